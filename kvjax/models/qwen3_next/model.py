"""The Qwen3-Next model on the paged cache: `cache_spec` and `forward`.

`forward` follows the model contract (`kvjax.models.base`): the caller has already
reserved the new tokens in the cache. A full-attention layer writes its K/V with
`kvjax.cache.write` and attends with `kvjax.cache.attend` (its index in the cache is its
rank among the full layers); a linear layer reads its slot's recurrent state with
`kvjax.cache.read_state`, continues it over the new tokens (the chunked form of the delta
rule for a prefill chunk, the recurrent form for one token) and stores it with
`kvjax.cache.write_state` (rows without tokens keep theirs). Padded tokens of a row get
beta = 0 and decay 1, so the state after a padded chunk is the state after its real
tokens; the convolution's state ends with each row's last real input.

When the layer pattern repeats (Qwen3-Next: three linear layers, then a full one), the
model runs as one `lax.scan` over the repeats, so compile time does not grow with depth.
"""

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from kvjax import cache as kcache
from kvjax.cache import PagedKVCache
from kvjax.models import layers
from kvjax.models.base import check_logits_at, gather_positions
from kvjax.models.deepseek import moe as ds_moe
from kvjax.models.layers import embed_rows, rms_norm_1p
from kvjax.models.qwen3_next import delta_rule
from kvjax.models.qwen3_next.config import FULL, Qwen3NextConfig
from kvjax.models.qwen3_next.params import (
    AttentionParams,
    DeltaNetParams,
    MoEParams,
    Qwen3NextParams,
)
from kvjax.specs import CacheSpec, canonical_dtype

__all__ = ["cache_spec", "forward", "rms_norm_1p"]


def cache_spec(
    config: Qwen3NextConfig, *, page_size: int, num_pages: int, max_seqs: int,
    max_pages_per_seq: int, dtype: object = "float32",
) -> CacheSpec:
    """Pages for the full-attention layers, a float32 recurrent state for the linear ones."""
    return CacheSpec(
        attention=config.attention, num_layers=config.num_layers, page_size=page_size,
        num_pages=num_pages, max_seqs=max_seqs, max_pages_per_seq=max_pages_per_seq,
        dtype=canonical_dtype(dtype), recurrent=config.recurrent)


def _gated_norm(x, gate, weight, eps):
    """The DeltaNet output norm: `weight * x / rms(x)` (cast to x's dtype first), times
    SiLU(gate) in float32, cast back."""
    xf = x.astype(jnp.float32)
    var = jnp.mean(xf * xf, axis=-1, keepdims=True)
    y = weight.astype(x.dtype) * (xf * jax.lax.rsqrt(var + jnp.float32(eps))).astype(x.dtype)
    return (y.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


def _l2norm(x):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + jnp.float32(1e-6))


def _matrix(w):
    """A [in, out] array from a weight that may be a `LayerSlice` of a stack."""
    return w.get() if isinstance(w, layers.LayerSlice) else w


def _linear_attention(p: DeltaNetParams, c: Qwen3NextConfig, x, cache: PagedKVCache, index,
                      q_lengths, seq_ids):
    """One Gated DeltaNet layer (linear layer `index`): returns (out, cache)."""
    batch, t, _ = x.shape
    nk, nv = c.linear_key_heads, c.linear_value_heads
    dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
    kw, vw = c.linear_key_width, c.linear_value_width
    mixed = layers.linear(x, p.w_qkvz, None)
    mixed, z = mixed[..., :c.conv_dim], mixed[..., c.conv_dim:]
    ba = layers.linear(x, p.w_ba, None)
    b, a = ba[..., :nv], ba[..., nv:]
    conv_state, ssm = kcache.read_state(cache, index, seq_ids)
    mixed, conv_state = delta_rule.causal_conv(mixed, conv_state, _matrix(p.conv), q_lengths)
    q = mixed[..., :kw].reshape(batch, t, nk, dk).astype(jnp.float32)
    k = mixed[..., kw:2 * kw].reshape(batch, t, nk, dk).astype(jnp.float32)
    v = mixed[..., 2 * kw:].reshape(batch, t, nv, dv).astype(jnp.float32)
    # Each key head serves nv // nk consecutive value heads.
    q = jnp.repeat(_l2norm(q) * jnp.float32(dk ** -0.5), nv // nk, axis=2)
    k = jnp.repeat(_l2norm(k), nv // nk, axis=2)
    real = jnp.arange(t)[None, :] < q_lengths[:, None]  # [batch, t]
    beta = jnp.where(real[..., None], jax.nn.sigmoid(b).astype(jnp.float32), 0.0)
    g = -jnp.exp(p.a_log.astype(jnp.float32)) * jax.nn.softplus(
        a.astype(jnp.float32) + p.dt_bias.astype(jnp.float32))
    g = jnp.where(real[..., None], g, 0.0)
    if t == 1:
        out, ssm = delta_rule.gated_delta_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0],
                                               ssm.astype(jnp.float32))
        out = out[:, None]
    else:
        out, ssm = delta_rule.gated_delta_chunked(q, k, v, g, beta, ssm.astype(jnp.float32))
    cache = kcache.write_state(cache, index, conv_state, ssm, seq_ids=seq_ids,
                               rows=q_lengths > 0)
    out = _gated_norm(out.astype(x.dtype), z.reshape(batch, t, nv, dv), p.norm, c.rms_norm_eps)
    return layers.linear(out.reshape(batch, t, vw), p.w_out, None), cache


