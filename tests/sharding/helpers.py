"""Shared builders for the sharding tests: plans per strategy and a filled cache."""

import os

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import sharding as kvs
from kvjax.cache import layer_view, reserve
from kvjax.cache.paged import token_slots, write_layer
from kvjax.specs import AttentionSpec, CacheSpec, MLASpec

# (mesh shape, axis names, strategies): every strategy on (8,), (2, 4), (2, 2, 2).
# KVJAX_SHARDING_FULL=1 runs all of them; by default the three (8,) plans and the
# (2, 2, 2) plan with every strategy (the others are subsets of it), to keep the
# sharding tests under 3 minutes on a 2-core machine.
FULL = bool(os.environ.get("KVJAX_SHARDING_FULL"))
ALL_PLANS = [
    ((8,), ("model",), ("heads",)),
    ((8,), ("data",), ("sequences",)),
    ((8,), ("context",), ("context",)),
    ((2, 4), ("data", "model"), ("sequences", "heads")),
    ((2, 4), ("data", "context"), ("sequences", "context")),
    ((2, 2, 2), ("data", "model", "context"), ("sequences", "heads", "context")),
    ((2, 2, 2), ("data", "model", "context"), ("heads", "context")),
]
PLANS = ALL_PLANS if FULL else [ALL_PLANS[i] for i in (0, 1, 2, 5)]


def plan_id(p):
    return "x".join(map(str, p[0])) + "-" + "+".join(p[2])


def make_plan(shape, names, strategies, **kw):
    return kvs.ShardingPlan(mesh=kvs.make_mesh(shape, names), strategies=strategies, **kw)


def gqa_spec(**kw):
    base = dict(attention=AttentionSpec(q_heads=16, kv_heads=8, head_dim=16), num_layers=2,
                page_size=4, num_pages=256, max_seqs=8, max_pages_per_seq=16)
    return CacheSpec(**{**base, **kw})


def mla_spec(**kw):
    base = dict(attention=MLASpec(q_heads=8, kv_lora_rank=32, qk_rope_head_dim=8,
                                  qk_nope_head_dim=16, v_head_dim=16),
                num_layers=2, page_size=4, num_pages=256, max_seqs=8, max_pages_per_seq=16)
    return CacheSpec(**{**base, **kw})


def filled_cache(spec, plan, lengths, rng):
    """A sharded cache holding `lengths` random tokens per sequence in every layer."""
    cache = kvs.init_sharded_cache(spec, plan)
    cache, status = reserve(cache, jax.device_put(np.asarray(lengths, np.int32)))
    status.raise_if_error()
    t = max(int(np.max(lengths)), 1)
    heads = spec.attention.cache_heads
    wa, wb = spec.attention.cache_widths
    a = rng.standard_normal((spec.num_layers, spec.max_seqs, t, heads, wa)).astype(np.float32)
    b = rng.standard_normal((spec.num_layers, spec.max_seqs, t, heads, wb)).astype(np.float32)
    return _fill(cache, *jax.device_put((a, b)))  # no stage program per shape


@jax.jit
def _fill(cache, a, b):
    t = a.shape[2]
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), a.shape[1:3])
    slots = token_slots(cache, pos, pos < cache.lengths[:, None])
    for layer in range(a.shape[0]):
        cache = write_layer(cache, layer, slots, a[layer], b[layer])
    return cache


def view(cache, layer=1):
    """One layer's view, fetched to the host: the single-device reference reads it."""
    return jax.tree.map(np.asarray, layer_view(cache, layer))


def sharded_view(cache, layer=1):
    return layer_view(cache, layer)
