"""What the quantized-page kernels (`tpu.py`, `gpu.py`) share: part specs, shape checks,
query-row folding, visited-token bounds and in-kernel dequantization of one slice.

A kernel sees a key as a sum of parts (q . k = sum_i q_i . k_i) and a value
that is either its own part or the first key part (MLA: key [c_KV, k_rope],
value c_KV). A part is "quant" (packed codes plus scale and zero pools, read
in the layout of `layout.py`) or "plain" (a full-precision pool, MLA's
k_rope). A quantized part of width W with k = 8 / bits codes per byte is read
in k slices of W / k channels: slice i is bit field i of every byte
(`layout.py`'s planar order), so no in-kernel concatenation is needed.
"""

import dataclasses

import jax
import jax.numpy as jnp

from kernels_pallas.quantized_attention.layout import BITS, GROUPINGS, codes_per_byte

__all__ = ["Part", "fold_queries", "unfold", "visit_bounds", "row_positions",
           "slice_scale_window", "dequantize_slice", "check_gqa_pages", "check_mla_pages"]


@dataclasses.dataclass(frozen=True)
class Part:
    """One key or value part of a kernel (a static, hashable description).

    Attributes:
      kind: "quant" (codes, scale, zero pools) or "plain" (one full-precision pool).
      width: channels of the part (head_dim, v_head_dim, d_c or d_rope).
      bits: code width (quant only).
      grouping: "tokens" (keys: per channel over G tokens) or "channels" (values, MLA
        latent: per token over G channels); quant only.
      group: G (quant only).
    """

    kind: str
    width: int
    bits: int = 8
    grouping: str = "channels"
    group: int = 1

    @property
    def num_pools(self) -> int:
        return 3 if self.kind == "quant" else 1

    @property
    def num_slices(self) -> int:
        return codes_per_byte(self.bits) if self.kind == "quant" else 1

    @property
    def slice_width(self) -> int:
        return self.width // self.num_slices


def slice_scale_window(part: Part, i: int) -> tuple[int, int]:
    """(start, size) of slice i's columns in the part's scale/zero pools (last axis)."""
    w = part.slice_width
    if part.grouping == "tokens":
        return i * w, w
    # "channels": slice i spans channels [i*w, (i+1)*w); their groups are
    # [i*w/G, (i+1)*w/G) when G divides w, else the one group holding them all.
    if w >= part.group:
        return i * w // part.group, w // part.group
    return i * w // part.group, 1


