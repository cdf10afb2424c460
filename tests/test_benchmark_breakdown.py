"""benchmarks/breakdown.py: the op-by-op breakdown of the CPU decode step and prefill.

The script checks each kernel's result against XLA's in the same run (and raises on a
mismatch); this runs it at a toy size (`--quick`: decode_e2e's small model) and checks its
command line and its JSON. It asserts nothing about speed.
"""

import json
import os
import subprocess
import sys

import benchmark_cli
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_help_and_a_missing_mode(capsys, monkeypatch):
    breakdown = benchmark_cli.load(monkeypatch, "breakdown")
    benchmark_cli.assert_help_lists(breakdown.main, capsys, (
        "--decode", "--prefill", "--quick", "--batches", "--context", "--batch", "--prompt-len",
        "--chunk", "--skip-hf", "--repeats", "--march", "--out"))
    benchmark_cli.assert_refuses(breakdown.main, capsys, ["--repeats", "1"],
                                 "give --decode and/or --prefill")


def _timing(pair):  # (median, min) seconds
    return len(pair) == 2 and 0 < pair[1] <= pair[0]


@pytest.mark.cpu_kernels
def test_toy_decode_and_prefill_write_every_part(tmp_path, child_env):
    from kvjax.backends import cpu

    out = tmp_path / "breakdown.json"
    scratch = tmp_path / "tmp"  # the run's temporary files (the toy checkpoint), removed
    scratch.mkdir()
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "breakdown.py"), "--quick", "--decode",
         "--batches", "1", "--context", "48", "--prefill", "--batch", "1", "--prompt-len", "24",
         "--chunk", "16", "--skip-hf", "--repeats", "1", "--out", str(out)],
        cwd=ROOT, env=dict(child_env, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", TMPDIR=str(scratch)),
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # (torch keeps its own compile cache there, torchinductor_<user>: not the run's.)
    assert not [p.name for p in scratch.glob("kvjax*")], "left behind in TMPDIR"
    result = json.loads(out.read_text())
    assert result["isa_class"] == cpu.library().isa_class

    projections = ("q / o", "k / v", "gate / up", "down")
    assert [d["batch"] for d in result["decode"]] == [1]
    for d in result["decode"]:
        assert d["context"] == 48 and _timing(d["step"])
        parts = [r["part"] for r in d["rows"]]
        assert all(any(f"matmul {p} " in part for part in parts) for p in projections), parts
        assert any(part.startswith("attention, one layer") for part in parts), parts
        for r in d["rows"]:
            assert r["count"] > 0 and r["auto"] in ("kernel", "xla") and _timing(r["kernel"])
            assert _timing(r["xla"])

    p = result["prefill"]
    assert "hf" not in p["whole"] and _timing(p["whole"]["kvjax"])  # --skip-hf
    parts = [r["part"] for r in p["rows"]]
    assert all(any(f"matmul {q} " in part for part in parts) for q in projections), parts
    for r in p["rows"]:
        assert r["auto"] in ("kernel", "xla") and _timing(r["kernel"]) and _timing(r["xla"])
        assert _timing(r["torch"]) and r["torch_count"] > 0
