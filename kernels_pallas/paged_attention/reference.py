"""Plain-jnp reference for paged attention: decode and chunked prefill (MHA/GQA/MQA).

These functions are the oracle for every kernel in this folder and the simple
XLA path of `kvjax.attention`. They gather each sequence's pages through its
block table (never the whole pool per sequence) and compute attention in
float32.

Layouts (one layer):
  k_pages: [kv_heads, num_pages, page_size, head_dim]
  v_pages: [kv_heads, num_pages, page_size, v_head_dim]
  block_tables: int32[batch, max_pages]; entry j holds the page of tokens
    [j * page_size, (j + 1) * page_size) of that sequence. Entries at or past
    `ceil(lengths / page_size)` are never read: they may hold anything.
  lengths: int32[batch], tokens in the cache for each sequence, new ones included.

Query head h uses KV head h // (q_heads // kv_heads): consecutive query heads
form a group. KV is never repeated per query head.

Scale, soft cap and sliding window:
  logits = q . k * scale, then `soft_cap * tanh(logits / soft_cap)` if a cap is
  given; a query at position p sees key positions k with p - k < sliding_window.
The log-sum-exp (natural log) is of the final logits over visible keys; a query
that sees nothing returns output 0 and lse -inf.

Keys a query must not see are removed by selection (`jnp.where`), in the logits
and in the values, never by a zero weight: NaN or inf in a page or row a
sequence cannot see leaves its output bit-identical.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kernels_pallas.merge import NEG_INF

__all__ = ["paged_decode_attention", "paged_prefill_attention", "gather_pages",
           "select_seen_values"]


def gather_pages(
    pages: Float[Array, "heads pages page_size width"],
    block_tables: Int[Array, "batch max_pages"],
    lengths: Int[Array, " batch"],
) -> Float[Array, "batch heads max_tokens width"]:
    """Gathers each sequence's pages into a contiguous `[batch, heads, tokens, width]` view.

    Table entries past a sequence's length are replaced by page 0 before the
    gather so that untrusted entries are never used as indices; the tokens
    they would hold (page 0 may be anyone's) must be selected away by the
    caller, in the logits and in the values (`select_seen_values`).
    """
    heads, num_pages, page_size, width = pages.shape
    batch, max_pages = block_tables.shape
    used = jnp.arange(max_pages)[None, :] * page_size < lengths[:, None]
    safe = jnp.where(used, block_tables, 0)
    g = pages[:, safe]  # [heads, batch, max_pages, page_size, width]
    g = g.reshape(heads, batch, max_pages * page_size, width)
    return jnp.swapaxes(g, 0, 1)


def select_seen_values(
    v: Float[Array, "batch kv_heads keys width"],
    visible: Bool[Array, "batch 1 1 q_len keys"],
) -> Float[Array, "batch kv_heads keys width"]:
    """float32 values with every key no query of its row sees set to 0 by selection.

    The probabilities of such keys are 0, but 0 * NaN and 0 * inf are NaN: a
    non-finite value in a page or row a sequence cannot see (the unused rows of
    its last page; page 0, gathered for every dead table entry of every
    sequence) would otherwise reach its output.
    """
    seen = jnp.any(visible, axis=(1, 2, 3))  # [batch, keys]
    return jnp.where(seen[:, None, :, None], v.astype(jnp.float32), 0.0)


def _attend(qs, ks, v, visible, scale, soft_cap):
    """Attention with logits summed over (q, k) pairs.

    qs: tuple of [b, kvh, g, t, d_i]; ks: tuple of [b, kvh, s, d_i];
    v: [b, kvh, s, dv]; visible: [b, 1, 1, t, s].
    """
    logits = sum(
        jnp.einsum(
            "bhgtd,bhsd->bhgts", q.astype(jnp.float32), k.astype(jnp.float32),
            precision=jax.lax.Precision.HIGHEST,
        )
        for q, k in zip(qs, ks, strict=True)
    ) * jnp.float32(scale)
    if soft_cap is not None:
        logits = jnp.float32(soft_cap) * jnp.tanh(logits / jnp.float32(soft_cap))
    logits = jnp.where(visible, logits, NEG_INF)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(m == NEG_INF, 0.0, m)  # rows that see nothing: keep exp() at 0, not NaN
    p = jnp.where(visible, jnp.exp(logits - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum(
        "bhgts,bhsd->bhgtd", p, select_seen_values(v, visible),
        precision=jax.lax.Precision.HIGHEST,
    )
    out = out / jnp.where(denom == 0.0, 1.0, denom)
    lse = jnp.where(denom[..., 0] == 0.0, NEG_INF, m[..., 0] + jnp.log(denom[..., 0]))
    return out, lse


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
) -> tuple[Float[Array, "batch q_len q_heads v_head_dim"], Float[Array, "batch q_len q_heads"]]:
    """Chunked-prefill attention: new queries attend causally to the cache.

    The cache already holds the new tokens: sequence b has `lengths[b]` tokens
    of which the last `q_lengths[b]` are the new ones, so query t (for
    t < q_lengths[b]) sits at position `lengths[b] - q_lengths[b] + t` and sees
    every cached key at or before it. Queries at t >= q_lengths[b] are padding:
    their output is 0 and their lse -inf.

    Returns:
      out: [batch, q_len, q_heads, v_head_dim] in q's dtype.
      lse: float32[batch, q_len, q_heads].
    """
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return prefill_core(
        (q,), (k_pages,), v_pages, lengths, block_tables, q_lengths,
        scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
    )


def prefill_core(qs, k_pages_parts, v_pages, lengths, block_tables, q_lengths, *,
                 scale, soft_cap=None, sliding_window=None):
    """Shared body of the GQA and MLA references.

    The logits are the sum over parts of q_part . k_part, so MLA's
    [c_KV, k_rope] key needs no concatenated copy of the pool.
    `qs[i]` is [batch, q_len, q_heads, d_i], `k_pages_parts[i]` is
    [kv_heads, pages, page_size, d_i].
    """
    batch, q_len, q_heads, _ = qs[0].shape
    kv_heads = v_pages.shape[0]
    group = q_heads // kv_heads
    ks = tuple(gather_pages(kp, block_tables, lengths) for kp in k_pages_parts)
    v = gather_pages(v_pages, block_tables, lengths)
    max_tokens = v.shape[2]

    t = jnp.arange(q_len)[None, :]
    q_pos = lengths[:, None] - q_lengths[:, None] + t  # [batch, q_len]
    k_pos = jnp.arange(max_tokens)[None, None, :]
    visible = (k_pos <= q_pos[:, :, None]) & (t < q_lengths[:, None])[:, :, None]
    visible &= k_pos < lengths[:, None, None]
    if sliding_window is not None:
        visible &= q_pos[:, :, None] - k_pos < sliding_window

    qgs = tuple(
        q.reshape(batch, q_len, kv_heads, group, q.shape[-1]).transpose(0, 2, 3, 1, 4)
        for q in qs
    )
    out, lse = _attend(qgs, ks, v, visible[:, None, None], scale, soft_cap)
    out = out.transpose(0, 3, 1, 2, 4).reshape(batch, q_len, q_heads, -1)
    lse = lse.transpose(0, 3, 1, 2).reshape(batch, q_len, q_heads)
    return out.astype(qs[0].dtype), lse


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
) -> tuple[Float[Array, "batch q_heads v_head_dim"], Float[Array, "batch q_heads"]]:
    """Decode attention: one query per sequence, at position `lengths - 1`.

    Returns:
      out: [batch, q_heads, v_head_dim] in q's dtype.
      lse: float32[batch, q_heads].
    """
    ones = jnp.ones_like(lengths)
    out, lse = paged_prefill_attention(
        q[:, None], k_pages, v_pages, lengths, block_tables, jnp.minimum(ones, lengths),
        scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
    )
    return out[:, 0], lse[:, 0]
