"""Attention over KIVI-quantized pages as Pallas TPU kernels (GQA/MQA/MHA and MLA).

`quantized_pages_attention` / `quantized_mla_pages_attention` have the
signatures of the reference's (`reference.py`) plus kernel options, and
`quantized_attention` / `quantized_mla_attention` are drop-ins for the
reference's: the kernel computes the quantized pages' part and the
full-precision tail (at most R + page_size tokens per sequence) is attended
and merged by log-sum-exp with the reference's jnp code.

Design (the full-precision kernel `kernels_pallas/paged_attention/tpu.py`,
reading packed codes instead of pages):
  * grid = (batch, kv_heads), both "parallel"; every step starts and waits for
    its own DMAs;
  * the token range each row must read ([lo, hi): below the quantized length,
    up to its last query, from the sliding window's start) and the flattened
    block tables are scalar-prefetched into SMEM;
  * codes, scales and zeros stay in HBM (`memory_space=pl.ANY`); per inner
    step the kernel copies the codes, scales and zeros of `block_tokens /
    page_size` pages with `pltpu.make_async_copy`, double-buffered;
  * the queries of one KV head are rows (query t, head g at row t * group + g),
    each with its own position: decode (q_len 1) and chunked prefill share the
    kernel; more than `MAX_BLOCK_ROWS` rows (long prefill chunks) are split
    over a third grid axis, each row block re-reading the pages, to bound VMEM;
  * dequantization in VMEM/vregs, one bit field at a time: slice i of a
    b-bit part is `(bytes >> i*b) & mask`, the channels [i*W/k, (i+1)*W/k)
    (`layout.py`), times its scale plus its zero, broadcast over the group;
    logits are summed over slices (q_i . k_i) and the output is accumulated
    per slice (p @ v_i into acc[:, slice i]); no unpacked concatenation;
  * online softmax in float32 with per-row masks (causal, sliding window,
    quantized length); dots at HIGHEST precision (scales are float16, which
    a single bf16 MXU pass would round).

Table entries outside [lo, hi) are never read; the VMEM of pages not copied
holds stale data (NaN in the TPU interpreter), removed with `jnp.where`.
Checked in both interpreters; lowering to Mosaic is checked from CPU in
tests/kernels/test_quantized_kernels.py (not compiled by libtpu nor timed on
a TPU yet).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int, UInt8

from kernels_pallas.paged_attention.block_sizes import (
    BlockSizes,
    check_head_dim,
    check_table_width,
    resolve_block_sizes,
)
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
# Query rows per grid step: a [rows, head_dim] f32 query, accumulator and output
# tile are 128 KiB each at 256 x 128.
MAX_BLOCK_ROWS = 256


def _kernel(
    lo_ref,  # SMEM i32[batch]
    hi_ref,  # SMEM i32[batch]
    tables_ref,  # SMEM i32[batch * padded_max_pages]
    qpos_ref,  # VMEM i32[rows, 1]
    *refs,
    key_parts: tuple[c.Part, ...],
    value_part: c.Part | None,
    pages_per_block: int,
    padded_max_pages: int,
    scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
):
    nk = len(key_parts)
    parts = list(key_parts) + ([] if value_part is None else [value_part])
    n_pools = sum(p.num_pools for p in parts)
    q_refs = refs[:nk]  # VMEM [rows, width_i]
    pools = refs[nk:nk + n_pools]  # HBM [heads, pages, rows_j, cols_j]
    o_ref, lse_ref, acc_ref = refs[nk + n_pools:nk + n_pools + 3]
    bufs = refs[nk + n_pools + 3:nk + 2 * n_pools + 3]  # VMEM [2, ppb, rows_j, cols_j]
    sems = refs[nk + 2 * n_pools + 3]  # DMA [n_pools, 2]

    # Buffers of each part, in pool order.
    part_bufs, j = [], 0
    for p in parts:
        part_bufs.append(bufs[j:j + p.num_pools])
        j += p.num_pools

    b = pl.program_id(0)
    h = pl.program_id(1)  # grid axis 2 (row blocks) only selects the q / qpos / out blocks
    page_size = pools[0].shape[2]
    ppb = pages_per_block
    bk = ppb * page_size
    lo, hi = lo_ref[b], hi_ref[b]
    first_page = lo // page_size
    num_pages = pl.cdiv(hi, page_size)
    start_blk = lo // bk
    end_blk = pl.cdiv(hi, bk)

    def for_each_page_copy(blk, slot, action):
        p_lo = jnp.maximum(blk * ppb, first_page)
        p_hi = jnp.minimum((blk + 1) * ppb, num_pages)

        def one_page(pos, carry):
            page = tables_ref[b * padded_max_pages + pos]
            for i, (pool, buf) in enumerate(zip(pools, bufs, strict=True)):
                action(pltpu.make_async_copy(
                    pool.at[h, page], buf.at[slot, pos - blk * ppb], sems.at[i, slot]
                ))
            return carry

        jax.lax.fori_loop(p_lo, p_hi, one_page, 0)

    @pl.when(end_blk > start_blk)
    def _():
        for_each_page_copy(start_blk, 0, lambda cp: cp.start())

    rows = q_refs[0].shape[0]
    qpos = qpos_ref[...]  # [rows, 1]
    dims_qk = (((1,), (1,)), ((), ()))
    dims_pv = (((1,), (0,)), ((), ()))

    def part_slices(part, pbufs, slot):
        """float32 [bk, w] values of each slice of a part for the current block."""
        if part.kind == "plain":
            return [c.f32(pbufs[0][slot]).reshape(bk, part.width)]
        codes = pbufs[0][slot].astype(jnp.int32).reshape(bk, part.slice_width)
        out = []
        for i in range(part.num_slices):
            start, size = c.slice_scale_window(part, i)
            s = c.f32(pbufs[1][slot, :, :, pl.ds(start, size)])
            z = c.f32(pbufs[2][slot, :, :, pl.ds(start, size)])
            out.append(c.dequantize_slice(part, i, codes, s, z))
        return out

    def body(blk, carry):
        m_prev, l_prev = carry
        slot = (blk - start_blk) % 2

        @pl.when(blk + 1 < end_blk)
        def _():
            for_each_page_copy(blk + 1, 1 - slot, lambda cp: cp.start())

        for_each_page_copy(blk, slot, lambda cp: cp.wait())

        s = None
        key0 = None
        for pi, (part, q_ref) in enumerate(zip(key_parts, q_refs, strict=True)):
            ks = part_slices(part, part_bufs[pi], slot)
            if pi == 0:
                key0 = ks
            w = part.slice_width
            for i, k in enumerate(ks):
                qi = c.f32(q_ref[:, pl.ds(i * w, w)])
                d = jax.lax.dot_general(qi, k, dims_qk, precision=c.HIGHEST,
                                        preferred_element_type=jnp.float32)
                s = d if s is None else s + d
        s = s * jnp.float32(scale)
        if soft_cap is not None:
            s = jnp.float32(soft_cap) * jnp.tanh(s / jnp.float32(soft_cap))
        kpos = blk * bk + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
        visible = (kpos >= lo) & (kpos < hi) & (kpos <= qpos) & (qpos >= 0)
        if sliding_window is not None:
            visible &= qpos - kpos < sliding_window
        s = jnp.where(visible, s, NEG_INF)  # [rows, bk]

        # A row may see nothing in a block (causal / window masks are per row):
        # exponentiate against a finite max so no -inf - -inf appears.
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        m_use = jnp.where(m_new == NEG_INF, 0.0, m_new)
        alpha = jnp.exp(m_prev - m_use)
        p = jnp.exp(s - m_use)
        l_new = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)

        vpart = key_parts[0] if value_part is None else value_part
        vs = key0 if value_part is None else part_slices(value_part, part_bufs[-1], slot)
        kcol = blk * bk + jax.lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
        in_range = (kcol >= lo) & (kcol < hi)
        w = vpart.slice_width
        for i, v in enumerate(vs):
            v = jnp.where(in_range, v, 0.0)  # stale VMEM of pages not copied
            pv = jax.lax.dot_general(p, v, dims_pv, precision=c.HIGHEST,
                                     preferred_element_type=jnp.float32)
            acc_ref[:, pl.ds(i * w, w)] = alpha * acc_ref[:, pl.ds(i * w, w)] + pv
        return m_new, l_new

    acc_ref[...] = jnp.zeros_like(acc_ref)
    init = (jnp.full((rows, 1), NEG_INF, jnp.float32), jnp.zeros((rows, 1), jnp.float32))
    m, l_sum = jax.lax.fori_loop(start_blk, end_blk, body, init)
    seen = l_sum > 0.0
    safe = jnp.where(seen, l_sum, 1.0)
    o_ref[...] = jnp.where(seen, acc_ref[...] / safe, 0.0)
    lse_ref[...] = jnp.where(seen, m + jnp.log(safe), NEG_INF)


@functools.partial(
    jax.jit,
    static_argnames=("key_parts", "value_part", "scale", "soft_cap", "sliding_window",
                     "block_tokens", "interpret", "name"),
)
def _pages_tpu(
    qs,  # tuple of [batch, kv_heads, rows, width_i]
    pools,  # tuple of [kv_heads, pages, rows_j, cols_j], in part order
    q_pos,  # i32[batch, q_len]
    quant_lengths,  # i32[batch]
    block_tables,  # i32[batch, max_pages]
    *,
    key_parts, value_part, scale, soft_cap, sliding_window, block_tokens, interpret, name,
):
    """Shared body; returns (out f32 [batch, kv_heads, rows, dv], lse f32 [batch, kv_heads,
    rows])."""
    batch, kv_heads, rows, _ = qs[0].shape
    q_len = q_pos.shape[1]
    page_size = pools[0].shape[2]
    ppb = block_tokens // page_size
    max_pages = block_tables.shape[1]
    padded = pl.cdiv(max_pages, ppb) * ppb
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, padded - max_pages)))
    lo, hi = c.visit_bounds(q_pos, quant_lengths.astype(jnp.int32), max_pages * page_size,
                            sliding_window)
    qpos_rows = c.row_positions(q_pos, rows // q_len)[..., None]
    dv = (key_parts[0] if value_part is None else value_part).width
    # Row blocks: padding rows sit at position -1 (fully masked) and are sliced off.
    br = min(rows, MAX_BLOCK_ROWS)
    n_rb = pl.cdiv(rows, br)
    rows_p = n_rb * br
    qpos_rows = jnp.pad(qpos_rows, ((0, 0), (0, rows_p - rows), (0, 0)), constant_values=-1)
    qs = tuple(jnp.pad(q, ((0, 0), (0, 0), (0, rows_p - rows), (0, 0))) for q in qs)

    in_specs = [pl.BlockSpec((None, br, 1), lambda b, h, r, *_: (b, r, 0))]
    in_specs += [pl.BlockSpec((None, None, br, q.shape[-1]), lambda b, h, r, *_: (b, h, r, 0))
                 for q in qs]
    in_specs += [pl.BlockSpec(memory_space=pl.ANY) for _ in pools]
    scratch = [pltpu.VMEM((br, dv), jnp.float32)]
    scratch += [pltpu.VMEM((2, ppb) + p.shape[2:], p.dtype) for p in pools]
    scratch.append(pltpu.SemaphoreType.DMA((len(pools), 2)))
    kernel = functools.partial(
        _kernel, key_parts=key_parts, value_part=value_part, pages_per_block=ppb,
        padded_max_pages=padded, scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
    )
    out, lse = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(batch, kv_heads, n_rb),
            in_specs=in_specs,
            out_specs=[
                pl.BlockSpec((None, None, br, dv), lambda b, h, r, *_: (b, h, r, 0)),
                pl.BlockSpec((None, None, br, 1), lambda b, h, r, *_: (b, h, r, 0)),
            ],
            scratch_shapes=scratch,
        ),
        out_shape=[
            jax.ShapeDtypeStruct((batch, kv_heads, rows_p, dv), jnp.float32),
            jax.ShapeDtypeStruct((batch, kv_heads, rows_p, 1), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel")),
        interpret=interpret,
        name=name,
    )(lo, hi, tables.reshape(-1), qpos_rows, *qs, *pools)
    return out[:, :, :rows], lse[:, :, :rows, 0]


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
    interpret: bool | pltpu.InterpretParams = False,
) -> tuple[Float[Array, "batch q_len q_heads v_head_dim"], Float[Array, "batch q_len q_heads"]]:
    """The TPU kernel for `reference.quantized_pages_attention` (same arguments and results).

    Args:
      q ... q_pos, k_bits, v_bits, scale, soft_cap, sliding_window: as in the reference
        (layouts in `reference.py` / `layout.py`).
      block_sizes: tiling (`block_tokens`, whole pages); None picks the TPU default.
      max_pages: the declared maximum pages per sequence; a wider block table raises.
      interpret: False on TPU; True (Pallas' interpreter) or a `pltpu.InterpretParams`
        (the TPU interpreter) elsewhere.

    Returns:
      (out float32 [batch, q_len, q_heads, v_head_dim], lse float32 [batch, q_len, q_heads]).

    Raises:
      ValueError / TypeError: on inconsistent shapes, bits or dtypes, unsupported head widths,
        or a block table wider than `max_pages` or than SMEM holds; before any tracing.
    """
    op = "quantized_pages_attention[tpu]"
    kp, vp = c.check_gqa_pages(op, q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                               quant_lengths, block_tables, q_pos, k_bits, v_bits)
    check_head_dim(op, "head_dim", kp.width, "tpu")
    check_head_dim(op, "v_head_dim", vp.width, "tpu")
    check_table_width(op, block_tables.shape, max_pages, "tpu")
    batch, q_len, q_heads, _ = q.shape
    kv_heads, _, page_size, _ = k_codes.shape
    rows = q_len * (q_heads // kv_heads)
    bs = resolve_block_sizes(op, "tpu", block_sizes, page_size, block_tables.shape[1],
                             rows=min(rows, MAX_BLOCK_ROWS))
    out, lse = _pages_tpu(
        (c.fold_queries(q, kv_heads),), (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero),
        q_pos, quant_lengths, block_tables,
        key_parts=(kp,), value_part=vp, scale=float(scale),
        soft_cap=None if soft_cap is None else float(soft_cap), sliding_window=sliding_window,
        block_tokens=bs.block_tokens, interpret=interpret,
        name=f"kvjax_quant_pages_tpu_k{k_bits}v{v_bits}_r{rows}_bt{bs.block_tokens}",
    )
    return c.unfold(out, lse, q_len)


def quantized_attention(
    q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, tail_k, tail_v, quant_lengths,
    lengths, block_tables, q_pos, *, k_bits, v_bits, scale, soft_cap=None, sliding_window=None,
    block_sizes: BlockSizes | None = None, max_pages: int | None = None,
    interpret: bool | pltpu.InterpretParams = False,
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
    interpret: bool | pltpu.InterpretParams = False,
) -> tuple[Float[Array, "batch q_len q_heads d_c"], Float[Array, "batch q_len q_heads"]]:
    """The TPU kernel for `reference.quantized_mla_pages_attention` (key [c_KV, k_rope],
    value c_KV, one latent "KV head" whose group is every query head).

    Arguments and results as in the reference, plus `block_sizes`, `max_pages`,
    `interpret` as in `quantized_pages_attention`. Each latent slice is
    dequantized once per block and serves as key and value.
    """
    op = "quantized_mla_pages_attention[tpu]"
    cp, rp = c.check_mla_pages(op, q_latent, q_rope, c_codes, c_scale, c_zero, rope_pages,
                               quant_lengths, block_tables, q_pos, bits)
    if not scale > 0:
        raise ValueError(f"{op}: scale must be positive, got {scale}.")
    check_head_dim(op, "d_c", cp.width, "tpu")
    check_head_dim(op, "d_rope", rp.width, "tpu")
    check_table_width(op, block_tables.shape, max_pages, "tpu")
    batch, q_len, q_heads, _ = q_latent.shape
    page_size = c_codes.shape[1]
    rows = q_len * q_heads
    bs = resolve_block_sizes(op, "tpu", block_sizes, page_size, block_tables.shape[1],
                             rows=min(rows, MAX_BLOCK_ROWS))
    out, lse = _pages_tpu(
        (c.fold_queries(q_latent, 1), c.fold_queries(q_rope, 1)),
        (c_codes[None], c_scale[None], c_zero[None], rope_pages[None]),
        q_pos, quant_lengths, block_tables,
        key_parts=(cp, rp), value_part=None, scale=float(scale), soft_cap=None,
        sliding_window=None, block_tokens=bs.block_tokens, interpret=interpret,
        name=f"kvjax_quant_mla_pages_tpu_b{bits}_r{rows}_bt{bs.block_tokens}",
    )
    return c.unfold(out, lse, q_len)


def quantized_mla_attention(
    q_latent, q_rope, c_codes, c_scale, c_zero, rope_pages, tail_c, tail_rope, quant_lengths,
    lengths, block_tables, q_pos, *, bits, scale, block_sizes: BlockSizes | None = None,
    max_pages: int | None = None, interpret: bool | pltpu.InterpretParams = False,
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
