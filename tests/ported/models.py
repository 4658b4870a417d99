"""Demo models of the ported tests, re-created after Lightning's test helpers.

Lightning's tests cut an epoch with ``limit_train_batches=N``; ElChe refuses a per-rank batch limit
(ranks take as many batches as their speed earns), so the ported tests give the model a training
set of ``N`` batches instead: the epoch a single device would train, which 2 ElChe ranks share.
With ``{step}`` (the cohort step: all ranks' optimizer steps) checkpoint names are then the ones
Lightning's single-device tests expect.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch import nn
from torch.utils.data import DataLoader, Dataset


class SizedBoringModel(BoringModel):
    """Lightning's ``BoringModel`` with the sizes of its data sets as arguments (batch size 1, as there)."""

    def __init__(self, train: int = 64, val: int = 64, test: int = 64, predict: int = 64, batch_size: int = 1) -> None:
        super().__init__()
        self.sizes = {"train": train, "val": val, "test": test, "predict": predict}
        self.batch_size = batch_size

    def _loader(self, stage: str) -> DataLoader:
        return DataLoader(RandomDataset(32, self.sizes[stage]), batch_size=self.batch_size)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train")

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")

    def predict_dataloader(self) -> DataLoader:
        return self._loader("predict")


class LogInTwoMethods(SizedBoringModel):
    """Lightning's ``LogInTwoMethods`` (tests/checkpointing/test_model_checkpoint.py): logs the training
    loss per step as ``early_stop_on`` (rank-local) and a constant ``val_acc`` at validation epoch end."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        self.log("early_stop_on", out["loss"])
        return out

    def on_validation_epoch_end(self) -> None:
        self.log("val_acc", torch.tensor(1.23))


class ValLossModel(SizedBoringModel):
    """``BoringModel`` that logs its validation loss as ``val_loss`` (epoch mean, synced over the ranks)."""

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        loss = self.step(batch)
        self.log("val_loss", loss, sync_dist=True)
        return {"x": loss}


class ScheduledValues(SizedBoringModel):
    """Logs ``name`` = ``values[current_epoch]`` at the validation epoch end (Lightning's
    ``EarlyStoppingTestRestore``-style models feed a fixed sequence of monitor values)."""

    def __init__(self, values: list[float], name: str = "val_loss", **sizes: Any) -> None:
        super().__init__(**sizes)
        self.values, self.name = list(values), name

    def on_validation_epoch_end(self) -> None:
        self.log(self.name, torch.tensor(self.values[self.current_epoch]))


class ClassificationData(Dataset):
    """A fixed, separable 3-class problem (Lightning's helpers build one with scikit-learn)."""

    def __init__(self, n: int, seed: int = 0, dim: int = 8, classes: int = 3) -> None:
        centers = 3.0 * torch.randn(classes, dim, generator=torch.Generator().manual_seed(1234))  # every split's
        self.y = torch.arange(n) % classes
        self.x = centers[self.y] + torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class ClassifDataModule(LightningDataModule):
    """Lightning's ``ClassifDataModule`` (tests/helpers/datamodules.py), without scikit-learn."""

    def __init__(self, batch_size: int = 16, train: int = 192, val: int = 64, test: int = 64) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.sizes = (train, val, test)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(ClassificationData(self.sizes[0], seed=0), batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(ClassificationData(self.sizes[1], seed=1), batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(ClassificationData(self.sizes[2], seed=2), batch_size=self.batch_size)

    def predict_dataloader(self) -> DataLoader:
        return self.test_dataloader()


class ClassificationModel(BoringModel):
    """Lightning's ``ClassificationModel`` (tests/helpers/simple_models.py): an MLP, accuracy logged
    with ``sync_dist`` at epoch level."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.lr = lr
        self.layer = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def _shared(self, batch: Any, stage: str) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        acc = (logits.argmax(dim=1) == y).float().mean()
        on_step = stage == "train"
        self.log(f"{stage}_loss", loss, on_step=on_step, on_epoch=True, sync_dist=True, prog_bar=True)
        self.log(f"{stage}_acc", acc, on_step=on_step, on_epoch=True, sync_dist=True, prog_bar=True)
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._shared(batch, "train")

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._shared(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._shared(batch, "test")

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        return self(batch[0]).argmax(dim=1)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def listdir(path: Any) -> set[str]:
    import os

    return set(os.listdir(path))


def same_on_every_rank(value: Any, what: str, world_size: int = 2) -> None:
    """Assert that every rank holds ``value`` (one all_gather_object; call it on every rank)."""
    import torch.distributed as dist

    gathered: list[Optional[Any]] = [None] * world_size
    dist.all_gather_object(gathered, value)
    assert all(v == gathered[0] for v in gathered), f"{what} differs between ranks: {gathered}"
