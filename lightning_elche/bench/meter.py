"""``BenchMeter``: the callback that times, scores and (when asked) stops one fit.

Clocks are host wall-clock (``time.time()``, comparable across the processes of one host); on
CUDA the device is synchronized at measurement boundaries only (fit start, epoch boundaries,
around held-out scoring), never per step.

* Steady state: from the start of epoch 1 to the end of the last epoch, with the samples this
  rank trained in between (epoch 0, with its warm-up, is excluded).
* Train clock: seconds since the start of training, minus the time spent scoring the held-out
  set; the quality curve and the time to target use it.
* Time cap: at each epoch end (from the second on), rank 0 decides whether the fit has run long
  enough and every rank adopts its decision through a gloo group, so all ranks stop together.
* ElChe trace: after each round rank 0 records the time, anchor, and per-rank step share.
* ElChe rounds: a round listener (host code the strategy calls after every round, on every
  rank) lets rank 0 keep each round's metadata (every rank's steps, window compute time, sync
  time of its previous round, out-of-data flag, epoch) and the controller's calibration count;
  at the end of training every rank adds the sync time of its last round, which no later round
  reports. Nothing is added to the training path: no collective, no device synchronization.
* Memory: the pinned host bytes the averaging plane holds, read at the end of training (before
  the strategy's teardown releases them); the accelerator peaks are read around ``fit`` by the
  worker (:mod:`lightning_elche.bench.memory`).
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_elche.bench.memory import plane_pinned_bytes
from lightning_elche.bench.workloads import Workload


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class BenchMeter(Callback):
    """Per-rank measurements of one fit; read :meth:`record` after ``fit``.

    Args:
        workload: scores the model on its held-out set when ``evaluate`` is true.
        evaluate: score rank 0's replica before training and after every epoch.
        stop_after_s: stop at the first epoch end (from the second epoch on) after this many
            seconds of train clock (``None``: run ``max_epochs``).
        control_group: gloo group used to agree on the stop (``None``: a single-process fit).
        trace_elche: record ElChe's rounds (rank 0).
    """

    def __init__(
        self,
        workload: Workload,
        evaluate: bool = False,
        stop_after_s: Optional[float] = None,
        control_group: Optional[Any] = None,
        trace_elche: bool = False,
    ) -> None:
        self.workload = workload
        self.evaluate = evaluate
        self.stop_after_s = stop_after_s
        self.control_group = control_group
        self.trace_elche = trace_elche
        self.device = torch.device("cpu")
        self.rank = 0
        self.t_fit0 = 0.0
        self.eval_s = 0.0
        self.t_start: Optional[float] = None
        self.t_end: Optional[float] = None
        self.epoch_ends: list[float] = []
        self.samples = 0
        self.steps = 0
        self.total_samples = 0
        self.total_steps = 0
        self.curve: list[dict[str, float]] = []
        self.trace: list[dict[str, Any]] = []
        self.stopped_by_cap = False
        self._last_round = 0
        self.rounds: list[dict[str, Any]] = []
        self.final_sync_s: Optional[float] = None
        self.pinned_held: Optional[int] = None
        self._listening: Any = None

    # -- clocks ---------------------------------------------------------------------------

    def train_clock(self) -> float:
        return time.time() - self.t_fit0 - self.eval_s

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.device = trainer.strategy.root_device
        self.rank = trainer.global_rank
        _sync(self.device)
        self.t_fit0 = time.time()
        if self.evaluate and self.rank == 0:
            self._score(pl_module, epoch=-1)
        # Rank 0 only: the metadata of a round is the same on every rank.
        if self.trace_elche and self.rank == 0 and hasattr(trainer.strategy, "add_round_listener"):
            trainer.strategy.add_round_listener(self._on_round)
            self._listening = trainer.strategy

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if hasattr(trainer.strategy, "remove_round_listener"):
            trainer.strategy.remove_round_listener(self._on_round)
        self._listening = None
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None:
            # The engine's own duration of this rank's last sync (set when its last round returned):
            # every earlier one is reported by the next round's metadata, this one by no round.
            last = getattr(engine, "_last_sync_s", None)
            self.final_sync_s = float(last) if isinstance(last, (int, float)) else None
        self.pinned_held = plane_pinned_bytes(trainer.strategy)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.current_epoch == 1:
            _sync(self.device)
            self.t_start = time.time()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        n = int(batch[-1].shape[0])
        self.total_samples += n
        self.total_steps += 1
        if trainer.current_epoch >= 1:
            self.samples += n
            self.steps += 1
        if self.trace_elche and self.rank == 0:
            self._trace_round(trainer)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        _sync(self.device)
        self.t_end = time.time()
        self.epoch_ends.append(self.t_end - self.t_fit0 - self.eval_s)
        if self.evaluate and self.rank == 0:
            self._score(pl_module, epoch=trainer.current_epoch)
        if self.stop_after_s is not None and trainer.current_epoch >= 1:
            stop = self._agree(self.train_clock() >= self.stop_after_s)
            if stop:
                self.stopped_by_cap = True
                trainer.should_stop = True

    # -- parts ----------------------------------------------------------------------------

    def _agree(self, local: bool) -> bool:
        if self.control_group is None:
            return local
        box = [local]
        dist.broadcast_object_list(box, src=0, group=self.control_group)
        return bool(box[0])

    def _score(self, module: LightningModule, epoch: int) -> None:
        _sync(self.device)
        t0 = time.time()
        scores = self.workload.evaluate(module)
        _sync(self.device)
        t1 = time.time()
        point = {"epoch": epoch, "train_s": t0 - self.t_fit0 - self.eval_s, "samples": self.total_samples, **scores}
        self.eval_s += t1 - t0
        self.curve.append(point)

    def _trace_round(self, trainer: Trainer) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        outcome = getattr(engine, "last_outcome", None)
        if outcome is None:
            return
        try:
            index = int(outcome.index)
            if index == self._last_round:
                return
            steps = [int(r.steps) for r in outcome.reports]
            point = {"round": index, "train_s": self.train_clock(), "anchor": int(outcome.anchor), "steps": steps,
                     "planned": [int(n) for n in outcome.planned],
                     # Accelerator stall of each rank's previous sync (cpu_async on CUDA), None if unmeasured.
                     "stall_ms": [getattr(r, "stall_ms", None) for r in outcome.reports]}
        except (AttributeError, TypeError, ValueError):  # the engine's outcome changed shape: stop tracing
            self.trace_elche = False
            return
        self._last_round = index
        total = sum(steps)
        point["share"] = [s / total if total else 0.0 for s in steps]
        self.trace.append(point)

    def _on_round(self, outcome: Any, metrics: dict[str, float]) -> None:
        """Round listener (rank 0, every round; host values only)."""
        if self._listening is None:
            return
        engine = getattr(self._listening, "engine", None)
        controller = getattr(engine, "controller", None)
        try:
            reports = outcome.reports
            self.rounds.append({
                "index": int(outcome.index),
                "t": time.time(),
                "steps": [int(r.steps) for r in reports],
                "compute_s": [float(r.compute_s) for r in reports],
                "last_sync_s": [float(r.last_sync_s) for r in reports],
                "out_of_data": [bool(r.out_of_data) for r in reports],
                "epoch": [int(r.epoch) for r in reports],
                "calibrations": int(getattr(controller, "calibration_count", -1)),
            })
        except (AttributeError, TypeError, ValueError):  # the outcome changed shape: stop recording
            self.rounds = []
            self._listening = None  # removing it here would disturb the strategy's loop over its listeners

    def record(self) -> dict[str, Any]:
        """This rank's numbers (plain JSON values)."""
        return {
            "rank": self.rank,
            "device_type": self.device.type,
            "t_fit0": self.t_fit0,
            "t_start": self.t_start,
            "t_end": self.t_end,
            "eval_s": self.eval_s,
            "epoch_ends_train_s": self.epoch_ends,
            "samples": self.samples,
            "steps": self.steps,
            "total_samples": self.total_samples,
            "total_steps": self.total_steps,
            "curve": self.curve,
            "trace": self.trace,
            "stopped_by_cap": self.stopped_by_cap,
            "rounds": self.rounds,
            "final_sync_s": self.final_sync_s,
            "pinned_held": self.pinned_held,
        }
