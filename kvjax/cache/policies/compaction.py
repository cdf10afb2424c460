"""Eviction that returns memory: compact kept tokens to the front, release trailing pages.

Masking evicted tokens saves nothing. Here eviction moves the kept tokens of
every sequence to positions 0, 1, ... of its own pages (a gather of the kept
slots, then a dense write), shortens the sequence to the kept count, and
hands every whole page past the new end back to the allocator
(`page_table.truncate`: reference counts down, free pages pushed on the free
stack). Pages another sequence shares (after `fork`) are copied before they
are written (`page_table.unshare`), so a fork never sees its sibling's
eviction.

Per-head and per-layer token sets. One block table and one length per
sequence serve every layer and KV head, but the pools are
`[layers, heads, pages, page_size, width]`: slot j of a sequence can hold a
different token in every (layer, head). So each (layer, KV head) may keep its
own set of tokens, as H2O and SnapKV want, as long as every (layer, head) of a
sequence keeps the same number of them; memory is then really freed.
Decode attention does not care which original position a slot holds, since
keys are cached after RoPE at their original positions (StreamingLLM's
cache-position scheme re-rotates moved keys instead, see `rope.py`).
Budgets that differ per layer (PyramidKV) cannot free different amounts per
layer, because a page id stands for the same slots in every layer; see
`pyramidkv.py` for how the smaller layers read fewer pages instead.
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kvjax.cache import page_table as pt
from kvjax.cache.paged import all_pools, allocator, copy_pages, set_drop
from kvjax.cache.state import PagedKVCache

__all__ = ["compact", "keep_heavy_and_recent", "keep_windows", "only_rows"]


def compact(
    cache: PagedKVCache,
    keep: Int[Array, "layers max_seqs heads budget"],
    new_lengths: Int[Array, " max_seqs"],
    *,
    rerotate_keys: Callable[[Float[Array, "..."], Int[Array, "..."]], Float[Array, "..."]]
    | None = None,
) -> tuple[PagedKVCache, Int[Array, " entries"], pt.AllocStatus]:
    """Moves the kept tokens of each sequence to its front and frees the pages left over.

    Slot j < new_lengths[s] of sequence s, in layer l and cache head h, receives
    the token now at slot keep[l, s, h, j]. Slots j >= budget are left where
    they are. Pure; jit it with the cache donated to update in place.

    Args:
      cache: the cache.
      keep: int32[layers, max_seqs, cache_heads, budget], source slots,
        strictly increasing along the last axis over j < new_lengths[s], each
        < the sequence's length (so a slot is read before it is overwritten in
        order). Entries at j >= new_lengths[s] are ignored.
      new_lengths: int32[max_seqs], tokens each sequence keeps; equal to the
        current length for sequences not evicting (then keep[..., j] == j).
      rerotate_keys: if given, `f(keys, delta)` re-rotates moved keys by
        `delta = j - keep` (cache-position RoPE); applied to the first pool only.

    Returns:
      (cache, released, status): `released` lists the pages that went back to
      the pool (padded with num_pages). Status OUT_OF_PAGES if copies of shared
      pages could not be allocated, BAD_TRUNCATE if a new length exceeds the
      current one; in both cases nothing changes.
    """
    spec = cache.spec
    ps = spec.page_size
    table = cache.table
    layers, seqs, heads, budget = keep.shape
    if (layers, seqs, heads) != (spec.num_layers, spec.max_seqs, spec.attention.cache_heads):
        raise ValueError(
            f"compact: keep must be [layers={spec.num_layers}, max_seqs={spec.max_seqs}, "
            f"heads={spec.attention.cache_heads}, budget], got {keep.shape}."
        )
    keep = keep.astype(jnp.int32)
    new_lengths = jnp.asarray(new_lengths, jnp.int32)
    j = jnp.arange(budget, dtype=jnp.int32)
    in_range = j[None, :] < new_lengths[:, None]  # [seqs, budget]
    grows = jnp.any(new_lengths > table.lengths)
    moved = (keep != j) & in_range[None, :, None, :]  # [layers, seqs, heads, budget]

    # Pages that receive moved tokens must be private to the sequence first.
    moved_any = jnp.any(moved, axis=(0, 2))  # [seqs, budget]
    first = jnp.min(jnp.where(moved_any, j[None, :], budget), axis=1)
    cols = jnp.arange(spec.max_pages_per_seq)[None, :]
    written = (cols >= (first // ps)[:, None]) & (cols < table.pages_used(new_lengths)[:, None])
    written &= ~grows
    table, copy, status = allocator(table).unshare(table, written)
    pages = copy_pages(cache.pages, copy.src, copy.dst)
    ok = status.ok & ~grows

    bt = table.block_tables
    src = jnp.clip(keep, 0, spec.max_tokens_per_seq - 1)
    s_idx = jnp.arange(seqs)[None, :, None, None]
    l_idx = jnp.arange(layers)[:, None, None, None]
    h_idx = jnp.arange(heads)[None, None, :, None]
    src_page = jnp.clip(bt[s_idx, src // ps], 0, spec.num_pages - 1)
    src_off = src % ps
    dst_page = jnp.where(ok & moved, bt[s_idx, j // ps], spec.num_pages)
    dst_off = j % ps
    new_pools = {}
    # Every pool moves with its tokens (an MLA cache's indexer keys too).
    for i, (name, pool) in enumerate(all_pools(pages).items()):
        vals = pool[l_idx, h_idx, src_page, src_off]  # [layers, seqs, heads, budget, width]
        if i == 0 and rerotate_keys is not None:
            vals = rerotate_keys(vals, j - keep)
        new_pools[name] = set_drop(pool, (l_idx, h_idx, dst_page, dst_off), vals)
    pages = dataclasses.replace(pages, **new_pools)

    table, released, t_status = allocator(table).truncate(
        table, jnp.where(ok, new_lengths, table.lengths))
    code = jnp.where(grows, pt.BAD_TRUNCATE, jnp.where(status.ok, t_status.code, status.code))
    status = pt.AllocStatus(code=code.astype(jnp.int32), pages_needed=status.pages_needed,
                            pages_free=status.pages_free)
    return dataclasses.replace(cache, pages=pages, table=table), released, status


def keep_heavy_and_recent(
    scores: Float[Array, "*lead max_tokens"],
    lengths: Int[Array, " max_seqs"],
    budget: int,
    recent: int,
    *,
    seq_axis: int,
) -> tuple[Int[Array, "*lead budget"], Int[Array, " max_seqs"]]:
    """The slots to keep when a sequence exceeds `budget`: top scorers plus the recent window.

    For a sequence of length n > budget: its last `recent` slots, plus the
    `budget - recent` highest-scoring slots among the older n - recent, in
    increasing slot order. For n <= budget: every slot, unchanged.

    Args:
      scores: float32[..., max_tokens]; one ranking per leading index
        (e.g. [layers, max_seqs, kv_heads, max_tokens]).
      lengths: int32[max_seqs].
      budget: tokens kept (static).
      recent: most recent tokens always kept, 0 <= recent <= budget (static).
      seq_axis: which leading axis of `scores` is the sequence axis.

    Returns:
      (keep int32[..., budget], new_lengths int32[max_seqs]) for `compact`.
    """
    lead = scores.shape[:-1]
    max_tokens = scores.shape[-1]
    if budget >= max_tokens:  # no sequence can exceed the budget: keep everything
        return (jnp.broadcast_to(jnp.arange(budget, dtype=jnp.int32), (*lead, budget)),
                lengths.astype(jnp.int32))
    shape = [1] * len(lead)
    shape[seq_axis] = lengths.shape[0]
    n = lengths.reshape(*shape, 1)
    pos = jnp.arange(max_tokens, dtype=jnp.int32)
    older = pos < n - recent
    heavy = budget - recent
    if heavy > 0:
        # Rank older slots by score; lax.top_k puts the lower index first on ties.
        masked = jnp.where(older, scores.astype(jnp.float32), -jnp.inf)
        _, top = jax.lax.top_k(masked, heavy)
        top = jnp.sort(top, axis=-1)
    else:
        top = jnp.zeros((*lead, 0), jnp.int32)
    window = n - recent + jnp.arange(recent, dtype=jnp.int32)
    window = jnp.broadcast_to(window, (*lead, recent))
    evicting = n > budget
    keep = jnp.where(evicting, jnp.concatenate([top, window], axis=-1),
                     jnp.arange(budget, dtype=jnp.int32))
    new_lengths = jnp.minimum(lengths, budget)
    return keep.astype(jnp.int32), new_lengths


def keep_windows(
    keep: Int[Array, "layers max_seqs heads budget"],
    lengths: Int[Array, " max_seqs"],
    layers: tuple[int, ...],
) -> Int[Array, "layers max_seqs heads budget"]:
    """`keep` with the listed (sliding-window) layers keeping their most recent tokens.

    A windowed layer's sequence of n tokens keeps slots [n - budget, n) (every slot when
    n <= budget): a contiguous suffix ending at the newest token, so positions within it
    keep their distances and the window (masked by cache position) reads the same keys.
    """
    if not layers:
        return keep
    budget = keep.shape[-1]
    start = jnp.maximum(lengths - budget, 0).astype(jnp.int32)
    recent = start[:, None, None] + jnp.arange(budget, dtype=jnp.int32)[None, None, :]
    recent = jnp.broadcast_to(recent, keep.shape[1:])
    return keep.at[jnp.asarray(layers, jnp.int32)].set(recent)


def only_rows(
    keep: Int[Array, "layers max_seqs heads budget"],
    new_lengths: Int[Array, " max_seqs"],
    lengths: Int[Array, " max_seqs"],
    rows: Bool[Array, " max_seqs"],
) -> tuple[Int[Array, "layers max_seqs heads budget"], Int[Array, " max_seqs"]]:
    """Restricts an eviction to the flagged sequences; the others keep every token in place."""
    same = jnp.broadcast_to(jnp.arange(keep.shape[-1], dtype=jnp.int32), keep.shape)
    keep = jnp.where(rows[None, :, None, None], keep, same)
    return keep, jnp.where(rows, new_lengths, lengths)
