"""Bit layout of quantized KV pages: packing, unpacking and dequantization (plain jnp).

This file is the single definition of how kvjax stores low-bit KV codes, so
that the quantizer (`kvjax.cache.quant`), the XLA attention path and the
Pallas kernels all read the same bytes. It uses only shifts, masks, integer
casts and multiply-adds, which lower inside Pallas kernels on TPU and GPU.

Codes
  A b-bit code (b in {2, 4, 8}) is an unsigned integer in [0, 2^b - 1]. The
  element it stands for is `code * scale + zero` (asymmetric min/max
  quantization), computed in float32.

Packing (uint8 words, "planar" order)
  `k = 8 // b` codes share one uint8. Codes are packed along the last axis,
  of width W (W must be a multiple of k); the packed axis has W // k bytes.
  Byte j holds, in its bit field i (bits [i*b, (i+1)*b), i = 0 is the least
  significant), the code of element

      i * (W // k) + j.

  So field i of all bytes together is the contiguous slice of elements
  [i * W/k, (i+1) * W/k): unpacking is `(byte >> (i*b)) & (2^b - 1)` for each
  i, concatenated along the last axis, with no interleaving shuffle (which
  would be a relayout inside a TPU kernel). Example, b = 2, W = 8, codes
  c0..c7: byte 0 = c0 | c2 << 2 | c4 << 4 | c6 << 6 and
  byte 1 = c1 | c3 << 2 | c5 << 4 | c7 << 6. For b = 8 the bytes are the codes.

Groups and scale/zero layout (per page of `page_size` tokens and width D)
  keys   ("tokens" grouping, KIVI per-channel): codes [page_size, D/k];
         scale, zero [page_size / G, D]: one pair per channel per G tokens.
  values ("channels" grouping, KIVI per-token): codes [page_size, D/k];
         scale, zero [page_size, D / G]: one pair per token per G channels.
  MLA's latent c_KV uses the "channels" grouping.
  Scales and zeros are float16 by default (see `kvjax.specs.QuantSpec`). The
  quantizer (`kvjax.cache.quant`) keeps them finite and `code * scale + zero`
  finite in float32 for every finite input; only a group that held a NaN or
  an inf has NaN scale and zero (so exactly its elements dequantize to NaN).

Reading it in a kernel
  Because field i of the packed bytes is the contiguous channel slice
  [i * W/k, (i+1) * W/k), a kernel need not concatenate the unpacked fields:
  q . k = sum_i q[:, slice_i] . ((bytes >> i*b) & mask) * scale[slice_i] + ...,
  and p @ v can keep one accumulator per slice, each written to its own slice
  of the output. Keys' scales are per channel ([page_size / G, W]: slice them
  like the codes and broadcast over the G tokens of a group); values' scales
  are per token and group ([page_size, W / G]), constant over runs of G
  channels.
"""

import jax.numpy as jnp
from jaxtyping import Array, Float, UInt8

__all__ = ["BITS", "GROUPINGS", "codes_per_byte", "pack_codes", "unpack_codes", "dequantize"]

BITS = (2, 4, 8)
GROUPINGS = ("tokens", "channels")


def codes_per_byte(bits: int) -> int:
    """How many `bits`-wide codes one uint8 holds."""
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits!r}.")
    return 8 // bits


def pack_codes(codes: UInt8[Array, "... width"], bits: int) -> UInt8[Array, "... packed"]:
    """Packs codes in [0, 2^bits) along the last axis into uint8, in the planar order above.

    Args:
      codes: uint8 (or any integer dtype) codes, last axis a multiple of `8 // bits`.
      bits: 2, 4 or 8.

    Returns:
      uint8 array with last axis `width * bits // 8`.
    """
    k = codes_per_byte(bits)
    width = codes.shape[-1]
    if width % k:
        raise ValueError(
            f"pack_codes: the last axis ({width}) must be a multiple of {k} to pack "
            f"{bits}-bit codes into bytes."
        )
    codes = codes.astype(jnp.uint8)
    if k == 1:
        return codes
    n = width // k
    out = codes[..., :n]
    for i in range(1, k):
        out = out | (codes[..., i * n:(i + 1) * n] << jnp.uint8(i * bits))
    return out


def unpack_codes(packed: UInt8[Array, "... packed"], bits: int) -> UInt8[Array, "... width"]:
    """Inverse of `pack_codes`: uint8 codes with last axis `packed * 8 // bits`."""
    k = codes_per_byte(bits)
    if k == 1:
        return packed
    mask = jnp.uint8((1 << bits) - 1)
    return jnp.concatenate(
        [(packed >> jnp.uint8(i * bits)) & mask for i in range(k)], axis=-1
    )


def dequantize(
    packed: UInt8[Array, "... rows packed"],
    scale: Float[Array, "... srows scols"],
    zero: Float[Array, "... srows scols"],
    *,
    bits: int,
    grouping: str,
) -> Float[Array, "... rows width"]:
    """Float32 values of packed codes: `code * scale + zero`, scales broadcast over their group.

    Args:
      packed: uint8 codes of one or more pages, `[..., rows (tokens), width * bits / 8]`.
      scale, zero: `[..., rows / G, width]` for grouping "tokens" (keys) or
        `[..., rows, width / G]` for "channels" (values, MLA latent).
      bits: 2, 4 or 8.
      grouping: "tokens" or "channels".

    Returns:
      float32 `[..., rows, width]`.
    """
    codes = unpack_codes(packed, bits).astype(jnp.float32)
    rows, width = codes.shape[-2:]
    s = scale.astype(jnp.float32)
    z = zero.astype(jnp.float32)
    if grouping == "tokens":
        g = rows // s.shape[-2]
        s = jnp.repeat(s, g, axis=-2)
        z = jnp.repeat(z, g, axis=-2)
    elif grouping == "channels":
        g = width // s.shape[-1]
        s = jnp.repeat(s, g, axis=-1)
        z = jnp.repeat(z, g, axis=-1)
    else:
        raise ValueError(f"grouping must be one of {GROUPINGS}, got {grouping!r}.")
    return codes * s + z
