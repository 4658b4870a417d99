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

The change the admission opened is then the settled one: a join, a join and a loss, a loss alone,
or nothing at all.

Two later settlements of the same admission work the same way (``stage``): ``grouped``, once every
participant built the group (watched: :func:`~.groups.init_generation_group_watched`) or gave up
on it, and ``delivered``, once rank 0 sent each joiner its state. At those every absent participant
is waited for until it is there or gone, and someone left out costs one more generation's group.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_elche.membership.agreement import Membership
from lightning_elche.membership.change import RanksLost

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
          "delivered": "did not take its state"}
"""The settlements of one admission (``stage``: the entry, before the group; ``grouped``, once the
group was built, or its build given up on; ``delivered``, once the state was sent), each with what
a joiner left out at it did not do."""


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
