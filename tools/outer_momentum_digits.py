"""Which outer momentum suits ElChe's short windows? DiLoCo variants on scikit-learn digits.

Two CPU ranks (gloo), rank 1 throttled 2x, 30 epochs, MLP on digits (the benchmark's
``DigitsWorkload``); prints rank 0's held-out accuracy per arm and seed, and a JSON line at the end.
Arms: ``nccl_sync`` (reference), ``nccl_cadence`` with ``DiLoCo(0.7, 0.9)`` (published values),
the same without DiLoCo's inner-optimizer reset, ``DiLoCo(0.7, 0.5)`` and ``DiLoCo(1.0, 0.5)``.

    python tools/outer_momentum_digits.py --seeds 2
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from datetime import timedelta

import torch
import torch.multiprocessing as mp
from lightning.pytorch import Trainer, seed_everything

from lightning_elche import DiLoCo, ElCheConfig, ElCheStrategy
from lightning_elche.outer import OuterOptimizer

ARMS = ("nccl_sync", "diloco_0.7_0.9", "diloco_0.7_0.9_no_reset", "diloco_0.7_0.5", "diloco_1.0_0.5")


class DiLoCoWithoutReset(DiLoCo):
    """DiLoCo's outer step, but the ranks keep their inner optimizer state."""

    @property
    def resets_inner(self) -> bool:
        return False


def outer_for(arm: str) -> OuterOptimizer | None:
    if arm == "nccl_sync":
        return None
    _, lr, momentum, *rest = arm.split("_")
    kind = DiLoCoWithoutReset if rest else DiLoCo
    return kind(lr=float(lr), momentum=float(momentum))


def rank_main(rank: int, port: int, seeds: int) -> None:
    from lightning_elche.bench.workloads import DigitsWorkload, train_loader
    from lightning_elche.testing import Throttle

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0",
                      LOCAL_RANK=str(rank), RANK=str(rank))
    workload = DigitsWorkload(torch.device("cpu"))
    accuracy: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for seed in range(seeds):
        for arm in ARMS:
            seed_everything(seed, verbose=False)
            module = workload.make_module()
            mode = "nccl_sync" if arm == "nccl_sync" else "nccl_cadence"
            strategy = ElCheStrategy(elche=ElCheConfig.preset(mode), outer_optimizer=outer_for(arm),
                                     timeout=timedelta(seconds=60), summary=False)
            trainer = Trainer(accelerator="cpu", devices=2, max_epochs=30, strategy=strategy,
                              callbacks=[Throttle(1, 2.0)], logger=False, enable_progress_bar=False,
                              enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0)
            trainer.fit(module, train_dataloaders=train_loader(workload.train_set(), 32, drop_last=False))
            accuracy[arm].append(round(workload.evaluate(module)["held_out_acc"], 4))
            if rank == 0:
                print(f"{arm} seed {seed}: held-out accuracy {accuracy[arm][-1]}", flush=True)
    if rank == 0:
        print(json.dumps(accuracy))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=2)
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(rank_main, args=(port, args.seeds), nprocs=2, join=True)


if __name__ == "__main__":
    main()
