"""The numbers of the report, derived from the per-rank records (pure functions, no torch).

Formulas (``docs/benchmarks.md`` explains them):

* steady-state samples/s = samples every rank trained from the start of epoch 1 to the end of the
  last epoch ÷ (latest end − earliest start);
* efficiency = samples/s ÷ ideal, ideal = the sum over ranks of the solo rate of each rank's speed
  class (same pass; ranks with the same throttle share one solo fit): solo rank 0 + solo rank 1 on
  2 ranks;
* speed share of a rank = its class's solo rate ÷ ideal (the batch share a perfectly balanced arm
  gives it); share error of an arm = the largest |steady batch share ÷ speed share − 1| over ranks,
  the steady batch share counting each rank's batches from epoch 1 on; the in-arm share error
  (ElChe arms) compares the same shares with the in-arm speed shares, each rank's steady samples
  over its window compute seconds: how evenly the dispatch kept the ranks busy, whatever their
  speeds did between the solo fits and the arm;
* a ring all-reduce of N bytes makes each of W ranks send ``2 (W-1)/W · N`` bytes; an all-gather of
  m bytes per rank makes each send ``(W-1) · m``; a broadcast of N bytes puts ``(W-1) · N`` on the wire;
* bytes sent per sample = bytes all ranks sent during the fit ÷ samples all ranks trained;
* bus bandwidth = N · 2 (W-1)/W ÷ seconds per all-reduce.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any, Optional

from lightning_elche.bench.limits import optimizer_steps
from lightning_elche.bench.plan import DDP, LOCAL_SGD, SOLO_PAIR

TOLERANCE_ACC = 0.005
"""Default target = Lightning DDP's worst-seed final accuracy minus 0.5 percentage points ..."""
TOLERANCE_LOSS = 0.01
"""... or its worst-seed final loss plus 1 % (the protocol's "within seed noise")."""


# -- primitives ------------------------------------------------------------------------------


def ring_allreduce_bytes(nbytes: float, world: int) -> float:
    """Bytes one rank sends in a ring all-reduce of ``nbytes``."""
    return 2.0 * (world - 1) / world * nbytes


def bus_bandwidth(nbytes: float, seconds: float, world: int) -> float:
    """nccl-tests' bus bandwidth of an all-reduce (bytes/s)."""
    return ring_allreduce_bytes(nbytes, world) / seconds if seconds > 0 else 0.0


def ddp_bytes(steps: int, grad_bytes: int, buffer_bytes: int, world: int) -> float:
    """All ranks, one fit of DDP: a gradient all-reduce per step, plus DDP's default buffer
    broadcast from rank 0 before every forward (``broadcast_buffers=True``)."""
    per_step = world * ring_allreduce_bytes(grad_bytes, world) + (world - 1) * buffer_bytes
    return steps * per_step


def local_sgd_bytes(steps: int, warmup: int, averagings: int, grad_bytes: int, buffer_bytes: int, world: int) -> float:
    """All ranks, one fit of post-local SGD: gradient all-reduces during the warm-up, one parameter
    all-reduce per average (the parameters that have gradients), DDP's buffer broadcast per step."""
    warm = min(steps, warmup) * world * ring_allreduce_bytes(grad_bytes, world)
    averages = averagings * world * ring_allreduce_bytes(grad_bytes, world)
    return warm + averages + steps * (world - 1) * buffer_bytes


def elche_bytes(rounds: int, param_bytes: int, float_buffer_bytes: int, meta_bytes: int, world: int,
                bf16_wire: bool = False) -> float:
    """All ranks, one fit of an ElChe mode: per round a metadata all-gather and one all-reduce of
    the flat f32 parameters and floating-point buffers (the ``nccl_*`` modes on the default group,
    the ``cpu_*`` modes on host snapshots over gloo). With ``bf16_wire`` (``cpu_*`` only) the
    parameters travel as an all-gather of bf16 snapshots instead. Every round is counted as
    realized (a round in which no rank moved skips the reduce), so this is an upper bound."""
    if bf16_wire:
        params = world * (world - 1) * param_bytes / 2
    else:
        params = world * ring_allreduce_bytes(param_bytes, world)
    per_round = params + world * ring_allreduce_bytes(float_buffer_bytes, world) + world * (world - 1) * meta_bytes
    return rounds * per_round


def steady_rate(records: Sequence[dict[str, Any]]) -> float:
    """Samples/s of all ranks together from the start of epoch 1 to the end of the last epoch."""
    starts = [r["t_start"] for r in records if r.get("t_start") is not None]
    ends = [r["t_end"] for r in records if r.get("t_end") is not None]
    if not starts or not ends:
        return 0.0
    span = max(ends) - min(starts)
    return sum(r["samples"] for r in records) / span if span > 0 else 0.0


