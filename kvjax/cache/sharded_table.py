"""A page table whose allocator respects a sharded pool: per-shard free stacks.

The pool's page ids are cut into `S = data_shards * context_shards` contiguous
ranges of `num_pages / S` pages; range k = d * C + c lives on the devices of
data shard d and context shard c (see `kvjax.sharding`). The table keeps the
global layout of `PageTable` (block tables hold global page ids, so every op
that reads the table is unchanged) and adds:

  * `num_free: int32[S]`, the free count of each shard, and `free_stack`
    cut into S segments: segment k (`free_stack[k*n : k*n + num_free[k]]`,
    n = num_pages / S) holds shard k's free pages;
  * the owner rule: entry j of sequence s is a page of shard
    `(s // (max_seqs / D)) * C + j % C`: sequences are grouped by data shard,
    and a sequence's pages go round-robin over its context shards.

Every operation keeps `kvjax.cache`'s semantics shard by shard, by running the
foundation allocator (`page_table.reserve/free`) unchanged, `vmap`-ed over
shards, on each shard's *virtual table*: the rows of its data group, the
columns j = c, c + C, ... of its context shard, page ids made local, and the
virtual length = the tokens those columns hold. A sequence's last, partly
filled page sits in exactly one shard, so copy-on-write happens inside that
shard. `reserve` stays all-or-nothing across shards. `fork` shares pages, so
source and target must be in one data group.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from kvjax.cache import page_table as pt

__all__ = [
    "ShardedPageTable",
    "init_sharded_page_table",
    "reserve",
    "fork",
    "free",
    "check_invariants",
    "tokens_on_shard",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ShardedPageTable(pt.PageTable):
    """`PageTable` with per-shard free stacks (`num_free: int32[data_shards * context_shards]`).

    Attributes (beyond `PageTable`'s):
      data_shards: sequence groups (static); `max_seqs` and `num_pages` divide by it.
      context_shards: shards one sequence's pages rotate over (static).
    """

    data_shards: int = dataclasses.field(default=1, metadata=dict(static=True))
    context_shards: int = dataclasses.field(default=1, metadata=dict(static=True))

    @property
    def num_shards(self) -> int:
        return self.data_shards * self.context_shards

    @property
    def pages_per_shard(self) -> int:
        return self.num_pages // self.num_shards

    @property
    def seqs_per_shard(self) -> int:
        return self.max_seqs // self.data_shards


def init_sharded_page_table(
    *, num_pages: int, max_seqs: int, max_pages_per_seq: int, page_size: int,
    data_shards: int, context_shards: int,
) -> ShardedPageTable:
    """An empty sharded table; raises ValueError if the shards do not divide the sizes."""
    shards = data_shards * context_shards
    if num_pages % shards:
        raise ValueError(
            f"num_pages={num_pages} must be divisible by data_shards * context_shards = "
            f"{data_shards} * {context_shards} = {shards} so that every shard owns as many pages."
        )
    if max_seqs % data_shards:
        raise ValueError(
            f"max_seqs={max_seqs} must be divisible by data_shards={data_shards} so that every "
            f"data shard holds as many sequences."
        )
    n = num_pages // shards
    # Each segment reversed so a shard hands out its lowest ids first.
    stack = np.concatenate([np.arange((k + 1) * n - 1, k * n - 1, -1) for k in range(shards)])
    return ShardedPageTable(
        block_tables=jnp.full((max_seqs, max_pages_per_seq), -1, jnp.int32),
        lengths=jnp.zeros((max_seqs,), jnp.int32),
        refcounts=jnp.zeros((num_pages,), jnp.int32),
        free_stack=jnp.asarray(stack, jnp.int32),
        num_free=jnp.full((shards,), n, jnp.int32),
        page_size=page_size,
        data_shards=data_shards,
        context_shards=context_shards,
    )


def tokens_on_shard(
    lengths: Int[Array, "..."], c: Int[Array, "..."] | int, page_size: int, context_shards: int
) -> Int[Array, "..."]:
    """Tokens at positions < `lengths` that live on context shard `c` (pages j with j % C == c).

    Those pages come first-to-last in position order and all but the
    sequence's last page are full, so these tokens are contiguous in the shard's
    compacted page list.
    """
    full = lengths // page_size
    rest = lengths % page_size
    n_full = jnp.maximum(full - c + context_shards - 1, 0) // context_shards
    return n_full * page_size + jnp.where(full % context_shards == c, rest, 0)


def _virtual(table: ShardedPageTable):
    """Per-shard virtual PageTables, stacked on a leading shard axis (local page ids)."""
    D, C = table.data_shards, table.context_shards
    S, n, R = table.num_shards, table.pages_per_shard, table.seqs_per_shard
    M = table.max_pages_per_seq
    Mc = -(-M // C)
    c = jnp.arange(C)
    cols = c[:, None] + C * jnp.arange(Mc)[None, :]  # [C, Mc]
    bt = table.block_tables.reshape(D, R, M)
    bt = jnp.take(bt, jnp.minimum(cols, M - 1), axis=2)  # [D, R, C, Mc]
    bt = jnp.where(cols[None, None] < M, bt, -1).transpose(0, 2, 1, 3).reshape(S, R, Mc)
    offset = (jnp.arange(S, dtype=jnp.int32) * n)[:, None, None]
    bt = jnp.where(bt >= 0, bt - offset, -1)
    lengths = table.lengths.reshape(D, 1, R)
    lengths = tokens_on_shard(lengths, c[None, :, None], table.page_size, C).reshape(S, R)
    stack = table.free_stack.reshape(S, n) - offset[:, :, 0]
    virtual = pt.PageTable(
        block_tables=bt.astype(jnp.int32),
        lengths=lengths.astype(jnp.int32),
        refcounts=table.refcounts.reshape(S, n),
        free_stack=stack.astype(jnp.int32),
        num_free=table.num_free,
        page_size=table.page_size,
    )
    return virtual, cols


def _from_virtual(table: ShardedPageTable, virtual: pt.PageTable, cols) -> ShardedPageTable:
    """Writes the virtual tables' block tables, refcounts and stacks back (global ids)."""
    D, C = table.data_shards, table.context_shards
    S, n, R = table.num_shards, table.pages_per_shard, table.seqs_per_shard
    M = table.max_pages_per_seq
    offset = (jnp.arange(S, dtype=jnp.int32) * n)[:, None, None]
    bt = jnp.where(virtual.block_tables >= 0, virtual.block_tables + offset, -1)
    bt = bt.reshape(D, C, R, -1).transpose(0, 2, 3, 1).reshape(D * R, -1)  # column j'C + c
    bt = bt[:, :M]
    return dataclasses.replace(
        table,
        block_tables=bt.astype(jnp.int32),
        refcounts=virtual.refcounts.reshape(-1),
        free_stack=(virtual.free_stack + offset[:, :, 0]).reshape(-1).astype(jnp.int32),
        num_free=virtual.num_free,
    )


def _status(statuses: pt.AllocStatus, extra_code=None) -> pt.AllocStatus:
    """One status from per-shard ones: the first failing shard's, else OK with totals."""
    codes = statuses.code
    if extra_code is not None:
        codes = jnp.where(extra_code != pt.OK, extra_code, codes)
    bad = codes != pt.OK
    first = jnp.argmax(bad)
    any_bad = jnp.any(bad)
    return pt.AllocStatus(
        code=jnp.where(any_bad, codes[first], pt.OK).astype(jnp.int32),
        pages_needed=jnp.where(any_bad, statuses.pages_needed[first],
                               jnp.sum(statuses.pages_needed)).astype(jnp.int32),
        pages_free=jnp.where(any_bad, statuses.pages_free[first],
                             jnp.sum(statuses.pages_free)).astype(jnp.int32),
    )


def reserve(
    table: ShardedPageTable, num_new: Int[Array, " max_seqs"]
) -> tuple[ShardedPageTable, pt.CopyPlan, pt.AllocStatus]:
    """`page_table.reserve` per shard: every new page comes from the shard that owns its slot.

    All or nothing over all shards. On OUT_OF_PAGES the status reports the
    first shard that ran out (its pages needed and free), since pages of one
    shard cannot stand in for another's. Counts are validated as in
    `page_table.reserve` (a negative one raises when concrete, BAD_COUNT traced).
    """
    D, C = table.data_shards, table.context_shards
    S, n, R = table.num_shards, table.pages_per_shard, table.seqs_per_shard
    num_new = pt.check_reserve_counts(table, num_new)
    negative = jnp.any(num_new < 0)
    # Compared as counts, not as new lengths: lengths + num_new can overflow int32.
    too_long = jnp.any(num_new > table.max_pages_per_seq * table.page_size - table.lengths)
    num_new = jnp.where(negative | too_long, 0, num_new)  # failed calls compute nothing odd
    new_len = table.lengths + num_new
    virtual, cols = _virtual(table)
    c = jnp.arange(C)[None, :, None]
    old_v = tokens_on_shard(table.lengths.reshape(D, 1, R), c, table.page_size, C)
    new_v = tokens_on_shard(new_len.reshape(D, 1, R), c, table.page_size, C)
    num_new_v = (new_v - old_v).reshape(S, R)
    virtual, copy, statuses = jax.vmap(pt.reserve)(virtual, num_new_v)
    status = _status(statuses, jnp.where(negative, pt.BAD_COUNT,
                                         jnp.where(too_long, pt.TOO_LONG, pt.OK)))
    ok = status.code == pt.OK
    new = _from_virtual(table, virtual, cols)
    new = dataclasses.replace(new, lengths=new_len)
    table = jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, table)
    offset = (jnp.arange(S, dtype=jnp.int32) * n)[:, None]
    do = ok & (copy.dst < n)
    copy = pt.CopyPlan(
        src=jnp.where(do, copy.src + offset, 0).reshape(-1).astype(jnp.int32),
        dst=jnp.where(do, copy.dst + offset, table.num_pages).reshape(-1).astype(jnp.int32),
    )
    return table, copy, status


