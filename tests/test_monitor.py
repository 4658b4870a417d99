"""ElCheMonitor: record-log ring, reductions, sub-epoch reports, timeline, dashboard (in a real headless
Chromium), the callback's flow driven in-process, and one 2-process run with the monitor attached."""

from __future__ import annotations

import csv
import html.parser
import json
import math
import os
import shutil
import struct
import subprocess
import warnings
import zlib
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from model_helpers import RecordingModel
from process_helpers import load_records

from lightning_elche import ElCheConfig, ElCheStrategy
from lightning_elche.monitor import (
    ElCheMonitor,
    RecordLog,
    ReportScheduler,
    Timeline,
    dashboard_data,
    dashboard_from_log,
    epoch_rollup,
    read_records,
    reduce_values,
    render_dashboard,
    rollup,
)
from lightning_elche.monitor.record import CORE_REDUCTIONS, MemoryRing, validate_reductions
from lightning_elche.monitor.reports import ReportAccumulator
from lightning_elche.testing import Throttle

ARTIFACTS = os.environ.get("ELCHE_TEST_ARTIFACTS")  # set to keep dashboards and screenshots


def keep(path: Path, name: str) -> None:
    if ARTIFACTS:
        os.makedirs(ARTIFACTS, exist_ok=True)
        shutil.copy(path, os.path.join(ARTIFACTS, name))


# -- record log: a drop-oldest ring with the meta record first ---------------------------------


def test_record_log_is_a_ring_capped_at_max_bytes_keeping_meta_and_the_newest_records(tmp_path):
    path = tmp_path / "rank0.jsonl"
    cap = 8192
    log = RecordLog(path, {"world_size": 2, "config": {"mode": "nccl_cadence"}}, max_bytes=cap)
    written = 0
    for i in range(2000):
        log.append({"kind": "sync", "sync": i, "metrics": {"loss": 1.0 / (i + 1), "pad": "x" * (i % 50)}})
        written += 1
        assert path.stat().st_size <= cap, f"record {i} grew the file past its cap"
        assert log.size == path.stat().st_size
    log.close()
    records = read_records(path)
    assert records[0]["kind"] == "meta" and records[0]["world_size"] == 2
    syncs = [r["sync"] for r in records[1:]]
    assert syncs == list(range(syncs[0], 2000)), "the ring must keep a contiguous run of the newest records"
    assert records[0]["dropped"] == syncs[0] == log.dropped > 0
    assert all(r["v"] == 1 for r in records)
    # Amortised: every compaction frees a quarter of the cap at least.
    total_bytes = sum(len(json.dumps(r)) for r in records[1:]) / len(syncs) * written
    assert 0 < log.compactions <= total_bytes / (0.2 * cap) + 1


def test_memory_ring_keeps_the_newest_records_within_its_byte_cap():
    ring = MemoryRing(max_bytes=4096)
    for i in range(3000):
        ring.append({"kind": "sync", "sync": i})
    kept = [r["sync"] for r in ring]
    assert kept == list(range(kept[0], 3000)) and ring.dropped == kept[0] > 0
    assert sum(len(json.dumps(r, separators=(",", ":"))) + 1 for r in ring) <= 4096
    assert len(ring) == len(kept)


