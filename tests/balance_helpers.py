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
out of data at the epoch's end (the drain). At every epoch's end it checks that the consensus holds
every sample of the epoch exactly once.

Membership changes go through the holders' ``apply_change`` with a
:class:`~lightning_elche.membership.change.Change`, as the strategy has them do:

* a :class:`Loss` kills a rank in a window (its work since the last round is lost; the survivors
  wait ``detect_s`` in the failed round, the samplers and the controller follow the change, and
  the round runs again on the survivors);
* a :class:`Join` is a rank whose request reaches the job ``at_s`` into an epoch. As in
  :mod:`lightning_elche.growth`: the request ends every member's window at its next batch (the
  knock: once per member, and not for a member whose window is already due); rank 0's round
  metadata reports the joiner from the first round it arrives at after the request; at the first
  such round at which every member can take part (:func:`~lightning_elche.growth.all_can_admit`)
  every member applies the change, rank 0 hands the joiner its sampler's ``state_for_joiner``
  (pickled, as it crosses the wire), and the joiner builds its sampler with
  :func:`~lightning_elche.dispatch.sampler_for_joiner`. The members wait ``admit_s`` for the
  admission (the state's delivery); the joiner then trains from the shared pool of the current
  epoch, its first batch ``first_batch_s`` slower, and is measured by the controller's calibration
  windows, which a join starts again.
"""

from __future__ import annotations

import heapq
import itertools
import pickle
import random
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace

from test_data import SharedCounter

from lightning_elche.config import Dispatch, ElCheConfig
from lightning_elche.controller import ElCheController
from lightning_elche.dispatch import ElCheSampler, build_sampler, sampler_for_joiner
from lightning_elche.growth import all_can_admit
from lightning_elche.guard import Stable
from lightning_elche.membership.change import Change

CAUSES = ("first_window", "plan_lag", "drain", "sync", "change", "join", "warm_up")
"""Where capacity goes, in solo batches (see :meth:`FitResult.loss_by_cause`)."""


@dataclass
class EpochResult:
    batches: list[int]
    """Batches each rank trained in the epoch (ranks at the epoch's end; a lost rank's are gone)."""
    seconds: float
    """From the epoch's start to the round that ended it."""
    idle_s: list[float] = field(default_factory=list)
    """Per rank: time spent waiting in rounds (including the epoch-end drain and an admission)."""
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
    joined_at_s: float | None = None
    """Seconds into the epoch at which a joiner became a member (None: none joined)."""


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
        join: the admission's wait, the window its request cut short and the calibration windows
        that measure the joiner (``join``), a rank's first, slower batch (``warm_up``) and
        batch-time noise (``rest``)."""
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
    """A rank taking ``batch_s`` per batch (its first ``first_batch_s`` more) asks to join ``at_s``
    seconds into ``epoch``; its admission holds the members ``admit_s`` (the state's delivery)."""

    epoch: int
    at_s: float
    batch_s: float
    first_batch_s: float = 0.3
    admit_s: float = 0.0


@dataclass
class _Rank:
    rank: int
    sampler: ElCheSampler
    batch_s: float
    warm_s: float = 0.0
    """What its next batch takes beyond ``batch_s`` (its first batch of the fit)."""
    indices: object = None
    fetched: deque = field(default_factory=deque)
    done: list[list[int]] = field(default_factory=list)
    """The samples of every batch it trained in the epoch, in order."""
    steps: int = 0
    window_start: float = 0.0
    idle_s: float = 0.0
    arrived: float = 0.0
    out_of_data: bool = False
    drain_s: float = 0.0
    member_since: float = 0.0
    started_at_round: int = 0
    knocked: bool = False
    """It ended a window for the joiner's request (each member does once, as JoinKnock.take)."""

    @property
    def trained(self) -> int:
        return len(self.done)


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
    config = ElCheConfig.preset(mode)
    if anchor is not None:
        config = ElCheConfig(mode=config.mode, anchor=anchor)
    model = _Model(config, batch_s, samples, batch, chunk, sync_s, first_batch_s, jitter, seed, shuffle, loss, join)
    results = [model.run_epoch(epoch) for epoch in range(epochs)]
    return FitResult(results, model.plans, tuple(s.batch_s for s in model.ranks))


class _Model:
    """The fit's state between epochs: the ranks, the controller, the store, the members."""

    def __init__(self, config: ElCheConfig, batch_s: Sequence[float], samples: int, batch: int, chunk: int,
                 sync_s: float, first_batch_s: Sequence[float] | None, jitter: float, seed: int, shuffle: bool,
                 loss: Loss | None, join: Join | None) -> None:
        world = len(batch_s)
        self.rng = random.Random(seed)  # batch times vary by up to ``jitter`` of the mean, reproducibly
        self.jitter, self.sync_s, self.batch, self.samples = jitter, sync_s, batch, samples
        self.loss, self.join = loss, join
        self.controller = ElCheController.from_config(config, world)
        self.counter = SharedCounter()
        warm = list(first_batch_s) if first_batch_s is not None else [0.0] * world
        self.ranks = [
            _Rank(r, build_sampler(Dispatch.POOL, samples, batch, r, world, shuffle=shuffle, seed=0,
                                   counter=self.counter, key_prefix="balance", max_chunk_batches=chunk),
                  float(batch_s[r]), float(warm[r]))
            for r in range(world)
        ]
        self.members = list(range(world))  # member ids in rank order
        self.next_member = world  # ids are never reused
        self.generation = 0
        self.epoch_size = self.ranks[0].sampler.num_batches
        self.controller.set_epoch_size(self.epoch_size)
        self.controller.set_epoch_batches_left(self.epoch_size)  # as the engine does before its first round
        self.plans: list[tuple[int, ...]] = []
        self.now = 0.0
        self.knock_at: float | None = None
        self.admitted = False
        self.measuring_joiner = False  # windows since the admission that the joiner's calibration plans

    # -- the epoch -------------------------------------------------------------------------------

    def run_epoch(self, epoch: int) -> EpochResult:
        start = self.now
        self.lost = dict.fromkeys(CAUSES, 0.0)
        self.capacity = 0.0
        self.gone: list[list[int]] = []  # lost ranks' batches in the consensus
        self.joined_at: float | None = None
        if self.join is not None and self.join.epoch == epoch:
            self.knock_at = start + self.join.at_s
        for state in self.ranks:
            state.sampler.set_epoch(epoch)
            state.sampler.started_batches = 0
            state.indices = iter(state.sampler)
            state.fetched.clear()
            state.done = []
            state.steps = state.started_at_round = 0
            state.idle_s = state.drain_s = 0.0
            state.window_start = state.member_since = self.now
            state.out_of_data = False
            self.fetch(state)  # the fetcher's prefetch
        self.ready = [(self.now, r) for r in range(len(self.ranks))]
        self.cut = False  # a member ended the current window for the joiner's request
        rounds = 0
        epoch_over = False
        while not epoch_over:
            if self.ready:
                self.train_batch(*heapq.heappop(self.ready))
                continue
            epoch_over = self.round(epoch, rounds)
            rounds += 1
        self.capacity += sum((self.now - s.member_since) / s.batch_s for s in self.ranks)
        consensus = [b for state in self.ranks for b in state.done] + self.gone
        trained = Counter(i for b in consensus for i in b)
        assert trained == Counter(range(self.samples)), f"epoch {epoch}: not every sample trained exactly once"
        return EpochResult([s.trained for s in self.ranks], self.now - start, [s.idle_s for s in self.ranks],
                           [s.drain_s for s in self.ranks], rounds, self.capacity, float(len(consensus)),
                           self.lost, None if self.joined_at is None else self.joined_at - start)

    def fetch(self, state: _Rank) -> None:
        got = list(itertools.islice(state.indices, self.batch))  # type: ignore[call-overload]
        if got:
            state.fetched.append(got)

    def reopen_if_work(self, state: _Rank) -> None:
        """The strategy's reopen: a change handed an out-of-data rank more of the epoch."""
        if state.out_of_data and state.sampler.wants_reopen:
            state.sampler.reopen()
            state.indices = iter(state.sampler)
            self.fetch(state)
            state.out_of_data = not state.fetched

    def train_batch(self, at: float, r: int) -> None:
        state = self.ranks[r]
        state.done.append(state.fetched.popleft())
        self.fetch(state)  # refilled before the batch starts, as Lightning's fetcher does
        state.sampler.batch_started()
        noise = 1.0 + self.rng.uniform(-self.jitter, self.jitter) if self.jitter else 1.0
        at += state.batch_s * noise + state.warm_s
        self.lost["warm_up"] += state.warm_s / state.batch_s
        state.warm_s = 0.0
        state.steps += 1
        if not state.fetched and state.sampler.wants_reopen:
            state.sampler.reopen()  # a lost rank's work came its way (the strategy's _reopen)
            state.indices = iter(state.sampler)
            self.fetch(state)
        state.out_of_data = not state.fetched
        # The round driver's order: out of data, else the engine's window_due (the plan, then the knock).
        if state.out_of_data or state.steps >= self.controller.planned_batches(r) or self.take_knock(state, at):
            state.arrived = at
        else:
            heapq.heappush(self.ready, (at, r))

    def take_knock(self, state: _Rank, at: float) -> bool:
        if self.knock_at is None or at < self.knock_at or state.knocked:
            return False
        state.knocked = self.cut = True
        return True

    # -- the round -------------------------------------------------------------------------------

    def round(self, epoch: int, index: int) -> bool:
        """Every rank is in the round: it completes at the latest arrival. Returns whether it ended
        the epoch."""
        controller, ranks = self.controller, self.ranks
        # Rank 0 reads the waiting joiners into its metadata when it arrives.
        waiting = not self.admitted and self.knock_at is not None and ranks[0].arrived >= self.knock_at
        detect_s = self.lose(epoch, index)
        ranks = self.ranks
        uncalibrated = controller.speed_shares() is None  # the window was planned without a reading
        done = max(s.arrived for s in ranks) + detect_s + self.sync_s
        walls = [1000.0 * (s.arrived - s.window_start) if s.steps else 0.0 for s in ranks]
        controller.report_timing(walls, [s.steps for s in ranks], 1000.0 * self.sync_s)
        epoch_over = all(s.out_of_data for s in ranks)
        # As the engine does: what is left of the epoch comes from the batches every rank started.
        started = [s.sampler.started_batches or 0 for s in ranks]
        controller.set_epoch_batches_left(self.epoch_size if epoch_over else max(0, self.epoch_size - sum(started)))
        controller.apply_verdict(Stable())
        self.plans.append(tuple(controller.batch_counts))
        # As the strategy does: the measured speed shares (the plan before every rank has a
        # reading) and the batches every rank started in the epoch.
        shares = controller.speed_shares() or [float(count) for count in controller.batch_counts]
        join_window = self.cut or self.measuring_joiner
        for state in ranks:
            state.sampler.on_round(shares, epoch, started)
            state.started_at_round = state.sampler.started_batches or 0
            waited = done - state.arrived
            state.idle_s += waited
            self.lost["sync"] += self.sync_s / state.batch_s
            self.lost["change"] += detect_s / state.batch_s
            waited -= self.sync_s + detect_s
            if state.out_of_data:
                state.drain_s += done - state.arrived
                self.lost["drain"] += waited / state.batch_s
            elif join_window:
                self.lost["join"] += waited / state.batch_s
            elif uncalibrated:
                self.lost["first_window"] += waited / state.batch_s
            else:
                self.lost["plan_lag"] += waited / state.batch_s
        self.cut = False
        if waiting:
            for state in self.ranks:  # JoinKnock.settle: the round that saw the joiner answers its request
                state.knocked = True
            done = self.after_round(epoch_over, done)
        # A join's calibration windows (short, planned from no or a warm-up reading of the joiner) are its cost.
        self.measuring_joiner = self.measuring_joiner and (
            controller.speed_shares() is None or controller.window_counts() != list(controller.batch_counts))
        self.ready = []
        for state in self.ranks:
            state.steps = 0
            state.window_start = state.arrived = done
            if not state.out_of_data and not epoch_over:
                heapq.heappush(self.ready, (done, state.rank))
            # An out-of-data rank joins the next round at once, with zero mass.
        self.now = done
        return epoch_over

    def lose(self, epoch: int, index: int) -> float:
        """The failed round of a :class:`Loss`: the survivors follow the change. Returns the wait
        to detect it."""
        loss = self.loss
        if loss is None or loss.epoch != epoch or loss.round != index:
            return 0.0
        dead = self.ranks[loss.rank]
        self.capacity += (dead.arrived - dead.member_since) / dead.batch_s
        self.lost["change"] += dead.steps  # its window never reached a consensus
        assert dead.started_at_round == dead.trained - dead.steps
        self.gone += dead.done[: dead.started_at_round]
        self.generation += 1
        after = tuple(m for k, m in enumerate(self.members) if k != loss.rank)
        # Its batches up to the last completed round are in the consensus; the rest go back.
        change = Change(self.generation, tuple(self.members), after,
                        trained_batches={self.members[loss.rank]: dead.started_at_round})
        for k, state in enumerate(self.ranks):
            if k != loss.rank:
                state.sampler.apply_change(change)
        self.controller.apply_change(change)
        self.members = list(after)
        del self.ranks[loss.rank]
        for k, state in enumerate(self.ranks):
            state.rank = k
            self.reopen_if_work(state)  # the strategy's _reopen after the round
        return loss.detect_s

    def after_round(self, epoch_over: bool, done: float) -> float:
        """:meth:`Growth.after_round <lightning_elche.growth.Growth.after_round>` of a round that
        reported the joiner waiting (every blocking round is a consensus round). Returns when the
        members go on."""
        controller = self.controller
        controller.keep_a_round_before_the_epoch_end(True)
        reports = [SimpleNamespace(out_of_data=s.out_of_data, epoch_batches=s.sampler.started_batches or 0)
                   for s in self.ranks]
        if epoch_over or not all_can_admit(SimpleNamespace(reports=reports), Dispatch.POOL):
            return done
        controller.keep_a_round_before_the_epoch_end(False)
        assert self.join is not None
        self.generation += 1
        joiner = self.next_member
        self.next_member += 1
        change = Change(self.generation, tuple(self.members), (*self.members, joiner))
        for state in self.ranks:
            state.sampler.apply_change(change)
        controller.apply_change(change)
        self.members.append(joiner)
        # Rank 0 sends the dispatch state; the joiner builds its sampler from it (process_dataloader, then adopt).
        handed = pickle.loads(pickle.dumps(self.ranks[0].sampler.state_for_joiner()))
        sampler = sampler_for_joiner(handed, len(self.ranks), counter=self.counter)
        sampler.set_epoch(handed.epoch)
        sampler.started_batches = 0
        state = _Rank(len(self.ranks), sampler, float(self.join.batch_s), float(self.join.first_batch_s),
                      member_since=done, knocked=True)  # its own request is no knock to it
        state.indices = iter(sampler)
        self.fetch(state)
        state.out_of_data = not state.fetched  # admitted once the epoch's work was all claimed
        self.ranks.append(state)
        for member in self.ranks[:-1]:
            self.reopen_if_work(member)
        self.admitted = self.measuring_joiner = True
        self.joined_at = done
        admit_s = self.join.admit_s
        for member in self.ranks:  # the joiner too: a member from the admission on
            member.idle_s += admit_s
            self.lost["join"] += admit_s / member.batch_s
        return done + admit_s
