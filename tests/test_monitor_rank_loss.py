"""ElCheMonitor when ranks are lost: the ``rank_lost`` event record, the survivors' new numbering,
the root's view taken over by a new rank 0, the dashboard's markers (in a real headless Chromium)
and the timeline; then real 3-rank fits in which rank 1, and rank 0, are killed."""

from __future__ import annotations

import html.parser
import json
import math
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import pytest
import torch
from fault_jobs import run_job
from test_monitor import run_chromium

from lightning_elche import ElCheConfig
from lightning_elche.membership.change import Change
from lightning_elche.monitor import ElCheMonitor, Timeline, dashboard_data, read_records, render_dashboard
from lightning_elche.monitor.changes import rank_lost_record
from lightning_elche.monitor.reports import ReportAccumulator

# -- the event record ---------------------------------------------------------------------------


def a_loss(lost: list[int], world: int, ranks_before: Optional[list[int]] = None, generation: int = 1) -> Change:
    """The change the strategy hands its listeners; ``lost`` in the numbering before the loss."""
    ranks_before = ranks_before if ranks_before is not None else list(range(world))
    return Change(generation=generation, before=tuple(ranks_before),
                  after=tuple(r for k, r in enumerate(ranks_before) if k not in lost),
                  reasons={ranks_before[k]: f"its process (pid {100 + k}) is gone" for k in lost},
                  trained_batches={ranks_before[k]: 7 for k in lost}, detected_at=1234.5)


def test_rank_lost_record_names_the_lost_ranks_by_launch_number_and_the_survivors():
    # A second loss: launch ranks [0, 2, 3] are ranks 0, 1, 2 now; rank 1 (launch rank 2) leaves.
    loss = a_loss([1], 3, ranks_before=[0, 2, 3], generation=2)
    record = rank_lost_record(loss, t=12.5, ts=99.0, sync=41, epoch=3)
    assert record == {
        "kind": "event", "label": "rank_lost", "ts": 99.0, "t": 12.5, "sync": 41, "epoch": 3, "generation": 2,
        "lost": [2], "reasons": {"2": "its process (pid 101) is gone"}, "survivors": 2, "survivor_ranks": [0, 3],
        "trained_batches": {"2": 7}, "detected_at": 1234.5,
    }
    json.dumps(record, allow_nan=False)  # a record-log line as it is


def test_timeline_keeps_each_rank_on_its_launch_track_and_marks_the_loss(tmp_path):
    tl = Timeline(3)
    tl.epoch_start(0, 0.0)
    tl.round(1, 1.0, 0, [4, 3, 2], [32, 24, 16], [0.9, 0.9, 0.9], 10)
    tl.ranks_lost(1.4, 1, [0], [1, 2], {"0": "its process (pid 7) is gone"}, sync=2)
    tl.round(2, 2.0, 0, [5, 5], [40, 40], [0.5, 0.5], 10)
    tl.validation(2.0, 2.5)
    tl.epoch_end(0, 2.5)
    trace = tl.to_trace()
    events = trace["traceEvents"]
    lost = [e for e in events if e.get("cat") == "rank_lost"]
    assert {(e["s"], e["pid"]) for e in lost} == {("g", 0), ("p", 0)} and all(e["ts"] == 1_400_000.0 for e in lost)
    assert lost[0]["args"]["lost"] == [0] and lost[0]["args"]["survivors"] == [1, 2]
    assert [e["pid"] for e in events if e["name"] == "sync" and e["args"]["sync"] == 2] == [1, 2]
    assert [e["pid"] for e in events if e["name"] == "validation"] == [1, 2]
    assert [e["pid"] for e in events if e["name"] == "epoch 0"] == [1, 2]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "rank 0 (lost)", 1: "rank 1", 2: "rank 2"}


def test_report_accumulator_keeps_the_survivors_rows_under_their_launch_numbers():
    acc = ReportAccumulator(3)
    acc.add([2, 4, 6], [16, 32, 48], [1.0, 1.0, 1.0], [2.0, 8.0, 18.0], [0.1, 0.1, 0.1])
    acc.apply_change(Change(generation=1, before=(0, 1, 2), after=(0, 2)))
    acc.add([1, 3], [8, 24], [0.5, 0.5], [1.0, 3.0], [0.1, 0.1])
    payload = acc.payload()
    assert acc.ranks == [0, 2] and acc.world_size == 2
    assert payload["elche/report/loss/rank2"] == pytest.approx(21.0 / 9)
    assert payload["elche/report/batch_share/rank0"] == pytest.approx(3 / 12)
    assert not any(key.endswith("rank1") for key in payload)
    with pytest.raises(ValueError, match="ranks"):
        ReportAccumulator(2, ranks=[0])


# -- the callback, driven in-process as one rank of 3 -----------------------------------------------


