"""Rank 0 of a CPU job (Lightning's popen launcher starts the others) in which ranks are lost.

    python fault_fit.py OUT_DIR --mode M --devices 3 --fault kill:1:12 [--fault stop:2:30] [--max-failure N]

A fault is ``KIND:RANK:STEP[:EPOCH]``: on original rank ``RANK``, before its optimizer step number ``STEP``
(with ``EPOCH``: its ``STEP``-th step of that epoch, from 0, or with ``STEP`` ``last`` its last batch of it)
(its own count), ``kill`` sends itself SIGKILL, ``stop`` SIGSTOP, ``raise`` raises in the step,
``oom`` raises ``torch.OutOfMemoryError`` as a CUDA allocation that fails inside the step would,
``exit`` ends the process with ``os._exit(1)`` (no exception, no notice), ``loop`` spins in an
endless loop inside the step (its heartbeat goes on), ``sleep_in_collective`` makes the rank's next
collective (the next round's, whichever thread runs it) block forever (its heartbeat goes on; the
fault's time is then when it enters that collective).
Every rank appends each batch it trains to ``steps-rank<original rank>.jsonl`` (flushed at once,
so a killed rank's record survives it); every rank that finishes writes ``result-rank<r>.json``
(its final numbering, parameters and the losses it saw).

``--stall S`` passes ``stall_timeout=timedelta(seconds=S)`` (default: derived);
``--stall-floor S`` lowers the derived bound's floor for short test jobs.
A process started with ``ELCHE_JOIN=1`` (and ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` of the job)
joins the running job; ``ELCHE_TEST_MEMBER`` names it until the job gives it a member id, which then
names its files (the faults given to it match the first name). ``--joiner-dies`` makes it die right after
its request (before it acknowledges admission), ``--joiner-dies-after-ack`` (SIGKILL) once it acknowledged
its admission and read the admitted list, before the new process group; ``--joiner-fails-in-admission
KIND:STAGE`` kills (``kill``) or stops (``stop``) it at ``STAGE`` of its admission (``regrouped``: the new
group is up, its state not yet arrived); ``--request-after-first-join``
makes it ask only once the first joiner acknowledged its admission, ``--request-once-held`` only once
launch rank 0 holds for it; ``--join-when-dry`` (cohort and joiner, pooled modes) makes the members train
to the epoch's end after an admission and the joiner's first claim wait for that (its first iterator is
empty); ``--width`` changes the model (a
bad join). ``--hold-for-joiner STEP[:COUNT[:WORLD]]`` (repeatable): launch rank 0 waits once, at its first
batch from step ``STEP`` on with at least ``WORLD`` ranks in the fit, until ``COUNT`` (default 1) joiners
asked to join (each hold appends a line to ``holds-rank0.jsonl``). ``--member-dies-in-admission RANK:POINT`` SIGKILLs
launch rank ``RANK`` in its first admission: at ``admitted`` (the admitted list read, before the new
group), ``entered`` (the entry settled with it there, before the new group), ``side_group`` (its side
group's rendezvous, ``cpu_*`` modes, wherever it is built), ``taking`` (as its engine takes the change,
after Lightning's rank view, the session and the dispatch) or ``applied`` (the change
applied, the joiner's state sent), and launch rank 0 also at ``offered`` (the joiner acknowledged, the
admitted list not out), ``sending`` (the new group up, before the joiner's state) or ``rest`` (the
holders took the change, before the rest of the joiner's state); it writes its
``fault-rank<r>.json`` first.

``--val-fault KIND:RANK:BATCH:EPOCH`` injects ``kill``/``stop``/``raise``/``exit`` (at the batch's start)
or ``loop`` (an endless loop inside ``validation_step``) on original rank ``RANK`` at its validation batch
``BATCH`` of the validation after training epoch ``EPOCH`` (``sanity``: in the sanity check;
``--sanity-steps N`` runs one, ``-1`` over the whole validation set). Every rank appends
each validation it finishes to ``val-rank<original rank>.jsonl``: the synced ``val_*`` metrics, the
parameters it validated and its numbering. ``--val-delay RANK:SECONDS`` makes every validation step of
``RANK`` sleep that long (slow by design, steady).

``--epoch-end-fault KIND:RANK:PHASE:EPOCH`` injects ``kill``/``stop``/``raise``/``exit``/``loop`` on original rank
``RANK`` at the end of training epoch ``EPOCH``, in ``PHASE``: ``epoch_end_log`` (the module's
``on_train_epoch_end``, before its ``self.log("epoch_members", sync_dist=True)``), ``epoch_end_callback``
(a callback's ``on_train_epoch_end``, before its ``strategy.reduce``/``barrier``/``all_gather``) or
``checkpoint_save`` (the epoch's first ``ModelCheckpoint`` save: rank 0 halfway through writing the file,
any other rank while the checkpoint is dumped). With it (or ``--epoch-end-probes``) every rank logs
``epoch_members`` (2**original rank, summed over the ranks) at each epoch end, its callback reduces,
gathers and barriers there, and every rank appends to ``epoch-end-rank<original rank>.jsonl`` what those
returned, the ``epoch_members`` it logged and the epoch of ``ckpt/last.ckpt`` at the next epoch's
start; every checkpoint file written whole is appended to ``writes.jsonl`` (by whom, in which epoch).

``--restart-lost N`` passes ``ElCheStrategy(restart_lost=N)``: the launcher restarts a lost child as a
joiner (it names its files by the launch world size, the member id it gets).

``--digits`` trains the digits workload of tests/test_convergence.py instead (scikit-learn digits, MLP
64-256-256-10, SGD with momentum; ``--samples`` is ignored, no validation loop) and adds the held-out
accuracy and loss of the final parameters to ``result-rank<r>.json``; ``--seed`` seeds the fit.

``--params N`` makes the model an MLP 8-w-w-1 of about N parameters (w = sqrt(N)): a large state
for a joiner to receive (tools/join_timing.py).

``--monitor DIR`` attaches an ``ElCheMonitor`` writing its record log to ``DIR/records``, its
dashboard to ``DIR/dashboard.html`` and its timeline to ``DIR/timeline.json``.

``--epoch-metrics`` logs one epoch metric of each kind from ``training_step``: ``epoch_synced``
(``sync_dist=True``, summed: the epoch's batches over all ranks), ``epoch_unsynced`` (no sync: the
epoch's index, the same on every rank that trained) and ``epoch_torchmetric`` (a ``SumMetric`` of the
samples trained, synced by torchmetrics: the epoch's samples); and it steps three schedulers, all
keeping the learning rate: a step-interval and an epoch-interval ``LambdaLR`` and a step-interval
``ReduceLROnPlateau`` on ``val_sq_err`` (from the first validation on). Every rank appends each
``log_metrics`` call its loggers get to ``logged-rank<original rank>.jsonl`` (step and metrics: the
loggers of a rank other than 0 write nothing) and, after each epoch's end, its step counters, its
schedulers' counts and how long the epoch's end took (from the callbacks' ``on_train_epoch_end``)
to ``epoch-ends-rank<original rank>.jsonl`` (and, at its first epoch's start, the counts it starts
from).

``--step-schedule`` adds a step-interval ``StepLR`` that decays the learning rate at every step; every
``result-rank<r>.json`` has the rank's schedulers' final states, learning rates and ``global_step``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import CSVLogger, Logger  # noqa: E402
from multirank_helpers import IndexedSamples, StepDelay  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_elche import ElCheConfig, ElCheMonitor, ElCheStrategy  # noqa: E402

# One node: the rank given at launch (a joiner: the name the test gives it; a child that Lightning's
# launcher restarted, with ``--restart-lost``: the launch world size, the member id of the first joiner).
_RESTARTED = bool(os.environ.get("ELCHE_JOIN")) and "ELCHE_TEST_MEMBER" not in os.environ and "WORLD_SIZE" in os.environ
# A joiner started without LOCAL_RANK brings its devices' ranks: they are named from ELCHE_TEST_MEMBER on.
_LOCAL = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")))  # a launcher's, or srun's
ORIGINAL_RANK = (int(os.environ["WORLD_SIZE"]) if _RESTARTED else
                 int(os.environ["ELCHE_TEST_MEMBER"]) + _LOCAL if "ELCHE_TEST_MEMBER" in os.environ else _LOCAL)
CHANGES: list[dict[str, Any]] = []
KINDS = ("kill", "stop", "raise", "oom", "exit", "loop", "sleep_in_collective")
EPOCH_END_PHASES = ("epoch_end_log", "epoch_end_callback", "checkpoint_save", "train_end_callback",
                    "train_end_buffers")
"""``train_end_*``: after the last epoch (EPOCH must be the last), in a callback's ``on_train_end`` before
its own reduce and barrier, or inside ElChe's end-of-training buffer average (its first all-reduce)."""
EPOCH_END_FAULTS: dict[str, tuple[str, int]] = {}
"""This rank's epoch-end faults: phase -> (kind, epoch)."""
VALIDATION_STEP_S = [0.0]
"""``--val-delay``: how long each of this rank's validation steps sleeps (a slow but steady rank)."""
LOOP_IN_VALIDATION_STEP = [False]
"""Set by a ``loop`` validation fault at its batch's start: the step itself then spins."""


