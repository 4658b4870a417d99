"""The round protocol of one rank, driven against a scripted peer (no processes)."""

import math
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from lightning_elche import ElCheConfig
from lightning_elche.averaging import round_weights
from lightning_elche.controller import CALIBRATION_ANCHOR, CALIBRATION_WINDOWS
from lightning_elche.engine import ElCheEngine
from lightning_elche.planes.base import AveragingPlane, RoundResult
from lightning_elche.rounds import META_SIZE, Meta, RanksOutOfStep, StopRequest, validate_table


class ScriptedPeer(AveragingPlane):
    """Rank 1's rows come from a script; rank 0 is the engine under test."""

    def __init__(self, non_blocking: bool = False) -> None:
        self.non_blocking = non_blocking
        self.peer_rows: list[dict] = []
        self.averaged = []
        self.adopted: list[float] = []
        self.own_divergence = [0.0, 1.0, 1.0]  # [||pre - consensus||, ||pre||, ||consensus||]
        self.finished = True
        self._local = None

    def start(self, local):
        self._local = local

    def ready(self):
        return self.finished

    def collect(self):
        local = self._local
        peer = torch.zeros(META_SIZE, dtype=torch.float64)
        row = {"ROUND": local[Meta.ROUND].item(), "EPOCH": local[Meta.EPOCH].item(),
               "SIGNATURE": local[Meta.SIGNATURE].item(), "FINITE": 1.0, **self.peer_rows.pop(0)}
        for name, value in row.items():
            peer[Meta[name]] = value
        table = torch.stack([local.cpu(), peer]).tolist()
        validate_table(table)
        weights = round_weights([int(r[Meta.STEPS]) for r in table], 1.0)
        self.averaged.append(weights)
        divergence = torch.tensor(self.own_divergence, dtype=torch.float64) if weights.realized else None
        return RoundResult(table, weights, divergence)

    def adopt(self, result, alpha):
        self.adopted.append(alpha)


def make_engine(outer=None, non_blocking=False, **config):
    plane = ScriptedPeer(non_blocking)
    param = torch.ones(4)
    engine = ElCheEngine(ElCheConfig(**config), plane, rank=0, world_size=2, device=torch.device("cpu"),
                         params=[param], signature=42.0, outer=outer)
    engine.set_epoch_size(1000)
    return engine, plane, param


def run_window(engine, steps, loss=1.0):
    for _ in range(steps):
        engine.record_step(8, torch.tensor(loss), lr=0.1)


def test_window_plan_starts_with_short_calibration_windows_and_is_due_after_planned_steps():
    # The fit's first two windows are short (the plan from no reading, then from the warm-up
    # readings); then every rank plans the anchor's window.
    engine, plane, _ = make_engine()
    assert (CALIBRATION_WINDOWS, CALIBRATION_ANCHOR) == (2, 2)
    for _ in range(CALIBRATION_WINDOWS):
        assert engine.planned_steps == CALIBRATION_ANCHOR
        run_window(engine, CALIBRATION_ANCHOR - 1)
        assert not engine.window_due()
        run_window(engine, 1)
        assert engine.window_due()
        plane.peer_rows.append({"STEPS": CALIBRATION_ANCHOR, "COMPUTE_S": 0.01 * CALIBRATION_ANCHOR})
        with mock.patch.object(engine.clock, "close_window", return_value=0.01 * CALIBRATION_ANCHOR):
            engine.run_round(epoch=0, out_of_data=False)
    assert engine.planned_steps == 10
    run_window(engine, 9)
    assert not engine.window_due()
    run_window(engine, 1)
    assert engine.window_due()


def test_round_weights_by_work_and_plans_the_fast_rank_more():
    engine, plane, _ = make_engine()
    for _ in range(3):
        run_window(engine, engine.planned_steps)
        peer_steps = engine.controller.planned_batches(1)
        with mock.patch.object(engine.clock, "close_window", return_value=0.01 * engine.planned_steps):
            plane.peer_rows.append({"STEPS": peer_steps, "SAMPLES": 8 * peer_steps, "COMPUTE_S": 0.03 * peer_steps,
                                    "LAST_SYNC_S": 0.001})
            (outcome,) = engine.run_round(epoch=0, out_of_data=False)
    # Rank 0 is 3x faster per step (10 ms vs 30 ms): it gets ~3x the batches per window, in the
    # calibration windows (anchor 2) and after them (anchor 10).
    assert outcome.planned == (30, 10)
    assert plane.averaged[0].param_factors == (0.5, 0.5)
    assert plane.averaged[1].param_factors == pytest.approx((0.75, 0.25))
    assert plane.averaged[-1].param_factors == pytest.approx((0.75, 0.25))
    assert outcome.cohort_step == (2 + 2) + (6 + 2) + (30 + 10)
    assert not outcome.epoch_over and outcome.stop_level == 0


