"""`forward(..., logits_at=idx)`: logits at the named tokens only, equal to the full forward's.

Both families (Llama with tied and untied LM heads, stacked and per-layer weights;
DeepSeek MLA), indices drawn fresh per test, concrete and traced; the prefill that
uses it (only each row's last prompt token through the LM head) against the prefill
that returns every logit, with and without a cache policy; and the errors at the
boundary.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax.cache as kv_cache
import kvjax.generate as gen
from kvjax.cache.policies import StreamingLLM
from kvjax.models import llama, tiny
from kvjax.models.base import gather_positions

PAGE = 8
# float32 throughout; the gathered rows go through the same norm and head as the full
# forward's, so they agree to rounding (different matmul shapes may sum differently).
ATOL = 1e-5


def _model(name, untied=False):
    config = tiny.tiny_config(name)
    if untied:
        config = dataclasses.replace(config, tie_word_embeddings=False)
    model = tiny.tiny_model(config)
    params = tiny.init_tiny(config, jax.random.key(1))
    return model, params


def _prompt_cache(model, rng, batch, q_len):
    """A cache with `q_len` slots reserved per row, random tokens and row lengths."""
    spec = gen.CacheConfig(page_size=PAGE).spec(model, num_seqs=batch, max_tokens=q_len)
    cache = kv_cache.init_cache(spec)
    q_lengths = rng.integers(1, q_len + 1, batch).astype(np.int32)
    cache, st = kv_cache.reserve(cache, q_lengths)
    st.raise_if_error()
    tokens = rng.integers(0, model.vocab_size, (batch, q_len)).astype(np.int32)
    positions = np.broadcast_to(np.arange(q_len, dtype=np.int32), (batch, q_len))
    return cache, *jax.device_put((tokens, positions, q_lengths))


@pytest.mark.parametrize("name,untied,unstack", [("gqa", False, False), ("gqa", True, False),
                                                 ("gqa", True, True), ("mla", False, False)])
def test_logits_at_equals_full_forward(name, untied, unstack, rng):
    model, params = _model(name, untied)
    if unstack:
        params = model.unstack_layers(params)
    batch, q_len, k = 3, 13, 2
    cache, tokens, positions, q_lengths = _prompt_cache(model, rng, batch, q_len)
    idx = rng.integers(0, q_len, (batch, k)).astype(np.int32)

    # One program per case: the full forward, concrete indices (a constant of the trace:
    # the forward sees them as values, as an eager call would) and traced indices (what
    # prefill passes), the latter with the policy hook's observe=True too.
    @jax.jit
    def fwd(p, c, i):
        def apply(**kw):
            return model.apply(p, tokens, positions, c, q_lengths=q_lengths, **kw)
        return apply()[0], apply(logits_at=idx)[0], apply(logits_at=i, observe=True)

    full, some, (jitted, _, queries) = fwd(params, cache, jax.device_put(idx))
    assert some.shape == (batch, k, model.vocab_size) and some.dtype == jnp.float32
    want = np.take_along_axis(np.asarray(full), idx[:, :, None], axis=1)
    np.testing.assert_allclose(np.asarray(some), want, rtol=0, atol=ATOL)
    np.testing.assert_allclose(np.asarray(jitted), want, rtol=0, atol=ATOL)
    assert queries.shape[:3] == (model.config.num_layers, batch, q_len)


def test_logits_at_errors(rng):
    model, params = _model("gqa")
    cache, tokens, positions, q_lengths = _prompt_cache(model, rng, 2, 8)
    run = jax.tree_util.Partial(model.apply, params, tokens, positions, cache,
                                q_lengths=q_lengths)
    with pytest.raises(ValueError, match=r"logits_at must be \[batch=2"):
        run(logits_at=jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match=r"logits_at must be \[batch=2"):
        run(logits_at=jnp.zeros((3, 1), jnp.int32))
    with pytest.raises(TypeError, match="logits_at must be integer"):
        run(logits_at=jnp.zeros((2, 1), jnp.float32))
    with pytest.raises(ValueError, match=r"must lie in \[0, q_len=8\)"):
        run(logits_at=jnp.array([[0], [8]], jnp.int32))
    with pytest.raises(ValueError, match=r"must lie in \[0, q_len=8\)"):
        run(logits_at=jnp.array([[-1], [2]], jnp.int32))


def test_gather_positions_traced_out_of_range_is_nan(rng):
    x = jnp.asarray(rng.standard_normal((2, 5, 3)), jnp.float32)
    idx = jnp.array([[4, 0], [5, -1]], jnp.int32)
    got = np.asarray(jax.jit(gather_positions)(x, idx))
    np.testing.assert_array_equal(got[0], np.asarray(x)[0, [4, 0]])
    assert np.isnan(got[1]).all()


@pytest.mark.parametrize("name", ["gqa", "mla"])
@pytest.mark.parametrize("with_policy", [False, True])
def test_prefill_last_logits_without_all_logits(name, with_policy, rng):
    """prefill's last-token logits (LM head on one row per sequence per chunk) equal the
    prefill that computes every logit; prompt ends in every chunk, and on chunk borders."""
    model, params = _model(name)
    chunk, width = 8, 32
    lengths = np.array([1, 8, 9, rng.integers(10, 24), 32], np.int32)
    tokens = rng.integers(0, model.vocab_size, (len(lengths), width)).astype(np.int32)
    spec = gen.CacheConfig(page_size=PAGE).spec(model, num_seqs=len(lengths), max_tokens=width)
    ids = jax.device_put(np.arange(len(lengths), dtype=np.int32))
    policy = StreamingLLM(n_sink=2, window=12) if with_policy else None

    def run(return_logits):
        cache = kv_cache.init_cache(spec)
        pstate = None if policy is None else policy.init_state(cache)
        cache, last, st, logits, _ = gen.prefill(
            model, params, cache, *jax.device_put((tokens, lengths)), ids,
            chunk_size=chunk, return_logits=return_logits, policy=policy, policy_state=pstate)
        st.raise_if_error()
        return np.asarray(last), logits, np.asarray(cache.lengths)

    last, none, n1 = run(False)
    last_all, logits, n2 = run(True)
    assert none is None
    np.testing.assert_array_equal(n1, n2)
    np.testing.assert_allclose(last, last_all, rtol=0, atol=ATOL)
    at_end = np.asarray(logits)[np.arange(len(lengths)), lengths - 1]
    np.testing.assert_allclose(last, at_end, rtol=0, atol=ATOL)


def test_score_matches_dense_forward(rng):
    """score's first log-prob comes from prefill's last-token logits, the rest from decode
    steps: all equal the cache-free forward's log-probs over prompt + continuation."""
    model, params = _model("gqa", untied=True)
    prompts = [rng.integers(0, model.vocab_size, n).tolist() for n in (5, 19)]
    conts = [rng.integers(0, model.vocab_size, 4).tolist() for _ in prompts]
    res = gen.score(model, params, prompts, conts, chunk_size=8)
    # Both sequences in one causal forward, the shorter right-padded: a position's logits
    # see only the tokens before it, so the padding changes none that are read.
    seqs = np.zeros((2, max(len(p) + len(c) for p, c in zip(prompts, conts, strict=True))),
                    np.int32)
    for b, (p, c) in enumerate(zip(prompts, conts, strict=True)):
        seqs[b, :len(p) + len(c)] = p + c
    logps = np.asarray(jax.jit(lambda p, s: jax.nn.log_softmax(
        llama.forward_dense(p, model.config, s), axis=-1))(params, seqs))
    for b, (p, c) in enumerate(zip(prompts, conts, strict=True)):
        want = logps[b, np.arange(len(p) - 1, len(p) + len(c) - 1), c]
        np.testing.assert_allclose(res.logprobs[b, : len(c)], want, rtol=0, atol=1e-4)
