"""The fused drift kernel alone at the benchmark's two model sizes, for several launch grids
(``FusedDrift.programs_per_sm``; ``1e9``: a program per 4,096-value block), on one GPU: median
device time of 50 launches (CUDA events) and the bandwidth of its two reads.

    python tools/drift_grid.py --out drift-grid.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from lightning_elche.planes.fused import FusedDrift

SIZES_MB = {"resnet20x4": 17.31, "char-medium": 77.24}


def timed(drift: FusedDrift, addresses: list[int], iters: int) -> float:
    for _ in range(5):
        drift(addresses)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        drift(addresses)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--tensors", type=int, default=60)
    parser.add_argument("--out", default="drift-grid.json")
    args = parser.parse_args()
    result: dict[str, object] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    for name, megabytes in SIZES_MB.items():
        numel = int(megabytes * 1e6 / 4)
        sizes = [numel // args.tensors] * (args.tensors - 1) + [numel - (numel // args.tensors) * (args.tensors - 1)]
        flat = torch.randn(numel, device="cuda")
        views = list(torch.split(flat, sizes))
        saved = [torch.randn_like(view) for view in views]
        drift = FusedDrift([flat], views)
        rows = {}
        for per_sm in (1, 2, 4, 8, 16, 10**9):
            drift.programs_per_sm = per_sm
            ms = timed(drift, [t.data_ptr() for t in saved], args.iters)
            rows[str(per_sm)] = {"us": 1000 * ms, "read_tb_per_s": 2 * numel * 4 / (ms * 1e-3) / 1e12}
        result[name] = rows
        print(name, {k: f"{v['us']:.1f} us {v['read_tb_per_s']:.2f} TB/s" for k, v in rows.items()})
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
