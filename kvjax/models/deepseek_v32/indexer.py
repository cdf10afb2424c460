"""The lightning indexer's projections: queries, the key to cache, per-head weights.

For the tokens x of a layer (and the layer's normalised low-rank query q_resid,
`kvjax.models.deepseek.mla.q_lora`):

    q = q_resid @ q_b                  -> [heads, index_dim] per token
    k = LayerNorm(x @ k_proj)          -> [index_dim] per token (eps 1e-6, with bias)
    w = (x @ weights_proj) / sqrt(heads), float32

q and k carry a rotate-half rotary embedding on their first `qk_rope_head_dim`
channels (the same angles as MLA's, which rotates interleaved pairs). The score of
cached token s for query t is `sum_h w[t, h] * relu(q[t, h] . k[s] / sqrt(index_dim))`
(`kvjax.attention.indexer_scores`). transformers 5.24's `DeepseekV32Indexer` computes
these in bf16/fp32 where DeepSeek's kernels use a Hadamard rotation and FP8 (the
rotation preserves dot products; FP8 is a precision choice): kvjax follows
transformers.
"""

import jax.numpy as jnp

from kvjax.models import layers
from kvjax.models.deepseek_v32.config import DeepseekV32Config
from kvjax.models.deepseek_v32.params import IndexerParams
from kvjax.rope import apply_rope

__all__ = ["indexer_inputs", "layer_norm", "K_NORM_EPS"]

# transformers builds the indexer's k_norm as nn.LayerNorm(index_head_dim, eps=1e-6).
K_NORM_EPS = 1e-6


def layer_norm(x, weight, bias, eps: float):
    """LayerNorm over the last axis, statistics and affine map in float32, result in x's
    dtype (as PyTorch computes it for 16-bit inputs)."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * (1.0 / jnp.sqrt(var + jnp.float32(eps)))
    return (y * weight.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def indexer_inputs(p: IndexerParams, config: DeepseekV32Config, x, q_resid, cos, sin):
    """One layer's indexer queries, keys and head weights (unstacked `p`).

    Args:
      p: the layer's `IndexerParams`.
      config: the architecture.
      x: the normed hidden states [B, T, hidden].
      q_resid: `q_a_layernorm(q_a_proj(x))` [B, T, q_lora_rank].
      cos, sin: float32 [B, T, rope/2], MLA's rotary tables (`mla.rope_tables`).

    Returns:
      q [B, T, index_heads, index_dim] and k [B, T, index_dim] (rotated, x's dtype),
      w float32 [B, T, index_heads].
    """
    c = config
    b, t, _ = x.shape
    dr = c.qk_rope_head_dim
    q = layers.linear(q_resid, p.q_b, None).reshape(b, t, c.index_n_heads, c.index_head_dim)
    k = layer_norm(layers.linear(x, p.k_proj, None), p.k_norm, p.k_norm_bias, K_NORM_EPS)
    q = jnp.concatenate([apply_rope(q[..., :dr], cos, sin), q[..., dr:]], axis=-1)
    k = jnp.concatenate([apply_rope(k[:, :, None, :dr], cos, sin)[:, :, 0], k[..., dr:]],
                        axis=-1)
    w = layers.linear(x.astype(jnp.float32), p.weights_proj, None)
    return q, k, w * jnp.float32(c.index_n_heads ** -0.5)
