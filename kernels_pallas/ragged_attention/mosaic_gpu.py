"""Ragged paged attention (chunked prefill, mixed steps) on Hopper as a Mosaic GPU kernel.

The contract of `kernels_pallas/paged_attention/reference.paged_prefill_attention`
(and of the TPU kernel beside this file): a batch of rows, row b with
`q_lengths[b]` new queries (0 up to the chunk width; 1 for a decode row) at
positions `lengths[b] - q_lengths[b] + t`, causal against its cache pages;
GQA/MQA/MHA, bf16 or f16 pages, sliding window and soft cap. Returns the
output in q's dtype and the float32 log-sum-exp; rows past `q_lengths` give 0
and -inf. `unsupported_reason` says which shapes it leaves to the XLA path.

Design (after FlashAttention-3's forward and jax's `attention_mgpu.py`):

* Work items. The query heads of one KV head (the GQA group) are folded into
  the rows of a query block, as in the TPU kernel: a compute warpgroup holds
  64 rows (wgmma's M) = `64 // group` query positions x `group` heads, so each
  K/V byte brought into shared memory serves the whole group. A work item is
  (KV head, row, query block) of 128 rows, one 64-row half per compute
  warpgroup; rows with no new query have no item, a decode row is one item.
* Warp specialisation: three warpgroups per CTA. Warpgroup 2 only issues TMA
  copies (40 registers; `set_max_registers`) and streams the K and V pages of
  its items' steps into a `num_stages` ring; warpgroups 0 and 1 (232
  registers) each compute S = Q K^T and O += P V with `wgmma` on their own 64
  rows against the same K/V stage. Separate "landed" barriers for K and V let
  Q K^T start before V lands, and separate "free" barriers (two arrivals) let
  the next K copy start as soon as both Q K^T are done.
* Pages by the block table: one TMA copy per page (Hopper has no TMA gather),
  `block_tokens` = 128 tokens per step at head_dim <= 128 (64 above, for the
  accumulator's registers), so a 16-token page is 8 copies per step and K
  and V each; the page ids of a step are read before waiting for its slot.
  Table entries are clamped to the pages the item's queries can see, so
  garbage past a row's length is never an address.
* Persistent schedule: `min(num_sms, items)` CTAs (one per SM: the ring
  takes 128 KiB of shared memory at head_dim 128) walk the item list
  round-robin. The wrapper sorts the items by their number of steps, longest
  first (FA3's persistent causal scheduler likewise starts with the longest
  blocks): with round-robin that is the greedy longest-processing-time
  assignment, so a long chunk's late blocks do not end up last on one SM. The
  K/V ring runs across item boundaries (the copy warpgroup prefetches the
  next item's first pages while the current one computes).
* Masking only where needed: per warpgroup, the steps wholly below its first
  query's position (and, with a window, wholly inside its last query's
  window) run without a mask; only the diagonal steps (and the window's
  leading edge) build the position mask.
* Online softmax in base 2 (logits scaled by log2(e) once, `exp2`), float32
  statistics, P rounded to the pages' dtype as the register A operand of
  P V. Soft cap `c * tanh(s / c)` before the mask.
* NaN safety: K rows a query must not see are selected away in the logits;
  V rows outside [first key, last key] of the item (the unwritten tail of a
  row's last page, pages clamped in place of dead entries) are zeroed in
  shared memory by warpgroup 0 on the item's boundary steps before either
  warpgroup's P V (one extra warpgroup barrier on those steps only).

Output goes back through shared memory by TMA (the Q buffer once the last
Q K^T is done), the log-sum-exp likewise.

Not measured on a GPU yet (checked in Mosaic GPU's interpreter with race
detection and lowered for an H100 from CPU: tests/kernels/test_mosaic_gpu_ragged.py).
Design targets: bf16 prefill at >= 50% of the measured bf16 matmul rate.
Known costs to measure first: the per-item start (two dependent global
loads and the Q copy, ~1-2 us; Q is not prefetched across items), a decode
row occupying a whole 128-row item (FA3 pads decode rows the same way), and
the page ids read from global memory by the copy warpgroup (the decode
kernel stages them in shared memory). Not done yet: the ping-pong schedule
barrier between the two compute warpgroups (one's softmax under the other's
wgmma; jax's `attention_mgpu.py` `use_schedule_barrier`, FA3's
intra-warpgroup overlap), the first thing to try if the tensor cores idle.

Absorbed MLA is not served here: its value is the d_c = 512 latent, whose
float32 [64, 512] accumulator exceeds one warpgroup's registers; it needs the
output columns split across warpgroups (as the MLA decode kernel does) rather
than the query rows. `mla_mosaic_gpu.py` does that on this kernel's schedule
(`work_items`).
"""

