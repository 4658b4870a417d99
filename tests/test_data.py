import itertools
import random

import pytest
import torch
from torch.utils.data import DistributedSampler

from lightning_elche.config import Dispatch
from lightning_elche.dispatch import build_sampler, chunk_layout, epoch_permutation, fixed_share_batches

EQUAL, FIXED, POOL = Dispatch.EQUAL, Dispatch.FIXED, Dispatch.POOL


class SharedCounter:
    """An in-memory stand-in for the torch.distributed store: atomic add, append, check, get."""

    def __init__(self) -> None:
        self.values: dict[str, int] = {}
        self.texts: dict[str, bytes] = {}

    def add(self, key: str, amount: int) -> int:
        self.values[key] = self.values.get(key, 0) + amount
        return self.values[key]

    def append(self, key: str, value: str) -> None:
        self.texts[key] = self.texts.get(key, b"") + value.encode()

    def check(self, keys: list[str]) -> bool:
        return all(key in self.texts or key in self.values for key in keys)

    def get(self, key: str) -> bytes:
        if key in self.texts:
            return self.texts[key]
        return str(self.values[key]).encode()


def drain_interleaved(samplers, rng: random.Random, speeds):
    """Advance rank iterators in a random order biased by speed, as concurrent ranks would."""
    iters = [iter(s) for s in samplers]
    out = [[] for _ in samplers]
    live = list(range(len(samplers)))
    while live:
        r = rng.choices(live, weights=[speeds[k] for k in live])[0]
        try:
            out[r].append(next(iters[r]))
        except StopIteration:
            live.remove(r)
    return out


def make(dispatch, rank, counter=None, n=1000, batch=10, world=2, **kw):
    return build_sampler(dispatch, n, batch, rank, world, shuffle=True, seed=3, counter=counter, key_prefix="t", **kw)


def test_permutation_matches_distributed_sampler():
    ds = list(range(97))
    ref = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=5)
    ref.set_epoch(4)
    assert epoch_permutation(97, 4, 5, True) == list(ref)
    assert epoch_permutation(5, 0, 0, False) == [0, 1, 2, 3, 4]


def test_equal_split_reproduces_ddp_batches_without_padding():
    ds = list(range(100))
    for rank in range(2):
        ref = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=3)
        ref.set_epoch(2)
        mine = make(EQUAL, rank, n=100)
        mine.set_epoch(2)
        assert list(mine) == list(ref)
    odd = [list(make(EQUAL, r, n=101)) for r in range(2)]
    assert sorted(odd[0] + odd[1]) == list(range(101))


@pytest.mark.parametrize("speeds", [(1, 1), (3, 1), (1, 10)])
def test_pool_covers_every_sample_exactly_once_and_fast_ranks_claim_more(speeds):
    counter = SharedCounter()
    samplers = [make(POOL, r, counter, max_chunk_batches=4) for r in range(2)]
    for s in samplers:
        s.set_epoch(1)
    out = drain_interleaved(samplers, random.Random(0), speeds)
    assert sorted(out[0] + out[1]) == list(range(1000))
    if speeds[0] != speeds[1]:
        fast = 0 if speeds[0] > speeds[1] else 1
        assert len(out[fast]) > 2 * len(out[1 - fast])
    # Chunks are whole batches, so every rank's stream splits into full batches but the last.
    assert all(len(o) % 10 == 0 for o in out)


def test_pool_epochs_use_separate_counters_and_permutations():
    counter = SharedCounter()
    samplers = [make(POOL, r, counter) for r in range(2)]
    orders = []
    for epoch in (0, 1):
        for s in samplers:
            s.set_epoch(epoch)
        out = drain_interleaved(samplers, random.Random(epoch), (1, 1))
        assert sorted(out[0] + out[1]) == list(range(1000))
        orders.append(out[0][:10])
    assert orders[0] != orders[1]
    assert set(counter.values) == {"t/epoch0", "t/epoch1"}


def test_pool_reserves_one_chunk_per_rank():
    counter = SharedCounter()
    samplers = [make(POOL, r, counter, n=40, batch=10) for r in range(2)]
    # Rank 0 alone drains the pool before rank 1 starts: rank 1 still gets its reserved chunk.
    first = list(samplers[0])
    second = list(samplers[1])
    assert len(second) >= 10 and sorted(first + second) == list(range(40))


