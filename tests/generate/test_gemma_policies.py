"""Cache policies on Gemma: the global layers scored with the model's attention, the
windowed layers keeping their window.

A tiny Gemma (a local layer with a 6-token window, then a global layer; soft-capped
attention logits at 3 and a query scale of 5 ** -0.5, not head_dim ** -0.5) on
full-precision pages (`window_pages=False`; a policy with window-only pages is refused).
Checked against references that run none of the policy code:

  * the scores H2O and SnapKV rank the global layer's tokens by are the model's attention
    probabilities, soft cap and scale included: NumPy float64 over the keys the cache holds
    and the queries the model computed;
  * SnapKV's compaction keeps the global layer's best tokens by that reference's votes;
  * SnapKV's and PyramidKV's compactions keep the local layer's newest tokens, and
    PyramidKV's and Quest's page selections skip it;
  * with the global layer muted (its attention output projection zero, so only the local
    layer's attention reaches the logits), H2O through `kvjax.generate` gives the tokens
    of a run with no policy while it evicts: the local layer keeps and reads exactly its
    window.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax.generate as gen
from kvjax.cache import ops as cache_ops
from kvjax.cache.policies import H2O, PyramidKV, Quest, SnapKV, UndefinedCombination
from kvjax.cache.policies.base import LayerAttention, bind_model
from kvjax.cache.policies.snapkv import snapkv_scores
from kvjax.models import gemma, get_family
from kvjax.rope import RopeConfig
from kvjax.serve.engine import Engine
from kvjax.specs import QuantSpec

WINDOW, PAGE, CHUNK, NEW = 6, 4, 8, 16
CAP, QSCALAR = 3.0, 5.0
LENS = (21, 13)


@pytest.fixture(scope="module")
def model_params():
    cfg = gemma.GemmaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, q_heads=4,
        kv_heads=2, head_dim=8, layer_types=(gemma.LOCAL, gemma.GLOBAL), sliding_window=WINDOW,
        rope_local=RopeConfig(theta=10000.0, dim=8), rope_global=RopeConfig(theta=1e6, dim=8),
        query_pre_attn_scalar=QSCALAR, attn_softcap=CAP, final_softcap=30.0,
        architecture="Gemma2ForCausalLM")
    fam = get_family("gemma")
    params = fam.init_params(cfg, jax.random.key(11), std=0.3)
    # An embedding of std 0.03 (times sqrt(32) at the input) lets the layers, not the
    # token's own embedding, drive the residual stream, and a final norm of ~8 spreads the
    # tied head's logits: varied greedy tokens that change when either layer is muted.
    params = dataclasses.replace(params, embed=jax.device_put(np.asarray(params.embed) / 10),
                                 final_norm=jax.device_put(np.asarray(params.final_norm) + 7))
    return fam.model(cfg), params


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(5)
    return [rng.integers(0, 64, n).tolist() for n in LENS]


def _full(**kw):
    return gen.CacheConfig(page_size=PAGE, window_pages=False, **kw)


def test_bind_model_reads_windows_soft_cap_and_scale(model_params):
    model, _ = model_params
    bound = bind_model(H2O(budget=8), model)
    assert bound.attention == LayerAttention(windows=(WINDOW, None), soft_cap=CAP,
                                             scale=QSCALAR ** -0.5)
    with pytest.raises(UndefinedCombination, match=r"budget=5 is smaller than the model's "
                                                   r"sliding window \(6 tokens\)"):
        gen.generate(model, model_params[1], [[1, 2, 3]], key=jax.random.key(0),
                     max_new_tokens=1, cache=_full(), policy=H2O(budget=5))
    with pytest.raises(UndefinedCombination, match=r"budget=4 is smaller"):
        Engine(model, model_params[1], max_seqs=1, max_seq_len=32, cache=_full(),
               policy=SnapKV(budget=4, window=2))
    with pytest.raises(UndefinedCombination, match="KIVI eviction drops whole quantized"):
        bind_model(SnapKV(budget=40, window=4), model).init_state(
            _full(quant=QuantSpec(bits=4, group_size=4, residual=4)).build(
                model, num_seqs=1, max_tokens=48))


def _dense_probs(q, k, length, q_lengths, scale, cap):
    """float64 attention probabilities [q_heads, length] summed over a row's real queries
    (query t at position length - q_lengths + t sees keys <= its position)."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)  # [T, H, D], [S, Hkv, D]
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k[:length], group, axis=1)
    s = scale * np.einsum("thd,shd->hts", q[:q_lengths], k)
    s = cap * np.tanh(s / cap)
    pos = length - q_lengths + np.arange(q_lengths)
    s = np.where(np.arange(length)[None, None, :] <= pos[None, :, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)).sum(axis=1)


