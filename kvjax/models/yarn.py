"""Rotary frequencies for DeepSeek models: plain RoPE and YaRN scaling (arXiv 2309.00071).

DeepSeek-V2/V3 checkpoints extend their context with YaRN. Three numbers come out
of a YaRN setting, and all three must match transformers for logits to agree:

* the inverse frequencies: a per-dimension blend of the original frequencies
  (fast dimensions, extrapolated) and the frequencies divided by `factor` (slow
  dimensions, interpolated), with a linear ramp between the `beta_fast` and
  `beta_slow` correction dimensions;
* `attention_factor`: multiplies cos and sin, so it scales both the rotary query
  and the rotary key;
* `softmax_scale_multiplier`: DeepSeek multiplies the softmax scale
  1/sqrt(qk_head_dim) by mscale(factor, mscale_all_dim)**2.

Everything here is host-side NumPy computed once per config (float32, the way
transformers computes it) and baked into the jitted program as constants.
"""

import dataclasses
import math

import numpy as np

__all__ = [
    "YarnScaling",
    "yarn_mscale",
    "rope_inv_freq",
    "attention_factor",
    "softmax_scale_multiplier",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class YarnScaling:
    """A YaRN rope-scaling setting, as in a DeepSeek `config.json`'s rope parameters.

    Args:
      factor: context-extension factor (> 0).
      original_max_position_embeddings: the pre-extension context length.
      beta_fast, beta_slow: rotation counts bounding the interpolation ramp.
      mscale, mscale_all_dim: DeepSeek's magnitude-scaling coefficients (0 = unset).
      attention_factor: explicit cos/sin multiplier; None derives it from the mscales.
      truncate: round the correction range outwards to whole dimensions.
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self):
        if not (isinstance(self.factor, int | float) and self.factor > 0):
            raise ValueError(f"YarnScaling.factor must be a positive number, got {self.factor!r}.")
        opm = self.original_max_position_embeddings
        if isinstance(opm, bool) or not isinstance(opm, int) or opm <= 0:
            raise ValueError(
                f"YarnScaling.original_max_position_embeddings must be a positive int, got {opm!r}."
            )
        if not self.beta_fast > 0 or not self.beta_slow > 0:
            raise ValueError(
                f"YarnScaling.beta_fast and beta_slow must be positive, got {self.beta_fast} and "
                f"{self.beta_slow}."
            )
        if self.attention_factor is not None and not self.attention_factor > 0:
            raise ValueError(
                f"YarnScaling.attention_factor must be positive or None, got "
                f"{self.attention_factor}."
            )


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(scale) + 1 (1 when scale <= 1)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(yarn: YarnScaling | None) -> float:
    """The multiplier transformers applies to cos and sin (1.0 without YaRN)."""
    if yarn is None:
        return 1.0
    if yarn.attention_factor is not None:
        return float(yarn.attention_factor)
    if yarn.mscale and yarn.mscale_all_dim:
        return float(yarn_mscale(yarn.factor, yarn.mscale)
                     / yarn_mscale(yarn.factor, yarn.mscale_all_dim))
    return float(yarn_mscale(yarn.factor))


def softmax_scale_multiplier(yarn: YarnScaling | None) -> float:
    """DeepSeek's extra softmax-scale factor mscale(factor, mscale_all_dim)**2 (1.0 if unset)."""
    if yarn is None or not yarn.mscale_all_dim:
        return 1.0
    m = yarn_mscale(yarn.factor, yarn.mscale_all_dim)
    return m * m


def rope_inv_freq(dim: int, theta: float, yarn: YarnScaling | None = None) -> np.ndarray:
    """Inverse rotary frequencies, float32[dim // 2], with YaRN blending when `yarn` is set.

    Args:
      dim: rotary width (qk_rope_head_dim), even.
      theta: rope base.
      yarn: the scaling setting, or None for plain RoPE.
    """
    if dim <= 0 or dim % 2:
        raise ValueError(f"rope_inv_freq: dim must be a positive even int, got {dim}.")
    if not theta > 0:
        raise ValueError(f"rope_inv_freq: theta must be positive, got {theta}.")
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    pos_freqs = np.float32(theta) ** exponents
    extrapolated = np.float32(1.0) / pos_freqs
    if yarn is None:
        return extrapolated.astype(np.float32)
    interpolated = np.float32(1.0) / (np.float32(yarn.factor) * pos_freqs)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(yarn.original_max_position_embeddings
                               / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low))
                   / np.float32(high - low), 0, 1).astype(np.float32)
    keep = np.float32(1) - ramp  # 1 = keep the original (extrapolated) frequency
    return (interpolated * (np.float32(1) - keep) + extrapolated * keep).astype(np.float32)
