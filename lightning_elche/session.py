"""The life of one ElChe fit on one rank: its phases, its stop requests and what a round decides.

:class:`ElCheStrategy` translates Lightning's hooks into the calls below and the returned
:class:`RoundAction` back into Lightning (``trainer.should_stop``, ``SIGTERMException``). Nothing
here touches Lightning, the engine or the data, so every transition can be read (and tested) in
this one file:

* **a batch starts** (:meth:`Session.start_batch`): the first batch of an epoch resets the epoch's
  counters; every batch puts the rank *in a window*, where ranks take different numbers of steps
  and no collective outside ElChe's rounds may run;
* **a stop is requested** (:meth:`Session.request_stop`, :meth:`Session.hold_back_local_stop`): the
  request is only recorded; it travels in the next round's metadata, so every rank learns it at
  the same round;
* **a round completes** (:meth:`Session.after_round`): the round's outcome (identical on every
  rank) becomes the same :class:`RoundAction` on every rank: train on, leave the epoch, stop the
  fit, or save and exit (a stop signal);
* **a stop signal was acted on** (:attr:`Session.pending_save`): every rank saves the consensus
  checkpoint at its next batch start (right after the round, or at the next epoch's first batch
  when the round ended an epoch), where every rank reaches the same code with the same weights,
  then the fit ends;
* **a checkpoint inside an epoch** (:meth:`Session.at_sync_point`): every rank is at the same round;
* **the members changed** (:meth:`Session.apply_change`): ranks were lost or joined and the fit goes
  on, renumbered; the callback role follows its rank or is chosen again.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal, Optional

from lightning_elche.engine import RoundOutcome
from lightning_elche.membership.change import Change
from lightning_elche.rounds import StopRequest

EpochCallbackPolicy = Literal["fastest", "rank0", "all"]


class CallbackRole:
    """Tracks the fastest rank from the controller's shared timings (sticky once chosen)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.fastest: Optional[int] = None

    def observe(self, controller: Any) -> None:
        """After a round: pick the fastest rank once every rank has a timing."""
        if self.fastest is not None:
            return
        speeds = [controller.smoothed_ms_or_none(rank) for rank in range(self.world_size)]
        if any(ms is None or ms <= 0.0 for ms in speeds):
            return
        self.fastest = min(range(self.world_size), key=lambda rank: (speeds[rank], rank))

    def apply_change(self, change: Change) -> None:
        """The members changed: renumber the role; if its rank was lost, choose again from the next
        timings (a joiner has none yet, so a lost role waits until it has)."""
        self.world_size = change.world_size_after
        self.fastest = change.new_rank(self.fastest) if self.fastest is not None else None

    def rank_for(self, policy: str) -> Optional[int]:
        """The rank that runs epoch callbacks under ``policy``; None means every rank."""
        if policy == "all":
            return None
        if policy == "rank0":
            return 0
        return self.fastest if self.fastest is not None else 0

    def state_dict(self) -> dict[str, Any]:
        return {"fastest": self.fastest}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the chosen rank; a rank that no longer exists (a resume on fewer ranks) is
        forgotten, and the role is chosen again from the new ranks' timings."""
        fastest = state.get("fastest")
        if fastest is not None and not (isinstance(fastest, int) and not isinstance(fastest, bool) and fastest >= 0):
            raise ValueError(
                f"The checkpoint's epoch callback role names rank {fastest!r}: expected None or a rank >= 0."
            )
        self.fastest = fastest if fastest is not None and fastest < self.world_size else None


class Phase(enum.Enum):
    """Where a rank is in its fit, as far as collectives are concerned."""

    IDLE = "idle"
    """Outside training steps: before the first batch, between epochs, in validation, after fit.
    Every rank reaches the same code, so collectives are allowed."""
    IN_WINDOW = "in_window"
    """Training steps: ranks take different numbers of steps; only ElChe's rounds synchronize."""
    LEAVING = "leaving"
    """A round decided that every rank leaves the epoch after its current batch."""
    AT_SYNC_POINT = "at_sync_point"
    """Inside ``sync_point()`` right after a consensus round: every rank at the same code."""
    SAVING = "saving"
    """A stop signal was acted on: no more steps or rounds; the save comes at the next batch start."""


class RoundAction(enum.Enum):
    """What the strategy does on Lightning's side after a round (the same on every rank)."""

    CONTINUE = "continue"
    LEAVE_EPOCH = "leave_epoch"  # every rank is out of data: the epoch ends after this batch
    STOP_FIT = "stop_fit"  # a stop request or the step budget: set trainer.should_stop
    SAVE_AND_EXIT = "save_and_exit"  # a stop signal: save at the next batch start, then raise


