"""The own-stream splits: every rank trains its own stream of the epoch, in order.

:class:`EqualDispatch` (sync modes) interleaves the epoch like ``DistributedSampler``;
:class:`FixedDispatch` (``partition_ratios``) gives each rank a contiguous share of whole batches.
What a rank trained is then a count of picks of its stream, until a membership change.

After a change a rank's work is a list of *segments*: what it keeps of its own stream, then one
piece per change, each batched from its start, so that every rank's batches are known to all
(:class:`StreamPlan`, a pure function of the epoch's start and its :class:`StreamChange` log):

* a loss deals the lost ranks' untrained batches (beyond those in the consensus) to the members;
* a join re-splits the untrained rest of the epoch: every survivor keeps what it had already handed
  to its DataLoader and gives the rest back, and the lost work and those rests are dealt over the
  new numbering, so a joiner gets an equal part. How far each survivor had handed its work out is
  known only to itself: it writes it to the store when it applies the change, and every member
  reads the others' before it hands out its next batch (the change's generation names the keys).
  A member lost before it wrote its count (a second loss in the same recovery) is settled by the
  next change: its batches in the consensus stand in for it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Optional, Union

from lightning_elche.augment import PickKey
from lightning_elche.config import Dispatch
from lightning_elche.coverage import (
    EpochCoverage,
    Range,
    compress,
    legacy_offsets,
    merge,
    runs,
    stream_remaining,
    subtract,
)
from lightning_elche.dispatch.order import batch_count, fixed_share_batches
from lightning_elche.dispatch.sampler import ElCheSampler
from lightning_elche.dispatch.store import EpochKeys, missing_counter_methods, read_entries
from lightning_elche.membership.change import Change

HANDED_WAIT_S = 120.0
"""How long a member waits for the others to say how far they had handed their work out after a
join (they write it as they apply the change, in the same recovery)."""


@dataclass(frozen=True)
class StreamChange:
    """One membership change as the stream plan replays it."""

    sources: tuple[Optional[int], ...]
    """For every rank of the new numbering, its old rank (None: it joined)."""
    trained: tuple[tuple[int, int], ...]
    """``(old rank, batches in the consensus)`` of every lost rank."""
    ratios: Optional[tuple[float, ...]] = None
    """The fixed shares after the change (None: the equal split)."""
    handed: Optional[tuple[tuple[int, int], ...]] = None
    """With joiners: ``(old rank, batches it had handed out)`` of every member that stays."""

    @property
    def joins(self) -> bool:
        return None in self.sources


@dataclass(frozen=True)
class StreamLog:
    """An epoch's start and its changes: every rank's work follows from it (what a joiner takes over)."""

    world_size: int
    ratios: Optional[tuple[float, ...]]
    changes: tuple[StreamChange, ...]


Deal = Callable[[int, StreamChange], list[list[int]]]
"""Which of ``count`` batches put back into the epoch (in order) each rank of the new numbering takes."""


class StreamPlan:
    """Every rank's work of one epoch after a change: segments, each batched from its start."""

    def __init__(self, segments: list[list[Sequence[int]]], batch_size: int, drop_last: bool) -> None:
        self.segments = segments
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.lost_trained: list[Range] = []
        """Positions the lost ranks trained into the consensus."""

    def batches(self, rank: int) -> int:
        return sum(batch_count(len(segment), self.batch_size, self.drop_last) for segment in self.segments[rank])

    def batch(self, rank: int, index: int) -> Optional[Sequence[int]]:
        """The positions of ``rank``'s batch ``index`` (None: it has fewer)."""
        for segment in self.segments[rank]:
            count = batch_count(len(segment), self.batch_size, self.drop_last)
            if index < count:
                return segment[index * self.batch_size : min((index + 1) * self.batch_size, len(segment))]
            index -= count
        return None

    def split(self, rank: int, batches: int) -> tuple[list[int], list[int]]:
        """The positions of ``rank``'s first ``batches`` batches, and all its others; ValueError
        when it has fewer batches."""
        kept, rest = self.cut(rank, batches)
        return [p for segment in kept for p in segment], rest

    def cut(self, rank: int, batches: int) -> tuple[list[Sequence[int]], list[int]]:
        """``rank``'s segments holding only its first ``batches`` batches, and the positions of the rest."""
        kept: list[Sequence[int]] = []
        rest: list[int] = []
        left = batches
        for segment in self.segments[rank]:
            take = min(left, batch_count(len(segment), self.batch_size, self.drop_last))
            picks = min(take * self.batch_size, len(segment))
            kept.append(segment[:picks])
            rest.extend(segment[picks:])
            left -= take
        if left:
            raise ValueError(f"{batches} batches asked, {batches - left} dispatched")
        return kept, rest

    def apply(self, change: StreamChange, deal: Deal) -> int:
        """Follow ``change``; the batches of lost work it put back into the epoch."""
        returned: list[int] = []
        for rank, trained in change.trained:
            done, rest = self.split(rank, trained)
            self.lost_trained = merge(self.lost_trained + compress(done))
            returned.extend(rest)
        lost_batches = math.ceil(len(returned) / self.batch_size)
        handed = dict(change.handed or ())
        kept: dict[int, list[Sequence[int]]] = {}
        for source in change.sources:
            if source is None:
                continue
            if change.joins:
                kept[source], rest = self.cut(source, handed[source])
                returned.extend(rest)
            else:
                kept[source] = list(self.segments[source])
        # Whole batches of what goes back (a short one only last), so no batch is cut in two.
        batches = [returned[i : i + self.batch_size] for i in range(0, len(returned), self.batch_size)]
        segments: list[list[Sequence[int]]] = []
        for source, share in zip(change.sources, deal(len(batches), change), strict=True):
            piece = [p for b in share for p in batches[b]]
            segments.append((kept[source] if source is not None else []) + ([piece] if piece else []))
        self.segments = segments
        return lost_batches


