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
  page landing in its 8-row-tiled, swizzled slice of a stage slot. K and V each
  have a ring of `num_stages` slots; the copy into a slot is issued as soon as the
  product reading its previous contents has been awaited: 4 stages x 64 tokens x
  256 bf16 columns = 128 KiB of shared memory at head_dim 128, i.e. three 32 KiB
  steps in flight per SM, 3x what Little's law asks of one SM at ~1 us memory
  latency (3.35 TB/s / 132 SMs x 1 us = 25 KiB).
* Column parts: where a step's whole K and V rows leave fewer than 2 stages in the
  200 KiB budget, each step's K and V come in parts of `k_cols` / `v_cols` columns
  (the widest that leave 2 stages, halving down to 32), each part a slot of its
  ring: Q K^T sums the parts' products (a loop over K's parts), P V fills the
  output's column parts one by one (an accumulator per part, unrolled). The cost is
  smaller copies and wgmmas and more barrier waits per step, not bytes; it buys
  overlap where whole rows fit one stage or none. Pages that are repacked through
  registers (under 8 rows, float32) take parts of at most 64 columns, one register
  pass each: Mosaic GPU's layout inference (jax 0.11.2) searched for ~5 s over a
  part of 2 passes and did not finish in minutes over 4 (bf16 width 256, page 1).
  Chosen per geometry: bf16 pages of 8+ rows whole rows to width 256 (4 stages to
  128, 2 at 256), width 512 in 256-column parts (2 stages; whole rows were 1), 128
  with float32 queries (2); pages under 8 rows whole rows to width 64, 64-column
  parts beyond (4 stages); float32 pages whole rows to width 64 (4 stages),
  64-column parts at 128 and 256 (3 / 2), 32 at 512 (3 stages of 2 x 8 KiB: 48 KiB
  in flight).
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
* Dtypes: bfloat16, float16 or float32 pages. wgmma reads float32 only as tf32 (10
  bits), and only K-major, which P V's value operand is not; so float32 values go
  into the products as 3 bfloat16 parts, hi + mid + lo (8 significand bits each,
  together exact), and each product sums the 6 part products above 2^-24 (i + j < 3
  of 9). Two parts (16 bits, 3 wgmmas) missed the float32 tolerance (1e-5) on short
  sequences: a NumPy emulation over 3 tokens erred by up to 1.8e-5 at every width,
  against 1e-7 with 3 parts. A float32 step lands in shared memory as it is and
  passes through registers into the parts' operand buffers; the query stays float32
  in shared memory (the bytes of two parts) and is split the same way, a column part
  at a time. The cost is FLOPs: at group <= 64 padded to 64 rows, 6 products need 192
  FLOP per float32 K/V byte, ~640 TFLOP/s at the H100's full bandwidth, beyond what
  its tensor cores sustain beside the register repacking, so float32 pages are
  compute-bound: they buy float32 accuracy, not speed. Float32 queries over 16-bit
  pages become hi + lo parts (the pages are exact in 16 bits; logits to ~2^-16).
* Pages of 1, 2 or 4 rows (below one 8-row tile of the swizzled wgmma layout) are
  copied by TMA, one copy per page, into stage slots tiled by the page's rows, and
  repacked through registers like float32 pages; a part's copies arrive on one
  barrier per slot (`num_arrivals` = copies). Beyond 8 copies a part (pages under 8
  rows) the copies are a loop, not unrolled: lowering a page-1 kernel took 23 s on
  jax 0.11.2 with 64 unrolled copies, 2 s with the loop.
* Widths up to 512: a value wider than 256 columns is split over programs (each
  accumulating 256 columns, 128 float32 registers a thread, re-reading K).
