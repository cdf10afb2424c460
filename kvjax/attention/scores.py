"""Attention probabilities over a paged cache, for policies that score cached tokens.

Eviction policies (H2O, SnapKV, PyramidKV) rank cached tokens by the
attention they receive. The attention ops return outputs and log-sum-exps,
not the probability matrix, so this module recomputes it with XLA over the
gathered pages. It is a separate pass over the keys (no values are read); the
policies that need it say so.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels_pallas.paged_attention.reference import gather_pages

__all__ = ["paged_attention_probs"]


def paged_attention_probs(
    q: Float[Array, "batch q_len q_heads head_dim"],
    k_pages: Float[Array, "kv_heads pages page_size head_dim"],
    lengths: Int[Array, " batch"],
    block_tables: Int[Array, "batch max_pages"],
    q_lengths: Int[Array, " batch"],
    *,
    scale: float | None = None,
    soft_cap: float | None = None,
) -> Float[Array, "batch q_len q_heads max_tokens"]:
    """Softmax attention probabilities of `q` over each sequence's cached keys, causal.

    Positions follow `paged_prefill_attention`: query t of sequence b sits at
    position `lengths[b] - q_lengths[b] + t` and sees cached positions at or
    before it. Padding queries (t >= q_lengths[b]) and invisible keys get 0.

    Args:
      q: [batch, q_len, q_heads, head_dim].
      k_pages: one layer's key pool, [kv_heads, pages, page_size, head_dim].
      lengths: int32[batch], cached tokens per sequence (the queries' own keys included).
      block_tables: int32[batch, max_pages].
      q_lengths: int32[batch], real queries per row.
      scale: logit scale, default 1/sqrt(head_dim).
      soft_cap: if set, logits become soft_cap * tanh(logits / soft_cap).

    Returns:
      float32[batch, q_len, q_heads, max_pages * page_size]; column j is cache
      position j of the sequence.
    """
    if q.ndim != 4 or k_pages.ndim != 4 or q.shape[-1] != k_pages.shape[-1]:
        raise ValueError(
            f"paged_attention_probs: q must be [batch, q_len, q_heads, head_dim] and k_pages "
            f"[kv_heads, pages, page_size, head_dim] with equal head_dim; got {q.shape} and "
            f"{k_pages.shape}."
        )
    batch, q_len, q_heads, head_dim = q.shape
    kv_heads = k_pages.shape[0]
    if q_heads % kv_heads:
        raise ValueError(
            f"paged_attention_probs: q_heads={q_heads} is not a multiple of kv_heads={kv_heads}."
        )
    group = q_heads // kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    k = gather_pages(k_pages, block_tables, lengths)  # [batch, kv_heads, tokens, head_dim]
    tokens = k.shape[2]
    qg = q.reshape(batch, q_len, kv_heads, group, head_dim)
    logits = jnp.einsum(
        "bthgd,bhsd->bthgs", qg.astype(jnp.float32), k.astype(jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
    ) * jnp.float32(scale)
    if soft_cap is not None:
        logits = jnp.float32(soft_cap) * jnp.tanh(logits / jnp.float32(soft_cap))
    t = jnp.arange(q_len)[None, :]
    q_pos = lengths[:, None] - q_lengths[:, None] + t  # [batch, q_len]
    k_pos = jnp.arange(tokens)[None, None, :]
    visible = (k_pos <= q_pos[:, :, None]) & (k_pos < lengths[:, None, None])
    visible &= (t < q_lengths[:, None])[:, :, None]
    visible = visible[:, :, None, None, :]
    logits = jnp.where(visible, logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(visible, jnp.exp(logits - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0.0, 1.0, denom)
    return p.reshape(batch, q_len, q_heads, tokens)
