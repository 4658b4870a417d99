"""The ElChe cadence controller: how many batches each rank runs per averaging window.

The slowest rank (the *anchor rank*) runs ``anchor`` batches per window; every other rank runs
proportionally more, so that all ranks reach the window's end at about the same time. After each
window the caller feeds the measured timing to :meth:`ElCheController.report_timing`; the
controller refines its per-rank speed estimates, re-elects the anchor rank once it trusts its
data, recomputes ``batch_counts`` and, when the per-window fixed cost (sync + pipeline fill) is a
large fraction of the window, stages a proposal to grow the anchor. Only a convergence verdict
(:meth:`ElCheController.apply_verdict`) ever changes the anchor: ``Stable`` commits the proposal,
``SuppressGrowth`` drops it, ``NudgeDown`` drops it and shrinks the anchor.

This is flodl 0.7.0's window-pressure controller (``elche-spec.md`` §3). It is pure and
deterministic: the strategy runs one copy on every rank and feeds each copy the same all-gathered
numbers, so every copy reaches the same decisions without further communication. The plan's
arithmetic is :mod:`lightning_elche.window_plan`, the checkpoint format
:mod:`lightning_elche.controller_state`; a change of the fit's ranks arrives through
:meth:`ElCheController.apply_change`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

from lightning_elche import window_plan as plan
from lightning_elche.checks import as_real, require_int
from lightning_elche.config import DEFAULT_MAX_ANCHOR, Dispatch, clamp_overhead_target
from lightning_elche.controller_state import Phase, SavedState
from lightning_elche.guard import NudgeDown, Stable, SuppressGrowth, Verdict
from lightning_elche.membership.change import Change
from lightning_elche.speed_readings import SpeedReadings

if TYPE_CHECKING:
    from lightning_elche.config import ElCheConfig

GROWTH_REARM_STABLE = 5
"""Consecutive ``Stable`` verdicts that re-arm window growth after a non-``Stable`` one."""

CALIBRATION_WINDOWS = 2
"""The fit's first windows are short: the first, planned from no reading, and the second, planned
from the warm-up readings. Each costs the fast ranks a wait for the slowest one's window at a
guessed ratio; at the full anchor that was (speed gap - 1) x anchor fast batches. A window that
runs to the epoch's end ends the calibration: it was long, whatever the plan."""

CALIBRATION_ANCHOR = 2
"""Batches the anchor rank runs in a calibration window (when ``anchor`` is larger)."""

STABLE_AFTER_CALIBRATIONS = 5
MATURE_AFTER_CALIBRATIONS = 20


