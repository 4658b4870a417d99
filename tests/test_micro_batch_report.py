"""Each rank's micro-batch is reported: the rounds' metadata carries it to every rank, the end-of-fit
summary has a column for it and the round metrics a value per rank (real 2-process fits on gloo),
without a collective of its own."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from micro_batch_helpers import MetricsFile, SummaryFile
from model_helpers import RecordingModel

from lightning_elche import ElCheConfig, ElCheStrategy
from lightning_elche.averaging import round_weights
from lightning_elche.engine import ElCheEngine, FitProgress, RankTotals
from lightning_elche.planes.base import AveragingPlane, RoundResult
from lightning_elche.rounds import META_SIZE, Meta, RankReport
from lightning_elche.summary import format_summary

PG_TIMEOUT = timedelta(seconds=30)
N, B = 64, 8


def reported_fit(tmp_path: Path, micro_batch: Any) -> tuple[list[str], list[dict[str, Any]]]:
    """(rank 0's summary lines, rank 0's logged micro-batch metrics per round) of a 2-rank fit."""
    pl.seed_everything(0, verbose=False)
    model = RecordingModel(str(tmp_path), n=N, batch_size=B, val=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, max_epochs=1, enable_checkpointing=False, limit_val_batches=0,
        strategy=ElCheStrategy(elche=ElCheConfig(mode="cpu_sync"), micro_batch=micro_batch, summary=True,
                               start_method="spawn", timeout=PG_TIMEOUT),
        logger=MetricsFile(str(tmp_path)), callbacks=[SummaryFile(str(tmp_path))], log_every_n_steps=1,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
    )
    trainer.fit(model)
    summary = (tmp_path / "summary-rank0.txt").read_text().splitlines()
    assert (tmp_path / "summary-rank1.txt").read_text() == "", "the summary is rank 0's"
    rounds = [json.loads(line) for line in (tmp_path / "metrics-rank0.jsonl").read_text().splitlines()]
    return summary, [r for r in rounds if r["syncs"] is not None]


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("micro_batch", "expected"), [
    pytest.param({1: 3}, [B, 3], id="mapping", marks=pytest.mark.extended),  # rank 0 left out: the whole batch
    pytest.param([4, "auto"], [4, B], id="list-int-auto"),  # "auto" on a CPU rank: the whole batch
])
def test_the_summary_and_the_metrics_show_each_ranks_micro_batch(tmp_path: Path, micro_batch: Any,
                                                                 expected: list[int]) -> None:
    summary, rounds = reported_fit(tmp_path, micro_batch)
    assert summary and summary[0].startswith("ElChe summary: mode cpu_sync")
    header, rows = summary[1].split(), [line.split() for line in summary[2:4]]
    assert header[:7] == ["rank", "steps", "share", "samples", "samples/s", "idle", "micro"], summary[1]
    assert [r[0] for r in rows] == ["0", "1"] and [int(r[6]) for r in rows] == expected, summary
    assert rounds, "rank 0 logged no round metrics"
    for logged in rounds:  # every round, from the first: "auto" has chosen at the first batch
        assert logged["micro_batch"] == {f"elche/micro_batch/rank{k}": float(m) for k, m in enumerate(expected)}


def progress(*totals: RankTotals) -> FitProgress:
    return FitProgress(mode="cpu_sync", rounds=4, cohort_step=sum(t.steps for t in totals), anchor=2, plan=(2, 2),
                       epoch_batches=8, totals=totals)


def test_a_fit_without_micro_batch_has_no_micro_column() -> None:
    text = format_summary(progress(RankTotals(steps=4), RankTotals(steps=4)))
    assert "micro" not in text
    assert all(len(line.split()) == 6 for line in text.splitlines()[2:])


def test_a_rank_that_reported_no_micro_batch_shows_a_dash_and_lost_ranks_keep_theirs() -> None:
    totals = (RankTotals(steps=4, micro_batch=16), RankTotals(steps=4))
    lost = (RankTotals(steps=2, micro_batch=2),)
    text = format_summary(FitProgress(mode="cpu_sync", rounds=4, cohort_step=10, anchor=2, plan=(2, 2),
                                      epoch_batches=8, totals=totals, lost_totals=lost), lost_ranks=[2])
    rows = [line.split() for line in text.splitlines()[2:5]]
    assert [(r[0], r[6]) for r in rows] == [("0", "16"), ("1", "-"), ("lost2", "2")]


def test_the_metadata_slot_reads_back_as_the_reported_micro_batch() -> None:
    row = [0.0] * META_SIZE
    assert RankReport.from_row(row).micro_batch is None, "0: not reported"
    row[Meta.MICRO_BATCH] = 24.0
    assert RankReport.from_row(row).micro_batch == 24


class PeerWithMicroBatch(AveragingPlane):
    """Rank 1's row reports a micro-batch of 2; rank 0 is the engine under test."""

    def __init__(self) -> None:
        self.sent: list[torch.Tensor] = []

    def start(self, local: torch.Tensor) -> None:
        self.sent.append(local.clone())

    def collect(self) -> RoundResult:
        own = self.sent[-1].tolist()
        peer = [0.0] * META_SIZE
        for slot in (Meta.ROUND, Meta.EPOCH, Meta.SIGNATURE, Meta.FINITE, Meta.STEPS):
            peer[slot] = own[slot]
        peer[Meta.MICRO_BATCH] = 2.0
        return RoundResult([own, peer], round_weights([int(own[Meta.STEPS])] * 2, 1.0), None)


def test_the_engine_sends_its_micro_batch_in_the_round_metadata_and_reports_every_ranks() -> None:
    plane = PeerWithMicroBatch()
    engine = ElCheEngine(ElCheConfig(mode="cpu_sync"), plane, rank=0, world_size=2, device=torch.device("cpu"),
                         params=[torch.ones(4)], signature=42.0)
    engine.set_epoch_size(1000)
    engine.record_step(8, None, 0.1)
    engine.run_round(0, False)
    assert plane.sent[-1][Meta.MICRO_BATCH] == 0, "not set: nothing reported"
    engine.micro_batch_size = lambda: 3
    engine.record_step(8, None, 0.1)
    outcome = engine.run_round(0, False)[-1]
    assert plane.sent[-1][Meta.MICRO_BATCH] == 3
    assert [r.micro_batch for r in outcome.reports] == [3, 2]
    assert [t.micro_batch for t in engine.progress().totals] == [3, 2]
    metrics = engine.metrics(outcome)
    assert (metrics["elche/micro_batch/rank0"], metrics["elche/micro_batch/rank1"]) == (3.0, 2.0)
