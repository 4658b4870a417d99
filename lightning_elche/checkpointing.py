"""``ElCheCheckpoint``: Lightning's ``ModelCheckpoint`` that can also save every N ElChe syncs.

flodl's ``checkpoint_every`` in syncs. A sync checkpoint is taken inside an epoch, so it must hold
what a resumed fit needs to train the rest of that epoch exactly once:

* consensus weights: the round before the save is a *consensus round* (blocking and adopted with
  alpha 1, also in ``cpu_async``), so every replica holds the same parameters;
* ElChe's state (controller, guard, meta-controller, outer optimizer, counters), as at epoch ends;
* the epoch's data coverage: which picks every rank had *trained* by that round (not merely
  claimed: DataLoader prefetch claims ahead), gathered once at the save.

Every rank saves at the end of the batch whose optimizer step ran that round, where Lightning's
own step-checkpoints save (``on_train_batch_end``), so Lightning restores its loops exactly as for
``ModelCheckpoint(every_n_train_steps)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional, Union

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor

from lightning_elche.checks import require_int
from lightning_elche.cohort_callbacks import cohort_view
from lightning_elche.engine import RoundOutcome
from lightning_elche.loop_glue import monitor_candidates, save_checkpoint_now
from lightning_elche.strategy import ElCheStrategy


class ElCheCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` plus checkpoints every ``every_n_syncs`` ElChe syncs, inside epochs.

    Every argument but ``every_n_syncs`` is ``ModelCheckpoint``'s. With ``every_n_syncs=N`` a
    checkpoint is saved at the first consensus round at or after every N-th sync at which every
    rank still has data in the epoch (while a rank drains the epoch's last batches it waits in
    rounds and cannot reach the save; the checkpoint is then taken at the next eligible round).
    Epoch-end saving follows ``every_n_epochs`` as usual (``every_n_epochs=0`` turns it off).

    ``Trainer.fit(ckpt_path=...)`` from a sync checkpoint continues the same cadence and trains the
    rest of the interrupted epoch, each remaining sample once. ``{sync}`` can be used in
    ``filename`` (the sync count at the save).

    Args:
        every_n_syncs: save every this many syncs (``None``: epoch ends only, as ``ModelCheckpoint``).
            Sync checkpoints carry no fresh validation metric, so ``monitor`` must then be ``None``:
            add a separate ``ModelCheckpoint(monitor=...)`` for best-k at epoch ends.
    """

    def __init__(
        self,
        dirpath: Optional[Union[str, Path]] = None,
        filename: Optional[str] = None,
        monitor: Optional[str] = None,
        verbose: bool = False,
        save_last: Optional[Union[bool, Literal["link"]]] = None,
        save_top_k: int = 1,
        save_weights_only: bool = False,
        mode: str = "min",
        auto_insert_metric_name: bool = True,
        every_n_epochs: Optional[int] = None,
        save_on_train_epoch_end: Optional[bool] = None,
        enable_version_counter: bool = True,
        every_n_syncs: Optional[int] = None,
    ) -> None:
        if every_n_syncs is not None:
            every_n_syncs = require_int(
                f"ElCheCheckpoint(every_n_syncs={every_n_syncs!r})", every_n_syncs, 1,
                "expected an integer >= 1 or None",
            )
        if every_n_syncs is not None and monitor is not None:
            raise ValueError(
                f"ElCheCheckpoint(every_n_syncs={every_n_syncs}, monitor={monitor!r}) is invalid: sync checkpoints "
                "are taken inside epochs, where validation metrics are not fresh. Leave monitor=None and add a "
                "separate ModelCheckpoint(monitor=...) for the best checkpoints at epoch ends."
            )
        super().__init__(
            dirpath=dirpath, filename=filename, monitor=monitor, verbose=verbose, save_last=save_last,
            save_top_k=save_top_k, save_weights_only=save_weights_only, mode=mode,
            auto_insert_metric_name=auto_insert_metric_name, every_n_epochs=every_n_epochs,
            save_on_train_epoch_end=save_on_train_epoch_end, enable_version_counter=enable_version_counter,
        )
        self.every_n_syncs = every_n_syncs
        self._strategy: Optional[ElCheStrategy] = None
        self._next_due = 0
        self._save_now = False

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if self.every_n_syncs is None or stage != "fit":
            return
        strategy = trainer.strategy
        if not isinstance(strategy, ElCheStrategy):
            raise MisconfigurationException(
                f"ElCheCheckpoint(every_n_syncs={self.every_n_syncs}) needs ElCheStrategy; the Trainer runs "
                f"{type(strategy).__name__}. Use every_n_epochs / every_n_train_steps with other strategies."
            )
        self._strategy = strategy
        strategy.add_round_listener(self._on_round)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        progress = self._strategy.progress if self._strategy is not None else None
        if progress is None:
            return
        assert self._strategy is not None and self.every_n_syncs is not None
        # Continue the cadence of a resumed fit: the next multiple after the restored sync count.
        self._next_due = (progress.rounds // self.every_n_syncs + 1) * self.every_n_syncs
        self._save_now = False
        self._strategy.request_consensus(at_round=self._next_due)  # no round is in flight yet

    def _on_round(self, outcome: RoundOutcome, metrics: dict[str, float]) -> None:
        # Runs on every rank with the same outcome, so every rank takes the same decisions.
        assert self._strategy is not None and self.every_n_syncs is not None
        eligible = (
            outcome.consensus
            and not outcome.ends_window_sequence
            and not any(report.out_of_data for report in outcome.reports)
        )
        if outcome.index >= self._next_due and eligible:
            self._save_now = True
            self._next_due = (outcome.index // self.every_n_syncs + 1) * self.every_n_syncs
            # The round that falls due flushes to the consensus first. After this (blocking) round no
            # rank has started another, so the next index is safe to name.
            self._strategy.request_consensus(at_round=self._next_due)
        elif outcome.index >= self._next_due:
            # Due but not eligible (a rank is out of data, or the consensus came too late): the next
            # round a rank can still start after this outcome, on every rank, is two past it.
            self._strategy.request_consensus(at_round=outcome.index + 2)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if not self._save_now:
            return
        self._save_now = False
        assert self._strategy is not None
        engine = self._strategy.engine
        assert engine is not None
        with self._strategy.sync_point():
            # Every rank is at this round: the cohort step and rank 0's metrics name the file on each.
            save_checkpoint_now(self, cohort_view(trainer, engine.state.cohort_step, share_metrics=True))

    def _monitor_candidates(self, trainer: Trainer) -> dict[str, Tensor]:
        # Overrides ModelCheckpoint's: adds ``{sync}`` for filenames.
        candidates = monitor_candidates(self, trainer)
        progress = trainer.strategy.progress if isinstance(trainer.strategy, ElCheStrategy) else None
        if progress is not None and "sync" not in candidates:
            candidates["sync"] = torch.tensor(progress.rounds)
        return candidates

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._strategy is not None:
            self._strategy.remove_round_listener(self._on_round)
            self._strategy = None
        super().teardown(trainer, pl_module, stage)
