"""The serving engine's host tier on window-only pages (`CacheConfig(window_pages=True)` and
`Engine(host_pages=...)`): a preempted request is parked with its windowed layers' rings
(`kvjax.cache.host.swap_out` copies each ring's pages to the tier, `swap_in` brings them
back into fresh ring pages) and continues where it stopped.

The tiny model of test_engine_window_pages (a windowed layer seeing 6 tokens, then a global
layer; 4-token pages, 8-token chunks, rings of 4 pages): three requests of 20 to 27 prompt
tokens and 24 to 30 new ones (past 3 windows) on a main pool of 16 pages, which holds one
or two of them: the engine swaps rows out and back in (no recompute), each request's tokens
equal `kvjax.generate` on the full-context cache, and the engine's invariant check (rings
included) passes after every step. Below the engine, `swap_out` / `swap_in` move two
sequences' rings (one with a hole left by a truncation) out and crosswise back in: the
keys and values each ring holds, its holes and its length come back exactly, and the
allocator's invariants hold after every move.
"""

import jax
import numpy as np
import pytest

import kvjax.generate as gen
from kvjax.cache import host, window
from kvjax.cache import ops as cache_ops
from kvjax.serve import Engine
from tests.generate.test_window_pages import tiny
from tests.serve.engine_helpers import _drive

WINDOW, PAGE, CHUNK = 6, 4, 8


@pytest.fixture(scope="module")
def model_params():
    return tiny((WINDOW, None))


def test_swapped_requests_keep_their_rings_and_tokens(model_params, rng):
    model, params = model_params
    prompts = [rng.integers(0, 64, int(n)).tolist() for n in (27, 20, 23)]
    max_new = [30, 24, 28]
    ref = gen.generate(model, params, prompts, key=jax.random.key(0), max_new_tokens=30,
                       chunk_size=CHUNK, cache=gen.CacheConfig(page_size=PAGE))
    want = [t[:m] for t, m in zip(ref.sequences(), max_new, strict=True)]
    engine = Engine(model, params, max_seqs=3, max_seq_len=64, chunk_size=CHUNK,
                    prefill_rows=1, prefix_caching=False, host_pages=48, host_rows=3,
                    cache=gen.CacheConfig(page_size=PAGE, num_pages=16, window_pages=True))
    assert [g.layers for g in engine.spec.window_groups] == [(0,)]
    got, reasons = _drive(engine, prompts, max_new, first=3)
    s = engine.stats
    assert s["swaps"] > 0 and s["swap_ins"] == s["swaps"] and s["preemptions"] == 0, s
    assert reasons == ["length"] * 3
    assert got == want
    cache = engine.state.cache
    assert window.pages_in_use(cache) == (0,) and int(cache.num_free_pages) == 16


def _rings(cache):
    """Per slot: (length, held flags, K and V of the logical pages its ring holds, in order)."""
    grp = cache.groups[0]
    bt = np.asarray(grp.table.block_tables)
    k, v = np.asarray(grp.pages.k), np.asarray(grp.pages.v)
    lo, hi = (np.asarray(x) for x in window.ring_range(grp.table))
    ring = bt.shape[1]
    out = []
    for s in range(bt.shape[0]):
        pages = [bt[s, p % ring] for p in range(lo[s], hi[s])]
        out.append((int(cache.lengths[s]), (bt[s] >= 0).tolist(), k[:, :, pages], v[:, :, pages]))
    return out


def test_swap_moves_rings_exactly(model_params):
    model, _ = model_params
    cache = gen.CacheConfig(page_size=PAGE, window_pages=True).build(
        model, num_seqs=2, max_tokens=64, chunk=CHUNK)
    rng = np.random.default_rng(0)
    kv = rng.standard_normal((4, 2, 2, 2, CHUNK, 2, 8)).astype(np.float32)

    @jax.jit
    def fill(cache, kv):  # a chunk of 8 tokens in both rows and layers
        cache, _ = cache_ops.reserve(cache, np.full((2,), CHUNK, np.int32))
        for layer in range(2):
            cache = cache_ops.write(cache, layer, kv[layer, 0], kv[layer, 1],
                                    q_lengths=np.full((2,), CHUNK, np.int32))
        return cache

    for c in range(4):  # 32 tokens: the rings (16 tokens) wrap
        cache = fill(cache, jax.device_put(kv[c]))
    cache, st = cache_ops.truncate(cache, np.array([32, 28], np.int32))  # row 1: a hole
    st.raise_if_error()
    before = _rings(cache)
    assert not all(before[1][1]) and all(before[0][1])
    cache = host.attach(cache, 20, parked=2)
    for slot in (0, 1):
        cache, st = host.swap_out(cache, slot, slot)
        assert int(st.code) == 0
        cache_ops.check_invariants(cache)
    assert window.pages_in_use(cache) == (0,)
    for row, slot in ((1, 0), (0, 1)):
        cache, st = host.swap_in(cache, row, slot)
        assert int(st.code) == 0
        cache_ops.check_invariants(cache)
    after = _rings(cache)
    for old, new in ((before[0], after[1]), (before[1], after[0])):
        assert new[:2] == old[:2]
        np.testing.assert_array_equal(new[2], old[2])
        np.testing.assert_array_equal(new[3], old[3])
