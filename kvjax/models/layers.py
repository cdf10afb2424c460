"""Building blocks shared by the model families: RMSNorm, RoPE (with scaling), SwiGLU.

Plain functions over arrays: the params live in the families' params pytrees,
so the same function serves a `lax.scan` over stacked layers and a Python loop.
Numerics follow HuggingFace `transformers` (the reference the tests compare
against): norms and rotary tables are computed in float32 and cast back to the
activation dtype at the same points.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from kvjax.backends.linear import LayerSlice, layer_params, linear

__all__ = [
    "RopeConfig",
    "rms_norm",
    "rope_inv_freq",
    "rope_cos_sin",
    "apply_rope",
    "swiglu",
    "linear",
    "LayerSlice",
    "layer_params",
]

_ROPE_TYPES = ("default", "linear", "llama3")


def rms_norm(
    x: Float[Array, "*batch width"], weight: Float[Array, " width"], eps: float
) -> Float[Array, "*batch width"]:
    """RMSNorm: `weight * x / sqrt(mean(x**2) + eps)`, statistics in float32.

    The normalised activations are cast back to x's dtype before the weight
    multiplies them (as transformers does), so bf16 models round at the same place.
    """
    xf = x.astype(jnp.float32)
    var = jnp.mean(xf * xf, axis=-1, keepdims=True)
    y = (xf * jax.lax.rsqrt(var + jnp.float32(eps))).astype(x.dtype)
    return weight.astype(x.dtype) * y


def swiglu(
    x: Float[Array, "*batch hidden"],
    w_gate: Float[Array, "hidden inter"],
    w_up: Float[Array, "hidden inter"],
    w_down: Float[Array, "inter hidden"],
    b_gate=None,
    b_up=None,
    b_down=None,
) -> Float[Array, "*batch hidden"]:
    """The gated MLP of Llama-style models: down(silu(gate(x)) * up(x))."""
    return linear(jax.nn.silu(linear(x, w_gate, b_gate)) * linear(x, w_up, b_up), w_down, b_down)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeConfig:
    """Rotary embedding settings (hashable; usable inside a static model config).

    Attributes:
      theta: base wavelength (`rope_theta`).
      dim: rotated width per head (the head dim times `partial_rotary_factor`).
      rope_type: "default", "linear" (positions divided by `factor`) or "llama3"
        (Llama-3.1 frequency-dependent scaling with `factor`, `low_freq_factor`,
        `high_freq_factor` and `original_max_position_embeddings`).
    """

    theta: float
    dim: int
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.rope_type not in _ROPE_TYPES:
            raise ValueError(
                f"RopeConfig: rope_type {self.rope_type!r} is not supported; supported: "
                f"{_ROPE_TYPES}."
            )
        if not self.theta > 0:
            raise ValueError(f"RopeConfig.theta must be positive, got {self.theta}.")
        if self.dim <= 0 or self.dim % 2:
            raise ValueError(f"RopeConfig.dim must be a positive even int, got {self.dim}.")
        if not self.factor > 0:
            raise ValueError(f"RopeConfig.factor must be positive, got {self.factor}.")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"RopeConfig: llama3 scaling needs high_freq_factor > low_freq_factor, got "
                f"{self.high_freq_factor} and {self.low_freq_factor}."
            )

    @classmethod
    def from_hf(cls, hf_config: dict, head_dim: int) -> "RopeConfig":
        """Reads `rope_parameters` (transformers >= 5) or `rope_theta` + `rope_scaling` (older).

        Raises:
          ValueError: naming an unsupported rope type or partial rotary factor.
        """
        params = dict(hf_config.get("rope_parameters") or {})
        legacy = hf_config.get("rope_scaling") or {}
        for k, v in legacy.items():
            params.setdefault(k, v)
        theta = params.get("rope_theta", hf_config.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        partial = params.get("partial_rotary_factor",
                             hf_config.get("partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise ValueError(
                f"partial_rotary_factor={partial} is not supported (only 1.0)."
            )
        kw = dict(theta=float(theta), dim=int(head_dim), rope_type=rope_type)
        if rope_type in ("linear", "llama3"):
            kw["factor"] = float(params["factor"])
        if rope_type == "llama3":
            kw["low_freq_factor"] = float(params["low_freq_factor"])
            kw["high_freq_factor"] = float(params["high_freq_factor"])
            kw["original_max_position_embeddings"] = int(
                params.get("original_max_position_embeddings",
                           hf_config.get("max_position_embeddings", 8192))
            )
        return cls(**kw)


def rope_inv_freq(rope: RopeConfig) -> np.ndarray:
    """float32[dim // 2] inverse frequencies, scaled as `rope.rope_type` says.

    Computed on the host in float32, the precision transformers uses, so that
    long positions agree with it to the last bits.
    """
    exponent = np.arange(0, rope.dim, 2, dtype=np.int64).astype(np.float32) / np.float32(rope.dim)
    inv_freq = (np.float32(1.0) / (np.float32(rope.theta) ** exponent)).astype(np.float32)
    if rope.rope_type == "linear":
        inv_freq = inv_freq / np.float32(rope.factor)
    elif rope.rope_type == "llama3":
        old = rope.original_max_position_embeddings
        low_wavelen = old / rope.low_freq_factor
        high_wavelen = old / rope.high_freq_factor
        wavelen = np.float32(2 * math.pi) / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / np.float32(rope.factor), inv_freq)
        smooth = (np.float32(old) / wavelen - np.float32(rope.low_freq_factor)) / np.float32(
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / np.float32(rope.factor) + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


def rope_cos_sin(
    positions: Int[Array, "batch q_len"], rope: RopeConfig, dtype
) -> tuple[Float[Array, "batch q_len dim"], Float[Array, "batch q_len dim"]]:
    """cos and sin tables for `positions`, in `dtype` (computed in float32)."""
    inv_freq = jnp.asarray(rope_inv_freq(rope))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [batch, q_len, dim/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(
    x: Float[Array, "batch q_len heads dim"],
    cos: Float[Array, "batch q_len dim"],
    sin: Float[Array, "batch q_len dim"],
) -> Float[Array, "batch q_len heads dim"]:
    """Rotates the two halves of each head (the "rotate_half" layout of HF Llama checkpoints)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]
