"""The batch that ``self.log`` infers its batch size from (the logger connector's results)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
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


SYNCED, UNSYNCED, TORCHMETRIC = "synced", "unsynced", "torchmetric"
"""The kinds of epoch metric a spec tags: ``self.log(..., sync_dist=True)`` of a tensor (the epoch's end
reduces it, a collective), one without it (each rank's own value, no collective), and a
``torchmetrics.Metric`` (its ``compute`` syncs its states over the metric's process group: a collective)."""


def epoch_metric_specs(trainer: Trainer) -> list[dict[str, Any]]:
    """This rank's epoch-level training metrics of the current epoch (``self.log(..., on_epoch=True)``
    of its training steps and batch hooks), in the order the epoch's end computes them, each tagged
    with its ``"kind"``: what :func:`add_missing_epoch_metrics` registers on a rank that lacks them.
    An unsynced one carries this rank's accumulated ``"state"`` (plain numbers: the specs travel
    pickled), a torchmetric its module attribute."""
    specs = []
    for key, metric in trainer.fit_loop.epoch_loop._results.valid_items():
        meta = metric.meta
        if not meta.on_epoch:
            continue
        kind = TORCHMETRIC if not metric.is_tensor else SYNCED if meta.sync.should else UNSYNCED
        spec = {"key": key, "kind": kind, "fx": meta.fx, "name": meta.name, "prog_bar": meta.prog_bar,
                "logger": meta.logger, "on_step": meta.on_step, "reduce_fx": meta.reduce_fx,
                "enable_graph": meta.enable_graph, "add_dataloader_idx": meta.add_dataloader_idx,
                "dataloader_idx": meta.dataloader_idx, "metric_attribute": meta.metric_attribute,
                "sync_dist": meta.sync.should, "rank_zero_only": meta.sync.rank_zero_only}
        if kind == UNSYNCED:
            # At a round, once per epoch that needs it: the value is read once, off the per-step path.
            spec["state"] = {"value": metric.value.tolist(), "dtype": metric.value.dtype,
                             "cumulated_batch_size": int(metric.cumulated_batch_size)
                             if meta.is_mean_reduction else None}
        specs.append(spec)
    return specs


def add_missing_epoch_metrics(trainer: Trainer, specs: list[dict[str, Any]]) -> list[str]:
    """Register the epoch metrics of ``specs`` this rank did not log in the current training epoch
    (it trained no batch of it), so that its epoch's end computes and logs the same metrics as the
    others, in the same collectives:

    * a synced one at its neutral value (nothing summed, no batch counted): the epoch's end reduces
      it on every rank, and this rank adds nothing to it;
    * an unsynced one with the spec's state (the rank that sent it: rank 0's, where it logged it):
      this rank logs that rank's value instead of none;
    * a torchmetric as this rank's own metric (the module's attribute of that name): it was not
      updated here, and its ``compute`` joins the metric's sync with its empty states, where the
      others would wait for this rank until the process group's timeout.

    The metrics of ``specs`` then come last, in its order (the order of the reduces: the
    same on every rank that is given the same ``specs``). Returns the keys added."""
    results = trainer.fit_loop.epoch_loop._results
    added = []
    for spec in specs:
        key = spec["key"]
        current = results.get(key)
        if current is not None and not current.has_reset:
            continue
        if current is None:
            current = results[key] = _registered(trainer, spec)
        if spec["kind"] == TORCHMETRIC:
            current.value = _module_metric(trainer, spec)
        else:
            current.to(trainer.strategy.root_device)
            if spec["kind"] == UNSYNCED:
                _take_state(current, spec["state"], trainer.strategy.root_device)
        current.has_reset = False  # reset: at its default (0, or -inf/inf for max/min), counting no batch
        added.append(key)
    if added:
        for spec in specs:
            results[spec["key"]] = results.pop(spec["key"])
    return added


def _registered(trainer: Trainer, spec: dict[str, Any]) -> Any:
    """A result of ``spec``'s metadata, as ``self.log`` would have registered it here (the same, so
    that the rank's own ``self.log`` of it in a later epoch updates this one)."""
    from lightning.pytorch.trainer.connectors.logger_connector.result import _Metadata, _ResultMetric, _Sync

    meta = _Metadata(fx=spec["fx"], name=spec["name"], prog_bar=spec["prog_bar"], logger=spec["logger"],
                     on_step=spec["on_step"], on_epoch=True, reduce_fx=spec["reduce_fx"],
                     enable_graph=spec["enable_graph"], add_dataloader_idx=spec["add_dataloader_idx"],
                     dataloader_idx=spec["dataloader_idx"], metric_attribute=spec["metric_attribute"])
    meta.sync = _Sync(_should=spec["sync_dist"], fn=trainer.strategy.reduce, rank_zero_only=spec["rank_zero_only"])
    return _ResultMetric(meta, is_tensor=spec["kind"] != TORCHMETRIC)


def _take_state(metric: Any, state: dict[str, Any], device: torch.device) -> None:
    metric.value = torch.tensor(state["value"], dtype=state["dtype"], device=device)
    if state["cumulated_batch_size"] is not None:
        metric.cumulated_batch_size = torch.tensor(state["cumulated_batch_size"], device=device)


def _module_metric(trainer: Trainer, spec: dict[str, Any]) -> Any:
    module, attribute = trainer.lightning_module, spec["metric_attribute"]
    try:
        return module.get_submodule(attribute)
    except AttributeError:
        raise RuntimeError(
            f"ElCheStrategy: the epoch metric {spec['name']!r} is the torchmetric {attribute!r} of the other ranks' "
            f"LightningModule, which this rank's {type(module).__name__} does not have: every rank must build the "
            "same module."
        ) from None
