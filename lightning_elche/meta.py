"""LR-aware meta-controller: shrinks the averaging window on LR cliffs and sustained drift.

Sits above the cadence controller and is consulted once per sync, after the guard's verdict.
Two watchers feed one actuator, a :class:`~lightning_elche.guard.NudgeDown` that the controller
applies through its verdict seam (dropping any staged growth, latching growth off, cutting the
anchor):

* the **LR-cliff watcher** fires when the learning rate fell by more than 30 % since the
  previous sync (a step schedule's drop), before the drift it causes shows up;
* the **convergence watcher** fires when the guard's last K verdicts all asked to hold or cut
  the window, with K shorter in more trusted phases.

Their base factors are bent by the anchor's recent trend: a climbing anchor gets a harder cut
(so the controller's growth does not undo it at once), a recovering anchor a gentler one.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Optional

from lightning_elche.guard import NudgeDown, Stable, SuppressGrowth, Verdict

# Controller phases as the controller numbers them.
PROBE = 0
WARMUP = 1
STABLE = 2
MATURE = 3

LR_WINDOW = 3
ANCHOR_WINDOW = 5
VERDICT_WINDOW = 5
SHARP_DROP = 0.3
LR_CLIFF_BASE = 0.5
SETTLED_EPSILON = 0.10
FACTOR_MIN = 0.1
FACTOR_MAX = 0.95
# Trailing verdicts that must all be SuppressGrowth/NudgeDown, and the base cut, per phase:
# low-trust phases demand more evidence and cut harder, trusted phases react sooner and gentler.
SUSTAIN_BY_PHASE = {WARMUP: 5, STABLE: 3, MATURE: 2}
BASE_BY_PHASE = {WARMUP: 0.3, STABLE: 0.5, MATURE: 0.7}

ACTIONS = ("noop", "lr_cliff", "convergence", "both")
_VERDICT_KINDS: dict[str, type] = {
    "Stable": Stable,
    "SuppressGrowth": SuppressGrowth,
    "NudgeDown": NudgeDown,
}


def _invalid(name: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"MetaController.{name}={value!r} is invalid: {allowed}.")


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


def _is_count(value: Any, minimum: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= minimum


def effective_factor(base: float, trend: float) -> float:
    """``clamp(base - (1 - base) * trend, 0.1, 0.95)``: a rising anchor (trend > 0) cuts harder."""
    return min(FACTOR_MAX, max(FACTOR_MIN, base - (1.0 - base) * trend))


def _verdict_to_dict(verdict: Verdict) -> dict[str, Any]:
    factor = verdict.factor if isinstance(verdict, NudgeDown) else None
    return {"kind": type(verdict).__name__, "factor": factor}


def _verdict_from_dict(entry: Any) -> Verdict:
    kind = entry.get("kind") if isinstance(entry, dict) else None
    if kind not in _VERDICT_KINDS:
        raise _invalid("state['verdict_window']", entry, "expected {'kind': Stable|SuppressGrowth|NudgeDown}")
    if kind == "NudgeDown":
        return NudgeDown(entry.get("factor"))
    return _VERDICT_KINDS[kind]()


class MetaController:
    """Watches LR, anchor and guard verdicts across syncs and recommends anchor cuts.

    Keeps the last 3 learning rates, 5 anchors and 5 verdicts. :meth:`observe` runs once per
    sync; ``last_action`` (``"noop"``, ``"lr_cliff"``, ``"convergence"`` or ``"both"``) and
    ``last_factor`` describe its latest answer for logging.
    """

    def __init__(self) -> None:
        self._lrs: deque[float] = deque(maxlen=LR_WINDOW)
        self._anchors: deque[int] = deque(maxlen=ANCHOR_WINDOW)
        self._verdicts: deque[Verdict] = deque(maxlen=VERDICT_WINDOW)
        self.last_action: str = "noop"
        self.last_factor: Optional[float] = None

    @property
    def lr_window(self) -> tuple[float, ...]:
        """Recorded learning rates, oldest first."""
        return tuple(self._lrs)

    @property
    def anchor_window(self) -> tuple[int, ...]:
        """Recorded anchors, oldest first."""
        return tuple(self._anchors)

    @property
    def verdict_window(self) -> tuple[Verdict, ...]:
        """Recorded guard verdicts, oldest first."""
        return tuple(self._verdicts)

    def observe(self, lr: Optional[float], anchor: int, verdict: Verdict, phase: int) -> Optional[NudgeDown]:
        """Record one sync and return the cut to apply, or ``None``.

        Args:
            lr: the learning rate now (the first rank's that reported one); ``None`` or a
                non-finite value records no LR sample, so the LR-cliff watcher stays silent.
            anchor: the controller's anchor now (>= 1).
            verdict: the guard's verdict for this sync.
            phase: the controller's phase, 0 = Probe, 1 = Warmup, 2 = Stable, 3 = Mature. In
                Probe nothing is recommended (the observation is still recorded).

        Returns:
            ``NudgeDown(f)`` when a watcher fires: ``f`` is :func:`effective_factor` of that
            watcher's base and :meth:`anchor_trend`; when both fire, the product of the two,
            clamped to [0.1, 0.95].
        """
        if lr is not None and not _is_number(lr):
            raise _invalid("observe(lr)", lr, "expected a number or None")
        if not _is_count(anchor, 1):
            raise _invalid("observe(anchor)", anchor, "expected an integer >= 1")
        if not isinstance(verdict, (Stable, SuppressGrowth, NudgeDown)):
            raise _invalid("observe(verdict)", verdict, "expected Stable, SuppressGrowth or NudgeDown")
        if not _is_count(phase, PROBE) or phase > MATURE:
            raise _invalid("observe(phase)", phase, "expected 0 (Probe), 1 (Warmup), 2 (Stable) or 3 (Mature)")
        if lr is not None and math.isfinite(lr):
            self._lrs.append(float(lr))
        self._anchors.append(int(anchor))
        self._verdicts.append(verdict)

        self.last_action, self.last_factor = "noop", None
        if phase == PROBE:
            return None
        trend = self.anchor_trend()
        cliff = effective_factor(LR_CLIFF_BASE, trend) if self._lr_cliff() else None
        drift = effective_factor(BASE_BY_PHASE[phase], trend) if self._sustained(phase) else None
        if cliff is not None and drift is not None:
            self.last_action = "both"
            self.last_factor = min(FACTOR_MAX, max(FACTOR_MIN, cliff * drift))
        elif cliff is not None:
            self.last_action, self.last_factor = "lr_cliff", cliff
        elif drift is not None:
            self.last_action, self.last_factor = "convergence", drift
        else:
            return None
        return NudgeDown(self.last_factor)

    def anchor_trend(self) -> float:
        """``(anchor_now - mean) / mean`` over the anchor window.

        0.0 with fewer than 2 anchors recorded or a mean <= 0.
        """
        if len(self._anchors) < 2:
            return 0.0
        mean = sum(self._anchors) / len(self._anchors)
        if mean <= 0.0:
            return 0.0
        return (self._anchors[-1] - mean) / mean

    def is_settled(self) -> bool:
        """Whether the anchor sits within 10 % of its recent mean (a diagnostic only)."""
        return abs(self.anchor_trend()) < SETTLED_EPSILON

    def _lr_cliff(self) -> bool:
        if len(self._lrs) < 2:
            return False
        prev, now = self._lrs[-2], self._lrs[-1]
        if prev <= 0.0 or now >= prev:
            return False
        return (prev - now) / prev > SHARP_DROP

    def _sustained(self, phase: int) -> bool:
        k = SUSTAIN_BY_PHASE[phase]
        if len(self._verdicts) < k:
            return False
        recent = list(self._verdicts)[-k:]
        return all(isinstance(v, (SuppressGrowth, NudgeDown)) for v in recent)

    def reset(self) -> None:
        """Forget every window and the last answer."""
        self._lrs.clear()
        self._anchors.clear()
        self._verdicts.clear()
        self.last_action, self.last_factor = "noop", None

    def state_dict(self) -> dict[str, Any]:
        """The three windows and the last answer, as plain values."""
        return {
            "lr_window": list(self._lrs),
            "anchor_window": list(self._anchors),
            "verdict_window": [_verdict_to_dict(v) for v in self._verdicts],
            "last_action": self.last_action,
            "last_factor": self.last_factor,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict` (each window keeps only its newest entries)."""
        lrs = state.get("lr_window")
        if not isinstance(lrs, (list, tuple)) or not all(_is_number(v) and math.isfinite(v) for v in lrs):
            raise _invalid("state['lr_window']", lrs, "expected a list of finite numbers")
        anchors = state.get("anchor_window")
        if not isinstance(anchors, (list, tuple)) or not all(_is_count(a, 1) for a in anchors):
            raise _invalid("state['anchor_window']", anchors, "expected a list of integers >= 1")
        entries = state.get("verdict_window")
        if not isinstance(entries, (list, tuple)):
            raise _invalid("state['verdict_window']", entries, "expected a list")
        verdicts = [_verdict_from_dict(e) for e in entries]
        action = state.get("last_action", "noop")
        if action not in ACTIONS:
            raise _invalid("state['last_action']", action, f"expected one of {', '.join(ACTIONS)}")
        factor = state.get("last_factor")
        if factor is not None and not _is_number(factor):
            raise _invalid("state['last_factor']", factor, "expected a number or None")
        self._lrs = deque((float(v) for v in lrs), maxlen=LR_WINDOW)
        self._anchors = deque(anchors, maxlen=ANCHOR_WINDOW)
        self._verdicts = deque(verdicts, maxlen=VERDICT_WINDOW)
        self.last_action = action
        self.last_factor = None if factor is None else float(factor)

    def __repr__(self) -> str:
        return "MetaController()"
