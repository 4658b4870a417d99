"""Exactly-once check of real multi-rank fits at many ranks (CPU processes, gloo).

The reproduction of the cpu_async sample loss of issue 13: per-step sleeps of 2, 4, 8, 3 ms
repeated over the ranks, 6144 samples, batch 32, default chunking, 3 epochs. Every rank records
the sample indices it trained; the driver checks that every epoch's union is each index exactly
once and that every rank ends with the same parameters.

    python tools/many_rank_coverage.py --ranks 8 16 --modes cpu_async --repeats 5 --out DIR

Needs about one core per rank (run it on a many-core machine).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SLEEPS_MS = (2.0, 4.0, 8.0, 3.0)


def worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    from lightning_elche import ElCheStrategy

    torch.set_num_threads(1)

    class Indexed(Dataset):
        def __init__(self, n: int) -> None:
            g = torch.Generator().manual_seed(0)
            self.x = torch.randn(n, 8, generator=g)
            self.y = self.x.sum(1, keepdim=True)

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
            return i, self.x[i], self.y[i]

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
            self.seen: dict[int, list[int]] = {}

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            idx, x, y = batch
            self.seen.setdefault(self.current_epoch, []).extend(idx.tolist())
            time.sleep(SLEEPS_MS[self.global_rank % len(SLEEPS_MS)] / 1000.0)
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(Indexed(args.samples), batch_size=args.batch, shuffle=True)

        def on_fit_end(self) -> None:
            record = {"seen": {str(k): v for k, v in self.seen.items()},
                      "params": torch.cat([p.detach().flatten() for p in self.parameters()]).tolist()}
            Path(args.out, f"rank{self.global_rank}.json").write_text(json.dumps(record))

    from datetime import timedelta

    trainer = pl.Trainer(
        accelerator="cpu", devices=args.ranks, max_epochs=args.epochs, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=args.out,
        strategy=ElCheStrategy(mode=args.mode, timeout=timedelta(seconds=60)),
    )
    trainer.fit(Model())


def check(out: Path, ranks: int, samples: int, epochs: int) -> dict[str, Any]:
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]
    missing, repeated = {}, {}
    for e in range(epochs):
        got: list[int] = []
        for rec in records:
            got += rec["seen"].get(str(e), [])
        counts: dict[int, int] = {}
        for i in got:
            counts[i] = counts.get(i, 0) + 1
        missing[e] = samples - len(counts)
        repeated[e] = sum(c - 1 for c in counts.values())
    identical = all(rec["params"] == records[0]["params"] for rec in records)
    return {"missing": missing, "repeated": repeated, "identical_params": identical,
            "exact": identical and not any(missing.values()) and not any(repeated.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8])
    parser.add_argument("--modes", nargs="+", default=["cpu_async"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--samples", type=int, default=6144)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=240.0)
    parser.add_argument("--out", default="many_rank_coverage")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(argparse.Namespace(**{**vars(args), "ranks": args.ranks[0]}))
        return
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    results = []
    for ranks in args.ranks:
        for mode in args.modes:
            for repeat in range(args.repeats):
                out = root / f"{mode}-n{ranks}-r{repeat}"
                out.mkdir(parents=True, exist_ok=True)
                cmd = [sys.executable, __file__, "--worker", "--ranks", str(ranks), "--mode", mode, "--out", str(out),
                       "--samples", str(args.samples), "--batch", str(args.batch), "--epochs", str(args.epochs)]
                start = time.perf_counter()
                env = {**os.environ, "OMP_NUM_THREADS": "1"}
                try:
                    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout_s)
                    rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-2000:]
                except subprocess.TimeoutExpired:
                    rc, tail = -1, "timed out"
                row: dict[str, Any] = {"ranks": ranks, "mode": mode, "repeat": repeat, "rc": rc,
                                       "seconds": round(time.perf_counter() - start, 1)}
                if rc == 0:
                    row.update(check(out, ranks, args.samples, args.epochs))
                else:
                    row["error"] = tail
                results.append(row)
                print(json.dumps(row), flush=True)
    (root / "results.json").write_text(json.dumps(results, indent=1))
    bad = [r for r in results if not r.get("exact")]
    print(f"{len(results) - len(bad)} exact, {len(bad)} not exact")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
