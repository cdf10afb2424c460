"""tunix's published Flax NNX models on kvjax's cache: Gemma 3 (text).

    from tunix.models.gemma3 import model as gemma3
    from kvjax.nnx import tunix as kvtunix

    model = gemma3.Gemma3(config, rngs=nnx.Rngs(0))  # or loaded from a checkpoint
    kvtunix.adapt_gemma3(model)                      # its attention layers -> paged
    model_, params = kvtunix.as_model(model)
    result = kvjax.generate.generate(model_, params, prompts, key=..., max_new_tokens=32)

`adapt_gemma3` swaps each of the model's `Attention` modules (the dense-cache
attention of `tunix.models.gemma3.model`, tunix 0.1.7) for `Gemma3Attention`, which
keeps the original's projection and QK-norm modules (the weights are shared, not
copied) and computes what the original computes — QK RMSNorm, RoPE with the layer's
base frequency and linear scale factor, the query pre-attention scale, the sliding
window of local layers — with the cache write and attention of `kvjax.nnx.attention`.
The module is called as tunix's is, `(x, segment_pos, cache, attn_mask) -> (cache,
out)`; its dense `cache` and `attn_mask` are not used (the paged cache gives causality,
the window and the decoding state) and it returns no dense cache.

This module reads the tunix modules' attributes and does not import tunix. Local
layers keep every page of the context and mask by their window (the paged cache of
an NNX model has one layer group).
"""

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from kvjax.models.base import Model
from kvjax.nnx import PagedCache, PagedLayer, adapt, attention
from kvjax.nnx import as_model as nnx_as_model
from kvjax.rope import RopeConfig, apply_rope, rope_cos_sin

__all__ = ["Gemma3Attention", "adapt_gemma3", "as_model", "call_gemma3", "is_gemma3_attention"]

# The attributes of tunix's gemma3 `Attention` the adapter reads.
_GEMMA3_ATTRS = ("attn_vec_einsum", "_query_norm", "_key_norm", "attn_type",
                 "sliding_window_size", "rope_base_frequency", "rope_scale_factor",
                 "query_pre_attn_scalar")


def is_gemma3_attention(module: Any) -> bool:
    """Whether `module` is a tunix Gemma 3 `Attention` (by its module and attributes)."""
    return (type(module).__name__ == "Attention"
            and type(module).__module__.startswith("tunix.models.gemma3")
            and all(hasattr(module, a) for a in _GEMMA3_ATTRS))


class Gemma3Attention(PagedLayer):
    """A tunix Gemma 3 attention layer on kvjax's cache, with the original's weights.

    Args:
      original: the tunix `Attention` module (its `q_einsum` / `kv_einsum` or
        `qkv_einsum`, `attn_vec_einsum`, `_query_norm`, `_key_norm` are kept).
      cache: the model's `PagedCache`; layer: this layer's index in the cache.
    """

    def __init__(self, original: nnx.Module, cache: PagedCache, layer: int):
        if not is_gemma3_attention(original):
            raise TypeError(f"Gemma3Attention adapts tunix.models.gemma3.model.Attention, got "
                            f"{type(original).__module__}.{type(original).__name__}.")
        self.cache, self.layer = cache, layer
        self.num_heads = int(original.num_heads)
        self.num_kv_heads = int(original.num_kv_heads)
        self.head_dim = int(original.head_dim)
        if original.use_qkv_einsum:
            self.qkv_einsum = original.qkv_einsum
        else:
            self.q_einsum, self.kv_einsum = original.q_einsum, original.kv_einsum
        self.attn_vec_einsum = original.attn_vec_einsum
        self.query_norm, self.key_norm = original._query_norm, original._key_norm
        self.scale = float(original.query_pre_attn_scalar)
        local = original.attn_type.name == "LOCAL_SLIDING"
        self.sliding_window = int(original.sliding_window_size) if local else None
        factor = float(original.rope_scale_factor)
        if factor < 1.0:
            raise ValueError(f"Gemma3Attention: rope_scale_factor must be >= 1, got {factor}.")
        self.rope = RopeConfig(theta=float(original.rope_base_frequency), dim=self.head_dim,
                               rope_type="default" if factor == 1.0 else "linear",
                               factor=factor)

    def __call__(self, x: Float[Array, "batch q_len features"],
                 segment_pos: Int[Array, "batch q_len"], cache=None, attn_mask=None
                 ) -> tuple[None, Float[Array, "batch q_len features"]]:
        del cache, attn_mask  # the paged cache holds the context, causality and window
        if hasattr(self, "qkv_einsum"):
            q, k, v = self.qkv_einsum(x)
        else:
            q = self.q_einsum(x)
            k, v = self.kv_einsum(x)
        q, k = self.query_norm(q), self.key_norm(k)
        # tunix rotates in float32 (its sin/cos) and casts back to the activations' dtype.
        cos, sin = rope_cos_sin(segment_pos, self.rope, jnp.float32)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attention(self.cache, self.layer, q, k, v, scale=self.scale,
                        sliding_window=self.sliding_window)
        return None, self.attn_vec_einsum(out)


def _build(original, cache: PagedCache, layer: int) -> Gemma3Attention:
    return Gemma3Attention(original, cache, layer)


def adapt_gemma3(model: nnx.Module, cache: PagedCache | None = None) -> PagedCache:
    """Swaps every attention layer of a tunix `Gemma3` for `Gemma3Attention`, in place.

    Returns the `PagedCache` the layers share (new unless given).

    Raises:
      ValueError: the model has no tunix Gemma 3 attention layer.
    """
    attention_types = {type(node) for _, node in nnx.iter_graph(model)
                       if is_gemma3_attention(node)}
    if not attention_types:
        raise ValueError(f"kvjax.nnx.tunix.adapt_gemma3: no tunix Gemma 3 attention layer "
                         f"in {type(model).__module__}.{type(model).__name__}.")
    return adapt(model, cache, target=tuple(attention_types), build=_build)


def call_gemma3(module: nnx.Module, tokens: Int[Array, "batch q_len"],
                positions: Int[Array, "batch q_len"]) -> Float[Array, "batch q_len vocab"]:
    """How kvjax's drivers call an adapted tunix `Gemma3`: tokens and positions, no dense
    cache or mask (`kvjax.nnx.NNXConfig.call`). Under jax's standard dtype promotion,
    which tunix's code relies on (it divides int positions by float timescales)."""
    with jax.numpy_dtype_promotion("standard"):
        logits, _ = module(tokens, positions, None, None)
    return logits


def as_model(model: nnx.Module) -> tuple[Model, nnx.State]:
    """An adapted tunix `Gemma3` as a `kvjax.models.Model` and its params
    (`kvjax.nnx.as_model` with its vocabulary and `call_gemma3`)."""
    return nnx_as_model(model, vocab_size=int(model.config.num_embed), call=call_gemma3)

