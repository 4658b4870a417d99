"""A model of the micro-batch fits that checks, at every optimizer step, the accumulated gradient
against the whole batches' gradient, and the loss Lightning got against the whole batch's loss; a
logger and a callback that keep the micro-batch metrics and the end-of-fit summary of a fit."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from model_helpers import RecordingModel
from multirank_helpers import JsonLinesLogger
from torch import nn


class MicroBatchCheckModel(RecordingModel):
    """``RecordingModel`` plus, per rank, the largest gradient and loss differences from the reference
    (the same batches trained whole), how many training_step calls it took and the size of each batch."""

    def __init__(self, out_dir: str, **kwargs: Any) -> None:
        super().__init__(out_dir, **kwargs)
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.reference_loss: float = 0.0
        self.grad_diff = 0.0
        self.loss_diff = 0.0
        self.step_calls = 0
        self.checked_steps = 0
        self.batch_sizes: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.step_calls += 1
        return super().training_step(batch, batch_idx)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        _, x, y = batch
        self.batch_sizes.append(len(x))
        self.pending.append((x, y))
        with torch.no_grad():
            self.reference_loss = float(nn.functional.mse_loss(self(x), y))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        seen = float(outputs["loss"]) * self.trainer.accumulate_grad_batches  # Lightning divides it
        self.loss_diff = max(self.loss_diff, abs(seen - self.reference_loss))

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        net = copy.deepcopy(self.net)
        accumulate = self.trainer.accumulate_grad_batches
        for x, y in self.pending:
            (nn.functional.mse_loss(net(x), y) / accumulate).backward()
        for ours, reference in zip(self.net.parameters(), net.parameters(), strict=True):
            assert ours.grad is not None
            self.grad_diff = max(self.grad_diff, float((ours.grad - reference.grad).abs().max()))
        self.pending = []
        self.checked_steps += 1

    def on_fit_end(self) -> None:
        super().on_fit_end()
        path = Path(self.out_dir, f"rank{self.global_rank}.json")
        record = json.loads(path.read_text())
        record.update(grad_diff=self.grad_diff, loss_diff=self.loss_diff, step_calls=self.step_calls,
                      checked_steps=self.checked_steps, batch_sizes=self.batch_sizes)
        path.write_text(json.dumps(record))


class MetricsFile(JsonLinesLogger):
    """Appends every ``log_metrics`` call (the ``elche/micro_batch/*`` values) of its process to
    ``metrics-rank<r>.jsonl``; ElChe logs its round metrics on rank 0."""

    file_stem = "metrics"
    rank_outside_a_group = 0

    def line(self, metrics: dict[str, float], step: Optional[int]) -> dict[str, Any]:
        micro = {k: v for k, v in metrics.items() if k.startswith("elche/micro_batch")}
        return {"step": step, "micro_batch": micro, "syncs": metrics.get("elche/syncs")}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class SummaryFile(Callback):
    """Keeps what rank 0 logs through Lightning's logger during the fit and writes the end-of-fit
    summary (``ElChe summary: ...``) to ``summary-rank<r>.txt`` after the strategy printed it."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self._handler: Optional[_Lines] = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._handler = _Lines()
        logging.getLogger("lightning.pytorch").addHandler(self._handler)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        assert self._handler is not None
        logging.getLogger("lightning.pytorch").removeHandler(self._handler)
        summary = [line for line in self._handler.lines if line.startswith("ElChe summary")]
        Path(self.out_dir, f"summary-rank{trainer.global_rank}.txt").write_text("\n".join(summary))
