"""The test helpers, by purpose: import from the purpose modules; this index keeps ``from helpers
import ...`` working.

* ``model_helpers``: models and data of the fit tests;
* ``callback_helpers``: callbacks that inject faults on one rank or record what a fit did;
* ``process_helpers``: ports, launched commands, per-rank records, the leftovers worker;
* ``convergence_helpers``: the digits convergence job.
"""

from __future__ import annotations

from callback_helpers import CountCollectives, FlipBf16Wire, GoSilent, RaiseAtStep, RecordRounds, StopAtStep
from convergence_helpers import CONVERGENCE_ARMS, OUTER_FOR_SHORT_WINDOWS, digits_convergence
from model_helpers import IndexedRegression, RecordingModel, WideRegression, inverse_decay
from process_helpers import fit_and_report_leftovers, free_port, load_records, run_command

__all__ = [
    "CONVERGENCE_ARMS", "OUTER_FOR_SHORT_WINDOWS", "CountCollectives", "FlipBf16Wire", "GoSilent", "IndexedRegression",
    "RaiseAtStep", "RecordRounds", "RecordingModel", "StopAtStep", "WideRegression", "digits_convergence",
    "fit_and_report_leftovers", "free_port", "inverse_decay", "load_records", "run_command",
]
