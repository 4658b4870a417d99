"""The benchmark harness: its formulas (no processes) and two end-to-end runs on 2 CPU ranks.

The end-to-end runs use ``--budget tiny`` and check the structure of the JSON and that every
number that must be finite and positive is; no timing is asserted (CI machines are too noisy).
Each run is a subprocess in its own session, so that a hang is cleaned up with its rank processes.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Optional

import pytest
from process_helpers import run_command

from lightning_elche.bench import metrics
from lightning_elche.bench.arms import available_elche_modes
from lightning_elche.bench.config import RIGS, BenchConfig, build_config, parse_args
from lightning_elche.bench.plan import CONVERGENCE, SOLO_PAIR, THROUGHPUT, build_plan

COMMAND_TIMEOUT_S = 170


def run_bench(args: list[str], cwd: Path) -> tuple[int, str]:
    return run_command([sys.executable, "-m", "lightning_elche.bench", *args], cwd, COMMAND_TIMEOUT_S)


def positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def fraction(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and 0.0 <= value <= 1.0


# -- formulas and plan (no processes) --------------------------------------------------------


def test_bytes_formulas():
    assert metrics.ring_allreduce_bytes(1000, 2) == 1000
    assert metrics.ring_allreduce_bytes(1000, 4) == 1500
    # DDP, 2 ranks, 10 steps: each rank sends its gradient bytes once per step, plus the buffers.
    assert metrics.ddp_bytes(10, grad_bytes=400, buffer_bytes=8, world=2) == 10 * (2 * 400 + 8)
    # Post-local SGD: 3 warm-up all-reduces, 2 averages, buffer broadcast every step.
    assert metrics.local_sgd_bytes(10, 3, 2, grad_bytes=400, buffer_bytes=8, world=2) == 3 * 800 + 2 * 800 + 10 * 8
    # ElChe: per round 2 x (params + float buffers) plus the metadata all-gather.
    assert metrics.elche_bytes(5, param_bytes=400, float_buffer_bytes=100, meta_bytes=96, world=2) == 5 * (
        2 * 500 + 2 * 96)
    # bf16 wire (cpu_* modes): the parameters travel as an all-gather of half-size snapshots.
    assert metrics.elche_bytes(1, param_bytes=400, float_buffer_bytes=0, meta_bytes=0, world=2, bf16_wire=True) == 400
    assert metrics.bus_bandwidth(1000, 0.5, 2) == 2000


def test_stall_per_sync():
    trace = [{"stall_ms": [None, None]}, {"stall_ms": [1.0, 3.0]}, {"stall_ms": [3.0, None]}]
    totals = [{"compute_s": 1.0, "steps": 100}, {"compute_s": 3.0, "steps": 100}]
    stall = metrics.stall_per_sync(trace, totals)
    assert stall["mean_ms"] == [2.0, 3.0] and stall["rounds_measured"] == [2, 1]
    assert stall["fraction_of_step"] == pytest.approx([0.2, 0.1])
    assert metrics.stall_per_sync([{"stall_ms": [None, None]}], totals) is None


def test_time_to_target_and_spread():
    curve = [{"train_s": 0.0, "acc": 0.1}, {"train_s": 1.0, "acc": 0.8}, {"train_s": 2.0, "acc": 0.95}]
    assert metrics.time_to_target(curve, "acc", 0.9, higher_is_better=True) == 2.0
    assert metrics.time_to_target(curve, "acc", 0.99, higher_is_better=True) is None
    loss = [{"train_s": 0.0, "loss": 3.0}, {"train_s": 1.5, "loss": 1.0}]
    assert metrics.time_to_target(loss, "loss", 1.2, higher_is_better=False) == 1.5
    assert metrics.spread([3.0, None, 1.0, 2.0])["median"] == 2.0
    # A seed that never reached the target counts as the slowest.
    assert metrics.spread([1.0, None, 2.0], missing_is_worst=True)["median"] == 2.0
    assert metrics.spread([1.0, None], missing_is_worst=True)["median"] is None
    assert metrics.default_target([0.9, 0.92, 0.91], higher_is_better=True) == pytest.approx(0.895)
    assert metrics.default_target([2.0, 1.9], higher_is_better=False) == pytest.approx(2.02)


def _config(argv: list[str]) -> BenchConfig:
    modes, skipped = available_elche_modes()
    return build_config(parse_args(argv), modes, skipped)


def test_plan_interleaves_arms_and_lists_every_constructible_mode():
    config = _config(["--rig", "cpu2", "--budget", "full", "--throughput-seeds", "2", "--no-bracket"])
    modes, skipped = available_elche_modes()
    assert {"nccl_sync", "nccl_cadence"} <= set(modes)
    assert set(modes) | set(skipped) == {"nccl_sync", "nccl_cadence", "cpu_sync", "cpu_cadence", "cpu_async"}
    plan = build_plan(config)
    throughput = [g for g in plan if g.section == THROUGHPUT]
    convergence = [g for g in plan if g.section == CONVERGENCE]
    assert len(convergence) == 3
    assert [g.jobs[0].setting.label for g in throughput] == ["k3", "k3", "k1", "k1"]
    for group in throughput:
        assert group.jobs[0].arm == SOLO_PAIR
        assert {job.arm for job in group.jobs[1:]} == {"ddp", "ddp_post_local_sgd", *modes}
    assert throughput[0].jobs[1].arm != throughput[1].jobs[1].arm, "arm order does not rotate between passes"
    assert throughput[0].check_throttle and not throughput[0].skippable
    assert not any(g.check_throttle for g in throughput if g.jobs[0].setting.label == "k1")


def test_cpu_passes_end_with_the_solos_again_and_tp_arms_restrict_only_throughput():
    config = _config(["--rig", "cpu4", "--budget", "full", "--throughput-seeds", "2", "--tp-arms",
                      "ddp,nccl_cadence,cpu_async"])
    assert config.bracket_solos and not _config(["--rig", "gpu2-homo"]).bracket_solos
    plan = build_plan(config)
    throughput = [g for g in plan if g.section == THROUGHPUT]
    for group in throughput:
        assert group.jobs[0].arm == group.jobs[-1].arm == SOLO_PAIR  # A-B-A
        assert group.jobs[-1].job_id == group.jobs[0].job_id + "-end"
        assert {job.arm for job in group.jobs[1:-1]} == {"ddp", "nccl_cadence", "cpu_async"}
    for group in plan:
        if group.section == CONVERGENCE:
            assert "cpu_cadence" in {job.arm for job in group.jobs}
    with pytest.raises(ValueError, match="--tp-arms"):
        _config(["--rig", "cpu4", "--tp-arms", "nccl_cadence"])


def test_a_bracketed_pass_takes_the_mean_solo_rates_and_warns_on_a_spread_above_5_percent():
    from lightning_elche.bench.report import noise_lines

    before = [_fit_record(0, steps=90, batch=10, span=9.0), _fit_record(0, steps=30, batch=10, span=9.0)]
    after = [_fit_record(0, steps=90, batch=10, span=11.25), _fit_record(0, steps=30, batch=10, span=9.0)]
    ddp = [_fit_record(r, steps=30, batch=10, span=6.0) for r in range(2)]
    tp = metrics.throughput_pass([("solo", "s"), ("ddp", "d"), ("solo", "e")], {"s": before, "d": ddp, "e": after})
    # Rank 0 alone: 100/s before the arms, 80/s after: the ideal counts 90.
    assert tp["ideal_samples_per_s"] == pytest.approx(90.0 + 100.0 / 3)
    assert tp["solo_bracket"]["drift"] == pytest.approx([-0.2, 0.0])
    assert tp["solo_bracket"]["measured_slowdown_opening"] == pytest.approx(3.0)
    assert tp["solo_bracket"]["measured_slowdown_closing"] == pytest.approx(2.4)
    steady = metrics.aggregate_passes([tp, tp])
    assert steady["arms"]["ddp"]["efficiency_spread"] == pytest.approx(0.0) and steady["spread_warnings"] == []
    slower = metrics.throughput_pass([("solo", "s"), ("ddp", "d")], {"s": before, "d": ddp})
    noisy = metrics.aggregate_passes([tp, slower, tp])
    first, second = tp["arms"]["ddp"]["efficiency"], slower["arms"]["ddp"]["efficiency"]
    assert noisy["arms"]["ddp"]["efficiency_spread"] == pytest.approx((first - second) / first)
    assert noisy["spread_warnings"] == ["ddp"]
    text = "\n".join(noise_lines(noisy))
    assert "**Warning**" in text and "`ddp`" in text and "before / after 3.00x / 2.40x" in text


def test_gpu_rigs_throttle_by_sm_count():
    assert RIGS["gpu2-hetero"].settings[0].sms == 32
    assert not RIGS["gpu2-homo"].settings[0].throttled
    config = _config(["--rig", "gpu2-hetero"])
    assert config.conv_workload == "char" and config.budget.conv_seeds == 3


def test_workload_flags_reach_the_budget_and_conv_arms_restrict_only_convergence():
    config = _config(["--rig", "gpu2-hetero", "--model", "resnet20x4", "--tp-batch", "512", "--conv-batch", "32",
                      "--char-model", "medium", "--conv-arms", "ddp,nccl_sync,nccl_cadence"])
    assert (config.budget.model, config.budget.tp_batch, config.budget.conv_batch) == ("resnet20x4", 512, 32)
    assert config.budget.char_model == "medium"
    plan = build_plan(config)
    for group in plan:
        arms = {job.arm for job in group.jobs[1:]}
        if group.section == CONVERGENCE:
            assert arms == {"ddp", "nccl_sync", "nccl_cadence"}
        else:
            assert "ddp_post_local_sgd" in arms and "cpu_async" in arms
    for bad in ("ddp,nccl_turbo", "nccl_sync,nccl_cadence"):
        with pytest.raises(ValueError, match="--conv-arms"):
            _config(["--rig", "gpu2-hetero", "--conv-arms", bad])
    with pytest.raises(SystemExit):
        parse_args(["--rig", "gpu2-hetero", "--tp-batch", "0"])


def test_wide_resnet_has_four_times_the_channels():
    from lightning_elche.bench.workloads import throughput_net

    narrow, wide = throughput_net("resnet20"), throughput_net("resnet20x4")
    assert wide[0].out_channels == 4 * narrow[0].out_channels == 64
    assert wide[-1].in_features == 4 * narrow[-1].in_features == 256
    with pytest.raises(ValueError, match="unknown throughput model"):
        throughput_net("vgg")


# -- N-rank rigs (no processes) --------------------------------------------------------------


def test_n_rank_rigs_give_every_rank_a_throttle_and_share_solos_within_a_speed_class():
    cpu4, cpu8 = RIGS["cpu4"], RIGS["cpu8"]
    assert (cpu4.world_size, cpu8.world_size) == (4, 8)
    spread = cpu8.settings[0]
    assert [spread.rank_throttle(r)[0] for r in range(8)] == [1.0, 1.5, 2.0, 3.0] * 2
    assert spread.representatives(8) == [0, 1, 2, 3, 0, 1, 2, 3]
    assert spread.solo_ranks(8) == [0, 1, 2, 3] and spread.throttled
    assert cpu4.settings[0].solo_ranks(4) == [0, 1, 2, 3]
    homogeneous = cpu4.settings[1]
    assert not homogeneous.throttled and homogeneous.solo_ranks(4) == [0]
    # A CPU rig's ranks share one machine: each runs its own solo, all at once (a GPU rig: one per class).
    assert cpu8.solo_per_rank and RIGS["cpu2"].solo_per_rank and not RIGS["gpu8-hetero"].solo_per_rank
    assert spread.representatives(8, per_rank=True) == list(range(8))
    assert homogeneous.solo_ranks(4, per_rank=True) == [0, 1, 2, 3]
    gpu4, gpu8 = RIGS["gpu4-hetero"], RIGS["gpu8-hetero"]
    assert (gpu4.world_size, gpu8.world_size, gpu8.accelerator, gpu8.backend) == (4, 8, "cuda", "nccl")
    assert [gpu4.settings[0].rank_throttle(r)[1] for r in range(4)] == [None, 96, 64, 32]
    assert gpu8.settings[0].representatives(8) == [0, 1, 2, 3, 0, 1, 2, 3]
    # The 2-rank settings still throttle rank 1 only.
    assert RIGS["cpu2"].settings[0].rank_throttle(0) == (1.0, None)
    assert RIGS["cpu2"].settings[0].rank_throttle(1) == (3.0, None)
    assert RIGS["gpu2-hetero"].settings[0].rank_throttle(1) == (1.0, 32)
    assert RIGS["cpu2"].settings[0].solo_ranks(2) == [0, 1]


def test_n_rank_budgets_keep_the_samples_per_rank_and_2_rank_budgets_are_unchanged():
    assert _config(["--rig", "cpu2", "--budget", "quick"]).budget.tp_samples == 1024
    assert _config(["--rig", "cpu4", "--budget", "quick"]).budget.tp_samples == 2048
    assert _config(["--rig", "cpu8", "--budget", "quick"]).budget.tp_samples == 4096
    assert _config(["--rig", "gpu8-hetero", "--budget", "full"]).budget.tp_samples == 4 * 32768
    assert _config(["--rig", "cpu4", "--budget", "tiny"]).budget.tp_samples == 1024  # tiny keeps the total
    # full on the N-rank CPU rigs: longer fits of longer epochs (the drain is paid per epoch)
    full_cpu2, full_cpu4 = (_config(["--rig", rig, "--budget", "full"]).budget for rig in ("cpu2", "cpu4"))
    assert (full_cpu2.tp_samples, full_cpu2.tp_seconds, full_cpu2.solo_seconds) == (2048, 20.0, 20.0)
    assert (full_cpu4.tp_samples, full_cpu4.tp_seconds, full_cpu4.solo_seconds) == (8192, 60.0, 25.0)
    # --tp-seconds sets every throughput fit; --tp-solo-seconds the solos alone
    assert _config(["--rig", "cpu4", "--budget", "full", "--tp-seconds", "30"]).budget.solo_seconds == 30.0
    both = _config(["--rig", "cpu2", "--budget", "full", "--tp-seconds", "30", "--tp-solo-seconds", "12"]).budget
    assert (both.tp_seconds, both.solo_seconds) == (30.0, 12.0)
    plan = build_plan(_config(["--rig", "cpu4", "--budget", "tiny"]))
    assert [g.jobs[0].setting.label for g in plan if g.section == THROUGHPUT] == ["spread", "k1"]


def test_solo_fits_stop_after_the_solo_seconds_and_the_arms_after_the_fit_seconds():
    from types import SimpleNamespace

    from lightning_elche.bench.worker import _fit_limits

    config = _config(["--rig", "cpu4", "--budget", "full", "--tp-arms", "ddp,cpu_async"])
    ctx: Any = SimpleNamespace(config=config)
    stops = {job.arm: _fit_limits(ctx, job)[1] for group in build_plan(config) if group.section == THROUGHPUT
             for job in group.jobs}
    assert stops == {SOLO_PAIR: 25.0, "ddp": 60.0, "cpu_async": 60.0}


def test_n_rank_setting_errors_name_the_knob():
    from lightning_elche.bench.config import Setting

    with pytest.raises(ValueError, match="throttles 3 ranks but the rig has 4"):
        Setting("bad", rank_slowdowns=(1.0, 2.0, 3.0)).check_world(4)
    with pytest.raises(ValueError, match="rank_slowdowns"):
        Setting("bad", rank_slowdowns=(1.0, 0.5))
    with pytest.raises(ValueError, match="not both"):
        Setting("bad", rank_slowdowns=(1.0, 2.0), rank_sms=(None, 32))
    with pytest.raises(ValueError, match="--slowdowns='2'"):
        _config(["--rig", "cpu4", "--slowdowns", "2"])
    with pytest.raises(ValueError, match="expected 4 comma-separated"):
        _config(["--rig", "cpu4", "--rank-slowdowns", "1,2"])
    with pytest.raises(ValueError, match="N-rank CPU rigs"):
        _config(["--rig", "cpu2", "--rank-slowdowns", "1,2"])
    custom = _config(["--rig", "cpu4", "--rank-slowdowns", "1,2,2,4"]).headline
    assert custom.representatives(4) == [0, 1, 1, 3]


def _fit_record(rank: int, steps: int, batch: int, span: float, **extra: Any) -> dict[str, Any]:
    """A rank record as the worker writes it: ``steps`` steps of ``batch`` in ``span`` seconds."""
    return {"rank": rank, "t_fit0": 0.0, "t_start": 1.0, "t_end": 1.0 + span, "eval_s": 0.0,
            "samples": steps * batch, "steps": steps, "total_samples": steps * batch, "total_steps": steps,
            "epochs": 3, "batch_size": batch, "stopped_by_cap": False, "trace": [],
            "model": {"grad_bytes": 4000, "buffer_bytes": 0, "param_bytes": 4000, "float_buffer_bytes": 0},
            **extra}


def _four_rank_records() -> dict[str, list[dict[str, Any]]]:
    """Ranks 0 and 2 are fast (100 samples/s alone), ranks 1 and 3 slow (50/s): the slow class's
    solo is rank 1's, so the ideal is 2 x 100 + 2 x 50 = 300 samples/s."""
    solo = [_fit_record(0, steps=100, batch=10, span=10.0, solo_of_rank=0),
            _fit_record(0, steps=50, batch=10, span=10.0, solo_of_rank=1)]
    # DDP: lockstep, every rank 40 steps of 10 in 10 s -> 160 samples/s, each rank waits on the slow ones.
    ddp = [_fit_record(r, steps=40, batch=10, span=10.0) for r in range(4)]
    # ElChe: steps in proportion to speed (40, 20, 40, 20) in 5 s -> 240 samples/s, 10 rounds.
    # The engine's totals count the whole fit (epoch 0's equal start included): 50, 30, 50, 30.
    totals = [{"steps": n, "samples": 10 * n, "compute_s": 4.0, "sync_s": 1.0} for n in (50, 30, 50, 30)]
    elche_info = {"rounds": 10, "cohort_step": 0, "final_anchor": 2, "window_plan": [2, 1, 2, 1],
                  "totals": totals, "meta_bytes": 96, "bf16_wire": False}
    elche = [_fit_record(r, steps=n, batch=10, span=5.0, elche=elche_info) for r, n in enumerate((40, 20, 40, 20))]
    return {"p-solo": solo, "p-ddp": ddp, "p-nccl_cadence": elche}


