"""DeepSeek Sparse Attention (DSA): the lightning indexer's scores, top-k, and MLA over them.

DeepSeek-V3.2 (first released as DeepSeek-V3.2-Exp) keeps V3's latent cache and adds,
per layer, a "lightning indexer": `index_n_heads` small query heads score every cached token
against one cached indexer key per token, and each query then attends to its
`index_topk` best tokens only. The ops here take pages (pools and block tables),
never cache objects (`kvjax.cache.indexer_topk` and `kvjax.cache.attend` build their
inputs):

* `indexer_scores`: the index score of every position s for query t of a row,

      I[t, s] = sum_h w[t, h] * relu(scale * q[t, h] . k[s])

  over the indexer keys read through the block tables, float32, -inf where s is
  not visible to t (past the row's keys, or after the query). A loop over blocks
  of table columns stops after the longest row, so its cost follows the live
  context, not the table's width. `tail_indexer_scores` scores a KIVI cache's
  full-precision tail ring, and `select_topk` turns scores into a
  `TokenSelection` (-1 where a query sees fewer than k tokens).
* `mla_sparse_attention`: absorbed MLA attention of each query over its selected
  tokens, at token granularity: the selected rows of the latent and rotary-key
  pools are gathered (`[batch, q_len, k, width]`, one row per selected token) and
  attended; nothing else of the pools is read. Decode and prefill chunks alike.
* `quantized_mla_sparse_attention`: the same on KIVI pages. The selected tokens
  held in quantized pages are gathered as rows of codes with their own scales and
  zeros (MLA's latent is grouped along channels, per token) and only those rows
  are dequantized; the full-precision tail ring (at most residual + page_size
  tokens) is read whole, masked to its selected tokens, and merged by log-sum-exp.

Token granularity costs a gather of k scattered rows (each `d_c + d_rope` elements,
1152 bytes in bf16 for DeepSeek-V3.2) where page-granular selection would read
whole pages: it reads exactly the selected tokens, never the other tokens of their
pages, but its reads are row-sized rather than page-sized.

`page_range=(first, n)` on the implementations reads only the pages whose ids lie
in [first, first + n), as local ids of pools holding those n pages: the per-device
form under a sharding plan (`kvjax.sharding.ShardedAttention`), whose partial
scores (max over devices: each position lives on one) and partial attention
results (log-sum-exp merge) combine into the single-device result.

Every impl name of the registry runs this jnp path: there is no kernel for these
ops yet. 16-bit pools are gathered as uint16 bits (XLA:CPU would otherwise widen the
whole pool to float32 to gather a few rows).
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kernels_pallas.merge import NEG_INF, merge_attention_states
from kernels_pallas.quantized_attention import layout
from kvjax.attention import registry
from kvjax.attention.pages import QuantizedLayerView, TokenSelection

__all__ = [
    "indexer_scores",
    "tail_indexer_scores",
    "select_topk",
    "mla_sparse_attention",
    "quantized_mla_sparse_attention",
    "tail_positions",
    "selected_mask",
]

# Tokens per sequence the indexer loop scores per step (rounded to whole pages that
# divide the table's width).
INDEXER_BLOCK_TOKENS = 256
_HI = jax.lax.Precision.HIGHEST


def _flat(pool, layer):
    """A pool `[pages, ps, w]` / `[1, pages, ps, w]`, or with `layer` a cache's whole
    `[layers, 1, pages, ps, w]`, as rows `[n, w]`; with the layer's first row and the
    pool's pages and page size."""
    pages, ps, w = pool.shape[-3:]
    base = 0 if layer is None else jnp.asarray(layer, jnp.int32) * (pages * ps)
    return pool.reshape(-1, w), base, pages, ps


def _gather(flat, rows):
    """flat[rows] (rows clipped into the pool); 16-bit floats are gathered as their bits."""
    if jnp.dtype(flat.dtype).itemsize == 2 and jnp.issubdtype(flat.dtype, jnp.floating):
        bits = jnp.take(jax.lax.bitcast_convert_type(flat, jnp.uint16), rows, axis=0,
                        mode="clip")
        return jax.lax.bitcast_convert_type(bits, flat.dtype)
    return jnp.take(flat, rows, axis=0, mode="clip")


