"""kvrelay's benchmarks, a package of suites; each module runs as ``python -m bench.SUITE.NAME``
from the repository root, or through the one runner: ``python -m bench`` lists them and
``python -m bench SUITE NAME [ARGS...]`` runs one. Raw outputs stay out of git (``.gitignore``);
``bench/results`` keeps the reports a reader needs (``tests/test_bench_layout.py``)."""
