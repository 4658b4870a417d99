"""Real CPU jobs in which ranks are lost, and the checks of what the survivors promise.

A job is ``tests/scripts/fault_fit.py`` run to its end (gloo, Lightning's popen launcher), with
faults ``KIND:RANK:STEP[:EPOCH]`` injected into chosen ranks. :func:`check_survived` checks a job
whose losses stayed under ``max_failure``; :func:`check_saving_stop` one that reached it. Shared by
``test_rank_loss.py`` (chosen faults), ``test_soak.py`` (random ones) and the tests that build on
them; the job's size (ranks, samples, epochs) travels with the :class:`Job`.
"""

from __future__ import annotations

import json
import secrets
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from multirank_helpers import (
    LAUNCH_TAG,
    clean_environment,
    end_launch,
    launch_logged,
    rank_results,
    tagged_processes,
    wait_for_launch,
)

SCRIPT = Path(__file__).parent / "scripts" / "fault_fit.py"
MODES = ("nccl_sync", "nccl_cadence", "cpu_sync", "cpu_cadence", "cpu_async")
SAMPLES, BATCH, RANKS, EPOCHS = 480, 8, 3, 3
"""A job's default size."""
VAL_SAMPLES = 96
"""The validation set of ``fault_fit.py`` (fixed there)."""


@dataclass
class Job:
    out: Path
    returncode: int
    log: str
    results: dict[int, dict[str, Any]]  # by original rank, the ranks that finished
    ranks: int
    leftover: list[int]
    elapsed_s: float
    samples: int = SAMPLES
    epochs: int = EPOCHS


STORE_PORT_TAKEN = "job store could not start on"
"""What rank 0 says when the job's store port is in use (``job_store.start_host``)."""


def run_job(out: Path, mode: str, faults: list[str], max_failure: Optional[str] = None,
            liveness_s: float = 5.0, timeout_s: float = 150.0, ranks: int = RANKS, accelerator: str = "cpu",
            epochs: int = EPOCHS, samples: int = SAMPLES, extra: tuple[str, ...] = ()) -> Job:
    """Run the job to its end (rank 0's process and every process it started, whichever ends last)."""
    out.mkdir(parents=True, exist_ok=True)
    tag = secrets.token_hex(8)
    command = [sys.executable, str(SCRIPT), str(out), "--mode", mode, "--devices", str(ranks), "--accelerator",
               accelerator, "--epochs", str(epochs), *extra, "--samples", str(samples), "--batch-size", str(BATCH),
               "--liveness", str(liveness_s)]
    for fault in faults:
        command += ["--fault", fault]
    if max_failure is not None:
        command += ["--max-failure", max_failure]
    log_path = out / "job.log"
    for attempt in range(2):
        started = time.monotonic()
        proc = launch_logged(command, {**clean_environment(), LAUNCH_TAG: tag}, log_path)
        try:
            wait_for_launch(proc, tag, log_path, timeout_s)  # rank 0 may be the rank that was lost
            elapsed = time.monotonic() - started
            leftover = tagged_processes(tag)
        finally:
            end_launch([proc], tag)
        # The free port this harness picked was taken before the job's store bound it (soak trial
        # 0.071, eight jobs starting at once): the job refused to start, as it should; start it
        # again on another port. Nothing ran, so nothing is hidden.
        if attempt == 0 and STORE_PORT_TAKEN in log_path.read_text() and not fired_faults(out):
            shutil.rmtree(out)
            out.mkdir(parents=True)
            continue
        break
    results = rank_results(out)
    return Job(out, proc.returncode, log_path.read_text(), results, ranks, leftover, elapsed, samples, epochs)


def records(out: Path, rank: int) -> list[dict[str, Any]]:
    path = out / f"steps-rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def fired_faults(out: Path) -> dict[int, dict[str, Any]]:
    """The faults that fired, by original rank: the record each faulty rank wrote just before acting."""
    return {int(p.stem.removeprefix("fault-rank")): json.loads(p.read_text()) for p in out.glob("fault-rank*.json")}


