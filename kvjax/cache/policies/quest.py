"""Quest: read only the pages whose keys could matter to the current query.

Paper: Tang, Zhao, Zhu, Xiao, Kasikci, Han, "Quest: Query-Aware Sparsity for
Efficient Long-Context LLM Inference", arXiv 2406.10774 (ICML 2024).

Rule (paraphrased): for every KV page keep two vectors, the channel-wise
minimum m and maximum M of the keys in the page. For a query q, channel i of
q . k can be at most max(q_i * M_i, q_i * m_i) for any key k of the page, so
the page's criticality is U = sum_i max(q_i * M_i, q_i * m_i), an upper bound
of q . k over the page. Attention then loads only the Top-K pages by U.
Nothing is evicted: memory stays, reads shrink. The paper leaves the first two
layers dense (their attention is not sparse enough) and uses 16-token pages.

Here:
  * summaries are kept per KV head and per page id, `[layers, kv_heads,
    pages, head_dim]`, refreshed for every page a prefill chunk wrote and for
    the page holding each decode step's new token (so a copy-on-write copy or
    a recycled page gets fresh summaries);
  * with GQA, the bounds of a KV head's query heads are summed (an upper
    bound of the group's summed logits) and each KV head picks its own pages;
  * the page holding the newest tokens is always read, plus the top_k - 1
    best of the others. The selection is a compact per-head block table with
    the partial current page last and lengths (n_sel - 1) * page_size +
    tokens in the current page; decode attention does not depend on key
    order, so `selected_decode_attention` reads exactly those pages with the
    unchanged attention ops (XLA path or kernels). A sliding window would
    depend on key positions: do not combine the two.
  * MLA (absorbed form): the key is `[c_KV, k_rope]` and the query
    `[q_latent, q_rope]`, one latent head: summaries span both parts.

KIVI pages: the selection names quantized pages (`top_k` of them per head) and the
full-precision tail is always read besides; `top_k` counts quantized pages. A key
group with zero z and scale s is reconstructed as code * s + z with codes in
[0, 2^b - 1] (`kvjax.cache.quant` rounds z down and s up), so every dequantized key
channel of a page lies in the min / max of [z, z + s (2^b - 1)] over its groups:
bounds that need no extra state and bound exactly the keys attention reads (keys
grouped per channel; MLA's c_KV grouped per token, where each token's channel group
gives its own range). MLA's full-precision k_rope part keeps summaries, refreshed
when a page is quantized.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kvjax.cache import quantized
from kvjax.cache.page_table import AllocStatus
from kvjax.cache.paged import _pools, set_drop
from kvjax.cache.policies.base import (
    CachePolicy,
    Selection,
    active_rows,
    ok_status,
    refuse_indexer,
    windowed,
)
from kvjax.cache.state import PagedKVCache

__all__ = ["Quest", "QuestState", "quest_page_bounds", "kivi_key_bounds"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuestState:
    """Per-page key summaries, indexed by page id (shared pages share summaries).

    Attributes:
      kmin, kmax: [layers, heads, pages, width] in the cache dtype; only pages that
        hold tokens have meaningful values. width: head_dim (K pages), d_c + d_rope
        (MLA latents), d_rope (KIVI MLA: the rotary part; c_KV bounds come from its
        scales), 0 (KIVI K/V: bounds from the key scales).
    """

    kmin: Float[Array, "layers kv_heads pages head_dim"]
    kmax: Float[Array, "layers kv_heads pages head_dim"]


def quest_page_bounds(
    q: Float[Array, "batch q_heads head_dim"],
    kmin: Float[Array, "batch kv_heads max_pages head_dim"],
    kmax: Float[Array, "batch kv_heads max_pages head_dim"],
) -> Float[Array, "batch q_heads max_pages"]:
    """Quest's criticality of each page for each query head: sum_i max(q_i M_i, q_i m_i).

    An upper bound of q . k for every key k of the page (float32, exact
    whenever the products and sums are).
    """
    batch, q_heads, head_dim = q.shape
    kv_heads = kmin.shape[1]
    qg = q.astype(jnp.float32).reshape(batch, kv_heads, q_heads // kv_heads, 1, head_dim)
    hi = qg * kmax.astype(jnp.float32)[:, :, None]
    lo = qg * kmin.astype(jnp.float32)[:, :, None]
    return jnp.sum(jnp.maximum(hi, lo), axis=-1).reshape(batch, q_heads, -1)


def kivi_key_bounds(
    scale: Float[Array, "... groups head_dim"],
    zero: Float[Array, "... groups head_dim"],
    bits: int,
) -> tuple[Float[Array, "... head_dim"], Float[Array, "... head_dim"]]:
    """Per-channel (min, max) bounds of the dequantized keys of pages, from scales and zeros.

    Args:
      scale, zero: a key pool's per-channel scales and zeros, `[..., page_size / G,
        head_dim]` (one row per group of G tokens).
      bits: the code width.

    Returns:
      float32 (kmin, kmax) `[..., head_dim]`: min over groups of min(z, z + s (2^b - 1)) and
      max over groups of max(z, z + s (2^b - 1)) (the quantizer's s is >= 0; both are taken
      so that a negative scale would still give a valid bound).
    """
    s = scale.astype(jnp.float32)
    z = zero.astype(jnp.float32)
    top = s * jnp.float32((1 << bits) - 1) + z  # computed as `dequantize` does: code * s + z
    return jnp.min(jnp.minimum(z, top), axis=-2), jnp.max(jnp.maximum(z, top), axis=-2)


def _latent_bounds(scale, zero, bits: int, width: int):
    """Per-channel bounds of c_KV pages quantized per token in channel groups.

    scale, zero: `[..., page_size, width / G]`; returns float32 `[..., width]` each.
    """
    lo, hi = kivi_key_bounds(scale, zero, bits)  # over the page's tokens: [..., width / G]
    group = width // lo.shape[-1]
    return jnp.repeat(lo, group, axis=-1), jnp.repeat(hi, group, axis=-1)


def _fresh_rope_bounds(cache: PagedKVCache, layer, lo, hi):
    """KIVI MLA: the k_rope bounds of the page this decode step's write quantized, from the
    pool. The state's summaries of it are refreshed by `after_step`, after the attention
    that selects among the quantized pages (a decode step quantizes at most one page: the
    last). lo, hi: float32 [heads, batch, max_pages, d_rope]."""
    spec = cache.spec
    ps, max_pages = spec.page_size, spec.max_pages_per_seq
    col = jnp.clip(cache.quant_lengths // ps - 1, 0, max_pages - 1)  # [B]
    page = jnp.take_along_axis(cache.block_tables, col[:, None], axis=1)[:, 0]
    rows = cache.pages.k_rope[layer][:, jnp.clip(page, 0, spec.num_pages - 1)]  # [H, B, ps, W]
    at = (cache.tail.pending[1] > 0)[:, None] & (jnp.arange(max_pages)[None, :] == col[:, None])
    at = at[None, :, :, None]  # [1, B, M, 1]
    lo = jnp.where(at, rows.min(axis=2).astype(jnp.float32)[:, :, None], lo)
    hi = jnp.where(at, rows.max(axis=2).astype(jnp.float32)[:, :, None], hi)
    return lo, hi


@dataclasses.dataclass(frozen=True, kw_only=True)
class Quest(CachePolicy):
    """Attend to the current page plus the top_k - 1 pages with the highest Quest bound.

    Attributes:
      top_k: pages read per step and KV head, the current page included
        (default 64: a 1024-token budget at the paper's 16-token pages; the
        paper evaluates token budgets from 256 to 4096).
      dense_layers: the first `dense_layers` layers read every page (paper: 2).
    """

    top_k: int = 64
    dense_layers: int = 2

    def __post_init__(self):
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1:
            raise ValueError(f"Quest.top_k must be an int >= 1, got {self.top_k!r}.")
        if (isinstance(self.dense_layers, bool) or not isinstance(self.dense_layers, int)
                or self.dense_layers < 0):
            raise ValueError(f"Quest.dense_layers must be an int >= 0, got "
                             f"{self.dense_layers!r}.")

    def _summarised(self, cache: PagedKVCache):
        """The full-precision key pools whose summaries the state keeps."""
        if not cache.is_quantized:
            pools = _pools(cache.pages)
            return pools if cache.spec.is_mla else pools[:1]
        return (cache.pages.k_rope,) if cache.spec.is_mla else ()

    def init_state(self, cache: PagedKVCache) -> QuestState:
        refuse_indexer("Quest", cache, "its page selection would be a second choice of what "
                       "decode reads, competing with the indexer's token selection (which "
                       "one wins is not defined).")
        spec = cache.spec
        width = sum(p.shape[4] for p in self._summarised(cache))
        shape = (spec.num_layers, spec.attention.cache_heads, spec.num_pages, width)
        return QuestState(kmin=jnp.zeros(shape, spec.dtype), kmax=jnp.zeros(shape, spec.dtype))

    def _refresh(self, cache: PagedKVCache, state: QuestState, first, count,
                 width: int) -> QuestState:
        """Recomputes the summaries of block-table columns [first, first + count) of each row.

        `width` (static) bounds `count`: only max_seqs * width pages are read, never the
        pool.
        """
        pools = self._summarised(cache)
        if not pools:
            return state
        spec = cache.spec
        ps, num_pages, max_pages = spec.page_size, spec.num_pages, spec.max_pages_per_seq
        lengths = cache.table.lengths  # pages' tokens (quantized ones on a KIVI cache)
        cols = first[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]  # [B, width]
        n_valid = jnp.clip(lengths[:, None] - cols * ps, 0, ps)  # tokens in each page
        flag = (jnp.arange(width)[None, :] < count[:, None]) & (n_valid > 0) & (cols < max_pages)
        pages = jnp.take_along_axis(cache.block_tables, jnp.clip(cols, 0, max_pages - 1), axis=1)
        ids = jnp.where(flag, pages, num_pages).reshape(-1)
        safe = jnp.clip(ids, 0, num_pages - 1)
        k = jnp.concatenate([p[:, :, safe] for p in pools], axis=-1)  # [L, H, N, ps, W]
        valid = (jnp.arange(ps)[None, :] < n_valid.reshape(-1)[:, None])[None, None, :, :, None]
        big = jnp.asarray(jnp.finfo(k.dtype).max, k.dtype)
        kmin = jnp.min(jnp.where(valid, k, big), axis=3)
        kmax = jnp.max(jnp.where(valid, k, -big), axis=3)
        at = (slice(None), slice(None), ids)
        return QuestState(kmin=set_drop(state.kmin, at, kmin), kmax=set_drop(state.kmax, at, kmax))

    def _refresh_written(self, cache, state, rows, q_lengths, q_len: int):
        """Refreshes the pages the last write filled (a KIVI cache: the pages it quantized)."""
        ps = cache.spec.page_size
        width = -(-q_len // ps) + 1
        if cache.is_quantized:
            q = cache.quant_lengths
            first = (q - cache.tail.pending[1]) // ps
            count = q // ps - first
        else:
            first = (cache.lengths - q_lengths) // ps
            count = (cache.lengths + ps - 1) // ps - first
        count = jnp.where(rows, count, 0)
        return self._refresh(cache, state, first.astype(jnp.int32), count, width)

    def after_prefill(
        self,
        cache: PagedKVCache,
        state: QuestState,
        queries: Float[Array, "layers batch q_len q_heads head_dim"],
        q_lengths: Int[Array, " batch"],
    ) -> tuple[PagedKVCache, QuestState, AllocStatus]:
        state = self._refresh_written(cache, state, q_lengths > 0, q_lengths, queries.shape[2])
        return cache, state, ok_status(cache)

    def after_step(
        self,
        cache: PagedKVCache,
        state: QuestState,
        queries: Float[Array, "layers batch q_heads head_dim"],
        active: Bool[Array, " batch"] | None = None,
    ) -> tuple[PagedKVCache, QuestState, AllocStatus]:
        rows = active_rows(cache, active)
        return cache, self._refresh_written(cache, state, rows, rows.astype(jnp.int32), 1), (
            ok_status(cache))

    def before_attention(
        self,
        cache: PagedKVCache,
        state: QuestState,
        layer: int | Int[Array, ""],
        q: Float[Array, "batch q_heads head_dim"],
    ) -> Selection | None:
        """Per-head selection; a static `layer` below `dense_layers` reads everything (None),
        as does a sliding-window layer (`attention`): it already reads at most its window,
        and a selection reads pages out of position order, where no window applies. On
        the other layers the ranking (an upper bound of q . k per page) is that of the
        model's logits too: its scale and soft cap are increasing maps.

        With a traced `layer` (a scan over layers) the table is max_pages wide
        and dense layers select every page through it.
        """
        max_pages = cache.spec.max_pages_per_seq
        select = self._select_quantized if cache.is_quantized else self._select
        if windowed(self.attention, layer):  # reads its window, at most window tokens
            return None
        if isinstance(layer, int):
            if layer < self.dense_layers or self.top_k >= max_pages:
                return None
            return select(cache, state, layer, q, self.top_k, self.top_k)
        k_eff = jnp.where(layer < self.dense_layers, max_pages, min(self.top_k, max_pages))
        return select(cache, state, layer, q, k_eff, max_pages)

    def _bounds(self, cache, state, layer, safe):
        """(kmin, kmax) float32 [batch, heads, max_pages, width] of the pages `safe` names."""
        parts_lo, parts_hi = [], []
        if cache.is_quantized:
            view = quantized.layer_view(cache, layer)
            k = view.k
            if cache.spec.is_mla:
                lo, hi = _latent_bounds(k.scale[:, safe], k.zero[:, safe], k.bits,
                                        view.tail_k.shape[-1])
            else:
                lo, hi = kivi_key_bounds(k.scale[:, safe], k.zero[:, safe], k.bits)
            parts_lo.append(lo)
            parts_hi.append(hi)
        if state.kmin.shape[-1]:
            lo = state.kmin[layer][:, safe].astype(jnp.float32)
            hi = state.kmax[layer][:, safe].astype(jnp.float32)
            if cache.is_quantized:
                lo, hi = _fresh_rope_bounds(cache, layer, lo, hi)
            parts_lo.append(lo)
            parts_hi.append(hi)
        lo = jnp.concatenate(parts_lo, axis=-1)  # [H, B, M, W]
        hi = jnp.concatenate(parts_hi, axis=-1)
        return jnp.swapaxes(lo, 0, 1), jnp.swapaxes(hi, 0, 1)

    def _select_quantized(self, cache, state, layer, q, k_eff, width: int) -> Selection:
        """The top quantized pages per head (the tail is read besides)."""
        spec = cache.spec
        ps, num_pages = spec.page_size, spec.num_pages
        bt = cache.block_tables
        batch, max_pages = bt.shape
        heads = spec.attention.cache_heads
        n = cache.quant_lengths // ps  # quantized pages of each sequence
        kmin, kmax = self._bounds(cache, state, layer, jnp.clip(bt, 0, num_pages - 1))
        bound = quest_page_bounds(q, kmin, kmax)
        bound = bound.reshape(batch, heads, -1, max_pages).sum(axis=2)  # [B, H, M]
        cols = jnp.arange(max_pages, dtype=jnp.int32)
        bound = jnp.where(cols[None, None, :] < n[:, None, None], bound, -jnp.inf)
        _, top = jax.lax.top_k(bound, width)  # best first; non-candidates last
        n_sel = jnp.minimum(k_eff, n)  # [B]
        chosen = jnp.arange(width)[None, None, :] < n_sel[:, None, None]
        # Read the chosen pages in page order (attention does not depend on key order;
        # page order makes "every page selected" read exactly what plain attention reads).
        top = jnp.sort(jnp.where(chosen, top, max_pages), axis=2)
        table = jnp.take_along_axis(jnp.broadcast_to(bt[:, None, :], (batch, heads, max_pages)),
                                    jnp.clip(top, 0, max_pages - 1), axis=2)
        table = jnp.where(chosen, table, -1).astype(jnp.int32)
        lengths = jnp.broadcast_to((n_sel * ps)[:, None], (batch, heads)).astype(jnp.int32)
        return Selection(block_tables=table, lengths=lengths)

    def _select(self, cache, state, layer, q, k_eff, width: int) -> Selection:
        ps = cache.spec.page_size
        num_pages = cache.spec.num_pages
        lengths = cache.lengths
        bt = cache.block_tables
        batch = bt.shape[0]
        kv_heads = cache.spec.attention.cache_heads
        n = cache.table.pages_used()
        kmin, kmax = self._bounds(cache, state, layer, jnp.clip(bt, 0, num_pages - 1))
        bound = quest_page_bounds(q, kmin, kmax)
        bound = bound.reshape(batch, kv_heads, -1, bound.shape[-1]).sum(axis=2)  # [B, H, M]
        cols = jnp.arange(bt.shape[1])
        older = cols[None, None, :] < (n - 1)[:, None, None]
        bound = jnp.where(older, bound, -jnp.inf)
        _, top = jax.lax.top_k(bound, width - 1)  # best first; non-candidates last
        pages = jnp.take_along_axis(jnp.broadcast_to(bt[:, None, :], bound.shape), top, axis=2)
        n_sel = jnp.minimum(k_eff, n)  # [B]
        current = jnp.take_along_axis(bt, jnp.maximum(n - 1, 0)[:, None], axis=1)  # [B, 1]
        table = jnp.concatenate([pages, jnp.full((batch, kv_heads, 1), -1, jnp.int32)], axis=2)
        sel_cols = jnp.arange(width)[None, None, :]
        table = jnp.where(sel_cols == (n_sel - 1)[:, None, None], current[:, :, None], table)
        table = jnp.where(sel_cols < n_sel[:, None, None], table, -1)
        sel_len = jnp.where(lengths > 0, (n_sel - 1) * ps + lengths - (n - 1) * ps, 0)
        return Selection(block_tables=table.astype(jnp.int32),
                         lengths=jnp.broadcast_to(sel_len[:, None], (batch, kv_heads)))
