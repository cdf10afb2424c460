"""Quest and page-granular H2O on a KIVI-quantized cache, on the packed pages themselves.

Quest bounds each quantized page's keys from the stored scales and zeros and reads its
top_k pages plus the full-precision tail; H2O evicts whole quantized pages, lowest
attention mass first, never the tail. References: NumPy attention over the dequantized
pages, and the same decode without eviction.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax as kvx
from kvjax import cache as kvc
from kvjax.cache import quantized as qz
from kvjax.cache.policies import H2O, H2OState, Quest, UndefinedCombination, kivi_key_bounds
from kvjax.specs import QuantSpec
from tests.cache.policies.helpers import (
    decode_step,
    dense_kv,
    held_pages,
    random_filled_cache,
    select,
)

PS, RES, HQ, HKV, D, LAYERS, SEQS = 8, 8, 4, 2, 16, 2, 3


def make_spec(*, bits=4):
    return kvx.CacheSpec(
        attention=kvx.AttentionSpec(q_heads=HQ, kv_heads=HKV, head_dim=D), num_layers=LAYERS,
        page_size=PS, num_pages=24, max_seqs=SEQS, max_pages_per_seq=8, dtype="float32",
        quant=QuantSpec(bits=bits, group_size=4, residual=RES))


def filled(rng, lengths, *, bits=4, constant_channel=False):
    """A KIVI cache holding `lengths` random tokens per slot."""
    spec = make_spec(bits=bits)
    k = rng.standard_normal((LAYERS, SEQS, HKV, spec.max_tokens_per_seq, D))
    if constant_channel:  # a constant key channel over the first page: scale 0
        k[:, :, :, :PS, 0] = 0.375
    return random_filled_cache(spec, lengths, rng, k=k)[0]


def deq_keys(cache, layer, seq):
    """float32 [heads, pages, page_size, D]: the dequantized key pages of a sequence."""
    n = int(np.asarray(cache.quant_lengths)[seq]) // PS
    dk, _ = dense_kv(cache)
    return dk[layer, seq, :, :n * PS].reshape(HKV, n, PS, D)


def readback(cache, layer, seq):
    """(K, V) float32 [tokens, heads, D] of a sequence: dequantized pages, then the tail."""
    dk, dv = dense_kv(cache)
    n = int(np.asarray(cache.lengths)[seq])
    return dk[layer, seq, :, :n].transpose(1, 0, 2), dv[layer, seq, :, :n].transpose(1, 0, 2)


def _np_attention(q, k, v):
    """q [hq, D], k/v [tokens, hkv, D] float64 -> [hq, D]."""
    g = HQ // HKV
    out = []
    for h in range(HQ):
        logits = k[:, h // g] @ q[h] / np.sqrt(D)
        p = np.exp(logits - logits.max())
        out.append((p / p.sum()) @ v[:, h // g])
    return np.stack(out)


@jax.jit
def _decode(cache, q, selection):
    """Layer 1's decode attention of q [SEQS, HQ, D], over `selection` (None: everything)."""
    out, lse = kvc.attend(cache, 1, q[:, None], q_lengths=jnp.ones((SEQS,), jnp.int32),
                          selection=selection)
    return out[:, 0], lse[:, 0]


