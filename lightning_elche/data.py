"""Heterogeneity-aware dispatch of training samples.

Every rank draws from one permutation of the dataset per epoch, built from ``(seed, epoch)``
exactly as ``torch.utils.data.DistributedSampler`` builds it. How the permutation is shared out
depends on the mode:

* sync modes split it equally, interleaved like ``DistributedSampler`` (without its padding);
* cadence and async modes cut it into chunks of whole batches that ranks *claim* with an atomic
  counter in the job's ``torch.distributed`` store, so a faster rank simply claims more chunks,
  from the first epoch on, and adapts within an epoch if a rank slows down;
* ``partition_ratios`` gives each rank a fixed contiguous share.

Whatever the dispatch, every sample of an epoch is handed to exactly one rank exactly once.
Claimed chunks are always trained (prefetching DataLoader workers only claim ahead), so windows
and syncs never change which indices a rank reads.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Optional, Protocol

import torch
from torch.utils.data import Sampler

CHUNK_KEY_PREFIX = "lightning_elche/dispatch"


class ChunkCounter(Protocol):
    """The shared counter behind chunk claims (``torch.distributed.Store`` satisfies it)."""

    def add(self, key: str, amount: int) -> int: ...


def epoch_permutation(num_samples: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    """The epoch's sample order: ``DistributedSampler``'s, so sync modes reproduce DDP's batches."""
    if not shuffle:
        return list(range(num_samples))
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(num_samples, generator=generator).tolist()


