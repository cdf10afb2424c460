"""A host-memory tier for the paged cache: cold pages in host RAM, brought back on demand.

    cache = host.attach(cache, num_pages=4096, parked=8, stream_pages=64)
    cache, st = host.move(cache, slot, n_pages)       # slot's first n pages live on the host
    cache, st = host.swap_out(cache, slot, row)        # whole sequence -> parked row
    cache, st = host.swap_in(cache, row, slot)         # parked row -> empty slot
    cache = host.drop_parked(cache, row)               # forget a parked sequence
    cache = host.compile_swaps(cache, slot, row)       # compile every swap (empty slot/row)

The tier (`HostTier`, a field of `PagedKVCache`) is a second page pool of the same
page kind and layout in host memory (`memory_kind="pinned_host"`), with its own page
table: row s < max_seqs lists the leading pages of live slot s that live on the host,
row max_seqs + r a parked sequence. A device block-table entry holding the device
pool's page count (`spec.num_pages`) is a page that lives on the host; freeing,
forking and truncating skip such entries on the device and follow them on the host
(`kvjax.cache.ops` keeps both tables in step), so each tier's allocator invariants hold
on their own and `check` verifies both and how they meet.

Attention over a slot with host pages (`stream_pages > 0`): the device-resident pages
are attended as a sequence that starts at its first device page (positions shift by
whole pages; keys carry their rotary phase already, so only relative positions
matter), the host pages of the layer are gathered in host memory, copied to the
device and attended densely, and the two results merge by log-sum-exp. Only the
pages a row holds on the host are read (up to `stream_pages` per row, a static bound).

Copies between tiers are jitted programs over a batch of pages, dispatched
asynchronously like every JAX computation: the caller keeps working and only a read
of the result waits. Every program is all or nothing: when the target tier has too
few free pages nothing changes and the returned `AllocStatus` says OUT_OF_PAGES.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import compute_on as _compute_on
from jaxtyping import Array, Bool, Int

from kernels_pallas.merge import merge_attention_states
from kernels_pallas.quantized_attention.layout import dequantize
from kvjax.cache import page_table as pt
from kvjax.cache import paged, quantized, window
from kvjax.cache.state import HostTier, KIVITail, KVPages, PagedKVCache, QuantPool

__all__ = [
    "attach",
    "host_pages",
    "move",
    "swap_out",
    "swap_in",
    "drop_parked",
    "compile_swaps",
    "parked_lengths",
    "check",
    "tier_bytes",
    "HOST_MEMORY",
]

HOST_MEMORY = "pinned_host"


# --------------------------------------------------------------------------- placement


def _to_host(x):
    return jax.device_put(x, jax.memory.Space.Host)


def _to_device(x):
    return jax.device_put(x, jax.memory.Space.Device)


# The function-transform spelling of `compute_on`: `compute_on2` up to jax 0.10, renamed
# `compute_on` from 0.11 on (where the context manager of that name is gone).
_compute_on_fn = getattr(_compute_on, "compute_on2", _compute_on.compute_on)


def _on_host(f, *args):
    """f(*args) computed on the host ("device_host"), its results in host memory."""
    return _compute_on_fn(f, compute_type="device_host",
                          out_memory_spaces=jax.memory.Space.Host)(*args)


def _host_dtype(dtype):
    """The element type of a host pool for a device pool of `dtype`: 16-bit floats are held
    as their uint16 bits. Host computations run on XLA:CPU, which widens a 16-bit float
    gather or scatter to float32: on a bf16 pool that converted the whole pool both ways on
    every move and every step that read host pages (a bitcast inside the host computation
    does not help: XLA moves it past the indexing)."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 2:
        return jnp.dtype(jnp.uint16)
    return dtype


# The bitcasts below apply to a block of pages, behind an optimization barrier: XLA
# otherwise moves a bitcast past the gather or scatter onto the whole pool (a copy of it).
def _device_bits(x):
    """A device block in its host pool's element type (_host_dtype), still on the device."""
    want = _host_dtype(x.dtype)
    if want != x.dtype:
        x = jax.lax.bitcast_convert_type(jax.lax.optimization_barrier(x), want)
    return x


def _from_host_bits(x, dtype):
    """A block gathered from a host pool, on the device in the device pool's `dtype`."""
    x = _to_device(x)
    if x.dtype != dtype:
        x = jax.lax.optimization_barrier(jax.lax.bitcast_convert_type(x, dtype))
    return x


# How a program writes pages into a host pool, and reads them back. On CPU the host pools
# share the device's memory and a scatter computed on the host (`compute_on`) updates the
# donated pool in place. On GPU that host computation writes a fresh output buffer, so
# every move copied the whole pool. There a program moves one page at a time instead: a
# device_put to host memory and a dynamic_update_slice into the donated pool, which XLA's
# host offloading keeps in place, and a dynamic_slice plus a device_put to read. On an
# H200 (jax 0.11.2, 2 GiB pools) `move` of 256 pages (0.5 GiB) took 0.08 s out and 0.03 s
# back this way, against 0.50 s and 0.34 s through compute_on. Each page now goes straight
# from one pool into the other, without a device block of every page moved (a swap must
# not need device memory for the sequence it frees); that form has not run on a GPU yet.
# None: pick by backend; tests set True or False.
PAGE_AT_A_TIME = None


def _page_at_a_time() -> bool:
    return jax.default_backend() != "cpu" if PAGE_AT_A_TIME is None else PAGE_AT_A_TIME


def _inside_first(inside):
    """Positions of the True entries of `inside` first (in order), then the others."""
    return jnp.argsort(~inside, stable=True)


