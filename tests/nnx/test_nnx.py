"""A Flax NNX model on kvjax's cache: adapted in place, driven by kvjax.generate.

The model (tests/nnx/flax_lm.py) is assembled from Flax's own published NNX modules;
`kvjax.nnx.adapt` swaps its `nnx.MultiHeadAttention` layers for paged ones sharing their
weights. The reference is Flax's own dense-cache decoding (`decode=True`) of the same
module, run before the adaptation. Ragged prompts longer than a page (page_size 8,
prefill chunks of 8).
"""

import jax
import numpy as np
import pytest
from flax import nnx

from kvjax import generate as kvg
from kvjax import nnx as kvnnx
from kvjax import sharding as kvs
from kvjax.cache.policies import H2O
from kvjax.specs import QuantSpec
from tests.nnx.flax_lm import VOCAB, FlaxLM, dense_decode
from tests.nnx.paged_logits import assert_paged_logits_equal

MAX_NEW, PAGE = 32, 8
PROMPT_LENS = (13, 5, 21)
# float32 on both sides; the paged path sums attention in another order.
LOGIT_TOL = dict(rtol=1e-4, atol=1e-4)
# The model built in one program (its initialisers run eagerly compile one program each).
new_lm = nnx.jit(lambda: FlaxLM(seed=3))


@pytest.fixture(scope="module")
def setup():
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in PROMPT_LENS]
    module = new_lm()
    ref_tokens, ref_logits = dense_decode(module, prompts, MAX_NEW)
    holder = kvnnx.adapt(module)
    model, params = kvnnx.as_model(module, vocab_size=VOCAB)
    result = kvg.generate(model, params, prompts, key=jax.random.key(0),
                          max_new_tokens=MAX_NEW, cache=kvg.CacheConfig(page_size=PAGE),
                          chunk_size=PAGE)
    return dict(prompts=prompts, module=module, holder=holder, model=model, params=params,
                ref_tokens=ref_tokens, ref_logits=ref_logits, result=result)


def test_adapt_replaces_attention_and_reuses_weights(setup):
    module = setup["module"]
    fresh = new_lm()
    for layer, (block, orig) in enumerate(zip(module.blocks, fresh.blocks, strict=True)):
        attn = block.attn
        assert isinstance(attn, kvnnx.PagedMultiHeadAttention) and attn.layer == layer
        assert attn.cache is setup["holder"]
        np.testing.assert_array_equal(np.asarray(attn.query.kernel[...]),
                                      np.asarray(orig.attn.query.kernel[...]))
    assert setup["model"].config.num_layers == len(module.blocks)


def test_greedy_tokens_and_logits_equal_flax_dense_decoding(setup):
    prompts, result = setup["prompts"], setup["result"]
    np.testing.assert_array_equal(result.tokens, setup["ref_tokens"])
    assert result.status.code == 0
    assert_paged_logits_equal(setup["model"], setup["params"], prompts, setup["ref_tokens"],
                              setup["ref_logits"], page=PAGE, max_new=MAX_NEW, tol=LOGIT_TOL)


def test_kivi_int4_pages_with_h2o_eviction(setup):
    """KIVI int4 pages and H2O (which observes every layer's queries) through the NNX
    model: every row decodes its tokens, each sequence is held to the budget, and the
    first token (from the prompt's logits over int4 pages) is the float one."""
    budget = 24
    result = kvg.generate(
        setup["model"], setup["params"], setup["prompts"], key=jax.random.key(0),
        max_new_tokens=MAX_NEW, chunk_size=PAGE, free_finished=False, policy=H2O(budget=budget),
        cache=kvg.CacheConfig(page_size=PAGE, quant=QuantSpec(bits=4, group_size=PAGE,
                                                              residual=PAGE)))
    assert result.status.code == 0 and result.cache.is_quantized
    np.testing.assert_array_equal(result.num_generated, MAX_NEW)
    held = np.asarray(result.cache.lengths)[: len(PROMPT_LENS)]
    grown = np.array(PROMPT_LENS) + MAX_NEW
    assert (held <= budget + PAGE).all() and (held < grown).all(), (held, grown)
    np.testing.assert_array_equal(result.tokens[:, 0], setup["ref_tokens"][:, 0])


def test_sharding_plan_on_8_devices_equals_unsharded(setup):
    plan = kvs.ShardingPlan(mesh=kvs.make_mesh((2, 2, 2), ("data", "model", "context")),
                            strategies=("sequences", "heads", "context"))
    result = kvg.generate(setup["model"], setup["params"], setup["prompts"],
                          key=jax.random.key(0), max_new_tokens=MAX_NEW, chunk_size=PAGE,
                          cache=kvg.CacheConfig(page_size=PAGE, plan=plan))
    assert len(result.cache.pages.k.sharding.device_set) == 8
    np.testing.assert_array_equal(result.tokens, setup["result"].tokens)


def test_holder_reserve_fork_free_and_a_direct_call(setup):
    """The holder's own cache: reserve, a direct model call in `step` (under nnx.jit),
    fork and free; then `kvjax.nnx.generate` decodes on it and the holder gets the cache."""
    module, holder, model = setup["module"], setup["holder"], setup["model"]
    prompt = np.asarray(setup["prompts"][0], np.int32)
    n = prompt.size
    # The geometry of the fixture's generate: the generate below reuses its programs.
    spec = setup["result"].cache.spec
    holder.set_cache(kvg.CacheConfig(page_size=PAGE).build(
        model, num_seqs=spec.max_seqs, max_tokens=spec.max_tokens_per_seq))
    holder.reserve(jax.device_put(np.array([n, 0, 0], np.int32))).raise_if_error()

    @nnx.jit
    def run(module, holder, tokens, positions, q_lengths):
        with holder.step(positions=positions, q_lengths=q_lengths):
            return module(tokens, positions)

    logits = run(module, holder, jax.device_put(np.stack([prompt] * 3)),
                 jax.device_put(np.tile(np.arange(n, dtype=np.int32), (3, 1))),
                 jax.device_put(np.array([n, 0, 0], np.int32)))
    np.testing.assert_allclose(np.asarray(logits)[0], setup["ref_logits"][0, :n], **LOGIT_TOL)
    holder.fork(jax.device_put(np.array([0], np.int32)), jax.device_put(np.array([1], np.int32))
                ).raise_if_error()
    np.testing.assert_array_equal(np.asarray(holder.cache.lengths), [n, n, 0])
    holder.free(jax.device_put(np.array([True, True, True])))
    np.testing.assert_array_equal(np.asarray(holder.cache.lengths), [0, 0, 0])
    with pytest.raises(RuntimeError, match="outside a step"):  # raised while tracing
        nnx.jit(lambda m, t, p: m(t, p))(module, jax.device_put(prompt[None]),
                                          jax.device_put(np.arange(n, dtype=np.int32)[None]))
    result = kvnnx.generate(module, setup["prompts"], vocab_size=VOCAB,
                            key=jax.random.key(0), max_new_tokens=MAX_NEW, chunk_size=PAGE)
    np.testing.assert_array_equal(result.tokens, setup["ref_tokens"])
    held, final = jax.tree.leaves(holder.cache), jax.tree.leaves(result.cache)
    assert all(a is b for a, b in zip(held, final, strict=True))
