"""How fast the job store host leaves after the last rank ends (the number in the docs).

    python tests/scripts/job_store_exit_latency.py [--trials 12]

Each trial starts a host, registers two stand-in ranks (this process, marked exited at once, and
a ``sleep`` process), then ends the second one, alternately by ``kill -9`` and by marking it
exited, and times the host's exit from that moment.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import time
from datetime import timedelta

from lightning_elche import job_store


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def trial(by_kill: bool) -> float:
    port = free_port()
    host = job_store.start_host("127.0.0.1", port, 2, timedelta(seconds=30))
    client = job_store.connect("127.0.0.1", port, timedelta(seconds=10))
    rank = subprocess.Popen(["sleep", "60"])
    client.set(job_store.proc_key(0), f"{socket.gethostname()}:{os.getpid()}")
    client.set(job_store.proc_key(1), f"{socket.gethostname()}:{rank.pid}")
    job_store.mark_exited(client, 0, "done")
    time.sleep(0.6)  # the host has seen both ranks
    if by_kill:
        rank.kill()
        ended = time.monotonic()
        rank.wait()
    else:
        ended = time.monotonic()
        job_store.mark_exited(client, 1, "done")
    host.wait(timeout=30)
    delay = time.monotonic() - ended
    rank.kill()
    rank.wait()
    return delay


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=12)
    trials = parser.parse_args().trials
    for label, by_kill in (("kill -9 of the last rank", True), ("last rank marked exited", False)):
        delays = [trial(by_kill) for _ in range((trials + 1) // 2)]
        print(f"host exit after {label}: median {statistics.median(delays):.3f} s, max {max(delays):.3f} s "
              f"(n={len(delays)}, poll interval {job_store.POLL_INTERVAL_S} s)")


if __name__ == "__main__":
    main()
