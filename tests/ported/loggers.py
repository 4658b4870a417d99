"""Loggers and logging: Lightning's ``loggers/`` (CSV, TensorBoard) and ``trainer/logging_/`` tests, on 2 ElChe ranks.

Per-step values are rank-local under ElChe (ranks take different numbers of steps); epoch-level
``sync_dist`` values are reduced over the ranks at the epoch end, over the batches each rank trained.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Union
from unittest import mock

import torch
import yaml
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from torch import Tensor

from ported.harness import FEW_MODES, MODES, Context, Suite
from ported.models import ClassifDataModule, ClassificationModel, SizedBoringModel, same_on_every_rank

SUITE = Suite("loggers")
LOGGING = "trainer/logging_/"


@SUITE.case("loggers/test_csv.py::test_fit_csv_logger")
def test_fit_csv_logger(ctx: Context) -> None:
    logger = CSVLogger(save_dir=ctx.tmp_path)
    trainer = ctx.trainer(max_steps=10, logger=logger, log_every_n_steps=1)
    trainer.fit(ClassificationModel(), datamodule=ClassifDataModule())
    ctx.barrier("fit")
    assert os.path.isfile(os.path.join(logger.log_dir, "metrics.csv"))


@SUITE.case("loggers/test_tensorboard.py::test_tensorboard_hparams_reload")
def test_tensorboard_hparams_reload(ctx: Context) -> None:
    class CustomModel(SizedBoringModel):
        def __init__(self, b1: float = 0.5, b2: float = 0.999) -> None:
            super().__init__(train=16)
            self.save_hyperparameters()

    trainer = ctx.trainer(max_steps=1, logger=TensorBoardLogger(ctx.tmp_path))
    model = CustomModel()
    assert trainer.log_dir == trainer.logger.log_dir
    trainer.fit(model)
    ctx.barrier("fit")
    assert trainer.log_dir == trainer.logger.log_dir
    with open(os.path.join(trainer.log_dir, "hparams.yaml")) as file:
        yaml_params = yaml.safe_load(file)
    assert yaml_params["b1"] == 0.5 and yaml_params["b2"] == 0.999 and len(yaml_params) == 2
    assert len(os.listdir(os.path.join(trainer.log_dir, "checkpoints"))) == 1


class AccumulatedLogging(SizedBoringModel):
    """``test_tensorboard_with_accumulated_gradients``'s model, recording each rank's epoch-end step too."""

    def __init__(self) -> None:
        super().__init__(train=24)  # Lightning: limit_train_batches=12 on one device; 24 over 2 ranks
        self.indexes: list[int] = []
        self.epoch_end_steps: list[int] = []

    def training_step(self, *args: Any) -> Any:
        self.log("foo", 1, on_step=True, on_epoch=True)
        if not self.trainer.fit_loop._should_accumulate() and self.trainer._logger_connector.should_update_logs:
            self.indexes.append(self.trainer.global_step)
        return super().training_step(*args)

    def on_train_epoch_end(self) -> None:
        self.epoch_end_steps.append(self.trainer.fit_loop.epoch_loop._batches_that_stepped - 1)


@SUITE.case("loggers/test_tensorboard.py::test_tensorboard_with_accumulated_gradients", modes=MODES)
def test_tensorboard_with_accumulated_gradients(ctx: Context) -> None:
    model = AccumulatedLogging()
    logger_0 = TensorBoardLogger(ctx.tmp_path, default_hp_metric=False)
    trainer = ctx.trainer(limit_val_batches=0, max_epochs=3, accumulate_grad_batches=2, logger=[logger_0],
                          log_every_n_steps=3)
    with mock.patch("lightning.pytorch.loggers.TensorBoardLogger.log_metrics") as mock_log_metrics:
        trainer.fit(model)
    calls = [m[2] for m in mock_log_metrics.mock_calls]
    count_epochs = [c["step"] for c in calls if "foo_epoch" in c["metrics"]]
    # Lightning (one device, 12 batches an epoch): [5, 11, 17]. Each rank logs at its own step count,
    # which depends on its share of the epoch; on each rank it is the last step of each epoch.
    assert count_epochs == model.epoch_end_steps and len(count_epochs) == 3
    count_steps = [c["step"] for c in calls if "foo_step" in c["metrics"]]
    assert count_steps == model.indexes and count_steps


LOGGER_FIT_TEST = {
    "CSVLogger": (CSVLogger, lambda path: {"save_dir": path}),
    "TensorBoardLogger": (TensorBoardLogger, lambda path: {"save_dir": path}),
}
for logger_name, (logger_class, logger_args) in LOGGER_FIT_TEST.items():

    def fit_test_all_case(ctx: Context, logger_class=logger_class, logger_args=logger_args) -> None:
        class CustomModel(SizedBoringModel):
            def training_step(self, batch: Any, batch_idx: int) -> Any:
                loss = self.step(batch)
                self.log("train_some_val", loss)
                return {"loss": loss}

            def on_validation_epoch_end(self) -> None:
                self.log_dict({"early_stop_on": torch.tensor(1), "val_loss": torch.tensor(0.5)})

            def on_test_epoch_end(self) -> None:
                self.log("test_loss", torch.tensor(2))

        class StoreHistoryLogger(logger_class):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                self.history: list[tuple[int, dict]] = []

            def log_metrics(self, metrics: dict, step: Optional[int] = None) -> None:
                super().log_metrics(metrics, step)
                self.history.append((step, metrics))

        logger = StoreHistoryLogger(**logger_args(ctx.tmp_path))
        trainer = ctx.trainer(max_epochs=1, logger=logger, limit_val_batches=1, log_every_n_steps=1)
        trainer.fit(CustomModel(train=2))  # Lightning: limit_train_batches=1 on one device
        trainer.test()
        names = [(s, sorted(m)) for s, m in logger.history if not any(k.startswith("elche/") for k in m)]
        assert names == [(0, ["epoch", "train_some_val"]), (0, ["early_stop_on", "epoch", "val_loss"]),
                         (1, ["epoch", "test_loss"])]
        if ctx.is_global_zero:  # rank 0 also logs ElChe's own metrics at every sync
            assert any("elche/anchor" in m for _, m in logger.history)

    SUITE.add(f"test_loggers_fit_test_all[{logger_name}]",
              f"loggers/test_all.py::test_loggers_fit_test_all[{logger_name}]", "deviation", FEW_MODES,
              fit_test_all_case,
              "rank 0 also logs ElChe's elche/* metrics at every sync (the other rows are Lightning's)")


@SUITE.case(LOGGING + "test_train_loop_logging.py::test__training_step__epoch_end__log")
def test__training_step__epoch_end__log(ctx: Context) -> None:
    class TestModel(SizedBoringModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            out = super().training_step(batch, batch_idx)
            loss = out["loss"]
            self.log("a", loss, on_step=True, on_epoch=True)
            self.log_dict({"a1": loss, "a2": loss})
            return out

        def on_train_epoch_end(self) -> None:
            self.log("b1", torch.tensor(1.0))
            self.log("b", torch.tensor(2.0), on_epoch=True, prog_bar=True, logger=True)

    model = TestModel(train=4)
    model.val_dataloader = None
    trainer = ctx.trainer(limit_val_batches=2, max_epochs=2, log_every_n_steps=1)
    trainer.fit(model)
    logged_metrics = set(trainer.logged_metrics)
    assert logged_metrics == {"a_step", "a_epoch", "b", "b1", "a1", "a2"}
    assert set(trainer.progress_bar_metrics) == {"b"}
    assert set(trainer.callback_metrics) == (logged_metrics | {"b"} | {"a"})
    assert all(isinstance(v, Tensor) for v in trainer.callback_metrics.values())
    assert all(isinstance(v, float) for v in trainer.progress_bar_metrics.values())


class LoggingSyncDistModel(SizedBoringModel):
    def __init__(self, fake_result: int) -> None:
        super().__init__(train=6, val=6)  # Lightning: limit_train_batches=3 per rank on 2 ranks
        self.fake_result = fake_result

    @property
    def rank(self) -> int:
        return self.trainer.global_rank

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        value = self.fake_result + self.rank
        self.log("foo_6", value, on_step=False, on_epoch=True, sync_dist=True, reduce_fx="sum")
        self.log("foo_7", 2, on_step=False, on_epoch=True, sync_dist=True, reduce_fx="sum")
        self.log("foo_8", 2, on_step=False, on_epoch=True, sync_dist=True, reduce_fx="mean")
        self.log("foo_10", batch_idx, on_step=False, on_epoch=True, sync_dist=True, reduce_fx="max")
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        self.log("bar", self.fake_result, on_step=False, on_epoch=True, sync_dist=True, reduce_fx="sum")
        self.log("bar_2", self.fake_result, on_step=False, on_epoch=True, sync_dist=True, reduce_fx="mean")
        self.log("bar_3", batch_idx + self.rank, on_step=False, on_epoch=True, sync_dist=True, reduce_fx="max")
        return super().validation_step(batch, batch_idx)


@SUITE.case(LOGGING + "test_train_loop_logging.py::test_logging_sync_dist_true[2-cpu]", modes=MODES, kind="deviation",
            note="per-step sync_dist values are rank-local (a warning says so); epoch-level training values are "
                 "reduced over the batches each rank trained, so under the pooled dispatch (uneven shares) a sum "
                 "of per-rank values counts each rank's batches, not 3 each")
def test_logging_sync_dist_true(ctx: Context) -> None:
    trainer = ctx.trainer(max_epochs=1, limit_val_batches=3)
    model = LoggingSyncDistModel(1)
    trainer.fit(model)
    metrics = trainer.callback_metrics
    batches = [0, 0]
    torch.distributed.all_gather_object(batches, trainer.fit_loop.epoch_loop.batch_progress.current.completed)
    assert sum(batches) == 6
    if ctx.mode in ("nccl_sync", "cpu_sync"):
        assert batches == [3, 3]  # the equal split: Lightning's DDP numbers
    assert metrics["foo_6"] == 1 * batches[0] + 2 * batches[1]  # Lightning (3 each): 0+1+1+2+2+3 = 9
    assert metrics["foo_7"] == 2 * 6
    assert metrics["foo_8"] == 2
    assert metrics["foo_10"] == max(batches) - 1  # Lightning: 2
    assert metrics["bar"] == 1 * 3 * 2
    assert metrics["bar_2"] == 1
    assert metrics["bar_3"] == 2 + 1
    same_on_every_rank({k: float(v) for k, v in metrics.items()}, "the epoch-level sync_dist values")


@SUITE.case(LOGGING + "test_train_loop_logging.py::test_metric_are_properly_reduced[cpu]")
def test_metric_are_properly_reduced(ctx: Context) -> None:
    from torchmetrics import Accuracy

    class TestingModel(SizedBoringModel):
        def __init__(self) -> None:
            super().__init__(train=10)
            self.val_acc = Accuracy(task="multiclass", num_classes=2)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            output = super().training_step(batch, batch_idx)
            self.log("train_loss", output["loss"])
            return output

        def validation_step(self, batch: Any, batch_idx: int) -> Any:
            preds = torch.tensor([[0.9, 0.1]], device=self.device)
            targets = torch.tensor([1], device=self.device)
            if batch_idx < 8:
                preds = torch.tensor([[0.1, 0.9]], device=self.device)
            self.val_acc(preds, targets)
            self.log("val_acc", self.val_acc, on_step=True, on_epoch=True)
            return super().validation_step(batch, batch_idx)

    early_stop = EarlyStopping(monitor="val_acc", mode="max")
    checkpoint = ModelCheckpoint(monitor="val_acc", save_last=True, save_top_k=2, mode="max")
    trainer = ctx.trainer(max_epochs=2, limit_val_batches=32, callbacks=[early_stop, checkpoint])
    trainer.fit(TestingModel())
    # Each rank validates 32 batches of its half, 8 of them right: the metric object syncs over the ranks.
    assert trainer.callback_metrics["val_acc"] == 8 / 32.0
    assert "train_loss" in trainer.callback_metrics


@SUITE.case(LOGGING + "test_train_loop_logging.py::test_progress_bar_metrics_contains_values_on_train_epoch_end")
def test_progress_bar_metrics_contains_values_on_train_epoch_end(ctx: Context) -> None:
    from lightning.pytorch.callbacks import TQDMProgressBar

    class TestModel(SizedBoringModel):
        def training_step(self, *args: Any) -> Any:
            self.log("foo", torch.tensor(self.current_epoch), on_step=False, on_epoch=True, prog_bar=True)
            return super().training_step(*args)

        def on_train_epoch_end(self, *_: Any) -> None:
            self.log("foo_2", torch.tensor(self.current_epoch), prog_bar=True, on_epoch=True, sync_dist=True,
                     reduce_fx="sum")
            self.on_train_epoch_end_called = True

    class TestProgressBar(TQDMProgressBar):
        def get_metrics(self, trainer: Trainer, model: LightningModule) -> dict:
            items = super().get_metrics(trainer, model)
            items.pop("v_num", None)
            return items

        def on_train_end(self, trainer: Trainer, model: LightningModule) -> None:
            metrics = self.get_metrics(trainer, model)
            assert metrics["foo"] == self.trainer.current_epoch - 1
            # Lightning (one device): current_epoch - 1; a sum over the 2 ranks (as under DDP) is twice that.
            assert metrics["foo_2"] == (self.trainer.current_epoch - 1) * trainer.world_size
            model.callback_on_train_end_called = True

    trainer = ctx.trainer(callbacks=[TestProgressBar()], max_epochs=2, limit_val_batches=0, enable_checkpointing=False,
                          logger=False, enable_progress_bar=True)
    model = TestModel(train=2)
    trainer.fit(model)
    assert model.on_train_epoch_end_called
    assert model.callback_on_train_end_called


@SUITE.case(LOGGING + "test_train_loop_logging.py::test_logging_in_callbacks_with_log_function")
def test_logging_in_callbacks_with_log_function(ctx: Context) -> None:
    class LoggingCallback(Callback):
        def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
            self.log("on_train_start", 1)

        def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
            self.log("on_train_epoch_start", 2)

        def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
            self.log("on_train_batch_end", 3)

        def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
            self.log("on_train_epoch_end", 5)

    trainer = ctx.trainer(limit_val_batches=1, max_epochs=1, callbacks=[LoggingCallback()])
    trainer.fit(SizedBoringModel(train=2))
    assert trainer.callback_metrics == {"on_train_start": 1, "on_train_epoch_start": 2, "on_train_batch_end": 3,
                                        "on_train_epoch_end": 5}


class AllRankLogger(Logger):
    def __init__(self) -> None:
        super().__init__()
        self.logs: dict[str, Any] = {}

    @property
    def experiment(self) -> Any:
        return None

    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        self.logs.update(metrics)

    @property
    def version(self) -> Union[int, str]:
        return 1

    @property
    def name(self) -> str:
        return "AllRank"

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass


@SUITE.case(LOGGING + "test_distributed_logging.py::test_all_rank_logging_ddp_cpu")
def test_all_rank_logging_ddp_cpu(ctx: Context) -> None:
    class TestModel(SizedBoringModel):
        def on_train_start(self) -> None:
            self.log(f"rank-{self.local_rank}", 0)

        def on_train_end(self) -> None:
            assert f"rank-{self.local_rank}" in self.logger.logs, "Expected rank to be logged"

    trainer = ctx.trainer(limit_val_batches=1, max_epochs=1, logger=AllRankLogger(), log_every_n_steps=1)
    trainer.fit(TestModel(train=2))


@SUITE.case(LOGGING + "test_distributed_logging.py::test_logger_after_fit_predict_test_calls", kind="deviation",
            note="rank 0 also logs ElChe's elche/* metrics at every sync (the other entries are Lightning's)")
def test_logger_after_fit_predict_test_calls(ctx: Context) -> None:
    class BufferLogger(AllRankLogger):
        def __init__(self) -> None:
            super().__init__()
            self.buffer: dict[str, Any] = {}

        def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
            self.buffer.update(metrics)

        def finalize(self, status: str) -> None:
            self.logs.update(self.buffer)
            self.buffer = {}

    class LoggerCallsObserver(Callback):
        def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
            trainer.logger.log_metrics({"fit": 1})

        def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
            trainer.logger.log_metrics({"validate": 1})

        def on_predict_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
            trainer.logger.log_metrics({"predict": 1})

        def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
            trainer.logger.log_metrics({"test": 1})

    model = SizedBoringModel(train=2)
    trainer = ctx.trainer(limit_val_batches=1, limit_test_batches=1, limit_predict_batches=1, max_epochs=1,
                          logger=BufferLogger(), callbacks=[LoggerCallsObserver()])
    def lightning_logs() -> dict[str, Any]:  # rank 0 also logs ElChe's elche/* metrics at every sync
        return {k: v for k, v in trainer.logger.logs.items() if not k.startswith("elche/")}

    assert not trainer.logger.logs
    trainer.fit(model)
    assert lightning_logs() == {"fit": 1, "validate": 1}
    trainer.test(model)
    assert lightning_logs() == {"fit": 1, "validate": 1, "test": 1}
    trainer.predict(model)
    assert lightning_logs() == {"fit": 1, "validate": 1, "test": 1, "predict": 1}
