"""docs/compatibility.md stays honest: every line names a test, and every named test exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST_REFERENCE = re.compile(r"`(test_[a-z0-9_]+\.py)::(test_[A-Za-z0-9_]+)")


def defined_tests(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


def test_every_feature_line_names_tests_that_exist():
    rows = [line for line in (ROOT / "docs" / "compatibility.md").read_text().splitlines()
            if line.startswith("| ") and not line.startswith("| Feature") and not line.startswith("|---")]
    assert len(rows) >= 40
    for row in rows:
        references = TEST_REFERENCE.findall(row)
        assert references, f"no test named for: {row}"
        for file, name in references:
            assert name in defined_tests(ROOT / "tests" / file), f"{file}::{name} does not exist ({row})"


def test_the_table_of_ported_lightning_tests_is_the_case_registry():
    # One row per ported case (tests/ported/), as tests/ported/table.py prints it: regenerate with
    # `cd tests && python -m ported.table` after adding or changing a case.
    from ported.table import markdown

    doc = (ROOT / "docs" / "compatibility.md").read_text()
    table = markdown()
    assert table in doc, "docs/compatibility.md's table of ported Lightning tests is not the case registry's"
    assert doc.count("| Feature (Lightning's test") == 1
