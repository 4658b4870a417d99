"""Timing of compute windows and of the accelerator's stall at each sync, without per-step syncs."""

from __future__ import annotations

import time
from typing import Optional

import torch


class WindowClock:
    """Times each compute window (between two syncs) and the device's stall at each sync.

    On CPU it is host wall time. On CUDA:

    * blocking modes (``synchronize=True``) synchronize the current stream once at the window's
      end, so the window time is real device time (the round blocks anyway);
    * non-blocking ``cpu_async`` (``synchronize=False``) never synchronizes: CUDA events bracket
      each window and each sync, and their times are read one window later, when they have
      completed. The stall of a sync is the device time between the last work of one window and
      the first of the next (``stall_ms``), the cost the CPU plane must keep small.
    """

    def __init__(self, device: torch.device, synchronize: bool = True) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.synchronize = synchronize or not self.cuda
        self._window_start = time.perf_counter()
        self._excluded = 0.0
        self._start_event: Optional[torch.cuda.Event] = None
        self._pending: Optional[tuple[torch.cuda.Event, torch.cuda.Event, float, int]] = None
        self._seconds_per_step: Optional[float] = None
        self._sync_start: Optional[torch.cuda.Event] = None
        self._stall_pending: Optional[tuple[torch.cuda.Event, torch.cuda.Event]] = None
        self.last_stall_ms: Optional[float] = None

    def _event(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def restart_window(self, after_sync: bool = True) -> None:
        """Start timing a window. ``after_sync=False`` (a new epoch, or a blocking round) does
        not count the gap before it as a sync's stall: validation or a wait happened there."""
        self._window_start = time.perf_counter()
        self._excluded = 0.0
        if self.cuda and not self.synchronize:
            self._start_event = self._event()
            if self._sync_start is not None and after_sync:
                self._stall_pending = (self._sync_start, self._start_event)
            self._sync_start = None

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` spent waiting inside the window out of its compute time."""
        self._excluded += seconds

    def close_window(self, steps: int = 1) -> float:
        """Seconds of compute in the window that ends now, which took ``steps`` steps.

        Without a boundary sync, the device time of a window is known only once its events have
        completed, a window later; the value returned is then the latest measured device time
        per step times ``steps``, so the controller always sees a consistent per-step cost.
        """
        host = max(0.0, time.perf_counter() - self._window_start - self._excluded)
        if self.synchronize:
            if self.cuda:
                torch.cuda.current_stream(self.device).synchronize()
                host = max(0.0, time.perf_counter() - self._window_start - self._excluded)
            return host
        end = self._event()
        self._sync_start = end
        self._read_stall()
        # The previous window's events have almost surely completed by now.
        previous, self._pending = self._pending, None
        if self._start_event is not None:
            self._pending = (self._start_event, end, self._excluded, steps)
        if previous is not None and previous[1].query() and previous[3] > 0:
            start, stop, excluded, previous_steps = previous
            self._seconds_per_step = max(0.0, start.elapsed_time(stop) / 1000.0 - excluded) / previous_steps
        if self._seconds_per_step is None:
            return host
        return self._seconds_per_step * steps

    def _read_stall(self) -> None:
        if self._stall_pending is not None and self._stall_pending[1].query():
            begin, end = self._stall_pending
            self.last_stall_ms = begin.elapsed_time(end)
            self._stall_pending = None
