"""DeepSeek-V3.2 params: DeepSeek's, with the lightning indexer's in every layer.

`DeepseekV32LayerParams` is `DeepseekLayerParams` (MLA, dense MLP or MoE, stacked on a
leading `layers` axis per group) plus `indexer`, the indexer's projections stacked the
same way; the model-level pytree is `DeepseekParams` with groups of that type.
Projections are stored [in, out]. HF checkpoints map as

    self_attn.indexer.wq_b          -> indexer.q_b          [q_lora, heads * dim]
    self_attn.indexer.wk            -> indexer.k_proj       [hidden, dim]
    self_attn.indexer.k_norm        -> indexer.k_norm, k_norm_bias (LayerNorm)
    self_attn.indexer.weights_proj  -> indexer.weights_proj [hidden, heads], float32
                                       (transformers keeps it in float32)
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from kvjax.models import deepseek
from kvjax.models.deepseek.checkpoint import read_tensor
from kvjax.models.deepseek.params import (
    DeepseekLayerParams,
    DeepseekParams,
    init_from_shapes,
)
from kvjax.models.deepseek.params import param_shapes as ds_param_shapes
from kvjax.models.deepseek_v32.config import DeepseekV32Config

__all__ = ["IndexerParams", "DeepseekV32LayerParams", "param_shapes", "init_params",
           "params_from_hf"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class IndexerParams:
    """The lightning indexer of a group of layers (leading `layers` axis)."""

    q_b: Float[Array, "layers q_lora index_width"]
    k_proj: Float[Array, "layers hidden index_dim"]
    k_norm: Float[Array, "layers index_dim"]
    k_norm_bias: Float[Array, "layers index_dim"]
    weights_proj: Float[Array, "layers hidden index_heads"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeepseekV32LayerParams(DeepseekLayerParams):
    """`DeepseekLayerParams` plus the layers' lightning indexer."""

    indexer: IndexerParams | None = None


def _with_indexer(group: DeepseekLayerParams | None, indexer) -> DeepseekV32LayerParams | None:
    if group is None:
        return None
    fields = {f.name: getattr(group, f.name) for f in dataclasses.fields(group)}
    return DeepseekV32LayerParams(**fields, indexer=indexer)


def _indexer_shapes(config: DeepseekV32Config, n: int) -> IndexerParams:
    c = config
    dt, f32 = c.dtype, np.dtype("float32")
    h, d, heads = c.hidden_size, c.index_head_dim, c.index_n_heads

    def s(shape, dtype=dt):
        return jax.ShapeDtypeStruct(shape, dtype)

    return IndexerParams(q_b=s((n, c.q_lora_rank, heads * d)), k_proj=s((n, h, d)),
                         k_norm=s((n, d)), k_norm_bias=s((n, d)),
                         weights_proj=s((n, h, heads), f32))


def param_shapes(config: DeepseekV32Config) -> DeepseekParams:
    """The params pytree with `jax.ShapeDtypeStruct` leaves (DeepSeek's plus the indexers)."""
    base = ds_param_shapes(config)
    return dataclasses.replace(
        base,
        dense_layers=_with_indexer(base.dense_layers,
                                   _indexer_shapes(config, config.num_dense_layers)),
        moe_layers=_with_indexer(base.moe_layers, _indexer_shapes(config,
                                                                   config.num_moe_layers)))


def init_params(config: DeepseekV32Config, key: jax.Array, *, std: float = 0.02
                ) -> DeepseekParams:
    """Random parameters: normal(0, std) matrices, norm weights 1, biases 0 (as DeepSeek's
    `init_params`, drawn per key in the order of the sorted path names)."""
    return init_from_shapes(param_shapes(config), key, std=std)


def params_from_hf(
    config: DeepseekV32Config, get_tensor: Callable[[str], np.ndarray]
) -> DeepseekParams:
    """Maps HuggingFace DeepSeek-V3.2 tensors to kvjax params, one tensor at a time.

    DeepSeek-V3's tensors are read by `kvjax.models.deepseek.params_from_hf` (per-expert
    or fused experts, block-FP8 dequantization); the indexers' are stacked here, one
    layer group at a time.

    Raises:
      KeyError: naming a tensor the checkpoint lacks.
      ValueError: naming a tensor whose shape does not match the config.
    """
    base = deepseek.params_from_hf(config, get_tensor)
    c = config
    h, d, heads = c.hidden_size, c.index_head_dim, c.index_n_heads

    def group(first: int, n: int) -> IndexerParams:
        shapes = _indexer_shapes(c, n)
        buf = jax.tree.map(lambda s: np.empty(s.shape, s.dtype), shapes)
        for i in range(n):
            p = f"model.layers.{first + i}.self_attn.indexer."

            def fetch(name, shape, p=p):
                return read_tensor(get_tensor, p + name, shape, c.fp8_block_size)

            buf.q_b[i] = fetch("wq_b.weight", (heads * d, c.q_lora_rank)).T
            buf.k_proj[i] = fetch("wk.weight", (d, h)).T
            buf.k_norm[i] = fetch("k_norm.weight", (d,))
            buf.k_norm_bias[i] = fetch("k_norm.bias", (d,))
            buf.weights_proj[i] = fetch("weights_proj.weight", (heads, h)).T
        return jax.tree.map(jnp.asarray, buf)

    nd = c.num_dense_layers
    return dataclasses.replace(
        base,
        dense_layers=_with_indexer(base.dense_layers, group(0, nd) if nd else None),
        moe_layers=_with_indexer(base.moe_layers,
                                 group(nd, c.num_moe_layers) if c.num_moe_layers else None))
