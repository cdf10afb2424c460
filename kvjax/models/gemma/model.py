"""The Gemma 2 / Gemma 3 model on the paged cache: `cache_spec` and `forward`.

`forward` follows the model contract (`kvjax.models.base`): the caller has already
reserved the new tokens in the cache; each layer writes its K/V with
`kvjax.cache.write` and attends with `kvjax.cache.attend`, passing its own window
(`GemmaConfig.window(layer)`: the local layers' `sliding_window`, None for global ones),
its soft cap and the `query_pre_attn_scalar` scale. The layers run as an unrolled loop
with static layer indices: local and global layers differ in window and RoPE, and a
cache whose local layers keep only their window's pages dispatches on the layer index.

One decoder layer (transformers' `Gemma2DecoderLayer` / `Gemma3DecoderLayer`):

    h = attn(norm_in(x));   x = x + norm_post_attn(h)
    h = mlp(norm_pre_mlp(x)); x = x + norm_post_mlp(h)

with every norm the (1 + w) RMSNorm (`layers.rms_norm_1p`), attention on q and k
normalised per head (Gemma 3) and rotated with the layer type's RoPE, and the MLP
`down(gelu_tanh(gate(h)) * up(h))`. The embedding is multiplied by sqrt(hidden_size)
rounded to the params' dtype, as transformers does.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kvjax import cache as kv_cache
from kvjax.models.base import Packing, check_logits_at, check_packing, gather_positions
from kvjax.models.gemma.config import GLOBAL, LOCAL, GemmaConfig
from kvjax.models.gemma.params import GemmaLayerParams, GemmaParams
from kvjax.models.layers import (
    apply_rope,
    embed_rows,
    layer_params,
    linear,
    rms_norm_1p,
    rope_cos_sin,
)
from kvjax.specs import CacheSpec, canonical_dtype

__all__ = ["cache_spec", "forward", "soft_cap"]


def cache_spec(config: GemmaConfig, *, page_size: int, num_pages: int, max_seqs: int,
               max_pages_per_seq: int, dtype="float32") -> CacheSpec:
    """The `CacheSpec` of a paged K/V cache for this model (every layer in the pool)."""
    return CacheSpec(attention=config.attention, num_layers=config.num_layers,
                     page_size=page_size, num_pages=num_pages, max_seqs=max_seqs,
                     max_pages_per_seq=max_pages_per_seq, dtype=canonical_dtype(dtype))


def soft_cap(x: Float[Array, "*shape"], cap: float | None) -> Float[Array, "*shape"]:
    """`cap * tanh(x / cap)` in x's dtype (identity for cap None)."""
    if cap is None:
        return x
    c = jnp.asarray(cap, x.dtype)
    return c * jnp.tanh(x / c)


def _mlp(config: GemmaConfig, lp: GemmaLayerParams, x):
    gate = linear(x, lp.w_gate)
    act = jax.nn.gelu(gate, approximate=config.hidden_activation == "gelu_pytorch_tanh")
    return linear(act * linear(x, lp.w_up), lp.w_down)


def _layer(c: GemmaConfig, lp: GemmaLayerParams, layer: int, x, rope, cache, rows, impl,
           select, packing=None):
    """One decoder layer over the paged cache. Returns (x, cache, post-RoPE q). With
    `packing`, x holds sequences end to end in one row; the cache sees them as rows."""
    batch, q_len, _ = x.shape
    eps = c.rms_norm_eps
    cos, sin = rope
    h = rms_norm_1p(x, lp.attn_norm, eps)
    q = linear(h, lp.wq).reshape(batch, q_len, c.q_heads, c.head_dim)
    k = linear(h, lp.wk).reshape(batch, q_len, c.kv_heads, c.head_dim)
    v = linear(h, lp.wv).reshape(batch, q_len, c.kv_heads, c.head_dim)
    if c.qk_norm:
        q = rms_norm_1p(q, lp.q_norm, eps)
        k = rms_norm_1p(k, lp.k_norm, eps)
    q = apply_rope(q, cos, sin)
    k = apply_rope(k, cos, sin)
    if packing is not None:
        q, k, v = packing.lanes(q), packing.lanes(k), packing.lanes(v)
    cache = kv_cache.write(cache, layer, k, v, **rows)
    selection = select(cache, layer, q[:, 0]) if select is not None and q_len == 1 else None
    out, _ = kv_cache.attend(cache, layer, q, selection=selection, scale=c.scale,
                             soft_cap=c.attn_softcap, sliding_window=c.window(layer),
                             impl=impl, **rows)
    if packing is not None:
        out = packing.packed(out.astype(x.dtype))  # rounded first: rows copied at 16 bits
    h = linear(out.astype(x.dtype).reshape(batch, q_len, -1), lp.wo)
    x = x + rms_norm_1p(h, lp.post_attn_norm, eps)
    h = _mlp(c, lp, rms_norm_1p(x, lp.mlp_norm, eps))
    x = x + rms_norm_1p(h, lp.post_mlp_norm, eps)
    return x, cache, q


