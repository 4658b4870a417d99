"""A rank joins a running fit: real CPU jobs (gloo, Lightning's popen launcher) of two ranks, and a
third process started with the same script and ``ELCHE_JOIN=1`` (plus ``LOCAL_RANK`` and the job's
``MASTER_ADDR``/``MASTER_PORT``) while the fit runs.

A good join: the fit ends on three ranks with identical parameters, every sample of every epoch
trained exactly once over the three ranks' records, every rank saw the join, and no process is
left. Bad joins (another model, a wrong token, a joiner that dies before it is admitted) are refused
or dropped, and the cohort finishes on its own. The default run has one fast case per kind; the
mode matrix is marked ``faults``.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from fault_jobs import consensus_samples
from multirank_helpers import LAUNCH_TAG, clean_environment, end_launch, free_port, rank_results, tagged_processes

SCRIPT = Path(__file__).parent / "scripts" / "fault_fit.py"
SAMPLES, BATCH, EPOCHS = 480, 8, 4
HOLD_AT_STEP = 10  # launch rank 0 waits there for the join request (a loaded machine starts the joiner slowly)
JOINER = 2  # the joiner's member id: the next after the launch ranks 0 and 1

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


@dataclass
class JoinJob:
    out: Path
    cohort_rc: int
    joiner_rc: int
    log: str
    joiner_log: str
    results: dict[int, dict[str, Any]]
    leftover: list[int]
    ranks: int = 3


def _command(out: Path, mode: str, extra: tuple[str, ...]) -> list[str]:
    return [sys.executable, str(SCRIPT), str(out), "--mode", mode, "--devices", "2", "--epochs", str(EPOCHS),
            "--samples", str(SAMPLES), "--batch-size", str(BATCH), "--liveness", "5", "--delays-ms", "25", "35",
            *extra]


def run_join_job(out: Path, mode: str, joiner_extra: tuple[str, ...] = (), joiner_env: dict[str, str] | None = None,
                 timeout_s: float = 240.0) -> JoinJob:
    """The 2-rank cohort and, started at the same time, the joiner; the cohort's rank 0 waits at its
    step ``HOLD_AT_STEP`` until the joiner asked to join (it keeps training while the joiner imports,
    builds its model and loaders), so that the join comes in the middle of the fit."""
    out.mkdir(parents=True, exist_ok=True)
    tag = secrets.token_hex(8)
    port = free_port()
    env = {**clean_environment(), LAUNCH_TAG: tag, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "XDG_CACHE_HOME": str(out / "cache")}  # the token file stays in the test's directory
    cohort_log, joiner_log = out / "job.log", out / "joiner.log"
    procs: list[subprocess.Popen] = []
    try:
        with open(cohort_log, "w") as sink:
            procs.append(subprocess.Popen(_command(out, mode, ("--hold-for-joiner", str(HOLD_AT_STEP))), env=env,
                                          stdout=sink, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + timeout_s
        joiner_environment = {**env, "ELCHE_JOIN": "1", "LOCAL_RANK": "0", "ELCHE_TEST_MEMBER": str(JOINER),
                              **(joiner_env or {})}
        with open(joiner_log, "w") as sink:
            procs.append(subprocess.Popen(_command(out, mode, joiner_extra), env=joiner_environment, stdout=sink,
                                          stderr=subprocess.STDOUT, start_new_session=True))
        for proc, log in zip(procs, (cohort_log, joiner_log), strict=True):
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{log.name}: did not finish in {timeout_s} s:\n{log.read_text()[-4000:]}\n---\n"
                            f"{cohort_log.read_text()[-3000:]}")
        while tagged_processes(tag) and time.monotonic() < deadline:
            time.sleep(0.2)
        leftover = tagged_processes(tag)
    finally:
        end_launch(procs, tag)
    results = rank_results(out)
    return JoinJob(out, procs[0].returncode, procs[1].returncode, cohort_log.read_text(), joiner_log.read_text(),
                   results, leftover)


def check_joined(job: JoinJob) -> None:
    logs = f"{job.log[-4000:]}\n--- joiner ---\n{job.joiner_log[-4000:]}"
    assert not job.leftover, f"processes left behind: {job.leftover}\n{logs}"
    assert job.cohort_rc == 0 and job.joiner_rc == 0, f"exit codes {job.cohort_rc}, {job.joiner_rc}\n{logs}"
    assert sorted(job.results) == [0, 1, JOINER], f"finished: {sorted(job.results)}\n{logs}"
    first = job.results[0]
    for member, result in job.results.items():
        assert result["world_size"] == 3 and result["global_rank"] == member, (member, result["world_size"])
        assert result["params"] == first["params"], f"member {member}'s parameters differ from rank 0's"
        assert result["losses"] == []
    for member in (0, 1):
        joins = job.results[member]["changes"]
        assert [c["joined"] for c in joins] == [[JOINER]] and joins[0]["world_size"] == 3, joins
    # RankJoinedWarning on every rank: the two members (one log) and the joiner.
    said = "ElCheStrategy joined rank 2 (member ids): 3 rank(s) go on"
    assert job.log.count(said) == 2 and job.joiner_log.count(said) == 1, logs
    joined_in = job.results[0]["changes"][0]["epoch"]
    trained = consensus_samples(job, {})  # type: ignore[arg-type]  # a Job's out and ranks
    assert sorted(trained) == list(range(EPOCHS))
    for epoch, indices in trained.items():
        counts = torch.bincount(torch.tensor(indices), minlength=SAMPLES)
        missing, twice = int((counts == 0).sum()), int((counts > 1).sum())
        assert missing == 0 and twice == 0, f"epoch {epoch}: {missing} samples never trained, {twice} twice"
    joiner_rows = [json.loads(line) for line in (job.out / f"steps-rank{JOINER}.jsonl").read_text().splitlines()]
    assert joiner_rows and min(r["epoch"] for r in joiner_rows) == joined_in, "the joiner trains from its epoch on"


def check_cohort_alone(job: JoinJob) -> None:
    assert not job.leftover, f"processes left behind: {job.leftover}"
    assert job.cohort_rc == 0, f"the cohort failed:\n{job.log[-4000:]}"
    assert sorted(job.results) == [0, 1], sorted(job.results)
    assert all(r["world_size"] == 2 and r["changes"] == [] for r in job.results.values())
    assert job.results[0]["params"] == job.results[1]["params"]
    trained = consensus_samples(job, {})  # type: ignore[arg-type]
    for epoch, indices in trained.items():
        counts = torch.bincount(torch.tensor(indices), minlength=SAMPLES)
        assert int((counts != 1).sum()) == 0, f"epoch {epoch}: not every sample trained exactly once"


@pytest.mark.parametrize("mode", ["cpu_cadence", *(pytest.param(m, marks=pytest.mark.faults)
                                                   for m in ("cpu_sync", "cpu_async", "nccl_sync", "nccl_cadence"))])
def test_a_rank_joins_a_running_fit(tmp_path: Path, mode: str) -> None:
    check_joined(run_join_job(tmp_path, mode))


@pytest.mark.extended  # CI refuses a wrong token; every refusal runs the same admission check
def test_a_joiner_with_another_model_is_refused(tmp_path: Path) -> None:
    job = run_join_job(tmp_path, "cpu_cadence", joiner_extra=("--width", "17"))
    assert job.joiner_rc != 0
    assert "JoinRefused" in job.joiner_log and "model (averaging layout signature)" in job.joiner_log, job.joiner_log
    check_cohort_alone(job)


def test_a_joiner_with_a_wrong_token_is_refused(tmp_path: Path) -> None:
    job = run_join_job(tmp_path, "cpu_cadence", joiner_env={"ELCHE_JOIN_TOKEN": "not-the-token"})
    assert job.joiner_rc != 0
    assert "wrong join token" in job.joiner_log, job.joiner_log[-3000:]
    assert "refused joiner 2" in job.log and "not-the-token" not in job.log, job.log[-3000:]
    check_cohort_alone(job)


@pytest.mark.faults
def test_a_joiner_that_dies_before_its_admission_is_dropped(tmp_path: Path) -> None:
    job = run_join_job(tmp_path, "cpu_cadence", joiner_extra=("--joiner-dies",))
    assert job.joiner_rc == 3
    assert "dropped joiner 2" in job.log, job.log[-3000:]
    check_cohort_alone(job)
