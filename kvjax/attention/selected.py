"""Decode attention over a `Selection` of pages, for every page kind.

A page-selecting cache policy (Quest, PyramidKV's per-layer budgets) hands decode
attention a `Selection`: block tables and lengths to read instead of each sequence's
own, one per sequence or one per KV head. Decode attention does not depend on key
order, so a selection is run by the ordinary decode op:

  * one table per sequence: the op with the selection's tables and lengths;
  * one table per KV head: the pools are viewed as one KV head with
    `kv_heads * pages` pages (a free reshape of the leading axes), KV head h's page
    ids are offset by `h * pages`, and each (sequence, KV head) pair becomes a batch
    row carrying its group of query heads. No key, value, code or scale is copied.

On a KIVI-quantized cache the selection names quantized pages; the full-precision
tail of recent tokens is always read besides (the reference's dense tail attention,
a few hundred tokens at most) and merged by log-sum-exp.

These are composite ops of the registry (`registry.COMPOSITE_OPS`): a string `impl`
runs the underlying op with that impl, and an impl that resolves ops itself
(`kvjax.sharding.ShardedAttention`) gets the whole selected op, so that the reshape
happens per device, on the pages each device holds.
"""

import dataclasses

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels_pallas.quantized_attention import reference as qref
from kvjax.attention import ops, quantized, registry
from kvjax.attention.pages import QuantizedLayerView, QuantLayer, Selection

__all__ = [
    "selected_decode_attention",
    "mla_selected_decode_attention",
    "quantized_selected_decode_attention",
    "quantized_mla_selected_decode_attention",
]


def _check_selection(op: str, selection: Selection, batch: int, kv_heads: int) -> int:
    bt, ln = selection.block_tables, selection.lengths
    sel_heads = bt.shape[1] if bt.ndim == 3 else -1
    if bt.ndim != 3 or bt.shape[0] != batch or ln.shape != (batch, sel_heads) or (
            sel_heads not in (1, kv_heads)):
        raise ValueError(
            f"{op}: selection block_tables {bt.shape} and lengths {ln.shape} must be "
            f"[batch={batch}, sel_heads, sel_pages] and [batch, sel_heads], sel_heads 1 or "
            f"kv_heads={kv_heads}.")
    return sel_heads


def _no_window(op: str, sliding_window):
    if sliding_window is not None:
        raise NotImplementedError(
            f"{op}: a Selection reads pages in any order, so a sliding window (which depends "
            f"on key positions) cannot apply; use a page-selecting policy only on layers "
            f"without a window.")


def _flat_heads(x, lead: int):
    """[*lead, kv_heads, pages, ...] -> [*lead, 1, kv_heads * pages, ...] (a free reshape)."""
    s = x.shape
    return x.reshape(*s[:lead], 1, s[lead] * s[lead + 1], *s[lead + 2:])


def _head_rows(bt, num_pages: int):
    """Per-head tables as batch rows: [batch, heads, n] -> [batch * heads, n], ids offset."""
    batch, heads, _ = bt.shape
    offset = (jnp.arange(heads, dtype=jnp.int32) * num_pages)[None, :, None]
    return jnp.where(bt >= 0, bt + offset, -1).reshape(batch * heads, -1)


def selected_decode_attention(
    q: Float[Array, "batch q_heads head_dim"],
    k_pages: Float[Array, "*layers kv_heads pages page_size head_dim"],
    v_pages: Float[Array, "*layers kv_heads pages page_size v_head_dim"],
    selection: Selection,
    *,
    scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    impl="auto",
    interpret: bool | None = None,
    layer: int | Int[Array, ""] | None = None,
) -> tuple[Float[Array, "batch q_heads v_head_dim"], Float[Array, "batch q_heads"]]:
    """`paged_decode_attention` over a `Selection` (arguments as there, plus `selection`)."""
    op = "selected_decode_attention"
    _no_window(op, sliding_window)
    kv_heads = k_pages.shape[-4]
    _check_selection(op, selection, q.shape[0], kv_heads)
    fn, _ = registry.resolve(op, impl, interpret)
    return fn(q, k_pages, v_pages, selection, scale=scale, soft_cap=soft_cap, layer=layer)


