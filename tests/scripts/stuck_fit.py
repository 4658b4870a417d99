"""One rank of a 2-rank CPU fit in which a rank gets stuck, or the ranks' collectives disagree.

    python stuck_fit.py OUT_DIR --rank R --port P --mode M --case CASE [--grace S] [--stuck-rank 1]
    python stuck_fit.py OUT_DIR --launcher popen --port P --mode M --case training   (rank 0 only)

Each rank is its own process (``LOCAL_RANK`` set: Lightning takes the processes as launched
outside), so that a test sees every rank's exit status; ``--launcher popen`` starts rank 0 only
and lets Lightning's launcher start rank 1. Cases:

* stuck phases (the ``--stuck-rank`` loops forever there, sleeping): ``training`` (training_step),
  ``validation`` (validation_step), ``sanity`` (validation_step in the sanity check),
  ``on_train_end``, ``checkpoint`` (on_save_checkpoint of an epoch-end ModelCheckpoint),
  ``strategy_teardown`` (the strategy's own teardown), ``teardown_hook`` (a callback's teardown,
  after Lightning put back the pre-fit signal handlers), ``raw_barrier`` (a bare
  ``torch.distributed.barrier()`` in on_train_end that its peer never joins: blocked in C);
* collectives that cannot complete: ``uneven_gather`` (``self.all_gather`` of a list of 5 numbers
  on rank 0, 3 on rank 1, in on_train_end, as Lightning's
  ``test_distributed_sampler_without_global_seed`` does), ``issue_barriers`` (rank 0 calls
  ``barrier()`` twice in on_train_end, rank 1 once), ``lone_barrier`` (rank 0 alone calls
  ``barrier()`` in on_train_epoch_end), ``peer_left`` (rank 1 fails in on_train_end while rank 0
  waits in a barrier there, which rank 0 passes alone once it agreed on the loss; rank 1's script
  catches the error and lives on); ``matching`` (every
  checked collective, called alike on both ranks, writes ``matching-rank<r>.json``).

The stuck rank writes ``stuck-rank<r>.json`` (time, pid) when it gets stuck; every rank whose fit
ends with an exception writes ``result-rank<r>.json`` (the error and when); a rank about to enter
the collective of its case writes ``entered-rank<r>.json`` (when).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_elche import ElCheStrategy  # noqa: E402

STUCK_CASES = ("training", "validation", "sanity", "on_train_end", "checkpoint", "strategy_teardown",
               "teardown_hook", "raw_barrier")
COLLECTIVE_CASES = ("uneven_gather", "issue_barriers", "lone_barrier", "peer_left", "matching")


def get_stuck(out: str, rank: int, phase: str) -> None:
    Path(out, f"stuck-rank{rank}.json").write_text(json.dumps({"time": time.time(), "pid": os.getpid(),
                                                                "phase": phase}))
    while True:  # an endless loop in user code (sleeping: the machine's cores are shared)
        time.sleep(0.02)


def launch_rank() -> int:
    """The rank this process was launched as (ranks are renumbered after a lost rank)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def entered(out: str) -> None:
    """This rank is about to enter the collective of its case (the test times the error from here)."""
    Path(out, f"entered-rank{launch_rank()}.json").write_text(json.dumps({"time": time.time()}))


def data(n: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=generator)
    return TensorDataset(x, x.sum(dim=1, keepdim=True))


