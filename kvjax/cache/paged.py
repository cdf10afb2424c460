"""The paged KV cache pytree and the pure functions that grow, write, fork and free it.

Every page pool, for every cache kind, has the layout

    [layers, heads, pages, page_size, width]

(`heads` = kv_heads for MHA/GQA/MQA, 1 for MLA's latent "head"), so that paging
operations (copy-on-write, scrubbing) and sharding treat all pools alike: the
page axis is always axis 2 and the head axis axis 1.

The functions exported as jitted entry points donate the cache: the pools are
updated in place, and the caller must use the returned cache. Their cost does
not grow with unused pool capacity: writes and copies scatter only the pages
they touch.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kvjax.backends import cpu
from kvjax.cache import page_table as pt
from kvjax.cache import sharded_table as st
from kvjax.specs import CacheSpec

__all__ = [
    "KVPages",
    "LatentPages",
    "PagedKVCache",
    "LayerView",
    "Slots",
    "init_cache",
    "reserve",
    "fork",
    "free",
    "token_slots",
    "write_layer",
    "layer_view",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVPages:
    """Key and value page pools of an MHA/GQA/MQA cache, all layers."""

    k: Float[Array, "layers kv_heads pages page_size head_dim"]
    v: Float[Array, "layers kv_heads pages page_size head_dim"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LatentPages:
    """MLA latent pools, all layers: normalised c_KV and the shared rotary key."""

    c_kv: Float[Array, "layers 1 pages page_size d_c"]
    k_rope: Float[Array, "layers 1 pages page_size d_rope"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """A paged KV cache: page pools for every layer and the page table they share.

    Attributes:
      pages: `KVPages` (MHA/GQA/MQA) or `LatentPages` (MLA).
      table: block tables, lengths, reference counts and the free stack.
      spec: the static `CacheSpec` the cache was built from.
    """

    pages: KVPages | LatentPages
    table: pt.PageTable
    spec: CacheSpec = dataclasses.field(metadata=dict(static=True))

    @property
    def lengths(self) -> Int[Array, " max_seqs"]:
        return self.table.lengths

    @property
    def block_tables(self) -> Int[Array, "max_seqs max_pages"]:
        return self.table.block_tables

    @property
    def num_free_pages(self) -> Int[Array, ""]:
        return self.table.num_free


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerView:
    """One layer's pools with the page table, in the layout `kvjax.attention` takes.

    For MLA, `k` is the latent pool and `v` the rotary-key pool, both with the
    latent head axis squeezed away ([pages, page_size, width]).
    """

    k: Float[Array, "..."]
    v: Float[Array, "..."]
    block_tables: Int[Array, "max_seqs max_pages"]
    lengths: Int[Array, " max_seqs"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Slots:
    """Where tokens go in the pools: page id and offset per token; page == num_pages drops it."""

    page: Int[Array, "batch q_len"]
    offset: Int[Array, "batch q_len"]


def init_cache(spec: CacheSpec) -> PagedKVCache:
    """An empty cache for `spec`: zeroed pools, no sequence, every page free."""
    if spec.quant is not None:
        raise ValueError(
            "init_cache: spec.quant is set; build a quantized cache with "
            "kvjax.cache.init_quantized_cache(spec)."
        )
    shape_a, shape_b = spec.pool_shapes
    a = jnp.zeros(shape_a, spec.dtype)
    b = jnp.zeros(shape_b, spec.dtype)
    pages = LatentPages(c_kv=a, k_rope=b) if spec.is_mla else KVPages(k=a, v=b)
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


def set_rows(pool: Array, layer, i1: Array, i2: Array, x: Array) -> Array:
    """`pool.at[layer, :, i1, i2, :].set(x, mode="drop")`: x [rows, heads, width], i1, i2 [rows].

    The token writes of the cache (pages and KIVI tails). For 16-bit float pools on CPU it
    is a custom call that copies the rows in place (`kvjax.backends.cpu.write_rows`):
    XLA:CPU's own scatter or dynamic-update-slice widens or copies the whole pool on every
    write of a few rows. Elsewhere, or without the CPU kernels, the XLA scatter.
    """
    cpu = _in_place_kernels(pool)
    if cpu is not None:
        return cpu.write_rows(pool, layer, i1, i2, x)
    return set_drop(pool, (layer, slice(None), i1, i2, slice(None)), x)


def _cpu_16bit(x: Array) -> bool:
    return (jnp.dtype(x.dtype).itemsize == 2 and jnp.issubdtype(x.dtype, jnp.floating)
            and jax.default_backend() == "cpu")


def _in_place_kernels(x: Array):
    """`kvjax.backends.cpu` when x (a 5-D pool) is 16-bit float on CPU and the kernels
    are built (its `write_rows` / `copy_pages` then update x in place), else None."""
    if x.ndim != 5 or not _cpu_16bit(x):
        return None
    return cpu if cpu.available() else None


def _copy_pages(pages, src: Int[Array, " n"], dst: Int[Array, " n"]):
    """pages[:, :, dst] = pages[:, :, src] for every pool; dst == num_pages is skipped.

    Runs in every `reserve` (copy-on-write of shared last pages): 16-bit pools on CPU take
    the in-place custom call, as `set_rows` does.
    """
    def copy(x):
        cpu = _in_place_kernels(x)
        if cpu is not None:
            return cpu.copy_pages(x, src, dst)
        return set_drop(x, (slice(None), slice(None), dst), x[:, :, src])

    return jax.tree.map(copy, pages)


def _zero_pages(pages, ids: Int[Array, " n"]):
    return jax.tree.map(lambda x: set_drop(x, (slice(None), slice(None), ids), 0), pages)


def _allocator(table: pt.PageTable):
    """The allocator module for `table`: per-shard free stacks when the pool is sharded."""
    return st if isinstance(table, st.ShardedPageTable) else pt


def _check_seq_vector(name: str, x, spec: CacheSpec, dtype_kind: str = "i") -> None:
    shape = getattr(x, "shape", None)
    if shape != (spec.max_seqs,):
        raise ValueError(
            f"{name} must have shape (max_seqs,) = ({spec.max_seqs},), got {shape}."
        )
    if jnp.dtype(x.dtype).kind not in dtype_kind:
        raise TypeError(f"{name} must be {'bool' if dtype_kind == 'b' else 'integer'}, "
                        f"got {x.dtype}.")


@functools.partial(jax.jit, donate_argnames="cache")
def reserve(
    cache: PagedKVCache, num_new: Int[Array, " max_seqs"]
) -> tuple[PagedKVCache, pt.AllocStatus]:
    """Grows sequences by `num_new[s]` tokens: allocates pages, copies shared pages first.

    Args:
      cache: the cache (donated).
      num_new: int32[max_seqs], tokens each sequence is about to receive (0 for idle slots).

    Returns:
      (cache, status): `cache.lengths` already counts the new tokens; write them
      with `write_layer` at positions [old_length, old_length + num_new). On
      failure (out of pages, too long) nothing changes, and
      `status.raise_if_error()` raises `CacheFullError` on the host.
    """
    _check_seq_vector("reserve: num_new", num_new, cache.spec, "iu")
    table, copy, status = _allocator(cache.table).reserve(cache.table, num_new)
    pages = _copy_pages(cache.pages, copy.src, copy.dst)
    return dataclasses.replace(cache, pages=pages, table=table), status


@functools.partial(jax.jit, donate_argnames="cache")
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
    table, status = _allocator(cache.table).fork(cache.table, src, dst)
    return dataclasses.replace(cache, table=table), status


@functools.partial(jax.jit, donate_argnames="cache", static_argnames="scrub")
def free(
    cache: PagedKVCache, seqs: Bool[Array, " max_seqs"], scrub: bool = False
) -> PagedKVCache:
    """Frees the flagged sequences; pages nobody else holds return to the pool.

    Args:
      cache: the cache (donated).
      seqs: bool[max_seqs], the sequences to free.
      scrub: zero the released pages in every pool (static).
    """
    _check_seq_vector("free: seqs", seqs, cache.spec, "b")
    table, released = _allocator(cache.table).free(cache.table, seqs)
    pages = _zero_pages(cache.pages, released) if scrub else cache.pages
    return dataclasses.replace(cache, pages=pages, table=table)


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
    bt = cache.block_tables if seq_ids is None else cache.block_tables[seq_ids]
    if bt.shape[0] != positions.shape[0]:
        raise ValueError(
            f"token_slots: positions has batch {positions.shape[0]} but there are "
            f"{bt.shape[0]} sequences (seq_ids or max_seqs)."
        )
    col = jnp.clip(positions // spec.page_size, 0, spec.max_pages_per_seq - 1)
    page = jnp.take_along_axis(bt, col, axis=1)
    page = jnp.where(valid, page, spec.num_pages)
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
) -> PagedKVCache:
    """Writes one layer's new tokens into the pools at `slots`.

    Args:
      cache: the cache; pure function, jit it with the cache donated to update in place.
      layer: layer index (may be traced, e.g. inside a scan over layers).
      slots: from `token_slots`.
      a, b: K and V `[batch, q_len, kv_heads, head_dim]` for MHA/GQA/MQA; for MLA
        c_KV `[batch, q_len, d_c]` and k_rope `[batch, q_len, d_rope]` (a head
        axis of 1 may be present or not). Must have the cache's dtype.
    """
    spec = cache.spec
    if spec.is_mla:
        a = a[:, :, None] if a.ndim == 3 else a
        b = b[:, :, None] if b.ndim == 3 else b
    pools = _pools(cache.pages)
    names = ("c_kv", "k_rope") if spec.is_mla else ("k", "v")
    for name, pool, x in zip(names, pools, (a, b), strict=True):
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
    new = [_scatter_tokens(pool, layer, slots, x) for pool, x in zip(pools, (a, b), strict=True)]
    pages = type(cache.pages)(*new)
    return dataclasses.replace(cache, pages=pages)


def _pools(pages) -> tuple[jax.Array, jax.Array]:
    return tuple(getattr(pages, f.name) for f in dataclasses.fields(pages))


def layer_view(cache: PagedKVCache, layer: int | Int[Array, ""]) -> LayerView:
    """One layer's pools plus the block tables and lengths, ready for `kvjax.attention`."""
    a, b = (p[layer] for p in _pools(cache.pages))
    if cache.spec.is_mla:
        a, b = a[0], b[0]
    return LayerView(k=a, v=b, block_tables=cache.block_tables, lengths=cache.lengths)


@functools.partial(jax.jit, donate_argnames="cache")
def write_layer_jit(cache, layer, slots, a, b):
    """`write_layer` as a jitted entry point that donates the cache (updates in place)."""
    return write_layer(cache, layer, slots, a, b)
