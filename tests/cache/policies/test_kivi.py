"""Quest and page-granular H2O on a KIVI-quantized cache (kvjax.cache.policies.kivi)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax as kvx
from kvjax.attention import quantized_decode_attention
from kvjax.attention.quantized_selected import quantized_selected_decode_attention
from kvjax.cache import check_invariants
from kvjax.cache import quantized as qz
from kvjax.cache.policies import H2O, KIVIH2O, KIVIH2OState, KIVIPolicy, KIVIQuest, NoPolicy
from kvjax.cache.policies.kivi import kivi_key_bounds
from kvjax.cache.quant import dequantize
from kvjax.specs import QuantSpec

PS, RES, HQ, HKV, D, LAYERS = 8, 8, 4, 2, 16, 2


SEQS, PAD = 3, 56  # slots; prefill arrays are padded to PAD tokens (one compile)


def make_spec(*, bits=4, max_seqs=SEQS, num_pages=24, max_pages=8):
    return kvx.CacheSpec(
        attention=kvx.AttentionSpec(q_heads=HQ, kv_heads=HKV, head_dim=D), num_layers=LAYERS,
        page_size=PS, num_pages=num_pages, max_seqs=max_seqs, max_pages_per_seq=max_pages,
        dtype="float32", quant=QuantSpec(bits=bits, group_size=4, residual=RES))


@functools.partial(jax.jit, donate_argnames="cache")
def _fill(cache, lengths, kv):
    cache, status = qz.reserve(cache, lengths)
    for layer in range(LAYERS):
        cache = qz.write_layer(cache, layer, kv[layer, 0], kv[layer, 1])
    return cache, status


def filled(rng, lengths, *, bits=4, constant_channel=False):
    """A cache holding `lengths` random tokens per slot (one prefill)."""
    cache = qz.init_quantized_cache(make_spec(bits=bits))
    lengths = np.asarray(list(lengths) + [0] * (SEQS - len(lengths)), np.int32)
    kv = rng.standard_normal((LAYERS, 2, SEQS, PAD, HKV, D)).astype(np.float32)
    if constant_channel:  # a constant channel over the first page: scale 0
        kv[:, 0, :, :PS, :, 0] = 0.375
    cache, status = _fill(cache, jnp.asarray(lengths), jnp.asarray(kv))
    status.raise_if_error()
    return cache


@functools.partial(jax.jit, static_argnames=("layer",))
def _deq_pool(cache, layer):
    view = qz.layer_view(cache, layer)
    return tuple(dequantize(p.codes, p.scale, p.zero, bits=p.bits, grouping=p.grouping)
                 for p in (view.k, view.v))


def deq_keys(cache, layer, seq):
    """float32 [heads, pages, page_size, D]: the dequantized key pages of a sequence."""
    n = int(cache.quant_lengths[seq]) // PS
    return np.asarray(_deq_pool(cache, layer)[0])[:, np.asarray(cache.block_tables)[seq, :n]]


def readback(cache, layer, seq):
    """(K, V) float32 [tokens, heads, D] of a sequence: dequantized pages, then the tail."""
    pools = [np.asarray(x) for x in _deq_pool(cache, layer)]
    tails = np.asarray(cache.tail.a[layer]), np.asarray(cache.tail.b[layer])
    ln, ql = int(cache.lengths[seq]), int(cache.quant_lengths[seq])
    pages = np.asarray(cache.block_tables)[seq, :ql // PS]
    ring = tails[0].shape[2]
    out = []
    for pool, tail in zip(pools, tails, strict=True):
        x = pool[:, pages].reshape(HKV, -1, D)
        out.append(np.concatenate([x, tail[:, seq, np.arange(ql, ln) % ring]], 1)
                   .transpose(1, 0, 2))
    return out[0], out[1]


@functools.partial(jax.jit, static_argnames=("policy", "layer"))
def _before(cache, q, *, policy, layer):
    return policy.before_attention(cache, None, layer, q)


_selected = jax.jit(quantized_selected_decode_attention)
_plain = jax.jit(quantized_decode_attention)


@pytest.mark.parametrize("bits", [2, 4])
def test_bounds_from_scales_equal_bounds_of_dequantized_keys(bits, rng):
    cache = filled(rng, [40, 27], bits=bits, constant_channel=True)
    q = rng.standard_normal((HQ, D)).astype(np.float32)
    for layer in range(LAYERS):
        view = qz.layer_view(cache, layer)
        kmin_all, kmax_all = jax.jit(kivi_key_bounds, static_argnums=2)(
            view.k.scale, view.k.zero, bits)
        for seq in range(2):
            n = int(cache.quant_lengths[seq]) // PS
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
    p0 = int(cache.block_tables[0, 0])
    assert float(kmin_all[0, p0, 0]) == float(kmax_all[0, p0, 0]) == 0.375


def _np_attention(q, k, v):
    """q [hq, D], k/v [tokens, hkv, D] float64 -> [hq, D]."""
    g = HQ // HKV
    out = []
    for h in range(HQ):
        logits = k[:, h // g] @ q[h] / np.sqrt(D)
        p = np.exp(logits - logits.max())
        out.append((p / p.sum()) @ v[:, h // g])
    return np.stack(out)


def test_quest_selects_top_pages_and_attends_over_them_plus_tail(rng):
    cache = filled(rng, [50, 35])  # 5 and 3 quantized pages; tails of 10 and 11 tokens
    q = jnp.asarray(rng.standard_normal((SEQS, HQ, D)).astype(np.float32))
    policy = KIVIQuest(top_k=2, dense_layers=1)
    assert policy.init_state(cache) is None
    assert policy.before_attention(cache, None, 0, q) is None  # a dense layer
    sel = _before(cache, q, policy=policy, layer=1)
    out, _ = _selected(q, qz.layer_view(cache, 1), sel)
    bt = np.asarray(cache.block_tables)
    for seq in range(2):
        k = deq_keys(cache, 1, seq).astype(np.float64)  # [H, n, ps, D]
        kmin, kmax = k.min(axis=2), k.max(axis=2)
        qq = np.asarray(q[seq], np.float64)
        a, b = readback(cache, 1, seq)  # [tokens, H, D]
        n, ql = k.shape[1], int(cache.quant_lengths[seq])
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
        assert n == (5, 3)[seq]


def test_quest_with_every_page_equals_plain_quantized_attention(rng):
    cache = filled(rng, [50, 35])
    q = jnp.asarray(rng.standard_normal((SEQS, HQ, D)).astype(np.float32))
    view = qz.layer_view(cache, 1)
    plain, plain_lse = _plain(q, view)
    # top_k >= the table width: no selection at all, the plain op runs.
    assert KIVIQuest(top_k=8, dense_layers=0).before_attention(cache, None, 1, q) is None
    # top_k = 5 >= every sequence's quantized pages: the selected path reads them all.
    sel = _before(cache, q, policy=KIVIQuest(top_k=5, dense_layers=0), layer=1)
    out, lse = _selected(q, view, sel)
    # Same pages in the same order; only the batching of the einsums differs (f32).
    np.testing.assert_allclose(np.asarray(out), np.asarray(plain), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(plain_lse), rtol=1e-6, atol=1e-6)


@functools.partial(jax.jit, static_argnames="policy", donate_argnames="cache")
def _decode_step(cache, state, k, v, q, *, policy):
    """One decode step of every slot: reserve, write every layer, attend, policy hooks."""
    cache, status = qz.reserve(cache, jnp.ones_like(cache.lengths))
    outs = []
    for layer in range(LAYERS):
        cache = qz.write_layer(cache, layer, k[layer], v[layer])
        view = qz.layer_view(cache, layer)
        sel = policy.before_attention(cache, state, layer, q[layer]) if isinstance(
            policy, KIVIPolicy) else None
        if sel is None:
            out, _ = quantized_decode_attention(q[layer], view)
        else:
            out, _ = quantized_selected_decode_attention(q[layer], view, sel)
        outs.append(out)
    p_status = status
    if isinstance(policy, KIVIPolicy):
        cache, state, p_status = policy.after_step(cache, state, q)
    return cache, state, jnp.stack(outs), status, p_status


def _stream(rng, steps, seqs=SEQS):
    k = rng.standard_normal((steps, LAYERS, seqs, 1, HKV, D)).astype(np.float32)
    v = rng.standard_normal((steps, LAYERS, seqs, 1, HKV, D)).astype(np.float32)
    q = rng.standard_normal((steps, LAYERS, seqs, HQ, D)).astype(np.float32)
    return k, v, q


BUDGET = 20  # one policy for both decode tests: one compiled step


def test_h2o_with_budget_over_every_length_is_no_policy(rng):
    seed = int(rng.integers(1 << 30))
    caches = [filled(np.random.default_rng(seed), [5, 3]) for _ in range(2)]
    k, v, q = _stream(rng, 12)  # lengths reach 17, 15 and 12, all within the budget
    policy = KIVIH2O(budget=BUDGET)
    state = policy.init_state(caches[1])
    for i in range(12):
        caches[0], _, want, _, _ = _decode_step(caches[0], None, k[i], v[i], q[i],
                                                policy=NoPolicy())
        caches[1], state, got, _, st = _decode_step(caches[1], state, k[i], v[i], q[i],
                                                    policy=policy)
        st.raise_if_error()
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for a, b in zip(jax.tree.leaves(caches[0]), jax.tree.leaves(caches[1]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(jnp.sum(state.scores)) > 0


@functools.partial(jax.jit, static_argnames="policy")
def _evict(cache, state, rows, *, policy):
    return policy._evict(cache, state, rows)


@functools.partial(jax.jit, static_argnames="policy")
def _after_prefill(cache, state, queries, q_lengths, *, policy):
    return policy.after_prefill(cache, state, queries, q_lengths)


@pytest.mark.parametrize("forked", [False, True])
def test_h2o_evicts_the_lowest_mass_page_and_frees_it(forked, rng):
    cache = filled(rng, [40, 27])  # seq 0: 4 quantized pages + 8 tail tokens
    if forked:
        cache, st = qz.fork(cache, jnp.asarray([0]), jnp.asarray([2]))
        st.raise_if_error()
    policy = KIVIH2O(budget=33)  # seq 0 is 7 over: one page goes; seq 1 (27) stays
    scores = rng.uniform(0.5, 1.0, (3, 64)).astype(np.float32)
    scores[0, 2 * PS:3 * PS] *= 0.01  # page 2 of seq 0 has the lowest mass
    old_bt = np.asarray(cache.block_tables).copy()
    old_free = int(cache.num_free_pages)
    old = [readback(cache, layer, s) for layer in range(LAYERS) for s in (0, 1)]
    victim = old_bt[0, 2]
    rows = jnp.asarray([True, True, False])
    cache, state, status = _evict(cache, KIVIH2OState(scores=jnp.asarray(scores)), rows,
                                  policy=policy)
    status.raise_if_error()
    check_invariants(cache.table)
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
    np.testing.assert_array_equal(np.asarray(state.scores)[0, :32], scores[0, keep])
    assert not np.asarray(state.scores)[0, 32:].any()
    rc = np.asarray(cache.table.refcounts)
    free = set(np.asarray(cache.table.free_stack)[:int(cache.num_free_pages)].tolist())
    if forked:  # the fork still holds the page: one reference less, not freed
        assert rc[victim] == 1 and victim not in free
        assert int(cache.num_free_pages) == old_free
        cache = qz.free(cache, jnp.asarray([False, False, True]))
        check_invariants(cache.table)
        free = set(np.asarray(cache.table.free_stack)[:int(cache.num_free_pages)].tolist())
    else:
        assert int(cache.num_free_pages) == old_free + 1
    assert rc[victim] == 0 or forked
    assert victim in free


def test_h2o_holds_the_budget_at_every_step_and_keeps_real_pages(rng):
    seed = int(rng.integers(1 << 30))
    policy = KIVIH2O(budget=BUDGET)  # tail up to 15 tokens, so at most 1 quantized page at times
    h2o = filled(np.random.default_rng(seed), [40, 13])
    ref = filled(np.random.default_rng(seed), [40, 13])  # same tokens, nothing evicted
    state = policy.init_state(h2o)
    # Prefill: seq 0 (40 tokens) must come down to the budget at once: 3 pages go.
    prompt_q = jnp.asarray(rng.standard_normal((LAYERS, SEQS, 40, HQ, D)).astype(np.float32))
    h2o, state, st = _after_prefill(h2o, state, prompt_q, jnp.asarray([40, 13, 0]),
                                    policy=policy)
    st.raise_if_error()
    assert list(np.asarray(h2o.lengths)) == [16, 13, 0]
    steps = 22  # the reference reaches 62 of its 64 tokens
    k, v, q = _stream(rng, steps)
    for i in range(steps):
        h2o, state, _, rs, st = _decode_step(h2o, state, k[i], v[i], q[i], policy=policy)
        ref, _, _, ref_status, _ = _decode_step(ref, None, k[i], v[i], q[i], policy=NoPolicy())
        for status in (rs, st, ref_status):
            status.raise_if_error()
        lengths = np.asarray(h2o.lengths)
        assert (lengths <= policy.budget).all(), (i, lengths)
        check_invariants(h2o.table)
        held = int(np.sum(-(-np.asarray(h2o.quant_lengths) // PS)))
        assert int(h2o.num_free_pages) + held == h2o.spec.num_pages
        for s in range(SEQS):
            for layer in range(LAYERS):
                a, b = readback(h2o, layer, s)
                ra, rb = readback(ref, layer, s)
                t = int(h2o.tail_lengths[s])
                assert t == int(ref.tail_lengths[s])
                # The tail is exactly the most recent tokens ...
                np.testing.assert_array_equal(a[len(a) - t:], ra[len(ra) - t:])
                np.testing.assert_array_equal(b[len(b) - t:], rb[len(rb) - t:])
                # ... and every kept page is one of the reference's pages, in text order.
                last = -1
                for c in range((len(a) - t) // PS):
                    page = a[c * PS:(c + 1) * PS]
                    hits = [r for r in range(len(ra) // PS)
                            if np.array_equal(page, ra[r * PS:(r + 1) * PS])]
                    assert hits and max(hits) > last
                    last = max(hits)
                    np.testing.assert_array_equal(b[c * PS:(c + 1) * PS],
                                                  rb[last * PS:(last + 1) * PS])
    # Fewer pages held than without the policy.
    assert int(h2o.num_free_pages) > int(ref.num_free_pages)


def test_configuration_errors(rng):
    from kvjax.decoding import CacheConfig

    with pytest.raises(ValueError, match="KIVIQuest and KIVIH2O"):
        CacheConfig(name="x", bits=4, policy=H2O(budget=64))
    with pytest.raises(ValueError, match="set bits"):
        CacheConfig(name="x", policy=KIVIH2O(budget=64))
    CacheConfig(name="ok", bits=2, policy=KIVIH2O(budget=64))
    cache = filled(rng, [9])
    with pytest.raises(ValueError, match="budget >= 15"):
        KIVIH2O(budget=14).init_state(cache)
    with pytest.raises(ValueError, match="top_k"):
        KIVIQuest(top_k=0)
    with pytest.raises(ValueError, match="QuantizedKVCache"):
        KIVIQuest().init_state(kvx.init_cache(dataclass_replace_quant(cache.spec)))


def dataclass_replace_quant(spec):
    import dataclasses

    return dataclasses.replace(spec, quant=None)
