"""The rounds as Lightning's training loop meets them: when a rank joins one, and what each outcome
changes in Lightning's objects (loggers, schedulers, optimizers, ``should_stop``, the stop save).

:class:`RoundDriver` is built per fit by the strategy, which calls it from its hooks; the round
protocol itself is the engine's (:mod:`lightning_elche.engine`), the decisions the session's
(:mod:`lightning_elche.session`).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, NoReturn, Optional, Protocol

import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_elche.coverage import EpochCoverage
from lightning_elche.dispatch import ElCheSampler
from lightning_elche.engine import ElCheEngine, RoundOutcome
from lightning_elche.loop_glue import (
    add_missing_epoch_metrics,
    can_stop_early,
    epoch_metric_specs,
    reopen_training_epoch,
    save_and_requeue_slurm_job,
    skip_validation_after_this_batch,
    slurm_requeue_signal,
)
from lightning_elche.membership.agreement import Membership, RoundProgress
from lightning_elche.membership.change import RanksLost, lost_ranks_text
from lightning_elche.membership.stall import ProgressStamp, expect_own_window
from lightning_elche.rounds import StopRequest
from lightning_elche.session import RoundAction, Session
from lightning_elche.stop_checkpoint import RANKS_LOST_CHECKPOINT_NAME, stop_checkpoint_path

RoundListener = Callable[[RoundOutcome, dict[str, float]], None]


class EvaluationPlace(Protocol):
    """Where a rank is in the fit's validations (:class:`~lightning_elche.evaluation_recovery.EvaluationRecovery`)."""

    evaluating: int
    evaluated: int


class OutOfDataView:
    """Whether a rank at its last batch is still out of data: once work came its way (``reopen``
    continued its epoch), it is not, for the rest of this boundary."""

    def __init__(self, out_of_data: bool, reopen: Callable[[], bool]) -> None:
        self._out_of_data = out_of_data
        self._reopen = reopen

    def __call__(self) -> bool:
        if self._out_of_data and self._reopen():
            self._out_of_data = False
        return self._out_of_data