def _four_rank_pass(records: Optional[dict[str, list[dict[str, Any]]]] = None) -> dict[str, Any]:
    jobs = [("solo", "p-solo"), ("ddp", "p-ddp"), ("nccl_cadence", "p-nccl_cadence")]
    return metrics.throughput_pass(jobs, records or _four_rank_records(), representatives=[0, 1, 0, 1])


def test_n_rank_pass_sums_each_ranks_class_rate_and_compares_shares_with_speeds():
    tp = _four_rank_pass()
    assert tp["ideal_samples_per_s"] == pytest.approx(300.0)
    assert tp["measured_slowdown"] == pytest.approx(2.0)
    assert tp["speed_share"] == pytest.approx([1 / 3, 1 / 6, 1 / 3, 1 / 6])
    arms = tp["arms"]
    assert set(arms) == {"solo_rank0", "solo_rank1", "ddp", "nccl_cadence"}
    assert arms["solo_rank0"]["ranks"] == [0, 2] and arms["solo_rank1"]["ranks"] == [1, 3]
    assert arms["ddp"]["efficiency"] == pytest.approx(160 / 300)
    assert arms["nccl_cadence"]["efficiency"] == pytest.approx(240 / 300)
    assert arms["nccl_cadence"]["speedup_vs_ddp"] == pytest.approx(1.5)
    # DDP gives every rank a quarter: the fast ranks get 25 % / 33 % -> 25 % short, the slow 50 % over.
    assert arms["ddp"]["batch_share"] == pytest.approx([0.25] * 4)
    assert arms["ddp"]["share_error"] == pytest.approx(0.5)
    # The share error compares the shares from epoch 1 on; the table's batch share is the whole fit's.
    assert arms["nccl_cadence"]["share_error"] == pytest.approx(0.0)
    assert arms["nccl_cadence"]["batch_share"] == pytest.approx([5 / 16, 3 / 16, 5 / 16, 3 / 16])
    # DDP's idle estimate uses each rank's class rate: a fast rank needs 0.1 s per step alone and
    # takes 0.25 s; a slow one needs 0.2 s.
    assert arms["ddp"]["idle"] == pytest.approx([0.6, 0.2, 0.6, 0.2])
    assert arms["nccl_cadence"]["idle"] == pytest.approx([0.2] * 4)
    assert arms["nccl_cadence"]["round_s"] == pytest.approx(0.6)  # (6 s - 0) / 10 rounds
    # Bytes: 10 rounds x 4 ranks x a ring all-reduce of 4000 B (6000 B) + the metadata all-gather.
    assert arms["nccl_cadence"]["bytes_per_sample"] == pytest.approx(10 * (4 * 6000 + 4 * 3 * 96) / 1200)
    merged = metrics.aggregate_passes([tp, _four_rank_pass()])
    assert merged["speed_share"] == pytest.approx(tp["speed_share"])
    assert merged["arms"]["ddp"]["share_error"] == pytest.approx(0.5)


