"""Decode attention over a selection of quantized pages (one per KV head) plus the whole tail.

A page-selecting policy on a KIVI cache (`kvjax.cache.policies.kivi.KIVIQuest`)
reads, per KV head, only some of a sequence's quantized pages, and always the
full-precision tail of recent tokens. This op computes

  * the quantized part with a per-KV-head block table: the pools are viewed
    as one KV head with `kv_heads * pages` pages (a free reshape of the
    leading axes), KV head h's page ids are offset by `h * pages`, and each
    (sequence, KV head) pair becomes a batch row carrying its group of query
    heads — the same trick as `kvjax.cache.policies.selected_decode_attention`,
    so no code, scale or key is copied;
  * the tail with the sequence's own ring (`merge_with_tail`), merged with the
    quantized part by log-sum-exp.

The quantized part runs `kernels_pallas.quantized_attention.reference.
quantized_pages_attention` (gather the selected pages' codes and scales,
dequantize in float32, attend): the XLA path on every backend.
"""

import jax.numpy as jnp
from jaxtyping import Array, Float

from kernels_pallas.quantized_attention import reference as qref
from kvjax.cache.policies.base import Selection
from kvjax.cache.quantized import QuantizedLayerView, QuantLayer

__all__ = ["quantized_selected_decode_attention"]


def quantized_selected_decode_attention(
    q: Float[Array, "batch q_heads head_dim"],
    view: QuantizedLayerView,
    selection: Selection,
    *,
    scale: float | None = None,
    soft_cap: float | None = None,
) -> tuple[Float[Array, "batch q_heads head_dim"], Float[Array, "batch q_heads"]]:
    """Decode attention (query at lengths - 1) over selected quantized pages and the tail.

    Args:
      q: [batch, q_heads, head_dim]; batch rows are the cache slots (batch == max_seqs).
      view: `kvjax.cache.quantized.layer_view(cache, layer)` of a GQA/MHA/MQA cache.
      selection: `Selection` of quantized pages: `block_tables` int32[batch, sel_heads,
        sel_pages] (page ids, any order, -1 or anything past `lengths` unused) and
        `lengths` int32[batch, sel_heads], the quantized tokens read through that
        table (at most the sequence's `quant_lengths`). `sel_heads` is 1 or kv_heads.
      scale: logit scale, default 1/sqrt(head_dim).
      soft_cap: optional logit soft cap.

    Returns:
      (out [batch, q_heads, head_dim] in q's dtype, lse float32[batch, q_heads]); rows of
      empty sequences give 0 and -inf.
    """
    op = "quantized_selected_decode_attention"
    if not isinstance(view, QuantizedLayerView) or not isinstance(view.v, QuantLayer):
        raise TypeError(f"{op}: view must be the QuantizedLayerView of a GQA/MHA/MQA cache.")
    if q.ndim != 3:
        raise ValueError(f"{op}: q must be [batch, q_heads, head_dim], got {q.shape}.")
    batch, q_heads, head_dim = q.shape
    kv_heads, num_pages = view.k.codes.shape[:2]
    if batch != view.lengths.shape[0]:
        raise ValueError(f"{op}: q has batch {batch} but the cache has "
                         f"{view.lengths.shape[0]} slots.")
    if head_dim != view.tail_k.shape[-1] or q_heads % kv_heads:
        raise ValueError(f"{op}: q {q.shape} does not fit the cache's {kv_heads} KV heads of "
                         f"head_dim {view.tail_k.shape[-1]}.")
    bt, sel_len = selection.block_tables, selection.lengths
    sel_heads = bt.shape[1] if bt.ndim == 3 else -1
    if bt.ndim != 3 or bt.shape[0] != batch or sel_len.shape != (batch, sel_heads) or (
            sel_heads not in (1, kv_heads)):
        raise ValueError(
            f"{op}: selection block_tables {bt.shape} and lengths {sel_len.shape} must be "
            f"[batch={batch}, sel_heads, sel_pages] and [batch, sel_heads], sel_heads 1 or "
            f"{kv_heads}.")
    scale = head_dim ** -0.5 if scale is None else scale
    q_pos = jnp.where(view.lengths > 0, view.lengths - 1, -1).astype(jnp.int32)[:, None]
    group = q_heads // kv_heads
    opts = dict(k_bits=view.k.bits, v_bits=view.v.bits, scale=scale, soft_cap=soft_cap)
    if sel_heads == 1:
        out_q, lse_q = qref.quantized_pages_attention(
            q[:, None], view.k.codes, view.k.scale, view.k.zero, view.v.codes, view.v.scale,
            view.v.zero, sel_len[:, 0], bt[:, 0], q_pos, **opts)
    else:
        def flat(x):  # [kv_heads, pages, ...] -> [1, kv_heads * pages, ...], a free reshape
            return x.reshape(1, kv_heads * num_pages, *x.shape[2:])

        offset = (jnp.arange(kv_heads, dtype=jnp.int32) * num_pages)[None, :, None]
        rows_bt = jnp.where(bt >= 0, bt + offset, -1).reshape(batch * kv_heads, -1)
        rows_pos = jnp.repeat(q_pos, kv_heads, axis=0)
        out_q, lse_q = qref.quantized_pages_attention(
            q.reshape(batch * kv_heads, 1, group, head_dim),
            flat(view.k.codes), flat(view.k.scale), flat(view.k.zero),
            flat(view.v.codes), flat(view.v.scale), flat(view.v.zero),
            sel_len.reshape(-1), rows_bt, rows_pos, **opts)
        out_q = out_q.reshape(batch, 1, q_heads, -1)
        lse_q = lse_q.reshape(batch, 1, q_heads)
    out, lse = qref.merge_with_tail(out_q, lse_q, q[:, None], view.tail_k, view.tail_v,
                                    view.quant_lengths, view.lengths, q_pos, scale=scale,
                                    soft_cap=soft_cap)
    return out[:, 0], lse[:, 0]