def _page_loop(dst, size, move, target):
    """target with move(target, i) applied for each i whose dst[i] < size, one page at a
    time."""
    inside = dst < size
    order = _inside_first(inside)
    return jax.lax.fori_loop(0, jnp.sum(inside, dtype=jnp.int32),
                             lambda j, t: move(t, order[j]), target)


def _write_host_pages(pool, dst, dev, src):
    """pool[:, :, dst] = dev[:, :, src]: device pages into a host pool (`dst`, `src` [k] or
    scalars, src within dev); entries of dst past the pool are skipped."""
    if not _page_at_a_time():
        bits = _to_host(_device_bits(dev[:, :, src]))
        return _on_host(lambda p, i, b: p.at[:, :, i].set(b, mode="drop"), pool,
                        _to_host(dst), bits)
    dst, src = jnp.atleast_1d(dst), jnp.atleast_1d(src)

    def move(p, i):
        page = _device_bits(jax.lax.dynamic_slice_in_dim(dev, src[i], 1, axis=2))
        return jax.lax.dynamic_update_slice_in_dim(p, _to_host(page), dst[i], axis=2)

    return _page_loop(dst, pool.shape[2], move, pool)


def _read_host_pages(dev, dst, pool, src):
    """dev[:, :, dst] = pool[:, :, src]: host pages into a device pool (`dst`, `src` [k] or
    scalars, src within the host pool); entries of dst past dev are skipped."""
    if not _page_at_a_time():
        block = _from_host_bits(_on_host(lambda p, i: p[:, :, i], pool, _to_host(src)),
                                dev.dtype)
        return paged.set_drop(dev, (slice(None), slice(None), dst), block)
    dst, src = jnp.atleast_1d(dst), jnp.atleast_1d(src)

    def move(d, i):
        page = _from_host_bits(jax.lax.dynamic_slice_in_dim(pool, src[i], 1, axis=2), d.dtype)
        return jax.lax.dynamic_update_slice_in_dim(d, page, dst[i], axis=2)

    return _page_loop(dst, dev.shape[2], move, dev)


def _host_sharding(x: Array):
    return x.sharding.with_memory_kind(HOST_MEMORY)


def _host_zeros(shape, like: Array) -> Array:
    """A zero host pool for device pool `like`, built in host memory: from a NumPy array
    (untouched zero pages until copied), not a device array of the pool's size."""
    return jax.device_put(np.zeros(shape, _host_dtype(like.dtype)), _host_sharding(like))


def attach(
    cache: PagedKVCache, num_pages: int, *, parked: int = 0, stream_pages: int = 0
) -> PagedKVCache:
    """The cache with an empty host tier of `num_pages` pages in host memory.

    With window groups (`CacheSpec.window_groups`) the tier mirrors the main pools (the
    global layers); a live sequence's ring stays on the device: a ring is at most
    `ring_pages(window, chunk, page_size)` = R pages per sequence whatever its length, so
    moving its pages would save little, and its attention never reads a host page. `move`
    moves the global layers' leading pages. A parked sequence (`swap_out`) takes its rings
    along: each group gets R host pages per parked row.

    Args:
      cache: a cache of any page kind on one device (not laid out by a sharding plan).
      num_pages: pages of the host pool (same page size and layout as the device's).
      parked: rows for whole sequences held on the host (`swap_out`).
      stream_pages: leading pages per live slot that may live on the host (`move`);
        decode attention reads that many host pages per row and layer, so keep it to
        what you offload. 0: live slots keep all their pages on the device.

    Raises:
      ValueError: a bad count, a sharded cache, or a cache that has a tier already.
    """
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"attach: expected a kvjax PagedKVCache, got {type(cache).__name__}.")
    if cache.host is not None:
        raise ValueError("attach: the cache has a host tier already.")
    if not isinstance(cache.table, pt.PageTable) or type(cache.table) is not pt.PageTable:
        raise ValueError("attach: a host tier needs an unsharded page table (the cache's pages "
                         "are sharded over a context axis).")
    if cache.recurrent is not None:
        raise ValueError("attach: a hybrid model's cache (recurrent state per slot) does not "
                         "take a host tier yet: a swapped-out slot would lose its state.")
    if cache.spec.indexer is not None:
        raise ValueError("attach: a cache with lightning-indexer keys (DeepSeek-V3.2, "
                         "CacheSpec.indexer) does not take a host tier yet: the tier's pools "
                         "and streamed attention cover the latent pages only.")
    spread = {len(x.sharding.device_set) for x in jax.tree.leaves(cache.pages)
              if hasattr(x, "sharding")}
    if spread - {1}:
        raise ValueError("attach: a host tier is built for a cache on one device; this cache's "
                         "pools are sharded over a mesh (a sharding plan), which the tier does "
                         "not support yet.")
    spec = cache.spec
    for name, v, lo in (("num_pages", num_pages, 1), ("parked", parked, 0),
                        ("stream_pages", stream_pages, 0)):
        if not isinstance(v, int | np.integer) or isinstance(v, bool) or v < lo:
            raise ValueError(f"attach: {name} must be an int >= {lo}, got {v!r}.")
    if stream_pages >= spec.max_pages_per_seq:
        raise ValueError(f"attach: stream_pages must be below max_pages_per_seq "
                         f"({spec.max_pages_per_seq}): a slot keeps its last page on the "
                         f"device; got {stream_pages}.")

    def pool(x):
        shape = (*x.shape[:2], int(num_pages), *x.shape[3:])
        return _host_zeros(shape, x)

    pages = jax.tree.map(pool, cache.pages)
    table = pt.init_page_table(num_pages=int(num_pages), max_seqs=spec.max_seqs + parked,
                               max_pages_per_seq=spec.max_pages_per_seq,
                               page_size=spec.page_size)
    tail_a = tail_b = None
    if cache.tail is not None:
        def ring(x):
            shape = (*x.shape[:2], int(parked), *x.shape[3:])
            return _host_zeros(shape, x)
        tail_a, tail_b = ring(cache.tail.a), ring(cache.tail.b)
    rings, ring_held = [], []
    for g, grp in enumerate(cache.groups):
        ring = window.ring_size(spec, g)

        def ring_pool(x, ring=ring):
            return _host_zeros((*x.shape[:2], int(parked) * ring, *x.shape[3:]), x)

        rings.append(KVPages(k=ring_pool(grp.pages.k), v=ring_pool(grp.pages.v)))
        ring_held.append(jnp.zeros((int(parked), ring), bool))
    tier = HostTier(pages=pages, table=table, parked_lengths=jnp.zeros((parked,), jnp.int32),
                    tail_a=tail_a, tail_b=tail_b, stream_pages=int(stream_pages),
                    rings=tuple(rings), ring_held=tuple(ring_held))
    return dataclasses.replace(cache, host=tier)


