"""Plain-jnp reference for attention over quantized pages plus a full-precision tail.

A sequence's keys and values live in two places (see
`kvjax.cache.quantized`): positions [0, Q) in quantized pages named by its
block-table row, positions [Q, L) in a full-precision ring buffer (position p
in slot p mod ring). Attention is computed on each part and the two partial
results are combined by log-sum-exp (`merge_attention_states`).

The quantized part gathers, per sequence, only the packed codes, scales and
zeros of the pages its block table names (entries past Q are replaced by page
0 and selected away: logits and values of keys a query may not see are removed
with `jnp.where`, so NaN/inf in them, or in the tail ring's unused slots,
cannot reach it), dequantizes those in float32 and attends; it never forms a
dequantized copy of the pool. A kernel replaces `quantized_pages_attention`
(and `quantized_mla_pages_attention`) with the same signature, reading the
same bytes (layout in `layout.py`).

Layouts (one layer):
  *_codes: uint8[kv_heads, pages, page_size, width * bits / 8]
  k_scale, k_zero: [kv_heads, pages, page_size / G, head_dim]  (per channel)
  v_scale, v_zero: [kv_heads, pages, page_size, v_head_dim / G] (per token)
  MLA: c_codes uint8[pages, page_size, d_c * bits / 8], c_scale/c_zero
    [pages, page_size, d_c / G], rope_pages [pages, page_size, d_rope].
  tail_k, tail_v: [kv_heads, batch, ring, width] (MLA: [batch, ring, width]).
  quant_lengths Q, lengths L: int32[batch]; block_tables int32[batch, max_pages].
  q_pos: int32[batch, q_len], position of each query; a query sees keys at
    positions <= its own; q_pos < 0 marks padding (output 0, lse -inf).

Logits are `q . k * scale` (then `soft_cap * tanh(logits / soft_cap)` if a
cap is given; with `sliding_window` a query at p sees keys k with
p - k < sliding_window); float32 throughout; query head h uses KV head
h // (q_heads // kv_heads).
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, UInt8

from kernels_pallas.merge import NEG_INF, merge_attention_states
from kernels_pallas.paged_attention.reference import select_seen_values
from kernels_pallas.quantized_attention.layout import dequantize

__all__ = [
    "gather_dequantize",
    "quantized_pages_attention",
    "tail_attention",
    "quantized_attention",
    "merge_with_tail",
    "quantized_mla_pages_attention",
    "quantized_mla_attention",
    "mla_merge_with_tail",
]


def gather_dequantize(
    codes: UInt8[Array, "heads pages page_size packed"],
    scale: Float[Array, "heads pages srows scols"],
    zero: Float[Array, "heads pages srows scols"],
    block_tables: Int[Array, "batch max_pages"],
    lengths: Int[Array, " batch"],
    *,
    bits: int,
    grouping: str,
) -> Float[Array, "batch heads max_tokens width"]:
    """Dequantizes each sequence's own pages: float32 `[batch, heads, max_pages * ps, width]`.

    Table entries at or past `ceil(lengths / page_size)` are replaced by page 0
    before the gather (never trusted as indices); their tokens must be masked
    by the caller.
    """
    heads, _, page_size, _ = codes.shape
    batch, max_pages = block_tables.shape
    used = jnp.arange(max_pages)[None, :] * page_size < lengths[:, None]
    safe = jnp.where(used, block_tables, 0)
    x = dequantize(codes[:, safe], scale[:, safe], zero[:, safe], bits=bits, grouping=grouping)
    x = x.reshape(heads, batch, max_pages * page_size, x.shape[-1])
    return jnp.swapaxes(x, 0, 1)


def _attend(qs, ks, v, visible, scale, soft_cap):
    """qs: tuple of [b, kvh, g, t, d_i]; ks: tuple of [b, kvh, s, d_i]; v [b, kvh, s, dv];
    visible [b, 1, 1, t, s]. Returns out [b, kvh, g, t, dv] f32 and lse [b, kvh, g, t]."""
    hi = jax.lax.Precision.HIGHEST
    logits = sum(
        jnp.einsum("bhgtd,bhsd->bhgts", q.astype(jnp.float32), k.astype(jnp.float32),
                   precision=hi)
        for q, k in zip(qs, ks, strict=True)
    ) * jnp.float32(scale)
    if soft_cap is not None:
        logits = jnp.float32(soft_cap) * jnp.tanh(logits / jnp.float32(soft_cap))
    logits = jnp.where(visible, logits, NEG_INF)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(m == NEG_INF, 0.0, m)
    p = jnp.where(visible, jnp.exp(logits - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("bhgts,bhsd->bhgtd", p, select_seen_values(v, visible), precision=hi)
    out = out / jnp.where(denom == 0.0, 1.0, denom)
    lse = jnp.where(denom[..., 0] == 0.0, NEG_INF, m[..., 0] + jnp.log(denom[..., 0]))
    return out, lse


def _visible(k_pos, lo, hi, q_pos, sliding_window):
    """[batch, 1, 1, q_len, keys]: key positions in [lo, hi) at or before each query."""
    vis = (k_pos[:, None, :] >= lo[:, None, None]) & (k_pos[:, None, :] < hi[:, None, None])
    vis &= (k_pos[:, None, :] <= q_pos[:, :, None]) & (q_pos[:, :, None] >= 0)
    if sliding_window is not None:
        vis &= q_pos[:, :, None] - k_pos[:, None, :] < sliding_window
    return vis[:, None, None]


def _group(q, kv_heads):
    """[b, t, hq, d] -> [b, kvh, g, t, d]."""
    b, t, hq, d = q.shape
    return q.reshape(b, t, kv_heads, hq // kv_heads, d).transpose(0, 2, 3, 1, 4)


def _ungroup(out, lse):
    b, kvh, g, t, d = out.shape
    return (out.transpose(0, 3, 1, 2, 4).reshape(b, t, kvh * g, d),
            lse.transpose(0, 3, 1, 2).reshape(b, t, kvh * g))


def quantized_pages_attention(
    q: Float[Array, "batch q_len q_heads head_dim"],
    k_codes: UInt8[Array, "kv_heads pages page_size k_packed"],
    k_scale: Float[Array, "kv_heads pages k_srows head_dim"],
    k_zero: Float[Array, "kv_heads pages k_srows head_dim"],
    v_codes: UInt8[Array, "kv_heads pages page_size v_packed"],
    v_scale: Float[Array, "kv_heads pages page_size v_groups"],
    v_zero: Float[Array, "kv_heads pages page_size v_groups"],
    quant_lengths: Int[Array, " batch"],
    block_tables: Int[Array, "batch max_pages"],
    q_pos: Int[Array, "batch q_len"],
    *,
    k_bits: int,
    v_bits: int,
    scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
) -> tuple[Float[Array, "batch q_len q_heads v_head_dim"], Float[Array, "batch q_len q_heads"]]:
    """Attention over the quantized pages only (positions [0, quant_lengths)).

    Returns:
      (out float32 [batch, q_len, q_heads, v_head_dim], lse float32 [batch, q_len, q_heads]).
    """
    kv_heads = k_codes.shape[0]
    k = gather_dequantize(k_codes, k_scale, k_zero, block_tables, quant_lengths, bits=k_bits,
                          grouping="tokens")
    v = gather_dequantize(v_codes, v_scale, v_zero, block_tables, quant_lengths, bits=v_bits,
                          grouping="channels")
    k_pos = jnp.broadcast_to(jnp.arange(k.shape[2]), (q.shape[0], k.shape[2]))
    vis = _visible(k_pos, jnp.zeros_like(quant_lengths), quant_lengths, q_pos, sliding_window)
    out, lse = _attend((_group(q, kv_heads),), (k,), v, vis, scale, soft_cap)
    return _ungroup(out, lse)


def _tail_positions(quant_lengths, ring):
    """Position held by each ring slot: Q + ((slot - Q) mod ring), [batch, ring]."""
    slot = jnp.arange(ring)[None, :]
    return quant_lengths[:, None] + jnp.mod(slot - quant_lengths[:, None], ring)


def tail_attention(
    q: Float[Array, "batch q_len q_heads head_dim"],
    tail_k: Float[Array, "kv_heads batch ring head_dim"],
    tail_v: Float[Array, "kv_heads batch ring v_head_dim"],
    quant_lengths: Int[Array, " batch"],
    lengths: Int[Array, " batch"],
    q_pos: Int[Array, "batch q_len"],
    *,
    scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
) -> tuple[Float[Array, "batch q_len q_heads v_head_dim"], Float[Array, "batch q_len q_heads"]]:
    """Attention over the full-precision tail (positions [quant_lengths, lengths))."""
    kv_heads, _, ring, _ = tail_k.shape
    k_pos = _tail_positions(quant_lengths, ring)
    vis = _visible(k_pos, quant_lengths, lengths, q_pos, sliding_window)
    out, lse = _attend((_group(q, kv_heads),), (jnp.swapaxes(tail_k, 0, 1),),
                       jnp.swapaxes(tail_v, 0, 1), vis, scale, soft_cap)
    return _ungroup(out, lse)


def quantized_attention(
    q: Float[Array, "batch q_len q_heads head_dim"],
    k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
    tail_k: Float[Array, "kv_heads batch ring head_dim"],
    tail_v: Float[Array, "kv_heads batch ring v_head_dim"],
    quant_lengths: Int[Array, " batch"],
    lengths: Int[Array, " batch"],
    block_tables: Int[Array, "batch max_pages"],
    q_pos: Int[Array, "batch q_len"],
    *,
    k_bits: int,
    v_bits: int,
    scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
) -> tuple[Float[Array, "batch q_len q_heads v_head_dim"], Float[Array, "batch q_len q_heads"]]:
    """Quantized pages and full-precision tail, merged by log-sum-exp.

    Returns:
      (out [batch, q_len, q_heads, v_head_dim] in q's dtype, lse float32 [batch, q_len, q_heads]).
    """
    opts = dict(scale=scale, soft_cap=soft_cap, sliding_window=sliding_window)
    out_q, lse_q = quantized_pages_attention(
        q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, quant_lengths, block_tables,
        q_pos, k_bits=k_bits, v_bits=v_bits, **opts)
    return merge_with_tail(out_q, lse_q, q, tail_k, tail_v, quant_lengths, lengths, q_pos,
                           **opts)


def merge_with_tail(out_q, lse_q, q, tail_k, tail_v, quant_lengths, lengths, q_pos, *, scale,
                    soft_cap=None, sliding_window=None):
    """Attends over the tail and merges it with the quantized pages' (out_q, lse_q).

    The part of `quantized_attention` after the pages, shared with the kernels
    (`tpu.py`, `gpu.py`), which replace only `quantized_pages_attention`.
    Returns (out in q's dtype, lse float32), shapes as in `quantized_attention`.
    """
    out_t, lse_t = tail_attention(q, tail_k, tail_v, quant_lengths, lengths, q_pos, scale=scale,
                                  soft_cap=soft_cap, sliding_window=sliding_window)
    out, lse = merge_attention_states(out_q, lse_q, out_t, lse_t)
    return out.astype(q.dtype), lse


def quantized_mla_pages_attention(
    q_latent: Float[Array, "batch q_len q_heads d_c"],
    q_rope: Float[Array, "batch q_len q_heads d_rope"],
    c_codes: UInt8[Array, "pages page_size c_packed"],
    c_scale: Float[Array, "pages page_size c_groups"],
    c_zero: Float[Array, "pages page_size c_groups"],
    rope_pages: Float[Array, "pages page_size d_rope"],
    quant_lengths: Int[Array, " batch"],
    block_tables: Int[Array, "batch max_pages"],
    q_pos: Int[Array, "batch q_len"],
    *,
    bits: int,
    scale: float,
) -> tuple[Float[Array, "batch q_len q_heads d_c"], Float[Array, "batch q_len q_heads"]]:
    """Absorbed MLA attention over quantized latent pages: keys [c_KV, k_rope], values c_KV."""
    c = gather_dequantize(c_codes[None], c_scale[None], c_zero[None], block_tables,
                          quant_lengths, bits=bits, grouping="channels")
    batch, max_pages = block_tables.shape
    page_size = rope_pages.shape[1]
    used = jnp.arange(max_pages)[None, :] * page_size < quant_lengths[:, None]
    r = rope_pages[jnp.where(used, block_tables, 0)]  # [batch, max_pages, ps, d_rope]
    r = r.reshape(batch, 1, max_pages * page_size, r.shape[-1])
    k_pos = jnp.broadcast_to(jnp.arange(c.shape[2]), (batch, c.shape[2]))
    vis = _visible(k_pos, jnp.zeros_like(quant_lengths), quant_lengths, q_pos, None)
    out, lse = _attend((_group(q_latent, 1), _group(q_rope, 1)), (c, r), c, vis, scale, None)
    return _ungroup(out, lse)


def quantized_mla_attention(
    q_latent: Float[Array, "batch q_len q_heads d_c"],
    q_rope: Float[Array, "batch q_len q_heads d_rope"],
    c_codes, c_scale, c_zero,
    rope_pages: Float[Array, "pages page_size d_rope"],
    tail_c: Float[Array, "batch ring d_c"],
    tail_rope: Float[Array, "batch ring d_rope"],
    quant_lengths: Int[Array, " batch"],
    lengths: Int[Array, " batch"],
    block_tables: Int[Array, "batch max_pages"],
    q_pos: Int[Array, "batch q_len"],
    *,
    bits: int,
    scale: float,
) -> tuple[Float[Array, "batch q_len q_heads d_c"], Float[Array, "batch q_len q_heads"]]:
    """MLA over quantized latent pages plus the full-precision tail, merged by log-sum-exp.

    Returns:
      (out in latent space [batch, q_len, q_heads, d_c] in q_latent's dtype,
      lse float32 [batch, q_len, q_heads]).
    """
    out_q, lse_q = quantized_mla_pages_attention(
        q_latent, q_rope, c_codes, c_scale, c_zero, rope_pages, quant_lengths, block_tables,
        q_pos, bits=bits, scale=scale)
    return mla_merge_with_tail(out_q, lse_q, q_latent, q_rope, tail_c, tail_rope, quant_lengths,
                               lengths, q_pos, scale=scale)


def mla_merge_with_tail(out_q, lse_q, q_latent, q_rope, tail_c, tail_rope, quant_lengths,
                        lengths, q_pos, *, scale):
    """MLA's `merge_with_tail`: attends over the latent tail and merges with the pages' part."""
    ring = tail_c.shape[1]
    k_pos = _tail_positions(quant_lengths, ring)
    vis = _visible(k_pos, quant_lengths, lengths, q_pos, None)
    out_t, lse_t = _attend((_group(q_latent, 1), _group(q_rope, 1)),
                           (tail_c[:, None], tail_rope[:, None]), tail_c[:, None], vis, scale,
                           None)
    out_t, lse_t = _ungroup(out_t, lse_t)
    out, lse = merge_attention_states(out_q, lse_q, out_t, lse_t)
    return out.astype(q_latent.dtype), lse
