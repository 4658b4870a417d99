"""Lightning's ``ModelCheckpoint`` and ``EarlyStopping`` on numbers every rank shares.

Both callbacks decide from ``trainer.global_step`` and ``trainer.callback_metrics``. Under ElChe
ranks take different numbers of optimizer steps, so each rank's ``global_step`` differs: the default
``{epoch}-{step}`` file name, ``_last_global_step_saved`` and the "already saved at this step" checks
would differ by rank, and a rank would record as ``best_model_path`` a file that only its own step
count names (issue 26). A metric logged without ``sync_dist`` differs by rank too, and with it the
scores, the order of ``best_k_models`` and EarlyStopping's ``best_score``.

So, during a fit, every ``ModelCheckpoint`` (``ElCheCheckpoint`` included) and ``EarlyStopping``
among the Trainer's callbacks sees the Trainer through a :class:`CohortTrainerView`:

* ``global_step`` is the **cohort step**, the optimizer steps of all ranks together (the engine's
  ``state.cohort_step``, the count ``max_steps`` budgets). It only changes at rounds, which every
  rank runs with the same numbers, so it is the same on every rank wherever these callbacks run
  (epoch ends, validation ends, the end of fit, a sync checkpoint). A 2-rank fit over an epoch of
  ``N`` batches therefore names its checkpoints ``step=N, 2N, ...``, as one device would.
* ``callback_metrics`` are **rank 0's**, broadcast once per hook call (a collective, at a point
  every rank reaches: the end of a training or validation epoch, the end of fit). A metric logged
  with ``self.log(..., sync_dist=True)`` is already the same on every rank (the reduced value), so
  the broadcast changes nothing for it; any other metric is rank 0's value on every rank.

Everything else reads and writes through to the Trainer (``trainer.should_stop = ...`` included).
The wrappers are installed when a fit starts and removed at its end, through
:class:`~lightning_elche.loop_glue.LightningPatches`.

As Lightning's ``global_step`` does, the cohort step continues over later fits of the same Trainer
(:func:`continue_the_cohort`), unless a checkpoint restores its own; a fit whose ``max_steps`` is
already spent trains nothing (:func:`stop_if_the_budget_is_spent`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional, Protocol, cast

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from torch import Tensor

# The hooks that read the step or the metrics, and whether every rank reaches them together
# (then rank 0's metrics are broadcast; ``on_exception`` may run on one rank alone).
_HOOKS: dict[type[Callback], dict[str, bool]] = {
    ModelCheckpoint: {"on_train_epoch_end": True, "on_validation_end": True, "on_train_end": True,
                      "on_exception": False},
    EarlyStopping: {"on_train_epoch_end": True, "on_validation_end": True},
}


def continue_the_cohort(previous: Optional[Any], engine: Any) -> Any:
    """``engine`` (this fit's) continuing the cohort step of ``previous`` (the last fit's engine of the
    same strategy, or None): a second ``fit()`` on a Trainer continues counting, as Lightning's
    ``global_step`` does, so ``max_steps`` and ``{step}`` mean the same over repeated fits. A checkpoint
    loaded later in ``setup`` replaces it with its own."""
    if previous is not None:
        engine.state.cohort_step = previous.state.cohort_step
    return engine


def stop_if_the_budget_is_spent(trainer: Trainer, cohort_step: int, budget: Optional[int]) -> None:
    """End the fit before its first batch when the cohort step already reached ``max_steps`` (a later
    fit, or a resume from a checkpoint past it), as Lightning's fit loop does with its own ``max_steps``."""
    if budget is not None and cohort_step >= budget:
        trainer.should_stop = True


class _WithCallbacks(Protocol):
    """The Trainer's callback list (set by Lightning's connector; its class does not declare it)."""

    callbacks: list[Callback]


class CohortTrainerView:
    """The Trainer with the cohort step as ``global_step`` and (optionally) rank 0's
    ``callback_metrics``; every other attribute is the Trainer's own."""

    def __init__(self, trainer: Trainer, cohort_step: int, metrics: Optional[dict[str, Tensor]] = None) -> None:
        object.__setattr__(self, "_view_of", trainer)
        object.__setattr__(self, "_view_step", cohort_step)
        object.__setattr__(self, "_view_metrics", metrics)

    @property
    def global_step(self) -> int:
        return self._view_step

    @property
    def callback_metrics(self) -> dict[str, Tensor]:
        return self._view_metrics if self._view_metrics is not None else self._view_of.callback_metrics

    def __getattr__(self, name: str) -> Any:
        return getattr(self._view_of, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._view_of, name, value)


def rank_zero_metrics(trainer: Trainer) -> dict[str, Tensor]:
    """Rank 0's ``callback_metrics`` on every rank (one broadcast; call it on every rank).

    Each value lands on the device of this rank's own value of that name (the root device if this
    rank has none)."""
    local = trainer.callback_metrics
    # Plain numbers on the wire: pickling a tensor goes through torch.save, which a test may mock.
    sent: Optional[dict[str, tuple[Any, torch.dtype]]] = (
        {name: (value.tolist(), value.dtype) for name, value in local.items()} if trainer.is_global_zero else None
    )
    received = trainer.strategy.broadcast(sent, src=0)
    assert received is not None  # rank 0 sent a dict
    device = trainer.strategy.root_device
    return {
        name: torch.tensor(values, dtype=dtype, device=local[name].device if name in local else device)
        for name, (values, dtype) in received.items()
    }


def cohort_view(trainer: Trainer, cohort_step: int, share_metrics: bool) -> CohortTrainerView:
    """The view of ``trainer`` at ``cohort_step``; ``share_metrics`` broadcasts rank 0's metrics
    (every rank must call it then, at the same point)."""
    return CohortTrainerView(trainer, cohort_step, rank_zero_metrics(trainer) if share_metrics else None)


def follow_the_cohort(trainer: Trainer, cohort_step: Callable[[], int],
                      replace_hook: Callable[[Callback, str, Callable[..., Any]], None]) -> int:
    """Give every ``ModelCheckpoint`` and ``EarlyStopping`` of ``trainer`` the cohort's view in the
    hooks that read the step or the metrics; ``replace_hook(callback, name, fn)`` installs one
    (and undoes it when the fit ends). Returns how many callbacks follow the cohort."""
    followed = 0
    for callback in cast(_WithCallbacks, trainer).callbacks:
        hooks = next((hooks for kind, hooks in _HOOKS.items() if isinstance(callback, kind)), None)
        if hooks is None:
            continue
        followed += 1
        for name, together in hooks.items():
            replace_hook(callback, name, _through_view(getattr(callback, name), cohort_step, together))
    return followed


def _through_view(hook: Callable[..., Any], cohort_step: Callable[[], int], together: bool) -> Callable[..., Any]:
    def hook_on_the_cohort(trainer: Trainer, *args: Any, **kwargs: Any) -> Any:
        return hook(cohort_view(trainer, cohort_step(), together), *args, **kwargs)

    return hook_on_the_cohort

