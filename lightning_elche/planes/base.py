"""The contract between the round protocol and a transport."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist
from torch import Tensor

from lightning_elche.averaging import AveragedLayout, RoundWeights
from lightning_elche.membership.agreement import Membership
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


class AveragingPlane(ABC):
    """Moves one round's metadata and replicas between ranks.

    Every rank calls :meth:`start`, then :meth:`collect`, then :meth:`adopt`, once per round and
    in the same order: that fixed sequence keeps ranks with different step counts from
    deadlocking. A blocking plane does all the work in :meth:`collect`; a non-blocking one lets
    the rank keep training between :meth:`start` and :meth:`collect`.
    """

    #: Whether training may continue while a round is in flight.
    non_blocking: bool = False

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

    # -- after a lost rank ---------------------------------------------------------------------

    watch: Optional[Membership] = None
    """Waits for the round's collectives while checking the peers' liveness (None: plain waits)."""

    def regroup(self, group: Optional[Any], rank: int, world_size: int) -> None:
        """Continue on the survivors' group, as ``rank`` of ``world_size``. The round whose
        :meth:`collect` raised :class:`PeerFailure` is kept: :meth:`retry` runs it again."""
        raise NotImplementedError(f"{type(self).__name__} cannot continue after a lost rank.")

    def retry(self) -> None:  # noqa: B027 (blocking planes run the whole round in collect)
        """Run the failed round again, on the group given to :meth:`regroup`, with this rank's same
        contribution; the next :meth:`collect` returns it."""

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
