"""The console table printed at the end of ``fit``."""

from __future__ import annotations

from lightning_elche.engine import FitProgress


def format_summary(progress: FitProgress) -> str:
    """Per-rank work, throughput and idle share of this fit, plus the controller's state.

    The syncs and cohort steps in the header count the whole training run (a resumed fit
    continues the checkpoint's counters); the per-rank rows count this fit only. After a resume
    the header says how many of the run's steps this fit took, so the two never disagree silently.
    """
    fit_steps = sum(t.steps for t in progress.totals)
    total_steps = fit_steps or 1
    if progress.cohort_step != fit_steps:
        steps = (f"{progress.cohort_step} cohort steps since the run started ({fit_steps} in this fit, "
                 f"resumed at cohort step {progress.cohort_step - fit_steps})")
        rows = "this fit"
    else:
        steps = f"{progress.cohort_step} cohort steps"
        rows = "the whole run"
    lines = [
        f"ElChe summary: mode {progress.mode}, {progress.rounds} syncs, {steps}, final anchor {progress.anchor}, "
        f"window plan {list(progress.plan)}",
        f"{'rank':>4} {'steps':>8} {'share':>7} {'samples':>9} {'samples/s':>10} {'idle':>6}"
        f"   (rows: {rows}; samples/s over compute time; idle = time in syncs / (compute + syncs))",
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
