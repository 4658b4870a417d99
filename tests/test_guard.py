"""Convergence guards: flodl's convergence.rs cases (elche-spec §16 "Guards") plus our additions."""

from __future__ import annotations

import math
import pickle

import pytest

from lightning_elche.config import ElCheConfig
from lightning_elche.guard import (
    ConvergenceGuard,
    DivergenceReport,
    GrowthGuard,
    LambdaEstimator,
    NoGuard,
    NudgeDown,
    Stable,
    SuppressGrowth,
    TrendGuard,
    default_guard,
    guard_load_state_dict,
    guard_state_dict,
    guard_telemetry,
)

LN2 = math.log(2.0)


def rep(*deltas: float) -> DivergenceReport:
    return DivergenceReport(list(deltas))


def feed(guard: ConvergenceGuard, deltas: list[float], k_used: int = 8, k_max: int = 4) -> list:
    return [guard.report(rep(d), k_used, k_max) for d in deltas]


# -- DivergenceReport ----------------------------------------------------------------------


def test_max_relative_delta_picks_worst_rank() -> None:
    assert rep(0.01, 0.05, 0.03).max_relative_delta() == 0.05


def test_max_relative_delta_empty_is_zero() -> None:
    assert rep().max_relative_delta() == 0.0


def test_max_relative_delta_skips_nan_keeps_inf() -> None:
    assert rep(float("nan"), 0.02).max_relative_delta() == 0.02
    assert rep(0.02, float("nan")).max_relative_delta() == 0.02
    assert rep(0.02, math.inf).max_relative_delta() == math.inf


def test_report_validation() -> None:
    with pytest.raises(ValueError, match="pre_norms has 1 entries"):
        DivergenceReport([0.1, 0.2], [1.0])
    with pytest.raises(ValueError, match="DivergenceReport.deltas"):
        DivergenceReport(["x"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="DivergenceReport.post_norm"):
        DivergenceReport([0.1], [1.0], "big")  # type: ignore[arg-type]
    assert DivergenceReport((0.1, 1)).deltas == [0.1, 1.0]  # type: ignore[arg-type]


# -- NoGuard -------------------------------------------------------------------------------


def test_no_guard_is_always_stable() -> None:
    g = NoGuard()
    assert feed(g, [0.5] * 10) == [Stable()] * 10
    assert g.telemetry() == {}
    assert g.state_dict() == {}


# -- TrendGuard ----------------------------------------------------------------------------


def test_trend_3_rises_above_threshold_suppress() -> None:
    assert feed(TrendGuard(0.01), [0.02, 0.03, 0.04]) == [Stable(), Stable(), SuppressGrowth()]


def test_trend_just_above_threshold_fires() -> None:
    assert feed(TrendGuard(0.01), [0.011, 0.012, 0.013])[-1] == SuppressGrowth()


def test_trend_non_rising_is_stable() -> None:
    assert feed(TrendGuard(0.01), [0.05, 0.04, 0.06]) == [Stable()] * 3


def test_trend_equal_values_are_not_rises() -> None:
    assert feed(TrendGuard(0.01), [0.05, 0.05, 0.06])[-1] == Stable()


def test_trend_below_threshold_is_stable() -> None:
    assert feed(TrendGuard(0.10), [0.01, 0.02, 0.03]) == [Stable()] * 3


def test_trend_latest_equal_to_threshold_is_stable() -> None:
    assert feed(TrendGuard(0.03), [0.01, 0.02, 0.03])[-1] == Stable()


def test_trend_keeps_firing_while_rising_and_never_nudges() -> None:
    verdicts = feed(TrendGuard(0.01), [0.02, 0.03, 0.04, 0.05, 0.06, 0.01])
    assert verdicts == [Stable(), Stable()] + [SuppressGrowth()] * 3 + [Stable()]


def test_trend_history_capped_at_5() -> None:
    g = TrendGuard(0.01)
    feed(g, [i * 0.01 for i in range(10)])
    assert g.history == pytest.approx((0.05, 0.06, 0.07, 0.08, 0.09))


def test_trend_reset_clears_history() -> None:
    g = TrendGuard(0.01)
    feed(g, [0.05] * 5)
    g.reset()
    assert g.history == ()
    # Blind again: two rises after a reset are not enough.
    assert feed(g, [0.02, 0.03]) == [Stable(), Stable()]


def test_trend_default_threshold_is_framework_default() -> None:
    assert TrendGuard().threshold == 0.05
    assert feed(TrendGuard(), [0.03, 0.04, 0.05])[-1] == Stable()
    assert feed(TrendGuard(), [0.04, 0.05, 0.051])[-1] == SuppressGrowth()


def test_trend_telemetry_is_latest() -> None:
    g = TrendGuard(0.01)
    assert g.telemetry() == {}
    feed(g, [0.02, 0.07])
    assert g.telemetry() == {"d_history_last": 0.07}


def test_trend_state_round_trip_restores_ring() -> None:
    warm = TrendGuard(0.01)
    feed(warm, [0.01, 0.02])
    resumed = TrendGuard(0.01)
    resumed.load_state_dict(warm.state_dict())
    assert resumed.history == (0.01, 0.02)
    # The third rise fires right after resume: the ring was not blind.
    assert resumed.report(rep(0.03), 8, 4) == SuppressGrowth()
    assert TrendGuard(0.01).report(rep(0.03), 8, 4) == Stable()


def test_trend_load_keeps_newest_five() -> None:
    g = TrendGuard(0.01)
    g.load_state_dict({"history": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]})
    assert g.history == (0.3, 0.4, 0.5, 0.6, 0.7)


