"""SnapKV and PyramidKV: observation-window votes, pooling, group mean; per-layer budgets."""

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as kvc
from kvjax.cache.policies import PyramidKV, SnapKV, snapkv_scores
from kvjax.specs import AttentionSpec, CacheSpec
from tests.cache.policies.helpers import (
    KIVI,
    SPEC,
    attend,
    dense_kv,
    random_filled_cache,
    select,
    write,
)

# The observation window (queries at positions 6 and 7) of one GQA group of two query heads,
# written out. Head A, then head B; position 7 is invisible to the query at 6.
P_A = np.array([[0.05, 0.40, 0.05, 0.05, 0.05, 0.05, 0.35, 0.00],
                [0.05, 0.30, 0.05, 0.05, 0.05, 0.10, 0.20, 0.20]])
P_B = np.array([[0.10, 0.05, 0.05, 0.50, 0.05, 0.05, 0.20, 0.00],
                [0.10, 0.05, 0.05, 0.40, 0.05, 0.05, 0.10, 0.20]])
# Votes for the prefix 0..5: A [.10 .70 .10 .10 .10 .15], B [.20 .10 .10 .90 .10 .10].
# Max-pooled, kernel 3: A [.70 .70 .70 .10 .15 .15], B [.20 .20 .90 .90 .90 .10].
# Group mean: [.45 .45 .80 .50 .525 .125] -> top 2 are positions 2 and 4 (without pooling
# the mean [.15 .40 .10 .50 .10 .125] would pick 3 and 1).
POOLED_MEAN = np.array([0.45, 0.45, 0.80, 0.50, 0.525, 0.125])


def _setup(rng, num_layers):
    spec = CacheSpec(attention=AttentionSpec(q_heads=2, kv_heads=1, head_dim=8),
                     num_layers=num_layers, page_size=2, num_pages=12, max_seqs=1,
                     max_pages_per_seq=6)
    cache, status = kvc.reserve(kvc.init_cache(spec), np.array([8], np.int32))
    status.raise_if_error()
    # Key j is the unit vector e_j, so logit_j = q_j / sqrt(8): a query of sqrt(8) log p
    # gives exactly the probabilities p.
    keys = np.eye(8, dtype=np.float32)[None, :, None]
    for layer in range(num_layers):
        vals = rng.standard_normal((1, 8, 1, 8)).astype(np.float32)
        cache = write(cache, layer, keys, vals, np.array([8], np.int32))
    q = rng.standard_normal((num_layers, 1, 8, 2, 8)).astype(np.float32)
    with np.errstate(divide="ignore"):
        for t, row in enumerate((6, 7)):
            for h, p in enumerate((P_A, P_B)):
                q[:, 0, row, h] = np.sqrt(8) * np.where(p[t] > 0, np.log(p[t]), 0.0)
    return cache, jax.device_put(q)


def test_snapkv_hand_example(rng):
    cache, q = _setup(rng, 1)
    policy = SnapKV(budget=4, window=2, kernel=3)
    scores = jax.jit(snapkv_scores, static_argnames=("window", "kernel"))(
        cache, q, jnp.asarray([8]), window=2, kernel=3)
    np.testing.assert_allclose(scores[0, 0, 0, :6], POOLED_MEAN, rtol=1e-5)
    assert (np.asarray(scores)[0, 0, 0, 6:] == 0).all()
    k_before, v_before = dense_kv(cache)
    free0 = int(cache.num_free_pages)
    out, _, status = jax.jit(policy.after_prefill)(cache, None, q, jnp.asarray([8]))
    status.raise_if_error()
    kvc.check_invariants(out)
    dk, dv = dense_kv(out)
    assert int(out.lengths[0]) == 4
    np.testing.assert_array_equal(dk[0, 0, 0, :4], np.eye(8)[[2, 4, 6, 7]])
    np.testing.assert_array_equal(dv[0, 0, 0, :4], v_before[0, 0, 0, [2, 4, 6, 7]])
    assert int(out.num_free_pages) == free0 + 2  # 4 pages -> 2


