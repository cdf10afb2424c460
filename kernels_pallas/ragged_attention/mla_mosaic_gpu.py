"""Ragged absorbed-MLA attention (chunked prefill, mixed steps) on Hopper as a Mosaic GPU kernel.

The contract of `kernels_pallas/mla_decode/reference.mla_prefill_attention`
(and of the TPU kernel's `mla_prefill_attention`): a batch of rows, row b with
`q_lengths[b]` new queries (0 up to the chunk width; 1 for a decode row) at
positions `lengths[b] - q_lengths[b] + t`, causal against its latent pages;
MQA over the latent (key [c_KV, k_rope], value c_KV). Returns the output in
latent space in the queries' dtype and the float32 log-sum-exp; rows past
`q_lengths` give 0 and -inf. `unsupported_reason` says which shapes it leaves
to the XLA path.

Absorbed, not decompressed, by arithmetic at DeepSeek-V3's widths (d_c 512,
d_rope 64, d_nope 128, d_v 128, 128 heads) on an H100 (989 TFLOP/s bf16 dense,
3.35 TB/s: a ridge near 295 FLOP/B):

* absorbed, a (query, key, head) triple costs 2 (d_c + d_rope) + 2 d_c = 2176
  FLOPs and a key's bytes are its 1152-byte latent row, read once per 64 query
  rows;
* decompressed it costs 2 (d_nope + d_rope) + 2 d_v = 640 FLOPs, but every key
  a chunk sees is first up-projected for every head, 2 d_c (d_nope + d_v) =
  262144 FLOPs per key and head (33.6 MFLOP per key), and written and re-read
  as per-head K and V: 128 x 320 x 2 B = 80 KiB per key, worth 2 x 80 KiB x
  295 FLOP/B = 48.3 MFLOP at the ridge. That is 82 MFLOP-equivalents per key
  per chunk against the 1536 x 128 = 0.197 MFLOP per key and query saved, so
  decompressing pays only for chunks above ~416 query positions (~171 counting
  FLOPs alone). Decode rows, mixed steps and chunks up to 512 (the engine's
  default) are as fast or faster absorbed, the form kvjax's MLA models call,
  and it needs no weights inside the attention op.

Design: the MLA decode kernel's body (`kernels_pallas/mla_decode/mosaic_gpu.py`)
on the GQA ragged kernel's schedule (`mosaic_gpu.work_items`):

* A work item is (head block, row, query block) of 64 query rows (wgmma's
  M): with q_heads <= 64, `64 // q_heads` positions x q_heads heads (all heads
  of a position share its causal limit, so each latent byte brought into
  shared memory serves `64 // q_heads` positions); with more heads, 64 heads
  of one position per item. A decode row is one item; a row with no new
  query has none.
* Three warpgroups as in the decode kernel: warpgroup 2 only issues TMA copies
  (the item's queries, then 64-token steps of latent and rope pages, one copy
  per page piece, into a two-stage ring running across item boundaries);
  warpgroups 0 and 1 split each step's tokens for Q K^T (32 each, K = d_c +
  d_rope) and the output's columns for P V (d_c / 2 each, a 128-register
  float32 accumulator at d_c 512), exchanging row maxima and 16-bit
  probabilities through shared memory (`mla_decode.mosaic_gpu._accumulate_pv`).
  The shared memory is the decode kernel's (216 KiB at d_c 512): one query
  buffer, so the next item's queries are copied once both compute warpgroups
  have finished the last item's last Q K^T (a "queries free" barrier).
* Persistent grid: `min(num_sms, items)` CTAs walk the items longest first,
  round-robin (`work_items`); no split-K and no merge: an item's steps run from
  key 0 to its last query's position.
* Masking: logits of keys past a row's position are selected to -inf (every
  row sees key 0 in step 0, so the running maximum is finite from the first
  step on); latent rows past the item's last query on its last step (the
  unwritten tail of a page, a piece clamped in place of a dead table entry)
  are zeroed in shared memory before P V, each warpgroup its own columns.
  Table entries past the pages an item sees are never addresses.

Not measured on a GPU yet; checked in Mosaic GPU's interpreter with race
detection and lowered for an H100 from CPU (tests/kernels/test_mosaic_gpu_ragged.py).
Known costs to measure first: 64 query rows per CTA (two [64, 256] float32
accumulators fill the compute warpgroups' registers at d_c 512) give 2176 x 64
FLOPs per 1152-byte latent row, about 121 FLOP/B from shared memory, below
an H100's HBM ridge (~295): the design relies on L2 for the re-reads, which
the schedule favours (the items of a row start together and walk its pages
in the same order); the per-item start (a dependent query copy that waits for
the previous item's last Q K^T: ~1-2 us an item, no room in shared memory for
a second query buffer); and rows padded to 64 at head counts that do not
divide 64.
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
from kernels_pallas.mla_decode import mosaic_gpu as mla_mgpu
from kernels_pallas.ragged_attention.mosaic_gpu import work_items

__all__ = ["mla_prefill_attention", "unsupported_reason"]

ROWS = mla_mgpu.BLOCK_HEADS  # query rows per item: wgmma's M
BLOCK_TOKENS = mla_mgpu.BLOCK_TOKENS  # cached tokens per pipeline step
STAGES = mla_mgpu.NUM_STAGES
NEG_INF = float("-inf")
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


def unsupported_reason(q_latent, q_rope, latent_pages, rope_pages) -> str | None:
    """None when this kernel takes these shapes and dtypes; else a sentence saying why not.

    Takes arrays or `jax.ShapeDtypeStruct`s (only shapes and dtypes are read): queries
    [batch, q_len, q_heads, d_c | d_rope], pools [pages, page_size, d_c | d_rope]. The
    limits are the MLA decode kernel's (same shared memory, wgmma and TMA shapes).
    """
    if len(q_latent.shape) != 4 or len(q_rope.shape) != 4:
        return (f"the Mosaic GPU MLA prefill kernel takes 4-D queries [batch, q_len, q_heads, "
                f"width], got {tuple(q_latent.shape)} and {tuple(q_rope.shape)}")

    def per_token(x):
        return jax.ShapeDtypeStruct((x.shape[0], x.shape[2], x.shape[3]), x.dtype)

    return mla_mgpu.unsupported_reason(per_token(q_latent), per_token(q_rope), latent_pages,
                                       rope_pages)


def _kernel(
    lengths_ref,  # i32[batch] (GMEM)
    q_lengths_ref,  # i32[batch]
    tables_ref,  # i32[batch, max_pages]
    items_ref,  # i32[3, max_items]: head block, row, query block of item i (longest first)
    num_items_ref,  # i32[1]
    ql_ref,  # [head_blocks, batch, blocks, 64, d_c]: folded queries
    qr_ref,  # [head_blocks, batch, blocks, 64, d_rope]
    lat_ref,  # [pages, page_size, d_c]
    rope_ref,  # [pages, page_size, d_rope]
    out_ref,  # [head_blocks, batch, blocks, 64, d_c]
    lse_ref,  # f32[head_blocks, batch, blocks, 64]
    q_smem,  # [64, d_c]
    qr_smem,  # [64, d_rope]
    lat_smem,  # [stages, 64, d_c]
    rope_smem,  # [stages, 64, d_rope]
    p_smem,  # [2, 64, 32]: each compute warpgroup's probabilities
    rows_smem,  # f32[4, 64]: each warpgroup's row maxima of a step, then its row sums
    q_bar,  # an item's query copies landed (2 arrivals: latent and rope)
    q_free,  # both compute warpgroups finished an item's Q K^T (2 arrivals)
    kv_bar,  # [stages]: a step's page copies landed
    kv_free,  # [stages]: both compute warpgroups are done with a step's buffers
    x_bar,  # the two compute warpgroups meet (2 arrivals)
    *,
    heads_per_position: int,
    item_positions: int,
    num_programs: int,
    scale: float,
    interpret: Any,
):
    sm = lax.axis_index("sm")
    wg = lax.axis_index("wg")
    page_size = lat_ref.shape[1]
    piece = min(page_size, BLOCK_TOKENS)
    pieces = BLOCK_TOKENS // piece
    d_c = q_smem.shape[1]
    half = d_c // 2
    tok_half = BLOCK_TOKENS // 2
    dtype = q_smem.dtype
    num_items = num_items_ref[0]
    my_items = lax.div(jnp.maximum(num_items - sm, 0) + (num_programs - 1), num_programs)

    def item(k):
        i = sm + k * num_programs
        hb, b, qb = items_ref[0, i], items_ref[1, i], items_ref[2, i]
        length = lengths_ref[b]
        q0 = length - q_lengths_ref[b] + qb * item_positions
        last = jnp.minimum(length, q0 + item_positions) - 1  # the item's last query
        return hb, b, qb, q0, last, lax.div(last, BLOCK_TOKENS) + 1  # ... and its steps

    @pl.when(wg == 2)
    def _memory_warpgroup():
        plgpu.set_max_registers(40, action="decrease")

        def one_item(k, g):
            hb, b, qb, _, last, steps = item(k)

            @pl.when(k > 0)
            def _():
                plgpu.barrier_wait(q_free)

            plgpu.copy_gmem_to_smem(ql_ref.at[hb, b, qb], q_smem, q_bar)
            plgpu.copy_gmem_to_smem(qr_ref.at[hb, b, qb], qr_smem, q_bar)
            last_page = lax.div(last, page_size)

            @pl.loop(0, steps)
            def _(j):
                slot = lax.rem(g + j, STAGES)

                @pl.when(g + j >= STAGES)
                def _():
                    plgpu.barrier_wait(kv_free.at[slot])

                for c in range(pieces):
                    tok = j * BLOCK_TOKENS + c * piece
                    # A piece past the item's last query re-reads its last page: table
                    # entries past it are never addresses.
                    page = tables_ref[b, jnp.minimum(lax.div(tok, page_size), last_page)]
                    start = 0 if page_size <= BLOCK_TOKENS else pl.multiple_of(
                        lax.rem(tok, page_size), BLOCK_TOKENS)
                    rows = pl.ds(start, piece)
                    dst = pl.ds(c * piece, piece)
                    plgpu.copy_gmem_to_smem(lat_ref.at[page, rows], lat_smem.at[slot, dst],
                                            kv_bar.at[slot])
                    plgpu.copy_gmem_to_smem(rope_ref.at[page, rows], rope_smem.at[slot, dst],
                                            kv_bar.at[slot])

            return g + steps

        total = lax.fori_loop(0, my_items, one_item, jnp.int32(0))

        # Observe the last releases too: no barrier phase is left unwaited at exit.
        @pl.when(my_items > 0)
        def _():
            plgpu.barrier_wait(q_free)

        @pl.loop(jnp.maximum(total - STAGES, 0), total)
        def _(g):
            plgpu.barrier_wait(kv_free.at[lax.rem(g, STAGES)])

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
        in_place = mgpu.wgmma_acc_in_place(interpret)

        def load_rows(ref):  # a [64] f32 row vector, as the accumulator's rows
            return mgpu.load(ref, row_layout, interpret=interpret)

        def one_item(k, g):
            hb, b, qb, q0, last, steps = item(k)
            # Row r is position q0 + r // heads_per_position; padding rows act as the last.
            row_pos = jnp.minimum(q0 + lax.div(iota((ROWS, tok_half), 0), heads_per_position),
                                  last)

            def step_fn(j, carry):
                acc, m_prev, l_prev = carry
                slot = lax.rem(g + j, STAGES)
                plgpu.barrier_wait(kv_bar.at[slot])
                s = mgpu.dot_transposed_b(
                    (q_smem, qr_smem), (lat_smem.at[slot, mine], rope_smem.at[slot, mine]),
                    interpret=interpret)

                @pl.when(j == steps - 1)
                def _():  # the item's last Q K^T: its queries' buffer may be refilled
                    plgpu.barrier_arrive(q_free)

                key = (j * BLOCK_TOKENS + wg * tok_half) + iota((ROWS, tok_half), 1)
                s = jnp.where(key <= row_pos, s * qk_scale, NEG_INF)
                m_mine = s.max(axis=1)
                rows_smem[wg] = m_mine
                plgpu.barrier_arrive(x_bar)
                plgpu.barrier_wait(x_bar)
                # Every row sees key 0 (step 0): m_new is finite.
                m_new = jnp.maximum(m_prev, jnp.maximum(m_mine, load_rows(rows_smem.at[other])))
                alpha = jnp.exp2(m_prev - m_new)
                p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                l_new = l_prev * alpha + p.sum(axis=1)
                p_smem[wg] = p.astype(dtype)

                # Latent rows past the item's last query may hold NaN or inf; P V must not
                # see them. Both Q K^T are done (x_bar); each clears only its own columns.
                visible = last + 1 - j * BLOCK_TOKENS

                @pl.when(visible < BLOCK_TOKENS)
                def _():
                    for c0 in range(0, half, mla_mgpu.ZERO_COLS):
                        v_ref = lat_smem.at[slot, :, pl.ds(wg * half + c0, mla_mgpu.ZERO_COLS)]
                        v = mgpu.load(v_ref, wgmma_layout, interpret=interpret)
                        v_ref[...] = jnp.where(iota(v.shape, 0) < visible, v,
                                               jnp.zeros_like(v))

                plgpu.commit_smem()
                plgpu.barrier_arrive(x_bar)
                plgpu.barrier_wait(x_bar)
                acc = mla_mgpu._accumulate_pv(
                    acc, alpha, p_smem,
                    lambda t: lat_smem.at[slot, pl.ds(t * tok_half, tok_half), cols],
                    in_place=in_place)

                @pl.when(j < steps - 1)  # the last step's buffer stages the output first
                def _():
                    plgpu.barrier_arrive(kv_free.at[slot])

                return acc, m_new, l_new

            acc = layout_cast(jnp.zeros((ROWS, half), jnp.float32), wgmma_layout)
            m = layout_cast(jnp.full((ROWS,), NEG_INF, jnp.float32), row_layout)
            l_sum = layout_cast(jnp.zeros((ROWS,), jnp.float32), row_layout)
            plgpu.barrier_wait(q_bar)
            acc, m, l_sum = lax.fori_loop(0, steps, step_fn, (acc, m, l_sum))

            # Each warpgroup summed its own tokens' probabilities under the shared maxima.
            rows_smem[2 + wg] = l_sum
            plgpu.barrier_arrive(x_bar)
            plgpu.barrier_wait(x_bar)
            l_sum = l_sum + load_rows(rows_smem.at[2 + other])
            out = acc * lax.broadcast_in_dim(1.0 / l_sum, acc.shape, [0])
            # The output leaves through the last step's latent buffer (each warpgroup writes
            # its own columns, the only ones its P V read) in one TMA copy; the buffer is
            # released once the copy has read it.
            last_slot = lax.rem(g + steps - 1, STAGES)
            o_smem = lat_smem.at[last_slot]
            o_smem[:, cols] = out.astype(dtype)
            plgpu.commit_smem()
            plgpu.barrier_arrive(x_bar)
            plgpu.barrier_wait(x_bar)

            # Warpgroup 1 read row 0 (warpgroup 0's maxima) before the barriers above; the
            # next item's first write to row 0 comes after this copy is read.
            @pl.when(wg == 0)
            def _():
                lse_smem = rows_smem.at[0]
                lse_smem[...] = (m + jnp.log2(l_sum)) * _LN2
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem, out_ref.at[hb, b, qb])
                plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[hb, b, qb])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            plgpu.barrier_arrive(kv_free.at[last_slot])
            return g + steps

        lax.fori_loop(0, my_items, one_item, jnp.int32(0))

        @pl.when(wg == 0)
        def _():
            plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("scale", "num_sms", "interpret"))
def _prefill(q_latent, q_rope, latent_pages, rope_pages, lengths, block_tables, q_lengths, *,
             scale, num_sms, interpret):
    batch, q_len, q_heads, d_c = q_latent.shape
    d_rope = q_rope.shape[-1]
    page_size = latent_pages.shape[1]
    dtype = q_latent.dtype
    if q_heads <= ROWS:  # several positions per item, all their heads
        head_blocks, hpp = 1, q_heads
        positions = ROWS // q_heads
    else:  # one position per item, 64 heads (padded to whole blocks)
        head_blocks, hpp = -(-q_heads // ROWS), ROWS
        positions = 1
    blocks = pl.cdiv(q_len, positions)

    def fold(q):  # [batch, q_len, q_heads, w] -> [head_blocks, batch, blocks, 64, w]
        w = q.shape[-1]
        q = jnp.pad(q, ((0, 0), (0, blocks * positions - q_len),
                        (0, head_blocks * hpp - q_heads), (0, 0)))
        q = q.reshape(batch, blocks, positions, head_blocks, hpp, w).transpose(3, 0, 1, 2, 4, 5)
        q = q.reshape(head_blocks, batch, blocks, positions * hpp, w)
        return jnp.pad(q, ((0, 0),) * 3 + ((0, ROWS - positions * hpp), (0, 0)))

    lengths = lengths.astype(jnp.int32)
    q_lengths = q_lengths.astype(jnp.int32)
    items, num_items = work_items(lengths, q_lengths, heads=head_blocks, blocks=blocks,
                                  item_positions=positions, block_tokens=BLOCK_TOKENS,
                                  sliding_window=None)
    num_programs = min(num_sms, head_blocks * batch * blocks)
    kernel = functools.partial(
        _kernel, heads_per_position=hpp, item_positions=positions, num_programs=num_programs,
        scale=scale, interpret=interpret)
    swizzled = mla_mgpu._swizzled
    out, lse = plgpu.kernel(
        kernel,
        out_type=(
            jax.ShapeDtypeStruct((head_blocks, batch, blocks, ROWS, d_c), dtype),
            jax.ShapeDtypeStruct((head_blocks, batch, blocks, ROWS), jnp.float32),
        ),
        scratch_types=(
            swizzled((ROWS, d_c), dtype),
            swizzled((ROWS, d_rope), dtype),
            swizzled((STAGES, BLOCK_TOKENS, d_c), dtype),
            swizzled((STAGES, BLOCK_TOKENS, d_rope), dtype),
            swizzled((2, ROWS, BLOCK_TOKENS // 2), dtype),
            plgpu.SMEM((4, ROWS), jnp.float32),
            plgpu.Barrier(num_arrivals=2),
            plgpu.Barrier(num_arrivals=2),
            plgpu.Barrier(num_arrivals=2 * (BLOCK_TOKENS // min(page_size, BLOCK_TOKENS)),
                          num_barriers=STAGES),
            plgpu.Barrier(num_arrivals=2, num_barriers=STAGES),
            plgpu.Barrier(num_arrivals=2),
        ),
        grid=(num_programs,),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        kernel_name=f"kvjax_ragged_mla_mosaic_gpu_h{q_heads}_p{page_size}",
        # Row reductions of the wgmma layout stay inside a warp: no cross-warp scratch.
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0,
                                              lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret,
    )(lengths, q_lengths, block_tables.astype(jnp.int32), items, num_items,
      fold(q_latent), fold(q_rope), latent_pages, rope_pages)

    def unfold(x):  # [head_blocks, batch, blocks, 64, w] -> [batch, q_len, q_heads, w]
        w = x.shape[-1]
        x = x[:, :, :, :positions * hpp].reshape(head_blocks, batch, blocks, positions, hpp, w)
        x = x.transpose(1, 2, 3, 0, 4, 5).reshape(batch, blocks * positions,
                                                   head_blocks * hpp, w)
        return x[:, :q_len, :q_heads]

    # Rows past q_lengths belong to no item (never written) or pad a partial one.
    keep = jnp.arange(q_len)[None, :] < q_lengths[:, None]
    out = jnp.where(keep[:, :, None, None], unfold(out), jnp.zeros((), dtype))
    lse = jnp.where(keep[:, :, None], unfold(lse[..., None])[..., 0], NEG_INF)
    return out, lse


def mla_prefill_attention(
    q_latent: Float[Array, "batch q_len q_heads d_c"],
    q_rope: Float[Array, "batch q_len q_heads d_rope"],
    latent_pages: Float[Array, "pages page_size d_c"],
    rope_pages: Float[Array, "pages page_size d_rope"],
    lengths: Int[Array, " batch"],
    block_tables: Int[Array, "batch max_pages"],
    q_lengths: Int[Array, " batch"],
    *,
    scale: float,
    num_sms: int = mgpu.H100_NUM_SMS,
    interpret: Any = False,
) -> tuple[Float[Array, "batch q_len q_heads d_c"], Float[Array, "batch q_len q_heads"]]:
    """Ragged absorbed-MLA attention on Hopper (Mosaic GPU); the contract of
    `kernels_pallas/mla_decode/reference.mla_prefill_attention`.

    Row b has `q_lengths[b]` new queries (0 <= q_lengths[b] <= min(q_len, lengths[b])),
    query t at position `lengths[b] - q_lengths[b] + t`, causal over the row's latent
    cache (which already holds the new tokens).

    Args:
      q_latent: [batch, q_len, q_heads, d_c], queries already multiplied by W_UK; bfloat16
        or float16.
      q_rope: [batch, q_len, q_heads, d_rope].
      latent_pages, rope_pages: one layer's pools [pages, page_size, d_c | d_rope] in the
        queries' dtype; only pages holding keys some query sees are read.
      lengths: int32[batch], tokens per sequence including the new ones.
      block_tables: int32[batch, max_pages]; entries past what a row's queries see are
        never used as addresses.
      q_lengths: int32[batch], new queries per row.
      scale: softmax scale.
      num_sms: SMs of the target GPU (132 on H100/H200): the persistent grid's size; a
        static argument, never read from the device.
      interpret: False to compile for the GPU; True, or
        `kernels_pallas._mosaic_gpu.interpret_params(...)`, to run Mosaic GPU's
        interpreter on any backend.

    Returns:
      (out in latent space [batch, q_len, q_heads, d_c] in q_latent's dtype, lse
      float32[batch, q_len, q_heads]); rows t >= q_lengths[b] give 0 and -inf.

    Raises:
      ValueError: on shapes that do not form one MLA prefill, shapes and dtypes this kernel
        does not take (`unsupported_reason` says which), a non-positive scale or num_sms;
        before any tracing.
    """
    op = "mla_prefill_attention[mosaic_gpu]"
    if (q_latent.ndim != 4 or q_rope.ndim != 4 or q_latent.shape[:3] != q_rope.shape[:3]
            or latent_pages.ndim != 3 or rope_pages.ndim != 3
            or latent_pages.shape[:2] != rope_pages.shape[:2]
            or latent_pages.shape[2] != q_latent.shape[3]
            or rope_pages.shape[2] != q_rope.shape[3]):
        raise ValueError(
            f"{op}: expected q_latent / q_rope [batch, q_len, q_heads, d_c | d_rope] and "
            f"latent_pages / rope_pages [pages, page_size, d_c | d_rope] of matching widths; "
            f"got {q_latent.shape}, {q_rope.shape}, {latent_pages.shape}, {rope_pages.shape}."
        )
    batch = q_latent.shape[0]
    if block_tables.ndim != 2 or block_tables.shape[0] != batch or lengths.shape != (
            batch,) or q_lengths.shape != (batch,):
        raise ValueError(
            f"{op}: block_tables {block_tables.shape} must be [batch={batch}, max_pages], "
            f"lengths {lengths.shape} and q_lengths {q_lengths.shape} [batch={batch}].")
    reason = unsupported_reason(q_latent, q_rope, latent_pages, rope_pages)
    if reason is not None:
        raise ValueError(f"{op}: {reason}. The XLA path (kvjax.attention) takes these shapes.")
    if not scale > 0:
        raise ValueError(f"{op}: scale must be positive, got {scale}.")
    if not isinstance(num_sms, int) or num_sms < 1:
        raise ValueError(f"{op}: num_sms must be an int >= 1, got {num_sms!r}.")
    if batch == 0 or q_latent.shape[1] == 0:  # no rows or no query slots: nothing to launch
        return (jnp.zeros(q_latent.shape, q_latent.dtype),
                jnp.full(q_latent.shape[:3], NEG_INF, jnp.float32))
    return _prefill(q_latent, q_rope, latent_pages, rope_pages, lengths, block_tables,
                    q_lengths, scale=float(scale), num_sms=num_sms,
                    interpret=mgpu.resolve_interpret(interpret))