def consensus_samples(job: Job, lost: dict[int, tuple[int, int]]) -> dict[int, list[int]]:
    """Per epoch, every sample index in the consensus: all a survivor trained, and of a lost rank
    the epochs before the one it was lost in, plus that epoch's first ``trained_batches`` batches.

    ``lost``: original rank -> (epoch it was lost in, its batches of that epoch in the consensus)."""
    by_epoch: dict[int, list[int]] = {}
    for rank in range(job.ranks):
        for epoch, batch, row in numbered_batches(records(job.out, rank)):
            if rank in lost:
                lost_epoch, kept = lost[rank]
                if epoch > lost_epoch or (epoch == lost_epoch and batch >= kept):
                    continue
            by_epoch.setdefault(epoch, []).extend(row["indices"])
    return by_epoch


def numbered_batches(rows: list[dict[str, Any]]) -> list[tuple[int, int, dict[str, Any]]]:
    """``(epoch, batch number in the epoch, row)`` of a rank's step rows: consecutive rows of one
    ``batch_idx`` are the micro-batches of one batch (a row without it is a batch)."""
    numbered: list[tuple[int, int, dict[str, Any]]] = []
    counted: dict[int, int] = {}
    previous: Optional[tuple[int, Any]] = None
    for row in rows:
        epoch = int(row["epoch"])
        key = (epoch, row.get("batch_idx", object()))
        if key != previous:
            counted[epoch] = counted.get(epoch, 0) + 1
        previous = key
        numbered.append((epoch, counted[epoch] - 1, row))
    return numbered


def csv_rows(out: Path) -> list[dict[str, str]]:
    import csv

    path = out / "csv" / "version_0" / "metrics.csv"
    with open(path) as handle:
        return list(csv.DictReader(handle))


def agreed(result: dict[str, Any]) -> list[dict[str, Any]]:
    """What the survivors must agree on about the losses (each notes its own detection time)."""
    return [{k: v for k, v in loss.items() if k != "detected_at"} for loss in result["losses"]]


EPOCH_END_PHASES = ("epoch_end_log", "epoch_end_callback", "checkpoint_save", "train_end_callback",
                    "train_end_buffers")
"""Where ``fault_fit.py --epoch-end-fault`` strikes at a training epoch's end (after its validation)."""


