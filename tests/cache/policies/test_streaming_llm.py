"""StreamingLLM: sinks + window kept, pages returned, both position schemes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache import page_table as pt
from kvjax.cache.policies import NoPolicy, StreamingLLM, apply_rope, rerotate, rope_inv_freq
from kvjax.cache.policies.toy import (
    dense_kv,
    init_toy,
    random_filled_cache,
    toy_generate,
)
from kvjax.specs import AttentionSpec, CacheSpec

SPEC = CacheSpec(attention=AttentionSpec(q_heads=4, kv_heads=2, head_dim=8), num_layers=2,
                 page_size=4, num_pages=24, max_seqs=2, max_pages_per_seq=5)
TOY = CacheSpec(attention=AttentionSpec(q_heads=4, kv_heads=2, head_dim=16), num_layers=2,
                page_size=4, num_pages=40, max_seqs=2, max_pages_per_seq=16)


def test_hand_example_keeps_sinks_and_window(rng):
    cache, k, v = random_filled_cache(SPEC, [11, 4], rng)
    free0 = int(cache.num_free_pages)
    policy = StreamingLLM(n_sink=2, window=3)
    step = jax.jit(policy.after_step)
    out, _, status = step(cache, None, jnp.zeros((2, 2, 4, 8), jnp.float32))
    status.raise_if_error()
    pt.check_invariants(out.table)
    assert np.asarray(out.lengths).tolist() == [5, 4]
    dk, dv = dense_kv(out)
    kept = [0, 1, 8, 9, 10]  # 2 sinks + the last 3 of 11 tokens
    np.testing.assert_array_equal(dk[:, 0, :, :5], k[:, 0][:, :, kept])
    np.testing.assert_array_equal(dv[:, 0, :, :5], v[:, 0][:, :, kept])
    np.testing.assert_array_equal(dk[:, 1, :, :4], k[:, 1, :, :4])
    assert int(out.num_free_pages) == free0 + 1  # 11 tokens on 3 pages -> 5 tokens on 2 pages


def test_rerotated_key_equals_rope_at_new_position(rng):
    inv_freq = rope_inv_freq(16, 10000.0)
    k = jnp.asarray(rng.standard_normal((64, 16)), jnp.float32)
    s = jnp.asarray(rng.integers(1, 1024, 64), jnp.int32)
    j = jnp.asarray(rng.integers(0, 1024, 64), jnp.int32) % s
    got = rerotate(apply_rope(k, s, inv_freq), j - s, inv_freq)
    np.testing.assert_allclose(got, apply_rope(k, j, inv_freq), atol=1e-5, rtol=0)
    # And it must actually move: a stale key differs.
    assert np.abs(np.asarray(apply_rope(k, s, inv_freq) - apply_rope(k, j, inv_freq))).max() > 1e-2


def test_cache_scheme_rerotates_moved_keys(rng):
    policy = StreamingLLM(n_sink=2, window=5, positions="cache")
    cache, k_pre, v = random_filled_cache(SPEC, [13, 6], rng)
    # Re-write the keys as the cache-position scheme caches them: rotated at their slot.
    inv_freq = rope_inv_freq(8)
    slots = jnp.arange(SPEC.max_tokens_per_seq)
    k_rot = np.asarray(apply_rope(jnp.asarray(k_pre), slots, inv_freq))
    from kvjax.cache import paged

    pos = jnp.broadcast_to(slots, (2, slots.shape[0])).astype(jnp.int32)
    wslots = paged.token_slots(cache, pos, pos < cache.lengths[:, None])
    for layer in range(2):
        cache = paged.write_layer(cache, layer, wslots,
                                  jnp.asarray(k_rot[layer].transpose(0, 2, 1, 3)),
                                  jnp.asarray(v[layer].transpose(0, 2, 1, 3)))
    out, _, status = jax.jit(policy.after_step)(cache, None, jnp.zeros((2, 2, 4, 8)))
    status.raise_if_error()
    dk, _ = dense_kv(out)
    kept = np.array([0, 1, 8, 9, 10, 11, 12])
    want = apply_rope(jnp.asarray(k_pre[:, 0][:, :, kept]), jnp.arange(7), inv_freq)
    np.testing.assert_allclose(dk[:, 0, :, :7], want, atol=1e-5, rtol=0)
    np.testing.assert_allclose(dk[:, 1, :, :6], k_rot[:, 1, :, :6], atol=0, rtol=0)
    # The next token's rotary position is its cache slot, not its text position.
    nxt = policy.rope_positions(out, None, jnp.asarray([[100], [100]], jnp.int32))
    assert np.asarray(nxt)[:, 0].tolist() == [7, 6]


@pytest.mark.parametrize("positions", ["original", "cache"])
def test_long_decode_respects_budget_and_frees_pages(rng, positions):
    params = init_toy(TOY, seed=int(rng.integers(1 << 30)))
    policy = StreamingLLM(n_sink=2, window=9, positions=positions)
    prompts = rng.integers(0, 64, (2, 7))
    seen = []

    def on_step(i, cache, state):
        pt.check_invariants(cache.table)
        lengths = np.asarray(cache.lengths)
        used = -(-lengths // TOY.page_size)
        seen.append((lengths.copy(), int(cache.num_free_pages), used.sum()))

    from kvjax.cache import init_cache

    toy_generate(params, init_cache(TOY), policy, prompts, 40, on_step=on_step)
    for lengths, free, used in seen:
        assert lengths.max() <= policy.budget
        # Nothing is shared, so every page not in a block table is on the free stack.
        assert free == TOY.num_pages - used
    # Without the policy the same decode would hold 47 tokens = 12 pages per sequence.
    assert max(u for _, _, u in seen) == 2 * -(-policy.budget // TOY.page_size)


def test_budget_keeping_every_token_is_identical_to_no_policy(rng):
    from kvjax.cache import init_cache

    params = init_toy(TOY, seed=int(rng.integers(1 << 30)))
    prompts = rng.integers(0, 64, (2, 6))
    t0, l0, _ = toy_generate(params, init_cache(TOY), NoPolicy(), prompts, 20)
    for positions in ("original", "cache"):
        t1, l1, _ = toy_generate(params, init_cache(TOY),
                                 StreamingLLM(n_sink=4, window=36, positions=positions),
                                 prompts, 20)
        np.testing.assert_array_equal(t1, t0)
        np.testing.assert_array_equal(l1, l0)


def test_inactive_slots_are_left_alone(rng):
    cache, k, _ = random_filled_cache(SPEC, [11, 9], rng)
    policy = StreamingLLM(n_sink=2, window=3)
    out, _, status = jax.jit(policy.after_step)(cache, None, jnp.zeros((2, 2, 4, 8)),
                                                jnp.asarray([False, True]))
    status.raise_if_error()
    assert np.asarray(out.lengths).tolist() == [11, 5]
    dk, _ = dense_kv(out)
    np.testing.assert_array_equal(dk[:, 0, :, :11], k[:, 0, :, :11])
    np.testing.assert_array_equal(dk[:, 1, :, :5], k[:, 1][:, :, [0, 1, 6, 7, 8]])
