"""Rotary position embedding helpers for policies that move keys to new cache positions.

StreamingLLM's cache-position scheme gives each cached key the rotary
position of its slot in the cache, not of its place in the text. When
eviction moves a key from slot s to slot j, the key must be re-rotated by
j - s: rotations compose, R(j) = R(j - s) R(s), so a key cached after RoPE at
s becomes RoPE at j without ever keeping the pre-RoPE key.

Convention: the "rotate half" layout of Llama-family models (HuggingFace's
`rotate_half`): the first `rotary_dim / 2` channels pair with the next
`rotary_dim / 2`; channels past `rotary_dim` are not rotated.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

__all__ = ["rope_inv_freq", "apply_rope", "rerotate"]


def rope_inv_freq(rotary_dim: int, theta: float = 10000.0) -> Float[Array, " half"]:
    """Inverse frequencies theta^(-2i / rotary_dim), i < rotary_dim / 2, float32."""
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rope_inv_freq: rotary_dim must be a positive even int, got "
                         f"{rotary_dim}.")
    if not theta > 0:
        raise ValueError(f"rope_inv_freq: theta must be positive, got {theta}.")
    exponent = jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / jnp.float32(rotary_dim)
    return jnp.float32(theta) ** (-exponent)


def apply_rope(
    x: Float[Array, "*batch head_dim"],
    positions: Int[Array, "*batch"],
    inv_freq: Float[Array, " half"],
) -> Float[Array, "*batch head_dim"]:
    """Rotates `x` (any leading axes) to `positions` (broadcast against them); f32 math.

    Args:
      x: [..., head_dim]; the first `2 * len(inv_freq)` channels are rotated.
      positions: integer positions, shape `x.shape[:-1]` or broadcastable to it
        (negative values rotate backwards, as re-rotation needs).
      inv_freq: float32[rotary_dim / 2], e.g. from `rope_inv_freq`.

    Returns:
      x rotated, in x's dtype.
    """
    half = inv_freq.shape[0]
    rot = 2 * half
    if rot > x.shape[-1]:
        raise ValueError(f"apply_rope: rotary_dim {rot} exceeds head_dim {x.shape[-1]}.")
    angle = _angles(jnp.asarray(positions), inv_freq)
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    xf = x.astype(jnp.float32)
    x1, x2, rest = xf[..., :half], xf[..., half:rot], xf[..., rot:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)
    return out.astype(x.dtype)


def _angles(
    positions: Int[Array, "*batch"], inv_freq: Float[Array, " half"]
) -> Float[Array, "*batch half"]:
    """position * inv_freq reduced to [0, 2 pi), accurate to ~1e-6 rad at any position < 2^24.

    A plain float32 product `position * inv_freq` rounds by |angle| * 2^-24,
    i.e. 3e-5 rad at angle 500, so a key rotated to s then re-rotated by
    j - s would differ from one rotated to j by more than 1e-5. Instead the
    angle is computed in turns, p * g with g = inv_freq / (2 pi), split into
    12-bit halves (p = ph + pl, g = gh + gl) whose partial products are exact
    in float32; their fractional parts are exact too, and only their sum of
    at most four numbers in [0, 1) rounds.
    """
    p = positions.astype(jnp.float32)[..., None]  # exact for |p| < 2^24
    ph = jnp.floor(p * jnp.float32(1 / 4096)) * jnp.float32(4096)
    pl = p - ph
    g = inv_freq / jnp.float32(2 * np.pi)
    # Keep the top 12 significant bits of g by masking the low 12 mantissa bits.
    gh = jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(g, jnp.uint32) & jnp.uint32(0xFFFFF000), jnp.float32
    )
    gl = g - gh

    def frac(x):
        return x - jnp.floor(x)

    turns = frac(ph * gh) + frac(ph * gl) + frac(pl * gh) + frac(pl * gl)
    return frac(turns) * jnp.float32(2 * np.pi)


def rerotate(
    k: Float[Array, "*batch head_dim"],
    delta: Int[Array, "*batch"],
    inv_freq: Float[Array, " half"],
) -> Float[Array, "*batch head_dim"]:
    """A key rotated at position s, re-rotated to s + delta: R(delta) applied to it."""
    return apply_rope(k, delta, inv_freq)
