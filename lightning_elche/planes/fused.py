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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
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
def _block_source(live_ptr, offsets_ptr, saved_addresses_ptr, sizes_ptr, block_tensor_ptr,  # type: ignore[no-untyped-def]
                  block_start_ptr, block):
    """Where block ``block`` of the tables lives: its tensor's pre-round and live values (base
    pointers), the block's first index in that tensor and the tensor's size."""
    tensor = tl.load(block_tensor_ptr + block)
    saved = tl.load(saved_addresses_ptr + tensor).to(tl.pointer_type(live_ptr.dtype.element_ty))
    live = live_ptr + tl.load(offsets_ptr + tensor)
    return saved, live, tl.load(block_start_ptr + block), tl.load(sizes_ptr + tensor)


def _drift_source(live_ptr, offsets_ptr, saved_addresses_ptr, sizes_ptr, block_tensor_ptr,  # type: ignore[no-untyped-def]
                  block_start_ptr, partial_ptr, first_block, tickets_ptr, out_ptr, total_blocks, block_base,
                  BLOCK: tl.constexpr, FINISH_BLOCK: tl.constexpr):
    """One program: one block of one tensor (``block_base`` onwards: a launch may cover part of a
    group); its three partial sums of squares, then :func:`_finish_source`."""
    block = block_base + tl.program_id(0)
    saved, live, start, size = _block(live_ptr, offsets_ptr, saved_addresses_ptr, sizes_ptr, block_tensor_ptr,
                                      block_start_ptr, block)
    index = start + tl.arange(0, BLOCK)
    mask = index < size
    pre = tl.load(saved + index, mask=mask, other=0.0).to(tl.float32)
    consensus = tl.load(live + index, mask=mask, other=0.0).to(tl.float32)
    delta = pre - consensus
    out = partial_ptr + 3 * (first_block + block)
    tl.store(out, tl.sum(delta * delta, axis=0))
    tl.store(out + 1, tl.sum(pre * pre, axis=0))
    tl.store(out + 2, tl.sum(consensus * consensus, axis=0))
    finish_norms(partial_ptr, tickets_ptr, out_ptr, total_blocks, FINISH_BLOCK)


