"""A stuck rank is told from a slow one by its own speed (``membership/stall.py``).

Pure logic first (the bound, the knob, a simulated steady 10x slower rank that is never flagged and
a stuck one that is), then the stamps through a real in-process store and heartbeat threads, then
the phases outside training (evaluation steps, the phases without steps of an epoch's end, the
stillness a reader witnessed). The jobs with real processes: an endless loop in ``training_step``
and a rank asleep inside a collective in ``tests/test_rank_loss.py``, a loop in ``validation_step``
and a 10x slower validating rank in ``tests/test_validation_loss.py``, loops at an epoch's end in
``tests/test_epoch_end_loss.py``.
"""

from __future__ import annotations

import random
import threading
import time
from datetime import timedelta
from typing import Any, Optional

import pytest
import torch.distributed as dist

from lightning_elche import ElCheStrategy
from lightning_elche.membership.agreement import Membership
from lightning_elche.membership.stall import (
    BETWEEN,
    EVALUATING,
    IDLE,
    STALL_FLOOR,
    STALL_SLACK_S,
    STALL_WINDOWS,
    TRAINING,
    ProgressStamp,
    Stamp,
    phase_bound_s,
    resolve_stall_timeout,
    stall_bound_s,
    stall_verdict,
)

FLOOR_S = STALL_FLOOR.total_seconds()


# -- the bound ---------------------------------------------------------------------------------------


def test_the_bound_is_the_floor_for_short_windows_and_grows_with_the_rank_s_own_window() -> None:
    assert stall_bound_s(None, None) is None, "nothing measured: never flagged"
    assert stall_bound_s(0.05, 0.01) == FLOOR_S
    assert stall_bound_s(30.0, 1.0) == pytest.approx(STALL_WINDOWS * 31.0 + STALL_SLACK_S)
    assert stall_bound_s(30.0, 1.0, floor_s=1.0) == pytest.approx(STALL_WINDOWS * 31.0 + STALL_SLACK_S)
    assert stall_bound_s(0.05, 0.0, floor_s=1.0) == pytest.approx(STALL_WINDOWS * 0.05 + STALL_SLACK_S)
    assert stall_bound_s(None, None, override=timedelta(seconds=7)) == 7.0, "the override holds from the start"
    assert stall_bound_s(300.0, 5.0, override=timedelta(seconds=7)) == 7.0


def test_a_held_stamp_is_not_judged_and_leaving_the_hold_is_progress() -> None:
    stamp = ProgressStamp()
    stamp.enter_training()
    stamp.expect(1.0, 0.1)
    before = stamp.stamp(0.0)
    assert before.bound_s == FLOOR_S
    with stamp.held():
        inside = stamp.stamp(100.0)
        assert inside.bound_s is None and inside.count > before.count and inside.still_s == 0.0
    after = stamp.stamp(200.0)
    assert after.bound_s == FLOOR_S and after.count > inside.count and after.still_s == 0.0
    assert stamp.stamp(230.0).still_s == 30.0, "the stillness is counted on the publisher's own clock"
    assert Stamp.loads(after.dumps().encode()) == after
    assert Stamp.loads(Stamp(3, 1.5, None).dumps()) == Stamp(3, 1.5, None)


def test_training_is_judged_by_its_windows_from_its_first_batch() -> None:
    stamp = ProgressStamp(timedelta(seconds=5))
    assert stamp.stamp(0.0).bound_s is None, "not before the first step"
    stamp.enter_training()
    assert stamp.stamp(1.0).bound_s == 5.0 and stamp.stamp(1.0).phase == TRAINING
    stamp.leave_training()
    stamp.enter_training()
    back = stamp.stamp(101.0)
    assert back.bound_s == 5.0 and back.still_s == 0.0, "entering again is progress"
    assert stall_verdict(stamp.stamp(107.0)) is not None, "training: the rank's own account, unwitnessed"


def test_the_stamp_carries_its_phase_and_a_three_field_stamp_is_a_training_one() -> None:
    for phase in (TRAINING, EVALUATING, BETWEEN, IDLE):
        assert Stamp.loads(Stamp(7, 2.5, 20.0, phase).dumps()) == Stamp(7, 2.5, 20.0, phase)
    assert Stamp.loads(b"7 2.5 20.0") == Stamp(7, 2.5, 20.0, TRAINING)


