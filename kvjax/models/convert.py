"""MHA → GQA checkpoint conversion by mean-pooling key/value heads (GQA, arXiv 2305.13245).

The GQA paper builds a grouped-query checkpoint from a multi-head one by
averaging the key and value projection heads of each group, then uptraining
briefly (a few percent of the original steps). kvjax groups query heads
contiguously: query head i reads KV head `i // (q_heads // kv_heads)`, so the
new KV head g is the mean of the old heads `g * r .. (g + 1) * r - 1`, r =
old_kv_heads // kv_heads — exactly the query heads that will read it.
"""

import dataclasses

import jax.numpy as jnp

__all__ = ["convert_mha_to_gqa"]


def _pool(w, old_heads: int, new_heads: int, head_dim: int):
    """Mean-pools the head axis of a [..., old_heads * head_dim] tensor into new_heads groups."""
    lead = w.shape[:-1]
    x = w.astype(jnp.float32).reshape(*lead, new_heads, old_heads // new_heads, head_dim)
    return x.mean(axis=-2).reshape(*lead, new_heads * head_dim).astype(w.dtype)


def convert_mha_to_gqa(params, config, kv_heads: int):
    """Mean-pools the K/V heads of a Llama-family checkpoint into `kv_heads` groups.

    Works for any source with more KV heads than `kv_heads` (MHA, or GQA to
    fewer groups, or MQA with kv_heads=1); `kv_heads` equal to the current
    count returns the params unchanged.

    Args:
      params: `LlamaParams` of the source model.
      config: its `LlamaConfig`.
      kv_heads: KV heads of the result; must divide the source's KV heads.

    Returns:
      (params, config) of the grouped model (q/o/MLP weights shared with the source).

    Raises:
      TypeError: not a Llama-family config. ValueError: kv_heads does not divide the
        source's KV heads.
    """
    from kvjax.models.llama import LlamaConfig

    if not isinstance(config, LlamaConfig):
        raise TypeError(f"convert_mha_to_gqa takes a LlamaConfig, got {type(config).__name__}.")
    old = config.kv_heads
    if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads < 1 \
            or old % kv_heads:
        raise ValueError(f"convert_mha_to_gqa: kv_heads must be a positive divisor of the "
                         f"source's {old} KV heads, got {kv_heads!r}.")
    new_config = dataclasses.replace(config, kv_heads=kv_heads)
    if kv_heads == old:
        return params, new_config
    lp = params.layers
    d = config.head_dim
    changes = dict(wk=_pool(lp.wk, old, kv_heads, d), wv=_pool(lp.wv, old, kv_heads, d))
    if lp.bk is not None:
        changes.update(bk=_pool(lp.bk, old, kv_heads, d), bv=_pool(lp.bv, old, kv_heads, d))
    return dataclasses.replace(params, layers=dataclasses.replace(lp, **changes)), new_config
