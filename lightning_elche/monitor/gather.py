"""The monitor's one collective: at the end of an epoch, every rank's per-sync user scalars.

User scalars are known only to the rank that logged them, so each rank sends its own entries
(JSON, padded to the longest rank's length) in two all-gathers, once per epoch, where every rank
has left the epoch after the same round. Nothing here runs inside the training steps.
"""

from __future__ import annotations

import json
from typing import Any

import torch


def gather_entries(strategy: Any, entries: list[dict[str, Any]], world_size: int) -> list[list[dict[str, Any]]]:
    """Every rank's ``entries`` (JSON-ready dicts), by rank, on every rank; a collective when
    ``world_size > 1`` (``strategy.all_gather`` on ``strategy.root_device``). Entries that cannot
    be written as strict JSON are sent as none."""
    try:
        payload = json.dumps(entries, separators=(",", ":"), allow_nan=False).encode("utf-8")
    except (TypeError, ValueError):
        payload = b"[]"
    if world_size == 1:
        blobs = [payload]
    else:
        device = strategy.root_device
        size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
        sizes = strategy.all_gather(size).reshape(-1).tolist()
        length = max(1, int(max(sizes)))
        buffer = torch.zeros(length, dtype=torch.uint8)
        if payload:
            buffer[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        rows = strategy.all_gather(buffer.to(device)).reshape(world_size, length).cpu()
        blobs = [bytes(rows[k, : int(sizes[k])].tolist()) for k in range(world_size)]
    out: list[list[dict[str, Any]]] = []
    for blob in blobs:
        try:
            received = json.loads(blob.decode("utf-8")) if blob else []
        except ValueError:
            received = []
        out.append(received if isinstance(received, list) else [])
    return out
