"""Lightning's own tests (``tests/tests_pytorch/`` of Lightning 2.6), ported to ``ElCheStrategy``.

Each module here is one *suite*: a list of cases, each a function that runs on both ranks of one
2-process launch (gloo on CPU) with its own ``Trainer``. ``tests/scripts/lightning_suite.py`` runs
a suite's cases one after the other inside the same two processes, per mode;
``tests/test_lightning_suite.py`` turns every case into its own pytest test id. Every case names
the Lightning test it comes from (``origin``) and what ElChe does with it (``kind``): it passes
with Lightning's assertions, or ElChe refuses the feature (the case asserts the message), or it is
a documented deviation (``docs/compatibility.md``; the case asserts ElChe's behaviour).
"""

SUITES = ("checkpointing", "stops", "loggers", "trainer", "callbacks", "hooks", "elche")
"""The suites, in the order a launch runs them (``elche`` holds ElChe's own cases of issue 26)."""
