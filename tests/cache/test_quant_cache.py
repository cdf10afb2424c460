"""The quantized paged cache: tail state machine, flushes, allocator (fork/CoW/free), MLA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax as kvx
from kvjax.cache import CacheFullError, check_invariants
from kvjax.cache import quantized as qz
from kvjax.cache.quant import dequantize
from kvjax.specs import QuantSpec

# The cache operations as one program each (run op by op they compile every primitive at
# every shape they meet; the same functions, the same results).
_qwrite = jax.jit(qz.write_layer, static_argnames="layer", donate_argnames="cache")
_qreserve = jax.jit(qz.reserve, donate_argnames="cache")
_qfork = jax.jit(qz.fork, donate_argnames="cache")
_qfree = jax.jit(qz.free, static_argnames="scrub", donate_argnames="cache")

EPS = np.finfo(np.float32).eps


def gqa_spec(*, bits=4, group=8, residual=16, page_size=8, num_pages=64, max_seqs=4,
             max_pages=8, layers=2, dtype="float32"):
    return kvx.CacheSpec(
        attention=kvx.AttentionSpec(q_heads=4, kv_heads=2, head_dim=16), num_layers=layers,
        page_size=page_size, num_pages=num_pages, max_seqs=max_seqs,
        max_pages_per_seq=max_pages, dtype=dtype,
        quant=QuantSpec(bits=bits, group_size=group, residual=residual),
    )


def small_spec():
    """The one-layer cache of 8 pages (6 a sequence) that the allocator tests share: their
    reserve, write (chunks of CHUNK tokens), fork and free compile once."""
    return gqa_spec(residual=8, num_pages=8, layers=1, max_pages=6)


CHUNK = 8


def mla_spec(*, bits=4, group=8, residual=8, page_size=8, num_pages=48, max_seqs=3,
             max_pages=8):
    return kvx.CacheSpec(
        attention=kvx.MLASpec(q_heads=4, kv_lora_rank=32, qk_rope_head_dim=8,
                              qk_nope_head_dim=8, v_head_dim=8),
        num_layers=1, page_size=page_size, num_pages=num_pages, max_seqs=max_seqs,
        max_pages_per_seq=max_pages, quant=QuantSpec(bits=bits, group_size=group,
                                                     residual=residual),
    )


def _expand(s, grouping, rows, width):
    s = np.asarray(s, np.float32)
    return np.repeat(s, rows // s.shape[-2], -2) if grouping == "tokens" else np.repeat(
        s, width // s.shape[-1], -1)


@jax.jit
def _layer_pools(cache):
    """Every layer's pools and rings: quantized pools as (dequantized, scale), every page
    (one program per cache kind)."""
    views = [qz.layer_view(cache, layer) for layer in range(cache.spec.num_layers)]
    return [[(dequantize(p.codes, p.scale, p.zero, bits=p.bits, grouping=p.grouping), p.scale)
             if isinstance(p, qz.QuantLayer) else p
             for p in (view.k, view.tail_k, view.v, view.tail_v)] for view in views]


_VIEWS = {}


def _view_kinds(cache, layer):
    """The layer view's structure (which pools are quantized, their grouping), traced once
    per cache kind and layer: no eager slicing programs."""
    key = (cache.spec, layer)
    if key not in _VIEWS:
        _VIEWS[key] = jax.eval_shape(lambda c: qz.layer_view(c, layer), cache)
    return _VIEWS[key]


def reconstruct(cache, layer, seq):
    """Host-side read-back of one sequence: (a, b, step_a, step_b), each [tokens, heads, width].

    Quantized positions are dequantized (step = the stored scale of each
    element); tail positions are read from the ring (step 0). Every layer is dequantized
    by one program per cache kind and the sequence's pages picked on the host.
    """
    spec = cache.spec
    view = _view_kinds(cache, layer)
    pools = jax.tree.map(np.asarray, _layer_pools(cache)[layer])
    L, Q = int(np.asarray(cache.lengths)[seq]), int(np.asarray(cache.quant_lengths)[seq])
    ps, ring = spec.page_size, qz.tail_capacity(spec)
    pages = np.asarray(cache.block_tables)[seq, :Q // ps]
    outs = []
    parts = [(view.k, pools[0], pools[1]), (view.v, pools[2], pools[3])]
    for pool, read, tail in parts:
        if isinstance(pool, qz.QuantLayer):
            q, scale = read[0][:, pages], read[1][:, pages]
            h, n, _, w = q.shape
            step = _expand(scale, pool.grouping, ps, w)
        else:  # MLA k_rope: full precision pages
            q = read[:, pages].astype(np.float32)
            h, n, _, w = q.shape
            step = np.zeros_like(q)
        q = q.reshape(h, n * ps, w)
        step = step.reshape(h, n * ps, w)
        t = np.asarray(tail)[:, seq, np.arange(Q, L) % ring].astype(np.float32)
        outs.append((np.concatenate([q, t], 1).transpose(1, 0, 2),
                     np.concatenate([step, np.zeros_like(t)], 1).transpose(1, 0, 2)))
    (a, sa), (b, sb) = outs
    return a, b, sa, sb


def assert_close_to_truth(got, step, want):
    """Quantized elements within half a stored step (plus f32 rounding); tail elements exact."""
    want = np.asarray(want, np.float32)
    err = np.abs(got - want)
    bound = step / 2 + 8 * EPS * (np.abs(want) + step * 256)
    assert got.shape == want.shape
    assert np.all(err <= bound), f"max excess {np.max(err - bound)}"
    tail = step.reshape(len(step), -1).max(axis=1) == 0
    np.testing.assert_array_equal(got[tail], want[tail])


def _step(cache, num_new, toks_a, toks_b, layers, seq_ids=None):
    cache, status = _qreserve(cache, jax.device_put(np.asarray(num_new, np.int32)))
    status.raise_if_error()
    for layer in range(layers):
        cache = _qwrite(cache, layer, jax.device_put(np.asarray(toks_a[layer], np.float32)),
                        jax.device_put(np.asarray(toks_b[layer], np.float32)), seq_ids)
    return cache


@pytest.mark.parametrize("residual", [0, 16])
def test_tail_state_machine_random_prefill_then_decode(rng, residual):
    spec = gqa_spec(residual=residual, bits=(8, 2), num_pages=64, max_pages=8)
    ps, S, layers = spec.page_size, spec.max_seqs, spec.num_layers
    chunk = 24  # padded prefill length, static
    for _ in range(2):  # two fresh random draws of T and n per run
        cache = qz.init_cache(spec)
        T = rng.integers(0, chunk + 1, S)
        n = int(rng.integers(1, 2 * ps + 3))
        truth_a = rng.standard_normal((layers, S, chunk + n, 2, 16)).astype(np.float32) * 3
        truth_b = rng.standard_normal((layers, S, chunk + n, 2, 16)).astype(np.float32)
        # Prefill rows carry garbage past T[s] (padding): it must never be stored.
        pad_a = truth_a[:, :, :chunk].copy()
        pad_b = truth_b[:, :, :chunk].copy()
        for s in range(S):
            pad_a[:, s, T[s]:] = 1e4
            pad_b[:, s, T[s]:] = -1e4
        cache = _step(cache, T, pad_a, pad_b, layers)
        seqs = [truth_a[:, s, :T[s]] for s in range(S)], [truth_b[:, s, :T[s]] for s in range(S)]
        for _step_i in range(n):
            new_a = rng.standard_normal((layers, S, 1, 2, 16)).astype(np.float32)
            new_b = rng.standard_normal((layers, S, 1, 2, 16)).astype(np.float32)
            cache = _step(cache, np.ones(S), new_a, new_b, layers)
            for s in range(S):
                seqs[0][s] = np.concatenate([seqs[0][s], new_a[:, s]], 1)
                seqs[1][s] = np.concatenate([seqs[1][s], new_b[:, s]], 1)
        L = T + n
        Q = ps * (np.maximum(L - residual, 0) // ps)
        np.testing.assert_array_equal(np.asarray(cache.lengths)[:S], L)
        np.testing.assert_array_equal(np.asarray(cache.quant_lengths), Q)
        tail = L - Q
        assert np.all(np.where(L >= residual, (tail >= residual) & (tail < residual + ps),
                               tail == L))
        check_invariants(cache.table)
        assert int(cache.num_free_pages) == spec.num_pages - Q.sum() // ps
        for s in range(S):
            for layer in range(layers):
                a, b, sa, sb = reconstruct(cache, layer, s)
                assert_close_to_truth(a, sa, seqs[0][s][layer])
                assert_close_to_truth(b, sb, seqs[1][s][layer])


def test_fork_shares_pages_copies_tail_and_free_returns_them(rng):
    spec = small_spec()
    cache = qz.init_cache(spec)
    # 21 tokens in slot 0, written in chunks of CHUNK (8, 8, 5).
    a = rng.standard_normal((1, 4, 24, 2, 16)).astype(np.float32)
    b = rng.standard_normal((1, 4, 24, 2, 16)).astype(np.float32)
    for start, n in ((0, 8), (8, 8), (16, 5)):
        cache = _step(cache, np.array([n, 0, 0, 0]), a[:, :, start:start + CHUNK],
                      b[:, :, start:start + CHUNK], 1)
    a, b = a[:, :, :21], b[:, :, :21]
    shared = np.asarray(cache.block_tables)[0, :1]  # Q = 8: one quantized page
    cache, status = _qfork(cache, np.array([0, 0], np.int32), np.array([1, 2], np.int32))
    status.raise_if_error()
    assert np.asarray(cache.table.refcounts)[shared].tolist() == [3]
    check_invariants(cache.table)
    # Diverge: each sequence decodes its own tokens until a flush happens in all three.
    hist = {s: (a[0, 0], b[0, 0]) for s in range(3)}
    for _ in range(5):
        na = rng.standard_normal((1, 4, 1, 2, 16)).astype(np.float32)
        nb = rng.standard_normal((1, 4, 1, 2, 16)).astype(np.float32)
        cache = _step(cache, np.array([1, 1, 1, 0]), na, nb, 1)
        for s in range(3):
            hist[s] = (np.concatenate([hist[s][0], na[0, s]]), np.concatenate([hist[s][1],
                                                                               nb[0, s]]))
    assert np.asarray(cache.quant_lengths).tolist() == [16, 16, 16, 0]
    check_invariants(cache.table)
    for s in range(3):
        x, y, sx, sy = reconstruct(cache, 0, s)
        assert_close_to_truth(x, sx, hist[s][0])
        assert_close_to_truth(y, sy, hist[s][1])
    # The shared page survives freeing its creator; the new pages are private.
    cache = _qfree(cache, np.array([True, False, False, False]), scrub=True)
    assert np.asarray(cache.table.refcounts)[shared].tolist() == [2]
    check_invariants(cache.table)
    x, _, sx, _ = reconstruct(cache, 0, 1)
    assert_close_to_truth(x, sx, hist[1][0])
    cache = _qfree(cache, np.array([False, True, True, False]), scrub=True)
    assert int(cache.num_free_pages) == spec.num_pages
    # Scrubbed: the pools and the tails hold zeros again.
    assert not np.asarray(cache.pages.k[0].codes).any()
    assert not np.asarray(cache.tail.a).any()


def test_fork_into_busy_slot_is_refused(rng):
    spec = small_spec()
    cache = qz.init_cache(spec)
    x = rng.standard_normal((1, 4, CHUNK, 2, 16)).astype(np.float32)
    cache = _step(cache, np.array([5, 3, 0, 0]), x, x, 1)  # slot 1: tail only, Q = 0
    cache, status = _qfork(cache, np.array([0], np.int32), np.array([1], np.int32))
    with pytest.raises(ValueError, match="fork"):
        status.raise_if_error()
    assert np.asarray(cache.lengths).tolist() == [5, 3, 0, 0]


def test_out_of_pages_is_cache_full_and_changes_nothing(rng):
    spec = small_spec()
    cache = qz.init_cache(spec)
    cache, status = _qreserve(cache, np.array([41, 0, 0, 0], np.int32))
    status.raise_if_error()  # 4 quantized pages of the 8, 9 tail tokens
    before = np.asarray(cache.lengths).copy()
    # 1 + 4 more pages: refused.
    cache, status = _qreserve(cache, np.array([7, 40, 0, 0], np.int32))
    with pytest.raises(CacheFullError):
        status.raise_if_error()
    np.testing.assert_array_equal(np.asarray(cache.lengths), before)
    assert np.asarray(cache.quant_lengths).tolist() == [32, 0, 0, 0]
    assert int(cache.num_free_pages) == 4
    # The failed step's writes are no-ops.
    x = jax.device_put(rng.standard_normal((4, CHUNK, 2, 16)).astype(np.float32))
    cache2 = _qwrite(cache, 0, x, x, None)
    assert np.asarray(cache2.lengths)[1] == 0
    check_invariants(cache2.table)


@pytest.mark.parametrize("bits", [2, 8])
def test_mla_latent_quantized_rope_full_precision(rng, bits):
    spec = mla_spec(bits=bits)
    cache = qz.init_cache(spec)
    T = np.array([19, 9, 0])
    c = rng.standard_normal((1, 3, 19, 32)).astype(np.float32)
    r = rng.standard_normal((1, 3, 19, 8)).astype(np.float32)
    cache = _step(cache, T, c, r, 1)
    hist = [(c[0, s, :T[s]], r[0, s, :T[s]]) for s in range(3)]
    for _ in range(9):
        nc = rng.standard_normal((1, 3, 1, 32)).astype(np.float32)
        nr = rng.standard_normal((1, 3, 1, 8)).astype(np.float32)
        cache = _step(cache, np.array([1, 1, 0]), nc, nr, 1)
        for s in range(2):
            hist[s] = (np.concatenate([hist[s][0], nc[0, s]]),
                       np.concatenate([hist[s][1], nr[0, s]]))
    assert np.asarray(cache.quant_lengths).tolist() == [16, 8, 0]
    for s in range(2):
        x, y, sx, sy = reconstruct(cache, 0, s)
        assert_close_to_truth(x[:, 0], sx[:, 0], hist[s][0])
        np.testing.assert_array_equal(y[:, 0], hist[s][1])  # k_rope is never quantized
        assert sx[:16 if s == 0 else 8].min() > 0  # the flushed part is really quantized


def test_per_layer_bits_pools_and_traced_layer_rule():
    spec = gqa_spec(bits=(8, 2, 8), layers=3)
    cache = qz.init_cache(spec)
    ks = cache.pages.k
    assert [p.bits for p in ks] == [8, 2]
    assert [p.codes.shape[0] for p in ks] == [2, 1]
    assert ks[0].codes.shape[-1] == 16 and ks[1].codes.shape[-1] == 4
    assert qz.layer_groups(spec)[1] == ((0, 0), (1, 0), (0, 1))
    with pytest.raises(TypeError, match="Python int"):
        qz.layer_view(cache, jnp.int32(1))
    uniform = qz.init_cache(gqa_spec(bits=4, layers=2))
    view = qz.layer_view(uniform, jnp.int32(1))  # a traced/array layer works with one width
    assert view.k.bits == 4


def test_quant_spec_validation():
    with pytest.raises(ValueError, match="bits entries"):
        QuantSpec(bits=3)
    with pytest.raises(ValueError, match="residual"):
        gqa_spec(residual=12)
    with pytest.raises(ValueError, match="divide page_size"):
        gqa_spec(group=16, page_size=8)
    with pytest.raises(ValueError, match="3 entries"):
        gqa_spec(bits=(2, 4, 8), layers=2)
    with pytest.raises(ValueError, match="scale_dtype"):
        QuantSpec(scale_dtype="float32")
    assert hash(QuantSpec(bits=[2, 4])) == hash(QuantSpec(bits=(2, 4)))
    with pytest.raises(ValueError, match="quant="):
        qz.init_cache(gqa_spec().replace(quant=None))


def test_random_interleavings_of_reserve_write_fork_free(rng):
    # The allocator under a quantized cache: random decode/prefill chunks, forks
    # and frees (with and without scrub), out-of-pages included. After every
    # operation the page table is consistent, and every live sequence reads back
    # as what was written into it (quantized part within half a step).
    spec = small_spec()
    S, chunk, ps = spec.max_seqs, CHUNK, spec.page_size
    cache = qz.init_cache(spec)
    truth = {s: (np.zeros((0, 2, 16), np.float32), np.zeros((0, 2, 16), np.float32))
             for s in range(S)}
    full_seen = 0
    for _ in range(40):
        op = rng.choice(["grow", "grow", "grow", "fork", "free"])
        lengths = np.asarray(cache.lengths)
        if op == "grow":
            num_new = rng.integers(0, chunk + 1, S) * (rng.random(S) < 0.7)
            num_new = np.minimum(num_new, spec.max_tokens_per_seq - lengths)
            a = rng.standard_normal((1, S, chunk, 2, 16)).astype(np.float32)
            b = rng.standard_normal((1, S, chunk, 2, 16)).astype(np.float32)
            cache, status = _qreserve(cache, np.asarray(num_new, np.int32))
            if int(status.code) != 0:
                full_seen += 1
                with pytest.raises(CacheFullError):
                    status.raise_if_error()
                np.testing.assert_array_equal(np.asarray(cache.lengths), lengths)
                continue
            cache = _qwrite(cache, 0, jax.device_put(a[0]), jax.device_put(b[0]), None)
            for s in range(S):
                n = num_new[s]
                truth[s] = (np.concatenate([truth[s][0], a[0, s, :n]]),
                            np.concatenate([truth[s][1], b[0, s, :n]]))
        elif op == "fork":
            live = [s for s in range(S) if lengths[s] > 0]
            empty = [s for s in range(S) if lengths[s] == 0]
            if not live or not empty:
                continue
            src, dst = int(rng.choice(live)), int(rng.choice(empty))
            cache, status = _qfork(cache, np.array([src], np.int32), np.array([dst], np.int32))
            status.raise_if_error()
            truth[dst] = truth[src]
        else:
            s = int(rng.integers(S))
            mask = np.zeros(S, bool)
            mask[s] = True
            cache = _qfree(cache, mask, scrub=bool(rng.integers(2)))
            truth[s] = (truth[s][0][:0], truth[s][1][:0])
        check_invariants(cache.table)
        # Donation needs every leaf in its own buffer (XLA may merge equal outputs).
        ptrs = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(cache)]
        assert len(set(ptrs)) == len(ptrs), "two cache leaves share a device buffer"
        L = np.asarray(cache.lengths)
        np.testing.assert_array_equal(L, [len(truth[s][0]) for s in range(S)])
        np.testing.assert_array_equal(np.asarray(cache.quant_lengths),
                                      ps * (np.maximum(L - spec.quant.residual, 0) // ps))
        for s in range(S):
            if L[s]:
                x, y, sx, sy = reconstruct(cache, 0, s)
                assert_close_to_truth(x, sx, truth[s][0])
                assert_close_to_truth(y, sy, truth[s][1])
    print(f"out-of-pages events: {full_seen}")


def test_write_must_cover_reserved_tokens(rng):
    spec = small_spec()
    cache = qz.init_cache(spec)
    cache, _ = _qreserve(cache, np.array([5, 0, 0, 0], np.int32))
    xn = rng.standard_normal((4, 3, 2, 16)).astype(np.float32)
    x = jax.device_put(xn)
    with pytest.raises(ValueError, match="q_len=3"):
        qz.write_layer(cache, 0, x, x)
    half = jax.device_put(xn.astype(jnp.bfloat16))
    with pytest.raises(TypeError, match="dtype"):
        qz.write_layer(cache, 0, half, half)
    with pytest.raises(ValueError, match=r"\[batch, q_len, 2, 16\]"):
        qz.write_layer(cache, 0, jax.device_put(xn[..., :8]), x)
