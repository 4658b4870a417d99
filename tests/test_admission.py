"""The admission protocol's decisions without processes: the join secret's file, the judgement of a
request (token, earlier job, facts named by field), and the change a join opens."""

from __future__ import annotations

import json
import socket
import stat
import subprocess
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from lightning_elche.config import Dispatch
from lightning_elche.growth import all_can_admit
from lightning_elche.job_store import heartbeat_key, proc_key
from lightning_elche.membership.admission import (
    Admitter,
    FitFacts,
    JoinerLink,
    JoinRefused,
    JoinRequest,
    create_join_secret,
    judge,
    proof,
    publish_job,
    read_join_secret,
    token_path,
)
from lightning_elche.membership.agreement import Membership
from lightning_elche.membership.change import PeerFailure, RanksLost
from lightning_elche.membership.entry import entry_key, settle_entry
from lightning_elche.rounds import StopRequest
from lightning_elche.session import Session

FACTS = FitFacts(mode="cpu_cadence", signature=123.0, dataset_len=480, batch_size=8, seed=0, shuffle=True,
                 drop_last=False)


@pytest.fixture(autouse=True)
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("ELCHE_JOIN_TOKEN", raising=False)
    return tmp_path


def test_the_join_secret_is_a_file_only_its_user_reads() -> None:
    job, secret = create_join_secret("10.0.0.1", 29500)
    path = token_path("10.0.0.1", 29500)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert json.loads(path.read_text()) == {"job": job, "secret": secret}
    assert read_join_secret("10.0.0.1", 29500) == secret
    assert read_join_secret("10.0.0.1", 29501) is None  # another job's address: no file


def test_a_given_token_is_the_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELCHE_JOIN_TOKEN", "chosen")
    _, secret = create_join_secret("h", 1)
    assert secret == "chosen" and read_join_secret("h", 2) == "chosen"


def test_judging_a_request() -> None:
    secret, job = "s3cret", "job-b"
    good = JoinRequest(5, job, proof(secret, job, 5), FACTS)
    assert judge(good, job, secret, FACTS) is None
    wrong = judge(JoinRequest(5, job, proof("guess", job, 5), FACTS), job, secret, FACTS)
    assert wrong is not None and "wrong join token" in wrong and secret not in wrong
    # A proof for another member id does not carry over.
    assert judge(JoinRequest(6, job, good.proof, FACTS), job, secret, FACTS) is not None
    stale = judge(JoinRequest(5, "job-a", proof(secret, "job-a", 5), FACTS), job, secret, FACTS)
    assert stale is not None and "earlier job (job-a)" in stale
    for field, value in (("batch_size", 16), ("dataset_len", 479), ("seed", 1), ("mode", "cpu_sync"),
                         ("signature", 124.0)):
        other = FitFacts(**{**json.loads(FACTS.to_json()), field: value})
        why = judge(JoinRequest(5, job, good.proof, other), job, secret, FACTS)
        assert why is not None and (field if field != "signature" else "model") in why, why


def _membership(store: dist.Store, member: int, members: list[int]) -> Membership:
    return Membership(store, "fit", member, members, timedelta(seconds=5), timedelta(seconds=5), max_failure=1)


def test_rank_0_counts_accepted_joiners_and_refuses_the_others() -> None:
    store = dist.HashStore()
    publish_job(store, "job", 2)
    members = _membership(store, 0, [0, 1])
    admitter = Admitter(members, "job", "s3cret")
    assert admitter.waiting() == 0  # no facts yet: nobody is judged
    admitter.publish(FACTS)
    assert json.loads(store.get("lightning_elche/join/fit"))["fit_prefix"] == "fit"
    good, bad = JoinerLink(store, 5.0), JoinerLink(store, 5.0)
    view = good.job()
    assert (view.job, view.world_size) == ("job", 2)
    assert good.take_member_id(2) == 2 and bad.take_member_id(2) == 3
    good.request(view, "s3cret", FACTS)
    bad.request(view, None, FACTS)
    assert admitter.waiting() == 1
    with pytest.raises(JoinRefused, match="wrong join token"):
        bad.wait_admission("fit", 5.0)


def test_a_join_opens_a_generation_with_the_joiners_last_and_loses_nobody() -> None:
    members = _membership(dist.HashStore(), 1, [0, 1])
    change = members.admit([2, 3])
    assert change.after == (0, 1, 2, 3) and change.joined == [2, 3] and not change.is_loss
    assert members.generation == 1 and members.rank == 1 and members.world_size == 4
    assert members.lost_count == 0 and members.renumbered


