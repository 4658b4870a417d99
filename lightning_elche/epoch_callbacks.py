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
from typing import Any, Literal, Optional

from lightning.pytorch import Callback, LightningModule, Trainer

EpochCallbackPolicy = Literal["fastest", "rank0", "all"]
EPOCH_CALLBACK_POLICIES: tuple[str, ...] = ("fastest", "rank0", "all")


def check_policy(owner: str, policy: Any) -> str:
    if policy not in EPOCH_CALLBACK_POLICIES:
        raise ValueError(
            f"{owner}(epoch_callback_policy={policy!r}) is invalid: expected 'fastest', 'rank0' or 'all'."
        )
    return str(policy)


class CallbackRole:
    """Tracks the fastest rank from the controller's shared timings (sticky once chosen)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.fastest: Optional[int] = None

    def observe(self, controller: Any) -> None:
        """After a round: pick the fastest rank once every rank has a timing."""
        if self.fastest is not None:
            return
        speeds = [controller.smoothed_ms_or_none(rank) for rank in range(self.world_size)]
        if any(ms is None or ms <= 0.0 for ms in speeds):
            return
        self.fastest = min(range(self.world_size), key=lambda rank: (speeds[rank], rank))

    def rank_for(self, policy: str) -> Optional[int]:
        """The rank that runs epoch callbacks under ``policy``; None means every rank."""
        if policy == "all":
            return None
        if policy == "rank0":
            return 0
        return self.fastest if self.fastest is not None else 0

    def state_dict(self) -> dict[str, Any]:
        return {"fastest": self.fastest}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        fastest = state.get("fastest")
        if fastest is not None and not (isinstance(fastest, int) and 0 <= fastest < self.world_size):
            raise ValueError(
                f"The checkpoint's epoch callback role names rank {fastest!r}; world size is {self.world_size}."
            )
        self.fastest = fastest


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
        from lightning_elche.strategy import ElCheStrategy

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
        policy = self.policy or strategy.epoch_callback_policy
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
