"""One launch of N CPU ranks (gloo) that runs several ElChe fits in a row, ranks of different speeds.

    python multirank_fits.py OUT_DIR --ranks 4 --modes nccl_cadence cpu_async [--repeats 1] ...

Each fit writes ``OUT_DIR/<mode>-<repeat>/rank<r>.json`` (see ``CoverageModel``): what every rank
trained, its final parameters and the engine's counters. The ranks are started with
``torch.multiprocessing.spawn`` and share one process group (and one TCPStore) over all fits, so
a launch pays the start-up of N processes once.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from multirank_helpers import MODES, STEP_DELAYS_MS, CoverageModel, StepDelay, free_port  # noqa: E402

from lightning_elche import ElCheStrategy  # noqa: E402


def run_rank(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(args.ranks), NODE_RANK="0",
                      LOCAL_RANK=str(rank), RANK=str(rank))
    torch.set_num_threads(1)
    timeout = timedelta(seconds=args.pg_timeout)
    try:
        for repeat in range(args.repeats):
            for mode in args.modes:
                pl.seed_everything(repeat, verbose=False)
                out_dir = Path(args.out_dir, f"{mode}-{repeat}")
                trainer = pl.Trainer(
                    accelerator="cpu", devices=args.ranks, max_epochs=args.epochs,
                    strategy=ElCheStrategy(mode=mode, timeout=timeout, snapshot_timeout=timeout, summary=False),
                    callbacks=[StepDelay(args.delays_ms)], logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                    default_root_dir=str(out_dir),
                )
                trainer.fit(CoverageModel(str(out_dir), n=args.samples, batch_size=args.batch_size))
    finally:
        # Leave like a well-behaved job: a default group alive at exit can abort in c10d's destructors.
        if dist.is_initialized():
            dist.destroy_process_group()


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--modes", nargs="+", choices=MODES, required=True)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--delays-ms", type=float, nargs="+", default=list(STEP_DELAYS_MS))
    parser.add_argument("--pg-timeout", type=float, default=30.0, help="process-group and snapshot timeout (s)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    arguments = parse_args(sys.argv[1:])
    torch.multiprocessing.spawn(run_rank, args=(arguments, free_port()), nprocs=arguments.ranks)
