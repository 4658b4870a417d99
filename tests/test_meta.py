"""LR-aware meta-controller: flodl's lr_event_meta.rs cases (elche-spec §16 "Meta")."""

from __future__ import annotations

import pickle

import pytest

from lightning_elche.guard import NudgeDown, Stable, SuppressGrowth
from lightning_elche.meta import (
    MATURE,
    PROBE,
    STABLE,
    WARMUP,
    MetaController,
    effective_factor,
)

S, SG = Stable(), SuppressGrowth()
N = NudgeDown(0.5)


def run(meta: MetaController, phase: int, seq: list[tuple]) -> NudgeDown | None:
    out = None
    for lr, anchor, verdict in seq:
        out = meta.observe(lr, anchor, verdict, phase)
    return out


def factor_of(action: NudgeDown | None) -> float:
    assert isinstance(action, NudgeDown), action
    return action.factor


# -- windows and phase gating --------------------------------------------------------------


def test_single_observation_is_noop() -> None:
    meta = MetaController()
    assert meta.observe(0.1, 100, S, STABLE) is None
    assert (meta.last_action, meta.last_factor) == ("noop", None)


def test_windows_are_capped() -> None:
    meta = MetaController()
    for i in range(7):
        meta.observe(0.1 * i, 100 + i, S if i % 2 else SG, STABLE)
    assert meta.lr_window == pytest.approx((0.4, 0.5, 0.6))
    assert meta.anchor_window == (102, 103, 104, 105, 106)
    assert meta.verdict_window == (SG, S, SG, S, SG)


def test_probe_phase_silences_both_watchers() -> None:
    meta = MetaController()
    for _ in range(5):
        meta.observe(0.1, 100, N, PROBE)
    assert meta.observe(0.01, 100, N, PROBE) is None
    assert meta.last_action == "noop"
    # Probe observations were still recorded: the first Mature sync can act on them.
    assert meta.observe(0.01, 100, N, MATURE) == NudgeDown(0.7)


# -- LR-cliff watcher ----------------------------------------------------------------------


def test_lr_cliff_fires_on_multistep_drop() -> None:
    meta = MetaController()
    meta.observe(0.1, 100, S, STABLE)
    assert meta.observe(0.01, 100, S, STABLE) == NudgeDown(0.5)
    assert (meta.last_action, meta.last_factor) == ("lr_cliff", 0.5)


def test_lr_cliff_fires_in_warmup_with_the_same_base() -> None:
    meta = MetaController()
    meta.observe(0.1, 100, S, WARMUP)
    assert meta.observe(0.05, 100, S, WARMUP) == NudgeDown(0.5)


def test_lr_cliff_silent_on_smooth_decay() -> None:
    meta = MetaController()
    lr = 0.1
    for _ in range(10):
        assert meta.observe(lr, 100, S, STABLE) is None
        lr *= 0.98


def test_lr_cliff_silent_on_lr_rise() -> None:
    meta = MetaController()
    meta.observe(0.001, 100, S, STABLE)
    assert meta.observe(0.1, 100, S, STABLE) is None


def test_lr_cliff_threshold_at_boundary() -> None:
    meta = MetaController()
    meta.observe(1.0, 100, S, STABLE)
    assert meta.observe(0.75, 100, S, STABLE) is None  # 25 %: under 30 %
    meta = MetaController()
    meta.observe(1.0, 100, S, STABLE)
    assert meta.observe(0.65, 100, S, STABLE) == NudgeDown(0.5)  # 35 %: over
    meta = MetaController()
    meta.observe(10.0, 100, S, STABLE)
    assert meta.observe(7.0, 100, S, STABLE) is None  # exactly 30 %: not "more than"


def test_lr_cliff_compares_consecutive_samples_only() -> None:
    meta = MetaController()
    assert run(meta, STABLE, [(1.0, 100, S), (0.8, 100, S), (0.64, 100, S)]) is None


def test_lr_cliff_needs_positive_previous_lr() -> None:
    meta = MetaController()
    meta.observe(0.0, 100, S, STABLE)
    assert meta.observe(-1.0, 100, S, STABLE) is None


