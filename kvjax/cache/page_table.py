"""The page table and its allocator: block tables, lengths, reference counts, a free stack.

All state is one fixed-shape pytree, and every operation is a pure function
that runs under `jax.jit`. Costs scale with the block table
(`max_seqs * max_pages_per_seq`), never with the number of pages in the pool:
pages are popped from and pushed onto a free stack, and reference counts are
touched only at the pages an operation names.

Invariants (checked by `check_invariants`):
  * a page is either on the free stack (refcount 0) or referenced (refcount > 0);
  * a page's refcount equals the number of block-table entries, over all
    sequences and within each sequence's length, that point at it;
  * table entries at or past `ceil(length / page_size)` are not pages the
    sequence owns; they hold -1 after a free and are never trusted.

Running out of pages is not an exception inside jit: operations return an
`AllocStatus`, leave the table unchanged when they cannot complete, and the
host raises with `status.raise_if_error()`.

Arguments are validated at the boundary: a wrong shape or dtype raises
`ValueError`/`TypeError` (also while tracing: shapes are static), and a value
no call can accept (a negative token count) raises `ValueError` when the
counts are concrete and is a status (BAD_COUNT, nothing changed) when traced.
`check_reserve_counts`, `check_fork_pairs` and `check_free_flags` are those
checks on their own, for host-side wrappers to run before donating a cache.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

__all__ = [
    "PageTable",
    "AllocStatus",
    "CacheFullError",
    "CopyPlan",
    "init_page_table",
    "reserve",
    "fork",
    "free",
    "truncate",
    "unshare",
    "assign_entries",
    "vacate_entries",
    "check_invariants",
    "check_reserve_counts",
    "check_fork_pairs",
    "check_free_flags",
]

# Status codes carried by AllocStatus.code.
OK = 0
OUT_OF_PAGES = 1
TOO_LONG = 2
BAD_FORK = 3
BAD_TRUNCATE = 4
BAD_COUNT = 5
TOO_MANY_NEW = 6


class CacheFullError(RuntimeError):
    """The page pool cannot hold what was asked for."""

    def __init__(self, pages_needed: int, pages_free: int):
        self.pages_needed = pages_needed
        self.pages_free = pages_free
        super().__init__(
            f"KV cache is full: the operation needs {pages_needed} new pages but only "
            f"{pages_free} are free. Free finished sequences, evict, or build the cache with "
            f"more pages (CacheSpec.num_pages)."
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AllocStatus:
    """Outcome of an allocator operation, returned as arrays so it works under jit.

    Attributes:
      code: int32[], 0 ok, 1 out of pages, 2 a sequence would exceed
        max_pages_per_seq * page_size tokens, 3 a fork target is in use,
        4 a truncation asked to grow a sequence or for a negative length,
        5 a reserve asked for a negative number of tokens, 6 a reserve added more
        tokens to a sequence than a window group's chunk (`kvjax.cache.window`).
      pages_needed: int32[], new pages the operation asked for.
      pages_free: int32[], pages that were free before it.
    """

    code: Int[Array, ""]
    pages_needed: Int[Array, ""]
    pages_free: Int[Array, ""]

    @property
    def ok(self) -> Bool[Array, ""]:
        return self.code == OK

    def raise_if_error(self) -> None:
        """Host-side: raises `CacheFullError` or `ValueError` if the operation failed."""
        code = int(self.code)
        if code == OUT_OF_PAGES:
            raise CacheFullError(int(self.pages_needed), int(self.pages_free))
        if code == TOO_LONG:
            raise ValueError(
                "A sequence would exceed the cache's max_pages_per_seq * page_size tokens; "
                "build the cache with a larger max_pages_per_seq."
            )
        if code == BAD_FORK:
            raise ValueError(
                "fork: every target slot must be empty (length 0), distinct, and differ from "
                "its source; free the target first."
            )
        if code == BAD_TRUNCATE:
            raise ValueError(
                "truncate: new lengths must lie in [0, current length] for every sequence."
            )
        if code == BAD_COUNT:
            raise ValueError(
                "reserve: a count of new tokens was negative; counts must be >= 0 (shorten "
                "a sequence with truncate). Nothing was reserved."
            )
        if code == TOO_MANY_NEW:
            raise ValueError(
                "reserve: a sequence would receive more tokens in one reserve than a window "
                "group's chunk (WindowGroupSpec.chunk), whose ring holds only the pages its "
                "window and one chunk reach; reserve in smaller steps or build the cache with "
                "a larger chunk. Nothing was reserved."
            )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CopyPlan:
    """Pages to copy before writing (copy-on-write); `dst == num_pages` means no copy."""

    src: Int[Array, " seqs"]
    dst: Int[Array, " seqs"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PageTable:
    """Which pages each sequence owns, and which pages are free.

    Attributes:
      block_tables: int32[max_seqs, max_pages_per_seq]; entry j of row s is the
        page holding tokens [j * page_size, (j + 1) * page_size) of sequence s.
      lengths: int32[max_seqs], tokens held by each sequence.
      refcounts: int32[num_pages], number of block-table references to each page.
      free_stack: int32[num_pages]; `free_stack[:num_free]` are the free pages,
        the top of the stack (allocated next) last.
      num_free: int32[], number of free pages.
      page_size: tokens per page (static).
    """

    block_tables: Int[Array, "max_seqs max_pages"]
    lengths: Int[Array, " max_seqs"]
    refcounts: Int[Array, " pages"]
    free_stack: Int[Array, " pages"]
    num_free: Int[Array, ""]
    page_size: int = dataclasses.field(metadata=dict(static=True))

    @property
    def num_pages(self) -> int:
        return self.refcounts.shape[0]

    @property
    def max_seqs(self) -> int:
        return self.block_tables.shape[0]

    @property
    def max_pages_per_seq(self) -> int:
        return self.block_tables.shape[1]

    def pages_used(self, lengths: Int[Array, "..."] | None = None) -> Int[Array, "..."]:
        """Pages each sequence holds: ceil(length / page_size)."""
        lengths = self.lengths if lengths is None else lengths
        return (lengths + self.page_size - 1) // self.page_size


def init_page_table(
    *, num_pages: int, max_seqs: int, max_pages_per_seq: int, page_size: int
) -> PageTable:
    """An empty table: no sequence holds a page, every page is free."""
    return PageTable(
        block_tables=jnp.full((max_seqs, max_pages_per_seq), -1, jnp.int32),
        lengths=jnp.zeros((max_seqs,), jnp.int32),
        refcounts=jnp.zeros((num_pages,), jnp.int32),
        # Reversed so that the first pages handed out are 0, 1, 2, ...
        free_stack=jnp.arange(num_pages - 1, -1, -1, dtype=jnp.int32),
        num_free=jnp.asarray(num_pages, jnp.int32),
        page_size=page_size,
    )


def _is_concrete(*xs) -> bool:
    return not any(isinstance(x, jax.core.Tracer) for x in xs)


def _int_array(op: str, name: str, x, shape: tuple[int, ...], what: str) -> Array:
    """x as an int32 array of `shape`; ValueError / TypeError naming what was given."""
    x = jnp.asarray(x)
    if x.shape != shape:
        raise ValueError(f"{op}: {name} must have shape {what} = {shape}, got {x.shape}.")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{op}: {name} must be an integer array, got dtype {x.dtype}.")
    return x.astype(jnp.int32)


def check_reserve_counts(table: PageTable, num_new) -> Int[Array, " max_seqs"]:
    """Validates `reserve`'s counts; returns them as int32[max_seqs].

    Raises:
      ValueError / TypeError: if `num_new` is not an integer vector of shape
        (max_seqs,), or (when its values are concrete) a count is negative.
    """
    num_new = _int_array("reserve", "num_new", num_new, (table.max_seqs,), "(max_seqs,)")
    if _is_concrete(num_new):
        counts = np.asarray(num_new)
        bad = np.nonzero(counts < 0)[0]
        if bad.size:
            raise ValueError(
                f"reserve: num_new[{bad[0]}] = {counts[bad[0]]} is negative; a count of new "
                f"tokens must be >= 0 (shorten a sequence with truncate)."
            )
    return num_new


def check_fork_pairs(table: PageTable, src, dst) -> tuple[Int[Array, " n"], Int[Array, " n"]]:
    """Validates `fork`'s pairs; returns (src, dst) as int32 vectors of one length.

    Pair i forks sequence src[i] into slot dst[i], so both must be integer scalars
    or vectors of the same length (no broadcasting: a source forked into n slots
    is written out n times, e.g. `jnp.full_like(dst, s)`). Which slots are usable
    (in range, empty, distinct) is the status's business (BAD_FORK).

    Raises:
      ValueError / TypeError: on other shapes or non-integer dtypes.
    """
    src, dst = jnp.asarray(src), jnp.asarray(dst)
    for name, x in (("src", src), ("dst", dst)):
        if x.ndim > 1:
            raise ValueError(f"fork: {name} must be a scalar or a vector of slots, got shape "
                             f"{x.shape}.")
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"fork: {name} must be integer slot ids, got dtype {x.dtype}.")
    src, dst = jnp.atleast_1d(src), jnp.atleast_1d(dst)
    if src.shape != dst.shape:
        raise ValueError(
            f"fork: src {src.shape} and dst {dst.shape} must have one length: pair i forks "
            f"src[i] into dst[i]. To fork one sequence s into several slots, pass "
            f"src=jnp.full_like(dst, s)."
        )
    return src.astype(jnp.int32), dst.astype(jnp.int32)


def check_free_flags(table: PageTable, seqs) -> Bool[Array, " max_seqs"]:
    """Validates `free`'s flags; returns them as bool[max_seqs].

    Raises:
      ValueError / TypeError: if `seqs` is not a bool vector of shape (max_seqs,).
    """
    seqs = jnp.asarray(seqs)
    if seqs.shape != (table.max_seqs,):
        raise ValueError(f"free: seqs must be bool flags of shape (max_seqs,) = "
                         f"({table.max_seqs},), got shape {seqs.shape}.")
    if seqs.dtype != jnp.bool_:
        raise TypeError(f"free: seqs must be bool flags (one per slot), got dtype {seqs.dtype}; "
                        f"for slot ids use jnp.zeros(max_seqs, bool).at[ids].set(True).")
    return seqs


def _pop(table: PageTable, ranks: Int[Array, "..."]) -> Int[Array, "..."]:
    """The pages at stack ranks 0, 1, ... counted from the top (rank < num_free)."""
    idx = table.num_free - 1 - ranks
    return table.free_stack[jnp.clip(idx, 0, table.num_pages - 1)]


def reserve(
    table: PageTable, num_new: Int[Array, " max_seqs"]
) -> tuple[PageTable, CopyPlan, AllocStatus]:
    """Grows each sequence by `num_new[s]` tokens, allocating the pages they need.

    Sequence s will hold positions [lengths[s], lengths[s] + num_new[s]) once the
    caller writes them; `lengths` is advanced here. If the first new token lands
    in a partly filled page that other sequences share, that page is replaced by
    a fresh copy (copy-on-write): the returned `CopyPlan` says which pages the
    caller must copy in the pools before writing. When several sharers write
    into the same shared page at once, the last of them keeps the original, so
    no page is orphaned.

    All or nothing: if a count is negative, the pool cannot supply every page,
    or a sequence would grow past `max_pages_per_seq * page_size`, nothing
    changes and the status says why.

    Args:
      table: the page table.
      num_new: int32[max_seqs], tokens to add to each sequence (>= 0).

    Returns:
      (table, copy_plan, status).

    Raises:
      ValueError / TypeError: see `check_reserve_counts` (a negative count raises
        only when concrete; traced, it is status BAD_COUNT).
    """
    ps = table.page_size
    max_seqs, max_pages = table.block_tables.shape
    num_pages = table.num_pages
    num_new = check_reserve_counts(table, num_new)
    old_len = table.lengths
    negative = jnp.any(num_new < 0)
    # Compared as counts, not as new lengths: old_len + num_new can overflow int32.
    too_long = jnp.any(num_new > max_pages * ps - old_len)
    num_new = jnp.where(negative | too_long, 0, num_new)  # failed calls compute nothing odd
    new_len = old_len + num_new
    old_np = table.pages_used(old_len)
    new_np = table.pages_used(new_len)

    # Copy-on-write candidates: writing into a partly filled, shared last page.
    last = jnp.clip(old_np - 1, 0, max_pages - 1)
    last_page = jnp.take_along_axis(table.block_tables, last[:, None], axis=1)[:, 0]
    partial = (num_new > 0) & (old_len % ps != 0)
    shared = partial & (table.refcounts[jnp.clip(last_page, 0, num_pages - 1)] > 1)
    # Among candidates sharing one page, the last one keeps it if every holder
    # of the page is copying away in this call.
    same = shared[:, None] & shared[None, :] & (last_page[:, None] == last_page[None, :])
    n_same = jnp.sum(same, axis=1)
    rank_same = jnp.sum(same & (jnp.arange(max_seqs)[None, :] < jnp.arange(max_seqs)[:, None]),
                        axis=1)
    keeps = (table.refcounts[jnp.clip(last_page, 0, num_pages - 1)] == n_same) & (
        rank_same == n_same - 1
    )
    cow = shared & ~keeps

    cols = jnp.arange(max_pages)[None, :]
    grow = (cols >= old_np[:, None]) & (cols < new_np[:, None])
    needed = jnp.concatenate([cow, grow.reshape(-1)])
    pages_needed = jnp.sum(needed, dtype=jnp.int32)
    out_of_pages = pages_needed > table.num_free
    code = jnp.where(negative, BAD_COUNT,
                     jnp.where(too_long, TOO_LONG, jnp.where(out_of_pages, OUT_OF_PAGES, OK)))
    ok = code == OK

    rank = jnp.cumsum(needed, dtype=jnp.int32) - 1
    fresh = _pop(table, rank)
    cow_fresh, grow_fresh = fresh[:max_seqs], fresh[max_seqs:].reshape(max_seqs, max_pages)

    block_tables = jnp.where(ok & grow, grow_fresh, table.block_tables)
    block_tables = jnp.where(
        (ok & cow)[:, None] & (cols == last[:, None]), cow_fresh[:, None], block_tables
    )
    # Index `num_pages` is out of range: scatters drop it, so failed or unneeded
    # updates touch nothing.
    sink = jnp.int32(num_pages)
    new_pages = jnp.where(ok & needed, fresh, sink)
    refcounts = table.refcounts.at[new_pages].set(1, mode="drop")
    refcounts = refcounts.at[jnp.where(ok & cow, last_page, sink)].add(-1, mode="drop")

    copy = CopyPlan(src=jnp.where(ok & cow, last_page, 0),
                    dst=jnp.where(ok & cow, cow_fresh, sink))
    status = AllocStatus(code=code.astype(jnp.int32), pages_needed=pages_needed,
                         pages_free=table.num_free)
    table = dataclasses.replace(
        table,
        block_tables=block_tables,
        lengths=jnp.where(ok, new_len, old_len),
        refcounts=refcounts,
        num_free=table.num_free - jnp.where(ok, pages_needed, 0),
    )
    return table, copy, status


def assign_entries(
    table: PageTable, want: Bool[Array, "max_seqs max_pages"]
) -> tuple[PageTable, Int[Array, "max_seqs max_pages"], AllocStatus]:
    """Puts a fresh page (refcount 1) at every flagged block-table entry.

    For entries the caller fills itself (a page brought back from another tier);
    lengths do not change. All or nothing: OUT_OF_PAGES changes nothing.

    Returns:
      (table, pages, status): `pages` holds the new page at each flagged entry and
      `num_pages` elsewhere (and everywhere on failure).
    """
    sink = jnp.int32(table.num_pages)
    flat = want.reshape(-1)
    pages_needed = jnp.sum(flat, dtype=jnp.int32)
    ok = pages_needed <= table.num_free
    fresh = _pop(table, jnp.cumsum(flat, dtype=jnp.int32) - 1)
    new = jnp.where(ok & flat, fresh, sink).reshape(want.shape)
    status = AllocStatus(code=jnp.where(ok, OK, OUT_OF_PAGES).astype(jnp.int32),
                         pages_needed=pages_needed, pages_free=table.num_free)
    table = dataclasses.replace(
        table,
        block_tables=jnp.where(new < sink, new, table.block_tables),
        refcounts=table.refcounts.at[new.reshape(-1)].set(1, mode="drop"),
        num_free=table.num_free - jnp.where(ok, pages_needed, 0),
    )
    return table, new, status


def vacate_entries(
    table: PageTable, drop: Bool[Array, "max_seqs max_pages"]
) -> tuple[PageTable, Int[Array, " entries"]]:
    """Drops the flagged entries' references and marks them `num_pages` (held elsewhere).

    The sequences keep their lengths: an entry holding `num_pages` stands for a page
    that lives in another tier (`kvjax.cache.host`); freeing, forking and truncating
    skip it. Pages whose count reaches zero return to the free stack.

    Returns:
      (table, released): the pages that became free, padded with `num_pages`.
    """
    table, released = _release(table, drop)
    table = dataclasses.replace(
        table, block_tables=jnp.where(drop, table.num_pages, table.block_tables))
    return table, released


def fork(
    table: PageTable, src: Int[Array, " n"], dst: Int[Array, " n"]
) -> tuple[PageTable, AllocStatus]:
    """Makes each `dst[i]` a copy of sequence `src[i]` that shares all its pages.

    No page is copied: reference counts go up, and a later write into a shared
    page copies it first (see `reserve`). Every `dst` slot must be empty,
    distinct and different from every `src`; otherwise nothing changes and the
    status code is BAD_FORK.

    Args:
      table: the page table.
      src, dst: int32[n] (or scalars), the pairs; see `check_fork_pairs`.

    Raises:
      ValueError / TypeError: if src and dst are not integer vectors of one length.
    """
    src, dst = check_fork_pairs(table, src, dst)
    n = dst.shape[0]
    distinct = jnp.sum(dst[:, None] == dst[None, :]) == n
    disjoint = ~jnp.any(dst[:, None] == src[None, :])
    in_range = jnp.all((dst >= 0) & (dst < table.max_seqs) & (src >= 0) & (src < table.max_seqs))
    empty = jnp.all(table.lengths[jnp.clip(dst, 0, table.max_seqs - 1)] == 0)
    ok = distinct & disjoint & in_range & empty

    rows = table.block_tables[src]
    lens = table.lengths[src]
    owned = jnp.arange(table.max_pages_per_seq)[None, :] < table.pages_used(lens)[:, None]
    sink = table.num_pages
    refcounts = table.refcounts.at[jnp.where(ok & owned, rows, sink)].add(1, mode="drop")
    tgt = jnp.where(ok, dst, table.max_seqs)
    table = dataclasses.replace(
        table,
        block_tables=table.block_tables.at[tgt].set(jnp.where(owned, rows, -1), mode="drop"),
        lengths=table.lengths.at[tgt].set(lens, mode="drop"),
        refcounts=refcounts,
    )
    status = AllocStatus(code=jnp.where(ok, OK, BAD_FORK).astype(jnp.int32),
                         pages_needed=jnp.int32(0), pages_free=table.num_free)
    return table, status


def free(
    table: PageTable, seqs: Bool[Array, " max_seqs"]
) -> tuple[PageTable, Int[Array, " entries"]]:
    """Frees the sequences flagged in `seqs`; pages whose count reaches 0 return to the pool.

    Returns:
      (table, released): `released` lists the pages that became free, padded
      with `num_pages`; pass it to a scrub to zero them.

    Raises:
      ValueError / TypeError: if `seqs` is not bool[max_seqs].
    """
    seqs = check_free_flags(table, seqs)
    owned = seqs[:, None] & _owned(table, table.lengths)
    table, released = _release(table, owned)
    table = dataclasses.replace(
        table,
        block_tables=jnp.where(seqs[:, None], -1, table.block_tables),
        lengths=jnp.where(seqs, 0, table.lengths),
    )
    return table, released


def _owned(table: PageTable, lengths: Int[Array, " max_seqs"]) -> Bool[Array, "max_seqs max_pages"]:
    """Block-table entries a sequence of the given length holds."""
    cols = jnp.arange(table.max_pages_per_seq)[None, :]
    return cols < table.pages_used(lengths)[:, None]


def _release(
    table: PageTable, drop: Bool[Array, "max_seqs max_pages"]
) -> tuple[PageTable, Int[Array, " entries"]]:
    """Drops the block-table references flagged in `drop` (block tables left as they are).

    Reference counts go down by one per dropped entry; pages that reach zero are
    pushed onto the free stack once each, even when several dropped entries
    name them.
    """
    sink = table.num_pages
    refs = jnp.where(drop, table.block_tables, sink).reshape(-1)
    refcounts = table.refcounts.at[refs].add(-1, mode="drop")
    # A page dropped by several entries must be pushed once: sort and keep the
    # first of each run.
    refs = jnp.sort(refs)
    first = jnp.concatenate([jnp.array([True]), refs[1:] != refs[:-1]])
    hit = first & (refs < sink)
    released_mask = hit & (refcounts[jnp.clip(refs, 0, sink - 1)] == 0)
    released = jnp.where(released_mask, refs, sink)
    pos = table.num_free + jnp.cumsum(released_mask, dtype=jnp.int32) - 1
    free_stack = table.free_stack.at[jnp.where(released_mask, pos, sink)].set(
        released, mode="drop"
    )
    table = dataclasses.replace(
        table,
        refcounts=refcounts,
        free_stack=free_stack,
        num_free=table.num_free + jnp.sum(released_mask, dtype=jnp.int32),
    )
    return table, released


def truncate(
    table: PageTable, new_lengths: Int[Array, " max_seqs"]
) -> tuple[PageTable, Int[Array, " entries"], AllocStatus]:
    """Shortens sequences to `new_lengths`; whole pages past the new end return to the pool.

    Tokens at positions >= new_lengths[s] are dropped. A page that other
    sequences still share only loses this sequence's reference; a page whose
    count reaches 0 is pushed onto the free stack. The partly filled last page
    that remains is kept (its stale tail is masked by length and overwritten
    by later writes; `reserve` copies it first if it is shared).

    All or nothing: if any new length is negative or longer than the current
    one, nothing changes and the status code is BAD_TRUNCATE.

    Returns:
      (table, released, status): `released` lists the pages that became free,
      padded with `num_pages`.
    """
    new_lengths = _int_array("truncate", "new_lengths", new_lengths, (table.max_seqs,),
                             "(max_seqs,)")
    ok = jnp.all((new_lengths >= 0) & (new_lengths <= table.lengths))
    drop = ok & _owned(table, table.lengths) & ~_owned(table, new_lengths)
    table, released = _release(table, drop)
    table = dataclasses.replace(
        table,
        block_tables=jnp.where(drop, -1, table.block_tables),
        lengths=jnp.where(ok, new_lengths, table.lengths),
    )
    status = AllocStatus(code=jnp.where(ok, OK, BAD_TRUNCATE).astype(jnp.int32),
                         pages_needed=jnp.int32(0), pages_free=table.num_free)
    return table, released, status


def unshare(
    table: PageTable, entries: Bool[Array, "max_seqs max_pages"]
) -> tuple[PageTable, CopyPlan, AllocStatus]:
    """Gives each flagged block-table entry a private page if its page is shared (copy-on-write).

    Use before writing into pages other than a sequence's growing tail (e.g.
    compacting kept tokens after an eviction). Entries past a sequence's
    length are ignored. An entry whose page has refcount 1 keeps it. When
    every holder of a shared page is flagged, the last of them (in row-major
    order) keeps the original so that no page is orphaned.

    All or nothing: if the pool cannot supply the copies, nothing changes and
    the status code is OUT_OF_PAGES.

    Returns:
      (table, copy_plan, status): `copy_plan` has `max_seqs * max_pages`
      entries; copy page `src[i]` to `dst[i]` in every pool before writing
      (`dst == num_pages` means no copy).
    """
    entries = jnp.asarray(entries)
    if entries.shape != table.block_tables.shape or entries.dtype != jnp.bool_:
        raise ValueError(f"unshare: entries must be bool flags of shape (max_seqs, max_pages) = "
                         f"{table.block_tables.shape}, got {entries.dtype}{list(entries.shape)}.")
    num_pages = table.num_pages
    sink = jnp.int32(num_pages)
    bt = table.block_tables
    flat_bt = bt.reshape(-1)
    safe = jnp.clip(flat_bt, 0, num_pages - 1)
    flagged = (entries & _owned(table, table.lengths)).reshape(-1)
    flagged &= table.refcounts[safe] > 1
    target = jnp.where(flagged, flat_bt, sink)
    # Scratch counters indexed by page id: int32[num_pages], no page data touched.
    n_flagged = jnp.zeros((num_pages,), jnp.int32).at[target].add(1, mode="drop")
    idx = jnp.arange(flat_bt.shape[0], dtype=jnp.int32)
    last_holder = jnp.full((num_pages,), -1, jnp.int32).at[target].max(idx, mode="drop")
    keeps = flagged & (table.refcounts[safe] == n_flagged[safe]) & (last_holder[safe] == idx)
    cow = flagged & ~keeps
    pages_needed = jnp.sum(cow, dtype=jnp.int32)
    ok = pages_needed <= table.num_free
    fresh = _pop(table, jnp.cumsum(cow, dtype=jnp.int32) - 1)
    do = ok & cow
    free_before = table.num_free
    refcounts = table.refcounts.at[jnp.where(do, fresh, sink)].set(1, mode="drop")
    refcounts = refcounts.at[jnp.where(do, flat_bt, sink)].add(-1, mode="drop")
    table = dataclasses.replace(
        table,
        block_tables=jnp.where(do, fresh, flat_bt).reshape(bt.shape),
        refcounts=refcounts,
        num_free=table.num_free - jnp.where(ok, pages_needed, 0),
    )
    copy = CopyPlan(src=jnp.where(do, flat_bt, 0), dst=jnp.where(do, fresh, sink))
    status = AllocStatus(code=jnp.where(ok, OK, OUT_OF_PAGES).astype(jnp.int32),
                         pages_needed=pages_needed, pages_free=free_before)
    return table, copy, status


def check_invariants(table: PageTable, elsewhere: np.ndarray | None = None) -> None:
    """Host-side check of the allocator invariants; raises AssertionError naming a breach.

    `elsewhere` (int[max_seqs], optional): each sequence's leading entries that live in
    another tier; they must hold `num_pages` and count for no page.
    """
    bt = np.asarray(table.block_tables)
    lengths = np.asarray(table.lengths)
    rc = np.asarray(table.refcounts)
    stack = np.asarray(table.free_stack)
    num_free = int(table.num_free)
    num_pages = rc.shape[0]
    max_pages = bt.shape[1]
    ps = table.page_size

    if (lengths < 0).any() or (lengths > max_pages * ps).any():
        raise AssertionError(f"lengths out of range [0, {max_pages * ps}]: {lengths}")
    counts = np.zeros(num_pages, np.int64)
    for s in range(bt.shape[0]):
        n = -(-int(lengths[s]) // ps)
        away = 0 if elsewhere is None else int(elsewhere[s])
        if away and not (bt[s, :away] == num_pages).all():
            raise AssertionError(f"sequence {s}: its first {away} entries live in another "
                                 f"tier but hold pages {bt[s, :away]}")
        row = bt[s, away:n]
        n -= away
        if ((row < 0) | (row >= num_pages)).any():
            raise AssertionError(f"sequence {s} points outside the pool: {row}")
        if len(set(row.tolist())) != n:
            raise AssertionError(f"sequence {s} holds a page twice: {row}")
        np.add.at(counts, row, 1)
    if not (counts == rc).all():
        bad = np.nonzero(counts != rc)[0][:5]
        raise AssertionError(
            f"refcounts disagree with the block tables at pages {bad}: "
            f"refcounts {rc[bad]}, references {counts[bad]}"
        )
    free_pages = stack[:num_free]
    if len(set(free_pages.tolist())) != num_free:
        raise AssertionError(f"free stack holds a page twice: {sorted(free_pages.tolist())}")
    if (rc[free_pages] != 0).any():
        raise AssertionError("a page on the free stack is referenced")
    if num_free + int((rc > 0).sum()) != num_pages:
        raise AssertionError(
            f"{num_free} free + {(rc > 0).sum()} referenced != {num_pages} pages: a page is lost"
        )
