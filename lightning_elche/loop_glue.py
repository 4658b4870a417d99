"""The one door into Lightning's internals: every private Lightning name ElChe uses, and every
change it makes to Lightning's objects.

ElChe adapts a fit loop written for lockstep ranks to ranks that take different numbers of
steps. Some of that needs Lightning's private state. It is all here, each private name used once,
so that a Lightning upgrade breaks one module (``tests/test_architecture.py`` fails when a private
Lightning attribute is used anywhere else in the package). Every patch of a Lightning object is
made through :class:`LightningPatches`, which undoes them all when the fit ends. The supported
Lightning range is :data:`SUPPORTED_LIGHTNING` (the range ``pyproject.toml`` declares); the strategy
refuses to fit under any other version.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from types import FrameType
from typing import Any, Optional, Union, cast

import lightning
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.fabric.utilities.distributed import (
    DistributedSamplerWrapper,
    _distributed_is_initialized,
    _set_num_threads_if_needed,
)
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar, Timer, TQDMProgressBar
from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook, _sync_module_states
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.ddp import default_pg_timeout
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.connectors.signal_connector import _HandlersCompose
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _update_dataloader
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.nn import Module
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

from lightning_elche import job_store
from lightning_elche.augment import AugmentedDataset
from lightning_elche.config import Dispatch, ElCheConfig
from lightning_elche.dispatch import ChunkCounter, ElCheSampler, build_sampler
from lightning_elche.job_store import JobStoreLink
from lightning_elche.rounds import StopRequest

SUPPORTED_LIGHTNING = ">=2.6,<2.7"
"""The Lightning versions whose internals this module is written against (as in pyproject.toml)."""
_SUPPORTED_RANGE = ((2, 6), (2, 7))

SigtermHandler = Callable[[int, Optional[FrameType]], Any]


def check_lightning_version(version: str = lightning.__version__) -> None:
    """Refuse a Lightning version outside :data:`SUPPORTED_LIGHTNING`, naming both."""
    match = re.match(r"(\d+)\.(\d+)", version)
    low, high = _SUPPORTED_RANGE
    if match is None or not low <= (int(match[1]), int(match[2])) < high:
        raise RuntimeError(
            f"lightning-elche supports lightning{SUPPORTED_LIGHTNING}; this environment has lightning {version}. "
            "ElCheStrategy adapts Lightning's fit loop internals, which change between minor versions: "
            f"install lightning{SUPPORTED_LIGHTNING}."
        )


# -- Lightning's private helpers, under public names ------------------------------------------


def distributed_is_initialized() -> bool:
    return _distributed_is_initialized()


def sync_module_states(module: Module) -> None:
    """Broadcast rank 0's parameters and buffers, as DistributedDataParallel's constructor does."""
    _sync_module_states(module)


def with_training_sampler(dataloader: DataLoader, sampler: ElCheSampler) -> DataLoader:
    """``dataloader`` rebuilt around ``sampler``, the way Lightning re-instantiates loaders."""
    return _update_dataloader(dataloader, sampler, mode=RunningStage.TRAINING)


# -- reads of Lightning's private state --------------------------------------------------------


def train_dataloader_count(trainer: Trainer) -> int:
    """How many training DataLoaders the fit loop combined."""
    loader = trainer.fit_loop._combined_loader
    return len(loader.flattened) if loader is not None else 0


def next_epoch(trainer: Trainer) -> int:
    """The epoch the fit loop runs next (the counter ``set_epoch`` uses)."""
    return int(trainer.fit_loop.epoch_progress.current.processed)  # type: ignore[attr-defined]  # a _StartedTracker


def can_stop_early(trainer: Trainer) -> bool:
    """Whether Lightning would honour ``should_stop`` now (``min_epochs`` reached)."""
    return bool(trainer.fit_loop._can_stop_early)


def skip_validation_after_this_batch(trainer: Trainer) -> None:
    """Let this batch end without the validation Lightning starts after a ``should_stop`` set mid-epoch.

    ElChe stops a fit at its step budget with ``should_stop``; Lightning's own ``max_steps`` ends the
    epoch loop without validating (unless the epoch ended too), and so must the budget's stop."""
    trainer.fit_loop.epoch_loop._skip_next_val = True


