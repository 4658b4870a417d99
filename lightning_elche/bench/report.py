"""The outputs: a Markdown table, the JSON file with every number, and PNG plots.

matplotlib is imported only when plots are drawn; without it the plots are skipped and the JSON
says why.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

from lightning_elche.bench.arms import ARM_DESCRIPTIONS


def _num(value: Optional[float], digits: int = 2, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return f"{value:.{digits}f}{suffix}"


def _rate(value: Optional[float]) -> str:
    if value is None:
        return "n/a"
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def _bytes(value: Optional[float]) -> str:
    if value is None:
        return "n/a"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value:.0f} B"


def _count(value: Optional[float]) -> str:
    if value is None:
        return "n/a"
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.1f}"


def _pair(values: Optional[list[Optional[float]]], fmt: str = "pct") -> str:
    if not values:
        return "n/a"
    if fmt == "pct":
        return " / ".join("n/a" if v is None else f"{v:.0%}" for v in values)
    return " / ".join(_num(v) for v in values)


def throughput_table(section: dict[str, Any], world: int = 2) -> list[str]:
    ranks = "r0 / r1" if world == 2 else " / ".join(f"r{r}" for r in range(world))
    lines = [
        f"| arm | samples/s | efficiency | vs DDP | syncs | bytes sent / sample | idle {ranks} | batch share {ranks} |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for arm, row in section["arms"].items():
        idle = _pair(row.get("idle")) + (" (est.)" if row.get("idle_method", "").startswith("estimate") else "")
        share = _pair(row.get("batch_share")) if row.get("kind") != "solo" else "-"
        rate, efficiency = _rate(row["samples_per_s"]), _num(row.get("efficiency"))
        if row.get("samples_per_s_range"):  # several passes: the median and [min, max] over them
            low, high = row["samples_per_s_range"]
            rate += f" [{_rate(low)}, {_rate(high)}]"
        if row.get("efficiency_range"):
            low, high = row["efficiency_range"]
            efficiency += f" [{_num(low)}, {_num(high)}]"
        lines.append(
            f"| `{arm}` | {rate} | {efficiency} | "
            f"{_num(row.get('speedup_vs_ddp'), suffix='x')} | {_count(row.get('syncs'))} | "
            f"{_bytes(row.get('bytes_per_sample'))} | {idle} | {share} |"
        )
    ideal = "solo rank 0 + solo rank 1" if world == 2 else f"sum of the {world} ranks' solo rates"
    lines.append(f"| ideal ({ideal}) | {_rate(section['ideal_samples_per_s'])} | 1.00 | | | | | |")
    for arm, row in section["arms"].items():
        stall = row.get("stall")
        if stall:
            per_rank = ", ".join(
                f"rank {k} {_num(ms, 3, ' ms')} ({_num(None if f is None else 100 * f, 2, ' %')} of a step)"
                for k, (ms, f) in enumerate(zip(stall["mean_ms"], stall["fraction_of_step"], strict=True)))
            lines += ["", f"Accelerator stall per sync, `{arm}`: {per_rank}."]
    if world != 2:
        lines += ["", *balance_lines(section)]
    return lines


def _mb(values: Optional[list[Optional[float]]]) -> str:
    if not values:
        return "n/a"
    return " / ".join("n/a" if v is None else f"{v / 1e6:,.0f}" for v in values)


def memory_table(section: dict[str, Any], world: int = 2) -> list[str]:
    """Peak accelerator memory of every arm beside DDP's (and the pinned host memory of the
    ``cpu_*`` modes); empty for results recorded before memory was measured."""
    rows = {arm: row["memory"] for arm, row in section["arms"].items() if "memory" in row}
    if not rows:
        return []
    ranks = "r0 / r1" if world == 2 else " / ".join(f"r{r}" for r in range(world))
    lines = [
        f"| arm | peak allocated MB {ranks} | vs DDP, f32 parameter copies {ranks} | peak reserved MB {ranks} | "
        f"pinned host MB held by the plane {ranks} |",
        "|---|---:|---:|---:|---:|",
    ]
    for arm, memory in rows.items():
        if not memory.get("measured"):
            why = memory.get("reason", "n/a")
            lines.append(f"| `{arm}` | {why} | {why} | {why} | {why} |")
            continue
        copies = memory.get("vs_ddp_param_copies")
        vs_ddp = " / ".join("n/a" if c is None else f"{c:+.2f}" for c in copies) if copies else "-"
        pinned = memory.get("pinned_held")
        held = _mb(pinned) if pinned and any(v for v in pinned) else "-"
        lines.append(f"| `{arm}` | {_mb(memory['peak_allocated'])} | {vs_ddp} | {_mb(memory['peak_reserved'])} | "
                     f"{held} |")
    return lines


def _pp(value: Optional[float]) -> str:
    """A fraction as percent with one decimal ("-0.0", a rounding artefact, shown as 0.0)."""
    if value is None:
        return "n/a"
    text = f"{100 * value:.1f}"
    return "0.0" if text == "-0.0" else text


def breakdown_table(section: dict[str, Any]) -> list[str]:
    """Each ElChe arm's ``1 - efficiency`` split into first window, plan lag, epoch-end drain, sync
    and rest (percent of the ideal); empty for results recorded before the split existed."""
    rows = {arm: row for arm, row in section["arms"].items() if row.get("kind") == "elche" and "loss_breakdown" in row}
    if not rows:
        return []
    speed = section.get("speed_share") or []
    lines = [
        "| arm | efficiency | 1 - eff. | (a) first window | (b) plan lag | (c) epoch-end drain | (d) sync | "
        "(e) rest: compute vs solo + outside rounds | steady batch share r0 (speed share) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for arm, row in rows.items():
        split = row["loss_breakdown"]
        share = row.get("steady_batch_share") or [None]
        share_cell = f"{_pp(share[0])} % ({_pp(speed[0]) if speed else 'n/a'} %)"
        if split is None:
            missing = " n/a |" * 6
            lines.append(f"| `{arm}` | {_num(row.get('efficiency'))} |{missing} {share_cell} |")
            continue
        parts, rest = split["fractions"], split["rest_detail"]
        lines.append(
            f"| `{arm}` | {_num(split['efficiency'])} | {_pp(split['one_minus_efficiency'])} | "
            f"{_pp(parts['first_window'])} | {_pp(parts['plan_lag'])} | {_pp(parts['epoch_end_drain'])} | "
            f"{_pp(parts['sync'])} | {_pp(parts['rest'])}: {_pp(rest['compute_vs_solo'])} + "
            f"{_pp(rest['outside_rounds'])} | {share_cell} |"
        )
    return lines


def in_arm_table(section: dict[str, Any]) -> list[str]:
    """Each ElChe arm's efficiency and in-arm efficiency side by side, with their spreads over the
    passes (empty for results recorded before the in-arm efficiency existed)."""
    rows = {arm: row for arm, row in section["arms"].items() if row.get("kind") == "elche"
            and row.get("in_arm_efficiency") is not None}
    if not rows:
        return []

    def cell(row: dict[str, Any], key: str) -> str:
        text, bounds = _num(row.get(key)), row.get(f"{key}_range")
        return text + (f" [{_num(bounds[0])}, {_num(bounds[1])}]" if bounds else "")

    def spread(value: Optional[float]) -> str:
        return _num(None if value is None else 100 * value, 1, " %")

    lines = ["| arm | efficiency | spread | in-arm efficiency | spread |", "|---|---:|---:|---:|---:|"]
    for arm, row in rows.items():
        lines.append(f"| `{arm}` | {cell(row, 'efficiency')} | {spread(row.get('efficiency_spread'))} | "
                     f"{cell(row, 'in_arm_efficiency')} | {spread(row.get('in_arm_efficiency_spread'))} |")
    return lines


def _sizes(values: list[Optional[Any]]) -> str:
    return " / ".join("-" if v is None else str(v) for v in values)


def limits_lines(section: dict[str, Any], world: int) -> list[str]:
    """``--memory-fraction`` / ``--micro-batch``: each arm's micro-batch per rank, the batches it
    accumulated per optimizer step, its batch share and its efficiency (nothing without limits)."""
    limits = section.get("limits")
    if not limits:
        return []
    ranks = "r0 / r1" if world == 2 else " / ".join(f"r{r}" for r in range(world))
    fractions = limits.get("memory_fraction") or []
    limited = [f"rank {r} may allocate {f:.3g} of its GPU's memory" for r, f in enumerate(fractions) if f is not None]
    searched = [f"r{r} {found['chosen']}" + (f" ({found['usable_bytes'] / 2**30:.2f} GiB usable)"
                                             if found.get("usable_bytes") else "")
                for r, found in enumerate(limits.get("searched") or []) if found is not None]
    intro = [
        f"Memory-limited ranks: {'; '.join(limited) or 'no memory limit'}; --micro-batch per rank "
        f"{_sizes(limits.get('micro_batch') or [])} (- = the whole batch of {limits.get('batch')})"
        + (f"; micro_batch='auto' searched before the fits: {', '.join(searched)}" if searched else "") + ".",
        "Each solo fit trains its rank at that rank's micro-batch, accumulated to the whole batch per optimizer step "
        "(the ideal); DDP and post-local SGD cannot give ranks different batches, so every rank runs the smallest "
        "micro-batch, accumulated to the same samples per step (the job sized for the smallest card); the ElChe "
        "arms train the whole batch, each rank in the micro-batches its fit chose (reported by its rounds).",
    ]
    lines = [f"| arm | micro-batch {ranks} | micro-batches per optimizer step {ranks} | batch share {ranks} | "
             "efficiency |",
             "|---|---:|---:|---:|---:|"]
    for arm, row in section["arms"].items():
        micro = row.get("micro_batch")
        if row.get("kind") == "solo":
            own = row.get("ranks") or [int(arm.removeprefix("solo_rank"))]
            per_rank = [micro if r in own and isinstance(micro, dict) else None for r in range(world)]
            share = "-"
        else:
            per_rank = list(micro) if isinstance(micro, list) else [None] * world
            share = _pair(row.get("batch_share"))
        sizes = _sizes([m.get("size") if m else None for m in per_rank])
        steps = _sizes([m.get("per_step") if m else None for m in per_rank])
        lines.append(f"| `{arm}` | {sizes} | {steps} | {share} | {_num(row.get('efficiency'))} |")
    lines.append(f"| speed share (the balanced batch share) | | | {_pair(section.get('speed_share'))} | |")
    return ["", *intro, "", *lines]


def section_extras(section: dict[str, Any], world: int) -> list[str]:
    """The memory-limit, memory and loss-breakdown tables of a throughput section (nothing for older results)."""
    out: list[str] = [*limits_lines(section, world)]
    memory = memory_table(section, world)
    if memory:
        out += ["", "Memory of each fit (last pass; peaks per rank from `torch.cuda.max_memory_*`, reset before "
                "the fit; the difference to DDP in f32 parameter copies):", "", *memory]
    in_arm = in_arm_table(section)
    if in_arm:
        out += ["", "Each ElChe arm's efficiency against the speeds its ranks computed at inside the arm (no solo fit "
                "in it: a machine whose speed moves between the solos and the arms moves it far less; it leaves out "
                "(e) below, computing slower than alone; median over passes [min, max]):", "", *in_arm]
    split = breakdown_table(section)
    if split:
        out += ["", "Where each ElChe arm's lost efficiency goes (last pass; percent of the ideal, the parts sum to "
                "1 - eff.; formulas in docs/benchmarks.md):", "", *split]
    return out


def _rank_list(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def balance_lines(section: dict[str, Any]) -> list[str]:
    """N-rank rigs: each solo fit's rate with the ranks it measures, the speed shares, and how far
    each arm's batch shares from epoch 1 on are from them."""
    solos = [f"`{arm}` {_rate(row['samples_per_s'])}/s ({_rank_list(row.get('ranks', []))})"
             for arm, row in section["arms"].items() if row.get("kind") == "solo"]
    errors = [f"`{arm}` {_num(None if row.get('share_error') is None else 100 * row['share_error'], 0, ' %')}"
              for arm, row in section["arms"].items() if row.get("kind") != "solo"]
    in_arm = [f"`{arm}` {_num(100 * row['in_arm_share_error'], 0, ' %')}"
              for arm, row in section["arms"].items() if row.get("in_arm_share_error") is not None]
    rounds = [f"`{arm}` {_num(None if row.get('round_s') is None else 1000 * row['round_s'], 1, ' ms')}"
              for arm, row in section["arms"].items() if row.get("kind") == "elche"]
    lines = [f"Solo rates (the ranks each measures): {'; '.join(solos)}.",
             f"Speed share per rank (the balanced batch share): {_pair(section.get('speed_share'))}.",
             f"Largest deviation of a rank's batch share (epoch 1 on) from its speed share: {', '.join(errors)}."]
    if in_arm:
        lines.append("The same against the speeds the ranks computed at inside the arm (steady samples over "
                     f"window compute seconds; the dispatch's own balance): {', '.join(in_arm)}.")
    if rounds:
        lines.append(f"Mean round of the ElChe arms: {', '.join(rounds)}.")
    return lines


