"""Resuming a mid-epoch checkpoint that leaves fewer batches of its epoch than there are resuming
ranks, none at all included (a preemption save taken after the epoch's last batch, before its
end). Every rank still runs the epoch's end: the ranks without a batch join the rounds without
mass until the one that ends the epoch, then validate, run the epoch-end hooks and save with the
others; the next epoch is whole again.

The checkpoint is a real sync checkpoint of a 2-rank fit whose recorded remainder is cut to
``left`` epoch positions: the resumed run must train exactly those, once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from model_helpers import RecordingModel
from process_helpers import load_records
from resume_helpers import RecordEpochEnds
from test_resume_resize import N, config_for, seen_in, sync_checkpoints
from test_strategy_distributed import PG_TIMEOUT

from lightning_elche import ElCheStrategy
from lightning_elche.testing import Throttle

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]
BATCH = 16
EPOCHS = 2  # the thin epoch 0, then a whole epoch 1


def fit(out_dir: Path, mode: str, ranks: int, max_epochs: int, callbacks: list[Any],
        ckpt_path: Path | None = None) -> list[dict[str, Any]]:
    """``ranks`` spawned processes, rank 1 three times slower, validating after every epoch and
    logging an epoch-level synced training metric (the epoch's end reduces it on every rank)."""
    out_dir.mkdir(exist_ok=True)
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=ranks, max_epochs=max_epochs, limit_val_batches=2,
        strategy=ElCheStrategy(elche=config_for(mode), start_method="spawn", timeout=PG_TIMEOUT),
        callbacks=[Throttle(1, 3.0), *callbacks], enable_progress_bar=False, enable_model_summary=False,
        logger=False, enable_checkpointing=True, default_root_dir=str(out_dir),
    )
    model = RecordingModel(str(out_dir), n=N, batch_size=BATCH, log_step_sync=True)
    trainer.fit(model, ckpt_path=None if ckpt_path is None else str(ckpt_path))
    return load_records(out_dir, ranks)


def thin_checkpoint(tmp_path: Path, mode: str, left: int) -> Path:
    """A 2-rank sync checkpoint of epoch 0 whose untrained remainder is cut to ``left`` positions."""
    fit(tmp_path / "first", mode, 2, 1, [sync_checkpoints(tmp_path / "ckpt")])
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
    records = fit(resumed, mode, ranks, EPOCHS, [RecordEpochEnds(str(resumed)), ends], ckpt_path=path)

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
