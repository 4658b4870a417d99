"""How far can the mid-epoch batch shares sit from the ranks' speeds with the spec's dead zone?

The real :class:`~lightning_elche.controller.ElCheController`, no processes: W ranks with fixed
batch times (the ``cpu8`` rig's spread, 1, 2, 3, 4.5 twice by default), each window's wall time
read with a relative Gaussian error ``sigma`` (a shared machine's jitter), the plan followed
exactly, the shares counted over the windows after the first ``--skip``. Each row runs the
controller as the spec has it (a rank's count moves only when its target differs by more than
5 %) and once with the dead zone at 0, for comparison; the largest |share / speed share - 1| over
ranks, median and 90th percentile over seeds. A fit's epoch-end windows are shared by the pool,
not by the plan, so a real fit's steady shares sit between these and the speeds.

    PYTHONPATH=. python tools/dead_zone_shares.py [--ranks-ms 100,200,...] [--anchor 20]
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Sequence

from lightning_elche import window_plan
from lightning_elche.controller import ElCheController


def plan_share_error(batch_ms: Sequence[float], anchor: int, sigma: float, seed: int, windows: int,
                     skip: int) -> float:
    """The largest relative error of a rank's planned share over ``windows - skip`` windows."""
    rng = random.Random(seed)
    world = len(batch_ms)
    controller = ElCheController(world, anchor, overhead_target=0.5)  # no growth: the anchor stays
    ran = [0] * world
    for window in range(windows):
        counts = [controller.planned_batches(rank) for rank in range(world)]
        if window >= skip:
            ran = [total + count for total, count in zip(ran, counts, strict=True)]
        wall = [count * ms * max(0.1, 1.0 + rng.gauss(0.0, sigma)) for count, ms in zip(counts, batch_ms, strict=True)]
        controller.report_timing(wall, counts, sync_ms=1.0)
    speeds = [1.0 / ms for ms in batch_ms]
    return max(abs(r / sum(ran) / (s / sum(speeds)) - 1.0) for r, s in zip(ran, speeds, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks-ms", default="100,200,300,450,100,200,300,450", help="each rank's ms per batch")
    parser.add_argument("--anchor", type=int, default=20, help="the slowest rank's batches per window")
    parser.add_argument("--sigmas", default="0,0.02,0.05,0.1", help="relative errors of a window's reading")
    parser.add_argument("--seeds", type=int, default=40)
    parser.add_argument("--windows", type=int, default=40)
    parser.add_argument("--skip", type=int, default=10, help="windows left out at the start (calibration)")
    args = parser.parse_args()
    batch_ms = [float(v) for v in args.ranks_ms.split(",")]
    spec_zone = window_plan.DEAD_ZONE
    print(f"{len(batch_ms)} ranks at {args.ranks_ms} ms per batch, anchor {args.anchor}, {args.windows} windows "
          f"({args.skip} left out), {args.seeds} seeds\n")
    print("| reading error | dead zone | largest share error, median | 90th percentile |")
    print("|---:|---:|---:|---:|")
    try:
        for sigma in (float(v) for v in args.sigmas.split(",")):
            for zone in (spec_zone, 0.0):
                window_plan.DEAD_ZONE = zone  # read by follow_speeds at each report
                errors = sorted(plan_share_error(batch_ms, args.anchor, sigma, seed, args.windows, args.skip)
                                for seed in range(args.seeds))
                p90 = errors[min(len(errors) - 1, int(0.9 * len(errors)))]
                print(f"| {100 * sigma:g} % | {100 * zone:g} % | {100 * statistics.median(errors):.1f} % | "
                      f"{100 * p90:.1f} % |")
    finally:
        window_plan.DEAD_ZONE = spec_zone


if __name__ == "__main__":
    main()
