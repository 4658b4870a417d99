"""Transports that run an averaging round: the collective plane (default process group) now,
the CPU plane (host snapshots on a dedicated gloo group) for the ``cpu_*`` modes."""

from lightning_elche.planes.base import AveragingPlane
from lightning_elche.planes.collective import CollectivePlane

__all__ = ["AveragingPlane", "CollectivePlane"]
