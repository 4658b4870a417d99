"""The fit's members as one rank sees them, and the one place where a change of members is decided.

A collective of a round is never waited on blindly: :meth:`Membership.wait` waits for it in slices
and checks the peers (:class:`~lightning_elche.membership.liveness.PeerSignals`) between slices,
so a dead peer is noticed in about a second on one host and after ``liveness_timeout`` across
hosts, never at the transport's own timeout.

After a failed round the members agree on the change through the store: the first proposal for
the next generation wins (``compare_set``), every member adopts it, and the ranks it names are out
for good. Every member then announces itself in the new generation and waits for the others; a
member that vanishes meanwhile is dropped by the generation after, and the generations of one
agreement reach the caller as one :class:`~lightning_elche.membership.change.Change`. Losses are
counted here, and so is ``max_failure``: the change that reaches the limit says so
(:attr:`Change.ends_fit`).
"""

from __future__ import annotations

import ctypes
import json
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Optional

from lightning_elche.membership.change import (
    Change,
    MaxFailure,
    PeerFailure,
    RanksLost,
    combined,
    failure_limit,
)
from lightning_elche.membership.liveness import GoneKnock, Heartbeat, PeerSignals
from lightning_elche.membership.stall import ProgressStamp

CHECK_INTERVAL_S = 0.5
"""How often a wait on a collective looks at the peers."""
_SPIN_S = 0.005  # how long a wait on a device collective polls without sleeping
_TIMED_OUT = "timed out"


def keep_past_exit(*handles: Any) -> None:
    """Give each handle a reference nobody releases, so the interpreter's finalization never
    destroys it: a gloo group (or a collective's work, which holds its group) with a receive still
    waiting on a lost peer joins that transport thread in its destructor, which ends only at the
    group's timeout. The process exits without destroying it; what it holds (its buffers) is the
    price, paid only for the collectives a loss left behind."""
    for handle in handles:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(handle))


def exit_notice_prefix(fit_prefix: str) -> str:
    """Where the members of the fit ``fit_prefix`` leave their exit notices (:class:`PeerSignals`)."""
    return f"{fit_prefix}/membership/left"


