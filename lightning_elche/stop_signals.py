"""Stop signals that always end the process: a bounded grace, then an exit; a second signal at once.

ElChe honours a stop signal (SIGTERM, SIGINT, SLURM's requeue signal) at the next round: every
rank saves the consensus and exits with ``128 + signum`` (:mod:`lightning_elche.session`). A rank
that never reaches a round (an endless loop in user code, a collective that cannot complete, a
hung hook or save) would ignore the signal. :class:`StopWatchdog` bounds that wait: when the
stop has not ended the process within the grace (:func:`stop_grace_s`: a few measured windows
plus the sync time, never below a floor, or ``ElCheStrategy(stop_grace=...)``), it writes why,
marks the rank exited in the job's registry, flushes the logs and ends the process with
``128 + signum``. A second stop signal ends it at once.

The signal path takes no lock and runs no collective. Python runs a signal handler only between
bytecodes of the main thread, so a main thread blocked inside a C call (a gloo or NCCL wait, a
blocking read) never runs it; but Python's C-level handler writes the signal's number at once to
the file descriptor given to :func:`signal.set_wakeup_fd`, whatever the main thread is doing. The
watchdog's thread reads that pipe: the C handler writes one byte, the Python handler (ElChe's,
installed by ``loop_glue``) only records the stop for the next round.

Nothing is saved when the grace expires: the parameters in memory are then one rank's replica
(mid-window, or in the middle of a hook), and the main thread may be writing them; a consistent
copy of the last consensus would cost a parameter-sized buffer on every rank for the whole fit.
The message names the newest checkpoint on disk instead.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Optional

from lightning_elche.checks import invalid

log = logging.getLogger(__name__)

STOP_GRACE_FLOOR = timedelta(seconds=30)
"""The shortest derived grace: time for the next round and the save of the stop's checkpoint."""
GRACE_WINDOWS = 3
"""Windows in the derived grace: the stop rides the next round (one window at most), ``cpu_async``
acts on it one round later (its in-flight round is not a consensus), and one window of slack."""
GRACE_SYNCS = 2
"""Rounds in the derived grace (their measured duration), for the same two rounds."""
REPEAT_WINDOW_S = 1.0
"""A stop signal within this long of the first is the same stop: one signal that reached the
process twice (sent to the process group and forwarded by a launcher), not a second request."""
_BOUNDED_STEP_S = 2.0  # the longest the exit waits for the registry mark, and for the log flush
_WAKE = 0  # the byte that wakes the watchdog's thread (no signal has number 0)


def resolve_stop_grace(value: Any) -> Optional[timedelta]:
    """``ElCheStrategy(stop_grace=...)`` checked: None (derived from the measured window) or a
    positive timedelta (used as it is, floor included)."""
    if value is None:
        return None
    if not isinstance(value, timedelta) or value.total_seconds() <= 0:
        raise invalid(
            f"ElCheStrategy(stop_grace={value!r})",
            f"expected None (derived from the measured window, at least {STOP_GRACE_FLOOR.total_seconds():.0f} s) "
            "or a positive timedelta: how long a stop signal may wait for a sync before the process ends anyway",
        )
    return value


def stop_grace_s(window_s: Optional[float], sync_s: Optional[float],
                 floor_s: float = STOP_GRACE_FLOOR.total_seconds()) -> float:
    """The derived grace: ``GRACE_WINDOWS`` windows and ``GRACE_SYNCS`` rounds, at least ``floor_s``.

    ``window_s`` is the longest planned window of any rank, ``sync_s`` the longest round
    duration, both measured (None before the first round: the floor alone).
    """
    measured = 0.0
    if window_s is not None and window_s > 0:
        measured += GRACE_WINDOWS * window_s
    if sync_s is not None and sync_s > 0:
        measured += GRACE_SYNCS * sync_s
    return max(floor_s, measured)


def grace_for(stop_grace: Optional[timedelta], engine: Optional[Any]) -> float:
    """The grace in seconds: ``stop_grace`` as given, else :func:`stop_grace_s` from the engine's
    measurements (the controller's planned window of each rank at its measured speed, and the
    longest round of the last outcome)."""
    if stop_grace is not None:
        return stop_grace.total_seconds()
    window_s = sync_s = None
    if engine is not None:
        controller = engine.controller
        window_s = max(controller.smoothed_ms(rank) * controller.batch_counts[rank]
                       for rank in range(controller.world_size)) / 1000.0
        outcome = engine.last_outcome
        if outcome is not None and outcome.reports:
            sync_s = max(report.last_sync_s for report in outcome.reports)
    return stop_grace_s(window_s, sync_s)


