"""Quest: page bounds, selection by hand, upper-bound property, all pages == dense."""

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.attention import paged_decode_attention
from kvjax.cache import init_cache, paged
from kvjax.cache.policies import NoPolicy, selected_decode_attention
from kvjax.cache.policies.quest import Quest, quest_page_bounds
from kvjax.cache.policies.toy import dense_kv, init_toy, random_filled_cache, toy_generate
from kvjax.specs import AttentionSpec, CacheSpec


def _prefill_state(policy, cache):
    state = policy.init_state(cache)
    _, state, _ = policy.after_prefill(cache, state, None, cache.lengths)
    return state


def test_hand_example():
    spec = CacheSpec(attention=AttentionSpec(q_heads=1, kv_heads=1, head_dim=2), num_layers=1,
                     page_size=2, num_pages=8, max_seqs=1, max_pages_per_seq=6)
    keys = np.array([[1, 0], [0, 1],      # page 0: min [0, 0],    max [1, 1]
                     [-2, 1], [3, -1],    # page 1: min [-2, -1],  max [3, 1]
                     [0.5, 0.5], [0, 2],  # page 2: min [0, 0.5],  max [0.5, 2]
                     [5, 5]], np.float32)  # page 3 (current, 1 token)
    vals = np.arange(14, dtype=np.float32).reshape(7, 1, 2)
    cache = init_cache(spec)
    cache, _ = paged.reserve(cache, jnp.asarray([7]))
    slots = paged.token_slots(cache, jnp.arange(7)[None], jnp.ones((1, 7), bool))
    cache = paged.write_layer(cache, 0, slots, jnp.asarray(keys[None, :, None]),
                              jnp.asarray(vals[None]))
    q = jnp.asarray([[[1.0, -1.0]]])
    policy = Quest(top_k=2, dense_layers=0)
    state = _prefill_state(policy, cache)
    bt = np.asarray(cache.block_tables)[0]
    kmin = state.kmin[0][:, jnp.asarray(bt[:4])][None]
    kmax = state.kmax[0][:, jnp.asarray(bt[:4])][None]
    # U = sum_i max(q_i M_i, q_i m_i): page0 1 + 0, page1 3 + 1, page2 0.5 - 0.5, page3 5 - 5.
    np.testing.assert_array_equal(quest_page_bounds(q, kmin, kmax)[0, 0], [1, 4, 0, 0])
    sel = policy.before_attention(cache, state, 0, q)
    assert np.asarray(sel.block_tables)[0, 0].tolist() == [bt[1], bt[3]]  # best page, current
    assert np.asarray(sel.lengths).tolist() == [[3]]  # 2 tokens of page 1 + 1 of page 3
    out, _ = selected_decode_attention(q, cache.pages.k[0], cache.pages.v[0], sel)
    logits = keys[[2, 3, 6]] @ np.array([1.0, -1.0]) / np.sqrt(2)
    p = np.exp(logits - logits.max())
    p /= p.sum()
    np.testing.assert_allclose(out[0, 0], p @ vals[[2, 3, 6], 0], rtol=1e-6)
    sel3 = Quest(top_k=3, dense_layers=0).before_attention(cache, state, 0, q)
    assert np.asarray(sel3.block_tables)[0, 0].tolist() == [bt[1], bt[0], bt[3]]
    assert np.asarray(sel3.lengths).tolist() == [[5]]


SPEC = CacheSpec(attention=AttentionSpec(q_heads=6, kv_heads=2, head_dim=16), num_layers=2,
                 page_size=4, num_pages=48, max_seqs=3, max_pages_per_seq=8)


