"""A fit's stop signals, wired: routed into stop requests, and bounded by the stop watchdog.

:func:`guard_stops` is what the strategy installs at set-up (:mod:`lightning_elche.stop_signals`
has the watchdog and the grace; :mod:`lightning_elche.loop_glue` the routes into Lightning's signal
connector). A signal is only recorded as a stop request, which every rank acts on at its next
round; the watchdog, woken by the same signal, passes a SIGTERM on to the ranks the popen launcher
started (as Lightning's own handler does), and ends the process once the grace is spent.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any, Optional

from lightning.pytorch import Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_elche.job_store import JobStoreLink, mark_exited
from lightning_elche.loop_glue import LightningPatches, lightning_phase, stop_signal_requests
from lightning_elche.rounds import StopRequest
from lightning_elche.stop_checkpoint import unsaved_note
from lightning_elche.stop_signals import StopWatchdog, grace_for


def guard_stops(strategy: Any, trainer: Trainer, patches: LightningPatches,
                request_stop: Callable[[StopRequest], Any]) -> StopWatchdog:
    """Install the fit's stop-signal routes and watchdog for ``strategy`` (an ``ElCheStrategy``);
    ``request_stop`` records a signal's request for the next round."""

    def forward(signum: int) -> None:
        if signum == signal.SIGTERM and strategy.launcher is not None:
            strategy.launcher.kill(signum)

    def report() -> str:
        return f"Rank {strategy.global_rank} was in {lightning_phase(trainer)}. {unsaved_note(trainer)}"

    watchdog = StopWatchdog(lambda: grace_for(strategy.stop_grace, strategy.engine), report,
                            forward=forward, on_exit=lambda message: mark_stopped(strategy.job_store_link, message))
    if not watchdog.listen({*stop_signal_requests(trainer), int(signal.SIGINT)}):
        rank_zero_warn("ElCheStrategy: outside the main thread a stop signal is not bounded by stop_grace.")
    patches.route_stop_signals_for_the_fit(
        trainer, lambda request, signum: request_stop(request), on_restored=watchdog.stop_listening,
        on_unroutable=lambda: rank_zero_warn(
            "ElCheStrategy could not install its stop-signal handlers outside the main thread."))
    return watchdog


def mark_stopped(link: Optional[JobStoreLink], message: str) -> None:
    """Record in the job's registry that this rank ends with ``message`` (the watchdog's exit)."""
    if link is not None:
        # On a connection of its own: the main thread may hold the link's.
        store = link.store.clone() if hasattr(link.store, "clone") else link.store
        mark_exited(store, link.rank, message[:2000])
