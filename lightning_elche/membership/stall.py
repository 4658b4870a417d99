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

Each phase has its own bound, measured on the rank itself (:class:`ProgressStamp`):

* **Training** (from a training batch's start to the round that ends its epoch's windows):
  ``STALL_WINDOWS x (window + round) + STALL_SLACK_S`` from its measured windows and rounds
  (:func:`stall_bound_s`), none before its first round.
* **Evaluation steps** (inside a ``validation_step``, the sanity check's included; test and predict
  are not part of a fit): ``STALL_WINDOWS x`` its longest stillness inside an evaluation step of
  this fit ``+ STALL_SLACK_S`` (:func:`phase_bound_s`); its first evaluation step of the fit is not
  judged (nothing is measured yet).
* **The phases without steps** (from the round that ends the epoch's windows to the next training
  batch, apart from evaluation steps: the gaps between them, epoch-end hooks and callbacks, their
  ``sync_dist``, a checkpoint's collectives, ``on_train_end``): ``STALL_WINDOWS x`` its longest
  stillness there at the epoch ends before this one ``+ STALL_SLACK_S``; the first epoch end (and
  what comes before the first training batch) is not judged.

Every derived bound is at least :data:`STALL_FLOOR`; ``ElCheStrategy(stall_timeout=...)`` replaces
it in every phase, from the first occurrence on. Nothing is judged while the rank is inside a step it
does not control and that has no steps of its own (a checkpoint's write, the rebuild of the process
group): :meth:`ProgressStamp.held`. The stillness of the last two phases is measured by the
heartbeat thread (each time the counter moved since its last look, the stillness that ended is
compared with the longest of its phase): the main thread reads no clock for it.

Outside training a healthy rank may stand still for as long as a slower peer needs: it waits in a
collective ElChe does not see (a torchmetrics metric's own ``all_gather``, a logger's), whose wait
advances no counter. Judged on its own account, such a rank was fenced (at the 20 s floor, on a
loaded 2-core machine): the slower peer, once through that collective, entered a checked one and
read the waiting rank's stamp, up to a second old, with the whole wait in it. So in these phases a
peer counts only the stillness it witnessed itself (:class:`~lightning_elche.membership.liveness.
PeerSignals`): how long the rank's published count stood still while the peer looked at it at least
every :data:`WITNESS_GAP_S` (peers read stamps only in their watched waits: rounds, checked
collectives, the agreement, every half second). That cannot fence a healthy rank for a wait on a
peer: every rank calls the same collectives in the same order (the checked ones fail otherwise).
While a peer waits in a watched collective ``n``, the rank has either not reached ``n`` yet, or is
inside it (and advances); not having reached it, it is not waiting in an earlier collective for the
peer, which went through all of them, so each of them returned on the rank too. What the peer
witnesses is then the rank's own work before ``n`` (plus at most the stamp's second of age), which
its bound measures; a rank waiting in an unwatched collective is witnessed by nobody, since every
peer that could see it is either the one it waits for (not waiting) or waiting with it (unwatched).
Training keeps the rank's own account (a stuck rank is found one bound after its last progress,
however late its peers began to wait): there, waits on peers are rounds, which advance.
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


TRAINING = "training"
"""From a training batch's start to the round that ends its epoch's windows: bound from its windows."""
EVALUATING = "evaluation step"
"""Inside a validation step (the sanity check's too): bound from its own longest evaluation step."""
BETWEEN = "epoch end"
"""The phases without steps (epoch-end hooks and callbacks, their ``sync_dist``, a checkpoint's
collectives, the gaps between evaluation steps): bound from its longest stillness there in earlier
epochs."""
IDLE = "idle"
"""Before the fit's first step: never judged."""
WITNESSED = (EVALUATING, BETWEEN)
"""The phases in which a peer counts the stillness only while it waits for the rank itself."""
WITNESS_GAP_S = 2.0
"""A reader that did not look at a peer for this long was not waiting for it in a watched wait (they
look every half second there): what it witnessed of the peer's stillness starts again."""


