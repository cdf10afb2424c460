"""KIVI attention over quantized pages for ragged prefill rows on Hopper (Mosaic GPU, GQA).

Same contract as `reference.quantized_[pages_]attention` and the Triton kernel
(`gpu.py`) for any q_len: row b's query t sits at `q_pos[b, t]` (< 0: padding,
output 0 and log-sum-exp -inf) and sees the quantized keys at positions
<= its own below `quant_lengths[b]`, within the sliding window; soft cap as in
the reference. The full-precision tail is attended by the reference's jnp
code and merged by log-sum-exp (`reference.merge_with_tail`). Decode rows
(q_len 1) run the split-K decode kernel (`mosaic_gpu.py`); this kernel serves
chunked prefill and mixed steps, whose rows carry several new queries each.

Design: the decode kernel's per-step body on the ragged kernel's schedule.

* Work items and schedule: `ragged_attention.mosaic_gpu.work_items`. The
  query heads of one KV head are folded into wgmma's 64 rows (row = query t x
  `group` heads + head), so an item is (KV head, row, block of `64 // group`
  queries); a persistent grid of `min(num_sms, items)` CTAs deals the list,
  longest first, round-robin. Rows with no query have no item. The list's
  cost is the steps up to each block's last query; the quantized part stops
  at `quant_lengths` (the tail is merged outside), so blocks beyond it cost
  less than listed: the order is an estimate there, never a correctness
  matter.
* The item's token range [lo, hi) (the window's first key of its earliest
  query, min(last query + 1, quant_length)) and the position of each of its
  64 rows are computed by the wrapper from q_pos; the kernel masks each key
  against its row's own position, so any q_pos (contiguous or not) is served.
  Every step is masked (the step's codes are converted in registers anyway;
  an unmasked fast path for whole steps below the block's first query is left
  for a GPU measurement to justify).
* Steps of 64 tokens, one warpgroup per CTA: the decode kernel's pipeline
  (one TMA copy per page chunk for codes, key scales/zeros and value
  scales/zeros into a `num_stages` ring, the next steps issued as a slot
  frees). A step counter carried from item to item keeps each slot's
  barriers waited in order; an item's first copies are issued when it
  starts (no prefetch across items).
* Dequantization as in the decode kernel (its `_to_float`: magic-number
  exponent, one OR and one subtract per element): keys per channel by the
  query times each G-token group's scales (rounded to the 16-bit dtype) plus
  the bias q . z per row; values per token by scaling the probabilities per
  token and adding the zero points through one row sum per channel group.
* Online softmax in float32 (natural exp); a row that sees nothing in a step
  keeps exp at 0 (its running max stays -inf until a key shows), so padding
  rows and rows whose window leaves the quantized part give 0 and -inf.
* NaN safety: logits of keys a row may not see are selected to -inf and its
  scaled probabilities and zero sums to 0 before the P V wgmma, so a NaN scale
  of an unused page never reaches a row; table entries are clamped to the
  pages the item sees, so entries past a row's length are never addresses.

Not measured on a GPU (checked in Mosaic GPU's interpreter with race detection
and lowered for an H100 from CPU: tests/kernels/test_mosaic_gpu_kivi_prefill.py).
Known costs to measure first: a single warpgroup per CTA (no copy warpgroup,
no second compute warpgroup sharing the converted codes: the codes of a step
are converted once per 64 query rows), the conversion of every step's codes
in the same warpgroup as the wgmmas, every step masked, an item's first
pages fetched only when it starts.
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int, UInt8

from kernels_pallas import _mosaic_gpu as mgpu
from kernels_pallas._mosaic_gpu import plgpu
from kernels_pallas.quantized_attention import _common as c
from kernels_pallas.quantized_attention import mosaic_gpu as qdecode
from kernels_pallas.quantized_attention import reference as qref
from kernels_pallas.quantized_attention.layout import codes_per_byte
from kernels_pallas.ragged_attention.mosaic_gpu import work_items

__all__ = [
    "quantized_pages_attention",
    "quantized_attention",
    "unsupported_reason",
    "num_stages",
]

NEG_INF = float("-inf")
ROWS = 64  # wgmma's M: the folded query rows of one item
BLOCK_TOKENS = 64  # tokens per step: one wgmma-layout tile of codes
_MAX_STAGES = 4
_SMEM_BUDGET = 200 * 1024


def unsupported_reason(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, *,
                       k_bits: int, v_bits: int) -> str | None:
    """None when this kernel takes these shapes and dtypes; else a sentence saying why not.

    The decode kernel's conditions (`mosaic_gpu.unsupported_reason`: widths, page size, key
    group of a multiple of 32 tokens, 32-byte code rows, at most 64 query heads per KV head)
    for any q_len >= 1. Takes arrays or `jax.ShapeDtypeStruct`s.
    """
    if q.ndim != 4:
        return "the Mosaic GPU KIVI prefill kernel takes 4-D q."
    if q.shape[1] < 1:
        return f"the Mosaic GPU KIVI prefill kernel takes q_len >= 1, got {q.shape[1]}."
    one_row = jax.ShapeDtypeStruct((q.shape[0], 1, *q.shape[2:]), q.dtype)
    return qdecode.unsupported_reason(one_row, k_codes, k_scale, k_zero, v_codes, v_scale,
                                      v_zero, k_bits=k_bits, v_bits=v_bits)


def num_stages(stage_bytes: int, fixed_bytes: int) -> int:
    """K/V steps in the shared-memory ring: as many (2 to 4) as the budget holds beside the
    `fixed_bytes` every stage shares, `stage_bytes` (one step's codes, scales and zeros)
    each."""
    return max(2, min(_MAX_STAGES, (_SMEM_BUDGET - fixed_bytes) // stage_bytes))


def _item_bounds(q_pos, quant_lengths, positions: int, blocks: int, max_tokens: int,
                 sliding_window: int | None):
    """Per (row, query block): the token range [lo, hi) its queries see in the quantized
    part (int32[batch, blocks] each; lo == hi when they see none): `_common.visit_bounds`
    over each block's queries."""
    batch = q_pos.shape[0]
    pos = jnp.pad(q_pos, ((0, 0), (0, blocks * positions - q_pos.shape[1])),
                  constant_values=-1).reshape(batch * blocks, positions)
    lo, hi = c.visit_bounds(pos, jnp.repeat(quant_lengths, blocks), max_tokens, sliding_window)
    return lo.reshape(batch, blocks), hi.reshape(batch, blocks)


def _kernel(
    items_ref,  # i32[3, max_items]: KV head, row, query block of item i (longest first)
    num_items_ref,  # i32[1]
    lo_ref, hi_ref,  # i32[batch, blocks]: the item's token range
    tbl_ref,  # i32[batch, max_pages]
    pos_ref,  # i32[batch, blocks, 64]: each folded row's position (-1: padding)
    q_ref,  # [kv_heads, batch, blocks, kk, 64, kw]: folded queries by key field
    kc_ref, ks_ref, kz_ref,  # key codes [kvh, pages, ps, k_packed]; scale/zero [.., srows, kk, kw]
    vc_ref, vsz_ref,  # value codes [kvh, pages, ps, v_packed]; [kvh, pages, 2, groups, ps]
    o_ref,  # f32[kv_heads, batch, blocks, pieces, 64, vw]
    lse_ref,  # f32[kv_heads, batch, blocks, 64]
    q_smem, pos_smem, qs_smem, kc_smem, ks_smem, kz_smem, vc_smem, vsz_smem, kst_smem,
    vst_smem, q_bar, k_bars, v_bars, p_smem,
    *, stages: int, num_programs: int, k_bits: int, v_bits: int, group: int, v_group: int,
    scale: float, soft_cap: float | None, sliding_window: int | None, interpret: Any,
):
    sm = lax.axis_index("sm")
    page_size = kc_ref.shape[2]
    max_pages = tbl_ref.shape[1]
    bt = BLOCK_TOKENS
    chunk = min(page_size, bt)
    chunks = bt // chunk
    dtype = qs_smem.dtype
    kk = kst_smem.shape[0]  # key fields
    n_pieces, vw = vst_smem.shape[0], vst_smem.shape[-1]  # value pieces, channels per piece
    vk = codes_per_byte(v_bits)
    vpc = n_pieces // vk  # byte-column pieces per packed value row
    sub = min(group, bt)
    n_sub = bt // sub
    rows_per_chunk = max(1, chunk // group)  # key scale rows one page chunk brings
    num_items = num_items_ref[0]
    my_items = lax.div(jnp.maximum(num_items - sm, 0) + (num_programs - 1), num_programs)

    wg = plgpu.Layout.WGMMA
    rows_l, cols_l = wg.reduce(1), wg.reduce(0)
    layout_cast = functools.partial(mgpu.layout_cast, interpret=interpret)
    load = functools.partial(mgpu.load, interpret=interpret)
    iota = functools.partial(mgpu.broadcasted_iota, jnp.int32, layout=wg, interpret=interpret)
    kmask, vmask = (1 << k_bits) - 1, (1 << v_bits) - 1

    def bcast_cols(x, shape):  # a [cols] vector over the rows of a [rows, cols] tile
        return lax.broadcast_in_dim(x, shape, [1])

    def bcast_rows(x, shape):
        return lax.broadcast_in_dim(x, shape, [0])

    def one_item(k, g):
        i = sm + k * num_programs
        h, b, qb = items_ref[0, i], items_ref[1, i], items_ref[2, i]
        lo, hi = lo_ref[b, qb], hi_ref[b, qb]
        lo_step = lax.div(lo, bt)
        num_steps = jnp.where(hi > lo, lax.div(hi + (bt - 1), bt) - lo_step, 0)
        lo_page = lax.div(lo, page_size)
        hi_page = jnp.clip(lax.div(hi - 1, page_size), lo_page, max_pages - 1)
        # One barrier, two copies: the previous item's reads of both buffers were loads
        # (synchronous) before this point.
        plgpu.copy_gmem_to_smem(q_ref.at[h, b, qb], q_smem, q_bar)
        plgpu.copy_gmem_to_smem(pos_ref.at[b, qb], pos_smem, q_bar)

        def issue(j):
            slot = lax.rem(g + j, stages)
            step0 = (lo_step + j) * bt
            for ci in range(chunks):
                tok = step0 + ci * chunk
                # Only pages the item sees are addresses: a chunk outside [lo, hi) re-reads
                # one of them, and its tokens are masked.
                page = tbl_ref[b, jnp.clip(lax.div(tok, page_size), lo_page, hi_page)]
                rows = pl.ds(lax.rem(tok, page_size), chunk)
                dst = pl.ds(ci * chunk, chunk)
                plgpu.copy_gmem_to_smem(kc_ref.at[h, page, rows], kc_smem.at[slot, dst],
                                        k_bars.at[slot])
                srows = pl.ds(lax.div(lax.rem(tok, page_size), group), rows_per_chunk)
                sdst = pl.ds(ci * chunk // sub, rows_per_chunk)
                plgpu.copy_gmem_to_smem(ks_ref.at[h, page, srows], ks_smem.at[slot, sdst],
                                        k_bars.at[slot])
                plgpu.copy_gmem_to_smem(kz_ref.at[h, page, srows], kz_smem.at[slot, sdst],
                                        k_bars.at[slot])
                for pc in range(vpc):
                    plgpu.copy_gmem_to_smem(vc_ref.at[h, page, rows, pl.ds(pc * vw, vw)],
                                            vc_smem.at[slot, pc, dst], v_bars.at[slot])
                plgpu.copy_gmem_to_smem(vsz_ref.at[h, page, :, :, rows], vsz_smem.at[slot, ci],
                                        v_bars.at[slot])

        for j in range(stages):
            pl.when(j < num_steps)(functools.partial(issue, j))

        plgpu.barrier_wait(q_bar)
        qf = [load(q_smem.at[f], wg).astype(jnp.float32) for f in range(kk)]
        row_pos = load(pos_smem, rows_l)

        def step(j, carry):
            accs, m_prev, l_prev = carry
            slot = lax.rem(g + j, stages)
            step0 = (lo_step + j) * bt
            plgpu.barrier_wait(k_bars.at[slot])
            codes = load(kc_smem.at[slot], wg).astype(jnp.int32)
            for f in range(kk):
                kst_smem.at[f][...] = qdecode._to_float((codes >> (f * k_bits)) & kmask, dtype,
                                                        k_bits)
            biases = []
            for sb in range(n_sub):
                bias = None
                for f in range(kk):
                    s_f = load(ks_smem.at[slot, sb, f], cols_l).astype(jnp.float32)
                    z_f = load(kz_smem.at[slot, sb, f], cols_l).astype(jnp.float32)
                    qs_smem.at[sb, f][...] = (qf[f] * bcast_cols(s_f, qf[f].shape)).astype(dtype)
                    part = (qf[f] * bcast_cols(z_f, qf[f].shape)).sum(axis=1)
                    bias = part if bias is None else bias + part
                biases.append(bias)
            plgpu.commit_smem()

            logits = []
            for sb in range(n_sub):
                s = mgpu.dot_transposed_b(
                    tuple(qs_smem.at[sb, f] for f in range(kk)),
                    tuple(kst_smem.at[f, pl.ds(sb * sub, sub)] for f in range(kk)),
                    interpret=interpret)
                s = (s + bcast_rows(biases[sb], s.shape)) * jnp.float32(scale)
                if soft_cap is not None:
                    s = jnp.float32(soft_cap) * jnp.tanh(s / jnp.float32(soft_cap))
                key = step0 + sb * sub + iota((ROWS, sub), 1)
                pos = bcast_rows(row_pos, key.shape)
                seen = (key <= pos) & (key < hi)
                if sliding_window is not None:
                    seen &= pos - key < sliding_window
                logits.append((jnp.where(seen, s, NEG_INF), seen))
            m_new = m_prev
            for s, _ in logits:
                m_new = jnp.maximum(m_new, s.max(axis=1))
            # A row that has seen nothing yet (padding, the window's leading edge, a diagonal
            # step below its position) keeps exp at 0 rather than exp(-inf + inf).
            m_use = jnp.where(m_new == NEG_INF, 0.0, m_new)
            alpha = jnp.exp(m_prev - m_use)
            probs = [jnp.exp(s - bcast_rows(m_use, s.shape)) for s, _ in logits]
            l_new = l_prev * alpha
            for p in probs:
                l_new = l_new + p.sum(axis=1)

            plgpu.barrier_wait(v_bars.at[slot])
            for pc in range(vpc):
                vcodes = load(vc_smem.at[slot, pc], wg).astype(jnp.int32)
                for f in range(vk):
                    vst_smem.at[f * vpc + pc][...] = qdecode._to_float(
                        (vcodes >> (f * v_bits)) & vmask, dtype, v_bits)
            plgpu.commit_smem()

            new_accs = []
            for piece in range(n_pieces):
                f, pc = divmod(piece, vpc)
                grp = (f * vpc * vw + pc * vw) // v_group  # the piece's channel group
                acc = accs[piece] * bcast_rows(alpha, accs[piece].shape)
                for sb in range(n_sub):
                    p, (_, seen) = probs[sb], logits[sb]
                    toks = pl.ds(sb * sub, sub)
                    ci, off = divmod(sb * sub, chunk)  # a sub-block lies in one page chunk
                    sz = vsz_smem.at[slot, ci]
                    s_t = load(sz.at[0, grp, pl.ds(off, sub)], cols_l).astype(jnp.float32)
                    z_t = load(sz.at[1, grp, pl.ds(off, sub)], cols_l).astype(jnp.float32)
                    ps = jnp.where(seen, p * bcast_cols(s_t, p.shape), 0.0).astype(dtype)
                    pz = jnp.where(seen, p * bcast_cols(z_t, p.shape), 0.0).sum(axis=1)
                    if p_smem is None:
                        p_in = ps
                    else:
                        p_smem.at[sb][...] = ps
                        plgpu.commit_smem()
                        p_in = p_smem.at[sb]

                    def pv(acc_ref, p_in=p_in, piece=piece, toks=toks):
                        plgpu.wgmma(acc_ref, p_in, vst_smem.at[piece, toks])
                        return acc_ref[...]

                    acc = acc + pl.run_scoped(pv, plgpu.ACC((ROWS, vw), jnp.float32))
                    acc = acc + bcast_rows(pz, acc.shape)
                new_accs.append(acc)

            @pl.when(j + stages < num_steps)
            def _():
                issue(j + stages)

            return tuple(new_accs), m_new, l_new

        acc0 = tuple(layout_cast(jnp.zeros((ROWS, vw), jnp.float32), wg)
                     for _ in range(n_pieces))
        m0 = layout_cast(jnp.full((ROWS,), NEG_INF, jnp.float32), rows_l)
        l0 = layout_cast(jnp.full((ROWS,), 0.0, jnp.float32), rows_l)
        accs, m, l_sum = lax.fori_loop(0, num_steps, step, (acc0, m0, l0))
        seen = l_sum > 0.0
        safe_l = jnp.where(seen, l_sum, 1.0)
        for piece, acc in enumerate(accs):
            o_ref[h, b, qb, piece] = jnp.where(
                bcast_rows(seen, acc.shape), acc / bcast_rows(safe_l, acc.shape), 0.0)
        lse_ref[h, b, qb] = jnp.where(seen, m + jnp.log(safe_l), NEG_INF)
        return g + num_steps

    lax.fori_loop(0, my_items, one_item, jnp.int32(0))


@functools.partial(jax.jit, static_argnames=(
    "k_bits", "v_bits", "scale", "soft_cap", "sliding_window", "num_sms", "interpret"))
def _pages(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, quant_lengths, block_tables,
           q_pos, *, k_bits, v_bits, scale, soft_cap, sliding_window, num_sms, interpret):
    batch, q_len, q_heads, _ = q.shape
    kv_heads, _, page_size, k_packed = k_codes.shape
    head_dim, group, v_dim, v_group = qdecode._parts(k_codes, k_scale, v_codes, v_scale,
                                                     k_bits, v_bits)
    heads = q_heads // kv_heads  # query heads per KV head
    positions = ROWS // heads  # query positions per item
    blocks = pl.cdiv(q_len, positions)
    max_pages = block_tables.shape[1]
    dtype = jnp.float16 if q.dtype == jnp.float16 else jnp.bfloat16
    kk, vk = codes_per_byte(k_bits), codes_per_byte(v_bits)
    kw = head_dim // kk
    v_packed = v_codes.shape[-1]
    vw = min(v_group, v_packed)  # channels (= bytes) per value piece
    vpc = v_packed // vw
    n_pieces = vk * vpc
    n_groups = v_dim // v_group
    sub = min(group, BLOCK_TOKENS)
    n_sub = BLOCK_TOKENS // sub
    chunk = min(page_size, BLOCK_TOKENS)
    chunks = BLOCK_TOKENS // chunk
    sbytes = jnp.dtype(k_scale.dtype).itemsize
    stage_bytes = BLOCK_TOKENS * (k_packed + v_packed) + 2 * n_sub * head_dim * sbytes \
        + 2 * n_groups * BLOCK_TOKENS * sbytes
    fixed_bytes = 2 * (kk + n_sub * kk) * ROWS * kw + 2 * BLOCK_TOKENS * (head_dim + v_dim) \
        + 2 * n_sub * ROWS * sub
    stages = num_stages(stage_bytes, fixed_bytes)

    # Queries by key field: [kv_heads, batch, blocks, fields, 64 rows, channels per field],
    # row = position in the block x heads + head, padded to 64 rows.
    qf = jnp.pad(q.astype(dtype), ((0, 0), (0, blocks * positions - q_len), (0, 0), (0, 0)))
    qf = qf.reshape(batch, blocks, positions, kv_heads, heads, kk, kw)
    qf = qf.transpose(3, 0, 1, 5, 2, 4, 6).reshape(kv_heads, batch, blocks, kk,
                                                   positions * heads, kw)
    qf = jnp.pad(qf, ((0, 0),) * 4 + ((0, ROWS - positions * heads), (0, 0)))
    q_pos = q_pos.astype(jnp.int32)
    pos = jnp.pad(q_pos, ((0, 0), (0, blocks * positions - q_len)), constant_values=-1)
    pos = jnp.repeat(pos.reshape(batch, blocks, positions), heads, axis=2)
    pos = jnp.pad(pos, ((0, 0), (0, 0), (0, ROWS - positions * heads)), constant_values=-1)
    lo, hi = _item_bounds(q_pos, quant_lengths, positions, blocks, max_pages * page_size,
                          sliding_window)

    # The schedule's cost model takes contiguous rows: its row "length" is one past the last
    # query and its query count reaches the last real slot (padding slots inside are masked).
    slot = jnp.arange(q_len, dtype=jnp.int32)[None, :]
    valid = q_pos >= 0
    q_count = jnp.max(jnp.where(valid, slot + 1, 0), axis=1)
    ends = jnp.maximum(jnp.max(jnp.where(valid, q_pos + 1, 0), axis=1), q_count)
    items, num_items = work_items(ends, q_count, heads=kv_heads, blocks=blocks,
                                  item_positions=positions, block_tokens=BLOCK_TOKENS,
                                  sliding_window=sliding_window)
    num_programs = min(num_sms, kv_heads * batch * blocks)

    ks = k_scale.reshape(*k_scale.shape[:3], kk, kw)  # a free reshape of the last axis
    kz = k_zero.reshape(*k_zero.shape[:3], kk, kw)
    vsz = jnp.stack([v_scale, v_zero], axis=2).swapaxes(-1, -2)  # [kvh, pages, 2, groups, ps]
    kernel = functools.partial(
        _kernel, stages=stages, num_programs=num_programs, k_bits=k_bits, v_bits=v_bits,
        group=group, v_group=v_group, scale=scale, soft_cap=soft_cap,
        sliding_window=sliding_window, interpret=interpret)
    sdt = k_scale.dtype
    swz = qdecode._swizzled
    out, lse = plgpu.kernel(
        kernel,
        out_type=(
            jax.ShapeDtypeStruct((kv_heads, batch, blocks, n_pieces, ROWS, vw), jnp.float32),
            jax.ShapeDtypeStruct((kv_heads, batch, blocks, ROWS), jnp.float32),
        ),
        scratch_types=(
            plgpu.SMEM((kk, ROWS, kw), dtype, transforms=swz(kw, 2)),  # q
            plgpu.SMEM((ROWS,), jnp.int32),  # row positions
            plgpu.SMEM((n_sub, kk, ROWS, kw), dtype, transforms=swz(kw, 2)),  # q s
            plgpu.SMEM((stages, BLOCK_TOKENS, k_packed), jnp.uint8, transforms=swz(k_packed, 1)),
            plgpu.SMEM((stages, n_sub, kk, kw), sdt),
            plgpu.SMEM((stages, n_sub, kk, kw), sdt),
            plgpu.SMEM((stages, vpc, BLOCK_TOKENS, vw), jnp.uint8, transforms=swz(vw, 1)),
            plgpu.SMEM((stages, chunks, 2, n_groups, chunk), sdt),
            plgpu.SMEM((kk, BLOCK_TOKENS, kw), dtype, transforms=swz(kw, 2)),
            # P V's K is a sub-block's tokens: a multiple of the swizzle's width in elements.
            plgpu.SMEM((n_pieces, BLOCK_TOKENS, vw), dtype, transforms=swz(min(vw, sub), 2)),
            plgpu.Barrier(num_arrivals=2),
            plgpu.Barrier(num_arrivals=3 * chunks, num_barriers=stages),
            plgpu.Barrier(num_arrivals=chunks * (vpc + 1), num_barriers=stages),
            (plgpu.SMEM((n_sub, ROWS, sub), dtype, transforms=swz(sub, 2))
             if mgpu.wgmma_a_from_smem(interpret) else None),
        ),
        grid=(num_programs,),
        grid_names=("sm",),
        kernel_name=f"kvjax_kivi_prefill_mosaic_gpu_k{k_bits}v{v_bits}_g{heads}_p{page_size}",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=mgpu.resolve_interpret(interpret),
    )(items, num_items, lo, hi, block_tables.astype(jnp.int32), pos, qf, k_codes, ks, kz,
      v_codes, vsz)

    # [kvh, batch, blocks, pieces, 64, vw] -> [batch, q_len, q_heads, v_dim]: piece (field f,
    # byte columns pc) holds channels f * v_packed + pc * vw + [0, vw), so pieces in order are
    # the channels in order.
    out = out[:, :, :, :, :positions * heads].reshape(
        kv_heads, batch, blocks, n_pieces, positions, heads, vw)
    out = out.transpose(1, 2, 4, 0, 5, 3, 6).reshape(batch, blocks * positions, q_heads, v_dim)
    lse = lse[..., :positions * heads].reshape(kv_heads, batch, blocks, positions, heads)
    lse = lse.transpose(1, 2, 3, 0, 4).reshape(batch, blocks * positions, q_heads)
    # Slots past the last real query belong to no item (never written).
    keep = valid[:, :, None]
    return (jnp.where(keep[..., None], out[:, :q_len], 0.0),
            jnp.where(keep, lse[:, :q_len], NEG_INF))


def _check(op, q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, quant_lengths,
           block_tables, q_pos, k_bits, v_bits, num_sms, sliding_window):
    c.check_gqa_pages(op, q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, quant_lengths,
                      block_tables, q_pos, k_bits, v_bits)
    reason = unsupported_reason(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                                k_bits=k_bits, v_bits=v_bits)
    if reason is not None:
        raise ValueError(f"{op}: {reason} Use the Triton kernel (gpu.py) for these shapes.")
    if not isinstance(num_sms, int) or num_sms < 1:
        raise ValueError(f"{op}: num_sms must be an int >= 1, got {num_sms!r}.")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"{op}: sliding_window must be an int >= 1 or None, got "
                         f"{sliding_window!r}.")


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
    num_sms: int = mgpu.H100_NUM_SMS,
    interpret: Any = False,
) -> tuple[Float[Array, "batch q_len q_heads v_head_dim"], Float[Array, "batch q_len q_heads"]]:
    """The Mosaic GPU kernel for `reference.quantized_pages_attention` (rows of any q_len).

    Args:
      q: [batch, q_len, q_heads, head_dim]; q_heads a multiple of kv_heads, at most 64 per
        KV head. bfloat16 or float32 queries run the tensor cores in bfloat16, float16 in
        float16 (the query times each key scale, the converted codes and the scaled
        probabilities are rounded to that dtype; accumulation in float32).
      k_codes ... v_zero: one layer's KIVI pools, as in the reference (`layout.py`).
      quant_lengths: int32[batch], quantized tokens per row; only keys below it are read.
      block_tables: int32[batch, max_pages]; entries past what a row's queries see are never
        used as addresses.
      q_pos: int32[batch, q_len], each query's position (< 0: padding).
      k_bits, v_bits, scale, soft_cap, sliding_window: as in the reference.
      num_sms: SMs of the target GPU (132 on H100 and H200): the persistent grid's size;
        static, never read from the device.
      interpret: False to compile for the GPU; True, or
        `kernels_pallas._mosaic_gpu.interpret_params(...)`, to run Mosaic GPU's interpreter.

    Returns:
      (out float32 [batch, q_len, q_heads, v_head_dim], lse float32 [batch, q_len, q_heads]);
      padding queries and queries that see no quantized key give 0 and -inf.

    Raises:
      ValueError / TypeError: on arguments the reference refuses, or shapes this kernel does
        not take (`unsupported_reason`), before tracing.
    """
    op = "quantized_pages_attention[mosaic_gpu_prefill]"
    _check(op, q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, quant_lengths,
           block_tables, q_pos, k_bits, v_bits, num_sms, sliding_window)
    if q.shape[0] == 0:
        return (jnp.zeros((*q.shape[:3], v_codes.shape[-1] * codes_per_byte(v_bits)),
                          jnp.float32), jnp.full(q.shape[:3], NEG_INF, jnp.float32))
    return _pages(
        q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, quant_lengths.astype(jnp.int32),
        block_tables, q_pos, k_bits=k_bits, v_bits=v_bits, scale=float(scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        sliding_window=sliding_window, num_sms=num_sms, interpret=interpret)


def quantized_attention(
    q: Float[Array, "batch q_len q_heads head_dim"],
    k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
    tail_k: Float[Array, "kv_heads batch ring head_dim"],
    tail_v: Float[Array, "kv_heads batch ring v_head_dim"],
    quant_lengths: Int[Array, " batch"],
    lengths: Int[Array, " batch"],
    block_tables: Int[Array, "batch max_pages"],
    q_pos: Int[Array, "batch q_len"],
    *,
    k_bits: int,
    v_bits: int,
    scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    num_sms: int = mgpu.H100_NUM_SMS,
    interpret: Any = False,
) -> tuple[Float[Array, "batch q_len q_heads v_head_dim"], Float[Array, "batch q_len q_heads"]]:
    """Drop-in for `reference.quantized_attention` (rows of any q_len): this kernel's pages
    part merged with the full-precision tail by log-sum-exp.

    Returns:
      (out [batch, q_len, q_heads, v_head_dim] in q's dtype, lse float32 [batch, q_len,
      q_heads]).
    """
    opts = dict(scale=scale, soft_cap=soft_cap, sliding_window=sliding_window)
    out_q, lse_q = quantized_pages_attention(
        q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, quant_lengths, block_tables,
        q_pos, k_bits=k_bits, v_bits=v_bits, num_sms=num_sms, interpret=interpret, **opts)
    return qref.merge_with_tail(out_q, lse_q, q, tail_k, tail_v, quant_lengths, lengths, q_pos,
                                **opts)
