"""A collective outside ElChe's rounds that can never complete fails within seconds, on every rank
involved, naming the phase and the cause (issue 27); ``self.all_gather`` of a collection checks
every rank's structure first (issue 26).

The entry check runs here between two threads, one per rank, over one in-memory store; the cases
of the issues run as real 2-rank CPU fits (gloo, one process per rank). CI runs one mode per case;
every mode x every case is marked ``faults``.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from stop_helpers import launched

from lightning_elche.checked_collectives import (
    CheckedCollectives,
    CollectiveMismatch,
    Entry,
    collection_signature,
    collection_summary,
    reduce_op_for,
)
from lightning_elche.membership.change import PeerFailure

MODES = ("nccl_sync", "nccl_cadence", "cpu_sync", "cpu_cadence", "cpu_async")


# -- signatures ---------------------------------------------------------------------------------


def test_a_collection_is_described_as_lightning_walks_it():
    data = {"seen": [torch.tensor(1), torch.tensor(2)], "loss": torch.zeros(3, 2)}
    assert collection_signature(data) == "{'seen': list[int64[], int64[]], 'loss': float32[3, 2]}"
    assert collection_summary(data) == "a dict of 2 entries ('seen', 'loss')"
    assert collection_summary([torch.tensor(1)] * 5) == "a list of 5 tensors"
    assert collection_summary((torch.tensor(1), "x")) == "a tuple of 2 items"
    assert collection_summary(torch.zeros(4)) == "a tensor of shape [4] (float32)"


@pytest.mark.parametrize(("given", "backend", "op", "divide"), [
    ("mean", "gloo", dist.ReduceOp.SUM, True),  # gloo has no AVG: Lightning sums and divides
    ("avg", "gloo", dist.ReduceOp.SUM, True),
    ("mean", "nccl", dist.ReduceOp.AVG, False),
    ("max", "gloo", dist.ReduceOp.MAX, False),
    (None, "gloo", dist.ReduceOp.SUM, False),
    (dist.ReduceOp.MIN, "gloo", dist.ReduceOp.MIN, False),
])
def test_reduce_ops_map_as_lightning_maps_them(given, backend, op, divide):
    assert reduce_op_for(given, backend) == (op, divide)


# -- the entry check, two ranks in two threads ---------------------------------------------------


class FakeMembership:
    """The part of ``Membership`` the checks use, over a shared store; ``lost`` makes the liveness
    check fail as the real one does for a peer that left a notice."""

    def __init__(self, store: Any, rank: int, generation: int = 0) -> None:
        self.store, self.original_rank, self.members = store, rank, [0, 1]
        self.fit_prefix, self.generation, self.active = "fit", generation, True
        self.lost: dict[int, str] = {}

    @property
    def rank(self) -> int:
        return self.members.index(self.original_rank)

    def check(self) -> None:
        if self.lost:
            raise PeerFailure(f"rank(s) {sorted(self.lost)} (original numbering) stopped answering")

    def detect_lost(self) -> dict[int, str]:
        return dict(self.lost)

    def process_of(self, member: int) -> None:
        return None  # not registered: nothing to fence


def ranks_of(store: Any) -> list[tuple[FakeMembership, CheckedCollectives]]:
    pairs = []
    for rank in range(2):
        membership = FakeMembership(store, rank)
        pairs.append((membership, CheckedCollectives(lambda m=membership: m, lambda: "on_train_end (stage train)",
                                                     world_size=lambda: 2)))
    return pairs


def on_both(calls: list[Callable[[], Any]], timeout_s: float = 10.0) -> list[tuple[Optional[BaseException], float]]:
    """Run each call in its own thread (rank k runs ``calls[k]``); each one's error and duration."""
    results: list[tuple[Optional[BaseException], float]] = [(None, 0.0)] * len(calls)

    def run(k: int) -> None:
        started = time.monotonic()
        try:
            calls[k]()
            results[k] = (None, time.monotonic() - started)
        except BaseException as error:  # noqa: BLE001
            results[k] = (error, time.monotonic() - started)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
        assert not thread.is_alive(), "an entry check hung"
    return results


def test_matching_collectives_pass_and_are_counted():
    (_, zero), (_, one) = ranks_of(dist.HashStore())
    for _ in range(3):
        results = on_both([lambda: zero.enter("barrier()"), lambda: one.enter("barrier()")])
        assert [error for error, _ in results] == [None, None]
    assert zero.count == one.count == 3


