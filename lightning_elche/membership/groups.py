"""Process-group surgery, in one place: the default group of the current members, and the side
groups a plane keeps for itself.

After a change the default group is rebuilt on the new members: NCCL's own ``shrink_group`` where
the installed torch and NCCL offer it (losses only), else a new group on the store keys of the
new generation. Either way every other group is gone, so a plane that keeps a side group builds a
new one (:func:`new_side_group`) when it takes the change, and lets the broken one go with
:func:`abandon_group`. In an admission the side group is built with the default group, watched
(:func:`init_generation_group_watched`): taking the change is then no rendezvous a lost member
could hold.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_elche.job_store import generation_prefix
from lightning_elche.membership.agreement import Membership
from lightning_elche.membership.change import Change

log = logging.getLogger(__name__)


_made_ahead: list[Any] = []
"""The side group built with the current default group in an admission
(:func:`init_generation_group_watched`), until a plane takes it: a member's when it takes the
change, a joiner's when it builds its plane. It goes with its default group (:func:`let_default_group_go`)."""


def new_side_group(timeout: timedelta) -> Any:
    """A gloo group over the current members (every member calls it, in the same order); the one
    built with the default group, when there is one."""
    if _made_ahead:
        return _made_ahead.pop()
    return dist.new_group(backend="gloo", timeout=timeout)


def abandon_side_group_ahead(watch: Optional[Membership]) -> None:
    """Let the side group built with the default group go, unused (its generation was left out,
    or this joiner was dropped): a member of it may be lost."""
    while _made_ahead:
        abandon_group(_made_ahead.pop(), watch)


def abandon_group(group: Any, watch: Optional[Membership]) -> None:
    """Let a group that may still wait on a lost member go: abort it, and keep it referenced (its
    release would join transport threads blocked until the group's timeout)."""
    with contextlib.suppress(Exception):
        group.abort()
    if watch is not None:
        watch.abandon(group)


def release_group(group: Any) -> None:
    """Destroy a side group at the end of a fit (nothing to do once the default group is gone)."""
    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group(group)


def _default_group_shrinks() -> bool:
    """Whether the default group's backend can drop ranks in place (NCCL >= 2.27 with torch >= 2.10)."""
    if not hasattr(dist.distributed_c10d, "shrink_group") or "nccl" not in str(dist.get_backend()):
        return False
    try:
        world = dist.group.WORLD
        backend = world._get_backend(torch.device("cuda")) if world is not None else None
        return bool(getattr(backend, "supports_shrinking", False))
    except Exception:
        return False


class ProcessGroups:
    """The default process group of the fit's current members.

    Args:
        membership: the fit's members (store, key prefix, generation, this rank's number).
        timeout: the transport's collective timeout (``DDPStrategy(timeout=...)``).
        device: the rank's CUDA device for NCCL's eager init (None on CPU).
    """

    def __init__(self, membership: Membership, timeout: Optional[timedelta], device: Optional[torch.device]) -> None:
        self.membership = membership
        self.timeout = timeout
        self.device = device
        self._backend = "gloo"

    def rebuild(self, change: Change) -> str:
        """Move the default group to ``change.after``; returns how (``"shrink_group"`` or ``"new group"``).

        Shrinking destroys the other groups; so does a new group: every plane rebuilds its own
        side group when it takes the change."""
        if not change.is_join and _default_group_shrinks() and self._shrink(change.lost):
            return "shrink_group"
        return self.renew()

    def renew(self) -> str:
        """A new default group on the store keys of the membership's current generation (an
        admission that left someone out after its group was up: that group is not the one of
        any change the holders took, so shrinking it by a change's ranks would be wrong)."""
        backend = self._backend_now()
        let_default_group_go(self.membership)
        init_generation_group(self.membership, backend, self.timeout, self.device)
        return "new group"

    def _shrink(self, lost: list[int]) -> bool:
        # SHRINK_ABORT first aborts the collectives still waiting on the lost ranks.
        try:
            dist.distributed_c10d.shrink_group(lost, shrink_flags=dist.distributed_c10d.SHRINK_ABORT)
        except Exception as error:  # e.g. an NCCL build without shrink support: build a new group
            log.warning(f"ElCheStrategy: shrink_group failed ({error}); building a new group over the store.")
            return False
        return True

    def renew_watched(self, side_timeout: Optional[timedelta] = None) -> bool:
        """:meth:`renew`, watched (:func:`init_generation_group_watched`; ``side_timeout``: a plane's
        side group is built with it): False when a member of the generation was lost before the
        groups were up."""
        backend = self._backend_now()
        let_default_group_go(self.membership)
        return init_generation_group_watched(self.membership, backend, self.timeout, self.device, side_timeout)

    def _backend_now(self) -> str:
        # Remembered: a watched group that never came up leaves no default group to ask.
        if dist.is_initialized():
            self._backend = str(dist.get_backend())
        return self._backend


