"""Compiled decode steps move only partial outputs and LSEs between devices, never the pool."""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import attention as kva
from kvjax import sharding as kvs
from kvjax.cache import layer_view
from kvjax.cache.paged import token_slots, write_layer
from tests.sharding.helpers import filled_cache, gqa_spec, make_plan, mla_spec

_COLLECTIVE = re.compile(
    r"=\s*(?P<type>\(.*?\)|\S+)\s+(?P<op>all-gather|all-reduce|all-to-all|collective-permute|"
    r"reduce-scatter|collective-broadcast)(?:-start)?\("
)


def collective_shapes(hlo: str) -> list[tuple[str, tuple[int, ...]]]:
    """(op, result shape) for every array result of every collective in `hlo`."""
    found = []
    for line in hlo.splitlines():
        m = _COLLECTIVE.search(line)
        if m:
            for dims in re.findall(r"\w+\[([\d,]*)\]", m.group("type")):
                found.append((m.group("op"), tuple(int(d) for d in dims.split(",") if d)))
    return found


def pool_like(shape, spec, plan) -> bool:
    """Whether a collective's result looks like pool pages: [..., >= a shard's pages, ps, w]."""
    return (len(shape) >= 3 and shape[-2] == spec.page_size
            and shape[-1] in set(spec.attention.cache_widths)
            and shape[-3] >= spec.num_pages // plan.page_shards)


def collectives(hlo: str) -> list[tuple[str, int]]:
    """(op, largest element count among its results) for every collective in `hlo`."""
    found = []
    for line in hlo.splitlines():
        m = _COLLECTIVE.search(line)
        if m:
            dims = re.findall(r"\w+\[([\d,]*)\]", m.group("type"))
            size = max(math.prod(int(d) for d in ds.split(",") if d) for ds in dims)
            found.append((m.group("op"), size))
    return found


def _step(cache, q, a, b, *, impl, mla):
    """One decode step over every layer: write the new token, attend."""
    pos = (cache.lengths - 1)[:, None]
    slots = token_slots(cache, pos, pos >= 0)
    outs = []
    for layer in range(cache.spec.num_layers):
        cache = write_layer(cache, layer, slots, a, b)
        v = layer_view(cache, layer)
        if mla:
            out, _ = kva.mla_decode_attention(q[0], q[1], v.k, v.v, v.lengths, v.block_tables,
                                              scale=0.2, impl=impl)
        else:
            out, _ = kva.paged_decode_attention(q, v.k, v.v, v.lengths, v.block_tables,
                                                impl=impl)
        outs.append(out)
    return cache, outs


def _compiled_collectives(plan, spec, impl, rng):
    lengths = np.array([1, 3, 4, 5, 13, 33, 60, 61], np.int32)
    cache = filled_cache(spec, plan, lengths, rng)
    b = spec.max_seqs
    if spec.is_mla:
        q = (jnp.ones((b, 8, 32)), jnp.ones((b, 8, 8)))
        new = (jnp.ones((b, 1, 32)), jnp.ones((b, 1, 8)))
    else:
        q = jnp.ones((b, 16, 16))
        new = (jnp.ones((b, 1, 8, 16)),) * 2
    step = jax.jit(functools.partial(_step, impl=impl, mla=spec.is_mla), donate_argnums=0)
    hlo = step.lower(cache, q, *new).compile().as_text()
    return collectives(hlo), cache


@pytest.mark.parametrize("mla", [False, True])
def test_decode_step_moves_no_pool(mla, rng):
    plan = make_plan((2, 2, 2), ("data", "model", "context"), ("sequences", "heads", "context"))
    spec = mla_spec() if mla else gqa_spec()
    found, cache = _compiled_collectives(plan, spec, kvs.ShardedAttention(plan), rng)
    pool_shard = cache.pages.c_kv if mla else cache.pages.k
    shard_elems = math.prod(pool_shard.addressable_shards[0].data.shape) // spec.num_layers
    # The largest thing allowed to cross devices: one layer's partial outputs [batch, heads, w].
    out_elems = spec.max_seqs * 16 * 32
    assert found, "expected the LSE merge's all-reduces"
    assert all(op != "all-gather" for op, _ in found), found
    assert max(size for _, size in found) <= out_elems < shard_elems, found


def test_the_check_catches_a_pool_sized_collective(rng):
    # Control: the plain reference op on a page-sharded pool, left to the compiler, makes
    # collectives as large as the KV the batch reads. The check above would fail on it.
    plan = make_plan((2, 2, 2), ("data", "model", "context"), ("sequences", "heads", "context"))
    spec = gqa_spec()
    found, _ = _compiled_collectives(plan, spec, "reference", rng)
    kv_read = 4 * spec.max_seqs * spec.max_pages_per_seq * spec.page_size * 16  # local heads
    assert max(size for _, size in found) >= kv_read


def test_pool_like_check_catches_a_gathered_pool(rng):
    # Control for the model-level check in test_generate_sharded: replicating the pool
    # inside a step compiles to an all-gather that `pool_like` flags.
    plan = make_plan((2, 2, 2), ("data", "model", "context"), ("sequences", "heads", "context"))
    spec = gqa_spec()
    cache = kvs.init_sharded_cache(spec, plan)
    rep = jax.sharding.NamedSharding(plan.mesh, jax.sharding.PartitionSpec())
    step = jax.jit(lambda k: jnp.sum(jax.lax.with_sharding_constraint(k * 2, rep)[:, :, 3]))
    found = collective_shapes(step.lower(cache.pages.k).compile().as_text())
    assert any(pool_like(shape, spec, plan) for _, shape in found), found