def test_pyramidkv_hand_example(rng):
    cache, q = _setup(rng, 2)
    # Average 4 tokens per layer, top layer 4 / beta = 3, bottom 2 * 4 - 3 = 5; with 2-token
    # pages the top layer rounds to 5 - 1 page = 3 tokens: 1 heavy hitter + the window.
    policy = PyramidKV(budget=4, beta=4 / 3, window=2, kernel=3)
    assert policy.layer_budgets(2, 2) == (5, 3)
    state = policy.init_state(cache)
    _, v_before = dense_kv(cache)
    free0 = int(cache.num_free_pages)
    out, state, status = jax.jit(policy.after_prefill)(cache, state, q, jnp.asarray([8]))
    status.raise_if_error()
    kvc.check_invariants(out)
    assert int(out.lengths[0]) == 5
    assert int(out.num_free_pages) == free0 + 1  # 4 pages -> 3: the bottom layer's budget
    assert np.asarray(state.skip)[:, 0].tolist() == [0, 1]
    dk, dv = dense_kv(out)
    bottom, top = [2, 3, 4, 6, 7], [2, 6, 7]  # top 3 / top 1 of POOLED_MEAN + the window
    np.testing.assert_array_equal(dk[0, 0, 0, :5], np.eye(8)[bottom])
    np.testing.assert_array_equal(dk[1, 0, 0, 2:5], np.eye(8)[top])
    np.testing.assert_array_equal(dv[1, 0, 0, 2:5], v_before[1, 0, 0, top])
    # The top layer reads only its 3 tokens: attention equals attention over them alone.
    qd = jax.device_put(rng.standard_normal((1, 2, 8)).astype(np.float32))
    sel = select(policy, out, state, 1, qd)
    assert np.asarray(sel.lengths).tolist() == [[3]]
    got, _ = attend(out, 1, qd[:, None], np.array([1], np.int32), sel)
    logits = np.asarray(qd[0]) @ np.eye(8)[top].T / np.sqrt(8)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(got[0, 0], p @ v_before[1, 0, 0, top], rtol=1e-5, atol=1e-6)


