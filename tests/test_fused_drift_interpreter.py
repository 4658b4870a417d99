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

pytest.importorskip("triton", minversion="3.6", reason="the kernel is checked with Triton 3.6 (the device's) and later")

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


def test_the_drift_kernel_matches_float64_norms_in_tritons_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("checked")
