"""Lightning's ``DDPStrategy`` as a fit whose members change needs it: ranks renumbered densely
after a membership change, and collectives between ElChe's rounds checked.

:class:`ElasticDDPStrategy` is the layer of :class:`~lightning_elche.ElCheStrategy` right above
``DDPStrategy``. Its rank properties answer the membership's numbering once the members changed.
``reduce``, ``barrier``, ``broadcast`` and ``all_gather`` are refused where a peer may never reach
them (inside a window); between the fit's set-up and teardown they go through the fit's
:class:`~lightning_elche.checked_collectives.CheckedCollectives` (entry-checked, waited on with
liveness checks; run again on the survivors after a rank lost in them,
:mod:`lightning_elche.collective_recovery`); outside a fit, and on other groups, they are Lightning's own.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_elche.checked_collectives import CheckedCollectives
from lightning_elche.membership.agreement import Membership
from lightning_elche.session import Session


class ElasticDDPStrategy(DDPStrategy):
    """``DDPStrategy`` numbered by the fit's membership, its collectives consulting the fit's session
    and checked collectives."""

    _membership: Optional[Membership]
    _session: Session
    _collectives: Optional[CheckedCollectives]

    # -- ranks: renumbered densely when members change --------------------------------------------

    @property
    @override
    def global_rank(self) -> int:
        membership = self._renumbered_membership()
        return membership.rank if membership is not None else super().global_rank

    @property
    @override
    def world_size(self) -> int:
        membership = self._renumbered_membership()
        return membership.world_size if membership is not None else super().world_size

    def _renumbered_membership(self) -> Optional[Membership]:
        # Ranks keep their launch numbers until the members change (for the rest of the job after that).
        membership: Optional[Membership] = getattr(self, "_membership", None)
        return membership if membership is not None and membership.renumbered else None

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # DDP counts devices; after a change only the current members shard the evaluation data.
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    # -- collectives outside ElChe's rounds ---------------------------------------------------------

    @override
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        self._session.refuse_collective("reduce()", mid_window_too=False)
        if self._session.in_window:
            self._session.warn_rank_local_reduce(rank_zero_warn)
            return tensor
        reduced = self._collectives.reduce(tensor, group, reduce_op) if self._collectives is not None else None
        return reduced if reduced is not None else super().reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self._session.refuse_collective("barrier()")
        name = args[0] if args else kwargs.get("name")
        checked = self._collectives is not None and self._collectives.barrier(name, self.determine_ddp_device_ids())
        if not checked:
            super().barrier(*args, **kwargs)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self._session.refuse_collective("broadcast()")
        lightning = super().broadcast  # an object broadcast has no asynchronous form: Lightning's, once checked
        return lightning(obj, src) if self._collectives is None else self._collectives.broadcast(
            src, lambda: lightning(obj, src))

    @override
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        self._session.refuse_collective("all_gather()")
        gathered = self._collectives.all_gather(tensor, group, sync_grads) if self._collectives is not None else None
        return gathered if gathered is not None else super().all_gather(tensor, group=group, sync_grads=sync_grads)

    def _checked_gather(self, data: Any) -> contextlib.AbstractContextManager[None]:
        # LightningModule.all_gather(data), through the loop_glue patch the strategy installs at set-up.
        self._session.refuse_collective("all_gather()")
        return self._collectives.gathering(data) if self._collectives is not None else contextlib.nullcontext()
