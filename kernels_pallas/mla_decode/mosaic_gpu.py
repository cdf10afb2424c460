"""Paged MLA decode in absorbed form as a Mosaic GPU kernel (Hopper `wgmma`).

MQA over the latent: every query head attends over the same cached tokens,
key [c_KV, k_rope] (d_c + d_rope wide) and value c_KV. Absorbed decode does
about 2 x q_heads FLOP per latent byte, so at 128 heads it is compute-bound
on Hopper (about 240 FLOP/B against a bf16 ridge near 206): the design
reads each latent page once per 64 query heads and keeps both products on
the tensor cores. Choices, after FlashMLA (`csrc/sm90/decode/dense/`):

  * one CTA = 64 query heads (wgmma's M) of one sequence and one split, with
    three warpgroups: two compute warpgroups and one that only issues TMA
    copies (`set_max_registers` moves the registers to the compute ones);
  * a step covers 64 cached tokens (one page of 64, several smaller pages, or
    part of a larger one, each piece one TMA copy), double-buffered in shared
    memory: 2 x 64 x 576 bf16 plus the 64 x 576 query block is 216 KiB of the
    227 KiB a Hopper block may use;
  * the two compute warpgroups split a step's tokens for Q K^T (32 each, K =
    d_c + d_rope) and the output's columns for P V (d_c / 2 each, so the f32
    accumulator is 128 registers a thread): every warpgroup does half of both
    products. They exchange their row maxima and their 16-bit probabilities
    through shared memory (two warpgroup barriers per step), so both hold the
    same running maximum and P V sees all 64 tokens. Shared memory leaves no
    room for exchanging f32 partial logits (a K split of Q K^T) or for a
    third stage;
  * shared memory is tiled with a 64-byte swizzle: Mosaic's wgmma needs K a
    multiple of the swizzle width, and P V's K is a warpgroup's 32 tokens
    (with 128 bytes it would need 64); the probabilities are P V's A operand
    in shared memory, whose swizzle must match the latent's;
  * the grid is (batch, splits, head blocks) with the head blocks innermost
    (CUDA's x): the CTAs that read the same pages run side by side, so the
    second read of a page hits L2;
  * split-K over a sequence's token blocks, the count chosen from the SM count
    (`num_sms`) so that batch x head blocks x splits fills one wave (one CTA
    per SM: shared memory allows no second); the splits' partial outputs and
    log-sum-exps are merged by `kernels_pallas.merge`;
  * visible tokens only: a split's loop ends at the sequence's length, block
    table entries past it are never used as addresses (a step that reaches
    past the last visible page re-reads that page), logits past the length are
    masked and the latent rows past it are zeroed in shared memory before P V,
    so NaN or inf there cannot reach the output.

Not yet measured on a GPU (checked in Mosaic GPU's interpreter with race
detection and lowered for an H100 from CPU: tests/kernels/test_mosaic_gpu_mla.py).
The last step's latent rows past the length are cleared through registers,
32 columns at a time.

Head counts that are not a multiple of 64 (a TP shard's 16, a tiny model's
4) are padded with zero queries. Float32 is refused (`unsupported_reason`):
wgmma reads float32 only as tf32 and only K-major, which neither keeps the
precision asked for nor fits P V's value operand.
"""

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from kernels_pallas import _mosaic_gpu as mgpu
from kernels_pallas._mosaic_gpu import plgpu
from kernels_pallas.merge import merge_splits
from kernels_pallas.mla_decode._common import check_mla_shapes

__all__ = ["mla_decode_attention", "unsupported_reason", "choose_num_splits"]

BLOCK_HEADS = 64  # wgmma's M
BLOCK_TOKENS = 64  # cached tokens per pipeline step
NUM_STAGES = 2
SWIZZLE = 64  # bytes
ZERO_COLS = 32  # latent columns cleared per chunk past a length
SMEM_BYTES = 227 * 1024  # what one Hopper block may use
DTYPES = (jnp.bfloat16, jnp.float16)
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


