"""StreamingLLM: sinks + window kept, pages returned, both position schemes, KIVI pages."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import cache as kvc
from kvjax.cache.policies import (
    StreamingLLM,
    UndefinedCombination,
    apply_rope,
    rerotate,
    rope_inv_freq,
)
from tests.cache.policies.helpers import KIVI, SPEC, dense_kv, random_filled_cache


def _queries(rng, spec):
    """Random step queries [layers, max_seqs, q_heads, head_dim] (StreamingLLM ignores them)."""
    a = spec.attention
    return jnp.asarray(rng.standard_normal((spec.num_layers, spec.max_seqs, a.q_heads,
                                            a.head_dim)), jnp.float32)


def test_hand_example_keeps_sinks_and_window(rng):
    cache, k, v = random_filled_cache(SPEC, [11, 4], rng)
    free0 = int(cache.num_free_pages)
    policy = StreamingLLM(n_sink=2, window=3)
    out, _, status = jax.jit(policy.after_step)(cache, None, _queries(rng, SPEC))
    status.raise_if_error()
    kvc.check_invariants(out)
    assert np.asarray(out.lengths).tolist() == [5, 4]
    dk, dv = dense_kv(out)
    kept = [0, 1, 8, 9, 10]  # 2 sinks + the last 3 of 11 tokens
    np.testing.assert_array_equal(dk[:, 0, :, :5], k[:, 0][:, :, kept])
    np.testing.assert_array_equal(dv[:, 0, :, :5], v[:, 0][:, :, kept])
    np.testing.assert_array_equal(dk[:, 1, :, :4], k[:, 1, :, :4])
    assert int(out.num_free_pages) == free0 + 1  # 11 tokens on 3 pages -> 5 tokens on 2 pages


# The rotations as jitted programs: run op by op they compiled some 50 small programs.
_apply_rope = jax.jit(apply_rope)


@jax.jit
def _rerotated_and_direct(k, s, j, inv_freq):
    """(k rotated at s then re-rotated by j - s, k rotated at j, k rotated at s)."""
    at_s = apply_rope(k, s, inv_freq)
    return rerotate(at_s, j - s, inv_freq), apply_rope(k, j, inv_freq), at_s


def test_rerotated_key_equals_rope_at_new_position(rng):
    inv_freq = rope_inv_freq(16, 10000.0)
    s = rng.integers(1, 1024, 64).astype(np.int32)
    k, s, j = jax.device_put((rng.standard_normal((64, 16)).astype(np.float32), s,
                              (rng.integers(0, 1024, 64) % s).astype(np.int32)))
    got, want, stale = _rerotated_and_direct(k, s, j, inv_freq)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    # And it must actually move: a stale key differs.
    assert np.abs(np.asarray(stale) - np.asarray(want)).max() > 1e-2


def test_cache_scheme_rerotates_moved_keys(rng):
    policy = StreamingLLM(n_sink=2, window=5, positions="cache")
    # The keys as the cache-position scheme caches them: rotated at their slot.
    inv_freq = rope_inv_freq(8)
    k_pre = rng.standard_normal((2, 2, 2, SPEC.max_tokens_per_seq, 8)).astype(np.float32)
    slots = np.arange(SPEC.max_tokens_per_seq, dtype=np.int32)
    k_rot = np.asarray(_apply_rope(jax.device_put(k_pre), slots, inv_freq))
    cache, _, _ = random_filled_cache(SPEC, [13, 6], rng, k=k_rot)
    out, _, status = jax.jit(policy.after_step)(cache, None, _queries(rng, SPEC))
    status.raise_if_error()
    dk, _ = dense_kv(out)
    kept = np.array([0, 1, 8, 9, 10, 11, 12])
    want = _apply_rope(jax.device_put(k_pre[:, 0][:, :, kept]), np.arange(7, dtype=np.int32),
                       inv_freq)
    np.testing.assert_allclose(dk[:, 0, :, :7], want, atol=1e-5, rtol=0)
    np.testing.assert_allclose(dk[:, 1, :, :6], k_rot[:, 1, :, :6], atol=0, rtol=0)
    # The next token's rotary position is its cache slot, not its text position.
    nxt = policy.rope_positions(out, None, jnp.asarray([[100], [100]], jnp.int32))
    assert np.asarray(nxt)[:, 0].tolist() == [7, 6]


def test_inactive_slots_are_left_alone(rng):
    cache, k, _ = random_filled_cache(SPEC, [11, 9], rng)
    policy = StreamingLLM(n_sink=2, window=3)
    out, _, status = jax.jit(policy.after_step)(cache, None, _queries(rng, SPEC),
                                                jnp.asarray([False, True]))
    status.raise_if_error()
    assert np.asarray(out.lengths).tolist() == [11, 5]
    dk, _ = dense_kv(out)
    np.testing.assert_array_equal(dk[:, 0, :, :11], k[:, 0, :, :11])
    np.testing.assert_array_equal(dk[:, 1, :, :5], k[:, 1][:, :, [0, 1, 6, 7, 8]])


def test_kivi_keeps_sink_pages_and_tail_and_drops_the_oldest_pages_between(rng):
    """Page-granular StreamingLLM: the pages holding the sinks and the full-precision tail
    stay; the oldest quantized pages after the sinks go, as many as the budget needs."""
    # Seq 0: 29 tokens = 6 quantized pages of 4 + a tail of 5. Budget 3 + 11 = 14: 15 tokens
    # over, so 4 whole pages go, the oldest after the sink page (pages 1..4); 13 tokens stay.
    cache, _, _ = random_filled_cache(KIVI, [29, 11], rng)
    before = dense_kv(cache)
    free0 = int(cache.num_free_pages)
    bt0 = np.asarray(cache.block_tables).copy()
    policy = StreamingLLM(n_sink=3, window=11)
    out, _, status = jax.jit(policy.after_step)(cache, policy.init_state(cache),
                                                _queries(rng, KIVI))
    status.raise_if_error()
    kvc.check_invariants(out)
    assert np.asarray(out.lengths).tolist() == [13, 11]  # seq 1 (11 <= 14) is untouched
    assert int(out.num_free_pages) == free0 + 4
    np.testing.assert_array_equal(np.asarray(out.block_tables)[0, :2], bt0[0, [0, 5]])
    kept = np.r_[0:4, 20:29]
    after = dense_kv(out)
    for x, y in zip(after, before, strict=True):
        np.testing.assert_array_equal(x[:, 0, :, :13], y[:, 0][:, :, kept])
        np.testing.assert_array_equal(x[:, 1, :, :11], y[:, 1, :, :11])


def test_kivi_undefined_combinations(rng):
    cache = kvc.init_cache(KIVI)
    with pytest.raises(UndefinedCombination, match="positions='original'"):
        StreamingLLM(n_sink=4, window=60, positions="cache").init_state(cache)
    # The sink page (4 tokens) plus the largest tail (R + page_size - 1 = 7) exceed 10.
    with pytest.raises(UndefinedCombination, match="budget >= 11"):
        StreamingLLM(n_sink=1, window=9).init_state(cache)
    StreamingLLM(n_sink=1, window=10).init_state(cache)
