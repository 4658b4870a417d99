"""Models, callbacks, launch plumbing and checks for the tests that run more than two ranks or nodes.

The rank processes of those tests run scripts under ``tests/scripts/`` (launched by the tests as
subprocesses, so that a hang can be killed with everything it started); both sides import this
module. It is self-contained on purpose: the 2-rank helpers are free to change shape.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only
from torch import nn
from torch.utils.data import DataLoader, Dataset

MODES = ("nccl_sync", "nccl_cadence", "cpu_sync", "cpu_cadence", "cpu_async")
POOLED_MODES = ("nccl_cadence", "cpu_cadence", "cpu_async")
STEP_DELAYS_MS = (2.0, 4.0, 8.0, 3.0)
"""Per-step sleeps by rank (repeated over the ranks): the pattern issue 13 found losses with."""


class IndexedSamples(Dataset):
    """``(index, x, y)`` samples of a fixed random linear map, identical on every rank."""

    def __init__(self, n: int, dim: int = 8, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=generator)
        self.y = self.x @ torch.randn(dim, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


class CoverageModel(LightningModule):
    """A tiny MLP that records every sample index it trains, per epoch, and writes at the end of fit
    ``<out_dir>/rank<global rank>.json``: the indices, the parameters and the engine's counters."""

    def __init__(self, out_dir: str, n: int, batch_size: int, lr: float = 0.05) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.out_dir, self.n, self.batch_size, self.lr = out_dir, n, batch_size, lr
        self.seen: dict[int, list[int]] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        idx, x, y = batch
        self.seen.setdefault(self.current_epoch, []).extend(idx.tolist())
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(IndexedSamples(self.n), batch_size=self.batch_size, shuffle=True)

    def on_fit_end(self) -> None:
        engine = self.trainer.strategy.engine
        record = {
            "rank": self.global_rank,
            "seen": {str(epoch): indices for epoch, indices in self.seen.items()},
            "params": [p.detach().flatten().tolist() for p in self.parameters()],
            "current_epoch": self.trainer.current_epoch,
            "rounds": engine.state.rounds,
            "cohort_step": engine.state.cohort_step,
            "steps": [t.steps for t in engine.state.totals],
        }
        Path(self.out_dir).mkdir(parents=True, exist_ok=True)
        Path(self.out_dir, f"rank{self.global_rank}.json").write_text(json.dumps(record))


class StepDelay(Callback):
    """Each rank sleeps ``delays_ms[rank % len(delays_ms)]`` after every backward pass: ranks of
    different speeds on identical cores. The sleep frees the core, as a slower device would."""

    def __init__(self, delays_ms: Sequence[float] = STEP_DELAYS_MS) -> None:
        self.delays_ms = tuple(delays_ms)

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        time.sleep(self.delays_ms[trainer.global_rank % len(self.delays_ms)] / 1000.0)


class RankIdentity(Callback):
    """Writes what this process believes about itself, to check that a multi-node launch gives
    every process its global rank (and rank-zero-only code the right process)."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        import torch.distributed as dist

        Path(self.out_dir).mkdir(parents=True, exist_ok=True)
        Path(self.out_dir, f"identity{trainer.global_rank}.json").write_text(json.dumps({
            "global_rank": trainer.global_rank,
            "dist_rank": dist.get_rank(),
            "local_rank": trainer.local_rank,
            "node_rank": trainer.node_rank,
            "world_size": trainer.world_size,
            "rank_zero_only_rank": rank_zero_only.rank,
            "is_global_zero": trainer.is_global_zero,
            "environment": type(trainer.strategy.cluster_environment).__name__,
        }))


class JsonLinesLogger(Logger):
    """A logger that appends one JSON line per ``log_metrics`` call to ``<file_stem>-rank<r>.jsonl``
    under ``out_dir``, in every process (unlike Lightning's loggers it is not rank-zero-only, so it
    shows who logs what). Subclasses say what a line holds (:meth:`line`)."""

    file_stem = "calls"
    rank_outside_a_group = -1

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.out_dir = out_dir

    @property
    def name(self) -> str:
        return self.file_stem

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def line(self, metrics: dict[str, float], step: Optional[int]) -> dict[str, Any]:
        raise NotImplementedError

    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else self.rank_outside_a_group
        Path(self.out_dir).mkdir(parents=True, exist_ok=True)
        with open(Path(self.out_dir, f"{self.file_stem}-rank{rank}.jsonl"), "a") as sink:
            sink.write(json.dumps(self.line(metrics, step)) + "\n")


class CallRecordingLogger(JsonLinesLogger):
    """Records the keys of every ``log_metrics`` call of every process, with the caller's global rank."""

    def line(self, metrics: dict[str, float], step: Optional[int]) -> dict[str, Any]:
        return {"step": step, "keys": sorted(metrics)}


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def load_rank_records(out_dir: Path, world_size: int) -> list[dict[str, Any]]:
    missing = [r for r in range(world_size) if not (out_dir / f"rank{r}.json").exists()]
    assert not missing, f"{out_dir}: no record from rank(s) {missing}"
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]


