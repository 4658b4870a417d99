"""A round that fails on a lost peer: the engine regroups and runs it again (no processes)."""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from lightning_elche import ElCheConfig
from lightning_elche.averaging import round_weights
from lightning_elche.controller import ElCheController
from lightning_elche.engine import ElCheEngine
from lightning_elche.membership.change import Change, PeerFailure
from lightning_elche.planes.base import AveragingPlane, RoundResult
from lightning_elche.rounds import META_SIZE, Meta, StopRequest


class FailingPeers(AveragingPlane):
    """Rank 0 under test among ``world_size`` ranks; the first ``failures`` collects raise."""

    def __init__(self, world_size: int, failures: int = 1) -> None:
        self.world_size, self.failures = world_size, failures
        self.peer_out_of_data = False
        self.regroups: list[tuple[int, int]] = []
        self.retries = 0
        self.starts: list[torch.Tensor] = []
        self._local: Optional[torch.Tensor] = None

    def start(self, local: torch.Tensor) -> None:
        self._local = local
        self.starts.append(local.clone())

    def collect(self) -> RoundResult:
        if self.failures:
            self.failures -= 1
            raise PeerFailure("a collective of the round failed: Connection closed by peer")
        assert self._local is not None
        rows = [self._local.cpu().tolist()]
        for _ in range(self.world_size - 1):
            peer = torch.zeros(META_SIZE, dtype=torch.float64)
            for slot in (Meta.ROUND, Meta.EPOCH, Meta.SIGNATURE):
                peer[slot] = self._local[slot]
            peer[Meta.FINITE], peer[Meta.STEPS], peer[Meta.COMPUTE_S] = 1.0, 3, 0.3
            peer[Meta.OUT_OF_DATA] = float(self.peer_out_of_data)
            rows.append(peer.tolist())
        return RoundResult(rows, round_weights([int(r[Meta.STEPS]) for r in rows], 1.0), None)

    def apply_change(self, change: Change) -> None:
        rank = change.new_rank(0)
        assert rank is not None
        self.regroups.append((rank, change.world_size_after))
        self.world_size = change.world_size_after

    def retry(self) -> None:
        self.retries += 1


class Survivors:
    """Stands in for the survival module: each failure becomes ``change``, applied to the engine."""

    def __init__(self, engine: ElCheEngine, change: Change, keep_epoch_open: bool = False) -> None:
        self.engine, self.change, self.keep_epoch_open = engine, change, keep_epoch_open
        self.seen: list[PeerFailure] = []
        engine.failures = self

    def after_failed_round(self, failure: PeerFailure) -> Change:
        self.seen.append(failure)
        self.engine.apply_change(self.change)
        if self.keep_epoch_open:
            self.engine.keep_epoch_open()
        return self.change


def engine_for(plane: FailingPeers, world_size: int) -> ElCheEngine:
    engine = ElCheEngine(ElCheConfig(), plane, rank=0, world_size=world_size, device=torch.device("cpu"),
                         params=[torch.ones(3)], signature=7.0)
    engine.set_epoch_size(1000)
    return engine


def test_the_failed_round_runs_again_on_the_survivors() -> None:
    plane = FailingPeers(world_size=3)
    engine = engine_for(plane, 3)
    survivors = Survivors(engine, Change(generation=1, before=(0, 1, 2), after=(0, 2)))
    (outcome,) = engine.run_round(epoch=0, out_of_data=False, epoch_batches=5)
    assert len(survivors.seen) == 1 and plane.retries == 1
    assert plane.regroups == [(0, 2)]
    assert len(outcome.reports) == 2 and engine.world_size == 2
    assert engine.controller.world_size == 2 and len(engine.controller.batch_counts) == 2
    assert len(engine.state.totals) == 2 and len(engine.state.lost_totals) == 1
    assert outcome.reports[0].epoch_batches == 5
    assert engine.metrics(outcome)["elche/alive"] == 2.0


def test_an_outcome_of_the_old_members_is_still_published_after_the_change() -> None:
    # A round of three ranks published after the survivors renumbered their running totals to two
    # (a KeyboardInterrupt on a cpu_async peer once ended rank 0's fit here with a zip error).
    plane = FailingPeers(world_size=3, failures=0)
    engine = engine_for(plane, 3)
    engine.record_step(8, torch.tensor(0.25), 0.1)
    (outcome,) = engine.run_round(epoch=0, out_of_data=False, epoch_batches=1)
    engine.apply_change(Change(generation=1, before=(0, 1, 2), after=(0, 2)))
    metrics = engine.metrics(outcome)
    assert metrics["elche/alive"] == 3.0
    assert {f"elche/idle/rank{k}" for k in range(3)} <= set(metrics)
    assert all(0.0 <= metrics[f"elche/idle/rank{k}"] <= 1.0 for k in range(3))


