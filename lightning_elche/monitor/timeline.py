"""A Chrome-trace timeline of the run (open in Perfetto or ``chrome://tracing``).

Rank 0 builds it from the round outcomes, which carry every rank's compute time, so one file
shows every rank without a gather. Times are rank 0's clock (microseconds since the start of
training). A round ends at about the same moment on every rank, so rank ``k``'s slices of round
``r`` are reconstructed as: ``window`` from the end of the previous round (or the epoch start)
for ``compute_s`` seconds, then ``sync`` (waiting for peers plus the reduce) until the round's end.

Event kinds: ``window`` and ``sync`` slices per rank ("X"), ``validation`` slices, ``epoch N``
slices on a ``cohort`` track, and instant events ("i") for ``anchor_changed`` (from/to),
``throttle`` (a rank's batch share fell under half an equal share), epoch boundaries,
``rank_lost`` and ``rank_joined`` (a global marker, plus one on each lost or joined rank's track).

Each rank's track (``pid``) is its number at launch (a joiner's: its member id), so a rank keeps
its track when the ranks are renumbered after a change; a lost rank's track simply ends, a
joiner's starts at its marker.
"""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Sequence
from typing import Any, Optional, Union

from lightning_elche.monitor.record import clean, write_atomically

DEFAULT_MAX_EVENTS = 200_000
"""Events kept (the newest); metadata events are always kept."""

THROTTLE_SHARE = 0.5
"""A rank is marked throttled when its batch share is below this fraction of an equal share."""

TRAIN_TID = 0
EPOCH_TID = 1


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 1)


