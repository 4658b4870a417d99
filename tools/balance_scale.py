"""The virtual-time balance model at scale, as Markdown tables (docs/benchmarks.md, "The model at scale").

The model of tests/balance_helpers.py (the real controller and pooled dispatch, ranks with fixed
batch times, no processes): 2 to 32 ranks, batch times spread evenly from 0.13 s to 2, 4 and 8
times that, epochs of 16 (short) and 128 (long) batches per rank, a 5 ms round, a 0.3 s first
batch; efficiency from epoch 1 on and the loss split by cause, in percent of the ideal. Then, at a
4x spread and long epochs, changes in epoch 1: the slowest rank lost (0.5 s to detect it), and a
rank twice as slow as the fastest asking to join at 0.05, 0.35 and 0.65 of the epoch (admitted at
the next round, mid-epoch; its first batch 0.3 s slower), once with the members held 0.25 s for
its state, and a loss and a join in one epoch. The second table also gives where the joiner was
admitted and its batch share in epoch 2 over its speed share.

    PYTHONPATH=. python tools/balance_scale.py > table.md
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from balance_helpers import Loss  # noqa: E402
from test_balance import JOIN_AT, mid_epoch_join, scale_fit  # noqa: E402

CAUSES = ("plan_lag", "drain", "sync", "change", "join", "first_window", "warm_up")


def row(label: str, fit) -> str:  # type: ignore[no-untyped-def]
    parts = fit.loss_by_cause()
    # A part that is zero but for float rounding would print as -0.0.
    cells = " | ".join(f"{100 * parts[c] if abs(parts[c]) >= 5e-4 else 0.0:.1f}" for c in CAUSES)
    return f"| {label} | {fit.efficiency():.3f} | {cells} |"


def join_row(label: str, fit) -> str:  # type: ignore[no-untyped-def]
    joined = fit.epochs[1]
    speeds = [1.0 / t for t in fit.batch_s]
    share = fit.epochs[-1].batches[-1] / sum(fit.epochs[-1].batches) / (speeds[-1] / sum(speeds))
    return f"{row(label, fit)} {joined.joined_at_s:.1f} of {joined.seconds:.1f} | {share:.3f} |"


def main() -> None:
    print("| ranks, spread, batches per rank and epoch | efficiency | " + " | ".join(CAUSES) + " |")
    print("|---|---:|" + "---:|" * len(CAUSES))
    for world in (2, 4, 8, 16, 32):
        for batches in (128, 16):
            for spread in (2.0, 4.0, 8.0):
                print(row(f"{world}, {spread:g}x, {batches}", scale_fit(world, spread, batches)), flush=True)
    print()
    print("| ranks, change in epoch 1 (4x, 128) | efficiency | " + " | ".join(CAUSES)
          + " | admitted, s into the epoch | joiner's share / speed share |")
    print("|---|---:|" + "---:|" * (len(CAUSES) + 2))
    for world in (2, 4, 8, 32):
        loss = Loss(epoch=1, round=1, rank=world - 1, detect_s=0.5)
        print(row(f"{world}, slowest lost", scale_fit(world, 4.0, 128, epochs=3, loss=loss)) + " | |", flush=True)
        for fraction in JOIN_AT:
            join = mid_epoch_join(world, 4.0, 128, fraction)
            print(join_row(f"{world}, joiner asks at {fraction:g}", scale_fit(world, 4.0, 128, epochs=3, join=join)))
        join = replace(mid_epoch_join(world, 4.0, 128, 0.35), admit_s=0.25)
        print(join_row(f"{world}, joiner asks at 0.35, 0.25 s admission",
                       scale_fit(world, 4.0, 128, epochs=3, join=join)))
        both = scale_fit(world, 4.0, 128, epochs=3, loss=loss, join=mid_epoch_join(world, 4.0, 128, 0.35))
        print(join_row(f"{world}, slowest lost and joiner asks at 0.35", both), flush=True)


if __name__ == "__main__":
    main()
