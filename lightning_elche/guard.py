"""Convergence-guard verdicts: what a guard tells the cadence controller after each sync.

A verdict is applied by :meth:`lightning_elche.controller.ElCheController.apply_verdict`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Protocol, Union, runtime_checkable

from lightning_elche.checks import invalid, is_number, require_int, require_real

if TYPE_CHECKING:
    from lightning_elche.config import ElCheConfig


@dataclass(frozen=True)
class Stable:
    """Replicas agree: a pending window-growth proposal may be committed."""


@dataclass(frozen=True)
class SuppressGrowth:
    """Replicas drift: drop any growth proposal and latch growth off until 5 stable verdicts."""


@dataclass(frozen=True)
class NudgeDown:
    """Replicas drift badly: drop any proposal, latch growth off and shrink the anchor.

    ``factor`` multiplies the anchor (0.5 halves it); it is clamped to [0.1, 1.0] when applied.
    """

    factor: float

    def __post_init__(self) -> None:
        if isinstance(self.factor, bool) or not isinstance(self.factor, (int, float)):
            raise ValueError(f"NudgeDown.factor={self.factor!r} is invalid: expected a number in (0, 1].")
        if math.isfinite(self.factor) and not 0.0 < self.factor <= 1.0:
            raise ValueError(f"NudgeDown.factor={self.factor!r} is invalid: expected a number in (0, 1].")


Verdict = Union[Stable, SuppressGrowth, NudgeDown]


# -- guard input ---------------------------------------------------------------------------

TREND_WINDOW = 5
DEFAULT_DIVERGENCE_THRESHOLD = 0.05
# With EASGD blending the replicas keep a deliberate standing spread (about 0.1 at alpha 0.5)
# that a 0.05 floor would read as permanent divergence.
EASGD_DIVERGENCE_THRESHOLD = 0.3


def _invalid(owner: str, name: str, value: Any, allowed: str) -> ValueError:
    return invalid(f"{owner}.{name}={value!r}", allowed)


def _is_number(value: Any) -> bool:
    return is_number(value)


def _float_list(name: str, values: Any) -> list[float]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise _invalid("DivergenceReport", name, values, "expected a list of numbers")
    if not all(_is_number(value) for value in values):
        raise _invalid("DivergenceReport", name, values, "expected a list of numbers")
    return [float(value) for value in values]


@dataclass
class DivergenceReport:
    """How far each replica had drifted from the consensus at one sync.

    ``deltas[k] = ||pre_k - post|| / ||post||`` is rank k's relative distance between its
    parameters before the reduce (``pre_k``) and the consensus (``post``), over all parameter
    tensors concatenated; ``pre_norms[k] = ||pre_k||`` and ``post_norm = ||post||`` are optional.
    """

    deltas: list[float]
    pre_norms: Optional[list[float]] = None
    post_norm: Optional[float] = None

    def __post_init__(self) -> None:
        self.deltas = _float_list("deltas", self.deltas)
        if self.pre_norms is not None:
            self.pre_norms = _float_list("pre_norms", self.pre_norms)
            if len(self.pre_norms) != len(self.deltas):
                raise ValueError(
                    f"DivergenceReport.pre_norms has {len(self.pre_norms)} entries: "
                    f"expected one per rank, like deltas ({len(self.deltas)})."
                )
        if self.post_norm is not None:
            if not _is_number(self.post_norm):
                raise _invalid("DivergenceReport", "post_norm", self.post_norm, "expected a number")
            self.post_norm = float(self.post_norm)

    def max_relative_delta(self) -> float:
        """The worst rank's relative drift ``max_k deltas[k]``; 0.0 for an empty report.

        NaN entries are skipped, as in flodl: a replica with non-finite parameters is caught by the
        strategy's non-finite check, and one NaN must not blind the trend ring to the other ranks.
        """
        return max([0.0, *(d for d in self.deltas if not math.isnan(d))])


# -- guard protocol ------------------------------------------------------------------------


@runtime_checkable
class ConvergenceGuard(Protocol):
    """What the controller asks of a guard: one verdict per sync.

    ``k_used`` is the total number of batches all ranks ran since the previous sync and
    ``k_max`` the largest per-rank count (the window length in steps). A guard may also define
    ``state_dict() -> dict``, ``load_state_dict(dict)`` and ``telemetry() -> dict[str, float]``;
    use :func:`guard_state_dict`, :func:`guard_load_state_dict` and :func:`guard_telemetry` to
    call them when present.
    """

    def report(self, report: DivergenceReport, k_used: int, k_max: int) -> Verdict: ...


def guard_state_dict(guard: ConvergenceGuard) -> dict[str, Any]:
    """``guard.state_dict()`` if the guard defines it, else ``{}``."""
    state_dict = getattr(guard, "state_dict", None)
    return dict(state_dict()) if callable(state_dict) else {}


def guard_load_state_dict(guard: ConvergenceGuard, state: dict[str, Any]) -> None:
    """``guard.load_state_dict(state)`` if the guard defines it and ``state`` is not empty."""
    load = getattr(guard, "load_state_dict", None)
    if callable(load) and state:
        load(state)


def guard_telemetry(guard: ConvergenceGuard) -> dict[str, float]:
    """``guard.telemetry()`` if the guard defines it, else ``{}``."""
    telemetry = getattr(guard, "telemetry", None)
    return dict(telemetry()) if callable(telemetry) else {}


def _check_finite(owner: str, name: str, value: Any) -> float:
    return require_real(f"{owner}.{name}={value!r}", value)


def _check_count(owner: str, name: str, value: Any, minimum: int) -> int:
    return require_int(f"{owner}.{name}={value!r}", value, minimum)


# -- built-in guards -----------------------------------------------------------------------


class NoGuard:
    """Never intervenes: every sync is :class:`Stable` (the unconditioned baseline)."""

    def report(self, report: DivergenceReport, k_used: int, k_max: int) -> Verdict:
        """Always :class:`Stable`."""
        return Stable()

    def reset(self) -> None:
        """Nothing to clear."""

    def state_dict(self) -> dict[str, Any]:
        """Empty: the guard has no state."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore."""

    def telemetry(self) -> dict[str, float]:
        """Empty."""
        return {}

    def __repr__(self) -> str:
        return "NoGuard()"


