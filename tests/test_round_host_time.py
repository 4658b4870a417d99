"""``tools/round_host_time.py`` on the host (gloo, one rank): each part of a round is timed and a
part called inside another (gloo's waits inside its reduce) is not counted twice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(120)
def test_round_host_time_splits_both_rounds_into_their_parts(tmp_path: Path) -> None:
    out = tmp_path / "host.json"
    shown = subprocess.run(
        [sys.executable, "tools/round_host_time.py", "--device", "cpu", "--megabytes", "1", "--tensors", "7",
         "--iters", "5", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=110, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert shown.returncode == 0, shown.stderr[-3000:]
    result = json.loads(out.read_text())
    out_of_place, in_place = result["out-of-place 1 MB"], result["fused 1 MB"]
    assert out_of_place["out_of_place"] and not in_place["out_of_place"]
    for row in (out_of_place, in_place):
        assert row["average_us"] > 0 and all(us >= 0 for us in row["parts_us"].values())
        # Only the outermost timed call counts, so no round's parts add up to more than the round.
        assert row["rest_us"] >= 0
    assert out_of_place["parts_us"]["collectives"] > 0 and out_of_place["parts_us"]["settle"] > 0
    assert out_of_place["parts_us"]["in_place_reduce"] == 0
    assert in_place["parts_us"]["in_place_reduce"] > 0 and in_place["parts_us"]["collectives"] == 0
    assert "out-of-place 1 MB" in shown.stdout and result["device"] == "cpu"