def _dead_process(store: dist.Store, member: int) -> None:
    """Register ``member`` as a process of this host that has ended."""
    child = subprocess.Popen(["true"])
    child.wait()
    register_rank_process(store, member, child.pid)


def register_rank_process(store: dist.Store, member: int, pid: int) -> None:
    store.set(proc_key(member), f"{socket.gethostname()}:{pid}")


def test_an_admission_is_entered_by_everyone_there() -> None:
    store = dist.HashStore()
    members = _membership(store, 0, [0, 1])
    store.set(entry_key(members, 1, "present/1"), "1")
    store.set(entry_key(members, 1, "present/2"), "1")
    entry = settle_entry(members, 1, [0, 1], [2])
    assert entry.after == (0, 1, 2) and not entry.lost and not entry.dropped
    # Every later participant reads the same settled list.
    assert settle_entry(_membership(store, 1, [0, 1]), 1, [0, 1], [2]).after == (0, 1, 2)


def test_a_joiner_gone_before_the_new_group_is_dropped_at_once_and_a_gone_member_is_lost(
        caplog: pytest.LogCaptureFixture) -> None:
    store = dist.HashStore()
    members = _membership(store, 0, [0, 1, 2])
    store.set(entry_key(members, 1, "present/2"), "1")
    _dead_process(store, 1)  # a member
    _dead_process(store, 4)  # a joiner
    store.set(entry_key(members, 1, "present/3"), "1")
    started = time.monotonic()
    entry = settle_entry(members, 1, [0, 1, 2], [3, 4])
    assert time.monotonic() - started < 2.0  # not the join timeout, nor the liveness timeout
    assert entry.after == (0, 2, 3)
    assert list(entry.lost) == [1] and "is gone" in entry.lost[1]
    assert list(entry.dropped) == [4] and "dropped joiner 4" in caplog.text and "max_failure" in caplog.text
    with pytest.raises(RanksLost, match="member 1"):  # the member left out cannot go on
        settle_entry(_membership(store, 1, [0, 1, 2]), 1, [0, 1, 2], [3, 4])


def test_a_live_joiner_that_does_not_come_is_dropped_after_the_entry_timeout() -> None:
    store = dist.HashStore()
    members = _membership(store, 0, [0])
    entry = settle_entry(members, 1, [0], [1], joiner_timeout_s=0.3)
    assert entry.after == (0,) and "not there within" in entry.dropped[1]
    late = Membership(store, "fit", 1, [0], timedelta(seconds=5), timedelta(seconds=5))
    with pytest.raises(RanksLost, match="not there within"):
        settle_entry(late, 1, [0], [1])


def test_rank_0_lost_while_it_offers_an_admission_ends_it_for_members_and_joiners() -> None:
    # Rank 0 (member 0) offered joiner 2 its admission and was lost before it named the new
    # generation: the other members skip the admission (a PeerFailure: an ordinary loss), and the
    # joiner leaves, marked dropped so that the next rank 0 does not offer it again.
    store = dist.HashStore()
    publish_job(store, "job", 2)
    leader = _membership(store, 0, [0, 1])
    admitter = Admitter(leader, "job", "s3cret")
    admitter.publish(FACTS)
    joiner = JoinerLink(store, 5.0)
    view = joiner.job()
    joiner.take_member_id(2)
    joiner.request(view, "s3cret", FACTS)
    assert admitter.waiting() == 1
    store.set("lightning_elche/join/admitter/2", "0")
    store.set("lightning_elche/join/admit/2", "1")
    _dead_process(store, 0)
    started = time.monotonic()
    with pytest.raises(JoinRefused, match=r"the member that offered it \(0\) was lost"):
        joiner.wait_admission("fit", 5.0)
    assert store.check(["lightning_elche/join/dropped/2"]) and time.monotonic() - started < 2.0
    with pytest.raises(PeerFailure, match="lost while it offered an admission"):
        Admitter(_membership(store, 1, [0, 1]), "job", "s3cret").admit(1)


def _reports(*ranks: tuple[bool, int]) -> SimpleNamespace:
    """A round's outcome as ``all_can_admit`` reads it: each rank's (out of data, epoch batches)."""
    return SimpleNamespace(reports=[SimpleNamespace(out_of_data=dry, epoch_batches=batches) for dry, batches in ranks])