def timer_step_duration(timer: Timer) -> Optional[Any]:
    """The duration of a ``Timer`` that checks after every training step (None otherwise; a zero
    duration checks, and broadcasts, after every step too)."""
    return timer._duration if timer._interval == "step" and timer._duration is not None else None


def checkpoint_step_triggers(callback: ModelCheckpoint) -> tuple[Optional[int], Optional[Any]]:
    """A ``ModelCheckpoint``'s per-step triggers: ``every_n_train_steps`` and ``train_time_interval``."""
    return callback._every_n_train_steps, callback._train_time_interval


def uses_sync_batchnorm(strategy: Any) -> bool:
    """``Trainer(sync_batchnorm=True)`` gave the strategy a layer-sync plugin."""
    return getattr(strategy, "_layer_sync", None) is not None


def logged_callback_metrics(trainer: Trainer) -> dict[str, Any]:
    """The "callback" metrics of the loop that logged last (inside ``on_validation_end``: validation's)."""
    return dict(trainer._logger_connector.metrics["callback"])


def monitor_candidates(callback: ModelCheckpoint, trainer: Trainer) -> dict[str, Any]:
    """``ModelCheckpoint``'s own candidates for ``filename`` and ``monitor`` (its base method)."""
    return ModelCheckpoint._monitor_candidates(callback, trainer)


def save_checkpoint_now(callback: ModelCheckpoint, trainer: Any) -> None:
    """Save as ``ModelCheckpoint`` does at its own triggers: the top-k and the ``last`` file.
    ``trainer``: the Trainer or a view of it (``cohort_callbacks.CohortTrainerView``)."""
    candidates = callback._monitor_candidates(trainer)
    callback._save_topk_checkpoint(trainer, candidates)
    callback._save_last_checkpoint(trainer, candidates)


def ddp_model_averager(strategy: Any) -> Optional[Any]:
    """The ``PeriodicModelAverager`` of a ``DDPStrategy`` with post-local SGD (bench comparison arm)."""
    return strategy._model_averager


def register_ddp_comm_hook(strategy: Any) -> None:
    """Register the communication hook a ``DDPStrategy`` was built with on its wrapped model
    (bench comparison arm; Lightning does it itself on CUDA only)."""
    _register_ddp_comm_hook(
        model=strategy.model, ddp_comm_state=strategy._ddp_comm_state, ddp_comm_hook=strategy._ddp_comm_hook
    )


# -- data --------------------------------------------------------------------------------------


def default_group_store() -> dist.Store:
    """The store the default process group was set up on."""
    return dist.distributed_c10d._get_default_store()


