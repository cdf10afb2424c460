"""The cache-policy interface: what a decode loop calls to evict tokens or select pages.

`kvjax.generate` (prefill, decode_step, the jitted loop, stream, sample_n,
beam_search) takes `policy=` and drives these hooks, on every page kind: full-precision
K/V, MLA latents, KIVI-quantized K/V or latents.

A policy is a frozen, hashable dataclass (so it can be a static argument of a
jitted step) holding only settings; everything that changes lives in a
`state` pytree the loop threads along with the cache. The loop calls the same
five hooks for every policy, with no per-policy branches:

    state = policy.init_state(cache)
    # prefill: rotary positions for the new tokens, reserve, then the model
    positions = policy.rope_positions(cache_before_reserve, state, positions)
    ... each layer: kvjax.cache.write, then
        sel = policy.before_attention(cache, state, layer, q)   # decode only
        out, lse = kvjax.cache.attend(cache, layer, q, selection=sel, ...)
    cache, state, status = policy.after_prefill(cache, state, queries, q_lengths)
    # each decode step: the same, then
    cache, state, status = policy.after_step(cache, state, queries, active)

`queries` are the post-RoPE queries of every layer, stacked on a leading layer axis;
for MLA the absorbed queries `[q_latent, q_rope]` concatenated on the last axis (the
key they meet is `[c_KV, k_rope]`). The loop has them anyway (they are small: one
token per sequence in decode); policies that score tokens (H2O, SnapKV, PyramidKV)
recompute attention probabilities from them with `kvjax.cache.attention_probs`, the
others ignore them. `active` flags the slots that decoded this step; other slots are
left alone (their query rows are ignored and none of their tokens is evicted).

Batch rows are cache slots: `queries` has `max_seqs` rows, in slot order,
and idle slots have `q_lengths == 0` (prefill) or length 0 (decode).

Two kinds of results:
  * eviction (StreamingLLM, H2O, SnapKV, PyramidKV) rewrites the cache in
    `after_prefill` / `after_step`. On full-precision pages kept tokens are compacted to
    the front of the sequence and whole pages past the new length go back to the pool
    (`compaction.py`); on KIVI pages whole quantized pages are evicted
    (`kvjax.cache.quantized.drop_pages`) and the full-precision tail of recent tokens
    is always kept;
  * selection (Quest, and PyramidKV's per-layer budgets) returns from
    `before_attention` a `Selection`: block tables and lengths to attend over
    instead of the sequence's own, either one per sequence or one per KV head
    (`None` means "read everything"). `kvjax.cache.attend` runs it on every page kind
    (on KIVI pages a selection names quantized pages; the tail is read besides).

Models whose layers attend differently (sliding windows on some layers, soft-capped logits,
a query scale other than 1/sqrt(head_dim): Gemma 2/3, Mistral, Qwen2/3 sliding layers)
hand the policy a `LayerAttention` (`bind_model`, called by `kvjax.generate` and the
serving engine): the policies that score tokens compute each global layer's
probabilities with the model's scale and soft cap, and the windowed layers keep their
window: eviction keeps each windowed layer's most recent tokens (a contiguous suffix, so
the window, masked by cache position, sees exactly the tokens it would see without
eviction; the budget must hold the largest window) and page selection leaves them alone
(a windowed layer already reads at most its window).

A combination that is not defined (a policy on a page kind it cannot act on) raises
`UndefinedCombination` from `init_state`, naming the combination and what works. On a
cache with lightning-indexer keys (DeepSeek-V3.2's sparse attention) the policies that
score tokens by attention (H2O, SnapKV, PyramidKV) or select pages (Quest, PyramidKV)
refuse (`refuse_indexer`): the model's attention reads only the indexer's top-k tokens,
so dense attention scores describe attention it never computes, and a page selection
would compete with the indexer's token selection. StreamingLLM's positional eviction
is defined: the indexer keys move with their tokens.
"""

import dataclasses
from typing import Any

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kvjax.attention.pages import Selection
from kvjax.cache.page_table import OK, AllocStatus
from kvjax.cache.state import PagedKVCache

__all__ = [
    "CachePolicy",
    "LayerAttention",
    "NoPolicy",
    "Selection",
    "UndefinedCombination",
    "full_selection",
    "ok_status",
    "active_rows",
    "to_slots",
    "score_scale",
    "refuse_indexer",
    "bind_model",
]


class UndefinedCombination(ValueError):
    """A policy was given a page kind (or setting) on which its method is not defined."""


def refuse_indexer(policy: str, cache: PagedKVCache, why: str) -> None:
    """`UndefinedCombination` naming `policy` and `why`, if the cache holds indexer keys."""
    if cache.spec.indexer is not None:
        raise UndefinedCombination(
            f"{policy} on DeepSeek Sparse Attention (a cache with lightning-indexer keys, "
            f"CacheSpec.indexer): {why} StreamingLLM (positional eviction) composes with it; "
            f"or decode without a policy: the indexer already bounds what each step reads.")


