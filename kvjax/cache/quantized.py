"""A paged KV cache of low-bit codes with a full-precision tail (KIVI, arXiv 2402.02750).

State
  `QuantizedKVCache` = a `PagedKVCache` whose `pages` are `QuantizedKVPages`
  (GQA: packed K and V codes with their scales and zeros) or
  `QuantizedLatentPages` (MLA: packed c_KV codes, scales, zeros and the
  full-precision k_rope), plus a full-precision `KVTail` per sequence slot.
  Every pool of the pages has the layout `[layers, heads, pages, rows, cols]`
  (page axis 2), so the generic copy-on-write and scrub of
  `kvjax.cache.paged` apply to them unchanged.

Which tokens are quantized
  A sequence of L tokens keeps its first
      Q(L) = page_size * floor(max(L - R, 0) / page_size)
  tokens in quantized pages and the other T = L - Q tokens in the tail, so
  the tail holds the most recent max(R, ...) tokens: T = L while L < R, and
  R <= T <= R + page_size - 1 afterwards. R = `QuantSpec.residual` (a
  multiple of the page size, 0 allowed: then only the partly filled page is
  full precision). When decoding fills the oldest tail page (L - R crosses a
  page boundary), `write_layer` quantizes that page and stores it in the pool
  in the same jitted step; a prefill of T tokens quantizes every complete
  page but the tail at once.

Page table and allocator
  The page table (`cache.paged.table`) describes only the quantized pages:
  its `lengths` are Q, a multiple of the page size, and its pages are
  ordinary refcounted pages allocated by `page_table.reserve` when a flush
  needs them (so running out of pages is an `AllocStatus`/`CacheFullError`
  exactly as for full-precision pages). A quantized page is complete when it
  is written and never written again, so sharing it after `fork` needs no
  copy-on-write. The tail is private to each sequence slot: a ring buffer of
  R + page_size tokens (token at position p lives in slot p mod (R +
  page_size)); `fork` copies the source's ring into the target's (at most
  R + page_size tokens per layer) and shares every quantized page.

Per-layer bits
  Layers with the same bit width share one stacked pool (a tuple entry of
  `QuantizedKVPages.k` / `.v` per distinct width, in order of first
  appearance), so memory is exact for each layer's width. With one width for
  all layers the `layer` argument may be traced (scan over layers); with
  mixed widths it must be a Python int.

Example (one decode step of a model with `num_layers` layers)::

    cache, status = reserve(cache, num_new)          # jitted, cache donated
    for layer in range(num_layers):                  # inside the model's jit
        k, v = ...                                   # [max_seqs, 1, kv_heads, head_dim]
        cache = write_layer(cache, layer, k, v)      # flushes completed pages
        out, lse = kvjax.attention.quantized_decode_attention(q, layer_view(cache, layer))

Entry points mirror `kvjax.cache.paged`: `init_quantized_cache`, `reserve`,
`fork`, `free` (jitted, cache donated), and the pure `write_layer` and
`layer_view` for the model's forward pass: after `reserve`, write the new
tokens of every layer with `write_layer`, then attend with
`kvjax.attention.quantized_*_attention(q, layer_view(cache, layer), ...)`.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, UInt8

from kvjax.cache import page_table as pt
from kvjax.cache import paged
from kvjax.cache.quant import quantize_packed
from kvjax.specs import CacheSpec

__all__ = [
    "QuantPool",
    "QuantizedKVPages",
    "QuantizedLatentPages",
    "KVTail",
    "QuantizedKVCache",
    "QuantLayer",
    "QuantizedLayerView",
    "init_quantized_cache",
    "quantized_tokens",
    "tail_capacity",
    "layer_groups",
    "reserve",
    "fork",
    "free",
    "write_layer",
    "write_layer_jit",
    "layer_view",
    "dequantized_sequence",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantPool:
    """Packed codes with their scales and zeros for the layers of one bit width.

    Attributes:
      codes: uint8[layers_g, heads, pages, page_size, width * bits / 8] (layout.py order).
      scale, zero: scale dtype, `[layers_g, heads, pages, page_size / G, width]`
        for grouping "tokens" (keys) or `[..., page_size, width / G]` for "channels".
      bits: code width (static).
      grouping: "tokens" or "channels" (static).
    """

    codes: UInt8[Array, "layers heads pages page_size packed"]
    scale: Float[Array, "layers heads pages srows scols"]
    zero: Float[Array, "layers heads pages srows scols"]
    bits: int = dataclasses.field(metadata=dict(static=True))
    grouping: str = dataclasses.field(metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedKVPages:
    """Quantized K and V pools of an MHA/GQA/MQA cache, one `QuantPool` per bit width."""

    k: tuple[QuantPool, ...]
    v: tuple[QuantPool, ...]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedLatentPages:
    """MLA: quantized c_KV pools (per token, channel groups) and the full-precision k_rope."""

    c_kv: tuple[QuantPool, ...]
    k_rope: Float[Array, "layers 1 pages page_size d_rope"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVTail:
    """Full-precision ring buffers of the most recent tokens of every sequence slot.

    Token at position p of slot s lives at `[:, :, s, p % ring]`. `a` holds K
    (MLA: c_KV), `b` holds V (MLA: k_rope), in the cache dtype.
    """

    a: Float[Array, "layers heads max_seqs ring width_a"]
    b: Float[Array, "layers heads max_seqs ring width_b"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedKVCache:
    """A quantized paged cache with a full-precision tail.

    Attributes:
      paged: `PagedKVCache` with `QuantizedKVPages`/`QuantizedLatentPages`
        pages; its page table counts the quantized tokens only.
      tail: the full-precision ring buffers.
      lengths: int32[max_seqs], all tokens of each sequence (quantized + tail).
      pending: int32[2, max_seqs], what the last `reserve` added: row 0 the new
        tokens (`write_layer` writes positions [start, lengths), start =
        lengths - pending[0]), row 1 the newly quantized tokens (`write_layer`
        quantizes positions [quant_start, quant_lengths)). One array rather
        than two fields, so that no jitted step can return one buffer for two
        leaves (XLA merges identical outputs), which donation would reject.
    """

    paged: paged.PagedKVCache
    tail: KVTail
    lengths: Int[Array, " max_seqs"]
    pending: Int[Array, "2 max_seqs"]

    @property
    def spec(self) -> CacheSpec:
        return self.paged.spec

    @property
    def table(self) -> pt.PageTable:
        return self.paged.table

    @property
    def start(self) -> Int[Array, " max_seqs"]:
        """Length of each sequence before the last `reserve`."""
        return self.lengths - self.pending[0]

    @property
    def quant_start(self) -> Int[Array, " max_seqs"]:
        """Quantized tokens of each sequence before the last `reserve`."""
        return self.paged.table.lengths - self.pending[1]

    @property
    def quant_lengths(self) -> Int[Array, " max_seqs"]:
        """Tokens of each sequence held in quantized pages (a multiple of page_size)."""
        return self.paged.table.lengths

    @property
    def tail_lengths(self) -> Int[Array, " max_seqs"]:
        """Tokens of each sequence held in the full-precision tail."""
        return self.lengths - self.paged.table.lengths

    @property
    def block_tables(self) -> Int[Array, "max_seqs max_pages"]:
        return self.paged.table.block_tables

    @property
    def num_free_pages(self) -> Int[Array, ""]:
        return self.paged.table.num_free


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantLayer:
    """One layer's quantized pool: codes `[heads, pages, page_size, packed]`, scales, zeros.

    With `layer` set (`layer_view(..., whole_pools=True)`), codes, scale and
    zero are the whole pool of the layer's bit width, with a leading layers
    axis, and `layer` is the layer's index in it.
    """

    codes: UInt8[Array, "*layers heads pages page_size packed"]
    scale: Float[Array, "*layers heads pages srows scols"]
    zero: Float[Array, "*layers heads pages srows scols"]
    bits: int = dataclasses.field(metadata=dict(static=True))
    grouping: str = dataclasses.field(metadata=dict(static=True))
    layer: int | Int[Array, ""] | None = None

    def one_layer(self) -> "QuantLayer":
        """This layer's slice of whole pools (itself if it already holds one layer)."""
        if self.layer is None:
            return self
        i = self.layer
        return QuantLayer(codes=self.codes[i], scale=self.scale[i], zero=self.zero[i],
                          bits=self.bits, grouping=self.grouping)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedLayerView:
    """What attention needs from one layer of a `QuantizedKVCache`.

    Attributes:
      k: quantized keys (MLA: quantized c_KV, heads = 1).
      v: quantized values, or for MLA the k_rope pool `[1, pages, page_size, d_rope]`.
      tail_k, tail_v: `[heads, max_seqs, ring, width]` full-precision rings (MLA:
        c_KV and k_rope).
      block_tables: int32[max_seqs, max_pages] of the quantized pages.
      quant_lengths: int32[max_seqs], tokens in quantized pages (positions [0, Q)).
      lengths: int32[max_seqs], all tokens; the tail holds positions [Q, L).
      layer: None, or (`layer_view(..., whole_pools=True)`) the layer's index:
        then `k` and `v` hold whole pools (their own `layer` indexes them) and
        MLA's `v` is the whole k_rope pool `[layers, 1, pages, page_size,
        d_rope]`; `one_layer()` slices them. Attention's "xla" path reads the
        layer inside its gathers; slicing first makes XLA copy the layer's
        pools when the slice feeds a loop (benchmarks/NOTES.md, v3).
    """

    k: QuantLayer
    v: QuantLayer | Float[Array, "*layers 1 pages page_size d_rope"]
    tail_k: Float[Array, "heads max_seqs ring width_a"]
    tail_v: Float[Array, "heads max_seqs ring width_b"]
    block_tables: Int[Array, "max_seqs max_pages"]
    quant_lengths: Int[Array, " max_seqs"]
    lengths: Int[Array, " max_seqs"]
    layer: int | Int[Array, ""] | None = None

    def one_layer(self) -> "QuantizedLayerView":
        """The same view with one layer's pools (itself if it already holds one layer)."""
        if self.layer is None:
            return self
        v = self.v.one_layer() if isinstance(self.v, QuantLayer) else self.v[self.layer]
        return dataclasses.replace(self, k=self.k.one_layer(), v=v, layer=None)


