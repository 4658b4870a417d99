"""What callbacks may use of a running ElChe fit: the members, the round protocol's counters, the
listeners of rounds and membership changes, the epoch-callback role and the sync point.

:class:`ElCheFitView` is the part of :class:`~lightning_elche.ElCheStrategy` that callbacks call
(``ElCheCheckpoint``, ``ElCheMonitor``, ``EpochCallbacks``, users' own); the strategy's own file
keeps Lightning's hooks. Everything here reads the per-fit objects the strategy builds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Optional

import torch.distributed as dist

from lightning_elche.config import ElCheConfig, check_policy
from lightning_elche.engine import ElCheEngine, FitProgress
from lightning_elche.job_store import JobStoreLink, current_link
from lightning_elche.membership.agreement import Membership
from lightning_elche.membership.change import Change
from lightning_elche.membership.survival import ChangeListeners
from lightning_elche.round_driver import RoundDriver, RoundListener
from lightning_elche.session import Session

ChangeListener = Callable[[Change], None]


class ElCheFitView:
    """The callback-facing side of ``ElCheStrategy`` (a mixin: the strategy builds what it reads)."""

    elche: ElCheConfig
    _membership: Optional[Membership]
    _session: Session
    _engine: Optional[ElCheEngine]
    _rounds: Optional[RoundDriver]
    _round_listeners: list[RoundListener]
    _change_listeners: ChangeListeners
    _growth: Any  # lightning_elche.growth.Growth

    if TYPE_CHECKING:  # the strategy's own (renumbered) ranks

        @property
        def world_size(self) -> int: ...

        @property
        def global_rank(self) -> int: ...

    @property
    def restart_lost(self) -> int:
        """How many times in the fit rank 0's launcher restarts a lost child rank, as a joiner."""
        return int(self._growth.restart_lost)

    @property
    def launch_ranks(self) -> list[int]:
        """The member id (launch rank) of each current rank, in rank order."""
        membership = self._membership
        return list(membership.members) if membership is not None else list(range(self.world_size))

    @property
    def lost_ranks(self) -> list[Change]:
        """The changes of the last fit that lost ranks (empty when none was lost)."""
        return self._membership.losses if self._membership is not None else []

    def tolerates_rank_loss(self, member: Optional[int] = None) -> bool:
        """Whether a rank may be lost now without ending the job (the launcher then spares the
        survivors when a rank's process fails), or, given its launch rank ``member``, whether that
        rank's loss was already agreed in this fit. Called from the launcher's observer thread."""
        # Also once max_failure is reached: the survivors then save and exit by themselves, and a
        # kill from the launcher must not cut the save short.
        # And once this rank's own part ended while losses were tolerated (rank 0 failed and left, or
        # finished first): the survivors agree on their losses among themselves, and a kill from
        # here would end a fit that goes on without this rank.
        membership = self._membership
        if membership is None:
            return False
        return membership.active or membership.ended_tolerating or (
            member is not None and any(member in change.lost_ids for change in membership.losses))

    # -- what callbacks may use ---------------------------------------------------------------------

    @property
    def engine(self) -> Optional[ElCheEngine]:
        """The round protocol of this rank (built in ``setup`` when fitting)."""
        return self._engine

    @property
    def session(self) -> Session:
        """This rank's fit: its phase, stop requests and epoch counters."""
        return self._session

    @property
    def progress(self) -> Optional[FitProgress]:
        """A read-only snapshot of the fit's counters and plan (None before a fit built the engine)."""
        return self._engine.progress() if self._engine is not None else None

    def request_consensus(self, at_round: Optional[int] = None) -> None:
        """Make a round a consensus round (blocking, adopted with alpha 1 in every mode), so that
        every replica holds the consensus after it: the round with index ``at_round`` (or the first
        after it; every rank must name the same one: from a round listener, at least two rounds past
        its outcome), or the next round (``None``; from a round listener, outside ``cpu_async``)."""
        assert self._engine is not None
        self._engine.request_consensus(at_round)

    def add_round_listener(self, listener: RoundListener) -> None:
        """Call ``listener(outcome, metrics)`` on every rank after every round (``metrics``: the
        round's ``elche/*`` scalars, identical on every rank). Keep it cheap: no collectives."""
        self._round_listeners.append(listener)

    def remove_round_listener(self, listener: RoundListener) -> None:
        if listener in self._round_listeners:
            self._round_listeners.remove(listener)

    def add_membership_listener(self, listener: ChangeListener) -> None:
        """Call ``listener(change)`` on every member after each change of members (losses and
        joins), once the groups were rebuilt and ranks renumbered. No collectives inside."""
        self._change_listeners.on_change.append(listener)

    def add_rank_loss_listener(self, listener: ChangeListener) -> None:
        """As :meth:`add_membership_listener`, for the changes that lost ranks only."""
        self._change_listeners.on_loss.append(listener)

    def remove_rank_loss_listener(self, listener: ChangeListener) -> None:
        for listeners in (self._change_listeners.on_loss, self._change_listeners.on_change):
            if listener in listeners:
                listeners.remove(listener)

    def epoch_callback_rank(self, policy: Optional[str] = None) -> Optional[int]:
        """The rank that runs epoch callbacks under ``policy`` (default: the strategy's);
        ``None`` means every rank. The same on every rank."""
        chosen = check_policy("ElCheStrategy", policy or self.elche.epoch_callback_policy)
        return self._session.callback_role.rank_for(chosen)

    @property
    def runs_epoch_callbacks(self) -> bool:
        """Whether this rank runs epoch callbacks under ``epoch_callback_policy``."""
        rank = self.epoch_callback_rank()
        return rank is None or rank == self.global_rank

    @contextmanager
    def single_rank_callbacks(self, policy: str) -> Iterator[None]:
        """Refuse collectives while callbacks run on this rank alone (their peers would never join)."""
        self._session.single_rank_policy = policy
        try:
            yield
        finally:
            self._session.single_rank_policy = None

    @contextmanager
    def sync_point(self) -> Iterator[None]:
        """Run a checkpoint (or another collective) inside an epoch, on every rank, right after a
        consensus round at which every rank still had data: the one place mid-epoch where all
        replicas hold the consensus and every rank reaches the same code. Checkpoints saved inside
        carry the epoch's data coverage, so that a resumed fit trains the rest exactly once.
        Used by :class:`~lightning_elche.ElCheCheckpoint`; every rank must enter it for the same round."""
        if self._rounds is None:
            raise RuntimeError("ElCheStrategy.sync_point() is only valid while fitting.")
        with self._rounds.sync_point():
            yield

    @property
    def job_store(self) -> Optional[dist.Store]:
        """The job's base store (served outside the ranks; None before ``setup_distributed``)."""
        link = current_link()
        return link.store if link is not None else None

    @property
    def job_store_link(self) -> Optional[JobStoreLink]:
        """This process's link to the job's store (None before ``setup_distributed``)."""
        return current_link()
