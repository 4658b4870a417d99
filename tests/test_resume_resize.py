"""Resuming at another world size, in real processes (gloo): a checkpoint written by W ranks
resumed by W' != W ranks (a restart on fewer or more devices, torchrun ``--nnodes=1:2``).

Mid-epoch (``ElCheCheckpoint(every_n_syncs=1)``): the interrupted epoch's untrained remainder is
split over the new ranks, so what the W ranks trained before the save plus what the W' ranks
trained after the resume is every sample exactly once; the controller keeps the anchor and phase
and recalibrates the per-rank plan; a checkpoint inside the resumed epoch records the remainder
again, so it resumes as well (on W ranks again). Epoch-end checkpoints resize too.
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
from resume_helpers import RecordSaves, RecordStart
from test_strategy_distributed import PG_TIMEOUT

from lightning_elche import ElCheCheckpoint, ElCheConfig, ElCheStrategy
from lightning_elche.testing import Throttle

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(420)]
N = 1536  # 96 batches of 16: enough rounds in the rest of an epoch for another sync checkpoint


def config_for(mode: str) -> ElCheConfig:
    # Small windows, so that an epoch has several syncs to checkpoint at.
    return ElCheConfig(mode=mode) if mode == "nccl_sync" else ElCheConfig(mode=mode, anchor=2, max_anchor=3)


def run_fit(out_dir: Path, mode: str, ranks: int, max_epochs: int, callbacks: list[Any],
            ckpt_path: Path | None = None, validate: bool = False) -> list[dict[str, Any]]:
    """One fit of ``ranks`` spawned processes, rank 1 three times slower; returns each rank's record.
    ``validate``: two validation batches after every epoch and an epoch-level synced training
    metric, so that every epoch's end runs collectives on every rank."""
    out_dir.mkdir(exist_ok=True)
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=ranks, max_epochs=max_epochs, limit_val_batches=2 if validate else 0,
        strategy=ElCheStrategy(elche=config_for(mode), start_method="spawn", timeout=PG_TIMEOUT),
        callbacks=[Throttle(1, 3.0), *callbacks], enable_progress_bar=False, enable_model_summary=False,
        logger=False, enable_checkpointing=True, default_root_dir=str(out_dir),
    )
    model = RecordingModel(str(out_dir), val=validate, n=N, log_step_sync=validate)
    trainer.fit(model, ckpt_path=None if ckpt_path is None else str(ckpt_path))
    return load_records(out_dir, ranks)


def sync_checkpoints(ckpt_dir: Path) -> ElCheCheckpoint:
    return ElCheCheckpoint(dirpath=str(ckpt_dir), filename="{epoch}-{sync}", every_n_syncs=1, save_top_k=-1,
                           every_n_epochs=0)


def saves_of_epoch(out_dir: Path, epoch: int, ranks: int) -> dict[int, list[dict[str, Any]]]:
    """What every rank had trained at each sync checkpoint of ``epoch`` (RecordSaves' files)."""
    by_sync: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(out_dir.glob(f"save-e{epoch}-s*-rank0.json")):
        sync = int(path.name.split("-s")[1].split("-")[0])
        by_sync[sync] = [json.loads((out_dir / f"save-e{epoch}-s{sync}-rank{r}.json").read_text())
                         for r in range(ranks)]
    return by_sync


def first_save(out_dir: Path, ranks: int) -> tuple[int, list[dict[str, Any]]]:
    """The earliest sync checkpoint of epoch 1: it leaves the most of the epoch to the resumed run."""
    saves = saves_of_epoch(out_dir, 1, ranks)
    assert saves, f"no sync checkpoint in epoch 1 under {out_dir}"
    sync = min(saves)
    return sync, saves[sync]


def trained_at(save: list[dict[str, Any]]) -> list[int]:
    return [i for record in save for i in record["trained"]]


def seen_in(records: list[dict[str, Any]], epoch: int) -> list[int]:
    return [i for record in records for i in record["seen"].get(str(epoch), [])]


def elche_state(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=False)["elche"]


def read_starts(out_dir: Path, ranks: int) -> list[dict[str, Any]]:
    return [json.loads((out_dir / f"start{r}.json").read_text()) for r in range(ranks)]


def assert_controller_resized(start: dict[str, Any], saved: dict[str, Any], ranks: int) -> None:
    """The run's part of the controller continues; the per-rank part starts over for ``ranks`` ranks."""
    controller, before = start["controller"], saved["controller"]
    for key in ("anchor", "phase", "calibration_count", "growth_enabled", "consecutive_stable"):
        assert controller[key] == before[key], key
    assert controller["world_size"] == ranks != before["world_size"]
    assert controller["batch_counts"] == [before["anchor"]] * ranks
    assert controller["smoothed_ms"] == [None] * ranks
    assert start["rounds"] == saved["rounds"] and start["cohort_step"] == saved["cohort_step"]