def full_selection(cache: PagedKVCache) -> Selection:
    """Every cached token: the sequences' own block tables and lengths (quantized pages on
    a KIVI cache)."""
    return Selection(block_tables=cache.block_tables[:, None],
                     lengths=cache.table.lengths[:, None])


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerAttention:
    """How a model's layers attend, where it differs from plain causal attention.

    Attributes:
      windows: per layer, the sliding window (a query at p sees keys k with p - k <
        window) or None (a global layer).
      soft_cap: attention logits become `cap * tanh(logits / cap)`; None: off.
      scale: the logit scale; None: the cache geometry's (`softmax_scale`).
    """

    windows: tuple[int | None, ...]
    soft_cap: float | None = None
    scale: float | None = None

    def __post_init__(self):
        windows = tuple(self.windows)
        if any(w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1)
               for w in windows):
            raise ValueError(f"LayerAttention.windows must hold ints >= 1 or None, got "
                             f"{self.windows!r}.")
        object.__setattr__(self, "windows", windows)
        for name in ("soft_cap", "scale"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, int | float) and v > 0):
                raise ValueError(f"LayerAttention.{name} must be a positive number or None, "
                                 f"got {v!r}.")

    @classmethod
    def of(cls, config) -> "LayerAttention | None":
        """From a model config's `sliding_windows`, `attn_softcap` and query `scale`
        (Gemma's `query_pre_attn_scalar ** -0.5`); None where all are absent."""
        windows = getattr(config, "sliding_windows", None)
        cap = getattr(config, "attn_softcap", None)
        scale = getattr(config, "scale", None)
        scale = float(scale) if isinstance(scale, int | float) else None
        if (windows is None or all(w is None for w in windows)) and cap is None and (
                scale is None):
            return None
        return cls(windows=tuple(windows or (None,) * config.num_layers),
                   soft_cap=None if cap is None else float(cap), scale=scale)

    def window(self, layer: int) -> int | None:
        return self.windows[layer] if layer < len(self.windows) else None

    @property
    def max_window(self) -> int | None:
        ws = [w for w in self.windows if w is not None]
        return max(ws) if ws else None

    @property
    def windowed_layers(self) -> tuple[int, ...]:
        return tuple(i for i, w in enumerate(self.windows) if w is not None)


def bind_model(policy: "CachePolicy | None", model) -> "CachePolicy | None":
    """`policy` with the model's `LayerAttention` (unchanged where the model attends plainly
    or the policy already carries one)."""
    if policy is None or policy.attention is not None:
        return policy
    attention = LayerAttention.of(model.config)
    if attention is None:
        return policy
    if len(attention.windows) != model.config.num_layers:
        raise ValueError(f"bind_model: the model lists {len(attention.windows)} windows for "
                         f"{model.config.num_layers} layers.")
    return dataclasses.replace(policy, attention=attention)


def score_scale(scale: float | None, cache: PagedKVCache,
                attention: LayerAttention | None = None) -> float:
    """The logit scale a scoring policy uses: its own, the model's (`attention.scale`), or
    the cache geometry's attention scale."""
    if scale is not None:
        return scale
    if attention is not None and attention.scale is not None:
        return attention.scale
    return cache.spec.attention.softmax_scale


def soft_cap_of(attention: LayerAttention | None) -> float | None:
    return None if attention is None else attention.soft_cap


def windowed(attention: LayerAttention | None, layer) -> bool:
    """Whether a static `layer` has a sliding window; ValueError for a traced layer of a
    model with windows (its selection would differ per layer)."""
    if attention is None or not attention.windowed_layers:
        return False
    if not isinstance(layer, int):
        raise ValueError("a page-selecting policy on a model with sliding-window layers needs "
                         "static layer indices (run the layers in a Python loop, not a scan).")
    return attention.window(layer) is not None


def require_window_budget(owner: str, budget: int, attention: LayerAttention | None) -> None:
    """`UndefinedCombination` unless `budget` holds the largest window (eviction keeps each
    windowed layer's most recent `budget` tokens, so its whole window must fit)."""
    w = None if attention is None else attention.max_window
    if w is not None and budget < w:
        raise UndefinedCombination(
            f"{owner}: budget={budget} is smaller than the model's sliding window ({w} "
            f"tokens): eviction keeps each windowed layer's most recent tokens, so its whole "
            f"window must fit in the budget. Use budget >= {w}, or no policy.")


def refuse_kivi_windows(owner: str, cache: PagedKVCache,
                        attention: LayerAttention | None) -> None:
    """`UndefinedCombination` for page eviction on a KIVI cache of a model with windows: a
    quantized page is dropped from every layer at once, which would move the windowed
    layers' tokens out of their windows' positions."""
    if cache.is_quantized and attention is not None and attention.windowed_layers:
        raise UndefinedCombination(
            f"{owner} on a KIVI cache of a model with sliding-window layers (layers "
            f"{list(attention.windowed_layers)}): KIVI eviction drops whole quantized pages "
            f"from every layer, which would shift the windowed layers' tokens in their "
            f"windows. Use full-precision pages, Quest (selection, no eviction), or no policy.")


