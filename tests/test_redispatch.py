"""A lost rank's work goes back to the survivors: every pick of the epoch trained exactly once.

N ranks run as DataLoader-like loaders over the real samplers (one in-memory store), stepped in a
random interleaving biased by speed: each loader batches its sampler's iterator as torch's
BatchSampler does and keeps ``prefetch + 1`` batches fetched ahead of training. At random points
ranks are lost: each reports how many batches it had in the consensus (any number up to what it
trained), its fetched batches vanish with it, and every survivor applies the membership ``Change``.
A loader whose iterator ended asks ``wants_reopen`` and re-iterates after ``reopen``. The survivors'
trained batches and the lost ranks' consensus batches must be the epoch's picks, each exactly once.
Ranks may also join (:mod:`test_join_dispatch` uses the same harness).
"""

from __future__ import annotations

import itertools
import pickle
import random
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Optional

import pytest
from test_data import SharedCounter

from lightning_elche.config import Dispatch
from lightning_elche.coverage import EpochCoverage
from lightning_elche.dispatch import ElCheSampler, PoolDispatch, build_sampler, sampler_for_joiner
from lightning_elche.membership import Change

DISPATCHES = tuple(Dispatch)


class Crash(Exception):
    """A simulated rank dies inside its sampler."""


class CrashingStore(SharedCounter):
    """The store, where one rank can die between a claim and its record (the crash window)."""

    def __init__(self) -> None:
        super().__init__()
        self.crash_suffix: Optional[str] = None

    def append(self, key: str, value: str) -> None:
        if self.crash_suffix is not None and key.endswith(self.crash_suffix):
            self.crash_suffix = None
            raise Crash(key)
        super().append(key, value)


class Loader:
    """One rank's training DataLoader: BatchSampler batching, ``prefetch + 1`` batches fetched ahead."""

    def __init__(self, sampler: ElCheSampler, prefetch: int) -> None:
        self.sampler = sampler
        self.prefetch = prefetch
        self.iterator: Optional[Any] = None
        self.started = False
        self.fetched: deque[list[Any]] = deque()
        self.trained: list[list[Any]] = []
        self.dropped: list[Any] = []
        self.reopens = 0

    def _fetch(self) -> None:
        size = self.sampler.batch_size
        while self.iterator is not None and len(self.fetched) <= self.prefetch:
            batch = list(itertools.islice(self.iterator, size))
            if len(batch) < size:
                self.iterator = None  # the sampler's iterator ended
                if batch and self.sampler.drop_last:
                    self.dropped += batch
                    batch = []
            if batch:
                self.fetched.append(batch)

    def step(self) -> bool:
        """Train one batch; False when this rank has no work (for now)."""
        if not self.started:
            self.started = True
            self.sampler.started_batches = 0
            self.iterator = iter(self.sampler)
            self._fetch()
        if not self.fetched and self.iterator is None and self.sampler.wants_reopen:
            self.sampler.reopen()
            self.reopens += 1
            self.iterator = iter(self.sampler)
            self._fetch()
        if not self.fetched:
            return False
        self.sampler.batch_started()
        self.trained.append(self.fetched.popleft())
        self._fetch()
        return True


