"""``Throttle``: knob checks, the choice of method and the measured span (one 2-rank DDP fit)."""

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_elche.testing as testing
from lightning_elche.testing import Throttle, green_context_sms


@pytest.mark.parametrize(
    ("kwargs", "knob"),
    [
        ({"rank": -1, "slowdown": 2.0}, "rank"),
        ({"rank": 0, "slowdown": 0.5}, "slowdown"),
        ({"rank": 0, "slowdown": 2.0, "method": "nap"}, "method"),
    ],
)
def test_bad_knobs_name_themselves(kwargs, knob):
    with pytest.raises(ValueError, match=f"Throttle\\({knob}="):
        Throttle(**kwargs)


def test_sleep_on_cpu_and_no_throttle_at_one():
    assert Throttle(0, 2.0)._resolve(torch.device("cpu")) == "sleep"
    assert Throttle(0, 1.0)._resolve(torch.device("cuda")) is None
    with pytest.raises(ValueError, match="needs a CUDA device"):
        Throttle(0, 2.0, method="sm_limit")._resolve(torch.device("cpu"))


def test_sm_limit_without_green_contexts_names_the_torch_version_and_the_alternative(monkeypatch):
    monkeypatch.setattr(testing, "_has_green_contexts", lambda: False)
    for method in ("auto", "sm_limit"):
        with pytest.raises(RuntimeError, match=r"torch\.cuda\.green_contexts.*method='sleep'"):
            Throttle(0, 2.0, method=method)._resolve(torch.device("cuda"))
    monkeypatch.setattr(testing, "_has_green_contexts", lambda: True)
    assert Throttle(0, 2.0)._resolve(torch.device("cuda")) == "sm_limit"


def test_green_context_sms_round_down_to_the_partition_granularity():
    assert green_context_sms(132, 2.2) == 56
    assert green_context_sms(132, 100.0) == 8


def test_sleep_slows_each_backward_of_a_batch_by_its_own_compute(monkeypatch):
    # A batch trained as three micro-batches: three backwards, 1 s of compute each on a fake clock.
    clock = [0.0]
    monkeypatch.setattr(testing.time, "perf_counter", lambda: clock[0])

    def sleep(seconds):
        clock[0] += seconds

    monkeypatch.setattr(testing.time, "sleep", sleep)
    throttle = Throttle(0, 3.0)
    throttle.active_method = "sleep"
    throttle.on_train_batch_start(None, None, None, 0)
    for _ in range(3):
        clock[0] += 1.0
        throttle.on_after_backward(None, None)
    assert throttle.sleep_s == pytest.approx(6.0)  # 3x slower: 2 s of pause per 1 s of compute
    assert clock[0] == pytest.approx(9.0)


class _WaitThenCompute(LightningModule):
    """``wait()`` before the child's forward (as Lightning DDP's buffer broadcast waits on the other
    ranks), ``compute()`` inside it."""

    def __init__(self, wait, compute=lambda: None) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.wait, self.compute = wait, compute

    def training_step(self, batch, batch_idx):
        self.wait()
        out = self.layer(batch[0])
        self.compute()
        return out.square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_wait_before_the_first_child_forward_is_not_slowed(monkeypatch):
    # Fake clock: 5 s of waiting, then 1 s of compute, per backward. Counting the wait made a rank
    # that waited on the others sleep (k - 1) x 6 s, and so wait longer on it next time.
    clock = [0.0]
    monkeypatch.setattr(testing.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(testing.time, "sleep", lambda seconds: clock.__setitem__(0, clock[0] + seconds))

    def advance(seconds):
        return lambda: clock.__setitem__(0, clock[0] + seconds)

    module = _WaitThenCompute(wait=advance(5.0), compute=advance(1.0))
    throttle = Throttle(0, 3.0)
    trainer = SimpleNamespace(global_rank=0, strategy=SimpleNamespace(root_device=torch.device("cpu")))
    throttle.setup(trainer, module, "fit")
    batch = (torch.randn(8, 4),)
    throttle.on_train_batch_start(trainer, module, batch, 0)
    for _ in range(2):  # two micro-batches of one batch, each waiting before its forward
        module.training_step(batch, 0).backward()
        throttle.on_after_backward(trainer, module)
    assert throttle.sleep_s == pytest.approx(4.0)  # 2 s of pause per 1 s of compute, the waits not counted
    throttle.teardown(trainer, module, "fit")
    assert not throttle._forward_hooks and throttle._grad_hook is None


def test_a_lightning_fit_does_not_slow_the_wait_before_the_forward():
    # Real time, a real fit: 0.1 s of waiting before each forward of a tiny layer (ms of compute).
    # Counted, each of the 4 steps would sleep >= 0.1 s at k = 2.
    steps, wait_s = 4, 0.1
    module = _WaitThenCompute(wait=lambda: time.sleep(wait_s))
    throttle = Throttle(0, 2.0)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        callbacks=[throttle],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    data = DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=8)
    trainer.fit(module, train_dataloaders=data)
    assert throttle.active_method == "sleep"
    assert 0.0 < throttle.sleep_s < steps * wait_s / 2


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_a_ddp_rank_waiting_in_the_buffer_broadcast_is_not_slowed_for_its_wait(tmp_path):
    # Rank 0 reaches each forward 0.2 s late; throttled rank 1 waits for it in DDP's pre-forward
    # buffer broadcast. Counted as compute (before the fix), rank 1 slept about 0.2 s per step.
    from multirank_helpers import clean_environment, free_port, run_together

    script = Path(__file__).resolve().parent / "scripts" / "throttle_wait_fit.py"
    port = str(free_port())
    commands = []
    for rank in range(2):
        env = {
            **clean_environment(),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "WORLD_SIZE": "2",
            "NODE_RANK": "0",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
        }
        commands.append(([sys.executable, str(script), str(tmp_path)], env))
    run_together(commands, tmp_path / "logs", timeout_s=120)
    record = json.loads((tmp_path / "rank1.json").read_text())
    assert record["method"] == "sleep"
    assert 0.0 < record["sleep_per_step_s"] < record["late_s"] / 4, record
