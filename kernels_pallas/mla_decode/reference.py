"""Plain-jnp reference for paged MLA attention in absorbed form.

DeepSeek-V2's multi-head latent attention caches, per token, one latent
"head": the normalised `c_KV` (d_c wide) and the shared rotary key `k_rope`
(d_rope wide). With W_UK absorbed into the query, every query head attends
over the same latent tokens (MQA over the latent):

    logits[h, s] = (q_latent[h] . c_kv[s] + q_rope[h] . k_rope[s]) * scale
    out[h]       = softmax(logits[h]) @ c_kv            # latent space, d_c wide

The caller applies W_UV to `out` afterwards. `scale` is given by the caller
because it is 1/sqrt(qk_nope_head_dim + qk_rope_head_dim) (times any YaRN
mscale), not a function of d_c.

Layouts (one layer), with the cache's single latent head squeezed away:
  latent_pages: [num_pages, page_size, d_c]
  rope_pages:   [num_pages, page_size, d_rope]
  block_tables: int32[batch, max_pages]; lengths: int32[batch] (new tokens included).
"""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels_pallas.paged_attention.reference import prefill_core

__all__ = ["mla_decode_attention", "mla_prefill_attention"]


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
) -> tuple[Float[Array, "batch q_len q_heads d_c"], Float[Array, "batch q_len q_heads"]]:
    """Chunked-prefill MLA attention in absorbed form; causal as in `paged_prefill_attention`.

    Returns:
      out: [batch, q_len, q_heads, d_c] in q_latent's dtype (latent space).
      lse: float32[batch, q_len, q_heads].
    """
    # Key [c_kv, k_rope] and value c_kv make MLA an MQA with one KV head.
    return prefill_core(
        (q_latent, q_rope), (latent_pages[None], rope_pages[None]), latent_pages[None],
        lengths, block_tables, q_lengths, scale=scale,
    )


def mla_decode_attention(
    q_latent: Float[Array, "batch q_heads d_c"],
    q_rope: Float[Array, "batch q_heads d_rope"],
    latent_pages: Float[Array, "pages page_size d_c"],
    rope_pages: Float[Array, "pages page_size d_rope"],
    lengths: Int[Array, " batch"],
    block_tables: Int[Array, "batch max_pages"],
    *,
    scale: float,
) -> tuple[Float[Array, "batch q_heads d_c"], Float[Array, "batch q_heads"]]:
    """Decode MLA attention in absorbed form: one query per sequence at `lengths - 1`.

    Returns:
      out: [batch, q_heads, d_c] in q_latent's dtype; lse: float32[batch, q_heads].
    """
    ones = jnp.ones_like(lengths)
    out, lse = mla_prefill_attention(
        q_latent[:, None], q_rope[:, None], latent_pages, rope_pages, lengths, block_tables,
        jnp.minimum(ones, lengths), scale=scale,
    )
    return out[:, 0], lse[:, 0]

