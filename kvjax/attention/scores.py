"""Attention probabilities over paged keys, for cache policies that score cached tokens.

Eviction policies (H2O, SnapKV, PyramidKV) rank cached tokens by the attention
they receive. The attention ops return outputs and log-sum-exps, not the
probability matrix, so this module recomputes the probabilities: two blocked
passes over the keys (no values), one block of pages at a time through the same
`BlockReader`s as the XLA attention path — the first finds each query's
log-sum-exp, the second turns each block's logits into probabilities and adds
them up over the counted queries. No sequence's keys are ever gathered whole
(nor, for quantized pages, dequantized whole): a block of pages is the largest
key array in flight.

Keys come in parts whose logits add up (MLA: the latent and the rotary key), from
full-precision or KIVI-quantized pages, plus, for a KIVI cache, the
full-precision tail ring of recent tokens (`tail_probs_input`).
"""

import itertools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels_pallas.merge import NEG_INF
from kvjax.attention.xla import BlockReader, _dot, _parts, default_block_tokens

__all__ = ["blocked_attention_probs"]


def _fold(q, kv_heads):
    """[batch, q_len, q_heads, d] -> [kv_heads, batch, group * q_len, d] (rows = (g, t))."""
    batch, q_len, q_heads, d = q.shape
    group = q_heads // kv_heads
    q = q.reshape(batch, q_len, kv_heads, group, d).transpose(2, 0, 3, 1, 4)
    return q.reshape(kv_heads, batch, group * q_len, d)


