"""Window groups: sliding-window layers that keep only the pages their window reaches.

A layer whose queries see only the last `window` keys never reads a page that left
its window, so the cache need not keep it. `CacheSpec.window_groups` puts such layers
in groups (`WindowGroupSpec`), each with pools and a page table of its own
(`WindowGroup`); the main pools and table hold the other layers. In a group's table a
sequence's row is a ring of

    R = ring_pages(window, chunk, page_size) = ceil((window + chunk - 2) / page_size) + 1

entries: logical page p (tokens [p * page_size, (p + 1) * page_size)) lives in ring
slot p mod R. Slots are allocated as the sequence first reaches them; once all R are
held, the page entering the window takes the slot of the page leaving it and is
written in place: a sequence of any length holds at most R pages of the group, and
its growth allocates nothing there (unless the slot's page is shared after a fork:
then the slot gets a fresh page, copy-on-write without a copy, since the new page's
tokens are all new).

A ring holds a contiguous range of logical pages [lo, P) of a sequence of P pages
(`ring_range`): lo = max(0, P - R) while it only grows. Truncation to P' pages frees
the slots of pages [P', P) (after a wrap they would otherwise keep newer pages under
the slot of an older one) and leaves lo as it was, so the range becomes [lo, P');
the freed slots are holes (-1) that a later reserve fills with fresh pages.

Attention reads the group's pools through a virtual block table of the cache's usual
width whose entry p is `ring[p mod R]` (`virtual_tables`, one small int gather): every
implementation of `kvjax.attention` masks keys outside `[q - window + 1, q]` by
position (the XLA path and the Pallas kernels select them away, the CPU kernels start
at the window), so entries before the window, which name newer pages, are never seen.
`ring_pages` sizes R so that a reserve of up to `chunk` tokens overwrites no page a
query of the same step reads (see `kvjax.specs.ring_pages`).

Every allocator operation covers the groups: `reserve` (all or nothing over the main
table and every group; a reserve of more than `chunk` tokens is refused, status
TOO_MANY_NEW), `fork` (rings are shared page for page), `free`, `truncate` (allowed
while the ring's range still holds the pages the new length's window reaches) and
`check_invariants`. The functions here are called by `kvjax.cache`'s generic
operations, which dispatch on `cache.groups`.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from kvjax.cache import page_table as pt
from kvjax.cache import paged, sharded_table
from kvjax.cache.state import KVPages, PagedKVCache, Slots, WindowGroup
from kvjax.specs import CacheSpec

__all__ = [
    "init_groups",
    "ring_size",
    "reserve_ring",
    "reserve",
    "fork_ring",
    "fork",
    "free_ring",
    "free",
    "ring_range",
    "truncate_allowed",
    "truncate_ring",
    "truncate",
    "home",
    "virtual_tables",
    "write_layer",
    "attention_inputs",
    "pages_in_use",
    "check_invariants",
]


def ring_size(spec: CacheSpec, g: int) -> int:
    """Ring slots per sequence of window group g."""
    return spec.window_groups[g].ring_pages(spec.page_size)


def init_groups(spec: CacheSpec) -> tuple[WindowGroup, ...]:
    """Empty window groups for `spec`: zeroed pools, empty rings, every page free."""
    groups = []
    for g in range(len(spec.window_groups)):
        shape = spec.group_pool_shape(g)
        pages = KVPages(k=jnp.zeros(shape, spec.dtype), v=jnp.zeros(shape, spec.dtype))
        table = pt.init_page_table(num_pages=spec.group_num_pages(g), max_seqs=spec.max_seqs,
                                   max_pages_per_seq=ring_size(spec, g),
                                   page_size=spec.page_size)
        groups.append(WindowGroup(pages=pages, table=table))
    return tuple(groups)


def _per_shard(fn, table: pt.PageTable, *row_args):
    """Runs the ring op `fn(table, *row_args) -> (table, pages, ...)` on each data shard's
    virtual table of a `ShardedPageTable` (rings never span shards: a sequence's ring
    pages all come from its data shard's range), or on a plain table as it is. `pages`
    (the op's second output, local page ids padded with the shard's page count) come back
    as global ids padded with `num_pages`."""
    if not isinstance(table, sharded_table.ShardedPageTable):
        return fn(table, *row_args)
    if table.context_shards != 1:
        raise ValueError("window groups: a ring table cannot be split over context shards "
                         f"(got context_shards={table.context_shards}).")
    D, n = table.data_shards, table.pages_per_shard
    virtual, cols = sharded_table._virtual(table)
    args = [a.reshape(D, -1) for a in row_args]
    new_v, pages, *rest = jax.vmap(fn)(virtual, *args)
    new = sharded_table._from_virtual(table, new_v, cols)
    new = dataclasses.replace(new, lengths=new_v.lengths.reshape(-1))
    offset = (jnp.arange(D, dtype=jnp.int32) * n)[:, None]
    pages = jnp.where(pages < n, pages + offset, table.num_pages).reshape(-1)
    return (new, pages.astype(jnp.int32), *rest)


def reserve_ring(
    table: pt.PageTable, num_new: Int[Array, " max_seqs"], *, chunk: int, max_tokens: int
) -> tuple[pt.PageTable, pt.CopyPlan, pt.AllocStatus]:
    """`page_table.reserve` for a ring table (per data shard on a `ShardedPageTable`): see
    `_reserve_ring`."""
    num_new = pt.check_reserve_counts(table, num_new)
    if not isinstance(table, sharded_table.ShardedPageTable):
        return _reserve_ring(table, num_new, chunk=chunk, max_tokens=max_tokens)

    def one(t, n):
        t, copy, status = _reserve_ring(t, n, chunk=chunk, max_tokens=max_tokens)
        return t, copy.dst, copy.src, status

    table2, dst, src, statuses = _per_shard(one, table, num_new)
    status = sharded_table._status(statuses)
    ok = status.ok
    table = jax.tree.map(lambda a, b: jnp.where(ok, a, b), table2, table)
    D, n = table.data_shards, table.pages_per_shard
    src = (src + (jnp.arange(D, dtype=jnp.int32) * n)[:, None]).reshape(-1)
    do = ok & (dst < table.num_pages)
    copy = pt.CopyPlan(src=jnp.where(do, src, 0).astype(jnp.int32),
                       dst=jnp.where(do, dst, table.num_pages).astype(jnp.int32))
    return table, copy, status


def _reserve_ring(
    table: pt.PageTable, num_new: Int[Array, " max_seqs"], *, chunk: int, max_tokens: int
) -> tuple[pt.PageTable, pt.CopyPlan, pt.AllocStatus]:
    """`page_table.reserve` for a ring table: grows sequences by `num_new[s]` tokens.

    New logical pages take their ring slots (p mod R): a hole (a slot never held, or
    freed by `truncate_ring`) gets a fresh page; a held one is reused in place (its page
    has left the window), or, if its page is shared, gets a fresh page without a copy. The
    partly filled last page is copied first if it is shared, as in `page_table.reserve`. Where
    every holder of a shared page gives it up in this call, the last of them (row-major)
    keeps it.

    All or nothing: a negative count (BAD_COUNT), a sequence past `max_tokens`
    (TOO_LONG), a count above `chunk` (TOO_MANY_NEW) or too few free pages
    (OUT_OF_PAGES) change nothing.

    Args:
      table: the group's page table (rows of R ring slots).
      num_new: int32[max_seqs] >= 0.
      chunk: the most tokens one reserve may add to a sequence (static).
      max_tokens: the longest sequence the cache holds (static).

    Returns:
      (table, copy_plan, status): copy_plan has max_seqs * R entries (dst == num_pages:
      no copy).
    """
    ps = table.page_size
    max_seqs, ring = table.block_tables.shape
    num_pages = table.num_pages
    sink = jnp.int32(num_pages)
    num_new = pt.check_reserve_counts(table, num_new)
    old_len = table.lengths
    negative = jnp.any(num_new < 0)
    too_long = jnp.any(num_new > max_tokens - old_len)
    too_many = jnp.any(num_new > chunk)
    num_new = jnp.where(negative | too_long | too_many, 0, num_new)
    new_len = old_len + num_new
    old_np, new_np = table.pages_used(old_len), table.pages_used(new_len)

    j = jnp.arange(ring, dtype=jnp.int32)[None, :]
    grow = jnp.mod(j - old_np[:, None], ring) < (new_np - old_np)[:, None]
    # A slot never held, or freed by a truncation, is a hole (-1); a held one holds a
    # page of the ring's range that has left the window.
    fresh_slot = grow & (table.block_tables < 0)
    replace = grow & ~fresh_slot
    partial = ((num_new > 0) & (old_len % ps != 0))[:, None] & (
        j == jnp.mod(old_np - 1, ring)[:, None])

    flat_bt = table.block_tables.reshape(-1)
    safe = jnp.clip(flat_bt, 0, num_pages - 1)
    flagged = (replace | partial).reshape(-1) & (table.refcounts[safe] > 1)
    target = jnp.where(flagged, flat_bt, sink)
    n_flagged = jnp.zeros((num_pages,), jnp.int32).at[target].add(1, mode="drop")
    idx = jnp.arange(flat_bt.shape[0], dtype=jnp.int32)
    last_holder = jnp.full((num_pages,), -1, jnp.int32).at[target].max(idx, mode="drop")
    keeps = flagged & (table.refcounts[safe] == n_flagged[safe]) & (last_holder[safe] == idx)
    cow = flagged & ~keeps
    needed = cow | fresh_slot.reshape(-1)
    pages_needed = jnp.sum(needed, dtype=jnp.int32)
    code = jnp.where(negative, pt.BAD_COUNT, jnp.where(
        too_long, pt.TOO_LONG, jnp.where(too_many, pt.TOO_MANY_NEW, jnp.where(
            pages_needed > table.num_free, pt.OUT_OF_PAGES, pt.OK))))
    ok = code == pt.OK
    fresh = pt._pop(table, jnp.cumsum(needed, dtype=jnp.int32) - 1)
    do = ok & needed
    refcounts = table.refcounts.at[jnp.where(do, fresh, sink)].set(1, mode="drop")
    refcounts = refcounts.at[jnp.where(ok & cow, flat_bt, sink)].add(-1, mode="drop")
    copy_needed = ok & cow & partial.reshape(-1)
    copy = pt.CopyPlan(src=jnp.where(copy_needed, flat_bt, 0),
                       dst=jnp.where(copy_needed, fresh, sink))
    status = pt.AllocStatus(code=code.astype(jnp.int32), pages_needed=pages_needed,
                            pages_free=table.num_free)
    table = dataclasses.replace(
        table,
        block_tables=jnp.where(do, fresh, flat_bt).reshape(max_seqs, ring),
        lengths=jnp.where(ok, new_len, old_len),
        refcounts=refcounts,
        num_free=table.num_free - jnp.where(ok, pages_needed, 0),
    )
    return table, copy, status


def _ring_reserve(spec: CacheSpec, g: int, table: pt.PageTable, num_new):
    return reserve_ring(table, num_new, chunk=spec.window_groups[g].chunk,
                        max_tokens=spec.max_tokens_per_seq)


def reserve(
    cache: PagedKVCache, num_new: Int[Array, " max_seqs"], main_reserve=paged.reserve
) -> tuple[PagedKVCache, pt.AllocStatus]:
    """The main pools' reserve and every window group's, all or nothing.

    The outcomes are computed first (the main pools' status from a trial of
    `main_reserve`, whose pool updates nothing uses); only when all succeed do the
    sequences grow, else nothing changes and the status is the first failure (main
    pools first, then the groups in order).

    Args:
      cache: the cache.
      num_new: int32[max_seqs] tokens per sequence.
      main_reserve: the main pools' page kind's reserve, `(cache, num_new) -> (cache,
        status)` (`paged.reserve`, or `quantized.reserve` for KIVI pages).
    """
    spec = cache.spec
    num_new = pt.check_reserve_counts(cache.table, num_new)
    statuses = [main_reserve(cache, num_new)[1]]
    statuses += [_ring_reserve(spec, g, grp.table, num_new)[2]
                 for g, grp in enumerate(cache.groups)]
    status = statuses[-1]
    for st in reversed(statuses[:-1]):
        status = jax.tree.map(lambda a, b, bad=~st.ok: jnp.where(bad, a, b), st, status)
    ok = jnp.all(jnp.stack([st.ok for st in statuses]))
    n = jnp.where(ok, num_new, 0)
    cache, _ = main_reserve(cache, n)
    groups = []
    for g, grp in enumerate(cache.groups):
        table, copy, _ = _ring_reserve(spec, g, grp.table, n)
        groups.append(WindowGroup(pages=paged.copy_pages(grp.pages, copy.src, copy.dst),
                                  table=table))
    return dataclasses.replace(cache, groups=tuple(groups)), status


def fork_ring(table: pt.PageTable, src: Int[Array, " n"], dst: Int[Array, " n"]
              ) -> tuple[pt.PageTable, pt.AllocStatus]:
    """`page_table.fork` for a ring table: each `dst[i]` (empty) shares the held slots of
    `src[i]`'s ring, holes staying holes. Nothing changes (BAD_FORK) on pairs that
    `page_table.fork` refuses (or, on a `ShardedPageTable`, across data shards)."""
    src, dst = pt.check_fork_pairs(table, src, dst)
    plain = pt.PageTable(block_tables=table.block_tables, lengths=table.lengths,
                         refcounts=table.refcounts, free_stack=table.free_stack,
                         num_free=jnp.sum(table.num_free), page_size=table.page_size)
    status = pt.fork(plain, src, dst)[1]
    ok = status.ok
    if isinstance(table, sharded_table.ShardedPageTable):  # a page lives on one data shard
        ok &= jnp.all(src // table.seqs_per_shard == dst // table.seqs_per_shard)
        status = dataclasses.replace(
            status, code=jnp.where(ok, pt.OK, pt.BAD_FORK).astype(jnp.int32))
    rows = table.block_tables[src]
    held = rows >= 0
    refcounts = table.refcounts.at[jnp.where(ok & held, rows, table.num_pages)].add(
        1, mode="drop")
    tgt = jnp.where(ok, dst, table.max_seqs)
    table = dataclasses.replace(
        table,
        block_tables=table.block_tables.at[tgt].set(rows, mode="drop"),
        lengths=table.lengths.at[tgt].set(table.lengths[src], mode="drop"),
        refcounts=refcounts,
    )
    return table, status


def fork(cache: PagedKVCache, src: Int[Array, " n"], dst: Int[Array, " n"]) -> PagedKVCache:
    """Each group's ring of `src[i]` shared by `dst[i]` (the main table's `fork` checks the
    same slots and lengths, so both succeed or fail together)."""
    groups = tuple(dataclasses.replace(grp, table=fork_ring(grp.table, src, dst)[0])
                   for grp in cache.groups)
    return dataclasses.replace(cache, groups=groups)


def free_ring(table: pt.PageTable, seqs: Bool[Array, " max_seqs"]
              ) -> tuple[pt.PageTable, Int[Array, " entries"]]:
    """`page_table.free` for a ring table: the flagged sequences drop every held slot
    (holes hold nothing). Returns (table, released pages padded with `num_pages`)."""
    seqs = pt.check_free_flags(table, seqs)

    def one(t, flags):
        t, released = pt._release(t, flags[:, None] & (t.block_tables >= 0))
        return dataclasses.replace(
            t, block_tables=jnp.where(flags[:, None], -1, t.block_tables),
            lengths=jnp.where(flags, 0, t.lengths)), released

    return _per_shard(one, table, seqs)


def free(cache: PagedKVCache, seqs: Bool[Array, " max_seqs"], scrub: bool = False
         ) -> PagedKVCache:
    """Frees the flagged sequences' rings; pages nobody else holds return to the group."""
    groups = []
    for grp in cache.groups:
        table, released = free_ring(grp.table, seqs)
        pages = grp.pages
        if scrub:
            pages = jax.tree.map(
                lambda x, r=released: paged.set_drop(x, (slice(None), slice(None), r), 0), pages)
        groups.append(WindowGroup(pages=pages, table=table))
    return dataclasses.replace(cache, groups=tuple(groups))


