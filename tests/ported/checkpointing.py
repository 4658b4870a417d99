"""Checkpoints: Lightning's ``tests/tests_pytorch/checkpointing/`` and the checkpoint tests of
``trainer/test_trainer.py``, on 2 ElChe ranks.

What ElChe must give every rank: the same file names (``{step}`` is the cohort step), the same
``best_model_path`` / ``best_k_models`` / ``last_model_path`` / scores (the files that exist), so that
``ckpt_path="best"`` / ``"last"`` and resumes work on every rank.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from lightning.fabric.utilities.cloud_io import _load as pl_load
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from ported.harness import MODES, Context, Suite
from ported.models import LogInTwoMethods, SizedBoringModel, ValLossModel, listdir, same_on_every_rank

SUITE = Suite("checkpointing")
MC = "checkpointing/test_model_checkpoint.py::"


def mc_state(callback: ModelCheckpoint) -> dict:
    """What ``ModelCheckpoint`` saves, as plain values (for comparing ranks)."""
    state = callback.state_dict()
    return {
        "best_model_path": state["best_model_path"],
        "best_model_score": None if state["best_model_score"] is None else float(state["best_model_score"]),
        "best_k_models": {k: float(v) for k, v in state["best_k_models"].items()},
        "kth_best_model_path": state["kth_best_model_path"],
        "last_model_path": state["last_model_path"],
        "current_score": None if state["current_score"] is None else float(state["current_score"]),
    }


def check_agreed(ctx: Context, callback: ModelCheckpoint) -> None:
    """Every rank holds the same checkpoint state, and every path it names exists."""
    state = mc_state(callback)
    same_on_every_rank(state, "ModelCheckpoint's state")
    for path in [state["best_model_path"], state["last_model_path"], *state["best_k_models"]]:
        assert not path or os.path.exists(path), f"rank {ctx.rank} names {path}, which does not exist"


for save_last in (True, "link"):

    def save_last_case(ctx: Context, save_last=save_last) -> None:
        model = LogInTwoMethods(train=10)
        epochs = 3
        with mock.patch.object(ModelCheckpoint, "CHECKPOINT_NAME_LAST", "last-{epoch}"):
            model_checkpoint = ModelCheckpoint(monitor="early_stop_on", dirpath=ctx.tmp_path, save_top_k=-1,
                                               save_last=save_last)
            trainer = ctx.trainer(callbacks=[model_checkpoint], max_epochs=epochs, limit_val_batches=10, logger=False)
            trainer.fit(model)
            last_filename = model_checkpoint._format_checkpoint_name(
                ModelCheckpoint.CHECKPOINT_NAME_LAST, {"epoch": trainer.current_epoch - 1}) + ".ckpt"
        ctx.barrier("fit")
        assert str(ctx.tmp_path / last_filename) == model_checkpoint.last_model_path
        # {step} is the cohort step: the 10 batches of an epoch over both ranks, as on one device.
        expected = {f"epoch={i}-step={j}.ckpt" for i, j in zip(range(epochs), [10, 20, 30], strict=True)}
        expected.add(last_filename)
        assert listdir(ctx.tmp_path) == expected
        if save_last == "link":
            assert os.path.islink(ctx.tmp_path / last_filename)
        else:
            assert os.path.isfile(ctx.tmp_path / last_filename)
        assert os.path.realpath(ctx.tmp_path / last_filename) == model_checkpoint._last_checkpoint_saved
        check_agreed(ctx, model_checkpoint)

    SUITE.add(f"test_model_checkpoint_save_last[{save_last}]", MC + f"test_model_checkpoint_save_last[{save_last}]",
              "passes", MODES, save_last_case)


@SUITE.case(MC + "test_model_checkpoint_save_last_none_monitor", modes=MODES)
def test_model_checkpoint_save_last_none_monitor(ctx: Context) -> None:
    model = LogInTwoMethods(train=10)
    epochs = 2
    checkpoint_callback = ModelCheckpoint(monitor=None, dirpath=ctx.tmp_path, save_top_k=-1, save_last=True)
    trainer = ctx.trainer(callbacks=[checkpoint_callback], limit_val_batches=10, max_epochs=epochs, logger=False)
    trainer.fit(model)
    ctx.barrier("fit")
    assert checkpoint_callback.monitor is None
    assert checkpoint_callback.best_model_path == str(ctx.tmp_path / "epoch=1-step=20.ckpt")
    assert checkpoint_callback.last_model_path == str(ctx.tmp_path / "last.ckpt")
    assert checkpoint_callback.best_model_score is None
    assert checkpoint_callback.best_k_models == {}
    assert checkpoint_callback.kth_best_model_path == ""
    expected = {f"epoch={i}-step={j}.ckpt" for i, j in zip(range(epochs), [10, 20], strict=True)} | {"last.ckpt"}
    assert listdir(ctx.tmp_path) == expected
    assert os.path.isfile(ctx.tmp_path / "last.ckpt")
    check_agreed(ctx, checkpoint_callback)


for every_n_epochs in range(4):

    def every_n_epochs_case(ctx: Context, every_n_epochs=every_n_epochs) -> None:
        model = LogInTwoMethods(train=2)
        epochs = 5
        checkpoint_callback = ModelCheckpoint(dirpath=ctx.tmp_path, filename="{epoch}", save_top_k=-1,
                                              every_n_epochs=every_n_epochs)
        trainer = ctx.trainer(callbacks=[checkpoint_callback], max_epochs=epochs, limit_val_batches=1, logger=False)
        trainer.fit(model)
        ctx.barrier("fit")
        expected = set()
        if every_n_epochs:
            expected = {f"epoch={e}.ckpt" for e in range(epochs) if not (e + 1) % every_n_epochs}
        assert listdir(ctx.tmp_path) == expected

    SUITE.add(f"test_model_checkpoint_every_n_epochs[{every_n_epochs}]",
              MC + f"test_model_checkpoint_every_n_epochs[{every_n_epochs}]", "passes",
              MODES if every_n_epochs == 2 else ("nccl_cadence",), every_n_epochs_case)


@SUITE.case(MC + "test_ckpt_every_n_train_steps", "refused",
            note="refused in setup: use every_n_epochs or ElCheCheckpoint(every_n_syncs=N)")
def test_ckpt_every_n_train_steps(ctx: Context) -> None:
    checkpoint_callback = ModelCheckpoint(filename="{step}", every_n_epochs=0, every_n_train_steps=16,
                                          dirpath=ctx.tmp_path, save_top_k=-1, save_last=False)
    trainer = ctx.trainer(max_epochs=2, callbacks=[checkpoint_callback], logger=False)
    with ctx.raises(MisconfigurationException, match=r"ModelCheckpoint\(every_n_train_steps\)=16.*every_n_epochs"):
        trainer.fit(LogInTwoMethods())
    assert listdir(ctx.tmp_path) == set()


@SUITE.case(MC + "test_model_checkpoint_train_time_interval", "refused",
            note="refused in setup: use every_n_epochs")
def test_model_checkpoint_train_time_interval(ctx: Context) -> None:
    from datetime import timedelta

    checkpoint_callback = ModelCheckpoint(dirpath=ctx.tmp_path, train_time_interval=timedelta(seconds=1),
                                          save_top_k=-1)
    trainer = ctx.trainer(max_epochs=1, callbacks=[checkpoint_callback], logger=False)
    with ctx.raises(MisconfigurationException, match=r"ModelCheckpoint\(train_time_interval\).*every_n_epochs"):
        trainer.fit(SizedBoringModel(train=8))


@SUITE.case(MC + "test_model_checkpoint_topk_zero", modes=MODES)
def test_model_checkpoint_topk_zero(ctx: Context) -> None:
    model = LogInTwoMethods()
    checkpoint_callback = ModelCheckpoint(dirpath=ctx.tmp_path, save_top_k=0, save_last=True)
    trainer = ctx.trainer(callbacks=[checkpoint_callback], max_epochs=2, logger=False)
    trainer.fit(model)
    ctx.barrier("fit")
    assert checkpoint_callback.monitor is None
    assert checkpoint_callback.best_model_path == ""
    assert checkpoint_callback.best_model_score is None
    assert checkpoint_callback.best_k_models == {}
    assert checkpoint_callback.kth_best_model_path == ""
    assert os.listdir(ctx.tmp_path) == ["last.ckpt"]
    assert checkpoint_callback.last_model_path == str(ctx.tmp_path / "last.ckpt")
    assert not os.path.islink(checkpoint_callback.last_model_path)


@SUITE.case(MC + "test_model_checkpoint_topk_all", modes=MODES)
def test_model_checkpoint_topk_all(ctx: Context) -> None:
    epochs = 3
    model = SizedBoringModel()
    checkpoint_callback = ModelCheckpoint(dirpath=ctx.tmp_path, filename="{epoch}", monitor="epoch", mode="max",
                                          save_top_k=-1)
    trainer = ctx.trainer(callbacks=[checkpoint_callback], max_epochs=epochs, logger=False, val_check_interval=1.0)
    trainer.fit(model)
    ctx.barrier("fit")
    assert checkpoint_callback.monitor == "epoch"
    assert checkpoint_callback.best_model_path == str(ctx.tmp_path / "epoch=2.ckpt")
    assert checkpoint_callback.best_model_score == epochs - 1
    assert len(os.listdir(ctx.tmp_path)) == len(checkpoint_callback.best_k_models) == epochs
    assert set(checkpoint_callback.best_k_models) == {str(ctx.tmp_path / f"epoch={i}.ckpt") for i in range(epochs)}
    assert checkpoint_callback.kth_best_model_path == str(ctx.tmp_path / "epoch=0.ckpt")
    check_agreed(ctx, checkpoint_callback)


@SUITE.case(MC + "test_default_checkpoint_behavior", modes=MODES)
def test_default_checkpoint_behavior(ctx: Context) -> None:
    model = LogInTwoMethods(train=5)
    trainer = ctx.trainer(max_epochs=3, limit_val_batches=5, logger=False)
    with mock.patch.object(trainer, "save_checkpoint", wraps=trainer.save_checkpoint) as save_mock:
        trainer.fit(model)
        results = trainer.test()
    assert len(results) == 1
    save_dir = ctx.tmp_path / "checkpoints"
    save_weights_only = trainer.checkpoint_callback.save_weights_only
    save_mock.assert_has_calls([
        mock.call(str(save_dir / "epoch=0-step=5.ckpt"), save_weights_only),
        mock.call(str(save_dir / "epoch=1-step=10.ckpt"), save_weights_only),
        mock.call(str(save_dir / "epoch=2-step=15.ckpt"), save_weights_only),
    ])
    ctx.barrier("fit")
    assert os.listdir(save_dir) == ["epoch=2-step=15.ckpt"]
    assert trainer.ckpt_path == str(save_dir / "epoch=2-step=15.ckpt")  # test() loaded the best, on every rank


@SUITE.case(MC + "test_model_checkpoint_save_last_checkpoint_contents", modes=MODES)
def test_model_checkpoint_save_last_checkpoint_contents(ctx: Context) -> None:
    model = LogInTwoMethods(train=2)
    num_epochs = 3
    model_checkpoint = ModelCheckpoint(monitor="early_stop_on", dirpath=ctx.tmp_path, filename="{epoch}",
                                       save_top_k=num_epochs, save_last=True)
    trainer = ctx.trainer(callbacks=[model_checkpoint], max_epochs=num_epochs, limit_val_batches=2)
    trainer.fit(model)
    ctx.barrier("fit")
    path_last_epoch = str(ctx.tmp_path / f"epoch={num_epochs - 1}.ckpt")
    path_last = str(ctx.tmp_path / "last.ckpt")
    assert path_last == model_checkpoint.last_model_path
    assert os.path.isfile(path_last_epoch)
    assert os.path.isfile(path_last)
    ckpt_last_epoch = torch.load(path_last_epoch, weights_only=True)
    ckpt_last = torch.load(path_last, weights_only=True)
    assert ckpt_last_epoch["epoch"] == ckpt_last["epoch"]
    assert ckpt_last_epoch["global_step"] == ckpt_last["global_step"]
    ckpt_id = model_checkpoint.state_key
    assert ckpt_last["callbacks"][ckpt_id] == ckpt_last_epoch["callbacks"][ckpt_id]
    model_last_epoch = LogInTwoMethods.load_from_checkpoint(path_last_epoch)
    model_last = LogInTwoMethods.load_from_checkpoint(model_checkpoint.last_model_path)
    for w0, w1 in zip(model_last_epoch.parameters(), model_last.parameters(), strict=True):
        assert w0.eq(w1).all()
    check_agreed(ctx, model_checkpoint)


for nan_mode in ("min", "max"):

    def nan_first_case(ctx: Context, mode=nan_mode) -> None:
        monitor = [float("nan")] + ([5, 7, 8] if mode == "max" else [8, 7, 5])

        class CurrentModel(LogInTwoMethods):
            def on_validation_epoch_end(self) -> None:
                self.log("abc", monitor[self.current_epoch])

        callback = ModelCheckpoint(monitor="abc", mode=mode, save_top_k=1, dirpath=ctx.tmp_path)
        trainer = ctx.trainer(callbacks=[callback], val_check_interval=1.0, max_epochs=len(monitor))
        trainer.save_checkpoint = mock.Mock()
        trainer.fit(CurrentModel(train=8))
        assert trainer.save_checkpoint.call_count == len(monitor)
        assert (mode == "min" and callback.best_model_score == 5) or (mode == "max" and callback.best_model_score == 8)

    SUITE.add(f"test_checkpointing_with_nan_as_first[{nan_mode}]",
              MC + f"test_checkpointing_with_nan_as_first[{nan_mode}]", "passes",
              MODES if nan_mode == "min" else ("nccl_cadence",), nan_first_case)


@SUITE.case(MC + "test_checkpoint_repeated_strategy", modes=MODES)
def test_checkpoint_repeated_strategy(ctx: Context) -> None:
    checkpoint_callback = ModelCheckpoint(monitor="val_loss", dirpath=ctx.tmp_path, filename="{epoch:02d}")
    model = ValLossModel(train=2)
    trainer_kwargs = {"max_epochs": 1, "limit_val_batches": 2, "limit_test_batches": 2, "log_every_n_steps": 1}
    trainer = ctx.trainer(**trainer_kwargs, logger=CSVLogger(ctx.tmp_path), callbacks=[checkpoint_callback])
    trainer.fit(model)
    ctx.barrier("fit")
    assert listdir(ctx.tmp_path) == {"epoch=00.ckpt", "lightning_logs"}
    for _ in range(2):  # Lightning repeats 4 times
        trainer = ctx.trainer(**trainer_kwargs, logger=CSVLogger(ctx.tmp_path))
        trainer.fit(model, ckpt_path=checkpoint_callback.best_model_path)
        trainer.test(ckpt_path=checkpoint_callback.best_model_path, verbose=False)
        ctx.barrier("refit")
        assert listdir(ctx.tmp_path) == {"epoch=00.ckpt", "lightning_logs"}
    # Not kept: Lightning's "no new log versions after the first fit" holds on one device only; on 2
    # processes Lightning's DDP also makes a version per resumed fit (measured with DDPStrategy).


@SUITE.case(MC + "test_checkpoint_repeated_strategy_extended", modes=MODES,
            kind="deviation",
            note="trainer.global_step is each rank's own step count; the cohort step (strategy.progress.cohort_step) "
                 "is the number Lightning's assertions expect")
def test_checkpoint_repeated_strategy_extended(ctx: Context) -> None:
    epochs, limit_train_batches = 2, 2

    def cohort_step(trainer: Trainer) -> int:
        return trainer.strategy.progress.cohort_step

    def get_last_checkpoint(ckpt_dir: Path) -> str:
        return str(sorted(ckpt_dir.iterdir())[-1])

    def assert_checkpoint_content(ckpt_dir: Path) -> None:
        chk = pl_load(get_last_checkpoint(ckpt_dir))
        assert chk["epoch"] == epochs - 1
        assert chk["elche"]["cohort_step"] == epochs * limit_train_batches  # Lightning: chk["global_step"] == 4

    ckpt_dir = ctx.tmp_path / "checkpoints"
    checkpoint_cb = ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1)
    config = {"max_epochs": epochs, "limit_val_batches": 3, "limit_test_batches": 4, "callbacks": [checkpoint_cb]}
    trainer = ctx.trainer(**config, logger=TensorBoardLogger(ctx.tmp_path))
    assert trainer.global_step == 0 and trainer.current_epoch == 0
    model = ValLossModel(train=limit_train_batches)
    trainer.fit(model)
    assert cohort_step(trainer) == epochs * limit_train_batches  # Lightning: trainer.global_step
    assert trainer.current_epoch == epochs
    ctx.barrier("fit")
    assert len(list(ckpt_dir.iterdir())) == epochs
    trainer.validate(model)
    trainer.test(model)
    assert trainer.current_epoch == epochs
    for _ in range(1, 3):  # Lightning repeats 4 times
        chk = get_last_checkpoint(ckpt_dir)
        trainer = ctx.trainer(**config, logger=TensorBoardLogger(ctx.tmp_path))
        model = ValLossModel(train=limit_train_batches)
        trainer.test(model)
        assert trainer.global_step == 0 and trainer.current_epoch == 0
        trainer.fit(model, ckpt_path=chk)
        assert cohort_step(trainer) == epochs * limit_train_batches
        assert trainer.current_epoch == epochs
        assert trainer.fit_loop.epoch_progress.current.processed == epochs
        trainer.validate(model)
        assert trainer.current_epoch == epochs
        trainer.fit(model)
        assert trainer.current_epoch == epochs
        ctx.barrier("refit")
        assert len(list(ckpt_dir.iterdir())) == epochs


@SUITE.case(MC + "test_ckpt_version_after_rerun_new_trainer")
def test_ckpt_version_after_rerun_new_trainer(ctx: Context) -> None:
    epochs = 2
    for i in range(epochs):
        mc = ModelCheckpoint(dirpath=ctx.tmp_path, save_top_k=-1, monitor="epoch", filename="{epoch}")
        trainer = ctx.trainer(max_epochs=epochs, limit_val_batches=1, callbacks=[mc], logger=False)
        trainer.fit(SizedBoringModel(train=2))
        ctx.barrier(f"fit{i}")
        expected = {"epoch=0-v1.ckpt", "epoch=1-v1.ckpt"} if i else {"epoch=0.ckpt", "epoch=1.ckpt"}
        assert {Path(f).name for f in mc.best_k_models} == expected
        check_agreed(ctx, mc)
    assert listdir(ctx.tmp_path) == {"epoch=0.ckpt", "epoch=1.ckpt", "epoch=0-v1.ckpt", "epoch=1-v1.ckpt"}


@SUITE.case(MC + "test_ckpt_version_after_rerun_same_trainer", modes=MODES)
def test_ckpt_version_after_rerun_same_trainer(ctx: Context) -> None:
    mc = ModelCheckpoint(dirpath=ctx.tmp_path, save_top_k=-1, monitor="epoch", filename="test")
    mc.STARTING_VERSION = 9
    trainer = ctx.trainer(max_epochs=2, limit_val_batches=1, callbacks=[mc], logger=False)
    trainer.fit(SizedBoringModel(train=2))
    trainer.fit_loop.max_epochs = 4
    trainer.fit(SizedBoringModel(train=2))
    ctx.barrier("fit")
    ckpt_range = range(mc.STARTING_VERSION, trainer.max_epochs + mc.STARTING_VERSION - 1)
    expected = {"test.ckpt", *(f"test-v{i}.ckpt" for i in ckpt_range)}
    assert {Path(f).name for f in mc.best_k_models} == expected
    assert listdir(ctx.tmp_path) == expected
    check_agreed(ctx, mc)


@SUITE.case(MC + "test_ckpt_version_counter_disabled_after_rerun_new_trainer")
def test_ckpt_version_counter_disabled_after_rerun_new_trainer(ctx: Context) -> None:
    for i in range(2):
        mc = ModelCheckpoint(dirpath=ctx.tmp_path, save_top_k=-1, save_last=True, monitor="epoch", filename="{epoch}",
                             enable_version_counter=False)
        trainer = ctx.trainer(max_epochs=2, limit_val_batches=1, callbacks=[mc], logger=False)
        trainer.fit(SizedBoringModel(train=2))
        ctx.barrier(f"fit{i}")
        assert {Path(f).name for f in mc.best_k_models} == {"epoch=0.ckpt", "epoch=1.ckpt"}
        assert Path(mc.last_model_path).name == "last.ckpt"
    assert listdir(ctx.tmp_path) == {"epoch=0.ckpt", "epoch=1.ckpt", "last.ckpt"}


@SUITE.case(MC + "test_check_val_every_n_epochs_top_k_integration", modes=MODES)
def test_check_val_every_n_epochs_top_k_integration(ctx: Context) -> None:
    mc = ModelCheckpoint(dirpath=ctx.tmp_path, monitor="epoch", save_top_k=-1, filename="{epoch}")
    trainer = ctx.trainer(limit_val_batches=1, num_sanity_val_steps=0, max_epochs=5, check_val_every_n_epoch=2,
                          callbacks=mc, logger=False)
    trainer.fit(SizedBoringModel(train=2))
    ctx.barrier("fit")
    assert listdir(ctx.tmp_path) == {"epoch=1.ckpt", "epoch=3.ckpt"}


@SUITE.case(MC + "test_save_last_versioning")
def test_save_last_versioning(ctx: Context) -> None:
    for i in range(2):
        mc = ModelCheckpoint(dirpath=ctx.tmp_path, save_top_k=0, save_last=True)
        trainer = ctx.trainer(max_epochs=2, callbacks=mc, limit_val_batches=0, logger=False)
        trainer.fit(SizedBoringModel(train=2))
        ctx.barrier(f"fit{i}")
    assert listdir(ctx.tmp_path) == {"last.ckpt", "last-v1.ckpt"}
    assert all(not os.path.islink(ctx.tmp_path / path) for path in listdir(ctx.tmp_path))


for save_every in (0, 5):

    def save_last_every_n_epochs_case(ctx: Context, every_n_epochs=save_every) -> None:
        mc = ModelCheckpoint(every_n_epochs=every_n_epochs, save_last=True, save_top_k=0, save_on_train_epoch_end=True)
        trainer = ctx.trainer(max_epochs=2, callbacks=mc, limit_val_batches=0, logger=False)
        with mock.patch.object(trainer, "save_checkpoint") as save_mock:
            trainer.fit(SizedBoringModel(train=2))
        assert mc.last_model_path
        assert save_mock.call_count == trainer.max_epochs - 1

    SUITE.add(f"test_save_last_every_n_epochs_interaction[{save_every}]",
              MC + f"test_save_last_every_n_epochs_interaction[{save_every}]", "passes",
              ("nccl_cadence", "cpu_async"), save_last_every_n_epochs_case)


@SUITE.case("checkpointing/test_trainer_checkpoint.py::test_finetuning_with_ckpt_path", modes=MODES)
def test_finetuning_with_ckpt_path(ctx: Context) -> None:
    checkpoint_callback = ModelCheckpoint(monitor="val_loss", dirpath=ctx.tmp_path, filename="{epoch:02d}",
                                          save_top_k=-1)

    class ExtendedBoringModel(SizedBoringModel):
        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.layer.parameters(), lr=0.001)
            return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)]

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_loss", self.step(batch), on_epoch=True, prog_bar=True)  # rank-local: rank 0's is compared

    model = ExtendedBoringModel(train=12)
    trainer = ctx.trainer(max_epochs=1, limit_val_batches=6, limit_test_batches=12, callbacks=[checkpoint_callback],
                          logger=False)
    trainer.fit(model)
    ctx.barrier("fit")
    assert os.listdir(ctx.tmp_path) == ["epoch=00.ckpt"]
    best_model_paths = [checkpoint_callback.best_model_path]
    for idx in range(3, 6):
        trainer = ctx.trainer(max_epochs=idx, limit_val_batches=12, limit_test_batches=12)
        trainer.fit(model, ckpt_path=best_model_paths[-1])
        trainer.test()
        best_model_paths.append(trainer.checkpoint_callback.best_model_path)
        check_agreed(ctx, trainer.checkpoint_callback)
    for idx, best_model_path in enumerate(best_model_paths):
        if idx == 0:
            assert best_model_path.endswith(f"epoch=0{idx}.ckpt")
        else:
            assert f"epoch={idx + 1}" in best_model_path


FREQ = "checkpointing/test_checkpoint_callback_frequency.py::"


@SUITE.case(FREQ + "test_disabled_checkpointing")
def test_disabled_checkpointing(ctx: Context) -> None:
    trainer = ctx.trainer(logger=False, max_epochs=3, enable_checkpointing=False)
    assert not trainer.checkpoint_callbacks
    trainer.fit(SizedBoringModel(train=8))
    assert not trainer.checkpoint_callbacks


@SUITE.case(FREQ + "test_default_checkpoint_freq[2-1.0-2]", name="test_default_checkpoint_freq[2-1.0-2]")
def test_default_checkpoint_freq(ctx: Context) -> None:
    trainer = ctx.trainer(max_epochs=2, val_check_interval=1.0, limit_val_batches=1)
    with mock.patch("torch.save") as save_mock:
        trainer.fit(SizedBoringModel(train=16))
    assert save_mock.call_count == (2 if ctx.is_global_zero else 0)  # rank 0 writes the files


@SUITE.case(FREQ + "test_default_checkpoint_freq[1-0.25-4]", "refused", name="test_default_checkpoint_freq[1-0.25-4]",
            note="val_check_interval other than 1.0 is refused in setup: use check_val_every_n_epoch")
def test_default_checkpoint_freq_inside_epochs(ctx: Context) -> None:
    trainer = ctx.trainer(max_epochs=1, val_check_interval=0.25, limit_val_batches=1)
    with ctx.raises(MisconfigurationException, match=r"val_check_interval\)=0.25.*check_val_every_n_epoch"):
        trainer.fit(SizedBoringModel(train=16))


for k, epochs, expected in ((1, 1, 1), (2, 2, 2)):
    for save_last in (False, True, "link"):

        def top_k_case(ctx: Context, k=k, epochs=epochs, expected=expected, save_last=save_last) -> None:
            class TestModel(SizedBoringModel):
                def __init__(self) -> None:
                    super().__init__(train=16)
                    self.last_coeff = 10.0

                def training_step(self, batch: Any, batch_idx: int) -> Any:
                    loss = self.step(torch.ones(32, device=self.device))
                    loss = loss / (loss + 0.0000001) + self.last_coeff
                    self.log("my_loss", loss)  # rank-local (each rank's own step count): rank 0's is compared
                    self.last_coeff *= 0.999
                    return loss

            callback = ModelCheckpoint(dirpath=ctx.tmp_path, monitor="my_loss", save_top_k=k, save_last=save_last)
            trainer = ctx.trainer(callbacks=[callback], max_epochs=epochs, val_check_interval=1.0)
            with mock.patch("torch.save") as save_mock:
                trainer.fit(TestModel())
            expected_calls = expected * 2 if save_last is True else expected
            assert save_mock.call_count == (expected_calls if ctx.is_global_zero else 0)
            same_on_every_rank(mc_state(callback), "ModelCheckpoint's state")

        params = f"{save_last}-{k}-{epochs}-1.0-{expected}"
        SUITE.add(f"test_top_k[{params}]", FREQ + f"test_top_k[{params}]", "passes",
                  MODES if (k, save_last) == (2, "link") else ("nccl_cadence",), top_k_case)


TT = "trainer/test_trainer.py::"


class FooModel(SizedBoringModel):
    """trainer/test_trainer.py's ``TestModel`` of the ``ckpt_path`` tests."""

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        self.log("foo", -batch_idx)
        return super().validation_step(batch, batch_idx)

    def test_step(self, *args: Any) -> Any:
        return self.validation_step(*args)

    def predict_step(self, batch: Any, *_: Any) -> Any:
        return self(batch)


