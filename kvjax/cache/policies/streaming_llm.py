"""StreamingLLM: attention sinks plus a window of recent tokens.

Paper: Xiao, Tian, Chen, Han, Lewis, "Efficient Streaming Language Models
with Attention Sinks", arXiv 2309.17453 (ICLR 2024).

Rule (paraphrased): the first few tokens soak up a large share of attention
whatever their content ("attention sinks"), so a rolling cache that keeps the
KV of those initial tokens together with the most recent tokens stays stable
far past the training length, where a plain sliding window collapses. Their
default is 4 sink tokens; the rest of the cache budget is the recent window.

Here, once a sequence holds more than `n_sink + window` tokens, every token
between the sinks and the window is evicted: the window is compacted next to
the sinks and the pages past the new end return to the pool (see
`compaction.py`). Eviction happens after each step, so a sequence never holds
more than `n_sink + window` tokens between steps (and one more during a step).

Positions, two schemes:
  * "original" (default): keys are cached after RoPE at their position in the
    text, and queries use their text position. Moving a key in the cache does
    not change it. Distances between the query and the kept keys are the
    true ones, which may exceed the model's training length.
  * "cache" (the paper's): rotary positions are counted inside the cache, so
    the query of a cache holding n tokens sits at position n and every
    distance stays below n_sink + window + 1. The paper caches keys before
    RoPE and rotates at attention time; here keys stay cached after RoPE at
    their cache slot, and when compaction moves a key from slot s to slot j
    it is re-rotated by j - s (`rope.rerotate`), which gives the same key.
    The decode loop must take rotary positions from `rope_positions`
    (`kvjax.generate` does). Re-rotation uses plain RoPE frequencies
    theta^(-2i/d) in the rotate-half layout; models with scaled RoPE
    (Llama 3.1, YaRN) or interleaved pairs need "original".

Page kinds. Full-precision K/V and MLA latents evict token by token as above (MLA:
"original" positions only). KIVI pages evict whole quantized pages (page-granular
StreamingLLM): the pages holding the `n_sink` first tokens stay, the full-precision
tail (the most recent tokens) stays, and the oldest quantized pages after the sinks
go, as many as it takes to hold `n_sink + window` tokens; so the budget must hold the
sink pages plus the largest tail (`init_state` checks). "cache" positions would need
quantized keys re-rotated and are not defined there.
"""

import dataclasses
import functools

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kvjax.cache.page_table import AllocStatus
from kvjax.cache.policies import rope
from kvjax.cache.policies.base import CachePolicy, UndefinedCombination, active_rows, ok_status
from kvjax.cache.policies.compaction import compact, only_rows
from kvjax.cache.policies.h2o import evict_lowest_pages, require_kivi_budget
from kvjax.cache.state import PagedKVCache

__all__ = ["StreamingLLM"]