class FakeLogger:
    def __init__(self) -> None:
        self.calls: list[dict[str, float]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.calls.append(dict(metrics))


class FakeStrategy:
    """What the monitor reads of ElCheStrategy; ``all_gather`` stacks the current members' rows
    (this rank's tensor, and the others' fixed payloads, by launch rank)."""

    def __init__(self, me: int, world: int) -> None:
        self.elche = ElCheConfig()
        self.chunk_batches = 4
        self.log_every_n_syncs = 1
        self.root_device = torch.device("cpu")
        self.me, self.members = me, list(range(world))
        self.global_rank, self.world_size = me, world
        self.peer_payloads: dict[int, bytes] = {}
        self.gathered_worlds: list[int] = []
        self.progress = SimpleNamespace(epoch_batches=120, cohort_step=0, rounds=0, totals=[], lost_totals=[])

    @property
    def launch_ranks(self) -> list[int]:
        return list(self.members)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        rows = []
        for rank in self.members:
            if rank == self.me:
                rows.append(tensor)
                continue
            payload = self.peer_payloads.get(rank, b"[]")
            if tensor.dtype == torch.int64:
                rows.append(torch.tensor([len(payload)]))
            else:
                row = torch.zeros_like(tensor)
                row[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                rows.append(row)
        self.gathered_worlds.append(len(rows))
        return torch.stack(rows)


def outcome(index: int, steps: list[int], cohort: int, epoch_over: bool = False) -> SimpleNamespace:
    reports = tuple(SimpleNamespace(steps=s, samples=8 * s, compute_s=0.1 * s + 0.05, last_sync_s=0.01,
                                    loss_sum=(1.0 + k) * s) for k, s in enumerate(steps))
    return SimpleNamespace(index=index, reports=reports, anchor=10, overhead=0.03, cohort_step=cohort,
                           planned=tuple(steps), epoch_over=epoch_over)


SYNCS_PER_EPOCH, EPOCHS, LOST_AFTER_SYNC = 6, 2, 4


def drive(tmp_path: Path, me: int, lost: int) -> tuple[ElCheMonitor, FakeStrategy, FakeLogger, dict[str, Any]]:
    """Launch rank ``me`` of 3 through two epochs; launch rank ``lost`` is lost after sync 4 of epoch 0."""
    logger = FakeLogger()
    monitor = ElCheMonitor(record_log_dir=str(tmp_path / "log"), dashboard_html=str(tmp_path / "dash.html"),
                           timeline=str(tmp_path / "trace.json"), reports_per_epoch=2)
    strategy = FakeStrategy(me, 3)
    trainer = SimpleNamespace(
        strategy=strategy, global_rank=me, world_size=3, current_epoch=0, global_step=0, loggers=[logger],
        sanity_checking=False, callback_metrics={}, num_training_batches=40, accumulate_grad_batches=1,
        _logger_connector=SimpleNamespace(metrics={"callback": {}}),
    )
    monitor._strategy, monitor._trainer = strategy, trainer
    clock = [0.0]
    monitor._now = lambda: clock[0]
    monitor.on_train_start(trainer, None)
    info: dict[str, Any] = {"loss_t": None, "logger_calls_before_loss": None}
    index = cohort = 0
    for epoch in range(EPOCHS):
        trainer.current_epoch = epoch
        monitor.on_train_epoch_start(trainer, None)
        strategy.peer_payloads = {}
        for j in range(SYNCS_PER_EPOCH):
            index += 1
            world = len(strategy.members)
            steps = [3 + k for k in range(world)]
            cohort += sum(steps)
            clock[0] += 0.5
            trainer.callback_metrics = {"tokens": torch.tensor(float(index))}
            monitor._on_round(outcome(index, steps, cohort, epoch_over=j == SYNCS_PER_EPOCH - 1),
                              {"elche/anchor": 10.0})
            strategy.progress.rounds = index
            for rank in strategy.members:
                if rank != me:
                    entries = json.loads(strategy.peer_payloads.get(rank, b"[]"))
                    entries.append({"sync": index, "work": steps[strategy.members.index(rank)],
                                    "scalars": {"tokens": 100.0 + rank}})
                    strategy.peer_payloads[rank] = json.dumps(entries).encode()
            if index == LOST_AFTER_SYNC:
                clock[0] += 0.2
                info["loss_t"] = clock[0]
                info["logger_calls_before_loss"] = len(logger.calls)
                before = strategy.members.index(lost)
                strategy.members.remove(lost)
                strategy.peer_payloads.pop(lost, None)
                strategy.global_rank, strategy.world_size = strategy.members.index(me), 2
                trainer.global_rank, trainer.world_size = strategy.global_rank, 2
                monitor.apply_change(a_loss([before], 3))
        monitor.on_validation_start(trainer, None)
        clock[0] += 0.3
        trainer._logger_connector.metrics["callback"] = {"val_loss": torch.tensor(1.0 / (epoch + 1))}
        monitor.on_validation_end(trainer, None)
        monitor.on_train_epoch_end(trainer, None)
    strategy.progress.totals = [SimpleNamespace(steps=50, samples=400, compute_s=5.0, sync_s=0.5)] * 2
    strategy.progress.lost_totals = [SimpleNamespace(steps=9, samples=72, compute_s=1.0, sync_s=0.1)]
    monitor.on_fit_end(trainer, None)
    info["syncs"] = index
    return monitor, strategy, logger, info


def events_of(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r["kind"] == "event"]


def check_survivor_log(path: Path, me: int, lost: int, info: dict[str, Any]) -> None:
    """A survivor's rank log: the event once, then syncs with the survivors' rows only."""
    records = read_records(path)
    assert records[0]["kind"] == "meta" and records[0]["original_rank"] == me and records[0]["node"] == f"rank{me}"
    (event,) = events_of(records)
    survivors = [r for r in range(3) if r != lost]
    assert event["label"] == "rank_lost" and event["lost"] == [lost] and event["generation"] == 1
    assert event["survivors"] == 2 and event["survivor_ranks"] == survivors and event["rank"] == survivors.index(me)
    assert event["sync"] == LOST_AFTER_SYNC + 1, "the round that failed, which runs again on the survivors"
    assert event["t"] == pytest.approx(info["loss_t"]) and event["ts"] > 0 and event["node"] == f"rank{me}"
    assert event["reasons"] == {str(lost): f"its process (pid {100 + lost}) is gone"}
    syncs = [r for r in records if r["kind"] == "sync"]
    assert [r["sync"] for r in syncs] == list(range(1, info["syncs"] + 1))
    for r in syncs:
        width = 3 if r["sync"] <= LOST_AFTER_SYNC else 2
        assert len(r["per_rank"]["steps"]) == len(r["per_rank"]["loss"]) == width
        assert r["ranks"] == (list(range(3)) if width == 3 else survivors)
        assert r["rank"] == (me if width == 3 else survivors.index(me))
        assert r["work"] == r["per_rank"]["steps"][r["rank"]]


def test_a_survivor_records_the_loss_and_follows_the_new_numbering(tmp_path):
    monitor, strategy, logger, info = drive(tmp_path, me=1, lost=2)
    check_survivor_log(tmp_path / "log" / "rank1.jsonl", me=1, lost=2, info=info)
    assert strategy.gathered_worlds == [2, 2, 2, 2], "the epoch-end gathers run on the two survivors"
    assert not (tmp_path / "log" / "root.jsonl").exists() and not (tmp_path / "dash.html").exists()
    assert monitor._rank == 1 and monitor._world == 2 and not monitor.is_root and logger.calls == []


def test_the_root_records_the_loss_in_its_log_dashboard_and_timeline(tmp_path):
    _, strategy, logger, info = drive(tmp_path, me=0, lost=1)
    check_survivor_log(tmp_path / "log" / "rank0.jsonl", me=0, lost=1, info=info)
    root = read_records(tmp_path / "log" / "root.jsonl")
    (event,) = events_of(root)
    assert event["node"] == "root" and event["lost"] == [1] and event["survivor_ranks"] == [0, 2]
    assert "rank" not in event
    reports = [c for c in logger.calls if "elche/report/loss" in c]
    assert reports and all("elche/report/loss/rank1" not in c for c in reports[1:])
    assert "elche/report/loss/rank2" in reports[-1], "report keys keep the launch numbers"
    data = dashboard_page_data(tmp_path / "dash.html")
    (marker,) = data["events"]
    assert marker["label"] == "rank_lost" and marker["lost"] == [1] and marker["text"] == "rank 1 lost"
    assert marker["t"] == pytest.approx(info["loss_t"]) and marker["sync"] == LOST_AFTER_SYNC + 1
    assert data["title"].endswith("· 1 lost")
    end = root[-1]
    assert [(r["rank"], r["original_rank"], r.get("lost", False)) for r in end["ranks"]] == \
        [(0, 0, False), (1, 2, False), (None, 1, True)]
    trace = json.loads((tmp_path / "trace.json").read_text())
    marks = [e for e in trace["traceEvents"] if e.get("cat") == "rank_lost"]
    assert {e["pid"] for e in marks} == {0, 1} and trace["otherData"]["lost_ranks"] == [1]
    assert {e["pid"] for e in trace["traceEvents"] if e["name"] == "sync" and e["args"]["sync"] > 4} == {0, 2}


def test_when_rank_0_is_lost_the_new_rank_0_takes_over_the_root_log_and_dashboard(tmp_path):
    _, strategy, logger, info = drive(tmp_path, me=1, lost=0)
    check_survivor_log(tmp_path / "log" / "rank1.jsonl", me=1, lost=0, info=info)
    assert info["logger_calls_before_loss"] == 0, "loggers are rank 0's until the loss"
    assert any("elche/report/loss" in c for c in logger.calls), "the new rank 0 logs the reports"
    root = read_records(tmp_path / "log" / "root.jsonl")
    assert root[0]["kind"] == "meta" and root[0]["root_original_rank"] == 1 and root[0]["world_size"] == 3
    # Its copy of the root's view: every sync from the start, the loss at its place, the epochs.
    syncs = [r["sync"] for r in root if r["kind"] == "sync"]
    assert syncs == list(range(1, info["syncs"] + 1))
    kinds = [r["kind"] for r in root]
    assert kinds.index("event") == kinds.index("sync") + LOST_AFTER_SYNC
    (event,) = events_of(root)
    assert event["lost"] == [0] and event["survivor_ranks"] == [1, 2] and event["node"] == "root"
    assert [r["epoch"] for r in root if r["kind"] == "epoch"] == [0, 1]
    rolled = {r["sync"]: r["scalars"] for r in root if r["kind"] == "scalars"}
    # Work-weighted over the survivors (steps 3, 4, 5 before the loss, 3, 4 after): the lost rank's
    # scalars of the epoch it died in left with it (it never reached the epoch-end gather).
    assert rolled[1]["tokens"] == pytest.approx((1.0 * 4 + 102.0 * 5) / 9)
    assert rolled[info["syncs"]]["tokens"] == pytest.approx((info["syncs"] * 3 + 102.0 * 4) / 7)
    assert all(r["t"] is not None for r in root if r["kind"] == "scalars"), "dated by the new root's clock"
    assert root[-1]["kind"] == "end"
    data = dashboard_page_data(tmp_path / "dash.html")
    assert [m["lost"] for m in data["events"]] == [[0]] and data["meta"]["root_original_rank"] == 1
    assert len(data["syncs"]) == info["syncs"] and len(data["evals"]) == EPOCHS
    assert [p["ranks"] for p in data["syncs"]][LOST_AFTER_SYNC - 1 : LOST_AFTER_SYNC + 1] == [[0, 1, 2], [1, 2]]
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert [e["pid"] for e in trace["traceEvents"] if e.get("cat") == "rank_lost" and e["s"] == "p"] == [0]


def test_a_loss_before_the_first_round_names_round_1(tmp_path):
    monitor = ElCheMonitor(record_log_dir=str(tmp_path / "log"))
    strategy = FakeStrategy(2, 3)
    trainer = SimpleNamespace(strategy=strategy, global_rank=2, world_size=3, current_epoch=0)
    monitor._strategy, monitor._trainer = strategy, trainer
    monitor.on_train_start(trainer, None)
    strategy.global_rank, strategy.world_size = 1, 2
    monitor.apply_change(a_loss([0], 3))
    (event,) = events_of(read_records(tmp_path / "log" / "rank2.jsonl"))
    assert event["sync"] == 1 and event["rank"] == 1 and event["survivor_ranks"] == [1, 2]
    assert monitor._rank == 1 and monitor._world == 2 and monitor._ranks == [1, 2]
    assert not monitor.is_root


def test_a_loss_the_monitor_cannot_follow_warns_and_never_fails_training(tmp_path):
    monitor = ElCheMonitor(record_log_dir=str(tmp_path / "log"))
    strategy = FakeStrategy(0, 2)
    trainer = SimpleNamespace(strategy=strategy, global_rank=0, world_size=2, current_epoch=0)
    monitor._strategy, monitor._trainer = strategy, trainer
    monitor.on_train_start(trainer, None)
    with pytest.warns(RuntimeWarning, match="recording a lost rank failed"):
        monitor.apply_change(a_loss([1], 3))  # names three ranks; the monitor knows two
    monitor._active = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        monitor.apply_change(a_loss([1], 2))  # after the fit: ignored


# -- the dashboard's markers ----------------------------------------------------------------------


def dashboard_page_data(path: Path) -> dict[str, Any]:
    """The data embedded in a written dashboard page."""
    page = path.read_text()
    start = page.index('<script type="application/json" id="elche-data">') + len(
        '<script type="application/json" id="elche-data">')
    return json.loads(page[start : page.index("</script>", start)])


def synthetic_root_records() -> list[dict[str, Any]]:
    """Root records of a 3-rank run that loses launch rank 1 at t = 5.25 s."""
    records: list[dict[str, Any]] = [{"kind": "meta", "world_size": 3, "ranks": [0, 1, 2],
                                      "config": {"mode": "cpu_cadence"}}]
    for i in range(1, 21):
        ranks = [0, 1, 2] if i <= 10 else [0, 2]
        n = len(ranks)
        records.append({"kind": "sync", "t": 0.5 * i, "sync": i, "epoch": (i - 1) // 10, "cohort_step": 9 * i,
                        "anchor": 10, "overhead": 0.05, "work": 9, "ranks": ranks,
                        "metrics": {"loss": 2.0 / i, "samples_per_s": 300.0},
                        "per_rank": {"loss": [2.0 / i + 0.01 * k for k in range(n)], "batch_share": [1 / n] * n,
                                     "samples_per_s": [100.0 + 10 * k for k in range(n)]}})
        if i == 10:
            records.append({"kind": "epoch", "epoch": 0, "start": 0.0, "t": 5.0})
            records.append({"kind": "event", "label": "rank_lost", "t": 5.25, "sync": 11, "epoch": 1,
                            "generation": 1, "lost": [1], "reasons": {"1": "silent for 30 s (<b>no heartbeat</b>)"},
                            "survivors": 2, "survivor_ranks": [0, 2]})
    records.append({"kind": "epoch", "epoch": 1, "start": 5.0, "t": 10.0})
    records.append({"kind": "end", "t": 10.1, "ranks": [
        {"rank": 0, "original_rank": 0, "steps": 90, "samples": 720, "compute_s": 5.0, "sync_s": 0.5},
        {"rank": 1, "original_rank": 2, "steps": 80, "samples": 640, "compute_s": 5.0, "sync_s": 0.5},
        {"rank": None, "original_rank": 1, "lost": True, "steps": 20, "samples": 160, "compute_s": 2.5, "sync_s": 0.2},
    ]})
    return records


def test_dashboard_data_carries_the_loss_markers():
    data = dashboard_data(synthetic_root_records())
    (marker,) = data["events"]
    assert marker == {"t": 5.25, "label": "rank_lost", "sync": 11, "epoch": 1, "generation": 1, "lost": [1],
                      "reasons": {"1": "silent for 30 s (<b>no heartbeat</b>)"}, "survivors": 2,
                      "text": "rank 1 lost"}
    assert data["title"] == "ElChe run · cpu_cadence · 3 ranks · 1 lost"
    assert data["syncs"][10]["ranks"] == [0, 2]
    two = dashboard_data([*synthetic_root_records(), {"kind": "event", "label": "rank_lost", "t": 8.0,
                                                      "lost": [0, 2], "reasons": {}}])
    assert two["events"][-1]["text"] == "ranks 0, 2 lost" and two["title"].endswith("· 3 lost")
    assert dashboard_data(synthetic_root_records()[:5])["events"] == []


def test_dashboard_page_embeds_the_marker_data_escaped(tmp_path):
    page = render_dashboard(dashboard_data(synthetic_root_records()))
    assert "<b>no heartbeat</b>" not in page and "\\u003cb\\u003eno heartbeat" in page
    assert page.count("</script>") == 2
    (tmp_path / "dash.html").write_text(page)
    assert dashboard_page_data(tmp_path / "dash.html")["events"][0]["lost"] == [1]


class DomMarkers(html.parser.HTMLParser):
    """Per chart: the svg's data-points and data-events, and the titles of its event markers."""

    def __init__(self) -> None:
        super().__init__()
        self.body: dict[str, str] = {}
        self.charts: dict[str, dict[str, Any]] = {}
        self._chart: Optional[str] = None
        self._in_event = False
        self._in_title = False
        self.rows: list[str] = []
        self._in_td = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, Optional[str]]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "body":
            self.body = a
        elif tag == "section" and "data-chart" in a:
            self._chart = a["data-chart"]
            self.charts[self._chart] = {"titles": [], "events": None, "points": 0, "lines": 0}
        elif tag == "svg" and self._chart is not None and "data-points" in a:
            self.charts[self._chart]["points"] = int(a["data-points"])
            self.charts[self._chart]["events"] = int(a["data-events"]) if "data-events" in a else None
        elif tag == "g" and a.get("class") == "event" and self._chart is not None:
            self._in_event = True
            self.charts[self._chart]["data_event"] = a.get("data-event")
        elif tag == "title" and self._in_event:
            self._in_title = True
        elif tag == "line" and self._in_event and a.get("class") == "eventline":
            self.charts[self._chart]["lines"] += 1  # type: ignore[index]
        elif tag == "td":
            self._in_td = True

    def handle_endtag(self, tag: str) -> None:
        if tag == "g":
            self._in_event = False
        elif tag == "title":
            self._in_title = False
        elif tag == "td":
            self._in_td = False

    def handle_data(self, data: str) -> None:
        if self._in_title and self._chart is not None:
            self.charts[self._chart]["titles"].append(data)
        if self._in_td:
            self.rows.append(data)


def dump_dom(tmp_path: Path, page: Path) -> str:
    return run_chromium(tmp_path, "--dump-dom", page.resolve().as_uri()).stdout


def check_markers_in_chromium(tmp_path: Path, page: Path, expect_text: str, count: int = 1) -> DomMarkers:
    """Every chart that drew data (so has a time axis) shows ``count`` markers whose tooltip has ``expect_text``."""
    dom = DomMarkers()
    dom.feed(dump_dom(tmp_path, page))
    assert dom.body.get("data-ready") == "1", "the page's script did not finish"
    drawn = {name: c for name, c in dom.charts.items() if c["points"] > 0}
    assert {"loss", "batch_share", "samples_per_s", "anchor", "syncs"} <= set(drawn)
    for name, chart in drawn.items():
        assert chart["events"] == count and chart["lines"] == count, f"chart {name!r}: {chart}"
        assert chart["data_event"] == "rank_lost"
        assert any(expect_text in title for title in chart["titles"]), f"chart {name!r}: {chart['titles']}"
    return dom


def test_every_time_axis_of_the_dashboard_marks_the_loss_in_headless_chromium(tmp_path):
    page = tmp_path / "dash.html"
    page.write_text(render_dashboard(dashboard_data(synthetic_root_records())))
    dom = check_markers_in_chromium(tmp_path, page, "rank 1 lost at 5.3 s, sync 11, epoch 1 (rank 1: silent for 30 s")
    assert "1 (lost)" in dom.rows and "1 (was 2)" in dom.rows  # the per-rank table by launch number
    no_loss = tmp_path / "plain.html"
    records = [r for r in synthetic_root_records() if r["kind"] != "event"]
    no_loss.write_text(render_dashboard(dashboard_data(records)))
    plain = DomMarkers()
    plain.feed(dump_dom(tmp_path, no_loss))
    assert all(c["events"] == 0 and c["lines"] == 0 for c in plain.charts.values() if c["points"] > 0)


# -- joins (a synthetic Change: no processes) ------------------------------------------------------


def drive_a_join(tmp_path: Path, change: Change) -> tuple[ElCheMonitor, FakeLogger]:
    """Launch rank 0 of ``change.before`` through one epoch of 4 syncs; ``change`` comes after sync 2."""
    logger = FakeLogger()
    monitor = ElCheMonitor(record_log_dir=str(tmp_path / "log"), dashboard_html=str(tmp_path / "dash.html"),
                           timeline=str(tmp_path / "trace.json"), reports_per_epoch=4)
    strategy = FakeStrategy(0, len(change.before))
    strategy.members = list(change.before)
    strategy.progress.epoch_batches = 28  # a report at every sync
    trainer = SimpleNamespace(
        strategy=strategy, global_rank=0, world_size=len(change.before), current_epoch=0, global_step=0,
        loggers=[logger], sanity_checking=False, callback_metrics={}, num_training_batches=20,
        accumulate_grad_batches=1, _logger_connector=SimpleNamespace(metrics={"callback": {}}),
    )
    monitor._strategy, monitor._trainer = strategy, trainer
    clock = [0.0]
    monitor._now = lambda: clock[0]
    monitor.on_train_start(trainer, None)
    monitor.on_train_epoch_start(trainer, None)
    cohort = 0
    for index in range(1, 5):
        steps = [3 + k for k in range(len(strategy.members))]
        cohort += sum(steps)
        clock[0] += 0.5
        monitor._on_round(outcome(index, steps, cohort, epoch_over=index == 4), {"elche/anchor": 10.0})
        strategy.progress.rounds = index
        if index == 2:
            clock[0] += 0.1
            strategy.members = list(change.after)
            strategy.world_size = trainer.world_size = len(change.after)
            strategy.global_rank = trainer.global_rank = change.new_rank(0)
            monitor.apply_change(change)
    monitor.on_train_epoch_end(trainer, None)
    strategy.progress.totals = [SimpleNamespace(steps=9, samples=72, compute_s=1.0, sync_s=0.1)] * len(change.after)
    strategy.progress.lost_totals = [SimpleNamespace(steps=5, samples=40, compute_s=0.5, sync_s=0.1)] * len(
        change.lost)
    monitor.on_fit_end(trainer, None)
    return monitor, logger


def test_a_joined_rank_is_an_event_in_the_logs_and_a_track_and_a_row(tmp_path):
    join = Change(generation=1, before=(0, 1), after=(0, 1, 5), detected_at=77.0)  # member 5 joins as rank 2
    monitor, logger = drive_a_join(tmp_path, join)
    for path, node in ((tmp_path / "log" / "rank0.jsonl", "rank0"), (tmp_path / "log" / "root.jsonl", "root")):
        records = read_records(path)
        (event,) = events_of(records)
        assert {k: v for k, v in event.items() if k not in ("ts", "rank", "v")} == {
            "kind": "event", "label": "rank_joined", "t": 1.1, "sync": 3, "epoch": 0, "generation": 1,
            "joined": [5], "joined_as": [2], "world_size": 3, "member_ranks": [0, 1, 5], "detected_at": 77.0,
            "node": node,
        }
        assert [r["ranks"] for r in records if r["kind"] == "sync"] == [[0, 1]] * 2 + [[0, 1, 5]] * 2
        end = records[-1]
        assert [(r["rank"], r["original_rank"], r.get("joined", False)) for r in end["ranks"]] == \
            [(0, 0, False), (1, 1, False), (2, 5, True)]
    assert monitor._ranks == [0, 1, 5] and monitor._world == 3 and monitor.is_root
    reports = [c for c in logger.calls if "elche/report/loss" in c]
    assert "elche/report/loss/rank5" not in reports[0] and "elche/report/loss/rank5" in reports[-1]
    trace = json.loads((tmp_path / "trace.json").read_text())
    marks = [e for e in trace["traceEvents"] if e.get("cat") == "rank_joined"]
    assert {(e["s"], e["pid"]) for e in marks} == {("g", 0), ("p", 5)} and trace["otherData"]["joined_ranks"] == [5]
    assert {e["pid"] for e in trace["traceEvents"] if e["name"] == "sync" and e["args"]["sync"] == 3} == {0, 1, 5}
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1", 5: "rank 5 (joined)"}
    data = dashboard_page_data(tmp_path / "dash.html")
    assert data["events"] == [{"t": 1.1, "label": "rank_joined", "sync": 3, "epoch": 0, "generation": 1,
                               "joined": [5], "world_size": 3, "text": "rank 5 joined"}]
    assert data["title"] == "ElChe run · nccl_cadence · 2 ranks · 1 joined"  # the world at launch


def test_a_loss_and_a_join_in_one_change_are_two_events(tmp_path):
    both = Change(generation=2, before=(0, 1), after=(0, 4), reasons={1: "its process is gone"})
    monitor, _ = drive_a_join(tmp_path, both)
    root = read_records(tmp_path / "log" / "root.jsonl")
    lost, joined = events_of(root)
    assert (lost["label"], lost["lost"], lost["survivor_ranks"]) == ("rank_lost", [1], [0])
    assert (joined["label"], joined["joined"], joined["member_ranks"]) == ("rank_joined", [4], [0, 4])
    assert [(r["rank"], r["original_rank"], r.get("joined", False), r.get("lost", False)) for r in root[-1]["ranks"]] \
        == [(0, 0, False, False), (1, 4, True, False), (None, 1, False, True)]
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert trace["otherData"]["lost_ranks"] == [1] and trace["otherData"]["joined_ranks"] == [4]
    markers = dashboard_page_data(tmp_path / "dash.html")["events"]
    assert [m["text"] for m in markers] == ["rank 1 lost", "rank 4 joined"]


def test_a_change_the_monitor_cannot_follow_warns_naming_the_join(tmp_path):
    monitor = ElCheMonitor(record_log_dir=str(tmp_path / "log"))
    strategy = FakeStrategy(0, 2)
    trainer = SimpleNamespace(strategy=strategy, global_rank=0, world_size=2, current_epoch=0)
    monitor._strategy, monitor._trainer = strategy, trainer
    monitor.on_train_start(trainer, None)
    with pytest.warns(RuntimeWarning, match="recording a joined rank failed.*current members"):
        monitor.apply_change(Change(generation=1, before=(0, 3), after=(0, 3, 4)))  # member 3 is not in this fit
    assert monitor._ranks == [0, 1]


def test_every_time_axis_of_the_dashboard_marks_the_join_in_headless_chromium(tmp_path):
    records = [r for r in synthetic_root_records() if r["kind"] != "event"]
    records.insert(12, {"kind": "event", "label": "rank_joined", "t": 5.25, "sync": 11, "epoch": 1, "generation": 1,
                        "joined": [3], "world_size": 3, "member_ranks": [0, 2, 3]})
    records[-1]["ranks"].insert(2, {"rank": 2, "original_rank": 3, "joined": True, "steps": 10, "samples": 80,
                                    "compute_s": 1.0, "sync_s": 0.1})
    page = tmp_path / "dash.html"
    page.write_text(render_dashboard(dashboard_data(records)))
    dom = DomMarkers()
    dom.feed(dump_dom(tmp_path, page))
    assert dom.body.get("data-ready") == "1", "the page's script did not finish"
    drawn = {name: c for name, c in dom.charts.items() if c["points"] > 0}
    assert {"loss", "batch_share", "samples_per_s", "anchor", "syncs"} <= set(drawn)
    for name, chart in drawn.items():
        assert chart["events"] == 1 and chart["lines"] == 1 and chart["data_event"] == "rank_joined", name
        assert any("rank 3 joined at 5.3 s, sync 11, epoch 1; 3 ranks from then on" in title
                   for title in chart["titles"]), f"chart {name!r}: {chart['titles']}"
    assert "2 (joined as 3)" in dom.rows and "1 (was 2)" in dom.rows


def test_the_summary_marks_the_joined_ranks_that_fit_members_follow():
    from lightning_elche.engine import FitProgress, RankTotals
    from lightning_elche.summary import FitMembers, format_summary

    members = FitMembers([0, 1, 2])
    members.apply_change(Change(generation=1, before=(0, 1, 2), after=(0, 2, 3)))  # 1 lost, 3 joins
    assert (members.members, members.lost, members.joined, members.joined_ranks) == ([0, 2, 3], [1], [3], [2])
    with pytest.raises(ValueError, match=r"FitMembers.apply_change.*current members \[0, 2, 3\]"):
        members.apply_change(Change(generation=1, before=(0, 1, 2), after=(0, 2)))  # applied twice
    progress = FitProgress(mode="cpu_async", rounds=9, cohort_step=75, anchor=3, plan=(3, 2, 2), epoch_batches=32,
                           totals=(RankTotals(steps=40), RankTotals(steps=20), RankTotals(steps=5)),
                           lost_totals=(RankTotals(steps=10),))
    text = format_summary(progress, lost_ranks=members.lost, joined_ranks=members.joined_ranks)
    rows = [line.split() for line in text.splitlines()[2:6]]
    assert [r[0] for r in rows] == ["0", "1", "2+", "lost1"] and [int(r[1]) for r in rows] == [40, 20, 5, 10]
    assert "1 rank(s) joined during the fit (marked +)" in text and "1 rank(s) lost" in text
    assert "joined" not in format_summary(progress, lost_ranks=members.lost)


# -- real 3-rank fits: rank 1, then rank 0, killed ------------------------------------------------


def run_fault_job(out: Path, mode: str, fault: str) -> dict[int, dict[str, Any]]:
    """Run tests/scripts/fault_fit.py with the monitor to its end (every process it started);
    returns the results of the ranks that finished, by launch rank."""
    job = run_job(out, mode, [fault], epochs=2, extra=("--monitor", str(out / "monitor")))
    assert not job.leftover, f"processes left behind: {job.leftover}"
    assert "ElCheMonitor" not in job.log, "the monitor warned:\n" + job.log[-4000:]
    return job.results


def check_monitor_outputs(tmp_path: Path, out: Path, lost: int, results: dict[int, dict[str, Any]]) -> None:
    survivors = [r for r in range(3) if r != lost]
    assert sorted(results) == survivors, (out / "job.log").read_text()[-4000:]
    records_dir = out / "monitor" / "records"
    agreed_sync = None
    for rank in survivors:
        records = read_records(records_dir / f"rank{rank}.jsonl")
        (event,) = events_of(records)
        assert event["lost"] == [lost] and event["generation"] == 1 and event["survivors"] == 2
        assert event["survivor_ranks"] == survivors and event["rank"] == survivors.index(rank)
        assert set(event["reasons"]) == {str(lost)} and math.isfinite(event["t"])
        assert agreed_sync in (None, event["sync"]), "every survivor names the same round"
        agreed_sync = event["sync"]
        later = [r for r in records if r["kind"] == "sync" and r["sync"] >= event["sync"]]
        assert later and all(r["ranks"] == survivors and len(r["per_rank"]["steps"]) == 2 for r in later)
        assert records[-1]["kind"] == "end" and records[-1]["rank"] == survivors.index(rank)
        assert [r["epoch"] for r in records if r["kind"] == "epoch"] == [0, 1]
    lost_log = read_records(records_dir / f"rank{lost}.jsonl")
    assert not events_of(lost_log) and lost_log[-1]["kind"] != "end", "the killed rank wrote nothing after"
    root = read_records(records_dir / "root.jsonl")
    assert root[0]["root_original_rank"] == survivors[0]
    (event,) = events_of(root)
    assert event["lost"] == [lost] and event["sync"] == agreed_sync and event["node"] == "root"
    root_syncs = [r["sync"] for r in root if r["kind"] == "sync"]
    assert root_syncs == list(range(1, root_syncs[-1] + 1)), "the root log holds every sync, before and after"
    assert root[-1]["kind"] == "end" and len([r for r in root[-1]["ranks"] if r.get("lost")]) == 1
    page = out / "monitor" / "dashboard.html"
    data = dashboard_page_data(page)
    assert [m["lost"] for m in data["events"]] == [[lost]] and data["events"][0]["sync"] == agreed_sync
    check_markers_in_chromium(tmp_path, page, f"rank {lost} lost at")
    trace = json.loads((out / "monitor" / "timeline.json").read_text())
    assert [e["pid"] for e in trace["traceEvents"] if e.get("cat") == "rank_lost" and e["s"] == "p"] == [lost]


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_killed_rank_1_is_in_every_survivors_log_the_root_log_and_the_dashboard(tmp_path):
    results = run_fault_job(tmp_path / "job", "cpu_async", "kill:1:12")
    check_monitor_outputs(tmp_path, tmp_path / "job", 1, results)


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_killed_rank_0_leaves_the_new_rank_0_writing_the_root_log_and_the_dashboard(tmp_path):
    results = run_fault_job(tmp_path / "job", "nccl_cadence", "kill:0:12")
    assert results[1]["is_global_zero"]
    check_monitor_outputs(tmp_path, tmp_path / "job", 0, results)
