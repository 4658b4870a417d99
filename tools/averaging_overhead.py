"""What the ``nccl_*`` averaging path adds to its all-reduce, on one GPU (a one-rank NCCL group).

A one-rank collective moves no bytes between GPUs, so this cannot give a bus bandwidth (the
benchmark's microbenchmark does, on 2 GPUs); it measures the rest of ``CollectivePlane.average``:
keeping or settling the pre-round values, the scaling, the divergence norms and the launches, at
the benchmark's two model sizes (the gradients a step leaves are in place before each round):

* ``bare_collective_ms``: the collectives alone as the plane issues them (out of place: a
  reduce-scatter into the round buffer and an all-gather in place, ``reduce_into``; in place: one
  PreMulSum all-reduce of the flat buffer, ``sum_scaled``), device time (CUDA events), median;
* ``average_ms``: the whole ``average()``, device time; ``own_ms`` = the difference, the round's
  own work beyond its collectives;
* ``wall_average_ms`` / ``wall_bare_ms``: the same two on the host's clock, synchronized;
* ``kernels_per_round``: device kernels one ``average()`` runs (torch.profiler), with their names;
  ``own_kernel_us``: the summed device time of those kernels but the bare collectives' (the round's
  own device work without the host's gaps), ``kernel_us`` per kernel name;
* ``collectives_per_round``: the collectives one ``average()`` launches, by name, counted at
  ``torch.distributed``;
* ``round_peak_extra_mb``: how far the allocated device memory rises during ``average()`` above
  where it stood with the step's gradients held (the out-of-place round drops them before it
  allocates its round buffer; the in-place one keeps its pre-round values in them);
* ``watched_average_ms`` / ``watched_own_ms``: ``average()`` as a fit runs it, its host polling the
  collectives for a lost peer (``Membership.wait`` on NCCL: ``is_completed()``, then ``wait()``);
* ``round_ms`` / ``bare_round_ms``: a whole round as the engine runs it (``start`` and ``collect``:
  the layout check, the metadata exchange (with the in-place round's pre-round copy beside it),
  ``average()``) against the collectives alone; ``round_own_ms`` the difference. On one rank nobody
  is waited for in the exchange, so a copy beside it shows here in full; with peers it runs while
  this rank waits for the slowest one.

Variants: ``fused`` is the plane as a fit runs it (the in-place round, the fused drift
measurement after the reduce); ``-out-of-place`` the out-of-place round settled by one Triton
kernel (``CollectivePlane.out_of_place``), ``-out-of-place-multi-tensor`` settled by PyTorch's
multi-tensor kernels; ``-queued`` the fused measurement queued behind the reduce on a side stream
(``CollectivePlane.queued``);
``-chunks-<n>MB`` the in-place round reduced in parts of about n MB, each copied aside just before
its reduce and measured right after it (``CollectivePlane.chunk_bytes``), ``-chunks-8MB-whole-copy``
the same with the whole model copied first (``copy_in_parts`` False); ``-multi-tensor`` the in-place
round with PyTorch's multi-tensor kernels instead of Triton's.
``drift_kernel_us``: the Triton kernel's device time (the settling, or the in-place drift
measurement); ``drift_read_tb_per_s`` the bandwidth of its two reads (the pre-round values and the
consensus) and ``drift_tb_per_s`` of all its traffic (the settling also writes the consensus).

    python tools/averaging_overhead.py --out overhead.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any, Optional
from unittest import mock

import torch
import torch.distributed as dist

from lightning_elche.averaging import AveragedLayout, FlatTensors, round_weights
from lightning_elche.planes.collective import CollectivePlane
from lightning_elche.rounds import META_SIZE, Meta

SIZES_MB = {"resnet20x4": 17.31, "char-medium": 77.24}  # the benchmark's flat parameter bytes
VARIANTS = ("fused", "out-of-place", "out-of-place-multi-tensor", "chunks-4MB", "chunks-8MB", "chunks-16MB",
            "chunks-8MB-whole-copy", "queued", "multi-tensor")


def timed(op: Callable[[], object], prepare: Callable[[], None], iters: int) -> tuple[float, float]:
    """Median device time (CUDA events) and median synchronized host wall of ``op``, in ms;
    ``prepare`` runs before each, untimed."""
    device, wall = [], []
    for _ in range(iters):
        prepare()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began = time.perf_counter()
        start.record()
        op()
        end.record()
        end.synchronize()
        wall.append(1000.0 * (time.perf_counter() - began))
        device.append(start.elapsed_time(end))
    return statistics.median(device), statistics.median(wall)


COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "all_gather_single", "all_gather_into_tensor")


def collectives_per_round(op: Callable[[], object], prepare: Callable[[], None]) -> dict[str, int]:
    """The collectives one ``op`` launches, by name, counted at ``torch.distributed`` (a one-rank
    NCCL group launches no kernel the profiler could name for some of them)."""
    calls: collections.Counter[str] = collections.Counter()

    def counting(name: str) -> Callable[..., Any]:
        real = getattr(dist, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return real(*args, **kwargs)
        return counted

    prepare()
    with contextlib.ExitStack() as stack:
        for name in COLLECTIVES:
            if hasattr(dist, name):
                stack.enter_context(mock.patch.object(dist, name, counting(name)))
        op()
    torch.cuda.synchronize()
    return dict(calls)


def round_peak_extra_bytes(op: Callable[[], object], prepare: Callable[[], None]) -> int:
    """How far the device's allocated bytes rise during ``op`` above where they stood before it
    (with the gradients a step leaves still held)."""
    prepare()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    op()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def kernels(op: Callable[[], object], prepare: Callable[[], None],
            rounds: int) -> tuple[float, dict[str, int], dict[str, float]]:
    """Device kernels per ``op`` (mean over ``rounds``), how often each ran, and each one's device
    time per ``op`` in µs."""
    from torch.profiler import ProfilerActivity, profile

    names: collections.Counter[str] = collections.Counter()
    spent: collections.Counter[str] = collections.Counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(rounds):
            prepare()
            torch.cuda.synchronize()
            op()
            torch.cuda.synchronize()
    prepares: collections.Counter[str] = collections.Counter()
    with profile(activities=[ProfilerActivity.CUDA]) as baseline:
        for _ in range(rounds):
            prepare()
            torch.cuda.synchronize()
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            names[evt.name] += 1
            spent[evt.name[:90]] += evt.time_range.elapsed_us()
    for evt in baseline.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            prepares[evt.name] += 1
    names.subtract(prepares)
    counts = {name[:90]: n // rounds for name, n in names.items() if n > 0}
    times = {name: spent[name] / rounds for name in counts}
    return sum(n for n in names.values() if n > 0) / rounds, counts, times


class PollingWatch:
    """The host side of ``Membership.wait`` on NCCL: poll the work until it completes, then order
    the stream after it (no peers to check on one rank)."""

    def wait(self, work: object, host_blocking: bool = True) -> None:
        while not work.is_completed():  # type: ignore[attr-defined]
            pass
        work.wait()  # type: ignore[attr-defined]


def one_rank_plane(megabytes: float, tensors: int, variant: str, device: Optional[torch.device] = None
                   ) -> tuple[CollectivePlane, list[torch.nn.Parameter]]:
    """A one-rank plane of ``variant`` over ``tensors`` parameters of ``megabytes`` in all (float32),
    on the default process group (``device``: CUDA when None), and its parameters."""
    device = device or torch.device("cuda")
    numel = int(megabytes * 1e6 / 4)
    sizes = [numel // tensors] * (tensors - 1) + [numel - (numel // tensors) * (tensors - 1)]
    params = [torch.nn.Parameter(torch.randn(n, device=device)) for n in sizes]
    plane = CollectivePlane(AveragedLayout.fixed(FlatTensors(params), FlatTensors([])), 0, 1, device)
    plane.fused = not variant.endswith("multi-tensor")
    plane.queued = variant == "queued"
    plane.out_of_place = variant.startswith("out-of-place")
    if variant.startswith("chunks-"):
        size, _, copy = variant.removeprefix("chunks-").partition("-")
        plane.chunk_bytes = int(float(size.removesuffix("MB")) * 1e6)
        plane.copy_in_parts = copy != "whole-copy"
    return plane, params


def leave_gradients(params: list[torch.nn.Parameter]) -> None:
    """The gradients a step leaves (held by the parameters alone); the round drops them."""
    for p in params:
        p.grad = torch.empty_like(p)


def measure(megabytes: float, iters: int, tensors: int, variant: str) -> dict[str, object]:
    plane, params = one_rank_plane(megabytes, tensors, variant)
    layout = plane.layout
    numel = sum(p.numel() for p in params)
    weights = round_weights([1], 1.0)

    def after_a_step() -> None:
        leave_gradients(params)

    def average() -> None:
        plane.average(weights)

    rounds = plane.round_buffers()

    def bare() -> None:  # the collectives of the round as the plane issues them
        if plane._reduces_out_of_place():
            for work in plane.reduce_into(rounds, 1.0):
                work.wait()
        else:
            plane.sum_scaled(layout.joint, 1.0)

    local = torch.zeros(META_SIZE, dtype=torch.float64, device="cuda")
    local[Meta.STEPS], local[Meta.FINITE] = 1.0, 1.0

    def whole_round() -> None:
        plane.start(local)
        plane.collect()

    def bare_round() -> None:
        plane.exchange(local)
        bare()

    for _ in range(5):
        after_a_step()
        average()
        bare()
        after_a_step()
        whole_round()
        bare_round()
    torch.cuda.synchronize()
    average_ms, wall_average_ms = timed(average, after_a_step, iters)
    bare_ms, wall_bare_ms = timed(bare, lambda: None, iters)
    round_ms, wall_round_ms = timed(whole_round, after_a_step, iters)
    bare_round_ms, wall_bare_round_ms = timed(bare_round, lambda: None, iters)
    per_round, names, spent = kernels(average, after_a_step, 20)
    bare_kernels, bare_names, _ = kernels(bare, lambda: None, 20)
    drift_us = sum(us for name, us in spent.items() if "drift" in name or "settle" in name)  # the Triton kernels
    plane.watch = PollingWatch()  # type: ignore[assignment]
    for _ in range(5):
        after_a_step()
        average()
    watched_ms, wall_watched_ms = timed(average, after_a_step, iters)
    plane.watch = None
    out_of_place = plane._reduces_out_of_place()
    return {
        "bytes": numel * 4,
        "tensors": tensors,
        "bare_collective_ms": bare_ms,
        "average_ms": average_ms,
        "own_ms": average_ms - bare_ms,
        "wall_bare_ms": wall_bare_ms,
        "wall_average_ms": wall_average_ms,
        "wall_own_ms": wall_average_ms - wall_bare_ms,
        "round_ms": round_ms,
        "bare_round_ms": bare_round_ms,
        "round_own_ms": round_ms - bare_round_ms,
        "wall_round_own_ms": wall_round_ms - wall_bare_round_ms,
        "watched_average_ms": watched_ms,
        "watched_own_ms": watched_ms - bare_ms,
        "wall_watched_own_ms": wall_watched_ms - wall_bare_ms,
        "own_kernel_us": sum(us for name, us in spent.items() if name not in bare_names),
        "drift_kernel_us": drift_us,
        "drift_read_tb_per_s": 2 * numel * 4 / drift_us / 1e6 if drift_us else None,
        # The settling also writes the consensus over the live values: three passes, not two.
        "drift_tb_per_s": (3 if out_of_place else 2) * numel * 4 / drift_us / 1e6 if drift_us else None,
        "kernel_us": spent,
        "kernels_per_round": per_round,
        "kernels_of_the_bare_collective": bare_kernels,
        "kernel_names": names,
        "fused_drift": plane._drift is not None and plane.fused,
        "queued_drift": plane._drift_stream is not None,
        "chunk_bytes": plane.chunk_bytes,
        "copy_in_parts": plane.copy_in_parts,
        "out_of_place": out_of_place,
        "collectives_per_round": collectives_per_round(average, after_a_step),
        "round_peak_extra_mb": round_peak_extra_bytes(average, after_a_step) / 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--tensors", type=int, default=60, help="parameter tensors per model")
    parser.add_argument("--out", default="averaging_overhead.json")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants {','.join(unknown)} is invalid: expected some of {', '.join(VARIANTS)}")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{os.path.join(tmp, 'pg')}", rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
        try:
            result: dict[str, object] = {
                f"{name}{'' if variant == 'fused' else '-' + variant}": measure(mb, args.iters, args.tensors, variant)
                for name, mb in SIZES_MB.items() for variant in variants
            }
        finally:
            dist.destroy_process_group()
    result["device"] = torch.cuda.get_device_name(0)
    result["torch"] = torch.__version__
    result["command"] = "python tools/averaging_overhead.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items())
    print(json.dumps(result, indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
