"""A stop signal always ends the process: within a grace when no sync can honour it, at once on a
second signal, on every rank, in every phase of a fit.

The grace computation and the watchdog run here in this process (real signals to itself); the
phases run as real 2-rank CPU jobs (gloo, one process per rank) in which one rank is stuck in an
endless loop, and the test sends SIGTERM like a scheduler and times each rank's exit. CI runs one
mode per phase; every mode x every phase is marked ``faults``.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import pytest
from stop_helpers import launched, wait_pid_gone

from lightning_elche import ElCheStrategy
from lightning_elche.stop_signals import (
    REPEAT_WINDOW_S,
    STOP_GRACE_FLOOR,
    StopWatchdog,
    grace_for,
    resolve_stop_grace,
    stop_grace_s,
)

MODES = ("nccl_sync", "nccl_cadence", "cpu_sync", "cpu_cadence", "cpu_async")
GRACE_S = 2.0
EXIT_SLACK_S = 5.0
"""How long after the grace a process may take to end: the registry mark and the log flush are
bounded to 2 s each; on an idle machine it ends about 0.2 s after the grace."""
FLOOR_S = STOP_GRACE_FLOOR.total_seconds()


# -- the grace ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("window_s", "sync_s", "expected"), [
    (None, None, FLOOR_S),  # before the first round: the floor alone
    (1.0, 0.1, FLOOR_S),  # short windows: the floor
    (20.0, 1.0, 3 * 20.0 + 2 * 1.0),  # long windows: 3 windows and 2 syncs
    (12.0, None, 36.0),
    (0.0, -1.0, FLOOR_S),  # nonsense readings count for nothing
])
def test_the_derived_grace_is_three_windows_and_two_syncs_with_a_floor(window_s, sync_s, expected):
    assert stop_grace_s(window_s, sync_s) == pytest.approx(expected)


def test_a_lower_floor_applies():
    assert stop_grace_s(None, None, floor_s=5.0) == 5.0
    assert stop_grace_s(1.0, 0.5, floor_s=2.0) == pytest.approx(4.0)


def test_the_grace_follows_the_controllers_planned_window_and_the_last_round():
    controller = SimpleNamespace(world_size=2, batch_counts=[10, 40], smoothed_ms=lambda rank: [500.0, 250.0][rank])
    outcome = SimpleNamespace(reports=[SimpleNamespace(last_sync_s=0.5), SimpleNamespace(last_sync_s=2.0)])
    engine = SimpleNamespace(controller=controller, last_outcome=outcome)
    # Rank 1 plans 40 batches at 250 ms: a 10 s window; 3 windows and 2 rounds of 2 s.
    assert grace_for(None, engine) == pytest.approx(34.0)
    assert grace_for(timedelta(seconds=3), engine) == 3.0  # the knob as given, floor included
    assert grace_for(None, None) == FLOOR_S


@pytest.mark.parametrize("value", [timedelta(0), timedelta(seconds=-1), 30, "30s"])
def test_a_bad_stop_grace_is_refused_naming_the_knob(value):
    with pytest.raises(ValueError, match=r"ElCheStrategy\(stop_grace=.*\) is invalid: expected None \(derived"):
        resolve_stop_grace(value)
    with pytest.raises(ValueError, match=r"ElCheStrategy\(stop_grace="):
        ElCheStrategy(stop_grace=value)


def test_stop_grace_is_kept_on_the_strategy():
    assert ElCheStrategy().stop_grace is None
    assert ElCheStrategy(stop_grace=timedelta(seconds=7)).stop_grace == timedelta(seconds=7)


# -- the watchdog, in this process ------------------------------------------------------------------


class Recorder:
    """What the watchdog did: the exit status (instead of ending the test process), the signals
    it passed on, and the message it left."""

    def __init__(self) -> None:
        self.ended = threading.Event()
        self.status: Optional[int] = None
        self.ended_at = 0.0
        self.forwarded: list[int] = []
        self.messages: list[str] = []

    def end_process(self, status: int) -> None:
        self.status, self.ended_at = status, time.monotonic()
        self.ended.set()


@pytest.fixture
def watchdog_for():
    """A factory of listening watchdogs on SIGUSR1 (given a no-op Python handler, as ElChe's
    routes give the stop signals), stopped and with the handler restored afterwards."""
    before = signal.getsignal(signal.SIGUSR1)
    signal.signal(signal.SIGUSR1, lambda signum, frame: None)
    made: list[StopWatchdog] = []

    def make(grace_s: float) -> tuple[StopWatchdog, Recorder]:
        record = Recorder()
        watchdog = StopWatchdog(lambda: grace_s, lambda: "rank 0 was in a test", forward=record.forwarded.append,
                                on_exit=record.messages.append, end_process=record.end_process)
        assert watchdog.listen({signal.SIGUSR1})
        made.append(watchdog)
        return watchdog, record

    yield make
    for watchdog in made:
        watchdog.stop_listening()
    signal.signal(signal.SIGUSR1, before)


def test_a_stop_signal_that_is_not_honoured_ends_the_process_after_the_grace(watchdog_for):
    watchdog, record = watchdog_for(0.4)
    sent = time.monotonic()
    os.kill(os.getpid(), signal.SIGUSR1)
    assert record.ended.wait(5.0)
    assert record.status == 128 + signal.SIGUSR1
    assert 0.35 <= record.ended_at - sent < 3.0
    assert record.forwarded == [signal.SIGUSR1]  # passed on once, to the ranks a launcher started
    assert "grace of 0.4 s" in record.messages[0] and "rank 0 was in a test" in record.messages[0]


def test_a_repeat_within_the_repeat_window_is_the_same_stop_and_a_later_one_ends_at_once(watchdog_for):
    watchdog, record = watchdog_for(30.0)
    os.kill(os.getpid(), signal.SIGUSR1)
    os.kill(os.getpid(), signal.SIGUSR1)  # the same signal through a second path (group + launcher)
    time.sleep(REPEAT_WINDOW_S + 0.2)
    assert not record.ended.is_set()
    second = time.monotonic()
    os.kill(os.getpid(), signal.SIGUSR1)
    assert record.ended.wait(5.0)
    assert record.ended_at - second < 1.0
    assert record.status == 128 + signal.SIGUSR1
    assert record.forwarded == [signal.SIGUSR1, signal.SIGUSR1]
    assert "a second stop signal" in record.messages[0]


def test_a_second_signal_during_the_stops_own_save_ends_the_process_once_the_file_is_written(watchdog_for):
    watchdog, record = watchdog_for(3.0)
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.3)
    armed = watchdog.deadline
    assert armed is not None
    with watchdog.saving():
        assert watchdog.deadline is not None and watchdog.deadline > armed + 0.25  # the grace starts again
        time.sleep(REPEAT_WINDOW_S + 0.1)
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.3)
        assert not record.ended.is_set(), "the save was cut short"
    assert record.ended.is_set() and record.status == 128 + signal.SIGUSR1
    assert "checkpoint was written" in record.messages[0]


def test_other_signals_and_the_end_of_listening_leave_the_process_alone(watchdog_for):
    watchdog, record = watchdog_for(0.2)
    previous = signal.getsignal(signal.SIGUSR2)
    signal.signal(signal.SIGUSR2, lambda signum, frame: None)
    try:
        os.kill(os.getpid(), signal.SIGUSR2)  # not a stop signal
        time.sleep(0.5)
        assert not record.ended.is_set() and watchdog.signum is None
    finally:
        signal.signal(signal.SIGUSR2, previous)
    watchdog.stop_listening()
    assert not watchdog.listening
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.5)
    assert not record.ended.is_set()


def test_the_wakeup_fd_in_place_before_is_given_back_and_still_hears_the_signals(watchdog_for):
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    original = signal.set_wakeup_fd(write_fd)
    try:
        watchdog, record = watchdog_for(30.0)
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.3)
        assert watchdog.signum == signal.SIGUSR1
        assert os.read(read_fd, 16) == bytes([signal.SIGUSR1])  # passed on to the previous owner
        watchdog.stop_listening()
        assert signal.set_wakeup_fd(write_fd) == write_fd
    finally:
        signal.set_wakeup_fd(original)
        os.close(read_fd)
        os.close(write_fd)


def test_a_rank_the_watchdog_ends_is_marked_exited_in_the_jobs_registry():
    from datetime import timedelta as td

    import torch.distributed as dist

    from lightning_elche import job_store
    from lightning_elche.stop_guard import mark_stopped

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=td(seconds=10))
    before = job_store.current_link()
    link = job_store.join(dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=td(seconds=10)), 3)
    try:
        mark_stopped(job_store.current_link(), "ending the process with status 143")  # the watchdog's on_exit
        assert server.get(job_store.exited_key(3)) == b"ending the process with status 143"
    finally:
        atexit.unregister(link.mark_exited)  # this process's exit is not the test rank's
        job_store._current = before


# -- the routes, from Lightning's handlers to Lightning's restore ------------------------------------


@pytest.fixture
def restore_sigterm():
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


def test_stop_signals_are_routed_from_lightnings_registration_to_its_restore(restore_sigterm):
    from lightning.pytorch import Trainer

    from lightning_elche.loop_glue import LightningPatches
    from lightning_elche.rounds import StopRequest

    original = signal.getsignal(signal.SIGTERM)
    trainer = Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    connector = trainer._signal_connector
    calls: list[Any] = []
    patches = LightningPatches()
    patches.route_stop_signals_for_the_fit(trainer, lambda request, signum: calls.append(request),
                                           on_restored=lambda: calls.append("restored"),
                                           on_unroutable=lambda: calls.append("unroutable"))
    connector.register_signal_handlers()  # Trainer._run, after the strategy's setup
    os.kill(os.getpid(), signal.SIGTERM)
    assert calls == [StopRequest.SIGTERM]
    assert trainer.received_sigterm is False  # Lightning's broadcasting notifier is not in the chain
    patches.undo()  # the strategy's teardown leaves the routes in place ...
    os.kill(os.getpid(), signal.SIGTERM)
    assert calls == [StopRequest.SIGTERM] * 2
    connector.teardown()  # ... until Lightning puts back the handlers from before the fit
    assert calls[-1] == "restored"
    assert signal.getsignal(signal.SIGTERM) == original
    assert "register_signal_handlers" not in vars(connector) and "teardown" not in vars(connector)


def test_a_gather_of_a_collection_runs_inside_the_check_with_lightnings_conversion():
    from contextlib import contextmanager

    import torch
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_elche.loop_glue import LightningPatches

    seen: list[Any] = []

    @contextmanager
    def check(data: Any) -> Any:
        seen.append(data)
        yield

    module = BoringModel()
    patches = LightningPatches()
    patches.check_gathered_collections(module, check)
    module.trainer = SimpleNamespace(strategy=SimpleNamespace(all_gather=lambda t, group=None, sync_grads=False: t))
    out = module.all_gather([1, 2.0])
    assert len(seen) == 1 and all(isinstance(x, torch.Tensor) for x in seen[0])  # numbers became tensors
    assert [x.item() for x in out] == [1, 2.0]
    patches.undo()
    assert "all_gather" not in vars(module)


# -- real fits ------------------------------------------------------------------------------------



def assert_ended_within_the_grace(job: Any, sent: float, ranks: list[int], status: int = 128 + signal.SIGTERM,
                                  grace_s: float = GRACE_S) -> list[float]:
    codes = job.wait_exits(grace_s + EXIT_SLACK_S + 10, ranks)
    times = [round(job.ended_at[k] - sent, 2) for k in ranks if k in job.ended_at]
    print(f"{job.out.name}: exit statuses {codes}, seconds from the signal to each exit {times}")
    assert codes == [status] * len(ranks), job.log()
    for elapsed in times:
        assert grace_s - 0.05 <= elapsed <= grace_s + EXIT_SLACK_S, (times, job.log())
    return times


def run_stuck(tmp_path: Path, case: str, mode: str, stuck_rank: int = 1, signal_ranks: Optional[list[int]] = None,
              epochs: int = 1) -> None:
    """Rank ``stuck_rank`` gets stuck in ``case``; SIGTERM to ``signal_ranks`` (default every rank,
    as a scheduler does); each of them ends with 143 once the grace is over, having saved nothing."""
    extra = ("--stuck-rank", str(stuck_rank), "--epochs", str(epochs))
    with launched(tmp_path / f"{case}-{mode}", case, mode=mode, grace_s=GRACE_S, extra=extra) as job:
        job.wait_file(f"stuck-rank{stuck_rank}.json", 150)
        time.sleep(0.3)  # its peer reaches whatever it waits in
        ranks = signal_ranks if signal_ranks is not None else [0, 1]
        sent = job.signal(signal.SIGTERM, ranks)
        assert_ended_within_the_grace(job, sent, ranks)
        log = job.log()
        assert "could not be honoured at a sync within its grace of 2.0 s" in log
        assert "Nothing was saved" in log


# One mode per phase in CI; the whole matrix is below (-m faults).
PHASES = [
    ("training", "cpu_async"),  # an endless loop in training_step; the peer waits in a round
    ("validation", "nccl_cadence"),  # in validation_step; the peer waits in the epoch-end reduce
    ("sanity", "cpu_cadence"),  # in the sanity check, before Lightning's on_train_start
    ("on_train_end", "nccl_sync"),  # a user hook; the peer waits in ElChe's end-of-training average
    ("checkpoint", "cpu_sync"),  # in on_save_checkpoint; the peer waits in the save's barrier
    ("raw_barrier", "nccl_cadence"),  # blocked inside gloo: the Python handler never runs, the wakeup fd does
]


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("case", "mode"), PHASES)
def test_a_stuck_rank_and_its_peer_end_with_143_once_the_grace_is_over(tmp_path, case, mode):
    run_stuck(tmp_path, case, mode)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_rank_stuck_in_the_strategys_teardown_ends_with_143_once_the_grace_is_over(tmp_path):
    run_stuck(tmp_path, "strategy_teardown", "cpu_async", signal_ranks=[1])


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_after_lightning_put_back_the_handlers_a_sigterm_ends_a_stuck_teardown_hook_at_once(tmp_path):
    # Callback.teardown runs after Lightning restored the handlers from before the fit (here the
    # default action): the signal ends the process at once, as it would without Lightning.
    with launched(tmp_path, "teardown_hook", grace_s=GRACE_S) as job:
        job.wait_file("stuck-rank1.json", 150)
        sent = job.signal(signal.SIGTERM, [1])
        codes = job.wait_exits(10, [1])
        print(f"teardown hook: status {codes}, {job.ended_at[1] - sent:.2f} s from the signal to the exit")
        assert codes == [-signal.SIGTERM], job.log()
        assert job.ended_at[1] - sent < 2.0


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_second_sigterm_ends_a_stuck_fit_at_once(tmp_path):
    with launched(tmp_path, "training", mode="nccl_cadence", grace_s=60.0) as job:
        job.wait_file("stuck-rank1.json", 150)
        job.signal(signal.SIGTERM)
        time.sleep(REPEAT_WINDOW_S + 0.5)
        assert job.wait_exits(0.1) == [None, None], "ended before the grace: " + job.log()
        second = job.signal(signal.SIGTERM)
        codes = job.wait_exits(15)
        times = [round(job.ended_at[k] - second, 2) for k in range(2)]
        print(f"second SIGTERM: statuses {codes}, seconds from the second signal to each exit {times}")
        assert codes == [128 + signal.SIGTERM] * 2, job.log()
        assert max(times) < 4.0
        assert "a second stop signal (SIGTERM) arrived" in job.log()


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_sigterm_to_rank_zero_alone_also_ends_the_rank_lightnings_launcher_started(tmp_path):
    # Lightning's popen launcher: the test knows rank 0's process only. Rank 1 is stuck; rank 0's
    # watchdog passes the signal on to it (its Python handler may never run).
    with launched(tmp_path, "training", mode="cpu_async", grace_s=GRACE_S, popen=True) as job:
        stuck = job.wait_file("stuck-rank1.json", 150)
        sent = job.signal(signal.SIGTERM, [0])
        assert_ended_within_the_grace(job, sent, [0])
        gone = wait_pid_gone(int(stuck["pid"]), GRACE_S + EXIT_SLACK_S)
        assert gone is not None, "rank 1 outlived rank 0"
        print(f"popen launcher: rank 1 ended {gone - sent:.2f} s after the signal to rank 0")
        assert gone - sent >= GRACE_S - 0.05


@pytest.mark.faults
@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", ["training", "validation", "sanity", "on_train_end", "checkpoint", "raw_barrier",
                                  "strategy_teardown"])
def test_every_mode_and_every_phase_ends_within_the_grace(tmp_path, case, mode):
    for stuck_rank in (0, 1):
        signal_ranks = [stuck_rank] if case == "strategy_teardown" else None
        run_stuck(tmp_path / f"stuck{stuck_rank}", case, mode, stuck_rank=stuck_rank, signal_ranks=signal_ranks)