def test_trend_load_rejects_bad_state() -> None:
    with pytest.raises(ValueError, match=r"TrendGuard.state\['history'\]"):
        TrendGuard().load_state_dict({"history": [0.1, float("nan")]})
    with pytest.raises(ValueError, match=r"TrendGuard.state\['history'\]"):
        TrendGuard().load_state_dict({})


@pytest.mark.parametrize("bad", [0.0, -0.1, math.inf, math.nan, "0.1", True, None])
def test_trend_threshold_validation(bad: object) -> None:
    with pytest.raises(ValueError, match="TrendGuard.threshold"):
        TrendGuard(bad)  # type: ignore[arg-type]


# -- LambdaEstimator -----------------------------------------------------------------------


def test_lambda_first_event_is_none() -> None:
    s = LambdaEstimator().observe(0.05, 8, 4)
    assert (s.d_raw, s.lambda_raw, s.lambda_ema, s.k_used, s.k_max) == (0.05, None, None, 8, 4)


def test_lambda_growth_positive_uses_k_max() -> None:
    e = LambdaEstimator()
    e.observe(0.01, 8, 4)
    assert e.observe(0.02, 8, 4).lambda_raw == pytest.approx(LN2 / 4.0, abs=1e-12)


def test_lambda_decay_negative_uses_k_max() -> None:
    e = LambdaEstimator()
    e.observe(0.04, 8, 4)
    assert e.observe(0.02, 8, 4).lambda_raw == pytest.approx(-LN2 / 4.0, abs=1e-12)


def test_lambda_k_max_unchanged_by_world_size() -> None:
    two, three = LambdaEstimator(), LambdaEstimator()
    two.observe(0.01, 8, 4)
    three.observe(0.01, 12, 4)
    assert two.observe(0.02, 8, 4).lambda_raw == three.observe(0.02, 12, 4).lambda_raw


def test_lambda_zero_k_max_yields_no_sample() -> None:
    e = LambdaEstimator()
    e.observe(0.01, 0, 0)
    assert e.observe(0.02, 0, 0).lambda_raw is None
    assert e.observe(0.04, 8, 4).lambda_raw == pytest.approx(LN2 / 4.0, abs=1e-12)


def test_lambda_sub_floor_breaks_chain() -> None:
    e = LambdaEstimator()
    e.observe(0.01, 8, 4)
    assert e.observe(1e-12, 8, 4).lambda_raw is None
    assert e.observe(0.02, 8, 4).lambda_raw is None
    assert e.observe(0.04, 8, 4).lambda_raw == pytest.approx(LN2 / 4.0, abs=1e-12)


def test_lambda_sub_floor_keeps_the_mean() -> None:
    e = LambdaEstimator()
    e.observe(1.0, 1, 1)
    e.observe(math.e, 1, 1)
    s = e.observe(1e-12, 1, 1)
    assert s.lambda_raw is None
    assert s.lambda_ema == pytest.approx(1.0, abs=1e-12)
    assert e.samples == 1


