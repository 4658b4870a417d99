"""Unit tests of the data coverage a mid-epoch checkpoint keeps, and of resuming the dispatch from it."""

import random

import pytest
from test_data import SharedCounter

from lightning_elche.coverage import EpochCoverage, compress, expand, merge, subtract
from lightning_elche.data import ElCheSampler


def test_range_helpers():
    assert merge([(5, 7), (0, 2), (2, 3), (6, 9), (4, 4)]) == [(0, 3), (5, 9)]
    assert subtract([(0, 10)], [(2, 4), (3, 5), (8, 12)]) == [(0, 2), (5, 8)]
    assert subtract([(0, 3), (5, 9)], [(1, 6)]) == [(0, 1), (6, 9)]
    assert subtract([(0, 4)], []) == [(0, 4)]
    assert compress([3, 4, 5, 9, 1]) == [(1, 2), (3, 6), (9, 10)]
    assert expand([(1, 3), (7, 8)]) == [1, 2, 7]
    rng = random.Random(0)
    for _ in range(50):
        universe = compress(rng.sample(range(60), 40))
        taken = compress(rng.sample(range(70), 30))
        assert expand(subtract(universe, taken)) == sorted(set(expand(universe)) - set(expand(taken)))


def make(dispatch, rank, counter, n=1000, batch=10, world=2, seed=3, **kw):
    sampler = ElCheSampler(n, batch, rank, world, shuffle=True, seed=seed, dispatch=dispatch, counter=counter,
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


@pytest.mark.parametrize("dispatch", ["equal", "fixed"])
def test_equal_and_fixed_resume_each_rank_where_its_stream_stopped(dispatch):
    kw = {"partition_ratios": [0.7, 0.3]} if dispatch == "fixed" else {}
    rng = random.Random(1)
    samplers = [make(dispatch, r, None, n=1003, **kw) for r in range(2)]
    trained, batches = run_partially(samplers, rng, (2, 1), 2)
    coverage = samplers[0].coverage([s.local_coverage(b) for s, b in zip(samplers, batches, strict=True)])
    assert coverage.offsets == [len(t) for t in trained]
    resumed = [make(dispatch, r, None, n=1003, **kw) for r in range(2)]
    for s in resumed:
        s.resume(coverage)
    rest = [list(s) for s in resumed]
    assert sorted(trained[0] + trained[1] + rest[0] + rest[1]) == list(range(1003))
    assert rest[0] == list(samplers[0])[len(trained[0]):]  # the rank's own stream, continued


@pytest.mark.parametrize(
    ("change", "field"),
    [({"seed": 4}, "seed"), ({"batch": 20}, "batch_size"), ({"n": 999}, "picks"), ({"world": 3}, "world_size")],
)
def test_resume_into_a_different_order_is_refused_with_the_field(change, field):
    samplers = [make("pool", r, SharedCounter()) for r in range(2)]
    coverage = samplers[0].coverage([[(0, 30)], [(30, 60)]])
    other = make("pool", 0, SharedCounter(), **change)
    with pytest.raises(ValueError, match=rf"{field}=.*this run has {field}="):
        other.resume(coverage)


def test_resume_that_leaves_a_rank_without_a_batch_is_refused():
    samplers = [make("pool", r, SharedCounter()) for r in range(2)]
    coverage = samplers[0].coverage([[(0, 600)], [(600, 990)]])  # one batch left for two ranks
    with pytest.raises(ValueError, match="1 batch"):
        make("pool", 0, SharedCounter()).resume(coverage)


def test_malformed_coverage_is_refused():
    with pytest.raises(ValueError, match="malformed"):
        EpochCoverage.from_state_dict({"epoch": 1})
