"""``ElCheStrategy``: heterogeneity-aware local SGD as a Lightning strategy.

Every rank trains its own replica with its own optimizer for a window of steps; faster ranks take
proportionally more steps per window and claim proportionally more data; at the window's end the
replicas' parameters are averaged, weighted by the work each did. The strategy is thin glue: the
round protocol lives in :mod:`lightning_elche.engine`, the controller in
:mod:`lightning_elche.controller`, the transport in :mod:`lightning_elche.planes`, the dispatch in
:mod:`lightning_elche.data`.

It subclasses ``DDPStrategy`` to keep Lightning's launchers, cluster environments, process-group
set-up and epoch-level ``sync_dist``, but never wraps the model in ``DistributedDataParallel``.
"""

from __future__ import annotations

import copy
import logging
import secrets
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from types import FrameType
from typing import Any, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, Strategy
from lightning.pytorch.strategies.ddp import default_pg_timeout
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _update_dataloader, extract_batch_size
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from lightning_elche.averaging import AveragedLayout
from lightning_elche.config import ElCheConfig, ElCheMode
from lightning_elche.coverage import EpochCoverage
from lightning_elche.data import ElCheSampler
from lightning_elche.engine import ElCheEngine, RoundOutcome
from lightning_elche.epoch_callbacks import CallbackRole, EpochCallbackPolicy, check_policy
from lightning_elche.loop_glue import (
    check_step_schedulers,
    report_cohort_batches,
    sampler_for,
    silence_per_step_sigterm_broadcast,
    take_over_max_steps,
)
from lightning_elche.outer import OuterAvg, OuterOptimizer
from lightning_elche.planes import AveragingPlane, CollectivePlane, CpuPlane
from lightning_elche.summary import format_summary
from lightning_elche.trainer_checks import check_trainer

log = logging.getLogger(__name__)

_STOP_NONE, _STOP_GRACEFUL, _STOP_SIGTERM = 0, 1, 2


def resolve_config(mode: Optional[Union[ElCheMode, str]], elche: Optional[ElCheConfig]) -> ElCheConfig:
    """The effective config from the strategy's ``mode`` and ``elche`` arguments."""
    if elche is None:
        return ElCheConfig.preset(ElCheMode.nccl_cadence if mode is None else mode)
    if not isinstance(elche, ElCheConfig):
        raise TypeError(f"ElCheStrategy(elche={elche!r}) is invalid: expected an ElCheConfig.")
    if mode is not None:
        try:
            requested = ElCheMode(mode)
        except ValueError:
            allowed = ", ".join(m.value for m in ElCheMode)
            raise ValueError(f"ElCheStrategy(mode={mode!r}) is invalid: expected one of {allowed}.") from None
        if requested is not elche.mode:
            raise ValueError(
                f"ElCheStrategy(mode={requested.value!r}) conflicts with elche.mode={elche.mode.value!r}: "
                "give the mode once (either argument), or the same value in both."
            )
    return elche


