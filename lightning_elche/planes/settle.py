"""The end of an out-of-place round: the consensus moves into the live buffers and the drift is
measured on the way, in one pass.

An out-of-place round (:meth:`~lightning_elche.planes.collective.CollectivePlane.average`) reduces
the live parameters into a round buffer and leaves them as they were until every collective has
finished, so the live values *are* the pre-round values: nothing is copied aside before the round,
and a round that failed on a lost peer has nothing to restore. Settling reads each value of both
once and writes the consensus over the live one: three passes over the model, where the in-place
round needs four (the copy aside reads and writes, the measurement reads both).

On CUDA with Triton one kernel does it: a grid the size of the device (not of the buffer), each
program striding over the buffer with 16-byte accesses and keeping its three sums of squares in
registers; the program that finishes last sums every program's partials in float64, in program
order, and takes the square roots. Elsewhere :func:`settle_multi_tensor` does the same with
PyTorch's multi-tensor kernels.

The kernel walks the buffer from its end, where the collective wrote last (the part the L2 cache
may still hold), and marks every value as touched once (loads ``evict_first``, stores streaming),
so that what it has read does not push out what it has still to read. Inside the round on one H100
(``tools/probe_settle.py``, 2026-12-07) the two took the settling of 77 MB from 123 µs to 74 µs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from lightning_elche.averaging import divergence_norms
from lightning_elche.planes.fused import FINISH_BLOCK, FUSED_DTYPES, HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from lightning_elche.planes.fused import finish_norms

SETTLE_BLOCK = 1024
"""Values a program moves per step of its stride. Inside the round on one H100 (2026-12-07,
``docs/benchmarks.md``), walking forward without cache hints, 4096 took 395 µs at 77 MB and 1024
took 118 µs, although both took about 85 µs timed alone; walking back with the hints, 1024 and 2048
took 74 µs (``tools/probe_settle.py``)."""
PROGRAMS_PER_SM = 4
SETTLE_WARPS = 8


@dataclass(frozen=True)
class Settled:
    """One joint buffer of a round: its live values, the round's consensus of them (at least as
    long), and how many of its first values are parameters (the rest are buffers: moved, not measured)."""

    live: Tensor
    consensus: Tensor
    measured: int


# Triton compiles these sources itself: a parameter may carry no annotation but ``tl.constexpr``.
def _add_squares_source(pre, consensus, index, measured, squares, norms, after):  # type: ignore[no-untyped-def]
    """One block's values added to a program's three sums of squares (``pre - consensus``, ``pre``,
    ``consensus``), over the indices below ``measured`` alone."""
    counted = index < measured
    pre32 = tl.where(counted, pre.to(tl.float32), 0.0)
    consensus32 = tl.where(counted, consensus.to(tl.float32), 0.0)
    delta = pre32 - consensus32
    return squares + delta * delta, norms + pre32 * pre32, after + consensus32 * consensus32


def _end_program_source(partial_ptr, program, squares, norms, after,  # type: ignore[no-untyped-def]
                        tickets_ptr, out_ptr, total_programs, FINISH_BLOCK: tl.constexpr):
    """A program's three partial sums stored in its slot, then the round's finish
    (:func:`~lightning_elche.planes.fused._finish_source`)."""
    out = partial_ptr + 3 * program
    tl.store(out, tl.sum(squares, axis=0))
    tl.store(out + 1, tl.sum(norms, axis=0))
    tl.store(out + 2, tl.sum(after, axis=0))
    finish_norms(partial_ptr, tickets_ptr, out_ptr, total_programs, FINISH_BLOCK)


def _settle_source(live_ptr, consensus_ptr, numel, measured, partial_ptr, first_program,  # type: ignore[no-untyped-def]
                   tickets_ptr, out_ptr, total_programs, BLOCK: tl.constexpr, FINISH_BLOCK: tl.constexpr):
    """One program: blocks ``program_id``, ``program_id + num_programs``, ... of ``numel`` values
    (a multiple of 16, over the live buffer's spare tail where needed), counted from the end; the
    consensus written over the live values; the sums of squares over the first ``measured`` ones."""
    program = tl.program_id(0)
    last = tl.cdiv(numel, BLOCK) - 1
    squares = tl.zeros((BLOCK,), dtype=tl.float32)
    norms = tl.zeros((BLOCK,), dtype=tl.float32)
    after = tl.zeros((BLOCK,), dtype=tl.float32)
    for step in range(program, last + 1, tl.num_programs(0)):
        index = (last - step) * BLOCK + tl.arange(0, BLOCK)
        inside = index < numel
        pre = tl.load(live_ptr + index, mask=inside, other=0.0, eviction_policy="evict_first")
        consensus = tl.load(consensus_ptr + index, mask=inside, other=0.0, eviction_policy="evict_first")
        tl.store(live_ptr + index, consensus, mask=inside, cache_modifier=".cs")
        squares, norms, after = add_squares(pre, consensus, index, measured, squares, norms, after)
    end_program(partial_ptr, first_program + program, squares, norms, after, tickets_ptr, out_ptr, total_programs,
                FINISH_BLOCK)


if HAVE_TRITON:
    add_squares = triton.jit(_add_squares_source)
    end_program = triton.jit(_end_program_source)
    _settle_kernel = triton.jit(_settle_source)


def settled_numel(flat: Tensor) -> int:
    """The values the kernel moves for ``flat``: its length rounded up to 16, so that its bound
    keeps 16-byte accesses whole (the live buffer's spare tail and the round buffer cover them)."""
    return -(-flat.numel() // 16) * 16


def fused_settle_available(joint: Sequence[Tensor]) -> bool:
    """Whether :class:`FusedSettle` can end a round of these joint buffers."""
    return HAVE_TRITON and bool(joint) and all(flat.is_cuda and flat.dtype in FUSED_DTYPES for flat in joint)


class FusedSettle:
    """The one-pass settling of one layout's joint buffers; built once per layout (its partial
    sums and ticket counter), run once per round.

    Args:
        joint: the joint flat buffers, each with at least :func:`settled_numel` values of storage.
        programs_per_sm: programs launched per multiprocessor (the grid is at most the device);
            :data:`PROGRAMS_PER_SM` when None.
    """

    def __init__(self, joint: Sequence[Tensor], programs_per_sm: Optional[int] = None) -> None:
        device = joint[0].device
        limit = (programs_per_sm or PROGRAMS_PER_SM) * _multiprocessors(device)
        self._block, self._warps = SETTLE_BLOCK, SETTLE_WARPS
        self._grids = [max(1, min(limit, -(-settled_numel(flat) // self._block))) for flat in joint]
        self._programs = sum(self._grids)
        self._partials = torch.empty(3 * self._programs, dtype=torch.float32, device=device)
        self._tickets = torch.zeros(1, dtype=torch.int32, device=device)  # programs finished this round

    def __call__(self, settled: Sequence[Settled]) -> Tensor:
        """Move each consensus into its live buffer; ``[||pre - consensus||, ||pre||,
        ||consensus||]`` over the parameters (float64, on the device)."""
        out = torch.empty(3, dtype=torch.float64, device=self._partials.device)
        first = 0
        for grid, one in zip(self._grids, settled, strict=True):
            numel = settled_numel(one.live)
            assert one.consensus.numel() >= numel, "the round buffer must cover the rounded length"
            _settle_kernel[(grid,)](one.live, one.consensus, numel, one.measured, self._partials, first,
                                    self._tickets, out, self._programs,
                                    BLOCK=self._block, FINISH_BLOCK=FINISH_BLOCK, num_warps=self._warps)
            first += grid
        return out


def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":  # Triton's interpreter (tests): any grid does
        return 8
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def settle_multi_tensor(settled: Sequence[Settled]) -> Tensor:
    """:class:`FusedSettle`'s result with PyTorch's multi-tensor kernels (any device)."""
    measured = [one for one in settled if one.measured]
    if measured:
        divergence = divergence_norms([one.live[:one.measured] for one in measured],  # overwritten: moved next
                                      [one.consensus[:one.measured] for one in measured])
    else:
        divergence = torch.zeros(3, dtype=torch.float64, device=settled[0].live.device)
    torch._foreach_copy_([one.live for one in settled], [one.consensus[:one.live.numel()] for one in settled])
    return divergence


def settle_or_none(joint: Sequence[Tensor]) -> Optional[FusedSettle]:
    """A :class:`FusedSettle` for the joint buffers, or None where it cannot run."""
    return FusedSettle(joint) if fused_settle_available(joint) else None
