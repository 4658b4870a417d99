"""Goodput under churn: ``python -m lightning_elche.bench --rig cpu4 --churn RATE [--churn-delay S]``.

Ranks are killed (``kill -9``) at seeded random times for a fixed wall time per arm, and each arm's
*goodput* is measured: samples trained into the model the job holds at the end, per wall second.
The arms, one after the other, in one invocation:

* ``elche_fault_free``: ``ElCheStrategy(mode=M)`` (M: ``--churn-mode``, default ``cpu_cadence``), no fault.
* ``elche_joins``: the fault schedule; ``--churn-delay`` seconds after each kill a replacement is
  started (the same script with ``ELCHE_JOIN=1``, the killed process's throttle) and joins at a
  consensus round.
* ``elche_shrink``: the fault schedule, no replacement (the survivors go on).
* ``ddp_fault_free``: Lightning ``DDPStrategy`` under ``python -m torch.distributed.run``, no fault.
* ``ddp_torchrun``: the fault schedule; torchrun (``--max-restarts``) restarts every worker after a
  kill, and each attempt resumes from the last checkpoint (every ``--churn-ckpt-every`` steps).

**The schedule** (:func:`fault_schedule`): ``round(RATE * ranks / 4 * seconds / 60)`` faults, the
k-th at a uniform random moment inside the k-th of as many equal slots of the arm's measured time
(from 10 % to 90 % of the slot), each with a uniform random *pick* in [0, 1) that chooses the
victim among the live processes other than launch rank 0, ordered by (slot, pid). The same seeded
schedule (times and picks) applies to every faulted arm. Rank 0 is never killed: it hosts the
job's store here (no external ``python -m lightning_elche.job_store``; docs/failures.md: the
store host's loss ends the job) and, for DDP, it writes the step record. A fault that finds no
victim waits until one is alive (DDP mid-restart: the kill then lands in the new attempt) but
not past the arm's end; in ``elche_shrink`` a fault with only rank 0 left is skipped (both
listed in the JSON).

**The clock**: an arm's measured time starts at its launch rank 0's ``on_train_start``
(start-up excluded alike for every arm; a replacement's or a restart's start-up is inside the
clock) and lasts ``--churn-seconds``; then every process of the arm is killed.

**Accounting** (:func:`elche_goodput`, :func:`ddp_goodput`):

* ElChe: the samples of every averaging round that completed inside the measured time (the round
  listener's per-member ``samples``, summed over the round's members). Work a killed rank did
  after its last round never reaches the consensus and is not counted.
* DDP: the optimizer steps of the model the job holds at the end of the measured time times the
  samples per step (batch x world): the last attempt's ``global_step`` at its last step record, or,
  when that attempt was killed and the next one had not trained a step by the end, the newest
  checkpoint's. A resume restores ``global_step`` from the checkpoint, so steps trained after the
  checkpoint by an attempt that was then killed are not counted (they are ``lost_samples``).

Each arm's goodput is reported against its own family's fault-free arm and against DDP's fault-free
arm. Outputs: ``<out>/<rig>-churn.md`` and ``<out>/<rig>-churn.json``.
"""

from __future__ import annotations

import json
import math
import os
import platform
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Optional

from lightning_elche.bench.churn_fit import EVENTS
from lightning_elche.bench.worker import cpu_model, free_port
from lightning_elche.checks import invalid
from lightning_elche.growth import JOIN_TIMING_ENV

ELCHE_CLEAN, ELCHE_JOINS, ELCHE_SHRINK = "elche_fault_free", "elche_joins", "elche_shrink"
DDP_CLEAN, DDP_RESTART = "ddp_fault_free", "ddp_torchrun"
ARMS = (ELCHE_CLEAN, ELCHE_JOINS, ELCHE_SHRINK, DDP_CLEAN, DDP_RESTART)
FAULTED = (ELCHE_JOINS, ELCHE_SHRINK, DDP_RESTART)
BASELINE = {ELCHE_CLEAN: ELCHE_CLEAN, ELCHE_JOINS: ELCHE_CLEAN, ELCHE_SHRINK: ELCHE_CLEAN, DDP_CLEAN: DDP_CLEAN,
            DDP_RESTART: DDP_CLEAN}
TAG = "ELCHE_CHURN_TAG"
JOIN_TIMING_DIR = "join-timing"
ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 180.0
ARM_DESCRIPTIONS = {
    ELCHE_CLEAN: "ElCheStrategy, no fault",
    ELCHE_JOINS: "ElCheStrategy, each killed rank replaced by a joiner after the delay",
    ELCHE_SHRINK: "ElCheStrategy, killed ranks not replaced (the survivors go on)",
    DDP_CLEAN: "Lightning DDPStrategy under torchrun, no fault",
    DDP_RESTART: "Lightning DDPStrategy under torchrun --max-restarts, resuming from its last checkpoint",
}


