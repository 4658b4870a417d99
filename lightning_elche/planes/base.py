"""The contract between the round protocol and a transport, and how a plane is chosen.

A plane is one class in one file of this package, for one :class:`~lightning_elche.config.Transport`
(its ``transport`` class attribute): defining the class registers it, and :func:`build_plane`
builds the plane of a run mode's transport from a :class:`PlaneSetup`. A plane owns whatever
groups it needs beyond the default one, and rebuilds them when it takes a membership change.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_elche.averaging import AveragedLayout, RoundWeights
from lightning_elche.config import RunMode, Transport
from lightning_elche.membership.agreement import Membership
from lightning_elche.membership.change import Change
from lightning_elche.outer import OuterOptimizer
from lightning_elche.rounds import Meta, RanksOutOfStep


@dataclass
class RoundResult:
    """A completed round: the gathered metadata, the weights used, this rank's drift.

    ``divergence`` is ``[||pre - consensus||, ||pre||, ||consensus||]`` (consensus before any
    outer step) as a float64 tensor, or ``None`` when no rank moved and nothing was averaged.
    """

    table: list[list[float]]
    weights: RoundWeights
    divergence: Optional[Tensor]


@dataclass(frozen=True)
class PlaneSetup:
    """What every rank builds its plane from, at the start of a fit."""

    layout: AveragedLayout
    rank: int
    world_size: int
    device: torch.device
    """The rank's own device."""
    run_mode: RunMode
    gamma: float
    outer: Optional[OuterOptimizer]
    """The outer optimizer the plane applies to each consensus (None: plain averaging)."""
    watch: Optional[Membership]
    """Waits for the round's collectives while checking the peers (None: plain waits)."""
    round_timeout: timedelta
    """How long a round on a group of the plane's own may wait for a silent peer."""


_PLANES: dict[Transport, type[AveragingPlane]] = {}


def build_plane(setup: PlaneSetup) -> AveragingPlane:
    """The plane of ``setup.run_mode``'s transport. Every rank calls it at the same point of the
    fit (a plane may create a process group)."""
    if setup.run_mode.transport not in _PLANES:
        known = ", ".join(t.value for t in _PLANES)
        raise ValueError(f"No averaging plane is registered for transport {setup.run_mode.transport.value!r} "
                         f"(registered: {known}).")
    return _PLANES[setup.run_mode.transport].build(setup)


def keeps_side_group(transport: Transport) -> bool:
    """Whether the plane of ``transport`` builds a process group of its own."""
    return transport in _PLANES and _PLANES[transport].keeps_side_group


class AveragingPlane(ABC):
    """Moves one round's metadata and replicas between ranks.

    Every rank calls :meth:`start`, then :meth:`collect`, then :meth:`adopt`, once per round and
    in the same order: that fixed sequence keeps ranks with different step counts from
    deadlocking. A blocking plane does all the work in :meth:`collect`; a non-blocking one lets
    the rank keep training between :meth:`start` and :meth:`collect`.
    """

    transport: ClassVar[Optional[Transport]] = None
    """The transport this plane serves; a concrete plane sets it, which registers the class."""

    #: Whether training may continue while a round is in flight.
    non_blocking: bool = False

    keeps_side_group: ClassVar[bool] = False
    """The plane builds a process group of its own (every member again at each change)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.transport is not None:
            _PLANES[cls.transport] = cls

    @classmethod
    def build(cls, setup: PlaneSetup) -> AveragingPlane:
        """This plane for a fit, from what every rank knows (see :func:`build_plane`)."""
        raise NotImplementedError(f"{cls.__name__} does not build from a PlaneSetup.")

    @property
    def round_bytes(self) -> int:
        """Payload bytes this rank puts on the wire in a realized round (metadata excluded)."""
        return 0

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

    def start_epoch(self) -> None:  # noqa: B027 (optional hook: a plane without a module's layout)
        """An epoch starts (every rank): its first round looks for modules added or replaced."""

    # -- after a membership change ---------------------------------------------------------------

    watch: Optional[Membership] = None
    """Waits for the round's collectives while checking the peers' liveness (None: plain waits)."""

    def apply_change(self, change: Change) -> None:
        """Continue with ``change.after`` on the rebuilt default group (and groups of its own,
        rebuilt here by every member in the same order). The round whose :meth:`collect` raised
        :class:`PeerFailure` is kept: :meth:`retry` runs it again."""
        raise NotImplementedError(f"{type(self).__name__} cannot continue after a membership change.")

    def retry(self) -> None:  # noqa: B027 (blocking planes run the whole round in collect)
        """Run the failed round again, on the groups of the last :meth:`apply_change`, with this
        rank's same contribution; the next :meth:`collect` returns it."""

    def _await(self, work: Any, host_blocking: bool = True) -> None:
        if self.watch is None:
            work.wait()
        else:
            self.watch.wait(work, host_blocking)


def all_gather_flat(output: Tensor, local: Tensor, group: Optional[Any] = None, async_op: bool = False) -> Any:
    """All-gather equal-sized tensors into one flat ``output`` (rank-major); the work when ``async_op``."""
    # torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, local, group=group, async_op=async_op)


def reduce_scatter_flat(output: Tensor, source: Tensor, op: Any, group: Optional[Any] = None,
                        async_op: bool = False) -> Any:
    """Reduce equal shares of one flat ``source`` over the ranks, this rank's share into ``output``."""
    # torch 2.13 renamed reduce_scatter_tensor (now deprecated) to reduce_scatter_single.
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, source, op=op, group=group, async_op=async_op)


def stamp_layout(local: Tensor, layout: AveragedLayout) -> bool:
    """Bring ``layout`` up to date with the module's ``requires_grad`` flags and write its
    signature into this round's metadata; whether the layout was rebuilt.

    Called by :meth:`AveragingPlane.start`, so the signature is the one of the bytes the round
    sends. Writing one slot of a device tensor queues a fill, it does not synchronize."""
    rebuilt = layout.refresh()
    local[Meta.SIGNATURE] = layout.signature
    return rebuilt


def check_layout(table: list[list[float]], layout: AveragedLayout, rank: int) -> None:
    """Refuse, on every rank alike, a round whose ranks average different layouts, naming the
    likely cause. Rounds or epochs that differ are left to ``validate_table``, which names those."""
    signatures = [row[Meta.SIGNATURE] for row in table]
    if all(s == signatures[0] for s in signatures):
        return
    for slot in (Meta.ROUND, Meta.EPOCH):
        if any(row[slot] != table[0][slot] for row in table):
            return
    raise RanksOutOfStep(
        f"ElChe ranks average different parameter layouts at round {int(table[0][Meta.ROUND])}: "
        f"signatures {[int(s) for s in signatures]} (rank {rank} averages {len(layout.names)} trainable "
        f"parameter tensors, {layout.params.numel} values). Either the models differ, or requires_grad "
        "was changed on some ranks only or in the middle of an epoch: change it on every rank and "
        "between epochs (e.g. in on_train_epoch_start, or with BackboneFinetuning); the next round "
        "then averages the new set everywhere."
    )