def slowdown_line(section: dict[str, Any], world: int) -> str:
    if world == 2:
        return f"Measured solo slowdown of rank 1: {_num(section['measured_slowdown'])}x."
    slowdown = _num(section['measured_slowdown'])
    return f"Measured solo slowdown of the slowest other solo fit against rank 0: {slowdown}x."


def noise_lines(section: dict[str, Any]) -> list[str]:
    """How steady the machine was: each pass's measured slowdown (and, A-B-A, the solo rates'
    drift across the arms), each arm's efficiency per pass and its spread, the solo rates per pass,
    and the warnings (an arm's spread or a solo's drift above 5 %; older results: what they hold)."""
    passes = int(section.get("passes", 1))
    brackets = [b for b in section.get("solo_brackets", []) if b]
    lines: list[str] = []
    if brackets:
        drift = ", ".join("[" + ", ".join(_num(None if d is None else 100 * d, 1, " %") for d in b["drift"]) + "]"
                          for b in brackets)
        slow = ", ".join(f"{_num(b.get('measured_slowdown_opening'))}x / {_num(b.get('measured_slowdown_closing'))}x"
                         for b in brackets)
        lines.append(f"Solo fits before and after the arms of each pass (A-B-A; the ideal is their mean): measured "
                     f"slowdown before / after {slow}; solo rate drift per solo fit {drift}.")
    if passes > 1:
        ranges = section.get("measured_slowdown_range_per_pass") or [None] * passes
        per_pass = ", ".join(
            f"{_num(p)}x" + (f" [{_num(r[0])}x, {_num(r[1])}x]" if r and brackets else "")
            for p, r in zip(section.get("measured_slowdown_per_pass", []), ranges, strict=False))
        lines.append(f"Measured slowdown per pass{' [min, max] of its solo fits' if brackets else ''}: {per_pass}.")
        cells, solos = [], []
        for arm, row in section["arms"].items():
            if row.get("kind") == "solo":
                if "samples_per_s_per_pass" in row:
                    rates = ", ".join(_rate(v) for v in row["samples_per_s_per_pass"])
                    drift = row.get("rate_drift")
                    solos.append(f"`{arm}` {rates} (drift {_num(None if drift is None else 100 * drift, 1, ' %')})")
                continue
            if "efficiency_per_pass" not in row:
                continue
            spread = row.get("efficiency_spread")
            values = ", ".join(_num(v) for v in row["efficiency_per_pass"])
            cells.append(f"`{arm}` {values} (spread {_num(None if spread is None else 100 * spread, 1, ' %')})")
        lines.append(f"Efficiency per pass (median in the table; spread = (max - min) / median): {'; '.join(cells)}.")
        if solos:
            lines.append(f"Solo samples/s per pass (drift = (max - min) / median): {'; '.join(solos)}.")
    if "noise_warnings" in section:
        lines += _grouped_warnings(section["noise_warnings"])
    else:  # results recorded before the solo drift was checked
        warned = section.get("spread_warnings") or []
        if warned:
            lines.append(f"**Warning**: the efficiency of {', '.join(f'`{a}`' for a in warned)} varies by more than "
                         "5 % between passes: the machine's load changed more than the passes measure through; do "
                         "not read their differences below that spread.")
    return ["", *lines] if lines else []


