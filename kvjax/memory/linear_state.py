"""Bytes of hybrid models: a fixed-size linear-attention state beside a growing KV cache.

A hybrid model such as Qwen3-Next interleaves two kinds of layers: full
(softmax) attention layers, each with an ordinary paged KV cache that grows by
one token per step, and Gated DeltaNet linear-attention layers (arXiv
2412.06464), each holding a state per sequence whose size does not depend on
the context. One Gated DeltaNet layer keeps, per sequence:

* the short causal convolution's state: the last `conv_kernel - 1` inputs of
  the depthwise convolution over q, k and v, `conv_dim x (conv_kernel - 1)`
  with `conv_dim = 2 * num_key_heads * key_head_dim + num_value_heads *
  value_head_dim`. `conv_kernel - 1` columns is what the convolution needs
  (and what vLLM's Mamba-style state allocates); transformers' cache keeps
  `conv_kernel` columns, one more than needed.
* the delta rule's recurrent state, one `key_head_dim x value_head_dim` matrix
  per value head: `num_value_heads x key_head_dim x value_head_dim`.

Dtypes, as transformers 5.x's `Qwen3NextGatedDeltaNet` keeps them: the conv
state is in the activations' dtype (the model's, bf16), and the recurrent state
in float32 (its gated delta rule, torch fallback and FLA kernel alike, casts
q, k, v to float32 and returns the final state in float32, which the cache
stores as given). Both are parameters here, defaulting to those.

Pure Python: no JAX import. Byte counts are exact `Fraction`s.
"""

import dataclasses
from fractions import Fraction
from typing import TYPE_CHECKING

from kvjax.memory import accounting as acc

if TYPE_CHECKING:
    from kvjax.memory.presets import ModelPreset

__all__ = [
    "CONV_STATE_DTYPE",
    "RECURRENT_STATE_DTYPE",
    "GatedDeltaNetSpec",
    "HybridCacheBytes",
    "conv_state_bytes",
    "hybrid_cache_bytes",
    "linear_state_bytes",
    "recurrent_state_bytes",
]

CONV_STATE_DTYPE = "bf16"
"""Default conv state dtype: the activations' (bf16), as transformers' cache stores it."""

RECURRENT_STATE_DTYPE = "fp32"
"""Default recurrent state dtype: float32, as transformers' gated delta rule returns it."""


def _check_int(owner: str, name: str, value: object, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}.{name} must be an int >= {minimum}, got {value!r}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GatedDeltaNetSpec:
    """Geometry of one Gated DeltaNet layer's per-sequence state.

    Field names follow transformers' `Qwen3NextConfig` without its `linear_`
    prefix (`linear_num_key_heads` -> `num_key_heads`, `linear_conv_kernel_dim`
    -> `conv_kernel`).

    Args:
      num_key_heads: query/key heads (`linear_num_key_heads`).
      num_value_heads: value heads (`linear_num_value_heads`); a multiple of
        `num_key_heads`, each key head serving a group of value heads.
      key_head_dim: width of one key head (`linear_key_head_dim`).
      value_head_dim: width of one value head (`linear_value_head_dim`).
      conv_kernel: taps of the causal depthwise convolution
        (`linear_conv_kernel_dim`).
    """

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    def __post_init__(self):
        for name in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim",
                     "conv_kernel"):
            _check_int("GatedDeltaNetSpec", name, getattr(self, name))
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(
                f"GatedDeltaNetSpec: num_key_heads={self.num_key_heads} must divide "
                f"num_value_heads={self.num_value_heads} (each key head serves a group of "
                f"value heads)."
            )

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q and k (`num_key_heads * key_head_dim` each) and v."""
        key_dim = self.num_key_heads * self.key_head_dim
        return 2 * key_dim + self.num_value_heads * self.value_head_dim

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        """(conv_dim, conv_kernel - 1): the inputs the next step's convolution still needs."""
        return (self.conv_dim, self.conv_kernel - 1)

    @property
    def recurrent_state_shape(self) -> tuple[int, int, int]:
        """(num_value_heads, key_head_dim, value_head_dim): one matrix per value head."""
        return (self.num_value_heads, self.key_head_dim, self.value_head_dim)

    @property
    def conv_state_elements(self) -> int:
        rows, cols = self.conv_state_shape
        return rows * cols

    @property
    def recurrent_state_elements(self) -> int:
        heads, dk, dv = self.recurrent_state_shape
        return heads * dk * dv


def conv_state_bytes(spec: GatedDeltaNetSpec, dtype: acc.KVFormat | str = CONV_STATE_DTYPE
                     ) -> Fraction:
    """Bytes of one layer's conv state for one sequence: `conv_dim * (conv_kernel - 1)` elements."""
    return spec.conv_state_elements * acc.as_kv_format(dtype).bits_per_element / 8


def recurrent_state_bytes(
    spec: GatedDeltaNetSpec, dtype: acc.KVFormat | str = RECURRENT_STATE_DTYPE
) -> Fraction:
    """Bytes of one layer's recurrent state for one sequence: `heads * d_k * d_v` elements."""
    return spec.recurrent_state_elements * acc.as_kv_format(dtype).bits_per_element / 8


