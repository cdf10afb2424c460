"""The shipped tiny models (kvjax/assets) and the demo / eval command lines."""

import json
import os
import subprocess
import sys

import pytest

from kvjax.models import tiny
from kvjax.train import reference_continuation

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("name", ["gqa", "mla"])
def test_shipped_weights_reproduce_the_stored_greedy_continuation(name):
    info = tiny.tiny_info(name)
    model, params = tiny.load_tiny(name)
    assert tiny.param_count(params) == info["params"]
    # Stored at training time from the same float16 weights through kvjax.generate.
    got = reference_continuation(model, params, info["reference_prompt"],
                                 len(info["reference_continuation"]))
    assert got == info["reference_continuation"]


def _run(*args, timeout=600):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "kvjax", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, check=True).stdout


def test_demo_runs():
    out = _run("demo", "--max-new-tokens", "4", "--models", "gqa")
    for label in ("bf16", "KIVI int4", "KIVI int2", "StreamingLLM", "agree", "tok/s"):
        assert label in out, out


def test_eval_quick_runs(tmp_path):
    _run("eval", "--quick", "--models", "gqa", "--configs", "bf16,=KIVI-2,^H2O",
         "--out", str(tmp_path))
    with open(tmp_path / "eval.json") as f:
        result = json.load(f)
    names = [r["config"] for r in result["rows"]]
    assert names == ["bf16", "KIVI-2", "H2O 50%"]
    bf16, kivi2, h2o = result["rows"]
    assert bf16["ppl_change_pct"] == 0
    # The quick context (72 tokens) is shorter than KIVI's R=128 full-precision tail, so
    # nothing is quantized yet; H2O at 50% holds half the context.
    assert kivi2["bytes_held"] == bf16["bytes_held"]
    assert h2o["bytes_held"] == pytest.approx(bf16["bytes_held"] / 2, rel=0.05)
    for r in result["rows"]:
        assert r["ppl"] > 1 and 0 <= r["retrieval_mean"] <= 1
        # Asked the way the shipped model was trained to answer.
        assert r["retrieval_query"] == tiny.tiny_info("gqa").get("retrieval_query", "assert")
