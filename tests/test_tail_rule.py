"""The end-of-epoch tail rule of the pooled dispatch, as a pure object: no store, no sampler."""

from __future__ import annotations

import random

import pytest

from lightning_elche.dispatch import SMALLEST_LAYOUT_SHARE, TailRule


class Chunk:
    """The next chunk's size and the pool left from it as the rule reads them, counting the reads
    (each is a store round trip). ``pool`` defaults to the chunk alone (the pool's last chunk)."""

    def __init__(self, size, pool=None):
        self.size, self.pool = size, size if pool is None else pool
        self.reads = 0

    def __call__(self):
        self.reads += 1
        return None if self.size is None else (self.size, self.pool)


def test_the_drainer_is_the_fastest_rank_and_stays_for_the_epoch():
    rule = TailRule.from_shares([1, 3, 3, 2], 4)
    assert rule.shares == pytest.approx((1 / 9, 3 / 9, 3 / 9, 2 / 9))
    assert rule.drainer == 1  # a tie goes to the lower rank
    later = rule.with_shares([9, 1, 1, 1])  # rank 0 now looks fastest: the drainer stays
    assert later.drainer == 1 and later.shares[0] == pytest.approx(0.75)
    assert TailRule.from_shares(later.shares, 4).drainer == 0  # a new epoch chooses again


def test_the_drainer_never_leaves_the_tail():
    rule = TailRule.from_shares([0.0, 1.0], 2, drainer=0)  # no speed at all, yet the drainer
    chunk = Chunk(4)
    assert not rule.leaves_tail(0, claimed=30, at_round=[0, 0], total=40, largest_chunk=4, next_chunk=chunk)
    assert chunk.reads == 0
    assert rule.leaves_tail(1, claimed=0, at_round=[0, 0], total=40, largest_chunk=4, next_chunk=chunk) is False


def test_a_rank_without_speed_leaves_and_a_rank_with_all_of_it_stays():
    rule = TailRule.from_shares([1.0, 0.0], 2)
    chunk = Chunk(1)
    assert rule.leaves_tail(1, claimed=1, at_round=[0, 0], total=100, largest_chunk=4, next_chunk=chunk)
    assert not TailRule.from_shares([0.0, 1.0], 2, drainer=0).leaves_tail(
        1, claimed=99, at_round=[0, 0], total=100, largest_chunk=4, next_chunk=chunk)
    assert chunk.reads == 0


def test_the_rule_counts_from_the_latest_round():
    # test_data's sampler scenario as numbers: a slow rank (a fifth of the speed) claimed 12 of
    # 40 batches; from the epoch's start it looks far ahead and leaves, from a round at which both
    # ranks had trained 10 it has as much left per speed as the fast rank and stays.
    rule = TailRule.from_shares([0.8, 0.2], 2)
    chunk = Chunk(2)
    assert rule.leaves_tail(1, claimed=12, at_round=[0, 0], total=40, largest_chunk=2, next_chunk=chunk)
    assert chunk.reads == 1
    assert not rule.leaves_tail(1, claimed=12, at_round=[10, 10], total=40, largest_chunk=2, next_chunk=chunk)
    assert chunk.reads == 1  # even the largest chunk keeps it first to finish: no store read


def test_a_dry_pool_never_makes_a_rank_leave():
    rule = TailRule.from_shares([0.8, 0.2], 2)
    assert not rule.leaves_tail(1, claimed=12, at_round=[0, 0], total=40, largest_chunk=2, next_chunk=Chunk(None))


def test_on_a_tie_the_rank_takes_the_chunk():
    rule = TailRule.from_shares([1, 1], 2)  # drainer 0; rank 1 decides
    # mine 2, rest 4 (the others' claimed-untrained work and the pool): a chunk of 2 ends both at 4.
    assert not rule.leaves_tail(1, claimed=2, at_round=[0, 0], total=6, largest_chunk=2, next_chunk=Chunk(2))
    # A chunk of 3 would end this rank later (5) than the others without it (4): it leaves.
    assert rule.leaves_tail(1, claimed=2, at_round=[0, 0], total=6, largest_chunk=3, next_chunk=Chunk(3))


def test_the_shortcut_only_skips_reads_whose_answer_is_stay():
    # The rule reads the next chunk only when the largest chunk could end this rank later: every
    # decision made without the read must be the one any chunk up to the largest would give.
    rng = random.Random(0)
    skipped = leaving = 0
    for _ in range(3000):
        world = rng.randint(2, 5)
        rule = TailRule.from_shares([rng.choice((0, 1, 2, 5, 9)) + rng.random() for _ in range(world)], world)
        rank = rng.randrange(world)
        total = rng.randint(world, 200)
        at_round = [rng.randint(0, total // world) for _ in range(world)]
        claimed = rng.randint(at_round[rank], max(at_round[rank], total - sum(at_round) + at_round[rank]))
        largest = rng.randint(1, 8)
        size = rng.randint(1, largest)
        rest = total - claimed - (sum(at_round) - at_round[rank])
        chunk = Chunk(size, rng.randint(size, max(size, rest)))
        leaves = rule.leaves_tail(rank, claimed, at_round, total, largest, chunk)
        leaving += leaves
        share = rule.shares[rank]
        if rank == rule.drainer or share <= 0 or share >= 1:
            continue
        mine, others = claimed - at_round[rank], 1 - share
        faster = sum(s for k, s in enumerate(rule.shares) if (s, -k) > (share, -rank))
        if faster <= 0:
            assert not leaves, "the fastest rank never leaves the tail"
            continue
        theirs = max(0, rest - chunk.pool) * faster / others + chunk.pool
        for c in range(1, largest + 1):
            later = max((mine + c) / share, (theirs - c) / faster) > max(mine / share, theirs / faster)
            if chunk.reads == 0:
                assert not later, (rank, claimed, at_round, total, largest, c)
            elif c == size:
                assert leaves == later
        skipped += chunk.reads == 0
    assert skipped > 100 and leaving > 100


def test_a_slow_rank_counts_only_the_faster_ranks_as_taking_what_it_leaves():
    # Four ranks, rank 1 the second slowest: leaving its chunk to the others would give it to
    # ranks 2 and 3 only (rank 0 is slower and leaves too); counted as every other rank's work, the
    # end without it looked earlier than it is, and all but the drainer left the tail.
    rule = TailRule.from_shares([1, 2, 3, 4], 4)
    args = dict(claimed=1, at_round=[0, 0, 0, 0], total=12, largest_chunk=2)
    assert not rule.leaves_tail(1, next_chunk=Chunk(2, pool=7), **args)
    everyone = max((1 + 2) / 0.2, (11 - 2) / 0.8) > max(1 / 0.2, 11 / 0.8)  # the old rule's answer
    assert everyone, "the old rule left this chunk"


@pytest.mark.parametrize("shares", [(1.0,), (1.0, -1.0), (0.0, 0.0), (float("nan"), 1.0), (float("inf"), 1.0)])
def test_bad_shares_are_refused(shares):
    with pytest.raises(ValueError, match=r"speed shares .* are invalid: expected 2 finite values >= 0"):
        TailRule.from_shares(shares, 2)


def test_the_layout_plans_for_the_slowest_share_with_a_floor():
    assert TailRule.from_shares([3, 1], 2).layout_share == pytest.approx(0.25)
    assert TailRule.from_shares([1, 0], 2).layout_share == SMALLEST_LAYOUT_SHARE
