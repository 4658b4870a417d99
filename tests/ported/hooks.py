"""Hooks and strategies: the epoch-level hook order of Lightning's ``models/test_hooks.py`` and the DDP tests of
``strategies/test_ddp.py``, ``test_ddp_integration.py`` and ``test_common.py``, on 2 ElChe ranks.

The fit's per-batch hooks run per rank (each rank runs its own share of batches, in Lightning's order);
the ported tests compare every hook outside the training batches in Lightning's order.
"""

from __future__ import annotations

from functools import partial, update_wrapper
from inspect import getmembers, isfunction
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.nn.parallel import DistributedDataParallel

from ported.harness import MODES, Context, Suite
from ported.models import ClassifDataModule, ClassificationModel, SizedBoringModel, same_on_every_rank

SUITE = Suite("hooks")
HOOKS = "models/test_hooks.py::"
TRAIN_BATCH_HOOKS = {
    "on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer", "on_train_batch_start",
    "forward", "training_step", "on_before_zero_grad", "optimizer_zero_grad", "on_before_backward", "backward",
    "on_after_backward", "on_before_optimizer_step", "clip_gradients", "configure_gradient_clipping", "optimizer_step",
    "lr_scheduler_step", "on_train_batch_end",
}


def get_members(cls: type) -> set[str]:
    return {h for h, _ in getmembers(cls, predicate=isfunction) if not h.startswith("_")}