def test_pool_tail_is_one_partial_batch_and_drop_last_drops_only_the_global_tail():
    counter = SharedCounter()
    samplers = [make(POOL, r, counter, n=105) for r in range(2)]
    out = drain_interleaved(samplers, random.Random(1), (1, 1))
    assert sorted(out[0] + out[1]) == list(range(105))
    shared = SharedCounter()
    dropped = [make(POOL, r, shared, n=105, drop_last=True) for r in range(2)]
    out = drain_interleaved(dropped, random.Random(1), (1, 1))
    assert len(out[0]) + len(out[1]) == 100 and len(set(out[0] + out[1])) == 100


def test_chunk_layout_shrinks_toward_the_end_and_sums():
    layout = chunk_layout(100, 2, 4)
    assert sum(n for _, n in layout) == 100
    assert layout[0] == (0, 4) and layout[-1][1] == 1
    starts = [s for s, _ in layout]
    assert starts == sorted(starts) and all(a + n == b for (a, n), (b, _) in zip(layout, layout[1:], strict=False))
    assert all(n <= 4 for _, n in layout)


def test_chunk_layout_plans_the_tail_for_the_slowest_rank_share():
    # Default: half an equal share of what remains (the guided layout, unchanged).
    assert chunk_layout(100, 2, 4, 0.5) == chunk_layout(100, 2, 4)
    layout = chunk_layout(128, 2, 4, 0.2)
    assert sum(n for _, n in layout) == 128
    assert all(a + n == b for (a, n), (b, _) in zip(layout, layout[1:], strict=False))
    for first, count in layout:
        remaining = 128 - first
        assert count == max(1, min(4, int(remaining * 0.2 / 2)))
    # A slow rank holding a fifth of the speed meets 1-3 batch chunks from 40 batches left on,
    # where an equal share's layout still cuts 4.
    assert [n for s, n in layout if s >= 88][:3] == [4, 3, 3]
    assert [n for s, n in chunk_layout(128, 2, 4) if s >= 88][:3] == [4, 4, 4]


def test_every_rank_cuts_the_epoch_with_the_first_layout_share_proposed():
    # Ranks that hold different shares when they start the epoch (the first epoch's first round
    # adopted by one rank before the other starts) must still name the same chunks by index.
    counter = SharedCounter()
    samplers = [make(POOL, r, counter, n=2000) for r in range(2)]
    samplers[0].set_epoch(1)
    samplers[0].set_speed_shares([0.8, 0.2])
    first = iter(samplers[0])
    taken = [list(itertools.islice(first, 10))]
    samplers[1].set_epoch(1)
    samplers[1].set_speed_shares([0.5, 0.5])
    assert samplers[1]._layout_share() == 0.5 and samplers[0]._layout_share() == 0.2
    second = iter(samplers[1])
    taken.append(list(second))
    taken[0] += list(first)
    assert samplers[0].layout == samplers[1].layout == chunk_layout(200, 2, 4, 0.2)
    assert sorted(taken[0] + taken[1]) == list(range(2000))


def test_the_tail_rule_counts_from_the_latest_round():
    # A slow rank (a fifth of the speed) that trained 10 batches in a lockstep window, like the
    # fast one, and holds 2 more: from the epoch's start it looks far ahead of its share and would
    # leave the rest to the fast rank; from the round on, both have the same work left per speed.
    counter = SharedCounter()
    slow = make(POOL, 1, counter, n=400, batch=10, max_chunk_batches=2)
    slow.set_epoch(0)
    slow.set_speed_shares([0.8, 0.2])
    it = iter(slow)
    next(it)  # claims its reserved chunk
    # The pool handed out 30 batches of 2: 20 to the fast rank, 10 to the slow one (12 with its
    # reserved chunk); 6 of 40 are left.
    key = slow.pool_key(0)
    counter.add(key, 15)
    slow.record.samples = 12 * 10
    assert slow.leaves_tail()
    slow.on_round([0.8, 0.2], 0, [10, 10])
    assert not slow.leaves_tail()
    slow.on_round([0.8, 0.2], 1, [10, 10])  # another epoch's counts do not apply
    assert slow.leaves_tail()