def chunk_layout(num_batches: int, world_size: int, max_chunk_batches: int) -> list[tuple[int, int]]:
    """Cut ``num_batches`` into ``(first_batch, batch_count)`` chunks, shrinking toward the end.

    Chunks are ``max_chunk_batches`` long while plenty remains and fall to single batches near
    the end (guided scheduling), so that when the pool runs dry no rank holds more than about one
    batch of work that the others must wait for.
    """
    chunks: list[tuple[int, int]] = []
    start = 0
    while start < num_batches:
        remaining = num_batches - start
        size = max(1, min(max_chunk_batches, remaining // (2 * world_size)))
        chunks.append((start, size))
        start += size
    return chunks


def fixed_share_batches(num_batches: int, ratios: Sequence[float]) -> list[int]:
    """Whole batches per rank for fixed shares: floor of each share, remainder by largest share."""
    counts = [math.floor(r * num_batches) for r in ratios]
    order = sorted(range(len(ratios)), key=lambda r: (-ratios[r], r))
    for i in range(num_batches - sum(counts)):
        counts[order[i % len(order)]] += 1
    return counts


@dataclass
class DispatchRecord:
    """What this rank was handed in the current epoch: for coverage checks and checkpoints."""

    epoch: int = -1
    chunks: list[int] = field(default_factory=list)
    samples: int = 0


class ElCheSampler(Sampler[int]):
    """Yields this rank's sample indices for one epoch under ElChe's dispatch.

    It deliberately has no ``__len__``: in the pooled dispatch a rank does not know in advance how
    many batches it will train, so Lightning runs the epoch until the iterator is exhausted.

    Args:
        num_samples: length of the dataset.
        batch_size: the DataLoader's batch size; chunks are whole batches.
        rank, world_size: this rank and the number of ranks.
        shuffle, seed: permutation as ``DistributedSampler(shuffle, seed)`` builds it.
        dispatch: ``"equal"`` (sync modes), ``"pool"`` (cadence/async) or ``"fixed"``.
        counter: the shared counter for ``"pool"``.
        key_prefix: a prefix unique to this fit, shared by all ranks, for the counter keys.
        partition_ratios: the shares for ``"fixed"``.
        max_chunk_batches: longest chunk in the pool.
        drop_last: the DataLoader drops incomplete batches. Pooled and fixed dispatch then drop
            the epoch's global tail (fewer than ``batch_size`` samples) up front; the equal split
            leaves each rank's own partial batch to the DataLoader, as under DDP.
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        rank: int,
        world_size: int,
        *,
        shuffle: bool,
        seed: int,
        dispatch: str,
        counter: Optional[ChunkCounter] = None,
        key_prefix: str = CHUNK_KEY_PREFIX,
        partition_ratios: Optional[Sequence[float]] = None,
        max_chunk_batches: int = 4,
        drop_last: bool = False,
    ) -> None:
        if dispatch not in ("equal", "pool", "fixed"):
            raise ValueError(f"dispatch={dispatch!r} is invalid: expected 'equal', 'pool' or 'fixed'.")
        if dispatch == "pool" and counter is None:
            raise ValueError("dispatch='pool' needs a shared counter (the torch.distributed store).")
        if dispatch == "fixed" and (partition_ratios is None or len(partition_ratios) != world_size):
            raise ValueError(f"dispatch='fixed' needs one partition ratio per rank ({world_size}).")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} is invalid: expected >= 1.")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.seed = seed
        self.dispatch = dispatch
        self.counter = counter
        self.key_prefix = key_prefix
        self.partition_ratios = list(partition_ratios) if partition_ratios is not None else None
        self.max_chunk_batches = max_chunk_batches
        self.drop_last = drop_last
        self.epoch = 0
        self.record = DispatchRecord()
        self._check_every_rank_gets_data()

    @property
    def num_batches(self) -> int:
        """Batches in one epoch, over all ranks (pooled and fixed dispatch)."""
        if self.drop_last:
            return self.num_samples // self.batch_size
        return math.ceil(self.num_samples / self.batch_size)

    @property
    def samples_per_epoch(self) -> int:
        """Samples handed out per epoch, over all ranks."""
        if self.drop_last and self.dispatch != "equal":
            return self.num_batches * self.batch_size
        return self.num_samples

    def _check_every_rank_gets_data(self) -> None:
        # A rank with no batch would skip the epoch's training loop, and with it the rounds its
        # peers wait in: refuse such a split up front instead of deadlocking later.
        if self.dispatch == "fixed":
            shares = fixed_share_batches(self.num_batches, self.partition_ratios or [])
            if min(shares) < 1:
                raise ValueError(
                    f"partition_ratios={self.partition_ratios} give rank {shares.index(min(shares))} no "
                    f"batch of the {self.num_batches} in an epoch: every rank needs at least one."
                )
        elif self.num_samples < self.world_size * (
            self.batch_size if self.drop_last or self.dispatch == "pool" else 1
        ):
            raise ValueError(
                f"The training set has {self.num_samples} samples: too few for {self.world_size} ranks "
                f"with batch_size={self.batch_size}; every rank needs at least one batch per epoch."
            )

    def set_epoch(self, epoch: int) -> None:
        """Called by Lightning before each epoch: selects the permutation and the counter key."""
        self.epoch = epoch

    def counter_key(self, epoch: int) -> str:
        return f"{self.key_prefix}/epoch{epoch}"

    def __iter__(self) -> Iterator[int]:
        order = epoch_permutation(self.num_samples, self.epoch, self.seed, self.shuffle)
        self.record = DispatchRecord(epoch=self.epoch)
        if self.dispatch == "equal":
            yield from self._yield_samples(order[self.rank :: self.world_size])
        elif self.dispatch == "fixed":
            yield from self._iter_fixed(order)
        else:
            yield from self._iter_pool(order)

    def _yield_samples(self, indices: list[int]) -> Iterator[int]:
        self.record.samples += len(indices)
        yield from indices

    def _batch_span(self, order: list[int], first_batch: int, batch_count: int) -> list[int]:
        start = first_batch * self.batch_size
        return order[start : min((first_batch + batch_count) * self.batch_size, self.samples_per_epoch)]

    def _iter_fixed(self, order: list[int]) -> Iterator[int]:
        shares = fixed_share_batches(self.num_batches, self.partition_ratios or [])
        first = sum(shares[: self.rank])
        yield from self._yield_samples(self._batch_span(order, first, shares[self.rank]))

    def _iter_pool(self, order: list[int]) -> Iterator[int]:
        chunks = chunk_layout(self.num_batches, self.world_size, self.max_chunk_batches)
        # The first chunk of each rank is reserved, so that no rank can find the pool empty
        # before it has trained anything; the rest are claimed in order through the counter.
        claim = self.rank
        key = self.counter_key(self.epoch)
        while claim < len(chunks):
            self.record.chunks.append(claim)
            first_batch, batch_count = chunks[claim]
            yield from self._yield_samples(self._batch_span(order, first_batch, batch_count))
            assert self.counter is not None
            claim = self.world_size + self.counter.add(key, 1) - 1
