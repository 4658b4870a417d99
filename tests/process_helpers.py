"""Running ranks in processes: ports, launched commands, per-rank records, and a rank worker that
inspects what a failed fit left behind."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import torch
from callback_helpers import FlipBf16Wire, RaiseAtStep
from lightning.pytorch import Callback, Trainer
from model_helpers import RecordingModel


def free_port() -> int:
    """A free TCP port on the loopback interface, for a test's own process group."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def load_records(out_dir: Path, world_size: int = 2) -> list[dict[str, Any]]:
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]


def fit_and_report_leftovers(rank: int, out_dir: str, port: int, scenario: str) -> None:
    """A rank of a 2-process cpu_async fit started by ``torch.multiprocessing.spawn`` (not by Lightning),
    so that code runs after ``fit`` returns or fails: it records what the CPU plane left behind."""
    import threading
    from datetime import timedelta

    from lightning_elche import ElCheStrategy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0",
                      LOCAL_RANK=str(rank), RANK=str(rank))
    callbacks: list[Callback] = []
    if scenario == "exception":
        callbacks.append(RaiseAtStep(1, 12, RuntimeError("rank 1 crashed")))
    elif scenario == "interrupt":
        callbacks.append(RaiseAtStep(1, 12, KeyboardInterrupt()))
    elif scenario == "bf16_mismatch":
        callbacks.append(FlipBf16Wire(1))
    trainer = Trainer(
        accelerator="cpu", devices=2, max_epochs=2, limit_val_batches=0, callbacks=callbacks,
        strategy=ElCheStrategy(mode="cpu_async", timeout=timedelta(seconds=20),
                               snapshot_timeout=timedelta(seconds=4)),
        enable_progress_bar=False, enable_model_summary=False, logger=False, enable_checkpointing=False,
    )
    error, message, where = None, "", ""
    try:
        trainer.fit(RecordingModel(out_dir, val=False))
    except BaseException as exc:  # noqa: BLE001 (the point is to look at what is left afterwards)
        import traceback

        error, message, where = type(exc).__name__, str(exc), traceback.format_exc()[-3000:]
    strategy = trainer.strategy
    plane = strategy.engine.plane if strategy.engine is not None else None
    Path(out_dir, f"leftovers{rank}.json").write_text(json.dumps({
        "error": error,
        "message": message,
        "traceback": where,
        "rounds": strategy.engine.state.rounds if strategy.engine is not None else -1,
        "threads": [t.name for t in threading.enumerate() if t.name.startswith("elche-cpu-plane")],
        "side_group_released": getattr(plane, "group", None) is None,
        "plane_closed": bool(plane is not None and plane.closed),
    }))
    # Leave as a well-behaved script does: a process that exits with its default group alive can
    # abort in c10d's destructors at interpreter exit ("terminate called without an active
    # exception"), which mp.spawn reports as a crash after the report above was written.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def run_command(command: list[str], cwd: Path, timeout_s: float) -> tuple[int, str]:
    """Run ``command`` in its own process session; on a hang, kill the whole session and fail.

    Killing the session matters: a launcher's rank processes would otherwise outlive the test
    and wait out their process-group timeout.
    """
    import os
    import signal
    import subprocess

    import pytest

    proc = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{command} did not finish in {timeout_s} s:\n{output[-4000:]}")
    return proc.returncode, output