def test_gathers_of_collections_of_different_lengths_fail_on_both_ranks_naming_both():
    (_, zero), (_, one) = ranks_of(dist.HashStore())

    def gather(checks: CheckedCollectives, n: int) -> None:
        with checks.gathering([torch.tensor(i) for i in range(n)]):
            pass

    results = on_both([lambda: gather(zero, 5), lambda: gather(one, 3)])
    messages = [str(error) for error, _ in results]
    assert all(isinstance(error, CollectiveMismatch) for error, _ in results)
    assert messages[0] == messages[1], "every rank words it the same"
    assert "rank 0 gathers a list of 5 tensors, rank 1 a list of 3 tensors (in on_train_end (stage train))" \
        in messages[0]
    assert max(elapsed for _, elapsed in results) < 2.0


def test_collections_of_the_same_length_but_other_shapes_name_the_difference():
    (_, zero), (_, one) = ranks_of(dist.HashStore())

    def gather(checks: CheckedCollectives, n: int) -> None:
        with checks.gathering([torch.zeros(2), torch.zeros(n)]):
            pass

    results = on_both([lambda: gather(zero, 4), lambda: gather(one, 3)])
    message = str(results[0][0])
    assert "rank 0 and rank 1 enter self.all_gather() with different arguments" in message
    assert "float32[4]" in message and "float32[3]" in message


def test_different_collectives_at_the_same_point_fail_on_both_ranks():
    (_, zero), (_, one) = ranks_of(dist.HashStore())
    results = on_both([lambda: zero.enter("barrier()"), lambda: one.enter("ElChe's end-of-training buffer average")])
    for error, _ in results:
        assert isinstance(error, CollectiveMismatch)
        assert ("at collective #1 of the fit: rank 0 is in barrier() in on_train_end (stage train), rank 1 in "
                "ElChe's end-of-training buffer average in on_train_end (stage train)") in str(error)


def test_the_leaves_of_a_checked_collection_need_no_entry_of_their_own():
    (_, zero), (_, one) = ranks_of(dist.HashStore())

    def gather(checks: CheckedCollectives) -> None:
        with checks.gathering([torch.tensor(1), torch.tensor(2)]):
            for _ in range(2):
                checks.enter("all_gather()", "int64[]")  # what each leaf's gather asks for

    assert [error for error, _ in on_both([lambda: gather(zero), lambda: gather(one)])] == [None, None]
    assert zero.count == one.count == 1


def test_a_peer_that_ended_its_fit_fails_the_waiting_rank_at_once():
    (_, zero), (_, one) = ranks_of(dist.HashStore())
    on_both([lambda: zero.enter("barrier()"), lambda: one.enter("barrier()")])
    one.close()  # rank 1's teardown
    started = time.monotonic()
    with pytest.raises(CollectiveMismatch, match=r"barrier\(\) in on_train_end \(stage train\) on rank 0 "
                       r"\(collective #2 outside ElChe's rounds\) can never complete: rank 1 ended its fit after 1 "
                       r"collective\(s\) outside the rounds \(the last: barrier\(\) in on_train_end"):
        zero.enter("barrier()")
    assert time.monotonic() - started < 1.0


def test_a_peer_that_entered_this_collective_before_it_ended_its_fit_is_no_evidence():
    # Between a rank's look for the peer's entry and its look at the peer's markers, the peer may
    # pass the collective and end its fit: its closed count then covers this collective.
    store = dist.HashStore()
    (m0, zero), (_, one) = ranks_of(store)
    on_both([lambda: zero.enter("barrier()"), lambda: one.enter("barrier()")])
    one.close()
    zero._check_peer_can_come(m0, "fit/collectives/gen0", 1, Entry("barrier()"), 1)  # no error
    with pytest.raises(CollectiveMismatch, match="ended its fit after 1 collective"):
        zero._check_peer_can_come(m0, "fit/collectives/gen0", 2, Entry("barrier()"), 1)


def test_a_peer_that_went_on_to_train_the_next_epoch_fails_the_waiting_rank():
    (_, zero), (_, one) = ranks_of(dist.HashStore())
    zero.training_started(0)
    one.training_started(0)
    one.training_started(1)  # rank 1 left epoch 0's end without the barrier rank 0 waits in
    with pytest.raises(CollectiveMismatch, match=r"rank 1 went on to train epoch 1 after 0 collective\(s\)"):
        zero.enter("barrier()")


