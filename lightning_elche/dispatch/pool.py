"""The pooled dispatch (cadence and async modes): chunks of whole batches claimed from the store.

Each epoch is cut into chunks (:func:`~lightning_elche.dispatch.order.chunk_layout`) that ranks
claim through an atomic counter, so a faster rank simply claims more, and adapts within an epoch
if a rank slows down. Each rank's first chunk is reserved (chunk ``r`` goes to rank ``r``), so no
rank finds the pool empty before it has trained anything. Every claim is recorded in the store
before it is yielded, so that the others can read what a lost rank had claimed.

A membership change closes the current *span* of the epoch and opens the next: the lost ranks'
untrained batches (claimed beyond their consensus, claimed but unrecorded, or a reserved chunk
never claimed) are queued, and every rank of the new numbering claims from that queue, then from
the pool through a counter of the new span, until both are dry. A joiner is one more rank: it has
no reserved chunk and claims from the queue and the pool from its first batch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Optional, Union

from lightning_elche.augment import PickKey
from lightning_elche.config import Dispatch
from lightning_elche.coverage import Range, claimed_prefix, compress, expand, merge, subtract
from lightning_elche.dispatch.order import batches_of, chunk_layout
from lightning_elche.dispatch.sampler import ElCheSampler
from lightning_elche.dispatch.store import COUNTER_METHODS, EpochKeys, missing_counter_methods, read_entries
from lightning_elche.dispatch.tail import TailRule
from lightning_elche.membership.change import Change


@dataclass
class PoolPlan:
    """What every member knows of a pooled epoch's changes (identical on all; a joiner takes it over)."""

    epoch_world: int
    """Ranks at the epoch's start: chunk ``r`` was reserved for rank ``r``."""
    epoch_generation: int
    """The membership generation the epoch started with: its store keys carry it."""
    layout_share: Optional[float]
    """The slowest share the epoch's layout was cut for (None: an equal share)."""
    queues: list[list[Range]] = field(default_factory=lambda: [[]])
    """``queues[g]``: the batches (local spans) the change opening span ``g`` returned, sorted, so
    the epoch's short tail batch comes last."""
    pool_bases: list[int] = field(default_factory=list)
    """``pool_bases[g]``: the first pool chunk of span ``g``'s counter (where the claims before ended)."""
    lineage: list[tuple[Optional[int], ...]] = field(default_factory=list)
    """``lineage[g - 1]``: for every rank of span ``g``, its rank in span ``g - 1`` (None: it joined)."""
    lost_trained: list[Range] = field(default_factory=list)
    """Positions the lost ranks trained into the consensus."""

    def copy(self) -> PoolPlan:
        return PoolPlan(self.epoch_world, self.epoch_generation, self.layout_share, [list(q) for q in self.queues],
                        list(self.pool_bases), list(self.lineage), list(self.lost_trained))


@dataclass
class PoolEpoch:
    """One rank's view of its pooled epoch: the shared plan and its own claim state."""

    epoch: int
    plan: PoolPlan
    keys: EpochKeys
    positions: Optional[list[int]]
    """Global positions of the pooled picks (None: the whole epoch, positions are local ones)."""
    limit: int
    """The end of the last batch, in local positions."""
    layout: list[tuple[int, int]]
    reserved: Optional[int]
    """This rank's reserved chunk while it has not claimed it (None: claimed, or a joiner)."""
    last_chunk: Optional[int] = None
    queue_dry: bool = False
    left_tail: Optional[int] = None
    """The span (changes before it) in which this rank left the pool's tail to faster ranks: it
    claims no more in that span, so a reopened iterator would find nothing for it."""

    @property
    def total_batches(self) -> int:
        """Batches in the layout, in O(1) (chunks are contiguous)."""
        return self.batches_from(0)

    def batches_from(self, chunk: int) -> int:
        """Batches in the layout's chunks ``chunk`` to the end, in O(1): it runs at every claim, and
        an epoch may have tens of thousands of chunks."""
        if chunk >= len(self.layout):
            return 0
        last_first, last_count = self.layout[-1]
        return last_first + last_count - self.layout[chunk][0]


