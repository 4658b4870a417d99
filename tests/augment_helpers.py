"""A transform and a model for the augment tests (spawned ranks must unpickle them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from model_helpers import IndexedRegression, RecordingModel
from torch.utils.data import DataLoader

from lightning_elche import AugmentedDataset, PickKey


def jitter(sample: Any, key: PickKey, generator: torch.Generator) -> Any:
    """Noise on the inputs drawn from the pick's generator; the key rides along for the checks."""
    _, x, y = sample
    noisy = x + 0.1 * torch.randn(x.shape, generator=generator)
    return torch.tensor([key.index, key.repeat, key.epoch]), noisy, y


def augmented(n: int, augment: int) -> AugmentedDataset:
    return AugmentedDataset(IndexedRegression(n), augment=augment, transform=jitter, seed=5)


class AugmentedModel(RecordingModel):
    """Records every trained pick as [index, repeat, epoch] plus its transformed inputs, per rank."""

    def __init__(self, out_dir: str, n: int = 96, augment: int = 3, batch_size: int = 8) -> None:
        super().__init__(out_dir, n=n, batch_size=batch_size, val=False)
        self.augment = augment
        self.picks: list[list[Any]] = []

    def train_dataloader(self) -> DataLoader:
        return DataLoader(augmented(self.n, self.augment), batch_size=self.batch_size, shuffle=True)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        keys, x, y = batch
        for key, row in zip(keys.tolist(), x.tolist(), strict=True):
            self.picks.append([key, row])
        return torch.nn.functional.mse_loss(self(x), y)

    def on_fit_end(self) -> None:
        Path(self.out_dir, f"picks{self.global_rank}.json").write_text(json.dumps(self.picks))
