"""How a rank tells that a peer is gone: heartbeats, exit notices and the peer's process.

Every rank keeps a heartbeat counter in the job's store (a background thread bumps it), and a rank
that fails with an exception leaves a notice there before it exits. A peer is lost on the first of
three signals, the fastest first:

* it left a notice (an exception in its training step, a clean exit);
* its process is gone (same host only: ``kill -9``, a crash, the OOM killer);
* its heartbeat did not move for ``liveness_timeout`` (a stopped or hung process, a remote host
  that vanished);

and, alive but stuck, when its progress stamp stood still for the bound it derived from its own
speed (:mod:`~lightning_elche.membership.stall`); outside training, for that bound while this rank
looked at it (:meth:`PeerSignals._witness`). A member found lost stays lost for the reason first
found (fenced, a stalled one would read as gone after).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any, Optional

from lightning_elche.job_store import heartbeat_key, process_alive, registered_process
from lightning_elche.membership.stall import WITNESS_GAP_S, ProgressStamp, Stamp, stall_verdict

log = logging.getLogger(__name__)

DEFAULT_LIVENESS_TIMEOUT = timedelta(seconds=30)


def resolve_liveness_timeout(value: Any, transport_timeout: Optional[timedelta]) -> timedelta:
    """The liveness timeout to use: ``value`` (checked, and shorter than the transport's timeout), or
    by default 30 s, or half the transport's timeout when that is shorter (a lost rank must be found
    before the transport gives up)."""
    if value is None:
        if transport_timeout is None or transport_timeout >= 2 * DEFAULT_LIVENESS_TIMEOUT:
            return DEFAULT_LIVENESS_TIMEOUT
        return max(timedelta(seconds=1), transport_timeout / 2)
    value = check_liveness_timeout(value)
    if transport_timeout is not None and value >= transport_timeout:
        raise ValueError(
            f"ElCheStrategy(liveness_timeout={value}) must be shorter than timeout={transport_timeout}: a "
            "lost rank is detected at the liveness timeout, before the transport's own timeout (NCCL's watchdog "
            "aborts the process at it)."
        )
    return value


def check_liveness_timeout(value: Any) -> timedelta:
    if not isinstance(value, timedelta) or value.total_seconds() < 1.0:
        raise ValueError(
            f"ElCheStrategy(liveness_timeout={value!r}) is invalid: expected a timedelta of at least 1 second "
            "(a peer silent for that long is declared lost)."
        )
    return value


class Heartbeat:
    """A daemon thread bumping this rank's heartbeat counter in the store (its own connection),
    and writing its progress stamp under ``progress_key``."""

    def __init__(self, store: Any, rank: int, interval_s: float, progress: Optional[ProgressStamp] = None,
                 progress_key: str = "") -> None:
        self._store = store.clone() if hasattr(store, "clone") else store
        self._watchers: tuple[Callable[[Any], None], ...] = ()
        self._key = heartbeat_key(rank)
        self._interval_s = interval_s
        self._progress, self._progress_key = progress, progress_key
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"elche-heartbeat-rank{rank}", daemon=True)
        self._store.add(self._key, 1)
        self._publish()
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._store.add(self._key, 1)
                self._publish()
            except Exception:  # the store is gone: the job is ending; peers see this rank silent
                return
            for watch in self._watchers:
                try:
                    watch(self._store)
                except Exception as error:  # a reading for the training loop; never the heartbeat's end
                    log.debug(f"ElChe heartbeat watcher failed: {error}")

    def add_watcher(self, watch: Callable[[Any], None]) -> None:
        """Call ``watch(store)`` after every beat, on this thread's own store connection (a key the
        training loop wants read without a store round trip in its steps)."""
        self._watchers = (*self._watchers, watch)

    def _publish(self) -> None:
        if self._progress is None:
            return
        self._store.set(self._progress_key, self._progress.stamp(time.monotonic()).dumps())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self._interval_s + 5.0)


class GoneKnock:
    """Whether a peer on this host died and no round has taken it out yet.

    The heartbeat thread looks once per beat (:meth:`observe`, on its own store connection: the
    registry entry of each peer once, then a read of ``/proc``, no store call); the training loop
    asks once per step (:meth:`take`) and ends its window on it. The round that finds the loss then
    comes about a beat after the death, not at the window's planned end: until that round, what the
    lost rank had claimed of the epoch stays unclaimed and the survivors' plan still counts it,
    so a long window ran the survivors dry and idle at its end. Peers on other hosts are found at
    the round as before (their silence takes ``liveness_timeout``).

    Args:
        members: the current member ids (read on the heartbeat thread; replaced, never mutated,
            at a change).
        member: this rank's member id.
    """

    def __init__(self, members: Callable[[], Sequence[int]], member: int) -> None:
        self._members, self._member = members, member
        self._procs: dict[int, tuple[str, int]] = {}
        self._dead: frozenset[int] = frozenset()  # written by the heartbeat thread only (rebound, never mutated)
        self._taken: frozenset[int] = frozenset()  # the training thread's only

    def observe(self, store: Any) -> None:
        for peer in tuple(self._members()):
            if peer == self._member or peer in self._dead:
                continue
            proc = self._procs.get(peer) or registered_process(store, peer)
            if proc is None:
                continue
            self._procs[peer] = proc
            if process_alive(*proc) is False:
                self._dead = self._dead | {peer}

    def take(self) -> bool:
        """Whether a peer died that is still a member and has not ended a window yet."""
        dead = self._dead
        if dead <= self._taken:
            return False
        fresh = (dead - self._taken) & set(self._members())
        self._taken = dead
        return bool(fresh)


class PeerSignals:
    """What the store and this host say about the job's members (by member id).

    Args:
        store: the job's store.
        notice_prefix: the key prefix under which members of this fit leave their exit notices.
        liveness_timeout_s: how long a heartbeat may stand still before its member is lost.
        progress_prefix: the key prefix under which members publish their progress stamps ("": not judged).
    """

    def __init__(self, store: Any, notice_prefix: str, liveness_timeout_s: float, progress_prefix: str = "") -> None:
        self.store = store
        self.notice_prefix = notice_prefix
        self.liveness_timeout_s = liveness_timeout_s
        self.progress_prefix = progress_prefix
        self._procs: dict[int, tuple[str, int]] = {}
        self._beats: dict[int, tuple[int, float]] = {}  # member -> (counter, local time it last moved)
        self._witnessed: dict[int, tuple[int, float, float]] = {}  # member -> (its stamp's count, since, last look)
        self._found: dict[int, str] = {}  # member -> why it was first found lost (a fenced one is then gone)

    def notice_key(self, member: int) -> str:
        return f"{self.notice_prefix}/{member}"

    def leave(self, member: int, reason: str) -> None:
        """Leave ``member``'s exit notice (best effort: the store may be gone)."""
        try:
            self.store.set(self.notice_key(member), reason[:2000])
        except Exception:  # the peers then notice the process is gone
            pass

    def left_a_notice(self, member: int) -> bool:
        """Whether ``member`` said it was leaving (an exception): it is winding down by itself."""
        return bool(self.store.check([self.notice_key(member)]))

    def lost(self, members: Iterable[int]) -> dict[int, str]:
        """The members among ``members`` that this rank can tell are lost, with the reason."""
        now = time.monotonic()
        found: dict[int, str] = {}
        for member in members:
            reason = self._lost_reason(member, now)
            if reason is not None:
                found[member] = reason
        return found

    def _lost_reason(self, member: int, now: float) -> Optional[str]:
        # A member found lost is lost for the reason first found: fenced at once (a stalled one
        # killed by a checked collective before the agreement), it would read as "gone" after.
        found = self._found.get(member)
        if found is None:
            found = self._first_reason(member, now)
            if found is not None:
                self._found[member] = found
        return found

    def _first_reason(self, member: int, now: float) -> Optional[str]:
        notice = self.notice_key(member)
        if self.store.check([notice]):
            return f"it failed: {self.store.get(notice).decode(errors='replace')}"
        proc = self.process_of(member)
        if proc is not None and process_alive(*proc) is False:
            return f"its process (pid {proc[1]}) is gone"
        count = self.store.add(heartbeat_key(member), 0)
        seen = self._beats.get(member)
        if seen is None or seen[0] != count:
            self._beats[member] = seen = (count, now)
        silent = now - seen[1]
        if silent >= self.liveness_timeout_s:
            return f"silent for {silent:.0f} s (liveness_timeout={self.liveness_timeout_s:.0f} s)"
        stamp = self._stamp_of(member)
        return stall_verdict(stamp, beat_age_s=silent, witnessed_s=self._witness(member, stamp, now))

    def _witness(self, member: int, stamp: Optional[Stamp], now: float) -> Optional[float]:
        # How long this rank has seen ``member``'s count stand still while looking at it at least
        # every WITNESS_GAP_S (so: while waiting for it in watched waits), on this rank's clock.
        if stamp is None:
            return None
        seen = self._witnessed.get(member)
        if seen is None or seen[0] != stamp.count or now - seen[2] > WITNESS_GAP_S:
            seen = (stamp.count, now, now)
        self._witnessed[member] = (seen[0], seen[1], now)
        return now - seen[1]

    def progress_key(self, member: int) -> str:
        return f"{self.progress_prefix}/{member}"

    def _stamp_of(self, member: int) -> Optional[Stamp]:
        if not self.progress_prefix:
            return None
        key = self.progress_key(member)
        return Stamp.loads(self.store.get(key)) if self.store.check([key]) else None

    def process_of(self, member: int) -> Optional[tuple[str, int]]:
        """``(host, pid)`` of a member, when it registered."""
        if member not in self._procs:
            registered = registered_process(self.store, member)
            if registered is None:
                return None
            self._procs[member] = registered
        return self._procs[member]
