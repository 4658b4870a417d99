"""What the ``nccl_*`` averaging path adds to its all-reduce, on one GPU (a one-rank NCCL group).

A one-rank all-reduce moves no bytes, so this cannot give a bus bandwidth (the benchmark's
microbenchmark does, on 2 GPUs); it measures the rest of ``CollectivePlane.average``: the
pre-round copy, the scaling, the divergence norms and the launches, in device time (CUDA events,
median of many rounds), at the benchmark's two model sizes. Adding that time to a measured
2-GPU raw all-reduce time estimates the path's share of the raw bus bandwidth.

    python tools/averaging_overhead.py --out overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

import torch
import torch.distributed as dist

from lightning_elche.averaging import AveragedLayout, FlatTensors, round_weights
from lightning_elche.planes.collective import CollectivePlane

SIZES_MB = {"resnet20x4": 17.31, "char-medium": 77.24}  # the benchmark's flat parameter bytes


def device_ms(op, iters: int) -> float:
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        op()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(megabytes: float, iters: int, tensors: int, profile: bool = False) -> dict[str, float]:
    numel = int(megabytes * 1e6 / 4)
    sizes = [numel // tensors] * (tensors - 1) + [numel - (numel // tensors) * (tensors - 1)]
    params = [torch.randn(n, device="cuda") for n in sizes]
    layout = AveragedLayout.fixed(FlatTensors(params), FlatTensors([]))
    plane = CollectivePlane(layout, 0, 1, torch.device("cuda"))
    weights = round_weights([1], 1.0)
    flat = torch.ones(numel, device="cuda")
    for _ in range(5):
        plane.average(weights)
        dist.all_reduce(flat)
    torch.cuda.synchronize()
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                plane.average(weights)
            torch.cuda.synchronize()
        print(f"== {megabytes} MB, 20 rounds")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14))
    return {
        "bytes": numel * 4,
        "one_rank_all_reduce_ms": device_ms(lambda: dist.all_reduce(flat), iters),
        "average_ms": device_ms(lambda: plane.average(weights), iters),
        "copy_ms": device_ms(lambda: flat.copy_(layout.params.flats[0]), iters),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--tensors", type=int, default=60, help="parameter tensors per model")
    parser.add_argument("--out", default="averaging_overhead.json")
    parser.add_argument("--profile", action="store_true", help="print a torch.profiler table per size")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{os.path.join(tmp, 'pg')}", rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
        try:
            result = {name: measure(mb, args.iters, args.tensors, args.profile) for name, mb in SIZES_MB.items()}
        finally:
            dist.destroy_process_group()
    result["device"] = torch.cuda.get_device_name(0)
    result["torch"] = torch.__version__
    print(json.dumps(result, indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
