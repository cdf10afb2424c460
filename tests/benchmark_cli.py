"""The command-line checks every `benchmarks/` script's test makes: it imports as a module,
its --help lists its flags, and bad input exits 2 with a message."""

import importlib
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(monkeypatch, name: str):
    """`benchmarks.<name>`, with the repository root on sys.path for this test."""
    monkeypatch.syspath_prepend(ROOT)
    return importlib.import_module(f"benchmarks.{name}")


def assert_help_lists(main, capsys, flags) -> None:
    with pytest.raises(SystemExit) as helped:
        main(["--help"])
    out = capsys.readouterr().out
    assert helped.value.code == 0
    missing = [f for f in flags if f not in out]
    assert not missing, f"--help does not list {missing}"


def assert_refuses(main, capsys, argv, *needles) -> None:
    """`main(argv)` exits 2 with every needle in its error message."""
    with pytest.raises(SystemExit) as refused:
        main(argv)
    err = capsys.readouterr().err
    assert refused.value.code == 2 and all(n in err for n in needles), err
