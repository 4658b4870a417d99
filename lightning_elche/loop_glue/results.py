"""The batch that ``self.log`` infers its batch size from (the logger connector's results)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lightning.pytorch import Trainer


@contextmanager
def logging_batch(trainer: Trainer, batch: Any) -> Iterator[None]:
    """Inside, ``self.log`` without ``batch_size`` weighs its epoch means by ``batch``'s size (a micro-batch's
    samples, not the loader's whole batch); the loop's batch is back afterwards."""
    results = trainer._results
    if results is None:
        yield
        return
    outer, outer_size = results.batch, results.batch_size
    results.batch, results.batch_size = batch, None
    try:
        yield
    finally:
        results.batch, results.batch_size = outer, outer_size


def epoch_metric_specs(trainer: Trainer) -> list[dict[str, Any]]:
    """This rank's synced epoch-level training metrics of the current epoch (``self.log(...,
    on_epoch=True, sync_dist=True)`` of its training steps and batch hooks), in the order the epoch's
    end reduces them: what :func:`add_missing_epoch_metrics` registers on a rank that lacks them."""
    specs = []
    for key, metric in trainer.fit_loop.epoch_loop._results.valid_items():
        meta = metric.meta
        if metric.is_tensor and meta.on_epoch and meta.sync.should:
            specs.append({"key": key, "fx": meta.fx, "name": meta.name, "prog_bar": meta.prog_bar,
                          "logger": meta.logger, "on_step": meta.on_step, "reduce_fx": meta.reduce_fx,
                          "enable_graph": meta.enable_graph, "add_dataloader_idx": meta.add_dataloader_idx,
                          "dataloader_idx": meta.dataloader_idx, "metric_attribute": meta.metric_attribute,
                          "rank_zero_only": meta.sync.rank_zero_only})
    return specs


def add_missing_epoch_metrics(trainer: Trainer, specs: list[dict[str, Any]]) -> list[str]:
    """Register the epoch metrics of ``specs`` this rank did not log in the current training epoch
    (it trained no batch of it), at their neutral value (nothing summed, no batch counted): the
    epoch's end then reduces the same metrics on every rank, in the same collectives, and this rank
    adds nothing to them. The metrics of ``specs`` then come last, in its order (the order of the
    reduces: the same on every rank that is given the same ``specs``). Returns the keys added."""
    from lightning.pytorch.trainer.connectors.logger_connector.result import _Metadata, _ResultMetric, _Sync

    results = trainer.fit_loop.epoch_loop._results
    added = []
    for spec in specs:
        key = spec["key"]
        current = results.get(key)
        if current is not None and not current.has_reset:
            continue
        if current is None:
            meta = _Metadata(fx=spec["fx"], name=spec["name"], prog_bar=spec["prog_bar"], logger=spec["logger"],
                             on_step=spec["on_step"], on_epoch=True, reduce_fx=spec["reduce_fx"],
                             enable_graph=spec["enable_graph"], add_dataloader_idx=spec["add_dataloader_idx"],
                             dataloader_idx=spec["dataloader_idx"], metric_attribute=spec["metric_attribute"])
            meta.sync = _Sync(_should=True, fn=trainer.strategy.reduce, rank_zero_only=spec["rank_zero_only"])
            current = results[key] = _ResultMetric(meta, is_tensor=True)
        current.to(trainer.strategy.root_device)
        current.has_reset = False  # reset: at its default (0, or -inf/inf for max/min), counting no batch
        added.append(key)
    if added:
        for spec in specs:
            results[spec["key"]] = results.pop(spec["key"])
    return added
