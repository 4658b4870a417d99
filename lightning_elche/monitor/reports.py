"""Sub-epoch reports: at most ``n`` logged points per epoch, fired at sync boundaries (spec §13.4).

At each sync the window's cohort steps are added to the epoch's work; a report fires when
``floor(work / (steps_per_epoch / n))`` exceeds the number already fired (capped at ``n``, at
most one per sync, reset every epoch).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

from lightning_elche.checks import require_int
from lightning_elche.membership.change import Change


class ReportScheduler:
    """Decides at which syncs of an epoch a sub-epoch report fires."""

    def __init__(self, per_epoch: int) -> None:
        per_epoch = require_int(f"reports_per_epoch={per_epoch!r}", per_epoch, 1)
        self.per_epoch = per_epoch
        self.steps_per_epoch = 1
        self.work = 0
        self.fired = 0

    def start_epoch(self, steps_per_epoch: int) -> None:
        self.steps_per_epoch = max(1, int(steps_per_epoch))
        self.work = 0
        self.fired = 0

    def add(self, steps: int) -> bool:
        """Account one sync's cohort steps; True when a report fires at this sync."""
        self.work += max(0, int(steps))
        interval = self.steps_per_epoch / self.per_epoch
        due = min(self.per_epoch, math.floor(self.work / interval + 1e-9))
        if due > self.fired:
            self.fired += 1
            return True
        return False


@dataclass
class ReportAccumulator:
    """Per-rank work since the last report, for interval means (loss) and rates (samples/s)."""

    world_size: int
    ranks: Optional[list[int]] = None
    """The label of each rank in the payload keys (its number at launch); default: 0, 1, ..."""
    steps: list[int] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    compute_s: list[float] = field(default_factory=list)
    loss_sum: list[float] = field(default_factory=list)
    sync_s: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.ranks is None:
            self.ranks = list(range(self.world_size))
        if len(self.ranks) != self.world_size:
            raise ValueError(f"ReportAccumulator(ranks={self.ranks!r}) names {len(self.ranks)} ranks, expected "
                             f"world_size={self.world_size}")
        self.reset()

    def apply_change(self, change: Change) -> None:
        """Follow a change of the fit's ranks: the survivors' rows in their new order, labelled as
        before; a joiner's row starts empty, labelled with its member id."""
        assert self.ranks is not None
        if change.world_size_before != self.world_size:
            raise ValueError(f"ReportAccumulator.apply_change(change=Change(before={list(change.before)}, ...)) is "
                             f"invalid: expected a change of the accumulator's {self.world_size} ranks.")
        self.ranks = [self.ranks[k] for k in change.survivors] + list(change.joined_ids)
        self.world_size = len(self.ranks)
        self.steps = change.carry(self.steps, lambda: 0)
        self.samples = change.carry(self.samples, lambda: 0)
        self.compute_s = change.carry(self.compute_s, lambda: 0.0)
        self.loss_sum = change.carry(self.loss_sum, lambda: 0.0)
        self.sync_s = change.carry(self.sync_s, lambda: 0.0)

    def reset(self) -> None:
        n = self.world_size
        self.steps, self.samples = [0] * n, [0] * n
        self.compute_s, self.loss_sum, self.sync_s = [0.0] * n, [0.0] * n, [0.0] * n

    def add(
        self,
        steps: Sequence[int],
        samples: Sequence[int],
        compute_s: Sequence[float],
        loss_sum: Sequence[float],
        sync_s: Sequence[float],
    ) -> None:
        for k in range(self.world_size):
            self.steps[k] += int(steps[k])
            self.samples[k] += int(samples[k])
            self.compute_s[k] += float(compute_s[k])
            self.loss_sum[k] += float(loss_sum[k])
            self.sync_s[k] += float(sync_s[k])

    def payload(self, prefix: str = "elche/report") -> dict[str, float]:
        """The report's scalars; keys of ranks that did no work in the interval are absent."""
        out: dict[str, float] = {}
        total_steps = sum(self.steps)
        loss: Optional[float] = None
        if total_steps > 0:
            loss = math.fsum(self.loss_sum) / total_steps
            out[f"{prefix}/loss"] = loss
        rate_total = 0.0
        assert self.ranks is not None
        for k, label in enumerate(self.ranks):
            if total_steps > 0:
                out[f"{prefix}/batch_share/rank{label}"] = self.steps[k] / total_steps
            if self.steps[k] > 0:
                out[f"{prefix}/loss/rank{label}"] = self.loss_sum[k] / self.steps[k]
            if self.compute_s[k] > 0 and self.samples[k] > 0:
                rate = self.samples[k] / self.compute_s[k]
                out[f"{prefix}/samples_per_s/rank{label}"] = rate
                rate_total += rate
        if rate_total > 0:
            out[f"{prefix}/samples_per_s"] = rate_total
        return out
