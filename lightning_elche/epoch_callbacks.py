"""Which rank runs user epoch callbacks (flodl's ``epoch_callback_policy`` and ``epoch_fn``).

* ``"fastest"`` (flodl's default): the rank with the highest measured throughput. Until the
  controller has timed every rank that is rank 0; at the first round after which it has, the rank
  with the lowest smoothed time per batch (ties: the lowest rank) takes the role and keeps it, as in
  flodl, so the role does not flap with timing noise. The controller's timings come from the
  round metadata every rank gathered, so every rank picks the same rank without a message.
* ``"rank0"``: rank 0.
* ``"all"``: every rank (Lightning's own behaviour for callbacks).

A callback that runs on one rank must not use collectives (``barrier``, ``broadcast``,
``all_gather``, ``reduce``, ``trainer.save_checkpoint``, ``self.log(..., sync_dist=True)``): the
other ranks never reach the matching call. :class:`EpochCallbacks` refuses the strategy's
collectives while it runs callbacks on one rank; raw ``torch.distributed`` calls and
``sync_dist`` logging cannot be intercepted, so keep them out of single-rank callbacks or use
``"all"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_elche.config import EPOCH_CALLBACK_POLICIES, check_policy
from lightning_elche.session import CallbackRole, EpochCallbackPolicy
from lightning_elche.strategy import ElCheStrategy

__all__ = ["EPOCH_CALLBACK_POLICIES", "CallbackRole", "EpochCallbackPolicy", "EpochCallbacks"]


class EpochCallbacks(Callback):
    """Runs the wrapped callbacks' epoch hooks on the rank chosen by an epoch callback policy.

    ``on_train_epoch_start`` and ``on_train_epoch_end`` are forwarded only on the chosen rank
    (every rank under ``"all"``); ``setup`` and ``teardown`` on every rank, so the wrapped
    callbacks can prepare themselves. Other hooks are not forwarded: register such callbacks
    with the Trainer directly.

    Args:
        callbacks: the user's epoch callbacks (flodl's ``epoch_fn``).
        policy: ``"fastest"``, ``"rank0"`` or ``"all"``; ``None`` uses
            ``ElCheStrategy(epoch_callback_policy=...)``.
    """

    def __init__(self, callbacks: Sequence[Callback], policy: Optional[EpochCallbackPolicy] = None) -> None:
        if isinstance(callbacks, Callback) or not all(isinstance(c, Callback) for c in callbacks):
            raise TypeError(f"EpochCallbacks(callbacks={callbacks!r}) is invalid: expected a list of Callbacks.")
        self.callbacks = list(callbacks)
        self.policy = None if policy is None else check_policy("EpochCallbacks", policy)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if not isinstance(trainer.strategy, ElCheStrategy):
            raise TypeError(
                f"EpochCallbacks needs ElCheStrategy (the Trainer runs {type(trainer.strategy).__name__}); "
                "register the callbacks with the Trainer directly."
            )
        for callback in self.callbacks:
            callback.setup(trainer, pl_module, stage)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        for callback in self.callbacks:
            callback.teardown(trainer, pl_module, stage)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._forward(trainer, pl_module, "on_train_epoch_start")

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._forward(trainer, pl_module, "on_train_epoch_end")

    def _forward(self, trainer: Trainer, pl_module: LightningModule, hook: str) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, ElCheStrategy)  # setup refused any other strategy
        policy = self.policy or strategy.elche.epoch_callback_policy
        rank = strategy.epoch_callback_rank(policy)
        if rank is None:
            for callback in self.callbacks:
                getattr(callback, hook)(trainer, pl_module)
            return
        if strategy.global_rank != rank:
            return
        with strategy.single_rank_callbacks(policy):
            for callback in self.callbacks:
                getattr(callback, hook)(trainer, pl_module)