@dataclass
class Epoch:
    """One epoch of the simulated ranks, with what the lost ranks left in the consensus."""

    loaders: list[Loader]
    rng: random.Random
    alive: list[Loader] = field(default_factory=list)
    consensus: list[Any] = field(default_factory=list)  # keys of the lost ranks' consensus batches
    regroups: int = 0  # membership changes (losses, joins or both)
    reopens_asked: int = 0
    members: list[int] = field(default_factory=list)  # member id of every live rank, in rank order
    generation: int = 0
    joined: int = 0

    def __post_init__(self) -> None:
        self.alive = list(self.loaders)
        self.members = list(range(len(self.loaders)))
        self.speeds = [self.rng.uniform(0.2, 3.0) for _ in self.loaders]

    def lose(self, victims: list[Loader], consensus: Optional[list[int]] = None, joiners: int = 0) -> Change:
        ranks = [self.alive.index(v) for v in victims]
        lost = []
        for k, (rank, victim) in enumerate(zip(ranks, victims, strict=True)):
            kept = self.rng.randint(0, len(victim.trained)) if consensus is None else consensus[k]
            lost.append((self.members[rank], kept))
            self.consensus += [key for batch in victim.trained[:kept] for key in batch]
        self.rng.shuffle(lost)  # any order
        return self.change(ranks, dict(lost), joiners)

    def change(self, lost: list[int], trained: dict[int, int], joiners: int = 0) -> Change:
        """Every survivor applies one change (``lost``: ranks; ``trained``: by member id); joiners
        take over a survivor's state (pickled, as it would cross the wire)."""
        new_ids = [max(self.members + [len(self.loaders) - 1]) + 1 + j for j in range(joiners)]
        self.generation += 1
        change = Change(generation=self.generation, before=tuple(self.members),
                        after=tuple(m for r, m in enumerate(self.members) if r not in lost) + tuple(new_ids),
                        trained_batches=trained)
        for r in change.survivors:
            self.alive[r].sampler.apply_change(change)
        self.alive = [self.alive[r] for r in change.survivors]
        self.members = list(change.after)
        if joiners:
            state = pickle.loads(pickle.dumps(self.alive[0].sampler.state_for_joiner()))
            store = self.alive[0].sampler.counter
            for rank in change.joined:
                joiner = Loader(sampler_for_joiner(state, rank, counter=store), prefetch=self.rng.choice((0, 1, 3)))
                self.loaders.append(joiner)
                self.alive.append(joiner)
                self.speeds.append(self.rng.uniform(0.2, 3.0))
            self.joined += joiners
        self.regroups += 1
        return change

    def run(self, losses: list[tuple[int, int]] = (), stop_after: Optional[int] = None,
            plans: bool = True, joins: list[tuple[int, int, int]] = ()) -> None:
        """Step until every rank is out of work; ``losses``: (step, ranks lost) events; ``joins``:
        (step, ranks lost, ranks joined) events (one change each)."""
        pending = sorted([(step, count, 0) for step, count in losses] + list(joins))
        idle: set[int] = set()
        steps = 0
        while True:
            if pending and (steps >= pending[0][0] or not self._can_step(idle)):
                _, count, joiners = pending.pop(0)
                count = min(count, len(self.alive) - 1)
                if count > 0 or joiners:
                    self.lose(self.rng.sample(self.alive, count), joiners=joiners)
                    idle.clear()
                continue
            if stop_after is not None and steps >= stop_after:
                return
            # A rank of speed 0 is stalled: it neither steps nor holds up the end.
            live = [lo for lo in self.alive if id(lo) not in idle and self.speeds[self.loaders.index(lo)] > 0]
            if not live:
                return
            loader = self.rng.choices(live, weights=[self.speeds[self.loaders.index(lo)] for lo in live])[0]
            try:
                if not loader.step():
                    idle.add(id(loader))
            except Crash:
                self.lose([loader])
                idle.clear()
            steps += 1
            if plans and steps % 7 == 0:
                plan = [self.rng.randint(0, 8) for _ in self.alive]
                if sum(plan):
                    for lo in self.alive:
                        lo.sampler.on_round(plan)

    def _can_step(self, idle: set[int]) -> bool:
        return any(id(lo) not in idle and self.speeds[self.loaders.index(lo)] > 0 for lo in self.alive)

    def trained_keys(self) -> list[Any]:
        return [key for lo in self.alive for batch in lo.trained for key in batch] + self.consensus


def make_samplers(dispatch: Dispatch, world: int, rng: random.Random, store: SharedCounter, n: int, batch: int,
                  drop_last: bool, augment: int = 1, epoch: int = 1) -> list[ElCheSampler]:
    raw = [rng.uniform(1, 3) for _ in range(world)]
    ratios = [r / sum(raw) for r in raw] if dispatch == "fixed" else None
    chunk = rng.choice((1, 2, 4))
    samplers = []
    for r in range(world):
        s = build_sampler(dispatch, n, batch, r, world, shuffle=True, seed=11, counter=store,
                          key_prefix=f"p{id(store)}", partition_ratios=ratios, max_chunk_batches=chunk,
                          drop_last=drop_last, augment=augment, pick_keys=augment > 1)
        s.set_epoch(epoch)
        samplers.append(s)
    return samplers


