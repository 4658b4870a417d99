"""augment (pick multiplicity) and transform (deterministic per pick) with ElChe's dispatch."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections import Counter

import lightning.pytorch as pl
import pytest
import torch
from augment_helpers import AugmentedModel, augmented
from test_data import SharedCounter, drain_interleaved
from test_strategy_distributed import elche

from lightning_elche import AugmentedDataset, PickKey
from lightning_elche.config import Dispatch
from lightning_elche.dispatch import build_sampler
from lightning_elche.testing import Throttle


def keyed_sampler(rank, counter, n=100, augment=3, dispatch=Dispatch.POOL, epoch=1):
    sampler = build_sampler(dispatch, n, 10, rank, 2, shuffle=True, seed=3, counter=counter, key_prefix="a",
                            augment=augment, pick_keys=True)
    sampler.set_epoch(epoch)
    return sampler


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("speeds", [(1, 1), (4, 1)])
def test_pool_dispatches_every_index_and_repeat_exactly_once(seed, speeds):
    counter = SharedCounter()
    samplers = [keyed_sampler(r, counter, n=101) for r in range(2)]
    out = drain_interleaved(samplers, random.Random(seed), speeds)
    keys = out[0] + out[1]
    assert all(isinstance(k, PickKey) and k.epoch == 1 for k in keys)
    assert Counter((k.index, k.repeat) for k in keys) == Counter((i, r) for i in range(101) for r in range(3))
    if speeds[0] > speeds[1]:
        assert len(out[0]) > 2 * len(out[1])
    # The repeats of a sample are spread over the epoch (one permutation of the pick space).
    first_third = {k.index for k in keys[:101]}
    assert len(first_third) < 101


@pytest.mark.parametrize("dispatch", [Dispatch.EQUAL, Dispatch.FIXED])
def test_equal_and_fixed_dispatch_cover_every_pick(dispatch):
    kw = {"partition_ratios": [0.6, 0.4]} if dispatch == "fixed" else {}
    samplers = [build_sampler(dispatch, 50, 10, r, 2, shuffle=False, seed=0, augment=2, pick_keys=True, **kw)
                for r in range(2)]
    keys = list(samplers[0]) + list(samplers[1])
    assert sorted((k.index, k.repeat) for k in keys) == [(i, r) for i in range(50) for r in range(2)]


def test_transform_is_a_function_of_the_pick_only():
    dataset = augmented(20, 3)
    a = dataset[PickKey(7, 2, 4)]
    again = augmented(20, 3)[PickKey(7, 2, 4)]
    assert torch.equal(a[1], again[1])
    other_repeat, other_epoch = dataset[PickKey(7, 1, 4)], dataset[PickKey(7, 2, 5)]
    assert not torch.equal(a[1], other_repeat[1]) and not torch.equal(a[1], other_epoch[1])
    assert not torch.equal(a[1], AugmentedDataset(dataset.dataset, 3, dataset.transform, seed=6)[PickKey(7, 2, 4)][1])
    # Integer picks: index = p % n, repeat = p // n, in the epoch given to set_epoch.
    dataset.set_epoch(4)
    assert len(dataset) == 60 and torch.equal(dataset[2 * 20 + 7][1], a[1])
    with pytest.raises(IndexError):
        dataset[60]


def test_pick_seeds_do_not_depend_on_the_process():
    # Python salts str/tuple hashes per process; the pick seed must not depend on anything like it.
    code = "from lightning_elche import PickKey; print(PickKey(11, 2, 3).seed(5), PickKey(0, 0, 0).seed())"
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": str(s), "PATH": ""}).stdout for s in (1, 2)}
    assert runs == {f"{PickKey(11, 2, 3).seed(5)} {PickKey(0, 0, 0).seed()}\n"}
    seeds = {PickKey(i, r, e).seed() for i in range(30) for r in range(3) for e in range(3)}
    assert len(seeds) == 270 and all(0 <= s < 2**63 for s in seeds)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"augment": 0}, r"augment=0\) is invalid"), ({"augment": 2.0}, r"augment=2.0\) is invalid"),
     ({"transform": 3}, r"transform=3\) is invalid")],
)
def test_bad_augmented_dataset_arguments_are_refused(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        AugmentedDataset(list(range(5)), **kwargs)


def test_sampler_refuses_augment_without_pick_keys():
    with pytest.raises(ValueError, match="augment=2 needs pick_keys=True"):
        build_sampler(Dispatch.EQUAL, 10, 2, 0, 2, shuffle=False, seed=0, augment=2)


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_two_process_fit_trains_each_pick_once_with_the_same_transform_everywhere(tmp_path):
    pl.seed_everything(0, verbose=False)
    n, augment = 96, 3
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=elche(mode="nccl_cadence"), max_epochs=2,
                         limit_val_batches=0, callbacks=[Throttle(1, 3.0)], enable_progress_bar=False,
                         enable_model_summary=False, logger=False, enable_checkpointing=False,
                         default_root_dir=str(tmp_path))
    trainer.fit(AugmentedModel(str(tmp_path), n=n, augment=augment))
    picks = [json.loads((tmp_path / f"picks{r}.json").read_text()) for r in range(2)]
    assert len(picks[0]) > len(picks[1]) > 0  # the fast rank trained more picks
    everything = picks[0] + picks[1]
    for epoch in range(2):
        keys = sorted((i, r) for (i, r, e), _ in everything if e == epoch)
        assert keys == [(i, r) for i in range(n) for r in range(augment)]
    # Each rank's transformed inputs equal what this process computes for the same pick.
    reference = augmented(n, augment)
    for (index, repeat, epoch), row in everything:
        expected = reference[PickKey(index, repeat, epoch)][1]
        assert torch.allclose(torch.tensor(row), expected, atol=1e-6)