@pytest.mark.parametrize("value", [timedelta(seconds=0.5), timedelta(0), 30, 30.0, "30s", True])
def test_a_bad_stall_timeout_names_the_knob_the_value_and_what_is_allowed(value: Any) -> None:
    pattern = r"ElCheStrategy\(stall_timeout=.*\) is invalid: expected None \(derived"
    with pytest.raises(ValueError, match=pattern):
        resolve_stall_timeout(value)
    with pytest.raises(ValueError, match=pattern):
        ElCheStrategy(stall_timeout=value)


def test_a_stall_timeout_at_the_transport_timeout_is_refused() -> None:
    with pytest.raises(ValueError, match=r"stall_timeout=.* is invalid: expected a timedelta shorter than timeout="):
        ElCheStrategy(stall_timeout=timedelta(seconds=60), timeout=timedelta(seconds=60))
    assert ElCheStrategy(stall_timeout=timedelta(seconds=5)).stall_timeout == timedelta(seconds=5)
    assert ElCheStrategy().stall_timeout is None


# -- a simulated fit: one rank publishing its stamp, one peer judging it -----------------------------


def simulate(step_s: float, planned: int, rounds: int, observer_window_s: float, stuck_at: Optional[float] = None,
             published_window_s: Optional[float] = None, seed: int = 0) -> tuple[Optional[str], float, float]:
    """A rank training ``rounds`` windows of ``planned`` steps of about ``step_s`` (+-20 %, steady),
    each followed by a 1 s round in which it waits on its peers; its heartbeat publishes its stamp
    once a second. A peer looks at it twice a second, but only while the peer itself waits in a
    round (from the end of its own window of ``observer_window_s`` until this rank arrives), as the
    real peers do. ``stuck_at``: the rank makes no progress from then on. ``published_window_s``:
    publish that window instead of the measured one (what a bound not derived from the rank's own
    speed would do). Returns the peer's verdict, when it came and the rank's last progress
    (simulated seconds)."""
    jitter = random.Random(seed)
    stamp = ProgressStamp()
    stamp.enter_training()
    events: list[tuple[float, str]] = []  # (time, "step" | "wait" | "expect:<window>")
    arrivals: list[tuple[float, float]] = []  # (window start, this rank's arrival at the round)
    t = 0.0
    for _ in range(rounds):
        start = t
        for _ in range(planned):
            events.append((t, "step"))
            t += step_s * jitter.uniform(0.8, 1.2)
        window = t - start
        arrivals.append((start, t))
        for k in range(2):  # the round: a watched wait advances every slice
            events.append((t + 0.5 * k, "wait"))
        t += 1.0
        events.append((t, f"expect:{published_window_s if published_window_s is not None else window}"))
    end = t + 60.0
    if stuck_at is not None:
        events = [e for e in events if e[0] < stuck_at]
        arrivals = [(s, a if a < stuck_at else end) for s, a in arrivals]
    last_progress = max(e[0] for e in events if not e[1].startswith("expect:"))
    published: Optional[Stamp] = None
    next_publish, next_look, cursor = 0.0, 0.0, 0
    now = 0.0
    while now < end:
        while cursor < len(events) and events[cursor][0] <= now:
            kind = events[cursor][1]
            if kind.startswith("expect:"):
                stamp.expect(float(kind.split(":")[1]), 1.0)
            else:
                stamp.advance()
            cursor += 1
        if now >= next_publish:
            published, next_publish = stamp.stamp(now), next_publish + 1.0
        if now >= next_look:
            next_look += 0.5
            waiting = any(start + observer_window_s <= now < arrival for start, arrival in arrivals)
            verdict = stall_verdict(published) if waiting else None
            if verdict is not None:
                return verdict, now, last_progress
        now = round(now + 0.05, 6)
    return None, end, last_progress


# The fast ranks take 3 s steps, this one 30 s: in a sync mode (one step per window) a fast peer
# waits 27 s for it every round; in a cadence mode (3 steps: 90 s windows, the peers' windows as
# long) it waits little, but the rank's steps are 30 s apart.
SLOW = [pytest.param(1, 3.0, id="sync-one-step-windows"), pytest.param(3, 88.0, id="cadence-balanced-windows")]


