"""Sharded generation of tiny GQA (Llama) and MLA (DeepSeek) models equals one device.

Params are tensor-parallel over `model`, the cache is laid out by
`cache_shardings`, and `kvjax.generate` runs unchanged with
`impl=ShardedAttention(plan)`. Prompt logits (chunked prefill), greedy tokens,
and one more decode step's logits are compared with a single-device run.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from kvjax import generate as kvg
from kvjax import sharding as kvs
from kvjax.cache import init_cache, reserve
from kvjax.models import deepseek as ds
from kvjax.models import llama
from kvjax.models.base import get_family
from kvjax.models.layers import RopeConfig
from tests.sharding.helpers import FULL, make_plan, plan_id
from tests.sharding.test_hlo import collective_shapes, pool_like

# (8,) per strategy, then (2, 4) and (2, 2, 2) combining them. Each generation compiles a
# prefill, a decode loop and a step (~25 s of CPU per plan), so by default only the (2, 2, 2)
# plan with all three strategies runs; KVJAX_SHARDING_FULL=1 runs the whole matrix.
_ALL_PLANS = [
    ((8,), ("model",), ("heads",)),
    ((8,), ("data",), ("sequences",)),
    ((8,), ("context",), ("context",)),
    ((2, 4), ("data", "model"), ("sequences", "heads")),
    ((2, 2, 2), ("data", "model", "context"), ("sequences", "heads", "context")),
]
GEN_PLANS = _ALL_PLANS if FULL else _ALL_PLANS[-1:]
# f32 logits; the sharded run sums matmul partials and attention pieces in another order.
LOGIT_TOL = dict(rtol=1e-4, atol=1e-4)
PROMPT_LENS = (5, 11, 3, 8, 1, 9, 6, 13)
MAX_NEW = 6


def _llama():
    config = llama.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, q_heads=8,
        kv_heads=4, head_dim=8, rope=RopeConfig(theta=10000.0, dim=8))
    return get_family("llama").model(config), 4


def _deepseek():
    config = ds.DeepseekConfig(
        vocab_size=96, hidden_size=48, intermediate_size=64, num_layers=2, num_heads=8,
        kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8)
    return get_family("deepseek").model(config), None


MODELS = {"gqa": _llama, "mla": _deepseek}


@jax.jit
def _scaled(params):
    # Random-normal weights larger than init's keep the logits spread (greedy ties unlikely).
    return jax.tree.map(
        lambda x: x * 3 if x.ndim >= 2 and jnp.issubdtype(x.dtype, jnp.floating) else x, params)


@functools.cache
def _setup(kind):
    model, kv_heads = MODELS[kind]()
    family = get_family(model.family)
    # One program each (eagerly, every tensor shape compiles its own draw and scaling);
    # DeepSeek's init draws on the host and is not traced.
    init = family.init_params if kind == "mla" else jax.jit(family.init_params,
                                                             static_argnums=0)
    params = _scaled(init(model.config, jax.random.key(7)))
    spec = model.make_cache_spec(page_size=4, num_pages=128, max_seqs=8, max_pages_per_seq=8,
                                 dtype="float32")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, model.vocab_size, n).tolist() for n in PROMPT_LENS]
    return model, kv_heads, params, spec, prompts


def _run(model, params, cache, prompts, impl):
    tokens, lengths, chunk = kvg.pad_prompts(prompts, 8)
    batch = len(prompts)
    seq_ids = jnp.arange(batch, dtype=jnp.int32)
    cache, last, status, logits, _ = kvg.prefill(
        model, params, cache, jnp.asarray(tokens), jnp.asarray(lengths), seq_ids,
        chunk_size=chunk, impl=impl, return_logits=True)
    status.raise_if_error()
    state = kvg.start(cache, seq_ids, last, jnp.asarray(lengths),
                      kvg.as_keys(jax.random.key(0), batch), jnp.full((batch,), MAX_NEW),
                      status, sampling=kvg.GREEDY, eos_ids=(), max_len=MAX_NEW,
                      free_finished=False)
    state = kvg.decode_loop(model, params, state, sampling=kvg.GREEDY, free_finished=False,
                            impl=impl)
    state.status.raise_if_error()
    # One more decode step on the grown cache, for its logits (reserve + forward, one jit).
    step = jax.jit(functools.partial(_decode_step, model=model, impl=impl))
    compiled = step.lower(params, state.cache, state.last, state.position).compile()
    step_logits, cache = compiled(params, state.cache, state.last, state.position)
    valid = np.arange(tokens.shape[1])[None, :] < lengths[:, None]
    return (np.asarray(logits)[valid], np.asarray(state.tokens), np.asarray(step_logits), cache,
            compiled.as_text())


def _decode_step(params, cache, last, position, *, model, impl):
    cache, _ = reserve(cache, jnp.ones((cache.spec.max_seqs,), jnp.int32))
    ones = jnp.ones((cache.spec.max_seqs,), jnp.int32)
    return model.apply(params, last[:, None], position[:, None], cache, q_lengths=ones,
                       impl=impl)


@functools.cache
def _single(kind):
    model, _, params, spec, prompts = _setup(kind)
    return _run(model, params, init_cache(spec), prompts, "xla")


@pytest.mark.parametrize("kind", ["gqa", "mla"])
@pytest.mark.parametrize("plan_args", GEN_PLANS, ids=plan_id)
def test_sharded_generation_matches_one_device(kind, plan_args):
    if kind == "mla" and plan_args[2] == ("heads",):
        pytest.skip("MLA's single latent head has nothing to split over heads")
    model, kv_heads, params, spec, prompts = _setup(kind)
    plan = make_plan(*plan_args)
    cache = kvs.init_sharded_cache(spec, plan)
    sharded_params = kvs.shard_params(params, plan, kv_heads=kv_heads)
    want = _single(kind)
    got = _run(model, sharded_params, cache, prompts, kvs.ShardedAttention(plan))
    np.testing.assert_allclose(got[0], want[0], **LOGIT_TOL)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_allclose(got[2], want[2], **LOGIT_TOL)
    # The pools stayed laid out as planned through prefill, the loop and the step.
    cache = got[3]
    wanted = kvs.cache_shardings(plan, spec)
    for pool, sh in zip(jax.tree.leaves(cache.pages), jax.tree.leaves(wanted.pages),
                        strict=True):
        assert pool.sharding.is_equivalent_to(sh, pool.ndim), (pool.sharding, sh)
    if plan.page_shards > 1:
        kvs.check_invariants(cache.table)
    # The model's compiled decode step (tensor-parallel matmuls included) moves no pool:
    # no collective result looks like pool pages [..., >= pages per shard, page_size, width].
    found = collective_shapes(got[4])
    assert not [(op, shape) for op, shape in found if pool_like(shape, spec, plan)], found


def test_param_shardings_split_heads_mlp_and_vocab():
    model, kv_heads, params, _, _ = _setup("gqa")
    plan = make_plan((2, 4), ("data", "model"), ("sequences", "heads"))
    sh = kvs.param_shardings(plan, params, kv_heads=kv_heads)
    specs = {k: v.spec for k, v in dataclasses.asdict(sh.layers).items() if v is not None}
    col, row = P(None, None, "model"), P(None, "model", None)
    assert specs["wq"] == col and specs["wk"] == col and specs["w_up"] == col
    assert specs["wo"] == row and specs["w_down"] == row and specs["attn_norm"] == P()
    assert sh.embed.spec == P("model", None) and sh.lm_head.spec == P(None, "model")
    # kv_heads=4 on model=8 cannot split by heads: K/V projections stay whole.
    sh8 = kvs.param_shardings(make_plan((8,), ("model",), ("heads",)), params, kv_heads=4)
    assert sh8.layers.wk.spec == P() and sh8.layers.wq.spec == col
    mla_model, _, mla_params, _, _ = _setup("mla")
    sh = kvs.param_shardings(plan, mla_params)
    layers = sh.dense_layers if sh.dense_layers is not None else sh.moe_layers
    assert layers.w_uk.spec == P(None, "model", None, None)
    assert layers.o_proj.spec == row and layers.kv_a_proj.spec == P()