def _finish_source(partial_ptr, tickets_ptr, out_ptr, total, FINISH_BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    """A program's end, after it stored its three partial sums of squares: it draws a ticket, and
    the program that draws the last of the ``total`` (every launch of the round shares the
    counter) sums every partial in float64 and in partial order (the result does not depend on
    which program is last), writes the three square roots and resets the counter for the next round."""
    # Every thread's partial stores come before the ticket; its release orders them for the
    # program that draws the last ticket, whose acquire makes them visible to its loads.
    tl.debug_barrier()
    ticket = tl.atomic_add(tickets_ptr, 1, sem="acq_rel")
    if ticket == total - 1:
        squares = tl.zeros((FINISH_BLOCK,), dtype=tl.float64)
        norms = tl.zeros((FINISH_BLOCK,), dtype=tl.float64)
        after = tl.zeros((FINISH_BLOCK,), dtype=tl.float64)
        for first in range(0, total, FINISH_BLOCK):
            rows = first + tl.arange(0, FINISH_BLOCK)
            valid = rows < total
            squares += tl.load(partial_ptr + 3 * rows, mask=valid, other=0.0, cache_modifier=".cg").to(tl.float64)
            norms += tl.load(partial_ptr + 3 * rows + 1, mask=valid, other=0.0, cache_modifier=".cg").to(tl.float64)
            after += tl.load(partial_ptr + 3 * rows + 2, mask=valid, other=0.0, cache_modifier=".cg").to(tl.float64)
        tl.store(out_ptr, tl.sqrt(tl.sum(squares, axis=0)))
        tl.store(out_ptr + 1, tl.sqrt(tl.sum(norms, axis=0)))
        tl.store(out_ptr + 2, tl.sqrt(tl.sum(after, axis=0)))
        tl.store(tickets_ptr, 0)


def _copy_source(live_ptr, offsets_ptr, saved_addresses_ptr, sizes_ptr, block_tensor_ptr,  # type: ignore[no-untyped-def]
                 block_start_ptr, block_base, BLOCK: tl.constexpr):
    """One program: one block of one tensor copied from the live parameters to its pre-round place."""
    saved, live, start, size = _block(live_ptr, offsets_ptr, saved_addresses_ptr, sizes_ptr, block_tensor_ptr,
                                      block_start_ptr, block_base + tl.program_id(0))
    index = start + tl.arange(0, BLOCK)
    mask = index < size
    tl.store(saved + index, tl.load(live + index, mask=mask), mask=mask)


if HAVE_TRITON:
    _block = triton.jit(_block_source)
    finish_norms = triton.jit(_finish_source)
    # A chunk's first block changes from launch to launch: one compiled kernel for every value.
    _drift_kernel = triton.jit(_drift_source, do_not_specialize=["block_base"])
    _copy_kernel = triton.jit(_copy_source, do_not_specialize=["block_base"])


def fused_drift_available(joint: Sequence[Tensor]) -> bool:
    """Whether :class:`FusedDrift` can measure a round of these joint buffers."""
    return HAVE_TRITON and bool(joint) and all(
        flat.is_cuda and flat.dtype in FUSED_DTYPES for flat in joint
    )


@dataclass(frozen=True)
class _Group:
    """The parameters of one joint buffer (one dtype) and their block tables."""

    flat: Tensor
    members: list[int]  # indices into the live views
    offsets: Tensor
    sizes: Tensor
    block_tensor: Tensor
    block_start: Tensor
    first: int  # this group's first block among every group's
    count: int
    block_positions: list[int]  # where each block starts in ``flat`` (host), to cut chunks at


@dataclass(frozen=True)
class Chunk:
    """A contiguous part of one joint buffer reduced by a collective of its own, and the blocks of
    the measurement inside it (``group`` None: no measured parameter lives there)."""

    view: Tensor
    group: Optional[int]
    first_block: int
    blocks: int


class FusedDrift:
    """The drift of one layout's parameters: built once per layout (the block tables), run once
    per round with that round's pre-round tensors (their addresses change from round to round).

    Args:
        joint: the layout's joint flat buffers (one per dtype), where the parameters live.
        current: each parameter's live view (slices of ``joint``), in :class:`PreRoundValues` order.
    """

    def __init__(self, joint: Sequence[Tensor], current: Sequence[Tensor]) -> None:
        device = current[0].device
        self._joint = list(joint)
        self._groups: list[_Group] = []
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

            self._groups.append(_Group(
                flat, members, table(offsets), table(sizes), table(block_tensor), table(block_start), blocks,
                len(block_tensor), [offsets[t] + start for t, start in zip(block_tensor, block_start, strict=True)],
            ))
            blocks += len(block_tensor)
        self._blocks = blocks
        self._partials = torch.empty(3 * max(blocks, 1), dtype=torch.float32, device=device)
        self._tickets = torch.zeros(1, dtype=torch.int32, device=device)  # programs finished this round
        self._tables: dict[int, tuple[list[int], Tensor]] = {}
        self._plans: dict[int, list[Chunk]] = {}

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

    def tables(self, addresses: Sequence[int]) -> list[Tensor]:
        """Each group's device table of the pre-round addresses (one per live view, in its order)."""
        whole = len(self._groups) == 1 and len(self._groups[0].members) == len(addresses)
        return [self._address_table(index, list(addresses) if whole else [addresses[i] for i in group.members])
                for index, group in enumerate(self._groups)]

    def __call__(self, addresses: Sequence[int], out: Optional[Tensor] = None) -> Tensor:
        """``[||pre - consensus||, ||pre||, ||consensus||]`` (float64, on the device) of the round
        whose pre-round values are at ``addresses`` (one tensor per live view, in its order,
        with its dtype and strides), written into ``out`` if given."""
        if out is None:
            out = torch.empty(3, dtype=torch.float64, device=self._partials.device)
        tables = self.tables(addresses)
        for index, group in enumerate(self._groups):
            self._launch_drift(group, tables[index], 0, group.count, out)
        return out

    def chunks(self, chunk_bytes: int) -> list[Chunk]:
        """The joint buffers cut into parts of about ``chunk_bytes`` at block boundaries (a buffer
        whose blocks are not in address order stays whole), covering every value once, in order."""
        plan = self._plans.get(chunk_bytes)
        if plan is None:
            plan = self._plans[chunk_bytes] = self._cut(chunk_bytes)
        return plan

    def _cut(self, chunk_bytes: int) -> list[Chunk]:
        plan: list[Chunk] = []
        by_flat = {id(group.flat): (index, group) for index, group in enumerate(self._groups)}
        for flat in self._joint:
            found = by_flat.get(id(flat))
            if found is None:
                plan.append(Chunk(flat, None, 0, 0))
                continue
            index, group = found
            positions = group.block_positions
            target = max(chunk_bytes // flat.element_size(), BLOCK)
            cuts = [0]
            if positions == sorted(positions):
                begin = 0
                for block, position in enumerate(positions):
                    if block > cuts[-1] and position - begin >= target:
                        cuts.append(block)
                        begin = position
            bounds = [0] + [positions[block] for block in cuts[1:]] + [flat.numel()]
            cuts.append(group.count)
            for part in range(len(cuts) - 1):
                plan.append(Chunk(flat[bounds[part]:bounds[part + 1]], index, cuts[part], cuts[part + 1] - cuts[part]))
        return plan

    def copy(self, chunk: Chunk, tables: Sequence[Tensor]) -> None:
        """Queue the copy of a chunk's live values to their pre-round places (current stream)."""
        if chunk.group is None or not chunk.blocks:
            return
        group = self._groups[chunk.group]
        _copy_kernel[(chunk.blocks,)](group.flat, group.offsets, tables[chunk.group], group.sizes,
                                      group.block_tensor, group.block_start, chunk.first_block,
                                      BLOCK=BLOCK, num_warps=8)

    def measure(self, chunk: Chunk, tables: Sequence[Tensor], out: Tensor) -> None:
        """Queue a chunk's part of the measurement (current stream); the round's last part writes ``out``."""
        if chunk.group is not None and chunk.blocks:
            self._launch_drift(self._groups[chunk.group], tables[chunk.group], chunk.first_block, chunk.blocks, out)

    def _launch_drift(self, group: _Group, saved: Tensor, block_base: int, blocks: int, out: Tensor) -> None:
        _drift_kernel[(blocks,)](group.flat, group.offsets, saved, group.sizes, group.block_tensor,
                                 group.block_start, self._partials, group.first, self._tickets, out,
                                 self._blocks, block_base, BLOCK=BLOCK, FINISH_BLOCK=FINISH_BLOCK, num_warps=8)


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
        self.measured = True
        """Whether every part of the measurement was queued (:meth:`pipeline`)."""

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

    def pipeline(self, chunks: Sequence[Chunk], addresses: Sequence[int], copy: bool,
                 reduce: Callable[[Tensor], Any]) -> list[Any]:
        """Run the round chunk by chunk; the reduces' works. With ``copy``, each chunk's pre-round
        copy goes on the training stream just before its reduce (else the values are aside
        already); its part of the measurement goes on the side stream behind that reduce, so that
        copies and measurements run beside the neighbouring chunks' reduces and find a chunk's
        values still in the device's cache. Every chunk's copy is queued even when a reduce fails
        to launch: a failed round restores every parameter from them. :attr:`measured` is False
        where the side stream could not be ordered behind a reduce."""
        training = torch.cuda.current_stream(self.stream.device)
        self._out = torch.empty(3, dtype=torch.float64, device=self.stream.device)
        tables = self.drift.tables(addresses)
        self.stream.wait_stream(training)
        works: list[Any] = []
        copied = 0 if copy else len(chunks)
        try:
            for chunk in chunks:
                if copy:
                    self.drift.copy(chunk, tables)
                    copied += 1
                work = reduce(chunk.view)
                works.append(work)
                if self.measured:
                    self.measured = self._measure_behind(work, chunk, tables)
        finally:
            for chunk in chunks[copied:]:
                self.drift.copy(chunk, tables)
        return works

    def _measure_behind(self, work: Any, chunk: Chunk, tables: Sequence[Tensor]) -> bool:
        assert self._out is not None
        try:
            with torch.cuda.stream(self.stream):
                work.wait()
                self.drift.measure(chunk, tables, self._out)
        except Exception:  # a collective that had already failed: the watched wait reports it
            return False
        return True

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
