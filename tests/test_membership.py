"""Liveness, agreement and the watched wait of ``membership.py``, on an in-process store (no processes)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any, Optional

import pytest
import torch.distributed as dist

from lightning_elche import ElCheStrategy
from lightning_elche.job_store import heartbeat_key, proc_key
from lightning_elche.membership.agreement import Membership, RoundProgress, stranded_members
from lightning_elche.membership.change import PeerFailure, RanksLost, check_max_failure, failure_limit
from lightning_elche.membership.liveness import check_liveness_timeout

LIVENESS = timedelta(seconds=1)


def members(store: Any, ranks: list[int], world: int, liveness: timedelta = LIVENESS) -> list[Membership]:
    return [Membership(store, "fit", r, list(range(world)), liveness, join_timeout=timedelta(seconds=5))
            for r in ranks]


def agree_together(ms: list[Membership], timeout_s: float,
                   progress: Optional[dict[int, RoundProgress]] = None) -> dict[int, Any]:
    """Every member runs ``agree`` at once (one thread each); the losses (or what a member raised) by
    original rank."""
    losses: dict[int, Any] = {}

    def agree(m: Membership) -> None:
        try:
            losses[m.original_rank] = m.agree(RuntimeError("connection closed"), (progress or {}).get(m.original_rank))
        except RanksLost as error:
            losses[m.original_rank] = error

    threads = [threading.Thread(target=agree, args=(m,)) for m in ms]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout_s)
    return losses


@pytest.mark.parametrize(("value", "world", "limit"), [(None, 4, None), (1, 4, 1), (2, 3, 2), (0.5, 3, 2),
                                                        (1.0, 4, 4), (0.01, 8, 1)])
def test_max_failure_reads_like_flodl(value: Any, world: int, limit: Any) -> None:
    assert failure_limit(check_max_failure(value), world) == limit


@pytest.mark.parametrize("value", [0, -1, True, 1.5, 0.0, float("nan"), "2", [1]])
def test_bad_max_failure_names_the_knob(value: Any) -> None:
    with pytest.raises((ValueError, TypeError), match="max_failure"):
        check_max_failure(value)
    with pytest.raises((ValueError, TypeError), match="max_failure"):
        ElCheStrategy(max_failure=value)


@pytest.mark.parametrize("value", [timedelta(seconds=0.5), 30, None])
def test_bad_liveness_timeout_names_the_knob(value: Any) -> None:
    with pytest.raises(ValueError, match="liveness_timeout"):
        check_liveness_timeout(value)


def test_liveness_must_come_before_the_transport_timeout() -> None:
    with pytest.raises(ValueError, match="liveness_timeout.*timeout"):
        ElCheStrategy(liveness_timeout=timedelta(seconds=60), timeout=timedelta(seconds=60))
    assert ElCheStrategy(liveness_timeout=timedelta(seconds=5), timeout=timedelta(seconds=60)).elche.max_failure is None
    # The default follows a short transport timeout instead of refusing it.
    assert ElCheStrategy(timeout=timedelta(seconds=30)).liveness_timeout == timedelta(seconds=15)
    assert ElCheStrategy().liveness_timeout == timedelta(seconds=30)


def test_a_silent_heartbeat_is_lost_after_the_liveness_timeout() -> None:
    store = dist.HashStore()
    (me,) = members(store, [0], world=2)
    store.add(heartbeat_key(1), 1)
    try:
        assert me.detect_lost() == {}  # first reading
        time.sleep(0.5)
        store.add(heartbeat_key(1), 1)
        assert me.detect_lost() == {}  # it moved
        time.sleep(1.2)
        lost = me.detect_lost()
        assert list(lost) == [1] and "silent" in lost[1]
    finally:
        me.close()


def test_a_gone_process_and_a_failure_notice_are_lost_at_once() -> None:
    store = dist.HashStore()
    store.set(proc_key(1), "some-other-host:1")  # another host: its process cannot be checked
    import socket

    store.set(proc_key(2), f"{socket.gethostname()}:999999999")  # this host, no such process
    ms = members(store, [0, 1], world=3)
    try:
        ms[1].leave("RuntimeError: boom")
        lost = ms[0].detect_lost()
        assert set(lost) == {1, 2}
        assert "boom" in lost[1] and "gone" in lost[2]
    finally:
        for m in ms:
            m.close()


def test_survivors_agree_on_one_proposal_and_renumber() -> None:
    store = dist.HashStore()
    import socket

    store.set(proc_key(1), f"{socket.gethostname()}:999999999")  # rank 1 is gone
    ms = members(store, [0, 2, 3], world=4)
    try:
        losses = agree_together(ms, timeout_s=10)
        assert sorted(losses) == [0, 2, 3]
        for m in ms:
            loss = losses[m.original_rank]
            assert loss.lost == [1] and loss.survivors == [0, 2, 3] and loss.generation == 1
            assert m.members == [0, 2, 3] and m.world_size == 3 and m.renumbered
        assert [m.rank for m in ms] == [0, 1, 2]
    finally:
        for m in ms:
            m.close()


def test_a_survivor_lost_during_the_agreement_is_one_loss_in_the_callers_numbering() -> None:
    import os
    import socket

    store = dist.HashStore()
    store.set(proc_key(1), f"{socket.gethostname()}:999999999")  # rank 1 is gone at once
    store.set(proc_key(3), f"{socket.gethostname()}:{os.getpid()}")  # rank 3 looks alive, never joins
    ms = members(store, [0, 2], world=4)
    try:
        losses = agree_together(ms, timeout_s=20)
        assert sorted(losses) == [0, 2]
        for m in ms:
            loss = losses[m.original_rank]
            # Two generations (rank 1, then rank 3, silent past the liveness timeout while the
            # others waited for it to join), one loss for the caller, in the numbering of 4 ranks.
            assert loss.generation == 2 and loss.lost == [1, 3] and loss.survivors == [0, 2]
            assert loss.lost_original == [1, 3] and set(loss.reasons) == {1, 3}
            assert m.losses == [loss] and m.lost_count == 2  # recorded as the caller sees it
            assert m.members == [0, 2] and m.world_size == 2
        assert [m.rank for m in ms] == [0, 1]
    finally:
        for m in ms:
            m.close()


def test_a_joiner_dropped_after_the_holders_took_it_leaves_with_the_next_change_uncounted() -> None:
    # An admission's last settlement dropped joiner 2 (it never had its whole state) after the holders
    # took it in, and rank 1 was lost there too: the next round's change takes both out, and only
    # rank 1 counts (max_failure=2 would end the fit if joiner 2 did).
    import socket

    store = dist.HashStore()
    for gone in (1, 2):
        store.set(proc_key(gone), f"{socket.gethostname()}:999999999")
    ms = [Membership(store, "fit", r, [0, 1, 2, 3], LIVENESS, join_timeout=timedelta(seconds=5), max_failure=2)
          for r in (0, 3)]
    for m in ms:
        m.note_dropped([2])
    try:
        changes = agree_together(ms, timeout_s=10)
        for m in ms:
            change = changes[m.original_rank]
            assert change.lost_original == [1, 2] and change.dropped == (2,) and change.counted_lost == 1
            assert not change.ends_fit and m.lost_count == 1
    finally:
        for m in ms:
            m.close()


def test_survivors_that_got_further_than_others_set_the_lost_ranks_trained_batches() -> None:
    # Rank 1 died in the middle of round 5's collectives: ranks 0 and 2 completed it, rank 3 did not.
    import socket

    store = dist.HashStore()
    store.set(proc_key(1), f"{socket.gethostname()}:999999999")
    ms = members(store, [0, 2, 3], world=4)
    progress = {0: RoundProgress(5, (9, 7, 9, 8)), 2: RoundProgress(5, (9, 7, 9, 8)), 3: RoundProgress(4, (6, 5, 6, 6))}
    try:
        changes = agree_together(ms, timeout_s=10, progress=progress)
        for m in ms:
            change = changes[m.original_rank]
            assert change.trained_batches == {1: 7}, "the furthest survivor's count: its round holds rank 1's work"
            assert change.completed_rounds == {0: 5, 2: 5, 3: 4}
            assert change.round_leader == 0 and change.behind_ids == (3,)
    finally:
        for m in ms:
            m.close()


def test_a_survivor_that_missed_the_round_that_ended_the_epoch_leaves_too() -> None:
    import socket

    store = dist.HashStore()
    store.set(proc_key(1), f"{socket.gethostname()}:999999999")
    ms = members(store, [0, 2], world=3)
    progress = {0: RoundProgress(8, (0, 0, 0), ended_sequence=True), 2: RoundProgress(7, (4, 3, 4))}
    try:
        outcome = agree_together(ms, timeout_s=10, progress=progress)
        assert isinstance(outcome[2], RanksLost) and "missed round 8" in str(outcome[2])
        change = outcome[0]
        assert change.lost_original == [1, 2] and change.after == (0,) and change.trained_batches == {1: 0, 2: 0}
        assert ms[0].members == [0]
    finally:
        for m in ms:
            m.close()


def test_a_survivor_still_in_a_validation_another_finished_leaves_too() -> None:
    # Rank 1 died inside the last collective of the validation after round 6: rank 0 finished that
    # validation and went on to train (it fails in round 7), rank 2 did not (it cannot run it again
    # alone). In the sanity check (round 0) the same holds. Both in it, or a member that never
    # validated (a joiner): nobody is stranded.
    import socket

    store = dist.HashStore()
    store.set(proc_key(1), f"{socket.gethostname()}:999999999")
    ms = members(store, [0, 2], world=3)
    progress = {0: RoundProgress(6, (5, 4, 5), True, evaluating=-1, evaluated=6),
                2: RoundProgress(6, (5, 4, 5), True, evaluating=6, evaluated=0)}
    try:
        outcome = agree_together(ms, timeout_s=10, progress=progress)
        assert isinstance(outcome[2], RanksLost) and "still in the validation after round 6" in str(outcome[2])
        assert outcome[0].lost_original == [1, 2] and ms[0].members == [0]
    finally:
        for m in ms:
            m.close()
    sanity = {0: RoundProgress(0, (), evaluated=0), 2: RoundProgress(0, (), evaluating=0)}
    assert list(stranded_members(sanity)) == [2]
    both_in = {m: RoundProgress(6, (5, 4, 5), True, evaluating=6, evaluated=0) for m in (0, 2)}
    assert stranded_members(both_in) == {}
    joiner = {0: RoundProgress(9, (2, 2, 2), evaluated=6), 3: RoundProgress(9, (2, 2, 2))}
    assert stranded_members(joiner) == {}
    assert RoundProgress.from_json(progress[2].to_json()) == progress[2]
    assert RoundProgress.from_json('{"rounds": 3, "epoch_batches": [1], "ended_sequence": false}').evaluating == -1


def test_a_rank_the_others_declared_lost_leaves() -> None:
    store = dist.HashStore()
    ms = members(store, [0, 1], world=2)
    try:
        ms[0]._propose(1, {1: "silent for 31 s"})
        with pytest.raises(RanksLost, match="declared this rank"):
            ms[1].agree(RuntimeError("timed out"))
    finally:
        for m in ms:
            m.close()


def test_a_failure_with_every_peer_alive_is_not_a_loss() -> None:
    store = dist.HashStore()
    ms = members(store, [0, 1], world=2)
    try:
        started = time.monotonic()
        with pytest.raises(PeerFailure, match="no peer was found lost"):
            ms[0].agree(RuntimeError("some other error"))
        assert time.monotonic() - started < 5.0
    finally:
        for m in ms:
            m.close()


class Pending:
    """A collective that never completes (gloo's wait(timeout) raises 'timed out')."""

    def wait(self, timeout: Any = None) -> bool:
        time.sleep(timeout.total_seconds() if timeout else 0.0)
        raise RuntimeError("Operation timed out!")

    def is_completed(self) -> bool:
        return False


class Failed:
    def wait(self, timeout: Any = None) -> bool:
        raise RuntimeError("[pair.cc:553] Connection closed by peer")


def test_the_watched_wait_turns_a_lost_peer_into_a_peer_failure() -> None:
    store = dist.HashStore()
    ms = members(store, [0, 1], world=2)
    try:
        with pytest.raises(PeerFailure, match="Connection closed"):
            ms[0].wait(Failed())
        ms[1].leave("KeyboardInterrupt")
        started = time.monotonic()
        with pytest.raises(PeerFailure, match=r"rank\(s\) \[1\]"):
            ms[0].wait(Pending())
        assert time.monotonic() - started < 3.0
    finally:
        for m in ms:
            m.close()


def test_the_watched_wait_stops_when_survivors_already_regroup() -> None:
    store = dist.HashStore()
    ms = members(store, [0, 1, 2], world=3)
    try:
        ms[2]._propose(1, {0: "its process is gone"})
        with pytest.raises(PeerFailure, match="regrouping"):
            ms[1].wait(Pending(), host_blocking=False)
    finally:
        for m in ms:
            m.close()


def test_lightning_cli_reads_max_failure_and_liveness_timeout(tmp_path: Any, monkeypatch: Any) -> None:
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.demos.boring_classes import BoringModel

    monkeypatch.setattr("sys.argv", ["train.py"])
    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n  accelerator: cpu\n  devices: 1\n  logger: false\n"
        "  strategy:\n    class_path: lightning_elche.ElCheStrategy\n"
        "    init_args:\n      mode: cpu_cadence\n      max_failure: 0.5\n      liveness_timeout: 0:00:10\n"
    )
    cli = LightningCLI(BoringModel, run=False, save_config_callback=None, seed_everything_default=False,
                       args=["--config", str(config)])
    strategy = cli.trainer.strategy
    assert isinstance(strategy, ElCheStrategy)
    assert strategy.elche.max_failure == 0.5 and strategy.liveness_timeout == timedelta(seconds=10)
    config.write_text(config.read_text().replace("max_failure: 0.5", "max_failure: 0"))
    with pytest.raises((SystemExit, ValueError)):
        LightningCLI(BoringModel, run=False, save_config_callback=None, seed_everything_default=False,
                     args=["--config", str(config)])


def test_the_summary_lists_lost_ranks_below_the_survivors() -> None:
    from lightning_elche.engine import FitProgress, RankTotals
    from lightning_elche.summary import format_summary

    progress = FitProgress(mode="cpu_async", rounds=9, cohort_step=70, anchor=3, plan=(3, 2), epoch_batches=32,
                           totals=(RankTotals(steps=40), RankTotals(steps=20)), lost_totals=(RankTotals(steps=10),))
    text = format_summary(progress, lost_ranks=[1])
    rows = [line.split() for line in text.splitlines()[2:4 + 1]]
    assert [r[0] for r in rows] == ["0", "1", "lost1"] and [int(r[1]) for r in rows] == [40, 20, 10]
    assert "70 cohort steps," in text and "resumed" not in text and "1 rank(s) lost" in text


@pytest.mark.parametrize("value", [timedelta(0), timedelta(seconds=-1), 30, None])
def test_bad_snapshot_timeout_names_the_knob_and_the_value(value: Any) -> None:
    expected = r"ElCheStrategy\(snapshot_timeout=.*\) is invalid: expected a positive timedelta"
    with pytest.raises(ValueError, match=expected):
        ElCheStrategy(snapshot_timeout=value)
