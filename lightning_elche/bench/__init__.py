"""The benchmark harness of lightning-elche: ``python -m lightning_elche.bench --rig cpu2``.

One invocation runs every arm of the benchmark protocol (``docs/benchmarks.md``) on one rig,
interleaved, in two long-lived rank processes, and writes a Markdown table, a JSON file with every
number and PNG plots. Modules:

* :mod:`~lightning_elche.bench.config`: rigs, budgets and the command line;
* :mod:`~lightning_elche.bench.plan`: the ordered list of fits one invocation runs;
* :mod:`~lightning_elche.bench.workloads`: models and data (synthetic CIFAR-shaped images,
  scikit-learn's digits, a byte-level transformer on the standard library's sources);
* :mod:`~lightning_elche.bench.arms`: the strategy of each arm;
* :mod:`~lightning_elche.bench.meter`: the callback that times and scores a fit;
* :mod:`~lightning_elche.bench.worker`: what each rank process runs;
* :mod:`~lightning_elche.bench.metrics`: the numbers derived from the rank records;
* :mod:`~lightning_elche.bench.report`: Markdown, JSON and plots.
"""
