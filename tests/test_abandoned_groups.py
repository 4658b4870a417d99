"""A collective that a loss left waiting must not hold its process at exit (real gloo processes).

Gloo's destructor joins its transport thread, which ends a receive from a silent peer only at the
group's timeout; ``Membership.abandon`` keeps such groups and works past the interpreter's
finalization so the process exits at once."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

GROUP_TIMEOUT_S = 45
"""Far above the exit bound below: a process that waits for it fails the test."""

SCRIPT = textwrap.dedent(f"""
    import os, sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    from lightning_elche.membership.agreement import Membership

    rank, port, keep = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "keep"
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=timedelta(seconds={GROUP_TIMEOUT_S}))
    if rank == 1:  # the lost peer: alive, silent
        time.sleep(3 * {GROUP_TIMEOUT_S})
        os._exit(0)
    work = dist.all_reduce(torch.ones(4), async_op=True)
    time.sleep(0.5)
    group = dist.group.WORLD
    if keep:
        membership = Membership(store, "fit", 0, [0, 1], timedelta(seconds=5), join_timeout=timedelta(seconds=5))
        membership.abandon(work, group)
        membership.heartbeat.close()
    dist.destroy_process_group()
    print("left", flush=True)
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def exit_after_abandoning(tmp_path: object, mode: str) -> float:
    """Seconds from rank 0's "left" to its exit."""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    port = free_port()
    peer = subprocess.Popen([sys.executable, "-c", SCRIPT, "1", str(port), mode], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        rank0 = subprocess.Popen([sys.executable, "-c", SCRIPT, "0", str(port), mode], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert rank0.stdout is not None
        line = rank0.stdout.readline()
        assert line.strip() == "left", rank0.stderr.read() if rank0.stderr else line
        left = time.monotonic()
        try:
            code = rank0.wait(timeout=GROUP_TIMEOUT_S / 3)
        except subprocess.TimeoutExpired:
            rank0.kill()
            rank0.wait()
            return float("inf")
        assert code == 0, rank0.stderr.read() if rank0.stderr else code
        return time.monotonic() - left
    finally:
        peer.kill()
        peer.wait()


@pytest.mark.timeout(120)
def test_an_abandoned_gloo_collective_does_not_hold_the_exit(tmp_path: object) -> None:
    assert exit_after_abandoning(tmp_path, "keep") < 10.0
