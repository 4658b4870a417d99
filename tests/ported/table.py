"""The table of ported Lightning tests in docs/compatibility.md, made from the case registry.

    python -m ported.table          (from tests/: prints the table)

``tests/test_compat_doc.py`` checks that the docs hold exactly this table.
"""

from __future__ import annotations

import importlib

from ported import SUITES
from ported.harness import FEW_MODES, MODES

HEADER = ("| Feature (Lightning's test, under `tests/tests_pytorch/`) | Under ElChe | Default run | Test |\n"
          "|---|---|---|---|")
KIND = {"passes": "passes", "refused": "refused", "deviation": "deviation"}


def _modes(modes: tuple[str, ...]) -> str:
    if modes == MODES:
        return "every mode"
    if modes == FEW_MODES:
        return "3 modes"
    return ", ".join(modes)


def rows() -> list[str]:
    lines = []
    for suite_name in SUITES:
        suite = importlib.import_module(f"ported.{suite_name}").SUITE
        for case in suite.cases.values():
            status = KIND[case.kind] + (f": {case.note}" if case.note else "")
            test = f"`test_lightning_suite.py::test_ported[{suite_name}-<mode>-{case.name}]`"
            lines.append(f"| `{case.origin}` | {status} | {_modes(case.modes)} | {test} |")
    return lines


def markdown() -> str:
    return "\n".join([HEADER, *rows()])


if __name__ == "__main__":
    print(markdown())