def dequantize_slice(part: Part, i: int, codes, s, z):
    """float32 [tokens, w] values of slice i of a block, inside a kernel.

    Args:
      part: a "quant" Part.
      i: slice (bit field) index.
      codes: int32 [tokens, w], the block's packed bytes widened (shift and mask
        in 32 bits: 8-bit vector shifts are not native on every TPU).
      s, z: float32 scale and zero of the slice's window (`slice_scale_window`):
        "tokens" grouping: [pages, page_size / G, w]; "channels": [pages, page_size, n].

    Returns:
      code * scale + zero in float32, scales broadcast over their group, as
      `layout.dequantize` computes it.
    """
    tokens, w = codes.shape
    field = (codes >> (i * part.bits)) & ((1 << part.bits) - 1) if part.bits < 8 else codes
    field = field.astype(jnp.float32)
    if part.grouping == "tokens":
        pages, srows, _ = s.shape
        g = tokens // (pages * srows)

        def expand(x):
            return jnp.broadcast_to(x[:, :, None, :], (pages, srows, g, w)).reshape(tokens, w)
    else:
        n = s.shape[-1]

        def expand(x):
            x = x.reshape(tokens, n)
            if n == 1:
                return jnp.broadcast_to(x, (tokens, w))
            return jnp.broadcast_to(x[:, :, None], (tokens, n, w // n)).reshape(tokens, w)
    return field * expand(s) + expand(z)


def fold_queries(q, kv_heads: int):
    """[batch, q_len, q_heads, d] -> [batch, kv_heads, q_len * group, d]; row = t * group + g."""
    b, t, hq, d = q.shape
    g = hq // kv_heads
    return q.reshape(b, t, kv_heads, g, d).transpose(0, 2, 1, 3, 4).reshape(b, kv_heads, t * g, d)


def unfold(out, lse, q_len: int):
    """Inverse of `fold_queries` for (out [b, kvh, rows, dv], lse [b, kvh, rows])."""
    b, kvh, rows, dv = out.shape
    g = rows // q_len
    out = out.reshape(b, kvh, q_len, g, dv).transpose(0, 2, 1, 3, 4).reshape(b, q_len, kvh * g, dv)
    lse = lse.reshape(b, kvh, q_len, g).transpose(0, 2, 1, 3).reshape(b, q_len, kvh * g)
    return out, lse


def visit_bounds(q_pos, quant_lengths, max_tokens: int, sliding_window: int | None):
    """Per row, the token range [lo, hi) a kernel must read: int32[batch] each.

    hi = min(quant_lengths, table capacity, last query position + 1) and lo the
    earliest position the sliding window lets any query see (0 without one).
    Every visible key of the row lies in [lo, hi); rows without queries get an
    empty range.
    """
    valid = q_pos >= 0
    hi = jnp.max(jnp.where(valid, q_pos + 1, 0), axis=1)
    hi = jnp.minimum(jnp.minimum(hi, quant_lengths), max_tokens)
    hi = jnp.maximum(hi, 0).astype(jnp.int32)
    if sliding_window is None:
        lo = jnp.zeros_like(hi)
    else:
        first = jnp.min(jnp.where(valid, q_pos, jnp.iinfo(jnp.int32).max), axis=1)
        lo = jnp.clip(first - sliding_window + 1, 0, hi).astype(jnp.int32)
    return lo, hi


def row_positions(q_pos, group: int):
    """int32[batch, q_len * group]: the position of each folded query row."""
    return jnp.repeat(q_pos.astype(jnp.int32), group, axis=1)


def _bits(op, name, bits):
    if bits not in BITS:
        raise ValueError(f"{op}: {name} must be one of {BITS}, got {bits!r}.")


def _quant_part(op, name, codes, scale, zero, bits, grouping, lead):
    """Checks one quantized pool triple ([*lead, page_size, packed] codes); returns its Part."""
    _bits(op, f"{name} bits", bits)
    k = codes_per_byte(bits)
    nd = len(lead) + 2
    if codes.ndim != nd or scale.ndim != nd or zero.shape != scale.shape:
        raise ValueError(
            f"{op}: {name} codes {codes.shape}, scale {scale.shape} and zero {zero.shape} must "
            f"have {nd} axes [{', '.join(lead)}, rows, cols] with scale and zero equal."
        )
    if codes.dtype != jnp.uint8:
        raise TypeError(f"{op}: {name} codes must be uint8, got {codes.dtype}.")
    if codes.shape[:-2] != scale.shape[:-2]:
        raise ValueError(f"{op}: {name} codes {codes.shape} and scale {scale.shape} disagree on "
                         f"[{', '.join(lead)}].")
    page_size, width = codes.shape[-2], codes.shape[-1] * k
    srows, scols = scale.shape[-2:]
    if grouping == "tokens":
        if scols != width or srows < 1 or page_size % srows:
            raise ValueError(
                f"{op}: {name} scale {scale.shape} must be [..., page_size / G, {width}] for "
                f"per-channel key groups of G tokens (page_size {page_size})."
            )
        group = page_size // srows
    else:
        if srows != page_size or scols < 1 or width % scols:
            raise ValueError(
                f"{op}: {name} scale {scale.shape} must be [..., {page_size}, width / G] for "
                f"per-token groups of G channels (width {width})."
            )
        group = width // scols
        w = width // k
        if w % group and group % w:
            raise ValueError(
                f"{op}: {name}: the group size G={group} and the slice width {w} "
                f"(= width / (8 / bits)) must divide one another."
            )
    assert grouping in GROUPINGS
    return Part("quant", width, bits, grouping, group)


def check_gqa_pages(op, q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, quant_lengths,
                    block_tables, q_pos, k_bits, v_bits):
    """Validates `quantized_pages_attention`'s arguments; returns (key Part, value Part)."""
    lead = ("kv_heads", "pages")
    kp = _quant_part(op, "k", k_codes, k_scale, k_zero, k_bits, "tokens", lead)
    vp = _quant_part(op, "v", v_codes, v_scale, v_zero, v_bits, "channels", lead)
    if q.ndim != 4:
        raise ValueError(f"{op}: q must be [batch, q_len, q_heads, head_dim], got {q.shape}.")
    if k_codes.shape[:3] != v_codes.shape[:3]:
        raise ValueError(f"{op}: k_codes {k_codes.shape} and v_codes {v_codes.shape} must agree "
                         f"on [kv_heads, pages, page_size].")
    if q.shape[3] != kp.width:
        raise ValueError(f"{op}: q head_dim {q.shape[3]} != the keys' width {kp.width} "
                         f"(k_codes {k_codes.shape} at {k_bits} bits).")
    if q.shape[2] % k_codes.shape[0]:
        raise ValueError(f"{op}: q_heads {q.shape[2]} is not a multiple of kv_heads "
                         f"{k_codes.shape[0]}.")
    _check_rows(op, q.shape[0], q.shape[1], quant_lengths, block_tables, q_pos)
    return kp, vp


def check_mla_pages(op, q_latent, q_rope, c_codes, c_scale, c_zero, rope_pages, quant_lengths,
                    block_tables, q_pos, bits):
    """Validates `quantized_mla_pages_attention`'s arguments; returns (latent Part, rope Part)."""
    cp = _quant_part(op, "c", c_codes, c_scale, c_zero, bits, "channels", ("pages",))
    if q_latent.ndim != 4 or q_rope.ndim != 4 or q_latent.shape[:3] != q_rope.shape[:3]:
        raise ValueError(
            f"{op}: q_latent {q_latent.shape} and q_rope {q_rope.shape} must be "
            f"[batch, q_len, q_heads, d_c | d_rope] with equal leading axes."
        )
    if rope_pages.ndim != 3 or rope_pages.shape[:2] != c_codes.shape[:2]:
        raise ValueError(f"{op}: rope_pages {rope_pages.shape} must be [pages, page_size, d_rope] "
                         f"matching c_codes {c_codes.shape}.")
    if q_latent.shape[3] != cp.width or q_rope.shape[3] != rope_pages.shape[2]:
        raise ValueError(
            f"{op}: query widths ({q_latent.shape[3]}, {q_rope.shape[3]}) must equal d_c "
            f"{cp.width} and d_rope {rope_pages.shape[2]}."
        )
    _check_rows(op, q_latent.shape[0], q_latent.shape[1], quant_lengths, block_tables, q_pos)
    return cp, Part("plain", rope_pages.shape[2])


def _check_rows(op, batch, q_len, quant_lengths, block_tables, q_pos):
    if block_tables.ndim != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"{op}: block_tables {block_tables.shape} must be [batch={batch}, "
                         f"max_pages].")
    if quant_lengths.shape != (batch,) or q_pos.shape != (batch, q_len):
        raise ValueError(
            f"{op}: quant_lengths {quant_lengths.shape} must be [{batch}] and q_pos "
            f"{q_pos.shape} [{batch}, {q_len}]."
        )
    for name, x in (("quant_lengths", quant_lengths), ("block_tables", block_tables),
                    ("q_pos", q_pos)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"{op}: {name} must be an integer array, got {x.dtype}.")


def f32(x):
    """float32 view of a kernel value (bf16/f16 inputs are exact in f32)."""
    return x.astype(jnp.float32)


HIGHEST = jax.lax.Precision.HIGHEST