def test_n_rank_pass_reads_each_elche_arm_against_the_speeds_inside_it_too():
    """The ElChe ranks trained 40, 20, 40 and 20 steady batches, rank 3 in 5 s of window compute
    and the others in 4 s: in the arm rank 3 ran at 40 samples/s, not its class's 50. Its share of
    1/6 is then exact against the solos and 21 % over its in-arm speed share (40 / 290)."""
    records = _four_rank_records()
    point = {"index": 2, "t": 0.0, "steps": [40, 20, 40, 20], "compute_s": [4.0, 4.0, 4.0, 5.0],
             "last_sync_s": [0.1] * 4, "out_of_data": [False] * 4, "epoch": [1] * 4, "calibrations": 1}
    for record in records["p-nccl_cadence"]:
        record["final_sync_s"] = 0.1
    records["p-nccl_cadence"][0]["rounds"] = [point]
    row = _four_rank_pass(records)["arms"]["nccl_cadence"]
    assert row["share_error"] == pytest.approx(0.0)
    assert row["in_arm_speed_share"] == pytest.approx([100 / 290, 50 / 290, 100 / 290, 40 / 290])
    assert row["in_arm_share_error"] == pytest.approx((1 / 6) / (40 / 290) - 1)
    assert "in_arm_share_error" not in _four_rank_pass()["arms"]["nccl_cadence"]  # no rounds recorded


