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

import bisect
import itertools
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
                  block_start_ptr, block, VECTOR: tl.constexpr):
    """Where block ``block`` of the tables lives: its tensor's pre-round and live values (base
    pointers), the block's first index in that tensor and the tensor's size. ``VECTOR`` > 1
    promises that both base pointers sit on 16 bytes and that the size is a multiple of
    ``VECTOR`` values, so that Triton loads and stores 16 bytes at a time."""
    tensor = tl.load(block_tensor_ptr + block)
    saved = tl.load(saved_addresses_ptr + tensor).to(tl.pointer_type(live_ptr.dtype.element_ty))
    offset = tl.load(offsets_ptr + tensor)
    size = tl.load(sizes_ptr + tensor)
    if VECTOR > 1:
        saved = tl.multiple_of(saved, 16)
        offset = tl.multiple_of(offset, VECTOR)
        size = tl.multiple_of(size, VECTOR)
    return saved, live_ptr + offset, tl.multiple_of(tl.load(block_start_ptr + block), VECTOR), size


def _drift_source(live_ptr, offsets_ptr, saved_addresses_ptr, sizes_ptr, block_tensor_ptr,  # type: ignore[no-untyped-def]
                  block_start_ptr, partial_ptr, first_block, tickets_ptr, out_ptr, total_blocks, block_base,
                  BLOCK: tl.constexpr, FINISH_BLOCK: tl.constexpr, VECTOR: tl.constexpr):
    """One program: one block of one tensor (``block_base`` onwards: a launch may cover part of a
    group); its three partial sums of squares. The program that finishes last (of every launch of
    the round: they share the ticket counter) sums the partials of all, in float64 and in block
    order (the result does not depend on which program is last), takes the square roots and
    resets the counter for the next round."""
    block = block_base + tl.program_id(0)
    saved, live, start, size = _block(live_ptr, offsets_ptr, saved_addresses_ptr, sizes_ptr, block_tensor_ptr,
                                      block_start_ptr, block, VECTOR)
    index = start + tl.arange(0, BLOCK)
    mask = index < size
    pre = tl.load(saved + index, mask=mask, other=0.0).to(tl.float32)
    consensus = tl.load(live + index, mask=mask, other=0.0).to(tl.float32)
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


def _copy_source(live_ptr, offsets_ptr, saved_addresses_ptr, sizes_ptr, block_tensor_ptr,  # type: ignore[no-untyped-def]
                 block_start_ptr, block_base, BLOCK: tl.constexpr, VECTOR: tl.constexpr):
    """One program: one block of one tensor copied from the live parameters to its pre-round place."""
    saved, live, start, size = _block(live_ptr, offsets_ptr, saved_addresses_ptr, sizes_ptr, block_tensor_ptr,
                                      block_start_ptr, block_base + tl.program_id(0), VECTOR)
    index = start + tl.arange(0, BLOCK)
    mask = index < size
    tl.store(saved + index, tl.load(live + index, mask=mask), mask=mask)


if HAVE_TRITON:
    _block = triton.jit(_block_source)
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
    vector: int  # values per 16 bytes, or 1 where no member can be read 16 bytes at a time
    vector_blocks: int  # the first blocks: those of the members that can, given aligned pre-round places
    vector_members: list[int]  # their positions in ``members``


@dataclass(frozen=True)
class AddressTable:
    """One group's pre-round addresses on the device, for one round."""

    addresses: Tensor
    wide: bool  # whether every place of the group's wide members sits on 16 bytes


@dataclass(frozen=True)
class Chunk:
    """A contiguous part of one joint buffer reduced by a collective of its own, and the blocks of
    the measurement inside it: at most two runs of the group's block table, ``(first, count)``, one
    among the wide members' blocks and one among the rest (``group`` None: no measured parameter
    lives there)."""

    view: Tensor
    group: Optional[int]
    runs: tuple[tuple[int, int], ...]

    @property
    def blocks(self) -> int:
        return sum(count for _, count in self.runs)


