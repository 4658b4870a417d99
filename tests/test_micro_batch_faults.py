"""Mixed micro-batches through membership changes (issue 24, item 3): a rank that splits its batches
is simply slower, so a lost rank's work, a joiner's share and the exactly-once coverage hold as
they do with whole batches. Real CPU jobs (``tests/scripts/fault_fit.py``, gloo); the lost-rank
checks are the survival checks of every fault job (:func:`fault_jobs.check_survived`), the join
checks those of ``test_join.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fault_jobs import check_survived, csv_rows, run_job
from test_join import check_joined, run_join_job

pytestmark = pytest.mark.distributed


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["cpu_cadence", pytest.param("nccl_sync", marks=pytest.mark.faults),
                                  pytest.param("cpu_async", marks=pytest.mark.faults)])
def test_a_rank_lost_among_mixed_micro_batches_leaves_every_sample_trained_once(tmp_path: Path, mode: str) -> None:
    # Batches of 8: rank 1 trains them as 3 + 3 + 2, rank 2 (lost at its step 12) as 4 + 4.
    job = run_job(tmp_path, mode, ["kill:2:12"], extra=("--micro-batch", "1=3,2=4"))
    check_survived(job, {2})
    # Each rank's micro-batch as its rounds reported it, numbered as the rounds were: all three
    # before the loss, the two survivors after it.
    rows = [row for row in csv_rows(tmp_path) if row.get("elche/micro_batch/rank0")]
    sizes = [tuple(float(row[f"elche/micro_batch/rank{k}"]) for k in range(3) if row.get(f"elche/micro_batch/rank{k}"))
             for row in rows]
    assert sizes and set(sizes) <= {(8.0, 3.0, 4.0), (8.0, 3.0)} and sizes[-1] == (8.0, 3.0), sizes


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", [pytest.param("cpu_cadence", marks=pytest.mark.extended),
                                  pytest.param("nccl_sync", marks=pytest.mark.faults)])
def test_a_joiner_that_splits_its_batches_takes_its_share_and_loses_nobody_a_sample(tmp_path: Path,
                                                                                  mode: str) -> None:
    check_joined(run_join_job(tmp_path, mode, joiner_extra=("--micro-batch", "3")))