import dataclasses
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
from kernels_pallas.ragged_attention.tpu import _check_gqa

__all__ = ["paged_prefill_attention", "unsupported_reason", "GpuRaggedConfig",
           "default_config", "work_items"]

ROWS = 64  # rows per compute warpgroup: wgmma's M
COMPUTE_WGS = 2
ITEM_ROWS = ROWS * COMPUTE_WGS
_MIN_PAGE = 8  # rows of one tile of the swizzled shared-memory layout
_SMEM_BUDGET = 220 * 1024  # of the 227 KiB a Hopper block may use, leaving room for barriers
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_HEAD_DIMS = (64, 128, 256)
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
NEG_INF = float("-inf")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuRaggedConfig:
    """Tiling of the Mosaic GPU ragged kernel (hashable: a static argument).

    Attributes:
      block_tokens: cached tokens per pipeline step: Q K^T's N and P V's K; a multiple of
        64 that the page size divides or is a multiple of.
      num_stages: K/V steps in the shared-memory ring (>= 2).
    """

    block_tokens: int
    num_stages: int

    def __post_init__(self):
        if not isinstance(self.block_tokens, int) or self.block_tokens < 64 or (
                self.block_tokens % 64):
            raise ValueError(f"GpuRaggedConfig.block_tokens must be a multiple of 64, got "
                             f"{self.block_tokens!r}.")
        if not isinstance(self.num_stages, int) or self.num_stages < 2:
            raise ValueError(f"GpuRaggedConfig.num_stages must be an int >= 2, got "
                             f"{self.num_stages!r}.")


def _smem_bytes(cfg: GpuRaggedConfig, head_dim: int, v_dim: int, itemsize: int,
                a_from_smem: bool = False) -> int:
    q = COMPUTE_WGS * ROWS * head_dim * itemsize
    o = 0 if v_dim == head_dim else COMPUTE_WGS * ROWS * v_dim * itemsize
    ring = cfg.num_stages * cfg.block_tokens * (head_dim + v_dim) * itemsize
    p = COMPUTE_WGS * ROWS * cfg.block_tokens * itemsize if a_from_smem else 0
    return q + o + ring + p + 2 * 1024  # lse rows and barriers (1 KiB aligned each)


def default_config(head_dim: int, v_dim: int, itemsize: int = 2) -> GpuRaggedConfig:
    """128-token steps (FA3's block for head_dim 128) where the [64, 128] float32 logits and
    the [64, v_dim] accumulator fit a warpgroup's registers beside each other, 64 above;
    as many stages (2 to 4) as the shared-memory budget holds."""
    block_tokens = 128 if max(head_dim, v_dim) <= 128 else 64
    stages = 2
    while stages < 4 and _smem_bytes(GpuRaggedConfig(block_tokens=block_tokens,
                                                     num_stages=stages + 1),
                                     head_dim, v_dim, itemsize) <= _SMEM_BUDGET:
        stages += 1
    return GpuRaggedConfig(block_tokens=block_tokens, num_stages=stages)


