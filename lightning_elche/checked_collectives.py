"""The collectives outside ElChe's rounds, checked at entry and waited on like the rounds.

Lightning's epoch-level collectives (``barrier``, ``broadcast``, ``all_gather``, ``reduce`` for
``self.log(sync_dist=True)``, ``LightningModule.all_gather`` of a collection) and ElChe's own
end-of-training buffer average are plain blocking calls under DDP: ranks that call different
numbers of them pair up wrongly (silently, when the shapes agree) or wait for the process group's
timeout (30 minutes) when one never comes. Here every rank first records in the job's store which
collective it enters: its sequence number in the fit and a small signature (the kind; dtypes and
shapes; the structure of a gathered collection). A rank then waits for every peer's record of the
same number, in short polls, and fails on every rank, naming both sides, as soon as

* a peer's record differs (``rank 0 gathers a list of 5 tensors, rank 1 a list of 3``);
* a peer ended its fit (teardown) or went on to train the next epoch without entering it;
* a peer left the fit with an exception, its process is gone, or it went silent
  (:meth:`Membership.check`: the liveness signals the rounds use).

Only then is the collective started, asynchronously where torch allows it, and waited on through
:meth:`Membership.wait` (half-second slices with liveness checks). A store round trip per call is
cheap here: these calls come at epoch level, never per training step (a per-step ``reduce`` is
rank-local under ElChe).

A peer lost in a collective raises :class:`CollectiveMismatch` with ``lost`` set on every survivor.
Outside an evaluation run (which is run again as a whole) the fit's ``recover`` (see
:mod:`lightning_elche.collective_recovery`) carries the survivors past the loss, and the collective is
run again on the new group: what it returns is the survivors'. A collective entered again names the
one it replaces in its signature, so that survivors which failed in different collectives (a peer
that died inside one let some complete it) fail with a mismatch instead of pairing up wrongly.

Records are kept under ``<fit prefix>/collectives/gen<g>/<registry rank>/``: ``<n>`` for the
collective number ``n`` (counted from 1 in each generation of the fit's membership: a regroup
happens in a round, where every survivor has entered the same number), ``training`` (the epoch the
rank last started to train, and its count then) and ``closed`` (its count at teardown).
"""

from __future__ import annotations

import json
import pickle
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional, TypeVar, Union

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.constants import default_pg_timeout

from lightning_elche.membership.agreement import Membership
from lightning_elche.membership.change import PeerFailure
from lightning_elche.membership.survival import fence_members

T = TypeVar("T")

_POLL_FIRST_S = 0.001
_POLL_MAX_S = 0.02
_MARKERS_EVERY_S = 0.1


class CollectiveMismatch(RuntimeError):
    """A collective outside ElChe's rounds that can never complete (raised on every rank involved).

    ``lost`` is set when the cause is a lost peer (it left the fit with an exception, its process is
    gone, it went silent) rather than ranks that called different collectives: what the agreement
    on the loss starts from. A phase the survivors can run again (the fit's validation and its
    sanity check, :mod:`lightning_elche.evaluation_recovery`) survives such an error; anywhere else
    it ends the fit like any mismatch."""

    def __init__(self, message: str, lost: Optional[PeerFailure] = None) -> None:
        super().__init__(message)
        self.lost = lost


@dataclass(frozen=True)
class Entry:
    """What a rank enters: compared between ranks (``kind``, ``signature``), or shown (the rest)."""

    kind: str
    signature: str = ""
    summary: str = ""
    """The signature in words, for the message (``a list of 5 tensors``)."""
    phase: str = ""
    """Where in the fit (Lightning's hook and stage), for the message."""

    def matches(self, other: Entry) -> bool:
        return (self.kind, self.signature) == (other.kind, other.signature)

    def describe(self) -> str:
        what = f"{self.kind} of {self.summary}" if self.summary else self.kind
        return f"{what} in {self.phase}" if self.phase else what

    def dumps(self) -> str:
        return json.dumps({"kind": self.kind, "signature": self.signature, "summary": self.summary,
                           "phase": self.phase})

    @classmethod
    def loads(cls, text: Union[str, bytes]) -> Entry:
        fields = json.loads(text)
        return cls(str(fields["kind"]), str(fields["signature"]), str(fields["summary"]), str(fields["phase"]))


