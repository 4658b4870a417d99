"""Models, fault injectors and checks for the preemption and restart tests.

The rank processes run ``tests/scripts/preempt_fit.py``; every rank appends the sample indices of
each step it trained to its own log, flushed at once, so that what a killed rank trained survives
it. A check then rebuilds, per epoch, what ended up in the model: the records of the run that
wrote the checkpoint a resume started from (what the checkpoint's coverage says was trained), plus
everything the resumed run trained.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from multirank_helpers import LAUNCH_TAG, IndexedSamples, kill_tagged
from torch import nn
from torch.utils.data import DataLoader

from lightning_elche.coverage import EpochCoverage, expand
from lightning_elche.dispatch import epoch_permutation

SAMPLES = 512
BATCH_SIZE = 16


class StepLogModel(LightningModule):
    """A tiny MLP; every training step appends ``{"epoch", "indices"}`` to
    ``<out_dir>/steps-<tag>-rank<r>.jsonl`` and flushes it, and ``on_fit_end`` writes the parameters."""

    def __init__(self, out_dir: str, tag: str) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.out_dir, self.tag = out_dir, tag
        self._log: Optional[Any] = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        idx, x, y = batch
        if self._log is None:
            self._log = open(Path(self.out_dir, f"steps-{self.tag}-rank{self.global_rank}.jsonl"), "a")  # noqa: SIM115
        self._log.write(json.dumps({"epoch": self.current_epoch, "indices": idx.tolist()}) + "\n")
        self._log.flush()
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(IndexedSamples(SAMPLES), batch_size=BATCH_SIZE, shuffle=True)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        # Runs only where the Trainer's limit_val_batches allows (preempt_fit.py --validate).
        _, x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), on_epoch=True, sync_dist=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(IndexedSamples(64, seed=1), batch_size=BATCH_SIZE)

    def on_fit_end(self) -> None:
        params = [p.detach().flatten().tolist() for p in self.parameters()]
        Path(self.out_dir, f"params-{self.tag}-rank{self.global_rank}.json").write_text(json.dumps(params))


def signal_self(out_dir: str, signum: int) -> None:
    """Writes the wall time to ``<out_dir>/signal-time.json``, then sends ``signum`` to this process."""
    Path(out_dir, "signal-time.json").write_text(json.dumps({"time": time.time(), "signal": signum}))
    os.kill(os.getpid(), signum)


class SignalAtStep(Callback):
    """Sends ``signum`` to this process on global rank ``rank`` before its optimizer step number
    ``step`` (or, with ``after_rounds``, before its first step once that many sync rounds are
    done, whatever the machine's speed), once; writes the wall time to ``<out_dir>/signal-time.json``."""

    def __init__(self, out_dir: str, rank: int, step: int, signum: int, after_rounds: Optional[int] = None) -> None:
        self.out_dir, self.rank, self.step, self.signum = out_dir, rank, step, signum
        self.after_rounds = after_rounds
        self.sent = False

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if self.sent or trainer.global_rank != self.rank:
            return
        if self.after_rounds is not None:
            progress = trainer.strategy.progress
            if progress is None or progress.rounds < self.after_rounds:
                return
        elif trainer.global_step != self.step:
            return
        self.sent = True
        signal_self(self.out_dir, self.signum)


class SignalInPhase(Callback):
    """Sends ``signum`` to this process on global rank ``rank`` once, in epoch ``epoch``: at its first
    validation batch (``phase="validation"``) or in ``on_train_epoch_end`` (``phase="epoch_end"``);
    writes the wall time to ``<out_dir>/signal-time.json``."""

    def __init__(self, out_dir: str, rank: int, signum: int, phase: str, epoch: int) -> None:
        if phase not in ("validation", "epoch_end"):
            raise ValueError(f"SignalInPhase(phase={phase!r}) is invalid: expected 'validation' or 'epoch_end'.")
        self.out_dir, self.rank, self.signum, self.phase, self.epoch = out_dir, rank, signum, phase, epoch
        self.sent = False

    def _send(self, trainer: Trainer, phase: str) -> None:
        if self.sent or phase != self.phase or trainer.global_rank != self.rank or trainer.current_epoch != self.epoch:
            return
        if trainer.sanity_checking:
            return
        self.sent = True
        signal_self(self.out_dir, self.signum)

    def on_validation_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int,
                                  dataloader_idx: int = 0) -> None:
        self._send(trainer, "validation")

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._send(trainer, "epoch_end")


