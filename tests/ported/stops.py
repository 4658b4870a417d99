"""Stops and steps: Lightning's ``callbacks/test_early_stopping.py``, ``callbacks/test_timer.py``, the
``max_steps`` / ``min_epochs`` tests of ``trainer/test_trainer.py`` and ``trainer/flags/``, on 2 ElChe ranks.

Under ElChe ``max_steps`` counts the cohort's steps (all ranks'), and a fit stops at the first round
at which the cohort step reaches it; ``trainer.global_step`` is each rank's own count. EarlyStopping
and Timer decide at epoch ends on values every rank shares (rank 0's metrics; the Timer broadcasts).
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any, Optional
from unittest import mock

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint, Timer
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from ported.harness import MODES, Context, Suite
from ported.models import ClassifDataModule, ClassificationModel, ScheduledValues, SizedBoringModel, same_on_every_rank

SUITE = Suite("stops")
ES = "callbacks/test_early_stopping.py::"
TT = "trainer/test_trainer.py::"


def cohort_sum(value: int) -> int:
    gathered: list[Optional[int]] = [None, None]
    dist.all_gather_object(gathered, value)
    return sum(v or 0 for v in gathered)


class LastRounds(Callback):
    """Records every round's cohort step and the steps of its window (a round listener)."""

    def __init__(self) -> None:
        self.rounds: list[tuple[int, int]] = []

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            trainer.strategy.add_round_listener(self._on_round)

    def _on_round(self, outcome: Any, metrics: dict[str, float]) -> None:
        self.rounds.append((outcome.cohort_step, sum(r.steps for r in outcome.reports)))

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            trainer.strategy.remove_round_listener(self._on_round)


def assert_stopped_at_the_budget(trainer: Trainer, rounds: LastRounds, max_steps: int) -> None:
    """ElChe's bound for ``max_steps`` (docs/compatibility.md): the fit stops at the first round at which
    the cohort step reaches ``max_steps``, so it ends less than that round's window past it."""
    final = trainer.strategy.progress.cohort_step
    before, window = final - rounds.rounds[-1][1], rounds.rounds[-1][1]
    assert rounds.rounds[-1][0] == final
    assert before < max_steps <= final < max_steps + window, (before, final, window, max_steps)