def test_the_round_in_flight_is_handed_out_before_the_next_round_can_renumber_the_members() -> None:
    # cpu_async: the round in flight completes on three ranks; the next one loses rank 1. Its caller
    # must act on the first outcome (dispatch shares, the rank's own report) while the engine still
    # counts three members, not after the change renumbered them.
    class LosesAPeerInTheNextRound(FailingPeers):
        non_blocking = True

        def start(self, local: torch.Tensor) -> None:
            super().start(local)
            self.failures = int(len(self.starts) == 2)

    plane = LosesAPeerInTheNextRound(world_size=3, failures=0)
    engine = engine_for(plane, 3)
    Survivors(engine, Change(generation=1, before=(0, 1, 2), after=(0, 2)))
    engine.record_step(8, torch.tensor(0.25), 0.1)
    assert engine.run_round(epoch=0, out_of_data=False, blocking=False) == []  # in flight
    engine.record_step(8, torch.tensor(0.25), 0.1)
    seen: list[tuple[int, int]] = []
    for outcome in engine.rounds_at_boundary(epoch=0, out_of_data=lambda: True, blocking=True):
        seen.append((len(outcome.reports), engine.world_size))
    assert seen == [(3, 3), (2, 2)]


def test_work_a_lost_peer_leaves_in_the_round_in_flight_keeps_the_epoch_open() -> None:
    # cpu_async, soak trial 58: the survivors reached their last batch with a round in flight; that
    # round lost a peer (regrouped and retried, it used up the "epoch stays open" mark) and its
    # untrained work came back to the epoch. The next round must be sent after the caller looked
    # for that work: sent with the stale "out of data", every survivor ended the epoch without it.
    class LosesAPeerInFlight(FailingPeers):
        non_blocking = True

        def start(self, local: torch.Tensor) -> None:
            super().start(local)
            self.failures = int(len(self.starts) == 1)

    plane = LosesAPeerInFlight(world_size=3, failures=0)
    plane.peer_out_of_data = True
    engine = engine_for(plane, 3)
    Survivors(engine, Change(generation=1, before=(0, 1, 2), after=(0, 2)), keep_epoch_open=True)
    engine.record_step(8, torch.tensor(0.25), 0.1)
    assert engine.run_round(epoch=0, out_of_data=False, blocking=False) == []  # in flight
    engine.record_step(8, torch.tensor(0.25), 0.1)
    work_came = {"asked": 0}

    def still_out_of_data() -> bool:
        work_came["asked"] += 1
        return engine.world_size == 3  # after the regroup, the lost peer's batches are this rank's

    outcomes = list(engine.rounds_at_boundary(epoch=0, out_of_data=still_out_of_data, blocking=True))
    assert [len(outcome.reports) for outcome in outcomes] == [2, 2]
    assert work_came["asked"] == 1, "out_of_data is asked once, when the next round starts"
    assert plane.starts[-1][Meta.OUT_OF_DATA] == 0.0
    assert not any(outcome.epoch_over for outcome in outcomes)


def test_a_rank_that_missed_a_round_takes_it_over_and_joins_the_next_one_without_mass() -> None:
    # Rank 1 of 3 died in the middle of a round's collectives: this rank's round failed, the
    # furthest survivor's completed; it hands over its round, this rank takes it and joins the
    # survivors' next round without mass (its work is in the round it took over).
    leader = engine_for(FailingPeers(world_size=3, failures=0), 3)
    laggard_plane = FailingPeers(world_size=3, failures=1)
    laggard = engine_for(laggard_plane, 3)
    for engine in (leader, laggard):
        for _ in range(3):
            engine.record_step(8, torch.tensor(0.25), 0.1)
    (missed,) = leader.run_round(epoch=0, out_of_data=False, epoch_batches=3)
    record = leader.round_record()
    change = Change(generation=1, before=(0, 1, 2), after=(0, 2), completed_rounds={0: 1, 2: 0})

    class CatchUp:
        def after_failed_round(self, failure: PeerFailure) -> Change:
            took = laggard.catch_up(record)
            assert took == missed and laggard.state.rounds == leader.state.rounds == 1
            assert laggard.controller.state_dict() == leader.controller.state_dict()
            assert laggard.state.totals == leader.state.totals
            laggard.apply_change(change)
            return change

    laggard.failures = CatchUp()
    (joined,) = laggard.run_round(epoch=0, out_of_data=False, epoch_batches=3)
    first, second = laggard_plane.starts
    assert first[Meta.STEPS] == 3 and first[Meta.ROUND] == 0
    assert second[Meta.STEPS] == 0 and second[Meta.SAMPLES] == 0 and second[Meta.LOSS_SUM] == 0
    assert second[Meta.ROUND] == 1 and second[Meta.EPOCH_BATCHES] == 3, "the others' round, its own epoch count"
    assert laggard_plane.retries == 0 and joined.index == 2 and laggard.state.rounds == 2
    assert len(joined.reports) == 2 and joined.reports[0].steps == 0


def test_without_a_handler_the_failure_ends_the_fit() -> None:
    engine = engine_for(FailingPeers(world_size=2), 2)
    with pytest.raises(PeerFailure):
        engine.run_round(epoch=0, out_of_data=False)


