"""Messages name what the user wrote: their own sampler class, and which counts the summary shows."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler, SequentialSampler, TensorDataset

from lightning_elche import ElCheConfig
from lightning_elche.engine import FitProgress, RankTotals
from lightning_elche.loop_glue import sampler_for, user_sampler_name
from lightning_elche.summary import format_summary


class EveryOtherSampler(Sampler[int]):
    """A user's own sampler (what Lightning wraps in a DistributedSamplerWrapper under DDP)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(0, self.n, 2))

    def __len__(self) -> int:
        return (self.n + 1) // 2


def test_a_custom_sampler_refusal_names_the_users_class_not_lightnings_wrapper():
    data = TensorDataset(torch.arange(16.0))
    wrapped = DistributedSamplerWrapper(EveryOtherSampler(16), num_replicas=2, rank=0, shuffle=False)
    loader = DataLoader(data, batch_size=4, sampler=wrapped)
    assert user_sampler_name(wrapped) == "EveryOtherSampler"
    with pytest.raises(TypeError) as info:
        sampler_for(loader, ElCheConfig.preset("nccl_sync"), 0, 2, "prefix", 4)
    assert "custom sampler (EveryOtherSampler)" in str(info.value)
    assert "DistributedSamplerWrapper" not in str(info.value)
    # Without Lightning's wrapper (use_distributed_sampler=False) the class is named directly.
    unwrapped = DataLoader(data, batch_size=4, sampler=EveryOtherSampler(16))
    with pytest.raises(TypeError, match=r"custom sampler \(EveryOtherSampler\)"):
        sampler_for(unwrapped, ElCheConfig.preset("nccl_sync"), 0, 2, "prefix", 4)


def progress(cohort_step: int, steps: tuple[int, int]) -> FitProgress:
    return FitProgress(mode="nccl_cadence", rounds=12, cohort_step=cohort_step, anchor=3, plan=(3, 2),
                       epoch_batches=32, totals=tuple(RankTotals(steps=s, samples=16 * s) for s in steps))


def test_summary_after_a_resume_says_which_steps_the_rows_count():
    text = format_summary(progress(120, (40, 20)))
    assert "120 cohort steps since the run started (60 in this fit, resumed at cohort step 60)" in text
    assert "rows: this fit" in text
    rows = [line.split() for line in text.splitlines()[2:]]
    assert [int(r[1]) for r in rows] == [40, 20] and sum(int(r[1]) for r in rows) == 60


def test_summary_of_a_fresh_fit_has_rows_that_add_up_to_the_cohort_steps():
    text = format_summary(progress(60, (40, 20)))
    assert "60 cohort steps," in text and "rows: the whole run" in text and "resumed" not in text


def test_an_iterable_dataset_is_refused_naming_the_alternative():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(torch.arange(8.0))

    with pytest.raises(TypeError, match="cannot dispatch an IterableDataset.*map-style Dataset"):
        sampler_for(DataLoader(Stream(), batch_size=4), ElCheConfig.preset("nccl_sync"), 0, 2, "prefix", 4)


def test_a_custom_batch_sampler_is_refused_naming_its_class():
    class PairedBatches(BatchSampler):
        pass

    data = TensorDataset(torch.arange(16.0))
    loader = DataLoader(data, batch_sampler=PairedBatches(SequentialSampler(data), batch_size=4, drop_last=False))
    with pytest.raises(TypeError, match=r"custom batch_sampler \(PairedBatches\).*batch_size"):
        sampler_for(loader, ElCheConfig.preset("nccl_sync"), 0, 2, "prefix", 4)
