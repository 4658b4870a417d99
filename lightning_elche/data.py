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

When ranks are lost mid-epoch, :meth:`ElCheSampler.regroup` hands their untrained work of the
epoch to the survivors (:class:`LostWork` says how much of it is in the consensus): the equal
and fixed splits append a share of the lost ranks' remaining stream to each survivor's, the pool
queues the lost ranks' untrained batches (read from the claim records every rank keeps in the
store) ahead of its remaining chunks. A survivor whose iterator had already ended continues the
epoch with :meth:`~ElCheSampler.reopen` when :attr:`~ElCheSampler.wants_reopen` says so.
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
from lightning_elche.membership.change import Change

CHUNK_KEY_PREFIX = "lightning_elche/dispatch"

SMALLEST_LAYOUT_SHARE = 0.02
"""The chunk layout plans for a slowest rank with at least this share of the cohort's speed."""


class ChunkCounter(Protocol):
    """The shared store behind chunk claims (``torch.distributed.Store`` satisfies it): an atomic
    counter for claims, and append-only records of what each rank claimed (read after a loss)."""

    def add(self, key: str, amount: int) -> int: ...

    def append(self, key: str, value: str) -> None: ...

    def check(self, keys: list[str]) -> bool: ...

    def get(self, key: str) -> bytes: ...


COUNTER_METHODS = ("add", "append", "check", "get")


@dataclass(frozen=True)
class LostWork:
    """A rank lost mid-epoch, as :meth:`ElCheSampler.regroup` needs it."""

    rank: int
    """The lost rank, in the numbering in force before the regroup."""
    trained_batches: int
    """Batches of the current epoch it had trained when it last contributed to a completed
    averaging round: those are in the consensus; the rest of its work is re-dispatched."""


