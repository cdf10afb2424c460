"""Window groups: sliding-window layers that keep only their window's pages (rings).

A cache of two layers, layer 0 global and layer 1 in a window group, checked against
dense attention computed in NumPy (float64) from every token ever written: the
windowed layer's pages in use stay at the ring bound while the global layer's grow,
pages a freed sequence gives back serve the next one, and random interleavings of
reserve / fork / free / truncate keep the allocator invariants and every sequence's
window intact.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import kvjax as kvx
from kvjax.cache import page_table as pt
from kvjax.cache import window
from kvjax.specs import WindowGroupSpec, ring_pages

PS, WINDOW, CHUNK = 4, 6, 4
RING = ring_pages(WINDOW, CHUNK, PS)  # ceil(8 / 4) + 1 = 3
ATT = kvx.AttentionSpec(q_heads=4, kv_heads=2, head_dim=8)
IMPLS = ("reference", "xla", "cpu")


def make_spec(*, max_seqs, group_pages=None, num_pages=64, max_pages=16):
    return kvx.CacheSpec(
        attention=ATT, num_layers=2, page_size=PS, num_pages=num_pages, max_seqs=max_seqs,
        max_pages_per_seq=max_pages,
        window_groups=(WindowGroupSpec(layers=(1,), window=WINDOW, chunk=CHUNK,
                                       num_pages=group_pages),))


def dense_attention(q, keys, values, pos, window_size):
    """float64 softmax attention of q [q_heads, d] at position `pos` over keys [t, kv, d]."""
    lo = 0 if window_size is None else max(0, pos - window_size + 1)
    k, v = keys[lo: pos + 1].astype(np.float64), values[lo: pos + 1].astype(np.float64)
    group = q.shape[0] // k.shape[1]
    kk, vv = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # [t, q_heads, d]
    s = np.einsum("hd,thd->ht", q.astype(np.float64), kk) * q.shape[-1] ** -0.5
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("ht,thd->hd", p, vv)


@functools.partial(jax.jit, donate_argnames="cache")
def step(cache, num_new, kv, q):
    """Reserves num_new[s] tokens, writes kv [layers, 2, batch, t, kv_heads, d] to both
    layers, and attends q [batch, t, q_heads, d] with every impl; outs [impls, layers, ...]."""
    cache, status = kvx.cache.reserve(cache, num_new)
    q_lengths = jnp.where(status.ok, num_new, 0)
    outs = []
    for layer in (0, 1):
        cache = kvx.cache.write(cache, layer, kv[layer, 0], kv[layer, 1], q_lengths=q_lengths)
    for impl in IMPLS:
        outs.append(jnp.stack([
            kvx.cache.attend(cache, layer, q, q_lengths=q_lengths, sliding_window=w,
                             impl=impl)[0] for layer, w in ((0, None), (1, WINDOW))]))
    return cache, status, jnp.stack(outs)


def run_steps(cache, rng, counts, history):
    """Grows slot 0 (the only live row in `counts`' sense: counts[i] tokens at step i), checks
    each step's attention against dense attention, and yields after every step."""
    batch = cache.spec.max_seqs
    for n in counts:
        t = CHUNK if n > 1 else 1
        num_new = np.zeros(batch, np.int32)
        num_new[history["slot"]] = n
        kv = rng.standard_normal((2, 2, batch, t, ATT.kv_heads, ATT.head_dim)).astype(np.float32)
        q = rng.standard_normal((batch, t, ATT.q_heads, ATT.head_dim)).astype(np.float32)
        cache, status, outs = step(cache, jax.device_put(num_new), jax.device_put(kv),
                                   jax.device_put(q))
        status.raise_if_error()
        s = history["slot"]
        for layer in (0, 1):
            history["k"][layer] = np.concatenate([history["k"][layer], kv[layer, 0, s, :n]])
            history["v"][layer] = np.concatenate([history["v"][layer], kv[layer, 1, s, :n]])
        length = len(history["k"][0])
        outs = np.asarray(outs)
        for layer, w in ((0, None), (1, WINDOW)):
            want = np.stack([dense_attention(q[s, i], history["k"][layer], history["v"][layer],
                                             length - n + i, w) for i in range(n)])
            for j, impl in enumerate(IMPLS):
                np.testing.assert_allclose(outs[j, layer, s, :n], want, rtol=2e-5, atol=2e-5,
                                           err_msg=f"{impl}, layer {layer}, length {length}")
        yield cache


def fresh_history(slot):
    empty = np.zeros((0, ATT.kv_heads, ATT.head_dim), np.float32)
    return dict(slot=slot, k=[empty, empty], v=[empty, empty])


def test_local_pages_stay_at_window_bound_and_freed_pages_are_reused(rng):
    # The group's pool holds exactly one ring: the second sequence can only run on the
    # pages the first one gives back.
    spec = make_spec(max_seqs=2, group_pages=RING)
    counts = [4, 4, 3] + [1] * 21 + [4, 2]  # 11 prompt tokens, 21 decoded, 6 more: 38 > 3 * 6
    hist = fresh_history(0)
    seen_local = []
    for cache in run_steps(kvx.init_cache(spec), rng, counts, hist):
        length = len(hist["k"][0])
        pages = -(-length // PS)
        kvx.cache.check_invariants(cache)
        assert window.pages_in_use(cache) == (min(pages, RING),)
        assert int(cache.table.num_pages - cache.table.num_free) == pages  # the global layer
        seen_local.append(window.pages_in_use(cache)[0])
    assert max(seen_local) == RING and len(hist["k"][0]) >= 3 * WINDOW
    ring = set(np.asarray(cache.groups[0].table.block_tables)[0].tolist())
    freed = kvx.cache.free(cache, jnp.array([True, False]))
    kvx.cache.check_invariants(freed)
    assert window.pages_in_use(freed) == (0,)
    hist = fresh_history(1)
    for cache in run_steps(freed, rng, [4, 4, 1, 1, 4, 1, 1, 1, 1], hist):
        kvx.cache.check_invariants(cache)
        held = np.asarray(cache.groups[0].table.block_tables)[1]
        used = held[:min(-(-len(hist["k"][0]) // PS), RING)]
        assert set(used.tolist()) <= ring
    assert set(used.tolist()) == ring


def test_refusals_and_errors():
    spec = make_spec(max_seqs=2)
    cache = kvx.init_cache(spec)
    cache, status = kvx.cache.reserve(cache, jnp.array([CHUNK + 1, 0]))
    assert int(status.code) == pt.TOO_MANY_NEW and np.asarray(cache.lengths).tolist() == [0, 0]
    with pytest.raises(ValueError, match="window group's chunk"):
        status.raise_if_error()
    q = jnp.ones((2, 1, ATT.q_heads, ATT.head_dim))
    with pytest.raises(ValueError, match="sliding_window <= 6"):
        kvx.cache.attend(cache, 1, q, q_lengths=jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match="sliding_window <= 6"):
        kvx.cache.attend(cache, 1, q, q_lengths=jnp.zeros(2, jnp.int32), sliding_window=7)
    for n in (4, 4, 4, 4):
        cache, status = kvx.cache.reserve(cache, jnp.array([n, 0]))
        status.raise_if_error()
    # 16 tokens on 4 pages, a ring of 3 (pages 1..3): at length 8 the next query reads
    # keys 3..8, and page 0 (keys 0..3) left the ring.
    with pytest.raises(ValueError, match="no longer holds the pages"):
        kvx.cache.truncate(cache, jnp.array([8, 0]))
    cache, status = kvx.cache.truncate(cache, jnp.array([15, 0]))
    status.raise_if_error()
    kvx.cache.check_invariants(cache)
    with pytest.raises(ValueError, match="in two groups"):
        kvx.CacheSpec(attention=ATT, num_layers=2, page_size=PS, num_pages=8, max_seqs=1,
                      max_pages_per_seq=4, window_groups=(
                          WindowGroupSpec(layers=(1,), window=4, chunk=1),
                          WindowGroupSpec(layers=(0, 1), window=8, chunk=1)))
    with pytest.raises(ValueError, match="outside the cache's 2 layers"):
        make_spec(max_seqs=1).replace(window_groups=(
            WindowGroupSpec(layers=(2,), window=4, chunk=1),))
    # KIVI pages hold the global layers only (layer 0, at its per-layer width); the group's
    # layer keeps a full-precision ring.
    kivi = kvx.init_cache(make_spec(max_seqs=1).replace(
        quant=kvx.QuantSpec(bits=(8, 2), group_size=4)))
    assert kivi.tail.a.shape[0] == 1 and [p.bits for p in kivi.pages.k] == [8]
    assert kivi.groups[0].pages.k.dtype == kivi.spec.dtype


# ---------------------------------------------------------------- random interleavings

SEQS = 4
FUZZ_SPEC = make_spec(max_seqs=SEQS, num_pages=24, group_pages=10, max_pages=8)


@functools.partial(jax.jit, donate_argnames="cache")
def grow_and_write(cache, num_new, values):
    """Reserves num_new[s] tokens per sequence; both layers' K and V get values[s, :n]."""
    cache, status = kvx.cache.reserve(cache, num_new)
    q_lengths = jnp.where(status.ok, num_new, 0)
    x = jnp.broadcast_to(values[:, :, None, None], (*values.shape, ATT.kv_heads, ATT.head_dim))
    for layer in (0, 1):
        cache = kvx.cache.write(cache, layer, x, -x, q_lengths=q_lengths)
    return cache, status


@functools.partial(jax.jit, static_argnames="layer")
def _tables_and_keys(cache, layer):
    """The block tables and first KV head's K pool of `layer`'s view, as one program (the
    view's slicing run op by op compiled a dozen small programs)."""
    view = kvx.cache.layer_view(cache, layer)
    return view.block_tables, view.k[0]


def tokens_seen(cache, s, layer):
    """The K values of sequence s that layer `layer`'s attention reads through its block
    table (the ring's virtual table for the windowed layer), by position."""
    tables, k = (np.asarray(x) for x in _tables_and_keys(cache, layer))
    n = int(np.asarray(cache.lengths)[s])
    ids = tables[s, : -(-n // PS)]
    return k[ids].reshape(-1, ATT.head_dim)[:n, 0]  # k: [pages, page_size, head_dim]


fuzz_ops = st.lists(
    st.one_of(
        st.tuples(st.just("grow"), st.lists(st.integers(0, CHUNK), min_size=SEQS,
                                            max_size=SEQS)),
        st.tuples(st.just("fork"), st.integers(0, SEQS - 1), st.integers(0, SEQS - 1)),
        st.tuples(st.just("free"), st.lists(st.booleans(), min_size=SEQS, max_size=SEQS)),
        st.tuples(st.just("truncate"), st.integers(0, SEQS - 1),
                  st.integers(0, FUZZ_SPEC.max_tokens_per_seq)),
    ),
    min_size=1, max_size=16,
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=fuzz_ops, seed=st.integers(0, 2**31 - 1))
# Beams: a sequence past its ring forked twice, all three growing across a page boundary
# at once (every holder of a shared slot gives it up; the last keeps it), then one freed.
@example(ops=[("grow", [4, 0, 0, 0])] * 4 + [("fork", 0, 1), ("fork", 0, 2),
              ("grow", [1, 1, 1, 0]), ("grow", [4, 4, 4, 0]), ("free", [False, True, False,
                                                                          False]),
              ("truncate", 2, 3)], seed=3)
# A wrapped ring truncated twice: the second truncation must be judged by what the ring
# still holds (pages 1..2 after 16 -> 12 tokens), not by the shorter length alone.
@example(ops=[("grow", [4, 0, 0, 0])] * 4 + [("truncate", 0, 12), ("truncate", 0, 8)], seed=5)
def test_random_interleavings_keep_invariants_and_windows(ops, seed):
    rng = np.random.default_rng(seed)
    cache = kvx.init_cache(FUZZ_SPEC)
    expect = {s: np.zeros(0, np.float32) for s in range(SEQS)}
    # The model of each ring: the first logical page it holds (it holds pages [lo, P) of a
    # P-page sequence); growing moves it to P - RING at least, truncation keeps it.
    ring_lo = np.zeros(SEQS, np.int64)
    for op in ops:
        lens = np.array([len(expect[s]) for s in range(SEQS)])
        if op[0] == "grow":
            n = np.array(op[1], np.int32)
            vals = rng.standard_normal((SEQS, CHUNK)).astype(np.float32)
            cache, status = grow_and_write(cache, jax.device_put(n), jax.device_put(vals))
            if (lens + n > FUZZ_SPEC.max_tokens_per_seq).any():
                assert int(status.code) == pt.TOO_LONG
            elif bool(status.ok):
                for s in range(SEQS):
                    expect[s] = np.concatenate([expect[s], vals[s, : n[s]]])
                    ring_lo[s] = max(ring_lo[s], -(-len(expect[s]) // PS) - RING)
            else:
                assert int(status.code) == pt.OUT_OF_PAGES
                assert int(status.pages_needed) > int(status.pages_free)
        elif op[0] == "fork":
            src, dst = op[1], op[2]
            if src == dst or lens[dst] > 0:
                with pytest.raises(ValueError, match="fork"):
                    kvx.cache.fork(cache, jnp.array([src]), jnp.array([dst]))
            else:
                cache, status = kvx.cache.fork(cache, jnp.array([src]), jnp.array([dst]))
                assert bool(status.ok)
                expect[dst] = expect[src].copy()
                ring_lo[dst] = ring_lo[src]
        elif op[0] == "free":
            mask = np.array(op[1])
            cache = kvx.cache.free(cache, jnp.asarray(mask))
            for s in np.nonzero(mask)[0]:
                expect[s] = np.zeros(0, np.float32)
                ring_lo[s] = 0
        else:
            s, new = op[1], min(op[2], lens[op[1]])
            allowed = new in (0, lens[s]) or max(new - WINDOW + 1, 0) // PS >= ring_lo[s]
            new_lengths = lens.copy()
            new_lengths[s] = new
            if not allowed:
                with pytest.raises(ValueError, match="no longer holds the pages"):
                    kvx.cache.truncate(cache, jnp.asarray(new_lengths))
            else:
                cache, status = kvx.cache.truncate(cache, jnp.asarray(new_lengths))
                assert bool(status.ok)
                expect[s] = expect[s][:new]
                if new == 0:
                    ring_lo[s] = 0
        kvx.cache.check_invariants(cache)
        lens = np.asarray(cache.lengths)
        held = int(np.minimum(-(-lens // PS), RING).sum())
        assert window.pages_in_use(cache)[0] <= held
        for s in range(SEQS):
            np.testing.assert_array_equal(tokens_seen(cache, s, 0), expect[s])
            lo = max(0, len(expect[s]) - WINDOW + 1)  # what the next query's window reads
            np.testing.assert_array_equal(tokens_seen(cache, s, 1)[lo:], expect[s][lo:])
    cache = kvx.cache.free(cache, jnp.ones(SEQS, bool))
    kvx.cache.check_invariants(cache)
    assert window.pages_in_use(cache) == (0,)