@dataclass(frozen=True)
class _PendingCuts:
    """A join applied on this rank whose re-split waits for every member's handed-out count."""

    change: StreamChange
    keys: tuple[tuple[int, str], ...]  # (old rank, store key) of every member that stays


class OwnStreamDispatch(ElCheSampler):
    """A policy that splits the epoch's positions (or a resumed epoch's remainder) into one fixed
    stream per rank, trained in order; what a rank trained is therefore a count of picks."""

    def stream_indices(self, count: int, rank: int, world_size: int) -> range:
        """Indices, into a sequence of ``count`` positions, of ``rank``'s stream among ``world_size``."""
        return self._stream(count, rank, world_size, self.partition_ratios)

    def own_stream(self) -> Sequence[int]:
        """This rank's positions in the epoch order (in a resumed epoch: of its remainder)."""
        universe = self._epoch_universe()
        indices = self.stream_indices(len(universe), self.rank, self.world_size)
        return universe[indices.start : indices.stop : indices.step]

    def _stream(self, count: int, rank: int, world_size: int, ratios: Optional[Sequence[float]]) -> range:
        raise NotImplementedError

    def _deal(self, count: int, change: StreamChange) -> list[list[int]]:
        raise NotImplementedError

    def _ratios_after(self, change: Change) -> Optional[tuple[float, ...]]:
        """The fixed shares after ``change`` (None: the equal split)."""
        return None

    # -- the epoch -----------------------------------------------------------------------------

    def _prepare_epoch(self) -> None:
        self._own: Sequence[int] = self.own_stream()
        self._handed = 0  # batches of this rank's work it has handed to its DataLoader this epoch
        self._plan: Optional[StreamPlan] = None  # every rank's segments, from the epoch's first change
        self._log: list[StreamChange] = []
        self._log_start: tuple[int, Optional[tuple[float, ...]]] = (self.world_size, self._ratios())
        self._pending: Optional[_PendingCuts] = None

    def _ratios(self) -> Optional[tuple[float, ...]]:
        return None if self.partition_ratios is None else tuple(self.partition_ratios)

    def _current_plan(self) -> Optional[StreamPlan]:
        """The epoch's plan once every member's handed-out count of a pending join is known."""
        pending = self._pending
        if pending is not None:
            assert self._plan is not None and self.counter is not None
            keys = [key for _, key in pending.keys]
            deadline = time.monotonic() + HANDED_WAIT_S
            while not self.counter.check(keys):
                if time.monotonic() > deadline:
                    missing = [key for key in keys if not self.counter.check([key])]
                    raise RuntimeError(
                        f"Rank {self.rank} waited {HANDED_WAIT_S:.0f} s for every member to say how far it had handed "
                        f"out its work of epoch {self.epoch} after a join; missing: {missing}. Every member that "
                        "stays must apply the change."
                    )
                time.sleep(0.002)
            handed = tuple((rank, int(read_entries(self.counter, key)[0])) for rank, key in pending.keys)
            change = replace(pending.change, handed=handed)
            self._pending = None
            self._plan.apply(change, self._deal)
            self._log.append(change)
        return self._plan

    def _settle_cuts_of_lost(self, change: Change) -> None:
        """A member lost before it said how far it had handed its work out at a pending join: its
        trained batches in the consensus stand in for that count (what it handed beyond them goes
        back to the epoch either way). The first entry of a key counts, so every member settles on
        the same value even if the lost one still writes its own."""
        pending = self._pending
        if pending is None:
            return
        assert self.counter is not None
        keys = dict(pending.keys)
        for rank, trained in change.trained_by_old_rank().items():
            before = pending.change.sources[rank]  # its rank when the pending join came
            if before is not None and not self.counter.check([keys[before]]):
                self.counter.append(keys[before], f"{trained};")

    def _first_plan(self, world_size: int, ratios: Optional[Sequence[float]]) -> StreamPlan:
        universe = self._epoch_universe()
        segments: list[list[Sequence[int]]] = []
        for rank in range(world_size):
            indices = self._stream(len(universe), rank, world_size, ratios)
            segments.append([universe[indices.start : indices.stop : indices.step]])
        return StreamPlan(segments, self.batch_size, self.drop_last)

    def _follow_change(self, change: Change, span: int) -> int:
        self._settle_cuts_of_lost(change)
        plan = self._current_plan()
        if plan is None:
            plan = self._first_plan(self.world_size, self.partition_ratios)
        trained = change.trained_by_old_rank()
        for rank, count in trained.items():
            total = plan.batches(rank)
            if count > total:
                member = change.before[rank]
                raise ValueError(
                    f"Change(trained_batches={{{member}: {count}}}) is invalid: rank {rank} had {total} batches "
                    f"of epoch {self.epoch}."
                )
        record = StreamChange(
            sources=tuple(change.old_rank(k) for k in range(change.world_size_after)),
            trained=tuple(sorted(trained.items())),
            ratios=self._ratios_after(change),
        )
        if record.joins:
            if self.counter is None or missing_counter_methods(self.counter):
                raise ValueError(
                    f"{type(self).__name__}.apply_change() with joiners needs a shared counter (the torch.distributed "
                    "store, counter=...): the members learn how far each had handed out its work through it."
                )
            keys = EpochKeys.of(self.key_prefix, self.epoch, self.generation)
            self.counter.append(keys.handed(change.generation, self.rank), f"{self._handed};")
            survivors = [source for source in record.sources if source is not None]
            self._pending = _PendingCuts(record, tuple((k, keys.handed(change.generation, k)) for k in survivors))
            returned = sum(len(plan.split(rank, count)[1]) for rank, count in trained.items())
            lost_batches = math.ceil(returned / self.batch_size)
        else:
            lost_batches = plan.apply(record, self._deal)
            self._log.append(record)
        self._plan = plan
        if record.ratios is not None:
            self.partition_ratios = list(record.ratios)
        return lost_batches

    def _epoch_plan(self) -> StreamLog:
        self._current_plan()
        world_size, ratios = self._log_start
        return StreamLog(world_size, ratios, tuple(self._log))

    def _adopt_plan(self, plan: StreamLog) -> None:
        self._prepare_epoch()
        self._log_start = (plan.world_size, plan.ratios)
        replayed = self._first_plan(plan.world_size, plan.ratios)
        for change in plan.changes:
            replayed.apply(change, self._deal)
        self._plan, self._log = replayed, list(plan.changes)

    # -- iterating -----------------------------------------------------------------------------

    def _continue_epoch(self, order: list[int]) -> Iterator[Union[int, PickKey]]:
        # A batch after a short one would shift the batches: the opening ends, reopen() goes on.
        while self._cursor.opening_picks % self.batch_size == 0:
            batch = self._next_batch()
            if batch is None:
                if self.drop_last and not self._cursor.changed:
                    # The short end of the rank's stream, for the DataLoader to drop, as under DDP.
                    whole = batch_count(len(self._own), self.batch_size, True) * self.batch_size
                    yield from self._yield_positions(order, self._own[whole:])
                return
            yield from self._yield_positions(order, batch)

    def _next_batch(self) -> Optional[Sequence[int]]:
        plan = self._current_plan()  # read again each time: a change may have moved work
        if plan is None:
            own, start = self._own, self._handed * self.batch_size
            if self._handed >= batch_count(len(own), self.batch_size, self.drop_last):
                return None
            batch: Optional[Sequence[int]] = own[start : min(start + self.batch_size, len(own))]
        else:
            batch = plan.batch(self.rank, self._handed)
        if batch is not None:
            self._handed += 1
        return batch

    def _work_left(self) -> bool:
        plan = self._current_plan()
        if plan is None:
            return self._handed < batch_count(len(self._own), self.batch_size, self.drop_last)
        return self._handed < plan.batches(self.rank)

    # -- coverage ------------------------------------------------------------------------------

    def local_coverage(self, batches: int) -> Union[list[Range], int]:
        plan = self._current_plan() if self._cursor.changed else None
        if plan is None:
            return min(batches * self.batch_size, len(self.own_stream()))
        # After a change a count no longer names positions on its own: report them.
        try:
            done, _ = plan.split(self.rank, batches)
        except ValueError:
            raise RuntimeError(
                f"Rank {self.rank} trained {batches} batches in epoch {self.epoch}, more than it was "
                "dispatched: the dispatch record is out of step with training."
            ) from None
        return compress(done)

    def _untrained(self, gathered: Sequence[Union[list[Range], int]]) -> list[Range]:
        universe = self._epoch_universe()
        plan = self._current_plan() if self._cursor.changed else None
        if plan is not None:
            if any(isinstance(entry, int) for entry in gathered):
                raise ValueError("After a membership change every rank's local coverage lists positions, not a count.")
            taken = [r for ranges in gathered for r in ranges] + plan.lost_trained  # type: ignore[union-attr]
            return subtract(runs(universe), taken)
        streams = [self.stream_indices(len(universe), rank, self.world_size) for rank in range(self.world_size)]
        return stream_remaining(universe, [int(t) for t in gathered], streams, self.epoch)  # type: ignore[arg-type]

    def _legacy_remaining(self, coverage: EpochCoverage) -> list[Range]:
        # Such records counted each rank's progress through its stream of the whole epoch.
        offsets = legacy_offsets(coverage)
        self._check_legacy_layout(coverage.world_size)
        universe = range(self.samples_per_epoch)
        streams = [self.stream_indices(len(universe), r, coverage.world_size) for r in range(coverage.world_size)]
        return stream_remaining(universe, offsets, streams, coverage.epoch)

    def _check_legacy_layout(self, world_size: int) -> None:
        """Refuse a legacy record whose ranks' streams this run cannot rebuild."""