def step_seconds(record: dict[str, Any]) -> Optional[float]:
    """This rank's steady-state seconds per optimizer step."""
    if record.get("t_start") is None or record.get("t_end") is None or record["steps"] <= 0:
        return None
    return (record["t_end"] - record["t_start"]) / record["steps"]


def spread(values: Iterable[Optional[float]], missing_is_worst: bool = False) -> dict[str, Any]:
    """Median, min, max of the finite values, and every value (None kept in place).

    With ``missing_is_worst`` a None counts as +infinity in the median (a seed that never reached a
    target took "forever"), so the median is None when half the values or more are missing.
    """
    values = list(values)
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return {"median": None, "min": None, "max": None, "values": values}
    median: Optional[float]
    if missing_is_worst:
        middle = statistics.median([math.inf if v is None else v for v in values])
        median = middle if math.isfinite(middle) else None
    else:
        median = statistics.median(finite)
    return {"median": median, "min": min(finite), "max": max(finite), "values": values}


def _median(values: Iterable[Optional[float]]) -> Optional[float]:
    return spread(values)["median"]


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


# -- throughput ------------------------------------------------------------------------------


def idle_fractions(arm_kind: str, records: Sequence[dict[str, Any]], solo_rates: Sequence[float],
                   batch_size: int) -> tuple[list[Optional[float]], str]:
    """Per-rank share of time not spent computing, and how it was obtained.

    ElChe measures it: ``sync_s / (compute_s + sync_s)`` from the engine's totals (whole fit).
    DDP and post-local SGD overlap the gradient all-reduce with the backward pass, so the wait
    cannot be told apart from compute without a profiler; it is estimated as
    ``1 - (step time alone) / (step time in the 2-rank fit)``, the step time alone coming from that
    device's solo fit of the same pass (same batch size).
    """
    if arm_kind == "elche":
        totals = records[0]["elche"]["totals"]
        return [t["sync_s"] / (t["compute_s"] + t["sync_s"]) if t["compute_s"] + t["sync_s"] > 0 else None
                for t in totals], "measured: engine totals sync_s / (compute_s + sync_s)"
    out: list[Optional[float]] = []
    for rank, record in enumerate(records):
        step = step_seconds(record)
        alone = batch_size / solo_rates[rank] if rank < len(solo_rates) and solo_rates[rank] > 0 else None
        out.append(max(0.0, 1.0 - alone / step) if step and alone else None)
    return out, "estimate: 1 - solo step time / 2-rank step time"


