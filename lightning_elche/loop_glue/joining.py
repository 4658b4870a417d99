"""What a rank that joins a running fit changes in Lightning: its collectives before it trains, the
training loader it shows the cohort, and where its loops start."""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Optional, cast

import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import Trainer
from lightning.pytorch.strategies.ddp import default_pg_timeout
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler

_QUIET = ("broadcast", "barrier", "reduce", "all_gather")


def quiet_collectives(strategy: Any) -> Callable[[], None]:
    """Until a joiner trains, the members are in the middle of an epoch and enter none of the
    collectives Lightning runs while a fit starts (the setup barriers, ``ModelCheckpoint``'s
    directory broadcast, the loaders' length reduce): on the joiner they answer locally, with what
    a one-rank fit would. Returns the undo (called when the joiner starts training)."""

    def broadcast(obj: Any, src: int = 0) -> Any:
        return obj

    def barrier(*args: Any, **kwargs: Any) -> None:
        return None

    def reduce(tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return tensor

    def all_gather(tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        return tensor.unsqueeze(0)

    for name, local in zip(_QUIET, (broadcast, barrier, reduce, all_gather), strict=True):
        setattr(strategy, name, local)

    def undo() -> None:
        for name in _QUIET:
            strategy.__dict__.pop(name, None)

    return undo


def prepare_joiner(strategy: Any) -> tuple[str, timedelta]:
    """``DDPStrategy.setup_distributed`` without a process group (a joiner gets its group at
    admission): the seed, Lightning's rank view and the backend; returns the backend and the timeout."""
    reset_seed()
    strategy.set_world_ranks()
    strategy._process_group_backend = strategy._get_process_group_backend()
    timeout = strategy._timeout if strategy._timeout is not None else default_pg_timeout
    return strategy._process_group_backend, timeout


def preview_train_loader(trainer: Trainer) -> Any:
    """The fit's training loader, built as Lightning will build it (the module's or datamodule's
    ``train_dataloader``): a joiner shows its dataset and batching to the cohort before it joins."""
    return trainer.fit_loop._data_source.dataloader()


def injected_sampler_seed(trainer: Trainer, loader: DataLoader) -> Optional[int]:
    """The seed the fit's training sampler will have when Lightning replaces ``loader``'s plain
    sampler by its DistributedSampler (``use_distributed_sampler``): ``PL_GLOBAL_SEED``, as Lightning
    seeds it; None when Lightning keeps the loader's own sampler. A joiner's preview loader still has
    the plain sampler, whose seed the shape reads as 0, while the members' facts come from the
    replaced one: without this, a fit seeded other than 0 refused every joiner."""
    if not trainer._accelerator_connector.use_distributed_sampler:
        return None
    if not isinstance(loader.sampler, (RandomSampler, SequentialSampler)):
        return None
    return int(os.getenv("PL_GLOBAL_SEED", 0))


def loader_of(loaders: Any) -> DataLoader:
    """The one torch DataLoader among what ``train_dataloader`` returned."""
    if isinstance(loaders, DataLoader):
        return loaders
    if isinstance(loaders, (list, tuple)) and len(loaders) == 1 and isinstance(loaders[0], DataLoader):
        return loaders[0]
    if isinstance(loaders, dict) and len(loaders) == 1:
        return loader_of(next(iter(loaders.values())))
    raise TypeError("ElCheStrategy supports exactly one training DataLoader (a torch DataLoader).")


def loop_position(trainer: Trainer) -> dict[str, Any]:
    """Where a member's loops are at the end of the batch whose round admits a joiner (what the
    joiner starts from: it trains from the next batch on). The round runs inside the batch's
    optimizer step, before Lightning counts that step (``global_step``), the batch
    (``_batches_that_stepped``) and steps the step-interval schedulers for it; those are counted here
    as Lightning will count them after the batch, and the schedulers it will step are named, for the
    joiner to step once (:func:`step_schedulers_for_admission_batch`)."""
    epoch_loop = trainer.fit_loop.epoch_loop
    stepping = not epoch_loop._should_accumulate()
    return {"epoch": int(trainer.current_epoch), "global_step": int(trainer.global_step) + 1,
            "batches_that_stepped": int(epoch_loop._batches_that_stepped) + int(stepping),
            "step_schedulers": _schedulers_stepped_after_this_batch(trainer) if stepping else []}


def _schedulers_stepped_after_this_batch(trainer: Trainer) -> list[int]:
    """The indices of the schedulers Lightning steps after the current training batch (its rule in
    ``_TrainingEpochLoop._update_learning_rates`` for ``interval="step"``, plateau ones apart: those
    step on the monitored metric in ``on_advance_end``, and follow each rank's own steps)."""
    if not trainer.lightning_module.automatic_optimization:
        return []  # Lightning steps no scheduler of a manual optimization
    batch = trainer.fit_loop.epoch_loop.batch_idx + 1
    return [k for k, config in enumerate(trainer.lr_scheduler_configs)
            if config.interval == "step" and not config.reduce_on_plateau and batch % config.frequency == 0]


def step_schedulers_for_admission_batch(trainer: Trainer, position: dict[str, Any]) -> None:
    """A joiner, once it loaded rank 0's schedulers: step those Lightning steps after rank 0's
    admission batch, as Lightning does (the module's ``lr_scheduler_step``). Rank 0 took their states
    inside that batch, before the step: without it the joiner's step schedules (and learning rates)
    stayed one cohort step behind every member's for the rest of the fit."""
    configs = trainer.lr_scheduler_configs
    for k in position.get("step_schedulers", []):
        trainer.lightning_module.lr_scheduler_step(configs[k].scheduler, None)


def callback_states(trainer: Trainer) -> dict[str, Any]:
    """Every callback's state by its ``state_key``, as a checkpoint keeps them (what a joiner's
    callbacks take from a member)."""
    callbacks: list[Any] = cast(Any, trainer).callbacks  # set by Lightning's connector, not declared
    return {callback.state_key: callback.state_dict() for callback in callbacks}


def load_callback_states(trainer: Trainer, states: dict[str, Any]) -> None:
    """A joiner's callbacks take a member's states (a ``ModelCheckpoint``'s best and last paths,
    an ``EarlyStopping``'s counters): their epoch-end decisions, and the collectives those make,
    are then the members'. A joiner without them saves ``last-v1.ckpt`` beside the members'
    ``last.ckpt`` and asks one ``reduce`` more than they do."""
    for callback in cast(Any, trainer).callbacks:
        state = states.get(callback.state_key)
        if state:
            callback.load_state_dict(state)


def position_loops(trainer: Trainer, position: dict[str, Any]) -> None:
    """Start a joiner's loops inside the cohort's epoch: the epoch counter (its own batches of the
    epoch start at 0: it trains only its share) and the step counters of the member that sent it, as
    they are after its admission batch (:func:`loop_position`)."""
    epoch = int(position["epoch"])
    progress = trainer.fit_loop.epoch_progress
    for tracker in (progress.current, progress.total):  # _ProcessedTrackers (their declared type is narrower)
        for counter in ("ready", "started", "processed", "completed"):
            setattr(tracker, counter, epoch)
    epoch_loop = trainer.fit_loop.epoch_loop
    steps = int(position["global_step"])
    for tracker in (epoch_loop.automatic_optimization.optim_progress.optimizer.step.total,
                    epoch_loop.manual_optimization.optim_step_progress.total):
        tracker.ready = tracker.completed = steps
    epoch_loop._batches_that_stepped = int(position["batches_that_stepped"])
    # Past epoch 0 the epoch loop builds a second iterator of the training loader unless the fit
    # resumes: the joiner's first one (built in setup_data, and prefetched from: it claimed work)
    # must be the one it trains. Lightning clears the mark after the epoch.
    trainer.fit_loop._resuming_from_checkpoint = True
    # Sanity validation would run collectives the members are not in.
    trainer.num_sanity_val_steps = 0
