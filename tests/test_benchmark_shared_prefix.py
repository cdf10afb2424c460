"""benchmarks/shared_prefix.py: decode attention over a shared prefix's pages, three layouts.

The script checks that the layouts give the same bits and match the reference, and exits
1 otherwise; this runs it at a small size and checks its command line and its JSON. It
asserts nothing about speed.
"""

import json
import os

import benchmark_cli
import pytest


@pytest.fixture
def script(monkeypatch):
    return benchmark_cli.load(monkeypatch, "shared_prefix")


def test_help_and_a_bad_prefix(script, capsys):
    benchmark_cli.assert_help_lists(script.main, capsys, (
        "--quick", "--batch", "--prefix", "--own", "--kv-heads", "--group", "--head-dim",
        "--page-size", "--dtype", "--repeats", "--share", "--bandwidth-mib", "--seed", "--out"))
    benchmark_cli.assert_refuses(script.main, capsys, ["--prefix", "100", "--page-size", "16"],
                                 "multiple of --page-size")


@pytest.mark.cpu_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_small_run_checks_its_layouts(script, tmp_path, cpu_build, dtype):
    """On every build of the kernels (tests/cpu_builds.py): the layouts give the same bits."""
    out = tmp_path / "run.json"
    seed = int.from_bytes(os.urandom(4), "little")
    code = script.main(["--batch", "4", "--prefix", "64", "--own", "40", "--kv-heads", "2",
                        "--group", "2", "--head-dim", "32", "--dtype", dtype, "--repeats", "3",
                        "--share", "16", "--bandwidth-mib", "8", "--seed", str(seed),
                        "--out", str(out)])
    run = json.loads(out.read_text())
    assert code == 0 and run["ok"] and run["identical"], run
    assert set(run["rows"]) == {"private", "shared", "runs"}
    # Bytes each layout must read: every copy privately, the prefix once when shared.
    row = 2 * 2 * 32 * (4 if dtype == "float32" else 2)
    assert run["rows"]["private"]["bytes"] == 4 * (64 + 40) * row
    assert run["rows"]["runs"]["bytes"] == run["rows"]["shared"]["bytes"] == (64 + 4 * 40) * row
    assert all(r["wall_min_s"] <= r["wall_median_s"] for r in run["rows"].values())