def _smem_bytes(d_c: int, d_rope: int, itemsize: int) -> int:
    width = d_c + d_rope
    q = BLOCK_HEADS * width * itemsize
    pages = NUM_STAGES * BLOCK_TOKENS * width * itemsize
    probs = BLOCK_HEADS * BLOCK_TOKENS * itemsize
    rows = 1024  # row maxima and sums (4 x 64 f32)
    barriers = 1024  # each allocation is aligned to 1 KiB
    return q + pages + probs + rows + barriers


def unsupported_reason(
    q_latent: Float[Array, "batch q_heads d_c"],
    q_rope: Float[Array, "batch q_heads d_rope"],
    latent_pages: Float[Array, "pages page_size d_c"],
    rope_pages: Float[Array, "pages page_size d_rope"],
) -> str | None:
    """None if this kernel takes these shapes and dtypes, else a sentence saying why not.

    Only shapes and dtypes are read (arrays or `jax.ShapeDtypeStruct`s); whether they form
    one absorbed-MLA decode is `mla_decode_attention`'s check (`_common.check_mla_shapes`).
    """
    arrays = (q_latent, q_rope, latent_pages, rope_pages)
    if any(len(x.shape) != 3 for x in arrays):
        return (f"the Mosaic GPU MLA kernel takes 3-D queries and pools, got shapes "
                f"{[tuple(x.shape) for x in arrays]}")
    dtypes = {jnp.dtype(x.dtype) for x in arrays}
    if len(dtypes) != 1 or next(iter(dtypes)) not in map(jnp.dtype, DTYPES):
        return (f"the Mosaic GPU MLA kernel takes bfloat16 or float16 queries and pages of "
                f"one dtype, got {sorted(str(d) for d in dtypes)}; wgmma reads float32 only "
                f"as tf32 and only K-major, which loses float32's precision and cannot hold "
                f"the value operand")
    d_c, d_rope = q_latent.shape[-1], q_rope.shape[-1]
    if d_c % 64 or not 64 <= d_c <= 512:
        return (f"the Mosaic GPU MLA kernel needs d_c a multiple of 64 in [64, 512] (two "
                f"warpgroups each own d_c / 2 output columns: whole 32-column swizzle tiles, "
                f"at most wgmma's N of 256), got {d_c}")
    if d_rope % 32 or d_rope < 32:
        return (f"the Mosaic GPU MLA kernel needs d_rope a positive multiple of 32 (whole "
                f"64-byte swizzle tiles), got {d_rope}")
    page_size = latent_pages.shape[1]
    if page_size % 8 or (page_size < BLOCK_TOKENS and BLOCK_TOKENS % page_size) or (
            page_size > BLOCK_TOKENS and page_size % BLOCK_TOKENS):
        return (f"the Mosaic GPU MLA kernel copies {BLOCK_TOKENS} tokens a step by TMA in "
                f"pieces of whole 8-row tiles, so page_size must divide {BLOCK_TOKENS} or be "
                f"a multiple of it (8, 16, 32, 64, 128, ...), got {page_size}")
    need = _smem_bytes(d_c, d_rope, jnp.dtype(q_latent.dtype).itemsize)
    if need > SMEM_BYTES:
        return (f"the Mosaic GPU MLA kernel needs {need} bytes of shared memory for "
                f"d_c={d_c}, d_rope={d_rope}, more than a Hopper block's {SMEM_BYTES}")
    return None


