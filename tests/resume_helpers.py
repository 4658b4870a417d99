"""Callbacks for the 2-process mid-epoch resume tests (spawned ranks must unpickle them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer


class RecordSaves(Callback):
    """At every checkpoint, writes what this rank had trained of the epoch and what it had claimed."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        strategy = trainer.strategy
        epoch = trainer.current_epoch
        record = {
            "epoch": epoch,
            "sync": strategy.engine.state.rounds,
            "trained": list(pl_module.seen.get(epoch, [])),
            "claimed": strategy._sampler.record.samples,
            "params": [p.detach().cpu().flatten().tolist() for p in pl_module.parameters()],
        }
        path = Path(self.out_dir, f"save-e{epoch}-s{record['sync']}-rank{trainer.global_rank}.json")
        path.write_text(json.dumps(record))


class RecordStart(Callback):
    """Writes the restored ElChe state each rank starts training with."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        engine = trainer.strategy.engine
        Path(self.out_dir, f"start{trainer.global_rank}.json").write_text(json.dumps({
            "rounds": engine.state.rounds,
            "cohort_step": engine.state.cohort_step,
            "controller": engine.controller.state_dict(),
            "current_epoch": trainer.current_epoch,
        }))


class RecordEpochEnds(Callback):
    """Writes, at each training epoch's end on every rank, the epoch-level metrics it ended with
    (``epoch-end-e{epoch}-rank{r}.json``): a rank that skipped an epoch's end leaves no file."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        Path(self.out_dir, f"epoch-end-e{trainer.current_epoch}-rank{trainer.global_rank}.json").write_text(
            json.dumps(metrics))
