"""Asymmetric min/max quantization of KV blocks to 2, 4 or 8 bits (KIVI, arXiv 2402.02750).

A group of G elements with minimum m and maximum M is stored as b-bit codes
plus a scale s and a zero point z; element x becomes

    code = clip(round((x - z) / s), 0, 2^b - 1),   x_hat = code * s + z.

s and z are stored in a 16-bit float (`QuantSpec.scale_dtype`, float16 by
default). Rounding them to nearest would move the grid off [m, M] and could
push an element more than half a step from its reconstruction, so they are
rounded outwards instead: z = m rounded down and s = (M - z) / (2^b - 1)
rounded up, both in the storage dtype. The grid then covers [m, M] and every
element is reconstructed within s/2 of its value (plus float32 rounding) with
the very s that is stored. A constant group gets s = 0 and code 0 (no division
by zero, no NaN) and is reconstructed exactly whenever its value is
representable in the scale dtype (every bfloat16 or float16 value inside
float16's normal range is).

Grouping ("tokens" or "channels") and the packed bit layout are defined in
`kernels_pallas.quantized_attention.layout`, re-exported here.
"""

import jax.numpy as jnp
from jaxtyping import Array, Float, UInt8

from kernels_pallas.quantized_attention.layout import (
    BITS,
    GROUPINGS,
    codes_per_byte,
    dequantize,
    pack_codes,
    unpack_codes,
)

__all__ = [
    "BITS",
    "GROUPINGS",
    "codes_per_byte",
    "dequantize",
    "pack_codes",
    "quantize",
    "quantize_packed",
    "unpack_codes",
]


def _round_down(x: Float[Array, "..."], dtype) -> Array:
    y = x.astype(dtype)
    return jnp.where(y.astype(jnp.float32) > x, jnp.nextafter(y, jnp.array(-jnp.inf, dtype)), y)


def _round_up(x: Float[Array, "..."], dtype) -> Array:
    y = x.astype(dtype)
    return jnp.where(y.astype(jnp.float32) < x, jnp.nextafter(y, jnp.array(jnp.inf, dtype)), y)


def quantize(
    x: Float[Array, "... rows width"],
    *,
    bits: int,
    group_size: int,
    grouping: str,
    scale_dtype=jnp.float16,
) -> tuple[UInt8[Array, "... rows width"], Float[Array, "... srows scols"],
           Float[Array, "... srows scols"]]:
    """Quantizes `x` in groups of `group_size` along rows ("tokens") or columns ("channels").

    Args:
      x: float array `[..., rows, width]` (any float dtype; computed in float32).
      bits: 2, 4 or 8.
      group_size: G; must divide `rows` ("tokens") or `width` ("channels").
      grouping: "tokens" — one scale/zero per column per G rows (KIVI keys,
        per channel); "channels" — one per row per G columns (KIVI values, per token).
      scale_dtype: float16 or bfloat16 storage of scale and zero.

    Returns:
      (codes, scale, zero): uint8 codes `[..., rows, width]` in [0, 2^bits - 1]
      (unpacked); scale and zero in `scale_dtype`, `[..., rows / G, width]` or
      `[..., rows, width / G]`.
    """
    codes_per_byte(bits)  # validates bits
    if grouping not in GROUPINGS:
        raise ValueError(f"quantize: grouping must be one of {GROUPINGS}, got {grouping!r}.")
    rows, width = x.shape[-2:]
    axis_len = rows if grouping == "tokens" else width
    if group_size <= 0 or axis_len % group_size:
        raise ValueError(
            f"quantize: group_size={group_size} must divide the grouped axis "
            f"({'rows' if grouping == 'tokens' else 'width'} = {axis_len})."
        )
    x = x.astype(jnp.float32)
    lead = x.shape[:-2]
    if grouping == "tokens":
        xg = x.reshape(*lead, rows // group_size, group_size, width)
        red = -2
    else:
        xg = x.reshape(*lead, rows, width // group_size, group_size)
        red = -1
    lo = jnp.min(xg, axis=red, keepdims=True)
    hi = jnp.max(xg, axis=red, keepdims=True)
    zero = _round_down(lo, scale_dtype)
    levels = jnp.float32((1 << bits) - 1)
    scale = _round_up((hi - zero.astype(jnp.float32)) / levels, scale_dtype)
    s32 = scale.astype(jnp.float32)
    safe = jnp.where(s32 > 0, s32, 1.0)
    q = jnp.round((xg - zero.astype(jnp.float32)) / safe)
    q = jnp.where(s32 > 0, jnp.clip(q, 0.0, levels), 0.0)
    codes = q.astype(jnp.uint8).reshape(*lead, rows, width)
    return codes, jnp.squeeze(scale, red), jnp.squeeze(zero, red)


def quantize_packed(
    x: Float[Array, "... rows width"],
    *,
    bits: int,
    group_size: int,
    grouping: str,
    scale_dtype=jnp.float16,
) -> tuple[UInt8[Array, "... rows packed"], Float[Array, "... srows scols"],
           Float[Array, "... srows scols"]]:
    """`quantize`, then `pack_codes` along the width: what a quantized page stores."""
    codes, scale, zero = quantize(
        x, bits=bits, group_size=group_size, grouping=grouping, scale_dtype=scale_dtype
    )
    return pack_codes(codes, bits), scale, zero
