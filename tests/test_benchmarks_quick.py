"""`python -m benchmarks --quick` runs every CPU section end to end and verifies its results.

The benchmark sections check their own results against references (and raise
on a mismatch); this test checks the entry point exits 0, wrote its JSON, and
that every section's JSON holds results. It asserts nothing about speed.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quick_run_exits_zero_and_writes_json(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # the suite's 8 fake CPU devices are not the benchmark's
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--no-plots",
                           "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    sections = summary["sections"]
    assert set(sections) == {"roofline", "paging", "pool", "e2e", "capacity"}
    assert all(s["status"] == "ok" for s in sections.values()), sections
    roof = json.loads((tmp_path / "roofline.json").read_text())
    assert {r["format"] for r in roof["rows"]} == {"bf16", "int4", "int2"}
    assert all(r["bytes"] > 0 and r["wall_median_s"] > 0 for r in roof["rows"])
    paging = json.loads((tmp_path / "paging.json").read_text())
    assert paging["results"] and all(r["ratios"] for r in paging["results"])
    pool = json.loads((tmp_path / "pool.json").read_text())
    assert set(pool["pool_capacity"]["float32"]) == {"x1", "x4", "x16"}
    e2e = json.loads((tmp_path / "e2e.json").read_text())
    families = {r["family"] for r in e2e["results"]}
    assert families == {"llama", "deepseek"}
    for r in e2e["results"]:  # float32: greedy tokens identical to transformers'
        assert r["engines"]["hf_dynamic"]["same_tokens_as_kvjax"] == 1.0
    cap = json.loads((tmp_path / "capacity.json").read_text())
    assert len(cap["layouts"]) == 5 and all(r["sequences"] > 0 for r in cap["layouts"])