def test_a_peer_still_in_the_same_epoch_is_waited_for():
    (_, zero), (_, one) = ranks_of(dist.HashStore())
    zero.training_started(3)
    one.training_started(3)  # from the start of the epoch both waiting ranks left: not evidence

    def late() -> None:
        time.sleep(0.4)
        one.enter("barrier()")

    assert [error for error, _ in on_both([lambda: zero.enter("barrier()"), late])] == [None, None]


def test_a_peer_that_left_the_fit_fails_the_waiting_rank_with_its_reason():
    store = dist.HashStore()
    (membership, zero), _ = ranks_of(store)
    membership.lost = {1: "it failed: RuntimeError: rank 1 gave up in on_train_end"}
    with pytest.raises(CollectiveMismatch, match=r"can never complete: rank 1 left the fit: it failed: "
                       r"RuntimeError: rank 1 gave up"):
        zero.enter("barrier()")


def test_a_lost_peer_is_named_as_a_loss_a_wrong_call_is_not():
    # Validation survives the first kind (lightning_elche.evaluation_recovery): it needs to tell them apart.
    store = dist.HashStore()
    (membership, zero), _ = ranks_of(store)
    membership.lost = {1: "its process (pid 7) is gone"}
    with pytest.raises(CollectiveMismatch) as lost:
        zero.enter("reduce()")
    assert isinstance(lost.value.lost, PeerFailure)
    (_, zero), (_, one) = ranks_of(dist.HashStore())
    mismatched = on_both([lambda: zero.enter("barrier()"), lambda: one.enter("reduce()")])
    assert all(isinstance(error, CollectiveMismatch) and error.lost is None for error, _ in mismatched)


def test_a_peer_that_left_with_an_exception_and_then_closed_its_fit_is_a_loss():
    # A rank that raises leaves its notice (on_exception), then closes its fit (teardown): whichever
    # the waiting rank sees first, the cause is a lost rank, not one that ended its fit early.
    store = dist.HashStore()
    (m0, zero), (_, one) = ranks_of(store)
    one.close()
    m0.lost = {1: "it failed: RuntimeError: injected"}
    with pytest.raises(CollectiveMismatch, match=r"rank 1 left the fit: it failed: RuntimeError") as left:
        zero._check_peer_can_come(m0, "fit/collectives/gen0", 1, Entry("barrier()"), 1)
    assert left.value.lost is not None
    m0.lost = {}
    with pytest.raises(CollectiveMismatch, match="ended its fit") as ended:
        zero._check_peer_can_come(m0, "fit/collectives/gen0", 1, Entry("barrier()"), 1)
    assert ended.value.lost is None


def test_a_live_peer_that_never_enters_fails_at_the_process_groups_timeout():
    store = dist.HashStore()
    membership = FakeMembership(store, 0)
    checks = CheckedCollectives(lambda: membership, lambda: "on_train_end (stage train)",
                                timeout=timedelta(seconds=0.3), world_size=lambda: 2)
    started = time.monotonic()
    with pytest.raises(CollectiveMismatch, match=r"can never complete: rank 1 did not enter it within the process "
                       r"group's timeout \(0.3 s\)"):
        checks.enter("barrier()")
    assert 0.3 <= time.monotonic() - started < 2.0


def test_a_regroup_starts_the_count_again():
    store = dist.HashStore()
    (m0, zero), (m1, one) = ranks_of(store)
    on_both([lambda: zero.enter("barrier()"), lambda: one.enter("barrier()")])
    m0.generation = m1.generation = 1
    assert [error for error, _ in on_both([lambda: zero.enter("reduce()"), lambda: one.enter("reduce()")])] == [
        None, None]
    assert zero.count == one.count == 1


def survivors_of_a_loss(store: Any) -> list[tuple[FakeMembership, CheckedCollectives]]:
    """Ranks 0 and 1 of three, rank 2 lost; ``recover`` regroups them as the fit's survival would."""
    pairs = []
    for rank in range(2):
        membership = FakeMembership(store, rank)
        membership.members, membership.lost = [0, 1, 2], {2: "its process (pid 7) is gone"}
        checks = CheckedCollectives(lambda m=membership: m, lambda: "on_train_epoch_end (stage train)",
                                    world_size=lambda: 2)

        def regroup(error: CollectiveMismatch, m: FakeMembership = membership) -> bool:
            assert error.lost is not None, "only a loss is recovered"
            m.members, m.generation, m.lost = [0, 1], m.generation + 1, {}
            return True

        checks.recover = regroup
        pairs.append((membership, checks))
    return pairs


