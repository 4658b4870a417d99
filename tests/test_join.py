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
import re
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from fault_jobs import consensus_samples
from multirank_helpers import LAUNCH_TAG, clean_environment, end_launch, free_port, rank_results, tagged_processes
from test_epoch_metrics import check_epoch_ends

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
    joiner_rcs: list[int] = field(default_factory=list)
    joiner_logs: list[str] = field(default_factory=list)


def _command(out: Path, mode: str, extra: tuple[str, ...]) -> list[str]:
    return [sys.executable, str(SCRIPT), str(out), "--mode", mode, "--devices", "2", "--epochs", str(EPOCHS),
            "--samples", str(SAMPLES), "--batch-size", str(BATCH), "--liveness", "5", "--delays-ms", "25", "35",
            *extra]


def run_join_job(out: Path, mode: str, joiner_extra: tuple[str, ...] = (),
                 joiner_env: dict[str, str | None] | None = None, timeout_s: float = 240.0, joiners: int = 1,
                 one_after_the_other: bool = False,
                 cohort_extra: tuple[str, ...] = (), joiner_devices: int = 0,
                 hold_at_step: int = HOLD_AT_STEP, cohort_tasks: tuple[dict[str, str], ...] = ({},),
                 joiner_extras: tuple[tuple[str, ...], ...] = (), holds: tuple[str, ...] | None = None,
                 first_joiner: int = JOINER) -> JoinJob:
    """The 2-rank cohort and, started at the same time, the joiner(s); the cohort's rank 0 waits at its
    step ``HOLD_AT_STEP`` until the joiners asked to join (it keeps training while they import,
    build their models and loaders), so that the join comes in the middle of the fit.

    ``joiner_devices``: each joiner starts without ``LOCAL_RANK`` and with ``--devices N``: its
    Lightning launcher brings N joining ranks.

    ``hold_at_step``: rank 0's step at which it waits (a later step: a join in a later epoch).

    ``one_after_the_other``: the second joiner asks to join once the first acknowledged its
    admission, and rank 0 waits for its request at its first batch on three ranks (two admissions,
    two changes).

    ``cohort_tasks``: the cohort's processes, each this environment over the job's: by default one
    (Lightning's launcher starts rank 1), or one per rank as a cluster's launcher starts them. In
    ``joiner_env`` a variable set to ``None`` is removed from the joiner's environment.

    ``joiner_extras``: joiner ``k``'s own arguments (after ``joiner_extra``); ``holds``: rank 0's
    ``--hold-for-joiner`` values in place of those above; ``first_joiner``: the first joiner's name
    (``ELCHE_TEST_MEMBER``; its files follow the member id it gets)."""
    out.mkdir(parents=True, exist_ok=True)
    tag = secrets.token_hex(8)
    port = free_port()
    env = {**clean_environment(), LAUNCH_TAG: tag, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "XDG_CACHE_HOME": str(out / "cache")}  # the token file stays in the test's directory
    cohort_log = out / "job.log"
    joiner_logs = [out / ("joiner.log" if k == 0 else f"joiner{k + 1}.log") for k in range(joiners)]
    if holds is None:
        holds = ((str(hold_at_step), "0:2:3") if one_after_the_other
                 else (f"{hold_at_step}:{joiners * max(1, joiner_devices)}",) if joiners else ())
    procs: list[subprocess.Popen] = []
    deadline = time.monotonic() + timeout_s

    def start_joiner(k: int) -> None:
        overlay = {"ELCHE_JOIN": "1", "LOCAL_RANK": "0", "ELCHE_TEST_MEMBER": str(first_joiner + k),
                   **(joiner_env or {})}
        environment = {name: value for name, value in {**env, **overlay}.items() if value is not None}
        extra = (*joiner_extra, "--request-after-first-join") if one_after_the_other and k > 0 else joiner_extra
        extra = (*extra, *(joiner_extras[k] if k < len(joiner_extras) else ()))
        if joiner_devices:
            del environment["LOCAL_RANK"]
            extra = (*joiner_extra, "--devices", str(joiner_devices))
        with open(joiner_logs[k], "w") as sink:
            procs.append(subprocess.Popen(_command(out, mode, extra), env=environment, stdout=sink,
                                          stderr=subprocess.STDOUT, start_new_session=True))

    try:
        with open(cohort_log, "w") as sink:
            hold = tuple(a for h in holds for a in ("--hold-for-joiner", h))
            for task in cohort_tasks:
                procs.append(subprocess.Popen(_command(out, mode, (*hold, *cohort_extra)), env={**env, **task},
                                              stdout=sink, stderr=subprocess.STDOUT, start_new_session=True))
        for k in range(joiners):
            start_joiner(k)
        for proc, log in zip(procs, (*(cohort_log for _ in cohort_tasks), *joiner_logs), strict=True):
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
    cohort, joining = procs[:len(cohort_tasks)], procs[len(cohort_tasks):]
    cohort_rc = next((p.returncode for p in cohort if p.returncode != 0), 0)
    return JoinJob(out, cohort_rc, joining[0].returncode if joiners else 0, cohort_log.read_text(),
                   joiner_logs[0].read_text() if joiners else "", results, leftover,
                   joiner_rcs=[p.returncode for p in joining], joiner_logs=[log.read_text() for log in joiner_logs])


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


