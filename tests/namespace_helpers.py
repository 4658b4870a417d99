"""A ``pytorch_lightning`` model for the namespace tests (module level: spawned ranks unpickle it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from helpers import IndexedRegression
from torch import nn
from torch.utils.data import DataLoader


class PlRecordingModel(pl.LightningModule):
    """A small MLP on the ``pytorch_lightning`` namespace that records the sample indices each rank trained."""

    def __init__(self, out_dir: str, n: int = 256, batch_size: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.out_dir = out_dir
        self.n = n
        self.batch_size = batch_size
        self.seen: dict[int, list[int]] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        idx, x, y = batch
        self.seen.setdefault(self.current_epoch, []).extend(idx.tolist())
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        _, x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), on_epoch=True, sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(IndexedRegression(self.n), batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(IndexedRegression(64, seed=1), batch_size=32)

    def on_fit_end(self) -> None:
        engine = self.trainer.strategy.engine
        record = {
            "rank": self.global_rank,
            "strategy": type(self.trainer.strategy).__module__ + "." + type(self.trainer.strategy).__qualname__,
            "seen": {str(k): v for k, v in self.seen.items()},
            "params": [p.detach().flatten().tolist() for p in self.parameters()],
            "rounds": engine.state.rounds,
            "steps": [t.steps for t in engine.state.totals],
            "val_loss": float(self.trainer.callback_metrics["val_loss"]),
        }
        Path(self.out_dir, f"rank{self.global_rank}.json").write_text(json.dumps(record))
