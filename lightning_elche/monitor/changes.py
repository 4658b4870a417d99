"""What the monitor records of a change of the fit's members: the ``event`` records (``label``
``"rank_lost"`` and ``"rank_joined"``) that the record log, the dashboard's markers and the
timeline show. Ranks are named by member id (their number at launch, or the id a joiner
registered under), which a renumbering keeps.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_elche.membership.change import Change


def rank_lost_record(change: Change, t: float, ts: float, sync: Optional[int], epoch: int) -> dict[str, Any]:
    """The ``event`` record of the ranks a change lost (without ``node``): who left, why, and who goes on.

    ``sync``: the index of the round that failed (it runs again on the survivors).
    """
    survivors = [change.before[k] for k in change.survivors]
    return {
        "kind": "event", "label": "rank_lost", "ts": ts, "t": t, "sync": sync, "epoch": epoch,
        "generation": change.generation, "lost": list(change.lost_original),
        "reasons": {str(rank): why for rank, why in change.reasons.items()},
        "survivors": len(survivors), "survivor_ranks": survivors,
        "trained_batches": {str(rank): n for rank, n in change.trained_batches.items()},
        "detected_at": change.detected_at,
    }


def rank_joined_record(change: Change, t: float, ts: float, sync: Optional[int], epoch: int) -> dict[str, Any]:
    """The ``event`` record of the ranks a change added (without ``node``): who joined, at which
    new ranks, and the members from then on. ``sync``: the first round they take part in."""
    return {
        "kind": "event", "label": "rank_joined", "ts": ts, "t": t, "sync": sync, "epoch": epoch,
        "generation": change.generation, "joined": list(change.joined_ids), "joined_as": list(change.joined),
        "world_size": change.world_size_after, "member_ranks": list(change.after),
        "detected_at": change.detected_at,
    }


def change_records(change: Change, t: float, ts: float, sync: Optional[int], epoch: int) -> list[dict[str, Any]]:
    """The event records of one change: its losses first, then its joins (a change may hold both)."""
    records = []
    if change.is_loss:
        records.append(rank_lost_record(change, t, ts, sync, epoch))
    if change.is_join:
        records.append(rank_joined_record(change, t, ts, sync, epoch))
    return records

