"""The cache-policy interface: what a decode loop calls to evict tokens or select pages.

`kvjax.generate` (prefill, decode_step, decode_loop, generate, stream) takes
`policy=` and drives these hooks; `kvjax.cache.policies.toy` does the same
for a tiny random attention stack.

A policy is a frozen, hashable dataclass (so it can be a static argument of a
jitted step) holding only settings; everything that changes lives in a
`state` pytree the loop threads along with the cache. The loop calls the same
five hooks for every policy, with no per-policy branches:

    state = policy.init_state(cache)
    # prefill: reserve, then rotary positions for the new tokens
    positions = policy.rope_positions(cache_before_reserve, state, positions)
    ... write K/V, attend ...
    cache, state, status = policy.after_prefill(cache, state, queries, q_lengths)
    # each decode step
    positions = policy.rope_positions(cache_before_reserve, state, positions)
    ... for each layer: write K/V, then
        sel = policy.before_attention(cache, state, layer, q)
        out, lse = selected_decode_attention(q, view.k, view.v, sel)
    cache, state, status = policy.after_step(cache, state, queries, active)

`queries` are the post-RoPE queries of every layer, stacked on a leading
layer axis. The loop has them anyway (they are small: one token per
sequence in decode); policies that score tokens (H2O, SnapKV) recompute
attention probabilities from them, the others ignore them. `active` flags
the slots that decoded this step; other slots are left alone (their query
rows are ignored and none of their tokens is evicted).

Batch rows are cache slots: `queries` has `max_seqs` rows, in slot order,
and idle slots have `q_lengths == 0` (prefill) or length 0 (decode).

Two kinds of results:
  * eviction (StreamingLLM, H2O, SnapKV, PyramidKV) rewrites the cache in
    `after_prefill` / `after_step`: kept tokens are compacted to the front of
    the sequence and whole pages past the new length go back to the pool
    (see `kvjax.cache.policies.compaction`);
  * selection (Quest, and PyramidKV's per-layer budgets) returns from
    `before_attention` a `Selection`: block tables and lengths to attend over
    instead of the sequence's own, either one per sequence or one per KV head.
    `selected_decode_attention` turns either form into a plain
    `paged_decode_attention` call, so the XLA path and every kernel take it
    unchanged.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kvjax.attention import paged_decode_attention
from kvjax.cache.page_table import OK, AllocStatus
from kvjax.cache.paged import PagedKVCache

__all__ = [
    "CachePolicy",
    "NoPolicy",
    "Selection",
    "full_selection",
    "ok_status",
    "selected_decode_attention",
    "active_rows",
    "to_slots",
    "rows_selection",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Selection:
    """Which cached tokens one layer's decode attention reads.

    Attributes:
      block_tables: int32[batch, sel_heads, sel_pages]; page ids to read, in
        any order (decode attention does not depend on key order), the page
        holding a partial tail last. `sel_heads` is 1 (all KV heads read the
        same pages) or kv_heads (each KV head reads its own pages).
      lengths: int32[batch, sel_heads]; tokens to read through that table:
        full pages except possibly the last column in use.
    """

    block_tables: Int[Array, "batch sel_heads sel_pages"]
    lengths: Int[Array, "batch sel_heads"]


def full_selection(cache: PagedKVCache) -> Selection:
    """Every cached token: the sequences' own block tables and lengths."""
    return Selection(block_tables=cache.block_tables[:, None], lengths=cache.lengths[:, None])


def selected_decode_attention(
    q: Float[Array, "batch q_heads head_dim"],
    k_pages: Float[Array, "kv_heads pages page_size head_dim"],
    v_pages: Float[Array, "kv_heads pages page_size v_head_dim"],
    selection: Selection,
    **kwargs: Any,
) -> tuple[Float[Array, "batch q_heads v_head_dim"], Float[Array, "batch q_heads"]]:
    """`paged_decode_attention` over a `Selection`; kwargs go to it unchanged.

    A per-head selection is run as a single call: the pools are viewed as one
    KV head with `kv_heads * pages` pages (a free reshape), KV head h's page
    ids are offset by `h * pages`, and each (sequence, KV head) pair becomes a
    batch row carrying its group of query heads. No key or value is copied.
    """
    batch, q_heads, head_dim = q.shape
    kv_heads, num_pages = k_pages.shape[:2]
    sel_heads = selection.block_tables.shape[1]
    if selection.block_tables.shape[0] != batch or selection.lengths.shape != (batch, sel_heads):
        raise ValueError(
            f"selected_decode_attention: selection block_tables "
            f"{selection.block_tables.shape} and lengths {selection.lengths.shape} must be "
            f"[batch={batch}, sel_heads, sel_pages] and [batch, sel_heads]."
        )
    if sel_heads == 1:
        return paged_decode_attention(
            q, k_pages, v_pages, selection.lengths[:, 0], selection.block_tables[:, 0], **kwargs
        )
    if sel_heads != kv_heads:
        raise ValueError(
            f"selected_decode_attention: a selection has 1 or kv_heads={kv_heads} heads, got "
            f"{sel_heads}."
        )
    group = q_heads // kv_heads
    offset = (jnp.arange(kv_heads, dtype=jnp.int32) * num_pages)[None, :, None]
    bt = jnp.where(selection.block_tables >= 0, selection.block_tables + offset, -1)
    out, lse = paged_decode_attention(
        q.reshape(batch * kv_heads, group, head_dim),
        k_pages.reshape(1, kv_heads * num_pages, *k_pages.shape[2:]),
        v_pages.reshape(1, kv_heads * num_pages, *v_pages.shape[2:]),
        selection.lengths.reshape(-1),
        bt.reshape(batch * kv_heads, -1),
        **kwargs,
    )
    return out.reshape(batch, q_heads, -1), lse.reshape(batch, q_heads)


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


def rows_selection(
    policy: "CachePolicy",
    cache: PagedKVCache,
    state: Any,
    layer: int | Int[Array, ""],
    q: Float[Array, "batch q_heads head_dim"],
    seq_ids: Int[Array, " batch"] | None = None,
) -> Selection:
    """`policy.before_attention` for a batch whose rows are the slots `seq_ids`."""
    sel = policy.before_attention(cache, state, layer, to_slots(cache, seq_ids, q))
    if seq_ids is None:
        return sel
    return Selection(block_tables=sel.block_tables[seq_ids], lengths=sel.lengths[seq_ids])


def ok_status(cache: PagedKVCache) -> AllocStatus:
    """A success status (for hooks that allocate nothing)."""
    return AllocStatus(code=jnp.int32(OK), pages_needed=jnp.int32(0),
                       pages_free=cache.table.num_free)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CachePolicy:
    """Base class: every hook is the identity, so a subclass overrides only what it uses.

    Subclasses are frozen, keyword-only dataclasses that validate their settings
    in `__post_init__`; they are hashable and can be static arguments of
    `jax.jit`. All hooks are pure and run under jit.
    """

    def init_state(self, cache: PagedKVCache) -> Any:
        """The policy's mutable state for `cache` (a pytree of fixed-shape arrays, or None)."""
        del cache
        return None

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
        """Called once the prompt (or its last chunk) is cached and attended.

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
    ) -> Selection:
        """The tokens layer `layer`'s decode attention reads (the new token is cached already)."""
        del state, layer, q
        return full_selection(cache)

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
