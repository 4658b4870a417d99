"""Lightning's own tests as the judge (issue 26): each ported case (``tests/ported/``) is its own test id.

The cases of one mode run in ONE 2-process launch (``tests/scripts/lightning_suite.py``), one after
the other in the same two processes, each with its own Trainer fit (importing torch and Lightning
costs a process about 10 s on 2 cores, more than most cases); the first test of a mode starts the
launch for every selected case of that mode, and every test reads its own case's result from both
ranks. The default run covers ``CI_MODES`` (both transports, both dispatches: two launches);
``-m lightning_suite_full`` adds the other modes, for every case whose behaviour depends on the
mode (checkpoints, stops, steps) and for the rest.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from multirank_helpers import clean_environment, free_port, run_together
from ported import SUITES
from ported.harness import MODES

CI_MODES = ("nccl_sync", "cpu_async")
"""The collective plane with the sharded dispatch, the CPU plane with the shared pool, not blocking."""

SCRIPT = Path(__file__).resolve().parent / "scripts" / "lightning_suite.py"
LAUNCH_BASE_S = 120.0
LAUNCH_PER_CASE_S = 10.0  # a backstop: a hung collective fails its case after the 30 s group timeout

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(1500)]


def suite(name: str) -> Any:
    return importlib.import_module(f"ported.{name}").SUITE


def _params() -> list[Any]:
    params = []
    for suite_name in SUITES:
        for case in suite(suite_name).cases.values():
            for mode in MODES:
                # CI: two launches (each transport and each dispatch once); the rest of a case's modes run full.
                marks = [] if mode in case.modes and mode in CI_MODES else [pytest.mark.lightning_suite_full]
                params.append(pytest.param(suite_name, mode, case.name, marks=marks,
                                           id=f"{suite_name}-{mode}-{case.name}"))
    return params


@dataclass
class Launch:
    results: dict[tuple[str, str], list[dict[str, Any]]]
    seconds: float
    failure: str = ""


class Launches:
    """One launch per mode, started by the first test that needs it, for every case this session
    selected in that mode (all suites: each launch pays the start-up of two processes once)."""

    def __init__(self, session: pytest.Session, root: Path) -> None:
        self.session, self.root = session, root
        self.done: dict[str, Launch] = {}

    def selected_cases(self, mode: str) -> list[tuple[str, str]]:
        selected = set()
        for item in self.session.items:
            callspec = getattr(item, "callspec", None)
            if getattr(item, "module", None) is sys.modules[__name__] and callspec is not None and \
                    callspec.params.get("mode") == mode:
                selected.add((callspec.params["suite_name"], callspec.params["case_name"]))
        order = [(name, case) for name in SUITES for case in suite(name).cases]
        return sorted(selected, key=order.index)

    def get(self, mode: str) -> Launch:
        if mode not in self.done:
            self.done[mode] = self._launch(mode, self.selected_cases(mode))
        return self.done[mode]

    def _launch(self, mode: str, cases: list[tuple[str, str]]) -> Launch:
        out_dir = self.root / mode
        port = free_port()
        names = [f"{suite_name}:{case}" for suite_name, case in cases]
        commands = [
            ([sys.executable, str(SCRIPT), str(out_dir), "--mode", mode, "--rank", str(rank), "--port", str(port),
              "--cases", *names], clean_environment())
            for rank in range(2)
        ]
        started = time.perf_counter()
        failure = ""
        try:
            run_together(commands, out_dir / "logs", LAUNCH_BASE_S + LAUNCH_PER_CASE_S * len(cases))
        except pytest.fail.Exception as error:
            failure = str(error)
        results: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for suite_name, case in cases:
            records = []
            for rank in range(2):
                path = out_dir / suite_name / case / f"rank{rank}.json"
                records.append(json.loads(path.read_text()) if path.exists() else
                               {"status": "no result", "error": "the rank wrote no result", "seconds": 0.0})
            results[(suite_name, case)] = records
        return Launch(results, time.perf_counter() - started, failure)


@pytest.fixture(scope="session")
def launches(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Launches:
    return Launches(request.session, tmp_path_factory.mktemp("lightning_suite"))


@pytest.mark.parametrize(("suite_name", "mode", "case_name"), _params())
def test_ported(launches: Launches, suite_name: str, mode: str, case_name: str) -> None:
    launch = launches.get(mode)
    records = launch.results[(suite_name, case_name)]
    failed = [(rank, r) for rank, r in enumerate(records) if r["status"] != "passed"]
    if failed:
        case = suite(suite_name).cases[case_name]
        details = "\n".join(f"--- rank {rank}: {r['status']}\n{r['error']}" for rank, r in failed)
        tail = f"\n--- launch:\n{launch.failure[-3000:]}" if launch.failure else ""
        pytest.fail(f"{case.origin} ({case.kind}) under {mode}:\n{details}{tail}")