@dataclass(frozen=True)
class Fault:
    """``at_s``: seconds after the arm's clock starts; ``pick`` in [0, 1): which victim."""

    at_s: float
    pick: float


def _invalid(owner: str, value: object, expected: str, remedy: str) -> ValueError:
    return invalid(f"{owner}={value!r})", f"expected {expected}; {remedy.rstrip('.')}")


@dataclass(frozen=True)
class ChurnConfig:
    """One churn run. ``rate``: faults per minute per four ranks; ``delay_s``: replacement delay;
    ``seconds``: measured wall time per arm; ``ckpt_every``: DDP optimizer steps between checkpoints."""

    rate: float
    delay_s: float
    seconds: float
    seed: int
    ranks: int
    slowdowns: tuple[float, ...]
    model: str
    batch: int
    samples: int
    ckpt_every: int
    mode: str
    arms: tuple[str, ...] = ARMS
    max_restarts: int = 100
    cpu_sets: tuple[tuple[int, ...], ...] = ()
    """Empty: the arms run one after the other. Else one CPU set per arm (in ``arms`` order): the arms
    run side by side, each pinned to its own set, so that every arm sees the same background load."""

    def __post_init__(self) -> None:
        checks = (
            ("rate", self.rate, math.isfinite(self.rate) and self.rate > 0,
             "a number > 0 (faults per minute per four ranks)", "pass e.g. --churn 1"),
            ("delay_s", self.delay_s, math.isfinite(self.delay_s) and self.delay_s >= 0,
             "a number of seconds >= 0 (the replacement's delay after a kill)", "pass e.g. --churn-delay 5"),
            ("seconds", self.seconds, math.isfinite(self.seconds) and self.seconds > 0,
             "a number of seconds > 0 (the measured wall time of each arm)", "pass e.g. --churn-seconds 45"),
            ("ranks", self.ranks, self.ranks >= 2,
             "a rig of at least 2 ranks (rank 0 is never killed)", "use --rig cpu2, cpu4 or cpu8"),
            ("ckpt_every", self.ckpt_every, self.ckpt_every >= 1,
             "a whole number of optimizer steps >= 1", "pass e.g. --churn-ckpt-every 50"),
        )
        for name, value, ok, expected, remedy in checks:
            if not ok:
                raise _invalid(f"ChurnConfig({name}", value, expected, remedy)
        unknown = [a for a in self.arms if a not in ARMS]
        if unknown or not self.arms:
            raise _invalid("ChurnConfig(arms", ",".join(self.arms),
                           f"a comma-separated subset of {', '.join(ARMS)}", "pass e.g. --churn-arms "
                           f"{ELCHE_CLEAN},{ELCHE_JOINS}")
        if self.cpu_sets:
            self._check_cpu_sets()
        for arm in self.arms:
            if BASELINE[arm] not in self.arms:
                raise _invalid("ChurnConfig(arms", ",".join(self.arms),
                               f"the fault-free arm of every faulted arm ({arm} is measured against "
                               f"{BASELINE[arm]})", f"add {BASELINE[arm]} to --churn-arms")

    def _check_cpu_sets(self) -> None:
        shown = "/".join(",".join(str(c) for c in cpus) for cpus in self.cpu_sets)
        usable = os.sched_getaffinity(0)
        flat = [c for cpus in self.cpu_sets for c in cpus]
        if len(self.cpu_sets) != len(self.arms) or not all(self.cpu_sets):
            raise _invalid("ChurnConfig(cpu_sets", shown, f"one non-empty CPU set per arm ({len(self.arms)} arms: "
                           f"{', '.join(self.arms)})", "pass e.g. --churn-cpus 0-3/4-7/8-11 with three arms")
        if len(set(flat)) != len(flat):
            raise _invalid("ChurnConfig(cpu_sets", shown, "disjoint CPU sets (arms side by side must not share a "
                           "core)", "pass e.g. --churn-cpus 0-3/4-7 (every arm its own cores)")
        if not set(flat) <= usable:
            raise _invalid("ChurnConfig(cpu_sets", shown, f"CPUs this process may use ({format_cpus(usable)})",
                           "pass only CPUs of that list to --churn-cpus")