def _take_rows(flat, rows):
    """flat[rows] as float32."""
    return _gather(flat, rows).astype(jnp.float32)


def _page_filter(page_range, num_pages):
    return (0, num_pages) if page_range is None else page_range


def _token_rows(block_tables, positions, page_size, base, first, n, below=None):
    """Pool rows of the selected positions and which of them to read.

    A position is read when it is >= 0 (and < `below`, per row, if given) and its page
    id lies in [first, first + n); rows index the flat pool, local ids from `first`.
    """
    batch, max_pages = block_tables.shape
    col = jnp.clip(positions // page_size, 0, max_pages - 1)
    page = jnp.take_along_axis(block_tables, col.reshape(batch, -1), axis=1).reshape(col.shape)
    ok = (positions >= 0) & (page >= first) & (page < first + n)
    if below is not None:
        ok &= positions < below[:, None, None]
    local = jnp.where(ok, page - first, 0)
    return base + local * page_size + positions % page_size, ok


def _attend(logits, ok, values):
    """Masked softmax attention: logits f32 [B, T, H, k], ok bool [B, T, k], values f32
    [B, T, k, w] (per query) or [B, k, w] (shared by a row's queries) -> (out f32
    [B, T, H, w], lse f32 [B, T, H]); no key: 0 and -inf."""
    logits = jnp.where(ok[:, :, None, :], logits, NEG_INF)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(m == NEG_INF, 0.0, m)
    p = jnp.exp(logits - m)
    den = jnp.sum(p, axis=-1)
    spec = "bthk,btkw->bthw" if values.ndim == 4 else "bthk,bkw->bthw"
    out = jnp.einsum(spec, p, values, precision=_HI, preferred_element_type=jnp.float32)
    out = out / jnp.where(den > 0, den, 1.0)[..., None]
    lse = jnp.where(den > 0, m[..., 0] + jnp.log(jnp.where(den > 0, den, 1.0)), NEG_INF)
    return out, lse


def _mla_logits(q_latent, q_rope, c, r, scale):
    """Absorbed MLA logits [B, T, H, k] against keys [c, r], per query [B, T, k, w] or
    shared by a row's queries [B, k, w]."""
    f32 = jnp.float32
    spec = "bthc,btkc->bthk" if c.ndim == 4 else "bthc,bkc->bthk"
    return (jnp.einsum(spec, q_latent.astype(f32), c, precision=_HI)
            + jnp.einsum(spec, q_rope.astype(f32), r, precision=_HI)) * f32(scale)


# Bytes of float32 gathered rows a prefill chunk materialises at once: queries are taken
# in blocks that keep [block, k, d_c + d_rope] under this.
QUERY_BLOCK_BYTES = 64 << 20


def _by_query_blocks(fn, q_latent, q_rope, positions, width):
    """`fn(q_latent, q_rope, positions) -> (out, lse)` over blocks of queries (a `lax.map`)
    when one call would gather more than QUERY_BLOCK_BYTES of rows; decode runs as is."""
    batch, q_len = positions.shape[:2]
    block = max(1, QUERY_BLOCK_BYTES // (4 * batch * positions.shape[2] * width))
    if q_len <= block:
        return fn(q_latent, q_rope, positions)
    n = -(-q_len // block)
    pad = n * block - q_len

    def split(x, fill):
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
        return jnp.moveaxis(x.reshape(batch, n, block, *x.shape[2:]), 1, 0)

    out, lse = jax.lax.map(lambda a: fn(*a), (split(q_latent, 0), split(q_rope, 0),
                                               split(positions, -1)))

    def join(x):
        x = jnp.moveaxis(x, 0, 1)
        return x.reshape(batch, n * block, *x.shape[3:])[:, :q_len]

    return join(out), join(lse)


def _block_pages(max_pages: int, page_size: int) -> int:
    """Columns per indexer loop step: the largest divisor of the table's width whose pages
    hold at most INDEXER_BLOCK_TOKENS tokens (one page at least)."""
    best = 1
    for d in range(1, max_pages + 1):
        if max_pages % d == 0 and d * page_size <= INDEXER_BLOCK_TOKENS:
            best = d
    return best


# ------------------------------------------------------------------------------ indexer


def _indexer_scores(q, weights, key_pages, block_tables, key_lengths, q_pos, *, scale,
                    layer=None, page_range=None, interpret=None):
    del interpret
    batch, q_len, heads, _ = q.shape
    flat, base, num_pages, ps = _flat(key_pages, layer)
    first, n = _page_filter(page_range, num_pages)
    max_pages = block_tables.shape[1]
    bp = _block_pages(max_pages, ps)
    width = bp * ps
    key_lengths = jnp.clip(key_lengths.astype(jnp.int32), 0, max_pages * ps)
    n_iter = (jnp.max(key_lengths) + width - 1) // width
    qf = q.astype(jnp.float32)
    wf = weights.astype(jnp.float32)
    tok = jnp.arange(width, dtype=jnp.int32)
    in_page = jnp.arange(ps, dtype=jnp.int32)

    def body(i, buf):
        cols = jax.lax.dynamic_slice_in_dim(block_tables, i * bp, bp, axis=1)  # [B, bp]
        mine = (cols >= first) & (cols < first + n)
        local = jnp.where(mine, cols - first, 0)
        rows = base + (local[:, :, None] * ps + in_page).reshape(batch, width)
        k = _take_rows(flat, rows)  # [B, width, D]
        s = jnp.einsum("bthd,bsd->bths", qf, k, precision=_HI) * jnp.float32(scale)
        s = jnp.einsum("bths,bth->bts", jax.nn.relu(s), wf, precision=_HI)
        pos = i * width + tok
        vis = (jnp.repeat(mine, ps, axis=1) & (pos[None, :] < key_lengths[:, None]))[:, None]
        vis &= pos[None, None, :] <= q_pos[:, :, None]
        return jax.lax.dynamic_update_slice_in_dim(buf, jnp.where(vis, s, NEG_INF), i * width,
                                                   axis=2)

    buf = jnp.full((batch, q_len, max_pages * ps), NEG_INF, jnp.float32)
    del heads
    return jax.lax.fori_loop(0, n_iter, body, buf)


def _check_indexer(op, q, weights, block_tables, key_lengths, q_pos, width):
    if q.ndim != 4:
        raise ValueError(f"{op}: q must be [batch, q_len, index_heads, index_head_dim], got "
                         f"{q.shape}.")
    batch, q_len, heads, d = q.shape
    if weights.shape != (batch, q_len, heads):
        raise ValueError(f"{op}: weights must be [batch, q_len, index_heads] = "
                         f"{(batch, q_len, heads)}, got {weights.shape}.")
    if width != d:
        raise ValueError(f"{op}: the keys are {width} wide but q is {d} wide.")
    if block_tables.ndim != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"{op}: block_tables must be [batch={batch}, max_pages], got "
                         f"{block_tables.shape}.")
    if key_lengths.shape != (batch,) or q_pos.shape != (batch, q_len):
        raise ValueError(f"{op}: key_lengths must be [batch={batch}] and q_pos [batch, q_len="
                         f"{q_len}], got {key_lengths.shape} and {q_pos.shape}.")
    for name, x in (("block_tables", block_tables), ("key_lengths", key_lengths),
                    ("q_pos", q_pos)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"{op}: {name} must be integer, got {x.dtype}.")


def indexer_scores(
    q: Float[Array, "batch q_len index_heads index_dim"],
    weights: Float[Array, "batch q_len index_heads"],
    key_pages: Float[Array, "*layers pages page_size index_dim"],
    block_tables: Int[Array, "batch max_pages"],
    key_lengths: Int[Array, " batch"],
    q_pos: Int[Array, "batch q_len"],
    *,
    scale: float,
    impl="auto",
    interpret: bool | None = None,
    layer: int | Int[Array, ""] | None = None,
) -> Float[Array, "batch q_len max_tokens"]:
    """The lightning indexer's score of every position of each row, for each query.

    Args:
      q: indexer queries (rotated), `[batch, q_len, index_heads, index_dim]`.
      weights: per-head weights `[batch, q_len, index_heads]` (the model's
        `weights_proj` output, already scaled).
      key_pages: the indexer key pool `[pages, page_size, index_dim]`, or with `layer`
        a cache's whole pool `[layers, 1, pages, page_size, index_dim]`.
      block_tables: int32[batch, max_pages], the rows' pages.
      key_lengths: int32[batch], keys each row holds in those pages.
      q_pos: int32[batch, q_len], each query's position (it sees positions <= q_pos).
      scale: the score scale (index_head_dim ** -0.5).
      impl, interpret: the registry's implementation (every name runs the jnp path) or
        a `kvjax.sharding.ShardedAttention`.
      layer: the layer of whole pools.

    Returns:
      float32 `[batch, q_len, max_pages * page_size]`, column s = position s; -inf where
      s is not visible to the query.
    """
    op = "indexer_scores"
    _check_indexer(op, q, weights, block_tables, key_lengths, q_pos, key_pages.shape[-1])
    fn, _ = registry.resolve(op, impl, interpret, dtype=key_pages.dtype)
    return fn(q, weights, key_pages, block_tables, key_lengths, q_pos, scale=scale, layer=layer)


def tail_positions(quant_lengths: Int[Array, " batch"], ring: int) -> Int[Array, "batch ring"]:
    """Position held by each slot of a KIVI tail ring: Q + ((slot - Q) mod ring)."""
    slot = jnp.arange(ring, dtype=jnp.int32)[None, :]
    return quant_lengths[:, None] + jnp.mod(slot - quant_lengths[:, None], ring)


def tail_indexer_scores(
    q: Float[Array, "batch q_len index_heads index_dim"],
    weights: Float[Array, "batch q_len index_heads"],
    tail_keys: Float[Array, "batch ring index_dim"],
    quant_lengths: Int[Array, " batch"],
    lengths: Int[Array, " batch"],
    q_pos: Int[Array, "batch q_len"],
    *,
    scale: float,
) -> Float[Array, "batch q_len ring"]:
    """`indexer_scores` of a KIVI tail ring (positions [quant_lengths, lengths); slot j
    holds `tail_positions(quant_lengths, ring)[:, j]`), -inf where not visible."""
    t_pos = tail_positions(quant_lengths, tail_keys.shape[1])
    s = jnp.einsum("bthd,bsd->bths", q.astype(jnp.float32), tail_keys.astype(jnp.float32),
                   precision=_HI) * jnp.float32(scale)
    s = jnp.einsum("bths,bth->bts", jax.nn.relu(s), weights.astype(jnp.float32), precision=_HI)
    vis = (t_pos < lengths[:, None])[:, None] & (t_pos[:, None, :] <= q_pos[:, :, None])
    return jnp.where(vis, s, NEG_INF)


def select_topk(
    scores: Float[Array, "batch q_len n"],
    k: int,
    positions: Int[Array, "batch n"] | None = None,
) -> TokenSelection:
    """Each query's k best-scoring positions (ties: the lower column first).

    Args:
      scores: float32 scores, -inf for positions a query does not see.
      k: tokens per query (static, at most n).
      positions: the position of each column (default: column s is position s).

    Returns:
      A `TokenSelection` of `[batch, q_len, k]` positions, -1 where fewer than k are seen.
    """
    n = scores.shape[-1]
    if not 1 <= k <= n:
        raise ValueError(f"select_topk: k must lie in [1, {n}] (the scored positions), got {k}.")
    vals, idx = jax.lax.top_k(scores, k)
    if positions is not None:
        batch, q_len = scores.shape[:2]
        idx = jnp.take_along_axis(positions, idx.reshape(batch, q_len * k), axis=1).reshape(
            idx.shape)
    return TokenSelection(positions=jnp.where(vals > NEG_INF, idx, -1).astype(jnp.int32))


# ------------------------------------------------------------------- attention over tokens


def _mla_sparse(q_latent, q_rope, latent_pages, rope_pages, block_tables, selection, *, scale,
                layer=None, page_range=None, interpret=None):
    del interpret
    c_flat, base, num_pages, ps = _flat(latent_pages, layer)
    r_flat, _, _, _ = _flat(rope_pages, layer)
    first, n = _page_filter(page_range, num_pages)

    def attend(q_latent, q_rope, positions):
        rows, ok = _token_rows(block_tables, positions, ps, base, first, n)
        c = _take_rows(c_flat, rows)  # [B, T, k, d_c]
        r = _take_rows(r_flat, rows)
        return _attend(_mla_logits(q_latent, q_rope, c, r, scale), ok, c)

    out, lse = _by_query_blocks(attend, q_latent, q_rope, selection.positions,
                                c_flat.shape[-1] + r_flat.shape[-1])
    return out.astype(q_latent.dtype), lse


def _check_mla(op, q_latent, q_rope, selection, batch_tables):
    if q_latent.ndim != 4 or q_rope.shape[:3] != q_latent.shape[:3]:
        raise ValueError(f"{op}: q_latent and q_rope must be [batch, q_len, q_heads, width] "
                         f"alike, got {q_latent.shape} and {q_rope.shape}.")
    if not isinstance(selection, TokenSelection):
        raise TypeError(f"{op}: selection must be a TokenSelection, got "
                        f"{type(selection).__name__}.")
    want = q_latent.shape[:2]
    if selection.positions.ndim != 3 or selection.positions.shape[:2] != want:
        raise ValueError(f"{op}: selection positions must be [batch, q_len, k] with [batch, "
                         f"q_len] = {want}, got {selection.positions.shape}.")
    if batch_tables is not None and batch_tables.shape[0] != want[0]:
        raise ValueError(f"{op}: block_tables has {batch_tables.shape[0]} rows for batch "
                         f"{want[0]}.")


def mla_sparse_attention(
    q_latent: Float[Array, "batch q_len q_heads d_c"],
    q_rope: Float[Array, "batch q_len q_heads d_rope"],
    latent_pages: Float[Array, "*layers pages page_size d_c"],
    rope_pages: Float[Array, "*layers pages page_size d_rope"],
    block_tables: Int[Array, "batch max_pages"],
    selection: TokenSelection,
    *,
    scale: float,
    impl="auto",
    interpret: bool | None = None,
    layer: int | Int[Array, ""] | None = None,
) -> tuple[Float[Array, "batch q_len q_heads d_c"], Float[Array, "batch q_len q_heads"]]:
    """Absorbed MLA attention of each query over its selected tokens (decode or prefill).

    Args:
      q_latent, q_rope: absorbed queries (q_rope rotated).
      latent_pages, rope_pages: the latent and rotary-key pools `[pages, page_size,
        width]`, or with `layer` a cache's whole pools `[layers, 1, pages, page_size,
        width]`.
      block_tables: int32[batch, max_pages], the rows' pages.
      selection: the positions each query reads (`TokenSelection`, -1 unused).
      scale: the logit scale.
      impl, interpret, layer: as in `indexer_scores`.

    Returns:
      (out in latent space `[batch, q_len, q_heads, d_c]` in q_latent's dtype, lse
      float32 `[batch, q_len, q_heads]`); a query with no selected token gives 0, -inf.
    """
    op = "mla_sparse_attention"
    _check_mla(op, q_latent, q_rope, selection, block_tables)
    fn, _ = registry.resolve(op, impl, interpret, dtype=latent_pages.dtype)
    return fn(q_latent, q_rope, latent_pages, rope_pages, block_tables, selection, scale=scale,
              layer=layer)


def _quantized_pages_part(q_latent, q_rope, view: QuantizedLayerView, positions, scale,
                          page_range):
    """Attention over the selected tokens held in quantized pages: (out f32, lse)."""
    k = view.k
    whole = view.layer is not None
    codes, base, num_pages, ps = _flat(k.codes, k.layer if whole else None)
    sc, _, _, _ = _flat(k.scale, k.layer if whole else None)
    zr, _, _, _ = _flat(k.zero, k.layer if whole else None)
    r_flat, r_base, _, _ = _flat(view.v, view.layer if whole else None)
    first, n = _page_filter(page_range, num_pages)
    rows, ok = _token_rows(view.block_tables, positions, ps, 0, first, n,
                           below=view.quant_lengths)
    take = lambda x, b: _gather(x, rows + b)[..., None, :]  # noqa: E731
    c = layout.dequantize(take(codes, base), take(sc, base), take(zr, base), bits=k.bits,
                          grouping="channels")[..., 0, :]
    r = _take_rows(r_flat, rows + r_base)
    return _attend(_mla_logits(q_latent, q_rope, c, r, scale), ok, c)


def _tail_part(q_latent, q_rope, view: QuantizedLayerView, positions, scale):
    """Attention over the selected tokens of the full-precision tail ring: (out f32, lse)."""
    tail_c, tail_r = view.tail_k[0], view.tail_v[0]  # [batch, ring, width]
    batch, ring = tail_c.shape[:2]
    q_len = positions.shape[1]
    ql = view.quant_lengths
    t_pos = tail_positions(ql, ring)
    slot = jnp.where(positions >= ql[:, None, None], positions % ring, ring)
    b = jnp.arange(batch)[:, None, None]
    t = jnp.arange(q_len)[None, :, None]
    chosen = jnp.zeros((batch, q_len, ring + 1), bool).at[b, t, slot].set(True)[..., :ring]
    ok = chosen & (t_pos < view.lengths[:, None])[:, None, :]
    c, r = tail_c.astype(jnp.float32), tail_r.astype(jnp.float32)  # shared by the queries
    return _attend(_mla_logits(q_latent, q_rope, c, r, scale), ok, c)


def _quantized_mla_sparse(q_latent, q_rope, view, selection, *, scale, page_range=None,
                          with_tail=True, interpret=None):
    del interpret
    pos = selection.positions
    width = view.tail_k.shape[-1] + view.tail_v.shape[-1]
    out, lse = _by_query_blocks(
        lambda ql, qr, p: _quantized_pages_part(ql, qr, view, p, scale, page_range), q_latent,
        q_rope, pos, width)
    if with_tail:
        out, lse = merge_attention_states(out, lse, *_tail_part(q_latent, q_rope, view, pos,
                                                                 scale))
    return out.astype(q_latent.dtype), lse


def quantized_mla_sparse_attention(
    q_latent: Float[Array, "batch q_len q_heads d_c"],
    q_rope: Float[Array, "batch q_len q_heads d_rope"],
    view: QuantizedLayerView,
    selection: TokenSelection,
    *,
    scale: float,
    impl="auto",
    interpret: bool | None = None,
) -> tuple[Float[Array, "batch q_len q_heads d_c"], Float[Array, "batch q_len q_heads"]]:
    """`mla_sparse_attention` on a KIVI latent cache: selected quantized rows dequantized
    after their gather, the tail ring read whole and masked to its selected tokens.

    Args:
      view: the rows' `QuantizedLayerView` of an MLA cache (rows = batch rows; whole
        pools are fine).
      Others as in `mla_sparse_attention`.
    """
    op = "quantized_mla_sparse_attention"
    if not isinstance(view, QuantizedLayerView) or not view.is_mla:
        raise TypeError(f"{op}: view must be the QuantizedLayerView of an MLA cache.")
    _check_mla(op, q_latent, q_rope, selection, view.block_tables)
    fn, _ = registry.resolve(op, impl, interpret, dtype=view.tail_k.dtype)
    return fn(q_latent, q_rope, view, selection, scale=scale)


def selected_mask(selection: TokenSelection, max_tokens: int) -> Bool[Array, "batch q_len n"]:
    """The selection as a mask over positions [0, max_tokens) (tests, references)."""
    batch, q_len, _ = selection.positions.shape
    pos = jnp.where(selection.positions >= 0, selection.positions, max_tokens)
    b = jnp.arange(batch)[:, None, None]
    t = jnp.arange(q_len)[None, :, None]
    return jnp.zeros((batch, q_len, max_tokens + 1), bool).at[b, t, pos].set(True)[..., :-1]


for _impl in ("reference", "xla", "pallas", "cpu"):
    registry.register("indexer_scores", _impl, _indexer_scores, takes_layer=True)
    registry.register("mla_sparse_attention", _impl, _mla_sparse, takes_layer=True)
    registry.register("quantized_mla_sparse_attention", _impl, _quantized_mla_sparse)
