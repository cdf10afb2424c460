"""Multi-head latent attention: the projections around the latent cache, without the cache.

Per token the cache holds the normalised latent c_KV (`kv_lora_rank` wide) and
the shared rotated key k_rope. Decode and prefill never decompress it: W_UK is
absorbed into the query and W_UV applied to the output in latent space,

    q_latent[h] = q_nope[h] @ W_UK[h]            # [kv_lora_rank]
    logit[h, s] = (q_latent[h] . c_kv[s] + q_rope[h] . k_rope[s]) * scale

(`mla_inputs`, `absorb_query`, then attention over the cache, then `output`).
`mla_attention_naive` is the textbook decompressing form, for tests and for the
cache-free `forward_dense`.

RoPE (`kvjax.rope`): DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ...
(V2 always; V3 when `rope_interleave`, else the rotate-half layout); cos and sin
carry YaRN's `attention_factor`. The rotated pairs are stored interleaved;
transformers' V3 stores them de-interleaved, a fixed permutation applied to
queries and keys alike, so scores are identical.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kvjax.models import layers
from kvjax.models.deepseek.config import DeepseekConfig
from kvjax.models.deepseek.params import DeepseekLayerParams
from kvjax.rope import apply_rope, rope_cos_sin

__all__ = ["rope_tables", "q_lora", "mla_inputs", "absorb_query", "output",
           "mla_attention_naive", "LATENT_NORM_EPS"]

# transformers builds q_a_layernorm / kv_a_layernorm without passing rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def rope_tables(config: DeepseekConfig, positions: Int[Array, "batch q_len"]):
    """cos, sin float32[batch, q_len, rope/2] of `config.rope` (with YaRN's attention factor)."""
    return rope_cos_sin(positions, config.rope, jnp.float32)


def q_lora(p: DeepseekLayerParams, x):
    """The normalised low-rank query `q_a_layernorm(q_a_proj(x))` [B,T,q_lora_rank] (a
    config with `q_lora_rank`); DeepSeek-V3.2's indexer reads it too."""
    return layers.rms_norm(layers.linear(x, p.q_a_proj, None), p.q_a_norm, LATENT_NORM_EPS)


def mla_inputs(p: DeepseekLayerParams, config: DeepseekConfig, x, cos, sin, q_resid=None):
    """Query parts and the new latents of one layer.

    `q_resid`: `q_lora(p, x)` when the caller has it already (else computed here).

    Returns q_nope [B,T,H,dn], q_rope [B,T,H,dr] (rotated), c_kv [B,T,dc]
    (normalised), k_rope [B,T,dr] (rotated).
    """
    c = config
    b, t, _ = x.shape
    if c.q_lora_rank is None:
        q = layers.linear(x, p.q_proj, None)
    else:
        q_a = q_lora(p, x) if q_resid is None else q_resid
        q = layers.linear(q_a, p.q_b_proj, None)
    q = q.reshape(b, t, c.num_heads, c.qk_head_dim)
    q_nope, q_rope = q[..., :c.qk_nope_head_dim], q[..., c.qk_nope_head_dim:]
    kv = layers.linear(x, p.kv_a_proj, None)
    c_kv = layers.rms_norm(kv[..., :c.kv_lora_rank], p.kv_a_norm, LATENT_NORM_EPS)
    k_rope = kv[..., c.kv_lora_rank:]
    # float32 rotation (cos, sin are float32), as transformers' DeepSeek computes it.
    q_rope = apply_rope(q_rope, cos, sin, interleaved=c.rope.interleaved)
    k_rope = apply_rope(k_rope[:, :, None], cos, sin, interleaved=c.rope.interleaved)[:, :, 0]
    return q_nope, q_rope, c_kv, k_rope


def absorb_query(p: DeepseekLayerParams, q_nope):
    """q_latent[h] = q_nope[h] @ W_UK[h]: [B,T,H,dn] -> [B,T,H,dc]."""
    return jnp.einsum("bthn,hnc->bthc", q_nope, p.w_uk)


def output(p: DeepseekLayerParams, config: DeepseekConfig, out_latent):
    """W_UV per head on the latent attention output, then o_proj: [B,T,H,dc] -> [B,T,hidden]."""
    b, t = out_latent.shape[:2]
    v = jnp.einsum("bthc,hcv->bthv", out_latent, p.w_uv)
    return layers.linear(v.reshape(b, t, config.num_heads * config.v_head_dim), p.o_proj, None)


def mla_attention_naive(
    p: DeepseekLayerParams, config: DeepseekConfig, c_kv: Float[Array, "batch seq d_c"],
    k_rope: Float[Array, "batch seq d_rope"], q_nope: Float[Array, "batch q_len q_heads d_nope"],
    q_rope: Float[Array, "batch q_len q_heads d_rope"], q_pos: Int[Array, "batch q_len"],
    lengths: Int[Array, " batch"],
) -> Float[Array, "batch q_len hidden"]:
    """MLA the textbook way, for tests: decompress K and V per head from dense latents, attend.

    Args:
      p: one layer's attention params (unstacked).
      c_kv, k_rope: dense per-sequence latents (position s at index s).
      q_nope, q_rope: queries (q_rope already rotated); query t of row b sits at q_pos[b, t]
        and sees positions <= q_pos and < lengths[b].
    Returns:
      attention output after o_proj, [batch, q_len, hidden], float32.
    """
    c = config
    f32 = jnp.float32
    kv_b_k = p.w_uk.astype(f32)  # [H, dn, dc]
    k_nope = jnp.einsum("bsc,hnc->bshn", c_kv.astype(f32), kv_b_k)
    v = jnp.einsum("bsc,hcv->bshv", c_kv.astype(f32), p.w_uv.astype(f32))
    logits = (jnp.einsum("bthn,bshn->bhts", q_nope.astype(f32), k_nope)
              + jnp.einsum("bthr,bsr->bhts", q_rope.astype(f32), k_rope.astype(f32)))
    logits = logits * f32(c.softmax_scale)
    s = jnp.arange(c_kv.shape[1])
    visible = (s[None, None, :] <= q_pos[:, :, None]) & (s[None, None, :] < lengths[:, None, None])
    logits = jnp.where(visible[:, None], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bhts,bshv->bthv", probs, v)
    b, t = out.shape[:2]
    return layers.linear(out.reshape(b, t, -1), p.o_proj.astype(f32), None)