def epoch_keys(sampler: ElCheSampler, coverage: Optional[EpochCoverage] = None) -> Counter:
    """The picks ``sampler``'s epoch dispatches (after ``coverage``): one rank alone yields them all."""
    assert sampler.dispatch is not None
    alone = build_sampler(sampler.dispatch, sampler.dataset_len, sampler.batch_size, 0, 1, shuffle=sampler.shuffle,
                          seed=sampler.seed, counter=SharedCounter(), key_prefix="alone",
                          partition_ratios=[1.0] if sampler.dispatch == "fixed" else None,
                          drop_last=sampler.drop_last, augment=sampler.augment, pick_keys=sampler.pick_keys)
    alone.set_epoch(sampler.epoch)
    if coverage is not None:
        alone.resume(coverage)
    return Counter(alone)


def resume_somehow(sampler: ElCheSampler, coverage: EpochCoverage, rng: random.Random,
                   world: int) -> list[ElCheSampler]:
    """Samplers of ``world`` ranks (fewer where the remainder leaves a rank no batch) resuming ``coverage``."""
    assert sampler.dispatch is not None
    for ranks in range(world, 0, -1):
        resumed = make_samplers(sampler.dispatch, ranks, rng, SharedCounter(), sampler.dataset_len,
                                sampler.batch_size, drop_last=sampler.drop_last)
        try:
            for s in resumed:
                s.resume(coverage)
        except ValueError as error:
            assert "no batch" in str(error) or "every rank needs" in str(error)
            continue
        return resumed
    raise AssertionError("not even one rank can resume the record")


def assert_exactly_once(trained: list[Any], expected: Counter, slack: int = 0) -> None:
    """Every expected pick once; ``slack`` picks may be missing (the DataLoaders' dropped short
    batches of the equal split under drop_last, as under DDP), none may be extra or repeated."""
    got = Counter(trained)
    repeated = {k: c for k, c in got.items() if c > 1}
    assert not repeated, f"{len(repeated)} picks trained twice, e.g. {list(repeated)[:4]}"
    extra = set(got) - set(expected)
    assert not extra, f"{len(extra)} picks trained that the epoch does not hold"
    missing = sum(expected.values()) - len(got)
    assert missing <= slack, f"{missing} picks missing (allowed {slack})"


def drop_slack(dispatch: Dispatch, drop_last: bool, epoch: Epoch, world: int) -> int:
    # The equal split leaves each rank's short batch to the DataLoader (dropped under drop_last):
    # one per rank's own stream and one per change's returned (or re-split) remainder.
    if dispatch != "equal" or not drop_last:
        return 0
    return (world + epoch.regroups) * (epoch.loaders[0].sampler.batch_size - 1)


def random_epoch(dispatch: Dispatch, seed: int, drop_last: bool, augment: int = 1,
                 store: Optional[SharedCounter] = None) -> tuple[Epoch, int, Counter]:
    rng = random.Random(seed)
    world = rng.randint(2, 8)
    batch = rng.randint(2, 5)
    n = rng.randint(world * batch * 3, world * batch * 12) // augment + 1
    samplers = make_samplers(dispatch, world, rng, store or SharedCounter(), n, batch, drop_last, augment)
    loaders = [Loader(s, prefetch=rng.choice((0, 1, 2, 4))) for s in samplers]
    return Epoch(loaders, rng), world, epoch_keys(samplers[0])


