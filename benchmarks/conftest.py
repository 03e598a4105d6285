"""Shared setup of the pytest-benchmark suite (benchmarks/bench_*.py).

The suite runs as smoke tests in the normal test run (the repo's pytest config passes
``--benchmark-disable``: every benchmarked function runs once, untimed). To measure::

    pytest benchmarks --benchmark-enable --benchmark-json results/pytest-benchmark.json

The JSON gets the machine's torch version and core count added below.
"""

from __future__ import annotations

import os
import platform


def pytest_benchmark_update_json(config, benchmarks, output_json) -> None:
    import torch

    import hiersync

    output_json["hiersync"] = {
        "version": hiersync.__version__,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