def check_grown(job: JoinJob, joins: list[list[int]], lost: tuple[int, ...] = (), epochs: int = EPOCHS,
                samples: int = SAMPLES, launch: int = 2, cohort_rc: int | None = 0, joiner_rc: int | None = 0,
                dropped: tuple[int, ...] = (), may_idle: tuple[int, ...] = ()) -> None:
    """The fit ended on the launch ranks and joiners that were not lost, identical, with the given
    admissions (member ids per change) seen by every surviving launch rank, ``lost`` counted as
    losses, and every sample of every epoch trained exactly once in the consensus (``epochs`` and
    ``samples``: the job's, when its extra arguments changed them; ``launch``: its launch ranks;
    ``cohort_rc``: rank 0's exit code, -9 when it was killed; ``joiner_rc``: every joiner's; None:
    the caller checks it; ``dropped``: joiners the holders took in that left before they had their
    whole state: a later change takes them out with the losses, marked dropped, and they train nothing;
    ``may_idle``: joiners admitted in the fit's last epoch, which may find its pool dry or its equal
    split empty and train nothing, still finishing identical)."""
    logs = f"{job.log[-5000:]}\n--- joiners ---\n" + "\n---\n".join(log[-3000:] for log in job.joiner_logs)
    assert not job.leftover, f"processes left behind: {job.leftover}\n{logs}"
    assert cohort_rc is None or job.cohort_rc == cohort_rc, (job.cohort_rc, logs)
    assert joiner_rc is None or all(rc == joiner_rc for rc in job.joiner_rcs), (job.joiner_rcs, logs)
    joiners = sorted({m for admitted in joins for m in admitted})  # the joiners' files are named by member id
    survivors = [m for m in range(launch) if m not in lost]
    finishers = survivors + [m for m in joiners if m not in lost and m not in dropped]
    assert sorted(job.results) == finishers, f"finished: {sorted(job.results)}, expected {finishers}\n{logs}"
    world = len(finishers)
    first = job.results[survivors[0]]
    assert sorted(r["global_rank"] for r in job.results.values()) == list(range(world))
    for name, result in job.results.items():
        assert result["world_size"] == world, (name, result["world_size"], logs)
        assert result["params"] == first["params"], f"{name}'s parameters differ from rank 0's\n{logs}"
    for member in survivors:
        changes = job.results[member]["changes"]
        assert [sorted(c["joined"]) for c in changes if c["joined"]] == joins, (changes, logs)
        assert sorted(m for c in changes for m in c["lost"]) == sorted((*lost, *dropped)), changes
        assert sorted(m for c in changes for m in c["dropped"]) == sorted(dropped), changes
        assert sorted(m for loss in job.results[member]["losses"] for m in loss["lost"]) == sorted((*lost, *dropped))
    faults = {int(p.stem.removeprefix("fault-rank")): json.loads(p.read_text()) for p in job.out.glob("fault-rank*")}
    kept = {m: (int(faults[m]["epoch"]), int(loss["trained_batches"][str(m)]))
            for loss in first["losses"] for m in loss["lost"] if m not in dropped}
    job.ranks = max((launch - 1, *joiners, *lost)) + 1  # every member id that may have trained
    trained = consensus_samples(job, kept)  # type: ignore[arg-type]  # a Job's out and ranks
    assert sorted(trained) == list(range(epochs))
    for epoch, indices in trained.items():
        counts = torch.bincount(torch.tensor(indices), minlength=samples)
        missing, twice = int((counts == 0).sum()), int((counts > 1).sum())
        assert missing == 0 and twice == 0, f"epoch {epoch}: {missing} samples never trained, {twice} twice\n{logs}"
    for joiner in joiners:
        steps = job.out / f"steps-rank{joiner}.jsonl"
        if joiner in dropped:
            assert not steps.exists() or not steps.read_text().strip(), f"dropped joiner {joiner} trained"
        elif joiner not in may_idle:
            assert steps.exists() and steps.read_text().strip(), f"joiner {joiner} trained nothing"