_SCHEMES = ("original", "cache")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StreamingLLM(CachePolicy):
    """Keep `n_sink` first tokens and the last `window` tokens; evict the rest.

    Attributes:
      n_sink: initial tokens always kept (paper: 4).
      window: recent tokens kept. Default 1020, so the cache holds 1024 tokens
        per sequence, one of the cache sizes the paper evaluates.
      positions: "original" or "cache" (see the module docstring).
      rope_theta: RoPE base, used by the "cache" scheme to re-rotate moved keys.
      rotary_dim: rotated channels per head for the "cache" scheme (None: all).
    """

    n_sink: int = 4
    window: int = 1020
    positions: str = "original"
    rope_theta: float = 10000.0
    rotary_dim: int | None = None

    def __post_init__(self):
        if isinstance(self.n_sink, bool) or not isinstance(self.n_sink, int) or self.n_sink < 0:
            raise ValueError(f"StreamingLLM.n_sink must be an int >= 0, got {self.n_sink!r}.")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"StreamingLLM.window must be an int >= 1, got {self.window!r}.")
        if self.positions not in _SCHEMES:
            raise ValueError(
                f"StreamingLLM.positions must be one of {_SCHEMES}, got {self.positions!r}."
            )

    @property
    def budget(self) -> int:
        """Tokens a sequence holds after every step once it is long enough."""
        return self.n_sink + self.window

    def sink_pages(self, page_size: int) -> int:
        """Quantized pages holding the sink tokens (KIVI caches)."""
        return -(-self.n_sink // page_size)

    def init_state(self, cache: PagedKVCache) -> None:
        if self.positions == "cache" and cache.spec.is_mla:
            raise UndefinedCombination(
                "StreamingLLM(positions='cache') re-rotates cached keys and supports MHA/GQA/MQA "
                "caches only; use positions='original' for MLA."
            )
        if cache.is_quantized:
            if self.positions == "cache":
                raise UndefinedCombination(
                    "StreamingLLM(positions='cache') would re-rotate quantized keys; on a KIVI "
                    "cache use positions='original' (page-granular eviction).")
            require_kivi_budget("StreamingLLM", self.budget, cache,
                                self.sink_pages(cache.spec.page_size))
        return None

    def rope_positions(
        self, cache: PagedKVCache, state: None, positions: Int[Array, "batch q_len"]
    ) -> Int[Array, "batch q_len"]:
        if self.positions == "original":
            return positions
        q_len = positions.shape[1]
        return (cache.lengths[: positions.shape[0], None]
                + jnp.arange(q_len, dtype=jnp.int32)[None, :]).astype(positions.dtype)

    def _evict(self, cache: PagedKVCache, rows) -> tuple[PagedKVCache, AllocStatus]:
        spec = cache.spec
        if cache.is_quantized:  # the oldest quantized pages after the sinks go first
            cols = jnp.arange(spec.max_pages_per_seq, dtype=jnp.float32)[None, :]
            mass = jnp.broadcast_to(cols, (spec.max_seqs, spec.max_pages_per_seq))
            cache, _, status = evict_lowest_pages(cache, mass, cache.lengths - self.budget, rows,
                                                  pinned_pages=self.sink_pages(spec.page_size))
            return cache, status
        lengths = cache.lengths
        j = jnp.arange(self.budget, dtype=jnp.int32)[None, :]
        n = lengths[:, None]
        evicting = n > self.budget
        keep = jnp.where(evicting & (j >= self.n_sink), n - self.budget + j, j)
        keep = jnp.broadcast_to(
            keep[None, :, None, :],
            (spec.num_layers, spec.max_seqs, spec.attention.cache_heads, self.budget),
        )
        rerotate = None
        if self.positions == "cache":
            head_dim = spec.attention.head_dim
            inv_freq = rope.rope_inv_freq(self.rotary_dim or head_dim, self.rope_theta)
            rerotate = functools.partial(_rerotate, inv_freq=inv_freq)
        keep, new_lengths = only_rows(keep, jnp.minimum(lengths, self.budget), lengths, rows)
        cache, _, status = compact(cache, keep, new_lengths, rerotate_keys=rerotate)
        return cache, status

    def after_prefill(
        self,
        cache: PagedKVCache,
        state: None,
        queries: Float[Array, "layers batch q_len q_heads head_dim"],
        q_lengths: Int[Array, " batch"],
    ) -> tuple[PagedKVCache, None, AllocStatus]:
        return self.after_step(cache, state, queries[:, :, 0], q_lengths > 0)

    def after_step(
        self,
        cache: PagedKVCache,
        state: None,
        queries: Float[Array, "layers batch q_heads head_dim"],
        active: Bool[Array, " batch"] | None = None,
    ) -> tuple[PagedKVCache, None, AllocStatus]:
        if cache.spec.max_tokens_per_seq <= self.budget:
            return cache, state, ok_status(cache)
        cache, status = self._evict(cache, active_rows(cache, active))
        return cache, state, status


def _rerotate(keys, delta, *, inv_freq):
    return rope.rerotate(keys, delta, inv_freq)
