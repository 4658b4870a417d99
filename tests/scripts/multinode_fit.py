"""One process of a multi-node CPU job, started by torchrun or (emulated) srun: fit, then resume.

    python multinode_fit.py OUT_DIR --mode cpu_async --nodes 2 --devices 1

Lightning finds the cluster environment (torchrun's or SLURM's) in the launcher's variables. The
job fits 2 epochs with an epoch-end checkpoint (``OUT_DIR/first``), then fits again from that
checkpoint to 3 epochs (``OUT_DIR/resumed``). Each fit leaves per rank: ``rank<r>.json`` (what the
rank trained, its parameters; see ``CoverageModel``), ``identity<r>.json`` (what the process
believes its ranks are) and ``calls/calls-rank<r>.jsonl`` (what it logged). The first fit also
logs to a CSVLogger under ``OUT_DIR/csv``.
"""

from __future__ import annotations

import argparse
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import CSVLogger, Logger  # noqa: E402
from multirank_helpers import MODES, CallRecordingLogger, CoverageModel, RankIdentity, StepDelay  # noqa: E402

from lightning_elche import ElCheStrategy  # noqa: E402

SAMPLES = 512
BATCH_SIZE = 16


def fit(args: argparse.Namespace, out_dir: Path, max_epochs: int, extra_callbacks: list[pl.Callback],
        extra_loggers: list[Logger], ckpt_path: str | None = None) -> None:
    timeout = timedelta(seconds=args.pg_timeout)
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, num_nodes=args.nodes, max_epochs=max_epochs,
        strategy=ElCheStrategy(mode=args.mode, timeout=timeout, snapshot_timeout=timeout, summary=False),
        callbacks=[StepDelay(), RankIdentity(str(out_dir)), *extra_callbacks],
        logger=[CallRecordingLogger(str(out_dir / "calls")), *extra_loggers],
        enable_checkpointing=bool(extra_callbacks), enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, default_root_dir=str(out_dir),
    )
    trainer.fit(CoverageModel(str(out_dir), n=SAMPLES, batch_size=BATCH_SIZE), ckpt_path=ckpt_path)


def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    root = Path(args.out_dir)
    try:
        checkpoint = ModelCheckpoint(dirpath=str(root / "ckpt"), save_last=True, every_n_epochs=1)
        fit(args, root / "first", 2, [checkpoint], [CSVLogger(str(root / "csv"), name="job")])
        fit(args, root / "resumed", 3, [], [], ckpt_path=str(root / "ckpt" / "last.ckpt"))
    finally:
        # Leave like a well-behaved job: a default group alive at exit can abort in c10d's destructors.
        if dist.is_initialized():
            dist.destroy_process_group()


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--devices", type=int, required=True, help="processes per node")
    parser.add_argument("--pg-timeout", type=float, default=30.0, help="process-group and snapshot timeout (s)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(parse_args(sys.argv[1:]))
