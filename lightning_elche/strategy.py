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

import contextlib
import copy
import logging
import os
import secrets
import signal
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal, NoReturn, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, Strategy
from lightning.pytorch.strategies.ddp import default_pg_timeout
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from lightning_elche.averaging import AveragedLayout
from lightning_elche.buffer_sync import average_replaced_buffers
from lightning_elche.checks import require_int
from lightning_elche.cohort_callbacks import continue_the_cohort, follow_the_cohort, stop_if_the_budget_is_spent
from lightning_elche.config import ElCheConfig, ElCheMode, Transport
from lightning_elche.coverage import EpochCoverage
from lightning_elche.data import ElCheSampler, LostWork
from lightning_elche.engine import ElCheEngine, FitProgress, Regroup, RoundOutcome
from lightning_elche.job_store import JobStoreLink, current_link, generation_prefix, process_alive
from lightning_elche.loop_glue import (
    LightningPatches,
    can_stop_early,
    check_lightning_version,
    check_step_schedulers,
    configure_launcher,
    default_group_store,
    distributed_is_initialized,
    init_process_group_on_job_store,
    process_group_timeout,
    renumber_lightning_ranks,
    reopen_training_epoch,
    sampler_for,
    save_and_requeue_slurm_job,
    skip_validation_after_this_batch,
    slurm_requeue_signal,
    sync_module_states,
    train_dataloader_count,
    with_training_sampler,
)
from lightning_elche.membership.agreement import Loss, Membership, resolve_liveness_timeout
from lightning_elche.membership.change import MaxFailure, PeerFailure, RanksLost, check_max_failure, failure_limit
from lightning_elche.outer import OuterAvg, OuterOptimizer
from lightning_elche.planes import AveragingPlane, CollectivePlane, CpuPlane
from lightning_elche.rounds import StopRequest
from lightning_elche.session import EpochCallbackPolicy, RoundAction, Session, check_policy
from lightning_elche.stop_checkpoint import RANKS_LOST_CHECKPOINT_NAME, stop_checkpoint_path, written_whole
from lightning_elche.summary import format_summary
from lightning_elche.trainer_checks import check_trainer

log = logging.getLogger(__name__)

RoundListener = Callable[[RoundOutcome, dict[str, float]], None]
RankLossListener = Callable[[Loss], None]


def _default_group_shrinks() -> bool:
    """Whether the default group's backend can drop ranks in place (NCCL >= 2.27 with torch >= 2.10)."""
    if not hasattr(dist.distributed_c10d, "shrink_group") or "nccl" not in str(dist.get_backend()):
        return False
    try:
        return bool(dist.group.WORLD._get_backend(torch.device("cuda")).supports_shrinking)
    except Exception:
        return False