class ElCheStrategy(DDPStrategy):
    """Heterogeneity-aware local SGD with a self-tuning averaging window (flodl's ElChe).

    Args:
        mode: one of ``nccl_sync``, ``nccl_cadence`` (default), ``cpu_sync``, ``cpu_cadence``,
            ``cpu_async``; selects that mode's preset when ``elche`` is not given.
        elche: the full :class:`~lightning_elche.ElCheConfig`; ``mode`` must then be omitted or equal.
        outer_optimizer: applied to every realized parameter consensus, identically on every rank:
            :class:`~lightning_elche.OuterAvg` (default, plain averaging),
            :class:`~lightning_elche.SlowMo` or :class:`~lightning_elche.DiLoCo` (which also resets
            each rank's optimizer state after every sync).
        chunk_batches: longest run of batches a rank claims at once from the shared data pool
            (cadence/async modes). Chunks shrink to single batches near the end of an epoch.
        snapshot_timeout: ``cpu_*`` modes: how long an averaging round may wait for a silent peer
            before it fails with a clear error (instead of hanging).
        log_every_n_syncs: log the ``elche/*`` metrics every this many syncs (rank 0).
        summary: print a per-rank summary table at the end of ``fit``.
        epoch_callback_policy: which rank runs user epoch callbacks wrapped in
            :class:`~lightning_elche.EpochCallbacks` (or that check :attr:`runs_epoch_callbacks`):
            ``"fastest"`` (default, as flodl), ``"rank0"`` or ``"all"``. Callbacks that Lightning
            runs directly still run on every rank.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
        process_group_backend, timeout, start_method: as for Lightning's ``DDPStrategy``.
    """

    strategy_name = "elche"

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_round_listeners"] = []  # listeners re-register in their callbacks' setup
        return state

    def __init__(
        self,
        mode: Optional[Union[ElCheMode, str]] = None,
        elche: Optional[ElCheConfig] = None,
        outer_optimizer: Optional[OuterOptimizer] = None,
        chunk_batches: int = 4,
        snapshot_timeout: timedelta = timedelta(minutes=5),
        log_every_n_syncs: int = 1,
        summary: bool = True,
        epoch_callback_policy: EpochCallbackPolicy = "fastest",
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self.elche = resolve_config(mode, elche)
        for name, value in (("chunk_batches", chunk_batches), ("log_every_n_syncs", log_every_n_syncs)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ElCheStrategy({name}={value!r}) is invalid: expected an integer >= 1.")
        if outer_optimizer is not None and not isinstance(outer_optimizer, OuterOptimizer):
            raise TypeError(
                f"ElCheStrategy(outer_optimizer={outer_optimizer!r}) is invalid: expected an OuterOptimizer "
                "(OuterAvg, SlowMo or DiLoCo)."
            )
        self.outer_optimizer = outer_optimizer
        if not isinstance(snapshot_timeout, timedelta) or snapshot_timeout.total_seconds() <= 0:
            raise ValueError(
                f"ElCheStrategy(snapshot_timeout={snapshot_timeout!r}) is invalid: expected a positive timedelta."
            )
        self.snapshot_timeout = snapshot_timeout
        self.chunk_batches = chunk_batches
        self.log_every_n_syncs = log_every_n_syncs
        self.summary = summary
        self.epoch_callback_policy = check_policy("ElCheStrategy", epoch_callback_policy)
        # Everything below is built per fit, inside the rank processes (never pickled).
        self._engine: Optional[ElCheEngine] = None
        self._restored_engine_state: Optional[dict[str, Any]] = None
        self._restored_coverage: Optional[EpochCoverage] = None
        self._batch_epoch: Optional[int] = None  # the epoch of the last training batch of this fit
        self._epoch_batches = 0  # batches this rank started in that epoch, in this fit
        self._sync_point_save = False
        self._callback_role = CallbackRole(1)
        self._single_rank_policy: Optional[str] = None
        self._side_group: Optional[Any] = None
        self._leaving = False
        self._sampler: Optional[ElCheSampler] = None
        self._undo_cohort_batches: Optional[Callable[[], None]] = None
        self._dispatch_prefix = ""
        self._step_budget: Optional[int] = None
        self._pending_samples = 0
        self._stop_request = _STOP_NONE
        self._should_stop_seen = False
        self._uneven_phase = False
        self._warned_rank_local_reduce = False
        self._round_listeners: list[Callable[[RoundOutcome, dict[str, float]], None]] = []

    @property
    def engine(self) -> Optional[ElCheEngine]:
        """The round protocol of this rank (built in ``setup`` when fitting)."""
        return self._engine

    def add_round_listener(self, listener: Callable[[RoundOutcome, dict[str, float]], None]) -> None:
        """Call ``listener(outcome, metrics)`` on every rank after every sync round.

        ``metrics`` are the round's ``elche/*`` scalars (identical on every rank). Listeners run in
        the training loop at the window boundary: keep them cheap (no collectives).
        """
        self._round_listeners.append(listener)

    def remove_round_listener(self, listener: Callable[[RoundOutcome, dict[str, float]], None]) -> None:
        if listener in self._round_listeners:
            self._round_listeners.remove(listener)

    # -- epoch callbacks -------------------------------------------------------------------

    def epoch_callback_rank(self, policy: Optional[str] = None) -> Optional[int]:
        """The rank that runs epoch callbacks under ``policy`` (default: the strategy's);
        ``None`` means every rank. The same on every rank."""
        return self._callback_role.rank_for(check_policy("ElCheStrategy", policy or self.epoch_callback_policy))

    @property
    def runs_epoch_callbacks(self) -> bool:
        """Whether this rank runs epoch callbacks under ``epoch_callback_policy``."""
        rank = self.epoch_callback_rank()
        return rank is None or rank == self.global_rank

    @contextmanager
    def single_rank_callbacks(self, policy: str) -> Iterator[None]:
        """Refuse collectives while callbacks run on this rank alone (their peers would never join)."""
        self._single_rank_policy = policy
        try:
            yield
        finally:
            self._single_rank_policy = None

    # -- set-up, in the order Lightning calls it --------------------------------------------

    def setup(self, trainer: Trainer) -> None:
        fitting = trainer.state.fn == "fit"
        if fitting:
            self.elche.validate_world_size(self.world_size)
            self._step_budget = take_over_max_steps(trainer)
            # Before super().setup: configure_optimizers may set up the train dataloader (through
            # trainer.estimated_stepping_batches), and the dispatch needs this prefix then.
            self._dispatch_prefix = f"lightning_elche/{self.broadcast(secrets.token_hex(8))}"
            self._undo_cohort_batches = report_cohort_batches(trainer, lambda: self._sampler)
        super().setup(trainer)
        if not fitting:
            return
        check_trainer(trainer)
        if self.elche.bf16_wire and not self.elche.mode.uses_cpu_plane:
            rank_zero_warn(
                f"ElCheConfig.bf16_wire=True is ignored by mode {self.elche.mode.value!r}: its reduce "
                "never leaves the devices. bf16_wire applies to the cpu_* modes."
            )
        self._batch_epoch = None
        self._callback_role = CallbackRole(self.world_size)
        if self._restored_engine_state is not None:
            self._engine.load_state_dict(self._restored_engine_state)
            self._callback_role.load_state_dict(self._restored_engine_state.get("callback_role", {}))
            self._restored_engine_state = None
        check_step_schedulers(trainer)

    def _build_engine(self) -> ElCheEngine:
        assert self.lightning_module is not None
        layout = AveragedLayout(self.lightning_module)
        outer = copy.deepcopy(self.outer_optimizer) if self.outer_optimizer is not None else OuterAvg()
        plane_outer = None if isinstance(outer, OuterAvg) else outer
        plane: AveragingPlane
        if self.elche.mode.uses_cpu_plane:
            # Every rank creates the side group here, in the same order; only the plane's thread uses it.
            self._side_group = dist.new_group(backend="gloo", timeout=self.snapshot_timeout)
            plane = CpuPlane(
                layout, self.global_rank, self.world_size, gamma=self.elche.gamma, outer=plane_outer,
                bf16_wire=self.elche.bf16_wire, non_blocking=self.elche.mode.is_async,
                snapshot_timeout=self.snapshot_timeout, group=self._side_group,
            )
        else:
            plane = CollectivePlane(
                layout, self.global_rank, self.world_size, self._metadata_device(),
                gamma=self.elche.gamma, outer=plane_outer,
            )
        return ElCheEngine(
            config=self.elche,
            plane=plane,
            rank=self.global_rank,
            world_size=self.world_size,
            device=self.root_device,
            # Frozen parameters too: one may be unfrozen later (the planes stamp the current signature).
            params=[p.detach() for p in self.lightning_module.parameters()],
            signature=layout.signature,
            epoch_batches=0,
            step_budget=self._step_budget,
            outer=outer,
        )

    def _metadata_device(self) -> torch.device:
        backend = dist.get_backend() if _distributed_is_initialized() else "gloo"
        return self.root_device if "nccl" in str(backend) else torch.device("cpu")

    def configure_ddp(self) -> None:
        # No DistributedDataParallel: replicas train independently between syncs. Start them
        # from identical weights, as DDP's constructor would, then set up the averaging in its
        # place, before configure_optimizers (which may already set up the train dataloader).
        assert self.model is not None
        _sync_module_states(self.model)
        self._engine = self._build_engine()

    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or trainer.state.stage != RunningStage.TRAINING or self._engine is None:
            return dataloader
        if not isinstance(dataloader, DataLoader):
            raise TypeError(
                f"ElCheStrategy dispatches training data itself and needs a torch DataLoader; got "
                f"{type(dataloader).__name__}."
            )
        self._sampler = sampler_for(dataloader, self.elche, self.global_rank, self.world_size, self._dispatch_prefix,
                                    self.chunk_batches)
        # Lightning's prefetching fetcher draws the first batch in setup_data, before it calls
        # set_epoch: a resumed fit would dispatch its first epoch with epoch 0's order and counter.
        # ``processed`` is the epoch the loop runs next (set_epoch uses the same counter).
        self._sampler.set_epoch(trainer.fit_loop.epoch_progress.current.processed)
        if self._restored_coverage is not None:
            self._sampler.resume(self._restored_coverage)
            self._restored_coverage = None
        self._engine.controller.max_total_batches = max(self._sampler.num_batches, self.world_size)
        return _update_dataloader(dataloader, self._sampler, mode=RunningStage.TRAINING)

    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer
        if self._sampler is None:
            raise RuntimeError(
                "ElCheStrategy found no training DataLoader to dispatch: return a torch DataLoader "
                "from train_dataloader()."
            )
        if len(trainer.fit_loop._combined_loader.flattened) != 1:
            raise TypeError("ElCheStrategy supports exactly one training DataLoader.")
        silence_per_step_sigterm_broadcast(trainer)
        self._install_sigterm_handler(trainer)

    def _install_sigterm_handler(self, trainer: Trainer) -> None:
        # Lightning's own handler broadcasts on the default group and raises on this rank alone.
        # Ours only records the request; every rank stops after the next round.
        launcher = self.launcher

        def request_stop(signum: int, frame: Optional[FrameType]) -> None:
            if self._stop_request != _STOP_SIGTERM and launcher is not None:
                launcher.kill(signum)
            self._stop_request = _STOP_SIGTERM

        try:
            signal.signal(signal.SIGTERM, request_stop)
        except ValueError:  # not the main thread: Lightning's handler stays, SIGTERM is not graceful
            rank_zero_warn("ElCheStrategy could not install its SIGTERM handler outside the main thread.")

    # -- per batch -----------------------------------------------------------------------------

    def on_train_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        assert self._engine is not None
        epoch = self.lightning_module.trainer.current_epoch
        # By epoch number, not batch_idx == 0: an epoch resumed mid-way starts at a later batch_idx.
        if epoch != self._batch_epoch:
            self._batch_epoch = epoch
            self._epoch_batches = 0
            self._engine.start_epoch()
            self._leaving = False
        self._epoch_batches += 1
        if self._sampler is not None:
            self._sampler.started_batches = self._epoch_batches
        self._uneven_phase = True
        try:
            self._pending_samples += extract_batch_size(batch)
        except Exception:  # an exotic batch: count the loader's nominal batch size
            self._pending_samples += self._sampler.batch_size if self._sampler else 0

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union[LightningModule, Module]] = None,
        **kwargs: Any,
    ) -> Any:
        engine = self._engine
        if engine is None:  # not fitting
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        trainer = self.lightning_module.trainer
        output = Strategy.optimizer_step(self, optimizer, closure, model, **kwargs)
        self._defer_rank_local_stop(trainer)
        raw = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        engine.record_step(self._pending_samples, output, float(raw.param_groups[0]["lr"]))
        self._pending_samples = 0
        for outcome in engine.poll():  # cpu_async: adopt a finished round; nothing to do otherwise
            self._after_round(trainer, outcome)
        if self._leaving:  # a round already decided that every rank stops after this batch
            return output
        out_of_data = bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)
        if out_of_data or engine.window_due():
            self._sync(trainer, out_of_data)
        return output

    def _defer_rank_local_stop(self, trainer: Trainer) -> None:
        # A stop raised on one rank mid-window would make it leave the epoch alone; hold it back
        # and let the next round stop every rank together.
        if trainer.should_stop and not self._should_stop_seen:
            trainer.should_stop = False
            self._stop_request = max(self._stop_request, _STOP_GRACEFUL)

    def _sync(self, trainer: Trainer, out_of_data: bool) -> None:
        """Join rounds until this rank may continue: one round, or until the epoch drains."""
        assert self._engine is not None
        # cpu_async trains on while a round is in flight, except when out of data: a draining
        # rank waits for every round, so that it sees the one that ends the epoch.
        blocking = out_of_data or not self.elche.mode.is_async
        while not self._leaving:
            outcomes = self._engine.run_round(trainer.current_epoch, out_of_data, self._stop_request, blocking)
            self._stop_request = _STOP_NONE
            for outcome in outcomes:
                self._after_round(trainer, outcome)
            # A rank out of data keeps joining rounds (with zero mass) until every rank is, so
            # that all ranks leave the epoch after the same round.
            if not out_of_data:
                break

    def _after_round(self, trainer: Trainer, outcome: RoundOutcome) -> None:
        """Log, and turn the round's stop requests into the same decision on every rank.

        Sets ``_leaving`` when every rank leaves the epoch after the current batch.
        """
        assert self._engine is not None
        log_now = self.is_global_zero and (outcome.index % self.log_every_n_syncs == 0 or outcome.epoch_over)
        if log_now or self._round_listeners:
            metrics = self._engine.metrics(outcome)
            for listener in self._round_listeners:
                listener(outcome, metrics)
            if log_now:
                # One x-axis with Lightning's own metrics (rank 0's global_step); the cohort's
                # step count is a logged value, elche/cohort_step.
                for logger in trainer.loggers:
                    logger.log_metrics(metrics, step=trainer.global_step)
        self._callback_role.observe(self._engine.controller)
        if self._sampler is not None and self._sampler.dispatch == "pool" and sum(outcome.planned) > 0:
            self._sampler.set_speed_shares(outcome.planned)
        if outcome.reset_inner:
            for optimizer in self.optimizers:
                optimizer.state.clear()
        self._follow_cohort_step(trainer, outcome)
        if outcome.stop_level >= _STOP_SIGTERM:
            self._uneven_phase = False
            raise SIGTERMException()
        leaving = outcome.epoch_over
        if outcome.budget_reached or outcome.stop_level == _STOP_GRACEFUL:
            # min_epochs is identical on every rank and only changes at epoch ends, which all
            # ranks cross together: until it allows stopping, keep the request for later rounds.
            if trainer.fit_loop._can_stop_early:
                trainer.should_stop = True
                leaving = True
            else:
                self._stop_request = _STOP_GRACEFUL
        if leaving:
            self._uneven_phase = False
            self._leaving = True
        self._should_stop_seen = trainer.should_stop

    def _follow_cohort_step(self, trainer: Trainer, outcome: RoundOutcome) -> None:
        # Lightning steps step-interval schedulers once per local optimizer step, so a fast rank
        # would decay faster. After each round every rank also advances by the steps the others
        # took, so all schedules sit at the cohort step (flodl: sched(global_step + local steps)).
        others = sum(r.steps for r in outcome.reports) - outcome.reports[self.global_rank].steps
        if others <= 0:
            return
        for config in trainer.lr_scheduler_configs:
            if config.interval == "step":
                for _ in range(others):
                    config.scheduler.step()

    # -- checkpoints ---------------------------------------------------------------------------

    @contextmanager
    def sync_point(self) -> Iterator[None]:
        """Run a checkpoint (or another collective) inside an epoch, on every rank, right after a
        consensus round at which every rank still had data: the one place mid-epoch where all
        replicas hold the consensus and every rank reaches the same code. Checkpoints saved
        inside carry the epoch's data coverage, so that a resumed fit trains the rest exactly once.

        Used by :class:`~lightning_elche.ElCheCheckpoint`; every rank must enter it for the same round.
        """
        engine = self._engine
        outcome = engine.last_outcome if engine is not None else None
        if (
            engine is None
            or outcome is None
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
        uneven, self._uneven_phase = self._uneven_phase, False
        self._sync_point_save = True
        try:
            yield
        finally:
            self._uneven_phase = uneven
            self._sync_point_save = False

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None
    ) -> None:
        if self._engine is not None:
            if self._uneven_phase:
                raise RuntimeError(
                    "ElCheStrategy: a checkpoint in the middle of a window would hold one rank's replica "
                    "(not the consensus) and no record of which samples were trained. Save at epoch ends "
                    "(ModelCheckpoint(every_n_epochs)) or at syncs with ElCheCheckpoint(every_n_syncs=N)."
                )
            state = self._engine.state_dict()
            state["callback_role"] = self._callback_role.state_dict()
            if self._sync_point_save:
                state["coverage"] = self._epoch_coverage().state_dict()
            checkpoint["elche"] = state
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def _epoch_coverage(self) -> EpochCoverage:
        # Every rank knows only which chunks it claimed itself; one gather at the sync point
        # (all ranks are there, in the same order) assembles the epoch's untrained remainder.
        assert self._sampler is not None
        local = self._sampler.local_coverage(self._epoch_batches)
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, local)
        return self._sampler.coverage(gathered)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        # Read before setup builds the engine; applied there so the cadence continues.
        state = checkpoint.get("elche")
        self._restored_engine_state = state
        coverage = state.get("coverage") if isinstance(state, dict) else None
        # Applied when the sampler is built: the resumed epoch dispatches only what was untrained.
        self._restored_coverage = EpochCoverage.from_state_dict(coverage) if coverage is not None else None
        return checkpoint

    # -- collectives outside ElChe's rounds ---------------------------------------------------

    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        self._refuse_on_one_rank("reduce()")
        if self._uneven_phase:
            if not self._warned_rank_local_reduce:
                self._warned_rank_local_reduce = True
                rank_zero_warn(
                    "ElCheStrategy: a per-step `self.log(..., sync_dist=True)` (or another reduce during "
                    "training steps) is rank-local under ElChe, since ranks take different numbers of steps. "
                    "Epoch-level values (on_epoch=True) are still reduced across ranks at the epoch end."
                )
            return tensor
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    def _refuse_on_one_rank(self, what: str) -> None:
        if self._single_rank_policy is not None:
            raise RuntimeError(
                f"ElCheStrategy: {what} inside an epoch callback that runs on one rank "
                f"(epoch_callback_policy={self._single_rank_policy!r}) would wait forever for the other ranks. "
                "Run callbacks with collectives under epoch_callback_policy='all' (or register them with the "
                "Trainer directly)."
            )

    def _refuse_mid_window(self, what: str) -> None:
        self._refuse_on_one_rank(what)
        if self._uneven_phase:
            raise RuntimeError(
                f"ElCheStrategy: {what} during training steps cannot work: ranks take different numbers "
                "of steps, so a peer may never reach the matching call. Do it at epoch end or in validation."
            )

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self._refuse_mid_window("barrier()")
        super().barrier(*args, **kwargs)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self._refuse_mid_window("broadcast()")
        return super().broadcast(obj, src)

    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        self._refuse_mid_window("all_gather()")
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    # -- end of fit ----------------------------------------------------------------------------

    def on_train_end(self) -> None:
        super().on_train_end()
        self._uneven_phase = False
        if self.summary and self.is_global_zero and self._engine is not None and self._engine.state.rounds:
            rank_zero_info(format_summary(self._engine))

    def teardown(self) -> None:
        # The engine stays readable after fit (its totals and controller state are the run's
        # record); only its transport is released.
        if self._engine is not None:
            self._engine.plane.close()
        if self._side_group is not None:
            if _distributed_is_initialized():
                dist.destroy_process_group(self._side_group)
            self._side_group = None
        self._sampler = None
        self._uneven_phase = False
        if self._undo_cohort_batches is not None:
            self._undo_cohort_batches()
            self._undo_cohort_batches = None
        super().teardown()

    @classmethod
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