def test_two_rank_pass_is_unchanged_without_representatives():
    solo = [_fit_record(0, steps=90, batch=10, span=9.0), _fit_record(0, steps=30, batch=10, span=9.0)]
    ddp = [_fit_record(r, steps=30, batch=10, span=6.0) for r in range(2)]
    tp = metrics.throughput_pass([("solo", "s"), ("ddp", "d")], {"s": solo, "d": ddp})
    assert tp["measured_slowdown"] == pytest.approx(3.0)
    assert set(tp["arms"]) == {"solo_rank0", "solo_rank1", "ddp"}
    assert "ranks" not in tp["arms"]["solo_rank1"]
    assert tp["ideal_samples_per_s"] == pytest.approx(100.0 + 100.0 / 3)
    with pytest.raises(ValueError, match="no record of rank"):
        metrics.throughput_pass([("solo", "s"), ("ddp", "d")], {"s": solo[:1], "d": ddp}, representatives=[0, 1])


def test_n_rank_report_has_a_column_per_rank_and_the_committed_2_rank_tables_replot_unchanged(tmp_path):
    from lightning_elche.bench.report import balance_lines, markdown, throughput_table

    section = {**_four_rank_pass()}
    table = throughput_table(section, world=4)
    assert "idle r0 / r1 / r2 / r3 | batch share r0 / r1 / r2 / r3 |" in table[0]
    assert any(line.startswith("| `ddp` |") and "60% / 20% / 60% / 20% (est.)" in line for line in table)
    assert any("ideal (sum of the 4 ranks' solo rates) | 300 |" in line for line in table)
    balance = "\n".join(balance_lines(section))
    assert "`solo_rank1` 50.0/s (ranks 1, 3)" in balance and "`ddp` 50 %" in balance and "`nccl_cadence` 0 %" in balance
    assert "33% / 17% / 33% / 17%" in balance
    committed = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"
    result = json.loads((committed / "cpu2.json").read_text())
    assert markdown(result) == (committed / "cpu2.md").read_text()
    assert "idle r0 / r1 | batch share r0 / r1 |" in markdown(result)


