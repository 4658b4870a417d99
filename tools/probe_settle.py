"""Which settling kernel is fastest inside the out-of-place round, on one GPU (issue 25, item 2).

The settling kernel (:mod:`lightning_elche.planes.settle`) reads the live values and the round's
consensus and writes the consensus over the live values: three passes over the model. Timed alone
it ran near the copy's bandwidth; inside the round it ran slower, right after the collectives had
written the round buffer (whose last tens of MB are still in the L2 cache, dirty). This probe runs
``tools/averaging_overhead.py``'s own measurement of the out-of-place round (``measure``) with the
plane's kernel swapped for variants of it, at the tool's two model sizes:

* ``reverse``: programs walk the buffer from its end, where the collective wrote last, so the
  consensus still in L2 is read before it is evicted;
* ``evict``: both loads marked ``evict_first`` and the store streaming (``.cs``): the values are
  touched once, so they need not displace what is still to be read;
* ``stages3``: the loop as ``tl.range(..., num_stages=3)`` (Triton's software pipelining), with both;
* blocks of 1024 and 2048 values, the grid the device's size (``PROGRAMS_PER_SM``) or one
  program per block (``flat``).

``base`` is the plane's kernel as committed: the forward walk without hints until `178832a`
(``docs/benchmarks/overhead/probe-settle-374638e-h100.json``), the walk from the end with hints since.
Each variant is first checked against :func:`~lightning_elche.planes.settle.settle_multi_tensor`.

    python tools/probe_settle.py --out probe_settle.json
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import statistics
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from lightning_elche.planes import settle
from lightning_elche.planes.settle import (
    FusedSettle,
    Settled,
    add_squares,
    end_program,
    settle_multi_tensor,
    settled_numel,
)

MODELS_MB = {"resnet20x4": 17.31, "char-medium": 77.24}


@triton.jit  # type: ignore[untyped-decorator]
def _settle_variant(live_ptr, consensus_ptr, numel, measured, partial_ptr, first_program,  # type: ignore[no-untyped-def]
                    tickets_ptr, out_ptr, total_programs, BLOCK: tl.constexpr, FINISH_BLOCK: tl.constexpr,
                    REVERSE: tl.constexpr, EVICT: tl.constexpr, STAGES: tl.constexpr):
    program = tl.program_id(0)
    blocks = tl.cdiv(numel, BLOCK)
    squares = tl.zeros((BLOCK,), dtype=tl.float32)
    norms = tl.zeros((BLOCK,), dtype=tl.float32)
    after = tl.zeros((BLOCK,), dtype=tl.float32)
    for step in tl.range(program, blocks, tl.num_programs(0), num_stages=STAGES):
        if REVERSE:
            index = (blocks - 1 - step) * BLOCK + tl.arange(0, BLOCK)
        else:
            index = step * BLOCK + tl.arange(0, BLOCK)
        inside = index < numel
        if EVICT:
            pre = tl.load(live_ptr + index, mask=inside, other=0.0, eviction_policy="evict_first")
            consensus = tl.load(consensus_ptr + index, mask=inside, other=0.0, eviction_policy="evict_first")
            tl.store(live_ptr + index, consensus, mask=inside, cache_modifier=".cs")
        else:
            pre = tl.load(live_ptr + index, mask=inside, other=0.0)
            consensus = tl.load(consensus_ptr + index, mask=inside, other=0.0)
            tl.store(live_ptr + index, consensus, mask=inside)
        squares, norms, after = add_squares(pre, consensus, index, measured, squares, norms, after)
    end_program(partial_ptr, first_program + program, squares, norms, after, tickets_ptr, out_ptr, total_programs,
                FINISH_BLOCK)


class Launcher:
    """Stands in for ``settle._settle_kernel``: the variant with its switches bound."""

    def __init__(self, reverse: bool, evict: bool, stages: int) -> None:
        self.switches = {"REVERSE": reverse, "EVICT": evict, "STAGES": stages}

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        launch = _settle_variant[grid]
        return lambda *args, **kwargs: launch(*args, **kwargs, **self.switches)


def load_overhead_tool() -> Any:
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "averaging_overhead.py")
    spec = importlib.util.spec_from_file_location("averaging_overhead", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check(numel: int = 1_000_003) -> float:
    """The largest relative error of the swapped kernel against the multi-tensor settling."""
    rounded = -(-numel // 16) * 16  # settled_numel's length, the live buffer's spare tail covering it
    live = torch.randn(rounded + 16, device="cuda")[:numel]
    consensus = torch.randn(settled_numel(live), device="cuda")
    reference_live = live.clone()
    expected = settle_multi_tensor([Settled(reference_live, consensus, numel - 7)])
    got = FusedSettle([live])([Settled(live, consensus, numel - 7)])
    assert torch.equal(live, reference_live), "the consensus did not land in the live values"
    return float(((got - expected).abs() / expected.abs()).max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="probe_settle.json")
    parser.add_argument("--iters", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=2, help="measurements per variant and model (their median)")
    args = parser.parse_args()
    tool = load_overhead_tool()
    original = settle._settle_kernel, settle.SETTLE_BLOCK, settle.PROGRAMS_PER_SM
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                              "triton": triton.__version__, "rows": []}
    configs: list[tuple[str, bool, bool, int, int, int]] = [("base", False, False, 1, 1024, 4)]
    for (reverse, evict, stages), block, per_sm in itertools.product(
            [(False, False, 1), (True, False, 1), (False, True, 1), (True, True, 1), (True, True, 3)],
            (1024, 2048), (4, 10_000)):
        name = ("reverse" if reverse else "forward") + ("+evict" if evict else "")
        name += f"+stages{stages}" if stages > 1 else ""
        configs.append((name, reverse, evict, stages, block, per_sm))
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{os.path.join(tmp, 'pg')}", rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
        try:
            for name, reverse, evict, stages, block, per_sm in configs:
                settle._settle_kernel = original[0] if name == "base" else Launcher(reverse, evict, stages)
                settle.SETTLE_BLOCK = block
                settle.PROGRAMS_PER_SM = per_sm
                grid = "flat" if per_sm == 10_000 else f"{per_sm}/SM"
                row: dict[str, Any] = {"kernel": name, "block": block, "grid": grid}
                try:
                    row["relative_error"] = check()
                    for model, megabytes in MODELS_MB.items():
                        kernel_us = []
                        for _ in range(args.repeats):  # the machine is shared: a median
                            measured = tool.measure(megabytes, args.iters, 60, "out-of-place")
                            kernel_us.append(measured["drift_kernel_us"])
                        row[f"{model}_settle_us"] = statistics.median(kernel_us)
                        row[f"{model}_settle_us_all"] = kernel_us
                        row[f"{model}_tb_per_s"] = 3 * megabytes * 1e6 / statistics.median(kernel_us) / 1e6
                except Exception as error:  # a variant that does not compile here is a finding, not a stop
                    row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
                print(json.dumps(row), flush=True)
                result["rows"].append(row)
                with open(args.out, "w") as f:  # what a run cut short has found so far
                    json.dump(result, f, indent=1)
            settle._settle_kernel, settle.SETTLE_BLOCK, settle.PROGRAMS_PER_SM = original
            result["multi_tensor_own_kernel_us"] = {
                model: tool.measure(megabytes, args.iters, 60, "out-of-place-multi-tensor")["own_kernel_us"]
                for model, megabytes in MODELS_MB.items()}
        finally:
            dist.destroy_process_group()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
