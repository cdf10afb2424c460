"""Meshes, plans and cache shardings: what each device holds, and errors on bad meshes."""

import math

import numpy as np
import pytest
from jax.sharding import AxisType

from kvjax import sharding as kvs
from kvjax.specs import AttentionSpec
from tests.sharding.helpers import filled_cache, gqa_spec, make_plan, mla_spec


def test_make_mesh_is_auto_and_uses_a_device_subset():
    mesh = kvs.make_mesh((2, 2), ("data", "context"))
    assert dict(mesh.shape) == {"data": 2, "context": 2}
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)
    assert mesh.size == 4


@pytest.mark.parametrize("shape,names,match", [
    ((8,), ("tensor",), "unknown axis name 'tensor'"),
    ((2, 4), ("data",), "2 sizes"),
    ((2, 2), ("data", "data"), "distinct"),
    ((4, 4), ("data", "model"), r"data=4, model=4\) need 16 devices but only 8"),
    ((0,), ("data",), "axis 'data' must have a positive int size, got 0"),
])
def test_make_mesh_errors_name_axes_and_sizes(shape, names, match):
    with pytest.raises(ValueError, match=match):
        kvs.make_mesh(shape, names)


def test_plan_missing_axis_is_named():
    mesh = kvs.make_mesh((2, 4), ("data", "model"))
    with pytest.raises(ValueError, match="strategy 'context' needs a mesh axis named 'context'"):
        kvs.ShardingPlan(mesh=mesh, strategies=("context",))
    with pytest.raises(ValueError, match="unknown strategy 'pages'"):
        kvs.ShardingPlan(mesh=mesh, strategies=("pages",))


def test_model_axis_not_dividing_kv_heads_is_named():
    spec = gqa_spec(attention=AttentionSpec(q_heads=12, kv_heads=6, head_dim=16))
    plan = make_plan((4,), ("model",), ("heads",))
    with pytest.raises(ValueError, match=r"'model' has size 4, which does not divide .*kv_heads=6"):
        kvs.cache_shardings(plan, spec)
    strict = make_plan((8,), ("model",), ("heads",), kv_heads_fallback="error")
    with pytest.raises(ValueError, match=r"'model' has size 8, .*kv_heads=2"):
        kvs.cache_shardings(strict, gqa_spec(attention=AttentionSpec(q_heads=16, kv_heads=2,
                                                                      head_dim=16)))


def test_pages_or_seqs_not_divisible_are_named():
    plan = make_plan((2, 2), ("data", "context"), ("sequences", "context"))
    with pytest.raises(ValueError, match=r"'data'=2 \* 'context'=2 = 4 shards.*num_pages=250"):
        kvs.cache_shardings(plan, gqa_spec(num_pages=250))
    with pytest.raises(ValueError, match=r"'data' has size 2, .*max_seqs=7"):
        kvs.cache_shardings(plan, gqa_spec(max_seqs=7))


def _held(array, axis):
    """device -> set of indices along `axis` it holds, read from addressable_shards."""
    out = {}
    for shard in array.addressable_shards:
        sl = shard.index[axis]
        start, stop = sl.start or 0, array.shape[axis] if sl.stop is None else sl.stop
        assert shard.data.shape[axis] == stop - start
        out.setdefault(shard.device, set()).update(range(start, stop))
    return out


@pytest.mark.parametrize("args,pages_n,heads_n", [
    (((8,), ("model",), ("heads",)), 1, 8),
    (((8,), ("data",), ("sequences",)), 8, 1),
    (((8,), ("context",), ("context",)), 8, 1),
    (((2, 4), ("data", "model"), ("sequences", "heads")), 2, 4),
    (((2, 2, 2), ("data", "model", "context"), ("sequences", "heads", "context")), 4, 2),
])
def test_each_device_holds_its_fraction(args, pages_n, heads_n, rng):
    plan = make_plan(*args)
    for spec in (gqa_spec(), mla_spec()):
        if spec.is_mla and "heads" in args[2] and len(args[2]) == 1:
            continue
        cache = kvs.init_sharded_cache(spec, plan)
        heads = spec.attention.cache_heads
        h_n = heads_n if not spec.is_mla else 1
        for pool in (cache.pages.k, cache.pages.v) if not spec.is_mla else (
                cache.pages.c_kv, cache.pages.k_rope):
            assert len(pool.addressable_shards) == 8
            for shard in pool.addressable_shards:
                assert shard.data.shape[2] == spec.num_pages // pages_n
                assert shard.data.shape[1] == heads // h_n
            pages = _held(pool, 2)
            # Devices that split pages hold disjoint ranges covering the pool.
            assert len({frozenset(p) for p in pages.values()}) == pages_n
            assert set().union(*pages.values()) == set(range(spec.num_pages))


def test_context_spreads_one_long_sequence(rng):
    plan = make_plan((8,), ("context",), ("context",))
    spec = gqa_spec(max_seqs=2, num_pages=64)
    length = 59  # 15 pages over 8 devices: at most 2 each
    cache = filled_cache(spec, plan, np.array([length, 0], np.int32), rng)
    held = _held(cache.pages.k, 2)
    pages = np.asarray(cache.block_tables)[0, :math.ceil(length / spec.page_size)]
    counts = [len(set(pages.tolist()) & ids) for ids in held.values()]
    assert sum(counts) == len(pages) == 15
    assert max(counts) <= math.ceil(len(pages) / 8)
    assert min(counts) >= 1