def parse_cpu_sets(text: str) -> tuple[tuple[int, ...], ...]:
    """``0-3/4-7/8,9`` -> ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9)): one set per arm, ``/`` between sets."""
    sets = []
    for part in text.split("/"):
        cpus: list[int] = []
        for piece in part.split(","):
            low, _, high = piece.strip().partition("-")
            try:
                first, last = int(low), int(high or low)
            except ValueError:
                raise _invalid("ChurnConfig(cpu_sets", text, "CPU lists like 0-3/4-7/8,9 (one per arm, '/' "
                               "between arms)", "pass e.g. --churn-cpus 0-3/4-7") from None
            cpus.extend(range(first, last + 1))
        sets.append(tuple(cpus))
    return tuple(sets)


def format_cpus(cpus: Any) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def fault_count(rate: float, ranks: int, seconds: float) -> int:
    """Faults of an arm: ``rate`` per minute per four ranks, rounded, at least one."""
    return max(1, round(rate * ranks / 4.0 * seconds / 60.0))


def fault_schedule(rate: float, ranks: int, seconds: float, seed: int) -> list[Fault]:
    """The stratified seeded schedule of the module docstring (sorted by time)."""
    count = fault_count(rate, ranks, seconds)
    width = seconds / count
    rng = random.Random(seed)
    return [Fault(at_s=(k + rng.uniform(0.1, 0.9)) * width, pick=rng.random()) for k in range(count)]


def choose_victim(pick: float, candidates: list[tuple[int, int]]) -> Optional[tuple[int, int]]:
    """The (slot, pid) that ``pick`` names among ``candidates`` (ordered by slot, then pid)."""
    if not candidates:
        return None
    ordered = sorted(candidates)
    return ordered[min(len(ordered) - 1, int(pick * len(ordered)))]


# -- accounting ---------------------------------------------------------------------------


def elche_goodput(events: list[dict[str, Any]], t0: float, t1: float) -> dict[str, Any]:
    """Samples of the rounds that completed in ``(t0, t1]`` (module docstring)."""
    rounds = [e for e in events if e["event"] == "round" and t0 < e["time"] <= t1]
    samples = sum(int(e["samples"]) for e in rounds)
    worlds = [int(e["world"]) for e in rounds]
    # The count stops at the last completed round: dividing by the whole clock would charge each arm a
    # random part of a window (up to 10 % of a 100 s arm with 10 s windows) that no fault caused.
    counted = max(e["time"] for e in rounds) - t0 if rounds else t1 - t0
    return {"consensus_samples": samples, "rounds": len(rounds), "samples_per_s": samples / counted,
            "counted_s": counted, "samples_per_clock_s": samples / (t1 - t0),
            "members_min": min(worlds, default=0), "members_max": max(worlds, default=0),
            "members_mean": sum(worlds) / len(worlds) if worlds else 0.0,
            "round_s_mean": counted / len(rounds) if rounds else None}


def ddp_goodput(events: list[dict[str, Any]], t0: float, t1: float, kill_times: tuple[float, ...] = ()
                ) -> dict[str, Any]:
    """The optimizer steps of the model held at ``t1`` times the samples per step; the rest of the
    steps trained in ``(t0, t1]`` is ``lost_samples`` (module docstring).

    The model held at the end is the last attempt's: its last step's ``global_step``, unless a kill
    came after that attempt's first step (it was killed and no later attempt trained a step before
    ``t1``): then the newest checkpoint's ``global_step``."""
    steps = [e for e in events if e["event"] == "step" and t0 < e["time"] <= t1]
    trained = sum(int(e["samples"]) for e in steps)
    before = [e for e in events if e["event"] == "step" and e["time"] <= t0]
    base = max((int(e["global_step"]) for e in before), default=0)  # none from a fresh start
    if not steps:
        return {"consensus_samples": 0, "trained_samples": 0, "lost_samples": 0, "final_global_step": base,
                "attempts": 0, "samples_per_s": 0.0, "ended_in_restart": bool(kill_times)}
    attempt = max(int(e["attempt"]) for e in steps)
    mine = [e for e in steps if int(e["attempt"]) == attempt]
    first, last = min(e["time"] for e in mine), max(mine, key=lambda e: e["time"])
    dead = any(first < k <= t1 for k in kill_times)
    if dead:
        saved = [e for e in events if e["event"] == "ckpt" and e["time"] <= t1]
        final = max((int(e["global_step"]) for e in saved), default=0)
    else:
        final = int(last["global_step"])
    kept = max(0, final - base) * int(last["samples"])
    return {"consensus_samples": kept, "trained_samples": trained, "lost_samples": trained - kept,
            "final_global_step": final, "attempts": len({int(e["attempt"]) for e in steps}),
            "samples_per_s": kept / (t1 - t0), "counted_s": t1 - t0, "samples_per_clock_s": kept / (t1 - t0),
            "ended_in_restart": dead}


# -- processes ----------------------------------------------------------------------------