def _slot_pages(table: pt.PageTable) -> Int[Array, "max_seqs ring"]:
    """The logical page each ring slot holds when it is not a hole: the last page before
    the sequence's end that maps to the slot (negative where the sequence never reached it)."""
    ring = table.max_pages_per_seq
    last = table.pages_used(table.lengths)[:, None] - 1
    j = jnp.arange(ring, dtype=jnp.int32)[None, :]
    return last - jnp.mod(last - j, ring)


def ring_range(table: pt.PageTable) -> tuple[Int[Array, " max_seqs"], Int[Array, " max_seqs"]]:
    """Per sequence of a ring table, the logical pages [lo, hi) its ring holds.

    hi is the sequence's page count; lo is where the run of held slots that ends at page
    hi - 1 stops (walking back through at most R slots and never below page 0).
    """
    ring = table.max_pages_per_seq
    hi = table.pages_used(table.lengths)
    k = jnp.arange(ring, dtype=jnp.int32)[None, :]
    slot = jnp.mod(hi[:, None] - 1 - k, ring)
    held = (jnp.take_along_axis(table.block_tables, slot, axis=1) >= 0) & (k < hi[:, None])
    run = jnp.sum(jnp.cumprod(held.astype(jnp.int32), axis=1), axis=1, dtype=jnp.int32)
    return hi - run, hi


