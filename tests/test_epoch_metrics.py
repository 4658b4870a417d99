"""A rank that trained no batch of an epoch ends it as the others do.

In-process: it registers the epoch metrics its peers logged (``loop_glue.results``): the epoch's end
then reduces the same synced metrics on every rank, in one order, and that rank adds nothing to their
values. Real processes (a joiner admitted to an epoch the members then claim whole, ``--join-when-dry``
of ``scripts/fault_fit.py`` with ``--epoch-metrics``): every rank logs the same epoch metrics of each
kind at the same logger step, a torchmetric's sync is not left waiting, and the schedulers count the
steps taken.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torchmetrics
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

from lightning_elche.loop_glue import add_missing_epoch_metrics, epoch_metric_specs
from lightning_elche.loop_glue.results import SYNCED, TORCHMETRIC, UNSYNCED


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
    module = torch.nn.Module()
    module.total = torchmetrics.SumMetric()  # a rank's own torchmetric, the module's attribute
    return SimpleNamespace(strategy=strategy, fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(_results=results)),
                           lightning_module=module)


def log(trainer: Any, name: str, value: float, **kwargs: Any) -> None:
    trainer.fit_loop.epoch_loop._results.log("training_step", name, torch.tensor(value), on_step=False,
                                             on_epoch=True, sync_dist_fn=trainer.strategy.reduce, batch_size=4,
                                             **kwargs)


def log_total(trainer: Any, samples: float) -> None:
    total = trainer.lightning_module.total
    total.update(samples)
    trainer.fit_loop.epoch_loop._results.log("training_step", "total", total, on_step=False, on_epoch=True,
                                             sync_dist_fn=trainer.strategy.reduce, metric_attribute="total")


def test_the_rank_without_a_batch_registers_each_kind_of_epoch_metric() -> None:
    member, joiner = rank(), rank()
    log(member, "loss", 2.0, sync_dist=True)
    log(member, "local", 1.0)  # not synced: no collective; the rank without a batch logs the member's
    log(member, "local", 4.0)
    log_total(member, 8.0)
    log(member, "peak", 3.0, sync_dist=True, reduce_fx="max")
    specs = epoch_metric_specs(member)
    assert [(s["key"], s["kind"]) for s in specs] == [
        ("training_step.loss", SYNCED), ("training_step.local", UNSYNCED), ("training_step.total", TORCHMETRIC),
        ("training_step.peak", SYNCED)]
    keys = [s["key"] for s in specs]
    assert add_missing_epoch_metrics(joiner, specs) == keys
    results = joiner.fit_loop.epoch_loop._results
    assert [key for key, _ in results.valid_items()] == keys
    loss, peak = results["training_step.loss"], results["training_step.peak"]
    assert float(loss.value) == 0.0 and int(loss.cumulated_batch_size) == 0  # no sum, no batch
    assert float(peak.value) == float("-inf")  # neutral for a max
    assert float(results["training_step.local"].compute()) == 2.5  # the member's mean, not none
    # Its own torchmetric, not updated here: its compute joins the metric's sync with empty states.
    assert results["training_step.total"].value is joiner.lightning_module.total
    assert float(results["training_step.total"].compute()) == 0.0
    loss.compute(), peak.compute()
    # The same reduces as on the member (mean: the value and the batch count; max), in the same order.
    member_results = member.fit_loop.epoch_loop._results
    member_results["training_step.loss"].compute(), member_results["training_step.peak"].compute()
    assert joiner.strategy.calls == member.strategy.calls == ["mean", "mean", "max"]
    # The joiner logs the metrics itself in the next epoch: the registered ones are the same metrics.
    results.reset()
    log(joiner, "loss", 5.0, sync_dist=True)
    log(joiner, "local", 6.0)
    log_total(joiner, 3.0)
    assert float(results["training_step.loss"].value) == 20.0
    assert float(results["training_step.local"].compute()) == 6.0
    assert float(results["training_step.total"].compute()) == 3.0
    assert add_missing_epoch_metrics(member, specs) == []  # a rank that logged them adds nothing


def rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_epoch_ends(out: Path, ranks: tuple[int, ...], epochs: int, samples: int, batch: int) -> None:
    """Every rank of ``ranks`` (original ranks; the joiner's member id) logged, at each epoch's end it
    took part in, the same epoch metrics, at the logger step of its own last step; its step counters
    agree; its per-step schedule moves with the cohort step and its per-epoch one sits at the epoch."""
    records = {rank: rows(out / f"epoch-ends-rank{rank}.jsonl") for rank in ranks}
    ends = {rank: [r for r in records[rank] if not r["start"]] for rank in ranks}
    # Each per-step schedule starts at the cohort step: a joiner too (it took rank 0's from inside the
    # admission batch, before Lightning stepped it for that batch, and was one behind to the end).
    offsets = {rank: next(r["schedulers"]["per_step"] - r["cohort_step"] for r in records[rank] if r["start"])
               for rank in ranks}
    assert all(offset == 0 for offset in offsets.values()), offsets
    logged = {rank: [r for r in rows(out / f"logged-rank{rank}.jsonl") if "epoch_synced" in r["metrics"]]
              for rank in ranks}
    for rank in ranks:
        assert [e["epoch"] for e in ends[rank]] == [int(r["metrics"]["epoch"]) for r in logged[rank]], rank
        for end, row in zip(ends[rank], logged[rank], strict=True):
            where = f"rank {rank}, epoch {end['epoch']}: {end} {row}"
            assert row["step"] == end["global_step"] - 1, where  # the epoch end logs at its last step
            assert end["batches_that_stepped"] == end["global_step"], where
            assert end["schedulers"]["per_step"] == end["cohort_step"], where
            assert end["schedulers"]["per_epoch"] == end["epoch"] + 1, where
            metrics = row["metrics"]
            assert metrics["epoch_synced"] == samples // batch, where
            assert metrics["epoch_torchmetric"] == samples, where
            assert metrics["epoch_unsynced"] == end["epoch"], where
    by_epoch = {rank: {int(r["metrics"]["epoch"]): r["metrics"] for r in logged[rank]} for rank in ranks}
    for epoch in range(epochs):
        seen = {rank: by_epoch[rank][epoch] for rank in ranks if epoch in by_epoch[rank]}
        assert len({json.dumps(m, sort_keys=True) for m in seen.values()}) == 1, (epoch, seen)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_rank_without_a_batch_ends_the_epoch_with_the_same_metrics_steps_and_schedules(tmp_path: Path) -> None:
    from test_join import BATCH, DRY, JOINER, SAMPLES, check_grown, run_join_job

    extra = ("--epoch-metrics", *DRY)
    job = run_join_job(tmp_path, "cpu_cadence", joiner_extra=("--request-once-held", *extra), cohort_extra=extra)
    dry = json.loads((tmp_path / f"dry-rank{JOINER}.json").read_text())
    assert dry["dry"], dry  # the case: the joiner's first iterator of its epoch gave no batch
    check_grown(job, joins=[[JOINER]], epochs=2)
    # A torchmetric's sync the joiner did not join held every rank's epoch end for the whole process
    # group's timeout (120 s); then the fit failed.
    for rank in (0, 1, JOINER):
        ends = [r["epoch_end_s"] for r in rows(tmp_path / f"epoch-ends-rank{rank}.jsonl") if not r["start"]]
        assert ends and max(ends) < 60, (rank, ends)
    check_epoch_ends(tmp_path, (0, 1, JOINER), 2, SAMPLES, BATCH)
    epoch = dry["epoch"]
    start, end = (next(r for r in rows(tmp_path / f"epoch-ends-rank{JOINER}.jsonl") if r["epoch"] == epoch
                       and r["start"] is first) for first in (True, False))
    # No step in that epoch: its own plateau schedule (stepped per local step) did not move.
    assert end["schedulers"]["plateau_per_step"] == start["schedulers"]["plateau_per_step"], (start, end)
    assert end["global_step"] == start["global_step"], (start, end)
