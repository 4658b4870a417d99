"""Does the pooled dispatch scale? Chunk claims through the job's store at N CPU ranks.

For each N, N processes join one gloo process group (``init_process_group`` over TCP, as a job
launched by Lightning does: rank 0 hosts the TCPStore) and each iterates an ``ElCheSampler`` in
pool dispatch whose counter is the default store, the sampler's own path, ``store.add(key, 1)``
through the job's ``PrefixStore``. Every store call is timed. Equal speed shares are set, as the
controller does for equal ranks, so the peeks near the epoch end (``add(key, 0)``) are included.

Two phases per N:

* ``saturation``: one batch per chunk and no training: every rank claims back to back. The
  aggregate claims/s is what the store can serve at all (no speed shares: claims only).
* ``fast_ranks``: the default chunk (4 batches) and a 1 ms sleep per batch on every rank: the
  worst realistic demand (all ranks fast). The claim latency under this load, against the 4 ms
  a chunk takes to train, says whether a fast rank waits on the dispatch. The sampler's own
  bookkeeping per claim (time in its iterator minus the store calls) is reported too: with speed
  shares set it grows with the number of chunks left in the epoch (``--fast-chunks``).

    python tools/dispatch_scaling.py --ranks 8 16 32 --out DIR

writes ``DIR/dispatch_scaling.json`` and ``DIR/dispatch_scaling.md``. Needs about as many cores as
ranks for the numbers to mean anything (the store serves from rank 0's process).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from scaling_cli import free_port, parse, world_size_parser

from lightning_elche.config import Dispatch
from lightning_elche.dispatch import build_sampler

FAST_STEP_S = 0.001
DEFAULT_CHUNK_BATCHES = 4
# "Not a bottleneck": a claim costs a fast rank under 2 % of a chunk at the median and under
# 10 % at p99, and the store serves at least 4x the claims that N fast ranks ask for.
MEDIAN_OVERHEAD_LIMIT = 0.02
P99_OVERHEAD_LIMIT = 0.10
HEADROOM_LIMIT = 4.0


class TimedCounter:
    """The store as the sampler's counter, timing every call (wall time on this rank)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.claims_s: list[float] = []
        self.peeks_s: list[float] = []
        self.records_s: list[float] = []  # the claim records written with every claim

    def add(self, key: str, amount: int) -> int:
        start = time.perf_counter()
        value = self.store.add(key, amount)
        (self.claims_s if amount else self.peeks_s).append(time.perf_counter() - start)
        return value

    def append(self, key: str, value: str) -> None:
        start = time.perf_counter()
        self.store.append(key, value)
        self.records_s.append(time.perf_counter() - start)

    def check(self, keys: list[str]) -> bool:
        return self.store.check(keys)

    def get(self, key: str) -> bytes:
        return self.store.get(key)


@dataclass
class RankPhase:
    """One rank's view of one phase."""

    rank: int
    wall_s: float
    batches: int
    claims: int
    claims_s: list[float]
    peeks: int
    peek_s_sum: float
    sampler_s: float
    """Time inside the sampler's iterator, store calls excluded: its own bookkeeping."""


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def run_phase(rank: int, world_size: int, store: Any, name: str, chunks_per_rank: int, chunk_batches: int,
              step_s: float, speed_shares: bool) -> RankPhase:
    counter = TimedCounter(store)
    sampler = build_sampler(Dispatch.POOL, world_size * chunks_per_rank * chunk_batches, 1, rank, world_size,
                            shuffle=False, seed=0, counter=counter, key_prefix=f"dispatch_scaling/{name}",
                            max_chunk_batches=chunk_batches)
    if speed_shares:
        sampler.set_speed_shares([1.0] * world_size)
    sampler.set_epoch(0)
    dist.barrier()
    start = time.perf_counter()
    batches, inside = 0, 0.0
    iterator = iter(sampler)
    while True:  # batch size 1: every index is a batch
        entered = time.perf_counter()
        try:
            next(iterator)
        except StopIteration:
            break
        inside += time.perf_counter() - entered
        batches += 1
        if step_s:
            time.sleep(step_s)
    wall = time.perf_counter() - start
    dist.barrier()
    store_s = sum(counter.claims_s) + sum(counter.peeks_s) + sum(counter.records_s)
    return RankPhase(rank, wall, batches, len(counter.claims_s), counter.claims_s, len(counter.peeks_s),
                     sum(counter.peeks_s), inside - store_s)


def run_rank(rank: int, world_size: int, port: int, args: argparse.Namespace, result_path: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=120))
    try:
        store = dist.distributed_c10d._get_default_store()  # what the strategy hands the sampler
        phases = {
            "saturation": run_phase(rank, world_size, store, "saturation", args.saturation_claims, 1, 0.0, False),
            "fast_ranks": run_phase(rank, world_size, store, "fast_ranks", args.fast_chunks, DEFAULT_CHUNK_BATCHES,
                                    FAST_STEP_S, True),
        }
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, {name: asdict(p) for name, p in phases.items()})
        if rank == 0:
            Path(result_path).write_text(json.dumps(gathered))
    finally:
        dist.destroy_process_group()