def truncate_allowed(cache: PagedKVCache, new_lengths: Int[Array, " max_seqs"]
                     ) -> Bool[Array, ""]:
    """Whether every group still holds the pages the new lengths' windows reach.

    A sequence may keep its length, end (0), or shorten to L' when its ring's range
    [lo, P) (`ring_range`) still starts at or before the page of position
    L' - window + 1 (the first key a later query reads). The range, not the length,
    decides: after one truncation of a wrapped ring, lo stays where the wrap left it.
    """
    spec, ps = cache.spec, cache.spec.page_size
    allowed = jnp.bool_(True)
    for gs, grp in zip(spec.window_groups, cache.groups, strict=True):
        old = grp.table.lengths
        lo, _ = ring_range(grp.table)
        first = jnp.maximum(new_lengths - gs.window + 1, 0) // ps
        ok = (new_lengths == old) | (new_lengths == 0) | (first >= lo)
        allowed &= jnp.all(ok)
    return allowed


def truncate_ring(table: pt.PageTable, new_lengths: Int[Array, " max_seqs"]
                  ) -> tuple[pt.PageTable, Int[Array, " entries"]]:
    """`page_table.truncate` for a ring table: the slots of logical pages [P', P) (P, P' the
    old and new page counts) become holes and their pages lose this sequence's
    reference; the partly filled last page is kept. Call with allowed lengths only
    (`truncate_allowed`, each in [0, current length]).

    Returns:
      (table, released): the pages that became free, padded with `num_pages`.
    """
    def one(t, new):
        drop = (t.block_tables >= 0) & (_slot_pages(t) >= t.pages_used(new)[:, None])
        t, released = pt._release(t, drop)
        return dataclasses.replace(t, block_tables=jnp.where(drop, -1, t.block_tables),
                                   lengths=new.astype(jnp.int32)), released

    return _per_shard(one, table, jnp.asarray(new_lengths, jnp.int32))