@pytest.mark.parametrize("mode", ["cpu_cadence", *(pytest.param(m, marks=pytest.mark.faults)
                                                   for m in ("cpu_sync", "cpu_async", "nccl_sync", "nccl_cadence"))])
def test_two_joiners_ready_before_the_same_round_are_admitted_together(tmp_path: Path, mode: str) -> None:
    job = run_join_job(tmp_path, mode, joiners=2)
    check_grown(job, joins=[[2, 3]])
    said = "ElCheStrategy joined rank 2, rank 3 (member ids): 4 rank(s) go on"
    assert job.log.count(said) == 2 and all(log.count(said) == 1 for log in job.joiner_logs), job.log[-3000:]


@pytest.mark.faults
@pytest.mark.parametrize("mode", ("cpu_cadence", "cpu_sync", "cpu_async", "nccl_sync", "nccl_cadence"))
def test_two_joiners_one_after_the_other(tmp_path: Path, mode: str) -> None:
    # The first joiner is a member (rank 2) when the second is admitted: it takes that change too.
    job = run_join_job(tmp_path, mode, joiners=2, one_after_the_other=True)
    seen = [sorted(c["joined"]) for c in job.results[0]["changes"] if c["joined"]]
    assert sorted(seen) == [[2], [3]], seen  # the joiners' member ids follow the order they connected
    check_grown(job, joins=seen)
    first = next(r for name, r in job.results.items() if name >= JOINER and r["global_rank"] == 2)
    assert [c["joined"] for c in first["changes"]] == [seen[1]], first["changes"]


@pytest.mark.parametrize("mode", ["cpu_async", *(pytest.param(m, marks=pytest.mark.faults)
                                                 for m in ("cpu_cadence", "cpu_sync", "nccl_sync", "nccl_cadence"))])
def test_a_joiner_admitted_in_a_later_epoch_trains_its_first_iterator(tmp_path: Path, mode: str) -> None:
    # Past epoch 0 Lightning's epoch loop builds a second iterator of the training loader unless
    # it resumes; the joiner's first one (built and prefetched from in setup_data) must be the one
    # it trains, or its cursor refuses the second and the chunk the first claimed is never trained.
    job = run_join_job(tmp_path, mode, joiner_extra=("--request-once-held",), hold_at_step=75)
    check_grown(job, joins=[[JOINER]])
    assert job.results[0]["changes"][0]["epoch"] >= 1, job.results[0]["changes"]
    # The joiner's ModelCheckpoint took the members' state: it saves the same files, no last-v1.ckpt.
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("last*.ckpt")) == ["last.ckpt"]


@pytest.mark.parametrize("mode", ["cpu_cadence", *(pytest.param(m, marks=pytest.mark.faults)
                                                   for m in ("cpu_sync", "cpu_async", "nccl_sync", "nccl_cadence"))])
def test_a_joiner_s_step_schedule_and_step_count_are_the_members_after_its_admission(tmp_path: Path,
                                                                                      mode: str) -> None:
    # Rank 0 takes its schedulers' states at the admission round, inside its batch, before Lightning
    # steps the step-interval ones for that batch: the joiner's schedule, and its learning rate, stayed
    # one cohort step behind every member's to the fit's end. Its step count did the same.
    schedule = ("--step-schedule",)
    job = run_join_job(tmp_path, mode, joiner_extra=schedule, cohort_extra=schedule)
    check_grown(job, joins=[[JOINER]])
    first = job.results[0]
    assert first["schedulers"][0]["last_epoch"] == EPOCHS * SAMPLES // BATCH, first["schedulers"]  # the cohort steps
    for member, result in job.results.items():
        assert result["schedulers"] == first["schedulers"], (member, result["schedulers"], first["schedulers"])
        assert result["lrs"] == first["lrs"], (member, result["lrs"], first["lrs"])
    # Its global_step counts rank 0's steps to the end of the admission batch (the round is inside
    # that batch's optimizer step, which Lightning counts after it), then its own steps.
    admission = next(c for c in first["changes"] if c["joined"])
    own = (tmp_path / f"steps-rank{JOINER}.jsonl").read_text().splitlines()
    assert job.results[JOINER]["global_step"] == admission["global_step"] + 1 + len(own), (admission, len(own))


