"""Every lever through the one decode engine: the composition matrix.

    family   {Llama GQA, Qwen2 (q/k/v bias, tied embeddings), DeepSeek-V2 (MLA + MoE),
              Qwen3-Next (Gated DeltaNet + gated full attention; policies, page kinds and
              sharding act on the full-attention layers, the recurrent state is per slot),
              DeepSeek-V3.2 (MLA + MoE + the lightning indexer: top-k sparse attention)}
  x cache    {float32, bfloat16, KIVI int8, int4, int2}
  x policy   {none, StreamingLLM, H2O, SnapKV, PyramidKV, Quest}
  x devices  {1, 8 with heads+sequences, 8 with context}
  x entry    {generate, stream, sample_n, beam_search}

Each cell runs through `kvjax.generate` and must either give the right tokens or raise
the documented `UndefinedCombination` (the list `UNDEFINED` below: DeepSeek-V3.2 with
H2O, SnapKV, PyramidKV or Quest, whose token scores or page selections would compete
with the indexer's own; docs/models.md). Lossless cells (float32 cache, no policy; any
sharding) give the greedy tokens of the single-device float32 run. Lossy cells (bf16 or
KIVI pages, or a policy) equal, token for token, a step-by-step reference that drives
the same public cache and policy operations (`kvjax.cache.reserve / fork / free`, the
model's forward with the policy's selection, the policy's hooks) one step at a time from
Python, without the jitted loop.

The cells are one `slow` and `heavy` sweep: by default a sample that covers every value
of every axis runs over each three-day window, a third of it a day (tests/conftest.py);
`--slow` (or KVJAX_SLOW=1) runs all 1800 cells.
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import cache as kvc
from kvjax import generate as gen
from kvjax import sharding as kvs
from kvjax.cache.policies import H2O, PyramidKV, Quest, SnapKV, StreamingLLM
from kvjax.cache.policies.base import to_slots
from kvjax.generate import setup
from kvjax.models import deepseek as ds
from kvjax.models import deepseek_v32 as v32
from kvjax.models import llama
from kvjax.models import qwen3_next as q3n
from kvjax.models.base import get_family
from kvjax.rope import RopeConfig
from kvjax.specs import QuantSpec

PAGE = 8
PROMPT_LENS = (27, 19)
NEW = 6
CHUNK = 16

FAMILIES = ("llama", "qwen2", "deepseek", "qwen3_next", "deepseek_v32")
CACHES = ("float32", "bfloat16", "int8", "int4", "int2")
POLICIES = ("none", "streaming_llm", "h2o", "snapkv", "pyramidkv", "quest")
DEVICES = ("1", "8:heads+sequences", "8:context")
ENTRIES = ("generate", "stream", "sample_n", "beam_search")
# Fresh weights and prompts per session (the compiled programs do not depend on them);
# a failing cell replays with KVJAX_TEST_SEED.
SEED = int(os.environ.get("KVJAX_TEST_SEED", np.random.SeedSequence().entropy % 2**31))
# Cells whose combination is undefined, each raising UndefinedCombination.
UNDEFINED: set[tuple[str, ...]] = {
    ("deepseek_v32", c, p, d, e) for c in CACHES for p in ("h2o", "snapkv", "pyramidkv", "quest")
    for d in DEVICES for e in ENTRIES}

# Budgets that make every policy act on these prompts (27 + 6 tokens at most), and that
# a KIVI cache (page 8, tail of up to R + 7 = 15 tokens) can hold.
POLICY = {
    "none": None,
    "streaming_llm": StreamingLLM(n_sink=4, window=20),
    "h2o": H2O(budget=24),
    "snapkv": SnapKV(budget=20, window=4, kernel=3),
    "pyramidkv": PyramidKV(budget=20, window=4, kernel=3, beta=2.0),
    "quest": Quest(top_k=2, dense_layers=0),
}


@functools.cache
def _model(family: str):
    rope = RopeConfig(theta=10000.0, dim=16)
    if family == "llama":
        config = llama.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                                   num_layers=2, q_heads=8, kv_heads=4, head_dim=16, rope=rope)
    elif family == "qwen2":
        config = llama.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                                   num_layers=2, q_heads=8, kv_heads=4, head_dim=16, rope=rope,
                                   qkv_bias=True, tie_word_embeddings=True,
                                   architecture="Qwen2ForCausalLM")
    elif family == "qwen3_next":
        config = q3n.Qwen3NextConfig(
            vocab_size=96, hidden_size=64, num_hidden_layers=3, intermediate_size=128,
            layer_types=("linear_attention", "full_attention", "linear_attention"),
            q_heads=8, kv_heads=4, head_dim=16, rope=RopeConfig(theta=10000.0, dim=8),
            linear_key_heads=2, linear_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16)
    elif family == "deepseek_v32":
        # index_topk 16 < the prompts (19, 27 tokens): decode reads a selection.
        config = v32.DeepseekV32Config(
            vocab_size=96, hidden_size=48, intermediate_size=64, num_layers=2, num_heads=8,
            q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8,
            v_head_dim=8, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, n_shared_experts=1, index_n_heads=4, index_head_dim=8,
            index_topk=16)
    else:
        config = ds.DeepseekConfig(vocab_size=96, hidden_size=48, intermediate_size=64,
                                   num_layers=2, num_heads=8, kv_lora_rank=16,
                                   qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
                                   first_k_dense_replace=1, n_routed_experts=4,
                                   num_experts_per_tok=2, moe_intermediate_size=32,
                                   n_shared_experts=1)
    fam = get_family(family if family in ("deepseek", "qwen3_next", "deepseek_v32") else "llama")
    params = fam.init_params(config, jax.random.key(SEED))
    # Larger weights than init's spread the logits (greedy ties unlikely).
    params = jax.tree.map(
        lambda x: x * 3 if x.ndim >= 2 and jnp.issubdtype(x.dtype, jnp.floating) else x, params)
    rng = np.random.default_rng(SEED)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in PROMPT_LENS]
    return fam.model(config), params, prompts


@functools.cache
def _plan(devices: str):
    if devices == "1":
        return None
    if devices == "8:heads+sequences":
        return kvs.ShardingPlan(mesh=kvs.make_mesh((2, 4), ("data", "model")),
                                strategies=("sequences", "heads"))
    return kvs.ShardingPlan(mesh=kvs.make_mesh((8,), ("context",)), strategies=("context",))


def _config(cache: str, devices: str) -> gen.CacheConfig:
    quant = None
    dtype = cache if cache in ("float32", "bfloat16") else "float32"
    if cache.startswith("int"):
        quant = QuantSpec(bits=int(cache[3:]), group_size=8, residual=PAGE)
    return gen.CacheConfig(dtype=dtype, quant=quant, page_size=PAGE, plan=_plan(devices))


# ----------------------------------------------------------------------------- the reference


@functools.partial(jax.jit, static_argnames=("model", "policy", "impl", "prefill"))
def _ref_step(model, params, cache, pstate, tokens, positions, q_lengths, seq_ids, *, policy,
              impl, prefill):
    """One forward of the public pieces: rope positions, reserve, the model with the
    policy's selection, the policy's hook. Returns (cache, pstate, logits, status)."""
    if policy is not None:
        positions = policy.rope_positions(cache, pstate,
                                          to_slots(cache, seq_ids, positions))[seq_ids]
    num = jnp.zeros((cache.spec.max_seqs,), jnp.int32).at[seq_ids].set(q_lengths)
    cache, status = kvc.reserve(cache, num)
    select = None if policy is None else (
        lambda c, layer, q: policy.before_attention(c, pstate, layer, to_slots(c, seq_ids, q)))
    out = model.apply(params, tokens, positions, cache, q_lengths=q_lengths, seq_ids=seq_ids,
                      impl=impl, select=select, observe=policy is not None)
    logits, cache = out[:2]
    if policy is not None:
        queries = to_slots(cache, seq_ids, out[2], axis=1)
        if prefill:
            cache, pstate, _ = policy.after_prefill(cache, pstate, queries, num)
        else:
            cache, pstate, _ = policy.after_step(cache, pstate, queries[:, :, 0], num > 0)
    return cache, pstate, logits, status


def _ref_prefill(model, params, cache, pstate, prompts, seq_ids, *, policy, impl):
    """Chunk by chunk, as `generate` does; returns (cache, pstate, last logits)."""
    tokens, lengths, chunk = gen.pad_prompts(prompts, CHUNK)
    seq_ids = jnp.asarray(seq_ids, jnp.int32)
    base = np.asarray(cache.lengths)[np.asarray(seq_ids)]
    last = [None] * len(prompts)
    for start in range(0, tokens.shape[1], chunk):
        ql = np.clip(lengths - start, 0, chunk).astype(np.int32)
        pos = (base[:, None] + start + np.arange(chunk)[None, :]).astype(np.int32)
        cache, pstate, logits, st = _ref_step(
            model, params, cache, pstate, jnp.asarray(tokens[:, start:start + chunk]),
            jnp.asarray(pos), jnp.asarray(ql), seq_ids, policy=policy, impl=impl, prefill=True)
        st.raise_if_error()
        for b in range(len(prompts)):
            if start <= lengths[b] - 1 < start + chunk:
                last[b] = np.asarray(logits[b, lengths[b] - 1 - start])
    return cache, pstate, np.stack(last), base + lengths


def _ref_decode(model, params, cache, pstate, last, positions, seq_ids, *, policy, impl):
    seq_ids = jnp.asarray(seq_ids, jnp.int32)
    out = [np.argmax(last, axis=-1).astype(np.int32)]
    for i in range(1, NEW):
        cache, pstate, logits, st = _ref_step(
            model, params, cache, pstate, jnp.asarray(out[-1][:, None]),
            jnp.asarray((positions + i - 1)[:, None].astype(np.int32)),
            jnp.ones(len(out[-1]), jnp.int32), seq_ids, policy=policy, impl=impl, prefill=False)
        st.raise_if_error()
        out.append(np.argmax(np.asarray(logits[:, 0]), axis=-1).astype(np.int32))
    return np.stack(out, axis=1)


def _prepared(model, params, config, policy, num_seqs, max_tokens):
    cache, impl, plan = setup.prepare_cache(model, config, "auto", num_seqs=num_seqs,
                                            max_tokens=max_tokens)
    pstate = None if policy is None else policy.init_state(cache)
    return cache, impl, setup.shard_for_plan(model, params, plan), pstate


@functools.cache  # shared by generate, stream and sample_n
def _reference(family, cache_name, policy_name, devices):
    """Greedy tokens of the prompts, step by step through the public operations."""
    model, params, prompts = _model(family)
    policy = POLICY[policy_name]
    cache, impl, params, pstate = _prepared(model, params, _config(cache_name, devices), policy,
                                            len(prompts), max(PROMPT_LENS) + NEW)
    seq_ids = np.arange(len(prompts), dtype=np.int32)
    cache, pstate, last, positions = _ref_prefill(model, params, cache, pstate, prompts,
                                                  seq_ids, policy=policy, impl=impl)
    return _ref_decode(model, params, cache, pstate, last, positions, seq_ids, policy=policy,
                       impl=impl)


@functools.cache
def _reference_beams(family, cache_name, policy_name, devices, width):
    """Beam search step by step: fork every beam's parent, free the old beams, reserve,
    the step, the policy's hook (the public operations `beam_search` runs in its loop)."""
    model, params, prompts = _model(family)
    policy = POLICY[policy_name]
    d = 1 if _plan(devices) is None else _plan(devices).data_shards
    config = _config(cache_name, devices)
    prompt = prompts[0]
    pages = -(-(len(prompt) + NEW) // PAGE) + (config.quant is not None)
    config = gen.CacheConfig(dtype=config.dtype, quant=config.quant, page_size=PAGE,
                             plan=config.plan,
                             num_pages=(pages + 2 * width * (pages + 1)) * d)
    cache, impl, params, pstate = _prepared(model, params, config, policy, 2 * width * d,
                                            len(prompt) + NEW)
    cache, pstate, last, _ = _ref_prefill(model, params, cache, pstate, [prompt], [0],
                                          policy=policy, impl=impl)
    logits = np.repeat(last, width, axis=0)
    scores = np.full(width, -1e9, np.float32)
    scores[0] = 0.0
    hist = np.zeros((width, 0), np.int32)
    base = 0
    lane = np.arange(width, dtype=np.int32)
    for t in range(NEW):
        lp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
        cand = (scores[:, None] + lp).reshape(-1)
        top = np.asarray(jax.lax.top_k(jnp.asarray(cand), width)[1])
        parent, tok = top // lp.shape[1], (top % lp.shape[1]).astype(np.int32)
        scores = cand[top]
        old, new = base + lane, (width - base) + lane
        cache, st = kvc.fork(cache, jnp.asarray(old[parent]), jnp.asarray(new))
        st.raise_if_error()
        if policy is not None:
            pstate = policy.fork_state(pstate, jnp.asarray(old[parent]), jnp.asarray(new))
        cache = kvc.free(cache, jnp.zeros(cache.spec.max_seqs, bool).at[old].set(True))
        hist = np.concatenate([hist[parent], tok[:, None]], axis=1)
        if t + 1 < NEW:
            cache, pstate, out, st = _ref_step(
                model, params, cache, pstate, jnp.asarray(tok[:, None]),
                jnp.full((width, 1), len(prompt) + t, jnp.int32), jnp.ones(width, jnp.int32),
                jnp.asarray(new), policy=policy, impl=impl, prefill=False)
            st.raise_if_error()
            logits = np.asarray(out[:, 0])
        base = width - base
    return hist[np.argsort(-scores, kind="stable")]


# ----------------------------------------------------------------------------- the engine


def _engine(family, cache_name, policy_name, devices, entry):
    model, params, prompts = _model(family)
    kw = dict(cache=_config(cache_name, devices), policy=POLICY[policy_name],
              chunk_size=CHUNK)
    if entry == "generate":
        return gen.generate(model, params, prompts, key=jax.random.key(0), max_new_tokens=NEW,
                            **kw).tokens
    if entry == "stream":
        out = [[] for _ in prompts]
        for event in gen.stream(model, params, prompts, key=jax.random.key(0),
                                max_new_tokens=NEW, **kw):
            for r in np.nonzero(event.emitted)[0]:
                out[r].append(int(event.tokens[r]))
        return np.asarray(out)
    if entry == "sample_n":
        res = gen.sample_n(model, params, prompts, n=2, key=jax.random.key(0),
                           max_new_tokens=NEW, **kw)
        return res.tokens  # greedy: both samples of prompt p equal its generation
    return gen.beam_search(model, params, prompts[0], beam_width=2, max_new_tokens=NEW,
                           **kw).tokens


def _expected(family, cache_name, policy_name, devices, entry):
    lossless = cache_name == "float32" and policy_name == "none"
    if entry == "beam_search":
        if lossless:
            return _reference_beams(family, "float32", "none", "1", 2)
        return _reference_beams(family, cache_name, policy_name, devices, 2)
    want = (_reference(family, "float32", "none", "1") if lossless
            else _reference(family, cache_name, policy_name, devices))
    return np.repeat(want, 2, axis=0) if entry == "sample_n" else want


@pytest.mark.heavy
@pytest.mark.slow
@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("devices", DEVICES)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("family", FAMILIES)
def test_cell(family, cache, policy, devices, entry):
    cell = (family, cache, policy, devices, entry)
    if cell in UNDEFINED:
        from kvjax.cache.policies import UndefinedCombination

        with pytest.raises(UndefinedCombination):
            _engine(*cell)
        return
    got = _engine(*cell)
    want = _expected(*cell)
    np.testing.assert_array_equal(got, want, err_msg=f"cell {cell}, KVJAX_TEST_SEED={SEED}")