def unsupported_reason(q, k_pages, v_pages, config: GpuRaggedConfig | None = None) -> str | None:
    """None when this kernel takes these shapes and dtypes; else a sentence saying why not.

    Takes arrays or `jax.ShapeDtypeStruct`s (only shapes and dtypes are read): q [batch,
    q_len, q_heads, head_dim], pools [kv_heads, pages, page_size, width].
    """
    head_dim = q.shape[-1]
    kv_heads, _, page_size, v_dim = v_pages.shape
    dtype = jnp.dtype(k_pages.dtype)
    if dtype not in _DTYPES or {jnp.dtype(q.dtype), jnp.dtype(v_pages.dtype)} != {dtype}:
        return (f"the Mosaic GPU ragged kernel takes bfloat16 or float16 queries and pages of "
                f"one dtype (wgmma reads float32 only as tf32), got q {q.dtype}, k_pages "
                f"{k_pages.dtype}, v_pages {v_pages.dtype}.")
    for name, width in (("head_dim", head_dim), ("v_head_dim", v_dim)):
        if width not in _HEAD_DIMS:
            return (f"the Mosaic GPU ragged kernel takes {name} in {_HEAD_DIMS} (whole 128-byte "
                    f"swizzle tiles; the [64, v_head_dim] float32 accumulator in one "
                    f"warpgroup's registers), got {width}.")
    cfg = config or default_config(head_dim, v_dim, dtype.itemsize)
    bt = cfg.block_tokens
    if page_size < _MIN_PAGE or page_size % _MIN_PAGE or not (
            bt % page_size == 0 or page_size % bt == 0):
        return (f"the Mosaic GPU ragged kernel takes page sizes that are multiples of "
                f"{_MIN_PAGE} (one TMA copy per page fills whole 8-row tiles of the swizzled "
                f"shared memory) dividing or divisible by its {bt}-token step, got "
                f"{page_size}.")
    group = q.shape[2] // max(kv_heads, 1)
    if group > ROWS:
        return (f"the Mosaic GPU ragged kernel folds the query heads of one KV head into a "
                f"warpgroup's {ROWS} rows, so at most {ROWS} per KV head, got {group}.")
    need = _smem_bytes(cfg, head_dim, v_dim, dtype.itemsize)
    if need > _SMEM_BUDGET:
        return (f"the Mosaic GPU ragged kernel needs {need} bytes of shared memory for "
                f"head_dim {head_dim}, v_head_dim {v_dim} and {cfg}, more than its budget "
                f"{_SMEM_BUDGET}.")
    return None


