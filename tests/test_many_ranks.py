"""More than two ranks of different speeds, every mode: each sample of each epoch trained exactly
once over all ranks, and every rank ends with the same parameters.

The CI part runs two launches (3 and 4 gloo ranks), each fitting several modes in a row so that
the process start-up is paid once. The ``many_ranks`` part repeats issue 13's matrix (8 and 16
ranks, per-step sleeps of 2, 4, 8, 3 ms, 6144 samples, batch 32, default chunks, 3 epochs, every
mode, 3 runs each); it needs a machine with about as many cores as ranks and is not part of CI's
``-m "not gpu and not many_ranks"``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest
from multirank_helpers import (
    MODES,
    assert_same_parameters,
    clean_environment,
    coverage_errors,
    load_rank_records,
    run_together,
)

SCRIPT = Path(__file__).parent / "scripts" / "multirank_fits.py"


@dataclass(frozen=True)
class Launch:
    """One multirank_fits.py run: ``ranks`` processes fitting each of ``modes`` ``repeats`` times."""

    ranks: int
    modes: tuple[str, ...]
    repeats: int = 1
    epochs: int = 2
    samples: int = 512
    batch_size: int = 16
    timeout_s: float = 150.0

    def command(self, out_dir: Path) -> list[str]:
        return [sys.executable, str(SCRIPT), str(out_dir), "--ranks", str(self.ranks), "--modes", *self.modes,
                "--repeats", str(self.repeats), "--epochs", str(self.epochs), "--samples", str(self.samples),
                "--batch-size", str(self.batch_size)]


# Every mode at least once, cpu_async (the mode with a non-blocking round) at both sizes.
CI_LAUNCHES = {
    3: Launch(3, ("nccl_sync", "cpu_cadence", "cpu_async")),
    4: Launch(4, ("nccl_cadence", "cpu_sync", "cpu_async")),
}
MANY_LAUNCHES = {
    ranks: Launch(ranks, MODES, repeats=3, epochs=3, samples=6144, batch_size=32, timeout_s=900.0)
    for ranks in (8, 16)
}


class Launches:
    """Runs each launch once per test session, on first demand, and remembers its outcome."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.outcomes: dict[Launch, Optional[str]] = {}

    def results(self, launch: Launch) -> Path:
        out_dir = self.root / f"ranks{launch.ranks}-{'-'.join(launch.modes)}-x{launch.repeats}"
        if launch not in self.outcomes:
            self.outcomes[launch] = "did not finish"
            try:
                run_together([(launch.command(out_dir), clean_environment())], out_dir / "logs", launch.timeout_s)
            except BaseException as failure:  # noqa: BLE001 (remembered, then failed again for each test)
                self.outcomes[launch] = str(failure)[-6000:]
                raise
            self.outcomes[launch] = None
        failure = self.outcomes[launch]
        if failure is not None:
            pytest.fail(f"the {launch.ranks}-rank launch failed earlier in this session:\n{failure}")
        return out_dir


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> Launches:
    return Launches(tmp_path_factory.mktemp("many_ranks"))


def check_fit(out_dir: Path, launch: Launch) -> None:
    records = load_rank_records(out_dir, launch.ranks)
    epochs = list(range(launch.epochs))
    errors = coverage_errors(records, launch.samples, epochs)
    assert not errors, f"{out_dir.name} at {launch.ranks} ranks: " + "; ".join(errors)
    assert_same_parameters(records)
    assert len({r["rounds"] for r in records}) == 1 and records[0]["rounds"] > 0, [r["rounds"] for r in records]
    assert all(r["current_epoch"] == launch.epochs for r in records)
    assert all(steps > 0 for steps in records[0]["steps"]), f"a rank never trained: {records[0]['steps']}"


@pytest.mark.distributed
@pytest.mark.timeout(200)
@pytest.mark.parametrize(("ranks", "mode"), [(r, m) for r, launch in CI_LAUNCHES.items() for m in launch.modes])
def test_every_sample_once_and_identical_replicas_at_3_and_4_ranks(launches: Launches, ranks: int, mode: str) -> None:
    launch = CI_LAUNCHES[ranks]
    check_fit(launches.results(launch) / f"{mode}-0", launch)


def test_the_ci_launches_cover_every_mode() -> None:
    assert {m for launch in CI_LAUNCHES.values() for m in launch.modes} == set(MODES)


@pytest.mark.many_ranks
@pytest.mark.timeout(1000)
@pytest.mark.parametrize("repeat", range(3))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("ranks", sorted(MANY_LAUNCHES))
def test_every_sample_once_and_identical_replicas_at_many_ranks(launches: Launches, ranks: int, mode: str,
                                                                repeat: int) -> None:
    launch = MANY_LAUNCHES[ranks]
    check_fit(launches.results(launch) / f"{mode}-{repeat}", launch)


def test_the_coverage_check_sees_a_lost_and_a_repeated_sample() -> None:
    ranks = [{"rank": 0, "seen": {"0": [0, 1, 2], "1": [2]}}, {"rank": 1, "seen": {"0": [3], "1": [0, 1, 1]}}]
    assert coverage_errors(ranks, 4, [0]) == ["trained in epochs ['1'], expected only [0]"]
    errors = coverage_errors(ranks, 4, [0, 1])
    assert len(errors) == 1 and errors[0].startswith("epoch 1: 1 samples never trained (first [3]), 1 trained")
