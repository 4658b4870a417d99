"""Memory of one fit: peak accelerator memory per rank, and the pinned host memory a strategy holds.

Accelerator memory is PyTorch's caching allocator's own count for this process:
``torch.cuda.reset_peak_memory_stats`` right before ``Trainer.fit``, ``max_memory_allocated`` and
``max_memory_reserved`` right after it. The allocated bytes at the reset (``baseline``: the
device-resident data set, the workloads kept between fits) are recorded, so that the growth a fit
itself causes (``peak - baseline``) can be told apart from what was there before it.

Pinned host memory is counted two ways, both recorded:

* ``pinned_held``: the bytes of the pinned tensors the averaging plane holds at the end of
  training (found by walking the plane's attributes, before the strategy's teardown releases
  them): what a ``cpu_*`` mode keeps for its host snapshots and consensus.

PyTorch's pinned host allocator statistics are not used: on torch 2.11 their peak read tens of
GB for a single-process fit that pins a few hundred MB (the counter is not reset per fit).

On a CPU device nothing is measured (``None``): CPU rigs report "n/a (CPU)".
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

_WALK_DEPTH = 3
"""Attribute levels searched for pinned tensors below the plane (plane -> mirror -> list)."""


def reset_peaks(device: torch.device) -> Optional[int]:
    """Start a fit's measurement; returns the allocated bytes now (None on a CPU device)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return int(torch.cuda.memory_allocated(device))


def read_peaks(device: torch.device, baseline: Optional[int]) -> Optional[dict[str, Any]]:
    """The fit's peaks (bytes), after ``fit`` returned; None on a CPU device."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return {
        "peak_allocated": int(torch.cuda.max_memory_allocated(device)),
        "peak_reserved": int(torch.cuda.max_memory_reserved(device)),
        "baseline_allocated": baseline,
    }


def pinned_bytes(root: Any) -> int:
    """Bytes of the distinct pinned host tensors reachable from ``root`` through attributes,
    lists, tuples and dicts, ``_WALK_DEPTH`` levels deep (a tensor's storage counted once)."""
    seen_objects: set[int] = set()
    seen_storage: set[int] = set()
    total = 0

    def visit(obj: Any, depth: int) -> None:
        nonlocal total
        if id(obj) in seen_objects:
            return
        seen_objects.add(id(obj))
        if isinstance(obj, Tensor):
            if obj.device.type == "cpu" and obj.is_pinned():
                storage = obj.untyped_storage()
                if storage.data_ptr() not in seen_storage:
                    seen_storage.add(storage.data_ptr())
                    total += storage.nbytes()
            return
        if depth > _WALK_DEPTH:
            return
        if isinstance(obj, (list, tuple)):
            children: list[Any] = list(obj)
        elif isinstance(obj, dict):
            children = list(obj.values())
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            children = list(vars(obj).values())
        else:
            return
        for child in children:
            visit(child, depth + 1)

    visit(root, 0)
    return total


def plane_pinned_bytes(strategy: Any) -> Optional[int]:
    """Pinned host bytes held by an ElChe strategy's averaging plane (None: no plane, or no CUDA)."""
    engine = getattr(strategy, "engine", None)
    plane = getattr(engine, "plane", None)
    if plane is None or not torch.cuda.is_available():
        return None
    return pinned_bytes(plane)
