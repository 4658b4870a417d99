"""bf16 wire and frozen/unfrozen parameters with the CPU plane fed from CUDA (pinned snapshots on a
side stream). CI has no GPU: these run on the device machine with `pytest -m gpu`."""

from __future__ import annotations

from datetime import timedelta

import lightning.pytorch as pl
import pytest
import torch
from wire_helpers import BackboneRegression, FineTuneRegression, load

from lightning_elche import ElCheConfig, ElCheStrategy

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def gpu_fit(tmp_path, mode: str, model: pl.LightningModule, epochs: int) -> None:
    assert torch.cuda.device_count() >= 2, "needs 2 CUDA GPUs"
    pl.seed_everything(0, verbose=False)
    strategy = ElCheStrategy(elche=ElCheConfig(mode=mode, bf16_wire=True, anchor=2, max_anchor=4),
                             start_method="spawn", timeout=timedelta(seconds=60))
    trainer = pl.Trainer(accelerator="cuda", devices=2, max_epochs=epochs, strategy=strategy, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(tmp_path))
    trainer.fit(model)


@pytest.mark.parametrize("mode", ["cpu_cadence", "cpu_async"])
def test_bf16_wire_keeps_f32_weights_on_gpus(tmp_path, mode):
    gpu_fit(tmp_path, mode, FineTuneRegression(str(tmp_path)), epochs=5)
    r0, r1 = load(tmp_path, "wire")
    assert r0["params"] == r1["params"], "replicas differ after fit"
    weights = torch.tensor(r0["params"][0])
    assert not torch.equal(weights, weights.bfloat16().float()), "the weights were rounded to bf16"
    print(f"GPU bf16 wire {mode}: loss {r0['loss']:.3g}, rounds {r0['rounds']}")
    assert r0["loss"] < 1e-5


@pytest.mark.parametrize("mode", ["cpu_cadence", "cpu_async"])
def test_unfreezing_with_the_bf16_wire_on_gpus(tmp_path, mode):
    gpu_fit(tmp_path, mode, BackboneRegression(str(tmp_path), unfreeze_at_epoch=1), epochs=3)
    r0, r1 = load(tmp_path, "frozen")
    assert r0["final"] == r1["final"], "replicas differ after fit"
    assert r0["final"]["backbone.0.weight"] != r0["initial"]["backbone.0.weight"]
    small, large = r0["round_bytes"][0], r0["round_bytes"][1]
    assert r0["round_bytes"] == [small, large, large] and large > 5 * small
