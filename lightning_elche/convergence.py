"""The feedback half of a round: divergence → guard verdict → meta-controller → controller.

Runs identically on every rank (same gathered numbers, deterministic guard and meta-controller),
so every rank's controller takes the same decisions without another message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from lightning_elche.config import ElCheConfig
from lightning_elche.controller import ElCheController
from lightning_elche.guard import (
    ConvergenceGuard,
    DivergenceReport,
    NudgeDown,
    Stable,
    SuppressGrowth,
    Verdict,
    default_guard,
    guard_load_state_dict,
    guard_state_dict,
    guard_telemetry,
)
from lightning_elche.meta import MetaController

VERDICT_CODES = {Stable: 0.0, SuppressGrowth: 1.0, NudgeDown: 2.0}
META_ACTION_CODES = {"noop": 0.0, "lr_cliff": 1.0, "convergence": 2.0, "both": 3.0}


@dataclass(frozen=True)
class Feedback:
    """What the guard and the meta-controller decided at one round."""

    verdict: Verdict
    meta_action: str
    meta_factor: Optional[float]
    anchor_before: int
    anchor_after: int
    telemetry: dict[str, float]

    def metrics(self) -> dict[str, float]:
        out = {
            "elche/verdict": VERDICT_CODES[type(self.verdict)],
            "elche/meta_action": META_ACTION_CODES.get(self.meta_action, -1.0),
            "elche/meta_factor": 1.0 if self.meta_factor is None else float(self.meta_factor),
        }
        out.update({f"elche/guard/{k}": float(v) for k, v in self.telemetry.items()})
        return out


class ConvergenceControl:
    """Owns the run's convergence guard and (optional) LR-aware meta-controller.

    Args:
        config: the ElChe knobs (guard selection, ``meta_controller``, ``relax_up``).
        controller: the cadence controller the verdicts drive.
    """

    def __init__(self, config: ElCheConfig, controller: ElCheController) -> None:
        self.config = config
        self.controller = controller
        self.guard: ConvergenceGuard = default_guard(config)
        self.meta: Optional[MetaController] = MetaController() if config.meta_controller else None
        # relax_up only means something while a round is in flight (flodl honours it under Async only).
        self.relax_up = config.run_mode.relax_up

    def after_round(
        self, divergence: Optional[DivergenceReport], k_used: int, k_max: int, lr: Optional[float]
    ) -> Feedback:
        """Feed one round's divergence to the guard, let the meta-controller react, apply both.

        ``divergence`` is ``None`` when no measurement exists yet (first round, or no rank moved):
        the guard is not consulted, so its trend history only holds real measurements.
        """
        before = self.controller.anchor
        verdict: Verdict = Stable()
        if divergence is not None:
            verdict = self.guard.report(divergence, k_used, k_max)
        meta_action, meta_factor = "noop", None
        if self.meta is not None:
            nudge = self.meta.observe(lr, self.controller.anchor, verdict, int(self.controller.phase))
            meta_action, meta_factor = self.meta.last_action, self.meta.last_factor
            if nudge is not None:
                self.controller.apply_verdict(nudge)
        self.controller.apply_verdict(verdict, relax_up=self.relax_up)
        return Feedback(
            verdict=verdict,
            meta_action=meta_action,
            meta_factor=meta_factor,
            anchor_before=before,
            anchor_after=self.controller.anchor,
            telemetry=guard_telemetry(self.guard),
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "guard": guard_state_dict(self.guard),
            "meta": self.meta.state_dict() if self.meta is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        guard_load_state_dict(self.guard, state.get("guard") or {})
        if self.meta is not None and state.get("meta") is not None:
            self.meta.load_state_dict(state["meta"])
