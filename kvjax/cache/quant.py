"""Asymmetric min/max quantization of KV blocks to 2, 4 or 8 bits (KIVI, arXiv 2402.02750).

A group of G elements with minimum m and maximum M is stored as b-bit codes
plus a scale s and a zero point z; element x becomes

    code = clip(round((x - z) / s), 0, 2^b - 1),   x_hat = code * s + z.

s and z are computed in float32 and stored in a 16-bit float
(`QuantSpec.scale_dtype`, float16 by default). Rounding them to nearest would
move the grid off [m, M] and could push an element more than half a step from
its reconstruction, so they are rounded outwards instead: z = m rounded down
and s = (M - z) / (2^b - 1) rounded up, both in the storage dtype. The grid
then covers [m, M] and every element is reconstructed within s/2 of its value
(plus float32 rounding) with the very s that is stored. A constant group gets
s = 0 and code 0 (no division by zero, no NaN) and is reconstructed exactly
whenever its value is representable in the scale dtype (every bfloat16 or
float16 value inside float16's normal range is).

Range. That guarantee holds for every group whose elements lie within
+-`representable_range(scale_dtype)`: float16's largest finite value (65504)
for float16 scales, 2^126 for bfloat16 (so that `code * s + z` stays finite in
float32). Finite inputs never give NaN or inf: a finite element beyond that
range is saturated to the end of its group's grid (the group's other elements
keep the s/2 bound). A group holding a NaN or an inf is stored with NaN scale
and zero, so all of its elements dequantize to NaN and nothing else does: for
values ("channels", one token's G channels) that is the token's own group; for
keys ("tokens", one channel over G tokens) it spans G tokens. `quantize`
itself never raises on values (it behaves the same eagerly and under jit, and
callers quantize padding lanes they then drop); either case is reported by
`unrepresentable_groups` (traceable flags to fold into a status) and
`check_quantizable` (a `ValueError` naming the element, for concrete inputs at
a host-side boundary).

Grouping ("tokens" or "channels") and the packed bit layout are defined in
`kernels_pallas.quantized_attention.layout`, re-exported here.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, UInt8

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
    "check_quantizable",
    "codes_per_byte",
    "dequantize",
    "pack_codes",
    "quantize",
    "quantize_packed",
    "representable_range",
    "unpack_codes",
    "unrepresentable_groups",
]


def _next16(y: Array, up: bool) -> Array:
    """The neighbour of finite 16-bit floats y towards +inf (up) or -inf, by integer steps
    on the sign-magnitude bits (zeros of either sign step to the smallest subnormal).
    `jnp.nextafter`'s general form (inf and NaN cases) is tens of ops, which XLA repeats
    for every element of a group when it fuses the scale into the codes' computation."""
    u = jax.lax.bitcast_convert_type(y, jnp.uint16)
    neg = (u & 0x8000) != 0
    zero = (u & 0x7FFF) == 0
    away = neg != up  # the step grows the magnitude
    step = jnp.where(away, u + jnp.uint16(1), u - jnp.uint16(1))
    return jax.lax.bitcast_convert_type(
        jnp.where(zero, jnp.uint16(0x0001 if up else 0x8001), step), y.dtype)


def _round_down(x: Float[Array, "..."], dtype) -> Array:
    """The largest `dtype` value <= finite x (float32)."""
    y = x.astype(dtype)
    if jnp.dtype(dtype).itemsize != 2:  # float32 scales hold x exactly
        return y
    return jnp.where(y.astype(jnp.float32) > x, _next16(y, up=False), y)


def _scale_up(span: Float[Array, "..."], levels, dtype) -> Array:
    """The least `dtype` value s with s * levels >= span (finite span >= 0, float32): span /
    levels rounded up to `dtype`, decided on the product instead of the quotient. XLA
    rounds span / levels differently in different programs (jax 0.12.1 on CPU: a
    quotient one float32 ulp apart between a jitted and an eager quantize), and one on
    the wrong side of a 16-bit value took the next scale up; s * levels is exact in
    float32 (at most 11 significant bits times 8)."""
    q = span / levels
    if jnp.dtype(dtype).itemsize != 2:  # float32 scales hold the quotient as is
        return q.astype(dtype)
    s = q.astype(dtype)  # to nearest: the answer or the value just below it
    return jnp.where(s.astype(jnp.float32) * levels < span, _next16(s, up=True), s)


def representable_range(scale_dtype) -> float:
    """The largest |x| a group may hold and keep the s/2 bound with scales in `scale_dtype`.

    float16: its largest finite value, 65504. bfloat16: 2^126, below its own
    limit, so that a dequantized `code * s + z` (at most about 2^127) stays
    finite in float32.
    """
    return float(min(np.float32(jnp.finfo(scale_dtype).max), np.float32(2.0**126)))


