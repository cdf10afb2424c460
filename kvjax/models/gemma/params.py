"""Typed params of a Gemma 2 / Gemma 3 model, their shapes, HF tensor names and random init.

Per-layer tensors are stacked on a leading `layers` axis (as the Llama family's), and
projections are stored [in, out]. Norm weights are the (1 + w) form's w, as in the
checkpoints: zero means the identity scale. Names follow the Llama family's where the
tensors play the same part, so `kvjax.sharding`'s tensor-parallel rules apply as they are.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from kvjax.models import llama
from kvjax.models.gemma.config import GemmaConfig

__all__ = ["GemmaLayerParams", "GemmaParams", "param_shapes", "init_params", "unstack_layers"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GemmaLayerParams:
    """Every layer's weights, stacked on a leading `layers` axis; projections are [in, out].

    Norms, in the order they act: `attn_norm` (input), `post_attn_norm` (on the attention
    output, before the residual add), `mlp_norm` (pre-feedforward), `post_mlp_norm`; and
    Gemma 3's per-head `q_norm` / `k_norm` (None for Gemma 2).
    """

    attn_norm: Float[Array, "layers hidden"]
    wq: Float[Array, "layers hidden q_width"]
    wk: Float[Array, "layers hidden kv_width"]
    wv: Float[Array, "layers hidden kv_width"]
    wo: Float[Array, "layers q_width hidden"]
    post_attn_norm: Float[Array, "layers hidden"]
    mlp_norm: Float[Array, "layers hidden"]
    w_gate: Float[Array, "layers hidden inter"]
    w_up: Float[Array, "layers hidden inter"]
    w_down: Float[Array, "layers inter hidden"]
    post_mlp_norm: Float[Array, "layers hidden"]
    q_norm: Float[Array, "layers head_dim"] | None = None
    k_norm: Float[Array, "layers head_dim"] | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GemmaParams:
    """Embedding [vocab, hidden], layers, final norm, and the LM head [hidden, vocab]
    (None when tied to the embedding, as in every released model).

    `layers` may also be a tuple of per-layer params without the leading axis
    (`unstack_layers`).
    """

    embed: Float[Array, "vocab hidden"]
    layers: GemmaLayerParams | tuple[GemmaLayerParams, ...]
    final_norm: Float[Array, " hidden"]
    lm_head: Float[Array, "hidden vocab"] | None = None


def param_shapes(config: GemmaConfig) -> dict:
    """name -> (shape, HF name relative to the text model, transpose) of every tensor.

    Layer entries are under "layers" with a `{}` for the layer index; the HF names are
    relative to the text model's prefix (`model.` for the causal LMs), except the LM head's
    (`lm_head.weight`, outside it).
    """
    c = config
    L, h, i = c.num_layers, c.hidden_size, c.intermediate_size
    qw, kw = c.q_heads * c.head_dim, c.kv_heads * c.head_dim
    p = "layers.{}."
    layer = {
        "attn_norm": ((L, h), p + "input_layernorm.weight", False),
        "wq": ((L, h, qw), p + "self_attn.q_proj.weight", True),
        "wk": ((L, h, kw), p + "self_attn.k_proj.weight", True),
        "wv": ((L, h, kw), p + "self_attn.v_proj.weight", True),
        "wo": ((L, qw, h), p + "self_attn.o_proj.weight", True),
        "post_attn_norm": ((L, h), p + "post_attention_layernorm.weight", False),
        "mlp_norm": ((L, h), p + "pre_feedforward_layernorm.weight", False),
        "w_gate": ((L, h, i), p + "mlp.gate_proj.weight", True),
        "w_up": ((L, h, i), p + "mlp.up_proj.weight", True),
        "w_down": ((L, i, h), p + "mlp.down_proj.weight", True),
        "post_mlp_norm": ((L, h), p + "post_feedforward_layernorm.weight", False),
    }
    if c.qk_norm:
        layer["q_norm"] = ((L, c.head_dim), p + "self_attn.q_norm.weight", False)
        layer["k_norm"] = ((L, c.head_dim), p + "self_attn.k_norm.weight", False)
    top = {
        "embed": ((c.vocab_size, h), "embed_tokens.weight", False),
        "final_norm": ((h,), "norm.weight", False),
    }
    if not c.tie_word_embeddings:
        top["lm_head"] = ((h, c.vocab_size), "lm_head.weight", True)
    return {"layers": layer, **top}


def init_params(config: GemmaConfig, key: jax.Array, *, std: float = 0.02) -> GemmaParams:
    """Random params for tests: normal(0, std) matrices, (1 + w) norm weights w normal(0, 0.1).

    Drawn on the host from a NumPy generator seeded by `key` (no compiled program per
    tensor shape), in the order of `param_shapes`.
    """
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    rng = np.random.default_rng(np.asarray(key, np.uint32).ravel())
    dtype = jnp.dtype(config.dtype)
    shapes = param_shapes(config)

    def draw(name, shape):
        x = rng.standard_normal(shape) * (0.1 if name.endswith("norm") else std)
        return jnp.asarray(x.astype(np.float32)).astype(dtype)

    layer = {n: draw(n, s) for n, (s, _, _) in shapes["layers"].items()}
    top = {n: draw(n, e[0]) for n, e in shapes.items() if n != "layers"}
    return GemmaParams(layers=GemmaLayerParams(**layer), **top)


def unstack_layers(params: GemmaParams) -> GemmaParams:
    """The same weights with `layers` as a tuple of per-layer `GemmaLayerParams`.

    `forward` runs either form; on CPU the decode loop picks this one for big models
    (`kvjax.generate.decode_params`). The Llama family's implementation, which any params
    with a stacked `layers` field share.
    """
    return llama.unstack_layers(params)
