"""Public attention ops over a paged cache: input validation, then an implementation.

Every op validates shapes and dtypes when it is called (at trace time under
jit) and, when the block tables and lengths are concrete arrays rather than
tracers, also their values: a block-table entry a sequence uses that points
outside the pool, or a length past `max_pages * page_size`, raises
`ValueError` here instead of being clamped inside the computation.

`impl` chooses the implementation from the one registry (`registry.py`, which
also says what "auto" picks): "reference", "xla", "pallas", "cpu", "auto", or an
object that resolves ops itself (`kvjax.sharding.ShardedAttention`).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from kernels_pallas.merge import merge_attention_states
from kvjax.attention import registry
from kvjax.attention.registry import IMPLS

__all__ = [
    "paged_decode_attention",
    "paged_prefill_attention",
    "mla_decode_attention",
    "mla_prefill_attention",
    "merge_attention_states",
    "IMPLS",
]


def _layer_views(op, pools, layer, *, mla):
    """One layer of a cache's pools (for validation and for impls that take one layer).

    Under jit an unused slice costs nothing (XLA drops it); the impls that read whole
    pools are handed the whole pools and the layer instead (see `_with_layer`).
    """
    if layer is None:
        return pools
    for p in pools:
        if p.ndim != 5 or (mla and p.shape[1] != 1):
            want = "[layers, 1, pages, page_size, width]" if mla else (
                "[layers, kv_heads, pages, page_size, width]")
            raise ValueError(f"{op}: with layer=..., the pools must be a cache's whole pools "
                             f"{want}; got shape {p.shape}.")
    if isinstance(layer, int) and not 0 <= layer < pools[0].shape[0]:
        raise ValueError(f"{op}: layer {layer} is outside the pools' {pools[0].shape[0]} layers.")
    return tuple(p[layer, 0] if mla else p[layer] for p in pools)


def _with_layer(op, impl, interpret, layer, views, pools):
    """The implementation and the pools to pass it: the whole pools plus `layer` for
    the impls that read the layer in place; one layer otherwise."""
    fn, takes_layer = registry.resolve(op, impl, interpret, dtype=pools[0].dtype, pages=views)
    if layer is not None and takes_layer:
        return functools.partial(fn, layer=layer), pools
    return fn, views


def _is_concrete(*xs) -> bool:
    return not any(isinstance(x, jax.core.Tracer) for x in xs)


def _check_table(op: str, batch: int, lengths, block_tables, num_pages: int, page_size: int):
    if block_tables.ndim != 2 or block_tables.shape[0] != batch:
        raise ValueError(
            f"{op}: block_tables must be int32[batch={batch}, max_pages], got shape "
            f"{block_tables.shape}."
        )
    if lengths.shape != (batch,):
        raise ValueError(f"{op}: lengths must be int32[batch={batch}], got shape {lengths.shape}.")
    for name, x in (("block_tables", block_tables), ("lengths", lengths)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"{op}: {name} must be an integer array, got {x.dtype}.")
    if not _is_concrete(lengths, block_tables):
        return
    lengths = np.asarray(lengths)
    block_tables = np.asarray(block_tables)
    max_tokens = block_tables.shape[1] * page_size
    bad = np.nonzero((lengths < 0) | (lengths > max_tokens))[0]
    if bad.size:
        raise ValueError(
            f"{op}: lengths must lie in [0, max_pages * page_size = {max_tokens}]; sequence "
            f"{bad[0]} has length {lengths[bad[0]]}."
        )
    used = np.arange(block_tables.shape[1])[None, :] * page_size < lengths[:, None]
    outside = used & ((block_tables < 0) | (block_tables >= num_pages))
    if outside.any():
        s, j = np.argwhere(outside)[0]
        raise ValueError(
            f"{op}: block_tables[{s}, {j}] = {block_tables[s, j]} points outside the pool of "
            f"{num_pages} pages (sequence {s} has length {lengths[s]}, so it uses that entry)."
        )


def _check_pages(op: str, k_pages, v_pages, head_dim: int, names=("k_pages", "v_pages")):
    if k_pages.ndim != 4 or v_pages.ndim != 4:
        raise ValueError(
            f"{op}: {names[0]} and {names[1]} must be [kv_heads, pages, page_size, width]; got "
            f"{k_pages.shape} and {v_pages.shape}."
        )
    if k_pages.shape[:3] != v_pages.shape[:3]:
        raise ValueError(
            f"{op}: {names[0]} {k_pages.shape} and {names[1]} {v_pages.shape} must agree on "
            f"[kv_heads, pages, page_size]."
        )
    if k_pages.shape[3] != head_dim:
        raise ValueError(
            f"{op}: query head_dim {head_dim} does not match {names[0]} width {k_pages.shape[3]}."
        )
    if k_pages.dtype != v_pages.dtype:
        raise TypeError(
            f"{op}: {names[0]} dtype {k_pages.dtype} differs from {names[1]} dtype "
            f"{v_pages.dtype}."
        )


def _check_heads(op: str, q_heads: int, kv_heads: int):
    if q_heads % kv_heads:
        raise ValueError(
            f"{op}: q has {q_heads} heads, which is not a multiple of the cache's {kv_heads} KV "
            f"heads; each KV head must serve a whole group of query heads."
        )


def _check_options(op: str, scale, soft_cap, sliding_window):
    if scale is not None and not scale > 0:
        raise ValueError(f"{op}: scale must be positive, got {scale}.")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"{op}: soft_cap must be positive or None, got {soft_cap}.")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"{op}: sliding_window must be an int >= 1 or None, got "
                         f"{sliding_window!r}.")


def paged_decode_attention(
    q: Float[Array, "batch q_heads head_dim"],
    k_pages: Float[Array, "kv_heads pages page_size head_dim"],
    v_pages: Float[Array, "kv_heads pages page_size v_head_dim"],
    lengths: Int[Array, " batch"],
    block_tables: Int[Array, "batch max_pages"],
    *,
    scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    impl: str = "auto",
    interpret: bool | None = None,
    layer: int | Int[Array, ""] | None = None,
) -> tuple[Float[Array, "batch q_heads v_head_dim"], Float[Array, "batch q_heads"]]:
    """Decode attention (one query per sequence) over one layer's paged K/V.

    Query head h reads KV head h // (q_heads // kv_heads); KV is never repeated.
    The query of sequence b sits at position lengths[b] - 1 (its own key is
    already in the cache).

    Args:
      q: [batch, q_heads, head_dim].
      k_pages, v_pages: [kv_heads, pages, page_size, head_dim | v_head_dim].
      lengths: int32[batch], cached tokens per sequence including the new one.
      block_tables: int32[batch, max_pages]; only entries below
        ceil(lengths / page_size) are read.
      scale: logit scale, default 1/sqrt(head_dim).
      soft_cap: if set, logits become soft_cap * tanh(logits / soft_cap).
      sliding_window: if set, only the last `sliding_window` positions are seen.
      impl: one of IMPLS (see the module docstring).
      interpret: only for impl "pallas" (or "auto" resolving to it): run the kernel in
        Pallas' interpret mode; None means interpret exactly when the backend is CPU.
      layer: if given, k_pages and v_pages are a cache's whole pools
        [layers, kv_heads, pages, page_size, width] and this layer (an int or a traced
        int32 scalar) is attended. The "xla" and "cpu" paths then read the layer's pages
        straight from the pools; slicing `pool[layer]` first makes XLA copy the layer's
        whole pool when the slice feeds a loop or a custom call (e.g. inside a scan over
        layers).

    Returns:
      (out [batch, q_heads, v_head_dim] in q's dtype, lse float32[batch, q_heads]).
    """
    op = "paged_decode_attention"
    if q.ndim != 3:
        raise ValueError(f"{op}: q must be [batch, q_heads, head_dim], got shape {q.shape}.")
    batch, q_heads, head_dim = q.shape
    pools = (k_pages, v_pages)
    k_pages, v_pages = _layer_views(op, pools, layer, mla=False)
    _check_pages(op, k_pages, v_pages, head_dim)
    _check_heads(op, q_heads, k_pages.shape[0])
    _check_options(op, scale, soft_cap, sliding_window)
    _check_table(op, batch, lengths, block_tables, k_pages.shape[1], k_pages.shape[2])
    fn, (k_pages, v_pages) = _with_layer(op, impl, interpret, layer, (k_pages, v_pages), pools)
    return fn(
        q, k_pages, v_pages, lengths, block_tables,
        scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
    )


def paged_prefill_attention(
    q: Float[Array, "batch q_len q_heads head_dim"],
    k_pages: Float[Array, "kv_heads pages page_size head_dim"],
    v_pages: Float[Array, "kv_heads pages page_size v_head_dim"],
    lengths: Int[Array, " batch"],
    block_tables: Int[Array, "batch max_pages"],
    q_lengths: Int[Array, " batch"],
    *,
    scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    impl: str = "auto",
    interpret: bool | None = None,
    layer: int | Int[Array, ""] | None = None,
) -> tuple[Float[Array, "batch q_len q_heads v_head_dim"], Float[Array, "batch q_len q_heads"]]:
    """Chunked-prefill attention: `q_lengths[b]` new queries per sequence, causal over the cache.

    The cache already holds the new tokens, so query t of sequence b sits at
    position lengths[b] - q_lengths[b] + t. Rows t >= q_lengths[b] are padding
    (output 0, lse -inf). Arguments as in `paged_decode_attention`.

    Returns:
      (out [batch, q_len, q_heads, v_head_dim], lse float32[batch, q_len, q_heads]).
    """
    op = "paged_prefill_attention"
    if q.ndim != 4:
        raise ValueError(
            f"{op}: q must be [batch, q_len, q_heads, head_dim], got shape {q.shape}."
        )
    batch, q_len, q_heads, head_dim = q.shape
    pools = (k_pages, v_pages)
    k_pages, v_pages = _layer_views(op, pools, layer, mla=False)
    _check_pages(op, k_pages, v_pages, head_dim)
    _check_heads(op, q_heads, k_pages.shape[0])
    _check_options(op, scale, soft_cap, sliding_window)
    _check_table(op, batch, lengths, block_tables, k_pages.shape[1], k_pages.shape[2])
    _check_q_lengths(op, batch, q_len, lengths, q_lengths)
    fn, (k_pages, v_pages) = _with_layer(op, impl, interpret, layer, (k_pages, v_pages), pools)
    return fn(
        q, k_pages, v_pages, lengths, block_tables, q_lengths,
        scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
    )


def _check_q_lengths(op, batch, q_len, lengths, q_lengths):
    if q_lengths.shape != (batch,):
        raise ValueError(f"{op}: q_lengths must be int32[batch={batch}], got {q_lengths.shape}.")
    if _is_concrete(lengths, q_lengths):
        ql, ln = np.asarray(q_lengths), np.asarray(lengths)
        bad = np.nonzero((ql < 0) | (ql > q_len) | (ql > ln))[0]
        if bad.size:
            b = bad[0]
            raise ValueError(
                f"{op}: q_lengths[{b}] = {ql[b]} must lie in [0, min(q_len={q_len}, "
                f"lengths[{b}]={ln[b]})]."
            )


def _check_mla(op, q_latent, q_rope, latent_pages, rope_pages, scale, lead):
    if q_latent.shape[:-1] != q_rope.shape[:-1] or q_latent.ndim != lead + 2:
        raise ValueError(
            f"{op}: q_latent {q_latent.shape} and q_rope {q_rope.shape} must share their "
            f"leading axes and have {lead + 2} dims."
        )
    if latent_pages.ndim != 3 or rope_pages.ndim != 3:
        raise ValueError(
            f"{op}: latent_pages and rope_pages must be [pages, page_size, width] (one layer, "
            f"latent head squeezed); got {latent_pages.shape} and {rope_pages.shape}."
        )
    _check_pages(op, latent_pages[None], rope_pages[None], q_latent.shape[-1],
                 names=("latent_pages", "rope_pages"))
    if rope_pages.shape[-1] != q_rope.shape[-1]:
        raise ValueError(
            f"{op}: q_rope width {q_rope.shape[-1]} does not match rope_pages width "
            f"{rope_pages.shape[-1]}."
        )
    if not scale > 0:
        raise ValueError(f"{op}: scale must be positive, got {scale}.")


def mla_decode_attention(
    q_latent: Float[Array, "batch q_heads d_c"],
    q_rope: Float[Array, "batch q_heads d_rope"],
    latent_pages: Float[Array, "pages page_size d_c"],
    rope_pages: Float[Array, "pages page_size d_rope"],
    lengths: Int[Array, " batch"],
    block_tables: Int[Array, "batch max_pages"],
    *,
    scale: float,
    impl: str = "auto",
    interpret: bool | None = None,
    layer: int | Int[Array, ""] | None = None,
) -> tuple[Float[Array, "batch q_heads d_c"], Float[Array, "batch q_heads"]]:
    """MLA decode attention in absorbed form over one layer's latent pages.

    Args:
      q_latent: queries already multiplied by W_UK, [batch, q_heads, d_c].
      q_rope: rotary part of the queries, [batch, q_heads, d_rope].
      latent_pages, rope_pages: [pages, page_size, d_c | d_rope].
      lengths, block_tables: as in `paged_decode_attention`.
      scale: softmax scale, 1/sqrt(qk_nope_head_dim + qk_rope_head_dim) times any mscale.
      impl: one of IMPLS (see the module docstring).
      interpret: only for impl "pallas" (or "auto" resolving to it): run the kernel in
        Pallas' interpret mode; None means interpret exactly when the backend is CPU.
      layer: if given, latent_pages and rope_pages are a cache's whole latent pools
        [layers, 1, pages, page_size, width]; as in `paged_decode_attention`.

    Returns:
      (out in latent space [batch, q_heads, d_c], lse float32[batch, q_heads]).
    """
    op = "mla_decode_attention"
    pools = (latent_pages, rope_pages)
    latent_pages, rope_pages = _layer_views(op, pools, layer, mla=True)
    _check_mla(op, q_latent, q_rope, latent_pages, rope_pages, scale, lead=1)
    _check_table(op, q_latent.shape[0], lengths, block_tables, *latent_pages.shape[:2])
    fn, (latent_pages, rope_pages) = _with_layer(
        op, impl, interpret, layer, (latent_pages, rope_pages), pools)
    return fn(q_latent, q_rope, latent_pages, rope_pages, lengths, block_tables, scale=scale)


def mla_prefill_attention(
    q_latent: Float[Array, "batch q_len q_heads d_c"],
    q_rope: Float[Array, "batch q_len q_heads d_rope"],
    latent_pages: Float[Array, "pages page_size d_c"],
    rope_pages: Float[Array, "pages page_size d_rope"],
    lengths: Int[Array, " batch"],
    block_tables: Int[Array, "batch max_pages"],
    q_lengths: Int[Array, " batch"],
    *,
    scale: float,
    impl: str = "auto",
    interpret: bool | None = None,
    layer: int | Int[Array, ""] | None = None,
) -> tuple[Float[Array, "batch q_len q_heads d_c"], Float[Array, "batch q_len q_heads"]]:
    """Chunked-prefill MLA attention in absorbed form, causal as in `paged_prefill_attention`."""
    op = "mla_prefill_attention"
    pools = (latent_pages, rope_pages)
    latent_pages, rope_pages = _layer_views(op, pools, layer, mla=True)
    _check_mla(op, q_latent, q_rope, latent_pages, rope_pages, scale, lead=2)
    batch, q_len = q_latent.shape[:2]
    _check_table(op, batch, lengths, block_tables, *latent_pages.shape[:2])
    _check_q_lengths(op, batch, q_len, lengths, q_lengths)
    fn, (latent_pages, rope_pages) = _with_layer(
        op, impl, interpret, layer, (latent_pages, rope_pages), pools)
    return fn(
        q_latent, q_rope, latent_pages, rope_pages, lengths, block_tables, q_lengths, scale=scale
    )
