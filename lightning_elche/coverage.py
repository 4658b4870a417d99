"""What part of an epoch is trained: the record a mid-epoch checkpoint keeps, and its range math.

Positions are indices into the epoch's pick order (the ``(seed, epoch)`` permutation), not sample
indices: with the seed, the shuffle flag and the pick count the order is rebuilt on resume, so a
position names the same sample there.

Two shapes, by dispatch:

* pooled dispatch: ranks train chunks claimed in an order nobody can replay, so the record keeps
  the epoch's *remaining positions* as ``[start, stop)`` ranges; the resumed epoch pools only those;
* equal and fixed dispatch: each rank's stream of positions is fixed by its rank, so the record
  keeps how far each rank's stream was trained (``offsets``); each rank resumes its own stream.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Optional

Range = tuple[int, int]


def merge(ranges: Iterable[Sequence[int]]) -> list[Range]:
    """Sorted, disjoint, non-adjacent ``[start, stop)`` ranges covering the same positions."""
    merged: list[Range] = []
    for start, stop in sorted((int(a), int(b)) for a, b in ranges if b > a):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
        else:
            merged.append((start, stop))
    return merged


def subtract(universe: Sequence[Range], taken: Sequence[Range]) -> list[Range]:
    """The positions of ``universe`` not in ``taken`` (both merged)."""
    out: list[Range] = []
    taken = merge(taken)
    k = 0
    for start, stop in merge(universe):
        cursor = start
        while k < len(taken) and taken[k][1] <= cursor:
            k += 1
        j = k
        while j < len(taken) and taken[j][0] < stop:
            if taken[j][0] > cursor:
                out.append((cursor, taken[j][0]))
            cursor = max(cursor, taken[j][1])
            j += 1
        if cursor < stop:
            out.append((cursor, stop))
    return out


def compress(positions: Iterable[int]) -> list[Range]:
    """Ranges of a sequence of positions (runs of consecutive values become one range)."""
    return merge((p, p + 1) for p in positions)


def expand(ranges: Iterable[Sequence[int]]) -> list[int]:
    """Every position of ``ranges``, in order."""
    return [p for start, stop in ranges for p in range(int(start), int(stop))]


def size(ranges: Iterable[Sequence[int]]) -> int:
    return sum(int(b) - int(a) for a, b in ranges)


@dataclass(frozen=True)
class EpochCoverage:
    """The untrained part of one epoch, as saved in a mid-epoch checkpoint.

    ``picks``, ``seed``, ``shuffle``, ``batch_size``, ``drop_last``, ``dispatch`` and
    ``world_size`` identify the epoch's order and dispatch; a resumed run must match them.
    """

    epoch: int
    picks: int
    seed: int
    shuffle: bool
    batch_size: int
    drop_last: bool
    dispatch: str
    world_size: int
    remaining: Optional[list[Range]] = None
    offsets: Optional[list[int]] = None

    @property
    def remaining_samples(self) -> Optional[int]:
        """Picks left for the pooled dispatch (None for per-rank offsets)."""
        return None if self.remaining is None else size(self.remaining)

    def state_dict(self) -> dict[str, Any]:
        state = asdict(self)
        if self.remaining is not None:
            state["remaining"] = [list(r) for r in self.remaining]
        return state

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> EpochCoverage:
        try:
            remaining = state.get("remaining")
            offsets = state.get("offsets")
            coverage = cls(
                epoch=int(state["epoch"]),
                picks=int(state["picks"]),
                seed=int(state["seed"]),
                shuffle=bool(state["shuffle"]),
                batch_size=int(state["batch_size"]),
                drop_last=bool(state["drop_last"]),
                dispatch=str(state["dispatch"]),
                world_size=int(state["world_size"]),
                remaining=None if remaining is None else [(int(a), int(b)) for a, b in remaining],
                offsets=None if offsets is None else [int(o) for o in offsets],
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"The checkpoint's ElChe data coverage is malformed ({error!r}).") from None
        if (coverage.remaining is None) == (coverage.offsets is None):
            raise ValueError("The checkpoint's ElChe data coverage needs either 'remaining' or 'offsets'.")
        return coverage

    def check_matches(self, current: EpochCoverage) -> None:
        """Refuse to resume into a different epoch order or dispatch (the positions would name other samples)."""
        for name in ("picks", "seed", "shuffle", "batch_size", "drop_last", "dispatch", "world_size"):
            saved, now = getattr(self, name), getattr(current, name)
            if saved != now:
                raise ValueError(
                    f"Cannot resume mid-epoch {self.epoch}: the checkpoint's data coverage was taken with "
                    f"{name}={saved!r}, this run has {name}={now!r}. Resume with the same dataset, DataLoader "
                    "(batch_size, shuffle, drop_last), sampler seed, ElChe mode and world size, or resume "
                    "from an epoch-end checkpoint."
                )