def test_missing_lr_records_no_sample() -> None:
    meta = MetaController()
    meta.observe(0.1, 100, S, STABLE)
    assert meta.observe(None, 100, S, STABLE) is None
    assert meta.observe(float("nan"), 100, S, STABLE) is None
    assert meta.lr_window == (0.1,)
    assert meta.anchor_window == (100, 100, 100)
    # The cliff is measured against the last real sample.
    assert meta.observe(0.01, 100, S, STABLE) == NudgeDown(0.5)


def test_convergence_watcher_works_without_lr() -> None:
    meta = MetaController()
    assert run(meta, STABLE, [(None, 100, N)] * 3) == NudgeDown(0.5)


# -- convergence watcher -------------------------------------------------------------------


def test_convergence_fires_after_k_consecutive_at_stable() -> None:
    meta = MetaController()
    assert run(meta, STABLE, [(0.1, 100, N)] * 2) is None
    assert meta.observe(0.1, 100, N, STABLE) == NudgeDown(0.5)
    assert (meta.last_action, meta.last_factor) == ("convergence", 0.5)


def test_convergence_silent_on_isolated_nudge() -> None:
    meta = MetaController()
    assert run(meta, STABLE, [(0.1, 100, S), (0.1, 100, N), (0.1, 100, S), (0.1, 100, S)]) is None


def test_convergence_silent_on_two_at_stable_needs_three() -> None:
    meta = MetaController()
    assert run(meta, STABLE, [(0.1, 100, S), (0.1, 100, N), (0.1, 100, N)]) is None


def test_convergence_at_mature_needs_only_two() -> None:
    meta = MetaController()
    meta.observe(0.1, 100, S, MATURE)
    assert meta.observe(0.1, 100, SG, MATURE) is None
    assert meta.observe(0.1, 100, SG, MATURE) == NudgeDown(0.7)


def test_convergence_at_warmup_needs_five_and_cuts_hardest() -> None:
    meta = MetaController()
    assert run(meta, WARMUP, [(0.1, 100, SG)] * 4) is None
    assert meta.observe(0.1, 100, SG, WARMUP) == NudgeDown(0.3)


def test_convergence_mixed_sustained_kinds_fire() -> None:
    meta = MetaController()
    assert run(meta, STABLE, [(0.1, 100, SG), (0.1, 100, N), (0.1, 100, SG)]) == NudgeDown(0.5)


def test_convergence_keeps_firing_while_sustained() -> None:
    meta = MetaController()
    run(meta, MATURE, [(0.1, 100, SG)] * 2)
    assert meta.observe(0.1, 100, SG, MATURE) == NudgeDown(0.7)
    assert meta.observe(0.1, 100, S, MATURE) is None


# -- anchor trend and effective factor -----------------------------------------------------


def test_anchor_trend_values() -> None:
    meta = MetaController()
    assert meta.anchor_trend() == 0.0
    meta.observe(0.1, 100, S, STABLE)
    assert meta.anchor_trend() == 0.0  # one sample
    for a in (110, 120, 130, 140):
        meta.observe(0.1, a, S, STABLE)
    assert meta.anchor_trend() == pytest.approx((140 - 120) / 120, abs=1e-12)
    meta = MetaController()
    for a in (100, 80, 60, 40, 20):
        meta.observe(0.1, a, S, STABLE)
    assert meta.anchor_trend() == pytest.approx((20 - 60) / 60, abs=1e-12)


def test_is_settled_within_ten_percent() -> None:
    meta = MetaController()
    for _ in range(5):
        meta.observe(0.1, 100, S, STABLE)
    assert meta.is_settled()
    for a in (100, 50, 150, 50, 150):
        meta.observe(0.1, a, S, STABLE)
    assert meta.anchor_trend() == pytest.approx(0.5, abs=1e-12)
    assert not meta.is_settled()


def test_effective_factor_symmetric_around_zero_trend() -> None:
    assert effective_factor(0.5, 0.0) == 0.5
    assert effective_factor(0.5, -0.5) == 0.75
    assert effective_factor(0.5, 0.5) == 0.25


def test_effective_factor_clamps_at_extremes() -> None:
    assert effective_factor(0.5, 5.0) == 0.1
    assert effective_factor(0.5, -5.0) == 0.95


def test_both_watchers_compound_factor_at_mature() -> None:
    meta = MetaController()
    run(meta, MATURE, [(0.1, 100, N)] * 2)
    assert factor_of(meta.observe(0.01, 100, N, MATURE)) == pytest.approx(0.35, abs=1e-12)
    assert meta.last_action == "both"
    assert meta.last_factor == pytest.approx(0.35, abs=1e-12)


