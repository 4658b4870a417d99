"""The drift measurement of a round in one pass over the parameters, on CUDA (Triton).

``||pre - consensus||``, ``||pre||`` and ``||consensus||`` need each value of the pre-round copy
and of the consensus once. PyTorch's multi-tensor kernels take five passes for them (the norms of
the copy, a subtraction in place, the norms of the difference and of the consensus); one Triton
kernel reads both once, every tensor of the round in the same launch (a table of their
addresses: the pre-round values live in the gradients, which the allocator places anywhere), and
its last program sums the per-block partials in float64 and takes the square roots. One launch
per parameter dtype instead of about ten, two passes instead of five.

On NCCL the launch is queued behind the round's reduce on a side stream (:class:`QueuedDrift`),
before the host starts polling the reduce for a lost peer, so the device goes from the reduce to
the measurement without waiting for the host.

Without Triton, or off CUDA, :func:`fused_drift_available` is False and the plane keeps the
multi-tensor path (:func:`~lightning_elche.averaging.divergence_norms`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Optional

import torch
from torch import Tensor

try:  # Triton comes with PyTorch's CUDA wheels; CPU-only installs have none.
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the install
    HAVE_TRITON = False

BLOCK = 4096
"""Values per program of the drift kernel."""
FINISH_BLOCK = 1024
FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# Triton compiles these sources itself: a parameter may carry no annotation but ``tl.constexpr``
# (it resolves every other one as a global of the kernel, and fails).
def _drift_source(live_ptr, offsets_ptr, saved_addresses_ptr, sizes_ptr, block_tensor_ptr,  # type: ignore[no-untyped-def]
                  block_start_ptr, partial_ptr, first_block, tickets_ptr, out_ptr, total_blocks,
                  BLOCK: tl.constexpr, FINISH_BLOCK: tl.constexpr):
    """One program: one block of one tensor; its three partial sums of squares. The program that
    finishes last (of every launch of the round: they share the ticket counter) sums the partials
    of all, in float64 and in block order (the result does not depend on which program is last),
    takes the square roots and resets the counter for the next round."""
    block = tl.program_id(0)
    tensor = tl.load(block_tensor_ptr + block)
    start = tl.load(block_start_ptr + block)
    size = tl.load(sizes_ptr + tensor)
    offset = tl.load(offsets_ptr + tensor)
    saved = tl.load(saved_addresses_ptr + tensor).to(tl.pointer_type(live_ptr.dtype.element_ty))
    index = start + tl.arange(0, BLOCK)
    mask = index < size
    pre = tl.load(saved + index, mask=mask, other=0.0).to(tl.float32)
    consensus = tl.load(live_ptr + offset + index, mask=mask, other=0.0).to(tl.float32)
    delta = pre - consensus
    out = partial_ptr + 3 * (first_block + block)
    tl.store(out, tl.sum(delta * delta, axis=0))
    tl.store(out + 1, tl.sum(pre * pre, axis=0))
    tl.store(out + 2, tl.sum(consensus * consensus, axis=0))
    # Every thread's partial stores come before the ticket; its release orders them for the
    # program that draws the last ticket, whose acquire makes them visible to its loads.
    tl.debug_barrier()
    ticket = tl.atomic_add(tickets_ptr, 1, sem="acq_rel")
    if ticket == total_blocks - 1:
        squares = tl.zeros((FINISH_BLOCK,), dtype=tl.float64)
        norms = tl.zeros((FINISH_BLOCK,), dtype=tl.float64)
        after = tl.zeros((FINISH_BLOCK,), dtype=tl.float64)
        for first in range(0, total_blocks, FINISH_BLOCK):
            rows = first + tl.arange(0, FINISH_BLOCK)
            valid = rows < total_blocks
            squares += tl.load(partial_ptr + 3 * rows, mask=valid, other=0.0, cache_modifier=".cg").to(tl.float64)
            norms += tl.load(partial_ptr + 3 * rows + 1, mask=valid, other=0.0, cache_modifier=".cg").to(tl.float64)
            after += tl.load(partial_ptr + 3 * rows + 2, mask=valid, other=0.0, cache_modifier=".cg").to(tl.float64)
        tl.store(out_ptr, tl.sqrt(tl.sum(squares, axis=0)))
        tl.store(out_ptr + 1, tl.sqrt(tl.sum(norms, axis=0)))
        tl.store(out_ptr + 2, tl.sqrt(tl.sum(after, axis=0)))
        tl.store(tickets_ptr, 0)


if HAVE_TRITON:
    _drift_kernel = triton.jit(_drift_source)


def fused_drift_available(joint: Sequence[Tensor]) -> bool:
    """Whether :class:`FusedDrift` can measure a round of these joint buffers."""
    return HAVE_TRITON and bool(joint) and all(
        flat.is_cuda and flat.dtype in FUSED_DTYPES for flat in joint
    )


class FusedDrift:
    """The drift of one layout's parameters: built once per layout (the block tables), run once
    per round with that round's pre-round tensors (their addresses change from round to round).

    Args:
        joint: the layout's joint flat buffers (one per dtype), where the parameters live.
        current: each parameter's live view (slices of ``joint``), in :class:`PreRoundValues` order.
    """

    def __init__(self, joint: Sequence[Tensor], current: Sequence[Tensor]) -> None:
        device = current[0].device
        self._groups: list[tuple[Tensor, list[int], Tensor, Tensor, Tensor, Tensor, int, int]] = []
        blocks = 0
        for flat in joint:
            members = [i for i, view in enumerate(current)
                       if view.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()]
            if not members:
                continue
            sizes = [int(current[i].numel()) for i in members]
            offsets = [int(current[i].storage_offset() - flat.storage_offset()) for i in members]
            block_tensor = [t for t, n in enumerate(sizes) for _ in range(-(-n // BLOCK))]
            block_start = [b * BLOCK for n in sizes for b in range(-(-n // BLOCK))]

            def table(values: list[int]) -> Tensor:
                return torch.tensor(values, dtype=torch.int64, device=device)

            self._groups.append((flat, members, table(offsets), table(sizes), table(block_tensor),
                                 table(block_start), blocks, len(block_tensor)))
            blocks += len(block_tensor)
        self._blocks = blocks
        self._partials = torch.empty(3 * max(blocks, 1), dtype=torch.float32, device=device)
        self._tickets = torch.zeros(1, dtype=torch.int32, device=device)  # programs finished this round
        self._tables: dict[int, tuple[list[int], Tensor]] = {}

    def _address_table(self, group: int, addresses: list[int]) -> Tensor:
        """The device copy of a group's pre-round addresses. The allocator usually hands a step's
        gradients the same blocks every step, so the table is mostly the last round's; a new one
        goes up from pinned memory without the host waiting for the device (a pageable copy
        would wait for every kernel queued before it)."""
        cached = self._tables.get(group)
        if cached is not None and cached[0] == addresses:
            return cached[1]
        device = self._partials.device
        host = torch.tensor(addresses, dtype=torch.int64, pin_memory=device.type == "cuda")
        table = host.to(device, non_blocking=True)
        self._tables[group] = (addresses, table)
        return table

    def __call__(self, addresses: Sequence[int], out: Optional[Tensor] = None) -> Tensor:
        """``[||pre - consensus||, ||pre||, ||consensus||]`` (float64, on the device) of the round
        whose pre-round values are at ``addresses`` (one tensor per live view, in its order,
        with its dtype and strides), written into ``out`` if given."""
        if out is None:
            out = torch.empty(3, dtype=torch.float64, device=self._partials.device)
        whole = len(self._groups) == 1 and len(self._groups[0][1]) == len(addresses)
        for group, (flat, members, offsets, sizes, block_tensor, block_start, first, count) in enumerate(self._groups):
            saved = self._address_table(group, list(addresses) if whole else [addresses[i] for i in members])
            _drift_kernel[(count,)](flat, offsets, saved, sizes, block_tensor, block_start, self._partials,
                                    first, self._tickets, out, self._blocks,
                                    BLOCK=BLOCK, FINISH_BLOCK=FINISH_BLOCK, num_warps=8)
        return out


def drift_or_none(joint: Sequence[Tensor], current: Sequence[Tensor]) -> Optional[Any]:
    """A :class:`FusedDrift` for the layout, or None where it cannot run (the plane then keeps
    the multi-tensor path)."""
    if not current or not fused_drift_available(joint):
        return None
    return FusedDrift(joint, current)


class QueuedDrift:
    """A round's drift measurement launched on a side stream that waits for the round's reduce.

    The host launches it while the reduce runs, so the launch hides behind the reduce and the
    device needs no host step between the two; the training stream depends on the reduce only
    through :meth:`result`, once the round's collectives are known to have finished. The side
    stream of a round that failed is never joined: :meth:`abandon` keeps it, and the buffers its
    kernel writes, referenced for the rest of the process (the kernels queued behind an abandoned
    reduce may still run late).

    Args:
        drift: the layout's measurement (its partial sums and ticket counter are written here).
        stream: the side stream.
    """

    _abandoned: ClassVar[list[tuple[Any, ...]]] = []

    def __init__(self, drift: FusedDrift, stream: Any) -> None:
        self.drift, self.stream = drift, stream
        self._out: Optional[Tensor] = None

    def launch(self, works: Sequence[Any], addresses: Sequence[int]) -> None:
        """Queue the measurement behind ``works`` (NCCL's ``wait()`` orders the current stream
        after a collective, without the host waiting); ``addresses`` as :class:`FusedDrift` takes them."""
        training = torch.cuda.current_stream(self.stream.device)
        # Allocated on the training stream, which reads it: the side stream only writes it.
        self._out = torch.empty(3, dtype=torch.float64, device=self.stream.device)
        self.stream.wait_stream(training)  # the pre-round copy and the scaling
        with torch.cuda.stream(self.stream):
            for work in works:
                work.wait()
            self.drift(addresses, self._out)

    def result(self) -> Tensor:
        """The measurement; the training stream waits for it (and so for the reduce)."""
        assert self._out is not None, "result() without launch()"
        torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
        return self._out

    def abandon(self) -> None:
        """The round failed: never join the side stream, and keep what its kernel may still write."""
        QueuedDrift._abandoned.append((self.stream, self.drift, self._out))


def queue_drift(drift: FusedDrift, stream: Any, works: Sequence[Any],
                addresses: Sequence[int]) -> Optional[QueuedDrift]:
    """The measurement launched behind ``works``, or None where a collective had already failed
    when asked to order the stream (the caller's watched wait then reports it); what was queued
    is abandoned."""
    queued = QueuedDrift(drift, stream)
    try:
        queued.launch(works, addresses)
    except Exception:
        queued.abandon()
        return None
    return queued