class EqualDispatch(OwnStreamDispatch):
    """Sync modes: the epoch split equally, interleaved like ``DistributedSampler`` (no padding);
    a resumed epoch's remainder is interleaved over the resumed run's ranks the same way. Work put
    back into the epoch by a change is dealt round-robin in whole batches over the new numbering,
    joiners included."""

    dispatch = Dispatch.EQUAL

    @property
    def samples_per_epoch(self) -> int:
        return self.num_samples  # each rank's own partial batch is left to the DataLoader, as under DDP

    def _stream(self, count: int, rank: int, world_size: int, ratios: Optional[Sequence[float]]) -> range:
        return range(rank, count, world_size)

    def _deal(self, count: int, change: StreamChange) -> list[list[int]]:
        # Whole batches dealt round-robin: shares differ by at most one batch.
        world = len(change.sources)
        return [list(range(k, count, world)) for k in range(world)]


class FixedDispatch(OwnStreamDispatch):
    """``partition_ratios``: each rank a fixed contiguous share of whole batches (of the epoch, or
    of a resumed epoch's remainder).

    After a change the members that stay keep their ratios, renormalised; a joiner gets an equal
    share of the ratios (``1 / new world size``; the others are scaled to the rest), since it has no
    ratio of its own. Work put back into the epoch is dealt in contiguous shares by those ratios,
    which stay for the next epochs.
    """

    dispatch = Dispatch.FIXED

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

    def _stream(self, count: int, rank: int, world_size: int, ratios: Optional[Sequence[float]]) -> range:
        ratios = list(ratios or [])
        if world_size != len(ratios):
            raise ValueError(f"partition_ratios={ratios} describe {len(ratios)} ranks, not {world_size}.")
        shares = fixed_share_batches(math.ceil(count / self.batch_size), ratios)
        first = sum(shares[:rank]) * self.batch_size
        return range(first, min(first + shares[rank] * self.batch_size, count))

    def _ratios_after(self, change: Change) -> Optional[tuple[float, ...]]:
        ratios = self.partition_ratios or []
        kept = [ratios[k] for k in change.survivors]
        total = sum(kept)
        base = [r / total for r in kept] if total > 0 else [1.0 / len(kept)] * len(kept)
        world, joined = change.world_size_after, len(change.joined)
        return tuple([r * (world - joined) / world for r in base] + [1.0 / world] * joined)

    def _deal(self, count: int, change: StreamChange) -> list[list[int]]:
        counts = fixed_share_batches(count, change.ratios or ())
        firsts = [sum(counts[:k]) for k in range(len(counts))]
        return [list(range(first, first + n)) for first, n in zip(firsts, counts, strict=True)]

    def _check_legacy_layout(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise ValueError(
                f"The checkpoint's data coverage (an older per-rank record of partition_ratios for {world_size} "
                f"ranks) cannot be split over {self.world_size} ranks: resume it with {world_size} ranks, or "
                "resume from an epoch-end checkpoint."
            )
