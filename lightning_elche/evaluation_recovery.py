"""A rank lost while the cohort evaluates: the survivors agree on it, regroup, and evaluate again.

The fit's validation epochs and its sanity check are Lightning's loop, not ElChe's rounds: their
collectives (``self.log(sync_dist=True)`` at the epoch end, the loader's set-up, the user's own)
are the checked collectives of :mod:`lightning_elche.checked_collectives`. A peer lost in one of
them (gone, silent, or leaving with an exception) makes it raise
:class:`~lightning_elche.checked_collectives.CollectiveMismatch` naming the loss (its ``lost``) on
every survivor: none can pass a collective the lost rank never entered, and one that failed inside
a collective the others passed fails at the next one, which the lost rank never enters either. Each survivor then hands
the failure to the fit's one place for membership changes
(:meth:`Survival.after_failed_round <lightning_elche.membership.survival.Survival.after_failed_round>`:
agree, fence, regroup, apply the change to every holder), exactly as after a failed round, and the
evaluation runs again from its start (:mod:`lightning_elche.loop_glue.evaluation`), its shards cut
for the new members. Nothing of the interrupted run is kept, so every sample counts once in what
the new run logs, whatever each survivor had reached.

Validation comes after the round that ended a training epoch, or before the first (the sanity
check): every replica holds the same consensus, and the lost rank's training is in it (its batches
of the epoch are ``Change.trained_batches``); nothing of the epoch is left to train. When the
change reaches ``max_failure``, there is nothing to evaluate for: every survivor saves that
consensus (``last-ranks-lost.ckpt``, an epoch-end checkpoint) and the fit ends with
:class:`~lightning_elche.membership.change.RanksLost`, as at a round.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Optional, Protocol

from lightning.pytorch import Trainer

from lightning_elche.checked_collectives import CollectiveMismatch
from lightning_elche.engine import ElCheEngine
from lightning_elche.membership.change import Change, RanksLost, lost_ranks_text
from lightning_elche.stop_checkpoint import RANKS_LOST_CHECKPOINT_NAME, stop_checkpoint_path


class EpochWork(Protocol):
    """The dispatch, as far as a change between epochs concerns it."""

    @property
    def returned_batches(self) -> int: ...


class EvaluationRecovery:
    """Follows the fit's evaluation runs; decides whether an interrupted one runs again, after
    carrying the fit past the loss.

    Args:
        trainer: the fitting trainer.
        engine: the fit's round protocol (its ``failures`` is the fit's survival; None before it
            exists or where lost ranks are not survived).
        dispatch: the training dispatch (None before it exists).
        max_failure: the knob, for the message when the change reaches it.
        losses: every change of the fit that lost ranks, for that message (None: only the last).
    """

    def __init__(self, trainer: Trainer, engine: Callable[[], Optional[ElCheEngine]],
                 dispatch: Callable[[], Optional[EpochWork]], max_failure: Any = None,
                 losses: Optional[Callable[[], list[Change]]] = None) -> None:
        self.trainer = trainer
        self.engine = engine
        self.dispatch = dispatch
        self.max_failure = max_failure
        self.losses = losses
        self.redone: list[Change] = []
        """The changes each evaluation was run again after, in order."""
        self.evaluating = -1
        """The rounds completed when the run in progress began (-1: none in progress)."""
        self.evaluated = -1
        """The rounds completed when the last run that finished began (-1: none yet)."""

    def starting(self) -> None:
        engine = self.engine()
        self.evaluating = engine.state.rounds if engine is not None else 0

    def finished(self) -> None:
        self.evaluated, self.evaluating = self.evaluating, -1

    def recovered(self, error: BaseException) -> bool:
        """Whether the evaluation ``error`` interrupted may run again: the error is a lost peer
        and every survivor took the change. False leaves ``error`` to end the fit.

        Raises:
            RanksLost: the others declared this rank lost, or the change reached ``max_failure``
                (after the survivors saved the consensus).
        """
        engine = self.engine()
        changes = engine.failures if engine is not None else None
        if not isinstance(error, CollectiveMismatch) or error.lost is None or changes is None:
            return False
        change = changes.after_failed_round(error.lost)
        work = self.dispatch()
        if work is not None and work.returned_batches > 0:
            raise RuntimeError(
                f"ElCheStrategy: the lost rank(s) {change.lost_original} left {work.returned_batches} untrained "
                "batch(es) of an epoch that had already ended when they were lost in its evaluation. This is a bug "
                "of lightning-elche: please report it with the log."
            ) from error
        self.redone.append(change)
        if change.ends_fit:
            self.save_and_stop(change)
        return True

    def save_and_stop(self, change: Change, where: str = "while evaluating") -> None:
        """``change`` reached ``max_failure``: save the consensus the survivors hold
        (``last-ranks-lost.ckpt``) and end the fit.

        Raises:
            RanksLost: always, once saved."""
        started = time.perf_counter()
        path = stop_checkpoint_path(self.trainer, RANKS_LOST_CHECKPOINT_NAME)
        # The evaluation will not run again: a rank lost in the save's collectives is the collectives'
        # own recovery's to survive, which saves again among the rest (nested here) as in training.
        self.evaluating = -1
        self.trainer.save_checkpoint(path)
        losses = (self.losses() if self.losses is not None else []) or [change]
        raise RanksLost(
            f"ElCheStrategy: max_failure={self.max_failure!r} reached {where}: lost {lost_ranks_text(losses)} "
            f"(original ranks). The {change.world_size_after} survivor(s) saved the consensus checkpoint {path} in "
            f"{time.perf_counter() - started:.2f} s; resume with Trainer.fit(ckpt_path=...)."
        )
