"""What a round costs besides the averaging itself, at N ranks: the metadata exchange and the
controller's bookkeeping.

* ``exchange`` (N CPU processes, one gloo group over TCP): the all-gather of one ``META_SIZE``
  float64 vector per rank, the call every round starts with in every mode
  (``planes.base.all_gather_flat``), timed on every rank over ``--rounds`` rounds.
* ``controller`` (one process, simulated table): what every rank computes from the gathered
  table: ``validate_table``, ``round_weights``, the engine's ``_advance`` (reports, totals,
  controller, convergence control) and rank 0's ``metrics`` for the loggers, with N rows of
  ranks of different speeds (per-step times 2, 4, 8, 3 ms repeated), over ``--rounds`` rounds.

    python tools/round_cost.py --ranks 8 16 32 --out DIR

writes ``DIR/round_cost.json`` and ``DIR/round_cost.md``.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from scaling_cli import free_port, parse, world_size_parser

from lightning_elche.averaging import round_weights
from lightning_elche.config import ElCheConfig
from lightning_elche.engine import ElCheEngine
from lightning_elche.planes.base import AveragingPlane, RoundResult, all_gather_flat
from lightning_elche.rounds import META_SIZE, Meta, validate_table

STEP_MS = (2.0, 4.0, 8.0, 3.0)
MODES = ("nccl_cadence", "cpu_async")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def spread(seconds: list[float]) -> dict[str, float]:
    return {"p50_ms": 1000 * percentile(seconds, 0.5), "p99_ms": 1000 * percentile(seconds, 0.99),
            "max_ms": 1000 * max(seconds)}


# -- the metadata exchange ------------------------------------------------------------------


def exchange_rank(rank: int, world_size: int, port: int, rounds: int, result_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=120))
    try:
        local = torch.full((META_SIZE,), float(rank), dtype=torch.float64)
        table = torch.empty(world_size * META_SIZE, dtype=torch.float64)
        for _ in range(10):  # connections and buffers warm up
            all_gather_flat(table, local)
        if table.view(world_size, META_SIZE)[:, 0].tolist() != [float(r) for r in range(world_size)]:
            raise RuntimeError("the gathered table is not rank-major: the exchange is broken")
        seconds = []
        for _ in range(rounds):
            dist.barrier()  # every round starts together, as ranks meet at a boundary
            start = time.perf_counter()
            all_gather_flat(table, local)
            table.view(world_size, META_SIZE).tolist()  # what the planes do with it
            seconds.append(time.perf_counter() - start)
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, seconds)
        if rank == 0:
            Path(result_path).write_text(json.dumps(gathered))
    finally:
        dist.destroy_process_group()


def measure_exchange(world_size: int, rounds: int, out_dir: Path) -> dict[str, Any]:
    result_path = out_dir / f".round_cost-exchange-{world_size}.json"
    mp.spawn(exchange_rank, args=(world_size, free_port(), rounds, str(result_path)), nprocs=world_size)
    per_rank: list[list[float]] = json.loads(result_path.read_text())
    result_path.unlink()
    # A round waits for its slowest participant: the per-round cost is the largest over ranks.
    per_round = [max(column) for column in zip(*per_rank, strict=True)]
    return {"bytes_per_rank": 8 * META_SIZE, "round": spread(per_round),
            "rank": spread([s for seconds in per_rank for s in seconds])}


# -- the controller's bookkeeping -------------------------------------------------------------


class NoPlane(AveragingPlane):
    """The engine's plane is not used by ``_advance``: the table is built here."""

    def start(self, local: torch.Tensor) -> None:
        raise NotImplementedError

    def collect(self) -> RoundResult:
        raise NotImplementedError


def simulated_table(engine: ElCheEngine, world_size: int, round_index: int) -> list[list[float]]:
    rows = []
    for rank in range(world_size):
        steps = engine.controller.batch_counts[rank]
        row = [0.0] * META_SIZE
        row[Meta.STEPS] = steps
        row[Meta.SAMPLES] = 32 * steps
        row[Meta.COMPUTE_S] = steps * STEP_MS[rank % len(STEP_MS)] / 1000
        row[Meta.LAST_SYNC_S] = 0.002
        row[Meta.LOSS_SUM] = 0.5 * steps
        row[Meta.LR] = 0.1
        row[Meta.FINITE] = 1.0
        row[Meta.ROUND] = round_index
        row[Meta.STALL_MS] = -1.0
        if round_index > 0:
            row[Meta.HAS_DIVERGENCE] = 1.0
            row[Meta.DELTA_NORM], row[Meta.PRE_NORM], row[Meta.POST_NORM] = 0.01 * (1 + rank % 3), 10.0, 10.0
        rows.append(row)
    return rows


