"""benchmarks/matmul.py: its command line, and the decode A/B's report of what "auto" picks.

The script checks the kernel's logits against XLA's itself; this checks that its "auto"
column is the library's own choice (not the forced kernel it timed). It asserts nothing
about speed.
"""

import benchmark_cli
import jax
import pytest


@pytest.fixture
def script(monkeypatch):
    return benchmark_cli.load(monkeypatch, "matmul")


def test_help_and_an_unknown_model(script, capsys):
    benchmark_cli.assert_help_lists(script.main, capsys, (
        "--quick", "--sweep", "--decode", "--decode-dtype", "--batches", "--models", "--marches",
        "--repeats", "--out"))
    benchmark_cli.assert_refuses(script.main, capsys, ["--decode", "--models", "tiny,huge"],
                                 "huge", "tiny")


@pytest.mark.cpu_kernels
def test_decode_ab_reports_the_auto_choice(script, monkeypatch):
    from kvjax.backends.cpu import policy

    # A rule under which "auto" keeps XLA's dot on this build: the report must say so,
    # although the kernel it timed was forced on.
    monkeypatch.setattr(policy, "MATMUL_MAX_ROWS", {"no-such-isa": 32})
    (row,) = script.decode_ab("float32", repeats=2, marches=["native"], batches=(2,),
                              context=64, verbose=False, model="tiny")
    assert row["model"] == "tiny" and row["batch"] == 2
    from kvjax.models.tiny import load_tiny

    _, params = load_tiny("gqa")  # float32, as timed
    assert row["model_bytes"] == sum(x.nbytes for x in jax.tree.leaves(params))
    assert row["native"]["auto"] == "xla"
    assert len(row["native"]["step_s"]) == 2 and min(row["native"]["step_s"]) > 0