def test_the_admission_batch_s_pending_counts_follow_lightning_s_rule() -> None:
    from types import SimpleNamespace

    from lightning.pytorch.utilities.types import LRSchedulerConfig

    from lightning_elche.loop_glue.joining import loop_position, step_schedulers_for_admission_batch

    def position(accumulating: bool, automatic: bool = True) -> tuple[dict[str, Any], Any]:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        configs = [LRSchedulerConfig(torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5), interval="step"),
                   LRSchedulerConfig(torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5), interval="epoch"),
                   LRSchedulerConfig(torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer), interval="step",
                                     reduce_on_plateau=True, monitor="loss")]
        optimizer.step()  # as in a fit, before its schedulers step
        module = SimpleNamespace(automatic_optimization=automatic,
                                 lr_scheduler_step=lambda scheduler, metric: scheduler.step())
        epoch_loop = SimpleNamespace(_should_accumulate=lambda: accumulating, _batches_that_stepped=7, batch_idx=4)
        trainer = SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=epoch_loop), current_epoch=1, global_step=7,
                                  lightning_module=module, lr_scheduler_configs=configs)
        return loop_position(trainer), trainer  # type: ignore[arg-type]

    # Inside the batch's optimizer step: Lightning counts the step and the batch after it, and steps
    # the step-interval scheduler (not the epoch one, not the plateau one: those are not pending).
    stepped, trainer = position(accumulating=False)
    assert stepped == {"epoch": 1, "global_step": 8, "batches_that_stepped": 8, "step_schedulers": [0]}
    step_schedulers_for_admission_batch(trainer, stepped)  # type: ignore[arg-type]
    assert [c.scheduler.last_epoch for c in trainer.lr_scheduler_configs] == [1, 0, 0]
    assert trainer.lr_scheduler_configs[0].scheduler.optimizer.param_groups[0]["lr"] == 0.5
    assert position(accumulating=True)[0]["step_schedulers"] == []
    assert position(accumulating=True)[0]["batches_that_stepped"] == 7
    assert position(accumulating=False, automatic=False)[0]["step_schedulers"] == []  # the user steps them


DRY = ("--join-when-dry", "--epochs", "2")
METRICS = ("--epoch-metrics",)  # an epoch metric of each kind, the schedulers' and logger's steps recorded


@pytest.mark.parametrize("mode", ["cpu_async", *(pytest.param(m, marks=pytest.mark.faults)
                                                 for m in ("cpu_cadence", "nccl_cadence"))])
def test_a_joiner_whose_first_iterator_is_empty_drains_the_epoch_with_the_members(tmp_path: Path, mode: str) -> None:
    # Issue 22: the members claim the whole epoch before the joiner's first claim. Its epoch loop got
    # no batch and left the epoch alone (the members waited for it in the rounds: a SnapshotTimeout);
    # it now joins the rounds out of data until the epoch's last one, and ends the epoch with them.
    job = run_join_job(tmp_path, mode, joiner_extra=("--request-once-held", *DRY, *METRICS),
                       cohort_extra=(*DRY, *METRICS))
    dry = json.loads((tmp_path / f"dry-rank{JOINER}.json").read_text())
    assert dry["dry"], dry  # the case itself: nothing of the epoch was left for the joiner's first iterator
    check_grown(job, joins=[[JOINER]], epochs=2)
    epoch = dry["epoch"]
    rows = [json.loads(line) for line in (tmp_path / f"steps-rank{JOINER}.jsonl").read_text().splitlines()]
    assert all(r["epoch"] != epoch for r in rows), "the joiner trained in the epoch it found claimed"
    validated = {rank: [v for v in map(json.loads, (tmp_path / f"val-rank{rank}.jsonl").read_text().splitlines())
                        if v["epoch"] == epoch and not v["sanity"]] for rank in (0, 1, JOINER)}
    # Its epoch end ran in step with the members': one validation of that epoch, on the same parameters.
    assert [len(v) for v in validated.values()] == [1, 1, 1], validated
    assert validated[JOINER][0]["metrics"] == validated[0][0]["metrics"], validated
    assert validated[JOINER][0]["params"] == validated[0][0]["params"]
    # And its epoch metrics of every kind, its logger step and its schedules (test_epoch_metrics.py).
    check_epoch_ends(tmp_path, (0, 1, JOINER), 2, SAMPLES, BATCH)


