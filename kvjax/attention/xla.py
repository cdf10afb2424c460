"""The XLA path of paged attention: an online-softmax loop over blocks of pages.

The reference gathers every sequence's whole K/V into a `[batch, kv_heads,
max_tokens, head_dim]` copy and then attends; on CPU that copy costs more than
the attention itself (an extra write and read of the whole live cache, through
XLA's slow elementwise gather). This path instead runs a `lax.while_loop` over
blocks of `pages_per_block` table columns:

  1. gather one block of pages of every sequence, `[kv_heads, batch, block_tokens,
     width]`, small enough to stay in cache, and upcast it to float32 there;
  2. logits for the group-folded queries `[kv_heads, batch, group * q_len, width]`
     with one batched matmul per block (batch dims kv_heads and batch, so no
     transposes and no KV repetition);
  3. fold the block into a running (max, sum, accumulator) triple (online softmax).

The loop stops after the block that holds the longest live length, so table
columns past every sequence's length are never read, and the step's cost does
not depend on the pool's capacity. With a sliding window it also starts at the
first block any query can see.

Pages are read through `BlockReader`s: a reader holds the arrays it reads
(a pool, or a quantized pool's codes and scales) and a function mapping them and
a block of page ids `int32[batch, pages_per_block]` to float32 `[kv_heads, batch,
block_tokens, width]`. `dense_reader` reads plain pages; a quantized cache
supplies a reader that gathers the codes and scales of the same pages and
dequantizes the block and calls `paged_attention_core` with it — the loop itself
does not change.

Inside a model, pass the cache's whole pools with `layer=` (the public ops
forward it here): the reader then indexes the layer inside its gather. Slicing
`pool[layer]` before the call makes XLA copy the layer's whole pool whenever the
slice feeds a loop, e.g. in a `lax.scan` over layers.

All arithmetic is float32: bf16 pages are upcast one block at a time (bf16
arithmetic is slower than f32 on CPU, and accumulating in bf16 would lose
precision). XLA:CPU has no bf16 gather or dynamic-slice: it rewrites them as
f32 ones on a converted operand, and since the pool is loop-invariant it then
hoists that conversion out of the loop — a float32 copy of the whole pool at
every step. The loop therefore passes the readers' arrays through an
`optimization_barrier` together with the loop counter, which makes them
loop-variant to XLA, so every conversion stays inside the block it belongs to
(docs/attention-backends.md). Outputs follow the reference's conventions: `out` in the
query's dtype, `lse` float32, rows that see no key give 0 and -inf.
"""

import dataclasses
import functools
import itertools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kernels_pallas.merge import NEG_INF

__all__ = [
    "BlockReader",
    "dense_reader",
    "paged_attention_core",
    "paged_decode_attention",
    "paged_prefill_attention",
    "mla_decode_attention",
    "mla_prefill_attention",
    "DEFAULT_BLOCK_BYTES",
    "default_block_tokens",
]

# Default block size, in float32 bytes of one block of keys and values for all heads and
# sequences. Large enough that the loop's per-step overhead (~10-20 us here) is small,
# small enough that the block stays in the 2 MiB L2 / L3 while it is used twice (logits,
# then values); docs/attention-backends.md.
DEFAULT_BLOCK_BYTES = 4 << 20
MIN_BLOCK_TOKENS = 16
MAX_BLOCK_TOKENS = 512

@dataclasses.dataclass(frozen=True)
class BlockReader:
    """Reads one block of pages of every sequence as float32.

    Attributes:
      arrays: the pytree of arrays the reader reads (full-precision pages, or a
        quantized pool's codes and scales). The loop passes them to `read`
        through an optimization barrier (see the module docstring), so `read`
        must use these, not arrays it closes over.
      read: `(arrays, idx int32[batch, block_pages]) -> float32 [heads, batch,
        block_pages * page_size, width]`, or a tuple of such arrays that are
        consecutive width slices of it (the loop then multiplies each slice with
        its slice of the queries and accumulates each value slice separately, so a
        reader of planar-packed codes need not concatenate its unpacked fields).
    """

    arrays: Any
    read: Callable[[Any, Int[Array, "batch block_pages"]],
                   Float[Array, "heads batch tokens width"]
                   | tuple[Float[Array, "heads batch tokens w"], ...]]

    def __call__(self, idx, arrays=None):
        return self.read(self.arrays if arrays is None else arrays, idx)


