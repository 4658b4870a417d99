"""The interface of every dispatch policy: :class:`ElCheSampler`, and what a joiner takes over.

A policy decides how an epoch's positions are shared out, how a membership change moves work,
and what a rank trained; this module holds what they share: the arguments, the lifecycle
(:class:`~lightning_elche.dispatch.cursor.Cursor`), the checks of a change, and the coverage and
resume calls the strategy makes (their math is :mod:`lightning_elche.coverage`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Optional, Union

from torch.utils.data import Sampler

from lightning_elche.augment import PickKey
from lightning_elche.checks import require_int
from lightning_elche.config import Dispatch
from lightning_elche.coverage import EpochCoverage, Range, expand
from lightning_elche.dispatch.cursor import Cursor, Opening, Phase
from lightning_elche.dispatch.order import epoch_permutation
from lightning_elche.dispatch.store import CHUNK_KEY_PREFIX, ChunkCounter
from lightning_elche.membership.change import Change


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


@dataclass(frozen=True)
class JoinState:
    """What a rank that joins the fit needs to take over the dispatch: the survivors' view of the
    current epoch, identical on every survivor, small and picklable (it crosses the wire).

    Built by :meth:`ElCheSampler.state_for_joiner` on a survivor after it applied the change that
    admits the joiner; taken over by :meth:`ElCheSampler.adopt` (or
    :func:`~lightning_elche.dispatch.build.sampler_for_joiner`).
    """

    dispatch: Dispatch
    dataset_len: int
    augment: int
    pick_keys: bool
    batch_size: int
    shuffle: bool
    seed: int
    drop_last: bool
    key_prefix: str
    max_chunk_batches: int
    world_size: int
    """The numbering after the change: the joiner's sampler is built at this world size."""
    epoch: int
    generation: int
    """The membership generation of the last change the survivors followed."""
    changes: int
    """Membership changes within the epoch (0: the epoch is not under way; the joiner starts it as
    any rank does)."""
    partition_ratios: Optional[tuple[float, ...]] = None
    resume: Optional[dict[str, Any]] = None
    """The record a resumed run dispatches its epoch from, as a state dict."""
    plan: Any = None
    """The policy's record of the epoch's changes (None when ``changes`` is 0)."""


_JOIN_FIELDS = ("dataset_len", "augment", "pick_keys", "batch_size", "shuffle", "seed", "drop_last", "key_prefix",
                "max_chunk_batches", "world_size")


