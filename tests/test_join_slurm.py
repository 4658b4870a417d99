"""A joiner started as a task of a new ``srun`` step inside the job's SLURM allocation.

The cohort is an emulated SLURM step of two tasks (one process per rank, ``SLURM_PROCID`` 0 and 1,
Lightning's ``SLURMEnvironment``); the joiner is a second step of one task, with the variables
``srun`` gives it: its own ``SLURM_PROCID`` 0, ``SLURM_NTASKS`` 1 and the step's own node list,
and neither ``LOCAL_RANK``, ``RANK`` nor ``MASTER_ADDR``. It must still find the job's store (on
the allocation's first node, ``SLURM_JOB_NODELIST``), be given the next free rank rather than its
step's rank 0, and the fit must end as any grown fit does (``test_join.check_grown``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_join import JOINER, check_grown, run_join_job

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

JOB = {"SLURM_JOB_ID": "5151", "SLURM_JOB_NAME": "elche-grow",  # not "bash"/"interactive": a batch job's step
       "SLURM_JOB_NODELIST": "127.0.0.1,joinhost"}


def cohort_step(tasks: int) -> tuple[dict[str, str], ...]:
    """The training step: ``tasks`` tasks on the allocation's first node."""
    return tuple({**JOB, "SLURM_STEP_ID": "0", "SLURM_NTASKS": str(tasks), "SLURM_NTASKS_PER_NODE": str(tasks),
                  "SLURM_NNODES": "1", "SLURM_NODELIST": "127.0.0.1", "SLURM_PROCID": str(rank),
                  "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0"} for rank in range(tasks))


# The joiner's step runs on a node of its own ("joinhost", which does not resolve here): the step's
# node list names only it, so the job's address must come from the allocation's.
JOINER_STEP: dict[str, str | None] = {
    **JOB, "SLURM_STEP_ID": "1", "SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "1", "SLURM_NNODES": "1",
    "SLURM_NODELIST": "joinhost", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
    "LOCAL_RANK": None, "MASTER_ADDR": None,
}


@pytest.mark.parametrize("mode", ["cpu_cadence", pytest.param("nccl_sync", marks=pytest.mark.faults)])
def test_a_task_of_a_new_srun_step_joins_the_running_fit(tmp_path: Path, mode: str) -> None:
    job = run_join_job(tmp_path, mode, joiner_env=JOINER_STEP, cohort_tasks=cohort_step(2))
    check_grown(job, joins=[[JOINER]])
    assert job.results[JOINER]["global_rank"] == 2, job.results[JOINER]  # not its step's SLURM_PROCID 0
    assert {r["environment"] for r in job.results.values()} == {"SLURMEnvironment"}, job.results
