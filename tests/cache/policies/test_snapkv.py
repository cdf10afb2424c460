"""SnapKV and PyramidKV: observation-window votes, pooling, group mean; per-layer budgets."""

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import init_cache, paged
from kvjax.cache import page_table as pt
from kvjax.cache.policies import PyramidKV, SnapKV, selected_decode_attention
from kvjax.cache.policies.toy import dense_kv
from kvjax.specs import AttentionSpec, CacheSpec

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
    cache = init_cache(spec)
    cache, _ = paged.reserve(cache, jnp.asarray([8]))
    slots = paged.token_slots(cache, jnp.arange(8)[None], jnp.ones((1, 8), bool))
    # Key j is the unit vector e_j, so logit_j = q_j / sqrt(8): a query of sqrt(8) log p
    # gives exactly the probabilities p.
    keys = jnp.asarray(np.eye(8, dtype=np.float32)[None, :, None])
    for layer in range(num_layers):
        vals = jnp.asarray(rng.standard_normal((1, 8, 1, 8)), jnp.float32)
        cache = paged.write_layer(cache, layer, slots, keys, vals)
    q = rng.standard_normal((num_layers, 1, 8, 2, 8)).astype(np.float32)
    with np.errstate(divide="ignore"):
        for t, row in enumerate((6, 7)):
            for h, p in enumerate((P_A, P_B)):
                q[:, 0, row, h] = np.sqrt(8) * np.where(p[t] > 0, np.log(p[t]), 0.0)
    return cache, jnp.asarray(q)


def test_snapkv_hand_example(rng):
    cache, q = _setup(rng, 1)
    policy = SnapKV(budget=4, window=2, kernel=3)
    from kvjax.cache.policies import snapkv_scores

    scores = snapkv_scores(cache, q, jnp.asarray([8]), window=2, kernel=3)
    np.testing.assert_allclose(scores[0, 0, 0, :6], POOLED_MEAN, rtol=1e-5)
    assert (np.asarray(scores)[0, 0, 0, 6:] == 0).all()
    k_before, v_before = dense_kv(cache)
    free0 = int(cache.num_free_pages)
    out, _, status = jax.jit(policy.after_prefill)(cache, None, q, jnp.asarray([8]))
    status.raise_if_error()
    pt.check_invariants(out.table)
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
    pt.check_invariants(out.table)
    assert int(out.lengths[0]) == 5
    assert int(out.num_free_pages) == free0 + 1  # 4 pages -> 3: the bottom layer's budget
    assert np.asarray(state.skip)[:, 0].tolist() == [0, 1]
    dk, dv = dense_kv(out)
    bottom, top = [2, 3, 4, 6, 7], [2, 6, 7]  # top 3 / top 1 of POOLED_MEAN + the window
    np.testing.assert_array_equal(dk[0, 0, 0, :5], np.eye(8)[bottom])
    np.testing.assert_array_equal(dk[1, 0, 0, 2:5], np.eye(8)[top])
    np.testing.assert_array_equal(dv[1, 0, 0, 2:5], v_before[1, 0, 0, top])
    # The top layer reads only its 3 tokens: attention equals attention over them alone.
    qd = jnp.asarray(rng.standard_normal((1, 2, 8)), jnp.float32)
    sel = policy.before_attention(out, state, 1, qd)
    assert np.asarray(sel.lengths).tolist() == [[3]]
    got, _ = selected_decode_attention(qd, out.pages.k[1], out.pages.v[1], sel)
    logits = np.asarray(qd[0]) @ np.eye(8)[top].T / np.sqrt(8)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(got[0], p @ v_before[1, 0, 0, top], rtol=1e-5, atol=1e-6)
