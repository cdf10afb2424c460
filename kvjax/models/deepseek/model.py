"""The DeepSeek model on the paged latent cache: `cache_spec`, `forward`, `forward_dense`.

`forward` follows the model contract (`kvjax.models.base`): the caller has already
reserved the new tokens in the cache; each layer writes its latents with
`kvjax.cache.write` and attends in absorbed form with `kvjax.cache.attend`
(`_attention`, the one place that talks to the cache) — whatever the page kind
(full-precision or KIVI latents), policy or backend. The dense and MoE layer groups
each run as one `lax.scan`, so compile time does not grow with depth.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kvjax import cache as kcache
from kvjax.cache import PagedKVCache
from kvjax.models import layers
from kvjax.models.base import check_logits_at, gather_positions
from kvjax.models.deepseek import mla, moe
from kvjax.models.deepseek.config import DeepseekConfig
from kvjax.models.deepseek.params import DeepseekLayerParams, DeepseekParams
from kvjax.specs import CacheSpec, canonical_dtype

__all__ = ["cache_spec", "forward", "forward_dense", "run_decoder", "check_forward_args"]


def cache_spec(
    config: DeepseekConfig, *, page_size: int, num_pages: int, max_seqs: int,
    max_pages_per_seq: int, dtype: object = "float32",
) -> CacheSpec:
    """The latent-cache `CacheSpec` for this model (`LatentPages`: c_KV and k_rope per token)."""
    return CacheSpec(
        attention=config.attention, num_layers=config.num_layers, page_size=page_size,
        num_pages=num_pages, max_seqs=max_seqs, max_pages_per_seq=max_pages_per_seq,
        dtype=canonical_dtype(dtype),
    )


def _attention(p: DeepseekLayerParams, config: DeepseekConfig, x, cos, sin, cache: PagedKVCache,
               layer, rows, impl, select):
    """One MLA layer: write the new latents, attend in absorbed form.

    Returns (out, cache, q) with q the absorbed query `[q_latent, q_rope]` (concatenated,
    the form cache policies score with).
    """
    q_nope, q_rope, c_kv, k_rope = mla.mla_inputs(p, config, x, cos, sin)
    cache = kcache.write(cache, layer, c_kv, k_rope, **rows)
    q_latent = mla.absorb_query(p, q_nope)
    q = jnp.concatenate([q_latent, q_rope.astype(q_latent.dtype)], axis=-1)
    # A policy's page selection (Quest, PyramidKV's layer budgets) applies to decode.
    selection = select(cache, layer, q[:, 0]) if select is not None and x.shape[1] == 1 else None
    out, _ = kcache.attend(cache, layer, (q_latent, q_rope), selection=selection,
                           scale=config.softmax_scale, impl=impl, **rows)
    return mla.output(p, config, out.astype(x.dtype)), cache, q


def check_forward_args(config, tokens, positions, cache, q_lengths, seq_ids):
    """`forward`'s argument checks (shapes, dtypes, the cache's geometry); raises
    ValueError / TypeError naming what was given and what the model needs."""
    if tokens.ndim != 2 or positions.shape != tokens.shape:
        raise ValueError(f"forward: tokens and positions must both be [batch, q_len]; got "
                         f"{tokens.shape} and {positions.shape}.")
    for name, x in (("tokens", tokens), ("positions", positions), ("q_lengths", q_lengths)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"forward: {name} must be integer, got {x.dtype}.")
    if q_lengths.shape != (tokens.shape[0],):
        raise ValueError(f"forward: q_lengths must be [batch={tokens.shape[0]}], got "
                         f"{q_lengths.shape}.")
    spec = cache.spec
    if spec.attention != config.attention or spec.num_layers != config.num_layers:
        raise ValueError(
            f"forward: the cache was built for {spec.attention} x {spec.num_layers} layers, but "
            f"the model needs {config.attention} x {config.num_layers} layers; build it with "
            f"deepseek.cache_spec(config, ...)."
        )
    if seq_ids is None and tokens.shape[0] != spec.max_seqs:
        raise ValueError(f"forward: without seq_ids the batch must cover all max_seqs="
                         f"{spec.max_seqs} slots, got batch {tokens.shape[0]}.")
    if seq_ids is not None and seq_ids.shape != (tokens.shape[0],):
        raise ValueError(f"forward: seq_ids must be [batch={tokens.shape[0]}], got "
                         f"{seq_ids.shape}.")


def forward(
    params: DeepseekParams,
    config: DeepseekConfig,
    tokens: Int[Array, "batch q_len"],
    positions: Int[Array, "batch q_len"],
    cache: PagedKVCache,
    *,
    q_lengths: Int[Array, " batch"],
    seq_ids: Int[Array, " batch"] | None = None,
    impl="auto",
    select: Callable | None = None,
    observe: bool = False,
    logits_at: Int[Array, "batch k"] | None = None,
):
    """Runs the model on new tokens, writing their latents into the cache.

    The caller has already called `kvjax.cache.reserve` for these tokens: token
    t of row b goes to cache position `lengths[seq_b] - q_lengths[b] + t`.
    Pure; jit it with `config` static and the cache donated.

    Args:
      params: from `init_params` / `params_from_hf`.
      config: the architecture (static).
      tokens: int32[batch, q_len]; positions t >= q_lengths[b] are padding.
      positions: int32[batch, q_len] RoPE positions.
      cache: a latent cache (any page kind) from `cache_spec(config, ...)` (donate it
        under jit).
      q_lengths: int32[batch] real tokens per row.
      seq_ids: int32[batch] cache slots of the rows (None: all slots in order).
      impl: attention implementation (`kvjax.attention.IMPLS` or a `ShardedAttention`).
      select: optional `select(cache, layer, q) -> Selection | None` for decode, q the
        absorbed query `[q_latent, q_rope]` [batch, heads, d_c + d_rope] (see
        `kvjax.models.base`).
      observe: also return the absorbed queries of every layer.
      logits_at: int32[batch, k] token indices (in [0, q_len)) at which to compute
        logits; None: every token (see `kvjax.models.base`).

    Returns:
      (float32 logits [batch, q_len, vocab] (or [batch, k, vocab] with `logits_at`),
      updated cache), plus, with `observe`, the queries of every layer
      [layers, batch, q_len, heads, d_c + d_rope].
    """
    check_forward_args(config, tokens, positions, cache, q_lengths, seq_ids)
    check_logits_at(logits_at, tokens.shape)

    def attention(p, h, cos, sin, cache, layer, rows):
        return _attention(p, config, h, cos, sin, cache, layer, rows, impl, select)

    return run_decoder(params, config, tokens, positions, cache, attention,
                       q_lengths=q_lengths, seq_ids=seq_ids, observe=observe,
                       logits_at=logits_at)


def run_decoder(
    params: DeepseekParams,
    config: DeepseekConfig,
    tokens: Int[Array, "batch q_len"],
    positions: Int[Array, "batch q_len"],
    cache: PagedKVCache,
    attention: Callable,
    *,
    q_lengths: Int[Array, " batch"],
    seq_ids: Int[Array, " batch"] | None = None,
    observe: bool = False,
    logits_at: Int[Array, "batch k"] | None = None,
):
    """The decoder around a layer's attention: embeddings, the dense and MoE layer groups
    (one `lax.scan` each), the final norm and the LM head (arguments checked by the caller).

    `attention(p, h, cos, sin, cache, layer, rows) -> (out [batch, q_len, hidden], cache,
    q)` is one layer's attention on the cache, `h` the normed hidden states, `rows` the
    keyword arguments `q_lengths` and `seq_ids` of the cache operations, `q` the queries
    `observe` stacks. `forward` passes MLA's; DeepSeek-V3.2 its sparse attention.

    Returns:
      As `forward`.
    """
    q_lengths = q_lengths.astype(jnp.int32)
    rows = dict(q_lengths=q_lengths, seq_ids=seq_ids)
    cos, sin = mla.rope_tables(config, positions)

    x = layers.embed_rows(params.embed, tokens)
    eps = config.rms_norm_eps

    def block(mlp_fn, offset):
        def body(carry, xs):
            x, cache = carry
            p, i = xs
            attn, cache, q = attention(p, layers.rms_norm(x, p.input_norm, eps), cos, sin,
                                       cache, offset + i, rows)
            x = x + attn
            x = x + mlp_fn(p, layers.rms_norm(x, p.post_norm, eps))
            return (x, cache), (q if observe else None)
        return body

    queries = []
    if config.num_dense_layers:
        n = config.num_dense_layers
        body = block(lambda p, h: moe.swiglu(h, p.mlp), 0)
        (x, cache), q = jax.lax.scan(body, (x, cache),
                                     (params.dense_layers, jnp.arange(n, dtype=jnp.int32)))
        queries.append(q)
    if config.num_moe_layers:
        n = config.num_moe_layers
        body = block(lambda p, h: moe.moe(p.moe, config, h), config.num_dense_layers)
        (x, cache), q = jax.lax.scan(body, (x, cache),
                                     (params.moe_layers, jnp.arange(n, dtype=jnp.int32)))
        queries.append(q)

    if logits_at is not None:
        x = gather_positions(x, logits_at)
    x = layers.rms_norm(x, params.final_norm, eps)
    head = params.embed.T if config.tie_word_embeddings else params.lm_head
    logits = layers.linear(x, head, None).astype(jnp.float32)
    if observe:
        return logits, cache, jnp.concatenate(queries, axis=0)
    return logits, cache


def forward_dense(
    params: DeepseekParams,
    config: DeepseekConfig,
    tokens: Int[Array, "batch seq"],
) -> Float[Array, "batch seq vocab"]:
    """Cache-free causal forward over whole sequences (training and reference scoring).

    The same params as `forward` (token t at position t); attention decompresses
    K and V from the latents per head (`mla_attention_naive`), the cheaper form
    when every token is a query.

    Args:
      params: from `init_params` / `params_from_hf`.
      config: the architecture (static).
      tokens: int32[batch, seq].

    Returns:
      float32 logits [batch, seq, vocab].
    """
    if tokens.ndim != 2:
        raise ValueError(f"forward_dense: tokens must be [batch, seq], got {tokens.shape}.")
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    lengths = jnp.full((b,), t, jnp.int32)
    cos, sin = mla.rope_tables(config, positions)
    eps = config.rms_norm_eps
    x = layers.embed_rows(params.embed, tokens)

    def block(mlp_fn):
        def body(x, p):
            h = layers.rms_norm(x, p.input_norm, eps)
            q_nope, q_rope, c_kv, k_rope = mla.mla_inputs(p, config, h, cos, sin)
            attn = mla.mla_attention_naive(p, config, c_kv, k_rope, q_nope, q_rope, positions,
                                       lengths)
            x = x + attn.astype(x.dtype)
            return x + mlp_fn(p, layers.rms_norm(x, p.post_norm, eps)), None
        return body

    if config.num_dense_layers:
        x, _ = jax.lax.scan(block(lambda p, h: moe.swiglu(h, p.mlp)), x, params.dense_layers)
    if config.num_moe_layers:
        x, _ = jax.lax.scan(block(lambda p, h: moe.moe(p.moe, config, h)), x,
                            params.moe_layers)
    x = layers.rms_norm(x, params.final_norm, eps)
    head = params.embed.T if config.tie_word_embeddings else params.lm_head
    return layers.linear(x, head, None).astype(jnp.float32)