class FaultLogModel(pl.LightningModule):
    def __init__(self, out_dir: str, samples: int, batch_size: int, width: int = 16, params: int = 0) -> None:
        super().__init__()
        self.lr = 0.05
        if params:
            wide = int((-11 + (121 + 4 * (params - 1)) ** 0.5) / 2)  # w * w + 11 w + 1 = params
            self.net = nn.Sequential(nn.Linear(8, wide), nn.Tanh(), nn.Linear(wide, wide), nn.Tanh(),
                                     nn.Linear(wide, 1))
            self.lr = 0.05 / wide  # the output sums `wide` units: 0.05 diverged within 3 rounds at 1e6
        else:
            self.net = nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 1))
        self.out_dir, self.samples, self.batch_size = out_dir, samples, batch_size
        self.probes = False
        self.epoch_metrics = False
        self.step_schedule = False
        self._log: Optional[Any] = None

    def record_step(self, idx: torch.Tensor, batch_idx: int) -> None:
        """One row per training_step call: per micro-batch when the rank splits its batches (the
        batch's index tells which rows make one batch)."""
        if self._log is None:
            self._log = open(Path(self.out_dir, f"steps-rank{ORIGINAL_RANK}.jsonl"), "a")  # noqa: SIM115
        self._log.write(json.dumps({"epoch": self.current_epoch, "batch_idx": batch_idx, "indices": idx.tolist(),
                                    "time": time.time()}) + "\n")
        self._log.flush()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        idx, x, y = batch
        self.record_step(idx, batch_idx)
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        if self.epoch_metrics:
            self.log_epoch_metrics(len(idx))
        return loss

    def log_epoch_metrics(self, samples: int) -> None:
        """``--epoch-metrics``: one epoch metric of each kind (synced, unsynced, a torchmetric)."""
        self.log("epoch_synced", 1.0, on_step=False, on_epoch=True, reduce_fx="sum", sync_dist=True)
        self.log("epoch_unsynced", float(self.current_epoch), on_step=False, on_epoch=True)
        self.samples_metric.update(float(samples))
        self.log("epoch_torchmetric", self.samples_metric, on_step=False, on_epoch=True)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if LOOP_IN_VALIDATION_STEP[0]:
            fail_now("loop")  # inside the step, where ElChe judges it by its own evaluation steps
        if VALIDATION_STEP_S[0]:
            time.sleep(VALIDATION_STEP_S[0])
        idx, x, y = batch
        self.log("val_count", float(len(idx)), on_step=False, on_epoch=True, reduce_fx="sum", sync_dist=True)
        # Sums over the whole set once reduced: each sample counted once, under the parameters validated.
        self.log("val_index_sum", float(idx.sum()), on_step=False, on_epoch=True, reduce_fx="sum", sync_dist=True)
        squared = nn.functional.mse_loss(self.net(x), y, reduction="sum")
        self.log("val_sq_err", squared, on_step=False, on_epoch=True, reduce_fx="sum", sync_dist=True)

    def on_train_epoch_end(self) -> None:
        if not self.probes:
            return
        fire_epoch_end_fault(self.out_dir, "epoch_end_log", self.trainer)
        # Summed over the ranks that reduced it: which ranks the logged value counts.
        self.log("epoch_members", float(2 ** ORIGINAL_RANK), reduce_fx="sum", sync_dist=True)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        if self.step_schedule:  # a learning rate that moves at every cohort step: one step apart shows
            decay = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.995)
            return [optimizer], [{"scheduler": decay, "interval": "step", "name": "decay_per_step"}]
        if not self.epoch_metrics:
            return optimizer
        # Schedulers that count their steps and keep the learning rate (the fit trains as without them).
        keep = torch.optim.lr_scheduler.LambdaLR
        return [optimizer], [
            {"scheduler": keep(optimizer, lambda step: 1.0), "interval": "step", "name": "per_step"},
            {"scheduler": keep(optimizer, lambda epoch: 1.0), "interval": "epoch", "name": "per_epoch"},
            # On a metric a rank that trained no batch has too (its epoch-end validation's).
            {"scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=10**9), "interval": "step",
             "monitor": "val_sq_err", "strict": False, "name": "plateau_per_step"},
        ]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(IndexedSamples(self.samples), batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(IndexedSamples(96), batch_size=8)

    def on_fit_end(self) -> None:
        strategy = self.trainer.strategy
        record = {
            "original_rank": ORIGINAL_RANK,
            "global_rank": self.trainer.global_rank,
            "world_size": self.trainer.world_size,
            "is_global_zero": self.trainer.is_global_zero,
            "environment": type(strategy.cluster_environment).__name__,
            "val_count": float(self.trainer.callback_metrics.get("val_count", -1.0)),
            "params": [p.detach().flatten().tolist() for p in self.parameters()],
            "losses": [
                {"generation": loss.generation, "lost": loss.lost_original, "dropped": list(loss.dropped),
                 "reasons": loss.reasons,
                 "trained_batches": loss.trained_batches, "detected_at": loss.detected_at,
                 "regrouped_with": loss.regrouped_with}
                for loss in strategy.lost_ranks
            ],
            "changes": CHANGES,
            "global_step": self.trainer.global_step,
            "schedulers": [c.scheduler.state_dict() for c in self.trainer.lr_scheduler_configs],
            "lrs": [group["lr"] for optimizer in self.trainer.optimizers for group in optimizer.param_groups],
        }
        Path(self.out_dir, f"result-rank{ORIGINAL_RANK}.json").write_text(json.dumps(record))


class IndexedDigits(torch.utils.data.Dataset):
    """``(index, x, y)`` rows of the digits workload's training split (the index for the step record)."""

    def __init__(self) -> None:
        from lightning_elche.bench.workloads import digits_split

        train, (self.held_x, self.held_y) = digits_split(torch.device("cpu"))
        self.x, self.y = train.tensors

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


class DigitsLogModel(FaultLogModel):
    """The digits workload's MLP and optimizer with FaultLogModel's step record; the result gains the
    held-out accuracy and loss of the parameters the fit ends with."""

    def __init__(self, out_dir: str, batch_size: int) -> None:
        from lightning_elche.bench.workloads import mlp

        digits = IndexedDigits()
        super().__init__(out_dir, len(digits), batch_size)
        self.digits, self.net = digits, mlp(64, 256, 2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        idx, x, y = batch
        self.record_step(idx, batch_idx)
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.digits, batch_size=self.batch_size, shuffle=True)

    def on_fit_end(self) -> None:
        super().on_fit_end()
        with torch.no_grad():
            logits = self.net(self.digits.held_x)
            held = {"held_out_acc": float((logits.argmax(dim=1) == self.digits.held_y).float().mean()),
                    "held_out_loss": float(nn.functional.cross_entropy(logits, self.digits.held_y))}
        path = Path(self.out_dir, f"result-rank{ORIGINAL_RANK}.json")
        path.write_text(json.dumps({**json.loads(path.read_text()), **held}))


LAST_STEP = -1
"""``--fault KIND:RANK:last:EPOCH``: the rank's last batch of the epoch (known once its loader is dry)."""


class InjectFault(pl.Callback):
    """Before this rank's optimizer step number ``step`` (of epoch ``epoch``, when given): the fault
    ``kind`` (once; the module's docstring lists them)."""

    def __init__(self, out_dir: str, kind: str, step: int, epoch: Optional[int] = None) -> None:
        self.out_dir, self.kind, self.step, self.epoch = out_dir, kind, step, epoch
        self.epoch_steps = 0

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.epoch_steps = 0

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        in_epoch, self.epoch_steps = self.epoch_steps, self.epoch_steps + 1
        if self.epoch is None and trainer.global_step != self.step:
            return
        if self.epoch is not None and trainer.current_epoch != self.epoch:
            return
        last = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch  # the fetcher found no batch after it
        if self.epoch is not None and (in_epoch != self.step if self.step != LAST_STEP else not last):
            return
        record: dict[str, Any] = {"kind": self.kind, "time": time.time(), "epoch": trainer.current_epoch}
        progress = getattr(getattr(trainer.strategy, "_membership", None), "progress", None)
        if progress is not None:  # this rank's own measured window and the bound it publishes
            record.update({"window_s": progress.window_s, "sync_s": progress.sync_s, "bound_s": progress.bound_s})
        Path(self.out_dir, f"fault-rank{ORIGINAL_RANK}.json").write_text(json.dumps(record))
        if self.kind == "sleep_in_collective":
            sleep_in_next_collective(self.out_dir, trainer, record)
        else:
            fail_now(self.kind)


def fail_now(kind: str) -> None:
    if kind == "loop":
        spin = 0
        while True:  # an endless loop in user code: the GIL is released between bytecodes only
            spin += 1
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif kind == "exit":
        os._exit(1)
    elif kind == "oom":
        raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB (injected on rank "
                                     f"{ORIGINAL_RANK})")
    else:
        raise RuntimeError(f"injected fault on rank {ORIGINAL_RANK}")


class InjectValidationFault(pl.Callback):
    """At this rank's validation batch ``batch`` of the validation after epoch ``epoch`` (None: the
    sanity check): kill, stop, exit or raise (once)."""

    def __init__(self, out_dir: str, kind: str, batch: int, epoch: Optional[int]) -> None:
        self.out_dir, self.kind, self.batch, self.epoch = out_dir, kind, batch, epoch
        self.fired = False

    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:
        here = trainer.sanity_checking if self.epoch is None else (
            not trainer.sanity_checking and trainer.current_epoch == self.epoch)
        if self.fired or not here or batch_idx != self.batch:
            return
        self.fired = True
        record = {"kind": self.kind, "time": time.time(), "epoch": trainer.current_epoch,
                  "phase": "sanity" if trainer.sanity_checking else "validation"}
        Path(self.out_dir, f"fault-rank{ORIGINAL_RANK}.json").write_text(json.dumps(record))
        if self.kind == "loop":
            LOOP_IN_VALIDATION_STEP[0] = True
        else:
            fail_now(self.kind)


def fire_epoch_end_fault(out_dir: str, phase: str, trainer: pl.Trainer, epoch: Optional[int] = None) -> None:
    """The fault of ``phase`` at the end of ``epoch`` (default: this epoch), if this rank has one there (once)."""
    epoch = trainer.current_epoch if epoch is None else epoch
    fault = EPOCH_END_FAULTS.get(phase)
    if fault is None or fault[1] != epoch:
        return
    del EPOCH_END_FAULTS[phase]
    record = {"kind": fault[0], "time": time.time(), "epoch": epoch, "phase": phase}
    Path(out_dir, f"fault-rank{ORIGINAL_RANK}.json").write_text(json.dumps(record))
    fail_now(fault[0])


class EpochEndCollectives(pl.Callback):
    """At each epoch end, a callback's own collectives (a reduce, a barrier, a gather); what they
    returned, the ``epoch_members`` the module logged and the epoch ``last.ckpt`` holds go to
    ``epoch-end-rank<r>.jsonl``. Every checkpoint file written whole goes to ``writes.jsonl``, and
    the ``checkpoint_save`` fault is injected into the save."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.epoch = -1  # the last epoch that ended

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        io = trainer.strategy.checkpoint_io
        write = io.save_checkpoint

        def save_checkpoint(checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
            name = Path(str(path)).name
            final = name.removeprefix(".").rsplit(".", 2)[0] if name.endswith(".partial") else name
            pending = EPOCH_END_FAULTS.get("checkpoint_save")
            if pending is not None and pending[1] == trainer.current_epoch:
                Path(str(path)).parent.mkdir(parents=True, exist_ok=True)
                Path(str(path)).write_bytes(b"half a checkpoint")  # the writer dies halfway
                fire_epoch_end_fault(self.out_dir, "checkpoint_save", trainer)
            write(checkpoint, path, storage_options=storage_options)
            self._append("writes.jsonl", {"name": final, "epoch": trainer.current_epoch, "rank": ORIGINAL_RANK,
                                          "time": time.time()})

        io.save_checkpoint = save_checkpoint  # type: ignore[method-assign]

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        if ORIGINAL_RANK != 0:  # rank 0's fault comes in the write
            fire_epoch_end_fault(self.out_dir, "checkpoint_save", trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.epoch = trainer.current_epoch
        fire_epoch_end_fault(self.out_dir, "epoch_end_callback", trainer)
        strategy = trainer.strategy
        reduced = strategy.reduce(torch.tensor(float(2 ** ORIGINAL_RANK)), reduce_op="sum")
        strategy.barrier("epoch_end_callback")
        gathered = strategy.all_gather(torch.tensor([ORIGINAL_RANK]))
        self._append(f"epoch-end-rank{ORIGINAL_RANK}.jsonl", {
            "epoch": trainer.current_epoch, "reduced": float(reduced), "gathered": gathered.flatten().tolist(),
            "world_size": trainer.world_size})

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch > 0:
            self._logged(trainer, trainer.current_epoch - 1)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._logged(trainer, self.epoch)
        fire_epoch_end_fault(self.out_dir, "train_end_callback", trainer, self.epoch)  # current_epoch is past it
        strategy = trainer.strategy
        reduced = strategy.reduce(torch.tensor(float(2 ** ORIGINAL_RANK)), reduce_op="sum")
        strategy.barrier("train_end_callback")
        self._append(f"epoch-end-rank{ORIGINAL_RANK}.jsonl", {"train_end_reduced": float(reduced),
                                                              "world_size": trainer.world_size})
        if EPOCH_END_FAULTS.get("train_end_buffers", ("", -1))[1] == self.epoch:
            # The strategy's on_train_end comes next: its buffer average's first all-reduce is this rank's end.
            all_reduce = torch.distributed.all_reduce

            def fail_in_all_reduce(*args: Any, **kwargs: Any) -> Any:
                torch.distributed.all_reduce = all_reduce  # type: ignore[assignment]
                fire_epoch_end_fault(self.out_dir, "train_end_buffers", trainer, self.epoch)
                return all_reduce(*args, **kwargs)

            torch.distributed.all_reduce = fail_in_all_reduce  # type: ignore[assignment]

    def _logged(self, trainer: pl.Trainer, epoch: int) -> None:
        last = Path(self.out_dir, "ckpt", "last.ckpt")
        saved = torch.load(last, weights_only=False, map_location="cpu")["epoch"] if last.exists() else None
        self._append(f"epoch-end-rank{ORIGINAL_RANK}.jsonl", {
            "logged_epoch": epoch, "epoch_members": float(trainer.callback_metrics.get("epoch_members", -1.0)),
            "last_ckpt_epoch": saved})

    def _append(self, name: str, record: dict[str, Any]) -> None:
        with open(Path(self.out_dir, name), "a") as sink:
            sink.write(json.dumps(record) + "\n")


class RecordingLogger(Logger):
    """Every ``log_metrics`` call this rank's loggers get (Lightning's own loggers write on rank 0
    only), to ``logged-rank<original rank>.jsonl``."""

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.path = Path(out_dir, f"logged-rank{ORIGINAL_RANK}.jsonl")

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        with open(self.path, "a") as sink:
            sink.write(json.dumps({"step": step, "metrics": {k: float(v) for k, v in metrics.items()}}) + "\n")


class RecordEpochEnds(pl.Callback):
    """After each training epoch's end (the next epoch's start, or the end of training): this rank's
    step counters, its schedulers' counts and the epoch end's duration, to
    ``epoch-ends-rank<original rank>.jsonl``."""

    def __init__(self, out_dir: str) -> None:
        self.path = Path(out_dir, f"epoch-ends-rank{ORIGINAL_RANK}.jsonl")
        self.first_epoch: Optional[int] = None  # a joiner starts in the cohort's epoch
        self.ending = 0.0  # when this rank's last epoch end started (its callbacks' on_train_epoch_end)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.ending = time.time()

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.first_epoch is None:
            self.first_epoch = trainer.current_epoch
            self._record(trainer, trainer.current_epoch, start=True)
        elif trainer.current_epoch > self.first_epoch:
            self._record(trainer, trainer.current_epoch - 1)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._record(trainer, trainer.current_epoch - 1)  # Lightning counted the last epoch as done

    def _record(self, trainer: pl.Trainer, epoch: int, start: bool = False) -> None:
        engine = trainer.strategy.engine  # type: ignore[attr-defined]
        with open(self.path, "a") as sink:
            sink.write(json.dumps({
                "epoch": epoch, "start": start, "global_step": trainer.global_step,
                "epoch_end_s": None if start else time.time() - self.ending,  # its hooks, metrics, saves
                "cohort_step": engine.state.cohort_step,
                "batches_that_stepped": trainer.fit_loop.epoch_loop._batches_that_stepped,
                "schedulers": {c.name: c.scheduler.last_epoch for c in trainer.lr_scheduler_configs}}) + "\n")


class RecordValidation(pl.Callback):
    """Every validation this rank finished: the synced metrics and the parameters it validated."""

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val_")}
        record = {"epoch": trainer.current_epoch, "sanity": trainer.sanity_checking, "metrics": metrics,
                  "world_size": trainer.world_size, "global_rank": trainer.global_rank,
                  "params": [p.detach().flatten().tolist() for p in pl_module.parameters()]}
        with open(Path(trainer.default_root_dir, f"val-rank{ORIGINAL_RANK}.jsonl"), "a") as sink:
            sink.write(json.dumps(record) + "\n")


def sleep_in_next_collective(out_dir: str, trainer: pl.Trainer, record: dict[str, Any]) -> None:
    """Replace the collectives the rounds call: the first one entered blocks forever (a hung kernel
    or transport), in the thread that enters it; the fault's record takes that moment."""
    import threading

    import torch.distributed as dist

    def hang(*args: Any, **kwargs: Any) -> None:
        Path(out_dir, f"fault-rank{ORIGINAL_RANK}.json").write_text(json.dumps(
            {**record, "time": time.time(), "epoch": trainer.current_epoch}))
        threading.Event().wait()

    for name in ("all_gather_single", "all_gather_into_tensor", "all_gather", "all_reduce", "broadcast", "barrier"):
        if hasattr(dist, name):
            setattr(dist, name, hang)


