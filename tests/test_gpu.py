"""2 × GPU (NCCL) runs. CI has no GPU: these run on the device machine with `pytest -m gpu`.

The README's test command deselects the marker (`-m "not gpu"`), so nothing is skipped silently.
"""

from __future__ import annotations

import json
from datetime import timedelta

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from model_helpers import WideRegression
from process_helpers import load_records

from lightning_elche import ElCheStrategy
from lightning_elche.testing import Throttle

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


@pytest.mark.parametrize("mode", ["nccl_cadence", "cpu_cadence", "cpu_async"])
def test_heterogeneous_run_with_green_context_throttle(tmp_path, mode):
    assert torch.cuda.device_count() >= 2, "needs 2 CUDA GPUs"
    pl.seed_everything(0, verbose=False)
    model = WideRegression(str(tmp_path))
    throttle = Throttle(1, 2.5)
    trainer = pl.Trainer(
        accelerator="cuda", devices=2, max_epochs=3,
        strategy=ElCheStrategy(mode=mode, start_method="spawn", timeout=timedelta(seconds=60)),
        callbacks=[throttle, ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), monitor="val_loss")],
        enable_progress_bar=False, enable_model_summary=False, logger=False,
    )
    trainer.fit(model)
    r0, r1 = load_records(tmp_path)
    assert torch.distributed.is_available()
    assert r0["params"] == r1["params"], "replicas differ after fit"
    assert r0["rounds"] == r1["rounds"] > 0
    assert r0["steps"][0] > 1.3 * r0["steps"][1], f"fast GPU did not train more: {r0['steps']}"
    for e in ("0", "1", "2"):
        assert sorted(r0["seen"][e] + r1["seen"][e]) == list(range(16384))
    assert r0["callback_metrics"]["val_loss"] == r1["callback_metrics"]["val_loss"]
    ms_per_step = [c / s for c, s in zip(r0["compute_s"], r0["steps"], strict=True)]
    print(f"GPU hetero {mode}: steps {r0['steps']}, ms/step {[round(1000 * m, 2) for m in ms_per_step]}, "
          f"rounds {r0['rounds']}, final plan {r0['batch_counts']}, mean stall per sync (ms) {r0['mean_stall_ms']}")
    assert ms_per_step[1] > 1.5 * ms_per_step[0], f"green-context throttle did not slow rank 1: {ms_per_step}"


@pytest.mark.parametrize("mode", ["nccl_cadence", "cpu_async"])
def test_a_killed_rank_is_survived_on_nccl_without_a_watchdog_abort(tmp_path, mode):
    """2 GPUs: rank 1 is killed mid-epoch; rank 0 goes on alone within 60 s (never a watchdog abort)."""
    from fault_jobs import check_survived, run_job

    job = run_job(tmp_path, mode, ["kill:1:12"], liveness_s=10.0, ranks=2, accelerator="gpu", timeout_s=240.0)
    assert "watchdog" not in job.log.lower() and "SIGABRT" not in job.log, job.log[-3000:]
    check_survived(job, {1})
    loss = job.results[0]["losses"][0]
    fault = json.loads((tmp_path / "fault-rank1.json").read_text())
    assert loss["detected_at"] - fault["time"] < 60.0
    print(f"{mode}: lost after {loss['detected_at'] - fault['time']:.2f} s, regrouped with {loss['regrouped_with']}")


def test_zero_copy_round_on_one_gpu_nccl_premul_and_inductor(tmp_path):
    """One GPU, a one-rank NCCL group: the plane scales inside the reduction (PreMulSum) on the
    parameters' own storage, holds one parameter-sized buffer (the pre-round values), and an
    inductor-compiled model sees every value a round writes."""
    import torch.distributed as dist
    from torch import nn

    from lightning_elche.averaging import AveragedLayout, round_weights
    from lightning_elche.planes.collective import CollectivePlane

    assert torch.cuda.is_available(), "needs a CUDA GPU"
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024)).cuda()
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        x = torch.randn(64, 1024, device="cuda")
        compiled = torch.compile(model)
        expected = model(x).detach()
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
        plane = CollectivePlane(AveragedLayout(model), 0, 1, torch.device("cuda", 0))
        torch.cuda.synchronize()
        # The parameters moved into the flat buffer; their old storage was freed: no net growth.
        assert torch.cuda.memory_allocated() - allocated < 0.05 * param_bytes
        assert torch.allclose(compiled(x), expected, atol=1e-5)
        assert plane._premul, "NCCL should scale inside the reduction"
        before = torch.cuda.memory_allocated()
        divergence = plane.average(round_weights([1], 1.0))
        delta, pre, post = divergence.tolist()
        assert delta == 0.0 and pre == pytest.approx(post, rel=1e-6) and pre > 0.0
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() - before < 1.05 * param_bytes  # only the pre-round copy
        plane.sum_scaled(plane.params.flats, 0.5)  # one rank, factor 1/2: the round halves every value
        with torch.no_grad():
            halved = model[2].weight.clone()
        assert torch.allclose(compiled(x), model(x), atol=1e-5)
        assert plane.params.flats[0].untyped_storage().data_ptr() == model[2].weight.untyped_storage().data_ptr()
        torch.manual_seed(0)
        model_ref = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024)).cuda()
        assert torch.allclose(halved, 0.5 * model_ref[2].weight.detach(), atol=1e-7)
        plane.close()
    finally:
        dist.destroy_process_group()