def active_rows(cache: PagedKVCache, active: Bool[Array, " batch"] | None) -> Bool[Array, " batch"]:
    """`active`, or every slot holding tokens when it is None."""
    return cache.lengths > 0 if active is None else jnp.asarray(active, bool)


def to_slots(
    cache: PagedKVCache, seq_ids: Int[Array, " batch"] | None, x: Array, axis: int = 0
) -> Array:
    """Scatters per-row values (rows = slots `seq_ids`) into slot order along `axis` (zeros
    elsewhere); identity when `seq_ids` is None (rows already are the slots)."""
    if seq_ids is None:
        return x
    x = jnp.moveaxis(x, axis, 0)
    out = jnp.zeros((cache.spec.max_seqs, *x.shape[1:]), x.dtype).at[seq_ids].set(x)
    return jnp.moveaxis(out, 0, axis)


def ok_status(cache: PagedKVCache) -> AllocStatus:
    """A success status (for hooks that allocate nothing)."""
    return AllocStatus(code=jnp.int32(OK), pages_needed=jnp.int32(0),
                       pages_free=jnp.sum(cache.table.num_free, dtype=jnp.int32))


@dataclasses.dataclass(frozen=True, kw_only=True)
class CachePolicy:
    """Base class: every hook is the identity, so a subclass overrides only what it uses.

    Subclasses are frozen, keyword-only dataclasses that validate their settings
    in `__post_init__`; they are hashable and can be static arguments of
    `jax.jit`. All hooks are pure and run under jit.

    Attributes:
      attention: how the model's layers attend (`LayerAttention`); set by `bind_model`
        (generate and the serving engine call it), None for plain causal attention.
    """

    attention: LayerAttention | None = None

    def init_state(self, cache: PagedKVCache) -> Any:
        """The policy's mutable state for `cache` (a pytree of fixed-shape arrays, or None)."""
        del cache
        return None

    def fork_state(self, state: Any, src: Int[Array, " n"], dst: Int[Array, " n"]) -> Any:
        """The state after `kvjax.cache.fork(cache, src, dst)`: slot dst[i] inherits src[i].

        Default: unchanged (stateless policies, or state indexed by page id, which a fork
        shares). Policies with per-slot state copy its rows.
        """
        del src, dst
        return state

    def rope_positions(
        self, cache: PagedKVCache, state: Any, positions: Int[Array, "batch q_len"]
    ) -> Int[Array, "batch q_len"]:
        """Rotary positions for the tokens about to be written (call before `reserve`).

        Default: the tokens' positions in the text. StreamingLLM's cache-position
        scheme returns their index in the cache instead.
        """
        del cache, state
        return positions

    def after_prefill(
        self,
        cache: PagedKVCache,
        state: Any,
        queries: Float[Array, "layers batch q_len q_heads head_dim"],
        q_lengths: Int[Array, " batch"],
    ) -> tuple[PagedKVCache, Any, AllocStatus]:
        """Called after each prefill chunk is cached and attended.

        Args:
          cache: the cache holding the prompt (donate it if jitting this alone).
          state: the policy state.
          queries: post-RoPE queries of the last prefill chunk for every layer.
          q_lengths: int32[batch], real queries per row (0 for idle slots).

        Returns:
          (cache, state, status).
        """
        del queries, q_lengths
        return cache, state, ok_status(cache)

    def before_attention(
        self,
        cache: PagedKVCache,
        state: Any,
        layer: int | Int[Array, ""],
        q: Float[Array, "batch q_heads head_dim"],
    ) -> Selection | None:
        """The pages layer `layer`'s decode attention reads (the new token is cached already).

        None (the default) reads every cached token.
        """
        del cache, state, layer, q
        return None

    def after_step(
        self,
        cache: PagedKVCache,
        state: Any,
        queries: Float[Array, "layers batch q_heads head_dim"],
        active: Bool[Array, " batch"] | None = None,
    ) -> tuple[PagedKVCache, Any, AllocStatus]:
        """Called after every decode step with the step's post-RoPE queries of every layer.

        Args:
          cache: the cache holding the step's new token.
          state: the policy state.
          queries: post-RoPE queries of the step for every layer, one row per slot.
          active: bool[batch], the slots that decoded this step; None means
            every slot holding tokens.

        Returns:
          (cache, state, status).
        """
        del queries, active
        return cache, state, ok_status(cache)


@dataclasses.dataclass(frozen=True, kw_only=True)
class NoPolicy(CachePolicy):
    """Keep and read every token (the default of a decode loop)."""