def test_record_log_drops_a_record_larger_than_the_cap_and_writes_strict_json(tmp_path):
    log = RecordLog(tmp_path / "r.jsonl", {"x": 1}, max_bytes=4096)
    log.append({"kind": "sync", "sync": 1, "loss": float("nan"), "rate": float("inf"), "t": torch.tensor(2.5)})
    log.append({"kind": "sync", "sync": 2, "blob": "y" * 10_000})
    log.append({"kind": "sync", "sync": 3})
    log.close()
    text = (tmp_path / "r.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    records = read_records(tmp_path / "r.jsonl")
    assert [r.get("sync") for r in records] == [None, 1, 3]
    assert records[1]["loss"] is None and records[1]["t"] == 2.5
    assert log.dropped == 1


def test_record_log_io_errors_warn_once_and_never_raise(tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    with pytest.warns(RuntimeWarning, match="record log"):
        log = RecordLog(blocker / "rank0.jsonl", {}, max_bytes=4096)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        log.append({"kind": "sync"})  # silently skipped
        log.close()

    log = RecordLog(tmp_path / "ok.jsonl", {}, max_bytes=4096)

    class Broken:
        def write(self, _: bytes) -> None:
            raise OSError(28, "No space left on device")

        def close(self) -> None:
            pass

    log._file = Broken()
    with pytest.warns(RuntimeWarning, match="No space left"):
        log.append({"kind": "sync", "sync": 1})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        log.append({"kind": "sync", "sync": 2})
    assert log.failed


# -- reductions --------------------------------------------------------------------------------


def test_reduce_values_follow_the_declared_reduction():
    children = [(1.0, 3), (3.0, 1), (100.0, 0), (None, 5)]
    assert reduce_values(children, "mean") == pytest.approx((1.0 * 3 + 3.0 * 1) / 4)  # zero work excluded
    assert reduce_values(children, "sum") == 104.0
    assert reduce_values(children, "max") == 100.0
    assert reduce_values(children, "min") == 1.0
    assert reduce_values(children, "last") == 1.0  # the value of the child with the most work
    assert reduce_values([(7.0, 0), (8.0, 0)], "mean") is None  # no work: absent, never zero
    assert reduce_values([(None, 4)], "sum") is None
    assert reduce_values([(float("nan"), 1), (2.0, 1)], "sum") == 2.0
    assert reduce_values([(5.0, 2), (6.0, 2)], "last") == 5.0  # tie: the first child


def test_rollup_has_fixed_core_reductions_and_declared_user_reductions():
    children = [
        {"work": 30, "metrics": {"loss": 1.0, "samples_per_s": 300.0, "batch_share": 0.75, "compute_s": 1.0},
         "scalars": {"tokens": 100.0, "acc": 0.5, "loss": 9.0, "peak_mem": 3.0}},
        {"work": 10, "metrics": {"loss": 2.0, "samples_per_s": 100.0, "batch_share": 0.25, "compute_s": 1.2},
         "scalars": {"tokens": 50.0, "acc": 0.9, "loss": 1.0}},
    ]
    out = rollup(children, {"tokens": "sum", "peak_mem": "max", "loss": "min"})
    m, s = out["metrics"], out["scalars"]
    assert m["loss"] == pytest.approx((1.0 * 30 + 2.0 * 10) / 40)  # core loss: work-weighted mean
    assert m["samples_per_s"] == 400.0 and m["batch_share"] == 1.0 and m["compute_s"] == 1.2
    assert s["tokens"] == 150.0
    assert s["acc"] == pytest.approx((0.5 * 30 + 0.9 * 10) / 40)  # undeclared: work-weighted mean
    assert s["peak_mem"] == 3.0  # reported by one rank only
    assert s["loss"] == 1.0  # the user's own "loss" scalar follows its declaration; the core key does not
    assert "divergence" not in m and "missing" not in s  # unreported keys are absent
    assert CORE_REDUCTIONS["samples_per_s"] == CORE_REDUCTIONS["batch_share"] == "sum"
    assert CORE_REDUCTIONS["loss"] == "mean"


def test_epoch_rollup_summarises_each_rank_then_reduces_across_ranks():
    rank0 = [{"work": 10, "scalars": {"acc": 0.5, "tokens": 100.0, "peak": 1.0, "lr": 0.1}},
             {"work": 30, "scalars": {"acc": 0.7, "tokens": 400.0, "peak": 3.0, "lr": 0.2}}]
    rank1 = [{"work": 10, "scalars": {"acc": 0.9, "tokens": 150.0, "peak": 2.0, "lr": 0.3}},
             {"work": 0, "scalars": {}}]
    out = epoch_rollup([rank0, rank1], {"tokens": "sum", "peak": "max", "lr": "last"})
    assert out["acc"] == pytest.approx((0.5 * 10 + 0.7 * 30 + 0.9 * 10) / 50)
    assert out["tokens"] == 550.0  # each rank's latest count, summed
    assert out["peak"] == 3.0
    assert out["lr"] == 0.2  # the busiest rank's latest value
    assert epoch_rollup([[], []]) == {}


def test_scalar_reductions_and_other_arguments_are_validated():
    assert validate_reductions({"tokens": "sum"}) == {"tokens": "sum"}
    with pytest.raises(ValueError, match=r"scalar_reductions\['tokens'\]='total'.*mean, sum, max, min, last"):
        ElCheMonitor(scalar_reductions={"tokens": "total"})
    with pytest.raises(ValueError, match="dashboard_theme='blue'"):
        ElCheMonitor(dashboard_theme="blue")
    with pytest.raises(ValueError, match="max_log_size=100"):
        ElCheMonitor(max_log_size=100)
    with pytest.raises(ValueError, match="reports_per_epoch=-1"):
        ElCheMonitor(reports_per_epoch=-1)
    assert ElCheMonitor(max_log_size=0).max_log_size == 32 * 1024 * 1024
    assert ElCheMonitor(dashboard_theme="DARK").dashboard_theme == "dark"


def test_setup_refuses_a_strategy_that_is_not_elche(tmp_path):
    monitor = ElCheMonitor()
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, callbacks=[monitor], default_root_dir=tmp_path,
                         enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(TypeError, match="ElCheMonitor .*needs Trainer\\(strategy=ElCheStrategy.*SingleDeviceStrategy"):
        monitor.setup(trainer, RecordingModel(str(tmp_path)), "fit")


def write_cli_config(tmp_path: Path, reductions: str) -> Path:
    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n"
        "  accelerator: cpu\n"
        "  devices: 1\n"
        "  logger: false\n"
        "  callbacks:\n"
        "    - class_path: lightning_elche.monitor.ElCheMonitor\n"
        "      init_args:\n"
        f"        record_log_dir: {tmp_path / 'log'}\n"
        "        max_log_size: 1048576\n"
        "        dashboard_theme: dark\n"
        "        reports_per_epoch: 4\n"
        f"        scalar_reductions: {reductions}\n"
        f"        timeline: {tmp_path / 'trace.json'}\n"
    )
    return config


def test_lightning_cli_builds_the_monitor_from_yaml(tmp_path, monkeypatch):
    from lightning.pytorch.cli import LightningCLI

    monkeypatch.setattr("sys.argv", ["train.py"])

    config = write_cli_config(tmp_path, "{tokens: sum, peak_mem_gb: max}")
    cli = LightningCLI(RecordingModel, run=False, save_config_callback=None, seed_everything_default=False,
                       args=["--config", str(config), "--model.out_dir", str(tmp_path)])
    monitor = next(c for c in cli.trainer.callbacks if isinstance(c, ElCheMonitor))
    assert monitor.scalar_reductions == {"tokens": "sum", "peak_mem_gb": "max"}
    assert monitor.dashboard_theme == "dark" and monitor.reports_per_epoch == 4 and monitor.max_log_size == 1048576
    assert monitor.record_log_dir == str(tmp_path / "log") and monitor.timeline == str(tmp_path / "trace.json")
    bad = write_cli_config(tmp_path, "{tokens: total}")
    with pytest.raises(SystemExit):
        LightningCLI(RecordingModel, run=False, save_config_callback=None, seed_everything_default=False,
                     args=["--config", str(bad), "--model.out_dir", str(tmp_path)])


def test_pending_scalars_thin_by_sync_index_to_a_bounded_list(monkeypatch):
    import lightning_elche.monitor.callback as callback

    monkeypatch.setattr(callback, "MAX_PENDING", 10)
    monitor = ElCheMonitor()
    for i in range(1, 101):
        monitor._keep_pending({"sync": i, "t": float(i), "work": 1, "scalars": {"a": 1.0}})
    kept = [e["sync"] for e in monitor._pending]
    assert len(kept) <= 10 and kept == list(range(monitor._pending_stride, 101, monitor._pending_stride))


def test_monitor_pickles_without_its_run_state():
    import pickle

    monitor = ElCheMonitor(record_log_dir="x", scalar_reductions={"a": "max"})
    monitor._pending.append({"sync": 1})
    copy = pickle.loads(pickle.dumps(monitor))
    assert copy.record_log_dir == "x" and copy.scalar_reductions == {"a": "max"} and copy._pending == []


# -- sub-epoch reports -------------------------------------------------------------------------


def test_report_scheduler_fires_at_most_n_per_epoch_and_one_per_sync():
    s = ReportScheduler(4)
    s.start_epoch(100)
    fired = [s.add(10) for _ in range(10)]
    assert fired.count(True) == 4
    assert [i for i, f in enumerate(fired) if f] == [2, 4, 7, 9]  # work 30, 50, 80, 100
    assert not s.add(50)  # capped at n
    s.start_epoch(100)
    assert s.add(100) and s.fired == 1  # one per sync even when several are due
    assert s.add(0) and s.add(0) and s.add(0) and not s.add(0)
    with pytest.raises(ValueError, match="reports_per_epoch"):
        ReportScheduler(0)


def test_report_accumulator_means_over_the_interval_and_leaves_idle_ranks_out():
    acc = ReportAccumulator(2)
    acc.add([3, 0], [48, 0], [0.3, 0.0], [6.0, 0.0], [0.01, 0.02])
    acc.add([3, 0], [48, 0], [0.3, 0.0], [3.0, 0.0], [0.01, 0.02])
    p = acc.payload()
    assert p["elche/report/loss"] == 1.5 and p["elche/report/loss/rank0"] == 1.5
    assert "elche/report/loss/rank1" not in p and "elche/report/samples_per_s/rank1" not in p
    assert p["elche/report/batch_share/rank1"] == 0.0
    assert p["elche/report/samples_per_s"] == pytest.approx(160.0)


# -- timeline ----------------------------------------------------------------------------------


def test_timeline_is_a_chrome_trace_with_rank_slices_and_events(tmp_path):
    tl = Timeline(2)
    tl.epoch_start(0, 0.0)
    tl.round(1, 1.0, 0, [30, 10], [480, 160], [0.9, 0.95], anchor=10, batch_share=[0.75, 0.25])
    tl.round(2, 2.0, 0, [30, 10], [480, 160], [0.8, 0.97], anchor=14, batch_share=[0.8, 0.2])
    tl.validation(2.0, 2.5, {"val_loss": float("nan")})
    tl.epoch_end(0, 2.5)
    path = tmp_path / "trace.json"
    tl.write(path, {"world_size": 2})
    trace = json.loads(path.read_text())  # strict JSON
    events = trace["traceEvents"]
    assert {e["ph"] for e in events} <= {"X", "i", "M"}
    names = {(e["name"], e["pid"]) for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {("process_name", 0), ("process_name", 1)}
    syncs = [e for e in events if e["name"] == "sync"]
    assert len(syncs) == 4 and {e["pid"] for e in syncs} == {0, 1}
    for e in events:
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0
    window1 = [e for e in events if e["name"] == "window" and e["args"]["sync"] == 1]
    assert {(e["pid"], e["dur"]) for e in window1} == {(0, 900_000.0), (1, 950_000.0)}
    first_sync0 = next(e for e in syncs if e["pid"] == 0)
    assert first_sync0["ts"] == 900_000.0 and first_sync0["dur"] == 100_000.0  # waits for rank 1
    anchor = [e for e in events if e["name"] == "anchor_changed"]
    assert len(anchor) == 1 and anchor[0]["args"]["from"] == 10 and anchor[0]["args"]["to"] == 14
    throttle = [e for e in events if e["name"] == "throttle"]
    assert len(throttle) == 1 and throttle[0]["pid"] == 1  # entering the state once, not every round
    assert [e["name"] for e in events if e.get("cat") == "epoch" and e["ph"] == "i"] == ["epoch_start", "epoch_end"]
    assert [e["pid"] for e in events if e["name"] == "epoch 0"] == [0, 1]
    assert [e for e in events if e["name"] == "validation"][0]["args"]["val_loss"] is None


# -- the callback's flow, driven in-process as rank 0 of 2 ---------------------------------------


class FakeLogger:
    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, float], int]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.calls.append((dict(metrics), step))


