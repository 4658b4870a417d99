"""A rank lost in a collective between ElChe's rounds, outside an evaluation run: the survivors agree
on it, regroup, and run that collective again; a checkpoint the lost rank 0 was writing is written
by the new rank 0.

Between the round that ends a training epoch and the first batch of the next one, the fit runs
Lightning's epoch end: the ``on_train_epoch_end`` hooks (the module's ``self.log(...,
sync_dist=True)``, a callback's ``strategy.reduce`` / ``all_gather`` / ``barrier``), the reduction
of the epoch's logged values (the first read of ``trainer.callback_metrics``: a monitoring
callback's, or the logger connector's) and the epoch-end checkpoints (``ModelCheckpoint``,
``ElCheCheckpoint``: the ``broadcast`` of whether a file exists, the save's barrier). Each of those
collectives is checked (:mod:`lightning_elche.checked_collectives`): a peer lost in one (gone,
silent, or leaving with an exception) raises
:class:`~lightning_elche.checked_collectives.CollectiveMismatch` with ``lost`` set on every
survivor, in the same collective (none can pass one the lost rank never entered). Each survivor
hands the loss to :meth:`Survival.after_failed_round
<lightning_elche.membership.survival.Survival.after_failed_round>` (agree, fence, regroup, apply the
change to every holder), as after a failed round, and runs the collective again on the new group:
what it returns is the survivors' (a reduce of their values, a gather of theirs), and the hook that
called it goes on. The epoch's training is over at that point (its last round is in the
consensus, the lost rank's batches of the epoch with it); the next epoch is dispatched over the
survivors and validation is sharded again for them.

The same holds after the last epoch (``on_train_end``, ElChe's end-of-training buffer average,
``on_fit_end``): every sample is trained and in the consensus by then, so the survivors agree on the
loss, run the collective again among themselves and end the fit as it would have ended.

Inside an evaluation run (a validation epoch, the sanity check) nothing is run again here: the
whole run is (:mod:`lightning_elche.evaluation_recovery`), so that no partial result of the
interrupted run is kept.

Saves: every rank keeps the checkpoint it was last handed to save (:class:`CheckpointSaves`);
rank 0 marks each save written in the job's store once its file is in place (whole:
:func:`~lightning_elche.stop_checkpoint.written_whole`). Rank 0 lost before the mark leaves the
others in the save's barrier; after the regroup the new rank 0 writes the unmarked save, then the
barrier runs again. A file is written once, whoever writes it.

A change that reaches ``max_failure`` saves the consensus (``last-ranks-lost.ckpt``) and ends the
fit with :class:`~lightning_elche.membership.change.RanksLost`, as in validation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Optional

from lightning.pytorch import Trainer

from lightning_elche.checked_collectives import CollectiveMismatch
from lightning_elche.elastic_ddp import ElasticDDPStrategy
from lightning_elche.engine import ElCheEngine
from lightning_elche.evaluation_recovery import EvaluationRecovery
from lightning_elche.loop_glue import lightning_phase
from lightning_elche.membership.agreement import Membership
from lightning_elche.membership.change import Change
from lightning_elche.stop_checkpoint import written_whole


class CheckpointSaves:
    """This rank's saves in the fit, numbered alike on every rank (every rank is handed every save),
    and the one rank 0 may have been lost writing.

    Args:
        strategy: the strategy whose saves these are (its membership's store holds the written
            marks; its rank 0, after a change too, writes).
    """

    def __init__(self, strategy: ElasticDDPStrategy) -> None:
        self.strategy = strategy
        self.count = 0
        self._fit = ""
        self._last: Optional[tuple[dict[str, Any], Any, Optional[Any]]] = None
        self.rewritten: list[Any] = []
        """The files this rank wrote after a loss in place of the rank 0 that was lost writing them."""

    def membership(self) -> Optional[Membership]:
        return self.strategy._membership

    def is_global_zero(self) -> bool:
        return self.strategy.is_global_zero

    def write(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any]) -> None:
        """Lightning's save (on rank 0 only), into a temporary file renamed over ``filepath``."""
        membership = self.membership()
        held = membership.progress.held() if membership is not None else contextlib.nullcontext()
        with held, written_whole(filepath) as partial:  # a write has no steps: not judged as a stall
            super(ElasticDDPStrategy, self.strategy).save_checkpoint(checkpoint, partial, storage_options)

    def save(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        membership = self.membership()
        fit = membership.fit_prefix if membership is not None else ""
        if fit != self._fit:
            self._fit, self.count = fit, 0
        self.count += 1
        self._last = (checkpoint, filepath, storage_options)
        self.write(checkpoint, filepath, storage_options)
        if self.is_global_zero():
            self._mark(membership)

    def finish_after_loss(self) -> None:
        """After a survived loss: the new rank 0 writes the last save if the lost rank 0 had not."""
        membership, last = self.membership(), self._last
        if membership is None or last is None or not self.is_global_zero():
            return
        if membership.store.check([self._key(membership)]):
            self._last = None
            return
        self.write(*last)
        self.rewritten.append(last[1])
        self._mark(membership)

    def _key(self, membership: Membership) -> str:
        return f"{membership.fit_prefix}/saves/{self.count}/written"

    def _mark(self, membership: Optional[Membership]) -> None:
        if membership is not None and membership.active:
            membership.store.set(self._key(membership), "1")


class CollectiveRecovery:
    """Decides whether a checked collective that lost a peer runs again, after carrying the fit past
    the loss (see the module's docstring).

    Args:
        trainer: the fitting trainer.
        engine: the fit's round protocol (its ``failures`` is the fit's survival; None before it
            exists or where lost ranks are not survived).
        evaluations: the evaluation runs (inside one, the run is redone instead; its
            ``save_and_stop`` ends a fit that reached ``max_failure``).
        saves: the fit's checkpoint saves.
    """

    def __init__(self, trainer: Trainer, engine: Callable[[], Optional[ElCheEngine]], evaluations: EvaluationRecovery,
                 saves: CheckpointSaves) -> None:
        self.trainer = trainer
        self.engine = engine
        self.evaluations = evaluations
        self.saves = saves
        self.redone: list[Change] = []
        """The changes a collective was run again after, in order."""

    def recovered(self, error: CollectiveMismatch) -> bool:
        """Whether the collective ``error`` interrupted may run again: the error is a lost peer,
        outside an evaluation run, and every survivor took the change. False leaves ``error`` to the
        caller (the evaluation's redo, or the end of the fit).

        Raises:
            RanksLost: the others declared this rank lost, or the change reached ``max_failure``
                (after the survivors saved the consensus).
        """
        engine = self.engine()
        changes = engine.failures if engine is not None else None
        if error.lost is None or changes is None or self.evaluations.evaluating >= 0:
            return False
        phase = lightning_phase(self.trainer)
        change = changes.after_failed_round(error.lost)
        self.redone.append(change)
        self.saves.finish_after_loss()
        if change.ends_fit:
            self.evaluations.save_and_stop(change, f"in {phase}")
        return True
