"""``python -m lightning_elche.bench --rig RIG [--budget tiny|quick|full]``.

Rigs: ``cpu2``, ``gpu2-hetero``, ``gpu2-homo`` (2 ranks), ``cpu4``, ``cpu8``, ``gpu4-hetero``,
``gpu8-hetero`` (N ranks). Starts the rank processes, waits for them, turns their records into
the report, and writes ``<out>/<rig>.md``, ``<out>/<rig>.json`` and ``<out>/<rig>-*.png``.
Exit status: 0 on success, 2 on a bad command line or a machine without the rig's GPUs, 3 when
the throttled devices are not measurably slower than rank 0's (the workload is input-bound), 1 on
any other failure.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import shlex
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

from lightning_elche.bench import metrics
from lightning_elche.bench.arms import available_elche_modes
from lightning_elche.bench.config import BenchConfig, build_config, parse_args
from lightning_elche.bench.plan import CONVERGENCE, SOLO_RANK0, THROUGHPUT, Group, build_plan, convergence_arms
from lightning_elche.bench.report import markdown, plot, write_json
from lightning_elche.bench.worker import EXIT_THROTTLE, free_port, worker_main

EXIT_FAILED = 1
GRACE_S = 15.0


def git_commit() -> tuple[str, bool]:
    """(HEAD commit of the checkout this package runs from, or "unknown"; whether tracked files
    have uncommitted changes). ``ELCHE_BENCH_COMMIT`` names the commit where the checkout has no
    git metadata (a copied tree on a remote machine)."""
    if os.environ.get("ELCHE_BENCH_COMMIT"):
        return os.environ["ELCHE_BENCH_COMMIT"], False
    where = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True,
                              cwd=where)
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True, timeout=10, check=True, cwd=where)
        return head.stdout.strip(), bool(status.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return "unknown", False


def run_stamp(rig: str, commit: Optional[str], argv: list[str]) -> dict[str, Any]:
    """What a result says produced it: the rig, the commit (``--commit`` where given, else git's),
    the date and the command line."""
    commit, dirty = (commit, False) if commit else git_commit()
    return {"rig": rig, "commit": commit, "commit_dirty": dirty,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join(["python", "-m", "lightning_elche.bench", *argv])}


def launch(config: BenchConfig, plan: list[Group], run_dir: str, t0: float) -> int:
    """Run every rank process to the end; returns 0, ``EXIT_THROTTLE`` or a failure status.

    If one rank fails, the others (blocked in a collective) get ``GRACE_S`` seconds and are then
    killed: only the processes started here are ever signalled.
    """
    if config.rig.accelerator == "cpu":
        os.environ["OMP_NUM_THREADS"] = "1"  # before the children import torch
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(target=worker_main, args=(rank, config, plan, run_dir, port, t0), name=f"elche-bench-rank{rank}")
        for rank in range(config.rig.world_size)
    ]
    for proc in procs:
        proc.start()
    hard_limit = t0 + 2.0 * config.budget.deadline_s + 600.0
    failed_at: Optional[float] = None
    try:
        while True:
            codes = [proc.exitcode for proc in procs]
            if all(code is not None for code in codes):
                return next((code for code in codes if code), 0)
            bad = [code for code in codes if code not in (None, 0)]
            if bad and failed_at is None:
                failed_at = time.time()
            if (failed_at is not None and time.time() - failed_at > GRACE_S) or time.time() > hard_limit:
                return bad[0] if bad else EXIT_FAILED
            time.sleep(0.2)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()


def check_machine(config: BenchConfig) -> Optional[str]:
    """Why this machine cannot run the rig (None: it can). A CPU rig with more ranks than logical
    CPUs runs, with a warning: its ranks share cores, so its rates say little."""
    world = config.rig.world_size
    if config.rig.accelerator == "cuda":
        import torch

        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if config.share_gpu:
            if found < 1:
                return "--share-gpu puts every rank on cuda:0; this machine has no GPU"
            return sm_problem(config, [torch.cuda.get_device_properties(0).multi_processor_count] * world)
        if found < world:
            return (f"--rig {config.rig.name} runs one process per GPU and needs {world} GPUs; this machine has "
                    f"{found}. Rigs for fewer GPUs: gpu2-hetero, gpu2-homo (2), gpu4-hetero (4).")
        return sm_problem(config, [torch.cuda.get_device_properties(k).multi_processor_count for k in range(world)])
    elif (os.cpu_count() or 1) < world:
        print(f"[bench] warning: --rig {config.rig.name} runs {world} ranks on {os.cpu_count()} logical CPU(s): the "
              "ranks share cores, so rates and efficiencies are not meaningful (structure only).", file=sys.stderr)
    return None


def sm_problem(config: BenchConfig, gpu_sms: list[int]) -> Optional[str]:
    """Why a setting's SM limit cannot apply to its rank's GPU (None: every one fits);
    ``gpu_sms[r]``: the SMs of rank r's GPU."""
    for setting in config.settings:
        for rank, sms in enumerate(gpu_sms):
            wanted = setting.rank_throttle(rank)[1]
            if wanted is not None and not 1 <= wanted <= sms:
                knob = "--rank1-sms" if config.rig.world_size == 2 else f"the {config.rig.name} SM spread"
                return (f"{knob}={wanted} (setting {setting.label}): rank {rank}'s GPU has {sms} SMs; expected "
                        f"1 to {sms}")
    return None


def load_records(run_dir: str) -> dict[str, list[dict[str, Any]]]:
    """{record name: [rank 0's, rank 1's, ...]} from ``<name>.rank<r>.json`` files."""
    found: dict[str, dict[int, dict[str, Any]]] = {}
    for path in Path(run_dir).glob("*.rank*.json"):
        name, _, rank = path.stem.rpartition(".rank")
        found.setdefault(name, {})[int(rank)] = json.loads(path.read_text())
    return {name: [ranks[r] for r in sorted(ranks)] for name, ranks in found.items()}


def describe_devices(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    first = per_rank[0]
    if "gpu" in first:
        gpus = ", ".join(f"{d['gpu']} ({d['gpu_sms']} SMs, {d['gpu_memory_gib']} GiB)" for d in per_rank)
        summary = (f"{len(per_rank)} GPUs: {gpus}; CUDA {first['cuda']}, NCCL {first['nccl']}; torch {first['torch']}, "
                   f"lightning {first['lightning']}, Python {first['python']}")
    else:
        # Each rank on one CPU: --pin-ranks, or a taskset of one CPU around the whole bench.
        pinned = all(len(d.get("cpus") or ()) == 1 for d in per_rank)
        placement = f", each on one CPU: {', '.join(str(d['cpus'][0]) for d in per_rank)}" if pinned else ""
        summary = (f"{first['cpu']} ({first['cpu_count']} logical CPUs), {len(per_rank)} ranks x "
                   f"{first['torch_threads']} torch thread(s){placement}; torch {first['torch']}, "
                   f"lightning {first['lightning']}, Python {first['python']}")
    return {"summary": summary, "ranks": per_rank}


def _ran(group: Group, records: dict[str, list[dict[str, Any]]]) -> bool:
    return all(job.job_id in records for job in group.jobs)


def throughput_sections(config: BenchConfig, plan: list[Group], records: dict[str, list[dict[str, Any]]]
                        ) -> dict[str, dict[str, Any]]:
    sections: dict[str, dict[str, Any]] = {}
    # The slowest rank's seconds per flat-parameter all-reduce of the throughput model (loss breakdown).
    reduce_device_s = max(r[THROUGHPUT]["flat_all_reduce_s"] for r in records["micro"]) if "micro" in records else None
    for setting in config.settings:
        groups = [g for g in plan if g.section == THROUGHPUT and g.jobs[0].setting == setting and _ran(g, records)]
        representatives = setting.representatives(config.rig.world_size, config.rig.solo_per_rank)
        passes = [metrics.throughput_pass([(job.arm, job.job_id) for job in g.jobs], records, representatives,
                                          reduce_device_s)
                  for g in groups]
        if passes:
            section = metrics.aggregate_passes(passes)
            section["setting"] = {"label": setting.label, "description": setting.describe()}
            section["description"] = setting.describe()
            if setting.limited:
                plan_record = records.get("micro_batch_plan", [{}])[0]
                section["limits"] = {"memory_fraction": list(setting.rank_memory),
                                     "micro_batch": list(setting.rank_micro_batch), "batch": config.budget.tp_batch,
                                     "planned": plan_record.get("planned"), "searched": plan_record.get("searched")}
            sections[setting.label] = section
    return sections


def convergence_section(config: BenchConfig, plan: list[Group], records: dict[str, list[dict[str, Any]]]
                        ) -> Optional[dict[str, Any]]:
    groups = [g for g in plan if g.section == CONVERGENCE and _ran(g, records)]
    if not groups:
        return None
    runs: dict[str, list[dict[str, Any]]] = {}
    for arm in (SOLO_RANK0, *convergence_arms(config)):
        runs[arm] = [records[f"{g.name}-{arm}"][0] for g in groups]
    workload = runs[SOLO_RANK0][0]["workload"]
    conv = metrics.convergence(runs, workload["quality"], workload["higher_is_better"], config.target)
    conv.update({"workload": workload["name"], "workload_details": workload, "seeds_run": len(groups),
                 "seeds_requested": config.budget.conv_seeds,
                 "curves": {arm: [r["curve"] for r in recs] for arm, recs in runs.items()}})
    return conv


def elche_traces(config: BenchConfig, plan: list[Group], records: dict[str, list[dict[str, Any]]]
                 ) -> dict[str, list[dict[str, Any]]]:
    first = next(g for g in plan if g.section == THROUGHPUT)
    return {job.arm: records[job.job_id][0]["trace"] for job in first.jobs
            if job.arm in config.elche_modes and job.job_id in records}


_CONVERGENCE_KEYS = ("final_quality", "time_to_target_s", "reached_target", "time_to_target_speedup_vs_ddp",
                     "final_quality_minus_ddp")


def summarize(config: BenchConfig, plan: list[Group], records: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The result: every number of the run (what ``<rig>.json`` holds, less the stamp)."""
    sections = throughput_sections(config, plan, records)
    headline = sections.pop(config.headline.label)
    conv = convergence_section(config, plan, records)
    arms = headline["arms"]
    if conv is not None:
        for arm, row in conv["arms"].items():
            arms.setdefault(arm, {}).update({k: row[k] for k in _CONVERGENCE_KEYS})
    first_tp = next(g for g in plan if g.section == THROUGHPUT)
    result: dict[str, Any] = {
        "rig": config.rig.name,
        "world_size": config.rig.world_size,
        "device": describe_devices(records["device"]),
        "config": dataclasses.asdict(config),
        "elche_modes": list(config.elche_modes),
        "elche_modes_skipped": dict(config.skipped_modes),
        "setting": headline["setting"],
        "throughput_workload": records[first_tp.jobs[0].job_id][0]["workload"]["name"],
        "passes": headline["passes"],
        "ideal_samples_per_s": headline["ideal_samples_per_s"],
        "measured_slowdown": headline["measured_slowdown"],
        "measured_slowdown_per_pass": headline["measured_slowdown_per_pass"],
        "measured_slowdown_range_per_pass": headline["measured_slowdown_range_per_pass"],
        "solo_brackets": headline["solo_brackets"],
        "spread_warnings": headline["spread_warnings"],
        "noise_warnings": headline["noise_warnings"],
        "speed_share": headline["speed_share"],
        "throttle_check": records.get("throttle_check", [None])[0],
        "arms": arms,
        "convergence": conv,
        "microbenchmark": metrics.microbenchmark(records["micro"], config.rig.world_size),
        "other_settings": sections,
        "skipped_groups": records.get("skipped", [{"groups": []}])[0]["groups"],
        "elche_traces": elche_traces(config, plan, records),
    }
    if headline.get("limits"):
        result["limits"] = headline["limits"]
    return result


def warn_noise(result: dict[str, Any]) -> list[str]:
    """Print each noise warning of the headline and the other settings to stderr; returns them."""
    sections = [(result["setting"]["label"], result), *result.get("other_settings", {}).items()]
    lines = [f"[bench] warning ({label}): {w['message']}." for label, section in sections
             for w in section.get("noise_warnings", [])]
    for line in lines:
        print(line, file=sys.stderr)
    return lines


def _read_errors(run_dir: str) -> str:
    texts = [p.read_text() for p in sorted(Path(run_dir).glob("error.rank*.txt"))]
    return "\n".join(texts) if texts else "(no traceback was written; see the output above)"


def write_outputs(result: dict[str, Any], out_dir: Path, plots: bool) -> str:
    """``<rig>.md``, ``<rig>.json`` and the plots; returns the Markdown."""
    stem = result["rig"]
    result["plots"] = plot(result, out_dir, stem) if plots else {"skipped": "--no-plots"}
    text = markdown(result)
    (out_dir / f"{stem}.md").write_text(text)
    write_json(result, out_dir / f"{stem}.json")
    return text


def replot(path: Path, plots: bool) -> int:
    result = json.loads(path.read_text())
    text = write_outputs(result, path.parent, plots)
    print(text)
    return 0


def churn_main(args: Any, argv: list[str]) -> int:
    """``--churn``: the goodput-under-churn arms (:mod:`lightning_elche.bench.churn`) instead of the protocol."""
    from lightning_elche.bench.churn import build_churn_config, run_churn

    try:
        config = build_churn_config(args)
    except ValueError as error:
        print(f"[bench] {error}", file=sys.stderr)
        return 2
    stamp = run_stamp(args.rig, args.commit, argv)
    command = stamp["command"]
    print(f"[bench] {command}: churn arms {', '.join(config.arms)}, {config.seconds:g} s each", flush=True)
    t0 = time.time()
    result = run_churn(config, Path(args.out), f"{args.rig}-churn", stamp)
    print((Path(args.out) / f"{args.rig}-churn.md").read_text())
    failed = [arm for arm in config.arms if result["arms"].get(arm, {}).get("samples_per_s") is None]
    print(f"[bench] wrote {args.out}/{args.rig}-churn.md and .json in {time.time() - t0:.0f} s", flush=True)
    if failed:
        print(f"[bench] churn arms without a measurement: {', '.join(failed)}", file=sys.stderr)
        return EXIT_FAILED
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.replot is not None:
        return replot(args.replot, not args.no_plots)
    if args.churn is not None:
        return churn_main(args, argv)
    modes, skipped = available_elche_modes()
    try:
        config = build_config(args, modes, skipped)
    except ValueError as error:
        print(f"[bench] {error}", file=sys.stderr)
        return 2
    problem = check_machine(config)
    if problem is not None:
        print(f"[bench] {problem}", file=sys.stderr)
        return 2
    plan = build_plan(config)
    out_dir = Path(config.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = run_stamp(config.rig.name, args.commit, argv)
    command = stamp["command"]
    print(f"[bench] {command}: {sum(len(g.jobs) for g in plan)} fits in {len(plan)} groups; "
          f"ElChe modes {', '.join(modes)} (not built: {', '.join(skipped) or 'none'})", flush=True)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="elche_bench_") as run_dir:
        status = launch(config, plan, run_dir, t0)
        records = load_records(run_dir)
        if status == EXIT_THROTTLE:
            check = records.get("throttle_check", [{}])[0]
            print(f"[bench] the slowest throttled device ran only {check.get('measured_slowdown', float('nan')):.2f}x "
                  f"slower than rank 0's alone (need >= {config.min_slowdown:g}x): the workload is input-bound (or the "
                  "throttle does not bite), so this rig shows no heterogeneity. Use a larger batch or model.",
                  file=sys.stderr)
            write_json({**stamp, "error": "throttle not measurable: workload input-bound", "throttle_check": check},
                       out_dir / f"{config.rig.name}.error.json")
            return EXIT_THROTTLE
        if status != 0:
            print(f"[bench] a rank process failed (exit status {status}):\n{_read_errors(run_dir)}", file=sys.stderr)
            return EXIT_FAILED
        result = summarize(config, plan, records)
    result = {**stamp, **result, "wall_s": time.time() - t0}
    text = write_outputs(result, out_dir, config.plots)
    print(text)
    warn_noise(result)
    print(f"[bench] wrote {out_dir / config.rig.name}.md, .json and {len(result['plots'].get('files', []))} plot(s) "
          f"in {result['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
