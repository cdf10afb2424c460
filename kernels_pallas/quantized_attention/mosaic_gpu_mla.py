"""KIVI decode over quantized MLA latent pages on Hopper as a Mosaic GPU kernel.

Same contract as `gpu.quantized_mla_[pages_]attention` (the Triton kernel) and
the reference, for decode rows (q_len 1); `unsupported_reason` says which
shapes this kernel leaves to the Triton kernel. The full-precision tail is
attended by the reference's jnp code and merged by log-sum-exp.

Design. The pipeline and schedule are the bf16 MLA decode kernel's
(`mla_decode/mosaic_gpu.py`, its `_kernel` with a `latent` hook): one CTA =
64 query heads of one sequence and one split, a TMA warpgroup feeding two
compute warpgroups, the grid's head blocks innermost so the CTAs reading one
page run side by side, split-K from `choose_num_splits` and the split merge
`merge.merge_splits`. What changes is how a step's latent reaches the two
products:

* The memory warpgroup copies the step's packed codes (in 32-byte column
  pieces, one swizzled TMA box each), the per-token scales and zeros
  (transposed token-minor by the wrapper: [pages, 2, groups, page_size]) and
  the full-precision rope rows.
* Each compute warpgroup converts its own d_c / 2 latent columns of the 64
  tokens once per step into one bf16 (f16) tile in shared memory, 32 columns
  at a time: a bit field of the codes becomes a float by the magic-number
  exponent (`(code | 0x4300)` read as bfloat16 is 128 + code: an OR and a
  subtract, no integer-to-float conversion; 8-bit codes in bfloat16 take the
  plain conversion), then one multiply-add by the token's scale and zero.
  Both products then read that tile as the bf16 kernel reads its pages.
  The layout (`layout.py`'s planar order) makes field i of the packed bytes
  the channel slice [i W/k, (i+1) W/k), so a warpgroup's half is whole fields
  (or whole byte columns at 8 bits) and needs no shuffle.
* Why convert the tile instead of folding the scales out of the products (as
  the GQA kernel does): MLA's latent is quantized per token in channel groups
  (it is the values' grouping, and also the keys'), so a fold multiplies
  every logit and every probability once per channel group: 64 heads x d_c/G
  products per token for each of Q K^T and P V (2 x 64 x 16 = 2048 at d_c 512,
  G 32) against d_c = 512 multiply-adds per token to dequantize the tile once
  for the CTA's 64 heads. With 64 heads per CTA, dequantizing once is 4x less
  per-element work.
* Shared memory at DeepSeek-V3's shape (d_c 512, d_rope 64, bf16): query 72
  KiB, the converted tile 64 KiB, two stages of rope (16 KiB), codes (int4 32
  KiB, int2 16 KiB) and scales (8 KiB), probabilities 8 KiB: 202 KiB at int4.
  Two int8 stages would not fit 227 KiB, so int8 runs one stage
  (`_stages`).
* Visibility: a row attends [0, hi) with hi = min(quantized length, query
  position + 1); rows past hi are zeroed in the conversion (their scales may
  be NaN), their logits masked, and table entries past hi never addressed.

Performance is unmeasured (no GPU here). Checked on CPU in Mosaic GPU's
interpreter with race detection and by lowering for an H100
(tests/kernels/test_mosaic_gpu_quantized_mla.py).
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int, UInt8

from kernels_pallas import _mosaic_gpu as mgpu
from kernels_pallas._mosaic_gpu import plgpu
from kernels_pallas.merge import merge_splits
from kernels_pallas.mla_decode import mosaic_gpu as mla
from kernels_pallas.quantized_attention import _common as c
from kernels_pallas.quantized_attention import reference as qref
from kernels_pallas.quantized_attention.layout import codes_per_byte
from kernels_pallas.quantized_attention.mosaic_gpu import _to_float

__all__ = ["quantized_mla_pages_attention", "quantized_mla_attention", "unsupported_reason"]

_COLS = 32  # latent columns converted at a time; bytes per TMA piece of codes
_Q_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def _stages(d_c: int, bits: int) -> int:
    """Pipeline stages: two, or one where two stages of codes do not fit (int8 at d_c 512)."""
    return 2 if d_c * bits // 8 * mla.BLOCK_TOKENS <= 16 * 1024 else 1


def _smem_bytes(d_c: int, d_rope: int, groups: int, bits: int, stages: int) -> int:
    q = mla.BLOCK_HEADS * (d_c + d_rope) * 2
    tile = mla.BLOCK_TOKENS * d_c * 2
    per_stage = mla.BLOCK_TOKENS * (d_rope * 2 + d_c * bits // 8 + 2 * groups * 2)
    probs = mla.BLOCK_HEADS * mla.BLOCK_TOKENS * 2
    return q + tile + stages * per_stage + probs + 2048  # row maxima/sums and barriers


def unsupported_reason(q_latent, q_rope, c_codes, c_scale, c_zero, rope_pages, *,
                       bits: int) -> str | None:
    """None when this kernel takes these shapes and dtypes; else a sentence saying why not.

    Takes arrays or `jax.ShapeDtypeStruct`s (only shapes and dtypes are read) in the op's
    argument order, and the bit width.
    """
    if q_latent.ndim != 4 or q_rope.ndim != 4 or c_codes.ndim != 3 or c_scale.ndim != 3 \
            or rope_pages.ndim != 3:
        return "the Mosaic GPU KIVI MLA kernel takes 4-D queries and 3-D pools."
    if q_latent.shape[1] != 1:
        return (f"the Mosaic GPU KIVI MLA kernel serves decode rows (q_len 1), got q_len "
                f"{q_latent.shape[1]}; the Triton kernel serves chunked prefill.")
    if bits not in (2, 4, 8):
        return f"the Mosaic GPU KIVI MLA kernel takes 2, 4 or 8 bits, got {bits}."
    if jnp.dtype(q_latent.dtype) not in _Q_DTYPES or jnp.dtype(q_rope.dtype) not in _Q_DTYPES:
        return (f"the Mosaic GPU KIVI MLA kernel takes bfloat16, float16 or float32 queries, "
                f"got {q_latent.dtype}, {q_rope.dtype}.")
    if jnp.dtype(rope_pages.dtype) not in map(jnp.dtype, mla.DTYPES):
        return (f"the Mosaic GPU KIVI MLA kernel takes bfloat16 or float16 rope pages (the "
                f"tensor cores' operand dtype), got {rope_pages.dtype}.")
    d_c = c_codes.shape[-1] * codes_per_byte(bits)
    d_rope = rope_pages.shape[-1]
    groups = c_scale.shape[-1]
    group = d_c // max(groups, 1)
    if d_c % 64 or not 64 <= d_c <= 512:
        return (f"the Mosaic GPU KIVI MLA kernel needs d_c a multiple of 64 in [64, 512] (the "
                f"bf16 MLA kernel's two column halves), got {d_c}.")
    if d_rope % 32 or d_rope < 32:
        return f"the Mosaic GPU KIVI MLA kernel needs d_rope a multiple of 32, got {d_rope}."
    if group % _COLS:
        return (f"the Mosaic GPU KIVI MLA kernel converts {_COLS} channels of one scale group "
                f"at a time, so the group size must be a multiple of {_COLS}, got {group}.")
    if d_c * bits // 8 % _COLS:
        return (f"the Mosaic GPU KIVI MLA kernel copies codes in {_COLS}-byte pieces, so "
                f"d_c * bits / 8 must be a multiple of {_COLS}, got {d_c * bits // 8}.")
    page_size = c_codes.shape[1]
    bt = mla.BLOCK_TOKENS
    if page_size % 8 or (page_size < bt and bt % page_size) or (
            page_size > bt and page_size % bt):
        return (f"the Mosaic GPU KIVI MLA kernel takes page sizes that divide {bt} or are "
                f"multiples of it (8, 16, 32, 64, 128, ...), got {page_size}.")
    need = _smem_bytes(d_c, d_rope, groups, bits, _stages(d_c, bits))
    if need > mla.SMEM_BYTES:
        return (f"the Mosaic GPU KIVI MLA kernel needs {need} bytes of shared memory for "
                f"d_c={d_c}, d_rope={d_rope}, more than a Hopper block's {mla.SMEM_BYTES}.")
    return None


class _Latent:
    """The `latent` hook of the MLA decode kernel for KIVI codes (see the module docstring)."""

    def __init__(self, codes_ref, sz_ref, codes_smem, sz_smem, lat_smem, *, bits, group,
                 interpret):
        self.codes_ref, self.sz_ref = codes_ref, sz_ref  # GMEM
        self.codes_smem, self.sz_smem, self.lat_smem = codes_smem, sz_smem, lat_smem
        self.bits, self.group, self.interpret = bits, group, interpret

    def fetch(self, page, rows, dst, slot, barrier):
        """Copies one page piece's codes and scales (all arrive on `barrier`)."""
        for pc in range(self.codes_smem.shape[1]):
            plgpu.copy_gmem_to_smem(self.codes_ref.at[page, rows, pl.ds(pc * _COLS, _COLS)],
                                    self.codes_smem.at[slot, pc, dst], barrier)
        if dst.size == mla.BLOCK_TOKENS:
            plgpu.copy_gmem_to_smem(self.sz_ref.at[page, :, :, rows], self.sz_smem.at[slot],
                                    barrier)
            return
        # A piece of a step: its tokens are a slice of every (scale | zero, group) row.
        for k in range(2):
            for g in range(self.sz_smem.shape[2]):
                plgpu.copy_gmem_to_smem(self.sz_ref.at[page, k, g, rows],
                                        self.sz_smem.at[slot, k, g, dst], barrier)

    def convert(self, slot, step, wg, length):
        """Writes warpgroup `wg`'s half of the step's latent, dequantized, to the tile."""
        d_c = self.lat_smem.shape[-1]
        half = d_c // 2
        packed = d_c * self.bits // 8
        mask = (1 << self.bits) - 1
        dtype = self.lat_smem.dtype
        layout = plgpu.Layout.WGMMA
        rows_l = layout.reduce(1)
        load = functools.partial(mgpu.load, interpret=self.interpret)
        row = mgpu.broadcasted_iota(jnp.int32, (mla.BLOCK_TOKENS, _COLS), 0, layout=layout,
                                    interpret=self.interpret)
        seen = row < length - step * mla.BLOCK_TOKENS

        def half_cols(first):
            for c0 in range(first, first + half, _COLS):
                field, byte = divmod(c0, packed)
                g = c0 // self.group
                codes = load(self.codes_smem.at[slot, byte // _COLS], layout).astype(jnp.int32)
                x = _to_float((codes >> (field * self.bits)) & mask, dtype, self.bits)
                s = load(self.sz_smem.at[slot, 0, g], rows_l).astype(jnp.float32)
                z = load(self.sz_smem.at[slot, 1, g], rows_l).astype(jnp.float32)
                x = (x.astype(jnp.float32) * jax.lax.broadcast_in_dim(s, x.shape, [0])
                     + jax.lax.broadcast_in_dim(z, x.shape, [0]))
                self.lat_smem.at[0, :, pl.ds(c0, _COLS)][...] = jnp.where(
                    seen, x, 0.0).astype(dtype)

        # Static column ranges: one branch per warpgroup.
        for w in range(2):
            pl.when(wg == w)(functools.partial(half_cols, w * half))


def _kernel(hi_ref, tables_ref, ql_ref, qr_ref, codes_ref, sz_ref, rope_ref, out_ref, lse_ref,
            q_smem, qr_smem, lat_smem, rope_smem, p_smem, rows_smem, q_bar, kv_bar, kv_free,
            x_bar, codes_smem, sz_smem, *, bits, group, scale, num_splits, page_size,
            num_stages, interpret):
    latent = _Latent(codes_ref, sz_ref, codes_smem, sz_smem, lat_smem, bits=bits, group=group,
                     interpret=interpret)
    mla._kernel(hi_ref, tables_ref, ql_ref, qr_ref, None, rope_ref, out_ref, lse_ref, q_smem,
                qr_smem, lat_smem, rope_smem, p_smem, rows_smem, q_bar, kv_bar, kv_free, x_bar,
                scale=scale, num_splits=num_splits, page_size=page_size, interpret=interpret,
                num_stages=num_stages, latent=latent)


@functools.partial(jax.jit, static_argnames=("bits", "scale", "num_sms", "interpret"))
def _pages(q_latent, q_rope, c_codes, c_scale, c_zero, rope_pages, quant_lengths,
           block_tables, q_pos, *, bits, scale, num_sms, interpret):
    batch, _, q_heads, d_c = q_latent.shape
    d_rope = q_rope.shape[-1]
    _, page_size, packed = c_codes.shape
    groups = c_scale.shape[-1]
    dtype = rope_pages.dtype
    bh, bt = mla.BLOCK_HEADS, mla.BLOCK_TOKENS
    heads_p = -(-q_heads // bh) * bh
    head_blocks = heads_p // bh
    max_pages = block_tables.shape[1]
    splits = mla.choose_num_splits(batch, head_blocks, -(-max_pages * page_size // bt), num_sms)
    stages = _stages(d_c, bits)
    piece = min(page_size, bt)
    pieces = bt // piece
    sz_copies = 1 if piece == bt else 2 * groups

    pad = ((0, 0), (0, heads_p - q_heads), (0, 0))
    ql = jnp.pad(q_latent[:, 0].astype(dtype), pad)
    qr = jnp.pad(q_rope[:, 0].astype(dtype), pad)
    sz = jnp.stack([c_scale, c_zero], axis=1).swapaxes(-1, -2)  # [pages, 2, groups, ps]
    _, hi = c.visit_bounds(q_pos, quant_lengths, max_pages * page_size, None)
    sdt = c_scale.dtype
    codes_smem = plgpu.SMEM((stages, packed // _COLS, bt, _COLS), jnp.uint8, transforms=(
        plgpu.TilingTransform((8, _COLS)), plgpu.SwizzleTransform(_COLS)))
    kernel = plgpu.kernel(
        functools.partial(_kernel, bits=bits, group=d_c // groups, scale=scale,
                          num_splits=splits, page_size=page_size, num_stages=stages,
                          interpret=interpret),
        out_type=(
            jax.ShapeDtypeStruct((splits, batch, heads_p, d_c), jnp.float32),
            jax.ShapeDtypeStruct((splits, batch, heads_p), jnp.float32),
        ),
        scratch_types=(
            mla._swizzled((bh, d_c), dtype),
            mla._swizzled((bh, d_rope), dtype),
            mla._swizzled((1, bt, d_c), dtype),  # the converted tile
            mla._swizzled((stages, bt, d_rope), dtype),
            mla._swizzled((2, bh, bt // 2), dtype),
            plgpu.SMEM((4, bh), jnp.float32),
            plgpu.Barrier(num_arrivals=2),
            plgpu.Barrier(num_arrivals=pieces * (packed // _COLS + sz_copies + 1),
                          num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2),
            codes_smem,
            plgpu.SMEM((stages, 2, groups, bt), sdt),
        ),
        grid=(batch, splits, head_blocks),
        grid_names=("batch", "split", "heads"),
        num_threads=3,
        thread_name="wg",
        kernel_name=f"kvjax_kivi_mla_decode_mosaic_gpu_b{bits}_h{heads_p}_p{page_size}",
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0,
                                              lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret,
    )
    out, lse = kernel(hi, block_tables.astype(jnp.int32), ql, qr, c_codes, sz, rope_pages)
    out, lse = merge_splits(out, lse)
    return out[:, None, :q_heads], lse[:, None, :q_heads]


def quantized_mla_pages_attention(
    q_latent: Float[Array, "batch q_len q_heads d_c"],
    q_rope: Float[Array, "batch q_len q_heads d_rope"],
    c_codes: UInt8[Array, "pages page_size c_packed"],
    c_scale: Float[Array, "pages page_size c_groups"],
    c_zero: Float[Array, "pages page_size c_groups"],
    rope_pages: Float[Array, "pages page_size d_rope"],
    quant_lengths: Int[Array, " batch"],
    block_tables: Int[Array, "batch max_pages"],
    q_pos: Int[Array, "batch q_len"],
    *,
    bits: int,
    scale: float,
    num_sms: int = mgpu.H100_NUM_SMS,
    interpret: Any = False,
) -> tuple[Float[Array, "batch q_len q_heads d_c"], Float[Array, "batch q_len q_heads"]]:
    """The Mosaic GPU kernel for `reference.quantized_mla_pages_attention` (decode rows).

    Args:
      q_latent ... scale: as in the reference; q_len must be 1. The queries are rounded to
        rope_pages' dtype (bfloat16 or float16) for the tensor cores, and so is the
        dequantized latent; accumulation in float32.
      num_sms: SMs of the target GPU, for the split count (132 on H100 and H200); static.
      interpret: False to compile for the GPU; True, or
        `kernels_pallas._mosaic_gpu.interpret_params(...)`, to run Mosaic GPU's interpreter.

    Returns:
      (out float32 [batch, 1, q_heads, d_c], lse float32 [batch, 1, q_heads]).

    Raises:
      ValueError / TypeError: on arguments the reference refuses, or shapes this kernel does
        not take (`unsupported_reason`), before tracing.
    """
    op = "quantized_mla_pages_attention[mosaic_gpu]"
    c.check_mla_pages(op, q_latent, q_rope, c_codes, c_scale, c_zero, rope_pages,
                      quant_lengths, block_tables, q_pos, bits)
    reason = unsupported_reason(q_latent, q_rope, c_codes, c_scale, c_zero, rope_pages,
                                bits=bits)
    if reason is not None:
        raise ValueError(f"{op}: {reason} Use the Triton kernel (gpu.py) for these shapes.")
    if not scale > 0:
        raise ValueError(f"{op}: scale must be positive, got {scale}.")
    if not isinstance(num_sms, int) or num_sms < 1:
        raise ValueError(f"{op}: num_sms must be an int >= 1, got {num_sms!r}.")
    return _pages(q_latent, q_rope, c_codes, c_scale, c_zero, rope_pages,
                  quant_lengths.astype(jnp.int32), block_tables, q_pos.astype(jnp.int32),
                  bits=bits, scale=float(scale), num_sms=num_sms,
                  interpret=mgpu.resolve_interpret(interpret))


def quantized_mla_attention(
    q_latent, q_rope, c_codes, c_scale, c_zero, rope_pages, tail_c, tail_rope, quant_lengths,
    lengths, block_tables, q_pos, *, bits, scale, num_sms: int = mgpu.H100_NUM_SMS,
    interpret=False,
):
    """Drop-in for `reference.quantized_mla_attention` (decode rows): the kernel's pages part
    merged with the full-precision latent tail by log-sum-exp.

    Returns:
      (out [batch, 1, q_heads, d_c] in q_latent's dtype, lse float32 [batch, 1, q_heads]).
    """
    out_q, lse_q = quantized_mla_pages_attention(
        q_latent, q_rope, c_codes, c_scale, c_zero, rope_pages, quant_lengths, block_tables,
        q_pos, bits=bits, scale=scale, num_sms=num_sms, interpret=interpret)
    return qref.mla_merge_with_tail(out_q, lse_q, q_latent, q_rope, tail_c, tail_rope,
                                    quant_lengths, lengths, q_pos, scale=scale)