class ElCheSampler(Sampler[Union[int, PickKey]]):
    """Yields this rank's sample indices (or pick keys) for one epoch under ElChe's dispatch.

    The interface of the three dispatch policies (:class:`~lightning_elche.dispatch.EqualDispatch`,
    :class:`~lightning_elche.dispatch.FixedDispatch`, :class:`~lightning_elche.dispatch.PoolDispatch`);
    :func:`~lightning_elche.dispatch.build_sampler` builds the one a
    :class:`~lightning_elche.config.Dispatch` names. It deliberately has no ``__len__``: in the
    pooled dispatch a rank does not know in advance how many batches it will train, so Lightning
    runs the epoch until the iterator is exhausted.

    Args:
        num_samples: length of the dataset (samples, before ``augment``).
        batch_size: the DataLoader's batch size; chunks are whole batches.
        rank, world_size: this rank and the number of ranks.
        shuffle, seed: permutation as ``DistributedSampler(shuffle, seed)`` builds it.
        counter: the shared store (required by the pool; the own-stream splits use it only when
            ranks join mid-epoch).
        key_prefix: a prefix unique to this fit, shared by all ranks, for the store keys.
        partition_ratios: the shares of the fixed dispatch.
        max_chunk_batches: longest chunk in the pool.
        drop_last: the DataLoader drops incomplete batches. Pooled and fixed dispatch then drop
            the epoch's global tail (fewer than ``batch_size`` samples) up front; the equal split
            leaves each rank's own partial batch to the DataLoader, as under DDP.
        augment: picks per sample and epoch; the epoch has ``num_samples * augment`` picks.
        pick_keys: yield :class:`PickKey` ``(index, repeat, epoch)`` instead of integer indices
            (for an :class:`~lightning_elche.AugmentedDataset`; required when ``augment > 1``).
    """

    dispatch: ClassVar[Optional[Dispatch]] = None
    """The policy's :class:`~lightning_elche.config.Dispatch`; its value names it in checkpoints."""

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        rank: int,
        world_size: int,
        *,
        shuffle: bool,
        seed: int,
        counter: Optional[ChunkCounter] = None,
        key_prefix: str = CHUNK_KEY_PREFIX,
        partition_ratios: Optional[Sequence[float]] = None,
        max_chunk_batches: int = 4,
        drop_last: bool = False,
        augment: int = 1,
        pick_keys: bool = False,
    ) -> None:
        if self.dispatch is None:
            raise TypeError(
                "ElCheSampler is the interface of the dispatch policies: build one with "
                "lightning_elche.dispatch.build_sampler(Dispatch.EQUAL | Dispatch.POOL | Dispatch.FIXED, ...)."
            )
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
        self.record = DispatchRecord()
        self.started_batches: Optional[int] = None
        """Batches this rank has started training in the current epoch (None: not tracked).
        The batches yielded beyond it are claimed work still ahead of the rank (prefetch)."""
        self.generation = 0
        """The membership generation of the last change this sampler followed (0: none)."""
        self.returned_batches = 0
        """Batches the last :meth:`apply_change` put back into the epoch (the same on every member)."""
        self._cursor = Cursor()
        self._resume: Optional[EpochCoverage] = None
        self._set_up_policy()
        self._check_every_rank_gets_data()

    # -- what every policy shares ------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self._cursor.epoch

    @property
    def phase(self) -> Phase:
        """Where this rank's iterator is in the current epoch."""
        return self._cursor.phase

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
        """Called by Lightning before each epoch: selects the permutation and the store keys."""
        self._cursor.set_epoch(epoch)

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
        opening = self._cursor.open(self.rank)
        order = epoch_permutation(self.num_samples, self.epoch, self.seed, self.shuffle)
        if opening is Opening.SET_UP:
            self._prepare_epoch()
        if opening is not Opening.CONTINUE:
            self.record = DispatchRecord(epoch=self.epoch)
            if self.started_batches is not None:
                self.started_batches = 0
            self._start_epoch()
        yield from self._continue_epoch(order)
        self._cursor.close()

    # -- membership changes ------------------------------------------------------------------

    def apply_change(self, change: Change) -> None:
        """Follow a change of the fit's members within the current epoch.

        The lost members' batches in the consensus are ``change.trained_by_old_rank()``; the rest
        of their work goes back to the epoch (:attr:`returned_batches`). Joiners are one more
        rank each: the policy gives them a part of the epoch's untrained rest (the pool: the
        returned work and the pool; the own-stream splits re-split it, see the policies). A joiner
        itself does not apply the change: it takes over :meth:`state_for_joiner`.

        Every member that stays must call it with the same change while none of them trains or
        claims: each computes the same split from it (and from the store's records). Afterwards
        :attr:`rank` and :attr:`world_size` are the new numbering; an ended iterator continues
        the epoch after :meth:`reopen` when :attr:`wants_reopen` says so.
        """
        self._check_change(change)
        if self._cursor.needs_set_up:
            self._prepare_epoch()  # this rank has not started the epoch yet: the change sets it up
        self.returned_batches = self._follow_change(change, self._cursor.changes)
        self._cursor.apply_change()
        self.generation = change.generation
        new_rank = change.new_rank(self.rank)
        assert new_rank is not None
        self.rank, self.world_size = new_rank, change.world_size_after

    def _check_change(self, change: Change) -> None:
        if not isinstance(change, Change):
            raise TypeError(
                f"apply_change(change={change!r}) is invalid: expected a lightning_elche.membership.Change."
            )
        if change.world_size_before != self.world_size:
            raise ValueError(
                f"Change(before={list(change.before)}) is invalid here: expected the {self.world_size} members of "
                f"this sampler's numbering (world_size={self.world_size}), in rank order."
            )
        if change.new_rank(self.rank) is None:
            raise ValueError(
                f"Change(before={list(change.before)}, after={list(change.after)}) does not hold this rank "
                f"({self.rank}): only members that stay apply a change (a joiner adopts state_for_joiner())."
            )
        if change.generation <= self.generation:
            raise ValueError(
                f"Change(generation={change.generation}) is invalid: expected a generation above "
                f"{self.generation}, the last this sampler followed."
            )
        lost = set(change.lost_ids)
        for member, count in change.trained_batches.items():
            if member not in lost:
                raise ValueError(
                    f"Change(trained_batches={dict(change.trained_batches)}) is invalid: member {member} is not "
                    "lost in this change; expected trained batches of lost members only."
                )
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise ValueError(
                    f"Change(trained_batches={{{member}: {count!r}}}) is invalid: expected an int >= 0 of "
                    "trained_batches per lost member."
                )

    @property
    def wants_reopen(self) -> bool:
        """This rank's iterator of the current epoch has ended, yet work that a membership change
        moved may be left for it: iterating the DataLoader again after :meth:`reopen` continues the
        epoch. Check it whenever the iterator ends in an epoch with a change (it can be true again)."""
        return self._cursor.wants_reopen and self._work_left()

    def reopen(self) -> None:
        """Make the next iteration continue the current epoch (only work this rank has not yet
        been handed; ``record`` and ``started_batches`` carry on) instead of starting it anew."""
        self._cursor.reopen(self.rank)

    # -- joining -------------------------------------------------------------------------------

    def state_for_joiner(self) -> JoinState:
        """What a rank joining with the last change needs to take over the dispatch (call it after
        :meth:`apply_change`; every survivor returns the same value)."""
        assert self.dispatch is not None
        changes = self._cursor.changes
        return JoinState(
            dispatch=self.dispatch, dataset_len=self.dataset_len, augment=self.augment, pick_keys=self.pick_keys,
            batch_size=self.batch_size, shuffle=self.shuffle, seed=self.seed, drop_last=self.drop_last,
            key_prefix=self.key_prefix, max_chunk_batches=self.max_chunk_batches, world_size=self.world_size,
            epoch=self.epoch, generation=self.generation, changes=changes,
            partition_ratios=None if self.partition_ratios is None else tuple(self.partition_ratios),
            resume=None if self._resume is None else self._resume.state_dict(),
            plan=self._epoch_plan() if changes else None,
        )

    def adopt(self, state: JoinState) -> None:
        """Take over the survivors' dispatch as a rank that joined: this sampler was built for the
        new numbering (its ``rank`` one of the change's joiners) and has not iterated yet."""
        if state.dispatch != self.dispatch:
            raise ValueError(
                f"{type(self).__name__}.adopt(state) is invalid: the survivors dispatch {state.dispatch.value!r}, "
                f"this sampler {self.dispatch.value if self.dispatch else None!r}; build the joiner's sampler "
                "for the fit's mode."
            )
        for name in _JOIN_FIELDS:
            theirs, mine = getattr(state, name), getattr(self, name)
            if theirs != mine:
                raise ValueError(
                    f"{type(self).__name__}.adopt(state) is invalid: the survivors have {name}={theirs!r}, this "
                    f"sampler {name}={mine!r}; a joiner must use the fit's dataset, DataLoader and numbering."
                )
        if self._cursor.started:
            raise RuntimeError(f"Rank {self.rank} iterated its sampler already: only a fresh sampler adopts a join.")
        self.generation = state.generation
        if state.partition_ratios is not None:
            self.partition_ratios = list(state.partition_ratios)
        self._resume = None if state.resume is None else EpochCoverage.from_state_dict(state.resume)
        self._cursor = Cursor(epoch=state.epoch)
        if state.changes:
            self._cursor = Cursor(epoch=state.epoch, phase=Phase.READY, changes=state.changes)
            self._adopt_plan(state.plan)

    # -- coverage: what a mid-epoch checkpoint keeps (the math is lightning_elche.coverage) --

    def identity(self, epoch: int) -> EpochCoverage:
        """The fields that fix an epoch's order and dispatch, with nothing covered yet."""
        assert self.dispatch is not None
        return EpochCoverage(
            epoch=epoch, picks=self.num_samples, seed=self.seed, shuffle=self.shuffle, batch_size=self.batch_size,
            drop_last=self.drop_last, dispatch=self.dispatch.value, world_size=self.world_size, remaining=[],
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
        self._resume = coverage

    def local_coverage(self, batches: int) -> Union[list[Range], int]:
        """What this rank trained of the current epoch, given that it trained its first ``batches``
        batches: epoch positions (pooled dispatch, or any after a change) or a pick count."""
        raise NotImplementedError

    def _resumed_epoch(self) -> Optional[EpochCoverage]:
        resume = self._resume
        return resume if resume is not None and resume.epoch == self.epoch else None

    def _epoch_universe(self) -> Sequence[int]:
        """The positions the current epoch dispatches: all of them, or a resumed epoch's remainder."""
        resume = self._resumed_epoch()
        if resume is None or resume.remaining is None:
            return range(self.samples_per_epoch)
        return expand(resume.remaining)

    def _key(self, pick: int) -> Union[int, PickKey]:
        if not self.pick_keys:
            return pick
        return PickKey(pick % self.dataset_len, pick // self.dataset_len, self.epoch)

    def _yield_positions(self, order: list[int], positions: Sequence[int]) -> Iterator[Union[int, PickKey]]:
        self.record.samples += len(positions)
        self._cursor.opening_picks += len(positions)
        for position in positions:
            yield self._key(order[position])

    # -- what each policy decides ------------------------------------------------------------

    def _set_up_policy(self) -> None:
        """Refuse arguments the policy cannot work with."""

    def _check_every_rank_gets_data(self) -> None:
        # A rank with no batch would skip the epoch's training loop, and with it the rounds its
        # peers wait in: refuse such a split up front instead of deadlocking later.
        if self.num_samples < self.world_size * (self.batch_size if self.drop_last else 1):
            raise ValueError(
                f"The training set has {self.num_samples} samples: too few for {self.world_size} ranks "
                f"with batch_size={self.batch_size}; every rank needs at least one batch per epoch."
            )

    def _prepare_epoch(self) -> None:
        """Set the current epoch's dispatch up afresh (no change in it yet)."""
        raise NotImplementedError

    def _start_epoch(self) -> None:
        """This rank's first opening of the epoch starts (after :meth:`_prepare_epoch` or a change)."""

    def _continue_epoch(self, order: list[int]) -> Iterator[Union[int, PickKey]]:
        """This rank's work of the current epoch from where its last opening ended."""
        raise NotImplementedError

    def _follow_change(self, change: Change, span: int) -> int:
        """Move the work a change moves (old numbering still in force; ``span`` changes came
        before it in the epoch); the batches it put back into the epoch."""
        raise NotImplementedError

    def _work_left(self) -> bool:
        """Whether a reopened iterator may still find work for this rank."""
        raise NotImplementedError

    def _epoch_plan(self) -> Any:
        """The policy's picklable record of the current epoch's changes, for a joiner."""
        raise NotImplementedError

    def _adopt_plan(self, plan: Any) -> None:
        """Take the survivors' record of the epoch's changes over (a joiner)."""
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
