"""Quest: page bounds, selection by hand, upper-bound property, all pages == dense.

In the decode loop: test_decode_loop.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as kvc
from kvjax.cache.policies.quest import Quest, quest_page_bounds
from kvjax.specs import AttentionSpec, CacheSpec
from tests.cache.policies.helpers import random_filled_cache, select, write


def _prefill_state(policy, cache, rng):
    """Quest's state after a prefill that wrote every token the cache holds (the queries, a
    random draw, only size the refresh)."""
    spec = cache.spec
    q = rng.standard_normal((spec.num_layers, spec.max_seqs, int(np.max(cache.lengths)),
                             spec.attention.q_heads, spec.attention.head_dim))
    _, state, _ = jax.jit(policy.after_prefill)(cache, policy.init_state(cache),
                                                jax.device_put(q.astype(np.float32)),
                                                cache.lengths)
    return state


# One program per shape (eagerly, each of its operations compiled on its own).
_bounds = jax.jit(quest_page_bounds)


@functools.partial(jax.jit, static_argnames="layer")
def _attend(cache, q, selection, *, layer):
    ones = jnp.ones((q.shape[0],), jnp.int32)
    out, lse = kvc.attend(cache, layer, q[:, None], q_lengths=ones, selection=selection)
    return out[:, 0], lse[:, 0]


def _decode(cache, layer, q, selection=None):
    """Decode attention of q [max_seqs, q_heads, head_dim] over the cache (or a selection)."""
    return tuple(np.asarray(x) for x in _attend(cache, q, selection, layer=layer))


def test_hand_example(rng):
    spec = CacheSpec(attention=AttentionSpec(q_heads=1, kv_heads=1, head_dim=2), num_layers=1,
                     page_size=2, num_pages=8, max_seqs=1, max_pages_per_seq=6)
    keys = np.array([[1, 0], [0, 1],      # page 0: min [0, 0],    max [1, 1]
                     [-2, 1], [3, -1],    # page 1: min [-2, -1],  max [3, 1]
                     [0.5, 0.5], [0, 2],  # page 2: min [0, 0.5],  max [0.5, 2]
                     [5, 5]], np.float32)  # page 3 (current, 1 token)
    vals = rng.standard_normal((7, 1, 2)).astype(np.float32)
    cache, status = kvc.reserve(kvc.init_cache(spec), np.array([7], np.int32))
    status.raise_if_error()
    cache = write(cache, 0, keys[None, :, None], vals[None], np.array([7], np.int32))
    q = jax.device_put(np.array([[[1.0, -1.0]]], np.float32))
    policy = Quest(top_k=2, dense_layers=0)
    state = _prefill_state(policy, cache, rng)
    bt = np.asarray(cache.block_tables)[0]
    kmin = np.asarray(state.kmin[0])[:, bt[:4]][None]
    kmax = np.asarray(state.kmax[0])[:, bt[:4]][None]
    # U = sum_i max(q_i M_i, q_i m_i): page0 1 + 0, page1 3 + 1, page2 0.5 - 0.5, page3 5 - 5.
    np.testing.assert_array_equal(_bounds(q, kmin, kmax)[0, 0], [1, 4, 0, 0])
    sel = select(policy, cache, state, 0, q)
    assert np.asarray(sel.block_tables)[0, 0].tolist() == [bt[1], bt[3]]  # best page, current
    assert np.asarray(sel.lengths).tolist() == [[3]]  # 2 tokens of page 1 + 1 of page 3
    out, _ = _decode(cache, 0, q, sel)
    logits = keys[[2, 3, 6]].astype(np.float64) @ np.array([1.0, -1.0]) / np.sqrt(2)
    p = np.exp(logits - logits.max())
    p /= p.sum()
    # float32 rounding is relative to the terms summed (an output near zero cancels them).
    np.testing.assert_allclose(out[0, 0], p @ vals[[2, 3, 6], 0], rtol=1e-6,
                               atol=1e-6 * np.abs(vals).max())
    sel3 = select(Quest(top_k=3, dense_layers=0), cache, state, 0, q)
    assert np.asarray(sel3.block_tables)[0, 0].tolist() == [bt[1], bt[0], bt[3]]
    assert np.asarray(sel3.lengths).tolist() == [[5]]


SPEC = CacheSpec(attention=AttentionSpec(q_heads=6, kv_heads=2, head_dim=16), num_layers=2,
                 page_size=4, num_pages=48, max_seqs=3, max_pages_per_seq=8)


def test_bound_is_an_upper_bound_exactly(rng):
    # Integer-valued keys and queries: every product and sum is exact in float32, so the
    # inequality is checked exactly, not up to rounding.
    lengths = rng.integers(1, SPEC.max_tokens_per_seq + 1, SPEC.max_seqs)
    k = np.round(rng.standard_normal((2, 3, 2, SPEC.max_tokens_per_seq, 16)) * 4)
    cache, k, _ = random_filled_cache(SPEC, lengths, rng, k=k)
    policy = Quest(top_k=3, dense_layers=0)
    state = _prefill_state(policy, cache, rng)
    q = np.round(rng.standard_normal((SPEC.max_seqs, 6, 16)) * 4).astype(np.float32)
    bt = np.asarray(cache.block_tables)
    ps = SPEC.page_size
    for layer in range(2):
        safe = np.clip(bt, 0, None)
        kmin = np.swapaxes(np.asarray(state.kmin[layer])[:, safe], 0, 1)
        kmax = np.swapaxes(np.asarray(state.kmax[layer])[:, safe], 0, 1)
        bound = np.asarray(_bounds(q, kmin, kmax))
        for s, n in enumerate(lengths):
            for c in range(-(-n // ps)):
                toks = np.arange(c * ps, min(n, (c + 1) * ps))
                for h in range(6):
                    true = (k[layer, s, h // 3][toks] @ q[s, h]).max()
                    assert bound[s, h, c] >= true, (layer, s, c, h)
                    if len(toks) == 1:
                        assert bound[s, h, c] == true


def test_all_pages_equals_dense(rng):
    # Sequences hold at most 5 pages; top_k=5 selects all of them, in score order.
    lengths = np.array([20, 13, 1])
    cache, _, _ = random_filled_cache(SPEC, lengths, rng)
    policy = Quest(top_k=5, dense_layers=0)
    state = _prefill_state(policy, cache, rng)
    q = jax.device_put(rng.standard_normal((3, 6, 16)).astype(np.float32))
    want, want_lse = _decode(cache, 1, q)
    for layer in (1, jnp.int32(1)):  # static layer: 5-wide table; traced: max_pages wide
        sel = jax.jit(policy.before_attention)(cache, state, layer, q) if not isinstance(
            layer, int) else select(policy, cache, state, layer, q)
        assert np.asarray(sel.block_tables).shape[-1] == (5 if isinstance(layer, int) else 8)
        got, got_lse = _decode(cache, 1, q, sel)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got_lse, want_lse, rtol=1e-5, atol=1e-6)
    # Fewer pages than a sequence holds: not dense any more (the selection matters).
    sel = select(Quest(top_k=2, dense_layers=0), cache, state, 1, q)
    assert np.asarray(sel.lengths)[0].tolist() == [4 + 4] * 2
    got, _ = _decode(cache, 1, q, sel)
    assert np.abs(got - want)[0].max() > 1e-4

