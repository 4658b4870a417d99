"""A rank that trained no batch of an epoch registers the synced epoch metrics its peers logged
(``loop_glue.results``): the epoch's end then reduces the same metrics on every rank, in one order,
and that rank adds nothing to their values."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

from lightning_elche.loop_glue import add_missing_epoch_metrics, epoch_metric_specs


class SummingStrategy:
    """``reduce`` over two ranks whose values the test sets (this rank's and a peer's)."""

    root_device = torch.device("cpu")

    def __init__(self) -> None:
        self.calls: list[str] = []

    def reduce(self, tensor: torch.Tensor, group: Any = None, reduce_op: Any = "mean") -> torch.Tensor:
        self.calls.append(str(reduce_op))
        return tensor


def rank() -> Any:
    strategy = SummingStrategy()
    results = _ResultCollection(training=True)
    return SimpleNamespace(strategy=strategy, fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(_results=results)))


def log(trainer: Any, name: str, value: float, **kwargs: Any) -> None:
    trainer.fit_loop.epoch_loop._results.log("training_step", name, torch.tensor(value), on_step=False,
                                             on_epoch=True, sync_dist_fn=trainer.strategy.reduce, batch_size=4,
                                             **kwargs)


def test_the_rank_without_a_batch_reduces_the_same_metrics_with_nothing_in_them() -> None:
    member, joiner = rank(), rank()
    log(member, "loss", 2.0, sync_dist=True)
    log(member, "local", 1.0)  # not synced: no collective, nothing to mirror
    log(member, "peak", 3.0, sync_dist=True, reduce_fx="max")
    specs = epoch_metric_specs(member)
    assert [s["key"] for s in specs] == ["training_step.loss", "training_step.peak"]
    assert add_missing_epoch_metrics(joiner, specs) == ["training_step.loss", "training_step.peak"]
    results = joiner.fit_loop.epoch_loop._results
    assert [key for key, _ in results.valid_items()] == ["training_step.loss", "training_step.peak"]
    loss, peak = results["training_step.loss"], results["training_step.peak"]
    assert float(loss.value) == 0.0 and int(loss.cumulated_batch_size) == 0  # no sum, no batch
    assert float(peak.value) == float("-inf")  # neutral for a max
    loss.compute(), peak.compute()
    # The same reduces as on the member (mean: the value and the batch count; max), in the same order.
    member_results = member.fit_loop.epoch_loop._results
    member_results["training_step.loss"].compute(), member_results["training_step.peak"].compute()
    assert joiner.strategy.calls == member.strategy.calls == ["mean", "mean", "max"]
    # The joiner logs the metric itself in the next epoch: the registered one is the same metric.
    results.reset()
    log(joiner, "loss", 5.0, sync_dist=True)
    assert float(results["training_step.loss"].value) == 20.0
    assert add_missing_epoch_metrics(member, specs) == []  # a rank that logged them adds nothing
