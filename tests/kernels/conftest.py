"""Kernel tests: the exhaustive sweeps are marked `slow` and run only on request.

CI runs a representative subset (every GQA ratio, head_dim, page size and dtype
appears at least once per kernel). `KVJAX_SLOW=1 pytest tests/kernels` (or
`-m slow`) adds the full cartesian sweeps, which take tens of minutes on a CPU.
"""

import os

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: exhaustive kernel sweep (KVJAX_SLOW=1 to run)")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("KVJAX_SLOW") == "1" or "slow" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="exhaustive sweep: set KVJAX_SLOW=1 or pass -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