def _full_attention(p: AttentionParams, c: Qwen3NextConfig, x, cos, sin, cache: PagedKVCache,
                    index, rows, impl, select):
    """One gated-attention layer (full layer `index`): returns (out, cache, q)."""
    batch, t, _ = x.shape
    q = layers.linear(x, p.wq, p.bq).reshape(batch, t, c.q_heads, c.head_dim)
    gate = layers.linear(x, p.w_gate, p.b_gate)
    k = layers.linear(x, p.wk, p.bk).reshape(batch, t, c.kv_heads, c.head_dim)
    v = layers.linear(x, p.wv, p.bv).reshape(batch, t, c.kv_heads, c.head_dim)
    q = layers.apply_rope(rms_norm_1p(q, p.q_norm, c.rms_norm_eps), cos, sin)
    k = layers.apply_rope(rms_norm_1p(k, p.k_norm, c.rms_norm_eps), cos, sin)
    cache = kcache.write(cache, index, k, v, **rows)
    # A policy's page selection (Quest, PyramidKV's layer budgets) applies to decode.
    selection = select(cache, index, q[:, 0]) if select is not None and t == 1 else None
    out, _ = kcache.attend(cache, index, q, selection=selection, scale=c.head_dim ** -0.5,
                           impl=impl, **rows)
    out = out.astype(x.dtype).reshape(batch, t, -1) * jax.nn.sigmoid(gate)
    return layers.linear(out, p.wo, p.bo), cache, q


class _Dispatch(NamedTuple):
    """What DeepSeek's expert dispatch reads from a config (shared by both MoE families)."""

    num_experts_per_tok: int
    n_routed_experts: int
    moe_impl: str


def _moe(p: MoEParams, c: Qwen3NextConfig, x):
    """The sparse MoE block: softmax router, top-k experts, plus the gated shared expert."""
    b, t, h = x.shape
    xf = x.reshape(b * t, h)
    probs = jax.nn.softmax(layers.linear(xf, p.router, None).astype(jnp.float32), axis=-1)
    weights, idx = jax.lax.top_k(probs, c.num_experts_per_tok)
    if c.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdims=True)
    # transformers rounds the routing weights to the activation dtype.
    weights = weights.astype(x.dtype).astype(jnp.float32)
    dispatch = _Dispatch(c.num_experts_per_tok, c.num_experts, c.moe_impl)
    out = ds_moe.experts(dispatch, p.experts, xf, weights, idx.astype(jnp.int32))
    if p.shared is not None:
        shared = layers.swiglu(xf, p.shared.gate, p.shared.up, p.shared.down)
        out = out + jax.nn.sigmoid(layers.linear(xf, p.shared_gate, None)) * shared
    return out.reshape(b, t, h)


def _signature(c: Qwen3NextConfig, layer: int) -> tuple[str, bool]:
    return c.layer_types[layer], c.is_moe(layer)


def _period(c: Qwen3NextConfig) -> int:
    """The shortest run of layers whose kinds (mixer, MLP) repeat to give every layer."""
    n = c.num_hidden_layers
    for period in range(1, n + 1):
        if n % period == 0 and all(_signature(c, i) == _signature(c, i % period)
                                   for i in range(n)):
            return period
    return n


def _check_forward_args(config, tokens, positions, cache, q_lengths, seq_ids):
    if tokens.ndim != 2 or positions.shape != tokens.shape:
        raise ValueError(f"forward: tokens and positions must both be [batch, q_len]; got "
                         f"{tokens.shape} and {positions.shape}.")
    for name, x in (("tokens", tokens), ("positions", positions), ("q_lengths", q_lengths)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"forward: {name} must be integer, got {x.dtype}.")
    if q_lengths.shape != (tokens.shape[0],):
        raise ValueError(f"forward: q_lengths must be [batch={tokens.shape[0]}], got "
                         f"{q_lengths.shape}.")
    spec, want = cache.spec, config.recurrent
    got = spec.recurrent
    # The state's dtype is the cache's choice; its shapes are the model's.
    same_state = (got is None) == (want is None) and (
        want is None or dataclasses.replace(got, dtype=want.dtype) == want)
    if spec.attention != config.attention or spec.num_layers != config.num_layers \
            or not same_state:
        raise ValueError(
            f"forward: the cache was built for {spec.attention} x {spec.num_layers} layers "
            f"with recurrent state {got}, but the model needs {config.attention} x "
            f"{config.num_layers} full-attention layers and {want}; build it with "
            f"model.make_cache_spec(...) (qwen3_next.cache_spec).")
    if seq_ids is None and tokens.shape[0] != spec.max_seqs:
        raise ValueError(f"forward: without seq_ids the batch must cover all max_seqs="
                         f"{spec.max_seqs} slots, got batch {tokens.shape[0]}.")
    if seq_ids is not None and jnp.shape(seq_ids) != (tokens.shape[0],):
        raise ValueError(f"forward: seq_ids must be [batch={tokens.shape[0]}], got "
                         f"{jnp.shape(seq_ids)}.")


