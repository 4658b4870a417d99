"""The contract between the round protocol and a transport."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

from torch import Tensor

from lightning_elche.averaging import RoundWeights
from lightning_elche.outer import OuterOptimizer


class AveragingPlane(ABC):
    """Moves one round's metadata and replicas between ranks.

    Every rank calls :meth:`exchange` then (when the round is realized) :meth:`average`, in the
    same order, once per round: that fixed sequence is what keeps ranks with different step
    counts from deadlocking.
    """

    @abstractmethod
    def exchange(self, local: Tensor) -> Tensor:
        """All-gather one float64 vector per rank; returns a ``[world_size, len(local)]`` CPU tensor."""

    @abstractmethod
    def average(self, weights: RoundWeights, outer: Optional[OuterOptimizer] = None) -> Optional[Tensor]:
        """Replace every replica's parameters and float buffers by the weighted consensus, in place.

        ``outer`` (applied identically on every rank) turns the parameter consensus into the new
        global parameters before they are adopted. Returns this rank's divergence measurement as a
        float64 device tensor ``[||pre - consensus||, ||pre||, ||consensus||]`` (consensus before
        the outer step), or ``None`` when the round is not realized (no rank moved).
        """

    def close(self) -> None:  # noqa: B027 (optional hook, default: nothing to release)
        """Release threads, groups and buffers (idempotent)."""
