"""Each ElChe arm's batch shares against two references, from committed N-rank benchmark JSONs.

The report's share error compares a rank's steady batch share (epoch 1 on) with its solo speed
share; on a shared machine the ranks' speeds move between the solo fits and the arm, and the
error then reads the machine as much as the dispatch. Results recorded before the report carried
the in-arm share error (``8a5b1e0``) still hold what it needs: each rank's steady batch share and
its window compute seconds (``loss_breakdown.seconds.compute``), whose ratio is proportional to
the speed it computed at inside the arm (one batch size for every rank).

    python tools/in_arm_shares.py docs/benchmarks/many-ranks-*/cpu8*.json
    python tools/in_arm_shares.py --speeds docs/benchmarks/many-ranks-*/cpu8*.json   # per rank
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Optional

from lightning_elche.bench.metrics import share_error


def in_arm_speed_share(row: dict[str, Any]) -> Optional[list[float]]:
    """Each rank's share of the summed in-arm speeds: as the report recorded it (since
    ``8a5b1e0``), else from the steady batch shares and the breakdown's compute (None without)."""
    if row.get("in_arm_speed_share"):
        return list(row["in_arm_speed_share"])
    compute = ((row.get("loss_breakdown") or {}).get("seconds") or {}).get("compute")
    shares = row.get("steady_batch_share")
    if not compute or not shares or min(compute) <= 0 or any(s is None for s in shares):
        return None
    rates = [share / seconds for share, seconds in zip(shares, compute, strict=True)]
    return [rate / sum(rates) for rate in rates]


def rows(path: Path) -> list[tuple[str, Optional[float], Optional[float]]]:
    result = json.loads(path.read_text())
    out = []
    for arm, row in result["arms"].items():
        if row.get("kind") != "elche":
            continue
        in_arm = in_arm_speed_share(row)
        out.append((arm, row.get("share_error"),
                    share_error(row["steady_batch_share"], in_arm) if in_arm else None))
    return out


def speed_moves(path: Path) -> list[tuple[str, list[float]]]:
    """Per ElChe arm, each rank's in-arm speed share over its solo speed share, minus 1: where
    the ranks' relative speeds in the arm differ from their solo fits'."""
    result = json.loads(path.read_text())
    out = []
    for arm, row in result["arms"].items():
        in_arm = in_arm_speed_share(row) if row.get("kind") == "elche" else None
        if in_arm:
            out.append((arm, [a / s - 1.0 for a, s in zip(in_arm, result["speed_share"], strict=True)]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--speeds", action="store_true",
                        help="per rank, how far its in-arm speed share is from its solo speed share")
    args = parser.parse_args()
    if args.speeds:
        for path in args.results:
            for arm, moves in speed_moves(path):
                print(f"{str(path):52} {arm:14} " + " ".join(f"{100 * m:+6.1f}" for m in moves))
        return
    print(f"{'result':52} {'arm':14} {'vs solo':>8} {'vs in-arm':>10}")
    for path in args.results:
        for arm, solo, in_arm in rows(path):
            cells = ["n/a" if v is None else f"{100 * v:.1f} %" for v in (solo, in_arm)]
            print(f"{str(path):52} {arm:14} {cells[0]:>8} {cells[1]:>10}")


if __name__ == "__main__":
    main()