def test_a_collective_a_peer_was_lost_in_runs_again_on_the_survivors():
    store = dist.HashStore()
    (_, zero), (_, one) = survivors_of_a_loss(store)
    results = on_both([lambda: zero.enter("reduce()", "float32[] SUM"), lambda: one.enter("reduce()", "float32[] SUM")])
    assert [error for error, _ in results] == [None, None]
    assert zero.count == one.count == 1  # counted afresh in the new generation
    again = Entry.loads(store.get("fit/collectives/gen1/0/1"))
    assert again.signature == "float32[] SUM (again after collective #1 of generation 0)"
    # The next collective is an ordinary one again.
    assert [error for error, _ in on_both([lambda: zero.enter("barrier()"), lambda: one.enter("barrier()")])] == [
        None, None]
    assert Entry.loads(store.get("fit/collectives/gen1/1/2")).signature == ""


def test_survivors_that_failed_in_different_collectives_do_not_pair_up_again():
    # A peer that died inside a collective may let one survivor complete it: its next is another.
    store = dist.HashStore()
    (m0, zero), (m1, one) = survivors_of_a_loss(store)
    m0.members, m1.members, m0.lost, m1.lost = [0, 1], [0, 1], {}, {}  # a first collective passes
    on_both([lambda: zero.enter("barrier()"), lambda: one.enter("barrier()")])
    m0.members, m1.members = [0, 1, 2], [0, 1, 2]
    m0.lost = m1.lost = {2: "its process (pid 7) is gone"}
    one.count += 1  # rank 1 completed collective #2, rank 0 did not
    results = on_both([lambda: zero.enter("reduce()", "float32[] SUM"), lambda: one.enter("reduce()", "float32[] SUM")])
    for error, _ in results:
        assert isinstance(error, CollectiveMismatch) and error.lost is None, error
        assert "again after collective #2" in str(error) and "again after collective #3" in str(error), error


def test_a_loss_the_fit_does_not_recover_from_ends_the_collective():
    store = dist.HashStore()
    (membership, zero), _ = survivors_of_a_loss(store)
    zero.recover = lambda error: False
    with pytest.raises(CollectiveMismatch, match="rank 2 left the fit") as lost:
        zero.enter("barrier()")
    assert lost.value.lost is not None and membership.generation == 0


def test_nothing_is_checked_without_an_active_membership_or_a_second_rank():
    membership = FakeMembership(dist.HashStore(), 0)
    alone = CheckedCollectives(lambda: membership, lambda: "", world_size=lambda: 1)
    assert alone.enter("barrier()") is None and alone.count == 0
    membership.active = False
    inactive = CheckedCollectives(lambda: membership, lambda: "", world_size=lambda: 2)
    assert inactive.enter("barrier()") is None and inactive.reduce(torch.ones(1), None, "sum") is None


def test_an_entry_round_trips_through_the_store():
    entry = Entry("self.all_gather()", "list[int64[]]", "a list of 1 tensors", "on_train_end (stage train)")
    assert Entry.loads(entry.dumps()) == entry


# -- real fits ------------------------------------------------------------------------------------


def run_case(tmp_path: Path, case: str, mode: str, epochs: int = 1) -> Any:
    return launched(tmp_path / f"{case}-{mode}", case, mode=mode, extra=("--epochs", str(epochs)))