def test_handed_over_work_keeps_the_epoch_open_for_one_round() -> None:
    plane = FailingPeers(world_size=3)
    plane.peer_out_of_data = True
    engine = engine_for(plane, 3)
    Survivors(engine, Change(generation=1, before=(0, 1, 2), after=(0, 1)), keep_epoch_open=True)
    (retried,) = engine.run_round(epoch=0, out_of_data=True)
    assert not retried.epoch_over, "the survivors still have the lost rank's batches to train"
    (next_round,) = engine.run_round(epoch=0, out_of_data=True)
    assert next_round.epoch_over


def test_reaching_max_failure_stops_at_the_retried_round() -> None:
    plane = FailingPeers(world_size=3)
    engine = engine_for(plane, 3)
    Survivors(engine, Change(generation=1, before=(0, 1, 2), after=(0, 1), ends_fit=True))
    (outcome,) = engine.run_round(epoch=0, out_of_data=False)
    assert outcome.stop_level is StopRequest.RANKS_LOST and outcome.stop_level.saves


def test_the_controller_keeps_the_survivors_speeds() -> None:
    controller = ElCheController(world_size=3, anchor=4)
    controller.report_timing([10.0, 40.0, 20.0], [4, 1, 2], 1.0)
    speeds = [controller.smoothed_ms(r) for r in range(3)]
    controller.apply_change(Change(generation=1, before=(0, 1, 2), after=(0, 2)))
    assert controller.world_size == 2
    assert [controller.smoothed_ms(r) for r in range(2)] == [speeds[0], speeds[2]]
    controller.report_timing([10.0, 20.0], [4, 2], 1.0)
    assert controller.batch_counts[0] > controller.batch_counts[1], "the faster survivor plans more batches"
    with pytest.raises(ValueError, match="retained"):
        controller.apply_change(Change(generation=2, before=(0, 1, 2), after=(0,)))  # names 3 ranks of 2


def test_a_lone_survivors_controller_state_resumes_on_more_ranks() -> None:
    # torchrun restarts every worker after a loss; the newest checkpoint may come from the last survivor.
    survivor = ElCheController(world_size=2, anchor=4)
    survivor.report_timing([10.0, 30.0], [4, 2], 1.0)
    survivor.apply_change(Change(generation=1, before=(0, 1), after=(0,)))
    saved = survivor.state_dict()
    assert saved["world_size"] == 1
    resumed = ElCheController(world_size=2, anchor=4)
    resumed.load_state_dict(saved)
    assert resumed.world_size == 2 and len(resumed.batch_counts) == 2 and resumed.anchor == survivor.anchor


def test_what_a_rank_kept_in_the_consensus_follows_two_changes_without_a_round_between() -> None:
    # Soak trial 54: rank 1 lost in a validation, then rank 3 at the epoch's end, no round between:
    # the second loss read the last round's batches in the numbering before the first, so rank 3 was
    # said to keep its neighbour's 27 batches instead of its own 32 (and 5 were counted untrained).
    class PeersWithBatches(FailingPeers):
        def collect(self) -> RoundResult:
            result = super().collect()
            for row, batches in zip(result.table[1:], (23, 27, 32), strict=True):
                row[Meta.EPOCH_BATCHES] = batches
            return result

    engine = engine_for(PeersWithBatches(world_size=4, failures=0), 4)
    engine.run_round(epoch=1, out_of_data=True, epoch_batches=20)
    assert engine.progress_at_failure(1).epoch_batches == (20, 23, 27, 32)
    engine.apply_change(Change(generation=1, before=(0, 1, 2, 3), after=(0, 2, 3)))
    assert engine.progress_at_failure(1).epoch_batches == (20, 27, 32)
    engine.apply_change(Change(generation=2, before=(0, 2, 3), after=(0, 3)))
    assert engine.progress_at_failure(1).epoch_batches == (20, 32)
    assert engine.progress_at_failure(0).epoch_batches == (0, 0)


def test_a_joiner_takes_the_consensus_round_the_members_asked_for_and_have_not_run() -> None:
    # An admission at an earlier consensus round leaves the members' own request pending; a joiner
    # without it would run that round non-blocking in cpu_async while they block and admit there.
    member = engine_for(FailingPeers(world_size=2, failures=0), 2)
    member.record_step(8, torch.tensor(0.25), 0.1)
    member.run_round(epoch=0, out_of_data=False)
    member.request_consensus(at_round=3)
    joiner = engine_for(FailingPeers(world_size=2, failures=0), 2)
    joiner.join_from(member.round_record())
    assert joiner.state.rounds == member.state.rounds == 1
    assert joiner._consensus_at == member._consensus_at == 3
    member.request_consensus(at_round=2)  # the earlier of two requests wins, on both alike
    joiner.request_consensus(at_round=2)
    assert joiner._consensus_at == member._consensus_at == 2
