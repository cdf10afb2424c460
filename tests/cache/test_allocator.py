"""The page allocator: hand-checked cases and hypothesis-driven random interleavings."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import kvjax as kvx
from kvjax.cache import page_table as pt

_pwrite = jax.jit(kvx.cache.paged.write_layer, donate_argnames="cache")

PAGE_SIZE = 4
SPEC = kvx.CacheSpec(
    attention=kvx.AttentionSpec(q_heads=2, kv_heads=1, head_dim=2),
    num_layers=1, page_size=PAGE_SIZE, num_pages=12, max_seqs=4, max_pages_per_seq=4,
)


def visible(cache, s):
    """The K a sequence sees: its pages gathered through the block table, cut to its length."""
    n = int(cache.lengths[s])
    pages = np.asarray(cache.block_tables[s, : -(-n // PAGE_SIZE)])
    k = np.asarray(cache.pages.k[0, 0])  # [pages, page_size, width]
    return k[pages].reshape(-1, k.shape[-1])[:n]


@functools.partial(jax.jit, donate_argnames="cache")
def grow_and_write(cache, num_new, values):
    """Reserves num_new[s] tokens per sequence and writes values[s, :num_new[s]] there."""
    old = cache.lengths
    cache, status = kvx.cache.reserve(cache, num_new)
    t = values.shape[1]
    pos = old[:, None] + jnp.arange(t)[None]
    valid = (jnp.arange(t)[None] < num_new[:, None]) & status.ok
    slots = kvx.cache.paged.token_slots(cache, pos, valid)
    k = values[:, :, None, :]
    return kvx.cache.paged.write_layer(cache, 0, slots, k, k), status


def test_reserve_allocates_on_page_boundaries():
    cache = kvx.init_cache(SPEC)
    cache, st_ = kvx.cache.reserve(cache, jnp.array([1, 4, 5, 0], jnp.int32))
    st_.raise_if_error()
    assert np.asarray(cache.table.pages_used()).tolist() == [1, 1, 2, 0]
    assert int(cache.num_free_pages) == 12 - 4
    # Growing within a page allocates nothing; crossing a boundary allocates one.
    cache, _ = kvx.cache.reserve(cache, jnp.array([3, 0, 0, 0], jnp.int32))
    assert int(cache.num_free_pages) == 8
    cache, _ = kvx.cache.reserve(cache, jnp.array([1, 0, 0, 0], jnp.int32))
    assert int(cache.num_free_pages) == 7
    pt.check_invariants(cache.table)


def test_out_of_pages_is_a_status_then_cache_full_error():
    cache = kvx.init_cache(SPEC)
    cache, status = kvx.cache.reserve(cache, jnp.array([16, 16, 16, 1], jnp.int32))
    assert int(status.code) == pt.OUT_OF_PAGES
    assert int(status.pages_needed) == 13 and int(status.pages_free) == 12
    # All or nothing: the failed call changed nothing.
    assert np.asarray(cache.lengths).tolist() == [0, 0, 0, 0]
    assert int(cache.num_free_pages) == 12
    with pytest.raises(kvx.CacheFullError, match="needs 13 new pages but only 12 are free"):
        status.raise_if_error()


def test_too_long_is_refused():
    cache = kvx.init_cache(SPEC)
    cache, status = kvx.cache.reserve(cache, jnp.array([17, 0, 0, 0], jnp.int32))
    assert int(status.code) == pt.TOO_LONG
    with pytest.raises(ValueError, match="max_pages_per_seq"):
        status.raise_if_error()
    assert int(cache.lengths[0]) == 0


def test_fork_shares_and_copy_on_write_isolates(rng):
    cache = kvx.init_cache(SPEC)
    vals = jnp.asarray(rng.standard_normal((4, 6, 2)), jnp.float32)
    cache, _ = grow_and_write(cache, jnp.array([6, 0, 0, 0], jnp.int32), vals)
    before = visible(cache, 0)
    cache, status = kvx.cache.fork(cache, jnp.array([0, 0]), jnp.array([1, 2]))
    status.raise_if_error()
    # Two pages, each now referenced three times; no page was allocated.
    assert int(cache.num_free_pages) == 10
    assert np.asarray(cache.table.refcounts)[np.asarray(cache.block_tables[0, :2])].tolist() == [
        3, 3]
    np.testing.assert_array_equal(visible(cache, 1), before)
    # Sequence 1 appends into the shared, partly filled page: it gets a copy.
    new = jnp.asarray(rng.standard_normal((4, 6, 2)), jnp.float32)
    cache, status = grow_and_write(cache, jnp.array([0, 1, 0, 0], jnp.int32), new)
    status.raise_if_error()
    np.testing.assert_array_equal(visible(cache, 0), before)
    np.testing.assert_array_equal(visible(cache, 2), before)
    np.testing.assert_array_equal(visible(cache, 1)[:6], before)
    np.testing.assert_array_equal(visible(cache, 1)[6], np.asarray(new[1, 0]))
    assert int(cache.block_tables[1, 0]) == int(cache.block_tables[0, 0])  # full page still shared
    assert int(cache.block_tables[1, 1]) != int(cache.block_tables[0, 1])
    pt.check_invariants(cache.table)


def test_fork_into_busy_slot_is_refused():
    cache = kvx.init_cache(SPEC)
    cache, _ = kvx.cache.reserve(cache, jnp.array([3, 2, 0, 0], jnp.int32))
    # Concrete arguments: refused on the host, the cache untouched and usable.
    with pytest.raises(ValueError, match="dst slot 1 holds a sequence"):
        kvx.cache.fork(cache, jnp.array([0]), jnp.array([1]))
    assert int(cache.lengths[1]) == 2
    # Traced arguments: a status, nothing changed.
    cache, status = jax.jit(kvx.cache.fork)(cache, jnp.array([0]), jnp.array([1]))
    assert int(status.code) == pt.BAD_FORK
    with pytest.raises(ValueError, match="target slot must be empty"):
        status.raise_if_error()
    assert int(cache.lengths[1]) == 2
    pt.check_invariants(cache.table)


def test_all_sharers_writing_at_once_orphan_no_page(rng):
    cache = kvx.init_cache(SPEC)
    vals = jnp.asarray(rng.standard_normal((4, 3, 2)), jnp.float32)
    cache, _ = grow_and_write(cache, jnp.array([3, 0, 0, 0], jnp.int32), vals)
    cache, _ = kvx.cache.fork(cache, jnp.array([0, 0, 0]), jnp.array([1, 2, 3]))
    cache, status = grow_and_write(cache, jnp.array([1, 1, 1, 1], jnp.int32), vals)
    status.raise_if_error()
    # Four holders of one partial page all write: three copies, the last keeps it.
    assert int(status.pages_needed) == 3
    pt.check_invariants(cache.table)
    for s in range(4):
        np.testing.assert_array_equal(visible(cache, s)[3], np.asarray(vals[s, 0]))


def test_free_returns_pages_and_scrubs(rng):
    cache = kvx.init_cache(SPEC)
    vals = jnp.asarray(rng.standard_normal((4, 9, 2)), jnp.float32) + 3.0
    cache, _ = grow_and_write(cache, jnp.array([9, 5, 0, 0], jnp.int32), vals)
    cache, _ = kvx.cache.fork(cache, jnp.array([0]), jnp.array([2]))
    before = visible(cache, 0)
    cache = kvx.cache.free(cache, jnp.array([True, False, False, False]), scrub=True)
    # Sequence 2 still holds sequence 0's pages: nothing is released or scrubbed.
    assert int(cache.num_free_pages) == 12 - 5
    np.testing.assert_array_equal(visible(cache, 2), before)
    cache = kvx.cache.free(cache, jnp.array([False, True, True, False]), scrub=True)
    assert int(cache.num_free_pages) == 12
    assert not np.any(np.asarray(cache.pages.k))
    pt.check_invariants(cache.table)


def test_jitted_write_updates_the_pool_in_place(rng):
    cache = kvx.init_cache(SPEC)
    cache, _ = kvx.cache.reserve(cache, jnp.array([2, 0, 0, 0], jnp.int32))
    slots = kvx.cache.paged.token_slots(cache, jnp.array([[0, 1]] * 4, jnp.int32),
                                  jnp.array([[True, True]] + [[False, False]] * 3))
    k = jnp.asarray(rng.standard_normal((4, 2, 1, 2)), jnp.float32)
    ptr = cache.pages.k.unsafe_buffer_pointer()
    old = cache.pages.k
    cache = _pwrite(cache, 0, slots, k, k)
    assert old.is_deleted()
    assert cache.pages.k.unsafe_buffer_pointer() == ptr
    np.testing.assert_array_equal(np.asarray(cache.pages.k[0, 0, 0, :2]), np.asarray(k[0, :, 0]))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16bit_writes_move_bits_in_place(rng, dtype):
    """bf16/f16 pools: writes land bit-exactly, in place, and (on CPU, where XLA has no
    16-bit float scatter) never widen the pool to float32; copy-on-write and scrubbing
    too."""
    spec = dataclasses.replace(SPEC, num_layers=3, dtype=dtype)
    cache = kvx.init_cache(spec)
    cache, _ = kvx.cache.reserve(cache, jnp.array([3, 2, 0, 0], jnp.int32))
    slots = kvx.cache.paged.token_slots(cache, jnp.array([[0, 1, 2]] * 4, jnp.int32),
                                  jnp.array([[True] * 3, [True, True, False]] + [[False] * 3] * 2))
    k = jnp.asarray(rng.standard_normal((4, 3, 1, 2)), dtype)
    pool_f32 = "f32[" + ",".join(map(str, cache.pages.k.shape)) + "]"
    hlo = _pwrite.lower(cache, 1, slots, k, k).compile().as_text()
    assert pool_f32 not in hlo
    ptr = cache.pages.k.unsafe_buffer_pointer()
    cache = _pwrite(cache, 1, slots, k, -k)
    assert cache.pages.k.unsafe_buffer_pointer() == ptr
    for s, n in ((0, 3), (1, 2)):
        page = int(cache.block_tables[s, 0])
        got_k = np.asarray(cache.pages.k[1, 0, page, :n]).view(np.uint16)
        got_v = np.asarray(cache.pages.v[1, 0, page, :n]).view(np.uint16)
        np.testing.assert_array_equal(got_k, np.asarray(k[s, :n, 0]).view(np.uint16))
        np.testing.assert_array_equal(got_v, np.asarray(-k[s, :n, 0]).view(np.uint16))
    assert not np.any(np.asarray(cache.pages.k[0], np.float32))  # other layers untouched
    # Fork, then a write to the shared partial page copies it (copy-on-write) first.
    cache, _ = kvx.cache.fork(cache, jnp.array([1]), jnp.array([2]))
    cache, st = kvx.cache.reserve(cache, jnp.array([0, 0, 1, 0], jnp.int32))
    st.raise_if_error()
    src, dst = int(cache.block_tables[1, 0]), int(cache.block_tables[2, 0])
    assert src != dst
    np.testing.assert_array_equal(np.asarray(cache.pages.k[1, 0, dst, :2]).view(np.uint16),
                                  np.asarray(cache.pages.k[1, 0, src, :2]).view(np.uint16))
    cache = kvx.cache.free(cache, jnp.array([True, True, True, True]), scrub=True)
    assert not np.any(np.asarray(cache.pages.k, np.float32))


def test_write_rejects_wrong_dtype_and_shape(rng):
    cache = kvx.init_cache(SPEC)
    slots = kvx.cache.paged.token_slots(cache, jnp.zeros((4, 1), jnp.int32), jnp.ones((4, 1), bool))
    k = jnp.asarray(rng.standard_normal((4, 1, 1, 2)), jnp.float32)
    with pytest.raises(TypeError, match="cache was built for float32"):
        kvx.cache.paged.write_layer(cache, 0, slots, k.astype(jnp.bfloat16), k.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match=r"k must have shape .* got \(4, 1, 2, 2\)"):
        kvx.cache.paged.write_layer(cache, 0, slots, jnp.concatenate([k, k], 2), k)
    with pytest.raises(ValueError, match=r"num_new must have shape \(max_seqs,\) = \(4,\)"):
        kvx.cache.reserve(cache, jnp.array([1, 2], jnp.int32))


# ---------------------------------------------------------------- random interleavings

ops = st.lists(
    st.one_of(
        st.tuples(st.just("grow"), st.lists(st.integers(0, 6), min_size=4, max_size=4)),
        st.tuples(st.just("fork"), st.integers(0, 3), st.integers(0, 3)),
        st.tuples(st.just("free"), st.lists(st.booleans(), min_size=4, max_size=4)),
    ),
    min_size=1, max_size=14,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, seed=st.integers(0, 2**31 - 1))
# A fork family freed in one call, then grown again from the pages it gave back: each
# shared page must go back to the pool once.
@example(ops=[("grow", [6, 3, 0, 0]), ("fork", 0, 2), ("fork", 2, 3),
              ("free", [True, False, True, True]), ("grow", [6, 6, 6, 6])], seed=1)
def test_random_interleavings_keep_invariants(ops, seed):
    rng = np.random.default_rng(seed)
    cache = kvx.init_cache(SPEC)
    expect = {s: np.zeros((0, 2), np.float32) for s in range(4)}
    for op in ops:
        if op[0] == "grow":
            n = np.array(op[1], np.int32)
            vals = rng.standard_normal((4, 6, 2)).astype(np.float32)
            cache, status = grow_and_write(cache, jnp.asarray(n), jnp.asarray(vals))
            lens = np.array([len(expect[s]) for s in range(4)])
            grow_pages = int((-(-(lens + n) // PAGE_SIZE) + (-lens // PAGE_SIZE)).sum())
            if (lens + n > SPEC.max_tokens_per_seq).any():
                assert int(status.code) == pt.TOO_LONG
            elif bool(status.ok):
                assert int(status.pages_needed) >= grow_pages
                for s in range(4):
                    expect[s] = np.concatenate([expect[s], vals[s, : n[s]]])
            else:
                assert int(status.code) == pt.OUT_OF_PAGES
                assert int(status.pages_needed) > int(status.pages_free)
                assert int(status.pages_needed) >= grow_pages
        elif op[0] == "fork":
            src, dst = op[1], op[2]
            expected_ok = src != dst and len(expect[dst]) == 0
            if not expected_ok:  # refused on the host, before the cache is donated
                with pytest.raises(ValueError, match="fork"):
                    kvx.cache.fork(cache, jnp.array([src]), jnp.array([dst]))
            else:
                cache, status = kvx.cache.fork(cache, jnp.array([src]), jnp.array([dst]))
                assert bool(status.ok)
                expect[dst] = expect[src].copy()
        else:
            mask = np.array(op[1])
            cache = kvx.cache.free(cache, jnp.asarray(mask))
            for s in np.nonzero(mask)[0]:
                expect[s] = np.zeros((0, 2), np.float32)
        pt.check_invariants(cache.table)
        # A write to a shared page never changes what another sequence sees.
        for s in range(4):
            np.testing.assert_array_equal(visible(cache, s), expect[s])
    cache = kvx.cache.free(cache, jnp.ones(4, bool))
    pt.check_invariants(cache.table)
    assert int(cache.num_free_pages) == SPEC.num_pages
