"""Which signals stop a fit, and Lightning's handlers ElChe keeps or replaces."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from types import FrameType
from typing import Any, Optional, Union

from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Trainer
from lightning.pytorch.trainer.connectors.signal_connector import _HandlersCompose

from lightning_elche.rounds import StopRequest

SigtermHandler = Callable[[int, Optional[FrameType]], Any]


def stop_signal_requests(trainer: Trainer) -> dict[int, StopRequest]:
    """The signals ElChe routes into stop requests (see :meth:`LightningPatches.route_stop_signals`)."""
    routes = {int(signal.SIGTERM): StopRequest.SIGTERM}
    if under_job_launcher():
        routes[int(signal.SIGINT)] = StopRequest.SIGTERM
    requeue = slurm_requeue_signal(trainer)
    if requeue is not None:
        routes[requeue] = StopRequest.REQUEUE
    return routes


def under_job_launcher() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "SLURM_JOB_ID" in os.environ


def slurm_requeue_signal(trainer: Trainer) -> Optional[int]:
    """The signal of ``SLURMEnvironment(auto_requeue=True)``, or None when the job does not requeue."""
    environment = getattr(trainer.strategy, "cluster_environment", None)
    if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
        return int(environment.requeue_signal) if environment.requeue_signal is not None else None
    return None


def save_and_requeue_slurm_job(trainer: Trainer, signum: int) -> str:
    """Lightning's own requeue: finalize the loggers, save the HPC checkpoint (which a requeued job
    resumes from by itself) and, on global rank 0, ``scontrol requeue`` the job. Returns the path.
    Every rank calls it, at the same point."""
    path = trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)
    trainer._signal_connector._slurm_sigusr_handler_fn(signum, None)  # type: ignore[arg-type]
    return path


def chained_user_handler(
    trainer: Trainer, signum: int, current: Union[SigtermHandler, int, None]
) -> Optional[SigtermHandler]:
    # Lightning's composite handler: keep what it chained (the handler from before the fit), not
    # its own notifier (the per-rank broadcast and flag that ElChe replaces).
    if isinstance(current, _HandlersCompose):
        connector = getattr(trainer, "_signal_connector", None)
        original = getattr(connector, "_original_handlers", {}).get(signum)
        return original if callable(original) and not isinstance(original, _HandlersCompose) else None
    if callable(current) and current is not signal.default_int_handler:
        return current
    return None
