"""PyramidKV: SnapKV's prompt compression with budgets that shrink with depth.

Paper: Cai, Zhang, Gao, Liu, Liu, Lu, Xiong, Dong, Chang, Hu, Xiao,
"PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information
Funneling", arXiv 2406.02069.

Rule (paraphrased): attention is spread widely in the lower layers and
concentrates on a few tokens in the upper ones ("pyramidal information
funneling"), so lower layers get more cache and upper layers less. The
per-layer budgets form an arithmetic sequence from the bottom layer to the
top one, with the top layer's budget the average divided by beta (default
20) and the bottom layer's twice the average minus the top's, so that the
total matches a uniform allocation. Within a layer, tokens are chosen as in
SnapKV (observation-window attention, pooled, top tokens plus the window).

On a paged cache with one block table per sequence, a page id names the
same slots in every layer, so memory can only be returned down to the
largest (bottom-layer) budget. The smaller layers save reads instead: each
layer's kept tokens are compacted to the END of the kept region, layer l
leaving `skip_l` whole pages at its front unused, and `before_attention`
hands the attention a block table that starts `skip_l` pages later (a
`Selection`). To make the skipped part whole pages, each layer's budget is
rounded up to `max_budget - skip_l * page_size`.

A prompt that fits the largest budget is kept whole in every layer. MLA latents
have one cache head.

KIVI pages (page-granular PyramidKV): quantized pages are shared by all layers, so
memory returns as in page-granular SnapKV, down to the bottom layer's budget (the
lowest-voted quantized pages, votes summed over layers and heads; the window's pages
and the tail always stay). Each layer then reads fewer pages instead: layer l drops,
from what it reads, its own lowest-voted quantized prompt pages until its reads fit
its budget (`PyramidState.drop`, per block-table column); pages quantized later
(generated tokens) and the tail are always read.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kvjax.cache.page_table import AllocStatus
from kvjax.cache.policies.base import (
    CachePolicy,
    Selection,
    ok_status,
    refuse_indexer,
    refuse_kivi_windows,
    require_window_budget,
    windowed,
)
from kvjax.cache.policies.compaction import (
    compact,
    keep_heavy_and_recent,
    keep_windows,
    only_rows,
)
from kvjax.cache.policies.h2o import _DENSE_SCORES, evict_lowest_pages, require_kivi_budget
from kvjax.cache.policies.snapkv import _check_snap, kivi_page_votes, snapkv_scores
from kvjax.cache.state import PagedKVCache

__all__ = ["PyramidKV", "PyramidState"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PyramidState:
    """What each layer reads less of.

    Attributes:
      skip: int32[layers, max_seqs], front pages of the kept region a layer does not
        read (full-precision pages).
      drop: bool[layers, max_seqs, max_pages], block-table columns of quantized pages a
        layer does not read (KIVI pages; all False otherwise).
    """

    skip: Int[Array, "layers max_seqs"]
    drop: Array | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class PyramidKV(CachePolicy):
    """SnapKV selection with per-layer budgets decreasing linearly with depth.

    Attributes:
      budget: average prompt tokens kept per layer (window included). Default 1024.
      beta: the top layer keeps budget / beta tokens (paper: 20).
      window, kernel, pooling, scale: as in `SnapKV`.

    On a model with sliding-window layers (`attention`, set by `bind_model`) the windowed
    layers keep the largest layer budget's most recent tokens and read them all; that
    budget must hold the largest window.
    """

    budget: int = 1024
    beta: float = 20.0
    window: int = 32
    kernel: int = 7
    pooling: str = "max"
    scale: float | None = None

    def __post_init__(self):
        _check_snap("PyramidKV", self.budget, self.window, self.kernel, self.pooling)
        if not self.beta >= 1:
            raise ValueError(f"PyramidKV.beta must be >= 1, got {self.beta!r}.")
        if self.budget / self.beta <= self.window:
            raise ValueError(
                f"PyramidKV: the top layer's budget budget/beta = {self.budget / self.beta:g} "
                f"must exceed window={self.window}; raise budget or lower beta."
            )

    def layer_budgets(self, num_layers: int, page_size: int) -> tuple[int, ...]:
        """Tokens each layer keeps, bottom first, after rounding up to whole skipped pages."""
        top = self.budget / self.beta
        bottom = 2 * self.budget - top
        raw = [bottom - (bottom - top) * i / max(num_layers - 1, 1) for i in range(num_layers)]
        if num_layers == 1:
            raw = [float(self.budget)]
        b_max = int(raw[0])
        return tuple(b_max - int((b_max - r) // page_size) * page_size for r in raw)

    def init_state(self, cache: PagedKVCache) -> PyramidState:
        refuse_indexer("PyramidKV", cache, _DENSE_SCORES.replace(
            "model.", "model, and its per-layer page selection would compete with the "
            "indexer's token selection."))
        spec = cache.spec
        refuse_kivi_windows("PyramidKV", cache, self.attention)
        require_window_budget("PyramidKV", self.layer_budgets(spec.num_layers,
                                                              spec.page_size)[0], self.attention)
        skip = jnp.zeros((spec.num_layers, spec.max_seqs), jnp.int32)
        if cache.is_quantized:
            require_kivi_budget("PyramidKV", self.layer_budgets(spec.num_layers,
                                                                spec.page_size)[0], cache)
            return PyramidState(skip=skip, drop=jnp.zeros(
                (spec.num_layers, spec.max_seqs, spec.max_pages_per_seq), bool))
        return PyramidState(skip=skip)

    def fork_state(self, state: PyramidState, src, dst) -> PyramidState:
        skip = state.skip.at[:, dst].set(state.skip[:, src], mode="drop")
        drop = None if state.drop is None else state.drop.at[:, dst].set(state.drop[:, src],
                                                                         mode="drop")
        return PyramidState(skip=skip, drop=drop)

    def after_prefill(
        self,
        cache: PagedKVCache,
        state: PyramidState,
        queries: Float[Array, "layers batch q_len q_heads head_dim"],
        q_lengths: Int[Array, " batch"],
    ) -> tuple[PagedKVCache, PyramidState, AllocStatus]:
        spec = cache.spec
        ps = spec.page_size
        budgets = self.layer_budgets(spec.num_layers, ps)
        b_max = budgets[0]
        if b_max >= spec.max_tokens_per_seq:  # no prompt can exceed the largest budget
            return cache, dataclasses.replace(state, skip=jnp.zeros_like(state.skip)), (
                ok_status(cache))
        scores = snapkv_scores(cache, queries, q_lengths, window=self.window,
                               kernel=self.kernel, pooling=self.pooling, scale=self.scale,
                               attention=self.attention)
        if cache.is_quantized:
            return self._kivi_prefill(cache, state, scores, q_lengths, budgets)
        lengths = cache.lengths
        evict = (q_lengths > 0) & (lengths > b_max)
        keeps, skips = [], []
        for layer, b in enumerate(budgets):
            if windowed(self.attention, layer):  # a windowed layer keeps its b_max newest
                b = b_max
            keep_l, _ = keep_heavy_and_recent(scores[layer], lengths, b, self.window,
                                              seq_axis=0)  # [batch, heads, b]
            front = jnp.broadcast_to(jnp.arange(b_max - b, dtype=jnp.int32),
                                     (*keep_l.shape[:2], b_max - b))
            keeps.append(jnp.concatenate([front, keep_l], axis=-1))
            skips.append((b_max - b) // ps)
        keep = jnp.stack(keeps)
        if self.attention is not None:
            keep = keep_windows(keep, lengths, self.attention.windowed_layers)
        keep, new_lengths = only_rows(keep, jnp.full_like(lengths, b_max), lengths, evict)
        cache, _, status = compact(cache, keep, new_lengths)
        skip = jnp.asarray(skips, jnp.int32)[:, None]
        skip = jnp.where(evict[None, :], skip, jnp.where(q_lengths[None, :] > 0, 0, state.skip))
        skip = jnp.where(status.ok, skip, state.skip)
        return cache, PyramidState(skip=skip), status

    def _kivi_prefill(self, cache, state, scores, q_lengths, budgets):
        spec = cache.spec
        ps, max_pages = spec.page_size, spec.max_pages_per_seq
        mass, pinned = kivi_page_votes(cache, scores, q_lengths, self.window)
        rows = q_lengths > 0
        cache, src, status = evict_lowest_pages(cache, mass, cache.lengths - budgets[0], rows,
                                                pinned=pinned)
        # Per-layer votes follow their pages; each layer drops its lowest-voted prompt pages.
        page_src = src[:, ::ps] // ps  # [max_seqs, max_pages]: old column of each new one
        valid = src[:, ::ps] >= 0
        per_layer = scores.sum(axis=2).reshape(spec.num_layers, spec.max_seqs, max_pages, ps)
        per_layer = jnp.take_along_axis(per_layer.sum(-1), jnp.clip(page_src, 0)[None], axis=2)
        pinned = jnp.take_along_axis(pinned, jnp.clip(page_src, 0), axis=1) & valid
        n_q = cache.quant_lengths // ps
        cols = jnp.arange(max_pages)[None, :]
        evictable = (cols < n_q[:, None]) & ~pinned
        drops = []
        for layer, b in enumerate(budgets):
            k = jnp.clip(-(-(cache.lengths - b) // ps), 0, jnp.sum(evictable, axis=1))
            order = jnp.argsort(jnp.where(evictable, per_layer[layer], jnp.inf), axis=1,
                                stable=True)
            d = jnp.zeros((spec.max_seqs, max_pages), bool).at[
                jnp.arange(spec.max_seqs)[:, None], order].set(cols < k[:, None])
            drops.append(d & evictable)
        drop = jnp.where(rows[None, :, None], jnp.stack(drops), state.drop)
        drop = jnp.where(status.ok, drop, state.drop)
        return cache, dataclasses.replace(state, drop=drop), status

    def before_attention(
        self,
        cache: PagedKVCache,
        state: PyramidState,
        layer: int | Int[Array, ""],
        q: Float[Array, "batch q_heads head_dim"],
    ) -> Selection | None:
        if windowed(self.attention, layer):  # reads its whole (kept) window
            return None
        if cache.is_quantized:  # the quantized pages this layer reads, in column order
            drop = state.drop[layer]
            spec = cache.spec
            cols = jnp.arange(spec.max_pages_per_seq)[None, :]
            read = (cols < (cache.quant_lengths // spec.page_size)[:, None]) & ~drop
            order = jnp.argsort(jnp.where(read, cols, cols + spec.max_pages_per_seq), axis=1)
            bt = jnp.take_along_axis(jnp.where(read, cache.block_tables, -1), order, axis=1)
            n = jnp.sum(read, axis=1) * spec.page_size
            return Selection(block_tables=bt[:, None].astype(jnp.int32), lengths=n[:, None])
        skip = state.skip[layer]  # [batch]
        bt = cache.block_tables
        cols = jnp.arange(bt.shape[1])[None, :] + skip[:, None]
        shifted = jnp.take_along_axis(bt, jnp.clip(cols, 0, bt.shape[1] - 1), axis=1)
        shifted = jnp.where(cols < bt.shape[1], shifted, -1)
        lengths = cache.lengths - skip * cache.spec.page_size
        return Selection(block_tables=shifted[:, None], lengths=lengths[:, None])