def let_default_group_go(membership: Membership) -> None:
    """Abandon and destroy the default group, if there is one (a watched one may never have come up)."""
    abandon_side_group_ahead(membership)  # built over the same members: it goes with them
    if dist.is_initialized():
        # A collective stuck on a lost rank must not hold the group, nor may its release wait for it.
        abandon_group(dist.group.WORLD, membership)
        dist.destroy_process_group()


def init_generation_group(membership: Membership, backend: str, timeout: Optional[timedelta],
                          device: Optional[torch.device], store: Any = None) -> None:
    """The default group of ``membership``'s current generation, on its store keys (every member, and
    a joiner entering the fit with that generation); ``store``: the job's store to build it on
    (default ``membership.store``)."""
    base = membership.store if store is None else store
    prefixed = dist.PrefixStore(f"{membership.fit_prefix}/{generation_prefix(membership.generation)}/", base)
    dist.init_process_group(backend, store=prefixed, rank=membership.rank, world_size=membership.world_size,
                            timeout=timeout, device_id=device)


GROUP_WAIT_FLOOR_S = 30.0
"""The least a watched group build waits for its rendezvous (:func:`init_generation_group_watched`)."""


def init_generation_group_watched(membership: Membership, backend: str, timeout: Optional[timedelta],
                                  device: Optional[torch.device], side_timeout: Optional[timedelta] = None) -> bool:
    """:func:`init_generation_group` in an admission, where a participant may die after it said it
    was there: the rendezvous waits for every rank until the transport's timeout, so it runs on a
    thread (on a store connection of its own: a client's blocking wait holds its connection), while
    this thread watches the generation's other members. Returns whether the group is up; False when
    one of them was lost first, or after max(30 s, 3 x liveness timeout).

    ``side_timeout``: the plane keeps a side group (the ``cpu_*`` modes), which the same thread
    builds next, with this timeout once it is up (:func:`new_side_group` hands it to the plane).
    Its rendezvous is one more a lost member would never complete; built here, it is watched and
    settled with the default group's, and taking the change builds nothing.

    Each rendezvous is given that bound as its timeout (a group takes ``timeout`` or
    ``side_timeout`` once it is up): a thread left in a rendezvous that a lost rank never completes
    ends by then, and the process waits for it at exit (a thread still inside torch's store wait
    when the interpreter finalizes aborts the process)."""
    store = membership.store.clone() if hasattr(membership.store, "clone") else membership.store
    limit = max(GROUP_WAIT_FLOOR_S, 3 * membership.liveness_timeout_s)
    rendezvous = timedelta(seconds=limit) if timeout is None else min(timeout, timedelta(seconds=limit))
    failed: list[BaseException] = []
    side: list[Any] = []

    def build() -> None:
        try:
            if device is not None and device.type == "cuda":
                torch.cuda.set_device(device)
            init_generation_group(membership, backend, rendezvous, device, store=store)
            if timeout is not None and timeout != rendezvous:
                dist.distributed_c10d._set_pg_timeout(timeout)
            if side_timeout is not None:
                group = dist.new_group(backend="gloo", timeout=min(side_timeout, timedelta(seconds=limit)))
                dist.distributed_c10d._set_pg_timeout(side_timeout, group)
                side.append(group)
        except BaseException as error:  # reported below, on the watching thread
            failed.append(error)

    thread = threading.Thread(target=build, name=f"elche-group-gen{membership.generation}")
    thread.start()
    deadline = time.monotonic() + limit
    others = [m for m in membership.members if m != membership.original_rank]
    while thread.is_alive():
        membership.progress.advance()  # waiting on the peers: not stuck
        lost = membership.signals.lost(others)
        if lost or time.monotonic() > deadline:
            why = "; ".join(f"member {m}: {reason}" for m, reason in lost.items()) or f"not up within {limit:.0f} s"
            log.warning(f"ElCheStrategy: the group of generation {membership.generation} did not come up ({why}).")
            membership.abandon(thread, store)
            return False
        thread.join(timeout=0.05)
    if failed:
        log.warning(f"ElCheStrategy: the group of generation {membership.generation} failed: {failed[0]}.")
        return False
    # Only a build this thread saw through: an abandoned one must never hand a plane its group.
    _made_ahead.extend(side)
    return True
