"""One process of a 2-rank CPU job that is stopped by a signal (or killed) and resumed.

    python preempt_fit.py OUT_DIR --mode M --tag first --fault TERM --fault-rank 1 --fault-step 20
    python preempt_fit.py OUT_DIR --mode M --tag resumed --ckpt last

Under Lightning's popen launcher (``--devices 2``), torchrun or an emulated SLURM step. Checkpoints
go to ``OUT_DIR/ckpt`` (an ``ElCheCheckpoint`` with ``every_n_syncs`` when given, saving ``last``);
each rank logs every step it trained (see ``preemption_helpers``). ``--fault KILL`` kills the rank
only in the first attempt of a torchrun job (``TORCHELASTIC_RESTART_COUNT=0``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from preemption_helpers import (  # noqa: E402
    DelaySteps,
    SignalAtStep,
    SignalInPhase,
    SignalWhileSaving,
    StepLogModel,
    newest_last_checkpoint,
)

from lightning_elche import ElCheCheckpoint, ElCheStrategy  # noqa: E402


def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    out = Path(args.out_dir)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    tag = f"{args.tag}{attempt}" if "TORCHELASTIC_RUN_ID" in os.environ else args.tag
    callbacks: list[pl.Callback] = [
        DelaySteps(),
        ElCheCheckpoint(dirpath=str(out / "ckpt"), save_last=True, every_n_syncs=args.every_n_syncs,
                        every_n_epochs=1),
    ]
    if args.fault and (args.fault != "KILL" or attempt == 0):
        signum = getattr(signal, f"SIG{args.fault}")
        if args.fault_phase == "train":
            callbacks.append(SignalAtStep(str(out), args.fault_rank, args.fault_step, signum,
                                          after_rounds=args.fault_round))
        else:
            callbacks.append(SignalInPhase(str(out), args.fault_rank, signum, args.fault_phase, args.fault_epoch))
    if args.repeat_signal:
        callbacks.append(SignalWhileSaving(signal.SIGTERM))
    ckpt_path = args.ckpt
    if attempt > 0 and ckpt_path == "last":
        # Keep the checkpoint this attempt resumes from (later saves replace last*.ckpt).
        chosen = newest_last_checkpoint(out / "ckpt")
        if chosen is not None:
            ckpt_path = str(out / f"resumed-from-attempt{attempt}.ckpt")
            if int(os.environ.get("RANK", "0")) == 0:
                shutil.copy(chosen, ckpt_path + ".partial")
                os.replace(ckpt_path + ".partial", ckpt_path)
            while not Path(ckpt_path).exists():
                time.sleep(0.05)
    timeout = timedelta(seconds=60)
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, max_epochs=args.epochs, logger=False, callbacks=callbacks,
        strategy=ElCheStrategy(mode=args.mode, timeout=timeout, snapshot_timeout=timeout, summary=False),
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=2 if args.validate else 0,
        default_root_dir=str(out),
    )
    try:
        trainer.fit(StepLogModel(str(out), tag), ckpt_path=ckpt_path)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--mode", required=True)
    parser.add_argument("--tag", required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--every-n-syncs", type=int, default=None)
    parser.add_argument("--fault", choices=("TERM", "INT", "USR1", "KILL"), default=None)
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--fault-step", type=int, default=20)
    parser.add_argument("--fault-round", type=int, default=None, help="fault once this many syncs are done")
    parser.add_argument("--fault-phase", choices=("train", "validation", "epoch_end"), default="train",
                        help="where the fault comes: a training step (--fault-step/--fault-round), the first "
                             "validation batch or on_train_epoch_end of --fault-epoch")
    parser.add_argument("--fault-epoch", type=int, default=0)
    parser.add_argument("--validate", action="store_true", help="two validation batches after every epoch")
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--repeat-signal", action="store_true", help="SIGTERM again while the checkpoint is saved")
    main(parser.parse_args())