class PoolDispatch(ElCheSampler):
    """Cadence and async modes: chunks of whole batches claimed from a shared pool through an
    atomic counter, so a faster rank claims more; near the end of the epoch slower ranks leave the
    tail to faster ones (:meth:`set_speed_shares`, :class:`~lightning_elche.dispatch.tail.TailRule`)."""

    dispatch = Dispatch.POOL

    def _set_up_policy(self) -> None:
        if self.counter is None:
            raise ValueError("dispatch='pool' needs a shared counter (the torch.distributed store).")
        missing = missing_counter_methods(self.counter)
        if missing:
            raise TypeError(
                f"dispatch='pool' needs a counter with {', '.join(COUNTER_METHODS)} (a torch.distributed.Store); "
                f"{type(self.counter).__name__} has no {', '.join(missing)}."
            )
        self._tail: Optional[TailRule] = None
        # The epoch and the batches every rank had started in it at the latest round: where every
        # rank's remaining work of the epoch was measured from, at one moment for all of them.
        self._round_batches: Optional[tuple[int, list[int]]] = None
        self._epoch: Optional[PoolEpoch] = None

    def _check_every_rank_gets_data(self) -> None:
        if self.num_samples < self.world_size * self.batch_size:
            raise ValueError(
                f"The training set has {self.num_samples} samples: too few for {self.world_size} ranks "
                f"with batch_size={self.batch_size}; every rank needs at least one batch per epoch."
            )

    # -- keys ------------------------------------------------------------------------------------

    def _keys(self) -> EpochKeys:
        current = self._epoch
        if current is not None and current.epoch == self.epoch:
            return current.keys
        return EpochKeys.of(self.key_prefix, self.epoch, self.generation)

    def counter_key(self, epoch: int) -> str:
        """The pool's claim counter of ``epoch`` (before any change in it)."""
        current = self._epoch
        if current is not None and current.epoch == epoch:
            return current.keys.base
        return EpochKeys.of(self.key_prefix, epoch, self.generation).base

    def pool_key(self, span: int) -> str:
        """The current epoch's pool claim counter after ``span`` membership changes."""
        return self._keys().pool(span)

    def queue_key(self, span: int) -> str:
        """The claim counter of the batches that change ``span`` (from 1) of the epoch returned."""
        return self._keys().queue(span)

    def claims_key(self, span: int, rank: int) -> str:
        """The record of what ``rank`` (numbered as after ``span`` changes) claimed in the epoch."""
        return self._keys().claims(span, rank)

    @property
    def layout(self) -> list[tuple[int, int]]:
        """The current epoch's chunks, ``(first_batch, batch_count)`` (empty before it is set up)."""
        return [] if self._epoch is None else self._epoch.layout

    def batches_from(self, chunk: int) -> int:
        """Batches in the current layout's chunks ``chunk`` to the end (O(1))."""
        return 0 if self._epoch is None else self._epoch.batches_from(chunk)

    # -- speed shares and the tail rule ------------------------------------------------------------

    @property
    def speed_shares(self) -> Optional[list[float]]:
        """Each rank's share of the cohort's speed, normalised (None: no plan yet, or a join)."""
        return None if self._tail is None else list(self._tail.shares)

    def on_round(
        self, shares: Sequence[float], epoch: Optional[int] = None, epoch_batches: Optional[Sequence[int]] = None
    ) -> None:
        if sum(shares) > 0:
            self.set_speed_shares(shares)
        if epoch is not None and epoch_batches is not None and len(epoch_batches) == self.world_size:
            self._round_batches = (epoch, [int(b) for b in epoch_batches])

    def set_speed_shares(self, shares: Sequence[float]) -> None:
        """Each rank's share of the cohort's throughput (any positive scale), identical on every
        rank; the strategy passes the controller's measured speed shares (its plan before every
        rank has a reading) after every round, through :meth:`on_round`.

        Near the end of a pooled epoch a slower rank then stops claiming chunks when the faster
        ranks would finish what is left sooner without it; one rank, the fastest by the first
        shares of the epoch (or since its latest membership change), claims until the pool is dry,
        so every chunk is still trained exactly once, however the shares change during the epoch
        (:class:`TailRule`).
        """
        if self._tail is None:
            self._tail = TailRule.from_shares(shares, self.world_size)
        else:
            self._tail = self._tail.with_shares(shares)

    def leaves_tail(self) -> bool:
        """Whether this rank would stop claiming now, leaving the epoch's tail to faster ranks
        (after a membership change: once the change's returned work is all claimed)."""
        current = self._epoch
        if self._tail is None or current is None:
            return False
        assert self.counter is not None
        counter, keys, plan, span = self.counter, current.keys, current.plan, self._cursor.changes

        def next_chunk() -> Optional[tuple[int, int]]:
            claim = plan.pool_bases[span] + counter.add(keys.pool(span), 0)
            return None if claim >= len(current.layout) else (current.layout[claim][1], current.batches_from(claim))

        claimed = math.ceil(self.record.samples / self.batch_size)
        # The lost ranks' batches in the consensus are neither any member's nor left in the pool.
        consensus = math.ceil(sum(stop - start for start, stop in plan.lost_trained) / self.batch_size)
        return self._tail.leaves_tail(self.rank, claimed, self._batches_at_round(), current.total_batches - consensus,
                                      self.max_chunk_batches, next_chunk)

    def _batches_at_round(self) -> list[int]:
        """Batches every rank had started in this epoch at the latest round (zeros before one)."""
        at_round = self._round_batches
        if at_round is None or at_round[0] != self.epoch or len(at_round[1]) != self.world_size:
            return [0] * self.world_size
        return at_round[1]

    def _layout_share(self) -> Optional[float]:
        """This rank's proposal for the epoch's layout share, from the shares it holds."""
        tail = self._tail
        if tail is None or len(tail.shares) != self.world_size:
            return None
        return tail.layout_share

    def _agreed_layout_share(self, keys: EpochKeys) -> Optional[float]:
        """The slowest rank's share of the cohort's speed that the epoch's chunk layout plans for
        (None: an equal share): the first one any rank proposed for the epoch, so that every rank
        cuts the epoch the same way (claims name chunks by index), whatever shares each held when
        it started the epoch."""
        assert self.counter is not None
        proposed = self._layout_share()
        self.counter.append(keys.layout, ("-" if proposed is None else repr(proposed)) + ";")
        first = read_entries(self.counter, keys.layout)[0]
        return None if first == "-" else float(first)

    # -- the epoch ---------------------------------------------------------------------------------

    def _epoch_extent(self) -> tuple[Optional[list[int]], int]:
        # A resumed epoch pools only its remaining positions; they are whole batches (but for the
        # epoch's own partial tail), so batches keep their samples.
        resume = self._resumed_epoch()
        positions = None if resume is None or resume.remaining is None else expand(resume.remaining)
        return positions, self.samples_per_epoch if positions is None else len(positions)

    def _prepare_epoch(self) -> None:
        positions, limit = self._epoch_extent()
        keys = EpochKeys.of(self.key_prefix, self.epoch, self.generation)
        share = self._agreed_layout_share(keys)
        layout = chunk_layout(math.ceil(limit / self.batch_size), self.world_size, self.max_chunk_batches, share)
        plan = PoolPlan(self.world_size, self.generation, share, pool_bases=[self.world_size])
        self._epoch = PoolEpoch(self.epoch, plan, keys, positions, limit, layout, reserved=self.rank)

    def _start_epoch(self) -> None:
        if not self._cursor.changed and self._tail is not None:
            # The drainer is the fastest by the first shares this rank holds in the epoch.
            self._tail = TailRule.from_shares(self._tail.shares, len(self._tail.shares))

    def _continue_epoch(self, order: list[int]) -> Iterator[Union[int, PickKey]]:
        assert self.counter is not None and self._epoch is not None
        # Work is claimed only on a batch boundary: after the epoch's short tail batch the opening
        # ends (a piece claimed after it would be batched differently than its peers assume).
        while self._cursor.opening_picks % self.batch_size == 0:
            claimed = self._claim()
            if claimed is None:
                return
            name, (start, stop) = claimed
            # Recorded before it is yielded: the others read it if this rank is lost.
            self.counter.append(self._epoch.keys.claims(self._cursor.changes, self.rank), name + ";")
            self.record.spans.append((start, stop))
            positions = self._epoch.positions
            local = range(start, stop)
            yield from self._yield_positions(order, local if positions is None else [positions[p] for p in local])

    def _claim(self) -> Optional[tuple[str, Range]]:
        """The next piece of work for this rank: its reserved chunk, then (after a change) the
        returned batches, then pool chunks; None when there is none (or it leaves the tail)."""
        assert self.counter is not None and self._epoch is not None
        current = self._epoch
        if current.reserved is not None:
            reserved, current.reserved = current.reserved, None
            return self._chunk_claim(reserved)
        span = self._cursor.changes
        if self._cursor.changed and not current.queue_dry:
            queue = current.plan.queues[span]
            index = self.counter.add(current.keys.queue(span), 1) - 1
            if index < len(queue):
                return f"r{span}.{index}", queue[index]
            current.queue_dry = True
        # After a change too: without the rule a slow rank took one of the last chunks of every
        # epoch with a join or a loss in it, and the others waited for it at the end.
        if current.last_chunk is not None and self.leaves_tail():
            current.left_tail = span
            return None
        return self._chunk_claim(current.plan.pool_bases[span] + self.counter.add(current.keys.pool(span), 1) - 1)

    def _chunk_claim(self, chunk: int) -> Optional[tuple[str, Range]]:
        assert self._epoch is not None
        if chunk >= len(self._epoch.layout):
            return None
        self.record.chunks.append(chunk)
        self._epoch.last_chunk = chunk
        return f"c{chunk}", self._chunk_span(chunk)

    def _chunk_span(self, chunk: int) -> Range:
        assert self._epoch is not None
        first_batch, batch_count = self._epoch.layout[chunk]
        return first_batch * self.batch_size, min((first_batch + batch_count) * self.batch_size, self._epoch.limit)

    def _work_left(self) -> bool:
        assert self.counter is not None and self._epoch is not None
        current, span = self._epoch, self._cursor.changes
        if current.left_tail == span:
            return False  # what is left is the faster ranks' (a later change may hand it more)
        if self.counter.add(current.keys.queue(span), 0) < len(current.plan.queues[span]):
            return True
        return current.plan.pool_bases[span] + self.counter.add(current.keys.pool(span), 0) < len(current.layout)

    # -- membership changes: what the lost ranks claimed comes back to the epoch -----------------

    def _follow_change(self, change: Change, span: int) -> int:
        assert self.counter is not None and self._epoch is not None
        current = self._epoch
        plan, keys, layout = current.plan, current.keys, current.layout
        trained = change.trained_by_old_rank()
        returned: list[Range] = []
        lost_trained = list(plan.lost_trained)
        for rank in change.lost:
            lineage = self._lineage_of(rank, span)
            claims = [name for g, r in lineage for name in self._claims(g, r)]
            batches = [b for name in claims for b in self._batches_of(self._span_of(name))]
            count = trained[rank]
            if count > len(batches):
                raise ValueError(
                    f"Change(trained_batches={{{change.before[rank]}: {count}}}) is invalid: rank {rank} had "
                    f"claimed {len(batches)} batches of epoch {self.epoch}."
                )
            lost_trained = merge(lost_trained + self._global(batches[:count]))
            returned += batches[count:]
            first_span, first_rank = lineage[0]
            if first_span == 0 and f"c{first_rank}" not in claims and first_rank < len(layout):
                # It never started the epoch (or died before recording its reserved chunk).
                returned += self._batches_of(self._chunk_span(first_rank))
        # Claimed in this span but unrecorded: a lost rank died between a claim and its record.
        # Nobody claims during a change, so every other claim is recorded by now.
        recorded = {name for rank in range(self.world_size) for name in self._claims(span, rank)}
        base = plan.pool_bases[span]
        claimed = min(len(layout), base + self.counter.add(keys.pool(span), 0))
        returned += [b for chunk in range(base, claimed) if f"c{chunk}" not in recorded
                     for b in self._batches_of(self._chunk_span(chunk))]
        if span:
            # The span's queue closes: its unclaimed and claimed-unrecorded batches move on.
            queue = plan.queues[span]
            taken = min(len(queue), self.counter.add(keys.queue(span), 0))
            returned += [b for i, b in enumerate(queue) if i >= taken or f"r{span}.{i}" not in recorded]
        # Pool claims of the next span go through a counter of their own, from where this span's
        # ended: each span's claims are settled once, and a lost rank still running cannot take
        # the members' chunks.
        plan.pool_bases.append(max(base, claimed))
        plan.queues.append(sorted(returned))
        plan.lineage.append(tuple(change.old_rank(k) for k in range(change.world_size_after)))
        plan.lost_trained = lost_trained
        current.queue_dry = False
        tail = self._tail
        kept = [] if tail is None or change.is_join else [tail.shares[k] for k in change.survivors]
        self._tail = TailRule.from_shares(kept, len(kept)) if sum(kept) > 0 else None
        at_round = self._round_batches
        if at_round is not None and at_round[0] == self.epoch and len(at_round[1]) == self.world_size:
            # The tail rule counts from the latest round: a joiner had started none of the epoch then.
            self._round_batches = (at_round[0], change.carry(at_round[1], lambda: 0))
        return len(returned)

    def _lineage_of(self, rank: int, span: int) -> list[tuple[int, int]]:
        """``(span, rank in it)`` of ``rank`` (numbered as in ``span``) in every span of the epoch
        it was in, from the first."""
        assert self._epoch is not None
        pairs = [(span, rank)]
        for g in range(span, 0, -1):
            before = self._epoch.plan.lineage[g - 1][pairs[-1][1]]
            if before is None:
                break  # it joined with change g
            pairs.append((g - 1, before))
        return pairs[::-1]

    def _claims(self, span: int, rank: int) -> list[str]:
        """What ``rank`` (numbered as in ``span``) recorded claiming in that span."""
        assert self.counter is not None and self._epoch is not None
        return read_entries(self.counter, self._epoch.keys.claims(span, rank))

    def _span_of(self, name: str) -> Range:
        assert self._epoch is not None
        if name.startswith("c"):
            return self._chunk_span(int(name[1:]))
        span, index = name[1:].split(".")
        return self._epoch.plan.queues[int(span)][int(index)]

    def _batches_of(self, span: Range) -> list[Range]:
        return batches_of(span, self.batch_size, self.drop_last)

    def _global(self, spans: Sequence[Range]) -> list[Range]:
        """Local spans as epoch positions."""
        positions = None if self._epoch is None else self._epoch.positions
        if positions is None:
            return merge(spans)
        return compress(positions[p] for start, stop in spans for p in range(start, stop))

    def _epoch_plan(self) -> PoolPlan:
        assert self._epoch is not None
        return self._epoch.plan.copy()

    def _adopt_plan(self, plan: PoolPlan) -> None:
        positions, limit = self._epoch_extent()
        keys = EpochKeys.of(self.key_prefix, self.epoch, plan.epoch_generation)
        layout = chunk_layout(math.ceil(limit / self.batch_size), plan.epoch_world, self.max_chunk_batches,
                              plan.layout_share)
        self._epoch = PoolEpoch(self.epoch, plan.copy(), keys, positions, limit, layout, reserved=None)
        self._tail = None

    # -- coverage: what a mid-epoch checkpoint keeps ---------------------------------------------

    def local_coverage(self, batches: int) -> Union[list[Range], int]:
        """Epoch positions of the work this rank claimed, in claim order, up to ``batches``
        batches: what the DataLoader claimed beyond them (prefetch) is not trained and stays in
        the epoch's remainder."""
        try:
            local = claimed_prefix(self.record.spans, batches, self.batch_size)
        except ValueError:
            claimed = sum(math.ceil((stop - start) / self.batch_size) for start, stop in self.record.spans)
            raise RuntimeError(
                f"Rank {self.rank} trained {batches} batches in epoch {self.epoch} but claimed only "
                f"{claimed}: the dispatch record is out of step with training."
            ) from None
        return self._global(local)

    def _untrained(self, gathered: Sequence[Union[list[Range], int]]) -> list[Range]:
        resume = self._resumed_epoch()
        universe = [(0, self.samples_per_epoch)] if resume is None else list(resume.remaining or [])
        taken = [r for ranges in gathered for r in ranges]  # type: ignore[union-attr]
        if self._cursor.changed and self._epoch is not None:
            taken += self._epoch.plan.lost_trained  # the lost ranks' batches in the consensus
        return subtract(universe, taken)