def work_items(
    lengths: Int[Array, " batch"],
    q_lengths: Int[Array, " batch"],
    *,
    heads: int,
    blocks: int,
    item_positions: int,
    block_tokens: int,
    sliding_window: int | None,
) -> tuple[Int[Array, "3 items"], Int[Array, " 1"]]:
    """The persistent grid's work list: every (head, row, query block) holding queries,
    longest first.

    Row b's query block qb covers positions `lengths[b] - q_lengths[b] + qb *
    item_positions` onward (at most `item_positions` of them); its cost is the number of
    `block_tokens`-token steps from the first key it sees (the window's start, or 0) to
    its last query. Sorted longest first (stable), the list dealt round-robin to the CTAs
    is the greedy longest-processing-time assignment. `heads` is the items' outer axis:
    KV heads for GQA, head blocks for MLA.

    Returns:
      (items int32[3, heads * batch * blocks]: head, row, query block of item i, the first
      `num_items` of them real; num_items int32[1]).
    """
    batch = lengths.shape[0]
    bt = block_tokens
    qb = jnp.arange(blocks, dtype=jnp.int32)[None, :]
    valid = qb * item_positions < q_lengths[:, None]  # [batch, blocks]
    q0 = (lengths - q_lengths)[:, None] + qb * item_positions
    last = jnp.minimum(lengths[:, None], q0 + item_positions) - 1
    first = (jnp.zeros_like(q0) if sliding_window is None
             else jnp.maximum(q0 - (sliding_window - 1), 0))
    steps = jnp.where(valid, last // bt - first // bt + 1, -1)
    cost = jnp.broadcast_to(steps, (heads, batch, blocks)).reshape(-1)
    order = jnp.argsort(-cost, stable=True).astype(jnp.int32)
    per_head = batch * blocks
    items = jnp.stack([order // per_head, (order % per_head) // blocks, order % blocks])
    num_items = (heads * valid.sum()).astype(jnp.int32).reshape(1)
    return items, num_items


def _swizzled(shape, dtype):
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = min(128, shape[-1] * itemsize)
    return plgpu.SMEM(shape, dtype, transforms=(
        plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)))


def _kernel(
    lengths_ref,  # i32[batch] (GMEM)
    q_lengths_ref,  # i32[batch]
    tables_ref,  # i32[batch, max_pages]
    items_ref,  # i32[3, max_items]: KV head, row, query block of item i (longest first)
    num_items_ref,  # i32[1]
    q_ref,  # [kv_heads, batch, blocks, 128, head_dim]: folded queries
    k_ref,  # [kv_heads, pages, page_size, head_dim]
    v_ref,  # [kv_heads, pages, page_size, v_dim]
    o_ref,  # [kv_heads, batch, blocks, 128, v_dim]
    lse_ref,  # f32[kv_heads, batch, blocks, 128]
    q_smem,  # [2, 64, head_dim]: each compute warpgroup's queries
    o_smem,  # [2, 64, v_dim], or None: the output staged in q_smem
    k_smem,  # [stages, block_tokens, head_dim]
    v_smem,  # [stages, block_tokens, v_dim]
    lse_smem,  # f32[2, 64]
    p_smem,  # [2, 64, block_tokens] or None: P staged for interpreters that need it
    q_bar,  # [2]: a warpgroup's query copy landed
    k_bar,  # [stages]: a step's K pages landed
    v_bar,  # [stages]: a step's V pages landed
    k_free,  # [stages]: both compute warpgroups finished Q K^T of a step (2 arrivals)
    v_free,  # [stages]: both finished P V of a step (2 arrivals)
    x_bar,  # the compute warpgroups meet after a boundary step's V rows are cleared
    *,
    cfg: GpuRaggedConfig,
    group: int,
    num_programs: int,
    scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    interpret: Any,
):
    sm = lax.axis_index("sm")
    wg = lax.axis_index("wg")
    bt, stages = cfg.block_tokens, cfg.num_stages
    page_size = k_ref.shape[2]
    piece = min(page_size, bt)
    pieces = bt // piece
    positions = ROWS // group  # query positions per warpgroup
    dtype = q_smem.dtype
    dv = v_smem.shape[-1]
    num_items = num_items_ref[0]
    my_items = lax.div(jnp.maximum(num_items - sm, 0) + (num_programs - 1), num_programs)

    def item(k):
        i = sm + k * num_programs
        return items_ref[0, i], items_ref[1, i], items_ref[2, i]

    def geometry(b, qb):
        """First query position, the first and last key any query of the item sees, and
        the item's steps [j_lo, j_hi)."""
        length = lengths_ref[b]
        q0 = length - q_lengths_ref[b] + qb * (COMPUTE_WGS * positions)
        last = jnp.minimum(length, q0 + COMPUTE_WGS * positions) - 1
        first = (jnp.int32(0) if sliding_window is None
                 else jnp.maximum(q0 - (sliding_window - 1), 0))
        return q0, first, last, lax.div(first, bt), lax.div(last, bt) + 1

    @pl.when(wg == COMPUTE_WGS)
    def _copy_warpgroup():
        plgpu.set_max_registers(40, action="decrease")

        def one_item(k, g):
            h, b, qb = item(k)
            _, first, last, j_lo, j_hi = geometry(b, qb)
            lo_page, hi_page = lax.div(first, page_size), lax.div(last, page_size)

            @pl.loop(j_lo, j_hi)
            def _(j):
                slot = lax.rem(g + j - j_lo, stages)
                copies = []
                for c in range(pieces):
                    tok = j * bt + c * piece
                    # Only pages the item's queries see are addresses: dead entries re-read
                    # a visible page, whose rows the mask and the V clearing leave unused.
                    page = tables_ref[b, jnp.clip(lax.div(tok, page_size), lo_page, hi_page)]
                    start = 0 if page_size <= bt else pl.multiple_of(
                        lax.rem(tok, page_size), bt)
                    copies.append((page, pl.ds(start, piece), pl.ds(c * piece, piece)))
                reuse = g + j - j_lo >= stages

                @pl.when(reuse)
                def _():
                    plgpu.barrier_wait(k_free.at[slot])

                for page, rows, dst in copies:
                    plgpu.copy_gmem_to_smem(k_ref.at[h, page, rows], k_smem.at[slot, dst],
                                            k_bar.at[slot])

                @pl.when(reuse)
                def _():
                    plgpu.barrier_wait(v_free.at[slot])

                for page, rows, dst in copies:
                    plgpu.copy_gmem_to_smem(v_ref.at[h, page, rows], v_smem.at[slot, dst],
                                            v_bar.at[slot])

            return g + (j_hi - j_lo)

        total = lax.fori_loop(0, my_items, one_item, jnp.int32(0))

        # Observe the last steps' releases: no barrier phase is left unwaited at exit.
        @pl.loop(jnp.maximum(total - stages, 0), total)
        def _(g):
            plgpu.barrier_wait(k_free.at[lax.rem(g, stages)])
            plgpu.barrier_wait(v_free.at[lax.rem(g, stages)])

    @pl.when(wg < COMPUTE_WGS)
    def _compute_warpgroup():
        plgpu.set_max_registers(232, action="increase")
        wgmma_layout = plgpu.Layout.WGMMA
        row_layout = wgmma_layout.reduce(1)
        layout_cast = functools.partial(mgpu.layout_cast, interpret=interpret)
        iota = functools.partial(mgpu.broadcasted_iota, jnp.int32, layout=wgmma_layout,
                                 interpret=interpret)
        a_from_smem = p_smem is not None
        in_place = mgpu.wgmma_acc_in_place(interpret)
        my_q = q_smem.at[wg]
        my_o = my_q if o_smem is None else o_smem.at[wg]
        rows = pl.ds(wg * ROWS, ROWS)
        qk_scale = jnp.float32(scale * _LOG2E if soft_cap is None else scale / soft_cap)
        v_chunk = min(dv, 64)  # one 128-byte swizzle tile of columns

        def one_item(k, g):
            h, b, qb = item(k)
            # The previous item's output left q_smem / o_smem (TMA store read them).
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            plgpu.copy_gmem_to_smem(q_ref.at[h, b, qb, rows], my_q, q_bar.at[wg])
            q0, first, last, j_lo, j_hi = geometry(b, qb)
            lo_pos = jnp.minimum(q0 + wg * positions, last)  # this warpgroup's queries
            hi_pos = jnp.minimum(q0 + wg * positions + (positions - 1), last)

            def row_pos():
                # Rows past the item's queries (padding) act as its last query: no row sees
                # nothing in the whole item.
                return jnp.minimum(lo_pos + lax.div(iota((ROWS, bt), 0), group), hi_pos)

            def step(j, carry, *, masked):
                acc, m_prev, l_prev = carry
                slot = lax.rem(g + j - j_lo, stages)
                plgpu.barrier_wait(k_bar.at[slot])
                s = mgpu.dot_transposed_b(my_q, k_smem.at[slot], interpret=interpret)
                plgpu.barrier_arrive(k_free.at[slot])
                s = s * qk_scale  # in log2 units (exp2 below) unless soft-capped
                if soft_cap is not None:
                    s = jnp.tanh(s) * jnp.float32(soft_cap * _LOG2E)
                if masked:
                    key = j * bt + iota((ROWS, bt), 1)
                    pos = row_pos()
                    visible = key <= pos
                    if sliding_window is not None:
                        visible &= pos - key < sliding_window
                    s = jnp.where(visible, s, NEG_INF)
                m_new = jnp.maximum(m_prev, s.max(axis=1))
                if masked and sliding_window is not None:
                    # A window's leading step may show a row nothing yet: keep exp2 at 0.
                    m_use = jnp.where(m_new == NEG_INF, 0.0, m_new)
                else:  # every row's first step holds key 0 or its own position
                    m_use = m_new
                alpha = jnp.exp2(m_prev - m_use)
                p = jnp.exp2(s - lax.broadcast_in_dim(m_use, s.shape, [0]))
                l_new = l_prev * alpha + p.sum(axis=1)
                p16 = p.astype(dtype)
                plgpu.barrier_wait(v_bar.at[slot])

                # Only the item's first and last steps can hold such rows, and the
                # condition is the item's, so both warpgroups meet at x_bar equally often
                # (checked on unmasked steps too, though none is a boundary step).
                @pl.when((j * bt < first) | ((j + 1) * bt > last + 1))
                def _():
                    @pl.when(wg == 0)
                    def _():  # V rows no query sees may be NaN: 0 * NaN in P V is NaN
                        for r0 in range(0, bt, ROWS):
                            for c0 in range(0, dv, v_chunk):
                                tile = v_smem.at[slot, pl.ds(r0, ROWS), pl.ds(c0, v_chunk)]
                                v = mgpu.load(tile, wgmma_layout, interpret=interpret)
                                key = j * bt + r0 + iota((ROWS, v_chunk), 0)
                                keep = (key >= first) & (key <= last)
                                tile[...] = jnp.where(keep, v, jnp.zeros_like(v))
                        plgpu.commit_smem()

                    plgpu.barrier_arrive(x_bar)
                    plgpu.barrier_wait(x_bar)

                if a_from_smem:
                    p_smem[wg] = p16
                    plgpu.commit_smem()
                    p_in = p_smem.at[wg]
                else:
                    p_in = p16
                scaled = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p_in, v_smem.at[slot])

                if in_place:
                    acc = pl.run_state(pv)(plgpu.ACC.init(scaled))
                else:
                    def fresh(acc_ref):
                        pv(acc_ref)
                        return acc_ref[...]

                    acc = scaled + pl.run_scoped(fresh, plgpu.ACC(acc.shape, jnp.float32))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l_new

            # Steps every row of this warpgroup sees whole run unmasked.
            if sliding_window is None:
                full_lo = j_lo
            else:
                edge = jnp.maximum(hi_pos - (sliding_window - 1), 0)
                full_lo = jnp.minimum(jnp.maximum(lax.div(edge + (bt - 1), bt), j_lo), j_hi)
            full_hi = jnp.maximum(jnp.minimum(lax.div(lo_pos + 1, bt), j_hi), full_lo)

            carry = (layout_cast(jnp.zeros((ROWS, dv), jnp.float32), wgmma_layout),
                     layout_cast(jnp.full((ROWS,), NEG_INF, jnp.float32), row_layout),
                     layout_cast(jnp.zeros((ROWS,), jnp.float32), row_layout))
            plgpu.barrier_wait(q_bar.at[wg])
            masked_step = functools.partial(step, masked=True)
            if sliding_window is not None:  # the window's leading edge
                carry = lax.fori_loop(j_lo, full_lo, masked_step, carry)
            carry = lax.fori_loop(full_lo, full_hi, functools.partial(step, masked=False),
                                  carry)
            acc, m, l_sum = lax.fori_loop(full_hi, j_hi, masked_step, carry)

            safe_l = jnp.where(l_sum > 0.0, l_sum, 1.0)
            out = acc * lax.broadcast_in_dim(1.0 / safe_l, acc.shape, [0])
            my_o[...] = out.astype(dtype)
            lse_smem[wg] = jnp.where(l_sum > 0.0, (m + jnp.log2(safe_l)) * _LN2, NEG_INF)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(my_o, o_ref.at[h, b, qb, rows])
            plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[h, b, qb, rows])
            return g + (j_hi - j_lo)

        lax.fori_loop(0, my_items, one_item, jnp.int32(0))
        plgpu.wait_smem_to_gmem(0)


