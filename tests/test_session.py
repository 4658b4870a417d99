"""The per-rank life of a fit (Session) and the Lightning patches, without processes."""

from __future__ import annotations

import os
import signal
import time
from types import SimpleNamespace

import pytest
from lightning.pytorch import Trainer

from lightning_elche.loop_glue import LightningPatches
from lightning_elche.membership.change import Change
from lightning_elche.rounds import StopRequest
from lightning_elche.session import Phase, RoundAction, Session


def outcome(epoch_over=False, stop=StopRequest.NONE, budget=False) -> SimpleNamespace:
    return SimpleNamespace(epoch_over=epoch_over, stop_level=stop, budget_reached=budget)


def test_batches_open_windows_and_count_per_epoch():
    session = Session(world_size=2)
    assert session.phase is Phase.IDLE and not session.in_window
    assert session.start_batch(epoch=0, samples=8) is True
    assert session.start_batch(epoch=0, samples=8) is False
    assert session.in_window and session.epoch == 0
    assert session.take_pending_samples() == 16 and session.take_pending_samples() == 0
    assert session.start_batch(epoch=1, samples=4) is True
    assert session.epoch == 1
    session.end_training()
    assert session.phase is Phase.IDLE


def test_rounds_turn_outcomes_into_one_action():
    session = Session(world_size=2)
    session.start_batch(0, 8)
    assert session.after_round(outcome(), lambda: True) is RoundAction.CONTINUE and session.in_window
    assert session.after_round(outcome(epoch_over=True), lambda: True) is RoundAction.LEAVE_EPOCH
    assert session.leaving and not session.in_window
    session.start_batch(1, 8)  # a new epoch clears the decision
    assert session.in_window
    assert session.after_round(outcome(budget=True), lambda: True) is RoundAction.STOP_FIT and session.leaving
    session.start_batch(2, 8)
    assert session.after_round(outcome(stop=StopRequest.SIGTERM), lambda: True) is RoundAction.SAVE_AND_EXIT
    assert session.phase is Phase.SAVING and session.leaving and session.pending_save is StopRequest.SIGTERM
    session.start_batch(3, 8)  # a stop signal is not cleared by a new epoch: the save comes first
    assert session.phase is Phase.SAVING and not session.in_window


def test_a_requeue_signal_saves_like_sigterm_and_outranks_it():
    session = Session(world_size=2)
    session.start_batch(0, 8)
    assert session.request_stop(StopRequest.SIGTERM) and session.request_stop(StopRequest.REQUEUE)
    assert session.take_stop_request() is StopRequest.REQUEUE
    assert session.after_round(outcome(stop=StopRequest.REQUEUE), lambda: False) is RoundAction.SAVE_AND_EXIT
    assert session.pending_save is StopRequest.REQUEUE
    assert not StopRequest.GRACEFUL.saves and StopRequest.SIGTERM.saves and StopRequest.REQUEUE.saves


def test_a_stop_before_min_epochs_is_kept_for_a_later_round():
    session = Session(world_size=2)
    session.start_batch(0, 8)
    assert session.after_round(outcome(stop=StopRequest.GRACEFUL), lambda: False) is RoundAction.CONTINUE
    assert session.take_stop_request() is StopRequest.GRACEFUL
    assert session.take_stop_request() is StopRequest.NONE


def test_stop_requests_keep_the_most_urgent_and_a_local_should_stop_is_held_back():
    session = Session(world_size=2)
    assert session.request_stop(StopRequest.SIGTERM) is True
    assert session.request_stop(StopRequest.GRACEFUL) is False
    assert session.stop_request is StopRequest.SIGTERM
    session.take_stop_request()
    assert session.hold_back_local_stop(True) is True
    assert session.stop_request is StopRequest.GRACEFUL
    session.saw_should_stop(True)  # the round itself set should_stop: not a new local request
    assert session.hold_back_local_stop(True) is False


