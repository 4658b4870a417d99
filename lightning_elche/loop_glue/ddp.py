"""The process groups Lightning's DDP strategy sets up, and its DDP internals ElChe reads."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
)
from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook, _sync_module_states
from lightning.pytorch.strategies.ddp import default_pg_timeout
from torch.nn import Module

from lightning_elche import job_store
from lightning_elche.job_store import JobStoreLink


def distributed_is_initialized() -> bool:
    return _distributed_is_initialized()


def sync_module_states(module: Module) -> None:
    """Broadcast rank 0's parameters and buffers, as DistributedDataParallel's constructor does."""
    _sync_module_states(module)


def default_group_store() -> dist.Store:
    """The store the default process group was set up on."""
    return dist.distributed_c10d._get_default_store()


def init_process_group_on_job_store(strategy: Any) -> Optional[JobStoreLink]:
    """``DDPStrategy.setup_distributed``, with the default group's store outside global rank 0.

    Lightning's ``env://`` set-up hosts the job's ``TCPStore`` inside rank 0, so that rank 0's death
    takes the store, and every survivor with it. Instead, global rank 0 starts a store host on
    MASTER_ADDR:MASTER_PORT (:mod:`lightning_elche.job_store`), every rank registers there and sets
    up the default group on the generation-0 keys. Under torchrun's agent store (which already
    lives outside the ranks) the keys are those of this restart attempt: the agent keeps one store
    for every restart, and a restarted rank could otherwise read a dead peer's address.

    Returns this process's link to the job's store; a later fit in a process whose default group
    is already set up keeps the link it has (Lightning, too, leaves such a group alone).
    """
    from lightning.fabric.utilities.distributed import _init_dist_connection
    from lightning.fabric.utilities.seed import reset_seed

    reset_seed()
    strategy.set_world_ranks()
    strategy._process_group_backend = strategy._get_process_group_backend()
    if dist.is_initialized():
        return job_store.current_link()
    environment = strategy.cluster_environment
    timeout = strategy._timeout if strategy._timeout is not None else default_pg_timeout
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True):
        client = job_store.connect(environment.main_address, environment.main_port, timeout)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        link = job_store.join(dist.PrefixStore(f"/lightning_elche/attempt{attempt}", client), strategy.global_rank)
    else:
        link = job_store.open_job_store(environment.main_address, environment.main_port, strategy.global_rank,
                                        strategy.world_size, timeout)
    device = strategy.root_device
    _init_dist_connection(environment, strategy._process_group_backend, timeout=timeout,
                          store=link.default_group_store(), device_id=device if device.type != "cpu" else None)
    return link


def process_group_timeout(strategy: Any) -> Optional[timedelta]:
    """The collective timeout the user gave the strategy (``DDPStrategy(timeout=...)``)."""
    return strategy._timeout


def ddp_model_averager(strategy: Any) -> Optional[Any]:
    """The ``PeriodicModelAverager`` of a ``DDPStrategy`` with post-local SGD (bench comparison arm)."""
    return strategy._model_averager


def register_ddp_comm_hook(strategy: Any) -> None:
    """Register the communication hook a ``DDPStrategy`` was built with on its wrapped model
    (bench comparison arm; Lightning does it itself on CUDA only)."""
    _register_ddp_comm_hook(
        model=strategy.model, ddp_comm_state=strategy._ddp_comm_state, ddp_comm_hook=strategy._ddp_comm_hook
    )
