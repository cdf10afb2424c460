"""Paged GQA/MQA/MHA decode attention as a Pallas GPU kernel (Triton backend).

Design:
  * grid = (batch, kv_heads, num_splits): the pages of a sequence are split
    into `num_splits` contiguous ranges (split-K) so that short batches still
    fill the GPU; each program writes a partial output and its log-sum-exp,
    and the partials are combined with `kernels_pallas.merge`;
  * the query heads of one KV head form one [group, head_dim] tile (padded to
    16 rows, tl.dot's minimum), so each K/V page read serves the whole group;
    groups wider than `block_heads` (MLA's 16-128 heads) are split over
    programs (grid axis 1 enumerates KV head x head block) to bound registers;
  * each inner step gathers `block_tokens / page_size` pages through the block
    table; table entries outside a sequence's visible pages are replaced by
    page 0 before they are used as addresses (the tokens are masked anyway);
  * online softmax in float32; a split's loop covers only its visible pages
    (so it ends at the sequence's length and starts at the sliding window).

Like the TPU kernel, the body takes the key as a sum of parts and may use the
first part as the value, which makes it the MLA kernel too.

Checked in Pallas' interpret mode, by lowering to Triton IR from CPU
(tests/kernels/test_kernel_lowering.py), and compiled on an H200 (jax 0.11.2:
the `*_native` tests and benchmarks/pallas_kernels.py; docs/performance.md).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int

from kernels_pallas.merge import merge_splits
from kernels_pallas.paged_attention.block_sizes import (
    BlockSizes,
    check_head_dim,
    check_table_width,
    resolve_block_sizes,
)
from kernels_pallas.paged_attention.tpu import _check_shapes

__all__ = ["paged_decode_attention", "decode_gpu", "choose_num_splits", "BlockSizes"]

NEG_INF = float("-inf")
# Programs to aim for when choosing the split count: about two waves on a
# 132-SM H100/H200.
_TARGET_PROGRAMS = 264
_MIN_DOT_ROWS = 16


def _decode_kernel(
    lengths_ref,  # [1]
    tables_ref,  # [pages_per_split]
    *refs,
    num_parts: int,
    value_is_key0: bool,
    pages_per_block: int,
    pages_per_split: int,
    scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    exact_f32: bool,
):
    q_refs = refs[:num_parts]  # [block_heads, d_i]
    k_refs = refs[num_parts:2 * num_parts]  # [pages, page_size, d_i]
    rest = refs[2 * num_parts:]
    if value_is_key0:
        v_ref = k_refs[0]
    else:
        v_ref, rest = rest[0], rest[1:]
    o_ref, lse_ref = rest  # [block_heads, dv] f32, [block_heads] f32

    split = pl.program_id(2)
    page_size = k_refs[0].shape[1]
    ppb = pages_per_block
    bk = ppb * page_size
    dv = v_ref.shape[-1]
    rows = q_refs[0].shape[0]
    length = lengths_ref[0]
    first = jnp.int32(0) if sliding_window is None else jnp.maximum(length - sliding_window, 0)
    first_page = first // page_size
    num_pages = pl.cdiv(length, page_size)
    split_page0 = split * pages_per_split
    lo = jnp.clip(first_page - split_page0, 0, pages_per_split)  # split-relative pages
    hi = jnp.clip(num_pages - split_page0, 0, pages_per_split)
    precision = jax.lax.Precision.HIGHEST if exact_f32 else jax.lax.Precision.DEFAULT
    qs = [q_ref[...] for q_ref in q_refs]

    def body(i, carry):
        m_prev, l_prev, acc_prev = carry
        rel = i * ppb + jnp.arange(ppb, dtype=jnp.int32)
        pages = tables_ref[pl.ds(i * ppb, ppb)]
        pages = jnp.where((rel >= lo) & (rel < hi), pages, 0)
        s = None
        for q, k_ref in zip(qs, k_refs, strict=True):
            k = k_ref[pages].reshape(bk, k_ref.shape[-1])
            # Triton's dot takes one element type (jax >= 0.11 checks): float32 when they
            # differ (jnp.promote_types refuses f32 x bf16 under strict promotion).
            dt = q.dtype if q.dtype == k.dtype else jnp.float32
            part = plgpu.dot(q.astype(dt), k.astype(dt), trans_b=True, precision=precision)
            s = part if s is None else s + part
        s = s * jnp.float32(scale)
        if soft_cap is not None:
            s = jnp.float32(soft_cap) * jnp.tanh(s / jnp.float32(soft_cap))
        pos = (split_page0 + i * ppb) * page_size + jnp.arange(bk, dtype=jnp.int32)
        valid = (pos >= first) & (pos < length)
        s = jnp.where(valid[None, :], s, NEG_INF)
        # Every block in the loop holds a visible token, so m_new is finite.
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.exp(s - m_new[:, None])
        l_new = alpha * l_prev + jnp.sum(p, axis=1)
        v = v_ref[pages].reshape(bk, dv)
        v = jnp.where(valid[:, None], v, jnp.zeros_like(v))
        pv = plgpu.dot(p.astype(v.dtype), v, precision=precision)
        return m_new, l_new, alpha[:, None] * acc_prev + pv

    init = (
        jnp.full((rows,), NEG_INF, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, dv), jnp.float32),
    )
    m, l_sum, acc = jax.lax.fori_loop(lo // ppb, pl.cdiv(hi, ppb), body, init)
    seen = l_sum > 0.0
    safe_l = jnp.where(seen, l_sum, 1.0)
    o_ref[...] = jnp.where(seen[:, None], acc / safe_l[:, None], 0.0)
    lse_ref[...] = jnp.where(seen, m + jnp.log(safe_l), NEG_INF)


def choose_num_splits(batch: int, programs_per_seq: int, num_blocks: int) -> int:
    """Splits per sequence so that batch * programs_per_seq * splits fills ~two waves of SMs."""
    want = -(-_TARGET_PROGRAMS // max(1, batch * programs_per_seq))
    return max(1, min(want, num_blocks))


@functools.partial(
    jax.jit,
    static_argnames=(
        "value_is_key0", "scale", "soft_cap", "sliding_window", "block_sizes", "interpret",
        "name",
    ),
)
def decode_gpu(
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
    block_sizes: BlockSizes,
    interpret: bool,
    name: str,
):
    """The shared GPU decode body; shapes are validated by the public wrappers.

    Returns (out [batch, kv_heads, group, dv] in qs[0]'s dtype, lse float32[batch, kv_heads,
    group]).
    """
    batch, kv_heads, group, _ = qs[0].shape
    _, num_pool_pages, page_size, _ = k_parts[0].shape
    dv = (k_parts[0] if value_is_key0 else v_pages).shape[-1]
    ppb = block_sizes.block_tokens // page_size
    max_pages = block_tables.shape[1]
    num_blocks = pl.cdiv(max_pages, ppb)
    group_p = max(_MIN_DOT_ROWS, pl.next_power_of_2(group))
    # Both are powers of two, so head blocks tile the padded group exactly. Grid
    # axis 1 enumerates (kv head, head block) pairs: Triton grids have 3 axes.
    bh = min(block_sizes.block_heads, group_p)
    n_hb = group_p // bh
    splits = block_sizes.num_splits or choose_num_splits(batch, kv_heads * n_hb, num_blocks)
    splits = min(splits, num_blocks)
    blocks_per_split = pl.cdiv(num_blocks, splits)
    splits = pl.cdiv(num_blocks, blocks_per_split)  # no split left without pages
    pps = blocks_per_split * ppb
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, splits * pps - max_pages)))

    qs = tuple(jnp.pad(q, ((0, 0), (0, 0), (0, group_p - group), (0, 0))) for q in qs)

    def pool_spec(d):
        return pl.BlockSpec((None, num_pool_pages, page_size, d),
                            lambda b, i, s: (i // n_hb, 0, 0, 0))

    in_specs = [
        pl.BlockSpec((1,), lambda b, i, s: (b,)),
        pl.BlockSpec((None, pps), lambda b, i, s: (b, s)),
    ]
    in_specs += [
        pl.BlockSpec((None, None, bh, q.shape[-1]), lambda b, i, s: (b, i // n_hb, i % n_hb, 0))
        for q in qs
    ]
    in_specs += [pool_spec(k.shape[-1]) for k in k_parts]
    args = [lengths.astype(jnp.int32), tables, *qs, *k_parts]
    if not value_is_key0:
        in_specs.append(pool_spec(dv))
        args.append(v_pages)
    kernel = functools.partial(
        _decode_kernel,
        num_parts=len(qs),
        value_is_key0=value_is_key0,
        pages_per_block=ppb,
        pages_per_split=pps,
        scale=scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        exact_f32=all(x.dtype == jnp.float32 for x in (*qs, *k_parts)),
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
            jax.ShapeDtypeStruct((splits, batch, kv_heads, group_p, dv), jnp.float32),
            jax.ShapeDtypeStruct((splits, batch, kv_heads, group_p), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(
            num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages
        ),
        interpret=interpret,
        name=name,
    )(*args)
    o, l_out = merge_splits(out, lse)
    return o[:, :, :group].astype(qs[0].dtype), l_out[:, :, :group]


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
    interpret: bool = False,
) -> tuple[Float[Array, "batch q_heads v_head_dim"], Float[Array, "batch q_heads"]]:
    """Paged decode attention on GPU; same contract as `reference.paged_decode_attention`.

    Args:
      q: [batch, q_heads, head_dim]; q_heads a multiple of kv_heads.
      k_pages, v_pages: one layer's pools [kv_heads, pages, page_size, head_dim | v_head_dim].
      lengths: int32[batch], tokens per sequence including the new one.
      block_tables: int32[batch, max_pages]; entries past a sequence's length are never used
        as addresses.
      scale, soft_cap, sliding_window: as in the reference.
      block_sizes: tiling and split-K; None picks the GPU defaults for this page size.
      max_pages: the declared maximum pages per sequence; a wider block table raises.
      interpret: run in Pallas' interpret mode (any backend).

    Returns:
      (out [batch, q_heads, v_head_dim] in q's dtype, lse float32[batch, q_heads]).

    Raises:
      ValueError: on an unsupported head width or page size, a block table wider than
        `max_pages`, or block sizes that are not a power-of-two number of whole pages; before
        any tracing.
    """
    op = "paged_decode_attention[gpu]"
    _check_shapes(op, q, k_pages, v_pages, lengths, block_tables)
    batch, q_heads, head_dim = q.shape
    kv_heads, _, page_size, _ = k_pages.shape
    check_head_dim(op, "head_dim", head_dim, "gpu")
    check_head_dim(op, "v_head_dim", v_pages.shape[-1], "gpu")
    check_page_size(op, page_size)
    check_table_width(op, block_tables.shape, max_pages, "gpu")
    bs = resolve_block_sizes(op, "gpu", block_sizes, page_size, block_tables.shape[1])
    group = q_heads // kv_heads
    out, lse = decode_gpu(
        (q.reshape(batch, kv_heads, group, head_dim),), (k_pages,), v_pages,
        lengths, block_tables,
        value_is_key0=False,
        scale=float(head_dim ** -0.5 if scale is None else scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        sliding_window=sliding_window,
        block_sizes=bs,
        interpret=interpret,
        name=f"kvjax_paged_decode_gpu_g{group}_bt{bs.block_tokens}",
    )
    return out.reshape(batch, q_heads, -1), lse.reshape(batch, q_heads)


def check_page_size(op: str, page_size: int):
    """Triton block shapes are powers of two, so a page must be too."""
    if page_size & (page_size - 1):
        raise ValueError(
            f"{op}: the GPU kernel needs a power-of-two page_size, got {page_size}."
        )