class Timeline:
    """Collects trace events; :meth:`to_trace` returns the Chrome-trace JSON object."""

    def __init__(self, world_size: int, max_events: int = DEFAULT_MAX_EVENTS,
                 ranks: Optional[Sequence[int]] = None) -> None:
        self.world_size = int(world_size)
        # The track of each current rank: its number at launch.
        self.ranks: list[int] = list(ranks) if ranks is not None else list(range(self.world_size))
        if len(self.ranks) != self.world_size:
            raise ValueError(f"Timeline(ranks={self.ranks!r}) names {len(self.ranks)} ranks, expected "
                             f"world_size={self.world_size}")
        self.tracks: list[int] = list(self.ranks)  # every track that ever had a rank
        self.joined: list[int] = []  # tracks of ranks that joined during the fit
        self.events: deque[dict[str, Any]] = deque(maxlen=max(16, int(max_events)))
        self.dropped = 0
        self._last_round_end: Optional[float] = None
        self._epoch_start: Optional[tuple[int, float]] = None
        self._anchor: Optional[int] = None
        self._throttled: set[int] = set()

    def _add(self, event: dict[str, Any]) -> None:
        if len(self.events) == self.events.maxlen:
            self.dropped += 1
        self.events.append(event)

    # -- feeding -------------------------------------------------------------------------------

    def epoch_start(self, epoch: int, t: float) -> None:
        self._epoch_start = (epoch, t)
        self._last_round_end = t
        self._add({"name": "epoch_start", "ph": "i", "s": "g", "pid": 0, "tid": EPOCH_TID, "ts": _us(t),
                   "cat": "epoch", "args": {"epoch": epoch}})

    def epoch_end(self, epoch: int, t: float) -> None:
        start = self._epoch_start[1] if self._epoch_start and self._epoch_start[0] == epoch else None
        if start is not None:
            for pid in self.ranks:
                self._add({"name": f"epoch {epoch}", "ph": "X", "pid": pid, "tid": EPOCH_TID, "ts": _us(start),
                           "dur": _us(max(0.0, t - start)), "cat": "epoch", "args": {"epoch": epoch}})
        self._add({"name": "epoch_end", "ph": "i", "s": "g", "pid": 0, "tid": EPOCH_TID, "ts": _us(t),
                   "cat": "epoch", "args": {"epoch": epoch}})
        self._epoch_start = None

    def validation(self, start: float, end: float, metrics: Optional[dict[str, float]] = None) -> None:
        for pid in self.ranks:
            self._add({"name": "validation", "ph": "X", "pid": pid, "tid": TRAIN_TID, "ts": _us(start),
                       "dur": _us(max(0.0, end - start)), "cat": "eval", "args": dict(metrics or {})})
        self._last_round_end = end

    def round(
        self,
        index: int,
        t_end: float,
        epoch: int,
        steps: Sequence[int],
        samples: Sequence[int],
        compute_s: Sequence[float],
        anchor: int,
        batch_share: Optional[Sequence[float]] = None,
    ) -> None:
        """One sync round that ended at ``t_end`` (seconds, rank 0's clock)."""
        start = self._last_round_end if self._last_round_end is not None else t_end - max(compute_s, default=0.0)
        for k, pid in enumerate(self.ranks):
            compute_end = min(t_end, start + max(0.0, float(compute_s[k])))
            if steps[k] > 0:
                self._add({"name": "window", "ph": "X", "pid": pid, "tid": TRAIN_TID, "ts": _us(start),
                           "dur": _us(compute_end - start), "cat": "compute",
                           "args": {"sync": index, "epoch": epoch, "steps": int(steps[k]),
                                    "samples": int(samples[k])}})
            self._add({"name": "sync", "ph": "X", "pid": pid, "tid": TRAIN_TID, "ts": _us(compute_end),
                       "dur": _us(max(0.0, t_end - compute_end)), "cat": "sync",
                       "args": {"sync": index, "epoch": epoch, "steps": int(steps[k])}})
        if self._anchor is not None and anchor != self._anchor:
            self._add({"name": "anchor_changed", "ph": "i", "s": "g", "pid": 0, "tid": TRAIN_TID, "ts": _us(t_end),
                       "cat": "anchor", "args": {"from": self._anchor, "to": anchor, "sync": index}})
        self._anchor = anchor
        if batch_share is not None and self.world_size > 1:
            equal = 1.0 / self.world_size
            for k, share in enumerate(batch_share):
                low = share < THROTTLE_SHARE * equal
                pid = self.ranks[k]
                if low and pid not in self._throttled and sum(steps) > 0:
                    self._add({"name": "throttle", "ph": "i", "s": "p", "pid": pid, "tid": TRAIN_TID,
                               "ts": _us(t_end), "cat": "throttle",
                               "args": {"rank": k, "original_rank": pid, "batch_share": share, "equal_share": equal,
                                        "sync": index}})
                if low:
                    self._throttled.add(pid)
                else:
                    self._throttled.discard(pid)
        self._last_round_end = t_end

    def ranks_lost(self, t: float, generation: int, lost: Sequence[int], survivors: Sequence[int],
                   reasons: Optional[dict[str, str]] = None, sync: Optional[int] = None) -> None:
        """Ranks ``lost`` (launch numbers) left at ``t``; ``survivors`` (launch numbers) are the new ranks 0, 1, ..."""
        args = {"generation": generation, "lost": list(lost), "survivors": list(survivors),
                "reasons": dict(reasons or {}), "sync": sync}
        label = "rank_lost: " + ", ".join(f"rank {r}" for r in lost)
        self._add({"name": label, "ph": "i", "s": "g", "pid": 0, "tid": TRAIN_TID, "ts": _us(t), "cat": "rank_lost",
                   "args": args})
        for pid in lost:
            self._add({"name": "rank_lost", "ph": "i", "s": "p", "pid": pid, "tid": TRAIN_TID, "ts": _us(t),
                       "cat": "rank_lost", "args": args})
            self._throttled.discard(pid)
        self.ranks = list(survivors)
        self.world_size = len(self.ranks)

    def ranks_joined(self, t: float, generation: int, joined: Sequence[int], ranks: Sequence[int],
                     sync: Optional[int] = None) -> None:
        """Ranks ``joined`` (member ids) joined at ``t``; ``ranks`` (member ids) are the new ranks 0, 1, ..."""
        args = {"generation": generation, "joined": list(joined), "ranks": list(ranks), "sync": sync}
        label = "rank_joined: " + ", ".join(f"rank {r}" for r in joined)
        self._add({"name": label, "ph": "i", "s": "g", "pid": 0, "tid": TRAIN_TID, "ts": _us(t),
                   "cat": "rank_joined", "args": args})
        for pid in joined:
            self._add({"name": "rank_joined", "ph": "i", "s": "p", "pid": pid, "tid": TRAIN_TID, "ts": _us(t),
                       "cat": "rank_joined", "args": args})
            if pid not in self.tracks:
                self.tracks.append(pid)
            self.joined.append(pid)
        self.ranks = list(ranks)
        self.world_size = len(self.ranks)

    # -- output --------------------------------------------------------------------------------

    def metadata(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for k in self.tracks:
            name = f"rank {k}" + (" (joined)" if k in self.joined else "") + ("" if k in self.ranks else " (lost)")
            out.append({"name": "process_name", "ph": "M", "pid": k, "tid": 0, "args": {"name": name}})
            out.append({"name": "process_sort_index", "ph": "M", "pid": k, "tid": 0, "args": {"sort_index": k}})
            out.append({"name": "thread_name", "ph": "M", "pid": k, "tid": TRAIN_TID, "args": {"name": "train"}})
            out.append({"name": "thread_name", "ph": "M", "pid": k, "tid": EPOCH_TID, "args": {"name": "epochs"}})
        return out

    def to_trace(self, extra: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        other = {"source": "lightning_elche.ElCheMonitor", "clock": "rank 0, seconds since train start",
                 "dropped_events": self.dropped, **(extra or {})}
        trace = {"traceEvents": self.metadata() + list(self.events), "displayTimeUnit": "ms", "otherData": other}
        return clean(trace)  # strict JSON: a NaN metric becomes null

    def write(self, path: Union[str, os.PathLike], extra: Optional[dict[str, Any]] = None) -> None:
        write_atomically(path, json.dumps(self.to_trace(extra), separators=(",", ":"), allow_nan=False))
