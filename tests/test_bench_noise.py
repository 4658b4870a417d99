"""A noise-proof CPU rig (issue 25, item 4): the spread of repeated passes, the throttle's measured
slowdown in each, and the warnings when the machine was not steady. Formulas only, no processes."""

from __future__ import annotations

from typing import Any, Optional

import pytest

from lightning_elche.bench import metrics
from lightning_elche.bench.__main__ import warn_noise
from lightning_elche.bench.report import noise_lines, throughput_table


def _record(rank: int, samples_per_s: float, span: float = 10.0) -> dict[str, Any]:
    """A rank record as the worker writes it: ``samples_per_s`` over ``span`` seconds, batches of 10."""
    steps = round(samples_per_s * span / 10)
    return {
        "rank": rank,
        "t_fit0": 0.0,
        "t_start": 1.0,
        "t_end": 1.0 + span,
        "eval_s": 0.0,
        "samples": steps * 10,
        "steps": steps,
        "total_samples": steps * 10,
        "total_steps": steps,
        "epochs": 3,
        "batch_size": 10,
        "stopped_by_cap": False,
        "trace": [],
        "model": {"grad_bytes": 4000, "buffer_bytes": 0, "param_bytes": 4000, "float_buffer_bytes": 0},
    }


def _pass(solo: tuple[float, float], ddp: float, closing: Optional[tuple[float, float]] = None) -> dict[str, Any]:
    """One 2-rank pass: the solo rates of ranks 0 and 1, DDP's rate per rank (both ranks), and
    with ``closing`` the solos again after the arms (A-B-A)."""
    records = {"s": [_record(0, solo[0]), _record(0, solo[1])], "d": [_record(r, ddp) for r in range(2)]}
    jobs = [("solo", "s"), ("ddp", "d")]
    if closing is not None:
        records["e"] = [_record(0, closing[0]), _record(0, closing[1])]
        jobs.append(("solo", "e"))
    return metrics.throughput_pass(jobs, records)


def _kinds(section: dict[str, Any]) -> list[tuple[str, str, Optional[int]]]:
    return [(w["kind"], w["arm"], w["pass"]) for w in section["noise_warnings"]]


def test_each_arm_gets_the_median_and_range_of_its_passes_in_the_json_and_the_table():
    # Ideal 100 + 25 = 125/s in every pass; DDP 2 x 25, 2 x 30, 2 x 20 samples/s: 0.4, 0.48, 0.32.
    section = metrics.aggregate_passes([_pass((100, 25), 25), _pass((100, 25), 30), _pass((100, 25), 20)])
    ddp = section["arms"]["ddp"]
    assert ddp["samples_per_s"] == pytest.approx(50.0) and ddp["samples_per_s_range"] == pytest.approx([40.0, 60.0])
    assert ddp["efficiency"] == pytest.approx(0.4) and ddp["efficiency_range"] == pytest.approx([0.32, 0.48])
    assert ddp["efficiency_spread"] == pytest.approx(0.4)
    row = next(line for line in throughput_table(section) if line.startswith("| `ddp` |"))
    assert "| 50.0 [40.0, 60.0] | 0.40 [0.32, 0.48] |" in row
    assert section["spread_warnings"] == ["ddp"] and _kinds(section) == [("efficiency_spread", "ddp", None)]
    assert "**Warning**: the efficiency varies by more than 5 % between passes: `ddp` 40.0 %;" in "\n".join(
        noise_lines(section)
    )
    # One pass: no range, so the committed single-pass tables replot unchanged.
    single = metrics.aggregate_passes([_pass((100, 25), 25)])
    assert "samples_per_s_range" not in single["arms"]["ddp"] and single["noise_warnings"] == []
    assert "[" not in next(line for line in throughput_table(single) if line.startswith("| `ddp` |"))


def test_the_measured_slowdown_range_of_each_pass_spans_its_solo_fits():
    # Pass 1: 4x before the arms, 100 / 30 after (3.33x), 3.64x on the mean rates; without a
    # bracket a pass has one solo pair, so one value.
    bracketed = _pass((100, 25), 25, closing=(100, 30))
    assert bracketed["measured_slowdown_range"] == pytest.approx([100 / 30, 4.0])
    assert _pass((100, 25), 25)["measured_slowdown_range"] == pytest.approx([4.0, 4.0])
    section = metrics.aggregate_passes([bracketed, _pass((100, 25), 25, closing=(100, 25))])
    flat = [v for low_high in section["measured_slowdown_range_per_pass"] for v in low_high]
    assert flat == pytest.approx([100 / 30, 4.0, 4.0, 4.0])
    text = "\n".join(noise_lines(section))
    assert "Measured slowdown per pass [min, max] of its solo fits: 3.64x [3.33x, 4.00x], 4.00x [4.00x, 4.00x]." in text


