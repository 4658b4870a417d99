"""Trainer flags and loops: Lightning's ``trainer/flags/``, ``trainer/test_dataloaders.py`` and the loop tests
of ``trainer/test_trainer.py`` (sanity check, predict, disabled validation, repeated fits), on 2 ElChe ranks.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import torch
from lightning.pytorch import Callback, LightningDataModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter, ModelCheckpoint
from lightning.pytorch.demos.boring_classes import RandomDataset
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.utils.data import DataLoader

from ported.harness import MODES, Context, Suite
from ported.models import ClassifDataModule, ClassificationModel, SizedBoringModel
from ported.stops import LastRounds, assert_stopped_at_the_budget

SUITE = Suite("trainer")
TT = "trainer/test_trainer.py::"
DL = "trainer/test_dataloaders.py::"


class CustomModelMixedVal(SizedBoringModel):
    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        return super().validation_step(batch, batch_idx)

    def val_dataloader(self) -> list[DataLoader]:
        return [DataLoader(RandomDataset(32, 64), batch_size=8), DataLoader(RandomDataset(32, 64))]


for limit_val_batches in (0.0, 1, 1.0, 0.5, 5):

    def num_sanity_val_steps_case(ctx: Context, limit_val_batches=limit_val_batches) -> None:
        num_sanity_val_steps = 4
        trainer = ctx.trainer(num_sanity_val_steps=num_sanity_val_steps, limit_val_batches=limit_val_batches,
                              max_steps=1)
        assert trainer.num_sanity_val_steps == num_sanity_val_steps
        val_loop = trainer.fit_loop.epoch_loop.val_loop
        with mock.patch.object(val_loop, "_evaluation_step", wraps=val_loop._evaluation_step) as mocked:
            trainer.fit(CustomModelMixedVal())
        # The sanity check's batches only: max_steps=1 stops inside the first epoch, where Lightning does
        # not validate (before issue 26 ElChe validated a whole epoch there: 44 calls instead of 8).
        assert mocked.call_count == sum(trainer.num_sanity_val_batches)

    SUITE.add(f"test_num_sanity_val_steps[{limit_val_batches}]", TT + f"test_num_sanity_val_steps[{limit_val_batches}]",
              "passes", MODES if limit_val_batches == 1.0 else ("nccl_cadence",), num_sanity_val_steps_case)

for limit_val_batches in (0.0, 1, 1.0, 0.3):

    def neg_one_case(ctx: Context, limit_val_batches=limit_val_batches) -> None:
        class CustomModel(SizedBoringModel):
            def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
                return super().validation_step(batch, batch_idx)

            def val_dataloader(self) -> list[DataLoader]:
                return [DataLoader(RandomDataset(32, 64)), DataLoader(RandomDataset(32, 64))]

        model = CustomModel()
        trainer = ctx.trainer(num_sanity_val_steps=-1, limit_val_batches=limit_val_batches, max_steps=1)
        assert trainer.num_sanity_val_steps == float("inf")
        val_loop = trainer.fit_loop.epoch_loop.val_loop
        with mock.patch.object(val_loop, "_evaluation_step", wraps=val_loop._evaluation_step) as mocked:
            trainer.fit(model, val_dataloaders=model.val_dataloader())
            assert mocked.call_count == sum(trainer.num_val_batches)

    SUITE.add(f"test_num_sanity_val_steps_neg_one[{limit_val_batches}]",
              TT + f"test_num_sanity_val_steps_neg_one[{limit_val_batches}]", "passes",
              MODES if limit_val_batches == 0.3 else ("nccl_cadence",), neg_one_case)


@SUITE.case("trainer/flags/test_limit_batches.py::test_num_dataloader_batches", "refused",
            note="limit_train_batches (a per-rank batch count) is refused in setup: fit on a Subset; "
                 "limit_val_batches works")
def test_num_dataloader_batches(ctx: Context) -> None:
    model = SizedBoringModel()
    trainer = ctx.trainer(limit_val_batches=100, max_epochs=1)
    trainer.fit(model)
    assert trainer.num_val_batches[0] == 32  # each rank validates its half of 64
    assert trainer.num_training_batches == 64  # the cohort's batches of an epoch
    trainer = ctx.trainer(limit_val_batches=7, limit_train_batches=7, max_epochs=1)
    with ctx.raises(MisconfigurationException, match=r"limit_train_batches\)=7.*Subset"):
        trainer.fit(SizedBoringModel())


for mode in ("val", "test", "predict"):
    for limit_batches in (0.1, 10):

        def eval_limit_case(ctx: Context, mode=mode, limit_batches=limit_batches) -> None:
            model = SizedBoringModel()
            trainer = ctx.trainer(max_epochs=1, **{f"limit_{mode}_batches": limit_batches})
            counts: list[int] = []

            class Count(Callback):
                def on_validation_batch_end(self, *args: Any) -> None:
                    counts.append(1)

                on_test_batch_end = on_predict_batch_end = on_validation_batch_end

            trainer.callbacks.append(Count())
            {"val": trainer.validate, "test": trainer.test, "predict": trainer.predict}[mode](model)
            per_rank = 32  # each rank's DistributedSampler shard of 64
            expected = int(limit_batches * per_rank) if isinstance(limit_batches, float) else limit_batches
            assert len(counts) == expected

        SUITE.add(f"test_eval_limit_batches[{limit_batches}-{mode}]",
                  f"trainer/flags/test_limit_batches.py::test_eval_limit_batches[{limit_batches}-{mode}]", "passes",
                  ("nccl_cadence",), eval_limit_case)


for max_epochs, denominator in ((1, 1), (2, 1), (1, 3)):

    def val_check_interval_case(ctx: Context, max_epochs=max_epochs, denominator=denominator) -> None:
        class TestModel(SizedBoringModel):
            def __init__(self) -> None:
                super().__init__()
                self.train_epoch_calls = 0
                self.val_epoch_calls = 0

            def on_train_epoch_start(self) -> None:
                self.train_epoch_calls += 1

            def on_validation_epoch_start(self) -> None:
                if not self.trainer.sanity_checking:
                    self.val_epoch_calls += 1

        model = TestModel()
        trainer = ctx.trainer(enable_checkpointing=False, logger=False, max_epochs=max_epochs,
                              val_check_interval=1 / denominator)
        if denominator != 1:
            with ctx.raises(MisconfigurationException, match=r"val_check_interval\)=0.33.*check_val_every_n_epoch"):
                trainer.fit(model)
            return
        trainer.fit(model)
        assert model.train_epoch_calls == max_epochs
        assert model.val_epoch_calls == max_epochs * denominator

    SUITE.add(f"test_val_check_interval[{denominator}-{max_epochs}]",
              f"trainer/flags/test_val_check_interval.py::test_val_check_interval[{denominator}-{max_epochs}]",
              "refused" if denominator != 1 else "passes", ("nccl_cadence", "cpu_async"), val_check_interval_case,
              "val_check_interval other than 1.0 is refused in setup: use check_val_every_n_epoch"
              if denominator != 1 else "")


for max_epochs, expected_val_loop_calls, expected_val_batches in ((1, 0, [0]), (4, 2, [0, 2, 0, 2]),
                                                                   (5, 2, [0, 2, 0, 2, 0])):

    def check_val_every_n_epoch_case(ctx: Context, max_epochs=max_epochs, expected_calls=expected_val_loop_calls,
                                     expected_batches=expected_val_batches) -> None:
        class TestModel(SizedBoringModel):
            val_epoch_calls = 0
            val_batches: list[int] = []

            def on_train_epoch_end(self, *args: Any, **kwargs: Any) -> None:
                self.val_batches.append(self.trainer.progress_bar_callback.total_val_batches)

            def on_validation_epoch_start(self) -> None:
                self.val_epoch_calls += 1

        model = TestModel(train=8)
        model.val_batches = []
        trainer = ctx.trainer(max_epochs=max_epochs, num_sanity_val_steps=0, limit_val_batches=2,
                              check_val_every_n_epoch=2, logger=False, enable_progress_bar=True)
        trainer.fit(model)
        assert trainer.state.finished, f"Training failed with {trainer.state}"
        assert model.val_epoch_calls == expected_calls
        assert model.val_batches == expected_batches

    params = f"{max_epochs}-{expected_val_loop_calls}-{expected_val_batches}".replace(" ", "")
    SUITE.add(f"test_check_val_every_n_epoch[{params}]",
              f"trainer/flags/test_check_val_every_n_epoch.py::test_check_val_every_n_epoch[{params}]", "passes",
              MODES if max_epochs == 5 else ("nccl_cadence",), check_val_every_n_epoch_case)


def tracked(model: Any) -> mock.Mock:
    tracker = mock.Mock()
    for name in ("train_dataloader", "val_dataloader", "test_dataloader"):
        setattr(model, name, mock.Mock(wraps=getattr(model, name)))
        tracker.attach_mock(getattr(model, name), name)
    return tracker


@SUITE.case(DL + "test_dataloaders_load_only_once")
def test_dataloaders_load_only_once(ctx: Context) -> None:
    model = SizedBoringModel(train=19)  # Lightning: limit_train_batches=0.3 of 64
    tracker = tracked(model)
    trainer = ctx.trainer(limit_val_batches=0.3, max_epochs=3)
    trainer.fit(model)
    model.train_dataloader.assert_called_once()
    model.val_dataloader.assert_called_once()
    model.test_dataloader.assert_not_called()
    assert tracker.mock_calls == [mock.call.val_dataloader(), mock.call.train_dataloader()]


@SUITE.case(DL + "test_dataloaders_load_only_once_no_sanity_check")
def test_dataloaders_load_only_once_no_sanity_check(ctx: Context) -> None:
    model = SizedBoringModel(train=19)
    trainer = ctx.trainer(limit_val_batches=0.3, num_sanity_val_steps=0, max_epochs=3)
    tracker = tracked(model)
    trainer.fit(model)
    assert tracker.mock_calls == [mock.call.train_dataloader(), mock.call.val_dataloader()]


RELOAD = [
    (0, 1, 1, list(range(10)), list(range(10)), list(range(10))),
    (1, 1, 2, [0, 2, 4, 6, 8], [2, 4, 6, 8], list(range(10))),
    (0, 3, 4, [0, 4, 8], [2, 8], [2, 5, 8]),
    (1, 2, 1, list(range(10)), [1, 3, 5, 7, 9], [1, 3, 5, 7, 9]),
    (1, 5, 2, [0, 2, 4, 6, 8], [4, 9], [4, 9]),
]
for index, (sanity, every_n, reload_n, train_expect, val_expect, step_expect) in enumerate(RELOAD):

    def reload_case(ctx: Context, sanity=sanity, every_n=every_n, reload_n=reload_n, train_expect=train_expect,
                    val_expect=val_expect, step_expect=step_expect) -> None:
        sanity_val_check_epochs: list[int] = []
        train_reload_epochs: list[int] = []
        val_reload_epochs: list[int] = []
        sanity_val_step_epochs: list[int] = []
        val_step_epochs: list[int] = []

        class TestModel(SizedBoringModel):
            def train_dataloader(self) -> DataLoader:
                train_reload_epochs.append(self.current_epoch)
                return super().train_dataloader()

            def val_dataloader(self) -> DataLoader:
                (sanity_val_check_epochs if self.trainer.sanity_checking else val_reload_epochs).append(
                    self.current_epoch)
                return super().val_dataloader()

            def validation_step(self, *args: Any, **kwargs: Any) -> Any:
                (sanity_val_step_epochs if self.trainer.sanity_checking else val_step_epochs).append(
                    self.current_epoch)
                return super().validation_step(*args, **kwargs)

        trainer = ctx.trainer(limit_val_batches=1, check_val_every_n_epoch=every_n,
                              reload_dataloaders_every_n_epochs=reload_n, max_epochs=10,
                              num_sanity_val_steps=sanity)
        trainer.fit(TestModel(train=2))  # Lightning: limit_train_batches=1 on one device
        assert sanity_val_check_epochs == sanity_val_step_epochs == ([0] if sanity else [])
        assert train_reload_epochs == train_expect
        assert val_reload_epochs == val_expect
        assert val_step_epochs == step_expect
        assert trainer.strategy.progress.cohort_step == 20  # every epoch's data trained once, reloaded or not

    params = f"{sanity}-{every_n}-{reload_n}"
    SUITE.add(f"test_dataloaders_load_every_n_epochs_infrequent_val[{params}]",
              DL + f"test_dataloaders_load_every_n_epochs_infrequent_val[{params}-...]", "passes",
              MODES if index == 1 else ("nccl_cadence",), reload_case)


@SUITE.case(DL + "test_dataloaders_load_every_epoch_no_sanity_check", modes=MODES)
def test_dataloaders_load_every_epoch_no_sanity_check(ctx: Context) -> None:
    class TestModel(SizedBoringModel):
        def validation_step(self, batch: Any, batch_idx: int) -> Any:
            self.log("dummy_val", 5.0)
            return super().validation_step(batch, batch_idx)

    model = TestModel(train=19)
    checkpoint_callback = ModelCheckpoint(monitor="dummy_val", save_top_k=1)
    trainer = ctx.trainer(limit_val_batches=0.3, num_sanity_val_steps=0, reload_dataloaders_every_n_epochs=1,
                          max_epochs=3, callbacks=[checkpoint_callback])
    tracker = tracked(model)
    trainer.fit(model)
    trainer.test(model)
    call = mock.call
    assert tracker.mock_calls == [call.train_dataloader(), call.val_dataloader()] * 3 + [call.test_dataloader()]


@SUITE.case(DL + "test_dataloaders_load_every_n_epochs_frequent_val", "refused",
            note="val_check_interval other than 1.0 is refused in setup: use check_val_every_n_epoch")
def test_dataloaders_load_every_n_epochs_frequent_val(ctx: Context) -> None:
    trainer = ctx.trainer(limit_val_batches=0.3, val_check_interval=0.3, reload_dataloaders_every_n_epochs=1,
                          max_epochs=3)
    with ctx.raises(MisconfigurationException, match=r"val_check_interval\)=0.3.*check_val_every_n_epoch"):
        trainer.fit(SizedBoringModel(train=19))


@SUITE.case(DL + "test_multiple_eval_dataloader[None]")
def test_multiple_eval_dataloader(ctx: Context) -> None:
    class MultiEvalDataLoaderModel(SizedBoringModel):
        def val_dataloader(self) -> list[DataLoader]:
            return [DataLoader(RandomDataset(32, 64)), DataLoader(RandomDataset(32, 64))]

        def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
            output = self.layer(batch)
            loss = self.loss(output)
            self.log(f"val_loss_{dataloader_idx}", loss, sync_dist=True)
            return loss

    model = MultiEvalDataLoaderModel(train=16)
    trainer = ctx.trainer(max_epochs=1, limit_val_batches=10)
    trainer.fit(model)
    results = trainer.validate(model)
    assert len(results) == 2
    assert {"val_loss_0/dataloader_idx_0", "val_loss_1/dataloader_idx_1"} <= set(trainer.callback_metrics)


class CustomPredictionWriter(BasePredictionWriter):
    write_on_batch_end_called = False
    write_on_epoch_end_called = False

    def write_on_batch_end(self, *args: Any, **kwargs: Any) -> None:
        assert not self.write_on_epoch_end_called
        self.write_on_batch_end_called = True

    def write_on_epoch_end(self, *args: Any) -> None:
        assert not self.write_on_batch_end_called
        self.write_on_epoch_end_called = True


class PredictData(LightningDataModule):
    def predict_dataloader(self) -> list[DataLoader]:
        return [DataLoader(RandomDataset(32, 2)), DataLoader(RandomDataset(32, 2))]


for datamodule in (False, True):

    def predict_case(ctx: Context, datamodule=datamodule) -> None:
        model = SizedBoringModel(train=4)
        cb, cb_1 = CustomPredictionWriter("batch"), CustomPredictionWriter("epoch")
        trainer = ctx.trainer(max_epochs=1, log_every_n_steps=1, callbacks=[cb, cb_1], enable_progress_bar=True)
        trainer.fit(model)  # a fit first, so that predict runs where ElChe trained
        loaders = PredictData().predict_dataloader()
        results = trainer.predict(model, datamodule=PredictData()) if datamodule else \
            trainer.predict(model, dataloaders=loaders)
        assert cb.write_on_batch_end_called and not cb.write_on_epoch_end_called
        assert not cb_1.write_on_batch_end_called and cb_1.write_on_epoch_end_called
        assert len(results) == 2
        assert len(results[0]) == 1  # Lightning: 1 per rank under DDP (2 samples, 2 ranks)
        assert results[0][0].shape == torch.Size([1, 2])

    SUITE.add(f"test_trainer_predict_cpu[{datamodule}]", TT + f"test_trainer_predict_cpu[True-{datamodule}]",
              "passes", ("nccl_cadence",), predict_case)


@SUITE.case(TT + "test_disabled_validation", kind="refused",
            note="limit_val_batches=0 works; fast_dev_run is refused in setup: smoke-test with a single-device "
                 "Trainer or max_epochs=1 on a small Subset")
def test_disabled_validation(ctx: Context) -> None:
    class CurrentModel(SizedBoringModel):
        validation_step_invoked = False

        def validation_step(self, *args: Any, **kwargs: Any) -> Any:
            self.validation_step_invoked = True
            return super().validation_step(*args, **kwargs)

    model = CurrentModel(train=26)  # Lightning: limit_train_batches=0.4 of 64
    trainer = ctx.trainer(max_epochs=2, limit_val_batches=0.0)
    trainer.fit(model)
    assert trainer.state.finished, f"Training failed with {trainer.state}"
    assert trainer.current_epoch == 2
    assert not model.validation_step_invoked, "`validation_step` should not run when `limit_val_batches=0`"
    trainer = ctx.trainer(max_epochs=2, limit_val_batches=0.0, fast_dev_run=True)
    with ctx.raises(MisconfigurationException, match=r"fast_dev_run\)=True.*single-device Trainer"):
        trainer.fit(CurrentModel(train=26))


for max_steps, max_epochs, global_step in ((10, 5, 10), (20, None, 20)):

    def repeated_fit_case(ctx: Context, max_steps=max_steps, max_epochs=max_epochs, global_step=global_step) -> None:
        train_data = DataLoader(RandomDataset(32, 200), batch_size=10)
        trainer = ctx.trainer(max_steps=max_steps, max_epochs=max_epochs)
        rounds = LastRounds()
        trainer.callbacks.append(rounds)
        trainer.fit(SizedBoringModel(), train_data)
        cohort = trainer.strategy.progress.cohort_step
        assert_stopped_at_the_budget(trainer, rounds, max_steps)  # Lightning: trainer.global_step == global_step
        assert global_step <= cohort
        trainer.fit(SizedBoringModel(), train_data)
        # The cohort step continues over the second fit (as Lightning's global_step): its budget is spent.
        assert trainer.strategy.progress.cohort_step == cohort

    SUITE.add(f"test_repeated_fit_calls_with_max_epochs_and_steps[{max_steps}-{max_epochs}]",
              TT + f"test_repeated_fit_calls_with_max_epochs_and_steps[{max_steps}-{max_epochs}-{global_step}]",
              "deviation", MODES if max_epochs is None else ("nccl_cadence",), repeated_fit_case,
              "max_steps counts the cohort's steps and stops at the first round that reaches it")


@SUITE.case(TT + "test_trainer_metrics_reset_before_each_task")
def test_trainer_metrics_reset_before_each_task(ctx: Context) -> None:
    class TestMetricRestartCallback(Callback):
        def _make_assertions(self, trainer: Trainer) -> None:
            assert trainer.callback_metrics == {}
            assert trainer.progress_bar_metrics == {}
            assert trainer.logged_metrics == {}

        def on_train_start(self, trainer: Trainer, *args: Any, **kwargs: Any) -> None:
            self._make_assertions(trainer)

        def on_validation_start(self, trainer: Trainer, *args: Any, **kwargs: Any) -> None:
            if trainer.state.fn == TrainerFn.VALIDATING:
                self._make_assertions(trainer)

        def on_test_start(self, trainer: Trainer, *args: Any, **kwargs: Any) -> None:
            self._make_assertions(trainer)

        def on_predict_start(self, trainer: Trainer, *args: Any, **kwargs: Any) -> None:
            self._make_assertions(trainer)

    class CustomBoringModel(SizedBoringModel):
        def training_step(self, *args: Any, **kwargs: Any) -> Any:
            self.log("train/metric", 7.0)
            return super().training_step(*args, **kwargs)

        def validation_step(self, *args: Any, **kwargs: Any) -> Any:
            self.log("val/metric", 14.0)
            return super().validation_step(*args, **kwargs)

        def test_step(self, *args: Any, **kwargs: Any) -> Any:
            self.log("test/metric", 21.0)
            return super().test_step(*args, **kwargs)

    model = CustomBoringModel(train=8)  # Lightning: fast_dev_run=4 (refused): 4 batches of each kind
    trainer = ctx.trainer(max_epochs=1, limit_val_batches=4, limit_test_batches=4, limit_predict_batches=4,
                          callbacks=[TestMetricRestartCallback()])
    trainer.fit(model)
    trainer.validate(model)
    trainer.test(model)
    trainer.predict(model)


@SUITE.case(TT + "test_gradient_clipping_by_norm[32-true]")
def test_gradient_clipping_by_norm(ctx: Context) -> None:
    norms: list[float] = []

    class TestModel(ClassificationModel):
        def configure_gradient_clipping(self, *args: Any, **kwargs: Any) -> None:
            super().configure_gradient_clipping(*args, **kwargs)
            grad_norm = torch.norm(torch.stack([torch.norm(p.grad.detach(), 2) for p in self.parameters()]), 2)
            norms.append(float(grad_norm))

    # Lightning clips to 0.05 for max_steps=1; the first gradients of this demo model (not Lightning's) are
    # smaller than that, and under ElChe the cohort's first window takes more than one step (later gradients
    # may be below the clip value: they stay unchanged).
    trainer = ctx.trainer(max_steps=1, max_epochs=1, gradient_clip_algorithm="norm", gradient_clip_val=0.001)
    trainer.fit(TestModel(), ClassifDataModule())
    assert norms, "configure_gradient_clipping was not called"
    torch.testing.assert_close(torch.tensor(norms[0]), torch.tensor(0.001))  # each rank clips its own gradients
    assert max(norms) <= 0.001 + 1e-6, norms