for fn in ("validate", "test", "predict"):
    for enable_checkpointing in (True, False):

        def tested_best_case(ctx: Context, fn=fn, enable_checkpointing=enable_checkpointing) -> None:
            model = FooModel(train=8)
            trainer = ctx.trainer(max_epochs=2, limit_val_batches=1, limit_test_batches=1, limit_predict_batches=1,
                                  enable_checkpointing=enable_checkpointing)
            trainer.fit(model)
            trainer_fn = getattr(trainer, fn)
            assert trainer.ckpt_path is None
            if enable_checkpointing:
                trainer_fn(ckpt_path="best")
                assert trainer.ckpt_path == trainer.checkpoint_callback.best_model_path
                trainer_fn(model, ckpt_path="best")
                assert trainer.ckpt_path == trainer.checkpoint_callback.best_model_path
                same_on_every_rank(trainer.ckpt_path, "the checkpoint loaded as 'best'")
            else:
                with ctx.raises(ValueError, match="`ModelCheckpoint` is not configured."):
                    trainer_fn(ckpt_path="best")
                with ctx.raises(ValueError, match="`ModelCheckpoint` is not configured."):
                    trainer_fn(model, ckpt_path="best")

        params = f"{fn}-{enable_checkpointing}"
        SUITE.add(f"test_tested_checkpoint_path_best[{params}]", TT + f"test_tested_checkpoint_path_best[{params}]",
                  "passes", MODES if enable_checkpointing else ("nccl_cadence",), tested_best_case)


