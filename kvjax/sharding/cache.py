"""Shardings for the paged cache pytree, and building a cache directly on a mesh.

Every pool of every page kind (full-precision K/V, MLA latents, KIVI codes, scales
and zeros) is `[layers, heads, pages, rows, cols]`; its sharding is

    P(None, heads_axis, page_axes, None, None)

with `heads_axis = "model"` under `"heads"` (None under the replicate
fallback and for MLA's single latent head) and `page_axes` the data and/or
context axes (`ShardingPlan.page_axes`, data-major, so pool shard k = d * C + c
holds page ids [k * n, (k + 1) * n), n = num_pages / (D * C)).

An MLA cache's lightning-indexer key pool (DeepSeek-V3.2) is one more pool of the
same layout, sharded like the latent pool. A KIVI cache's tail rings `[layers, heads,
max_seqs, ring, width]` (the indexer keys' ring too) split their heads
like the pools and are replicated over the page axes (a ring is at most residual +
page_size tokens per slot); its token counts are replicated.

A cache with window groups (window-only pages, `kvjax.cache.window`) lays each group's
pools out like the main ones (heads over `model`, pages over `data`); its ring table is
replicated and, with a data axis, a `ShardedPageTable` of one context shard, so every
ring takes its pages from its sequence's data shard. The `context` strategy refuses
window groups (a window read by position is not a prefix of a device's pages).

The page table is replicated: it is a few KB of int32 next to pools of GBs,
and keeping it on every device lets every device run the allocator (the same
deterministic result everywhere) with no communication. Under `"sequences"` or
`"context"` it is a `ShardedPageTable`, whose allocator hands each sequence
slot pages from the shard that holds it (`kvjax.cache.sharded_table`), so
`kvjax.cache.reserve/fork/free` keep their meaning per shard.
"""

import dataclasses

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.cache import PagedKVCache, init_cache
from kvjax.cache import page_table as pt
from kvjax.cache import sharded_table as st
from kvjax.cache.state import KIVITail, RecurrentState, WindowGroup
from kvjax.sharding.mesh import ShardingPlan
from kvjax.specs import CacheSpec

__all__ = ["pool_spec", "cache_shardings", "init_sharded_cache", "kv_heads_sharded"]


def kv_heads_sharded(plan: ShardingPlan, spec: CacheSpec) -> bool:
    """Whether the pools' heads axis is split over `model` (validates the heads strategy).

    Raises:
      ValueError: `"heads"` is asked for, the `model` size does not divide the
        cache's KV heads, and the fallback is `"error"` or cannot apply (kv_heads
        does not divide the `model` size either).
    """
    if "heads" not in plan.strategies:
        return False
    m = plan.axis_size("model")
    heads = spec.attention.cache_heads
    if heads % m == 0:
        return m > 1
    what = "an MLA cache has 1 latent head" if spec.is_mla else f"kv_heads={heads}"
    if plan.kv_heads_fallback == "replicate" and m % heads == 0:
        return False
    raise ValueError(
        f"strategy 'heads': mesh axis 'model' has size {m}, which does not divide the cache's "
        f"heads ({what}); use a 'model' size dividing {heads}, kv_heads_fallback='replicate' "
        f"(needs {heads} to divide {m}), or the 'sequences'/'context' strategies."
    )


def _validate(plan: ShardingPlan, spec: CacheSpec) -> None:
    kv_heads_sharded(plan, spec)
    D, C = plan.data_shards, plan.context_shards
    if spec.num_pages % (D * C):
        axes = " * ".join(f"'{a}'={plan.axis_size(a)}" for a in plan.page_axes)
        raise ValueError(
            f"the pool's pages are split over mesh axes {axes} = {D * C} shards, which does not "
            f"divide num_pages={spec.num_pages}; choose num_pages a multiple of {D * C}."
        )
    if spec.max_seqs % D:
        raise ValueError(
            f"strategy 'sequences': mesh axis 'data' has size {D}, which does not divide "
            f"max_seqs={spec.max_seqs}; choose max_seqs a multiple of {D}."
        )


def pool_spec(plan: ShardingPlan, spec: CacheSpec) -> P:
    """PartitionSpec of every pool `[layers, heads, pages, page_size, width]` (validates)."""
    _validate(plan, spec)
    heads = "model" if kv_heads_sharded(plan, spec) else None
    axes = plan.page_axes
    pages = None if not axes else axes[0] if len(axes) == 1 else axes
    return P(None, heads, pages, None, None)


