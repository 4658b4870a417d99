"""A fault-injection soak, torchft-style: many short real CPU jobs, each with random faults.

Each trial is drawn from ``random.Random(f"{seed}:{index}")`` (so trial ``k`` of a seed is the same
whatever the soak's size): a mode (all five), 3 to 8 ranks (mostly 3 to 5), one or two faults on
distinct random ranks (``kill``, ``stop``, ``raise``, ``exit``, ``oom``, and at a lower rate the
stalls ``loop`` and ``sleep_in_collective`` with a short ``--stall-floor``), each at a random
step of a random epoch: in the first windows, anywhere, or late in an epoch (the last included).
A second fault comes a step or two after the first (most often the same window) or anywhere else
(another window). Some trials set ``max_failure`` at or below the number of faults.

A trial whose fired faults (the records the faulty ranks wrote just before acting; a late step on
a slow rank may never come) reached ``max_failure`` must end in the saving stop
(:func:`fault_jobs.check_saving_stop`); any other must survive (:func:`fault_jobs.check_survived`:
the survivors finish, renumbered densely, identical replicas, every sample exactly once in the
consensus, no process left; with no fault fired, every rank finishes). A rank that raised is
reported with its error; a stalled rank, when it is the only fault, as stalled.

The training faults come before an optimizer step (a stalled rank's collective is the next
round's). A quarter of the trials also lose one more rank at a random batch of a validation epoch or
of the sanity check (:func:`draw_validation_fault`; a quarter of those by an endless loop inside
``validation_step``, :func:`validation_stall`), and a quarter lose one more at a random
epoch's end: in the module's ``sync_dist`` log, in a callback's own collectives or in the epoch's
checkpoint save (:func:`draw_epoch_end_fault`). Both are drawn after everything else, so that the
training faults of a trial are those it had before they were added (CI's fixed trials draw
neither).

The full soak is marked ``faults``; ``ELCHE_SOAK_TRIALS`` (default 240), ``ELCHE_SOAK_FIRST``
(default 0: the first trial's index, to split a soak over several runs) and ``ELCHE_SOAK_SEED``
(default 0) set its size and draw, ``ELCHE_SOAK_RANKS`` (unset: drawn) fixes every trial's rank count
(a soak at 8 or more ranks on a machine with the cores), and with ``ELCHE_SOAK_REPORT=path`` every
trial appends one JSON line there (``tools/soak_report.py`` totals them). CI runs a few fixed 3-rank trials.

    ELCHE_SOAK_TRIALS=240 ELCHE_SOAK_SEED=0 ELCHE_SOAK_REPORT=soak.jsonl pytest -m faults tests/test_soak.py -n 8
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import pytest
from fault_jobs import (
    BATCH,
    EPOCH_END_PHASES,
    MODES,
    Job,
    check_saving_stop,
    check_survived,
    fired_faults,
    run_job,
)

pytestmark = pytest.mark.distributed

EXITS = ("kill", "stop", "raise", "exit", "oom")
STALLS = ("loop", "sleep_in_collective")
KIND_WEIGHTS = {**dict.fromkeys(EXITS, 3), **dict.fromkeys(STALLS, 1)}
RANK_WEIGHTS = {3: 4, 4: 3, 5: 3, 6: 1, 7: 1, 8: 1}
PER_RANK_BATCHES = 20
"""Batches per rank and epoch (an even share; the samples grow with the ranks)."""
STALL_FLOOR_S = 8.0
"""``--stall-floor`` of a trial with a stall: its bound comes to the floor (short windows)."""
RAISED = {"raise": "RuntimeError", "oom": "OutOfMemoryError"}
"""The error a raising kind's survivors report (its failure notice)."""


