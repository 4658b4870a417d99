"""Preemption and restarts: a stop signal saves the consensus, SLURM requeues, torchrun restarts.

Real 2-rank CPU jobs (gloo) under Lightning's popen launcher, an emulated SLURM step and torchrun.
Each check rebuilds what the final model was trained on: the first run's steps that the resumed
checkpoint's coverage counts as trained, plus the resumed run's steps; every sample of every epoch
must be in it exactly once. No process may outlive a launch.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest
import torch
from multirank_helpers import clean_environment, free_port
from preemption_helpers import exactly_once_errors, launch, step_records, trained_in_checkpoint

from lightning_elche.stop_checkpoint import STOP_CHECKPOINT_NAME, written_whole

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]
SCRIPT = Path(__file__).parent / "scripts" / "preempt_fit.py"
EPOCHS = 3


def script(out: Path, mode: str, tag: str, *extra: str) -> list[str]:
    return [sys.executable, str(SCRIPT), str(out), "--mode", mode, "--tag", tag, "--epochs", str(EPOCHS), *extra]


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def same_parameters(out: Path, tag: str) -> bool:
    params = [json.loads((out / f"params-{tag}-rank{r}.json").read_text()) for r in range(2)]
    return params[0] == params[1]


@pytest.mark.parametrize(("mode", "rank", "rounds"), [
    ("nccl_cadence", 0, 2),  # the fast rank
    ("cpu_async", 1, 1),  # the round carrying the signal is in flight: the save waits one more
    ("nccl_sync", 1, 20),  # a sync per step: in the second epoch
])
def test_sigterm_saves_the_consensus_and_a_resumed_fit_trains_the_rest_once(tmp_path, mode, rank, rounds):
    env = clean_environment()
    signal_at = ("--fault", "TERM", "--fault-rank", str(rank), "--fault-round", str(rounds))
    codes, logs = launch([(script(tmp_path, mode, "first", *signal_at), env)], tmp_path / "logs-first", 150)
    saved = tmp_path / "ckpt" / STOP_CHECKPOINT_NAME
    assert saved.exists(), logs
    checkpoint = load(saved)
    stopped_in = checkpoint["elche"]["coverage"]["epoch"]
    signalled = json.loads((tmp_path / "signal-time.json").read_text())["time"]
    latency = saved.stat().st_mtime - signalled
    print(f"{mode}: signal to checkpoint on disk {latency:.2f} s")
    assert 0 < latency < 30
    first = step_records(tmp_path, "first")
    assert len(first.get(stopped_in, [])) < 512 and stopped_in + 1 not in first, "the fit stopped inside that epoch"
    assert codes == [128 + signal.SIGTERM]

    codes, logs = launch([(script(tmp_path, mode, "resumed", "--ckpt", "last"), env)], tmp_path / "logs-resumed", 150)
    assert codes == [0], logs
    parts = [trained_in_checkpoint(checkpoint, first), step_records(tmp_path, "resumed")]
    assert not exactly_once_errors(parts, range(EPOCHS))
    assert same_parameters(tmp_path, "resumed")


def test_slurm_requeue_signal_saves_the_hpc_checkpoint_requeues_and_the_requeued_job_resumes(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'scontrol.log'}\n")
    scontrol.chmod(0o755)

    def tasks(*extra: str) -> list[tuple[list[str], dict[str, str]]]:
        port = str(free_port())
        commands = []
        for rank in range(2):
            env = clean_environment()
            env.update(SLURM_JOB_ID="4242", SLURM_JOB_NAME="elche-requeue", SLURM_NTASKS="2",
                       SLURM_NTASKS_PER_NODE="2", SLURM_NNODES="1", SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank),
                       SLURM_NODEID="0", SLURM_NODELIST="localhost", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                       PATH=f"{bin_dir}:{env['PATH']}")
            commands.append((script(tmp_path, "cpu_cadence", *extra), env))
        return commands

    codes, logs = launch(tasks("first", "--fault", "USR1", "--fault-rank", "0", "--fault-round", "1"),
                         tmp_path / "logs-first", 150)
    assert codes != [0, 0], logs
    hpc = tmp_path / "hpc_ckpt_1.ckpt"
    assert hpc.exists(), logs
    assert (tmp_path / "scontrol.log").read_text().split("\n")[:-1] == ["requeue 4242"], "rank 0 requeues, once"
    checkpoint = load(hpc)
    assert checkpoint["elche"]["coverage"]["epoch"] in range(EPOCHS)
    first = step_records(tmp_path, "first")

    # The requeued job: same step, no ckpt_path: Lightning finds the HPC checkpoint itself.
    codes, logs = launch(tasks("resumed"), tmp_path / "logs-resumed", 150)
    assert codes == [0, 0], logs
    parts = [trained_in_checkpoint(checkpoint, first), step_records(tmp_path, "resumed")]
    assert not exactly_once_errors(parts, range(EPOCHS))
    assert same_parameters(tmp_path, "resumed")


def test_torchrun_restarts_after_a_killed_worker_and_loses_at_most_the_work_since_the_last_sync_checkpoint(tmp_path):
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
        *script(tmp_path, "nccl_cadence", "run", "--every-n-syncs", "1", "--fault", "KILL", "--fault-rank", "1",
                "--fault-round", "3", "--ckpt", "last")[1:],
    ]
    codes, logs = launch([(command, clean_environment())], tmp_path / "logs", 240)
    assert codes == [0], logs
    assert (tmp_path / "signal-time.json").exists(), "rank 1 was never killed: the fit ended first"
    resumed_from = tmp_path / "resumed-from-attempt1.ckpt"
    assert resumed_from.exists(), logs
    checkpoint = load(resumed_from)
    first, second = step_records(tmp_path, "run0"), step_records(tmp_path, "run1")
    # Rank 0 survives the kill until the agent restarts the group, and trains again what rank 1 had
    # trained past its last sync: both records hold those samples, the consensus once.
    kept = {epoch: sorted(set(indices)) for epoch, indices in trained_in_checkpoint(checkpoint, first).items()}
    assert not exactly_once_errors([kept, second], range(EPOCHS))
    lost = sum(len(set(v)) for v in first.values()) - sum(len(v) for v in kept.values())
    print(f"torchrun restart: {lost} samples trained after the last sync checkpoint were redone")
    assert 0 <= lost <= 512
    assert same_parameters(tmp_path, "run1")


def test_a_checkpoint_is_replaced_whole_or_not_at_all(tmp_path):
    target = tmp_path / "last-preempted.ckpt"
    target.write_bytes(b"the previous checkpoint")
    with pytest.raises(KeyboardInterrupt), written_whole(target) as partial:
        Path(partial).write_bytes(b"half of a new")
        raise KeyboardInterrupt  # a second Ctrl-C, or any crash, in the middle of the write
    assert target.read_bytes() == b"the previous checkpoint"
    assert list(tmp_path.iterdir()) == [target], "no partial file is left behind"
    with written_whole(target) as partial:
        Path(partial).write_bytes(b"a new checkpoint")
    assert target.read_bytes() == b"a new checkpoint"


def test_a_second_sigterm_while_stopping_changes_nothing(tmp_path):
    # The handler only records a request: a second SIGTERM (launchers repeat them) cannot interrupt
    # the save; the save itself is written whole (above).
    env = clean_environment()
    extra = ("--fault", "TERM", "--fault-round", "3")
    codes, logs = launch([(script(tmp_path, "nccl_cadence", "first", *extra) + ["--repeat-signal"], env)],
                         tmp_path / "logs", 150)
    assert codes == [128 + signal.SIGTERM], logs
    checkpoint = load(tmp_path / "ckpt" / STOP_CHECKPOINT_NAME)
    assert "coverage" in checkpoint["elche"] and "state_dict" in checkpoint

