"""Mixed micro-batches on real data (issue 24, item 4): on scikit-learn digits (the workload of
``test_convergence.py``: 2 ranks, rank 1 throttled 2x, 30 epochs), nccl_cadence with rank 0 training
its batches of 32 as 4 x 8 and rank 1 as 6 x 5 + 2 ends within seed noise of nccl_cadence on whole
batches. Six fits: behind ``-m extended``. Measured numbers: README "GPUs of different memory"."""

from __future__ import annotations

import json
import statistics

import pytest
import torch.multiprocessing as mp
from convergence_helpers import digits_convergence, within_seed_noise
from process_helpers import free_port

SEEDS = 3
EPOCHS = 30
ARMS = ("nccl_cadence", "nccl_cadence+micro")


def test_within_seed_noise_is_the_spread_of_the_seeds() -> None:
    assert within_seed_noise([0.95, 0.96, 0.97], [0.93, 0.95, 0.96])
    assert not within_seed_noise([0.95, 0.96, 0.97], [0.90, 0.91, 0.92])
    assert not within_seed_noise([0.96, 0.96, 0.96], [0.94, 0.94, 0.94])  # the floor of 0.01


@pytest.mark.distributed
@pytest.mark.extended
@pytest.mark.timeout(1500)
def test_mixed_micro_batches_learn_digits_within_seed_noise_of_whole_batches(tmp_path):
    mp.spawn(digits_convergence, args=(str(tmp_path), free_port(), SEEDS, EPOCHS, ARMS), nprocs=2, join=True)
    accuracy = json.loads((tmp_path / "digits0.json").read_text())
    assert json.loads((tmp_path / "digits1.json").read_text()) == accuracy  # replicas end identical
    print({arm: (round(statistics.mean(v), 4), [round(a, 4) for a in v]) for arm, v in accuracy.items()})
    whole, micro = accuracy["nccl_cadence"], accuracy["nccl_cadence+micro"]
    assert len(whole) == len(micro) == SEEDS
    assert statistics.mean(whole) > 0.9, "the reference did not learn"
    assert within_seed_noise(whole, micro), f"micro-batches {micro} vs whole batches {whole}"
