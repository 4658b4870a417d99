"""Mixed micro-batches through checkpoints (issue 24, item 3), in real processes (gloo): a fit whose
ranks split their batches differently saves mid-epoch, and a resume with another mapping, at
another world size or at the same one, trains every sample of the interrupted epoch exactly once;
in the lockstep setting (nccl_sync, ``max_batch_diff=0``, plain SGD) the resumed fit ends on the
uninterrupted fit's parameters, up to float accumulation order.

The sample bookkeeping is ``test_resume_resize.py``'s (``RecordSaves`` at each sync checkpoint,
``RecordingModel``'s per-epoch record); ``MicroBatchCheckModel`` counts the training_step calls,
so that a rank that silently trained whole batches fails the test.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import pytest
import torch
from micro_batch_helpers import MicroBatchCheckModel
from process_helpers import load_records
from resume_helpers import RecordSaves
from test_resume_resize import elche_state, saves_of_epoch, seen_in, trained_at
from test_strategy_distributed import PG_TIMEOUT

from lightning_elche import ElCheCheckpoint, ElCheConfig, ElCheStrategy

pytestmark = pytest.mark.distributed
N, B = 512, 16  # 32 batches an epoch: enough syncs in epoch 0 to save in its middle


def config_for(mode: str) -> ElCheConfig:
    if mode == "nccl_sync":
        return ElCheConfig(mode=mode, max_batch_diff=0)  # lockstep: the weights do not depend on timing
    return ElCheConfig(mode=mode, anchor=2, max_anchor=3)  # small windows: several syncs to save at


def run_fit(out_dir: Path, mode: str, ranks: int, micro_batch: Any, callbacks: list[Any],
            ckpt_path: Optional[Path] = None) -> list[dict[str, Any]]:
    """One epoch of ``ranks`` spawned processes (no throttle: a rank that splits is the slow one)."""
    out_dir.mkdir(exist_ok=True)
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=ranks, max_epochs=1, limit_val_batches=0,
        strategy=ElCheStrategy(elche=config_for(mode), micro_batch=micro_batch, start_method="spawn",
                               timeout=PG_TIMEOUT),
        callbacks=callbacks, enable_progress_bar=False,
        enable_model_summary=False, logger=False, enable_checkpointing=True, default_root_dir=str(out_dir),
    )
    model = MicroBatchCheckModel(str(out_dir), n=N, batch_size=B, val=False)
    trainer.fit(model, ckpt_path=None if ckpt_path is None else str(ckpt_path))
    return load_records(out_dir, ranks)


def sync_checkpoints(ckpt_dir: Path, every_n_syncs: int = 1) -> ElCheCheckpoint:
    return ElCheCheckpoint(dirpath=str(ckpt_dir), filename="{epoch}-{sync}", every_n_syncs=every_n_syncs,
                           save_top_k=-1, every_n_epochs=0)


def micro_of(micro_batch: dict[int, int], rank: int) -> int:
    return micro_batch.get(rank, B)


def assert_split_as_set(records: list[dict[str, Any]], micro_batch: dict[int, int]) -> None:
    """Each rank made ceil(n/m) training_step calls per batch of n samples it trained (a rank's last
    batch of an epoch split over 3 ranks holds fewer than B), and every optimizer step's gradient and
    loss were the whole batch's."""
    for r in records:
        sizes = r["batch_sizes"]
        assert sum(sizes) == sum(len(seen) for seen in r["seen"].values()) > 0
        micro = micro_of(micro_batch, r["rank"])
        assert r["step_calls"] == sum(math.ceil(n / micro) for n in sizes), (r["rank"], micro, sizes)
        assert r["grad_diff"] < 1e-5 and r["loss_diff"] < 1e-5, (r["grad_diff"], r["loss_diff"])


