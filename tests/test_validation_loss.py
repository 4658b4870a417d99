"""Survive a rank lost while the cohort validates: real 3-rank CPU jobs (gloo, Lightning's popen
launcher) in which a rank is killed (-9), stopped (SIGSTOP), raises or exits in ``validation_step``
at a chosen validation batch, after a training epoch or in the sanity check.

Every run checks what :mod:`test_rank_loss` checks of any loss (the survivors finish every epoch,
renumbered, with identical parameters; every training sample once in the consensus; validation
whole; no process left) and, of every validation each survivor finished: it ran once per epoch on
the survivors after the loss, its synced sums count every validation sample once, and its synced
squared error is the whole validation set's under the parameters it validated.

CI runs a representative subset; every mode x every fault x both phases is marked ``faults``.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from fault_jobs import EPOCHS, MODES, VAL_SAMPLES, Job, check_survived, csv_rows, run_job
from multirank_helpers import IndexedSamples
from torch import nn

pytestmark = pytest.mark.distributed

VAL_INDEX_SUM = VAL_SAMPLES * (VAL_SAMPLES - 1) // 2
VAL_BATCHES_PER_RANK = VAL_SAMPLES // 8 // 3  # batches of 8, 3 ranks before the loss


def validation_records(job: Job, rank: int) -> list[dict[str, Any]]:
    path = job.out / f"val-rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def whole_set_squared_error(params: list[list[float]]) -> float:
    """The validation set's summed squared error under ``params`` (the script's model)."""
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    with torch.no_grad():
        for tensor, values in zip(net.parameters(), params, strict=True):
            tensor.copy_(torch.tensor(values, dtype=tensor.dtype).view_as(tensor))
        data = IndexedSamples(VAL_SAMPLES)
        return float(((net(data.x) - data.y) ** 2).sum())


def check_validations(job: Job, lost: set[int], fault_epoch: Optional[int], sanity: bool) -> None:
    """Each survivor's validations: one per epoch (and one sanity check), whole and correct, the one of
    the loss and every later one on the survivors only."""
    survivors = sorted(set(range(job.ranks)) - lost)
    for rank in survivors:
        seen = validation_records(job, rank)
        kinds = [("sanity", None) if r["sanity"] else ("epoch", r["epoch"]) for r in seen]
        expected = ([("sanity", None)] if sanity else []) + [("epoch", e) for e in range(EPOCHS)]
        assert kinds == expected, f"rank {rank} finished the validations {kinds}, expected {expected} (each once)"
        for number, record in enumerate(seen):
            metrics = record["metrics"]
            where = f"rank {rank}, {kinds[number]}"
            assert metrics["val_count"] == VAL_SAMPLES, f"{where}: counted {metrics['val_count']}"
            assert metrics["val_index_sum"] == VAL_INDEX_SUM, f"{where}: a sample missing or counted twice"
            whole = whole_set_squared_error(record["params"])
            assert math.isclose(metrics["val_sq_err"], whole, rel_tol=1e-4), (
                f"{where}: logged squared error {metrics['val_sq_err']}, the whole set gives {whole}")
            after_loss = sanity or (record["epoch"] >= (fault_epoch or 0) and not record["sanity"])
            assert record["world_size"] == (len(survivors) if after_loss else job.ranks), where
    # What rank 0 logged (the new rank 0 after a loss of rank 0): the validation of the loss, once.
    if fault_epoch is not None:
        rows = [row for row in csv_rows(job.out) if row.get("val_count") and int(row["epoch"]) == fault_epoch]
        assert len(rows) == 1 and float(rows[0]["val_count"]) == VAL_SAMPLES, rows
        assert float(rows[0]["val_index_sum"]) == VAL_INDEX_SUM, rows


def run_validation_case(tmp_path: Path, mode: str, kind: str, rank: int, batch: int, epoch: Optional[int]) -> Job:
    where = "sanity" if epoch is None else str(epoch)
    extra = ("--val-fault", f"{kind}:{rank}:{batch}:{where}", "--sanity-steps", "-1" if epoch is None else "0")
    job = run_job(tmp_path, mode, [], extra=extra)
    check_survived(job, {rank})
    fault = json.loads((tmp_path / f"fault-rank{rank}.json").read_text())
    assert fault["phase"] == ("sanity" if epoch is None else "validation"), fault
    check_validations(job, {rank}, epoch, sanity=epoch is None)
    return job


CI_CASES = [("nccl_cadence", "kill", 1, 2, 0), ("cpu_async", "raise", 0, 1, None)]


@pytest.mark.parametrize(("mode", "kind", "rank", "batch", "epoch"), CI_CASES)
def test_survivors_validate_again_after_a_rank_lost_in_validation(tmp_path: Path, mode: str, kind: str, rank: int,
                                                                   batch: int, epoch: Optional[int]) -> None:
    run_validation_case(tmp_path, mode, kind, rank, batch, epoch)


KINDS = ("kill", "stop", "raise", "exit")


def spread(n: int) -> list[tuple[int, int, Optional[int]]]:
    """Case ``n``'s lost rank, validation batch and phase: once after a training epoch, once in the sanity check."""
    return [(n % 3, n % VAL_BATCHES_PER_RANK, n % 2), ((n + 1) % 3, (n + 2) % VAL_BATCHES_PER_RANK, None)]


FULL_CASES = [
    (mode, kind, rank, batch, epoch)
    for n, (mode, kind) in enumerate((mode, kind) for mode in MODES for kind in KINDS)
    for rank, batch, epoch in spread(n)
    if (mode, kind, rank, batch, epoch) not in CI_CASES
]


