"""Cache policies on KIVI-quantized pages through `kvjax.generate`, and their byte accounting.

Quest (bounds from the stored key scales, top_k quantized pages + the tail) and
page-granular H2O (whole quantized pages evicted, the tail kept) run in the jitted decode
loop on a KIVI int4 cache and give, token for token, what a step-by-step driver of the
public cache and policy operations gives (`tests/test_composition.py`'s reference step).
`kvjax.eval.kv_bytes_per_token` prices those combinations.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax.generate as gen
from kvjax import cache as kvc
from kvjax.cache.policies import H2O, Quest
from kvjax.eval import EvalConfig, kv_bytes_per_token
from kvjax.generate import setup
from kvjax.models.base import get_family
from kvjax.models.llama import LlamaConfig
from kvjax.rope import RopeConfig
from kvjax.specs import QuantSpec
from tests.cache.policies.helpers import held_pages, tiny_llama, tiny_params
from tests.test_composition import _ref_step

PAGE, NEW, PROMPT_LENS = 8, 8, (37, 22)
CACHE = gen.CacheConfig(page_size=PAGE, quant=QuantSpec(bits=4, group_size=8, residual=PAGE))
# Quest reads 2 of up to 5 quantized pages; H2O holds at most 24 tokens: the 37-token prompt
# loses 2 of its 3 quantized pages at once (its tail of 13 always stays).
POLICIES = {"quest": Quest(top_k=2, dense_layers=0), "h2o": H2O(budget=24)}
# Fresh weights and prompts per session; a failure replays with KVJAX_TEST_SEED.
SEED = int(os.environ.get("KVJAX_TEST_SEED", np.random.SeedSequence().entropy % 2**31))


def _reference(model, params, prompts, policy):
    """Greedy tokens, one public operation at a time: the prompts in one chunk, then NEW - 1
    decode steps (reserve, the model with the policy's selection, the policy's hook)."""
    cache, impl, _ = setup.prepare_cache(model, CACHE, "auto", num_seqs=len(prompts),
                                         max_tokens=max(PROMPT_LENS) + NEW)
    pstate = policy.init_state(cache)
    tokens, lengths, chunk = gen.pad_prompts(prompts, 64)
    assert tokens.shape[1] == chunk
    seq_ids = jnp.arange(len(prompts), dtype=jnp.int32)
    positions = np.broadcast_to(np.arange(chunk, dtype=np.int32), tokens.shape)
    cache, pstate, logits, st = _ref_step(
        model, params, cache, pstate, jnp.asarray(tokens), jnp.asarray(positions),
        jnp.asarray(lengths), seq_ids, policy=policy, impl=impl, prefill=True)
    st.raise_if_error()
    last = np.asarray(logits)[np.arange(len(prompts)), lengths - 1]
    out = [np.argmax(last, axis=-1).astype(np.int32)]
    for i in range(1, NEW):
        cache, pstate, logits, st = _ref_step(
            model, params, cache, pstate, jnp.asarray(out[-1][:, None]),
            jnp.asarray((lengths + i - 1)[:, None].astype(np.int32)),
            jnp.ones(len(prompts), jnp.int32), seq_ids, policy=policy, impl=impl,
            prefill=False)
        st.raise_if_error()
        out.append(np.argmax(np.asarray(logits[:, 0]), axis=-1).astype(np.int32))
    return np.stack(out, axis=1)


@pytest.mark.rotate(1)
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_kivi_policy_in_the_loop_matches_the_step_by_step_reference(name):
    print(f"test seed: KVJAX_TEST_SEED={SEED}")
    rng = np.random.default_rng(SEED)
    model, params = tiny_llama(), tiny_params(rng)
    prompts = [rng.integers(0, model.vocab_size, n).tolist() for n in PROMPT_LENS]
    policy = POLICIES[name]
    res = gen.generate(model, params, prompts, key=jax.random.key(0), max_new_tokens=NEW,
                       cache=CACHE, chunk_size=64, policy=policy, free_finished=False)
    np.testing.assert_array_equal(res.tokens, _reference(model, params, prompts, policy))
    cache = res.cache
    kvc.check_invariants(cache)
    assert int(cache.num_free_pages) == cache.spec.num_pages - held_pages(cache)
    lengths = np.asarray(cache.lengths)[:2]
    if name == "quest":  # nothing evicted; the selection dropped pages at every step
        assert lengths.tolist() == [n + NEW - 1 for n in PROMPT_LENS]
        assert int(cache.quant_lengths[0]) // PAGE > policy.top_k
    else:
        assert (lengths <= policy.budget).all() and lengths[0] < PROMPT_LENS[0]


def _small_model():
    """1 layer, 1 KV head of 16: 32 K/V elements per token."""
    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=1,
                         q_heads=2, kv_heads=1, head_dim=16, rope=RopeConfig(theta=1e4, dim=16))
    return get_family("llama").model(config)


def test_bytes_per_token_accounting():
    model = _small_model()
    bf16 = kv_bytes_per_token(model, EvalConfig(name="bf16"), 256)
    assert bf16["held"] == 64 and bf16["read"] == 64
    # int4, G=16: 0.5 B + 4 B per 16 elements; R=0 and 256 tokens: all quantized.
    q = kv_bytes_per_token(model, EvalConfig(name="q", bits=4, group_size=16, residual=0), 256)
    assert q["held"] == pytest.approx(32 * (0.5 + 4 / 16))
    half = kv_bytes_per_token(model, EvalConfig(name="e"), 256, kept_tokens=128)
    assert half["held"] == 32


def test_kivi_policy_byte_accounting():
    model = _small_model()
    kivi = dict(dtype="float32", bits=4, group_size=16, residual=32)
    # 256 tokens at R=32, 32-token pages: 224 quantized (0.5 B + 4 B / 16 per element), 32 f32.
    base = kv_bytes_per_token(model, EvalConfig(name="k", **kivi), 256)
    per_q, full = 32 * (0.5 + 0.25), 32 * 4
    assert base["held"] == pytest.approx((224 * per_q + 32 * full) / 256)
    # H2O with budget 96: a tail of T in [32, 63] leaves whole pages of 96 - T, i.e. 2 pages
    # at T = 32 and 1 page otherwise; averaged over the 32 tail phases.
    h2o = kv_bytes_per_token(model, EvalConfig(name="h", policy=H2O(budget=96), **kivi), 256,
                             kept_tokens=96)
    want = sum((64 if t == 32 else 32) * per_q + t * full for t in range(32, 64)) / 32
    assert h2o["held"] == h2o["read"] == pytest.approx(want / 256)
    # Quest reads 2 pages + the tail + the key scales and zeros of all 7 quantized pages.
    quest = kv_bytes_per_token(
        model, EvalConfig(name="q", policy=Quest(top_k=2, dense_layers=0), **kivi), 256)
    assert quest["held"] == base["held"]
    bounds = 224 * 16 * 4 / 16
    assert quest["read"] == pytest.approx((64 * per_q + 32 * full + bounds) / 256)
