"""Unit tests of the data coverage a mid-epoch checkpoint keeps, and of resuming the dispatch from it."""

import random
from dataclasses import replace

import pytest
from test_data import SharedCounter

from lightning_elche.config import Dispatch
from lightning_elche.coverage import EpochCoverage, compress, expand, merge, runs, subtract
from lightning_elche.dispatch import build_sampler, epoch_permutation


def test_range_helpers():
    assert merge([(5, 7), (0, 2), (2, 3), (6, 9), (4, 4)]) == [(0, 3), (5, 9)]
    assert subtract([(0, 10)], [(2, 4), (3, 5), (8, 12)]) == [(0, 2), (5, 8)]
    assert subtract([(0, 3), (5, 9)], [(1, 6)]) == [(0, 1), (6, 9)]
    assert subtract([(0, 4)], []) == [(0, 4)]
    assert compress([3, 4, 5, 9, 1]) == [(1, 2), (3, 6), (9, 10)]
    assert expand([(1, 3), (7, 8)]) == [1, 2, 7]
    assert runs([]) == [] and runs([4]) == [(4, 5)]
    rng = random.Random(0)
    for _ in range(50):
        universe = compress(rng.sample(range(60), 40))
        taken = compress(rng.sample(range(70), 30))
        assert expand(subtract(universe, taken)) == sorted(set(expand(universe)) - set(expand(taken)))
        positions = sorted(rng.sample(range(80), 30))
        assert runs(positions) == compress(positions) and expand(runs(positions)) == positions


def make(dispatch, rank, counter, n=1000, batch=10, world=2, seed=3, **kw):
    sampler = build_sampler(Dispatch(dispatch), n, batch, rank, world, shuffle=True, seed=seed, counter=counter,
                            key_prefix=f"k{id(counter)}", max_chunk_batches=3, **kw)
    sampler.set_epoch(2)
    return sampler


def run_partially(samplers, rng, speeds, prefetch_batches):
    """Ranks train batches in a random interleaving; each keeps ``prefetch_batches`` batches claimed
    ahead of what it trained (a DataLoader with workers). Stops at a random point of the epoch.

    Returns the indices each rank trained and the number of batches it trained."""
    batch = samplers[0].batch_size
    iters = [iter(s) for s in samplers]
    claimed = [[] for _ in samplers]  # batches drawn from the sampler, not yet trained
    trained = [[] for _ in samplers]
    batches = [0 for _ in samplers]
    exhausted = [False for _ in samplers]

    def pull(r):
        chunk = []
        for _ in range(batch):
            try:
                chunk.append(next(iters[r]))
            except StopIteration:
                exhausted[r] = True
                break
        if chunk:
            claimed[r].append(chunk)

    for r in range(len(samplers)):
        for _ in range(prefetch_batches + 1):
            pull(r)
    stop_after = rng.randint(10, 40)
    for _ in range(stop_after):
        r = rng.choices(range(len(samplers)), weights=speeds)[0]
        if len(claimed[r]) <= 1:  # keep every rank with data left, as a sync checkpoint requires
            continue
        trained[r].extend(claimed[r].pop(0))
        batches[r] += 1
        if not exhausted[r]:
            pull(r)
    return trained, batches


def drain(samplers, rng, speeds):
    from test_data import drain_interleaved

    return drain_interleaved(samplers, rng, speeds)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("prefetch", [1, 3])
def test_pooled_resume_trains_every_untrained_pick_exactly_once(seed, prefetch):
    rng = random.Random(seed)
    n = 1000 + rng.randint(0, 9)  # with a partial last batch
    counter = SharedCounter()
    samplers = [make("pool", r, counter, n=n) for r in range(2)]
    trained, batches = run_partially(samplers, rng, (3, 1), prefetch)
    claimed = sum(s.record.samples for s in samplers)
    assert claimed > sum(map(len, trained))  # prefetch claimed more than was trained
    coverage = samplers[0].coverage([s.local_coverage(b) for s, b in zip(samplers, batches, strict=True)])
    assert coverage.remaining_samples == n - sum(map(len, trained))
    # The record survives a checkpoint round trip and resumes on fresh samplers (a new fit, a new counter).
    restored = EpochCoverage.from_state_dict(coverage.state_dict())
    assert restored == coverage
    fresh = SharedCounter()
    resumed = [make("pool", r, fresh, n=n) for r in range(2)]
    for s in resumed:
        s.resume(restored)
    rest = drain(resumed, rng, (1, 2))
    everything = sorted(trained[0] + trained[1] + rest[0] + rest[1])
    assert everything == list(range(n))