def cache_shardings(plan: ShardingPlan, spec: CacheSpec) -> PagedKVCache:
    """A `PagedKVCache`-shaped pytree of `NamedSharding`s for `spec` under `plan`.

    Use it as `in_shardings`/`out_shardings` of a jitted step, or with
    `jax.device_put`. Raises ValueError naming the mesh axis and sizes when the
    mesh does not fit the cache (see `kv_heads_sharded` and the page/seq counts).
    """
    pspec = pool_spec(plan, spec)
    pool = NamedSharding(plan.mesh, pspec)
    rep = NamedSharding(plan.mesh, P())
    abstract = jax.eval_shape(lambda: _build(plan, spec))
    pages = jax.tree.map(lambda _: pool, abstract.pages)
    table = jax.tree.map(lambda _: rep, abstract.table)
    tail = None
    if abstract.tail is not None:
        ring = NamedSharding(plan.mesh, P(None, pspec[1], None, None, None))
        tail = KIVITail(a=ring, b=ring, lengths=rep, pending=rep,
                        c=None if abstract.tail.c is None else ring)
    recurrent = None
    if abstract.recurrent is not None:
        recurrent = _recurrent_shardings(plan, spec)
    groups = tuple(WindowGroup(pages=jax.tree.map(lambda _: pool, grp.pages),
                               table=jax.tree.map(lambda _: rep, grp.table))
                   for grp in abstract.groups)
    return dataclasses.replace(abstract, pages=pages, table=table, tail=tail,
                               recurrent=recurrent, groups=groups)


def _recurrent_shardings(plan: ShardingPlan, spec: CacheSpec) -> RecurrentState:
    """A hybrid cache's linear-attention state: the delta-rule state's heads over `model`
    under the "heads" strategy when the axis divides them; the small conv state (its
    channels mix the q, k and v heads) replicated."""
    m = plan.axis_size("model")
    heads = ("model" if "heads" in plan.strategies and m > 1
             and spec.recurrent.heads % m == 0 else None)
    return RecurrentState(conv=NamedSharding(plan.mesh, P()),
                          ssm=NamedSharding(plan.mesh, P(None, None, heads, None, None)))


def _validate_groups(plan: ShardingPlan, spec: CacheSpec) -> None:
    if not spec.window_groups:
        return
    if plan.context_shards > 1:
        raise ValueError(
            "init_sharded_cache: a cache with window groups (CacheSpec.window_groups, "
            "window-only pages) does not take the 'context' strategy: a ring's pages are read "
            "by position, which is not a prefix of a device's pages; use 'heads' and/or "
            "'sequences', or build the cache without window-only pages.")
    D = plan.data_shards
    for g in range(len(spec.window_groups)):
        n = spec.group_num_pages(g)
        if n % D:
            raise ValueError(
                f"init_sharded_cache: window group {g}'s pool has {n} pages, which mesh axis "
                f"'data' of size {D} does not divide; give the group a num_pages multiple of "
                f"{D}.")


def _build(plan: ShardingPlan, spec: CacheSpec) -> PagedKVCache:
    cache = init_cache(spec)
    if plan.page_shards == 1:
        return cache
    table = st.init_sharded_page_table(
        num_pages=spec.num_pages, max_seqs=spec.max_seqs,
        max_pages_per_seq=spec.max_pages_per_seq, page_size=spec.page_size,
        data_shards=plan.data_shards, context_shards=plan.context_shards,
    )
    groups = tuple(dataclasses.replace(grp, table=st.init_sharded_page_table(
        num_pages=grp.table.num_pages, max_seqs=spec.max_seqs,
        max_pages_per_seq=grp.table.max_pages_per_seq, page_size=spec.page_size,
        data_shards=plan.data_shards, context_shards=1)) for grp in cache.groups)
    return dataclasses.replace(cache, table=table, groups=groups)


def init_sharded_cache(spec: CacheSpec, plan: ShardingPlan) -> PagedKVCache:
    """An empty cache whose pools are created already sharded (no full pool on any device).

    Under `"sequences"` or `"context"` the table is a `ShardedPageTable`
    (`num_free` is then int32[shards]); otherwise a plain `PageTable`. Window groups'
    ring tables follow the data axis (see the module docstring).

    Raises:
      ValueError: window groups under the `context` strategy, or a group pool the
        `data` axis does not divide.
    """
    _validate_groups(plan, spec)
    shardings = cache_shardings(plan, spec)
    return jax.jit(lambda: _build(plan, spec), out_shardings=shardings)()


def is_sharded_table(table: pt.PageTable) -> bool:
    return isinstance(table, st.ShardedPageTable)


