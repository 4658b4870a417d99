"""Unit tests of the ElChe cadence controller (elche-spec.md §3, acceptance lists of §16)."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence

import pytest

from lightning_elche import controller as ctl
from lightning_elche import speed_readings, window_plan
from lightning_elche.config import ElCheConfig
from lightning_elche.controller import ElCheController, Phase
from lightning_elche.guard import NudgeDown, Stable, SuppressGrowth
from lightning_elche.membership import Change


def feed(
    c: ElCheController,
    wall_ms: Sequence[float],
    sync_ms: float,
    batches: Sequence[int] | None = None,
    fill_ms: Sequence[float] | None = None,
) -> None:
    """One report; ``batches`` defaults to the planned counts, as a real window would run."""
    c.report_timing(wall_ms, list(c.batch_counts) if batches is None else batches, sync_ms, fill_ms)


def seed_plan(c: ElCheController, slow_rank: int, ratio: float) -> None:
    """A plan before any timing: ``slow_rank`` pinned as the anchor rank at ``anchor`` batches,
    every other rank at ``round(anchor * ratio)``."""
    faster = max(1, window_plan.round_half_away(c.anchor * ratio))
    c.batch_counts = [c.anchor if rank == slow_rank else faster for rank in range(c.world_size)]
    c.anchor_rank = slow_rank


def reach_stable(c: ElCheController, wall_ms: Sequence[float], batches: Sequence[int]) -> None:
    """Five quiet reports (sync 5 ms): the controller ends in Stable with no proposal."""
    for _ in range(5):
        c.report_timing(wall_ms, batches, 5.0)
    assert c.phase == Phase.STABLE
    assert c.proposed_anchor is None


# -- construction ---------------------------------------------------------------------------


def test_cadence_initial_equal() -> None:
    c = ElCheController(2, 10)
    assert c.batch_counts == [10, 10]
    assert sum(c.batch_counts) == 20
    assert c.anchor == 10
    assert not c.calibrated
    assert c.anchor_rank is None


def test_cadence_initial_three_devices() -> None:
    c = ElCheController(3, 15)
    assert c.batch_counts == [15, 15, 15]
    assert sum(c.batch_counts) == 45


def test_cadence_requires_two_devices() -> None:
    with pytest.raises(ValueError, match="world_size=1"):
        ElCheController(1, 10)


def test_cadence_requires_positive_anchor() -> None:
    with pytest.raises(ValueError, match="anchor=0"):
        ElCheController(2, 0)


def test_cadence_builders_clamp_overhead_target() -> None:
    assert ElCheController(2, 10, overhead_target=0.20, max_anchor=100).overhead_target == 0.20
    assert ElCheController(2, 5, overhead_target=0.001).overhead_target == 0.01
    assert ElCheController(2, 5, overhead_target=0.9).overhead_target == 0.50
    assert ElCheController(2, 5).overhead_target == 0.05
    with pytest.raises(ValueError, match="overhead_target"):
        ElCheController(2, 5, overhead_target=math.nan)


def test_cadence_max_batch_diff_accessor() -> None:
    assert ElCheController(2, 10, max_batch_diff=5).max_batch_diff == 5
    assert ElCheController(2, 10).max_batch_diff is None
    with pytest.raises(ValueError, match="max_batch_diff=-1"):
        ElCheController(2, 10, max_batch_diff=-1)


def test_min_and_max_anchor_resolution() -> None:
    capped = ElCheController(2, 20, max_anchor=15)
    assert (capped.anchor, capped.min_anchor, capped.max_anchor) == (15, 15, 15)
    lifted = ElCheController(2, 5, min_anchor=8)
    assert (lifted.anchor, lifted.min_anchor, lifted.batch_counts) == (8, 8, [8, 8])
    floor_above_ceiling = ElCheController(2, 10, min_anchor=50, max_anchor=30)
    assert (floor_above_ceiling.anchor, floor_above_ceiling.min_anchor) == (30, 30)
    assert ElCheController(2, 10).max_anchor == 1000


def test_rank_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="initial_anchor_rank=2"):
        ElCheController(2, 10, initial_anchor_rank=2)
    c = ElCheController(2, 10)
    with pytest.raises(ValueError, match="rank=-1"):
        c.smoothed_ms(-1)
    with pytest.raises(ValueError, match="max_total_batches=-1"):
        c.max_total_batches = -1


class _Index:
    """An integer type that is not ``int`` (like numpy's), usable through ``__index__``."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


def test_integer_like_arguments_are_accepted() -> None:
    c = ElCheController(_Index(2), _Index(10), max_batch_diff=_Index(3))  # type: ignore[arg-type]
    assert (c.world_size, c.anchor, c.max_batch_diff) == (2, 10, 3)
    assert c.smoothed_ms(_Index(0)) == 0.0  # type: ignore[arg-type]
    assert c.planned_batches(_Index(1)) == ctl.CALIBRATION_ANCHOR  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rank=True"):
        c.smoothed_ms(True)  # type: ignore[arg-type]


def test_constants_match_the_spec() -> None:
    expected = {
        "COHORT_BAND": 0.15,
        "DOMINANCE_MARGIN": 0.10,
        "TRUST_WINDOW_CAP": 5,
        "MAX_SPEED_RATIO": 64,
        "GROWTH_REARM_STABLE": 5,
        "GROWTH_STEP_CAP": 2.0,
        "WARMUP_GROWTH_MARGIN": 2.0,
        "DEAD_ZONE": 0.05,
    }
    defined = {**vars(window_plan), **vars(speed_readings), **vars(ctl)}  # where each constant lives
    assert {name: defined[name] for name in expected} == expected
    assert [int(p) for p in Phase] == [0, 1, 2, 3]


# -- speed discovery and counts -------------------------------------------------------------


def test_cadence_ratio_discovery_2x() -> None:
    c = ElCheController(2, 10, overhead_target=0.50)
    feed(c, [500.0, 1000.0], 10.0)
    assert c.calibrated
    assert c.batch_counts == [20, 10]
    assert c.anchor_rank == 1


def test_cadence_ratio_discovery_fbrl_like() -> None:
    # 73 vs 164 ms/batch: 10 * 164/73 = 22.47 rounds to 22.
    c = ElCheController(2, 10, overhead_target=0.50)
    feed(c, [730.0, 1640.0], 50.0)
    assert c.batch_counts == [22, 10]


def test_counts_round_half_away_from_zero() -> None:
    # 10 * 45/20 = 22.5 must give 23 (Python's round() would give 22).
    c = ElCheController(2, 10, overhead_target=0.50)
    feed(c, [200.0, 450.0], 1.0)
    assert c.batch_counts == [23, 10]


def test_cadence_three_devices_mixed_speed() -> None:
    c = ElCheController(3, 10, overhead_target=0.50)
    feed(c, [333.0, 500.0, 1000.0], 10.0)
    assert c.batch_counts == [30, 20, 10]


def test_cadence_successive_reports_refine() -> None:
    c = ElCheController(2, 10, overhead_target=0.50)
    feed(c, [500.0, 1000.0], 10.0)
    assert c.batch_counts == [20, 10]
    feed(c, [1000.0, 1000.0], 10.0)  # 20 batches at 50 ms, 10 at 100 ms
    assert c.batch_counts == [20, 10]


def test_speed_ratio_clamped_against_degenerate_sample() -> None:
    c = ElCheController(2, 10)
    for _ in range(6):
        c.report_timing([0.1, 1000.0], [10, 10], 1.0)  # 0.01 vs 100 ms: ratio 10000
    assert c.batch_counts == [10 * 64, 10]


def test_trust_window_keeps_last_five_readings() -> None:
    c = ElCheController(2, 10, overhead_target=0.50)
    for wall in (100.0, 200.0, 300.0, 400.0, 500.0, 600.0):
        c.report_timing([wall, 1000.0], [10, 10], 1.0)
    assert c.smoothed_ms(0) == pytest.approx((20 + 30 + 40 + 50 + 60) / 5)
    assert c.smoothed_ms(1) == 100.0


def test_five_missing_readings_clear_a_rank() -> None:
    c = ElCheController(2, 10, overhead_target=0.50)
    c.report_timing([500.0, 1000.0], [10, 10], 1.0)
    for _ in range(4):
        c.report_timing([math.nan, 1000.0], [10, 10], 1.0)
    assert c.smoothed_ms(0) == 50.0
    c.report_timing([0.0, 1000.0], [0, 10], 1.0)
    assert c.smoothed_ms(0) == 0.0
    assert c.smoothed_ms_or_none(0) is None
    assert c.smoothed_ms_or_none(1) == 100.0


def test_batch_count_clamped_to_max_diff() -> None:
    c = ElCheController(2, 10, max_batch_diff=3)
    feed(c, [100.0, 20.0], 0.0)  # 10 vs 2 ms/batch; the first report is not clamped
    assert c.batch_counts == [10, 50]
    # Rank 1 slows to 9 ms: its mean becomes 5.5 and its target 18, but it may drop by 3 only.
    feed(c, [100.0, 450.0], 0.0)
    assert c.batch_counts == [10, 47]
    feed(c, [100.0, 47 * 9.0], 0.0)
    assert c.batch_counts == [10, 44]


def test_dead_zone_holds_small_changes() -> None:
    c = ElCheController(2, 10, overhead_target=0.50)
    c.report_timing([500.0, 1000.0], [10, 10], 1.0)  # the warm-up reading: replaced by the next
    c.report_timing([500.0, 1000.0], [10, 10], 1.0)
    assert c.batch_counts == [20, 10]
    c.report_timing([520.0, 1000.0], [10, 10], 1.0)  # mean 51 ms: target 20, unchanged
    assert c.batch_counts == [20, 10]
    c.report_timing([560.0, 1000.0], [10, 10], 1.0)  # mean 52.67 ms: target 19, exactly 5 %
    assert c.batch_counts == [20, 10]
    c.report_timing([700.0, 1000.0], [10, 10], 1.0)  # mean 57 ms: target 18, 10 %
    assert c.batch_counts == [18, 10]


def test_the_warm_up_reading_plans_one_window_then_leaves_the_average() -> None:
    # The first window of a fit carries each rank's warm-up: here it makes the 4x faster rank look
    # only 2.5x faster. It plans the next window (there is nothing better yet), then the second
    # reading replaces it instead of being averaged with it for a whole trust window.
    c = ElCheController(2, 10, overhead_target=0.50)
    c.report_timing([400.0, 1000.0], [10, 10], 1.0)  # 40 vs 100 ms/batch, warm-up included
    assert c.batch_counts == [25, 10]
    c.report_timing([25 * 25.0, 1000.0], [25, 10], 1.0)  # steady: 25 vs 100 ms/batch
    assert c.smoothed_ms(0) == 25.0
    assert c.batch_counts == [40, 10]
    c.report_timing([40 * 26.0, 1000.0], [40, 10], 1.0)  # later readings are averaged as before
    assert c.smoothed_ms(0) == 25.5


def test_a_rank_that_re_learns_after_silence_drops_its_warm_up_reading_again() -> None:
    c = ElCheController(2, 10, overhead_target=0.50)
    for _ in range(3):
        c.report_timing([250.0, 1000.0], [10, 10], 1.0)
    for _ in range(5):  # rank 0 silent for a whole trust window: its readings are cleared
        c.report_timing([0.0, 1000.0], [0, 10], 1.0)
    assert c.smoothed_ms_or_none(0) is None
    c.report_timing([800.0, 1000.0], [10, 10], 1.0)  # back, with a warm-up
    assert c.smoothed_ms(0) == 80.0
    c.report_timing([250.0, 1000.0], [10, 10], 1.0)
    assert c.smoothed_ms(0) == 25.0


# -- speed ratio hint -----------------------------------------------------------------------


def test_cadence_speed_ratio_self_corrects() -> None:
    c = ElCheController(2, 10, overhead_target=0.50)
    seed_plan(c, 0, 2.0)  # wrong: rank 0 is actually the fast one
    assert c.batch_counts == [10, 20]
    for _ in range(5):
        c.report_timing([500.0, 2000.0], [10, 20], 10.0)  # 50 vs 100 ms/batch
    assert c.anchor_rank == 0, "the pin holds through Warmup"
    assert c.batch_counts == [10, 5]
    c.report_timing([500.0, 2000.0], [10, 20], 10.0)
    assert c.anchor_rank == 1
    assert c.batch_counts == [20, 10]


def test_cadence_max_anchor_one() -> None:
    c = ElCheController(2, 1, max_anchor=1)
    seed_plan(c, 1, 2.0)
    assert c.batch_counts == [2, 1]
    for _ in range(8):
        c.report_timing([100.0, 200.0], [2, 1], 500.0)  # 50 vs 200 ms/batch
        c.apply_verdict(Stable())
    assert c.anchor == 1
    assert c.batch_counts == [4, 1]


# -- anchor-rank election -------------------------------------------------------------------


def test_anchor_election_lowest_rank_tiebreak() -> None:
    c = ElCheController(3, 10, overhead_target=0.50)
    feed(c, [100.0, 100.0, 100.0], 10.0)
    assert c.anchor_rank == 0


def test_anchor_stable_under_tied_slow_ranks() -> None:
    c = ElCheController(3, 10, overhead_target=0.50)
    feed(c, [100.0, 380.0, 395.0], 10.0)
    assert c.anchor_rank == 1  # both in the cohort, no current anchor: lowest index
    swings = [(390.0, 380.0), (385.0, 388.0), (392.0, 386.0)] * 4  # reaches Stable and beyond
    for a, b in swings:
        feed(c, [100.0, a, b], 10.0)
        assert c.anchor_rank == 1, "a <10 % difference inside the cohort must not move the anchor"
    assert c.phase == Phase.STABLE


def test_anchor_switches_when_clear_winner_emerges() -> None:
    c = ElCheController(3, 10, overhead_target=0.50)
    c.report_timing([100.0, 400.0, 200.0], [10, 10, 10], 10.0)
    assert c.anchor_rank == 1
    for _ in range(4):
        c.report_timing([100.0, 200.0, 600.0], [10, 10, 10], 10.0)
        assert c.anchor_rank == 1, "Warmup holds the anchor rank"
    c.report_timing([100.0, 200.0, 600.0], [10, 10, 10], 10.0)
    assert c.anchor_rank == 2
    assert c.batch_counts == [60, 30, 10]  # rings now hold only the new speeds: 10, 20, 60 ms


def test_dominance_margin_inside_the_cohort() -> None:
    # Rank 1 anchors at 100 ms; rank 2 moves to 109 ms (kept) and then to 111 ms (taken).
    c = ElCheController(3, 10, overhead_target=0.50)
    c.report_timing([100.0, 1000.0, 900.0], [10, 10, 10], 1.0)
    assert c.anchor_rank == 1
    for _ in range(10):
        c.report_timing([100.0, 1000.0, 1090.0], [10, 10, 10], 1.0)
    assert c.phase == Phase.STABLE
    assert c.anchor_rank == 1
    for _ in range(5):
        c.report_timing([100.0, 1000.0, 1110.0], [10, 10, 10], 1.0)
    assert c.anchor_rank == 2


def test_warmup_unsticks_when_pinned_anchor_never_reports() -> None:
    c = ElCheController(2, 10, initial_anchor_rank=1)
    for i in range(4):
        c.report_timing([100.0, 0.0], [10, 0], 1.0)
        assert not c.calibrated, f"report {i + 1}: the silent pin is still trusted"
    for _ in range(6):
        c.report_timing([100.0, 0.0], [10, 0], 1.0)
    assert c.calibrated
    assert c.anchor_rank == 0
    assert c.calibration_count == 6
    assert c.phase == Phase.STABLE
    assert c.batch_counts == [10, 10]


# -- phases ---------------------------------------------------------------------------------


def test_phase_starts_at_probe() -> None:
    c = ElCheController(3, 10)
    assert c.phase == Phase.PROBE
    assert c.anchor_rank is None


def test_phase_advances_on_first_calibration() -> None:
    c = ElCheController(3, 10, overhead_target=0.50)
    feed(c, [100.0, 380.0, 395.0], 10.0)
    assert c.phase == Phase.WARMUP
    assert c.anchor_rank == 1
    assert c.calibration_count == 1


def test_phase_warmup_to_stable_at_5() -> None:
    c = ElCheController(2, 10, overhead_target=0.50)
    for _ in range(4):
        feed(c, [500.0, 1000.0], 10.0)
    assert c.phase == Phase.WARMUP
    feed(c, [500.0, 1000.0], 10.0)
    assert c.phase == Phase.STABLE


def test_phase_stable_to_mature_at_20() -> None:
    c = ElCheController(2, 10, overhead_target=0.50)
    for _ in range(19):
        feed(c, [500.0, 1000.0], 10.0)
    assert c.phase == Phase.STABLE
    feed(c, [500.0, 1000.0], 10.0)
    assert c.phase == Phase.MATURE


# -- window-pressure growth -----------------------------------------------------------------


def test_cadence_anchor_auto_tune() -> None:
    c = ElCheController(2, 10, overhead_target=0.10)
    reach_stable(c, [1000.0, 1000.0], [10, 10])
    c.report_timing([1000.0, 1000.0], [10, 10], 500.0)  # 500 / (10*100 + 500) = 0.33
    assert c.last_overhead == pytest.approx(1 / 3)
    assert c.proposed_anchor == 20  # scale 3.3 capped at 2
    c.apply_verdict(Stable())
    assert c.anchor == 20
    assert c.batch_counts == [20, 20]


def test_cadence_anchor_auto_tune_with_speed_ratio() -> None:
    c = ElCheController(2, 10, overhead_target=0.10)
    reach_stable(c, [500.0, 1000.0], [10, 10])
    c.report_timing([500.0, 1000.0], [10, 10], 400.0)  # 400 / 1400 = 0.286
    c.apply_verdict(Stable())
    assert c.anchor == 20
    assert c.batch_counts == [40, 20]


def test_cadence_anchor_capped_at_max() -> None:
    c = ElCheController(2, 10, overhead_target=0.01, max_anchor=15)
    for _ in range(5):
        feed(c, [100.0, 100.0], 0.5)
    assert c.proposed_anchor is None
    feed(c, [100.0, 100.0], 500.0)
    c.apply_verdict(Stable())
    assert c.anchor == 15
    assert c.batch_counts == [15, 15]


def test_cadence_stable_when_overhead_low() -> None:
    c = ElCheController(2, 10, overhead_target=0.10)
    feed(c, [1000.0, 1000.0], 5.0)
    assert c.anchor == 10
    assert c.proposed_anchor is None
    assert c.last_overhead == pytest.approx(5 / 1005)


def test_overhead_proposal_committed_on_stable_verdict() -> None:
    c = ElCheController(2, 10, overhead_target=0.10)
    reach_stable(c, [1000.0, 1000.0], [10, 10])
    c.report_timing([1000.0, 1000.0], [10, 10], 500.0)
    assert c.anchor == 10, "report_timing must not move the anchor"
    assert c.proposed_anchor == 20
    c.apply_verdict(Stable())
    assert c.anchor == 20
    assert c.proposed_anchor is None


def test_overhead_grow_vetoed_on_suppress_growth() -> None:
    c = ElCheController(2, 10, overhead_target=0.10)
    reach_stable(c, [1000.0, 1000.0], [10, 10])
    c.report_timing([1000.0, 1000.0], [10, 10], 500.0)
    c.apply_verdict(SuppressGrowth())
    assert c.anchor == 10
    assert c.proposed_anchor is None
    assert not c.growth_enabled


def test_growth_latched_off_after_suppress_growth() -> None:
    c = ElCheController(2, 10, overhead_target=0.10)
    reach_stable(c, [1000.0, 1000.0], [10, 10])
    c.report_timing([1000.0, 1000.0], [10, 10], 500.0)
    c.apply_verdict(SuppressGrowth())
    assert c.anchor == 10
    assert not c.growth_enabled
    for streak in range(1, 6):
        c.report_timing([1000.0, 1000.0], [10, 10], 500.0)
        assert c.proposed_anchor is None, "latched off: no proposal"
        c.apply_verdict(Stable())
        assert c.anchor == 10
        assert c.consecutive_stable == streak
        assert c.growth_enabled == (streak == 5)
    c.report_timing([1000.0, 1000.0], [10, 10], 500.0)
    c.apply_verdict(Stable())
    assert c.anchor == 20


def test_overhead_proposal_discarded_on_nudge_down() -> None:
    c = ElCheController(2, 20, overhead_target=0.10)
    reach_stable(c, [1000.0, 1000.0], [20, 20])
    c.report_timing([1000.0, 1000.0], [20, 20], 500.0)
    assert c.proposed_anchor == 40
    c.apply_verdict(NudgeDown(0.5))
    assert c.anchor == 10
    assert c.proposed_anchor is None
    assert c.batch_counts == [10, 10]


def test_cap_binding_suppresses_anchor_growth() -> None:
    c = ElCheController(2, 10, overhead_target=0.10)
    c.max_total_batches = 30
    reach_stable(c, [500.0, 1000.0], [10, 10])
    assert c.batch_counts == [20, 10]
    assert not c.window_cap_binding
    c.report_timing([500.0, 1000.0], [10, 10], 400.0)
    c.apply_verdict(Stable())
    assert c.anchor == 20  # [40, 20] scaled down to the cap
    assert c.batch_counts == [20, 10]
    assert c.window_cap_binding
    for _ in range(10):
        c.report_timing([500.0, 1000.0], [10, 10], 400.0)
        assert c.proposed_anchor is None
        c.apply_verdict(Stable())
    assert c.anchor == 20
    assert c.batch_counts == [20, 10]


def test_cadence_window_capped_to_max_total() -> None:
    c = ElCheController(2, 10, overhead_target=0.10)
    c.max_total_batches = 40
    reach_stable(c, [500.0, 1000.0], [10, 10])
    c.report_timing([500.0, 1000.0], [10, 10], 400.0)
    c.apply_verdict(Stable())
    # [40, 20] * 40/60 = [26.7, 13.3] -> [26, 13]; the remainder goes to the largest count.
    assert c.batch_counts == [27, 13]
    assert c.window_cap_binding


def test_window_cap_floor_of_one_beats_the_cap() -> None:
    c = ElCheController(3, 10)
    c.max_total_batches = 2
    feed(c, [100.0, 100.0, 100.0], 1.0)
    assert c.batch_counts == [1, 1, 1]
    assert c.window_cap_binding


def test_window_cap_remainder_tie_goes_to_lowest_rank() -> None:
    c = ElCheController(2, 20)
    c.max_total_batches = 31
    feed(c, [100.0, 100.0], 1.0)
    assert c.batch_counts == [16, 15]


def test_fill_of_the_anchor_rank_drives_growth() -> None:
    # Equal speeds: rank 0 anchors. Fill 300 ms on rank 0: 300 / 1300 = 0.23 > 2 x 0.10.
    c = ElCheController(2, 10, overhead_target=0.10)
    for _ in range(2):
        feed(c, [1000.0, 1000.0], 0.0, fill_ms=[300.0, 0.0])
    assert c.last_overhead == pytest.approx(300 / 1300)
    assert c.proposed_anchor == 20
    other = ElCheController(2, 10, overhead_target=0.10)
    for _ in range(2):
        feed(other, [1000.0, 1000.0], 0.0, fill_ms=[0.0, 300.0])
    assert other.proposed_anchor is None
    assert other.last_overhead == 0.0


def test_proposal_respects_min_anchor() -> None:
    # A nudge may go below min_anchor; growth from there jumps back to the floor at once:
    # overhead 0.13 / target 0.10 -> ceil(10 * 1.304) = 14, lifted to min_anchor 30.
    c = ElCheController(2, 30, overhead_target=0.10, min_anchor=30)
    c.nudge_anchor_down(1 / 3)
    assert c.anchor == 10
    reach_stable(c, [1000.0, 1000.0], [10, 10])
    c.report_timing([1000.0, 1000.0], [10, 10], 150.0)
    assert c.proposed_anchor == 30


def test_sync_policy_exempt_from_window_pressure_growth() -> None:
    windowed = ElCheController(2, 10)
    sync = ElCheController(2, 10, window_growth_applicable=False)
    for c in (windowed, sync):
        for _ in range(2):
            c.report_timing([10.0, 10.0], [10, 10], 10.0)  # 1 ms/batch, overhead 0.5
    assert windowed.proposed_anchor == 20
    assert sync.proposed_anchor is None
    for _ in range(10):
        sync.report_timing([10.0, 10.0], [10, 10], 10.0)
        assert sync.proposed_anchor is None
        sync.apply_verdict(Stable())
    assert sync.anchor == 10
    assert sync.last_overhead == pytest.approx(0.5), "overhead is still measured for logging"


def test_warmup_proposes_growth_from_the_second_calibration() -> None:
    c = ElCheController(2, 10)
    feed(c, [1000.0, 1000.0], 5000.0)
    assert c.phase == Phase.WARMUP
    assert c.proposed_anchor is None, "the first report never proposes"
    feed(c, [1000.0, 1000.0], 5000.0)  # 5000 / 6000 = 0.83 > 2 x 0.05
    assert c.phase == Phase.WARMUP
    assert c.proposed_anchor == 20
    c.apply_verdict(Stable())
    assert c.anchor == 20


def test_warmup_growth_still_dies_on_a_guard_veto() -> None:
    c = ElCheController(2, 10)
    feed(c, [1000.0, 1000.0], 5000.0)
    feed(c, [1000.0, 1000.0], 5000.0)
    assert c.proposed_anchor == 20
    c.apply_verdict(SuppressGrowth())
    assert c.anchor == 10
    assert c.proposed_anchor is None


def test_borderline_warmup_pressure_waits_for_stable() -> None:
    c = ElCheController(2, 10, overhead_target=0.10)
    for i in range(5):
        feed(c, [1000.0, 1000.0], 150.0)  # 150 / 1150 = 0.13: above 0.10, below 0.20
        assert c.proposed_anchor is None, f"report {i + 1} proposed during Warmup"
    assert c.phase == Phase.STABLE
    feed(c, [1000.0, 1000.0], 150.0)
    assert c.proposed_anchor == 14  # ceil(10 * 1.304)


# -- verdicts, nudge, relax -----------------------------------------------------------------


def test_nudge_anchor_down() -> None:
    c = ElCheController(2, 20, overhead_target=0.50)
    feed(c, [50.0, 100.0], 0.0)
    assert c.batch_counts == [40, 20]
    c.nudge_anchor_down(0.5)
    assert c.anchor == 10
    assert c.batch_counts == [20, 10]


def test_nudge_anchor_down_clamped_to_one() -> None:
    c = ElCheController(2, 5)
    c.nudge_anchor_down(0.1)  # ceil(0.5)
    assert c.anchor == 1
    c = ElCheController(2, 5)
    c.nudge_anchor_down(0.01)  # clamped to 0.1 first
    assert c.anchor == 1


def test_nudge_anchor_down_never_increases() -> None:
    c = ElCheController(2, 10)
    c.nudge_anchor_down(2.0)
    assert c.anchor == 10


def test_nudge_anchor_down_ignores_nan_factor() -> None:
    c = ElCheController(2, 10)
    for _ in range(6):
        c.report_timing([100.0, 100.0], [10, 10], 1.0)
    c.nudge_anchor_down(math.nan)
    c.nudge_anchor_down(math.inf)
    assert c.anchor == 10
    c.nudge_anchor_down(0.5)
    assert c.anchor == 5
    assert c.batch_counts == [5, 5]


def test_nudge_then_discard_survives_a_later_commit() -> None:
    c = ElCheController(2, 10)
    c.proposed_anchor = 20  # as a report would have staged it
    c.apply_verdict(NudgeDown(0.5))  # e.g. the meta-controller's LR-cliff nudge
    assert c.anchor == 5
    c.apply_verdict(Stable())  # the guard's verdict later in the same cycle
    assert c.anchor == 5


def test_nudge_without_discard_is_clobbered_by_commit() -> None:
    # Why the verdict seam discards: a bare nudge leaves the pre-nudge grow to be committed.
    c = ElCheController(2, 10)
    c.proposed_anchor = 20
    c.nudge_anchor_down(0.5)
    assert c.anchor == 5
    c.apply_verdict(Stable())
    assert c.anchor == 20


def test_verdict_nudge_down_discards_and_nudges() -> None:
    c = ElCheController(2, 10)
    c.proposed_anchor = 20
    c.consecutive_stable = 3
    c.apply_verdict(NudgeDown(0.5))
    assert c.anchor == 5
    assert c.proposed_anchor is None
    assert not c.growth_enabled
    assert c.consecutive_stable == 0
    c.apply_verdict(Stable())
    assert c.anchor == 5


def test_verdict_stable_commits_pending_grow() -> None:
    c = ElCheController(2, 10)
    c.proposed_anchor = 20
    c.apply_verdict(Stable())
    assert c.anchor == 20
    assert c.proposed_anchor is None
    assert c.consecutive_stable == 1


def test_verdict_stable_relax_up_drifts_anchor() -> None:
    c = ElCheController(2, 10)
    c.apply_verdict(Stable(), relax_up=True)
    assert c.anchor == 11
    c = ElCheController(2, 10)
    c.apply_verdict(Stable())
    assert c.anchor == 10


def test_verdict_stable_commits_before_relaxing() -> None:
    c = ElCheController(2, 10)
    c.proposed_anchor = 20
    c.apply_verdict(Stable(), relax_up=True)
    assert c.anchor == 21


def test_verdict_suppress_growth_drops_proposal_and_latches() -> None:
    c = ElCheController(2, 10)
    c.proposed_anchor = 20
    c.apply_verdict(SuppressGrowth())
    assert c.anchor == 10
    assert not c.growth_enabled
    c.apply_verdict(Stable())
    assert c.anchor == 10


def test_apply_verdict_rejects_unknown_verdicts() -> None:
    with pytest.raises(TypeError, match="verdict"):
        ElCheController(2, 10).apply_verdict("Stable")  # type: ignore[arg-type]


def test_relax_anchor_up_grows_anchor() -> None:
    c = ElCheController(2, 10, overhead_target=0.50)
    feed(c, [500.0, 1000.0], 5.0)
    assert c.relax_anchor_up() is True
    assert c.anchor == 11
    assert c.batch_counts == [22, 11]


def test_relax_anchor_up_capped_by_max_batch_diff() -> None:
    # 1:3 speeds: at anchor 11 the fast rank would run 33, 22 more than the anchor (> 20).
    c = ElCheController(2, 10, overhead_target=0.50, max_batch_diff=20)
    feed(c, [300.0, 900.0], 5.0)
    assert c.batch_counts == [30, 10]
    assert c.relax_anchor_up() is False
    assert c.anchor == 10


def test_relax_anchor_up_capped_by_max_anchor() -> None:
    c = ElCheController(2, 10, overhead_target=0.50, max_anchor=11)
    feed(c, [500.0, 1000.0], 5.0)
    assert c.relax_anchor_up() is True
    assert c.anchor == 11
    assert c.relax_anchor_up() is False
    assert c.anchor == 11


# -- timing feed ----------------------------------------------------------------------------


def test_report_timing_rejects_wrong_lengths() -> None:
    c = ElCheController(2, 10)
    with pytest.raises(ValueError, match="wall_ms has 3 entries"):
        c.report_timing([1.0, 1.0, 1.0], [1, 1], 0.0)
    with pytest.raises(ValueError, match="batches has 1 entries"):
        c.report_timing([1.0, 1.0], [1], 0.0)
    with pytest.raises(ValueError, match="fill_ms has 1 entries"):
        c.report_timing([1.0, 1.0], [1, 1], 0.0, [0.0])
    assert not c.calibrated


def test_no_reading_reports_nothing() -> None:
    c = ElCheController(2, 10)
    c.report_timing([0.0, math.inf], [5, 5], 100.0)
    assert not c.calibrated
    assert c.phase == Phase.PROBE
    assert c.anchor_rank is None


# -- from_config ----------------------------------------------------------------------------


def test_from_config_defaults() -> None:
    c = ElCheController.from_config(ElCheConfig(), 2)
    assert (c.anchor, c.min_anchor, c.max_anchor) == (10, 10, 1000)
    assert c.overhead_target == 0.05
    assert c.max_batch_diff is None
    assert c.window_growth_applicable
    assert c.anchor_rank is None


def test_from_config_knobs_and_sync_mode() -> None:
    cfg = ElCheConfig(
        mode="cpu_sync", max_anchor=40, min_anchor=2, overhead_target=0.2, max_batch_diff=7
    )
    c = ElCheController.from_config(cfg, 3)
    assert (c.anchor, c.min_anchor, c.max_anchor) == (2, 2, 40)  # sync modes start at 1
    assert c.overhead_target == 0.2
    assert c.max_batch_diff == 7
    assert not c.window_growth_applicable
    assert not ElCheController.from_config(ElCheConfig.nccl_sync(), 2).window_growth_applicable
    assert ElCheController.from_config(ElCheConfig.cpu_async(), 2).window_growth_applicable


def test_from_config_pins_smallest_partition_ratio() -> None:
    c = ElCheController.from_config(ElCheConfig(partition_ratios=[0.5, 0.2, 0.3]), 3)
    assert c.anchor_rank == 1
    tied = ElCheController.from_config(ElCheConfig(partition_ratios=[0.4, 0.3, 0.3]), 3)
    assert tied.anchor_rank == 1
    with pytest.raises(ValueError, match="partition_ratios"):
        ElCheController.from_config(ElCheConfig(partition_ratios=[0.5, 0.5]), 3)


# -- checkpoint state -----------------------------------------------------------------------


def _trained_controller() -> ElCheController:
    c = ElCheController(3, 10, overhead_target=0.10)
    for _ in range(6):
        c.report_timing([300.0, 1000.0, 0.0], [10, 10, 0], 400.0)
        c.apply_verdict(Stable())
    c.apply_verdict(SuppressGrowth())
    c.apply_verdict(Stable())
    return c


def test_state_dict_round_trip() -> None:
    source = _trained_controller()
    state = json.loads(json.dumps(source.state_dict()))
    # Grew 10 -> 20 on report 2 (Warmup bar), 20 -> 34 on report 6 (0.167 / 0.10 = 1.67).
    assert state == {
        "world_size": 3,
        "anchor": 34,
        "anchor_rank": 1,
        "smoothed_ms": [30.0, 100.0, None],
        "phase": int(Phase.STABLE),
        "calibration_count": 6,
        "batch_counts": [113, 34, 34],
        "growth_enabled": False,
        "consecutive_stable": 1,
    }
    resumed = ElCheController(3, 4, max_anchor=500, overhead_target=0.3)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state
    assert resumed.calibrated
    assert resumed.phase is Phase.STABLE
    assert resumed.anchor * resumed.smoothed_ms(resumed.anchor_rank) == 3400.0  # the window's wall time
    assert (resumed.max_anchor, resumed.overhead_target) == (500, 0.3), "knobs are not restored"
    # Each ring restarts from one sample equal to the saved mean.
    resumed.report_timing([600.0, 1000.0, 0.0], [20, 10, 0], 1.0)
    assert resumed.smoothed_ms(0) == 30.0
    resumed.report_timing([400.0, 1000.0, 0.0], [20, 10, 0], 1.0)
    assert resumed.smoothed_ms(0) == pytest.approx((30.0 + 30.0 + 20.0) / 3)


@pytest.mark.parametrize("new_world", [2, 4])
def test_load_state_dict_at_another_world_size_keeps_the_run_and_recalibrates_the_ranks(new_world) -> None:
    state = _trained_controller().state_dict()  # 3 ranks, anchor 34, Stable, growth latched off
    resumed = ElCheController(new_world, 10, max_batch_diff=2)
    resumed.load_state_dict(state)
    # What describes the run, not its ranks, is kept.
    assert resumed.anchor == 34
    assert resumed.phase is Phase.STABLE and resumed.calibration_count == 6
    assert (resumed.growth_enabled, resumed.consecutive_stable) == (False, 1)
    # The per-rank part starts over: no speeds, every rank at the anchor, no anchor rank.
    assert resumed.batch_counts == [34] * new_world
    assert [resumed.smoothed_ms_or_none(r) for r in range(new_world)] == [None] * new_world
    assert resumed.anchor_rank is None and not resumed.calibrated
    assert resumed.state_dict()["world_size"] == new_world
    # The first report calibrates the new ranks at once (not limited by max_batch_diff=2 per update).
    walls = [1000.0] + [250.0] * (new_world - 1)
    resumed.report_timing(walls, [10] * new_world, 1.0)
    assert resumed.anchor_rank == 0 and resumed.anchor == 34
    assert resumed.batch_counts == [34] + [136] * (new_world - 1)


def test_load_state_dict_at_another_world_size_restores_the_partition_pin() -> None:
    state = _trained_controller().state_dict()  # its anchor rank is 1
    pinned = ElCheController(2, 10, initial_anchor_rank=0)
    pinned.anchor_rank = 1  # a controller that already ran: the constructed pin is what comes back
    pinned.load_state_dict(state)
    assert pinned.anchor_rank == 0


def test_load_state_dict_rejects_malformed_entries() -> None:
    state = _trained_controller().state_dict()
    with pytest.raises(ValueError, match="phase"):
        ElCheController(3, 10).load_state_dict({**state, "phase": 7})
    with pytest.raises(ValueError, match="anchor_rank"):
        ElCheController(3, 10).load_state_dict({**state, "anchor_rank": 3})
    with pytest.raises(ValueError, match="batch_counts"):
        ElCheController(3, 10).load_state_dict({**state, "batch_counts": [1, 2]})
    with pytest.raises(ValueError, match="smoothed_ms"):
        ElCheController(3, 10).load_state_dict({**state, "smoothed_ms": [1.0, "x", None]})
    # Per-rank entries must fit the state's own world size (whatever the resuming run's is).
    with pytest.raises(ValueError, match=r"state\['world_size'\]=None"):
        ElCheController(3, 10).load_state_dict({k: v for k, v in state.items() if k != "world_size"})
    with pytest.raises(ValueError, match=r"smoothed_ms.*one entry per saved rank \(3\)"):
        ElCheController(2, 10).load_state_dict({**state, "smoothed_ms": [1.0, 2.0]})
    with pytest.raises(ValueError, match="batch_counts"):
        ElCheController(4, 10).load_state_dict({**state, "batch_counts": [1, 2, 3, 4]})


# -- invariants (property style, seeded) ----------------------------------------------------

VERDICT_KINDS = ("stable", "stable_relax", "suppress", "nudge")


def _random_controller(rng: random.Random) -> ElCheController:
    world_size = rng.randint(2, 4)
    c = ElCheController(
        world_size,
        rng.randint(1, 30),
        max_anchor=rng.choice([None, 40, 200]),
        overhead_target=rng.choice([None, 0.02, 0.1, 0.3]),
        max_batch_diff=rng.choice([None, 0, 3, 25]),
        window_growth_applicable=rng.random() < 0.85,
        initial_anchor_rank=rng.choice([None, rng.randrange(world_size)]),
    )
    c.max_total_batches = rng.choice([0, 0, 50, 400])
    return c


def _random_report(
    rng: random.Random, c: ElCheController
) -> tuple[list[float], list[int], float, list[float] | None]:
    walls: list[float] = []
    batches: list[int] = []
    for count in c.batch_counts:
        roll = rng.random()
        if roll < 0.08:
            walls.append(rng.choice([0.0, math.nan, math.inf, -3.0]))
            batches.append(rng.choice([0, count]))
        else:
            walls.append(count * rng.uniform(0.5, 400.0))
            batches.append(count)
    sync = rng.choice([0.0, rng.uniform(0.0, 50.0), rng.uniform(100.0, 20_000.0)])
    fill = None if rng.random() < 0.5 else [rng.uniform(0.0, 500.0) for _ in walls]
    return walls, batches, sync, fill


def test_invariant_anchor_never_changes_inside_report_timing() -> None:
    proposals = 0
    for seed in range(40):
        rng = random.Random(seed)
        c = _random_controller(rng)
        for _ in range(50):
            before = c.anchor
            c.report_timing(*_random_report(rng, c))
            assert c.anchor == before, f"seed {seed}: report_timing moved the anchor"
            proposals += c.proposed_anchor is not None
            assert min(c.batch_counts) >= 1
            for kind in rng.choices(VERDICT_KINDS, weights=(6, 2, 1, 1), k=rng.randint(0, 2)):
                _apply(c, kind, rng)
    assert proposals > 100, "the scenarios must exercise growth proposals"


def _apply(c: ElCheController, kind: str, rng: random.Random) -> None:
    if kind == "stable":
        c.apply_verdict(Stable())
    elif kind == "stable_relax":
        c.apply_verdict(Stable(), relax_up=True)
    elif kind == "suppress":
        c.apply_verdict(SuppressGrowth())
    else:
        c.apply_verdict(NudgeDown(rng.uniform(0.05, 1.0)))


def test_invariant_nudge_down_is_never_overwritten_by_a_later_commit() -> None:
    nudged_over_a_proposal = 0
    for seed in range(40):
        rng = random.Random(1000 + seed)
        c = _random_controller(rng)
        for _ in range(50):
            c.report_timing(*_random_report(rng, c))
            ceiling: int | None = None
            kinds = [rng.choice(("stable", "suppress", "nudge")) for _ in range(rng.randint(1, 4))]
            for kind in kinds:
                had_proposal = c.proposed_anchor is not None
                before = c.anchor
                _apply(c, kind, rng)
                if kind == "nudge":
                    assert c.anchor <= before
                    nudged_over_a_proposal += had_proposal
                    ceiling = c.anchor if ceiling is None else min(ceiling, c.anchor)
                elif ceiling is not None:
                    assert c.anchor <= ceiling, f"seed {seed}: a commit overwrote the nudge"
            if rng.random() < 0.3:  # let growth re-arm so that proposals keep coming
                for _ in range(5):
                    c.apply_verdict(Stable())
    assert nudged_over_a_proposal > 50, "the scenarios must nudge over pending proposals"


def test_epoch_size_caps_the_window_with_at_least_one_batch_per_rank():
    c = ctl.ElCheController(world_size=3, anchor=10)
    c.set_epoch_size(120)
    assert c.max_total_batches == 120
    c.set_epoch_size(2)  # fewer batches than ranks: every rank still plans one
    assert c.max_total_batches == 3
    with pytest.raises(ValueError, match="num_batches=-1"):
        c.set_epoch_size(-1)


def test_planned_batches_bound_the_lead_over_the_slowest_plan():
    c = ctl.ElCheController(world_size=2, anchor=3, max_batch_diff=2)
    c.batch_counts = [9, 3]
    c._calibration_windows_left = 0  # past the short calibration windows
    assert [c.planned_batches(0), c.planned_batches(1)] == [5, 3]
    free = ctl.ElCheController(world_size=2, anchor=3)
    free.batch_counts = [9, 3]
    free._calibration_windows_left = 0
    assert [free.planned_batches(0), free.planned_batches(1)] == [9, 3]


def test_the_first_two_windows_are_short_calibration_windows() -> None:
    c = ctl.ElCheController(world_size=2, anchor=10)
    assert c.batch_counts == [10, 10]  # the plan keeps the anchor's counts ...
    assert [c.planned_batches(0), c.planned_batches(1)] == [2, 2]  # ... the window runs 2 batches
    feed(c, [2 * 50.0, 2 * 200.0], 1.0, batches=[2, 2])  # the warm-up reading
    assert c.batch_counts == [40, 10]
    assert [c.planned_batches(0), c.planned_batches(1)] == [8, 2]  # the same ratio, at anchor 2
    feed(c, [8 * 50.0, 2 * 200.0], 1.0, batches=[8, 2])
    assert [c.planned_batches(0), c.planned_batches(1)] == [40, 10]
    small = ctl.ElCheController(world_size=2, anchor=1)  # the sync modes' anchor: nothing to shorten
    assert small.planned_batches(0) == 1


def calibrated(world_size: int = 2, **knobs: object) -> ElCheController:
    """A controller past its calibration windows, rank 0 4x faster: plan [40, 10]."""
    c = ctl.ElCheController(world_size=world_size, anchor=10, **knobs)  # type: ignore[arg-type]
    for _ in range(ctl.CALIBRATION_WINDOWS):
        feed(c, [50.0 * 40, 200.0 * 10] + [200.0 * 10] * (world_size - 2), 1.0,
             batches=[40] + [10] * (world_size - 1))
    return c


def test_a_window_that_covers_the_rest_of_the_epoch_runs_every_rank_to_its_end() -> None:
    c = calibrated(pooled_dispatch=True)
    c.set_epoch_size(64)
    assert c.batch_counts == [40, 10]
    c.set_epoch_batches_left(64)  # more than one window's 50
    assert not c.window_reaches_epoch_end
    assert [c.planned_batches(0), c.planned_batches(1)] == [40, 10]
    c.set_epoch_batches_left(50)
    assert c.window_reaches_epoch_end
    # Every rank plans what is left: it joins the round when it runs out of data.
    assert [c.planned_batches(0), c.planned_batches(1)] == [50, 50]
    assert c.batch_counts == [40, 10]  # the plan itself (shares, reports) is unchanged
    c.set_epoch_batches_left(None)
    assert [c.planned_batches(0), c.planned_batches(1)] == [40, 10]
    with pytest.raises(ValueError, match="batches=-1"):
        c.set_epoch_batches_left(-1)


def test_while_joiners_wait_no_window_reaches_the_epoch_end() -> None:
    # An admission needs a round with data left on every rank: one-window epochs never give one.
    c = calibrated(pooled_dispatch=True)
    c.set_epoch_size(64)
    c.set_epoch_batches_left(50)
    assert c.window_reaches_epoch_end
    c.keep_a_round_before_the_epoch_end(True)
    assert not c.window_reaches_epoch_end
    planned = [c.planned_batches(0), c.planned_batches(1)]
    assert planned == [20, 5] and sum(planned) <= 50 // 2, planned  # the plan's shares, half the rest
    c.set_epoch_batches_left(200)
    assert [c.planned_batches(0), c.planned_batches(1)] == [40, 10]
    c.set_epoch_batches_left(3)  # every rank still runs a batch
    assert [c.planned_batches(0), c.planned_batches(1)] == [1, 1]
    c.keep_a_round_before_the_epoch_end(False)
    c.set_epoch_batches_left(50)
    assert [c.planned_batches(0), c.planned_batches(1)] == [50, 50]


def test_a_window_to_the_epoch_end_needs_the_pool_and_no_lead_bound() -> None:
    for c in (calibrated(), calibrated(pooled_dispatch=True, max_batch_diff=50)):
        c.set_epoch_batches_left(20)
        assert not c.window_reaches_epoch_end
        assert c.planned_batches(1) == 10
    assert ElCheController.from_config(ElCheConfig.preset("nccl_cadence"), 2)._pooled_dispatch
    assert ElCheController.from_config(ElCheConfig.preset("cpu_async"), 2)._pooled_dispatch
    assert not ElCheController.from_config(ElCheConfig.preset("nccl_sync"), 2)._pooled_dispatch
    fixed = ElCheConfig(mode="nccl_cadence", partition_ratios=[0.8, 0.2])
    assert not ElCheController.from_config(fixed, 2)._pooled_dispatch


def test_losing_ranks_or_loading_a_state_forgets_what_is_left_of_the_epoch() -> None:
    c = calibrated(world_size=3, pooled_dispatch=True)
    c.set_epoch_batches_left(30)
    assert c.window_reaches_epoch_end
    # The lost rank's untrained batches come back: unknown until the next round.
    c.apply_change(Change(generation=1, before=(0, 1, 2), after=(0, 2)))
    assert not c.window_reaches_epoch_end
    resumed = calibrated(pooled_dispatch=True)
    resumed.set_epoch_batches_left(30)
    resumed.load_state_dict(c.state_dict())
    assert not resumed.window_reaches_epoch_end


def test_a_joiner_starts_with_no_reading_and_is_planned_from_its_first_window() -> None:
    c = calibrated()  # plan [40, 10]: rank 0 at 50 ms/batch, rank 1 (the anchor rank) at 200
    c.set_epoch_batches_left(500)
    c.apply_change(Change(generation=1, before=(0, 1), after=(0, 1, 7)))  # member 7 joins as rank 2
    assert c.world_size == 3 and c.anchor_rank == 1
    assert c.batch_counts == [40, 10, 10], "a rank without a reading plans the anchor's count"
    assert [c.smoothed_ms_or_none(r) for r in range(3)] == [50.0, 200.0, None]
    assert c.speed_shares() is None, "no speed shares until the joiner has a reading"
    # The short calibration windows again, so that the guessed plan is soon a measured one.
    assert [c.planned_batches(r) for r in range(3)] == [8, 2, 2]
    assert c.state_dict()["world_size"] == 3 and c.state_dict()["smoothed_ms"][2] is None
    feed(c, [50.0 * 8, 200.0 * 2, 100.0 * 2], 1.0, batches=[8, 2, 2])  # the joiner: 100 ms/batch
    assert c.batch_counts == [40, 10, 20], "re-planned from the joiner's first reading"
    assert c.speed_shares() is not None
    with pytest.raises(ValueError, match=r"apply_change.*expected a change of this controller's 3 ranks"):
        c.apply_change(Change(generation=2, before=(0, 1), after=(0,)))


def test_a_loss_and_a_join_in_one_change_renumber_the_survivors_first() -> None:
    c = calibrated(world_size=3)  # rank 0 at 50 ms/batch, ranks 1 and 2 at 200; anchor rank 1
    assert c.anchor_rank == 1
    c.apply_change(Change(generation=1, before=(0, 1, 2), after=(0, 2, 3)))  # rank 1 lost, member 3 joins
    assert c.world_size == 3 and c.anchor_rank is None, "the lost anchor rank is elected again"
    assert [c.smoothed_ms_or_none(r) for r in range(3)] == [50.0, 200.0, None]
    feed(c, [50.0 * 8, 200.0 * 2, 400.0 * 2], 1.0, batches=[8, 2, 2])
    assert c.anchor_rank == 2, "the slow joiner is the anchor rank now"


def test_speed_shares_follow_the_measured_speeds_once_every_rank_has_a_reading() -> None:
    c = ctl.ElCheController(world_size=2, anchor=10)
    assert c.speed_shares() is None
    feed(c, [100.0, 0.0], 1.0, batches=[2, 0])  # rank 1 trained nothing: no reading
    assert c.speed_shares() is None
    feed(c, [100.0, 450.0], 1.0, batches=[2, 2])
    # 50 ms vs 225 ms per batch: shares 0.818 / 0.182, not the plan's rounded 45 / 10.
    assert c.speed_shares() == pytest.approx([225 / 275, 50 / 275])


def test_a_first_window_to_the_epoch_end_needs_no_calibration_round() -> None:
    # 30 batches per epoch: the anchor's first window (10 + 10) does not reach the end, its short
    # calibration window does not either. At 16 batches the first window reaches the end: the
    # pool shares the epoch as the ranks claim it, and that long window ends the calibration.
    short = ctl.ElCheController(world_size=2, anchor=10, pooled_dispatch=True)
    short.set_epoch_batches_left(30)
    assert [short.planned_batches(0), short.planned_batches(1)] == [2, 2]
    tiny = ctl.ElCheController(world_size=2, anchor=10, pooled_dispatch=True)
    tiny.set_epoch_batches_left(16)
    assert [tiny.planned_batches(0), tiny.planned_batches(1)] == [16, 16]
    feed(tiny, [12 * 50.0, 4 * 200.0], 1.0, batches=[12, 4])
    tiny.set_epoch_batches_left(100)
    assert [tiny.planned_batches(0), tiny.planned_batches(1)] == [40, 10]


def test_a_resume_on_another_world_size_calibrates_again() -> None:
    saved = calibrated().state_dict()
    same = ctl.ElCheController(world_size=2, anchor=10)
    same.load_state_dict(saved)
    assert same.planned_batches(0) == 40
    resized = ctl.ElCheController(world_size=3, anchor=10)
    resized.load_state_dict(saved)
    assert [resized.planned_batches(r) for r in range(3)] == [2, 2, 2]