def coverage_errors(records: Sequence[dict[str, Any]], n: int, epochs: Sequence[int]) -> list[str]:
    """What breaks "every sample of every epoch trained exactly once over all ranks" (empty: nothing)."""
    errors = []
    extra = sorted({e for r in records for e in r["seen"]} - {str(e) for e in epochs})
    if extra:
        errors.append(f"trained in epochs {extra}, expected only {list(epochs)}")
    for epoch in epochs:
        trained: list[int] = []
        for record in records:
            trained += record["seen"].get(str(epoch), [])
        counts: dict[int, int] = {}
        for index in trained:
            counts[index] = counts.get(index, 0) + 1
        missing = [i for i in range(n) if i not in counts]
        repeated = sorted(i for i, c in counts.items() if c > 1)
        alien = sorted(i for i in counts if not 0 <= i < n)
        if missing or repeated or alien:
            errors.append(f"epoch {epoch}: {len(missing)} samples never trained (first {missing[:8]}), "
                          f"{len(repeated)} trained more than once (first {repeated[:8]}), out of range {alien[:8]}")
    return errors


def assert_same_parameters(records: Sequence[dict[str, Any]]) -> None:
    differing = [r["rank"] for r in records if r["params"] != records[0]["params"]]
    assert not differing, f"rank(s) {differing} end with parameters that differ from rank 0's"


@dataclass
class Launched:
    """A started command and the file its output goes to."""

    proc: subprocess.Popen
    log: Path


def clean_environment() -> dict[str, str]:
    """This process's environment without any launcher's or cluster's variables (the test may
    itself run under one), with this checkout first on the import path."""
    inherited = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
                 "MASTER_PORT", "JSM_NAMESPACE_RANK", "OMPI_COMM_WORLD_RANK")
    prefixes = ("SLURM_", "PMI_", "LSB_", "TORCHELASTIC_")
    env = {k: v for k, v in os.environ.items() if k not in inherited and not k.startswith(prefixes)}
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    # Small CPU ops: one thread per process keeps N ranks from fighting over the cores.
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


LAUNCH_TAG = "ELCHE_TEST_LAUNCH"
"""Environment variable set to a fresh value for every launch: every process a launch starts
inherits it (torchrun puts its workers in sessions of their own, so sessions cannot find them)."""


def run_together(commands: Sequence[tuple[list[str], dict[str, str]]], log_dir: Path, timeout_s: float) -> str:
    """Start every command at once and wait for all of them; returns the tail of their logs.

    Fails (with the logs) when one exits non-zero or when they do not all finish within
    ``timeout_s``. In every case every process the launch started, however deep, is killed
    afterwards, and the call fails if one is still alive then: nothing outlives the test.
    """
    import secrets

    import pytest

    log_dir.mkdir(parents=True, exist_ok=True)
    tag = secrets.token_hex(8)
    launched: list[Launched] = []
    try:
        for k, (command, env) in enumerate(commands):
            log = log_dir / f"launch{k}.log"
            with open(log, "w") as sink:
                proc = subprocess.Popen(command, env={**env, LAUNCH_TAG: tag}, stdout=sink, stderr=subprocess.STDOUT,
                                        start_new_session=True)
            launched.append(Launched(proc, log))
        deadline = time.monotonic() + timeout_s
        for item in launched:
            try:
                item.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"the launch did not finish in {timeout_s} s:\n{logs_tail(launched)}")
        failed = [k for k, item in enumerate(launched) if item.proc.returncode != 0]
        if failed:
            pytest.fail(f"launch(es) {failed} exited with {[launched[k].proc.returncode for k in failed]}:\n"
                        f"{logs_tail(launched)}")
        return logs_tail(launched)
    finally:
        for item in launched:
            if item.proc.poll() is None:
                item.proc.kill()
                item.proc.wait()
        survivors = kill_tagged(tag)
        assert not survivors, f"processes left behind by the launch: {survivors}"


def launch_logged(command: Sequence[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    """Start ``command`` in a session of its own, its output to ``log_path``."""
    with open(log_path, "w") as sink:
        return subprocess.Popen(list(command), env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for_launch(proc: subprocess.Popen, tag: str, log_path: Path, timeout_s: float, what: str = "rank 0") -> None:
    """Wait for ``proc`` (failing the test after ``timeout_s``), then for every process of the
    launch ``tag`` for as long again: a lost rank 0's peers go on without it."""
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what} did not finish in {timeout_s} s:\n{log_path.read_text()[-4000:]}")
    deadline = time.monotonic() + timeout_s
    while tagged_processes(tag) and time.monotonic() < deadline:
        time.sleep(0.2)


def end_launch(procs: Sequence[subprocess.Popen], tag: str) -> None:
    """Kill whatever of the launch ``tag`` is still alive; fail if a process cannot be killed."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    still = kill_tagged(tag)
    assert not still, f"processes that could not be killed: {still}"


def kill_tagged(tag: str, grace_s: float = 10.0) -> list[int]:
    """SIGKILL every live process whose environment carries ``LAUNCH_TAG=tag``; returns those
    still alive after ``grace_s`` (zombies waiting to be reaped do not count)."""
    deadline = time.monotonic() + grace_s
    while True:
        alive = tagged_processes(tag)
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def tagged_processes(tag: str) -> list[int]:
    marker = f"{LAUNCH_TAG}={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in environ.split(b"\0") and state not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def logs_tail(launched: Sequence[Launched], chars: int = 3000) -> str:
    parts = []
    for k, item in enumerate(launched):
        text = item.log.read_text(errors="replace") if item.log.exists() else ""
        parts.append(f"--- launch {k} (exit {item.proc.returncode}) ---\n{text[-chars:]}")
    return "\n".join(parts)


def rank_results(out: Path) -> dict[int, dict[str, Any]]:
    """Each rank's ``result-rank<k>.json`` under ``out`` (written by ``scripts/fault_fit.py``), by rank."""
    return {int(p.stem.removeprefix("result-rank")): json.loads(p.read_text()) for p in out.glob("result-rank*.json")}
