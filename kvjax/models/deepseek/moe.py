"""DeepSeekMoE: routing and expert dispatch, and the SwiGLU block the experts share.

Layers `< first_k_dense_replace` have a dense SwiGLU MLP, later ones MoE: routed
experts plus `n_shared_experts` shared experts (one SwiGLU of width
`moe_intermediate_size * n_shared_experts`). The router runs in float32.
V2: softmax scores, `greedy` or `group_limited_greedy` (group score = max).
V3: sigmoid scores, `noaux_tc` (choice score = score + e_score_correction_bias,
group score = sum of the group's top two, weights from the unbiased scores).
Weights are divided by their sum when `norm_topk_prob`, then multiplied by
`routed_scaling_factor`. (transformers' V2 ignores `norm_topk_prob`; DeepSeek's
own V2 code honours it; every published V2 config has it False.)

Dispatch (`DeepseekConfig.moe_impl`):

* "dense": every expert on every token, combined by the (mostly zero) gate
  weights: E / top_k times the useful FLOPs; weights are read once.
* "gather": each (token, choice) gathers its expert's three matrices and does a
  matrix-vector product: reads only the chosen experts, but materialises
  tokens * top_k * 3 * hidden * moe_intermediate weights; right for decode.
* "ragged": sort (token, choice) pairs by expert and run `lax.ragged_dot`
  (a grouped GEMM on TPU/GPU; on CPU XLA lowers it to a masked product over all
  experts, no cheaper than "dense").
* "auto": "gather" when 2 * tokens * top_k <= number of experts (small-batch
  decode), else "ragged" on TPU/GPU and "dense" on CPU.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from kvjax.models import layers
from kvjax.models.deepseek.config import DeepseekConfig
from kvjax.models.deepseek.params import MoEParams, SwiGLUParams

__all__ = ["moe", "route", "swiglu", "experts"]


def swiglu(x: Float[Array, "*batch hidden"], p: SwiGLUParams) -> Float[Array, "*batch hidden"]:
    """down(silu(x @ gate) * (x @ up)) for one layer's (unstacked) `SwiGLUParams`."""
    return layers.swiglu(x, p.gate, p.up, p.down)


def route(config: DeepseekConfig, logits: Float[Array, "tokens experts"], bias):
    """Top-k experts and their combine weights, float32 [tokens, k] and int32 [tokens, k]."""
    c = config
    n, e = logits.shape
    k = c.num_experts_per_tok
    if c.scoring_func == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
        choice = scores
        if c.topk_method == "group_limited_greedy":
            group_scores = scores.reshape(n, c.n_group, e // c.n_group).max(axis=-1)
            choice = jnp.where(_group_mask(group_scores, c), scores, 0.0)
        weights, idx = jax.lax.top_k(choice, k)
    else:  # sigmoid + noaux_tc
        scores = jax.nn.sigmoid(logits)
        choice = scores + bias
        top2 = jax.lax.top_k(choice.reshape(n, c.n_group, e // c.n_group), 2)[0]
        choice = jnp.where(_group_mask(top2.sum(-1), c), choice, -jnp.inf)
        idx = jax.lax.top_k(choice, k)[1]
        weights = jnp.take_along_axis(scores, idx, axis=-1)
    if c.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + jnp.float32(1e-20))
    return weights * jnp.float32(c.routed_scaling_factor), idx.astype(jnp.int32)


def _group_mask(group_scores, c: DeepseekConfig):
    """bool[tokens, experts]: experts whose group is among the topk_group best groups."""
    n = group_scores.shape[0]
    top = jax.lax.top_k(group_scores, c.topk_group)[1]
    gmask = jnp.zeros((n, c.n_group), bool).at[jnp.arange(n)[:, None], top].set(True)
    return jnp.repeat(gmask, c.n_routed_experts // c.n_group, axis=1)


def _moe_impl(config: DeepseekConfig, num_tokens: int) -> str:
    if config.moe_impl != "auto":
        return config.moe_impl
    # "gather" reads (and copies) one expert per (token, choice); "dense" reads every expert
    # once. Gathering pays off while it touches at most half of the experts.
    if 2 * num_tokens * config.num_experts_per_tok <= config.n_routed_experts:
        return "gather"
    return "dense" if jax.default_backend() == "cpu" else "ragged"


def experts(config, ex: SwiGLUParams, x, weights, idx):
    """Routed-expert output for tokens x [N, hidden] with top-k (weights, idx).

    `config` is anything with `num_experts_per_tok`, `n_routed_experts` and `moe_impl`
    (a `DeepseekConfig`, or another family's stand-in: Qwen3-Next shares this dispatch).
    """
    n, h = x.shape
    k, e = config.num_experts_per_tok, config.n_routed_experts
    impl = _moe_impl(config, n)
    if impl == "dense":
        dense_w = jnp.zeros((n, e), jnp.float32).at[jnp.arange(n)[:, None], idx].add(weights)
        g = jnp.einsum("nh,ehi->nei", x, ex.gate)
        u = jnp.einsum("nh,ehi->nei", x, ex.up)
        y = jnp.einsum("nei,eih->neh", layers.silu(g) * u, ex.down)
        return jnp.einsum("neh,ne->nh", y.astype(jnp.float32), dense_w).astype(x.dtype)
    if impl == "gather":
        flat = idx.reshape(-1)  # [N*k]
        xs = jnp.repeat(x, k, axis=0)
        g = jnp.einsum("mh,mhi->mi", xs, ex.gate[flat])
        u = jnp.einsum("mh,mhi->mi", xs, ex.up[flat])
        y = jnp.einsum("mi,mih->mh", layers.silu(g) * u, ex.down[flat])
        y = y.astype(jnp.float32).reshape(n, k, h) * weights[..., None]
        return y.sum(1).astype(x.dtype)
    # ragged: sort (token, choice) pairs by expert; one grouped GEMM per projection.
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // k
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    xs = x[token]
    g = jax.lax.ragged_dot(xs, ex.gate, sizes)
    u = jax.lax.ragged_dot(xs, ex.up, sizes)
    y = jax.lax.ragged_dot(layers.silu(g) * u, ex.down, sizes)
    y = y.astype(jnp.float32) * weights.reshape(-1)[order][:, None]
    return jnp.zeros((n, h), jnp.float32).at[token].add(y).astype(x.dtype)


def moe(p: MoEParams, config: DeepseekConfig, x: Float[Array, "batch q_len hidden"]
        ) -> Float[Array, "batch q_len hidden"]:
    """One layer's MoE block (unstacked `p`): routed experts plus the shared ones."""
    b, t, h = x.shape
    xf = x.reshape(b * t, h)
    logits = layers.linear(xf.astype(jnp.float32), p.router.T, None)
    weights, idx = route(config, logits, p.bias)
    out = experts(config, p.experts, xf, weights, idx)
    if p.shared is not None:
        out = out + swiglu(xf, p.shared)
    return out.reshape(b, t, h)
