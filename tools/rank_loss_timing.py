"""How long a lost rank costs: detection, regroup and the samples trained again, per mode and fault.

    python tools/rank_loss_timing.py --out docs/benchmarks/rank_loss [--modes ...] [--faults ...] [--repeat 3]

Runs ``tests/scripts/fault_fit.py`` (3 CPU ranks, gloo, Lightning's popen launcher) once per mode,
fault and repeat, and reads what the job left: the fault's wall time (written by the faulty rank
just before it acts), each survivor's detection time (``Loss.detected_at``), and every rank's
per-step records. It reports

* **detect**: the fault to the first survivor's detection;
* **resume**: the fault to the first training step any survivor starts after every survivor has
  detected the loss (the regroup, the retried round and the re-dispatch all fall in between);
* **redone**: samples the lost rank had trained that were not in the consensus (the survivors
  train them again), and the lost rank's batches that the survivors took over in all.

Results go to ``<out>/rank_loss.json`` and ``<out>/rank_loss.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "fault_fit.py"
MODES = ("nccl_sync", "nccl_cadence", "cpu_sync", "cpu_cadence", "cpu_async")
FAULTS = {"kill": "kill:1:{step}", "kill-rank0": "kill:0:{step}", "stop": "stop:2:{step}", "raise": "raise:1:{step}",
          "loop": "loop:1:{step}", "sleep_in_collective": "sleep_in_collective:2:{step}"}
DEFAULT_FAULTS = ("kill", "kill-rank0", "stop", "raise")
"""The lost ranks; ``loop`` and ``sleep_in_collective`` are the stuck ones (alive, no progress)."""
TAG = "ELCHE_RANK_LOSS_TIMING"


def run_once(out: Path, mode: str, fault: str, step: int, liveness_s: float, timeout_s: float,
             devices: int = 3, accelerator: str = "cpu", epochs: int = 2, samples: int = 480,
             delays_ms: tuple[float, ...] = ()) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    tag = secrets.token_hex(6)
    env = {**os.environ, TAG: tag, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    command = [sys.executable, str(SCRIPT), str(out), "--mode", mode, "--fault", FAULTS[fault].format(step=step),
               "--liveness", str(liveness_s), "--epochs", str(epochs), "--samples", str(samples),
               "--devices", str(devices), "--accelerator", accelerator]
    if delays_ms:
        command += ["--delays-ms", *map(str, delays_ms)]
    with open(out / "job.log", "w") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        proc.wait(timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    while _tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    leftover = _tagged(tag)
    for pid in leftover:
        os.kill(pid, signal.SIGKILL)
    return measure(out, mode, fault, leftover)


def measure(out: Path, mode: str, fault: str, leftover: list[int]) -> dict[str, Any]:
    results = [json.loads(p.read_text()) for p in sorted(out.glob("result-rank*.json"))]
    faults = {int(p.stem.removeprefix("fault-rank")): json.loads(p.read_text()) for p in out.glob("fault-rank*.json")}
    row: dict[str, Any] = {"mode": mode, "fault": fault, "survivors": len(results), "leftover": len(leftover)}
    if not results or not faults or not results[0]["losses"]:
        row["error"] = (out / "job.log").read_text()[-2000:]
        return row
    (lost_rank, fault_info), = faults.items()
    fault_time = float(fault_info["time"])
    detected = [float(r["losses"][0]["detected_at"]) for r in results]
    resume = min(
        (step["time"] for r in results for step in _steps(out, r["original_rank"]) if step["time"] > max(detected)),
        default=float("nan"),
    )
    loss = results[0]["losses"][0]
    kept = int(loss["trained_batches"][str(lost_rank)])
    lost_steps = [s for s in _steps(out, lost_rank) if s["epoch"] == fault_info["epoch"]]
    # The batch the fault interrupted was logged before its optimizer step and not trained.
    trained_after = max(0, len(lost_steps) - 1 - kept)
    row.update({
        "detect_s": min(detected) - fault_time,
        "resume_s": resume - fault_time,
        "redone_samples": sum(len(s["indices"]) for s in lost_steps[kept : kept + trained_after]),
        "kept_batches": kept,
        "reason": next(iter(loss["reasons"].values())),
    })
    if fault_info.get("window_s"):  # a stuck rank: its own measured window when it stalled
        row.update({"window_s": float(fault_info["window_s"]), "bound_s": fault_info.get("bound_s"),
                    "detect_windows": row["detect_s"] / float(fault_info["window_s"])})
    return row


def _steps(out: Path, rank: int) -> list[dict[str, Any]]:
    path = out / f"steps-rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _tagged(tag: str, variable: str = TAG) -> list[int]:
    """The live processes (not zombies) whose environment sets ``variable=tag``."""
    marker = f"{variable}={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                    if state not in ("Z", "X"):
                        found.append(int(entry.name))
            except OSError:
                continue
    return found


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"Lost-rank cost, {args.devices} {args.accelerator} ranks, liveness_timeout={args.liveness} s, "
        f"{args.repeat} run(s) per cell, "
        f"host {socket.gethostname()} ({os.cpu_count()} cores), {time.strftime('%Y-%m-%d')}, commit {_commit()}.",
        f"Command: `python tools/rank_loss_timing.py --out {args.out} --modes {' '.join(args.modes)} "
        f"--faults {' '.join(args.faults)} --liveness {args.liveness} "
        f"--repeat {args.repeat} --devices {args.devices} --accelerator {args.accelerator} --step {args.step} "
        f"--epochs {args.epochs} --samples {args.samples}"
        + (f" --delays-ms {' '.join(map(str, args.delays_ms))}" if args.delays_ms else "") + "`",
        "",
        "| mode | fault | runs ok | detect s (median, max) | resume s (median, max) | redone samples (median) |",
        "|---|---|---|---|---|---|",
    ]
    for mode in args.modes:
        for fault in args.faults:
            cell = [r for r in rows if r["mode"] == mode and r["fault"] == fault]
            ok = [r for r in cell if "error" not in r and r["leftover"] == 0]
            if not ok:
                lines.append(f"| {mode} | {fault} | 0/{len(cell)} | - | - | - |")
                continue
            detect = [r["detect_s"] for r in ok]
            resume = [r["resume_s"] for r in ok]
            lines.append(
                f"| {mode} | {fault} | {len(ok)}/{len(cell)} | {statistics.median(detect):.2f}, {max(detect):.2f} | "
                f"{statistics.median(resume):.2f}, {max(resume):.2f} | "
                f"{statistics.median(r['redone_samples'] for r in ok):.0f} |"
            )
    stuck = [r for r in rows if "window_s" in r and "error" not in r]
    if stuck:
        lines += ["", "| mode | stuck rank | its window s (median) | its bound s | detect s (median, max) | "
                  "detect in its windows (median) |", "|---|---|---|---|---|---|"]
        for mode in args.modes:
            for fault in args.faults:
                cell = [r for r in stuck if r["mode"] == mode and r["fault"] == fault]
                if cell:
                    detect = [r["detect_s"] for r in cell]
                    lines.append(
                        f"| {mode} | {fault} | {statistics.median(r['window_s'] for r in cell):.3f} | "
                        f"{statistics.median(r['bound_s'] or 0.0 for r in cell):.1f} | "
                        f"{statistics.median(detect):.2f}, {max(detect):.2f} | "
                        f"{statistics.median(r['detect_windows'] for r in cell):.0f} |")
    return "\n".join(lines) + "\n"


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--faults", nargs="+", default=list(DEFAULT_FAULTS), choices=list(FAULTS))
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--step", type=int, default=12, help="the faulty rank's optimizer step of the fault")
    parser.add_argument("--liveness", type=float, default=30.0, help="liveness_timeout in seconds (default: 30)")
    parser.add_argument("--parallel", type=int, default=1, help="jobs at once")
    parser.add_argument("--devices", type=int, default=3, help="ranks per job")
    parser.add_argument("--accelerator", default="cpu", help="cpu (gloo) or gpu (NCCL)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=480, help="the training set's size")
    parser.add_argument("--delays-ms", type=float, nargs="+", default=(),
                        help="each rank's step time in ms (default: the fit script's 2, 5, 3)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cells = [(m, f, k) for m in args.modes for f in args.faults for k in range(args.repeat)]
    rows: list[dict[str, Any]] = []
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        futures = [pool.submit(run_once, args.out / "runs" / f"{m}-{f}-{k}", m, f, args.step, args.liveness,
                               120.0 + 2 * args.liveness, args.devices, args.accelerator, args.epochs,
                               args.samples, tuple(args.delays_ms)) for m, f, k in cells]
        for future in futures:
            rows.append(future.result())
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "error"}), flush=True)
    (args.out / "rank_loss.json").write_text(json.dumps(rows, indent=1))
    (args.out / "rank_loss.md").write_text(markdown(rows, args))
    print(markdown(rows, args))


if __name__ == "__main__":
    main()
