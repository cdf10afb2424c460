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
  * quantized pages: the summaries must come from the full-precision keys
    (at flush time); this module reads the cache's own pools and supports
    full-precision caches only (TODO when quantized pages land).
"""

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kvjax.cache.page_table import AllocStatus
from kvjax.cache.paged import PagedKVCache, set_drop
from kvjax.cache.policies.base import (
    CachePolicy,
    Selection,
    active_rows,
    full_selection,
    ok_status,
)

__all__ = ["Quest", "QuestState", "quest_page_bounds"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuestState:
    """Per-page key summaries, indexed by page id (shared pages share summaries).

    Attributes:
      kmin, kmax: [layers, kv_heads, pages, head_dim] in the cache dtype; only
        pages that hold tokens have meaningful values.
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

    def init_state(self, cache: PagedKVCache) -> QuestState:
        if cache.spec.is_mla:
            raise ValueError("Quest supports MHA/GQA/MQA caches (KVPages), not MLA latent caches.")
        k = cache.pages.k
        shape = (k.shape[0], k.shape[1], k.shape[2], k.shape[4])
        return QuestState(kmin=jnp.zeros(shape, k.dtype), kmax=jnp.zeros(shape, k.dtype))

    def _refresh(self, cache: PagedKVCache, state: QuestState,
                 entries: Int[Array, "max_seqs max_pages"]) -> QuestState:
        """Recomputes the summaries of the pages at flagged block-table entries."""
        ps = cache.spec.page_size
        num_pages = cache.spec.num_pages
        lengths = cache.lengths
        cols = jnp.arange(cache.spec.max_pages_per_seq)[None, :]
        n_valid = jnp.clip(lengths[:, None] - cols * ps, 0, ps)  # tokens in each entry's page
        flag = entries & (n_valid > 0)
        ids = jnp.where(flag, cache.block_tables, num_pages).reshape(-1)
        k = cache.pages.k[:, :, jnp.clip(ids, 0, num_pages - 1)]  # [L, H, N, ps, D]
        valid = (jnp.arange(ps)[None, :] < n_valid.reshape(-1)[:, None])[None, None, :, :, None]
        big = jnp.asarray(jnp.finfo(k.dtype).max, k.dtype)
        kmin = jnp.min(jnp.where(valid, k, big), axis=3)
        kmax = jnp.max(jnp.where(valid, k, -big), axis=3)
        at = (slice(None), slice(None), ids)
        return QuestState(kmin=set_drop(state.kmin, at, kmin), kmax=set_drop(state.kmax, at, kmax))

    def after_prefill(
        self,
        cache: PagedKVCache,
        state: QuestState,
        queries: Float[Array, "layers batch q_len q_heads head_dim"],
        q_lengths: Int[Array, " batch"],
    ) -> tuple[PagedKVCache, QuestState, AllocStatus]:
        ps = cache.spec.page_size
        cols = jnp.arange(cache.spec.max_pages_per_seq)[None, :]
        first = (cache.lengths - q_lengths) // ps
        entries = (q_lengths[:, None] > 0) & (cols >= first[:, None])
        return cache, self._refresh(cache, state, entries), ok_status(cache)

    def after_step(
        self,
        cache: PagedKVCache,
        state: QuestState,
        queries: Float[Array, "layers batch q_heads head_dim"],
        active: Bool[Array, " batch"] | None = None,
    ) -> tuple[PagedKVCache, QuestState, AllocStatus]:
        cols = jnp.arange(cache.spec.max_pages_per_seq)[None, :]
        last = cache.table.pages_used() - 1
        entries = (cols == last[:, None]) & active_rows(cache, active)[:, None]
        return cache, self._refresh(cache, state, entries), ok_status(cache)

    def before_attention(
        self,
        cache: PagedKVCache,
        state: QuestState,
        layer: int | Int[Array, ""],
        q: Float[Array, "batch q_heads head_dim"],
    ) -> Selection:
        """Per-KV-head selection; a static `layer` below `dense_layers` reads everything.

        With a traced `layer` (a scan over layers) the table is max_pages wide
        and dense layers select every page through it.
        """
        max_pages = cache.spec.max_pages_per_seq
        if isinstance(layer, int):
            if layer < self.dense_layers or self.top_k >= max_pages:
                return full_selection(cache)
            return self._select(cache, state, layer, q, self.top_k, self.top_k)
        k_eff = jnp.where(layer < self.dense_layers, max_pages, min(self.top_k, max_pages))
        return self._select(cache, state, layer, q, k_eff, max_pages)

    def _select(self, cache, state, layer, q, k_eff, width: int) -> Selection:
        ps = cache.spec.page_size
        num_pages = cache.spec.num_pages
        lengths = cache.lengths
        bt = cache.block_tables
        batch = bt.shape[0]
        kv_heads = cache.spec.attention.kv_heads
        n = cache.table.pages_used()
        safe = jnp.clip(bt, 0, num_pages - 1)
        kmin = jnp.swapaxes(state.kmin[layer][:, safe], 0, 1)  # [B, H, M, D]
        kmax = jnp.swapaxes(state.kmax[layer][:, safe], 0, 1)
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