class HookedCallback(Callback):
    """Lightning's ``HookedCallback``: records the name of every callback hook called."""

    def __init__(self, called: list[str]) -> None:
        def call(hook: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            called.append(f"Callback.{hook}")
            return out

        for h in get_members(Callback):
            attr = getattr(self, h)
            partial_h = partial(call, h, attr)
            update_wrapper(partial_h, attr)
            setattr(self, h, partial_h)

    def state_dict(*args: Any, **kwargs: Any) -> dict:
        return {"foo": True}


class HookedModel(SizedBoringModel):
    """Lightning's ``HookedModel``: records the name of every LightningModule hook called."""

    def __init__(self, called: list[str], **sizes: Any) -> None:
        super().__init__(**sizes)
        hooks = get_members(LightningModule) - {"optimizers", "log", "log_dict"}
        hooks -= get_members(torch.nn.Module) - {"forward", "zero_grad", "train"}

        def call(hook: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            called.append(hook)
            return out

        for h in hooks:
            attr = getattr(self, h)
            partial_h = partial(call, h, attr)
            update_wrapper(partial_h, attr)
            setattr(self, h, partial_h)

    def configure_model(self) -> None: ...

    def on_validation_model_train(self) -> None: ...

    def on_test_model_train(self) -> None: ...

    def on_predict_model_train(self) -> None: ...

    def prepare_data(self) -> None: ...


def outside_training_batches(called: list[str]) -> list[str]:
    """The recorded hooks without those of the training batches (each rank runs its own number of them):
    the batch hooks from a training epoch's start to its end, outside the validation run inside it."""
    kept, in_training, in_validation = [], False, False
    for name in called:
        if name == "on_train_epoch_start":
            in_training = True
        elif name in ("Callback.on_train_epoch_end", "Callback.on_train_end"):
            in_training = False
        elif name in ("zero_grad", "Callback.on_validation_start") and in_training:
            in_validation = True
        elif name == "on_validation_end":
            in_validation = False
        if in_training and not in_validation and name.removeprefix("Callback.") in TRAIN_BATCH_HOOKS:
            continue
        kept.append(name)
    return kept


def prepared(ctx: Context) -> list[str]:
    """``prepare_data`` runs on each node's local rank 0 (Lightning's ``prepare_data_per_node``, as under DDP)."""
    return ["prepare_data"] if ctx.is_global_zero else []


def eval_epoch(fn: str, batches: int, key_hooks: bool = True) -> list[str]:
    batch = ["on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer",
             f"Callback.on_{fn}_batch_start", f"on_{fn}_batch_start", "forward", f"{fn}_step",
             f"Callback.on_{fn}_batch_end", f"on_{fn}_batch_end"]
    return [f"Callback.on_{fn}_epoch_start", f"on_{fn}_epoch_start", *(batch * batches),
            f"Callback.on_{fn}_epoch_end", f"on_{fn}_epoch_end"]


def validation_run(batches: int, override: bool, in_fit: bool) -> list[str]:
    return [
        *(["zero_grad", "on_validation_model_zero_grad"] if in_fit else []),
        "train", "on_validation_model_eval", "Callback.on_validation_start", "on_validation_start",
        *eval_epoch("validation", batches), "Callback.on_validation_end", "on_validation_end",
        *(["on_validation_model_train"] if override else []),
    ]


for override in (True, False):

    def hook_system_fit_case(ctx: Context, override=override) -> None:
        called: list[str] = []
        model = HookedModel(called, train=4)  # Lightning: limit_train_batches=2 on one device
        if not override:
            model.on_validation_model_train = None
        trainer = ctx.trainer(max_epochs=1, limit_val_batches=2, callbacks=[HookedCallback(called)])
        trainer.fit(model)
        expected = [
            "configure_callbacks", *prepared(ctx), "Callback.setup", "setup", "configure_model", "configure_optimizers",
            "Callback.on_fit_start", "on_fit_start", "zero_grad", "Callback.on_sanity_check_start", "val_dataloader",
            *validation_run(2, override, in_fit=False)[0:],
            "Callback.on_sanity_check_end", "train_dataloader", "Callback.on_train_start", "on_train_start",
            "Callback.on_train_epoch_start", "on_train_epoch_start",
            *validation_run(2, override, in_fit=True),
            "Callback.on_train_epoch_end", "on_train_epoch_end", "Callback.state_dict", "Callback.on_save_checkpoint",
            "on_save_checkpoint", "Callback.on_train_end", "on_train_end", "Callback.on_fit_end", "on_fit_end",
            "Callback.teardown", "teardown",
        ]
        assert outside_training_batches(called) == expected, outside_training_batches(called)
        assert called.count("training_step") == trainer.fit_loop.epoch_loop.batch_progress.current.completed
        same_on_every_rank([h for h in outside_training_batches(called) if h != "prepare_data"],
                           "the hooks outside training batches")

    SUITE.add(f"test_trainer_model_hook_system_fit[{override}-True-kwargs0]",
              HOOKS + f"test_trainer_model_hook_system_fit[{override}-True-kwargs0]", "passes",
              MODES if override else ("nccl_cadence",), hook_system_fit_case)


@SUITE.case(HOOKS + "test_trainer_model_hook_system_fit[True-False-kwargs0]", "refused",
            name="test_trainer_model_hook_system_fit[manual-optimization]",
            note="manual optimization is refused in setup: use automatic optimization")
def test_trainer_model_hook_system_fit_manual(ctx: Context) -> None:
    model = HookedModel([], train=4)
    model.automatic_optimization = False
    trainer = ctx.trainer(max_epochs=1, limit_val_batches=2)
    with ctx.raises(MisconfigurationException, match=r"automatic_optimization=False.*automatic optimization"):
        trainer.fit(model)


@SUITE.case(HOOKS + "test_trainer_model_hook_system_fit_no_val_and_resume_max_epochs", modes=MODES)
def test_trainer_model_hook_system_fit_no_val_and_resume_max_epochs(ctx: Context) -> None:
    trainer = ctx.trainer(max_epochs=1, limit_val_batches=0, callbacks=[HookedCallback([])])
    trainer.fit(SizedBoringModel(train=4))
    best_model_path = trainer.checkpoint_callback.best_model_path
    called: list[str] = []
    trainer = ctx.trainer(max_epochs=2, limit_val_batches=0, callbacks=[HookedCallback(called)])
    model = HookedModel(called, train=4)
    trainer.fit(model, ckpt_path=best_model_path)
    expected = [
        "configure_callbacks", *prepared(ctx), "Callback.setup", "setup", "configure_model", "on_load_checkpoint",
        "Callback.on_load_checkpoint", "Callback.load_state_dict", "configure_optimizers", "Callback.on_fit_start",
        "on_fit_start", "zero_grad", "train_dataloader", "Callback.on_train_start", "on_train_start",
        "Callback.on_train_epoch_start", "on_train_epoch_start", "Callback.on_train_epoch_end", "on_train_epoch_end",
        "Callback.state_dict", "Callback.on_save_checkpoint", "on_save_checkpoint", "Callback.on_train_end",
        "on_train_end", "Callback.on_fit_end", "on_fit_end", "Callback.teardown", "teardown",
    ]
    assert outside_training_batches(called) == expected, outside_training_batches(called)
    assert trainer.strategy.progress.cohort_step == 8  # Lightning: the saved global_step 4 (2 per epoch, 2 epochs)


for verb, noun, batches in (("validate", "validation", 2), ("test", "test", 2), ("validate", "validation", 0)):

    def hook_system_eval_case(ctx: Context, verb=verb, noun=noun, batches=batches) -> None:
        called: list[str] = []
        model = HookedModel(called)
        trainer = ctx.trainer(max_epochs=1, limit_val_batches=batches, limit_test_batches=batches,
                              callbacks=[HookedCallback(called)])
        getattr(trainer, verb)(model, verbose=False)
        loader = "val" if verb == "validate" else "test"
        hooks = [f"{loader}_dataloader", "train", f"on_{noun}_model_eval", f"Callback.on_{noun}_start",
                 f"on_{noun}_start", *eval_epoch(noun, batches), f"Callback.on_{noun}_end", f"on_{noun}_end",
                 f"on_{noun}_model_train"]
        expected = ["configure_callbacks", *prepared(ctx), "Callback.setup", "setup", "configure_model", "zero_grad",
                    *(hooks if batches else []), "Callback.teardown", "teardown"]
        assert called == expected, called

    loader_key = "val-x" if verb == "validate" else "test-y"
    params = f"True-{verb}-{noun}-{loader_key}-{batches}"
    SUITE.add(f"test_trainer_model_hook_system_eval[{params}]",
              HOOKS + f"test_trainer_model_hook_system_eval[{params}]", "passes", ("nccl_cadence",),
              hook_system_eval_case)


@SUITE.case(HOOKS + "test_trainer_model_hook_system_predict")
def test_trainer_model_hook_system_predict(ctx: Context) -> None:
    called: list[str] = []
    model = HookedModel(called)
    trainer = ctx.trainer(limit_predict_batches=2, callbacks=[HookedCallback(called)])
    trainer.predict(model)
    batch = ["on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer",
             "Callback.on_predict_batch_start", "on_predict_batch_start", "forward", "predict_step",
             "Callback.on_predict_batch_end", "on_predict_batch_end"]
    expected = ["configure_callbacks", *prepared(ctx), "Callback.setup", "setup", "configure_model", "zero_grad",
                "predict_dataloader", "train", "on_predict_model_eval", "Callback.on_predict_start", "on_predict_start",
                "Callback.on_predict_epoch_start", "on_predict_epoch_start", *(batch * 2),
                "Callback.on_predict_epoch_end", "on_predict_epoch_end", "Callback.on_predict_end", "on_predict_end",
                "Callback.teardown", "teardown"]
    assert called == expected, called


@SUITE.case(HOOKS + "test_on_train_epoch_end_metrics_collection", modes=MODES)
def test_on_train_epoch_end_metrics_collection(ctx: Context) -> None:
    num_epochs = 3

    class CurrentModel(SizedBoringModel):
        def training_step(self, *args: Any, **kwargs: Any) -> Any:
            output = super().training_step(*args, **kwargs)
            self.log_dict({"step_metric": torch.tensor(-1), "shared_metric": 100}, logger=False, prog_bar=True)
            return output

        def on_train_epoch_end(self) -> None:
            epoch = self.current_epoch
            self.log_dict({f"epoch_metric_{epoch}": torch.tensor(epoch), "shared_metric": 111}, logger=False,
                          prog_bar=True)

    trainer = ctx.trainer(max_epochs=num_epochs)
    trainer.fit(CurrentModel(train=8))
    metrics = trainer.progress_bar_metrics
    assert metrics["step_metric"] == -1
    assert metrics["shared_metric"] == 111
    for i in range(num_epochs):
        assert metrics[f"epoch_metric_{i}"] == i


STRATEGIES = "strategies/"


@SUITE.case(STRATEGIES + "test_common.py::test_evaluate", modes=MODES)
def test_evaluate(ctx: Context) -> None:
    dm = ClassifDataModule(train=160)  # Lightning: limit_train_batches=10 (of 16)
    model = ClassificationModel()
    trainer = ctx.trainer(max_epochs=2, limit_val_batches=10)
    trainer.fit(model, datamodule=dm)
    assert "ckpt" in trainer.checkpoint_callback.best_model_path
    old_weights = model.layer[0].weight.clone().detach().cpu()
    trainer.validate(datamodule=dm)
    trainer.test(datamodule=dm)
    torch.testing.assert_close(old_weights, model.layer[0].weight.clone().detach().cpu())
    same_on_every_rank(trainer.ckpt_path, "the checkpoint test() loaded")


@SUITE.case(STRATEGIES + "test_ddp_integration.py::test_multi_gpu_model_ddp_fit_test", modes=MODES)
def test_multi_gpu_model_ddp_fit_test(ctx: Context) -> None:
    dm = ClassifDataModule(train=800, batch_size=10)  # Lightning's ClassifDataModule: 800 samples in batches of 10
    model = ClassificationModel()
    trainer = ctx.trainer(max_epochs=1)
    trainer.fit(model, datamodule=dm)
    result = trainer.test(model, datamodule=dm)
    for out in result:
        assert out["test_acc"] > 0.7


@SUITE.case(STRATEGIES + "test_ddp_integration.py::test_multi_gpu_early_stop_ddp_spawn", modes=MODES)
def test_multi_gpu_early_stop_ddp_spawn(ctx: Context) -> None:
    # tests/helpers/pipelines.py::run_model_test: fit, the weights changed, the best checkpoint loads.
    dm = ClassifDataModule(train=160)
    model = ClassificationModel()
    initial = [p.detach().clone() for p in model.parameters()]
    trainer = ctx.trainer(callbacks=[EarlyStopping(monitor="train_acc")], max_epochs=50, limit_val_batches=10)
    trainer.fit(model, datamodule=dm)
    assert trainer.state.finished, f"Training failed with {trainer.state}"
    change = sum(float((p.detach() - q).abs().sum()) for p, q in zip(model.parameters(), initial, strict=True))
    assert change > 0.1
    loaded = ClassificationModel.load_from_checkpoint(trainer.checkpoint_callback.best_model_path)
    assert loaded is not None
    same_on_every_rank(trainer.current_epoch, "the epoch EarlyStopping stopped")


@SUITE.case(STRATEGIES + "test_ddp_integration.py::test_ddp_all_dataloaders_passed_to_fit")
def test_ddp_all_dataloaders_passed_to_fit(ctx: Context) -> None:
    model = SizedBoringModel(train=13)  # Lightning: limit_train_batches=0.2 of 64
    trainer = ctx.trainer(max_epochs=1, limit_val_batches=0.2)
    trainer.fit(model, train_dataloaders=model.train_dataloader(), val_dataloaders=model.val_dataloader())
    assert trainer.state.finished
    assert trainer.strategy.progress.cohort_step == 13


@SUITE.case(STRATEGIES + "test_ddp.py::test_ddp_configure_ddp", kind="deviation",
            note="ElChe never wraps the model in DistributedDataParallel (each rank trains its own replica between "
                 "averaging rounds)")
def test_ddp_configure_ddp(ctx: Context) -> None:
    seen: list[Any] = []

    class Probe(Callback):
        def on_train_start(self, trainer: Any, pl_module: LightningModule) -> None:
            seen.append(trainer.model)

    trainer = ctx.trainer(max_epochs=1, limit_val_batches=0, callbacks=[Probe()])
    trainer.fit(SizedBoringModel(train=4))
    assert isinstance(seen[0], LightningModule) and not isinstance(seen[0], DistributedDataParallel)
    assert trainer.strategy.engine is not None and trainer.strategy.progress.rounds > 0
    trainer.validate(SizedBoringModel(train=4))
    assert isinstance(trainer.model, LightningModule)


@SUITE.case("checkpointing/test_model_checkpoint.py::test_model_checkpoint_no_extraneous_invocations")
def test_model_checkpoint_no_extraneous_invocations(ctx: Context) -> None:
    class CheckpointCounter(ModelCheckpoint):
        count = 0

        def _save_checkpoint(self, trainer: Any, filepath: str) -> None:
            self.count += 1
            super()._save_checkpoint(trainer, filepath)

    model_checkpoint = CheckpointCounter(monitor="early_stop_on", save_top_k=-1, mode="max")
    num_epochs = 4
    trainer = ctx.trainer(callbacks=[model_checkpoint], logger=False, max_epochs=num_epochs)

    class LogInTwoMethods(SizedBoringModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            out = super().training_step(batch, batch_idx)
            self.log("early_stop_on", out["loss"])
            return out

    trainer.fit(LogInTwoMethods(train=8))
    assert trainer.state.finished, f"Training failed with {trainer.state}"
    assert model_checkpoint.count == num_epochs
