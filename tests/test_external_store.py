"""No single host holds the job: the store served outside every training node (issue 23, item 4).

``python -m lightning_elche.job_store`` runs standalone (a login node, a batch step, a service);
ranks started with ``ELCHE_STORE=external`` connect to it instead of rank 0 starting its own. A
real 3-rank CPU job, each rank launched as its own process (an emulated node each): rank 0's whole
process tree is killed mid-epoch and the survivors finish the fit on the store that lives on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fault_jobs import BATCH, EPOCHS, RANKS, SAMPLES, SCRIPT, Job, check_survived, records
from multirank_helpers import LAUNCH_TAG, clean_environment, free_port, kill_tagged, tagged_processes

from lightning_elche.job_store import READY_LINE, STORE_ENV, store_place

ROOT = Path(__file__).resolve().parents[1]


def test_the_store_place_is_read_from_the_environment_and_a_bad_one_is_refused() -> None:
    assert store_place({}) == "rank0"
    assert store_place({STORE_ENV: "external"}) == "external"
    assert store_place({STORE_ENV: " rank0 "}) == "rank0"
    with pytest.raises(ValueError, match=r"ELCHE_STORE='extern' is invalid: expected 'external'"):
        store_place({STORE_ENV: "extern"})


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (its tree, as a node's death takes it)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(children.get(current, []))
    return tree


def start_store(port: int, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "lightning_elche.job_store", "--host", "127.0.0.1", "--port", str(port),
               "--world-size", str(RANKS), "--connect-timeout", "120", "--max-lifetime", "300",
               "--log-file", str(log)]
    with open(log.with_suffix(".err"), "w") as errors:
        host = subprocess.Popen(command, env={**clean_environment(), "PYTHONPATH": str(ROOT)},
                                stdout=subprocess.PIPE, stderr=errors, text=True, start_new_session=True)
    assert host.stdout is not None
    line = host.stdout.readline()
    assert line.strip() == READY_LINE, f"the standalone store did not start: {line!r}"
    return host


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_killing_rank_0s_whole_tree_leaves_the_external_store_to_the_survivors(tmp_path: Path) -> None:
    port, tag = free_port(), f"external-store-{os.getpid()}-{time.monotonic_ns()}"
    host = start_store(port, tmp_path / "store.log")
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(RANKS):
            env = {**clean_environment(), LAUNCH_TAG: tag, STORE_ENV: "external", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port), "WORLD_SIZE": str(RANKS), "NODE_RANK": "0", "LOCAL_RANK": str(rank),
                   "RANK": str(rank)}
            command = [sys.executable, str(SCRIPT), str(tmp_path), "--mode", "cpu_cadence", "--devices", str(RANKS),
                       "--epochs", str(EPOCHS), "--samples", str(SAMPLES), "--batch-size", str(BATCH),
                       "--liveness", "5"]
            with open(tmp_path / f"rank{rank}.log", "w") as sink:
                procs.append(subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        deadline = time.monotonic() + 120
        while len(records(tmp_path, 0)) < 12:
            assert time.monotonic() < deadline and procs[0].poll() is None, (tmp_path / "rank0.log").read_text()[-3000:]
            time.sleep(0.05)
        epoch = records(tmp_path, 0)[-1]["epoch"]
        (tmp_path / "fault-rank0.json").write_text(json.dumps({"kind": "kill-tree", "time": time.time(),
                                                                "epoch": epoch}))
        tree = descendants(procs[0].pid)
        for pid in tree:
            os.kill(pid, signal.SIGKILL)
        for proc in procs[1:]:
            proc.wait(timeout=150)
        leftover = tagged_processes(tag)
        log = "\n".join((tmp_path / f"rank{r}.log").read_text()[-3000:] for r in range(RANKS))
        results = {int(p.stem.removeprefix("result-rank")): json.loads(p.read_text())
                   for p in tmp_path.glob("result-rank*.json")}
        assert [proc.returncode for proc in procs[1:]] == [0, 0], log
        check_survived(Job(tmp_path, 0, log, results, RANKS, leftover, 0.0), {0})
        # The store outlived rank 0's node and leaves by itself once the survivors ended.
        assert host.wait(timeout=30) == 0
        assert "every registered rank ended" in (tmp_path / "store.log").read_text()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if host.poll() is None:
            host.kill()
            host.wait()
        assert not kill_tagged(tag)
