"""How a rank that is alive but makes no progress is told from a slow one: by its own speed.

A hung kernel, a deadlock or an endless loop in user code leaves a rank's heartbeat going (its
thread still runs), so liveness alone never finds it. Every rank therefore keeps a
:class:`ProgressStamp`: a counter that the training path advances at every training and
validation step, and every watched wait (a round, a checked collective, the agreement) at every
slice, so a rank waiting on its peers is never the stuck one. With the counter it publishes the
bound after which it may be declared stalled, derived from *its own* measured window and round
times (:func:`stall_bound_s`): a rank that is slow by design has long windows, hence a long bound,
and is never flagged for being slower than the others. The heartbeat thread writes both to the
job's store once a second, with how long the counter has stood still on this rank's own clock (no
clock is compared across hosts; no collective, no synchronize: the training path only adds one to
a Python int).

A peer that waits for this rank reads the stamp with its liveness checks (:func:`stall_verdict`):
when the counter has stood still for the published bound while the heartbeat still beats, the
rank is lost like a silent one and the survivors fence it (a looping process must not come back
into a group that went on without it). Because the stillness is the stuck rank's own account, it
is found one bound after its last progress, however late its peers started to wait for it.

A rank is judged only while it trains: from a training batch's start to the round that ends its
epoch's windows (:meth:`ProgressStamp.enter_training`, :meth:`ProgressStamp.leave_training`),
its windows and rounds being what its measured bound describes. Validation, the sanity check,
epoch-end hooks and callbacks may wait in collectives ElChe does not see (a metric's own
``all_gather``, a logger's) for as long as a slower peer needs: judged there, a healthy rank would
be fenced. No bound is published before a rank's first round either (nothing is measured yet)
unless ``ElCheStrategy(stall_timeout=...)`` fixes it, nor while the rank is inside a step it does
not control and that has no steps of its own (a checkpoint's write, the rebuild of the process
group): :meth:`ProgressStamp.held`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

from lightning_elche.checks import invalid

STALL_FLOOR = timedelta(seconds=20)
"""The shortest derived bound: a one-off pause of a healthy rank between steps (an epoch's
first batch, a callback, a recompile) must not end it."""
STALL_WINDOWS = 2.0
"""Windows (with their rounds) of the rank's own measured length in the derived bound."""
STALL_SLACK_S = 2.0
"""Added to the derived bound: the heartbeat publishes once a second and peers look twice a second."""
BEATING_S = 5.0
"""A heartbeat that moved this recently still beats; one silent for longer is left to the liveness
timeout (a stopped process: its own verdict, and its own timing)."""


def resolve_stall_timeout(value: Any, transport_timeout: Optional[timedelta] = None) -> Optional[timedelta]:
    """``ElCheStrategy(stall_timeout=...)`` checked: None (derived from each rank's own measured
    window, at least :data:`STALL_FLOOR`) or a timedelta of at least 1 second, shorter than the
    transport's ``timeout`` (a stall must be found before the transport gives up)."""
    if value is None:
        return None
    subject = f"ElCheStrategy(stall_timeout={value!r})"
    if not isinstance(value, timedelta) or value.total_seconds() < 1.0:
        raise invalid(
            subject,
            "expected None (derived from each rank's own measured window: "
            f"{STALL_WINDOWS:g} windows and rounds + {STALL_SLACK_S:g} s, at least {STALL_FLOOR.total_seconds():g} s) "
            "or a timedelta of at least 1 second: how long a live rank may make no progress before its peers "
            "declare it lost",
        )
    if transport_timeout is not None and value >= transport_timeout:
        raise invalid(
            subject,
            f"expected a timedelta shorter than timeout={transport_timeout}: a stalled rank must be found before "
            "the transport's own timeout ends the fit (raise timeout=..., or leave stall_timeout=None)",
        )
    return value


def stall_bound_s(window_s: Optional[float], sync_s: Optional[float], override: Optional[timedelta] = None,
                  floor_s: Optional[float] = None) -> Optional[float]:
    """How long a rank whose window is ``window_s`` and whose rounds take ``sync_s`` (its own
    measurements; None before any) may make no progress: ``override`` when given, else
    ``STALL_WINDOWS x (window + round) + STALL_SLACK_S``, at least ``floor_s`` (default
    :data:`STALL_FLOOR`); None (never flagged) when nothing is measured yet."""
    if override is not None:
        return override.total_seconds()
    if window_s is None or window_s <= 0.0:
        return None
    measured = STALL_WINDOWS * (window_s + max(0.0, sync_s or 0.0)) + STALL_SLACK_S
    return max(STALL_FLOOR.total_seconds() if floor_s is None else floor_s, measured)


