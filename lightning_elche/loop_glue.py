"""How ElCheStrategy adapts Lightning's fit loop and training data to uneven steps.

Each function changes one thing Lightning does per rank that assumes lockstep ranks; the
strategy calls them from its hooks. Kept apart from the strategy because they reach into
Lightning's loops and data utilities, which is where a Lightning upgrade would break them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Optional

import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

from lightning_elche.augment import AugmentedDataset
from lightning_elche.config import ElCheConfig
from lightning_elche.data import ElCheSampler


def sampler_for(dataloader: DataLoader, config: ElCheConfig, rank: int, world_size: int, key_prefix: str,
                chunk_batches: int) -> ElCheSampler:
    """The ElChe sampler that replaces ``dataloader``'s, keeping its shuffle, seed and batching.

    Raises ``TypeError`` for what cannot be dispatched by speed: an ``IterableDataset``, a custom
    sampler or batch sampler.
    """
    if isinstance(dataloader.dataset, IterableDataset):
        raise TypeError(
            "ElCheStrategy cannot dispatch an IterableDataset: it hands out sample indices by "
            "throughput. Use a map-style Dataset."
        )
    if dataloader.batch_sampler is not None and type(dataloader.batch_sampler).__name__ != "BatchSampler":
        raise TypeError(
            f"ElCheStrategy cannot honour a custom batch_sampler ({type(dataloader.batch_sampler).__name__}): "
            "it assigns batches to ranks by speed. Use batch_size with the default batching."
        )
    sampler = dataloader.sampler
    if isinstance(sampler, DistributedSampler) and type(sampler) is DistributedSampler:
        shuffle, seed = sampler.shuffle, sampler.seed
    elif isinstance(sampler, (RandomSampler, SequentialSampler)):
        shuffle, seed = isinstance(sampler, RandomSampler), 0
    else:
        raise TypeError(
            f"ElCheStrategy cannot honour a custom sampler ({type(sampler).__name__}): it assigns "
            "samples to ranks by speed. Use shuffle=True/False in the DataLoader."
        )
    assert dataloader.batch_size is not None
    dispatch = "fixed" if config.partition_ratios else ("pool" if config.mode.progressive_dispatch else "equal")
    store = dist.distributed_c10d._get_default_store() if dispatch == "pool" else None
    dataset = dataloader.dataset
    augmented = isinstance(dataset, AugmentedDataset)
    return ElCheSampler(
        dataset.base_len if augmented else len(dataset),  # type: ignore[arg-type, union-attr]
        dataloader.batch_size,
        rank,
        world_size,
        shuffle=shuffle,
        seed=seed,
        dispatch=dispatch,
        counter=store,
        key_prefix=key_prefix,
        partition_ratios=config.partition_ratios,
        max_chunk_batches=chunk_batches,
        drop_last=dataloader.drop_last,
        augment=dataset.augment if augmented else 1,  # type: ignore[union-attr]
        pick_keys=augmented,
    )


def take_over_max_steps(trainer: Trainer) -> Optional[int]:
    """Remove ``max_steps`` from the epoch loop and return it as the cohort's step budget.

    Lightning would stop each rank at its own ``global_step``; ElChe counts the steps of all ranks
    and stops every rank together at the first sync past the budget.
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    if epoch_loop.max_steps in (None, -1):
        return None
    budget = int(epoch_loop.max_steps)
    epoch_loop.max_steps = -1
    return budget


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


def report_cohort_batches(trainer: Trainer, sampler: Callable[[], Optional[ElCheSampler]]) -> Callable[[], None]:
    """Make ``trainer.num_training_batches`` the epoch's batches over all ranks; returns the undo.

    A rank's share of an epoch is decided while it trains, so the loader has no length and
    Lightning would report infinitely many batches: ``trainer.estimated_stepping_batches`` would
    fall back to ``max_steps`` (-1), and a OneCycleLR sized from it would fail. Step-interval
    schedulers follow the cohort step, whose count per epoch is known, so that is the number to
    report. The loader itself stays unsized: Lightning's fetcher then looks one batch ahead to
    find each rank's last batch.
    """
    fit_loop = trainer.fit_loop
    setup_data = fit_loop.setup_data

    def setup_data_with_cohort_batches() -> None:
        setup_data()
        current = sampler()
        if current is not None and math.isinf(fit_loop.max_batches):
            fit_loop.max_batches = current.num_batches

    fit_loop.setup_data = setup_data_with_cohort_batches  # type: ignore[method-assign]

    def undo() -> None:
        vars(fit_loop).pop("setup_data", None)  # back to the class's method

    return undo


def silence_per_step_sigterm_broadcast(trainer: Trainer) -> None:
    """Stop Lightning's broadcast of a SIGTERM flag before every training batch.

    That broadcast deadlocks as soon as ranks take different numbers of steps; ElChe carries stop
    requests in its own round metadata instead.
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    if not hasattr(epoch_loop, "_broadcast_sigterm_tensor"):
        raise RuntimeError(
            "This Lightning version has no TrainingEpochLoop._broadcast_sigterm_tensor; "
            "lightning-elche supports lightning>=2.6,<2.7."
        )
    epoch_loop._broadcast_sigterm_tensor = lambda: None
