"""Held-out accuracy on real data (scikit-learn digits): every mode, and nccl_cadence with each outer
optimizer (plain averaging, SlowMo, DiLoCo), guard on and off, learn as well as lockstep averaging
at equal epochs, on a heterogeneous 2-rank rig, 3 seeds."""

from __future__ import annotations

import json
import statistics

import pytest
import torch.multiprocessing as mp
from convergence_helpers import CONVERGENCE_ARMS, digits_convergence
from process_helpers import free_port

SEEDS = 3
EPOCHS = 30


CI_ARMS = ("nccl_sync", "cpu_async", "nccl_cadence+diloco")
"""CI's sample (the lockstep reference, async rounds on the CPU plane, cadence rounds with an outer
optimizer); every arm under ``-m extended``."""


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("arms", [
    pytest.param(CI_ARMS, id="ci-sample"),
    pytest.param(CONVERGENCE_ARMS, id="every-arm", marks=pytest.mark.extended),
])
def test_every_mode_and_outer_optimizer_guard_on_and_off_within_one_point_of_nccl_sync(tmp_path, arms):
    mp.spawn(digits_convergence, args=(str(tmp_path), free_port(), SEEDS, EPOCHS, arms), nprocs=2, join=True)
    accuracy = json.loads((tmp_path / "digits0.json").read_text())
    assert json.loads((tmp_path / "digits1.json").read_text()) == accuracy  # replicas end identical
    median = {arm: statistics.median(values) for arm, values in accuracy.items()}
    print({arm: (round(median[arm], 4), [round(v, 4) for v in accuracy[arm]]) for arm in arms})
    assert median["nccl_sync"] > 0.9, "the reference did not learn"
    assert set(accuracy) == set(arms)
    for arm in arms:
        assert len(accuracy[arm]) == SEEDS
        assert median[arm] >= median["nccl_sync"] - 0.01, f"{arm}: {accuracy[arm]} vs nccl_sync {accuracy['nccl_sync']}"
