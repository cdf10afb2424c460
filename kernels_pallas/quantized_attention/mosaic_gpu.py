"""KIVI decode over quantized pages on Hopper as a Mosaic GPU kernel (GQA/MQA/MHA).

Same contract as `gpu.quantized_[pages_]attention` (the Triton kernel) and the
reference, for decode rows (q_len 1); `unsupported_reason` says which shapes
this kernel leaves to the Triton kernel. The full-precision tail is attended
by the reference's jnp code and merged by log-sum-exp, as in `gpu.py`.

Design (the bf16 kernel `paged_attention/mosaic_gpu.py` is the frame: its
split-K `choose_splits`, block table staged in shared memory, one TMA copy per
page into a `num_stages` ring, the query group padded to wgmma's 64 rows,
online softmax in float32 and the split merge `merge.merge_splits`):

* Steps of 64 tokens (one wgmma-layout tile of codes). Packed codes come in
  by TMA into 8-row-tiled, swizzled uint8 buffers, are read into registers in
  the wgmma layout, and each bit field is converted to 16-bit floats by a
  magic-number exponent (`(code | 0x4300)` read as bfloat16 is `128 + code`;
  float16: `0x6400`, `1024 + code`), one OR and one subtract per element with
  no integer-to-float conversion (8-bit codes in bfloat16, which holds only 7
  mantissa bits above 128, take the plain conversion). The converted field is
  stored to a swizzled buffer wgmma reads. `layout.py`'s planar order makes
  field i of every byte the channel slice [i W/k, (i+1) W/k), so no shuffle
  is needed: the products sum over fields.
* Keys, per channel in groups of G tokens: each step is cut into sub-blocks
  of min(G, 64) tokens sharing one scale row s and zero row z. The query is
  multiplied by s once per sub-block (float32, rounded to the 16-bit dtype)
  and q . z is one float32 bias per row, so logits = (q s) . codes^T + q . z:
  the codes go into wgmma unscaled.
* Values, per token in groups of Gv channels: the output is accumulated in
  pieces of min(Gv, W/k) channels (each inside one channel group), fed by TMA
  copies of the matching byte columns of the packed codes. For a piece,
  P V = (P diag(s)) . codes + (P . z) broadcast over the piece: the
  probabilities are scaled per token before the wgmma and the zero points
  enter through one row sum. The scales and zeros are read token-minor
  ([groups, tokens]), transposed by the wrapper.
* Small shapes: key groups of 16 tokens (pages of 16) run 16-token logits
  and P V sub-blocks (bf16 wgmma's K and N of 16); code rows of 16 bytes
  (int2 at head_dim 64) are copied to and read from untiled shared memory
  (Mosaic's smallest swizzle is 32 bytes).
* Masking: logits outside [lo, hi) are selected to -inf, and the scaled
  probabilities and zero sums of those tokens to 0, so a NaN scale of a page
  no query sees never reaches the output (codes are integers and always
  finite).

Performance is unmeasured (no GPU here). Known costs left for later: the
64-row padding of small groups multiplies the wgmma FLOPs per byte by 8/bits
against the bf16 kernel; the value scales are transposed by XLA on every call
(a token-minor GPU page layout written at quantization time removes that);
key groups smaller than 64 tokens run one logits wgmma per group.

Checked on CPU in Mosaic GPU's interpreter with race detection and by
lowering for an H100 (tests/kernels/test_mosaic_gpu_quantized.py).
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int, UInt8

from kernels_pallas import _mosaic_gpu as mgpu
from kernels_pallas._mosaic_gpu import plgpu
from kernels_pallas.merge import merge_splits
from kernels_pallas.paged_attention.mosaic_gpu import KernelConfig, choose_splits
from kernels_pallas.quantized_attention import _common as c
from kernels_pallas.quantized_attention import reference as qref
from kernels_pallas.quantized_attention.layout import codes_per_byte

__all__ = [
    "quantized_pages_attention",
    "quantized_attention",
    "unsupported_reason",
    "kernel_config",
]

NEG_INF = float("-inf")
_MMA_ROWS = 64
_BLOCK_TOKENS = 64
_MIN_PAGE = 8
_MAX_STAGES = 4
_SMEM_BUDGET = 200 * 1024
_HEAD_DIMS = (64, 128, 256)
_Q_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
# Magic-number conversion: (code | bits) read as the 16-bit float is offset + code.
_MAGIC = {jnp.dtype(jnp.bfloat16): (0x4300, 128.0, 7), jnp.dtype(jnp.float16): (0x6400, 1024.0, 10)}


def _parts(k_codes, k_scale, v_codes, v_scale, k_bits, v_bits):
    """(head_dim, key group G, v_head_dim, value group Gv) from the pools' shapes."""
    page_size = k_codes.shape[2]
    head_dim = k_codes.shape[-1] * codes_per_byte(k_bits)
    v_dim = v_codes.shape[-1] * codes_per_byte(v_bits)
    return head_dim, page_size // k_scale.shape[2], v_dim, v_dim // v_scale.shape[-1]


