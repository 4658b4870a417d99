"""Trainer settings that cannot work when ranks take different numbers of steps.

Each of these evaluates a rank-local step counter or clock, or issues a collective per step, so
with ElChe one rank would leave a loop (or enter a collective) that its peers never reach. They
are refused in ``setup`` with the setting, its value and what to use instead, before any
training step runs.
"""

from __future__ import annotations

from typing import Any, Protocol, Union, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BatchSizeFinder, LearningRateFinder, ModelCheckpoint, Timer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_elche.config import Dispatch, ElCheConfig
from lightning_elche.loop_glue import checkpoint_step_triggers, timer_step_duration, uses_sync_batchnorm


class _ConnectorSettings(Protocol):
    """Trainer attributes that Lightning's connectors set at construction (its class does not
    declare them, so a type checker cannot see them on ``Trainer``)."""

    callbacks: list[pl.Callback]
    fast_dev_run: Union[int, bool]
    overfit_batches: Union[int, float]


def _refuse(setting: str, value: Any, why: str, instead: str) -> MisconfigurationException:
    return MisconfigurationException(f"ElCheStrategy cannot run with {setting}={value!r}: {why}. {instead}")


REPRODUCIBLE = (
    "For a reproducible run use mode='nccl_sync' or 'cpu_sync' with ElCheConfig(max_batch_diff=0) (and no "
    "partition_ratios): every rank then takes one step per round on the equal split, as DDP does, so the same "
    "seed gives the same weights; the cost is DDP's lockstep pace, the slowest rank's speed."
)


def reproducible(config: ElCheConfig) -> bool:
    """Whether two fits with the same seed train the same batches on the same ranks and average them
    at the same steps: only when nothing in the plan depends on measured speeds (one step per round,
    the equal split)."""
    run_mode = config.run_mode
    return not run_mode.window_growth and run_mode.dispatch is Dispatch.EQUAL and config.max_batch_diff == 0


def check_determinism(config: ElCheConfig) -> None:
    """``Trainer(deterministic=True)`` (``torch.use_deterministic_algorithms(True)``) asks for the same
    weights from run to run; refused where the plan follows measured speeds. ``deterministic="warn"``
    (torch's warn-only mode) warns instead."""
    if not torch.are_deterministic_algorithms_enabled() or reproducible(config):
        return
    run_mode = config.run_mode
    if run_mode.window_growth:
        cause = f"in mode={run_mode.mode.value!r} the window and the data dispatch follow the ranks' measured speeds"
    elif run_mode.dispatch is Dispatch.FIXED:
        cause = "partition_ratios give the ranks unequal shares, whose ends fall in speed-dependent rounds"
    else:
        cause = (f"ElCheConfig(max_batch_diff={config.max_batch_diff!r}) lets a fast rank take as many steps per "
                 "round as its measured speed earns")
    why = cause + ", so two runs with the same seed can average different steps together"
    if torch.is_deterministic_algorithms_warn_only_enabled():
        rank_zero_warn(f"ElCheStrategy with Trainer(deterministic='warn'): {why}. {REPRODUCIBLE}")
        return
    raise _refuse("Trainer(deterministic)", True, why, REPRODUCIBLE)


def check_trainer(trainer: pl.Trainer) -> None:
    """Raise ``MisconfigurationException`` for the first unsupported setting found."""
    check_settings(trainer)
    check_optimizers(trainer)


