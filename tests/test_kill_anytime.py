"""A rank killed at a random moment of a job's whole life, not at a chosen step: real 3-rank CPU jobs
(``scripts/fault_fit.py``, gloo, Lightning's popen launcher) in which this test sends ``SIGKILL`` or
``SIGTERM`` to a random rank at a random time, from the launch (imports, the job's store, the
default group, set-up) through training, validation and the epoch ends to the hooks after training
and the processes' exit.

The moment is a random fraction of an unfaulted job's duration on this machine (measured once per
session), so the draws reach every phase whatever the machine's speed. Each trial checks:

* the launch ends by itself within the bound and leaves no process behind (ranks, store host);
* a ``SIGKILL`` that came once the fit trained (a step of any rank before it) is survived: every
  other rank finishes, and the ranks that finished hold identical parameters, report the same
  losses and, with the lost rank's consensus batches, trained every sample once per epoch;
* a ``SIGKILL`` before that may end the whole launch (the fit has not formed; DDP ends it too);
* a ``SIGTERM`` is a stop request (``docs/failures.md``): whatever ends, ends together.

The random-time sweep that this test keeps found the loss after the last epoch
(``test_epoch_end_loss.py``) and the child left waiting for a store that would never serve
(``test_job_store.py``). CI runs two draws; ``-m faults`` the rest (``ELCHE_ANYTIME_TRIALS``,
``ELCHE_ANYTIME_SEED``).
"""

from __future__ import annotations

import os
import random
import secrets
import signal
import sys
import time
from pathlib import Path
from typing import Optional

import pytest
import torch
from fault_jobs import (
    BATCH,
    EPOCHS,
    MODES,
    RANKS,
    SAMPLES,
    SCRIPT,
    Job,
    agreed,
    consensus_samples,
    records,
)
from multirank_helpers import LAUNCH_TAG, clean_environment, end_launch, launch_logged, rank_results, tagged_processes

pytestmark = pytest.mark.distributed

SEED = os.environ.get("ELCHE_ANYTIME_SEED", "0")
TRIALS = int(os.environ.get("ELCHE_ANYTIME_TRIALS", "40"))
CI_DRAWS = (3, 10)  # mid-fit, and rank 0 as the launch starts
END_BOUND_S = 150.0
"""How long the launch may take to end after the signal (the job's transport timeout is 120 s)."""


def draw(index: int) -> tuple[str, int, signal.Signals, float]:
    """``(mode, rank, signal, moment)``: the moment as a fraction of an unfaulted job's duration."""
    chooser = random.Random(f"anytime-{SEED}-{index}")
    mode, rank = chooser.choice(MODES), chooser.randrange(RANKS)
    sent = chooser.choice((signal.SIGKILL, signal.SIGKILL, signal.SIGKILL, signal.SIGTERM))
    return mode, rank, sent, chooser.uniform(0.05, 1.1)


def command(out: Path, mode: str) -> list[str]:
    return [sys.executable, str(SCRIPT), str(out), "--mode", mode, "--devices", str(RANKS), "--epochs",
            str(EPOCHS), "--samples", str(SAMPLES), "--batch-size", str(BATCH), "--liveness", "5"]


def rank_process(tag: str, rank: int, root: int) -> Optional[int]:
    """The pid of launch rank ``rank`` (rank 0 is the launch's own process), None when it is not running."""
    if rank == 0:
        return root
    for pid in tagged_processes(tag):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if SCRIPT.name.encode() in argv and f"LOCAL_RANK={rank}".encode() in environ:
            return pid
    return None


def run_killed(out: Path, mode: str, rank: int, sent: signal.Signals, after_s: Optional[float]
               ) -> tuple[Job, Optional[float]]:
    """Run the job, send ``sent`` to launch rank ``rank`` ``after_s`` seconds into it (None: never);
    returns the job and when the signal went (wall clock; None: the rank was not running then)."""
    out.mkdir(parents=True, exist_ok=True)
    tag = secrets.token_hex(8)
    log_path = out / "job.log"
    started = time.monotonic()
    proc = launch_logged(command(out, mode), {**clean_environment(), LAUNCH_TAG: tag}, log_path)
    signalled: Optional[float] = None
    try:
        while after_s is not None and time.monotonic() - started < after_s:
            if proc.poll() is not None and not tagged_processes(tag):
                break
            time.sleep(0.02)
        pid = rank_process(tag, rank, proc.pid) if after_s is not None else None
        if pid is not None and (rank != 0 or proc.poll() is None):
            try:
                os.kill(pid, sent)
                signalled = time.time()
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + END_BOUND_S
        while (proc.poll() is None or tagged_processes(tag)) and time.monotonic() < deadline:
            time.sleep(0.1)
        elapsed = time.monotonic() - started
        leftover = tagged_processes(tag)
    finally:
        end_launch([proc], tag)
    job = Job(out, proc.returncode, log_path.read_text(errors="replace"), rank_results(out), RANKS, leftover,
              elapsed)
    return job, signalled


