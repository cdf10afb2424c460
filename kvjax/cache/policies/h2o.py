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

Here, per layer and per KV head (scores summed over the head's query group,
so every query head of the group keeps the same tokens):
  * `after_prefill` adds, for every cached token, the attention probability
    each prompt query of the last chunk gives it; `after_step` adds the new
    query's probabilities (an extra XLA pass over the keys,
    `kvjax.attention.scores.paged_attention_probs`);
  * when a sequence exceeds `budget`, it keeps its last `recent` tokens plus
    the `budget - recent` older tokens with the largest accumulated score,
    each (layer, KV head) its own set, all of the same size; kept tokens are
    compacted and whole pages return to the pool (`compaction.py`);
    evicting one token per step, as the paper does, keeps the length at most
    `budget` after every step.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kvjax.attention.scores import paged_attention_probs
from kvjax.cache.page_table import AllocStatus
from kvjax.cache.paged import PagedKVCache
from kvjax.cache.policies.base import CachePolicy, active_rows, ok_status
from kvjax.cache.policies.compaction import compact, keep_heavy_and_recent, only_rows

__all__ = ["H2O", "H2OState"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class H2OState:
    """Accumulated attention per cached slot.

    Attributes:
      scores: float32[layers, max_seqs, kv_heads, max_tokens]; slot j of
        sequence s in (layer, KV head); moves with its token on compaction.
    """

    scores: Float[Array, "layers max_seqs kv_heads max_tokens"]


def _check_budget(owner: str, budget, recent):
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"{owner}.budget must be an int >= 1, got {budget!r}.")
    if isinstance(recent, bool) or not isinstance(recent, int) or not 0 <= recent <= budget:
        raise ValueError(f"{owner}: the recent window must be an int in [0, budget={budget}], "
                         f"got {recent!r}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class H2O(CachePolicy):
    """Heavy hitters + recent window within `budget` tokens per sequence.

    Attributes:
      budget: tokens kept per sequence (per layer and KV head). Default 1024.
      recent: most recent tokens always kept; None means budget // 2 (the
        paper's even split between heavy hitters and recent tokens).
      scale: attention logit scale for scoring, default 1/sqrt(head_dim).
    """

    budget: int = 1024
    recent: int | None = None
    scale: float | None = None

    def __post_init__(self):
        _check_budget("H2O", self.budget, self.n_recent)

    @property
    def n_recent(self) -> int:
        return self.budget // 2 if self.recent is None else self.recent

    def init_state(self, cache: PagedKVCache) -> H2OState:
        spec = cache.spec
        if spec.is_mla:
            raise ValueError("H2O scores MHA/GQA/MQA caches (KVPages), not MLA latent caches.")
        shape = (spec.num_layers, spec.max_seqs, spec.attention.kv_heads,
                 spec.max_tokens_per_seq)
        return H2OState(scores=jnp.zeros(shape, jnp.float32))

    def _accumulate(self, cache, scores, queries, q_lengths):
        kv_heads = cache.spec.attention.kv_heads
        per_layer = []
        for layer in range(cache.spec.num_layers):
            p = paged_attention_probs(queries[layer], cache.pages.k[layer], cache.lengths,
                                      cache.block_tables, q_lengths, scale=self.scale)
            b, _, hq, t = p.shape
            per_layer.append(p.sum(axis=1).reshape(b, kv_heads, hq // kv_heads, t).sum(axis=2))
        return scores + jnp.stack(per_layer)

    def _evict(self, cache, state, rows):
        if self.budget >= cache.spec.max_tokens_per_seq:  # nothing can ever be evicted
            return cache, state, ok_status(cache)
        keep, new_lengths = keep_heavy_and_recent(
            state.scores, cache.lengths, self.budget, self.n_recent, seq_axis=1
        )
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
        scores = jnp.where(fresh[None, :, None, None], 0.0, state.scores)
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
