"""Paged GQA/MQA/MHA decode attention on Hopper as a Mosaic GPU kernel.

Same contract as `gpu.paged_decode_attention` (the Triton kernel) and the
reference: q [batch, q_heads, head_dim], pools [kv_heads, pages, page_size,
width], lengths, block tables; returns the output in q's dtype and the float32
log-sum-exp. `unsupported_reason` says which shapes this kernel leaves to the
Triton kernel.

Design (each choice and the number behind it):

* One program per (split, KV head, sequence) holds all `group = q_heads /
  kv_heads` query heads of its KV head (FA3's PackGQA), so every K/V byte is
  read from HBM once per KV head.
* Tensor cores with the group padded to 64 rows, wgmma's smallest M. The
  alternative, dot products on CUDA cores, needs register layouts for a
  [group, tokens, head_dim] product that Mosaic GPU does not offer; the
  padding costs FLOPs, not bytes: at group 4 and full H100 bandwidth (3.35 TB/s
  of bf16 K/V) the padded products need 64 rows x 4 FLOP per K/V byte, about
  215 TFLOP/s, a fifth of the H100's dense bf16 peak, so the kernel stays
  memory-bound. FA3 pads decode the same way. Groups of 64 rows (MLA-like)
  waste nothing.
* S = Q K^T and O += P V are two `wgmma`s per step of `block_tokens` = 64
  tokens (the width of one wgmma-layout tile; P goes from registers straight
  into the second product as its A operand). Online softmax in float32.
* K/V pages come in by TMA, one copy per page (Hopper has no TMA gather), each
  page landing in its 8-row-tiled, swizzled slice of a stage buffer. The
  pipeline keeps `num_stages` steps in flight (copies for step j + stages are
  issued as soon as step j's products are done): 4 stages x 64 tokens x 256
  bf16 columns = 128 KiB of shared memory at head_dim 128, i.e. three 32 KiB
  steps in flight per SM, 3x what Little's law asks of one SM at ~1 us memory
  latency (3.35 TB/s / 132 SMs x 1 us = 25 KiB). Wider heads get fewer stages
  (at least 2) to fit 227 KiB.
* The split's block-table entries are staged in shared memory by one TMA copy
  at the start (FlashInfer stages page offsets the same way), so issuing a
  page copy never waits on a global-memory load. Entries outside the
  sequence's visible pages are replaced by page 0 before use as addresses.
* Split-K: the pages of a sequence split into `choose_splits` ranges sized to
  the SM count passed in as `num_sms` (never queried at trace time): the
  fewest splits within 85% of the best wave efficiency (FA3's heuristic), so
  one long sequence over 8 KV heads still fills 132 SMs. The splits' partial
  outputs and log-sum-exps are merged by `kernels_pallas.merge` (the tree in
  `merge.merge_splits`), one small XLA fusion per level.
* Masking: logits outside [first visible, length) are selected to -inf; on a
  range's first and last step the invisible rows of the V stage are zeroed in
  shared memory before P V, so NaN or inf there never reaches the output.
* Dtypes: bfloat16 or float16 pages. float32 queries become two parts in the
  pages' dtype (hi + lo, one more Q K^T wgmma per step). float32 pages are
  refused (`unsupported_reason`): wgmma would read them as tf32, and P V with
  tf32 needs V transposed in shared memory; the Triton kernel serves them.

Checked on CPU in Mosaic GPU's interpreter with race detection and by
lowering for an H100 (tests/kernels/test_mosaic_gpu_decode.py).
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from kernels_pallas import _mosaic_gpu as mgpu
from kernels_pallas._mosaic_gpu import plgpu
from kernels_pallas.merge import merge_splits
from kernels_pallas.paged_attention.tpu import _check_shapes

__all__ = [
    "paged_decode_attention",
    "choose_splits",
    "unsupported_reason",
    "KernelConfig",
    "kernel_config",
]

NEG_INF = float("-inf")
_MMA_ROWS = 64  # wgmma's M: the query group is padded to this many rows
_BLOCK_TOKENS = 64  # tokens per pipeline step (one wgmma-layout tile of logits)
_MIN_PAGE = 8  # rows of one tile of the swizzled shared-memory layout
_MAX_STAGES = 4
_SMEM_BUDGET = 200 * 1024  # of the H100's 227 KiB per block, leaving room for barriers
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_HEAD_DIMS = (16, 32, 64, 128, 256)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Static tiling of one call (hashable: a static argument of the jitted kernel).

    Attributes:
      block_tokens: tokens per pipeline step.
      chunk: rows per TMA copy: a whole page, or a 64-row part of a larger page.
      num_stages: pipeline depth in steps.
      num_splits: ranges each sequence's pages split into.
      pages_per_split: block-table entries per split (a multiple of 4: a TMA copy of the
        table starts at a 16-byte aligned address).
      table_window: table entries each program copies to shared memory: pages_per_split
        rounded up to 32 (one copy moves a multiple of 128 bytes, which jax 0.10's
        lowering requires); the entries past pages_per_split are never used.
    """

    block_tokens: int
    chunk: int
    num_stages: int
    num_splits: int
    pages_per_split: int
    table_window: int


