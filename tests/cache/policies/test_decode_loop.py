"""Every policy over a long decode through `kvjax.generate` on a tiny random Llama: the
budget holds after the prefill and every step, evicted pages really return to the pool,
Quest's summaries track every page, and a budget that keeps every token (or Quest reading
every page) generates exactly what no policy does."""

import os

import jax
import numpy as np
import pytest

import kvjax.generate as gen
from kvjax import cache as kvc
from kvjax.cache.policies import PyramidKV, Quest, SnapKV, StreamingLLM
from kvjax.specs import QuantSpec
from tests.cache.policies.helpers import dense_kv, held_pages, tiny_llama, tiny_params

PAGE, PROMPT, STEPS = 4, 22, 30
# Fresh weights and prompts per session; a failure replays with KVJAX_TEST_SEED.
SEED = int(os.environ.get("KVJAX_TEST_SEED", np.random.SeedSequence().entropy % 2**31))


@pytest.fixture(scope="module")
def setting():
    print(f"test seed: KVJAX_TEST_SEED={SEED}")
    rng = np.random.default_rng(SEED)
    model = tiny_llama()
    params = tiny_params(rng)
    prompts = rng.integers(0, model.vocab_size, (2, PROMPT)).tolist()
    # 16 pages of 4 a sequence (64 tokens): the decode reaches 22 + 30 = 52 without a policy.
    spec = gen.CacheConfig(page_size=PAGE).spec(model, num_seqs=2, max_tokens=64)
    return model, params, prompts, spec


def _kw(spec):
    return dict(key=jax.random.key(0), max_new_tokens=STEPS + 1, cache=kvc.init_cache(spec),
                free_finished=False)


@pytest.fixture(scope="module")
def baseline(setting):
    model, params, prompts, spec = setting
    return gen.generate(model, params, prompts, **_kw(spec)).tokens


def _stream(setting, policy, check, spec=None):
    """Streams the decode; `check(i, cache, policy_state)` after the prefill (i = 0) and
    after every step i; returns the generated tokens [2, STEPS + 1]."""
    model, params, prompts, spec0 = setting
    spec = spec0 if spec is None else spec
    out = []
    for i, event in enumerate(gen.stream(model, params, prompts, policy=policy, **_kw(spec))):
        kvc.check_invariants(event.state.cache)
        check(i, event.state.cache, event.state.policy_state)
        out.append(event.tokens)
    assert i == STEPS
    return np.stack(out, axis=1)


# (policy, tokens a sequence holds after step i: exactly this many on full-precision pages,
# at most on KIVI pages, which evict whole quantized pages and never the tail)
# (H2O in the loop: tests/generate/test_policies.py on full-precision pages, test_kivi.py
# on KIVI pages.)
CASES = {
    "snapkv": (SnapKV(budget=12, window=4, kernel=3), lambda i: 12 + i),
    # Budgets 16 (bottom) and 8 (top): memory is returned down to the bottom layer's 16.
    "pyramidkv": (PyramidKV(budget=12, beta=1.5, window=4, kernel=3), lambda i: 16 + i),
    "streaming_llm": (StreamingLLM(n_sink=2, window=9), lambda i: 11),
}
# Pages of 4 tokens; KIVI keeps the last 4 .. 7 tokens in its full-precision tail.
CACHES = {"float32": None, "int4": QuantSpec(bits=4, group_size=4, residual=4)}


@pytest.mark.slow
@pytest.mark.parametrize("cache", sorted(CACHES))
@pytest.mark.parametrize("name", sorted(CASES))
def test_budget_at_every_step_and_pages_return(setting, name, cache):
    policy, bound = CASES[name]
    model, params, prompts, spec = setting
    quant = CACHES[cache]
    spec = spec if quant is None else gen.CacheConfig(page_size=PAGE, quant=quant).spec(
        model, num_seqs=2, max_tokens=64)
    held = []

    after_prefill = {}

    def check(i, c, _):
        lengths = np.asarray(c.lengths)
        after_prefill.setdefault("lengths", lengths)
        if quant is None:
            assert (lengths == bound(i)).all(), (i, lengths)
        else:
            assert (lengths <= bound(i)).all(), (i, lengths)
        if name in ("snapkv", "pyramidkv"):  # prompt compressors: nothing after the prefill
            assert (lengths == after_prefill["lengths"] + i).all(), (i, lengths)
        # Nothing is shared: every page out of a block table is back on the free stack.
        assert int(c.num_free_pages) == spec.num_pages - held_pages(c)
        held.append(held_pages(c))

    _stream(setting, policy, check, spec=spec)
    if quant is None:
        # The prefill cached ceil(22 / 4) = 6 pages per sequence; eviction gave some back.
        assert held[0] == 2 * -(-bound(0) // PAGE) < 2 * 6
        # Without a policy the sequences would end at 52 tokens = 13 pages each.
        assert held[-1] == 2 * -(-bound(STEPS) // PAGE) < 2 * 13
    else:  # without a policy: 16 of 22 and 48 of 52 tokens in quantized pages
        assert held[0] < 2 * 4 and held[-1] < 2 * 12


# A budget below the cache's 64 tokens per sequence (so the policy runs every step) but
# above the 52 tokens this decode reaches: StreamingLLM's cache-position scheme then feeds
# the model its rotary positions (`rope_positions`) through prefill and every step, and
# they must be the text positions. (The other policies: tests/generate/test_policies.py.)
def test_cache_positions_keeping_every_token_generate_like_no_policy(setting, baseline):
    model, params, prompts, spec = setting
    policy = StreamingLLM(n_sink=4, window=56, positions="cache")
    got = gen.generate(model, params, prompts, policy=policy, **_kw(spec)).tokens
    np.testing.assert_array_equal(got, baseline)


def test_quest_summaries_track_every_page_and_reading_all_generates_like_no_policy(
        setting, baseline):
    """After the prefill and every step each held page's summaries are the min / max of its
    keys; reading every page through the selection (13 of a 16-page table, so the
    selection path runs) generates what no policy does."""

    def check(i, cache, state):
        dk, _ = dense_kv(cache)
        bt, lengths = np.asarray(cache.block_tables), np.asarray(cache.lengths)
        assert (lengths == PROMPT + i).all()
        for s in range(2):
            for c in range(-(-lengths[s] // PAGE)):
                page_k = dk[:, s, :, c * PAGE:min(lengths[s], (c + 1) * PAGE)]
                np.testing.assert_array_equal(state.kmin[:, :, bt[s, c]], page_k.min(axis=2))
                np.testing.assert_array_equal(state.kmax[:, :, bt[s, c]], page_k.max(axis=2))

    got = _stream(setting, Quest(top_k=13, dense_layers=1), check)
    np.testing.assert_array_equal(got, baseline)
