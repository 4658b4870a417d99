"""Who is still in the fit: liveness, agreement on lost ranks, and the watched wait of a collective.

Every rank keeps a heartbeat counter in the job's store (a background thread bumps it), and a rank
that fails with an exception leaves a notice there before it exits. A survivor decides that a peer
is lost from three signals, the fastest first:

* the peer left a notice (an exception in its training step, a clean exit);
* the peer's process is gone (same host only: ``kill -9``, a crash, the OOM killer);
* the peer's heartbeat did not move for ``liveness_timeout`` (a stopped or hung process, a
  remote host that vanished).

A collective of a round is never waited on blindly: :meth:`Membership.wait` waits for it in
slices and checks the signals between slices, so a dead peer is noticed in about a second on one
host and after ``liveness_timeout`` across hosts, never at the transport's own timeout.

Survivors agree on the lost ranks through the store: the first proposal for the next generation
wins (``compare_set``), every rank adopts it, and the ranks it names are out for good (membership
only shrinks). Ranks are numbered densely after each loss, in the order of their original ranks.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

from lightning_elche.job_store import heartbeat_key, parse_process, proc_key, process_alive
from lightning_elche.membership.change import PeerFailure, RanksLost

DEFAULT_LIVENESS_TIMEOUT = timedelta(seconds=30)
_CHECK_INTERVAL_S = 0.5
_SPIN_S = 0.005  # how long a wait on a device collective polls without sleeping
_TIMED_OUT = "timed out"

def resolve_liveness_timeout(value: Any, transport_timeout: Optional[timedelta]) -> timedelta:
    """The liveness timeout to use: ``value`` (checked), or by default 30 s, or half the transport's
    timeout when that is shorter (a lost rank must be found before the transport gives up)."""
    if value is not None:
        return check_liveness_timeout(value)
    if transport_timeout is None or transport_timeout >= 2 * DEFAULT_LIVENESS_TIMEOUT:
        return DEFAULT_LIVENESS_TIMEOUT
    return max(timedelta(seconds=1), transport_timeout / 2)


def check_liveness_timeout(value: Any) -> timedelta:
    if not isinstance(value, timedelta) or value.total_seconds() < 1.0:
        raise ValueError(
            f"ElCheStrategy(liveness_timeout={value!r}) is invalid: expected a timedelta of at least 1 second "
            "(a peer silent for that long is declared lost)."
        )
    return value


@dataclass
class Loss:
    """One agreed loss: the ranks that left, in the numbering before it, and why."""

    generation: int
    lost: list[int]  # numbering before this loss
    lost_original: list[int]  # ranks at process-group set-up
    survivors: list[int]  # numbering before this loss; new rank k is survivors[k]
    reasons: dict[int, str] = field(default_factory=dict)  # by original rank
    trained_batches: dict[int, int] = field(default_factory=dict)
    """By original rank: batches of the current epoch in the consensus (the rest went to the survivors)."""
    detected_at: float = 0.0  # time.time()
    regrouped_with: str = ""
    """How the survivors' process group was built: ``"shrink_group"`` or ``"new group"``."""


class Heartbeat:
    """A daemon thread bumping this rank's heartbeat counter in the store (its own connection)."""

    def __init__(self, store: Any, rank: int, interval_s: float) -> None:
        self._store = store.clone() if hasattr(store, "clone") else store
        self._key = heartbeat_key(rank)
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"elche-heartbeat-rank{rank}", daemon=True)
        self._store.add(self._key, 1)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._store.add(self._key, 1)
            except Exception:  # the store is gone: the job is ending; peers see this rank silent
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self._interval_s + 5.0)


