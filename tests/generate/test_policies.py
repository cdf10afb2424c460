"""Cache policies driven by the real decode loop on a tiny HF Llama (GQA 8:2, 2 layers)."""

import jax
import numpy as np
import pytest

import kvjax.cache as kv_cache
import kvjax.generate as gen
import kvjax.models as models
from kvjax.cache.policies import H2O, Quest, SnapKV, StreamingLLM
from tests.models import hf_tiny

PAGE = 8
LENS = (5, 13, 21)
MAX_NEW = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    m = hf_tiny.build("llama_gqa")
    d = tmp_path_factory.mktemp("llama_gqa_policies")
    m.save_pretrained(d)
    return models.load(str(d))


def _cache(model):
    # 12 pages (96 tokens) per sequence: budgets below that make the policies act.
    return kv_cache.init_cache(
        gen.CacheConfig(page_size=PAGE).spec(model, num_seqs=3, max_tokens=96))


def _prompts(rng, vocab):
    return [rng.integers(3, vocab, n).tolist() for n in LENS]


# Budgets under the cache's 96 tokens per sequence but over the 21 + 12 this decode
# reaches; Quest's 6 pages cover every page of a 33-token sequence (in score order).
KEEP_ALL = {
    "streaming_llm": StreamingLLM(n_sink=4, window=44),
    "h2o": H2O(budget=48, recent=8),
    "snapkv": SnapKV(budget=48, window=4, kernel=3),
    "quest": Quest(top_k=6, dense_layers=0),
}


@pytest.fixture(scope="module")
def baseline(tiny):
    model, params = tiny
    prompts = _prompts(np.random.default_rng(0), model.vocab_size)
    res = gen.generate(model, params, prompts, key=jax.random.key(0), max_new_tokens=MAX_NEW,
                       cache=_cache(model), chunk_size=32)
    return prompts, res.tokens


@pytest.mark.parametrize("name", sorted(KEEP_ALL))
def test_budget_keeping_every_token_generates_like_no_policy(tiny, baseline, name):
    model, params = tiny
    prompts, want = baseline
    res = gen.generate(model, params, prompts, key=jax.random.key(0), max_new_tokens=MAX_NEW,
                       cache=_cache(model), chunk_size=32, policy=KEEP_ALL[name])
    np.testing.assert_array_equal(res.tokens, want)


def test_h2o_in_the_loop_keeps_its_budget_and_returns_pages(tiny, rng):
    model, params = tiny
    prompts = _prompts(rng, model.vocab_size)
    policy = H2O(budget=12, recent=4)
    cache = _cache(model)
    num_pages = cache.spec.num_pages
    peak = 0
    for event in gen.stream(model, params, prompts, key=jax.random.key(1),
                            max_new_tokens=MAX_NEW, cache=cache, chunk_size=32, policy=policy,
                            free_finished=False):
        c = event.state.cache
        kv_cache.check_invariants(c.table)
        lengths = np.asarray(c.lengths)
        assert lengths.max() <= policy.budget
        used = int((-(-lengths // PAGE)).sum())
        assert int(c.num_free_pages) == num_pages - used  # evicted pages are back in the pool
        peak = max(peak, used)
    assert event.state.status.code == 0
    assert np.asarray(event.state.num_generated).tolist() == [MAX_NEW] * 3
    # 12 tokens = 2 pages per sequence, against ceil(33 / 8) = 5 for the longest without it.
    assert peak == 3 * 2


def test_undefined_combination_is_refused_before_any_work(tiny, rng):
    """A policy on a page kind where its method is undefined raises from init_state, in
    generate before the caller's cache is touched; the cache still works afterwards."""
    from kvjax.cache.policies import UndefinedCombination
    from kvjax.specs import QuantSpec

    model, params = tiny
    spec = gen.CacheConfig(page_size=PAGE).spec(model, num_seqs=3, max_tokens=96)
    cache = kv_cache.init_cache(spec.replace(quant=QuantSpec(bits=4, group_size=8,
                                                             residual=8)))
    prompts = _prompts(rng, model.vocab_size)
    # Re-rotating quantized keys is not defined; neither is a budget below the largest tail.
    for policy in (StreamingLLM(n_sink=4, window=60, positions="cache"), H2O(budget=8)):
        with pytest.raises(UndefinedCombination, match="KIVI"):
            gen.generate(model, params, prompts, key=jax.random.key(0), max_new_tokens=4,
                         cache=cache, policy=policy)
    res = gen.generate(model, params, prompts, key=jax.random.key(0), max_new_tokens=4,
                       cache=cache)
    assert (res.num_generated == 4).all()


def test_policies_on_sliding_window_models_follow_the_windows(tiny, rng):
    """generate and the serving engine bind a policy to the model's windows
    (`setup.check_policy_model`): on a windowed layer, eviction keeps the newest tokens, so
    a budget below the window is refused before any work; a model without windows or soft
    cap leaves the policy as it is. (Gemma: tests/generate/test_gemma_policies.py.)"""
    import dataclasses

    from kvjax.cache.policies import UndefinedCombination
    from kvjax.generate import setup
    from kvjax.models.base import get_family
    from kvjax.serve.engine import Engine

    model, params = tiny
    windows = (None,) * (model.config.num_layers - 1) + (6,)
    windowed = get_family("llama").model(dataclasses.replace(model.config,
                                                             sliding_windows=windows))
    prompts = _prompts(rng, model.vocab_size)
    for policy in (H2O(budget=4), SnapKV(budget=5, window=2)):
        with pytest.raises(UndefinedCombination, match=r"smaller than the model's sliding "
                                                       r"window \(6 tokens\)"):
            gen.generate(windowed, params, prompts, key=jax.random.key(0), max_new_tokens=2,
                         cache=gen.CacheConfig(page_size=PAGE, window_pages=False),
                         policy=policy)
        with pytest.raises(UndefinedCombination, match="sliding window"):
            Engine(windowed, params, max_seqs=2, max_seq_len=64,
                   cache=gen.CacheConfig(page_size=PAGE, window_pages=False), policy=policy)
        assert setup.check_policy_model(policy, model) is policy  # no window, no soft cap
    bound = setup.check_policy_model(Quest(top_k=6, dense_layers=0), windowed)
    assert bound.attention.windows == windows and bound.attention.soft_cap is None