# -- end to end ------------------------------------------------------------------------------


def check_multi_rank_row(arm: str, row: dict[str, Any]) -> None:
    assert positive(row["samples_per_s"]), arm
    assert positive(row["efficiency"]), arm
    assert positive(row["speedup_vs_ddp"]), arm
    assert isinstance(row["syncs"], int) and row["syncs"] > 0, arm
    assert positive(row["bytes_per_sample"]), arm
    assert len(row["idle"]) == 2 and all(fraction(v) for v in row["idle"]), (arm, row["idle"])
    assert len(row["batch_share"]) == 2 and sum(row["batch_share"]) == pytest.approx(1.0), arm


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_cpu2_tiny_end_to_end(tmp_path):
    out = tmp_path / "bench"
    status, output = run_bench(["--rig", "cpu2", "--budget", "tiny", "--out", str(out)], tmp_path)
    assert status == 0, output[-4000:]
    result = json.loads((out / "cpu2.json").read_text())
    assert result["rig"] == "cpu2"
    assert isinstance(result["commit"], str) and result["commit"]
    assert result["date"] and "--rig cpu2" in result["command"]
    assert result["device"]["summary"]
    modes, _ = available_elche_modes()
    assert set(result["elche_modes"]) == set(modes)
    arms = result["arms"]
    assert set(arms) == {"solo_rank0", "solo_rank1", "ddp", "ddp_post_local_sgd", *modes}
    for arm in ("solo_rank0", "solo_rank1"):
        assert positive(arms[arm]["samples_per_s"]) and positive(arms[arm]["efficiency"]), arm
    for arm in ("ddp", "ddp_post_local_sgd", *modes):
        check_multi_rank_row(arm, arms[arm])
    for mode in modes:
        assert arms[mode]["elche"]["rounds"] == arms[mode]["syncs"]
        assert arms[mode]["idle_method"].startswith("measured")
    assert arms["ddp"]["idle_method"].startswith("estimate")
    assert positive(result["ideal_samples_per_s"])
    assert result["measured_slowdown"] >= result["config"]["min_slowdown"]
    assert result["measured_slowdown_range_per_pass"] == [[result["measured_slowdown"]] * 2]  # one pass, no bracket
    assert isinstance(result["noise_warnings"], list)
    for warning in result["noise_warnings"]:  # also on stderr
        assert warning["message"] in output

    conv = result["convergence"]
    assert conv["quality"] == "held_out_acc" and conv["seeds_run"] >= 1
    assert fraction(conv["target"])
    for arm in ("solo_rank0", "ddp", "ddp_post_local_sgd", *modes):
        assert fraction(conv["arms"][arm]["final_quality"]["median"]), arm
        assert positive(conv["arms"][arm]["train_s"]["median"]), arm
        assert arms[arm]["final_quality"] == conv["arms"][arm]["final_quality"]

    for row in result["microbenchmark"].values():
        assert positive(row["raw_busbw_gb_s"]) and positive(row["plane_busbw_gb_s"]) and positive(row["plane_vs_raw"])
        # Timings only; a tiny run's ratios are noise (speed is the full benchmark's job).
        assert positive(row["flat_all_reduce_s"]) and positive(row["flat_busbw_gb_s"]) and positive(row["flat_vs_raw"])
        assert positive(row["metadata_exchange_s"])

    other = result["other_settings"]["k1"]
    for arm in ("ddp", "ddp_post_local_sgd", *modes):
        check_multi_rank_row(arm, other["arms"][arm])

    # Memory: nothing can be measured on CPU ranks, and the table says so instead of inventing numbers.
    for arm, row in arms.items():
        assert row["memory"] == {"measured": False, "reason": "n/a (CPU)"}, arm
    # Where each ElChe arm's lost efficiency goes: the parts add up to the efficiency the throughput
    # table reports (computed separately, from the steady-state rate), and the round and window
    # times the engine reported fit inside the span the efficiency is measured over.
    for mode in modes:
        split = arms[mode]["loss_breakdown"]
        assert split is not None, mode
        assert split["efficiency"] == pytest.approx(arms[mode]["efficiency"], rel=1e-9), mode
        assert sum(split["fractions"].values()) == pytest.approx(1.0 - arms[mode]["efficiency"], abs=1e-9), mode
        assert split["rounds_in_span"] >= 1, mode
        for part in ("first_window", "plan_lag", "epoch_end_drain", "sync"):
            assert split["fractions"][part] >= 0.0, (mode, part)
            assert all(v >= 0.0 for v in split["seconds"][part]), (mode, part)
        span = split["span_s"]
        assert all(v >= -0.01 * span for v in split["seconds"]["outside_rounds"]), (mode, split["seconds"])
        assert split["reduce_device_s"] is None, mode  # CPU: every round's reduce is waited for on the host
    assert not any("loss_breakdown" in arms[arm] for arm in ("ddp", "ddp_post_local_sgd", "solo_rank0"))

    table = (out / "cpu2.md").read_text()
    assert "| `ddp` |" in table and "| `nccl_cadence` |" in table and result["commit"] in table
    assert "| `ddp` |" + " n/a (CPU) |" * 4 in table
    assert "| arm | efficiency | 1 - eff. | (a) first window | (b) plan lag | (c) epoch-end drain | (d) sync |" in table
    if importlib.util.find_spec("matplotlib") is not None:
        assert sorted(result["plots"]["files"]) == ["cpu2-elche.png", "cpu2-quality.png"]
        for name in result["plots"]["files"]:
            assert (out / name).stat().st_size > 1000
    else:
        assert "skipped" in result["plots"]


