"""A model and probes for the zero-copy parameter tests, at module level for spawned ranks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class ConvClassifier(LightningModule):
    """A small conv net with BatchNorm (channels_last), trained on fixed random images."""

    def __init__(self, optimizer: str = "adam", compile_backend: str = "", n: int = 256) -> None:
        super().__init__()
        net = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, 4),
        ).to(memory_format=torch.channels_last)
        self.net = torch.compile(net, backend=compile_backend) if compile_backend else net
        self.optimizer = optimizer
        g = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 4, (n,), generator=g))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x.contiguous(memory_format=torch.channels_last)), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=1e-2)
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=16)


def _layout(trainer: Trainer) -> Any:
    return trainer.strategy._engine.plane.layout  # the plane's own record of what it averages


def linked_fraction(trainer: Trainer) -> float:
    """Share of the averaged parameters and buffers whose storage is the plane's flat buffer."""
    layout = _layout(trainer)
    flats = {f.untyped_storage().data_ptr() for f in layout.params.flats + layout.buffers.flats}
    tensors = list(layout.params.tensors) + list(layout.buffers.tensors)
    return sum(t.untyped_storage().data_ptr() in flats for t in tensors) / len(tensors)


class ZeroCopyProbe(Callback):
    """Records, after every batch (rank-local, no collective), whether the averaged tensors still
    live in the plane's flat buffers; at ``rebind_step`` on ``rebind_rank`` it rebinds the first
    weight's ``.data`` to new storage (user code replacing ``p.data``). Writes a JSON record per
    rank at the end of the fit."""

    def __init__(self, out_dir: str, rebind_rank: int = -1, rebind_step: int = -1) -> None:
        self.out_dir = out_dir
        self.rebind_rank = rebind_rank
        self.rebind_step = rebind_step
        self.linked: list[float] = []
        self.rebound_at: int = -1
        self.linked_after_rebind: float = -1.0

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        self.linked.append(linked_fraction(trainer))
        if trainer.global_rank == self.rebind_rank and trainer.global_step == self.rebind_step:
            weight = next(p for p in pl_module.parameters() if p.requires_grad)
            weight.data = weight.detach().clone() * 0.5
            self.rebound_at = len(self.linked)
            self.linked_after_rebind = linked_fraction(trainer)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        record = {
            "rank": trainer.global_rank,
            "linked": self.linked,
            "rebound_at": self.rebound_at,
            "linked_after_rebind": self.linked_after_rebind,
            "params": [p.detach().cpu().flatten().tolist() for p in pl_module.parameters()],
            "buffers": [b.detach().cpu().flatten().tolist() for b in pl_module.buffers() if b.is_floating_point()],
        }
        Path(self.out_dir, f"zero_copy_rank{trainer.global_rank}.json").write_text(json.dumps(record))


def load_probe_records(out_dir: Path, world_size: int = 2) -> list[dict[str, Any]]:
    return [json.loads((out_dir / f"zero_copy_rank{r}.json").read_text()) for r in range(world_size)]