def test_sync_point_is_a_phase_that_restores_the_previous_one():
    session = Session(world_size=2)
    session.start_batch(0, 8)
    with session.at_sync_point():
        assert session.at_sync_point_now and not session.in_window
    assert session.in_window


def test_a_regroup_renumbers_the_callback_role():
    session = Session(world_size=4)
    session.callback_role.fastest = 3
    session.apply_change(Change(generation=1, before=(0, 1, 2, 3), after=(0, 1, 3)))
    assert session.world_size == 3 and session.callback_role.fastest == 2
    session.apply_change(Change(generation=2, before=(0, 1, 3), after=(0, 1)))  # the role's rank is lost
    assert session.callback_role.fastest is None and session.callback_role.rank_for("fastest") == 0


def test_max_steps_is_taken_over_and_given_back():
    trainer = Trainer(max_steps=7, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    patches = LightningPatches()
    patches.take_over_max_steps(trainer)
    assert trainer.max_steps == -1
    patches.undo()
    assert trainer.max_steps == 7


def test_every_loop_patch_is_undone():
    trainer = Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    fit_loop, epoch_loop = trainer.fit_loop, trainer.fit_loop.epoch_loop
    patches = LightningPatches()
    patches.report_cohort_batches(trainer, lambda: None)
    patches.silence_per_step_sigterm_broadcast(trainer)
    assert "setup_data" in vars(fit_loop) and "_broadcast_sigterm_tensor" in vars(epoch_loop)
    patches.undo()
    assert "setup_data" not in vars(fit_loop) and "_broadcast_sigterm_tensor" not in vars(epoch_loop)


@pytest.fixture
def restore_sigterm():
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


def test_sigterm_reaches_elche_then_the_handler_lightning_had_chained(restore_sigterm):
    calls: list[str] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: calls.append("user"))
    trainer = Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    connector = trainer._signal_connector
    connector.register_signal_handlers()  # as Trainer.fit does: Lightning's composite, chaining the user's
    patches = LightningPatches()
    assert patches.route_stop_signals(trainer, lambda request, signum: calls.append("elche"))
    os.kill(os.getpid(), signal.SIGTERM)
    assert calls == ["elche", "user"]
    # Lightning's own notifier (a broadcast and a rank-local flag) is not chained.
    assert trainer.received_sigterm is False
    patches.undo()
    connector.teardown()
    os.kill(os.getpid(), signal.SIGTERM)
    assert calls == ["elche", "user", "user"]


def test_sigterm_handler_installed_after_lightnings_still_runs(restore_sigterm):
    calls: list[str] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: calls.append("later"))
    patches = LightningPatches()
    assert patches.route_stop_signals(SimpleNamespace(strategy=None), lambda request, signum: calls.append("elche"))
    os.kill(os.getpid(), signal.SIGTERM)
    assert calls == ["elche", "later"]
    patches.undo()
    os.kill(os.getpid(), signal.SIGTERM)
    assert calls == ["elche", "later", "later"]


def test_time_inside_a_sync_point_is_excluded_from_the_window():
    from lightning_elche import ElCheStrategy

    excluded: list[float] = []
    consensus = SimpleNamespace(consensus=True, ends_window_sequence=False,
                                reports=(SimpleNamespace(out_of_data=False),))
    from lightning_elche.round_driver import RoundDriver

    strategy = ElCheStrategy()
    engine = SimpleNamespace(last_outcome=consensus, steps_in_window=0, in_flight=False,
                             exclude_from_window=excluded.append)
    strategy._rounds = RoundDriver(engine, strategy.session, lambda: None, [], 1, lambda: 0)  # type: ignore[arg-type]
    with strategy.sync_point():
        assert strategy.session.at_sync_point_now
        time.sleep(0.05)
    assert len(excluded) == 1 and excluded[0] >= 0.05
    assert not strategy.session.at_sync_point_now