# -- signatures ------------------------------------------------------------------------------------


def tensor_signature(tensor: Tensor) -> str:
    """``float32[4, 3]``: what ranks must agree on for a gather or a reduce."""
    return f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}"


def collection_signature(data: Any) -> str:
    """The structure of a collection as Lightning's ``apply_to_collection`` walks it: containers,
    their lengths and keys, and each tensor's dtype and shape."""
    if isinstance(data, Tensor):
        return tensor_signature(data)
    if isinstance(data, Mapping):
        return "{" + ", ".join(f"{key!r}: {collection_signature(value)}" for key, value in data.items()) + "}"
    if isinstance(data, (list, tuple)):
        return f"{type(data).__name__}[" + ", ".join(collection_signature(item) for item in data) + "]"
    return type(data).__name__


def collection_summary(data: Any) -> str:
    """The collection in a few words: ``a list of 5 tensors``, ``a dict of 2 entries ('a', 'b')``."""
    if isinstance(data, Tensor):
        return f"a tensor of shape {list(data.shape)} ({str(data.dtype).removeprefix('torch.')})"
    if isinstance(data, Mapping):
        keys = ", ".join(repr(key) for key in list(data)[:6]) + (", ..." if len(data) > 6 else "")
        return f"a dict of {len(data)} entries ({keys})"
    if isinstance(data, (list, tuple)):
        items = "tensors" if data and all(isinstance(item, Tensor) for item in data) else "items"
        return f"a {type(data).__name__} of {len(data)} {items}"
    return f"a {type(data).__name__}"


def _first_difference(mine: str, theirs: str) -> str:
    at = next((k for k, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b), min(len(mine), len(theirs)))
    start = max(0, at - 30)
    return f"{mine[start:at + 40]!r} vs {theirs[start:at + 40]!r}"


# -- reduce ops as Lightning maps them ---------------------------------------------------------------


def reduce_op_for(reduce_op: Optional[Union[dist.ReduceOp, str]], backend: str) -> tuple[Any, bool]:
    """Lightning's mapping (``_sync_ddp``): ``"mean"``/``"avg"`` average (a sum divided by the world
    size on gloo, which has no ``AVG``), other strings name a ``ReduceOp``, None sums. Returns the
    op and whether to divide by the world size afterwards."""
    if reduce_op is None:
        return dist.ReduceOp.SUM, False
    if isinstance(reduce_op, str):
        name = "avg" if reduce_op.lower() == "mean" else reduce_op.lower()
        if name == "avg" and "gloo" in backend:
            return dist.ReduceOp.SUM, True
        return getattr(dist.ReduceOp, name.upper()), False
    return reduce_op, False


def _op_name(op: Any) -> str:
    return str(getattr(op, "name", op)).removeprefix("ReduceOp.")


# -- the checks ----------------------------------------------------------------------------------