def _grouped(x, group_size, grouping, op):
    """float32 x as groups along the reduced axis; returns (groups, reduced axis)."""
    if grouping not in GROUPINGS:
        raise ValueError(f"{op}: grouping must be one of {GROUPINGS}, got {grouping!r}.")
    rows, width = x.shape[-2:]
    axis_len = rows if grouping == "tokens" else width
    if group_size <= 0 or axis_len % group_size:
        raise ValueError(
            f"{op}: group_size={group_size} must divide the grouped axis "
            f"({'rows' if grouping == 'tokens' else 'width'} = {axis_len})."
        )
    x = x.astype(jnp.float32)
    lead = x.shape[:-2]
    if grouping == "tokens":
        return x.reshape(*lead, rows // group_size, group_size, width), -2
    return x.reshape(*lead, rows, width // group_size, group_size), -1


def unrepresentable_groups(
    x: Float[Array, "... rows width"],
    *,
    group_size: int,
    grouping: str,
    scale_dtype=jnp.float16,
) -> Bool[Array, "... srows scols"]:
    """Flags the groups `quantize` cannot store within its bound; traceable.

    A group is flagged if it holds a NaN or an inf (stored as NaN: all its
    elements dequantize to NaN) or a finite element beyond
    +-`representable_range(scale_dtype)` (saturated). Under jit, fold
    `jnp.any` of the flags into the caller's status.

    Returns:
      bool, the shape of `quantize`'s scale: `[..., rows / G, width]` or `[..., rows, width / G]`.
    """
    xg, red = _grouped(x, group_size, grouping, "unrepresentable_groups")
    lim = jnp.float32(representable_range(scale_dtype))
    bad = ~(jnp.abs(xg) <= lim)  # NaN compares false: flagged too
    return jnp.any(bad, axis=red)


def check_quantizable(
    x: Float[Array, "... rows width"],
    *,
    group_size: int,
    grouping: str,
    scale_dtype=jnp.float16,
) -> None:
    """Raises ValueError naming the first element of a concrete `x` that `quantize` would
    saturate (beyond `representable_range(scale_dtype)`) or turn into a NaN group.

    For a host-side boundary, before the values go into a jitted write; under jit
    use `unrepresentable_groups`.

    Raises:
      TypeError: if `x` is traced.
      ValueError: on such an element.
    """
    if isinstance(x, jax.core.Tracer):
        raise TypeError("check_quantizable needs a concrete array; under jit fold "
                        "unrepresentable_groups(...) into a status instead.")
    _grouped(x, group_size, grouping, "check_quantizable")
    xs = np.asarray(jnp.asarray(x).astype(jnp.float32))
    lim = representable_range(scale_dtype)
    bad = ~(np.abs(xs) <= lim)
    if not bad.any():
        return
    idx = tuple(int(i) for i in np.argwhere(bad)[0])
    val = xs[idx]
    span = (f"one channel over {group_size} tokens" if grouping == "tokens"
            else f"{group_size} channels of one token")
    if np.isfinite(val):
        raise ValueError(
            f"check_quantizable: x{list(idx)} = {val:.6g} lies outside +-{lim:.6g}, the range that "
            f"{jnp.dtype(scale_dtype).name} scales represent; it would be saturated. Store "
            f"scales in bfloat16 (QuantSpec(scale_dtype='bfloat16')) or keep such values out "
            f"of the cache."
        )
    raise ValueError(
        f"check_quantizable: x{list(idx)} = {val} is not finite; its group ({grouping!r} grouping: "
        f"{span}) would dequantize to NaN. Only finite values can be quantized."
    )


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
      `[..., rows, width / G]`. See the module docstring for inputs outside the
      representable range (saturated) and non-finite inputs (their group is NaN);
      `unrepresentable_groups` and `check_quantizable` report them.
    """
    codes_per_byte(bits)  # validates bits
    xg, red = _grouped(x, group_size, grouping, "quantize")
    rows, width = x.shape[-2:]
    lead = x.shape[:-2]
    lo = jnp.min(xg, axis=red, keepdims=True)
    hi = jnp.max(xg, axis=red, keepdims=True)
    finite = jnp.isfinite(lo) & jnp.isfinite(hi)  # min/max propagate NaN
    # Clipped to the representable range, z >= -lim and s <= 2 lim / levels are finite in
    # the scale dtype and code * s + z in float32; elements beyond it saturate.
    lim = jnp.float32(representable_range(scale_dtype))
    lo = jnp.clip(lo, -lim, lim)
    hi = jnp.clip(hi, -lim, lim)
    zero = _round_down(lo, scale_dtype)
    levels = jnp.float32((1 << bits) - 1)
    scale = _scale_up(hi - zero.astype(jnp.float32), levels, scale_dtype)
    s32 = scale.astype(jnp.float32)
    safe = jnp.where(s32 > 0, s32, 1.0)
    q = jnp.round((xg - zero.astype(jnp.float32)) / safe)
    q = jnp.where((s32 > 0) & finite, jnp.clip(q, 0.0, levels), 0.0)
    codes = q.astype(jnp.uint8).reshape(*lead, rows, width)
    nan = jnp.array(jnp.nan, scale_dtype)
    scale = jnp.where(finite, scale, nan)
    zero = jnp.where(finite, zero, nan)
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
    """`quantize`, then `pack_codes` along the width: what a quantized page stores.

    Range, non-finite inputs and errors as in `quantize`.
    """
    codes, scale, zero = quantize(
        x, bits=bits, group_size=group_size, grouping=grouping, scale_dtype=scale_dtype
    )
    return pack_codes(codes, bits), scale, zero
