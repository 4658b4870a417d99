"""The job's key-value store, hosted by a process of its own, and the registry of the job's ranks.

With Lightning's ``env://`` set-up the job's ``TCPStore`` lives inside global rank 0: when rank 0
dies, every survivor loses the store it needs to claim data and to form a new group. Here global
rank 0 starts a small store host instead (``python -m lightning_elche.job_store``, in a session of
its own so that signals sent to rank 0's process group do not reach it), and every rank, rank 0
included, connects to it as a client.

With ``ELCHE_STORE=external`` in every rank's environment no rank starts a host: the ranks connect
to one already serving on MASTER_ADDR:MASTER_PORT, started on a stable host outside every training
node (a login node, a SLURM batch step, a Kubernetes service) with
``python -m lightning_elche.job_store --host H --port P --world-size N``. The loss of any one
training node, global rank 0's included, then leaves the store to the survivors.

The host leaves by itself once the job is over. Every rank registers
``lightning_elche/ranks/<rank>/proc`` (``"<hostname>:<pid>"``) and marks
``lightning_elche/ranks/<rank>/exited`` (a reason) when it ends; a heartbeat thread may bump
``lightning_elche/ranks/<rank>/heartbeat``. The host exits when every registered rank has exited,
is gone (a dead or zombie process on the host's own machine) or went silent (a heartbeat that
stopped changing), when nobody registered within the connect timeout, or at ``--max-lifetime``.

This module uses only the standard library and ``torch.distributed``: the host runs it as a plain
file, without importing the package (and Lightning) behind it.
"""

from __future__ import annotations

import argparse
import atexit
import os
import select
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import IO, Optional

import torch.distributed as dist

RANKS_PREFIX = "lightning_elche/ranks"
POLL_INTERVAL_S = 0.25
"""How often the host looks at the registry: the delay between the last rank's end and its exit."""
DEFAULT_SILENT_AFTER_S = 120.0
"""A heartbeat that has not changed for this long marks its rank as gone (generous on purpose: the
host only decides when to leave; the strategy's own liveness timeout detects hung ranks)."""
# Neither this line nor the registry prefix may depend on the package name: the host runs this
# file as it is, while a rank may run a copy of it rewritten for another namespace
# (lightning_elche.pytorch_lightning), so the starting rank passes its prefix to the host.
READY_LINE = "job store ready"
STORE_ENV = "ELCHE_STORE"
"""Where the job's store runs: unset (or ``rank0``) global rank 0 starts its host; ``external``: it
already serves on MASTER_ADDR:MASTER_PORT, outside the training nodes."""
STORE_PLACES = ("rank0", "external")


def generation_prefix(generation: int) -> str:
    """The key prefix of the process group of ``generation`` (0: the group the fit starts with)."""
    return f"lightning_elche/gen{generation}"


def proc_key(rank: int, prefix: str = RANKS_PREFIX) -> str:
    return f"{prefix}/{rank}/proc"


def exited_key(rank: int, prefix: str = RANKS_PREFIX) -> str:
    return f"{prefix}/{rank}/exited"


def heartbeat_key(rank: int, prefix: str = RANKS_PREFIX) -> str:
    return f"{prefix}/{rank}/heartbeat"


# -- processes ----------------------------------------------------------------------------------


def this_process() -> str:
    """``"<hostname>:<pid>"`` of the calling process, as ranks register themselves."""
    return f"{socket.gethostname()}:{os.getpid()}"


def parse_process(value: str) -> tuple[str, int]:
    """``(hostname, pid)`` from a registered ``"<hostname>:<pid>"``."""
    host, _, pid = value.rpartition(":")
    if not host or not pid.isdigit():
        raise ValueError(f"a registered rank process must read '<hostname>:<pid>', got {value!r}")
    return host, int(pid)


def registered_process(store: dist.Store, rank: int, prefix: str = RANKS_PREFIX) -> Optional[tuple[str, int]]:
    """``(hostname, pid)`` that rank ``rank`` registered (:func:`register_rank`); None before it did."""
    key = proc_key(rank, prefix)
    return parse_process(store.get(key).decode()) if store.check([key]) else None


def process_alive(host: str, pid: int) -> Optional[bool]:
    """Whether process ``pid`` of machine ``host`` is running: None when ``host`` is another machine
    (nothing can be known from here). A zombie (exited, not yet reaped by its parent) is dead."""
    if host != socket.gethostname():
        return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (not Linux): nothing is known; a lost peer is then found by its silence
        return None
    # The state follows the command name, which may itself hold spaces and parentheses.
    state = stat.rsplit(")", 1)[1].split()[0]
    return state not in ("Z", "X")


