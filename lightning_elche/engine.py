"""The per-window protocol every rank runs: count local steps, join rounds, adopt the plan.

A *round* is one fixed sequence of collectives that every rank joins: a small metadata
all-gather, then (if any rank moved) the averaging reduce. A rank decides locally, from a plan
all ranks agreed at the previous round, *when* it joins the next one: after its planned number
of optimizer steps, or when it runs out of data. From the gathered metadata every rank runs the
same deterministic controller on the same numbers, so the next plan needs no extra message.

Nothing here touches Lightning; the strategy calls :meth:`ElCheEngine.record_step`,
:meth:`window_due` and :meth:`run_round` from its hooks.
"""

from __future__ import annotations

import io
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any, Optional, Protocol

import torch
from torch import Tensor

from lightning_elche.averaging import relative_divergence
from lightning_elche.config import ElCheConfig
from lightning_elche.controller import ElCheController
from lightning_elche.convergence import ConvergenceControl
from lightning_elche.engine_state import EngineState, FitProgress, RankTotals, RoundOutcome
from lightning_elche.guard import DivergenceReport, NudgeDown, Stable
from lightning_elche.membership.agreement import RoundProgress
from lightning_elche.membership.change import Change, PeerFailure
from lightning_elche.outer import OuterAvg, OuterOptimizer
from lightning_elche.planes.base import AveragingPlane, RoundResult
from lightning_elche.rounds import META_SIZE, Meta, RankReport, StopRequest
from lightning_elche.timing import WindowClock

OVERSHOOT_INITIAL = 3
OVERSHOOT_CEILING = 15

__all__ = ["ElCheEngine", "EngineState", "FailedRoundHandler", "FitProgress", "RankTotals", "RoundOutcome"]


class FailedRoundHandler(Protocol):
    """Carries the fit on after a round failed on a lost peer (the survival module): agrees on the
    change and hands it to every holder, this engine included, before the round runs again."""

    def after_failed_round(self, failure: PeerFailure) -> Change: ...


