"""The examples run end to end, each in its own subprocess (2 real CPU ranks, gloo).

``examples/train.py`` uses Lightning's ``popen`` launcher, which re-executes the script for rank 1:
fine in a subprocess, never inside pytest itself. Each command runs in its own session so that a
hang is cleaned up with all of its rank processes (``subprocess.run(timeout=...)`` would only kill
the first one). No timing is asserted: CI machines are too noisy.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from process_helpers import run_command

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TRAIN = EXAMPLES / "train.py"
CONFIGS = EXAMPLES / "configs"
COMMAND_TIMEOUT_S = 150


def run(args: list[str], cwd: Path) -> str:
    """Run ``python *args`` in ``cwd``; fail with the output's tail on a non-zero exit or a hang."""
    status, output = run_command([sys.executable, *args], cwd, COMMAND_TIMEOUT_S)
    assert status == 0, f"{args} exited with {status}:\n{output[-4000:]}"
    return output


def test_hetero_demo_quick_reports_all_four_arms(tmp_path):
    result_path = tmp_path / "hetero.json"
    output = run([str(EXAMPLES / "hetero_demo.py"), "--quick", "--json", str(result_path)], tmp_path)
    result = json.loads(result_path.read_text())
    assert set(result["arms"]) == {"solo", "solo_throttled", "ddp", "elche"}
    for arm, row in result["arms"].items():
        assert row["samples_per_s"] > 0, arm
        assert row["efficiency"] > 0, arm
    assert len(result["arms"]["ddp"]["ranks"]) == len(result["arms"]["elche"]["ranks"]) == 2
    assert result["arms"]["elche"]["ranks"][0]["elche"]["syncs"] > 0
    assert "ElCheStrategy nccl_cadence" in output


@pytest.mark.parametrize("mode", [
    *(pytest.param(m, marks=pytest.mark.extended) for m in ("nccl_sync", "cpu_sync", "cpu_cadence")),
    "nccl_cadence", "cpu_async",
])
def test_cli_yaml_fit(tmp_path, mode):
    output = run([str(TRAIN), "fit", "--config", str(CONFIGS / f"{mode}.yaml"), "--trainer.max_epochs=2"], tmp_path)
    assert f"ElChe summary: mode {mode}" in output
    assert list((tmp_path / "lightning_logs").rglob("metrics.csv")), "the CSVLogger wrote nothing"
    if mode == "cpu_async":  # the YAML also wires DiLoCo and the monitor by class_path
        assert (tmp_path / "lightning_logs" / "cpu_async_dashboard.html").is_file()
        assert (tmp_path / "lightning_logs" / "cpu_async_records" / "rank1.jsonl").is_file()


def test_cli_print_config_round_trips(tmp_path):
    printed = run([str(TRAIN), "fit", "--config", str(CONFIGS / "nccl_cadence.yaml"), "--print_config"], tmp_path)
    assert "class_path: lightning_elche.ElCheStrategy" in printed
    assert "max_anchor: 20" in printed
    config = tmp_path / "printed.yaml"
    config.write_text(printed)
    output = run([str(TRAIN), "fit", "--config", str(config), "--trainer.max_epochs=1"], tmp_path)
    assert "ElChe summary: mode nccl_cadence" in output


def test_cli_registered_strategy_name(tmp_path):
    config = tmp_path / "registered.yaml"
    config.write_text(
        "trainer:\n"
        "  accelerator: cpu\n"
        "  devices: 2\n"
        "  max_epochs: 1\n"
        "  strategy: elche_nccl_sync\n"
        "  logger: false\n"
        "  enable_checkpointing: false\n"
        "  enable_progress_bar: false\n"
        "model:\n"
        "  hidden: 128\n"
        "data:\n"
        "  num_samples: 2048\n"
        "  val_samples: 256\n"
    )
    output = run([str(TRAIN), "fit", "--config", str(config)], tmp_path)
    assert "ElChe summary: mode nccl_sync" in output