def phase_bound_s(longest_s: Optional[float], override: Optional[timedelta] = None,
                  floor_s: Optional[float] = None) -> Optional[float]:
    """The bound of a phase without windows (evaluation steps, the phases without steps): ``override``
    when given, else ``STALL_WINDOWS x longest_s + STALL_SLACK_S`` at least ``floor_s`` (default
    :data:`STALL_FLOOR`), where ``longest_s`` is the longest stillness this rank showed there (None:
    nothing measured yet, never flagged)."""
    if override is not None:
        return override.total_seconds()
    if longest_s is None:
        return None
    floor = STALL_FLOOR.total_seconds() if floor_s is None else floor_s
    return max(floor, STALL_WINDOWS * max(0.0, longest_s) + STALL_SLACK_S)


@dataclass(frozen=True)
class Stamp:
    """What a rank publishes: its progress counter, how long it has stood still (seconds, on the
    rank's own clock), its current bound (None: not judged now) and the phase it is in."""

    count: int
    still_s: float
    bound_s: Optional[float]
    phase: str = TRAINING
    """A stamp of three fields (before phases were published) is a training one: only training was judged."""

    def dumps(self) -> str:
        bound = "-" if self.bound_s is None else repr(self.bound_s)
        return f"{self.count} {self.still_s!r} {bound} {self.phase.replace(' ', '_')}"

    @classmethod
    def loads(cls, text: Any) -> Stamp:
        count, still, bound, *phase = (text.decode() if isinstance(text, (bytes, bytearray)) else str(text)).split()
        return cls(int(count), float(still), None if bound == "-" else float(bound),
                   phase[0].replace("_", " ") if phase else TRAINING)


@dataclass(frozen=True)
class _Seen:
    """The heartbeat thread's view of the counter: its value, when it first saw it, in which phase."""

    count: int
    since: float
    phase: str
    epoch_end: int
    """The epoch end it was seen in (counted from 1; 0: none)."""