_WARNING_TEXT = {
    "efficiency_spread": ("the efficiency varies by more than 5 % between passes", "do not read differences "
                          "below that spread"),
    "solo_drift": ("the solo rate drifts by more than 5 % between passes", "the machine's speed changed between "
                   "passes, and every efficiency of a pass with it"),
    "solo_drift_in_pass": ("a solo rate moved by more than 5 % across the arms of a pass", "the machine's speed "
                           "changed within the pass (its ideal is the mean of the two)"),
}


def _grouped_warnings(warnings: list[dict[str, Any]]) -> list[str]:
    """One report line per kind of noise warning (the JSON and stderr keep one per arm)."""
    lines = []
    for kind, (what, meaning) in _WARNING_TEXT.items():
        found = [w for w in warnings if w["kind"] == kind]
        if not found:
            continue
        cells = ", ".join(f"`{w['arm']}` {100 * w['value']:{'+' if w['pass'] else ''}.1f} %"
                          + (f" (pass {w['pass']})" if w["pass"] else "") for w in found)
        lines.append(f"**Warning**: {what}: {cells}; {meaning}.")
    return lines


def convergence_table(conv: dict[str, Any]) -> list[str]:
    quality = conv["quality"].replace("_", " ")
    digits = 4 if conv["higher_is_better"] else 3
    lines = [
        f"| arm | final {quality}: median [min, max] | vs DDP | time to target (s): median [min, max] | "
        "reached | speed-up vs DDP | train s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for arm, row in conv["arms"].items():
        fq, tt = row["final_quality"], row["time_to_target_s"]
        lines.append(
            f"| `{arm}` | {_num(fq['median'], digits)} [{_num(fq['min'], digits)}, {_num(fq['max'], digits)}] | "
            f"{_num(row['final_quality_minus_ddp'], digits, '')} | "
            f"{_num(tt['median'], 1)} [{_num(tt['min'], 1)}, {_num(tt['max'], 1)}] | "
            f"{row['reached_target']}/{row['seeds']} | {_num(row['time_to_target_speedup_vs_ddp'], 2, 'x')} | "
            f"{_num(row['train_s']['median'], 1)} |"
        )
    return lines


def micro_table(micro: dict[str, Any]) -> list[str]:
    # The pool-claim column exists from the runs that measured it on (older JSON replots unchanged).
    claims = all("pool_claim_s" in row for row in micro.values())
    lines = [
        "| model | flat bytes | raw `all_reduce` busbw | ElChe flat-parameter all-reduce busbw | ratio | "
        "whole averaging path (`CollectivePlane.average`) busbw | ratio | metadata exchange |"
        + (" pool dispatch claim |" if claims else ""),
        "|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if claims else ""),
    ]
    for row in micro.values():
        lines.append(
            f"| {row['model']} | {_bytes(row['bytes'])} | {_num(row['raw_busbw_gb_s'], 2, ' GB/s')} | "
            f"{_num(row.get('flat_busbw_gb_s'), 2, ' GB/s')} | {_num(row.get('flat_vs_raw'))} | "
            f"{_num(row['plane_busbw_gb_s'], 2, ' GB/s')} | {_num(row['plane_vs_raw'])} | "
            f"{_num(row['metadata_exchange_s'] * 1e6, 0, ' µs')} |"
            + (f" {_num(row['pool_claim_s'] * 1e6, 0, ' µs')} |" if claims else "")
        )
    return lines


def arm_description(arm: str) -> str:
    if arm in ARM_DESCRIPTIONS:
        return ARM_DESCRIPTIONS[arm]
    if arm.startswith("solo_rank"):
        return f"rank {arm.removeprefix('solo_rank')}'s device alone, with its throttle (single-process fit); " \
               "measures the ranks listed with it (CPU rigs: itself; GPU rigs: its speed class)"
    return arm


def markdown(result: dict[str, Any]) -> str:
    world = int(result.get("world_size", 2))
    out = [
        f"# lightning-elche benchmark: `{result['rig']}`",
        "",
        f"- command: `{result['command']}`",
        f"- commit: `{result['commit']}`{' (uncommitted changes)' if result.get('commit_dirty') else ''}",
        f"- date: {result['date']}",
        f"- device: {result['device']['summary']}",
        f"- budget: {result['config']['budget']['name']}; ElChe modes run: "
        + ", ".join(f"`{m}`" for m in result["elche_modes"]),
        "",
        f"## Throughput: {result['setting']['description']}",
        "",
        f"Workload: {result['throughput_workload']}, per-device batch {result['config']['budget']['tp_batch']}; "
        f"steady state (epoch 0 excluded), median of {result.get('passes', 1)} pass(es).",
        "",
        *throughput_table(result, world),
        "",
        slowdown_line(result, world),
        *noise_lines(result),
        *section_extras(result, world),
    ]
    conv = result.get("convergence")
    if conv:
        target = _num(conv["target"], 4)
        out += [
            "",
            f"## Convergence: {conv['workload']}",
            "",
            f"{conv['seeds_run']} seed(s) (of {conv['seeds_requested']} requested), "
            f"{result['config']['budget']['conv_epochs']} epochs per fit, "
            f"same setting as above; held-out score of rank 0's replica after every epoch. "
            f"Target {conv['quality']} = {target} ({conv['target_source']}).",
            "",
            *convergence_table(conv),
        ]
    out += ["", f"## All-reduce microbenchmark ({world} ranks, no throttle)", "",
            *micro_table(result["microbenchmark"])]
    for label, section in result.get("other_settings", {}).items():
        out += ["", f"## Throughput: {section['description']} (`{label}`)", "", *throughput_table(section, world), "",
                slowdown_line(section, world), *noise_lines(section), *section_extras(section, world)]
    out += ["", "## Notes", ""]
    out += [f"- `{arm}`: {arm_description(arm)}." for arm in result["arms"]]
    for mode, why in result.get("elche_modes_skipped", {}).items():
        out.append(f"- `{mode}` not run: {why}.")
    if result.get("skipped_groups"):
        out.append(f"- skipped for time (budget deadline): {', '.join(result['skipped_groups'])}.")
    out.append("- idle marked (est.) is estimated from the solo step times; see docs/benchmarks.md for every formula.")
    if any(row.get("efficiency") and row["efficiency"] > 1.0 for row in result["arms"].values()):
        out.append("- an efficiency above 1 means the solo fits ran under heavier load than the 2-rank fits: "
                   "rerun on a quiet machine.")
    return "\n".join(out) + "\n"


def write_json(result: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(result, indent=2, allow_nan=False) + "\n")


def plot(result: dict[str, Any], out_dir: Path, stem: str) -> dict[str, Any]:
    """Held-out quality vs train time per arm (``result["convergence"]["curves"]``); ElChe batch
    share and anchor over time (``result["elche_traces"]``, the first headline pass).

    Returns {"files": [...]} or {"skipped": reason}.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        return {"skipped": f"matplotlib is not installed ({error}); pip install 'lightning-elche[bench]'"}
    files: list[str] = []
    conv = result.get("convergence")
    curves = conv.get("curves", {}) if conv else {}
    traces = result.get("elche_traces", {})
    if conv and curves:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for i, (arm, seeds) in enumerate(curves.items()):
            for j, curve in enumerate(seeds):
                xs = [p["train_s"] for p in curve]
                ys = [p[conv["quality"]] for p in curve]
                ax.plot(xs, ys, color=colors[i % len(colors)], alpha=0.8, lw=1.2, label=arm if j == 0 else None)
        if conv["target"] is not None:
            ax.axhline(conv["target"], color="grey", ls="--", lw=0.8, label="target")
        ax.set_xlabel("train time (s, held-out scoring excluded)")
        ax.set_ylabel(conv["quality"].replace("_", " "))
        ax.set_title(f"{result['rig']}: held-out quality vs time ({conv['seeds_run']} seed(s))")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{stem}-quality.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        files.append(path.name)
    if traces:
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True)
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for i, (mode, trace) in enumerate((m, t) for m, t in traces.items() if t):
            color = colors[i % len(colors)]
            xs = [t["train_s"] for t in trace]
            planned = [t["planned"][0] / sum(t["planned"]) if sum(t["planned"]) else 0.0 for t in trace]
            top.step(xs, planned, where="post", color=color, lw=1.2, label=mode)
            top.plot(xs, [t["share"][0] for t in trace], ".", color=color, ms=3, alpha=0.5)
            bottom.step(xs, [t["anchor"] for t in trace], where="post", color=color, lw=1.2, label=mode)
        solo = [result["arms"].get(f"solo_rank{k}", {}).get("samples_per_s") for k in (0, 1)]
        if result.get("world_size", 2) != 2 and result.get("speed_share"):
            top.axhline(result["speed_share"][0], color="grey", ls="--", lw=0.8, label="solo speed share")
        elif all(solo) and sum(solo) > 0:
            top.axhline(solo[0] / sum(solo), color="grey", ls="--", lw=0.8, label="solo speed share")
        top.set_ylabel("rank 0's batch share\n(line: plan, dots: each round)")
        top.set_ylim(0, 1)
        top.legend(fontsize=7, ncol=2)
        bottom.set_ylabel("anchor (batches of the slow rank)")
        bottom.set_xlabel("train time (s)")
        bottom.legend(fontsize=7, ncol=2)
        top.set_title(f"{result['rig']}: ElChe batch share and anchor ({result['setting']['label']})")
        fig.tight_layout()
        path = out_dir / f"{stem}-elche.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        files.append(path.name)
    return {"files": files}
