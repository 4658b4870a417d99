"""The shared store behind the dispatch: its protocol and the keys of an epoch.

The pooled dispatch claims chunks with an atomic counter and keeps append-only records of what
each rank claimed (read by the others after a loss); the own-stream splits use the store only when
ranks join mid-epoch, to learn how far every member had handed its work out. Every key of an epoch
carries the membership generation the epoch started with, so a rank declared lost that still runs
(stopped, then continued) claims on keys no member uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

CHUNK_KEY_PREFIX = "lightning_elche/dispatch"


class ChunkCounter(Protocol):
    """The shared store behind chunk claims (``torch.distributed.Store`` satisfies it): an atomic
    counter for claims, and append-only records of what each rank claimed (read after a loss)."""

    def add(self, key: str, amount: int, /) -> int: ...

    def append(self, key: str, value: str, /) -> None: ...

    def check(self, keys: list[str], /) -> bool: ...

    def get(self, key: str, /) -> bytes: ...


COUNTER_METHODS = ("add", "append", "check", "get")


def missing_counter_methods(counter: Any) -> list[str]:
    """The :class:`ChunkCounter` methods ``counter`` lacks."""
    return [name for name in COUNTER_METHODS if not callable(getattr(counter, name, None))]


def read_entries(counter: ChunkCounter, key: str) -> list[str]:
    """The ``;``-terminated entries appended to ``key`` (none when it was never written)."""
    if not counter.check([key]):
        return []
    value = counter.get(key)
    text = value.decode() if isinstance(value, bytes) else str(value)
    return [entry for entry in text.split(";") if entry]


@dataclass(frozen=True)
class EpochKeys:
    """The store keys of one epoch. A *span* is the stretch of the epoch between two membership
    changes: span 0 until the first change, span ``g`` after the ``g``-th."""

    base: str

    @classmethod
    def of(cls, prefix: str, epoch: int, generation: int) -> EpochKeys:
        """``generation``: the membership generation the epoch started with (0: the fit's first)."""
        if generation == 0:
            return cls(f"{prefix}/epoch{epoch}")
        return cls(f"{prefix}/m{generation}/epoch{epoch}")

    def pool(self, span: int) -> str:
        """The pool's claim counter in ``span``."""
        return self.base if span == 0 else f"{self.base}/pool{span}"

    def queue(self, span: int) -> str:
        """The claim counter of the batches that the change opening ``span`` (from 1) returned."""
        return f"{self.base}/returned{span}"

    def claims(self, span: int, rank: int) -> str:
        """The record of what ``rank`` (numbered as in ``span``) claimed in ``span``."""
        return f"{self.base}/claims/g{span}/r{rank}"

    @property
    def layout(self) -> str:
        """The slowest shares the ranks proposed for the epoch's chunk layout (the first counts)."""
        return f"{self.base}/layout"

    def handed(self, generation: int, rank: int) -> str:
        """How many batches ``rank`` (numbered as before the change) had handed out when the change
        of ``generation`` arrived (own-stream splits with joiners)."""
        return f"{self.base}/change{generation}/handed/r{rank}"
