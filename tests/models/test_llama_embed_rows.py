"""The embedding lookup of a model step reads rows of the table as stored."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax as kvx
from kvjax.backends import cpu as cpu_kernels
from kvjax.models import llama
from kvjax.models.layers import embed_rows
from kvjax.rope import RopeConfig

VOCAB, HIDDEN = 3000, 64


def test_embed_rows_are_the_table_rows(rng, monkeypatch):
    """The rows jnp indexing takes (the custom call for 16-bit tables on one CPU device),
    negative indices from the end and those past the table clamped."""
    monkeypatch.setattr(jax, "device_count", lambda backend=None: 1)
    table = jnp.asarray(rng.standard_normal((50, 8)), jnp.bfloat16)
    tokens = rng.integers(0, 50, (3, 4)).astype(np.int32)
    tokens[0, :2] = -3, 57
    for t in (table, table.astype(jnp.float16), table.astype(jnp.float32)):
        got = jax.jit(embed_rows)(t, jnp.asarray(tokens))
        assert got.dtype == t.dtype and got.shape == (3, 4, 8)
        want = np.asarray(t, np.float32)[np.clip(np.where(tokens < 0, tokens + 50, tokens),
                                                 0, 49)]
        np.testing.assert_array_equal(np.asarray(got, np.float32), want)


@pytest.mark.cpu_kernels
def test_decode_steps_gather_embedding_rows_without_converting_the_table(monkeypatch):
    """bfloat16 weights, steps in a loop (as the decode loop runs them): XLA:CPU gathers
    bfloat16 in float32, converts the whole [vocab, hidden] table for it and hoists that
    out of the loop, writing a float32 copy of the table on every call (65 MB at
    32000 x 512). The LM head is untied (a tied one contracts with the table itself). On
    one device (the tests see 8, over which the custom call would not partition)."""
    monkeypatch.setattr(jax, "device_count", lambda backend=None: 1)
    config = llama.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64,
                               num_layers=1, q_heads=2, kv_heads=1, head_dim=32,
                               rope=RopeConfig(theta=10000.0, dim=32), dtype="bfloat16")
    params = jax.eval_shape(lambda: llama.init_params(config, jax.random.key(0)))
    assert params.embed.dtype == jnp.bfloat16 and params.lm_head is not None
    spec = kvx.CacheSpec(attention=kvx.AttentionSpec(q_heads=2, kv_heads=1, head_dim=32),
                         num_layers=1, page_size=8, num_pages=16, max_seqs=4,
                         max_pages_per_seq=4, dtype="bfloat16")
    cache = jax.eval_shape(lambda: kvx.cache.init_cache(spec))
    tok = jax.ShapeDtypeStruct((4, 1), jnp.int32)

    def steps(params, tokens, cache):
        def body(i, carry):
            tokens, cache = carry
            logits, cache = llama.forward(params, config, tokens, tokens + i, cache,
                                          q_lengths=jnp.ones((4,), jnp.int32))
            return jnp.argmax(logits, -1).astype(jnp.int32), cache
        return jax.lax.fori_loop(0, 3, body, (tokens, cache))

    text = jax.jit(steps).lower(params, tok, cache).compile().as_text()
    assert cpu_kernels.choose("take_rows", dtype=jnp.bfloat16).use_kernel
    assert "kvjax_take_rows" in text
    assert re.search(rf"bf16\[{VOCAB},{HIDDEN}\]", text)  # the table itself is read
    assert not re.search(rf"f32\[{VOCAB},{HIDDEN}\]", text)
