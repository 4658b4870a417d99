"""Lightning's rank-dependent state after a membership change."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar


class LightningRankView:
    """Lightning's rank-dependent state as a holder of a membership change: rank-zero-only logging,
    the progress bar and the evaluation loaders follow the rank's new number (``rank()``; the
    strategy's ``global_rank`` and ``world_size`` already answer it)."""

    def __init__(self, trainer: Trainer, rank: Callable[[], int]) -> None:
        self.trainer = trainer
        self.rank = rank

    def apply_change(self, change: Any) -> None:
        renumber_lightning_ranks(self.trainer, self.rank())


def renumber_lightning_ranks(trainer: Trainer, global_rank: int) -> None:
    """After a regroup: rank-zero-only logging, the progress bar and the evaluation loaders follow
    the rank's new number (``strategy.global_rank``/``world_size`` already answer it)."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
    from lightning.pytorch.utilities.rank_zero import rank_zero_only
    from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

    for rank_zero_only_fn in (rank_zero_only, fabric_rank_zero_only, utils_rank_zero_only):
        rank_zero_only_fn.rank = global_rank  # type: ignore[attr-defined]  # set by Lightning, read by every rank_zero_*
    bar = trainer.progress_bar_callback
    if global_rank == 0 and isinstance(bar, (RichProgressBar, TQDMProgressBar)) and bar.is_disabled:
        # Lightning disabled it at setup on every rank but 0: the new rank 0 shows it from here on,
        # with the display the bar builds when training starts.
        bar.enable()
        if isinstance(bar, RichProgressBar):
            bar._init_progress(trainer)
        elif isinstance(bar, TQDMProgressBar):
            bar.train_progress_bar = bar.init_train_tqdm()
            total = bar.total_train_batches
            bar.train_progress_bar.total = total if math.isfinite(total) else None
    # Validation shards were cut for the old ranks (DistributedSampler): cut them again for the new.
    trainer.fit_loop.epoch_loop.val_loop._combined_loader = None
