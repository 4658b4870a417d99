"""Lightning's popen launcher, with an observer that lets the survivors of a lost rank live, and
restarts a lost child as a joiner of the running fit (``ElCheStrategy(restart_lost=N)``)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional, cast

from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _set_num_threads_if_needed,
)
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_elche.job_store import LAUNCHER_ENV

JOIN_ENV = "ELCHE_JOIN"  # lightning_elche.membership.admission.JOIN_ENV: a restarted child joins the fit


def configure_launcher(strategy: Any, tolerates_loss: Callable[[int], bool], restart_lost: int = 0,
                       restartable: Callable[[], bool] = lambda: False, joining: bool = False) -> None:
    """``DDPStrategy._configure_launcher``, with a popen launcher that spares the survivors of a loss.

    Lightning's popen launcher (the default for ``devices=N``) kills every rank as soon as one
    child exits non-zero; :class:`TolerantSubprocessLauncher` only reports such an exit while
    ``tolerates_loss(member)`` (``member``: the child's launch rank). The ``spawn``/``fork`` start
    methods keep Lightning's launcher, whose ``torch.multiprocessing`` context ends every process
    when one fails.

    ``restart_lost``: how many times in the fit rank 0 starts a lost child again, as a joiner
    (``ELCHE_JOIN=1``, the same command, environment and ``LOCAL_RANK``), while ``restartable()``
    (the fit admits joiners).

    ``joining``: this process joins a running fit (``ELCHE_JOIN=1``). Started by a cluster (a task
    of its own ``srun`` step), it is one rank whatever its step's shape, so the step is not held to
    ``Trainer(devices=..., num_nodes=...)`` (the admission checks what the fit needs instead).
    """
    if strategy._start_method != "popen":
        DDPStrategy._configure_launcher(strategy)
        return
    assert strategy.cluster_environment is not None
    strategy._launcher = TolerantSubprocessLauncher(strategy.cluster_environment, strategy.num_processes,
                                                    strategy.num_nodes, tolerates_loss, restart_lost, restartable,
                                                    joining)


class TolerantSubprocessLauncher(_SubprocessScriptLauncher):
    """Lightning's popen launcher with an observer that lets survivors live (see :class:`ChildObserver`).

    The children are started exactly as Lightning starts them: subprocesses of rank 0, in its
    session and process group (Ctrl-C still reaches every rank), without a parent-death signal,
    so that rank 0's death does not take them down.
    """

    def __init__(self, cluster_environment: ClusterEnvironment, num_processes: int, num_nodes: int,
                 tolerates_loss: Callable[[int], bool], restart_lost: int = 0,
                 restartable: Callable[[], bool] = lambda: False, joining: bool = False) -> None:
        super().__init__(cluster_environment, num_processes, num_nodes)
        self.tolerates_loss = tolerates_loss
        self.restart_lost = restart_lost
        self.restartable = restartable
        self.joining = joining

    def launch(self, function: Callable, *args: Any, trainer: Optional[Trainer] = None, **kwargs: Any) -> Any:
        if not (self.joining and self.cluster_environment.creates_processes_externally):
            self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        restarter = None
        first_member: Optional[int] = None
        if not self.cluster_environment.creates_processes_externally:
            # Only the children get it (Lightning copies the environment for each): a child that finds
            # its launcher gone before the job's store serves stops waiting for it (job_store.connect).
            os.environ[LAUNCHER_ENV] = str(os.getpid())
            try:
                self._call_children_scripts()
            finally:
                del os.environ[LAUNCHER_ENV]
            first_member = self.cluster_environment.node_rank() * self.num_processes
            restarter = ChildRestarter(self.procs, self.restart_lost, self.restartable) if self.restart_lost else None
            ChildObserver(self.procs, os.getpid(), self.tolerates_loss, first_member, restarter=restarter).start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        try:
            result = function(*args, **kwargs)
        except BaseException:
            # Failed before the fit formed (nothing tolerates a loss yet): the children cannot form it
            # without this rank, and one stuck or slow to fail would outlive the launch.
            if first_member is not None and not self.tolerates_loss(first_member):
                end_children(self.procs, CHILDREN_GRACE_S)
            raise
        if restarter is not None:
            restarter.wait_restarted(RESTARTED_WAIT_S)
        return result


CHILDREN_GRACE_S = 10.0
"""How long rank 0, failed before the fit formed, lets its children end by themselves (each may be
refusing the same setting, and say so) before it kills them."""


def end_children(children: Sequence[subprocess.Popen], grace_s: float) -> None:
    """Wait up to ``grace_s`` for ``children`` to exit, then SIGKILL those still running."""
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


RESTARTED_WAIT_S = 120.0
"""How long rank 0, its fit done, waits for a child it restarted (one still starting needs to import,
connect and find the fit over)."""


class ChildRestarter:
    """Starts a lost child of rank 0 again, as a joiner of the running fit, up to ``budget`` times.

    The command is the one Lightning started the child with; the environment is rank 0's (Lightning
    put the job's ``MASTER_ADDR``/``MASTER_PORT``, ``NODE_RANK`` and ``WORLD_SIZE`` there before it
    started the children) with the child's ``LOCAL_RANK`` and ``ELCHE_JOIN=1``: the restarted process
    connects to the job's store and asks to join, as a joiner started by hand would.
    """

    def __init__(self, children: list[subprocess.Popen], budget: int, restartable: Callable[[], bool]) -> None:
        # Lightning starts every child with a list of arguments.
        self.commands = [list(cast(Sequence[str], child.args)) for child in children]
        self.budget = budget
        self.restartable = restartable
        self.restarted = 0
        self.started: list[subprocess.Popen] = []

    def restart(self, index: int) -> Optional[subprocess.Popen]:
        """Start child ``index`` (local rank ``index + 1``) again; None when the budget is spent or
        the fit admits no joiner now."""
        if self.restarted >= self.budget or not self._restartable():
            return None
        self.restarted += 1
        env = os.environ.copy()
        env["LOCAL_RANK"] = str(index + 1)
        env[JOIN_ENV] = "1"
        env[LAUNCHER_ENV] = str(os.getpid())
        if os.environ.get("PL_GLOBAL_SEED") is None:  # as Lightning starts its children
            env.pop("PL_GLOBAL_SEED", None)
        self.started.append(subprocess.Popen(self.commands[index], env=env))
        return self.started[-1]

    def wait_restarted(self, timeout_s: float) -> None:
        """Rank 0, its fit done: wait (up to ``timeout_s``) for the children it restarted. One still
        starting when the fit ended finds it over and leaves at once, but only while the job's store
        serves it: the store leaves once every registered rank has ended, and rank 0 is registered
        until it exits (without this wait, such a child hung in its connect for the store timeout)."""
        deadline = time.monotonic() + timeout_s
        for child in self.started:
            try:
                child.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return  # past the bound rank 0 leaves: the child ends by its own timeouts

    def _restartable(self) -> bool:
        try:
            return bool(self.restartable())
        except Exception:  # noqa: BLE001 (a broken answer restarts nothing)
            return False


class ChildObserver(threading.Thread):
    """Watches the children of rank 0 for a non-zero exit.

    While ``tolerates_loss(member)`` a failed child is only reported, once, and never held against
    the job later; otherwise every child and rank 0 are killed, as Lightning's ``_ChildProcessObserver``
    does (a rank blocked in a collective with a dead peer would hang). The tolerance is read when
    the exit is seen, at most ``period_s`` after it; ``member`` is the child's launch rank
    (``first_member`` + its local rank), so that an exit the survivors already agreed on is tolerated
    even when it is seen only after the fit (a fit may be shorter than ``period_s``). With a
    ``restarter``, a tolerated failed child is started again as a joiner (and watched in its place)
    while the restarter's budget lasts.
    """

    def __init__(self, children: list[subprocess.Popen], main_pid: int, tolerates_loss: Callable[[int], bool],
                 first_member: int = 0, period_s: float = 1.0, restarter: Optional[ChildRestarter] = None) -> None:
        super().__init__(daemon=True, name="elche-child-observer")  # ends with rank 0
        self.children = children
        self.main_pid = main_pid
        self.tolerates_loss = tolerates_loss
        self.first_member = first_member
        self.period_s = period_s
        self.tolerated: set[int] = set()
        self.restarter = restarter

    def run(self) -> None:
        while True:
            time.sleep(self.period_s)
            if self.check():
                return

    def check(self) -> bool:
        """Look at every child once; returns True when there is nothing left to watch."""
        for index, child in enumerate(self.children):
            code = child.poll()
            if code is None or code == 0 or index in self.tolerated:
                continue
            local_rank = index + 1
            if self._tolerating(self.first_member + local_rank):
                restarted = self.restarter.restart(index) if self.restarter is not None else None
                if restarted is not None:
                    self.children[index] = restarted
                    rank_zero_warn(f"The process of local rank {local_rank} (pid {child.pid}) exited with code "
                                   f"{code}; ElCheStrategy tolerates the loss and restarted it (pid {restarted.pid}, "
                                   f"restart {self.restarter.restarted} of restart_lost="  # type: ignore[union-attr]
                                   f"{self.restarter.budget}): it joins the running fit.")  # type: ignore[union-attr]
                    continue
                self.tolerated.add(index)
                rank_zero_warn(f"The process of local rank {local_rank} (pid {child.pid}) exited with code {code}; "
                               "ElCheStrategy tolerates the loss: the other ranks go on.")
                continue
            rank_zero_warn(f"The process of local rank {local_rank} (pid {child.pid}) exited with code {code}. "
                           "Killing every other rank (as Lightning's launcher does): the job does not tolerate "
                           "the loss of a rank now.")
            for other in self.children:
                other.send_signal(signal.SIGKILL)
            os.kill(self.main_pid, signal.SIGKILL)
            return True
        return all(child.returncode is not None for child in self.children)

    def _tolerating(self, member: int) -> bool:
        try:
            return bool(self.tolerates_loss(member))
        except Exception:  # noqa: BLE001 (a broken answer must not keep a doomed job alive)
            return False
