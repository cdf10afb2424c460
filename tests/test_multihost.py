"""Multi-host decoding, executed: two processes joined by `jax.distributed` decode as one.

`scripts/multihost_decode.py --launch-local 2` starts 2 processes x 4 CPU
devices on this machine, coordinated over localhost with gloo collectives; the
mesh puts `data` across the processes and `model` x `context` within each, so
every strategy (sequences, heads, context) crosses devices and `data` crosses
processes. Its greedy tokens must equal a single-process, single-device run of
the same model and prompts, made here.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "multihost_decode.py"


def _script():
    spec = importlib.util.spec_from_file_location("multihost_decode", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_two_processes_decode_the_tokens_of_one(rng, child_env):
    import kvjax as kvx
    from kvjax.backends import cpu

    cpu.available()  # build the CPU kernels here once, so the two processes only load them
    lengths = rng.integers(1, 21, size=4)
    lengths[0] = 20  # one prompt spans two pages: the context axis splits it
    prompts = [rng.integers(0, 128, size=n).tolist() for n in lengths]
    new_tokens = 6
    env = dict(child_env, PYTHONPATH=str(ROOT))  # the script sets its own 4 devices
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--launch-local", "2", "--context", "2",
         "--prompts", ";".join(",".join(map(str, p)) for p in prompts),
         "--max-new-tokens", str(new_tokens)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "2 processes x 4 devices, mesh {'data': 2, 'model': 2, 'context': 2}" in out, out
    line = next(s for s in proc.stdout.splitlines() if s.startswith("tokens: "))
    tokens = np.asarray(json.loads(line.removeprefix("tokens: ")))
    assert tokens.shape == (len(prompts), new_tokens)

    mh = _script()
    model, params = mh.tiny_model()
    spec = mh.cache_spec(model, prompts, max_new_tokens=new_tokens, page_size=16, num_pages=32,
                         max_seqs=len(prompts))
    ref = mh.greedy_tokens(model, params, kvx.init_cache(spec), prompts,
                           max_new_tokens=new_tokens, impl="auto")
    np.testing.assert_array_equal(tokens, np.asarray(ref.tokens))
