"""The strategy of each 2-rank arm, and which ElChe modes exist.

* ``ddp``: Lightning's stock ``DDPStrategy``: gradient all-reduce in every step.
* ``ddp_post_local_sgd``: Lightning's ``DDPStrategy`` with PyTorch's post-local-SGD recipe,
  exactly as Lightning documents it (``ddp_comm_state=PostLocalSGDState(...)``,
  ``ddp_comm_hook=post_localSGD_hook``, ``model_averaging_period=K``): plain DDP for the first
  ``start_localSGD_iter`` steps, then no gradient all-reduce and a parameter average
  (``PeriodicModelAverager``, run by Lightning after each optimizer step) every K steps. Two
  deliberate details, both in :class:`PostLocalSGDStrategy`:

  - ``post_local_gradient_allreduce=False``. With PyTorch's default (True) and ``subgroup=None``
    the hook keeps all-reducing gradients every step inside ``dist.new_subgroups()``, whose
    default subgroup is *all the GPUs of the node*: on a one-node rig that is DDP plus periodic
    averaging, not local SGD (and on CPU ``new_subgroups`` fails: it sizes groups by
    ``torch.cuda.device_count()``).
  - Lightning registers DDP communication hooks on CUDA only (``DDPStrategy._register_ddp_hooks``).
    The subclass registers the same hook through the same Lightning helper on CPU as well (gloo
    runs DDP comm hooks); on CUDA it changes nothing. Everything else (DDP wrapper, buffer
    broadcast, ``PeriodicModelAverager`` in ``DDPStrategy.optimizer_step``) is Lightning's own.

* ElChe arms, named by their mode: ``ElCheStrategy(mode=...)`` for every mode that can be
  constructed in this version (:func:`available_elche_modes`).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional, Union

from lightning.pytorch.strategies import DDPStrategy, Strategy

from lightning_elche import ElCheMode, ElCheStrategy
from lightning_elche.bench.config import BenchConfig
from lightning_elche.bench.plan import DDP, LOCAL_SGD
from lightning_elche.loop_glue import register_ddp_comm_hook


def available_elche_modes() -> tuple[tuple[str, ...], dict[str, str]]:
    """(modes whose ``ElCheStrategy`` constructs, {mode: why not} for the others)."""
    available: list[str] = []
    skipped: dict[str, str] = {}
    for mode in ElCheMode:
        try:
            ElCheStrategy(mode=mode.value)
        except NotImplementedError as error:
            skipped[mode.value] = str(error).split(";")[0]
        else:
            available.append(mode.value)
    return tuple(available), skipped


class PostLocalSGDStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` configured for post-local SGD, with the hook registered on CPU too.

    Args:
        period: ``model_averaging_period`` K (steps between parameter averages).
        warmup: ``start_localSGD_iter``: steps of plain DDP gradient all-reduce before local SGD.
        kwargs: passed to ``DDPStrategy``.
    """

    def __init__(self, period: int, warmup: int, **kwargs: Any) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
            PostLocalSGDState,
            post_localSGD_hook,
        )

        state = PostLocalSGDState(
            process_group=None, subgroup=None, start_localSGD_iter=warmup, post_local_gradient_allreduce=False
        )
        super().__init__(ddp_comm_state=state, ddp_comm_hook=post_localSGD_hook, model_averaging_period=period,
                         **kwargs)
        self.period = period
        self.warmup = warmup

    def configure_ddp(self) -> None:
        super().configure_ddp()
        if self.root_device.type != "cuda":  # Lightning registered it already on CUDA
            register_ddp_comm_hook(self)

    def averagings(self, steps: int) -> int:
        """Parameter averages ``PeriodicModelAverager`` ran in ``steps`` optimizer steps."""
        if steps <= self.warmup:
            return 0
        return -(-(steps - self.warmup) // self.period)


def make_strategy(arm: str, config: BenchConfig, micro_batch: Optional[list[Union[None, int, str]]] = None
                  ) -> Strategy:
    """A fresh strategy for one 2-rank fit of ``arm`` (state such as hook counters is per fit);
    ``micro_batch``: the ElChe arms' ``ElCheStrategy(micro_batch=...)`` (:mod:`lightning_elche.bench.limits`).

    The rank processes are started by the harness (Lightning sees ``LOCAL_RANK`` and launches
    nothing, as under ``torchrun``) and the process group already exists, so ``timeout`` and
    ``process_group_backend`` only document what the harness set up.
    """
    common: dict[str, Any] = {
        "process_group_backend": config.rig.backend,
        "timeout": timedelta(seconds=60),
    }
    if arm == DDP:
        return DDPStrategy(**common)
    if arm == LOCAL_SGD:
        return PostLocalSGDStrategy(config.local_sgd_period, config.local_sgd_warmup, **common)
    if arm in config.elche_modes:
        return ElCheStrategy(mode=arm, summary=False, micro_batch=micro_batch, **common)
    raise ValueError(f"unknown arm {arm!r}")


ARM_DESCRIPTIONS: dict[str, str] = {
    "solo_rank0": "rank 0's device alone (single-process fit)",
    "solo_rank1": "rank 1's device alone, with its throttle (single-process fit)",
    DDP: "Lightning DDPStrategy: gradient all-reduce every step",
    LOCAL_SGD: "Lightning DDPStrategy + PyTorch post-local SGD: average parameters every K steps",
    "nccl_sync": "ElCheStrategy(mode='nccl_sync'): lockstep windows, equal data split",
    "nccl_cadence": "ElCheStrategy(mode='nccl_cadence'): throughput-proportional windows and data",
    "cpu_sync": "ElCheStrategy(mode='cpu_sync'): lockstep windows, averaging of host snapshots on a gloo group",
    "cpu_cadence": "ElCheStrategy(mode='cpu_cadence'): proportional windows and data, host snapshots on a gloo group",
    "cpu_async": "ElCheStrategy(mode='cpu_async'): proportional windows, non-blocking host-snapshot rounds, "
                 "elastic blend",
}
