"""Ranks that join mid-epoch: one more rank each, and every pick of the epoch still trained once.

The harness of :mod:`test_redispatch` (DataLoader-like loaders over the real samplers, one
in-memory store, random interleavings biased by speed) with changes that lose ranks, add ranks,
or both. A joiner's sampler is built from a survivor's ``state_for_joiner()`` after a pickle round
trip, as it would cross the wire.
"""

from __future__ import annotations

import heapq
import itertools
import pickle
import random
import threading
from collections import Counter

import pytest
from test_data import SharedCounter
from test_redispatch import (
    DISPATCHES,
    Epoch,
    Loader,
    ThreadCohort,
    ThreadSafeStore,
    assert_exactly_once,
    drop_slack,
    epoch_keys,
    make_samplers,
    random_epoch,
    resume_somehow,
)

import lightning_elche.dispatch.streams as streams
from lightning_elche.config import Dispatch
from lightning_elche.dispatch import JoinState, Phase, build_sampler, sampler_for_joiner
from lightning_elche.membership import Change

MAX_WORLD = 10


def random_changes(epoch: Epoch, total: int, world: int) -> list[tuple[int, int, int]]:
    """(step, ranks lost, ranks joined) events, at least one with a joiner, the world kept small."""
    events = []
    size = world
    for k in range(epoch.rng.choice((1, 2, 3, 4))):
        lost = epoch.rng.choice((0, 0, 1, 2)) if k else epoch.rng.choice((0, 1))
        joined = epoch.rng.choice((1, 1, 2)) if k == 0 else epoch.rng.choice((0, 1, 2))
        lost = min(lost, size - 1)
        joined = min(joined, MAX_WORLD - size + lost)
        size += joined - lost
        events.append((epoch.rng.randint(0, total + total // 3), lost, joined))
    return events


@pytest.mark.parametrize("drop_last", (False, True))
@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_joins_and_losses_mid_epoch_train_every_pick_exactly_once(dispatch, drop_last):
    joiner_batches = reopened = 0
    for seed in range(50):
        epoch, world, expected = random_epoch(dispatch, 4000 + seed, drop_last)
        total = sum(expected.values()) // epoch.loaders[0].sampler.batch_size
        epoch.run(joins=random_changes(epoch, total, world))
        assert epoch.joined > 0
        assert_exactly_once(epoch.trained_keys(), expected, drop_slack(dispatch, drop_last, epoch, world))
        assert all(not lo.fetched and not lo.sampler.wants_reopen for lo in epoch.alive)
        assert sorted(lo.sampler.rank for lo in epoch.alive) == list(range(len(epoch.alive)))
        assert all(lo.sampler.world_size == len(epoch.alive) for lo in epoch.alive)
        joiner_batches += sum(len(lo.trained) for lo in epoch.loaders[world:])
        reopened += sum(lo.reopens for lo in epoch.alive)
    # Joiners did train (a share of the rest of the epoch), and survivors out of work reopened.
    assert joiner_batches > 50 and reopened > 0


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_every_member_and_the_joiner_hold_the_same_epoch_state(dispatch):
    for seed in range(6):
        epoch, world, _ = random_epoch(dispatch, 4100 + seed, drop_last=False)
        epoch.run(stop_after=epoch.rng.randint(0, 25))
        epoch.lose(epoch.rng.sample(epoch.alive, 1), joiners=2)
        epoch.run(stop_after=epoch.rng.randint(0, 10))
        epoch.lose([], joiners=1)
        states = [lo.sampler.state_for_joiner() for lo in epoch.alive]
        assert all(state == states[0] for state in states)  # the joiners' too: they can hand it on
        assert states[0].world_size == world + 2 and states[0].changes == 2
        assert isinstance(pickle.loads(pickle.dumps(states[0])), JoinState)


def test_a_joiner_gets_an_equal_part_of_the_equal_split():
    for seed in range(10):
        rng = random.Random(seed)
        samplers = make_samplers(Dispatch.EQUAL, rng.randint(2, 5), rng, SharedCounter(), 400, 4, drop_last=False)
        epoch = Epoch([Loader(s, prefetch=rng.choice((0, 2))) for s in samplers], rng)
        epoch.run(stop_after=rng.randint(0, 40))
        epoch.lose([], joiners=1)
        joiner = epoch.alive[-1].sampler
        left = [lo.sampler._current_plan().batches(lo.sampler.rank) - lo.sampler._handed for lo in epoch.alive]
        assert left[-1] == joiner._current_plan().batches(joiner.rank) > 0
        assert max(left) - min(left) <= 1, left  # what no rank had handed out, dealt evenly
        epoch.run()
        assert_exactly_once(epoch.trained_keys(), epoch_keys(samplers[0]))


def test_a_joiner_of_the_fixed_split_gets_an_equal_share_of_the_ratios():
    rng = random.Random(2)
    samplers = make_samplers(Dispatch.FIXED, 3, rng, SharedCounter(), 600, 4, drop_last=False)
    ratios = list(samplers[0].partition_ratios)
    epoch = Epoch([Loader(s, prefetch=1) for s in samplers], rng)
    epoch.run(stop_after=30)
    epoch.lose([], joiners=1)
    for lo in epoch.alive:
        assert lo.sampler.partition_ratios == pytest.approx([r * 3 / 4 for r in ratios] + [0.25])
    epoch.run()
    assert_exactly_once(epoch.trained_keys(), epoch_keys(samplers[0]))
    assert len(epoch.alive[-1].trained) > 0


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_a_join_before_any_rank_started_the_epoch(dispatch):
    rng = random.Random(5)
    samplers = make_samplers(dispatch, 3, rng, SharedCounter(), 300, 4, drop_last=False)
    epoch = Epoch([Loader(s, prefetch=1) for s in samplers], rng)
    epoch.lose([], joiners=2)
    assert all(lo.sampler.phase is Phase.READY for lo in epoch.alive)
    epoch.run()
    assert_exactly_once(epoch.trained_keys(), epoch_keys(samplers[0]))
    assert all(lo.trained for lo in epoch.alive)


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_a_join_at_the_epoch_end_and_the_next_epoch_has_the_joiner_as_any_rank(dispatch):
    rng = random.Random(9)
    store = SharedCounter()
    samplers = make_samplers(dispatch, 3, rng, store, 240, 4, drop_last=False)
    epoch = Epoch([Loader(s, prefetch=1) for s in samplers], rng)
    epoch.run()  # every rank out of work
    epoch.lose([epoch.alive[1]], joiners=2)  # the lost rank's untrained work goes to all four
    epoch.run()
    assert_exactly_once(epoch.trained_keys(), epoch_keys(samplers[0]))
    members = [lo.sampler for lo in epoch.alive]
    assert [s.world_size for s in members] == [4] * 4 and [s.rank for s in members] == [0, 1, 2, 3]
    for s in members:
        s.set_epoch(2)
    following = Epoch([Loader(s, prefetch=1) for s in members], rng)
    following.run()
    assert_exactly_once(following.trained_keys(), epoch_keys(members[0]))
    assert not any(lo.reopens for lo in following.loaders) and all(lo.trained for lo in following.loaders)
    if dispatch == "fixed":
        assert len(members[0].partition_ratios or []) == 4
        assert sum(members[0].partition_ratios or []) == pytest.approx(1.0)
    if dispatch == "pool":
        assert members[3].record.chunks[0] == 3  # the joiner's reserved chunk, as any rank's


@pytest.mark.parametrize("drop_last", (False, True))
@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_a_checkpoint_after_joins_resumes_on_another_world_size(dispatch, drop_last):
    checked = 0
    for seed in range(10):
        epoch, world, expected = random_epoch(dispatch, 4300 + seed, drop_last)
        total = sum(expected.values()) // epoch.loaders[0].sampler.batch_size
        first = epoch.rng.randint(0, total // 2)
        epoch.run(joins=[(first, epoch.rng.choice((0, 1)), 1), (first + 3, 1, epoch.rng.choice((0, 1)))],
                  stop_after=epoch.rng.randint(first + 4, max(first + 5, total * 3 // 4)))
        gathered = [lo.sampler.local_coverage(lo.sampler.started_batches or 0) for lo in epoch.alive]
        records = [lo.sampler.coverage(gathered) for lo in epoch.alive]
        assert all(r == records[0] for r in records)
        coverage = records[0]
        done = epoch.trained_keys()
        if not coverage.remaining:
            continue
        checked += 1
        assert epoch_keys(epoch.loaders[0].sampler, coverage) == expected - Counter(done)
        rng = random.Random(seed)
        resumed = resume_somehow(epoch.loaders[0].sampler, coverage, rng, rng.randint(1, 5))
        second = Epoch([Loader(s, prefetch=rng.choice((0, 2))) for s in resumed], rng)
        second.run(joins=[(rng.randint(0, 10), 0, 1)])
        slack = drop_slack(dispatch, drop_last, epoch, world) + drop_slack(dispatch, drop_last, second, len(resumed))
        assert_exactly_once(done + second.trained_keys(), expected, slack)
    assert checked >= 5


class JoiningCohort(ThreadCohort):
    """The threaded cohort, where a change may also add ranks (each a new thread)."""

    def change(self, rng: random.Random) -> list[threading.Thread]:
        lost = min(rng.choice((0, 1, 2)), len(self.epoch.alive) - 1)
        joiners = rng.choice((1, 1, 2)) if len(self.epoch.alive) - lost < MAX_WORLD else 0
        victims = rng.sample(self.epoch.alive, lost)
        self.lost |= {id(v) for v in victims}
        before = len(self.epoch.loaders)
        self.epoch.lose(victims, joiners=joiners)
        added = [threading.Thread(target=self.body, args=(joiner,), daemon=True)
                 for joiner in self.epoch.loaders[before:]]
        for thread in added:
            thread.start()
        return added


@pytest.mark.timeout(240)
@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_ranks_claiming_concurrently_as_threads_with_joins_lose_nothing(dispatch):
    joined = 0
    for seed in range(6):
        rng = random.Random(4500 + seed)
        world = rng.randint(2, 6)
        batch = rng.randint(2, 4)
        samplers = make_samplers(dispatch, world, rng, ThreadSafeStore(), rng.randint(world * batch * 4, 400), batch,
                                 drop_last=rng.random() < 0.5)
        cohort = JoiningCohort([Loader(s, prefetch=rng.choice((0, 1, 3))) for s in samplers], rng)
        cohort.run(rng.randint(1, 3))
        assert_exactly_once(cohort.epoch.trained_keys(), epoch_keys(samplers[0]),
                            drop_slack(dispatch, samplers[0].drop_last, cohort.epoch, world))
        joined += cohort.epoch.joined
    assert joined >= 6


def test_the_state_a_joiner_takes_over_does_not_grow_with_the_epoch():
    sizes = []
    for n in (400, 40_000):
        rng = random.Random(1)
        samplers = make_samplers(Dispatch.EQUAL, 3, rng, SharedCounter(), n, 4, drop_last=False)
        epoch = Epoch([Loader(s, prefetch=1) for s in samplers], rng)
        epoch.run(stop_after=20)
        epoch.lose([epoch.alive[2]], joiners=1)
        sizes.append(len(pickle.dumps(epoch.alive[0].sampler.state_for_joiner())))
    assert sizes[1] < sizes[0] + 64 and sizes[1] < 4000, sizes


@pytest.mark.parametrize("dispatch", (Dispatch.EQUAL, Dispatch.FIXED))
def test_own_stream_joins_without_a_store_are_refused(dispatch):
    ratios = [0.5, 0.5] if dispatch == "fixed" else None
    sampler = build_sampler(dispatch, 100, 4, 0, 2, shuffle=False, seed=0, partition_ratios=ratios)
    with pytest.raises(ValueError, match=r"apply_change\(\) with joiners needs a shared counter"):
        sampler.apply_change(Change(generation=1, before=(0, 1), after=(0, 1, 2)))
    sampler.apply_change(Change(generation=1, before=(0, 1), after=(0,)))  # a loss needs none
    assert sampler.world_size == 1


def test_a_member_that_never_applies_the_join_fails_clearly_instead_of_hanging(monkeypatch):
    monkeypatch.setattr(streams, "HANDED_WAIT_S", 0.05)
    samplers = make_samplers(Dispatch.EQUAL, 3, random.Random(0), SharedCounter(), 120, 4, drop_last=False)
    change = Change(generation=1, before=(0, 1, 2), after=(0, 1, 2, 3))
    samplers[0].apply_change(change)
    samplers[1].apply_change(change)  # rank 2 never does
    with pytest.raises(RuntimeError, match=r"waited 0 s for every member .* missing: \[.*handed/r2'\]"):
        next(iter(samplers[0]))


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_a_joiner_refuses_a_state_of_another_fit(dispatch):
    samplers = make_samplers(dispatch, 2, random.Random(0), SharedCounter(), 200, 4, drop_last=False)
    change = Change(generation=1, before=(0, 1), after=(0, 1, 2))
    for s in samplers:
        s.apply_change(change)
    state = samplers[0].state_for_joiner()
    ratios = state.partition_ratios
    other = build_sampler(dispatch, 200, 8, 2, 3, shuffle=True, seed=11, counter=samplers[0].counter,
                          key_prefix=state.key_prefix, partition_ratios=ratios,
                          max_chunk_batches=state.max_chunk_batches)
    with pytest.raises(ValueError, match=r"the survivors have batch_size=4, this sampler batch_size=8"):
        other.adopt(state)
    joiner = sampler_for_joiner(state, 2, counter=samplers[0].counter)
    next(iter(joiner))
    with pytest.raises(RuntimeError, match="only a fresh sampler adopts a join"):
        joiner.adopt(state)
    with pytest.raises(ValueError, match=r"sampler_for_joiner\(rank=3\) is invalid"):
        sampler_for_joiner(state, 3, counter=samplers[0].counter)


@pytest.mark.parametrize("drop_last", (False, True))
@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_a_member_lost_before_it_applied_a_join_is_settled_by_the_next_change(dispatch, drop_last):
    # Two losses in one recovery: member 2 dies after the join was agreed but before it applied it
    # (so it never said how far it had handed its work out); the next change loses it.
    for seed in range(8):
        rng = random.Random(4700 + seed)
        store = SharedCounter()
        samplers = make_samplers(dispatch, 3, rng, store, 300, 4, drop_last)
        epoch = Epoch([Loader(s, prefetch=rng.choice((0, 2))) for s in samplers], rng)
        expected = epoch_keys(samplers[0])
        epoch.run(stop_after=rng.randint(5, 40))
        survivors, doomed = epoch.alive[:2], epoch.alive[2]
        join = Change(generation=1, before=(0, 1, 2), after=(0, 1, 2, 3))
        for lo in survivors:
            lo.sampler.apply_change(join)
        kept = rng.randint(0, len(doomed.trained))
        epoch.consensus += [key for batch in doomed.trained[:kept] for key in batch]
        loss = Change(generation=2, before=(0, 1, 2, 3), after=(0, 1, 3), trained_batches={2: kept})
        for lo in survivors:
            lo.sampler.apply_change(loss)
        state = pickle.loads(pickle.dumps(survivors[0].sampler.state_for_joiner()))
        assert state.changes == 2 and state.world_size == 3
        joiner = Loader(sampler_for_joiner(state, 2, counter=store), prefetch=1)
        epoch.loaders.append(joiner)
        epoch.speeds.append(1.0)
        epoch.alive = survivors + [joiner]
        epoch.regroups += 2
        epoch.run()
        assert_exactly_once(epoch.trained_keys(), expected, drop_slack(dispatch, drop_last, epoch, 3))


def pooled_epoch_with_a_change(speeds, change_at, joiner_speed=None, lost=None, n=4000, batch=10, round_every=10.0):
    """One pooled epoch in virtual time: ranks train a batch in ``1 / speed``, one batch fetched
    ahead; every ``round_every`` every live sampler gets the speed shares and the batches each rank
    started (``on_round``, as the strategy passes them); at ``change_at`` rank ``lost`` is lost
    (all it trained in the consensus) or a rank of ``joiner_speed`` joins. Returns each live
    rank's end; checks exactly-once and that no ended iterator asks to be reopened for nothing."""
    store = SharedCounter()
    world = len(speeds)
    ranks = []

    def start(sampler, speed):
        sampler.started_batches = 0
        rank = {"sampler": sampler, "speed": speed, "it": iter(sampler), "fetched": [], "trained": [], "end": 0.0}
        fetch(rank)
        return rank

    def fetch(rank):
        got = list(itertools.islice(rank["it"], batch))
        if got:
            rank["fetched"].append(got)
        elif rank["sampler"].wants_reopen:  # the strategy's reopen, at the rank's last batch or after a change
            rank["sampler"].reopen()
            rank["it"] = iter(rank["sampler"])
            got = list(itertools.islice(rank["it"], batch))
            if got:
                rank["fetched"].append(got)
            assert got or not rank["sampler"].wants_reopen  # else the strategy would reopen it forever

    for r, speed in enumerate(speeds):
        sampler = build_sampler(Dispatch.POOL, n, batch, r, world, shuffle=True, seed=3, counter=store,
                                key_prefix="tail", max_chunk_batches=4)
        sampler.set_epoch(0)
        sampler.set_speed_shares(speeds)
        ranks.append(start(sampler, speed))
    live, consensus = list(ranks), []
    events = [(0.0, 0, r) for r in range(world)] + [(change_at, 1, -1)]
    events += [(k * round_every, 2, -1) for k in range(1, 1000)]
    heapq.heapify(events)
    while any(rank["fetched"] for rank in live):
        now, kind, r = heapq.heappop(events)
        if kind == 2:
            started = [rank["sampler"].started_batches for rank in live]
            for rank in live:
                rank["sampler"].on_round([other["speed"] for other in live], 0, started)
        elif kind == 1:
            before = tuple(range(world))
            if lost is not None:
                consensus += [key for batch_ in live[lost]["trained"] for key in batch_]
                change = Change(1, before, tuple(m for m in before if m != lost),
                                trained_batches={lost: len(live[lost]["trained"])})
            else:
                change = Change(1, before, (*before, world))
            for k in change.survivors:
                live[k]["sampler"].apply_change(change)
            live = [live[k] for k in change.survivors]
            if joiner_speed is not None:
                state = pickle.loads(pickle.dumps(live[0]["sampler"].state_for_joiner()))
                live.append(start(sampler_for_joiner(state, world, counter=store), joiner_speed))
                ranks.append(live[-1])
            for rank in live:
                if not rank["fetched"]:
                    fetch(rank)
                if rank["fetched"] and rank["end"] <= now:
                    heapq.heappush(events, (now, 0, ranks.index(rank)))
        elif ranks[r] in live and ranks[r]["fetched"]:
            rank = ranks[r]
            rank["trained"].append(rank["fetched"].pop(0))
            fetch(rank)
            rank["sampler"].batch_started()
            rank["end"] = now + 1.0 / rank["speed"]
            heapq.heappush(events, (rank["end"], 0, r))
    assert_exactly_once([key for rank in live for b in rank["trained"] for key in b] + consensus,
                        Counter(range(n)))
    return [rank["end"] for rank in live]


@pytest.mark.parametrize("speeds, joiner_speed, lost", [((4, 1), 2, None), ((4, 1), 1, None), ((4, 1, 1), None, 1)])
def test_after_a_join_or_a_loss_a_slow_rank_leaves_the_last_chunks_to_faster_ones(speeds, joiner_speed, lost):
    # The tail rule used to hold only in an epoch without a change: after one, a slow rank took one
    # of the pool's last chunks and the fast rank, out of data, waited up to one and a half slow
    # batches for it (in the balance model, 3 % of an epoch with a join on 2 ranks). Now the epoch
    # ends within a slow batch, as in an epoch without a change.
    slow_batch = 1.0 / min(speeds)
    for change_at in range(3, 70, 4):
        ends = pooled_epoch_with_a_change(speeds, float(change_at), joiner_speed, lost)
        assert max(ends) - ends[0] <= slow_batch + 1e-9, (change_at, ends)