def _tier(cache: PagedKVCache, op: str) -> HostTier:
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"{op}: expected a kvjax PagedKVCache, got {type(cache).__name__}.")
    if cache.host is None:
        raise ValueError(f"{op}: the cache has no host tier; add one with "
                         f"kvjax.cache.host.attach(cache, num_pages=...).")
    return cache.host


def host_pages(cache: PagedKVCache) -> Int[Array, " max_seqs"]:
    """Leading pages of each live slot that live on the host (zeros without a tier)."""
    if cache.host is None:
        return jnp.zeros((cache.spec.max_seqs,), jnp.int32)
    return cache.host.table.lengths[: cache.spec.max_seqs] // cache.spec.page_size


def parked_lengths(cache: PagedKVCache) -> Int[Array, " parked"]:
    """Tokens of each parked sequence (0: the row is free)."""
    return _tier(cache, "parked_lengths").parked_lengths


# --------------------------------------------------------------------------- page copies


def _pools(pages) -> list[Array]:
    return jax.tree.leaves(pages)


def _copy_out(dev_pages, host_pages_, src: Int[Array, " k"], dst: Int[Array, " k"]):
    """host[:, :, dst] = device[:, :, src] for every pool; dst == host page count skips."""

    def one(d, h):
        return _write_host_pages(h, dst, d, jnp.clip(src, 0, d.shape[2] - 1))

    return jax.tree.map(one, dev_pages, host_pages_)


def _copy_in(dev_pages, host_pages_, src: Int[Array, " k"], dst: Int[Array, " k"]):
    """device[:, :, dst] = host[:, :, src] for every pool; dst == device page count skips."""

    def one(d, h):
        return _read_host_pages(d, dst, h, jnp.clip(src, 0, h.shape[2] - 1))

    return jax.tree.map(one, dev_pages, host_pages_)


def _pick(mask: Bool[Array, "rows cols"], values: Int[Array, "rows cols"], k: int, fill: int):
    """The first k flagged entries of `values` (row-major), padded with `fill`."""
    idx = jnp.nonzero(mask.reshape(-1), size=k, fill_value=mask.size)[0]
    flat = jnp.concatenate([values.reshape(-1), jnp.array([fill], values.dtype)])
    return flat[idx]


def _bucket(n: int, cap: int) -> int:
    """Static copy width for n pages: the next power of two, at most cap (>= 1)."""
    return max(1, min(cap, 1 << max(int(n) - 1, 0).bit_length()))


def _ok_where(ok, new, old):
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


def _set_host_row(tier: HostTier, row, cols_mask, ids, length) -> HostTier:
    """Host table row `row`: entries under `cols_mask` set to `ids`, length `length`."""
    t = tier.table
    bt = t.block_tables.at[row].set(jnp.where(cols_mask, ids, t.block_tables[row]))
    return dataclasses.replace(tier, table=dataclasses.replace(
        t, block_tables=bt, lengths=t.lengths.at[row].set(length)))


# --------------------------------------------------------------------------- move


def _check_slot(op: str, cache: PagedKVCache, slot) -> int:
    s = int(slot)
    if not 0 <= s < cache.spec.max_seqs:
        raise ValueError(f"{op}: slot {s} is outside [0, max_seqs={cache.spec.max_seqs}).")
    return s