def test_compound_factor_is_clamped_low() -> None:
    # Window (100, 100, 100, 400, 400): trend 180/220; the cliff's factor clamps to 0.1, the
    # Mature one bends to 0.7 - 0.3*180/220, and their product (~0.045) clamps to 0.1.
    meta = MetaController()
    for a in (100, 100, 100, 400):
        meta.observe(0.1, a, SG, MATURE)
    assert meta.observe(0.01, 400, SG, MATURE) == NudgeDown(0.1)
    assert meta.last_action == "both"


def test_trend_dampens_subsequent_nudge_after_cliff() -> None:
    meta = MetaController()
    run(meta, STABLE, [(0.1, 100, S)] * 4)
    # Window (100, 100, 100, 100, 50): mean 90, trend -4/9, factor 0.5 + 0.5*4/9 = 13/18.
    assert factor_of(meta.observe(0.01, 50, S, STABLE)) == pytest.approx(13 / 18, abs=1e-12)


def test_trend_amplifies_nudge_during_relax_up_climb() -> None:
    meta = MetaController()
    for a in (100, 110, 120, 130, 140):
        meta.observe(0.1, a, S, STABLE)
    # Window (110, 120, 130, 140, 140): mean 128, trend 12/128, factor 0.5 - 0.5*12/128.
    assert factor_of(meta.observe(0.01, 140, S, STABLE)) == pytest.approx(0.453125, abs=1e-12)


# -- validation, state ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "name"),
    [
        (("0.1", 10, S, STABLE), "lr"),
        ((0.1, 0, S, STABLE), "anchor"),
        ((0.1, 2.5, S, STABLE), "anchor"),
        ((0.1, 10, "Stable", STABLE), "verdict"),
        ((0.1, 10, S, 4), "phase"),
        ((0.1, 10, S, -1), "phase"),
        ((0.1, 10, S, None), "phase"),
    ],
)
def test_observe_validation_names_the_argument(args: tuple, name: str) -> None:
    meta = MetaController()
    with pytest.raises(ValueError, match=rf"MetaController.observe\({name}\)="):
        meta.observe(*args)
    assert meta.anchor_window == ()


def test_state_round_trip_is_faithful() -> None:
    warm = MetaController()
    run(warm, STABLE, [(0.1, 100, S), (0.1, 120, N), (0.09, 130, SG)])
    state = pickle.loads(pickle.dumps(warm.state_dict()))
    resumed = MetaController()
    resumed.load_state_dict(state)
    assert resumed.state_dict() == warm.state_dict()
    assert resumed.verdict_window == (S, N, SG)
    nxt = [(0.01, 130, SG), (0.01, 120, S)]
    assert [resumed.observe(*o, STABLE) for o in nxt] == [warm.observe(*o, STABLE) for o in nxt]
    assert resumed.last_action == warm.last_action


def test_state_round_trip_continues_a_pattern() -> None:
    warm = MetaController()
    run(warm, STABLE, [(0.1, 100, N)] * 2)
    resumed = MetaController()
    resumed.load_state_dict(warm.state_dict())
    assert resumed.observe(0.1, 100, N, STABLE) == NudgeDown(0.5)
    assert MetaController().observe(0.1, 100, N, STABLE) is None


def test_load_rejects_bad_state() -> None:
    good = MetaController().state_dict()
    for key, value in (
        ("lr_window", [0.1, "x"]),
        ("anchor_window", [0]),
        ("verdict_window", [{"kind": "Shrug"}]),
        ("last_action", "panic"),
    ):
        with pytest.raises(ValueError, match=rf"MetaController.state\['{key}'\]"):
            MetaController().load_state_dict({**good, key: value})


def test_reset_forgets_everything() -> None:
    meta = MetaController()
    run(meta, MATURE, [(0.1, 100, N)] * 2)
    assert meta.last_action == "convergence"
    meta.reset()
    assert (meta.lr_window, meta.anchor_window, meta.verdict_window) == ((), (), ())
    assert (meta.last_action, meta.last_factor) == ("noop", None)
    assert meta.observe(0.1, 100, N, MATURE) is None
