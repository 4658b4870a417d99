"""The epoch's order and how it is cut: pure functions every rank computes identically."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

import torch

from lightning_elche.coverage import Range

SMALLEST_LAYOUT_SHARE = 0.02
"""The chunk layout plans for a slowest rank with at least this share of the cohort's speed."""


def epoch_permutation(num_samples: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    """The epoch's sample order: ``DistributedSampler``'s, so sync modes reproduce DDP's batches."""
    if not shuffle:
        return list(range(num_samples))
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(num_samples, generator=generator).tolist()


def chunk_layout(
    num_batches: int, world_size: int, max_chunk_batches: int, smallest_share: Optional[float] = None
) -> list[tuple[int, int]]:
    """Cut ``num_batches`` into ``(first_batch, batch_count)`` chunks, shrinking toward the end.

    Chunks are ``max_chunk_batches`` long while plenty remains and at most half the slowest rank's
    share of what remains after that (``smallest_share``, default an equal share ``1 /
    world_size``), down to single batches (guided scheduling). When the pool runs dry no rank then
    holds more than about one batch of work the others must wait for, and a slow rank deciding to
    leave the tail (:class:`~lightning_elche.dispatch.tail.TailRule`) faces chunks small against
    its share.
    """
    chunks: list[tuple[int, int]] = []
    start = 0
    while start < num_batches:
        remaining = num_batches - start
        if smallest_share is None:
            half_share = remaining // (2 * world_size)
        else:
            half_share = math.floor(remaining * smallest_share / 2.0)
        size = max(1, min(max_chunk_batches, half_share))
        chunks.append((start, size))
        start += size
    return chunks


def fixed_share_batches(num_batches: int, ratios: Sequence[float]) -> list[int]:
    """Whole batches per rank for fixed shares: floor of each share, remainder by largest share."""
    counts = [math.floor(r * num_batches) for r in ratios]
    order = sorted(range(len(ratios)), key=lambda r: (-ratios[r], r))
    for i in range(num_batches - sum(counts)):
        counts[order[i % len(order)]] += 1
    return counts


def batches_of(span: Range, batch_size: int, drop_last: bool) -> list[Range]:
    """``[start, stop)`` cut into the DataLoader's batches (a short last one only without drop_last)."""
    start, stop = span
    cuts = [(s, min(s + batch_size, stop)) for s in range(start, stop, batch_size)]
    if drop_last and cuts and cuts[-1][1] - cuts[-1][0] < batch_size:
        cuts.pop()
    return cuts


def batch_count(picks: int, batch_size: int, drop_last: bool) -> int:
    """How many batches :func:`batches_of` cuts ``picks`` consecutive picks into, in O(1)."""
    return picks // batch_size if drop_last else math.ceil(picks / batch_size)
