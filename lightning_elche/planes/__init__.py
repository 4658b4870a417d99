"""Transports that run an averaging round, one file each: the collective plane on the job's
default process group (``nccl_*`` modes) and the CPU plane on host snapshots and a gloo group of
its own (``cpu_*`` modes).

Every module of this package is imported here, so that a plane registers itself by being defined
(:class:`~lightning_elche.planes.base.AveragingPlane` subclasses with a ``transport``): a new
transport is one file and one :class:`~lightning_elche.config.Transport` member.
"""

import importlib
import pkgutil
from pathlib import Path

from lightning_elche.planes.base import AveragingPlane, PlaneSetup, RoundResult, build_plane, keeps_side_group
from lightning_elche.planes.collective import CollectivePlane
from lightning_elche.planes.cpu import CpuPlane, SnapshotTimeout

for _module in pkgutil.iter_modules([str(Path(__file__).parent)]):  # any other plane registers itself on import
    importlib.import_module(f"{__package__}.{_module.name}")

__all__ = ["AveragingPlane", "CollectivePlane", "CpuPlane", "PlaneSetup", "RoundResult", "SnapshotTimeout",
           "build_plane", "keeps_side_group"]