@dataclass(frozen=True)
class Trial:
    seed: str
    index: int
    mode: str
    ranks: int
    epochs: int
    faults: tuple[str, ...]  # KIND:RANK:STEP:EPOCH
    max_failure: Optional[int]
    val_faults: tuple[str, ...] = ()  # KIND:RANK:BATCH:EPOCH|sanity (fault_fit.py's --val-fault)
    epoch_end_faults: tuple[str, ...] = ()  # KIND:RANK:PHASE:EPOCH (fault_fit.py's --epoch-end-fault)

    @property
    def samples(self) -> int:
        return PER_RANK_BATCHES * BATCH * self.ranks

    @property
    def kinds(self) -> list[str]:
        return [fault.split(":")[0] for fault in (*self.faults, *self.val_faults, *self.epoch_end_faults)]

    @property
    def sanity_steps(self) -> int:
        return 2 if any(fault.endswith(":sanity") for fault in self.val_faults) else 0

    @property
    def name(self) -> str:
        return f"{self.seed}.{self.index:03d}-{self.mode}-{self.ranks}r-{'+'.join(self.kinds)}" + (
            "-val" if self.val_faults else "") + ("-epochend" if self.epoch_end_faults else "") + (
            f"-max{self.max_failure}" if self.max_failure is not None else "")


def fault_place(chooser: random.Random, kind: str, epochs: int) -> tuple[int, int]:
    """``(epoch, step of that epoch)`` for a fault: the first windows, anywhere, or late in an epoch."""
    where = chooser.choices(("first", "anywhere", "late"), weights=(1, 2, 1))[0]
    if where == "first":
        epoch, step = 0, chooser.randint(0, 5)
    elif where == "anywhere":
        epoch, step = chooser.randrange(epochs), chooser.randrange(int(0.6 * PER_RANK_BATCHES))
    else:  # a slow rank of a cadence mode may never reach it: then the fault does not fire
        epoch = epochs - 1 if chooser.random() < 0.5 else chooser.randrange(epochs)
        step = chooser.randrange(int(0.6 * PER_RANK_BATCHES), PER_RANK_BATCHES)
    return epoch, step


def after_first_round(kind: str, epoch: int, step: int) -> int:
    """A stall's step: a stalled rank has a bound from its first round on (docs/failures.md), after
    the two 2-step calibration windows."""
    return max(step, 4) if kind in STALLS and epoch == 0 else step


VALIDATION_SHARE = 0.25
"""Trials that also lose a rank in a validation epoch or the sanity check (docs/failures.md)."""
VAL_BATCHES = 12  # fault_fit.py's 96 validation samples in batches of 8


