"""The Trainer view that ModelCheckpoint and EarlyStopping get under ElChe (without processes; the
2-process behaviour is in test_lightning_suite.py and test_checkpoint_agreement.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint

from lightning_elche.cohort_callbacks import CohortTrainerView, follow_the_cohort
from lightning_elche.loop_glue import LightningPatches


def test_the_view_shows_the_cohort_step_and_the_given_metrics_and_writes_through():
    trainer = SimpleNamespace(global_step=7, callback_metrics={"loss": torch.tensor(1.0)}, should_stop=False,
                              current_epoch=3)
    view = CohortTrainerView(trainer, cohort_step=40, metrics={"loss": torch.tensor(0.5)})
    assert view.global_step == 40 and trainer.global_step == 7
    assert float(view.callback_metrics["loss"]) == 0.5
    assert view.current_epoch == 3
    view.should_stop = True  # EarlyStopping sets it on the Trainer
    assert trainer.should_stop is True
    assert CohortTrainerView(trainer, 40).callback_metrics is trainer.callback_metrics  # no metrics given


def test_checkpoint_and_early_stopping_hooks_see_the_view_until_the_patches_are_undone(tmp_path):
    seen: list[Any] = []

    class Probe(ModelCheckpoint):
        def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
            seen.append(trainer.global_step)

    class ProbeStop(EarlyStopping):
        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            seen.append(("stop", trainer.global_step))

    checkpoint, stopping, other = Probe(dirpath=tmp_path), ProbeStop(monitor="loss"), LearningRateMonitor()
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, callbacks=[checkpoint, stopping, other],
                      enable_progress_bar=False, default_root_dir=str(tmp_path))
    patches = LightningPatches()
    assert follow_the_cohort(trainer, lambda: 123, patches.replace_hook) == 2
    assert "on_train_epoch_end" not in vars(other)  # other callbacks are left alone
    # Hooks that every rank reaches broadcast rank 0's metrics: here one process, world size 1.
    checkpoint.on_validation_end(trainer, None)
    stopping.on_train_epoch_end(trainer, None)
    checkpoint.on_exception(trainer, None, RuntimeError())  # no broadcast on an exception (one rank may raise)
    assert seen == [123, ("stop", 123)]
    patches.undo()
    checkpoint.on_validation_end(trainer, None)
    assert seen[-1] == trainer.global_step == 0
    assert "on_validation_end" not in vars(checkpoint)


def test_a_later_fit_continues_the_cohort_step_and_a_spent_budget_trains_nothing():
    from lightning_elche.cohort_callbacks import continue_the_cohort, stop_if_the_budget_is_spent

    def engine(step: int) -> SimpleNamespace:
        return SimpleNamespace(state=SimpleNamespace(cohort_step=step))

    assert continue_the_cohort(None, engine(0)).state.cohort_step == 0  # the first fit
    assert continue_the_cohort(engine(42), engine(0)).state.cohort_step == 42  # as Lightning's global_step
    trainer = SimpleNamespace(should_stop=False)
    stop_if_the_budget_is_spent(trainer, 41, 42)
    assert trainer.should_stop is False
    stop_if_the_budget_is_spent(trainer, 41, None)
    assert trainer.should_stop is False
    stop_if_the_budget_is_spent(trainer, 42, 42)
    assert trainer.should_stop is True
