"""SnapKV: compress the prompt once, by what its last queries attend to.

Paper: Li, Huang, Yang, Venkitesh, Locatelli, Ye, Cai, Lewis, Chen, "SnapKV:
LLM Knows What You are Looking for Before Generation", arXiv 2404.14469.

Rule (paraphrased): the attention that the last few prompt tokens (the
observation window) pay to the earlier prompt tokens predicts which of them
generation will need. Sum the window queries' attention weights for each
earlier position, smooth the sums along the sequence with a 1-D pooling
(max-pooling, kernel 7 by default) so that neighbours of a selected token
come along, keep the top-scoring positions per head, and concatenate the KV
of the observation window itself. Defaults: window w = 32, kernel 7,
max-pooling. With grouped-query attention, the scores of a KV head's query
group are averaged.

Here it runs once, in `after_prefill`, on the sequences prefilled in that
call whose cache exceeds `budget`: each (layer, cache head) keeps its own
`budget - window` best prefix tokens plus the window, all compacted, and the
whole pages left over return to the pool. Generated tokens are then
appended and never evicted (the paper compresses the prompt only). The
observation window comes from the last prefill chunk's queries, so give the
prompt's last chunk at least `window` tokens (shorter windows are used as
they are). MLA latents have one cache head.

KIVI pages (page-granular SnapKV): a quantized page's vote is the sum of its
tokens' pooled votes over all layers and heads; the lowest-voted quantized pages
are evicted (`kvjax.cache.quantized.drop_pages`) until the sequence holds at most
`budget` tokens. The pages holding the observation window and the full-precision
tail are never evicted, so the budget must hold the largest tail.
"""

import dataclasses

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kvjax.cache import ops
from kvjax.cache.page_table import AllocStatus
from kvjax.cache.policies.base import (
    CachePolicy,
    LayerAttention,
    ok_status,
    refuse_indexer,
    refuse_kivi_windows,
    require_window_budget,
    score_scale,
    soft_cap_of,
)
from kvjax.cache.policies.compaction import (
    compact,
    keep_heavy_and_recent,
    keep_windows,
    only_rows,
)
from kvjax.cache.policies.h2o import _DENSE_SCORES, evict_lowest_pages, require_kivi_budget
from kvjax.cache.state import PagedKVCache

__all__ = ["SnapKV", "snapkv_scores"]

_POOLING = ("max", "avg")


def snapkv_scores(
    cache: PagedKVCache,
    queries: Float[Array, "layers batch q_len q_heads head_dim"],
    q_lengths: Int[Array, " batch"],
    *,
    window: int,
    kernel: int,
    pooling: str = "max",
    scale: float | None = None,
    attention: LayerAttention | None = None,
) -> Float[Array, "layers batch kv_heads max_tokens"]:
    """SnapKV's pooled observation-window votes for every cached position.

    For row b, the observation window is its last min(window, q_lengths[b])
    queries. Each prefix position (before the window) gets the sum of the
    window's attention probabilities, pooled along positions (kernel `kernel`,
    stride 1, centred; zeros outside the prefix), then averaged over the KV
    head's query group. Window positions and positions past the length get 0.

    `scale` (default: `attention.scale`, else the cache geometry's) and the soft cap of
    `attention` (the model's `LayerAttention`) are those of the model's attention; its
    windowed layers get no votes (zeros): they keep their most recent tokens.

    Returns:
      float32[layers, batch, cache_heads, max_tokens].
    """
    spec = cache.spec
    heads = spec.attention.cache_heads
    q_len = queries.shape[2]
    w = jnp.minimum(q_lengths, window)
    t = jnp.arange(q_len)[None, :]
    in_window = (t >= q_lengths[:, None] - w[:, None]) & (t < q_lengths[:, None])
    prefix_end = cache.lengths - w  # positions < prefix_end are candidates
    pos = jnp.arange(spec.max_tokens_per_seq)[None, :]
    in_prefix = (pos < prefix_end[:, None])[:, None, :]  # [batch, 1, tokens]
    scale = score_scale(scale, cache, attention)
    local = () if attention is None else attention.windowed_layers
    out = []
    for layer in range(spec.num_layers):
        if layer in local:  # windowed layers keep their most recent tokens: no votes
            out.append(jnp.zeros((q_lengths.shape[0], heads, spec.max_tokens_per_seq),
                                 jnp.float32))
            continue
        p = ops.attention_probs(cache, layer, queries[layer], q_lengths, scale=scale,
                                soft_cap=soft_cap_of(attention),
                                weights=in_window.astype(jnp.float32))
        votes = jnp.where(in_prefix, p, 0.0)  # [batch, q_heads, tokens]
        votes = _pool(votes, kernel, pooling)
        b, hq, tok = votes.shape
        votes = votes.reshape(b, heads, hq // heads, tok).mean(axis=2)
        out.append(jnp.where(in_prefix, votes, 0.0))
    return jnp.stack(out)


def _pool(x, kernel: int, pooling: str):
    """Centred 1-D pooling along the last axis, stride 1, zero padding."""
    half = kernel // 2
    padded = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(half, kernel - 1 - half)])
    n = x.shape[-1]
    shifts = jnp.stack([padded[..., i:i + n] for i in range(kernel)])
    # Probabilities are >= 0, so zero padding never wins a max.
    return shifts.max(axis=0) if pooling == "max" else shifts.mean(axis=0)


