"""Where the host's time goes in one averaging round, on a one-rank group (issue 25, item 2).

On one rank the collectives finish at once, so ``tools/averaging_overhead.py``'s ``own_ms`` (CUDA
events) reads mostly how long the host takes to issue the round: 292 / 317 µs out of place on an
H100 at 17 / 77 MB against 13 / 74 µs of kernels (``docs/benchmarks.md``). This tool splits that
host time by part, with perf_counter wrappers around the plane's own methods (the package is not
changed): the pre-round bookkeeping, the round buffers, the collectives' launch, the waits on them,
the settling or drift launch, and the rest of ``average()`` (the gradients dropped, the weights,
Python). Each ``average()`` is timed from its call to its return, the device left running; the
device is synchronized between rounds, untimed. Medians over ``--iters`` rounds, in µs.

    python tools/round_host_time.py --out host.json                  # one GPU, NCCL
    python tools/round_host_time.py --device cpu --megabytes 4       # gloo on the host (a smoke run)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from averaging_overhead import SIZES_MB, leave_gradients, one_rank_plane  # noqa: E402

from lightning_elche.averaging import round_weights  # noqa: E402
from lightning_elche.planes import collective  # noqa: E402

PARTS = ("pre_round", "round_buffers", "collectives", "waits", "settle", "in_place_reduce")
"""The plane's methods timed, by part (``in_place_reduce``: the in-place round's reduce with the
waits and the drift launch inside it, one part)."""


_SETTLE_MULTI_TENSOR = collective.settle_multi_tensor


class Timer:
    """Host seconds spent in each wrapped callable during the current round; a wrapped call made
    inside another (a wait inside gloo's reduce) counts as the outer one's."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)
        self._depth = 0

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._depth += 1
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.spent[part] += time.perf_counter() - began
        return timed


def instrument(plane: collective.CollectivePlane, timer: Timer) -> None:
    """Time the plane's parts on this instance (and the multi-tensor settling where it is used)."""
    plane._pre_round = timer.wrap("pre_round", plane._pre_round)  # type: ignore[method-assign]
    plane.round_buffers = timer.wrap("round_buffers", plane.round_buffers)  # type: ignore[method-assign]
    plane.reduce_into = timer.wrap("collectives", plane.reduce_into)  # type: ignore[method-assign]
    plane._await = timer.wrap("waits", plane._await)  # type: ignore[method-assign]
    plane._reduce_whole = timer.wrap("in_place_reduce", plane._reduce_whole)  # type: ignore[method-assign]
    collective.settle_multi_tensor = timer.wrap("settle", _SETTLE_MULTI_TENSOR)  # the package's, not a former wrap


def measure(megabytes: float, tensors: int, variant: str, iters: int, device: torch.device) -> dict[str, Any]:
    plane, params = one_rank_plane(megabytes, tensors, variant, device)
    weights = round_weights([1], 1.0)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(5):  # warm up: compiles the kernels, builds the fused settling, fills the allocator's cache
        leave_gradients(params)
        plane.average(weights)
    sync()
    timer = Timer()
    instrument(plane, timer)
    if plane._settle is not None:  # built by the first round; timed on this instance
        plane._settle = timer.wrap("settle", plane._settle)  # type: ignore[assignment]
    totals: list[float] = []
    parts: dict[str, list[float]] = {part: [] for part in PARTS}
    for _ in range(iters):
        leave_gradients(params)
        sync()
        timer.spent.clear()
        began = time.perf_counter()
        plane.average(weights)
        totals.append(time.perf_counter() - began)
        sync()
        for part in PARTS:
            parts[part].append(timer.spent.get(part, 0.0))
    medians = {part: 1e6 * statistics.median(values) for part, values in parts.items()}
    rest = [t - sum(parts[p][i] for p in PARTS) for i, t in enumerate(totals)]
    return {"average_us": 1e6 * statistics.median(totals), "parts_us": medians,
            "rest_us": 1e6 * statistics.median(rest), "out_of_place": plane._reduces_out_of_place(),
            "tensors": tensors, "megabytes": megabytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--megabytes", type=float, nargs="*", default=None,
                        help=f"model sizes (default: the benchmark's, {sorted(SIZES_MB.values())})")
    parser.add_argument("--tensors", type=int, default=60, help="parameter tensors per model")
    parser.add_argument("--variants", default="out-of-place,fused", help="of tools/averaging_overhead.py's")
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--out", default=None, help="also write the result here (JSON)")
    args = parser.parse_args()
    device = torch.device(args.device)
    sizes = args.megabytes or sorted(SIZES_MB.values())
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"file://{os.path.join(tmp, 'pg')}", rank=0, world_size=1,
                                device_id=torch.device("cuda", 0) if device.type == "cuda" else None)
        try:
            result: dict[str, Any] = {f"{variant} {mb:g} MB": measure(mb, args.tensors, variant, args.iters, device)
                                      for mb in sizes for variant in args.variants.split(",")}
        finally:
            dist.destroy_process_group()
    result["device"] = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    result["torch"] = torch.__version__
    print(f"{'case':28} {'average':>8} " + " ".join(f"{p:>15}" for p in PARTS) + f" {'rest':>8}   (µs, host)")
    for name, row in result.items():
        if isinstance(row, dict):
            print(f"{name:28} {row['average_us']:8.1f} " + " ".join(f"{row['parts_us'][p]:15.1f}" for p in PARTS)
                  + f" {row['rest_us']:8.1f}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