for fn, save_top_k, ckpt_path in (("validate", 1, "best"), ("test", 2, "best"), ("predict", -1, "best"),
                                  ("validate", 0, "best"), ("test", 1, "specific"), ("predict", 1, None)):

    def checkpoint_path_input_case(ctx: Context, fn=fn, save_top_k=save_top_k, ckpt_path=ckpt_path) -> None:
        model = FooModel(train=8)
        trainer = ctx.trainer(max_epochs=2, limit_val_batches=1, limit_test_batches=1, limit_predict_batches=1,
                              callbacks=[ModelCheckpoint(monitor="foo", save_top_k=save_top_k)])
        trainer.fit(model)
        trainer_fn = getattr(trainer, fn)
        assert trainer.ckpt_path is None
        if ckpt_path == "best":
            if save_top_k == 0:
                with ctx.raises(ValueError, match=".*is not configured to save the best.*"):
                    trainer_fn(ckpt_path=ckpt_path)
                with ctx.raises(ValueError, match=".*is not configured to save the best.*"):
                    trainer_fn(model, ckpt_path=ckpt_path)
            else:
                trainer_fn(ckpt_path=ckpt_path)
                assert trainer.ckpt_path == trainer.checkpoint_callback.best_model_path
                trainer_fn(model, ckpt_path=ckpt_path)
                assert trainer.ckpt_path == trainer.checkpoint_callback.best_model_path
        elif ckpt_path is None:
            trainer_fn(model, ckpt_path=ckpt_path)
            assert trainer.ckpt_path is None
            with ctx.warns(UserWarning, match="The best model of the previous `fit` call will be used"):
                trainer_fn(ckpt_path=ckpt_path)
            assert trainer.ckpt_path == trainer.checkpoint_callback.best_model_path
        else:
            folder = Path(ctx.tmp_path) / f"lightning_logs/version_{trainer.logger.version}/checkpoints"
            path = str(sorted(folder.iterdir())[0].absolute())
            trainer_fn(ckpt_path=path)
            assert trainer.ckpt_path == path
            trainer_fn(model, ckpt_path=path)
            assert trainer.ckpt_path == path
        same_on_every_rank(trainer.ckpt_path, "the checkpoint loaded")

    params = f"{fn}-{save_top_k}-{ckpt_path}"
    SUITE.add(f"test_checkpoint_path_input[{params}]", TT + f"test_checkpoint_path_input[{params}]", "passes",
              MODES if save_top_k == 2 else ("nccl_cadence",), checkpoint_path_input_case)