def test_lambda_ema_bias_corrected_at_warmup() -> None:
    e = LambdaEstimator()
    e.observe(1.0, 1, 1)
    s = e.observe(math.e, 1, 1)
    assert s.lambda_raw == pytest.approx(1.0, abs=1e-12)
    assert s.lambda_ema == pytest.approx(1.0, abs=1e-12)
    # Second sample 0: raw ema = 0.9*0.1 + 0 = 0.09, corrected by 1 - 0.81 = 0.19.
    s = e.observe(math.e, 1, 1)
    assert s.lambda_raw == 0.0
    assert s.lambda_ema == pytest.approx(0.09 / 0.19, abs=1e-12)


def test_lambda_ema_smooths_over_constant_input() -> None:
    e = LambdaEstimator()
    d = 1.0
    for _ in range(200):
        d *= math.e
        e.observe(d, 1, 1)
    assert e.ema_raw == pytest.approx(1.0, abs=1e-3)


def test_lambda_estimator_state_round_trip() -> None:
    warm = LambdaEstimator()
    for d in (0.01, 0.02, 0.05):
        warm.observe(d, 8, 4)
    resumed = LambdaEstimator()
    resumed.load_state_dict(warm.state_dict())
    assert resumed.observe(0.07, 8, 4) == warm.observe(0.07, 8, 4)


# -- GrowthGuard ---------------------------------------------------------------------------


def doubling(n: int, start: float = 1e-4) -> list[float]:
    return [start * 2.0 ** (i + 1) for i in range(n)]


S, SG = Stable(), SuppressGrowth()
N = NudgeDown(0.5)


def test_growth_default_starts_stable() -> None:
    assert GrowthGuard().report(rep(0.01), 8, 4) == S


def test_growth_fire_sequence_nudge_wins_then_suppress() -> None:
    # lambda = ln2/4 every event from the second on: both streaks run from event 2.
    # Event 4: both due, the nudge wins and resets only its own streak; event 5 the still-due
    # suppress fires; then the nudge needs 3 more events.
    assert feed(GrowthGuard(), doubling(11)) == [S, S, S, N, SG, S, N, SG, S, N, SG]


def test_growth_suppress_only_when_rate_between_thresholds() -> None:
    # ratio 1.01 per event at k_max 4: lambda = ln(1.01)/4 ~ 2.49e-3, above 1e-3, below 1e-2.
    deltas = [0.01 * 1.01**i for i in range(8)]
    assert feed(GrowthGuard(), deltas) == [S, S, S, SG, S, S, SG, S]


def test_growth_without_nudge_disables_hard_trigger() -> None:
    assert feed(GrowthGuard(without_nudge=True), doubling(8)) == [S, S, S, SG, S, S, SG, S]
    assert GrowthGuard(without_nudge=True).nudge_threshold == math.inf
    assert feed(GrowthGuard(nudge_threshold=math.inf), doubling(8)) == [S, S, S, SG, S, S, SG, S]


def test_growth_custom_nudge_factor_and_sustain() -> None:
    g = GrowthGuard(nudge_sustain=1, nudge_factor=0.25)
    assert feed(g, doubling(3)) == [S, NudgeDown(0.25), NudgeDown(0.25)]


def test_growth_decaying_drift_never_fires() -> None:
    deltas = [0.5 * 0.5 ** (i + 1) for i in range(30)]
    assert feed(GrowthGuard(), deltas) == [S] * 30


def test_growth_telemetry_carries_lambda_after_second_event() -> None:
    g = GrowthGuard()
    assert g.telemetry() == {}
    g.report(rep(0.01), 8, 4)
    assert g.telemetry() == {}
    g.report(rep(0.02), 8, 4)
    assert g.telemetry() == pytest.approx({"lambda_raw": LN2 / 4.0, "lambda_ema": LN2 / 4.0})


def test_growth_reset_clears_state() -> None:
    g = GrowthGuard()
    feed(g, [0.01, 0.02, 0.04])
    g.reset()
    assert g.report(rep(0.08), 8, 4) == S
    assert g.last_sample is not None and g.last_sample.lambda_raw is None
    assert (g.suppress_streak, g.nudge_streak) == (0, 0)


