"""A fit that loses a rank and grows back ends as well as one without faults (issue 22, item 9).

On scikit-learn digits (the workload of test_convergence.py: MLP 64-256-256-10, SGD with momentum,
batches of 32, 30 epochs, 2 CPU ranks of different speeds), for 3 seeds: a fault-free fit, and a
fit in which launch rank 1 is SIGKILLed at its step ``KILL_AT_STEP`` (epoch ~9 of 30) and
``restart_lost=1`` starts it again as a joiner (``ELCHE_JOIN=1``, member 2); launch rank 0 waits at
its step ``HOLD_AT_STEP`` until the joiner asked to join, so that the admission comes while the fit
runs (in a later epoch than the loss: the replacement needs seconds to start, and the lone rank
trains on meanwhile). That is the realistic order: a replacement only exists after the loss.

The grown fit's held-out accuracy and loss lie within seed noise of the fault-free fits (the
``within_seed_noise`` of test_micro_batch_convergence.py), its three processes end with identical
parameters, and every sample of every epoch was trained exactly once in the consensus (the lost
rank's batches of its last epoch counted as far as the members kept them). Twelve fits: behind
``-m extended``. Measured numbers: docs/failures.md "Convergence through a loss and a join".
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest
from convergence_helpers import within_seed_noise
from test_join import JOINER, check_grown, run_join_job

SEEDS = 3
EPOCHS = 30
DIGITS_TRAIN = 1438  # digits_split's training rows (1797 less the 20 % held out)
KILL_AT_STEP = 200  # rank 1's optimizer step: ~22 steps per rank and epoch on two ranks
HOLD_AT_STEP = 500  # rank 0's step, ~6 epochs later on its own
DIGITS = ("--digits", "--epochs", str(EPOCHS), "--batch-size", "32", "--delays-ms", "2", "4")

pytestmark = [pytest.mark.distributed, pytest.mark.extended, pytest.mark.timeout(1800)]


def _held_out(result: dict[str, Any]) -> tuple[float, float]:
    return float(result["held_out_acc"]), float(result["held_out_loss"])


def fault_free(out: Path, mode: str, seed: int) -> tuple[float, float]:
    job = run_join_job(out, mode, joiners=0, cohort_extra=(*DIGITS, "--seed", str(seed)))
    assert job.cohort_rc == 0 and not job.leftover, job.log[-4000:]
    assert sorted(job.results) == [0, 1] and job.results[0]["params"] == job.results[1]["params"]
    assert job.results[0]["changes"] == [] and job.results[0]["losses"] == []
    return _held_out(job.results[0])


def lost_and_joined(out: Path, mode: str, seed: int) -> tuple[float, float, dict[str, int]]:
    job = run_join_job(out, mode, joiners=0, cohort_extra=(
        *DIGITS, "--seed", str(seed), "--fault", f"kill:1:{KILL_AT_STEP}", "--restart-lost", "1",
        "--hold-for-joiner", str(HOLD_AT_STEP)))
    check_grown(job, joins=[[JOINER]], lost=(1,), epochs=EPOCHS, samples=DIGITS_TRAIN)
    changes = job.results[0]["changes"]
    loss = next(c for c in changes if c["lost"])
    join = next(c for c in changes if c["joined"])
    assert loss["generation"] < join["generation"], changes  # the replacement joins after the loss
    assert _held_out(job.results[JOINER]) == _held_out(job.results[0])  # one model on every rank
    return (*_held_out(job.results[0]), {"lost_in_epoch": int(loss["epoch"]), "joined_in_epoch": int(join["epoch"])})


@pytest.mark.parametrize("mode", ["cpu_cadence", "nccl_cadence"])
def test_a_fit_that_loses_a_rank_and_takes_a_joiner_learns_digits_within_seed_noise(tmp_path: Path,
                                                                                     mode: str) -> None:
    clean: list[tuple[float, float]] = []
    grown: list[tuple[float, float]] = []
    when: list[dict[str, int]] = []
    for seed in range(SEEDS):
        clean.append(fault_free(tmp_path / f"clean{seed}", mode, seed))
        acc, loss, epochs = lost_and_joined(tmp_path / f"grown{seed}", mode, seed)
        grown.append((acc, loss))
        when.append(epochs)
    report = {"mode": mode, "fault_free": clean, "loss_and_join": grown, "epochs": when}
    print(json.dumps(report))
    (tmp_path / "join_convergence.json").write_text(json.dumps(report))
    clean_acc, grown_acc = [a for a, _ in clean], [a for a, _ in grown]
    clean_loss, grown_loss = [v for _, v in clean], [v for _, v in grown]
    assert statistics.mean(clean_acc) > 0.9, f"the fault-free fits did not learn: {clean_acc}"
    assert all(e["joined_in_epoch"] < EPOCHS - 1 for e in when), f"a join came too late to matter: {when}"
    assert within_seed_noise(clean_acc, grown_acc), f"accuracy: loss and join {grown_acc} vs fault-free {clean_acc}"
    assert within_seed_noise(clean_loss, grown_loss, floor=0.02), (
        f"held-out loss: loss and join {grown_loss} vs fault-free {clean_loss}")
