"""ElChe vs Lightning's DDP on a heterogeneous 2-rank CPU rig (rank 1 made ``--slowdown`` x slower).

One invocation runs four arms, in this order:

1. ``solo`` and ``solo_throttled``: one rank's workload trained alone, unthrottled and throttled,
   as two independent single-process fits running *concurrently* (one torch thread each), so that
   they compete for the cores as the two ranks of the 2-rank arms do. The sum of their rates is
   the ideal heterogeneous throughput: nothing can beat it.
2. ``ddp``: Lightning's stock ``DDPStrategy`` (gradient all-reduce every step), rank 1 throttled.
3. ``elche``: ``ElCheStrategy(mode="nccl_cadence")``, rank 1 throttled.

Throughput is measured in steady state: from the start of epoch 1 to the end of the last epoch
(epoch 0, with its warm-up, is excluded), counting the samples every rank trained in that span.
Each rank writes its numbers to a JSON file from a callback, since ``spawn`` only returns rank 0's
state. Run::

    python examples/hetero_demo.py                  # about 2 minutes on 2 cores
    python examples/hetero_demo.py --quick --json /tmp/hetero.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

# Pin one thread per process before torch is imported (Lightning then leaves the setting alone).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from demo_models import DemoDataModule, DemoModel, accuracy  # noqa: E402
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, Strategy  # noqa: E402

from lightning_elche import ElCheStrategy  # noqa: E402
from lightning_elche.testing import Throttle  # noqa: E402

PG_TIMEOUT = timedelta(seconds=60)
SOLO_TIMEOUT_S = 600
ARMS = ("solo", "solo_throttled", "ddp", "elche")


class Meter(Callback):
    """Records this rank's steady-state span and samples, and writes them to ``out_dir``.

    The span starts at the start of epoch 1 and ends at the end of the last epoch; samples are
    those this rank trained in between. Rank 0 also scores the final model on a held-out split
    (after the span, so it costs no throughput).
    """

    def __init__(self, out_dir: str, arm: str, held_out: int = 2048) -> None:
        self.out_dir = out_dir
        self.arm = arm
        self.held_out = held_out
        self.t_start: Optional[float] = None
        self.t_end: Optional[float] = None
        self.samples = 0
        self.steps = 0
        self.total_samples = 0

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        torch.set_num_threads(1)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.current_epoch == 1:
            self.t_start = time.time()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        n = len(batch[1])
        self.total_samples += n
        if trainer.current_epoch >= 1:
            self.samples += n
            self.steps += 1

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.t_end = time.time()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        record: dict[str, Any] = {
            "arm": self.arm,
            "rank": trainer.global_rank,
            "t_start": self.t_start,
            "t_end": self.t_end,
            "samples": self.samples,
            "steps": self.steps,
            "total_samples": self.total_samples,
            "epochs": trainer.current_epoch,
        }
        throttle = next((c for c in trainer.callbacks if isinstance(c, Throttle)), None)
        if throttle is not None and throttle.active_method is not None:
            record["throttle_sleep_s"] = throttle.sleep_s
        if trainer.global_rank == 0:
            datamodule = trainer.datamodule
            held_out = datamodule.split(self.held_out, split_seed=2)
            record["held_out_acc"] = accuracy(pl_module, held_out)
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None and trainer.global_rank == 0:
            record["elche"] = {
                "syncs": engine.state.rounds,
                "final_anchor": engine.controller.anchor,
                "window_plan": list(engine.controller.batch_counts),
                "steps": [t.steps for t in engine.state.totals],
                "idle": [t.sync_s / (t.compute_s + t.sync_s) if t.compute_s + t.sync_s > 0 else 0.0
                         for t in engine.state.totals],
            }
        Path(self.out_dir, f"{self.arm}.rank{trainer.global_rank}.json").write_text(json.dumps(record))


def make_trainer(args: argparse.Namespace, out_dir: str, arm: str, strategy: Any, devices: int,
                 throttle: Optional[Throttle]) -> Trainer:
    callbacks: list[Callback] = [Meter(out_dir, arm)]
    if throttle is not None:
        callbacks.insert(0, throttle)
    return Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=args.epochs,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )


def make_model(args: argparse.Namespace) -> DemoModel:
    return DemoModel(hidden=args.hidden, depth=args.depth)


def make_data(args: argparse.Namespace, num_samples: int) -> DemoDataModule:
    return DemoDataModule(num_samples=num_samples, val_samples=0, batch_size=args.batch_size, seed=0)


def run_solo(args: argparse.Namespace, out_dir: str, arm: str, slowdown: float, num_samples: int) -> None:
    """One single-process fit (the target of a spawned process)."""
    torch.set_num_threads(1)
    seed_everything(0, verbose=False)
    throttle = Throttle(0, slowdown) if slowdown > 1 else None
    trainer = make_trainer(args, out_dir, arm, "auto", 1, throttle)
    trainer.fit(make_model(args), datamodule=make_data(args, num_samples))


def run_solo_arms(args: argparse.Namespace, out_dir: str) -> None:
    """Both solo arms at once, in two independent processes, so they compete for the cores.

    Each solo fit trains one rank's share of the 2-rank epoch; the throttled one gets ``1/slowdown``
    of it so that the two finish together and neither runs alone at the end.
    """
    share = args.samples // 2
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=run_solo, args=(args, out_dir, "solo", 1.0, share)),
        ctx.Process(
            target=run_solo,
            args=(args, out_dir, "solo_throttled", args.slowdown, max(args.batch_size, int(share / args.slowdown))),
        ),
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + SOLO_TIMEOUT_S
    for p in procs:
        p.join(timeout=max(1.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"a solo fit failed (exit code {p.exitcode}); see its output above")


class ReleaseDefaultGroup(Callback):
    """Destroys the default process group once the fit tears down. Lightning's DDP leaves it alive,
    and a spawned rank that exits with it alive can abort in c10d's destructors at interpreter exit
    ("terminate called without an active exception"; ElCheStrategy releases its own groups)."""

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def run_two_ranks(args: argparse.Namespace, out_dir: str, arm: str, strategy: Strategy) -> None:
    seed_everything(0, verbose=False)
    trainer = make_trainer(args, out_dir, arm, strategy, 2, Throttle(1, args.slowdown))
    if isinstance(strategy, DDPStrategy) and not isinstance(strategy, ElCheStrategy):
        trainer.callbacks.append(ReleaseDefaultGroup())
    trainer.fit(make_model(args), datamodule=make_data(args, args.samples))


def load(out_dir: str, arm: str, ranks: int) -> list[dict[str, Any]]:
    return [json.loads(Path(out_dir, f"{arm}.rank{r}.json").read_text()) for r in range(ranks)]


def steady_rate(records: list[dict[str, Any]]) -> float:
    """Samples trained by all ranks from the start of epoch 1 to the end of the last, per second."""
    t0 = min(r["t_start"] for r in records)
    t1 = max(r["t_end"] for r in records)
    return sum(r["samples"] for r in records) / (t1 - t0)


def summarize(out_dir: str, args: argparse.Namespace) -> dict[str, Any]:
    records = {
        "solo": load(out_dir, "solo", 1),
        "solo_throttled": load(out_dir, "solo_throttled", 1),
        "ddp": load(out_dir, "ddp", 2),
        "elche": load(out_dir, "elche", 2),
    }
    rates = {arm: steady_rate(records[arm]) for arm in ARMS}
    ideal = rates["solo"] + rates["solo_throttled"]
    arms: dict[str, Any] = {}
    for arm in ARMS:
        arms[arm] = {
            "samples_per_s": rates[arm],
            "efficiency": rates[arm] / ideal,
            "speedup_vs_ddp": rates[arm] / rates["ddp"],
            "held_out_acc": records[arm][0].get("held_out_acc"),
            "ranks": records[arm],
        }
    return {
        "config": {k: getattr(args, k) for k in ("epochs", "samples", "slowdown", "batch_size", "hidden", "depth")},
        "ideal_samples_per_s": ideal,
        "measured_slowdown": rates["solo"] / rates["solo_throttled"],
        "arms": arms,
    }


def print_table(result: dict[str, Any]) -> None:
    labels = {
        "solo": "solo (rank 0 alone)",
        "solo_throttled": f"solo, throttled {result['config']['slowdown']:g}x",
        "ddp": "Lightning DDPStrategy",
        "elche": "ElCheStrategy nccl_cadence",
    }
    print()
    print(f"{'arm':<28} {'samples/s':>10} {'efficiency':>11} {'vs DDP':>7} {'held-out acc':>13}")
    for arm in ARMS:
        row = result["arms"][arm]
        eff = f"{row['efficiency']:.2f}" if arm in ("ddp", "elche") else "-"
        speedup = f"{row['speedup_vs_ddp']:.2f}x" if arm in ("ddp", "elche") else "-"
        print(f"{labels[arm]:<28} {row['samples_per_s']:>10.0f} {eff:>11} {speedup:>7} {row['held_out_acc']:>13.3f}")
    print(f"{'ideal (sum of solo rates)':<28} {result['ideal_samples_per_s']:>10.0f} {'1.00':>11}")
    print(f"measured solo slowdown: {result['measured_slowdown']:.2f}x")
    if any(result["arms"][arm]["efficiency"] > 1.0 for arm in ("ddp", "elche")):
        print("NOTE: an efficiency above 1 is impossible on a steady machine: the solo arms ran under "
              "heavier contention than the 2-rank arms. Rerun on a quiet machine.")
    elche = result["arms"]["elche"]["ranks"][0].get("elche")
    if elche:
        total = sum(elche["steps"]) or 1
        shares = ", ".join(f"rank{k} {s / total:.0%}" for k, s in enumerate(elche["steps"]))
        idle = ", ".join(f"rank{k} {v:.1%}" for k, v in enumerate(elche["idle"]))
        print(f"ElChe: {elche['syncs']} syncs, final anchor {elche['final_anchor']}, "
              f"step share {shares}, idle {idle}")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=None, help="epochs per arm (>= 2; epoch 0 is excluded)")
    parser.add_argument("--samples", type=int, default=None, help="training samples per epoch over both ranks")
    parser.add_argument("--slowdown", type=float, default=3.0, help="how many times slower rank 1 is")
    parser.add_argument("--batch-size", type=int, default=64, help="per-rank batch size")
    parser.add_argument("--hidden", type=int, default=None, help="MLP width")
    parser.add_argument("--depth", type=int, default=2, help="MLP hidden layers")
    parser.add_argument("--json", type=Path, default=None, help="write every number to this JSON file")
    parser.add_argument("--quick", action="store_true", help="tiny configuration (for tests)")
    args = parser.parse_args(argv)
    defaults = {"epochs": 2, "samples": 2048, "hidden": 256} if args.quick else {
        "epochs": 4, "samples": 24576, "hidden": 768}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.epochs < 2:
        parser.error("--epochs must be >= 2: epoch 0 is excluded from the measurement")
    if args.samples < 4 * args.batch_size:
        parser.error("--samples must hold at least 4 batches")
    return args


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hetero_demo_") as out_dir:
        started = time.monotonic()
        print(f"[1/3] solo arms, concurrently (slowdown {args.slowdown:g}x)", flush=True)
        run_solo_arms(args, out_dir)
        print("[2/3] Lightning DDPStrategy", flush=True)
        ddp = DDPStrategy(process_group_backend="gloo", timeout=PG_TIMEOUT, start_method="spawn")
        run_two_ranks(args, out_dir, "ddp", ddp)
        print("[3/3] ElCheStrategy(mode='nccl_cadence')", flush=True)
        elche = ElCheStrategy(mode="nccl_cadence", process_group_backend="gloo", timeout=PG_TIMEOUT,
                              start_method="spawn")
        run_two_ranks(args, out_dir, "elche", elche)
        result = summarize(out_dir, args)
        result["wall_s"] = time.monotonic() - started
    print_table(result)
    print(f"total wall time {result['wall_s']:.0f} s")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
