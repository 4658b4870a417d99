"""The ``nccl_*`` modes: a blocking round on the job's default process group.

NCCL on GPUs, gloo on CPU. The parameters live in one flat buffer per dtype for the whole fit
(:class:`~lightning_elche.averaging.FlatTensors`), so the round all-reduces their own storage:
each rank's contribution is scaled by its share of the realized-work mass (inside the reduction
on NCCL, ``PreMulSum``; one multiply first on gloo and for bfloat16) and the SUM is the
consensus, in place. Only trainable parameters travel (see :class:`AveragedLayout`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_elche.averaging import (
    AveragedLayout,
    FlatTensors,
    RoundWeights,
    divergence_norms,
    round_weights,
    spare_room,
)
from lightning_elche.config import Transport
from lightning_elche.membership.change import Change
from lightning_elche.outer import OuterOptimizer
from lightning_elche.planes.base import (
    AveragingPlane,
    PlaneSetup,
    RoundResult,
    all_gather_flat,
    check_layout,
    reduce_scatter_flat,
    stamp_layout,
)
from lightning_elche.planes.fused import FusedDrift, QueuedDrift, drift_or_none, queue_drift
from lightning_elche.planes.scratch import PreRoundValues
from lightning_elche.planes.settle import FusedSettle, Settled, settle_multi_tensor, settle_or_none
from lightning_elche.rounds import Meta, validate_table

PREMUL_DTYPES = (torch.float32, torch.float16, torch.float64)
"""Where NCCL's PreMulSum scales right. For bfloat16 PyTorch handed NCCL a 4-byte float factor of
which NCCL reads 2 bytes (pytorch/pytorch#190745): 0.5 arrives as zero, other factors as noise,
and the consensus is wrong. Seen with torch 2.11 on an H100; bfloat16 is multiplied first."""


def padded_numel(numel: int, world_size: int) -> int:
    """``numel`` rounded up to a multiple of ``16 * world_size``: every rank's share of an
    out-of-place round starts and ends on whole 16-element (64-byte in float32) boundaries."""
    quantum = 16 * world_size
    return -(-numel // quantum) * quantum


def default_group_device(rank_device: torch.device) -> torch.device:
    """Where tensors of the default group's collectives live: the rank's device under NCCL, else the host."""
    backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else "gloo"
    return rank_device if "nccl" in str(backend) else torch.device("cpu")


class CollectivePlane(AveragingPlane):
    """Blocking averaging on a process group (the default group unless ``group`` is given).

    Args:
        layout: the trainable parameters and floating-point buffers, in flat persistent buffers.
        rank, world_size: this rank's index and the number of ranks in ``group``.
        device: where metadata travels (CUDA for NCCL, CPU for gloo).
        gamma: exponent of the realized-work weights.
        outer: outer optimizer applied to the parameter consensus (``None``: plain averaging).
        group: the process group; ``None`` is the default group.
    """

    transport = Transport.DEVICE

    @classmethod
    def build(cls, setup: PlaneSetup) -> CollectivePlane:
        plane = cls(setup.layout, setup.rank, setup.world_size, default_group_device(setup.device),
                    gamma=setup.gamma, outer=setup.outer)
        plane.watch = setup.watch
        return plane

    def __init__(
        self,
        layout: AveragedLayout,
        rank: int,
        world_size: int,
        device: torch.device,
        gamma: float = 1.0,
        outer: Optional[OuterOptimizer] = None,
        group: Optional[Any] = None,
    ) -> None:
        self.layout = layout
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.gamma = gamma
        self.outer = outer
        self.group = group
        self._meta_out: Optional[Tensor] = None
        self._pre: Optional[PreRoundValues] = None  # this replica before the round (in its gradients)
        self._drift: Optional[FusedDrift] = None  # the one-pass drift measurement (CUDA, Triton)
        self.fused = True
        """Measure the drift in one fused pass where it can run (CUDA with Triton)."""
        self.queued = False
        """Launch the fused measurement behind the reduce on a side stream (NCCL) rather than after it.
        Off: on one H100 (2026-12-06, ``docs/benchmarks.md``) it did not shorten the round a fit
        runs, whose host polls the reduce (465 against 310 µs at 17 MB), on a host loaded by
        other runs; ``tools/averaging_overhead.py`` measures both."""
        self.chunk_bytes: Optional[int] = None
        """Reduce the parameters in parts of about this many bytes, each part copied aside just
        before its reduce and measured on a side stream right after it (NCCL with the fused
        measurement; ``None``: one reduce per buffer, copied beside the metadata exchange)."""
        self.copy_in_parts = True
        """With :attr:`chunk_bytes`: copy each part aside just before its reduce (False: the whole
        model beside the metadata exchange, as without parts; only the reduces and measurements go
        part by part)."""
        self.out_of_place: Optional[bool] = None
        """Reduce into a round buffer and settle the consensus into the live buffers after every
        collective finished (:meth:`reduce_into`, :mod:`~lightning_elche.planes.settle`): nothing
        is copied aside, three passes over the model instead of four. ``None``: wherever NCCL
        reduces; True: on any backend; False: never. Either way not when :attr:`chunk_bytes` or
        :attr:`queued` ask for the in-place round, and only where the joint buffers have room to
        pad over. On one H100 (2026-12-07, ``docs/benchmarks.md``) its own kernels took 13.9 µs at
        17 MB and 116.7 µs at 77 MB, the in-place round's 32.2 and 122.9 µs."""
        self._settle: Optional[FusedSettle] = None
        self._kept_round_buffers: list[Tensor] = []  # a failed round's: its abandoned collectives hold them
        self._drift_stream: Optional[Any] = None  # where the drift waits for the reduce (CUDA)
        self._failed = False  # the last round's collectives did not finish: its values need restoring
        self._premul_backend: Optional[bool] = None
        self._local: Optional[Tensor] = None

    @property
    def params(self) -> FlatTensors:
        return self.layout.params

    @property
    def buffers(self) -> FlatTensors:
        return self.layout.buffers

    @property
    def round_bytes(self) -> int:
        return self.params.nbytes + self.buffers.nbytes

    def start(self, local: Tensor) -> None:
        if stamp_layout(local, self.layout):
            self._pre, self._drift, self._settle = None, None, None  # paired with the old layout's tensors
            if self.outer is not None:
                # Its momentum and previous global have the old layout's shape: restart it (every
                # rank relayouts at the same round, so every rank restarts alike).
                self.outer.reset()
        self._local = local

    def collect(self) -> RoundResult:
        assert self._local is not None, "collect() without start()"
        gathering = self._begin_exchange(self._local)
        self._save_beside_the_exchange()
        table = self._finish_exchange(gathering).tolist()
        check_layout(table, self.layout, self.rank)
        validate_table(table)
        weights = round_weights([int(row[Meta.STEPS]) for row in table], self.gamma)
        result = RoundResult(table, weights, self.average(weights, self.outer))
        self._local = None  # kept until here: a round that failed on a lost peer is run again
        return result

    def apply_change(self, change: Change) -> None:
        rank = change.new_rank(self.rank)
        assert rank is not None, "a lost rank does not take the change"
        # The default group was rebuilt on the new members (a group of the caller's stays its own).
        self.rank, self.world_size = rank, change.world_size_after
        self._meta_out = None
        self._premul_backend = None

    def exchange(self, local: Tensor) -> Tensor:
        """All-gather one float64 vector per rank; a ``[world_size, len(local)]`` CPU tensor."""
        return self._finish_exchange(self._begin_exchange(local))

    def _begin_exchange(self, local: Tensor) -> Any:
        local = local.to(self.device, dtype=torch.float64)
        if self._meta_out is None or self._meta_out.numel() != self.world_size * local.numel():
            self._meta_out = torch.empty(self.world_size * local.numel(), dtype=torch.float64, device=self.device)
        return all_gather_flat(self._meta_out, local, group=self.group, async_op=True)

    def _finish_exchange(self, work: Any) -> Tensor:
        assert self._meta_out is not None
        self._await(work, self._host_blocking)
        return self._meta_out.view(self.world_size, -1).cpu()

    def _pre_round(self) -> PreRoundValues:
        if self._pre is None:
            self._pre = PreRoundValues(self.layout)
            self._drift = drift_or_none(self.layout.joint, self._pre.current)
        return self._pre

    def _save_beside_the_exchange(self) -> None:
        """Keep this replica's pre-round values while the metadata travels (the host waits for the
        slowest rank there anyway), where that costs no allocation; a round run again after a
        failure restores them instead."""
        if self._failed or not self.layout.joint or self._reduces_out_of_place():
            return
        pre = self._pre_round()
        if self.copy_in_parts and self._pipelined(self._drift):
            return  # each part is copied right before its reduce
        if not pre.saved:
            pre.save(borrow_only=True)

    @property
    def _host_blocking(self) -> bool:
        return self.device.type == "cpu"

    def average(self, weights: RoundWeights, outer: Optional[OuterOptimizer] = None) -> Optional[Tensor]:
        """Average the live parameters and buffers; returns this rank's divergence measurement
        (``None`` if nobody moved or nothing is measured).

        Out of place (:attr:`out_of_place`), the live values stay untouched until every collective
        has finished. In place, the collectives write into them, and their values before the round
        are kept aside (:class:`PreRoundValues`: in the parameters' stale gradients, no buffer of
        the model's size) for the drift measurement. Either way a round that failed on a lost peer
        runs again from the same contribution."""
        if not weights.realized:
            if self._pre is not None and self._pre.saved and not self._failed:
                self._pre.release()  # saved beside the exchange for a round that averages nothing
            return None
        if self._reduces_out_of_place():
            divergence = self._average_out_of_place(weights)
        else:
            divergence = self._average_in_place(weights)
        if outer is not None:
            outer.step(self.params.flats)
        return divergence

    def _reduces_out_of_place(self) -> bool:
        if self.out_of_place is False or not self.layout.joint or self.chunk_bytes is not None or self.queued:
            return False
        if self.out_of_place is None and not self._premul:
            return False
        return all(spare_room(flat) >= padded_numel(flat.numel(), self.world_size) - flat.numel()
                   for flat in self.layout.joint)

    def _average_out_of_place(self, weights: RoundWeights) -> Optional[Tensor]:
        pre = self._pre_round()  # the buffers' values, where this round scales them before the reduce
        if self._failed and pre.saved:
            pre.restore()
            pre.release()
        param_factor, buffer_factor = weights.param_factors[self.rank], weights.buffer_factors[self.rank]
        scale_buffers = bool(self.buffers) and param_factor > 0.0 and buffer_factor != param_factor
        if scale_buffers:
            pre.save(params=False)
        for param in self.params.tensors:
            param.grad = None  # spent by the step (see PreRoundValues): the round buffer takes their memory
        self._failed = True
        if scale_buffers:
            torch._foreach_mul_(self.buffers.flats, buffer_factor / param_factor)
        rounds = self.round_buffers()
        try:
            for work in self.reduce_into(rounds, param_factor):
                self._await(work, self._host_blocking)
        except BaseException:
            self._kept_round_buffers = rounds
            raise
        self._failed = False
        settled = self._settled(rounds)
        if self.fused and self._settle is None:
            self._settle = settle_or_none(self.layout.joint)
        divergence = self._settle(settled) if self.fused and self._settle is not None else settle_multi_tensor(settled)
        pre.release()
        return divergence if self.params else None

    def round_buffers(self) -> list[Tensor]:
        """Where this round's collectives write, one per joint buffer (with room for any padding):
        new ones, which take the memory the step's spent gradients leave, or the buffers of a
        round that failed, which its abandoned collectives keep referenced."""
        joint = self.layout.joint
        kept = self._kept_round_buffers
        if len(kept) == len(joint) and all(
            buf.dtype == flat.dtype and buf.device == flat.device and buf.numel() >= flat.numel() + spare_room(flat)
            for buf, flat in zip(kept, joint, strict=True)
        ):
            return kept
        return [torch.empty(flat.numel() + spare_room(flat), dtype=flat.dtype, device=flat.device) for flat in joint]

    def reduce_into(self, rounds: list[Tensor], factor: float) -> list[Any]:
        """The wire part of an out-of-place round: each joint buffer, padded to a multiple of
        ``16 * world_size`` over its spare tail and scaled by ``factor``, reduce-scattered into
        this rank's share of its round buffer, then all-gathered in place (NCCL's ring all-reduce
        in its two halves: the same traffic); the works still to wait for, in order. Alone, the
        values are multiplied first: NCCL's one-rank reduce-scatter is a plain copy that skips
        ``PreMulSum`` (seen on an H100 with torch 2.11: a ``Memcpy DtoD`` and unscaled values)."""
        premul = dist._make_nccl_premul_sum(factor) if self._premul else None
        works = []
        for flat, buf in zip(self.layout.joint, rounds, strict=True):
            numel = padded_numel(flat.numel(), self.world_size)
            share = numel // self.world_size
            out = buf[:numel]
            piece = out[self.rank * share:(self.rank + 1) * share]
            op: Any
            if premul is not None and flat.dtype in PREMUL_DTYPES and self.world_size > 1:
                source, op = flat.as_strided((numel,), (1,)), premul
            else:
                torch.mul(flat.as_strided((numel,), (1,)), factor, out=out)
                source, op = out, dist.ReduceOp.SUM
            scatter = reduce_scatter_flat(piece, source, op, group=self.group, async_op=True)
            if self._host_blocking:
                # gloo runs a group's works on several threads: the gather must not start first.
                self._await(scatter, host_blocking=True)
            else:
                works.append(scatter)
            works.append(all_gather_flat(out, piece, group=self.group, async_op=True))
        return works

    def _settled(self, rounds: list[Tensor]) -> list[Settled]:
        measured = {flat.data_ptr(): flat.numel() for flat in self.params.flats}  # each a joint buffer's head
        return [Settled(flat, buf, measured.get(flat.data_ptr(), 0))
                for flat, buf in zip(self.layout.joint, rounds, strict=True)]

    def _average_in_place(self, weights: RoundWeights) -> Optional[Tensor]:
        buffers = self.buffers
        pre = self._pre_round()
        drift = self._drift if self.fused else None
        pipelined = self._pipelined(drift)
        copy_parts = False  # the live values are aside already (saved, or restored from there)
        if self._failed:
            pre.restore()  # the failed round's partial sums are in the live tensors
        elif not pre.saved:
            copy_parts = pipelined and self.copy_in_parts
            pre.save(copy_params=not copy_parts)
        self._failed = True  # until every collective is done (a PeerFailure leaves it set)
        param_factor, buffer_factor = weights.param_factors[self.rank], weights.buffer_factors[self.rank]
        if buffers and param_factor > 0.0 and buffer_factor != param_factor:
            # Buffers are averaged equally over the movers, parameters by work: one collective
            # per dtype reduces both, so the buffers carry the ratio of the two weights.
            torch._foreach_mul_(buffers.flats, buffer_factor / param_factor)
        if pipelined:
            assert drift is not None
            divergence: Optional[Tensor] = self._reduce_in_parts(drift, pre, param_factor, copy_parts)
        else:
            divergence = self._reduce_whole(drift, pre, param_factor)
        pre.release()
        return divergence

    def _reduce_whole(self, drift: Optional[FusedDrift], pre: PreRoundValues, factor: float) -> Optional[Tensor]:
        """One reduce per joint buffer, then the measurement; this rank's (None: no parameters)."""
        works = self.sum_scaled(self.layout.joint, factor, wait=False)
        # The multi-tensor path takes the pre-round norms beside the reduce; the fused one reads
        # every value once after it, launched while the reduce runs where it can be.
        pre_norms = torch._foreach_norm(pre.params) if pre.params and drift is None else None
        queued = None
        if pre.params and drift is not None and self.queued:
            queued = self._drift_behind(works, drift, pre.addresses)
            drift = self._drift  # a new one where the queuing failed and abandoned the old one
        try:
            for work in works:
                self._await(work, self._host_blocking)
        except BaseException:
            if queued is not None:
                self._abandon(queued)
            raise
        self._failed = False
        if not pre.params:
            return None
        if queued is not None:
            return queued.result()
        if drift is not None:
            return drift(pre.addresses)
        return divergence_norms(pre.params, pre.current, pre_norms)

    def _pipelined(self, drift: Optional[FusedDrift]) -> bool:
        return self.chunk_bytes is not None and self.fused and drift is not None and self._premul

    def _reduce_in_parts(self, drift: FusedDrift, pre: PreRoundValues, factor: float, copy: bool) -> Tensor:
        """The round part by part (:meth:`QueuedDrift.pipeline`); this rank's measurement."""
        assert self.chunk_bytes is not None
        queued = QueuedDrift(drift, self._side_stream())
        premul = dist._make_nccl_premul_sum(factor)

        def reduce(view: Tensor) -> Any:  # after the part's copy: the pre-round values stay unscaled
            op = self._scale_or_premul(view, factor, premul)
            return dist.all_reduce(view, op=op, group=self.group, async_op=True)

        try:
            works = queued.pipeline(drift.chunks(self.chunk_bytes), pre.addresses, copy, reduce)
            for work in works:
                self._await(work, self._host_blocking)
        except BaseException:
            self._abandon(queued)
            raise
        self._failed = False
        if queued.measured:
            return queued.result()
        self._abandon(queued)  # the side stream was left half-measured: measure again after the reduces
        assert self._drift is not None
        return self._drift(pre.addresses)

    def _side_stream(self) -> Any:
        """Where the measurement waits for the reduce (CUDA), kept from round to round."""
        if self._drift_stream is None:
            self._drift_stream = torch.cuda.Stream(device=self.layout.joint[0].device)
        return self._drift_stream

    def _drift_behind(self, works: list[Any], drift: FusedDrift, addresses: list[int]) -> Optional[QueuedDrift]:
        """The fused drift queued behind the reduce on a side stream (NCCL, whose works order
        streams without the host waiting); None on a host-blocking transport."""
        if self._host_blocking:
            return None
        queued = queue_drift(drift, self._side_stream(), works, addresses)
        if queued is None:
            self._abandon_side_stream()
        return queued

    def _abandon(self, queued: QueuedDrift) -> None:
        queued.abandon()
        self._abandon_side_stream()

    def _abandon_side_stream(self) -> None:
        # Its kernel may still run after a failed reduce, into this measurement's partial sums and
        # ticket counter: the next round measures on a new stream with new ones.
        self._drift_stream = None
        if self._pre is not None:
            self._drift = drift_or_none(self.layout.joint, self._pre.current)

    def sum_scaled(self, flats: list[Tensor], factor: float, wait: bool = True) -> list[Any]:
        """The wire part of a round: SUM all-reduce each flat buffer in place, every rank's values
        scaled by its ``factor`` (one collective per buffer, all in flight at once); the works
        when not ``wait``."""
        ops: list[Any]
        if self._premul:
            premul = dist._make_nccl_premul_sum(factor)
            ops = [self._scale_or_premul(flat, factor, premul) for flat in flats]
        else:
            torch._foreach_mul_(flats, factor)
            ops = [dist.ReduceOp.SUM] * len(flats)
        works = [dist.all_reduce(flat, op=op, group=self.group, async_op=True)
                 for flat, op in zip(flats, ops, strict=True)]
        if wait:
            for work in works:
                self._await(work, self._host_blocking)
            return []
        return works

    @staticmethod
    def _scale_or_premul(flat: Tensor, factor: float, premul: Any) -> Any:
        """The reduction that sums ``flat`` scaled by ``factor``: ``premul`` where NCCL scales
        right, else SUM after multiplying it in place."""
        if flat.dtype in PREMUL_DTYPES:
            return premul
        flat.mul_(factor)
        return dist.ReduceOp.SUM

    @property
    def _premul(self) -> bool:
        # NCCL scales inside the reduction: no separate pass over the parameters.
        if self._premul_backend is None:
            self._premul_backend = (
                dist.is_initialized()
                and "nccl" in str(dist.get_backend(self.group))
                and hasattr(dist, "_make_nccl_premul_sum")
            )
        return self._premul_backend

    def start_epoch(self) -> None:
        self.layout.walk_at_next_refresh()

    def close(self) -> None:
        # The engine outlives fit (its totals are the run's record): free the model-sized buffers.
        if self._pre is not None:
            self._pre.release()
        self._pre, self._drift, self._drift_stream, self._settle = None, None, None, None
        self._kept_round_buffers = []
        self._meta_out = None
        self.params.release()
        self.buffers.release()

