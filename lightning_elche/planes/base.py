"""The contract between the round protocol and a transport."""

from __future__ import annotations

from abc import ABC, abstractmethod

from torch import Tensor

from lightning_elche.averaging import RoundWeights


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
    def average(self, weights: RoundWeights) -> None:
        """Replace every replica's parameters and float buffers by the weighted consensus, in place."""

    def close(self) -> None:  # noqa: B027 (optional hook, default: nothing to release)
        """Release threads, groups and buffers (idempotent)."""
