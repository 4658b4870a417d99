"""Models and data of the fit tests, at module level so that spawned ranks can unpickle them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, Dataset


def inverse_decay(step: int) -> float:
    """A step-interval LR factor that is easy to check: 1 / (1 + step / 100)."""
    return 1.0 / (1.0 + step / 100.0)


class IndexedRegression(Dataset):
    """``(index, x, y)`` samples of a fixed random linear map plus noise, identical on every rank."""

    def __init__(self, n: int = 512, dim: int = 8, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=g)
        w = torch.randn(dim, 1, generator=g)
        self.y = self.x @ w + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


class RecordingModel(LightningModule):
    """A small MLP that records which sample indices each rank trained, per epoch.

    Validation logs ``val_loss`` with ``sync_dist=True`` (epoch level) so that tests exercise the
    epoch-end collectives that must stay aligned across ranks.
    """

    def __init__(
        self,
        out_dir: str,
        dim: int = 8,
        hidden: int = 16,
        lr: float = 0.05,
        n: int = 512,
        batch_size: int = 16,
        momentum: float = 0.0,
        batchnorm: bool = False,
        val: bool = True,
        log_step_sync: bool = False,
        step_schedule: bool = False,
        one_cycle: bool = False,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(dim, hidden)]
        if batchnorm:
            layers.append(nn.BatchNorm1d(hidden))
        layers += [nn.Tanh(), nn.Linear(hidden, 1)]
        self.net = nn.Sequential(*layers)
        self.out_dir = out_dir
        self.lr = lr
        self.n = n
        self.batch_size = batch_size
        self.momentum = momentum
        self.val = val
        self.log_step_sync = log_step_sync
        self.step_schedule = step_schedule
        self.one_cycle = one_cycle
        self.estimated_stepping_batches: Optional[float] = None
        self.max_steps_in_configure_optimizers: Optional[int] = None
        self.seen: dict[int, list[int]] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        idx, x, y = batch
        self.seen.setdefault(self.current_epoch, []).extend(idx.tolist())
        loss = nn.functional.mse_loss(self(x), y)
        if self.log_step_sync:
            self.log("train_loss_step", loss, on_step=True, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        _, x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), on_epoch=True, sync_dist=True)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)
        self.max_steps_in_configure_optimizers = self.trainer.max_steps
        if self.one_cycle:
            # The usual recipe: size the schedule from the trainer's estimate.
            self.estimated_stepping_batches = self.trainer.estimated_stepping_batches
            one_cycle = torch.optim.lr_scheduler.OneCycleLR(
                optimizer, max_lr=self.lr, total_steps=int(self.estimated_stepping_batches))
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": one_cycle, "interval": "step"}}
        if not self.step_schedule:
            return optimizer
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, inverse_decay)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(IndexedRegression(self.n), batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(IndexedRegression(128, seed=1), batch_size=32)

    def on_fit_end(self) -> None:
        strategy = self.trainer.strategy
        engine = getattr(strategy, "engine", None)
        record: dict[str, Any] = {
            "rank": self.global_rank,
            "seen": {str(k): v for k, v in self.seen.items()},
            "params": [p.detach().cpu().flatten().tolist() for p in self.parameters()],
            "global_step": self.trainer.global_step,
            "current_epoch": self.trainer.current_epoch,
            "callback_metrics": {k: float(v) for k, v in self.trainer.callback_metrics.items()},
            "lr": self.trainer.optimizers[0].param_groups[0]["lr"],
            "schedule_position": [c.scheduler.last_epoch for c in self.trainer.lr_scheduler_configs],
            "estimated_stepping_batches": self.estimated_stepping_batches,
            "max_steps_in_configure_optimizers": self.max_steps_in_configure_optimizers,
            "num_training_batches": self.trainer.num_training_batches,
        }
        if engine is not None:
            record["rounds"] = engine.state.rounds
            record["cohort_step"] = engine.state.cohort_step
            record["steps"] = [t.steps for t in engine.state.totals]
            record["compute_s"] = [t.compute_s for t in engine.state.totals]
            record["mean_stall_ms"] = [t.stall_ms_sum / t.stalls if t.stalls else None for t in engine.state.totals]
            record["batch_counts"] = list(engine.controller.batch_counts)
        Path(self.out_dir, f"rank{self.global_rank}.json").write_text(json.dumps(record))


class WideRegression(RecordingModel):
    """A compute-bound variant for GPUs: wide layers, so that an SM limit really slows a rank."""

    def __init__(self, out_dir: str, dim: int = 1024, hidden: int = 8192, n: int = 16384, batch_size: int = 512,
                 lr: float = 1e-3) -> None:
        super().__init__(out_dir, dim=dim, hidden=hidden, lr=lr, n=n, batch_size=batch_size, val=True)
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                                 nn.Linear(hidden, 1))
        self.dim = dim

    def train_dataloader(self) -> DataLoader:
        return DataLoader(IndexedRegression(self.n, dim=self.dim), batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(IndexedRegression(1024, dim=self.dim, seed=1), batch_size=self.batch_size)