def measure_controller(world_size: int, rounds: int, mode: str) -> dict[str, Any]:
    config = ElCheConfig.preset(mode)
    engine = ElCheEngine(config=config, plane=NoPlane(), rank=0, world_size=world_size, device=torch.device("cpu"),
                         params=[], signature=0.0)
    engine.set_epoch_size(10**7)  # an epoch long enough that no window is capped by it
    parts: dict[str, list[float]] = {"validate_table": [], "round_weights": [], "advance": [], "metrics": []}
    totals = []
    for index in range(rounds):
        table = simulated_table(engine, world_size, index)
        t0 = time.perf_counter()
        validate_table(table)
        t1 = time.perf_counter()
        weights = round_weights([int(row[Meta.STEPS]) for row in table], config.gamma)
        t2 = time.perf_counter()
        outcome = engine._advance(RoundResult(table, weights, None))
        t3 = time.perf_counter()
        engine.metrics(outcome)
        t4 = time.perf_counter()
        for name, seconds in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            parts[name].append(seconds)
        totals.append(t4 - t0)
    return {"mode": mode, "total": spread(totals), **{name: spread(values) for name, values in parts.items()},
            "final_batch_counts": list(engine.controller.batch_counts), "anchor": engine.controller.anchor}


# -- output ------------------------------------------------------------------------------------


def markdown(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "# Per-round cost besides the averaging: metadata exchange and controller",
        "",
        f"Machine: {meta['machine']}, {meta['cpus']} CPUs; torch {meta['torch']}; {meta['rounds']} rounds; "
        f"command `{meta['command']}`.",
        "",
        f"Exchange: all-gather of {META_SIZE} float64 per rank over gloo (TCP, one host); a round's time is "
        "the slowest rank's. Controller: validate_table + round_weights + engine._advance + rank 0's metrics, "
        "one process, simulated table of ranks with per-step times " + ", ".join(f"{s:g}" for s in STEP_MS)
        + " ms (repeated).",
        "",
        "| ranks | exchange bytes / rank | exchange p50 ms | exchange p99 ms | exchange max ms "
        + "".join(f"| {m} controller p50 ms | {m} controller p99 ms " for m in MODES) + "| _advance p50 ms "
        "| metrics p50 ms |",
        "|---:|---:|---:|---:|---:" + "|---:|---:" * len(MODES) + "|---:|---:|",
    ]
    for r in results:
        e = r["exchange"]["round"]
        controllers = {c["mode"]: c for c in r["controller"]}
        first = controllers[MODES[0]]
        lines.append(
            f"| {r['ranks']} | {r['exchange']['bytes_per_rank']} | {e['p50_ms']:.3f} | {e['p99_ms']:.3f} "
            f"| {e['max_ms']:.2f} "
            + "".join(f"| {controllers[m]['total']['p50_ms']:.3f} | {controllers[m]['total']['p99_ms']:.3f} "
                      for m in MODES)
            + f"| {first['advance']['p50_ms']:.3f} | {first['metrics']['p50_ms']:.3f} |"
        )
    lines.append("")
    return "\n".join(lines)



def main() -> None:
    parser = world_size_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=500, help="rounds measured per world size")
    args = parse(parser)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: expected >= 1")
    results = []
    for world_size in args.ranks:
        exchange = measure_exchange(world_size, args.rounds, args.out)
        controller = [measure_controller(world_size, args.rounds, mode) for mode in MODES]
        results.append({"ranks": world_size, "exchange": exchange, "controller": controller})
        print(f"{world_size} ranks: exchange p50 {exchange['round']['p50_ms']:.3f} ms p99 "
              f"{exchange['round']['p99_ms']:.3f} ms; controller "
              + ", ".join(f"{c['mode']} p50 {c['total']['p50_ms']:.3f} ms" for c in controller), flush=True)
    meta = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "rounds": args.rounds, "command": " ".join(["python", *sys.argv])}
    (args.out / "round_cost.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    (args.out / "round_cost.md").write_text(markdown(results, meta))
    print(f"wrote {args.out / 'round_cost.json'} and {args.out / 'round_cost.md'}")


if __name__ == "__main__":
    main()
