"""Who actually enters the generation an admission opens, decided before its process group is built.

An admission names its members in the generation's admitted list (:mod:`.admission`): the members
in their order, then the joiners. Building that generation's group is a rendezvous that waits for
every one of them until the transport's timeout, so a joiner that died after it acknowledged, or a
member that died at the admission round, would hold everybody there. Before the group, every
participant (member or joiner) says it is here (``entry/present/<member>``) and waits for the
others while watching them (:class:`~.liveness.PeerSignals`); the first participant that sees
everyone here, or someone gone, settles the generation's final list with ``compare_set``, and all
read that one:

* a joiner that is gone (its process ended, its heartbeat stopped) or not here within
  :data:`JOINER_ENTRY_TIMEOUT_S` is left out: it never was a member, so nothing counts against
  ``max_failure``;
* a member that is gone, or not here within the join timeout, is left out as a lost rank (it
  counts against ``max_failure``, as any loss does).

The change the admission opened is then the settled one (:func:`narrow`): a join, a join and a
loss, a loss alone, or nothing at all.

Three later settlements of the same admission work the same way (``stage``): ``grouped``, once every
participant built the group (watched: :func:`~.groups.init_generation_group_watched`) or gave up
on it, ``delivered``, once rank 0 sent each joiner its state, and ``joined``, once the holders took
the change and rank 0 sent the rest. At those every absent participant is waited for until it is
there or gone. At the first two someone left out costs one more generation's group; at ``joined``
the holders have the change already, so nobody is taken out there: a joiner left out leaves (it
never was a member, :meth:`~.agreement.Membership.note_dropped`), and whoever is gone is taken out
at the next round, as after any change.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Optional

from lightning_elche.membership.agreement import Membership
from lightning_elche.membership.change import Change, RanksLost
from lightning_elche.membership.groups import ProcessGroups, let_default_group_go
from lightning_elche.membership.survival import fence, fence_members

log = logging.getLogger(__name__)

JOINER_ENTRY_TIMEOUT_S = 10.0
"""How long the participants wait for a live joiner that acknowledged its admission to reach the
new generation (it has only a few store operations to do) before they go on without it."""


@dataclass(frozen=True)
class Entry:
    """The settled members of an admission's generation."""

    after: tuple[int, ...]
    """Member ids in rank order: the members that stayed, then the joiners that entered."""
    lost: dict[int, str] = field(default_factory=dict)
    """Members (not joiners) left out, with the reason: they count as lost ranks."""
    dropped: dict[int, str] = field(default_factory=dict)
    """Joiners left out, with the reason: they never were members."""
    waited_s: float = 0.0
    """How long this participant waited for the list to be settled."""

    def to_json(self) -> str:
        return json.dumps({"after": list(self.after), "lost": {str(m): why for m, why in self.lost.items()},
                           "dropped": {str(m): why for m, why in self.dropped.items()}})

    @classmethod
    def from_json(cls, value: bytes, waited_s: float) -> Entry:
        fields = json.loads(value)
        return cls(tuple(int(m) for m in fields["after"]), {int(m): w for m, w in fields["lost"].items()},
                   {int(m): w for m, w in fields["dropped"].items()}, waited_s)


def entry_key(membership: Membership, generation: int, name: str) -> str:
    return f"{membership.fit_prefix}/membership/gen{generation}/entry/{name}"


STAGES = {"": "did not reach the new group", "grouped": "did not build the new group",
          "delivered": "did not take its state", "joined": "did not take the rest of its state"}
"""The settlements of one admission (``stage``: the entry, before the group; ``grouped``, once the
group was built, or its build given up on; ``delivered``, once the state was sent; ``joined``, once
the holders took the change and rank 0 sent the rest), each with what a joiner left out at it did
not do."""


def settle_entry(membership: Membership, generation: int, members: Sequence[int], joiners: Sequence[int],
                 joiner_timeout_s: float = JOINER_ENTRY_TIMEOUT_S, stage: str = "") -> Entry:
    """Every participant of ``generation`` (the members that were there before it, then the
    admitted ``joiners``): say this one is here, and return the settled list (the same on all).

    ``stage``: which settlement of the admission (:data:`STAGES`): the entry (``""``), or a later one
    (``"grouped"``, ``"delivered"``: the joiners say they are here once they have their state), at
    which every absent participant is waited for until it is there or gone (a live joiner as long
    as its state takes to arrive).

    Raises:
        RanksLost: this member was left out (the others found it gone or too late)."""
    me = membership.original_rank
    store = membership.store
    settled = settled_key(membership, generation, stage)
    store.set(_stage_key(membership, generation, stage, f"present/{me}"), "1")
    everyone = [*members, *joiners]
    started = time.monotonic()
    while not store.check([settled]):
        membership.progress.advance()  # waiting on the peers: not stuck
        absent = [m for m in everyone if not store.check([_stage_key(membership, generation, stage, f"present/{m}")])]
        waited = time.monotonic() - started
        gone = membership.signals.lost(absent) if absent else {}
        for m in absent:
            limit = joiner_timeout_s if m in joiners else membership.join_timeout_s
            if m not in gone and waited > limit:
                gone[m] = f"not there within {limit:.0f} s"
        # At the entry someone gone settles it at once (the others absent are on their way); at the
        # delivery every absent joiner is waited for until it is gone or there (it may still be
        # receiving, or about to leave because its sender was lost).
        if not absent or (gone and (not stage or set(absent) <= set(gone))):
            entry = Entry(tuple(m for m in everyone if m not in gone),
                          {m: why for m, why in gone.items() if m not in joiners},
                          {m: why for m, why in gone.items() if m in joiners})
            store.compare_set(settled, "", entry.to_json())
            break
        time.sleep(0.02)
    entry = Entry.from_json(store.get(settled), time.monotonic() - started)
    if me not in entry.after:
        why = entry.lost.get(me) or entry.dropped.get(me, "left out")
        raise RanksLost(f"ElChe: the others went on without this rank (member {me}) when they admitted a joiner "
                        f"({why}); it leaves the fit.")
    for joiner, why in entry.dropped.items():
        log.warning(f"ElCheStrategy dropped joiner {joiner}: it acknowledged its admission but {STAGES[stage]} "
                    f"({why}); the members went on without it after {entry.waited_s:.1f} s (it never "
                    "was a member; nothing counts against max_failure).")
    return entry


