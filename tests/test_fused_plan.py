"""How :class:`~lightning_elche.planes.fused.FusedDrift` splits a round into launches, on the CPU
without Triton: which members are read 16 bytes at a time, and the parts of the round in parts.
The kernels themselves run in ``tests/test_fused_drift_interpreter.py`` and on the GPU."""

from __future__ import annotations

import pytest
import torch

from lightning_elche.planes.fused import BLOCK, FusedDrift

# Members on 16 bytes that fill whole 16-byte words (float32: offsets and sizes in fours), others
# between them: a bias of 10, one of 6 that ends on 16 bytes but starts off them, an odd one.
SIZES = [BLOCK * 2, 10, 6, BLOCK + 8, 3, BLOCK * 3 + 5, 16]
WIDE = [0, 3, 6]  # in float32 and in bfloat16 (words of 8)


def drift_of(sizes: list[int], dtype: torch.dtype = torch.float32, shift: int = 0) -> tuple[FusedDrift, torch.Tensor]:
    room = torch.zeros(sum(sizes) + 8, dtype=dtype)
    flat = room[shift:shift + sum(sizes)]
    return FusedDrift([flat], list(torch.split(flat, sizes))), flat


def places(sizes: list[int], dtype: torch.dtype, off: int = 0) -> list[int]:
    """Pre-round places for each member, ``off`` elements past 16 bytes."""
    return [torch.empty(n + 16, dtype=dtype)[off:].data_ptr() for n in sizes]


def blocks_of(sizes: list[int], members: list[int]) -> int:
    return sum(-(-sizes[t] // BLOCK) for t in members)


@pytest.mark.parametrize(("dtype", "wide"), [(torch.float32, WIDE), (torch.bfloat16, WIDE)])
def test_members_on_whole_16_byte_words_go_first_in_a_launch_of_their_own(dtype, wide):
    drift, _ = drift_of(SIZES, dtype)
    group = drift._groups[0]
    assert group.vector == 16 // dtype.itemsize
    assert group.vector_members == wide
    split = blocks_of(SIZES, wide)
    assert group.vector_blocks == split
    (table,) = drift.tables(places(SIZES, dtype))
    assert table.wide
    assert drift._launches(group, table, 0, group.count) == [(0, split, group.vector), (split, group.count - split, 1)]
    # A run inside either kind is one launch; one across the boundary is cut at it.
    assert drift._launches(group, table, 1, split - 1) == [(1, split - 1, group.vector)]
    assert drift._launches(group, table, split, 2) == [(split, 2, 1)]
    assert drift._launches(group, table, split - 1, 3) == [(split - 1, 1, group.vector), (split, 2, 1)]


def test_a_round_whose_pre_round_places_are_off_16_bytes_reads_narrow():
    drift, _ = drift_of(SIZES)
    group = drift._groups[0]
    (table,) = drift.tables(places(SIZES, torch.float32, off=1))
    assert not table.wide
    assert drift._launches(group, table, 0, group.count) == [(0, group.count, 1)]
    (table,) = drift.tables(places(SIZES, torch.float32))  # the next round's places are on 16 bytes
    assert table.wide and len(drift._launches(group, table, 0, group.count)) == 2


def test_wide_loads_can_be_turned_off_and_a_buffer_off_16_bytes_has_no_wide_member(monkeypatch):
    drift, _ = drift_of(SIZES)
    group = drift._groups[0]
    (table,) = drift.tables(places(SIZES, torch.float32))
    monkeypatch.setattr(FusedDrift, "wide_loads", False)
    assert drift._launches(group, table, 0, group.count) == [(0, group.count, 1)]
    shifted, _ = drift_of(SIZES, shift=1)
    assert shifted._groups[0].vector == 1 and shifted._groups[0].vector_blocks == 0


@pytest.mark.parametrize("sizes", [SIZES, [BLOCK * 3, BLOCK * 2 + 4, 8], [7, BLOCK + 1, 5]])
@pytest.mark.parametrize("chunk_bytes", [1, BLOCK * 4, BLOCK * 4 * 3, 1 << 30])
def test_each_part_measures_exactly_the_blocks_that_start_inside_it(sizes, chunk_bytes):
    drift, flat = drift_of(sizes)
    group = drift._groups[0]
    plan = drift.chunks(chunk_bytes)
    assert torch.equal(torch.cat([chunk.view for chunk in plan]), flat)
    assert [chunk.view.data_ptr() for chunk in plan] == sorted(chunk.view.data_ptr() for chunk in plan)
    seen: list[int] = []
    for chunk in plan:
        low = chunk.view.storage_offset() - flat.storage_offset()
        high = low + chunk.view.numel()
        assert len(chunk.runs) <= 2
        inside = [b for first, count in chunk.runs for b in range(first, first + count)]
        assert all(low <= group.block_positions[b] < high for b in inside)
        seen += inside
    assert sorted(seen) == list(range(group.count)), "every block measured once"
    # A part spans at least a block's values (the smallest part asked for) and at most the asked
    # size plus one block, so that no part is cut between a block's start and its end.
    target = max(chunk_bytes // 4, BLOCK)
    assert all(target <= chunk.view.numel() < target + BLOCK for chunk in plan[:-1])
    assert (len(plan) > 1) == (max(group.block_positions) >= target)