@pytest.mark.parametrize(("planned", "observer_window_s"), SLOW)
def test_a_steady_ten_times_slower_rank_is_never_flagged(planned: int, observer_window_s: float) -> None:
    for seed in range(5):
        verdict, _, _ = simulate(30.0, planned, rounds=30, observer_window_s=observer_window_s, seed=seed)
        assert verdict is None, f"seed {seed}: a slow but steady rank was flagged: {verdict}"


def test_the_same_slow_rank_would_be_flagged_by_a_bound_from_the_fast_ranks_window() -> None:
    # What the rule guards against: judged by a fast rank's window (3 s), the slow rank's 30 s
    # steps exceed the bound while its peer waits for it.
    verdict, _, _ = simulate(30.0, 1, rounds=10, observer_window_s=3.0, published_window_s=3.0)
    assert verdict is not None and "stalled" in verdict


@pytest.mark.parametrize(("planned", "observer_window_s"), SLOW)
def test_a_stuck_slow_rank_is_flagged_within_its_own_bound(planned: int, observer_window_s: float) -> None:
    verdict, at, last = simulate(30.0, planned, rounds=20, observer_window_s=observer_window_s, stuck_at=400.0)
    assert verdict is not None, "a rank that stopped progressing must be found"
    shortest, longest = stall_bound_s(24.0 * planned, 1.0), stall_bound_s(36.0 * planned, 1.0)
    assert shortest is not None and longest is not None
    assert shortest <= at - last <= longest + 2.0, f"found {at - last:.1f} s after its last progress"


def test_a_stuck_fast_rank_is_flagged_at_the_floor() -> None:
    verdict, at, last = simulate(0.01, 20, rounds=60, observer_window_s=0.1, stuck_at=10.0)
    assert verdict is not None
    assert FLOOR_S <= at - last <= FLOOR_S + 2.0


def test_a_rank_never_measured_is_not_judged_without_an_override() -> None:
    assert stall_verdict(None) is None
    assert stall_verdict(Stamp(5, 1000.0, None)) is None, "no bound published: nothing measured yet, or a hold"
    assert stall_verdict(Stamp(5, 9.0, 10.0)) is None
    verdict = stall_verdict(Stamp(5, 10.5, 10.0))
    assert verdict is not None and "no progress for 10.5 s" in verdict and "its own bound: 10.0 s" in verdict
    assert stall_verdict(Stamp(5, 60.0, 10.0), beat_age_s=6.0) is None, "a silent heartbeat is liveness's"


# -- through a real store and heartbeat threads ------------------------------------------------------


def members(store: Any, stall: timedelta) -> list[Membership]:
    ms = [Membership(store, "fit", r, [0, 1], timedelta(seconds=10), join_timeout=timedelta(seconds=5),
                     stall_timeout=stall) for r in (0, 1)]
    for m in ms:
        m.progress.enter_training()
    return ms


def test_a_live_member_that_makes_no_progress_is_lost_and_one_that_steps_is_not() -> None:
    ms = members(dist.HashStore(), timedelta(seconds=1))
    observer, peer = ms
    stop = threading.Event()

    def steps() -> None:
        while not stop.wait(0.2):
            peer.progress.advance()

    stepping = threading.Thread(target=steps, daemon=True)
    stepping.start()
    try:
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:  # stepping every 0.2 s: never stalled
            assert observer.detect_lost() == {}
            time.sleep(0.1)
        stop.set()
        stepping.join()
        started = time.monotonic()
        lost: dict[int, str] = {}
        while not lost and time.monotonic() - started < 6.0:
            lost = observer.detect_lost()
            time.sleep(0.1)
        elapsed = time.monotonic() - started
        assert set(lost) == {1} and "stalled" in lost[1] and "heartbeat goes on" in lost[1], lost
        assert 0.9 <= elapsed <= 3.5, f"found after {elapsed:.1f} s with stall_timeout=1 s"
    finally:
        stop.set()
        for m in ms:
            m.close()