# -- what ranks do ------------------------------------------------------------------------------


def register_rank(store: dist.Store, rank: int) -> None:
    """Record this process as global rank ``rank`` of the job (the host watches it from now on)."""
    store.set(proc_key(rank), this_process())


def mark_exited(store: dist.Store, rank: int, reason: str) -> bool:
    """Record that rank ``rank`` has ended, and why; the first reason recorded stays.

    Safe to call while failing (from an exception handler, at interpreter exit): an unreachable
    store is not an error here. Returns whether the mark was written (or was already there).
    """
    try:
        store.compare_set(exited_key(rank), "", reason)
    except (RuntimeError, OSError):  # DistStoreError, DistNetworkError are RuntimeErrors
        return False
    return True


def start_host(address: str, port: int, world_size: int, connect_timeout: timedelta,
               silent_after_s: float = DEFAULT_SILENT_AFTER_S, max_lifetime_s: Optional[float] = None,
               log_file: Optional[Path] = None, ready_timeout_s: float = 120.0) -> subprocess.Popen:
    """Start a store host on ``port`` and return once it serves; raises when it cannot start.

    The host runs in a session of its own (``start_new_session``): a signal sent to the caller's
    process group, or the caller's death, does not reach it. Its output is discarded once it is
    ready (pass ``log_file`` to keep its account of why it left).
    """
    command = [sys.executable, "-c", _BOOTSTRAP, __file__, "--host", address, "--port", str(port),
               "--world-size", str(world_size), "--connect-timeout", str(connect_timeout.total_seconds()),
               "--silent-after", str(silent_after_s), "--parent-pid", str(os.getpid()),
               "--ranks-prefix", RANKS_PREFIX]
    if max_lifetime_s is not None:
        command += ["--max-lifetime", str(max_lifetime_s)]
    if log_file is not None:
        command += ["--log-file", str(log_file)]
    host = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, text=True)
    assert host.stdout is not None and host.stderr is not None
    line = _read_line(host.stdout, ready_timeout_s)
    if line is None or line.strip() != READY_LINE:
        if line is None:
            said = f"it was not serving after {ready_timeout_s} s"
        else:
            said = f"it wrote {line.strip()!r}" if line else "it exited before serving"
        if host.poll() is None:
            host.kill()
        host.wait()
        error = host.stderr.read().strip()[-2000:]
        raise RuntimeError(
            f"The lightning_elche job store could not start on {address}:{port} (MASTER_ADDR:MASTER_PORT): "
            f"{said}, exit code {host.returncode}{': ' + error if error else ''}. Is another job using that port?"
        )
    host.stdout.close()
    host.stderr.close()
    return host


# Runs job_store.py as a plain file: ``python -m lightning_elche.job_store`` would import the
# package, and Lightning with it (seconds), and ``python job_store.py`` would put the package's
# directory first on sys.path, where its modules could shadow others.
_BOOTSTRAP = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"


def _read_line(stream: IO[str], timeout_s: float) -> Optional[str]:
    """The next line of ``stream`` ("" at its end), or None when none came within ``timeout_s``."""
    ready, _, _ = select.select([stream], [], [], timeout_s)
    return stream.readline() if ready else None


LAUNCHER_ENV = "ELCHE_LAUNCHER_PID"
"""Set by the popen launcher (rank 0) for the ranks it starts: the pid of the process that started them."""
PROBE_INTERVAL_S = 0.25
"""How often a rank waiting for the store checks that its launcher is still alive."""


def launcher_gone() -> Optional[int]:
    """The pid of the rank 0 that started this process, if it has exited; None while it runs, or when
    this process was not started by rank 0's popen launcher (nothing can be known then)."""
    launcher = os.environ.get(LAUNCHER_ENV, "")
    if not launcher.isdigit() or int(launcher) == os.getpid():
        return None
    # Whether that process still runs, not whether it is this one's parent: a process this rank
    # starts (a spawned rank of a job of its own) inherits the variable and has another parent.
    return int(launcher) if process_alive(socket.gethostname(), int(launcher)) is False else None


def _serving(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=PROBE_INTERVAL_S):
            return True
    except OSError:
        return False