@dataclass
class Proc:
    pid: int
    env: dict[str, str]
    cmdline: list[str]

    @property
    def slot(self) -> int:
        return int(self.env.get("ELCHE_CHURN_SLOT", self.env.get("LOCAL_RANK", "0")))

    @property
    def launch_rank0(self) -> bool:
        return self.env.get("LOCAL_RANK") == "0" and not self.env.get("ELCHE_JOIN")

    @property
    def rank_process(self) -> bool:
        return "LOCAL_RANK" in self.env and any("churn_fit" in part for part in self.cmdline)


def tagged(tag: str) -> list[Proc]:
    """This user's live processes whose environment holds ``TAG=tag`` (started by this arm)."""
    needle = f"{TAG}={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "environ").read_bytes()
            if needle not in raw.split(b"\0"):
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            if state == "Z":
                continue
            cmdline = [p.decode(errors="replace") for p in (entry / "cmdline").read_bytes().split(b"\0") if p]
        except OSError:
            continue
        env = dict(p.decode(errors="replace").split("=", 1) for p in raw.split(b"\0") if b"=" in p)
        found.append(Proc(int(entry.name), env, cmdline))
    return found


def read_events(arm_dir: Path) -> list[dict[str, Any]]:
    return json_lines(arm_dir / EVENTS)