LOSS_POINTS = {
    # rank 1 dies in the admission: the admitted list read, before the new group is up
    "admitted": ("--member-dies-in-admission", "1:admitted"),
    # after the change is applied and the joiner has its state: the next round loses it
    "applied": ("--member-dies-in-admission", "1:applied"),
    # in the window before the admission round (rank 0 holds at HOLD_AT_STEP for the request)
    "window": ("--fault", f"kill:1:{HOLD_AT_STEP}"),
}


@pytest.mark.parametrize("point", ["admitted", *(pytest.param(p, marks=pytest.mark.faults) for p in ("applied",
                                                                                                     "window"))])
@pytest.mark.parametrize("mode", ["cpu_cadence", *(pytest.param(m, marks=pytest.mark.faults)
                                                   for m in ("cpu_sync", "cpu_async", "nccl_sync", "nccl_cadence"))])
def test_a_member_lost_around_the_admission_round(tmp_path: Path, mode: str, point: str) -> None:
    job = run_join_job(tmp_path, mode, cohort_extra=LOSS_POINTS[point])
    check_grown(job, joins=[[JOINER]], lost=(1,))
    assert "RankLostWarning" in job.log or "lost rank 1" in job.log, job.log[-3000:]


@pytest.mark.faults
@pytest.mark.parametrize("mode", ("cpu_cadence", "cpu_async", "nccl_sync"))
def test_a_joiner_that_dies_after_acknowledging_is_dropped_within_seconds(tmp_path: Path, mode: str) -> None:
    job = run_join_job(tmp_path, mode, joiner_extra=("--joiner-dies-after-ack",))
    assert job.joiner_rc == -9
    found = re.search(r"dropped joiner 2: it acknowledged its admission but did not reach the new group \((.*?)\); "
                      r"the members went on without it after ([0-9.]+) s", job.log)
    assert found is not None, job.log[-3000:]
    # Not held for the process-group timeout (120 s in the script): the members went on at once.
    assert float(found.group(2)) < 10.0, found.group(0)
    check_cohort_alone(job)


def check_dropped_in_time(job: JoinJob, did: str, within_s: float, joined: bool = False) -> None:
    """The cohort dropped joiner 2 (it never was a member) within ``within_s`` of waiting for it, not
    at the process-group timeout (120 s in the script), and finished alone (``joined``: the holders
    had taken it in, so a later change takes it out, marked dropped)."""
    found = re.search(rf"dropped joiner 2: it acknowledged its admission but {did} \((.*?)\); the members went on "
                      r"without it after ([0-9.]+) s", job.log)
    assert found is not None, job.log[-3000:]
    assert float(found.group(2)) < within_s, found.group(0)
    if joined:
        check_grown(job, joins=[[JOINER]], dropped=(JOINER,), joiner_rc=None)
    else:
        check_cohort_alone(job)


@pytest.mark.parametrize(("kind", "mode"), [("kill", "cpu_cadence"),
                                            *(pytest.param(k, m, marks=pytest.mark.faults)
                                              for k, m in (("kill", "cpu_async"), ("kill", "nccl_sync"),
                                                           ("stop", "cpu_cadence")))])
def test_a_joiner_lost_before_its_state_arrived_is_dropped(tmp_path: Path, kind: str, mode: str) -> None:
    # Issue 22: the new group is up, rank 0 sends the joiner its state, and the joiner dies (or
    # stops). The members watched the transfer: they drop it (not a loss) and build one more group.
    job = run_join_job(tmp_path, mode, joiner_extra=("--joiner-fails-in-admission", f"{kind}:regrouped"))
    assert job.joiner_rc == -9  # a stopped joiner was fenced: it must not wake into the fit
    check_dropped_in_time(job, "did not take its state", within_s=15.0)


