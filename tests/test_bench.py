"""The benchmark harness: its formulas (no processes) and two end-to-end runs on 2 CPU ranks.

The end-to-end runs use ``--budget tiny`` and check the structure of the JSON and that every
number that must be finite and positive is; no timing is asserted (CI machines are too noisy).
Each run is a subprocess in its own session, so that a hang is cleaned up with its rank processes.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import Any

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
    config = _config(["--rig", "cpu2", "--budget", "full", "--throughput-seeds", "2"])
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

    table = (out / "cpu2.md").read_text()
    assert "| `ddp` |" in table and "| `nccl_cadence` |" in table and result["commit"] in table
    if importlib.util.find_spec("matplotlib") is not None:
        assert sorted(result["plots"]["files"]) == ["cpu2-elche.png", "cpu2-quality.png"]
        for name in result["plots"]["files"]:
            assert (out / name).stat().st_size > 1000
    else:
        assert "skipped" in result["plots"]


@pytest.mark.distributed
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
