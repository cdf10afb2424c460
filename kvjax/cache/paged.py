"""Full-precision pages (`KVPages`, `LatentPages`): allocation, token writes, layer views.

The functions here are the full-precision kind's implementation of the generic
cache operations; use them through `kvjax.cache` (`reserve`, `fork`, `free`,
`write`, `attend`, `layer_view`), which dispatches on the page kind. They are pure:
the jitted entry points of `kvjax.cache` donate the cache, so the pools are updated
in place, and their cost does not grow with unused pool capacity: writes and copies
scatter only the pages they touch.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kvjax.backends import cpu
from kvjax.cache import page_table as pt
from kvjax.cache import sharded_table as st
from kvjax.cache.state import KVPages, LatentPages, LayerView, PagedKVCache, Slots
from kvjax.specs import CacheSpec

__all__ = [
    "init_cache",
    "reserve",
    "fork",
    "free",
    "truncate",
    "token_slots",
    "write_layer",
    "layer_view",
    "set_drop",
    "set_rows",
    "set_pages",
    "copy_pages",
    "all_pools",
]


def init_cache(spec: CacheSpec) -> PagedKVCache:
    """An empty full-precision cache for `spec`: zeroed pools, no sequence, every page free."""
    shape_a, shape_b = spec.pool_shapes
    a = jnp.zeros(shape_a, spec.dtype)
    b = jnp.zeros(shape_b, spec.dtype)
    if spec.is_mla:
        index_k = (None if spec.indexer is None
                   else jnp.zeros(spec.index_pool_shape, spec.indexer.dtype))
        pages = LatentPages(c_kv=a, k_rope=b, index_k=index_k)
    else:
        pages = KVPages(k=a, v=b)
    table = pt.init_page_table(
        num_pages=spec.num_pages, max_seqs=spec.max_seqs,
        max_pages_per_seq=spec.max_pages_per_seq, page_size=spec.page_size,
    )
    return PagedKVCache(pages=pages, table=table, spec=spec)


def set_drop(x: Array, index, values) -> Array:
    """`x.at[index].set(values, mode="drop")`; 16-bit floats go through integer bits on CPU.

    XLA:CPU has no bfloat16 scatter: it widens the whole operand to float32, scatters,
    and narrows it back, for every write of a few rows. A scatter of the same bits as
    uint16 is about twice as fast (measured: the bitcasts still copy the operand); the
    hot token writes use `set_rows` instead.
    """
    if _cpu_16bit(x):
        bits = jax.lax.bitcast_convert_type(x, jnp.uint16)
        vals = jax.lax.bitcast_convert_type(jnp.asarray(values, x.dtype), jnp.uint16)
        return jax.lax.bitcast_convert_type(bits.at[index].set(vals, mode="drop"), x.dtype)
    return x.at[index].set(values, mode="drop")


def set_rows(pool: Array, layer, i1: Array, i2: Array, x: Array, *,
             after: tuple[Array, ...] = ()) -> Array:
    """`pool.at[layer, :, i1, i2, :].set(x, mode="drop")`: x [rows, heads, width], i1, i2 [rows].

    The token writes of the cache (pages and KIVI tails). For 16-bit float pools on CPU it
    is a custom call that copies the rows in place (`kvjax.backends.cpu.write_rows`):
    XLA:CPU's own scatter or dynamic-update-slice widens or copies the whole pool on every
    write of a few rows. Elsewhere, or without the CPU kernels, the XLA scatter. `after`:
    values read from `pool` before this write (see `write_rows`; the scatter ignores it).
    """
    cpu = _in_place_kernels(pool)
    if cpu is not None:
        return cpu.write_rows(pool, layer, i1, i2, x, after=after)
    return set_drop(pool, (layer, slice(None), i1, i2, slice(None)), x)


def get_rows(pool: Array, layer, i1: Array, i2: Array) -> Array:
    """`pool[layer, :, i1, i2, :]` as [rows, heads, width] for in-range indices (i1, i2
    [rows]): rows a `set_rows` write may overwrite next, read first (pass them as its
    `after`). 16-bit float pools on CPU read through a custom call that copies the rows
    (`kvjax.backends.cpu.read_rows`); elsewhere the XLA gather.
    """
    cpu = _in_place_kernels(pool)
    if cpu is not None:
        return cpu.read_rows(pool, layer, i1, i2)
    return jnp.moveaxis(pool[layer][:, i1, i2], 0, 1)


def set_pages(pool: Array, layer, page_ids: Int[Array, " n"], x: Array) -> Array:
    """`pool.at[layer, :, page_ids].set(x, mode="drop")`: x [n, heads, n2, width].

    Whole-page writes (KIVI pages as they are quantized, their scales and zero-points).
    16-bit float pools on CPU go through `set_rows`'s in-place custom call, one row per
    (page, n2): the scatter would copy the whole pool on every write.
    """
    if _in_place_kernels(pool) is None:
        return set_drop(pool, (layer, slice(None), page_ids), x)
    n, heads, n2, width = x.shape
    i1 = jnp.repeat(page_ids, n2)
    i2 = jnp.tile(jnp.arange(n2, dtype=page_ids.dtype), n)
    return set_rows(pool, layer, i1, i2, jnp.moveaxis(x, 2, 1).reshape(n * n2, heads, width))


def _cpu_16bit(x: Array) -> bool:
    return (jnp.dtype(x.dtype).itemsize == 2 and jnp.issubdtype(x.dtype, jnp.floating)
            and jax.default_backend() == "cpu")


def _in_place_kernels(x: Array):
    """`kvjax.backends.cpu` when x (a 5-D pool) is 16-bit float on CPU and the kernels
    are built (its `write_rows` / `copy_pages` then update x in place), else None."""
    if x.ndim != 5 or not _cpu_16bit(x):
        return None
    return cpu if cpu.choose("write_rows", dtype=x.dtype).use_kernel else None


def copy_pages(pages, src: Int[Array, " n"], dst: Int[Array, " n"]):
    """pages[:, :, dst] = pages[:, :, src] for every pool; dst == num_pages is skipped.

    Runs in every `reserve` (copy-on-write of shared last pages): pools on CPU take the
    in-place custom call (XLA's copy reads one page per slot of every layer, whether or
    not it is copied: a few MB per reserve).
    """
    def copy(x):
        if x.size == 0:  # a cache whose every layer lives in window groups
            return x
        if (x.ndim == 5 and jax.default_backend() == "cpu"
                and cpu.choose("copy_pages", dtype=x.dtype).use_kernel):
            return cpu.copy_pages(x, src, dst)
        return set_drop(x, (slice(None), slice(None), dst), x[:, :, src])

    return jax.tree.map(copy, pages)


def _zero_pages(pages, ids: Int[Array, " n"]):
    return jax.tree.map(lambda x: set_drop(x, (slice(None), slice(None), ids), 0), pages)


def allocator(table: pt.PageTable):
    """The allocator module for `table`: per-shard free stacks when the pool is sharded."""
    return st if isinstance(table, st.ShardedPageTable) else pt


def reserve(
    cache: PagedKVCache, num_new: Int[Array, " max_seqs"]
) -> tuple[PagedKVCache, pt.AllocStatus]:
    """Grows sequences by `num_new[s]` tokens: allocates pages, copies shared pages first.

    Args:
      cache: the cache.
      num_new: int32[max_seqs], tokens each sequence is about to receive (0 for idle slots).

    Returns:
      (cache, status): `cache.lengths` already counts the new tokens; write them
      with `write_layer` at positions [old_length, old_length + num_new). On
      failure (out of pages, too long) nothing changes, and
      `status.raise_if_error()` raises `CacheFullError` on the host.
    """
    table, copy, status = allocator(cache.table).reserve(cache.table, num_new)
    pages = copy_pages(cache.pages, copy.src, copy.dst)
    return dataclasses.replace(cache, pages=pages, table=table), status


def fork(
    cache: PagedKVCache, src: Int[Array, " n"], dst: Int[Array, " n"]
) -> tuple[PagedKVCache, pt.AllocStatus]:
    """Makes each `dst[i]` slot share every page of sequence `src[i]` (no copy).

    Args:
      cache: the cache (donated).
      src, dst: int32[n] slot ids; each dst must be empty, distinct, and not a src.

    Returns:
      (cache, status): status code BAD_FORK (nothing changed) if a target is unusable.
    """
    table, status = allocator(cache.table).fork(cache.table, src, dst)
    return dataclasses.replace(cache, table=table), status


def free(
    cache: PagedKVCache, seqs: Bool[Array, " max_seqs"], scrub: bool = False
) -> PagedKVCache:
    """Frees the flagged sequences; pages nobody else holds return to the pool.

    Args:
      cache: the cache (donated).
      seqs: bool[max_seqs], the sequences to free.
      scrub: zero the released pages in every pool (static).
    """
    table, released = allocator(cache.table).free(cache.table, seqs)
    pages = _zero_pages(cache.pages, released) if scrub else cache.pages
    return dataclasses.replace(cache, pages=pages, table=table)


def truncate(
    cache: PagedKVCache, new_lengths: Int[Array, " max_seqs"]
) -> tuple[PagedKVCache, pt.AllocStatus]:
    """Shortens sequences to `new_lengths`; whole pages past the new ends return to the pool.

    Returns:
      (cache, status): BAD_TRUNCATE (nothing changed) if a new length is negative or
      longer than the sequence.
    """
    table, _, status = allocator(cache.table).truncate(cache.table, new_lengths)
    return dataclasses.replace(cache, table=table), status


def token_slots(
    cache: PagedKVCache,
    positions: Int[Array, "batch q_len"],
    valid: Bool[Array, "batch q_len"],
    seq_ids: Int[Array, " batch"] | None = None,
) -> Slots:
    """Page and in-page offset for tokens at `positions` of sequences `seq_ids`.

    Compute once per step and reuse for every layer's `write_layer`. Tokens
    with `valid == False` (padding) map to the out-of-range page and are never
    written. Positions must lie inside each sequence's reserved length.

    Args:
      cache: the cache (not modified).
      positions: int32[batch, q_len], token positions within their sequence.
      valid: bool[batch, q_len], which tokens are real.
      seq_ids: int32[batch] slots of the batch rows; defaults to all slots in order.
    """
    spec = cache.spec
    if positions.ndim != 2 or valid.shape != positions.shape:
        raise ValueError(
            f"token_slots: positions and valid must both be [batch, q_len]; got "
            f"{positions.shape} and {valid.shape}."
        )
    if seq_ids is None:
        bt = cache.block_tables
    else:
        seq_ids = jnp.asarray(seq_ids, jnp.int32)
        ok = (seq_ids >= 0) & (seq_ids < spec.max_seqs)
        bt = jnp.where(ok[:, None], cache.block_tables[jnp.clip(seq_ids, 0, spec.max_seqs - 1)],
                       -1)
    if bt.shape[0] != positions.shape[0]:
        raise ValueError(
            f"token_slots: positions has batch {positions.shape[0]} but there are "
            f"{bt.shape[0]} sequences (seq_ids or max_seqs)."
        )
    col = jnp.clip(positions // spec.page_size, 0, spec.max_pages_per_seq - 1)
    page = jnp.take_along_axis(bt, col, axis=1)
    # A position no page was reserved for (entry -1), or a slot outside the table, is
    # dropped: a negative index would wrap to the pool's last page.
    inside = (positions >= 0) & (positions < spec.max_tokens_per_seq) & (page >= 0)
    page = jnp.where(valid & inside, page, spec.num_pages)
    return Slots(page=page.astype(jnp.int32), offset=(positions % spec.page_size).astype(jnp.int32))


def _scatter_tokens(pool, layer, slots: Slots, x):
    """pool[layer, :, page, offset, :] = x, x: [batch, q_len, heads, width]."""
    page = slots.page.reshape(-1)
    off = slots.offset.reshape(-1)
    # Advanced indices split by a slice put their axis first: [tokens, heads, width].
    x = x.reshape(-1, *x.shape[2:])
    return set_rows(pool, layer, page, off, x)


def write_layer(
    cache: PagedKVCache,
    layer: int | Int[Array, ""],
    slots: Slots,
    a: Float[Array, "batch q_len heads width_a"],
    b: Float[Array, "batch q_len heads width_b"],
    index_keys: Float[Array, "batch q_len d_index"] | None = None,
) -> PagedKVCache:
    """Writes one layer's new tokens into the pools at `slots`.

    Args:
      cache: the cache; pure function, jit it with the cache donated to update in place.
      layer: layer index (may be traced, e.g. inside a scan over layers; a traced one
        outside the cache writes nothing).
      slots: from `token_slots`.
      a, b: K and V `[batch, q_len, kv_heads, head_dim]` for MHA/GQA/MQA; for MLA
        c_KV `[batch, q_len, d_c]` and k_rope `[batch, q_len, d_rope]` (a head
        axis of 1 may be present or not). Must have the cache's dtype.
      index_keys: the tokens' indexer keys `[batch, q_len, d_index]` in the indexer's
        dtype, exactly when the cache has an indexer (`CacheSpec.indexer`).
    """
    spec = cache.spec
    check_layer(spec, layer)
    layer = write_index(spec, layer)
    if spec.is_mla:
        a = a[:, :, None] if a.ndim == 3 else a
        b = b[:, :, None] if b.ndim == 3 else b
    names = ("c_kv", "k_rope") if spec.is_mla else ("k", "v")
    xs = [a, b]
    if (index_keys is None) != (spec.indexer is None):
        raise ValueError("write_layer: give index_keys exactly when the cache has an indexer "
                         f"(CacheSpec.indexer is {spec.indexer}).")
    if index_keys is not None:
        names += ("index_k",)
        xs.append(index_keys[:, :, None] if index_keys.ndim == 3 else index_keys)
    pools = [getattr(cache.pages, n) for n in names]
    for name, pool, x in zip(names, pools, xs, strict=True):
        want = (*slots.page.shape, pool.shape[1], pool.shape[4])
        if x.shape != want:
            raise ValueError(
                f"write_layer: {name} must have shape [batch, q_len, heads, width] = {want}, "
                f"got {x.shape}."
            )
        if x.dtype != pool.dtype:
            raise TypeError(
                f"write_layer: {name} has dtype {x.dtype} but the cache was built for "
                f"{pool.dtype}; cast it first."
            )
    new = {n: _scatter_tokens(pool, layer, slots, x)
           for n, pool, x in zip(names, pools, xs, strict=True)}
    return dataclasses.replace(cache, pages=dataclasses.replace(cache.pages, **new))


def _pools(pages) -> tuple[jax.Array, jax.Array]:
    """The two pools attention reads: K and V, or MLA's c_KV and k_rope."""
    return tuple(getattr(pages, f.name) for f in dataclasses.fields(pages)[:2])