class FusedDrift:
    """The drift of one layout's parameters: built once per layout (the block tables), run once
    per round with that round's pre-round tensors (their addresses change from round to round).

    Args:
        joint: the layout's joint flat buffers (one per dtype), where the parameters live.
        current: each parameter's live view (slices of ``joint``), in :class:`PreRoundValues` order.
    """

    wide_loads: ClassVar[bool] = True
    """Whether members that allow it are read 16 bytes at a time (``tools/averaging_overhead.py``
    turns it off to measure what that saves)."""

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
            # The members whose live values start on 16 bytes and fill whole 16-byte words go
            # first, launched apart with wide loads; the rest (odd biases, say) after them.
            vector = 16 // flat.element_size()
            wide = [flat.data_ptr() % 16 == 0 and offsets[t] % vector == 0 and sizes[t] % vector == 0
                    for t in range(len(members))]
            order = [t for t in range(len(members)) if wide[t]] + [t for t in range(len(members)) if not wide[t]]
            block_tensor = [t for t in order for _ in range(-(-sizes[t] // BLOCK))]
            block_start = [b * BLOCK for t in order for b in range(-(-sizes[t] // BLOCK))]
            vector_blocks = sum(-(-sizes[t] // BLOCK) for t in order if wide[t])

            def table(values: list[int]) -> Tensor:
                return torch.tensor(values, dtype=torch.int64, device=device)

            self._groups.append(_Group(
                flat, members, table(offsets), table(sizes), table(block_tensor), table(block_start), blocks,
                len(block_tensor), [offsets[t] + start for t, start in zip(block_tensor, block_start, strict=True)],
                vector if vector_blocks else 1, vector_blocks, [t for t in order if wide[t]],
            ))
            blocks += len(block_tensor)
        self._blocks = blocks
        self._partials = torch.empty(3 * max(blocks, 1), dtype=torch.float32, device=device)
        self._tickets = torch.zeros(1, dtype=torch.int32, device=device)  # programs finished this round
        self._tables: dict[int, tuple[list[int], AddressTable]] = {}
        self._plans: dict[int, list[Chunk]] = {}

    def _address_table(self, group: int, addresses: list[int]) -> AddressTable:
        """The device copy of a group's pre-round addresses. The allocator usually hands a step's
        gradients the same blocks every step, so the table is mostly the last round's; a new one
        goes up from pinned memory without the host waiting for the device (a pageable copy
        would wait for every kernel queued before it)."""
        cached = self._tables.get(group)
        if cached is not None and cached[0] == addresses:
            return cached[1]
        device = self._partials.device
        host = torch.tensor(addresses, dtype=torch.int64, pin_memory=device.type == "cuda")
        wide = all(addresses[t] % 16 == 0 for t in self._groups[group].vector_members)
        table = AddressTable(host.to(device, non_blocking=True), wide)
        self._tables[group] = (addresses, table)
        return table

    def tables(self, addresses: Sequence[int]) -> list[AddressTable]:
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
                plan.append(Chunk(flat, None, ()))
                continue
            index, group = found
            positions = group.block_positions
            # Each kind of member's blocks must be in address order for an address range to hold
            # one run of each; else the buffer stays whole.
            kinds = ((0, group.vector_blocks), (group.vector_blocks, group.count))
            ordered = all(positions[a:b] == sorted(positions[a:b]) for a, b in kinds)
            bounds = [0, flat.numel()]
            if ordered:
                target = max(chunk_bytes // flat.element_size(), BLOCK)
                bounds = [0]
                for position in sorted(positions):
                    if position > bounds[-1] and position - bounds[-1] >= target:
                        bounds.append(position)
                bounds.append(flat.numel())
            for low, high in itertools.pairwise(bounds):
                runs = []
                for a, b in kinds:
                    first, last = (bisect.bisect_left(positions, low, a, b),
                                   bisect.bisect_left(positions, high, a, b)) if ordered else (a, b)
                    if last > first:
                        runs.append((first, last - first))
                plan.append(Chunk(flat[low:high], index, tuple(runs)))
        return plan

    def copy(self, chunk: Chunk, tables: Sequence[AddressTable]) -> None:
        """Queue the copy of a chunk's live values to their pre-round places (current stream)."""
        if chunk.group is None:
            return
        group, table = self._groups[chunk.group], tables[chunk.group]
        for base, blocks, vector in (launch for run in chunk.runs for launch in self._launches(group, table, *run)):
            _copy_kernel[(blocks,)](group.flat, group.offsets, table.addresses, group.sizes, group.block_tensor,
                                    group.block_start, base, BLOCK=BLOCK, VECTOR=vector, num_warps=8)

    def measure(self, chunk: Chunk, tables: Sequence[AddressTable], out: Tensor) -> None:
        """Queue a chunk's part of the measurement (current stream); the round's last part writes ``out``."""
        if chunk.group is not None:
            for first, count in chunk.runs:
                self._launch_drift(self._groups[chunk.group], tables[chunk.group], first, count, out)

    def _launch_drift(self, group: _Group, table: AddressTable, block_base: int, blocks: int, out: Tensor) -> None:
        for base, count, vector in self._launches(group, table, block_base, blocks):
            _drift_kernel[(count,)](group.flat, group.offsets, table.addresses, group.sizes, group.block_tensor,
                                    group.block_start, self._partials, group.first, self._tickets, out,
                                    self._blocks, base, BLOCK=BLOCK, FINISH_BLOCK=FINISH_BLOCK, VECTOR=vector,
                                    num_warps=8)

    def _launches(self, group: _Group, table: AddressTable, base: int, blocks: int) -> list[tuple[int, int, int]]:
        """The launches, ``(first block, blocks, VECTOR)``, that cover ``blocks`` blocks of ``group``
        from ``base``: the wide members' blocks apart from the rest, where this round's places allow."""
        if group.vector == 1 or not table.wide or not self.wide_loads:
            return [(base, blocks, 1)]
        end, split = base + blocks, min(max(group.vector_blocks, base), base + blocks)
        return [(first, last - first, vector) for first, last, vector in
                ((base, split, group.vector), (split, end, 1)) if last > first]


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

    def _measure_behind(self, work: Any, chunk: Chunk, tables: Sequence[AddressTable]) -> bool:
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
