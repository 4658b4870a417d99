"""ElChe's own cases of issue 26, run in the same launches as the ported Lightning tests.

Not from Lightning's suite: ``ElCheCheckpoint`` with ``ckpt_path="best"`` / ``"last"`` in fit,
validate, test and predict; ``max_steps`` inside an epoch; ``Trainer(deterministic=True)``.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_elche import ElCheCheckpoint, ElCheConfig
from ported.checkpointing import check_agreed
from ported.harness import MODES, Context, Suite
from ported.models import SizedBoringModel, ValLossModel, same_on_every_rank
from ported.stops import LastRounds, assert_stopped_at_the_budget

SUITE = Suite("elche")
ISSUE = "(ElChe, issue 26) "


class CountValidation(Callback):
    def __init__(self) -> None:
        self.runs: list[tuple[bool, int]] = []

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.runs.append((trainer.sanity_checking, trainer.current_epoch))


@SUITE.case(ISSUE + "max_steps inside an epoch", modes=MODES)
def max_steps_inside_an_epoch_skips_validation(ctx: Context) -> None:
    # Lightning's max_steps inside an epoch ends the epoch without validating; so must ElChe's budget
    # (before issue 26 the budget's stop ran a whole validation epoch there).
    counter, rounds = CountValidation(), LastRounds()
    trainer = ctx.trainer(max_steps=560, max_epochs=5, callbacks=[counter, rounds], limit_val_batches=2)
    trainer.fit(SizedBoringModel(train=512, batch_size=2))  # 256 cohort steps an epoch
    assert_stopped_at_the_budget(trainer, rounds, 560)
    assert trainer.strategy.progress.cohort_step < 768  # inside epoch 2
    assert counter.runs == [(True, 0), (False, 0), (False, 1)], counter.runs  # the sanity check, epochs 0 and 1
    same_on_every_rank(trainer.strategy.progress.cohort_step, "the cohort step")


def checkpoint_callbacks(ctx: Context) -> tuple[ElCheCheckpoint, ElCheCheckpoint]:
    best = ElCheCheckpoint(dirpath=ctx.tmp_path / "best", monitor="val_loss", save_top_k=2, save_last="link")
    sync = ElCheCheckpoint(dirpath=ctx.tmp_path / "sync", filename="{epoch}-{step}-{sync}", every_n_syncs=4,
                           save_top_k=-1, save_last=True)
    return best, sync


@SUITE.case(ISSUE + "ElCheCheckpoint with ckpt_path='best'/'last' in fit, validate, test, predict", modes=MODES)
def elche_checkpoint_best_and_last_everywhere(ctx: Context) -> None:
    best, sync = checkpoint_callbacks(ctx)
    model = ValLossModel(train=48, val=16, test=16, predict=16)
    trainer = ctx.trainer(max_epochs=2, callbacks=[best, sync])
    trainer.fit(model)
    ctx.barrier("fit")
    check_agreed(ctx, best)
    check_agreed(ctx, sync)
    assert len(best.best_k_models) == 2 and os.path.islink(best.last_model_path)
    sync_files = sorted(os.listdir(ctx.tmp_path / "sync"))
    assert any("-sync=" in name for name in sync_files), sync_files  # saved inside the epochs
    for fn in (trainer.validate, trainer.test, trainer.predict):
        fn(model, ckpt_path="best")
        assert trainer.ckpt_path == best.best_model_path
        fn(model, ckpt_path="last")
        assert trainer.ckpt_path in (best.last_model_path, sync.last_model_path)
        same_on_every_rank(trainer.ckpt_path, f"the checkpoint {fn.__name__} loaded")
    cohort = trainer.strategy.progress.cohort_step
    best, sync = checkpoint_callbacks(ctx)
    trainer = ctx.trainer(max_epochs=3, callbacks=[best, sync])
    trainer.fit(model, ckpt_path="last")
    assert trainer.strategy.progress.cohort_step == cohort + 48  # one more epoch
    check_agreed(ctx, best)
    # fit(ckpt_path="best") on the same Trainer: from the best epoch-end checkpoint to the end of epoch 4.
    trainer.fit_loop.max_epochs = 4
    trainer.fit(model, ckpt_path="best")
    assert trainer.strategy.progress.cohort_step == 4 * 48
    assert trainer.current_epoch == 4
    check_agreed(ctx, best)


class Jitter(Callback):
    """Random per-batch delays, different in each run and on each rank (rank 1 slower)."""

    def __init__(self, seed: int) -> None:
        self.random = random.Random(seed)

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        time.sleep(self.random.random() * 0.004 * (1 + 2 * trainer.global_rank))


@SUITE.case(ISSUE + "Trainer(deterministic=True)", modes=MODES)
def deterministic_runs_reproduce_the_weights_or_are_refused(ctx: Context) -> None:
    reproducible = ctx.mode in ("nccl_sync", "cpu_sync")

    def fit(run: int) -> torch.Tensor:
        from lightning.pytorch import seed_everything

        seed_everything(7)
        config = ElCheConfig(mode=ctx.mode, max_batch_diff=0) if reproducible else ElCheConfig(mode=ctx.mode)
        trainer = ctx.trainer(ctx.strategy(elche=config), max_epochs=2, limit_val_batches=0, logger=False,
                              enable_checkpointing=False, deterministic=True, callbacks=[Jitter(10 * run + ctx.rank)])
        model = SizedBoringModel(train=96, batch_size=2)
        trainer.fit(model)
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    try:
        if not reproducible:
            with ctx.raises(MisconfigurationException, match=r"deterministic\)=True: in mode=.*max_batch_diff=0"):
                fit(0)
            return
        first, second = fit(0), fit(1)
        # The speeds differ from run to run (the jitter); the weights do not. (Without max_batch_diff=0 they
        # differ: measured 0.13 at most on these 2 ranks in nccl_sync.)
        assert torch.equal(first, second), float((first - second).abs().max())
    finally:
        torch.use_deterministic_algorithms(False)
