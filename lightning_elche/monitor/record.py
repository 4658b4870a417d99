"""The record log (append-only JSONL with a byte cap) and the cross-rank scalar reductions.

Each rank writes ``rank<r>.jsonl``; rank 0 also writes ``root.jsonl``, the cross-rank roll-up.
Every file starts with one ``meta`` record and is a drop-oldest ring: when the next record would
push the file past ``max_bytes``, the file is rewritten with the meta record and the newest
records that fit in three quarters of the cap, so rewrites are rare (each one frees at least a
quarter of the cap) and the file never grows past the cap. I/O errors warn once and disable the
log; they never fail training.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Optional, Union

DEFAULT_MAX_LOG_BYTES = 32 * 1024 * 1024
"""Default per-file cap of the record log (flodl's default)."""

MIN_LOG_BYTES = 4096
"""Smallest accepted cap: room for the meta record and a few records."""

LOW_WATER = 0.75
"""A compaction keeps the newest records that fit in this fraction of the cap."""

RECORD_VERSION = 1

Reduction = Literal["mean", "sum", "max", "min", "last"]
REDUCTIONS: tuple[str, ...] = ("mean", "sum", "max", "min", "last")

CORE_REDUCTIONS: dict[str, str] = {
    "loss": "mean",
    "samples_per_s": "sum",
    "batch_share": "sum",
    "steps": "sum",
    "samples": "sum",
    "compute_s": "max",
    "sync_s": "max",
    "idle": "max",
}
"""How the per-rank core metrics roll up across ranks; fixed, user declarations never change them."""

DEFAULT_SCALAR_REDUCTION = "mean"
"""Roll-up of a user scalar that ``scalar_reductions`` does not name (flodl's default)."""


def validate_reductions(reductions: Optional[Mapping[str, str]], owner: str = "ElCheMonitor") -> dict[str, str]:
    """A checked copy of a ``name -> reduction`` mapping; raises ``ValueError`` naming the bad entry."""
    if reductions is None:
        return {}
    if not isinstance(reductions, Mapping):
        raise ValueError(
            f"{owner}(scalar_reductions={reductions!r}) is invalid: expected a mapping of scalar name to one of "
            f"{', '.join(REDUCTIONS)}."
        )
    out: dict[str, str] = {}
    for name, how in reductions.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"{owner}(scalar_reductions): key {name!r} is invalid: expected a scalar name.")
        if how not in REDUCTIONS:
            raise ValueError(
                f"{owner}(scalar_reductions[{name!r}]={how!r}) is invalid: expected one of {', '.join(REDUCTIONS)}."
            )
        out[name] = str(how)
    return out


def reduce_values(children: Sequence[tuple[Optional[float], float]], how: str) -> Optional[float]:
    """Roll up ``(value, work)`` pairs of the direct children of a node.

    ``None`` values are unreported and ignored. ``mean`` is weighted by work over the children
    with work > 0 (absent if none did work); ``sum``, ``max`` and ``min`` use every reported
    value; ``last`` is the value of the child with the most work (the first such child on a tie).
    Returns ``None`` when nothing was reported: an unreported key stays absent, never zero.
    """
    reported = [(float(v), float(w)) for v, w in children if v is not None and _finite(v)]
    if not reported:
        return None
    if how == "mean":
        worked = [(v, w) for v, w in reported if w > 0]
        total = math.fsum(w for _, w in worked)
        if total <= 0:
            return None
        return math.fsum(v * w for v, w in worked) / total
    if how == "sum":
        return math.fsum(v for v, _ in reported)
    if how == "max":
        return max(v for v, _ in reported)
    if how == "min":
        return min(v for v, _ in reported)
    if how == "last":
        best = max(range(len(reported)), key=lambda i: (reported[i][1], -i))
        return reported[best][0]
    raise ValueError(f"unknown reduction {how!r}: expected one of {', '.join(REDUCTIONS)}")


