"""One rank of a churn arm (``python -m lightning_elche.bench.churn_fit OUT --kind elche|ddp ...``).

The churn harness (:mod:`lightning_elche.bench.churn`) starts it three ways:

* **ElChe**: as launch rank 0 with ``--devices N``; Lightning's popen launcher starts ranks 1..N-1
  (the same command with ``LOCAL_RANK``). A replacement is the same command with ``ELCHE_JOIN=1``,
  ``LOCAL_RANK=0`` and ``ELCHE_CHURN_SLOT`` (the killed process's throttle slot): it joins at a
  consensus round.
* **DDP**: under ``python -m torch.distributed.run --max-restarts ...``; every attempt resumes
  from ``OUT/ckpt/last.ckpt`` when it exists. Every ``--ckpt-every`` optimizer steps every rank
  calls ``trainer.save_checkpoint`` on a temporary name, and rank 0 renames it over ``last.ckpt``
  (a rename: a kill mid-write never leaves a torn ``last.ckpt``).

The process's *slot* (``ELCHE_CHURN_SLOT``, else ``LOCAL_RANK``) picks its sleep throttle from
``--slowdowns``: a replacement inherits the speed of the process it replaces.

Every process appends JSON lines to ``OUT/events.jsonl`` (one ``os.write`` each, ``O_APPEND``: lines
of concurrent writers do not interleave): ``start`` (its ``on_train_start``); ElChe launch rank 0:
``round`` after every averaging round (host metadata from the round listener: samples and steps
of every member in that round, members); DDP global rank 0: ``step`` after every optimizer step
(``global_step`` of the model it holds, samples of that step over all ranks) and ``ckpt`` after each
checkpoint is in place (its ``global_step``). Nothing else runs
per step: no collective, no device synchronization.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy

from lightning_elche import ElCheStrategy
from lightning_elche.bench.workloads import ImagesWorkload, train_loader
from lightning_elche.testing import Throttle

EVENTS = "events.jsonl"
CKPT = "last.ckpt"


def slot() -> int:
    """This process's throttle slot: ``ELCHE_CHURN_SLOT`` (a replacement), else ``LOCAL_RANK``."""
    return int(os.environ.get("ELCHE_CHURN_SLOT", os.environ.get("LOCAL_RANK", "0")))


def append_event(out: str, record: dict[str, Any]) -> None:
    line = (json.dumps({**record, "pid": os.getpid()}) + "\n").encode()
    fd = os.open(os.path.join(out, EVENTS), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


class SlotThrottle(Throttle):
    """``Throttle`` of whatever global rank this process has when the fit sets up (a joiner learns
    its rank only then; a renumbering later does not move the throttle off this process)."""

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.rank = trainer.global_rank
        super().setup(trainer, pl_module, stage)


class ChurnRecorder(Callback):
    """Writes the events of the module docstring."""

    def __init__(self, out: str, kind: str) -> None:
        self.out, self.kind = out, kind
        self.joiner = bool(os.environ.get("ELCHE_JOIN"))
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self._strategy: Optional[Any] = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        append_event(self.out, {"event": "start", "time": time.time(), "slot": slot(), "joiner": self.joiner,
                                "global_rank": trainer.global_rank, "world": trainer.world_size,
                                "attempt": self.attempt, "global_step": trainer.global_step,
                                "cpus": sorted(os.sched_getaffinity(0))})
        if self.kind == "elche" and not self.joiner and trainer.global_rank == 0:
            self._strategy = trainer.strategy
            trainer.strategy.add_round_listener(self._on_round)  # type: ignore[attr-defined]

    def _on_round(self, outcome: Any, metrics: dict[str, float]) -> None:
        reports = outcome.reports
        append_event(self.out, {"event": "round", "time": time.time(), "index": int(outcome.index),
                                "samples": sum(int(r.samples) for r in reports),
                                "steps": sum(int(r.steps) for r in reports), "world": len(reports),
                                # per member: steps, samples, compute seconds, out of data
                                "ranks": [[int(r.steps), int(r.samples), round(float(r.compute_s), 3),
                                           bool(r.out_of_data)] for r in reports]})

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.kind == "ddp" and trainer.global_rank == 0:
            append_event(self.out, {"event": "step", "time": time.time(), "global_step": trainer.global_step,
                                    "attempt": self.attempt,
                                    "samples": int(batch[-1].shape[0]) * trainer.world_size})

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._strategy is not None:
            self._strategy.remove_round_listener(self._on_round)
            self._strategy = None


class StepCheckpoint(Callback):
    """DDP: every ``every`` optimizer steps, a whole checkpoint renamed over ``last.ckpt``."""

    def __init__(self, directory: str, every: int) -> None:
        self.directory, self.every = directory, every

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step % self.every:
            return
        temporary = os.path.join(self.directory, f"{CKPT}.tmp")
        trainer.save_checkpoint(temporary)  # every rank calls it; rank 0 writes, then a barrier
        if trainer.global_rank == 0:
            os.replace(temporary, os.path.join(self.directory, CKPT))
            append_event(str(Path(self.directory).parent), {"event": "ckpt", "time": time.time(),
                                                            "global_step": trainer.global_step})


def init_attempt_group() -> None:
    """DDP under torchrun: the default process group on the job's store under a prefix of its own per
    attempt (``TORCHELASTIC_RESTART_COUNT``). Lightning's own ``env://`` init reads the store without
    one, and a restarted attempt then found the previous attempt's gloo addresses there and failed
    to connect (torch 2.13, ``--standalone``); Lightning sees the group and keeps it."""
    from datetime import timedelta

    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    hosted_by_agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not hosted_by_agent and rank == 0, timeout=timedelta(seconds=60))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group("gloo", store=dist.PrefixStore(f"/elche_churn/attempt_{attempt}", store), rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lightning_elche.bench.churn_fit")
    parser.add_argument("out")
    parser.add_argument("--kind", choices=("elche", "ddp"), required=True)
    parser.add_argument("--mode", default="cpu_cadence")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4096, help="training samples per epoch")
    parser.add_argument("--slowdowns", default="1", help="comma-separated sleep factors by slot")
    parser.add_argument("--ckpt-every", type=int, default=20, help="DDP: optimizer steps between checkpoints")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    callbacks: list[Callback] = [ChurnRecorder(args.out, args.kind)]
    slowdowns = [float(v) for v in args.slowdowns.split(",")]
    factor = slowdowns[slot() % len(slowdowns)]
    if factor > 1.0:
        callbacks.append(SlotThrottle(0, factor, method="sleep"))
    ckpt_dir = os.path.join(args.out, "ckpt")
    resume: Optional[str] = None
    if args.kind == "ddp":
        Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
        callbacks.append(StepCheckpoint(ckpt_dir, args.ckpt_every))
        init_attempt_group()
        strategy: Any = DDPStrategy(process_group_backend="gloo")
        resume = os.path.join(ckpt_dir, CKPT) if os.path.exists(os.path.join(ckpt_dir, CKPT)) else None
    else:
        strategy = ElCheStrategy(mode=args.mode, summary=False)
    workload = ImagesWorkload(args.model, args.samples, torch.device("cpu"))
    trainer = Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_epochs=1_000_000,
                      callbacks=callbacks, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                      enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=args.out)
    trainer.fit(workload.make_module(), train_loader(workload.train_set(), args.batch, drop_last=True),
                ckpt_path=resume)


if __name__ == "__main__":
    main()
