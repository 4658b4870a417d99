"""A stuck rank is told from a slow one by its own speed (``membership/stall.py``).

Pure logic first (the bound, the knob, a simulated steady 10x slower rank that is never flagged and
a stuck one that is), then the stamps through a real in-process store and heartbeat threads. The
jobs with real processes (an endless loop in ``training_step``, a rank asleep inside a
collective) are in ``tests/test_rank_loss.py``.
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
    STALL_FLOOR,
    STALL_SLACK_S,
    STALL_WINDOWS,
    ProgressStamp,
    Stamp,
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


def test_only_training_is_judged() -> None:
    # Validation and epoch-end hooks may wait in collectives ElChe does not see (a metric's own
    # all_gather) for as long as a slower peer needs: not judged there.
    stamp = ProgressStamp(timedelta(seconds=5))
    assert stamp.stamp(0.0).bound_s is None, "not before the first training batch"
    stamp.enter_training()
    assert stamp.stamp(1.0).bound_s == 5.0
    stamp.leave_training()
    left = stamp.stamp(2.0)
    assert left.bound_s is None and stall_verdict(stamp.stamp(100.0)) is None
    stamp.enter_training()
    back = stamp.stamp(101.0)
    assert back.bound_s == 5.0 and back.still_s == 0.0, "entering again is progress"
    assert stall_verdict(stamp.stamp(107.0)) is not None


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