for ckpt_path, save_last in (("last", True), ("last", False), (None, True)):

    def checkpoint_path_input_last_case(ctx: Context, ckpt_path=ckpt_path, save_last=save_last) -> None:
        model = SizedBoringModel(train=2)
        mc = ModelCheckpoint(save_last=save_last)
        trainer = ctx.trainer(max_epochs=1, limit_val_batches=1, logger=False, callbacks=[mc])
        assert trainer.ckpt_path is None
        trainer.fit(model)
        if ckpt_path is None:
            final_path = mc.best_model_path
            with ctx.warns(UserWarning, match=".*The best model of the previous `fit` call will be used"):
                trainer.validate(ckpt_path=ckpt_path)
        elif save_last:
            final_path = mc.last_model_path
            trainer.validate(ckpt_path=ckpt_path)
        else:
            final_path = None
            with ctx.warns(UserWarning, match="No checkpoint will be loaded"):
                trainer.validate(ckpt_path=ckpt_path)
        assert trainer.ckpt_path == final_path

    params = f"validate-{save_last}-{ckpt_path}"
    SUITE.add(f"test_checkpoint_path_input_last[{params}]", TT + f"test_checkpoint_path_input_last[{params}]",
              "passes", MODES if (ckpt_path, save_last) == ("last", True) else ("nccl_cadence",),
              checkpoint_path_input_last_case)


