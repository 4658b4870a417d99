"""One change of who is in the fit: the value every holder of per-rank state takes.

Ranks are numbered densely. A change keeps the members that stay in the order of their old
ranks and appends the members that join, so new rank ``k`` is the member that had old rank
``survivors[k]`` for ``k < len(survivors)``, and a joiner otherwise. Members are named by their
*member id*: the rank they registered under in the job's registry (the launch rank of a rank
started with the job, the next free id of a rank that joined later). Ids never change; ranks do.

Every holder of per-rank state (the controller, the session and its callback role, the
dispatch, the engine, the planes, Lightning's rank view, the monitor) follows a change through
one method, ``apply_change(change)``, and nothing else: a loss, several losses agreed together,
a join, or a loss and a join in one change are one code path.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Union

from lightning_elche.checks import require_int

MaxFailure = Optional[Union[int, float]]


class PeerFailure(RuntimeError):
    """A collective of a round could not complete: a peer may be lost."""


class RanksLost(RuntimeError):
    """The fit ended because ranks were lost (``max_failure`` reached, or this rank was excluded)."""


@dataclass(frozen=True)
class Change:
    """One agreed change of the fit's members, identical on every member after it.

    Attributes:
        generation: the membership generation this change opens (the first change opens 1).
        before: member ids in rank order before the change.
        after: member ids in rank order after it: the members that stay, in their old order,
            then the joiners.
        reasons: why each lost member left, by member id.
        trained_batches: by member id of each lost member, the batches of the current epoch it
            had trained at its last contribution to a completed round (those are in the
            consensus; the rest of its work goes back to the epoch).
        ends_fit: ``max_failure`` was reached with this change: every member saves the
            consensus and the fit ends with :class:`RanksLost`.
        detected_at: wall time (``time.time()``) at which the change was first proposed.
        regrouped_with: how the members' process group was built for ``after``:
            ``"shrink_group"`` (NCCL's own shrink) or ``"new group"`` (a group on the store).
        completed_rounds: by member id of each member that stays, the rounds it had completed
            when the change was agreed. A peer that dies in the middle of a round's collectives may
            let some members complete it and not others: those behind catch up on the round
            before the failed one runs again (see :mod:`~lightning_elche.membership.survival`).
        dropped: of the members that left, the joiners of an admission that left it before they had
            their whole state (its last settlement, after the holders took it): they leave the
            numbering as a lost rank does (nothing of theirs is in the consensus, their share of
            the epoch goes back), but never were members, so nothing counts against ``max_failure``.
    """

    generation: int
    before: tuple[int, ...]
    after: tuple[int, ...]
    reasons: Mapping[int, str] = field(default_factory=dict)
    trained_batches: Mapping[int, int] = field(default_factory=dict)
    ends_fit: bool = False
    detected_at: float = 0.0
    regrouped_with: str = ""
    completed_rounds: Mapping[int, int] = field(default_factory=dict)
    dropped: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("before", "after"):
            ids = getattr(self, name)
            if len(set(ids)) != len(ids):
                raise ValueError(f"Change({name}={list(ids)}) is invalid: expected distinct member ids.")
        kept = [m for m in self.before if m in self.after]
        if list(self.after[: len(kept)]) != kept:
            raise ValueError(
                f"Change(before={list(self.before)}, after={list(self.after)}) is invalid: expected the members "
                "that stay first, in their old order, then the joiners."
            )
        if not self.after:
            raise ValueError("Change(after=[]) is invalid: a change leaves at least one member.")
        if not set(self.dropped) <= set(self.lost_ids):
            raise ValueError(f"Change(dropped={list(self.dropped)}) is invalid: expected members that leave with "
                             f"this change (of {list(self.lost_ids)}): the joiners dropped before they had their "
                             "whole state.")

    # -- who -------------------------------------------------------------------------------------

    @property
    def lost_ids(self) -> tuple[int, ...]:
        """Member ids that left, in their old rank order."""
        return tuple(m for m in self.before if m not in self.after)

    @property
    def joined_ids(self) -> tuple[int, ...]:
        """Member ids that joined, in their new rank order."""
        return tuple(m for m in self.after if m not in self.before)

    @property
    def lost(self) -> list[int]:
        """Old ranks of the members that left."""
        return [k for k, m in enumerate(self.before) if m not in self.after]

    @property
    def survivors(self) -> list[int]:
        """Old ranks of the members that stay, in new rank order (new rank ``k`` is old rank ``survivors[k]``)."""
        return [k for k, m in enumerate(self.before) if m in self.after]

    @property
    def joined(self) -> list[int]:
        """New ranks of the members that joined (the last ranks)."""
        return list(range(len(self.survivors), len(self.after)))

    @property
    def counted_lost(self) -> int:
        """How many of the members that left count against ``max_failure`` (dropped joiners do not)."""
        return len(self.lost_ids) - len(self.dropped)

    @property
    def lost_original(self) -> list[int]:
        """Member ids that left, ascending (the launch ranks of ranks started with the job)."""
        return sorted(self.lost_ids)

    @property
    def is_loss(self) -> bool:
        return bool(self.lost_ids)

    @property
    def is_join(self) -> bool:
        return bool(self.joined_ids)

    @property
    def world_size_before(self) -> int:
        return len(self.before)

    @property
    def world_size_after(self) -> int:
        return len(self.after)

    @property
    def round_leader(self) -> Optional[int]:
        """The member that completed the most rounds, the lowest id among equals (None: unknown)."""
        if not self.completed_rounds:
            return None
        most = max(self.completed_rounds.values())
        return min(m for m, r in self.completed_rounds.items() if r == most)

    @property
    def behind_ids(self) -> tuple[int, ...]:
        """Members that completed fewer rounds than :attr:`round_leader` (they missed its last round)."""
        if not self.completed_rounds:
            return ()
        most = max(self.completed_rounds.values())
        return tuple(m for m in self.after if self.completed_rounds.get(m, most) < most)

    # -- renumbering -----------------------------------------------------------------------------

    def new_rank(self, old_rank: int) -> Optional[int]:
        """The new rank of the member at ``old_rank`` (None: it left)."""
        member = self.before[old_rank]
        return self.after.index(member) if member in self.after else None

    def old_rank(self, new_rank: int) -> Optional[int]:
        """The old rank of the member at ``new_rank`` (None: it joined)."""
        member = self.after[new_rank]
        return self.before.index(member) if member in self.before else None

    def trained_by_old_rank(self) -> dict[int, int]:
        """:attr:`trained_batches` keyed by old rank (every lost member, 0 where unrecorded)."""
        return {k: int(self.trained_batches.get(self.before[k], 0)) for k in self.lost}

    def carry(self, per_rank: Sequence[Any], joiner: Any) -> list[Any]:
        """A per-rank list in the new numbering: the survivors' entries, then ``joiner()`` per joiner
        (``joiner`` is called once per joiner, so each gets its own value)."""
        if len(per_rank) != len(self.before):
            raise ValueError(f"Change.carry() needs one entry per old rank ({len(self.before)}), got {len(per_rank)}.")
        return [per_rank[k] for k in self.survivors] + [joiner() for _ in self.joined]

    def describe(self) -> str:
        """``"lost rank 1 (its process is gone); joined rank 3"``, by member id."""
        parts = []
        lost = [m for m in self.lost_ids if m not in self.dropped]
        if lost:
            parts.append("lost " + ", ".join(f"rank {m} ({self.reasons.get(m, 'lost')})" for m in lost))
        if self.dropped:
            parts.append("dropped joiner " + ", ".join(f"{m} ({self.reasons.get(m, 'dropped')})"
                                                      for m in self.dropped))
        if self.joined_ids:
            # By id: joiners admitted together take their ranks in the order they asked, which races.
            parts.append("joined " + ", ".join(f"rank {m}" for m in sorted(self.joined_ids)))
        return "; ".join(parts) or "no change"


class ChangeHolder(Protocol):
    """Anything that keeps per-rank state and follows the fit's membership."""

    def apply_change(self, change: Change) -> None: ...


def combined(changes: Sequence[Change]) -> Change:
    """Changes agreed one after the other (a member vanished while the others waited for it) as one
    change from the first's ``before`` to the last's ``after``."""
    if not changes:
        raise ValueError("combined() needs at least one change.")
    first, last = changes[0], changes[-1]
    if len(changes) == 1:
        return first
    reasons = {m: why for change in changes for m, why in change.reasons.items()}
    trained = {m: n for change in changes for m, n in change.trained_batches.items()}
    return Change(
        generation=last.generation,
        before=first.before,
        after=last.after,
        reasons={m: reasons[m] for m in first.before if m not in last.after and m in reasons},
        trained_batches={m: trained[m] for m in first.before if m not in last.after and m in trained},
        ends_fit=any(change.ends_fit for change in changes),
        detected_at=first.detected_at,
        regrouped_with=last.regrouped_with,
        completed_rounds=last.completed_rounds,
        dropped=tuple(m for m in first.before if m not in last.after and any(m in c.dropped for c in changes)),
    )


# -- max_failure ----------------------------------------------------------------------------------

_MAX_FAILURE_ALLOWED = (
    "expected None (tolerate any loss that leaves a rank), an int >= 1 (that many lost ranks end the fit) "
    "or a float in (0, 1] (that fraction of the ranks, rounded up)"
)


def lost_ranks_text(changes: Sequence[Change]) -> str:
    """The ranks ``changes`` lost and why, as a ``RanksLost`` message names them."""
    return ", ".join(f"rank {r} ({why})" for change in changes for r, why in change.reasons.items())


def check_max_failure(value: Any, subject: Optional[str] = None) -> MaxFailure:
    """``max_failure`` as flodl reads it: None, an int >= 1, or a float fraction in (0, 1].
    ``subject`` names the knob and its value in an error (default ``ElCheStrategy(max_failure=v)``)."""
    subject = subject or f"ElCheStrategy(max_failure={value!r})"
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"{subject} is invalid: {_MAX_FAILURE_ALLOWED}.")
    if isinstance(value, float):
        if not (math.isfinite(value) and 0.0 < value <= 1.0):
            raise ValueError(f"{subject} is invalid: {_MAX_FAILURE_ALLOWED}.")
        return value
    return require_int(subject, value, 1, _MAX_FAILURE_ALLOWED)


def failure_limit(max_failure: MaxFailure, world_size: int) -> Optional[int]:
    """How many lost ranks end the fit (None: only losing every rank does)."""
    if max_failure is None:
        return None
    if isinstance(max_failure, float):
        return max(1, math.ceil(max_failure * world_size))
    return int(max_failure)
