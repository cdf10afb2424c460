"""Every eviction policy over a long toy decode: budget at every step, pages really freed,
and a budget that keeps everything decodes exactly like no policy."""

import numpy as np
import pytest

from kvjax.cache import init_cache
from kvjax.cache import page_table as pt
from kvjax.cache.policies import H2O, NoPolicy, PyramidKV, SnapKV, StreamingLLM
from kvjax.cache.policies.toy import init_toy, toy_generate
from kvjax.specs import AttentionSpec, CacheSpec

TOY = CacheSpec(attention=AttentionSpec(q_heads=4, kv_heads=2, head_dim=16), num_layers=2,
                page_size=4, num_pages=40, max_seqs=2, max_pages_per_seq=16)
PROMPT, STEPS = 22, 30


def _run(policy, rng):
    params = init_toy(TOY, seed=int(rng.integers(1 << 30)))
    prompts = rng.integers(0, 64, (2, PROMPT))
    seen = []

    def on_step(i, cache, state):
        pt.check_invariants(cache.table)
        lengths = np.asarray(cache.lengths)
        used = int((-(-lengths // TOY.page_size)).sum())
        seen.append((i, lengths.copy(), int(cache.num_free_pages), used))

    toy_generate(params, init_cache(TOY), policy, prompts, STEPS, on_step=on_step)
    return seen


# (policy, max tokens a sequence holds after step i)
CASES = {
    "h2o": (H2O(budget=12, recent=4), lambda i: 12),
    "snapkv": (SnapKV(budget=12, window=4, kernel=3), lambda i: 12 + i),
    # Budgets 16 (bottom) and 8 (top): memory is returned down to the bottom layer's 16.
    "pyramidkv": (PyramidKV(budget=12, beta=1.5, window=4, kernel=3), lambda i: 16 + i),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_budget_at_every_step_and_free_pages_rise(name, rng):
    policy, bound = CASES[name]
    seen = _run(policy, rng)
    prev_free = None
    for i, lengths, free, used in seen:
        assert (lengths == bound(i)).all(), (i, lengths)
        # Nothing is shared: every page out of a block table is back on the free stack.
        assert free == TOY.num_pages - used
        if i == 0:
            # Prefill reserved ceil(22 / 4) = 6 pages per sequence; eviction gave some back.
            assert free == TOY.num_pages - 2 * (-(-bound(0) // TOY.page_size))
            assert free > TOY.num_pages - 2 * 6
        prev_free = free
    assert prev_free is not None
    # Without a policy the sequences would end at 52 tokens = 13 pages each.
    assert seen[-1][3] < 2 * 13


# Budgets below the cache's 64 tokens per sequence (so scoring and compaction run every
# step) but above the 8 + 24 tokens this decode reaches.
@pytest.mark.parametrize("policy", [
    H2O(budget=40, recent=8),
    SnapKV(budget=40, window=4, kernel=3),
    PyramidKV(budget=30, beta=1.5, window=4, kernel=3),  # layer budgets 40 and 20
    StreamingLLM(n_sink=4, window=36),
], ids=["h2o", "snapkv", "pyramidkv", "streaming_llm"])
def test_budget_keeping_every_token_is_identical_to_no_policy(policy, rng):
    seed = int(rng.integers(1 << 30))
    params = init_toy(TOY, seed=seed)
    prompts = rng.integers(0, 64, (2, 8))
    t0, l0, _ = toy_generate(params, init_cache(TOY), NoPolicy(), prompts, 24)
    t1, l1, _ = toy_generate(params, init_cache(TOY), policy, prompts, 24)
    np.testing.assert_array_equal(t1, t0)
    np.testing.assert_array_equal(l1, l0)
