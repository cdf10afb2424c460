"""benchmarks/offload.py: the GPU preset's toy-size run, the GPU plan, a broken tier failing.

The script checks its own results (greedy tokens with host-resident pages equal the
all-device run's; the bf16 tier's bytes equal `kvjax.memory.host_tier_bytes`) and exits
non-zero otherwise; these tests check that it ran, what it wrote, and that the H200
preset resolves its sizes without allocating. Nothing about speed is asserted. The CPU
quick run is checked in tests/test_benchmarks_quick.py (`python -m benchmarks --quick`).
"""

import json
import sys
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import offload  # noqa: E402


def _run(args, tmp_path, capsys):
    """Runs the script's main in this process; returns its JSON and what it printed."""
    out = tmp_path / "offload.json"
    code = offload.main([*args, "--json", str(out)])
    stdout = capsys.readouterr().out
    assert code == 0, stdout[-4000:]
    return json.loads(out.read_text()), stdout


def test_gpu_preset_at_toy_size_runs_on_cpu(tmp_path, capsys):
    # --probe-mib 4: the bandwidth probes (64 MiB at --quick) only feed the step / bound
    # figures, which nothing here asserts on.
    d, stdout = _run(["--gpu", "--quick", "--seed", "4", "--probe-mib", "4"], tmp_path, capsys)
    assert d["ok"] and d["run"]["preset"] == "gpu_quick" and d["run"]["caches"] == ["bf16"]
    # The context is twice the device budget of bf16 KV over the batch: at 50% each tier
    # holds the budget.
    half = next(r for r in d["rows"] if r["host_fraction"] == 0.5)
    assert half["host_kv_bytes"] == d["run"]["budget_bytes"]
    assert half["device_kv_bytes"] == d["run"]["budget_bytes"]
    assert "device budget" in stdout and ("within 1.3x" in stdout)


def test_dropping_the_host_pages_fails_the_run(monkeypatch, tmp_path):
    """A host tier whose pages never reach attention decodes other tokens, far from a tie."""
    from kvjax.cache import host

    out = tmp_path / "broken.json"
    # The step programs this process traced with the real merge (the GPU preset's run) are
    # dropped before and after, so neither the broken run nor a later test reuses the other's.
    with monkeypatch.context() as m:
        m.setattr(host, "merge", lambda dev, from_host: dev)
        jax.clear_caches()
        try:
            assert offload.main(["--quick", "--caches", "bf16", "--fractions", "0,0.5",
                                 "--seed", "5", "--probe-mib", "4", "--json", str(out)]) == 1
        finally:
            jax.clear_caches()
    d = json.loads(out.read_text())
    assert not d["ok"] and d["failures"]
    broken = [t for t in d["trials"] if t["host_pages"]]
    assert broken and all(not t["near_tie"]["tie"] and t["near_tie"]["max_logprob_diff_nats"]
                          > 100 * offload.TIE_NATS for t in broken)


def test_gpu_plan_resolves_llama3_8b_shapes_without_allocating(capsys):
    before = len(jax.live_arrays())
    assert offload.main(["--gpu", "--plan"]) == 0
    assert len(jax.live_arrays()) == before
    text = capsys.readouterr().out
    assert "32 layers, 32/8 heads x 128" in text and "batch 8 x 32768 tokens" in text
    _, run = offload.parse(["--gpu"])
    pl = offload.plan(run)
    bf16 = pl["caches"]["bf16"]
    # 32 layers x 2 x 8 heads x 128 x 2 bytes = 128 KiB per token; 2 x 16 GiB of context.
    assert run.batch * run.context * 128 * 1024 == 2 * 16 * 2**30
    assert bf16["shares"]["1/2"]["host_pool_bytes"] == 16 * 2**30
    assert pl["params"] > 8.0e9


def test_bad_flags_are_refused():
    for argv in (["--fractions", "0,1"], ["--caches", "fp8"], ["--batch", "0"],
                 ["--page-size", "48"], ["--context", "16"]):
        with pytest.raises(SystemExit) as e:
            offload.parse(argv)
        assert e.value.code == 2, argv