@pytest.mark.distributed
@pytest.mark.extended  # a benchmark's refusal to report; CI runs the benchmark end to end once
@pytest.mark.timeout(120)
def test_throttle_that_does_not_bite_stops_the_run(tmp_path):
    out = tmp_path / "bench"
    status, output = run_bench(
        ["--rig", "cpu2", "--budget", "tiny", "--out", str(out), "--slowdowns", "1.05", "--min-slowdown", "50"],
        tmp_path,
    )
    assert status == 3, output[-4000:]
    assert "input-bound" in output
    error = json.loads((out / "cpu2.error.json").read_text())
    assert error["throttle_check"]["measured_slowdown"] < 50
    assert not (out / "cpu2.json").exists()


@pytest.mark.distributed
@pytest.mark.extended
@pytest.mark.timeout(330)
def test_cpu4_tiny_end_to_end_reports_every_arm_for_four_ranks(tmp_path):
    """4 CPU ranks with k = 1, 1.5, 1.5, 3: every throughput arm, a solo of every rank (ranks 1 and 2
    share a speed class but not a core), 4 per-rank columns. Convergence only for DDP (the cpu2 run
    covers every arm there), so it is the throughput section and the microbenchmark at 4 ranks that
    this run checks (about a minute on 2 idle cores; minutes when the machine is shared)."""
    out = tmp_path / "bench"
    status, output = run_command(
        [sys.executable, "-m", "lightning_elche.bench", "--rig", "cpu4", "--budget", "tiny", "--only-headline",
         "--rank-slowdowns", "1,1.5,1.5,3", "--conv-arms", "ddp", "--micro-iters", "2", "--no-plots",
         "--commit", "abc1234", "--out", str(out)],
        tmp_path, 320)
    assert status == 0, output[-4000:]
    result = json.loads((out / "cpu4.json").read_text())
    assert result["rig"] == "cpu4" and result["world_size"] == 4
    # A copied tree on a device machine stamps its results with the commit it is told.
    assert (result["commit"], result["commit_dirty"]) == ("abc1234", False)
    assert "- commit: `abc1234`" in (out / "cpu4.md").read_text()
    modes, _ = available_elche_modes()
    arms = result["arms"]
    solos = {"solo_rank0", "solo_rank1", "solo_rank2", "solo_rank3"}
    assert set(arms) == solos | {"ddp", "ddp_post_local_sgd", *modes}
    for arm in solos:
        assert positive(arms[arm]["samples_per_s"]) and arms[arm]["ranks"] == [int(arm[-1])], arm
    for arm in ("ddp", "ddp_post_local_sgd", *modes):
        row = arms[arm]
        assert positive(row["samples_per_s"]) and positive(row["efficiency"]) and positive(row["speedup_vs_ddp"]), arm
        assert isinstance(row["syncs"], int) and row["syncs"] > 0 and positive(row["bytes_per_sample"]), arm
        assert len(row["idle"]) == 4 and all(fraction(v) for v in row["idle"]), (arm, row["idle"])
        assert len(row["batch_share"]) == 4 and sum(row["batch_share"]) == pytest.approx(1.0), arm
        assert isinstance(row["share_error"], float) and row["share_error"] >= 0.0, arm
    for mode in modes:
        assert positive(arms[mode]["round_s"]) and len(arms[mode]["elche"]["totals"]) == 4, mode
    assert len(result["speed_share"]) == 4 and sum(result["speed_share"]) == pytest.approx(1.0)
    ideal = sum(arms[f"solo_rank{r}"]["samples_per_s"] for r in range(4))
    assert result["ideal_samples_per_s"] == pytest.approx(ideal)
    for row in result["microbenchmark"].values():
        for key in ("raw_busbw_gb_s", "plane_busbw_gb_s", "flat_busbw_gb_s", "metadata_exchange_s", "pool_claim_s"):
            assert positive(row[key]), key
    assert set(result["convergence"]["arms"]) == {"solo_rank0", "ddp"}
    table = (out / "cpu4.md").read_text()
    assert "| idle r0 / r1 / r2 / r3 | batch share r0 / r1 / r2 / r3 |" in table
    solo_line = next(line for line in table.splitlines() if line.startswith("Solo rates (the ranks each measures)"))
    assert all(f"(rank {r})" in solo_line for r in range(4)) and "ranks" not in solo_line.split(":", 1)[1], solo_line
    assert "## All-reduce microbenchmark (4 ranks, no throttle)" in table and "| `cpu_async` |" in table


@pytest.mark.distributed
@pytest.mark.timeout(330)
def test_cpu2_tiny_with_pinned_ranks_runs_each_rank_on_its_own_cpu(tmp_path: Path) -> None:
    usable = sorted(os.sched_getaffinity(0))[:2]
    out = tmp_path / "bench"
    status, output = run_command(
        [sys.executable, "-m", "lightning_elche.bench", "--rig", "cpu2", "--budget", "tiny", "--seeds", "0",
         "--only-headline", "--pin-ranks", "--tp-arms", "ddp,cpu_async", "--micro-iters", "2", "--no-plots",
         "--out", str(out)], tmp_path, 320)
    assert status == 0, output[-4000:]
    result = json.loads((out / "cpu2.json").read_text())
    assert [rank["cpus"] for rank in result["device"]["ranks"]] == [[usable[0]], [usable[1]]]
    assert f"2 ranks x 1 torch thread(s), each on one CPU: {usable[0]}, {usable[1]};" in (out / "cpu2.md").read_text()
    assert positive(result["arms"]["cpu_async"]["efficiency"])
