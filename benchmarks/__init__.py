"""kvjax benchmarks: `python -m benchmarks --help` (see benchmarks/__main__.py)."""

import datetime
import os

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def result_path(prefix: str, out: str | None = None) -> str:
    """Where a benchmark writes its JSON: `out` when given, else
    benchmarks/results/<prefix><UTC time>.json; the folder is created."""
    path = out or os.path.join(
        RESULTS, f"{prefix}{datetime.datetime.now(datetime.UTC).strftime('%Y%m%dT%H%M%SZ')}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return path
