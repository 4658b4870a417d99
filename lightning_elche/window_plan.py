"""The arithmetic of a window plan (``elche-spec.md`` §3): each rank's batch count from its speed,
the per-update step limit, the window cap, the anchor-rank election and window-pressure growth.

Functions of numbers only. :class:`~lightning_elche.controller.ElCheController` holds the state
(readings, anchor, phase, latches) and decides when each one applies.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

COHORT_BAND = 0.15
"""A rank is an anchor candidate when its ms/batch is at least (1 - band) x the slowest rank's."""

DOMINANCE_MARGIN = 0.10
"""A challenger replaces the current anchor rank only when it is this fraction slower."""

MAX_SPEED_RATIO = 64
"""Largest slow/fast speed ratio used for batch counts (guards against a degenerate reading)."""

GROWTH_STEP_CAP = 2.0
"""Largest multiplicative anchor growth in one proposal."""

WARMUP_GROWTH_MARGIN = 2.0
"""During Warmup, growth fires only above this multiple of the overhead target."""

PLAN_IDLE_SHARE = 0.25
"""Window growth also aims for whole-batch counts that leave at most this fraction of the
overhead target idle: on many ranks each rank's count is rounded, and the longest rounded-up
window makes the others wait (4.5 % of the ideal on 32 ranks at the default anchor of 10)."""

DEAD_ZONE = 0.05
"""A rank's batch count changes only when the new target differs by more than this fraction."""

SAME_SPEED_EPS_MS = 1e-6


def round_half_away(value: float) -> int:
    """Round a non-negative number to the nearest integer, halves up (Python's round() is
    banker's rounding, which would turn a ratio of 22.5 into 22 instead of 23)."""
    floor = math.floor(value)
    return int(floor) + 1 if value - floor >= 0.5 else int(floor)


# -- batch counts -----------------------------------------------------------------------------


def rank_target(anchor: int, ms: float, slow_ms: float) -> int:
    """The count of a rank at ``ms`` per batch when the anchor rank takes ``slow_ms`` for each of
    its ``anchor`` batches (a rank without a reading, ``ms <= 0``, plans ``anchor``)."""
    if ms <= 0.0 or abs(ms - slow_ms) < SAME_SPEED_EPS_MS:
        return anchor
    return max(1, round_half_away(anchor * min(slow_ms / ms, MAX_SPEED_RATIO)))


def limit_step(current: int, target: int, step: Optional[int]) -> int:
    """``target``, moved at most ``step`` away from ``current`` (None: unlimited)."""
    if step is None:
        return target
    if target > current:
        return min(current + step, target)
    return max(current - step, target, 1)


def follow_speeds(
    counts: Sequence[int], speeds_ms: Sequence[float], slow_ms: float, anchor: int, step: Optional[int], settled: bool,
) -> list[int]:
    """Counts proportional to speed relative to the anchor rank. Once ``settled`` (calibrated), a
    count moves only beyond the dead zone and at most ``step`` per update."""
    out = list(counts)
    for rank, ms in enumerate(speeds_ms):
        target = rank_target(anchor, ms, slow_ms)
        current = out[rank]
        if abs(target - current) > current * DEAD_ZONE or not settled:
            out[rank] = limit_step(current, target, step if settled else None)
    return out


def capped(counts: Sequence[int], cap: int) -> tuple[list[int], bool]:
    """``counts`` scaled down to a total of ``cap`` (0: no cap), and whether the cap bound; the
    floor of 1 per rank wins over the cap."""
    total = sum(counts)
    if cap <= 0 or total <= cap:
        return list(counts), False
    scale = cap / total
    out = [max(1, math.floor(count * scale)) for count in counts]
    remainder = cap - sum(out)
    if remainder > 0:
        largest = max(range(len(out)), key=lambda rank: out[rank])
        out[largest] += remainder
    return out, True


def projected_spread(anchor: int, speeds_ms: Sequence[float]) -> int:
    """Fastest rank's count minus ``anchor`` at these speeds (0 without data)."""
    speeds = [ms for ms in speeds_ms if ms > 0.0]
    if not speeds:
        return 0
    fastest = max(1, round_half_away(anchor * max(speeds) / min(speeds)))
    return max(0, fastest - anchor)


# -- anchor-rank election ---------------------------------------------------------------------


def slow_cohort(speeds_ms: Sequence[float]) -> list[int]:
    """The ranks within :data:`COHORT_BAND` of the slowest (none without data)."""
    slowest = max(speeds_ms)
    if slowest <= 0.0:
        return []
    threshold = slowest * (1.0 - COHORT_BAND)
    return [rank for rank, ms in enumerate(speeds_ms) if ms >= threshold]


def elect_anchor_rank(speeds_ms: Sequence[float], current: Optional[int]) -> Optional[int]:
    """The slow cohort's anchor: the sticky ``current`` one unless a member is clearly slower."""
    cohort = slow_cohort(speeds_ms)
    if not cohort:
        return None
    if len(cohort) == 1:
        return cohort[0]
    if current is None or current not in cohort:
        return cohort[0]
    challengers = [rank for rank in cohort if rank != current]
    # max() keeps the first of equals, so exact ties go to the lowest index.
    challenger = max(challengers, key=lambda rank: speeds_ms[rank])
    if speeds_ms[challenger] > speeds_ms[current] * (1.0 + DOMINANCE_MARGIN):
        return challenger
    return current


# -- window-pressure growth -------------------------------------------------------------------


def window_overhead(anchor: int, slow_ms: float, sync_ms: float, fill_ms: float) -> Optional[float]:
    """Fixed per-window cost as a fraction of the anchor rank's window wall, or None when there is
    no fixed cost to measure."""
    fixed = sync_ms + fill_ms
    denominator = anchor * slow_ms + fixed
    if fixed <= 0.0 or denominator <= 0.0:
        return None
    return fixed / denominator


def rounding_idle(anchor: int, speeds_ms: Sequence[float], slow_ms: float) -> float:
    """The part of the ranks' time a window at ``anchor`` leaves idle because each rank's count is
    a whole number of batches (0 unless every rank has a reading): from the counts' targets, not
    the counts, so that the dead zone's lag does not count as rounding."""
    if not speeds_ms or any(ms <= 0.0 for ms in speeds_ms):
        return 0.0
    counts = [rank_target(anchor, ms, slow_ms) for ms in speeds_ms]
    window = max(n * ms for n, ms in zip(counts, speeds_ms, strict=True))
    if window <= 0.0:
        return 0.0
    return max(0.0, 1.0 - sum(counts) / sum(window / ms for ms in speeds_ms))


def grown_anchor(
    anchor: int, overhead: Optional[float], target: float, warmup: bool, min_anchor: int, max_anchor: int,
    rounding: float = 0.0,
) -> Optional[int]:
    """The grown anchor that ``overhead`` (against the overhead ``target``) or the counts'
    ``rounding`` idle (against :data:`PLAN_IDLE_SHARE` of it) calls for, a margin higher during
    warm-up, or None. Grow-only by design."""
    pressure = max(0.0 if overhead is None else overhead / target, rounding / (target * PLAN_IDLE_SHARE))
    if pressure <= (WARMUP_GROWTH_MARGIN if warmup else 1.0):
        return None
    scale = min(pressure, GROWTH_STEP_CAP)
    grown = min(max(math.ceil(anchor * scale), min_anchor), max_anchor)
    return grown if grown > anchor else None