class Membership:
    """The members of one fit as seen from one rank: who they are, who is lost, and the agreement.

    Args:
        store: the job's store (outliving any one rank when the job has a store host).
        fit_prefix: a key prefix unique to this fit, identical on every rank.
        member: this process's member id (its rank in the job's registry, :mod:`lightning_elche.job_store`).
        members: the member ids of the fit's ranks, in rank order (the same on every rank).
        liveness_timeout: how long a heartbeat may stand still before its member is declared lost.
        join_timeout: how long members wait for a live but absent member to join a new generation.
        max_failure: how many lost ranks end the fit (see :func:`~lightning_elche.membership.change.failure_limit`),
            counted against the fit's starting world size.
        renumbered: an earlier fit of the job changed its members (``members`` are its last ones).
        stall_timeout: how long a live member may make no progress before it is declared lost
            (None: derived from its own measured window, :mod:`~lightning_elche.membership.stall`).
    """

    def __init__(
        self,
        store: Any,
        fit_prefix: str,
        member: int,
        members: Sequence[int],
        liveness_timeout: timedelta,
        join_timeout: timedelta,
        max_failure: MaxFailure = None,
        renumbered: bool = False,
        stall_timeout: Optional[timedelta] = None,
    ) -> None:
        self.store = store
        self.fit_prefix = fit_prefix
        self.original_rank = member
        self.members = list(members)  # member ids, in the current rank order
        self.max_failure = max_failure
        self.limit = failure_limit(max_failure, len(self.members))
        self._inherited_renumbering = renumbered
        self.abandoned: list[Any] = []
        self.generation = 0
        self.changes: list[Change] = []
        self.dropped_joiners: set[int] = set()
        """Joiners that left their admission before they had their whole state, after the holders
        took it (:meth:`note_dropped`): the change that takes them out does not count them."""
        self.liveness_timeout_s = liveness_timeout.total_seconds()
        self.join_timeout_s = join_timeout.total_seconds()
        self.signals = PeerSignals(store, exit_notice_prefix(fit_prefix), self.liveness_timeout_s,
                                   progress_prefix=f"{fit_prefix}/membership/progress")
        self._next_check = 0.0
        self.progress = ProgressStamp(stall_timeout)
        """This rank's progress stamp: advanced by its steps and its watched waits, judged by its peers."""
        self.heartbeat = Heartbeat(store, member, min(1.0, self.liveness_timeout_s / 10.0), self.progress,
                                   self.signals.progress_key(member))
        self.gone = GoneKnock(lambda: self.members, member)
        """A peer on this host died since the last round (ends the training loop's window)."""
        self.heartbeat.add_watcher(self.gone.observe)
        self.active = True
        """Between set-up and the end of the fit: a peer that leaves is survived."""
        self.ended_tolerating = False
        """This rank's part of the fit ended (done, or it failed and left) while losses were
        tolerated: what happens to the other ranks is theirs to agree on from then on."""

    # -- the current numbering --------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.members.index(self.original_rank)

    @property
    def world_size(self) -> int:
        return len(self.members)

    @property
    def renumbered(self) -> bool:
        """Whether the ranks no longer carry their launch numbers (members changed in this job)."""
        return self._inherited_renumbering or bool(self.changes)

    @property
    def losses(self) -> list[Change]:
        """The changes of this fit that lost ranks, in order."""
        return [change for change in self.changes if change.is_loss]

    @property
    def lost_count(self) -> int:
        """The lost ranks that count against ``max_failure`` (dropped joiners never were members)."""
        return sum(change.counted_lost for change in self.changes)

    @property
    def lost_original(self) -> list[int]:
        """Member ids lost during the fit, in the order they were lost."""
        return [m for change in self.changes for m in change.lost_original]

    def close(self) -> None:
        self.ended_tolerating = self.ended_tolerating or self.active
        self.active = False
        self.heartbeat.close()

    def leave(self, reason: str) -> None:
        """Tell the peers that this rank is leaving the fit (an exception): they stop waiting for it."""
        self.ended_tolerating = self.ended_tolerating or self.active
        self.active = False
        self.signals.leave(self.original_rank, reason)

    def left_a_notice(self, member: int) -> bool:
        return self.signals.left_a_notice(member)

    def process_of(self, member: int) -> Optional[tuple[str, int]]:
        return self.signals.process_of(member)

    def record(self, change: Change) -> None:
        """Replace the record of ``change``'s generation (the survival module adds how it regrouped)."""
        self.changes = [change if c.generation == change.generation else c for c in self.changes]

    def admit(self, joined: Sequence[int]) -> Change:
        """Open the next generation with the members ``joined`` as the last ranks: every member, at the
        same consensus round (:mod:`~lightning_elche.membership.admission` decides who). A join loses
        nobody, so nothing counts against ``max_failure``."""
        before = tuple(self.members)
        change = Change(generation=self.generation + 1, before=before, after=before + tuple(joined),
                        detected_at=time.time())
        self.enter(change)
        return change

    def note_dropped(self, joiners: Iterable[int]) -> None:
        """Joiners the holders took in with a change, left out at its last settlement (they did not
        get their whole state): they are gone, and the next change takes them out, uncounted. Every
        member (and every joiner that stays) notes the same, from the settled list."""
        self.dropped_joiners.update(joiners)

    def enter(self, change: Change) -> None:
        """Follow ``change``: its members and generation are this fit's from now on (a joiner enters
        the fit with the change that admitted it)."""
        self.members = list(change.after)
        self.generation = change.generation
        self.changes.append(change)

    # -- waiting on a collective --------------------------------------------------------------------

    def wait(self, work: Any, host_blocking: bool = True, peers: Optional[Sequence[int]] = None,
             ends_on: str = "") -> None:
        """Wait for an async collective, checking the peers every half second.

        ``host_blocking``: the work's ``wait(timeout)`` blocks the host (gloo); False polls
        ``is_completed()`` instead (NCCL, whose ``wait`` only orders streams). ``peers``: the
        members the work waits on (default: every member; a point-to-point transfer names its
        other end, so that a member lost elsewhere does not end it). ``ends_on``: a store key whose
        appearance ends the wait too (the others decided without this rank).

        Raises:
            PeerFailure: the collective failed, a peer is lost, or members already started a regroup.
        """
        spin_until = time.monotonic() + _SPIN_S
        while True:
            self.progress.advance()  # waiting on the peers: not the stuck one
            try:
                if host_blocking:
                    work.wait(timeout=timedelta(seconds=CHECK_INTERVAL_S))
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
                self.check(peers, ends_on)
            except PeerFailure:
                self.abandon(work)
                raise

    def abandon(self, *handles: Any) -> None:
        """Keep collectives (and groups) that still wait on a lost rank referenced for the rest of
        the fit: releasing one joins its transport threads, which would block until its timeout.

        They are kept past the process's exit too (:func:`keep_past_exit`): the interpreter's
        finalization would release them, and gloo's ``abort`` does not end a pending receive, so
        the process would linger until the group's timeout (2 minutes and more) after its fit."""
        self.abandoned.extend(handles)
        keep_past_exit(*(handle for handle in handles if not isinstance(handle, threading.Thread)))

    def check(self, peers: Optional[Sequence[int]] = None, ends_on: str = "") -> None:
        """Raise :class:`PeerFailure` when a peer (of ``peers``, default every member) is lost, a
        regroup was proposed, or the key ``ends_on`` appeared (rate-limited)."""
        self.progress.advance()
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + CHECK_INTERVAL_S
        if self.store.check([self._proposal_key(self.generation + 1)]):
            raise PeerFailure("survivors are regrouping after a lost rank")
        if ends_on and self.store.check([ends_on]):
            raise PeerFailure("the others went on without this rank")
        lost = self.detect_lost() if peers is None else self.signals.lost(m for m in peers if m != self.original_rank)
        if lost:
            raise PeerFailure(f"rank(s) {sorted(lost)} (original numbering) stopped answering")

    def detect_lost(self) -> dict[int, str]:
        """Peers (member ids) this rank can tell are lost, with the reason."""
        return self.signals.lost(m for m in self.members if m != self.original_rank)

    # -- agreement -----------------------------------------------------------------------------------

    def _proposal_key(self, generation: int) -> str:
        return f"{self.fit_prefix}/membership/gen{generation}/lost"

    def _joined_key(self, generation: int, member: int) -> str:
        return f"{self.fit_prefix}/membership/gen{generation}/joined/{member}"

    def agree(self, cause: BaseException, progress: Optional[RoundProgress] = None) -> Change:
        """After a failed round: agree with the other members on who is lost, and wait until every
        member has joined the next generation. Returns the change (already applied here).

        ``progress`` is how far this rank got: the rounds it completed, and by rank, the batches of
        the current epoch each rank had trained at the last of them. A peer's death may let some
        survivors complete a round that failed on others; the change carries every survivor's count
        (:attr:`Change.completed_rounds`) and the lost ranks' trained batches as the survivor that
        got furthest saw them (its round is in the consensus). A survivor that missed a round which
        ended the epoch for the others cannot take part again: it is dropped too.

        Raises:
            RanksLost: this rank was declared lost by the others (it must leave the fit).
            PeerFailure: nobody could be found lost within the liveness timeout (``cause`` was
                something else).
        """
        before = tuple(self.members)
        mine = progress or RoundProgress()
        deadline = time.monotonic() + self.liveness_timeout_s + 2 * CHECK_INTERVAL_S
        applied: list[Change] = []
        while True:
            self.progress.advance()
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
            missing = self._join(applied[-1].generation, mine)
            if missing is None:
                records = self._progress_of(applied[-1].generation)
                stranded = stranded_members(records)
                if not stranded:
                    return self._settle(combined(applied), len(applied), before, records)
                missing = stranded
            if missing:  # a member vanished before it joined (or was stranded): the next generation drops it
                self._propose(self.generation + 1, missing)

    def _settle(self, change: Change, generations: int, before: tuple[int, ...],
                records: dict[int, RoundProgress]) -> Change:
        """The agreed change as the caller acts on it: every survivor's round count, the lost ranks'
        trained batches (as the survivor that got furthest saw them), the dropped joiners it takes
        out (:meth:`note_dropped`), and whether it reaches ``max_failure`` (they do not count); the
        record holds it in place of its generations."""
        furthest = records[round_leader(records)].epoch_batches
        lost_ids = change.lost_ids
        # 0 for a rank no round reported yet (lost before the first round: in the sanity check).
        trained = {m: int(furthest[k]) if k < len(furthest) else 0 for k, m in enumerate(before) if m in lost_ids}
        del self.changes[-generations:]
        change = replace(change, trained_batches=trained, completed_rounds={m: r.rounds for m, r in records.items()},
                         dropped=tuple(m for m in lost_ids if m in self.dropped_joiners))
        lost = self.lost_count + change.counted_lost
        change = replace(change, ends_fit=bool(change.counted_lost) and self.limit is not None and lost >= self.limit)
        self.changes.append(change)
        return change

    def wait_for_key(self, key: str, member: int) -> bytes:
        """The value ``member`` leaves under ``key``, waiting while it lives.

        Raises:
            RanksLost: ``member`` was lost before it left the value (this rank cannot go on)."""
        while not self.store.check([key]):
            self.progress.advance()
            lost = self.signals.lost([member])
            if lost:
                raise RanksLost(f"ElChe: rank {member} was lost ({lost[member]}) before it handed over the round "
                                f"this rank (original rank {self.original_rank}) missed; this rank leaves the fit.")
            time.sleep(0.02)
        return bytes(self.store.get(key))

    def round_record_key(self, generation: int) -> str:
        """Where the survivor that got furthest leaves its round for the others (``generation``'s)."""
        return f"{self.fit_prefix}/membership/gen{generation}/round_record"

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

    def _apply(self, proposal: dict[int, str]) -> Change:
        if self.original_rank in proposal:
            raise RanksLost(
                f"ElChe: the other ranks declared this rank (original rank {self.original_rank}) lost "
                f"({proposal[self.original_rank]}) and went on without it; it leaves the fit."
            )
        before = tuple(self.members)
        change = Change(
            generation=self.generation + 1,
            before=before,
            after=tuple(m for m in before if m not in proposal),
            reasons={m: proposal[m] for m in before if m in proposal},
            detected_at=time.time(),
        )
        self.members = list(change.after)
        self.generation = change.generation
        self.changes.append(change)
        return change

    def _join(self, generation: int, progress: RoundProgress) -> Optional[dict[int, str]]:
        """Announce this rank (and how far it got) in ``generation`` and wait for every member. None
        when all joined; otherwise the members found lost meanwhile (empty when another rank
        already proposed)."""
        self.store.set(self._joined_key(generation, self.original_rank), progress.to_json())
        deadline = time.monotonic() + self.join_timeout_s
        while True:
            self.progress.advance()
            absent = [m for m in self.members if not self.store.check([self._joined_key(generation, m)])]
            if not absent:
                return None
            if self.store.check([self._proposal_key(generation + 1)]):
                return {}
            now = time.monotonic()
            lost = {m: why for m, why in self.detect_lost().items() if m in absent}
            if lost:
                return lost
            if now > deadline:
                return {m: f"did not join the regroup within {self.join_timeout_s:.0f} s" for m in absent}
            time.sleep(0.02)

    def _progress_of(self, generation: int) -> dict[int, RoundProgress]:
        """Every member's announcement in ``generation`` (all joined)."""
        return {m: RoundProgress.from_json(self.store.get(self._joined_key(generation, m))) for m in self.members}