def test_epoch_is_over_only_when_every_rank_is_out_of_data():
    engine, plane, _ = make_engine()
    run_window(engine, 3)
    plane.peer_rows.append({"STEPS": 10, "OUT_OF_DATA": 0.0})
    assert not engine.run_round(0, out_of_data=True)[0].epoch_over
    plane.peer_rows.append({"STEPS": 2, "OUT_OF_DATA": 1.0})
    (outcome,) = engine.run_round(0, out_of_data=True)
    assert outcome.epoch_over
    # The draining rank joined with zero steps: zero mass.
    assert plane.averaged[-1].param_factors == (0.0, 1.0)


def test_stop_requests_travel_to_every_rank():
    engine, plane, _ = make_engine()
    run_window(engine, 10)
    plane.peer_rows.append({"STEPS": 10, "STOP_REQUESTED": 2.0})
    (outcome,) = engine.run_round(0, out_of_data=False, stop_level=1)
    assert outcome.stop_level == 2 and outcome.ends_window_sequence


def test_a_saving_stop_in_a_non_blocking_round_is_carried_to_a_consensus_round():
    # cpu_async: the round that carries a SIGTERM is in flight while the rank trains on, so the save
    # waits for the next round, which every rank makes a consensus round (blocking, alpha 1).
    engine, plane, _ = make_engine(non_blocking=True, mode="cpu_async")
    run_window(engine, engine.planned_steps)
    plane.peer_rows.append({"STEPS": 10, "STOP_REQUESTED": float(StopRequest.SIGTERM)})
    assert engine.run_round(0, out_of_data=False, blocking=False) == []  # in flight
    run_window(engine, 2)
    (carried,) = engine.poll()
    assert carried.stop_level is StopRequest.NONE and not carried.consensus
    run_window(engine, engine.planned_steps)
    plane.peer_rows.append({"STEPS": 10})
    (acted,) = engine.run_round(0, out_of_data=False, blocking=False)  # forced to block
    assert acted.consensus and acted.stop_level is StopRequest.SIGTERM and plane.adopted[-1] == 1.0
    assert plane._local[Meta.STOP_REQUESTED].item() == float(StopRequest.SIGTERM)  # this rank carried it


def test_a_saving_stop_while_ranks_drain_waits_for_the_epoch_end():
    engine, plane, _ = make_engine()
    run_window(engine, 3)
    plane.peer_rows.append({"STEPS": 4, "OUT_OF_DATA": 0.0, "STOP_REQUESTED": float(StopRequest.REQUEUE)})
    (draining,) = engine.run_round(0, out_of_data=True)
    assert draining.stop_level is StopRequest.NONE and not draining.ends_window_sequence
    plane.peer_rows.append({"STEPS": 1, "OUT_OF_DATA": 1.0})
    (over,) = engine.run_round(0, out_of_data=True)
    assert over.epoch_over and over.stop_level is StopRequest.REQUEUE


def test_step_budget_counts_cohort_steps():
    engine, plane, _ = make_engine()
    engine.step_budget = 35
    run_window(engine, 10)
    plane.peer_rows.append({"STEPS": 10})
    assert not engine.run_round(0, False)[0].budget_reached
    run_window(engine, 10)
    plane.peer_rows.append({"STEPS": 10})
    assert engine.run_round(0, False)[0].budget_reached


def test_ranks_in_different_rounds_fail_loudly_instead_of_hanging():
    engine, plane, _ = make_engine()
    run_window(engine, 10)
    plane.peer_rows.append({"STEPS": 10, "ROUND": 7.0})
    with pytest.raises(RanksOutOfStep, match="round"):
        engine.run_round(0, False)


def test_different_models_fail_loudly():
    engine, plane, _ = make_engine()
    plane.peer_rows.append({"STEPS": 1, "SIGNATURE": 1.0})
    with pytest.raises(RanksOutOfStep, match="signature"):
        engine.run_round(0, False)


def test_non_finite_parameters_anywhere_stop_every_rank():
    engine, plane, param = make_engine()
    param[0] = math.nan
    plane.peer_rows.append({"STEPS": 1})
    with pytest.raises(FloatingPointError, match=r"rank\(s\) \[0\]"):
        engine.run_round(0, False)