def _require_quant(spec: CacheSpec, op: str) -> None:
    if not isinstance(spec, CacheSpec) or spec.quant is None:
        raise ValueError(f"{op}: needs a CacheSpec with quant=QuantSpec(...), got {spec!r}.")


def layer_groups(spec: CacheSpec) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]]:
    """Static map of layers to pools: (bits of each pool, (pool, index in pool) per layer)."""
    _require_quant(spec, "layer_groups")
    per_layer = spec.quant.layer_bits(spec.num_layers)
    widths: list[int] = []
    where: list[tuple[int, int]] = []
    counts: dict[int, int] = {}
    for b in per_layer:
        if b not in widths:
            widths.append(b)
        where.append((widths.index(b), counts.get(b, 0)))
        counts[b] = counts.get(b, 0) + 1
    return tuple(widths), tuple(where)


def tail_capacity(spec: CacheSpec) -> int:
    """Tokens in each slot's ring buffer: residual + page_size."""
    _require_quant(spec, "tail_capacity")
    return spec.quant.residual + spec.page_size


def quantized_tokens(spec: CacheSpec, lengths):
    """Q(L) = page_size * floor(max(L - residual, 0) / page_size), for ints or arrays."""
    _require_quant(spec, "quantized_tokens")
    ps, r = spec.page_size, spec.quant.residual
    if isinstance(lengths, int | np.integer):
        return ps * (max(int(lengths) - r, 0) // ps)
    return ps * (jnp.maximum(lengths - r, 0) // ps)


def _pool(spec: CacheSpec, n_layers: int, heads: int, width: int, bits: int,
          grouping: str) -> QuantPool:
    ps, g = spec.page_size, spec.quant.group_size
    srows, scols = (ps // g, width) if grouping == "tokens" else (ps, width // g)
    base = (n_layers, heads, spec.num_pages)
    return QuantPool(
        codes=jnp.zeros((*base, ps, width * bits // 8), jnp.uint8),
        scale=jnp.zeros((*base, srows, scols), spec.quant.scale_dtype),
        zero=jnp.zeros((*base, srows, scols), spec.quant.scale_dtype),
        bits=bits, grouping=grouping,
    )


def init_quantized_cache(spec: CacheSpec) -> QuantizedKVCache:
    """An empty quantized cache for `spec` (which must have `quant` set); every page free."""
    _require_quant(spec, "init_quantized_cache")
    widths, where = layer_groups(spec)
    n_in = [sum(1 for gi, _ in where if gi == i) for i in range(len(widths))]
    heads = spec.attention.cache_heads
    wa, wb = spec.attention.cache_widths
    if spec.is_mla:
        pages = QuantizedLatentPages(
            c_kv=tuple(_pool(spec, n, 1, wa, b, "channels") for b, n in zip(widths, n_in,
                                                                              strict=True)),
            k_rope=jnp.zeros((spec.num_layers, 1, spec.num_pages, spec.page_size, wb),
                             spec.dtype),
        )
    else:
        pages = QuantizedKVPages(
            k=tuple(_pool(spec, n, heads, wa, b, "tokens")
                    for b, n in zip(widths, n_in, strict=True)),
            v=tuple(_pool(spec, n, heads, wb, b, "channels")
                    for b, n in zip(widths, n_in, strict=True)),
        )
    ring = tail_capacity(spec)
    tail = KVTail(
        a=jnp.zeros((spec.num_layers, heads, spec.max_seqs, ring, wa), spec.dtype),
        b=jnp.zeros((spec.num_layers, heads, spec.max_seqs, ring, wb), spec.dtype),
    )
    table = pt.init_page_table(
        num_pages=spec.num_pages, max_seqs=spec.max_seqs,
        max_pages_per_seq=spec.max_pages_per_seq, page_size=spec.page_size,
    )
    return QuantizedKVCache(
        paged=paged.PagedKVCache(pages=pages, table=table, spec=spec), tail=tail,
        lengths=jnp.zeros((spec.max_seqs,), jnp.int32),
        pending=jnp.zeros((2, spec.max_seqs), jnp.int32),
    )


@functools.partial(jax.jit, donate_argnames="cache")
def reserve(
    cache: QuantizedKVCache, num_new: Int[Array, " max_seqs"]
) -> tuple[QuantizedKVCache, pt.AllocStatus]:
    """Grows sequences by `num_new[s]` tokens and allocates the quantized pages a flush needs.

    Args:
      cache: the cache (donated).
      num_new: int32[max_seqs], tokens each sequence is about to receive.

    Returns:
      (cache, status): `cache.lengths` counts the new tokens and the page table
      the pages they complete; write them with `write_layer` for every layer.
      All or nothing: on failure (out of pages, a sequence longer than
      `max_pages_per_seq * page_size`) nothing changes, the next `write_layer`
      writes nothing, and `status.raise_if_error()` raises on the host.
    """
    spec = cache.spec
    paged._check_seq_vector("reserve: num_new", num_new, spec, "iu")
    num_new = num_new.astype(jnp.int32)
    old_len = cache.lengths
    new_len = old_len + num_new
    old_q = cache.quant_lengths
    new_q = jnp.maximum(quantized_tokens(spec, new_len), old_q)
    table, copy, status = pt.reserve(cache.table, new_q - old_q)
    too_long = jnp.any(new_len > spec.max_tokens_per_seq)
    ok = status.ok & ~too_long
    table = jax.tree.map(lambda n, o: jnp.where(ok, n, o), table, cache.table)
    # Quantized pages are complete when allocated, so no copy-on-write is ever
    # planned; the generic copy keeps this correct should that change.
    copy_dst = jnp.where(ok, copy.dst, spec.num_pages)
    pages = paged._copy_pages(cache.paged.pages, copy.src, copy_dst)
    code = jnp.where(too_long, pt.TOO_LONG, status.code).astype(jnp.int32)
    status = dataclasses.replace(status, code=code)
    return dataclasses.replace(
        cache,
        paged=dataclasses.replace(cache.paged, pages=pages, table=table),
        lengths=jnp.where(ok, new_len, old_len),
        pending=jnp.where(ok, jnp.stack([num_new, new_q - old_q]), 0),
    ), status


@functools.partial(jax.jit, donate_argnames="cache")
def fork(
    cache: QuantizedKVCache, src: Int[Array, " n"], dst: Int[Array, " n"]
) -> tuple[QuantizedKVCache, pt.AllocStatus]:
    """Makes each `dst[i]` share every quantized page of `src[i]` and copies its tail.

    Args:
      cache: the cache (donated).
      src, dst: int32[n] slot ids; each dst must be empty, distinct, and not a src.

    Returns:
      (cache, status): BAD_FORK (nothing changed) if a target is unusable.
    """
    src = jnp.atleast_1d(jnp.asarray(src, jnp.int32))
    dst = jnp.atleast_1d(jnp.asarray(dst, jnp.int32))
    table, status = pt.fork(cache.table, src, dst)
    spec = cache.spec
    tgt = jnp.where(status.ok, dst, spec.max_seqs)
    # An occupied target has length 0 in the quantized table but a tail; check both.
    busy = jnp.any(cache.lengths[jnp.clip(dst, 0, spec.max_seqs - 1)] > 0)
    ok = status.ok & ~busy
    tgt = jnp.where(ok, tgt, spec.max_seqs)
    table = jax.tree.map(lambda n, o: jnp.where(ok, n, o), table, cache.table)
    s = jnp.clip(src, 0, spec.max_seqs - 1)
    tail = jax.tree.map(
        lambda x: paged.set_drop(x, (slice(None), slice(None), tgt), x[:, :, s]), cache.tail)

    def copy_row(x):
        return x.at[tgt].set(x[s], mode="drop")

    status = dataclasses.replace(
        status, code=jnp.where(ok, pt.OK, pt.BAD_FORK).astype(jnp.int32))
    return dataclasses.replace(
        cache, paged=dataclasses.replace(cache.paged, table=table), tail=tail,
        lengths=copy_row(cache.lengths),
        pending=cache.pending.at[:, tgt].set(0, mode="drop"),
    ), status


@functools.partial(jax.jit, donate_argnames="cache", static_argnames="scrub")
def free(
    cache: QuantizedKVCache, seqs: Bool[Array, " max_seqs"], scrub: bool = False
) -> QuantizedKVCache:
    """Frees the flagged sequences; quantized pages nobody else holds return to the pool.

    Args:
      cache: the cache (donated).
      seqs: bool[max_seqs], the sequences to free.
      scrub: zero the released pages in every pool and the freed tails (static).
    """
    pc = paged.free(cache.paged, seqs, scrub=scrub)
    tail = cache.tail
    if scrub:
        tail = jax.tree.map(lambda x: jnp.where(seqs[None, None, :, None, None], 0, x), tail)
    zero = jnp.zeros_like(cache.lengths)
    return dataclasses.replace(
        cache, paged=pc, tail=tail,
        lengths=jnp.where(seqs, zero, cache.lengths),
        pending=jnp.where(seqs[None, :], 0, cache.pending),
    )


def _locate(spec: CacheSpec, layer):
    widths, where = layer_groups(spec)
    if isinstance(layer, int | np.integer):
        if not 0 <= layer < spec.num_layers:
            raise ValueError(f"layer must lie in [0, {spec.num_layers}), got {layer}.")
        return where[int(layer)]
    if len(widths) > 1:
        raise TypeError(
            "layer must be a Python int when layers have different bit widths "
            f"({spec.quant.bits}); a traced layer index works only with one width."
        )
    return 0, layer


def _to_heads_first(x):
    """[batch, f, ps, heads, w] -> [heads, batch, f, ps, w]."""
    return jnp.moveaxis(x, 3, 0)


def write_layer(
    cache: QuantizedKVCache,
    layer: int | Int[Array, ""],
    a: Float[Array, "batch q_len heads width_a"],
    b: Float[Array, "batch q_len heads width_b"],
    seq_ids: Int[Array, " batch"] | None = None,
) -> QuantizedKVCache:
    """Writes one layer's tokens reserved by the last `reserve`, flushing completed pages.

    Row r of the batch is sequence `seq_ids[r]` (default: every slot in
    order); its token t sits at position `cache.start[s] + t` and is written
    if that is below `cache.lengths[s]` (later rows are padding). Pages that
    became quantized in the last `reserve` ([quant_start, quant_lengths)) are
    assembled from the old tail and the new tokens, quantized and scattered
    into the pool; new tokens past the quantized region go to the tail.

    Args:
      cache: the cache; pure function, jit it with the cache donated.
      layer: layer index (may be traced when every layer has the same bits).
      a, b: K and V `[batch, q_len, kv_heads, head_dim]`; MLA c_KV
        `[batch, q_len, d_c]` and k_rope `[batch, q_len, d_rope]` (a head axis
        of 1 may be present). Must have the cache dtype, and q_len must cover
        every token the last `reserve` added to each row (checked when the
        cache is concrete; under jit, missing tokens would be read as padding).
      seq_ids: int32[batch], distinct slots.

    Returns:
      The updated cache.
    """
    spec = cache.spec
    if spec.is_mla:
        a = a[:, :, None] if a.ndim == 3 else a
        b = b[:, :, None] if b.ndim == 3 else b
    heads = spec.attention.cache_heads
    for name, x, w in zip(("a", "b"), (a, b), spec.attention.cache_widths, strict=True):
        if x.ndim != 4 or x.shape[2:] != (heads, w):
            raise ValueError(
                f"write_layer: {name} must be [batch, q_len, {heads}, {w}], got {x.shape}."
            )
        if x.dtype != spec.dtype:
            raise TypeError(
                f"write_layer: {name} has dtype {x.dtype} but the cache holds {spec.dtype}; "
                f"cast it first."
            )
    if a.shape[:2] != b.shape[:2]:
        raise ValueError(f"write_layer: a {a.shape} and b {b.shape} differ in [batch, q_len].")
    batch, q_len = a.shape[:2]
    if seq_ids is None:
        if batch != spec.max_seqs:
            raise ValueError(
                f"write_layer: batch {batch} != max_seqs {spec.max_seqs}; pass seq_ids."
            )
        seq_ids = jnp.arange(spec.max_seqs, dtype=jnp.int32)
    elif seq_ids.shape != (batch,):
        raise ValueError(f"write_layer: seq_ids must be int32[{batch}], got {seq_ids.shape}.")
    gi, li = _locate(spec, layer)
    ps, ring = spec.page_size, tail_capacity(spec)
    quant = spec.quant
    if not any(isinstance(x, jax.core.Tracer) for x in (cache.lengths, cache.start, seq_ids)):
        pending = np.asarray(cache.lengths)[np.asarray(seq_ids)] - np.asarray(
            cache.start)[np.asarray(seq_ids)]
        if pending.max(initial=0) > q_len:
            raise ValueError(
                f"write_layer: the last reserve added up to {pending.max()} tokens to a row, "
                f"but a and b hold only q_len={q_len}; write all reserved tokens in one call."
            )

    start = cache.start[seq_ids]
    end = cache.lengths[seq_ids]
    q0 = cache.quant_start[seq_ids]
    q1 = cache.quant_lengths[seq_ids]

    # ---- flush: pages [q0, q1) from the old tail (positions < start) and the new tokens.
    n_flush = math.ceil(q_len / ps)
    pos = (q0[:, None, None] + jnp.arange(n_flush)[None, :, None] * ps
           + jnp.arange(ps)[None, None, :])  # [batch, f, ps]
    from_tail = pos < start[:, None, None]
    slot = pos % ring
    new_idx = jnp.clip(pos - start[:, None, None], 0, q_len - 1)
    rows = jnp.arange(batch)[:, None, None]

    def assemble(tail_pool, x):
        old = tail_pool[layer][:, seq_ids[:, None, None], slot]  # [heads, batch, f, ps, w]
        new = _to_heads_first(x[rows, new_idx])  # [heads, batch, f, ps, w]
        return jnp.where(from_tail[None, ..., None], old, new)

    page_col = jnp.clip(pos[:, :, 0] // ps, 0, spec.max_pages_per_seq - 1)
    page_ids = jnp.take_along_axis(cache.block_tables[seq_ids], page_col, axis=1)
    active = pos[:, :, 0] < q1[:, None]
    page_ids = jnp.where(active, page_ids, spec.num_pages)  # [batch, f]; sink is dropped

    def flush(pool: QuantPool, x_full):
        codes, scale, zero = quantize_packed(
            x_full, bits=pool.bits, group_size=quant.group_size, grouping=pool.grouping,
            scale_dtype=quant.scale_dtype,
        )
        # pool[li, :, page_ids] has the advanced axes first: [batch, f, heads, ...].
        def put(dst, val):
            return paged.set_drop(dst, (li, slice(None), page_ids), jnp.moveaxis(val, 0, 2))

        return dataclasses.replace(pool, codes=put(pool.codes, codes),
                                   scale=put(pool.scale, scale), zero=put(pool.zero, zero))

    full_a = assemble(cache.tail.a, a)
    full_b = assemble(cache.tail.b, b)
    pages = cache.paged.pages
    if spec.is_mla:
        c_kv = list(pages.c_kv)
        c_kv[gi] = flush(c_kv[gi], full_a)
        k_rope = paged.set_drop(pages.k_rope, (layer, slice(None), page_ids),
                                jnp.moveaxis(full_b, 0, 2))
        pages = QuantizedLatentPages(c_kv=tuple(c_kv), k_rope=k_rope)
    else:
        k, v = list(pages.k), list(pages.v)
        k[gi] = flush(k[gi], full_a)
        v[gi] = flush(v[gi], full_b)
        pages = QuantizedKVPages(k=tuple(k), v=tuple(v))

    # ---- tail: new tokens at or past the quantized region.
    new_pos = start[:, None] + jnp.arange(q_len)[None, :]  # [batch, q_len]
    keep = (new_pos < end[:, None]) & (new_pos >= q1[:, None])
    tslot = jnp.where(keep, new_pos % ring, ring)  # ring is out of range: dropped
    sid = seq_ids[:, None]
    rows = (jnp.broadcast_to(sid, tslot.shape).reshape(-1), tslot.reshape(-1))
    tail = KVTail(
        a=paged.set_rows(cache.tail.a, layer, *rows, a.reshape(-1, *a.shape[2:])),
        b=paged.set_rows(cache.tail.b, layer, *rows, b.reshape(-1, *b.shape[2:])),
    )
    return dataclasses.replace(cache, paged=dataclasses.replace(cache.paged, pages=pages),
                               tail=tail)


@functools.partial(jax.jit, donate_argnames="cache", static_argnames="layer")
def write_layer_jit(cache, layer, a, b, seq_ids=None):
    """`write_layer` as a jitted entry point that donates the cache; `layer` is static."""
    return write_layer(cache, layer, a, b, seq_ids)


def layer_view(
    cache: QuantizedKVCache, layer: int | Int[Array, ""], *, whole_pools: bool = False
) -> QuantizedLayerView:
    """One layer's quantized pools, tail rings and page table, for `kvjax.attention`.

    Args:
      cache: the cache.
      layer: the layer (may be traced when every layer has the same bits).
      whole_pools: keep the pools whole and record the layer's index in the
        view (see `QuantizedLayerView.layer`) instead of slicing the layer out.
        Use it inside a model's step: the attention ops' "xla" path then reads
        the layer's pages straight from the pools.
    """
    spec = cache.spec
    gi, li = _locate(spec, layer)
    pages = cache.paged.pages

    def one(pool: QuantPool) -> QuantLayer:
        if whole_pools:
            return QuantLayer(codes=pool.codes, scale=pool.scale, zero=pool.zero,
                              bits=pool.bits, grouping=pool.grouping, layer=li)
        return QuantLayer(codes=pool.codes[li], scale=pool.scale[li], zero=pool.zero[li],
                          bits=pool.bits, grouping=pool.grouping)

    if spec.is_mla:
        k, v = one(pages.c_kv[gi]), pages.k_rope if whole_pools else pages.k_rope[layer]
    else:
        k, v = one(pages.k[gi]), one(pages.v[gi])
    return QuantizedLayerView(
        k=k, v=v, tail_k=cache.tail.a[layer], tail_v=cache.tail.b[layer],
        block_tables=cache.block_tables, quant_lengths=cache.quant_lengths,
        lengths=cache.lengths, layer=layer if whole_pools else None,
    )


def dequantized_sequence(
    cache: QuantizedKVCache, layer: int, seq: int
) -> tuple[np.ndarray, np.ndarray]:
    """Host-side read-back of one sequence of one layer, for debugging and tests.

    Returns:
      (a, b) float32 NumPy arrays `[tokens, heads, width]`: K and V (MLA: c_KV
      and k_rope), quantized positions dequantized, tail positions as stored.
    """
    from kernels_pallas.quantized_attention.layout import dequantize

    spec = cache.spec
    view = layer_view(cache, layer)
    length, q_len = int(cache.lengths[seq]), int(cache.quant_lengths[seq])
    ps, ring = spec.page_size, tail_capacity(spec)
    pages = np.asarray(cache.block_tables[seq, :q_len // ps])
    out = []
    for pool, tail in ((view.k, view.tail_k), (view.v, view.tail_v)):
        if isinstance(pool, QuantLayer):
            x = dequantize(pool.codes[:, pages], pool.scale[:, pages], pool.zero[:, pages],
                           bits=pool.bits, grouping=pool.grouping)
        else:
            x = pool[:, pages]
        x = np.asarray(x, np.float32)
        x = x.reshape(x.shape[0], -1, x.shape[-1])
        t = np.asarray(tail[:, seq, np.arange(q_len, length) % ring], np.float32)
        out.append(np.concatenate([x, t], axis=1).transpose(1, 0, 2))
    return out[0], out[1]
