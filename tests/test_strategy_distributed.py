"""Two real processes (gloo on CPU), spawned by Lightning, with short timeouts so a hang fails."""

from __future__ import annotations

import csv
import json
import sys
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from callback_helpers import CountCollectives, StopAtStep
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy
from model_helpers import RecordingModel, inverse_decay
from process_helpers import load_records, run_command

from lightning_elche import DiLoCo, ElCheConfig, ElCheStrategy
from lightning_elche.dispatch import epoch_permutation
from lightning_elche.testing import Throttle

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(150)]
PG_TIMEOUT = timedelta(seconds=30)


def fit(tmp_path: Path, strategy, callbacks=(), model_kwargs=None, **trainer_kwargs) -> list[dict]:
    pl.seed_everything(0, verbose=False)
    model = RecordingModel(str(tmp_path), **(model_kwargs or {}))
    trainer_kwargs.setdefault("max_epochs", 2)
    trainer_kwargs.setdefault("logger", False)
    trainer_kwargs.setdefault("enable_checkpointing", False)
    if not model.val:
        trainer_kwargs.setdefault("limit_val_batches", 0)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, callbacks=list(callbacks),
        enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(tmp_path), **trainer_kwargs,
    )
    trainer.fit(model)
    return load_records(tmp_path)


def elche(**kwargs) -> ElCheStrategy:
    return ElCheStrategy(start_method="spawn", timeout=PG_TIMEOUT, **kwargs)


def assert_exactly_once(records: list[dict], n: int = 512) -> None:
    epochs = set(records[0]["seen"]) | set(records[1]["seen"])
    for e in epochs:
        got = sorted(records[0]["seen"].get(e, []) + records[1]["seen"].get(e, []))
        assert got == list(range(n)), f"epoch {e}: samples missing or repeated"