def test_growth_state_round_trip_is_faithful() -> None:
    deltas = doubling(11)
    warm = GrowthGuard()
    feed(warm, deltas[:5])
    resumed = GrowthGuard()
    resumed.load_state_dict(pickle.loads(pickle.dumps(warm.state_dict())))
    assert feed(resumed, deltas[5:]) == feed(warm, deltas[5:]) == [S, N, SG, S, N, SG]


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"alpha": 1.0}, "alpha"),
        ({"alpha": -0.1}, "alpha"),
        ({"suppress_threshold": math.nan}, "suppress_threshold"),
        ({"suppress_sustain": 0}, "suppress_sustain"),
        ({"nudge_threshold": math.nan}, "nudge_threshold"),
        ({"nudge_sustain": 1.5}, "nudge_sustain"),
        ({"nudge_factor": 0.0}, "nudge_factor"),
        ({"nudge_factor": 1.5}, "nudge_factor"),
        ({"without_nudge": 1}, "without_nudge"),
    ],
)
def test_growth_validation_names_the_argument(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=f"GrowthGuard.{name}="):
        GrowthGuard(**kwargs)


# -- protocol, helpers, selection ----------------------------------------------------------


class MinimalGuard:
    """A user guard with nothing but report()."""

    def report(self, report: DivergenceReport, k_used: int, k_max: int) -> NudgeDown:
        return NudgeDown(0.5)


def test_builtin_and_user_guards_satisfy_the_protocol() -> None:
    for guard in (NoGuard(), TrendGuard(), GrowthGuard(), MinimalGuard()):
        assert isinstance(guard, ConvergenceGuard)
    assert not isinstance(object(), ConvergenceGuard)


def test_helpers_tolerate_guards_without_optional_methods() -> None:
    g = MinimalGuard()
    assert guard_state_dict(g) == {}
    guard_load_state_dict(g, {"history": [1.0]})
    assert guard_telemetry(g) == {}
    t = TrendGuard(0.01)
    feed(t, [0.02])
    assert guard_state_dict(t) == {"history": [0.02]}
    assert guard_telemetry(t) == {"d_history_last": 0.02}
    t.reset()
    assert t.history == ()


@pytest.mark.parametrize("guard", [NoGuard(), TrendGuard(0.2), GrowthGuard(without_nudge=True)])
def test_guards_pickle_with_state(guard: ConvergenceGuard) -> None:
    feed(guard, [0.01, 0.02])
    clone = pickle.loads(pickle.dumps(guard))
    assert type(clone) is type(guard)
    assert guard_state_dict(clone) == guard_state_dict(guard)
    assert feed(clone, [0.04, 0.08, 0.16]) == feed(guard, [0.04, 0.08, 0.16])


def test_trend_threshold_default_is_easgd_aware() -> None:
    nccl = default_guard(ElCheConfig())
    assert isinstance(nccl, TrendGuard) and nccl.threshold == 0.05
    easgd = default_guard(ElCheConfig.cpu_async())
    assert isinstance(easgd, TrendGuard) and easgd.threshold == 0.3
    # Keyed on presence, not value: a full-overwrite alpha of 1.0 still gets 0.3.
    overwrite = default_guard(ElCheConfig(mode="cpu_async", easgd_alpha=1.0))
    assert isinstance(overwrite, TrendGuard) and overwrite.threshold == 0.3
    for mode in ("nccl_sync", "cpu_sync", "cpu_cadence"):
        guard = default_guard(ElCheConfig(mode=mode))
        assert isinstance(guard, TrendGuard) and guard.threshold == 0.05


def test_default_guard_precedence() -> None:
    user = MinimalGuard()
    cfg = ElCheConfig(convergence_guard=user, no_divergence_guard=True, divergence_threshold=0.2)
    assert default_guard(cfg) is user
    assert isinstance(default_guard(ElCheConfig(no_divergence_guard=True, divergence_threshold=0.2)), NoGuard)
    explicit = default_guard(ElCheConfig(mode="cpu_async", divergence_threshold=0.2))
    assert isinstance(explicit, TrendGuard) and explicit.threshold == 0.2
