"""The console table printed at the end of ``fit``."""

from __future__ import annotations

from lightning_elche.engine import FitProgress


def format_summary(progress: FitProgress) -> str:
    """Per-rank work, throughput and idle share over the whole fit, plus the controller's state."""
    total_steps = sum(t.steps for t in progress.totals) or 1
    lines = [
        f"ElChe summary: mode {progress.mode}, {progress.rounds} syncs, "
        f"{progress.cohort_step} cohort steps, final anchor {progress.anchor}, "
        f"window plan {list(progress.plan)}",
        f"{'rank':>4} {'steps':>8} {'share':>7} {'samples':>9} {'samples/s':>10} {'idle':>6}"
        "   (samples/s over compute time; idle = time in syncs / (compute + syncs))",
    ]
    for rank, totals in enumerate(progress.totals):
        busy = totals.compute_s + totals.sync_s
        rate = totals.samples / totals.compute_s if totals.compute_s > 0 else 0.0
        idle = totals.sync_s / busy if busy > 0 else 0.0
        lines.append(
            f"{rank:>4} {totals.steps:>8} {totals.steps / total_steps:>7.1%} {totals.samples:>9} "
            f"{rate:>10.1f} {idle:>6.1%}"
        )
    return "\n".join(lines)