class ElCheController:
    """Per-rank batch counts for heterogeneous local SGD, tuned from measured timing.

    Args:
        world_size: number of ranks (>= 2).
        anchor: batches the slowest rank runs per window at the start (>= 1).
        min_anchor: growth floor (default ``anchor``; at least 1, at most ``max_anchor``); an
            anchor below it is lifted to it. ``NudgeDown`` may go below it.
        max_anchor: growth ceiling (default 1000, at least 1).
        overhead_target: per-window fixed cost (sync + fill) as a fraction of the anchor rank's
            window wall that growth aims for (default 0.05, clamped to [0.01, 0.5]).
        max_batch_diff: largest change of a rank's count per recompute, and the spread limit of
            :meth:`relax_anchor_up` (None = unlimited, 0 = lockstep).
        window_growth_applicable: False for the sync modes, which have no window to amortize.
        initial_anchor_rank: soft pin of the slow rank before there is timing data (held until
            Stable).
        pooled_dispatch: the ranks claim the epoch's batches from a shared pool (cadence and
            async modes without ``partition_ratios``): a window whose plan covers what is left of
            the epoch then runs every rank to the epoch's end (:meth:`planned_batches`).

    Raises:
        ValueError: naming the argument, for ``world_size < 2``, ``anchor < 1`` and other values
            that cannot be used.
    """

    def __init__(
        self,
        world_size: int,
        anchor: int,
        *,
        min_anchor: Optional[int] = None,
        max_anchor: Optional[int] = None,
        overhead_target: Optional[float] = None,
        max_batch_diff: Optional[int] = None,
        window_growth_applicable: bool = True,
        initial_anchor_rank: Optional[int] = None,
        pooled_dispatch: bool = False,
    ) -> None:
        world_size = _require_int("world_size", world_size, 2, "ElChe needs at least 2 ranks")
        anchor = _require_int("anchor", anchor, 1, "expected an integer >= 1")
        if max_batch_diff is not None:
            max_batch_diff = _require_int(
                "max_batch_diff", max_batch_diff, 0, "expected None or an integer >= 0"
            )
        self.world_size: int = world_size
        self._max_anchor = max(1, _int_or("max_anchor", max_anchor, DEFAULT_MAX_ANCHOR))
        self._min_anchor = min(max(1, _int_or("min_anchor", min_anchor, anchor)), self._max_anchor)
        self.anchor: int = min(max(anchor, self._min_anchor), self._max_anchor)
        self._overhead_target = _clamp_target(overhead_target)
        self._max_batch_diff = max_batch_diff
        self._window_growth_applicable = bool(window_growth_applicable)
        self._pooled_dispatch = bool(pooled_dispatch)
        self._max_total_batches = 0
        self._epoch_batches_left: Optional[int] = None
        self._round_before_epoch_end = False

        self.batch_counts: list[int] = [self.anchor] * world_size
        self._readings = SpeedReadings(world_size)

        self.anchor_rank: Optional[int] = None
        self.phase: Phase = Phase.PROBE
        self.calibrated: bool = False
        self.calibration_count: int = 0
        self._calibration_windows_left = CALIBRATION_WINDOWS
        self.proposed_anchor: Optional[int] = None
        self.growth_enabled: bool = True
        self.consecutive_stable: int = 0
        self.window_cap_binding: bool = False
        self.last_overhead: float = 0.0

        if initial_anchor_rank is not None:
            self.anchor_rank = self._checked_rank("initial_anchor_rank", initial_anchor_rank)
        self._initial_anchor_rank = self.anchor_rank  # the pin a resized resume starts from

    @classmethod
    def from_config(cls, config: ElCheConfig, world_size: int) -> ElCheController:
        """The controller that ``config`` describes for ``world_size`` ranks.

        With ``partition_ratios`` the rank with the smallest share (lowest index on ties) is
        pinned as the initial anchor rank; the sync modes get no window growth.
        """
        config.validate_world_size(world_size)
        initial_anchor_rank: Optional[int] = None
        ratios = config.partition_ratios
        if ratios is not None:
            initial_anchor_rank = min(range(len(ratios)), key=lambda rank: ratios[rank])
        return cls(
            world_size,
            config.resolved_anchor,
            min_anchor=config.resolved_min_anchor,
            max_anchor=config.resolved_max_anchor,
            overhead_target=config.resolved_overhead_target,
            max_batch_diff=config.max_batch_diff,
            window_growth_applicable=config.run_mode.window_growth,
            initial_anchor_rank=initial_anchor_rank,
            pooled_dispatch=config.run_mode.dispatch is Dispatch.POOL,
        )

    # -- knobs (read-only: fixed at construction) -----------------------------------------

    @property
    def min_anchor(self) -> int:
        """Floor for window growth (not for nudges)."""
        return self._min_anchor

    @property
    def max_anchor(self) -> int:
        """Ceiling for window growth and :meth:`relax_anchor_up`."""
        return self._max_anchor

    @property
    def overhead_target(self) -> float:
        """Target fixed-cost fraction of the anchor rank's window, after clamping."""
        return self._overhead_target

    @property
    def max_batch_diff(self) -> Optional[int]:
        """Per-recompute change limit of each count (None = unlimited)."""
        return self._max_batch_diff

    @property
    def window_growth_applicable(self) -> bool:
        """Whether growth proposals can happen at all (False for the sync modes)."""
        return self._window_growth_applicable

    @property
    def max_total_batches(self) -> int:
        """Cap on ``sum(batch_counts)`` applied at every recompute; 0 = no cap."""
        return self._max_total_batches

    @max_total_batches.setter
    def max_total_batches(self, value: int) -> None:
        self._max_total_batches = _require_int(
            "max_total_batches", value, 0, "expected an integer >= 0 (0 = no cap)"
        )

    def set_epoch_size(self, num_batches: int) -> None:
        """Batches per epoch over all ranks: no window may plan more (at least one per rank)."""
        num_batches = _require_int("num_batches", num_batches, 0, "expected an integer >= 0")
        self.max_total_batches = max(num_batches, self.world_size)

    def set_epoch_batches_left(self, batches: Optional[int]) -> None:
        """Batches of the current epoch that no rank has started yet, at the start of the next
        window (None: unknown). Every rank must pass the same number (the engine derives it from
        a round's gathered reports)."""
        if batches is not None:
            batches = _require_int("batches", batches, 0, "expected None or an integer >= 0")
        self._epoch_batches_left = batches

    def keep_a_round_before_the_epoch_end(self, keep: bool) -> None:
        """While ``keep``, no window reaches the epoch's end: the plan leaves at least half of the
        batches left to a later window, so a round comes while every rank still has data (an
        admission needs one; with the pooled dispatch a long anchor otherwise makes each epoch one
        window). Every rank must set it at the same outcome."""
        self._round_before_epoch_end = bool(keep)

    def window_counts(self) -> list[int]:
        """Each rank's batches in the current window before the epoch's end and ``max_batch_diff``
        are applied: ``batch_counts``, scaled to an anchor of :data:`CALIBRATION_ANCHOR` in the
        fit's first :data:`CALIBRATION_WINDOWS` windows, so that a plan from no or from warm-up
        readings is soon replaced by a measured one."""
        counts = list(self.batch_counts)
        if self._calibration_windows_left <= 0 or self.anchor <= CALIBRATION_ANCHOR:
            return counts
        return [max(1, plan.round_half_away(count * CALIBRATION_ANCHOR / self.anchor)) for count in counts]

    @property
    def window_reaches_epoch_end(self) -> bool:
        """The plan (``batch_counts``, at the full anchor) covers every batch left in the epoch,
        and the pooled dispatch shares them out: every rank runs to the epoch's end (see
        :meth:`planned_batches`)."""
        left = self._epoch_batches_left
        if (not self._pooled_dispatch or self._max_batch_diff is not None or left is None or left <= 0
                or self._round_before_epoch_end):
            return False
        # Before any reading, the window at the full anchor: when that reaches the epoch's end no
        # calibration round is needed, the pool shares the epoch out as the ranks claim it. After
        # warm-up readings, the calibration window: their shares are too rough to hand out the
        # rest of the epoch by.
        counts = self.batch_counts if not self.calibrated else self.window_counts()
        return sum(counts) >= left

    def planned_batches(self, rank: int) -> int:
        """Batches ``rank`` runs in the current window (:meth:`window_counts`).

        ``max_batch_diff = D`` also bounds the lead of any rank over the slowest plan to D batches
        (0 is strict lockstep), on top of the per-update clamp: the plan may jump to the measured
        ratio at its first calibration, the lead bound never lets a rank run that far ahead.

        When the window reaches the epoch's end (:attr:`window_reaches_epoch_end`), every rank
        plans all the batches left: the pool shares them by speed, and each rank joins the round
        when it runs out of data. Closing the window at a rank's count instead would end it a
        batch or two before the epoch does, with the slow rank's next batch already claimed and
        fetched, and every other rank, out of data, waiting a whole slow batch for it.
        """
        rank = self._checked_rank("rank", rank)
        if self.window_reaches_epoch_end:
            assert self._epoch_batches_left is not None
            return self._epoch_batches_left
        counts = self.window_counts()
        lead = self._max_batch_diff
        planned = counts[rank] if lead is None else min(counts[rank], min(counts) + lead)
        left = self._epoch_batches_left
        if self._round_before_epoch_end and left is not None and 2 * sum(counts) > left:
            planned = min(planned, max(1, counts[rank] * (left // 2) // sum(counts)))
        return planned

    # -- timing feed ----------------------------------------------------------------------

    def report_timing(
        self,
        wall_ms: Sequence[float],
        batches: Sequence[int],
        sync_ms: float,
        fill_ms: Optional[Sequence[float]] = None,
    ) -> None:
        """Feed one window's timing; call once per averaging round, before the verdict.

        ``wall_ms[r]`` is rank r's wall time over the ``batches[r]`` batches it actually ran since
        the last sync; ``sync_ms`` the wall of the sync that closed the window; ``fill_ms[r]``
        (optional) rank r's first-batch excess over its marginal rate. A rank with no batches or
        no positive finite wall contributes no reading. Updates speeds, the anchor rank,
        ``batch_counts``, the phase and ``proposed_anchor``; never the anchor itself.

        Raises:
            ValueError: if a sequence's length is not ``world_size``.
        """
        self._require_per_rank("wall_ms", wall_ms)
        self._require_per_rank("batches", batches)
        if fill_ms is not None:
            self._require_per_rank("fill_ms", fill_ms)
        self.last_overhead = 0.0
        ran_to_epoch_end = self.window_reaches_epoch_end
        self._readings.ingest(wall_ms, batches)
        if self.anchor_rank is None or self.phase >= Phase.STABLE:
            elected = self._elect_anchor_rank()
            if elected is not None:
                self.anchor_rank = elected
        if self.anchor_rank is None:
            return
        slow_ms = self._resolve_slow_ms(self.anchor_rank)
        if slow_ms <= 0.0:
            return

        fill_b = 0.0
        if fill_ms is not None:
            fill_b = _finite_non_negative(float(fill_ms[self.anchor_rank]))
        overhead = plan.window_overhead(self.anchor, slow_ms, _finite_non_negative(float(sync_ms)), fill_b)
        self.last_overhead = 0.0 if overhead is None else overhead
        self.proposed_anchor = None
        if self.phase >= Phase.STABLE or (
            self.phase == Phase.WARMUP and self.calibration_count >= 1
        ):
            rounding = plan.rounding_idle(self.anchor, self._speeds_ms(), slow_ms)
            self.proposed_anchor = self._propose_growth(overhead, rounding)

        # Counts follow the current anchor; a proposal only lands through a verdict.
        self._recompute_batch_counts(slow_ms)
        self.calibrated = True
        self.calibration_count += 1
        self._calibration_windows_left = 0 if ran_to_epoch_end else self._calibration_windows_left - 1
        self._advance_phase()

    def _resolve_slow_ms(self, anchor_rank: int) -> float:
        """The anchor rank's ms/batch; re-elects among ranks with data when a pinned anchor rank
        has been silent for a whole trust window (else the controller would never calibrate)."""
        slow_ms = self.smoothed_ms(anchor_rank)
        if slow_ms > 0.0 or not self._readings.silent_for_trust_window(anchor_rank):
            return slow_ms
        elected = self._elect_anchor_rank()
        if elected is None:
            return 0.0
        self.anchor_rank = elected
        return self.smoothed_ms(elected)

    # -- anchor-rank election -------------------------------------------------------------

    def _elect_anchor_rank(self) -> Optional[int]:
        return plan.elect_anchor_rank(self._speeds_ms(), self.anchor_rank)

    # -- window-pressure growth -----------------------------------------------------------

    def _propose_growth(self, overhead: Optional[float], rounding_idle: float = 0.0) -> Optional[int]:
        """The grown anchor that ``overhead`` (or the counts' ``rounding_idle``) calls for, or
        None. Grow-only by design."""
        if not self._window_growth_applicable or not self.growth_enabled:
            return None
        # At the cap a larger anchor would not enlarge the window, only detach it from the anchor.
        if self.window_cap_binding or (overhead is None and rounding_idle <= 0.0):
            return None
        return plan.grown_anchor(self.anchor, overhead, self._overhead_target, self.phase < Phase.STABLE,
                                 self._min_anchor, self._max_anchor, rounding_idle)

    # -- batch counts ---------------------------------------------------------------------

    def _recompute_batch_counts(self, slow_ms: float) -> None:
        """Counts proportional to speed relative to the anchor rank, then the window cap."""
        counts = plan.follow_speeds(self.batch_counts, self._speeds_ms(), slow_ms, self.anchor,
                                    self._max_batch_diff, self.calibrated)
        self.batch_counts, self.window_cap_binding = plan.capped(counts, self._max_total_batches)

    # -- verdicts -------------------------------------------------------------------------

    def apply_verdict(self, verdict: Verdict, relax_up: bool = False) -> None:
        """Apply a convergence verdict (guard or meta-controller): the only way the anchor moves
        apart from :meth:`nudge_anchor_down` and :meth:`relax_anchor_up`.

        ``Stable`` counts toward re-arming growth, commits a pending proposal and, with
        ``relax_up``, then adds one to the anchor. ``SuppressGrowth`` drops the proposal and
        latches growth off. ``NudgeDown`` drops the proposal, latches growth off, then shrinks.
        """
        if isinstance(verdict, Stable):
            self._commit_proposal()
            if relax_up:
                self.relax_anchor_up()
        elif isinstance(verdict, SuppressGrowth):
            self._latch_growth_off()
        elif isinstance(verdict, NudgeDown):
            # Drop first: the proposal was sized from the pre-nudge anchor, and a Stable verdict
            # later in the same cycle would otherwise commit it over the nudge.
            self._latch_growth_off()
            self.nudge_anchor_down(verdict.factor)
        else:
            raise TypeError(
                f"verdict={verdict!r} is invalid: expected Stable, SuppressGrowth or NudgeDown."
            )

    def _commit_proposal(self) -> None:
        self.consecutive_stable += 1
        if self.consecutive_stable >= GROWTH_REARM_STABLE:
            self.growth_enabled = True
        if self.proposed_anchor is None:
            return
        self.anchor = self.proposed_anchor
        self.proposed_anchor = None
        self._recompute_if_timed()

    def _latch_growth_off(self) -> None:
        self.proposed_anchor = None
        self.consecutive_stable = 0
        self.growth_enabled = False

    def nudge_anchor_down(self, factor: float) -> None:
        """Multiply the anchor by ``factor`` clamped to [0.1, 1] (rounded up, at least 1).

        Never increases the anchor; may go below ``min_anchor``. A non-finite factor is ignored.
        """
        if not math.isfinite(factor):
            return
        shrunk = math.ceil(self.anchor * min(max(factor, 0.1), 1.0))
        self.anchor = max(1, min(self.anchor, shrunk))
        self._recompute_if_timed()

    def relax_anchor_up(self) -> bool:
        """Add one to the anchor unless at ``max_anchor`` or, with ``max_batch_diff`` set, the
        fastest rank's projected count would then exceed the anchor by more than it.

        Returns whether the anchor grew.
        """
        if self.anchor >= self._max_anchor:
            return False
        grown = self.anchor + 1
        limit = self._max_batch_diff
        if limit is not None and plan.projected_spread(grown, self._speeds_ms()) > limit:
            return False
        self.anchor = grown
        self._recompute_if_timed()
        return True

    def _recompute_if_timed(self) -> None:
        slow_ms = self._slow_ms()
        if slow_ms > 0.0:
            self._recompute_batch_counts(slow_ms)

    # -- phase ----------------------------------------------------------------------------

    def _advance_phase(self) -> None:
        if self.phase == Phase.PROBE:
            self.phase = Phase.WARMUP
        elif self.phase == Phase.WARMUP and self.calibration_count >= STABLE_AFTER_CALIBRATIONS:
            self.phase = Phase.STABLE
        elif self.phase == Phase.STABLE and self.calibration_count >= MATURE_AFTER_CALIBRATIONS:
            self.phase = Phase.MATURE

    # -- derived outputs ------------------------------------------------------------------

    def smoothed_ms(self, rank: int) -> float:
        """Mean ms/batch of ``rank``'s recent readings; 0.0 when it has none."""
        mean = self._readings.mean(self._checked_rank("rank", rank))
        return 0.0 if mean is None else mean

    def speed_shares(self) -> Optional[list[float]]:
        """Each rank's share of the cohort's measured speed (batches per second, summing to 1),
        or None until every rank has a reading. Unlike ``batch_counts`` it is not rounded to whole
        batches of a window: the pooled dispatch shares out the epoch with it."""
        speeds = self._speeds_ms()
        if any(ms <= 0.0 for ms in speeds):
            return None
        rates = [1.0 / ms for ms in speeds]
        return [rate / sum(rates) for rate in rates]

    def _speeds_ms(self) -> list[float]:
        return [self.smoothed_ms(rank) for rank in range(self.world_size)]

    def smoothed_ms_or_none(self, rank: int) -> Optional[float]:
        """Like :meth:`smoothed_ms`, but None when ``rank`` has no reading."""
        return self._readings.mean(self._checked_rank("rank", rank))

    def _slow_ms(self) -> float:
        return 0.0 if self.anchor_rank is None else self.smoothed_ms(self.anchor_rank)

    # -- membership -----------------------------------------------------------------------

    def apply_change(self, change: Change) -> None:
        """Follow a change of the fit's ranks (:class:`~lightning_elche.membership.Change`).

        The survivors keep their speed readings and counts, renumbered in their new order, so the
        next report re-plans them from what was measured; an anchor rank that was lost is elected
        again from that report. A joiner starts as a rank whose reading is unknown: no reading, the
        anchor's count, and the fit's short calibration windows again, so that its first measured
        window soon replaces the guess. A single survivor is allowed here (it averages with
        nobody, but keeps its cadence).
        """
        if change.world_size_before != self.world_size:
            raise ValueError(
                f"ElCheController.apply_change(change=Change(before={list(change.before)}, ...)) is invalid: expected "
                f"a change of this controller's {self.world_size} ranks; pass the change agreed for the fit's current "
                "ranks (the retained ranks are numbered as before it, the joiners after them)."
            )
        self.batch_counts = change.carry(self.batch_counts, lambda: self.anchor)
        self._readings.apply_change(change)
        # The lost ranks' untrained batches come back to the epoch and joiners take a share: what
        # is left is unknown until the next round.
        self._epoch_batches_left = None
        self.anchor_rank = change.new_rank(self.anchor_rank) if self.anchor_rank is not None else None
        initial = self._initial_anchor_rank
        self._initial_anchor_rank = change.new_rank(initial) if initial is not None else None
        self.world_size = change.world_size_after
        self.proposed_anchor = None
        if change.joined:
            self._calibration_windows_left = CALIBRATION_WINDOWS

    # -- checkpointing --------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The trajectory state, as JSON-ready plain values (no user knobs, no pending proposal)."""
        return SavedState(
            world_size=self.world_size,
            anchor=self.anchor,
            anchor_rank=self.anchor_rank,
            smoothed_ms=tuple(self.smoothed_ms_or_none(rank) for rank in range(self.world_size)),
            phase=self.phase,
            calibration_count=self.calibration_count,
            batch_counts=tuple(self.batch_counts),
            growth_enabled=self.growth_enabled,
            consecutive_stable=self.consecutive_stable,
        ).to_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`; knobs stay as constructed.

        With the saved world size, each rank's readings restart as one sample equal to the saved
        mean. A state saved with another number of ranks (a restart on fewer or more devices)
        keeps what describes the run rather than its ranks (anchor, phase, calibration count,
        growth latch and stable streak) and recalibrates the per-rank part: speeds are cleared,
        every rank plans ``anchor`` batches until the first report, and the anchor rank is the
        constructed one (the ``partition_ratios`` pin, or elected from the first report). Rank
        numbers of a resized run need not name the same devices, so no per-rank value is carried.

        Raises:
            ValueError: on a malformed entry, naming the key.
        """
        saved = SavedState.parse(state)
        self.anchor = saved.anchor
        self.phase = saved.phase
        self.calibration_count = saved.calibration_count
        self.growth_enabled = saved.growth_enabled
        self.consecutive_stable = saved.consecutive_stable
        self.proposed_anchor = None
        self._epoch_batches_left = None  # the resumed epoch's first round tells
        self._calibration_windows_left = 0  # recalibrated below when the world size changed
        if saved.world_size != self.world_size:
            self._readings.restart([None] * self.world_size)
            self.anchor_rank = self._initial_anchor_rank
            self.batch_counts = [self.anchor] * self.world_size
            self.window_cap_binding = False
            self.calibrated = False  # the first report sets the counts from the new ranks' speeds
            self._calibration_windows_left = CALIBRATION_WINDOWS
            return
        self.anchor_rank = saved.anchor_rank
        self.batch_counts = list(saved.batch_counts)
        self._readings.restart(saved.smoothed_ms)
        self.calibrated = self._readings.any()

    # -- argument checks ------------------------------------------------------------------

    def _checked_rank(self, name: str, rank: int) -> int:
        allowed = f"expected a rank in 0..{self.world_size - 1}"
        number = _require_int(name, rank, 0, allowed)
        if number >= self.world_size:
            raise ValueError(f"{name}={rank!r} is invalid: {allowed}.")
        return number

    def _require_per_rank(self, name: str, values: Sequence[Any]) -> None:
        if len(values) != self.world_size:
            raise ValueError(
                f"{name} has {len(values)} entries: expected one per rank ({self.world_size})."
            )


def _require_int(name: str, value: Any, minimum: int, allowed: str) -> int:
    return require_int(f"{name}={value!r}", value, minimum, allowed)


def _finite_non_negative(value: float) -> float:
    """``value`` when it is a finite number > 0, else 0.0 (no signal)."""
    return value if math.isfinite(value) and value > 0.0 else 0.0


def _is_finite_number(value: Any) -> bool:
    return as_real(value) is not None


def _int_or(name: str, value: Optional[int], default: int) -> int:
    if value is None:
        return default
    return _require_int(name, value, 1, "expected None or an integer >= 1")


def _clamp_target(target: Optional[float]) -> float:
    if target is not None and not _is_finite_number(target):
        raise ValueError(f"overhead_target={target!r} is invalid: expected a finite number.")
    return clamp_overhead_target(target)

