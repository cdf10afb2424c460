"""Paged GQA/MQA/MHA decode attention as a Pallas TPU kernel.

Design (one grid step per sequence and KV head):
  * grid = (batch, kv_heads), both "parallel": every step starts and waits for
    its own DMAs, so no state crosses steps and megacore may split either axis
    without any risk of a hang on single-core chips;
  * lengths and the (flattened) block tables are scalar-prefetched into SMEM;
  * the page pools stay in HBM (`memory_space=pl.ANY`); the kernel copies only
    the pages a sequence uses with `pltpu.make_async_copy`, `block_tokens`
    tokens per inner step, double-buffered: the next block's pages are in
    flight while the current one is computed;
  * the query heads of one KV head (the GQA group) are one [group, head_dim]
    tile, so each K/V page read serves the whole group;
  * online softmax in float32, a loop that ends at the sequence's last block
    (and starts at the sliding window's first one), output plus log-sum-exp.

Table entries past a sequence's length are never read, not even as DMA
addresses. The VMEM slots of pages that are not copied hold stale data (NaN
in the TPU interpreter): logits and values of invalid tokens are selected
away with `jnp.where`, never multiplied by zero.

Cost of the self-contained steps: the first block of every (sequence, KV
head) is fetched without overlap (jax's own paged kernel prefetches across
steps instead, which is why it must run its grid sequentially and can hang
with megacore on single-core chips). For long contexts this prologue is one
block in many. Checked so far in both interpreters and by lowering to Mosaic
from CPU (tests/kernels/test_kernel_lowering.py); not yet compiled by libtpu
or timed on a TPU.

The generic body (`decode_tpu`) takes the key as a sum of parts
(q . k = sum_i q_i . k_i) and may use the first key part as the value; the
MLA kernel in `kernels_pallas/mla_decode/tpu.py` is that body with key
[c_KV, k_rope] and value c_KV.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int

from kernels_pallas.paged_attention.block_sizes import (
    BlockSizes,
    check_head_dim,
    check_table_width,
    resolve_block_sizes,
)

__all__ = ["paged_decode_attention", "decode_tpu", "interpret_params", "BlockSizes"]

NEG_INF = float("-inf")


def interpret_params() -> pltpu.InterpretParams:
    """TPU-interpreter settings: uninitialised memory is NaN, out-of-bounds reads raise."""
    return pltpu.InterpretParams(uninitialized_memory="nan", out_of_bounds_reads="raise")


def _decode_kernel(
    lengths_ref,  # SMEM i32[batch]
    tables_ref,  # SMEM i32[batch * padded_max_pages]
    *refs,
    num_parts: int,
    value_is_key0: bool,
    pages_per_block: int,
    padded_max_pages: int,
    scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    exact_f32: bool,
):
    q_refs = refs[:num_parts]  # VMEM [group, d_i]
    k_hbm = refs[num_parts:2 * num_parts]  # HBM [kv_heads, pages, page_size, d_i]
    rest = refs[2 * num_parts:]
    if value_is_key0:
        v_hbm, rest = None, rest
    else:
        v_hbm, rest = rest[0], rest[1:]
    o_ref, lse_ref = rest[0], rest[1]  # VMEM [group, dv], [group, 1]
    acc_ref = rest[2]  # VMEM f32[group, dv]: kept out of the loop carry (MLA: 128 x 512)
    scratch = rest[3:]
    k_bufs = scratch[:num_parts]  # VMEM [2, pages_per_block, page_size, d_i]
    if value_is_key0:
        v_buf, sems = k_bufs[0], scratch[num_parts]
    else:
        v_buf, sems = scratch[num_parts], scratch[num_parts + 1]  # sems: DMA[num_bufs, 2]

    b = pl.program_id(0)
    h = pl.program_id(1)
    page_size = k_hbm[0].shape[2]
    ppb = pages_per_block
    bk = ppb * page_size
    length = lengths_ref[b]
    first = jnp.int32(0) if sliding_window is None else jnp.maximum(length - sliding_window, 0)
    first_page = first // page_size
    num_pages = pl.cdiv(length, page_size)
    start_blk = first // bk
    end_blk = pl.cdiv(length, bk)

    bufs = list(k_bufs) + ([] if value_is_key0 else [v_buf])
    pools = list(k_hbm) + ([] if value_is_key0 else [v_hbm])

    def for_each_page_copy(blk, slot, action):
        # Only the block's visible pages: a loop, not an unrolled list, keeps
        # the kernel small for wide blocks.
        lo = jnp.maximum(blk * ppb, first_page)
        hi = jnp.minimum((blk + 1) * ppb, num_pages)

        def one_page(pos, carry):
            page = tables_ref[b * padded_max_pages + pos]
            for i, (pool, buf) in enumerate(zip(pools, bufs, strict=True)):
                action(pltpu.make_async_copy(
                    pool.at[h, page], buf.at[slot, pos - blk * ppb], sems.at[i, slot]
                ))
            return carry

        jax.lax.fori_loop(lo, hi, one_page, 0)

    @pl.when(end_blk > start_blk)
    def _():
        for_each_page_copy(start_blk, 0, lambda c: c.start())

    precision = jax.lax.Precision.HIGHEST if exact_f32 else jax.lax.Precision.DEFAULT
    dims_qk = (((1,), (1,)), ((), ()))
    group = q_refs[0].shape[0]
    dv = o_ref.shape[-1]

    def body(blk, carry):
        m_prev, l_prev = carry
        slot = (blk - start_blk) % 2

        @pl.when(blk + 1 < end_blk)
        def _():
            for_each_page_copy(blk + 1, 1 - slot, lambda c: c.start())

        for_each_page_copy(blk, slot, lambda c: c.wait())

        # Cast before the reshape: collapsing [pages, page_size] is a free
        # relabelling for 32-bit tiles whatever the page size. Inputs that
        # were bf16 are exact in f32, so one default-precision pass suffices.
        s = None
        for q_ref, buf in zip(q_refs, k_bufs, strict=True):
            k = buf[slot].astype(jnp.float32).reshape(bk, buf.shape[-1])
            part = jax.lax.dot_general(
                q_ref[...].astype(jnp.float32), k, dims_qk,
                precision=precision, preferred_element_type=jnp.float32,
            )
            s = part if s is None else s + part
        s = s * jnp.float32(scale)
        if soft_cap is not None:
            s = jnp.float32(soft_cap) * jnp.tanh(s / jnp.float32(soft_cap))
        pos_row = blk * bk + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
        valid_row = (pos_row >= first) & (pos_row < length)
        s = jnp.where(valid_row, s, NEG_INF)  # [group, bk]

        # Every block in [start_blk, end_blk) holds a visible token, so m_new is finite.
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.exp(s - m_new)
        l_new = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)

        v = v_buf[slot].astype(jnp.float32).reshape(bk, dv)
        pos_col = blk * bk + jax.lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
        v = jnp.where((pos_col >= first) & (pos_col < length), v, 0.0)
        pv = jax.lax.dot_general(
            p, v, (((1,), (0,)), ((), ())),
            precision=precision, preferred_element_type=jnp.float32,
        )
        acc_ref[...] = alpha * acc_ref[...] + pv
        return m_new, l_new

    acc_ref[...] = jnp.zeros_like(acc_ref)
    init = (jnp.full((group, 1), NEG_INF, jnp.float32), jnp.zeros((group, 1), jnp.float32))
    m, l_sum = jax.lax.fori_loop(start_blk, end_blk, body, init)
    acc = acc_ref[...]
    seen = l_sum > 0.0
    o_ref[...] = jnp.where(seen, acc / jnp.where(seen, l_sum, 1.0), 0.0).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l_sum, 1.0)), NEG_INF)


@functools.partial(
    jax.jit,
    static_argnames=(
        "value_is_key0", "scale", "soft_cap", "sliding_window", "block_tokens", "interpret",
        "name",
    ),
)
def decode_tpu(
    qs,  # tuple of [batch, kv_heads, group, d_i]
    k_parts,  # tuple of [kv_heads, pages, page_size, d_i]
    v_pages,  # [kv_heads, pages, page_size, dv] or None (value = k_parts[0])
    lengths,  # i32[batch]
    block_tables,  # i32[batch, max_pages]
    *,
    value_is_key0: bool,
    scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    block_tokens: int,
    interpret,
    name: str,
):
    """The shared TPU decode body; shapes are validated by the public wrappers.

    Returns (out f32-accumulated in qs[0]'s dtype [batch, kv_heads, group, dv],
    lse float32[batch, kv_heads, group]).
    """
    batch, kv_heads, group, _ = qs[0].shape
    _, _, page_size, _ = k_parts[0].shape
    v_ref_pool = k_parts[0] if value_is_key0 else v_pages
    dv = v_ref_pool.shape[-1]
    ppb = block_tokens // page_size
    max_pages = block_tables.shape[1]
    padded = pl.cdiv(max_pages, ppb) * ppb
    # Padding makes every SMEM address the kernel could form in-bounds; the
    # padded entries lie past every length and are never used.
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, padded - max_pages)))
    tables = tables.reshape(-1)
    num_parts = len(qs)

    def q_spec(d):
        return pl.BlockSpec((None, None, group, d), lambda b, h, *_: (b, h, 0, 0))

    in_specs = [q_spec(q.shape[-1]) for q in qs]
    in_specs += [pl.BlockSpec(memory_space=pl.ANY) for _ in k_parts]
    args = [*qs, *k_parts]
    scratch = [pltpu.VMEM((group, dv), jnp.float32)]
    scratch += [pltpu.VMEM((2, ppb, page_size, k.shape[-1]), k.dtype) for k in k_parts]
    if not value_is_key0:
        in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
        args.append(v_pages)
        scratch.append(pltpu.VMEM((2, ppb, page_size, dv), v_pages.dtype))
    scratch.append(pltpu.SemaphoreType.DMA((len(scratch) - 1, 2)))

    kernel = functools.partial(
        _decode_kernel,
        num_parts=num_parts,
        value_is_key0=value_is_key0,
        pages_per_block=ppb,
        padded_max_pages=padded,
        scale=scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        exact_f32=all(x.dtype == jnp.float32 for x in (*qs, *k_parts)),
    )
    out, lse = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(batch, kv_heads),
            in_specs=in_specs,
            out_specs=[
                pl.BlockSpec((None, None, group, dv), lambda b, h, *_: (b, h, 0, 0)),
                pl.BlockSpec((None, None, group, 1), lambda b, h, *_: (b, h, 0, 0)),
            ],
            scratch_shapes=scratch,
        ),
        out_shape=[
            jax.ShapeDtypeStruct((batch, kv_heads, group, dv), qs[0].dtype),
            jax.ShapeDtypeStruct((batch, kv_heads, group, 1), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
        name=name,
    )(lengths.astype(jnp.int32), tables, *args)
    return out, lse[..., 0]


def paged_decode_attention(
    q: Float[Array, "batch q_heads head_dim"],
    k_pages: Float[Array, "kv_heads pages page_size head_dim"],
    v_pages: Float[Array, "kv_heads pages page_size v_head_dim"],
    lengths: Int[Array, " batch"],
    block_tables: Int[Array, "batch max_pages"],
    *,
    scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    block_sizes: BlockSizes | None = None,
    max_pages: int | None = None,
    interpret: bool | pltpu.InterpretParams = False,
) -> tuple[Float[Array, "batch q_heads v_head_dim"], Float[Array, "batch q_heads"]]:
    """Paged decode attention on TPU; same contract as `reference.paged_decode_attention`.

    Args:
      q: [batch, q_heads, head_dim]; q_heads a multiple of kv_heads.
      k_pages, v_pages: one layer's pools [kv_heads, pages, page_size, head_dim | v_head_dim],
        left in HBM; only the pages below each sequence's length are read.
      lengths: int32[batch], tokens per sequence including the new one.
      block_tables: int32[batch, max_pages]; entries past a sequence's length are never read.
      scale, soft_cap, sliding_window: as in the reference.
      block_sizes: tiling; None picks the TPU defaults for this page size.
      max_pages: the declared maximum pages per sequence (CacheSpec.max_pages_per_seq);
        a wider block table raises.
      interpret: False on TPU; True (plain Pallas interpreter) or a `pltpu.InterpretParams`
        (the TPU interpreter, which simulates DMAs, semaphores and VMEM) elsewhere.

    Returns:
      (out [batch, q_heads, v_head_dim] in q's dtype, lse float32[batch, q_heads]).

    Raises:
      ValueError: on an unsupported head width, a block table wider than `max_pages` or
        than SMEM holds, or block sizes that are not whole pages; before any tracing.
    """
    op = "paged_decode_attention[tpu]"
    _check_shapes(op, q, k_pages, v_pages, lengths, block_tables)
    batch, q_heads, head_dim = q.shape
    kv_heads, _, page_size, _ = k_pages.shape
    check_head_dim(op, "head_dim", head_dim, "tpu")
    check_head_dim(op, "v_head_dim", v_pages.shape[-1], "tpu")
    check_table_width(op, block_tables.shape, max_pages, "tpu")
    group = q_heads // kv_heads
    bs = resolve_block_sizes(op, "tpu", block_sizes, page_size, block_tables.shape[1],
                             rows=group)
    out, lse = decode_tpu(
        (q.reshape(batch, kv_heads, group, head_dim),), (k_pages,), v_pages,
        lengths, block_tables,
        value_is_key0=False,
        scale=float(head_dim ** -0.5 if scale is None else scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        sliding_window=sliding_window,
        block_tokens=bs.block_tokens,
        interpret=interpret,
        name=f"kvjax_paged_decode_tpu_g{group}_bt{bs.block_tokens}",
    )
    return out.reshape(batch, q_heads, -1), lse.reshape(batch, q_heads)


def _check_shapes(op, q, k_pages, v_pages, lengths, block_tables):
    if q.ndim != 3 or k_pages.ndim != 4 or v_pages.ndim != 4:
        raise ValueError(
            f"{op}: expected q [batch, q_heads, head_dim] and pages [kv_heads, pages, page_size, "
            f"width]; got q {q.shape}, k_pages {k_pages.shape}, v_pages {v_pages.shape}."
        )
    if k_pages.shape[:3] != v_pages.shape[:3] or k_pages.shape[3] != q.shape[2]:
        raise ValueError(
            f"{op}: k_pages {k_pages.shape} and v_pages {v_pages.shape} must agree on "
            f"[kv_heads, pages, page_size], and k_pages' width must equal q's head_dim "
            f"{q.shape[2]}."
        )
    if q.shape[1] % k_pages.shape[0]:
        raise ValueError(f"{op}: q_heads {q.shape[1]} is not a multiple of kv_heads "
                         f"{k_pages.shape[0]}.")
    if block_tables.ndim != 2 or block_tables.shape[0] != q.shape[0] or lengths.shape != (
        q.shape[0],
    ):
        raise ValueError(
            f"{op}: block_tables {block_tables.shape} must be [batch={q.shape[0]}, max_pages] "
            f"and lengths {lengths.shape} must be [batch]."
        )