def test_metrics_of_a_round():
    engine, plane, _ = make_engine()
    run_window(engine, 10, loss=2.0)
    plane.peer_rows.append({"STEPS": 10, "SAMPLES": 40, "COMPUTE_S": 0.5, "LOSS_SUM": 40.0})
    with mock.patch.object(engine.clock, "close_window", return_value=0.2):
        (outcome,) = engine.run_round(0, False)
    m = engine.metrics(outcome)
    assert m["elche/anchor"] == 10 and m["elche/syncs"] == 1 and m["elche/cohort_step"] == 20
    assert m["elche/batch_share/rank0"] == 0.5 and m["elche/batch_share/rank1"] == 0.5
    assert m["elche/samples_per_s/rank0"] == pytest.approx(80 / 0.2)
    assert m["elche/samples_per_s/rank1"] == pytest.approx(40 / 0.5)
    assert m["elche/train_loss"] == pytest.approx((20.0 + 40.0) / 20)
    assert set(m) >= {"elche/overhead", "elche/idle/rank0", "elche/idle/rank1"}


def test_per_step_path_makes_no_collective_no_item_no_device_sync():
    engine, _, _ = make_engine()
    forbidden = RuntimeError("called in the per-step path")
    with mock.patch.object(torch.Tensor, "item", side_effect=forbidden), \
            mock.patch.object(torch.Tensor, "tolist", side_effect=forbidden), \
            mock.patch.object(torch.cuda, "synchronize", side_effect=forbidden), \
            mock.patch.object(dist, "all_reduce", side_effect=forbidden), \
            mock.patch.object(dist, "all_gather_into_tensor", side_effect=forbidden), \
            mock.patch.object(dist, "broadcast", side_effect=forbidden):
        for _ in range(100):
            engine.record_step(8, torch.tensor(0.5), lr=0.1)
            engine.window_due()
    assert engine._steps == 100


def sync(engine, plane, steps=10, lr=0.1, peer=None, own_divergence=None):
    if own_divergence is not None:
        plane.own_divergence = own_divergence
    for _ in range(steps):
        engine.record_step(8, torch.tensor(1.0), lr=lr)
    plane.peer_rows.append({"STEPS": steps, **(peer or {})})
    with mock.patch.object(engine.clock, "close_window", return_value=0.01 * steps):
        (outcome,) = engine.run_round(0, False)
    return outcome


def test_divergence_reaches_every_rank_one_round_later():
    engine, plane, _ = make_engine()
    first = sync(engine, plane, own_divergence=[0.2, 2.0, 4.0])
    assert first.divergence is None  # nothing measured before the first reduce
    second = sync(engine, plane, peer={"HAS_DIVERGENCE": 1.0, "DELTA_NORM": 0.4, "PRE_NORM": 2.1, "POST_NORM": 4.0})
    assert second.divergence.deltas == [0.05, 0.1]
    assert second.divergence.pre_norms == [2.0, 2.1] and second.divergence.post_norm == 4.0
    m = engine.metrics(second)
    assert m["elche/divergence"] == 0.1 and m["elche/divergence/rank0"] == 0.05


def test_rising_divergence_makes_the_default_guard_suppress_growth():
    engine, plane, _ = make_engine(meta_controller=False)
    verdicts = []
    for d in (0.06, 0.07, 0.08, 0.09):
        peer = {"HAS_DIVERGENCE": 1.0, "DELTA_NORM": d, "PRE_NORM": 1.0, "POST_NORM": 1.0}
        outcome = sync(engine, plane, peer=peer, own_divergence=[d, 1.0, 1.0])
        verdicts.append(type(outcome.feedback.verdict).__name__)
    # Measurements lag one round: 0.06, 0.07, 0.08 are judged at rounds 2-4.
    assert verdicts == ["Stable", "Stable", "Stable", "SuppressGrowth"]
    assert engine.controller.growth_enabled is False
    assert engine.metrics(outcome)["elche/verdict"] == 1.0


def test_lr_cliff_makes_the_meta_controller_shrink_the_window():
    engine, plane, _ = make_engine()
    sync(engine, plane, lr=0.1)
    sync(engine, plane, lr=0.1)
    assert engine.controller.anchor == 10
    outcome = sync(engine, plane, lr=0.01)
    assert outcome.feedback.meta_action == "lr_cliff"
    assert outcome.feedback.anchor_before == 10 and outcome.feedback.anchor_after == 5
    assert engine.controller.anchor == 5


