"""Rotary position embedding for policies that move keys to new cache positions.

StreamingLLM's cache-position scheme gives each cached key the rotary
position of its slot in the cache, not of its place in the text. When
eviction moves a key from slot s to slot j, the key must be re-rotated by
j - s: rotations compose, R(j) = R(j - s) R(s), so a key cached after RoPE at
s becomes RoPE at j without ever keeping the pre-RoPE key.

The implementation is `kvjax.rope` (the one the models use); these are its
position-based forms with exact angles. Convention: the "rotate half" layout
of Llama-family models; channels past `rotary_dim` are not rotated.
"""

import jax.numpy as jnp
from jaxtyping import Array, Float

from kvjax import rope as _rope
from kvjax.rope import rerotate

__all__ = ["rope_inv_freq", "apply_rope", "rerotate"]

# x [..., head_dim] rotated to integer positions (any leading axes), exact angles, f32 math.
apply_rope = _rope.rotate


def rope_inv_freq(rotary_dim: int, theta: float = 10000.0) -> Float[Array, " half"]:
    """Unscaled inverse frequencies theta^(-2i / rotary_dim), i < rotary_dim / 2, float32."""
    return jnp.asarray(_rope.rope_inv_freq(_rope.RopeConfig(theta=theta, dim=rotary_dim)))
