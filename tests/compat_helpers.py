"""Models and callbacks of the compatibility tests (module level, so that spawned ranks unpickle them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torchmetrics
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from model_helpers import RecordingModel
from torch.utils.data import DataLoader


class StopAfterBatch(Callback):
    """Sets ``trainer.should_stop`` on one rank in ``on_train_batch_end``: after the optimizer step,
    where the strategy's hold-back in ``optimizer_step`` has already run."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            trainer.should_stop = True


class RecordException(Callback):
    """Writes each rank's exception type and message (spawn re-raises only one rank's)."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        Path(self.out_dir, f"exception{trainer.global_rank}.json").write_text(
            json.dumps({"type": type(exception).__name__, "message": str(exception)})
        )


class SkipRestOfEpoch(RecordingModel):
    """``on_train_batch_start`` returns -1 (Lightning: skip the rest of the epoch) on one rank."""

    def __init__(self, out_dir: str, rank: int, batch_idx: int) -> None:
        super().__init__(out_dir, val=False)
        self.skip_rank, self.skip_batch = rank, batch_idx

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        if self.global_rank == self.skip_rank and batch_idx == self.skip_batch:
            return -1
        return None


class BatchNormRecordingModel(RecordingModel):
    """``RecordingModel`` with BatchNorm whose record also holds the BatchNorm buffers."""

    def __init__(self, out_dir: str, lr: float = 0.05) -> None:
        super().__init__(out_dir, batchnorm=True, val=False, lr=lr, momentum=0.0)

    def on_train_epoch_start(self) -> None:
        # After SWA's own hook: in the BatchNorm pass these are the averaged weights it runs with
        # (its one optimizer step at the end applies the last epoch's stale gradients).
        self.epoch_start_params = [p.detach().flatten().tolist() for p in self.parameters()]

    def on_fit_end(self) -> None:
        super().on_fit_end()
        path = Path(self.out_dir, f"rank{self.global_rank}.json")
        record = json.loads(path.read_text())
        record["last_epoch_start_params"] = self.epoch_start_params
        bn = self.net[1]
        record["running_mean"] = bn.running_mean.tolist()
        record["running_var"] = bn.running_var.tolist()
        record["num_batches_tracked"] = int(bn.num_batches_tracked)
        path.write_text(json.dumps(record))


def first_layer_mean(record: dict[str, Any], n: int = 512) -> torch.Tensor:
    """The mean of the BatchNorm layer's input over the whole training set, under the weights of the
    last epoch (SWA's BatchNorm pass)."""
    from model_helpers import IndexedRegression

    weight, bias = (torch.tensor(p) for p in record["last_epoch_start_params"][:2])
    x = IndexedRegression(n).x
    return (x @ weight.view(16, 8).T + bias).mean(dim=0)


class EcosystemModel(BoringModel):
    """Lightning's ``BoringModel`` with what a typical project adds: a torchmetrics metric, two
    validation loaders, an epoch-interval StepLR, DataLoader workers; records what every rank ended with."""

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.out_dir = out_dir
        self.train_mse = torchmetrics.MeanSquaredError()

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        output = self(batch)
        self.train_mse(output, torch.ones_like(output))
        self.log("train_mse", self.train_mse, on_step=False, on_epoch=True)
        return self.loss(output)

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.log("val_loss", self.loss(self(batch)), on_epoch=True, sync_dist=True)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 128), batch_size=4, shuffle=True, num_workers=1)

    def val_dataloader(self) -> list[DataLoader]:
        return [DataLoader(RandomDataset(32, 32), batch_size=8), DataLoader(RandomDataset(32, 16), batch_size=8)]

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)}

    def on_fit_end(self) -> None:
        engine = self.trainer.strategy.engine
        Path(self.out_dir, f"rank{self.global_rank}.json").write_text(json.dumps({
            "params": [p.detach().float().flatten().tolist() for p in self.parameters()],
            "callback_metrics": {k: float(v) for k, v in self.trainer.callback_metrics.items()},
            "lr": self.trainer.optimizers[0].param_groups[0]["lr"],
            "rounds": engine.state.rounds,
            "steps": [t.steps for t in engine.state.totals],
        }))


class RecordingBoringModel(BoringModel):
    """Lightning's ``BoringModel`` unchanged, plus a record of each rank's weights and rounds."""

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.out_dir = out_dir

    def on_fit_end(self) -> None:
        engine = self.trainer.strategy.engine
        Path(self.out_dir, f"rank{self.global_rank}.json").write_text(json.dumps({
            "params": [p.detach().flatten().tolist() for p in self.parameters()],
            "rounds": engine.state.rounds,
            "steps": [t.steps for t in engine.state.totals],
        }))
