"""The per-shard allocator: kvjax.cache semantics per shard, pages always in their owner shard."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache import (
    CacheFullError,
    check_invariants,
    fork,
    free,
    init_cache,
    page_table,
    reserve,
    write,
)
from kvjax.cache import quantized as qz
from kvjax.cache import sharded_table as st
from kvjax.sharding import init_sharded_cache
from kvjax.specs import AttentionSpec, CacheSpec, QuantSpec
from tests.cache.policies.helpers import dense_kv
from tests.sharding.helpers import filled_cache, gqa_spec, make_plan, view

_reserve = jax.jit(st.reserve)
_fork = jax.jit(st.fork)
_free = jax.jit(st.free)


def _table(D, C, num_pages=48, max_seqs=6, max_pages=8, page_size=4):
    return st.init_sharded_page_table(num_pages=num_pages, max_seqs=max_seqs,
                                      max_pages_per_seq=max_pages, page_size=page_size,
                                      data_shards=D, context_shards=C)


@pytest.mark.parametrize("shards", [(1, 1), (2, 1), (1, 3), (2, 3)])
def test_random_reserve_fork_free_keep_invariants_and_owners(shards, rng):
    D, C = shards
    table = _table(D, C)
    R = table.seqs_per_shard
    lengths = np.zeros(table.max_seqs, np.int64)  # host model of the lengths
    for _ in range(30):
        op = rng.choice(["reserve", "reserve", "fork", "free"])
        if op == "reserve":
            num_new = rng.integers(0, 7, table.max_seqs) * (rng.random(table.max_seqs) < 0.6)
            new, copy, status = _reserve(table, jnp.asarray(num_new, jnp.int32))
            if int(status.code) == page_table.OK:
                lengths += num_new
                # Copies stay inside one shard: source and target pages share an owner.
                do = np.asarray(copy.dst) < table.num_pages
                n = table.pages_per_shard
                assert (np.asarray(copy.src)[do] // n == np.asarray(copy.dst)[do] // n).all()
            else:  # all or nothing
                jax.tree.map(np.testing.assert_array_equal, new, table)
            table = new
        elif op == "fork":
            d = rng.integers(D)
            src, dst = rng.choice(np.arange(d * R, (d + 1) * R), 2, replace=False)
            table, status = _fork(table, jnp.asarray([src]), jnp.asarray([dst]))
            if int(status.code) == page_table.OK:
                lengths[dst] = lengths[src]
        else:
            seqs = rng.random(table.max_seqs) < 0.3
            table, _ = _free(table, jnp.asarray(seqs))
            lengths[seqs] = 0
        np.testing.assert_array_equal(np.asarray(table.lengths), lengths)
        st.check_invariants(table)


def test_fork_across_data_shards_is_refused():
    table = _table(2, 1)
    table, _, status = _reserve(table, jnp.asarray([5, 0, 0, 0, 0, 0], jnp.int32))
    status.raise_if_error()
    new, status = _fork(table, jnp.asarray([0]), jnp.asarray([3]))  # rows 0-2 | rows 3-5
    assert int(status.code) == page_table.BAD_FORK
    jax.tree.map(np.testing.assert_array_equal, new, table)


def test_one_full_shard_fails_the_whole_reserve():
    # 2 data shards of 8 pages; shard 0's sequence wants 9 pages while shard 1 has room.
    table = _table(2, 1, num_pages=16, max_seqs=2, max_pages=16)
    new, _, status = _reserve(table, jnp.asarray([36, 4], jnp.int32))
    with pytest.raises(CacheFullError, match="needs 9 new pages but only 8 are free"):
        status.raise_if_error()
    jax.tree.map(np.testing.assert_array_equal, new, table)


def test_unsharded_table_allocates_like_the_foundation(rng):
    # With one shard the sharded allocator must hand out the same pages as page_table.
    plain = page_table.init_page_table(num_pages=48, max_seqs=6, max_pages_per_seq=8,
                                       page_size=4)
    sharded = _table(1, 1)
    for _ in range(6):
        num_new = jnp.asarray(rng.integers(0, 6, 6), jnp.int32)
        plain, _, s1 = jax.jit(page_table.reserve)(plain, num_new)
        sharded, _, s2 = _reserve(sharded, num_new)
        assert int(s1.code) == int(s2.code)
        seqs = jnp.asarray(rng.random(6) < 0.2)
        plain, _ = jax.jit(page_table.free)(plain, seqs)
        sharded, _ = _free(sharded, seqs)
        np.testing.assert_array_equal(plain.block_tables, sharded.block_tables)
        np.testing.assert_array_equal(plain.free_stack, sharded.free_stack)


def test_cache_entry_points_dispatch_and_copy_on_write_stays_local(rng):
    # kvjax.cache.reserve/fork/free on a sharded cache: fork a sequence whose last page is
    # partial, grow both; the copy lands in the same shard and carries the tokens.
    plan = make_plan((2, 2), ("data", "context"), ("sequences", "context"))
    spec = gqa_spec()
    lengths = np.array([6, 0, 0, 0, 9, 0, 0, 0], np.int32)
    cache = filled_cache(spec, plan, lengths, rng)
    before = view(cache, 0)
    cache, status = fork(cache, jnp.asarray([4]), jnp.asarray([5]))
    status.raise_if_error()
    num_new = jnp.asarray([0, 0, 0, 0, 1, 1, 0, 0], jnp.int32)
    cache, status = reserve(cache, num_new)
    status.raise_if_error()
    st.check_invariants(cache.table)
    after = view(cache, 0)
    last_a, last_b = after.block_tables[4, 2], after.block_tables[5, 2]
    assert last_a != last_b  # one of them got a copy
    n = spec.num_pages // 4
    assert last_a // n == last_b // n == before.block_tables[4, 2] // n
    np.testing.assert_array_equal(after.k[:, last_a, :1], after.k[:, last_b, :1])
    cache = free(cache, jnp.asarray(np.arange(8) == 4))
    st.check_invariants(cache.table)
    # Left: sequence 0 (2 pages) and the fork (3 pages, two of them once shared).
    assert int(jnp.sum(cache.table.num_free)) == spec.num_pages - 5


def test_init_sharded_cache_table_kind():
    spec = gqa_spec()
    heads_only = init_sharded_cache(spec, make_plan((8,), ("model",), ("heads",)))
    assert type(heads_only.table) is page_table.PageTable
    seq = init_sharded_cache(spec, make_plan((8,), ("data",), ("sequences",)))
    assert isinstance(seq.table, st.ShardedPageTable)
    assert seq.table.num_free.shape == (8,)
    assert dataclasses.asdict(seq.spec) == dataclasses.asdict(spec)


@pytest.mark.parametrize("forked", [False, True])
def test_kivi_page_eviction_keeps_context_shard_owners_and_contents(forked, rng):
    """Evicting whole KIVI pages on a context-sharded cache moves the kept pages' contents,
    not their ids: every column still holds a page of its own shard, the freed pages go
    back to their owners' stacks, and the sequences read back what the same eviction
    leaves on one device (a fork's pages untouched)."""
    spec = CacheSpec(attention=AttentionSpec(q_heads=4, kv_heads=2, head_dim=8), num_layers=2,
                     page_size=4, num_pages=48, max_seqs=3, max_pages_per_seq=12,
                     quant=QuantSpec(bits=4, group_size=4, residual=4))
    plan = make_plan((8,), ("context",), ("context",))
    lengths = np.array([41, 30, 0], np.int32)
    a = jnp.asarray(rng.standard_normal((2, 3, 41, 2, 8)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((2, 3, 41, 2, 8)), jnp.float32)

    @jax.jit
    def fill(cache):
        cache, status = reserve(cache, jnp.asarray(lengths))
        for layer in range(spec.num_layers):
            cache = write(cache, layer, a[layer], b[layer], q_lengths=jnp.asarray(lengths))
        return cache, status

    caches = []
    for cache in (init_sharded_cache(spec, plan), init_cache(spec)):
        cache, status = fill(cache)
        status.raise_if_error()
        if forked:
            cache, status = fork(cache, jnp.asarray([0]), jnp.asarray([2]))
            status.raise_if_error()
        caches.append(cache)
    # Seq 0 (9 quantized pages) loses random pages, at least the first; seq 1 (6) its
    # second; the fork (seq 2) none.
    drop = rng.random((3, 12)) < 0.4
    drop[0, 0], drop[1], drop[2] = True, np.arange(12) == 1, False
    outs = [jax.jit(qz.drop_pages)(cache, jnp.asarray(drop)) for cache in caches]
    (sharded, src_s, st_s), (plain, src_p, st_p) = outs
    st_s.raise_if_error()
    st_p.raise_if_error()
    check_invariants(sharded)  # KIVI counts, allocator invariants and every page in its owner shard
    np.testing.assert_array_equal(np.asarray(src_s), np.asarray(src_p))
    np.testing.assert_array_equal(np.asarray(sharded.lengths), np.asarray(plain.lengths))
    np.testing.assert_array_equal(np.asarray(sharded.quant_lengths),
                                  np.asarray(plain.quant_lengths))
    assert int(sharded.lengths[0]) < 41 and int(sharded.lengths[1]) == 26
    for got, want in zip(dense_kv(sharded), dense_kv(plain), strict=True):
        np.testing.assert_array_equal(got, want)
    if forked:  # the fork still reads the 41 tokens it had
        for got, want in zip(dense_kv(sharded), dense_kv(caches[0]), strict=True):
            np.testing.assert_array_equal(got[:, 2], want[:, 2])
