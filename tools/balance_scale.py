"""The virtual-time balance model at scale, as a Markdown table (docs/benchmarks.md, "The model at scale").

The model of tests/balance_helpers.py (the real controller and pooled dispatch, ranks with fixed
batch times, no processes): 2 to 32 ranks, batch times spread evenly from 0.13 s to 2, 4 and 8
times that, epochs of 16 (short) and 128 (long) batches per rank, a 5 ms round, a 0.3 s first
batch; efficiency from epoch 1 on and the loss split by cause, in percent of the ideal. Then a
loss of the slowest rank in epoch 1 (0.5 s to detect it) and a join at epoch 1, at a 4x spread.

    python tools/balance_scale.py > table.md
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from balance_helpers import Loss  # noqa: E402
from test_balance import mid_epoch_join, scale_fit  # noqa: E402

CAUSES = ("plan_lag", "drain", "sync", "change", "join", "first_window", "warm_up")


def row(label: str, fit) -> str:  # type: ignore[no-untyped-def]
    parts = fit.loss_by_cause()
    cells = " | ".join(f"{100 * parts[c]:.1f}" for c in CAUSES)
    return f"| {label} | {fit.efficiency():.3f} | {cells} |"


def main() -> None:
    print("| ranks, spread, batches per rank and epoch | efficiency | " + " | ".join(CAUSES) + " |")
    print("|---|---:|" + "---:|" * len(CAUSES))
    for world in (2, 4, 8, 16, 32):
        for batches in (128, 16):
            for spread in (2.0, 4.0, 8.0):
                print(row(f"{world}, {spread:g}x, {batches}", scale_fit(world, spread, batches)), flush=True)
    for world in (2, 4, 8, 32):
        lost = scale_fit(world, 4.0, 128, epochs=3, loss=Loss(epoch=1, round=1, rank=world - 1, detect_s=0.5))
        print(row(f"{world}, 4x, 128, slowest lost in epoch 1", lost))
        joined = scale_fit(world, 4.0, 128, epochs=3, join=mid_epoch_join(world, 4.0, 128))
        print(row(f"{world}, 4x, 128, a 2x rank joins 0.3 into epoch 1", joined), flush=True)


if __name__ == "__main__":
    main()
