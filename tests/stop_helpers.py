"""Launching the ranks of ``tests/scripts/stuck_fit.py``, signalling them, and timing their exits.

Each rank runs as a process of its own (as torchrun or a scheduler would start it), so that a test
sees every rank's exit status and the time from a signal to each exit. Every process a launch
started, however deep, is killed when the ``with`` block ends; output goes to ``rank<r>.log``.
"""

from __future__ import annotations

import json
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from multirank_helpers import LAUNCH_TAG, clean_environment, free_port, kill_tagged

SCRIPT = Path(__file__).parent / "scripts" / "stuck_fit.py"


@dataclass
class Launched:
    out: Path
    procs: list[subprocess.Popen]
    logs: list[Path]
    ended_at: dict[int, float] = field(default_factory=dict)
    """``time.monotonic()`` at which each process (by index) was seen to have exited."""

    def log(self) -> str:
        return "\n".join(f"--- {log.name}\n{log.read_text()[-6000:]}" for log in self.logs if log.exists())

    def wait_file(self, name: str, timeout_s: float) -> dict[str, Any]:
        """The JSON a rank writes (``stuck-rank1.json``), once it exists; fails with the logs otherwise."""
        path = self.out / name
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if path.exists() and path.stat().st_size:
                return json.loads(path.read_text())
            self._note_exits()
            if len(self.ended_at) == len(self.procs):
                break
            time.sleep(0.05)
        raise AssertionError(f"{name} was not written within {timeout_s} s:\n{self.log()}")

    def signal(self, signum: int, ranks: Optional[list[int]] = None) -> float:
        """Send ``signum`` to the processes of ``ranks`` (default: all); returns ``time.monotonic()``."""
        sent = time.monotonic()
        for k in ranks if ranks is not None else range(len(self.procs)):
            if self.procs[k].poll() is None:
                self.procs[k].send_signal(signum)
        return sent

    def wait_exits(self, timeout_s: float, ranks: Optional[list[int]] = None) -> list[Optional[int]]:
        """Wait until the processes of ``ranks`` (default: all) exited; their exit codes (None: alive)."""
        indices = list(ranks if ranks is not None else range(len(self.procs)))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(k not in self.ended_at for k in indices):
            self._note_exits()
            time.sleep(0.01)
        return [self.procs[k].poll() for k in indices]

    def _note_exits(self) -> None:
        for k, proc in enumerate(self.procs):
            if k not in self.ended_at and proc.poll() is not None:
                self.ended_at[k] = time.monotonic()

    def result(self, rank: int) -> dict[str, Any]:
        path = self.out / f"result-rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no result:\n{self.log()}"
        return json.loads(path.read_text())


@contextmanager
def launched(out: Path, case: str, mode: str = "cpu_async", grace_s: Optional[float] = None,
             ranks: int = 2, popen: bool = False, extra: tuple[str, ...] = ()) -> Iterator[Launched]:
    """Start the ranks of ``stuck_fit.py --case case`` (only rank 0 with ``popen``: Lightning's
    launcher starts the other); kill whatever is left when the block ends."""
    out.mkdir(parents=True, exist_ok=True)
    tag = secrets.token_hex(8)
    env = {**clean_environment(), LAUNCH_TAG: tag}
    port = str(free_port())
    common = [str(out), "--port", port, "--mode", mode, "--case", case, *extra]
    if grace_s is not None:
        common += ["--grace", str(grace_s)]
    procs, logs = [], []
    for rank in range(1 if popen else ranks):
        command = [sys.executable, str(SCRIPT), *common, "--rank", str(rank)]
        if popen:
            command += ["--launcher", "popen"]
        log = out / f"rank{rank}.log"
        with open(log, "w") as sink:
            procs.append(subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        logs.append(log)
    job = Launched(out, procs, logs)
    try:
        yield job
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
        survivors = kill_tagged(tag)
        assert not survivors, f"processes left behind by the launch: {survivors}"


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def wait_pid_gone(pid: int, timeout_s: float) -> Optional[float]:
    """``time.monotonic()`` when ``pid`` was seen gone, or None if it is still alive after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return time.monotonic()
        time.sleep(0.01)
    return None


def exit_status(signum: int) -> int:
    return 128 + signum