def choose_num_splits(batch: int, head_blocks: int, num_blocks: int, num_sms: int) -> int:
    """Splits per sequence so that batch x head_blocks x splits fills at most one wave of
    `num_sms` CTAs (one per SM), at most one split per token block."""
    return max(1, min(num_sms // max(1, batch * head_blocks), num_blocks))


def _kernel(
    lengths_ref,  # i32[batch] (GMEM)
    tables_ref,  # i32[batch, max_pages] (GMEM)
    ql_ref,  # [batch, heads_p, d_c]
    qr_ref,  # [batch, heads_p, d_rope]
    lat_ref,  # [pages, page_size, d_c]
    rope_ref,  # [pages, page_size, d_rope]
    out_ref,  # f32[splits, batch, heads_p, d_c]
    lse_ref,  # f32[splits, batch, heads_p]
    q_smem,  # [64, d_c]
    qr_smem,  # [64, d_rope]
    lat_smem,  # [stages, 64, d_c]
    rope_smem,  # [stages, 64, d_rope]
    p_smem,  # [2, 64, 32]: each warpgroup's probabilities
    rows_smem,  # f32[4, 64]: each warpgroup's row maxima of a step, then its row sums
    q_bar,  # the query copies
    kv_bar,  # [stages]: a step's page copies landed
    kv_free,  # [stages]: both compute warpgroups are done with a step's buffers
    x_bar,  # the two compute warpgroups meet (2 arrivals)
    *,
    scale: float,
    num_splits: int,
    page_size: int,
    interpret,
    num_stages: int = NUM_STAGES,
    latent: Any = None,
):
    # `latent`, when given, brings the latent in another form (e.g. quantized codes): the
    # memory warpgroup calls `latent.fetch(page, rows, dst, slot, barrier)` in place of the
    # latent page copy, and each compute warpgroup calls `latent.convert(slot, step, wg,
    # length)` once a step's copies land, which writes that warpgroup's d_c / 2 columns of
    # the step's latent into `lat_smem[0]` (one buffer; `lat_ref` is unused). A third
    # warpgroup barrier per step then makes both halves visible to both products.
    b = lax.axis_index("batch")
    split = lax.axis_index("split")
    hb = lax.axis_index("heads")
    wg = lax.axis_index("wg")
    d_c = q_smem.shape[1]
    half = d_c // 2
    tok_half = BLOCK_TOKENS // 2
    piece = min(page_size, BLOCK_TOKENS)
    pieces = BLOCK_TOKENS // piece
    dtype = q_smem.dtype

    length = lengths_ref[b]
    num_blocks = lax.div(length + (BLOCK_TOKENS - 1), BLOCK_TOKENS)
    per_split = lax.div(num_blocks + (num_splits - 1), num_splits)
    lo = jnp.minimum(split * per_split, num_blocks)
    hi = jnp.minimum(lo + per_split, num_blocks)
    heads = pl.ds(hb * BLOCK_HEADS, BLOCK_HEADS)

    @pl.when(wg == 2)
    def _memory_warpgroup():
        plgpu.set_max_registers(40, action="decrease")
        plgpu.copy_gmem_to_smem(ql_ref.at[b, heads], q_smem, q_bar)
        plgpu.copy_gmem_to_smem(qr_ref.at[b, heads], qr_smem, q_bar)
        last_page = lax.div(jnp.maximum(length, 1) - 1, page_size)

        def fetch(step, slot):
            for j in range(pieces):
                tok = step * BLOCK_TOKENS + j * piece
                # A piece past the length re-reads the last visible page: table entries
                # past it are never addresses.
                page = tables_ref[b, jnp.minimum(lax.div(tok, page_size), last_page)]
                # Pages up to a step wide hold whole pieces; a wider page holds whole steps.
                start = 0 if page_size <= BLOCK_TOKENS else pl.multiple_of(
                    lax.rem(tok, page_size), BLOCK_TOKENS)
                rows = pl.ds(start, piece)
                dst = pl.ds(j * piece, piece)
                if latent is None:
                    plgpu.copy_gmem_to_smem(lat_ref.at[page, rows], lat_smem.at[slot, dst],
                                            kv_bar.at[slot])
                else:
                    latent.fetch(page, rows, dst, slot, kv_bar.at[slot])
                plgpu.copy_gmem_to_smem(rope_ref.at[page, rows], rope_smem.at[slot, dst],
                                        kv_bar.at[slot])

        @pl.loop(lo, hi)
        def _(step):
            i = step - lo
            slot = lax.rem(i, num_stages)

            @pl.when(i >= num_stages)
            def _():
                plgpu.barrier_wait(kv_free.at[slot])

            fetch(step, slot)

        # Observe the last steps' releases too: no barrier phase is left unwaited at exit.
        @pl.loop(jnp.maximum(hi - num_stages, lo), hi)
        def _(step):
            plgpu.barrier_wait(kv_free.at[lax.rem(step - lo, num_stages)])

    @pl.when(wg < 2)
    def _compute_warpgroup():
        plgpu.set_max_registers(232, action="increase")
        other = 1 - wg
        cols = pl.ds(wg * half, half)
        mine = pl.ds(wg * tok_half, tok_half)
        qk_scale = jnp.float32(scale * _LOG2E)  # logits in log2 units: exp2 below
        wgmma_layout = plgpu.Layout.WGMMA
        row_layout = plgpu.Layout.WGMMA.reduce(1)
        layout_cast = functools.partial(mgpu.layout_cast, interpret=interpret)
        iota = functools.partial(mgpu.broadcasted_iota, jnp.int32, layout=wgmma_layout,
                                 interpret=interpret)

        def load_rows(ref):  # a [64] f32 row vector, as the accumulator's rows
            return mgpu.load(ref, row_layout, interpret=interpret)

        def step_fn(step, carry):
            acc, m_prev, l_prev = carry
            slot = lax.rem(step - lo, num_stages)
            plgpu.barrier_wait(kv_bar.at[slot])
            buf = slot
            if latent is not None:
                latent.convert(slot, step, wg, length)
                plgpu.commit_smem()
                plgpu.barrier_arrive(x_bar)
                plgpu.barrier_wait(x_bar)
                buf = 0

            s = mgpu.dot_transposed_b((q_smem, qr_smem),
                                      (lat_smem.at[buf, mine], rope_smem.at[slot, mine]),
                                      interpret=interpret)
            pos = (step * BLOCK_TOKENS + wg * tok_half) + iota((BLOCK_HEADS, tok_half), 1)
            s = jnp.where(pos < length, s * qk_scale, -jnp.inf)
            m_mine = s.max(axis=1)
            rows_smem[wg] = m_mine
            plgpu.barrier_arrive(x_bar)
            plgpu.barrier_wait(x_bar)
            # The first token of every step is visible, so m_new is finite.
            m_new = jnp.maximum(m_prev, jnp.maximum(m_mine, load_rows(rows_smem.at[other])))
            alpha = jnp.exp2(m_prev - m_new)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            l_new = l_prev * alpha + p.sum(axis=1)
            p_smem[wg] = p.astype(dtype)

            # Latent rows past the length may hold NaN or inf; P V must not see them.
            # Both warpgroups' Q K^T is done (x_bar), and each clears only its own columns.
            visible = length - step * BLOCK_TOKENS

            def clear_rows():
                for c0 in range(0, half, ZERO_COLS):  # a few registers at a time
                    v_ref = lat_smem.at[buf, :, pl.ds(wg * half + c0, ZERO_COLS)]
                    v = mgpu.load(v_ref, wgmma_layout, interpret=interpret)
                    row = iota(v.shape, 0)
                    v_ref[...] = jnp.where(row < visible, v, jnp.zeros_like(v))

            if latent is None:  # a converted latent has them zeroed by `latent.convert`
                pl.when(visible < BLOCK_TOKENS)(clear_rows)

            plgpu.commit_smem()
            plgpu.barrier_arrive(x_bar)
            plgpu.barrier_wait(x_bar)

            acc = _accumulate_pv(
                acc, alpha, p_smem,
                lambda t: lat_smem.at[buf, pl.ds(t * tok_half, tok_half), cols],
                in_place=mgpu.wgmma_acc_in_place(interpret))
            plgpu.barrier_arrive(kv_free.at[slot])
            return acc, m_new, l_new

        acc = layout_cast(jnp.zeros((BLOCK_HEADS, half), jnp.float32), wgmma_layout)
        m = layout_cast(jnp.full((BLOCK_HEADS,), -jnp.inf, jnp.float32), row_layout)
        l_sum = layout_cast(jnp.zeros((BLOCK_HEADS,), jnp.float32), row_layout)
        plgpu.barrier_wait(q_bar)
        acc, m, l_sum = lax.fori_loop(lo, hi, step_fn, (acc, m, l_sum))

        # Each warpgroup summed its own tokens' probabilities under the shared maxima.
        rows_smem[2 + wg] = l_sum
        plgpu.barrier_arrive(x_bar)
        plgpu.barrier_wait(x_bar)
        l_sum = l_sum + load_rows(rows_smem.at[2 + other])
        seen = l_sum > 0.0
        safe_l = jnp.where(seen, l_sum, 1.0)
        out = acc * lax.broadcast_in_dim(1.0 / safe_l, acc.shape, [0])
        out_ref[split, b, heads, cols] = out

        # Warpgroup 1 read row 0 (warpgroup 0's maxima) before the barrier above.
        @pl.when(wg == 0)
        def _():
            lse_smem = rows_smem.at[0]
            lse_smem[...] = jnp.where(seen, (m + jnp.log2(safe_l)) * _LN2, -jnp.inf)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[split, b, heads])
            plgpu.wait_smem_to_gmem(0)


def _accumulate_pv(acc, alpha, p_smem, v_of, *, in_place: bool):
    """`acc * alpha[:, None] + P @ V` over the step's two token halves, P from `p_smem[t]`
    and V from `v_of(t)`.

    In place (compiled; `mgpu.wgmma_acc_in_place`): wgmma accumulates into the rescaled
    accumulator's own registers. Otherwise (interpreters before jax 0.12) the product goes
    to a fresh accumulator and is added after.
    """
    scaled = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

    def pv(acc_ref):
        for t in range(2):
            plgpu.wgmma(acc_ref, p_smem.at[t], v_of(t))

    if in_place:
        return pl.run_state(pv)(plgpu.ACC.init(scaled))

    def fresh(acc_ref):
        pv(acc_ref)
        return acc_ref[...]

    return scaled + pl.run_scoped(fresh, plgpu.ACC(acc.shape, jnp.float32))


def _swizzled(shape, dtype):
    """A shared-memory buffer in wgmma's tiling with a 64-byte swizzle: a wgmma's K must be
    a multiple of the swizzle's width, and P V's K is a warpgroup's 32 tokens."""
    minor = SWIZZLE // jnp.dtype(dtype).itemsize
    return plgpu.SMEM(shape, dtype, transforms=(
        plgpu.TilingTransform((8, minor)), plgpu.SwizzleTransform(SWIZZLE)))


@functools.partial(jax.jit, static_argnames=("scale", "num_sms", "interpret"))
def _decode(q_latent, q_rope, latent_pages, rope_pages, lengths, block_tables, *, scale,
            num_sms, interpret):
    batch, q_heads, d_c = q_latent.shape
    d_rope = q_rope.shape[-1]
    page_size = latent_pages.shape[1]
    dtype = q_latent.dtype
    heads_p = -(-q_heads // BLOCK_HEADS) * BLOCK_HEADS
    head_blocks = heads_p // BLOCK_HEADS
    max_blocks = -(-block_tables.shape[1] * page_size // BLOCK_TOKENS)
    splits = choose_num_splits(batch, head_blocks, max_blocks, num_sms)
    pad = ((0, 0), (0, heads_p - q_heads), (0, 0))
    q_latent = jnp.pad(q_latent, pad)
    q_rope = jnp.pad(q_rope, pad)

    kernel = plgpu.kernel(
        functools.partial(_kernel, scale=scale, num_splits=splits, page_size=page_size,
                          interpret=interpret),
        out_type=(
            jax.ShapeDtypeStruct((splits, batch, heads_p, d_c), jnp.float32),
            jax.ShapeDtypeStruct((splits, batch, heads_p), jnp.float32),
        ),
        scratch_types=(
            _swizzled((BLOCK_HEADS, d_c), dtype),
            _swizzled((BLOCK_HEADS, d_rope), dtype),
            _swizzled((NUM_STAGES, BLOCK_TOKENS, d_c), dtype),
            _swizzled((NUM_STAGES, BLOCK_TOKENS, d_rope), dtype),
            _swizzled((2, BLOCK_HEADS, BLOCK_TOKENS // 2), dtype),
            plgpu.SMEM((4, BLOCK_HEADS), jnp.float32),
            plgpu.Barrier(num_arrivals=2),
            plgpu.Barrier(num_arrivals=2 * (BLOCK_TOKENS // min(page_size, BLOCK_TOKENS)),
                          num_barriers=NUM_STAGES),
            plgpu.Barrier(num_arrivals=2, num_barriers=NUM_STAGES),
            plgpu.Barrier(num_arrivals=2),
        ),
        grid=(batch, splits, head_blocks),
        grid_names=("batch", "split", "heads"),
        num_threads=3,
        thread_name="wg",
        kernel_name=f"kvjax_mla_decode_mosaic_gpu_h{heads_p}_p{page_size}",
        # Row reductions of the wgmma layout stay inside a warp: no cross-warp scratch.
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0,
                                              lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret,
    )
    out, lse = kernel(lengths.astype(jnp.int32), block_tables.astype(jnp.int32),
                      q_latent, q_rope, latent_pages, rope_pages)
    out, lse = merge_splits(out, lse)
    return out[:, :q_heads].astype(dtype), lse[:, :q_heads]


def mla_decode_attention(
    q_latent: Float[Array, "batch q_heads d_c"],
    q_rope: Float[Array, "batch q_heads d_rope"],
    latent_pages: Float[Array, "pages page_size d_c"],
    rope_pages: Float[Array, "pages page_size d_rope"],
    lengths: Int[Array, " batch"],
    block_tables: Int[Array, "batch max_pages"],
    *,
    scale: float,
    num_sms: int = mgpu.H100_NUM_SMS,
    interpret: Any = False,
) -> tuple[Float[Array, "batch q_heads d_c"], Float[Array, "batch q_heads"]]:
    """Absorbed-MLA decode on Hopper; same contract as `reference.mla_decode_attention`.

    Args:
      q_latent: [batch, q_heads, d_c], queries already multiplied by W_UK; bf16 or f16.
      q_rope: [batch, q_heads, d_rope].
      latent_pages, rope_pages: one layer's pools [pages, page_size, d_c | d_rope], in
        q_latent's dtype.
      lengths: int32[batch], tokens per sequence including the new one.
      block_tables: int32[batch, max_pages]; entries past a sequence's length are never
        used as addresses.
      scale: softmax scale.
      num_sms: streaming multiprocessors of the target GPU (132 on an H100/H200 SXM); the
        split count fills one wave of them. Passed in, never queried while tracing.
      interpret: False to compile for the GPU; True or
        `kernels_pallas._mosaic_gpu.interpret_params(...)` (e.g. with race detection) to
        run in Mosaic GPU's interpreter on any backend.

    Returns:
      (out in latent space [batch, q_heads, d_c] in q_latent's dtype, lse float32[batch,
      q_heads]).

    Raises:
      ValueError: on shapes that do not form one MLA decode, on shapes or dtypes this
        kernel does not take (`unsupported_reason` says which), on a non-positive scale or
        num_sms; before any tracing.
    """
    op = "mla_decode_attention[mosaic_gpu]"
    check_mla_shapes(op, "gpu", q_latent, q_rope, latent_pages, rope_pages, lengths,
                     block_tables)
    reason = unsupported_reason(q_latent, q_rope, latent_pages, rope_pages)
    if reason is not None:
        raise ValueError(f"{op}: {reason}.")
    if not scale > 0:
        raise ValueError(f"{op}: scale must be positive, got {scale}.")
    if not isinstance(num_sms, int) or num_sms < 1:
        raise ValueError(f"{op}: num_sms must be a positive int, got {num_sms!r}.")
    return _decode(q_latent, q_rope, latent_pages, rope_pages, lengths, block_tables,
                   scale=float(scale), num_sms=num_sms,
                   interpret=mgpu.resolve_interpret(interpret))
