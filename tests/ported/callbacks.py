"""Callbacks: Lightning's ``callbacks/test_lambda_function.py``, ``test_lr_monitor.py``, ``test_finetuning_callback.py``
and ``callbacks/progress/`` (TQDM and Rich progress bars), on 2 ElChe ranks.
"""

from __future__ import annotations

import inspect
from functools import partial
from typing import Any
from unittest import mock

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import (
    BackboneFinetuning,
    BaseFinetuning,
    LambdaCallback,
    LearningRateMonitor,
    ModelCheckpoint,
    RichProgressBar,
    TQDMProgressBar,
)
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm
from lightning.pytorch.demos.boring_classes import RandomDataset
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn, optim
from torch.utils.data import DataLoader

from ported.harness import MODES, Context, Suite
from ported.models import ClassifDataModule, ClassificationModel, SizedBoringModel

SUITE = Suite("callbacks")
LR = "callbacks/test_lr_monitor.py::"
FT = "callbacks/test_finetuning_callback.py::"
PROGRESS = "callbacks/progress/"


def get_members(cls: type) -> set[str]:
    """Lightning's ``tests/models/test_hooks.py::get_members``: the public hooks a class defines."""
    return {h for h, _ in inspect.getmembers(cls, predicate=inspect.isfunction) if not h.startswith("_")}


@SUITE.case("callbacks/test_lambda_function.py::test_lambda_call", modes=MODES)
def test_lambda_call(ctx: Context) -> None:
    class CustomException(Exception):
        pass

    class CustomModel(SizedBoringModel):
        def on_train_epoch_start(self) -> None:
            if self.current_epoch > 1:
                raise CustomException("Custom exception to trigger `on_exception` hooks")

    checker: set[str] = set()

    def call(hook: str, *_: Any, **__: Any) -> None:
        checker.add(hook)

    hooks = get_members(Callback) - {"state_dict", "load_state_dict"}
    hooks_args = {h: partial(call, h) for h in hooks}
    model = CustomModel(train=2)
    trainer = ctx.trainer(max_epochs=1, limit_val_batches=1, callbacks=[LambdaCallback(**hooks_args)])
    trainer.fit(model)
    ckpt_path = trainer.checkpoint_callback.best_model_path
    trainer = ctx.trainer(max_epochs=3, limit_val_batches=1, limit_test_batches=1, limit_predict_batches=1,
                          callbacks=[LambdaCallback(**hooks_args)])
    with ctx.raises(CustomException, match="Custom exception"):
        trainer.fit(model, ckpt_path=ckpt_path)  # every rank raises at the same epoch start
    trainer.test(model)
    trainer.predict(model)
    assert checker == hooks


@SUITE.case(LR + "test_lr_monitor_single_lr")
def test_lr_monitor_single_lr(ctx: Context) -> None:
    lr_monitor = LearningRateMonitor()
    trainer = ctx.trainer(max_epochs=2, limit_val_batches=0.1, callbacks=[lr_monitor], logger=CSVLogger(ctx.tmp_path))
    trainer.fit(SizedBoringModel(train=32))  # Lightning: limit_train_batches=0.5 of 64
    assert lr_monitor.lrs, "No learning rates logged"
    assert all(v is None for v in lr_monitor.last_momentum_values.values())
    assert all(v is None for v in lr_monitor.last_weight_decay_values.values())
    assert len(lr_monitor.lrs) == len(trainer.lr_scheduler_configs)
    assert list(lr_monitor.lrs) == ["lr-SGD"]


for opt in ("SGD", "Adam"):

    def momentum_case(ctx: Context, opt=opt) -> None:
        class LogMomentumModel(SizedBoringModel):
            def configure_optimizers(self) -> Any:
                opt_kwargs = {"momentum": 0.9} if opt == "SGD" else {"betas": (0.9, 0.999)}
                optimizer = getattr(optim, opt)(self.parameters(), lr=1e-2, **opt_kwargs)
                return [optimizer], [optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=10_000)]

        lr_monitor = LearningRateMonitor(log_momentum=True, log_weight_decay=True)
        trainer = ctx.trainer(max_epochs=2, limit_val_batches=2, log_every_n_steps=1, callbacks=[lr_monitor],
                              logger=CSVLogger(ctx.tmp_path))
        trainer.fit(LogMomentumModel(train=5))
        assert all(v is not None for v in lr_monitor.last_momentum_values.values())
        assert len(lr_monitor.last_momentum_values) == len(trainer.lr_scheduler_configs)
        assert all(k == f"lr-{opt}-momentum" for k in lr_monitor.last_momentum_values)
        assert all(v is not None for v in lr_monitor.last_weight_decay_values.values())
        assert all(k == f"lr-{opt}-weight_decay" for k in lr_monitor.last_weight_decay_values)

    SUITE.add(f"test_lr_monitor_single_lr_with_momentum[{opt}]", LR + f"test_lr_monitor_single_lr_with_momentum[{opt}]",
              "passes", ("nccl_cadence",), momentum_case)