@pytest.fixture(scope="module")
def clean_duration(tmp_path_factory: pytest.TempPathFactory) -> float:
    """An unfaulted job's duration on this machine now (the draws' time scale)."""
    job, _ = run_killed(tmp_path_factory.mktemp("clean"), "cpu_cadence", 0, signal.SIGKILL, None)
    assert job.returncode == 0 and sorted(job.results) == list(range(RANKS)), job.log[-3000:]
    return job.elapsed_s


def first_step_time(job: Job) -> Optional[float]:
    times = [rows[0]["time"] for rows in (records(job.out, rank) for rank in range(RANKS)) if rows]
    return min(times) if times else None


def check_kill(job: Job, rank: int, sent: signal.Signals, signalled: Optional[float]) -> None:
    where = f"\n{job.log[-4000:]}"
    assert not job.leftover, f"processes left behind: {job.leftover}{where}"
    assert job.elapsed_s < END_BOUND_S, f"the launch took {job.elapsed_s:.0f} s to end{where}"
    if signalled is None:  # the job had ended (or not started the rank) by the drawn moment
        assert sorted(job.results) == list(range(RANKS)), where
    trained = first_step_time(job)
    if sent == signal.SIGKILL and signalled is not None and trained is not None and trained < signalled:
        others = set(range(RANKS)) - {rank}
        assert others <= set(job.results), f"finished: {sorted(job.results)}, expected at least {others}{where}"
    if not job.results:
        return
    finished = sorted(job.results)
    first = job.results[finished[0]]
    for other in finished[1:]:
        assert job.results[other]["params"] == first["params"], f"rank {other}'s parameters differ{where}"
        assert agreed(job.results[other]) == agreed(first), f"rank {other} saw other losses{where}"
    reported = {lost for loss in first["losses"] for lost in loss["lost"]}
    assert reported <= {rank}, f"reported lost {reported}; only rank {rank} was signalled{where}"
    assert set(range(RANKS)) - set(finished) <= {rank}, f"finished: {finished}{where}"
    if sent == signal.SIGTERM or len(finished) < RANKS - len(reported):
        return  # a stop request ends the epochs early; exactly-once is the survivors' promise
    lost = {}
    for loss, change in zip(first["losses"], [c for c in first["changes"] if c["lost"]], strict=True):
        for gone in loss["lost"]:
            lost[gone] = (int(change["epoch"]), int(loss["trained_batches"][str(gone)]))
    for epoch, indices in consensus_samples(job, lost).items():
        counts = torch.bincount(torch.tensor(indices), minlength=SAMPLES)
        missing, twice = int((counts == 0).sum()), int((counts > 1).sum())
        assert missing == 0 and twice == 0, f"epoch {epoch}: {missing} samples never trained, {twice} twice{where}"
    assert sorted(consensus_samples(job, lost)) == list(range(EPOCHS)), where


def run_trial(tmp_path: Path, index: int, duration_s: float) -> None:
    mode, rank, sent, moment = draw(index)
    job, signalled = run_killed(tmp_path, mode, rank, sent, moment * duration_s)
    print(f"anytime {SEED}.{index}: {mode}, {sent.name} to rank {rank} at {moment:.2f} of {duration_s:.1f} s: "
          f"{'sent' if signalled else 'not running'}, finished {sorted(job.results)}, exit {job.returncode}, "
          f"{job.elapsed_s:.1f} s")
    check_kill(job, rank, sent, signalled)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("index", CI_DRAWS)
def test_a_rank_killed_at_a_random_moment(tmp_path: Path, clean_duration: float, index: int) -> None:
    run_trial(tmp_path, index, clean_duration)


@pytest.mark.faults
@pytest.mark.timeout(400)
@pytest.mark.parametrize("index", [k for k in range(TRIALS) if k not in CI_DRAWS])
def test_ranks_killed_at_random_moments(tmp_path: Path, clean_duration: float, index: int) -> None:
    run_trial(tmp_path, index, clean_duration)
