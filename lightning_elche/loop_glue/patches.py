"""Every change ElChe makes to Lightning's objects during a fit, with its undo."""

from __future__ import annotations

import math
import signal
from collections.abc import Callable
from types import FrameType
from typing import Any, Optional

from lightning.pytorch import LightningModule, Trainer

from lightning_elche.dispatch import ElCheSampler
from lightning_elche.loop_glue.evaluation import EvaluationRuns, run_evaluation_again_after
from lightning_elche.loop_glue.signals import chained_user_handler, stop_signal_requests
from lightning_elche.loop_glue.versions import SUPPORTED_LIGHTNING
from lightning_elche.rounds import StopRequest


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
                      on_epoch_skipped: Callable[[], None], on_no_batch: Callable[[], bool]) -> None:
        """Call ``after_batch_hooks()`` once a training batch's ``on_train_batch_end`` hooks have run
        (before an end-of-epoch validation and before the epoch loop reads ``trainer.should_stop``),
        and ``on_epoch_skipped()`` when ``on_train_batch_start`` returned -1 (Lightning then leaves
        the epoch on this rank alone). No strategy hook runs at either point, so the epoch loop's
        two methods are wrapped.

        ``on_no_batch()`` runs when the fetcher has no batch at all for this rank where the epoch
        loop asks for one (its iterator of the epoch gave nothing: a joiner admitted after the
        epoch's work was all claimed): True when work came its way (the loop fetches again),
        False when the epoch ends for it. Lightning would leave the epoch at once, without its
        epoch-end validation; the batch is taken for the epoch's last one instead, so that the
        epoch ends as on a rank at its last batch (validation, epoch-interval schedulers), but
        without what a step counts (:func:`_end_without_a_step`).
        """
        epoch_loop = trainer.fit_loop.epoch_loop
        advance, on_advance_end = epoch_loop.advance, epoch_loop.on_advance_end
        without_a_batch = [False]  # the advance just run ended the epoch without a batch

        def advance_watching_for_skip(data_fetcher: Any) -> None:
            current = epoch_loop.batch_progress.current
            without_a_batch[0] = False
            while True:
                ready = current.ready
                unstarted = ready - current.started  # type: ignore[attr-defined]  # a _ProcessedTracker
                try:
                    advance(data_fetcher)
                    return
                except StopIteration:
                    # Lightning's -1 path marks this batch ready but never starts it; a plain end of
                    # data raises before the batch is ready.
                    if current.ready - current.started > unstarted:  # type: ignore[attr-defined]
                        on_epoch_skipped()
                    if current.ready != ready or epoch_loop.batch_progress.is_last_batch:
                        raise
                if not on_no_batch():
                    epoch_loop.batch_progress.is_last_batch = True  # on_advance_end: the epoch's end
                    without_a_batch[0] = True
                    # What advance does after an epoch's last batch (fit_loop steps only the plateau ones).
                    epoch_loop.update_lr_schedulers("epoch", update_plateau_schedulers=False)
                    return

        def on_advance_end_after_batch_hooks(data_fetcher: Any) -> None:
            after_batch_hooks()
            if without_a_batch[0]:
                _end_without_a_step(epoch_loop, lambda: on_advance_end(data_fetcher))
            else:
                on_advance_end(data_fetcher)

        epoch_loop.advance = advance_watching_for_skip  # type: ignore[method-assign]
        epoch_loop.on_advance_end = on_advance_end_after_batch_hooks  # type: ignore[method-assign]

        def restore() -> None:
            vars(epoch_loop).pop("advance", None)
            vars(epoch_loop).pop("on_advance_end", None)

        self._undo.append(restore)

    def redo_evaluation_after_losses(self, trainer: Trainer, runs: EvaluationRuns) -> None:
        """Run the fit's evaluation loop (a validation epoch, the sanity check) again from its start
        when ``runs.recovered(error)`` says the error that interrupted it was survived (a lost rank
        the survivors agreed on and regrouped without): see :mod:`.evaluation`."""
        self._undo.append(run_evaluation_again_after(trainer, runs))

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
        chained = chained_user_handler(trainer, signum, previous) if request is StopRequest.SIGTERM else None

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


def _end_without_a_step(epoch_loop: Any, on_advance_end: Callable[[], None]) -> None:
    """The epoch loop's ``on_advance_end`` after an epoch this rank trained no batch of (its validation
    and logger flush), without what it counts for the batch's optimizer step, which never came:

    * the step-interval schedulers (the plateau ones: the others follow the cohort step at rounds);
    * ``_batches_that_stepped``, the step Lightning logs at: one ahead of this rank's ``global_step``,
      its epoch-end metrics would be logged one step later than its last step, as no rank at its last
      batch does, and every later row of its loggers too.
    """
    stepped, update = epoch_loop._batches_that_stepped, epoch_loop.update_lr_schedulers

    def update_unless_per_step(interval: str, update_plateau_schedulers: bool) -> None:
        if interval != "step":
            update(interval, update_plateau_schedulers=update_plateau_schedulers)

    epoch_loop.update_lr_schedulers = update_unless_per_step
    try:
        on_advance_end()
    finally:
        vars(epoch_loop).pop("update_lr_schedulers", None)  # back to the class's method
        epoch_loop._batches_that_stepped = stepped