@pytest.mark.faults
@pytest.mark.parametrize(("mode", "kind", "rank", "batch", "epoch"), FULL_CASES)
def test_every_mode_survives_every_fault_in_validation(tmp_path: Path, mode: str, kind: str, rank: int, batch: int,
                                                        epoch: Optional[int]) -> None:
    run_validation_case(tmp_path, mode, kind, rank, batch, epoch)


@pytest.mark.faults
@pytest.mark.parametrize("seed", range(8))
def test_a_validation_fault_at_a_random_point(tmp_path: Path, seed: int) -> None:
    chooser = random.Random(seed)
    epoch = chooser.choice([0, 1, None])
    run_validation_case(tmp_path, chooser.choice(MODES), chooser.choice(KINDS), chooser.randrange(3),
                        chooser.randrange(VAL_BATCHES_PER_RANK), epoch)


@pytest.mark.faults
@pytest.mark.parametrize("epoch", [0, None])
def test_max_failure_reached_in_validation_saves_the_consensus_and_stops_every_survivor(tmp_path: Path,
                                                                                       epoch: Optional[int]) -> None:
    where = "sanity" if epoch is None else str(epoch)
    job = run_job(tmp_path, "cpu_cadence", [], max_failure="1",
                  extra=("--val-fault", f"kill:2:1:{where}", "--sanity-steps", "-1" if epoch is None else "0"))
    assert not job.leftover, f"processes left behind: {job.leftover}"
    assert job.returncode != 0, "the survivors must exit non-zero when max_failure is reached"
    assert not job.results, "no rank may finish the fit normally"
    assert "RanksLost" in job.log and "max_failure=1 reached while evaluating: lost rank 2" in job.log, job.log[-4000:]
    checkpoint = torch.load(tmp_path / "ckpt" / "last-ranks-lost.ckpt", weights_only=False, map_location="cpu")
    assert checkpoint["epoch"] == 0
    assert (checkpoint["elche"]["rounds"] > 0) == (epoch is not None), "saved where the loss was"


# -- a rank alive but stuck in validation: found by its own evaluation steps (membership/stall.py) --

STALL_FLOOR_S = 8.0  # fault_fit.py --stall-floor: the stuck rank's short steps give it this bound


def run_validation_stall(tmp_path: Path, mode: str, rank: int, batch: int, epoch: Optional[int]) -> Job:
    # An endless loop inside validation_step after some evaluation steps of this fit (the rank's
    # bound comes from them); its heartbeat goes on. The peers wait for it in the epoch-end
    # sync_dist reduce, witness its stillness for the bound, and survive it like a silent rank.
    # epoch None: in the sanity check (over the whole set; its first step is the fit's first, not judged).
    where = "sanity" if epoch is None else str(epoch)
    extra = ("--val-fault", f"loop:{rank}:{batch}:{where}", "--stall-floor", str(STALL_FLOOR_S),
             "--sanity-steps", "-1" if epoch is None else "0")
    job = run_job(tmp_path, mode, [], extra=extra, timeout_s=200.0)
    check_survived(job, {rank})
    fault = json.loads((tmp_path / f"fault-rank{rank}.json").read_text())
    assert fault["phase"] == ("sanity" if epoch is None else "validation") and fault["kind"] == "loop", fault
    check_validations(job, {rank}, epoch, sanity=epoch is None)
    for result in job.results.values():
        (loss,) = result["losses"]
        reason = loss["reasons"][str(rank)]
        assert reason.startswith("stalled: ") and "in its evaluation step" in reason, reason
        detect_s = float(loss["detected_at"]) - float(fault["time"])
        print(f"{mode}: rank {rank} found stalled in validation {detect_s:.2f} s after the fault ({reason})")
        assert STALL_FLOOR_S - 1.0 <= detect_s < 60.0, f"found {detect_s:.1f} s after the fault"
    return job


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("mode", "rank", "batch", "epoch"), [
    # All under faults (CI's time): CI's stuck-rank case is the training one in test_rank_loss.py.
    pytest.param("nccl_cadence", 1, 2, 1, marks=pytest.mark.faults),
    *(pytest.param(mode, rank, batch, epoch, marks=pytest.mark.faults)
      for mode, rank, batch, epoch in [("cpu_async", 2, 1, 0), ("nccl_sync", 0, 3, 1), ("cpu_sync", 1, 0, 2),
                                       ("cpu_cadence", 0, 2, 0), ("cpu_async", 1, 1, None)]),
])
def test_a_rank_stuck_in_validation_step_is_found_by_its_own_speed(tmp_path: Path, mode: str, rank: int, batch: int,
                                                                   epoch: Optional[int]) -> None:
    run_validation_stall(tmp_path, mode, rank, batch, epoch)


@pytest.mark.faults
@pytest.mark.timeout(300)
def test_a_rank_ten_times_slower_in_validation_is_not_flagged(tmp_path: Path) -> None:
    # Rank 1 sleeps 5 s in each validation step, its peers' steps take milliseconds: they wait
    # 20 s for it at every validation's reduce. A bound not derived from its own steps (the 4 s
    # floor) would flag it; its own (2 x 5 s + 2 s) does not.
    extra = ("--val-delay", "1:5.0", "--stall-floor", "4.0")
    job = run_job(tmp_path, "nccl_cadence", [], extra=extra, epochs=2, timeout_s=200.0)
    assert sorted(job.results) == [0, 1, 2], job.log[-3000:]
    assert all(not result["losses"] for result in job.results.values()), [r["losses"] for r in job.results.values()]
    assert not job.leftover
