"""The training DataLoader: ElChe's sampler in place of the user's, and the epoch reopened after a loss."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, cast

from lightning.fabric.utilities.distributed import (
    DistributedSamplerWrapper,
)
from lightning.pytorch import Trainer
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _update_dataloader, extract_batch_size
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

from lightning_elche.augment import AugmentedDataset
from lightning_elche.config import Dispatch, ElCheConfig
from lightning_elche.dispatch import ChunkCounter, ElCheSampler, build_sampler
from lightning_elche.loop_glue.ddp import default_group_store, distributed_is_initialized


def with_training_sampler(dataloader: DataLoader, sampler: ElCheSampler) -> DataLoader:
    """``dataloader`` rebuilt around ``sampler``, the way Lightning re-instantiates loaders."""
    return _update_dataloader(dataloader, sampler, mode=RunningStage.TRAINING)


def sampler_for(dataloader: DataLoader, config: ElCheConfig, rank: int, world_size: int, key_prefix: str,
                chunk_batches: int, store: Optional[Any] = None) -> ElCheSampler:
    """The ElChe sampler that replaces ``dataloader``'s, keeping its shuffle, seed and batching.
    ``store``: where the dispatch claims (default: the default group's store).

    Raises ``TypeError`` for what cannot be dispatched by speed: an ``IterableDataset``, a custom
    sampler or batch sampler.
    """
    shape = dispatch_shape(dataloader)
    dispatch = config.run_mode.dispatch
    # The pool claims through the store; the own-stream splits use it only when ranks join mid-epoch.
    # (A Store has append at run time; torch's stub lacks it.)
    if store is None and (dispatch is Dispatch.POOL or distributed_is_initialized()):
        store = default_group_store()
    return build_sampler(
        dispatch,
        shape.samples,
        shape.batch_size,
        rank,
        world_size,
        shuffle=shape.shuffle,
        seed=shape.seed,
        counter=cast(Optional[ChunkCounter], store),
        key_prefix=key_prefix,
        partition_ratios=config.partition_ratios,
        max_chunk_batches=chunk_batches,
        drop_last=shape.drop_last,
        augment=shape.augment,
        pick_keys=shape.pick_keys,
    )


@dataclass(frozen=True)
class DispatchShape:
    """What of a training loader the dispatch keeps: its dataset's length, batching and order."""

    samples: int
    augment: int
    batch_size: int
    shuffle: bool
    seed: int
    drop_last: bool
    pick_keys: bool


def dispatch_shape(dataloader: DataLoader) -> DispatchShape:
    """``dataloader``'s :class:`DispatchShape`; a ``TypeError`` for what cannot be dispatched by speed."""
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
            f"ElCheStrategy cannot honour a custom sampler ({user_sampler_name(sampler)}): it assigns "
            "samples to ranks by speed. Use shuffle=True/False in the DataLoader."
        )
    assert dataloader.batch_size is not None
    dataset = dataloader.dataset
    if isinstance(dataset, AugmentedDataset):
        samples, augment = dataset.base_len, dataset.augment
    else:
        samples, augment = len(dataset), 1  # type: ignore[arg-type]  # a map-style Dataset has __len__
    return DispatchShape(samples, augment, dataloader.batch_size, shuffle, seed, dataloader.drop_last,
                         isinstance(dataset, AugmentedDataset))


def user_sampler_name(sampler: Any) -> str:
    """The class name of the sampler the user passed: Lightning wraps a custom sampler in a
    ``DistributedSamplerWrapper`` under a distributed strategy, which is not what the user wrote."""
    if type(sampler) is DistributedSamplerWrapper:
        sampler = sampler.dataset._sampler  # type: ignore[attr-defined]  # a _DatasetSamplerWrapper
    return type(sampler).__name__


def batch_samples(batch: Any, nominal: int) -> int:
    """The samples in a training batch as Lightning counts them; ``nominal`` (the loader's batch size)
    for a batch it cannot measure."""
    try:
        return extract_batch_size(batch)
    except Exception:  # noqa: BLE001 (an exotic batch)
        return nominal


def reopen_training_epoch(trainer: Trainer, before: Callable[[], None]) -> bool:
    """Iterate the training DataLoader again within the current epoch (the sampler continues the
    epoch with re-dispatched work); whether a batch came. ``before`` runs first (the sampler's
    ``reopen``). Call only at the rank's last batch, when the fetcher holds nothing more of the old
    iterator.

    Lightning's fetcher looks one batch ahead to find the last batch; it is rewound to the new
    iterator with that look-ahead refilled, and the epoch loop's last-batch flag is cleared so
    that the loop runs on."""
    from lightning.pytorch.loops.fetchers import _DataFetcher, _PrefetchDataFetcher

    fetcher = trainer.fit_loop._data_fetcher
    if not isinstance(fetcher, _PrefetchDataFetcher) or fetcher.batches:
        return False
    before()
    fetcher.iterator = iter(fetcher.combined_loader)
    try:
        fetcher.batches.append(_DataFetcher.__next__(fetcher))
    except StopIteration:
        fetcher.done = True
        return False
    fetcher.done = False
    trainer.fit_loop.epoch_loop.batch_progress.is_last_batch = False
    return True
