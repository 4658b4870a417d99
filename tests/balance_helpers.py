"""A deterministic, virtual-time model of blocking cadence epochs: the real controller and the real
pooled dispatch, ranks that take a fixed time per batch, no processes and no clocks.

Each rank iterates its :class:`~lightning_elche.dispatch.PoolDispatch` the way Lightning's fetcher does
(one batch fetched ahead, ``batch_started`` after the refill), trains a batch in ``batch_s[r]``
virtual seconds (times a seeded factor within ``1 +- jitter``; plus ``first_batch_s[r]`` once per
fit, a warm-up), and joins a blocking round when its window is due or it is out of data. A round
releases every rank at the latest arrival plus ``sync_s``; as in the engine and the strategy, the
controller gets each rank's window wall and batches and the batches left in the epoch, and every
sampler gets the measured speed shares and the batches each rank started in the epoch. An
out-of-data rank joins zero-mass rounds until every rank is out of data, which ends the epoch for
all. The model answers where a fast rank's time goes: waits in rounds, and the part of them spent
out of data at the epoch's end (the drain).

Membership changes: a :class:`Loss` kills a rank in a window (its work since the last round is
lost; the survivors wait ``detect_s`` in the failed round, and the dispatch and the controller
follow the :class:`~lightning_elche.membership.change.Change` as the strategy has them do, then
the round runs again on them). A :class:`Join` admits a rank at an epoch's start: the controller
takes it through ``apply_change``; the pooled dispatch takes no joiner yet
(``ElCheSampler.apply_change`` refuses one), so the model's joiner waits for the next epoch's
layout, for which every rank gets a sampler of the new world.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from test_data import SharedCounter

from lightning_elche.config import Dispatch, ElCheConfig
from lightning_elche.controller import ElCheController
from lightning_elche.dispatch import ElCheSampler, build_sampler
from lightning_elche.guard import Stable
from lightning_elche.membership.change import Change

CAUSES = ("first_window", "plan_lag", "drain", "sync", "change", "warm_up")
"""Where capacity goes, in solo batches (see :meth:`FitResult.loss_by_cause`)."""


@dataclass
class EpochResult:
    batches: list[int]
    """Batches each rank trained in the epoch (ranks at the epoch's end; a lost rank's are gone)."""
    seconds: float
    """From the epoch's start to the round that ended it."""
    idle_s: list[float] = field(default_factory=list)
    """Per rank: time spent waiting in rounds (including the epoch-end drain)."""
    drain_s: list[float] = field(default_factory=list)
    """Per rank: the part of ``idle_s`` spent out of data, waiting for the epoch to end."""
    rounds: int = 0
    """Rounds in the epoch, the one that ended it included."""
    capacity: float = 0.0
    """Batches the epoch's members could have trained alone in the time they were members."""
    trained: float = 0.0
    """Batches in the consensus (a lost rank's last window excluded)."""
    lost: dict[str, float] = field(default_factory=dict)
    """Capacity not trained, by cause (:data:`CAUSES`), in solo batches."""


@dataclass
class FitResult:
    epochs: list[EpochResult]
    plans: list[tuple[int, ...]]
    """The controller's plan after every round."""
    batch_s: tuple[float, ...]

    def efficiency(self, first_epoch: int = 1) -> float:
        """Batches trained from ``first_epoch`` on over what the members could have trained alone
        in that time (the benchmark's steady-state efficiency, in batches)."""
        epochs = self.epochs[first_epoch:]
        return sum(e.trained for e in epochs) / sum(e.capacity for e in epochs)

    def loss_by_cause(self, first_epoch: int = 1) -> dict[str, float]:
        """``1 - efficiency`` split by cause (the benchmark's breakdown: seconds lost weighted by
        the rank's solo rate, over the ideal): waits in windows planned before the first
        calibration (``first_window``), in rounds because the plan's windows did not take equally
        long (``plan_lag``), out of data at the epoch's end (``drain``), the rounds' own time
        (``sync``), a lost rank's last window and the survivors' wait to detect it (``change``), a
        rank's first, slower batch (``warm_up``) and batch-time noise (``rest``)."""
        epochs = self.epochs[first_epoch:]
        capacity = sum(e.capacity for e in epochs)
        parts = {cause: sum(e.lost.get(cause, 0.0) for e in epochs) / capacity for cause in CAUSES}
        parts["rest"] = 1.0 - self.efficiency(first_epoch) - sum(parts.values())
        return parts

    def idle_fraction(self, rank: int, first_epoch: int = 1, drain_only: bool = False) -> float:
        """The part of ``rank``'s time from ``first_epoch`` on spent waiting in rounds (with
        ``drain_only``: out of data, waiting for the epoch to end)."""
        epochs = self.epochs[first_epoch:]
        waited = sum((e.drain_s if drain_only else e.idle_s)[rank] for e in epochs)
        return waited / sum(e.seconds for e in epochs)

    def batch_shares(self, first_epoch: int = 1) -> list[float]:
        epochs = self.epochs[first_epoch:]
        per_rank = [sum(e.batches[r] for e in epochs) for r in range(len(self.batch_s))]
        return [b / sum(per_rank) for b in per_rank]


