"""Reads of the Trainer's and its callbacks' private state, under public names."""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, Timer
from lightning.pytorch.utilities.exceptions import MisconfigurationException


def train_dataloader_count(trainer: Trainer) -> int:
    """How many training DataLoaders the fit loop combined."""
    loader = trainer.fit_loop._combined_loader
    return len(loader.flattened) if loader is not None else 0


def next_epoch(trainer: Trainer) -> int:
    """The epoch the fit loop runs next (the counter ``set_epoch`` uses)."""
    return int(trainer.fit_loop.epoch_progress.current.processed)  # type: ignore[attr-defined]  # a _StartedTracker


def can_stop_early(trainer: Trainer) -> bool:
    """Whether Lightning would honour ``should_stop`` now (``min_epochs`` reached)."""
    return bool(trainer.fit_loop._can_stop_early)


def skip_validation_after_this_batch(trainer: Trainer) -> None:
    """Let this batch end without the validation Lightning starts after a ``should_stop`` set mid-epoch.

    ElChe stops a fit at its step budget with ``should_stop``; Lightning's own ``max_steps`` ends the
    epoch loop without validating (unless the epoch ended too), and so must the budget's stop."""
    trainer.fit_loop.epoch_loop._skip_next_val = True


def timer_step_duration(timer: Timer) -> Optional[Any]:
    """The duration of a ``Timer`` that checks after every training step (None otherwise; a zero
    duration checks, and broadcasts, after every step too)."""
    return timer._duration if timer._interval == "step" and timer._duration is not None else None


def checkpoint_step_triggers(callback: ModelCheckpoint) -> tuple[Optional[int], Optional[Any]]:
    """A ``ModelCheckpoint``'s per-step triggers: ``every_n_train_steps`` and ``train_time_interval``."""
    return callback._every_n_train_steps, callback._train_time_interval


def uses_sync_batchnorm(strategy: Any) -> bool:
    """``Trainer(sync_batchnorm=True)`` gave the strategy a layer-sync plugin."""
    return getattr(strategy, "_layer_sync", None) is not None


def logged_callback_metrics(trainer: Trainer) -> dict[str, Any]:
    """The "callback" metrics of the loop that logged last (inside ``on_validation_end``: validation's)."""
    return dict(trainer._logger_connector.metrics["callback"])


def monitor_candidates(callback: ModelCheckpoint, trainer: Trainer) -> dict[str, Any]:
    """``ModelCheckpoint``'s own candidates for ``filename`` and ``monitor`` (its base method)."""
    return ModelCheckpoint._monitor_candidates(callback, trainer)


def save_checkpoint_now(callback: ModelCheckpoint, trainer: Any) -> None:
    """Save as ``ModelCheckpoint`` does at its own triggers: the top-k and the ``last`` file.
    ``trainer``: the Trainer or a view of it (``cohort_callbacks.CohortTrainerView``)."""
    candidates = callback._monitor_candidates(trainer)
    callback._save_topk_checkpoint(trainer, candidates)
    callback._save_last_checkpoint(trainer, candidates)


def check_step_schedulers(trainer: Trainer) -> None:
    """Refuse step-interval LR schedulers with ``frequency != 1`` (they follow the cohort step one
    step at a time)."""
    for config in trainer.lr_scheduler_configs:
        if config.interval == "step" and config.frequency != 1:
            raise MisconfigurationException(
                f"ElCheStrategy cannot run a step-interval LR scheduler with frequency={config.frequency}: "
                "schedulers follow the cohort step (all ranks' steps) and are advanced one step at a time. "
                "Use frequency=1 and fold the factor into the schedule."
            )


def lightning_phase(trainer: Trainer) -> str:
    """Where a fit is, in Lightning's words: the hook being run and the stage
    (``on_train_end (stage train)``, ``validation_step (the sanity check)``)."""
    module = trainer.lightning_module
    hook = module._current_fx_name if module is not None else None
    stage = trainer.state.stage
    where = "the sanity check" if trainer.sanity_checking else f"stage {stage.value}" if stage else "outside a stage"
    return f"{hook} ({where})" if hook else where