@pytest.mark.parametrize("drop_last", (False, True))
@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_lost_ranks_work_is_trained_exactly_once(dispatch, drop_last):
    reopened = regrouped_late = 0
    for seed in range(60):
        epoch, world, expected = random_epoch(dispatch, seed, drop_last)
        total = sum(expected.values()) // epoch.loaders[0].sampler.batch_size
        events = [(epoch.rng.randint(0, total + total // 3), epoch.rng.choice((1, 1, 2)))
                  for _ in range(epoch.rng.choice((1, 1, 2, 3)))]
        epoch.run(events)
        assert_exactly_once(epoch.trained_keys(), expected, drop_slack(dispatch, drop_last, epoch, world))
        assert all(not lo.fetched and not lo.sampler.wants_reopen for lo in epoch.alive)
        reopened += sum(lo.reopens for lo in epoch.alive)
        regrouped_late += any(e[0] > total for e in events)
    # The random epochs did exercise survivors that had already run out of work.
    assert reopened > 0 and regrouped_late > 0


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_augmented_picks_of_a_lost_rank_are_trained_once(dispatch):
    for seed in range(15):
        epoch, world, expected = random_epoch(dispatch, 500 + seed, drop_last=False, augment=3)
        epoch.run([(epoch.rng.randint(0, 30), 1), (epoch.rng.randint(10, 60), 1)])
        assert all(key.repeat in (0, 1, 2) for key in epoch.trained_keys())
        assert_exactly_once(epoch.trained_keys(), expected)


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_a_rank_lost_before_it_started_the_epoch_leaves_its_share(dispatch):
    rng = random.Random(3)
    samplers = make_samplers(dispatch, 4, rng, SharedCounter(), 200, 4, drop_last=False)
    epoch = Epoch([Loader(s, prefetch=2) for s in samplers], rng)
    for _ in range(5):
        epoch.loaders[0].step()
    epoch.lose([epoch.loaders[2]], consensus=[0])  # it never iterated: nothing in the consensus
    epoch.run()
    assert not epoch.loaders[2].started
    assert_exactly_once(epoch.trained_keys(), epoch_keys(samplers[0]))


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_survivors_that_had_run_out_reopen_and_a_chain_of_losses_is_covered(dispatch):
    rng = random.Random(8)
    samplers = make_samplers(dispatch, 5, rng, SharedCounter(), 301, 4, drop_last=False)
    epoch = Epoch([Loader(s, prefetch=4 if r == 4 else 1) for r, s in enumerate(samplers)], rng)
    slow = epoch.loaders[4]
    for _ in range(2):
        assert slow.step()
    epoch.speeds = [5.0, 1.0, 1.0, 1.0, 0.0]  # rank 4 stalls, holding what it fetched
    epoch.run(stop_after=40)
    epoch.lose([epoch.loaders[1]])
    epoch.run(stop_after=100)
    epoch.run()  # everyone but rank 4 ends up out of work
    assert all(not lo.step() for lo in epoch.alive if lo is not slow)
    assert slow.fetched
    # Now the stalled rank is lost with work left: the others must reopen for it.
    epoch.lose([slow], consensus=[1])
    assert any(lo.sampler.wants_reopen for lo in epoch.alive)
    epoch.run()
    assert sum(lo.reopens for lo in epoch.alive) > 0
    assert [lo.sampler.world_size for lo in epoch.alive] == [3, 3, 3]
    assert sorted(lo.sampler.rank for lo in epoch.alive) == [0, 1, 2]
    assert_exactly_once(epoch.trained_keys(), epoch_keys(samplers[0]))


@pytest.mark.parametrize("where", ("pool", "returned"))
def test_a_rank_that_dies_between_claim_and_record_loses_nothing(where):
    crashes = 0
    for seed in range(10):
        store = CrashingStore()
        epoch, world, expected = random_epoch(Dispatch.POOL, 900 + seed, drop_last=False, store=store)
        epoch.run(stop_after=epoch.rng.randint(0, 20))
        if where == "returned":
            epoch.lose([epoch.alive[-1]])
        if len(epoch.alive) < 2:
            continue
        victim = epoch.alive[epoch.rng.randrange(len(epoch.alive))]
        store.crash_suffix = f"/g{epoch.regroups}/r{epoch.alive.index(victim)}"
        epoch.run()
        crashes += store.crash_suffix is None
        assert_exactly_once(epoch.trained_keys(), expected)
    assert crashes >= 5


@pytest.mark.parametrize("drop_last", (False, True))
@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_a_checkpoint_after_a_loss_resumes_on_another_world_size(dispatch, drop_last):
    checked = 0
    for seed in range(12):
        epoch, world, expected = random_epoch(dispatch, 300 + seed, drop_last)
        total = sum(expected.values()) // epoch.loaders[0].sampler.batch_size
        loss = epoch.rng.randint(0, total // 2)
        epoch.run([(loss, epoch.rng.choice((1, 2)))], stop_after=epoch.rng.randint(loss + 1, total * 3 // 4))
        gathered = [lo.sampler.local_coverage(lo.sampler.started_batches or 0) for lo in epoch.alive]
        records = [lo.sampler.coverage(gathered) for lo in epoch.alive]
        assert all(r == records[0] for r in records)  # every survivor computes the same record
        coverage = records[0]
        assert coverage.world_size == len(epoch.alive)
        done = epoch.trained_keys()
        if not coverage.remaining:
            assert_exactly_once(done, expected, drop_slack(dispatch, drop_last, epoch, world))
            continue
        checked += 1
        assert epoch_keys(epoch.loaders[0].sampler, coverage) == expected - Counter(done)
        # Resume on another number of ranks, and lose one of those too.
        rng = random.Random(seed)
        resumed = resume_somehow(epoch.loaders[0].sampler, coverage, rng, rng.randint(1, 6))
        second = Epoch([Loader(s, prefetch=rng.choice((0, 2))) for s in resumed], rng)
        second.run([(rng.randint(0, 20), 1)])
        slack = drop_slack(dispatch, drop_last, epoch, world) + drop_slack(dispatch, drop_last, second, len(resumed))
        assert_exactly_once(done + second.trained_keys(), expected, slack)
    assert checked >= 6


@pytest.mark.parametrize("drop_last", (False, True))
@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_a_resumed_epoch_then_a_loss(dispatch, drop_last):
    checked = 0
    for seed in range(12):
        epoch, world, expected = random_epoch(dispatch, 700 + seed, drop_last)
        total = sum(expected.values()) // epoch.loaders[0].sampler.batch_size
        epoch.run(stop_after=epoch.rng.randint(1, total // 2))
        gathered = [lo.sampler.local_coverage(lo.sampler.started_batches or 0) for lo in epoch.alive]
        coverage = epoch.alive[0].sampler.coverage(gathered)
        done = epoch.trained_keys()
        rng = random.Random(seed)
        resumed = resume_somehow(epoch.loaders[0].sampler, coverage, rng, rng.randint(2, 6))
        if len(resumed) < 2:
            continue
        checked += 1
        second = Epoch([Loader(s, prefetch=rng.choice((0, 1, 3))) for s in resumed], rng)
        second.run([(rng.randint(0, 15), 1), (rng.randint(0, 30), 1)])
        slack = drop_slack(dispatch, drop_last, epoch, world) + drop_slack(dispatch, drop_last, second, len(resumed))
        assert_exactly_once(done + second.trained_keys(), expected, slack)
    assert checked >= 6


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_the_next_epoch_uses_the_new_numbering(dispatch):
    rng = random.Random(21)
    store = SharedCounter()
    samplers = make_samplers(dispatch, 4, rng, store, 160, 4, drop_last=False)
    epoch = Epoch([Loader(s, prefetch=1) for s in samplers], rng)
    epoch.run([(10, 1)])
    assert_exactly_once(epoch.trained_keys(), epoch_keys(samplers[0]))
    survivors = [lo.sampler for lo in epoch.alive]
    for s in survivors:
        s.set_epoch(2)
    following = Epoch([Loader(s, prefetch=1) for s in survivors], rng)
    following.run()
    assert_exactly_once(following.trained_keys(), epoch_keys(survivors[0]))
    assert not any(lo.reopens for lo in following.loaders)
    if dispatch == "fixed":
        assert len(survivors[0].partition_ratios or []) == 3
        assert sum(survivors[0].partition_ratios or []) == pytest.approx(1.0)
    if dispatch == "pool":
        survivors[0].on_round([1, 2, 3])  # plans have the new world size
        with pytest.raises(ValueError, match="3 finite values"):
            survivors[0].on_round([1, 2, 3, 4])


def test_the_check_catches_a_regroup_that_forgets_the_lost_work(monkeypatch):
    # The assertion must be able to fail: a pool change that returns nothing loses the lost
    # rank's claimed, untrained batches.
    follow = PoolDispatch._follow_change

    def forgetful(self, change, span):
        returned = follow(self, change, span)
        self._epoch.plan.queues[-1] = []
        return returned

    monkeypatch.setattr(PoolDispatch, "_follow_change", forgetful)
    epoch, world, expected = random_epoch(Dispatch.POOL, 4, drop_last=False)
    epoch.run([(10, 1)])
    with pytest.raises(AssertionError, match="missing"):
        assert_exactly_once(epoch.trained_keys(), expected)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"after": (0, 2), "trained_batches": {1: 0}}, "does not hold this rank"),
        ({"after": (1, 0), "trained_batches": {2: 0}}, "in their old order"),
        ({"after": (1, 2), "trained_batches": {1: 3}}, "member 1 is not lost"),
        ({"after": (1, 2), "trained_batches": {0: -1}}, "trained_batches"),
        ({"after": (1, 2), "trained_batches": {0: 10_000}}, "had"),
        ({"before": (0, 1), "after": (1,)}, "expected the 3 members"),
        ({"after": (1, 2), "generation": 0}, "expected a generation above 0"),
    ],
)
@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_bad_regroups_are_refused(dispatch, change, message):
    samplers = make_samplers(dispatch, 3, random.Random(0), SharedCounter(), 120, 4, drop_last=False)
    for s in samplers:
        s.started_batches = 0
    list(itertools.islice(iter(samplers[0]), 8))
    with pytest.raises(ValueError, match=message):
        samplers[1].apply_change(Change(**{"generation": 1, "before": (0, 1, 2), **change}))


def test_reopen_is_refused_while_the_iterator_is_live():
    sampler = make_samplers(Dispatch.EQUAL, 2, random.Random(0), SharedCounter(), 40, 4, drop_last=False)[0]
    iterator = iter(sampler)
    next(iterator)
    assert not sampler.wants_reopen
    with pytest.raises(RuntimeError, match="has not ended"):
        sampler.reopen()


def test_a_lost_rank_that_runs_on_takes_no_work_from_the_survivors():
    # A rank declared lost while stopped (SIGSTOP past the liveness timeout) may run again: it
    # still claims, with its old numbering, in this epoch and the next. The survivors' claims go
    # through counters it does not know, so it takes nothing from them.
    for seed in range(10):
        rng = random.Random(seed)
        samplers = make_samplers(Dispatch.POOL, 4, rng, SharedCounter(), rng.randint(100, 300), 4, drop_last=False)
        epoch = Epoch([Loader(s, prefetch=rng.choice((0, 2))) for s in samplers], rng)
        epoch.run(stop_after=rng.randint(0, 12))
        zombie = epoch.alive[1]
        epoch.lose([zombie])
        while zombie.step():  # it runs first and would claim the whole pool
            pass
        epoch.run()
        assert_exactly_once(epoch.trained_keys(), epoch_keys(samplers[0]))
        survivors = [lo.sampler for lo in epoch.alive]
        for s in survivors + [zombie.sampler]:
            s.set_epoch(2)
        ghost = Loader(zombie.sampler, prefetch=0)
        while ghost.step():
            pass
        assert ghost.trained  # it did claim in the next epoch, on its own keys
        following = Epoch([Loader(s, prefetch=1) for s in survivors], rng)
        following.run()
        assert_exactly_once(following.trained_keys(), epoch_keys(survivors[0]))


class ThreadCohort:
    """The ranks as threads that claim concurrently; a loss pauses them all (the recovery), the
    survivors regroup, and they go on. An out-of-work rank waits for a regroup or the end."""

    def __init__(self, loaders: list[Loader], rng: random.Random) -> None:
        self.epoch = Epoch(loaders, rng)
        self.changed = threading.Condition()
        self.paused = False
        self.finished = False
        self.quiet: set[int] = set()  # ranks parked for a pause or out of work
        self.out_of_work: set[int] = set()
        self.lost: set[int] = set()
        self.errors: list[BaseException] = []

    def body(self, loader: Loader) -> None:
        me = id(loader)
        try:
            while True:
                with self.changed:
                    while self.paused or me in self.out_of_work:
                        if self.finished or me in self.lost:
                            return
                        self.quiet.add(me)
                        self.changed.notify_all()
                        self.changed.wait()
                    self.quiet.discard(me)
                    if self.finished or me in self.lost:
                        return
                if loader.step():
                    time.sleep(random.random() * 0.0005)
                else:
                    with self.changed:
                        self.out_of_work.add(me)
        except BaseException as error:  # reported by run()
            self.errors.append(error)
            with self.changed:
                self.finished = True
                self.changed.notify_all()

    def _all_quiet(self) -> bool:
        return all(id(lo) in self.quiet for lo in self.epoch.alive) or self.finished

    def change(self, rng: random.Random) -> list[threading.Thread]:
        """One change of members while every rank is quiet: here one or two losses (never the last
        rank); the threads of ranks it adds, started."""
        count = min(rng.choice((1, 2)), len(self.epoch.alive) - 1)
        if count > 0:
            victims = rng.sample(self.epoch.alive, count)
            self.lost |= {id(v) for v in victims}
            self.epoch.lose(victims)
        return []

    def run(self, losses: int) -> None:
        threads = [threading.Thread(target=self.body, args=(lo,), daemon=True) for lo in self.epoch.loaders]
        for t in threads:
            t.start()
        rng = self.epoch.rng
        for _ in range(losses):
            time.sleep(rng.uniform(0.0, 0.02))
            with self.changed:
                self.paused = True
                assert self.changed.wait_for(self._all_quiet, timeout=30)
                if not self.finished:
                    threads += self.change(rng)
                    self.out_of_work.clear()  # survivors look again (wants_reopen)
                self.paused = False
                self.changed.notify_all()
        with self.changed:
            done = lambda: self.finished or all(id(lo) in self.out_of_work for lo in self.epoch.alive)  # noqa: E731
            assert self.changed.wait_for(done, timeout=60), "the threads never ran out of work"
            self.finished = True
            self.changed.notify_all()
        for t in threads:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in threads), "a rank thread hung"
        assert not self.errors, self.errors


@pytest.mark.timeout(240)
@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_ranks_claiming_concurrently_as_threads_lose_nothing(dispatch):
    regroups = 0
    for seed in range(8):
        rng = random.Random(1500 + seed)
        world = rng.randint(3, 8)
        batch = rng.randint(2, 4)
        store = ThreadSafeStore()
        samplers = make_samplers(dispatch, world, rng, store, rng.randint(world * batch * 4, 400), batch,
                                 drop_last=rng.random() < 0.5)
        cohort = ThreadCohort([Loader(s, prefetch=rng.choice((0, 1, 3))) for s in samplers], rng)
        cohort.run(losses=rng.randint(1, 3))
        assert_exactly_once(cohort.epoch.trained_keys(), epoch_keys(samplers[0]),
                            drop_slack(dispatch, samplers[0].drop_last, cohort.epoch, world))
        regroups += cohort.epoch.regroups
    assert regroups >= 8


class ThreadSafeStore(SharedCounter):
    """The in-memory store, atomic under threads."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()

    def add(self, key: str, amount: int) -> int:
        with self._lock:
            return super().add(key, amount)

    def append(self, key: str, value: str) -> None:
        with self._lock:
            super().append(key, value)

    def check(self, keys: list[str]) -> bool:
        with self._lock:
            return super().check(keys)

    def get(self, key: str) -> bytes:
        with self._lock:
            return super().get(key)
