"""The console table printed at the end of ``fit``, and who each of its rows is."""

from __future__ import annotations

from collections.abc import Sequence

from lightning_elche.engine import FitProgress, RankTotals
from lightning_elche.membership.change import Change


class FitMembers:
    """Who each rank of a fit is, following its membership changes (a ``ChangeHolder``).

    ``members[k]`` is the member id of current rank ``k`` (its launch rank, or the id it joined
    under); ``lost`` and ``joined`` are member ids, in the order the changes named them.
    """

    def __init__(self, members: Sequence[int]) -> None:
        self.members: list[int] = list(members)
        self.lost: list[int] = []
        self.joined: list[int] = []

    def apply_change(self, change: Change) -> None:
        if list(change.before) != self.members:
            raise ValueError(
                f"FitMembers.apply_change(change=Change(before={list(change.before)}, ...)) is invalid: expected a "
                f"change of the current members {self.members} (a change was missed or applied twice)."
            )
        self.lost.extend(change.lost_ids)  # old rank order: the order the engine keeps their totals in
        self.joined.extend(change.joined_ids)
        self.members = list(change.after)

    @property
    def joined_ranks(self) -> list[int]:
        """Current ranks of the members that joined during the fit."""
        return [k for k, member in enumerate(self.members) if member in self.joined]


def format_summary(progress: FitProgress, lost_ranks: Sequence[int] = (), joined_ranks: Sequence[int] = ()) -> str:
    """Per-rank work, throughput and idle share of this fit, plus the controller's state.

    The syncs and cohort steps in the header count the whole training run (a resumed fit
    continues the checkpoint's counters); the per-rank rows count this fit only. After a resume
    the header says how many of the run's steps this fit took, so the two never disagree silently.
    Ranks lost during the fit (``lost_ranks``: their original numbers, in the order they were lost)
    get a row each below the survivors, labelled ``lost<rank>``; the survivors are numbered anew.
    Ranks that joined during the fit (``joined_ranks``: their current numbers, as
    :attr:`FitMembers.joined_ranks` gives them) are marked ``<rank>+``: their rows count from their join.
    A fit with ``micro_batch`` set gets a last column, each rank's micro-batch in samples as its rounds
    reported it (``-``: none reported).
    """
    fit_steps = sum(t.steps for t in progress.totals) + sum(t.steps for t in progress.lost_totals)
    total_steps = fit_steps or 1
    if progress.cohort_step != fit_steps:
        steps = (f"{progress.cohort_step} cohort steps since the run started ({fit_steps} in this fit, "
                 f"resumed at cohort step {progress.cohort_step - fit_steps})")
        rows = "this fit"
    else:
        steps = f"{progress.cohort_step} cohort steps"
        rows = "the whole run"
    every = (*progress.totals, *progress.lost_totals)
    micro = any(t.micro_batch is not None for t in every)
    lines = [
        f"ElChe summary: mode {progress.mode}, {progress.rounds} syncs, {steps}, final anchor {progress.anchor}, "
        f"window plan {list(progress.plan)}",
        f"{'rank':>6} {'steps':>8} {'share':>7} {'samples':>9} {'samples/s':>10} {'idle':>6}"
        + (f" {'micro':>6}" if micro else "")
        + f"   (rows: {rows}; samples/s over compute time; idle = time in syncs / (compute + syncs)"
        + ("; micro = samples per forward and backward, micro_batch)" if micro else ")"),
    ]
    labels = [f"{rank}+" if rank in joined_ranks else str(rank) for rank in range(len(progress.totals))]
    labels += [f"lost{rank}" for rank in lost_ranks] or [f"lost{k}" for k in range(len(progress.lost_totals))]
    for label, totals in zip(labels, every, strict=False):
        lines.append(_row(label, totals, total_steps, micro))
    if progress.lost_totals:
        lines.append(f"{len(progress.lost_totals)} rank(s) lost during the fit; the survivors were renumbered.")
    joined = [rank for rank in joined_ranks if rank < len(progress.totals)]
    if joined:
        lines.append(f"{len(joined)} rank(s) joined during the fit (marked +); their rows count from their join.")
    return "\n".join(lines)


def _row(label: str, totals: RankTotals, total_steps: int, micro: bool) -> str:
    busy = totals.compute_s + totals.sync_s
    rate = totals.samples / totals.compute_s if totals.compute_s > 0 else 0.0
    idle = totals.sync_s / busy if busy > 0 else 0.0
    row = (f"{label:>6} {totals.steps:>8} {totals.steps / total_steps:>7.1%} {totals.samples:>9} "
           f"{rate:>10.1f} {idle:>6.1%}")
    if micro:
        row += f" {'-' if totals.micro_batch is None else totals.micro_batch:>6}"
    return row