def test_a_solo_drifting_more_than_5_percent_between_passes_warns():
    steady = metrics.aggregate_passes([_pass((100, 25), 25), _pass((104, 25), 26)])  # 3.9 % apart
    assert not [w for w in steady["noise_warnings"] if w["kind"] == "solo_drift"]
    assert steady["arms"]["solo_rank0"]["rate_drift"] == pytest.approx(4 / 102)
    drifting = metrics.aggregate_passes([_pass((100, 25), 25), _pass((100, 25), 25), _pass((110, 25), 27)])
    assert drifting["arms"]["solo_rank0"]["rate_drift"] == pytest.approx(0.1)
    assert ("solo_drift", "solo_rank0", None) in _kinds(drifting)
    assert ("solo_drift", "solo_rank1", None) not in _kinds(drifting)
    text = "\n".join(noise_lines(drifting))
    assert "**Warning**: the solo rate drifts by more than 5 % between passes: `solo_rank0` 10.0 %;" in text
    assert "Solo samples/s per pass (drift = (max - min) / median): `solo_rank0` 100, 100, 110 (drift 10.0 %)" in text


def test_a_solo_moving_more_than_5_percent_within_an_a_b_a_pass_warns_with_its_pass():
    section = metrics.aggregate_passes(
        [
            _pass((100, 25), 25, closing=(100, 25.5)),  # +2 %: quiet
            _pass((100, 25), 25, closing=(93, 25)),
        ]
    )  # rank 0 -7 %
    assert _kinds(section) == [("solo_drift_in_pass", "solo_rank0", 2)]
    assert section["noise_warnings"][0]["value"] == pytest.approx(-0.07)
    assert "moved by more than 5 % across the arms of a pass: `solo_rank0` -7.0 % (pass 2);" in "\n".join(
        noise_lines(section)
    )
    assert "moved by -7.0 % across the arms of pass 2" in section["noise_warnings"][0]["message"]


def test_the_warnings_go_to_stderr_for_every_setting(capsys):
    noisy = metrics.aggregate_passes([_pass((100, 25), 25), _pass((100, 25), 35)])
    quiet = metrics.aggregate_passes([_pass((100, 25), 25), _pass((100, 25), 25)])
    result = {**quiet, "setting": {"label": "k3"}, "other_settings": {"k1": noisy}}
    lines = warn_noise(result)
    err = capsys.readouterr().err
    assert lines and err.splitlines() == lines
    assert err.startswith("[bench] warning (k1): the efficiency of `ddp` varies by 33.3 % between passes")
    assert warn_noise({**quiet, "setting": {"label": "k3"}}) == [] and capsys.readouterr().err == ""


def test_each_elche_arm_gets_the_median_range_and_spread_of_its_in_arm_efficiency_beside_its_efficiency():
    """The machine moved between passes (efficiency 0.80, 0.95, 0.88: a 17 % spread) while the ranks'
    own speeds inside the arm kept the in-arm efficiency at 0.93-0.94: both are reported, side by side."""
    from lightning_elche.bench.report import in_arm_table

    def one(efficiency: float, in_arm: float) -> dict[str, Any]:
        arm = {"kind": "elche", "samples_per_s": 100 * efficiency, "efficiency": efficiency,
               "in_arm_efficiency": in_arm, "idle": [0.0, 0.0]}
        return {"measured_slowdown": 4.0, "ideal_samples_per_s": 100.0, "speed_share": [0.8, 0.2],
                "arms": {"ddp": {"kind": "ddp", "samples_per_s": 40.0, "efficiency": 0.4, "idle": [0.0, 0.0]},
                         "cpu_async": arm}}

    section = metrics.aggregate_passes([one(0.80, 0.93), one(0.95, 0.94), one(0.88, 0.935)])
    row = section["arms"]["cpu_async"]
    assert row["in_arm_efficiency"] == pytest.approx(0.935)
    assert row["in_arm_efficiency_range"] == pytest.approx([0.93, 0.94])
    assert row["in_arm_efficiency_spread"] == pytest.approx(0.01 / 0.935)
    assert row["efficiency_spread"] == pytest.approx(0.15 / 0.88)
    assert "in_arm_efficiency_spread" not in section["arms"]["ddp"]
    lines = in_arm_table(section)
    assert lines[2] == "| `cpu_async` | 0.88 [0.80, 0.95] | 17.0 % | 0.94 [0.93, 0.94] | 1.1 % |", lines
    assert all("`ddp`" not in line for line in lines), "DDP's ranks have no window compute to read"
    assert in_arm_table(metrics.aggregate_passes([_pass((100, 25), 25)])) == [], "no ElChe arm, no table"
