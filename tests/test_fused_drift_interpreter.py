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
        # pre-round copies sit one element off.
        for sizes in ([4096 * 3, 12, 8 * 4096 + 16], [10, 4096 * 2 + 5, 7, 16, 4100], [1]):
            flat = torch.randn(sum(sizes)).to(dtype)
            views = list(torch.split(flat, sizes))
            drift = FusedDrift([flat], views)
            for round_index in range(4):
                pre = []
                for view in views:
                    room = torch.empty(view.numel() + 1, dtype=dtype)
                    copy = room[round_index % 2:][:view.numel()]
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
    for sizes in ([4096 * 3, 12, 8 * 4096 + 16, 5], [10, 4096 * 2 + 5, 7, 16, 4100], [1]):
        room = torch.randn(sum(sizes) + 7).to(dtype)
        flat = room[3:3 + sum(sizes)]  # a joint buffer at an offset of its storage
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
                space = torch.full((view.numel() + 1,), float("nan")).to(dtype)
                pre.append(space[1:])
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


# The end of an out-of-place round (``lightning_elche.planes.settle``): the consensus moved over
# every live value (the rounded length reaching into the spare tail), the norms over the measured
# head only, programs striding over buffers longer than the grid, two dtypes sharing one ticket
# counter, rounds back to back; against float64 norms and the multi-tensor path.
SETTLE = """import torch
from lightning_elche.averaging import shared_flat_tensors
from lightning_elche.planes import settle
from lightning_elche.planes.settle import FusedSettle, Settled, settle_multi_tensor, settled_numel
torch.manual_seed(0)
for programs_per_sm in (1, 4):  # 8 or 32 programs: the longest buffer takes several strides
    for sizes in ([4096 * 40 + 3, 17], [1, 4096], [4096 * 2, 0]):
        params = [torch.randn(sizes[0]), torch.randn(sizes[1]).to(torch.bfloat16)]
        buffers = [torch.randn(5), torch.randn(9).to(torch.bfloat16)] if sizes[1] else [torch.randn(5)]
        joint, (flat_params, _) = shared_flat_tensors([p for p in params if p.numel()], buffers)
        heads = {t.data_ptr(): t.numel() for t in flat_params.flats}
        fused = FusedSettle(joint, programs_per_sm)
        for round_index in range(3):
            live = [flat.clone() for flat in joint]
            consensus = [torch.randn(settled_numel(flat) + round_index).to(flat.dtype) for flat in joint]
            settled = [Settled(flat, c, heads.get(flat.data_ptr(), 0)) for flat, c in zip(joint, consensus)]
            pre = torch.cat([flat[:one.measured].double() for flat, one in zip(joint, settled)])
            after = torch.cat([c[:one.measured].double() for c, one in zip(consensus, settled)])
            expected = torch.stack([(pre - after).norm(), pre.norm(), after.norm()])
            measured = fused(settled)
            assert torch.allclose(measured, expected, rtol=1e-6), (sizes, round_index, measured, expected)
            assert fused._tickets.item() == 0, "the last program resets the ticket counter"
            for flat, c in zip(joint, consensus):
                assert torch.equal(flat, c[:flat.numel()]), "every live value takes the consensus"
            for flat, before in zip(joint, live):
                flat.copy_(before)
            reference = settle_multi_tensor([Settled(flat, c, one.measured)
                                             for flat, c, one in zip(joint, consensus, settled)])
            assert torch.allclose(measured, reference, rtol=1e-2), (measured, reference)  # bfloat16 rounds there
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


def test_the_settle_kernel_moves_the_consensus_and_matches_float64_norms_in_tritons_interpreter():
    interpret("-c", SETTLE)