* Every page dtype, query dtype, head width (16 to 512) and page size the Triton
  kernel takes runs here on jax >= 0.11; jax 0.10 lowers TMA copies of whole 128
  bytes only, which sends the narrowest tiny-page copies (e.g. 1 x 16 bf16) to Triton.

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
_SMALL_PAGES = (1, 2, 4)  # pages below one tile: staged untiled, repacked through registers
_MAX_STAGES = 4
_SMEM_BUDGET = 200 * 1024  # of the H100's 227 KiB per block, leaving room for the table
_MAX_TABLE_WINDOW = 4096  # block-table entries per program: 16 KiB beside the budget
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_F32 = jnp.dtype(jnp.float32)
_HEAD_DIMS = (16, 32, 64, 128, 256, 512)
_MAX_ACC_COLS = 256  # output columns one warpgroup accumulates (128 f32 registers a thread)
_REPACK_COLS = 64  # columns per register pass: one 128-byte swizzle tile of 16-bit values
_MIN_COLS = 32  # narrowest column part of a copy (128 bytes of float32)
_UNROLLED_COPIES = 8  # page copies a step issues unrolled (pages >= 8 rows); more: a loop


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
      v_block: output columns per program (v_head_dim up to 256; wider values are split
        over programs, each re-reading K, so one warpgroup's accumulator fits its
        registers).
      repack: pages land in untiled shared memory and pass through registers into the
        swizzled wgmma operand buffers (pages smaller than one 8-row tile, float32 pages).
      parts: 16-bit parts per cached value in the operand buffers: 3 (hi + mid + lo
        bfloat16, together exact) for float32 pages, else 1.
      k_cols, v_cols: columns of K and of the program's value block per copy into a stage
        slot (0: the whole width). Narrower than the width when a step's whole K and V
        rows do not fit shared memory: a step then takes several slots of each ring, Q K^T
        sums the column parts' products and P V fills the output's column parts one by
        one.
    """

    block_tokens: int
    chunk: int
    num_stages: int
    num_splits: int
    pages_per_split: int
    table_window: int
    v_block: int = 0
    repack: bool = False
    parts: int = 1
    k_cols: int = 0
    v_cols: int = 0


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
    if dtype not in (*_DTYPES, _F32) or jnp.dtype(v_pages.dtype) != dtype:
        return (f"the Mosaic GPU kernel takes bfloat16, float16 or float32 pages (one dtype "
                f"for K and V), got k_pages {k_pages.dtype}, v_pages {v_pages.dtype}.")
    if jnp.dtype(q.dtype) not in (*_DTYPES, _F32):
        return f"the Mosaic GPU kernel takes bfloat16, float16 or float32 queries, got {q.dtype}."
    for name, width in (("head_dim", head_dim), ("v_head_dim", v_dim)):
        if width not in _HEAD_DIMS:
            return (f"the Mosaic GPU kernel takes {name} in {_HEAD_DIMS} (whole swizzle tiles "
                    f"of wgmma operands), got {width}.")
    if page_size not in _SMALL_PAGES and (page_size % _MIN_PAGE or not (
        _BLOCK_TOKENS % page_size == 0 or page_size % _BLOCK_TOKENS == 0
    )):
        return (f"the Mosaic GPU kernel takes page sizes {_SMALL_PAGES} or multiples of "
                f"{_MIN_PAGE} (a TMA copy of one page must fill whole 8-row tiles of the "
                f"swizzled shared memory wgmma reads) dividing or divisible by "
                f"{_BLOCK_TOKENS}, got {page_size}.")
    q_parts = _q_parts(q.dtype, dtype)
    tiling = _tiling(head_dim, v_dim, page_size, dtype.itemsize, q_parts, _SMEM_BUDGET)
    if tiling is None:
        need = _smem_bytes(head_dim, v_dim, page_size, dtype.itemsize, 1, q_parts,
                           _MIN_COLS)
        return (f"the Mosaic GPU kernel needs {need} bytes of shared memory for head_dim "
                f"{head_dim}, v_head_dim {v_dim} and {dtype} pages (one pipeline stage of "
                f"{_MIN_COLS}-column copies, the query parts and the repacked operands), more "
                f"than its {_SMEM_BUDGET}.")
    if mgpu.JAX_VERSION < (0, 11):
        cols = tiling[0]
        copy = min(page_size, _BLOCK_TOKENS) * cols * dtype.itemsize
        if copy % 128:
            return (f"jax {jax.__version__} lowers TMA copies of a multiple of 128 bytes "
                    f"only (a jax 0.10 lowering limit; jax 0.11 lowers any), and one page's "
                    f"rows of page_size {page_size} x {cols} columns in {dtype} are {copy}.")
    group = q_heads // max(kv_heads, 1)
    if group > _MMA_ROWS:
        return (f"the Mosaic GPU kernel holds at most {_MMA_ROWS} query heads per KV head "
                f"(one wgmma tile), got {group}.")
    return None


def _layout(head_dim: int, v_dim: int, page_size: int, itemsize: int):
    """(v_block, repack, parts) for a cache geometry: see `KernelConfig`."""
    repack = page_size < _MIN_PAGE or itemsize == 4
    return min(v_dim, _MAX_ACC_COLS), repack, (3 if itemsize == 4 else 1)


def _q_parts(q_dtype, page_dtype) -> int:
    """Bytes per query element in shared memory, over 2: 2 for float32 queries over 16-bit
    pages (hi + lo bfloat16 parts) and for float32 pages (the float32 query itself, split
    into parts a column part at a time), else 1."""
    return 2 if _F32 in (jnp.dtype(q_dtype), jnp.dtype(page_dtype)) else 1


def _smem_bytes(head_dim: int, v_dim: int, page_size: int, itemsize: int, stages: int,
                q_parts: int, cols: int) -> int:
    """Shared memory of one program, the block table aside: `stages` K/V stage slots of at
    most `cols` columns each in the pages' dtype, the query (`q_parts` x 2 bytes an
    element), and with `repack` the 16-bit operand buffers (K's and V's shared when they
    are equally wide; for float32 pages also the query's parts of one column part)."""
    v_block, repack, parts = _layout(head_dim, v_dim, page_size, itemsize)
    kc, vc = min(head_dim, cols), min(v_block, cols)
    stage = _BLOCK_TOKENS * (kc + vc) * itemsize
    q = q_parts * _MMA_ROWS * head_dim * 2
    ops = parts * _BLOCK_TOKENS * (kc + (0 if vc == kc else vc)) * 2 if repack else 0
    if itemsize == 4:
        ops += parts * _MMA_ROWS * kc * 2
    return stages * stage + q + ops


def _tiling(head_dim: int, v_dim: int, page_size: int, itemsize: int, q_parts: int,
            budget: int) -> tuple[int, int] | None:
    """(columns per copy, stages) within `budget` bytes, or None when nothing fits.

    Whole rows first: the widest copies that leave 2 or more stages in flight, halving the
    columns (down to `_MIN_COLS`) until they do; if no width leaves 2, the widest with 1.
    """
    widest = max(head_dim, min(v_dim, _MAX_ACC_COLS))
    if _layout(head_dim, v_dim, page_size, itemsize)[1]:
        widest = min(widest, _REPACK_COLS)  # one register pass a part (see the docstring)
    caps = [widest >> i for i in range(8) if widest >> i >= min(_MIN_COLS, widest)]
    single = None
    for cap in caps:
        fixed = _smem_bytes(head_dim, v_dim, page_size, itemsize, 0, q_parts, cap)
        stage = _smem_bytes(head_dim, v_dim, page_size, itemsize, 1, q_parts, cap) - fixed
        stages = min(_MAX_STAGES, max(0, budget - fixed) // stage)
        if stages >= 2:
            return cap, stages
        if stages == 1 and single is None:
            single = (cap, 1)
    return single


def kernel_config(
    batch: int, kv_heads: int, max_pages: int, page_size: int, head_dim: int, v_dim: int,
    itemsize: int, num_sms: int, q_parts: int = 2,
) -> KernelConfig:
    """The tiling `paged_decode_attention` uses for a cache geometry (a pure function);
    `q_parts` is 2 for float32 queries or pages (hi + lo parts over 16-bit pages, the
    float32 query itself over float32 pages), else 1.

    Raises:
      ValueError: when the geometry does not fit shared memory (`unsupported_reason`).
    """
    block_tokens = _BLOCK_TOKENS
    chunk = min(page_size, block_tokens)
    v_block, repack, parts = _layout(head_dim, v_dim, page_size, itemsize)
    tiling = _tiling(head_dim, v_dim, page_size, itemsize, q_parts, _SMEM_BUDGET)
    if tiling is None:
        raise ValueError(f"kernel_config: head_dim {head_dim}, v_head_dim {v_dim}, "
                         f"page_size {page_size} and {itemsize}-byte pages do not fit "
                         f"{_SMEM_BUDGET} bytes of shared memory; see unsupported_reason.")
    cols, stages = tiling
    pages_per_step = max(1, block_tokens // page_size)
    steps_per_page = max(1, page_size // block_tokens)
    num_steps = max(1, -(-max_pages // pages_per_step) * steps_per_page)
    splits = choose_splits(batch * kv_heads * (v_dim // v_block), num_steps, num_sms)
    steps_per_split = -(-num_steps // splits)
    # A split is whole steps and starts at a 16-byte aligned table entry.
    unit = math.lcm(4, pages_per_step)
    pages_per_split = -(-steps_per_split * block_tokens // page_size)
    pages_per_split = -(-pages_per_split // unit) * unit
    # The table window shares the block's shared memory with the budget's buffers: tiny
    # pages over a long sequence take more splits rather than a larger window.
    pages_per_split = min(pages_per_split, _MAX_TABLE_WINDOW)
    splits = -(-max_pages // pages_per_split)  # no split without pages
    return KernelConfig(block_tokens=block_tokens, chunk=chunk, num_stages=stages,
                        num_splits=splits, pages_per_split=pages_per_split,
                        table_window=-(-pages_per_split // 32) * 32, v_block=v_block,
                        repack=repack, parts=parts, k_cols=min(head_dim, cols),
                        v_cols=min(v_block, cols))


def _smem_transforms(width: int, itemsize: int, rows: int = 8):
    """Swizzled tiles of `rows` rows; wgmma operands need 8, a page of 1-4 rows is copied
    into tiles of its own height (then repacked into 8-row tiles through registers)."""
    swizzle = min(128, width * itemsize)
    return (plgpu.TilingTransform((rows, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def _pairs(a_parts: int, b_parts: int) -> tuple[tuple[int, int], ...]:
    """The part products that matter to float32 accuracy: part i carries ~2^(-8 i) of a
    value, so of n-part splits keep the products with i + j < n (hi + lo: all but lo x lo;
    hi + mid + lo: 6 of 9, the rest below 2^-24)."""
    n = max(a_parts, b_parts)
    return tuple((a, b) for a in range(a_parts) for b in range(b_parts) if a + b < n)


def _split(x, dtype, parts: int) -> list:
    """x (float32) as `parts` values of a 16-bit `dtype` summing to x: each the rounding of
    what the previous ones leave (exact subtractions), so 3 bfloat16 parts hold all 24
    bits of a float32 significand."""
    out = []
    for _ in range(parts):
        piece = x.astype(dtype)
        out.append(piece)
        x = x - piece.astype(jnp.float32)
    return out


def _decode_kernel(
    q_ref, k_ref, v_ref, len_ref, tbl_ref, o_ref, lse_ref,  # GMEM
    q_smem, k_smem, v_smem, tbl_smem, q_bar, k_bars, v_bars, tbl_bar, k_op, v_op, q_op,
    p_smem,  # scratch
    *, cfg: KernelConfig, page_size: int, scale: float, soft_cap: float | None,
    sliding_window: int | None, interpret,
):
    s_idx = jax.lax.axis_index("split")
    hv = jax.lax.axis_index("kv_head")  # KV head x value-column block
    b = jax.lax.axis_index("seq")
    bt, chunk, stages = cfg.block_tokens, cfg.chunk, cfg.num_stages
    chunks = bt // chunk
    vb = cfg.v_block
    v_blocks = v_ref.shape[-1] // vb
    h, vc = hv // v_blocks, hv % v_blocks
    kc, vcols = cfg.k_cols, cfg.v_cols
    nk, nv = k_ref.shape[-1] // kc, vb // vcols  # K and V copies per step
    op_dtype = q_smem.dtype if q_op is None else q_op.dtype
    pps = cfg.pages_per_split
    if cfg.repack and v_op is None:
        v_op = k_op

    plgpu.copy_gmem_to_smem(tbl_ref.at[b, pl.ds(s_idx * pps, cfg.table_window)], tbl_smem,
                            tbl_bar)
    # One copy per (part, column part): a TMA box has at most 5 dims.
    for i in range(q_smem.shape[0]):
        plgpu.copy_gmem_to_smem(q_ref.at[b, h, i], q_smem.at[i], q_bar)

    length = len_ref[b]
    first = jnp.int32(0) if sliding_window is None else jnp.maximum(length - sliding_window, 0)
    split0 = s_idx * (pps * page_size)  # first token of this split
    lo_tok = jnp.maximum(first, split0)
    hi_tok = jnp.minimum(length, split0 + pps * page_size)
    lo_step = (lo_tok - split0) // bt
    num_steps = jnp.where(hi_tok > lo_tok, pl.cdiv(hi_tok - split0, bt) - lo_step, 0)

    plgpu.barrier_wait(tbl_bar)

    def ring(ref, smem, bars, col0, cols, per_step):
        """`issue(j, i)`: the copies of step j's `i`-th column part (i static or traced; past
        `per_step`, a later step's), `cols` columns from `col0 + i * cols` of the step's
        rows, into slot (j * per_step + i) % stages of the ring; nothing past the split's
        last step."""

        def issue(j, i):
            j = j + i // per_step
            i = i % per_step
            slot = (j * per_step + i) % stages
            step0 = split0 + (lo_step + j) * bt

            def copy(c):
                tok = step0 + c * chunk
                visible = (tok < length) & (tok + chunk > first)
                page = jnp.where(visible, tbl_smem[(tok - split0) // page_size], 0)
                src = ref.at[h, page, pl.ds(tok % page_size, chunk)]
                if cols != ref.shape[-1]:
                    src = ref.at[h, page, pl.ds(tok % page_size, chunk),
                                 pl.ds(col0 + i * cols, cols)]
                plgpu.copy_gmem_to_smem(src, smem.at[slot, pl.ds(c * chunk, chunk)],
                                        bars.at[slot])

            @pl.when(j < num_steps)
            def _():
                if chunks <= _UNROLLED_COPIES:
                    for c in range(chunks):
                        copy(c)
                else:  # pages of 1-4 rows: a loop keeps the lowered program small
                    pl.loop(0, chunks)(copy)

        return issue

    issue_k = ring(k_ref, k_smem, k_bars, 0, kc, nk)
    issue_v = ring(v_ref, v_smem, v_bars, vc * vb, vcols, nv)
    for i in range(stages):
        issue_k(0, i)
        issue_v(0, i)

    plgpu.barrier_wait(q_bar)
    wgmma_layout = plgpu.Layout.WGMMA
    row_layout = wgmma_layout.reduce(1)
    layout_cast = functools.partial(mgpu.layout_cast, interpret=interpret)
    iota = functools.partial(mgpu.broadcasted_iota, jnp.int32, layout=wgmma_layout,
                             interpret=interpret)
    m0 = layout_cast(jnp.full((_MMA_ROWS,), NEG_INF, jnp.float32), row_layout)
    l0 = layout_cast(jnp.full((_MMA_ROWS,), 0.0, jnp.float32), row_layout)
    acc0 = tuple(layout_cast(jnp.zeros((_MMA_ROWS, vcols), jnp.float32), wgmma_layout)
                 for _ in range(nv))

    def repack(stage, op, step0=None):
        """stage [rows, width] (the pages' dtype, or the float32 query) -> op [parts, rows,
        width] (16-bit, 8-row swizzled tiles), through registers a swizzle tile of columns
        at a time; with `step0`, rows outside [first, length) become 0 (NaN there must not
        reach P V)."""
        rows, width = stage.shape
        cols = min(width, _REPACK_COLS)
        for c0 in range(0, width, cols):
            x = mgpu.load(stage.at[:, pl.ds(c0, cols)], wgmma_layout, interpret=interpret)
            if step0 is not None:
                pos = step0 + iota((rows, cols), 0)
                x = jnp.where((pos >= first) & (pos < length), x, jnp.zeros_like(x))
            for i, piece in enumerate(_split(x.astype(jnp.float32), op_dtype, cfg.parts)):
                op[i, :, pl.ds(c0, cols)] = piece
        plgpu.commit_smem()

    if q_op is None:
        q_parts = q_smem.shape[0] // nk
    else:  # float32 pages: the query's parts of one column part at a time
        q_parts = cfg.parts
        if nk == 1:
            repack(q_smem.at[0], q_op)

    def step(j, carry):
        accs, m_prev, l_prev = carry
        step0 = split0 + (lo_step + j) * bt

        def qk_part(i):  # Q K^T over K's i-th column part
            slot = (j * nk + i) % stages
            plgpu.barrier_wait(k_bars.at[slot])
            if cfg.repack:
                repack(k_smem.at[slot], k_op)
                k_parts = tuple(k_op.at[p] for p in range(cfg.parts))
            else:
                k_parts = (k_smem.at[slot],)
            if q_op is None:
                q_in = tuple(q_smem.at[a * nk + i] for a in range(q_parts))
            else:
                if nk > 1:
                    repack(q_smem.at[i], q_op)
                q_in = tuple(q_op.at[a] for a in range(q_parts))
            qk = _pairs(q_parts, len(k_parts))
            part = mgpu.dot_transposed_b(tuple(q_in[a] for a, _ in qk),
                                         tuple(k_parts[c] for _, c in qk),
                                         interpret=interpret)
            issue_k(j, i + stages)  # the slot is read (the product is awaited)
            return part

        if nk == 1:
            s = qk_part(0)
        else:  # a loop over the column parts keeps the lowered program small
            s = jax.lax.fori_loop(0, nk, lambda i, s: s + qk_part(i),
                                  layout_cast(jnp.zeros((_MMA_ROWS, bt), jnp.float32),
                                              wgmma_layout))
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

        p_in = _split(p, op_dtype, cfg.parts)  # float32 values: P in parts too
        if p_smem is not None:
            for i, part in enumerate(p_in):
                p_smem[i] = part
            plgpu.commit_smem()
            p_in = [p_smem.at[i] for i in range(len(p_in))]

        new_accs = []
        for i in range(nv):  # P V, one column part of the output at a time
            slot = (j * nv + i) % stages
            plgpu.barrier_wait(v_bars.at[slot])
            if cfg.repack:
                # The last product has been awaited, so a shared operand buffer is free.
                repack(v_smem.at[slot], v_op, step0)
                v_parts = tuple(v_op.at[c] for c in range(cfg.parts))
            else:
                v_parts = (v_smem.at[slot],)

                @pl.when((j == 0) | (j == num_steps - 1))
                def _(slot=slot):  # zero the rows no query sees: 0 * NaN in P V is NaN
                    v_tile = v_smem.at[slot]
                    rows = step0 + iota((bt, vcols), 0)
                    v = v_tile[...]
                    v_tile[...] = jnp.where((rows >= first) & (rows < length), v,
                                            jnp.zeros_like(v))
                    plgpu.commit_smem()

            def pv(acc_ref, v_parts=v_parts):
                for a, c in _pairs(len(p_in), len(v_parts)):
                    plgpu.wgmma(acc_ref, p_in[a], v_parts[c])
                return acc_ref[...]

            pv_out = pl.run_scoped(pv, plgpu.ACC((_MMA_ROWS, vcols), jnp.float32))
            new_accs.append(
                accs[i] * jax.lax.broadcast_in_dim(alpha, accs[i].shape, [0]) + pv_out)
            issue_v(j, i + stages)

        return tuple(new_accs), m_new, l_new

    accs, m, l_sum = jax.lax.fori_loop(0, num_steps, step, (acc0, m0, l0))
    seen = l_sum > 0.0
    safe_l = jnp.where(seen, l_sum, 1.0)
    for i, acc in enumerate(accs):
        out = jnp.where(jax.lax.broadcast_in_dim(seen, acc.shape, [0]),
                        acc / jax.lax.broadcast_in_dim(safe_l, acc.shape, [0]), 0.0)
        if vcols == o_ref.shape[-1]:
            o_ref[s_idx, b, h] = out
        else:
            o_ref[s_idx, b, h, :, pl.ds(vc * vb + i * vcols, vcols)] = out
    lse_ref[s_idx, b, hv] = jnp.where(seen, m + jnp.log(safe_l), NEG_INF)


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
    op_dtype = jnp.bfloat16 if dtype == jnp.float32 else dtype
    q_parts = _q_parts(q.dtype, dtype)
    f32_pages = itemsize == 4
    max_pages = block_tables.shape[1]
    cfg = kernel_config(batch, kv_heads, max_pages, page_size, head_dim, dv, itemsize, num_sms,
                        q_parts=q_parts)
    splits, pps, vb = cfg.num_splits, cfg.pages_per_split, cfg.v_block
    v_blocks = dv // vb
    kc = cfg.k_cols
    nk = head_dim // kc

    qg = q.reshape(batch, kv_heads, 1, group, head_dim)
    if f32_pages:  # the kernel splits the float32 query as it splits K
        qg, q_dtype, q_slices = qg.astype(jnp.float32), jnp.float32, 1
    elif q_parts == 2:
        # Two 16-bit parts, hi + lo, carry a float32 query to ~2^-16 relative.
        qg = jnp.concatenate(_split(qg.astype(jnp.float32), op_dtype, 2), axis=2)
        q_dtype, q_slices = op_dtype, 2
    else:
        q_dtype, q_slices = op_dtype, 1
    qg = jnp.pad(qg.astype(q_dtype), ((0, 0), (0, 0), (0, 0), (0, _MMA_ROWS - group), (0, 0)))
    # [batch, kv_heads, parts x column parts, rows, k_cols]: one TMA copy per slice.
    qg = qg.reshape(batch, kv_heads, q_slices, _MMA_ROWS, nk, kc).transpose(0, 1, 2, 4, 3, 5)
    qg = qg.reshape(batch, kv_heads, q_slices * nk, _MMA_ROWS, kc)
    tables = jnp.pad(block_tables.astype(jnp.int32),
                     ((0, 0), (0, (splits - 1) * pps + cfg.table_window - max_pages)))
    kernel = functools.partial(
        _decode_kernel, cfg=cfg, page_size=page_size, scale=scale, soft_cap=soft_cap,
        sliding_window=sliding_window, interpret=interpret,
    )

    def staged(width):  # K/V stages, swizzled in tiles of one TMA copy's rows (at most 8)
        return plgpu.SMEM((cfg.num_stages, cfg.block_tokens, width), dtype,
                          transforms=_smem_transforms(width, itemsize, min(cfg.chunk, 8)))

    def operands(width):
        return plgpu.SMEM((cfg.parts, cfg.block_tokens, width), op_dtype,
                          transforms=_smem_transforms(width, 2))

    k_op = v_op = None
    if cfg.repack:
        k_op = operands(kc)
        v_op = None if cfg.v_cols == kc else operands(cfg.v_cols)  # None: V shares K's
    p_parts = cfg.parts
    copies = cfg.block_tokens // cfg.chunk
    out, lse = plgpu.kernel(
        kernel,
        out_type=(
            jax.ShapeDtypeStruct((splits, batch, kv_heads, _MMA_ROWS, dv), jnp.float32),
            jax.ShapeDtypeStruct((splits, batch, kv_heads * v_blocks, _MMA_ROWS), jnp.float32),
        ),
        scratch_types=(
            plgpu.SMEM((q_slices * nk, _MMA_ROWS, kc), q_dtype,
                       transforms=_smem_transforms(kc, jnp.dtype(q_dtype).itemsize)),
            staged(kc),
            staged(cfg.v_cols),
            plgpu.SMEM((cfg.table_window,), jnp.int32),
            plgpu.Barrier(num_arrivals=q_slices * nk),
            plgpu.Barrier(num_arrivals=copies, num_barriers=cfg.num_stages),
            plgpu.Barrier(num_arrivals=copies, num_barriers=cfg.num_stages),
            plgpu.Barrier(),
            k_op,
            v_op,
            plgpu.SMEM((cfg.parts, _MMA_ROWS, kc), op_dtype,
                       transforms=_smem_transforms(kc, 2)) if f32_pages else None,
            (plgpu.SMEM((p_parts, _MMA_ROWS, cfg.block_tokens), op_dtype,
                        transforms=_smem_transforms(cfg.block_tokens, 2))
             if mgpu.wgmma_a_from_smem(interpret) else None),
        ),
        grid=(splits, kv_heads * v_blocks, batch),
        grid_names=("split", "kv_head", "seq"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=mgpu.resolve_interpret(interpret),
    )(qg, k_pages, v_pages, lengths.astype(jnp.int32), tables)
    lse = lse.reshape(splits, batch, kv_heads, v_blocks, _MMA_ROWS)[:, :, :, 0]
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
      q: [batch, q_heads, head_dim]; q_heads a multiple of kv_heads, at most 64 per KV
        head; bfloat16, float16 or float32 (over 16-bit pages split into hi + lo parts
        in the pages' dtype for the tensor cores: logits to ~2^-16 relative).
      k_pages, v_pages: one layer's pools [kv_heads, pages, page_size, head_dim |
        v_head_dim], bfloat16, float16 or float32 (one dtype; float32 to float32
        accuracy through 3 bfloat16 parts, see the module docstring); head_dim and
        v_head_dim in 16..512 (powers of two); page_size 1, 2, 4 or a multiple of 8
        dividing or divisible by 64.
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