@pytest.mark.parametrize(("kind", "mode"), [("kill", "cpu_async"),
                                            *(pytest.param(k, m, marks=pytest.mark.faults)
                                              for k, m in (("kill", "cpu_cadence"), ("kill", "cpu_sync"),
                                                           ("kill", "nccl_sync"), ("kill", "nccl_cadence"),
                                                           ("stop", "cpu_cadence")))])
def test_a_joiner_lost_while_it_takes_the_rest_of_its_state_is_dropped(tmp_path: Path, kind: str, mode: str) -> None:
    # Issue 22: the holders took the change and rank 0 sends the joiner the rest of its state (round
    # record, dispatch), and the joiner dies (or stops) there. Rank 0's send watches it; every rank's
    # settlement leaves it out; the next round's change takes it out, dropped: no loss counted, its
    # share of the epoch back to the members, every sample once.
    job = run_join_job(tmp_path, mode, joiner_extra=("--joiner-fails-in-admission", f"{kind}:rest"),
                       cohort_extra=("--max-failure", "1"))
    assert job.joiner_rc == -9  # a stopped joiner was fenced: it must not wake into the fit
    check_dropped_in_time(job, "did not take the rest of its state", within_s=15.0, joined=True)


@pytest.mark.faults  # a minute each: the watched rendezvous a lost member never completes ends at its 30 s bound
@pytest.mark.parametrize(("member", "mode"), [(1, "cpu_cadence"), (1, "cpu_async"), (1, "nccl_sync"),
                                              (0, "cpu_cadence")])
def test_a_member_lost_between_the_entry_and_the_group_is_an_ordinary_loss(tmp_path: Path, member: int,
                                                                           mode: str) -> None:
    # Issue 22: a member said it is there, then died before the new group was up: the others waited
    # in the group's rendezvous until the process-group timeout. The rendezvous is watched now; the
    # participants settle who built it and build it again without the lost one; the joiner joins.
    job = run_join_job(tmp_path, mode, cohort_extra=("--member-dies-in-admission", f"{member}:entered"))
    assert "did not come up" in job.log or "did not come up" in job.joiner_log, job.log[-3000:]
    check_grown(job, joins=[[JOINER]], lost=(member,), cohort_rc=-9 if member == 0 else 0)


@pytest.mark.parametrize(("point", "mode"), [("taking", "cpu_cadence"),
                                             *(pytest.param(p, m, marks=pytest.mark.faults)
                                               for p, m in (("taking", "cpu_sync"), ("taking", "cpu_async"),
                                                            ("side_group", "cpu_cadence"), ("side_group", "cpu_sync"),
                                                            ("side_group", "cpu_async")))])
def test_a_member_lost_while_the_holders_take_the_change_is_an_ordinary_loss(tmp_path: Path, point: str,
                                                                            mode: str) -> None:
    # Issue 22: the cpu_* plane built its side group when it took the change, a rendezvous: rank 0
    # and the joiner waited there for the dead member until snapshot_timeout (60 s here) and failed.
    # The side group is built with the admission's group now, watched and settled (side_group: lost
    # there, it is left out of the group and the joiner enters with the others); taking the change
    # waits for nobody (taking: the next round loses it, the joiner takes part in that agreement).
    job = run_join_job(tmp_path, mode, cohort_extra=("--member-dies-in-admission", f"1:{point}"), timeout_s=150.0)
    check_grown(job, joins=[[JOINER]], lost=(1,))
    assert sorted(m for loss in job.results[JOINER]["losses"] for m in loss["lost"]) == [1], job.results[JOINER]
    if point == "side_group":
        assert "did not come up" in job.log or "did not come up" in job.joiner_log, job.log[-3000:]


RANK_0_POINTS = {
    # the joiner acknowledged its admission, rank 0 has not named the new generation yet
    "offered": r"the member that offered it \(0\) was lost .* before it named the new generation",
    # the new group is up, the joiner waits for its state
    "sending": "its state did not arrive",
}