@SUITE.case(TT + "test_checkpoint_find_last", modes=MODES)
def test_checkpoint_find_last(ctx: Context) -> None:
    mc = ModelCheckpoint(save_last=True)
    trainer = ctx.trainer(max_epochs=1, limit_val_batches=0, logger=False, callbacks=[mc])
    assert trainer.ckpt_path is None
    trainer.fit(SizedBoringModel(train=2))
    mc = ModelCheckpoint()
    trainer = ctx.trainer(max_epochs=1, limit_val_batches=0, logger=False, callbacks=[mc])
    assert trainer.ckpt_path is None
    trainer.fit(SizedBoringModel(train=2), ckpt_path="last")
    assert trainer.ckpt_path == str(ctx.tmp_path / "checkpoints" / "last.ckpt")


@SUITE.case(TT + "test_model_checkpoint_only_weights")
def test_model_checkpoint_only_weights(ctx: Context) -> None:
    model = SizedBoringModel(train=2)
    trainer = ctx.trainer(max_epochs=1, limit_val_batches=1,
                          callbacks=[ModelCheckpoint(dirpath=ctx.tmp_path, save_weights_only=True)])
    trainer.fit(model)
    assert trainer.state.finished, f"Training failed with {trainer.state}"
    checkpoint_path = trainer.checkpoint_callback.best_model_path
    checkpoint = torch.load(checkpoint_path, weights_only=True)
    assert "optimizer_states" not in checkpoint and "lr_schedulers" not in checkpoint
    assert SizedBoringModel.load_from_checkpoint(checkpoint_path=checkpoint_path)
    new_weights_path = os.path.join(ctx.tmp_path, "save_test.ckpt")
    trainer.save_checkpoint(new_weights_path, weights_only=True)
    checkpoint = torch.load(new_weights_path, weights_only=True)
    assert "optimizer_states" not in checkpoint and "lr_schedulers" not in checkpoint
    with ctx.raises(KeyError, match="checkpoint contains only the model"):
        trainer._checkpoint_connector.restore(new_weights_path)


