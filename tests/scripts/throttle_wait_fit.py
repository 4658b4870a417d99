"""One rank of a 2-rank Lightning DDP fit on gloo where rank 0 reaches every forward 0.2 s late
and rank 1 is throttled 2x: rank 1 writes its throttle's sleep per step to ``OUT/rank1.json``.

DDP's forward first broadcasts the BatchNorm buffers, so rank 1 waits there for rank 0 each
step: the throttle must not count that wait as rank 1's compute (``tests/test_throttle.py``)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_elche.testing import Throttle

STEPS = 8
LATE_S = 0.2


class Net(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Late(Callback):
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank == 0:
            time.sleep(LATE_S)


def main(out: Path) -> None:
    torch.manual_seed(0)
    throttle = Throttle(1, 2.0)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=STEPS,
        callbacks=[Late(), throttle],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(Net(), DataLoader(TensorDataset(torch.randn(32 * STEPS, 16)), batch_size=32))
    if trainer.global_rank == 1:
        (out / "rank1.json").write_text(
            json.dumps(
                {"sleep_per_step_s": throttle.sleep_s / STEPS, "late_s": LATE_S, "method": throttle.active_method}
            )
        )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
