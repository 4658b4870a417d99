"""Callbacks that inject a fault on one rank (a stop, a crash, silence, a mismatched knob) or
record what a fit did when it ended (rounds, collectives)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer


class StopAtStep(Callback):
    """Requests a stop on one rank mid-window, the way a user callback or SIGTERM would, once, at
    its first step from ``step`` on; with ``out_dir``, writes the rounds done by then
    (``stop-rounds.json``)."""

    def __init__(self, rank: int, step: int, sigterm: bool = False, out_dir: str | None = None) -> None:
        self.rank = rank
        self.step = step
        self.sigterm = sigterm
        self.out_dir = out_dir
        self.sent = False

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if self.sent or trainer.global_rank != self.rank or trainer.global_step < self.step:
            return
        self.sent = True
        if self.out_dir is not None:
            Path(self.out_dir, "stop-rounds.json").write_text(json.dumps(trainer.strategy.engine.state.rounds))
        if self.sigterm:
            os.kill(os.getpid(), 15)
        else:
            trainer.should_stop = True


class RecordRounds(Callback):
    """Writes each rank's round count when fit ends by an exception (spawn returns only one error)."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        engine = trainer.strategy.engine
        Path(self.out_dir, f"exception{trainer.global_rank}.json").write_text(
            json.dumps({"type": type(exception).__name__, "rounds": engine.state.rounds if engine else -1})
        )


class CountCollectives(Callback):
    """Counts torch.distributed collectives issued between train start and train end."""

    NAMES = ("all_reduce", "all_gather_into_tensor", "all_gather_single", "broadcast", "all_gather", "barrier")

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.counts: dict[str, int] = {}
        self._originals: dict[str, Any] = {}

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        import torch.distributed as dist

        for name in self.NAMES:
            original = getattr(dist, name, None)
            if original is None:
                continue
            self._originals[name] = original
            self.counts[name] = 0

            def counted(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
                self.counts[_name] += 1
                return _original(*args, **kwargs)

            setattr(dist, name, counted)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        import torch.distributed as dist

        for name, original in self._originals.items():
            setattr(dist, name, original)
        engine = trainer.strategy.engine
        realized = engine.state.rounds  # every round in this test has movers
        Path(self.out_dir, f"collectives{trainer.global_rank}.json").write_text(
            json.dumps({"counts": self.counts, "rounds": engine.state.rounds, "realized": realized})
        )


class FlipBf16Wire(Callback):
    """Sets ``bf16_wire`` on one rank only (before the strategy builds its plane): a mismatched cohort."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if trainer.global_rank == self.rank:
            trainer.strategy.elche.bf16_wire = True


class GoSilent(Callback):
    """One rank stops answering (sleeps) at a given step, as a hung or preempted peer would."""

    def __init__(self, rank: int, step: int, seconds: float) -> None:
        self.rank, self.step, self.seconds = rank, step, seconds

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            import time

            time.sleep(self.seconds)


class RaiseAtStep(Callback):
    """Raises ``exception`` on one rank at a given step (a crash, or Ctrl-C)."""

    def __init__(self, rank: int, step: int, exception: BaseException) -> None:
        self.rank, self.step, self.exception = rank, step, exception

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            raise self.exception
