"""Transports that run an averaging round: the collective plane (default process group) now,
the CPU plane (host snapshots on a dedicated gloo group) for the ``cpu_*`` modes."""

from lightning_elche.planes.base import AveragingPlane, RoundResult
from lightning_elche.planes.collective import CollectivePlane
from lightning_elche.planes.cpu import CpuPlane, SnapshotTimeout

__all__ = ["AveragingPlane", "CollectivePlane", "CpuPlane", "RoundResult", "SnapshotTimeout"]