def choose_splits(
    programs: int, num_steps: int, num_sms: int, *, max_splits: int = 128,
    blocks_per_sm: int = 1, efficiency: float = 0.85,
) -> int:
    """Splits per sequence so that `programs * splits` fills the GPU's SMs in whole waves.

    FA3's rule (`hopper/heuristics.h`): among the split counts that change the
    steps per split, take the fewest whose wave efficiency `n / ceil(n)` (n =
    programs * splits / (num_sms * blocks_per_sm)) is within `efficiency` of the
    best; one split when the programs already fill ~80% of a wave.

    Args:
      programs: programs without splitting (batch x KV heads).
      num_steps: pipeline steps in the widest sequence (the block table's width).
      num_sms: streaming multiprocessors of the target GPU (132 on H100/H200).
      max_splits: upper bound on the answer.
      blocks_per_sm: programs one SM holds at once.
      efficiency: fraction of the best wave efficiency to settle for.

    Returns:
      An int in [1, min(max_splits, num_steps)].
    """
    for name, value in (("programs", programs), ("num_steps", num_steps), ("num_sms", num_sms),
                        ("max_splits", max_splits), ("blocks_per_sm", blocks_per_sm)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"choose_splits: {name} must be an int >= 1, got {value!r}.")
    slots = num_sms * blocks_per_sm
    if programs >= 0.8 * slots:
        return 1
    limit = min(max_splits, num_steps, slots)

    def eligible(s):  # a split count whose steps per split differ from one fewer split's
        return s == 1 or -(-num_steps // s) != -(-num_steps // (s - 1))

    def wave_efficiency(s):
        waves = programs * s / slots
        return waves / math.ceil(waves)

    candidates = [s for s in range(1, limit + 1) if eligible(s)]
    best = max(wave_efficiency(s) for s in candidates)
    return next(s for s in candidates if wave_efficiency(s) >= efficiency * best)


def unsupported_reason(q, k_pages, v_pages) -> str | None:
    """None when this kernel takes these shapes and dtypes; else a sentence saying why not.

    Takes arrays or `jax.ShapeDtypeStruct`s (only shapes and dtypes are read).
    """
    _, q_heads, head_dim = q.shape
    kv_heads, _, page_size, v_dim = v_pages.shape
    dtype = jnp.dtype(k_pages.dtype)
    if dtype not in _DTYPES or jnp.dtype(v_pages.dtype) != dtype:
        return (f"the Mosaic GPU kernel takes bfloat16 or float16 pages (one dtype for K and "
                f"V), got k_pages {k_pages.dtype}, v_pages {v_pages.dtype}.")
    if jnp.dtype(q.dtype) not in (*_DTYPES, jnp.dtype(jnp.float32)):
        return f"the Mosaic GPU kernel takes bfloat16, float16 or float32 queries, got {q.dtype}."
    for name, width in (("head_dim", head_dim), ("v_head_dim", v_dim)):
        if width not in _HEAD_DIMS:
            return (f"the Mosaic GPU kernel takes {name} in {_HEAD_DIMS} (the float32 "
                    f"[64, v_head_dim] accumulator of one warpgroup must fit its registers), "
                    f"got {width}.")
    if page_size < _MIN_PAGE or page_size % _MIN_PAGE or not (
        _BLOCK_TOKENS % page_size == 0 or page_size % _BLOCK_TOKENS == 0
    ):
        return (f"the Mosaic GPU kernel takes page sizes that are multiples of {_MIN_PAGE} "
                f"(a TMA copy of one page must fill whole 8-row tiles of the swizzled shared "
                f"memory wgmma reads) dividing or divisible by {_BLOCK_TOKENS}, got "
                f"{page_size}.")
    group = q_heads // max(kv_heads, 1)
    if group > _MMA_ROWS:
        return (f"the Mosaic GPU kernel holds at most {_MMA_ROWS} query heads per KV head "
                f"(one wgmma tile), got {group}.")
    return None


def kernel_config(
    batch: int, kv_heads: int, max_pages: int, page_size: int, head_dim: int, v_dim: int,
    itemsize: int, num_sms: int,
) -> KernelConfig:
    """The tiling `paged_decode_attention` uses for a cache geometry (a pure function)."""
    block_tokens = _BLOCK_TOKENS
    chunk = min(page_size, block_tokens)
    stage_bytes = block_tokens * (head_dim + v_dim) * itemsize
    q_bytes = 2 * _MMA_ROWS * head_dim * itemsize  # room for float32 queries' two parts
    stages = max(2, min(_MAX_STAGES, (_SMEM_BUDGET - q_bytes) // stage_bytes))
    pages_per_step = max(1, block_tokens // page_size)
    steps_per_page = max(1, page_size // block_tokens)
    num_steps = max(1, -(-max_pages // pages_per_step) * steps_per_page)
    splits = choose_splits(batch * kv_heads, num_steps, num_sms)
    steps_per_split = -(-num_steps // splits)
    # A split is whole steps and starts at a 16-byte aligned table entry.
    unit = math.lcm(4, pages_per_step)
    pages_per_split = -(-steps_per_split * block_tokens // page_size)
    pages_per_split = -(-pages_per_split // unit) * unit
    splits = -(-max_pages // pages_per_split)  # no split without pages
    return KernelConfig(block_tokens=block_tokens, chunk=chunk, num_stages=stages,
                        num_splits=splits, pages_per_split=pages_per_split,
                        table_window=-(-pages_per_split // 32) * 32)


def _smem_transforms(width: int, itemsize: int):
    swizzle = min(128, width * itemsize)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def _decode_kernel(
    q_ref, k_ref, v_ref, len_ref, tbl_ref, o_ref, lse_ref,  # GMEM
    q_smem, k_smem, v_smem, tbl_smem, q_bar, k_bars, v_bars, tbl_bar, p_smem,  # scratch
    *, cfg: KernelConfig, page_size: int, scale: float, soft_cap: float | None,
    sliding_window: int | None, interpret,
):
    s_idx = jax.lax.axis_index("split")
    h = jax.lax.axis_index("kv_head")
    b = jax.lax.axis_index("seq")
    bt, chunk, stages = cfg.block_tokens, cfg.chunk, cfg.num_stages
    chunks = bt // chunk
    dtype = k_smem.dtype
    dv = v_smem.shape[-1]
    pps = cfg.pages_per_split

    plgpu.copy_gmem_to_smem(tbl_ref.at[b, pl.ds(s_idx * pps, cfg.table_window)], tbl_smem,
                            tbl_bar)
    plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_smem, q_bar)

    length = len_ref[b]
    first = jnp.int32(0) if sliding_window is None else jnp.maximum(length - sliding_window, 0)
    split0 = s_idx * (pps * page_size)  # first token of this split
    lo_tok = jnp.maximum(first, split0)
    hi_tok = jnp.minimum(length, split0 + pps * page_size)
    lo_step = (lo_tok - split0) // bt
    num_steps = jnp.where(hi_tok > lo_tok, pl.cdiv(hi_tok - split0, bt) - lo_step, 0)

    plgpu.barrier_wait(tbl_bar)

    def issue(j):
        slot = j % stages
        step0 = split0 + (lo_step + j) * bt
        for c in range(chunks):
            tok = step0 + c * chunk
            visible = (tok < length) & (tok + chunk > first)
            page = jnp.where(visible, tbl_smem[(tok - split0) // page_size], 0)
            rows = pl.ds(tok % page_size, chunk)
            dst = pl.ds(c * chunk, chunk)
            plgpu.copy_gmem_to_smem(k_ref.at[h, page, rows], k_smem.at[slot, dst],
                                    k_bars.at[slot * chunks + c])
            plgpu.copy_gmem_to_smem(v_ref.at[h, page, rows], v_smem.at[slot, dst],
                                    v_bars.at[slot * chunks + c])

    for j in range(stages):
        pl.when(j < num_steps)(functools.partial(issue, j))

    plgpu.barrier_wait(q_bar)
    wgmma_layout = plgpu.Layout.WGMMA
    row_layout = wgmma_layout.reduce(1)
    layout_cast = functools.partial(mgpu.layout_cast, interpret=interpret)
    iota = functools.partial(mgpu.broadcasted_iota, jnp.int32, layout=wgmma_layout,
                             interpret=interpret)
    m0 = layout_cast(jnp.full((_MMA_ROWS,), NEG_INF, jnp.float32), row_layout)
    l0 = layout_cast(jnp.full((_MMA_ROWS,), 0.0, jnp.float32), row_layout)
    acc0 = layout_cast(jnp.zeros((_MMA_ROWS, dv), jnp.float32), wgmma_layout)

    def step(j, carry):
        acc, m_prev, l_prev = carry
        slot = j % stages
        step0 = split0 + (lo_step + j) * bt
        for c in range(chunks):
            plgpu.barrier_wait(k_bars.at[slot * chunks + c])

        s = mgpu.dot_transposed_b(q_smem.at[0], k_smem.at[slot], interpret=interpret)
        for part in range(1, q_smem.shape[0]):  # float32 queries: + q_lo K^T
            s = s + mgpu.dot_transposed_b(q_smem.at[part], k_smem.at[slot], interpret=interpret)
        s = s * jnp.float32(scale)
        if soft_cap is not None:
            s = jnp.float32(soft_cap) * jnp.tanh(s / jnp.float32(soft_cap))
        pos = step0 + iota((_MMA_ROWS, bt), 1)
        s = jnp.where((pos >= first) & (pos < length), s, NEG_INF)
        # Every step holds a visible token, so m_new is finite.
        m_new = jnp.maximum(m_prev, s.max(axis=1))
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.exp(s - jax.lax.broadcast_in_dim(m_new, s.shape, [0]))
        l_new = l_prev * alpha + p.sum(axis=1)

        for c in range(chunks):
            plgpu.barrier_wait(v_bars.at[slot * chunks + c])

        @pl.when((j == 0) | (j == num_steps - 1))
        def _():  # zero the rows no query sees: 0 * NaN in P V would be NaN
            v_tile = v_smem.at[slot]
            rows = step0 + iota((bt, dv), 0)
            v = v_tile[...]
            v_tile[...] = jnp.where((rows >= first) & (rows < length), v, jnp.zeros_like(v))
            plgpu.commit_smem()

        if p_smem is None:
            p_in = p.astype(dtype)
        else:
            p_smem[...] = p.astype(dtype)
            plgpu.commit_smem()
            p_in = p_smem

        def pv(acc_ref):
            plgpu.wgmma(acc_ref, p_in, v_smem.at[slot])
            return acc_ref[...]

        pv_out = pl.run_scoped(pv, plgpu.ACC((_MMA_ROWS, dv), jnp.float32))
        acc = acc * jax.lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv_out

        @pl.when(j + stages < num_steps)
        def _():
            issue(j + stages)

        return acc, m_new, l_new

    acc, m, l_sum = jax.lax.fori_loop(0, num_steps, step, (acc0, m0, l0))
    seen = l_sum > 0.0
    safe_l = jnp.where(seen, l_sum, 1.0)
    o_ref[s_idx, b, h] = jnp.where(
        jax.lax.broadcast_in_dim(seen, acc.shape, [0]),
        acc / jax.lax.broadcast_in_dim(safe_l, acc.shape, [0]), 0.0)
    lse_ref[s_idx, b, h] = jnp.where(seen, m + jnp.log(safe_l), NEG_INF)


@functools.partial(
    jax.jit,
    static_argnames=("scale", "soft_cap", "sliding_window", "num_sms", "interpret"),
)
def _decode(q, k_pages, v_pages, lengths, block_tables, *, scale, soft_cap, sliding_window,
            num_sms, interpret):
    batch, q_heads, head_dim = q.shape
    kv_heads, _, page_size, dv = v_pages.shape
    group = q_heads // kv_heads
    dtype = k_pages.dtype
    itemsize = jnp.dtype(dtype).itemsize
    max_pages = block_tables.shape[1]
    cfg = kernel_config(batch, kv_heads, max_pages, page_size, head_dim, dv, itemsize, num_sms)
    splits, pps = cfg.num_splits, cfg.pages_per_split
    chunks = cfg.block_tokens // cfg.chunk

    qg = q.reshape(batch, kv_heads, 1, group, head_dim)
    if q.dtype == jnp.float32:
        # Two parts in the pages' dtype, hi + lo, carry a float32 query to ~2^-16 relative.
        hi = qg.astype(dtype)
        qg = jnp.concatenate([hi, (qg - hi.astype(jnp.float32)).astype(dtype)], axis=2)
    qg = jnp.pad(qg.astype(dtype), ((0, 0), (0, 0), (0, 0), (0, _MMA_ROWS - group), (0, 0)))
    q_parts = qg.shape[2]
    tables = jnp.pad(block_tables.astype(jnp.int32),
                     ((0, 0), (0, (splits - 1) * pps + cfg.table_window - max_pages)))
    kernel = functools.partial(
        _decode_kernel, cfg=cfg, page_size=page_size, scale=scale, soft_cap=soft_cap,
        sliding_window=sliding_window, interpret=interpret,
    )
    out, lse = plgpu.kernel(
        kernel,
        out_type=(
            jax.ShapeDtypeStruct((splits, batch, kv_heads, _MMA_ROWS, dv), jnp.float32),
            jax.ShapeDtypeStruct((splits, batch, kv_heads, _MMA_ROWS), jnp.float32),
        ),
        scratch_types=(
            plgpu.SMEM((q_parts, _MMA_ROWS, head_dim), dtype,
                       transforms=_smem_transforms(head_dim, itemsize)),
            plgpu.SMEM((cfg.num_stages, cfg.block_tokens, head_dim), dtype,
                       transforms=_smem_transforms(head_dim, itemsize)),
            plgpu.SMEM((cfg.num_stages, cfg.block_tokens, dv), dtype,
                       transforms=_smem_transforms(dv, itemsize)),
            plgpu.SMEM((cfg.table_window,), jnp.int32),
            plgpu.Barrier(),
            plgpu.Barrier(num_barriers=cfg.num_stages * chunks),
            plgpu.Barrier(num_barriers=cfg.num_stages * chunks),
            plgpu.Barrier(),
            (plgpu.SMEM((_MMA_ROWS, cfg.block_tokens), dtype,
                        transforms=_smem_transforms(cfg.block_tokens, itemsize))
             if mgpu.wgmma_a_from_smem(interpret) else None),
        ),
        grid=(splits, kv_heads, batch),
        grid_names=("split", "kv_head", "seq"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=mgpu.resolve_interpret(interpret),
    )(qg, k_pages, v_pages, lengths.astype(jnp.int32), tables)
    out, lse = merge_splits(out, lse)
    out = out[:, :, :group].reshape(batch, q_heads, dv).astype(q.dtype)
    return out, lse[:, :, :group].reshape(batch, q_heads)


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
    num_sms: int = mgpu.H100_NUM_SMS,
    interpret=False,
) -> tuple[Float[Array, "batch q_heads v_head_dim"], Float[Array, "batch q_heads"]]:
    """Paged decode attention on Hopper (Mosaic GPU); the contract of
    `reference.paged_decode_attention`.

    Args:
      q: [batch, q_heads, head_dim]; q_heads a multiple of kv_heads; in the pages' dtype or
        float32 (then split into two parts in the pages' dtype, hi + lo, for the tensor
        cores: logits to ~2^-16 relative).
      k_pages, v_pages: one layer's pools [kv_heads, pages, page_size, head_dim |
        v_head_dim], bfloat16 or float16.
      lengths: int32[batch], tokens per sequence including the new one.
      block_tables: int32[batch, max_pages]; entries past a sequence's length are never
        used as addresses.
      scale, soft_cap, sliding_window: as in the reference.
      num_sms: SMs of the target GPU, for the split count (132 on H100 and H200); a
        static argument, never read from the device.
      interpret: False to compile for the GPU; True, or
        `kernels_pallas._mosaic_gpu.interpret_params(...)`, to run Mosaic GPU's
        interpreter (any backend).

    Returns:
      (out [batch, q_heads, v_head_dim] in q's dtype, lse float32[batch, q_heads]).

    Raises:
      ValueError: on shapes the reference refuses, or shapes and dtypes this kernel does
        not take (`unsupported_reason` says which), before any tracing.
    """
    op = "paged_decode_attention[mosaic_gpu]"
    _check_shapes(op, q, k_pages, v_pages, lengths, block_tables)
    reason = unsupported_reason(q, k_pages, v_pages)
    if reason is not None:
        raise ValueError(f"{op}: {reason} Use the Triton kernel (gpu.py) for these shapes.")
    if not isinstance(num_sms, int) or num_sms < 1:
        raise ValueError(f"{op}: num_sms must be an int >= 1, got {num_sms!r}.")
    head_dim = q.shape[-1]
    return _decode(
        q, k_pages, v_pages, lengths, block_tables,
        scale=float(head_dim ** -0.5 if scale is None else scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        sliding_window=None if sliding_window is None else int(sliding_window),
        num_sms=num_sms,
        interpret=interpret,
    )