def _movable(cache: PagedKVCache, s: int) -> int:
    """Leading pages of slot s that may live on the host: every page but the last one
    being written (KIVI: the quantized pages)."""
    ps = cache.spec.page_size
    if cache.tail is not None:
        return int(cache.quant_lengths[s]) // ps
    return max(-(-int(cache.lengths[s]) // ps) - 1, 0)


def move(cache: PagedKVCache, slot: int, n_pages: int) -> tuple[PagedKVCache, pt.AllocStatus]:
    """Makes the first `n_pages` pages of `slot` live on the host and the rest on the device.

    Pages between the slot's current host count and `n_pages` are copied device->host
    (more on the host) or host->device (fewer), and their old tier's pages are released.
    Call it between steps: attention treats host pages as older than every query, so a
    step's own new tokens must be on the device (they are: they sit in the last pages).

    Args:
      cache: a cache with a host tier (donated).
      slot: the live slot.
      n_pages: pages to keep on the host, in [0, min(stream_pages, movable)] where
        movable is every page but the last (KIVI: the quantized pages).

    Returns:
      (cache, status): OUT_OF_PAGES (nothing changed) when the receiving tier is full.
    """
    tier = _tier(cache, "move")
    s = _check_slot("move", cache, slot)
    n = int(n_pages)
    limit = min(tier.stream_pages, _movable(cache, s))
    if not 0 <= n <= limit:
        raise ValueError(
            f"move: slot {s} can keep 0 .. {limit} pages on the host (stream_pages "
            f"{tier.stream_pages}; every page but the last"
            f"{', quantized pages only' if cache.tail is not None else ''}), got {n}.")
    h = int(host_pages(cache)[s])
    k = _bucket(abs(n - h), cache.spec.max_pages_per_seq)
    return _move(cache, jnp.int32(s), jnp.int32(n), k=k)


@functools.partial(jax.jit, donate_argnames="cache", static_argnames="k")
def _move(cache: PagedKVCache, s, n, *, k: int):
    spec, tier = cache.spec, cache.host
    ps, dev_sink, host_sink = spec.page_size, spec.num_pages, tier.num_pages
    h = tier.table.lengths[s] // ps
    cols = jnp.arange(spec.max_pages_per_seq)
    out = (cols >= h) & (cols < n)        # device -> host
    back = (cols >= n) & (cols < h)       # host -> device
    rows_d = jnp.arange(spec.max_seqs)[:, None] == s
    rows_h = jnp.arange(tier.table.max_seqs)[:, None] == s
    ok = (jnp.sum(out) <= tier.table.num_free) & (jnp.sum(back) <= cache.table.num_free)
    out, back = out & ok, back & ok

    htable, new_h, _ = pt.assign_entries(tier.table, rows_h & out[None])
    dtable, new_d, _ = pt.assign_entries(cache.table, rows_d & back[None])
    # Data: device pages of `out` to their new host pages; host pages of `back` home.
    dev_row, host_row = cache.table.block_tables[s], tier.table.block_tables[s]
    pages_h = _copy_out(cache.pages, tier.pages, _pick(out, dev_row[None], k, dev_sink),
                        _pick(out, new_h[s][None], k, host_sink))
    pages_d = _copy_in(cache.pages, pages_h, _pick(back, host_row[None], k, host_sink),
                       _pick(back, new_d[s][None], k, dev_sink))
    # References: the old tier lets go.
    dtable, _ = pt.vacate_entries(dtable, rows_d & out[None])
    htable, _ = pt.vacate_entries(htable, rows_h & back[None])
    htable = dataclasses.replace(
        htable,
        block_tables=jnp.where(ok & rows_h & (cols[None] >= n), -1, htable.block_tables),
        lengths=htable.lengths.at[s].set(jnp.where(ok, n * ps, htable.lengths[s])))
    status = pt.AllocStatus(code=jnp.where(ok, pt.OK, pt.OUT_OF_PAGES).astype(jnp.int32),
                            pages_needed=jnp.sum(out | back, dtype=jnp.int32),
                            pages_free=jnp.where(n > h, tier.table.num_free,
                                                 cache.table.num_free))
    tier = dataclasses.replace(tier, pages=pages_h, table=htable)
    return dataclasses.replace(cache, pages=pages_d, table=dtable, host=tier), status


# --------------------------------------------------------------------------- swap


def _park_rings(cache: PagedKVCache, tier: HostTier, s, r, ok):
    """Each window group's ring of slot s copied to parked row r's host ring pages (all R
    slots, holes included: their flags say which were held). Nothing changes unless ok."""
    rings, held = [], []
    for g, (grp, hr, hh) in enumerate(zip(cache.groups, tier.rings, tier.ring_held,
                                          strict=True)):
        ring = window.ring_size(cache.spec, g)
        row_bt = grp.table.block_tables[s]  # [R], -1 for holes
        dst = jnp.where(ok, r * ring + jnp.arange(ring, dtype=jnp.int32), hr.k.shape[2])
        src = jnp.clip(row_bt, 0, grp.table.num_pages - 1)
        rings.append(KVPages(k=_write_host_pages(hr.k, dst, grp.pages.k, src),
                             v=_write_host_pages(hr.v, dst, grp.pages.v, src)))
        held.append(hh.at[r].set(jnp.where(ok, row_bt >= 0, hh[r])))
    return tuple(rings), tuple(held)


def _unpark_rings(cache: PagedKVCache, tier: HostTier, r, s, ok):
    """Each window group's ring of parked row r brought back into the empty slot s: a fresh
    page at every slot the row held, filled from the host, the group's length the parked
    sequence's. Nothing changes unless ok (the caller checked each group has the pages)."""
    groups = []
    for g, (grp, hr, hh) in enumerate(zip(cache.groups, tier.rings, tier.ring_held,
                                          strict=True)):
        ring = window.ring_size(cache.spec, g)
        rows = (jnp.arange(cache.spec.max_seqs)[:, None] == s) & (hh[r] & ok)[None, :]
        table, new, _ = pt.assign_entries(grp.table, rows)
        table = dataclasses.replace(table, lengths=table.lengths.at[s].set(
            jnp.where(ok, tier.parked_lengths[r], table.lengths[s])))
        src = r * ring + jnp.arange(ring, dtype=jnp.int32)
        pages = KVPages(k=_read_host_pages(grp.pages.k, new[s], hr.k, src),
                        v=_read_host_pages(grp.pages.v, new[s], hr.v, src))
        groups.append(dataclasses.replace(grp, pages=pages, table=table))
    return tuple(groups)


def _check_row(op: str, tier: HostTier, row) -> int:
    r = int(row)
    if not 0 <= r < tier.num_parked:
        raise ValueError(f"{op}: parked row {r} is outside [0, {tier.num_parked}) (attach the "
                         f"tier with more parked rows).")
    return r


def swap_out(cache: PagedKVCache, slot: int, row: int) -> tuple[PagedKVCache, pt.AllocStatus]:
    """Moves the whole sequence of `slot` to parked row `row`; the slot becomes empty.

    Its device pages are copied to fresh host pages (pages it already holds on the host
    move with it), a KIVI tail is copied to the row's ring, each window group's ring
    (`CacheSpec.window_groups`) to the row's R host ring pages (slot j to page r * R + j,
    holes flagged), and the slot is freed.

    Returns:
      (cache, status): OUT_OF_PAGES (nothing changed) when the host pool is too small.

    Raises:
      ValueError: a slot that holds nothing, or a row that is out of range or in use.
    """
    tier = _tier(cache, "swap_out")
    s = _check_slot("swap_out", cache, slot)
    r = _check_row("swap_out", tier, row)
    if int(cache.lengths[s]) == 0:
        raise ValueError(f"swap_out: slot {s} holds no sequence.")
    if int(tier.parked_lengths[r]) != 0:
        raise ValueError(f"swap_out: parked row {r} is in use; drop_parked it first.")
    ps = cache.spec.page_size
    n = -(-int(cache.table.lengths[s]) // ps) - int(host_pages(cache)[s])
    return _swap_out(cache, jnp.int32(s), jnp.int32(r),
                     k=_bucket(n, cache.spec.max_pages_per_seq))


@functools.partial(jax.jit, donate_argnames="cache", static_argnames="k")
def _swap_out(cache: PagedKVCache, s, r, *, k: int):
    spec, tier = cache.spec, cache.host
    ps, dev_sink, host_sink = spec.page_size, spec.num_pages, tier.num_pages
    row = spec.max_seqs + r
    h = tier.table.lengths[s] // ps
    dev_len = cache.table.lengths[s]
    cols = jnp.arange(spec.max_pages_per_seq)
    out = (cols >= h) & (cols < (dev_len + ps - 1) // ps)
    ok = jnp.sum(out) <= tier.table.num_free
    out = out & ok
    rows_h = jnp.arange(tier.table.max_seqs)[:, None] == row
    htable, new_h, _ = pt.assign_entries(tier.table, rows_h & out[None])
    pages_h = _copy_out(cache.pages, tier.pages,
                        _pick(out, cache.table.block_tables[s][None], k, dev_sink),
                        _pick(out, new_h[row][None], k, host_sink))
    # The parked row takes over the live row's host pages (references move, no copy).
    live = cols < h
    bt = htable.block_tables
    bt = bt.at[row].set(jnp.where(ok & live, bt[s], bt[row]))
    bt = bt.at[s].set(jnp.where(ok, -1, bt[s]))
    lengths = htable.lengths.at[row].set(jnp.where(ok, dev_len, htable.lengths[row]))
    lengths = lengths.at[s].set(jnp.where(ok, 0, lengths[s]))
    htable = dataclasses.replace(htable, block_tables=bt, lengths=lengths)
    tail_a, tail_b = tier.tail_a, tier.tail_b
    if cache.tail is not None:
        def park(ring_h, ring_d):
            return _write_host_pages(ring_h, jnp.where(ok, r, tier.num_parked), ring_d, s)
        tail_a, tail_b = park(tier.tail_a, cache.tail.a), park(tier.tail_b, cache.tail.b)
    parked = tier.parked_lengths.at[r].set(jnp.where(ok, cache.lengths[s],
                                                     tier.parked_lengths[r]))
    rings, ring_held = _park_rings(cache, tier, s, r, ok)
    tier = dataclasses.replace(tier, pages=pages_h, table=htable, parked_lengths=parked,
                               tail_a=tail_a, tail_b=tail_b, rings=rings, ring_held=ring_held)
    # The device slot: host-resident entries are already out of its references.
    flags = (jnp.arange(spec.max_seqs) == s) & ok
    cache = dataclasses.replace(cache, host=None)
    cache = (quantized if cache.tail is not None else paged).free(cache, flags)
    cache = window.free(cache, flags)
    status = pt.AllocStatus(code=jnp.where(ok, pt.OK, pt.OUT_OF_PAGES).astype(jnp.int32),
                            pages_needed=jnp.sum(out, dtype=jnp.int32),
                            pages_free=tier.table.num_free)
    return dataclasses.replace(cache, host=tier), status


def swap_in(cache: PagedKVCache, row: int, slot: int) -> tuple[PagedKVCache, pt.AllocStatus]:
    """Brings parked row `row` back into the empty `slot`, all its pages on the device
    (each window group's ring: a fresh page at every ring slot it held, holes left holes).

    Returns:
      (cache, status): OUT_OF_PAGES (nothing changed) when the device pool is too small.

    Raises:
      ValueError: a row that holds nothing, or a slot that is out of range or in use.
    """
    tier = _tier(cache, "swap_in")
    r = _check_row("swap_in", tier, row)
    s = _check_slot("swap_in", cache, slot)
    if int(tier.parked_lengths[r]) == 0:
        raise ValueError(f"swap_in: parked row {r} holds no sequence.")
    if int(cache.lengths[s]) != 0:
        raise ValueError(f"swap_in: slot {s} holds a sequence; free it first.")
    n = -(-int(tier.table.lengths[cache.spec.max_seqs + r]) // cache.spec.page_size)
    return _swap_in(cache, jnp.int32(r), jnp.int32(s),
                    k=_bucket(n, cache.spec.max_pages_per_seq))


@functools.partial(jax.jit, donate_argnames="cache", static_argnames="k")
def _swap_in(cache: PagedKVCache, r, s, *, k: int):
    spec, tier = cache.spec, cache.host
    ps, dev_sink = spec.page_size, spec.num_pages
    row = spec.max_seqs + r
    dev_len = tier.table.lengths[row]
    cols = jnp.arange(spec.max_pages_per_seq)
    back = cols < (dev_len + ps - 1) // ps
    ok = jnp.sum(back) <= cache.table.num_free
    for grp, held in zip(cache.groups, tier.ring_held, strict=True):
        ok &= jnp.sum(held[r], dtype=jnp.int32) <= grp.table.num_free
    back = back & ok
    rows_d = jnp.arange(spec.max_seqs)[:, None] == s
    dtable, new_d, _ = pt.assign_entries(cache.table, rows_d & back[None])
    dtable = dataclasses.replace(
        dtable, lengths=dtable.lengths.at[s].set(jnp.where(ok, dev_len, dtable.lengths[s])))
    pages_d = _copy_in(cache.pages, tier.pages,
                       _pick(back, tier.table.block_tables[row][None], k, tier.num_pages),
                       _pick(back, new_d[s][None], k, dev_sink))
    tail = cache.tail
    if tail is not None:
        tgt = jnp.where(ok, s, spec.max_seqs)

        def unpark(ring_d, ring_h):
            return _read_host_pages(ring_d, tgt, ring_h, r)

        tail = KIVITail(a=unpark(tail.a, tier.tail_a), b=unpark(tail.b, tier.tail_b),
                        lengths=tail.lengths.at[tgt].set(tier.parked_lengths[r], mode="drop"),
                        pending=tail.pending.at[:, tgt].set(0, mode="drop"))
    groups = _unpark_rings(cache, tier, r, s, ok)
    flags = (jnp.arange(tier.table.max_seqs) == row) & ok
    htable, _ = pt.free(tier.table, flags)
    tier = dataclasses.replace(
        tier, table=htable,
        parked_lengths=tier.parked_lengths.at[r].set(jnp.where(ok, 0, tier.parked_lengths[r])))
    status = pt.AllocStatus(code=jnp.where(ok, pt.OK, pt.OUT_OF_PAGES).astype(jnp.int32),
                            pages_needed=jnp.sum(back, dtype=jnp.int32),
                            pages_free=cache.table.num_free)
    return dataclasses.replace(cache, pages=pages_d, table=dtable, tail=tail, host=tier,
                               groups=groups), status


def drop_parked(cache: PagedKVCache, row: int) -> PagedKVCache:
    """Forgets parked row `row`; its host pages return to the host pool."""
    tier = _tier(cache, "drop_parked")
    r = _check_row("drop_parked", tier, row)
    return _drop_parked(cache, jnp.int32(r))


@functools.partial(jax.jit, donate_argnames="cache")
def _drop_parked(cache: PagedKVCache, r):
    tier = cache.host
    flags = jnp.arange(tier.table.max_seqs) == cache.spec.max_seqs + r
    htable, _ = pt.free(tier.table, flags)
    tier = dataclasses.replace(tier, table=htable,
                               parked_lengths=tier.parked_lengths.at[r].set(0))
    return dataclasses.replace(cache, host=tier)


def compile_swaps(cache: PagedKVCache, slot: int, row: int) -> PagedKVCache:
    """Compiles `swap_out` and `swap_in` for every copy width they may use, by running each
    on the empty `slot` and the free parked `row`: a swap of nothing changes nothing, and
    the row is dropped after (as `drop_parked` leaves it), so the cache comes back as it
    was. For a server that compiles its programs before taking requests.

    Args:
      cache: a cache with a host tier (donated).
      slot: an empty slot.
      row: a parked row that holds nothing.

    Returns:
      The cache, its contents unchanged.

    Raises:
      ValueError: no host tier, a slot that holds a sequence, a row in use, or either
        out of range.
    """
    tier = _tier(cache, "compile_swaps")
    s = _check_slot("compile_swaps", cache, slot)
    r = _check_row("compile_swaps", tier, row)
    if int(cache.lengths[s]) != 0:
        raise ValueError(f"compile_swaps: slot {s} holds a sequence; give an empty one.")
    if int(tier.parked_lengths[r]) != 0:
        raise ValueError(f"compile_swaps: parked row {r} is in use; give a free one.")
    mp = cache.spec.max_pages_per_seq
    s_, r_ = jnp.int32(s), jnp.int32(r)
    for k in sorted({_bucket(n, mp) for n in range(mp + 1)}):
        cache, _ = _swap_out(cache, s_, r_, k=k)
        cache, _ = _swap_in(cache, r_, s_, k=k)
    return _drop_parked(cache, r_)


# --------------------------------------------------------------------------- the generic ops


def _live(tier: HostTier, flags: Bool[Array, " max_seqs"]) -> Bool[Array, " rows"]:
    """Live-slot flags widened to the host table's rows (parked rows unflagged)."""
    return jnp.concatenate([flags, jnp.zeros((tier.num_parked,), bool)])


def after_fork(cache: PagedKVCache, src, dst, status: pt.AllocStatus) -> PagedKVCache:
    """The host rows of forked slots follow their sources (their host pages shared)."""
    if cache.host is None:
        return cache
    htable, _ = pt.fork(cache.host.table, src, dst)
    htable = _ok_where(status.ok, htable, cache.host.table)
    return dataclasses.replace(cache, host=dataclasses.replace(cache.host, table=htable))


def after_free(cache: PagedKVCache, seqs: Bool[Array, " max_seqs"]) -> PagedKVCache:
    """Freed slots' host pages return to the host pool."""
    if cache.host is None:
        return cache
    htable, _ = pt.free(cache.host.table, _live(cache.host, seqs))
    return dataclasses.replace(cache, host=dataclasses.replace(cache.host, table=htable))


def truncate_allowed(cache: PagedKVCache, new_lengths: Int[Array, " max_seqs"]):
    """Whether every new length keeps the host pages whole: at least the host tokens,
    or a whole number of pages."""
    if cache.host is None:
        return jnp.bool_(True)
    hl = cache.host.table.lengths[: cache.spec.max_seqs]
    return jnp.all((new_lengths >= hl) | (new_lengths % cache.spec.page_size == 0))


def after_truncate(cache: PagedKVCache, new_lengths, status: pt.AllocStatus) -> PagedKVCache:
    """Host rows shortened with their slots (to min(host tokens, new length))."""
    if cache.host is None:
        return cache
    tier = cache.host
    hl = tier.table.lengths
    new = jnp.concatenate([jnp.minimum(hl[: cache.spec.max_seqs], new_lengths),
                           hl[cache.spec.max_seqs:]])
    htable, _, _ = pt.truncate(tier.table, new)
    htable = _ok_where(status.ok, htable, tier.table)
    return dataclasses.replace(cache, host=dataclasses.replace(tier, table=htable))


# --------------------------------------------------------------------------- attention


def device_part(cache: PagedKVCache) -> PagedKVCache:
    """The cache as the device sees it: each slot starts at its first device page.

    Block tables shift left by the slot's host pages and lengths drop by their tokens
    (a KIVI ring rotates so that position p - H sits at slot (p - H) mod ring).
    """
    spec, ps = cache.spec, cache.spec.page_size
    h = host_pages(cache)
    cols = jnp.arange(spec.max_pages_per_seq)[None, :] + h[:, None]
    bt = jnp.take_along_axis(cache.table.block_tables,
                             jnp.clip(cols, 0, spec.max_pages_per_seq - 1), axis=1)
    bt = jnp.where(cols < spec.max_pages_per_seq, bt, -1)
    table = dataclasses.replace(cache.table, block_tables=bt,
                                lengths=cache.table.lengths - h * ps)
    tail = cache.tail
    if tail is not None:
        ring = tail.a.shape[3]
        idx = (jnp.arange(ring)[None, :] + (h * ps)[:, None]) % ring   # [max_seqs, ring]

        def rotate(x):
            return jnp.take_along_axis(x, idx[None, None, :, :, None], axis=3)

        tail = dataclasses.replace(tail, a=rotate(tail.a), b=rotate(tail.b),
                                   lengths=tail.lengths - h * ps)
    return dataclasses.replace(cache, table=table, tail=tail, host=None)


def _layer_pools(cache: PagedKVCache, layer, pages=None):
    """Pools of one layer (the host's, or those of `pages`, a tree of the same structure)
    as (kind, arrays): full-precision (a, b), or the quantized pools' (codes, scale, zero)
    with their bits and grouping."""
    pages = cache.host.pages if pages is None else pages
    spec = cache.spec
    if cache.tail is None:
        return [("dense", p, None) for p in paged._pools(pages)], layer
    gi, li = quantized._locate(spec, layer)
    if spec.is_mla:
        return [("quant", pages.c_kv[gi], None), ("dense", pages.k_rope, None)], (li, layer)
    return [("quant", pages.k[gi], None), ("quant", pages.v[gi], None)], (li, li)


def _gather_layer(cache: PagedKVCache, layer, ids: Int[Array, "batch n"]):
    """One layer's host pages `ids` as float32 `[batch, heads, n * page_size, width]`
    on the device, for K and V (MLA: c_KV and k_rope)."""
    spec = cache.spec
    pools, idx = _layer_pools(cache, layer)
    dev_pools, _ = _layer_pools(cache, layer, cache.pages)  # the element types
    b, n = ids.shape
    flat = _to_host(ids.reshape(-1))

    def take(arrays, li, f):  # one gather per pool: [pages, heads, ...]
        return [a[li, :, f] for a in arrays]

    out = []
    for i, ((kind, pool, _), (_, dev, _)) in enumerate(zip(pools, dev_pools, strict=True)):
        li = idx[i] if isinstance(idx, tuple) else idx
        li_h = _to_host(jnp.broadcast_to(jnp.asarray(li, jnp.int32), flat.shape))
        if kind == "dense":
            (block,) = _on_host(take, [pool], li_h, flat)
            x = jnp.moveaxis(_from_host_bits(block, dev.dtype), 0, 1).astype(jnp.float32)
        else:
            assert isinstance(pool, QuantPool)
            parts = _on_host(take, [pool.codes, pool.scale, pool.zero], li_h, flat)
            codes, scale, zero = (jnp.moveaxis(_from_host_bits(p, d.dtype), 0, 1)
                                  for p, d in zip(parts, (dev.codes, dev.scale, dev.zero),
                                                  strict=True))
            x = dequantize(codes, scale, zero, bits=pool.bits, grouping=pool.grouping)
        heads = x.shape[0]
        x = x.reshape(heads, b, n * spec.page_size, x.shape[-1])
        out.append(jnp.moveaxis(x, 0, 1))
    return out


# float32 dots at float32 precision, as the device pages' kernels and XLA path compute
# them (a GPU's default float32 dot rounds its inputs to TF32).
_EXACT = jax.lax.Precision.HIGHEST


def _dense_attend(qs, keys, values, valid, *, scale, soft_cap):
    """Softmax attention of `qs` [batch, q_len, q_heads, w] (tuple: parts whose logits
    add) over keys / values [batch, kv_heads, t, w] with valid [batch, q_len, t];
    returns (out, lse) with lse -inf and out 0 for a row with no valid key."""
    b, q_len, q_heads, _ = qs[0].shape
    kv_heads = keys[0].shape[1]
    g = q_heads // kv_heads
    logits = 0.0
    for q, k in zip(qs, keys, strict=True):
        qg = q.astype(jnp.float32).reshape(b, q_len, kv_heads, g, q.shape[-1])
        logits = logits + jnp.einsum("bqhgd,bhtd->bqhgt", qg, k, precision=_EXACT)
    logits = logits * scale
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    logits = jnp.where(valid[:, :, None, None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(logits - m)
    total = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("bqhgt,bhtd->bqhgd", p / jnp.where(total > 0, total, 1.0), values,
                     precision=_EXACT)
    lse = jnp.where(total[..., 0] > 0, jnp.log(total[..., 0]) + m[..., 0], -jnp.inf)
    return (out.reshape(b, q_len, q_heads, -1),
            lse.reshape(b, q_len, q_heads))


def attend_host(cache: PagedKVCache, layer, q, q_lengths, seq_ids, *, scale, soft_cap,
                sliding_window):
    """Attention over each row's host pages of one layer: (out float32, lse)."""
    spec = cache.spec
    tier = cache.host
    rows = jnp.arange(spec.max_seqs) if seq_ids is None else seq_ids
    n = tier.stream_pages
    ids = tier.table.block_tables[rows, :n]
    h_tok = tier.table.lengths[rows]
    ids = jnp.where(jnp.arange(n)[None, :] * spec.page_size < h_tok[:, None], ids, 0)
    a, b = _gather_layer(cache, layer, ids)
    q0 = q[0] if spec.is_mla else q
    q_len = q0.shape[1]
    t = jnp.arange(n * spec.page_size)
    valid = t[None, :] < h_tok[:, None]
    valid = jnp.broadcast_to(valid[:, None, :], (valid.shape[0], q_len, t.size))
    if sliding_window is not None:
        q_pos = (cache.lengths[rows][:, None] - q_lengths[:, None]
                 + jnp.arange(q_len)[None, :])
        valid = valid & (t[None, None, :] > q_pos[:, :, None] - sliding_window)
    if spec.is_mla:
        return _dense_attend(q, (a, b), a, valid, scale=scale, soft_cap=None)
    return _dense_attend((q,), (a,), b, valid, scale=scale, soft_cap=soft_cap)


def merge(dev, host):
    """Device and host partial attention merged (out in the device result's dtype)."""
    out, lse = merge_attention_states(dev[0], dev[1], host[0].astype(dev[0].dtype), host[1])
    return out, lse


# --------------------------------------------------------------------------- checks, bytes


def check(cache: PagedKVCache) -> None:
    """Host-side check of both tiers; AssertionError naming a breach.

    Each tier's allocator invariants (refcounts equal the references, the free stack
    holds exactly the unreferenced pages), where they meet (a live slot's host
    entries are marked on the device and counted on the host, never on both;
    whole pages, never more than the slot's paged tokens), and the parked rows (a row's
    host length matches its tokens; free rows hold nothing).
    """
    tier = _tier(cache, "check")
    spec, ps = cache.spec, cache.spec.page_size
    hl = np.asarray(tier.table.lengths)
    live = hl[: spec.max_seqs]
    if (live % ps).any():
        raise AssertionError(f"host rows of live slots must hold whole pages: {live}")
    pt.check_invariants(cache.table, elsewhere=live // ps)
    pt.check_invariants(tier.table)
    dev = np.asarray(cache.table.lengths)
    if (live > dev).any():
        s = int(np.nonzero(live > dev)[0][0])
        raise AssertionError(f"slot {s} holds {live[s]} host tokens but only {dev[s]} tokens in "
                             f"pages")
    parked = np.asarray(tier.parked_lengths)
    prow = hl[spec.max_seqs:]
    if ((parked == 0) & (prow != 0)).any():
        raise AssertionError(f"a free parked row holds pages: lengths {prow}, tokens {parked}")
    if cache.tail is None and (prow != parked).any():
        raise AssertionError(f"parked rows' pages {prow} disagree with their tokens {parked}")
    if cache.tail is not None:
        want = np.asarray(quantized.quantized_tokens(spec, jnp.asarray(parked)))
        if ((prow < want) | (prow > parked) | (prow % ps != 0)).any():
            raise AssertionError(f"parked KIVI rows hold {prow} quantized tokens of {parked}")


def tier_bytes(cache: PagedKVCache) -> dict[str, int]:
    """Bytes of each tier's pools ('device', 'host'; a KIVI cache's rings included)."""
    def size(tree):
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))

    dev = size(cache.pages) + (0 if cache.tail is None else size((cache.tail.a, cache.tail.b)))
    host = 0 if cache.host is None else size(
        (cache.host.pages, cache.host.tail_a, cache.host.tail_b))
    return {"device": int(dev), "host": int(host)}

