"""Qwen3-Next params: frozen dataclass pytrees, their shapes for a config, and random init.

Each kind of block is stacked on its own leading axis, in layer order: the Gated
DeltaNet mixers of the linear layers (`linear`), the gated attention of the full
layers (`full`), the dense MLPs (`mlp`) and the MoE blocks (`moe`); the two RMSNorms of
every decoder layer are stacked over all layers. Projections are stored [in, out].
The (1 + weight) RMSNorms (`input_norm`, `post_norm`, `q_norm`, `k_norm`,
`final_norm`) keep transformers' raw weights, centred on 0; the gated norm of the
DeltaNet output (`DeltaNetParams.norm`) is a plain weight, centred on 1.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from kvjax.models.deepseek.params import SwiGLUParams
from kvjax.models.qwen3_next.config import Qwen3NextConfig

__all__ = ["DeltaNetParams", "AttentionParams", "MoEParams", "Qwen3NextParams",
           "SwiGLUParams", "param_shapes", "init_params"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeltaNetParams:
    """The Gated DeltaNet mixers of the linear layers, stacked on a leading axis.

    `w_qkvz` holds transformers' `in_proj_qkvz` with its columns regrouped from per key
    head (q, k, v, z of one head group together) to flat `[q | k | v | z]`: the first
    `conv_dim` columns are the convolution's channels in its own order. `w_ba` likewise
    holds `in_proj_ba` as `[b | a]`, value heads in order.
    """

    w_qkvz: Float[Array, "layers hidden qkvz"]
    w_ba: Float[Array, "layers hidden two_value_heads"]
    conv: Float[Array, "layers conv_dim kernel"]
    dt_bias: Float[Array, "layers value_heads"]
    a_log: Float[Array, "layers value_heads"]
    norm: Float[Array, "layers value_dim"]
    w_out: Float[Array, "layers value_width hidden"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionParams:
    """The gated attention of the full layers, stacked on a leading axis.

    transformers' `q_proj` interleaves, per head, the query and the output gate; here
    they are two matrices, `wq` and `w_gate`, each in head order.
    """

    wq: Float[Array, "layers hidden q_width"]
    w_gate: Float[Array, "layers hidden q_width"]
    wk: Float[Array, "layers hidden kv_width"]
    wv: Float[Array, "layers hidden kv_width"]
    wo: Float[Array, "layers q_width hidden"]
    q_norm: Float[Array, "layers head_dim"]
    k_norm: Float[Array, "layers head_dim"]
    bq: Float[Array, "layers q_width"] | None = None
    b_gate: Float[Array, "layers q_width"] | None = None
    bk: Float[Array, "layers kv_width"] | None = None
    bv: Float[Array, "layers kv_width"] | None = None
    bo: Float[Array, "layers hidden"] | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoEParams:
    """Router, routed experts and the sigmoid-gated shared expert of the MoE layers."""

    router: Float[Array, "layers hidden experts"]
    experts: SwiGLUParams  # [layers, experts, ...]
    shared: SwiGLUParams | None = None
    shared_gate: Float[Array, "layers hidden 1"] | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Qwen3NextParams:
    """Embedding, per-layer norms, the stacked blocks, final norm and LM head ([hidden, vocab];
    None when tied). A block kind the config does not use is None."""

    embed: Float[Array, "vocab hidden"]
    input_norm: Float[Array, "layers hidden"]
    post_norm: Float[Array, "layers hidden"]
    full: AttentionParams
    final_norm: Float[Array, " hidden"]
    linear: DeltaNetParams | None = None
    mlp: SwiGLUParams | None = None
    moe: MoEParams | None = None
    lm_head: Float[Array, "hidden vocab"] | None = None


def param_shapes(config: Qwen3NextConfig) -> Qwen3NextParams:
    """The params pytree with `jax.ShapeDtypeStruct` leaves: one source of truth for init/load."""
    c = config
    h, dt = c.hidden_size, np.dtype(c.dtype)

    def s(*shape):
        return jax.ShapeDtypeStruct(shape, dt)

    def swiglu(lead, inner):
        return SwiGLUParams(gate=s(*lead, h, inner), up=s(*lead, h, inner),
                            down=s(*lead, inner, h))

    nf, qw, kw = c.num_layers, c.q_heads * c.head_dim, c.kv_heads * c.head_dim
    bias = c.attention_bias
    full = AttentionParams(
        wq=s(nf, h, qw), w_gate=s(nf, h, qw), wk=s(nf, h, kw), wv=s(nf, h, kw),
        wo=s(nf, qw, h), q_norm=s(nf, c.head_dim), k_norm=s(nf, c.head_dim),
        bq=s(nf, qw) if bias else None, b_gate=s(nf, qw) if bias else None,
        bk=s(nf, kw) if bias else None, bv=s(nf, kw) if bias else None,
        bo=s(nf, h) if bias else None)
    linear = None
    if c.num_linear_layers:
        n, nv, vw = c.num_linear_layers, c.linear_value_heads, c.linear_value_width
        linear = DeltaNetParams(
            w_qkvz=s(n, h, c.conv_dim + vw), w_ba=s(n, h, 2 * nv),
            conv=s(n, c.conv_dim, c.linear_conv_kernel), dt_bias=s(n, nv), a_log=s(n, nv),
            norm=s(n, c.linear_value_head_dim), w_out=s(n, vw, h))
    mlp = swiglu((c.num_dense_layers,), c.intermediate_size) if c.num_dense_layers else None
    moe = None
    if c.num_moe_layers:
        n, e, si = c.num_moe_layers, c.num_experts, c.shared_expert_intermediate_size
        moe = MoEParams(router=s(n, h, e), experts=swiglu((n, e), c.moe_intermediate_size),
                        shared=swiglu((n,), si) if si else None,
                        shared_gate=s(n, h, 1) if si else None)
    L = c.num_hidden_layers
    return Qwen3NextParams(
        embed=s(c.vocab_size, h), input_norm=s(L, h), post_norm=s(L, h), full=full,
        final_norm=s(h), linear=linear, mlp=mlp, moe=moe,
        lm_head=None if c.tie_word_embeddings else s(h, c.vocab_size))


def _path_names(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "name", getattr(k, "key", k))) for k in path)


def init_params(config: Qwen3NextConfig, key: jax.Array, *, std: float = 0.02
                ) -> Qwen3NextParams:
    """Random parameters for tests: normal(0, std) matrices and biases, (1 + w) norm weights
    normal(0, 0.1), the gated norm near 1, decay rates A = exp(a_log) in [1, 16), dt_bias 1.

    Draws come from a host NumPy generator seeded by `key`, in sorted path-name order.
    """
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    rng = np.random.default_rng(np.asarray(key, np.uint32).ravel())
    flat, treedef = jax.tree_util.tree_flatten_with_path(param_shapes(config))
    out = [None] * len(flat)
    for i in sorted(range(len(flat)), key=lambda i: _path_names(flat[i][0])):
        path, sds = flat[i]
        names = _path_names(path)
        name = names[-1]
        if names[0] == "linear" and name == "norm":
            x = 1.0 + 0.1 * rng.standard_normal(sds.shape)
        elif name.endswith("norm"):
            x = 0.1 * rng.standard_normal(sds.shape)
        elif name == "a_log":
            x = np.log(rng.uniform(1.0, 16.0, sds.shape))
        elif name == "dt_bias":
            x = np.ones(sds.shape)
        else:
            x = std * rng.standard_normal(sds.shape)
        out[i] = jnp.asarray(np.asarray(x, np.float32)).astype(sds.dtype)
    return jax.tree.unflatten(treedef, out)