@SUITE.case(LR + "test_lr_monitor_no_lr_scheduler_single_lr")
def test_lr_monitor_no_lr_scheduler_single_lr(ctx: Context) -> None:
    class CustomBoringModel(SizedBoringModel):
        def configure_optimizers(self) -> Any:
            return optim.SGD(self.parameters(), lr=0.1)

    lr_monitor = LearningRateMonitor()
    trainer = ctx.trainer(max_epochs=2, limit_val_batches=0.1, callbacks=[lr_monitor], logger=CSVLogger(ctx.tmp_path))
    trainer.fit(CustomBoringModel(train=32))
    assert lr_monitor.lrs, "No learning rates logged"
    assert len(lr_monitor.lrs) == len(trainer.optimizers)
    assert list(lr_monitor.lrs) == ["lr-SGD"]


@SUITE.case(LR + "test_lr_monitor_multi_lrs[step]", "refused",
            note="manual optimization (and more than one optimizer) is refused in setup: use automatic "
                 "optimization with one optimizer")
def test_lr_monitor_multi_lrs(ctx: Context) -> None:
    class CustomBoringModel(SizedBoringModel):
        def __init__(self) -> None:
            super().__init__(train=2)
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            for opt in self.optimizers():
                loss = self.loss(self.step(batch))
                opt.zero_grad()
                self.manual_backward(loss)
                opt.step()

        def configure_optimizers(self) -> Any:
            optimizers = [optim.Adam(self.parameters(), lr=1e-2), optim.Adam(self.parameters(), lr=1e-2)]
            return optimizers, [optim.lr_scheduler.StepLR(o, 1, gamma=0.1) for o in optimizers]

    trainer = ctx.trainer(max_epochs=2, limit_val_batches=0, callbacks=[LearningRateMonitor(logging_interval="step")],
                          logger=CSVLogger(ctx.tmp_path))
    with ctx.raises(MisconfigurationException, match=r"automatic_optimization=False.*automatic optimization"):
        trainer.fit(CustomBoringModel())


@SUITE.case(LR + "test_lr_monitor_param_groups")
def test_lr_monitor_param_groups(ctx: Context) -> None:
    class CustomClassificationModel(ClassificationModel):
        def configure_optimizers(self) -> Any:
            param_groups = [{"params": list(self.parameters())[:2], "lr": self.lr * 0.1},
                            {"params": list(self.parameters())[2:], "lr": self.lr}]
            optimizer = optim.Adam(param_groups)
            return [optimizer], [optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.1)]

    lr_monitor = LearningRateMonitor()
    trainer = ctx.trainer(max_epochs=2, limit_val_batches=0.5, callbacks=[lr_monitor], logger=CSVLogger(ctx.tmp_path))
    trainer.fit(CustomClassificationModel(), datamodule=ClassifDataModule(train=96))
    assert lr_monitor.lrs, "No learning rates logged"
    assert len(lr_monitor.lrs) == 2 * len(trainer.lr_scheduler_configs)
    assert list(lr_monitor.lrs) == ["lr-Adam/pg1", "lr-Adam/pg2"]


@SUITE.case(LR + "test_lr_monitor_custom_name")
def test_lr_monitor_custom_name(ctx: Context) -> None:
    class TestModel(SizedBoringModel):
        def configure_optimizers(self) -> Any:
            optimizer, [scheduler] = super().configure_optimizers()
            return optimizer, [{"scheduler": scheduler, "name": "my_logging_name"}]

    lr_monitor = LearningRateMonitor()
    trainer = ctx.trainer(max_epochs=2, limit_val_batches=0.1, callbacks=[lr_monitor], logger=CSVLogger(ctx.tmp_path))
    trainer.fit(TestModel(train=32))
    assert list(lr_monitor.lrs) == ["my_logging_name"]