def summarize(world_size: int, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {"ranks": world_size}
    for name in ("saturation", "fast_ranks"):
        phases = [r[name] for r in per_rank]
        all_claims = [s for p in phases for s in p["claims_s"]]
        wall = max(p["wall_s"] for p in phases)
        summary[name] = {
            "wall_s": wall,
            "claims": len(all_claims),
            "claims_per_s": len(all_claims) / wall if wall > 0 else float("nan"),
            "peeks": sum(p["peeks"] for p in phases),
            "claim_ms_p50": 1000 * percentile(all_claims, 0.50),
            "claim_ms_p99": 1000 * percentile(all_claims, 0.99),
            "claim_ms_max": 1000 * max(all_claims, default=float("nan")),
            "sampler_us_per_claim": 1e6 * max(p["sampler_s"] / max(p["claims"], 1) for p in phases),
            "per_rank": [
                {"rank": p["rank"], "batches": p["batches"], "claims": p["claims"], "wall_s": p["wall_s"],
                 "claim_ms_p50": 1000 * percentile(p["claims_s"], 0.50),
                 "claim_ms_p99": 1000 * percentile(p["claims_s"], 0.99),
                 "store_share": (sum(p["claims_s"]) + p["peek_s_sum"]) / p["wall_s"] if p["wall_s"] else 0.0}
                for p in phases
            ],
        }
    chunk_s = DEFAULT_CHUNK_BATCHES * FAST_STEP_S
    fast = summary["fast_ranks"]
    demand = world_size / chunk_s  # claims/s when every rank is a 1 ms-step rank
    verdict = {
        "chunk_ms": 1000 * chunk_s,
        "demand_claims_per_s": demand,
        "headroom": summary["saturation"]["claims_per_s"] / demand,
        "median_overhead": fast["claim_ms_p50"] / 1000 / chunk_s,
        "p99_overhead": fast["claim_ms_p99"] / 1000 / chunk_s,
        "worst_rank_store_share": max(r["store_share"] for r in fast["per_rank"]),
    }
    verdict["sampler_overhead"] = fast["sampler_us_per_claim"] / 1e6 / chunk_s
    verdict["bottleneck"] = bool(verdict["median_overhead"] > MEDIAN_OVERHEAD_LIMIT
                                 or verdict["p99_overhead"] > P99_OVERHEAD_LIMIT
                                 or verdict["headroom"] < HEADROOM_LIMIT)
    summary["verdict"] = verdict
    return summary


def markdown(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "# Pool dispatch scaling: chunk claims through the job's TCPStore",
        "",
        f"Machine: {meta['machine']}, {meta['cpus']} CPUs; torch {meta['torch']}; command `{meta['command']}`.",
        "",
        "Saturation: every rank claims back to back (one batch per chunk, no training).",
        f"Fast ranks: every rank trains 1 ms batches in chunks of {DEFAULT_CHUNK_BATCHES} (a chunk: 4 ms).",
        "",
        "| ranks | saturation claims/s | sat. p50 ms | sat. p99 ms | fast: claims/s | fast p50 ms | fast p99 ms "
        "| fast max ms | demand claims/s | headroom | p50 / chunk | p99 / chunk | worst rank's store time "
        "| sampler µs / claim (worst rank) | store bottleneck |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for r in results:
        s, f, v = r["saturation"], r["fast_ranks"], r["verdict"]
        lines.append(
            f"| {r['ranks']} | {s['claims_per_s']:.0f} | {s['claim_ms_p50']:.3f} | {s['claim_ms_p99']:.3f} "
            f"| {f['claims_per_s']:.0f} | {f['claim_ms_p50']:.3f} | {f['claim_ms_p99']:.3f} | {f['claim_ms_max']:.2f} "
            f"| {v['demand_claims_per_s']:.0f} | {v['headroom']:.1f}x | {100 * v['median_overhead']:.2f} % "
            f"| {100 * v['p99_overhead']:.2f} % | {100 * v['worst_rank_store_share']:.2f} % "
            f"| {f['sampler_us_per_claim']:.0f} ({100 * v['sampler_overhead']:.1f} % of a chunk) "
            f"| {'**yes**' if v['bottleneck'] else 'no'} |"
        )
    lines += [
        "",
        f"Store bottleneck means: p50 claim > {100 * MEDIAN_OVERHEAD_LIMIT:.0f} % of a fast chunk, or p99 > "
        f"{100 * P99_OVERHEAD_LIMIT:.0f} %, or saturation serves less than {HEADROOM_LIMIT:.0f}x the claims "
        "that all-fast ranks ask for. \"Worst rank's store time\" is the largest share of a rank's wall time "
        "spent in store calls (claims and end-of-epoch peeks) in the fast phase.",
        "",
    ]
    return "\n".join(lines)



def main() -> None:
    parser = world_size_parser(__doc__)
    parser.add_argument("--saturation-claims", type=int, default=2000, help="claims per rank when saturating")
    parser.add_argument("--fast-chunks", type=int, default=250, help="chunks per rank in the fast-ranks phase")
    args = parse(parser)
    results = []
    for world_size in args.ranks:
        result_path = args.out / f".dispatch_scaling-{world_size}.json"
        mp.spawn(run_rank, args=(world_size, free_port(), args, str(result_path)), nprocs=world_size)
        summary = summarize(world_size, json.loads(result_path.read_text()))
        result_path.unlink()
        results.append(summary)
        v, fast = summary["verdict"], summary["fast_ranks"]
        print(f"{world_size} ranks: saturation {summary['saturation']['claims_per_s']:.0f} claims/s; fast ranks "
              f"claim p50 {fast['claim_ms_p50']:.3f} ms p99 {fast['claim_ms_p99']:.3f} ms; headroom "
              f"{v['headroom']:.1f}x; sampler {fast['sampler_us_per_claim']:.0f} us/claim; store bottleneck: "
              f"{v['bottleneck']}", flush=True)
    meta = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "command": " ".join(["python", *sys.argv])}
    (args.out / "dispatch_scaling.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    (args.out / "dispatch_scaling.md").write_text(markdown(results, meta))
    print(f"wrote {args.out / 'dispatch_scaling.json'} and {args.out / 'dispatch_scaling.md'}")


if __name__ == "__main__":
    main()
