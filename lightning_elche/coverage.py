"""What part of an epoch is trained: the record a mid-epoch checkpoint keeps, and its range math.

Positions are indices into the epoch's pick order (the ``(seed, epoch)`` permutation), not sample
indices: with the seed, the shuffle flag and the pick count the order is rebuilt on resume, so a
position names the same sample there.

The record is rank-agnostic: the epoch's *remaining positions* as ``[start, stop)`` ranges,
whatever the dispatch, so a resumed run may have another number of ranks. The resumed epoch
dispatches only those positions over its own ranks, by its policy (pooled chunks, the equal
interleaved split or the fixed shares).

Records written before the resize support kept per-rank ``offsets`` for the equal and fixed
dispatch (how far each rank's stream of the whole epoch was trained); the sampler converts them
to remaining positions when it resumes (:meth:`~lightning_elche.dispatch.ElCheSampler.resume`).

Below the record: how a rank's part of it (``local_coverage``) and the epoch's remainder are
computed from what the dispatch knows, and when a remainder cannot be resumed. The dispatch
(:mod:`lightning_elche.dispatch`) calls these with its policy's streams or claims; nothing here
knows a policy.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
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


def runs(sorted_positions: Iterable[int]) -> list[Range]:
    """Ranges of increasing, distinct positions, in one pass (no sort, unlike :func:`compress`)."""
    out: list[Range] = []
    start = stop = None
    for position in sorted_positions:
        if stop is not None and position == stop:
            stop += 1
            continue
        if start is not None and stop is not None:
            out.append((start, stop))
        start, stop = position, position + 1
    if start is not None and stop is not None:
        out.append((start, stop))
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

    ``picks``, ``seed``, ``shuffle``, ``batch_size``, ``drop_last`` and ``dispatch`` identify the
    epoch's order and dispatch; a resumed run must match them. ``world_size`` is the number of
    ranks that wrote the record: a resumed run may have another (``remaining`` names positions,
    not ranks); only a legacy ``offsets`` record needs it, to rebuild the ranks' streams.
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
    """Legacy records only (equal and fixed dispatch): picks each rank had trained of its stream."""

    @property
    def remaining_samples(self) -> Optional[int]:
        """Picks left untrained (None for a legacy ``offsets`` record)."""
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
        if coverage.remaining is None and coverage.offsets is None:
            raise ValueError("The checkpoint's ElChe data coverage needs either 'remaining' or 'offsets'.")
        if coverage.remaining is not None:
            merged = merge(coverage.remaining)
            if size(merged) != size(coverage.remaining) or (
                merged and (merged[0][0] < 0 or merged[-1][1] > coverage.picks)
            ):
                raise ValueError(
                    "The checkpoint's ElChe data coverage is malformed: 'remaining' must be disjoint "
                    f"[start, stop) ranges inside 0..{coverage.picks}."
                )
            coverage = replace(coverage, remaining=merged)
        return coverage

    def check_matches(self, current: EpochCoverage) -> None:
        """Refuse to resume into a different epoch order or dispatch (the positions would name other
        samples). The number of ranks may differ: the remainder is split over the resumed run's."""
        for name in ("picks", "seed", "shuffle", "batch_size", "drop_last", "dispatch"):
            saved, now = getattr(self, name), getattr(current, name)
            if saved != now:
                raise ValueError(
                    f"Cannot resume mid-epoch {self.epoch}: the checkpoint's data coverage was taken with "
                    f"{name}={saved!r}, this run has {name}={now!r}. Resume with the same dataset, DataLoader "
                    "(batch_size, shuffle, drop_last), sampler seed and ElChe mode (the number of ranks may "
                    "change), or resume from an epoch-end checkpoint."
                )


# -- what each rank trained, and what a resumed epoch can take ----------------------------------


def claimed_prefix(spans: Sequence[Range], batches: int, batch_size: int) -> list[Range]:
    """The first ``batches`` batches of ``spans`` (pieces of work claimed in this order, each cut into
    batches from its start), as ranges; what was claimed beyond them (a prefetch) is not trained.

    Raises:
        ValueError: the spans hold fewer batches.
    """
    taken: list[Range] = []
    left = batches
    for start, stop in spans:
        if left <= 0:
            break
        count = min(left, -(-(stop - start) // batch_size))
        taken.append((start, min(start + count * batch_size, stop)))
        left -= count
    if left > 0:
        raise ValueError(f"{batches} batches trained, {batches - left} claimed")
    return taken


def stream_remaining(
    universe: Sequence[int], trained: Sequence[int], streams: Sequence[range], epoch: int
) -> list[Range]:
    """``universe`` less the first ``trained[r]`` picks of every rank's stream (``streams[r]``: the
    indices into ``universe`` of rank ``r``'s stream)."""
    untrained = [True] * len(universe)
    for rank, (count, stream) in enumerate(zip(trained, streams, strict=True)):
        if not 0 <= count <= len(stream):
            raise ValueError(
                f"Rank {rank} reports {count} trained picks of epoch {epoch}; its stream has {len(stream)}."
            )
        done = stream[:count]
        untrained[done.start : done.stop : done.step] = [False] * len(done)
    return runs(p for p, left in zip(universe, untrained, strict=True) if left)


def legacy_offsets(coverage: EpochCoverage) -> list[int]:
    """The per-rank ``offsets`` of a legacy record, checked against its world size."""
    if coverage.offsets is None:
        raise ValueError(
            f"The checkpoint's ElChe data coverage of epoch {coverage.epoch} has no remaining positions "
            f"(dispatch={coverage.dispatch!r}): it is malformed."
        )
    if len(coverage.offsets) != coverage.world_size:
        raise ValueError(
            f"The checkpoint's coverage has {len(coverage.offsets)} rank offsets for world_size="
            f"{coverage.world_size}: it is malformed."
        )
    return list(coverage.offsets)