def connect(address: str, port: int, timeout: timedelta) -> dist.TCPStore:
    """A client of the store served on ``address:port`` (it waits up to ``timeout`` for the server).

    A rank started by rank 0's popen launcher stops waiting as soon as rank 0 is gone: rank 0 starts
    the store's host, so a rank 0 that died before the store served means it never will (without
    this the rank waited out the whole timeout, a leftover process of a failed launch).
    """
    deadline = time.monotonic() + timeout.total_seconds()
    while not _serving(address, port) and time.monotonic() < deadline:
        launcher = launcher_gone()
        if launcher is not None:
            raise RuntimeError(
                f"The lightning_elche job store on {address}:{port} (MASTER_ADDR:MASTER_PORT) is not serving and "
                f"rank 0 (pid {launcher}), which started this rank and starts the store, has exited: the job "
                "cannot start. Rank 0's own output says why it ended."
            )
        time.sleep(PROBE_INTERVAL_S)
    # Past the probe TCPStore waits out what is left of the timeout itself, and raises its own error.
    remaining = max(deadline - time.monotonic(), PROBE_INTERVAL_S)
    store = dist.TCPStore(address, port, is_master=False, timeout=timedelta(seconds=remaining))
    store.set_timeout(timeout)
    return store


@dataclass
class JobStoreLink:
    """This process's connection to the job's store.

    ``store`` is the job's base store: what the rank registry lives in and what new process groups
    are built on (``PrefixStore(generation_prefix(g), store)``); ``prefix`` is the prefix of the
    default group the fit started with. ``host`` is the store host this process started (global
    rank 0 only).
    """

    store: dist.Store
    rank: int
    prefix: str = generation_prefix(0)
    host: Optional[subprocess.Popen] = field(default=None, repr=False)

    def default_group_store(self) -> dist.Store:
        return dist.PrefixStore(self.prefix, self.store)

    def mark_exited(self, reason: str) -> bool:
        return mark_exited(self.store, self.rank, reason)


_current: Optional[JobStoreLink] = None


def current_link() -> Optional[JobStoreLink]:
    """The job store this process joined last (one per process, as the default process group)."""
    return _current


def join(store: dist.Store, rank: int, host: Optional[subprocess.Popen] = None) -> JobStoreLink:
    """Register this process as ``rank`` in ``store`` and make it this process's job store.

    The rank is marked exited at interpreter exit (a clean end or an uncaught exception; a killed
    process is found dead by the host instead), and when a later fit joins another store.
    """
    global _current
    if _current is not None:
        _current.mark_exited("joined another job store")
    register_rank(store, rank)
    _current = JobStoreLink(store=store, rank=rank, host=host)
    atexit.register(_current.mark_exited, "process exit")
    return _current


def store_place(environ: Optional[dict[str, str]] = None) -> str:
    """Where the job's store runs (``ELCHE_STORE``): ``rank0`` (the default) or ``external``."""
    value = (os.environ if environ is None else environ).get(STORE_ENV, "").strip() or "rank0"
    if value not in STORE_PLACES:
        raise ValueError(
            f"{STORE_ENV}={value!r} is invalid: expected 'external' (the ranks connect to a store already "
            "serving on MASTER_ADDR:MASTER_PORT, started with `python -m lightning_elche.job_store --host H "
            "--port P --world-size N`), or 'rank0' / unset (global rank 0 starts the store host)."
        )
    return value


def open_job_store(address: str, port: int, rank: int, world_size: int, timeout: timedelta) -> JobStoreLink:
    """Join the job's store on ``address:port``, global rank 0 starting its host first (unless
    :func:`store_place` says it runs outside the ranks: every rank then only connects).

    A single-rank job keeps its store in its own process: there is no other rank to survive it.
    """
    if world_size == 1:
        return join(dist.HashStore(), rank)
    starts_host = rank == 0 and store_place() == "rank0"
    host = start_host(address, port, world_size, connect_timeout=timeout) if starts_host else None
    return join(connect(address, port, timeout), rank, host)


# -- the host -----------------------------------------------------------------------------------


@dataclass
class _Watched:
    host: str
    pid: int
    beats: int = 0
    beat_changed_at: float = 0.0


