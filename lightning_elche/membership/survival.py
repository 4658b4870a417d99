"""The one home for carrying a fit on after its members changed.

When a round fails on a lost peer, the engine hands the failure to :class:`Survival`, which
does everything in one order, on every member:

1. agree on the change (:meth:`Membership.agree`, which also judges ``max_failure``); a member
   that missed the last round the others completed (a peer died in the middle of its
   collectives) catches up on it from the member that got furthest, through the store;
2. fence: a stopped or hung rank on this host is killed, so that it cannot wake into a job that
   went on without it (a rank that left a notice is ending by itself);
3. rebuild the default process group on the new members (:mod:`~lightning_elche.membership.groups`);
4. hand the change to every holder of per-rank state (``apply_change``), in a fixed order:
   Lightning's rank view, the session, the dispatch, the engine (its controller and plane,
   which rebuilds its own side group), then the listeners;
5. warn.

The engine then runs the failed round again on the new group. Nothing here knows the strategy.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Optional, Protocol

from lightning_elche.job_store import process_alive
from lightning_elche.membership.agreement import Membership, RoundProgress
from lightning_elche.membership.change import Change, ChangeHolder, PeerFailure
from lightning_elche.membership.groups import ProcessGroups

log = logging.getLogger(__name__)


class RankLostWarning(UserWarning):
    """A rank was lost and the survivors went on without it."""


class EpochHandover(Protocol):
    """What the dispatch answers around a change: the epoch it hands over (it opens an epoch before
    that epoch's first batch starts) and how many batches the lost ranks left in it."""

    @property
    def epoch(self) -> int: ...

    @property
    def returned_batches(self) -> int: ...


def fence(change: Change, membership: Membership) -> None:
    """End the lost members that still run on this host and left no notice (stopped or hung): they
    are out for good. One on another host finds itself excluded at its next round and leaves."""
    fence_members(change.lost_original, membership)


def fence_members(members: Iterable[int], membership: Membership) -> None:
    """:func:`fence` for members found lost where no change follows (the fit ends with an error
    instead): a stopped or looping process must not outlive the job."""
    for member in members:
        proc = membership.process_of(member)
        if proc is not None and process_alive(*proc) and not membership.left_a_notice(member):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(proc[1], signal.SIGKILL)


class RoundRecovery(Protocol):
    """How a member hands over its last completed round, and how one that missed it catches up."""

    def progress(self, epoch: Optional[int]) -> RoundProgress: ...

    def round_record(self) -> bytes: ...

    def catch_up(self, record: bytes) -> None: ...


class Survival:
    """Carries the fit on after a failed round (see the module's docstring).

    Args:
        membership: the fit's members; it decides the change.
        groups: the default process group's rebuilder.
        holders: the holders of per-rank state, in the order they take a change (called at each
            change: the dispatch may be built during the fit).
        handover: the dispatch (None before it exists): whether the lost ranks left work in the epoch.
        recovery: the rounds' side (how far this rank got; the round record and the catch-up).
        epoch: the epoch of this rank's last batch (None before its first), where no dispatch is.
        keep_epoch_open: called when the lost ranks left work, so that the retried round does not
            end the epoch even if every survivor had run out of its own data.
    """

    def __init__(
        self,
        membership: Membership,
        groups: ProcessGroups,
        holders: Callable[[], Sequence[ChangeHolder]],
        handover: Callable[[], Optional[EpochHandover]],
        recovery: RoundRecovery,
        epoch: Callable[[], Optional[int]],
        keep_epoch_open: Callable[[], None],
    ) -> None:
        self.membership = membership
        self.groups = groups
        self.holders = holders
        self.handover = handover
        self.recovery = recovery
        self.epoch = epoch
        self.keep_epoch_open = keep_epoch_open

    def after_failed_round(self, failure: PeerFailure) -> Change:
        """Agree, catch up, fence, regroup, apply and warn."""
        change = self.membership.agree(failure, self.recovery.progress(self._handed_over_epoch()))
        self._catch_up(change)
        fence(change, self.membership)
        # Building the new groups blocks in rendezvous that have no steps: not judged as a stall.
        with self.membership.progress.held():
            change = replace(change, regrouped_with=self.groups.rebuild(change))
            self.membership.record(change)
            for holder in self.holders():
                holder.apply_change(change)
        self.follow_up(change)
        return change

    def _handed_over_epoch(self) -> Optional[int]:
        """The epoch whose batches the lost ranks' counts refer to: the dispatch's. A save or a
        callback between the dispatch opening an epoch and its first batch can lose a rank, and
        the counts of the epoch before would then be read against the claims of the new one."""
        handover = self.handover()
        return self.epoch() if handover is None else handover.epoch

    def follow_up(self, change: Change) -> None:
        """After every holder took ``change``: keep the epoch open when lost ranks left work in it,
        and warn of a loss (an admission that lost a member calls it too)."""
        if not change.is_loss:
            return
        handover = self.handover()
        if handover is not None and handover.returned_batches > 0:
            self.keep_epoch_open()
        self._warn(change)

    def _catch_up(self, change: Change) -> None:
        """Members behind the furthest one take its last round (still in the old numbering, before
        any holder takes the change); the furthest one leaves it in the store for them."""
        behind, leader = change.behind_ids, change.round_leader
        if not behind or leader is None:
            return
        membership = self.membership
        key = membership.round_record_key(change.generation)
        me = membership.original_rank
        if me == leader:
            membership.store.set(key, self.recovery.round_record())
        elif me in behind:
            self.recovery.catch_up(membership.wait_for_key(key, leader))

    def _warn(self, change: Change) -> None:
        membership = self.membership
        if change.ends_fit:
            then = (f"max_failure={membership.max_failure!r} reached ({membership.lost_count} lost of limit "
                    f"{membership.limit}): every "
                    "survivor saves a consensus checkpoint and stops.")
        else:
            then = (f"{membership.world_size} rank(s) go on; what it had not trained of this epoch goes to them, and a "
                    "validation it was in runs again on them.")
        message = f"ElCheStrategy {change.describe()} (original ranks). {then}"
        log.warning(message)
        warnings.warn(message, RankLostWarning, stacklevel=2)


class ChangeListeners:
    """The callbacks' listeners of membership changes, as one holder (registered before a fit starts)."""

    def __init__(self) -> None:
        self.on_change: list[Callable[[Change], None]] = []
        self.on_loss: list[Callable[[Change], None]] = []

    def apply_change(self, change: Change) -> None:
        for listener in list(self.on_change):
            listener(change)
        if change.is_loss:
            for listener in list(self.on_loss):
                listener(change)

    def clear(self) -> None:
        self.on_change.clear()
        self.on_loss.clear()