def test_fixed_shares():
    assert fixed_share_batches(100, [0.75, 0.25]) == [75, 25]
    assert fixed_share_batches(10, [0.5, 0.3, 0.2]) == [5, 3, 2]
    assert fixed_share_batches(7, [0.5, 0.5]) == [4, 3]
    out = [list(make(FIXED, r, partition_ratios=[0.7, 0.3])) for r in range(2)]
    assert len(out[0]) == 700 and len(out[1]) == 300
    assert sorted(out[0] + out[1]) == list(range(1000))


def test_shuffle_is_deterministic_from_the_seed():
    a, b = make(EQUAL, 0), make(EQUAL, 0)
    a.set_epoch(3), b.set_epoch(3)
    assert list(a) == list(b)
    c = build_sampler(EQUAL, 1000, 10, 0, 2, shuffle=True, seed=4)
    c.set_epoch(3)
    assert list(c) != list(a)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 15, "batch": 10}, "too few"),
        ({"dispatch": "bogus"}, "dispatch="),
        ({"dispatch": FIXED, "partition_ratios": [0.999, 0.001]}, "no batch"),
    ],
)
def test_splits_that_leave_a_rank_without_data_are_refused(kwargs, message):
    dispatch = kwargs.pop("dispatch", POOL)
    with pytest.raises(ValueError, match=message):
        make(dispatch, 0, SharedCounter(), **kwargs)


def test_sampler_has_no_len_so_lightning_runs_until_exhausted():
    with pytest.raises(TypeError):
        len(make(POOL, 0, SharedCounter()))


def test_dispatch_record_counts_chunks():
    s = make(POOL, 1, SharedCounter(), n=200)
    got = list(s)  # alone on the counter: its reserved chunk 1, then every chunk from 2 on
    layout = chunk_layout(20, 2, 4)
    assert s.record.chunks == [1] + list(range(2, len(layout)))
    assert s.record.samples == len(got) == 200 - 10 * layout[0][1]
    assert torch.tensor(got).unique().numel() == len(got)


def test_split_adapts_within_the_epoch_when_a_rank_slows_down():
    counter = SharedCounter()
    samplers = [make(POOL, r, counter, n=4000, max_chunk_batches=2) for r in range(2)]
    iters = [iter(s) for s in samplers]
    rng = random.Random(5)
    taken = [[0, 0], [0, 0]]  # [half][rank]
    done = [False, False]
    total = 0
    while not all(done):
        half = 0 if total < 2000 else 1
        speeds = (1, 1) if half == 0 else (1, 8)  # rank 0 becomes 8x slower mid-epoch
        live = [k for k in range(2) if not done[k]]
        r = rng.choices(live, weights=[speeds[k] for k in live])[0]
        try:
            next(iters[r])
            taken[half][r] += 1
            total += 1
        except StopIteration:
            done[r] = True
    assert total == 4000
    assert abs(taken[0][0] - taken[0][1]) < 400  # even split while speeds were equal
    assert taken[1][1] > 4 * taken[1][0]  # after the slowdown, the other rank takes the bulk


def simulate_pool(speeds, shares=None, n=1000, batch=10, chunk=4, prefetch=0):
    """Ranks train whole batches of ``1 / speed`` time units each. A rank pulls a batch from its
    sampler ``prefetch`` batches before it starts it (Lightning's fetcher holds one), and reports
    started batches as the strategy does. Returns (per-rank samples, per-rank finish times)."""
    import heapq

    counter = SharedCounter()
    samplers = [make(POOL, r, counter, n=n, batch=batch, world=len(speeds), max_chunk_batches=chunk)
                for r in range(len(speeds))]
    for s in samplers:
        s.set_epoch(0)
        s.started_batches = 0
        if shares is not None:
            s.set_speed_shares(shares)
    iters = [iter(s) for s in samplers]
    out = [[] for _ in speeds]
    queues = [[] for _ in speeds]

    def pull(r):
        got = list(itertools.islice(iters[r], batch))
        if got:
            queues[r].append(got)
            out[r] += got

    for r in range(len(speeds)):
        for _ in range(prefetch):
            pull(r)
    finish = [0.0] * len(speeds)
    ready = [(0.0, r) for r in range(len(speeds))]
    while ready:
        now, r = heapq.heappop(ready)
        if not queues[r]:
            pull(r)
        if not queues[r]:
            finish[r] = now
            continue
        queues[r].pop(0)
        samplers[r].started_batches += 1
        while len(queues[r]) < prefetch:
            before = len(queues[r])
            pull(r)
            if len(queues[r]) == before:
                break
        heapq.heappush(ready, (now + 1.0 / speeds[r], r))
    return out, finish