def error_delay(job: Any, rank: int) -> float:
    entered = job.wait_file(f"entered-rank{rank}.json", 5)
    return round(job.result(rank)["time"] - entered["time"], 2)


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["cpu_async"])
def test_an_uneven_all_gather_of_a_list_fails_on_every_rank_naming_the_lengths(tmp_path, mode):
    # Lightning's test_distributed_sampler_without_global_seed gathers each rank's list of seen samples.
    with run_case(tmp_path, "uneven_gather", mode) as job:
        codes = job.wait_exits(150)
        delays = [error_delay(job, rank) for rank in range(2)]
        print(f"uneven all_gather ({mode}): statuses {codes}, seconds from entering to the error {delays}")
        assert codes == [1, 1], job.log()
        for rank in range(2):
            result = job.result(rank)
            assert result["error"] == "CollectiveMismatch"
            assert ("rank 0 gathers a list of 5 tensors, rank 1 a list of 3 tensors (in on_train_end (stage train))"
                    in result["message"])
        assert max(delays) < 5.0


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["cpu_async"])
def test_two_barriers_against_one_fail_on_both_ranks_within_seconds(tmp_path, mode):
    # The BoringModel case: rank 0 calls barrier() twice in on_train_end, rank 1 once. Under
    # DDP rank 1 exits and rank 0 fails on the closed connection; under ElChe rank 1's second
    # collective was ElChe's own end-of-training buffer average, which paired with rank 0's second
    # barrier: both waited forever. Now both are entry-checked.
    with run_case(tmp_path, "issue_barriers", mode) as job:
        codes = job.wait_exits(150)
        delays = [error_delay(job, rank) for rank in range(2)]
        print(f"two barriers against one ({mode}): statuses {codes}, seconds from entering to the error {delays}")
        assert codes == [1, 1], job.log()
        for rank in range(2):
            assert ("rank 0 is in barrier() in on_train_end (stage train), rank 1 in ElChe's end-of-training buffer "
                    "average in on_train_end (stage train)") in job.result(rank)["message"]
        assert max(delays) < 5.0


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["nccl_cadence"])
def test_a_barrier_only_one_rank_reaches_fails_once_the_other_trains_on(tmp_path, mode):
    with run_case(tmp_path, "lone_barrier", mode, epochs=2) as job:
        codes = job.wait_exits(150)
        delay = error_delay(job, 0)
        print(f"lone barrier ({mode}): statuses {codes}, {delay} s from entering to the error on rank 0")
        assert codes[0] == 1, job.log()
        result = job.result(0)
        assert result["error"] == "CollectiveMismatch"
        assert re.search(r"barrier\(\) in on_train_epoch_end \(stage train\) on rank 0 \(collective #\d+ outside "
                         r"ElChe's rounds\) can never complete: rank 1 went on to train epoch 1", result["message"])
        assert delay < 5.0
        # Rank 1 survives the failed rank (max_failure=None), naming why it left.
        assert codes[1] == 0, job.log()
        assert "ElCheStrategy lost rank 0 (it failed: CollectiveMismatch" in (job.out / "rank1.log").read_text()


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["cpu_sync"])
def test_a_barrier_whose_peer_left_the_fit_after_training_is_passed_by_the_survivor(tmp_path, mode):
    # Rank 1 raises in on_train_end while rank 0 waits in a barrier there. Every sample is trained by
    # then; the survivor agrees on the loss (naming rank 1's error), passes the barrier alone and
    # ends its fit as any fit ends (until the kill sweep at a13093e this ended rank 0's fit too).
    with run_case(tmp_path, "peer_left", mode) as job:
        failed = job.wait_file("result-rank1.json", 150)
        assert failed["error"] == "RuntimeError" and failed["message"] == "rank 1 gave up in on_train_end"
        assert job.wait_exits(60, [0]) == [0], job.log()
        assert not (job.out / "result-rank0.json").exists(), job.result(0)
        rank0_log = (job.out / "rank0.log").read_text()
        assert "ElCheStrategy lost rank 1 (it failed: RuntimeError: rank 1 gave up in on_train_end" in rank0_log, \
            rank0_log[-3000:]
        job.signal(signal.SIGKILL, [1])  # rank 1's script lives on after its fit failed


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["cpu_cadence"])
def test_the_same_collectives_on_every_rank_give_what_lightnings_give(tmp_path, mode):
    with run_case(tmp_path, "matching", mode) as job:
        codes = job.wait_exits(150)
        assert codes == [0, 0], job.log()
        records = [json.loads((job.out / f"matching-rank{rank}.json").read_text()) for rank in range(2)]
    for record in records:
        assert record["rank"] == [0, 1] and record["xs"] == [[0, 10], [1, 11]]  # stacked per leaf
        assert record["mean"] == 0.5 and record["total"] == [1, 2]
        assert record["broadcast"] == "from rank 1"
        assert record["entries_of_the_gather"] == 1  # one entry check for the collection's three tensors


@pytest.mark.faults
@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_fails_uneven_collectives_within_seconds(tmp_path, mode):
    test_an_uneven_all_gather_of_a_list_fails_on_every_rank_naming_the_lengths(tmp_path / "gather", mode)
    test_two_barriers_against_one_fail_on_both_ranks_within_seconds(tmp_path / "barriers", mode)
    test_a_barrier_only_one_rank_reaches_fails_once_the_other_trains_on(tmp_path / "lone", mode)
    test_a_barrier_whose_peer_left_the_fit_after_training_is_passed_by_the_survivor(tmp_path / "left", mode)
    test_the_same_collectives_on_every_rank_give_what_lightnings_give(tmp_path / "matching", mode)