class ProgressStamp:
    """This rank's progress counter, its phase and the bound it publishes with them (see the
    module's docstring).

    The main thread only adds to :attr:`count`, sets :attr:`phase` and counts finished evaluation
    steps (Python assignments). The heartbeat thread measures the stillness episodes in
    :meth:`stamp`: each time the counter moved since its last look, the episode that ended (from
    when it first saw the old value) is the longest of its phase if it is longer than those before.

    Args:
        override: ``ElCheStrategy(stall_timeout=...)`` (None: derived from the measured window).
    """

    def __init__(self, override: Optional[timedelta] = None) -> None:
        self.override = override
        self.count = 0
        self.window_s: Optional[float] = None
        self.sync_s: Optional[float] = None
        self._holds = 0
        self.phase = IDLE
        self.evaluation_steps = 0
        """Evaluation steps finished in this fit (none: the first one is not judged)."""
        self.longest_evaluation_s = 0.0
        """The longest stillness inside an evaluation step, seen by the heartbeat thread."""
        self._epoch_ends = 0  # epoch ends begun (the rounds that ended an epoch's windows)
        self._at_epoch_end = False
        self._epoch_end_longest: dict[int, float] = {}  # epoch end -> its longest stillness seen
        self._seen: Optional[_Seen] = None

    @property
    def training(self) -> bool:
        return self.phase == TRAINING

    @property
    def epoch_end_s(self) -> Optional[float]:
        """The longest stillness in the phases without steps of the epoch ends finished before
        now (None: none finished yet; one the heartbeat thread saw no stillness in counts 0)."""
        finished = self._epoch_ends - (1 if self._at_epoch_end else 0)
        if finished < 1:
            return None
        return max((s for end, s in self._epoch_end_longest.items() if end <= finished), default=0.0)

    def advance(self) -> None:
        """Some progress (a step, a slice of a watched wait): one Python add, nothing else."""
        self.count += 1

    def expect(self, window_s: float, sync_s: float) -> None:
        """This rank's own measured window and round time, after a round."""
        self.window_s, self.sync_s = window_s, sync_s

    def enter_training(self) -> None:
        """A training batch starts: judged by its windows from here. Coming from an epoch end, that
        epoch end's longest stillness joins those the next ones are judged by."""
        if self.phase != TRAINING:
            self._at_epoch_end = False
            self.phase = TRAINING
            self.advance()

    def leave_training(self) -> None:
        """The epoch's windows ended (or the fit did): the phases without steps until the next
        training batch."""
        if self.phase == TRAINING:
            self._epoch_ends += 1
            self._at_epoch_end = True
        self.phase = BETWEEN
        self.advance()

    def enter_evaluation_step(self) -> None:
        """A validation (or sanity-check) step starts: two assignments and an add."""
        self.phase = EVALUATING  # inside an epoch (val_check_interval): no epoch end
        self.advance()

    def leave_evaluation_step(self) -> None:
        """The step returned (or raised): the phases without steps until the next step."""
        self.evaluation_steps += 1
        self.phase = BETWEEN
        self.advance()

    @property
    def bound_s(self) -> Optional[float]:
        if self._holds:
            return None
        phase = self.phase
        if phase == TRAINING:
            return stall_bound_s(self.window_s, self.sync_s, self.override)
        if phase == EVALUATING:
            if not self.evaluation_steps and self.override is None:
                return None  # its first evaluation step of the fit: nothing measured yet
            return phase_bound_s(self.longest_evaluation_s, self.override)
        if phase == BETWEEN:
            return phase_bound_s(self.epoch_end_s, self.override)
        return None

    def stamp(self, now: float) -> Stamp:
        """The stamp to publish at ``now`` (the publisher's monotonic clock; called about once a
        second, so the stillness is under-counted by that period at most, and an episode measured
        by at most that period more than it lasted)."""
        count = self.count
        seen = self._seen
        if seen is None or count != seen.count:
            if seen is not None:
                self._ended(seen, now - seen.since)
            phase = self.phase  # read after the count: a phase changes before its advance
            self._seen = seen = _Seen(count, now, phase, self._epoch_ends if self._at_epoch_end else 0)
        return Stamp(count, max(0.0, now - seen.since), self.bound_s, self.phase)

    def _ended(self, seen: _Seen, still_s: float) -> None:
        if seen.phase == EVALUATING:
            self.longest_evaluation_s = max(self.longest_evaluation_s, still_s)
        elif seen.phase == BETWEEN and seen.epoch_end:
            longest = self._epoch_end_longest
            longest[seen.epoch_end] = max(longest.get(seen.epoch_end, 0.0), still_s)

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


@contextmanager
def evaluation_step(stamp: Optional[ProgressStamp]) -> Iterator[None]:
    """Around a validation step: judged inside by the rank's own longest evaluation step
    (assignments and adds only: no clock, no collective)."""
    if stamp is None:
        yield
        return
    stamp.enter_evaluation_step()
    try:
        yield
    finally:
        stamp.leave_evaluation_step()


def stall_verdict(stamp: Optional[Stamp], beat_age_s: float = 0.0,
                  witnessed_s: Optional[float] = None) -> Optional[str]:
    """Why the rank that published ``stamp`` is stalled, or None (nothing published yet, no bound
    now, still within it, or its heartbeat silent: ``beat_age_s`` ago it last moved, a case for
    the liveness timeout). In the phases of :data:`WITNESSED` the stillness must also have lasted
    the bound while the reader itself waited for the rank (``witnessed_s``, on the reader's clock:
    None, not witnessed)."""
    if stamp is None or stamp.bound_s is None or stamp.still_s < stamp.bound_s or beat_age_s > BEATING_S:
        return None
    if stamp.phase in WITNESSED and (witnessed_s is None or witnessed_s < stamp.bound_s):
        return None
    where = "" if stamp.phase == TRAINING else f" in its {stamp.phase}"
    return (f"stalled: alive (its heartbeat goes on) but no progress for {stamp.still_s:.1f} s{where} "
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
