"""compact: kept tokens move to the front per (layer, head), pages go back, forks stay intact."""

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as kvc
from kvjax.cache import page_table as pt
from kvjax.cache.policies import compact
from kvjax.specs import CacheSpec, MLASpec
from tests.cache.policies.helpers import SPEC, dense_kv, random_filled_cache

_compact = jax.jit(compact)


def test_compact_hand_example_per_head_sets(rng):
    cache, k, v = random_filled_cache(SPEC, [10, 6], rng)
    free0 = int(cache.num_free_pages)
    # seq 0 keeps 4 tokens, a different set per (layer, head); seq 1 keeps its 6 in place.
    keep0 = np.array([[[0, 3, 7, 9], [1, 2, 8, 9]], [[4, 5, 6, 7], [0, 1, 2, 9]]])
    keep = np.zeros((2, 2, 2, 6), np.int32)
    keep[:, 0, :, :4] = keep0
    keep[:, 1] = np.arange(6)
    out, released, status = _compact(cache, jnp.asarray(keep), jnp.asarray([4, 6], jnp.int32))
    status.raise_if_error()
    kvc.check_invariants(out)
    assert np.asarray(out.lengths).tolist() == [4, 6]
    # 10 tokens on 3 pages -> 4 tokens on 1 page: 2 pages freed, and counted by the allocator.
    assert int(out.num_free_pages) == free0 + 2
    assert int((np.asarray(released) < SPEC.num_pages).sum()) == 2
    dk, dv = dense_kv(out)
    for layer in range(2):
        for h in range(2):
            np.testing.assert_array_equal(dk[layer, 0, h, :4], k[layer, 0, h, keep0[layer, h]])
            np.testing.assert_array_equal(dv[layer, 0, h, :4], v[layer, 0, h, keep0[layer, h]])
    np.testing.assert_array_equal(dk[:, 1, :, :6], k[:, 1, :, :6])


def test_compact_does_not_touch_a_fork(rng):
    cache, k, v = random_filled_cache(SPEC, [9, 0], rng)
    cache, s = kvc.fork(cache, jnp.asarray([0]), jnp.asarray([1]))
    s.raise_if_error()
    keep = np.zeros((2, 2, 2, 5), np.int32)
    keep[:, 0] = np.array([0, 1, 6, 7, 8])
    keep[:, 1] = np.arange(5)
    free0 = int(cache.num_free_pages)
    out, _, status = _compact(cache, jnp.asarray(keep), jnp.asarray([5, 9], jnp.int32))
    status.raise_if_error()
    kvc.check_invariants(out)
    dk, dv = dense_kv(out)
    np.testing.assert_array_equal(dk[:, 1, :, :9], k[:, 0, :, :9])  # the fork sees the old text
    np.testing.assert_array_equal(dk[:, 0, :, :5], k[:, 0][:, :, [0, 1, 6, 7, 8]])
    # Slots 2..4 change, so pages 0 and 1 are copied before the write (two new pages);
    # page 2 only loses seq 0's reference (seq 1 still holds it).
    assert int(out.num_free_pages) == free0 - 2


def test_compact_refuses_to_grow(rng):
    cache, _, _ = random_filled_cache(SPEC, [5, 3], rng)
    keep = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (2, 2, 2, 6))
    out, _, status = _compact(cache, keep, jnp.asarray([6, 3], jnp.int32))
    assert int(status.code) == pt.BAD_TRUNCATE
    np.testing.assert_array_equal(out.lengths, [5, 3])


def test_compact_moves_both_latent_pools_of_an_mla_cache(rng):
    spec = CacheSpec(attention=MLASpec(q_heads=4, kv_lora_rank=16, qk_rope_head_dim=4,
                                       qk_nope_head_dim=8, v_head_dim=8),
                     num_layers=2, page_size=4, num_pages=20, max_seqs=2, max_pages_per_seq=4)
    cache, c_kv, k_rope = random_filled_cache(spec, [13, 7], rng)
    free0 = int(cache.num_free_pages)
    # Each layer keeps its own 5 of seq 0's 13 tokens (one latent head); seq 1 keeps all 7.
    keep0 = np.stack([np.sort(rng.choice(13, 5, replace=False)) for _ in range(2)])
    keep = np.zeros((2, 2, 1, 7), np.int32)
    keep[:, 0, 0, :5] = keep0
    keep[:, 1, 0] = np.arange(7)
    out, _, status = _compact(cache, jnp.asarray(keep), jnp.asarray([5, 7], jnp.int32))
    status.raise_if_error()
    kvc.check_invariants(out)
    assert int(out.num_free_pages) == free0 + 2  # 13 tokens on 4 pages -> 5 on 2
    da, db = dense_kv(out)
    for layer in range(2):
        np.testing.assert_array_equal(da[layer, 0, 0, :5], c_kv[layer, 0, 0, keep0[layer]])
        np.testing.assert_array_equal(db[layer, 0, 0, :5], k_rope[layer, 0, 0, keep0[layer]])
    np.testing.assert_array_equal(da[:, 1, :, :7], c_kv[:, 1, :, :7])
    np.testing.assert_array_equal(db[:, 1, :, :7], k_rope[:, 1, :, :7])
