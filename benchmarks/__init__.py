"""kvjax benchmarks: `python -m benchmarks --help` (see benchmarks/__main__.py)."""
