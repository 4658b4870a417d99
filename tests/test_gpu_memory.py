"""Peak accelerator memory of the ``nccl_*`` modes against Lightning DDP, on ONE GPU (`pytest -m gpu`).

Runs the benchmark harness itself (its memory columns are what the docs quote): both ranks on
``cuda:0`` over gloo (``--share-gpu``), the 67 M-parameter MLP with SGD and momentum and the
medium byte-level transformer (19 M parameters) with AdamW, outer optimizer off, rank-loss
tolerance on (the defaults). DDP holds its gradient buckets, a parameter
copy local SGD does not need; the rounds keep their pre-round values in the stale gradients, so
the ``nccl_*`` modes must peak at least 0.8 f32 parameter copies below DDP on every rank.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(420)]

BOUND_COPIES = -0.8


@pytest.mark.parametrize("model, batch", [("mlp-wide", 256), ("char-medium", 64)])
def test_nccl_modes_peak_at_least_0_8_parameter_copies_below_ddp_on_one_gpu(tmp_path: Path, model: str,
                                                                            batch: int) -> None:
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    command = [
        sys.executable, "-m", "lightning_elche.bench", "--rig", "gpu2-homo", "--share-gpu", "--budget", "tiny",
        "--model", model, "--tp-batch", str(batch), "--seeds", "0", "--only-headline", "--tp-seconds", "1",
        "--tp-arms", "ddp,ddp_post_local_sgd,nccl_sync,nccl_cadence", "--no-plots", "--out", str(tmp_path),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=400, env=dict(os.environ))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    keep = os.environ.get("ELCHE_KEEP_BENCH")  # a folder to copy the run's tables to (device runs)
    if keep:
        for name in ("gpu2-homo.json", "gpu2-homo.md"):
            shutil.copy(tmp_path / name, Path(keep) / f"memory-{model}-{name}")
    result = json.loads((tmp_path / "gpu2-homo.json").read_text())
    arms = result["arms"]
    ddp = arms["ddp"]["memory"]
    assert ddp["measured"], ddp
    for mode in ("nccl_sync", "nccl_cadence"):
        memory = arms[mode]["memory"]
        copies = memory["vs_ddp_param_copies"]
        peaks = [p / 1e6 for p in memory["peak_allocated"]]
        print(f"{mode}: peak MB {peaks}, DDP {[p / 1e6 for p in ddp['peak_allocated']]}, vs DDP {copies} copies")
        assert all(c <= BOUND_COPIES for c in copies), f"{mode}: {copies} parameter copies vs DDP, bound {BOUND_COPIES}"
