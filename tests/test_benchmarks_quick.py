"""`python -m benchmarks --quick` runs the CPU sections end to end and verifies their results.

The benchmark sections check their own results against references (and raise
on a mismatch); this test checks the entry point exits 0, wrote its run.json,
that every section's data holds results, and that the README / docs tables render
from it. It asserts nothing about speed.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


# The quick run's CPU sections in four parts of about 25-40 s each alone on a 2-core machine
# (the offload section alone is 40): a rotation, one part a run (the commit's seed chooses);
# `--slow` runs all.
PARTS = {
    "offload": ("offload",),
    "kvbits": ("kvbits", "roofline", "pool"),
    "decode": ("decode", "e2e", "dsa", "paging"),
    "serving": ("serving", "capacity"),
}


@pytest.mark.rotate(1)
@pytest.mark.parametrize("part", sorted(PARTS))
def test_quick_run_exits_zero_and_writes_json(tmp_path, child_env, part):
    scratch = tmp_path / "tmp"  # the run's temporary files, which it must remove
    scratch.mkdir()
    env = dict(child_env, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", TMPDIR=str(scratch))
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--no-plots",
                           "--only", ",".join(PARTS[part]), "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    # (torch keeps its own compile cache there, torchinductor_<user>: not the run's.)
    assert not [p.name for p in scratch.glob("kvjax*")], "left behind in TMPDIR"
    run = json.loads((tmp_path / "run.json").read_text())
    sections = run["sections"]
    assert set(sections) == set(PARTS[part])
    assert all(s["status"] == "ok" for s in sections.values()), {
        k: s.get("error", "")[-2000:] for k, s in sections.items()}
    for name, section in sections.items():
        if name == "offload":
            _check_offload(section["data"], section["table"])
        else:
            _CHECKS[name](section["data"])

    # The README's summary and docs/performance.md's block render from this run.
    from benchmarks import report

    rows = report.summary_rows(run)
    # Headline rows from every part but offload's (that section has none).
    assert bool(rows) == (part != "offload"), rows
    assert all(len(r) == 2 and r[1] for r in rows), rows
    text = report.replace_block("a\n<!-- benchmarks:x -->\nold\n<!-- /benchmarks:x -->\nb",
                                "x", report.full_report(run, "out"))
    assert "old" not in text and f"#### {PARTS[part][0]} (ok" in text and text.endswith("-->\nb")


def _check_roofline(roof):
    assert {r["format"] for r in roof["rows"]} == {"bf16", "int4", "int2"}
    assert all(r["bytes"] > 0 and r["wall_median_s"] > 0 for r in roof["rows"])


def _check_paging(paging):
    assert paging["results"] and all(r["ratios"] for r in paging["results"])


def _check_pool(pool):
    assert set(pool["pool_capacity"]["float32"]) == {"x1", "x4", "x16"}


def _check_decode(decode):
    assert decode["results"] and all(r["kvjax_tokens_per_s"] > 0 for r in decode["results"])


def _check_e2e(e2e):
    families = {r["family"] for r in e2e["results"]}
    assert families == {"llama", "deepseek"}
    for r in e2e["results"]:  # float32: greedy tokens identical to transformers'
        assert r["engines"]["hf_dynamic"]["same_tokens_as_kvjax"] == 1.0


def _check_serving(srv):  # every request's tokens equal generate's; some hit
    assert srv["ok"] and srv["identical"] == srv["requests"] and srv["hit_pages"] > 0


def _check_kvbits(data):
    kvb = {r["cache"]: r for r in data["results"]}
    assert set(kvb) == {"bf16", "int4", "int2"}
    assert all(r["kv_bytes_read"] > 0 for r in kvb.values())
    # A step time is positive, or None when timing noise exceeded the timed steps.
    assert all(r["tokens_per_s"] is None or r["tokens_per_s"] > 0 for r in kvb.values())
    # KIVI pages read fewer bytes than bf16 pages for the same context.
    read = [kvb[c]["kv_bytes_read"] for c in ("int2", "int4", "bf16")]
    assert read == sorted(set(read)), read


def _check_dsa(dsa):  # checked itself: counted bytes = memory's, float64 refs
    assert dsa["ok"] and {r["program"] for r in dsa["rows"]} >= {"dense", "dsa"}
    assert all(r["bytes_counted"] == r["bytes_hand"] for r in dsa["rows"])
    assert dsa["ratios"]["bytes_dsa_over_dense"] < 1


def _check_capacity_section(data):
    _check_capacity(data["layouts"])


def _check_offload(d, stdout):
    """benchmarks/offload.py's quick run: host-resident pages decode the all-device tokens
    (the script checks that itself and fails otherwise), and what it recorded adds up."""
    assert d["ok"] and d["finished"] and not d["failures"]
    assert d["machine"]["cpu"] and d["machine"]["backend"] == "cpu"
    rows = {(r["cache"], r["host_fraction"]): r for r in d["rows"]}
    assert set(rows) == {(c, f) for c in ("bf16", "int4") for f in (0.0, 0.5, 0.9)}
    for cache in ("bf16", "int4"):
        host = [rows[cache, f]["host_kv_bytes"] for f in (0.0, 0.5, 0.9)]
        dev = [rows[cache, f]["device_kv_bytes"] for f in (0.0, 0.5, 0.9)]
        assert host[0] == 0 < host[1] < host[2] and dev[0] > dev[1] > dev[2] > 0
        for f in (0.0, 0.5, 0.9):
            r = rows[cache, f]
            assert r["step_median_s"] > 0 and r["steps_timed"] >= 3
            assert r["bound_s"] == pytest.approx(r["bound_host_s"] + r["bound_device_s"])
            assert r["step_over_bound"] == pytest.approx(r["step_median_s"] / r["bound_s"])
    # Every trial (warm-up included) decoded the reference's tokens, or flipped one at a
    # near tie (int4: the device kernel's integer arithmetic vs the host's float32).
    for t in d["trials"]:
        assert t["tokens_same_as_reference"] == 1.0 or (
            t["cache"] == "int4" and t["near_tie"]["tie"]), t
    assert all(r["tokens_same"] for r in d["rows"] if r["cache"] == "bf16")
    assert all(t["accounted_host_bytes"] == t["host_kv_bytes"] for t in d["trials"]
               if t["cache"] == "bf16")
    bw = d["bandwidth"]
    assert min(bw["put_d2h_GBps"], bw["put_h2d_GBps"], bw["read_GBps"]) > 0
    assert bw["tier_move_out_GBps"]["median"] > 0 and bw["tier_move_in_GBps"]["median"] > 0
    assert "step/bound" in stdout and "bf16" in stdout


def _check_capacity(rows):
    """benchmarks/capacity.py's quick run: it really allocated and filled each layout's
    cache within the budget (3 MiB)."""
    by = {r["layout"]: r for r in rows}
    assert len(rows) == 5
    for r in rows:
        assert r["sequences"] == r["predicted_sequences"], r
        assert r["pool_bytes"] <= 3 * 2**20
    assert by["paged int2"]["tokens_vs_paged_bf16"] >= 4.5
    assert by["paged bf16"]["sequences"] >= 2 * by["contiguous bf16"]["sequences"]
    assert by["paged int4"]["sequences"] > by["paged bf16"]["sequences"]


_CHECKS = {"roofline": _check_roofline, "paging": _check_paging, "pool": _check_pool,
           "decode": _check_decode, "e2e": _check_e2e, "kvbits": _check_kvbits,
           "dsa": _check_dsa, "serving": _check_serving,
           "capacity": _check_capacity_section}


def test_a_merged_run_of_another_machine_leaves_the_readme_summary(tmp_path):
    """`--only S --merge` on a machine kind the README does not summarise rewrites only
    that kind's docs block (a one-section run once replaced the README's whole table)."""
    import shutil

    from benchmarks import report

    results = ROOT / "benchmarks" / "results"
    kinds = sorted(p.name for p in results.iterdir() if (p / "run.json").exists())
    readme_text = (ROOT / "README.md").read_text()
    cited = [k for k in kinds if f"benchmarks/results/{k}/run.json" in readme_text]
    others = [k for k in kinds if k not in cited]
    assert cited and others, f"needs the summarised kind and another one; have {kinds}"
    for rel in ("README.md", "docs/performance.md",
                *(f"benchmarks/results/{k}/run.json" for k in kinds)):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    readme = tmp_path / "README.md"
    before = readme.read_text()
    written = report.update_docs(tmp_path / "benchmarks" / "results" / others[0], tmp_path,
                                 merged=True)
    assert readme not in written and readme.read_text() == before
    assert f"<!-- benchmarks:{others[0]} -->" in (tmp_path / "docs/performance.md").read_text()
    # A full run of that kind takes the README over.
    written = report.update_docs(tmp_path / "benchmarks" / "results" / others[0], tmp_path)
    assert readme in written and f"results/{others[0]}/run.json" in readme.read_text()