def truncate(cache: PagedKVCache, new_lengths: Int[Array, " max_seqs"]) -> PagedKVCache:
    """Each group's rings shortened to `new_lengths` (`truncate_ring`; checked by
    `truncate_allowed` and the main table's truncate: call with the lengths that were
    allowed)."""
    groups = tuple(dataclasses.replace(grp, table=truncate_ring(grp.table, new_lengths)[0])
                   for grp in cache.groups)
    return dataclasses.replace(cache, groups=groups)


def home(spec: CacheSpec, layer) -> tuple[int | None, int | Int[Array, ""]]:
    """(window group or None for the main pools, the layer's index in those pools).

    A traced layer (a scan over layers) is its own index when no layer is in a group,
    or when one group holds every layer.

    Raises:
      ValueError: a traced layer in a cache whose layers live in different pools.
    """
    if not isinstance(layer, jax.core.Tracer):
        return spec.layer_home(int(layer))
    groups = spec.window_groups
    if not groups:
        return None, layer
    if len(groups) == 1 and len(groups[0].layers) == spec.num_layers:
        return 0, layer
    raise ValueError(
        "A traced layer index (a scan over layers) needs every layer in one pool, but this "
        f"cache keeps layers {spec.global_layers} in the main pools and "
        f"{[g.layers for g in groups]} in window groups; run the layers in a Python loop "
        "(static indices).")


