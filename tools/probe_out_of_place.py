"""Why the out-of-place ``nccl_*`` round (``CollectivePlane.out_of_place``) is off, asked on one GPU.

Two questions from its first H100 reading (``docs/benchmarks.md``, 2026-12-07, ``57d8310``):

* its float32 consensus on a one-rank NCCL group was not exactly half the values with this rank's
  weight 1/2: ``premul`` compares NCCL's one-rank reduce-scatter (out of place and in place) and
  all-reduce under ``PreMulSum(0.5)`` with the exact half, then the plane's whole round, and
  names the first elements that differ;
* its settling kernel ran at 0.58 TB/s at 77 MB (3.4 at 17 MB): ``settle`` times it at 77 MB
  for block sizes, warps and programs per multiprocessor, from the L2 cache and after flushing
  it, beside a plain copy of the same buffer.

    python tools/probe_out_of_place.py --out probe.json [--overhead-out overhead.json]

With ``--overhead-out`` it then runs ``tools/averaging_overhead.py --variants out-of-place`` with
the fastest flushed configuration of the sweep set in :mod:`lightning_elche.planes.settle`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import runpy
import statistics
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_elche.averaging import AveragedLayout, round_weights
from lightning_elche.planes import settle
from lightning_elche.planes.collective import CollectivePlane
from lightning_elche.planes.settle import FusedSettle, Settled, settled_numel

SIZES = (4096, 336_080, 19_310_000)  # a block; the GPU test's model (padded); the 77 MB buffer


def premul() -> dict[str, Any]:
    half = dist._make_nccl_premul_sum(0.5)
    found: dict[str, Any] = {}
    for numel in SIZES:
        values = torch.randn(numel, device="cuda")
        scattered = torch.empty_like(values)
        dist.reduce_scatter_tensor(scattered, values, op=half)
        in_place = values.clone()
        dist.reduce_scatter_tensor(in_place, in_place, op=half)
        reduced = values.clone()
        dist.all_reduce(reduced, op=half)
        torch.cuda.synchronize()
        exact = values * 0.5
        found[f"values_{numel}"] = {
            "reduce_scatter_exact": bool(torch.equal(scattered, exact)),
            "reduce_scatter_unscaled": bool(torch.equal(scattered, values)),
            "reduce_scatter_median_ratio": float((scattered / values).median()),
            "reduce_scatter_in_place_exact": bool(torch.equal(in_place, exact)),
            "all_reduce_exact": bool(torch.equal(reduced, exact)),
        }
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 1000), nn.LayerNorm(1000), nn.ReLU(), nn.Linear(1000, 77)).cuda().to(dtype)
        plane = CollectivePlane(AveragedLayout(model), 0, 1, torch.device("cuda", 0))
        plane.out_of_place = True
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        before = torch.cat([p.detach().float().flatten() for p in model.parameters()])
        divergence = plane.average(round_weights([1, 1], 1.0))
        torch.cuda.synchronize()
        after = torch.cat([p.detach().float().flatten() for p in model.parameters()])
        wrong = (after != before * 0.5).nonzero().flatten()
        found[f"plane_{dtype}"] = {
            "wrong": int(wrong.numel()), "of": before.numel(), "first_wrong": wrong[:8].tolist(),
            "ratio_there": (after[wrong[:8]] / before[wrong[:8]]).tolist(),
            "divergence": None if divergence is None else divergence.tolist(),
        }
        plane.close()
    return found


def timed_us(op: Callable[[], object], iters: int = 40) -> float:
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        op()
        end.record()
        end.synchronize()
        times.append(1000.0 * start.elapsed_time(end))
    return statistics.median(times)


def settle_speed(numel: int = SIZES[-1]) -> dict[str, float]:
    live = torch.randn(numel + 16384, device="cuda")[:numel]
    consensus = torch.randn(settled_numel(live), device="cuda")
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")  # past the 50 MB L2
    flushing = timed_us(flush.zero_)

    def flushed(op: Callable[[], object]) -> float:
        return timed_us(lambda: (flush.zero_(), op())) - flushing

    def copy() -> None:
        live.copy_(consensus[:numel])

    found = {"copy_us": timed_us(copy), "copy_flushed_us": flushed(copy)}
    one = [Settled(live, consensus, numel - 5)]
    for block in (1024, 4096):
        for warps in (4, 8):
            for per_sm in (2, 4, 16, 64):
                settle.SETTLE_BLOCK, settle.SETTLE_WARPS = block, warps
                fused = FusedSettle([live], per_sm)
                fused(one)
                found[f"block{block}_warps{warps}_per_sm{per_sm}_us"] = timed_us(lambda: fused(one))  # noqa: B023
                found[f"block{block}_warps{warps}_per_sm{per_sm}_flushed_us"] = flushed(lambda: fused(one))  # noqa: B023
    return found


def fastest_flushed(speeds: dict[str, float]) -> tuple[int, int, int]:
    """The sweep's (block, warps, programs per multiprocessor) that settled fastest from memory."""
    swept = [key for key in speeds if key.startswith("block") and key.endswith("_flushed_us")]
    name = min(swept, key=speeds.__getitem__)
    found = re.fullmatch(r"block(\d+)_warps(\d+)_per_sm(\d+)_flushed_us", name)
    assert found is not None, name
    block, warps, per_sm = (int(group) for group in found.groups())
    return block, warps, per_sm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="probe_out_of_place.json")
    parser.add_argument("--overhead-out", default=None,
                        help="then run the overhead tool's out-of-place variant at the fastest setting, into this file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{os.path.join(tmp, 'pg')}", rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
        try:
            result: dict[str, Any] = {"premul": premul()}
        finally:
            dist.destroy_process_group()
    result["settle"] = settle_speed()
    result["device"] = torch.cuda.get_device_name(0)
    result["torch"] = torch.__version__
    print(json.dumps(result, indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    if args.overhead_out:
        settle.SETTLE_BLOCK, settle.SETTLE_WARPS, settle.PROGRAMS_PER_SM = fastest_flushed(result["settle"])
        print(f"overhead at block {settle.SETTLE_BLOCK}, warps {settle.SETTLE_WARPS}, {settle.PROGRAMS_PER_SM} per SM")
        sys.argv = [os.path.join(os.path.dirname(__file__), "averaging_overhead.py"), "--iters", "100",
                    "--variants", "out-of-place", "--out", args.overhead_out]
        runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
