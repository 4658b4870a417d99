"""The fit's evaluation loop run again from its start after an error the survivors recovered from
(``loop_glue.run_evaluation_again_after``), in one process: what the interrupted run left (its
logged results, batch counters, data fetcher, the module's eval mode) is gone, the hooks run again,
and what is logged is the new run's alone. The multi-process contract is tests/test_validation_loss.py.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
import pytest
import torch
from multirank_helpers import IndexedSamples
from torch import nn
from torch.utils.data import DataLoader

from lightning_elche.checked_collectives import CollectiveMismatch
from lightning_elche.loop_glue import run_evaluation_again_after
from lightning_elche.membership.change import PeerFailure

VAL_SAMPLES, BATCH = 40, 8


class Interrupted(pl.LightningModule):
    """Raises a lost-peer error at validation batch ``at_batch`` of the runs named in ``interrupt``
    (``"sanity"`` or an epoch), once each; records what every run saw."""

    def __init__(self, interrupt: set[Any], at_batch: int = 2, error: Optional[BaseException] = None) -> None:
        super().__init__()
        self.net = nn.Linear(8, 1)
        self.interrupt, self.at_batch = set(interrupt), at_batch
        self.error = error or CollectiveMismatch("a peer was lost", PeerFailure("rank 1 is gone"))
        self.starts: list[Any] = []
        self.trained_in_train_mode: list[bool] = []
        self.val_counts: dict[Any, float] = {}

    def run_name(self) -> Any:
        return "sanity" if self.trainer.sanity_checking else self.current_epoch

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.trained_in_train_mode.append(self.training)
        _, x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def on_validation_epoch_start(self) -> None:
        self.starts.append(self.run_name())

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        idx, x, y = batch
        self.log("val_count", float(len(idx)), on_step=False, on_epoch=True, reduce_fx="sum")
        if batch_idx == self.at_batch and self.run_name() in self.interrupt:
            self.interrupt.discard(self.run_name())
            raise self.error

    def on_validation_end(self) -> None:
        self.val_counts[self.run_name()] = float(self.trainer.callback_metrics["val_count"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(IndexedSamples(32), batch_size=BATCH)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(IndexedSamples(VAL_SAMPLES), batch_size=BATCH)


class RunAgain(pl.Callback):
    """Installs the patch for the fit; ``recovered`` says yes to the lost-peer error and records its context."""

    def __init__(self) -> None:
        self.recoveries: list[dict[str, bool]] = []
        self.runs: list[str] = []
        self.undo: Any = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.undo = run_evaluation_again_after(trainer, self)

    def starting(self) -> None:
        self.runs.append("starting")

    def finished(self) -> None:
        self.runs.append("finished")

    def recovered(self, error: BaseException) -> bool:
        if not isinstance(error, CollectiveMismatch) or error.lost is None:
            return False
        self.recoveries.append({"grad": torch.is_grad_enabled(), "inference": torch.is_inference_mode_enabled()})
        return True


def fit(module: Interrupted, callback: RunAgain, epochs: int = 2) -> pl.Trainer:
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, callbacks=[callback], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=-1)
    trainer.fit(module)
    return trainer


def test_an_interrupted_validation_and_sanity_check_run_again_whole():
    module, callback = Interrupted({"sanity", 0}), RunAgain()
    trainer = fit(module, callback)
    assert module.starts == ["sanity", "sanity", 0, 0, 1], "each interrupted run starts again from its first hook"
    assert module.val_counts == {"sanity": VAL_SAMPLES, 0: VAL_SAMPLES, 1: VAL_SAMPLES}, "nothing of a run kept"
    assert all(module.trained_in_train_mode) and module.trained_in_train_mode, "eval mode undone"
    # The recovery runs outside the run's no-grad or inference context: the regroup may build tensors.
    assert callback.recoveries == [{"grad": True, "inference": False}] * 2
    assert callback.runs == ["starting", "finished"] * 3, "a run and its redo are one run"
    val_loop = trainer.fit_loop.epoch_loop.val_loop
    assert val_loop.batch_progress.current.completed == VAL_SAMPLES // BATCH, "the counters of the last run only"
    callback.undo()
    assert "run" not in vars(val_loop), "the undo gives the loop its class's method back"


@pytest.mark.parametrize("error", [RuntimeError("not a collective"), CollectiveMismatch("called differently")])
def test_an_error_that_was_not_survived_goes_on(error: BaseException):
    module, callback = Interrupted({0}, error=error), RunAgain()
    with pytest.raises(type(error), match=str(error)):
        fit(module, callback, epochs=1)
    assert callback.recoveries == [] and module.starts == ["sanity", 0], "not run again"
    assert callback.runs == ["starting", "finished", "starting"]