def virtual_tables(table: pt.PageTable, max_pages: int,
                   seq_ids: Int[Array, " batch"] | None = None) -> Int[Array, "batch max_pages"]:
    """Block tables of width `max_pages` over a ring table: entry p is `ring[p mod R]`.

    Entries before a sequence's last R pages name newer pages (or, for holes, its last
    page); attention with the group's window masks them by position.
    """
    bt = table.block_tables
    # Holes (slots before the ring's range, freed by a truncation) name the row's last
    # page instead of -1: masked by the window like every entry before it, and on the
    # sequence's own shard of a sharded pool, so a device's compacted list of the row's
    # pages keeps every column in place.
    last = jnp.mod(table.pages_used(table.lengths) - 1, table.max_pages_per_seq)
    bt = jnp.where(bt >= 0, bt, jnp.take_along_axis(bt, last[:, None], axis=1))
    rows = bt if seq_ids is None else bt[seq_ids]
    cols = np.arange(max_pages, dtype=np.int32) % table.max_pages_per_seq
    return rows[:, cols]


def token_slots(spec: CacheSpec, table: pt.PageTable, positions: Int[Array, "batch q_len"],
                valid: Bool[Array, "batch q_len"], seq_ids: Int[Array, " batch"] | None
                ) -> Slots:
    """Page and offset in a group's pool of the tokens at `positions` (ring slot p mod R)."""
    ring = table.max_pages_per_seq
    if seq_ids is None:
        bt = table.block_tables
    else:
        ok = (seq_ids >= 0) & (seq_ids < spec.max_seqs)
        bt = jnp.where(ok[:, None], table.block_tables[jnp.clip(seq_ids, 0, spec.max_seqs - 1)],
                       -1)
    col = jnp.mod(positions // spec.page_size, ring)
    page = jnp.take_along_axis(bt, col, axis=1)
    inside = (positions >= 0) & (positions < spec.max_tokens_per_seq) & (page >= 0)
    page = jnp.where(valid & inside, page, table.num_pages)
    return Slots(page=page.astype(jnp.int32),
                 offset=(positions % spec.page_size).astype(jnp.int32))


def write_layer(cache: PagedKVCache, g: int, index, positions, valid, seq_ids, k, v
                ) -> PagedKVCache:
    """Writes K/V `[batch, q_len, kv_heads, head_dim]` (cache dtype, checked by the caller)
    of the group's layer `index` at `positions` (valid tokens only)."""
    grp = cache.groups[g]
    n = grp.pages.k.shape[0]
    if isinstance(index, jax.core.Tracer):  # out of range: dropped by the scatter
        index = jnp.where((index >= 0) & (index < n), index, n)
    slots = token_slots(cache.spec, grp.table, positions, valid, seq_ids)
    page, off = slots.page.reshape(-1), slots.offset.reshape(-1)
    k = paged.set_rows(grp.pages.k, index, page, off, k.reshape(-1, *k.shape[2:]))
    v = paged.set_rows(grp.pages.v, index, page, off, v.reshape(-1, *v.shape[2:]))
    groups = list(cache.groups)
    groups[g] = WindowGroup(pages=KVPages(k=k, v=v), table=grp.table)
    return dataclasses.replace(cache, groups=tuple(groups))


def attention_inputs(cache: PagedKVCache, layer, seq_ids=None):
    """(pools, block tables of the batch rows, pool layer index) attention reads for `layer`:
    the main pools and tables, or its group's pools and virtual tables."""
    g, index = home(cache.spec, layer)
    if g is None:
        tables = cache.block_tables if seq_ids is None else cache.block_tables[seq_ids]
        return paged._pools(cache.pages), tables, index
    grp = cache.groups[g]
    tables = virtual_tables(grp.table, cache.spec.max_pages_per_seq, seq_ids)
    return (grp.pages.k, grp.pages.v), tables, index


def pages_in_use(cache: PagedKVCache) -> tuple[int, ...]:
    """Host-side: pages each window group holds (its pool size minus its free pages)."""
    return tuple(int(grp.table.num_pages - np.sum(grp.table.num_free)) for grp in cache.groups)


def check_invariants(cache: PagedKVCache) -> None:
    """Host-side check of every group's ring table; AssertionError naming a breach.

    Per sequence of P pages: the held slots are exactly those of a range of logical
    pages [lo, P) with P - R <= lo (`ring_range`), which reaches back to the page the
    next query's window starts on; the allocator's invariants over the held pages; the
    group's lengths equal to the cache's.
    """
    spec, ps = cache.spec, cache.spec.page_size
    lengths = np.asarray(cache.lengths)
    for g, grp in enumerate(cache.groups):
        ring, w = ring_size(spec, g), spec.window_groups[g].window
        glen = np.asarray(grp.table.lengths)
        if not (glen == lengths).all():
            raise AssertionError(f"window group {g}: lengths {glen.tolist()} differ from the "
                                 f"cache's {lengths.tolist()}")
        if (lengths > spec.max_tokens_per_seq).any():
            raise AssertionError(f"window group {g}: a length exceeds "
                                 f"{spec.max_tokens_per_seq} tokens: {lengths.tolist()}")
        bt = np.asarray(grp.table.block_tables)
        lo, hi = (np.asarray(x) for x in ring_range(grp.table))
        packed = np.full_like(bt, -1)
        for s in range(spec.max_seqs):
            first = max(int(lengths[s]) - w + 1, 0) // ps
            if lengths[s] and lo[s] > first:
                raise AssertionError(
                    f"window group {g}: sequence {s} of {lengths[s]} tokens holds pages "
                    f"[{lo[s]}, {hi[s]}) only, but its window starts on page {first} "
                    f"(ring {bt[s].tolist()})")
            slots = [p % ring for p in range(lo[s], hi[s])]
            stale = sorted(set(np.nonzero(bt[s] >= 0)[0].tolist()) - set(slots))
            if stale:
                raise AssertionError(
                    f"window group {g}: sequence {s} holds pages [{lo[s]}, {hi[s]}) but also "
                    f"slots {stale} outside that range (ring {bt[s].tolist()})")
            packed[s, :len(slots)] = bt[s, slots]
        # The allocator's own check over each row's held pages, packed at the front (and,
        # on a sharded table, every page on its sequence's data shard).
        held = (hi - lo).astype(np.int32) * ps
        try:
            sharded_table.check_invariants(dataclasses.replace(
                grp.table, block_tables=jnp.asarray(packed), lengths=jnp.asarray(held)))
        except AssertionError as e:
            raise AssertionError(f"window group {g}: {e}") from None