def _selected(q, k_pages, v_pages, selection, *, scale=None, soft_cap=None, layer=None,
              impl, interpret=None):
    batch, q_heads, head_dim = q.shape
    bt, ln = selection.block_tables, selection.lengths
    kw = dict(scale=scale, soft_cap=soft_cap, impl=impl, interpret=interpret, layer=layer)
    if bt.shape[1] == 1:
        return ops.paged_decode_attention(q, k_pages, v_pages, ln[:, 0], bt[:, 0], **kw)
    lead = 0 if layer is None else 1
    kv_heads, num_pages = k_pages.shape[lead:lead + 2]
    out, lse = ops.paged_decode_attention(
        q.reshape(batch * kv_heads, q_heads // kv_heads, head_dim),
        _flat_heads(k_pages, lead), _flat_heads(v_pages, lead), ln.reshape(-1),
        _head_rows(bt, num_pages), **kw)
    return out.reshape(batch, q_heads, -1), lse.reshape(batch, q_heads)


def mla_selected_decode_attention(
    q_latent: Float[Array, "batch q_heads d_c"],
    q_rope: Float[Array, "batch q_heads d_rope"],
    latent_pages: Float[Array, "*layers pages page_size d_c"],
    rope_pages: Float[Array, "*layers pages page_size d_rope"],
    selection: Selection,
    *,
    scale: float,
    impl="auto",
    interpret: bool | None = None,
    layer: int | Int[Array, ""] | None = None,
) -> tuple[Float[Array, "batch q_heads d_c"], Float[Array, "batch q_heads"]]:
    """`mla_decode_attention` over a `Selection` (one latent head: sel_heads is 1)."""
    op = "mla_selected_decode_attention"
    _check_selection(op, selection, q_latent.shape[0], 1)
    fn, _ = registry.resolve(op, impl, interpret)
    return fn(q_latent, q_rope, latent_pages, rope_pages, selection, scale=scale, layer=layer)


def _mla_selected(q_latent, q_rope, latent_pages, rope_pages, selection, *, scale, layer=None,
                  impl, interpret=None):
    return ops.mla_decode_attention(
        q_latent, q_rope, latent_pages, rope_pages, selection.lengths[:, 0],
        selection.block_tables[:, 0], scale=scale, impl=impl, interpret=interpret, layer=layer)


def _pages_only(view: QuantizedLayerView, block_tables, quant_lengths, rows: int):
    """`view` reading `quant_lengths` tokens through `block_tables`, with an empty tail."""
    def empty(tail):
        return jnp.zeros((tail.shape[0], rows, 1, tail.shape[-1]), tail.dtype)

    return dataclasses.replace(view, block_tables=block_tables, quant_lengths=quant_lengths,
                               lengths=quant_lengths, tail_k=empty(view.tail_k),
                               tail_v=empty(view.tail_v))


def _decode_q_pos(lengths):
    return jnp.where(lengths > 0, lengths - 1, -1).astype(jnp.int32)[:, None]


def quantized_selected_decode_attention(
    q: Float[Array, "batch q_heads head_dim"],
    view: QuantizedLayerView,
    selection: Selection,
    *,
    scale: float | None = None,
    soft_cap: float | None = None,
    impl="auto",
    interpret: bool | None = None,
) -> tuple[Float[Array, "batch q_heads head_dim"], Float[Array, "batch q_heads"]]:
    """Decode attention (query at lengths - 1) over selected quantized pages and the tail.

    Args:
      q: [batch, q_heads, head_dim]; batch rows are the view's rows (its slots).
      view: a KIVI GQA/MHA/MQA layer view (`kvjax.cache.layer_view`; whole pools are fine).
      selection: quantized pages to read (lengths count quantized tokens, at most each
        sequence's `quant_lengths`).
      scale: logit scale, default 1/sqrt(head_dim). soft_cap: optional logit soft cap.
      impl, interpret: as in `quantized_decode_attention`.

    Returns:
      (out [batch, q_heads, head_dim] in q's dtype, lse float32[batch, q_heads]).
    """
    op = "quantized_selected_decode_attention"
    if not isinstance(view, QuantizedLayerView) or view.is_mla:
        raise TypeError(f"{op}: view must be the QuantizedLayerView of a GQA/MHA/MQA cache.")
    if q.ndim != 3 or q.shape[0] != view.lengths.shape[0]:
        raise ValueError(f"{op}: q must be [batch={view.lengths.shape[0]}, q_heads, head_dim], "
                         f"got {q.shape}.")
    _check_selection(op, selection, q.shape[0], view.k.codes.shape[-4])
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    fn, _ = registry.resolve(op, impl, interpret)
    return fn(q, view, selection, scale=scale, soft_cap=soft_cap)


def _quantized_selected(q, view, selection, *, scale, soft_cap=None, impl, interpret=None):
    batch, q_heads, head_dim = q.shape
    bt, ln = selection.block_tables, selection.lengths
    q_pos = _decode_q_pos(view.lengths)
    if bt.shape[1] == 1:
        rows_q, rows_view, rows_pos = q[:, None], _pages_only(view, bt[:, 0], ln[:, 0],
                                                               batch), q_pos
    else:
        lead = 0 if view.layer is None else 1
        kv_heads, num_pages = view.k.codes.shape[lead:lead + 2]

        def flat(x: QuantLayer) -> QuantLayer:
            return dataclasses.replace(x, codes=_flat_heads(x.codes, lead),
                                       scale=_flat_heads(x.scale, lead),
                                       zero=_flat_heads(x.zero, lead))

        rows = batch * kv_heads
        one = dataclasses.replace(view, k=flat(view.k), v=flat(view.v),
                                  tail_k=view.tail_k[:1], tail_v=view.tail_v[:1])
        rows_view = _pages_only(one, _head_rows(bt, num_pages), ln.reshape(-1), rows)
        rows_q = q.reshape(rows, 1, q_heads // kv_heads, head_dim)
        rows_pos = jnp.repeat(q_pos, kv_heads, axis=0)
    fn, rows_view = quantized._with_layer("quantized_attention", impl, interpret, rows_view)
    out_q, lse_q = fn(
        rows_q, *rows_view.k.arrays, *rows_view.v.arrays, rows_view.tail_k, rows_view.tail_v,
        rows_view.quant_lengths, rows_view.lengths, rows_view.block_tables, rows_pos,
        k_bits=rows_view.k.bits, v_bits=rows_view.v.bits, scale=scale, soft_cap=soft_cap)
    out_q = out_q.reshape(batch, 1, q_heads, -1)
    lse_q = lse_q.reshape(batch, 1, q_heads)
    out, lse = qref.merge_with_tail(out_q, lse_q, q[:, None], view.tail_k, view.tail_v,
                                    view.quant_lengths, view.lengths, q_pos, scale=scale,
                                    soft_cap=soft_cap)
    return out[:, 0], lse[:, 0]


def quantized_mla_selected_decode_attention(
    q_latent: Float[Array, "batch q_heads d_c"],
    q_rope: Float[Array, "batch q_heads d_rope"],
    view: QuantizedLayerView,
    selection: Selection,
    *,
    scale: float,
    impl="auto",
    interpret: bool | None = None,
) -> tuple[Float[Array, "batch q_heads d_c"], Float[Array, "batch q_heads"]]:
    """Absorbed MLA decode over selected quantized latent pages and the whole tail."""
    op = "quantized_mla_selected_decode_attention"
    if not isinstance(view, QuantizedLayerView) or not view.is_mla:
        raise TypeError(f"{op}: view must be the QuantizedLayerView of an MLA cache.")
    _check_selection(op, selection, q_latent.shape[0], 1)
    fn, _ = registry.resolve(op, impl, interpret)
    return fn(q_latent, q_rope, view, selection, scale=scale)


def _quantized_mla_selected(q_latent, q_rope, view, selection, *, scale, impl,
                            interpret=None):
    batch = q_latent.shape[0]
    q_pos = _decode_q_pos(view.lengths)
    rows_view = _pages_only(view, selection.block_tables[:, 0], selection.lengths[:, 0], batch)
    fn, rows_view = quantized._with_layer("quantized_mla_attention", impl, interpret, rows_view)
    pools = (*rows_view.k.arrays, rows_view.v)
    if rows_view.layer is None:  # one layer's pools: drop the single head axis
        pools = tuple(p[0] for p in pools)
    out_q, lse_q = fn(q_latent[:, None], q_rope[:, None], *pools, rows_view.tail_k[0],
                      rows_view.tail_v[0], rows_view.quant_lengths, rows_view.lengths,
                      rows_view.block_tables, q_pos, bits=rows_view.k.bits, scale=scale)
    out, lse = qref.mla_merge_with_tail(out_q, lse_q, q_latent[:, None], q_rope[:, None],
                                        view.tail_k[0], view.tail_v[0], view.quant_lengths,
                                        view.lengths, q_pos, scale=scale)
    return out[:, 0], lse[:, 0]


registry.register_composite("selected_decode_attention", _selected)
registry.register_composite("mla_selected_decode_attention", _mla_selected)
registry.register_composite("quantized_selected_decode_attention", _quantized_selected)
registry.register_composite("quantized_mla_selected_decode_attention", _quantized_mla_selected)
