"""The contract between the round protocol and a transport."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist
from torch import Tensor

from lightning_elche.averaging import RoundWeights


@dataclass
class RoundResult:
    """A completed round: the gathered metadata, the weights used, this rank's drift.

    ``divergence`` is ``[||pre - consensus||, ||pre||, ||consensus||]`` (consensus before any
    outer step) as a float64 tensor, or ``None`` when no rank moved and nothing was averaged.
    """

    table: list[list[float]]
    weights: RoundWeights
    divergence: Optional[Tensor]


class AveragingPlane(ABC):
    """Moves one round's metadata and replicas between ranks.

    Every rank calls :meth:`start`, then :meth:`collect`, then :meth:`adopt`, once per round and
    in the same order: that fixed sequence keeps ranks with different step counts from
    deadlocking. A blocking plane does all the work in :meth:`collect`; a non-blocking one lets
    the rank keep training between :meth:`start` and :meth:`collect`.
    """

    #: Whether training may continue while a round is in flight.
    non_blocking: bool = False

    @abstractmethod
    def start(self, local: Tensor) -> None:
        """Begin a round with this rank's metadata vector (and its current replica)."""

    def ready(self) -> bool:
        """Whether :meth:`collect` would return without waiting (cheap, no collective)."""
        return True

    @abstractmethod
    def collect(self) -> RoundResult:
        """Finish the round begun by :meth:`start` and return its result."""

    def adopt(self, result: RoundResult, alpha: float) -> None:  # noqa: B027 (blocking planes adopt in collect)
        """Move this rank's replica toward the consensus: ``θ ← (1 − alpha)·θ + alpha·consensus``."""

    def close(self) -> None:  # noqa: B027 (optional hook, default: nothing to release)
        """Release threads, groups and buffers (idempotent)."""


def all_gather_flat(output: Tensor, local: Tensor, group: Optional[Any] = None) -> None:
    """All-gather equal-sized tensors into one flat ``output`` (rank-major)."""
    # torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, local, group=group)