class FakeStrategy:
    """Rank 0 of 2: ``all_gather`` returns this rank's tensor and rank 1's (a fixed payload)."""

    def __init__(self, peer_payload: list[dict[str, Any]]) -> None:
        self.elche = ElCheConfig()
        self.chunk_batches = 4
        self.log_every_n_syncs = 1
        self.root_device = torch.device("cpu")
        self.peer = json.dumps(peer_payload).encode()
        self.progress = SimpleNamespace(epoch_batches=160, cohort_step=0, totals=[])
        self.launch_ranks = [0, 1]

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dtype == torch.int64:
            return torch.stack([tensor, torch.tensor([len(self.peer)])])
        other = torch.zeros_like(tensor)
        other[: len(self.peer)] = torch.frombuffer(bytearray(self.peer), dtype=torch.uint8)
        return torch.stack([tensor, other])


def outcome(index: int, steps: list[int], compute: list[float], losses: list[float], anchor: int,
            cohort: int, epoch_over: bool = False) -> SimpleNamespace:
    reports = tuple(SimpleNamespace(steps=s, samples=16 * s, compute_s=c, last_sync_s=0.01, loss_sum=x * s)
                    for s, c, x in zip(steps, compute, losses, strict=True))
    return SimpleNamespace(index=index, reports=reports, anchor=anchor, overhead=0.04, cohort_step=cohort,
                           planned=tuple(steps), epoch_over=epoch_over)