@pytest.mark.parametrize(
    ("ranks", "dispatch", "admits"),
    [
        (((False, 3), (False, 9)), Dispatch.EQUAL, True),  # every rank has data: any dispatch
        (((False, 3), (False, 9)), Dispatch.POOL, True),
        (((True, 2), (False, 9)), Dispatch.POOL, True),  # the pool: a slow rank 0 waits for the epoch's end
        (((False, 2), (True, 9), (False, 4)), Dispatch.POOL, True),
        (((True, 2), (False, 9)), Dispatch.EQUAL, False),  # the equal split would cut the rest again
        (((True, 2), (False, 9)), Dispatch.FIXED, False),
        (((True, 2), (True, 9)), Dispatch.POOL, False),  # everyone drains: the epoch's last round
        (((True, 0), (False, 9)), Dispatch.POOL, False),  # rank 0 trained no batch: no loop position to send
    ],
)
def test_an_admission_waits_for_a_draining_rank_only_where_it_must(
    ranks: tuple[tuple[bool, int], ...], dispatch: Dispatch, admits: bool
) -> None:
    assert all_can_admit(_reports(*ranks), dispatch) is admits


def test_a_joiners_request_ends_each_members_window_once_and_a_launch_request_never() -> None:
    from lightning_elche.membership.admission import JoinKnock
    from lightning_elche.membership.liveness import Heartbeat

    store = dist.HashStore()
    publish_job(store, "job", 2)
    Admitter(_membership(store, 0, [0, 1]), "job", "s3cret").publish(FACTS)
    early = JoinerLink(store, 5.0)
    view = early.job()
    early.take_member_id(2)
    early.request(view, "s3cret", FACTS)  # before the member started: the next round sees it anyway
    knock = JoinKnock(store)
    beat = Heartbeat(store, 0, 0.02)
    beat.add_watcher(lambda store: (_ for _ in ()).throw(RuntimeError("a watcher that fails")))
    beat.add_watcher(knock.observe)
    try:
        time.sleep(0.1)
        assert not knock.take()
        late = JoinerLink(store, 5.0)
        late.take_member_id(3)
        late.request(view, "s3cret", FACTS)
        deadline = time.monotonic() + 5.0
        while not knock.take():  # seen by the heartbeat thread within a beat, despite the failing watcher
            assert time.monotonic() < deadline, "the heartbeat never read the new request"
            time.sleep(0.01)
        time.sleep(0.1)
        assert not knock.take()  # one window per request
        assert int(store.add(heartbeat_key(0), 0)) > 3  # the failing watcher did not end the heartbeat
    finally:
        beat.close()


def test_a_request_that_rank_0_had_not_read_into_the_round_ends_the_next_window_again() -> None:
    """Rank 0 built its row and waited in the round; a joiner asked; the other members ended their
    windows for it just before the round. The round did not read it, so every member ends its next
    window for it again (rank 0 at once too): they meet at the next round, which reads it. Without
    this, rank 0 alone ended its next window and waited a whole window for the others (measured on
    the churn rig: 11.9 s from the joiner's readiness to its admission)."""
    from lightning_elche.membership.admission import JoinKnock, key

    store = dist.HashStore()
    member, first = JoinKnock(store), JoinKnock(store)  # a member that finished late; rank 0
    store.add(key("requests"), 1)
    member.observe(store)
    assert member.take(), "the member ends its window for the request"
    assert not member.take(), "at most once per window"
    member.settle(read=0)  # the round: rank 0 had not read the request
    first.observe(store)
    first.settle(read=0)
    assert member.take() and first.take(), "both end their next window for it: they meet again"
    member.settle(read=1)  # that round read it (admitted, scheduled or refused)
    assert not member.take()
    # Bounded where no rank 0 reads requests: a request ends at most two windows of a member.
    store.add(key("requests"), 1)
    member.observe(store)
    assert member.take()
    member.settle(read=1)
    assert member.take()
    member.settle(read=1)
    assert not member.take()


