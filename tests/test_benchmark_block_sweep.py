"""benchmarks/block_sweep.py: its command line, and that it checks every setting's result.

On CPU the GPU kernels run in Pallas' interpret mode, so this asserts nothing about speed:
only that each setting is run, checked against the reference, and a wrong one fails.
"""

import json

import benchmark_cli
import jax.numpy as jnp
import pytest


@pytest.fixture
def script(monkeypatch):
    return benchmark_cli.load(monkeypatch, "block_sweep")


def test_help_and_bad_shapes(script, capsys):
    benchmark_cli.assert_help_lists(script.main, capsys, (
        "--quick", "--ops", "--batch", "--context", "--q-heads", "--kv-heads", "--mla-heads",
        "--page-size", "--bits", "--block-tokens", "--warps", "--stages", "--splits",
        "--block-heads", "--repeats", "--time-limit", "--json", "--seed"))
    benchmark_cli.assert_refuses(script.main, capsys, ["--context", "100"], "100", "16")
    benchmark_cli.assert_refuses(script.main, capsys, ["--block-tokens", "48"], "48",
                                 "power-of-two")
    benchmark_cli.assert_refuses(script.main, capsys, ["--block-heads", "24"], "24",
                                 "power of two")


def test_every_setting_is_checked_and_a_wrong_kernel_fails(script, tmp_path, monkeypatch):
    out = tmp_path / "sweep.json"
    argv = ["--quick", "--ops", "gqa", "qgqa", "--bits", "2", "--json", str(out)]
    assert script.main(argv) == 0
    got = json.loads(out.read_text())
    rows = [(r["op"], r["bits"], r["block_tokens"]) for r in got["rows"]]
    # Every op at every block size of the grid, the default first, each checked.
    assert rows == [("gqa", None, 64), ("gqa", None, 32), ("qgqa", 2, 64), ("qgqa", 2, 32)]
    assert [r["default"] for r in got["rows"]] == [True, False, True, False]
    assert all(r["ok"] and r["max_err"] < 3e-2 for r in got["rows"])

    real = script.paged_gpu.paged_decode_attention

    def off_by_a_little(*args, **kwargs):
        o, lse = real(*args, **kwargs)
        return o + jnp.asarray(0.1, o.dtype), lse

    monkeypatch.setattr(script.paged_gpu, "paged_decode_attention", off_by_a_little)
    assert script.main(["--quick", "--ops", "gqa", "--json", str(out)]) == 1
    assert not any(r["ok"] for r in json.loads(out.read_text())["rows"])
