"""A fit whose windows span its epochs still admits a joiner (issue 22, docs/failures.md
"Convergence through a loss and a join").

scikit-learn digits at batches of 32 on 3 CPU ranks: 45 batches an epoch, and the pooled dispatch
plans each window to the epoch's end once the controller has its readings, so a round at which
every rank still has data (what an admission needs) only comes while joiners wait
(``ElCheController.keep_a_round_before_the_epoch_end``). Launch rank 1 is SIGKILLed at its step 20
(epoch 1) and ``restart_lost=1`` starts it again as a joiner; rank 0 waits at its step 60 for its
request. Without the kept round every round ended an epoch and the joiner waited out the fit (it left
with exit 0: "the fit ended before it could admit this joiner"), and check_grown fails.

Three processes and a replacement for 6 epochs: ``faults`` (about 40 s a mode on the shared 2-core machine).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_join import check_grown, run_join_job

EPOCHS = 6
DIGITS_TRAIN = 1438  # digits_split's training rows
JOINER = 3  # the restarted rank's member id: the first after the launch ranks 0-2

pytestmark = [pytest.mark.distributed, pytest.mark.faults, pytest.mark.timeout(900)]


@pytest.mark.parametrize("mode", ["nccl_cadence", "cpu_cadence"])
def test_a_fit_whose_windows_span_an_epoch_admits_a_restarted_rank(tmp_path: Path, mode: str) -> None:
    job = run_join_job(
        tmp_path,
        mode,
        joiners=0,
        timeout_s=600,
        cohort_extra=(
            "--digits",
            "--devices",
            "3",
            "--epochs",
            str(EPOCHS),
            "--batch-size",
            "32",
            "--delays-ms",
            "20",
            "30",
            "25",
            "--seed",
            "1",
            "--fault",
            "kill:1:20",
            "--restart-lost",
            "1",
            "--hold-for-joiner",
            "60",
        ),
    )
    check_grown(job, joins=[[JOINER]], lost=(1,), epochs=EPOCHS, samples=DIGITS_TRAIN, launch=3)
    join = next(c for c in job.results[0]["changes"] if c["joined"])
    assert int(join["epoch"]) < EPOCHS - 1, job.results[0]["changes"]  # admitted while the fit had epochs left