def fork(
    table: ShardedPageTable, src: Int[Array, " n"], dst: Int[Array, " n"]
) -> tuple[ShardedPageTable, pt.AllocStatus]:
    """`page_table.fork` on the global table; source and target must share a data shard.

    Forking shares pages without copying, and a page cannot be shared across
    data shards (it lives on one), so a pair in different data groups is a
    BAD_FORK and nothing changes.
    """
    src, dst = pt.check_fork_pairs(table, src, dst)
    same_group = jnp.all(src // table.seqs_per_shard == dst // table.seqs_per_shard)
    plain = pt.PageTable(
        block_tables=table.block_tables, lengths=table.lengths, refcounts=table.refcounts,
        free_stack=table.free_stack, num_free=jnp.sum(table.num_free), page_size=table.page_size,
    )
    forked, status = pt.fork(plain, src, dst)
    ok = same_group & (status.code == pt.OK)
    new = dataclasses.replace(table, block_tables=forked.block_tables, lengths=forked.lengths,
                              refcounts=forked.refcounts)
    table = jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, table)
    status = dataclasses.replace(
        status, code=jnp.where(ok, pt.OK, pt.BAD_FORK).astype(jnp.int32))
    return table, status


def free(
    table: ShardedPageTable, seqs: Bool[Array, " max_seqs"]
) -> tuple[ShardedPageTable, Int[Array, " entries"]]:
    """`page_table.free` per shard: released pages go back onto their own shard's stack.

    Returns:
      (table, released): global ids of the released pages, padded with num_pages.
    """
    D, C = table.data_shards, table.context_shards
    S, n, R = table.num_shards, table.pages_per_shard, table.seqs_per_shard
    seqs = pt.check_free_flags(table, seqs)
    virtual, cols = _virtual(table)
    seqs_v = jnp.broadcast_to(seqs.reshape(D, 1, R), (D, C, R)).reshape(S, R)
    virtual, released = jax.vmap(pt.free)(virtual, seqs_v)
    new = _from_virtual(table, virtual, cols)
    new = dataclasses.replace(
        new,
        block_tables=jnp.where(seqs[:, None], -1, new.block_tables),
        lengths=jnp.where(seqs, 0, table.lengths),
    )
    offset = (jnp.arange(S, dtype=jnp.int32) * n)[:, None]
    released = jnp.where(released < n, released + offset, table.num_pages).reshape(-1)
    return new, released.astype(jnp.int32)


