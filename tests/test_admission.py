"""The admission protocol's decisions without processes: the join secret's file, the judgement of a
request (token, earlier job, facts named by field), and the change a join opens."""

from __future__ import annotations

import json
import stat
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

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
        bad.wait_admission("fit")


def test_a_join_opens_a_generation_with_the_joiners_last_and_loses_nobody() -> None:
    members = _membership(dist.HashStore(), 1, [0, 1])
    change = members.admit([2, 3])
    assert change.after == (0, 1, 2, 3) and change.joined == [2, 3] and not change.is_loss
    assert members.generation == 1 and members.rank == 1 and members.world_size == 4
    assert members.lost_count == 0 and members.renumbered