class ElCheEngine:
    """Local step accounting and the round protocol of one rank.

    Args:
        config: the ElChe knobs.
        plane: the transport running exchanges and reduces.
        rank, world_size: this rank's index and the number of ranks.
        device: the rank's device (for the loss accumulator and timing).
        params: the live parameter tensors, checked for non-finite values at each round.
        signature: a number identifying the averaged layout (same on every rank).
        step_budget: stop once the cohort has taken this many optimizer steps (None: no budget).
        outer: the outer optimizer applied to each realized consensus (default: plain averaging).
        failures: what carries the fit on when a round fails on a lost peer (None: the failure
            ends the fit).
    """

    def __init__(
        self,
        config: ElCheConfig,
        plane: AveragingPlane,
        rank: int,
        world_size: int,
        device: torch.device,
        params: list[Tensor],
        signature: float,
        step_budget: Optional[int] = None,
        outer: Optional[OuterOptimizer] = None,
        failures: Optional[FailedRoundHandler] = None,
    ) -> None:
        self.config = config
        self.plane = plane
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.params = params
        self.signature = signature
        self.step_budget = step_budget
        self.controller = ElCheController.from_config(config, world_size)
        self.convergence = ConvergenceControl(config, self.controller)
        self.outer: OuterOptimizer = outer if outer is not None else OuterAvg()
        self._divergence: Optional[Tensor] = None
        self._in_flight = False
        self.run_mode = config.run_mode
        self.alpha = self.run_mode.blend_alpha
        self.max_overshoot = config.max_overshoot if config.max_overshoot is not None else OVERSHOOT_INITIAL
        self.state = EngineState(totals=[RankTotals() for _ in range(world_size)])
        self.clock = WindowClock(device, synchronize=self.run_mode.blocking or not plane.non_blocking)
        self.last_outcome: Optional[RoundOutcome] = None
        self._kept_batches: tuple[tuple[int, int], ...] = ()
        """(epoch, batches of it) per current rank at the last round: what each has in the consensus,
        renumbered by every change since (two changes may come without a round between them)."""
        self._consensus_next = False
        self._consensus_at: Optional[int] = None
        self._consensus_round = False
        self._carried_stop = StopRequest.NONE
        self._steps = 0
        self._samples = 0
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self._last_sync_s = 0.0
        self._lr = 0.0
        self._forced_stop = StopRequest.NONE
        self._epoch_continues = False
        self.failures = failures
        self._sent: Optional[Tensor] = None  # the metadata of the round in flight or last started
        self._caught_up = False
        self.admission: Optional[Callable[[], tuple[int, int]]] = None
        """(accepted joiners waiting, join requests read): rank 0's, once per round into its metadata."""
        self.knocks: tuple[Callable[[], bool], ...] = ()
        """End the window after the step in hand: a ready joiner's or a dead peer's round comes now (no I/O)."""
        self.micro_batch_size: Optional[Callable[[], Optional[int]]] = None
        """This rank's micro-batch in samples (None until known), read once per round into its metadata
        when the fit sets ``micro_batch``: every rank's choice reaches every rank without a collective."""

    # -- per step: no collective, no host sync --------------------------------------------

    @property
    def planned_steps(self) -> int:
        """Optimizer steps this rank runs in the current window (the controller's plan)."""
        return self.controller.planned_batches(self.rank)

    def record_step(self, samples: int, loss: Optional[Tensor], lr: float) -> None:
        """Account one local optimizer step (device-side loss accumulation only)."""
        self._steps += 1
        self._samples += samples
        self._lr = lr
        if isinstance(loss, Tensor):
            self._loss_sum.add_(loss.detach().to(torch.float64))

    def window_due(self) -> bool:
        if self._steps >= self.planned_steps:
            return True
        return self._steps > 0 and any(knock() for knock in self.knocks)

    @property
    def steps_in_window(self) -> int:
        """Optimizer steps this rank took since it last joined a round."""
        return self._steps

    def set_epoch_size(self, num_batches: int) -> None:
        """Batches per epoch over all ranks, once the training data is known (caps the window)."""
        self.controller.set_epoch_size(num_batches)
        if self.last_outcome is None:
            # Before this run's first round: the whole epoch is left (a resumed epoch's remainder is
            # smaller, which only keeps the first window at its planned counts).
            self.controller.set_epoch_batches_left(self.controller.max_total_batches)

    def start_epoch(self) -> None:  # the time between epochs (validation, saves) is not in the window
        self.clock.restart_window(after_sync=False)
        self.plane.start_epoch()

    def exclude_from_window(self, seconds: float) -> None:
        """Time this rank spent outside training inside the current window (a checkpoint at a sync
        point): not compute, so it must not make the rank look slower."""
        self.clock.exclude(seconds)

    def request_consensus(self, at_round: Optional[int] = None) -> None:
        """Every replica must hold the consensus after a round (a checkpoint follows): that round is
        then blocking and adopted with alpha 1, in every mode, and consumes the request.

        ``at_round``: the index of that round (the first round with an index at least this). Every
        rank names the same index, so every rank makes the same round a consensus round whatever its
        timing: in ``cpu_async`` a rank may already have started the round after an outcome when a
        listener of that outcome runs (the outcome of a round in flight arrives inside the next
        ``run_round``), so name a round at least two past the outcome at hand. ``None``: the next
        round this rank starts (only safe where no round can be in flight)."""
        if at_round is None:
            self._consensus_next = True
        else:
            self._consensus_at = at_round if self._consensus_at is None else min(self._consensus_at, at_round)

    # -- per round -------------------------------------------------------------------------

    @property
    def in_flight(self) -> bool:
        """A non-blocking round was started and not yet collected."""
        return self._in_flight

    def run_round(
        self,
        epoch: int,
        out_of_data: bool,
        stop_level: StopRequest = StopRequest.NONE,
        blocking: bool = True,
        epoch_batches: int = 0,
    ) -> list[RoundOutcome]:
        """Join one round at this rank's window boundary; returns the rounds completed by this call
        (:meth:`rounds_at_boundary`, run to its end).

        Blocking (every mode but ``cpu_async``, and any rank that is out of data): the round is
        started, completed and adopted here, and its outcome returned. Non-blocking: a round
        still in flight is completed first (its outcome is returned), then the new round starts
        and the rank goes back to training; :meth:`poll` completes it later.

        ``stop_level`` is this rank's stop request; an outcome carries the largest over all ranks.
        ``epoch_batches``: batches this rank started in the epoch (what a lost rank leaves trained).
        """
        return list(self.rounds_at_boundary(epoch, lambda: out_of_data, stop_level, blocking, epoch_batches))

    def rounds_at_boundary(
        self,
        epoch: int,
        out_of_data: Callable[[], bool],
        stop_level: StopRequest = StopRequest.NONE,
        blocking: bool = True,
        epoch_batches: int = 0,
    ) -> Iterator[RoundOutcome]:
        """:meth:`run_round`, yielding each outcome as soon as it is known: the round that was in
        flight before the next one starts. Its caller acts on that outcome while it still speaks of
        the current members; the next round may fail on a lost peer and renumber them.

        ``out_of_data`` is asked when the next round starts, after the caller acted on the in-flight
        one: that round may have lost a peer whose untrained work now comes to this rank, and a rank
        that reported itself out of data on its stale view would end the epoch without it."""
        compute_s = self.clock.close_window(self._steps)
        round_start = time.perf_counter()
        if self._in_flight:
            finished = self._finish()
            yield finished
            if finished.ends_window_sequence:
                return  # the round that was in flight already decided that nobody trains on
        # Read after finishing the in-flight round: its outcome may have asked for it.
        due = self._consensus_at is not None and self.state.rounds + 1 >= self._consensus_at
        if due:
            self._consensus_at = None
        self._consensus_round, self._consensus_next = self._consensus_next or due, False
        self._sent = self._local_metadata(epoch, out_of_data(), stop_level, compute_s, epoch_batches)
        self.plane.start(self._sent)
        self._reset_window()
        if blocking or self._consensus_round or not self.plane.non_blocking:
            outcome = self._finish()
            self.clock.restart_window(after_sync=False)
            self._last_sync_s = time.perf_counter() - round_start
            yield outcome
        else:
            self._in_flight = True
            self.clock.restart_window()  # the gap since close_window is this sync's stall
            self._last_sync_s = time.perf_counter() - round_start

    def poll(self) -> list[RoundOutcome]:
        """Per step in ``cpu_async``: adopt the round in flight once it is done, or once this rank
        has run ``max_overshoot`` steps past it (then wait for it). Host-side check only."""
        if not self._in_flight:
            return []
        if self.plane.ready():
            return [self._finish()]
        if self._steps < self.max_overshoot:
            return []
        waited = time.perf_counter()
        outcome = self._finish()
        waited = time.perf_counter() - waited
        # Waiting is sync time, not compute: it must not make this rank look slower.
        self.clock.exclude(waited)
        self._last_sync_s += waited
        return [outcome]

    def _finish(self) -> RoundOutcome:
        while True:
            try:
                result = self.plane.collect()
                break
            except PeerFailure as failure:
                if self.failures is None:
                    raise
                self.failures.after_failed_round(failure)  # applies the change here too
                if self._caught_up:
                    # This round is one the others completed and this rank took over: it joins their
                    # next round instead, without mass (its work is in the round it caught up on).
                    self._caught_up = False
                    self.plane.start(self._without_mass(self._sent))
                else:
                    self.plane.retry()
        self._in_flight = False
        if result.divergence is not None:
            self._divergence = result.divergence
        outcome = self._advance(result)
        # Elastic blending keeps ahead-of-sync progress; when the rounds stop (epoch end, stop,
        # budget) or a checkpoint follows, every replica must hold the same consensus, so those
        # rounds overwrite.
        self.plane.adopt(result, 1.0 if outcome.ends_window_sequence or outcome.consensus else self.alpha)
        self._tune_overshoot(outcome)
        return outcome

    def _tune_overshoot(self, outcome: RoundOutcome) -> None:
        # flodl's auto-tune: one more step of lookahead per stable verdict, back to the start on a nudge.
        if self.config.max_overshoot is not None or not self.plane.non_blocking:
            return
        verdict = outcome.feedback.verdict
        if isinstance(verdict, NudgeDown) or outcome.feedback.meta_factor is not None:
            self.max_overshoot = OVERSHOOT_INITIAL
        elif isinstance(verdict, Stable):
            self.max_overshoot = min(self.max_overshoot + 1, OVERSHOOT_CEILING)

    def _local_metadata(
        self, epoch: int, out_of_data: bool, stop_level: StopRequest, compute_s: float, epoch_batches: int
    ) -> Tensor:
        values = [0.0] * META_SIZE
        values[Meta.EPOCH_BATCHES] = epoch_batches
        values[Meta.JOINERS], values[Meta.REQUESTS_READ] = self.admission() if self.admission is not None else (0, 0)
        values[Meta.MICRO_BATCH] = (self.micro_batch_size() or 0) if self.micro_batch_size is not None else 0
        values[Meta.STEPS] = self._steps
        values[Meta.SAMPLES] = self._samples
        values[Meta.COMPUTE_S] = compute_s
        values[Meta.LAST_SYNC_S] = self._last_sync_s
        values[Meta.LR] = self._lr
        values[Meta.OUT_OF_DATA] = float(out_of_data)
        values[Meta.STOP_REQUESTED] = float(max(stop_level, self._carried_stop))
        self._carried_stop = StopRequest.NONE
        values[Meta.EPOCH] = epoch
        values[Meta.ROUND] = self.state.rounds
        values[Meta.SIGNATURE] = self.signature
        values[Meta.HAS_DIVERGENCE] = float(self._divergence is not None)
        values[Meta.WIRE] = float(self.run_mode.bf16_wire)
        values[Meta.STALL_MS] = -1.0 if self.clock.last_stall_ms is None else self.clock.last_stall_ms
        # Pinned (PyTorch's caching host allocator) so that the copy below does not synchronize
        # the device: in cpu_async nothing at the boundary may wait for the GPU.
        host = torch.tensor(values, dtype=torch.float64, pin_memory=self.device.type == "cuda")
        divergence, self._divergence = self._divergence, None
        if divergence is not None and not divergence.is_cuda:  # the CPU plane measures on the host
            host[Meta.DELTA_NORM : Meta.POST_NORM + 1] = divergence
            divergence = None
        local = host.to(self.device, non_blocking=True)
        local[Meta.LOSS_SUM] = self._loss_sum
        if divergence is not None:
            local[Meta.DELTA_NORM : Meta.POST_NORM + 1] = divergence
        if self.params:
            with torch.no_grad():  # the live parameters themselves (a layout change rebinds them)
                norms = torch._foreach_norm(self.params)
            local[Meta.FINITE] = torch.stack(norms).isfinite().all().to(torch.float64)
        else:
            local[Meta.FINITE] = 1.0
        return local

    def _advance(self, result: RoundResult) -> RoundOutcome:
        reports = tuple(RankReport.from_row(row) for row in result.table)
        weights = result.weights
        state = self.state
        for totals, report in zip(state.totals, reports, strict=True):
            totals.steps += report.steps
            totals.samples += report.samples
            totals.compute_s += report.compute_s
            totals.sync_s += report.last_sync_s
            if report.stall_ms is not None:
                totals.stall_ms_sum += report.stall_ms
                totals.stalls += 1
            if report.micro_batch is not None:
                totals.micro_batch = report.micro_batch
        state.cohort_step += sum(r.steps for r in reports)
        state.rounds += 1
        # The fastest arrival pays no wait, so the smallest round time is the pure reduce cost.
        sync_ms = 1000.0 * min(r.last_sync_s for r in reports)
        self.controller.report_timing(
            [1000.0 * r.compute_s for r in reports], [r.steps for r in reports], sync_ms
        )
        divergence = self._divergence_report(reports)
        steps = [r.steps for r in reports]
        lr = reports[0].lr if reports[0].lr > 0 else None
        feedback = self.convergence.after_round(divergence, sum(steps), max(steps), lr)
        budget_reached = self.step_budget is not None and state.cohort_step >= self.step_budget
        epoch_over = all(r.out_of_data for r in reports) and not self._epoch_continues
        self._epoch_continues = False
        self.controller.set_epoch_batches_left(self._epoch_batches_left(reports, epoch_over))
        # In-flight rounds are never consensus rounds (those block), so the flag set at the start
        # of the round being finished is this round's.
        consensus = self._consensus_round or not self.plane.non_blocking
        requested = StopRequest(max(max(r.stop_level for r in reports), self._forced_stop))
        self._forced_stop = StopRequest.NONE
        stop_level = self._stop_to_act_on(requested, reports, consensus, epoch_over)
        outcome = RoundOutcome(
            index=state.rounds,
            reports=reports,
            weights=weights,
            planned=tuple(self.controller.batch_counts),
            anchor=self.controller.anchor,
            overhead=self.controller.last_overhead,
            cohort_step=state.cohort_step,
            epoch_over=epoch_over,
            stop_level=stop_level,
            budget_reached=budget_reached,
            divergence=divergence,
            feedback=feedback,
            reset_inner=weights.realized and self.outer.resets_inner,
            consensus=consensus,
            dispatch_shares=tuple(self.controller.speed_shares() or map(float, self.controller.batch_counts)),
            idle=tuple(t.sync_s / (t.compute_s + t.sync_s) if t.compute_s + t.sync_s > 0 else 0.0
                       for t in state.totals),
        )
        self._remember(outcome)
        return outcome

    def _remember(self, outcome: RoundOutcome) -> None:
        self.last_outcome = outcome
        self._kept_batches = tuple((r.epoch, r.epoch_batches) for r in outcome.reports)

    def _stop_to_act_on(
        self, requested: StopRequest, reports: tuple[RankReport, ...], consensus: bool, epoch_over: bool
    ) -> StopRequest:
        """The stop this round acts on; a saving stop may be carried to a later round.

        A save needs every replica at the consensus with no step past it, and a point where every
        rank still reaches the same code: either every rank still has data in the epoch, or the
        epoch is over. Otherwise (a non-blocking ``cpu_async`` round, or ranks already draining the
        epoch's end) every rank carries the request to its next round, which is made a consensus
        round; the same outcome on every rank takes the same decision.
        """
        if not requested.saves:
            return requested
        if epoch_over or (consensus and not any(r.out_of_data for r in reports)):
            return requested  # an epoch-end round blocks on every rank and is adopted with alpha 1
        self._carried_stop = requested
        self._consensus_next = True
        return StopRequest.NONE

    def _epoch_batches_left(self, reports: tuple[RankReport, ...], epoch_over: bool) -> Optional[int]:
        """Batches of the epoch no rank has started when the next window begins, from the round's
        reports (the same on every rank); None when unknown. The epoch size is the full epoch's, so
        in a resumed epoch (which trains only its remainder) this over-counts: the window then
        keeps its planned counts, the behaviour before the plan could reach the epoch's end."""
        epoch_size = self.controller.max_total_batches
        if epoch_size <= 0:
            return None
        if epoch_over:
            return epoch_size  # the next window starts the next epoch
        return max(0, epoch_size - sum(r.epoch_batches for r in reports))  # the ranks agree on the epoch

    @staticmethod
    def _divergence_report(reports: tuple[RankReport, ...]) -> Optional[DivergenceReport]:
        """The previous realized round's drift of every rank from the consensus (one-round lag)."""
        measured = [r.divergence for r in reports]
        if any(m is None for m in measured):
            return None
        post_norm = measured[0][2]  # type: ignore[index]
        return DivergenceReport(
            deltas=[relative_divergence(m[0], post_norm) for m in measured],  # type: ignore[index]
            pre_norms=[m[1] for m in measured],  # type: ignore[index]
            post_norm=post_norm,
        )

    def _reset_window(self) -> None:
        self._steps = 0
        self._samples = 0
        self._loss_sum.zero_()

    # -- membership ------------------------------------------------------------------------

    def apply_change(self, change: Change) -> None:
        """Continue with the new members: renumber the per-rank state, re-plan from the measured
        speeds (a joiner is measured from its first window), and move the plane to the new group
        (it keeps a failed round, which runs again). Every member learns ``max_failure`` at the
        same round: that round acts on it."""
        self.state.lost_totals.extend(self.state.totals[k] for k in change.lost)
        self.state.totals = change.carry(self.state.totals, RankTotals)
        if self._kept_batches:
            self._kept_batches = tuple(change.carry(self._kept_batches, lambda: (-1, 0)))
        self.controller.apply_change(change)
        rank = change.new_rank(self.rank)
        assert rank is not None, "a lost rank does not take the change"
        self.rank, self.world_size = rank, change.world_size_after
        self.plane.apply_change(change)
        if change.ends_fit:
            self._forced_stop = max(self._forced_stop, StopRequest.RANKS_LOST)

    def keep_epoch_open(self) -> None:
        """Lost ranks left untrained work in the epoch: the next round must not end it, even if
        every member had run out of its own data."""
        self._epoch_continues = True

    def progress_at_failure(self, epoch: Optional[int]) -> RoundProgress:
        """How far this rank got when a round failed: the rounds it completed, and each rank's
        batches of ``epoch`` at the last of them (what a lost rank left in the consensus)."""
        last = self.last_outcome
        kept = tuple(batches if at == epoch else 0 for at, batches in self._kept_batches)
        return RoundProgress(self.state.rounds, kept, last is not None and last.ends_window_sequence)

    def round_record(self) -> bytes:
        """This rank's last completed round and the state it left (for a member that missed it)."""
        record = {
            "decisions": (self.controller, self.convergence, self.outer),  # one pickle keeps their links
            "rounds": self.state.rounds, "cohort_step": self.state.cohort_step, "totals": self.state.totals,
            "outcome": self.last_outcome, "kept_batches": self._kept_batches, "carried_stop": int(self._carried_stop),
            "consensus_next": self._consensus_next, "consensus_at": self._consensus_at,
            "max_overshoot": self.max_overshoot,
        }
        buffer = io.BytesIO()
        torch.save(record, buffer)
        return buffer.getvalue()

    def catch_up(self, record: bytes) -> RoundOutcome:
        """Take over the round the others completed and this rank missed (its failed round): the
        decisions and counters it left, identical to theirs from here on. Returns its outcome."""
        taken = torch.load(io.BytesIO(record), map_location=self.device, weights_only=False)
        self.controller, self.convergence, self.outer = taken["decisions"]
        self.state.rounds, self.state.cohort_step = int(taken["rounds"]), int(taken["cohort_step"])
        self.state.totals = list(taken["totals"])
        self.last_outcome = taken["outcome"]
        # In the record's numbering: a joiner's record was left after the join was applied.
        self._kept_batches = tuple(taken["kept_batches"])
        self._carried_stop = StopRequest(taken["carried_stop"])
        self._consensus_next = bool(taken["consensus_next"])
        # A consensus round the others asked for and have not run yet (an admission at an earlier
        # consensus round leaves its own request pending): in cpu_async a round is blocking, and
        # admits, only where every rank made it a consensus round.
        self._consensus_at = taken["consensus_at"]
        self.max_overshoot = int(taken["max_overshoot"])
        self._divergence = None  # this rank measured no drift in the round it missed
        self._caught_up = True
        assert self.last_outcome is not None
        return self.last_outcome

    def join_from(self, record: bytes) -> None:
        """A rank admitted into the fit takes the cohort's state: the :meth:`round_record` of the
        admission round, left by a member after it took the change (the same decisions from here on)."""
        self.catch_up(record)
        self._caught_up = False
        if getattr(self.plane, "outer", None) is not None:
            self.plane.outer = self.outer  # type: ignore[attr-defined]  # the planes that apply it hold it

    def _without_mass(self, sent: Optional[Tensor]) -> Tensor:
        """``sent`` as this rank's part of the next round after a catch-up: no steps, samples, time,
        loss or stop request of its own (the round it caught up on had them), at the others' round."""
        assert sent is not None, "a round failed before any was started"
        local = sent.clone()
        for slot in (Meta.STEPS, Meta.SAMPLES, Meta.COMPUTE_S, Meta.LOSS_SUM, Meta.HAS_DIVERGENCE, Meta.STOP_REQUESTED):
            local[slot] = 0.0
        local[Meta.ROUND] = float(self.state.rounds)
        return local

    # -- checkpoints -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue the same cadence (identical on every rank)."""
        return {
            "rounds": self.state.rounds,
            "cohort_step": self.state.cohort_step,
            "controller": self.controller.state_dict(),
            "convergence": self.convergence.state_dict(),
            "outer": self.outer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state.rounds = int(state["rounds"])
        self.state.cohort_step = int(state["cohort_step"])
        self.controller.load_state_dict(state["controller"])
        self.convergence.load_state_dict(state["convergence"])
        self.outer.load_state_dict(state["outer"])

    # -- reporting -------------------------------------------------------------------------

    def progress(self) -> FitProgress:
        return FitProgress(
            mode=self.run_mode.mode.value,
            rounds=self.state.rounds,
            cohort_step=self.state.cohort_step,
            anchor=self.controller.anchor,
            plan=tuple(self.controller.batch_counts),
            epoch_batches=self.controller.max_total_batches,
            totals=tuple(replace(t) for t in self.state.totals),
            lost_totals=tuple(replace(t) for t in self.state.lost_totals),
        )

    def metrics(self, outcome: RoundOutcome) -> dict[str, float]:
        """The ``elche/*`` scalars of one round, for the Trainer's loggers."""
        metrics: dict[str, float] = {
            "elche/anchor": float(outcome.anchor),
            "elche/overhead": float(outcome.overhead),
            "elche/syncs": float(outcome.index),
            "elche/cohort_step": float(outcome.cohort_step),
            "elche/alive": float(len(outcome.reports)),
        }
        metrics.update(outcome.feedback.metrics())
        if outcome.divergence is not None:
            metrics["elche/divergence"] = outcome.divergence.max_relative_delta()
            for k, d in enumerate(outcome.divergence.deltas):
                metrics[f"elche/divergence/rank{k}"] = d
        for k, report in enumerate(outcome.reports):
            if report.stall_ms is not None:
                metrics[f"elche/stall_ms/rank{k}"] = report.stall_ms
            if report.micro_batch is not None:
                metrics[f"elche/micro_batch/rank{k}"] = float(report.micro_batch)
        if not isinstance(self.outer, OuterAvg) and outcome.weights.realized:
            metrics["elche/outer_step_norm"] = self.outer.last_step_norm
        total_steps = sum(r.steps for r in outcome.reports)
        moved = [r for r in outcome.reports if r.steps > 0]
        if moved:
            metrics["elche/train_loss"] = math.fsum(r.loss_sum for r in moved) / max(total_steps, 1)
        for k, (report, idle) in enumerate(zip(outcome.reports, outcome.idle, strict=True)):
            metrics[f"elche/batch_share/rank{k}"] = report.steps / total_steps if total_steps else 0.0
            if report.compute_s > 0 and report.samples > 0:
                metrics[f"elche/samples_per_s/rank{k}"] = report.samples / report.compute_s
            metrics[f"elche/idle/rank{k}"] = idle
        return metrics