class CheckedCollectives:
    """Entry checks and watched waits for the collectives outside the rounds, for one rank's fit.

    Args:
        membership: the fit's :class:`Membership` (the store, the members, the liveness checks);
            collectives are checked while it is active (between the fit's set-up and teardown) and
            the default group has more than one rank.
        phase: where the fit is (Lightning's hook and stage), for the messages.
        timeout: how long a live peer may take to enter the same collective (the process group's
            timeout: what a DDP collective would wait before it fails).
        world_size: the default group's size (1 while there is none).

    The collective methods return None where they do not apply (another group, no active
    membership): the caller then runs Lightning's own. The counters restart with each new fit (a
    new ``fit_prefix``) and each regroup (a new generation).
    """

    def __init__(self, membership: Callable[[], Optional[Membership]], phase: Callable[[], str],
                 timeout: timedelta = default_pg_timeout,
                 world_size: Callable[[], int] = lambda: dist.get_world_size() if dist.is_initialized() else 1) -> None:
        self._membership = membership
        self._phase = phase
        self._timeout_s = timeout.total_seconds()
        self._world_size = world_size
        self._scope: tuple[str, int] = ("", -1)
        self.count = 0
        """Collectives this rank entered in the current generation of the fit."""
        self._trained_epoch = -1
        self._covered = False
        self.recover: Optional[Callable[[CollectiveMismatch], bool]] = None
        """Carries the survivors past a lost peer (True: regrouped, run the collective again)."""
        self._again = ""

    def active(self, group: Optional[Any] = None) -> Optional[Membership]:
        """The membership to check a collective on ``group`` with, or None (not checked)."""
        membership = self._membership()
        if membership is None or not membership.active or self._world_size() < 2:
            return None
        return membership if group is None or group is dist.group.WORLD else None

    # -- what peers read -----------------------------------------------------------------------

    def _base(self, membership: Membership) -> str:
        scope = (membership.fit_prefix, membership.generation)
        if scope != self._scope:
            if scope[0] != self._scope[0]:  # a new fit
                self._trained_epoch = -1
            self._scope, self.count = scope, 0
        return f"{membership.fit_prefix}/collectives/gen{membership.generation}"

    def training_started(self, epoch: int) -> None:
        """This rank started to train ``epoch``: a peer still waiting in a collective this rank did
        not enter will never see it (one store write per epoch)."""
        membership = self.active()
        if membership is None:
            return
        base = self._base(membership)
        self._trained_epoch = epoch
        membership.store.set(f"{base}/{membership.original_rank}/training",
                             json.dumps({"epoch": epoch, "count": self.count}))

    def close(self) -> None:
        """This rank's fit ends (teardown): a peer waiting in a collective it did not enter fails."""
        membership = self.active()
        if membership is None:
            return
        base = self._base(membership)
        try:
            membership.store.set(f"{base}/{membership.original_rank}/closed", json.dumps({"count": self.count}))
        except Exception:  # noqa: BLE001 (the store may be gone at the end of a failed job)
            pass

    # -- entering ------------------------------------------------------------------------------

    def enter(self, kind: str, signature: str = "", summary: str = "") -> Optional[Membership]:
        """Enter the next collective (``kind`` with ``signature``) if checked: record it and wait
        until every peer entered the same one (again on the new group after a survived loss).
        Returns the membership (None: not checked).

        Raises:
            CollectiveMismatch: a peer entered another collective, or can never enter this one.
        """
        return self._retried(lambda: self._enter(kind, signature, summary))

    def _retried(self, attempt: Callable[[], T], restore: Callable[[], object] = lambda: None) -> T:
        """``attempt()``; each time a peer is lost in it and ``recover`` carried the survivors past
        the loss, ``restore()`` (the inputs a half-run collective may have changed) and again."""
        while True:
            try:
                result = attempt()
                self._again = ""
                return result
            except CollectiveMismatch as error:
                failed = f" (again after collective #{self.count} of generation {self._scope[1]})"
                if error.lost is None or self.recover is None or not self.recover(error):
                    self._again = ""
                    raise
                self._again = failed
                restore()

    def _enter(self, kind: str, signature: str = "", summary: str = "") -> Optional[Membership]:
        membership = self.active()
        if membership is None or self._covered:
            return membership
        entry = Entry(kind, signature + self._again, summary, self._phase())
        base = self._base(membership)
        self.count += 1
        number = self.count
        store, me = membership.store, membership.original_rank
        store.set(f"{base}/{me}/{number}", entry.dumps())
        pending = [peer for peer in membership.members if peer != me]
        poll, next_markers = _POLL_FIRST_S, time.monotonic() + _MARKERS_EVERY_S
        deadline = time.monotonic() + self._timeout_s
        while pending:
            for peer in list(pending):
                key = f"{base}/{peer}/{number}"
                if store.check([key]):
                    theirs = Entry.loads(store.get(key))
                    if not entry.matches(theirs):
                        raise self._mismatch(membership, number, entry, peer, theirs)
                    pending.remove(peer)
            if not pending:
                break
            if time.monotonic() >= next_markers:
                next_markers = time.monotonic() + _MARKERS_EVERY_S
                for peer in pending:
                    self._check_peer_can_come(membership, base, number, entry, peer)
                try:
                    membership.check()
                except PeerFailure as failure:
                    cause = _lost_peers(membership, failure)
                    raise self._cannot_complete(membership, number, entry, cause, failure) from failure
                if time.monotonic() > deadline:
                    late = ", ".join(f"rank {self._rank_of(membership, peer)}" for peer in pending)
                    raise self._cannot_complete(
                        membership, number, entry,
                        f"{late} did not enter it within the process group's timeout ({self._timeout_s:g} s)")
            time.sleep(poll)
            poll = min(_POLL_MAX_S, poll * 2)
        return membership

    @contextmanager
    def gathering(self, data: Any) -> Iterator[None]:
        """``LightningModule.all_gather(data)``: one check of the collection's structure on every
        rank; the gathers of its tensors follow from it and skip their own entry checks."""
        self.enter("self.all_gather()", collection_signature(data), collection_summary(data))
        self._covered = True
        try:
            yield
        finally:
            self._covered = False

    def _check_peer_can_come(self, membership: Membership, base: str, number: int, entry: Entry, peer: int) -> None:
        store = membership.store
        closed = f"{base}/{peer}/closed"
        if store.check([closed]):
            count = int(json.loads(store.get(closed))["count"])
            if count >= number:  # it entered this one (and went on) between the two looks: not evidence
                return
            why = membership.detect_lost().get(peer)
            if why is not None:  # it left the fit with an exception (its notice, then its teardown): a lost rank
                failure = PeerFailure(f"rank(s) [{peer}] (original numbering) left the fit")
                raise self._cannot_complete(membership, number, entry,
                                            f"rank {self._rank_of(membership, peer)} left the fit: {why}", failure)
            raise self._cannot_complete(
                membership, number, entry,
                f"rank {self._rank_of(membership, peer)} ended its fit after {count} collective(s) outside the "
                f"rounds{self._last_of(membership, base, peer, count)}")
        training = f"{base}/{peer}/training"
        if store.check([training]):
            record = json.loads(store.get(training))
            epoch, count = int(record["epoch"]), int(record["count"])
            if epoch > self._trained_epoch and count < number:
                raise self._cannot_complete(
                    membership, number, entry,
                    f"rank {self._rank_of(membership, peer)} went on to train epoch {epoch} after {count} "
                    f"collective(s) outside the rounds{self._last_of(membership, base, peer, count)}, "
                    "without entering this one")

    # -- messages -------------------------------------------------------------------------------

    @staticmethod
    def _rank_of(membership: Membership, peer: int) -> int:
        return membership.members.index(peer)

    @staticmethod
    def _last_of(membership: Membership, base: str, peer: int, count: int) -> str:
        key = f"{base}/{peer}/{count}"
        if count < 1 or not membership.store.check([key]):
            return ""
        return f" (the last: {Entry.loads(membership.store.get(key)).describe()})"

    def _mismatch(self, membership: Membership, number: int, mine: Entry, peer: int, theirs: Entry
                  ) -> CollectiveMismatch:
        # In rank order, so that every rank words it the same.
        (low, first), (high, second) = sorted([(membership.rank, mine), (self._rank_of(membership, peer), theirs)],
                                              key=lambda side: side[0])
        if first.kind == second.kind:
            verb = "gathers" if "gather" in first.kind else f"enters {first.kind} with"
            if first.summary and first.summary != second.summary:
                differs = f"rank {low} {verb} {first.summary}, rank {high} {second.summary}"
            else:
                differs = (f"rank {low} and rank {high} enter {first.kind} with different arguments: "
                           f"{_first_difference(first.signature, second.signature)}")
            differs += f" (in {first.phase})" if first.phase else ""
        else:
            differs = f"rank {low} is in {first.describe()}, rank {high} in {second.describe()}"
        return CollectiveMismatch(
            f"ElCheStrategy: the collectives outside ElChe's rounds differ between ranks at collective #{number} "
            f"of the fit: {differs}. They would pair up wrongly or wait forever. Every rank must call the same "
            "collectives (barrier, broadcast, all_gather, reduce, self.log(sync_dist=True)) in the same order, "
            "with tensors of the same shapes and collections of the same structure; gather per-rank data of "
            "different lengths by padding it to one length first (or with all_gather_object)."
        )

    @staticmethod
    def _cannot_complete(membership: Membership, number: int, entry: Entry, cause: str,
                         lost: Optional[PeerFailure] = None) -> CollectiveMismatch:
        message = (f"ElCheStrategy: {entry.describe()} on rank {membership.rank} (collective #{number} outside "
                   f"ElChe's rounds) can never complete: {cause}.")
        if lost is not None:  # nobody called it wrongly
            return CollectiveMismatch(message, lost)
        return CollectiveMismatch(message + " Every rank must call the same collectives in the same order.")

    # -- the collectives themselves ----------------------------------------------------------------

    def _wait(self, membership: Membership, work: Any, kind: str) -> None:
        """Wait for ``work`` through the rounds' watched wait; a lost peer becomes an error naming it."""
        try:
            membership.wait(work, not _uses_nccl())
        except PeerFailure as failure:
            raise CollectiveMismatch(
                f"ElCheStrategy: {kind} in {self._phase()} on rank {membership.rank} failed while waiting for its "
                f"peers: {failure}.", failure
            ) from failure

    def barrier(self, name: Optional[str], device_ids: Optional[Sequence[int]]) -> bool:
        """Lightning's ``barrier``; False when not checked here."""

        def attempt() -> bool:
            membership = self._enter(f"barrier({name!r})" if name is not None else "barrier()")
            if membership is None:
                return False
            kwargs: dict[str, Any] = {"device_ids": list(device_ids)} if device_ids and _uses_nccl() else {}
            self._wait(membership, dist.barrier(async_op=True, **kwargs), "barrier()")
            return True

        return self._retried(attempt)

    def broadcast(self, src: int, broadcast: Callable[[], T]) -> T:
        """Lightning's object ``broadcast`` (``broadcast()``, which has no asynchronous form), once
        checked. A peer that dies inside it fails gloo at once: that error becomes the loss it is."""

        def attempt() -> T:
            membership = self._enter("broadcast()", f"src={src}")
            try:
                return broadcast()
            except RuntimeError as error:
                failure = None if membership is None else _lost_within_liveness(membership)
                if membership is None or failure is None:
                    raise
                raise CollectiveMismatch(f"ElCheStrategy: broadcast() in {self._phase()} on rank {membership.rank} "
                                         f"failed: {str(error).splitlines()[0]}; {failure}.", failure) from error

        return self._retried(attempt)

    def all_gather(self, tensor: Tensor, group: Optional[Any], sync_grads: bool) -> Optional[Tensor]:
        """Lightning's ``all_gather`` without gradients: ``(world_size, *tensor.shape)``. None when
        not checked here, or (``sync_grads``, autograd's gather: Lightning's) once checked."""
        if self.active(group) is None:
            return None
        kind = "all_gather(sync_grads=True)" if sync_grads else "all_gather()"

        def attempt() -> Optional[Tensor]:
            membership = self._enter(kind, tensor_signature(tensor), collection_summary(tensor))
            if membership is None or sync_grads:
                return None
            with torch.no_grad():
                sent = tensor.contiguous()
                gathered = [torch.empty_like(sent) for _ in range(dist.get_world_size())]
                self._wait(membership, dist.all_gather(gathered, sent, async_op=True), kind)
                return torch.stack(gathered)

        return self._retried(attempt)

    def all_gather_object(self, local: Callable[[], Any]) -> list[Any]:
        """Every rank's ``local()``, in rank order: ElChe's own gather (a checkpoint's coverage),
        checked and watched. ``dist.all_gather_object`` blocks with no asynchronous form, so a
        stopped peer would hold it until the transport's timeout; here the pickled objects travel
        as two tensor gathers, each waited for through the rounds' watched wait (a lost peer is
        found within the liveness timeout), and a survived loss runs it again on the survivors,
        asking ``local()`` again (the change moved the lost rank's work)."""

        def attempt() -> list[Any]:
            membership = self._enter("all_gather_object()")
            world_size = dist.get_world_size() if dist.is_initialized() else 1
            if membership is None:  # not checked: a plain gather (a lone rank keeps its own)
                gathered: list[Any] = [local()] * world_size
                if world_size > 1:
                    dist.all_gather_object(gathered, gathered[0])
                return gathered
            device = torch.device("cuda", torch.cuda.current_device()) if _uses_nccl() else torch.device("cpu")
            data = torch.frombuffer(bytearray(pickle.dumps(local())), dtype=torch.uint8).to(device)
            size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
            sizes = [torch.empty_like(size) for _ in range(world_size)]
            self._wait(membership, dist.all_gather(sizes, size, async_op=True), "all_gather_object()")
            lengths = [int(n) for n in torch.cat(sizes).tolist()]
            padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
            padded[: data.numel()] = data
            chunks = [torch.empty_like(padded) for _ in range(world_size)]
            self._wait(membership, dist.all_gather(chunks, padded, async_op=True), "all_gather_object()")
            return [pickle.loads(chunk[:n].cpu().numpy().tobytes()) for chunk, n in zip(chunks, lengths, strict=True)]

        return self._retried(attempt)

    def reduce(self, tensor: Any, group: Optional[Any], reduce_op: Optional[Union[dist.ReduceOp, str]],
               kind: str = "reduce()") -> Optional[Tensor]:
        """Lightning's ``_sync_ddp`` (in place), with the entry check in place of its leading
        barrier; None when not checked here (a non-tensor is returned as it is, as Lightning does).
        ``kind`` names the collective to the peers' checks and in errors."""
        if not isinstance(tensor, Tensor) or self.active(group) is None:
            return None
        op, divide = reduce_op_for(reduce_op, str(dist.get_backend()))
        sent = tensor.clone()  # what to reduce again if a peer is lost in the middle of the reduce

        def attempt() -> Optional[Tensor]:
            membership = self._enter(kind, f"{tensor_signature(tensor)} {_op_name(op)}")
            if membership is None:  # a lone survivor: Lightning's own reduce
                return None
            self._wait(membership, dist.all_reduce(tensor, op=op, async_op=True), kind)
            if not divide:
                return tensor
            world_size = dist.get_world_size()
            return tensor.copy_(tensor / world_size) if not torch.is_floating_point(tensor) else tensor.div_(world_size)

        return self._retried(attempt, lambda: tensor.copy_(sent))

    def all_reduce(self, kind: str) -> Callable[[Tensor, Any], None]:
        """An in-place all-reduce for ElChe's own collectives outside the rounds (``kind`` names it):
        checked, watched and run again among the survivors of a loss like Lightning's reduce; a
        plain ``all_reduce`` where it is not checked (no membership, a lone rank)."""

        def all_reduce(tensor: Tensor, op: Any) -> None:  # a dist.ReduceOp
            if self.reduce(tensor, None, op, kind) is None:
                dist.all_reduce(tensor, op=op)

        return all_reduce


def _lost_peers(membership: Membership, failure: PeerFailure) -> str:
    """The liveness check's finding, with each lost peer's reason where the membership tells it."""
    try:
        lost = membership.detect_lost()
    except Exception:  # noqa: BLE001 (the reasons only improve the message)
        lost = {}
    if not lost:
        return str(failure)
    fence_members(lost, membership)  # the fit ends here: a stopped or stalled peer must not outlive it
    return "; ".join(f"rank {membership.members.index(peer)} left the fit: {why}" for peer, why in sorted(lost.items()))


def _lost_within_liveness(membership: Membership) -> Optional[PeerFailure]:
    """The loss behind a transport error, once the liveness signals show it (None: no peer is lost)."""
    deadline = time.monotonic() + membership.liveness_timeout_s + 1.0
    while time.monotonic() < deadline:
        try:
            membership.check()
        except PeerFailure as failure:
            return failure
        time.sleep(0.05)
    return None


def _uses_nccl() -> bool:
    return "nccl" in str(dist.get_backend())
