"""Models and callbacks for the bf16-wire and frozen-parameter tests (spawned ranks must unpickle them)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset


def fine_tuning_regression(n: int = 512, dim: int = 16, seed: int = 0) -> tuple[Dataset, torch.Tensor, torch.Tensor]:
    """Noise-free targets of a linear map whose weights are of order 1 and close to a given start:
    the regime where rounding the weights to bf16 (spacing 2⁻⁷ in [1, 2)) freezes the updates.
    Returns the data set and the start (weight, bias)."""
    g = torch.Generator().manual_seed(seed)
    start_w = 1.0 + 0.5 * torch.rand(1, dim, generator=g)
    start_b = torch.tensor([1.25])
    target_w = start_w + 0.05 * torch.randn(1, dim, generator=g)
    target_b = start_b + 0.05
    x = torch.randn(n, dim, generator=g)
    y = x @ target_w.T + target_b
    return TensorDataset(x, y), start_w, start_b


class FineTuneRegression(LightningModule):
    """A linear model started at order-1 weights near the solution, trained with a small lr.

    Writes, per rank, the final full-data loss and the parameters to ``out_dir/wire{rank}.json``."""

    def __init__(self, out_dir: str, lr: float = 0.05, n: int = 512, dim: int = 16) -> None:
        super().__init__()
        self.data, start_w, start_b = fine_tuning_regression(n, dim)
        self.linear = nn.Linear(dim, 1)
        with torch.no_grad():
            self.linear.weight.copy_(start_w)
            self.linear.bias.copy_(start_b)
        self.out_dir, self.lr = out_dir, lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.linear(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=16, shuffle=True)

    def on_fit_end(self) -> None:
        x, y = (t.to(self.device) for t in self.data.tensors)
        with torch.no_grad():
            loss = nn.functional.mse_loss(self.linear(x), y).item()
        record = {"loss": loss, "params": [p.detach().flatten().tolist() for p in self.parameters()],
                  "rounds": self.trainer.strategy.engine.state.rounds}
        Path(self.out_dir, f"wire{self.global_rank}.json").write_text(json.dumps(record))


class BackboneRegression(LightningModule):
    """A wide frozen backbone (Linear + BatchNorm) under a small trainable head.

    ``frozen``: freeze the backbone's parameters at construction. ``unfreeze_at_epoch``: set
    ``requires_grad`` back on in ``on_train_epoch_start`` of that epoch, on every rank or only on
    ``unfreeze_rank``. ``trainable_only``: give the optimizer only the trainable parameters (what
    Lightning's ``BackboneFinetuning`` expects: it adds the backbone's group itself). Writes the
    initial and final parameters by name, the rounds and the plane's ``round_bytes`` to
    ``out_dir/frozen{rank}.json``.
    """

    def __init__(self, out_dir: str, frozen: bool = True, unfreeze_at_epoch: Optional[int] = None,
                 unfreeze_rank: Optional[int] = None, trainable_only: bool = False, dim: int = 32,
                 hidden: int = 256, n: int = 512) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, dim, generator=g)
        self.y = torch.tanh(self.x[:, :1]) + 0.1 * torch.randn(n, 1, generator=g)
        self.backbone = nn.Sequential(nn.Linear(dim, hidden), nn.BatchNorm1d(hidden), nn.Tanh())
        self.head = nn.Linear(hidden, 1)
        if frozen:
            self.backbone.requires_grad_(False)
        self.out_dir = out_dir
        self.unfreeze_at_epoch, self.unfreeze_rank = unfreeze_at_epoch, unfreeze_rank
        self.trainable_only = trainable_only
        self.initial = {name: p.detach().clone() for name, p in self.named_parameters()}
        self.round_bytes: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(self.backbone(x)), y)

    def configure_optimizers(self) -> Any:
        if self.trainable_only:
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.05)
        # All parameters: an unfrozen backbone is then trained without rebuilding the optimizer.
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=16, shuffle=True)

    def on_train_epoch_start(self) -> None:
        if self.current_epoch == self.unfreeze_at_epoch and self.unfreeze_rank in (None, self.global_rank):
            self.backbone.requires_grad_(True)

    def on_train_epoch_end(self) -> None:
        self.round_bytes.append(self.trainer.strategy.engine.plane.round_bytes)

    def on_fit_end(self) -> None:
        record = {
            "initial": {name: p.flatten().tolist() for name, p in self.initial.items()},
            "final": {name: p.detach().flatten().tolist() for name, p in self.named_parameters()},
            "rounds": self.trainer.strategy.engine.state.rounds,
            "round_bytes": self.round_bytes,
        }
        Path(self.out_dir, f"frozen{self.global_rank}.json").write_text(json.dumps(record))


class GrowingHead(BackboneRegression):
    """:class:`BackboneRegression`, trainable, that adds a module at the start of epoch
    ``grow_at_epoch`` on every rank (a second head, put in the optimizer, as
    ``BackboneFinetuning`` adds a group): ElChe must average it from that epoch on."""

    def __init__(self, out_dir: str, grow_at_epoch: int = 1) -> None:
        super().__init__(out_dir, frozen=False)
        self.grow_at_epoch = grow_at_epoch
        self.extra: Optional[nn.Module] = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        features = self.backbone(x)
        out = self.head(features) if self.extra is None else self.head(features) + self.extra(features)
        return nn.functional.mse_loss(out, y)

    def on_train_epoch_start(self) -> None:
        if self.current_epoch == self.grow_at_epoch:
            torch.manual_seed(1)  # the same new module on every rank
            self.extra = nn.Linear(self.head.in_features, 1)
            self.trainer.optimizers[0].add_param_group({"params": list(self.extra.parameters())})


class CountWireBytes(Callback):
    """Sums the bytes every torch.distributed collective of training puts on the wire from this rank
    (the CPU plane's thread included), and writes them with the round count at train end."""

    NAMES = ("all_reduce", "all_gather_into_tensor", "all_gather_single", "all_gather", "broadcast")

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.bytes = 0
        self._lock: Optional[threading.Lock] = None  # made in the rank: a lock does not pickle
        self._originals: dict[str, Any] = {}

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        import torch.distributed as dist

        lock = self._lock = threading.Lock()

        for name in self.NAMES:
            original = getattr(dist, name, None)
            if original is None:
                continue
            self._originals[name] = original

            def counted(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
                # The sent tensor is the first argument, or the second for the gathers into an output.
                sent = args[1] if _name != "all_reduce" and _name != "broadcast" else args[0]
                with lock:
                    self.bytes += sent.numel() * sent.element_size()
                return _original(*args, **kwargs)

            setattr(dist, name, counted)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        import torch.distributed as dist

        for name, original in self._originals.items():
            setattr(dist, name, original)
        Path(self.out_dir, f"bytes{trainer.global_rank}.json").write_text(
            json.dumps({"bytes": self.bytes, "rounds": trainer.strategy.engine.state.rounds}))


def load(out_dir: Path, prefix: str, world_size: int = 2) -> list[dict[str, Any]]:
    return [json.loads((out_dir / f"{prefix}{r}.json").read_text()) for r in range(world_size)]


def fit_with_rank_local_unfreeze(rank: int, out_dir: str, port: int) -> None:
    """A rank of a 2-process ``nccl_cadence`` fit (``torch.multiprocessing.spawn``) in which only rank
    1 unfreezes the backbone at epoch 1; writes the error each rank ends with."""
    import os
    from datetime import timedelta

    from lightning_elche import ElCheStrategy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0",
                      LOCAL_RANK=str(rank), RANK=str(rank))
    trainer = Trainer(accelerator="cpu", devices=2, max_epochs=3, logger=False, enable_checkpointing=False,
                      strategy=ElCheStrategy(mode="nccl_cadence", timeout=timedelta(seconds=20)),
                      enable_progress_bar=False, enable_model_summary=False)
    error, message = None, ""
    try:
        trainer.fit(BackboneRegression(out_dir, unfreeze_at_epoch=1, unfreeze_rank=1))
    except BaseException as exc:  # noqa: BLE001 (what each rank ends with is the point)
        error, message = type(exc).__name__, str(exc)
    engine = trainer.strategy.engine
    Path(out_dir, f"error{rank}.json").write_text(json.dumps({
        "error": error, "message": message, "rounds": engine.state.rounds if engine is not None else -1}))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
