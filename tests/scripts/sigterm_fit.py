"""A 2-rank CPU fit launched with Lightning's popen launcher, in which rank 1 gets SIGTERM mid-window.

Run as ``python sigterm_fit.py OUT_DIR``; each rank writes ``exception<rank>.json`` when it stops.
"""

import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning.pytorch as pl  # noqa: E402
from callback_helpers import RecordRounds, StopAtStep  # noqa: E402
from model_helpers import RecordingModel  # noqa: E402

from lightning_elche import ElCheStrategy  # noqa: E402

if __name__ == "__main__":
    out_dir = sys.argv[1]
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        max_epochs=5,
        limit_val_batches=0,
        strategy=ElCheStrategy(timeout=timedelta(seconds=30)),
        callbacks=[StopAtStep(rank=1, step=9, sigterm=True, out_dir=out_dir), RecordRounds(out_dir)],
        enable_progress_bar=False,
        logger=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=out_dir,
    )
    trainer.fit(RecordingModel(out_dir, val=False))
    Path(out_dir, f"finished{trainer.global_rank}").write_text("fit returned without the stop")