def linear_state_bytes(
    spec: GatedDeltaNetSpec,
    num_layers: int,
    *,
    conv_dtype: acc.KVFormat | str = CONV_STATE_DTYPE,
    state_dtype: acc.KVFormat | str = RECURRENT_STATE_DTYPE,
) -> Fraction:
    """Bytes of one sequence's state over `num_layers` Gated DeltaNet layers.

    Args:
      spec: the layers' geometry.
      num_layers: Gated DeltaNet layers (not the model's total).
      conv_dtype: dtype of the conv state (default bf16, the activations').
      state_dtype: dtype of the recurrent state (default fp32, transformers').

    Returns:
      Bytes per sequence, whatever its length, as an exact `Fraction`.
    """
    acc._check_int("num_layers", num_layers, minimum=1)
    return num_layers * (conv_state_bytes(spec, conv_dtype)
                         + recurrent_state_bytes(spec, state_dtype))


@dataclasses.dataclass(frozen=True, kw_only=True)
class HybridCacheBytes:
    """Cache bytes of a hybrid model at one context, against an all-full-attention twin.

    Per-sequence fields; the `batch_*` properties multiply by `batch`.

    Args:
      context: tokens per sequence.
      batch: sequences.
      num_layers: all layers of the model.
      kv_layers: full-attention layers, each with a KV cache.
      linear_layers: Gated DeltaNet layers, each with a fixed state.
      conv_bytes_per_layer: one layer's conv state.
      recurrent_bytes_per_layer: one layer's recurrent state.
      state_bytes: conv + recurrent state over all linear layers; constant in `context`.
      kv_bytes_per_token: one token's KV over the `kv_layers` layers.
      kv_bytes: KV of `context` tokens over the `kv_layers` layers.
      dense_kv_bytes: KV of `context` tokens if all `num_layers` layers were full
        attention with the same KV heads and head_dim (and KV format).
    """

    context: int
    batch: int
    num_layers: int
    kv_layers: int
    linear_layers: int
    conv_bytes_per_layer: Fraction
    recurrent_bytes_per_layer: Fraction
    state_bytes: Fraction
    kv_bytes_per_token: Fraction
    kv_bytes: Fraction
    dense_kv_bytes: Fraction

    @property
    def total_bytes(self) -> Fraction:
        """State plus KV, per sequence."""
        return self.state_bytes + self.kv_bytes

    @property
    def batch_state_bytes(self) -> Fraction:
        return self.batch * self.state_bytes

    @property
    def batch_kv_bytes(self) -> Fraction:
        return self.batch * self.kv_bytes

    @property
    def batch_total_bytes(self) -> Fraction:
        return self.batch * self.total_bytes

    @property
    def batch_dense_kv_bytes(self) -> Fraction:
        return self.batch * self.dense_kv_bytes

    @property
    def breakeven_tokens(self) -> Fraction:
        """Context at which the full layers' KV equals the state (state / KV bytes per token)."""
        return self.state_bytes / self.kv_bytes_per_token


def hybrid_cache_bytes(
    preset: "ModelPreset",
    context: int,
    *,
    batch: int = 1,
    fmt: acc.KVFormat | str = "bf16",
    conv_dtype: acc.KVFormat | str = CONV_STATE_DTYPE,
    state_dtype: acc.KVFormat | str = RECURRENT_STATE_DTYPE,
) -> HybridCacheBytes:
    """State and KV bytes of a hybrid preset, and of the same model with only full attention.

    Args:
      preset: a hybrid `ModelPreset` (`preset.linear_attention` set).
      context: tokens per sequence.
      batch: sequences.
      fmt: KV cache format of the full-attention layers (as in `accounting`).
      conv_dtype: dtype of the conv state.
      state_dtype: dtype of the recurrent state.

    Returns:
      A `HybridCacheBytes`.

    Raises:
      ValueError: for a preset without linear-attention layers, or bad counts.
    """
    if getattr(preset, "linear_attention", None) is None:
        raise ValueError(
            f"hybrid_cache_bytes: {getattr(preset, 'name', preset)!r} has no linear-attention "
            f"layers; use accounting.bytes_per_sequence for its KV cache."
        )
    acc._check_int("context", context, minimum=0)
    acc._check_int("batch", batch, minimum=1)
    spec, gdn = preset.attention, preset.linear_attention
    return HybridCacheBytes(
        context=context,
        batch=batch,
        num_layers=preset.num_layers,
        kv_layers=preset.kv_layers,
        linear_layers=preset.linear_layers,
        conv_bytes_per_layer=conv_state_bytes(gdn, conv_dtype),
        recurrent_bytes_per_layer=recurrent_state_bytes(gdn, state_dtype),
        state_bytes=linear_state_bytes(gdn, preset.linear_layers, conv_dtype=conv_dtype,
                                       state_dtype=state_dtype),
        kv_bytes_per_token=acc.bytes_per_token(spec, preset.kv_layers, fmt),
        kv_bytes=acc.bytes_per_sequence(spec, preset.kv_layers, context, fmt),
        dense_kv_bytes=acc.bytes_per_sequence(spec, preset.num_layers, context, fmt),
    )