def padded_validation(world_size: int, samples: int = VAL_SAMPLES) -> int:
    """Samples a validation epoch visits on ``world_size`` ranks: Lightning's ``DistributedSampler``
    pads every shard to ``ceil(samples / world_size)`` (repeating the first samples) when the set
    does not divide evenly; ElChe re-shards validation over the survivors the same way."""
    return -(-samples // world_size) * world_size


def check_survived(job: Job, lost_ranks: set[int]) -> None:
    """The acceptance checks of a job whose lost ranks stay under max_failure."""
    assert not job.leftover, f"processes left behind: {job.leftover}\n{job.log[-3000:]}"
    survivors = sorted(set(range(job.ranks)) - lost_ranks)
    assert sorted(job.results) == survivors, f"finished: {sorted(job.results)}, expected {survivors}\n{job.log[-4000:]}"
    first = job.results[survivors[0]]
    # A rank lost at the last epoch's end (a reduce, a callback, the save) was lost after the fit's
    # last validation, which it took part in.
    after_last_validation = {rank for rank, record in fired_faults(job.out).items() if rank in lost_ranks
                             and record.get("phase") in EPOCH_END_PHASES and int(record["epoch"]) == job.epochs - 1}
    for rank in survivors:
        result = job.results[rank]
        assert result["world_size"] == len(survivors)
        assert result["global_rank"] == survivors.index(rank), "survivors renumber densely, in original order"
        assert result["is_global_zero"] == (result["global_rank"] == 0)
        assert result["params"] == first["params"], f"rank {rank}'s parameters differ from rank {survivors[0]}'s"
        assert agreed(result) == agreed(first), "every survivor saw the same losses"
        assert result["val_count"] == padded_validation(len(survivors) + len(after_last_validation)), (
            "validation covers the whole validation set after renumbering")
    # Rank-zero-only work follows rank 0: the epoch-end checkpoint and the logger's rows after the loss.
    last = torch.load(job.out / "ckpt" / "last.ckpt", weights_only=False, map_location="cpu")
    assert last["epoch"] == job.epochs - 1 and last["elche"]["rounds"] > 0
    alive = [float(row["elche/alive"]) for row in csv_rows(job.out) if row.get("elche/alive")]
    # From the first logged sync (a killed rank 0 takes the rows it had not flushed with it; an early
    # fault comes before any), the count only falls, to the survivors; a rank lost in the last
    # validation of the fit, or at its last epoch's end, left no sync after it to log the smaller count.
    after_last_sync = {rank for rank, record in fired_faults(job.out).items()
                       if record.get("phase") not in (None, "sanity") and int(record["epoch"]) == job.epochs - 1}
    final = len(survivors) + len(after_last_sync & lost_ranks)
    if not alive:
        # Only a logger lost with its unflushed rows leaves none: rank 0, and after it the rank that
        # took its place, lost before anything was flushed.
        assert 0 in lost_ranks, f"no elche/alive logged, yet rank 0 survived\n{job.log[-3000:]}"
    else:
        assert alive[-1] == final, f"elche/alive logged: {alive}, expected it to end at {final}"
    assert alive == sorted(alive, reverse=True) and set(alive) <= set(range(len(survivors), job.ranks + 1)), alive
    reported = {r for loss in first["losses"] for r in loss["lost"]}
    assert reported == lost_ranks, f"reported lost {reported}, expected {lost_ranks}"
    faults = fired_faults(job.out)
    lost: dict[int, tuple[int, int]] = {}
    for loss in first["losses"]:
        for rank in loss["lost"]:
            lost[rank] = (int(faults[rank]["epoch"]), int(loss["trained_batches"][str(rank)]))
    trained = consensus_samples(job, lost)
    assert sorted(trained) == list(range(job.epochs))
    for epoch, indices in trained.items():
        counts = torch.bincount(torch.tensor(indices), minlength=job.samples)
        missing, twice = int((counts == 0).sum()), int((counts > 1).sum())
        assert missing == 0 and twice == 0, (f"epoch {epoch}: {missing} samples never trained, {twice} twice; "
                                             f"{where_trained(job, epoch, counts, lost)}")


def where_trained(job: Job, epoch: int, counts: torch.Tensor, lost: dict[int, tuple[int, int]]) -> str:
    """Who recorded training the samples of ``epoch`` that are not in the consensus exactly once: a
    lost rank's batch past its consensus point, or nobody (never handed out), or several ranks."""
    wrong = [int(i) for i in torch.nonzero(counts != 1).flatten()]
    trainers: dict[int, list[str]] = {i: [] for i in wrong}
    batches = {}
    for rank in range(job.ranks):
        rows = [(ordinal, row) for e, ordinal, row in numbered_batches(records(job.out, rank)) if e == epoch]
        batches[rank] = rows[-1][0] + 1 if rows else 0
        for ordinal, row in rows:
            for index in set(row["indices"]) & set(trainers):
                trainers[index].append(f"rank {rank} batch {ordinal}")
    shown = "; ".join(f"{i}: {', '.join(trainers[i]) or 'nobody'}" for i in wrong[:12])
    return f"records of the epoch by rank {batches}, lost (epoch, kept batches) {lost}; {shown}"


def check_saving_stop(job: Job, max_failure: str) -> None:
    """The acceptance checks of a job that reached ``max_failure``: every survivor saves a consensus
    checkpoint and fails with ``RanksLost``; none finishes the fit; nothing is left running."""
    assert not job.leftover, f"processes left behind: {job.leftover}\n{job.log[-3000:]}"
    assert fired_faults(job.out), f"no fault fired, so max_failure could not be reached\n{job.log[-3000:]}"
    assert job.returncode != 0, "the survivor must exit non-zero when max_failure is reached"
    assert not job.results, f"no rank may finish the fit normally: {sorted(job.results)} did\n{job.log[-4000:]}"
    assert "RanksLost" in job.log and f"max_failure={max_failure} reached" in job.log, job.log[-4000:]
    checkpoint = torch.load(job.out / "ckpt" / "last-ranks-lost.ckpt", weights_only=False, map_location="cpu")
    # A limit reached before the first round (a loss in the sanity check) saves the untrained start.
    rounds, step = checkpoint["elche"]["rounds"], checkpoint["global_step"]
    assert rounds > 0 or (step == 0 and checkpoint["elche"]["cohort_step"] == 0), (rounds, step)
