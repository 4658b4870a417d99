"""Each Trainer setting that cannot work with uneven step counts is refused, naming what to use."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import BatchSizeFinder, LearningRateFinder, ModelCheckpoint, Timer
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from model_helpers import RecordingModel

import lightning_elche  # noqa: F401  (registers the strategy names)
from lightning_elche import ElCheConfig, ElCheMode, ElCheStrategy
from lightning_elche.loop_glue import check_step_schedulers
from lightning_elche.strategy import resolve_config
from lightning_elche.trainer_checks import check_trainer


def attached_trainer(tmp_path, model=None, **kwargs) -> Trainer:
    trainer = Trainer(accelerator="cpu", devices=2, strategy=ElCheStrategy(), logger=False,
                      enable_progress_bar=False, default_root_dir=str(tmp_path), **kwargs)
    model = model or RecordingModel(str(tmp_path))
    trainer.strategy.connect(model)
    model.trainer = trainer
    trainer.strategy.optimizers = [torch.optim.SGD(model.parameters(), lr=0.1)]
    return trainer


def test_a_supported_configuration_passes(tmp_path):
    check_trainer(attached_trainer(tmp_path, max_epochs=3, check_val_every_n_epoch=2,
                                   callbacks=[ModelCheckpoint(every_n_epochs=1), Timer(interval="epoch")]))


@pytest.mark.parametrize(
    ("kwargs", "setting", "instead"),
    [
        ({"min_steps": 10}, "min_steps", "min_epochs"),
        ({"max_time": "00:00:01:00"}, "max_time", "Timer(duration, interval='epoch')"),
        ({"callbacks": [ModelCheckpoint(every_n_train_steps=5)]}, "every_n_train_steps", "every_n_epochs"),
        ({"callbacks": [ModelCheckpoint(train_time_interval=__import__("datetime").timedelta(minutes=1))]},
         "train_time_interval", "every_n_epochs"),
        ({"val_check_interval": 0.5}, "val_check_interval", "check_val_every_n_epoch"),
        ({"val_check_interval": 100, "check_val_every_n_epoch": None}, "val_check_interval", "check_val_every_n_epoch"),
        ({"limit_train_batches": 10}, "limit_train_batches", "Subset"),
        ({"limit_train_batches": 1}, "limit_train_batches)=1: it means 1 batch(es) per rank", "Subset"),
        ({"limit_train_batches": 0.5}, "limit_train_batches)=0.5: it means 50% of each rank's batches", "Subset"),
        ({"fast_dev_run": 5}, "fast_dev_run)=5", "single-device Trainer"),
        ({"fast_dev_run": True}, "fast_dev_run)=True", "single-device Trainer"),
        ({"callbacks": [LearningRateFinder()]}, "Tuner.lr_find", "single-device Trainer"),
        ({"callbacks": [BatchSizeFinder()]}, "Tuner.scale_batch_size", "single-device Trainer"),
        ({"overfit_batches": 2}, "overfit_batches", "Subset"),
        ({"sync_batchnorm": True}, "sync_batchnorm", "running statistics are averaged"),
    ],
)
def test_unsupported_settings_are_refused_with_an_alternative(tmp_path, kwargs, setting, instead):
    trainer = attached_trainer(tmp_path, **kwargs)
    if kwargs.get("sync_batchnorm"):
        trainer.strategy._layer_sync = object()
    with pytest.raises(MisconfigurationException) as info:
        check_trainer(trainer)
    assert setting in str(info.value) and instead in str(info.value)


@pytest.mark.parametrize("kwargs", [{"max_time": {"seconds": 1337}}, {"fast_dev_run": 2}, {"min_steps": 3}])
def test_a_refused_setting_is_refused_before_the_strategy_builds_anything(tmp_path, kwargs):
    # The ported Lightning suite, cpu_async on 2 ranks: refused only after the CPU plane had built its
    # side group, one rank tore that group down while its peer was still connecting to it, and the peer
    # failed with gloo's "Connection closed by peer" instead of the refusal.
    trainer = attached_trainer(tmp_path, **kwargs)
    trainer.state.fn = TrainerFn.FITTING
    with mock.patch("lightning_elche.strategy.build_plane", side_effect=AssertionError("a plane was built")) as build:
        with pytest.raises(MisconfigurationException, match=next(iter(kwargs))):
            trainer.strategy.setup(trainer)
    assert build.call_count == 0 and trainer.strategy._membership is None


def test_fast_dev_run_is_named_not_the_limit_it_implies(tmp_path):
    trainer = attached_trainer(tmp_path, fast_dev_run=5)
    assert trainer.limit_train_batches == 5  # what Lightning turns it into; the message must not say so
    with pytest.raises(MisconfigurationException) as info:
        check_trainer(trainer)
    assert "fast_dev_run" in str(info.value) and "limit_train_batches" not in str(info.value)


def test_the_default_limit_of_the_whole_epoch_passes(tmp_path):
    check_trainer(attached_trainer(tmp_path, limit_train_batches=1.0))


def test_manual_optimization_is_refused(tmp_path):
    model = RecordingModel(str(tmp_path))
    model.automatic_optimization = False
    with pytest.raises(MisconfigurationException, match="automatic_optimization"):
        check_trainer(attached_trainer(tmp_path, model=model))


def test_two_optimizers_are_refused(tmp_path):
    trainer = attached_trainer(tmp_path)
    trainer.strategy.optimizers = trainer.strategy.optimizers * 2
    with pytest.raises(MisconfigurationException, match="2 optimizers"):
        check_trainer(trainer)


@pytest.mark.parametrize(
    ("name", "mode"),
    [("elche", ElCheMode.nccl_cadence), ("elche_nccl_sync", ElCheMode.nccl_sync),
     ("elche_nccl_cadence", ElCheMode.nccl_cadence), ("elche_cpu_async", ElCheMode.cpu_async)],
)
def test_registered_names_build_the_strategy(name, mode):
    assert name in StrategyRegistry
    trainer = Trainer(accelerator="cpu", devices=2, strategy=name, logger=False)
    assert isinstance(trainer.strategy, ElCheStrategy)
    assert trainer.strategy.elche.mode is mode


@pytest.mark.parametrize("name", ["elche_cpu_sync", "elche_cpu_cadence", "elche_cpu_async"])
def test_cpu_mode_names_are_registered(name):
    trainer = Trainer(accelerator="cpu", devices=2, strategy=name, logger=False)
    assert trainer.strategy.elche.mode is ElCheMode(name.removeprefix("elche_"))


def test_mode_and_config_arguments():
    assert resolve_config("nccl_sync", None) == ElCheConfig.nccl_sync()
    assert resolve_config(None, None) == ElCheConfig()
    cfg = ElCheConfig(max_anchor=20)
    assert resolve_config(None, cfg) is cfg and resolve_config("nccl_cadence", cfg) is cfg
    with pytest.raises(ValueError, match="conflicts with elche.mode='nccl_cadence'"):
        ElCheStrategy(mode="nccl_sync", elche=cfg)
    with pytest.raises(ValueError, match="mode='turbo'"):
        ElCheStrategy(mode="turbo")
    with pytest.raises(ValueError, match="chunk_batches=0"):
        ElCheStrategy(chunk_batches=0)
    assert ElCheStrategy(elche=ElCheConfig(divergence_threshold=0.1)).elche.divergence_threshold == 0.1
    with pytest.raises(TypeError, match="outer_optimizer"):
        ElCheStrategy(outer_optimizer="diloco")


def test_strategy_is_picklable_before_fit():
    import pickle

    strategy = pickle.loads(pickle.dumps(ElCheStrategy(mode="nccl_sync")))
    assert strategy.elche.mode is ElCheMode.nccl_sync and strategy.engine is None


def test_a_step_scheduler_with_frequency_other_than_one_is_refused(tmp_path):
    from lightning.pytorch.utilities.types import LRSchedulerConfig

    trainer = attached_trainer(tmp_path)
    optimizer = trainer.strategy.optimizers[0]
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, 10)
    trainer.strategy.lr_scheduler_configs = [LRSchedulerConfig(schedule, interval="step", frequency=2)]
    with pytest.raises(MisconfigurationException, match="frequency=2.*Use frequency=1"):
        check_step_schedulers(trainer)
    trainer.strategy.lr_scheduler_configs = [LRSchedulerConfig(schedule, interval="step", frequency=1)]
    check_step_schedulers(trainer)


@pytest.fixture
def restore_determinism():
    # Trainer(deterministic=...) sets torch's process-wide flags; leave them as the next test expects.
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def deterministic_trainer(tmp_path, deterministic, elche: ElCheConfig) -> Trainer:
    trainer = Trainer(accelerator="cpu", devices=2, strategy=ElCheStrategy(elche=elche), logger=False,
                      enable_progress_bar=False, default_root_dir=str(tmp_path), deterministic=deterministic)
    model = RecordingModel(str(tmp_path))
    trainer.strategy.connect(model)
    model.trainer = trainer
    trainer.strategy.optimizers = [torch.optim.SGD(model.parameters(), lr=0.1)]
    return trainer


@pytest.mark.parametrize(
    ("elche", "cause"),
    [
        (ElCheConfig(mode="nccl_cadence"), "in mode='nccl_cadence' the window and the data dispatch follow"),
        (ElCheConfig(mode="cpu_async"), "in mode='cpu_async' the window and the data dispatch follow"),
        (ElCheConfig(mode="nccl_sync"), r"ElCheConfig\(max_batch_diff=None\) lets a fast rank take"),
        (ElCheConfig(mode="cpu_sync", max_batch_diff=1), r"ElCheConfig\(max_batch_diff=1\) lets a fast rank"),
        (ElCheConfig(mode="nccl_sync", max_batch_diff=0, partition_ratios=[0.6, 0.4]), "partition_ratios give"),
    ],
)
def test_deterministic_is_refused_where_the_plan_follows_measured_speeds(tmp_path, restore_determinism, elche,
                                                                          cause):
    trainer = deterministic_trainer(tmp_path, True, elche)
    with pytest.raises(MisconfigurationException) as info:
        check_trainer(trainer)
    message = str(info.value)
    assert "ElCheStrategy cannot run with Trainer(deterministic)=True" in message
    assert __import__("re").search(cause, message), message
    assert "mode='nccl_sync' or 'cpu_sync' with ElCheConfig(max_batch_diff=0)" in message
    assert "the slowest rank's speed" in message  # what the reproducible setting costs


@pytest.mark.parametrize("mode", ["nccl_sync", "cpu_sync"])
def test_deterministic_passes_in_lockstep_on_the_equal_split(tmp_path, restore_determinism, mode):
    check_trainer(deterministic_trainer(tmp_path, True, ElCheConfig(mode=mode, max_batch_diff=0)))


def test_deterministic_warn_only_warns(tmp_path, restore_determinism):
    trainer = deterministic_trainer(tmp_path, "warn", ElCheConfig(mode="nccl_cadence"))
    with pytest.warns(UserWarning, match=r"deterministic='warn'\): in mode='nccl_cadence'.*max_batch_diff=0"):
        check_trainer(trainer)


def test_no_determinism_asked_passes(tmp_path, restore_determinism):
    check_trainer(deterministic_trainer(tmp_path, False, ElCheConfig(mode="nccl_cadence")))
