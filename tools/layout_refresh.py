"""The host time of ``AveragedLayout.refresh``, which every plane runs at the start of every round
(``planes.base.stamp_layout``): on the host, with the device idle in the blocking modes, so it is
part of the round's exposed time on every rank.

A model of ``--blocks`` conv-BatchNorm-ReLU blocks (``3 x blocks`` modules, ``4 x blocks``
parameters and ``2 x blocks`` float buffers) is timed at an ordinary round and at an epoch's first
round (the whole module walked: ``walk_at_next_refresh``), and, with ``--baseline REV``, the same
against that commit's ``lightning_elche/averaging.py`` in the same process (ratios from one run).

    python tools/layout_refresh.py --baseline cc9e70f --out DIR

writes ``DIR/layout_refresh.json`` and ``DIR/layout_refresh.md``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from torch import nn

from lightning_elche import averaging


def model(blocks: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Conv2d(16, 16, 3), nn.BatchNorm2d(16), nn.ReLU()]
    return nn.Sequential(*layers)


def microseconds(op: Callable[[], object], calls: int, repeats: int) -> list[float]:
    """Mean time of ``op`` over ``calls`` calls, ``repeats`` times."""
    for _ in range(min(calls, 100)):
        op()
    out = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            op()
        out.append(1e6 * (time.perf_counter() - started) / calls)
    return out


def baseline_module(revision: str, folder: str) -> ModuleType:
    source = subprocess.run(["git", "show", f"{revision}:lightning_elche/averaging.py"], check=True,
                            capture_output=True, text=True).stdout
    path = Path(folder, "baseline_averaging.py")
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("baseline_averaging", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[10, 50, 150])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline", default=None, help="a commit whose averaging.py to time beside this one")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "lightning_elche"], capture_output=True,
                                text=True).stdout.strip())
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        old = baseline_module(args.baseline, folder) if args.baseline else None
        for blocks in args.blocks:
            layout = averaging.AveragedLayout(model(blocks))

            def at_an_epoch_start(layout: Any = layout) -> None:
                layout.walk_at_next_refresh()
                layout.refresh()

            row: dict[str, Any] = {"blocks": blocks, "modules": 3 * blocks,
                                   "parameters": len(layout.params.tensors), "buffers": len(layout.buffers.tensors),
                                   "round_us": microseconds(layout.refresh, args.calls, args.repeats),
                                   "epoch_start_us": microseconds(at_an_epoch_start, args.calls, args.repeats)}
            if old is not None:
                row["baseline_us"] = microseconds(old.AveragedLayout(model(blocks)).refresh, args.calls, args.repeats)
            rows.append(row)
    result = {"commit": commit, "commit_dirty": dirty, "baseline": args.baseline,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs, "
                         f"load {os.getloadavg()[0]:.1f}", "python": sys.version.split()[0],
              "command": "python tools/layout_refresh.py " + " ".join(sys.argv[1:]), "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "layout_refresh.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# AveragedLayout.refresh, host time per call (median of {args.repeats} x {args.calls} calls)", "",
             f"commit `{commit}`{' (dirty)' if dirty else ''}, {result['date']}, {result['machine']}, "
             f"Python {result['python']}", "", f"`{result['command']}`", "",
             "| modules | parameters + buffers | a round, µs | an epoch's first round, µs |"
             + (f" `{args.baseline}`, every round, µs | round / baseline |" if old else ""),
             "|---:|---:|---:|---:|" + ("---:|---:|" if old else "")]
    for row in rows:
        line = (f"| {row['modules']} | {row['parameters']} + {row['buffers']} | "
                f"{statistics.median(row['round_us']):.1f} | {statistics.median(row['epoch_start_us']):.1f} |")
        if old:
            ratio = statistics.median(row["round_us"]) / statistics.median(row["baseline_us"])
            line += f" {statistics.median(row['baseline_us']):.1f} | {ratio:.2f} |"
        lines.append(line)
    (out / "layout_refresh.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
