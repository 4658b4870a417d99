"""What the engine keeps and tells: a round's outcome, the fit's counters and their snapshot.

Plain values, shared by the engine, the round driver, the monitor and the summary; nothing here
runs a round.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from lightning_elche.averaging import RoundWeights
from lightning_elche.convergence import Feedback
from lightning_elche.guard import DivergenceReport
from lightning_elche.rounds import RankReport, StopRequest


@dataclass(frozen=True)
class RoundOutcome:
    """What every rank learned from a round (identical on all ranks)."""

    index: int
    reports: tuple[RankReport, ...]
    weights: RoundWeights
    planned: tuple[int, ...]
    anchor: int
    overhead: float
    cohort_step: int
    epoch_over: bool
    stop_level: StopRequest
    budget_reached: bool
    divergence: Optional[DivergenceReport]
    feedback: Feedback
    reset_inner: bool
    consensus: bool = False  # a blocking round adopted with alpha 1: every replica holds the consensus
    dispatch_shares: tuple[float, ...] = ()
    """Each rank's share of the cohort's measured speed (the plan's counts until every rank has a
    reading), for the pooled dispatch: unlike ``planned`` not rounded to a window's whole batches."""
    idle: tuple[float, ...] = ()
    """Each rank's share of its fit time spent in rounds, up to this round. Kept with the outcome: a
    membership change may renumber the running totals before the outcome is published."""

    @property
    def epoch(self) -> int:
        """The epoch every rank was in at the round."""
        return self.reports[0].epoch if self.reports else 0

    @property
    def epoch_batches(self) -> tuple[int, ...]:
        """Batches each rank had started in :attr:`epoch` at the round (all trained by then)."""
        return tuple(r.epoch_batches for r in self.reports)

    @property
    def ends_window_sequence(self) -> bool:
        """No rank trains further in this epoch after this round."""
        return self.epoch_over or self.stop_level != StopRequest.NONE or self.budget_reached


@dataclass
class RankTotals:
    """Running totals per rank since the start of fit, for metrics and the summary."""

    steps: int = 0
    samples: int = 0
    compute_s: float = 0.0
    sync_s: float = 0.0
    stall_ms_sum: float = 0.0
    stalls: int = 0
    micro_batch: Optional[int] = None
    """The rank's micro-batch in samples as its last round reported it (None: not reported)."""


@dataclass(frozen=True)
class FitProgress:
    """A read-only snapshot of a fit's counters and plan, for callbacks, the summary and reports."""

    mode: str
    rounds: int
    cohort_step: int
    anchor: int
    plan: tuple[int, ...]
    epoch_batches: int
    """Batches per epoch over all ranks (0 until the training data is known)."""
    totals: tuple[RankTotals, ...]
    lost_totals: tuple[RankTotals, ...] = ()
    """Totals of the ranks lost during the fit, in the order they were lost."""


@dataclass
class EngineState:
    """Counters that survive across epochs (and, later, checkpoints)."""

    rounds: int = 0
    cohort_step: int = 0
    totals: list[RankTotals] = field(default_factory=list)
    lost_totals: list[RankTotals] = field(default_factory=list)
    """The totals of ranks lost during the fit, in the order they were lost."""