def sampler_for(dataloader: DataLoader, config: ElCheConfig, rank: int, world_size: int, key_prefix: str,
                chunk_batches: int) -> ElCheSampler:
    """The ElChe sampler that replaces ``dataloader``'s, keeping its shuffle, seed and batching.

    Raises ``TypeError`` for what cannot be dispatched by speed: an ``IterableDataset``, a custom
    sampler or batch sampler.
    """
    if isinstance(dataloader.dataset, IterableDataset):
        raise TypeError(
            "ElCheStrategy cannot dispatch an IterableDataset: it hands out sample indices by "
            "throughput. Use a map-style Dataset."
        )
    if dataloader.batch_sampler is not None and type(dataloader.batch_sampler).__name__ != "BatchSampler":
        raise TypeError(
            f"ElCheStrategy cannot honour a custom batch_sampler ({type(dataloader.batch_sampler).__name__}): "
            "it assigns batches to ranks by speed. Use batch_size with the default batching."
        )
    sampler = dataloader.sampler
    if isinstance(sampler, DistributedSampler) and type(sampler) is DistributedSampler:
        shuffle, seed = sampler.shuffle, sampler.seed
    elif isinstance(sampler, (RandomSampler, SequentialSampler)):
        shuffle, seed = isinstance(sampler, RandomSampler), 0
    else:
        raise TypeError(
            f"ElCheStrategy cannot honour a custom sampler ({user_sampler_name(sampler)}): it assigns "
            "samples to ranks by speed. Use shuffle=True/False in the DataLoader."
        )
    assert dataloader.batch_size is not None
    dispatch = config.run_mode.dispatch
    # The pool claims through the store; the own-stream splits use it only when ranks join mid-epoch.
    # (A Store has append at run time; torch's stub lacks it.)
    store = (cast(ChunkCounter, default_group_store()) if dispatch is Dispatch.POOL or distributed_is_initialized()
             else None)
    dataset = dataloader.dataset
    if isinstance(dataset, AugmentedDataset):
        samples, augment = dataset.base_len, dataset.augment
    else:
        samples, augment = len(dataset), 1  # type: ignore[arg-type]  # a map-style Dataset has __len__
    return build_sampler(
        dispatch,
        samples,
        dataloader.batch_size,
        rank,
        world_size,
        shuffle=shuffle,
        seed=seed,
        counter=store,
        key_prefix=key_prefix,
        partition_ratios=config.partition_ratios,
        max_chunk_batches=chunk_batches,
        drop_last=dataloader.drop_last,
        augment=augment,
        pick_keys=isinstance(dataset, AugmentedDataset),
    )


def user_sampler_name(sampler: Any) -> str:
    """The class name of the sampler the user passed: Lightning wraps a custom sampler in a
    ``DistributedSamplerWrapper`` under a distributed strategy, which is not what the user wrote."""
    if type(sampler) is DistributedSamplerWrapper:
        sampler = sampler.dataset._sampler  # type: ignore[attr-defined]  # a _DatasetSamplerWrapper
    return type(sampler).__name__


def check_step_schedulers(trainer: Trainer) -> None:
    """Refuse step-interval LR schedulers with ``frequency != 1`` (they follow the cohort step one
    step at a time)."""
    for config in trainer.lr_scheduler_configs:
        if config.interval == "step" and config.frequency != 1:
            raise MisconfigurationException(
                f"ElCheStrategy cannot run a step-interval LR scheduler with frequency={config.frequency}: "
                "schedulers follow the cohort step (all ranks' steps) and are advanced one step at a time. "
                "Use frequency=1 and fold the factor into the schedule."
            )