class JobWatch:
    """Decides when the job is over, from the rank registry in ``store``."""

    def __init__(self, store: dist.Store, world_size: int, silent_after_s: float,
                 registry_prefix: str = RANKS_PREFIX) -> None:
        self.store = store
        self.world_size = world_size
        self.silent_after_s = silent_after_s
        self.prefix = registry_prefix
        self.watched: dict[int, _Watched] = {}

    def ended(self, now: float) -> dict[int, str]:
        """Each registered rank that has ended, with how."""
        self._find_registered(now)
        ended: dict[int, str] = {}
        for rank, watched in self.watched.items():
            how = self._how_ended(rank, watched, now)
            if how is not None:
                ended[rank] = how
        return ended

    def over(self, now: float) -> Optional[str]:
        """Why the job is over (every registered rank ended), or None while it is not."""
        ended = self.ended(now)
        if not self.watched or len(ended) < len(self.watched):
            return None
        return "; ".join(f"rank {rank}: {how}" for rank, how in sorted(ended.items()))

    def _find_registered(self, now: float) -> None:
        # Ranks that joined the running fit take the ids after the launch world size (the admission's
        # counter sits next to the registry: ``<base>/join/next_member``).
        joined_key = f"{self.prefix.rsplit('/', 1)[0]}/join/next_member"
        joined = int(self.store.add(joined_key, 0)) if self.store.check([joined_key]) else 0
        for rank in range(self.world_size + joined):
            registered = registered_process(self.store, rank, self.prefix) if rank not in self.watched else None
            if registered is not None:
                self.watched[rank] = _Watched(*registered, beat_changed_at=now)

    def _how_ended(self, rank: int, watched: _Watched, now: float) -> Optional[str]:
        exited = exited_key(rank, self.prefix)
        if self.store.check([exited]):
            return f"exited ({self.store.get(exited).decode()})"
        if process_alive(watched.host, watched.pid) is False:
            return f"process {watched.pid} is gone"
        heartbeat = heartbeat_key(rank, self.prefix)
        if self.store.check([heartbeat]):
            beats = int(self.store.get(heartbeat))
            if beats != watched.beats:
                watched.beats, watched.beat_changed_at = beats, now
        # A rank that never beat is judged by its process and its exit mark alone: without a
        # heartbeat thread, silence says nothing.
        if watched.beats > 0 and now - watched.beat_changed_at > self.silent_after_s:
            return f"heartbeat silent for {now - watched.beat_changed_at:.0f} s"
        return None


def serve(options: argparse.Namespace) -> str:
    """Host the store until the job is over; returns why it ended."""
    started = time.monotonic()
    store = dist.TCPStore(options.host, options.port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    print(READY_LINE, flush=True)
    _discard_output()
    watch = JobWatch(store, options.world_size, options.silent_after, options.ranks_prefix)
    while True:
        time.sleep(POLL_INTERVAL_S)
        now = time.monotonic()
        reason = watch.over(now)
        if reason is not None:
            return f"every registered rank ended: {reason}"
        if not watch.watched:
            if now - started > options.connect_timeout:
                return f"no rank registered within the connect timeout ({options.connect_timeout:.0f} s)"
            if options.parent_pid is not None and process_alive(socket.gethostname(), options.parent_pid) is False:
                return f"the process that started the host ({options.parent_pid}) is gone and no rank registered"
        if options.max_lifetime is not None and now - started > options.max_lifetime:
            return f"max lifetime reached ({options.max_lifetime:.0f} s)"


def _discard_output() -> None:
    # The starting rank closes its ends of the pipes; writing to them later would kill the host.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.close(devnull)


def _positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text}")
    return value


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m lightning_elche.job_store", description=(
        "Host the TCPStore of a lightning_elche job outside its ranks; exits once the job is over."))
    parser.add_argument("--host", default="127.0.0.1", help="address the ranks connect to (MASTER_ADDR)")
    parser.add_argument("--port", type=int, required=True, help="port to serve on (MASTER_PORT)")
    parser.add_argument("--world-size", type=int, required=True, help="number of ranks that may register")
    parser.add_argument("--connect-timeout", type=_positive, default=1800.0,
                        help="exit when no rank registered within this many seconds")
    parser.add_argument("--silent-after", type=_positive, default=DEFAULT_SILENT_AFTER_S,
                        help="a rank whose heartbeat has not changed for this many seconds is gone")
    parser.add_argument("--max-lifetime", type=_positive, default=None, help="exit after this many seconds at most")
    parser.add_argument("--parent-pid", type=int, default=None,
                        help="exit when this process is gone before any rank registered")
    parser.add_argument("--ranks-prefix", default=RANKS_PREFIX, help="key prefix of the rank registry")
    parser.add_argument("--log-file", type=Path, default=None, help="append why the host exited to this file")
    options = parser.parse_args(argv)
    if options.world_size < 1:
        parser.error(f"--world-size must be at least 1, got {options.world_size}")
    return options


def main(argv: Optional[list[str]] = None) -> int:
    options = parse_args(argv)
    reason = serve(options)
    if options.log_file is not None:
        with open(options.log_file, "a") as log:
            log.write(f"lightning_elche job store on port {options.port} (pid {os.getpid()}) exits: {reason}\n")
    return 0


if __name__ == "__main__":
    code = main()
    # Skip the interpreter's teardown of torch (about 0.7 s): nothing is left to flush, and the
    # job is over the moment the host decides it is.
    os._exit(code)