class TestBackboneFinetuningCallback(BackboneFinetuning):
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        epoch = trainer.current_epoch
        if self.unfreeze_backbone_at_epoch <= epoch:
            current_lr = trainer.optimizers[0].param_groups[0]["lr"]
            backbone_lr = self.previous_backbone_lr
            if epoch < 6:
                assert backbone_lr <= current_lr
            else:
                assert backbone_lr == current_lr


@SUITE.case(FT + "test_finetuning_callback", modes=MODES)
def test_finetuning_callback(ctx: Context) -> None:
    class FinetuningBoringModel(SizedBoringModel):
        def __init__(self) -> None:
            super().__init__(train=8, batch_size=2)  # Lightning: limit_train_batches=4 of batches of 2
            self.backbone = nn.Sequential(nn.Linear(32, 32, bias=False), nn.BatchNorm1d(32), nn.ReLU())
            self.layer = torch.nn.Linear(32, 2)
            self.backbone.has_been_used = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.backbone.has_been_used = True
            return self.layer(self.backbone(x))

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.layer.parameters(), lr=0.1)
            return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)]

    model = FinetuningBoringModel()
    callback = TestBackboneFinetuningCallback(unfreeze_backbone_at_epoch=3, verbose=False)
    trainer = ctx.trainer(callbacks=[callback], max_epochs=8)
    trainer.fit(model)
    assert model.backbone.has_been_used
    weights = [p.detach().flatten().tolist() for p in model.parameters()]
    gathered: list[Any] = [None, None]
    torch.distributed.all_gather_object(gathered, weights)
    assert gathered[0] == gathered[1], "the unfrozen backbone is averaged like the rest"


class TestBackboneFinetuningWarningCallback(BackboneFinetuning):
    def finetune_function(self, pl_module: LightningModule, epoch: int, optimizer: Any) -> None:
        if epoch == 0:
            self.unfreeze_and_add_param_group(pl_module.backbone, optimizer, 0.1, train_bn=self.train_bn,
                                              initial_denom_lr=self.initial_denom_lr)


@SUITE.case(FT + "test_finetuning_callback_warning")
def test_finetuning_callback_warning(ctx: Context) -> None:
    class FinetuningBoringModel(SizedBoringModel):
        def __init__(self) -> None:
            super().__init__(train=4, batch_size=2)  # Lightning: limit_train_batches=1; here one per rank
            self.backbone = nn.Linear(32, 2, bias=False)
            self.layer = None
            self.backbone.has_been_used = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.backbone.has_been_used = True
            return self.backbone(x)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    chk = ModelCheckpoint(dirpath=ctx.tmp_path, save_last=True)
    model = FinetuningBoringModel()
    model.validation_step = None
    callback = TestBackboneFinetuningWarningCallback(unfreeze_backbone_at_epoch=3, verbose=False)
    trainer = ctx.trainer(callbacks=[callback, chk], max_epochs=2)
    with ctx.warns(UserWarning, match="Did you init your optimizer in"):
        trainer.fit(model)
    assert model.backbone.has_been_used
    trainer = ctx.trainer(max_epochs=3)
    trainer.fit(model, ckpt_path=chk.last_model_path)


class TestCallbacksRestoreCallback(BaseFinetuning):
    def freeze_before_training(self, pl_module: LightningModule) -> None:
        self.freeze(pl_module.layer[:3])

    def finetune_function(self, pl_module: LightningModule, epoch: int, optimizer: Any) -> None:
        if epoch >= 1:
            self.unfreeze_and_add_param_group(pl_module.layer[epoch - 1], optimizer)


class FinetuningLayers(SizedBoringModel):
    def __init__(self) -> None:
        super().__init__(train=2)
        self.layer = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 2))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(filter(lambda x: x.requires_grad, self.parameters()), lr=0.1)