class EarlyStoppingTestRestore(EarlyStopping):
    def __init__(self, expected_state: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.expected_state = expected_state
        self.saved_states: list[dict] = []

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.expected_state:
            assert self.state_dict() == self.expected_state

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        self.saved_states.append(self.state_dict().copy())


@SUITE.case(ES + "test_resume_early_stopping_from_checkpoint", modes=MODES)
def test_resume_early_stopping_from_checkpoint(ctx: Context) -> None:
    model = ClassificationModel()
    dm = ClassifDataModule()
    checkpoint_callback = ModelCheckpoint(dirpath=ctx.tmp_path, monitor="train_loss", save_top_k=1)
    early_stop_callback = EarlyStoppingTestRestore(None, monitor="train_loss")
    trainer = ctx.trainer(callbacks=[early_stop_callback, checkpoint_callback], num_sanity_val_steps=0, max_epochs=4)
    trainer.fit(model, datamodule=dm)
    assert len(early_stop_callback.saved_states) == 4
    same_on_every_rank([{k: float(v) if torch.is_tensor(v) else v for k, v in s.items()}
                        for s in early_stop_callback.saved_states], "EarlyStopping's state")
    checkpoint_filepath = checkpoint_callback.kth_best_model_path
    checkpoint = torch.load(checkpoint_filepath, weights_only=True)
    early_stop_callback_state = early_stop_callback.saved_states[checkpoint["epoch"]]
    es_name = "EarlyStoppingTestRestore{'monitor': 'train_loss', 'mode': 'min'}"
    assert checkpoint["callbacks"][es_name] == early_stop_callback_state
    early_stop_callback = EarlyStoppingTestRestore(early_stop_callback_state, monitor="train_loss")
    new_trainer = ctx.trainer(max_epochs=1, callbacks=[early_stop_callback])
    with ctx.raises(MisconfigurationException, match=r"You restored a checkpoint with current_epoch"):
        new_trainer.fit(model, datamodule=dm, ckpt_path=checkpoint_filepath)


@SUITE.case(ES + "test_early_stopping_no_extraneous_invocations")
def test_early_stopping_no_extraneous_invocations(ctx: Context) -> None:
    model = ClassificationModel()
    dm = ClassifDataModule(train=64)  # Lightning: limit_train_batches=4 (of 16)
    early_stop_callback = EarlyStopping(monitor="train_loss")
    early_stop_callback._run_early_stopping_check = mock.Mock()
    trainer = ctx.trainer(callbacks=[early_stop_callback], limit_val_batches=4, max_epochs=4,
                          enable_checkpointing=False)
    trainer.fit(model, datamodule=dm)
    assert trainer.early_stopping_callback == early_stop_callback
    assert trainer.early_stopping_callbacks == [early_stop_callback]
    assert early_stop_callback._run_early_stopping_check.call_count == 4


PATIENCE = [([6, 5, 5, 5, 5, 5], 3, 4), ([6, 5, 4, 4, 3, 3], 1, 3), ([6, 5, 6, 5, 5, 5], 3, 4)]

for index, (loss_values, patience, expected_stop_epoch) in enumerate(PATIENCE):

    def patience_case(ctx: Context, loss_values=loss_values, patience=patience, expected=expected_stop_epoch) -> None:
        model = ScheduledValues(loss_values, "test_val_loss", train=16)
        early_stop_callback = EarlyStopping(monitor="test_val_loss", patience=patience, verbose=True)
        trainer = ctx.trainer(callbacks=[early_stop_callback], num_sanity_val_steps=0, max_epochs=10)
        trainer.fit(model)
        assert trainer.current_epoch - 1 == expected
        assert trainer.strategy.progress.cohort_step == 16 * (expected + 1)  # every rank stopped at that epoch

    params = f"{loss_values}-{patience}-{expected_stop_epoch}".replace(" ", "")
    SUITE.add(f"test_early_stopping_patience[{params}]", ES + f"test_early_stopping_patience[{params}]", "passes",
              MODES if index == 0 else ("nccl_cadence",), patience_case)

for validation_step_none in (True, False):

    def patience_train_case(ctx: Context, validation_step_none=validation_step_none) -> None:
        loss_values, patience, expected_stop_epoch = PATIENCE[1]

        class ModelOverrideTrainReturn(SizedBoringModel):
            train_return_values = torch.tensor(loss_values)

            def on_train_epoch_end(self) -> None:
                self.log("train_loss", self.train_return_values[self.current_epoch])

        model = ModelOverrideTrainReturn(train=16)
        if validation_step_none:
            model.validation_step = None
        early_stop_callback = EarlyStopping(monitor="train_loss", patience=patience, verbose=True,
                                            check_on_train_epoch_end=True)
        trainer = ctx.trainer(callbacks=[early_stop_callback], num_sanity_val_steps=0, max_epochs=10)
        trainer.fit(model)
        assert trainer.current_epoch - 1 == expected_stop_epoch

    SUITE.add(f"test_early_stopping_patience_train[{validation_step_none}]",
              ES + f"test_early_stopping_patience_train[{validation_step_none}-[6,5,4,4,3,3]-1-3]", "passes",
              MODES if validation_step_none else ("nccl_cadence",), patience_train_case)


@SUITE.case(ES + "test_early_stopping_no_val_step", modes=MODES)
def test_early_stopping_no_val_step(ctx: Context) -> None:
    model = ClassificationModel()
    dm = ClassifDataModule(train=48)  # Lightning: overfit_batches=0.20 (refused under ElChe: fit on a subset)
    model.validation_step = None
    model.val_dataloader = None
    stopping = EarlyStopping(monitor="train_loss", min_delta=0.1, patience=0, check_on_train_epoch_end=True)
    trainer = ctx.trainer(callbacks=[stopping], max_epochs=10)
    trainer.fit(model, datamodule=dm)
    assert trainer.state.finished, f"Training failed with {trainer.state}"
    assert trainer.current_epoch < trainer.max_epochs - 1


THRESHOLDS = [(None, None, [8, 4, 2, 3, 4, 5, 8, 10], 5), (2.9, None, [9, 8, 7, 6, 5, 6, 4, 3, 2, 1], 8),
              (None, 15.9, [9, 4, 2, 16, 32, 64], 3)]
for stopping_threshold, divergence_threshold, losses, expected_epoch in THRESHOLDS:

    def thresholds_case(ctx: Context, stopping_threshold=stopping_threshold,
                        divergence_threshold=divergence_threshold, losses=losses, expected=expected_epoch) -> None:
        model = ScheduledValues(losses, "abc", train=13)  # Lightning: limit_train_batches=0.2 of 64
        early_stopping = EarlyStopping(monitor="abc", stopping_threshold=stopping_threshold,
                                       divergence_threshold=divergence_threshold)
        trainer = ctx.trainer(callbacks=[early_stopping], limit_val_batches=0.2, max_epochs=20)
        trainer.fit(model)
        assert trainer.current_epoch - 1 == expected, "early_stopping failed"

    params = f"{stopping_threshold}-{divergence_threshold}-{expected_epoch}"
    SUITE.add(f"test_early_stopping_thresholds[{params}]", ES + f"test_early_stopping_thresholds[{params}]",
              "passes", ("nccl_cadence", "cpu_async"), thresholds_case)

for stop_value in ("inf", "nan"):

    def non_finite_case(ctx: Context, stop_value=stop_value) -> None:
        losses = [4, 3, float(stop_value), 2, 1]
        model = ScheduledValues(losses, "val_loss", train=13)
        early_stopping = EarlyStopping(monitor="val_loss", check_finite=True)
        trainer = ctx.trainer(callbacks=[early_stopping], limit_val_batches=0.2, max_epochs=10)
        trainer.fit(model)
        assert trainer.current_epoch - 1 == 2
        assert early_stopping.stopped_epoch == 2

    SUITE.add(f"test_early_stopping_on_non_finite_monitor[{stop_value}]",
              ES + f"test_early_stopping_on_non_finite_monitor[tensor({stop_value})]", "passes",
              MODES if stop_value == "nan" else ("nccl_cadence",), non_finite_case)

for limit_train_batches, min_epochs, min_steps, stop_step in ((3, 2, 0, 6), (5, 2, 0, 10), (3, 0, 10, 10)):

    def min_epochs_case(ctx: Context, limit=limit_train_batches, min_epochs=min_epochs, min_steps=min_steps,
                        stop_step=stop_step) -> None:
        class TestModel(SizedBoringModel):
            def training_step(self, batch: Any, batch_idx: int) -> Any:
                self.log("foo", batch_idx)
                return super().training_step(batch, batch_idx)

        es_callback = EarlyStopping("foo")
        trainer = ctx.trainer(callbacks=es_callback, limit_val_batches=0, min_epochs=min_epochs, min_steps=min_steps,
                              logger=False, enable_checkpointing=False)
        expected_epochs = max(math.ceil(min_steps / limit), min_epochs)
        if min_steps:
            with ctx.raises(MisconfigurationException, match=r"Trainer\(min_steps\)=10.*Use min_epochs instead"):
                trainer.fit(TestModel(train=limit))
            return
        with mock.patch.object(es_callback, "_evaluate_stopping_criteria", side_effect=[(True, "")] * expected_epochs):
            trainer.fit(TestModel(train=limit))
        assert trainer.should_stop
        assert trainer.current_epoch == expected_epochs
        assert trainer.strategy.progress.cohort_step == stop_step  # Lightning: trainer.global_step

    params = f"{limit_train_batches}-{min_epochs}-{min_steps}-{stop_step}"
    SUITE.add(f"test_min_epochs_min_steps_global_step[{params}]",
              ES + f"test_min_epochs_min_steps_global_step[{params}]", "refused" if min_steps else "passes",
              MODES if (min_epochs, limit_train_batches) == (2, 3) else ("nccl_cadence",), min_epochs_case,
              "min_steps is refused in setup: use min_epochs" if min_steps else "")


class EarlyStoppingModel(SizedBoringModel):
    def __init__(self, expected_end_epoch: int, early_stop_on_train: bool,
                 dist_diverge_epoch: Optional[int] = None) -> None:
        super().__init__(train=7)  # Lightning: limit_train_batches=0.1 of 64
        self.expected_end_epoch = expected_end_epoch
        self.early_stop_on_train = early_stop_on_train
        self.dist_diverge_epoch = dist_diverge_epoch

    def _epoch_end(self) -> None:
        losses = [8, 4, 2, 3, 4, 5, 8, 10]
        diverge = (self.dist_diverge_epoch and self.current_epoch >= self.dist_diverge_epoch
                   and self.trainer.global_rank == 0)
        self.log("abc", torch.tensor(10 if diverge else losses[self.current_epoch]))
        self.log("cba", torch.tensor(0))

    def on_train_epoch_end(self) -> None:
        if self.early_stop_on_train:
            self._epoch_end()

    def on_validation_epoch_end(self) -> None:
        if not self.early_stop_on_train:
            self._epoch_end()

    def on_train_end(self) -> None:
        assert self.trainer.current_epoch - 1 == self.expected_end_epoch, "Early Stopping Failed"


MULTIPLE = [
    ("abc+cba3", lambda: [EarlyStopping("abc"), EarlyStopping("cba", patience=3)], 3, False, None),
    ("cba3+abc", lambda: [EarlyStopping("cba", patience=3), EarlyStopping("abc")], 3, False, None),
    ("abc1+cba-diverge", lambda: [EarlyStopping("abc", patience=1), EarlyStopping("cba")], 2, False, 2),
    ("abc+cba3-train", lambda: [EarlyStopping("abc", check_on_train_epoch_end=True),
                                EarlyStopping("cba", patience=3, check_on_train_epoch_end=True)], 3, True, None),
]
for name, make_callbacks, expected_stop_epoch, on_train, diverge in MULTIPLE:

    def multiple_case(ctx: Context, make_callbacks=make_callbacks, expected=expected_stop_epoch, on_train=on_train,
                      diverge=diverge) -> None:
        model = EarlyStoppingModel(expected, on_train, dist_diverge_epoch=diverge)
        trainer = ctx.trainer(callbacks=make_callbacks(), limit_val_batches=0.1, max_epochs=20)
        trainer.fit(model)  # on_train_end asserts the epoch

    SUITE.add(f"test_multiple_early_stopping_callbacks[{name}]", ES + f"test_multiple_early_stopping_callbacks[{name}]",
              "passes", MODES if diverge else ("nccl_cadence",), multiple_case)


@SUITE.case(ES + "test_check_on_train_epoch_end_smart_handling[check_val_every_n_epoch]")
def test_check_on_train_epoch_end_smart_handling(ctx: Context) -> None:
    class TestModel(SizedBoringModel):
        def validation_step(self, batch: Any, batch_idx: int) -> Any:
            self.log("foo", 1)
            return super().validation_step(batch, batch_idx)

    trainer = ctx.trainer(limit_val_batches=1, callbacks=EarlyStopping(monitor="foo"), check_val_every_n_epoch=2,
                          max_epochs=5)
    side_effect = [(False, "A"), (True, "B")]
    with mock.patch("lightning.pytorch.callbacks.EarlyStopping._evaluate_stopping_criteria",
                    side_effect=side_effect) as es_mock:
        trainer.fit(TestModel(train=8))
    assert es_mock.call_count == len(side_effect)
    assert trainer.current_epoch == len(side_effect) * trainer.check_val_every_n_epoch


@SUITE.case(ES + "test_check_on_train_epoch_end_smart_handling[val_check_interval]", "refused",
            name="test_check_on_train_epoch_end_smart_handling[val_check_interval]",
            note="val_check_interval other than 1.0 is refused in setup: use check_val_every_n_epoch")
def test_check_on_train_epoch_end_smart_handling_inside_epochs(ctx: Context) -> None:
    trainer = ctx.trainer(limit_val_batches=1, callbacks=EarlyStopping(monitor="foo"), val_check_interval=0.3,
                          max_epochs=10)
    with ctx.raises(MisconfigurationException, match=r"val_check_interval\)=0.3.*check_val_every_n_epoch"):
        trainer.fit(SizedBoringModel(train=10))


@SUITE.case(TT + "test_trainer_min_steps_and_min_epochs_not_reached", modes=MODES, kind="deviation",
            note="a stop requested before min_epochs is met is held by ElChe as a pending request, so "
                 "trainer.should_stop reads False in the training steps until then (Lightning leaves it True); "
                 "the fit stops at the same epoch")
def test_trainer_min_steps_and_min_epochs_not_reached(ctx: Context) -> None:
    class TestModel(SizedBoringModel):
        training_step_invoked = 0

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            output = super().training_step(batch, batch_idx)
            output["loss"] = output["loss"] * 0.0  # force minimal loss to trigger early stopping
            self.log("loss", output["loss"])
            self.training_step_invoked += 1
            return output

    model = TestModel(train=2)
    min_epochs = 5
    trainer = ctx.trainer(min_epochs=min_epochs, limit_val_batches=0,
                          callbacks=[EarlyStopping(monitor="loss", patience=0, check_on_train_epoch_end=True)])
    trainer.fit(model)
    assert cohort_sum(model.training_step_invoked) == min_epochs * 2
    assert trainer.current_epoch == min_epochs


@SUITE.case(TT + "test_trainer_max_steps_and_epochs", modes=MODES, kind="deviation",
            note="max_steps counts the cohort's steps; a fit stopped inside an epoch ends at the first round at "
                 "which the cohort step reaches max_steps (less than one window past it), without validating there")
def test_trainer_max_steps_and_epochs(ctx: Context) -> None:
    num_train_samples = 32  # Lightning: limit_train_batches=0.5 of 64
    kwargs = {"max_epochs": 3, "max_steps": num_train_samples + 10, "logger": False}
    rounds = LastRounds()
    trainer = ctx.trainer(**kwargs, callbacks=[rounds])
    trainer.fit(SizedBoringModel(train=num_train_samples))
    assert trainer.state.finished, f"Training failed with {trainer.state}"
    assert_stopped_at_the_budget(trainer, rounds, trainer.max_steps)  # Lightning: global_step == max_steps
    kwargs.update(max_epochs=2, max_steps=3 * 2 * num_train_samples)
    trainer = ctx.trainer(**kwargs)
    trainer.fit(SizedBoringModel(train=num_train_samples))
    assert trainer.strategy.progress.cohort_step == num_train_samples * trainer.max_epochs
    assert trainer.current_epoch == trainer.max_epochs, "Model did not stop at max_epochs"
    kwargs.update(max_epochs=-1, max_steps=3)
    rounds = LastRounds()
    trainer = ctx.trainer(**kwargs, callbacks=[rounds])
    trainer.fit(SizedBoringModel(train=num_train_samples))
    assert_stopped_at_the_budget(trainer, rounds, 3)


@SUITE.case(TT + "test_trainer_max_steps_accumulate_batches", kind="deviation",
            note="max_steps counts the cohort's optimizer steps (each rank accumulates its own batches)")
def test_trainer_max_steps_accumulate_batches(ctx: Context) -> None:
    num_train_samples = 32
    rounds = LastRounds()
    trainer = ctx.trainer(max_steps=num_train_samples + 10, accumulate_grad_batches=10, logger=False,
                          callbacks=[rounds])
    trainer.fit(SizedBoringModel(train=num_train_samples))
    assert trainer.state.finished, f"Training failed with {trainer.state}"
    assert_stopped_at_the_budget(trainer, rounds, trainer.max_steps)


@SUITE.case("trainer/flags/test_check_val_every_n_epoch.py::test_check_val_every_n_epoch_with_max_steps", modes=MODES)
def test_check_val_every_n_epoch_with_max_steps(ctx: Context) -> None:
    data_samples_train, check_val_every_n_epoch, max_epochs = 2, 3, 4

    class TestModel(SizedBoringModel):
        def __init__(self) -> None:
            super().__init__(train=data_samples_train)
            self.validation_called_at_step: set[int] = set()

        def validation_step(self, *args: Any) -> Any:
            self.validation_called_at_step.add(self.global_step)
            return super().validation_step(*args)

    trainer = ctx.trainer(max_steps=data_samples_train * max_epochs, check_val_every_n_epoch=check_val_every_n_epoch,
                          num_sanity_val_steps=0)
    model = TestModel()
    trainer.fit(model)
    assert trainer.current_epoch == max_epochs
    assert trainer.strategy.progress.cohort_step == max_epochs * data_samples_train  # Lightning: global_step
    assert len(model.validation_called_at_step) == 1  # the one validation, at epoch 2's end


MIN_MAX = [(None, 3, None, -1), (None, None, None, 20), (None, 3, None, 20), (1, None, None, 20), (None, None, 10, 20)]
for min_epochs, max_epochs, min_steps, max_steps in MIN_MAX:

    def min_max_case(ctx: Context, min_epochs=min_epochs, max_epochs=max_epochs, min_steps=min_steps,
                     max_steps=max_steps) -> None:
        rounds = LastRounds()
        trainer = ctx.trainer(min_epochs=min_epochs, max_epochs=max_epochs, min_steps=min_steps, max_steps=max_steps,
                              callbacks=[rounds])
        if min_steps:
            with ctx.raises(MisconfigurationException, match=r"Trainer\(min_steps\)=10.*Use min_epochs instead"):
                trainer.fit(SizedBoringModel())
            return
        trainer.fit(SizedBoringModel())
        if trainer.max_steps and not trainer.max_epochs:
            assert_stopped_at_the_budget(trainer, rounds, trainer.max_steps)  # Lightning: global_step == max_steps

    params = f"{min_epochs}-{max_epochs}-{min_steps}-{max_steps}"
    SUITE.add(f"test_min_max_steps_epochs[{params}]", "trainer/flags/test_min_max_epochs.py::"
              f"test_min_max_steps_epochs[{params}]", "refused" if min_steps else "passes",
              MODES if (max_epochs, max_steps) == (None, 20) and min_epochs is None and not min_steps
              else ("nccl_cadence",), min_max_case,
              "min_steps is refused in setup: use min_epochs" if min_steps else "")


TIMER = "callbacks/test_timer.py::"


@SUITE.case(TIMER + "test_trainer_flag", "refused", note="max_time is refused in setup: use max_epochs or "
            "Timer(duration, interval='epoch')")
def test_trainer_flag(ctx: Context) -> None:
    trainer = ctx.trainer(logger=False, max_time={"seconds": 1337})
    with ctx.raises(MisconfigurationException, match=r"max_time\) / Timer\(interval='step'\).*interval='epoch'"):
        trainer.fit(SizedBoringModel(train=8))


@SUITE.case(TIMER + "test_timer_stops_training", modes=MODES)
def test_timer_stops_training(ctx: Context) -> None:
    timer = Timer(duration=timedelta(milliseconds=100), interval="epoch")  # Lightning: interval="step"
    trainer = ctx.trainer(max_epochs=1000, callbacks=[timer])
    trainer.fit(SizedBoringModel(train=16))
    assert trainer.global_step > 1
    assert trainer.current_epoch < 999
    same_on_every_rank(trainer.current_epoch, "the epoch the timer stopped")


for interval in ("step", "epoch"):

    def zero_duration_case(ctx: Context, interval=interval) -> None:
        timer = Timer(duration=timedelta(0), interval=interval)
        trainer = ctx.trainer(callbacks=[timer])
        if interval == "step":
            with ctx.raises(MisconfigurationException, match=r"Timer\(interval='step'\).*interval='epoch'"):
                trainer.fit(SizedBoringModel())
            return
        trainer.fit(SizedBoringModel())  # the timer checks at the start of fit too: nothing trains
        assert trainer.global_step == 0
        assert trainer.current_epoch == 0
        assert trainer.strategy.progress.cohort_step == 0

    SUITE.add(f"test_timer_zero_duration_stop[{interval}]", TIMER + f"test_timer_zero_duration_stop[{interval}]",
              "refused" if interval == "step" else "passes", ("nccl_cadence", "cpu_async"), zero_duration_case,
              "Timer(interval='step') is refused in setup, even with a zero duration: use interval='epoch'"
              if interval == "step" else "")


@SUITE.case(TIMER + "test_timer_resume_training", kind="deviation",
            note="a resumed trainer.global_step is rank 0's saved count on every rank; the cohort step is restored")
def test_timer_resume_training(ctx: Context) -> None:
    timer = Timer(duration=timedelta(milliseconds=200), interval="epoch")
    checkpoint_callback = ModelCheckpoint(dirpath=ctx.tmp_path, save_top_k=-1)
    trainer = ctx.trainer(max_epochs=100, callbacks=[timer, checkpoint_callback])
    trainer.fit(SizedBoringModel(train=16))
    assert not timer._offset
    assert timer.time_remaining() <= 0
    assert trainer.current_epoch < 99
    saved_cohort_step = trainer.strategy.progress.cohort_step
    timer = Timer(duration=timedelta(milliseconds=200), interval="epoch")
    trainer = ctx.trainer(callbacks=timer)
    trainer.fit(SizedBoringModel(train=16), ckpt_path=checkpoint_callback.best_model_path)
    assert timer._offset > 0
    assert trainer.strategy.progress.cohort_step == saved_cohort_step  # Lightning: global_step == saved_global_step
    assert trainer.global_step == torch.load(checkpoint_callback.best_model_path, weights_only=True)["global_step"]
    same_on_every_rank(trainer.global_step, "the resumed global_step (rank 0's saved count)")
