"""A hybrid model's per-slot recurrent state in the cache: fork copies, free clears,
truncation cannot roll it back, and layers read and write their own rows."""

import jax.numpy as jnp
import numpy as np
import pytest

import kvjax as kvx
from kvjax import cache as kc


def _spec():
    return kvx.CacheSpec(
        attention=kvx.AttentionSpec(q_heads=4, kv_heads=2, head_dim=8), num_layers=1,
        page_size=8, num_pages=16, max_seqs=4, max_pages_per_seq=4,
        recurrent=kvx.RecurrentSpec(num_layers=3, conv_dim=12, conv_width=3, heads=2,
                                    key_dim=4, value_dim=5))


def _random_state(rng, batch):
    return (jnp.asarray(rng.standard_normal((batch, 12, 3)), jnp.float32),
            jnp.asarray(rng.standard_normal((batch, 2, 4, 5)), jnp.float32))


def test_layers_read_and_write_their_own_rows_and_fork_and_free_follow_the_slots():
    rng = np.random.default_rng()
    cache = kc.init_cache(_spec())
    assert cache.recurrent.conv.shape == (3, 4, 12, 3)
    assert cache.recurrent.ssm.shape == (3, 4, 2, 4, 5)
    cache, _ = kc.reserve(cache, jnp.array([5, 3, 0, 0]))
    conv, ssm = _random_state(rng, 2)
    cache = kc.write_state(cache, 1, conv, ssm, seq_ids=jnp.array([1, 0]))
    c0, s0 = kc.read_state(cache, 1, jnp.array([0, 1]))
    np.testing.assert_array_equal(c0, conv[::-1])
    np.testing.assert_array_equal(s0, ssm[::-1])
    assert not np.asarray(cache.recurrent.ssm[0]).any()     # other layers untouched
    # A row with no real token keeps its slot's state.
    conv2, ssm2 = _random_state(rng, 2)
    cache = kc.write_state(cache, 1, conv2, ssm2, seq_ids=jnp.array([0, 1]),
                           rows=jnp.array([True, False]))
    np.testing.assert_array_equal(kc.read_state(cache, 1, jnp.array([1]))[1], ssm[:1])
    np.testing.assert_array_equal(kc.read_state(cache, 1, jnp.array([0]))[1], ssm2[:1])
    cache, status = kc.fork(cache, jnp.array([0]), jnp.array([3]))
    status.raise_if_error()
    np.testing.assert_array_equal(kc.read_state(cache, 1, jnp.array([3]))[1], ssm2[:1])
    cache = kc.free(cache, jnp.array([True, False, False, False]))
    assert not np.asarray(kc.read_state(cache, 1, jnp.array([0]))[1]).any()
    np.testing.assert_array_equal(kc.read_state(cache, 1, jnp.array([3]))[1], ssm2[:1])
    kc.check_invariants(cache)


def test_truncation_cannot_roll_the_state_back():
    cache = kc.init_cache(_spec())
    cache, _ = kc.reserve(cache, jnp.array([5, 3, 0, 0]))
    rng = np.random.default_rng()
    cache = kc.write_state(cache, 0, *_random_state(rng, 4))
    with pytest.raises(ValueError, match="cannot be rolled back; slot 0 can keep its 5 "
                                         "tokens or end"):
        kc.truncate(cache, jnp.array([4, 3, 0, 0]))
    cache, status = kc.truncate(cache, jnp.array([5, 0, 0, 0]))
    status.raise_if_error()
    assert int(cache.lengths[1]) == 0
    assert not np.asarray(kc.read_state(cache, 0, jnp.array([1]))[1]).any()
    assert np.asarray(kc.read_state(cache, 0, jnp.array([0]))[1]).any()


def test_bad_layers_and_caches_are_named():
    cache = kc.init_cache(_spec())
    with pytest.raises(ValueError, match="linear layer 3 is outside the cache's 3"):
        kc.read_state(cache, 3)
    plain = kc.init_cache(_spec().replace(recurrent=None))
    with pytest.raises(ValueError, match="holds no recurrent state"):
        kc.read_state(plain, 0)
    with pytest.raises(ValueError, match="RecurrentSpec.heads must be a positive int"):
        kvx.RecurrentSpec(num_layers=1, conv_dim=4, conv_width=3, heads=0, key_dim=4,
                          value_dim=4)


def test_a_sharded_hybrid_cache_splits_the_state_over_heads():
    import jax

    from kvjax import sharding as kvs

    mesh = kvs.make_mesh((2, 2), ("data", "model"), devices=jax.devices()[:4])
    plan = kvs.ShardingPlan(mesh=mesh, strategies=("heads", "sequences"))
    cache = kvs.init_sharded_cache(_spec().replace(num_pages=16), plan)
    assert cache.recurrent.ssm.sharding.spec[2] == "model"
    assert cache.recurrent.ssm.addressable_shards[0].data.shape == (3, 4, 1, 4, 5)
    rng = np.random.default_rng()
    cache, _ = kc.reserve(cache, jnp.array([5, 3, 4, 0]))
    conv, ssm = _random_state(rng, 4)
    cache = kc.write_state(cache, 2, conv, ssm)
    cache, status = kc.fork(cache, jnp.array([2]), jnp.array([3]))   # within a data shard
    status.raise_if_error()
    np.testing.assert_array_equal(kc.read_state(cache, 2, jnp.array([3]))[1], ssm[2:3])
