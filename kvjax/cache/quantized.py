"""A paged KV cache of low-bit codes with a full-precision tail (KIVI, arXiv 2402.02750).

State
  A quantized cache is a `PagedKVCache` whose `pages` are `QuantizedKVPages`
  (GQA: packed K and V codes with their scales and zeros) or
  `QuantizedLatentPages` (MLA: packed c_KV codes, scales, zeros and the
  full-precision k_rope), and whose `tail` is a `KIVITail` (the full-precision
  ring of every sequence slot, and the token counts). Every pool of the pages has
  the layout `[layers, heads, pages, rows, cols]` (page axis 2), so the generic
  copy-on-write and scrub of `kvjax.cache.paged` apply to them unchanged.

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
  `truncate` to whole quantized pages (prefix caching) leaves a sequence with
  more: quantized_lengths = L, an empty tail. In general Q(L) <= quant_lengths
  <= L, and the tail holds positions [quant_lengths, L).

Page table and allocator
  The page table (`cache.table`) describes only the quantized pages:
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

Window groups
  With `CacheSpec.window_groups`, the quantized pools and the tail hold the main
  pools' layers only (`spec.global_layers`); the groups' layers keep full-precision
  rings (`kvjax.cache.window`). The `layer` the functions here take is then a layer's
  index among the global layers (`CacheSpec.layer_home`), which `kvjax.cache`'s
  generic operations pass.

The functions here are the quantized kinds' implementation of the generic
operations of `kvjax.cache` (`init_cache`, `reserve`, `fork`, `free`, `write`,
`attend`, `layer_view`), which dispatch on the page kind; use them through it.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from kvjax.attention.pages import QuantizedLayerView, QuantLayer
from kvjax.cache import page_table as pt
from kvjax.cache import paged
from kvjax.cache.quant import quantize_packed
from kvjax.cache.state import (
    KIVITail,
    PagedKVCache,
    QuantizedKVPages,
    QuantizedLatentPages,
    QuantPool,
)
from kvjax.specs import CacheSpec

__all__ = [
    "init_cache",
    "quantized_tokens",
    "tail_capacity",
    "layer_groups",
    "reserve",
    "fork",
    "free",
    "truncate",
    "write_layer",
    "layer_view",
    "drop_pages",
    "dequantized_sequence",
]


def _require_quant(spec: CacheSpec, op: str) -> None:
    if not isinstance(spec, CacheSpec) or spec.quant is None:
        raise ValueError(f"{op}: needs a CacheSpec with quant=QuantSpec(...), got {spec!r}.")


def layer_groups(spec: CacheSpec) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]]:
    """Static map of layers to pools: (bits of each pool, (pool, index in pool) per layer).

    The layers are those of the main pools, `spec.global_layers` in order (every layer
    when the spec has no window groups; a group's layers keep full-precision rings).
    """
    _require_quant(spec, "layer_groups")
    bits = spec.quant.layer_bits(spec.num_layers)
    per_layer = [bits[i] for i in spec.global_layers]
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


def init_cache(spec: CacheSpec) -> PagedKVCache:
    """An empty quantized cache for `spec` (which must have `quant` set); every page free."""
    _require_quant(spec, "init_cache")
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
            index_k=(None if spec.indexer is None
                     else jnp.zeros(spec.index_pool_shape, spec.indexer.dtype)),
        )
    else:
        pages = QuantizedKVPages(
            k=tuple(_pool(spec, n, heads, wa, b, "tokens")
                    for b, n in zip(widths, n_in, strict=True)),
            v=tuple(_pool(spec, n, heads, wb, b, "channels")
                    for b, n in zip(widths, n_in, strict=True)),
        )
    ring = tail_capacity(spec)
    n_main = len(spec.global_layers)
    tail = KIVITail(
        a=jnp.zeros((n_main, heads, spec.max_seqs, ring, wa), spec.dtype),
        b=jnp.zeros((n_main, heads, spec.max_seqs, ring, wb), spec.dtype),
        lengths=jnp.zeros((spec.max_seqs,), jnp.int32),
        pending=jnp.zeros((2, spec.max_seqs), jnp.int32),
        c=(None if spec.indexer is None else jnp.zeros(
            (spec.num_layers, 1, spec.max_seqs, ring, spec.indexer.head_dim),
            spec.indexer.dtype)),
    )
    table = pt.init_page_table(
        num_pages=spec.num_pages, max_seqs=spec.max_seqs,
        max_pages_per_seq=spec.max_pages_per_seq, page_size=spec.page_size,
    )
    return PagedKVCache(pages=pages, table=table, spec=spec, tail=tail)


def _start(cache: PagedKVCache):
    """Length of each sequence before the last `reserve`."""
    return cache.tail.lengths - cache.tail.pending[0]


def _quant_start(cache: PagedKVCache):
    """Quantized tokens of each sequence before the last `reserve`."""
    return cache.table.lengths - cache.tail.pending[1]


def reserve(
    cache: PagedKVCache, num_new: Int[Array, " max_seqs"]
) -> tuple[PagedKVCache, pt.AllocStatus]:
    """Grows sequences by `num_new[s]` tokens and allocates the quantized pages a flush needs.

    Args:
      cache: the cache.
      num_new: int32[max_seqs], tokens each sequence is about to receive.

    Returns:
      (cache, status): `cache.lengths` counts the new tokens and the page table
      the pages they complete; write them with `write_layer` for every layer.
      All or nothing: on failure (out of pages, a sequence longer than
      `max_pages_per_seq * page_size`, a negative count) nothing changes, the next
      `write_layer` writes nothing, and `status.raise_if_error()` raises on the host.

    Raises:
      ValueError / TypeError: as `page_table.check_reserve_counts` (a negative count
        raises when concrete; traced, it is status BAD_COUNT).
    """
    spec = cache.spec
    # The table sees only the quantized tokens a count adds, never the count itself:
    # the counts are validated here.
    num_new = pt.check_reserve_counts(cache.table, num_new)
    old_len = cache.lengths
    negative = jnp.any(num_new < 0)
    # Compared as counts, not as new lengths: old_len + num_new can overflow int32.
    too_long = jnp.any(num_new > spec.max_tokens_per_seq - old_len)
    num_new = jnp.where(negative | too_long, 0, num_new)  # failed calls compute nothing odd
    new_len = old_len + num_new
    old_q = cache.quant_lengths
    new_q = jnp.maximum(quantized_tokens(spec, new_len), old_q)
    table, copy, status = paged.allocator(cache.table).reserve(cache.table, new_q - old_q)
    ok = status.ok & ~too_long & ~negative
    table = jax.tree.map(lambda n, o: jnp.where(ok, n, o), table, cache.table)
    # Quantized pages are complete when allocated, so no copy-on-write is ever
    # planned; the generic copy keeps this correct should that change.
    copy_dst = jnp.where(ok, copy.dst, spec.num_pages)
    pages = paged.copy_pages(cache.pages, copy.src, copy_dst)
    code = jnp.where(negative, pt.BAD_COUNT,
                     jnp.where(too_long, pt.TOO_LONG, status.code)).astype(jnp.int32)
    status = dataclasses.replace(status, code=code)
    tail = dataclasses.replace(
        cache.tail, lengths=jnp.where(ok, new_len, old_len),
        pending=jnp.where(ok, jnp.stack([num_new, new_q - old_q]), 0))
    return dataclasses.replace(cache, pages=pages, table=table, tail=tail), status


def fork(
    cache: PagedKVCache, src: Int[Array, " n"], dst: Int[Array, " n"]
) -> tuple[PagedKVCache, pt.AllocStatus]:
    """Makes each `dst[i]` share every quantized page of `src[i]` and copies its tail.

    Args:
      cache: the cache.
      src, dst: int32[n] slot ids; each dst must be empty, distinct, and not a src.

    Returns:
      (cache, status): BAD_FORK (nothing changed) if a target is unusable.
    """
    src = jnp.atleast_1d(jnp.asarray(src, jnp.int32))
    dst = jnp.atleast_1d(jnp.asarray(dst, jnp.int32))
    table, status = paged.allocator(cache.table).fork(cache.table, src, dst)
    spec = cache.spec
    tgt = jnp.where(status.ok, dst, spec.max_seqs)
    # An occupied target has length 0 in the quantized table but a tail; check both.
    busy = jnp.any(cache.lengths[jnp.clip(dst, 0, spec.max_seqs - 1)] > 0)
    ok = status.ok & ~busy
    tgt = jnp.where(ok, tgt, spec.max_seqs)
    table = jax.tree.map(lambda n, o: jnp.where(ok, n, o), table, cache.table)
    s = jnp.clip(src, 0, spec.max_seqs - 1)
    def copy_ring(x):
        return paged.set_drop(x, (slice(None), slice(None), tgt), x[:, :, s])

    t = cache.tail
    status = dataclasses.replace(
        status, code=jnp.where(ok, pt.OK, pt.BAD_FORK).astype(jnp.int32))
    tail = KIVITail(a=copy_ring(t.a), b=copy_ring(t.b),
                    lengths=t.lengths.at[tgt].set(t.lengths[s], mode="drop"),
                    pending=t.pending.at[:, tgt].set(0, mode="drop"),
                    c=None if t.c is None else copy_ring(t.c))
    return dataclasses.replace(cache, table=table, tail=tail), status


def free(
    cache: PagedKVCache, seqs: Bool[Array, " max_seqs"], scrub: bool = False
) -> PagedKVCache:
    """Frees the flagged sequences; quantized pages nobody else holds return to the pool.

    Args:
      cache: the cache.
      seqs: bool[max_seqs], the sequences to free.
      scrub: zero the released pages in every pool and the freed tails (static).
    """
    cache = paged.free(cache, seqs, scrub=scrub)
    t = cache.tail
    a, b, c = t.a, t.b, t.c
    if scrub:
        a, b, c = (None if x is None else jnp.where(seqs[None, None, :, None, None], 0, x)
                   for x in (a, b, c))
    tail = KIVITail(a=a, b=b, lengths=jnp.where(seqs, 0, t.lengths),
                    pending=jnp.where(seqs[None, :], 0, t.pending), c=c)
    return dataclasses.replace(cache, tail=tail)


def truncate(
    cache: PagedKVCache, new_lengths: Int[Array, " max_seqs"]
) -> tuple[PagedKVCache, pt.AllocStatus]:
    """Shortens sequences to whole quantized pages: the tail is dropped, the pages kept.

    A sequence's new length must be its current length (unchanged) or a multiple of the
    page size no longer than its quantized tokens: the full-precision tail cannot be
    rebuilt from quantized pages, so only whole quantized pages can end a sequence. The
    result holds more quantized tokens than `Q(length)` (every token is in a page); later
    reserves quantize from there on (`max(Q(L), quant_lengths)`), so the tail still holds
    [quant_lengths, length). This is how prefix caching keeps a prompt's quantized pages.

    Returns:
      (cache, status): BAD_TRUNCATE (nothing changed) if a new length is not allowed.
    """
    spec = cache.spec
    ps = spec.page_size
    new_lengths = jnp.asarray(new_lengths, jnp.int32)
    lengths, q = cache.lengths, cache.quant_lengths
    same = new_lengths == lengths
    whole = (new_lengths >= 0) & (new_lengths <= q) & (new_lengths % ps == 0)
    allowed = jnp.all(same | whole)
    new_q = jnp.where(same | ~allowed, q, new_lengths)
    table, _, status = paged.allocator(cache.table).truncate(cache.table, new_q)
    ok = allowed & status.ok
    table = jax.tree.map(lambda n, o: jnp.where(ok, n, o), table, cache.table)
    changed = ok & ~same
    t = cache.tail
    tail = dataclasses.replace(t, lengths=jnp.where(changed, new_lengths, lengths),
                               pending=jnp.where(changed[None, :], 0, t.pending))
    status = dataclasses.replace(
        status, code=jnp.where(ok, pt.OK, pt.BAD_TRUNCATE).astype(jnp.int32))
    return dataclasses.replace(cache, table=table, tail=tail), status


def _locate(spec: CacheSpec, layer):
    """(pool, index in pool) of main-pool layer `layer` (its index in `spec.global_layers`)."""
    widths, where = layer_groups(spec)
    paged.check_layer(spec, layer)
    if isinstance(layer, int | np.integer):
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
    cache: PagedKVCache,
    layer: int | Int[Array, ""],
    a: Float[Array, "batch q_len heads width_a"],
    b: Float[Array, "batch q_len heads width_b"],
    seq_ids: Int[Array, " batch"] | None = None,
    index_keys: Float[Array, "batch q_len d_index"] | None = None,
) -> PagedKVCache:
    """Writes one layer's tokens reserved by the last `reserve`, flushing completed pages.

    Row r of the batch is sequence `seq_ids[r]` (default: every slot in
    order); its token t sits at position `lengths[s] - pending[0, s] + t` (as
    the last `reserve` left them) and is written if that is below
    `cache.lengths[s]` (later rows are padding). Pages that
    became quantized in the last `reserve` ([quant_start, quant_lengths)) are
    assembled from the old tail and the new tokens, quantized and scattered
    into the pool; new tokens past the quantized region go to the tail.

    Args:
      cache: the cache; pure function, jit it with the cache donated.
      layer: layer index (may be traced when every layer has the same bits; a traced
        one outside the cache writes nothing).
      a, b: K and V `[batch, q_len, kv_heads, head_dim]`; MLA c_KV
        `[batch, q_len, d_c]` and k_rope `[batch, q_len, d_rope]` (a head axis
        of 1 may be present). Must have the cache dtype, and q_len must cover
        every token the last `reserve` added to each row (checked when the
        cache is concrete; under jit, missing tokens would be read as padding).
      seq_ids: int32[batch], distinct slots; a row whose slot is outside [0, max_seqs)
        writes nothing (a negative id does not wrap to another slot).
      index_keys: the tokens' indexer keys `[batch, q_len, d_index]` in the indexer's
        dtype, exactly when the cache has one (`CacheSpec.indexer`): kept in full
        precision, flushed into the `index_k` pages with the latent's pages and held in
        the tail ring `c` meanwhile.

    Returns:
      The updated cache.
    """
    spec = cache.spec
    if (index_keys is None) != (spec.indexer is None):
        raise ValueError("write_layer: give index_keys exactly when the cache has an indexer "
                         f"(CacheSpec.indexer is {spec.indexer}).")
    if index_keys is not None:
        index_keys = index_keys[:, :, None] if index_keys.ndim == 3 else index_keys
        want = (*a.shape[:2], 1, spec.indexer.head_dim)
        if index_keys.shape != want or index_keys.dtype != spec.indexer.dtype:
            raise ValueError(f"write_layer: index_keys must be {spec.indexer.dtype.name}"
                             f"{list(want)}, got {index_keys.dtype.name}"
                             f"{list(index_keys.shape)}.")
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
    elif jnp.shape(seq_ids) != (batch,):
        raise ValueError(f"write_layer: seq_ids must be int32[{batch}], got "
                         f"{jnp.shape(seq_ids)}.")
    gi, li = _locate(spec, layer)
    if isinstance(layer, jax.core.Tracer):  # outside the cache: every scatter drops it
        layer = li = paged.write_index(spec, layer)
    ps, ring = spec.page_size, tail_capacity(spec)
    quant = spec.quant
    start_all = _start(cache)
    # Gathers clamp and negative indices wrap: rows of slots outside the table read slot 0
    # and write nothing (their range [start, end) is empty).
    seq_ids = jnp.asarray(seq_ids, jnp.int32)
    inside = (seq_ids >= 0) & (seq_ids < spec.max_seqs)
    seq_ids = jnp.where(inside, seq_ids, 0)
    if not any(isinstance(x, jax.core.Tracer) for x in (cache.lengths, start_all, seq_ids,
                                                         inside)):
        ids = np.asarray(seq_ids)[np.asarray(inside)]
        pending = np.asarray(cache.lengths)[ids] - np.asarray(start_all)[ids]
        if pending.max(initial=0) > q_len:
            raise ValueError(
                f"write_layer: the last reserve added up to {pending.max()} tokens to a row, "
                f"but a and b hold only q_len={q_len}; write all reserved tokens in one call."
            )

    start = start_all[seq_ids]
    end = jnp.where(inside, cache.lengths[seq_ids], start)
    q0 = _quant_start(cache)[seq_ids]
    q1 = jnp.where(inside, cache.quant_lengths[seq_ids], q0)

    # ---- flush: pages [q0, q1) from the old tail (positions < start) and the new tokens.
    n_flush = math.ceil(q_len / ps)
    pos = (q0[:, None, None] + jnp.arange(n_flush)[None, :, None] * ps
           + jnp.arange(ps)[None, None, :])  # [batch, f, ps]
    from_tail = pos < start[:, None, None]
    slot = pos % ring
    new_idx = jnp.clip(pos - start[:, None, None], 0, q_len - 1)
    rows = jnp.arange(batch)[:, None, None]

    # The ring rows a flush may take, read outside the flush's cond and handed to the
    # ring's in-place write below as values it must follow: otherwise XLA copies the ring
    # (every layer's) twice per layer and step to keep the read's value. One page per row,
    # [batch f ps, heads, w] (on CPU a copy of the rows: XLA's gather of them was ~1 ms a
    # layer-step at batch 8).
    ring_slots = (jnp.broadcast_to(seq_ids[:, None, None], slot.shape).reshape(-1),
                  slot.reshape(-1))
    old_rows = {name: paged.get_rows(t, layer, *ring_slots)
                for name, t in (("a", cache.tail.a), ("b", cache.tail.b), ("c", cache.tail.c))
                if t is not None and (name != "c" or index_keys is not None)}

    def assemble(name, x):
        new = _to_heads_first(x[rows, new_idx])  # [heads, batch, f, ps, w]
        old = old_rows[name].reshape(*slot.shape, *old_rows[name].shape[1:])
        return jnp.where(from_tail[None, ..., None], _to_heads_first(old), new)

    page_col = jnp.clip(pos[:, :, 0] // ps, 0, spec.max_pages_per_seq - 1)
    page_ids = jnp.take_along_axis(cache.block_tables[seq_ids], page_col, axis=1)
    active = pos[:, :, 0] < q1[:, None]
    page_ids = jnp.where(active, page_ids, spec.num_pages)  # [batch, f]; sink is dropped

    def flush(pool: QuantPool, x_full):
        codes, scale, zero = quantize_packed(
            x_full, bits=pool.bits, group_size=quant.group_size, grouping=pool.grouping,
            scale_dtype=quant.scale_dtype,
        )
        def put(dst, val):  # val [heads, batch, f, ...] -> one page per (batch, f)
            val = jnp.moveaxis(val, 0, 2)
            return paged.set_pages(dst, li, page_ids.reshape(-1),
                                   val.reshape(-1, *val.shape[2:]))

        return dataclasses.replace(pool, codes=put(pool.codes, codes),
                                   scale=put(pool.scale, scale), zero=put(pool.zero, zero))

    def put_full(pool, full):  # full-precision pages [heads, batch, f, ps, w]
        full = jnp.moveaxis(full, 0, 2)
        return paged.set_pages(pool, layer, page_ids.reshape(-1),
                               full.reshape(-1, *full.shape[2:]))

    def flush_all(pages):
        full_a = assemble("a", a)
        full_b = assemble("b", b)
        if spec.is_mla:
            c_kv = list(pages.c_kv)
            c_kv[gi] = flush(c_kv[gi], full_a)
            index_k = pages.index_k
            if index_keys is not None:
                index_k = put_full(index_k, assemble("c", index_keys))
            return QuantizedLatentPages(c_kv=tuple(c_kv), k_rope=put_full(pages.k_rope, full_b),
                                        index_k=index_k)
        k, v = list(pages.k), list(pages.v)
        k[gi] = flush(k[gi], full_a)
        v[gi] = flush(v[gi], full_b)
        return QuantizedKVPages(k=tuple(k), v=tuple(v))

    # A page completes once every page_size tokens of a row: most decode steps skip the
    # assembly and quantization.
    pages = jax.lax.cond(jnp.any(active), flush_all, lambda p: p, cache.pages)

    # ---- tail: new tokens at or past the quantized region.
    new_pos = start[:, None] + jnp.arange(q_len)[None, :]  # [batch, q_len]
    keep = (new_pos < end[:, None]) & (new_pos >= q1[:, None])
    tslot = jnp.where(keep, new_pos % ring, ring)  # ring is out of range: dropped
    sid = seq_ids[:, None]
    rows = (jnp.broadcast_to(sid, tslot.shape).reshape(-1), tslot.reshape(-1))
    # Each ring's write follows the flush's read of it (`after`): no copy of the ring.
    tail = dataclasses.replace(
        cache.tail,
        a=paged.set_rows(cache.tail.a, layer, *rows, a.reshape(-1, *a.shape[2:]),
                         after=(old_rows["a"],)),
        b=paged.set_rows(cache.tail.b, layer, *rows, b.reshape(-1, *b.shape[2:]),
                         after=(old_rows["b"],)),
    )
    if index_keys is not None:
        tail = dataclasses.replace(tail, c=paged.set_rows(
            cache.tail.c, layer, *rows, index_keys.reshape(-1, *index_keys.shape[2:]),
            after=(old_rows["c"],)))
    return dataclasses.replace(cache, pages=pages, tail=tail)


def layer_view(
    cache: PagedKVCache, layer: int | Int[Array, ""], *, whole_pools: bool = False
) -> QuantizedLayerView:
    """One layer's quantized pools, tail rings and page table, for `kvjax.attention`.

    Args:
      cache: the cache.
      layer: the layer (may be traced when every layer has the same bits).
      whole_pools: keep the pools whole and record the layer's index in the
        view (see `QuantizedLayerView.layer`) instead of slicing the layer out.
        Use it inside a model's step: the attention ops' "xla" path then reads
        the layer's pages straight from the pools.

    A traced `layer` outside the cache gives NaN scales, zero-points, k_rope pages and
    tails (`paged.traced_layer_ok`); with `whole_pools` the pools are not read here, and
    `kvjax.cache.attend` returns NaN for such a layer instead.
    """
    spec = cache.spec
    gi, li = _locate(spec, layer)
    pages = cache.pages
    ok = None if whole_pools else paged.traced_layer_ok(spec, layer)

    def poison(x):
        return paged.poison_unless(ok, x)

    def one(pool: QuantPool) -> QuantLayer:
        if whole_pools:
            return QuantLayer(codes=pool.codes, scale=pool.scale, zero=pool.zero,
                              bits=pool.bits, grouping=pool.grouping, layer=li)
        return QuantLayer(codes=pool.codes[li], scale=poison(pool.scale[li]),
                          zero=poison(pool.zero[li]), bits=pool.bits, grouping=pool.grouping)

    if spec.is_mla:
        k, v = one(pages.c_kv[gi]), pages.k_rope if whole_pools else poison(pages.k_rope[layer])
    else:
        k, v = one(pages.k[gi]), one(pages.v[gi])
    return QuantizedLayerView(
        k=k, v=v, tail_k=poison(cache.tail.a[layer]), tail_v=poison(cache.tail.b[layer]),
        block_tables=cache.block_tables, quant_lengths=cache.quant_lengths,
        lengths=cache.lengths, layer=layer if whole_pools else None,
    )


def drop_pages(
    cache: PagedKVCache, drop: Bool[Array, "max_seqs max_pages"]
) -> tuple[PagedKVCache, Int[Array, "max_seqs max_tokens"], pt.AllocStatus]:
    """Evicts whole quantized pages: the KIVI cache's eviction, for every policy that evicts.

    The tokens of a quantized page share their key scales and zeros (per channel over G
    tokens), so single tokens cannot leave without requantizing the rest of their group
    from already-quantized values. Eviction on a KIVI cache therefore frees whole
    quantized pages, for all layers and heads at once (one block-table row serves them
    all), and never touches the full-precision tail:

      * the kept quantized pages move to the front of the block-table row (bookkeeping
        only, no data moves) and `truncate` drops the evicted references (refcounts down,
        pages at zero back on the free stack; a page a fork still holds stays). On a
        context-sharded table, where a column's page must come from that column's
        shard, the kept pages' contents move to the front columns instead;
      * the sequence's positions shift down by page_size per evicted page, and the tail
        ring is rotated by as much, so position p still lives in slot p mod ring and
        `Q(L) = page_size * floor((L - R) / page_size)` still holds. Keys are cached after
        RoPE at their text positions, so attention does not care about cache positions.

    Args:
      cache: a quantized cache.
      drop: bool[max_seqs, max_pages], block-table columns to evict; only columns of
        quantized pages (below quant_lengths / page_size) count.

    Returns:
      (cache, src, status): `src[s, j]` is the old position of the token now at position j
      (for moving per-token state such as scores), -1 past the new length; status is
      BAD_TRUNCATE if the allocator refuses, or OUT_OF_PAGES if a context-sharded pool
      has no page for the private copy of a shared destination (nothing changed).
    """
    spec = cache.spec
    ps, max_pages = spec.page_size, spec.max_pages_per_seq
    lengths, ql = cache.lengths, cache.quant_lengths
    n_q = ql // ps
    cols = jnp.arange(max_pages, dtype=jnp.int32)[None, :]
    drop = drop & (cols < n_q[:, None])
    k = jnp.sum(drop, axis=1, dtype=jnp.int32)
    # Kept quantized pages first, then the evicted ones, then unused entries, each in
    # page order: truncating to the kept count then drops exactly the evicted ones.
    group = jnp.where(cols < n_q[:, None], drop.astype(jnp.int32), 2)
    perm = jnp.argsort(group * max_pages + cols, axis=1).astype(jnp.int32)
    new_q = ql - k * ps
    pages, moved = cache.pages, None
    if getattr(cache.table, "context_shards", 1) > 1:
        table, pages, moved = _move_kept_pages(cache, perm, n_q - k)
    else:
        table = dataclasses.replace(
            cache.table, block_tables=jnp.take_along_axis(cache.table.block_tables, perm, axis=1))
    table, _, status = paged.allocator(table).truncate(table, new_q)
    if moved is not None:  # the private copies' shortfall, if any, is the error to report
        status = jax.tree.map(lambda m, t: jnp.where(moved.ok, t, m), moved, status)
    ok = status.ok
    new_len = lengths - k * ps
    j = jnp.arange(spec.max_tokens_per_seq, dtype=jnp.int32)[None, :]
    src_page = jnp.take_along_axis(perm, jnp.broadcast_to(j // ps, (spec.max_seqs, j.shape[1])),
                                   axis=1)
    src = jnp.where(j < new_q[:, None], src_page * ps + j % ps, j + (k * ps)[:, None])
    src = jnp.where(j < new_len[:, None], src, -1)
    shift = jnp.where(ok, k * ps, 0)

    def rotate(x):  # position p must stay in slot p mod ring after the shift
        ring = x.shape[3]
        idx = (jnp.arange(ring)[None, :] + shift[:, None]) % ring  # [max_seqs, ring]
        return jnp.take_along_axis(x, idx[None, None, :, :, None], axis=3)

    t = cache.tail
    rings = (t.a, t.b) if t.c is None else (t.a, t.b, t.c)
    rings = jax.lax.cond(jnp.any(shift > 0), lambda: tuple(rotate(x) for x in rings),
                         lambda: rings)
    tail = KIVITail(a=rings[0], b=rings[1],
                    lengths=jnp.where(ok, new_len, lengths).astype(jnp.int32),
                    pending=jnp.where((shift > 0)[None, :], 0, t.pending),
                    c=rings[2] if len(rings) == 3 else None)
    table = jax.tree.map(lambda n, o: jnp.where(ok, n, o), table, cache.table)
    src = jnp.where(ok, src, jnp.where(j < lengths[:, None], j, -1))
    return dataclasses.replace(cache, pages=pages, table=table, tail=tail), src, status


def _move_kept_pages(cache: PagedKVCache, perm, n_keep):
    """`drop_pages` on a context-sharded table: the kept pages' data moves, not their ids.

    Column j of a block-table row must hold a page of context shard j mod C (each shard's
    free stack and its per-shard views rely on it), so kept pages cannot just slide to
    the front of the row. Instead column j keeps its own page and receives the contents
    of the kept page `perm[j]` (all layers, heads and pools: a quantized page is whole);
    a destination page a fork still shares is replaced by a private one first. The
    columns past the kept count are then truncated as usual.

    Returns:
      (table, pages, status): OUT_OF_PAGES (nothing moved, the table unchanged) when the
      pool has no pages left for the private copies.
    """
    table = cache.table
    cols = jnp.arange(table.max_pages_per_seq, dtype=jnp.int32)[None, :]
    moved = (perm != cols) & (cols < n_keep[:, None])
    new_table, _, status = paged.allocator(table).unshare(table, moved)
    # Destination pages are overwritten whole, so unshare's copy of their old contents
    # is not needed; sources are read through the old ids before anything is written.
    src = jnp.clip(jnp.take_along_axis(table.block_tables, perm, axis=1), 0,
                   table.num_pages - 1).reshape(-1)
    dst = jnp.where(moved & status.ok, new_table.block_tables, table.num_pages).reshape(-1)
    pages = jax.tree.map(
        lambda x: paged.set_drop(x, (slice(None), slice(None), dst), x[:, :, src]), cache.pages)
    return new_table, pages, status


def dequantized_sequence(
    cache: PagedKVCache, layer: int, seq: int
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
