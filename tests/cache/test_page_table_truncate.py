"""truncate and unshare: pages really return to the pool, shared pages are copied, invariants."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax.cache import page_table as _pt

# Jitted once per shape: eager dispatch of these small ops dominates otherwise.
pt = types.SimpleNamespace(
    init_page_table=_pt.init_page_table, check_invariants=_pt.check_invariants,
    reserve=jax.jit(_pt.reserve), fork=jax.jit(_pt.fork), truncate=jax.jit(_pt.truncate),
    unshare=jax.jit(_pt.unshare), BAD_TRUNCATE=_pt.BAD_TRUNCATE, OUT_OF_PAGES=_pt.OUT_OF_PAGES,
)


def _table(lengths, num_pages=16, max_pages=6, ps=4):
    t = pt.init_page_table(num_pages=num_pages, max_seqs=len(lengths),
                           max_pages_per_seq=max_pages, page_size=ps)
    t, _, s = pt.reserve(t, jnp.asarray(lengths, jnp.int32))
    assert int(s.code) == 0
    return t


def test_truncate_frees_trailing_pages():
    t = _table([10, 7])  # pages: seq0 -> 3 pages, seq1 -> 2 pages
    free0 = int(t.num_free)
    bt0 = np.asarray(t.block_tables)
    t2, released, s = pt.truncate(t, jnp.asarray([4, 7], jnp.int32))
    assert int(s.code) == 0
    pt.check_invariants(t2)
    # seq0 keeps 1 page: 2 pages go back.
    assert int(t2.num_free) == free0 + 2
    assert sorted(np.asarray(released)[np.asarray(released) < 16].tolist()) == sorted(
        bt0[0, 1:3].tolist())
    assert np.asarray(t2.lengths).tolist() == [4, 7]
    assert np.asarray(t2.block_tables)[0, 0] == bt0[0, 0]


def test_truncate_rejects_growth():
    t = _table([5, 3])
    t2, _, s = pt.truncate(t, jnp.asarray([6, 3], jnp.int32))
    assert int(s.code) == pt.BAD_TRUNCATE
    np.testing.assert_array_equal(t2.lengths, t.lengths)
    with pytest.raises(ValueError, match="truncate"):
        s.raise_if_error()


def test_truncate_shared_pages_only_drop_a_reference():
    t = _table([9, 0])
    t, s = pt.fork(t, jnp.asarray([0]), jnp.asarray([1]))
    free0 = int(t.num_free)
    t2, _, s = pt.truncate(t, jnp.asarray([1, 9], jnp.int32))
    pt.check_invariants(t2)
    assert int(t2.num_free) == free0  # seq1 still holds every page
    t3, _, _ = pt.truncate(t2, jnp.asarray([1, 2], jnp.int32))
    pt.check_invariants(t3)
    assert int(t3.num_free) == free0 + 2  # pages 1 and 2 of the original now unreferenced


def test_unshare_copies_shared_entries():
    t = _table([8, 0])
    t, _ = pt.fork(t, jnp.asarray([0]), jnp.asarray([1]))
    entries = jnp.zeros(t.block_tables.shape, bool).at[0, 1].set(True)
    t2, copy, s = pt.unshare(t, entries)
    assert int(s.code) == 0
    pt.check_invariants(t2)
    bt, bt2 = np.asarray(t.block_tables), np.asarray(t2.block_tables)
    assert bt2[0, 1] != bt[0, 1] and bt2[1, 1] == bt[1, 1] and bt2[0, 0] == bt[0, 0]
    src, dst = np.asarray(copy.src), np.asarray(copy.dst)
    moved = dst < t.num_pages
    assert moved.sum() == 1 and src[moved][0] == bt[0, 1] and dst[moved][0] == bt2[0, 1]


def test_unshare_all_holders_flagged_keeps_one_original():
    t = _table([4, 0, 0])
    t, _ = pt.fork(t, jnp.asarray([0, 0]), jnp.asarray([1, 2]))
    entries = jnp.zeros(t.block_tables.shape, bool).at[:, 0].set(True)
    t2, copy, s = pt.unshare(t, entries)
    pt.check_invariants(t2)
    assert int(s.pages_needed) == 2
    assert len(set(np.asarray(t2.block_tables)[:, 0].tolist())) == 3


def test_unshare_out_of_pages_changes_nothing():
    t = _table([8, 0], num_pages=3)
    t, _ = pt.fork(t, jnp.asarray([0]), jnp.asarray([1]))
    entries = jnp.ones(t.block_tables.shape, bool)
    t2, copy, s = pt.unshare(t, entries)
    assert int(s.code) == pt.OUT_OF_PAGES
    np.testing.assert_array_equal(t2.block_tables, t.block_tables)
    assert (np.asarray(copy.dst) == 3).all()


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 20), min_size=3, max_size=3), st.data())
def test_truncate_unshare_invariants(lengths, data):
    t = _table(lengths, num_pages=24)
    if lengths[2] == 0:
        t, _ = pt.fork(t, jnp.asarray([0]), jnp.asarray([2]))
    flags = data.draw(st.lists(st.booleans(), min_size=18, max_size=18))
    t, _, _ = pt.unshare(t, jnp.asarray(flags).reshape(3, 6))
    pt.check_invariants(t)
    cur = np.asarray(t.lengths)
    new = [data.draw(st.integers(0, int(n))) for n in cur]
    used_before = int(t.num_pages - t.num_free)
    t2, released, s = pt.truncate(t, jnp.asarray(new, jnp.int32))
    assert int(s.code) == 0
    pt.check_invariants(t2)
    n_rel = int((np.asarray(released) < t.num_pages).sum())
    assert int(t2.num_free) == int(t.num_free) + n_rel
    assert used_before - n_rel == int(t2.num_pages - t2.num_free)
