"""Buffers that left ElChe's averaging during a fit, brought back to one value on every rank.

The averaging rounds reduce the floating-point buffers the module had when the engine was built
(:func:`~lightning_elche.averaging.averaged_state` keeps those tensor objects). A callback that
*replaces* a buffer instead of writing into it takes it out of the rounds: Lightning's
``StochasticWeightAveraging`` does so for BatchNorm's running statistics before its final
statistics pass, and each rank then ends the fit with the statistics of its own share of the data.
:func:`average_replaced_buffers` runs once at the end of training, where every rank reaches the
same code, and gives every rank the cohort's value.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn


def replaced_buffers(module: nn.Module, averaged: Iterable[Tensor]) -> list[tuple[nn.Module, str]]:
    """``(owner, name)`` of each floating-point buffer of ``module`` that is not one of ``averaged``
    (the tensor objects the rounds reduce), in ``named_modules`` order (the same on every rank)."""
    kept = {id(t) for t in averaged}
    found: list[tuple[nn.Module, str]] = []
    for _, owner in module.named_modules():
        for name, buffer in owner.named_buffers(recurse=False):
            if buffer is not None and buffer.is_floating_point() and id(buffer) not in kept:
                found.append((owner, name))
    return found


def _batch_weight(owner: nn.Module) -> float:
    # A BatchNorm layer's statistics are a mean over the batches it tracked (SWA's pass uses
    # momentum=None: a plain cumulative average), so the cohort's value is the batch-weighted mean.
    tracked = getattr(owner, "num_batches_tracked", None)
    if isinstance(owner, nn.modules.batchnorm._BatchNorm) and isinstance(tracked, Tensor):
        return float(tracked)
    return 1.0


AllReduce = Callable[[Tensor, Any], None]
"""An in-place all-reduce of the default group (``dist.all_reduce``, or a checked one that survives a loss)."""


def _plain_all_reduce(tensor: Tensor, op: Any) -> None:
    dist.all_reduce(tensor, op=op)


def average_replaced_buffers(module: nn.Module, averaged: Iterable[Tensor], world_size: int,
                             device: torch.device, all_reduce: Optional[AllReduce] = None) -> int:
    """Give every rank the same value for each buffer that a callback replaced during the fit.

    BatchNorm statistics are averaged weighted by each rank's tracked batches (and the batch
    counts summed), other buffers equally. Collective: every rank must call it at the same point;
    ranks that replaced different buffers fail with an error naming the counts. Returns how many
    buffers were averaged. ``device`` is where the default process group reduces (CPU for gloo);
    ``all_reduce`` reduces in place (default ``dist.all_reduce``; a checked one runs again among the
    survivors of a lost peer, so the values are the survivors').
    """
    found = replaced_buffers(module, averaged)
    if world_size <= 1:
        return 0
    reduce = all_reduce or _plain_all_reduce
    counts = torch.tensor([len(found), -len(found)], dtype=torch.float64, device=device)
    reduce(counts, dist.ReduceOp.MAX)
    most, fewest = int(counts[0]), -int(counts[1])
    if most != fewest:
        raise RuntimeError(
            f"ElCheStrategy: ranks replaced different numbers of module buffers during the fit (between {fewest} "
            f"and {most}; rank {dist.get_rank()}: {len(found)}), so they cannot be brought to one value."
        )
    if not found:
        return 0
    weights = [_batch_weight(owner) for owner, _ in found]
    values = [getattr(owner, name).detach().to(device, torch.float64).flatten() * w
              for (owner, name), w in zip(found, weights, strict=True)]
    packed = torch.cat([*values, torch.tensor(weights, dtype=torch.float64, device=device)])
    reduce(packed, dist.ReduceOp.SUM)
    totals = packed[-len(found):]
    offset = 0
    for (owner, name), value, total in zip(found, values, totals.tolist(), strict=True):
        buffer = getattr(owner, name)
        chunk = packed[offset : offset + value.numel()]
        offset += value.numel()
        if total > 0:
            buffer.copy_((chunk / total).view_as(buffer))  # copy_ casts and moves to the buffer's device
        tracked = getattr(owner, "num_batches_tracked", None)
        if isinstance(owner, nn.modules.batchnorm._BatchNorm) and isinstance(tracked, Tensor):
            tracked.fill_(int(round(total)))  # the cohort's batches (the weights' sum)
    return len(found)
