"""Ragged paged attention (decode, chunked prefill, mixed batches) as a Pallas TPU kernel.

One kernel serves every step the engine runs: a batch of rows, row b with
`q_lengths[b]` new queries (0 up to the chunk width q_len; 1 for a decode row)
at positions `lengths[b] - q_lengths[b] + t`, causal against its cache pages;
GQA/MQA/MHA, and absorbed MLA through the same body. The contract and the
oracle are `paged_prefill_attention` / `mla_prefill_attention` of
`kernels_pallas/paged_attention/reference.py` / `kernels_pallas/mla_decode/reference.py`.

Design:
  * grid = (kv_heads,), "parallel"; the loop over sequences runs inside the
    kernel. The wrapper turns the rows' query counts into a schedule of query
    blocks (sequence, block index), `ceil(q_lengths[b] / block_q)` per row, so
    rows with no new query cost nothing and a decode row is one small block;
  * lengths, q_lengths, the (flattened) block tables and the schedule are
    scalar-prefetched into SMEM;
  * queries, outputs and the page pools stay in HBM (`memory_space=pl.ANY`).
    The query heads of one KV head (the GQA group) are folded into the rows of
    a query block (`block_q` positions x group heads: row r is position
    r // group), so each K/V page read serves the whole group and, in a
    prefill chunk, `block_q` positions at once;
  * one async copy per page (`pltpu.make_async_copy`), `block_tokens` tokens
    per inner step, double-buffered, and the pipeline runs across query
    blocks and sequences: the last step of a block starts the copies of the
    next block's first pages, so only the kernel's first step waits on a cold
    copy. Query blocks are double-buffered the same way (the next block's
    queries are in flight while the current one is computed) and outputs are
    written back by DMA from two buffers, waited on two blocks later;
  * a query block reads only the keys its queries can see: from the sliding
    window's first position to its last query's position (a chunk's early
    blocks skip the chunk's later pages);
  * online softmax in float32; bf16 operands go to the MXU as bf16 with f32
    accumulation (the probabilities are rounded to bf16 for P @ V), f32
    operands at HIGHEST precision.

The log-sum-exp is written lane-replicated, `[rows, 128]` per block (the
layout jax's splash attention writes its residuals in), and its first lane is
returned. Table entries outside the keys a block reads are never used, not
even as DMA addresses; VMEM of pages not copied holds stale data (NaN in the
TPU interpreter), selected away with `jnp.where` in logits and values, never
multiplied by zero. Rows past a sequence's `q_lengths` are computed as padding
inside a partial block and set to 0 / -inf by the wrapper.

What the anchor (tpu-inference's ragged paged attention v3) does beyond this:
the KV write of the new tokens fused into the same pipeline, and separately
compiled decode-only / prefill-only / mixed variants with their own block
sizes. Here the write stays a separate op (`kvjax.cache.write`) and one
program serves all three mixes. MLA runs in absorbed form (MQA over the
latent: key [c_KV, k_rope], value c_KV): the form kvjax's MLA models prefill
in. Per query-key pair and head it costs 2 (d_c + d_rope) + 2 d_c FLOPs
against 2 (d_nope + d_rope) + 2 d_v decompressed, but decompressing costs
2 d_c (d_nope + d_v) FLOPs per key and head, so the decompressed form needs
fewer FLOPs only for chunks of more than d_c (d_nope + d_v) / (2 d_c - d_nope -
d_v) query positions (171 at DeepSeek-V3's widths); decode and short chunks
are cheaper absorbed. Not measured on a TPU.

Checked in Pallas' interpret mode and the TPU interpreter (with race
detection) and by lowering to Mosaic for TPU v5e, v6e and v7 from CPU
(tests/kernels/test_ragged_attention.py); not yet compiled by libtpu nor
timed on a TPU.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int

from kernels_pallas.paged_attention.block_sizes import check_head_dim, check_table_width
from kernels_pallas.ragged_attention.block_sizes import (
    RaggedBlockSizes,
    check_work_items,
    resolve_block_sizes,
)

__all__ = ["paged_prefill_attention", "mla_prefill_attention", "ragged_tpu",
           "RaggedBlockSizes", "LSE_LANES"]

NEG_INF = float("-inf")
# Lanes of the log-sum-exp blocks the kernel writes (one vreg row).
LSE_LANES = 128
_NT = (((1,), (1,)), ((), ()))  # contract the last dims: q @ k.T
_NN = (((1,), (0,)), ((), ()))  # p @ v


def _block_rows(buf, slot, tokens):
    """One slot of a [2, pages, page_size, width] page buffer as [tokens, width].

    Collapsing (pages, page_size) is a free relabelling when page_size fills
    whole (8 x packing)-row tiles; otherwise the block goes through float32,
    whose 8-row tiles any page size of the kernels' multiples of 8 fills.
    """
    x = buf[slot]
    packing = 4 // x.dtype.itemsize
    if x.shape[1] % (8 * packing) == 0:
        return x.reshape(tokens, x.shape[-1])
    return x.astype(jnp.float32).reshape(tokens, x.shape[-1]).astype(x.dtype)


def _ragged_kernel(
    lengths_ref,  # SMEM i32[batch]
    q_lengths_ref,  # SMEM i32[batch]
    tables_ref,  # SMEM i32[batch * padded_max_pages]
    item_seq_ref,  # SMEM i32[max_items]: the sequence of query block i
    item_blk_ref,  # SMEM i32[max_items]: its block index within the sequence's chunk
    num_items_ref,  # SMEM i32[1]
    *refs,
    num_parts: int,
    value_is_key0: bool,
    group: int,
    block_q: int,
    pages_per_block: int,
    padded_max_pages: int,
    scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    bf16_qk: bool,
    bf16_pv: bool,
):
    q_hbm = refs[:num_parts]  # HBM [kv_heads, batch, padded_rows, d_i]
    k_hbm = refs[num_parts:2 * num_parts]  # HBM [kv_heads, pages, page_size, d_i]
    rest = refs[2 * num_parts:]
    if value_is_key0:
        v_hbm = None
    else:
        v_hbm, rest = rest[0], rest[1:]
    o_hbm, lse_hbm = rest[0], rest[1]  # HBM [kv_heads, batch, padded_rows, dv | LSE_LANES]
    scratch = rest[2:]
    q_bufs = scratch[:num_parts]  # VMEM [2, rows, d_i]
    k_bufs = scratch[num_parts:2 * num_parts]  # VMEM [2, pages_per_block, page_size, d_i]
    scratch = scratch[2 * num_parts:]
    if value_is_key0:
        v_buf = k_bufs[0]
    else:
        v_buf, scratch = scratch[0], scratch[1:]
    o_buf, lse_buf, acc_ref, kv_sems, q_sems, o_sems = scratch

    h = pl.program_id(0)
    page_size = k_hbm[0].shape[2]
    ppb = pages_per_block
    bk = ppb * page_size
    rows = q_bufs[0].shape[1]
    num_items = num_items_ref[0]
    pools = list(k_hbm) + ([] if value_is_key0 else [v_hbm])
    bufs = list(k_bufs) + ([] if value_is_key0 else [v_buf])

    def geometry(i):
        """Query block i: its sequence, block index, first query position, and the
        first and last key positions any of its queries sees."""
        b = item_seq_ref[i]
        qb = item_blk_ref[i]
        length = lengths_ref[b]
        q0 = length - q_lengths_ref[b] + qb * block_q
        last = jnp.minimum(length, q0 + block_q) - 1
        first = (jnp.int32(0) if sliding_window is None
                 else jnp.maximum(q0 - (sliding_window - 1), 0))
        return b, qb, q0, first, last

    def kv_copies(i, blk, slot, action):
        # Only the pages holding keys the block sees: a loop, not an unrolled
        # list, keeps the kernel small for wide blocks.
        b, _, _, first, last = geometry(i)
        lo = jnp.maximum(blk * ppb, first // page_size)
        hi = jnp.minimum((blk + 1) * ppb, last // page_size + 1)

        def one_page(pos, carry):
            page = tables_ref[b * padded_max_pages + pos]
            for j, (pool, buf) in enumerate(zip(pools, bufs, strict=True)):
                action(pltpu.make_async_copy(
                    pool.at[h, page], buf.at[slot, pos - blk * ppb], kv_sems.at[j, slot]))
            return carry

        jax.lax.fori_loop(lo, hi, one_page, 0)

    def q_copies(i, slot, action):
        b, qb = item_seq_ref[i], item_blk_ref[i]
        for j in range(num_parts):
            action(pltpu.make_async_copy(
                q_hbm[j].at[h, b, pl.ds(qb * rows, rows)], q_bufs[j].at[slot],
                q_sems.at[j, slot]))

    def out_copies(i, slot, action):
        b, qb = item_seq_ref[i], item_blk_ref[i]
        action(pltpu.make_async_copy(
            o_buf.at[slot], o_hbm.at[h, b, pl.ds(qb * rows, rows)], o_sems.at[0, slot]))
        action(pltpu.make_async_copy(
            lse_buf.at[slot], lse_hbm.at[h, b, pl.ds(qb * rows, rows)], o_sems.at[1, slot]))

    def start(c):
        c.start()

    def wait(c):
        c.wait()

    @pl.when(num_items > 0)
    def _():
        q_copies(0, 0, start)
        first = geometry(0)[3]
        kv_copies(0, first // bk, 0, start)

    qk_precision = jax.lax.Precision.DEFAULT if bf16_qk else jax.lax.Precision.HIGHEST
    pv_precision = jax.lax.Precision.DEFAULT if bf16_pv else jax.lax.Precision.HIGHEST

    def item_body(i, kv_slot):
        q_slot = i % 2

        @pl.when(i + 1 < num_items)
        def _():
            q_copies(i + 1, 1 - q_slot, start)

        q_copies(i, q_slot, wait)
        _, _, q0, first, last = geometry(i)
        start_blk, end_blk = first // bk, last // bk + 1
        row_pos = q0 + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) // group
        # Padding rows past the sequence's queries see what its last query sees: no
        # key past `last` was copied.
        row_last = jnp.minimum(row_pos, last)

        def kv_body(blk, carry):
            m_prev, l_prev, slot = carry

            @pl.when(blk + 1 < end_blk)
            def _():
                kv_copies(i, blk + 1, 1 - slot, start)

            @pl.when((blk + 1 == end_blk) & (i + 1 < num_items))
            def _():
                kv_copies(i + 1, geometry(i + 1)[3] // bk, 1 - slot, start)

            kv_copies(i, blk, slot, wait)

            s = None
            for q_buf, k_buf in zip(q_bufs, k_bufs, strict=True):
                q = q_buf[q_slot]
                k = _block_rows(k_buf, slot, bk)
                if not bf16_qk:
                    q, k = q.astype(jnp.float32), k.astype(jnp.float32)
                part = jax.lax.dot_general(q, k, _NT, precision=qk_precision,
                                           preferred_element_type=jnp.float32)
                s = part if s is None else s + part
            s = s * jnp.float32(scale)
            if soft_cap is not None:
                s = jnp.float32(soft_cap) * jnp.tanh(s / jnp.float32(soft_cap))
            k_pos = blk * bk + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
            visible = k_pos <= row_last
            if sliding_window is not None:
                visible &= row_pos - k_pos < sliding_window
            s = jnp.where(visible, s, NEG_INF)  # [rows, bk]

            # A padding row of a windowed block may see nothing: keep exp() at 0, not NaN.
            m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
            alpha = jnp.exp(m_prev - m_safe)
            p = jnp.exp(s - m_safe)
            l_new = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)

            v = _block_rows(v_buf, slot, bk)
            k_col = blk * bk + jax.lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
            v = jnp.where((k_col >= first) & (k_col <= last), v, jnp.zeros_like(v))
            if bf16_pv:
                p = p.astype(v.dtype)
            else:
                v = v.astype(jnp.float32)
            pv = jax.lax.dot_general(p, v, _NN, precision=pv_precision,
                                     preferred_element_type=jnp.float32)
            acc_ref[...] = alpha * acc_ref[...] + pv
            return m_new, l_new, 1 - slot

        acc_ref[...] = jnp.zeros_like(acc_ref)
        init = (jnp.full((rows, 1), NEG_INF, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
                kv_slot)
        m, l_sum, kv_slot = jax.lax.fori_loop(start_blk, end_blk, kv_body, init)

        # The output buffer of this slot was last sent two blocks ago.
        @pl.when(i >= 2)
        def _():
            out_copies(i - 2, q_slot, wait)

        seen = l_sum > 0.0
        safe_l = jnp.where(seen, l_sum, 1.0)
        o_buf[q_slot] = jnp.where(seen, acc_ref[...] / safe_l, 0.0).astype(o_buf.dtype)
        lse = jnp.where(seen, m + jnp.log(safe_l), NEG_INF)
        lse_buf[q_slot] = jnp.broadcast_to(lse, (rows, LSE_LANES))
        out_copies(i, q_slot, start)
        return kv_slot

    jax.lax.fori_loop(0, num_items, item_body, jnp.int32(0))

    def drain(back):  # the output copies still in flight: the last two blocks'
        @pl.when(num_items >= back)
        def _():
            out_copies(num_items - back, (num_items - back) % 2, wait)

    drain(2)
    drain(1)


@functools.partial(
    jax.jit,
    static_argnames=("value_is_key0", "group", "scale", "soft_cap", "sliding_window",
                     "block_q", "block_tokens", "interpret", "name"),
)
def ragged_tpu(
    qs,  # tuple of [batch, q_len, kv_heads * group, d_i]
    k_parts,  # tuple of [kv_heads, pages, page_size, d_i]
    v_pages,  # [kv_heads, pages, page_size, dv] or None (value = k_parts[0])
    lengths,  # i32[batch]
    block_tables,  # i32[batch, max_pages]
    q_lengths,  # i32[batch]
    *,
    value_is_key0: bool,
    group: int,
    scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    block_q: int,
    block_tokens: int,
    interpret,
    name: str,
):
    """The shared TPU body; shapes are validated by the public wrappers.

    Returns (out [batch, q_len, q_heads, dv] in qs[0]'s dtype, lse float32[batch, q_len,
    q_heads]); rows past `q_lengths` are 0 and -inf.
    """
    batch, q_len, q_heads, _ = qs[0].shape
    kv_heads, _, page_size, _ = k_parts[0].shape
    dv = (k_parts[0] if value_is_key0 else v_pages).shape[-1]
    padded_q = pl.cdiv(q_len, block_q) * block_q
    blocks_per_row = padded_q // block_q
    rows = block_q * group

    def fold(q):  # [batch, q_len, heads, d] -> [kv_heads, batch, padded_q * group, d]
        q = jnp.pad(q, ((0, 0), (0, padded_q - q_len), (0, 0), (0, 0)))
        q = q.reshape(batch, padded_q, kv_heads, group, q.shape[-1])
        return q.transpose(2, 0, 1, 3, 4).reshape(kv_heads, batch, padded_q * group, -1)

    ppb = block_tokens // page_size
    max_pages = block_tables.shape[1]
    padded_pages = pl.cdiv(max_pages, ppb) * ppb
    # Padding makes every SMEM address the kernel could form in-bounds; the
    # padded entries lie past every length and are never used.
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, padded_pages - max_pages)))
    tables = tables.reshape(-1)

    # The schedule: the query blocks of every row with new queries, in row order.
    lengths = lengths.astype(jnp.int32)
    q_lengths = q_lengths.astype(jnp.int32)
    per_row = (q_lengths + block_q - 1) // block_q
    ends = jnp.cumsum(per_row)
    slots = jnp.arange(batch * blocks_per_row, dtype=jnp.int32)
    item_seq = jnp.minimum(jnp.searchsorted(ends, slots, side="right"), batch - 1)
    item_seq = item_seq.astype(jnp.int32)
    item_blk = slots - (ends - per_row)[item_seq]
    num_items = ends[-1:].astype(jnp.int32)

    args = [fold(q) for q in qs] + list(k_parts) + ([] if value_is_key0 else [v_pages])
    scratch = [pltpu.VMEM((2, rows, q.shape[-1]), q.dtype) for q in qs]
    scratch += [pltpu.VMEM((2, ppb, page_size, k.shape[-1]), k.dtype) for k in k_parts]
    if not value_is_key0:
        scratch.append(pltpu.VMEM((2, ppb, page_size, dv), v_pages.dtype))
    num_pools = len(k_parts) + (0 if value_is_key0 else 1)
    scratch += [
        pltpu.VMEM((2, rows, dv), qs[0].dtype),
        pltpu.VMEM((2, rows, LSE_LANES), jnp.float32),
        pltpu.VMEM((rows, dv), jnp.float32),
        pltpu.SemaphoreType.DMA((num_pools, 2)),
        pltpu.SemaphoreType.DMA((len(qs), 2)),
        pltpu.SemaphoreType.DMA((2, 2)),
    ]
    is_bf16 = [x.dtype == jnp.bfloat16 for x in (*qs, *k_parts)]
    bf16_qk = all(is_bf16)
    bf16_pv = bf16_qk and (value_is_key0 or v_pages.dtype == jnp.bfloat16)
    kernel = functools.partial(
        _ragged_kernel,
        num_parts=len(qs),
        value_is_key0=value_is_key0,
        group=group,
        block_q=block_q,
        pages_per_block=ppb,
        padded_max_pages=padded_pages,
        scale=scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        bf16_qk=bf16_qk,
        bf16_pv=bf16_pv,
    )
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    out, lse = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(kv_heads,),
            in_specs=[any_spec] * len(args),
            out_specs=[any_spec, any_spec],
            scratch_shapes=scratch,
        ),
        out_shape=[
            jax.ShapeDtypeStruct((kv_heads, batch, padded_q * group, dv), qs[0].dtype),
            jax.ShapeDtypeStruct((kv_heads, batch, padded_q * group, LSE_LANES), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
        name=name,
    )(lengths, q_lengths, tables, item_seq, item_blk, num_items, *args)

    def unfold(x):  # [kv_heads, batch, padded_q * group, w] -> [batch, q_len, q_heads, w]
        x = x.reshape(kv_heads, batch, padded_q, group, x.shape[-1])
        return x.transpose(1, 2, 0, 3, 4).reshape(batch, padded_q, q_heads, -1)[:, :q_len]

    # Rows past q_lengths were never written (or are a partial block's padding).
    valid = jnp.arange(q_len)[None, :] < q_lengths[:, None]  # [batch, q_len]
    out = jnp.where(valid[:, :, None, None], unfold(out), jnp.zeros((), out.dtype))
    lse = jnp.where(valid[:, :, None], unfold(lse[..., :1])[..., 0], NEG_INF)
    return out, lse


def paged_prefill_attention(
    q: Float[Array, "batch q_len q_heads head_dim"],
    k_pages: Float[Array, "kv_heads pages page_size head_dim"],
    v_pages: Float[Array, "kv_heads pages page_size v_head_dim"],
    lengths: Int[Array, " batch"],
    block_tables: Int[Array, "batch max_pages"],
    q_lengths: Int[Array, " batch"],
    *,
    scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    block_sizes: RaggedBlockSizes | None = None,
    max_pages: int | None = None,
    interpret: bool | pltpu.InterpretParams = False,
) -> tuple[Float[Array, "batch q_len q_heads v_head_dim"], Float[Array, "batch q_len q_heads"]]:
    """Ragged paged attention on TPU; same contract as `reference.paged_prefill_attention`.

    Row b has `q_lengths[b]` new queries (0 <= q_lengths[b] <= min(q_len, lengths[b])),
    query t at position `lengths[b] - q_lengths[b] + t`, causal over the row's cache
    (which already holds the new tokens). Decode is q_len 1; a mixed batch pads every
    row to the widest chunk and costs only the blocks its rows fill.

    Args:
      q: [batch, q_len, q_heads, head_dim]; q_heads a multiple of kv_heads.
      k_pages, v_pages: one layer's pools [kv_heads, pages, page_size, head_dim |
        v_head_dim], left in HBM; only the pages holding keys some query sees are read.
      lengths: int32[batch], tokens per sequence including the new ones.
      block_tables: int32[batch, max_pages]; entries past what a row's queries see are
        never read.
      q_lengths: int32[batch], new queries per row.
      scale, soft_cap, sliding_window: as in the reference.
      block_sizes: tiling; None picks the defaults for this geometry.
      max_pages: the declared maximum pages per sequence (CacheSpec.max_pages_per_seq);
        a wider block table raises.
      interpret: False on TPU; True (plain Pallas interpreter) or a `pltpu.InterpretParams`
        (the TPU interpreter, which simulates DMAs, semaphores and VMEM) elsewhere.

    Returns:
      (out [batch, q_len, q_heads, v_head_dim] in q's dtype, lse float32[batch, q_len,
      q_heads]); rows t >= q_lengths[b] give 0 and -inf.

    Raises:
      ValueError: on shapes that do not form one attention, an unsupported head width,
        a block table wider than `max_pages` or than SMEM holds, or block sizes that are
        not whole pages; before any tracing.
    """
    op = "paged_prefill_attention[tpu]"
    _check_gqa(op, q, k_pages, v_pages, lengths, block_tables, q_lengths)
    batch, q_len, q_heads, head_dim = q.shape
    kv_heads, _, page_size, _ = k_pages.shape
    check_head_dim(op, "head_dim", head_dim, "tpu")
    check_head_dim(op, "v_head_dim", v_pages.shape[-1], "tpu")
    check_table_width(op, block_tables.shape, max_pages, "tpu")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"{op}: sliding_window must be an int >= 1 or None, got "
                         f"{sliding_window!r}.")
    group = q_heads // kv_heads
    bs = resolve_block_sizes(op, block_sizes, page_size, block_tables.shape[1], q_len, group)
    check_work_items(op, batch, q_len, bs.block_q)
    return ragged_tpu(
        (q,), (k_pages,), v_pages, lengths, block_tables, q_lengths,
        value_is_key0=False,
        group=group,
        scale=float(head_dim ** -0.5 if scale is None else scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        sliding_window=sliding_window,
        block_q=bs.block_q,
        block_tokens=bs.block_tokens,
        interpret=interpret,
        name=f"kvjax_ragged_paged_attention_tpu_g{group}_bq{bs.block_q}_bt{bs.block_tokens}",
    )


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
    block_sizes: RaggedBlockSizes | None = None,
    max_pages: int | None = None,
    interpret: bool | pltpu.InterpretParams = False,
) -> tuple[Float[Array, "batch q_len q_heads d_c"], Float[Array, "batch q_len q_heads"]]:
    """Ragged absorbed-MLA attention on TPU; same contract as
    `kernels_pallas/mla_decode/reference.mla_prefill_attention`.

    The kernel of `paged_prefill_attention` with one KV head whose group is every query
    head, key [c_KV, k_rope] (logits summed over the two parts, no concatenated copy)
    and value c_KV, so each latent page is copied once per query block for all heads.

    Args:
      q_latent: [batch, q_len, q_heads, d_c], queries already multiplied by W_UK.
      q_rope: [batch, q_len, q_heads, d_rope].
      latent_pages, rope_pages: one layer's pools [pages, page_size, d_c | d_rope].
      lengths, block_tables, q_lengths: as in `paged_prefill_attention`.
      scale: softmax scale.
      block_sizes, max_pages, interpret: as in `paged_prefill_attention`.

    Returns:
      (out in latent space [batch, q_len, q_heads, d_c] in q_latent's dtype, lse
      float32[batch, q_len, q_heads]).

    Raises:
      ValueError: as `paged_prefill_attention`, and on a non-positive scale.
    """
    op = "mla_prefill_attention[tpu]"
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
    _check_rows(op, q_latent.shape[0], lengths, block_tables, q_lengths)
    if not scale > 0:
        raise ValueError(f"{op}: scale must be positive, got {scale}.")
    check_head_dim(op, "d_c", q_latent.shape[3], "tpu")
    check_head_dim(op, "d_rope", q_rope.shape[3], "tpu")
    check_table_width(op, block_tables.shape, max_pages, "tpu")
    batch, q_len, q_heads, _ = q_latent.shape
    bs = resolve_block_sizes(op, block_sizes, latent_pages.shape[1], block_tables.shape[1],
                             q_len, q_heads)
    check_work_items(op, batch, q_len, bs.block_q)
    return ragged_tpu(
        (q_latent, q_rope), (latent_pages[None], rope_pages[None]), None,
        lengths, block_tables, q_lengths,
        value_is_key0=True,
        group=q_heads,
        scale=float(scale),
        soft_cap=None,
        sliding_window=None,
        block_q=bs.block_q,
        block_tokens=bs.block_tokens,
        interpret=interpret,
        name=f"kvjax_ragged_mla_attention_tpu_h{q_heads}_bq{bs.block_q}_bt{bs.block_tokens}",
    )


def _check_rows(op, batch, lengths, block_tables, q_lengths):
    if block_tables.ndim != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"{op}: block_tables {block_tables.shape} must be [batch={batch}, "
                         f"max_pages].")
    if lengths.shape != (batch,) or q_lengths.shape != (batch,):
        raise ValueError(f"{op}: lengths {lengths.shape} and q_lengths {q_lengths.shape} must "
                         f"be [batch={batch}].")


def _check_gqa(op, q, k_pages, v_pages, lengths, block_tables, q_lengths):
    if q.ndim != 4 or k_pages.ndim != 4 or v_pages.ndim != 4:
        raise ValueError(
            f"{op}: expected q [batch, q_len, q_heads, head_dim] and pages [kv_heads, pages, "
            f"page_size, width]; got q {q.shape}, k_pages {k_pages.shape}, v_pages "
            f"{v_pages.shape}."
        )
    if k_pages.shape[:3] != v_pages.shape[:3] or k_pages.shape[3] != q.shape[3]:
        raise ValueError(
            f"{op}: k_pages {k_pages.shape} and v_pages {v_pages.shape} must agree on "
            f"[kv_heads, pages, page_size], and k_pages' width must equal q's head_dim "
            f"{q.shape[3]}."
        )
    if q.shape[2] % k_pages.shape[0]:
        raise ValueError(f"{op}: q_heads {q.shape[2]} is not a multiple of kv_heads "
                         f"{k_pages.shape[0]}.")
    _check_rows(op, q.shape[0], lengths, block_tables, q_lengths)