def test_bound_is_an_upper_bound_exactly(rng):
    # Integer-valued keys and queries: every product and sum is exact in float32, so the
    # inequality is checked exactly, not up to rounding.
    lengths = rng.integers(1, SPEC.max_tokens_per_seq + 1, SPEC.max_seqs)
    cache, k, _ = random_filled_cache(SPEC, lengths, rng)
    k = np.round(k * 4)
    cache = _rewrite_keys(cache, k)
    policy = Quest(top_k=3, dense_layers=0)
    state = _prefill_state(policy, cache)
    q = np.round(rng.standard_normal((SPEC.max_seqs, 6, 16)) * 4).astype(np.float32)
    bt = np.asarray(cache.block_tables)
    ps = SPEC.page_size
    for layer in range(2):
        safe = jnp.asarray(np.clip(bt, 0, None))
        kmin = jnp.swapaxes(state.kmin[layer][:, safe], 0, 1)
        kmax = jnp.swapaxes(state.kmax[layer][:, safe], 0, 1)
        bound = np.asarray(quest_page_bounds(jnp.asarray(q), kmin, kmax))
        for s, n in enumerate(lengths):
            for c in range(-(-n // ps)):
                toks = np.arange(c * ps, min(n, (c + 1) * ps))
                for h in range(6):
                    true = (k[layer, s, h // 3][toks] @ q[s, h]).max()
                    assert bound[s, h, c] >= true, (layer, s, c, h)
                    if len(toks) == 1:
                        assert bound[s, h, c] == true


def _rewrite_keys(cache, k):
    spec = cache.spec
    t = spec.max_tokens_per_seq
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (spec.max_seqs, t))
    slots = paged.token_slots(cache, pos, pos < cache.lengths[:, None])
    _, v = dense_kv(cache)
    for layer in range(spec.num_layers):
        cache = paged.write_layer(cache, layer, slots,
                                  jnp.asarray(k[layer].transpose(0, 2, 1, 3), jnp.float32),
                                  jnp.asarray(v[layer].transpose(0, 2, 1, 3), jnp.float32))
    return cache


def test_all_pages_equals_dense(rng):
    # Sequences hold at most 5 pages; top_k=5 selects all of them, in score order.
    lengths = np.array([20, 13, 1])
    cache, _, _ = random_filled_cache(SPEC, lengths, rng)
    policy = Quest(top_k=5, dense_layers=0)
    state = _prefill_state(policy, cache)
    q = jnp.asarray(rng.standard_normal((3, 6, 16)), jnp.float32)
    for layer in (1, jnp.int32(1)):  # static layer: 5-wide table; traced: max_pages wide
        sel = jax.jit(policy.before_attention)(cache, state, layer, q) if not isinstance(
            layer, int) else policy.before_attention(cache, state, layer, q)
        view = paged.layer_view(cache, 1)
        got, got_lse = selected_decode_attention(q, view.k, view.v, sel)
        want, want_lse = paged_decode_attention(q, view.k, view.v, view.lengths,
                                                view.block_tables)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got_lse, want_lse, rtol=1e-5, atol=1e-6)
    # Fewer pages than a sequence holds: not dense any more (the selection matters).
    sel = Quest(top_k=2, dense_layers=0).before_attention(cache, state, 1, q)
    assert np.asarray(sel.lengths)[0].tolist() == [4 + 4] * 2
    got, _ = selected_decode_attention(q, view.k, view.v, sel)
    assert np.abs(np.asarray(got - want))[0].max() > 1e-4


def test_summaries_track_decode_and_all_pages_decode_like_dense(rng):
    toy = CacheSpec(attention=AttentionSpec(q_heads=4, kv_heads=2, head_dim=16), num_layers=2,
                    page_size=4, num_pages=40, max_seqs=2, max_pages_per_seq=16)
    params = init_toy(toy, seed=int(rng.integers(1 << 30)))
    prompts = rng.integers(0, 64, (2, 6))
    policy = Quest(top_k=8, dense_layers=1)  # 6 + 24 tokens fit in 8 pages: reads everything

    def check(i, cache, state):
        dk, _ = dense_kv(cache)
        bt, lengths = np.asarray(cache.block_tables), np.asarray(cache.lengths)
        for s in range(2):
            for c in range(-(-lengths[s] // 4)):
                page_k = dk[:, s, :, c * 4:min(lengths[s], c * 4 + 4)]
                np.testing.assert_array_equal(state.kmin[:, :, bt[s, c]], page_k.min(axis=2))
                np.testing.assert_array_equal(state.kmax[:, :, bt[s, c]], page_k.max(axis=2))

    t0, l0, _ = toy_generate(params, init_cache(toy), NoPolicy(), prompts, 24)
    t1, l1, _ = toy_generate(params, init_cache(toy), policy, prompts, 24, on_step=check)
    np.testing.assert_array_equal(t1, t0)
    np.testing.assert_allclose(l1, l0, rtol=1e-5, atol=1e-5)