def blocked_attention_probs(
    qs: tuple[Float[Array, "batch q_len q_heads d"], ...],
    k_readers: tuple[BlockReader, ...],
    lengths: Int[Array, " batch"],
    block_tables: Int[Array, "batch max_pages"],
    q_pos: Int[Array, "batch q_len"],
    weights: Float[Array, "batch q_len"],
    *,
    page_size: int,
    kv_heads: int,
    scale: float,
    soft_cap: float | None = None,
    tail: tuple | None = None,
) -> Float[Array, "batch q_heads max_tokens"]:
    """Softmax probabilities each cached position gets, summed over weighted queries.

    Args:
      qs: query parts `[batch, q_len, q_heads, d_i]`; logit = scale * sum_i q_i . k_i.
      k_readers: one reader per part over the paged keys (positions [0, lengths)).
      lengths: int32[batch], keys read through the pages.
      block_tables: int32[batch, max_pages]; entries past `lengths` are never read.
      q_pos: int32[batch, q_len], each query's position; it sees keys at positions
        <= q_pos. Rows with q_pos < 0 see nothing.
      weights: float32[batch, q_len], how much each query's probabilities count
        (0 for padding or queries outside an observation window).
      page_size, kv_heads: geometry of the pages (kv_heads 1 for MLA).
      scale, soft_cap: as in the attention ops.
      tail: optional `(parts, positions, valid)` of extra keys, e.g. a KIVI tail ring:
        `parts` one `[kv_heads, batch, n, d_i]` array per query part, `positions`
        int32[batch, n] their cache positions (< max_pages * page_size), `valid`
        bool[batch, n]. They join the softmax and their probabilities are added at
        their positions.

    Returns:
      float32[batch, q_heads, max_pages * page_size]; column j is cache position j.
    """
    batch, q_len, q_heads, _ = qs[0].shape
    max_pages = block_tables.shape[1]
    group = q_heads // kv_heads
    rows = group * q_len
    widths = sum(q.shape[-1] for q in qs)
    bp = max(1, min(default_block_tokens(kv_heads, batch, widths) // page_size, max_pages))
    bt = bp * page_size
    n_blocks = -(-max_pages // bp)
    pad = n_blocks * bp - max_pages
    used = jnp.arange(max_pages)[None, :] * page_size < lengths[:, None]
    safe = jnp.pad(jnp.where(used, block_tables, 0).astype(jnp.int32), ((0, 0), (0, pad)))
    stop = -(-jnp.max(lengths) // bt)

    folded = tuple(_fold(q.astype(jnp.float32) * jnp.float32(scale), kv_heads) for q in qs)
    row_pos = jnp.tile(q_pos.astype(jnp.int32), (1, group))  # [batch, rows], rows = (g, t)
    lim = jnp.minimum(row_pos + 1, lengths[:, None])  # page keys < lim are visible
    w_rows = jnp.tile(weights.astype(jnp.float32), (1, group))
    slices = [tuple(x.shape[-1] for x in _parts(jax.eval_shape(r, safe[:, :bp])))
              for r in k_readers]
    q_parts = [tuple(jnp.split(q, list(itertools.accumulate(w[:-1])), axis=-1))
               for q, w in zip(folded, slices, strict=True)]

    def logits(i):
        idx = jax.lax.dynamic_slice_in_dim(safe, i * bp, bp, axis=1)
        arrays, _ = jax.lax.optimization_barrier(([r.arrays for r in k_readers], i))
        ks = [_parts(r(idx, a)) for r, a in zip(k_readers, arrays, strict=True)]
        s = sum(_dot(k, q, 3, 3) for qp, kp in zip(q_parts, ks, strict=True)
                for q, k in zip(qp, kp, strict=True))  # [heads, batch, tokens, rows]
        if soft_cap is not None:
            s = jnp.float32(soft_cap) * jnp.tanh(s / jnp.float32(soft_cap))
        k_pos = i * bt + jnp.arange(bt, dtype=jnp.int32)
        vis = k_pos[None, :, None] < lim[:, None, :]
        return jnp.where(vis[None], s, NEG_INF)

    def lse_body(carry):
        i, m, den = carry
        s = logits(i)
        m_new = jnp.maximum(m, jnp.max(s, axis=2))
        m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
        den = den * jnp.exp(m - m_safe) + jnp.sum(jnp.exp(s - m_safe[:, :, None]), axis=2)
        return i + 1, m_new, den

    init = (jnp.int32(0), jnp.full((kv_heads, batch, rows), NEG_INF, jnp.float32),
            jnp.zeros((kv_heads, batch, rows), jnp.float32))
    _, m, den = jax.lax.while_loop(lambda c: c[0] < stop, lse_body, init)
    lse = jnp.where(den > 0, m + jnp.log(jnp.where(den > 0, den, 1.0)), NEG_INF)

    if tail is not None:
        t_parts, t_pos, t_valid = tail
        q_flat = [jnp.concatenate(qp, axis=-1) for qp in q_parts]
        st = sum(jnp.einsum("hbrd,hbnd->hbrn", q, k.astype(jnp.float32),
                            precision=jax.lax.Precision.HIGHEST)
                 for q, k in zip(q_flat, t_parts, strict=True))
        if soft_cap is not None:
            st = jnp.float32(soft_cap) * jnp.tanh(st / jnp.float32(soft_cap))
        t_vis = t_valid[:, None, :] & (t_pos[:, None, :] <= row_pos[:, :, None])
        st = jnp.where(t_vis[None], st, NEG_INF)
        mt = jnp.max(st, axis=-1)
        mt = jnp.where(mt == NEG_INF, 0.0, mt)
        dt = jnp.sum(jnp.exp(st - mt[..., None]), axis=-1)
        lse = jnp.logaddexp(lse, jnp.where(dt > 0, mt + jnp.log(jnp.where(dt > 0, dt, 1.0)),
                                           NEG_INF))
    lse_safe = jnp.where(lse == NEG_INF, 0.0, lse)

    def prob_body(carry):
        i, out = carry
        p = jnp.exp(logits(i) - lse_safe[:, :, None])  # [heads, batch, tokens, rows]
        p = p * w_rows[None, :, None, :]
        p = p.reshape(kv_heads, batch, bt, group, q_len).sum(axis=-1)
        return i + 1, jax.lax.dynamic_update_slice_in_dim(out, p, i * bt, axis=2)

    out = jnp.zeros((kv_heads, batch, n_blocks * bt, group), jnp.float32)
    _, out = jax.lax.while_loop(lambda c: c[0] < stop, prob_body, (jnp.int32(0), out))
    out = out[:, :, : max_pages * page_size]

    if tail is not None:
        pt = jnp.exp(st - lse_safe[..., None]) * w_rows[None, :, :, None]  # [h, b, rows, n]
        pt = pt.reshape(kv_heads, batch, group, q_len, -1).sum(axis=3)  # [h, b, g, n]
        col = jnp.where(t_valid, t_pos, out.shape[2])  # invalid slots: dropped
        b_idx = jnp.arange(batch)[:, None]
        out = out.at[:, b_idx, col].add(jnp.moveaxis(pt, 3, 2), mode="drop")
    # [heads, batch, tokens, group] -> [batch, q_heads, tokens]
    return jnp.moveaxis(out, 3, 1).reshape(kv_heads * group, batch, -1).swapaxes(0, 1)