@pytest.mark.faults
@pytest.mark.parametrize("point", RANK_0_POINTS)
@pytest.mark.parametrize("mode", ("cpu_cadence", "cpu_async", "nccl_sync"))
def test_rank_0_lost_in_an_admission_is_a_loss_and_drops_its_joiner(tmp_path: Path, mode: str, point: str) -> None:
    # Issue 23: rank 0 offers the admission and sends the state. Lost before it named the new
    # generation, the members left with RanksLost; lost while it sent, the joiner waited until the
    # process-group timeout. Now the members agree on its loss (as on any) and the joiner leaves.
    job = run_join_job(tmp_path, mode, cohort_extra=("--member-dies-in-admission", f"0:{point}"))
    assert re.search(rf"joiner 2 was dropped from its admission: .*{RANK_0_POINTS[point]}", job.joiner_log), (
        job.joiner_log[-3000:])
    check_grown(job, joins=[], lost=(0,), cohort_rc=-9, joiner_rc=1)


@pytest.mark.parametrize("mode", ["cpu_cadence", *(pytest.param(m, marks=pytest.mark.faults)
                                                   for m in ("cpu_sync", "cpu_async", "nccl_sync", "nccl_cadence"))])
def test_rank_0_lost_sending_the_rest_of_the_state_is_a_loss_and_drops_its_joiner(tmp_path: Path, mode: str) -> None:
    # Issue 22: rank 0 dies once the holders took the change, before the joiner has the rest of its
    # state (round record, dispatch). The joiner left, and the members lost both at their next round,
    # the joiner counted: with max_failure=2 that ended the fit. Now every rank settles which joiners
    # have their whole state; this one leaves as a dropped joiner, and the change of the next round
    # takes both out, the joiner uncounted (the fit goes on on rank 1 alone).
    job = run_join_job(tmp_path, mode, cohort_extra=("--member-dies-in-admission", "0:rest", "--max-failure", "2"),
                       timeout_s=150.0)
    assert re.search(r"joiner 2 was dropped from its admission: the rest of its state did not arrive",
                     job.joiner_log), job.joiner_log[-3000:]
    assert "dropped joiner 2: it acknowledged its admission but did not take the rest of its state" in job.log, (
        job.log[-3000:])
    check_grown(job, joins=[[JOINER]], lost=(0,), dropped=(JOINER,), cohort_rc=-9, joiner_rc=1)


@pytest.mark.parametrize("mode", ["cpu_cadence", *(pytest.param(m, marks=pytest.mark.faults)
                                                   for m in ("cpu_sync", "cpu_async", "nccl_sync", "nccl_cadence"))])
def test_restart_lost_restarts_a_killed_child_which_joins_the_fit(tmp_path: Path, mode: str) -> None:
    # Lightning's launcher started rank 1; it is killed at its step 8; rank 0 (its launcher) starts it
    # again as a joiner (member 2), and waits at its step 70 (epoch 1, alone) until it asked to join.
    job = run_join_job(tmp_path, mode, joiners=0, cohort_extra=("--fault", "kill:1:8", "--restart-lost", "1",
                                                                "--hold-for-joiner", "70"))
    check_grown(job, joins=[[JOINER]], lost=(1,))
    # Past epoch 0 (the other join tests admit in epoch 0): a joiner there used to fail at its first
    # batch (a second iterator of its first epoch) and at its first save (ModelCheckpoint's state).
    assert [c["epoch"] for c in job.results[0]["changes"] if c["joined"]][0] >= 1, job.results[0]["changes"]
    assert "tolerates the loss and restarted it" in job.log and "restart 1 of restart_lost=1" in job.log, job.log
    # RankJoinedWarning on rank 0 and on the restarted process (both write to the job's log).
    assert job.log.count("ElCheStrategy joined rank 2 (member ids): 2 rank(s) go on") == 2, job.log[-3000:]


def test_restart_lost_refuses_a_bad_value() -> None:
    from lightning_elche import ElCheStrategy

    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match=rf"ElCheStrategy\(restart_lost={re.escape(repr(bad))}\) is invalid: "
                                             r"expected an int >= 0"):
            ElCheStrategy(restart_lost=bad)
    assert ElCheStrategy().restart_lost == 0 and ElCheStrategy(restart_lost=2).restart_lost == 2


