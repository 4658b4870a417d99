"""Heterogeneity-aware dispatch of training samples.

Every rank draws from one permutation of the dataset per epoch, built from ``(seed, epoch)``
exactly as ``torch.utils.data.DistributedSampler`` builds it. How the permutation is shared out
depends on the mode:

* sync modes split it equally, interleaved like ``DistributedSampler`` (without its padding);
* cadence and async modes cut it into chunks of whole batches that ranks *claim* with an atomic
  counter in the job's ``torch.distributed`` store, so a faster rank simply claims more chunks,
  from the first epoch on, and adapts within an epoch if a rank slows down;
* ``partition_ratios`` gives each rank a fixed contiguous share.

Each policy is one class behind the :class:`ElCheSampler` interface (:class:`EqualDispatch`,
:class:`FixedDispatch`, :class:`PoolDispatch`); ``ElCheSampler(..., dispatch="pool")`` builds the
policy's class. Whatever the dispatch, every sample of an epoch is handed to exactly one rank
exactly once.
Claimed chunks are always trained (prefetching DataLoader workers only claim ahead), so windows
and syncs never change which indices a rank reads.

With ``augment = k`` (an :class:`~lightning_elche.AugmentedDataset`) the epoch is ``k`` picks per
sample, permuted together, and the sampler yields :class:`~lightning_elche.augment.PickKey`
objects; each pick is still dispatched exactly once. A mid-epoch checkpoint records the epoch's
untrained part as positions, not per rank (:mod:`lightning_elche.coverage`);
:meth:`ElCheSampler.resume` dispatches only that part in the resumed epoch, split by the policy
over however many ranks the resumed run has.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Optional, Protocol, Union

import torch
from torch.utils.data import Sampler

from lightning_elche.augment import PickKey
from lightning_elche.checks import require_int
from lightning_elche.coverage import EpochCoverage, Range, compress, expand, merge, runs, size, subtract

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


class ElCheSampler(Sampler[Union[int, PickKey]]):
    """Yields this rank's sample indices (or pick keys) for one epoch under ElChe's dispatch.

    The interface of the three dispatch policies; ``ElCheSampler(..., dispatch=...)`` builds the
    policy's class. It deliberately has no ``__len__``: in the pooled dispatch a rank does not
    know in advance how many batches it will train, so Lightning runs the epoch until the
    iterator is exhausted.

    Args:
        num_samples: length of the dataset (samples, before ``augment``).
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
        augment: picks per sample and epoch; the epoch has ``num_samples * augment`` picks.
        pick_keys: yield :class:`PickKey` ``(index, repeat, epoch)`` instead of integer indices
            (for an :class:`~lightning_elche.AugmentedDataset`; required when ``augment > 1``).
    """

    dispatch: ClassVar[str] = ""
    """The policy's name, as in ``ElCheSampler(dispatch=...)`` and in checkpoints' coverage."""

    def __new__(cls, *args: Any, dispatch: str = "", **kwargs: Any) -> ElCheSampler:
        if cls is ElCheSampler:
            policies: dict[str, type[ElCheSampler]] = {
                "equal": EqualDispatch, "fixed": FixedDispatch, "pool": PoolDispatch,
            }
            if dispatch not in policies:
                raise ValueError(f"dispatch={dispatch!r} is invalid: expected 'equal', 'pool' or 'fixed'.")
            cls = policies[dispatch]
        return super().__new__(cls)

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        rank: int,
        world_size: int,
        *,
        shuffle: bool,
        seed: int,
        dispatch: Optional[str] = None,
        counter: Optional[ChunkCounter] = None,
        key_prefix: str = CHUNK_KEY_PREFIX,
        partition_ratios: Optional[Sequence[float]] = None,
        max_chunk_batches: int = 4,
        drop_last: bool = False,
        augment: int = 1,
        pick_keys: bool = False,
    ) -> None:
        if dispatch is not None and dispatch != self.dispatch:
            raise ValueError(f"{type(self).__name__} dispatches {self.dispatch!r}, not dispatch={dispatch!r}.")
        augment = require_int(f"augment={augment!r}", augment, 1)
        if augment > 1 and not pick_keys:
            raise ValueError(
                f"augment={augment} needs pick_keys=True: the dataset must read (index, repeat, epoch) "
                "keys (wrap it in lightning_elche.AugmentedDataset)."
            )
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} is invalid: expected >= 1.")
        self.dataset_len = num_samples
        self.augment = augment
        self.pick_keys = pick_keys
        # Everything below counts picks: an epoch dispatches every sample ``augment`` times.
        self.num_samples = num_samples * augment
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.seed = seed
        self.counter = counter
        self.key_prefix = key_prefix
        self.partition_ratios = list(partition_ratios) if partition_ratios is not None else None
        self.max_chunk_batches = max_chunk_batches
        self.drop_last = drop_last
        self.epoch = 0
        self.record = DispatchRecord()
        self._resume: Optional[EpochCoverage] = None
        self.started_batches: Optional[int] = None
        """Batches this rank has started training in the current epoch (None: not tracked).
        The batches yielded beyond it are claimed work still ahead of the rank (prefetch)."""
        self._set_up_policy()
        self._check_every_rank_gets_data()

    # -- what every policy shares ------------------------------------------------------------

    @property
    def num_batches(self) -> int:
        """Batches in one epoch, over all ranks (pooled and fixed dispatch)."""
        if self.drop_last:
            return self.num_samples // self.batch_size
        return math.ceil(self.num_samples / self.batch_size)

    @property
    def samples_per_epoch(self) -> int:
        """Samples handed out per epoch, over all ranks: whole batches only under ``drop_last``
        (the equal split overrides: it leaves each rank's partial batch to the DataLoader)."""
        if self.drop_last:
            return self.num_batches * self.batch_size
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Called by Lightning before each epoch: selects the permutation and the counter key."""
        self.epoch = epoch

    def batch_started(self) -> None:
        """The training loop started one more batch of the current epoch on this rank."""
        self.started_batches = (self.started_batches or 0) + 1

    def on_round(self, planned: Sequence[int]) -> None:
        """After every round, with the controller's plan (identical on every rank). Only the
        pooled dispatch uses it."""

    def __iter__(self) -> Iterator[Union[int, PickKey]]:
        order = epoch_permutation(self.num_samples, self.epoch, self.seed, self.shuffle)
        self.record = DispatchRecord(epoch=self.epoch)
        if self.started_batches is not None:
            self.started_batches = 0
        yield from self._iter_epoch(order, self._resumed_epoch())

    def _resumed_epoch(self) -> Optional[EpochCoverage]:
        resume = self._resume
        return resume if resume is not None and resume.epoch == self.epoch else None

    def _key(self, pick: int) -> Union[int, PickKey]:
        if not self.pick_keys:
            return pick
        return PickKey(pick % self.dataset_len, pick // self.dataset_len, self.epoch)

    def _yield_positions(self, order: list[int], positions: Sequence[int]) -> Iterator[Union[int, PickKey]]:
        self.record.samples += len(positions)
        for position in positions:
            yield self._key(order[position])

    def identity(self, epoch: int) -> EpochCoverage:
        """The fields that fix an epoch's order and dispatch, with nothing covered yet."""
        return EpochCoverage(
            epoch=epoch, picks=self.num_samples, seed=self.seed, shuffle=self.shuffle, batch_size=self.batch_size,
            drop_last=self.drop_last, dispatch=self.dispatch, world_size=self.world_size, remaining=[],
        )

    def coverage(self, gathered: Sequence[Union[list[Range], int]]) -> EpochCoverage:
        """The current epoch's untrained part, from every rank's :meth:`local_coverage` (rank order).

        Rank-agnostic: the positions of the epoch (or of a resumed epoch's remainder) that no rank
        has trained, so that the record resumes on any number of ranks."""
        if len(gathered) != self.world_size:
            raise ValueError(f"Coverage needs one entry per rank ({self.world_size}), got {len(gathered)}.")
        return replace(self.identity(self.epoch), remaining=self._untrained(gathered))

    def resume(self, coverage: EpochCoverage) -> None:
        """Dispatch only ``coverage``'s untrained part when its epoch comes (the resumed epoch),
        split over this run's ranks: the record may come from a run with another world size."""
        coverage.check_matches(self.identity(coverage.epoch))
        if coverage.remaining is None:
            coverage = replace(coverage, remaining=self._legacy_remaining(coverage), offsets=None)
        assert coverage.remaining is not None
        self._check_resumable(coverage.remaining, coverage.epoch)
        self._resume = coverage

    def _epoch_universe(self) -> Sequence[int]:
        """The positions the current epoch dispatches: all of them, or a resumed epoch's remainder."""
        resume = self._resumed_epoch()
        if resume is None or resume.remaining is None:
            return range(self.samples_per_epoch)
        return expand(resume.remaining)

    # -- what each policy decides ------------------------------------------------------------

    def _set_up_policy(self) -> None:
        """Refuse arguments the policy cannot work with; set up its per-epoch state."""

    def _check_every_rank_gets_data(self) -> None:
        # A rank with no batch would skip the epoch's training loop, and with it the rounds its
        # peers wait in: refuse such a split up front instead of deadlocking later.
        if self.num_samples < self.world_size * (self.batch_size if self.drop_last else 1):
            raise ValueError(
                f"The training set has {self.num_samples} samples: too few for {self.world_size} ranks "
                f"with batch_size={self.batch_size}; every rank needs at least one batch per epoch."
            )

    def _iter_epoch(self, order: list[int], resume: Optional[EpochCoverage]) -> Iterator[Union[int, PickKey]]:
        raise NotImplementedError

    def local_coverage(self, batches: int) -> Union[list[Range], int]:
        """What this rank trained of the current epoch, given that it trained its first ``batches``
        batches: epoch positions (pooled dispatch) or a pick count (equal, fixed)."""
        raise NotImplementedError

    def _untrained(self, gathered: Sequence[Union[list[Range], int]]) -> list[Range]:
        """The current epoch's positions that no rank trained, from every rank's local coverage."""
        raise NotImplementedError

    def _legacy_remaining(self, coverage: EpochCoverage) -> list[Range]:
        """The remaining positions of a record that kept per-rank ``offsets`` (before resizing)."""
        raise ValueError(
            f"The checkpoint's ElChe data coverage of epoch {coverage.epoch} has no remaining positions "
            f"(dispatch={coverage.dispatch!r}): it is malformed."
        )

    def _check_resumable(self, remaining: list[Range], epoch: int) -> None:
        """Refuse a remainder that leaves a rank of this run without a batch (it would deadlock)."""
        raise NotImplementedError


class _OwnStreamDispatch(ElCheSampler):
    """A policy that splits the epoch's positions (or a resumed epoch's remainder) into one fixed
    stream per rank, trained in order; what a rank trained is therefore a count of picks."""

    def stream_indices(self, count: int, rank: int, world_size: int) -> range:
        """Indices, into a sequence of ``count`` positions, of ``rank``'s stream among ``world_size``."""
        raise NotImplementedError

    def own_stream(self) -> Sequence[int]:
        """This rank's positions in the epoch order (in a resumed epoch: of its remainder)."""
        universe = self._epoch_universe()
        indices = self.stream_indices(len(universe), self.rank, self.world_size)
        return universe[indices.start : indices.stop : indices.step]

    def _iter_epoch(self, order: list[int], resume: Optional[EpochCoverage]) -> Iterator[Union[int, PickKey]]:
        yield from self._yield_positions(order, self.own_stream())

    def local_coverage(self, batches: int) -> Union[list[Range], int]:
        return min(batches * self.batch_size, len(self.own_stream()))

    def _untrained(self, gathered: Sequence[Union[list[Range], int]]) -> list[Range]:
        universe = self._epoch_universe()
        return self._remaining_after(universe, [int(t) for t in gathered], self.world_size)  # type: ignore[arg-type]

    def _remaining_after(self, universe: Sequence[int], trained: Sequence[int], world_size: int) -> list[Range]:
        """``universe`` less the first ``trained[r]`` picks of every rank's stream (``world_size`` ranks)."""
        untrained = [True] * len(universe)
        for rank, count in enumerate(trained):
            stream = self.stream_indices(len(universe), rank, world_size)
            if not 0 <= count <= len(stream):
                raise ValueError(
                    f"Rank {rank} reports {count} trained picks of epoch {self.epoch}; its stream has {len(stream)}."
                )
            done = stream[:count]
            untrained[done.start : done.stop : done.step] = [False] * len(done)
        return runs(p for p, left in zip(universe, untrained, strict=True) if left)

    def _legacy_remaining(self, coverage: EpochCoverage) -> list[Range]:
        # Such records counted each rank's progress through its stream of the whole epoch.
        assert coverage.offsets is not None
        if len(coverage.offsets) != coverage.world_size:
            raise ValueError(
                f"The checkpoint's coverage has {len(coverage.offsets)} rank offsets for world_size="
                f"{coverage.world_size}: it is malformed."
            )
        self._check_legacy_layout(coverage.world_size)
        return self._remaining_after(range(self.samples_per_epoch), coverage.offsets, coverage.world_size)

    def _check_legacy_layout(self, world_size: int) -> None:
        """Refuse a legacy record whose ranks' streams this run cannot rebuild."""

    def _check_resumable(self, remaining: list[Range], epoch: int) -> None:
        count = size(remaining)
        needed = self.batch_size if self.drop_last else 1  # the DataLoader drops a partial batch
        for rank in range(self.world_size):
            if len(self.stream_indices(count, rank, self.world_size)) < needed:
                raise ValueError(
                    f"The checkpoint leaves {count} pick(s) of epoch {epoch}, which give rank {rank} of "
                    f"{self.world_size} no batch; every rank needs at least one. Resume from the epoch-end "
                    "checkpoint instead."
                )


class EqualDispatch(_OwnStreamDispatch):
    """Sync modes: the epoch split equally, interleaved like ``DistributedSampler`` (no padding);
    a resumed epoch's remainder is interleaved over the resumed run's ranks the same way."""

    dispatch = "equal"

    @property
    def samples_per_epoch(self) -> int:
        return self.num_samples  # each rank's own partial batch is left to the DataLoader, as under DDP

    def stream_indices(self, count: int, rank: int, world_size: int) -> range:
        return range(rank, count, world_size)


class FixedDispatch(_OwnStreamDispatch):
    """``partition_ratios``: each rank a fixed contiguous share of whole batches (of the epoch, or
    of a resumed epoch's remainder)."""

    dispatch = "fixed"

    def _set_up_policy(self) -> None:
        if self.partition_ratios is None or len(self.partition_ratios) != self.world_size:
            raise ValueError(f"dispatch='fixed' needs one partition ratio per rank ({self.world_size}).")

    def _check_every_rank_gets_data(self) -> None:
        shares = fixed_share_batches(self.num_batches, self.partition_ratios or [])
        if min(shares) < 1:
            raise ValueError(
                f"partition_ratios={self.partition_ratios} give rank {shares.index(min(shares))} no "
                f"batch of the {self.num_batches} in an epoch: every rank needs at least one."
            )

    def stream_indices(self, count: int, rank: int, world_size: int) -> range:
        ratios = self.partition_ratios or []
        if world_size != len(ratios):
            raise ValueError(f"partition_ratios={ratios} describe {len(ratios)} ranks, not {world_size}.")
        shares = fixed_share_batches(math.ceil(count / self.batch_size), ratios)
        first = sum(shares[:rank]) * self.batch_size
        return range(first, min(first + shares[rank] * self.batch_size, count))

    def _check_legacy_layout(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise ValueError(
                f"The checkpoint's data coverage (an older per-rank record of partition_ratios for {world_size} "
                f"ranks) cannot be split over {self.world_size} ranks: resume it with {world_size} ranks, or "
                "resume from an epoch-end checkpoint."
            )


class PoolDispatch(ElCheSampler):
    """Cadence and async modes: chunks of whole batches claimed from a shared pool through an
    atomic counter, so a faster rank claims more; near the end of the epoch slower ranks leave the
    tail to faster ones (:meth:`set_speed_shares`)."""

    dispatch = "pool"

    def _set_up_policy(self) -> None:
        if self.counter is None:
            raise ValueError("dispatch='pool' needs a shared counter (the torch.distributed store).")
        # The current epoch's layout, kept for coverage: global positions of the pooled picks
        # (None: the whole epoch), chunk layout and the end of the last batch, in local positions.
        self._positions: Optional[list[int]] = None
        self._layout: list[tuple[int, int]] = []
        self._limit = 0
        self._speed_shares: Optional[list[float]] = None
        self._drainer: Optional[int] = None  # the rank that claims until the pool is dry, this epoch

    def _check_every_rank_gets_data(self) -> None:
        if self.num_samples < self.world_size * self.batch_size:
            raise ValueError(
                f"The training set has {self.num_samples} samples: too few for {self.world_size} ranks "
                f"with batch_size={self.batch_size}; every rank needs at least one batch per epoch."
            )

    def counter_key(self, epoch: int) -> str:
        return f"{self.key_prefix}/epoch{epoch}"

    def on_round(self, planned: Sequence[int]) -> None:
        if sum(planned) > 0:
            self.set_speed_shares(planned)

    def _iter_epoch(self, order: list[int], resume: Optional[EpochCoverage]) -> Iterator[Union[int, PickKey]]:
        self._positions = None
        if resume is not None:
            assert resume.remaining is not None
            self._positions = expand(resume.remaining)
        positions = self._positions
        # A resumed epoch pools only its remaining positions; they are whole batches (but for the
        # epoch's own partial tail), so batches keep their samples.
        self._limit = self.samples_per_epoch if positions is None else len(positions)
        self._layout = chunk_layout(math.ceil(self._limit / self.batch_size), self.world_size, self.max_chunk_batches)
        # The first chunk of each rank is reserved, so that no rank can find the pool empty
        # before it has trained anything; the rest are claimed in order through the counter.
        claim = self.rank
        key = self.counter_key(self.epoch)
        self._drainer = self._fastest_rank()
        while claim < len(self._layout):
            self.record.chunks.append(claim)
            start, stop = self._chunk_span(claim)
            local = range(start, stop)
            yield from self._yield_positions(order, local if positions is None else [positions[p] for p in local])
            assert self.counter is not None
            if self.rank != self._drainer and self._leaves_tail_to_faster_ranks(key, claim):
                return
            claim = self.world_size + self.counter.add(key, 1) - 1

    def set_speed_shares(self, shares: Sequence[float]) -> None:
        """Each rank's share of the cohort's throughput (any positive scale), identical on every
        rank; the strategy passes the controller's latest plan after every round.

        Near the end of a pooled epoch a slower rank then stops claiming chunks when the faster
        ranks would finish what is left sooner without it: a slow rank that takes one of the last
        chunks makes every other rank wait for it at the epoch's end. One rank, the fastest by the
        first shares of the epoch, claims until the pool is dry, so every chunk is still trained
        exactly once, however the shares change during the epoch.
        """
        # The drainer is the fastest by the first shares this rank holds in the epoch: those of
        # the round before the epoch (blocking on every rank), or, in a fit's first epoch, of the
        # epoch's first round. Every rank adopts the rounds in the same order, so it is the same
        # rank everywhere; shares adopted later differ between ranks at any one moment (cpu_async
        # adopts at different steps), and a drainer chosen from them could leave on every rank.
        if len(shares) != self.world_size or any(not math.isfinite(s) or s < 0 for s in shares) or sum(shares) <= 0:
            raise ValueError(
                f"speed shares {list(shares)!r} are invalid: expected {self.world_size} finite values >= 0 "
                "with a positive sum."
            )
        total = float(sum(shares))
        self._speed_shares = [s / total for s in shares]
        if self._drainer is None:
            self._drainer = self._fastest_rank()

    def _fastest_rank(self) -> Optional[int]:
        shares = self._speed_shares
        if shares is None:
            return None
        return max(range(self.world_size), key=lambda r: (shares[r], -r))

    def _leaves_tail_to_faster_ranks(self, key: str, last_claim: int) -> bool:
        shares = self._speed_shares
        if shares is None:
            return False
        share = shares[self.rank]
        if share <= 0:
            return True
        # Taking a chunk of c batches pays off unless this rank would end it, after the b batches
        # it already holds (prefetched, or in progress), later than the others end the whole
        # remainder R without it. They hold about as many batches as this rank (the same loader
        # settings): leave iff (b + c) / share > (b + R) / (1 - share).
        patience = (1.0 - share) / share
        held = 0
        if self.started_batches is not None:
            held = max(0, math.ceil(self.record.samples / self.batch_size) - self.started_batches + 1)
        upper_bound = self._batches_from(last_claim + 1)
        if held + upper_bound >= (held + self.max_chunk_batches) * patience:
            return False  # far from the tail: no need to look at the shared counter
        assert self.counter is not None
        next_claim = self.world_size + self.counter.add(key, 0)
        if next_claim >= len(self._layout):
            return False  # the pool is dry: the claim below ends the epoch for this rank
        remaining = self._batches_from(next_claim)
        # Strict: on a tie the others are still busy with chunks in flight, so taking it is no worse.
        return (held + self._layout[next_claim][1]) * patience > held + remaining

    def _batches_from(self, chunk: int) -> int:
        """Batches in the layout's chunks ``chunk`` to the end, in O(1) (chunks are contiguous):
        it runs at every claim, and an epoch may have tens of thousands of chunks."""
        if chunk >= len(self._layout):
            return 0
        last_first, last_count = self._layout[-1]
        return last_first + last_count - self._layout[chunk][0]

    def _chunk_span(self, chunk: int) -> tuple[int, int]:
        first_batch, batch_count = self._layout[chunk]
        return first_batch * self.batch_size, min((first_batch + batch_count) * self.batch_size, self._limit)

    # -- coverage: what a mid-epoch checkpoint keeps -----------------------------------------

    def local_coverage(self, batches: int) -> Union[list[Range], int]:
        """Epoch positions of the chunks this rank claimed, in claim order, up to ``batches``
        batches: what the DataLoader claimed beyond them (prefetch) is not trained and stays in
        the epoch's remainder."""
        local: list[Range] = []
        left = batches
        for chunk in self.record.chunks:
            if left <= 0:
                break
            start, stop = self._chunk_span(chunk)
            take = min(left, math.ceil((stop - start) / self.batch_size))
            local.append((start, min(start + take * self.batch_size, stop)))
            left -= take
        if left > 0:
            raise RuntimeError(
                f"Rank {self.rank} trained {batches} batches in epoch {self.epoch} but claimed only "
                f"{batches - left}: the dispatch record is out of step with training."
            )
        if self._positions is None:
            return merge(local)
        return compress(self._positions[p] for start, stop in local for p in range(start, stop))

    def _untrained(self, gathered: Sequence[Union[list[Range], int]]) -> list[Range]:
        resume = self._resumed_epoch()
        universe = [(0, self.samples_per_epoch)] if resume is None else list(resume.remaining or [])
        taken = [r for ranges in gathered for r in ranges]  # type: ignore[union-attr]
        return subtract(universe, taken)

    def _check_resumable(self, remaining: list[Range], epoch: int) -> None:
        batches = math.ceil(size(remaining) / self.batch_size)
        if batches < self.world_size:
            raise ValueError(
                f"The checkpoint leaves {batches} batch(es) of epoch {epoch} for {self.world_size} "
                "ranks; every rank needs at least one. Resume from the epoch-end checkpoint instead."
            )