def owner_shards(table: ShardedPageTable) -> np.ndarray:
    """Host-side: int[max_seqs, max_pages], the shard that must own each table entry."""
    s = np.arange(table.max_seqs)[:, None] // table.seqs_per_shard
    j = np.arange(table.max_pages_per_seq)[None, :] % table.context_shards
    return s * table.context_shards + j


def check_invariants(table: pt.PageTable) -> None:
    """Host-side: the global allocator invariants, plus every page in its owner shard.

    A plain `PageTable` gets `page_table.check_invariants`. Raises AssertionError
    naming the breach.
    """
    if not isinstance(table, ShardedPageTable):
        pt.check_invariants(table)
        return
    S, n = table.num_shards, table.pages_per_shard
    num_free = np.asarray(table.num_free)
    stack = np.asarray(table.free_stack).reshape(S, n)
    if num_free.shape != (S,):
        raise AssertionError(f"num_free must have shape ({S},), got {num_free.shape}")
    for k in range(S):
        seg = stack[k, :num_free[k]]
        if ((seg < k * n) | (seg >= (k + 1) * n)).any():
            raise AssertionError(f"free stack of shard {k} holds foreign pages: {seg}")
    # Global invariants on an equivalent unsharded table: one stack of all free pages.
    flat = np.concatenate([stack[k, :num_free[k]] for k in range(S)])
    pad = np.full(table.num_pages - flat.size, -1)
    pt.check_invariants(pt.PageTable(
        block_tables=table.block_tables, lengths=table.lengths, refcounts=table.refcounts,
        free_stack=np.concatenate([flat, pad]).astype(np.int32),
        num_free=np.int32(flat.size), page_size=table.page_size,
    ))
    bt = np.asarray(table.block_tables)
    used = np.arange(bt.shape[1])[None, :] * table.page_size < np.asarray(table.lengths)[:, None]
    owner = owner_shards(table)
    wrong = used & (bt // n != owner)
    if wrong.any():
        s, j = np.argwhere(wrong)[0]
        raise AssertionError(
            f"sequence {s} page {j} is page {bt[s, j]} of shard {bt[s, j] // n}, but that slot "
            f"belongs to shard {owner[s, j]}"
        )


def truncate(
    table: ShardedPageTable, new_lengths: Int[Array, " max_seqs"]
) -> tuple[ShardedPageTable, Int[Array, " entries"], pt.AllocStatus]:
    """`page_table.truncate` per shard: released pages go back onto their own shard's stack.

    All or nothing: a negative new length or one past the current length changes
    nothing (BAD_TRUNCATE).
    """
    D, C = table.data_shards, table.context_shards
    S, n, R = table.num_shards, table.pages_per_shard, table.seqs_per_shard
    new_lengths = jnp.asarray(new_lengths, jnp.int32)
    ok = jnp.all((new_lengths >= 0) & (new_lengths <= table.lengths))
    virtual, cols = _virtual(table)
    c = jnp.arange(C)[None, :, None]
    new_v = tokens_on_shard(jnp.where(ok, new_lengths, table.lengths).reshape(D, 1, R), c,
                            table.page_size, C).reshape(S, R)
    virtual, released, _ = jax.vmap(pt.truncate)(virtual, new_v)
    new = _from_virtual(table, virtual, cols)
    new = dataclasses.replace(new, lengths=jnp.where(ok, new_lengths, table.lengths))
    offset = (jnp.arange(S, dtype=jnp.int32) * n)[:, None]
    released = jnp.where(released < n, released + offset, table.num_pages).reshape(-1)
    status = pt.AllocStatus(code=jnp.where(ok, pt.OK, pt.BAD_TRUNCATE).astype(jnp.int32),
                            pages_needed=jnp.int32(0),
                            pages_free=jnp.sum(new.num_free, dtype=jnp.int32))
    return new, released.astype(jnp.int32), status


def unshare(
    table: ShardedPageTable, entries: Bool[Array, "max_seqs max_pages"]
) -> tuple[ShardedPageTable, pt.CopyPlan, pt.AllocStatus]:
    """`page_table.unshare` per shard: each copy comes from the shard owning its entry.

    All or nothing over all shards (OUT_OF_PAGES names the first shard that ran out).
    """
    D = table.data_shards
    S, n, R = table.num_shards, table.pages_per_shard, table.seqs_per_shard
    M = table.max_pages_per_seq
    virtual, cols = _virtual(table)
    e = entries.reshape(D, R, M)
    e = jnp.take(e, jnp.minimum(cols, M - 1), axis=2)  # [D, R, C, Mc]
    e = (e & (cols[None, None] < M)).transpose(0, 2, 1, 3).reshape(S, R, -1)
    new_virtual, copy, statuses = jax.vmap(pt.unshare)(virtual, e)
    status = _status(statuses)
    ok = status.code == pt.OK
    new = _from_virtual(table, new_virtual, cols)
    table = jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, table)
    offset = (jnp.arange(S, dtype=jnp.int32) * n)[:, None]
    do = ok & (copy.dst < n)
    copy = pt.CopyPlan(
        src=jnp.where(do, copy.src + offset, 0).reshape(-1).astype(jnp.int32),
        dst=jnp.where(do, copy.dst + offset, table.num_pages).reshape(-1).astype(jnp.int32),
    )
    return table, copy, status