def test_heterogeneous_cadence_run_with_validation_checkpoint_and_early_stopping(tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    records = fit(
        tmp_path,
        elche(mode="nccl_cadence"),
        callbacks=[
            Throttle(1, 3.0),
            ModelCheckpoint(dirpath=str(ckpt_dir), monitor="val_loss", save_top_k=1),
            EarlyStopping("val_loss", patience=10),
        ],
        model_kwargs={"log_step_sync": True, "n": 512},
        max_epochs=3,
        logger=CSVLogger(str(tmp_path), name="logs"),
        enable_checkpointing=True,
    )
    r0, r1 = records
    assert r0["params"] == r1["params"], "replicas differ after fit"
    assert r0["rounds"] == r1["rounds"] > 0
    assert r0["steps"] == r1["steps"]
    assert r0["steps"][0] > 1.5 * r0["steps"][1], f"fast rank did not train more: {r0['steps']}"
    assert r0["current_epoch"] == r1["current_epoch"] == 3
    assert_exactly_once(records)
    assert "val_loss" in r0["callback_metrics"] and "train_loss_step_epoch" in r0["callback_metrics"]
    assert r0["callback_metrics"]["val_loss"] == r1["callback_metrics"]["val_loss"]
    assert len(list(ckpt_dir.glob("*.ckpt"))) == 1
    rows = list(csv.DictReader(open(next((tmp_path / "logs").rglob("metrics.csv")))))
    columns = set(rows[0])
    for key in ("elche/anchor", "elche/overhead", "elche/syncs", "elche/cohort_step",
                "elche/batch_share/rank0", "elche/samples_per_s/rank1", "elche/idle/rank0"):
        assert key in columns
    syncs = [float(row["elche/syncs"]) for row in rows if row.get("elche/syncs")]
    assert syncs == sorted(syncs) and syncs[-1] == r0["rounds"]


def test_nccl_sync_equals_lightning_ddp_for_plain_sgd(tmp_path):
    model_kwargs = {"n": 256, "val": False, "momentum": 0.0}
    ddp_dir, elche_dir = tmp_path / "ddp", tmp_path / "elche"
    ddp_dir.mkdir(), elche_dir.mkdir()
    ddp = fit(ddp_dir, DDPStrategy(start_method="spawn", timeout=PG_TIMEOUT), model_kwargs=model_kwargs)
    # max_batch_diff=0 pins lockstep (one step per rank per round) so that timing noise on a
    # shared CI machine cannot give a rank two steps in a round.
    ours = fit(elche_dir, elche(elche=ElCheConfig(mode="nccl_sync", max_batch_diff=0)), model_kwargs=model_kwargs)
    assert ours[0]["steps"] == [16, 16] and ours[0]["rounds"] == 16
    assert ours[0]["params"] == ours[1]["params"]
    for a, b in zip(ddp[0]["params"], ours[0]["params"], strict=True):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    initial = RecordingModel(str(tmp_path))
    moved = torch.cat([torch.tensor(p) for p in ours[0]["params"]])
    assert not torch.allclose(moved, torch.cat([p.detach().flatten() for p in initial.parameters()]))


def test_partition_ratios_batchnorm_and_gradient_accumulation(tmp_path):
    records = fit(
        tmp_path,
        elche(elche=ElCheConfig(partition_ratios=[0.75, 0.25])),
        model_kwargs={"batchnorm": True, "val": False},
        accumulate_grad_batches=2,
    )
    r0, r1 = records
    assert [len(r0["seen"]["0"]), len(r1["seen"]["0"])] == [384, 128]
    assert r0["steps"] == [2 * 12, 2 * 4]  # optimizer steps: 24 and 8 batches per epoch, accumulated by 2
    assert_exactly_once(records)
    assert r0["params"] == r1["params"]


def test_rank_local_stop_request_stops_every_rank_at_the_same_round(tmp_path):
    records = fit(tmp_path, elche(), callbacks=[StopAtStep(rank=1, step=3)], max_epochs=5,
                  model_kwargs={"val": False})
    r0, r1 = records
    # The first (calibration) window ends at step 2, before the request; the second round, at
    # step 4, carried it, and nobody trained on.
    assert r0["rounds"] == r1["rounds"] == 2
    assert r0["current_epoch"] == r1["current_epoch"]
    assert len(r0["seen"]["0"]) + len(r1["seen"]["0"]) < 512 and "1" not in r0["seen"]
    assert r0["params"] == r1["params"]


def test_sigterm_on_one_rank_stops_every_rank_at_the_next_sync(tmp_path):
    # Lightning turns SIGTERM into SIGTERMException (a SystemExit); under spawn the parent would wait
    # forever for rank 0's result, so this runs the popen launcher, as torchrun or SLURM jobs do.
    script = Path(__file__).parent / "scripts" / "sigterm_fit.py"
    _, output = run_command([sys.executable, str(script), str(tmp_path)], tmp_path, 120)
    reports = [json.loads((tmp_path / f"exception{r}.json").read_text()) for r in range(2)]
    assert [r["type"] for r in reports] == ["SIGTERMException", "SIGTERMException"], output[-2000:]
    # Rank 1 is signalled in its 10th step, mid-window (after the two 2-step calibration windows, in
    # the third at equal speeds; a loaded machine may shift the windows): both ranks stop right after
    # the next round.
    signalled_at = json.loads((tmp_path / "stop-rounds.json").read_text())
    assert signalled_at >= 2
    assert reports[0]["rounds"] == reports[1]["rounds"] == signalled_at + 1
    assert not list(tmp_path.glob("finished*"))


def test_max_steps_is_a_cohort_step_budget(tmp_path):
    records = fit(tmp_path, elche(), callbacks=[Throttle(1, 2.0)], max_steps=45, max_epochs=-1,
                  model_kwargs={"val": False})
    r0, r1 = records
    assert r0["cohort_step"] == r1["cohort_step"]
    assert 45 <= r0["cohort_step"] < 45 + sum(r0["batch_counts"]) + 10
    # The budget is taken over only after configure_optimizers, which sees the user's max_steps.
    assert r0["max_steps_in_configure_optimizers"] == r1["max_steps_in_configure_optimizers"] == 45
    assert r0["params"] == r1["params"]


def test_collectives_happen_only_in_rounds(tmp_path):
    records = fit(tmp_path, elche(), callbacks=[CountCollectives(str(tmp_path))], model_kwargs={"val": False})
    for rank in range(2):
        report = json.loads((tmp_path / f"collectives{rank}.json").read_text())
        counts, rounds = report["counts"], report["rounds"]
        assert rounds == records[0]["rounds"] > 0
        metadata_gathers = counts.get("all_gather_into_tensor", 0) + counts.get("all_gather_single", 0)
        assert metadata_gathers == rounds  # the metadata exchange
        assert counts["all_reduce"] == report["realized"]  # one flat parameter buffer, no float buffers
        assert counts["broadcast"] == counts["barrier"] == counts["all_gather"] == 0


def test_unsupported_trainer_setting_is_refused_before_training(tmp_path):
    with pytest.raises(Exception, match=r"val_check_interval\)=5.*check_val_every_n_epoch"):
        fit(tmp_path, elche(), val_check_interval=5, check_val_every_n_epoch=None)


def test_diloco_step_schedules_on_the_cohort_step_and_elche_state_in_checkpoints(tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    records = fit(
        tmp_path,
        elche(outer_optimizer=DiLoCo(lr=0.7, momentum=0.9)),
        callbacks=[Throttle(1, 3.0), ModelCheckpoint(dirpath=str(ckpt_dir), save_last=True)],
        model_kwargs={"step_schedule": True, "val": False, "momentum": 0.9, "n": 1024},
        logger=CSVLogger(str(tmp_path), name="logs"),
        enable_checkpointing=True,
    )
    r0, r1 = records
    assert r0["params"] == r1["params"]
    # The step counts must differ for the schedule check below to mean anything. How much they
    # differ is the cadence test's check: under heavy load on 2 cores this fit's fast rank ran only
    # 1.2x the steps, as Lightning's per-step overhead, which the throttle does not scale, dominated.
    assert r0["steps"][0] > r0["steps"][1], f"fast rank did not train more: {r0['steps']}"
    # Both ranks' schedules sit at the cohort step, not at their own (very different) step counts.
    assert r0["schedule_position"] == r1["schedule_position"] == [r0["cohort_step"]]
    assert r0["lr"] == r1["lr"] == pytest.approx(0.05 * inverse_decay(r0["cohort_step"]))
    checkpoint = torch.load(ckpt_dir / "last.ckpt", weights_only=False)
    state = checkpoint["elche"]
    assert state["rounds"] == r0["rounds"] and state["cohort_step"] == r0["cohort_step"]
    assert state["outer"]["kind"] == "DiLoCo" and len(state["outer"]["velocity"]) > 0
    assert state["controller"]["batch_counts"] == r0["batch_counts"]
    rows = list(csv.DictReader(open(next((tmp_path / "logs").rglob("metrics.csv")))))
    divergences = [float(row["elche/divergence"]) for row in rows if row.get("elche/divergence")]
    assert divergences and all(d > 0 for d in divergences)
    assert any(row.get("elche/outer_step_norm") for row in rows)


def test_fit_resumes_from_a_checkpoint_with_the_same_cadence(tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    first = fit(tmp_path, elche(), callbacks=[Throttle(1, 3.0), ModelCheckpoint(dirpath=str(ckpt_dir), save_last=True)],
                model_kwargs={"val": False}, enable_checkpointing=True)
    saved = torch.load(ckpt_dir / "last.ckpt", weights_only=False)["elche"]
    assert saved["rounds"] == first[0]["rounds"] and saved["controller"]["batch_counts"] == first[0]["batch_counts"]
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    pl.seed_everything(0, verbose=False)
    model = RecordingModel(str(resumed_dir), val=False)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=elche(), max_epochs=3, limit_val_batches=0,
                         callbacks=[Throttle(1, 3.0)], enable_progress_bar=False, enable_model_summary=False,
                         logger=False, enable_checkpointing=False, default_root_dir=str(resumed_dir))
    trainer.fit(model, ckpt_path=str(ckpt_dir / "last.ckpt"))
    r0, r1 = load_records(resumed_dir)
    assert set(r0["seen"]) == set(r1["seen"]) == {"2"}  # only the epoch that was left
    assert sorted(r0["seen"]["2"] + r1["seen"]["2"]) == list(range(512))
    # Epoch 2's own order (rank 0's reserved first chunk), though Lightning draws the first batch
    # before it calls set_epoch.
    assert r0["seen"]["2"][:16] == epoch_permutation(512, 2, 0, True)[:16]
    assert r0["rounds"] == r1["rounds"] > saved["rounds"]  # the round count carries on
    assert r0["cohort_step"] > saved["cohort_step"]
    assert r0["params"] == r1["params"]


def test_estimated_stepping_batches_is_the_cohort_total_and_sizes_a_one_cycle_schedule(tmp_path):
    # OneCycleLR sized from trainer.estimated_stepping_batches in configure_optimizers: the usual
    # recipe. The estimate must be the epochs' batches over all ranks (schedules follow the cohort
    # step), the dispatch must still be ElChe's, and the schedule must end exactly at its total.
    records = fit(tmp_path, elche(mode="nccl_cadence"), callbacks=[Throttle(1, 3.0)],
                  model_kwargs={"one_cycle": True, "val": False}, max_epochs=2)
    batches_per_epoch = 512 // 16
    for record in records:
        assert record["estimated_stepping_batches"] == 2 * batches_per_epoch
        assert record["num_training_batches"] == batches_per_epoch
        assert record["schedule_position"] == [2 * batches_per_epoch]
    assert_exactly_once(records)
    assert records[0]["steps"][0] > records[0]["steps"][1], "the throttled rank was not slower"
