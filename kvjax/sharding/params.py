"""Tensor-parallel shardings for model params over the `model` axis (Megatron layout).

Rules by parameter name, shared by the Llama and DeepSeek families (projections
are stored `[..., in, out]`):

  * column-parallel (output axis over `model`): query/key/value projections,
    MLP gate and up (dense, shared and routed experts), their biases, and the
    LM head (vocabulary);
  * row-parallel (input axis over `model`): the attention output projection
    and the MLP down projection, so each device's partial sums meet in one
    all-reduce per block;
  * MLA's per-head absorption matrices `w_uk`/`w_uv` over their head axis;
  * the embedding over its vocabulary rows;
  * everything else (norms, routers, low-rank down-projections shared by all
    heads: `kv_a_proj`, `q_a_proj`) is replicated.

A tensor whose axis the `model` size does not divide is replicated, as are the
key/value projections when `model` does not divide kv_heads (their columns
would split a head, forcing a reshard before the cache write). With no `model`
axis every param is replicated.
"""

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.sharding.mesh import ShardingPlan

__all__ = ["param_shardings", "shard_params"]

_COLUMN = {"wq", "wk", "wv", "bq", "bk", "bv", "w_gate", "w_up", "b_gate", "b_up", "q_proj",
           "q_b_proj", "gate", "up", "lm_head"}
_ROW = {"wo", "w_down", "o_proj", "down"}
_HEADS = {"w_uk", "w_uv"}
_KV = {"wk", "wv", "bk", "bv"}
_BIAS = {"bq", "bk", "bv", "b_gate", "b_up"}


def _name(path) -> str:
    last = path[-1]
    return str(getattr(last, "name", getattr(last, "key", last)))


def _spec(name: str, shape: tuple[int, ...], m: int, kv_heads: int | None) -> P:
    if m == 1 or not shape:
        return P()
    axis = None
    if name in _COLUMN or name in _BIAS:
        axis = len(shape) - 1
    elif name in _ROW:
        axis = len(shape) - 2
    elif name in _HEADS:
        axis = 1
    elif name == "embed":
        axis = 0
    if axis is None or axis < 0 or shape[axis] % m:
        return P()
    if name in _KV and (kv_heads is None or kv_heads % m):
        return P()
    spec = [None] * len(shape)
    spec[axis] = "model"
    return P(*spec)


def param_shardings(plan: ShardingPlan, params, *, kv_heads: int | None = None):
    """A pytree like `params` of `NamedSharding`s (tensor parallel over `model`).

    Args:
      plan: the mesh (its `model` axis, if any, is used whatever the cache strategies).
      params: a params pytree, or its `jax.eval_shape`.
      kv_heads: the model's KV heads, to decide whether K/V projections split
        (None: keep them replicated).
    """
    m = plan.axis_size("model")
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(plan.mesh, _spec(_name(path), tuple(x.shape), m, kv_heads)),
        params,
    )


def shard_params(params, plan: ShardingPlan, *, kv_heads: int | None = None):
    """`params` placed on the mesh with `param_shardings`."""
    return jax.device_put(params, param_shardings(plan, params, kv_heads=kv_heads))
