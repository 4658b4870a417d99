"""Resuming a mid-epoch checkpoint that leaves fewer batches of its epoch than there are resuming
ranks, none at all included (a resume on more ranks; under torchrun, a lone survivor stopped by
the agent after it trained to the end). Every rank still runs the epoch's end: the ranks without
a batch join the rounds without mass until the one that ends the epoch, then validate, run the
epoch-end hooks and save with the others; the next epoch is whole again.

The checkpoint is a real sync checkpoint of a 2-rank fit whose recorded remainder is cut to
``left`` epoch positions: the resumed run must train exactly those, once.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from resume_helpers import RecordEpochEnds
from test_resume_resize import N, run_fit, seen_in, sync_checkpoints

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]
BATCH = 16  # RecordingModel's
EPOCHS = 2  # the thin epoch 0, then a whole epoch 1


def thin_checkpoint(tmp_path: Path, mode: str, left: int) -> Path:
    """A 2-rank sync checkpoint of epoch 0 whose untrained remainder is cut to ``left`` positions."""
    run_fit(tmp_path / "first", mode, 2, 1, [sync_checkpoints(tmp_path / "ckpt")], validate=True)
    saved = sorted((tmp_path / "ckpt").glob("epoch=0-*.ckpt"))
    assert saved, "the first fit wrote no sync checkpoint in epoch 0"
    checkpoint = torch.load(saved[0], weights_only=False)
    coverage = checkpoint["elche"]["coverage"]
    assert coverage["epoch"] == 0
    start = coverage["remaining"][0][0]
    coverage["remaining"] = [(start, start + left)] if left else []
    path = tmp_path / "thin.ckpt"
    torch.save(checkpoint, path)
    return path


def epoch_ends(out_dir: Path, epoch: int, ranks: int) -> list[dict[str, float]]:
    files = [out_dir / f"epoch-end-e{epoch}-rank{r}.json" for r in range(ranks)]
    missing = [f.name for f in files if not f.exists()]
    assert not missing, f"ranks skipped the end of epoch {epoch}: {missing}"
    return [json.loads(f.read_text()) for f in files]


CASES = [
    ("cpu_cadence", 0),  # nothing left: every rank is without a batch
    ("nccl_sync", BATCH),  # one batch for 3 ranks (equal split: each rank a few samples)
    ("cpu_async", 2 * BATCH + 5),  # two batches and a short one for 4 ranks
]
EXTENDED = [("nccl_cadence", BATCH), ("cpu_sync", 0), ("cpu_cadence", 2 * BATCH), ("nccl_sync", 0), ("cpu_sync", 2)]


@pytest.mark.parametrize(("mode", "left"), [*CASES, *(pytest.param(*c, marks=pytest.mark.extended) for c in EXTENDED)])
def test_a_checkpoint_leaving_fewer_batches_than_ranks_resumes_and_runs_the_epoch_end(tmp_path, mode, left):
    ranks = 4 if mode == "cpu_async" else 3
    path = thin_checkpoint(tmp_path, mode, left)
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    ends = ModelCheckpoint(dirpath=str(tmp_path / "ends"), filename="{epoch}", every_n_epochs=1, save_top_k=-1)
    records = run_fit(resumed, mode, ranks, EPOCHS, [RecordEpochEnds(str(resumed)), ends], ckpt_path=path,
                      validate=True)

    thin = seen_in(records, 0)
    assert len(thin) == len(set(thin)) == left, "the remainder was not trained exactly once"
    assert sorted(seen_in(records, 1)) == list(range(N)), "the epoch after the thin one is not whole"
    assert all(r["params"] == records[0]["params"] for r in records), "replicas differ"
    assert len({r["rounds"] for r in records}) == 1
    for epoch in range(EPOCHS):
        metrics = epoch_ends(resumed, epoch, ranks)
        assert all("val_loss" in m for m in metrics), f"epoch {epoch} ended without validation on some rank"
        assert all(m["val_loss"] == metrics[0]["val_loss"] for m in metrics)
        assert (tmp_path / "ends" / f"epoch={epoch}.ckpt").exists(), f"no epoch-end checkpoint of epoch {epoch}"
    if left:
        assert all("train_loss_step_epoch" in m for m in epoch_ends(resumed, 0, ranks))