@pytest.mark.parametrize("speeds", [(4, 1), (1, 4), (3, 2, 1), (1, 1), (10, 1)])
@pytest.mark.parametrize("prefetch", [0, 1, 4])
def test_speed_shares_keep_exactly_once_and_never_lengthen_the_epoch(speeds, prefetch):
    plain, plain_finish = simulate_pool(speeds, prefetch=prefetch)
    aware, aware_finish = simulate_pool(speeds, shares=speeds, prefetch=prefetch)
    assert sorted(x for o in aware for x in o) == list(range(1000))
    assert max(aware_finish) <= max(plain_finish) + 1e-9


@pytest.mark.parametrize("speeds, prefetch", [((5, 1), 1), ((4, 1), 4)])
def test_a_slow_rank_leaves_the_last_chunks_to_the_fast_one(speeds, prefetch):
    plain, plain_finish = simulate_pool(speeds, prefetch=prefetch)
    aware, aware_finish = simulate_pool(speeds, shares=speeds, prefetch=prefetch)
    # Without shares the slow rank still holds claimed batches when the fast one runs dry.
    assert plain_finish[1] >= plain_finish[0] + 1.5
    # With them it stops claiming early enough that the epoch ends over a slow batch sooner.
    assert max(aware_finish) <= max(plain_finish) - 1.0
    assert len(aware[1]) < len(plain[1])


def test_the_fastest_rank_always_claims_even_on_equal_shares():
    out, _ = simulate_pool((1, 1, 1), shares=(1, 1, 1))
    assert sorted(x for o in out for x in o) == list(range(1000))


@pytest.mark.parametrize("shares", [(1.0,), (1.0, -1.0), (0.0, 0.0), (float("nan"), 1.0)])
def test_speed_shares_are_validated(shares):
    with pytest.raises(ValueError, match="speed shares"):
        make(POOL, 0, SharedCounter()).set_speed_shares(shares)



def simulate_pool_with_rounds(speeds, plans, adopt_times, n=1000, batch=10, chunk=4, seed=0):
    """Like :func:`simulate_pool` (prefetch 0), but the ranks adopt a sequence of round plans
    (``plans[k]``, the same for every rank, in order) each at its own times (``adopt_times[r][k]``),
    as ranks adopt non-blocking rounds at different steps in cpu_async: at any moment ranks may
    hold the plans of different rounds. Returns per-rank samples."""
    import heapq

    counter = SharedCounter()
    world = len(speeds)
    samplers = [make(POOL, r, counter, n=n, batch=batch, world=world, max_chunk_batches=chunk) for r in range(world)]
    for s in samplers:
        s.set_epoch(0)
        s.started_batches = 0
    iters = [iter(s) for s in samplers]
    adopted = [0] * world
    out = [[] for _ in speeds]
    rng = random.Random(seed)
    ready = [(0.0, r) for r in range(world)]
    while ready:
        now, r = heapq.heappop(ready)
        while adopted[r] < len(plans) and adopt_times[r][adopted[r]] <= now:
            samplers[r].set_speed_shares(plans[adopted[r]])
            adopted[r] += 1
        got = list(itertools.islice(iters[r], batch))
        if not got:
            continue
        out[r] += got
        samplers[r].started_batches += 1
        heapq.heappush(ready, (now + rng.uniform(0.9, 1.1) / speeds[r], r))
    return out


def test_ranks_holding_different_rounds_plans_never_all_leave_the_tail():
    # Two equally fast ranks whose plans alternate which one looks faster, each adopted half a
    # window later on rank 1 than on rank 0. Each rank, seeing the other as the fastest, used to
    # stop claiming near the end, and the rest of the pool went untrained (the cpu_async loss).
    plans = [(1.0, 1.02) if k % 2 == 0 else (1.02, 1.0) for k in range(40)]
    times = [[3.0 * k for k in range(40)], [3.0 * k + 1.5 for k in range(40)]]
    for seed in range(20):
        out = simulate_pool_with_rounds((1, 1), plans, times, seed=seed)
        assert sorted(x for o in out for x in o) == list(range(1000)), f"seed {seed}"