def test_resume_of_a_resumed_epoch_and_the_next_epoch_is_whole():
    rng = random.Random(7)
    counter = SharedCounter()
    samplers = [make("pool", r, counter) for r in range(2)]
    trained, batches = run_partially(samplers, rng, (1, 1), 2)
    seen = trained[0] + trained[1]
    coverage = samplers[0].coverage([s.local_coverage(b) for s, b in zip(samplers, batches, strict=True)])
    shared = SharedCounter()
    second = [make("pool", r, shared) for r in range(2)]
    for s in second:
        s.resume(coverage)
    trained2, batches2 = run_partially(second, rng, (1, 4), 1)
    seen += trained2[0] + trained2[1]
    coverage2 = second[0].coverage([s.local_coverage(b) for s, b in zip(second, batches2, strict=True)])
    assert coverage2.remaining_samples == 1000 - len(seen)
    shared3 = SharedCounter()
    third = [make("pool", r, shared3) for r in range(2)]
    for s in third:
        s.resume(coverage2)
    rest = drain(third, rng, (2, 1))
    assert sorted(seen + rest[0] + rest[1]) == list(range(1000))
    for s in third:  # the following epoch is dispatched whole again
        s.set_epoch(3)
    nxt = drain(third, rng, (1, 1))
    assert sorted(nxt[0] + nxt[1]) == list(range(1000))


def ratios_for(dispatch, world):
    """Keyword arguments of a sampler of ``dispatch`` for ``world`` ranks (fixed shares: uneven)."""
    return {"partition_ratios": [0.5] + [0.5 / (world - 1)] * (world - 1)} if dispatch == "fixed" else {}


def untrained_positions(samplers, trained):
    """Epoch positions (not sample indices) that no rank trained: the record's expected remainder."""
    order = epoch_permutation(samplers[0].num_samples, samplers[0].epoch, samplers[0].seed, True)
    done = {i for t in trained for i in t}
    return [p for p in range(samplers[0].samples_per_epoch) if order[p] not in done]


@pytest.mark.parametrize("dispatch", ["equal", "fixed"])
def test_equal_and_fixed_record_the_untrained_positions_and_resume_them(dispatch):
    rng = random.Random(1)
    samplers = [make(dispatch, r, None, n=1003, **ratios_for(dispatch, 2)) for r in range(2)]
    trained, batches = run_partially(samplers, rng, (2, 1), 2)
    gathered = [s.local_coverage(b) for s, b in zip(samplers, batches, strict=True)]
    assert gathered == [len(t) for t in trained]  # the gather stays one count per rank
    coverage = samplers[0].coverage(gathered)
    assert coverage.offsets is None and coverage.world_size == 2
    assert expand(coverage.remaining) == untrained_positions(samplers, trained)
    resumed = [make(dispatch, r, None, n=1003, **ratios_for(dispatch, 2)) for r in range(2)]
    for s in resumed:
        s.resume(EpochCoverage.from_state_dict(coverage.state_dict()))
    rest = [list(s) for s in resumed]
    assert sorted(trained[0] + trained[1] + rest[0] + rest[1]) == list(range(1003))
    if dispatch == "equal":  # the remainder is interleaved over the ranks: equal shares again
        assert abs(len(rest[0]) - len(rest[1])) <= 1


@pytest.mark.parametrize("dispatch", ["pool", "equal", "fixed"])
@pytest.mark.parametrize(("before", "after"), [(3, 2), (2, 3)])
@pytest.mark.parametrize("seed", range(3))
def test_resume_at_another_world_size_trains_every_pick_once_and_checkpoints_again(dispatch, before, after, seed):
    """W ranks train part of an epoch and checkpoint; W' ranks resume, train part of the rest and
    checkpoint again; W ranks finish it. Every pick is trained exactly once over the three runs."""
    rng = random.Random(seed)
    n = 1200 + rng.randint(0, 9)

    def world(size):
        counter = SharedCounter()
        return [make(dispatch, r, counter, n=n, world=size, **ratios_for(dispatch, size)) for r in range(size)]

    first = world(before)
    trained, batches = run_partially(first, rng, [3] + [1] * (before - 1), 2)
    coverage = first[0].coverage([s.local_coverage(b) for s, b in zip(first, batches, strict=True)])
    assert coverage.remaining_samples == n - sum(map(len, trained))
    second = world(after)
    for s in second:
        s.resume(EpochCoverage.from_state_dict(coverage.state_dict()))
    trained2, batches2 = run_partially(second, rng, [1] * (after - 1) + [3], 1)
    coverage2 = second[0].coverage([s.local_coverage(b) for s, b in zip(second, batches2, strict=True)])
    seen = [i for t in trained + trained2 for i in t]
    assert len(seen) == len(set(seen))
    assert coverage2.remaining_samples == n - len(seen)
    assert coverage2.world_size == after
    third = world(before)
    for s in third:
        s.resume(EpochCoverage.from_state_dict(coverage2.state_dict()))
    rest = drain(third, rng, [1] * before)
    assert sorted(seen + [i for r in rest for i in r]) == list(range(n))
    assert all(rest), "a rank of the resumed epoch got no data"


