"""``ElCheStrategy``: heterogeneity-aware local SGD as a Lightning strategy.

Every rank trains its own replica with its own optimizer for a window of steps; faster ranks take
proportionally more steps per window and claim proportionally more data; at the window's end the
replicas' parameters are averaged, weighted by the work each did. The strategy is an adapter: the
round protocol is :mod:`lightning_elche.engine`, its meeting with Lightning's loop
:mod:`lightning_elche.round_driver`, the transport :mod:`lightning_elche.planes`, the dispatch
:mod:`lightning_elche.dispatch`, and who is in the fit :mod:`lightning_elche.membership`.

It subclasses ``DDPStrategy`` to keep Lightning's launchers, cluster environments, process-group
set-up and epoch-level ``sync_dist``, but never wraps the model in ``DistributedDataParallel``.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.strategies.ddp import default_pg_timeout
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_elche.averaging import AveragedLayout
from lightning_elche.buffer_sync import average_replaced_buffers
from lightning_elche.checked_collectives import CheckedCollectives
from lightning_elche.checks import require_timedelta
from lightning_elche.cohort_callbacks import continue_the_cohort, follow_the_cohort, stop_if_the_budget_is_spent
from lightning_elche.collective_recovery import CheckpointSaves, CollectiveRecovery
from lightning_elche.config import FIT_KNOBS, ElCheConfig, ElCheMode, resolve_config
from lightning_elche.coverage import EpochCoverage
from lightning_elche.dispatch import ElCheSampler
from lightning_elche.elastic_ddp import ElasticDDPStrategy
from lightning_elche.engine import ElCheEngine
from lightning_elche.evaluation_recovery import EvaluationRecovery
from lightning_elche.fit_view import ElCheFitView
from lightning_elche.growth import Growth, RankJoinedWarning, dispatch_store
from lightning_elche.loop_glue import (
    LightningPatches,
    LightningRankView,
    batch_samples,
    check_lightning_version,
    check_step_schedulers,
    default_group_store,
    init_process_group_on_job_store,
    lightning_phase,
    logging_batch,
    next_epoch,
    process_group_timeout,
    sampler_for,
    sync_module_states,
    train_dataloader_count,
    with_training_sampler,
)
from lightning_elche.membership.agreement import Membership
from lightning_elche.membership.change import MaxFailure, RanksLost
from lightning_elche.membership.groups import ProcessGroups
from lightning_elche.membership.liveness import resolve_liveness_timeout
from lightning_elche.membership.stall import evaluation_step, resolve_stall_timeout
from lightning_elche.membership.survival import ChangeListeners, RankLostWarning, Survival
from lightning_elche.micro_batch import MicroBatch, MicroBatching, rank_micro_batch
from lightning_elche.micro_batch_auto import choose_micro_batch
from lightning_elche.outer import OuterAvg, OuterOptimizer
from lightning_elche.planes import PlaneSetup, build_plane
from lightning_elche.planes.collective import default_group_device
from lightning_elche.round_driver import RoundDriver, RoundListener
from lightning_elche.session import Session
from lightning_elche.stop_guard import guard_stops
from lightning_elche.stop_signals import StopWatchdog, resolve_stop_grace
from lightning_elche.summary import format_summary
from lightning_elche.trainer_checks import check_optimizers, check_settings

__all__ = ["ElCheStrategy", "RankJoinedWarning", "RankLostWarning", "resolve_config"]

class ElCheStrategy(ElasticDDPStrategy, ElCheFitView):
    """Heterogeneity-aware local SGD with a self-tuning averaging window (flodl's ElChe).

    Args:
        mode: one of ``nccl_sync``, ``nccl_cadence`` (default), ``cpu_sync``, ``cpu_cadence``,
            ``cpu_async``; selects that mode's preset when ``elche`` is not given.
        elche: the full :class:`~lightning_elche.ElCheConfig`; ``mode`` must then be omitted or equal.
        outer_optimizer, chunk_batches, max_failure, epoch_callback_policy, log_every_n_syncs, summary, micro_batch:
            the :class:`~lightning_elche.ElCheConfig` knobs of these names (documented there), given
            here instead of in ``elche``; a knob given in both must have the same value.
        liveness_timeout: how long a rank may stay silent (no heartbeat) before its peers declare
            it lost (default 30 s, or half of ``timeout`` when that is shorter; it must be shorter
            than ``timeout``). A killed or crashed rank on the same host is noticed at once.
        snapshot_timeout: ``cpu_*`` modes: how long a round on the CPU plane's own gloo group may
            wait for a silent peer before it fails with a clear error (instead of hanging).
        stop_grace: how long a stop signal may wait for the sync that honours it before the process
            ends anyway (with ``128 + signum``, saving nothing): ``None`` (default) derives it from the
            measured window (3 windows and 2 syncs, at least 30 s); a timedelta is used as it is.
            A second stop signal ends the process at once.
        stall_timeout: how long a live rank may make no progress (no step, no wait on its peers) before
            they declare it lost: ``None`` (default) derives it from that rank's own speed in its phase (2
            windows and rounds, steps or epoch ends + 2 s, at least 20 s: slow is not stuck); or a timedelta.
        restart_lost: how many lost child ranks rank 0's popen launcher restarts as joiners (README, "Growing a fit").
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
        process_group_backend, timeout, start_method: as for Lightning's ``DDPStrategy``.
    """

    strategy_name = "elche"

    def __init__(
        self,
        mode: Optional[Union[ElCheMode, str]] = None,
        elche: Optional[ElCheConfig] = None,
        outer_optimizer: Optional[OuterOptimizer] = None,
        chunk_batches: int = 4,
        snapshot_timeout: timedelta = timedelta(minutes=5),
        log_every_n_syncs: int = 1,
        summary: bool = True,
        epoch_callback_policy: Literal["fastest", "rank0", "all"] = "fastest",
        max_failure: MaxFailure = None,
        liveness_timeout: Optional[timedelta] = None,
        stop_grace: Optional[timedelta] = None,
        stall_timeout: Optional[timedelta] = None,
        micro_batch: MicroBatch = None,
        restart_lost: int = 0,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout, start_method=start_method)
        knobs = dict(zip(FIT_KNOBS, (outer_optimizer, chunk_batches, max_failure, epoch_callback_policy,
                                     log_every_n_syncs, summary, micro_batch), strict=True))
        self.elche = resolve_config(mode, elche, knobs)
        self.snapshot_timeout = require_timedelta(f"ElCheStrategy(snapshot_timeout={snapshot_timeout!r})",
                                                  snapshot_timeout)
        self.liveness_timeout = resolve_liveness_timeout(liveness_timeout, timeout)
        self.stop_grace = resolve_stop_grace(stop_grace)
        self.stall_timeout = resolve_stall_timeout(stall_timeout, timeout)
        # Everything below is built per fit, inside the rank processes (never pickled).
        self._membership: Optional[Membership] = None
        self._session = Session(world_size=1)  # replaced in setup; its role answers before that
        self._engine: Optional[ElCheEngine] = None
        self._rounds: Optional[RoundDriver] = None
        self._sampler: Optional[ElCheSampler] = None
        self._patches = LightningPatches()
        # From a checkpoint, until setup applies the state and the sampler the coverage (the
        # sampler may be built inside setup, by configure_optimizers, or after it).
        self._restored_state: Optional[dict[str, Any]] = None
        self._restored_coverage: Optional[EpochCoverage] = None
        self._round_listeners: list[RoundListener] = []
        self._change_listeners = ChangeListeners()
        self._averaged_buffers: list[Tensor] = []  # the buffer tensors the rounds reduce
        self._stop_watchdog: Optional[StopWatchdog] = None
        self._collectives: Optional[CheckedCollectives] = None
        self._evaluations: Optional[EvaluationRecovery] = None
        self._saves = CheckpointSaves(self)  # a save is written once, whole, by rank 0 (or the new rank 0)
        self._micro_batching: Optional[MicroBatching] = None
        self._growth = Growth(restart_lost)  # a rank joining a running fit (ELCHE_JOIN=1), the members' admissions

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_round_listeners"] = []  # listeners re-register in their callbacks' setup
        state["_change_listeners"] = ChangeListeners()
        return state

    # -- hooks, in the order Lightning calls them ---------------------------------------------------

    @override
    def _configure_launcher(self) -> None:
        # Late-bound: the answer may change during the fit (and tests replace the method).
        self._growth.configure_launcher(self, tolerates_loss=lambda member: self.tolerates_rank_loss(member))

    @override
    def setup_distributed(self) -> None:
        # The job's store is hosted outside rank 0, so that losing rank 0 does not lose it. A joiner
        # gets its group when the fit admits it (setup).
        if self._growth.joining:
            self._growth.connect(self)
        else:
            init_process_group_on_job_store(self)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        # Applied in setup, once the engine and the sampler exist, so that the cadence continues.
        state = checkpoint.get("elche")
        self._restored_state = state if isinstance(state, dict) else None
        coverage = self._restored_state.get("coverage") if self._restored_state is not None else None
        self._restored_coverage = EpochCoverage.from_state_dict(coverage) if coverage is not None else None
        return checkpoint

    @override
    def setup(self, trainer: Trainer) -> None:
        fitting = trainer.state.fn == "fit"
        if fitting:
            check_lightning_version()
            check_settings(trainer)
            # Before super().setup: configure_optimizers may build the train dataloader, which needs the prefix.
            prefix = self._growth.fit_prefix(self)
            self.elche.validate_world_size(self.world_size)
            budget = trainer.max_steps
            self._session = Session(self.world_size, None if budget in (None, -1) else int(budget), prefix)
            self._membership = self._growth.membership or self._join_membership(prefix)
            self._guard_fit(trainer)
            self._patches.report_cohort_batches(trainer, lambda: self._sampler)
        super().setup(trainer)  # configure_ddp, then configure_optimizers (with the user's max_steps)
        if not fitting:
            return
        self._patches.take_over_max_steps(trainer)
        check_optimizers(trainer)
        follow_the_cohort(trainer, lambda: self._engine.state.cohort_step if self._engine else 0,
                          self._patches.replace_hook)
        if self._restored_state is not None:
            assert self._engine is not None
            self._engine.load_state_dict(self._restored_state)
            self._session.callback_role.load_state_dict(self._restored_state.get("callback_role", {}))
            self._restored_state = None
        if self._growth.joining:
            self._growth.take_state(trainer, self._engine, self._session)
        self._growth.attach(self._membership, self._rounds, lambda: self._sampler)
        stop_if_the_budget_is_spent(trainer, self._engine.state.cohort_step if self._engine else 0,
                                    self._session.step_budget)
        check_step_schedulers(trainer)

    def _join_membership(self, fit_prefix: str) -> Membership:
        link = self.job_store_link
        # A process group set up before the fit (a harness, the user) has no job store of ours: its
        # own store serves, without the registry (lost ranks are then found by silence only).
        store, member = (link.store, link.rank) if link is not None else (default_group_store(), self.global_rank)
        previous = self._membership
        # A later fit of the same job keeps the numbering a change gave the ranks.
        members = previous.members if previous is not None else list(range(self.world_size))
        if previous is not None:
            previous.close()
        # A live member that is slow to reach a regroup is waited for as long as a collective would be.
        join_timeout = process_group_timeout(self) or default_pg_timeout
        return Membership(store, fit_prefix, member, members, self.liveness_timeout, join_timeout,
                          max_failure=self.elche.max_failure, renumbered=previous is not None and previous.renumbered,
                          stall_timeout=self.stall_timeout)

    @override
    def configure_ddp(self) -> None:
        # No DistributedDataParallel: replicas train independently between syncs. Start them from
        # identical weights, as DDP's constructor would, then set up the averaging in its place,
        # before configure_optimizers (which may already set up the train dataloader).
        assert self.model is not None and self.lightning_module is not None
        self._growth.take_module(self.model) if self._growth.joining else sync_module_states(self.model)
        previous = self._engine  # a later fit of this strategy continues its cohort step
        module = self.lightning_module
        layout = AveragedLayout(module)
        self._averaged_buffers = list(layout.buffers.tensors)
        outer = copy.deepcopy(self.elche.outer_optimizer) if self.elche.outer_optimizer is not None else OuterAvg()
        plane = build_plane(PlaneSetup(
            layout, self.global_rank, self.world_size, self.root_device, self.elche.run_mode, self.elche.gamma,
            outer=None if isinstance(outer, OuterAvg) else outer, watch=self._membership,
            round_timeout=self.snapshot_timeout))
        # Frozen parameters too: one may be unfrozen later (the planes stamp the current signature).
        self._engine = ElCheEngine(self.elche, plane, self.global_rank, self.world_size, self.root_device,
                                   params=list(module.parameters()), signature=layout.signature,
                                   step_budget=self._session.step_budget, outer=outer)
        continue_the_cohort(previous, self._engine)
        self._rounds = RoundDriver(self._engine, self._session, lambda: self._sampler, self._round_listeners,
                                   self.elche.log_every_n_syncs, lambda: self.global_rank, self._fitting_trainer)
        self._rounds.evaluations = self._evaluations
        self._rounds.gather_objects = getattr(self._collectives, "all_gather_object", None)  # coverage: checked
        self._engine.failures = self._survival(module.trainer, self._rounds)
        self._rounds.stall_stamp = self._membership.progress if self._membership else None

    def _survival(self, trainer: Trainer, rounds: RoundDriver) -> Optional[Survival]:
        membership = self._membership
        if membership is None:
            return None
        device = self.root_device if self.root_device.type == "cuda" else None
        view = LightningRankView(trainer, lambda: self.global_rank)
        return Survival(
            membership, ProcessGroups(membership, process_group_timeout(self), device),
            holders=lambda: [h for h in (view, self._session, self._sampler, self._engine, self._change_listeners)
                             if h is not None],
            handover=lambda: self._sampler, recovery=rounds, epoch=lambda: self._session.epoch,
            keep_epoch_open=lambda: self._engine.keep_epoch_open() if self._engine is not None else None,
        )

    def _fitting_trainer(self) -> Trainer:
        module = self.lightning_module
        assert module is not None, "ElCheStrategy: a training hook ran without a LightningModule"
        return module.trainer

    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or trainer.state.stage != RunningStage.TRAINING or self._engine is None:
            return dataloader
        if not isinstance(dataloader, DataLoader):
            raise TypeError(
                f"ElCheStrategy dispatches training data itself and needs a torch DataLoader; got "
                f"{type(dataloader).__name__}."
            )
        self._sampler = sampler_for(dataloader, self.elche, self.global_rank, self.world_size,
                                    self._session.dispatch_prefix, self.elche.chunk_batches,
                                    dispatch_store(self._membership) if self._membership is not None else None)
        # Lightning's prefetching fetcher draws the first batch in setup_data, before it calls
        # set_epoch: a resumed fit would dispatch its first epoch with epoch 0's order and counter.
        # ``processed`` is the epoch the loop runs next (set_epoch uses the same counter).
        self._sampler.set_epoch(next_epoch(trainer))
        if self._restored_coverage is not None:
            self._sampler.resume(self._restored_coverage)
            self._restored_coverage = None
        self._growth.dispatch_ready(self, self._sampler, dataloader)
        self._engine.set_epoch_size(self._sampler.num_batches)
        micro = self._micro_batching = MicroBatching(rank_micro_batch(self.elche.micro_batch, self.global_rank),
                                                     dataloader.batch_size, self, choose_micro_batch, logging_batch)
        # Every rank's choice reaches the summary and the metrics through the rounds' metadata.
        self._engine.micro_batch_size = (lambda: micro.size) if self.elche.micro_batch is not None else None
        return with_training_sampler(dataloader, self._sampler)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self._fitting_trainer()
        if self._sampler is None:
            raise RuntimeError(
                "ElCheStrategy found no training DataLoader to dispatch: return a torch DataLoader "
                "from train_dataloader()."
            )
        if train_dataloader_count(trainer) != 1:
            raise TypeError("ElCheStrategy supports exactly one training DataLoader.")
        self._growth.training_starts(trainer, self.global_rank)
        self._patches.silence_per_step_sigterm_broadcast(trainer)
        self._patches.watch_batches(trainer, self._after_batch_hooks, lambda: self._session.refuse_skipped_epoch(
            self.global_rank), self._without_a_batch)

    # -- stop signals: honoured at the next round, within a bounded grace in any case --------------

    def _guard_fit(self, trainer: Trainer) -> None:
        """For the rest of the fit: stop signals become stop requests and always end the process
        (:mod:`lightning_elche.stop_guard`); collectives outside the rounds are checked, gathers of
        collections included (:mod:`lightning_elche.checked_collectives`); a rank lost in one is survived
        (validation: :mod:`lightning_elche.evaluation_recovery`; elsewhere: :mod:`.collective_recovery`)."""
        self._stop_watchdog = guard_stops(self, trainer, self._patches, self._session.request_stop)
        self._collectives = CheckedCollectives(lambda: self._membership, lambda: lightning_phase(trainer),
                                               process_group_timeout(self) or default_pg_timeout)
        assert self.lightning_module is not None
        self._patches.check_gathered_collections(self.lightning_module, self._checked_gather)
        self._evaluations = EvaluationRecovery(trainer, lambda: self._engine, lambda: self._sampler,
                                               self.elche.max_failure, lambda: self.lost_ranks)
        self._patches.redo_evaluation_after_losses(trainer, self._evaluations)  # a rank lost while validating
        self._collectives.recover = CollectiveRecovery(trainer, lambda: self._engine, self._evaluations,
                                                       self._saves).recovered  # anywhere else: run it again

    def _stop_saving(self) -> contextlib.AbstractContextManager[None]:
        return self._stop_watchdog.saving() if self._stop_watchdog is not None else contextlib.nullcontext()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._training_goes_on(batch_samples(batch, self._sampler.batch_size if self._sampler else 0))
        if self._sampler is not None:
            self._sampler.batch_started()
        if self._micro_batching is not None:
            self._micro_batching.batch_started(batch_idx % self._fitting_trainer().accumulate_grad_batches == 0)

    def _training_goes_on(self, samples: int) -> None:
        assert self._engine is not None and self._rounds is not None
        trainer = self._fitting_trainer()
        self._advance_progress(training=True)
        if self._session.pending_save.saves:
            with self._stop_saving():  # the stop's own save: its grace starts again
                self._rounds.save_and_exit(trainer, self._membership, self.elche.max_failure)
        if self._session.start_batch(trainer.current_epoch, samples):
            self._engine.start_epoch()
            if self._collectives is not None:
                self._collectives.training_started(trainer.current_epoch)

    def _without_a_batch(self) -> bool:
        self._training_goes_on(0)  # the iterator of the epoch gave no batch: rounds until its end
        return self._rounds is not None and self._rounds.without_a_batch(self._fitting_trainer())

    def _advance_progress(self, training: bool) -> None:
        # Per step: one Python add; the heartbeat thread publishes it (membership/stall.py).
        if self._membership is not None:
            stamp = self._membership.progress
            stamp.enter_training() if training else stamp.leave_training()
            stamp.advance()

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        # Judged inside the step (the sanity check's too) by its own longest one (membership/stall.py).
        with evaluation_step(self._membership.progress if self._membership is not None else None):
            return super().validation_step(*args, **kwargs)

    def _after_batch_hooks(self) -> None:
        # A should_stop set in on_train_batch_end (after the step) travels to the next round instead.
        trainer = self._fitting_trainer()
        if self._session.hold_back_local_stop(trainer.should_stop):
            trainer.should_stop = False

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        step, micro = super().training_step, self._micro_batching  # micro_batch.py: a batch in pieces
        if micro is None or self._rounds is None or not args:
            return step(*args, **kwargs)
        return micro.training_step(args[0], lambda part: step(part, *args[1:], **kwargs))

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        super().pre_backward(closure_loss)
        if self._micro_batching is not None:
            self._micro_batching.pre_backward()

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any],
                       model: Optional[Union[LightningModule, Module]] = None, **kwargs: Any) -> Any:
        if self._rounds is None:  # not fitting
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        output = Strategy.optimizer_step(self, optimizer, closure, model, **kwargs)
        raw = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        self._rounds.after_optimizer_step(self._fitting_trainer(), output, float(raw.param_groups[0]["lr"]))
        return output

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Optional[Any] = None) -> None:
        if self._rounds is not None:
            checkpoint["elche"] = self._rounds.checkpoint_state(self.world_size)
        self._saves.save(checkpoint, filepath, storage_options)

    # -- end of fit ---------------------------------------------------------------------------------

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        self._advance_progress(training=False)
        self._growth.fit_over(self)
        if self._rounds is not None and self._session.pending_save.saves:
            # A saving stop acted on at the fit's last round has no next batch start to save at.
            with self._stop_saving():
                self._rounds.save_and_exit(self._fitting_trainer(), self._membership, self.elche.max_failure)
        self._session.end_training()
        if self._engine is not None and self.lightning_module is not None:
            # After the callbacks' on_train_end (SWA's BatchNorm pass has ended): buffers a callback
            # replaced left the rounds; every rank gets the cohort's value (one collective per fit).
            collectives = self._collectives  # checked: a peer lost in it is survived, the survivors' values kept
            checked = collectives.all_reduce("ElChe's end-of-training buffer average") if collectives else None
            average_replaced_buffers(self.lightning_module, self._averaged_buffers, self.world_size,
                                     default_group_device(self.root_device), checked)
        if self.elche.summary and self.is_global_zero and self._engine is not None and self._engine.state.rounds:
            lost = self._membership.lost_original if self._membership is not None else []
            rank_zero_info(format_summary(self._engine.progress(), lost))

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        reason = type(exception).__name__ + (f": {str(exception).splitlines()[0]}" if str(exception) else "")
        if self._membership is not None and self._membership.active and not isinstance(exception, RanksLost):
            self._membership.leave(reason)
        if self.job_store_link is not None:
            self.job_store_link.mark_exited(reason)  # the job's registry keeps why this rank ended

    @override
    def teardown(self) -> None:
        # The engine stays readable after fit (its totals and controller state are the run's
        # record); only its transport is released.
        if self._membership is not None:
            if self._collectives is not None:  # a peer waiting in a collective this rank never enters fails
                self._collectives.close()
            self._membership.close()
        if self._engine is not None:
            self._engine.plane.close()
        self._sampler = None
        self._micro_batching = None
        self._session.end_training()
        self._patches.undo()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        entries: list[tuple[str, Optional[ElCheMode]]] = [("elche", None)]
        entries += [(f"elche_{mode.value}", mode) for mode in ElCheMode]
        for name, mode in entries:
            if name in strategy_registry:
                continue
            label = mode.value if mode else "nccl_cadence (default)"
            strategy_registry.register(
                name, cls, description=f"ElChe heterogeneity-aware local SGD, mode {label}", mode=mode
            )