def epoch_permutation(num_samples: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    """The epoch's sample order: ``DistributedSampler``'s, so sync modes reproduce DDP's batches."""
    if not shuffle:
        return list(range(num_samples))
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(num_samples, generator=generator).tolist()


def chunk_layout(
    num_batches: int, world_size: int, max_chunk_batches: int, smallest_share: Optional[float] = None
) -> list[tuple[int, int]]:
    """Cut ``num_batches`` into ``(first_batch, batch_count)`` chunks, shrinking toward the end.

    Chunks are ``max_chunk_batches`` long while plenty remains and at most half the slowest rank's
    share of what remains after that (``smallest_share``, default an equal share ``1 /
    world_size``), down to single batches (guided scheduling). When the pool runs dry no rank then
    holds more than about one batch of work the others must wait for, and a slow rank deciding to
    leave the tail (:meth:`PoolDispatch.set_speed_shares`) faces chunks small against its share.
    """
    chunks: list[tuple[int, int]] = []
    start = 0
    while start < num_batches:
        remaining = num_batches - start
        if smallest_share is None:
            half_share = remaining // (2 * world_size)
        else:
            half_share = math.floor(remaining * smallest_share / 2.0)
        size = max(1, min(max_chunk_batches, half_share))
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
    """Pool chunks this rank claimed (its reserved chunk first), in claim order."""
    spans: list[Range] = field(default_factory=list)
    """Pooled dispatch: every claimed piece of work (chunks and re-dispatched batches) as local
    ``[start, stop)`` spans, in claim order: the rank's batches are these spans cut into batches."""
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
        # One epoch may be iterated in several openings (reopen() after a regroup). An opening
        # ends when the work it reached does not start on a batch boundary, so that every rank's
        # batches are the same whatever the timing, as its peers compute them after it is lost.
        self._prepared_epoch: Optional[int] = None  # the epoch the policy's state was set up for
        self._started_epoch: Optional[int] = None  # the epoch this rank's iterator started
        self._exhausted = False  # this rank's latest iterator of that epoch ran to its end
        self._reopen_pending = False
        self._opening_picks = 0  # picks yielded by the current opening
        self._regroup_epoch: Optional[int] = None  # the epoch the regroups below belong to
        self._regroups = 0  # regroups in that epoch
        self._membership = 0  # regroups since the fit started: a new membership after each
        self._lost_trained: list[Range] = []  # positions the lost ranks trained into the consensus
        self.returned_batches = 0
        """Batches the last :meth:`regroup` handed to the survivors (the same on every survivor)."""
        self._set_up_policy()
        self._check_every_rank_gets_data()
        self._prepare_epoch_policy()

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

    def on_round(
        self, shares: Sequence[float], epoch: Optional[int] = None, epoch_batches: Optional[Sequence[int]] = None
    ) -> None:
        """After every round, with each rank's share of the cohort's speed (any positive scale,
        identical on every rank: :attr:`~lightning_elche.engine.RoundOutcome.dispatch_shares`)
        and, when known, the batches every rank had started in ``epoch`` at the round. Only the
        pooled dispatch uses them."""

    def __iter__(self) -> Iterator[Union[int, PickKey]]:
        order = epoch_permutation(self.num_samples, self.epoch, self.seed, self.shuffle)
        if self._reopen_pending:
            self._reopen_pending = False
            self._exhausted = False
            self._opening_picks = 0
            yield from self._continue_epoch(order)
            self._exhausted = True
            return
        if self._regrouped_now():
            if self._started_epoch == self.epoch:
                raise RuntimeError(
                    f"Rank {self.rank}'s training DataLoader was iterated again in epoch {self.epoch} after a "
                    "regroup without reopen(): the epoch's work would be dispatched twice."
                )
        else:
            self._prepare_epoch()
        self._started_epoch = self.epoch
        self.record = DispatchRecord(epoch=self.epoch)
        if self.started_batches is not None:
            self.started_batches = 0
        self._exhausted = False
        self._opening_picks = 0
        yield from self._iter_epoch(order, self._resumed_epoch())
        self._exhausted = True

    def _prepare_epoch(self) -> None:
        """Set up the current epoch's dispatch (a fresh epoch, no regroup yet)."""
        self._prepared_epoch = self.epoch
        self._regroup_epoch = None
        self._regroups = 0
        self._lost_trained = []
        self._prepare_epoch_policy()

    def _regrouped_now(self) -> bool:
        return self._regroup_epoch == self.epoch

    # -- losing ranks mid-epoch -------------------------------------------------------------

    def regroup(self, survivors: Sequence[int], lost: Sequence[LostWork]) -> None:
        """Hand the lost ranks' untrained work of the current epoch to the survivors.

        ``survivors`` are the ranks that go on, ascending, in the numbering in force before this
        call (new rank ``k`` is ``survivors[k]``; this rank is one of them); ``lost`` names every
        other rank of that numbering, with the batches of the epoch it had trained at its last
        contribution to the consensus. Afterwards :attr:`rank` and :attr:`world_size` are the new
        numbering. Every survivor must call it with the same arguments while none of them trains or
        claims: each computes the same split from them (and, pooled, from the store's records)."""
        survivors = [int(s) for s in survivors]
        if not survivors or survivors != sorted(set(survivors)) or survivors[0] < 0 or survivors[-1] >= self.world_size:
            raise ValueError(
                f"survivors={survivors} is invalid: expected distinct ranks of 0..{self.world_size - 1}, ascending."
            )
        if self.rank not in survivors:
            raise ValueError(f"survivors={survivors} does not hold this rank ({self.rank}): only survivors regroup.")
        lost_ranks = sorted(work.rank for work in lost)
        expected = sorted(set(range(self.world_size)) - set(survivors))
        if lost_ranks != expected:
            raise ValueError(
                f"lost ranks {lost_ranks} do not match survivors={survivors}: with world_size={self.world_size} "
                f"every other rank ({expected}) must be lost, each once."
            )
        for work in lost:
            count = work.trained_batches
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise ValueError(
                    f"LostWork(rank={work.rank}, trained_batches={work.trained_batches!r}): trained_batches must "
                    "be an int >= 0."
                )
        if not self._regrouped_now():
            if self._prepared_epoch != self.epoch or self._started_epoch != self.epoch:
                self._prepare_epoch()  # this rank has not started the epoch yet: the regroup sets it up
            self._regroup_epoch = self.epoch
        self._regroup_policy(survivors, sorted(lost, key=lambda work: work.rank))
        self._regroups += 1
        self._membership += 1
        self.rank = survivors.index(self.rank)
        self.world_size = len(survivors)

    def apply_change(self, change: Change) -> None:
        """The members changed: hand the lost ranks' untrained work to the others (see :meth:`regroup`)."""
        if change.is_join:
            raise NotImplementedError("ElCheSampler cannot take a join yet.")
        self.regroup(change.survivors, [LostWork(k, n) for k, n in sorted(change.trained_by_old_rank().items())])

    @property
    def wants_reopen(self) -> bool:
        """This rank's iterator of the current epoch has ended, yet work re-dispatched by a regroup
        may be left for it: iterating the DataLoader again after :meth:`reopen` continues the epoch.
        Check it whenever the iterator ends in an epoch with a regroup (it can be true again later)."""
        if not (self._exhausted and self._started_epoch == self.epoch and self._regrouped_now()):
            return False
        return self._work_left()

    def reopen(self) -> None:
        """Make the next iteration continue the current epoch (only work this rank has not yet
        been handed; ``record`` and ``started_batches`` carry on) instead of starting it anew."""
        if not (self._exhausted and self._started_epoch == self.epoch):
            raise RuntimeError(
                f"reopen() continues epoch {self.epoch} after rank {self.rank}'s iterator of it ended; "
                "that iterator has not ended (or the epoch never started)."
            )
        self._reopen_pending = True

    def _resumed_epoch(self) -> Optional[EpochCoverage]:
        resume = self._resume
        return resume if resume is not None and resume.epoch == self.epoch else None

    def _key(self, pick: int) -> Union[int, PickKey]:
        if not self.pick_keys:
            return pick
        return PickKey(pick % self.dataset_len, pick // self.dataset_len, self.epoch)

    def _yield_positions(self, order: list[int], positions: Sequence[int]) -> Iterator[Union[int, PickKey]]:
        self.record.samples += len(positions)
        self._opening_picks += len(positions)
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

    def _prepare_epoch_policy(self) -> None:
        """Reset the policy's per-epoch state for a fresh epoch."""

    def _iter_epoch(self, order: list[int], resume: Optional[EpochCoverage]) -> Iterator[Union[int, PickKey]]:
        raise NotImplementedError

    def _continue_epoch(self, order: list[int]) -> Iterator[Union[int, PickKey]]:
        """The rest of this rank's work of the current epoch (a reopened iterator)."""
        raise NotImplementedError

    def _regroup_policy(self, survivors: list[int], lost: list[LostWork]) -> None:
        """Re-dispatch the lost ranks' untrained work (old numbering still in force)."""
        raise NotImplementedError

    def _work_left(self) -> bool:
        """Whether a reopened iterator may still find work for this rank."""
        raise NotImplementedError

    def _batches_of(self, span: Range) -> list[Range]:
        """``[start, stop)`` cut into the DataLoader's batches (a short last one only without drop_last)."""
        start, stop = span
        cuts = [(s, min(s + self.batch_size, stop)) for s in range(start, stop, self.batch_size)]
        if self.drop_last and cuts and cuts[-1][1] - cuts[-1][0] < self.batch_size:
            cuts.pop()
        return cuts

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

    # After a regroup a rank's work is a list of segments: its own stream, then a piece of the lost
    # ranks' remainder per regroup. Each segment is batched from its start (an opening continues
    # into the next segment only on a batch boundary), so every rank's batches are known to all.

    def _prepare_epoch_policy(self) -> None:
        self._segments: Optional[list[list[Sequence[int]]]] = None  # every rank's, once regrouped
        self._next_segment = 0

    def _rank_segments(self) -> list[Sequence[int]]:
        if self._segments is None or not self._regrouped_now():
            return [self.own_stream()]
        return self._segments[self.rank]

    def _iter_epoch(self, order: list[int], resume: Optional[EpochCoverage]) -> Iterator[Union[int, PickKey]]:
        self._next_segment = 0
        yield from self._continue_epoch(order)

    def _continue_epoch(self, order: list[int]) -> Iterator[Union[int, PickKey]]:
        while True:
            segments = self._rank_segments()  # read again each time: a regroup may have added some
            if self._next_segment >= len(segments) or self._opening_picks % self.batch_size:
                return  # a segment after a short batch would shift the batches: reopen() goes on
            segment = segments[self._next_segment]
            self._next_segment += 1
            whole = len(segment) - len(segment) % self.batch_size
            yield from self._yield_positions(order, segment[:whole])
            if whole < len(segment):
                if self.drop_last and self._next_segment < len(self._rank_segments()):
                    continue  # the DataLoader would drop this short batch: go on with the next segment
                yield from self._yield_positions(order, segment[whole:])

    def _work_left(self) -> bool:
        needed = self.batch_size if self.drop_last else 1
        return any(len(segment) >= needed for segment in self._rank_segments()[self._next_segment:])

    def _split_batches(self, segments: Sequence[Sequence[int]], batches: int) -> tuple[list[int], list[int]]:
        """The positions of the first ``batches`` batches of ``segments`` (each segment batched from
        its start), and all the others; ValueError when the segments hold fewer batches."""
        done: list[int] = []
        rest: list[int] = []
        left = batches
        for segment in segments:
            take = min(left, len(self._batches_of((0, len(segment)))))
            picks = min(take * self.batch_size, len(segment))
            done.extend(segment[:picks])
            rest.extend(segment[picks:])
            left -= take
        if left:
            raise ValueError(f"{batches} batches asked, {batches - left} dispatched")
        return done, rest

    def _regroup_policy(self, survivors: list[int], lost: list[LostWork]) -> None:
        if self._segments is None:
            universe = self._epoch_universe()
            self._segments = []
            for rank in range(self.world_size):
                indices = self.stream_indices(len(universe), rank, self.world_size)
                self._segments.append([universe[indices.start : indices.stop : indices.step]])
        returned: list[int] = []
        for work in lost:
            try:
                done, rest = self._split_batches(self._segments[work.rank], work.trained_batches)
            except ValueError:
                total = sum(len(self._batches_of((0, len(s)))) for s in self._segments[work.rank])
                raise ValueError(
                    f"LostWork(rank={work.rank}, trained_batches={work.trained_batches}) is invalid: that rank had "
                    f"{total} batches of epoch {self.epoch}."
                ) from None
            self._lost_trained = merge(self._lost_trained + compress(done))
            returned.extend(rest)
        # Whole batches of the remainder (a short one only last), so no batch is cut in two.
        batches = [returned[i : i + self.batch_size] for i in range(0, len(returned), self.batch_size)]
        self.returned_batches = len(batches)
        shares = self._returned_shares(len(batches), survivors)
        extended: list[list[Sequence[int]]] = []
        for rank, share in zip(survivors, shares, strict=True):
            piece = [p for b in share for p in batches[b]]
            extended.append(self._segments[rank] + ([piece] if piece else []))
        self._segments = extended

    def _returned_shares(self, count: int, survivors: list[int]) -> list[list[int]]:
        """Which of ``count`` returned batches (in order) each survivor takes."""
        raise NotImplementedError

    def local_coverage(self, batches: int) -> Union[list[Range], int]:
        if self._segments is None or not self._regrouped_now():
            return min(batches * self.batch_size, len(self.own_stream()))
        # After a regroup a count no longer names positions on its own: report them.
        try:
            done, _ = self._split_batches(self._segments[self.rank], batches)
        except ValueError:
            raise RuntimeError(
                f"Rank {self.rank} trained {batches} batches in epoch {self.epoch}, more than it was "
                "dispatched: the dispatch record is out of step with training."
            ) from None
        return compress(done)

    def _untrained(self, gathered: Sequence[Union[list[Range], int]]) -> list[Range]:
        universe = self._epoch_universe()
        if self._regrouped_now():
            if any(isinstance(entry, int) for entry in gathered):
                raise ValueError("After a regroup every rank's local coverage lists positions, not a count.")
            taken = [r for ranges in gathered for r in ranges] + self._lost_trained  # type: ignore[union-attr]
            return subtract(runs(universe), taken)
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

    def _returned_shares(self, count: int, survivors: list[int]) -> list[list[int]]:
        # Whole batches dealt round-robin: shares differ by at most one batch.
        return [list(range(k, count, len(survivors))) for k in range(len(survivors))]


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

    def _returned_shares(self, count: int, survivors: list[int]) -> list[list[int]]:
        # Contiguous shares by the survivors' ratios; they keep those ratios for the next epochs.
        ratios = self.partition_ratios or []
        kept = [ratios[s] for s in survivors]
        total = sum(kept)
        self.partition_ratios = [r / total for r in kept] if total > 0 else [1.0 / len(kept)] * len(kept)
        counts = fixed_share_batches(count, self.partition_ratios)
        firsts = [sum(counts[:k]) for k in range(len(counts))]
        return [list(range(first, first + n)) for first, n in zip(firsts, counts, strict=True)]

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
        missing = [name for name in COUNTER_METHODS if not callable(getattr(self.counter, name, None))]
        if missing:
            raise TypeError(
                f"dispatch='pool' needs a counter with {', '.join(COUNTER_METHODS)} (a torch.distributed.Store); "
                f"{type(self.counter).__name__} has no {', '.join(missing)}."
            )
        self._speed_shares: Optional[list[float]] = None
        self._drainer: Optional[int] = None  # the rank that claims until the pool is dry, this epoch
        # The epoch and the batches every rank had started in it at the latest round: where every
        # rank's remaining work of the epoch was measured from, at one moment for all of them.
        self._round_batches: Optional[tuple[int, list[int]]] = None

    def _prepare_epoch_policy(self) -> None:
        # The current epoch's layout, kept for coverage: global positions of the pooled picks
        # (None: the whole epoch), chunk layout and the end of the last batch, in local positions.
        resume = self._resumed_epoch()
        self._positions: Optional[list[int]] = None
        if resume is not None:
            assert resume.remaining is not None
            self._positions = expand(resume.remaining)
        # A resumed epoch pools only its remaining positions; they are whole batches (but for the
        # epoch's own partial tail), so batches keep their samples.
        self._limit = self.samples_per_epoch if self._positions is None else len(self._positions)
        # The numbering the epoch started with: reserved chunks and claim indices keep it.
        self._epoch_rank = self.rank
        self._epoch_world = self.world_size
        # Store keys of an epoch carry the membership it started with: a rank declared lost that
        # still runs (stopped, then continued) claims on keys no survivor uses.
        self._epoch_membership = self._membership
        self._layout: list[tuple[int, int]] = chunk_layout(
            math.ceil(self._limit / self.batch_size), self._epoch_world, self.max_chunk_batches,
            self._agreed_layout_share(),
        )
        self._reserved_pending = True
        self._last_chunk: Optional[int] = None
        # Regroup g (from 1) queues the batches it returned (local spans, the epoch's short tail
        # batch last); after it every rank claims from that queue, then from the pool, until dry.
        self._queues: list[list[Range]] = [[]]
        self._queue_dry = False
        self._lineage: list[list[int]] = []  # survivors of every regroup of the epoch
        # Pool claims after regroup g go through a counter of their own, from chunk _pool_bases[g]
        # on (where the claims before it ended): the claims of each regroup's span are settled at
        # the next regroup, once, and a lost rank still running cannot take the survivors' chunks.
        self._pool_bases: list[int] = [self._epoch_world]

    def _check_every_rank_gets_data(self) -> None:
        if self.num_samples < self.world_size * self.batch_size:
            raise ValueError(
                f"The training set has {self.num_samples} samples: too few for {self.world_size} ranks "
                f"with batch_size={self.batch_size}; every rank needs at least one batch per epoch."
            )

    def counter_key(self, epoch: int) -> str:
        """The pool's claim counter of ``epoch`` (before any regroup in it)."""
        membership = self._epoch_membership if epoch == self.epoch else self._membership
        if membership == 0:
            return f"{self.key_prefix}/epoch{epoch}"
        return f"{self.key_prefix}/m{membership}/epoch{epoch}"

    def pool_key(self, regroup: int) -> str:
        """The current epoch's pool claim counter after ``regroup`` regroups."""
        base = self.counter_key(self.epoch)
        return base if regroup == 0 else f"{base}/pool{regroup}"

    def queue_key(self, regroup: int) -> str:
        """The claim counter of the batches that regroup ``regroup`` (from 1) of the epoch returned."""
        return f"{self.counter_key(self.epoch)}/returned{regroup}"

    def claims_key(self, regroup: int, rank: int) -> str:
        """The record of what ``rank`` (numbered as after ``regroup`` regroups) claimed in the epoch."""
        return f"{self.counter_key(self.epoch)}/claims/g{regroup}/r{rank}"

    def on_round(
        self, shares: Sequence[float], epoch: Optional[int] = None, epoch_batches: Optional[Sequence[int]] = None
    ) -> None:
        if sum(shares) > 0:
            self.set_speed_shares(shares)
        if epoch is not None and epoch_batches is not None and len(epoch_batches) == self.world_size:
            self._round_batches = (epoch, [int(b) for b in epoch_batches])

    def _iter_epoch(self, order: list[int], resume: Optional[EpochCoverage]) -> Iterator[Union[int, PickKey]]:
        if not self._regrouped_now():
            self._drainer = self._fastest_rank()
        yield from self._continue_epoch(order)

    def _continue_epoch(self, order: list[int]) -> Iterator[Union[int, PickKey]]:
        assert self.counter is not None
        # Work is claimed only on a batch boundary: after the epoch's short tail batch the opening
        # ends (a piece claimed after it would be batched differently than its peers assume).
        while self._opening_picks % self.batch_size == 0:
            claimed = self._claim()
            if claimed is None:
                return
            name, (start, stop) = claimed
            # Recorded before it is yielded: the survivors of this rank read it if it is lost.
            self.counter.append(self.claims_key(self._regroups, self.rank), name + ";")
            self.record.spans.append((start, stop))
            local = range(start, stop)
            positions = self._positions
            yield from self._yield_positions(order, local if positions is None else [positions[p] for p in local])

    def _claim(self) -> Optional[tuple[str, Range]]:
        """The next piece of work for this rank: its reserved chunk, then (after a regroup) the
        returned batches, then pool chunks; None when there is none (or it leaves the tail)."""
        assert self.counter is not None
        if self._reserved_pending:
            # The first chunk of each rank is reserved, so that no rank can find the pool empty
            # before it has trained anything; the rest are claimed in order through the counter.
            self._reserved_pending = False
            return self._chunk_claim(self._epoch_rank)
        regroups = self._regroups
        key = self.pool_key(regroups)
        if not self._regrouped_now():
            if self._last_chunk is not None and self.rank != self._drainer and self._leaves_tail_to_faster_ranks(key):
                return None
        elif not self._queue_dry:
            queue = self._queues[regroups]
            index = self.counter.add(self.queue_key(regroups), 1) - 1
            if index < len(queue):
                return f"r{regroups}.{index}", queue[index]
            self._queue_dry = True
        return self._chunk_claim(self._pool_bases[regroups] + self.counter.add(key, 1) - 1)

    def _chunk_claim(self, chunk: int) -> Optional[tuple[str, Range]]:
        if chunk >= len(self._layout):
            return None
        self.record.chunks.append(chunk)
        self._last_chunk = chunk
        return f"c{chunk}", self._chunk_span(chunk)

    def _work_left(self) -> bool:
        assert self.counter is not None
        regroups = self._regroups
        if self.counter.add(self.queue_key(regroups), 0) < len(self._queues[regroups]):
            return True
        return self._pool_bases[regroups] + self.counter.add(self.pool_key(regroups), 0) < len(self._layout)

    # -- losing ranks: what they claimed comes back to the epoch -------------------------------

    def _regroup_policy(self, survivors: list[int], lost: list[LostWork]) -> None:
        assert self.counter is not None
        regroups = self._regroups
        returned: list[Range] = []
        for work in lost:
            lineage = self._ranks_through_regroups(work.rank)
            claims = [name for g, rank in enumerate(lineage) for name in self._claims(g, rank)]
            batches = [b for name in claims for b in self._batches_of(self._span_of(name))]
            if work.trained_batches > len(batches):
                raise ValueError(
                    f"LostWork(rank={work.rank}, trained_batches={work.trained_batches}) is invalid: that rank had "
                    f"claimed {len(batches)} batches of epoch {self.epoch}."
                )
            self._lost_trained = merge(self._lost_trained + self._global(batches[: work.trained_batches]))
            returned += batches[work.trained_batches :]
            if f"c{lineage[0]}" not in claims and lineage[0] < len(self._layout):
                # It never started the epoch (or died before recording its reserved chunk).
                returned += self._batches_of(self._chunk_span(lineage[0]))
        # Claimed since the last regroup but unrecorded: a lost rank died between a claim and its
        # record. Nobody claims during a regroup, so every other claim is recorded by now.
        world = self._epoch_world if not self._lineage else len(self._lineage[-1])
        recorded = {name for rank in range(world) for name in self._claims(regroups, rank)}
        base = self._pool_bases[regroups]
        claimed = min(len(self._layout), base + self.counter.add(self.pool_key(regroups), 0))
        for chunk in range(base, claimed):
            if f"c{chunk}" not in recorded:
                returned += self._batches_of(self._chunk_span(chunk))
        self._pool_bases.append(max(base, claimed))
        if regroups:
            # The last regroup's queue closes: its unclaimed and claimed-unrecorded batches move on.
            queue = self._queues[regroups]
            taken = min(len(queue), self.counter.add(self.queue_key(regroups), 0))
            returned += [b for i, b in enumerate(queue) if i >= taken or f"r{regroups}.{i}" not in recorded]
        # Sorted, the epoch's short tail batch (its last batch) comes last.
        self._queues.append(sorted(returned))
        self.returned_batches = len(returned)
        self._queue_dry = False
        self._lineage.append(list(survivors))
        shares = self._speed_shares
        if shares is not None and sum(shares[s] for s in survivors) > 0:
            self._speed_shares = [shares[s] / sum(shares[k] for k in survivors) for s in survivors]
        else:
            self._speed_shares = None
        self._drainer = None  # after a regroup every rank claims until the pool is dry

    def _ranks_through_regroups(self, rank: int) -> list[int]:
        """``rank`` (current numbering) in the numbering after each regroup of the epoch, from 0."""
        ranks = [rank]
        for survivors in reversed(self._lineage):
            ranks.append(survivors[ranks[-1]])
        return ranks[::-1]

    def _claims(self, regroup: int, rank: int) -> list[str]:
        """What ``rank`` (numbered as after ``regroup`` regroups) recorded claiming in that span."""
        assert self.counter is not None
        key = self.claims_key(regroup, rank)
        if not self.counter.check([key]):
            return []
        value = self.counter.get(key)
        text = value.decode() if isinstance(value, bytes) else str(value)
        return [name for name in text.split(";") if name]

    def _span_of(self, name: str) -> Range:
        if name.startswith("c"):
            return self._chunk_span(int(name[1:]))
        regroup, index = name[1:].split(".")
        return self._queues[int(regroup)][int(index)]

    def _global(self, spans: Sequence[Range]) -> list[Range]:
        """Local spans as epoch positions."""
        if self._positions is None:
            return merge(spans)
        positions = self._positions
        return compress(positions[p] for start, stop in spans for p in range(start, stop))

    def set_speed_shares(self, shares: Sequence[float]) -> None:
        """Each rank's share of the cohort's throughput (any positive scale), identical on every
        rank; the strategy passes the controller's measured speed shares (its plan before every
        rank has a reading) after every round, through :meth:`on_round`.

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

    def _agreed_layout_share(self) -> Optional[float]:
        """The slowest rank's share of the cohort's speed that the epoch's chunk layout plans for
        (None: an equal share): the first one any rank proposed for the epoch, so that every rank
        cuts the epoch the same way (claims name chunks by index), whatever shares each held when
        it started the epoch."""
        assert self.counter is not None
        key = f"{self.counter_key(self.epoch)}/layout"
        proposed = self._layout_share()
        self.counter.append(key, ("-" if proposed is None else repr(proposed)) + ";")
        value = self.counter.get(key)
        first = (value.decode() if isinstance(value, bytes) else str(value)).split(";", 1)[0]
        return None if first == "-" else float(first)

    def _layout_share(self) -> Optional[float]:
        """This rank's proposal for :meth:`_agreed_layout_share`, from the shares it holds."""
        shares = self._speed_shares
        if shares is None or len(shares) != self.world_size:
            return None
        # A rank with no speed (share 0) claims nothing near the tail; a floor keeps the tail's
        # chunks from all becoming single batches (a store round trip each) for a very slow rank.
        return max(min(shares), SMALLEST_LAYOUT_SHARE)

    def _fastest_rank(self) -> Optional[int]:
        shares = self._speed_shares
        if shares is None:
            return None
        return max(range(self.world_size), key=lambda r: (shares[r], -r))

    def _leaves_tail_to_faster_ranks(self, key: str) -> bool:
        shares = self._speed_shares
        if shares is None:
            return False
        share = shares[self.rank]
        if share <= 0:
            return True
        others = 1.0 - share
        if others <= 0:
            return False
        # From the latest round of the epoch (or its start) every rank trains at its share of the
        # cohort's speed, so the epoch ends at the later of two ends: this rank's, after `mine`
        # batches (time mine / share, in the cohort's batches), and the others', after `rest`
        # (rest / others): what they claimed, untrained at the round, and the pool. Taking the next
        # chunk pays off unless the later end is later with it than without it. Only claims and
        # the round's counts enter: how far every rank is at this moment (a prefetch, a chunk in
        # progress) is not known across ranks.
        claimed = math.ceil(self.record.samples / self.batch_size)
        trained = self._batches_at_round()
        mine = claimed - trained[self.rank]
        rest = self._batches_from(0) - claimed - (sum(trained) - trained[self.rank])
        largest = self.max_chunk_batches
        if (mine + largest) / share <= (rest - largest) / others:
            return False  # even after the largest chunk this rank ends first: no need to read the counter
        assert self.counter is not None
        next_claim = self._epoch_world + self.counter.add(key, 0)
        if next_claim >= len(self._layout):
            return False  # the pool is dry: the claim below ends the epoch for this rank
        chunk = self._layout[next_claim][1]
        with_chunk = max((mine + chunk) / share, (rest - chunk) / others)
        without = max(mine / share, rest / others)
        return with_chunk > without  # strict: on a tie taking it is no worse

    def _batches_at_round(self) -> list[int]:
        """Batches every rank had started in this epoch at the latest round (zeros before one)."""
        at_round = self._round_batches
        if at_round is None or at_round[0] != self.epoch or len(at_round[1]) != self.world_size:
            return [0] * self.world_size
        return at_round[1]

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
        for start, stop in self.record.spans:
            if left <= 0:
                break
            take = min(left, math.ceil((stop - start) / self.batch_size))
            local.append((start, min(start + take * self.batch_size, stop)))
            left -= take
        if left > 0:
            raise RuntimeError(
                f"Rank {self.rank} trained {batches} batches in epoch {self.epoch} but claimed only "
                f"{batches - left}: the dispatch record is out of step with training."
            )
        return self._global(local)

    def _untrained(self, gathered: Sequence[Union[list[Range], int]]) -> list[Range]:
        resume = self._resumed_epoch()
        universe = [(0, self.samples_per_epoch)] if resume is None else list(resume.remaining or [])
        taken = [r for ranges in gathered for r in ranges]  # type: ignore[union-attr]
        if self._regrouped_now():
            taken += self._lost_trained  # the lost ranks' batches in the consensus
        return subtract(universe, taken)

    def _check_resumable(self, remaining: list[Range], epoch: int) -> None:
        batches = math.ceil(size(remaining) / self.batch_size)
        if batches < self.world_size:
            raise ValueError(
                f"The checkpoint leaves {batches} batch(es) of epoch {epoch} for {self.world_size} "
                "ranks; every rank needs at least one. Resume from the epoch-end checkpoint instead."
            )
