"""``tools/in_arm_shares.py``: a committed result's ElChe arms read against their in-arm speeds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from in_arm_shares import in_arm_speed_share, rows, speed_moves  # noqa: E402


def _row(shares: list[float], compute: list[float], solo_error: float) -> dict[str, object]:
    return {"kind": "elche", "share_error": solo_error, "steady_batch_share": shares,
            "loss_breakdown": {"seconds": {"compute": compute}}}


def test_a_rank_that_computed_longer_for_its_batches_reads_as_slower_inside_the_arm(tmp_path: Path) -> None:
    # Rank 1 trained a third of the batches in the same compute time: it ran at half rank 0's speed,
    # so a 2 : 1 split is exactly balanced; in twice the compute time it ran at a quarter.
    assert in_arm_speed_share(_row([2 / 3, 1 / 3], [10.0, 10.0], 0.2)) == pytest.approx([2 / 3, 1 / 3])
    assert in_arm_speed_share(_row([2 / 3, 1 / 3], [10.0, 20.0], 0.2)) == pytest.approx([0.8, 0.2])
    assert in_arm_speed_share({"kind": "elche", "steady_batch_share": [0.5, 0.5]}) is None
    recorded = {**_row([0.5, 0.5], [10.0, 10.0], 0.0), "in_arm_speed_share": [0.7, 0.3]}
    assert in_arm_speed_share(recorded) == pytest.approx([0.7, 0.3])  # the report's own, where it has one
    result = tmp_path / "cpu2.json"
    result.write_text(json.dumps({"arms": {
        "ddp": {"kind": "ddp", "share_error": 0.5, "steady_batch_share": [0.5, 0.5]},
        "cpu_async": _row([2 / 3, 1 / 3], [10.0, 20.0], 0.1)}}))
    [(arm, solo, in_arm)] = rows(result)
    assert arm == "cpu_async" and solo == pytest.approx(0.1)
    assert in_arm == pytest.approx((1 / 3) / 0.2 - 1)  # rank 1 got 1/3 of the batches for 1/5 of the speed
    result.write_text(json.dumps({"speed_share": [0.5, 0.5], "arms": json.loads(result.read_text())["arms"]}))
    [(arm, moves)] = speed_moves(result)
    assert arm == "cpu_async" and moves == pytest.approx([0.6, -0.6])  # 0.8 and 0.2 in the arm, 0.5 alone
    shown = subprocess.run([sys.executable, "tools/in_arm_shares.py", str(result)], cwd=ROOT, capture_output=True,
                           text=True, timeout=60, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert shown.returncode == 0, shown.stderr
    assert "cpu_async" in shown.stdout and "10.0 %" in shown.stdout and "66.7 %" in shown.stdout