class Session:
    """Per-rank state of one fit, created in the strategy's ``setup``.

    Args:
        world_size: number of ranks (for the epoch-callback role).
        step_budget: the user's ``max_steps``, counted over all ranks (None: no budget).
        dispatch_prefix: the shared store prefix of this fit's data dispatch.
    """

    def __init__(self, world_size: int, step_budget: Optional[int] = None, dispatch_prefix: str = "") -> None:
        self.world_size = world_size
        self.step_budget = step_budget
        self.dispatch_prefix = dispatch_prefix
        self.phase = Phase.IDLE
        self.callback_role = CallbackRole(world_size)
        self.single_rank_policy: Optional[str] = None
        """Set while epoch callbacks run on one rank alone (collectives are then refused)."""
        self.epoch: Optional[int] = None
        """The epoch of the last training batch of this fit (the sampler counts its batches)."""
        self.pending_samples = 0
        self.pending_save = StopRequest.NONE
        """The stop signal a round acted on: the strategy saves the consensus, then ends the fit."""
        self.warned_rank_local_reduce = False
        self._stop = StopRequest.NONE
        self._should_stop_seen = False

    # -- phases --------------------------------------------------------------------------------

    @property
    def in_window(self) -> bool:
        """Ranks are taking different numbers of steps: no collective outside the rounds."""
        return self.phase is Phase.IN_WINDOW

    @property
    def at_sync_point_now(self) -> bool:
        """Inside :meth:`at_sync_point`: a checkpoint saved now carries the epoch's coverage."""
        return self.phase is Phase.AT_SYNC_POINT

    @property
    def leaving(self) -> bool:
        """A round decided that every rank leaves the epoch (or, on a stop signal, the fit) after
        the current batch: no more rounds now."""
        return self.phase in (Phase.LEAVING, Phase.SAVING)

    # -- per batch -----------------------------------------------------------------------------

    def start_batch(self, epoch: int, samples: int) -> bool:
        """A training batch of ``samples`` samples starts; returns whether it opens a new epoch.

        By epoch number, not batch index: an epoch resumed mid-way starts at a later index.
        """
        new_epoch = epoch != self.epoch
        self.epoch = epoch
        self.pending_samples += samples
        if self.phase is not Phase.SAVING and (new_epoch or not self.leaving):
            self.phase = Phase.IN_WINDOW
        return new_epoch

    def take_pending_samples(self) -> int:
        """Samples of the batches since the last optimizer step (the step being recorded)."""
        samples, self.pending_samples = self.pending_samples, 0
        return samples

    def end_training(self) -> None:
        self.phase = Phase.IDLE

    def refuse_collective(self, what: str, mid_window_too: bool = True) -> None:
        """Refuse a collective outside the rounds that a peer may never reach: inside an epoch
        callback running on one rank, or (``mid_window_too``) during training steps."""
        policy = self.single_rank_policy
        if policy is not None:
            raise RuntimeError(
                f"ElCheStrategy: {what} inside an epoch callback that runs on one rank "
                f"(epoch_callback_policy={policy!r}) would wait forever for the other ranks. "
                "Run callbacks with collectives under epoch_callback_policy='all' (or register them with the "
                "Trainer directly)."
            )
        if mid_window_too and self.in_window:
            raise RuntimeError(
                f"ElCheStrategy: {what} during training steps cannot work: ranks take different numbers "
                "of steps, so a peer may never reach the matching call. Do it at epoch end or in validation."
            )

    @staticmethod
    def refuse_skipped_epoch(rank: int) -> None:
        """``on_train_batch_start`` returned -1 on ``rank``: one rank cannot leave an epoch alone."""
        raise RuntimeError(
            f"ElCheStrategy: on_train_batch_start returned -1 (skip the rest of the epoch) on rank {rank}. "
            "Under ElChe the ranks hold different, speed-dependent shares of the epoch, so one rank cannot leave "
            "it alone: its peers would wait for it in the next sync, and the samples it already claimed would "
            "never be trained. To end training early, set trainer.should_stop = True (every rank stops at the "
            "next sync); to train on part of the data, fit on a torch.utils.data.Subset."
        )

    # -- stop requests -------------------------------------------------------------------------

    @property
    def stop_request(self) -> StopRequest:
        return self._stop

    def request_stop(self, request: StopRequest) -> bool:
        """Record ``request`` for the next round; returns whether it raised the pending level."""
        raised = request > self._stop
        self._stop = max(self._stop, request)
        return raised

    def hold_back_local_stop(self, should_stop: bool) -> bool:
        """A ``trainer.should_stop`` raised on this rank mid-window would make it leave the epoch
        alone. Returns True when it must be cleared: the request travels to the next round instead."""
        if should_stop and not self._should_stop_seen:
            self.request_stop(StopRequest.GRACEFUL)
            return True
        return False

    def take_stop_request(self) -> StopRequest:
        """The request this rank sends with the round it joins now (consumed)."""
        request, self._stop = self._stop, StopRequest.NONE
        return request

    # -- rounds --------------------------------------------------------------------------------

    def after_round(self, outcome: RoundOutcome, can_stop_early: Callable[[], bool]) -> RoundAction:
        """Turn a round's outcome into the same action on every rank.

        ``can_stop_early`` answers whether Lightning allows stopping now (``min_epochs``); it is
        identical on every rank and only changes at epoch ends, which all ranks cross together:
        until it allows stopping, the request is kept for later rounds.
        """
        if outcome.stop_level.saves:
            self.pending_save = outcome.stop_level
            self.phase = Phase.SAVING
            return RoundAction.SAVE_AND_EXIT
        action = RoundAction.LEAVE_EPOCH if outcome.epoch_over else RoundAction.CONTINUE
        if outcome.budget_reached or outcome.stop_level == StopRequest.GRACEFUL:
            if can_stop_early():
                action = RoundAction.STOP_FIT
            else:
                self.request_stop(StopRequest.GRACEFUL)
        if action is not RoundAction.CONTINUE:
            self.phase = Phase.LEAVING
        return action

    def saw_should_stop(self, should_stop: bool) -> None:
        """After a round: a ``should_stop`` set by the round itself is not a new local request."""
        self._should_stop_seen = should_stop

    # -- checkpoints inside an epoch ------------------------------------------------------------

    @contextmanager
    def at_sync_point(self) -> Iterator[None]:
        """Every rank is at the same round: collectives and checkpoints are allowed inside."""
        before, self.phase = self.phase, Phase.AT_SYNC_POINT
        try:
            yield
        finally:
            self.phase = before

    # -- failures ------------------------------------------------------------------------------

    def apply_change(self, change: Change) -> None:
        """Ranks were lost or joined mid-fit and the members went on, renumbered."""
        self.world_size = change.world_size_after
        self.callback_role.apply_change(change)