class SignalWhileSaving(Callback):
    """Sends ``signum`` to this process from inside the first checkpoint save (Lightning calls
    ``on_save_checkpoint`` while it builds the checkpoint), as a repeated launcher signal would."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.sent = False

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        if not self.sent:
            self.sent = True
            os.kill(os.getpid(), self.signum)


def newest_last_checkpoint(directory: Path) -> Optional[Path]:
    """What ``Trainer.fit(ckpt_path="last")`` picks in a ``ModelCheckpoint`` directory."""
    candidates = [p for p in directory.glob("last*.ckpt")] if directory.exists() else []
    return max(candidates, key=lambda p: p.stat().st_mtime) if candidates else None


class DelaySteps(Callback):
    """Rank 1 sleeps a little per step: ranks of different speeds, uneven windows."""

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        time.sleep(0.004 if trainer.global_rank == 1 else 0.001)


def step_records(out_dir: Path, tag: str) -> dict[int, list[int]]:
    """Every index the ranks of run ``tag`` trained, by epoch (all ranks together)."""
    by_epoch: dict[int, list[int]] = {}
    for log in sorted(out_dir.glob(f"steps-{tag}-rank*.jsonl")):
        for line in log.read_text().splitlines():
            row = json.loads(line)
            by_epoch.setdefault(int(row["epoch"]), []).extend(row["indices"])
    return by_epoch


def trained_in_checkpoint(checkpoint: dict[str, Any], first_run: dict[int, list[int]]) -> dict[int, list[int]]:
    """What the model saved in ``checkpoint`` was trained on, by epoch: the first run's records
    of every epoch before the checkpoint's, and of the checkpoint's epoch what its coverage says."""
    epoch = int(checkpoint["epoch"])
    coverage_state = checkpoint["elche"].get("coverage")
    kept = {e: list(indices) for e, indices in first_run.items() if e < epoch}
    if coverage_state is None:  # an epoch-end checkpoint: the whole epoch is in it
        kept[epoch] = list(first_run.get(epoch, []))
        return kept
    coverage = EpochCoverage.from_state_dict(coverage_state)
    order = epoch_permutation(coverage.picks, coverage.epoch, coverage.seed, coverage.shuffle)
    untrained = {order[p] for p in expand(coverage.remaining)} if coverage.remaining is not None else set()
    kept[coverage.epoch] = [i for i in first_run.get(coverage.epoch, []) if i not in untrained]
    return kept


def exactly_once_errors(parts: Sequence[dict[int, list[int]]], epochs: Sequence[int], n: int = SAMPLES) -> list[str]:
    errors = []
    for epoch in epochs:
        trained = sorted(i for part in parts for i in part.get(epoch, []))
        if trained != list(range(n)):
            missing = n - len(set(trained))
            errors.append(f"epoch {epoch}: {missing} never trained, {len(trained) - len(set(trained))} twice")
    return errors


def launch(commands: Sequence[tuple[list[str], dict[str, str]]], log_dir: Path, timeout_s: float,
           ) -> tuple[list[int], str]:
    """Start every command, wait for all (non-zero exits allowed: a stopped job exits non-zero);
    returns their exit codes and logs. Every process the launch started is killed afterwards, and
    the call fails if one is still alive then."""
    import secrets

    import pytest

    log_dir.mkdir(parents=True, exist_ok=True)
    tag = secrets.token_hex(8)
    procs: list[tuple[subprocess.Popen, Path]] = []
    try:
        for k, (command, env) in enumerate(commands):
            log = log_dir / f"launch{k}.log"
            with open(log, "w") as sink:
                procs.append((subprocess.Popen(command, env={**env, LAUNCH_TAG: tag}, stdout=sink,
                                               stderr=subprocess.STDOUT, start_new_session=True), log))
        deadline = time.monotonic() + timeout_s
        for proc, _ in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"the launch did not finish in {timeout_s} s:\n{_tails(procs)}")
        return [proc.returncode for proc, _ in procs], _tails(procs)
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
        survivors = kill_tagged(tag)
        assert not survivors, f"processes left behind by the launch: {survivors}"


def _tails(procs: Sequence[tuple[subprocess.Popen, Path]]) -> str:
    return "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for _, log in procs)