def drive_synthetic_run(tmp_path: Path, epochs: int = 6, syncs_per_epoch: int = 40, theme: Optional[str] = None,
                        reports_per_epoch: int = 3) -> tuple[ElCheMonitor, FakeLogger, dict[str, Any]]:
    """Feeds a realistic 2-rank run (rank 1 about 3x slower) through the monitor as rank 0 sees it."""
    logger = FakeLogger()
    monitor = ElCheMonitor(record_log_dir=str(tmp_path / "log"), dashboard_html=str(tmp_path / "dash.html"),
                           dashboard_theme=theme, reports_per_epoch=reports_per_epoch,
                           scalar_reductions={"tokens": "sum", "peak_mem_gb": "max"},
                           timeline=str(tmp_path / "trace.json"))
    peer: list[dict[str, Any]] = []
    strategy = FakeStrategy(peer)
    trainer = SimpleNamespace(
        strategy=strategy, global_rank=0, world_size=2, current_epoch=0, global_step=0, loggers=[logger],
        sanity_checking=False, callback_metrics={}, num_training_batches=80, accumulate_grad_batches=1,
        _logger_connector=SimpleNamespace(metrics={"callback": {}}),
    )
    monitor._strategy, monitor._trainer = strategy, trainer
    clock = [0.0]
    monitor._now = lambda: clock[0]
    monitor.on_train_start(trainer, None)
    index, cohort, anchor, tokens, all_peer = 0, 0, 10, [0.0, 0.0], []
    for epoch in range(epochs):
        trainer.current_epoch = epoch
        plan = []
        for _ in range(syncs_per_epoch):
            index += 1
            if index in (30, 90, 160):
                anchor = int(anchor * 1.4)
            plan.append((index, anchor, [3 * anchor // 10 + (index % 3 == 0), anchor // 10]))
        strategy.progress.epoch_batches = sum(sum(steps) for _, _, steps in plan)
        monitor.on_train_epoch_start(trainer, None)
        peer.clear()
        for j, (index, anchor, steps) in enumerate(plan):
            cohort += sum(steps)
            trainer.global_step += steps[0]
            progress = cohort / 1000
            loss = 0.08 + 2.2 * math.exp(-1.5 * progress) * (1 + 0.08 * math.sin(index * 1.7))
            compute = [0.30 + 0.02 * math.sin(index), 0.31 + 0.03 * math.cos(index)]
            clock[0] += max(compute) + 0.02
            tokens = [tokens[0] + 512 * steps[0], tokens[1] + 512 * steps[1]]
            trainer.callback_metrics = {"train_loss": torch.tensor(loss * 0.98), "tokens": torch.tensor(tokens[0]),
                                        "peak_mem_gb": 3.5, "vector": torch.ones(3)}
            if epoch:  # the last validation's values stay in callback_metrics
                trainer.callback_metrics["val_loss"] = torch.tensor(9.0)
            metrics = {"elche/anchor": float(anchor), "elche/divergence": 0.02 + 0.1 * math.exp(-progress)}
            monitor._on_round(outcome(index, steps, compute, [loss * 0.97, loss * 1.05], anchor, cohort,
                                      epoch_over=j == syncs_per_epoch - 1), metrics)
            peer.append({"sync": index, "work": steps[1],
                         "scalars": {"train_loss": loss * 1.02, "tokens": tokens[1], "peak_mem_gb": 5.25}})
        strategy.peer = json.dumps(peer).encode()
        all_peer += peer
        monitor.on_validation_start(trainer, None)
        clock[0] += 0.4
        val = {"val_loss": torch.tensor(0.12 + 2.0 * math.exp(-1.4 * cohort / 1000)),
               "val_acc": torch.tensor(1 - math.exp(-cohort / 900))}
        trainer._logger_connector.metrics["callback"] = val
        monitor.on_validation_end(trainer, None)
        monitor.on_train_epoch_end(trainer, None)
    strategy.progress.totals = [SimpleNamespace(steps=700, samples=11200, compute_s=12.0, sync_s=1.5),
                                    SimpleNamespace(steps=230, samples=3680, compute_s=12.4, sync_s=0.4)]
    monitor.on_fit_end(trainer, None)
    info = {"syncs": index, "epochs": epochs, "peer": all_peer}
    return monitor, logger, info


def test_callback_flow_records_rolls_up_reports_and_writes_outputs(tmp_path):
    monitor, logger, info = drive_synthetic_run(tmp_path, epochs=3, syncs_per_epoch=10)
    rank = read_records(tmp_path / "log" / "rank0.jsonl")
    assert rank[0]["kind"] == "meta" and rank[0]["world_size"] == 2 and rank[0]["config"]["mode"] == "nccl_cadence"
    assert rank[0]["scalar_reductions"] == {"tokens": "sum", "peak_mem_gb": "max"}
    assert set(rank[0]["versions"]) >= {"lightning_elche", "lightning", "torch", "python"}
    syncs = [r for r in rank if r["kind"] == "sync"]
    assert [r["sync"] for r in syncs] == list(range(1, info["syncs"] + 1))
    first = syncs[0]
    assert first["work"] == first["per_rank"]["steps"][0] and first["per_rank"]["samples"][1] == 16
    for r in syncs:  # validation keys are left out; non-scalar values are skipped
        assert set(r["scalars"]) == {"train_loss", "tokens", "peak_mem_gb"}
    later = [r for r in syncs if r["epoch"] == 1][0]
    assert later["elche"]["elche/anchor"] == later["anchor"]

    root = read_records(tmp_path / "log" / "root.jsonl")
    root_syncs = [r for r in root if r["kind"] == "sync"]
    assert len(root_syncs) == info["syncs"]
    rolled = {x["sync"]: x for x in root if x["kind"] == "scalars"}  # written at each epoch end
    assert sorted(rolled) == list(range(1, info["syncs"] + 1))
    r = root_syncs[-1]
    mine = [x for x in syncs if x["sync"] == r["sync"]][0]
    peer = [x for x in info["peer"] if x["sync"] == r["sync"]][0]
    both = rolled[r["sync"]]["scalars"]
    assert rolled[r["sync"]]["t"] == r["t"]
    assert both["tokens"] == mine["scalars"]["tokens"] + peer["scalars"]["tokens"]  # declared: sum
    assert both["train_loss"] == pytest.approx(
        (mine["scalars"]["train_loss"] * mine["work"] + peer["scalars"]["train_loss"] * peer["work"])
        / (mine["work"] + peer["work"]))  # undeclared: work-weighted mean
    assert both["peak_mem_gb"] == 5.25  # max over ranks
    assert "val_loss" not in both
    w0, w1 = r["per_rank"]["steps"]
    losses = r["per_rank"]["loss"]
    assert r["metrics"]["loss"] == pytest.approx((losses[0] * w0 + losses[1] * w1) / (w0 + w1))
    assert r["metrics"]["batch_share"] == pytest.approx(1.0)
    assert [e["epoch"] for e in root if e["kind"] == "eval"] == [0, 1, 2]
    assert root[-1]["kind"] == "end" and len(root[-1]["ranks"]) == 2

    reports = [m for m, _ in logger.calls if "elche/report/loss" in m]
    assert len(reports) == 3 * 3  # reports_per_epoch=3, three epochs
    assert {"elche/report/batch_share/rank1", "elche/report/samples_per_s", "elche/report/anchor"} <= set(reports[0])
    epoch_scalars = [m for m, _ in logger.calls if "elche/scalars/tokens" in m]
    assert len(epoch_scalars) == 3 and epoch_scalars[0]["elche/scalars/peak_mem_gb"] == 5.25

    trace = json.loads((tmp_path / "trace.json").read_text())
    assert len([e for e in trace["traceEvents"] if e["name"] == "sync"]) == 2 * info["syncs"]
    page = (tmp_path / "dash.html").read_text()
    assert 'data-theme' not in page.split("<head>")[0]


def test_dashboard_is_self_contained_and_escapes_its_data(tmp_path):
    drive_synthetic_run(tmp_path, epochs=2, syncs_per_epoch=5)
    records = read_records(tmp_path / "log" / "root.jsonl")
    next(r for r in records if r["kind"] == "scalars")["scalars"]["</script><script>alert(1)</script>"] = 1.0
    data = dashboard_data(records)
    assert data["meta"]["world_size"] == 2 and len(data["evals"]) == 2 and len(data["epochs"]) == 2
    assert len(data["syncs"]) == len(data["scalars"]) == 10
    page = render_dashboard(data, "dark")
    assert page.count("</script>") == 2 and "alert(1)</script>" not in page
    assert '<html lang="en" data-theme="dark">' in page
    lowered = page.lower()
    for needle in ("<link", "src=", "@import", "url(http", "fetch(", "xmlhttprequest"):
        assert needle not in lowered, needle
    assert [u for u in ("http://", "https://") if u in page.replace("http://www.w3.org/2000/svg", "")] == []
    assert "prefers-color-scheme: dark" in page
    assert '<html lang="en">' in render_dashboard(data, "auto")
    dashboard_from_log(tmp_path / "log", tmp_path / "again.html", "light")
    assert 'data-theme="light"' in (tmp_path / "again.html").read_text()


# -- headless Chromium --------------------------------------------------------------------------

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars", "--window-size=1400,1800"]


def chromium_path() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("CI needs Debian's chromium package (apt-get install -y chromium chromium-driver)")
        pytest.skip("chromium is not installed (apt-get install -y chromium chromium-driver)")
    return exe


def run_chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp_path / f"profile{len(list(tmp_path.glob('profile*')))}"
    proc = subprocess.run([chromium_path(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
                          capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


class DomCharts(html.parser.HTMLParser):
    """Collects body attributes and, per chart section, its plot box and drawn point count."""

    def __init__(self) -> None:
        super().__init__()
        self.body: dict[str, str] = {}
        self.charts: dict[str, dict[str, Any]] = {}
        self._current: Optional[str] = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, Optional[str]]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "body":
            self.body = a
        elif tag == "section" and "data-chart" in a:
            self._current = a["data-chart"]
            self.charts[self._current] = {"plot": [int(v) for v in a.get("data-plot", "0,0,0,0").split(",")]}
        elif tag == "svg" and self._current is not None and "data-points" in a:
            self.charts[self._current]["points"] = int(a["data-points"])
            self.charts[self._current]["series"] = int(a["data-series"])


def png_rows(path: Path, max_rows: int) -> tuple[int, int, int, list[bytearray]]:
    """The first ``max_rows`` rows of an 8-bit RGB(A), non-interlaced PNG (enough of a decoder for a screenshot)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, ihdr = 8, [], None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            ihdr = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
    assert ihdr is not None
    width, height, depth, ctype, _, _, interlace = ihdr
    assert depth == 8 and ctype in (2, 6) and interlace == 0, ihdr
    bpp = 3 if ctype == 2 else 4
    raw, stride = zlib.decompress(b"".join(idat)), width * bpp
    rows, prev = [], bytearray(stride)
    for y in range(min(height, max_rows)):
        kind_ = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        if kind_ == 1:
            for i in range(bpp, stride):
                line[i] = (line[i] + line[i - bpp]) & 255
        elif kind_ == 2:
            line = bytearray((a + b) & 255 for a, b in zip(line, prev, strict=True))
        elif kind_ == 3:
            for i in range(stride):
                left = line[i - bpp] if i >= bpp else 0
                line[i] = (line[i] + ((left + prev[i]) >> 1)) & 255
        elif kind_ == 4:
            for i in range(stride):
                a = line[i - bpp] if i >= bpp else 0
                b, c = prev[i], (prev[i - bpp] if i >= bpp else 0)
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(line)
        prev = line
    return width, height, bpp, rows


def coloured_pixels(rows: list[bytearray], bpp: int, box: list[int]) -> int:
    """Pixels in ``box`` (x, y, w, h) with a saturated colour: series lines, never grid, text or background."""
    x, y, w, h = box
    count = 0
    for row in rows[y : y + h]:
        for px in range(x, x + w):
            r, g, b = row[px * bpp : px * bpp + 3]
            if max(r, g, b) - min(r, g, b) > 70:
                count += 1
    return count


def check_dashboard_in_chromium(tmp_path: Path, page: Path, expect: tuple[str, ...], name: str) -> dict[str, Any]:
    """Open the page in headless Chromium: the DOM must report drawn points, the screenshot coloured lines."""
    dom = run_chromium(tmp_path, "--dump-dom", page.resolve().as_uri()).stdout
    parsed = DomCharts()
    parsed.feed(dom)
    assert parsed.body.get("data-ready") == "1", "the page's script did not finish"
    for chart in expect:
        assert parsed.charts[chart]["points"] > 0, f"chart {chart!r} drew nothing"
    png = tmp_path / f"{name}.png"
    run_chromium(tmp_path, f"--screenshot={png}", page.resolve().as_uri())
    keep(png, f"{name}.png")
    keep(page, f"{name}.html")
    boxes = {c: parsed.charts[c]["plot"] for c in ("batch_share", "samples_per_s")}
    width, height, bpp, rows = png_rows(png, max(y + h for _, y, _, h in boxes.values()) + 1)
    assert (width, height) == (1400, 1800)
    for chart, box in boxes.items():
        assert box[2] > 200 and box[3] > 100, f"chart {chart!r} has no room: {box}"
        assert coloured_pixels(rows, bpp, box) > 150, f"chart {chart!r} shows no coloured series in the screenshot"
    return parsed.charts


def test_dashboard_draws_its_charts_in_headless_chromium(tmp_path):
    drive_synthetic_run(tmp_path)
    charts = check_dashboard_in_chromium(
        tmp_path, tmp_path / "dash.html",
        ("loss", "validation", "batch_share", "samples_per_s", "anchor", "divergence", "syncs", "scalar:tokens"),
        "synthetic_dashboard",
    )
    assert charts["batch_share"]["series"] == 2 and charts["samples_per_s"]["series"] == 3
    assert charts["loss"]["points"] >= 240 + 6  # the rolled-up loss per sync, plus the validation points


# -- two real processes ---------------------------------------------------------------------------


class ScalarModel(RecordingModel):
    """Logs user scalars at every step, rank-local, as a user would."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, on_step=True)
        self.log("tokens", float(16 * (batch_idx + 1)), on_step=True)
        self.log("rank_id", float(self.global_rank), on_step=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        super().validation_step(batch, batch_idx)
        _, x, y = batch
        self.log("holdout_mae", (self(x) - y).abs().mean(), on_epoch=True, sync_dist=True)


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_two_process_run_with_the_monitor(tmp_path):
    pl.seed_everything(0, verbose=False)
    model = ScalarModel(str(tmp_path), n=512)
    monitor = ElCheMonitor(record_log_dir=str(tmp_path / "log"), dashboard_html=str(tmp_path / "dash.html"),
                           reports_per_epoch=2, scalar_reductions={"tokens": "sum", "rank_id": "max"},
                           timeline=str(tmp_path / "trace.json"))
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=ElCheStrategy(start_method="spawn", timeout=timedelta(seconds=30)),
        callbacks=[monitor, Throttle(1, 2.0)], max_epochs=2, logger=CSVLogger(str(tmp_path), name="logs"),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(model)
    r0, r1 = load_records(tmp_path)
    rounds = r0["rounds"]
    assert rounds == r1["rounds"] > 0

    per_rank = [read_records(tmp_path / "log" / f"rank{k}.jsonl") for k in range(2)]
    for k, records in enumerate(per_rank):
        meta = records[0]
        assert meta["kind"] == "meta" and meta["world_size"] == 2 and meta["rank"] == k
        assert meta["config"]["mode"] == "nccl_cadence" and meta["scalar_reductions"]["tokens"] == "sum"
        syncs = [r for r in records if r["kind"] == "sync"]
        assert [r["sync"] for r in syncs] == list(range(1, rounds + 1))
        assert sum(r["work"] for r in syncs) == r0["steps"][k]
        worked = [r for r in syncs if r["work"] > 0]
        assert worked and all({"train_loss", "tokens"} <= set(r["scalars"]) for r in worked)
        assert all(r["scalars"]["rank_id"] == k for r in worked)
        evals = [r for r in records if r["kind"] == "eval"]
        assert [r["epoch"] for r in evals] == [0, 1]
        assert all(set(r["metrics"]) == {"val_loss", "holdout_mae"} for r in evals)  # what validation logged
        assert records[-1]["kind"] == "end"
    assert [r["per_rank"] for r in per_rank[0] if r["kind"] == "sync"] == \
        [r["per_rank"] for r in per_rank[1] if r["kind"] == "sync"]

    root = read_records(tmp_path / "log" / "root.jsonl")
    rolled = {r["sync"]: r["scalars"] for r in root if r["kind"] == "scalars"}
    both = [r["sync"] for r in root if r["kind"] == "sync" and min(r["per_rank"]["steps"]) > 0]
    assert both and all(rolled[i]["rank_id"] == 1.0 for i in both)  # max over ranks
    by_sync = [{r["sync"]: r for r in records if r["kind"] == "sync"} for records in per_rank]
    for i in both:
        assert rolled[i]["tokens"] == by_sync[0][i]["scalars"]["tokens"] + by_sync[1][i]["scalars"]["tokens"]
        assert "holdout_mae" not in rolled[i] and "val_loss" not in rolled[i]

    rows = list(csv.DictReader(open(next((tmp_path / "logs").rglob("metrics.csv")))))
    reports = [row for row in rows if row.get("elche/report/loss")]
    assert 2 <= len(reports) <= 2 * 2
    assert any(row.get("elche/scalars/tokens") for row in rows)

    trace = json.loads((tmp_path / "trace.json").read_text())
    sync_events = [e for e in trace["traceEvents"] if e["name"] == "sync" and e["ph"] == "X"]
    assert len(sync_events) == 2 * rounds and {e["pid"] for e in sync_events} == {0, 1}

    check_dashboard_in_chromium(tmp_path, tmp_path / "dash.html",
                                ("loss", "validation", "batch_share", "samples_per_s", "anchor", "syncs"),
                                "two_process_dashboard")