@pytest.mark.parametrize("world", [2, 3, 5, 8, 16])
def test_random_round_plans_adopted_at_random_times_keep_exactly_once(world):
    # Plans with ties, near-ties and zeros, adopted by every rank in order at its own random
    # times: whatever each rank believes at any moment, every sample is trained exactly once.
    for seed in range(12):
        rng = random.Random(1000 * world + seed)
        speeds = [rng.choice((1, 2, 4, 8)) for _ in range(world)]
        plans = [[rng.choice((0, 1, 2, 4, 8)) for _ in range(world)] for _ in range(10)]
        for plan in plans:
            plan[rng.randrange(world)] += 1  # a positive sum
        times = [sorted(rng.uniform(0, 500 / world) for _ in plans) for _ in range(world)]
        out = simulate_pool_with_rounds(speeds, plans, times, n=2000, batch=8, seed=seed)
        assert sorted(x for o in out for x in o) == list(range(2000)), f"seed {seed}, speeds {speeds}"


def test_each_dispatch_policy_is_its_own_class():
    from lightning_elche.dispatch import EqualDispatch, FixedDispatch, PoolDispatch

    common = {"shuffle": False, "seed": 0}
    assert type(build_sampler(EQUAL, 40, 4, 0, 2, **common)) is EqualDispatch
    assert type(build_sampler(FIXED, 40, 4, 0, 2, partition_ratios=[0.5, 0.5], **common)) is FixedDispatch
    assert type(build_sampler(POOL, 40, 4, 0, 2, counter=SharedCounter(), **common)) is PoolDispatch
    assert type(PoolDispatch(40, 4, 0, 2, counter=SharedCounter(), **common)) is PoolDispatch
    # The builder takes the run mode's enum, not its name: no string round trip.
    expected = r"dispatch='round_robin'\) is invalid: expected a lightning_elche.config.Dispatch"
    with pytest.raises(ValueError, match=expected):
        build_sampler("round_robin", 40, 4, 0, 2, **common)
    with pytest.raises(ValueError, match=r"dispatch='pool'\) is invalid: .*Dispatch\(name\)"):
        build_sampler("pool", 40, 4, 0, 2, counter=SharedCounter(), **common)
    from lightning_elche.dispatch import ElCheSampler

    with pytest.raises(TypeError, match="interface of the dispatch policies"):
        ElCheSampler(40, 4, 0, 2, **common)


def test_only_the_pool_follows_the_round_plan():
    equal = build_sampler(EQUAL, 40, 4, 1, 2, shuffle=False, seed=0)
    equal.on_round([3, 1])  # nothing to adapt: the split is fixed
    assert list(equal) == list(range(1, 40, 2))
    pool = build_sampler(POOL, 40, 4, 1, 2, shuffle=False, seed=0, counter=SharedCounter())
    pool.on_round([0, 0])  # a plan without work carries no speed information
    assert pool.speed_shares is None
    pool.on_round([3, 1])
    assert pool.speed_shares == [0.75, 0.25]


def test_the_tail_rule_never_scans_the_layout_at_a_claim(monkeypatch):
    # The leave-the-tail check runs at every claim: summing the chunks left made a claim cost
    # O(chunks) (119 us per claim in a 32 000-batch epoch). A layout that refuses to be scanned
    # shows that a claim only indexes it, and the O(1) count must equal the plain sum.
    import lightning_elche.dispatch.pool as pool

    class NoScan(list):
        def __iter__(self):
            raise AssertionError("the layout was scanned during a claim")

        def __getitem__(self, key):
            if isinstance(key, slice):
                raise AssertionError("the layout was sliced during a claim")
            return super().__getitem__(key)

    layouts = []

    def unscannable_layout(*args):
        layout = NoScan(chunk_layout(*args))
        layouts.append(layout)
        return layout

    monkeypatch.setattr(pool, "chunk_layout", unscannable_layout)
    counter = SharedCounter()
    samplers = [make(POOL, r, counter, n=4000, batch=4, world=4) for r in range(4)]
    for s in samplers:
        s.set_speed_shares([1.0, 2.0, 3.0, 4.0])
    out = drain_interleaved(samplers, random.Random(0), (1, 2, 3, 4))
    assert sorted(x for o in out for x in o) == list(range(4000))
    layout = list.__iter__(layouts[0])
    counts = [count for _, count in layout]
    for chunk in range(len(counts) + 1):
        assert samplers[0].batches_from(chunk) == sum(counts[chunk:])