class LightningPatches:
    """Every change ElChe makes to Lightning's objects during one fit, each with its undo.

    :meth:`undo` (the strategy's ``teardown``) restores them in reverse order; a patch is never
    left behind after the fit, so the Trainer can fit again or run another strategy.
    """

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()

    def replace_hook(self, callback: Any, name: str, hook: Callable[..., Any]) -> None:
        """Give one callback object its own ``name`` hook (Lightning calls ``getattr(callback, name)``)."""
        setattr(callback, name, hook)
        self._undo.append(lambda: vars(callback).pop(name, None))  # back to the class's method

    def take_over_max_steps(self, trainer: Trainer) -> None:
        """Hide ``max_steps`` from the epoch loop; the strategy enforces it as the cohort's budget.

        Lightning would stop each rank at its own ``global_step``; ElChe counts the steps of all
        ranks and stops every rank together at the first sync past the budget. Called after
        ``configure_optimizers``, which therefore still sees the user's ``max_steps``.
        """
        epoch_loop = trainer.fit_loop.epoch_loop
        if epoch_loop.max_steps in (None, -1):
            return
        budget = epoch_loop.max_steps
        epoch_loop.max_steps = -1

        def restore() -> None:
            epoch_loop.max_steps = budget

        self._undo.append(restore)

    def report_cohort_batches(self, trainer: Trainer, sampler: Callable[[], Optional[ElCheSampler]]) -> None:
        """Make ``trainer.num_training_batches`` the epoch's batches over all ranks.

        A rank's share of an epoch is decided while it trains, so the loader has no length and
        Lightning would report infinitely many batches: ``trainer.estimated_stepping_batches``
        would fall back to ``max_steps`` (-1), and a OneCycleLR sized from it would fail.
        Step-interval schedulers follow the cohort step, whose count per epoch is known, so that
        is the number to report. The loader itself stays unsized: Lightning's fetcher then looks
        one batch ahead to find each rank's last batch.
        """
        fit_loop = trainer.fit_loop
        setup_data = fit_loop.setup_data

        def setup_data_with_cohort_batches() -> None:
            setup_data()
            current = sampler()
            if current is not None and math.isinf(fit_loop.max_batches):
                fit_loop.max_batches = current.num_batches

        fit_loop.setup_data = setup_data_with_cohort_batches  # type: ignore[method-assign]
        self._undo.append(lambda: vars(fit_loop).pop("setup_data", None))  # back to the class's method

    def watch_batches(self, trainer: Trainer, after_batch_hooks: Callable[[], None],
                      on_epoch_skipped: Callable[[], None]) -> None:
        """Call ``after_batch_hooks()`` once a training batch's ``on_train_batch_end`` hooks have run
        (before an end-of-epoch validation and before the epoch loop reads ``trainer.should_stop``),
        and ``on_epoch_skipped()`` when ``on_train_batch_start`` returned -1 (Lightning then leaves
        the epoch on this rank alone). No strategy hook runs at either point, so the epoch loop's
        two methods are wrapped.
        """
        epoch_loop = trainer.fit_loop.epoch_loop
        advance, on_advance_end = epoch_loop.advance, epoch_loop.on_advance_end

        def advance_watching_for_skip(data_fetcher: Any) -> None:
            current = epoch_loop.batch_progress.current
            unstarted = current.ready - current.started  # type: ignore[attr-defined]  # a _ProcessedTracker
            try:
                advance(data_fetcher)
            except StopIteration:
                # Lightning's -1 path marks this batch ready but never starts it; a plain end of
                # data raises before the batch is ready.
                if current.ready - current.started > unstarted:  # type: ignore[attr-defined]
                    on_epoch_skipped()
                raise

        def on_advance_end_after_batch_hooks(data_fetcher: Any) -> None:
            after_batch_hooks()
            on_advance_end(data_fetcher)

        epoch_loop.advance = advance_watching_for_skip  # type: ignore[method-assign]
        epoch_loop.on_advance_end = on_advance_end_after_batch_hooks  # type: ignore[method-assign]

        def restore() -> None:
            vars(epoch_loop).pop("advance", None)
            vars(epoch_loop).pop("on_advance_end", None)

        self._undo.append(restore)

    def silence_per_step_sigterm_broadcast(self, trainer: Trainer) -> None:
        """Stop Lightning's broadcast of a SIGTERM flag before every training batch.

        That broadcast deadlocks as soon as ranks take different numbers of steps; ElChe carries
        stop requests in its own round metadata instead.
        """
        epoch_loop = trainer.fit_loop.epoch_loop
        if not hasattr(epoch_loop, "_broadcast_sigterm_tensor"):
            raise RuntimeError(
                "This Lightning version has no TrainingEpochLoop._broadcast_sigterm_tensor; "
                f"lightning-elche supports lightning{SUPPORTED_LIGHTNING}."
            )
        epoch_loop._broadcast_sigterm_tensor = lambda: None  # type: ignore[method-assign]
        self._undo.append(lambda: vars(epoch_loop).pop("_broadcast_sigterm_tensor", None))

    def route_stop_signals(self, trainer: Trainer, on_stop: Callable[[StopRequest, int], None]) -> bool:
        """Turn the signals that stop a job into ElChe stop requests now: ``on_stop(request, signum)``.

        * SIGTERM (a launcher, a scheduler or a user stopping the job): ``StopRequest.SIGTERM``.
          Lightning's own handler broadcasts on the default group and makes this rank alone raise
          at its next batch, which deadlocks uneven ranks. Whatever handler Lightning had chained
          (one the user installed before the fit), or whatever handler was installed after
          Lightning's, still runs after ``on_stop``.
        * SIGINT under torchrun or SLURM (Ctrl-C reaches every process of the job):
          ``StopRequest.SIGTERM``; run interactively, Ctrl-C keeps Lightning's behaviour.
        * SLURM's requeue signal with ``SLURMEnvironment(auto_requeue=True)`` (SIGUSR1 unless
          configured): ``StopRequest.REQUEUE``. Lightning's handler would save in the middle of a
          window at once; the save and the requeue come at the next round instead.

        The handlers only record the request (no lock, no collective). :meth:`undo` restores the
        handlers found here. Returns False outside the main thread, where Python cannot install
        handlers (Lightning's stay, and a stop signal is then not graceful).
        """
        return self._install_routes(trainer, on_stop, restore=True)

    def route_stop_signals_for_the_fit(self, trainer: Trainer, on_stop: Callable[[StopRequest, int], None],
                                       on_restored: Callable[[], None], on_unroutable: Callable[[], None]) -> None:
        """:meth:`route_stop_signals` from the moment Lightning installs its handlers (after the
        strategy's ``setup``, before the sanity check) to the moment it puts back those from before
        the fit (the end of ``Trainer._teardown``, which covers ElChe's too: undoing them in the
        strategy's ``teardown`` would bring back Lightning's broadcasting handler); then
        ``on_restored()``. ``on_unroutable()`` outside the main thread."""
        connector = trainer._signal_connector
        register, restore = connector.register_signal_handlers, connector.teardown

        def register_then_route() -> None:
            register()
            if not self._install_routes(trainer, on_stop, restore=False):
                on_unroutable()

        def restore_then_notify() -> None:
            vars(connector).pop("register_signal_handlers", None)
            vars(connector).pop("teardown", None)
            try:
                restore()
            finally:
                on_restored()

        connector.register_signal_handlers = register_then_route  # type: ignore[method-assign]
        connector.teardown = restore_then_notify  # type: ignore[method-assign]

    def _install_routes(self, trainer: Trainer, on_stop: Callable[[StopRequest, int], None], restore: bool) -> bool:
        for signum, request in stop_signal_requests(trainer).items():
            if not self._route(trainer, signum, request, on_stop, restore):
                return False
        return True

    def _route(
        self, trainer: Trainer, signum: int, request: StopRequest, on_stop: Callable[[StopRequest, int], None],
        restore: bool = True,
    ) -> bool:
        previous = signal.getsignal(signum)
        chained = _chained_handler(trainer, signum, previous) if request is StopRequest.SIGTERM else None

        def handle(received: int, frame: Optional[FrameType]) -> None:
            on_stop(request, received)
            if chained is not None:
                chained(received, frame)

        try:
            signal.signal(signum, handle)
        except ValueError:  # not the main thread
            return False

        def put_back() -> None:
            try:
                signal.signal(signum, previous)
            except ValueError:  # torn down outside the main thread: Lightning restores its own later
                pass

        if restore:
            self._undo.append(put_back)
        return True

    def check_gathered_collections(self, module: LightningModule, check: Callable[[Any], Any]) -> None:
        """Run ``LightningModule.all_gather(data)`` inside ``check(data)`` (a context manager), with
        ``data`` as Lightning converts it: Lightning gathers a collection leaf by leaf, so ranks whose
        collections differ issue different numbers of collectives; ``check`` compares them first."""
        from lightning.fabric.utilities.apply_func import convert_to_tensors

        gather = module.all_gather

        def all_gather_checked(data: Any, group: Optional[Any] = None, sync_grads: bool = False) -> Any:
            data = convert_to_tensors(data, device=module.device)
            with check(data):
                return gather(data, group=group, sync_grads=sync_grads)

        module.all_gather = all_gather_checked  # type: ignore[method-assign]
        self._undo.append(lambda: vars(module).pop("all_gather", None))


