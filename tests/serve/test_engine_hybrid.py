"""The serving engine on a hybrid model (Qwen3-Next: linear-attention state per slot):
rows that join mid-decode and preemption give each request the tokens of `generate` on it
alone; prefix caching is off (the cache keeps a slot's state only at its end)."""

import numpy as np
import pytest

import kvjax.models as models
from kvjax.generate import CacheConfig
from kvjax.serve import Engine
from tests.models import hf_tiny
from tests.serve.engine_helpers import CHUNK, PAGE, _alone, _drive, _workload


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    m = hf_tiny.build("qwen3_next_dense", seed=int(np.random.default_rng().integers(1 << 20)))
    d = tmp_path_factory.mktemp("qwen3_next_dense")
    m.save_pretrained(d)
    return models.load(str(d))


@pytest.mark.heavy
def test_hybrid_requests_equal_generate_alone_under_preemption(hybrid):
    model, params = hybrid
    rng = np.random.default_rng()
    prompts, max_new = _workload(rng, model.vocab_size, 6)
    cfg = CacheConfig(page_size=PAGE, num_pages=14)
    engine = Engine(model, params, max_seqs=3, max_seq_len=96, cache=cfg, chunk_size=CHUNK,
                    prefill_rows=1)
    assert engine.prefix is None
    got, _ = _drive(engine, prompts, max_new)
    want = [_alone(model, params, p, m, CacheConfig(page_size=PAGE))
            for p, m in zip(prompts, max_new, strict=True)]
    assert got == want
    assert engine.stats["preemptions"] > 0


def test_hybrid_refuses_a_host_tier(hybrid):
    model, params = hybrid
    with pytest.raises(ValueError, match="hybrid model's cache"):
        Engine(model, params, max_seqs=2, max_seq_len=64, host_pages=8,
               cache=CacheConfig(page_size=PAGE))
