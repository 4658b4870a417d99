"""ElCheStrategy(micro_batch=...): ranks that train each batch in micro-batches (real 2-process fits
on gloo) and the pieces without processes: the knob's checks, the splitting, the accumulation
against Lightning's closure order, the "auto" search with an injected try."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple, Optional

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from micro_batch_helpers import MicroBatchCheckModel
from process_helpers import load_records
from torch import Tensor, nn

from lightning_elche import ElCheConfig, ElCheStrategy
from lightning_elche.loop_glue import logging_batch
from lightning_elche.micro_batch import (
    MicroBatching,
    MicroBatchSteps,
    UnsplittableBatchError,
    batch_length,
    split_batch,
)
from lightning_elche.micro_batch_auto import (
    NoMicroBatchFits,
    candidate_sizes,
    choose_micro_batch,
    choose_on_cuda,
    largest_fitting,
)

PG_TIMEOUT = timedelta(seconds=30)
N, B = 128, 8


def micro_fit(tmp_path: Path, elche: ElCheConfig, micro_batch: Any, **trainer_kwargs: Any) -> list[dict[str, Any]]:
    pl.seed_everything(0, verbose=False)
    model = MicroBatchCheckModel(str(tmp_path), n=N, batch_size=B, val=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, max_epochs=2, logger=False, enable_checkpointing=False, limit_val_batches=0,
        strategy=ElCheStrategy(elche=elche, micro_batch=micro_batch, start_method="spawn", timeout=PG_TIMEOUT),
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path), **trainer_kwargs,
    )
    trainer.fit(model)
    return load_records(tmp_path)


def lockstep(mode: str) -> ElCheConfig:
    """A setting whose weights do not depend on timing: lockstep counts, a fixed window, fixed shares."""
    if ElCheConfig(mode=mode).mode.is_sync:
        return ElCheConfig(mode=mode, max_batch_diff=0)
    return ElCheConfig(mode=mode, max_batch_diff=0, partition_ratios=[0.5, 0.5], anchor=3, min_anchor=3,
                       max_anchor=3, meta_controller=False, no_divergence_guard=True)


def assert_same_params(a: dict[str, Any], b: dict[str, Any], atol: float = 1e-5) -> None:
    for x, y in zip(a["params"], b["params"], strict=True):
        assert torch.allclose(torch.tensor(x), torch.tensor(y), atol=atol, rtol=0)


# (mode, accumulate_grad_batches, gradient_clip_val): every mode with and without accumulation, clipping
# in one of each pair; two in CI, the rest behind -m extended.
CI_CASES = [("nccl_sync", 1, None), ("cpu_cadence", 2, 0.05)]
MORE_CASES = [("nccl_sync", 2, 0.05), ("cpu_sync", 1, 0.05), ("cpu_sync", 2, None), ("nccl_cadence", 1, 0.05),
              ("nccl_cadence", 2, None), ("cpu_cadence", 1, None), ("cpu_async", 1, None), ("cpu_async", 2, 0.05)]
CASES = [pytest.param(*c, id="-".join(map(str, c))) for c in CI_CASES] + [
    pytest.param(*c, id="-".join(map(str, c)), marks=pytest.mark.extended) for c in MORE_CASES]


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("mode", "accumulate", "clip"), CASES)
def test_mixed_micro_batches_train_like_whole_batches(tmp_path: Path, mode: str, accumulate: int,
                                                      clip: Optional[float]) -> None:
    # Only the lockstep setting (a sync mode, max_batch_diff=0) reproduces the weights: the cadence
    # windows and the async rounds follow timing, so those modes are checked step by step (every
    # optimizer step's gradient and loss against the whole batches'), not against a second fit.
    deterministic = ElCheConfig(mode=mode).mode.is_sync
    kwargs = {"accumulate_grad_batches": accumulate, "gradient_clip_val": clip}
    (tmp_path / "whole").mkdir(), (tmp_path / "mixed").mkdir()
    whole = micro_fit(tmp_path / "whole", lockstep(mode), None, **kwargs) if deterministic else None
    mixed = micro_fit(tmp_path / "mixed", lockstep(mode), {1: 3}, **kwargs)
    batches = N // B // 2 * 2  # per rank: 8 batches an epoch, 2 epochs
    assert [r["checked_steps"] for r in mixed] == [batches // accumulate] * 2
    # Rank 1 ran 3 micro-batches (3 + 3 + 2 samples) per batch; rank 0 one training_step per batch.
    assert [r["step_calls"] for r in mixed] == [batches, 3 * batches]
    for r in mixed:
        assert r["grad_diff"] < 1e-5 and r["loss_diff"] < 1e-5, (r["grad_diff"], r["loss_diff"])
    for e in ("0", "1"):
        assert sorted(mixed[0]["seen"][e] + mixed[1]["seen"][e]) == list(range(N))
    if whole is not None:
        assert mixed[0]["params"] == mixed[1]["params"]
        assert mixed[0]["steps"] == whole[0]["steps"] and mixed[0]["rounds"] == whole[0]["rounds"]
        assert_same_params(whole[0], mixed[0])


# -- the knob ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -2, 1.5, True, "big", "", [], [4, 0], {0: 0}, {-1: 4}, {"a": 4}, {0: "x"}])
def test_bad_micro_batch_is_refused_naming_the_knob(value: Any) -> None:
    with pytest.raises(ValueError, match=r"ElCheStrategy\(micro_batch=.*\) is invalid: expected") as caught:
        ElCheStrategy(micro_batch=value)
    assert repr(value) in str(caught.value) and "a positive integer" in str(caught.value)
    with pytest.raises(ValueError, match=r"ElCheConfig.micro_batch=.* is invalid"):
        ElCheConfig(micro_batch=value)


@pytest.mark.parametrize(("value", "kept"), [
    (None, None), (4, 4), (np.int64(4), 4), ("auto", "auto"), ({1: 3}, {1: 3}), ({np.int64(0): "auto"}, {0: "auto"}),
    ([8, 3], [8, 3]), ((None, "auto"), [None, "auto"]),
])
def test_good_micro_batch_is_kept_as_plain_values(value: Any, kept: Any) -> None:
    assert ElCheStrategy(micro_batch=value).elche.micro_batch == kept
    assert ElCheConfig(micro_batch=value).micro_batch == kept
    assert type(ElCheConfig(micro_batch=value).micro_batch) is type(kept)


def test_a_rank_that_does_not_exist_is_refused_at_setup() -> None:
    ElCheConfig(micro_batch={1: 3}).validate_world_size(2)
    with pytest.raises(ValueError, match=r"ElCheStrategy\(micro_batch=\{2: 3\}\) is invalid: rank 2 does not exist"):
        ElCheConfig(micro_batch={2: 3}).validate_world_size(2)
    with pytest.raises(ValueError, match=r"micro_batch=\[8, 3, 2\]\) is invalid: expected one entry per rank: 2"):
        ElCheConfig(micro_batch=[8, 3, 2]).validate_world_size(2)


def test_the_same_knob_in_the_strategy_and_the_config_must_agree() -> None:
    assert ElCheStrategy(elche=ElCheConfig(micro_batch=4), micro_batch=4).elche.micro_batch == 4
    with pytest.raises(ValueError, match=r"ElCheStrategy\(micro_batch=2\) conflicts with elche.micro_batch=4"):
        ElCheStrategy(elche=ElCheConfig(micro_batch=4), micro_batch=2)


class FakeHost:
    """The strategy as MicroBatching sees it."""

    def __init__(self, module: Any = None, device: str = "cpu") -> None:
        self.global_rank = 1
        self.root_device = torch.device(device)
        self.lightning_module = module
        self.optimizers: list[Any] = []

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        closure_loss.backward()
        return closure_loss


def never_chosen(*args: Any) -> int:
    raise AssertionError("the auto search ran")


def test_a_micro_batch_larger_than_the_batch_is_refused_when_the_loader_is_known() -> None:
    with pytest.raises(ValueError, match=r"ElCheStrategy\(micro_batch=9\) on rank 1 is invalid: a micro-batch of 9 "
                                         r"samples is larger than the DataLoader's batch_size=8: expected at most 8"):
        MicroBatching(9, 8, FakeHost(), never_chosen, logging_batch)
    assert MicroBatching(8, 8, FakeHost(), never_chosen, logging_batch).steps is None  # the whole batch


def test_auto_on_a_cpu_rank_is_the_whole_batch() -> None:
    micro = MicroBatching("auto", 8, FakeHost(), never_chosen, logging_batch)
    assert micro.size == 8 and micro.steps is None
    assert choose_micro_batch(None, 8, FakeHost(nn.Linear(2, 1)), never_chosen) == 8


def test_lightning_cli_reads_micro_batch(tmp_path: Path, monkeypatch: Any) -> None:
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.demos.boring_classes import BoringModel

    monkeypatch.setattr("sys.argv", ["train.py"])
    config = tmp_path / "config.yaml"
    for text, expected in (("{1: 3}", {1: 3}), ("auto", "auto"), ("4", 4), ("[8, 2]", [8, 2])):
        config.write_text(
            "trainer:\n  accelerator: cpu\n  devices: 1\n  logger: false\n"
            "  strategy:\n    class_path: lightning_elche.ElCheStrategy\n"
            f"    init_args:\n      mode: cpu_cadence\n      micro_batch: {text}\n"
        )
        cli = LightningCLI(BoringModel, run=False, save_config_callback=None, seed_everything_default=False,
                           args=["--config", str(config)])
        assert isinstance(cli.trainer.strategy, ElCheStrategy)
        assert cli.trainer.strategy.elche.micro_batch == expected
    config.write_text(config.read_text().replace("[8, 2]", "0"))
    with pytest.raises((SystemExit, ValueError)):
        LightningCLI(BoringModel, run=False, save_config_callback=None, seed_everything_default=False,
                     args=["--config", str(config)])


# -- splitting --------------------------------------------------------------------------------------


class Pair(NamedTuple):
    x: Tensor
    y: Tensor


def test_batches_split_along_dim_0_keeping_their_containers() -> None:
    x, y = torch.arange(16.0).reshape(8, 2), torch.arange(8)
    batch = {"pair": Pair(x, y), "nested": [x, (y,)], "names": [f"s{i}" for i in range(8)], "scale": torch.tensor(2.0),
             "none": None}
    parts = split_batch(batch, 3)
    assert batch_length(batch) == 8 and [batch_length(p) for p in parts] == [3, 3, 2]
    assert isinstance(parts[0]["pair"], Pair) and isinstance(parts[0]["nested"][1], tuple)
    assert torch.equal(torch.cat([p["pair"].x for p in parts]), x)
    assert torch.equal(torch.cat([p["nested"][1][0] for p in parts]), y)
    assert sum((p["names"] for p in parts), []) == batch["names"]
    assert all(p["scale"] is batch["scale"] and p["none"] is None for p in parts)
    assert parts[2]["pair"].x.data_ptr() == x[6:].data_ptr()  # views, no copies
    assert [batch_length(p) for p in split_batch((x, y), 8)] == [8]


@pytest.mark.parametrize(("batch", "message"), [
    ((torch.zeros(8, 2), torch.zeros(7)), r"first dimensions differ \(\[7, 8\]\)"),
    ({"a": torch.tensor(1.0)}, "with no tensor of at least one dimension"),
    ((torch.zeros(8), object()), "holding a object"),
    ((torch.zeros(8), 3), "holding a int"),
])
def test_a_batch_that_cannot_be_split_is_refused(batch: Any, message: str) -> None:
    with pytest.raises(UnsplittableBatchError, match=message) as caught:
        split_batch(batch, 3)
    assert "micro_batch=None" in str(caught.value)


# -- accumulation against Lightning's closure ---------------------------------------------------------


def closure_like_lightning(model: nn.Module, batches: list[Tensor], targets: list[Tensor], accumulate: int,
                           micro: Optional[int], set_to_none: bool = True) -> tuple[list[Tensor], list[float]]:
    """Lightning's automatic optimization, step by step (training_step, zero_grad on an accumulation's
    first batch, the strategy's pre_backward, backward of loss / accumulate); the gradient at each
    optimizer step and the losses Lightning saw."""
    steps = MicroBatchSteps(micro, lambda: list(model.parameters())) if micro is not None else None
    grads, losses = [], []

    def step(part: Any) -> Tensor:
        x, y = part
        return nn.functional.mse_loss(model(x), y)

    for i, (x, y) in enumerate(zip(batches, targets, strict=True)):
        first = i % accumulate == 0
        if steps is not None:
            steps.batch_started(first)
            loss = steps.run((x, y), step, lambda loss: loss.backward(), accumulate)
        else:
            loss = step((x, y))
        if first:
            model.zero_grad(set_to_none=set_to_none)
        if steps is not None:
            steps.restore()
        (loss / accumulate).backward()
        losses.append(float(loss.detach()))
        if (i + 1) % accumulate == 0:
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    return grads, losses


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_micro_batches_give_the_whole_batch_gradient_and_loss(accumulate: int, set_to_none: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    batches = [torch.randn(8, 4) for _ in range(3)] + [torch.randn(5, 4)]  # a short last batch too
    targets = [torch.randn(len(b), 1) for b in batches]
    whole = closure_like_lightning(model, batches, targets, accumulate, None, set_to_none)
    for micro in (1, 3, 4, 7):
        split = closure_like_lightning(model, batches, targets, accumulate, micro, set_to_none)
        for a, b in zip(whole[0], split[0], strict=True):
            assert torch.allclose(a, b, atol=1e-6, rtol=0), micro
        assert split[1] == pytest.approx(whole[1], abs=1e-6)


def test_a_dict_output_carries_the_whole_loss_and_a_skipped_micro_batch_is_refused() -> None:
    model = nn.Linear(2, 1)
    steps = MicroBatchSteps(2, lambda: list(model.parameters()))
    batch = torch.randn(5, 2)
    out = steps.run(batch, lambda part: {"loss": model(part).mean(), "n": len(part)}, lambda loss: loss.backward(), 1)
    assert out["n"] == 1 and torch.allclose(out["loss"], model(batch).mean())
    steps.restore()
    with pytest.raises(RuntimeError, match="training_step returned NoneType for micro-batch 1 of 3"):
        steps.run(batch, lambda part: None, lambda loss: loss.backward(), 1)


def test_gradients_cleared_outside_an_accumulations_first_batch_are_caught() -> None:
    model = nn.Linear(2, 1)
    steps = MicroBatchSteps(2, lambda: list(model.parameters()))
    model(torch.randn(1, 2)).sum().backward()  # an accumulation in progress
    steps.batch_started(first_of_accumulation=False)
    steps.run(torch.randn(4, 2), lambda part: model(part).mean(), lambda loss: loss.backward(), 2)
    model.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match="cleared between training_step and backward"):
        steps.restore()


# -- the "auto" search ------------------------------------------------------------------------------


def test_auto_candidates_are_the_batch_then_powers_of_two_below_it() -> None:
    assert candidate_sizes(96) == [96, 64, 32, 16, 8, 4, 2, 1]
    assert candidate_sizes(64) == [64, 32, 16, 8, 4, 2, 1]
    assert candidate_sizes(3) == [3, 2, 1] and candidate_sizes(1) == [1]


def out_of_memory_above(limit: int, peak_per_sample: int = 10) -> tuple[Any, list[int]]:
    tried: list[int] = []

    def peak_of(size: int) -> int:
        tried.append(size)
        if size > limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory trying {size}")
        return size * peak_per_sample

    return peak_of, tried


def test_the_search_takes_the_largest_size_that_fits_within_the_budget() -> None:
    peak_of, tried = out_of_memory_above(40)
    assert largest_fitting(candidate_sizes(96), peak_of, budget=10**9) == 32
    assert tried == [96, 64, 32]
    peak_of, tried = out_of_memory_above(40)
    assert largest_fitting(candidate_sizes(96), peak_of, budget=200) == 16  # 32 fits but leaves no margin
    peak_of, tried = out_of_memory_above(0)
    assert largest_fitting(candidate_sizes(4), peak_of, budget=10**9) is None and tried == [4, 2, 1]


def test_other_errors_of_a_try_are_not_taken_for_out_of_memory() -> None:
    def broken(size: int) -> int:
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        largest_fitting([4, 2, 1], broken, budget=10**9)


class FakeTrial:
    def __init__(self, limit: int) -> None:
        self.module = nn.Linear(1000, 1000)  # 4 MB of trainable parameters
        self.limit = limit

    def peak(self, micro: Any) -> Optional[int]:
        return None if batch_length(micro) > self.limit else 2**20 * batch_length(micro)


def test_auto_picks_per_rank_and_a_card_without_room_for_one_sample_names_itself(monkeypatch: Any) -> None:
    import lightning_elche.micro_batch_auto as auto

    class Properties:
        total_memory = 16 * 2**30

    monkeypatch.setattr(auto, "usable_memory", lambda device: 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties())
    device = torch.device("cuda", 1)
    batch = (torch.zeros(64, 3),)
    first = lambda whole, size: split_batch(whole, size)[0]  # noqa: E731
    # Budget: 1 GiB less 10 % and two copies of the 4 MB of parameters (Adam's state, none yet).
    assert choose_on_cuda(batch, 64, 1, device, FakeTrial(40), False, first) == 32
    assert choose_on_cuda(batch, 64, 1, device, FakeTrial(2000), True, first) == 64
    with pytest.raises(NoMicroBatchFits, match=r"rank 3 on cuda:1 \(16.0 GiB, 1.00 GiB usable by this process\) "
                                               r"cannot train even a micro-batch of 1 sample"):
        choose_on_cuda(batch, 64, 3, device, FakeTrial(0), False, first)