def check_settings(trainer: pl.Trainer) -> None:
    """The checks that need no optimizer: run before the strategy builds anything, so that every
    rank refuses at the same point, before any group exists that a refusing rank would tear down
    while a peer still connects to it."""
    uneven = "ranks take different numbers of steps under ElChe"
    settings = cast(_ConnectorSettings, trainer)
    for callback in settings.callbacks:
        # Tuner(trainer).lr_find / scale_batch_size add these callbacks and run a short fit of their own.
        if isinstance(callback, (LearningRateFinder, BatchSizeFinder)):
            tuner = "Tuner.lr_find / LearningRateFinder" if isinstance(callback, LearningRateFinder) else (
                "Tuner.scale_batch_size / BatchSizeFinder")
            raise _refuse(
                tuner, type(callback).__name__,
                "the tuner runs its own short fit that stops each rank at its own step count, decides from "
                "one rank's losses and broadcasts during training steps, and " + uneven,
                "Tune with a single-device Trainer first (Trainer(devices=1), Tuner(trainer).lr_find(model)), "
                "then pass the value it suggests to the model you fit with ElCheStrategy.",
            )
    if settings.fast_dev_run:
        raise _refuse(
            "Trainer(fast_dev_run)", settings.fast_dev_run,
            "it limits every rank to the same number of batches, and " + uneven,
            "For a smoke test, run fast_dev_run with a single-device Trainer, or fit ElChe for max_epochs=1 on "
            "a small torch.utils.data.Subset of the training set.",
        )
    if trainer.fit_loop.epoch_loop.min_steps not in (None, -1, 0):
        raise _refuse(
            "Trainer(min_steps)", trainer.fit_loop.epoch_loop.min_steps,
            f"it is checked against each rank's own step count, and {uneven}",
            "Use min_epochs instead.",
        )
    for callback in settings.callbacks:
        duration = timer_step_duration(callback) if isinstance(callback, Timer) else None
        if duration is not None:
            raise _refuse(
                "Trainer(max_time) / Timer(interval='step')", duration,
                "the timer broadcasts after every training step, and " + uneven,
                "Use max_epochs, or Timer(duration, interval='epoch').",
            )
        if isinstance(callback, ModelCheckpoint):
            every_n_train_steps, train_time_interval = checkpoint_step_triggers(callback)
            if every_n_train_steps:
                raise _refuse(
                    "ModelCheckpoint(every_n_train_steps)", every_n_train_steps,
                    "it saves (a collective) when each rank's own global_step hits a multiple, and " + uneven,
                    "Use every_n_epochs (checkpoints at epoch ends hold the consensus weights).",
                )
            if train_time_interval is not None:
                raise _refuse(
                    "ModelCheckpoint(train_time_interval)", train_time_interval,
                    "it broadcasts after every training step, and " + uneven,
                    "Use every_n_epochs.",
                )
    interval = trainer.val_check_interval
    if isinstance(interval, int) or (isinstance(interval, float) and interval != 1.0):
        raise _refuse(
            "Trainer(val_check_interval)", interval,
            "validation inside an epoch would start on each rank after its own batch count, and " + uneven,
            "Leave val_check_interval=1.0 and use check_val_every_n_epoch.",
        )
    if settings.overfit_batches:
        raise _refuse(
            "Trainer(overfit_batches)", settings.overfit_batches,
            "it fixes a per-rank batch count", "Pass a small Subset of the training set instead.",
        )
    limit = trainer.limit_train_batches
    # Only the float 1.0 (the default: the whole epoch) is the same on every rank; an int, even 1,
    # is a per-rank batch count.
    if limit is not None and not (isinstance(limit, float) and limit == 1.0):
        meaning = f"{limit} batch(es) per rank" if isinstance(limit, int) else f"{limit:.0%} of each rank's batches"
        raise _refuse(
            "Trainer(limit_train_batches)", limit,
            f"it means {meaning}, but ElChe hands each rank as many batches as its speed earns, so a "
            "per-rank limit would end the ranks' epochs at different rounds and drop samples unevenly",
            "Leave limit_train_batches=1.0 and pass a torch.utils.data.Subset of the training set instead.",
        )
    config = getattr(trainer.strategy, "elche", None)
    if isinstance(config, ElCheConfig):
        check_determinism(config)
    if uses_sync_batchnorm(trainer.strategy):
        raise _refuse(
            "Trainer(sync_batchnorm)", True,
            "SyncBatchNorm all-reduces statistics in every forward pass, and " + uneven,
            "Leave it off: BatchNorm running statistics are averaged at every ElChe sync.",
        )
    module = trainer.lightning_module
    if not module.automatic_optimization:
        raise _refuse(
            "LightningModule.automatic_optimization", False,
            "ElChe counts work and syncs at optimizer steps that Lightning drives",
            "Use automatic optimization (one optimizer).",
        )


def check_optimizers(trainer: pl.Trainer) -> None:
    """The checks of what ``configure_optimizers`` returned."""
    if len(trainer.optimizers) != 1:
        raise _refuse(
            "configure_optimizers()", f"{len(trainer.optimizers)} optimizers",
            "automatic optimization steps exactly one optimizer", "Return one optimizer.",
        )