@dataclass(frozen=True)
class Stamp:
    """What a rank publishes: its progress counter, how long it has stood still (seconds, on the
    rank's own clock) and its current bound (None: not judged now)."""

    count: int
    still_s: float
    bound_s: Optional[float]

    def dumps(self) -> str:
        return f"{self.count} {self.still_s!r} {'-' if self.bound_s is None else repr(self.bound_s)}"

    @classmethod
    def loads(cls, text: Any) -> Stamp:
        count, still, bound = (text.decode() if isinstance(text, (bytes, bytearray)) else str(text)).split()
        return cls(int(count), float(still), None if bound == "-" else float(bound))


class ProgressStamp:
    """This rank's progress counter and the bound it publishes with it (see the module's docstring).

    Args:
        override: ``ElCheStrategy(stall_timeout=...)`` (None: derived from the measured window).
    """

    def __init__(self, override: Optional[timedelta] = None) -> None:
        self.override = override
        self.count = 0
        self.window_s: Optional[float] = None
        self.sync_s: Optional[float] = None
        self._holds = 0
        self.training = False
        self._seen: Optional[tuple[int, float]] = None  # (count, when it was first stamped), stamp()'s clock

    def advance(self) -> None:
        """Some progress (a step, a slice of a watched wait): one Python add, nothing else."""
        self.count += 1

    def expect(self, window_s: float, sync_s: float) -> None:
        """This rank's own measured window and round time, after a round."""
        self.window_s, self.sync_s = window_s, sync_s

    def enter_training(self) -> None:
        """A training batch starts: judged from here (its steps and rounds are what the bound measures)."""
        if not self.training:
            self.training = True
            self.advance()

    def leave_training(self) -> None:
        """The epoch's windows ended (or validation starts): not judged until the next training batch."""
        self.training = False
        self.advance()

    @property
    def bound_s(self) -> Optional[float]:
        if self._holds or not self.training:
            return None
        return stall_bound_s(self.window_s, self.sync_s, self.override)

    def stamp(self, now: float) -> Stamp:
        """The stamp to publish at ``now`` (the publisher's monotonic clock; called about once a
        second, so the stillness is under-counted by that period at most)."""
        count = self.count
        if self._seen is None or count != self._seen[0]:
            self._seen = (count, now)
        return Stamp(count, max(0.0, now - self._seen[1]), self.bound_s)

    @contextmanager
    def held(self) -> Iterator[None]:
        """Not judged inside (a write or a rebuild that has no steps); entering and leaving count
        as progress, so that the time inside never counts against the rank afterwards."""
        self._holds += 1
        self.advance()
        try:
            yield
        finally:
            self.advance()
            self._holds -= 1


def stall_verdict(stamp: Optional[Stamp], beat_age_s: float = 0.0) -> Optional[str]:
    """Why the rank that published ``stamp`` is stalled, or None (nothing published yet, no bound
    now, still within it, or its heartbeat silent: ``beat_age_s`` ago it last moved, a case for
    the liveness timeout)."""
    if stamp is None or stamp.bound_s is None or stamp.still_s < stamp.bound_s or beat_age_s > BEATING_S:
        return None
    return (f"stalled: alive (its heartbeat goes on) but no progress for {stamp.still_s:.1f} s "
            f"(its own bound: {stamp.bound_s:.1f} s)")


def expect_own_window(stamp: ProgressStamp, engine: Any, outcome: Any) -> None:
    """After a round: this rank's window as measured (the one just closed, or the next one planned
    at its smoothed speed, whichever is longer) and its round time, into ``stamp``."""
    rank = engine.rank
    if not 0 <= rank < len(outcome.reports):
        return
    report = outcome.reports[rank]
    planned = outcome.planned[rank] if rank < len(outcome.planned) else 0
    window_s = max(report.compute_s, engine.controller.smoothed_ms(rank) * planned / 1000.0)
    stamp.expect(window_s, report.last_sync_s)
