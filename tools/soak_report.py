"""Totals of a fault-injection soak's report (``tests/test_soak.py`` or ``tests/test_join_soak.py``,
one JSON line per trial).

    python tools/soak_report.py soak.jsonl

Prints the trials, the faults injected (those that fired: a faulty rank writes its record just
before acting) and the failures, in all, by mode and by fault kind, and for a join soak by what
became of the joiners; exits 1 when a trial failed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any


def load(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def failed(trial: dict[str, Any]) -> bool:
    return trial["outcome"] != "passed"


def table(title: str, trials: list[dict[str, Any]], keys_of: Any) -> list[str]:
    """One row per key: trials, faults fired, failures (a trial counts under each key it has)."""
    runs, fired, failures = Counter[str](), Counter[str](), Counter[str]()
    for trial in trials:
        for key, faults in keys_of(trial).items():
            runs[key] += 1
            fired[key] += faults
            failures[key] += failed(trial)
    lines = [f"{title:<22} {'trials':>7} {'fired':>7} {'failed':>7}"]
    lines += [f"{key:<22} {runs[key]:>7} {fired[key]:>7} {failures[key]:>7}" for key in sorted(runs)]
    return lines


def joiner_table(trials: list[dict[str, Any]]) -> list[str]:
    """What became of the joiners (admitted, restarted, lost, late, dropped): trials, joiners, failures."""
    runs, joiners, failures = Counter[str](), Counter[str](), Counter[str]()
    for trial in trials:
        outcomes = Counter(trial.get("joiner_outcomes", []))
        for outcome, count in outcomes.items():
            runs[outcome] += 1
            joiners[outcome] += count
            failures[outcome] += failed(trial)
    lines = [f"{'joiner outcome':<22} {'trials':>7} {'joiners':>7} {'failed':>7}"]
    return lines + [f"{key:<22} {runs[key]:>7} {joiners[key]:>7} {failures[key]:>7}" for key in sorted(runs)]


def report(trials: list[dict[str, Any]]) -> str:
    fired = sum(t["fired"] for t in trials)
    lines = [f"{len(trials)} trials, {fired} faults fired (of {sum(len(t['faults']) for t in trials)} drawn), "
             f"{sum(map(failed, trials))} failed; "
             f"{sum(t['expected'] == 'saving stop' for t in trials)} reached max_failure; "
             f"ranks {min(t['ranks'] for t in trials)}-{max(t['ranks'] for t in trials)}; "
             f"{sum(t['elapsed_s'] for t in trials) / 60:.1f} trial-minutes", ""]
    lines += table("mode", trials, lambda t: {t["mode"]: t["fired"]}) + [""]
    lines += table("fired kind", trials, lambda t: dict(Counter(t["fired_kinds"]))) + [""]
    lines += table("faults fired", trials, lambda t: {str(t["fired"]): t["fired"]})
    if any("joiner_outcomes" in t for t in trials):  # a join soak
        lines += [""] + joiner_table(trials)
    failures = [t for t in trials if failed(t)]
    if failures:
        lines += ["", "failed:"] + [f"  {t['seed']}.{t['index']:03d} {t['mode']} {t['ranks']} ranks {t['faults']} "
                                    f"max_failure={t['max_failure']}: {t['outcome']}" for t in failures]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("report", type=Path, help="the file ELCHE_SOAK_REPORT named")
    trials = load(parser.parse_args().report)
    if not trials:
        print("no trials in the report", file=sys.stderr)
        return 1
    print(report(trials))
    return 1 if any(map(failed, trials)) else 0


if __name__ == "__main__":
    sys.exit(main())