_ROW_GATHER = jax.lax.GatherDimensionNumbers(
    offset_dims=(0, 2), collapsed_slice_dims=(1,), start_index_map=(1,)
)


def _read_dense(arrays, idx):
    pages, layer = arrays
    if layer is not None:
        pages = pages[layer]  # fused into the gather below: never a copy of the layer
    heads, num_pages, page_size, width = pages.shape
    batch, block_pages = idx.shape
    # One page of one head is a contiguous row of page_size * width elements. Gathering rows
    # straight into [heads, batch * block_pages, row] needs no transpose afterwards (jnp.take
    # on axis 1 puts the gathered axis first and transposes).
    rows = pages.reshape(heads, num_pages, page_size * width)
    # Dead table entries were replaced by page 0; CLIP keeps a bad live entry (only
    # checkable outside jit) from reading outside the pool, as the reference does.
    block = jax.lax.gather(
        rows, idx.reshape(-1, 1), _ROW_GATHER, (heads, 1, page_size * width),
        mode=jax.lax.GatherScatterMode.CLIP,
    )
    return block.reshape(heads, batch, block_pages * page_size, width).astype(jnp.float32)


def dense_reader(
    pages: Float[Array, "*layers heads pages page_size width"],
    layer: int | Int[Array, ""] | None = None,
) -> BlockReader:
    """A `BlockReader` for full-precision pages.

    Args:
      pages: `[heads, pages, page_size, width]`, or with `layer` the whole
        multi-layer pool `[layers, heads, pages, page_size, width]`.
      layer: the layer to read (a traced index is fine). Reading the layer
        inside the loop's gather, instead of slicing `pages[layer]` before the
        call, matters: XLA materialises a sliced layer when its consumer is in a
        loop (a copy of the layer's whole pool per step).
    """
    return BlockReader(arrays=(pages, layer), read=_read_dense)


def default_block_tokens(heads: int, batch: int, widths: int) -> int:
    """Tokens per sequence per loop step for `heads * batch` sequences of `widths` floats
    per token (key widths plus value width): about `DEFAULT_BLOCK_BYTES` per block, clamped
    to [MIN_BLOCK_TOKENS, MAX_BLOCK_TOKENS]."""
    tokens = DEFAULT_BLOCK_BYTES // (4 * heads * batch * widths)
    return int(min(max(tokens, MIN_BLOCK_TOKENS), MAX_BLOCK_TOKENS))


def _dot(a, b, contract_a, contract_b):
    """float32 batched matmul over leading dims (heads, batch)."""
    return jax.lax.dot_general(
        a, b, (((contract_a,), (contract_b,)), ((0, 1), (0, 1))),
        precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32,
    )


