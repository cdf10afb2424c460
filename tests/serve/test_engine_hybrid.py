"""The serving engine on a hybrid model (Qwen3-Next: linear-attention state per slot):
rows that join mid-decode and preemption give each request the tokens of `generate` on it
alone; prefix caching is off (the cache keeps a slot's state only at its end)."""

import numpy as np
import pytest

import kvjax.models as models
from kvjax.generate import CacheConfig
from kvjax.serve import Engine
from tests.models import hf_tiny
from tests.serve.engine_helpers import CHUNK, PAGE, _alone, _drive, drawn_seed


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """(model, params, seed): a tiny random Qwen3-Next from a printed seed, which also draws
    the tests' prompts (KVJAX_TEST_SEED replays both)."""
    seed = drawn_seed()
    m = hf_tiny.build("qwen3_next_dense", seed=seed % (1 << 20))
    d = tmp_path_factory.mktemp("qwen3_next_dense")
    m.save_pretrained(d)
    return (*models.load(str(d)), seed)


def test_hybrid_requests_equal_generate_alone_under_preemption(hybrid):
    """Three prompts of 64 tokens (8 pages) arrive at once on a pool of 14 pages, three more
    (49 to 64 tokens) join one every two steps: the first two alone need 16 pages, so a
    prefilling request is preempted (and its recompute, with the linear layers' state
    rebuilt, must give the same tokens)."""
    model, params, seed = hybrid
    print(f"test seed: KVJAX_TEST_SEED={seed}")
    rng = np.random.default_rng(seed)
    lengths = [64, 64, 64] + rng.integers(49, 65, 3).tolist()  # one reference program
    prompts = [rng.integers(3, model.vocab_size, n).tolist() for n in lengths]
    max_new = rng.integers(8, 17, len(prompts)).tolist()
    cfg = CacheConfig(page_size=PAGE, num_pages=14)
    engine = Engine(model, params, max_seqs=3, max_seq_len=80, cache=cfg, chunk_size=CHUNK,
                    prefill_rows=1)
    assert engine.prefix is None
    got, reasons = _drive(engine, prompts, max_new, first=3)
    assert engine.stats["preemptions"] > 0, engine.stats
    assert reasons == ["length"] * len(prompts)
    want = [_alone(model, params, p, m, CacheConfig(page_size=PAGE))
            for p, m in zip(prompts, max_new, strict=True)]
    assert got == want


def test_hybrid_refuses_a_host_tier(hybrid):
    model, params, _ = hybrid
    with pytest.raises(ValueError, match="hybrid model's cache"):
        Engine(model, params, max_seqs=2, max_seq_len=64, host_pages=8,
               cache=CacheConfig(page_size=PAGE))
