"""Lightning's popen launcher path with ElCheStrategy, 3 CPU ranks, a dummy job instead of a fit.

    python launcher_probe.py OUT_DIR --scenario child_fails|rank0_killed|rank0_dies_first|rank0_fails_children_stuck

Rank 0 is this process; Lightning's launcher (the strategy's) starts ranks 1 and 2 as its
subprocesses, which run this script again. Every rank then sets up the job store and the default
group (``strategy.setup_environment()``, as a fit does), writes ``rank<r>.json`` (its pid; rank 0
also the store host's pid) and passes a barrier. Then:

* ``child_fails``: rank 1 exits with code 3; the others wait ``--linger`` seconds and write
  ``rank<r>.done``. ``--tolerate`` makes ``strategy.tolerates_rank_loss()`` answer True.
* ``rank0_killed``: rank 0 waits to be killed by the test; ranks 1 and 2 wait for ``OUT_DIR/go``
  (written after the kill), exchange a key through ``strategy.job_store`` and write
  ``rank<r>.done`` with the value their peer set.
* ``rank0_dies_first``: rank 0 exits with code 3 right after starting ranks 1 and 2, before it starts
  the job store; they must give up on the store at once rather than wait out ``--timeout``.
* ``rank0_fails_children_stuck``: rank 0 raises before it sets anything up while ranks 1 and 2 are
  stuck (a long sleep) before theirs; rank 0's launcher must not leave them running.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from lightning.pytorch import Trainer

from lightning_elche import ElCheStrategy

RANKS = 3


def probe(trainer: Trainer, args: argparse.Namespace) -> None:
    strategy = trainer.strategy
    assert isinstance(strategy, ElCheStrategy)
    if args.scenario == "rank0_dies_first" and os.environ.get("LOCAL_RANK", "0") == "0":  # its children run
        os._exit(3)
    if args.scenario == "rank0_fails_children_stuck":
        if os.environ.get("LOCAL_RANK", "0") == "0":
            raise RuntimeError("rank 0 failed before the fit formed")
        time.sleep(600)
    strategy.setup_environment()  # what a fit does first: the job store and the default group
    rank = strategy.global_rank
    link = strategy.job_store_link
    assert link is not None and strategy.job_store is link.store
    host_pid = link.host.pid if link.host is not None else None
    (args.out_dir / f"rank{rank}.json").write_text(json.dumps({"pid": os.getpid(), "host_pid": host_pid}))
    dist.barrier()
    if args.scenario == "child_fails":
        if rank == 1:
            time.sleep(0.5)
            os._exit(3)
        time.sleep(args.linger)
        (args.out_dir / f"rank{rank}.done").write_text("lingered")
        return
    if rank == 0:
        time.sleep(120)  # the test kills this process
        return
    go = args.out_dir / "go"
    deadline = time.monotonic() + 60
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    store = strategy.job_store
    assert store is not None
    store.set(f"probe/{rank}", f"from rank {rank}")
    peer = 2 if rank == 1 else 1
    (args.out_dir / f"rank{rank}.done").write_text(store.get(f"probe/{peer}").decode())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--scenario", choices=("child_fails", "rank0_killed", "rank0_dies_first",
                                                  "rank0_fails_children_stuck"), required=True)
    parser.add_argument("--tolerate", action="store_true")
    parser.add_argument("--linger", type=float, default=6.0)
    parser.add_argument("--timeout", type=float, default=30.0, help="the strategy's timeout, in seconds")
    args = parser.parse_args()
    trainer = Trainer(accelerator="cpu", devices=RANKS, logger=False, enable_progress_bar=False,
                      strategy=ElCheStrategy(mode="cpu_cadence", timeout=timedelta(seconds=args.timeout)))
    if args.tolerate:
        trainer.strategy.tolerates_rank_loss = lambda member=None: True  # type: ignore[method-assign]
    trainer.strategy.launcher.launch(probe, trainer, args, trainer=trainer)


if __name__ == "__main__":
    main()