def stop_signal_requests(trainer: Trainer) -> dict[int, StopRequest]:
    """The signals ElChe routes into stop requests (see :meth:`LightningPatches.route_stop_signals`)."""
    routes = {int(signal.SIGTERM): StopRequest.SIGTERM}
    if _under_job_launcher():
        routes[int(signal.SIGINT)] = StopRequest.SIGTERM
    requeue = slurm_requeue_signal(trainer)
    if requeue is not None:
        routes[requeue] = StopRequest.REQUEUE
    return routes


def lightning_phase(trainer: Trainer) -> str:
    """Where a fit is, in Lightning's words: the hook being run and the stage
    (``on_train_end (stage train)``, ``validation_step (the sanity check)``)."""
    module = trainer.lightning_module
    hook = module._current_fx_name if module is not None else None
    stage = trainer.state.stage
    where = "the sanity check" if trainer.sanity_checking else f"stage {stage.value}" if stage else "outside a stage"
    return f"{hook} ({where})" if hook else where


def init_process_group_on_job_store(strategy: Any) -> Optional[JobStoreLink]:
    """``DDPStrategy.setup_distributed``, with the default group's store outside global rank 0.

    Lightning's ``env://`` set-up hosts the job's ``TCPStore`` inside rank 0, so that rank 0's death
    takes the store, and every survivor with it. Instead, global rank 0 starts a store host on
    MASTER_ADDR:MASTER_PORT (:mod:`lightning_elche.job_store`), every rank registers there and sets
    up the default group on the generation-0 keys. Under torchrun's agent store (which already
    lives outside the ranks) the keys are those of this restart attempt: the agent keeps one store
    for every restart, and a restarted rank could otherwise read a dead peer's address.

    Returns this process's link to the job's store; a later fit in a process whose default group
    is already set up keeps the link it has (Lightning, too, leaves such a group alone).
    """
    from lightning.fabric.utilities.distributed import _init_dist_connection
    from lightning.fabric.utilities.seed import reset_seed

    reset_seed()
    strategy.set_world_ranks()
    strategy._process_group_backend = strategy._get_process_group_backend()
    if dist.is_initialized():
        return job_store.current_link()
    environment = strategy.cluster_environment
    timeout = strategy._timeout if strategy._timeout is not None else default_pg_timeout
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True):
        client = job_store.connect(environment.main_address, environment.main_port, timeout)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        link = job_store.join(dist.PrefixStore(f"/lightning_elche/attempt{attempt}", client), strategy.global_rank)
    else:
        link = job_store.open_job_store(environment.main_address, environment.main_port, strategy.global_rank,
                                        strategy.world_size, timeout)
    device = strategy.root_device
    _init_dist_connection(environment, strategy._process_group_backend, timeout=timeout,
                          store=link.default_group_store(), device_id=device if device.type != "cpu" else None)
    return link