def json_lines(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file (none when it is missing), without a line cut by the final kill."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


@dataclass
class ArmRun:
    """What happened in one arm (plain values for the JSON)."""

    arm: str
    t0: Optional[float] = None
    t1: Optional[float] = None
    kills: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    joiners_started: list[dict[str, Any]] = field(default_factory=list)
    ended_early: Optional[int] = None
    error: Optional[str] = None


def _fit_command(config: ChurnConfig, arm_dir: Path, kind: str) -> list[str]:
    return ["-m", "lightning_elche.bench.churn_fit", str(arm_dir), "--kind", kind, "--mode", config.mode,
            "--devices", str(config.ranks), "--model", config.model, "--batch", str(config.batch),
            "--samples", str(config.samples), "--slowdowns", ",".join(f"{k:g}" for k in config.slowdowns),
            "--ckpt-every", str(config.ckpt_every), "--seed", str(config.seed)]


def _environment(tag: str, arm_dir: Path, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
                        "ELCHE_JOIN", "ELCHE_CHURN_SLOT", "TORCHELASTIC_RUN_ID")}
    path = env.get("PYTHONPATH")
    env.update({TAG: tag, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{path}" if path else str(ROOT),
                "XDG_CACHE_HOME": str(arm_dir / "cache"), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    return env


def _candidates(tag: str) -> list[tuple[int, int]]:
    return [(p.slot, p.pid) for p in tagged(tag) if p.rank_process and not p.launch_rank0]


def _clock_start(arm_dir: Path) -> Optional[float]:
    starts = [e["time"] for e in read_events(arm_dir)
              if e["event"] == "start" and e.get("global_rank") == 0 and not e.get("joiner")]
    return min(starts, default=None)


def run_arm(arm: str, config: ChurnConfig, schedule: list[Fault], arm_dir: Path, log: Any = None,
            cpus: tuple[int, ...] = (), halt: Optional[threading.Event] = None) -> ArmRun:
    """Start the arm's processes, apply the schedule (faulted arms), kill everything at the end.
    ``cpus``: pin every process of the arm to them; ``halt``: once set, the arm ends at once (its
    processes are killed as at its end)."""
    halt = halt or threading.Event()
    if cpus:
        # Linux keeps the mask per thread and a child inherits its forking thread's mask: arms in threads
        # side by side pin their own processes (replacements and restarts included) and nobody else's.
        os.sched_setaffinity(0, cpus)
    arm_dir.mkdir(parents=True, exist_ok=True)
    (arm_dir / EVENTS).unlink(missing_ok=True)
    tag, port = secrets.token_hex(8), free_port()
    env = _environment(tag, arm_dir, port)
    kind = "ddp" if arm.startswith("ddp") else "elche"
    if kind == "elche":
        timing = arm_dir / JOIN_TIMING_DIR
        shutil.rmtree(timing, ignore_errors=True)
        timing.mkdir()
        env[JOIN_TIMING_ENV] = str(timing)
    fit = _fit_command(config, arm_dir, kind)
    if kind == "ddp":
        env.pop("MASTER_ADDR")
        env.pop("MASTER_PORT")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={config.ranks}",
                   f"--max-restarts={config.max_restarts if arm == DDP_RESTART else 0}", "--monitor-interval=0.1",
                   *fit]
    else:
        command = [sys.executable, *fit]
    run = ArmRun(arm)
    procs: list[subprocess.Popen[bytes]] = []
    sink = open(arm_dir / "job.log", "wb")  # noqa: SIM115  (closed in the finally)
    try:
        procs.append(subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.time() + START_TIMEOUT_S
        while (t0 := _clock_start(arm_dir)) is None:
            if procs[0].poll() is not None or time.time() > deadline or halt.is_set():
                run.error = f"no training start (exit status {procs[0].poll()}); see {arm_dir / 'job.log'}"
                return run
            time.sleep(0.05)
        run.t0, t1 = t0, t0 + config.seconds
        run.t1 = t1
        pending = list(schedule) if arm in FAULTED else []
        joins: list[tuple[float, int]] = []
        while time.time() < t1 and not halt.is_set():
            now = time.time()
            if pending and now >= t0 + pending[0].at_s:
                victim = choose_victim(pending[0].pick, _candidates(tag))
                if victim is None and arm == ELCHE_SHRINK:  # no process but launch rank 0 is left
                    run.skipped.append({"at_s": pending[0].at_s, "why": "only rank 0 is left"})
                    pending.pop(0)
                elif victim is not None:
                    try:
                        os.kill(victim[1], signal.SIGKILL)
                    except ProcessLookupError:
                        continue  # it ended between the scan and the kill: choose again
                    fault = pending.pop(0)
                    run.kills.append({"at_s": fault.at_s, "time": now, "late_s": now - t0 - fault.at_s,
                                      "slot": victim[0], "pid": victim[1]})
                    if arm == ELCHE_JOINS:
                        joins.append((now + config.delay_s, victim[0]))
            if joins and now >= joins[0][0]:
                _, slot = joins.pop(0)
                joiner_env = {**env, "ELCHE_JOIN": "1", "LOCAL_RANK": "0", "ELCHE_CHURN_SLOT": str(slot)}
                procs.append(subprocess.Popen(command, env=joiner_env, stdout=sink, stderr=subprocess.STDOUT,
                                              start_new_session=True))
                run.joiners_started.append({"time": now, "slot": slot, "pid": procs[-1].pid})
            if procs[0].poll() is not None:
                run.ended_early = procs[0].returncode
                break
            time.sleep(0.02)
        run.skipped += [{"at_s": f.at_s, "why": "the arm ended first"} for f in pending]
        return run
    finally:
        for left in tagged(tag):
            try:
                os.kill(left.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        sink.close()
        if log is not None:
            print(f"[bench] churn arm {arm}: {len(run.kills)} kill(s), {len(run.joiners_started)} joiner(s)"
                  f"{'; ' + run.error if run.error else ''}", file=log, flush=True)


def measure(run: ArmRun, arm_dir: Path) -> dict[str, Any]:
    """The arm's goodput from its events (``run`` must have a clock)."""
    assert run.t0 is not None and run.t1 is not None
    events = read_events(arm_dir)
    if run.arm.startswith("ddp"):
        row = ddp_goodput(events, run.t0, run.t1, tuple(k["time"] for k in run.kills))
    else:
        row = elche_goodput(events, run.t0, run.t1)
    starts = [e for e in events if e["event"] == "start"]
    row.update({"joiners_trained": sum(1 for e in starts if e.get("joiner")),
                "attempts_started": len({e.get("attempt") for e in starts}) if run.arm.startswith("ddp") else None})
    if run.joiners_started:
        row["joins"] = join_phases(run.joiners_started, arm_dir / JOIN_TIMING_DIR)
    return row


def join_phases(started: list[dict[str, Any]], timing: Path) -> list[dict[str, Any]]:
    """Where each replacement's time went: from its start to ``ready`` (import, model, loaders), to
    ``admitted`` (the next consensus round), to its training start; and the cohort's stall (launch rank
    0's admission). The k-th joiner to be ready is matched with the k-th replacement started."""
    marks: dict[str, dict[str, float]] = {}
    for path in sorted(timing.glob("join-timing-*.jsonl")):
        for mark in json_lines(path):
            marks.setdefault(path.stem, {}).setdefault(mark["event"], mark["time"])
    joiners = sorted((m for m in marks.values() if "ready" in m), key=lambda m: m["ready"])
    stalls = _admission_stalls(timing / "join-timing-0.jsonl")
    phases = []
    for k, launch in enumerate(started):
        row: dict[str, Any] = {"started": launch["time"]}
        if k < len(joiners):
            m = joiners[k]
            row["to_ready_s"] = m["ready"] - launch["time"]
            if "admitted" in m:
                row["ready_to_admitted_s"] = m["admitted"] - m["ready"]
            if "training_starts" in m and "admitted" in m:
                row["admitted_to_training_s"] = m["training_starts"] - m["admitted"]
                row["to_training_s"] = m["training_starts"] - launch["time"]
                row["cohort_stall_s"] = next((end - begin for begin, end in stalls
                                              if m["admitted"] - 5.0 <= begin <= m["training_starts"]), None)
        phases.append(row)
    return phases


def _admission_stalls(path: Path) -> list[tuple[float, float]]:
    begins, spans = [], []
    for mark in json_lines(path):
        if mark["event"] == "admit_start":
            begins.append(mark["time"])
        elif mark["event"] == "admit_end" and begins:
            spans.append((begins.pop(), mark["time"]))
    return spans


# -- the run ------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    cpu = cpu_model()
    versions = {}
    for package in ("torch", "lightning"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = "unknown"
    return {"cpu": cpu, "logical_cpus": os.cpu_count(), "host": socket.gethostname(),
            "python": platform.python_version(), **versions}


def run_churn(config: ChurnConfig, out_dir: Path, stem: str, stamp: dict[str, Any]) -> dict[str, Any]:
    """Every arm of ``config`` in order; the result, written as ``<stem>.md`` / ``.json`` after each
    arm (a run cut short keeps the arms it finished). A SIGTERM ends the arm in flight through its
    clean-up (its processes are killed) before the process exits."""
    out_dir.mkdir(parents=True, exist_ok=True)
    schedule = fault_schedule(config.rate, config.ranks, config.seconds, config.seed)
    work = out_dir / f"{stem}-runs"
    arms: dict[str, Any] = {}
    result: dict[str, Any] = {}

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    def finish(arm: str, run: ArmRun) -> None:
        nonlocal result
        row: dict[str, Any] = {"description": ARM_DESCRIPTIONS[arm], **asdict(run)}
        if run.t0 is not None:
            row.update(measure(run, work / arm))
        if config.cpu_sets:
            row["cpus"] = format_cpus(config.cpu_sets[config.arms.index(arm)])
        arms[arm] = row
        result = _result(config, schedule, {a: arms[a] for a in config.arms if a in arms}, stamp)
        (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=2, allow_nan=False) + "\n")
        (out_dir / f"{stem}.md").write_text(churn_markdown(result))

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        if config.cpu_sets:
            _side_by_side(config, schedule, work, finish)
        else:
            for arm in config.arms:
                finish(arm, run_arm(arm, config, schedule, work / arm, log=sys.stderr))
    finally:
        signal.signal(signal.SIGTERM, previous)
    return result


def _side_by_side(config: ChurnConfig, schedule: list[Fault], work: Path, finish: Any) -> None:
    """Every arm at once, each in a thread pinned to its CPU set; the clocks start together within the
    arms' start-up spread. An interrupt ends every arm through its own clean-up."""
    runs: dict[str, ArmRun] = {}
    halt = threading.Event()

    def one(arm: str, cpus: tuple[int, ...]) -> None:
        runs[arm] = run_arm(arm, config, schedule, work / arm, log=sys.stderr, cpus=cpus, halt=halt)

    threads = [threading.Thread(target=one, args=(arm, cpus), name=f"churn-{arm}", daemon=True)
               for arm, cpus in zip(config.arms, config.cpu_sets, strict=True)]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            while thread.is_alive():
                thread.join(0.5)  # in steps: the main thread stays free to take a SIGTERM
    except BaseException:
        halt.set()  # every arm kills its processes in its own clean-up before this one goes on
        for thread in threads:
            thread.join(60.0)
        raise
    for arm in config.arms:
        finish(arm, runs.get(arm, ArmRun(arm, error="its thread ended without a result")))


def _result(config: ChurnConfig, schedule: list[Fault], arms: dict[str, Any], stamp: dict[str, Any]
            ) -> dict[str, Any]:
    for arm, row in arms.items():
        own, ddp = arms.get(BASELINE[arm], {}), arms.get(DDP_CLEAN, {})
        row["vs_own_fault_free"] = _ratio(row.get("samples_per_s"), own.get("samples_per_s"))
        row["vs_ddp_fault_free"] = _ratio(row.get("samples_per_s"), ddp.get("samples_per_s"))
    faults_per_min = len(schedule) / config.seconds * 60.0 * 4.0 / config.ranks
    host = machine()
    # The ranks, a replacement starting and the harness: with fewer cores the rates measure contention.
    # Side by side, a replacement takes the core its victim freed.
    crowded = (min(len(cpus) for cpus in config.cpu_sets) < config.ranks if config.cpu_sets
               else (host["logical_cpus"] or 1) < config.ranks + 2)
    return {**stamp, "machine": host, "config": asdict(config), "arms_planned": list(config.arms),
            "schedule": [asdict(f) for f in schedule], "faults_per_minute_per_4_ranks": faults_per_min,
            "crowded": crowded,
            "goal": {"arm": ELCHE_JOINS, "vs_own_fault_free_at_least": 0.9, "at_rate": 1.0,
                     "met": None if crowded else goal_met(arms, config.rate)},
            "arms": arms}


def _ratio(value: Optional[float], base: Optional[float]) -> Optional[float]:
    return value / base if value is not None and base else None


MIN_JUDGED_ROUNDS = 10
"""The goal is judged only when both ElChe arms it compares completed this many rounds: an arm's
count ends at its last completed round, so with fewer the rounding of one round decides it."""


def goal_met(arms: dict[str, Any], rate: float) -> Optional[bool]:
    """Whether ``elche_joins`` kept >= 0.9 of its fault-free rate at 1 fault per minute per four
    ranks, as far as this run's rate tells: met at that rate or a harsher one, missed at that rate
    or a milder one (None: not measured, too few rounds, or missed only at a harsher rate)."""
    ratio = arms.get(ELCHE_JOINS, {}).get("vs_own_fault_free")
    rounds = [arms.get(arm, {}).get("rounds", 0) for arm in (ELCHE_CLEAN, ELCHE_JOINS)]
    if ratio is None or min(rounds) < MIN_JUDGED_ROUNDS:
        return None
    if ratio >= 0.9:
        return True if rate >= 1.0 else None
    return False if rate <= 1.0 else None


def _fmt(value: Optional[float], digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def churn_markdown(result: dict[str, Any]) -> str:
    config, m = result["config"], result["machine"]
    times = ", ".join(f"{fault['at_s']:.1f}" for fault in result["schedule"])
    lines = [
        f"# Goodput under churn: {result['rig']}",
        "",
        f"Commit {result['commit']}, {result['date']}; machine: {m['cpu']} ({m['logical_cpus']} logical CPUs), "
        f"torch {m['torch']}, lightning {m['lightning']}, Python {m['python']}.",
        f"Command: `{result['command']}`",
        "",
        f"{config['ranks']} CPU ranks (gloo, 1 torch thread each), sleep throttles k = "
        f"{', '.join(f'{k:g}' for k in config['slowdowns'])} by slot; {config['model']}, batch {config['batch']}, "
        f"{config['samples']} samples per epoch; ElChe mode {config['mode']}. Each arm: {config['seconds']:g} s "
        f"measured wall time from launch rank 0's training start. Faults: {len(result['schedule'])} per faulted arm "
        f"(--churn {config['rate']:g}: {result['faults_per_minute_per_4_ranks']:.2f} per minute per four ranks), "
        f"kill -9 of a random live rank other than launch rank 0 at "
        f"{times} s; replacement delay {config['delay_s']:g} s; "
        f"DDP checkpoint every {config['ckpt_every']} steps. " + _layout(result),
        "",
        "| arm | kills | replacements started / training | members (min-max) | samples into the model | "
        "counted to (s) | samples/s | vs own fault-free | vs DDP fault-free |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for arm, row in result["arms"].items():
        if row.get("samples_per_s") is None:
            lines.append(f"| {arm} | failed: {row.get('error')} | | | | | | | |")
            continue
        members = (f"{row['members_min']}-{row['members_max']} ({row['rounds']} rounds)" if "members_min" in row
                   else f"{config['ranks']} ({row.get('attempts', 0)} attempt(s))")
        lost = f" (lost {row['lost_samples']:,})" if row.get("lost_samples") else ""
        name = arm if row.get("ended_early") is None else f"{arm} (ended early, exit {row['ended_early']})"
        lines.append(f"| {name} | {len(row['kills'])} | {len(row['joiners_started'])} / {row['joiners_trained']} | "
                     f"{members} | {row['consensus_samples']:,}{lost} | {_fmt(row.get('counted_s'), 1)} | "
                     f"{row['samples_per_s']:.0f} | {_fmt(row['vs_own_fault_free'])} | "
                     f"{_fmt(row['vs_ddp_fault_free'])} |")
    missing = [arm for arm in result.get("arms_planned", []) if arm not in result["arms"]]
    if missing:
        lines.append(f"| not run (the run was cut short): {', '.join(missing)} | | | | | | | | |")
    joins = [f"- {arm}, replacement {k + 1}: {join_line(join)}"
             for arm, row in result["arms"].items() for k, join in enumerate(row.get("joins", []))]
    if joins:
        lines += ["", *joins]
    if result.get("crowded"):
        lines += ["", f"**Structure only**: {m['logical_cpus']} logical CPUs for {config['ranks']} ranks, a "
                      "replacement and the harness: these rates measure contention, not churn (the goal is not "
                      "judged)."]
    goal = result["goal"]
    verdict = {None: f"not judged by this run (a milder rate that met it, a harsher one that missed it, fewer "
                     f"than {MIN_JUDGED_ROUNDS} rounds in an ElChe arm, or no measurement)", True: "met",
               False: "not met"}[goal["met"]]
    lines += [
        "",
        f"Goal (issue 22): {ELCHE_JOINS} >= 0.9 of its fault-free rate at 1 fault per minute per four ranks: "
        f"{verdict} (this run: --churn {config['rate']:g}).",
        "",
        "How the numbers are computed: *samples into the model* for ElChe is the sum, over the averaging rounds "
        "that completed inside the measured time, of the samples every member trained in that round (the round "
        "listener's metadata); a killed rank's work after its last round is not in it. For DDP it is the "
        "`global_step` of the model held at the end times the samples per step (batch x world): the last attempt's "
        "last step, or the newest checkpoint when that attempt was killed and no later one trained a step before "
        "the end; steps trained after the last checkpoint by an attempt that was then killed are lost (shown in "
        "brackets), and every restart's start-up and checkpoint load are inside the clock. samples/s = that / "
        "*counted to*: for ElChe the time from the clock's start to its last completed round (the work of a round "
        "still in flight at the end is not counted, so neither is its time), for DDP the whole measured time. "
        "Replacements (elche_joins) and restarts (ddp_torchrun) start up inside the clock too. "
        "The per-second rate over the whole clock is `samples_per_clock_s` in the JSON. "
        "Rank 0 is never killed (it hosts the job's store and the records).",
    ]
    return "\n".join(lines) + "\n"


def _layout(result: dict[str, Any]) -> str:
    if not result["config"].get("cpu_sets"):
        return "The arms ran one after the other."
    pinned = ", ".join(f"{arm} on {row.get('cpus', '?')}" for arm, row in result["arms"].items())
    return f"The arms ran side by side, each pinned to its own CPUs: {pinned}."


def join_line(join: dict[str, Any]) -> str:
    """One replacement's phases (:func:`join_phases`) in words."""
    if "to_ready_s" not in join:
        return "never ready (killed or out of time first)"
    parts = [f"ready {join['to_ready_s']:.1f} s after its start (import, model, loaders)"]
    if "ready_to_admitted_s" in join:
        parts.append(f"admitted {join['ready_to_admitted_s']:.2f} s later")
    if "to_training_s" in join:
        parts.append(f"training {join['to_training_s']:.1f} s after its start")
    if join.get("cohort_stall_s") is not None:
        parts.append(f"launch rank 0's admission took {join['cohort_stall_s']:.2f} s")
    return "; ".join(parts) + "."


def build_churn_config(args: Any) -> ChurnConfig:
    """The churn run of a parsed ``python -m lightning_elche.bench`` command line (``--churn`` given)."""
    from dataclasses import replace

    from lightning_elche.bench.config import RIGS, budget_for, settings_for

    rig = RIGS[args.rig]
    if rig.accelerator != "cpu":
        raise _invalid("ChurnConfig(rig", rig.name, "a CPU rig (cpu2, cpu4, cpu8): the churn arms kill CPU rank "
                       "processes", "pass --rig cpu4")
    budget = budget_for(rig, args.budget)
    if args.model is not None:
        budget = replace(budget, model=args.model)
    headline = settings_for(rig, args.slowdowns, args.rank_slowdowns)[0]
    samples = args.tp_epoch_samples or (budget.tp_samples if budget.name == "tiny" else 2048 * rig.world_size)
    from lightning_elche.bench.arms import available_elche_modes

    modes, skipped = available_elche_modes()
    if args.churn_mode not in modes:
        not_built = f"; not built: {', '.join(skipped)}" if skipped else ""
        raise _invalid("ChurnConfig(mode", args.churn_mode, f"an ElChe mode of this build ({', '.join(modes)}"
                       f"{not_built})", "pass e.g. --churn-mode cpu_cadence")
    arms = ARMS if args.churn_arms is None else tuple(a.strip() for a in args.churn_arms.split(",") if a.strip())
    cpu_sets = parse_cpu_sets(args.churn_cpus) if args.churn_cpus else ()
    return ChurnConfig(rate=args.churn, delay_s=args.churn_delay, cpu_sets=cpu_sets,
                       seconds=budget.churn_seconds if args.churn_seconds is None else args.churn_seconds,
                       seed=args.churn_seed, ranks=rig.world_size,
                       slowdowns=tuple(headline.rank_throttle(r)[0] for r in range(rig.world_size)),
                       model=budget.model, batch=args.tp_batch or budget.tp_batch, samples=samples,
                       ckpt_every=args.churn_ckpt_every, mode=args.churn_mode, arms=arms)
