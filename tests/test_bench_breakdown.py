"""The benchmark's memory column, loss breakdown and new flags, without processes: hand-built
records with known answers (the end-to-end cpu2 run in test_bench.py checks them on real fits)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

from lightning_elche.bench import metrics
from lightning_elche.bench.__main__ import sm_problem
from lightning_elche.bench.arms import available_elche_modes
from lightning_elche.bench.config import BenchConfig, build_config, parse_args
from lightning_elche.bench.memory import pinned_bytes
from lightning_elche.bench.plan import CONVERGENCE, THROUGHPUT, build_plan
from lightning_elche.bench.report import balance_lines, breakdown_table, memory_table


def _config(argv: list[str]) -> BenchConfig:
    modes, skipped = available_elche_modes()
    return build_config(parse_args(argv), modes, skipped)


# -- loss breakdown ----------------------------------------------------------------------------


def _round(index: int, epoch: int, steps: list[int], compute: list[float], last_sync: list[float],
           out_of_data: list[bool], calibrations: int) -> dict[str, Any]:
    return {"index": index, "t": 0.0, "steps": steps, "compute_s": compute, "last_sync_s": last_sync,
            "out_of_data": out_of_data, "epoch": [epoch, epoch], "calibrations": calibrations}


def _elche_records() -> list[dict[str, Any]]:
    """Rank 0 (100 samples/s alone) and rank 1 (50/s), batch 10, epoch 1 from t = 1 s to 3.2 s.

    Round 1 (epoch 0) closes the uncalibrated first window: rank 0 waits 0.2 s. In epoch 1, round 2
    closes a window in which rank 0 finished 0.1 s early (plan lag), round 3 is rank 0's last batch
    (it waits 0.2 s: drain) and round 4 a zero-step window of rank 0 while rank 1 trains 0.4 s
    (drain). Every round's reduce costs 0.05 s; each rank spends 0.05 s outside windows and rounds.
    """
    rounds = [
        _round(1, 0, [2, 2], [0.2, 0.4], [0.0, 0.0], [False, False], calibrations=1),
        _round(2, 1, [7, 4], [0.7, 0.8], [0.25, 0.05], [False, False], calibrations=2),
        _round(3, 1, [6, 4], [0.6, 0.8], [0.15, 0.05], [True, False], calibrations=3),
        _round(4, 1, [0, 2], [0.0, 0.4], [0.25, 0.05], [True, True], calibrations=4),
    ]
    common = {"t_fit0": 0.0, "t_start": 1.0, "t_end": 3.2, "eval_s": 0.0, "device_type": "cpu"}
    return [{**common, "rank": 0, "samples": 130, "rounds": rounds, "final_sync_s": 0.45},
            {**common, "rank": 1, "samples": 100, "rounds": [], "final_sync_s": 0.05}]


def test_loss_breakdown_charges_each_wait_to_its_cause_and_sums_to_one_minus_efficiency():
    split = metrics.loss_breakdown(_elche_records(), [100.0, 50.0])
    capacity = 2.2 * 150.0
    assert split["span_s"] == pytest.approx(2.2)
    assert split["efficiency"] == pytest.approx(230.0 / capacity)
    fractions = split["fractions"]
    assert fractions["first_window"] == pytest.approx(0.0)  # round 1 is in epoch 0, outside the span
    assert fractions["plan_lag"] == pytest.approx(100 * 0.1 / capacity)
    assert fractions["epoch_end_drain"] == pytest.approx(100 * 0.6 / capacity)
    assert fractions["sync"] == pytest.approx(150 * 0.15 / capacity)
    assert fractions["rest"] == pytest.approx(150 * 0.05 / capacity)
    assert sum(fractions.values()) == pytest.approx(split["one_minus_efficiency"])
    assert split["rest_detail"]["compute_vs_solo"] == pytest.approx(0.0, abs=1e-12)
    assert split["rest_detail"]["outside_rounds"] == pytest.approx(150 * 0.05 / capacity)
    assert split["seconds"]["epoch_end_drain"] == pytest.approx([0.6, 0.0])
    assert split["rounds_in_span"] == 3 and split["realized_rounds_in_span"] == 3
    assert split["epoch0_first_window_wait_s"] == pytest.approx([0.2, 0.0])


def test_the_in_arm_efficiency_reads_the_ranks_speeds_inside_the_arm_not_the_solo_fits():
    """Solo fits measured on a machine twice as fast as during the arm halve the efficiency (the
    arm computes slower than alone: part e) and leave the in-arm efficiency where it was: the ranks
    computed at 100 and 50 samples/s in their windows, so only the waits, syncs and time outside the
    rounds (0.15 + 0.6 + 0.1 + ...) count against it."""
    split = metrics.loss_breakdown(_elche_records(), [100.0, 50.0])
    assert split["in_arm_efficiency"] == pytest.approx(230.0 / (2.2 * 150.0))
    fast_solos = metrics.loss_breakdown(_elche_records(), [200.0, 100.0])
    assert fast_solos["efficiency"] == pytest.approx(split["efficiency"] / 2)
    assert fast_solos["in_arm_efficiency"] == pytest.approx(split["in_arm_efficiency"])
    slow_rank_1 = _elche_records()
    for point in slow_rank_1[0]["rounds"][1:]:
        point["compute_s"][1] *= 2  # rank 1 computed at 25 samples/s in the arm
    assert metrics.loss_breakdown(slow_rank_1, [100.0, 50.0])["in_arm_efficiency"] == pytest.approx(
        230.0 / (2.2 * (100.0 + 25.0)))
    idle = _elche_records()
    for point in idle[0]["rounds"]:
        point["compute_s"][1] = 0.0  # no window compute measured: no in-arm speed to read
    assert metrics.loss_breakdown(idle, [100.0, 50.0])["in_arm_efficiency"] is None


def test_the_in_arm_share_error_reads_the_dispatch_against_the_speeds_inside_the_arm():
    """Rank 0 trained 130 steady samples in 1.3 s of window compute and rank 1 100 in 2.0 s: in-arm
    speeds 100 and 50 samples/s, shares 2/3 and 1/3. Batch shares of 13/23 and 10/23 are then 15 %
    and 30 % off, whatever the solo fits read; a rank that computed twice as slowly moves them."""
    split = metrics.loss_breakdown(_elche_records(), [100.0, 50.0])
    assert split["in_arm_speed_share"] == pytest.approx([2 / 3, 1 / 3])
    assert metrics.loss_breakdown(_elche_records(), [500.0, 10.0])["in_arm_speed_share"] == pytest.approx(
        [2 / 3, 1 / 3])
    slow_rank_1 = _elche_records()
    for point in slow_rank_1[0]["rounds"][1:]:
        point["compute_s"][1] *= 2
    assert metrics.loss_breakdown(slow_rank_1, [100.0, 50.0])["in_arm_speed_share"] == pytest.approx([0.8, 0.2])
    assert metrics.share_error([13 / 23, 10 / 23], split["in_arm_speed_share"]) == pytest.approx(7 / 23)
    assert metrics.share_error([2 / 3, 1 / 3], split["in_arm_speed_share"]) == pytest.approx(0.0)
    idle = _elche_records()
    for point in idle[0]["rounds"]:
        point["compute_s"][1] = 0.0
    assert metrics.loss_breakdown(idle, [100.0, 50.0])["in_arm_speed_share"] is None


def test_the_balance_lines_show_the_in_arm_share_error_only_where_it_was_measured():
    section = {"speed_share": [0.5, 0.5], "arms": {
        "solo_rank0": {"kind": "solo", "samples_per_s": 10.0, "ranks": [0, 1]},
        "ddp": {"kind": "ddp", "share_error": 0.0},
        "cpu_async": {"kind": "elche", "share_error": 0.12, "in_arm_share_error": 0.03, "round_s": 1.0}}}
    text = "\n".join(balance_lines(section))
    assert "from its speed share: `ddp` 0 %, `cpu_async` 12 %" in text
    assert "inside the arm" in text and "`cpu_async` 3 %" in text and "`ddp` 0 %." not in text.split("inside")[1]
    section["arms"]["cpu_async"]["in_arm_share_error"] = None
    assert "inside the arm" not in "\n".join(balance_lines(section))


def test_loss_breakdown_first_window_and_device_side_averaging():
    records = _elche_records()
    records[0]["rounds"][0]["calibrations"] = 0  # round 2 then closes a window planned uncalibrated
    split = metrics.loss_breakdown(records, [100.0, 50.0], reduce_device_s=0.01)
    capacity = 2.2 * 150.0
    assert split["fractions"]["first_window"] == pytest.approx(100 * 0.1 / capacity)
    assert split["fractions"]["plan_lag"] == pytest.approx(0.0)
    # 3 realized rounds x 10 ms of device-side averaging move from the window compute to sync.
    assert split["seconds"]["sync_device"] == pytest.approx([0.03, 0.03])
    assert split["fractions"]["sync"] == pytest.approx(150 * 0.18 / capacity)
    assert split["rest_detail"]["compute_vs_solo"] == pytest.approx(150 * -0.03 / capacity)
    assert sum(split["fractions"].values()) == pytest.approx(split["one_minus_efficiency"])


def test_loss_breakdown_refuses_incomplete_records():
    assert metrics.loss_breakdown(_elche_records(), [100.0]) is None  # a rate per rank
    gap = _elche_records()
    del gap[0]["rounds"][2]  # a missed round would shift every later sync time
    assert metrics.loss_breakdown(gap, [100.0, 50.0]) is None
    no_final = _elche_records()
    no_final[1]["final_sync_s"] = None
    assert metrics.loss_breakdown(no_final, [100.0, 50.0]) is None
    no_rounds = _elche_records()
    no_rounds[0]["rounds"] = []
    assert metrics.loss_breakdown(no_rounds, [100.0, 50.0]) is None


def test_breakdown_table_shows_every_part_and_the_share_against_the_speed_share():
    split = metrics.loss_breakdown(_elche_records(), [100.0, 50.0])
    section = {"speed_share": [2 / 3, 1 / 3], "arms": {
        "ddp": {"kind": "ddp", "efficiency": 0.5},
        "nccl_cadence": {"kind": "elche", "efficiency": split["efficiency"], "loss_breakdown": split,
                         "steady_batch_share": [13 / 23, 10 / 23]}}}
    table = breakdown_table(section)
    assert table[0].startswith("| arm | efficiency | 1 - eff. | (a) first window | (b) plan lag |")
    row = next(line for line in table if line.startswith("| `nccl_cadence` |"))
    # 1 - eff = 100 / 330 = 30.3 %: plan lag 3.0, drain 18.2, sync 6.8, rest 2.3 (0.0 + 2.3).
    assert row == "| `nccl_cadence` | 0.70 | 30.3 | 0.0 | 3.0 | 18.2 | 6.8 | 2.3: 0.0 + 2.3 | 56.5 % (66.7 %) |"
    assert not any("`ddp`" in line for line in table)
    assert breakdown_table({"arms": {"ddp": {"kind": "ddp"}}}) == []  # older results: no table


# -- memory ------------------------------------------------------------------------------------


def _memory_record(peak: int, pinned: int = 0) -> dict[str, Any]:
    return {"model": {"param_numel": 1_000_000},
            "memory": {"peak_allocated": peak, "peak_reserved": peak + 10**6, "baseline_allocated": 10**6,
                       "pinned_held": pinned}}


def test_memory_column_measures_copies_against_ddp_and_says_n_a_on_cpu():
    arms = {
        "ddp": {"kind": "ddp", "memory": metrics.memory_summary([_memory_record(20 * 10**6)] * 2)},
        "nccl_cadence": {"kind": "elche", "memory": metrics.memory_summary(
            [_memory_record(16 * 10**6), _memory_record(22 * 10**6)])},
        "cpu_async": {"kind": "elche", "memory": metrics.memory_summary([_memory_record(12 * 10**6, 8 * 10**6)] * 2)},
    }
    metrics.memory_vs_ddp(arms)
    # 4 MB of f32 parameters: 4 MB below DDP is one copy fewer, 2 MB above half a copy more.
    assert arms["nccl_cadence"]["memory"]["vs_ddp_param_copies"] == pytest.approx([-1.0, 0.5])
    assert arms["ddp"]["memory"]["vs_ddp_param_copies"] == pytest.approx([0.0, 0.0])
    table = memory_table({"arms": arms})
    assert "| `nccl_cadence` | 16 / 22 | -1.00 / +0.50 | 17 / 23 | - |" in table
    assert "| `cpu_async` | 12 / 12 | -2.00 / -2.00 | 13 / 13 | 8 / 8 |" in table
    cpu = {"memory": None, "model": {"param_numel": 10}}
    on_cpu = {"ddp": {"kind": "ddp", "memory": metrics.memory_summary([cpu, cpu])}}
    metrics.memory_vs_ddp(on_cpu)
    assert on_cpu["ddp"]["memory"] == {"measured": False, "reason": "n/a (CPU)"}
    assert memory_table({"arms": on_cpu})[-1] == "| `ddp` |" + " n/a (CPU) |" * 4


class _Pinned(torch.Tensor):
    """A CPU tensor that claims to be pinned (this test machine may have no CUDA to pin with)."""

    def is_pinned(self, device: Any = None) -> bool:  # noqa: ARG002
        return True


def _pinned(numel: int) -> torch.Tensor:
    return torch.Tensor._make_subclass(_Pinned, torch.zeros(numel, dtype=torch.float32))


def test_pinned_bytes_walks_the_plane_and_counts_each_storage_once():
    class Mirror:
        def __init__(self) -> None:
            self.buffers = [_pinned(100), _pinned(50)]
            self.source = torch.zeros(1000)  # an ordinary (device-side here) tensor: not counted

    class Plane:
        def __init__(self) -> None:
            self.params = Mirror()
            self._consensus = [_pinned(100)]
            self.alias = self._consensus  # the same storage seen twice
            self.deep = {"a": [[[[_pinned(10**6)]]]]}  # below the walk's depth: not counted

    assert pinned_bytes(Plane()) == 4 * (100 + 50 + 100)
    assert pinned_bytes(torch.zeros(10)) == 0


# -- flags -------------------------------------------------------------------------------------


def test_rank1_sms_selects_the_wider_gap_and_refuses_bad_values():
    config = _config(["--rig", "gpu2-hetero", "--rank1-sms", "16"])
    assert [(s.label, s.sms) for s in config.settings] == [("sm16", 16)]
    assert config.headline.rank_throttle(1) == (1.0, 16)
    both = _config(["--rig", "gpu2-hetero", "--rank1-sms", "32,16"])
    assert [s.label for s in both.settings] == ["sm32", "sm16"]
    assert [g.jobs[0].setting.label for g in build_plan(both) if g.section == THROUGHPUT] == ["sm32", "sm16"]
    assert _config(["--rig", "gpu2-hetero"]).headline.label == "sm32"  # the default is unchanged
    for bad in ("0", "x", "16,16", "", "-4"):
        with pytest.raises(ValueError, match="--rank1-sms"):
            _config(["--rig", "gpu2-hetero", "--rank1-sms", bad])
    with pytest.raises(ValueError, match="--rank1-sms='16' applies to the gpu2-hetero rig only"):
        _config(["--rig", "cpu2", "--rank1-sms", "16"])
    # The upper bound is the GPU's SM count, known where the GPUs are.
    problem = sm_problem(_config(["--rig", "gpu2-hetero", "--rank1-sms", "200"]), [132, 132])
    assert problem is not None and "--rank1-sms=200" in problem and "1 to 132" in problem
    assert sm_problem(_config(["--rig", "gpu2-hetero", "--rank1-sms", "132"]), [132, 132]) is None


def test_tp_epoch_samples_sets_the_epoch_and_refuses_too_few():
    config = _config(["--rig", "gpu2-hetero", "--tp-epoch-samples", "262144"])
    assert config.budget.tp_samples == 262144
    assert _config(["--rig", "gpu2-hetero"]).budget.tp_samples == 32768
    with pytest.raises(ValueError, match=r"--tp-epoch-samples=300 is too small.*at least 512"):
        _config(["--rig", "gpu2-hetero", "--tp-epoch-samples", "300"])
    with pytest.raises(SystemExit):
        parse_args(["--rig", "gpu2-hetero", "--tp-epoch-samples", "0"])


def test_seeds_zero_runs_no_convergence_section():
    plan = build_plan(_config(["--rig", "cpu2", "--budget", "tiny", "--seeds", "0"]))
    assert plan and not [g for g in plan if g.section == CONVERGENCE]
    assert [g for g in build_plan(_config(["--rig", "cpu2", "--budget", "tiny"])) if g.section == CONVERGENCE]
    with pytest.raises(SystemExit):
        parse_args(["--rig", "cpu2", "--seeds", "-1"])


def test_records_are_not_modified_by_the_breakdown():
    records = _elche_records()
    before = copy.deepcopy(records)
    metrics.loss_breakdown(records, [100.0, 50.0], reduce_device_s=0.01)
    assert records == before


def test_share_gpu_runs_every_rank_over_gloo_and_only_on_gpu_rigs():
    config = _config(["--rig", "gpu2-homo", "--share-gpu"])
    assert config.share_gpu and config.rig.backend == "gloo" and config.rig.accelerator == "cuda"
    assert _config(["--rig", "gpu2-homo"]).rig.backend == "nccl"
    with pytest.raises(ValueError, match="--share-gpu puts every rank on cuda:0; --rig cpu2 runs on CPU"):
        _config(["--rig", "cpu2", "--share-gpu"])


def test_pin_ranks_gives_each_rank_of_a_cpu_rig_its_own_usable_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {9, 3, 5, 7, 11}, raising=False)
    assert _config(["--rig", "cpu4", "--pin-ranks"]).rank_cpus == (3, 5, 7, 9)
    assert _config(["--rig", "cpu4"]).rank_cpus == ()
    with pytest.raises(ValueError, match=r"--pin-ranks is invalid here: expected a usable CPU for each of --rig "
                                         r"cpu8's 8 ranks, this process may use 5 \(\[3, 5, 7, 9, 11\]\); widen"):
        _config(["--rig", "cpu8", "--pin-ranks"])
    with pytest.raises(ValueError, match="--pin-ranks is invalid with --rig gpu2-homo: expected a CPU rig"):
        _config(["--rig", "gpu2-homo", "--pin-ranks"])


def test_pin_process_moves_every_thread_and_those_started_after_it() -> None:
    cpu = min(os.sched_getaffinity(0))
    script = f"""
import os, threading
from lightning_elche.bench.worker import pin_process
early = threading.Thread(target=threading.Event().wait, daemon=True)
early.start()
pin_process({cpu})
late = threading.Thread(target=threading.Event().wait, daemon=True)
late.start()
print(sorted({{tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir("/proc/self/task")}}))
"""
    shown = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert shown.stdout.strip() == f"[({cpu},)]", shown.stdout + shown.stderr
