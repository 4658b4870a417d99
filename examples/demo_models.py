"""Example LightningModule and LightningDataModule for the lightning-elche demos.

The data are synthetic and made in-process (no downloads): inputs drawn from a normal
distribution, labelled by a fixed random "teacher" MLP, so the task is learnable but not trivial,
and every rank builds exactly the same dataset from ``seed``.

Both classes live at module level so that processes started with ``spawn`` can unpickle them.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset


class TeacherClassification(Dataset):
    """``(x, y)`` pairs: ``x ~ N(0, I)``, ``y`` = argmax of a fixed random teacher MLP.

    ``seed`` fixes the teacher; ``split_seed`` the inputs, so a held-out split with another
    ``split_seed`` shares the labelling rule but not the samples.
    """

    def __init__(
        self, num_samples: int, num_features: int = 64, num_classes: int = 10, seed: int = 0, split_seed: int = 0
    ) -> None:
        teacher_gen = torch.Generator().manual_seed(seed)
        w1 = torch.randn(num_features, 32, generator=teacher_gen) / num_features**0.5
        w2 = torch.randn(32, num_classes, generator=teacher_gen) / 32**0.5
        data_gen = torch.Generator().manual_seed(1_000_003 * (seed + 1) + split_seed)
        self.x = torch.randn(num_samples, num_features, generator=data_gen)
        self.y = (torch.tanh(self.x @ w1) @ w2).argmax(dim=1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        return self.x[index], self.y[index]


class DemoDataModule(LightningDataModule):
    """Synthetic classification data, deterministic from ``seed``.

    Args:
        num_samples: training samples per epoch (over all ranks).
        val_samples: held-out samples (0 = no validation).
        num_features: input dimension.
        num_classes: number of classes.
        batch_size: per-rank batch size.
        seed: fixes the labelling rule and the samples.
    """

    def __init__(
        self,
        num_samples: int = 8192,
        val_samples: int = 1024,
        num_features: int = 64,
        num_classes: int = 10,
        batch_size: int = 64,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.num_samples = num_samples
        self.val_samples = val_samples
        self.num_features = num_features
        self.num_classes = num_classes
        self.batch_size = batch_size
        self.seed = seed
        self.train_set: Optional[TeacherClassification] = None
        self.val_set: Optional[TeacherClassification] = None

    def setup(self, stage: str) -> None:
        # Built in every rank process (never pickled): cheap, and identical everywhere.
        if self.train_set is None:
            self.train_set = self.split(self.num_samples, split_seed=0)
        if self.val_set is None and self.val_samples > 0:
            self.val_set = self.split(self.val_samples, split_seed=1)

    def split(self, n: int, split_seed: int) -> TeacherClassification:
        return TeacherClassification(n, self.num_features, self.num_classes, self.seed, split_seed)

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        # A plain shuffled DataLoader: ElCheStrategy (like DDPStrategy) replaces the sampler itself.
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> Any:
        if self.val_set is None:
            return []
        return DataLoader(self.val_set, batch_size=256)


class DemoModel(LightningModule):
    """An MLP classifier trained with SGD.

    Args:
        num_features: input dimension (linked to the data module's in ``examples/train.py``).
        num_classes: number of classes (linked likewise).
        hidden: width of the hidden layers.
        depth: number of hidden layers.
        lr: SGD learning rate.
        momentum: SGD momentum (optimizer state stays per rank under ElChe).
    """

    def __init__(
        self,
        num_features: int = 64,
        num_classes: int = 10,
        hidden: int = 768,
        depth: int = 2,
        lr: float = 0.05,
        momentum: float = 0.9,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        layers: list[nn.Module] = []
        width = num_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)
        self.lr = lr
        self.momentum = momentum

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        # Epoch-level only: under ElChe ranks take different numbers of steps, so a per-step
        # sync_dist would be rank-local; the epoch value is reduced across ranks at the epoch end.
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True, prog_bar=True)
        self.log("val_acc", (logits.argmax(dim=1) == y).float().mean(), sync_dist=True, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


@torch.no_grad()
def accuracy(model: nn.Module, dataset: TeacherClassification, batch_size: int = 1024) -> float:
    """Plain single-process accuracy of ``model`` on ``dataset`` (no collectives)."""
    was_training = model.training
    model.eval()
    correct = 0
    for start in range(0, len(dataset), batch_size):
        logits = model(dataset.x[start : start + batch_size])
        correct += int((logits.argmax(dim=1) == dataset.y[start : start + batch_size]).sum())
    model.train(was_training)
    return correct / max(len(dataset), 1)