def rollup(
    children: Sequence[Mapping[str, Any]], reductions: Optional[Mapping[str, str]] = None
) -> dict[str, dict[str, float]]:
    """Roll up child nodes ``{"work": w, "metrics": {...}, "scalars": {...}}`` into one parent node.

    ``metrics`` are core keys (fixed reductions, :data:`CORE_REDUCTIONS`; a key with no fixed
    reduction is averaged); ``scalars`` are user scalars, reduced as ``reductions`` declares
    (default ``mean``). A key reported by no child is absent from the result.
    """
    reductions = reductions or {}
    out: dict[str, dict[str, float]] = {"metrics": {}, "scalars": {}}
    for section, table in (("metrics", CORE_REDUCTIONS), ("scalars", reductions)):
        keys: list[str] = []
        for child in children:
            for key in child.get(section) or {}:
                if key not in keys:
                    keys.append(key)
        for key in keys:
            how = table.get(key, DEFAULT_SCALAR_REDUCTION)
            pairs = [((c.get(section) or {}).get(key), float(c.get("work", 0) or 0)) for c in children]
            value = reduce_values(pairs, how)
            if value is not None:
                out[section][key] = value
    return out


def _finite(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def clean(value: Any) -> Any:
    """JSON-safe copy: non-finite floats become ``null``, tuples become lists."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    if hasattr(value, "item"):
        try:
            return clean(value.item())
        except (TypeError, ValueError, RuntimeError):
            return str(value)
    return str(value)


def to_line(record: Mapping[str, Any]) -> bytes:
    """One JSONL line (strict JSON: no NaN or Infinity), newline included."""
    return (json.dumps(clean(record), separators=(",", ":"), allow_nan=False) + "\n").encode("utf-8")


def write_atomically(path: Union[str, os.PathLike], text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: a reader never sees half a file."""
    path = os.fspath(path)
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def read_records(path: Union[str, os.PathLike]) -> list[dict[str, Any]]:
    """Every record of a record-log file, oldest first (a torn last line is skipped)."""
    out: list[dict[str, Any]] = []
    with open(path, "rb") as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


class RecordLog:
    """One append-only JSONL file, capped at ``max_bytes`` by dropping its oldest records.

    The first record is ``meta`` and always survives compaction; it carries ``dropped``, the
    number of records dropped so far. Nothing here raises on I/O errors: the first one is
    warned about and the log stops writing.
    """

    def __init__(
        self,
        path: Union[str, os.PathLike],
        meta: Mapping[str, Any],
        max_bytes: int = DEFAULT_MAX_LOG_BYTES,
        low_water: float = LOW_WATER,
    ) -> None:
        self.path = Path(path)
        self.max_bytes = int(max_bytes)
        self.low_water = float(low_water)
        self.meta: dict[str, Any] = {"v": RECORD_VERSION, "kind": "meta", **dict(meta), "dropped": 0}
        self.dropped = 0
        self.compactions = 0
        self.failed = False
        self._size = 0
        self._file: Optional[Any] = None
        self._guard(self._open)

    @property
    def size(self) -> int:
        """Bytes in the file now."""
        return self._size

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = to_line(self.meta)
        with open(self.path, "wb") as f:
            f.write(line)
        self._size = len(line)
        self._file = open(self.path, "ab")

    def append(self, record: Mapping[str, Any]) -> None:
        """Add one record (``v`` is added); compacts first when the cap would be crossed."""
        if self.failed:
            return
        self._guard(self._append, {"v": RECORD_VERSION, **dict(record)})

    def _append(self, record: dict[str, Any]) -> None:
        line = to_line(record)
        if len(line) + len(to_line(self.meta)) > self.low_water * self.max_bytes:
            self.dropped += 1  # larger than the ring can hold: dropping it keeps the older records
            return
        if self._size + len(line) > self.max_bytes:
            self._compact(incoming=len(line))
        assert self._file is not None
        self._file.write(line)
        self._file.flush()
        self._size += len(line)

    def _compact(self, incoming: int) -> None:
        """Rewrite the file with the meta record and the newest records that fit under the low-water mark."""
        assert self._file is not None
        self._file.close()
        self._file = None
        with open(self.path, "rb") as f:
            lines = f.read().splitlines(keepends=True)
        body = [ln for ln in lines[1:] if ln.endswith(b"\n")]
        # Room for the meta record whatever its drop count grows to, and for the incoming record.
        head_room = len(to_line({**self.meta, "dropped": 10**15}))
        budget = int(self.max_bytes * self.low_water) - incoming - head_room
        kept: list[bytes] = []
        used = 0
        for line in reversed(body):
            if used + len(line) > budget:
                break
            kept.append(line)
            used += len(line)
        kept.reverse()
        self.dropped += len(body) - len(kept)
        self.meta["dropped"] = self.dropped
        head = to_line(self.meta)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(head)
            f.writelines(kept)
        os.replace(tmp, self.path)
        self._size = len(head) + used
        self.compactions += 1
        self._file = open(self.path, "ab")

    def close(self) -> None:
        if self._file is not None:
            self._guard(self._file.close)
            self._file = None

    def _guard(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except (OSError, ValueError, TypeError) as err:
            if not self.failed:
                self.failed = True
                warnings.warn(
                    f"ElCheMonitor: the record log {str(self.path)!r} stopped writing after an error "
                    f"({type(err).__name__}: {err}); training goes on without it.",
                    RuntimeWarning,
                    stacklevel=3,
                )
            if self._file is not None:
                try:
                    self._file.close()
                except OSError:
                    pass
                self._file = None


class MemoryRing:
    """An in-memory drop-oldest ring of records bounded by their JSON size (rank 0's history)."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_LOG_BYTES) -> None:
        self.max_bytes = int(max_bytes)
        self.records: list[dict[str, Any]] = []
        self._sizes: list[int] = []
        self._size = 0
        self._start = 0
        self.dropped = 0

    def append(self, record: Mapping[str, Any]) -> None:
        size = len(to_line(record))
        self.records.append(dict(record))
        self._sizes.append(size)
        self._size += size
        while self._size > self.max_bytes and self._start < len(self.records) - 1:
            self._size -= self._sizes[self._start]
            self._start += 1
            self.dropped += 1
        if self._start > 1024 and self._start * 2 > len(self.records):
            self.records = self.records[self._start :]
            self._sizes = self._sizes[self._start :]
            self._start = 0

    def __iter__(self) -> Any:
        return iter(self.records[self._start :])

    def __len__(self) -> int:
        return len(self.records) - self._start

    def items(self) -> list[dict[str, Any]]:
        return self.records[self._start :]

    def extend(self, records: Iterable[Mapping[str, Any]]) -> None:
        for r in records:
            self.append(r)


def epoch_rollup(
    per_rank: Sequence[Sequence[Mapping[str, Any]]], reductions: Optional[Mapping[str, str]] = None
) -> dict[str, float]:
    """One epoch's user scalars over all ranks, from each rank's per-sync ``{"work", "scalars"}`` entries.

    Each rank's entries are first summarised over the epoch, then the summaries are reduced across
    ranks with each rank's work (steps in the syncs where it reported the key):

    ======== ===================================== ============================
    reduction  per rank, over the epoch's syncs      across ranks
    ======== ===================================== ============================
    mean       work-weighted mean                     work-weighted mean
    sum        latest value (a running count)         sum
    max / min  max / min                              max / min
    last       latest value                           the busiest rank's value
    ======== ===================================== ============================
    """
    reductions = reductions or {}
    keys: list[str] = []
    for entries in per_rank:
        for entry in entries:
            for key in entry.get("scalars") or {}:
                if key not in keys:
                    keys.append(key)
    out: dict[str, float] = {}
    for key in keys:
        how = reductions.get(key, DEFAULT_SCALAR_REDUCTION)
        summaries: list[tuple[Optional[float], float]] = []
        for entries in per_rank:
            reported = [
                ((e.get("scalars") or {}).get(key), float(e.get("work", 0) or 0))
                for e in entries
                if (e.get("scalars") or {}).get(key) is not None
            ]
            if not reported:
                continue
            work = math.fsum(w for _, w in reported)
            if how in ("mean", "max", "min"):
                value = reduce_values(reported, how)
            else:
                value = reported[-1][0]
            summaries.append((value, work))
        value = reduce_values(summaries, how)
        if value is not None:
            out[key] = value
    return out