def configure_launcher(strategy: Any, tolerates_loss: Callable[[], bool]) -> None:
    """``DDPStrategy._configure_launcher``, with a popen launcher that spares the survivors of a loss.

    Lightning's popen launcher (the default for ``devices=N``) kills every rank as soon as one
    child exits non-zero; :class:`TolerantSubprocessLauncher` only reports such an exit while
    ``tolerates_loss()``. The ``spawn``/``fork`` start methods keep Lightning's launcher, whose
    ``torch.multiprocessing`` context ends every process when one fails.
    """
    if strategy._start_method != "popen":
        DDPStrategy._configure_launcher(strategy)
        return
    assert strategy.cluster_environment is not None
    strategy._launcher = TolerantSubprocessLauncher(strategy.cluster_environment, strategy.num_processes,
                                                    strategy.num_nodes, tolerates_loss)


class TolerantSubprocessLauncher(_SubprocessScriptLauncher):
    """Lightning's popen launcher with an observer that lets survivors live (see :class:`ChildObserver`).

    The children are started exactly as Lightning starts them: subprocesses of rank 0, in its
    session and process group (Ctrl-C still reaches every rank), without a parent-death signal,
    so that rank 0's death does not take them down.
    """

    def __init__(self, cluster_environment: ClusterEnvironment, num_processes: int, num_nodes: int,
                 tolerates_loss: Callable[[], bool]) -> None:
        super().__init__(cluster_environment, num_processes, num_nodes)
        self.tolerates_loss = tolerates_loss

    def launch(self, function: Callable, *args: Any, trainer: Optional[Trainer] = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            ChildObserver(self.procs, os.getpid(), self.tolerates_loss).start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)