@pytest.mark.parametrize("bits", [2, 4])
def test_bounds_from_scales_equal_bounds_of_dequantized_keys(bits, rng):
    cache = filled(rng, [40, 27], bits=bits, constant_channel=True)
    q = rng.standard_normal((HQ, D)).astype(np.float32)
    for layer in range(LAYERS):
        view = qz.layer_view(cache, layer)
        kmin_all, kmax_all = jax.jit(kivi_key_bounds, static_argnums=2)(
            view.k.scale, view.k.zero, bits)
        for seq in range(2):
            n = int(np.asarray(cache.quant_lengths)[seq]) // PS
            pages = np.asarray(cache.block_tables)[seq, :n]
            kmin, kmax = np.asarray(kmin_all)[:, pages], np.asarray(kmax_all)[:, pages]
            k = deq_keys(cache, layer, seq)  # [H, n, ps, D]
            np.testing.assert_array_equal(kmin, k.min(axis=2))
            np.testing.assert_array_equal(kmax, k.max(axis=2))
            # Quest's bound is an upper bound of q . k for every key of the page.
            for h in range(HQ):
                qk = np.einsum("d,npd->np", q[h], k[h // (HQ // HKV)].astype(np.float64))
                bound = np.maximum(q[h] * kmax[h // 2], q[h] * kmin[h // 2]).sum(-1)
                assert (bound[:, None] >= qk - 1e-5).all()
    # The constant channel (scale 0) gives min == max == its value on page 0.
    p0 = int(np.asarray(cache.block_tables)[0, 0])
    assert float(np.asarray(kmin_all)[0, p0, 0]) == float(np.asarray(kmax_all)[0, p0, 0]) == 0.375


def test_quest_selects_top_pages_and_attends_over_them_plus_tail(rng):
    cache = filled(rng, [50, 35])  # 5 and 3 quantized pages; tails of 10 and 11 tokens
    q = jnp.asarray(rng.standard_normal((SEQS, HQ, D)).astype(np.float32))
    policy = Quest(top_k=2, dense_layers=1)
    state = policy.init_state(cache)
    assert policy.before_attention(cache, state, 0, q) is None  # a dense layer
    sel = jax.jit(policy.before_attention, static_argnums=2)(cache, state, 1, q)
    out, _ = _decode(cache, q, sel)
    bt = np.asarray(cache.block_tables)
    for seq in range(2):
        k = deq_keys(cache, 1, seq).astype(np.float64)  # [H, n, ps, D]
        kmin, kmax = k.min(axis=2), k.max(axis=2)
        qq = np.asarray(q[seq], np.float64)
        a, b = readback(cache, 1, seq)  # [tokens, H, D]
        n, ql = k.shape[1], int(cache.quant_lengths[seq])
        assert n == (5, 3)[seq]
        for h in range(HKV):
            grp = qq[2 * h:2 * h + 2]
            bound = sum(np.maximum(g * kmax[h], g * kmin[h]).sum(-1) for g in grp)  # [n]
            want = sorted(np.argsort(-bound)[:2])
            np.testing.assert_array_equal(np.asarray(sel.block_tables[seq, h]), bt[seq, want])
            assert int(sel.lengths[seq, h]) == 2 * PS
            toks = np.concatenate([np.arange(c * PS, (c + 1) * PS) for c in want]
                                  + [np.arange(ql, a.shape[0])])
            ref = _np_attention(qq, a[toks].astype(np.float64), b[toks].astype(np.float64))
            np.testing.assert_allclose(np.asarray(out[seq, 2 * h:2 * h + 2]),
                                       ref[2 * h:2 * h + 2], rtol=1e-5, atol=1e-5)


def test_quest_with_every_page_equals_plain_quantized_attention(rng):
    cache = filled(rng, [50, 35])
    q = jnp.asarray(rng.standard_normal((SEQS, HQ, D)).astype(np.float32))
    plain, plain_lse = _decode(cache, q, None)
    # top_k >= the table width: no selection at all, the plain op runs.
    state = Quest(top_k=8, dense_layers=0).init_state(cache)
    assert Quest(top_k=8, dense_layers=0).before_attention(cache, state, 1, q) is None
    # top_k = 5 >= every sequence's quantized pages: the selected path reads them all.
    sel = select(Quest(top_k=5, dense_layers=0), cache, state, 1, q)
    assert np.asarray(sel.lengths).tolist() == [[40] * 2, [24] * 2, [0] * 2]
    out, lse = _decode(cache, q, sel)
    # Same pages in the same order; only the batching of the einsums differs (f32).
    np.testing.assert_allclose(np.asarray(out), np.asarray(plain), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(plain_lse), rtol=1e-6, atol=1e-6)


def _stream(rng, steps):
    """Random K/V [steps, LAYERS, SEQS, 1, HKV, D] and queries [steps, LAYERS, SEQS, HQ, D]."""
    k = rng.standard_normal((steps, LAYERS, SEQS, 1, HKV, D)).astype(np.float32)
    v = rng.standard_normal((steps, LAYERS, SEQS, 1, HKV, D)).astype(np.float32)
    q = rng.standard_normal((steps, LAYERS, SEQS, HQ, D)).astype(np.float32)
    return k, v, q


BUDGET = 20  # one policy for both decode tests: one compiled step


def test_h2o_with_budget_over_every_length_is_no_policy(rng):
    seed = int(rng.integers(1 << 30))
    caches = [filled(np.random.default_rng(seed), [5, 3]) for _ in range(2)]
    k, v, q = _stream(rng, 12)  # lengths reach 17 and 15, within the budget
    policy = H2O(budget=BUDGET)
    state = policy.init_state(caches[1])
    for i in range(12):
        caches[0], _, want, _, _ = decode_step(caches[0], None, k[i], v[i], q[i])
        caches[1], state, got, _, st = decode_step(caches[1], state, k[i], v[i], q[i],
                                                   policy=policy)
        st.raise_if_error()
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for a, b in zip(jax.tree.leaves(caches[0]), jax.tree.leaves(caches[1]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(jnp.sum(state.scores)) > 0


@pytest.mark.parametrize("forked", [False, True])
def test_h2o_evicts_the_lowest_mass_page_and_frees_it(forked, rng):
    """A step's probabilities join each token's score; over budget, the quantized page of
    lowest summed score goes (for every layer and head), the scores move with the tokens,
    and the page returns to the pool unless a fork still holds it."""
    cache = filled(rng, [40, 27])  # seq 0: 4 quantized pages + 8 tail tokens
    if forked:
        cache, st = kvc.fork(cache, jnp.asarray([0]), jnp.asarray([2]))
        st.raise_if_error()
    policy = H2O(budget=33)  # seq 0 is 7 over: one page goes; seq 1 (27) stays
    # Accumulated scores far above what one step adds (at most LAYERS * HQ per row), and
    # page 2 of seq 0 far below the others: the victim whatever the step's queries are.
    base = rng.uniform(50.0, 100.0, (SEQS, 64)).astype(np.float32)
    base[0, 2 * PS:3 * PS] *= 0.01
    for s, n in enumerate([40, 27, 40 if forked else 0]):
        base[s, n:] = 0
    q = rng.standard_normal((LAYERS, SEQS, HQ, D)).astype(np.float32)
    old_bt = np.asarray(cache.block_tables).copy()
    old_free = int(cache.num_free_pages)
    old = [readback(cache, layer, s) for layer in range(LAYERS) for s in (0, 1)]
    victim = old_bt[0, 2]
    want = base.astype(np.float64)
    for s, n in enumerate([40, 27]):  # the active rows' probabilities, on dequantized keys
        for layer in range(LAYERS):
            k = old[layer * 2 + s][0]
            for h in range(HQ):
                logits = k[:, h // 2] @ q[layer, s, h] / np.sqrt(D)
                p = np.exp(logits - logits.max())
                want[s, :n] += p / p.sum()
    cache, state, status = jax.jit(policy.after_step)(
        cache, H2OState(scores=jnp.asarray(base)), jnp.asarray(q),
        jnp.asarray([True, True, False]))
    status.raise_if_error()
    kvc.check_invariants(cache)
    assert list(np.asarray(cache.lengths)) == [32, 27, 40 if forked else 0]
    assert int(cache.quant_lengths[0]) == 3 * PS
    np.testing.assert_array_equal(np.asarray(cache.block_tables)[0, :3], old_bt[0, [0, 1, 3]])
    np.testing.assert_array_equal(np.asarray(cache.block_tables)[1], old_bt[1])
    keep = np.r_[0:2 * PS, 3 * PS:40]
    for i, (layer, s) in enumerate((layer, s) for layer in range(LAYERS) for s in (0, 1)):
        a, b = readback(cache, layer, s)
        idx = keep if s == 0 else np.arange(27)
        np.testing.assert_array_equal(a, old[i][0][idx])  # the tail ring was rotated too
        np.testing.assert_array_equal(b, old[i][1][idx])
    scores = np.asarray(state.scores)
    np.testing.assert_allclose(scores[0, :32], want[0, keep], rtol=1e-6)
    np.testing.assert_allclose(scores[1], want[1], rtol=1e-6)
    assert not scores[0, 32:].any()
    np.testing.assert_array_equal(scores[2], base[2])  # inactive: neither scored nor moved
    rc = np.asarray(cache.table.refcounts)
    free = set(np.asarray(cache.table.free_stack)[:int(cache.num_free_pages)].tolist())
    if forked:  # the fork still holds the page: one reference less, not freed
        assert rc[victim] == 1 and victim not in free
        assert int(cache.num_free_pages) == old_free
        cache = kvc.free(cache, jnp.asarray([False, False, True]))
        kvc.check_invariants(cache)
        free = set(np.asarray(cache.table.free_stack)[:int(cache.num_free_pages)].tolist())
    else:
        assert rc[victim] == 0
        assert int(cache.num_free_pages) == old_free + 1
    assert victim in free


def test_h2o_holds_the_budget_at_every_step_and_keeps_real_pages(rng):
    seed = int(rng.integers(1 << 30))
    policy = H2O(budget=BUDGET)  # tail up to 15 tokens, so at most 1 quantized page at times
    h2o = filled(np.random.default_rng(seed), [40, 13])
    ref = filled(np.random.default_rng(seed), [40, 13])  # same tokens, nothing evicted
    state = policy.init_state(h2o)
    # Prefill: seq 0 (40 tokens) must come down to the budget at once: 3 pages go.
    prompt_q = jnp.asarray(rng.standard_normal((LAYERS, SEQS, 40, HQ, D)).astype(np.float32))
    h2o, state, st = jax.jit(policy.after_prefill)(h2o, state, prompt_q,
                                                   jnp.asarray([40, 13, 0]))
    st.raise_if_error()
    assert list(np.asarray(h2o.lengths)) == [16, 13, 0]
    steps = 22  # the reference reaches 62 of its 64 tokens
    k, v, q = _stream(rng, steps)
    for i in range(steps):
        h2o, state, _, rs, st = decode_step(h2o, state, k[i], v[i], q[i], policy=policy)
        ref, _, _, ref_status, _ = decode_step(ref, None, k[i], v[i], q[i])
        for status in (rs, st, ref_status):
            status.raise_if_error()
        lengths = np.asarray(h2o.lengths)
        assert (lengths <= policy.budget).all(), (i, lengths)
        kvc.check_invariants(h2o)
        assert int(h2o.num_free_pages) + held_pages(h2o) == h2o.spec.num_pages
        tails = lengths - np.asarray(h2o.quant_lengths)
        ref_tails = np.asarray(ref.lengths) - np.asarray(ref.quant_lengths)
        np.testing.assert_array_equal(tails, ref_tails)
        got, want = dense_kv(h2o), dense_kv(ref)
        for s in range(SEQS):
            n, rn, t = int(lengths[s]), int(ref.lengths[s]), int(tails[s])
            for x, y in zip(got, want, strict=True):
                # The tail is exactly the most recent tokens ...
                np.testing.assert_array_equal(x[:, s, :, n - t:n], y[:, s, :, rn - t:rn])
            # ... and every kept page is one of the reference's pages, in text order.
            last = -1
            for c in range((n - t) // PS):
                hits = [r for r in range(rn // PS)
                        if all(np.array_equal(x[:, s, :, c * PS:(c + 1) * PS],
                                              y[:, s, :, r * PS:(r + 1) * PS])
                               for x, y in zip(got, want, strict=True))]
                assert hits and max(hits) > last, (i, s, c)
                last = max(hits)
    # Fewer pages held than without the policy.
    assert int(h2o.num_free_pages) > int(ref.num_free_pages)


def test_undefined_combinations(rng):
    cache = filled(rng, [9])
    # The tail alone holds up to R + page_size - 1 = 15 tokens.
    with pytest.raises(UndefinedCombination, match="budget >= 15"):
        H2O(budget=14).init_state(cache)
    with pytest.raises(UndefinedCombination, match="recent"):
        H2O(budget=64, recent=8).init_state(cache)
    H2O(budget=15).init_state(cache)
    with pytest.raises(ValueError, match="top_k"):
        Quest(top_k=0)