@functools.partial(
    jax.jit,
    static_argnames=("scale", "soft_cap", "sliding_window", "num_sms", "config", "interpret"),
)
def _prefill(q, k_pages, v_pages, lengths, block_tables, q_lengths, *, scale, soft_cap,
             sliding_window, num_sms, config, interpret):
    batch, q_len, q_heads, head_dim = q.shape
    kv_heads, _, _, dv = v_pages.shape
    group = q_heads // kv_heads
    positions = ROWS // group
    item_positions = COMPUTE_WGS * positions
    blocks = pl.cdiv(q_len, item_positions)
    bt = config.block_tokens
    dtype = q.dtype

    # [batch, q_len, q_heads, d] -> [kv_heads, batch, blocks, 128, d]: each 64-row half is
    # `positions` positions x `group` heads, padded to 64 rows.
    qf = jnp.pad(q, ((0, 0), (0, blocks * item_positions - q_len), (0, 0), (0, 0)))
    qf = qf.reshape(batch, blocks, COMPUTE_WGS, positions, kv_heads, group, head_dim)
    qf = qf.transpose(4, 0, 1, 2, 3, 5, 6).reshape(
        kv_heads, batch, blocks, COMPUTE_WGS, positions * group, head_dim)
    qf = jnp.pad(qf, ((0, 0),) * 4 + ((0, ROWS - positions * group), (0, 0)))
    qf = qf.reshape(kv_heads, batch, blocks, ITEM_ROWS, head_dim)

    lengths = lengths.astype(jnp.int32)
    q_lengths = q_lengths.astype(jnp.int32)
    items, num_items = work_items(lengths, q_lengths, heads=kv_heads, blocks=blocks,
                                  item_positions=item_positions, block_tokens=bt,
                                  sliding_window=sliding_window)
    num_programs = min(num_sms, kv_heads * batch * blocks)

    a_from_smem = mgpu.wgmma_a_from_smem(interpret)
    kernel = functools.partial(
        _kernel, cfg=config, group=group, num_programs=num_programs, scale=scale,
        soft_cap=soft_cap, sliding_window=sliding_window, interpret=interpret)
    page_size = k_pages.shape[2]
    pieces = bt // min(page_size, bt)
    out, lse = plgpu.kernel(
        kernel,
        out_type=(
            jax.ShapeDtypeStruct((kv_heads, batch, blocks, ITEM_ROWS, dv), dtype),
            jax.ShapeDtypeStruct((kv_heads, batch, blocks, ITEM_ROWS), jnp.float32),
        ),
        scratch_types=(
            _swizzled((COMPUTE_WGS, ROWS, head_dim), dtype),
            None if dv == head_dim else _swizzled((COMPUTE_WGS, ROWS, dv), dtype),
            _swizzled((config.num_stages, bt, head_dim), dtype),
            _swizzled((config.num_stages, bt, dv), dtype),
            plgpu.SMEM((COMPUTE_WGS, ROWS), jnp.float32),
            _swizzled((COMPUTE_WGS, ROWS, bt), dtype) if a_from_smem else None,
            plgpu.Barrier(num_barriers=COMPUTE_WGS),
            plgpu.Barrier(num_arrivals=pieces, num_barriers=config.num_stages),
            plgpu.Barrier(num_arrivals=pieces, num_barriers=config.num_stages),
            plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=config.num_stages),
            plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=config.num_stages),
            plgpu.Barrier(num_arrivals=COMPUTE_WGS),
        ),
        grid=(num_programs,),
        grid_names=("sm",),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        kernel_name=f"kvjax_ragged_attention_mosaic_gpu_g{group}_p{page_size}_bt{bt}",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )(lengths, q_lengths, block_tables.astype(jnp.int32), items, num_items, qf, k_pages,
      v_pages)

    def unfold(x):  # [kv_heads, batch, blocks, 128, w] -> [batch, q_len, q_heads, w]
        w = x.shape[-1]
        x = x.reshape(kv_heads, batch, blocks, COMPUTE_WGS, ROWS, w)[:, :, :, :, :positions
                                                                     * group]
        x = x.reshape(kv_heads, batch, blocks, COMPUTE_WGS, positions, group, w)
        x = x.transpose(1, 2, 3, 4, 0, 5, 6)
        return x.reshape(batch, blocks * item_positions, q_heads, w)[:, :q_len]

    # Rows past q_lengths belong to no item (never written) or pad a partial one.
    keep = jnp.arange(q_len)[None, :] < q_lengths[:, None]
    out = jnp.where(keep[:, :, None, None], unfold(out), jnp.zeros((), dtype))
    lse = jnp.where(keep[:, :, None], unfold(lse[..., None])[..., 0], NEG_INF)
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
    num_sms: int = mgpu.H100_NUM_SMS,
    config: GpuRaggedConfig | None = None,
    interpret: Any = False,
) -> tuple[Float[Array, "batch q_len q_heads v_head_dim"], Float[Array, "batch q_len q_heads"]]:
    """Ragged paged attention on Hopper (Mosaic GPU); the contract of
    `reference.paged_prefill_attention`.

    Row b has `q_lengths[b]` new queries (0 <= q_lengths[b] <= min(q_len, lengths[b])),
    query t at position `lengths[b] - q_lengths[b] + t`, causal over the row's cache
    (which already holds the new tokens).

    Args:
      q: [batch, q_len, q_heads, head_dim] in the pages' dtype; q_heads a multiple of
        kv_heads, at most 64 per KV head.
      k_pages, v_pages: one layer's pools [kv_heads, pages, page_size, head_dim |
        v_head_dim], bfloat16 or float16; only pages holding keys some query sees are read.
      lengths: int32[batch], tokens per sequence including the new ones.
      block_tables: int32[batch, max_pages]; entries past what a row's queries see are
        never used as addresses.
      q_lengths: int32[batch], new queries per row.
      scale, soft_cap, sliding_window: as in the reference.
      num_sms: SMs of the target GPU (132 on H100/H200): the persistent grid's size; a
        static argument, never read from the device.
      config: tiling; None picks `default_config`.
      interpret: False to compile for the GPU; True, or
        `kernels_pallas._mosaic_gpu.interpret_params(...)`, to run Mosaic GPU's
        interpreter on any backend.

    Returns:
      (out [batch, q_len, q_heads, v_head_dim] in q's dtype, lse float32[batch, q_len,
      q_heads]); rows t >= q_lengths[b] give 0 and -inf.

    Raises:
      ValueError: on shapes that do not form one attention, or shapes and dtypes this
        kernel does not take (`unsupported_reason` says which), before any tracing.
    """
    op = "paged_prefill_attention[mosaic_gpu]"
    _check_gqa(op, q, k_pages, v_pages, lengths, block_tables, q_lengths)
    if config is not None and not isinstance(config, GpuRaggedConfig):
        raise TypeError(f"{op}: config must be a GpuRaggedConfig or None, got "
                        f"{type(config).__name__}.")
    reason = unsupported_reason(q, k_pages, v_pages, config)
    if reason is not None:
        raise ValueError(f"{op}: {reason} The XLA path (kvjax.attention) takes these shapes.")
    if not isinstance(num_sms, int) or num_sms < 1:
        raise ValueError(f"{op}: num_sms must be an int >= 1, got {num_sms!r}.")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"{op}: sliding_window must be an int >= 1 or None, got "
                         f"{sliding_window!r}.")
    head_dim = q.shape[-1]
    if q.shape[0] == 0 or q.shape[1] == 0:  # no rows or no query slots: nothing to launch
        return (jnp.zeros((*q.shape[:3], v_pages.shape[-1]), q.dtype),
                jnp.full(q.shape[:3], NEG_INF, jnp.float32))
    cfg = config or default_config(head_dim, v_pages.shape[-1], jnp.dtype(q.dtype).itemsize)
    return _prefill(
        q, k_pages, v_pages, lengths, block_tables, q_lengths,
        scale=float(head_dim ** -0.5 if scale is None else scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        sliding_window=sliding_window,
        num_sms=num_sms,
        config=cfg,
        interpret=mgpu.resolve_interpret(interpret),
    )
