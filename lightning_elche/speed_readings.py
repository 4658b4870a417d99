"""Each rank's recent speed readings (ms per batch), as the cadence controller trusts them.

A rank's first reading (of the fit, or after its readings were cleared) covers its warm-up (lazy
initialization, allocator and kernel caches, the first batches' data loading): it plans the next
window, then the rank's second reading replaces it. Averaged in instead, it made a fast rank look
slower than it is for a whole trust window. A rank silent for a whole trust window re-learns
from scratch when it returns.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Optional

from lightning_elche.membership.change import Change

TRUST_WINDOW_CAP = 5
"""Readings kept per rank; also the number of consecutive missing readings that clears them."""


class SpeedReadings:
    """The last :data:`TRUST_WINDOW_CAP` ms/batch readings of each rank, by rank."""

    def __init__(self, world_size: int) -> None:
        self._windows: list[deque[float]] = [deque(maxlen=TRUST_WINDOW_CAP) for _ in range(world_size)]
        self._missed: list[int] = [0] * world_size  # consecutive reports without a reading
        self._warmup: list[bool] = [False] * world_size  # the only reading is the warm-up one

    def __len__(self) -> int:
        return len(self._windows)

    def ingest(self, wall_ms: Sequence[float], batches: Sequence[int]) -> None:
        """One report: rank r ran ``batches[r]`` batches in ``wall_ms[r]``; a rank with no batches
        or no positive finite wall gives no reading."""
        for rank, window in enumerate(self._windows):
            wall = float(wall_ms[rank])
            count = batches[rank]
            if count > 0 and wall > 0.0 and math.isfinite(wall):
                if self._warmup[rank]:
                    window.clear()
                    self._warmup[rank] = False
                elif not window:
                    self._warmup[rank] = True
                window.append(wall / count)
                self._missed[rank] = 0
                continue
            self._missed[rank] += 1
            if self._missed[rank] >= TRUST_WINDOW_CAP:
                window.clear()
                self._warmup[rank] = False

    def mean(self, rank: int) -> Optional[float]:
        """Mean ms/batch of ``rank``'s readings; None when it has none."""
        window = self._windows[rank]
        return sum(window) / len(window) if window else None

    def silent_for_trust_window(self, rank: int) -> bool:
        """``rank`` gave no reading in the last :data:`TRUST_WINDOW_CAP` reports."""
        return self._missed[rank] >= TRUST_WINDOW_CAP

    def any(self) -> bool:
        return any(self._windows)

    def restart(self, means: Sequence[Optional[float]]) -> None:
        """Each rank's readings restart as one steady reading equal to ``means[rank]`` (a resumed
        checkpoint's; None or 0: no reading)."""
        if len(means) != len(self._windows):
            raise ValueError(f"SpeedReadings.restart() needs one mean per rank ({len(self._windows)}), "
                             f"got {len(means)}.")
        self._missed = [0] * len(self._windows)
        self._warmup = [False] * len(self._windows)  # a saved mean is a steady reading
        for window, mean in zip(self._windows, means, strict=True):
            window.clear()
            if mean is not None and mean > 0.0:
                window.append(mean)

    def apply_change(self, change: Change) -> None:
        """The survivors keep their readings in their new order; a joiner has none."""
        self._windows = change.carry(self._windows, lambda: deque(maxlen=TRUST_WINDOW_CAP))
        self._missed = change.carry(self._missed, lambda: 0)
        self._warmup = change.carry(self._warmup, lambda: False)