class ChildObserver(threading.Thread):
    """Watches the children of rank 0 for a non-zero exit.

    While ``tolerates_loss()`` a failed child is only reported, once, and never held against the
    job later; otherwise every child and rank 0 are killed, as Lightning's ``_ChildProcessObserver``
    does (a rank blocked in a collective with a dead peer would hang). The tolerance is read when
    the exit is seen, at most ``period_s`` after it.
    """

    def __init__(self, children: list[subprocess.Popen], main_pid: int, tolerates_loss: Callable[[], bool],
                 period_s: float = 1.0) -> None:
        super().__init__(daemon=True, name="elche-child-observer")  # ends with rank 0
        self.children = children
        self.main_pid = main_pid
        self.tolerates_loss = tolerates_loss
        self.period_s = period_s
        self.tolerated: set[int] = set()

    def run(self) -> None:
        while True:
            time.sleep(self.period_s)
            if self.check():
                return

    def check(self) -> bool:
        """Look at every child once; returns True when there is nothing left to watch."""
        for index, child in enumerate(self.children):
            code = child.poll()
            if code is None or code == 0 or index in self.tolerated:
                continue
            local_rank = index + 1
            if self._tolerating():
                self.tolerated.add(index)
                rank_zero_warn(f"The process of local rank {local_rank} (pid {child.pid}) exited with code {code}; "
                               "ElCheStrategy tolerates the loss: the other ranks go on.")
                continue
            rank_zero_warn(f"The process of local rank {local_rank} (pid {child.pid}) exited with code {code}. "
                           "Killing every other rank (as Lightning's launcher does): the job does not tolerate "
                           "the loss of a rank now.")
            for other in self.children:
                other.send_signal(signal.SIGKILL)
            os.kill(self.main_pid, signal.SIGKILL)
            return True
        return all(child.returncode is not None for child in self.children)

    def _tolerating(self) -> bool:
        try:
            return bool(self.tolerates_loss())
        except Exception:  # noqa: BLE001 (a broken answer must not keep a doomed job alive)
            return False


def _under_job_launcher() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "SLURM_JOB_ID" in os.environ


def slurm_requeue_signal(trainer: Trainer) -> Optional[int]:
    """The signal of ``SLURMEnvironment(auto_requeue=True)``, or None when the job does not requeue."""
    environment = getattr(trainer.strategy, "cluster_environment", None)
    if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
        return int(environment.requeue_signal) if environment.requeue_signal is not None else None
    return None


def save_and_requeue_slurm_job(trainer: Trainer, signum: int) -> str:
    """Lightning's own requeue: finalize the loggers, save the HPC checkpoint (which a requeued job
    resumes from by itself) and, on global rank 0, ``scontrol requeue`` the job. Returns the path.
    Every rank calls it, at the same point."""
    path = trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)
    trainer._signal_connector._slurm_sigusr_handler_fn(signum, None)  # type: ignore[arg-type]
    return path


