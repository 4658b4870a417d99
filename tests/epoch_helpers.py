"""An epoch callback that leaves a file per call (spawned ranks must unpickle it)."""

from __future__ import annotations

import json
from pathlib import Path

from lightning.pytorch import Callback, LightningModule, Trainer


class TouchPerEpoch(Callback):
    """Writes ``{hook}-e{epoch}-rank{r}.json`` with the role every rank agreed on; optionally
    runs a barrier (a collective) to show it works under the "all" policy."""

    def __init__(self, out_dir: str, barrier: bool = False) -> None:
        self.out_dir, self.barrier = out_dir, barrier

    def _touch(self, trainer: Trainer, hook: str) -> None:
        if self.barrier:
            trainer.strategy.barrier("epoch callback")
        Path(self.out_dir, f"{hook}-e{trainer.current_epoch}-rank{trainer.global_rank}.json").write_text(
            json.dumps({"role": trainer.strategy.epoch_callback_rank("fastest")})
        )

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._touch(trainer, "start")

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._touch(trainer, "end")


class AskPerEpoch(Callback):
    """A user callback that asks the strategy instead of being wrapped."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.strategy.runs_epoch_callbacks:
            Path(self.out_dir, f"asked-e{trainer.current_epoch}-rank{trainer.global_rank}").write_text("")
