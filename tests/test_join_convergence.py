"""A fit that loses a rank and grows back ends as well as one without faults (issue 22, item 9).

On scikit-learn digits (the data, MLP 64-256-256-10 and SGD with momentum of test_convergence.py;
30 epochs, 3 CPU ranks of different speeds, batches of 8), for 3 seeds: a fault-free fit, and a fit
in which launch rank 1 is SIGKILLed at its step ``KILL_AT_STEP`` (epoch 2 of 30) and
``restart_lost=1`` starts it again as a joiner (``ELCHE_JOIN=1``, member 3); launch rank 0 waits at
its step ``HOLD_AT_STEP`` until the joiner asked to join, so that the admission comes while the fit
runs (epoch 4: the replacement needs seconds to start while the two survivors train on). That is
the realistic order: a replacement only exists after the loss.

Batches of 8, not test_convergence.py's 32: the numbers in docs/failures.md ("Convergence through a
loss and a join") were measured so. At 32 ElChe's windows span each epoch and the admission relies
on the round kept before an epoch's end while a joiner waits (tests/test_join_long_windows.py).

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
from test_join import check_grown, run_join_job

SEEDS = 3
EPOCHS = 30
DIGITS_TRAIN = 1438  # digits_split's training rows (1797 less the 20 % held out)
BATCH = 8  # 180 batches an epoch (see the docstring)
KILL_AT_STEP = 130  # rank 1's optimizer step: ~60 steps per rank and epoch on three ranks
HOLD_AT_STEP = 330  # rank 0's step, about two epochs later
LAUNCH = 3
JOINER = LAUNCH  # the restarted rank's member id: the first after the launch ranks
DIGITS = ("--digits", "--devices", str(LAUNCH), "--epochs", str(EPOCHS), "--batch-size", str(BATCH),
          "--delays-ms", "20", "30", "25")

pytestmark = [pytest.mark.distributed, pytest.mark.extended, pytest.mark.timeout(1800)]


def _held_out(result: dict[str, Any]) -> tuple[float, float]:
    return float(result["held_out_acc"]), float(result["held_out_loss"])


def fault_free(out: Path, mode: str, seed: int) -> tuple[float, float]:
    job = run_join_job(out, mode, joiners=0, cohort_extra=(*DIGITS, "--seed", str(seed)))
    assert job.cohort_rc == 0 and not job.leftover, job.log[-4000:]
    assert sorted(job.results) == list(range(LAUNCH))
    assert all(r["params"] == job.results[0]["params"] for r in job.results.values())
    assert job.results[0]["changes"] == [] and job.results[0]["losses"] == []
    return _held_out(job.results[0])


def lost_and_joined(out: Path, mode: str, seed: int) -> tuple[float, float, dict[str, int]]:
    job = run_join_job(out, mode, joiners=0, cohort_extra=(
        *DIGITS, "--seed", str(seed), "--fault", f"kill:1:{KILL_AT_STEP}", "--restart-lost", "1",
        "--hold-for-joiner", str(HOLD_AT_STEP)))
    check_grown(job, joins=[[JOINER]], lost=(1,), epochs=EPOCHS, samples=DIGITS_TRAIN, launch=LAUNCH)
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