def test_scores_are_the_models_attention(model_params, prompts):
    """After a prefill, on the global layer: H2O's accumulated scores and SnapKV's votes
    equal float64 softmax(cap * tanh(scale * q.k / cap)) over the cached keys (no pooling,
    kernel 1), and SnapKV's compaction keeps the top voted tokens of that reference plus
    its observation window. The windowed layer gets no scores and keeps its newest tokens
    (SnapKV, PyramidKV); Quest and PyramidKV select pages on the global layer only."""
    model, params = model_params
    cache = _full().build(model, num_seqs=2, max_tokens=32)
    h2o = bind_model(H2O(budget=64), model)  # budget past every length: scores only
    snap = bind_model(SnapKV(budget=8, window=2, kernel=1, pooling="avg"), model)
    quest = bind_model(Quest(top_k=2, dense_layers=0), model)
    # Layer budgets 12 (the windowed layer's) and 4: the windowed layer keeps 12.
    pyramid = bind_model(PyramidKV(budget=8, beta=2.0, window=2, kernel=1), model)
    tokens = np.zeros((2, 24), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    q_lengths = np.array(LENS, np.int32)
    selections = []

    @jax.jit
    def run(cache, tokens, q_lengths):
        cache, _ = cache_ops.reserve(cache, q_lengths)
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        _, cache, queries = model.apply(params, tokens, positions, cache,
                                        q_lengths=q_lengths, observe=True)
        _, state, _ = h2o.after_prefill(cache, h2o.init_state(cache), queries, q_lengths)
        votes = snapkv_scores(cache, queries, q_lengths, window=snap.window, kernel=1,
                              pooling="avg", attention=snap.attention)
        _, qstate, _ = quest.after_prefill(cache, quest.init_state(cache), queries, q_lengths)
        selections.extend(quest.before_attention(cache, qstate, layer, queries[layer, :, 0])
                          for layer in (0, 1))
        kept, _, _ = snap.after_prefill(cache, None, queries, q_lengths)
        pkept, pstate, _ = pyramid.after_prefill(cache, pyramid.init_state(cache), queries,
                                                 q_lengths)
        selections.extend(pyramid.before_attention(pkept, pstate, layer, queries[layer, :, 0])
                          for layer in (0, 1))
        return cache, queries, state.scores, votes, kept, pkept

    cache, queries, scores, votes, kept, pkept = jax.device_get(run(
        cache, jax.device_put(tokens), jax.device_put(q_lengths)))
    # Quest and PyramidKV select pages on the global layer only.
    assert selections[0] is None and selections[1] is not None
    assert selections[2] is None and selections[3] is not None
    assert not scores[0].any() and not votes[0].any()  # the windowed layer: no scores

    def keys(c, layer, r, n):
        """Row r's first n cached keys of `layer`, [n, kv_heads, D]."""
        pool, bt = np.asarray(c.pages.k[layer]), np.asarray(c.block_tables)
        k = np.concatenate([pool[:, bt[r, j]] for j in range(-(-n // PAGE))], axis=1)
        return k[:, :n].transpose(1, 0, 2)

    for r, n in enumerate(LENS):
        k = keys(cache, 1, r, n)
        want = _dense_probs(queries[1, r], k, n, n, QSCALAR ** -0.5, CAP)
        want = want.reshape(2, 2, n).sum(axis=1)  # summed over each KV head's query group
        np.testing.assert_allclose(scores[1, r, :, :n], want, rtol=2e-5, atol=1e-6)
        # SnapKV: the last 2 queries' probabilities on the positions before them, averaged
        # over each KV head's query group; it keeps each head's 6 best and the last 2.
        obs = _dense_probs(queries[1, r, n - 2: n], k, n, 2, QSCALAR ** -0.5, CAP)
        want_v = obs.reshape(2, 2, n).mean(axis=1)
        want_v[:, n - 2:] = 0.0
        np.testing.assert_allclose(votes[1, r, :, :n], want_v, rtol=2e-5, atol=1e-6)
        got = keys(kept, 1, r, 8)
        for h in range(2):
            top = np.sort(np.argsort(-want_v[h, : n - 2], kind="stable")[:6])
            np.testing.assert_array_equal(got[:, h], k[np.r_[top, n - 2, n - 1], h])
        # The windowed layer keeps its last 8 tokens (PyramidKV: 12), in order.
        np.testing.assert_array_equal(keys(kept, 0, r, 8), keys(cache, 0, r, n)[n - 8:])
        np.testing.assert_array_equal(keys(pkept, 0, r, 12), keys(cache, 0, r, n)[n - 12:])


def test_h2o_keeps_the_windowed_layer_exact(model_params, prompts):
    """Global layer muted: H2O's tokens (eviction at every decode step) equal those without
    a policy while it holds each sequence to its budget."""
    model, params = model_params
    wo = np.asarray(params.layers.wo).copy()
    wo[1] = 0
    muted = dataclasses.replace(params, layers=dataclasses.replace(
        params.layers, wo=jax.device_put(wo)))
    kw = dict(key=jax.random.key(0), max_new_tokens=NEW, chunk_size=CHUNK, free_finished=False)
    ref = gen.generate(model, muted, prompts, cache=_full(), **kw)
    ref_tokens = np.asarray(ref.tokens)
    # H2O evicts at every step (21 and 13 prompt tokens, 15 more cached by the decode
    # steps, 8 held): its recent half (4 tokens) is below the window (6), so a windowed
    # layer that kept H2O's choice instead of its newest tokens would read others.
    res = gen.generate(model, muted, prompts, cache=_full(), policy=H2O(budget=8), **kw)
    np.testing.assert_array_equal(np.asarray(res.tokens), ref_tokens)
    assert np.asarray(res.cache.lengths)[:2].tolist() == [8, 8]
