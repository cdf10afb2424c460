"""Attention over KIVI-quantized pages as Pallas GPU (Triton) kernels (GQA/MQA/MHA and MLA).

Same entry points and contract as `tpu.py` (drop-ins for the reference's
`quantized_[mla_]pages_attention` and `quantized_[mla_]attention`; the tail is
attended and merged with the reference's jnp code).

Design (the full-precision kernel `kernels_pallas/paged_attention/gpu.py`,
reading packed codes instead of pages):
  * grid = (batch, kv_heads x head blocks, splits): a sequence's pages are
    split into contiguous ranges (split-K), each program writes a partial
    output and log-sum-exp, merged afterwards;
  * the queries of one KV head are rows (query t, head g at row t * group + g),
    padded to a power of two >= 16 (tl.dot's minimum), each with its own
    position (decode and chunked prefill share the kernel);
  * each inner step gathers the codes, scales and zeros of `block_tokens /
    page_size` pages through the block table (entries outside the row's
    visited range are replaced by page 0 before use and masked);
  * dequantization in registers, one bit field at a time: slice i of a b-bit
    part is `(bytes >> i*b) & mask` = channels [i*W/k, (i+1)*W/k) (`layout.py`)
    times its scale plus its zero; logits sum q_i . k_i over slices and the
    output keeps one accumulator per slice (p @ v_i);
  * online softmax in float32 with per-row masks. With 16-bit queries (a bf16 or f16
    model) both dots take 16-bit operands: the dequantized slices and the
    probabilities are rounded to the query's dtype, as the full-precision kernel's
    pages and probabilities are, and run on the tensor cores with float32
    accumulation. With float32 queries the dots run at HIGHEST precision (IEEE
    float32: scales are float16, dequantized values need all 24 bits), which is
    exact but several times slower.

Restrictions (raised before tracing): power-of-two page size and widths, and
a slice width W * bits / 8 of at least 16 (tl.dot's minimum operand size).
Checked in Pallas' interpret mode, by lowering to Triton from CPU
(tests/kernels/test_quantized_kernels.py), and compiled and timed on an H200
(docs/performance.md, "Pallas kernels on a GPU": correct; with bf16 queries int4 is about
as fast as the bf16 kernel, not yet the 0.3x its bytes allow).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int, UInt8

from kernels_pallas.merge import merge_splits
from kernels_pallas.paged_attention.block_sizes import (
    BlockSizes,
    check_head_dim,
    check_table_width,
    resolve_block_sizes,
)
from kernels_pallas.paged_attention.gpu import check_page_size, choose_num_splits
from kernels_pallas.quantized_attention import _common as c
from kernels_pallas.quantized_attention import reference as qref

__all__ = [
    "quantized_pages_attention",
    "quantized_attention",
    "quantized_mla_pages_attention",
    "quantized_mla_attention",
    "BlockSizes",
]

NEG_INF = float("-inf")
_MIN_DOT = 16


def _kernel(
    lo_ref,  # [1]
    hi_ref,  # [1]
    tables_ref,  # [pages_per_split]
    qpos_ref,  # [block_rows]
    *refs,
    key_parts: tuple[c.Part, ...],
    value_part: c.Part | None,
    pages_per_block: int,
    pages_per_split: int,
    scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    dot_dtype,
):
    nk = len(key_parts)
    parts = list(key_parts) + ([] if value_part is None else [value_part])
    n_pools = sum(p.num_pools for p in parts)
    q_refs = refs[:nk]  # [block_rows, width_i]
    pools = refs[nk:nk + n_pools]  # [pages, rows_j, cols_j]
    o_ref, lse_ref = refs[nk + n_pools:]  # [block_rows, dv], [block_rows]
    part_pools, j = [], 0
    for p in parts:
        part_pools.append(pools[j:j + p.num_pools])
        j += p.num_pools

    split = pl.program_id(2)
    page_size = pools[0].shape[1]
    ppb = pages_per_block
    bk = ppb * page_size
    lo, hi = lo_ref[0], hi_ref[0]
    split_page0 = split * pages_per_split
    p_lo = jnp.clip(lo // page_size - split_page0, 0, pages_per_split)  # split-relative
    p_hi = jnp.clip(pl.cdiv(hi, page_size) - split_page0, 0, pages_per_split)
    qpos = qpos_ref[...]
    rows = qpos.shape[0]
    vpart = key_parts[0] if value_part is None else value_part
    n_acc = vpart.num_slices
    wv = vpart.slice_width
    exact = dot_dtype == jnp.float32
    precision = c.HIGHEST if exact else jax.lax.Precision.DEFAULT

    def part_slices(part, refs3, pages):
        if part.kind == "plain":
            return [c.f32(refs3[0][pages]).reshape(bk, part.width)]
        codes = refs3[0][pages].astype(jnp.int32).reshape(bk, part.slice_width)
        out = []
        for i in range(part.num_slices):
            start, size = c.slice_scale_window(part, i)
            s = c.f32(refs3[1][pages, :, pl.ds(start, size)])
            z = c.f32(refs3[2][pages, :, pl.ds(start, size)])
            out.append(c.dequantize_slice(part, i, codes, s, z))
        return out

    qs = [[q_ref[:, pl.ds(i * p.slice_width, p.slice_width)].astype(dot_dtype)
           for i in range(p.num_slices)] for p, q_ref in zip(key_parts, q_refs, strict=True)]

    def body(blk, carry):
        m_prev, l_prev, accs = carry
        rel = blk * ppb + jnp.arange(ppb, dtype=jnp.int32)
        pages = tables_ref[pl.ds(blk * ppb, ppb)]
        pages = jnp.where((rel >= p_lo) & (rel < p_hi), pages, 0)
        s = None
        key0 = None
        for pi, part in enumerate(key_parts):
            ks = part_slices(part, part_pools[pi], pages)
            if pi == 0:
                key0 = ks
            for qi, k in zip(qs[pi], ks, strict=True):
                d = plgpu.dot(qi, k.astype(dot_dtype), trans_b=True, precision=precision)
                s = d if s is None else s + d
        s = s * jnp.float32(scale)
        if soft_cap is not None:
            s = jnp.float32(soft_cap) * jnp.tanh(s / jnp.float32(soft_cap))
        kpos = (split_page0 + blk * ppb) * page_size + jnp.arange(bk, dtype=jnp.int32)
        in_range = (kpos >= lo) & (kpos < hi)
        visible = in_range[None, :] & (kpos[None, :] <= qpos[:, None]) & (qpos[:, None] >= 0)
        if sliding_window is not None:
            visible &= qpos[:, None] - kpos[None, :] < sliding_window
        s = jnp.where(visible, s, NEG_INF)
        # Per-row masks can leave a row without a visible key in this block.
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
        m_use = jnp.where(m_new == NEG_INF, 0.0, m_new)
        alpha = jnp.exp(m_prev - m_use)
        p = jnp.exp(s - m_use[:, None])
        l_new = alpha * l_prev + jnp.sum(p, axis=1)
        vs = key0 if value_part is None else part_slices(value_part, part_pools[-1], pages)
        new_accs = []
        p_dot = p.astype(dot_dtype)
        for acc, v in zip(accs, vs, strict=True):
            v = jnp.where(in_range[:, None], v, 0.0).astype(dot_dtype)
            new_accs.append(alpha[:, None] * acc + plgpu.dot(p_dot, v, precision=precision))
        return m_new, l_new, tuple(new_accs)

    init = (
        jnp.full((rows,), NEG_INF, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        tuple(jnp.zeros((rows, wv), jnp.float32) for _ in range(n_acc)),
    )
    m, l_sum, accs = jax.lax.fori_loop(p_lo // ppb, pl.cdiv(p_hi, ppb), body, init)
    seen = l_sum > 0.0
    safe = jnp.where(seen, l_sum, 1.0)
    for i, acc in enumerate(accs):
        o_ref[:, pl.ds(i * wv, wv)] = jnp.where(seen[:, None], acc / safe[:, None], 0.0)
    lse_ref[...] = jnp.where(seen, m + jnp.log(safe), NEG_INF)


@functools.partial(
    jax.jit,
    static_argnames=("key_parts", "value_part", "scale", "soft_cap", "sliding_window",
                     "block_sizes", "interpret", "name"),
)
def _pages_gpu(
    qs,  # tuple of [batch, kv_heads, rows, width_i]
    pools,  # tuple of [kv_heads, pages, rows_j, cols_j], in part order
    q_pos,  # i32[batch, q_len]
    quant_lengths,  # i32[batch]
    block_tables,  # i32[batch, max_pages]
    *,
    key_parts, value_part, scale, soft_cap, sliding_window, block_sizes, interpret, name,
):
    """Shared body; returns (out f32 [batch, kv_heads, rows, dv], lse f32 [batch, kv_heads,
    rows])."""
    batch, kv_heads, rows, _ = qs[0].shape
    num_pool_pages, page_size = pools[0].shape[1:3]
    ppb = block_sizes.block_tokens // page_size
    max_pages = block_tables.shape[1]
    lo, hi = c.visit_bounds(q_pos, quant_lengths.astype(jnp.int32), max_pages * page_size,
                            sliding_window)
    qpos_rows = c.row_positions(q_pos, rows // q_pos.shape[1])
    rows_p = max(_MIN_DOT, pl.next_power_of_2(rows))
    bh = min(block_sizes.block_heads, rows_p)
    n_hb = rows_p // bh
    num_blocks = pl.cdiv(max_pages, ppb)
    splits = block_sizes.num_splits or choose_num_splits(batch, kv_heads * n_hb, num_blocks)
    splits = min(splits, num_blocks)
    blocks_per_split = pl.cdiv(num_blocks, splits)
    splits = pl.cdiv(num_blocks, blocks_per_split)
    pps = blocks_per_split * ppb
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, splits * pps - max_pages)))
    # Padding rows sit at position -1: fully masked, sliced off below.
    qpos_rows = jnp.pad(qpos_rows, ((0, 0), (0, rows_p - rows)), constant_values=-1)
    qs = tuple(jnp.pad(q, ((0, 0), (0, 0), (0, rows_p - rows), (0, 0))) for q in qs)
    dv = (key_parts[0] if value_part is None else value_part).width

    in_specs = [
        pl.BlockSpec((1,), lambda b, i, s: (b,)),
        pl.BlockSpec((1,), lambda b, i, s: (b,)),
        pl.BlockSpec((None, pps), lambda b, i, s: (b, s)),
        pl.BlockSpec((None, bh), lambda b, i, s: (b, i % n_hb)),
    ]
    in_specs += [pl.BlockSpec((None, None, bh, q.shape[-1]),
                              lambda b, i, s: (b, i // n_hb, i % n_hb, 0)) for q in qs]
    in_specs += [pl.BlockSpec((None, num_pool_pages) + p.shape[2:],
                              lambda b, i, s: (i // n_hb, 0, 0, 0)) for p in pools]
    # 16-bit queries: 16-bit tensor-core dots; float32 queries: exact float32 dots.
    q_dtype = qs[0].dtype
    dot_dtype = q_dtype if q_dtype in (jnp.bfloat16, jnp.float16) else jnp.float32
    kernel = functools.partial(
        _kernel, key_parts=key_parts, value_part=value_part, pages_per_block=ppb,
        pages_per_split=pps, scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
        dot_dtype=jnp.dtype(dot_dtype),
    )
    out, lse = pl.pallas_call(
        kernel,
        grid=(batch, kv_heads * n_hb, splits),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, None, bh, dv),
                         lambda b, i, s: (s, b, i // n_hb, i % n_hb, 0)),
            pl.BlockSpec((None, None, None, bh), lambda b, i, s: (s, b, i // n_hb, i % n_hb)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((splits, batch, kv_heads, rows_p, dv), jnp.float32),
            jax.ShapeDtypeStruct((splits, batch, kv_heads, rows_p), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(
            num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages
        ),
        interpret=interpret,
        name=name,
    )(lo, hi, tables, qpos_rows, *qs, *pools)
    out, lse = merge_splits(out, lse)
    return out[:, :, :rows], lse[:, :, :rows]


def _check_gpu_part(op, name, part):
    check_head_dim(op, name, part.width, "gpu")
    if part.kind == "quant" and part.slice_width < _MIN_DOT:
        raise ValueError(
            f"{op}: {name} = {part.width} at {part.bits} bits gives {part.slice_width}-channel "
            f"slices; the GPU kernel needs at least {_MIN_DOT} (tl.dot's smallest operand). "
            f"Use impl='xla' for this shape."
        )
    if part.kind == "quant" and part.group & (part.group - 1):
        raise ValueError(f"{op}: {name}: the GPU kernel needs a power-of-two group size, got "
                         f"{part.group}.")


def quantized_pages_attention(
    q: Float[Array, "batch q_len q_heads head_dim"],
    k_codes: UInt8[Array, "kv_heads pages page_size k_packed"],
    k_scale: Float[Array, "kv_heads pages k_srows head_dim"],
    k_zero: Float[Array, "kv_heads pages k_srows head_dim"],
    v_codes: UInt8[Array, "kv_heads pages page_size v_packed"],
    v_scale: Float[Array, "kv_heads pages page_size v_groups"],
    v_zero: Float[Array, "kv_heads pages page_size v_groups"],
    quant_lengths: Int[Array, " batch"],
    block_tables: Int[Array, "batch max_pages"],
    q_pos: Int[Array, "batch q_len"],
    *,
    k_bits: int,
    v_bits: int,
    scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    block_sizes: BlockSizes | None = None,
    max_pages: int | None = None,
    interpret: bool = False,
) -> tuple[Float[Array, "batch q_len q_heads v_head_dim"], Float[Array, "batch q_len q_heads"]]:
    """The GPU kernel for `reference.quantized_pages_attention` (same arguments and results).

    Args:
      q ... sliding_window: as in the reference.
      block_sizes: tiling and split-K (`paged_attention.block_sizes.BlockSizes`); None picks
        the GPU defaults.
      max_pages: the declared maximum pages per sequence; a wider block table raises.
      interpret: run in Pallas' interpret mode (any backend).

    Returns:
      (out float32 [batch, q_len, q_heads, v_head_dim], lse float32 [batch, q_len, q_heads]).

    Raises:
      ValueError / TypeError: on inconsistent shapes, bits or dtypes, widths or page sizes the
        Triton kernel cannot tile, or a block table wider than `max_pages`; before tracing.
    """
    op = "quantized_pages_attention[gpu]"
    kp, vp = c.check_gqa_pages(op, q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                               quant_lengths, block_tables, q_pos, k_bits, v_bits)
    _check_gpu_part(op, "head_dim", kp)
    _check_gpu_part(op, "v_head_dim", vp)
    page_size = k_codes.shape[2]
    check_page_size(op, page_size)
    check_table_width(op, block_tables.shape, max_pages, "gpu")
    bs = resolve_block_sizes(op, "gpu", block_sizes, page_size, block_tables.shape[1])
    q_len, q_heads = q.shape[1:3]
    kv_heads = k_codes.shape[0]
    out, lse = _pages_gpu(
        (c.fold_queries(q, kv_heads),), (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero),
        q_pos, quant_lengths, block_tables,
        key_parts=(kp,), value_part=vp, scale=float(scale),
        soft_cap=None if soft_cap is None else float(soft_cap), sliding_window=sliding_window,
        block_sizes=bs, interpret=interpret,
        name=f"kvjax_quant_pages_gpu_k{k_bits}v{v_bits}_bt{bs.block_tokens}",
    )
    return c.unfold(out, lse, q_len)


def quantized_attention(
    q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, tail_k, tail_v, quant_lengths,
    lengths, block_tables, q_pos, *, k_bits, v_bits, scale, soft_cap=None, sliding_window=None,
    block_sizes: BlockSizes | None = None, max_pages: int | None = None,
    interpret: bool = False,
):
    """Drop-in for `reference.quantized_attention`: the kernel's pages part merged with the tail.

    Returns:
      (out [batch, q_len, q_heads, v_head_dim] in q's dtype, lse float32 [batch, q_len,
      q_heads]).
    """
    opts = dict(scale=scale, soft_cap=soft_cap, sliding_window=sliding_window)
    out_q, lse_q = quantized_pages_attention(
        q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, quant_lengths, block_tables,
        q_pos, k_bits=k_bits, v_bits=v_bits, block_sizes=block_sizes, max_pages=max_pages,
        interpret=interpret, **opts)
    return qref.merge_with_tail(out_q, lse_q, q, tail_k, tail_v, quant_lengths, lengths, q_pos,
                                **opts)


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
    block_sizes: BlockSizes | None = None,
    max_pages: int | None = None,
    interpret: bool = False,
) -> tuple[Float[Array, "batch q_len q_heads d_c"], Float[Array, "batch q_len q_heads"]]:
    """The GPU kernel for `reference.quantized_mla_pages_attention` (key [c_KV, k_rope],
    value c_KV); options as in `quantized_pages_attention`."""
    op = "quantized_mla_pages_attention[gpu]"
    cp, rp = c.check_mla_pages(op, q_latent, q_rope, c_codes, c_scale, c_zero, rope_pages,
                               quant_lengths, block_tables, q_pos, bits)
    if not scale > 0:
        raise ValueError(f"{op}: scale must be positive, got {scale}.")
    _check_gpu_part(op, "d_c", cp)
    _check_gpu_part(op, "d_rope", rp)
    page_size = c_codes.shape[1]
    check_page_size(op, page_size)
    check_table_width(op, block_tables.shape, max_pages, "gpu")
    bs = resolve_block_sizes(op, "gpu", block_sizes, page_size, block_tables.shape[1])
    q_len = q_latent.shape[1]
    out, lse = _pages_gpu(
        (c.fold_queries(q_latent, 1), c.fold_queries(q_rope, 1)),
        (c_codes[None], c_scale[None], c_zero[None], rope_pages[None]),
        q_pos, quant_lengths, block_tables,
        key_parts=(cp, rp), value_part=None, scale=float(scale), soft_cap=None,
        sliding_window=None, block_sizes=bs, interpret=interpret,
        name=f"kvjax_quant_mla_pages_gpu_b{bits}_bt{bs.block_tokens}",
    )
    return c.unfold(out, lse, q_len)


def quantized_mla_attention(
    q_latent, q_rope, c_codes, c_scale, c_zero, rope_pages, tail_c, tail_rope, quant_lengths,
    lengths, block_tables, q_pos, *, bits, scale, block_sizes: BlockSizes | None = None,
    max_pages: int | None = None, interpret: bool = False,
):
    """Drop-in for `reference.quantized_mla_attention` (kernel pages part + jnp tail, merged).

    Returns:
      (out in latent space [batch, q_len, q_heads, d_c] in q_latent's dtype, lse float32).
    """
    out_q, lse_q = quantized_mla_pages_attention(
        q_latent, q_rope, c_codes, c_scale, c_zero, rope_pages, quant_lengths, block_tables,
        q_pos, bits=bits, scale=scale, block_sizes=block_sizes, max_pages=max_pages,
        interpret=interpret)
    return qref.mla_merge_with_tail(out_q, lse_q, q_latent, q_rope, tail_c, tail_rope,
                                    quant_lengths, lengths, q_pos, scale=scale)
