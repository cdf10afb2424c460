"""The allocators reject arguments no call can accept, and never corrupt their state.

`page_table` and `sharded_table`: a negative token count raises a ValueError
naming it when the counts are concrete and is status BAD_COUNT (table
unchanged) under jit; a count that would overflow int32 is TOO_LONG; fork
pairs of different lengths, and arguments of the wrong shape or dtype, raise
before anything runs (also under jit: shapes are static). A random mix of
valid and invalid calls keeps `check_invariants` true after every call.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache import page_table as pt
from kvjax.cache import sharded_table as st

MAX_SEQS, MAX_PAGES, PS = 6, 4, 4


def _plain(num_pages=16):
    return pt.init_page_table(num_pages=num_pages, max_seqs=MAX_SEQS,
                              max_pages_per_seq=MAX_PAGES, page_size=PS)


def _sharded(num_pages=16):
    return st.init_sharded_page_table(num_pages=num_pages, max_seqs=MAX_SEQS,
                                      max_pages_per_seq=MAX_PAGES, page_size=PS,
                                      data_shards=2, context_shards=2)


KINDS = {
    "plain": (_plain, pt, pt.check_invariants),
    "sharded": (_sharded, st, st.check_invariants),
}
# The tables the tests start from are built by one jitted program per operation and kind
# (op by op, each call compiled every primitive it ran: most of this file's time); the
# tests themselves call the operations as before, eagerly or under jit.
_JITTED = {kind: (jax.jit(mod.reserve), jax.jit(mod.fork)) for kind, (_, mod, _) in
           KINDS.items()}


def _filled(kind, rng):
    """A table with a few sequences of random lengths, one of them forked (shared pages)."""
    make, _, check = KINDS[kind]
    reserve, fork = _JITTED[kind]
    table = make()
    lengths = np.zeros(MAX_SEQS, np.int32)
    lengths[[0, 1, 3]] = rng.integers(1, MAX_PAGES * PS // 2 + 1, 3)
    table, _, status = reserve(table, lengths)
    status.raise_if_error()
    table, status = fork(table, np.array([0], np.int32), np.array([2], np.int32))
    status.raise_if_error()
    check(table)
    return table


def _same(a, b):
    jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.mark.parametrize("kind", KINDS)
def test_negative_count_raises_when_concrete(rng, kind):
    _, mod, check = KINDS[kind]
    table = _filled(kind, rng)
    counts = rng.integers(0, 3, MAX_SEQS).astype(np.int32)
    s = int(rng.integers(0, MAX_SEQS))
    counts[s] = -int(rng.integers(1, 5))
    with pytest.raises(ValueError, match=rf"num_new\[{s}\] = {counts[s]} is negative"):
        mod.reserve(table, jnp.asarray(counts))
    check(table)


@pytest.mark.parametrize("kind", KINDS)
def test_negative_count_is_a_status_under_jit(rng, kind):
    _, mod, check = KINDS[kind]
    table = _filled(kind, rng)
    counts = rng.integers(0, 3, MAX_SEQS).astype(np.int32)
    counts[int(rng.integers(0, MAX_SEQS))] = -4
    new, copy, status = jax.jit(mod.reserve)(table, jnp.asarray(counts))
    assert int(status.code) == pt.BAD_COUNT
    with pytest.raises(ValueError, match="count of new tokens was negative"):
        status.raise_if_error()
    _same(new, table)
    assert np.all(np.asarray(copy.dst) == table.num_pages)  # nothing to copy
    check(new)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("count", [2**31 - 1, 2**31 - 3])
def test_count_that_overflows_int32_is_too_long(rng, kind, count):
    _, mod, check = KINDS[kind]
    table = _filled(kind, rng)
    counts = np.zeros(MAX_SEQS, np.int32)
    counts[1] = count  # lengths[1] + count wraps past int32's maximum
    new, _, status = jax.jit(mod.reserve)(table, jnp.asarray(counts))
    assert int(status.code) == pt.TOO_LONG
    _same(new, table)
    check(new)


@pytest.mark.parametrize("kind", KINDS)
def test_reserve_shape_and_dtype(rng, kind):
    _, mod, _ = KINDS[kind]
    table = _filled(kind, rng)
    with pytest.raises(ValueError, match=r"num_new must have shape \(max_seqs,\) = \(6,\), "
                                         r"got \(\)"):
        mod.reserve(table, jnp.int32(2))
    with pytest.raises(ValueError, match=r"got \(3,\)"):
        jax.jit(mod.reserve)(table, jnp.ones(3, jnp.int32))
    with pytest.raises(TypeError, match="num_new must be an integer array, got dtype float32"):
        mod.reserve(table, jnp.full(MAX_SEQS, 2.7, jnp.float32))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("jit", [False, True])
def test_fork_pairs_of_different_lengths_raise(rng, kind, jit):
    _, mod, check = KINDS[kind]
    table = _filled(kind, rng)
    fork = jax.jit(mod.fork) if jit else mod.fork
    with pytest.raises(ValueError, match=r"src \(1,\) and dst \(2,\) must have one length"):
        fork(table, jnp.asarray([0]), jnp.asarray([4, 5]))
    with pytest.raises(ValueError, match=r"src \(2,\) and dst \(1,\)"):
        fork(table, jnp.asarray([0, 3]), jnp.asarray([4]))
    with pytest.raises(ValueError, match=r"dst must be a scalar or a vector of slots, got shape "
                                         r"\(1, 2\)"):
        fork(table, jnp.asarray([0, 3]), jnp.asarray([[4, 5]]))
    with pytest.raises(TypeError, match="src must be integer slot ids, got dtype float32"):
        fork(table, jnp.asarray([0.0]), jnp.asarray([4]))
    check(table)
    # Scalars are one pair; vectors of one length work (slots 3-5 share a data shard).
    one, status = fork(table, jnp.int32(3), jnp.int32(4))
    status.raise_if_error()
    check(one)
    two, status = fork(table, jnp.asarray([3, 3]), jnp.asarray([4, 5]))
    status.raise_if_error()
    check(two)
    np.testing.assert_array_equal(np.asarray(two.lengths)[3:], [int(table.lengths[3])] * 3)


@pytest.mark.parametrize("kind", KINDS)
def test_free_flags_shape_and_dtype(rng, kind):
    _, mod, check = KINDS[kind]
    table = _filled(kind, rng)
    with pytest.raises(ValueError, match=r"seqs must be bool flags of shape \(max_seqs,\) = "
                                         r"\(6,\), got shape \(2,\)"):
        mod.free(table, jnp.asarray([True, False]))
    with pytest.raises(TypeError, match="seqs must be bool flags .* got dtype int32"):
        mod.free(table, jnp.asarray([0, 1, 0, 0, 0, 0], jnp.int32))
    check(table)


def test_truncate_and_unshare_shapes(rng):
    table = _filled("plain", rng)
    with pytest.raises(ValueError, match=r"new_lengths must have shape \(max_seqs,\)"):
        pt.truncate(table, jnp.asarray([1, 2], jnp.int32))
    with pytest.raises(ValueError, match=r"entries must be bool flags of shape"):
        pt.unshare(table, jnp.ones((MAX_SEQS, MAX_PAGES), jnp.int32))


@pytest.mark.parametrize("kind", KINDS)
def test_random_calls_keep_the_invariants(rng, kind):
    """Random reserve / fork / free calls under jit, a third of them invalid (negative or
    huge counts, busy, repeated or out-of-range fork slots): after each, either an OK status
    or an unchanged table, and the invariants hold."""
    make, mod, check = KINDS[kind]
    table = make()
    reserve, fork, free = jax.jit(mod.reserve), jax.jit(mod.fork), jax.jit(mod.free)
    for _ in range(60):
        op = rng.choice(["reserve", "fork", "free"], p=[0.5, 0.3, 0.2])
        if op == "reserve":
            counts = rng.integers(0, 5, MAX_SEQS)
            if rng.random() < 0.3:
                counts[rng.integers(0, MAX_SEQS)] = rng.choice([-1, -7, 2**31 - 1, 40])
            new, _, status = reserve(table, jnp.asarray(counts, jnp.int32))
        elif op == "fork":
            n = int(rng.integers(1, 3))
            src = rng.integers(-1, MAX_SEQS + 1, n)
            dst = rng.integers(-1, MAX_SEQS + 1, n)
            new, status = fork(table, jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32))
        else:
            new = free(table, jnp.asarray(rng.random(MAX_SEQS) < 0.3))[0]
            status = None
        if status is not None and int(status.code) != pt.OK:
            _same(new, table)
        check(new)
        table = new
