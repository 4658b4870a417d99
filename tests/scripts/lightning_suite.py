"""One rank of a 2-process launch (gloo on CPU) that runs ported Lightning cases one after the other.

    python lightning_suite.py OUT_DIR --mode nccl_cadence --rank R --port P --cases SUITE:CASE ...

The test starts both ranks with the same arguments but ``--rank``. Every case runs on both ranks
with its own Trainer; each rank writes ``OUT_DIR/<suite>/<case>/rank<r>.json`` (status, the error
with its traceback, seconds). Before and after each case both ranks meet on the launch's store
and check the process group with one all-reduce. When that fails (a case left a peer inside a
collective until the group's timeout) both ranks build a new process group and go on with the next
case; when they cannot meet at all, the remaining cases are recorded as not run, naming the case
after which the launch broke. Every Trainer of the launch uses the one process group, as several
fits in one job do.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

WORLD_SIZE = 2
MEET_TIMEOUT = timedelta(seconds=90)


def write(out_dir: Path, suite: str, case: str, rank: int, record: dict) -> None:
    folder = out_dir / suite / case
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rank{rank}.json").write_text(json.dumps(record))


class Launch:
    """The launch's own store (hosted by rank 0) and the process group the cases use, rebuilt on it
    when a case leaves it broken."""

    def __init__(self, rank: int, port: int, timeout: timedelta) -> None:
        self.rank, self.timeout = rank, timeout
        self.store = dist.TCPStore("127.0.0.1", port, WORLD_SIZE, is_master=rank == 0, timeout=MEET_TIMEOUT)
        self.generation = 0
        self._init_group()

    def _init_group(self) -> None:
        store = dist.PrefixStore(f"group{self.generation}/", self.store)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=WORLD_SIZE, timeout=self.timeout)

    def meet(self, tag: str) -> None:
        self.store.set(f"meet/{tag}/{self.rank}", "1")
        self.store.wait([f"meet/{tag}/{r}" for r in range(WORLD_SIZE)], MEET_TIMEOUT)

    def group_works(self) -> bool:
        try:
            check = torch.ones(1)
            dist.all_reduce(check)
            return check.item() == WORLD_SIZE
        except Exception:  # noqa: BLE001 (a broken group is what this looks for)
            return False

    def rebuild_group(self) -> None:
        self.meet(f"rebuild{self.generation}")
        dist.destroy_process_group()
        self.generation += 1
        self._init_group()


def run_rank(args: argparse.Namespace) -> None:
    launched = time.perf_counter()
    rank = args.rank
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), WORLD_SIZE=str(WORLD_SIZE),
                      NODE_RANK="0", LOCAL_RANK=str(rank), RANK=str(rank))
    torch.set_num_threads(1)
    import lightning.pytorch as pl
    from ported.harness import PG_TIMEOUT, Context

    out_dir = Path(args.out_dir)
    cases = [tuple(entry.split(":", 1)) for entry in args.cases]
    launch = Launch(rank, args.port, PG_TIMEOUT)
    print(f"lightning_suite: rank {rank} set up in {time.perf_counter() - launched:.1f} s", flush=True)
    broken_after = None
    try:
        for suite_name, name in cases:
            if broken_after is not None:
                write(out_dir, suite_name, name, rank, {"status": "not run", "seconds": 0.0, "error":
                      f"not run: the ranks could not meet after case {broken_after} (see its result)"})
                continue
            case = importlib.import_module(f"ported.{suite_name}").SUITE.cases[name]
            tmp_path = out_dir / suite_name / name / "tmp"
            tmp_path.mkdir(parents=True, exist_ok=True)
            record: dict = {"status": "passed", "error": "", "seconds": 0.0}
            started = time.perf_counter()
            try:
                launch.meet(f"{suite_name}/{name}/start")
                pl.seed_everything(0, verbose=False)
                started = time.perf_counter()
                case.run(Context(args.mode, rank, WORLD_SIZE, tmp_path, launch.meet))
            except BaseException as error:  # noqa: BLE001 (every outcome is the case's result)
                record.update(status="failed", error="".join(traceback.format_exception(error))[-6000:])
            record["seconds"] = time.perf_counter() - started
            try:
                launch.meet(f"{suite_name}/{name}/end")
                if not launch.group_works():
                    record["error"] += "\n(the case left the process group broken; the launch built a new one)"
                    launch.rebuild_group()
            except Exception:  # noqa: BLE001
                broken_after = f"{suite_name}:{name}"
            write(out_dir, suite_name, name, rank, record)
        print(f"lightning_suite: rank {rank} ran {len(cases)} cases in {time.perf_counter() - launched:.1f} s",
              flush=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--mode", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--cases", nargs="+", required=True, help="SUITE:CASE, in the order to run them")
    return parser.parse_args(argv)


if __name__ == "__main__":
    run_rank(parse_args(sys.argv[1:]))