class RecordChanges(pl.Callback):
    """Every membership change this rank took, through the strategy's membership listener."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        trainer.strategy.add_membership_listener(lambda change: CHANGES.append(
            {"generation": change.generation, "joined": list(change.joined_ids), "lost": change.lost_original,
             "dropped": list(change.dropped), "world_size": change.world_size_after, "epoch": trainer.current_epoch,
             "global_step": trainer.global_step}))


class HoldForJoiner(pl.Callback):
    """Launch rank 0, once: at its first batch from its optimizer step ``step`` on at which the fit
    has at least ``world`` ranks, wait until ``count`` joiners have asked to join (a loaded test
    machine may take longer to start a joiner than the fit takes to end).

    ``epoch_end``: instead, at the start of its last batch of epoch ``epoch_end`` (the pool dry),
    first wait ``EPOCH_END_SETTLE_S`` for the other ranks to train what they claimed and wait in the
    epoch's last round, then let the joiners ask (``--request-once-held``): their requests reach
    that round, which cannot admit them."""

    def __init__(self, step: int, count: int = 1, world: int = 0, epoch_end: Optional[int] = None) -> None:
        self.step, self.count, self.world, self.epoch_end = step, count, world, epoch_end
        self.held = False

    def _due(self, trainer: pl.Trainer) -> bool:
        if self.epoch_end is not None:
            return (trainer.current_epoch == self.epoch_end
                    and bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch))
        return trainer.global_step >= self.step and trainer.world_size >= self.world

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.held or not self._due(trainer):
            return
        self.held = True
        if self.epoch_end is not None:
            time.sleep(EPOCH_END_SETTLE_S)
        store, deadline = trainer.strategy.job_store, time.monotonic() + 180.0
        store.set(HOLDING_KEY, str(trainer.current_epoch))
        # Waiting here is not a stall: the peers judge this rank by its progress after its first round.
        progress = getattr(getattr(trainer.strategy, "_membership", None), "progress", None)
        started = time.monotonic()
        while int(store.add("lightning_elche/join/requests", 0)) < self.count and time.monotonic() < deadline:
            if progress is not None:
                progress.advance()
            time.sleep(0.1)
        with open(Path(trainer.default_root_dir, "holds-rank0.jsonl"), "a") as sink:  # which holds came, and how
            sink.write(json.dumps({"step": self.step, "count": self.count, "at_step": trainer.global_step,
                                   "epoch": trainer.current_epoch, "waited_s": round(time.monotonic() - started, 2),
                                   "requests": int(store.add("lightning_elche/join/requests", 0))}) + "\n")


HOLDING_KEY = "lightning_elche/test/rank0-holds"
EPOCH_END_SETTLE_S = 3.0


def request_once_held() -> None:
    """A joiner asks to join only once launch rank 0 waits for it (``--hold-for-joiner``): the join
    comes at that step, however fast the joiner starts."""
    from lightning_elche.membership import admission

    request = admission.JoinerLink.request

    def request_later(self: Any, *args: Any, **kwargs: Any) -> None:
        deadline = time.monotonic() + 180.0
        while not self.store.check([HOLDING_KEY]) and time.monotonic() < deadline:
            if self.store.check([admission.key("fit_over")]):
                break  # rank 0 was lost before its hold and the fit ended: the request finds it over
            time.sleep(0.1)
        request(self, *args, **kwargs)

    admission.JoinerLink.request = request_later  # type: ignore[method-assign]


def join_when_dry(out_dir: str) -> None:
    """``--join-when-dry``: the joiner is admitted to an epoch whose work the members then claim all
    before it can claim any (its first iterator is empty). A member that admitted a joiner joins no
    round of that epoch before it is out of data (it trains through the pool); the joiner's first claim
    waits (at most 60 s) until the pool and the queue of its span are dry, and it writes
    ``dry-rank<r>.json`` (the epoch, and whether they were)."""
    from lightning_elche import growth
    from lightning_elche.dispatch.pool import PoolDispatch
    from lightning_elche.engine import ElCheEngine

    if not os.environ.get("ELCHE_JOIN"):
        admit_joiners, window_due = growth.Growth._admit_joiners, ElCheEngine.window_due

        def admit_then_train_to_the_end(self: Any, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
            admit_joiners(self, trainer, *args, **kwargs)
            NO_ROUNDS_IN_EPOCH[0] = int(trainer.current_epoch)

        def due_unless_training_to_the_end(self: Any) -> bool:
            return NO_ROUNDS_IN_EPOCH[0] != TRAINING_EPOCH[0] and window_due(self)

        growth.Growth._admit_joiners = admit_then_train_to_the_end  # type: ignore[method-assign]
        ElCheEngine.window_due = due_unless_training_to_the_end  # type: ignore[method-assign]
        return
    continue_epoch = PoolDispatch._continue_epoch
    waited: list[bool] = []

    def continue_once_dry(self: Any, order: list[int]) -> Any:
        if not waited:
            deadline = time.monotonic() + 60.0
            while self._work_left() and time.monotonic() < deadline:
                time.sleep(0.05)
            waited.append(not self._work_left())
            Path(out_dir, f"dry-rank{ORIGINAL_RANK}.json").write_text(json.dumps({"epoch": self.epoch,
                                                                                 "dry": waited[0]}))
        return continue_epoch(self, order)

    PoolDispatch._continue_epoch = continue_once_dry  # type: ignore[method-assign]


NO_ROUNDS_IN_EPOCH = [-1]
"""``--join-when-dry`` on a member: the epoch in which it admitted a joiner."""
TRAINING_EPOCH = [-1]
"""The epoch of this rank's latest training batch (``TrainingEpoch``)."""


