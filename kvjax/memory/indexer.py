"""Bytes of DeepSeek Sparse Attention (DSA): the lightning indexer's key cache beside MLA's.

DeepSeek-V3.2 keeps DeepSeek-V3's MLA latent cache (`kv_lora_rank +
qk_rope_head_dim` elements per token per layer) and adds, in every layer, a
lightning indexer: `index_n_heads` small query heads score every cached token
against one shared indexer key of `index_head_dim` elements, and attention then
reads only the `index_topk` best tokens of the latent cache. So each layer
caches `index_head_dim` more elements per token (one key, shared by all indexer
heads: transformers' `DynamicIndexedLayer` stores it as
`[batch, seq_len, index_head_dim]`).

Dtype: transformers' `DeepseekV32Indexer` caches the keys in the model's dtype
(bf16); DeepSeek's own kernels keep them in fp8 with a float32 scale per block.
The dtype is a parameter here, bf16 by default.

One decode step, per sequence and layer, reads:

* dense MLA: the whole latent cache, `context` tokens;
* DSA: the whole indexer key cache (`context` keys, to score them) plus
  `min(index_topk, context)` tokens of the latent cache.

The selected tokens are priced as `accounting.bytes_per_sequence` of that many
tokens: with a KIVI tail (`KVFormat.residual`) its most recent tokens, kept in
bf16, are counted among them, as a local window usually is.

Pure Python: no JAX import. Byte counts are exact `Fraction`s.
"""

import dataclasses
from fractions import Fraction
from typing import TYPE_CHECKING

from kvjax.memory import accounting as acc

if TYPE_CHECKING:
    from kvjax.memory.presets import ModelPreset

__all__ = ["INDEXER_DTYPE", "DSACacheBytes", "IndexerSpec", "dsa_cache_bytes",
           "indexer_bytes_per_token"]

INDEXER_DTYPE = "bf16"
"""Default indexer key dtype: the model's, as transformers caches it."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class IndexerSpec:
    """The lightning indexer of DeepSeek Sparse Attention, as `DeepseekV32Config` names it.

    Args:
      n_heads: indexer query heads (`index_n_heads`); they share one cached key.
      head_dim: width of the indexer query and key (`index_head_dim`), the
        elements cached per token per layer.
      topk: tokens each query attends to (`index_topk`).
    """

    n_heads: int
    head_dim: int
    topk: int

    def __post_init__(self):
        for name in ("n_heads", "head_dim", "topk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"IndexerSpec.{name} must be a positive int, got {value!r}.")

    @property
    def elements_per_token_per_layer(self) -> int:
        """One shared key per token: `head_dim` elements."""
        return self.head_dim


def indexer_bytes_per_token(
    spec: IndexerSpec, num_layers: int, dtype: acc.KVFormat | str = INDEXER_DTYPE
) -> Fraction:
    """Bytes of one token's indexer keys across `num_layers` layers."""
    acc._check_int("num_layers", num_layers, minimum=1)
    return num_layers * spec.elements_per_token_per_layer * acc.as_kv_format(
        dtype).bits_per_element / 8


@dataclasses.dataclass(frozen=True, kw_only=True)
class DSACacheBytes:
    """Cache bytes of a DSA model at one context, and what one decode step reads.

    Per-sequence fields; the `batch_*` properties multiply by `batch`.

    Args:
      context: tokens per sequence.
      batch: sequences.
      topk: the indexer's `index_topk`.
      selected: tokens attention reads per layer, `min(topk, context)`.
      latent_bytes_per_token: one token's MLA latent cache, all layers.
      indexer_bytes_per_token: one token's indexer keys, all layers.
      latent_bytes: the MLA latent cache of `context` tokens.
      indexer_bytes: the indexer key cache of `context` tokens.
      dsa_read_bytes: one decode step with DSA: `selected` latent tokens plus
        the whole indexer key cache.
      dense_read_bytes: one decode step of dense MLA: the whole latent cache.
    """

    context: int
    batch: int
    topk: int
    selected: int
    latent_bytes_per_token: Fraction
    indexer_bytes_per_token: Fraction
    latent_bytes: Fraction
    indexer_bytes: Fraction
    dsa_read_bytes: Fraction
    dense_read_bytes: Fraction

    @property
    def total_bytes(self) -> Fraction:
        """Latent plus indexer cache, per sequence."""
        return self.latent_bytes + self.indexer_bytes

    @property
    def batch_latent_bytes(self) -> Fraction:
        return self.batch * self.latent_bytes

    @property
    def batch_indexer_bytes(self) -> Fraction:
        return self.batch * self.indexer_bytes

    @property
    def batch_total_bytes(self) -> Fraction:
        return self.batch * self.total_bytes

    @property
    def batch_dsa_read_bytes(self) -> Fraction:
        return self.batch * self.dsa_read_bytes

    @property
    def batch_dense_read_bytes(self) -> Fraction:
        return self.batch * self.dense_read_bytes


def dsa_cache_bytes(
    preset: "ModelPreset",
    context: int,
    *,
    batch: int = 1,
    fmt: acc.KVFormat | str = "bf16",
    indexer_dtype: acc.KVFormat | str = INDEXER_DTYPE,
) -> DSACacheBytes:
    """Latent and indexer cache bytes of a DSA preset, and one decode step's reads.

    Args:
      preset: a `ModelPreset` with an `indexer` (every layer is indexed).
      context: tokens per sequence.
      batch: sequences.
      fmt: format of the MLA latent cache (as in `accounting`).
      indexer_dtype: dtype of the indexer keys (default bf16).

    Returns:
      A `DSACacheBytes`.

    Raises:
      ValueError: for a preset without an indexer, or bad counts.
    """
    if getattr(preset, "indexer", None) is None:
        raise ValueError(
            f"dsa_cache_bytes: {getattr(preset, 'name', preset)!r} has no lightning indexer; "
            f"use accounting.bytes_per_sequence for its KV cache."
        )
    acc._check_int("context", context, minimum=0)
    acc._check_int("batch", batch, minimum=1)
    spec, layers, ix = preset.attention, preset.num_layers, preset.indexer
    selected = min(ix.topk, context)
    per_token = indexer_bytes_per_token(ix, layers, indexer_dtype)
    latent = acc.bytes_per_sequence(spec, layers, context, fmt)
    return DSACacheBytes(
        context=context,
        batch=batch,
        topk=ix.topk,
        selected=selected,
        latent_bytes_per_token=acc.bytes_per_token(spec, layers, fmt),
        indexer_bytes_per_token=per_token,
        latent_bytes=latent,
        indexer_bytes=context * per_token,
        dsa_read_bytes=acc.bytes_per_sequence(spec, layers, selected, fmt) + context * per_token,
        dense_read_bytes=latent,
    )