def test_pyramidkv_keeps_a_prompt_within_the_bottom_budget_whole(rng):
    """A prompt that fits the bottom layer's budget stays whole in every layer: the cache
    is untouched, and every layer's selection reads what plain decode attention reads."""
    cache, _, _ = random_filled_cache(SPEC, [13, 7], rng)
    policy = PyramidKV(budget=12, beta=1.5, window=4, kernel=3)
    assert policy.layer_budgets(2, 4) == (16, 8)  # the top layer alone would keep 8
    q = jnp.asarray(rng.standard_normal((2, 2, 13, 4, 8)), jnp.float32)
    out, state, status = jax.jit(policy.after_prefill)(cache, policy.init_state(cache), q,
                                                       jnp.asarray([13, 7]))
    status.raise_if_error()
    for x, y in zip(jax.tree.leaves(out), jax.tree.leaves(cache), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert not np.asarray(state.skip).any()
    qd = jax.device_put(rng.standard_normal((2, 1, 4, 8)).astype(np.float32))
    ones = np.ones((2,), np.int32)
    for layer in range(2):
        want, _ = attend(out, layer, qd, ones)
        sel = select(policy, out, state, layer, qd[:, 0])
        got, _ = attend(out, layer, qd, ones, sel)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- KIVI pages

LENGTHS = [30, 11]  # seq 0: 6 quantized pages of 4 + a tail of 6; seq 1 under every budget


def _votes(keys, q, n, window, kernel):
    """SnapKV's votes of one sequence in NumPy: float64 [layers, kv_heads, n].

    keys [layers, kv_heads, tokens, d] (as attention reads them), q [layers, n, q_heads, d]:
    the window's (last `window`) queries' causal attention probabilities summed over the
    window, zero outside the prefix, max-pooled (centred, zero padding), averaged over
    each KV head's query group.
    """
    layers, hk = keys.shape[:2]
    hq = q.shape[2]
    prefix = n - min(window, n)
    half = kernel // 2
    out = np.zeros((layers, hk, n))
    for layer in range(layers):
        for h in range(hq):
            v = np.zeros(n)
            for t in range(prefix, n):
                logits = keys[layer, h // (hq // hk), :t + 1] @ q[layer, t, h] / np.sqrt(8)
                p = np.exp(logits - logits.max())
                v[:t + 1] += p / p.sum()
            v[prefix:] = 0
            pooled = np.array([v[max(j - half, 0):j + kernel - half].max() for j in range(n)])
            out[layer, h // (hq // hk), :prefix] += pooled[:prefix] / (hq // hk)
    return out


def _kivi_prefilled(rng):
    cache, _, _ = random_filled_cache(KIVI, LENGTHS, rng)
    q = rng.standard_normal((2, 2, 30, 4, 8)).astype(np.float32)  # the prompts' queries
    keys, _ = dense_kv(cache)
    return cache, q, keys[:, 0].astype(np.float64)


def _kept_columns(before, after, n_pages):
    """The old block-table columns of the quantized pages seq 0 still holds, in order."""
    old = np.asarray(before.block_tables)[0].tolist()
    return [old.index(p) for p in np.asarray(after.block_tables)[0, :n_pages]]


def test_kivi_snapkv_evicts_the_lowest_voted_pages_and_keeps_the_window_pages(rng):
    """Page-granular SnapKV: pages go whole, lowest summed votes first; the pages holding
    the observation window and the tail always stay."""
    cache, q, keys = _kivi_prefilled(rng)
    before = dense_kv(cache)
    free0 = int(cache.num_free_pages)
    # Budget 15: 15 over, so 4 of the 6 pages go. The window (positions 22..29) starts in
    # page 5, which stays: one of pages 0..4 survives, the most voted.
    policy = SnapKV(budget=15, window=8, kernel=3)
    out, _, status = jax.jit(policy.after_prefill)(cache, policy.init_state(cache),
                                                   jnp.asarray(q), jnp.asarray(LENGTHS))
    status.raise_if_error()
    kvc.check_invariants(out)
    assert np.asarray(out.lengths).tolist() == [14, 11]
    assert int(out.num_free_pages) == free0 + 4
    cols = _kept_columns(cache, out, 2)
    mass = _votes(keys, q[:, 0], 30, 8, 3).sum(axis=(0, 1))[:24].reshape(6, 4).sum(-1)
    assert cols[1] == 5
    assert mass[cols[0]] >= np.delete(mass[:5], cols[0]).max() - 1e-5, (cols, mass)
    kept = np.r_[4 * cols[0]:4 * cols[0] + 4, 20:30]
    for x, y in zip(dense_kv(out), before, strict=True):
        np.testing.assert_array_equal(x[:, 0, :, :14], y[:, 0][:, :, kept])
        np.testing.assert_array_equal(x[:, 1, :, :11], y[:, 1, :, :11])


def test_kivi_pyramidkv_frees_to_the_bottom_budget_and_each_layer_reads_its_own_pages(rng):
    """Page-granular PyramidKV: memory comes back down to the bottom layer's budget (as
    SnapKV); the top layer then stops reading its own lowest-voted kept pages."""
    cache, q, keys = _kivi_prefilled(rng)
    policy = PyramidKV(budget=14, beta=1.4, window=4, kernel=3)
    assert policy.layer_budgets(2, 4) == (18, 10)
    out, state, status = jax.jit(policy.after_prefill)(cache, policy.init_state(cache),
                                                       jnp.asarray(q), jnp.asarray(LENGTHS))
    status.raise_if_error()
    kvc.check_invariants(out)
    # 30 tokens, 12 over 18: 3 pages go, 3 pages + the tail of 6 stay.
    assert np.asarray(out.lengths).tolist() == [18, 11]
    votes = _votes(keys, q[:, 0], 30, 4, 3)[..., :24].reshape(2, 2, 6, 4).sum(axis=(1, 3))
    cols = _kept_columns(cache, out, 3)
    dropped = sorted(set(range(6)) - set(cols))
    assert votes.sum(0)[cols].min() >= votes.sum(0)[dropped].max() - 1e-5, (cols, votes)
    # Layer 1 reads at most 10: 2 of its 3 kept pages drop, its lowest-voted.
    drop = np.asarray(state.drop)[:, 0]
    assert not drop[0].any() and drop[1].sum() == 2
    read1 = [c for i, c in enumerate(cols) if not drop[1, i]]
    assert votes[1, read1[0]] >= votes[1, [c for c in cols if c != read1[0]]].max() - 1e-5
    # Each layer's attention reads exactly its pages plus the tail.
    qd = jax.device_put(rng.standard_normal((2, 4, 8)).astype(np.float32))
    da, db = dense_kv(out)
    for layer, read in ((0, [0, 1, 2]), (1, [cols.index(read1[0])])):
        sel = select(policy, out, state, layer, qd)
        got, _ = attend(out, layer, qd[:, None], np.array([1, 1], np.int32), sel)
        toks = np.r_[tuple(np.arange(4 * i, 4 * i + 4) for i in read) + (np.arange(12, 18),)]
        for h in range(4):
            k, v = da[layer, 0, h // 2, toks], db[layer, 0, h // 2, toks]
            logits = k @ np.asarray(qd[0, h]) / np.sqrt(8)
            p = np.exp(logits - logits.max())
            np.testing.assert_allclose(got[0, 0, h], (p / p.sum()) @ v, rtol=1e-5, atol=1e-5)
