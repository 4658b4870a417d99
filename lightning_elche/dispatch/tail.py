"""The end-of-epoch tail rule of the pooled dispatch: when a slower rank stops claiming.

A slow rank that takes one of the last chunks makes every other rank wait for it at the epoch's
end. Near the end of an epoch it therefore leaves the pool to the faster ranks when the epoch
would end later with its next chunk than without it. One rank, the *drainer*, claims until the
pool is dry whatever the shares say, so every chunk is still trained exactly once.

:class:`TailRule` is pure: no store, no clock. The pool hands it the counts every rank knows
(claims, the latest round's started batches, the layout's size) and a way to read the next
chunk's size, which it calls only when the counts alone do not decide.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

from lightning_elche.dispatch.order import SMALLEST_LAYOUT_SHARE


def fastest_rank(shares: Sequence[float]) -> int:
    """The rank with the largest share (the lowest such rank on a tie)."""
    return max(range(len(shares)), key=lambda r: (shares[r], -r))


@dataclass(frozen=True)
class TailRule:
    """Each rank's share of the cohort's speed (summing to 1) and the epoch's drainer.

    The drainer is chosen once per epoch, from the first shares a rank holds in it (those of the
    round before the epoch, blocking on every rank, or in a fit's first epoch those of its first
    round): every rank adopts the rounds in the same order, so it is the same rank everywhere.
    Shares adopted later differ between ranks at any one moment (``cpu_async`` adopts at different
    steps), so :meth:`with_shares` keeps the drainer: one chosen from them could leave on every rank.
    A membership change chooses it again, the same way on every member: the fastest survivor by the
    shares every member held at the change (a loss), or by the first round's after it (a join).
    """

    shares: tuple[float, ...]
    drainer: int

    @classmethod
    def from_shares(cls, shares: Sequence[float], world_size: int, drainer: Optional[int] = None) -> TailRule:
        """Shares of any positive scale, normalised; the drainer is the fastest unless given."""
        if len(shares) != world_size or any(not math.isfinite(s) or s < 0 for s in shares) or sum(shares) <= 0:
            raise ValueError(
                f"speed shares {list(shares)!r} are invalid: expected {world_size} finite values >= 0 "
                "with a positive sum."
            )
        total = float(sum(shares))
        normalised = tuple(float(s) / total for s in shares)
        return cls(normalised, fastest_rank(normalised) if drainer is None else drainer)

    def with_shares(self, shares: Sequence[float]) -> TailRule:
        """Newer shares of the same epoch: the drainer stays."""
        return TailRule.from_shares(shares, len(self.shares), self.drainer)

    @property
    def layout_share(self) -> float:
        """The slowest share the epoch's chunk layout plans for. A rank with no speed (share 0)
        claims nothing near the tail; a floor keeps the tail's chunks from all becoming single
        batches (a store round trip each) for a very slow rank."""
        return max(min(self.shares), SMALLEST_LAYOUT_SHARE)

    def leaves_tail(
        self,
        rank: int,
        claimed: int,
        at_round: Sequence[int],
        total: int,
        largest_chunk: int,
        next_chunk: Callable[[], Optional[tuple[int, int]]],
    ) -> bool:
        """Whether ``rank`` stops claiming now.

        Args:
            rank: the rank about to claim.
            claimed: batches it has claimed in the epoch.
            at_round: batches every rank had started in the epoch at the latest round (zeros
                before one).
            total: batches in the epoch's layout.
            largest_chunk: the layout's longest chunk, in batches.
            next_chunk: the size in batches of the chunk the claim would take and the batches left
                in the pool from it on, or None when the pool is dry; read only when the counts alone
                do not decide.
        """
        if rank == self.drainer:
            return False
        share = self.shares[rank]
        if share <= 0:
            return True
        others = 1.0 - share
        if others <= 0:
            return False
        # From the latest round of the epoch (or its start) every rank trains at its share of the
        # cohort's speed, so the epoch ends at the later of two ends: this rank's, after `mine`
        # batches (time mine / share, in the cohort's batches), and that of the ranks faster than
        # it, which claim after it has left: their part of what the others claimed, untrained at
        # the round (level among them: in proportion to their shares), and the pool. Taking the
        # next chunk pays off unless the later end is later with it than without it. (Counting
        # every other rank as claiming made every rank leave the pool to the others once their
        # ends were level: on 32 ranks all but the drainer left the end of each epoch to it.)
        # Only claims and the round's counts enter: how far every rank is at this moment (a
        # prefetch, a chunk in progress) is not known across ranks.
        mine = claimed - at_round[rank]
        rest = total - claimed - (sum(at_round) - at_round[rank])
        if (mine + largest_chunk) / share <= (rest - largest_chunk) / others:
            return False  # even after the largest chunk this rank ends first: no need to read the counter
        faster = sum(s for k, s in enumerate(self.shares) if (s, -k) > (share, -rank))
        if faster <= 0:
            return False  # the fastest rank never leaves the tail
        read = next_chunk()
        if read is None:
            return False  # the pool is dry: the claim ends the epoch for this rank
        chunk, pool = read
        theirs = max(0, rest - pool) * faster / others + pool
        with_chunk = max((mine + chunk) / share, (theirs - chunk) / faster)
        without = max(mine / share, theirs / faster)
        return with_chunk > without  # strict: on a tie taking it is no worse
