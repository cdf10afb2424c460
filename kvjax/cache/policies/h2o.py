"""H2O: keep the heavy hitters (most attended tokens) and the recent tokens.

Paper: Zhang, Sheng, Zhou, Chen, Zheng, Cai, Song, Tian, Ré, Barrett, Wang,
Chen, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
Language Models", arXiv 2306.14048 (NeurIPS 2023).

Rule (paraphrased): a small set of tokens, the heavy hitters, collects most
of the attention; a token's importance is its attention score accumulated
over all queries so far. With the cache at its budget, each generation step
evicts, greedily, the token whose accumulated score is lowest, never one of
the most recent tokens. The paper splits the budget evenly between heavy
hitters and recent tokens (e.g. 10% + 10% of the sequence).

Scores: `after_prefill` adds, for every cached token, the attention probability
each prompt query of the chunk gives it; `after_step` adds the new query's
probabilities (a blocked pass over the keys, `kvjax.cache.attention_probs`: on KIVI
pages never a dequantized copy of a sequence's keys).

Full-precision pages (MHA/GQA/MQA K/V, MLA latents), per layer and per cache head
(scores summed over the head's query group, so every query head of the group keeps
the same tokens; MLA has one latent head): when a sequence exceeds `budget`, it keeps
its last `recent` tokens plus the `budget - recent` older tokens with the largest
accumulated score, each (layer, head) its own set, all of the same size; kept tokens
are compacted and whole pages return to the pool (`compaction.py`). Evicting one
token per step, as the paper does, keeps the length at most `budget` after every
step.

KIVI pages (page-granular H2O): the tokens of a quantized page share their scales,
so the quantized part is evicted a whole page at a time: a page's mass is the sum of
its tokens' scores (over all layers, heads and queries so far, including the mass
its tokens collected while still in the tail); when a sequence exceeds `budget`
tokens (quantized pages kept x page_size + tail), the lowest-mass quantized pages go
(`kvjax.cache.quantized.drop_pages`), as many as needed. The full-precision tail is
the recent window and is never evicted, so the budget must hold the largest tail
(residual + page_size - 1 tokens); `recent` must be left unset there.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kvjax.cache import ops, quantized
from kvjax.cache.page_table import AllocStatus
from kvjax.cache.policies.base import (
    CachePolicy,
    UndefinedCombination,
    active_rows,
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
from kvjax.cache.state import PagedKVCache

__all__ = ["H2O", "H2OState", "check_budget", "evict_lowest_pages"]

# Why the attention-scoring policies refuse DeepSeek Sparse Attention (`refuse_indexer`).
_DENSE_SCORES = ("it ranks tokens by each layer's dense attention probabilities, which a DSA "
                 "model never computes (its attention reads only the indexer's top-k tokens), "
                 "so the ranking would describe another model.")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class H2OState:
    """Accumulated attention per cached slot.

    Attributes:
      scores: float32; full-precision pages `[layers, max_seqs, cache_heads, max_tokens]`
        (slot j of sequence s in (layer, head)), KIVI pages `[max_seqs, max_tokens]`
        (position j of sequence s, summed over layers and heads). Scores move with their
        tokens on eviction.
    """

    scores: Float[Array, "..."]


def check_budget(owner: str, budget, recent):
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"{owner}.budget must be an int >= 1, got {budget!r}.")
    if isinstance(recent, bool) or not isinstance(recent, int) or not 0 <= recent <= budget:
        raise ValueError(f"{owner}: the recent window must be an int in [0, budget={budget}], "
                         f"got {recent!r}.")


def kivi_min_budget(cache: PagedKVCache, pinned_pages: int = 0) -> int:
    """Smallest budget a KIVI cache can hold every sequence to: pinned pages + largest tail."""
    return pinned_pages * cache.spec.page_size + quantized.tail_capacity(cache.spec) - 1


def require_kivi_budget(owner: str, budget: int, cache: PagedKVCache,
                        pinned_pages: int = 0) -> None:
    spec = cache.spec
    need = kivi_min_budget(cache, pinned_pages)
    if budget < need:
        raise UndefinedCombination(
            f"{owner}: budget={budget} cannot be held on a KIVI cache: its full-precision tail "
            f"alone holds up to R + page_size - 1 = {quantized.tail_capacity(spec) - 1} tokens "
            f"(R={spec.quant.residual}, page_size={spec.page_size})"
            + (f" plus {pinned_pages} pinned page(s)" if pinned_pages else "")
            + f"; use budget >= {need}, a smaller residual R, or a full-precision cache.")


def evict_lowest_pages(cache: PagedKVCache, mass, over, rows, pinned_pages: int = 0,
                       pinned=None):
    """Evicts, per flagged row, the `ceil(over / page_size)` quantized pages of lowest mass.

    mass: float32[max_seqs, max_pages] (a larger mass is kept first); pages below
    `pinned_pages` and columns flagged in `pinned` (bool[max_seqs, max_pages]) are never
    evicted. Returns (cache, src, status) as `quantized.drop_pages`.
    """
    spec = cache.spec
    ps, max_pages = spec.page_size, spec.max_pages_per_seq
    n_q = cache.quant_lengths // ps
    cols = jnp.arange(max_pages, dtype=jnp.int32)[None, :]
    evictable = (cols >= pinned_pages) & (cols < n_q[:, None])
    if pinned is not None:
        evictable &= ~pinned
    k = jnp.where(rows & (over > 0), (over + ps - 1) // ps, 0)
    k = jnp.minimum(k, jnp.sum(evictable, axis=1)).astype(jnp.int32)
    order = jnp.argsort(jnp.where(evictable, mass, jnp.inf), axis=1, stable=True)
    drop = jnp.zeros(mass.shape, bool).at[
        jnp.arange(spec.max_seqs)[:, None], order].set(cols < k[:, None])
    return quantized.drop_pages(cache, drop & evictable)


def moved_scores(scores, src):
    """Per-token scores [max_seqs, max_tokens] following their tokens (src from drop_pages)."""
    moved = jnp.take_along_axis(scores, jnp.clip(src, 0, scores.shape[1] - 1), axis=1)
    return jnp.where(src >= 0, moved, 0.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class H2O(CachePolicy):
    """Heavy hitters + recent window within `budget` tokens per sequence.

    Attributes:
      budget: tokens kept per sequence (per layer and head). Default 1024.
      recent: most recent tokens always kept; None means budget // 2 (the paper's even
        split). On KIVI pages the recent window is the full-precision tail; leave None.
      scale: attention logit scale for scoring, default the model's (`attention.scale`)
        or the cache geometry's (`softmax_scale`: 1/sqrt(head_dim), MLA's own).

    On a model with sliding-window layers (`attention`, set by `bind_model`) the global
    layers are scored with the model's scale and soft cap, and the windowed layers keep
    their most recent `budget` tokens (`budget` must hold the largest window).
    """

    budget: int = 1024
    recent: int | None = None
    scale: float | None = None

    def __post_init__(self):
        check_budget("H2O", self.budget, self.n_recent)

    @property
    def n_recent(self) -> int:
        return self.budget // 2 if self.recent is None else self.recent

    def init_state(self, cache: PagedKVCache) -> H2OState:
        refuse_indexer("H2O", cache, _DENSE_SCORES)
        refuse_kivi_windows("H2O", cache, self.attention)
        require_window_budget("H2O", self.budget, self.attention)
        spec = cache.spec
        if cache.is_quantized:
            if self.recent is not None:
                raise UndefinedCombination(
                    "H2O(recent=...) on a KIVI cache: the recent window is the cache's "
                    "full-precision tail (QuantSpec.residual); leave recent unset.")
            require_kivi_budget("H2O", self.budget, cache)
            return H2OState(scores=jnp.zeros((spec.max_seqs, spec.max_tokens_per_seq),
                                             jnp.float32))
        shape = (spec.num_layers, spec.max_seqs, spec.attention.cache_heads,
                 spec.max_tokens_per_seq)
        return H2OState(scores=jnp.zeros(shape, jnp.float32))

    def fork_state(self, state: H2OState, src, dst) -> H2OState:
        axis = 0 if state.scores.ndim == 2 else 1  # KIVI: [seqs, tokens]; else [L, seqs, ...]
        x = jnp.moveaxis(state.scores, axis, 0)
        x = x.at[dst].set(x[src], mode="drop")
        return H2OState(scores=jnp.moveaxis(x, 0, axis))

    def _probs(self, cache, queries, q_lengths):
        """Per layer: probabilities summed over queries, [layers, max_seqs, q_heads, tokens],
        with the model's scale and soft cap; zeros on windowed layers (they keep their most
        recent tokens, whatever the scores)."""
        scale = score_scale(self.scale, cache, self.attention)
        cap = soft_cap_of(self.attention)
        spec = cache.spec
        local = () if self.attention is None else self.attention.windowed_layers
        shape = (spec.max_seqs, queries.shape[-2], spec.max_tokens_per_seq)
        return [jnp.zeros(shape, jnp.float32) if layer in local else
                ops.attention_probs(cache, layer, queries[layer], q_lengths, scale=scale,
                                    soft_cap=cap)
                for layer in range(spec.num_layers)]

    def _accumulate(self, cache, scores, queries, q_lengths):
        probs = self._probs(cache, queries, q_lengths)
        if cache.is_quantized:
            return scores + sum(p.sum(axis=1) for p in probs)
        heads = cache.spec.attention.cache_heads
        per_layer = [p.reshape(p.shape[0], heads, -1, p.shape[-1]).sum(axis=2) for p in probs]
        return scores + jnp.stack(per_layer)

    def _evict(self, cache, state, rows):
        if cache.is_quantized:
            mass = state.scores.reshape(cache.spec.max_seqs, cache.spec.max_pages_per_seq,
                                        -1).sum(axis=-1)
            cache, src, status = evict_lowest_pages(cache, mass, cache.lengths - self.budget,
                                                    rows)
            return cache, H2OState(scores=moved_scores(state.scores, src)), status
        if self.budget >= cache.spec.max_tokens_per_seq:  # nothing can ever be evicted
            return cache, state, ok_status(cache)
        keep, new_lengths = keep_heavy_and_recent(
            state.scores, cache.lengths, self.budget, self.n_recent, seq_axis=1
        )
        if self.attention is not None:
            keep = keep_windows(keep, cache.lengths, self.attention.windowed_layers)
        keep, new_lengths = only_rows(keep, new_lengths, cache.lengths, rows)
        cache, _, status = compact(cache, keep, new_lengths)
        moved = jnp.take_along_axis(state.scores, keep, axis=-1)
        pos = jnp.arange(self.budget)[None, :]
        moved = jnp.where(pos < cache.lengths[:, None][None, :, None], moved, 0.0)
        scores = jnp.zeros_like(state.scores).at[..., : self.budget].set(moved)
        scores = jnp.where(status.ok, scores, state.scores)
        return cache, H2OState(scores=scores), status

    def after_prefill(
        self,
        cache: PagedKVCache,
        state: H2OState,
        queries: Float[Array, "layers batch q_len q_heads head_dim"],
        q_lengths: Int[Array, " batch"],
    ) -> tuple[PagedKVCache, H2OState, AllocStatus]:
        fresh = (q_lengths > 0) & (cache.lengths == q_lengths)  # a new sequence in this slot
        fresh = fresh[:, None] if cache.is_quantized else fresh[None, :, None, None]
        scores = jnp.where(fresh, 0.0, state.scores)
        scores = self._accumulate(cache, scores, queries, q_lengths)
        return self._evict(cache, H2OState(scores=scores), q_lengths > 0)

    def after_step(
        self,
        cache: PagedKVCache,
        state: H2OState,
        queries: Float[Array, "layers batch q_heads head_dim"],
        active: Bool[Array, " batch"] | None = None,
    ) -> tuple[PagedKVCache, H2OState, AllocStatus]:
        rows = active_rows(cache, active)
        scores = self._accumulate(cache, state.scores, queries[:, :, None],
                                  rows.astype(jnp.int32))
        return self._evict(cache, H2OState(scores=scores), rows)