@SUITE.case(FT + "test_callbacks_restore", modes=MODES)
def test_callbacks_restore(ctx: Context) -> None:
    chk = ModelCheckpoint(dirpath=ctx.tmp_path, save_last=True)
    model = FinetuningLayers()
    callback = TestCallbacksRestoreCallback()
    kwargs = {"limit_val_batches": 1, "callbacks": [callback, chk], "max_epochs": 2}
    trainer = ctx.trainer(**kwargs)
    trainer.fit(model)
    assert len(callback._internal_optimizer_metadata) == 1
    assert len(callback._internal_optimizer_metadata[0]) == 2
    first, added = callback._internal_optimizer_metadata[0]
    assert first["lr"] == 0.1 and first["params"] == ["layer.3.weight", "layer.3.bias"]
    assert added["lr"] == 0.01 and added["params"] == ["layer.0.weight", "layer.0.bias"]
    kwargs["max_epochs"] = 3
    trainer = ctx.trainer(**kwargs)
    trainer.fit(model, ckpt_path=chk.last_model_path)


@SUITE.case(FT + "test_callbacks_restore_backbone")
def test_callbacks_restore_backbone(ctx: Context) -> None:
    class BackboneBoringModel(SizedBoringModel):
        def __init__(self) -> None:
            super().__init__(train=2)
            self.layer = nn.Linear(32, 2)
            self.backbone = nn.Linear(32, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layer(self.backbone(x))

    ckpt = ModelCheckpoint(dirpath=ctx.tmp_path, save_last=True)
    trainer = ctx.trainer(limit_val_batches=1, max_epochs=2,
                          callbacks=[ckpt, BackboneFinetuning(unfreeze_backbone_at_epoch=1)])
    trainer.fit(BackboneBoringModel())
    trainer = ctx.trainer(limit_val_batches=1, max_epochs=3, callbacks=BackboneFinetuning(unfreeze_backbone_at_epoch=1))
    trainer.fit(BackboneBoringModel(), ckpt_path=ckpt.last_model_path)


class RecordingTqdm(Tqdm):
    """Lightning's ``MockTqdm``: Lightning's tqdm, recording the totals, counts and descriptions it is given."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.n_values: list[int] = []
        self.total_values: list[Any] = []
        self.descriptions: list[str] = []
        super().__init__(*args, **kwargs)
        self._recorded_n, self._recorded_total = 0, 0
        self.n_values, self.total_values, self.descriptions = [], [], []  # drop what __init__ set

    @property  # type: ignore[override]
    def n(self) -> int:
        return self._recorded_n

    @n.setter
    def n(self, value: int) -> None:
        self._recorded_n = value
        if not self.n_values or value != self.n_values[-1]:
            self.n_values.append(value)

    @property  # type: ignore[override]
    def total(self) -> Any:
        return self._recorded_total

    @total.setter
    def total(self, value: Any) -> None:
        self._recorded_total = value
        self.total_values.append(value)

    def set_description(self, *args: Any, **kwargs: Any) -> None:
        super().set_description(*args, **kwargs)
        self.descriptions.append(self.desc)


@SUITE.case(PROGRESS + "test_tqdm_progress_bar.py::test_tqdm_progress_bar_totals[1]", modes=MODES, kind="deviation",
            note="the train bar's total is the cohort's batches of an epoch (trainer.num_training_batches) and a "
                 "rank's bar ends at its own share; validation, test and predict bars are Lightning's")
def test_tqdm_progress_bar_totals(ctx: Context) -> None:
    model = SizedBoringModel()
    trainer = ctx.trainer(max_epochs=1, enable_progress_bar=True, callbacks=[TQDMProgressBar()])
    pbar = trainer.progress_bar_callback
    batches = [0]

    class Count(Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            batches[0] += 1

    trainer.callbacks.append(Count())
    with mock.patch("lightning.pytorch.callbacks.progress.tqdm_progress.Tqdm", RecordingTqdm):
        trainer.fit(model)
    n, m = trainer.num_training_batches, trainer.num_val_batches
    train_bar, val_bar = pbar.train_progress_bar, pbar.val_progress_bar
    with mock.patch("lightning.pytorch.callbacks.progress.tqdm_progress.Tqdm", RecordingTqdm):
        trainer.test(model)
    k, test_bar = trainer.num_test_batches, pbar.test_progress_bar
    assert n == 64  # the cohort's
    if not ctx.is_global_zero:  # the bars show on rank 0
        return
    assert train_bar.total == n
    assert train_bar.n == batches[0] < n  # Lightning: == n (each DDP rank runs all its batches of the total)
    assert train_bar.leave
    assert val_bar.total_values == m, (val_bar.total_values, m)
    assert val_bar.n_values == list(range(m[0] + 1)), val_bar.n_values
    assert val_bar.descriptions == ["Validation DataLoader 0: "]
    assert not val_bar.leave
    assert test_bar.total_values == k
    assert test_bar.n_values == list(range(k[0] + 1))
    assert test_bar.descriptions == ["Testing DataLoader 0: "]


for limit_val_batches in (0, 5):

    def sanity_bar_case(ctx: Context, limit_val_batches=limit_val_batches) -> None:
        class CurrentProgressBar(TQDMProgressBar):
            val_pbar_total = 0
            sanity_pbar_total = 0

            def on_sanity_check_end(self, *args: Any) -> None:
                self.sanity_pbar_total = self.val_progress_bar.total
                super().on_sanity_check_end(*args)

            def on_validation_epoch_end(self, *args: Any) -> None:
                self.val_pbar_total = self.val_progress_bar.total
                super().on_validation_epoch_end(*args)

        pbar = CurrentProgressBar()
        trainer = ctx.trainer(max_epochs=1, num_sanity_val_steps=2, limit_val_batches=limit_val_batches,
                              callbacks=[pbar], logger=False, enable_checkpointing=False, enable_progress_bar=True)
        trainer.fit(SizedBoringModel(train=2))
        if ctx.is_global_zero:
            assert pbar.sanity_pbar_total == min(2, limit_val_batches)
            assert pbar.val_pbar_total == limit_val_batches

    SUITE.add(f"test_num_sanity_val_steps_progress_bar[{limit_val_batches}]",
              PROGRESS + f"test_tqdm_progress_bar.py::test_num_sanity_val_steps_progress_bar[{limit_val_batches}]",
              "passes", ("nccl_cadence",), sanity_bar_case)


@SUITE.case(PROGRESS + "test_rich_progress_bar.py::test_rich_progress_bar_num_sanity_val_steps[5]")
def test_rich_progress_bar_num_sanity_val_steps(ctx: Context) -> None:
    progress_bar = RichProgressBar()
    trainer = ctx.trainer(num_sanity_val_steps=3, limit_val_batches=5, max_epochs=1, callbacks=progress_bar,
                          enable_progress_bar=True)
    trainer.fit(SizedBoringModel(train=2))
    if ctx.is_global_zero:
        assert progress_bar.progress.tasks[0].completed == 3
        assert progress_bar.progress.tasks[0].total == 3


for dataset_name in ("RandomDataset", "RandomIterableDataset"):

    def rich_bar_case(ctx: Context, dataset_name=dataset_name) -> None:
        from lightning.pytorch.demos.boring_classes import RandomIterableDataset

        dataset = RandomDataset(32, 64) if dataset_name == "RandomDataset" else RandomIterableDataset(32, 64)

        class TestModel(SizedBoringModel):
            def train_dataloader(self) -> DataLoader:
                # Lightning: the whole dataset with limit_train_batches=1; here 2 samples, 1 batch per rank
                return DataLoader(dataset=torch.utils.data.Subset(dataset, [0, 1])
                                  if isinstance(dataset, RandomDataset) else dataset)

        trainer = ctx.trainer(num_sanity_val_steps=0, limit_val_batches=1, limit_test_batches=1,
                              limit_predict_batches=1, max_epochs=1, callbacks=RichProgressBar(),
                              enable_progress_bar=True)
        model = TestModel()
        if dataset_name == "RandomIterableDataset":
            with ctx.raises(TypeError, match="cannot dispatch an IterableDataset.*map-style Dataset"):
                trainer.fit(model)
            return
        on_rank_zero = 1 if ctx.is_global_zero else 0  # the bar shows on rank 0 only
        with mock.patch("lightning.pytorch.callbacks.progress.rich_progress.Progress.update") as mocked:
            trainer.fit(model)
        assert mocked.call_count == 3 * on_rank_zero  # 2 for the train bar and 1 for the validation bar
        for fn in (trainer.validate, trainer.test, trainer.predict):
            with mock.patch("lightning.pytorch.callbacks.progress.rich_progress.Progress.update") as mocked:
                fn(model)
            assert mocked.call_count == on_rank_zero

    SUITE.add(f"test_rich_progress_bar[{dataset_name}]",
              PROGRESS + f"test_rich_progress_bar.py::test_rich_progress_bar[{dataset_name}]",
              "refused" if dataset_name == "RandomIterableDataset" else "passes", ("nccl_cadence",), rich_bar_case,
              "an IterableDataset for training is refused: use a map-style Dataset"
              if dataset_name == "RandomIterableDataset" else "")
