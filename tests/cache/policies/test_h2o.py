"""H2O: accumulated attention per KV head, heavy hitters + recent window, pages returned."""

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import init_cache, paged
from kvjax.cache import page_table as pt
from kvjax.cache.policies import H2O, H2OState
from kvjax.cache.policies.toy import dense_kv, random_filled_cache
from kvjax.specs import AttentionSpec, CacheSpec


def test_hand_example(rng):
    spec = CacheSpec(attention=AttentionSpec(q_heads=4, kv_heads=2, head_dim=2), num_layers=1,
                     page_size=2, num_pages=8, max_seqs=1, max_pages_per_seq=4)
    # Within a KV head every key is the same vector, so each query head attends uniformly:
    # 1/5 to each of the 5 tokens, 2/5 per KV head (two query heads per group).
    key = rng.standard_normal((1, 1, 2, 2)).astype(np.float32)
    vals = rng.standard_normal((1, 5, 2, 2)).astype(np.float32)
    cache = init_cache(spec)
    cache, _ = paged.reserve(cache, jnp.asarray([5]))
    slots = paged.token_slots(cache, jnp.arange(5)[None], jnp.ones((1, 5), bool))
    cache = paged.write_layer(cache, 0, slots, jnp.asarray(np.repeat(key, 5, axis=1)),
                              jnp.asarray(vals))
    acc = np.zeros((1, 1, 2, 8), np.float32)
    acc[0, 0, 0, :5] = [0.9, 0.1, 0.5, 0.2, 0.0]
    acc[0, 0, 1, :5] = [0.1, 0.9, 0.5, 0.3, 0.0]
    free0 = int(cache.num_free_pages)
    policy = H2O(budget=4, recent=2)
    q = jnp.asarray(rng.standard_normal((1, 1, 4, 2)), jnp.float32)
    out, state, status = jax.jit(policy.after_step)(cache, H2OState(jnp.asarray(acc)), q)
    status.raise_if_error()
    # Scores + 0.4: head 0 [1.3, 0.5, 0.9 | 0.6, 0.4], head 1 [0.5, 1.3, 0.9 | 0.7, 0.4];
    # the last 2 are the recent window, the best 2 of the first 3 are the heavy hitters.
    np.testing.assert_allclose(state.scores[0, 0, 0, :4], [1.3, 0.9, 0.6, 0.4], rtol=1e-6)
    np.testing.assert_allclose(state.scores[0, 0, 1, :4], [1.3, 0.9, 0.7, 0.4], rtol=1e-6)
    assert (np.asarray(state.scores)[..., 4:] == 0).all()
    _, dv = dense_kv(out)
    np.testing.assert_array_equal(dv[0, 0, 0, :4], vals[0, [0, 2, 3, 4], 0])
    np.testing.assert_array_equal(dv[0, 0, 1, :4], vals[0, [1, 2, 3, 4], 1])
    assert int(out.lengths[0]) == 4
    assert int(out.num_free_pages) == free0 + 1  # 3 pages -> 2 pages
    pt.check_invariants(out.table)


def test_accumulates_group_summed_probabilities(rng):
    spec = CacheSpec(attention=AttentionSpec(q_heads=6, kv_heads=2, head_dim=8), num_layers=2,
                     page_size=4, num_pages=20, max_seqs=2, max_pages_per_seq=4)
    lengths = [13, 6]
    cache, k, _ = random_filled_cache(spec, lengths, rng)
    policy = H2O(budget=16, recent=4)
    state = policy.init_state(cache)
    base = rng.random(state.scores.shape).astype(np.float32)
    for s, n in enumerate(lengths):  # the state holds 0 past each length
        base[:, s, :, n:] = 0
    q = rng.standard_normal((2, 2, 6, 8)).astype(np.float32)
    _, new, status = jax.jit(policy.after_step)(cache, H2OState(jnp.asarray(base)),
                                                jnp.asarray(q))
    status.raise_if_error()
    want = base.copy()
    for layer in range(2):
        for s, n in enumerate(lengths):
            for h in range(6):
                logits = k[layer, s, h // 3, :n] @ q[layer, s, h] / np.sqrt(8)
                p = np.exp(logits - logits.max())
                want[layer, s, h // 3, :n] += p / p.sum()
    np.testing.assert_allclose(new.scores, want, rtol=1e-5, atol=1e-6)


def test_inactive_slots_neither_scored_nor_evicted(rng):
    spec = CacheSpec(attention=AttentionSpec(q_heads=4, kv_heads=2, head_dim=8), num_layers=1,
                     page_size=4, num_pages=12, max_seqs=2, max_pages_per_seq=4)
    cache, k, _ = random_filled_cache(spec, [10, 10], rng)
    policy = H2O(budget=6, recent=2)
    state = policy.init_state(cache)
    q = jnp.asarray(rng.standard_normal((1, 2, 4, 8)), jnp.float32)
    out, new, status = jax.jit(policy.after_step)(cache, state, q, jnp.asarray([True, False]))
    status.raise_if_error()
    assert np.asarray(out.lengths).tolist() == [6, 10]
    assert (np.asarray(new.scores)[:, 1] == 0).all()
    assert (np.asarray(new.scores)[:, 0, :, :6] > 0).all()
    dk, _ = dense_kv(out)
    np.testing.assert_array_equal(dk[:, 1, :, :10], k[:, 1, :, :10])