def draw_validation_fault(chooser: random.Random, ranks: int, taken: set[int], epochs: int) -> Optional[str]:
    """A fault in the validation after a random epoch, or in the sanity check, on a rank no training
    fault names; drawn after everything else, so a trial's training faults are the same with or
    without it."""
    if chooser.random() >= VALIDATION_SHARE:
        return None
    free = [rank for rank in range(ranks) if rank not in taken]
    if len(free) < 2:
        return None  # one rank must survive every fault
    kind = chooser.choice(EXITS)
    rank = chooser.choice(free)
    batch = chooser.randrange(max(1, VAL_BATCHES // ranks))
    where = "sanity" if chooser.random() < 0.3 else str(chooser.randrange(epochs))
    return f"{kind}:{rank}:{batch if where != 'sanity' else 0}:{where}"


VALIDATION_STALL_SHARE = 0.25
"""Validation faults that are an endless loop inside ``validation_step`` instead of an exit."""


def validation_stall(fault: str) -> str:
    """``fault`` (``KIND:RANK:BATCH:EPOCH|sanity``) as a ``loop`` in the step: after an evaluation
    step of the fit (its first is not judged: nothing measured yet), so batch 1 of the sanity check's
    2, or a validation after epoch 0 when it is its first batch."""
    _, rank, batch, where = fault.split(":")
    if where == "sanity":
        return f"loop:{rank}:1:sanity"
    return f"loop:{rank}:{batch}:{max(int(where), 1) if batch == '0' else where}"


EPOCH_END_SHARE = 0.25
"""Trials that also lose a rank at an epoch's end (docs/failures.md)."""


def draw_epoch_end_fault(chooser: random.Random, ranks: int, taken: set[int], epochs: int) -> Optional[str]:
    """A fault at the end of a random epoch (fault_fit.py's ``--epoch-end-fault`` phases; the
    ``train_end_*`` ones after the last epoch) on a rank no other fault names."""
    if chooser.random() >= EPOCH_END_SHARE:
        return None
    free = [rank for rank in range(ranks) if rank not in taken]
    if len(free) < 2:
        return None  # one rank must survive every fault
    kind, rank, phase = chooser.choice(EXITS), chooser.choice(free), chooser.choice(EPOCH_END_PHASES)
    epoch = chooser.randrange(epochs)
    return f"{kind}:{rank}:{phase}:{epochs - 1 if phase.startswith('train_end') else epoch}"


def draw_trial(seed: str, index: int, ranks: Optional[int] = None, stalls: bool = True,
               validation: bool = True, epoch_end: bool = True) -> Trial:
    chooser = random.Random(f"{seed}:{index}")
    mode = chooser.choice(MODES)
    drawn_ranks = chooser.choices(list(RANK_WEIGHTS), weights=list(RANK_WEIGHTS.values()))[0]
    ranks = drawn_ranks if ranks is None else ranks
    epochs = chooser.choice((2, 3))
    count = chooser.choices((1, 2), weights=(2, 3))[0]
    kinds = {k: w for k, w in KIND_WEIGHTS.items() if stalls or k not in STALLS}
    faults: list[str] = []
    places: list[tuple[int, int]] = []
    for rank in chooser.sample(range(ranks), count):
        kind = chooser.choices(list(kinds), weights=list(kinds.values()))[0]
        epoch, step = fault_place(chooser, kind, epochs)
        if places and chooser.random() < 0.5:  # a step or two after the first: most often its window
            epoch, step = places[0][0], places[0][1] + chooser.randint(0, 2)
        step = after_first_round(kind, epoch, step)
        places.append((epoch, step))
        faults.append(f"{kind}:{rank}:{step}:{epoch}")
    limit = chooser.random()
    max_failure = chooser.randint(1, count) if limit < 0.2 else count + 1 if limit < 0.3 else None
    val_fault = draw_validation_fault(chooser, ranks, {int(f.split(":")[1]) for f in faults}, epochs) if (
        validation) else None
    if val_fault is not None and max_failure is not None and max_failure > count:
        max_failure += 1  # the limit stays above the faults it was drawn above
    taken = {int(f.split(":")[1]) for f in (*faults, *([val_fault] if val_fault else []))}
    end_fault = draw_epoch_end_fault(chooser, ranks, taken, epochs) if epoch_end else None
    if end_fault is not None and max_failure is not None and max_failure > count + (val_fault is not None):
        max_failure += 1
    if val_fault is not None and chooser.random() < VALIDATION_STALL_SHARE:  # drawn last: the rest stays
        val_fault = validation_stall(val_fault)
    return Trial(seed, index, mode, ranks, epochs, tuple(faults), max_failure,
                 () if val_fault is None else (val_fault,), () if end_fault is None else (end_fault,))


def soak_count(name: str, default: int, least: int) -> int:
    value = os.environ.get(name, str(default))
    if not value.isdigit() or int(value) < least:
        raise ValueError(f"{name}={value!r} is invalid: expected a whole number >= {least} (unset: {default}).")
    return int(value)


SEED = os.environ.get("ELCHE_SOAK_SEED", "0")
FIRST = soak_count("ELCHE_SOAK_FIRST", 0, 0)
"""The first trial's index: a soak split over several runs draws trials FIRST .. FIRST + TRIALS - 1."""
RANKS = soak_count("ELCHE_SOAK_RANKS", 0, 0) or None
"""Every trial's rank count when set (at least 3; unset or 0: drawn from ``RANK_WEIGHTS``), to soak many ranks."""
if RANKS is not None and RANKS < 3:
    raise ValueError(f"ELCHE_SOAK_RANKS={RANKS} is invalid: expected 0 (drawn) or a rank count >= 3.")
SOAK = [draw_trial(SEED, k, ranks=RANKS) for k in range(FIRST, FIRST + soak_count("ELCHE_SOAK_TRIALS", 240, 1))]
CI = [draw_trial("ci8", k, ranks=3, stalls=False, validation=False, epoch_end=False) for k in range(2)]
"""A fixed draw that has a saving stop (an out-of-memory error at the first step, ``max_failure=1``)
and a double fault in one window (SIGSTOP and an out-of-memory error)."""


def run_trial(tmp_path: Path, trial: Trial) -> None:
    """Run ``trial``, check what its fired faults promise, and add its line to the report."""
    started, expected, outcome = time.monotonic(), "", "failed"
    try:
        stalled = any(kind in STALLS for kind in trial.kinds)
        extra = ("--stall-floor", str(STALL_FLOOR_S)) if stalled else ()
        for fault in trial.val_faults:
            extra += ("--val-fault", fault)
        for fault in trial.epoch_end_faults:
            extra += ("--epoch-end-fault", fault)
        extra += ("--sanity-steps", str(trial.sanity_steps))
        job = run_job(tmp_path, trial.mode, list(trial.faults), ranks=trial.ranks, epochs=trial.epochs,
                      samples=trial.samples, max_failure=None if trial.max_failure is None else str(trial.max_failure),
                      extra=extra, timeout_s=180.0)
        faults = fired_faults(tmp_path)
        if trial.max_failure is not None and len(faults) >= trial.max_failure:
            expected = "saving stop"
            check_saving_stop(job, str(trial.max_failure))
        else:
            expected = "survived"
            check_survived(job, set(faults))
            # A rank lost in validation or at an epoch's end is checked by the survival checks; its
            # reason's wording is the recoveries' (tests/test_validation_loss.py, test_epoch_end_loss.py).
            check_reasons(job, {rank: str(record["kind"]) for rank, record in faults.items() if "phase" not in record})
        outcome = "passed"
    except BaseException as error:  # pytest.fail and a timeout too: the report counts every failure
        outcome = f"failed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
        raise
    finally:
        report = os.environ.get("ELCHE_SOAK_REPORT")
        if report:
            fired = [str(record["kind"]) for record in fired_faults(tmp_path).values()]
            line = {**asdict(trial), "faults": list(trial.faults), "val_faults": list(trial.val_faults),
                    "epoch_end_faults": list(trial.epoch_end_faults),
                    "kinds": trial.kinds, "fired": len(fired),
                    "fired_kinds": fired,
                    "expected": expected, "outcome": outcome, "elapsed_s": round(time.monotonic() - started, 1),
                    "out": str(tmp_path)}
            with open(report, "a") as sink:
                sink.write(json.dumps(line) + "\n")


def check_reasons(job: Job, kinds: dict[int, str]) -> None:
    """A rank that raised is lost with its error (its failure notice, read before anything else);
    a stall that is the only fault is found as a stall (its heartbeat went on)."""
    for result in job.results.values():
        for loss in result["losses"]:
            for rank in loss["lost"]:
                reason, kind = loss["reasons"][str(rank)], kinds.get(rank)
                if kind is None:
                    continue
                if kind in RAISED:
                    assert f"it failed: {RAISED[kind]}" in reason, f"rank {rank} ({kind}): {reason}"
                if kind in STALLS and len(kinds) == 1:
                    assert "stalled" in reason, f"rank {rank} ({kind}): {reason}"


@pytest.mark.timeout(420)
@pytest.mark.parametrize("trial", CI, ids=lambda trial: trial.name)
def test_a_few_random_faults(tmp_path: Path, trial: Trial) -> None:
    run_trial(tmp_path, trial)


LOST_WHILE_SAVING = Trial("fixed", 0, "cpu_cadence", 3, 2, (), 1, ("loop:0:1:sanity",), ("stop:2:checkpoint_save:0",))
"""Draw 14.015 at 3 ranks: rank 0 spins in the sanity check, which reaches ``max_failure=1``; while the
survivors save the consensus, rank 2 stops. Until the fix the save's barrier failed on every survivor
and the fit ended in a cascade of CollectiveMismatch errors without a checkpoint."""


@pytest.mark.timeout(420)
def test_a_rank_lost_while_the_survivors_save_at_max_failure_in_an_evaluation(tmp_path: Path) -> None:
    run_trial(tmp_path, LOST_WHILE_SAVING)
    saved = any(tmp_path.rglob("last-ranks-lost.ckpt"))
    assert saved, "the survivors left no checkpoint"
    log = (tmp_path / "job.log").read_text()
    assert "lost rank 0" in log and "rank 2 (" in log and "1 survivor(s) saved" in log, log[-3000:]


@pytest.mark.faults
@pytest.mark.timeout(420)
@pytest.mark.parametrize("trial", SOAK, ids=lambda trial: trial.name)
def test_soak(tmp_path: Path, trial: Trial) -> None:
    run_trial(tmp_path, trial)