def _chained_handler(
    trainer: Trainer, signum: int, current: Union[SigtermHandler, int, None]
) -> Optional[SigtermHandler]:
    # Lightning's composite handler: keep what it chained (the handler from before the fit), not
    # its own notifier (the per-rank broadcast and flag that ElChe replaces).
    if isinstance(current, _HandlersCompose):
        connector = getattr(trainer, "_signal_connector", None)
        original = getattr(connector, "_original_handlers", {}).get(signum)
        return original if callable(original) and not isinstance(original, _HandlersCompose) else None
    if callable(current) and current is not signal.default_int_handler:
        return current
    return None


# -- after a lost rank: the survivors' view -------------------------------------------------------


def reopen_training_epoch(trainer: Trainer, before: Callable[[], None]) -> bool:
    """Iterate the training DataLoader again within the current epoch (the sampler continues the
    epoch with re-dispatched work); whether a batch came. ``before`` runs first (the sampler's
    ``reopen``). Call only at the rank's last batch, when the fetcher holds nothing more of the old
    iterator.

    Lightning's fetcher looks one batch ahead to find the last batch; it is rewound to the new
    iterator with that look-ahead refilled, and the epoch loop's last-batch flag is cleared so
    that the loop runs on."""
    from lightning.pytorch.loops.fetchers import _DataFetcher, _PrefetchDataFetcher

    fetcher = trainer.fit_loop._data_fetcher
    if not isinstance(fetcher, _PrefetchDataFetcher) or fetcher.batches:
        return False
    before()
    fetcher.iterator = iter(fetcher.combined_loader)
    try:
        fetcher.batches.append(_DataFetcher.__next__(fetcher))
    except StopIteration:
        fetcher.done = True
        return False
    fetcher.done = False
    trainer.fit_loop.epoch_loop.batch_progress.is_last_batch = False
    return True


class LightningRankView:
    """Lightning's rank-dependent state as a holder of a membership change: rank-zero-only logging,
    the progress bar and the evaluation loaders follow the rank's new number (``rank()``; the
    strategy's ``global_rank`` and ``world_size`` already answer it)."""

    def __init__(self, trainer: Trainer, rank: Callable[[], int]) -> None:
        self.trainer = trainer
        self.rank = rank

    def apply_change(self, change: Any) -> None:
        renumber_lightning_ranks(self.trainer, self.rank())


def renumber_lightning_ranks(trainer: Trainer, global_rank: int) -> None:
    """After a regroup: rank-zero-only logging, the progress bar and the evaluation loaders follow
    the rank's new number (``strategy.global_rank``/``world_size`` already answer it)."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
    from lightning.pytorch.utilities.rank_zero import rank_zero_only
    from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

    for rank_zero_only_fn in (rank_zero_only, fabric_rank_zero_only, utils_rank_zero_only):
        rank_zero_only_fn.rank = global_rank  # type: ignore[attr-defined]  # set by Lightning, read by every rank_zero_*
    bar = trainer.progress_bar_callback
    if global_rank == 0 and isinstance(bar, (RichProgressBar, TQDMProgressBar)) and bar.is_disabled:
        # Lightning disabled it at setup on every rank but 0: the new rank 0 shows it from here on,
        # with the display the bar builds when training starts.
        bar.enable()
        if isinstance(bar, RichProgressBar):
            bar._init_progress(trainer)
        elif isinstance(bar, TQDMProgressBar):
            bar.train_progress_bar = bar.init_train_tqdm()
            total = bar.total_train_batches
            bar.train_progress_bar.total = total if math.isfinite(total) else None
    # Validation shards were cut for the old ranks (DistributedSampler): cut them again for the new.
    trainer.fit_loop.epoch_loop.val_loop._combined_loader = None


def process_group_timeout(strategy: Any) -> Optional[timedelta]:
    """The collective timeout the user gave the strategy (``DDPStrategy(timeout=...)``)."""
    return strategy._timeout
