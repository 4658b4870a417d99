"""Multi-node jobs on localhost: two torchrun agents (c10d rendezvous) and an emulated SLURM step.

Each job runs ``tests/scripts/multinode_fit.py`` on every process: a fit of 2 epochs with an
epoch-end checkpoint, then a fit resumed from it to 3 epochs, ranks of different speeds. The test
checks that Lightning's cluster environment gave every process its node, local and global rank,
that every sample was trained exactly once per epoch and every rank ends with the same
parameters, that only global rank 0 logged ElChe's metrics (and wrote the CSV log), and that the
resumed fit continued the epoch count and the round count from the checkpoint.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
import torch
from multirank_helpers import (
    assert_same_parameters,
    clean_environment,
    coverage_errors,
    free_port,
    load_rank_records,
    run_together,
)

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(200)]
SCRIPT = Path(__file__).parent / "scripts" / "multinode_fit.py"
NODES = 2
SAMPLES = 512  # multinode_fit.py's
LAUNCH_TIMEOUT_S = 150.0


def job_arguments(out_dir: Path, mode: str, per_node: int) -> list[str]:
    return [str(SCRIPT), str(out_dir), "--mode", mode, "--nodes", str(NODES), "--devices", str(per_node)]


def torchrun_agents(out_dir: Path, mode: str, per_node: int) -> list[tuple[list[str], dict[str, str]]]:
    """One torchrun agent per node; they meet in a c10d rendezvous hosted by the first."""
    endpoint = f"127.0.0.1:{free_port()}"
    return [
        ([sys.executable, "-m", "torch.distributed.run", f"--nnodes={NODES}", f"--nproc-per-node={per_node}",
          "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id=elche-{out_dir.name}",
          f"--rdzv-conf=is_host={int(node == 0)},join_timeout=60", "--max-restarts=0",
          *job_arguments(out_dir, mode, per_node)],
         clean_environment())
        for node in range(NODES)
    ]


def slurm_tasks(out_dir: Path, mode: str, per_node: int) -> list[tuple[list[str], dict[str, str]]]:
    """The tasks of ``srun --nodes=2 --ntasks-per-node=K``, with the variables srun gives each task."""
    port = str(free_port())
    tasks = []
    for rank in range(NODES * per_node):
        env = clean_environment()
        env.update(
            SLURM_JOB_ID="4242", SLURM_JOB_NAME="elche-multinode",  # not "bash"/"interactive": a batch step
            SLURM_NTASKS=str(NODES * per_node), SLURM_NTASKS_PER_NODE=str(per_node), SLURM_NNODES=str(NODES),
            SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank % per_node), SLURM_NODEID=str(rank // per_node),
            SLURM_NODELIST="localhost", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
        )
        tasks.append(([sys.executable, *job_arguments(out_dir, mode, per_node)], env))
    return tasks


def check_identities(fit_dir: Path, per_node: int, environment: str) -> None:
    world_size = NODES * per_node
    for rank in range(world_size):
        identity = json.loads((fit_dir / f"identity{rank}.json").read_text())
        assert identity == {
            "global_rank": rank, "dist_rank": rank, "local_rank": rank % per_node, "node_rank": rank // per_node,
            "world_size": world_size, "rank_zero_only_rank": rank, "is_global_zero": rank == 0,
            "environment": environment,
        }, f"rank {rank} of {fit_dir.name}"


def check_rank_zero_logging(fit_dir: Path, world_size: int) -> list[str]:
    """ElChe's metrics come from global rank 0 only; returns the keys rank 0 logged."""
    logged = {}
    for rank in range(world_size):
        path = fit_dir / "calls" / f"calls-rank{rank}.jsonl"
        calls = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        logged[rank] = {key for call in calls for key in call["keys"]}
    assert "elche/syncs" in logged[0] and "elche/batch_share/rank1" in logged[0], sorted(logged[0])
    for rank in range(1, world_size):
        elche_keys = sorted(k for k in logged[rank] if k.startswith("elche/"))
        assert not elche_keys, f"rank {rank} (not global zero) logged {elche_keys[:5]}"
    return sorted(logged[0])


def check_job(out_dir: Path, per_node: int, environment: str) -> None:
    world_size = NODES * per_node
    first_dir, resumed_dir = out_dir / "first", out_dir / "resumed"
    for fit_dir in (first_dir, resumed_dir):
        check_identities(fit_dir, per_node, environment)
        check_rank_zero_logging(fit_dir, world_size)

    first = load_rank_records(first_dir, world_size)
    errors = coverage_errors(first, SAMPLES, [0, 1])
    assert not errors, "first fit: " + "; ".join(errors)
    assert_same_parameters(first)
    assert [r["current_epoch"] for r in first] == [2] * world_size
    assert len({r["rounds"] for r in first}) == 1 and all(steps > 0 for steps in first[0]["steps"])

    # Lightning's CSVLogger (rank-zero-only) wrote one log, with ElChe's metrics in it.
    logs = list((out_dir / "csv").rglob("metrics.csv"))
    assert len(logs) == 1, logs
    rows = list(csv.DictReader(logs[0].open()))
    syncs = [float(row["elche/syncs"]) for row in rows if row.get("elche/syncs")]
    assert syncs and syncs[-1] == first[0]["rounds"]

    saved = torch.load(out_dir / "ckpt" / "last.ckpt", weights_only=False)
    assert saved["epoch"] == 1 and saved["elche"]["rounds"] == first[0]["rounds"]

    resumed = load_rank_records(resumed_dir, world_size)
    errors = coverage_errors(resumed, SAMPLES, [2])  # only the epoch that was left, all of it
    assert not errors, "resumed fit: " + "; ".join(errors)
    assert_same_parameters(resumed)
    assert [r["current_epoch"] for r in resumed] == [3] * world_size
    assert len({r["rounds"] for r in resumed}) == 1 and resumed[0]["rounds"] > first[0]["rounds"]
    assert resumed[0]["cohort_step"] > first[0]["cohort_step"]


@pytest.mark.parametrize(("per_node", "mode"), [(1, "cpu_async"), (2, "nccl_cadence")])
def test_torchrun_two_nodes(tmp_path: Path, per_node: int, mode: str) -> None:
    run_together(torchrun_agents(tmp_path, mode, per_node), tmp_path / "logs", LAUNCH_TIMEOUT_S)
    check_job(tmp_path, per_node, "TorchElasticEnvironment")


def test_slurm_two_nodes_two_tasks_each(tmp_path: Path) -> None:
    run_together(slurm_tasks(tmp_path, "cpu_cadence", 2), tmp_path / "logs", LAUNCH_TIMEOUT_S)
    check_job(tmp_path, 2, "SLURMEnvironment")
