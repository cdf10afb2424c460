"""H2O: accumulated attention per cache head, heavy hitters + recent window, pages returned."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import cache as kvc
from kvjax.cache.policies import H2O, H2OState
from kvjax.specs import AttentionSpec, CacheSpec, MLASpec
from tests.cache.policies.helpers import SPEC, dense_kv, random_filled_cache, write


def test_hand_example(rng):
    spec = CacheSpec(attention=AttentionSpec(q_heads=4, kv_heads=2, head_dim=2), num_layers=1,
                     page_size=2, num_pages=8, max_seqs=1, max_pages_per_seq=4)
    # Within a KV head every key is the same vector, so each query head attends uniformly:
    # 1/5 to each of the 5 tokens, 2/5 per KV head (two query heads per group).
    key = rng.standard_normal((1, 1, 2, 2)).astype(np.float32)
    vals = rng.standard_normal((1, 5, 2, 2)).astype(np.float32)
    cache, status = kvc.reserve(kvc.init_cache(spec), np.array([5], np.int32))
    status.raise_if_error()
    cache = write(cache, 0, np.repeat(key, 5, axis=1), vals, np.array([5], np.int32))
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
    kvc.check_invariants(out)


GQA = CacheSpec(attention=AttentionSpec(q_heads=6, kv_heads=2, head_dim=8), num_layers=2,
                page_size=4, num_pages=20, max_seqs=2, max_pages_per_seq=4)
MLA = CacheSpec(attention=MLASpec(q_heads=3, kv_lora_rank=8, qk_rope_head_dim=4,
                                  qk_nope_head_dim=4, v_head_dim=4),
                num_layers=2, page_size=4, num_pages=20, max_seqs=2, max_pages_per_seq=4)


@pytest.mark.parametrize("spec", [GQA, MLA], ids=["gqa", "mla"])
def test_accumulates_group_summed_probabilities(spec, rng):
    """Each step adds, per cache head, the step query group's attention probabilities
    (MLA: one latent head; the key is [c_KV, k_rope], the query [q_latent, q_rope])."""
    lengths = [13, 6]
    cache, a, b = random_filled_cache(spec, lengths, rng)
    keys = a if not spec.is_mla else np.concatenate([a, b], axis=-1)
    hq, hk = spec.attention.q_heads, spec.attention.cache_heads
    policy = H2O(budget=16, recent=4)
    state = policy.init_state(cache)
    base = rng.random(state.scores.shape).astype(np.float32)
    for s, n in enumerate(lengths):  # the state holds 0 past each length
        base[:, s, :, n:] = 0
    q = rng.standard_normal((2, 2, hq, keys.shape[-1])).astype(np.float32)
    _, new, status = jax.jit(policy.after_step)(cache, H2OState(jnp.asarray(base)),
                                                jnp.asarray(q))
    status.raise_if_error()
    want = base.astype(np.float64)
    for layer in range(2):
        for s, n in enumerate(lengths):
            for h in range(hq):
                g = h // (hq // hk)
                logits = keys[layer, s, g, :n] @ q[layer, s, h] * spec.attention.softmax_scale
                p = np.exp(logits - logits.max())
                want[layer, s, g, :n] += p / p.sum()
    np.testing.assert_allclose(new.scores, want, rtol=1e-5, atol=1e-6)


def test_inactive_slots_neither_scored_nor_evicted(rng):
    cache, k, _ = random_filled_cache(SPEC, [10, 10], rng)
    policy = H2O(budget=6, recent=2)
    state = policy.init_state(cache)
    q = jnp.asarray(rng.standard_normal((2, 2, 4, 8)), jnp.float32)
    out, new, status = jax.jit(policy.after_step)(cache, state, q, jnp.asarray([True, False]))
    status.raise_if_error()
    assert np.asarray(out.lengths).tolist() == [6, 10]
    assert (np.asarray(new.scores)[:, 1] == 0).all()
    assert (np.asarray(new.scores)[:, 0, :, :6] > 0).all()
    dk, _ = dense_kv(out)
    np.testing.assert_array_equal(dk[:, 1, :, :10], k[:, 1, :, :10])


def test_prefill_keeps_the_heaviest_prompt_tokens_per_head(rng):
    """after_prefill scores a new prompt with every prompt query (causal) and keeps, in
    each (layer, head), the top budget - recent older tokens plus the recent window."""
    spec = GQA
    lengths = [14, 5]
    cache, k, v = random_filled_cache(spec, lengths, rng)
    policy = H2O(budget=8, recent=3)
    q = rng.standard_normal((2, 2, 14, 6, 8)).astype(np.float32)
    out, state, status = jax.jit(policy.after_prefill)(
        cache, policy.init_state(cache), jnp.asarray(q), jnp.asarray(lengths))
    status.raise_if_error()
    kvc.check_invariants(out)
    assert np.asarray(out.lengths).tolist() == [8, 5]
    dk, dv = dense_kv(out)
    n = lengths[0]
    for layer in range(2):
        for g in range(2):
            score = np.zeros(n)
            for h in range(3 * g, 3 * g + 3):
                for t in range(n):  # prompt query t sees tokens 0..t
                    logits = k[layer, 0, g, :t + 1] @ q[layer, 0, t, h] / np.sqrt(8)
                    p = np.exp(logits - logits.max())
                    score[:t + 1] += p / p.sum()
            # Which tokens were kept, read off the cache (random keys are distinct).
            kept = [int(np.nonzero((k[layer, 0, g, :n] == row).all(-1))[0][0])
                    for row in dk[layer, 0, g, :8]]
            assert kept[5:] == [n - 3, n - 2, n - 1] and kept == sorted(set(kept))
            dropped = sorted(set(range(n - 3)) - set(kept))
            # The heavy hitters outscore every evicted token (up to float32 rounding).
            assert score[kept[:5]].min() >= score[dropped].max() - 1e-5
            np.testing.assert_array_equal(dv[layer, 0, g, :8], v[layer, 0, g, kept])
            np.testing.assert_allclose(state.scores[layer, 0, g, :8], score[kept], rtol=1e-5)
    np.testing.assert_array_equal(dk[:, 1, :, :5], k[:, 1, :, :5])  # under budget: untouched