def test_a_legacy_per_rank_record_converts_to_positions_and_resumes_on_another_world_size():
    rng = random.Random(4)
    samplers = [make("equal", r, None, n=1003) for r in range(2)]
    trained, _ = run_partially(samplers, rng, (2, 1), 2)
    legacy = replace(samplers[0].identity(2), remaining=None, offsets=[len(t) for t in trained]).state_dict()
    del legacy["remaining"]  # a record written before the rank-agnostic coverage
    resumed = [make("equal", r, None, n=1003, world=3) for r in range(3)]
    for s in resumed:
        s.resume(EpochCoverage.from_state_dict(legacy))
    rest = [list(s) for s in resumed]
    assert sorted(trained[0] + trained[1] + [i for r in rest for i in r]) == list(range(1003))
    assert max(map(len, rest)) - min(map(len, rest)) <= 1
    with pytest.raises(ValueError, match="Rank 1 reports 600 trained picks of epoch 2; its stream has 501"):
        make("equal", 0, None, n=1003).resume(EpochCoverage.from_state_dict({**legacy, "offsets": [10, 600]}))


def test_a_legacy_fixed_share_record_resumes_only_on_its_world_size():
    ratios = {"partition_ratios": [0.7, 0.3]}
    samplers = [make("fixed", r, None, **ratios) for r in range(2)]
    trained, _ = run_partially(samplers, random.Random(2), (2, 1), 2)
    legacy = replace(samplers[0].identity(2), remaining=None, offsets=[len(t) for t in trained])
    same = [make("fixed", r, None, **ratios) for r in range(2)]
    for s in same:
        s.resume(legacy)
    assert sorted(trained[0] + trained[1] + list(same[0]) + list(same[1])) == list(range(1000))
    with pytest.raises(ValueError, match=r"partition_ratios for 2 ranks\) cannot be split over 3 ranks"):
        make("fixed", 0, None, world=3, partition_ratios=[0.4, 0.3, 0.3]).resume(legacy)


@pytest.mark.parametrize(
    ("change", "field"),
    [({"seed": 4}, "seed"), ({"batch": 20}, "batch_size"), ({"n": 999}, "picks"), ({"dispatch": "equal"}, "dispatch")],
)
def test_resume_into_a_different_order_is_refused_with_the_field(change, field):
    samplers = [make("pool", r, SharedCounter()) for r in range(2)]
    coverage = samplers[0].coverage([[(0, 30)], [(30, 60)]])
    other = make(change.pop("dispatch", "pool"), 0, SharedCounter(), **change)
    with pytest.raises(ValueError, match=rf"{field}=.*this run has {field}=.*the number of ranks may change"):
        other.resume(coverage)


@pytest.mark.parametrize("dispatch", ["pool", "equal", "fixed"])
@pytest.mark.parametrize("left", [0, 1, 9, 10, 25])
def test_a_remainder_thinner_than_the_ranks_resumes_with_ranks_left_without_a_batch(dispatch, left):
    """A checkpoint may leave fewer picks (pool: batches) than the resumed run has ranks, none at
    all included: the remainder is trained exactly once and the ranks it does not reach get an
    empty epoch (they join the rounds without a batch), rather than a refusal."""
    n, world = 1000, 4
    first = [make(dispatch, r, SharedCounter() if dispatch == "pool" else None, n=n, **ratios_for(dispatch, 2))
             for r in range(2)]
    order = epoch_permutation(first[0].num_samples, first[0].epoch, first[0].seed, True)
    coverage = EpochCoverage.from_state_dict({**first[0].coverage(
        [[(0, 500)], [(500, 1000)]] if dispatch == "pool" else [500, 500]).state_dict(),
        "remaining": [(300, 300 + left)] if left else []})
    counter = SharedCounter() if dispatch == "pool" else None
    resumed = [make(dispatch, r, counter, n=n, world=world, **ratios_for(dispatch, world)) for r in range(world)]
    for sampler in resumed:
        sampler.resume(coverage)
    rest = [list(s) for s in resumed]
    assert sorted(i for r in rest for i in r) == sorted(order[p] for p in range(300, 300 + left))
    units = -(-left // 10) if dispatch == "pool" else left  # batches of 10, or picks
    assert sum(1 for r in rest if r) <= min(world, units)
    if units < world:
        assert not all(rest)


def test_malformed_coverage_is_refused():
    with pytest.raises(ValueError, match="malformed"):
        EpochCoverage.from_state_dict({"epoch": 1})
    good = make("pool", 0, SharedCounter()).coverage([[(0, 30)], [(30, 60)]]).state_dict()
    with pytest.raises(ValueError, match="'remaining' must be disjoint"):
        EpochCoverage.from_state_dict({**good, "remaining": [[60, 100], [90, 120]]})
    with pytest.raises(ValueError, match="inside 0..1000"):
        EpochCoverage.from_state_dict({**good, "remaining": [[60, 1001]]})
    with pytest.raises(ValueError, match="either 'remaining' or 'offsets'"):
        EpochCoverage.from_state_dict({**good, "remaining": None})