def forward(
    params: GemmaParams,
    config: GemmaConfig,
    tokens: Int[Array, "batch q_len"],
    positions: Int[Array, "batch q_len"],
    cache: kv_cache.PagedKVCache,
    *,
    q_lengths: Int[Array, " batch"],
    seq_ids: Int[Array, " batch"] | None = None,
    impl="auto",
    select: Callable | None = None,
    observe: bool = False,
    logits_at: Int[Array, "batch k"] | None = None,
    packing: Packing | None = None,
):
    """Runs the model on new tokens whose cache slots are already reserved.

    Args:
      params: from `init_params` / `params_from_hf` (stacked or `unstack_layers`).
      config: the model config (static under jit).
      tokens: int32[batch, q_len]; entries t >= q_lengths[b] are padding.
      positions: int32[batch, q_len] RoPE positions of the tokens.
      cache: a cache of any page kind built for this model's attention geometry;
        `cache.lengths[seq]` already counts the new tokens, and token t of row b goes to
        position `lengths[seq_b] - q_lengths[b] + t`. Pure: jit it with the cache donated.
      q_lengths: int32[batch], real tokens per row.
      seq_ids: int32[batch] cache slots of the rows; None = every slot in order.
      impl: attention implementation (`kvjax.attention.IMPLS` or a `ShardedAttention`).
      select: optional `select(cache, layer, q [batch, q_heads, head_dim]) -> Selection |
        None` for each layer's decode attention (a cache policy's page selection).
      observe: also return the post-RoPE queries of every layer.
      logits_at: int32[batch, k] token indices (in [0, q_len)) at which to compute logits;
        None: every token (see `kvjax.models.base`).
      packing: a `kvjax.models.base.Packing`: tokens and positions are then one row [1,
        tokens] holding several sequences end to end, `q_lengths` and `seq_ids` (required)
        are per sequence and `logits_at` indexes the row ([1, k]). Not with `observe`.

    Returns:
      (float32 logits [batch, q_len, vocab] (or [batch, k, vocab] with `logits_at`), soft-
      capped when the config says so, the cache with the new K/V written), plus, with
      `observe`, the queries of every layer [layers, batch, q_len, q_heads, head_dim].

    Raises:
      ValueError: tokens and positions not both [batch, q_len], or a cache built for
        another geometry.
    """
    c = config
    if tokens.ndim != 2 or positions.shape != tokens.shape:
        raise ValueError(f"forward: tokens and positions must both be [batch, q_len]; got "
                         f"{tokens.shape} and {positions.shape}.")
    if cache.spec.attention != c.attention or cache.spec.num_layers != c.num_layers:
        raise ValueError(
            f"forward: the cache was built for {cache.spec.attention} x {cache.spec.num_layers} "
            f"layers, the model needs {c.attention} x {c.num_layers} layers (build it with "
            f"model.make_cache_spec).")
    check_logits_at(logits_at, tokens.shape)
    dtype = jnp.dtype(c.dtype)
    rows = dict(q_lengths=jnp.asarray(q_lengths, jnp.int32), seq_ids=seq_ids)
    if packing is not None:
        check_packing(packing, tokens.shape, rows["q_lengths"], seq_ids, observe)
    ropes = {LOCAL: rope_cos_sin(positions, c.rope_local, dtype)}
    ropes[GLOBAL] = (ropes[LOCAL] if c.rope_global == c.rope_local  # Gemma 2: one RoPE
                     else rope_cos_sin(positions, c.rope_global, dtype))
    normalizer = jnp.asarray(c.hidden_size ** 0.5, dtype)
    x = embed_rows(params.embed, tokens).astype(dtype) * normalizer
    queries = []
    for layer in range(c.num_layers):
        lp = (params.layers[layer] if isinstance(params.layers, tuple)
              else layer_params(params.layers, layer))
        x, cache, q = _layer(c, lp, layer, x, ropes[c.layer_types[layer]], cache, rows, impl,
                             select, packing)
        queries.append(q)
    if logits_at is not None:
        x = gather_positions(x, logits_at)
    x = rms_norm_1p(x, params.final_norm, c.rms_norm_eps)
    if params.lm_head is None:
        logits = jnp.einsum("bth,vh->btv", x, params.embed.astype(dtype))
    else:
        logits = linear(x, params.lm_head)
    logits = soft_cap(logits, c.final_softcap).astype(jnp.float32)
    if observe:
        return logits, cache, jnp.stack(queries)
    return logits, cache