class RankLostWarning(UserWarning):
    """A rank was lost and the survivors went on without it."""


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
        max_failure: how many lost ranks end the fit: ``None`` (default) goes on as long as one rank
            is left, an int ends it at that many lost ranks, a float ``p`` in (0, 1] at
            ``ceil(p * world_size)``. A lost rank (killed, crashed, stopped or hung) is dropped: the
            survivors regroup, take over its untrained data and go on; at the limit every survivor
            saves a consensus checkpoint (``last-ranks-lost.ckpt``) and exits with an error.
        liveness_timeout: how long a rank may stay silent (no heartbeat) before its peers declare
            it lost (default 30 s, or half of ``timeout`` when that is shorter; it must be shorter
            than ``timeout``). A killed or crashed rank on the same host is noticed at once.
        epoch_callback_policy: which rank runs user epoch callbacks wrapped in
            :class:`~lightning_elche.EpochCallbacks` (or that check :attr:`runs_epoch_callbacks`):
            ``"fastest"`` (default, as flodl), ``"rank0"`` or ``"all"``. Callbacks that Lightning
            runs directly still run on every rank.
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
        epoch_callback_policy: EpochCallbackPolicy = "fastest",
        max_failure: MaxFailure = None,
        liveness_timeout: Optional[timedelta] = None,
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
        chunk_batches = require_int(f"ElCheStrategy(chunk_batches={chunk_batches!r})", chunk_batches, 1)
        log_every_n_syncs = require_int(f"ElCheStrategy(log_every_n_syncs={log_every_n_syncs!r})", log_every_n_syncs, 1)
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
        self.max_failure = check_max_failure(max_failure)
        self.liveness_timeout = resolve_liveness_timeout(liveness_timeout, timeout)
        if timeout is not None and self.liveness_timeout >= timeout:
            raise ValueError(
                f"ElCheStrategy(liveness_timeout={self.liveness_timeout}) must be shorter than timeout={timeout}: a "
                "lost rank is detected at the liveness timeout, before the transport's own timeout (NCCL's watchdog "
                "aborts the process at it)."
            )
        self._membership: Optional[Membership] = None
        # Everything below is built per fit, inside the rank processes (never pickled).
        self._session = Session(world_size=1)  # replaced in setup; its role answers before that
        self._engine: Optional[ElCheEngine] = None
        self._sampler: Optional[ElCheSampler] = None
        self._side_group: Optional[Any] = None
        self._patches = LightningPatches()
        # From a checkpoint, until setup applies the state and the sampler the coverage (the
        # sampler may be built inside setup, by configure_optimizers, or after it).
        self._restored_state: Optional[dict[str, Any]] = None
        self._restored_coverage: Optional[EpochCoverage] = None
        self._round_listeners: list[RoundListener] = []
        self._rank_loss_listeners: list[RankLossListener] = []
        self._averaged_buffers: list[Tensor] = []  # the buffer tensors the rounds reduce

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_round_listeners"] = []  # listeners re-register in their callbacks' setup
        state["_rank_loss_listeners"] = []
        return state

    # -- ranks: renumbered densely after a lost rank --------------------------------------------

    @property
    def global_rank(self) -> int:
        renumbered = self._renumbered_membership()
        return renumbered.rank if renumbered is not None else super().global_rank

    @property
    def world_size(self) -> int:
        renumbered = self._renumbered_membership()
        return renumbered.world_size if renumbered is not None else super().world_size

    def _renumbered_membership(self) -> Optional[Membership]:
        # Ranks keep their launch numbers until a rank is lost (for the rest of the job after that).
        membership: Optional[Membership] = getattr(self, "_membership", None)
        return membership if membership is not None and membership.renumbered else None

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # DDP counts devices; after a lost rank only the survivors shard the evaluation data.
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @property
    def launch_ranks(self) -> list[int]:
        """The launch rank of each current rank, in rank order (0..W-1 until a rank is lost)."""
        membership = self._membership
        return list(membership.members) if membership is not None else list(range(self.world_size))

    @property
    def lost_ranks(self) -> list[Loss]:
        """The ranks lost during the last fit, one entry per regroup (empty when none was lost)."""
        return list(self._membership.losses) if self._membership is not None else []

    def tolerates_rank_loss(self) -> bool:
        """Whether a rank may be lost now without ending the job (the launcher then spares the
        survivors when a rank's process fails). Called from the launcher's observer thread."""
        # Also once max_failure is reached: the survivors then save and exit by themselves, and a
        # kill from the launcher must not cut the save short.
        return self._membership is not None and self._membership.active

    # -- what callbacks may use --------------------------------------------------------------

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

    def request_consensus(self) -> None:
        """Make the next round a consensus round: blocking and adopted with alpha 1 in every mode,
        so that every replica holds the consensus after it (a checkpoint follows). Call it from a
        round listener only, so that every rank asks for the same round."""
        assert self._engine is not None
        self._engine.request_consensus()

    def add_round_listener(self, listener: RoundListener) -> None:
        """Call ``listener(outcome, metrics)`` on every rank after every sync round.

        ``metrics`` are the round's ``elche/*`` scalars (identical on every rank). Listeners run in
        the training loop at the window boundary: keep them cheap (no collectives).
        """
        self._round_listeners.append(listener)

    def remove_round_listener(self, listener: RoundListener) -> None:
        if listener in self._round_listeners:
            self._round_listeners.remove(listener)

    def add_rank_loss_listener(self, listener: RankLossListener) -> None:
        """Call ``listener(loss)`` on every survivor when ranks were lost, once the survivors
        regrouped (``global_rank`` and ``world_size`` are the new numbering) and before the failed
        round runs again. No collectives inside."""
        self._rank_loss_listeners.append(listener)

    def remove_rank_loss_listener(self, listener: RankLossListener) -> None:
        if listener in self._rank_loss_listeners:
            self._rank_loss_listeners.remove(listener)

    def epoch_callback_rank(self, policy: Optional[str] = None) -> Optional[int]:
        """The rank that runs epoch callbacks under ``policy`` (default: the strategy's);
        ``None`` means every rank. The same on every rank."""
        return self._session.callback_role.rank_for(check_policy("ElCheStrategy", policy or self.epoch_callback_policy))

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

    # -- hooks, in the order Lightning calls them -------------------------------------------------

    def _configure_launcher(self) -> None:
        # Late-bound: the answer may change during the fit (and tests replace the method).
        configure_launcher(self, tolerates_loss=lambda: self.tolerates_rank_loss())

    def setup_distributed(self) -> None:
        # The job's store is hosted outside rank 0, so that losing rank 0 does not lose it.
        init_process_group_on_job_store(self)

    @property
    def job_store(self) -> Optional[dist.Store]:
        """The job's base store (served outside the ranks; None before ``setup_distributed``).

        The rank registry of :mod:`lightning_elche.job_store` lives in it, and new process groups
        are built on it: ``PrefixStore(job_store.generation_prefix(g), strategy.job_store)``.
        """
        link = current_link()
        return link.store if link is not None else None

    @property
    def job_store_link(self) -> Optional[JobStoreLink]:
        """This process's link to the job's store: the store, this rank's registry entry and the
        key prefix of the default group the fit started with (None before ``setup_distributed``)."""
        return current_link()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        # Read before setup builds the engine and the sampler; applied there so the cadence (and
        # a sync checkpoint's epoch) continues.
        state = checkpoint.get("elche")
        self._restored_state = state if isinstance(state, dict) else None
        coverage = self._restored_state.get("coverage") if self._restored_state is not None else None
        self._restored_coverage = EpochCoverage.from_state_dict(coverage) if coverage is not None else None
        return checkpoint

    def setup(self, trainer: Trainer) -> None:
        fitting = trainer.state.fn == "fit"
        if fitting:
            check_lightning_version()
            self.elche.validate_world_size(self.world_size)
            budget = trainer.max_steps
            # Before super().setup: configure_optimizers may set up the train dataloader (through
            # trainer.estimated_stepping_batches), and the dispatch needs this prefix then.
            prefix = f"lightning_elche/{self.broadcast(secrets.token_hex(8))}"
            self._session = Session(self.world_size, None if budget in (None, -1) else int(budget), prefix)
            self._membership = self._join_membership(prefix)
            self._patches.report_cohort_batches(trainer, lambda: self._sampler)
        super().setup(trainer)  # configure_ddp, then configure_optimizers (with the user's max_steps)
        if not fitting:
            return
        self._patches.take_over_max_steps(trainer)
        check_trainer(trainer)
        follow_the_cohort(trainer, lambda: self._engine.state.cohort_step if self._engine else 0,
                          self._patches.replace_hook)
        if self._restored_state is not None:
            assert self._engine is not None
            self._engine.load_state_dict(self._restored_state)
            self._session.callback_role.load_state_dict(self._restored_state.get("callback_role", {}))
            self._restored_state = None
        stop_if_the_budget_is_spent(trainer, self._engine.state.cohort_step if self._engine else 0,
                                    self._session.step_budget)
        check_step_schedulers(trainer)

    def _join_membership(self, fit_prefix: str) -> Membership:
        link = self.job_store_link
        # A process group set up before the fit (a harness, the user) has no job store of ours: its
        # own store serves, without the registry (lost ranks are then found by silence only).
        store, rank = (link.store, link.rank) if link is not None else (default_group_store(), self.global_rank)
        previous = self._membership
        # A later fit of the same job keeps the numbering a loss gave the ranks.
        members = previous.members if previous is not None else list(range(self.world_size))
        if previous is not None:
            previous.close()
        return Membership(store, fit_prefix, rank, members, self.liveness_timeout,
                          join_timeout=self.snapshot_timeout, renumbered=previous is not None and previous.renumbered)

    def configure_ddp(self) -> None:
        # No DistributedDataParallel: replicas train independently between syncs. Start them
        # from identical weights, as DDP's constructor would, then set up the averaging in its
        # place, before configure_optimizers (which may already set up the train dataloader).
        assert self.model is not None
        sync_module_states(self.model)
        self._engine = continue_the_cohort(self._engine, self._build_engine())

    def _build_engine(self) -> ElCheEngine:
        assert self.lightning_module is not None
        layout = AveragedLayout(self.lightning_module)
        self._averaged_buffers = list(layout.buffers.tensors)
        outer = copy.deepcopy(self.outer_optimizer) if self.outer_optimizer is not None else OuterAvg()
        plane_outer = None if isinstance(outer, OuterAvg) else outer
        run_mode = self.elche.run_mode
        plane: AveragingPlane
        if run_mode.transport is Transport.HOST:
            # Every rank creates the side group here, in the same order; only the plane's thread uses it.
            self._side_group = dist.new_group(backend="gloo", timeout=self.snapshot_timeout)
            plane = CpuPlane(
                layout, self.global_rank, self.world_size, gamma=self.elche.gamma, outer=plane_outer,
                bf16_wire=run_mode.bf16_wire, non_blocking=not run_mode.blocking,
                snapshot_timeout=self.snapshot_timeout, group=self._side_group,
            )
        else:
            plane = CollectivePlane(
                layout, self.global_rank, self.world_size, self._metadata_device(),
                gamma=self.elche.gamma, outer=plane_outer,
            )
        plane.watch = self._membership
        engine = ElCheEngine(
            config=self.elche,
            plane=plane,
            rank=self.global_rank,
            world_size=self.world_size,
            device=self.root_device,
            # Frozen parameters too: one may be unfrozen later (the planes stamp the current signature).
            params=list(self.lightning_module.parameters()),
            signature=layout.signature,
            step_budget=self._session.step_budget,
            outer=outer,
        )
        engine.on_peer_failure = self._on_peer_failure
        return engine

    def _metadata_device(self) -> torch.device:
        backend = dist.get_backend() if distributed_is_initialized() else "gloo"
        return self.root_device if "nccl" in str(backend) else torch.device("cpu")

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
                                    self._session.dispatch_prefix, self.chunk_batches)
        # Lightning's prefetching fetcher draws the first batch in setup_data, before it calls
        # set_epoch: a resumed fit would dispatch its first epoch with epoch 0's order and counter.
        # ``processed`` is the epoch the loop runs next (set_epoch uses the same counter).
        self._sampler.set_epoch(trainer.fit_loop.epoch_progress.current.processed)
        if self._restored_coverage is not None:
            self._sampler.resume(self._restored_coverage)
            self._restored_coverage = None
        self._engine.set_epoch_size(self._sampler.num_batches)
        return with_training_sampler(dataloader, self._sampler)

    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer
        if self._sampler is None:
            raise RuntimeError(
                "ElCheStrategy found no training DataLoader to dispatch: return a torch DataLoader "
                "from train_dataloader()."
            )
        if train_dataloader_count(trainer) != 1:
            raise TypeError("ElCheStrategy supports exactly one training DataLoader.")
        self._patches.silence_per_step_sigterm_broadcast(trainer)
        if not self._patches.route_stop_signals(trainer, self._on_stop_signal):
            rank_zero_warn("ElCheStrategy could not install its stop-signal handlers outside the main thread.")
        self._patches.watch_batches(trainer, lambda: self._after_batch_hooks(trainer), self._refuse_skipped_epoch)

    def _on_stop_signal(self, request: StopRequest, signum: int) -> None:
        # Only recorded: every rank saves and stops after the next round. Lightning's launcher
        # passes a SIGTERM on to the ranks it started, once.
        raised = self._session.request_stop(request)
        if raised and request is StopRequest.SIGTERM and self.launcher is not None:
            self.launcher.kill(signum)

    def on_train_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        assert self._engine is not None
        if self._session.pending_save.saves:
            self._save_and_exit(self.lightning_module.trainer)
        if self._session.start_batch(self.lightning_module.trainer.current_epoch, self._batch_samples(batch)):
            self._engine.start_epoch()
        if self._sampler is not None:
            self._sampler.batch_started()

    def _after_batch_hooks(self, trainer: Trainer) -> None:
        # A should_stop set in on_train_batch_end comes after this batch's optimizer step, where
        # the hold-back runs: this rank would leave the epoch alone. It travels to the next round
        # instead (the next epoch's first round when this batch ended the epoch).
        if self._session.hold_back_local_stop(trainer.should_stop):
            trainer.should_stop = False

    def _refuse_skipped_epoch(self) -> None:
        raise RuntimeError(
            f"ElCheStrategy: on_train_batch_start returned -1 (skip the rest of the epoch) on rank {self.global_rank}. "
            "Under ElChe the ranks hold different, speed-dependent shares of the epoch, so one rank cannot leave "
            "it alone: its peers would wait for it in the next sync, and the samples it already claimed would "
            "never be trained. To end training early, set trainer.should_stop = True (every rank stops at the "
            "next sync); to train on part of the data, fit on a torch.utils.data.Subset."
        )

    def _batch_samples(self, batch: Any) -> int:
        try:
            return extract_batch_size(batch)
        except Exception:  # an exotic batch: count the loader's nominal batch size
            return self._sampler.batch_size if self._sampler else 0

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
        if self._session.hold_back_local_stop(trainer.should_stop):
            trainer.should_stop = False  # the next round stops every rank together
        raw = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        engine.record_step(self._session.take_pending_samples(), output, float(raw.param_groups[0]["lr"]))
        for outcome in engine.poll():  # cpu_async: adopt a finished round; nothing to do otherwise
            self._after_round(trainer, outcome)
        if self._session.leaving:  # a round already decided that every rank stops after this batch
            return output
        out_of_data = bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch) and not self._reopen(trainer)
        if out_of_data or engine.window_due():
            self._sync(trainer, out_of_data)
        return output

    # -- rounds ----------------------------------------------------------------------------------

    def _sync(self, trainer: Trainer, out_of_data: bool) -> None:
        """Join rounds until this rank may continue: one round, or until the epoch drains."""
        assert self._engine is not None
        # cpu_async trains on while a round is in flight, except when out of data: a draining
        # rank waits for every round, so that it sees the one that ends the epoch.
        blocking = out_of_data or self._engine.run_mode.blocking
        while not self._session.leaving:
            request = self._session.take_stop_request()
            batches = (self._sampler.started_batches or 0) if self._sampler is not None else 0
            for outcome in self._engine.run_round(trainer.current_epoch, out_of_data, request, blocking, batches):
                self._after_round(trainer, outcome)
            # A rank out of data keeps joining rounds (with zero mass) until every rank is, so
            # that all ranks leave the epoch after the same round; unless a lost rank's work came
            # its way, which it trains first.
            if not out_of_data or (not self._session.leaving and self._reopen(trainer)):
                break

    def _reopen(self, trainer: Trainer) -> bool:
        """At this rank's last batch: continue the epoch if a lost rank's work came its way."""
        sampler = self._sampler
        if sampler is None or not sampler.wants_reopen:
            return False
        return reopen_training_epoch(trainer, sampler.reopen)

    # -- lost ranks ------------------------------------------------------------------------------

    def _on_peer_failure(self, failure: PeerFailure) -> Regroup:
        """A round failed: agree on the lost ranks, rebuild the groups on the survivors, hand the lost
        ranks' untrained data to them and renumber Lightning's view. Runs on every survivor, in
        the round that failed, in the same order."""
        membership, engine = self._membership, self._engine
        assert membership is not None and engine is not None
        last = engine.last_outcome
        trainer = self.lightning_module.trainer
        loss = membership.agree(failure)
        self._fence(loss)
        group = self._rebuild_process_groups(loss)
        renumber_lightning_ranks(trainer, membership.rank)
        self._session.regroup(loss.survivors)
        if self._sampler is not None:
            epoch = self._session.epoch
            trained = [
                last.reports[k].epoch_batches if last is not None and last.reports[k].epoch == epoch else 0
                for k in loss.lost
            ]
            self._sampler.regroup(loss.survivors, [LostWork(k, n) for k, n in zip(loss.lost, trained, strict=True)])
            loss.trained_batches = dict(zip(loss.lost_original, trained, strict=True))
        limit = failure_limit(self.max_failure, membership.world_size + membership.lost_count)
        ended = limit is not None and membership.lost_count >= limit
        self._warn_lost(loss, ended, limit)
        for listener in self._rank_loss_listeners:
            listener(loss)
        handed_over = self._sampler is not None and self._sampler.returned_batches > 0
        return Regroup(loss.survivors, membership.rank, group,
                       StopRequest.RANKS_LOST if ended else StopRequest.NONE, epoch_continues=handed_over)

    def _fence(self, loss: Loss) -> None:
        # A stopped or hung rank may wake up later: it is out for good, so end it where we can
        # (same host). A rank elsewhere finds itself excluded at its next round and leaves.
        assert self._membership is not None
        for rank in loss.lost_original:
            proc = self._membership.process_of(rank)
            # A rank that failed with an exception left a notice and is ending by itself: let it.
            if proc is not None and process_alive(*proc) and not self._membership.left_a_notice(rank):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(proc[1], signal.SIGKILL)

    def _rebuild_process_groups(self, loss: Loss) -> Optional[Any]:
        """The survivors' default group (and averaging side group): NCCL's own shrink where the
        installed torch and NCCL offer it, else a new group on store keys of this generation."""
        assert self._membership is not None
        loss.regrouped_with = "shrink_group"
        if not (_default_group_shrinks() and self._shrink_default_group(loss.lost)):
            loss.regrouped_with = "new group"
            self._reinit_default_group(self._membership.rank, self._membership.world_size)
        self._side_group = None
        if self.elche.run_mode.transport is Transport.HOST:
            self._side_group = dist.new_group(backend="gloo", timeout=self.snapshot_timeout)
        return self._side_group

    def _shrink_default_group(self, lost: list[int]) -> bool:
        # SHRINK_ABORT first aborts the collectives still waiting on the lost ranks; shrinking
        # the default group destroys the other groups (the side group is built again).
        try:
            dist.distributed_c10d.shrink_group(lost, shrink_flags=dist.distributed_c10d.SHRINK_ABORT)
        except Exception as error:  # e.g. an NCCL build without shrink support: build a new group
            log.warning(f"ElCheStrategy: shrink_group failed ({error}); building a new group over the store.")
            return False
        return True

    def _reinit_default_group(self, rank: int, world_size: int) -> None:
        assert self._membership is not None
        backend = dist.get_backend()
        for group in (self._side_group, dist.group.WORLD):
            if group is not None:
                with contextlib.suppress(Exception):
                    group.abort()  # a collective stuck on the lost rank must not hold the group
                self._membership.abandon(group)  # nor may its release wait for that collective
        dist.destroy_process_group()
        store = dist.PrefixStore(f"{self._membership.fit_prefix}/{generation_prefix(self._membership.generation)}/",
                                 self._membership.store)
        device = self.root_device if self.root_device.type == "cuda" else None
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=process_group_timeout(self), device_id=device)

    def _warn_lost(self, loss: Loss, ended: bool, limit: Optional[int]) -> None:
        assert self._membership is not None
        who = ", ".join(f"rank {r} ({why})" for r, why in loss.reasons.items())
        then = (
            f"max_failure={self.max_failure!r} reached ({self._membership.lost_count} lost of limit {limit}): every "
            "survivor saves a consensus checkpoint and stops." if ended else
            f"{self._membership.world_size} rank(s) go on; its untrained data of this epoch is re-dispatched."
        )
        message = f"ElCheStrategy lost {who} (original ranks). {then}"
        log.warning(message)
        warnings.warn(message, RankLostWarning, stacklevel=2)

    def _after_round(self, trainer: Trainer, outcome: RoundOutcome) -> None:
        """Everything a round changes on this rank, in order; identical decisions on every rank."""
        assert self._engine is not None
        self._publish_round(trainer, outcome)
        self._session.callback_role.observe(self._engine.controller)
        if self._sampler is not None:
            self._sampler.on_round(outcome.dispatch_shares, outcome.epoch, outcome.epoch_batches)
        if outcome.reset_inner:
            for optimizer in self.optimizers:
                optimizer.state.clear()
        self._follow_cohort_step(trainer, outcome)
        action = self._session.after_round(outcome, lambda: can_stop_early(trainer))
        # SAVE_AND_EXIT: no more steps in this batch; every rank saves at its next batch start.
        if action is RoundAction.STOP_FIT:
            trainer.should_stop = True
            if outcome.budget_reached and not outcome.epoch_over and outcome.stop_level == StopRequest.NONE:
                skip_validation_after_this_batch(trainer)  # as Lightning's max_steps inside an epoch
        self._session.saw_should_stop(trainer.should_stop)

    def _publish_round(self, trainer: Trainer, outcome: RoundOutcome) -> None:
        assert self._engine is not None
        log_now = self.is_global_zero and (outcome.index % self.log_every_n_syncs == 0 or outcome.epoch_over)
        if not (log_now or self._round_listeners):
            return
        metrics = self._engine.metrics(outcome)
        for listener in self._round_listeners:
            listener(outcome, metrics)
        if log_now:
            # One x-axis with Lightning's own metrics (rank 0's global_step); the cohort's step
            # count is a logged value, elche/cohort_step.
            for logger in trainer.loggers:
                logger.log_metrics(metrics=metrics, step=trainer.global_step)

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

    # -- checkpoints -----------------------------------------------------------------------------

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
        started = time.perf_counter()
        try:
            with self._session.at_sync_point():
                yield
        finally:
            # The save runs inside the next window: its time is not compute (spec §5.11, time exclusion).
            engine.exclude_from_window(time.perf_counter() - started)

    def _save_and_exit(self, trainer: Trainer) -> NoReturn:
        """A stop signal was acted on at the last round: save the consensus with the epoch's coverage
        on every rank (all are at this batch start, holding the same weights), then end the fit."""
        request = self._session.pending_save
        signum = slurm_requeue_signal(trainer) if request is StopRequest.REQUEUE else int(signal.SIGTERM)
        assert signum is not None
        started = time.perf_counter()
        with self._session.at_sync_point():
            if request is StopRequest.REQUEUE:
                path = save_and_requeue_slurm_job(trainer, signum)
            else:
                name = RANKS_LOST_CHECKPOINT_NAME if request is StopRequest.RANKS_LOST else None
                path = stop_checkpoint_path(trainer, name)
                trainer.save_checkpoint(path)
        if request is StopRequest.RANKS_LOST:
            assert self._membership is not None
            losses = self._membership.losses
            lost = ", ".join(f"rank {r} ({why})" for loss in losses for r, why in loss.reasons.items())
            raise RanksLost(
                f"ElCheStrategy: max_failure={self.max_failure!r} reached: lost {lost} (original ranks). The "
                f"{self.world_size} survivor(s) saved the consensus checkpoint {path} in "
                f"{time.perf_counter() - started:.2f} s; resume with Trainer.fit(ckpt_path=...)."
            )
        rank_zero_info(
            f"ElCheStrategy: stopped by {request.name} at sync {self._engine.state.rounds if self._engine else 0}; "
            f"saved the consensus checkpoint {path} in {time.perf_counter() - started:.2f} s. "
            "Resume with Trainer.fit(ckpt_path=...)."
        )
        # Lightning's exception for a SIGTERM, with the shell's status for a signalled process: the
        # job stopped before its end, which launchers and retry loops must not take for success.
        raise SIGTERMException(128 + signum)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None
    ) -> None:
        if self._engine is not None:
            if self._session.in_window:
                raise RuntimeError(
                    "ElCheStrategy: a checkpoint in the middle of a window would hold one rank's replica "
                    "(not the consensus) and no record of which samples were trained. Save at epoch ends "
                    "(ModelCheckpoint(every_n_epochs)) or at syncs with ElCheCheckpoint(every_n_syncs=N)."
                )
            state = self._engine.state_dict()
            state["callback_role"] = self._session.callback_role.state_dict()
            if self._session.at_sync_point_now:
                state["coverage"] = self._epoch_coverage().state_dict()
            checkpoint["elche"] = state
        with written_whole(filepath) as partial:
            super().save_checkpoint(checkpoint, partial, storage_options=storage_options)

    def _epoch_coverage(self) -> EpochCoverage:
        # Every rank knows only which chunks it claimed itself; one gather at the sync point
        # (all ranks are there, in the same order) assembles the epoch's untrained remainder.
        assert self._sampler is not None
        local = self._sampler.local_coverage(self._sampler.started_batches or 0)
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, local)
        return self._sampler.coverage(gathered)

    # -- collectives outside ElChe's rounds --------------------------------------------------------

    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        self._refuse_on_one_rank("reduce()")
        if self._session.in_window:
            if not self._session.warned_rank_local_reduce:
                self._session.warned_rank_local_reduce = True
                rank_zero_warn(
                    "ElCheStrategy: a per-step `self.log(..., sync_dist=True)` (or another reduce during "
                    "training steps) is rank-local under ElChe, since ranks take different numbers of steps. "
                    "Epoch-level values (on_epoch=True) are still reduced across ranks at the epoch end."
                )
            return tensor
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self._refuse_mid_window("barrier()")
        super().barrier(*args, **kwargs)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self._refuse_mid_window("broadcast()")
        return super().broadcast(obj, src)

    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        self._refuse_mid_window("all_gather()")
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    def _refuse_on_one_rank(self, what: str) -> None:
        policy = self._session.single_rank_policy
        if policy is not None:
            raise RuntimeError(
                f"ElCheStrategy: {what} inside an epoch callback that runs on one rank "
                f"(epoch_callback_policy={policy!r}) would wait forever for the other ranks. "
                "Run callbacks with collectives under epoch_callback_policy='all' (or register them with the "
                "Trainer directly)."
            )

    def _refuse_mid_window(self, what: str) -> None:
        self._refuse_on_one_rank(what)
        if self._session.in_window:
            raise RuntimeError(
                f"ElCheStrategy: {what} during training steps cannot work: ranks take different numbers "
                "of steps, so a peer may never reach the matching call. Do it at epoch end or in validation."
            )

    # -- end of fit --------------------------------------------------------------------------------

    def on_train_end(self) -> None:
        super().on_train_end()
        self._session.end_training()
        if self._engine is not None and self.lightning_module is not None:
            # After the callbacks' on_train_end (SWA's BatchNorm pass has ended): buffers a callback
            # replaced left the rounds; every rank gets the cohort's value (one collective per fit).
            average_replaced_buffers(self.lightning_module, self._averaged_buffers, self.world_size,
                                     self._metadata_device())
        if self.summary and self.is_global_zero and self._engine is not None and self._engine.state.rounds:
            lost = self._membership.lost_original if self._membership is not None else []
            rank_zero_info(format_summary(self._engine.progress(), lost))

    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        reason = type(exception).__name__ + (f": {str(exception).splitlines()[0]}" if str(exception) else "")
        if self._membership is not None and self._membership.active and not isinstance(exception, RanksLost):
            self._membership.leave(reason)
        if self.job_store_link is not None:
            self.job_store_link.mark_exited(reason)  # the job's registry keeps why this rank ended

    def teardown(self) -> None:
        # The engine stays readable after fit (its totals and controller state are the run's
        # record); only its transport is released.
        if self._membership is not None:
            self._membership.close()
        if self._engine is not None:
            self._engine.plane.close()
        if self._side_group is not None:
            if distributed_is_initialized():
                dist.destroy_process_group(self._side_group)
            self._side_group = None
        self._sampler = None
        self._session.end_training()
        self._patches.undo()
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