def paged_attention_core(
    qs: tuple[Float[Array, "heads batch rows d"], ...],
    k_readers: tuple[BlockReader, ...],
    v_reader: BlockReader | None,
    q_pos: Int[Array, "batch rows"],
    lengths: Int[Array, " batch"],
    block_tables: Int[Array, "batch max_pages"],
    *,
    page_size: int,
    scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    block_tokens: int | None = None,
) -> tuple[Float[Array, "heads batch rows dv"], Float[Array, "heads batch rows"]]:
    """Online-softmax attention over paged K/V, one block of pages per loop step.

    Args:
      qs: query parts, float32 `[kv_heads, batch, rows, d_i]`; logits are
        the sum over parts of q_i . k_i (MLA: latent and rope parts). A row is
        one (query head in the group, query position) pair.
      k_readers: one `BlockReader` per query part.
      v_reader: reader for the values; None means the values are the first
        key part (MLA's latent), which is then read only once per block.
      q_pos: int32[batch, rows], the position of each row's query; rows with
        q_pos < 0 are padding and see nothing.
      lengths: int32[batch], cached tokens per sequence.
      block_tables: int32[batch, max_pages]; entries past a sequence's length
        are never used as indices (they become page 0, whose tokens are selected
        away in the logits and the values, so NaN/inf there cannot leak).
      page_size: tokens per page.
      scale, soft_cap, sliding_window: as in the reference.
      block_tokens: tokens per sequence per loop step (rounded down to whole
        pages, at least one page); None picks `default_block_tokens`.

    Returns:
      (out float32 [kv_heads, batch, rows, dv], lse float32 [kv_heads, batch, rows]).
    """
    heads, batch, rows, _ = qs[0].shape
    max_pages = block_tables.shape[1]
    if block_tokens is None:
        widths = sum(q.shape[-1] for q in qs) + (0 if v_reader is None else qs[0].shape[-1])
        block_tokens = default_block_tokens(heads, batch, widths)
    bp = max(1, min(block_tokens // page_size, max_pages))  # pages per block
    bt = bp * page_size
    num_blocks_total = -(-max_pages // bp)
    pad = num_blocks_total * bp - max_pages

    used = jnp.arange(max_pages)[None, :] * page_size < lengths[:, None]
    safe = jnp.where(used, block_tables, 0).astype(jnp.int32)
    if pad:
        safe = jnp.pad(safe, ((0, 0), (0, pad)))

    # Blocks [start, stop) hold every key some query can see.
    valid_q = q_pos >= 0
    stop = -(-jnp.max(lengths) // bt)
    if sliding_window is None:
        start = jnp.int32(0)
    else:
        lo = jnp.where(valid_q, q_pos - (sliding_window - 1), jnp.iinfo(jnp.int32).max)
        start = jnp.maximum(jnp.min(lo), 0) // bt
    start = jnp.minimum(start, stop)

    qs = tuple((q.astype(jnp.float32) * jnp.float32(scale)) for q in qs)
    lim = jnp.minimum(q_pos + 1, lengths[:, None])  # keys < lim are causal and live
    if sliding_window is not None:
        low = q_pos - (sliding_window - 1)

    readers = (*k_readers, *(() if v_reader is None else (v_reader,)))
    # Width slices each reader returns (one unless it splits its block, see BlockReader);
    # the queries are split to match once, outside the loop.
    widths = [tuple(x.shape[-1] for x in _parts(jax.eval_shape(r, safe[:, :bp])))
              for r in readers]
    q_parts = [tuple(jnp.split(q, list(itertools.accumulate(w[:-1])), axis=-1))
               for q, w in zip(qs, widths, strict=False)]

    def body(carry):
        i, m, denom, acc = carry
        idx = jax.lax.dynamic_slice_in_dim(safe, i * bp, bp, axis=1)  # [batch, bp]
        # Tie the pools to the loop counter so XLA cannot hoist per-block work on them
        # (bf16 -> f32 conversion) out of the loop as whole-pool work (module docstring).
        arrays, _ = jax.lax.optimization_barrier(([r.arrays for r in readers], i))
        blocks = [_parts(r(idx, a)) for r, a in zip(readers, arrays, strict=True)]
        ks = blocks[: len(k_readers)]
        vs = ks[0] if v_reader is None else blocks[-1]
        # Logits as [heads, batch, tokens, rows]: the block is the matmul's large left operand
        # and the few query rows its right one, which XLA:CPU runs about 2x faster than
        # rows x tokens (docs/attention-backends.md).
        s = sum(_dot(k, q, 3, 3) for qp, kp in zip(q_parts, ks, strict=True)
                for q, k in zip(qp, kp, strict=True))
        if soft_cap is not None:
            s = jnp.float32(soft_cap) * jnp.tanh(s / jnp.float32(soft_cap))
        k_pos = i * bt + jnp.arange(bt, dtype=jnp.int32)
        vis = k_pos[None, :, None] < lim[:, None, :]  # [batch, tokens, rows]
        if sliding_window is not None:
            vis &= k_pos[None, :, None] >= low[:, None, :]
        s = jnp.where(vis[None], s, NEG_INF)
        m_new = jnp.maximum(m, jnp.max(s, axis=2))  # [heads, batch, rows]
        m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
        alpha = jnp.exp(m - m_safe)  # exp(-inf) = 0 when nothing was seen before
        p = jnp.exp(s - m_safe[:, :, None, :])  # masked logits are -inf -> 0
        denom = denom * alpha + jnp.sum(p, axis=2)
        # p is 0 for keys no row sees, but 0 * NaN/inf is NaN: such keys (rows past the
        # length, page 0 read for dead entries) may hold anything, so select them away.
        seen = jnp.any(vis, axis=2)[None, :, :, None]  # [1, batch, tokens, 1]
        vs = tuple(jnp.where(seen, v, 0.0) for v in vs)
        acc = tuple(a * alpha[..., None] + _dot(p, v, 2, 2)  # [heads, batch, rows, dv_i]
                    for a, v in zip(acc, vs, strict=True))
        return i + 1, m_new, denom, acc

    init = (
        start,
        jnp.full((heads, batch, rows), NEG_INF, jnp.float32),
        jnp.zeros((heads, batch, rows), jnp.float32),
        tuple(jnp.zeros((heads, batch, rows, w), jnp.float32)
              for w in (widths[0] if v_reader is None else widths[-1])),
    )
    _, m, denom, acc = jax.lax.while_loop(lambda c: c[0] < stop, body, init)
    seen = denom > 0.0
    acc = acc[0] if len(acc) == 1 else jnp.concatenate(acc, axis=-1)
    out = acc / jnp.where(seen, denom, 1.0)[..., None]
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, denom, 1.0)), NEG_INF)
    return out, lse


def _parts(x):
    return x if isinstance(x, tuple) else (x,)


def _fold_queries(q, kv_heads):
    """[batch, q_len, q_heads, d] -> [kv_heads, batch, group * q_len, d] (rows = (g, t))."""
    batch, q_len, q_heads, d = q.shape
    group = q_heads // kv_heads
    q = q.reshape(batch, q_len, kv_heads, group, d).transpose(2, 0, 3, 1, 4)
    return q.reshape(kv_heads, batch, group * q_len, d)


def _unfold(out, lse, q_len, q_heads):
    """Inverse of `_fold_queries` for out [h, b, g*t, dv] and lse [h, b, g*t]."""
    heads, batch, _, dv = out.shape
    group = q_heads // heads
    out = out.reshape(heads, batch, group, q_len, dv).transpose(1, 3, 0, 2, 4)
    lse = lse.reshape(heads, batch, group, q_len).transpose(1, 3, 0, 2)
    return out.reshape(batch, q_len, q_heads, dv), lse.reshape(batch, q_len, q_heads)


def _row_positions(lengths, q_lengths, q_len, group):
    """int32[batch, group * q_len]: position of each folded row's query, -1 for padding."""
    t = jnp.arange(q_len, dtype=jnp.int32)[None, :]
    pos = lengths[:, None] - q_lengths[:, None] + t
    pos = jnp.where(t < q_lengths[:, None], pos, -1)
    return jnp.tile(pos, (1, group)).astype(jnp.int32)


@functools.partial(
    jax.jit, static_argnames=("scale", "soft_cap", "sliding_window", "block_tokens")
)
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
    block_tokens: int | None = None,
    layer: int | Int[Array, ""] | None = None,
) -> tuple[Float[Array, "batch q_len q_heads v_head_dim"], Float[Array, "batch q_len q_heads"]]:
    """Chunked-prefill attention; same signature and semantics as the reference.

    With `layer`, `k_pages` and `v_pages` are a cache's whole pools
    `[layers, kv_heads, pages, page_size, width]` and that layer is read (see
    `dense_reader`: never a sliced copy of the layer).

    Returns:
      (out [batch, q_len, q_heads, v_head_dim] in q's dtype, lse float32[batch, q_len, q_heads]).
    """
    batch, q_len, q_heads, head_dim = q.shape
    kv_heads, _, page_size, _ = k_pages.shape[-4:]
    if scale is None:
        scale = head_dim**-0.5
    lengths = lengths.astype(jnp.int32)
    q_pos = _row_positions(lengths, q_lengths.astype(jnp.int32), q_len, q_heads // kv_heads)
    out, lse = paged_attention_core(
        (_fold_queries(q, kv_heads),), (dense_reader(k_pages, layer),),
        dense_reader(v_pages, layer),
        q_pos, lengths, block_tables,
        page_size=page_size, scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
        block_tokens=block_tokens,
    )
    out, lse = _unfold(out, lse, q_len, q_heads)
    return out.astype(q.dtype), lse


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
    block_tokens: int | None = None,
    layer: int | Int[Array, ""] | None = None,
) -> tuple[Float[Array, "batch q_heads v_head_dim"], Float[Array, "batch q_heads"]]:
    """Decode attention (one query per sequence at `lengths - 1`); the reference's signature.

    `layer` as in `paged_prefill_attention`.

    Returns:
      (out [batch, q_heads, v_head_dim] in q's dtype, lse float32[batch, q_heads]).
    """
    q_lengths = jnp.minimum(jnp.ones_like(lengths), lengths)
    out, lse = paged_prefill_attention(
        q[:, None], k_pages, v_pages, lengths, block_tables, q_lengths,
        scale=scale, soft_cap=soft_cap, sliding_window=sliding_window, block_tokens=block_tokens,
        layer=layer,
    )
    return out[:, 0], lse[:, 0]