class TrainingEpoch(pl.Callback):
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        TRAINING_EPOCH[0] = int(trainer.current_epoch)


def die_after_the_request() -> None:
    from lightning_elche.membership import admission

    def die(*args: Any, **kwargs: Any) -> None:
        os._exit(3)

    admission.JoinerLink.wait_admission = die  # type: ignore[method-assign]


def die_after_the_ack() -> None:
    from lightning_elche.membership import admission

    acknowledge = admission.JoinerLink.wait_admission

    def acknowledge_then_die(self: Any, *args: Any, **kwargs: Any) -> Any:
        acknowledge(self, *args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)

    admission.JoinerLink.wait_admission = acknowledge_then_die  # type: ignore[method-assign]


def fail_in_admission(kind: str, stage: str) -> None:
    """``--joiner-fails-in-admission KIND:STAGE``: the joiner ``kill``s (SIGKILL) or ``stop``s (SIGSTOP)
    itself at ``STAGE``: ``regrouped`` (the new group is up, before its state arrived) or ``rest`` (it
    has its first state and the holders took the change; rank 0 sends the rest)."""
    from lightning_elche import growth

    if kind not in ("kill", "stop") or stage not in ("regrouped", "rest"):
        raise SystemExit(f"--joiner-fails-in-admission {kind}:{stage} is invalid: expected kill or stop, then "
                         "regrouped or rest")
    name = "_take_first" if stage == "regrouped" else "_take_rest"
    take = getattr(growth.Growth, name)

    def fail_then_take(*args: Any, **kwargs: Any) -> Any:
        os.kill(os.getpid(), signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        return take(*args, **kwargs)

    setattr(growth.Growth, name, fail_then_take)


def request_after_the_first_join() -> None:
    """A joiner asks to join only once the first joiner acknowledged its admission (so that it is
    admitted in a change of its own, with the first one already a member)."""
    from lightning_elche.membership import admission

    request = admission.JoinerLink.request

    def request_later(self: Any, *args: Any, **kwargs: Any) -> None:
        # Not past the fit's end (the first joiner may never be admitted): the request then finds it over.
        deadline, first = time.monotonic() + 180.0, admission.key("request/0")
        while time.monotonic() < deadline and not self.store.check([admission.key("fit_over")]):
            if self.store.check([first]):
                member = json.loads(self.store.get(first))["member"]
                if self.store.check([admission.key(f"ack/{member}")]):
                    break
            time.sleep(0.1)
        request(self, *args, **kwargs)

    admission.JoinerLink.request = request_later  # type: ignore[method-assign]


def die_in_admission(out_dir: str, point: str) -> None:
    """SIGKILL this member in its first admission, at ``point`` (``admitted``, ``entered``, ``side_group``,
    ``taking``, ``applied``; rank 0: ``offered``, ``sending``, ``rest``)."""
    from lightning_elche import growth
    from lightning_elche.membership import admission

    def fault_record() -> None:
        rows = Path(out_dir, f"steps-rank{ORIGINAL_RANK}.jsonl").read_text().splitlines()
        epoch = json.loads(rows[-1])["epoch"] if rows else 0
        Path(out_dir, f"fault-rank{ORIGINAL_RANK}.json").write_text(json.dumps(
            {"kind": f"kill in admission ({point})", "time": time.time(), "epoch": epoch}))
        os.kill(os.getpid(), signal.SIGKILL)

    if point == "admitted":
        admit = admission.Admitter.admit

        def admit_then_die(self: Any, count: int) -> list[int]:
            joined = admit(self, count)
            if joined:
                fault_record()
            return joined

        admission.Admitter.admit = admit_then_die  # type: ignore[method-assign]
    elif point == "entered":  # said it is there (the entry settled), before the new group
        settle_entry = growth.settle_entry

        def settle_then_die(*args: Any, **kwargs: Any) -> Any:
            entry = settle_entry(*args, **kwargs)
            if not kwargs.get("stage"):
                fault_record()
            return entry

        growth.settle_entry = settle_then_die  # type: ignore[assignment]
    elif point == "offered":  # rank 0: the joiner acknowledged, the admitted list is not out yet
        acknowledged = admission.Admitter._acknowledged

        def acknowledged_then_die(self: Any, *args: Any, **kwargs: Any) -> bool:
            acknowledged(self, *args, **kwargs)
            fault_record()
            return False

        admission.Admitter._acknowledged = acknowledged_then_die  # type: ignore[method-assign]
    elif point == "sending":  # rank 0: the new group is up, the joiner waits for its state
        def die_instead(*args: Any, **kwargs: Any) -> int:
            fault_record()
            return 0

        growth.Growth._deliver = staticmethod(die_instead)  # type: ignore[assignment]
    elif point == "rest":  # rank 0: the holders took the change, the joiner waits for the rest of its state
        def die_instead_of_the_rest(*args: Any, **kwargs: Any) -> None:
            fault_record()

        growth.Growth._send = staticmethod(die_instead_of_the_rest)  # type: ignore[assignment]
    elif point in ("side_group", "taking"):
        die_while_the_holders_take_the_change(point, fault_record)
    elif point == "applied":
        admit_joiners = growth.Growth._admit_joiners

        def admit_joiners_then_die(self: Any, *args: Any, **kwargs: Any) -> None:
            admit_joiners(self, *args, **kwargs)
            fault_record()

        growth.Growth._admit_joiners = admit_joiners_then_die  # type: ignore[method-assign]
    else:
        raise SystemExit(f"--member-dies-in-admission POINT={point!r} is invalid: expected admitted, entered, "
                         "side_group, taking, applied, offered, sending or rest")


def die_while_the_holders_take_the_change(point: str, die: Callable[[], None]) -> None:
    """``side_group``: die as this member's side group (``cpu_*`` modes) starts its rendezvous in its
    first admission, wherever that is built; ``taking``: die as its engine takes the admission's
    change (Lightning's rank view, the session and the dispatch took it already)."""
    from lightning_elche import growth
    from lightning_elche.engine import ElCheEngine

    admitting = threading.Event()
    admit_joiners = growth.Growth._admit_joiners

    def admit_joiners_marked(self: Any, *args: Any, **kwargs: Any) -> None:
        admitting.set()
        admit_joiners(self, *args, **kwargs)

    growth.Growth._admit_joiners = admit_joiners_marked  # type: ignore[method-assign]
    if point == "side_group":
        new_group = torch.distributed.new_group

        def die_at_the_side_group(*args: Any, **kwargs: Any) -> Any:
            if admitting.is_set():
                die()
            return new_group(*args, **kwargs)

        torch.distributed.new_group = die_at_the_side_group
        return
    apply_change = ElCheEngine.apply_change

    def die_taking(self: Any, *args: Any, **kwargs: Any) -> None:
        if admitting.is_set():
            die()
        apply_change(self, *args, **kwargs)

    ElCheEngine.apply_change = die_taking  # type: ignore[method-assign]


def micro_batch(value: Optional[str]) -> Any:
    """``--micro-batch``: ``M`` (every rank) or ``RANK=M,...`` (by rank at the fit's start)."""
    if value is None or "=" not in value:
        return None if value is None else int(value)
    return {int(rank): int(size) for rank, size in (pair.split("=") for pair in value.split(","))}


MEMBER_ID_SAID = "fault_fit.py: this joiner is member "


def name_files_by_member_id() -> None:
    """A joiner's files follow the member id the job gives it (the order the joiners connected in,
    a restarted child's included), which is what the members' losses and changes name; the faults
    it was given were matched to it by the name it started with."""
    from lightning_elche.membership import admission

    take_member_id = admission.JoinerLink.take_member_id

    def take_and_name(self: Any, launch_world_size: int) -> int:
        global ORIGINAL_RANK
        ORIGINAL_RANK = take_member_id(self, launch_world_size)
        print(f"{MEMBER_ID_SAID}{ORIGINAL_RANK}", flush=True)  # which process the member id is (its log)
        return ORIGINAL_RANK

    admission.JoinerLink.take_member_id = take_and_name  # type: ignore[method-assign]


def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    if os.environ.get("ELCHE_JOIN"):
        name_files_by_member_id()
    if args.joiner_dies:
        die_after_the_request()
    if args.joiner_dies_after_ack:
        die_after_the_ack()
    if args.joiner_fails_in_admission is not None:
        fail_in_admission(*args.joiner_fails_in_admission.split(":"))
    if args.request_after_first_join:
        request_after_the_first_join()
    if args.request_once_held:
        request_once_held()
    if args.join_when_dry:
        join_when_dry(args.out_dir)
    if args.member_dies_in_admission is not None:
        rank, point = args.member_dies_in_admission.split(":")
        if int(rank) == ORIGINAL_RANK and not os.environ.get("ELCHE_JOIN"):
            die_in_admission(args.out_dir, point)
    pl.seed_everything(args.seed)
    callbacks: list[pl.Callback] = [StepDelay(args.delays_ms), RecordChanges(), RecordValidation(), TrainingEpoch()]
    for fault in args.val_fault:
        kind, rank, batch, epoch = fault.split(":")
        if int(rank) == ORIGINAL_RANK:
            callbacks.append(InjectValidationFault(args.out_dir, kind, int(batch),
                                                   None if epoch == "sanity" else int(epoch)))
    for fault in args.epoch_end_fault:
        kind, rank, phase, epoch = fault.split(":")
        if phase not in EPOCH_END_PHASES:
            raise SystemExit(f"--epoch-end-fault {fault} is invalid: expected KIND:RANK:PHASE:EPOCH with PHASE one "
                             f"of {EPOCH_END_PHASES}")
        if int(rank) == ORIGINAL_RANK:
            EPOCH_END_FAULTS[phase] = (kind, int(epoch))
    probes = args.epoch_end_probes or bool(args.epoch_end_fault)
    if probes:
        callbacks.append(EpochEndCollectives(args.out_dir))
    if ORIGINAL_RANK == 0 and not os.environ.get("ELCHE_JOIN"):
        for hold in args.hold_for_joiner:
            step, count, world = (hold.split(":") + ["1", "0"])[:3]
            if step.startswith("end"):  # endE: rank 0's last batch of epoch E
                callbacks.append(HoldForJoiner(0, int(count), epoch_end=int(step.removeprefix("end"))))
            else:
                callbacks.append(HoldForJoiner(int(step), int(count), int(world)))
    for fault in args.fault:
        kind, rank, step, *epoch = fault.split(":")
        if kind not in KINDS:
            raise SystemExit(f"--fault {fault} is invalid: expected KIND:RANK:STEP[:EPOCH] with KIND one of {KINDS}")
        if step == "last" and not epoch:
            raise SystemExit(f"--fault {fault} is invalid: STEP 'last' needs an EPOCH")
        if int(rank) == ORIGINAL_RANK:
            callbacks.append(InjectFault(args.out_dir, kind, LAST_STEP if step == "last" else int(step),
                                         int(epoch[0]) if epoch else None))
    if args.epoch_metrics:
        callbacks.append(RecordEpochEnds(args.out_dir))
    if args.monitor is not None:
        monitor_dir = Path(args.monitor)
        callbacks.append(ElCheMonitor(record_log_dir=str(monitor_dir / "records"),
                                      dashboard_html=str(monitor_dir / "dashboard.html"),
                                      timeline=str(monitor_dir / "timeline.json"), reports_per_epoch=2))
    max_failure: Any = args.max_failure
    if max_failure is not None:
        max_failure = float(max_failure) if "." in max_failure else int(max_failure)
    # Rank-zero-only work (the logger's files, the checkpoint) must follow rank 0 when it is lost.
    callbacks.append(ModelCheckpoint(dirpath=str(Path(args.out_dir, "ckpt")), save_last=True, every_n_epochs=1))
    if args.stall_floor is not None:
        from lightning_elche.membership import stall

        stall.STALL_FLOOR = timedelta(seconds=args.stall_floor)
    stall_timeout = None if args.stall is None else timedelta(seconds=args.stall)
    trainer = pl.Trainer(
        accelerator=args.accelerator, devices=args.devices, max_epochs=args.epochs,
        strategy=ElCheStrategy(mode=None if args.anchor else args.mode,
                               elche=ElCheConfig(mode=args.mode, anchor=args.anchor, min_anchor=args.anchor)
                               if args.anchor else None,
                               max_failure=max_failure, summary=True,
                               micro_batch=micro_batch(args.micro_batch),
                               liveness_timeout=timedelta(seconds=args.liveness), stall_timeout=stall_timeout,
                               snapshot_timeout=timedelta(seconds=60), timeout=timedelta(seconds=120),
                               restart_lost=args.restart_lost),
        callbacks=callbacks, logger=[CSVLogger(args.out_dir, name="csv", version=0),
                                     *([RecordingLogger(args.out_dir)] if args.epoch_metrics else [])],
        enable_progress_bar=True,
        enable_model_summary=False, num_sanity_val_steps=args.sanity_steps, default_root_dir=args.out_dir,
        log_every_n_steps=1, **({"limit_val_batches": 0} if args.digits else {}),
    )
    model = (DigitsLogModel(args.out_dir, args.batch_size) if args.digits
             else FaultLogModel(args.out_dir, args.samples, args.batch_size, args.width, int(args.params)))
    model.probes = probes
    if args.epoch_metrics:
        import torchmetrics

        model.epoch_metrics, model.samples_metric = True, torchmetrics.SumMetric()
    model.step_schedule = args.step_schedule
    for delay in args.val_delay:
        rank, seconds = delay.split(":")
        if int(rank) == ORIGINAL_RANK:
            VALIDATION_STEP_S[0] = float(seconds)
    trainer.fit(model)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--mode", default="nccl_cadence")
    parser.add_argument("--devices", type=int, default=3)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=480)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--fault", action="append", default=[])
    parser.add_argument("--max-failure", default=None)
    parser.add_argument("--val-fault", action="append", default=[], help="KIND:RANK:BATCH:EPOCH (EPOCH: or sanity)")
    parser.add_argument("--epoch-end-fault", action="append", default=[],
                        help="KIND:RANK:PHASE:EPOCH (PHASE: epoch_end_log, epoch_end_callback or checkpoint_save)")
    parser.add_argument("--epoch-end-probes", action="store_true", help="the epoch-end collectives, without a fault")
    parser.add_argument("--micro-batch", default=None, help="ElCheStrategy(micro_batch): M or RANK=M,...")
    parser.add_argument("--val-delay", action="append", default=[], help="RANK:SECONDS slept in each validation step")
    parser.add_argument("--sanity-steps", type=int, default=0, help="Trainer(num_sanity_val_steps)")
    parser.add_argument("--liveness", type=float, default=5.0)
    parser.add_argument("--delays-ms", type=float, nargs="+", default=[2.0, 5.0, 3.0])
    parser.add_argument("--stall", type=float, default=None, help="stall_timeout in seconds (default: derived)")
    parser.add_argument("--stall-floor", type=float, default=None, help="the derived stall bound's floor, seconds")
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--joiner-dies", action="store_true")
    parser.add_argument("--joiner-dies-after-ack", action="store_true")
    parser.add_argument("--joiner-fails-in-admission", default=None, help="KIND:STAGE (kill, stop; regrouped, rest)")
    parser.add_argument("--request-after-first-join", action="store_true", help="a joiner asks once the first acked")
    parser.add_argument("--request-once-held", action="store_true", help="a joiner asks once rank 0 holds for it")
    parser.add_argument("--join-when-dry", action="store_true", help="the joiner's first iterator finds no work")
    parser.add_argument("--restart-lost", type=int, default=0, help="ElCheStrategy(restart_lost=N)")
    parser.add_argument("--member-dies-in-admission", default=None,
                        help="RANK:POINT (admitted, entered, side_group, taking, applied; rank 0: offered, "
                        "sending, rest)")
    parser.add_argument("--hold-for-joiner", action="append", default=[],
                        help="STEP[:COUNT[:WORLD]]: launch rank 0 waits there for COUNT join requests "
                        "(STEP endE: at its last batch of epoch E, once the others wait in the epoch's last round)")
    parser.add_argument("--params", type=float, default=0, help="an MLP of about this many parameters")
    parser.add_argument("--digits", action="store_true", help="the digits workload (held-out accuracy in the result)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--anchor", type=int, default=None, help="ElCheConfig(anchor=min_anchor=N): long windows")
    parser.add_argument("--monitor", default=None, help="attach an ElCheMonitor writing under this directory")
    parser.add_argument("--epoch-metrics", action="store_true",
                        help="log an epoch metric of each kind, step schedulers, record what is logged")
    parser.add_argument("--step-schedule", action="store_true",
                        help="a StepLR decaying the learning rate at every step (interval step)")
    main(parser.parse_args())
