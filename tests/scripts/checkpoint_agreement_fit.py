"""Rank 0 of a CPU job (Lightning's popen launcher starts the others) whose checkpoints every rank must agree on.

    python checkpoint_agreement_fit.py OUT_DIR --mode M --devices 3 --epochs 3 [--kill RANK:STEP] [--resume last]

A fit with a ``ModelCheckpoint(monitor="val_loss", save_top_k=2, save_last="link")`` in
``OUT_DIR/best`` and an ``ElCheCheckpoint(every_n_syncs=3, save_last=True)`` in ``OUT_DIR/sync``,
ranks of different speeds; ``--kill`` SIGKILLs original rank RANK before its optimizer step STEP
(its own count), ``--resume`` passes ``ckpt_path`` to ``fit``. After the fit every finishing rank
runs ``validate(ckpt_path="last")``, ``test(ckpt_path="best")`` and ``predict(ckpt_path="best")``
and writes ``result-<tag>-rank<original rank>.json``: both callbacks' states, which of the files
they name exist, the checkpoint each evaluation loaded and what it computed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from multirank_helpers import IndexedSamples, StepDelay  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_elche import ElCheCheckpoint, ElCheStrategy  # noqa: E402

ORIGINAL_RANK = int(os.environ.get("LOCAL_RANK", "0"))


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)  # per step, rank-local: in the sync checkpoints' file names
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        _, x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        _, x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(IndexedSamples(384), batch_size=8, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(IndexedSamples(96, seed=1), batch_size=8)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(IndexedSamples(96, seed=2), batch_size=8)

    def predict_dataloader(self) -> DataLoader:
        return self.test_dataloader()


class KillAt(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def state_of(callback: ModelCheckpoint) -> dict[str, Any]:
    named = [callback.best_model_path, callback.last_model_path, callback.kth_best_model_path, *callback.best_k_models]
    return {
        "best_model_path": callback.best_model_path,
        "best_model_score": None if callback.best_model_score is None else float(callback.best_model_score),
        "best_k_models": {path: float(score) for path, score in callback.best_k_models.items()},
        "kth_best_model_path": callback.kth_best_model_path,
        "last_model_path": callback.last_model_path,
        "missing": sorted(path for path in named if path and not os.path.exists(path)),
    }


def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    pl.seed_everything(0)
    out = Path(args.out_dir)
    best = ModelCheckpoint(dirpath=str(out / "best"), monitor="val_loss", save_top_k=2, save_last="link")
    sync = ElCheCheckpoint(dirpath=str(out / "sync"), filename="{epoch}-{step}-{sync}-{train_loss:.4f}",
                           every_n_syncs=3, save_last=True)
    callbacks: list[pl.Callback] = [StepDelay([2.0, 5.0, 3.0]), best, sync]
    if args.kill:
        rank, step = (int(v) for v in args.kill.split(":"))
        if rank == ORIGINAL_RANK:
            callbacks.append(KillAt(step))
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, max_epochs=args.epochs, callbacks=callbacks, logger=False,
        strategy=ElCheStrategy(mode=args.mode, summary=False, liveness_timeout=timedelta(seconds=5),
                               snapshot_timeout=timedelta(seconds=60), timeout=timedelta(seconds=120)),
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=str(out),
    )
    model = Regression()
    trainer.fit(model, ckpt_path=args.resume)
    result: dict[str, Any] = {
        "world_size": trainer.world_size,
        "global_rank": trainer.global_rank,
        "cohort_step": trainer.strategy.progress.cohort_step,
        "best": state_of(best),
        "sync": state_of(sync),
        "files": {"best": sorted(os.listdir(out / "best")), "sync": sorted(os.listdir(out / "sync"))},
    }
    trainer.validate(model, ckpt_path="last")
    result["validate"] = {"ckpt_path": trainer.ckpt_path, "val_loss": float(trainer.callback_metrics["val_loss"])}
    trainer.test(model, ckpt_path="best")
    result["test"] = {"ckpt_path": trainer.ckpt_path, "test_loss": float(trainer.callback_metrics["test_loss"])}
    predictions = trainer.predict(model, ckpt_path="best")
    result["predict"] = {"ckpt_path": trainer.ckpt_path, "batches": len(predictions or [])}
    Path(out, f"result-{args.tag}-rank{ORIGINAL_RANK}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--mode", default="nccl_cadence")
    parser.add_argument("--devices", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--kill", default="")
    parser.add_argument("--resume", default=None)
    parser.add_argument("--tag", default="first")
    main(parser.parse_args())
