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


@dataclass
class EpochResult:
    batches: list[int]
    """Batches each rank trained in the epoch."""
    seconds: float
    """From the epoch's start to the round that ended it."""
    idle_s: list[float] = field(default_factory=list)
    """Per rank: time spent waiting in rounds (including the epoch-end drain)."""
    drain_s: list[float] = field(default_factory=list)
    """Per rank: the part of ``idle_s`` spent out of data, waiting for the epoch to end."""
    rounds: int = 0
    """Rounds in the epoch, the one that ended it included."""


@dataclass
class FitResult:
    epochs: list[EpochResult]
    plans: list[tuple[int, ...]]
    """The controller's plan after every round."""
    batch_s: tuple[float, ...]

    def efficiency(self, first_epoch: int = 1) -> float:
        """Samples per second from ``first_epoch`` on over the sum of the ranks' solo rates (the
        benchmark's steady-state efficiency, in batches)."""
        epochs = self.epochs[first_epoch:]
        trained = sum(sum(e.batches) for e in epochs)
        seconds = sum(e.seconds for e in epochs)
        return trained / seconds / sum(1.0 / t for t in self.batch_s)

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


@dataclass
class _Rank:
    rank: int
    sampler: ElCheSampler
    indices: object = None
    fetched: deque = field(default_factory=deque)
    steps: int = 0
    window_start: float = 0.0
    trained: int = 0
    idle_s: float = 0.0
    arrived: float = 0.0
    out_of_data: bool = False
    drain_s: float = 0.0


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
) -> FitResult:
    world = len(batch_s)
    rng = random.Random(seed)  # batch times vary by up to ``jitter`` of the mean, reproducibly
    config = ElCheConfig.preset(mode)
    if anchor is not None:
        config = ElCheConfig(mode=config.mode, anchor=anchor)
    controller = ElCheController.from_config(config, world)
    counter = SharedCounter()
    ranks = [
        _Rank(r, build_sampler(Dispatch.POOL, samples, batch, r, world, shuffle=True, seed=0, counter=counter,
                               key_prefix="balance", max_chunk_batches=chunk))
        for r in range(world)
    ]
    epoch_size = ranks[0].sampler.num_batches
    controller.set_epoch_size(epoch_size)
    controller.set_epoch_batches_left(epoch_size)  # as the engine does before its first round
    warm = list(first_batch_s) if first_batch_s is not None else [0.0] * world
    plans: list[tuple[int, ...]] = []
    results: list[EpochResult] = []
    now = 0.0

    def fetch(state: _Rank) -> None:
        got = list(itertools.islice(state.indices, batch))  # type: ignore[call-overload]
        if got:
            state.fetched.append(got)

    for epoch in range(epochs):
        start = now
        for state in ranks:
            state.sampler.set_epoch(epoch)
            state.sampler.started_batches = 0
            state.indices = iter(state.sampler)
            state.fetched.clear()
            state.steps = state.trained = 0
            state.idle_s = state.drain_s = 0.0
            state.window_start = now
            state.out_of_data = False
            fetch(state)  # the fetcher's prefetch
        ready = [(now, r) for r in range(world)]
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
                at += batch_s[r] * noise + warm[r]
                warm[r] = 0.0
                state.steps += 1
                state.trained += 1
                state.out_of_data = not state.fetched
                if state.out_of_data or state.steps >= controller.planned_batches(r):
                    state.arrived = at
                    parked.append(r)
                else:
                    heapq.heappush(ready, (at, r))
                continue
            # Every rank is in the round: it completes at the latest arrival.
            assert len(parked) == world
            done = max(ranks[r].arrived for r in parked) + sync_s
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
            shares = controller.speed_shares() or [float(count) for count in controller.batch_counts]
            trained = [s.sampler.started_batches or 0 for s in ranks]
            for state in ranks:
                state.sampler.on_round(shares, epoch, trained)
                state.idle_s += done - state.arrived
                if state.out_of_data:
                    state.drain_s += done - state.arrived
            parked = []
            for state in ranks:
                state.steps = 0
                state.window_start = state.arrived = done
                if state.out_of_data:
                    parked.append(state.rank)  # joins the next round at once, with zero mass
                elif not epoch_over:
                    heapq.heappush(ready, (done, state.rank))
            now = done
        results.append(EpochResult([s.trained for s in ranks], now - start, [s.idle_s for s in ranks],
                                   [s.drain_s for s in ranks], rounds))
    return FitResult(results, plans, tuple(batch_s))