@dataclass(frozen=True)
class RoundProgress:
    """How far a member got before a failed round: what it announces when it joins a generation."""

    rounds: int = 0
    """Rounds it completed in this fit."""
    epoch_batches: tuple[int, ...] = ()
    """By rank (the numbering before the change), each rank's batches of this member's current
    epoch at the last round it completed (0 for a rank whose report was of an earlier epoch)."""
    ended_sequence: bool = False
    """Its last completed round ended the window sequence (the epoch, a stop, the step budget)."""
    evaluating: int = -1
    """The rounds completed when the validation it is in began (the sanity check: 0); -1: not validating."""
    evaluated: int = -1
    """The rounds completed when the last validation it finished began; -1: none."""

    def to_json(self) -> str:
        return json.dumps({"rounds": self.rounds, "epoch_batches": list(self.epoch_batches),
                           "ended_sequence": self.ended_sequence, "evaluating": self.evaluating,
                           "evaluated": self.evaluated})

    @classmethod
    def from_json(cls, value: Any) -> RoundProgress:
        fields = json.loads(value)
        batches = tuple(int(b) for b in fields["epoch_batches"])
        return cls(int(fields["rounds"]), batches, bool(fields["ended_sequence"]), int(fields.get("evaluating", -1)),
                   int(fields.get("evaluated", -1)))


def round_leader(records: dict[int, RoundProgress]) -> int:
    """The member that completed the most rounds (the lowest id among equals)."""
    most = max(r.rounds for r in records.values())
    return min(m for m, r in records.items() if r.rounds == most)


def stranded_members(records: dict[int, RoundProgress]) -> dict[int, str]:
    """Members that missed a round which ended the window sequence for the others: they cannot
    rejoin a round of the same epoch, so they leave the fit (their work is in that round). And
    members still inside a validation that another member finished (the lost rank died in its
    last collective): they cannot run it again alone, so they leave too."""
    furthest = records[round_leader(records)]
    stranded = {}
    if furthest.ended_sequence:
        stranded = {m: f"it missed round {furthest.rounds} (which ended the epoch for the others) when a peer was lost"
                    for m, r in records.items() if r.rounds < furthest.rounds}
    finished = {r.evaluated for r in records.values()}
    for m, r in records.items():
        if r.evaluating >= 0 and r.evaluating in finished and m not in stranded:
            stranded[m] = (f"it was still in the validation after round {r.evaluating}, which other ranks had "
                           "finished, when a peer was lost")
    return stranded