@pytest.mark.parametrize(("before", "after", "mode"), [
    (2, 3, "nccl_cadence"),
    *(pytest.param(*case, marks=pytest.mark.extended) for case in [(3, 2, "nccl_cadence"), (3, 2, "nccl_sync"),
                                                                   (2, 3, "nccl_sync")]),
])
def test_mid_epoch_checkpoint_resumes_on_another_world_size_exactly_once(tmp_path, mode, before, after):
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    first.mkdir()
    records = run_fit(first, mode, before, 2, [RecordSaves(str(first)), sync_checkpoints(tmp_path / "ckpt")])
    for epoch in (0, 1):
        assert sorted(seen_in(records, epoch)) == list(range(N))
    sync, at_save = first_save(first, before)
    trained_before = trained_at(at_save)
    assert 0 < len(trained_before) < N
    path = tmp_path / "ckpt" / f"epoch=1-sync={sync}.ckpt"
    saved = elche_state(path)
    coverage = saved["coverage"]
    # Rank-agnostic: the untrained positions, whatever the dispatch; no per-rank offsets.
    assert coverage["offsets"] is None and coverage["world_size"] == before
    assert sum(b - a for a, b in coverage["remaining"]) == N - len(trained_before)

    resumed.mkdir()
    watchers = [RecordStart(str(resumed)), RecordSaves(str(resumed)), sync_checkpoints(tmp_path / "ckpt2")]
    after_records = run_fit(resumed, mode, after, 3, watchers, ckpt_path=path)
    for start in read_starts(resumed, after):
        assert start["current_epoch"] == 1
        assert_controller_resized(start, saved, after)
    # The interrupted epoch: before the save on W ranks, after the resume on W' ranks, every sample once.
    assert sorted(trained_before + seen_in(after_records, 1)) == list(range(N))
    assert sorted(seen_in(after_records, 2)) == list(range(N))  # then whole epochs on the new world
    assert all(set(r["seen"]) == {"1", "2"} for r in after_records)
    assert all(r["seen"]["1"] for r in after_records), "a rank of the new world trained nothing of epoch 1"
    assert all(r["params"] == after_records[0]["params"] for r in after_records)
    assert len({r["rounds"] for r in after_records}) == 1 and after_records[0]["rounds"] > sync
    # A checkpoint inside the resumed epoch records the remainder of the remainder.
    later = saves_of_epoch(resumed, 1, after)
    assert later, "no sync checkpoint inside the resumed epoch"
    sync2 = min(later)
    coverage2 = elche_state(tmp_path / "ckpt2" / f"epoch=1-sync={sync2}.ckpt")["coverage"]
    assert coverage2["world_size"] == after
    trained_since = trained_at(later[sync2])
    assert sum(b - a for a, b in coverage2["remaining"]) == N - len(trained_before) - len(trained_since)


@pytest.mark.extended
def test_resume_checkpoint_resume_across_world_sizes_3_2_3(tmp_path):
    """cpu_async: 3 ranks save mid-epoch, 2 resume and save inside the resumed epoch, 3 resume that."""
    mode = "cpu_async"
    first, second, third = tmp_path / "first", tmp_path / "second", tmp_path / "third"
    first.mkdir()
    run_fit(first, mode, 3, 2, [RecordSaves(str(first)), sync_checkpoints(tmp_path / "ckpt")])
    sync, at_save = first_save(first, 3)
    trained_first = trained_at(at_save)
    second.mkdir()
    run_fit(second, mode, 2, 2, [RecordSaves(str(second)), sync_checkpoints(tmp_path / "ckpt2")],
            ckpt_path=tmp_path / "ckpt" / f"epoch=1-sync={sync}.ckpt")
    later = saves_of_epoch(second, 1, 2)
    assert later, "no sync checkpoint inside the resumed epoch"
    sync2 = min(later)
    trained_second = trained_at(later[sync2])
    assert trained_second and at_save[0]["params"] != later[sync2][0]["params"]
    assert later[sync2][0]["params"] == later[sync2][1]["params"]  # the saved consensus
    path2 = tmp_path / "ckpt2" / f"epoch=1-sync={sync2}.ckpt"
    saved2 = elche_state(path2)
    third.mkdir()
    records = run_fit(third, mode, 3, 2, [RecordStart(str(third))], ckpt_path=path2)
    for start in read_starts(third, 3):
        assert_controller_resized(start, saved2, 3)
    epoch1 = trained_first + trained_second + seen_in(records, 1)
    assert sorted(epoch1) == list(range(N)), "epoch 1 over three runs: samples missing or repeated"
    assert all(r["params"] == records[0]["params"] for r in records)


def test_epoch_end_checkpoint_resumes_on_more_ranks(tmp_path):
    """An epoch-end checkpoint of 2 ranks resumed by 3: whole epochs, anchor kept, plan recalibrated."""
    mode = "nccl_cadence"
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    epoch_ends = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), filename="{epoch}", every_n_epochs=1,
                                 save_top_k=-1)
    run_fit(first, mode, 2, 1, [epoch_ends])
    path = tmp_path / "ckpt" / "epoch=0.ckpt"
    saved = elche_state(path)
    assert "coverage" not in saved
    records = run_fit(resumed, mode, 3, 3, [RecordStart(str(resumed))], ckpt_path=path)
    for start in read_starts(resumed, 3):
        assert start["current_epoch"] == 1
        assert_controller_resized(start, saved, 3)
    for epoch in (1, 2):
        assert sorted(seen_in(records, epoch)) == list(range(N))
    assert all(set(r["seen"]) == {"1", "2"} for r in records)
    assert all(r["params"] == records[0]["params"] for r in records)