@dataclass(frozen=True)
class Loss:
    """Rank ``rank`` dies in the window that round ``round`` (0-based, of ``epoch``) closes."""

    epoch: int
    round: int
    rank: int
    detect_s: float = 0.0


@dataclass(frozen=True)
class Join:
    """A rank taking ``batch_s`` per batch is admitted at the start of ``epoch``."""

    epoch: int
    batch_s: float


@dataclass
class _Rank:
    rank: int
    sampler: ElCheSampler
    batch_s: float
    indices: object = None
    fetched: deque = field(default_factory=deque)
    steps: int = 0
    window_start: float = 0.0
    trained: int = 0
    idle_s: float = 0.0
    arrived: float = 0.0
    out_of_data: bool = False
    drain_s: float = 0.0
    member_since: float = 0.0
    started_at_round: int = 0


def simulate_cadence_fit(
    batch_s: Sequence[float],
    epochs: int = 3,
    samples: int = 1024,
    batch: int = 32,
    chunk: int = 4,
    sync_s: float = 0.0,
    first_batch_s: Sequence[float] | None = None,
    mode: str = "nccl_cadence",
    anchor: int | None = None,
    jitter: float = 0.0,
    seed: int = 0,
    shuffle: bool = True,
    loss: Loss | None = None,
    join: Join | None = None,
) -> FitResult:
    world = len(batch_s)
    rng = random.Random(seed)  # batch times vary by up to ``jitter`` of the mean, reproducibly
    config = ElCheConfig.preset(mode)
    if anchor is not None:
        config = ElCheConfig(mode=config.mode, anchor=anchor)
    controller = ElCheController.from_config(config, world)
    counter = SharedCounter()

    def sampler(rank: int, world: int) -> ElCheSampler:
        return build_sampler(Dispatch.POOL, samples, batch, rank, world, shuffle=shuffle, seed=0, counter=counter,
                             key_prefix="balance", max_chunk_batches=chunk)

    ranks = [_Rank(r, sampler(r, world), float(batch_s[r])) for r in range(world)]
    members = list(range(world))  # member ids in rank order
    epoch_size = ranks[0].sampler.num_batches
    controller.set_epoch_size(epoch_size)
    controller.set_epoch_batches_left(epoch_size)  # as the engine does before its first round
    warm = list(first_batch_s) if first_batch_s is not None else [0.0] * world
    plans: list[tuple[int, ...]] = []
    results: list[EpochResult] = []
    now = 0.0
    generation = 0

    def fetch(state: _Rank) -> None:
        got = list(itertools.islice(state.indices, batch))  # type: ignore[call-overload]
        if got:
            state.fetched.append(got)

    def round_shares() -> list[float]:
        return controller.speed_shares() or [float(count) for count in controller.batch_counts]

    for epoch in range(epochs):
        start = now
        lost = dict.fromkeys(CAUSES, 0.0)
        capacity = 0.0
        gone = 0  # batches of ranks lost in the epoch that are in the consensus
        if join is not None and join.epoch == epoch:
            generation += 1
            joiner = max(members) + 1
            controller.apply_change(Change(generation, tuple(members), (*members, joiner)))
            members.append(joiner)
            ranks.append(_Rank(len(ranks), sampler(len(ranks), len(ranks) + 1), float(join.batch_s)))
            warm.append(float(first_batch_s[0]) if first_batch_s else 0.0)  # its own warm-up
            for state in ranks:  # this branch's pooled dispatch takes the new world at an epoch's start
                state.sampler = sampler(state.rank, len(ranks))
                state.sampler.on_round(round_shares())
        for state in ranks:
            state.sampler.set_epoch(epoch)
            state.sampler.started_batches = 0
            state.indices = iter(state.sampler)
            state.fetched.clear()
            state.steps = state.trained = state.started_at_round = 0
            state.idle_s = state.drain_s = 0.0
            state.window_start = state.member_since = now
            state.out_of_data = False
            fetch(state)  # the fetcher's prefetch
        ready = [(now, r) for r in range(len(ranks))]
        parked: list[int] = []
        epoch_over = False
        rounds = 0
        while not epoch_over:
            if ready:
                at, r = heapq.heappop(ready)
                state = ranks[r]
                state.fetched.popleft()
                fetch(state)  # refilled before the batch starts, as Lightning's fetcher does
                state.sampler.batch_started()
                noise = 1.0 + rng.uniform(-jitter, jitter) if jitter else 1.0
                at += state.batch_s * noise + warm[r]
                lost["warm_up"] += warm[r] / state.batch_s
                warm[r] = 0.0
                state.steps += 1
                state.trained += 1
                if not state.fetched and state.sampler.wants_reopen:
                    state.sampler.reopen()  # a lost rank's work came its way (the strategy's _reopen)
                    state.indices = iter(state.sampler)
                    fetch(state)
                state.out_of_data = not state.fetched
                if state.out_of_data or state.steps >= controller.planned_batches(r):
                    state.arrived = at
                    parked.append(r)
                else:
                    heapq.heappush(ready, (at, r))
                continue
            # Every rank is in the round: it completes at the latest arrival.
            assert len(parked) == len(ranks)
            detect_s = 0.0
            if loss is not None and loss.epoch == epoch and loss.round == rounds:
                dead = ranks[loss.rank]
                capacity += (dead.arrived - dead.member_since) / dead.batch_s
                lost["change"] += dead.steps  # its window never reached a consensus
                gone += dead.trained - dead.steps
                detect_s = loss.detect_s
                generation += 1
                after = tuple(m for k, m in enumerate(members) if k != loss.rank)
                # Its batches up to the last completed round are in the consensus; the rest go back.
                change = Change(generation, tuple(members), after,
                                trained_batches={members[loss.rank]: dead.started_at_round})
                for k, state in enumerate(ranks):
                    if k != loss.rank:
                        state.sampler.apply_change(change)
                controller.apply_change(change)
                members = list(after)
                del ranks[loss.rank]
                del warm[loss.rank]
                for k, state in enumerate(ranks):
                    state.rank = k
                    if state.out_of_data and state.sampler.wants_reopen:  # the strategy's _reopen after the round
                        state.sampler.reopen()
                        state.indices = iter(state.sampler)
                        fetch(state)
                        state.out_of_data = not state.fetched
            uncalibrated = controller.speed_shares() is None  # the window was planned without a reading
            done = max(s.arrived for s in ranks) + detect_s + sync_s
            walls = [1000.0 * (s.arrived - s.window_start) if s.steps else 0.0 for s in ranks]
            controller.report_timing(walls, [s.steps for s in ranks], 1000.0 * sync_s)
            epoch_over = all(s.out_of_data for s in ranks)
            rounds += 1
            # As the engine does: what is left of the epoch comes from the batches every rank started.
            started = sum(s.sampler.started_batches or 0 for s in ranks)
            controller.set_epoch_batches_left(epoch_size if epoch_over else max(0, epoch_size - started))
            controller.apply_verdict(Stable())
            plans.append(tuple(controller.batch_counts))
            # As the strategy does: the measured speed shares (the plan before every rank has a
            # reading) and the batches every rank started in the epoch.
            shares = round_shares()
            trained = [s.sampler.started_batches or 0 for s in ranks]
            for state in ranks:
                state.sampler.on_round(shares, epoch, trained)
                state.started_at_round = state.sampler.started_batches or 0
                waited = done - state.arrived
                state.idle_s += waited
                lost["sync"] += sync_s / state.batch_s
                lost["change"] += detect_s / state.batch_s
                waited -= sync_s + detect_s
                if state.out_of_data:
                    state.drain_s += done - state.arrived
                    lost["drain"] += waited / state.batch_s
                elif uncalibrated:
                    lost["first_window"] += waited / state.batch_s
                else:
                    lost["plan_lag"] += waited / state.batch_s
            parked = []
            for state in ranks:
                state.steps = 0
                state.window_start = state.arrived = done
                if state.out_of_data:
                    parked.append(state.rank)  # joins the next round at once, with zero mass
                elif not epoch_over:
                    heapq.heappush(ready, (done, state.rank))
            now = done
        capacity += sum((now - s.member_since) / s.batch_s for s in ranks)
        trained_total = gone + sum(s.trained for s in ranks)
        results.append(EpochResult([s.trained for s in ranks], now - start, [s.idle_s for s in ranks],
                                   [s.drain_s for s in ranks], rounds, capacity, float(trained_total), lost))
    return FitResult(results, plans, tuple(s.batch_s for s in ranks))
