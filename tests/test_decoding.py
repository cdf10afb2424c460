"""kvjax.decoding: the cache decoder reproduces the dense forward on a float32 paged cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.decoding import CacheConfig, CacheDecoder, kv_bytes_per_token
from kvjax.models.tiny import forward_dense, init_tiny, tiny_model
from tests.test_train import SMALL


@pytest.mark.parametrize("name", ["llama", "mla"])
def test_f32_paged_decode_matches_dense_forward(name, rng):
    config = SMALL[name]
    params = init_tiny(config, jax.random.key(int(rng.integers(1 << 30))))
    tokens = rng.integers(0, 256, (2, 40)).astype(np.int32)
    ref = np.asarray(forward_dense(params, config, jnp.asarray(tokens)))
    dec = CacheDecoder(tiny_model(config), params, CacheConfig(name="f32", dtype="float32"),
                       batch=2, max_len=48, page_size=16)
    # Ragged prefill (row 1 padded) then decode steps feeding the true tokens.
    lengths = np.array([33, 30])
    padded = tokens[:, :33].copy()
    padded[1, 30:] = 0
    got = [np.asarray(dec.prefill(padded, lengths))]
    want = [ref[[0, 1], lengths - 1]]
    pos = lengths.copy()
    for _ in range(3):
        got.append(np.asarray(dec.step(tokens[[0, 1], pos])))
        want.append(ref[[0, 1], pos])
        pos += 1
    # float32 end to end: paged vs dense differ only in summation order.
    np.testing.assert_allclose(np.stack(got), np.stack(want), rtol=1e-4, atol=1e-4)


def test_bytes_per_token_accounting():
    model = tiny_model(SMALL["llama"])  # 1 layer, 1 KV head of 16: 32 elements per token
    bf16 = kv_bytes_per_token(model, CacheConfig(name="bf16"), 256)
    assert bf16["held"] == 64 and bf16["read"] == 64
    # int4, G=16: 0.5 B + 4 B per 16 elements; R=0 and 256 tokens: all quantized.
    q = kv_bytes_per_token(model, CacheConfig(name="q", bits=4, group_size=16, residual=0), 256)
    assert q["held"] == pytest.approx(32 * (0.5 + 4 / 16))
    half = kv_bytes_per_token(model, CacheConfig(name="e"), 256, kept_tokens=128)
    assert half["held"] == 32