def settled_key(membership: Membership, generation: int, stage: str = "") -> str:
    """Where ``generation``'s settlement of ``stage`` lands (its appearance: the list is final)."""
    return _stage_key(membership, generation, stage, "settled")


def _stage_key(membership: Membership, generation: int, stage: str, name: str) -> str:
    # The entry's keys lie at the entry's root (as before the later settlements), a stage's under its name.
    return entry_key(membership, generation, f"{stage}/{name}" if stage else name)


def stayed(change: Change) -> list[int]:
    """The members of ``change.after`` that were members before it (its joiners are the rest)."""
    return [m for m in change.after if m not in change.joined_ids]


def settle_stage(membership: Membership, change: Change, stage: str) -> Entry:
    """A later settlement (``stage``) of the admission ``change``: a live joiner is waited for as long as
    the join timeout (its state may still be on its way)."""
    return settle_entry(membership, change.generation, stayed(change), change.joined_ids,
                        joiner_timeout_s=membership.join_timeout_s, stage=stage)


def narrow(change: Change, entry: Entry, membership: Membership, generation: int,
           batches: Callable[[], Sequence[int]]) -> Optional[Change]:
    """Members: ``change`` as one of its settlements left it, as ``generation`` (the entry's own,
    before the group; the next one after a later settlement): a joiner that did not reach it is out
    (never a member), a member that did not is lost (its batches of the epoch at the admission round,
    ``batches()`` by rank, are in the consensus, the rest goes back); None when nothing changed after
    all (the fit goes on with the members it had)."""
    if entry.after == change.after:
        return change
    membership.changes.remove(change)
    membership.members, membership.generation = list(entry.after), generation
    if entry.after == change.before:
        return None
    counts = batches()
    trained = {m: int(counts[k]) if k < len(counts) else 0 for k, m in enumerate(change.before) if m in entry.lost}
    reasons = {**change.reasons, **entry.lost}
    limit = membership.limit  # the losses before this admission, and this admission's
    ends_fit = bool(reasons) and limit is not None and membership.lost_count + len(reasons) >= limit
    narrowed = replace(change, generation=generation, after=entry.after, reasons=reasons,
                       trained_batches={**change.trained_batches, **trained}, ends_fit=ends_fit)
    membership.changes.append(narrowed)
    fence(narrowed, membership)
    return narrowed


def regroup(change: Optional[Change], membership: Membership, groups: ProcessGroups,
            side_timeout: Optional[timedelta], batches: Callable[[], Sequence[int]],
            first: bool = True) -> Optional[Change]:
    """Members: the default group of ``change.after``, recorded in the change (None: the members it
    had before, on a new group of their own generation).

    With joiners the group (and the plane's side group, ``side_timeout``) is built watched
    (:meth:`ProcessGroups.renew_watched`) and every participant then settles it (``grouped``): one
    lost before it was up (it said it was there, then died) is left out as at the entry, and the
    group is built again without it, one generation on. ``first``: ``change`` is the entry's (the
    current group is the members' own, which a loss alone may shrink)."""
    while change is not None and change.is_join:
        built = groups.renew_watched(side_timeout)
        grouped = settle_stage(membership, change, "grouped")
        fence_members(grouped.dropped, membership)
        if grouped.after == change.after:
            if not built:  # everyone else is there and up: this rank cannot take part
                raise RanksLost(f"ElChe: this rank (member {membership.original_rank}) could not build the "
                                "admission's group while every other participant did; it leaves the fit.")
            change = replace(change, regrouped_with="new group")
            membership.record(change)
            return change
        change, first = narrow(change, grouped, membership, change.generation + 1, batches), False
    if change is None:
        if not first:
            groups.renew()
        return None
    change = replace(change, regrouped_with=groups.rebuild(change) if first else groups.renew())
    membership.record(change)
    return change


def followed(membership: Membership, change: Change, settled: Entry) -> Change:
    """A joiner: ``change`` as a settlement after its group was up left it (someone left out), one
    generation on; the group it had goes."""
    after = Change(generation=change.generation + 1, before=change.before, after=settled.after,
                   reasons={**change.reasons, **settled.lost}, detected_at=change.detected_at,
                   regrouped_with="new group")
    membership.changes.clear()
    membership.enter(after)
    let_default_group_go(membership)
    return after


def settle_joined(membership: Membership, change: Change) -> Entry:
    """Every participant, once the holders took ``change`` and rank 0 sent the rest of the state
    (``joined``): which joiners have their whole state, the same answer on all. The holders have
    the change, so nobody is taken out here: a joiner left out leaves by itself and never was a
    member (:meth:`Membership.note_dropped`: the change that takes it out at the next round does
    not count it), and a member found gone (rank 0 lost while it sent, one lost as it took the
    change) is lost at the next round, as after any change.

    Raises:
        RanksLost: this participant was left out."""
    joined = settle_stage(membership, change, "joined")
    if membership.original_rank in stayed(change):
        fence_members([*joined.lost, *joined.dropped], membership)
    membership.note_dropped(joined.dropped)
    return joined
