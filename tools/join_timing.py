"""What admitting a joiner costs: its wait from "ready" to its first batch, the cohort's stall, and
the state transfer's rate against the transport's raw bandwidth (issue 22, item 7).

    python tools/join_timing.py --out docs/benchmarks/join --params 1e6 1e8
    python tools/join_timing.py --out docs/benchmarks/join-gpu --params 1e6 1e8 --accelerator gpu --mode nccl_cadence

For each parameter count, one job of ``tests/scripts/fault_fit.py`` (an MLP 8-w-w-1 of about that
many parameters, plain SGD): a cohort of 2 ranks (Lightning's popen launcher) and, started with it,
a joiner (``ELCHE_JOIN=1``, member 2); cohort rank 0 waits at its step ``--hold-step`` until the
joiner asked to join, so that the admission comes in the middle of an epoch. Every process records
its admission's moments (``ELCHE_JOIN_TIMING``, lightning_elche/growth.py) and every batch it trains
(``steps-rank<r>.jsonl``); ``--after-join`` seconds after the joiner's first batch the job is
ended (exit codes -9 in the JSON are that). The tool reports

* **ready -> first batch**: the joiner's request (its model and loader built) to the start of its
  first training batch;
* **admission**: rank 0's admission, from the round that admits to the end of the change;
* **stall**: per member, the longest gap between two of its batches that overlaps the admission,
  less its median gap between batches (the step time), next to the longest gap elsewhere within an
  epoch (an ordinary round; the hold before the joiner's request left out);
* **transfer**: from rank 0's new group to the joiner's receipt of the state: its tensors copied
  into one buffer, one ``send``, the joiner's copies out of it (lightning_elche/state_transfer.py;
  before it, a ``torch.save``/``load`` copy and ``send_object_list``'s pickling), the tensor bytes
  and the rate;
* **raw**: the same bytes as one ``uint8`` tensor, ``dist.broadcast`` and ``send``/``recv`` between
  two processes on this host over the same backend (gloo; NCCL with ``--accelerator gpu``), best
  of ``--raw-repeat``.

The goal (issue 22): the stall no longer than the transfer, and the transfer at >= 0.5 of raw.
GPU runs need 3 GPUs: the cohort on GPUs 0 and 1, the joiner on ``--joiner-gpu`` (default 2).
Results go to ``<out>/join_timing.json`` and ``<out>/join_timing.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rank_loss_timing import _tagged  # noqa: E402  (a sibling tool: the processes a run left)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "fault_fit.py"
TAG = "ELCHE_JOIN_TIMING_TOOL"
JOINER = 2


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _environment(tag: str, port: int, out: Path) -> dict[str, str]:
    env = {**os.environ, TAG: tag, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "XDG_CACHE_HOME": str(out / "cache"), "ELCHE_JOIN_TIMING": str(out)}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "ELCHE_JOIN", "ELCHE_TEST_MEMBER"):
        env.pop(name, None)
    return env


def run_job(out: Path, params: float, args: argparse.Namespace) -> dict[str, Any]:
    """One cohort and its joiner; what their records say (:func:`measure`)."""
    shutil.rmtree(out, ignore_errors=True)  # the records are appended to
    out.mkdir(parents=True)
    tag, port = secrets.token_hex(6), _free_port()
    env = _environment(tag, port, out)
    command = [sys.executable, str(SCRIPT), str(out), "--mode", args.mode, "--devices", "2", "--accelerator",
               args.accelerator, "--params", str(params), "--samples", str(args.samples), "--batch-size", "8",
               "--epochs", str(args.epochs), "--delays-ms", "5", "5", "--liveness", str(args.liveness)]
    joiner_env = {**env, "ELCHE_JOIN": "1", "LOCAL_RANK": "0", "ELCHE_TEST_MEMBER": str(JOINER)}
    if args.accelerator == "gpu":
        env["CUDA_VISIBLE_DEVICES"] = "0,1"
        joiner_env["CUDA_VISIBLE_DEVICES"] = str(args.joiner_gpu)
    procs: list[subprocess.Popen[bytes]] = []
    started = time.time()
    try:
        with open(out / "job.log", "w") as log:
            procs.append(subprocess.Popen([*command, "--hold-for-joiner", str(args.hold_step)], env=env, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
        with open(out / "joiner.log", "w") as log:
            procs.append(subprocess.Popen(command, env=joiner_env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        # The admission is over once the joiner trains: a while after its first batch the job is
        # ended (a 1e8-parameter fit is slow and large; its end measures nothing).
        joiner_steps = out / f"steps-rank{JOINER}.jsonl"
        while any(p.poll() is None for p in procs) and time.time() < started + args.timeout:
            rows = _rows(joiner_steps) if joiner_steps.exists() else []
            if rows and time.time() > rows[0]["time"] + args.after_join:
                break
            time.sleep(0.5)
    finally:
        for pid in _tagged(tag, TAG):
            os.kill(pid, signal.SIGKILL)
    row: dict[str, Any] = {"params": params, "exit_codes": [p.poll() for p in procs],
                           "wall_s": time.time() - started}
    try:
        row.update(measure(out))
    except (OSError, KeyError, ValueError, StopIteration) as error:
        row["error"] = f"{type(error).__name__}: {error}; see {out}/job.log and joiner.log"
    return row


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _event(marks: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(m for m in marks if m["event"] == name)


def measure(out: Path) -> dict[str, Any]:
    marks = {m: _rows(out / f"join-timing-{m}.jsonl") for m in (0, 1, JOINER)}
    joiner, leader = marks[JOINER], marks[0]
    ready = _event(joiner, "ready")["time"]
    first_batch = _rows(out / f"steps-rank{JOINER}.jsonl")[0]["time"]
    admit_start, admit_end = _event(leader, "admit_start")["time"], _event(leader, "admit_end")["time"]
    regrouped = _event(leader, "regrouped")["time"]
    # Before lightning_elche/state_transfer.py rank 0 copied the state (torch.save/load) before the send.
    copied = next((m["time"] for m in leader if m["event"] == "state_copied"), regrouped)
    sent = _event(leader, "state_sent")
    received = _event(joiner, "state_received")["time"]
    tensor_bytes = int(sent["tensor_bytes"])
    transfer_s = received - regrouped  # copy, pickle, send, unpickle: the state's way to the joiner
    row: dict[str, Any] = {
        "ready_to_first_batch_s": first_batch - ready,
        "ready_to_admission_s": admit_start - ready,
        "admission_s": admit_end - admit_start,
        "entry_and_group_s": regrouped - admit_start,
        "copy_s": copied - regrouped,
        "send_s": sent["time"] - copied,
        "received_after_send_s": received - sent["time"],
        "transfer_s": transfer_s,
        "rest_s": _event(joiner, "rest_received")["time"] - _event(leader, "applied")["time"],
        "joiner_after_state_s": first_batch - received,
        "tensor_bytes": tensor_bytes,
        "transfer_mb_s": tensor_bytes / transfer_s / 1e6,
        "admitted_in_epoch": int(_event(leader, "admit_start")["epoch"]),
    }
    for member in (0, 1):
        steps = _rows(out / f"steps-rank{member}.jsonl")
        # Within an epoch: the gaps at an epoch's end are its validation and checkpoint.
        gaps = [(b["time"] - a["time"], a["time"], b["time"]) for a, b in zip(steps, steps[1:], strict=False)
                if a["epoch"] == b["epoch"]]
        during = [g for g, a, b in gaps if a <= admit_end and b >= admit_start]
        # Away from the hold (before the joiner's request) and the admission: the ordinary rounds.
        elsewhere = [g for g, a, b in gaps if b < ready - 1.0 or a > admit_end + 1.0]
        step = statistics.median(g for g, _, _ in gaps)
        row[f"rank{member}"] = {"step_s": step, "admission_gap_s": max(during, default=float("nan")),
                                "stall_s": max(during, default=float("nan")) - step,
                                "longest_other_gap_s": max(elsewhere, default=float("nan"))}
    row["stall_s"] = max(row[f"rank{m}"]["stall_s"] for m in (0, 1))
    return row


def raw_bandwidth(rank: int, port: int, size: int, repeat: int, backend: str, out: str) -> None:
    """A rank of a 2-process job (``torch.multiprocessing.spawn``): ``size`` bytes as one tensor,
    broadcast from rank 0 and sent to rank 1, ``repeat`` times each; rank 1 writes the times."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=2)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    tensor = torch.ones(size, dtype=torch.uint8, device=device)
    times: dict[str, list[float]] = {"broadcast": [], "send_recv": []}

    def timed(kind: str, operation: Any) -> None:
        dist.barrier()
        if backend == "nccl":
            torch.cuda.synchronize()
        started = time.perf_counter()
        operation()
        if backend == "nccl":
            torch.cuda.synchronize()
        times[kind].append(time.perf_counter() - started)

    for _ in range(repeat):
        timed("broadcast", lambda: dist.broadcast(tensor, src=0))
        timed("send_recv", lambda: dist.send(tensor, dst=1) if rank == 0 else dist.recv(tensor, src=0))
    if rank == 1:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def measure_raw(size: int, repeat: int, backend: str, out: Path) -> dict[str, float]:
    import torch.multiprocessing as mp

    path = out / f"raw-{size}.json"
    mp.spawn(raw_bandwidth, args=(_free_port(), size, repeat, backend, str(path)), nprocs=2, join=True)
    times = json.loads(path.read_text())
    return {f"raw_{kind}_s": min(values) for kind, values in times.items()} | {
        f"raw_{kind}_mb_s": size / min(values) / 1e6 for kind, values in times.items()}


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _f(value: Optional[float], digits: int = 2) -> str:
    return "-" if value is None or value != value else f"{value:.{digits}f}"


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    backend = "nccl" if args.accelerator == "gpu" else "gloo"
    lines = [
        f"Admission cost, mode {args.mode}, 2 {args.accelerator} ranks + 1 joiner ({backend}), "
        f"host {socket.gethostname()} ({os.cpu_count()} cores), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"commit {_commit()}.",
        f"Command: `python tools/join_timing.py --out {args.out} --params {' '.join(f'{p:g}' for p in args.params)} "
        f"--mode {args.mode} --accelerator {args.accelerator} --samples {args.samples} --epochs {args.epochs} "
        f"--hold-step {args.hold_step} --after-join {args.after_join}`",
        "",
        "| params | state MB | ready -> first batch s | admission s | entry+group s | copy s | send+recv s | "
        "transfer s | transfer MB/s | raw broadcast MB/s | raw send MB/s | transfer / raw send | "
        "stall s (rank 0, 1) | step s | longest other gap s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['params']:.0e} | failed: {row['error']} (exit codes {row['exit_codes']}) |")
            continue
        ratio = row["transfer_mb_s"] / row["raw_send_recv_mb_s"] if row.get("raw_send_recv_mb_s") else None
        lines.append(
            f"| {row['params']:.0e} | {row['tensor_bytes'] / 1e6:.1f} | {_f(row['ready_to_first_batch_s'])} | "
            f"{_f(row['admission_s'])} | {_f(row['entry_and_group_s'])} | {_f(row['copy_s'])} | "
            f"{_f(row['send_s'] + row['received_after_send_s'])} | {_f(row['transfer_s'])} | "
            f"{_f(row['transfer_mb_s'], 0)} | {_f(row.get('raw_broadcast_mb_s'), 0)} | "
            f"{_f(row.get('raw_send_recv_mb_s'), 0)} | {_f(ratio)} | "
            f"{_f(row['rank0']['stall_s'])}, {_f(row['rank1']['stall_s'])} | "
            f"{_f(row['rank0']['step_s'], 3)}, {_f(row['rank1']['step_s'], 3)} | "
            f"{_f(row['rank0']['longest_other_gap_s'])}, {_f(row['rank1']['longest_other_gap_s'])} |")
    lines += ["", "ready -> first batch = ready -> admission round (the rounds until a consensus round admits) + "
              "admission + the joiner's own setup after its state; transfer = copy + send+recv (pickle, transport, "
              "unpickle)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--params", type=float, nargs="+", default=[1e6, 1e8])
    parser.add_argument("--mode", default="cpu_cadence")
    parser.add_argument("--accelerator", default="cpu", choices=("cpu", "gpu"))
    parser.add_argument("--joiner-gpu", type=int, default=2, help="the joiner's GPU (gpu runs)")
    parser.add_argument("--samples", type=int, default=640, help="samples per epoch (batches of 8)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--hold-step", type=int, default=4, help="cohort rank 0 waits there for the join request")
    parser.add_argument("--liveness", type=float, default=30.0)
    parser.add_argument("--raw-repeat", type=int, default=3)
    parser.add_argument("--after-join", type=float, default=20.0,
                        help="seconds of training after the joiner's first batch before the job is ended")
    parser.add_argument("--timeout", type=float, default=900.0, help="per job, seconds")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for params in args.params:
        row = run_job(args.out / "runs" / f"{params:.0e}", params, args)
        if "tensor_bytes" in row:
            row.update(measure_raw(row["tensor_bytes"], args.raw_repeat, "nccl" if args.accelerator == "gpu"
                                   else "gloo", args.out / "runs"))
        rows.append(row)
        print(json.dumps(row), flush=True)
    (args.out / "join_timing.json").write_text(json.dumps(rows, indent=1))
    (args.out / "join_timing.md").write_text(markdown(rows, args))
    print(markdown(rows, args))


if __name__ == "__main__":
    main()
