"""The one-launch drift kernel run by Triton's interpreter on the CPU (where Triton is installed):
its arithmetic over blocks of several tensors and dtypes, and the ticket counter, against float64
norms. Its speed is the GPU's to show (``tests/test_gpu_round.py``,
``tools/averaging_overhead.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

# Triton 3.6's interpreter cannot run the kernel (a loaded scalar as a loop bound; its compiler
# can, and the device compiles it with 3.6); 3.7, 3.8 and 3.9 run these checks.
pytest.importorskip("triton", minversion="3.7", reason="needs Triton 3.7 or later (its interpreter)")

SCRIPT = textwrap.dedent("""
    import torch
    from lightning_elche.planes.fused import FusedDrift

    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        # 4096-value blocks, partial last blocks, tensors of one value; every other round the
        # pre-round copies sit one element off 16 bytes (no wide loads that round).
        # The last list mixes members read 16 bytes at a time with members that cannot be.
        for sizes in ([4096 * 3, 12, 8 * 4096 + 16], [10, 4096 * 2 + 5, 7, 16, 4100], [1],
                      [4096 * 2, 10, 6, 4096 + 8, 3, 4096 * 3 + 5, 16]):
            flat = torch.randn(sum(sizes)).to(dtype)
            views = list(torch.split(flat, sizes))
            drift = FusedDrift([flat], views)
            for round_index in range(4):
                pre = []
                for view in views:
                    room = torch.empty(view.numel() + 8, dtype=dtype)
                    copy = room[8 * (round_index % 2) or 1:][:view.numel()]
                    copy.copy_(view + 0.1 * torch.randn(view.shape).to(dtype))
                    pre.append(copy)
                measured = drift([t.data_ptr() for t in pre])
                before, after = torch.cat([t.double() for t in pre]), flat.double()
                expected = torch.stack([(before - after).norm(), before.norm(), after.norm()])
                assert torch.allclose(measured, expected, rtol=1e-6), (dtype, sizes, round_index, measured, expected)
                assert drift._tickets.item() == 0, "the last program resets the ticket counter"
    print("checked")
""")


# The round in parts (``CollectivePlane.chunk_bytes``): the parts cover each joint buffer once, in
# order; the copy kernel copies every value to its pre-round place; the measurement launched part
# by part equals float64 norms and leaves the ticket counter at 0.
PARTS = """import torch
from lightning_elche.planes.fused import FusedDrift
torch.manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    for sizes, shift in (([4096 * 3, 12, 8 * 4096 + 16, 5], 3), ([10, 4096 * 2 + 5, 7, 16, 4100], 3), ([1], 3),
                         ([4096 * 2, 10, 6, 4096 + 8, 3, 4096 * 3 + 5, 16], 0), ([4096 * 3, 4096 * 2], 0)):
        room = torch.randn(sum(sizes) + 7).to(dtype)
        flat = room[shift:shift + sum(sizes)]  # a joint buffer, at an offset of its storage (off 16 bytes) or not
        views = list(torch.split(flat, sizes))
        extra = torch.randn(33).to(dtype)  # a joint buffer without measured parameters
        drift = FusedDrift([flat, extra], views)
        for chunk_bytes in (1, 4096 * 4, 4096 * 16, 1 << 30):
            plan = drift.chunks(chunk_bytes)
            covered = torch.cat([c.view for c in plan if c.view.data_ptr() != extra.data_ptr()] )
            assert torch.equal(covered, flat), "the parts cover the buffer once, in order"
            assert sum(c.blocks for c in plan) == drift._blocks
            pre = []
            for view in views:
                space = torch.full((view.numel() + 8,), float("nan")).to(dtype)
                pre.append(space[8 if shift == 0 else 1:][:view.numel()])
            tables = drift.tables([t.data_ptr() for t in pre])
            out = torch.empty(3, dtype=torch.float64)
            expected_pre = flat.double().clone()
            for c in plan:
                drift.copy(c, tables)
            assert all(torch.equal(p, v) for p, v in zip(pre, views)), "the copy kernel copies every value"
            with torch.no_grad():
                flat.mul_(0.5)  # the consensus
            for c in plan:
                drift.measure(c, tables, out)
            after = flat.double()
            expected = torch.stack([(expected_pre - after).norm(), expected_pre.norm(), after.norm()])
            assert torch.allclose(out, expected, rtol=1e-6), (dtype, sizes, chunk_bytes, out, expected)
            assert drift._tickets.item() == 0
print("checked")
"""


def interpret(*argv: str) -> None:
    """Run a check (``-c SOURCE`` or a script) in a Python of its own with Triton's interpreter."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("checked")


def test_the_drift_kernel_matches_float64_norms_in_tritons_interpreter():
    interpret("-c", SCRIPT)


def test_the_round_in_parts_copies_every_value_and_measures_part_by_part_in_tritons_interpreter():
    interpret("-c", PARTS)


def test_the_planes_round_in_parts_restores_and_measures_like_the_whole_round_in_tritons_interpreter():
    interpret(os.path.join(os.path.dirname(__file__), "pipelined_round_check.py"))


# The kernels compiled for an H100 (sm_90) without a GPU: the launches of members that allow it
# (VECTOR > 1) read and write 16 bytes per instruction; the rest 4 bytes (2 for bfloat16).
PTX = """import re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lightning_elche.planes import fused
pointers = ["live_ptr", "offsets_ptr", "saved_addresses_ptr", "sizes_ptr", "block_tensor_ptr", "block_start_ptr"]
def accesses(kernel, extra, constexprs, dtype):
    signature = {name: "*i64" for name in pointers} | {"live_ptr": "*" + dtype} | extra
    signature |= {name: "constexpr" for name in constexprs}
    aligned = {(i,): [["tt.divisibility", 16]] for i, kind in enumerate(signature.values()) if kind.startswith("*")}
    code = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=aligned),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
    return set(re.findall(r"(?:ld|st)\\.global(?:\\.cg)?\\.(?:v4\\.)?b(?:16|32)", code))
drift = {"partial_ptr": "*fp32", "first_block": "i32", "tickets_ptr": "*i32", "out_ptr": "*fp64",
         "total_blocks": "i32", "block_base": "i32"}
for dtype, vector, narrow in (("fp32", 4, "b32"), ("bf16", 8, "b16")):
    wide = accesses(fused._copy_kernel, {"block_base": "i32"}, {"BLOCK": 4096, "VECTOR": vector}, dtype)
    assert wide == {"ld.global.v4.b32", "st.global.v4.b32"}, wide
    thin = accesses(fused._copy_kernel, {"block_base": "i32"}, {"BLOCK": 4096, "VECTOR": 1}, dtype)
    assert thin == {"ld.global." + narrow, "st.global." + narrow}, thin
    measured = accesses(fused._drift_kernel, drift, {"BLOCK": 4096, "FINISH_BLOCK": 1024, "VECTOR": vector}, dtype)
    assert "ld.global.v4.b32" in measured and "ld.global." + narrow not in measured, measured
print("checked")
"""


def test_the_wide_launches_compile_to_16_byte_loads_and_stores():
    interpret_off = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", PTX], env=interpret_off, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("checked")