class RoundDriver:
    """Joins this rank's rounds from the training loop and applies their outcomes to Lightning.

    Args:
        engine: this rank's round protocol.
        session: this rank's phases and stop requests.
        sampler: the training dispatch (None until the training loader is built).
        listeners: callbacks' round listeners (called on every rank after every round).
        log_every_n_syncs: rank 0 logs the ``elche/*`` metrics every this many rounds.
        rank: this rank's current number (it changes when members change).
        trainer: the fitting trainer.
    """

    def __init__(
        self,
        engine: ElCheEngine,
        session: Session,
        sampler: Callable[[], Optional[ElCheSampler]],
        listeners: list[RoundListener],
        log_every_n_syncs: int,
        rank: Callable[[], int],
        trainer: Callable[[], Trainer],
    ) -> None:
        self.engine = engine
        self.session = session
        self.sampler = sampler
        self.listeners = listeners
        self.log_every_n_syncs = log_every_n_syncs
        self.rank = rank
        self.trainer = trainer
        self.stall_stamp: Optional[ProgressStamp] = None
        """This rank's progress stamp (the strategy sets it): its bound follows its measured window."""
        self.after_each_round: Optional[Callable[[Trainer, RoundOutcome], None]] = None
        """Called last after every round (membership growth: an admission happens there)."""
        self.gather_objects: Optional[Callable[[Callable[[], Any]], list[Any]]] = None
        """Every rank's value of a callable, through the checked collectives (None: a plain gather)."""
        self.evaluations: Optional[EvaluationPlace] = None
        """Where this rank is in the fit's validations (the strategy sets it): published with an agreement."""

    # -- per step -----------------------------------------------------------------------------

    def after_optimizer_step(self, trainer: Trainer, output: Any, lr: float) -> None:
        """Account the step; join a round when the window is due or the rank is out of data."""
        engine, session = self.engine, self.session
        if session.hold_back_local_stop(trainer.should_stop):
            trainer.should_stop = False  # the next round stops every rank together
        engine.record_step(session.take_pending_samples(), output, lr)
        for outcome in engine.poll():  # cpu_async: adopt a finished round; nothing to do otherwise
            self.after_round(trainer, outcome)
        if session.leaving:  # a round already decided that every rank stops after this batch
            return
        out_of_data = bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch) and not self.reopen(trainer)
        if out_of_data or engine.window_due():
            self.sync(trainer, out_of_data)

    def sync(self, trainer: Trainer, out_of_data: bool) -> None:
        """Join rounds until this rank may continue: one round, or until the epoch drains."""
        # cpu_async trains on while a round is in flight, except when out of data: a draining
        # rank waits for every round, so that it sees the one that ends the epoch.
        blocking = out_of_data or self.engine.run_mode.blocking
        while not self.session.leaving:
            request = self.session.take_stop_request()
            sampler = self.sampler()
            batches = (sampler.started_batches or 0) if sampler is not None else 0
            # Each outcome is acted on before the next round starts: that round may lose a peer and
            # renumber the members, and an outcome read after it would speak of the old numbering.
            # The in-flight round's loss may also hand this rank work: it asks again before the next.
            still_out_of_data = OutOfDataView(out_of_data, lambda: not self.session.leaving and self.reopen(trainer))
            rounds = self.engine.rounds_at_boundary(
                trainer.current_epoch, still_out_of_data, request, blocking, batches
            )
            for outcome in rounds:
                self.after_round(trainer, outcome)
            # A rank out of data keeps joining rounds (with zero mass) until every rank is, so that
            # all ranks leave the epoch after the same round; unless a lost rank's work came its
            # way, which it trains first.
            if not still_out_of_data():
                break

    def without_a_batch(self, trainer: Trainer) -> bool:
        """This rank's iterator of the epoch ended before it gave a batch (a joiner admitted once the
        others had claimed the epoch's last work). It is out of data as a rank at its last batch is:
        it joins the rounds, without mass, until the one that ends the epoch (every rank runs the
        same rounds), unless work comes its way. Returns whether it did (the epoch was reopened:
        the loop fetches again); False: the epoch (or the fit) ends here as on the others."""
        if self.session.leaving:
            return False
        if self.reopen(trainer):
            return True
        self.sync(trainer, out_of_data=True)
        return not self.session.leaving

    def reopen(self, trainer: Trainer) -> bool:
        """At this rank's last batch: continue the epoch if a lost rank's work came its way."""
        sampler = self.sampler()
        if sampler is None or not sampler.wants_reopen:
            return False
        return reopen_training_epoch(trainer, sampler.reopen)

    # -- per round ----------------------------------------------------------------------------

    def after_round(self, trainer: Trainer, outcome: RoundOutcome) -> None:
        """Everything a round changes on this rank, in order; identical decisions on every rank."""
        self.publish(trainer, outcome)
        if self.stall_stamp is not None:
            expect_own_window(self.stall_stamp, self.engine, outcome)
            if outcome.ends_window_sequence:
                self.stall_stamp.leave_training()
        self.session.callback_role.observe(self.engine.controller)
        sampler = self.sampler()
        if sampler is not None:
            sampler.on_round(outcome.dispatch_shares, outcome.epoch, outcome.epoch_batches)
        if outcome.reset_inner:
            for optimizer in trainer.optimizers:
                optimizer.state.clear()
        self.follow_cohort_step(trainer, outcome)
        action = self.session.after_round(outcome, lambda: can_stop_early(trainer))
        # SAVE_AND_EXIT: no more steps in this batch; every rank saves at its next batch start.
        if action is RoundAction.STOP_FIT:
            trainer.should_stop = True
            if outcome.budget_reached and not outcome.epoch_over and outcome.stop_level == StopRequest.NONE:
                skip_validation_after_this_batch(trainer)  # as Lightning's max_steps inside an epoch
        self.session.saw_should_stop(trainer.should_stop)
        if outcome.epoch_over and any(r.epoch_batches == 0 for r in outcome.reports):
            self.share_epoch_metrics(trainer)
        if self.after_each_round is not None:
            self.after_each_round(trainer, outcome)

    def share_epoch_metrics(self, trainer: Trainer) -> None:
        """At the round that ends an epoch in which a rank trained no batch (a joiner admitted once
        the epoch's work was all claimed): that rank logged none of the epoch's training metrics.
        The epoch's end would reduce the synced ones and sync the torchmetrics on the others alone
        (they would wait for it until the process group's timeout), and it would log no unsynced
        one. Every rank gathers the epoch metrics every rank logged (one object gather, the same on
        all; of a metric several ranks logged, the lowest rank's spec) and registers those it lacks
        (``add_missing_epoch_metrics``: a synced one at its neutral value, an unsynced one at that
        rank's value, a torchmetric as its own, empty). What the ranks log after this round (the
        last batch's ``on_train_batch_end``, ``on_train_epoch_end``) is not in the specs: the
        zero-batch rank runs ``on_train_epoch_end`` too."""
        local = epoch_metric_specs(trainer)
        gathered = self._gathered(lambda: local)
        seen: dict[str, dict[str, Any]] = {}
        for specs in gathered:
            seen.update((spec["key"], spec) for spec in specs if spec["key"] not in seen)
        add_missing_epoch_metrics(trainer, list(seen.values()))

    def publish(self, trainer: Trainer, outcome: RoundOutcome) -> None:
        log_now = self.rank() == 0 and (outcome.index % self.log_every_n_syncs == 0 or outcome.epoch_over)
        if not (log_now or self.listeners):
            return
        metrics = self.engine.metrics(outcome)
        for listener in self.listeners:
            listener(outcome, metrics)
        if log_now:
            # One x-axis with Lightning's own metrics (rank 0's global_step); the cohort's step
            # count is a logged value, elche/cohort_step.
            for logger in trainer.loggers:
                logger.log_metrics(metrics=metrics, step=trainer.global_step)  # by keyword, as Lightning

    def follow_cohort_step(self, trainer: Trainer, outcome: RoundOutcome) -> None:
        # Lightning steps step-interval schedulers once per local optimizer step, so a fast rank
        # would decay faster. After each round every rank also advances by the steps the others
        # took, so all schedules sit at the cohort step (flodl: sched(global_step + local steps)).
        others = sum(r.steps for r in outcome.reports) - outcome.reports[self.rank()].steps
        if others <= 0:
            return
        for config in trainer.lr_scheduler_configs:
            # ReduceLROnPlateau follows its monitored metric, which Lightning feeds it; not steps.
            if config.interval == "step" and not config.reduce_on_plateau:
                for _ in range(others):
                    config.scheduler.step()  # type: ignore[call-arg]  # not a ReduceLROnPlateau here

    # -- a round some members missed (a peer died in the middle of its collectives) -----------------

    def progress(self, epoch: Optional[int]) -> RoundProgress:
        progress, place = self.engine.progress_at_failure(epoch), self.evaluations
        return progress if place is None else replace(progress, evaluating=place.evaluating, evaluated=place.evaluated)

    def round_record(self) -> bytes:
        return self.engine.round_record()

    def catch_up(self, record: bytes) -> None:
        """Take the round this rank missed: the engine's decisions and counters, then what the round
        changes on Lightning's side, as if it had completed here (still in the old numbering)."""
        self.after_round(self.trainer(), self.engine.catch_up(record))

    # -- checkpoints ----------------------------------------------------------------------------

    @contextmanager
    def sync_point(self) -> Iterator[None]:
        """Every rank at the same consensus round, with data left in the epoch (see
        :meth:`ElCheStrategy.sync_point <lightning_elche.ElCheStrategy.sync_point>`)."""
        engine = self.engine
        outcome = engine.last_outcome
        if (
            outcome is None
            or not outcome.consensus
            or outcome.ends_window_sequence
            or any(r.out_of_data for r in outcome.reports)
            or engine.steps_in_window
            or engine.in_flight
        ):
            raise RuntimeError(
                "ElCheStrategy.sync_point() is only valid right after a consensus round at which every rank "
                "still has data in the epoch (ElCheCheckpoint(every_n_syncs=...) arranges that)."
            )
        started = time.perf_counter()
        try:
            with self.session.at_sync_point():
                yield
        finally:
            # The save runs inside the next window: its time is not compute (spec §5.11, time exclusion).
            engine.exclude_from_window(time.perf_counter() - started)

    def checkpoint_state(self, world_size: int) -> dict[str, Any]:
        """ElChe's part of a checkpoint (identical on every rank); with the epoch's coverage at a sync point."""
        if self.session.in_window:
            raise RuntimeError(
                "ElCheStrategy: a checkpoint in the middle of a window would hold one rank's replica "
                "(not the consensus) and no record of which samples were trained. Save at epoch ends "
                "(ModelCheckpoint(every_n_epochs)) or at syncs with ElCheCheckpoint(every_n_syncs=N)."
            )
        state = self.engine.state_dict()
        state["callback_role"] = self.session.callback_role.state_dict()
        if self.session.at_sync_point_now:
            state["coverage"] = self.epoch_coverage(world_size).state_dict()
        return state

    def epoch_coverage(self, world_size: int) -> EpochCoverage:
        """The epoch's untrained remainder. Every rank knows only which chunks it claimed itself;
        one gather at the sync point (all ranks are there, in the same order) assembles it."""
        sampler = self.sampler()
        assert sampler is not None
        return sampler.coverage(self._gathered(lambda: sampler.local_coverage(sampler.started_batches or 0),
                                               world_size))

    def _gathered(self, value_of: Callable[[], Any], world_size: Optional[int] = None) -> list[Any]:
        """Every rank's ``value_of()``: through the checked collectives where the strategy gave them
        (a rank lost in the gather is survived, and the value asked again), else one plain gather."""
        if self.gather_objects is not None:
            return self.gather_objects(value_of)
        gathered: list[Any] = [None] * (world_size or dist.get_world_size())
        dist.all_gather_object(gathered, value_of())
        return gathered

    def save_and_exit(self, trainer: Trainer, membership: Optional[Membership], max_failure: Any) -> NoReturn:
        """A stop signal was acted on at the last round: save the consensus with the epoch's coverage
        on every rank (all are at this batch start, holding the same weights), then end the fit."""
        request = self.session.pending_save
        signum = slurm_requeue_signal(trainer) if request is StopRequest.REQUEUE else int(signal.SIGTERM)
        assert signum is not None
        started = time.perf_counter()
        with self.session.at_sync_point():
            if request is StopRequest.REQUEUE:
                path = save_and_requeue_slurm_job(trainer, signum)
            else:
                name = RANKS_LOST_CHECKPOINT_NAME if request is StopRequest.RANKS_LOST else None
                path = stop_checkpoint_path(trainer, name)
                trainer.save_checkpoint(path)
        seconds = time.perf_counter() - started
        if request is StopRequest.RANKS_LOST:
            assert membership is not None
            raise RanksLost(
                f"ElCheStrategy: max_failure={max_failure!r} reached: lost {lost_ranks_text(membership.losses)} "
                f"(original ranks). The {membership.world_size} survivor(s) saved the consensus checkpoint "
                f"{path} in {seconds:.2f} s; resume with Trainer.fit(ckpt_path=...)."
            )
        rank_zero_info(
            f"ElCheStrategy: stopped by {request.name} at sync {self.engine.state.rounds}; saved the consensus "
            f"checkpoint {path} in {seconds:.2f} s. Resume with Trainer.fit(ckpt_path=...)."
        )
        # Lightning's exception for a SIGTERM, with the shell's status for a signalled process: the
        # job stopped before its end, which launchers and retry loops must not take for success.
        raise SIGTERMException(128 + signum)
