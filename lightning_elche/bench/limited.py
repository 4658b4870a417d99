"""The rank processes' side of memory-limited ranks (:mod:`lightning_elche.bench.limits`): the limit
around a fit, and the ``auto`` search each rank runs once before the plan, so that the solo fits and
the DDP arms know every rank's micro-batch before the ElChe arms choose theirs.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_elche.bench.limits import AUTO, RankSize, planned_sizes
from lightning_elche.bench.workloads import Workload
from lightning_elche.micro_batch import split_batch, step_loss
from lightning_elche.micro_batch_auto import CudaTry, choose_on_cuda, usable_memory


@contextmanager
def memory_limit(device: torch.device, fraction: Optional[float]) -> Iterator[None]:
    """This process may allocate at most ``fraction`` of ``device``'s memory inside (None: no limit).

    The cache is emptied first: the caching allocator serves a request from blocks it already holds
    without looking at the limit, so blocks left by an earlier, unlimited fit would let the rank
    exceed it. It is emptied again at the end, before the limit is lifted."""
    if fraction is None or device.type != "cuda":
        yield
        return
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    try:
        yield
    finally:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(1.0, device)


def search_auto(workload: Workload, batch: int, rank: int, device: torch.device,
                fraction: Optional[float]) -> dict[str, Any]:
    """``micro_batch='auto'``'s choice for this rank, as the fit's own search makes it (a fresh module,
    the first ``batch`` samples, no optimizer state), under the rank's limit."""
    with memory_limit(device, fraction):  # the module and the batch are released before the limit is lifted
        usable = usable_memory(device)
        chosen = _search(workload, batch, rank, device)
    return {"chosen": chosen, "usable_bytes": usable, "memory_fraction": fraction}


def _search(workload: Workload, batch: int, rank: int, device: torch.device) -> int:
    module = workload.make_module().to(device)
    whole = workload.train_set().__getitems__(list(range(batch)))
    trial = CudaTry(module, device, lambda micro: step_loss(module.training_step(micro, 0), 0, 1))
    return choose_on_cuda(whole, batch, rank, device, trial, False, lambda b, size: split_batch(b, size)[0])


def plan_micro_batches(workload: Workload, micro: tuple[RankSize, ...], memory: tuple[Optional[float], ...],
                       batch: int, rank: int, device: torch.device, group: Any) -> tuple[list[int], list[Any]]:
    """(every rank's micro-batch before the fits, every rank's search record or None). Every rank
    calls it at the same point (one gather on the harness's ``group``)."""
    mine: Optional[dict[str, Any]] = None
    if micro[rank] == AUTO:
        if device.type == "cuda":
            mine = search_auto(workload, batch, rank, device, memory[rank] if memory else None)
        else:
            mine = {"chosen": batch, "usable_bytes": None}  # "auto" on a CPU rank: the whole batch
    gathered: list[Any] = [None] * len(micro)
    dist.all_gather_object(gathered, mine, group=group)
    searched = {r: int(found["chosen"]) for r, found in enumerate(gathered) if found is not None}
    return planned_sizes(micro, batch, searched), gathered