def test_a_round_that_saw_joiners_answers_the_requests_its_members_saw_while_they_waited_in_it() -> None:
    """A member that waited in a round while a joiner asked must not end its next window for that
    joiner once the round has seen it (rank 0 read it into the round): the round answers it."""
    from lightning_elche.growth import Growth
    from lightning_elche.membership.admission import JoinKnock, key

    store = dist.HashStore()
    knock = JoinKnock(store)
    store.add(key("requests"), 1)  # a joiner asks while this member waits in a round
    knock.observe(store)
    growth = Growth()
    growth.admitter, growth.knock = SimpleNamespace(), knock  # type: ignore[assignment]
    keeps: list[bool] = []
    engine = SimpleNamespace(controller=SimpleNamespace(keep_a_round_before_the_epoch_end=keeps.append),
                             request_consensus=lambda at_round: None)
    seen_nobody = SimpleNamespace(reports=[SimpleNamespace(joiners=0, requests_read=0)], consensus=False, index=3)
    growth.after_round(None, seen_nobody, engine, None, None)  # type: ignore[arg-type]
    assert knock._answered == 0, "a round that saw no joiner answers nothing"
    saw_one = SimpleNamespace(reports=[SimpleNamespace(joiners=1, requests_read=1)], consensus=False, index=4,
                              ends_window_sequence=False)
    growth.after_round(None, saw_one, engine, None, None)  # type: ignore[arg-type]
    assert not knock.take(), "the round that saw the joiner answered its request"
    assert keeps == [False, True] and growth.admit_at == 6
    store.add(key("requests"), 1)  # a later joiner still ends the next window
    knock.observe(store)
    assert knock.take()


@pytest.mark.parametrize(("case", "hurries"), [("epoch_end", True), ("async_round", True), ("equal_split_drain", False),
                                               ("pending_save", False), ("stop_before_min_epochs", False)])
def test_a_named_admission_round_ends_the_window_before_it_after_one_step(case: str, hurries: bool) -> None:
    """Joiners ready at a round that cannot admit them (the epoch's last round, a cpu_async round)
    are admitted at a named later round; the window before it ends after its first step instead of
    running its plan (measured on the churn rig: a replacement ready in an epoch-end drain waited
    7.8 s, a whole first window of the next epoch). Not where that round could not admit either: a
    rank draining its equal split (every window would be one step until the epoch's end), a save, or
    a stop that ``min_epochs`` defers (every round ends the sequence and admits nobody until then: the
    windows would be one step for epochs).

    The session is a real one, told of the round first as the round driver does: at an epoch's last
    round it is leaving the epoch when the listener runs (a fake session that was not hid that the
    epoch-end hurry never fired: a replacement ready 0.5 s before an epoch's end waited 10.2 s)."""
    from lightning_elche.growth import Growth

    growth = Growth()
    growth.admitter = SimpleNamespace()  # type: ignore[assignment]
    engine = SimpleNamespace(controller=SimpleNamespace(keep_a_round_before_the_epoch_end=lambda keep: None),
                             request_consensus=lambda at_round: None,
                             run_mode=SimpleNamespace(dispatch=Dispatch.EQUAL if case == "equal_split_drain"
                                                      else Dispatch.POOL))
    draining = case in ("epoch_end", "equal_split_drain")
    reports = [SimpleNamespace(joiners=1, requests_read=1, out_of_data=draining and (r == 1 or case == "epoch_end"),
                               epoch_batches=4) for r in range(3)]
    stop = {"pending_save": StopRequest.SIGTERM, "stop_before_min_epochs": StopRequest.GRACEFUL}.get(case,
                                                                                                   StopRequest.NONE)
    outcome = SimpleNamespace(reports=reports, index=7, epoch_over=case == "epoch_end", stop_level=stop,
                              budget_reached=False, consensus=case not in ("async_round",),
                              ends_window_sequence=case in ("epoch_end", "pending_save", "stop_before_min_epochs"))
    session = Session(3)
    session.start_batch(epoch=0, samples=8)
    deferred = case == "stop_before_min_epochs"
    session.after_round(outcome, lambda: not deferred)  # type: ignore[arg-type]
    assert session.leaving is (outcome.ends_window_sequence and not deferred)
    growth.after_round(None, outcome, engine, session, object())  # type: ignore[arg-type]
    assert growth.admit_at == (8 if outcome.ends_window_sequence else 9)
    assert growth.hurried() is hurries, "the engine ends its window at the first step it asks (ElCheEngine.knocks)"
    assert not growth.hurried(), "one window, not every window until the admission"
    growth._hurry = True
    growth.after_round(None, SimpleNamespace(reports=[SimpleNamespace(joiners=0, requests_read=1)]), engine, session,
                       object())  # type: ignore[arg-type]
    assert not growth.hurried(), "a round that names no admission leaves no hurry behind"
