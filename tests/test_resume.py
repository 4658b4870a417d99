"""Sync-interval checkpoints and exact mid-epoch resume, in two real processes (gloo)."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from model_helpers import RecordingModel
from process_helpers import load_records
from resume_helpers import RecordSaves, RecordStart
from test_strategy_distributed import assert_exactly_once, elche, fit

from lightning_elche import ElCheCheckpoint, ElCheConfig
from lightning_elche.testing import Throttle

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]
N = 512


def saves_of_epoch(out_dir: Path, epoch: int) -> dict[int, list[dict]]:
    by_sync: dict[int, list[dict]] = {}
    for path in sorted(out_dir.glob(f"save-e{epoch}-s*-rank0.json")):
        sync = int(path.name.split("-s")[1].split("-")[0])
        by_sync[sync] = [json.loads((out_dir / f"save-e{epoch}-s{sync}-rank{r}.json").read_text()) for r in range(2)]
    return by_sync


@pytest.mark.parametrize("mode", ["nccl_cadence", pytest.param("cpu_async", marks=pytest.mark.extended),
                                  pytest.param("nccl_sync", marks=pytest.mark.extended)])
def test_sync_checkpoint_resumes_mid_epoch_without_repeating_or_skipping_a_sample(tmp_path, mode):
    first, resumed, ckpt_dir = tmp_path / "first", tmp_path / "resumed", tmp_path / "ckpt"
    first.mkdir(), resumed.mkdir()
    # Small windows, so that an epoch has several syncs to checkpoint at.
    config = ElCheConfig(mode=mode, anchor=2, max_anchor=3) if mode != "nccl_sync" else ElCheConfig(mode=mode)
    records = fit(
        first, elche(elche=config),
        callbacks=[Throttle(1, 3.0), RecordSaves(str(first)),
                   ElCheCheckpoint(dirpath=str(ckpt_dir), filename="{epoch}-{sync}", every_n_syncs=1,
                                   save_top_k=-1, every_n_epochs=0)],
        model_kwargs={"val": False, "n": N}, enable_checkpointing=True,
    )
    assert_exactly_once(records, N)
    saves = saves_of_epoch(first, 1)
    assert len(saves) >= 1, f"too few sync checkpoints in epoch 1: {sorted(saves)}"
    sync = sorted(saves)[len(saves) // 2]
    at_save = saves[sync]
    trained = [len(s["trained"]) for s in at_save]
    assert 0 < sum(trained) < N
    if mode != "nccl_sync":  # pooled dispatch: the fast rank had trained more (equal split may tie)
        assert trained[0] != trained[1]
    # Prefetch: the ranks had claimed more than they trained, so coverage by claims would skip samples.
    assert sum(s["claimed"] for s in at_save) > sum(trained)
    # The checkpoint holds the consensus (cpu_async flushes to it before saving).
    assert at_save[0]["params"] == at_save[1]["params"]
    path = ckpt_dir / f"epoch=1-sync={sync}.ckpt"
    saved = torch.load(path, weights_only=False)["elche"]
    assert saved["rounds"] == sync
    coverage = saved["coverage"]
    assert coverage["epoch"] == 1
    # Rank-agnostic in every mode: the untrained positions of the epoch.
    assert coverage["offsets"] is None
    assert sum(b - a for a, b in coverage["remaining"]) == N - sum(trained)

    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=elche(elche=config), max_epochs=3,
                         limit_val_batches=0, callbacks=[Throttle(1, 3.0), RecordStart(str(resumed))],
                         enable_progress_bar=False, enable_model_summary=False, logger=False,
                         enable_checkpointing=False, default_root_dir=str(resumed))
    trainer.fit(RecordingModel(str(resumed), val=False, n=N), ckpt_path=str(path))
    r0, r1 = load_records(resumed)
    start = [json.loads((resumed / f"start{r}.json").read_text()) for r in range(2)]
    # The cadence continues from the checkpoint: same sync count, same controller (anchor, plan, speeds).
    for s in start:
        assert s["rounds"] == sync and s["cohort_step"] == saved["cohort_step"] and s["current_epoch"] == 1
        assert s["controller"] == saved["controller"]
    # The interrupted epoch: what was trained before the save plus what the resumed fit trained is
    # every sample exactly once.
    union = at_save[0]["trained"] + at_save[1]["trained"] + r0["seen"]["1"] + r1["seen"]["1"]
    assert sorted(union) == list(range(N))
    assert sorted(r0["seen"]["2"] + r1["seen"]["2"]) == list(range(N))  # then whole epochs again
    assert set(r0["seen"]) == set(r1["seen"]) == {"1", "2"}
    assert r0["params"] == r1["params"] and r0["rounds"] == r1["rounds"] > sync


def test_sync_checkpoint_needs_elche_and_no_monitor(tmp_path):
    with pytest.raises(ValueError, match=r"every_n_syncs=2, monitor='val_loss'\) is invalid"):
        ElCheCheckpoint(every_n_syncs=2, monitor="val_loss")
    with pytest.raises(ValueError, match=r"every_n_syncs=0\) is invalid"):
        ElCheCheckpoint(every_n_syncs=0)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
                         callbacks=[ElCheCheckpoint(dirpath=str(tmp_path), every_n_syncs=1)])
    with pytest.raises(Exception, match="needs ElCheStrategy"):
        trainer.fit(RecordingModel(str(tmp_path), val=False, n=64))