class TrendGuard:
    """The default guard: vetoes growth while the worst drift rises three syncs in a row.

    Keeps the last 5 values of :meth:`DivergenceReport.max_relative_delta`. After each sync,
    with at least 3 values, it answers :class:`SuppressGrowth` when the last three strictly
    increase and the latest exceeds ``threshold``, else :class:`Stable`. It never nudges the
    anchor down: the trend signal alone is too noisy for that.

    Args:
        threshold: drift level (relative L2 distance to the consensus) below which a rising
            trend is tolerated; > 0. The framework uses 0.05, or 0.3 with EASGD blending.
    """

    def __init__(self, threshold: float = DEFAULT_DIVERGENCE_THRESHOLD) -> None:
        value = _check_finite("TrendGuard", "threshold", threshold)
        if value <= 0.0:
            raise _invalid("TrendGuard", "threshold", threshold, "expected a finite number > 0")
        self.threshold = value
        self._history: deque[float] = deque(maxlen=TREND_WINDOW)

    @property
    def history(self) -> tuple[float, ...]:
        """The recorded worst drifts, oldest first (at most 5)."""
        return tuple(self._history)

    def report(self, report: DivergenceReport, k_used: int, k_max: int) -> Verdict:
        """Record ``report.max_relative_delta()`` and apply the three-rises rule."""
        self._history.append(report.max_relative_delta())
        if len(self._history) < 3:
            return Stable()
        d1, d2, d3 = self._history[-3], self._history[-2], self._history[-1]
        if d3 > d2 > d1 and d3 > self.threshold:
            return SuppressGrowth()
        return Stable()

    def reset(self) -> None:
        """Forget the recorded drifts."""
        self._history.clear()

    def state_dict(self) -> dict[str, Any]:
        """``{"history": [...]}``: restored on resume so the first syncs after it aren't blind."""
        return {"history": list(self._history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the drift ring from :meth:`state_dict` (only the newest 5 values are kept)."""
        history = state.get("history")
        # inf is a legitimate record (a replica blew up); NaN never enters the ring.
        if not isinstance(history, (list, tuple)) or not all(_is_number(v) and not math.isnan(v) for v in history):
            raise _invalid("TrendGuard", "state['history']", history, "expected a list of numbers")
        values = [float(v) for v in history]
        self._history = deque(values, maxlen=TREND_WINDOW)

    def telemetry(self) -> dict[str, float]:
        """``{"d_history_last": latest drift}`` once a sync was recorded, else ``{}``."""
        if not self._history:
            return {}
        return {"d_history_last": self._history[-1]}

    def __repr__(self) -> str:
        return f"TrendGuard(threshold={self.threshold!r})"


@dataclass(frozen=True)
class LambdaSample:
    """One observation of :class:`LambdaEstimator`.

    ``lambda_raw = ln(D_t / D_{t-1}) / k_max`` (``None`` when there is no usable previous ``D``)
    and ``lambda_ema`` its bias-corrected running mean (``None`` before the first ``lambda_raw``).
    """

    d_raw: float
    lambda_raw: Optional[float]
    lambda_ema: Optional[float]
    k_used: int
    k_max: int


class LambdaEstimator:
    """Growth rate of the drift across syncs, per step of the slowest rank.

    ``lambda_raw = ln(D_t / D_{t-1}) / k_max`` whenever both ``D`` exceed ``noise_floor`` and
    ``k_max > 0``; the running mean is ``ema <- alpha*ema + (1-alpha)*lambda_raw``, reported
    bias-corrected as ``ema / (1 - alpha^t)`` after ``t`` samples. A ``D`` at or below the floor
    yields no sample and breaks the chain, so the next sync yields none either; only
    :meth:`reset` clears the mean.
    """

    def __init__(self, alpha: float = 0.9, noise_floor: float = 1e-8) -> None:
        if not _is_number(alpha) or not 0.0 <= alpha < 1.0:
            raise _invalid("LambdaEstimator", "alpha", alpha, "expected a number in [0, 1)")
        if not _is_number(noise_floor) or not 0.0 <= noise_floor < math.inf:
            raise _invalid("LambdaEstimator", "noise_floor", noise_floor, "expected a finite number >= 0")
        self.alpha = alpha
        self.noise_floor = noise_floor
        self.prev_d: Optional[float] = None
        self.ema_raw = 0.0
        self.samples = 0

    def observe(self, d_raw: float, k_used: int, k_max: int) -> LambdaSample:
        """Record this sync's worst drift ``d_raw`` and return the resulting sample."""
        lambda_raw: Optional[float] = None
        if self.prev_d is not None and self.prev_d > self.noise_floor and d_raw > self.noise_floor and k_max > 0:
            lambda_raw = math.log(d_raw / self.prev_d) / k_max
            self.ema_raw = self.alpha * self.ema_raw + (1.0 - self.alpha) * lambda_raw
            self.samples += 1
        self.prev_d = d_raw if d_raw > self.noise_floor else None
        return LambdaSample(d_raw, lambda_raw, self.lambda_ema, k_used, k_max)

    @property
    def lambda_ema(self) -> Optional[float]:
        """Bias-corrected mean of the samples so far; ``None`` before the first one."""
        if self.samples == 0:
            return None
        return self.ema_raw / (1.0 - self.alpha**self.samples)

    def reset(self) -> None:
        """Forget the previous drift and the running mean."""
        self.prev_d = None
        self.ema_raw = 0.0
        self.samples = 0

    def state_dict(self) -> dict[str, Any]:
        """Previous drift, raw running mean and sample count."""
        return {"prev_d": self.prev_d, "ema_raw": self.ema_raw, "samples": self.samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`."""
        prev_d = state.get("prev_d")
        if prev_d is not None:
            prev_d = _check_finite("LambdaEstimator", "state['prev_d']", prev_d)
        ema_raw = _check_finite("LambdaEstimator", "state['ema_raw']", state.get("ema_raw"))
        samples = _check_count("LambdaEstimator", "state['samples']", state.get("samples"), 0)
        self.prev_d, self.ema_raw, self.samples = prev_d, ema_raw, samples


class GrowthGuard:
    """Opt-in guard on the growth *rate* of the drift (flodl's MsfGuard).

    Feeds :meth:`DivergenceReport.max_relative_delta` to a :class:`LambdaEstimator`. When its
    ``lambda_ema`` exceeds ``nudge_threshold`` for ``nudge_sustain`` syncs in a row the verdict is
    ``NudgeDown(nudge_factor)``; when it exceeds ``suppress_threshold`` for ``suppress_sustain``
    syncs it is :class:`SuppressGrowth`; otherwise :class:`Stable`. The two streaks count
    independently; the nudge wins when both are due, and a firing resets only its own streak.

    Args:
        alpha: smoothing of the rate's running mean, in [0, 1).
        suppress_threshold: rate (per step) above which growth is vetoed.
        suppress_sustain: syncs in a row above ``suppress_threshold`` before vetoing (>= 1).
        nudge_threshold: rate above which the anchor is cut; ``inf`` disables the nudge.
        nudge_sustain: syncs in a row above ``nudge_threshold`` before cutting (>= 1).
        nudge_factor: anchor multiplier of the nudge, in (0, 1].
        without_nudge: only ever veto growth (same as ``nudge_threshold=inf``).
    """

    def __init__(
        self,
        alpha: float = 0.9,
        suppress_threshold: float = 1e-3,
        suppress_sustain: int = 3,
        nudge_threshold: float = 1e-2,
        nudge_sustain: int = 3,
        nudge_factor: float = 0.5,
        without_nudge: bool = False,
    ) -> None:
        self.suppress_threshold = _check_finite("GrowthGuard", "suppress_threshold", suppress_threshold)
        self.suppress_sustain = _check_count("GrowthGuard", "suppress_sustain", suppress_sustain, 1)
        if not _is_number(nudge_threshold) or math.isnan(nudge_threshold):
            raise _invalid(
                "GrowthGuard",
                "nudge_threshold",
                nudge_threshold,
                "expected a number (inf disables the nudge)",
            )
        self.nudge_sustain = _check_count("GrowthGuard", "nudge_sustain", nudge_sustain, 1)
        factor = _check_finite("GrowthGuard", "nudge_factor", nudge_factor)
        if not 0.0 < factor <= 1.0:
            raise _invalid("GrowthGuard", "nudge_factor", nudge_factor, "expected a number in (0, 1]")
        if not isinstance(without_nudge, bool):
            raise _invalid("GrowthGuard", "without_nudge", without_nudge, "expected true or false")
        if not _is_number(alpha) or not 0.0 <= alpha < 1.0:
            raise _invalid("GrowthGuard", "alpha", alpha, "expected a number in [0, 1)")
        self.estimator = LambdaEstimator(alpha=alpha)
        self.nudge_threshold = math.inf if without_nudge else float(nudge_threshold)
        self.nudge_factor = factor
        self.suppress_streak = 0
        self.nudge_streak = 0
        self.last_sample: Optional[LambdaSample] = None

    def report(self, report: DivergenceReport, k_used: int, k_max: int) -> Verdict:
        """Update the rate estimate with this sync's worst drift and the two streaks."""
        sample = self.estimator.observe(report.max_relative_delta(), k_used, k_max)
        self.last_sample = sample
        rate = -math.inf if sample.lambda_ema is None else sample.lambda_ema
        self.suppress_streak = self.suppress_streak + 1 if rate > self.suppress_threshold else 0
        self.nudge_streak = self.nudge_streak + 1 if rate > self.nudge_threshold else 0
        if math.isfinite(self.nudge_threshold) and self.nudge_streak >= self.nudge_sustain:
            self.nudge_streak = 0
            return NudgeDown(self.nudge_factor)
        if self.suppress_streak >= self.suppress_sustain:
            self.suppress_streak = 0
            return SuppressGrowth()
        return Stable()

    def reset(self) -> None:
        """Clear the estimator, both streaks and the last sample."""
        self.estimator.reset()
        self.suppress_streak = 0
        self.nudge_streak = 0
        self.last_sample = None

    def state_dict(self) -> dict[str, Any]:
        """Estimator state and both streaks.

        flodl does not persist these; restoring them costs nothing and keeps a resume faithful.
        """
        return {
            "estimator": self.estimator.state_dict(),
            "suppress_streak": self.suppress_streak,
            "nudge_streak": self.nudge_streak,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`."""
        estimator = state.get("estimator")
        if not isinstance(estimator, dict):
            raise _invalid("GrowthGuard", "state['estimator']", estimator, "expected a dict")
        suppress = _check_count("GrowthGuard", "state['suppress_streak']", state.get("suppress_streak"), 0)
        nudge = _check_count("GrowthGuard", "state['nudge_streak']", state.get("nudge_streak"), 0)
        self.estimator.load_state_dict(estimator)
        self.suppress_streak, self.nudge_streak = suppress, nudge
        self.last_sample = None

    def telemetry(self) -> dict[str, float]:
        """``lambda_raw`` and ``lambda_ema`` of the last sync, each when it exists."""
        out: dict[str, float] = {}
        if self.last_sample is not None:
            if self.last_sample.lambda_raw is not None:
                out["lambda_raw"] = self.last_sample.lambda_raw
            if self.last_sample.lambda_ema is not None:
                out["lambda_ema"] = self.last_sample.lambda_ema
        return out

    def __repr__(self) -> str:
        return (
            f"GrowthGuard(alpha={self.estimator.alpha!r}, "
            f"suppress_threshold={self.suppress_threshold!r}, "
            f"suppress_sustain={self.suppress_sustain!r}, "
            f"nudge_threshold={self.nudge_threshold!r}, "
            f"nudge_sustain={self.nudge_sustain!r}, nudge_factor={self.nudge_factor!r})"
        )


def default_guard(config: ElCheConfig) -> ConvergenceGuard:
    """The guard a run uses, by precedence.

    1. ``config.convergence_guard`` (the user's object, returned as is);
    2. :class:`NoGuard` when ``config.no_divergence_guard``;
    3. ``TrendGuard(config.divergence_threshold)`` when a threshold is given;
    4. ``TrendGuard(0.3)`` when EASGD blending is on (``config.easgd_alpha`` set: ``cpu_async``),
       keyed on presence, not value;
    5. ``TrendGuard(0.05)``.
    """
    if config.convergence_guard is not None:
        return config.convergence_guard
    if config.no_divergence_guard:
        return NoGuard()
    if config.divergence_threshold is not None:
        return TrendGuard(config.divergence_threshold)
    if config.easgd_alpha is not None:
        return TrendGuard(EASGD_DIVERGENCE_THRESHOLD)
    return TrendGuard(DEFAULT_DIVERGENCE_THRESHOLD)