def all_pools(pages) -> dict[str, jax.Array]:
    """Every pool of full-precision pages by field name (with MLA's indexer keys, if any)."""
    return {f.name: getattr(pages, f.name) for f in dataclasses.fields(pages)
            if getattr(pages, f.name) is not None}


def layer_view(cache: PagedKVCache, layer: int | Int[Array, ""]) -> LayerView:
    """One layer's pools plus the block tables and lengths, ready for `kvjax.attention`.

    A traced `layer` outside the cache gives pools of NaN (see `traced_layer_ok`).
    """
    check_layer(cache.spec, layer)
    ok = traced_layer_ok(cache.spec, layer)
    a, b = (poison_unless(ok, p[layer]) for p in _pools(cache.pages))
    if cache.spec.is_mla:
        a, b = a[0], b[0]
    return LayerView(k=a, v=b, block_tables=cache.block_tables, lengths=cache.lengths)


def check_layer(spec: CacheSpec, layer) -> None:
    """ValueError for a static layer index outside [0, num_layers) (traced ones pass: a
    traced one outside is read as NaN and written nowhere, see `traced_layer_ok`)."""
    if isinstance(layer, jax.core.Tracer):
        return
    if not hasattr(layer, "__index__") and not (hasattr(layer, "ndim") and layer.ndim == 0):
        raise TypeError(f"layer must be an int or an int32 scalar, got {layer!r}.")
    value = int(layer)
    if not 0 <= value < spec.num_layers:
        raise ValueError(f"layer {value} is outside the cache's {spec.num_layers} layers "
                         f"(allowed: 0 .. {spec.num_layers - 1}).")


def traced_layer_ok(spec: CacheSpec, layer) -> Bool[Array, ""] | None:
    """Whether a traced layer index lies in [0, num_layers): a traced bool; None for a
    concrete index, which `check_layer` has already checked on the host.

    Under jit an index past the cache cannot raise, and indexing would clamp it to the
    nearest layer (a silently wrong read); readers turn what they return into NaN
    instead (`poison_unless`), and writes to it are dropped.
    """
    if not isinstance(layer, jax.core.Tracer):
        return None
    return (layer >= 0) & (layer < spec.num_layers)


def write_index(spec: CacheSpec, layer):
    """The layer index a write scatters to: a traced one outside [0, num_layers) becomes
    num_layers, which every scatter drops (a negative one would wrap to a real layer)."""
    ok = traced_layer_ok(spec, layer)
    return layer if ok is None else jnp.where(ok, layer, spec.num_layers)


def poison_unless(ok: Bool[Array, ""] | None, x: Array) -> Array:
    """`x`, or NaN everywhere when `ok` is false; `ok` None (concrete, checked) and
    non-float arrays (codes, whose scales carry the NaN) pass unchanged."""
    if ok is None or not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    return jnp.where(ok, x, jnp.array(jnp.nan, x.dtype))