@pytest.mark.faults
def test_a_joiner_without_local_rank_brings_its_devices_ranks(tmp_path: Path) -> None:
    # The joiner's own Lightning launcher starts its second rank (LOCAL_RANK=1), which joins too.
    job = run_join_job(tmp_path, "cpu_cadence", joiner_devices=2)
    seen = [sorted(c["joined"]) for c in job.results[0]["changes"] if c["joined"]]
    # Admitted together, or one round after the other when the first asked before the second.
    assert seen in ([[2, 3]], [[2], [3]]), seen
    check_grown(job, joins=seen)


@pytest.mark.extended
def test_a_fit_seeded_other_than_0_admits_a_joiner(tmp_path: Path) -> None:
    # The joiner's facts came from its preview loader (a RandomSampler: seed 0) and the members' from
    # Lightning's DistributedSampler (seed PL_GLOBAL_SEED): every joiner of a fit seeded 3 was refused.
    job = run_join_job(tmp_path, "cpu_cadence", joiner_extra=("--seed", "3"), cohort_extra=("--seed", "3"))
    assert "its seed" not in job.joiner_log, job.joiner_log[-3000:]
    check_joined(job)


LONG_WINDOWS = ("--batch-size", "2", "--delays-ms", "60", "80", "--anchor", "40")


@pytest.mark.parametrize("mode", ["cpu_cadence", *(pytest.param(m, marks=pytest.mark.faults)
                                                   for m in ("cpu_sync", "nccl_sync", "nccl_cadence"))])
def test_a_joiner_ready_in_a_long_window_is_admitted_within_steps_not_at_its_end(tmp_path: Path, mode: str) -> None:
    # Windows of 40-53 steps (anchor 40, rank 0 the faster); rank 0 holds at its step 12, early in its
    # first long window (steps 5 to about 57), until the joiner asks. Without ending the window for
    # the request, the round that admits it comes about 45 of rank 0's steps after the hold.
    job = run_join_job(tmp_path, mode, joiner_extra=("--request-once-held", *LONG_WINDOWS), hold_at_step=12,
                       cohort_extra=LONG_WINDOWS, timeout_s=300)
    check_joined(job)
    hold = json.loads((tmp_path / "holds-rank0.jsonl").read_text().splitlines()[0])
    join = job.results[0]["changes"][0]
    assert join["epoch"] == hold["epoch"] == 0, (hold, join)
    print(f"{mode}: admitted {join['global_step'] - hold['at_step']} steps after the hold")
    assert join["global_step"] - hold["at_step"] <= 20, (hold, join)


def _steps_in_epoch(out: Path, rank: int, epoch: int) -> int:
    rows = (out / f"steps-rank{rank}.jsonl").read_text().splitlines()
    return sum(json.loads(row)["epoch"] == epoch for row in rows)


@pytest.mark.parametrize("mode", ["cpu_cadence", *(pytest.param(m, marks=pytest.mark.faults)
                                                   for m in ("nccl_cadence", "cpu_async"))])
def test_a_joiner_read_into_an_epochs_last_round_is_admitted_after_one_step_of_the_next(tmp_path: Path,
                                                                                       mode: str) -> None:
    # Rank 0 holds at its last batch of epoch 0 until rank 1 waits in the epoch's last round, then the
    # joiner asks: that round reads the request and cannot admit it (nobody trains further in the
    # epoch), so it names the next epoch's first round, and the window before it (planned for tens of
    # steps: anchor 40) ends after one step on every member. Until b777c81 it ran its plan: the session
    # was already leaving the epoch when the growth listener ran, which read that as a hindrance.
    job = run_join_job(tmp_path, mode, joiner_extra=("--request-once-held", *LONG_WINDOWS), holds=("end0:1",),
                       cohort_extra=LONG_WINDOWS, timeout_s=300)
    check_joined(job)
    hold = json.loads((tmp_path / "holds-rank0.jsonl").read_text().splitlines()[0])
    assert hold["epoch"] == 0 and hold["requests"] >= 1, hold
    for rank in (0, 1):
        join = job.results[rank]["changes"][0]
        assert join["joined"] == [JOINER] and join["epoch"] == 1, (rank, join)
        # The change is taken inside the round at the end of the window's first batch, before Lightning
        # counts that batch's step: 0 here; the window's plan was 35-39 steps on b777c81's parent.
        before = join["global_step"] - _steps_in_epoch(tmp_path, rank, 0)
        assert before <= 1, f"rank {rank} took {before} steps of epoch 1 before the admission round's batch"