class Membership:
    """The ranks of one fit as seen from one rank, and the agreement protocol after a loss.

    Args:
        store: the job's store (outliving any one rank when the job has a store host).
        fit_prefix: a key prefix unique to this fit, identical on every rank.
        rank: this process's rank in the job's registry (:mod:`lightning_elche.job_store`).
        members: the registry ranks of the fit's ranks, in rank order (the same on every rank).
        liveness_timeout: how long a heartbeat may stand still before its rank is declared lost.
        join_timeout: how long survivors wait for a live but absent peer to join a regroup.
        renumbered: an earlier fit of the job lost ranks (``members`` are its survivors).
    """

    def __init__(
        self,
        store: Any,
        fit_prefix: str,
        rank: int,
        members: list[int],
        liveness_timeout: timedelta,
        join_timeout: timedelta,
        renumbered: bool = False,
    ) -> None:
        self.store = store
        self.fit_prefix = fit_prefix
        self.original_rank = rank
        self.members = list(members)  # registry ranks, in the current numbering
        self._inherited_renumbering = renumbered
        self.abandoned: list[Any] = []
        self.generation = 0
        self.losses: list[Loss] = []
        self.liveness_timeout_s = liveness_timeout.total_seconds()
        self.join_timeout_s = join_timeout.total_seconds()
        self._procs: dict[int, tuple[str, int]] = {}
        self._beats: dict[int, tuple[int, float]] = {}  # original rank -> (counter, local time it last moved)
        self._next_check = 0.0
        self.heartbeat = Heartbeat(store, rank, min(1.0, self.liveness_timeout_s / 10.0))
        self.active = True
        """Between set-up and the end of the fit: a peer that leaves is survived."""

    # -- the current numbering --------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.members.index(self.original_rank)

    @property
    def world_size(self) -> int:
        return len(self.members)

    @property
    def renumbered(self) -> bool:
        """Whether the ranks no longer carry their launch numbers (a rank was lost in this job)."""
        return self._inherited_renumbering or bool(self.losses)

    @property
    def lost_count(self) -> int:
        return sum(len(loss.lost) for loss in self.losses)

    @property
    def lost_original(self) -> list[int]:
        return [r for loss in self.losses for r in loss.lost_original]

    def close(self) -> None:
        self.active = False
        self.heartbeat.close()

    def leave(self, reason: str) -> None:
        """Tell the peers that this rank is leaving the fit (an exception): they stop waiting for it."""
        self.active = False
        try:
            self.store.set(self._notice_key(self.original_rank), reason[:2000])
        except Exception:  # the store may be gone; the peers then notice the process is gone
            pass

    def left_a_notice(self, rank: int) -> bool:
        """Whether ``rank`` said it was leaving (an exception): it is winding down by itself."""
        return bool(self.store.check([self._notice_key(rank)]))

    def _notice_key(self, rank: int) -> str:
        return f"{self.fit_prefix}/membership/left/{rank}"

    # -- waiting on a collective --------------------------------------------------------------------

    def wait(self, work: Any, host_blocking: bool = True) -> None:
        """Wait for an async collective, checking the peers' liveness every half second.

        ``host_blocking``: the work's ``wait(timeout)`` blocks the host (gloo); False polls
        ``is_completed()`` instead (NCCL, whose ``wait`` only orders streams).

        Raises:
            PeerFailure: the collective failed, a peer is lost, or survivors already started a regroup.
        """
        spin_until = time.monotonic() + _SPIN_S
        while True:
            try:
                if host_blocking:
                    work.wait(timeout=timedelta(seconds=_CHECK_INTERVAL_S))
                    return
                if work.is_completed():
                    work.wait()
                    return
                # Spin first: a sleep's wake-up latency would add to every short collective.
                if time.monotonic() >= spin_until:
                    time.sleep(0.0002)
            except RuntimeError as error:
                if _TIMED_OUT not in str(error).lower():
                    raise PeerFailure(f"a collective of the round failed: {str(error).splitlines()[0]}") from error
            try:
                self.check()
            except PeerFailure:
                self.abandon(work)
                raise

    def abandon(self, *handles: Any) -> None:
        """Keep collectives (and groups) that still wait on a lost rank referenced for the rest of
        the fit: releasing one joins its transport threads, which would block until its timeout."""
        self.abandoned.extend(handles)

    def check(self) -> None:
        """Raise :class:`PeerFailure` when a peer is lost or a regroup was proposed (rate-limited)."""
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + _CHECK_INTERVAL_S
        if self.store.check([self._proposal_key(self.generation + 1)]):
            raise PeerFailure("survivors are regrouping after a lost rank")
        lost = self.detect_lost()
        if lost:
            raise PeerFailure(f"rank(s) {sorted(lost)} (original numbering) stopped answering")

    # -- detection -------------------------------------------------------------------------------------

    def detect_lost(self) -> dict[int, str]:
        """Peers (original ranks) this rank can tell are lost, with the reason."""
        lost: dict[int, str] = {}
        now = time.monotonic()
        for peer in self.members:
            if peer == self.original_rank:
                continue
            reason = self._lost_reason(peer, now)
            if reason is not None:
                lost[peer] = reason
        return lost

    def _lost_reason(self, peer: int, now: float) -> Optional[str]:
        notice = self._notice_key(peer)
        if self.store.check([notice]):
            return f"it failed: {self.store.get(notice).decode(errors='replace')}"
        proc = self.process_of(peer)
        if proc is not None and process_alive(*proc) is False:
            return f"its process (pid {proc[1]}) is gone"
        count = self.store.add(heartbeat_key(peer), 0)
        seen = self._beats.get(peer)
        if seen is None or seen[0] != count:
            self._beats[peer] = (count, now)
            return None
        silent = now - seen[1]
        if silent >= self.liveness_timeout_s:
            return f"silent for {silent:.0f} s (liveness_timeout={self.liveness_timeout_s:.0f} s)"
        return None

    def process_of(self, peer: int) -> Optional[tuple[str, int]]:
        """``(host, pid)`` of an original rank, when it registered."""
        if peer not in self._procs:
            key = proc_key(peer)
            if not self.store.check([key]):
                return None
            self._procs[peer] = parse_process(self.store.get(key).decode())
        return self._procs[peer]


    # -- agreement -----------------------------------------------------------------------------------

    def _proposal_key(self, generation: int) -> str:
        return f"{self.fit_prefix}/membership/gen{generation}/lost"

    def _joined_key(self, generation: int, rank: int) -> str:
        return f"{self.fit_prefix}/membership/gen{generation}/joined/{rank}"

    def agree(self, cause: BaseException) -> Loss:
        """After a failed round: agree with the other survivors on who is lost, and wait until every
        survivor has joined the next generation. Returns the loss (already applied).

        Raises:
            RanksLost: this rank was declared lost by the others (it must leave the fit).
            PeerFailure: nobody could be found lost within the liveness timeout (``cause`` was
                something else).
        """
        deadline = time.monotonic() + self.liveness_timeout_s + 2 * _CHECK_INTERVAL_S
        applied: list[Loss] = []
        while True:
            proposal = self._read_proposal(self.generation + 1)
            if proposal is None:
                lost = self.detect_lost()
                if not lost:
                    if time.monotonic() > deadline:
                        raise PeerFailure(
                            f"a round failed ({cause}) but no peer was found lost within "
                            f"liveness_timeout={self.liveness_timeout_s:.0f} s"
                        ) from cause
                    time.sleep(0.05)
                    continue
                proposal = self._propose(self.generation + 1, lost)
            applied.append(self._apply(proposal))
            missing = self._join(applied[-1].generation)
            if missing is None:
                loss = _combined(applied)
                self.losses[-len(applied):] = [loss]  # the record holds what the caller acts on
                return loss
            if missing:  # a survivor vanished before it joined: the next generation drops it too
                self._propose(self.generation + 1, missing)

    def _read_proposal(self, generation: int) -> Optional[dict[int, str]]:
        key = self._proposal_key(generation)
        if not self.store.check([key]):
            return None
        return {int(k): v for k, v in json.loads(self.store.get(key)).items()}

    def _propose(self, generation: int, lost: dict[int, str]) -> dict[int, str]:
        key = self._proposal_key(generation)
        mine = json.dumps({str(k): v for k, v in sorted(lost.items())})
        winner = self.store.compare_set(key, "", mine)
        return {int(k): v for k, v in json.loads(winner).items()}

    def _apply(self, proposal: dict[int, str]) -> Loss:
        if self.original_rank in proposal:
            raise RanksLost(
                f"ElChe: the other ranks declared this rank (original rank {self.original_rank}) lost "
                f"({proposal[self.original_rank]}) and went on without it; it leaves the fit."
            )
        before = list(self.members)
        survivors = [k for k, r in enumerate(before) if r not in proposal]
        loss = Loss(
            generation=self.generation + 1,
            lost=[k for k, r in enumerate(before) if r in proposal],
            lost_original=sorted(r for r in before if r in proposal),
            survivors=survivors,
            reasons={r: proposal[r] for r in before if r in proposal},
            detected_at=time.time(),
        )
        self.members = [before[k] for k in survivors]
        self.generation = loss.generation
        self.losses.append(loss)
        return loss

    def _join(self, generation: int) -> Optional[dict[int, str]]:
        """Announce this rank in ``generation`` and wait for every member. None when all joined;
        otherwise the members found lost meanwhile (empty when another rank already proposed)."""
        self.store.set(self._joined_key(generation, self.original_rank), "1")
        deadline = time.monotonic() + self.join_timeout_s
        while True:
            absent = [r for r in self.members if not self.store.check([self._joined_key(generation, r)])]
            if not absent:
                return None
            if self.store.check([self._proposal_key(generation + 1)]):
                return {}
            now = time.monotonic()
            lost = {r: why for r, why in self.detect_lost().items() if r in absent}
            if lost:
                return lost
            if now > deadline:
                return {r: f"did not join the regroup within {self.join_timeout_s:.0f} s" for r in absent}
            time.sleep(0.02)


def _combined(losses: list[Loss]) -> Loss:
    """Generations applied one after the other within one agreement (a survivor vanished before
    it joined), as one loss in the numbering the caller had before the first of them."""
    first, last = losses[0], losses[-1]
    if len(losses) == 1:
        return first
    survivors = first.survivors  # positions in the caller's numbering, narrowed generation by generation
    for loss in losses[1:]:
        survivors = [survivors[k] for k in loss.survivors]
    lost = sorted(k for k in range(len(first.survivors) + len(first.lost)) if k not in survivors)
    reasons = {r: why for loss in losses for r, why in loss.reasons.items()}
    return Loss(
        generation=last.generation,
        lost=lost,
        lost_original=sorted(r for loss in losses for r in loss.lost_original),
        survivors=survivors,
        reasons=reasons,
        detected_at=first.detected_at,
    )