def test_meta_controller_off_leaves_the_anchor_alone():
    engine, plane, _ = make_engine(meta_controller=False)
    sync(engine, plane, lr=0.1), sync(engine, plane, lr=0.1)
    assert sync(engine, plane, lr=0.01).feedback.meta_action == "noop"
    assert engine.controller.anchor == 10


def test_inner_reset_is_flagged_only_on_realized_rounds():
    from lightning_elche.outer import DiLoCo

    engine, plane, _ = make_engine(outer=DiLoCo(lr=0.7, momentum=0.9))
    outcome = sync(engine, plane)
    assert outcome.reset_inner
    plane.peer_rows.append({"STEPS": 0})
    (idle,) = engine.run_round(0, False)  # nobody moved: nothing averaged, no inner reset
    assert not idle.reset_inner and not idle.weights.realized


def test_engine_state_round_trips():
    engine, plane, _ = make_engine()
    for _ in range(6):
        sync(engine, plane, peer={"COMPUTE_S": 0.3})
    state = engine.state_dict()
    fresh, _, _ = make_engine()
    fresh.load_state_dict(state)
    assert fresh.state.rounds == 6 and fresh.state.cohort_step == engine.state.cohort_step
    assert fresh.controller.batch_counts == engine.controller.batch_counts
    assert fresh.controller.phase == engine.controller.phase


def test_async_rounds_stay_in_flight_and_blend_with_easgd_alpha():
    engine, plane, _ = make_engine(non_blocking=True, mode="cpu_async")
    assert engine.alpha == 0.5 and engine.max_overshoot == 3
    run_window(engine, 10)
    plane.finished = False
    plane.peer_rows.append({"STEPS": 10})
    assert engine.run_round(0, False, blocking=False) == []  # in flight, training goes on
    assert engine.in_flight
    run_window(engine, 1)
    assert engine.poll() == []  # not done, under the overshoot bound
    plane.finished = True
    (outcome,) = engine.poll()  # done: adopted mid-window with the elastic blend
    assert plane.adopted == [0.5] and not engine.in_flight
    assert outcome.cohort_step == 20
    # Stable verdicts grow the lookahead by one.
    assert engine.max_overshoot == 4


def test_async_overshoot_bound_forces_the_wait():
    engine, plane, _ = make_engine(non_blocking=True, mode="cpu_async", max_overshoot=2)
    run_window(engine, 10)
    plane.finished = False
    plane.peer_rows.append({"STEPS": 10})
    engine.run_round(0, False, blocking=False)
    run_window(engine, 1)
    assert engine.poll() == []
    run_window(engine, 1)
    assert len(engine.poll()) == 1  # two steps past the sync point: collect, even if not ready
    assert engine.max_overshoot == 2  # pinned by the user


def test_async_round_that_ends_the_epoch_overwrites_instead_of_blending():
    engine, plane, _ = make_engine(non_blocking=True, mode="cpu_async")
    run_window(engine, 10)
    plane.peer_rows.append({"STEPS": 10})
    engine.run_round(0, False, blocking=False)
    run_window(engine, 3)
    plane.peer_rows.append({"STEPS": 4, "OUT_OF_DATA": 1.0})
    earlier, last = engine.run_round(0, out_of_data=True, blocking=True)
    assert not earlier.epoch_over and last.epoch_over
    assert plane.adopted == [0.5, 1.0]


def test_max_batch_diff_bounds_the_lead_over_the_slowest_plan():
    engine, plane, _ = make_engine(max_batch_diff=0)
    for _ in range(CALIBRATION_WINDOWS):  # rank 0 measured 5x faster
        sync(engine, plane, steps=10, peer={"COMPUTE_S": 0.5})
    assert engine.controller.batch_counts[0] > engine.controller.batch_counts[1]  # the controller's plan
    assert engine.planned_steps == engine.controller.batch_counts[1]  # strict lockstep wins
    loose, plane2, _ = make_engine(max_batch_diff=3)
    for _ in range(CALIBRATION_WINDOWS):
        sync(loose, plane2, steps=10, peer={"COMPUTE_S": 0.5})
    assert loose.planned_steps == loose.controller.batch_counts[1] + 3


