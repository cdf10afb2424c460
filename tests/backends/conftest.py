"""Fixtures of the native-backend tests: CPU options set for one test."""

import contextlib
import sys
from pathlib import Path

import pytest

from kvjax.backends import cpu

# The quantized-cache builders and HLO helpers these tests share with tests/attention.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "attention"))


@pytest.fixture
def cpu_options():
    """`cpu_options(**fields)` sets CPU backend options until the test ends."""
    with contextlib.ExitStack() as stack:
        yield lambda **kw: stack.enter_context(cpu.override(**kw))
