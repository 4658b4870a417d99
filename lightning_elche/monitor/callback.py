"""``ElCheMonitor``: record log, scalar roll-ups, sub-epoch reports, dashboard and timeline.

Everything is fed by the strategy's round listener (``ElCheStrategy.add_round_listener``), which
runs on every rank after every sync with the round's outcome (every rank's steps, samples,
compute time and loss) and its ``elche/*`` metrics. Nothing here runs a collective inside the
training steps: user scalars, which only the rank that logged them knows, are gathered once per
epoch in ``on_train_epoch_end``, where every rank has left the epoch after the same round.

Membership changes: :meth:`ElCheMonitor.apply_change` (the strategy's membership listener)
records each change as ``event`` records (``label: "rank_lost"`` and ``"rank_joined"``,
:mod:`~lightning_elche.monitor.changes`) and follows the new numbering. Because the round
outcomes carry every rank's numbers, every rank keeps the root's view (the dashboard history,
the timeline, the report accumulator) and only the current rank 0 writes it out; when rank 0 is
lost, the new rank 0 takes over the root log (rewritten from its copy) and writes the dashboard
and the timeline at the end of fit. Rank-log files keep the rank's original number.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import time
import warnings
from typing import Any, Literal, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_elche.checks import require_int
from lightning_elche.engine import RoundOutcome
from lightning_elche.loop_glue import logged_callback_metrics
from lightning_elche.membership.change import Change
from lightning_elche.monitor.changes import change_records
from lightning_elche.monitor.dashboard import dashboard_data, validate_theme, write_dashboard
from lightning_elche.monitor.gather import gather_entries
from lightning_elche.monitor.record import (
    CORE_REDUCTIONS,
    DEFAULT_MAX_LOG_BYTES,
    DEFAULT_SCALAR_REDUCTION,
    MIN_LOG_BYTES,
    MemoryRing,
    RecordLog,
    epoch_rollup,
    rollup,
    validate_reductions,
)
from lightning_elche.monitor.reports import ReportAccumulator, ReportScheduler
from lightning_elche.monitor.round_columns import RoundColumns, logged_scalar
from lightning_elche.monitor.timeline import Timeline
from lightning_elche.strategy import ElCheStrategy
from lightning_elche.summary import FitMembers
from lightning_elche.version import __version__

ReductionName = Literal["mean", "sum", "max", "min", "last"]

MAX_PENDING = 8192
"""Syncs per epoch whose user scalars are kept for the epoch-end roll-up (thinned evenly beyond)."""


class ElCheMonitor(Callback):
    """Monitoring for :class:`~lightning_elche.ElCheStrategy` runs (flodl's monitor knobs).

    Args:
        record_log_dir: write the record log here: ``rank<r>.jsonl`` per rank (every sync's
            metrics, user scalars and per-rank work; a first ``meta`` record; ``r`` is the rank's
            number at launch) and, on rank 0, ``root.jsonl`` (the cross-rank roll-up). A lost rank
            is an ``event`` record (``label: "rank_lost"``) in every survivor's file and the root's,
            a joined rank one labelled ``"rank_joined"``. ``None``: no files.
        max_log_size: byte cap of each record-log file (drop-oldest ring; the meta record
            stays). ``None`` or ``0``: 32 MiB. Also caps the in-memory history each rank keeps.
        dashboard_html: at the end of fit, rank 0 (after a lost rank 0: the new rank 0) writes a
            self-contained HTML dashboard here; lost and joined ranks are markers on its time axes.
        dashboard_theme: ``"light"`` or ``"dark"`` pins the dashboard's theme; ``"auto"`` or
            ``None`` follows the reader's ``prefers-color-scheme``.
        reports_per_epoch: log at most this many ``elche/report/*`` points per epoch, at sync
            boundaries (rank 0, through the Trainer's loggers). ``None`` or ``0``: off.
        scalar_reductions: how each user scalar (a name logged with ``self.log``) rolls up across
            ranks: ``mean`` (work-weighted; the default), ``sum``, ``max``, ``min``, ``last``
            (the value of the rank that did the most work).
        timeline: at the end of fit, rank 0 writes a Chrome-trace JSON here (Perfetto,
            ``chrome://tracing``): per-rank compute windows and syncs, validation, epochs,
            anchor changes and throttled ranks.
    """

    def __init__(
        self,
        record_log_dir: Optional[str] = None,
        max_log_size: Optional[int] = None,
        dashboard_html: Optional[str] = None,
        dashboard_theme: Optional[Literal["light", "dark", "auto"]] = None,
        reports_per_epoch: Optional[int] = None,
        scalar_reductions: Optional[dict[str, ReductionName]] = None,
        timeline: Optional[str] = None,
    ) -> None:
        super().__init__()
        if max_log_size in (None, 0):
            max_log_size = DEFAULT_MAX_LOG_BYTES
        max_log_size = require_int(
            f"ElCheMonitor(max_log_size={max_log_size!r})", max_log_size, MIN_LOG_BYTES,
            f"expected an integer number of bytes >= {MIN_LOG_BYTES}, or 0/None for the default "
            f"{DEFAULT_MAX_LOG_BYTES}",
        )
        if reports_per_epoch is not None:
            reports_per_epoch = require_int(
                f"ElCheMonitor(reports_per_epoch={reports_per_epoch!r})", reports_per_epoch, 0,
                "expected an integer >= 0 (0 or None: off)",
            )
        for name, value in (("record_log_dir", record_log_dir), ("dashboard_html", dashboard_html),
                            ("timeline", timeline)):
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise ValueError(f"ElCheMonitor({name}={value!r}) is invalid: expected a path.")
        self.record_log_dir = os.fspath(record_log_dir) if record_log_dir is not None else None
        self.max_log_size = int(max_log_size)
        self.dashboard_html = os.fspath(dashboard_html) if dashboard_html is not None else None
        self.dashboard_theme = validate_theme(dashboard_theme)
        self.reports_per_epoch = reports_per_epoch or 0
        self.scalar_reductions = validate_reductions(scalar_reductions)
        self.timeline = os.fspath(timeline) if timeline is not None else None
        self._reset_runtime()

    # -- run-time state (built per fit, inside the rank processes) --------------------------

    def _reset_runtime(self) -> None:
        self._strategy: Optional[ElCheStrategy] = None
        self._trainer: Optional[Trainer] = None
        self._active = False
        self._rank = 0
        self._world = 1
        self._members = FitMembers([0])  # the original rank (member id) of each current rank
        self._original_rank = 0
        self._last_sync: Optional[int] = None
        self._t0 = 0.0
        self._rank_log: Optional[RecordLog] = None
        self._root_log: Optional[RecordLog] = None
        self._history: Optional[MemoryRing] = None
        self._pending: list[dict[str, Any]] = []  # this rank's user scalars at the current epoch's syncs
        self._pending_stride = 1
        self._epoch_syncs = 0
        self._epoch_start = 0.0
        self._val_start: Optional[float] = None
        self._val_keys: set[str] = set()
        self._timeline: Optional[Timeline] = None
        self._scheduler: Optional[ReportScheduler] = None
        self._accumulator: Optional[ReportAccumulator] = None
        self._meta: dict[str, Any] = {}
        self._warned = False
        self._written = False

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in list(state):
            if key.startswith("_"):
                del state[key]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_runtime()

    @property
    def _ranks(self) -> list[int]:
        return self._members.members

    @property
    def is_root(self) -> bool:
        return self._rank == 0

    def _now(self) -> float:
        return time.perf_counter() - self._t0

    def _warn_once(self, what: str, err: BaseException) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"ElCheMonitor (rank {self._rank}): {what} failed ({type(err).__name__}: {err}); training goes on "
                "and the monitor skips what it could not record.",
                RuntimeWarning,
                stacklevel=2,
            )

    # -- Lightning hooks -----------------------------------------------------------------------

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        strategy = trainer.strategy
        if not isinstance(strategy, ElCheStrategy):
            raise TypeError(
                f"ElCheMonitor records ElChe sync rounds and needs Trainer(strategy=ElCheStrategy(...)) "
                f"(or strategy='elche'); this Trainer's strategy is {type(strategy).__name__}. Remove the "
                "callback or switch the strategy."
            )
        self._reset_runtime()
        self._strategy = strategy
        self._trainer = trainer
        strategy.remove_round_listener(self._on_round)
        strategy.add_round_listener(self._on_round)
        strategy.remove_rank_loss_listener(self.apply_change)  # also the membership listeners
        strategy.add_membership_listener(self.apply_change)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        strategy = self._strategy
        if strategy is None:
            return
        self._active = True
        self._t0 = time.perf_counter()
        self._rank = int(trainer.global_rank)
        self._world = int(trainer.world_size)
        self._members = FitMembers(strategy.launch_ranks)
        self._original_rank = self._ranks[self._rank]
        self._meta = self._build_meta(trainer, strategy)
        if self.record_log_dir is not None:
            # Named by the original rank: after a loss, the new rank 0 must not overwrite the old one's file.
            self._rank_log = RecordLog(os.path.join(self.record_log_dir, f"rank{self._original_rank}.jsonl"),
                                       {**self._meta, "node": self._node, "rank": self._rank,
                                        "original_rank": self._original_rank}, self.max_log_size)
            if self.is_root:
                self._open_root_log()
        # The root's view lives on every rank (built from the round outcomes, which every rank
        # has), so that a new rank 0 can write it out when rank 0 is lost.
        self._history = MemoryRing(self.max_log_size)
        if self.timeline is not None:
            self._timeline = Timeline(self._world, ranks=self._ranks)
        if self.reports_per_epoch:
            self._scheduler = ReportScheduler(self.reports_per_epoch)
            self._accumulator = ReportAccumulator(self._world, ranks=list(self._ranks))

    @property
    def _node(self) -> str:
        return f"rank{self._original_rank}"

    def _open_root_log(self) -> None:
        """Start ``root.jsonl``: empty at the start of fit; on a new rank 0, this rank's copy of the root's records."""
        assert self.record_log_dir is not None
        self._root_log = RecordLog(os.path.join(self.record_log_dir, "root.jsonl"),
                                   {**self._meta, "node": "root", "root_original_rank": self._original_rank},
                                   self.max_log_size)
        for record in self._history or ():
            self._root_log.append(record)

    def _build_meta(self, trainer: Trainer, strategy: ElCheStrategy) -> dict[str, Any]:
        import lightning

        return {
            "ts": time.time(),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "world_size": self._world,
            "ranks": list(self._ranks),
            "config": strategy.elche.describe(),
            "strategy": {"chunk_batches": strategy.elche.chunk_batches,
                         "log_every_n_syncs": strategy.elche.log_every_n_syncs},
            "scalar_reductions": dict(self.scalar_reductions),
            "default_reduction": DEFAULT_SCALAR_REDUCTION,
            "core_reductions": dict(CORE_REDUCTIONS),
            "max_log_size": self.max_log_size,
            "versions": {
                "lightning_elche": __version__,
                "lightning": lightning.__version__,
                "torch": torch.__version__,
                "python": platform.python_version(),
            },
        }

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._active:
            return
        epoch = int(trainer.current_epoch)
        self._epoch_start = self._now()
        self._pending = []
        self._pending_stride = 1
        self._epoch_syncs = 0
        if self._timeline is not None:
            self._timeline.epoch_start(epoch, self._epoch_start)
        if self._scheduler is not None and self._accumulator is not None:
            self._scheduler.start_epoch(self._steps_per_epoch(trainer))
            self._accumulator.reset()

    def _steps_per_epoch(self, trainer: Trainer) -> int:
        progress = self._strategy.progress if self._strategy is not None else None
        batches = progress.epoch_batches if progress is not None else 0
        if batches <= 0:
            per_rank = trainer.num_training_batches
            batches = int(per_rank) * self._world if math.isfinite(per_rank) else 1
        return max(1, math.ceil(batches / max(1, int(trainer.accumulate_grad_batches))))

    # -- every sync ----------------------------------------------------------------------------

    def _on_round(self, outcome: RoundOutcome, metrics: dict[str, float]) -> None:
        if not self._active:
            return
        try:
            self._record_round(outcome, metrics)
        except Exception as err:  # the monitor must never fail training
            self._warn_once("recording a sync", err)

    def _record_round(self, outcome: RoundOutcome, metrics: dict[str, float]) -> None:
        trainer = self._trainer
        assert trainer is not None
        t = self._now()
        ts = time.time()
        epoch = int(trainer.current_epoch)
        self._last_sync = outcome.index
        reports = outcome.reports
        columns = RoundColumns.of(reports)
        steps, total, per_rank = columns.steps, sum(columns.steps), columns.as_record()
        core = [columns.core(k) for k in range(self._world)]
        mine = reports[self._rank]
        scalars = self._user_scalars(trainer) if mine.steps > 0 else {}
        common = {
            "ts": ts, "t": t, "sync": outcome.index, "epoch": epoch, "cohort_step": outcome.cohort_step,
            "global_step": int(trainer.global_step), "epoch_over": outcome.epoch_over, "anchor": outcome.anchor,
            "overhead": outcome.overhead, "planned": list(outcome.planned), "ranks": list(self._ranks),
        }
        if self._rank_log is not None:
            self._rank_log.append({"kind": "sync", "node": self._node, "rank": self._rank, **common,
                                   "work": mine.steps, "metrics": core[self._rank], "scalars": scalars,
                                   "per_rank": per_rank, "elche": metrics})
        self._epoch_syncs += 1
        self._keep_pending({"sync": outcome.index, "t": t, "work": mine.steps, "scalars": scalars})
        rolled = rollup([{"work": steps[k], "metrics": core[k]} for k in range(self._world)])
        root: dict[str, Any] = {"kind": "sync", "node": "root", **common, "work": total,
                                "metrics": rolled["metrics"], "per_rank": per_rank, "elche": metrics}
        if "elche/divergence" in metrics:
            root["divergence"] = metrics["elche/divergence"]
        self._root_record(root)
        if self._timeline is not None:
            self._timeline.round(outcome.index, t, epoch, steps, columns.samples, columns.compute_s,
                                 outcome.anchor, [s or 0.0 for s in columns.batch_share] if total else None)
        if self._scheduler is not None and self._accumulator is not None:
            self._accumulator.add(steps, columns.samples, columns.compute_s, [r.loss_sum for r in reports],
                                  columns.sync_s)
            if self._scheduler.add(total):
                self._log_report(trainer, outcome, t)

    def _keep_pending(self, entry: dict[str, Any]) -> None:
        """Keep this sync's user scalars for the epoch-end roll-up, thinned to at most MAX_PENDING.

        Every rank sees the same sync indices, so thinning by index keeps the same syncs everywhere.
        """
        if entry["sync"] % self._pending_stride == 0:
            self._pending.append(entry)
        if len(self._pending) > MAX_PENDING:
            self._pending_stride *= 2
            self._pending = [e for e in self._pending if e["sync"] % self._pending_stride == 0]

    def _user_scalars(self, trainer: Trainer) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, value in trainer.callback_metrics.items():
            if name in self._val_keys or name.startswith("elche/"):
                continue
            v = logged_scalar(value)
            if v is not None:
                out[name] = v
        return out

    def _log_report(self, trainer: Trainer, outcome: RoundOutcome, t: float) -> None:
        assert self._accumulator is not None and self._scheduler is not None
        payload = self._accumulator.payload()
        payload["elche/report/anchor"] = float(outcome.anchor)
        payload["elche/report/overhead"] = float(outcome.overhead)
        payload["elche/report/index"] = float(self._scheduler.fired)
        payload["elche/report/epoch_progress"] = min(1.0, self._scheduler.work / self._scheduler.steps_per_epoch)
        payload["elche/report/wall_s"] = t
        self._accumulator.reset()
        if self.is_root:
            for logger in trainer.loggers:
                logger.log_metrics(metrics=payload, step=trainer.global_step)
        self._root_record({"kind": "report", "node": "root", "t": t, "ts": time.time(), "sync": outcome.index,
                           "epoch": int(trainer.current_epoch), "metrics": payload})

    def _root_record(self, record: dict[str, Any]) -> None:
        """A record of the root's view: kept on every rank, written to ``root.jsonl`` by rank 0."""
        if self._history is not None:
            self._history.append(record)
        if self._root_log is not None and self.is_root:
            self._root_log.append(record)

    # -- validation ----------------------------------------------------------------------------

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._active and not trainer.sanity_checking:
            self._val_start = self._now()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking:
            if self._strategy is not None:  # learn the validation keys, so that syncs leave them out
                self._val_keys.update(self._validation_metrics(trainer))
            return
        if not self._active:
            return
        try:
            t = self._now()
            values = self._validation_metrics(trainer)
            self._val_keys.update(values)
            progress = self._strategy.progress if self._strategy is not None else None
            record = {"kind": "eval", "ts": time.time(), "t": t, "epoch": int(trainer.current_epoch),
                      "global_step": int(trainer.global_step),
                      "cohort_step": progress.cohort_step if progress is not None else None, "metrics": values}
            if self._rank_log is not None:
                self._rank_log.append({**record, "node": self._node})
            self._root_record({**record, "node": "root"})
            if self._timeline is not None and self._val_start is not None:
                self._timeline.validation(self._val_start, t, values)
        except Exception as err:
            self._warn_once("recording validation metrics", err)
        self._val_start = None

    @staticmethod
    def _validation_metrics(trainer: Trainer) -> dict[str, float]:
        # During on_validation_end the logger connector's results are the validation loop's, so
        # its "callback" metrics are exactly what validation logged.
        try:
            logged = logged_callback_metrics(trainer)
        except Exception:  # another Lightning layout: fall back to the naming convention
            logged = {k: v for k, v in trainer.callback_metrics.items() if k.startswith("val")}
        out: dict[str, float] = {}
        for name, value in logged.items():
            v = logged_scalar(value)
            if v is not None and not name.startswith("elche/"):
                out[name] = v
        return out

    # -- epoch end: the one place user scalars cross ranks ------------------------------------

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._active:
            return
        epoch = int(trainer.current_epoch)
        gathered = self._gather_pending(trainer)
        try:
            self._close_epoch(trainer, epoch, gathered)
        except Exception as err:
            self._warn_once("rolling up the epoch", err)

    def _gather_pending(self, trainer: Trainer) -> list[list[dict[str, Any]]]:
        """Every rank's per-sync user scalars of this epoch (on every rank); collective when W > 1."""
        # Each rank dates its roll-up with its own clock: the times stay home.
        entries = [{k: v for k, v in e.items() if k != "t"} for e in self._pending]
        return gather_entries(trainer.strategy, entries, self._world)

    def _close_epoch(self, trainer: Trainer, epoch: int, gathered: list[list[dict[str, Any]]]) -> None:
        t = self._now()
        if self._rank_log is not None:
            self._rank_log.append({"kind": "epoch", "node": self._node, "ts": time.time(), "t": t,
                                   "epoch": epoch, "start": self._epoch_start, "syncs": self._epoch_syncs})
        by_sync: dict[int, list[dict[str, Any]]] = {}
        for entries in gathered:
            for entry in entries:
                by_sync.setdefault(int(entry.get("sync", -1)), []).append(entry)
        for own in self._pending:
            rolled = rollup(by_sync.get(int(own["sync"]), []), self.scalar_reductions)["scalars"]
            if rolled:
                self._root_record({"kind": "scalars", "node": "root", "t": own.get("t"), "sync": own["sync"],
                                   "epoch": epoch, "scalars": rolled})
        summary = epoch_rollup(gathered, self.scalar_reductions)
        self._root_record({"kind": "epoch", "node": "root", "ts": time.time(), "t": t, "epoch": epoch,
                           "start": self._epoch_start, "scalars": summary})
        if summary and self.is_root:
            logged = {f"elche/scalars/{name}": value for name, value in summary.items()}
            for logger in trainer.loggers:
                logger.log_metrics(metrics=logged, step=trainer.global_step)
        if self._timeline is not None:
            self._timeline.epoch_end(epoch, t)
        self._pending = []

    # -- end of fit ----------------------------------------------------------------------------

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._finish(trainer, "end")

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._finish(trainer, f"exception: {type(exception).__name__}")

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._finish(trainer, "teardown")
            if self._strategy is not None:
                self._strategy.remove_round_listener(self._on_round)
                self._strategy.remove_rank_loss_listener(self.apply_change)

    def _finish(self, trainer: Trainer, how: str) -> None:
        if not self._active or self._written:
            return
        self._written = True
        t = self._now()
        try:
            ranks = self._rank_totals()
            end = {"kind": "end", "ts": time.time(), "t": t, "how": how, "ranks": ranks}
            if self._rank_log is not None:
                self._rank_log.append({**end, "node": self._node, "rank": self._rank})
            if self._root_log is not None:
                self._root_log.append({**end, "node": "root"})
            if self.is_root and self.dashboard_html is not None:
                meta = {"kind": "meta", **self._meta, "root_original_rank": self._original_rank}
                records = [meta, *(self._history or []), {**end, "node": "root"}]
                dropped = self._history.dropped if self._history is not None else 0
                write_dashboard(self.dashboard_html, dashboard_data(records, dropped=dropped), self.dashboard_theme)
            if self.is_root and self._timeline is not None and self.timeline is not None:
                self._timeline.write(self.timeline, {"world_size": self._world, "end": how,
                                                     "lost_ranks": list(self._members.lost),
                                                     "joined_ranks": list(self._members.joined)})
        except Exception as err:
            self._warn_once("writing the dashboard or timeline", err)
        finally:
            for log in (self._rank_log, self._root_log):
                if log is not None:
                    log.close()
            self._active = False

    def _rank_totals(self) -> list[dict[str, Any]]:
        """Whole-fit totals: one row per current rank (``joined`` when it joined during the fit), then
        one per lost rank (``lost``)."""
        progress = self._strategy.progress if self._strategy is not None else None
        if progress is None:
            return []
        members = self._members
        rows: list[dict[str, Any]] = [
            {"rank": k, "original_rank": members.members[k] if k < len(members.members) else k, "steps": tot.steps,
             "samples": tot.samples, "compute_s": tot.compute_s, "sync_s": tot.sync_s}
            for k, tot in enumerate(progress.totals)]
        for k in members.joined_ranks:
            if k < len(rows):
                rows[k]["joined"] = True  # its totals count from its join
        # The engine keeps the lost ranks' totals in the order they were lost, as this monitor does.
        lost_totals = progress.lost_totals if members.lost else ()
        for original, tot in zip(members.lost, lost_totals, strict=False):
            rows.append({"rank": None, "original_rank": original, "lost": True, "steps": tot.steps,
                         "samples": tot.samples, "compute_s": tot.compute_s, "sync_s": tot.sync_s})
        return rows

    # -- membership changes -----------------------------------------------------------------

    def apply_change(self, change: Change) -> None:
        """Follow a change of the fit's members (a ``ChangeHolder``, and the strategy's membership
        listener): its ``rank_lost`` and ``rank_joined`` events, the new numbering of the root's
        view. Runs on every member after the regroup, before the next round (no collectives);
        never fails training."""
        if not self._active:
            return
        try:
            self._record_change(change)
        except Exception as err:  # the monitor must never fail training
            self._warn_once("recording a lost rank" if change.is_loss else "recording a joined rank", err)

    def _record_change(self, change: Change) -> None:
        t, ts = self._now(), time.time()
        trainer = self._trainer
        epoch = int(trainer.current_epoch) if trainer is not None else 0
        # The next round has the next index: after a loss, the failed round runs again (a change may come
        # before this fit's first round).
        progress = self._strategy.progress if self._strategy is not None else None
        done = getattr(progress, "rounds", None)
        done = int(done) if isinstance(done, int) else self._last_sync
        sync = done + 1 if done is not None else None
        self._members.apply_change(change)
        self._world = len(self._ranks)
        self._rank = self._ranks.index(self._original_rank)
        strategy = self._strategy
        if strategy is not None and (strategy.global_rank, strategy.world_size) != (self._rank, self._world):
            raise RuntimeError(f"the monitor renumbered this rank to {self._rank} of {self._world}, the strategy to "
                               f"{strategy.global_rank} of {strategy.world_size}")
        records = change_records(change, t, ts, sync, epoch)
        if self._rank_log is not None:
            for record in records:
                self._rank_log.append({**record, "node": self._node, "rank": self._rank})
        if self._accumulator is not None:
            self._accumulator.apply_change(change)
        if self._timeline is not None:
            if change.is_loss:
                self._timeline.ranks_lost(t, change.generation, list(change.lost_original),
                                          [change.before[k] for k in change.survivors],
                                          {str(m): why for m, why in change.reasons.items()}, sync)
            if change.is_join:
                self._timeline.ranks_joined(t, change.generation, list(change.joined_ids), self._ranks, sync)
        roots = [{**record, "node": "root"} for record in records]
        if self.is_root and self._root_log is None and self.record_log_dir is not None:
            # Rank 0 was lost: this rank is the root from now on; its copy already ends with the events.
            if self._history is not None:
                for root in roots:
                    self._history.append(root)
            self._open_root_log()
        else:
            for root in roots:
                self._root_record(root)