def stall_per_sync(trace: Sequence[dict[str, Any]], totals: Sequence[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """Mean accelerator stall per sync of each rank (the engine measures it for ``cpu_async`` on
    CUDA), and as a fraction of that rank's mean step time (``compute_s / steps`` from the totals).
    None when no round carried a measurement."""
    per_rank: list[list[float]] = [[] for _ in totals]
    for point in trace:
        for rank, value in enumerate(point.get("stall_ms") or []):
            if value is not None and rank < len(per_rank):
                per_rank[rank].append(float(value))
    if not any(per_rank):
        return None
    mean_ms = [statistics.fmean(v) if v else None for v in per_rank]
    step_ms = [1000.0 * t["compute_s"] / t["steps"] if t["steps"] else None for t in totals]
    return {
        "mean_ms": mean_ms,
        "rounds_measured": [len(v) for v in per_rank],
        "fraction_of_step": [m / s if m is not None and s else None for m, s in zip(mean_ms, step_ms, strict=True)],
    }


def arm_kind(arm: str) -> str:
    if arm.startswith("solo_rank"):
        return "solo"
    if arm == DDP:
        return "ddp"
    if arm == LOCAL_SGD:
        return "local_sgd"
    return "elche"


def multi_rank_metrics(arm: str, records: Sequence[dict[str, Any]], solo_rates: Sequence[float],
                       reduce_device_s: Optional[float] = None) -> dict[str, Any]:
    """Throughput, syncs, bytes per sample, idle, batch share, memory and (ElChe) the breakdown of
    the lost efficiency of one multi-rank fit; ``solo_rates``: the solo rate of each rank's speed
    class, per rank; ``reduce_device_s``: the microbenchmark's seconds per flat-parameter all-reduce."""
    world = len(records)
    kind = arm_kind(arm)
    stats = records[0]["model"]
    steps = [r["total_steps"] for r in records]
    samples = sum(r["total_samples"] for r in records)
    out: dict[str, Any] = {"kind": kind, "samples_per_s": steady_rate(records), "epochs": records[0]["epochs"]}
    optimizer = optimizer_steps(steps[0], records[0])  # batches accumulated under a memory limit count once
    if kind == "ddp":
        syncs = optimizer
        sent = ddp_bytes(optimizer, stats["grad_bytes"], stats["buffer_bytes"], world)
    elif kind == "local_sgd":
        info = records[0]["local_sgd"]
        syncs = min(optimizer, info["warmup"]) + info["averagings"]
        sent = local_sgd_bytes(optimizer, info["warmup"], info["averagings"], stats["grad_bytes"],
                               stats["buffer_bytes"], world)
        out["local_sgd"] = info
    else:
        info = records[0]["elche"]
        syncs = info["rounds"]
        sent = elche_bytes(info["rounds"], stats["param_bytes"], stats["float_buffer_bytes"], info["meta_bytes"], world,
                           bool(info.get("bf16_wire", False)))
        out["elche"] = {k: info[k] for k in ("rounds", "cohort_step", "final_anchor", "window_plan", "totals",
                                             "meta_bytes", "bf16_wire")}
        steps = [t["steps"] for t in info["totals"]]
        stall = stall_per_sync(records[0].get("trace", []), info["totals"])
        if stall is not None:
            out["stall"] = stall
        out["round_s"] = mean_round_seconds(records, info["rounds"])
        # Only the nccl_* modes queue the parameter all-reduce on the device without the host waiting.
        device_reduce = records[0].get("device_type") == "cuda" and arm.startswith("nccl")
        out["loss_breakdown"] = split = loss_breakdown(records, solo_rates, reduce_device_s if device_reduce else None)
        out["in_arm_efficiency"] = split.get("in_arm_efficiency") if split else None
        out["in_arm_speed_share"] = split.get("in_arm_speed_share") if split else None
    idle, how = idle_fractions(kind, records, solo_rates, records[0]["batch_size"])
    steady = [r["steps"] for r in records]  # each rank's batches from epoch 1 on (the meter's count)
    out.update({
        "syncs": syncs,
        "samples_per_sync": samples / syncs if syncs else None,
        "bytes_sent": sent,
        "bytes_per_sample": sent / samples if samples else None,
        "idle": idle,
        "idle_method": how,
        "steps": steps,
        "batch_share": [s / sum(steps) if sum(steps) else None for s in steps],
        "steady_batch_share": [s / sum(steady) if sum(steady) else None for s in steady],
        "stopped_by_cap": any(r["stopped_by_cap"] for r in records),
        "model": stats,
        "memory": memory_summary(records),
    })
    if any("micro_batch" in r for r in records):  # --micro-batch: each rank's, as it ran this arm
        out["micro_batch"] = [r.get("micro_batch") for r in records]
    return out


def mean_round_seconds(records: Sequence[dict[str, Any]], rounds: int) -> Optional[float]:
    """Mean wall-clock seconds of an ElChe round: the fit's training time ÷ its rounds."""
    ends = [r["t_end"] for r in records if r.get("t_end") is not None]
    starts = [r["t_fit0"] for r in records if r.get("t_fit0") is not None]
    if not ends or not starts or rounds <= 0:
        return None
    return (max(ends) - min(starts) - max(r.get("eval_s", 0.0) for r in records)) / rounds


def share_error(batch_share: Sequence[Optional[float]], speed_share: Sequence[float]) -> Optional[float]:
    """The largest |batch share ÷ speed share − 1| over ranks (0: perfectly proportional)."""
    errors = [abs(b / s - 1.0) for b, s in zip(batch_share, speed_share, strict=True) if b is not None and s > 0]
    return max(errors) if errors and len(errors) == len(speed_share) else None


def throughput_pass(jobs: Sequence[tuple[str, str]], records: dict[str, list[dict[str, Any]]],
                    representatives: Optional[Sequence[int]] = None, reduce_device_s: Optional[float] = None
                    ) -> dict[str, Any]:
    """One pass: ``jobs`` = [(arm, job id)], the first being the solo job; ``reduce_device_s``: the
    microbenchmark's seconds per flat-parameter all-reduce of the throughput model (see
    :func:`loss_breakdown`).

    ``representatives[r]`` is the rank whose solo fit measured rank ``r``'s speed class (default:
    every rank ran its own solo, as on the 2-rank rigs). Solo arms are named by that rank.
    """
    (_, solo_id), *multi = jobs
    closing_id = multi.pop()[1] if multi and multi[-1][0] == SOLO_PAIR else None  # A-B-A: the solos again
    solo = records[solo_id]
    class_rate = {int(r.get("solo_of_rank", k)): steady_rate([r]) for k, r in enumerate(solo)}
    by_rank = {int(r.get("solo_of_rank", k)): r for k, r in enumerate(solo)}
    reps = list(representatives) if representatives is not None else sorted(class_rate)
    missing = sorted(set(reps) - set(class_rate))
    if missing:
        raise ValueError(f"solo job {solo_id} has no record of rank(s) {missing}")
    bracket: Optional[dict[str, Any]] = None
    if closing_id is not None:
        # The ideal of the pass is the mean of the solo rates before and after its arms.
        closing = {int(r.get("solo_of_rank", k)): steady_rate([r]) for k, r in enumerate(records[closing_id])}
        opening = dict(class_rate)
        class_rate = {rep: (rate + closing[rep]) / 2.0 for rep, rate in opening.items()}
        bracket = {
            "opening": [opening[rep] for rep in sorted(opening)],
            "closing": [closing[rep] for rep in sorted(opening)],
            "drift": [closing[rep] / opening[rep] - 1.0 if opening[rep] else None for rep in sorted(opening)],
            "representatives": sorted(opening),
        }
    rates = [class_rate[rep] for rep in reps]
    ideal = sum(rates)
    arms: dict[str, Any] = {}
    for rep in sorted(class_rate):
        record = by_rank[rep]
        arms[f"solo_rank{rep}"] = {"kind": "solo", "samples_per_s": class_rate[rep], "syncs": 0,
                                   "bytes_per_sample": 0.0, "idle": [0.0], "idle_method": "single process",
                                   "epochs": record["epochs"], "throttle": record.get("throttle"),
                                   "memory": memory_summary([record]),
                                   **({"micro_batch": record["micro_batch"]} if "micro_batch" in record else {})}
        if len(reps) != 2:
            arms[f"solo_rank{rep}"]["ranks"] = [r for r, x in enumerate(reps) if x == rep]
    speed_share = [rate / ideal if ideal > 0 else 0.0 for rate in rates]
    for arm, job_id in multi:
        arms[arm] = multi_rank_metrics(arm, records[job_id], rates, reduce_device_s)
        arms[arm]["share_error"] = share_error(arms[arm]["steady_batch_share"], speed_share)
        if arms[arm].get("in_arm_speed_share"):
            arms[arm]["in_arm_share_error"] = share_error(arms[arm]["steady_batch_share"],
                                                          arms[arm]["in_arm_speed_share"])
    memory_vs_ddp(arms)
    ddp_rate = arms.get(DDP, {}).get("samples_per_s")
    for row in arms.values():
        row["efficiency"] = row["samples_per_s"] / ideal if ideal > 0 else None
        row["speedup_vs_ddp"] = _ratio(row["samples_per_s"], ddp_rate)
    slowest = min(rates[1:]) if len(rates) > 1 else None
    # Rank 0's device against the slowest other: on 2 ranks, solo rank 0 ÷ solo rank 1.
    measured = rates[0] / slowest if slowest else None
    measured_each = [measured]
    if bracket is not None:
        for key in ("opening", "closing"):
            class_rates = dict(zip(sorted(class_rate), bracket[key], strict=True))
            others = [class_rates[rep] for rep in reps[1:]]
            bracket[f"measured_slowdown_{key}"] = class_rates[reps[0]] / min(others) if others and min(others) else None
        measured_each = [bracket["measured_slowdown_opening"], bracket["measured_slowdown_closing"]]
    finite = [m for m in measured_each if m is not None]
    return {
        "solo_bracket": bracket,
        "ideal_samples_per_s": ideal,
        "measured_slowdown": measured,
        # What the throttle gave in this pass: [min, max] over its solo fits (A-B-A: before and after the arms).
        "measured_slowdown_range": [min(finite), max(finite)] if finite else None,
        "speed_share": speed_share,
        "arms": arms,
    }


_AGGREGATED = ("samples_per_s", "efficiency", "in_arm_efficiency", "speedup_vs_ddp", "syncs", "samples_per_sync",
               "bytes_per_sample", "share_error", "in_arm_share_error")


SPREAD_WARNING = 0.05
"""An arm whose efficiency varies more than this (max - min over the median) between passes is
flagged in the report: the machine's speed changed more than the rig can measure through."""

DRIFT_WARNING = 0.05
"""A solo fit whose rate moves more than this between passes (max - min over the median), or
between the opening and closing solos of one A-B-A pass, is flagged: the ideal it sets moved."""


def relative_spread(values: Sequence[Optional[float]]) -> Optional[float]:
    """``(max - min) / median`` of the finite values (None with fewer than two)."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if len(finite) < 2 or statistics.median(finite) <= 0:
        return None
    return (max(finite) - min(finite)) / statistics.median(finite)


def efficiency_spread(values: Sequence[Optional[float]]) -> Optional[float]:
    """``(max - min) / median`` of an arm's per-pass efficiencies (None with fewer than two)."""
    return relative_spread(values)


def _range(values: Sequence[Optional[float]]) -> Optional[list[float]]:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return [min(finite), max(finite)] if finite else None


def noise_warnings(section: dict[str, Any]) -> list[dict[str, Any]]:
    """What in an aggregated section says the machine was not steady enough to read it closely:
    an arm's efficiency spread above :data:`SPREAD_WARNING` between passes, a solo's rate drift
    above :data:`DRIFT_WARNING` between passes or within one A-B-A pass. Each warning has its
    ``kind``, ``arm``, ``value`` (a fraction), ``pass`` (1-based; None between passes) and ``message``."""
    out: list[dict[str, Any]] = []
    for arm, row in section["arms"].items():
        spread = row.get("efficiency_spread")
        if row.get("kind") != "solo" and spread is not None and spread > SPREAD_WARNING:
            out.append({"kind": "efficiency_spread", "arm": arm, "value": spread, "pass": None,
                        "message": f"the efficiency of `{arm}` varies by {100 * spread:.1f} % between passes "
                                   f"(> {100 * SPREAD_WARNING:.0f} %): do not read differences below that spread"})
        drift = row.get("rate_drift")
        if row.get("kind") == "solo" and drift is not None and drift > DRIFT_WARNING:
            out.append({"kind": "solo_drift", "arm": arm, "value": drift, "pass": None,
                        "message": f"the solo rate of `{arm}` drifts by {100 * drift:.1f} % between passes "
                                   f"(> {100 * DRIFT_WARNING:.0f} %): the machine's speed changed between passes"})
    for number, bracket in enumerate(section.get("solo_brackets") or [], start=1):
        if not bracket:
            continue
        for rep, change in zip(bracket.get("representatives", range(len(bracket["drift"]))), bracket["drift"],
                               strict=True):
            if change is not None and abs(change) > DRIFT_WARNING:
                arm = f"solo_rank{rep}"
                out.append({"kind": "solo_drift_in_pass", "arm": arm, "value": change, "pass": number,
                            "message": f"the solo rate of `{arm}` moved by {100 * change:+.1f} % across the arms "
                                       f"of pass {number} (> {100 * DRIFT_WARNING:.0f} %): the machine's speed "
                                       "changed within the pass"})
    return out


def aggregate_passes(passes: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Median over passes of every headline number; the last pass's details (idle, shares, ...).

    With several passes each arm also gets the [min, max] of its samples/s and efficiency over
    the passes and its ``efficiency_spread`` (a solo its ``rate_drift``); the section lists the
    measured slowdown of every pass and its [min, max] range, the ``spread_warnings`` (arms above
    :data:`SPREAD_WARNING`) and every :func:`noise_warnings`."""
    if not passes:
        return {}
    last = passes[-1]
    out: dict[str, Any] = {
        "passes": len(passes),
        "measured_slowdown_per_pass": [p["measured_slowdown"] for p in passes],
        "measured_slowdown_range_per_pass": [p.get("measured_slowdown_range") for p in passes],
        "solo_brackets": [p.get("solo_bracket") for p in passes],
        "ideal_samples_per_s": _median(p["ideal_samples_per_s"] for p in passes),
        "measured_slowdown": _median(p["measured_slowdown"] for p in passes),
        "speed_share": [_median(p["speed_share"][r] for p in passes) for r in range(len(last["speed_share"]))],
        "arms": {},
    }
    for arm in passes[0]["arms"]:  # the first pass runs the arms in their base order
        merged = dict(last["arms"][arm])
        for key in _AGGREGATED:
            values = [p["arms"][arm].get(key) for p in passes if arm in p["arms"]]
            merged[key] = _median(values)
            if len(passes) > 1:
                merged[f"{key}_per_pass"] = values
                if key in ("samples_per_s", "efficiency", "in_arm_efficiency"):
                    merged[f"{key}_range"] = _range(values)
        idle = [p["arms"][arm]["idle"] for p in passes if arm in p["arms"]]
        merged["idle"] = [_median(v[k] for v in idle) for k in range(len(idle[0]))]
        merged["efficiency_spread"] = efficiency_spread([p["arms"][arm].get("efficiency") for p in passes
                                                         if arm in p["arms"]])
        if merged.get("kind") == "elche":
            merged["in_arm_efficiency_spread"] = efficiency_spread([p["arms"][arm].get("in_arm_efficiency")
                                                                    for p in passes if arm in p["arms"]])
        if merged.get("kind") == "solo":
            merged["rate_drift"] = relative_spread([p["arms"][arm]["samples_per_s"] for p in passes
                                                    if arm in p["arms"]])
        out["arms"][arm] = merged
    out["spread_warnings"] = [arm for arm, row in out["arms"].items() if row.get("kind") != "solo"
                              and (row["efficiency_spread"] or 0.0) > SPREAD_WARNING]
    out["noise_warnings"] = noise_warnings(out)
    return out


# -- convergence -----------------------------------------------------------------------------


def reaches(value: float, target: float, higher_is_better: bool) -> bool:
    return value >= target if higher_is_better else value <= target


def time_to_target(curve: Sequence[dict[str, Any]], quality: str, target: float, higher_is_better: bool
                   ) -> Optional[float]:
    """Train-clock seconds of the first held-out score that meets the target (None: never)."""
    for point in curve:
        if reaches(point[quality], target, higher_is_better):
            return float(point["train_s"])
    return None


def default_target(ddp_finals: Sequence[float], higher_is_better: bool) -> Optional[float]:
    """The final quality every Lightning DDP seed reached (its worst seed), relaxed by the
    protocol's seed-noise tolerance: DDP reaches it in every seed by construction, so the time to
    target compares how much sooner other arms get there."""
    finals = [v for v in ddp_finals if v is not None and math.isfinite(v)]
    if not finals:
        return None
    return min(finals) - TOLERANCE_ACC if higher_is_better else max(finals) * (1.0 + TOLERANCE_LOSS)


def convergence(runs: dict[str, list[dict[str, Any]]], quality: str, higher_is_better: bool,
                target: Optional[float]) -> dict[str, Any]:
    """``runs``: arm -> rank-0 records (one per seed). Final quality and time to target per arm."""
    finals = {arm: [r["curve"][-1][quality] for r in recs if r["curve"]] for arm, recs in runs.items()}
    source = "--target"
    if target is None:
        target = default_target(finals.get(DDP, []), higher_is_better)
        tolerance = f"{TOLERANCE_ACC * 100:g} pp" if higher_is_better else f"{TOLERANCE_LOSS:.0%}"
        source = f"Lightning DDP's worst-seed final {quality}, relaxed by {tolerance}"
    arms: dict[str, Any] = {}
    for arm, recs in runs.items():
        times = [time_to_target(r["curve"], quality, target, higher_is_better) if target is not None else None
                 for r in recs]
        reached = [t for t in times if t is not None]
        tt = spread(times, missing_is_worst=True)
        arms[arm] = {
            "seeds": len(recs),
            "final_quality": spread(finals[arm]),
            "time_to_target_s": tt,
            "reached_target": len(reached),
            "train_s": spread(r["epoch_ends_train_s"][-1] if r["epoch_ends_train_s"] else None for r in recs),
            "epochs": [r["epochs"] for r in recs],
            "capped_fits": sum(1 for r in recs if r["stopped_by_cap"]),
        }
    ddp = arms.get(DDP)
    for row in arms.values():
        row["time_to_target_speedup_vs_ddp"] = _ratio(ddp["time_to_target_s"]["median"] if ddp else None,
                                                      row["time_to_target_s"]["median"])
        final, ddp_final = row["final_quality"]["median"], ddp["final_quality"]["median"] if ddp else None
        row["final_quality_minus_ddp"] = final - ddp_final if final is not None and ddp_final is not None else None
    return {"quality": quality, "higher_is_better": higher_is_better, "target": target, "target_source": source,
            "arms": arms}


# -- microbenchmark --------------------------------------------------------------------------


def microbenchmark(per_rank: Sequence[dict[str, Any]], world: int) -> dict[str, Any]:
    """Bus bandwidth of a raw all-reduce, of ElChe's flat-parameter all-reduce and of its whole
    averaging path, from the slowest rank's timings (also of the metadata exchange and the pool claim)."""
    out: dict[str, Any] = {}
    for section, first in per_rank[0].items():
        raw = max(r[section]["raw_all_reduce_s"] for r in per_rank)
        plane = max(r[section]["plane_average_s"] for r in per_rank)
        flat = max(r[section]["flat_all_reduce_s"] for r in per_rank)
        meta = max(r[section]["metadata_exchange_s"] for r in per_rank)
        raw_bw, plane_bw = bus_bandwidth(first["bytes"], raw, world), bus_bandwidth(first["bytes"], plane, world)
        flat_bw = bus_bandwidth(first["bytes"], flat, world)
        out[section] = {
            "model": first["model"],
            "bytes": first["bytes"],
            "iters": first["iters"],
            "raw_all_reduce_s": raw,
            "plane_average_s": plane,
            "flat_all_reduce_s": flat,
            "metadata_exchange_s": meta,
            "raw_busbw_gb_s": raw_bw / 1e9,
            "plane_busbw_gb_s": plane_bw / 1e9,
            "plane_vs_raw": plane_bw / raw_bw if raw_bw > 0 else None,
            "flat_busbw_gb_s": flat_bw / 1e9,
            "flat_vs_raw": flat_bw / raw_bw if raw_bw > 0 else None,
        }
        if "pool_claim_s" in first:  # runs before the pooled dispatch's timing existed lack it
            out[section]["pool_claim_s"] = max(r[section]["pool_claim_s"] for r in per_rank)
    return out


# -- memory ----------------------------------------------------------------------------------

MEMORY_NOT_MEASURED = "n/a (CPU)"


def _every(records: Sequence[dict[str, Any]], key: str) -> Optional[list[float]]:
    """``record[key]`` of every record, or None when a record lacks it."""
    values = [r.get(key) for r in records]
    return None if any(v is None for v in values) else [float(v) for v in values if v is not None]


def memory_summary(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per rank: peak accelerator bytes allocated and reserved during the fit, the allocated bytes
    when it started, and the pinned host bytes held by the averaging plane. ``measured`` is False
    on CPU devices, where nothing is measured."""
    memory = [r["memory"] for r in records if r.get("memory") is not None]
    if not memory or len(memory) != len(records):
        return {"measured": False, "reason": MEMORY_NOT_MEASURED}
    return {
        "measured": True,
        "peak_allocated": [m["peak_allocated"] for m in memory],
        "peak_reserved": [m["peak_reserved"] for m in memory],
        "baseline_allocated": [m["baseline_allocated"] for m in memory],
        "pinned_held": [m.get("pinned_held") for m in memory],
        "param_bytes_f32": 4 * int(records[0]["model"]["param_numel"]),
    }


def memory_vs_ddp(arms: dict[str, dict[str, Any]]) -> None:
    """Add to each measured multi-rank arm's memory the difference of its peak to DDP's, per rank,
    in f32 parameter copies: ``(peak - ddp_peak) / (4 * parameters)``."""
    ddp = arms.get(DDP, {}).get("memory", {})
    for row in arms.values():
        memory = row.get("memory")
        if not memory or not memory.get("measured") or not ddp.get("measured") or row.get("kind") == "solo":
            continue
        copies = memory["param_bytes_f32"]
        memory["vs_ddp_param_copies"] = [(peak - base) / copies if copies else None
                                         for peak, base in zip(memory["peak_allocated"], ddp["peak_allocated"],
                                                               strict=True)]


# -- where the lost percent goes ---------------------------------------------------------------

BREAKDOWN_PARTS = ("first_window", "plan_lag", "epoch_end_drain", "sync", "rest")


def _round_syncs(rounds: Sequence[dict[str, Any]], final_sync: Sequence[float]) -> list[list[float]]:
    """Per round j, per rank: the sync time right after the rank's window j (the engine reports it
    in round j+1's metadata; the last round's comes from each rank's engine at the end of fit)."""
    return [list(rounds[j + 1]["last_sync_s"]) if j + 1 < len(rounds) else list(final_sync)
            for j in range(len(rounds))]


def loss_breakdown(records: Sequence[dict[str, Any]], solo_rates: Sequence[float],
                   reduce_device_s: Optional[float] = None) -> Optional[dict[str, Any]]:
    """Where an ElChe arm's ``1 - efficiency`` goes, from every round's metadata (rank 0's round
    listener) and each rank's steady-state span; None when the fit recorded no rounds.

    Over the steady span T (epoch 1 to the end, as for the efficiency), rank r trained n_r samples
    at solo rate s_r, so it lost ``L_r = T - n_r / s_r`` seconds of its solo capacity, and
    ``1 - efficiency = sum_r s_r L_r / (T sum_r s_r)`` exactly. Each L_r is split, per round j
    of epochs >= 1 (sync_rj = rank r's sync time after its window j):

    * sync: ``min_k sync_kj``, the round's cost to the rank that arrived last (it waited for nobody);
    * the rest of sync_rj is waiting for a peer, charged to
      (a) first window when round j closed a window planned before the controller's first
      calibration, else (c) epoch-end drain when some rank was out of data in round j, else
      (b) plan lag (the plan gave the ranks windows of unequal duration);
    * rest = L_r - (a + b + c + sync): computing slower than alone (``compute_vs_solo``: the
      engine's window compute time minus n_r / s_r) plus time in neither a window nor a round
      (``outside_rounds``: epoch turnovers, the ranks' different epoch-1 starts).

    ``reduce_device_s`` (CUDA ``nccl_*`` modes): the microbenchmark's seconds per flat-parameter
    all-reduce (``CollectivePlane.sum_scaled``, synchronized). There the all-reduce is queued
    without the host waiting, so its device time lands in the next window's compute; it is moved
    from rest to sync for every realized round (``sync_device``); the host-visible part of the
    round stays ``sync_host``. The round's other small kernels (pack, norms, unpack) stay in rest.
    """
    rounds = sorted(records[0].get("rounds") or [], key=lambda p: p["index"])
    final_sync = _every(records, "final_sync_s")
    starts = _every(records, "t_start")
    ends = _every(records, "t_end")
    world = len(records)
    if (not rounds or final_sync is None or starts is None or ends is None or len(solo_rates) != world
            or any(len(p["steps"]) != world for p in rounds)
            or [p["index"] for p in rounds] != list(range(rounds[0]["index"], rounds[0]["index"] + len(rounds)))):
        return None
    span = max(ends) - min(starts)
    capacity = span * sum(solo_rates)
    if span <= 0 or capacity <= 0 or any(s <= 0 for s in solo_rates):
        return None
    syncs = _round_syncs(rounds, final_sync)
    zero = [0.0] * world
    parts = {name: list(zero) for name in ("first_window", "plan_lag", "epoch_end_drain", "sync")}
    compute, synced, epoch0_first_window = list(zero), list(zero), list(zero)
    realized_rounds = 0
    for j, point in enumerate(rounds):
        cost = min(syncs[j])
        uncalibrated = rounds[0]["index"] == 1 and (j == 0 or rounds[j - 1]["calibrations"] == 0)
        steady = min(point["epoch"]) >= 1
        if not steady:
            if uncalibrated:
                for r in range(world):
                    epoch0_first_window[r] += syncs[j][r] - cost
            continue
        realized_rounds += sum(point["steps"]) > 0
        kind = "first_window" if uncalibrated else "epoch_end_drain" if any(point["out_of_data"]) else "plan_lag"
        for r in range(world):
            parts["sync"][r] += cost
            parts[kind][r] += syncs[j][r] - cost
            compute[r] += point["compute_s"][r]
            synced[r] += syncs[j][r]
    productive = [records[r]["samples"] / solo_rates[r] for r in range(world)]
    lost = [span - p for p in productive]
    sync_host = list(parts["sync"])
    sync_device = [realized_rounds * reduce_device_s if reduce_device_s else 0.0] * world
    parts["sync"] = [h + d for h, d in zip(sync_host, sync_device, strict=True)]
    parts["rest"] = [lost[r] - sum(parts[k][r] for k in BREAKDOWN_PARTS[:4]) for r in range(world)]
    compute_vs_solo = [compute[r] - productive[r] - sync_device[r] for r in range(world)]
    outside = [span - compute[r] - synced[r] for r in range(world)]

    def share(seconds: Sequence[float]) -> float:
        return sum(rate * s for rate, s in zip(solo_rates, seconds, strict=True)) / capacity

    trained = sum(r["samples"] for r in records)
    # The same span against the speeds the ranks computed at inside this arm (their window compute,
    # throttle included): no solo fit in it, so a machine that speeds up or slows down between the
    # solos and the arm moves it far less; it leaves out (e), which only the solos can measure.
    in_arm_rates = [records[r]["samples"] / compute[r] for r in range(world)] if min(compute) > 0 else []
    in_arm_capacity = span * sum(in_arm_rates)
    return {
        "span_s": span,
        "efficiency": trained / capacity,
        "in_arm_efficiency": trained / in_arm_capacity if in_arm_capacity > 0 else None,
        # Each rank's share of the summed in-arm speeds: the batch share a dispatch that kept every
        # rank computing for the same time gives it, whatever the solos read.
        "in_arm_speed_share": [rate / sum(in_arm_rates) for rate in in_arm_rates] if in_arm_capacity > 0 else None,
        "one_minus_efficiency": 1.0 - trained / capacity,
        "fractions": {name: share(parts[name]) for name in BREAKDOWN_PARTS},
        "rest_detail": {"compute_vs_solo": share(compute_vs_solo), "outside_rounds": share(outside)},
        "seconds": {**parts, "lost": lost, "productive": productive, "compute": compute, "sync_host": sync_host,
                    "sync_device": sync_device, "compute_vs_solo": compute_vs_solo, "outside_rounds": outside},
        "rounds_in_span": sum(1 for p in rounds if min(p["epoch"]) >= 1),
        "realized_rounds_in_span": realized_rounds,
        "reduce_device_s": reduce_device_s,
        "epoch0_first_window_wait_s": epoch0_first_window,
    }
