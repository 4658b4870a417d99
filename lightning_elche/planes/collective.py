"""The ``nccl_*`` modes: a blocking round on the job's default process group.

NCCL on GPUs, gloo on CPU. Each rank pre-scales its flat parameter buffer by its share of the
realized-work mass and a SUM all-reduce yields the consensus directly, which is copied back into
the live parameters in place. Only trainable parameters travel (see :class:`AveragedLayout`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_elche.averaging import AveragedLayout, FlatTensors, RoundWeights, divergence_norms, round_weights
from lightning_elche.outer import OuterOptimizer
from lightning_elche.planes.base import AveragingPlane, RoundResult, all_gather_flat, check_layout, stamp_layout
from lightning_elche.rounds import Meta, validate_table


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
        self._pre: Optional[list[Tensor]] = None
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
            self._pre = None  # sized for the old layout
            if self.outer is not None:
                # Its momentum and previous global have the old layout's shape: restart it (every
                # rank relayouts at the same round, so every rank restarts alike).
                self.outer.reset()
        self._local = local

    def collect(self) -> RoundResult:
        assert self._local is not None, "collect() without start()"
        table = self.exchange(self._local).tolist()
        check_layout(table, self.layout, self.rank)
        validate_table(table)
        weights = round_weights([int(row[Meta.STEPS]) for row in table], self.gamma)
        result = RoundResult(table, weights, self.average(weights, self.outer))
        self._local = None  # kept until here: a round that failed on a lost peer is run again
        return result

    def regroup(self, group: Optional[Any], rank: int, world_size: int) -> None:
        self.group, self.rank, self.world_size = group, rank, world_size
        self._meta_out = None

    def exchange(self, local: Tensor) -> Tensor:
        """All-gather one float64 vector per rank; a ``[world_size, len(local)]`` CPU tensor."""
        local = local.to(self.device, dtype=torch.float64)
        if self._meta_out is None or self._meta_out.numel() != self.world_size * local.numel():
            self._meta_out = torch.empty(self.world_size * local.numel(), dtype=torch.float64, device=self.device)
        self._await(all_gather_flat(self._meta_out, local, group=self.group, async_op=True), self._host_blocking)
        return self._meta_out.view(self.world_size, -1).cpu()

    @property
    def _host_blocking(self) -> bool:
        return self.device.type == "cpu"

    def average(self, weights: RoundWeights, outer: Optional[OuterOptimizer] = None) -> Optional[Tensor]:
        """Average in place; returns this rank's divergence measurement (``None`` if nobody moved).

        Every collective runs on the flat buffers before anything is written back, so a round that
        fails on a lost peer leaves the live parameters and buffers as they were (it can run again)."""
        if not weights.realized:
            return None
        params = self.params
        params.pack()
        if self._pre is None:
            self._pre = [torch.empty_like(flat) for flat in params.flats]
        # Keep this replica's parameters to measure how far it drifted from the consensus.
        torch._foreach_copy_(self._pre, params.flats)
        self.sum_scaled(params, weights.param_factors[self.rank])
        if self.buffers:
            self.buffers.pack()
            self.sum_scaled(self.buffers, weights.buffer_factors[self.rank])
        divergence = divergence_norms(self._pre, params.flats)
        if outer is not None:
            outer.step(params.flats)
        params.unpack()
        if self.buffers:
            self.buffers.unpack()
        return divergence

    def sum_scaled(self, flat: FlatTensors, factor: float) -> None:
        """The wire part of a round: pre-scale each flat buffer by this rank's weight and SUM
        all-reduce it in place (one collective per dtype group, all in flight at once)."""
        works = []
        for buffer in flat.flats:
            buffer.mul_(factor)
            works.append(dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=self.group, async_op=True))
        for work in works:
            self._await(work, self._host_blocking)

    def close(self) -> None:
        # The engine outlives fit (its totals are the run's record): free the model-sized buffers.
        self._pre = None
        self._meta_out = None
        self.params.release()
        self.buffers.release()