def test_a_member_in_a_hold_is_not_judged() -> None:
    ms = members(dist.HashStore(), timedelta(seconds=1))
    observer, peer = ms
    try:
        with peer.progress.held():
            time.sleep(1.2)  # the heartbeat publishes the hold within its 1 s period
            deadline = time.monotonic() + 2.5
            while time.monotonic() < deadline:
                assert observer.detect_lost() == {}
                time.sleep(0.1)
    finally:
        for m in ms:
            m.close()




# -- evaluation steps and the phases without steps (issue 23, item 3, every phase) -------------------


def publish_until(stamp: ProgressStamp, start: float, end: float) -> Stamp:
    """The heartbeat thread's looks from ``start`` to ``end`` (once a second); the last stamp."""
    t = start
    last = stamp.stamp(t)
    while t + 1.0 <= end:
        t += 1.0
        last = stamp.stamp(t)
    return last


def test_the_first_evaluation_step_is_not_judged_and_the_next_ones_by_the_longest_so_far() -> None:
    stamp = ProgressStamp()
    stamp.enter_evaluation_step()  # the sanity check's first step: nothing measured yet
    first = publish_until(stamp, 0.0, 40.0)
    assert first.phase == EVALUATING and first.bound_s is None and stall_verdict(first, witnessed_s=1e9) is None
    stamp.leave_evaluation_step()
    between = stamp.stamp(41.0)
    assert between.phase == BETWEEN and between.bound_s is None, "no epoch end measured: not judged"
    stamp.enter_evaluation_step()
    second = stamp.stamp(42.0)
    assert second.bound_s == pytest.approx(phase_bound_s(41.0)), "its own 41 s step (as the heartbeat saw it)"
    assert second.bound_s == pytest.approx(STALL_WINDOWS * 41.0 + STALL_SLACK_S)
    stuck = publish_until(stamp, 43.0, 42.0 + second.bound_s + 1.0)
    assert stall_verdict(stuck, witnessed_s=stuck.still_s) is not None


def test_short_evaluation_steps_are_judged_at_the_floor_and_the_override_holds_from_the_first() -> None:
    stamp = ProgressStamp()
    for _ in range(5):
        stamp.enter_evaluation_step()
        stamp.leave_evaluation_step()
    stamp.enter_evaluation_step()
    assert stamp.stamp(0.0).bound_s == FLOOR_S
    fixed = ProgressStamp(timedelta(seconds=3))
    fixed.enter_evaluation_step()
    assert fixed.stamp(0.0).bound_s == 3.0


def test_evaluation_and_epoch_end_stillness_counts_only_while_a_peer_waits_for_the_rank() -> None:
    # A healthy rank may wait in a collective ElChe does not see (a metric's all_gather) for a
    # slower peer: that peer, once past it, reads a stamp up to a second old. Only what the reader
    # itself saw while waiting counts.
    for phase in (EVALUATING, BETWEEN):
        stale = Stamp(9, 60.0, 20.0, phase)
        assert stall_verdict(stale) is None and stall_verdict(stale, witnessed_s=0.5) is None
        assert stall_verdict(stale, witnessed_s=20.0) is not None
    assert stall_verdict(Stamp(9, 60.0, 20.0, TRAINING)) is not None


def test_the_phases_without_steps_are_judged_from_the_second_epoch_end_by_the_longest_before() -> None:
    stamp = ProgressStamp()
    stamp.enter_training()
    stamp.expect(0.5, 0.1)
    stamp.leave_training()  # the round that ends epoch 0's windows
    first = publish_until(stamp, 0.0, 30.0)  # a 30 s callback at epoch 0's end
    assert first.phase == BETWEEN and first.bound_s is None, "the first epoch end: nothing measured yet"
    with stamp.held():
        assert stamp.stamp(31.0).bound_s is None
    stamp.enter_training()
    assert stamp.stamp(32.0).phase == TRAINING  # the heartbeat's look: the epoch end's last stillness ended
    assert stamp.epoch_end_s == pytest.approx(31.0)
    publish_until(stamp, 33.0, 99.0)
    stamp.leave_training()
    second = stamp.stamp(100.0)
    assert second.bound_s == pytest.approx(STALL_WINDOWS * 31.0 + STALL_SLACK_S)
    steady = publish_until(stamp, 101.0, 131.0)  # the same callback again: far within
    assert stall_verdict(steady, witnessed_s=steady.still_s) is None
    stuck = publish_until(stamp, 132.0, 100.0 + second.bound_s + 1.0)
    assert stall_verdict(stuck, witnessed_s=stuck.still_s) is not None


