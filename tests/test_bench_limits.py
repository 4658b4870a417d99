"""The benchmark's memory-limited ranks (``--memory-fraction``, ``--micro-batch``): parsing and its
errors, the per-rank plan of each arm, the DDP arms' step counts under accumulation, the report's
rows (no processes), and one end-to-end run on 2 CPU ranks with a micro-batched rank."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from process_helpers import run_command

from lightning_elche.bench import metrics
from lightning_elche.bench.arms import available_elche_modes, make_strategy
from lightning_elche.bench.config import BenchConfig, build_config, parse_args
from lightning_elche.bench.limits import (
    FitShape,
    accumulation,
    multi_shape,
    parse_memory_fractions,
    parse_micro_batch,
    planned_sizes,
    solo_shape,
)
from lightning_elche.bench.report import limits_lines
from lightning_elche.strategy import ElCheStrategy


def _config(argv: list[str]) -> BenchConfig:
    modes, skipped = available_elche_modes()
    return build_config(parse_args(argv), modes, skipped)


# -- the flags --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "expected"), [
    ("auto", ("auto", "auto")),
    ("16", (16, 16)),
    ("1=8", (None, 8)),
    ("0=auto, 1=32", ("auto", 32)),
    ("1=256", (None, 256)),
])
def test_micro_batch_flag_gives_one_setting_per_rank(text: str, expected: tuple[Any, ...]) -> None:
    assert parse_micro_batch(text, 2, 256) == expected


@pytest.mark.parametrize(("text", "message"), [
    ("0", "a micro-batch of 0 samples"),
    ("1=-4", "a micro-batch of -4 samples"),
    ("1=x", "'x' is not a size"),
    ("1.5", "'1.5' is not a size"),
    ("512", "larger than the throughput batch of 256 .--tp-batch.; expected at most 256"),
    ("2=8", "rank 2 does not exist, the rig has 2 ranks .0 to 1."),
    ("1=8,1=4", "rank 1 is named twice"),
    ("", "expected 'auto', a positive whole number"),
    ("8,4", "expected 'auto', a positive whole number"),
    ("1=", "expected 'auto', a positive whole number"),
    ("x=8", "expected 'auto', a positive whole number"),
])
def test_bad_micro_batch_flag_is_refused_naming_the_flag(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=rf"^--micro-batch={text!r} is invalid: .*{message}"):
        parse_micro_batch(text, 2, 256)


@pytest.mark.parametrize(("text", "message"), [
    ("1=0", "rank 1's fraction '0'"),
    ("1=1.5", "rank 1's fraction '1.5'"),
    ("1=nan", "rank 1's fraction 'nan'"),
    ("1=lots", "rank 1's fraction 'lots'"),
    ("0.02", "expected RANK=FRACTION pairs"),
    ("3=0.5", "rank 3 does not exist"),
    ("1=0.1,1=0.2", "rank 1 is named twice"),
])
def test_bad_memory_fraction_is_refused_naming_the_flag(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=rf"^--memory-fraction={text!r} is invalid: .*{message}"):
        parse_memory_fractions(text, 2)
    assert parse_memory_fractions("1=0.02", 2) == (None, 0.02)


def test_a_memory_limit_needs_a_gpu_rig_and_a_micro_batch() -> None:
    with pytest.raises(ValueError, match=r"--memory-fraction='1=0.5' is invalid: .* runs on CPU"):
        _config(["--rig", "cpu2", "--memory-fraction", "1=0.5", "--micro-batch", "auto"])
    with pytest.raises(ValueError, match=r"--memory-fraction='1=0.02' is invalid without --micro-batch"):
        _config(["--rig", "gpu2-homo", "--share-gpu", "--memory-fraction", "1=0.02"])
    with pytest.raises(ValueError, match=r"--micro-batch='1=64' is invalid: .*larger than the throughput batch of 32"):
        _config(["--rig", "cpu2", "--budget", "tiny", "--micro-batch", "1=64"])


def test_the_main_entry_turns_a_bad_flag_into_exit_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_elche.bench.__main__ import main

    assert main(["--rig", "gpu2-homo", "--share-gpu", "--memory-fraction", "1=2", "--micro-batch", "auto"]) == 2
    assert "--memory-fraction='1=2' is invalid" in capsys.readouterr().err


def test_limits_reach_every_setting_and_give_the_limited_rank_its_own_solo() -> None:
    config = _config(["--rig", "gpu2-homo", "--share-gpu", "--budget", "quick", "--tp-batch", "512",
                      "--memory-fraction", "1=0.02", "--micro-batch", "auto"])
    (homo,) = config.settings
    assert homo.rank_memory == (None, 0.02) and homo.rank_micro_batch == ("auto", "auto") and homo.limited
    assert homo.representatives(2) == [0, 1] and homo.solo_ranks(2) == [0, 1]
    assert not homo.throttled, "a memory limit is not a speed throttle: no throttle check"
    assert "rank 1 limited to 0.02 of its GPU's memory" in homo.describe()
    plain = _config(["--rig", "gpu2-homo", "--budget", "quick"]).headline
    assert not plain.limited and plain.representatives(2) == [0, 0] and plain.describe() == "no throttle"
    hetero = _config(["--rig", "gpu2-hetero", "--budget", "quick", "--micro-batch", "1=64"]).headline
    assert hetero.rank_sms == () and hetero.sms == 32 and hetero.rank_micro_batch == (None, 64)


# -- what each arm runs -----------------------------------------------------------------------------


def test_each_arm_runs_the_micro_batches_the_limits_allow() -> None:
    micro, memory, batch = ("auto", "auto"), (None, 0.02), 512
    planned = planned_sizes(micro, batch, {0: 512, 1: 128})
    assert planned == [512, 128] and planned_sizes((None, 96), 512, {}) == [512, 96]
    assert accumulation(128, 512) == 4 and accumulation(96, 512) == 6  # the last micro-batch partial
    # Solo fits: each rank at its own micro-batch, accumulated to the whole batch per step (the ideal).
    assert solo_shape(memory, 0, batch, planned) == FitShape(512, 1, None, None)
    assert solo_shape(memory, 1, batch, planned) == FitShape(128, 4, None, 0.02)
    # ElChe: the loader's batch, every rank's own setting; DDP: every rank at the smallest, accumulated.
    assert multi_shape(memory, micro, True, 1, batch, planned) == FitShape(512, 1, ["auto", "auto"], 0.02)
    assert multi_shape(memory, micro, False, 0, batch, planned) == FitShape(128, 4, None, None)
    assert FitShape(512, 1, None, 0.02).record(128)["per_step"] == 4
    assert FitShape(128, 4).record(128)["per_step"] == 4 and FitShape(512).record(None)["per_step"] is None
    strategy = make_strategy("nccl_cadence", _config(["--rig", "cpu2"]), [None, 8])
    assert isinstance(strategy, ElCheStrategy) and strategy.elche.micro_batch == [None, 8]


def _record(rank: int, batches: int, batch: int, **extra: Any) -> dict[str, Any]:
    return {"rank": rank, "t_fit0": 0.0, "t_start": 1.0, "t_end": 11.0, "eval_s": 0.0,
            "samples": batches * batch, "steps": batches, "total_samples": batches * batch, "total_steps": batches,
            "epochs": 3, "batch_size": batch, "stopped_by_cap": False, "trace": [],
            "model": {"grad_bytes": 4000, "buffer_bytes": 0, "param_bytes": 4000, "float_buffer_bytes": 0}, **extra}


def _limited_pass() -> dict[str, Any]:
    """Rank 1 holds micro-batches of 8 of the batch of 32: alone 50 samples/s, rank 0 100/s."""
    solo = [_record(0, 100, 32, solo_of_rank=0, micro_batch=FitShape(32).record(32)),
            _record(0, 200, 8, solo_of_rank=1, micro_batch=FitShape(8, 4, None, 0.02).record(8))]
    ddp_shape = FitShape(8, 4)
    ddp = [_record(r, 160, 8, micro_batch=ddp_shape.record(8)) for r in range(2)]  # 40 steps of 4 batches
    totals = [{"steps": n, "samples": 32 * n, "compute_s": 9.0, "sync_s": 1.0, "micro_batch": m}
              for n, m in ((30, 32), (15, 8))]
    info = {"rounds": 10, "cohort_step": 45, "final_anchor": 2, "window_plan": [2, 1], "totals": totals,
            "meta_bytes": 168, "bf16_wire": False}
    elche = [_record(r, n, 32, elche=info, micro_batch=FitShape(32, 1, [None, 8], f).record(m))
             for r, (n, m, f) in enumerate(((30, 32, None), (15, 8, 0.02)))]
    records = {"p-solo": solo, "p-ddp": ddp, "p-nccl_cadence": elche}
    return metrics.throughput_pass([("solo", "p-solo"), ("ddp", "p-ddp"), ("nccl_cadence", "p-nccl_cadence")],
                                   records, representatives=[0, 1])


def test_accumulated_ddp_counts_one_gradient_all_reduce_per_optimizer_step() -> None:
    tp = _limited_pass()
    ddp = tp["arms"]["ddp"]
    assert ddp["syncs"] == 40, "160 batches of 8, accumulated 4 to a step"
    assert ddp["bytes_sent"] == metrics.ddp_bytes(40, 4000, 0, 2)
    assert [m["size"] for m in ddp["micro_batch"]] == [8, 8]
    assert tp["arms"]["solo_rank1"]["micro_batch"]["per_step"] == 4


def test_the_report_shows_each_ranks_micro_batch_share_and_efficiency() -> None:
    tp = _limited_pass()
    tp["limits"] = {"memory_fraction": [None, 0.02], "micro_batch": ["auto", "auto"], "batch": 32,
                    "planned": [32, 8], "searched": [{"chosen": 32, "usable_bytes": 2**32},
                                                     {"chosen": 8, "usable_bytes": 3 * 2**30}]}
    text = "\n".join(limits_lines(tp, 2))
    assert "rank 1 may allocate 0.02 of its GPU's memory" in text
    assert "micro_batch='auto' searched before the fits: r0 32 (4.00 GiB usable), r1 8 (3.00 GiB usable)" in text
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in text.splitlines() if line.startswith("| `")}
    ideal = 100.0 + 50.0
    assert rows["`solo_rank0`"] == ["32 / -", "1 / -", "-", f"{100 / ideal:.2f}"]
    assert rows["`solo_rank1`"] == ["- / 8", "- / 4", "-", f"{50 / ideal:.2f}"]
    assert rows["`ddp`"] == ["8 / 8", "4 / 4", "50% / 50%", f"{tp['arms']['ddp']['efficiency']:.2f}"]
    assert rows["`nccl_cadence`"] == ["32 / 8", "1 / 4", "67% / 33%", f"{tp['arms']['nccl_cadence']['efficiency']:.2f}"]
    assert "| speed share (the balanced batch share) | | | 67% / 33% | |" in text
    assert limits_lines({"arms": tp["arms"]}, 2) == [], "no limits: no table"


# -- one run on 2 CPU ranks -------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.extended  # CI runs the cpu2 tiny benchmark once (test_bench.py); the limits' parsing and rows here
@pytest.mark.timeout(330)
def test_cpu2_tiny_with_a_micro_batched_rank_reports_it_per_arm(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    status, output = run_command(
        [sys.executable, "-m", "lightning_elche.bench", "--rig", "cpu2", "--budget", "tiny", "--seeds", "0",
         "--only-headline", "--micro-batch", "1=8", "--tp-arms", "ddp,nccl_cadence", "--micro-iters", "2",
         "--no-plots", "--out", str(out)], tmp_path, 320)
    assert status == 0, output[-4000:]
    result = json.loads((out / "cpu2.json").read_text())
    assert result["limits"]["micro_batch"] == [None, 8] and result["limits"]["planned"] == [32, 8]
    arms = result["arms"]
    assert arms["solo_rank0"]["micro_batch"]["size"] == 32 and arms["solo_rank1"]["micro_batch"]["per_step"] == 4
    assert [(m["size"], m["per_step"]) for m in arms["ddp"]["micro_batch"]] == [(8, 4), (8, 4)]
    # The ElChe fit's own micro-batches, as its rounds reported them to every rank.
    assert [(m["size"], m["per_step"]) for m in arms["nccl_cadence"]["micro_batch"]] == [(32, 1), (8, 4)]
    assert [t["micro_batch"] for t in arms["nccl_cadence"]["elche"]["totals"]] == [32, 8]
    assert arms["ddp"]["syncs"] * 4 == sum(arms["ddp"]["steps"]) // 2, "one all-reduce per 4 batches of 8"
    table = (out / "cpu2.md").read_text()
    assert "| `nccl_cadence` | 32 / 8 | 1 / 4 |" in table and "| `ddp` | 8 / 8 | 4 / 4 | 50% / 50% |" in table
