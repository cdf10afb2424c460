"""kvjax.decoding with a policy on a KIVI cache (KIVIQuest, KIVIH2O): wiring and accounting."""

import jax
import numpy as np
import pytest

from kvjax.cache import check_invariants
from kvjax.cache.policies import KIVIH2O, KIVIQuest
from kvjax.decoding import CacheConfig, CacheDecoder, kv_bytes_per_token
from kvjax.models.tiny import init_tiny, tiny_model
from tests.test_train import SMALL

KIVI = dict(dtype="float32", bits=4, group_size=16, residual=16)


def _run(params, cc, tokens, steps):
    dec = CacheDecoder(tiny_model(SMALL["llama"]), params, cc, batch=2, max_len=64,
                       page_size=16)
    logits = [np.asarray(dec.prefill(tokens[:, :40]))]
    held = [dec.cached_tokens()]
    for i in range(steps):
        logits.append(np.asarray(dec.step(tokens[:, 40 + i])))
        held.append(dec.cached_tokens())
        check_invariants(dec.cache.table)
    return np.stack(logits), np.stack(held), dec


def test_decoder_runs_quest_and_h2o_on_a_kivi_cache(rng):
    params = init_tiny(SMALL["llama"], jax.random.key(int(rng.integers(1 << 30))))
    tokens = rng.integers(0, 256, (2, 48)).astype(np.int32)
    # 40..46 tokens with R = 16 and 16-token pages: 1 quantized page, so top_k = 1 reads all:
    # the same attention as without a policy.
    cc = CacheConfig(name="q", policy=KIVIQuest(top_k=1, dense_layers=0), **KIVI)
    quest, quest_held, _ = _run(params, cc, tokens, 6)
    np.testing.assert_array_equal(quest_held, 40 + np.arange(7)[:, None] + np.zeros((1, 2)))
    # H2O holds 40 - 16 = 24 quantized tokens at most: one 16-token page. Its prefill and
    # first step attend before any eviction, so they match Quest's (= no policy) exactly
    # up to f32 summation order.
    cc = CacheConfig(name="h", policy=KIVIH2O(budget=40), **KIVI)
    h2o, h2o_held, dec = _run(params, cc, tokens, 6)
    np.testing.assert_array_equal(h2o[0], quest[0])
    np.testing.assert_allclose(h2o[1], quest[1], rtol=1e-5, atol=1e-5)
    assert (h2o_held <= 40).all() and (h2o_held < quest_held).any()
    assert np.isfinite(h2o).all() and np.isfinite(quest).all()
    assert int(dec.cache.num_free_pages) > 0


def test_combo_byte_accounting():
    model = tiny_model(SMALL["llama"])  # 1 layer, 1 KV head of 16: 32 elements per token
    kivi = dict(bits=4, group_size=16, residual=32)
    # 256 tokens at R=32, 32-token pages: 224 quantized (0.5 B + 4 B / 16 per element), 32 f32.
    base = kv_bytes_per_token(model, CacheConfig(name="k", dtype="float32", **kivi), 256)
    per_q, full = 32 * (0.5 + 0.25), 32 * 4
    assert base["held"] == pytest.approx((224 * per_q + 32 * full) / 256)
    # H2O with budget 96: a tail of T in [32, 63] leaves whole pages of 96 - T, i.e. 2 pages
    # at T = 32 and 1 page otherwise; averaged over the 32 tail phases.
    h2o = kv_bytes_per_token(model, CacheConfig(name="h", dtype="float32",
                                                policy=KIVIH2O(budget=96), **kivi), 256,
                             kept_tokens=96)
    want = sum((64 if t == 32 else 32) * per_q + t * full for t in range(32, 64)) / 32
    assert h2o["held"] == h2o["read"] == pytest.approx(want / 256)
    # Quest reads 2 pages + the tail + the key scales and zeros of all 7 quantized pages.
    quest = kv_bytes_per_token(model, CacheConfig(name="q", dtype="float32",
                                                  policy=KIVIQuest(top_k=2, dense_layers=0),
                                                  **kivi), 256)
    assert quest["held"] == base["held"]
    bounds = 224 * 16 * 4 / 16
    assert quest["read"] == pytest.approx((64 * per_q + 32 * full + bounds) / 256)
