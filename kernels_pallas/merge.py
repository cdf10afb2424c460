"""Combining partial attention results by their log-sum-exp.

Attention over a set of keys can be computed piecewise: each piece returns its
normalised output and the log-sum-exp (lse) of its logits. Two pieces combine
exactly:

    lse = logaddexp(lse_a, lse_b)
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

This one primitive serves split pages, the quantized-plus-full-precision tail
and cross-device context parallelism. An empty piece has lse = -inf and
contributes nothing; two empty pieces give output 0 and lse -inf.
"""

import jax.numpy as jnp
from jaxtyping import Array, Float

__all__ = ["merge_attention_states", "merge_splits", "NEG_INF"]

NEG_INF = float("-inf")


def merge_attention_states(
    out_a: Float[Array, "*batch width"],
    lse_a: Float[Array, "*batch"],
    out_b: Float[Array, "*batch width"],
    lse_b: Float[Array, "*batch"],
) -> tuple[Float[Array, "*batch width"], Float[Array, "*batch"]]:
    """Merges two partial attention results over disjoint key sets.

    Args:
      out_a, out_b: outputs normalised over their own keys, `[..., width]`.
      lse_a, lse_b: float32 log-sum-exp of each piece's logits, `[...]`.

    Returns:
      (out, lse): the output over the union of keys in `out_a`'s dtype, and its
      float32 lse.
    """
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape:
        raise ValueError(
            f"merge_attention_states: shapes differ: out {out_a.shape} vs {out_b.shape}, "
            f"lse {lse_a.shape} vs {lse_b.shape}."
        )
    if out_a.shape[:-1] != lse_a.shape:
        raise ValueError(
            f"merge_attention_states: lse shape {lse_a.shape} must equal out shape without "
            f"its last axis, {out_a.shape[:-1]}."
        )
    lse_a = lse_a.astype(jnp.float32)
    lse_b = lse_b.astype(jnp.float32)
    m = jnp.maximum(lse_a, lse_b)
    m_safe = jnp.where(m == NEG_INF, 0.0, m)
    wa = jnp.exp(lse_a - m_safe)
    wb = jnp.exp(lse_b - m_safe)
    total = wa + wb
    lse = jnp.where(total == 0.0, NEG_INF, m_safe + jnp.log(total))
    inv = jnp.where(total == 0.0, 0.0, 1.0 / jnp.where(total == 0.0, 1.0, total))
    out = (out_a.astype(jnp.float32) * (wa * inv)[..., None]
           + out_b.astype(jnp.float32) * (wb * inv)[..., None])
    return out.astype(out_a.dtype), lse


def merge_splits(out, lse):
    """Combines the split axis (axis 0) of split-K partials (out [splits, ...], lse
    [splits, ...]) by log-sum-exp in a tree of log2(splits) merges."""
    while out.shape[0] > 1:
        if out.shape[0] % 2:
            # An empty piece (output 0, lse -inf) contributes nothing.
            out = jnp.concatenate([out, jnp.zeros_like(out[:1])])
            lse = jnp.concatenate([lse, jnp.full_like(lse[:1], NEG_INF)])
        half = out.shape[0] // 2
        out, lse = merge_attention_states(out[:half], lse[:half], out[half:], lse[half:])
    return out[0], lse[0]