def exit_status(signum: int) -> int:
    """The shell's status of a process ended by ``signum``: what launchers and retry loops expect."""
    return 128 + signum


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _run_bounded(step: Callable[[], Any], timeout_s: float) -> None:
    """Run ``step`` in a daemon thread and wait ``timeout_s`` at most: the exit must not hang on it
    (the store's or a log handler's lock may be held by a main thread that will never let go)."""
    def guarded() -> None:
        try:
            step()
        except Exception:  # noqa: BLE001 (best effort on the way out)
            pass

    thread = threading.Thread(target=guarded, name="elche-stop-exit", daemon=True)
    thread.start()
    thread.join(timeout_s)


def _flush_logs() -> None:
    loggers = [logging.getLogger()] + [
        item for item in logging.Logger.manager.loggerDict.values() if isinstance(item, logging.Logger)
    ]
    for logger in loggers:
        for handler in logger.handlers:
            handler.flush()
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()


class StopWatchdog:
    """Ends the process when a stop signal is not honoured within its grace, or at a second signal.

    Args:
        grace_s: the grace, asked when the first stop signal arrives (and again when the stop's own
            save starts, which re-arms it once: a large checkpoint may take its time).
        describe: where the rank is and what is saved, for the message on the way out.
        forward: called with the signal number when a stop signal arrives (first or second; not a
            repeat within :data:`REPEAT_WINDOW_S`): the launcher passes it on to the ranks it started.
        on_exit: called with the message just before the exit (the registry's mark), in a bounded thread.
        end_process: how the process ends (tests pass a recorder); ``os._exit`` skips the
            interpreter's teardown, which may itself wait on a hung collective.
    """

    def __init__(
        self,
        grace_s: Callable[[], float],
        describe: Callable[[], str] = lambda: "",
        forward: Callable[[int], None] = lambda signum: None,
        on_exit: Callable[[str], None] = lambda message: None,
        end_process: Callable[[int], Any] = os._exit,
    ) -> None:
        self._grace_s = grace_s
        self._describe = describe
        self._forward = forward
        self._on_exit = on_exit
        self._end_process = end_process
        self.stop_signals: frozenset[int] = frozenset()
        self.signum: Optional[int] = None
        """The first stop signal (None until one arrived)."""
        self.deadline: Optional[float] = None
        """``time.monotonic()`` at which the process ends (None until a stop signal arrived)."""
        self.ended_with: Optional[int] = None
        """The exit status the watchdog ended the process with (a recorder's ``end_process`` returns)."""
        self._first_at = 0.0
        self._rearmed = False
        self._saving = False
        self._exit_after_save = False
        self._pipe: Optional[tuple[int, int]] = None
        self._previous_fd = -1
        self._closing = False
        self._given_back = False
        self._closed = False
        self._close_lock = threading.Lock()  # never taken in the signal path
        self._thread: Optional[threading.Thread] = None

    @property
    def listening(self) -> bool:
        return self._pipe is not None and not self._closing

    # -- the main thread's side ----------------------------------------------------------------

    def listen(self, stop_signals: Collection[int]) -> bool:
        """Watch for ``stop_signals`` from now on. Main thread only (Python's rule for the wakeup
        fd); returns False elsewhere. Only signals with a Python handler reach the wakeup fd: one
        left at the default action ends the process by itself."""
        if threading.current_thread() is not threading.main_thread() or self._pipe is not None:
            return False
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        try:
            self._previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except ValueError:
            os.close(read_fd)
            os.close(write_fd)
            return False
        self.stop_signals = frozenset(int(s) for s in stop_signals)
        self._pipe = (read_fd, write_fd)
        self._thread = threading.Thread(target=self._run, name="elche-stop-watchdog", daemon=True)
        self._thread.start()
        return True

    def stop_listening(self) -> None:
        """Give the wakeup fd back (the end of the fit). A stop that already arrived keeps its deadline."""
        if self._pipe is None or self._closing:
            return
        write_fd = self._pipe[1]
        if threading.current_thread() is threading.main_thread():
            replaced = signal.set_wakeup_fd(self._previous_fd)
            if replaced != write_fd:  # someone set their own after ours: leave theirs
                signal.set_wakeup_fd(replaced)
            self._given_back = True
        self._closing = True
        self._wake()
        if self._thread is not None and self.deadline is None:
            self._thread.join(timeout=1.0)
        if self._thread is None or not self._thread.is_alive():
            self._close_pipe()

    def _close_pipe(self) -> None:
        # Only once the wakeup fd is given back: a closed number may be reused, and the C handler
        # would write into whatever file got it.
        with self._close_lock:
            if self._pipe is None or self._closed or not self._given_back:
                return
            self._closed = True
            for fd in self._pipe:
                os.close(fd)

    @contextmanager
    def saving(self) -> Iterator[None]:
        """The stop's own checkpoint is being written: the grace starts again (once), and a second
        signal ends the process only once the file is complete (it is written whole)."""
        if self.deadline is not None and not self._rearmed:
            self._rearmed = True
            self.deadline = max(self.deadline, time.monotonic() + self._grace_or_floor())
        self._saving = True
        try:
            yield
        finally:
            self._saving = False
            if self._exit_after_save:
                self._end("a second stop signal arrived while the stop's checkpoint was written; it is complete")

    # -- the watchdog's thread -------------------------------------------------------------------

    def _wake(self) -> None:
        if self._pipe is not None and not self._closed:
            try:
                os.write(self._pipe[1], bytes([_WAKE]))
            except OSError:  # a full pipe wakes the thread as well
                pass

    def _run(self) -> None:
        assert self._pipe is not None
        read_fd = self._pipe[0]
        while self.ended_with is None:
            timeout = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
            readable, _, _ = select.select([read_fd], [], [], timeout)
            if readable:
                received = os.read(read_fd, 512)
                self._pass_on(received)
                for signum in received:
                    if signum != _WAKE and self.ended_with is None:
                        self.on_signal(signum)
            if self.deadline is not None and time.monotonic() >= self.deadline and self.ended_with is None:
                assert self.signum is not None
                grace = self.deadline - self._first_at
                self._end(f"the stop could not be honoured at a sync within its grace of {grace:.1f} s (stop_grace)")
            if self._closing and self.deadline is None:
                break
        self._close_pipe()

    def _pass_on(self, received: bytes) -> None:
        # Whoever had the wakeup fd before the fit (an event loop) still hears its signals.
        if self._previous_fd >= 0:
            try:
                os.write(self._previous_fd, bytes(b for b in received if b != _WAKE))
            except OSError:
                pass

    def on_signal(self, signum: int) -> None:
        """A signal reached the process (the thread calls it; tests may too)."""
        if signum not in self.stop_signals:
            return
        now = time.monotonic()
        name = signal_name(signum)
        if self.signum is None:
            self.signum, self._first_at = signum, now
            grace = self._grace_or_floor()
            self.deadline = now + grace
            self._say(f"received {name}: every rank saves the consensus and stops at the next sync; if that does "
                      f"not end the process within {grace:.1f} s (stop_grace), it ends anyway with status "
                      f"{exit_status(signum)}. A second stop signal ends it at once.")
            self._pass_to_launched(signum)
            return
        if now - self._first_at < REPEAT_WINDOW_S:
            return  # the same stop through a second path
        self._pass_to_launched(signum)
        if self._saving:
            self._exit_after_save = True
            self._say(f"received {name} again: the process ends as soon as the stop's checkpoint is written.")
            return
        self._end(f"a second stop signal ({name}) arrived")

    def _grace_or_floor(self) -> float:
        try:  # read while the main thread trains on: a reading caught mid-update must not cost the stop
            return float(self._grace_s())
        except Exception:  # noqa: BLE001
            return STOP_GRACE_FLOOR.total_seconds()

    def _pass_to_launched(self, signum: int) -> None:
        try:
            self._forward(signum)
        except Exception as error:  # noqa: BLE001 (the watchdog must go on)
            self._say(f"could not pass {signal_name(signum)} on to the ranks this process launched: {error}")

    def _end(self, why: str) -> None:
        assert self.signum is not None
        status = exit_status(self.signum)
        where: list[str] = []
        _run_bounded(lambda: where.append(self._describe()), _BOUNDED_STEP_S)  # reads files and the trainer
        where = where or ["(where the rank was could not be told in time)"]
        elapsed = time.monotonic() - self._first_at
        message = (f"ending the process with status {status}, {elapsed:.1f} s after {signal_name(self.signum)}: "
                   f"{why}. {where[0]}")
        self._say(message)
        self.ended_with = status
        _run_bounded(lambda: self._on_exit(message), _BOUNDED_STEP_S)
        if log.hasHandlers():
            _run_bounded(lambda: log.warning(f"ElCheStrategy: {message}"), _BOUNDED_STEP_S)
        _run_bounded(_flush_logs, _BOUNDED_STEP_S)
        self._end_process(status)

    @staticmethod
    def _say(text: str) -> None:
        # Straight to the file descriptor: no Python lock, which a stuck main thread may hold.
        try:
            os.write(2, f"ElCheStrategy: {text}\n".encode(errors="replace"))
        except OSError:
            pass