@SUITE.case(TT + "test_fit_ckpt_path_epoch_restored[False]", modes=MODES, kind="deviation",
            note="the batches a rank sees and trainer.global_step are its own share; summed over the ranks they are "
                 "Lightning's counts, and the cohort step continues from the checkpoint's")
def test_fit_ckpt_path_epoch_restored(ctx: Context) -> None:
    class TestModel(SizedBoringModel):
        num_epochs_end_seen = 0
        num_batches_seen = 0
        num_on_load_checkpoint_called = 0

        def on_train_epoch_end(self) -> None:
            self.num_epochs_end_seen += 1

        def on_train_batch_start(self, *_: Any) -> None:
            self.num_batches_seen += 1

        def on_load_checkpoint(self, _: Any) -> None:
            self.num_on_load_checkpoint_called += 1

    def cohort_sum(value: int) -> int:
        gathered = [0, 0]
        torch.distributed.all_gather_object(gathered, value)
        return sum(gathered)

    model = TestModel(train=41)  # Lightning: limit_train_batches=0.65 of 64
    max_epochs = 2
    trainer = ctx.trainer(max_epochs=max_epochs, limit_val_batches=1, val_check_interval=1.0, logger=False,
                          callbacks=ModelCheckpoint(dirpath=ctx.tmp_path, save_top_k=-1))
    trainer.fit(model)
    assert model.num_epochs_end_seen == max_epochs
    cohort = trainer.strategy.progress.cohort_step
    assert cohort_sum(model.num_batches_seen) == trainer.num_training_batches * max_epochs == cohort
    assert model.num_on_load_checkpoint_called == 0
    ctx.barrier("fit")
    checkpoints = sorted(Path(trainer.checkpoint_callback.dirpath).glob("*.ckpt"))
    assert len(checkpoints) == max_epochs
    for ckpt in checkpoints:
        model = TestModel(train=41)
        state = pl_load(ckpt)
        trainer = ctx.trainer(max_epochs=2)
        trainer.fit(model, ckpt_path=ckpt)
        resumed_at = state["elche"]["cohort_step"]
        assert resumed_at + cohort_sum(model.num_batches_seen) == trainer.strategy.progress.cohort_step
        assert model.num_on_load_checkpoint_called == 1