@functools.partial(jax.jit, static_argnames=("scale", "block_tokens"))
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
    block_tokens: int | None = None,
    layer: int | Int[Array, ""] | None = None,
) -> tuple[Float[Array, "batch q_len q_heads d_c"], Float[Array, "batch q_len q_heads"]]:
    """Chunked-prefill MLA attention in absorbed form; the reference's signature.

    MQA over the latent: one "KV head" whose key is [c_kv, k_rope] and whose
    value is c_kv; each latent block is read once and used for both. With
    `layer`, the pages are a cache's whole latent pools `[layers, 1, pages,
    page_size, width]` and that layer is read.

    Returns:
      (out [batch, q_len, q_heads, d_c] in q_latent's dtype, lse float32[batch, q_len, q_heads]).
    """
    batch, q_len, q_heads, _ = q_latent.shape
    page_size = latent_pages.shape[-2]
    if layer is None:
        latent_pages, rope_pages = latent_pages[None], rope_pages[None]  # one "KV head"
    lengths = lengths.astype(jnp.int32)
    q_pos = _row_positions(lengths, q_lengths.astype(jnp.int32), q_len, q_heads)
    out, lse = paged_attention_core(
        (_fold_queries(q_latent, 1), _fold_queries(q_rope, 1)),
        (dense_reader(latent_pages, layer), dense_reader(rope_pages, layer)), None,
        q_pos, lengths, block_tables,
        page_size=page_size, scale=scale, block_tokens=block_tokens,
    )
    out, lse = _unfold(out, lse, q_len, q_heads)
    return out.astype(q_latent.dtype), lse


def mla_decode_attention(
    q_latent: Float[Array, "batch q_heads d_c"],
    q_rope: Float[Array, "batch q_heads d_rope"],
    latent_pages: Float[Array, "pages page_size d_c"],
    rope_pages: Float[Array, "pages page_size d_rope"],
    lengths: Int[Array, " batch"],
    block_tables: Int[Array, "batch max_pages"],
    *,
    scale: float,
    block_tokens: int | None = None,
    layer: int | Int[Array, ""] | None = None,
) -> tuple[Float[Array, "batch q_heads d_c"], Float[Array, "batch q_heads"]]:
    """Decode MLA attention in absorbed form; the reference's signature.

    `layer` as in `mla_prefill_attention`.

    Returns:
      (out [batch, q_heads, d_c] in q_latent's dtype, lse float32[batch, q_heads]).
    """
    q_lengths = jnp.minimum(jnp.ones_like(lengths), lengths)
    out, lse = mla_prefill_attention(
        q_latent[:, None], q_rope[:, None], latent_pages, rope_pages, lengths, block_tables,
        q_lengths, scale=scale, block_tokens=block_tokens, layer=layer,
    )
    return out[:, 0], lse[:, 0]
