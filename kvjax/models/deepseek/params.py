"""DeepSeek params: frozen dataclass pytrees, their shapes for a config, and random init.

Layers are split in two stacked groups, `dense_layers` (the first
`num_dense_layers`, with a dense SwiGLU MLP) and `moe_layers` (with the MoE
block); each group's tensors carry a leading `layers` axis so the group runs as
one `lax.scan`. Projections are stored [in, out]. Tensors a config does not use
are None: `q_proj` or the low-rank `q_a_proj`/`q_a_norm`/`q_b_proj`, `mlp` or
`moe`, the router `bias` (only `noaux_tc`), the `shared` experts, `lm_head`
(tied embeddings), and a layer group with no layers.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from kvjax.models.deepseek.config import DeepseekConfig

__all__ = ["SwiGLUParams", "MoEParams", "DeepseekLayerParams", "DeepseekParams", "init_params",
           "param_shapes", "init_from_shapes"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SwiGLUParams:
    """down(silu(x @ gate) * (x @ up)); leading axes (layers, experts) come first."""

    gate: Float[Array, "*lead hidden inter"]
    up: Float[Array, "*lead hidden inter"]
    down: Float[Array, "*lead inter hidden"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoEParams:
    """Router (float32), routed experts, optional correction bias and shared experts."""

    router: Float[Array, "layers experts hidden"]
    experts: SwiGLUParams  # [layers, experts, ...]
    bias: Float[Array, "layers experts"] | None = None  # noaux_tc's e_score_correction_bias
    shared: SwiGLUParams | None = None  # one SwiGLU of width moe_intermediate * n_shared


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeepseekLayerParams:
    """One group of decoder layers, stacked on a leading `layers` axis.

    `w_uk` [heads, d_nope, d_c] and `w_uv` [heads, d_c, d_v] are the two halves of
    HF's `kv_b_proj`, split per head for the absorbed attention. A slice without
    the leading axis (one layer, as inside the scan) has the same type.
    """

    input_norm: Float[Array, "layers hidden"]
    post_norm: Float[Array, "layers hidden"]
    kv_a_proj: Float[Array, "layers hidden d_c_plus_rope"]
    kv_a_norm: Float[Array, "layers d_c"]
    w_uk: Float[Array, "layers q_heads d_nope d_c"]
    w_uv: Float[Array, "layers q_heads d_c d_v"]
    o_proj: Float[Array, "layers o_width hidden"]
    q_proj: Float[Array, "layers hidden q_width"] | None = None
    q_a_proj: Float[Array, "layers hidden q_lora"] | None = None
    q_a_norm: Float[Array, "layers q_lora"] | None = None
    q_b_proj: Float[Array, "layers q_lora q_width"] | None = None
    mlp: SwiGLUParams | None = None
    moe: MoEParams | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeepseekParams:
    """Embedding, the dense and MoE layer groups, final norm, LM head [hidden, vocab]."""

    embed: Float[Array, "vocab hidden"]
    final_norm: Float[Array, " hidden"]
    dense_layers: DeepseekLayerParams | None = None
    moe_layers: DeepseekLayerParams | None = None
    lm_head: Float[Array, "hidden vocab"] | None = None


def param_shapes(config: DeepseekConfig) -> DeepseekParams:
    """The params pytree with `jax.ShapeDtypeStruct` leaves: one source of truth for init/load."""
    c = config
    h, nh, dc, dr = c.hidden_size, c.num_heads, c.kv_lora_rank, c.qk_rope_head_dim
    dt, f32 = c.dtype, np.dtype("float32")

    def s(shape, dtype=dt):
        return jax.ShapeDtypeStruct(shape, dtype)

    def swiglu(lead, inner):
        return SwiGLUParams(gate=s((*lead, h, inner)), up=s((*lead, h, inner)),
                            down=s((*lead, inner, h)))

    def group(n, **mlp):
        q = (dict(q_proj=s((n, h, nh * c.qk_head_dim))) if c.q_lora_rank is None else dict(
            q_a_proj=s((n, h, c.q_lora_rank)), q_a_norm=s((n, c.q_lora_rank)),
            q_b_proj=s((n, c.q_lora_rank, nh * c.qk_head_dim))))
        return DeepseekLayerParams(
            input_norm=s((n, h)), post_norm=s((n, h)), kv_a_proj=s((n, h, dc + dr)),
            kv_a_norm=s((n, dc)), w_uk=s((n, nh, c.qk_nope_head_dim, dc)),
            w_uv=s((n, nh, dc, c.v_head_dim)), o_proj=s((n, nh * c.v_head_dim, h)), **q, **mlp)

    dense = moe = None
    if c.num_dense_layers:
        n = c.num_dense_layers
        dense = group(n, mlp=swiglu((n,), c.intermediate_size))
    if c.num_moe_layers:
        n, e, im = c.num_moe_layers, c.n_routed_experts, c.moe_intermediate_size
        moe = group(n, moe=MoEParams(
            router=s((n, e, h), f32), experts=swiglu((n, e), im),
            bias=s((n, e), f32) if c.topk_method == "noaux_tc" else None,
            shared=swiglu((n,), im * c.n_shared_experts) if c.n_shared_experts else None))
    return DeepseekParams(
        embed=s((c.vocab_size, h)), final_norm=s((h,)), dense_layers=dense, moe_layers=moe,
        lm_head=None if c.tie_word_embeddings else s((h, c.vocab_size)))


def _path_names(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "name", getattr(k, "key", k))) for k in path)


def init_params(config: DeepseekConfig, key: jax.Array, *, std: float = 0.02) -> DeepseekParams:
    """Random parameters: normal(0, std) matrices, norm weights 1, zero router bias.

    The draws come from a host NumPy generator seeded by `key`: deterministic per
    key, and far cheaper than compiling threefry for every tensor shape. Tensors
    are drawn in the order of their sorted path names, so a key gives the same
    weights whatever the pytree's field order.
    """
    return init_from_shapes(param_shapes(config), key, std=std)


def init_from_shapes(shapes, key: jax.Array, *, std: float = 0.02):
    """`init_params` of any params pytree given by its `jax.ShapeDtypeStruct` leaves: a
    leaf named `*bias` starts at 0, one whose name holds "norm" at 1, others normal(0, std)."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    rng = np.random.default_rng(np.asarray(key, np.uint32).ravel())
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    out = [None] * len(flat)
    for i in sorted(range(len(flat)), key=lambda i: _path_names(flat[i][0])):
        path, sds = flat[i]
        name = _path_names(path)[-1]
        if name.endswith("bias"):
            x = np.zeros(sds.shape, np.float32)
        elif "norm" in name:
            x = np.ones(sds.shape, np.float32)
        else:
            x = (std * rng.standard_normal(sds.shape)).astype(np.float32)
        out[i] = jnp.asarray(x).astype(sds.dtype)
    return jax.tree.unflatten(treedef, out)