def middle_save(out_dir: Path, epoch: int, ranks: int) -> tuple[int, list[dict[str, Any]]]:
    saves = saves_of_epoch(out_dir, epoch, ranks)
    inside = {s: at for s, at in saves.items() if 0 < len(trained_at(at)) < N}
    assert inside, f"no sync checkpoint inside epoch {epoch} under {out_dir}: {sorted(saves)}"
    sync = sorted(inside)[len(inside) // 2]
    return sync, inside[sync]


# (mode, ranks before, mapping before, ranks after, mapping after): B=16 against 3 (5 + 1 micro-batches
# of 3 and one of 1) and 5 (three of 5 and one of 1); 4 divides it.
RESIZE_CASES = [
    ("cpu_cadence", 2, {1: 3}, 3, {0: 4, 2: 5}),
    *(pytest.param(*case, marks=pytest.mark.extended) for case in [
        ("nccl_cadence", 3, {1: 5, 2: 4}, 2, {0: 3}),
        ("cpu_async", 2, {0: 5, 1: 3}, 3, {1: 4}),
        ("nccl_sync", 3, {2: 3}, 2, {0: 5, 1: 4}),
    ]),
]


@pytest.mark.timeout(300)  # two fits, a few seconds each on an idle machine; spawning waits on a loaded one
@pytest.mark.parametrize(("mode", "before", "micro_before", "after", "micro_after"), RESIZE_CASES)
def test_mixed_micro_batches_resume_mid_epoch_on_another_world_size_exactly_once(
        tmp_path: Path, mode: str, before: int, micro_before: dict[int, int], after: int,
        micro_after: dict[int, int]) -> None:
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    records = run_fit(first, mode, before, micro_before, [RecordSaves(str(first)), sync_checkpoints(tmp_path / "c")])
    assert sorted(seen_in(records, 0)) == list(range(N))
    assert_split_as_set(records, micro_before)
    sync, at_save = middle_save(first, 0, before)
    trained_before = trained_at(at_save)
    path = tmp_path / "c" / f"epoch=0-sync={sync}.ckpt"
    coverage = elche_state(path)["coverage"]
    assert coverage["world_size"] == before
    assert sum(b - a for a, b in coverage["remaining"]) == N - len(trained_before)

    after_records = run_fit(resumed, mode, after, micro_after, [], ckpt_path=path)
    assert_split_as_set(after_records, micro_after)
    # The interrupted epoch: before the save on W ranks, after the resume on W' ranks, every sample once.
    assert sorted(trained_before + seen_in(after_records, 0)) == list(range(N))
    assert all(r["seen"].get("0") for r in after_records), "a rank of the new world trained nothing"
    assert all(r["params"] == after_records[0]["params"] for r in after_records)


def max_difference(a: list[list[float]], b: list[list[float]]) -> float:
    return max(float((torch.tensor(x) - torch.tensor(y)).abs().max()) for x, y in zip(a, b, strict=True))


@pytest.mark.timeout(300)
@pytest.mark.extended  # CI resumes with micro-batches once (at another world size, above)
@pytest.mark.parametrize(("micro_before", "micro_after"), [({1: 3}, {0: 5}), ({0: 4, 1: 5}, {1: 3})])
def test_a_same_size_resume_with_other_micro_batches_ends_on_the_uninterrupted_parameters(
        tmp_path: Path, micro_before: dict[int, int], micro_after: dict[int, int]) -> None:
    mode = "nccl_sync"
    uninterrupted, resumed = tmp_path / "uninterrupted", tmp_path / "resumed"
    whole = run_fit(uninterrupted, mode, 2, micro_before,
                    [RecordSaves(str(uninterrupted)), sync_checkpoints(tmp_path / "c", every_n_syncs=4)])
    assert_split_as_set(whole, micro_before)
    sync, at_save = middle_save(uninterrupted, 0, 2)
    trained_before = trained_at(at_save)
    records = run_fit(resumed, mode, 2, micro_after, [], ckpt_path=tmp_path / "c" / f"epoch=0-sync={sync}.ckpt")
    assert_split_as_set(records, micro_after)
    assert sorted(trained_before + seen_in(records, 0)) == list(range(N))
    assert records[0]["params"] == records[1]["params"]
    assert records[0]["rounds"] == whole[0]["rounds"]
    # The same batches in the same steps; only the micro-batches' float accumulation order differs.
    difference = max_difference(records[0]["params"], whole[0]["params"])
    assert difference < 1e-5, difference
    assert max_difference(records[0]["params"], at_save[0]["params"]) > 1e-3  # the resumed fit did train
