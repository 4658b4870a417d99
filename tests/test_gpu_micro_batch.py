"""``micro_batch="auto"`` on ONE GPU (`pytest -m gpu`): a process limited with
``torch.cuda.set_per_process_memory_fraction`` so that the loader's batch does not fit picks a
smaller micro-batch, trains, and its peak memory stays under the limit; a try leaves the gradients,
buffers and random generators as it found them.

Two ranks share ``cuda:0`` (each its own one-device "node", over gloo, as the benchmark's
``--share-gpu``): rank 1 is memory-limited, rank 0 is not.
"""

from __future__ import annotations

import json
import math
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch import Callback, LightningModule
from process_helpers import free_port
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_elche import ElCheStrategy
from lightning_elche.micro_batch_auto import CudaTry

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

# Activations dominate (a whole batch's are about 25x the parameters), so a quarter batch fits where the
# whole does not.
BATCH, DIM, HIDDEN = 16384, 256, 2048


class WideMLP(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                                 nn.Linear(HIDDEN, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4 * BATCH, DIM, generator=g)
        return DataLoader(TensorDataset(x, x[:, :1].clone()), batch_size=BATCH, shuffle=True)


def peak_of_a_step(model: nn.Module, samples: int, device: torch.device) -> int:
    x = torch.randn(samples, DIM, device=device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    nn.functional.mse_loss(model(x), x[:, :1]).backward()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    model.zero_grad(set_to_none=True)
    return peak


class ChosenSize(Callback):
    def on_train_end(self, trainer: pl.Trainer, pl_module: LightningModule) -> None:
        self.size = trainer.strategy._micro_batching.size  # type: ignore[attr-defined]


def memory_limited_rank(rank: int, out_dir: str, port: int, limit: int) -> None:
    """A rank of a 2-process fit on cuda:0 (each rank its own one-device "node", gloo): rank 1 is
    limited to ``limit`` bytes, rank 0 is not."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                      LOCAL_RANK="0", NODE_RANK=str(rank))
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    if rank == 1:
        torch.cuda.set_per_process_memory_fraction(limit / torch.cuda.get_device_properties(device).total_memory)
    torch.cuda.reset_peak_memory_stats(device)
    pl.seed_everything(0, verbose=False)
    model, chosen = WideMLP(), ChosenSize()
    strategy = ElCheStrategy(mode="nccl_sync", micro_batch="auto", process_group_backend="gloo",
                             timeout=timedelta(seconds=60))
    trainer = pl.Trainer(accelerator="cuda", devices=1, num_nodes=2, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[chosen], strategy=strategy)
    trainer.fit(model)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({
        "size": chosen.size, "peak_reserved": torch.cuda.max_memory_reserved(device), "losses": model.losses,
        "params": float(sum(p.detach().double().sum() for p in model.parameters())),
    }))


def test_auto_picks_a_smaller_micro_batch_on_the_memory_limited_rank_and_trains(tmp_path: Path) -> None:
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    device = torch.device("cuda", 0)
    probe = WideMLP().net.to(device)
    params = sum(p.numel() * p.element_size() for p in probe.parameters())
    whole, quarter = peak_of_a_step(probe, BATCH, device), peak_of_a_step(probe, BATCH // 4, device)
    del probe
    torch.cuda.empty_cache()
    # Room for a quarter batch with auto's reserve (10 % and two parameter copies), not for the batch.
    limit = int((quarter + 2 * params) / 0.9 * 1.05)
    assert whole > limit, f"the batch fits the limit anyway: {whole / 2**30:.2f} GiB <= {limit / 2**30:.2f} GiB"
    torch.multiprocessing.spawn(memory_limited_rank, args=(str(tmp_path), free_port(), limit), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    print(f"auto chose {r0['size']} and {r1['size']} of {BATCH}; rank 1 limit {limit / 2**30:.2f} GiB, peak reserved "
          f"{r1['peak_reserved'] / 2**30:.2f} GiB; a whole-batch step peaks at {whole / 2**30:.2f} GiB")
    assert r0["size"] == BATCH
    assert BATCH // 4 <= r1["size"] < BATCH
    assert r1["peak_reserved"] <= limit
    for r in (r0, r1):
        assert len(r["losses"]) == 2 and all(math.isfinite(v) for v in r["losses"])  # 4 batches over 2 ranks
    assert r0["params"] == r1["params"]  # one consensus after the last sync


def test_a_try_leaves_gradients_buffers_and_generators_as_it_found_them() -> None:
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    device = torch.device("cuda", 0)
    model = WideMLP().to(device)
    model.net(torch.randn(8, DIM, device=device)).sum().backward()
    grads = [p.grad for p in model.parameters()]
    values = [g.clone() for g in grads if g is not None]
    buffers = [b.clone() for b in model.buffers()]
    step = lambda batch: nn.functional.mse_loss(model.net(batch), batch[:, :1])  # noqa: E731
    trial = CudaTry(model, device, step)
    small, large = torch.randn(256, DIM, device=device), torch.randn(BATCH, DIM, device=device)
    rng = torch.cuda.get_rng_state(device)  # after drawing the inputs: only the tries must leave it as it is
    assert trial.peak(small) is not None
    before = torch.cuda.memory_allocated(device)
    torch.cuda.set_per_process_memory_fraction((before + 2**20) / torch.cuda.get_device_properties(device).total_memory,
                                               device)
    try:
        assert trial.peak(large) is None  # out of memory, caught and freed
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    assert all(p.grad is g for p, g in zip(model.parameters(), grads, strict=True))
    assert all(torch.equal(g, v) for g, v in zip([g for g in grads if g is not None], values, strict=True))
    assert all(torch.equal(b, c) for b, c in zip(model.buffers(), buffers, strict=True))
    assert torch.equal(torch.cuda.get_rng_state(device), rng)
    assert torch.cuda.memory_allocated(device) <= before + 2**20  # nothing of the tries left behind