def forward(
    params: Qwen3NextParams,
    config: Qwen3NextConfig,
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
    """Runs the model on new tokens: K/V of the full layers into the pages, the linear
    layers' states continued.

    The caller has already called `kvjax.cache.reserve` for these tokens: token t of row
    b goes to cache position `lengths[seq_b] - q_lengths[b] + t`. Each row continues its
    slot's sequence (pages and recurrent state alike). Pure; jit it with `config` static
    and the cache donated.

    Args:
      params: from `init_params` / `params_from_hf`.
      config: the architecture (static).
      tokens: int32[batch, q_len]; entries t >= q_lengths[b] are padding (they change
        neither the pages' contents that count nor the recurrent state).
      positions: int32[batch, q_len] RoPE positions.
      cache: a cache from `cache_spec(config, ...)` (any page kind; donate it under jit).
      q_lengths: int32[batch] real tokens per row; a row with 0 keeps its state.
      seq_ids: int32[batch] distinct cache slots of the rows (None: all slots in order).
      impl: attention implementation (`kvjax.attention.IMPLS` or a `ShardedAttention`).
      select: optional `select(cache, layer, q) -> Selection | None` for the full layers'
        decode attention (layer = the full layer's index in the cache).
      observe: also return the post-RoPE queries of every full layer.
      logits_at: int32[batch, k] token indices (in [0, q_len)) at which to compute
        logits; None: every token (see `kvjax.models.base`).

    Returns:
      (float32 logits [batch, q_len, vocab] (or [batch, k, vocab] with `logits_at`), the
      updated cache), plus, with `observe`, the queries [full_layers, batch, q_len,
      q_heads, head_dim].
    """
    c = config
    q_lengths = jnp.asarray(q_lengths)
    _check_forward_args(c, tokens, positions, cache, q_lengths, seq_ids)
    check_logits_at(logits_at, tokens.shape)
    q_lengths = q_lengths.astype(jnp.int32)
    if seq_ids is not None:
        seq_ids = jnp.asarray(seq_ids, jnp.int32)
    rows = dict(q_lengths=q_lengths, seq_ids=seq_ids)
    dtype = jnp.dtype(c.dtype)
    cos, sin = layers.rope_cos_sin(positions, c.rope, dtype)
    x = embed_rows(params.embed, tokens).astype(dtype)
    eps = c.rms_norm_eps

    period = _period(c)
    kinds = [_signature(c, i) for i in range(period)]
    per = {  # blocks of each kind in one period
        "full": sum(t == FULL for t, _ in kinds), "linear": sum(t != FULL for t, _ in kinds),
        "moe": sum(m for _, m in kinds), "mlp": sum(not m for _, m in kinds)}

    def run_period(carry, rep):
        """Layers rep * period .. (rep + 1) * period - 1; `rep` may be traced."""
        x, cache = carry
        seen = dict.fromkeys(per, 0)
        queries = []
        for i, (mixer, is_moe) in enumerate(kinds):
            layer = rep * period + i
            h = rms_norm_1p(x, params.input_norm[layer], eps)
            if mixer == FULL:
                j = rep * per["full"] + seen["full"]
                seen["full"] += 1
                out, cache, q = _full_attention(layers.layer_params(params.full, j), c, h, cos,
                                                sin, cache, j, rows, impl, select)
                queries.append(q)
            else:
                j = rep * per["linear"] + seen["linear"]
                seen["linear"] += 1
                out, cache = _linear_attention(layers.layer_params(params.linear, j), c, h,
                                               cache, j, q_lengths, seq_ids)
            x = x + out
            h = rms_norm_1p(x, params.post_norm[layer], eps)
            kind = "moe" if is_moe else "mlp"
            j = rep * per[kind] + seen[kind]
            seen[kind] += 1
            if is_moe:
                x = x + _moe(layers.layer_params(params.moe, j), c, h)
            else:
                p = layers.layer_params(params.mlp, j)
                x = x + layers.swiglu(h, p.gate, p.up, p.down)
        return (x, cache), (jnp.stack(queries) if observe else None)

    reps = c.num_hidden_layers // period
    if reps == 1:
        (x, cache), queries = run_period((x, cache), 0)
    else:
        (x, cache), queries = jax.lax.scan(run_period, (x, cache),
                                           jnp.arange(reps, dtype=jnp.int32))
        if observe:
            queries = queries.reshape(-1, *queries.shape[2:])
    if logits_at is not None:
        x = gather_positions(x, logits_at)
    x = rms_norm_1p(x, params.final_norm, eps)
    if params.lm_head is None:
        logits = jnp.einsum("bth,vh->btv", x, params.embed.astype(dtype))
    else:
        logits = layers.linear(x, params.lm_head, None)
    logits = logits.astype(jnp.float32)
    if observe:
        return logits, cache, queries
    return logits, cache