class StuckModel(pl.LightningModule):
    def __init__(self, out: str, case: str, stuck_rank: int) -> None:
        super().__init__()
        self.net = nn.Linear(8, 1)
        self.out, self.case, self.stuck_rank = out, case, stuck_rank

    def stuck_here(self, phase: str) -> bool:
        return self.case == phase and self.global_rank == self.stuck_rank

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.stuck_here("training") and batch_idx == 2:
            get_stuck(self.out, self.global_rank, "training_step")
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if self.trainer.sanity_checking and self.stuck_here("sanity"):
            get_stuck(self.out, self.global_rank, "validation_step (sanity check)")
        if not self.trainer.sanity_checking and self.stuck_here("validation"):
            get_stuck(self.out, self.global_rank, "validation_step")
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def on_train_epoch_end(self) -> None:
        if self.case == "lone_barrier" and self.global_rank == 0 and self.current_epoch == 0:
            entered(self.out)
            self.trainer.strategy.barrier()

    def on_train_end(self) -> None:
        rank = self.global_rank
        if self.stuck_here("on_train_end"):
            get_stuck(self.out, rank, "on_train_end")
        if self.stuck_here("raw_barrier"):
            Path(self.out, f"stuck-rank{rank}.json").write_text(json.dumps(
                {"time": time.time(), "pid": os.getpid(), "phase": "raw barrier"}))
            dist.barrier()  # bypasses the strategy: its peer never joins; blocked inside gloo
        if self.case in COLLECTIVE_CASES and self.case != "lone_barrier":
            entered(self.out)
        if self.case == "uneven_gather":
            self.all_gather(list(range(5 if rank == 0 else 3)))
        if self.case == "issue_barriers":
            for _ in range(2 if rank == 0 else 1):
                self.trainer.strategy.barrier()
        if self.case == "matching":
            self.matching_collectives()
        if self.case == "peer_left":
            if rank == 1:
                raise RuntimeError("rank 1 gave up in on_train_end")
            self.trainer.strategy.barrier()

    def matching_collectives(self) -> None:
        """The checked collectives, called alike on every rank, give what Lightning's give."""
        rank, strategy = self.global_rank, self.trainer.strategy
        before = strategy._collectives.count
        gathered = self.all_gather({"rank": rank, "xs": [10 * rank, 10 * rank + 1]})
        entries_of_the_gather = strategy._collectives.count - before
        strategy.barrier("matching")
        mean = strategy.reduce(torch.tensor(float(rank)), reduce_op="mean")
        total = strategy.reduce(torch.tensor([rank, 1]), reduce_op="sum")
        chosen = strategy.broadcast(f"from rank {rank}", src=1)
        Path(self.out, f"matching-rank{rank}.json").write_text(json.dumps({
            "rank": gathered["rank"].tolist(), "xs": [x.tolist() for x in gathered["xs"]],
            "mean": mean.item(), "total": total.tolist(), "broadcast": chosen,
            "entries_of_the_gather": entries_of_the_gather}))

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.stuck_here("checkpoint"):
            get_stuck(self.out, self.global_rank, "on_save_checkpoint")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(data(64), batch_size=4, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(data(16), batch_size=4)


class StuckTeardown(pl.Callback):
    def __init__(self, out: str, stuck_rank: int) -> None:
        self.out, self.stuck_rank = out, stuck_rank

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.global_rank == self.stuck_rank:
            get_stuck(self.out, trainer.global_rank, "Callback.teardown")


class StuckTeardownStrategy(ElCheStrategy):
    """A strategy whose own teardown hangs on one rank (as a transport thread that never ends would)."""

    stuck_out = ""
    stuck_rank = 1

    def teardown(self) -> None:
        if self.global_rank == self.stuck_rank:
            get_stuck(self.stuck_out, self.global_rank, "ElCheStrategy.teardown")
        super().teardown()


def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    if args.launcher == "external":
        os.environ.update(WORLD_SIZE="2", NODE_RANK="0", LOCAL_RANK=str(args.rank), RANK=str(args.rank))
    case = args.case
    grace = timedelta(seconds=args.grace) if args.grace is not None else None
    strategy_type = StuckTeardownStrategy if case == "strategy_teardown" else ElCheStrategy
    StuckTeardownStrategy.stuck_out, StuckTeardownStrategy.stuck_rank = args.out_dir, args.stuck_rank
    strategy = strategy_type(mode=args.mode, timeout=timedelta(seconds=120), snapshot_timeout=timedelta(seconds=60),
                             stop_grace=grace, summary=False)
    callbacks: list[pl.Callback] = []
    if case == "checkpoint":
        callbacks.append(ModelCheckpoint(dirpath=str(Path(args.out_dir, "ckpt")), every_n_epochs=1))
    if case == "teardown_hook":
        callbacks.append(StuckTeardown(args.out_dir, args.stuck_rank))
    validating = case in ("validation", "sanity")
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, max_epochs=args.epochs, strategy=strategy, callbacks=callbacks,
        limit_val_batches=1.0 if validating else 0, num_sanity_val_steps=2 if case == "sanity" else 0,
        enable_checkpointing=case == "checkpoint", enable_progress_bar=False, enable_model_summary=False,
        logger=False, default_root_dir=args.out_dir,
    )
    started = time.time()
    try:
        trainer.fit(StuckModel(args.out_dir, case, args.stuck_rank))
    except Exception as error:  # noqa: BLE001 (the test reads what each rank ended with)
        Path(args.out_dir, f"result-rank{launch_rank()}.json").write_text(json.dumps({
            "error": type(error).__name__, "message": str(error), "time": time.time(), "started": started}))
        if case == "peer_left" and launch_rank() == 1:
            time.sleep(20)  # the process lives on after its fit failed
        raise


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--mode", default="cpu_async")
    parser.add_argument("--case", choices=STUCK_CASES + COLLECTIVE_CASES, required=True)
    parser.add_argument("--stuck-rank", type=int, default=1)
    parser.add_argument("--grace", type=float, default=None, help="stop_grace in seconds")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--launcher", choices=("external", "popen"), default="external")
    main(parser.parse_args())
