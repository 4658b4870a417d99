"""What the monitor reads of one sync round: every rank's numbers, as columns by current rank
(every rank's round outcome carries them all), and a logged value as a plain float."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from lightning_elche.rounds import RankReport

CORE_KEYS = ("loss", "samples_per_s", "batch_share", "steps", "samples", "compute_s", "sync_s")
"""The per-rank metrics of a sync record, in the order they are written."""


@dataclass(frozen=True)
class RoundColumns:
    """One round's per-rank numbers; ``None`` where a rank did no work to measure."""

    steps: list[int]
    samples: list[int]
    compute_s: list[float]
    sync_s: list[float]
    loss: list[Optional[float]]
    batch_share: list[Optional[float]]
    samples_per_s: list[Optional[float]]

    @classmethod
    def of(cls, reports: Sequence[RankReport]) -> RoundColumns:
        steps = [r.steps for r in reports]
        total = sum(steps)
        return cls(
            steps=steps,
            samples=[r.samples for r in reports],
            compute_s=[r.compute_s for r in reports],
            sync_s=[r.last_sync_s for r in reports],
            loss=[r.loss_sum / r.steps if r.steps > 0 else None for r in reports],
            batch_share=[s / total if total else None for s in steps],
            samples_per_s=[r.samples / r.compute_s if r.compute_s > 0 and r.samples > 0 else None for r in reports],
        )

    def as_record(self) -> dict[str, list[Any]]:
        """The ``per_rank`` entry of a sync record."""
        return dataclasses.asdict(self)

    def core(self, rank: int) -> dict[str, float]:
        """Rank ``rank``'s :data:`CORE_KEYS` that were measured."""
        values = {key: getattr(self, key)[rank] for key in CORE_KEYS}
        return {key: float(value) for key, value in values.items() if value is not None}


def logged_scalar(value: Any) -> Optional[float]:
    """A finite float from a logged value (0-d or 1-element tensor, number), else None."""
    try:
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                return None
            out = float(value.detach().reshape(()).to("cpu", torch.float64))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out = float(value)
        else:
            return None
    except (RuntimeError, TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None