def unsupported_reason(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, *,
                       k_bits: int, v_bits: int) -> str | None:
    """None when this kernel takes these shapes and dtypes; else a sentence saying why not.

    Takes arrays or `jax.ShapeDtypeStruct`s (only shapes and dtypes are read); the bit widths
    as given to the op.
    """
    if q.ndim != 4 or k_codes.ndim != 4 or v_codes.ndim != 4 or k_scale.ndim != 4 \
            or v_scale.ndim != 4:
        return "the Mosaic GPU KIVI kernel takes 4-D q and pools."
    if q.shape[1] != 1:
        return (f"the Mosaic GPU KIVI kernel serves decode rows (q_len 1), got q_len "
                f"{q.shape[1]}; the Triton kernel serves chunked prefill.")
    if jnp.dtype(q.dtype) not in _Q_DTYPES:
        return (f"the Mosaic GPU KIVI kernel takes bfloat16, float16 or float32 queries, got "
                f"{q.dtype}.")
    if k_bits not in (2, 4, 8) or v_bits not in (2, 4, 8):
        return f"the Mosaic GPU KIVI kernel takes 2, 4 or 8 bits, got {k_bits}, {v_bits}."
    head_dim, group, v_dim, v_group = _parts(k_codes, k_scale, v_codes, v_scale, k_bits, v_bits)
    for name, width in (("head_dim", head_dim), ("v_head_dim", v_dim)):
        if width not in _HEAD_DIMS:
            return f"the Mosaic GPU KIVI kernel takes {name} in {_HEAD_DIMS}, got {width}."
    page_size = k_codes.shape[2]
    if page_size < _MIN_PAGE or page_size % _MIN_PAGE or not (
        _BLOCK_TOKENS % page_size == 0 or page_size % _BLOCK_TOKENS == 0
    ):
        return (f"the Mosaic GPU KIVI kernel takes page sizes that are multiples of {_MIN_PAGE} "
                f"dividing or divisible by {_BLOCK_TOKENS}, got {page_size}.")
    if group % 16:
        return (f"the Mosaic GPU KIVI kernel takes key groups of a multiple of 16 tokens (the "
                f"K extent of one bf16 P V wgmma over a group's probabilities), got {group}.")
    if 4 * (v_dim // v_group) * min(page_size, _BLOCK_TOKENS) % 128:
        return ("the Mosaic GPU KIVI kernel copies a page chunk's value scales and zeros in "
                "one TMA copy of a multiple of 128 bytes; use more value groups or larger "
                "pages.")
    piece = min(v_group, v_dim * v_bits // 8)
    if piece < 16:
        return (f"the Mosaic GPU KIVI kernel reads value codes in pieces of min(group, "
                f"v_head_dim * bits / 8) >= 16 bytes (one TMA box row), got {piece}.")
    for name, width in (("head_dim", head_dim * k_bits // 8), ("v_head_dim", piece)):
        if width < 16:
            return f"the Mosaic GPU KIVI kernel needs >= 16-byte code rows for {name}."
    group_rows = q.shape[2] // max(k_codes.shape[0], 1)
    if group_rows > _MMA_ROWS:
        return (f"the Mosaic GPU KIVI kernel holds at most {_MMA_ROWS} query heads per KV head, "
                f"got {group_rows}.")
    return None


def kernel_config(batch: int, kv_heads: int, max_pages: int, page_size: int, stage_bytes: int,
                  fixed_bytes: int, num_sms: int) -> KernelConfig:
    """The tiling of one call (a pure function): the bf16 kernel's steps and splits, with the
    stage count from the bytes of one step's codes, scales and zeros (`stage_bytes`) and the
    shared memory every stage shares (`fixed_bytes`)."""
    bt = _BLOCK_TOKENS
    stages = max(2, min(_MAX_STAGES, (_SMEM_BUDGET - fixed_bytes) // stage_bytes))
    pages_per_step = max(1, bt // page_size)
    steps_per_page = max(1, page_size // bt)
    num_steps = max(1, -(-max_pages // pages_per_step) * steps_per_page)
    splits = choose_splits(batch * kv_heads, num_steps, num_sms)
    steps_per_split = -(-num_steps // splits)
    unit = math.lcm(4, pages_per_step)
    pps = -(-steps_per_split * bt // page_size)
    pps = -(-pps // unit) * unit
    splits = -(-max_pages // pps)
    return KernelConfig(block_tokens=bt, chunk=min(page_size, bt), num_stages=stages,
                        num_splits=splits, pages_per_split=pps,
                        table_window=-(-pps // 32) * 32)


def _swizzled(width: int, itemsize: int):
    swizzle = min(128, width * itemsize)
    if swizzle < 32:  # 16-byte rows (int2 codes at head_dim 64): untiled, one row a line
        return ()
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def _to_float(field, dtype, bits):
    """Integer codes (int32, wgmma layout) as `dtype` values, by the magic-number exponent."""
    magic, offset, mantissa = _MAGIC[jnp.dtype(dtype)]
    if bits > mantissa:
        return field.astype(jnp.float32).astype(dtype)
    word = (field | magic).astype(jnp.uint16)
    return jax.lax.bitcast_convert_type(word, dtype) - jnp.asarray(offset, dtype)


def _kernel(
    q_ref, kc_ref, ks_ref, kz_ref, vc_ref, vsz_ref, lo_ref, hi_ref, tbl_ref,  # GMEM
    o_ref, lse_ref,
    q_smem, qs_smem, kc_smem, ks_smem, kz_smem, vc_smem, vsz_smem, kst_smem, vst_smem,
    tbl_smem, q_bar, tbl_bar, k_bars, v_bars, p_smem,
    *, cfg: KernelConfig, page_size: int, k_bits: int, v_bits: int, group: int,
    v_group: int, scale: float, soft_cap: float | None, interpret,
):
    s_idx = jax.lax.axis_index("split")
    h = jax.lax.axis_index("kv_head")
    b = jax.lax.axis_index("seq")
    bt, chunk, stages, pps = cfg.block_tokens, cfg.chunk, cfg.num_stages, cfg.pages_per_split
    chunks = bt // chunk
    dtype = qs_smem.dtype
    kk = kst_smem.shape[0]  # key fields
    n_pieces, vw = vst_smem.shape[0], vst_smem.shape[-1]  # value pieces, channels per piece
    vk = codes_per_byte(v_bits)
    vpc = n_pieces // vk  # byte-column pieces per packed value row
    sub = min(group, bt)
    n_sub = bt // sub
    rows_per_chunk = max(1, chunk // group)  # key scale rows one page chunk brings

    plgpu.copy_gmem_to_smem(tbl_ref.at[b, pl.ds(s_idx * pps, cfg.table_window)], tbl_smem,
                            tbl_bar)
    plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_smem, q_bar)
    lo, hi = lo_ref[b], hi_ref[b]
    split0 = s_idx * (pps * page_size)
    lo_tok = jnp.maximum(lo, split0)
    hi_tok = jnp.minimum(hi, split0 + pps * page_size)
    lo_step = (lo_tok - split0) // bt
    num_steps = jnp.where(hi_tok > lo_tok, pl.cdiv(hi_tok - split0, bt) - lo_step, 0)
    plgpu.barrier_wait(tbl_bar)

    def issue(j):
        slot = j % stages
        step0 = split0 + (lo_step + j) * bt
        for ci in range(chunks):
            tok = step0 + ci * chunk
            visible = (tok < hi) & (tok + chunk > lo)
            page = jnp.where(visible, tbl_smem[(tok - split0) // page_size], 0)
            rows = pl.ds(tok % page_size, chunk)
            dst = pl.ds(ci * chunk, chunk)
            # One barrier per slot and side counts all of the step's copies (num_arrivals).
            plgpu.copy_gmem_to_smem(kc_ref.at[h, page, rows], kc_smem.at[slot, dst],
                                    k_bars.at[slot])
            srows = pl.ds((tok % page_size) // group, rows_per_chunk)
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

    wg = plgpu.Layout.WGMMA
    rows_l, cols_l = wg.reduce(1), wg.reduce(0)
    layout_cast = functools.partial(mgpu.layout_cast, interpret=interpret)
    load = functools.partial(mgpu.load, interpret=interpret)
    iota = functools.partial(mgpu.broadcasted_iota, jnp.int32, layout=wg, interpret=interpret)

    def bcast_cols(x, shape):  # a [cols] vector over the rows of a [rows, cols] tile
        return jax.lax.broadcast_in_dim(x, shape, [1])

    def bcast_rows(x, shape):
        return jax.lax.broadcast_in_dim(x, shape, [0])

    plgpu.barrier_wait(q_bar)
    qf = [load(q_smem.at[i], wg).astype(jnp.float32) for i in range(kk)]
    m0 = layout_cast(jnp.full((_MMA_ROWS,), NEG_INF, jnp.float32), rows_l)
    l0 = layout_cast(jnp.full((_MMA_ROWS,), 0.0, jnp.float32), rows_l)
    acc0 = tuple(layout_cast(jnp.zeros((_MMA_ROWS, vw), jnp.float32), wg)
                 for _ in range(n_pieces))
    kmask, vmask = (1 << k_bits) - 1, (1 << v_bits) - 1

    def step(j, carry):
        accs, m_prev, l_prev = carry
        slot = j % stages
        step0 = split0 + (lo_step + j) * bt
        plgpu.barrier_wait(k_bars.at[slot])
        codes = load(kc_smem.at[slot], wg).astype(jnp.int32)
        for i in range(kk):
            kst_smem.at[i][...] = _to_float((codes >> (i * k_bits)) & kmask, dtype, k_bits)
        biases = []
        for sb in range(n_sub):
            bias = None
            for i in range(kk):
                s_i = load(ks_smem.at[slot, sb, i], cols_l).astype(jnp.float32)
                z_i = load(kz_smem.at[slot, sb, i], cols_l).astype(jnp.float32)
                qs_smem.at[sb, i][...] = (qf[i] * bcast_cols(s_i, qf[i].shape)).astype(dtype)
                part = (qf[i] * bcast_cols(z_i, qf[i].shape)).sum(axis=1)
                bias = part if bias is None else bias + part
            biases.append(bias)
        plgpu.commit_smem()

        logits = []
        for sb in range(n_sub):
            s = mgpu.dot_transposed_b(
                tuple(qs_smem.at[sb, i] for i in range(kk)),
                tuple(kst_smem.at[i, pl.ds(sb * sub, sub)] for i in range(kk)),
                interpret=interpret)
            s = (s + bcast_rows(biases[sb], s.shape)) * jnp.float32(scale)
            if soft_cap is not None:
                s = jnp.float32(soft_cap) * jnp.tanh(s / jnp.float32(soft_cap))
            pos = step0 + sb * sub + iota((_MMA_ROWS, sub), 1)
            seen = (pos >= lo) & (pos < hi)
            logits.append((jnp.where(seen, s, NEG_INF), seen))
        m_new = m_prev
        for s, _ in logits:
            m_new = jnp.maximum(m_new, s.max(axis=1))
        alpha = jnp.exp(m_prev - m_new)
        probs = [jnp.exp(s - bcast_rows(m_new, s.shape)) for s, _ in logits]
        l_new = l_prev * alpha
        for p in probs:
            l_new = l_new + p.sum(axis=1)

        plgpu.barrier_wait(v_bars.at[slot])
        for pc in range(vpc):
            vcodes = load(vc_smem.at[slot, pc], wg).astype(jnp.int32)
            for i in range(vk):
                vst_smem.at[i * vpc + pc][...] = _to_float((vcodes >> (i * v_bits)) & vmask,
                                                           dtype, v_bits)
        plgpu.commit_smem()

        new_accs = []
        for piece in range(n_pieces):
            i, pc = divmod(piece, vpc)
            g = (i * vpc * vw + pc * vw) // v_group  # the piece's channel group
            acc = accs[piece] * bcast_rows(alpha, accs[piece].shape)
            for sb in range(n_sub):
                p, (_, seen) = probs[sb], logits[sb]
                toks = pl.ds(sb * sub, sub)
                # A sub-block lies in one page chunk (sub <= chunk: G divides the page).
                ci, off = divmod(sb * sub, chunk)
                sz = vsz_smem.at[slot, ci]
                s_t = load(sz.at[0, g, pl.ds(off, sub)], cols_l).astype(jnp.float32)
                z_t = load(sz.at[1, g, pl.ds(off, sub)], cols_l).astype(jnp.float32)
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

                acc = acc + pl.run_scoped(pv, plgpu.ACC((_MMA_ROWS, vw), jnp.float32))
                acc = acc + bcast_rows(pz, acc.shape)
            new_accs.append(acc)

        @pl.when(j + stages < num_steps)
        def _():
            issue(j + stages)

        return tuple(new_accs), m_new, l_new

    accs, m, l_sum = jax.lax.fori_loop(0, num_steps, step, (acc0, m0, l0))
    seen = l_sum > 0.0
    safe_l = jnp.where(seen, l_sum, 1.0)
    for piece, acc in enumerate(accs):
        o_ref[s_idx, b, h, piece] = jnp.where(
            bcast_rows(seen, acc.shape), acc / bcast_rows(safe_l, acc.shape), 0.0)
    lse_ref[s_idx, b, h] = jnp.where(seen, m + jnp.log(safe_l), NEG_INF)


@functools.partial(jax.jit, static_argnames=(
    "k_bits", "v_bits", "scale", "soft_cap", "sliding_window", "num_sms", "interpret"))
def _pages(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, quant_lengths, block_tables,
           q_pos, *, k_bits, v_bits, scale, soft_cap, sliding_window, num_sms, interpret):
    batch, _, q_heads, _ = q.shape
    kv_heads, _, page_size, k_packed = k_codes.shape
    head_dim, group, v_dim, v_group = _parts(k_codes, k_scale, v_codes, v_scale, k_bits, v_bits)
    rows = q_heads // kv_heads
    max_pages = block_tables.shape[1]
    dtype = jnp.float16 if q.dtype == jnp.float16 else jnp.bfloat16
    kk, vk = codes_per_byte(k_bits), codes_per_byte(v_bits)
    kw = head_dim // kk
    v_packed = v_codes.shape[-1]
    vw = min(v_group, v_packed)  # channels (= bytes) per value piece
    vpc = v_packed // vw
    n_pieces = vk * vpc
    n_groups = v_dim // v_group
    sub = min(group, _BLOCK_TOKENS)
    n_sub = _BLOCK_TOKENS // sub
    sbytes = jnp.dtype(k_scale.dtype).itemsize
    stage_bytes = _BLOCK_TOKENS * (k_packed + v_packed) + 2 * n_sub * head_dim * sbytes \
        + 2 * n_groups * _BLOCK_TOKENS * sbytes
    fixed_bytes = 2 * (kk + n_sub * kk) * _MMA_ROWS * kw + 2 * _BLOCK_TOKENS * (head_dim + v_dim)
    cfg = kernel_config(batch, kv_heads, max_pages, page_size, stage_bytes, fixed_bytes,
                        num_sms)
    splits, pps = cfg.num_splits, cfg.pages_per_split
    chunks = cfg.block_tokens // cfg.chunk

    # Queries by key field: [batch, kv_heads, fields, 64 rows, channels per field].
    qg = q[:, 0].reshape(batch, kv_heads, rows, kk, kw).transpose(0, 1, 3, 2, 4)
    qg = jnp.pad(qg.astype(dtype), ((0, 0), (0, 0), (0, 0), (0, _MMA_ROWS - rows), (0, 0)))
    ks = k_scale.reshape(*k_scale.shape[:3], kk, kw)  # a free reshape of the last axis
    kz = k_zero.reshape(*k_zero.shape[:3], kk, kw)
    vsz = jnp.stack([v_scale, v_zero], axis=2).swapaxes(-1, -2)  # [kvh, pages, 2, groups, ps]
    lo, hi = c.visit_bounds(q_pos, quant_lengths, max_pages * page_size, sliding_window)
    tables = jnp.pad(block_tables.astype(jnp.int32),
                     ((0, 0), (0, (splits - 1) * pps + cfg.table_window - max_pages)))
    kernel = functools.partial(
        _kernel, cfg=cfg, page_size=page_size, k_bits=k_bits, v_bits=v_bits, group=group,
        v_group=v_group, scale=scale, soft_cap=soft_cap, interpret=interpret)
    st = cfg.num_stages
    sdt = k_scale.dtype
    out, lse = plgpu.kernel(
        kernel,
        out_type=(
            jax.ShapeDtypeStruct((splits, batch, kv_heads, n_pieces, _MMA_ROWS, vw), jnp.float32),
            jax.ShapeDtypeStruct((splits, batch, kv_heads, _MMA_ROWS), jnp.float32),
        ),
        scratch_types=(
            plgpu.SMEM((kk, _MMA_ROWS, kw), dtype, transforms=_swizzled(kw, 2)),  # q
            plgpu.SMEM((n_sub, kk, _MMA_ROWS, kw), dtype, transforms=_swizzled(kw, 2)),  # q s
            plgpu.SMEM((st, _BLOCK_TOKENS, k_packed), jnp.uint8,
                       transforms=_swizzled(k_packed, 1)),
            plgpu.SMEM((st, n_sub, kk, kw), sdt),
            plgpu.SMEM((st, n_sub, kk, kw), sdt),
            plgpu.SMEM((st, vpc, _BLOCK_TOKENS, vw), jnp.uint8, transforms=_swizzled(vw, 1)),
            plgpu.SMEM((st, chunks, 2, n_groups, cfg.chunk), sdt),
            plgpu.SMEM((kk, _BLOCK_TOKENS, kw), dtype, transforms=_swizzled(kw, 2)),
            # P V's K is a sub-block's tokens: a multiple of the swizzle's width in elements.
            plgpu.SMEM((n_pieces, _BLOCK_TOKENS, vw), dtype,
                       transforms=_swizzled(min(vw, sub), 2)),
            plgpu.SMEM((cfg.table_window,), jnp.int32),
            plgpu.Barrier(),
            plgpu.Barrier(),
            plgpu.Barrier(num_arrivals=3 * chunks, num_barriers=st),
            plgpu.Barrier(num_arrivals=chunks * (vpc + 1), num_barriers=st),
            (plgpu.SMEM((n_sub, _MMA_ROWS, sub), dtype, transforms=_swizzled(sub, 2))
             if mgpu.wgmma_a_from_smem(interpret) else None),
        ),
        grid=(splits, kv_heads, batch),
        grid_names=("split", "kv_head", "seq"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=mgpu.resolve_interpret(interpret),
    )(qg, k_codes, ks, kz, v_codes, vsz, lo, hi, tables)
    # Piece (field i, byte columns pc) holds channels i * v_packed + pc * vw + [0, vw), so
    # pieces in order are the channels in order.
    out = out[:, :, :, :, :rows].transpose(0, 1, 2, 4, 3, 5).reshape(
        splits, batch, kv_heads, rows, v_dim)
    out, lse = merge_splits(out, lse[..., :rows])
    return c.unfold(out, lse, 1)


def _check(op, q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, quant_lengths,
           block_tables, q_pos, k_bits, v_bits, num_sms):
    c.check_gqa_pages(op, q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, quant_lengths,
                      block_tables, q_pos, k_bits, v_bits)
    reason = unsupported_reason(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                                k_bits=k_bits, v_bits=v_bits)
    if reason is not None:
        raise ValueError(f"{op}: {reason} Use the Triton kernel (gpu.py) for these shapes.")
    if not isinstance(num_sms, int) or num_sms < 1:
        raise ValueError(f"{op}: num_sms must be an int >= 1, got {num_sms!r}.")


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
    interpret=False,
) -> tuple[Float[Array, "batch q_len q_heads v_head_dim"], Float[Array, "batch q_len q_heads"]]:
    """The Mosaic GPU kernel for `reference.quantized_pages_attention` (decode rows).

    Args:
      q ... sliding_window: as in the reference; q_len must be 1. Queries in bfloat16 or
        float32 run the tensor cores in bfloat16, float16 queries in float16 (the query
        times each key scale, the converted codes and the scaled probabilities are rounded
        to that dtype; accumulation in float32).
      num_sms: SMs of the target GPU, for the split count (132 on H100 and H200); static.
      interpret: False to compile for the GPU; True, or
        `kernels_pallas._mosaic_gpu.interpret_params(...)`, to run Mosaic GPU's interpreter.

    Returns:
      (out float32 [batch, 1, q_heads, v_head_dim], lse float32 [batch, 1, q_heads]).

    Raises:
      ValueError / TypeError: on arguments the reference refuses, or shapes this kernel does
        not take (`unsupported_reason`), before tracing.
    """
    op = "quantized_pages_attention[mosaic_gpu]"
    _check(op, q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, quant_lengths,
           block_tables, q_pos, k_bits, v_bits, num_sms)
    return _pages(
        q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, quant_lengths.astype(jnp.int32),
        block_tables, q_pos.astype(jnp.int32), k_bits=k_bits, v_bits=v_bits,
        scale=float(scale), soft_cap=None if soft_cap is None else float(soft_cap),
        sliding_window=None if sliding_window is None else int(sliding_window),
        num_sms=num_sms, interpret=interpret)


def quantized_attention(
    q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, tail_k, tail_v, quant_lengths,
    lengths, block_tables, q_pos, *, k_bits, v_bits, scale, soft_cap=None, sliding_window=None,
    num_sms: int = mgpu.H100_NUM_SMS, interpret=False,
):
    """Drop-in for `reference.quantized_attention` (decode rows): the kernel's pages part
    merged with the full-precision tail by log-sum-exp.

    Returns:
      (out [batch, 1, q_heads, v_head_dim] in q's dtype, lse float32 [batch, 1, q_heads]).
    """
    opts = dict(scale=scale, soft_cap=soft_cap, sliding_window=sliding_window)
    out_q, lse_q = quantized_pages_attention(
        q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, quant_lengths, block_tables,
        q_pos, k_bits=k_bits, v_bits=v_bits, num_sms=num_sms, interpret=interpret, **opts)
    return qref.merge_with_tail(out_q, lse_q, q, tail_k, tail_v, quant_lengths, lengths, q_pos,
                                **opts)
