"""The cadence controller's lifecycle phase and its checkpointed state: the one place that writes
and reads the format of :meth:`ElCheController.state_dict <lightning_elche.controller.ElCheController.state_dict>`.

A saved state is plain JSON-ready values. :meth:`SavedState.parse` checks every entry before the
controller takes any of them, so a malformed checkpoint fails naming its first bad key and leaves
the controller as it was.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Optional

from lightning_elche.checks import as_real, require_int


class Phase(enum.IntEnum):
    """Lifecycle of the controller; it only ever moves forward.

    PROBE: no successful report yet. WARMUP: after the first one; the anchor-rank pin holds and
    only unambiguous window pressure may propose growth. STABLE: after 5; the anchor rank may be
    re-elected and growth fires at the plain target. MATURE: after 20; same as STABLE inside the
    controller (the meta-controller reads it).
    """

    PROBE = 0
    WARMUP = 1
    STABLE = 2
    MATURE = 3


@dataclass(frozen=True)
class SavedState:
    """A controller's trajectory state; per-rank entries fit its own ``world_size``."""

    world_size: int
    anchor: int
    anchor_rank: Optional[int]
    smoothed_ms: tuple[Optional[float], ...]
    """Each rank's mean ms/batch (None: no reading)."""
    phase: Phase
    calibration_count: int
    batch_counts: tuple[int, ...]
    growth_enabled: bool
    consecutive_stable: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "anchor": self.anchor,
            "anchor_rank": self.anchor_rank,
            "smoothed_ms": list(self.smoothed_ms),
            "phase": int(self.phase),
            "calibration_count": self.calibration_count,
            "batch_counts": list(self.batch_counts),
            "growth_enabled": self.growth_enabled,
            "consecutive_stable": self.consecutive_stable,
        }

    @classmethod
    def parse(cls, state: dict[str, Any]) -> SavedState:
        """Raise ValueError naming the first entry that is malformed or disagrees with the state's
        own ``world_size``."""
        # 1: saved by the last survivor of lost ranks (ElChe itself needs 2 ranks to start).
        world_size = _require_int("state['world_size']", state.get("world_size"), 1, "expected an integer >= 1")
        smoothed = state.get("smoothed_ms")
        if not isinstance(smoothed, list) or len(smoothed) != world_size:
            raise ValueError(
                f"state['smoothed_ms']={smoothed!r} is invalid: expected one entry per saved rank ({world_size})."
            )
        anchor_rank = state.get("anchor_rank")
        if anchor_rank is not None:
            anchor_rank = _require_int(
                "state['anchor_rank']", anchor_rank, 0, f"expected None or 0..{world_size - 1}"
            )
            if anchor_rank >= world_size:
                raise ValueError(
                    f"state['anchor_rank']={anchor_rank} is invalid: expected None or "
                    f"0..{world_size - 1}."
                )
        counts = state.get("batch_counts")
        if not isinstance(counts, list) or len(counts) != world_size:
            raise ValueError(
                f"state['batch_counts']={counts!r} is invalid: expected {world_size} integers >= 1."
            )
        return cls(
            world_size=world_size,
            anchor=_require_int("state['anchor']", state.get("anchor"), 1, "expected an int >= 1"),
            anchor_rank=anchor_rank,
            smoothed_ms=tuple(_saved_mean(value) for value in smoothed),
            phase=_saved_phase(state.get("phase")),
            calibration_count=_require_int(
                "state['calibration_count']", state.get("calibration_count"), 0, "expected >= 0"
            ),
            batch_counts=tuple(
                _require_int("state['batch_counts']", count, 1, "expected integers >= 1")
                for count in counts
            ),
            growth_enabled=bool(state.get("growth_enabled", True)),
            consecutive_stable=_require_int(
                "state['consecutive_stable']",
                state.get("consecutive_stable", 0),
                0,
                "expected >= 0",
            ),
        )


def _require_int(name: str, value: Any, minimum: int, allowed: str) -> int:
    return require_int(f"{name}={value!r}", value, minimum, allowed)


def _saved_mean(value: Any) -> Optional[float]:
    if value is None:
        return None
    number = as_real(value)
    if number is None or number < 0.0:
        raise ValueError(
            f"state['smoothed_ms'] entry {value!r} is invalid: expected None or a finite ms >= 0."
        )
    return number


def _saved_phase(value: Any) -> Phase:
    try:
        return Phase(value)
    except ValueError:
        allowed = ", ".join(str(int(p)) for p in Phase)
        raise ValueError(
            f"state['phase']={value!r} is invalid: expected one of {allowed}."
        ) from None