def test_a_round_tells_the_plan_what_is_left_of_the_epoch():
    engine, plane, _ = make_engine()
    engine.set_epoch_size(60)
    started = 0
    for _ in range(CALIBRATION_WINDOWS):  # equal speeds: plan [10, 10] after them
        started += 2
        sync(engine, plane, steps=2, peer={"EPOCH_BATCHES": started, "COMPUTE_S": 0.02})
    # Each round carries the batches every rank started in the epoch (this rank reported none yet).
    assert engine.controller.batch_counts == [10, 10] and not engine.controller.window_reaches_epoch_end
    run_window(engine, 10)
    plane.peer_rows.append({"STEPS": 10, "EPOCH_BATCHES": 39, "COMPUTE_S": 0.1})
    with mock.patch.object(engine.clock, "close_window", return_value=0.1):
        (outcome,) = engine.run_round(0, out_of_data=False, epoch_batches=14)
    assert outcome.epoch_batches == (14, 39) and outcome.epoch == 0
    assert outcome.dispatch_shares == pytest.approx((0.5, 0.5))
    # 60 - 53 = 7 batches left, fewer than the window's 20: every rank runs to the epoch's end.
    assert engine.controller.window_reaches_epoch_end
    assert engine.planned_steps == 7
    run_window(engine, 3)
    plane.peer_rows.append({"STEPS": 4, "EPOCH_BATCHES": 43, "OUT_OF_DATA": 1.0, "COMPUTE_S": 0.04})
    with mock.patch.object(engine.clock, "close_window", return_value=0.03):
        (outcome,) = engine.run_round(0, out_of_data=True, epoch_batches=17)
    assert outcome.epoch_over
    # The next window starts the next epoch, all of it left: the anchor's window again.
    assert not engine.controller.window_reaches_epoch_end and engine.planned_steps == 10


def test_the_sync_modes_keep_their_window_at_the_epoch_end():
    # Lockstep windows of one batch over an equal split: 2 batches left would be the window to
    # the epoch's end under the pooled dispatch.
    engine, plane, _ = make_engine(mode="nccl_sync")
    engine.set_epoch_size(5)
    sync(engine, plane, steps=1, peer={"EPOCH_BATCHES": 3})
    assert engine.controller.batch_counts == [1, 1]
    assert not engine.controller.window_reaches_epoch_end and engine.planned_steps == 1


def test_a_consensus_requested_for_a_round_index_is_that_round_however_the_round_before_completed():
    # cpu_async: the outcome of an in-flight round arrives either in poll() or inside the next
    # run_round, after which that next round has already started; a "next round" request from a
    # listener of that outcome then lands one round later on one rank than on another (a sync
    # checkpoint on one rank only). A request naming the round's index lands on the same round.
    for completes_in_poll in (True, False):
        engine, plane, _ = make_engine(non_blocking=True, mode="cpu_async")
        engine.request_consensus(at_round=3)
        outcomes = []
        for _ in range(3):
            run_window(engine, engine.planned_steps)
            if completes_in_poll and engine.in_flight:
                outcomes += engine.poll()
            plane.peer_rows.append({"STEPS": 10})
            outcomes += engine.run_round(0, out_of_data=False, blocking=False)
        outcomes += engine.poll()
        by_index = {o.index: o.consensus for o in outcomes}
        assert by_index == {1: False, 2: False, 3: True}, (completes_in_poll, by_index)
        assert plane.adopted[-1] == 1.0  # the consensus round overwrites


def test_a_consensus_for_the_next_round_is_still_available():
    engine, plane, _ = make_engine(non_blocking=True, mode="cpu_async")
    engine.request_consensus()
    run_window(engine, engine.planned_steps)
    plane.peer_rows.append({"STEPS": 10})
    (outcome,) = engine.run_round(0, out_of_data=False, blocking=False)  # made blocking by the request
    assert outcome.consensus and outcome.index == 1


def test_a_dead_peers_knock_ends_the_window_after_its_current_step():
    engine, plane, _ = make_engine()
    died = [True, False]
    engine.knocks = (lambda: died.pop(0) if died else False,)
    assert not engine.window_due() and died == [True, False], "no step yet in this window: not asked"
    run_window(engine, 1)
    assert engine.planned_steps > 1
    assert engine.window_due(), "a peer died: the round that takes it out comes now"
    assert not engine.window_due()


def test_a_joiners_knock_ends_the_window_after_its_current_step():
    engine, plane, _ = make_engine()
    knocks = [False, True]
    engine.knocks = (lambda: knocks.pop(0) if knocks else False,)
    assert not engine.window_due()  # no step yet in this window: the knock waits for one
    assert knocks == [False, True]
    run_window(engine, 1)
    assert engine.planned_steps > 1
    assert not engine.window_due()
    assert engine.window_due()  # knocked: the round comes now
    assert not engine.window_due()