def test_a_validation_inside_the_epoch_is_no_epoch_end() -> None:
    stamp = ProgressStamp()
    stamp.enter_training()
    stamp.enter_evaluation_step()  # val_check_interval < 1: the windows go on after it
    stamp.leave_evaluation_step()
    publish_until(stamp, 0.0, 50.0)
    stamp.enter_training()
    assert stamp.epoch_end_s is None


def simulate_validation(step_s: float, steps: int, epochs: int, stuck_at: Optional[float] = None,
                        seed: int = 0) -> tuple[Optional[str], float, float]:
    """A rank validating ``steps`` steps of about ``step_s`` (+-20 %, steady) per epoch, with a
    50 % longer epoch end (a callback) after each, its heartbeat publishing once a second, and a
    peer that waits for it all along (the worst case: it judges every look). Returns the verdict,
    when it came and the rank's last progress."""
    jitter = random.Random(seed)
    stamp = ProgressStamp()
    events: list[tuple[float, str]] = []
    t = 0.0
    for _ in range(epochs):
        events.append((t, "train"))
        t += 1.0
        events.append((t, "windows_end"))
        for _ in range(steps):
            events.append((t, "step"))
            t += step_s * jitter.uniform(0.8, 1.2)
            events.append((t, "step_end"))
        t += 1.5 * step_s * jitter.uniform(0.8, 1.2)
    end = t  # the fit is over: its heartbeat stops
    if stuck_at is not None:
        events, end = [e for e in events if e[0] < stuck_at], t + 10 * step_s + 60.0
    last = max(e[0] for e in events)
    act = {"train": stamp.enter_training, "windows_end": stamp.leave_training,
           "step": stamp.enter_evaluation_step, "step_end": stamp.leave_evaluation_step}
    cursor, now, next_publish, witness_since = 0, 0.0, 0.0, 0.0
    published: Optional[Stamp] = None
    while now < end:
        while cursor < len(events) and events[cursor][0] <= now:
            act[events[cursor][1]]()
            cursor += 1
        if now >= next_publish:
            previous, published, next_publish = published, stamp.stamp(now), next_publish + 1.0
            if previous is None or previous.count != published.count:
                witness_since = now
            verdict = stall_verdict(published, witnessed_s=now - witness_since)
            if verdict is not None:
                return verdict, now, last
        now = round(now + 0.05, 6)
    return None, end, last


def test_a_steady_ten_times_slower_rank_is_never_flagged_in_validation() -> None:
    for seed in range(5):
        verdict, _, _ = simulate_validation(30.0, 4, epochs=4, seed=seed)
        assert verdict is None, f"seed {seed}: a slow but steady validating rank was flagged: {verdict}"


def test_a_rank_stuck_in_a_validation_step_is_flagged_within_its_own_bound() -> None:
    verdict, at, last = simulate_validation(30.0, 4, epochs=4, stuck_at=250.0)
    assert verdict is not None and "in its evaluation step" in verdict, verdict
    bound = phase_bound_s(36.0 + 1.0)
    assert bound is not None and at - last <= bound + 2.0, f"found {at - last:.1f} s after its last progress"


def test_a_reader_witnesses_a_peer_only_while_it_keeps_looking() -> None:
    ms = members(dist.HashStore(), timedelta(seconds=1))
    observer, peer = ms
    try:
        peer.progress.leave_training()  # an epoch end: a peer in a metric's own all_gather stands still
        observer.detect_lost()
        time.sleep(2.5)  # the observer is busy elsewhere (not in a watched wait): not witnessed
        assert observer.detect_lost() == {}, "a stale stillness the reader did not witness"
        started = time.monotonic()
        lost: dict[int, str] = {}
        while not lost and time.monotonic() - started < 5.0:
            lost = observer.detect_lost()
            time.sleep(0.1)
        elapsed = time.monotonic() - started
        assert set(lost) == {1} and "epoch end" in lost[1], lost
        assert 0.9 <= elapsed <= 3.0, f"found {elapsed:.1f} s after the observer began to wait for it"
    finally:
        for m in ms:
            m.close()