def _check_snap(owner, budget, window, kernel, pooling):
    for name, v in (("budget", budget), ("window", window), ("kernel", kernel)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{owner}.{name} must be an int >= 1, got {v!r}.")
    if window >= budget:
        raise ValueError(f"{owner}: window={window} must be smaller than budget={budget}.")
    if pooling not in _POOLING:
        raise ValueError(f"{owner}.pooling must be one of {_POOLING}, got {pooling!r}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SnapKV(CachePolicy):
    """Compress each prompt to `budget` tokens: top pooled votes + the observation window.

    Attributes:
      budget: prompt tokens kept per sequence (per layer and KV head), window
        included. Default 1024 (the paper evaluates 1024 to 4096).
      window: observation window w (paper: 32).
      kernel: pooling kernel size (paper: 7).
      pooling: "max" (paper) or "avg".
      scale: attention logit scale for scoring, default 1/sqrt(head_dim).
    """

    budget: int = 1024
    window: int = 32
    kernel: int = 7
    pooling: str = "max"
    scale: float | None = None

    def __post_init__(self):
        _check_snap("SnapKV", self.budget, self.window, self.kernel, self.pooling)

    def init_state(self, cache: PagedKVCache) -> None:
        refuse_indexer("SnapKV", cache, _DENSE_SCORES)
        refuse_kivi_windows("SnapKV", cache, self.attention)
        require_window_budget("SnapKV", self.budget, self.attention)
        if cache.is_quantized:
            require_kivi_budget("SnapKV", self.budget, cache)
        return None

    def after_prefill(
        self,
        cache: PagedKVCache,
        state: None,
        queries: Float[Array, "layers batch q_len q_heads head_dim"],
        q_lengths: Int[Array, " batch"],
    ) -> tuple[PagedKVCache, None, AllocStatus]:
        if self.budget >= cache.spec.max_tokens_per_seq:  # no prompt can exceed the budget
            return cache, state, ok_status(cache)
        scores = snapkv_scores(cache, queries, q_lengths, window=self.window,
                               kernel=self.kernel, pooling=self.pooling, scale=self.scale,
                               attention=self.attention)
        if cache.is_quantized:
            cache, _, status = evict_kivi_pages(cache, scores, q_lengths, self.window,
                                                self.budget)
            return cache, state, status
        keep, new_lengths = keep_heavy_and_recent(scores, cache.lengths, self.budget,
                                                  self.window, seq_axis=1)
        if self.attention is not None:
            keep = keep_windows(keep, cache.lengths, self.attention.windowed_layers)
        keep, new_lengths = only_rows(keep, new_lengths, cache.lengths, q_lengths > 0)
        cache, _, status = compact(cache, keep, new_lengths)
        return cache, state, status



def kivi_page_votes(cache: PagedKVCache, scores, q_lengths, window: int):
    """Page votes of a KIVI cache (summed over layers and heads) and the window's pages.

    Returns (mass float32[max_seqs, max_pages], pinned bool[max_seqs, max_pages]).
    """
    spec = cache.spec
    ps, max_pages = spec.page_size, spec.max_pages_per_seq
    mass = scores.sum(axis=(0, 2)).reshape(spec.max_seqs, max_pages, ps).sum(axis=-1)
    w = jnp.minimum(q_lengths, window)
    first_window_page = (cache.lengths - w) // ps
    pinned = jnp.arange(max_pages)[None, :] >= first_window_page[:, None]
    return mass, pinned


def evict_kivi_pages(cache: PagedKVCache, scores, q_lengths, window: int, budget: int):
    """Page-granular SnapKV on a KIVI cache (see the module docstring)."""
    mass, pinned = kivi_page_votes(cache, scores, q_lengths, window)
    return evict_lowest_pages(cache, mass, cache.lengths - budget, q_lengths > 0,
                              pinned=pinned)
