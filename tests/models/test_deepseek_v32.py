"""DeepSeek-V3.2 (MLA + MoE + DeepSeek Sparse Attention) against transformers (PyTorch CPU).

Two tiny random configs (`hf_tiny`: "v32_moe", a dense layer then MoE, YaRN rope,
index_topk 8 below the contexts; "v32_dense", dense MLPs, tied embeddings, index_topk 64
above them) are built and saved with transformers and loaded with `kvjax.models.load`.
Checked: float32 logits within 1e-4 of transformers at every prompt position (chunked
prefill, rows in non-trivial slots); 32 greedy tokens identical through
`kvjax.generate.generate` and `python -m kvjax generate`; the compiled decode step
gathers only the selected latent rows (dense MLA gathers the whole context); the
indexer keys ride the latent pages through fork, copy-on-write, truncation, scrubbing,
compaction and KIVI flushes; policy and host-tier refusals; config errors; the second
config; `sample_n` and `beam_search` against transformers; bf16 and KIVI int4 caches;
sharding plans on 8 devices; StreamingLLM.
"""

import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import kvjax.cache as kc  # noqa: E402
import kvjax.generate as gen  # noqa: E402
import kvjax.models as models  # noqa: E402
from kvjax import sharding as kvs  # noqa: E402
from kvjax.__main__ import main  # noqa: E402
from kvjax.cache import host  # noqa: E402
from kvjax.cache.policies import (  # noqa: E402
    H2O,
    PyramidKV,
    Quest,
    SnapKV,
    StreamingLLM,
    UndefinedCombination,
)
from kvjax.cache.policies.compaction import compact  # noqa: E402
from kvjax.models import deepseek_v32 as v32  # noqa: E402
from kvjax.specs import CacheSpec, IndexerCacheSpec, MLASpec, QuantSpec  # noqa: E402
from tests.models import hf_tiny  # noqa: E402

PAGE = 8
LENS = (13, 21)  # different lengths in one batch; both cross page boundaries
NEW = 32
# f32 end to end; the two sides sum in different orders (~1e-6), bound 1e-4.
LOGIT_ATOL = 1e-4
CC = gen.CacheConfig(page_size=PAGE)


@functools.cache
def _case(name: str, root: str):
    """(hf_model, kvjax model, params, directory) of a case, built once per session."""
    seed = int(os.environ.get("KVJAX_TEST_SEED", np.random.SeedSequence().entropy % 2**31))
    print(f"{name} weights: KVJAX_TEST_SEED={seed}")
    m = hf_tiny.build(name, seed=seed)
    with torch.no_grad():
        # transformers zeroes the padding token's embedding (pad_token_id 0): that token's
        # hidden state, hence its indexer query, would be 0 and every score tie at 0, a
        # choice of tokens that each side breaks its own way.
        m.model.embed_tokens.weight[0].normal_(0.0, 0.1)
    d = f"{root}/{name}"
    m.save_pretrained(d)
    model, params = models.load(d)
    return m, model, params, d


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("deepseek_v32"))


def _prompts(rng, lens=LENS):
    return [rng.integers(3, 96, n).tolist() for n in lens]


def _hf_logits(m, ids) -> np.ndarray:
    return hf_tiny.hf_logits(m, ids)


def _hf_greedy(m, prompt, new=NEW) -> list[int]:
    return hf_tiny.hf_greedy(m, prompt, new)


_assert_greedy = hf_tiny.assert_greedy


_forward = jax.jit(v32.forward, static_argnames=("config", "impl"), donate_argnames="cache")


def _put(x, dtype=np.int32):
    """A host array on the device (jnp.asarray would compile a program per shape)."""
    return jax.device_put(np.asarray(x, dtype))


# One compiled prefill, start and decode loop serve every float32 `generate` of "v32_moe"
# here (two prompts of at most 24 tokens, NEW tokens, pages kept): the parity test, the
# one-device reference of the sharded test and StreamingLLM's uncompacted run.
GEN = dict(max_new_tokens=NEW, cache=CC, chunk_size=16, free_finished=False)


def _prefill(params, config, cache, prompts, seq_ids, chunk):
    """Feeds the prompts `chunk` tokens per forward (rows padded; a row that has run out
    has none); returns (cache, each prompt's logits at its every token)."""
    logits = [[] for _ in prompts]
    for s in range(0, max(map(len, prompts)), chunk):
        rows = [p[s:s + chunk] for p in prompts]
        tokens = np.zeros((len(rows), chunk), np.int32)
        for i, r in enumerate(rows):
            tokens[i, :len(r)] = r
        q_lengths = np.array([len(r) for r in rows], np.int32)
        counts = np.zeros(cache.spec.max_seqs, np.int32)
        counts[seq_ids] = q_lengths
        cache, status = kc.reserve(cache, _put(counts))
        status.raise_if_error()
        positions = s + np.arange(chunk, dtype=np.int32)[None].repeat(len(rows), 0)
        out, cache = _forward(params, config, _put(tokens), _put(positions), cache,
                              q_lengths=_put(q_lengths), seq_ids=_put(seq_ids))
        for i, r in enumerate(rows):
            logits[i].extend(np.asarray(out)[i, :len(r)])
    return cache, [np.stack(x) for x in logits]


# ------------------------------------------------------------------- transformers parity


@pytest.mark.parametrize("name", ["v32_moe", "v32_dense"])
def test_matches_transformers(name, root, rng, full_sweeps):
    """Prefill logits at every position (chunks of 8, two rows in slots 2 and 0) and 32
    greedy tokens through generate; index_topk below the contexts ("v32_moe": the tokens
    are really chosen) or above them ("v32_dense": the sparse path selects all)."""
    m, model, params, _ = _case(name, root)
    assert model.family == "deepseek_v32"
    c = model.config
    assert c.index_topk == {"v32_moe": 8, "v32_dense": 64}[name]
    prompts = _prompts(rng)
    seq_ids = np.array([2, 0], np.int32)
    # 12 pages of 8: capacity 96 > index_topk in both cases, so the indexer runs.
    cache = kc.init_cache(model.make_cache_spec(page_size=PAGE, num_pages=24, max_seqs=3,
                                                max_pages_per_seq=12))
    _, logits = _prefill(params, c, cache, prompts, seq_ids, chunk=8)
    for i, p in enumerate(prompts):
        np.testing.assert_allclose(logits[i], _hf_logits(m, p), atol=LOGIT_ATOL, rtol=0,
                                   err_msg=f"prefill logits, prompt {i}")
    res = gen.generate(model, params, prompts, key=jax.random.key(0), **GEN)
    for i in range(len(prompts)) if full_sweeps else [1]:
        _assert_greedy(m, prompts[i], res.tokens[i].tolist(), _hf_greedy(m, prompts[i]))


@pytest.mark.parametrize("name", ["v32_moe", "v32_dense"])
def test_cli_generate_matches_transformers(name, root, rng, capsys):
    m, _, _, d = _case(name, root)
    capsys.readouterr()  # the case's seed line, when this test built it: not the CLI's output
    prompt = _prompts(rng, (11,))[0]
    assert main(["generate", "--model", d, "--prompt-ids", ",".join(map(str, prompt)),
                 "--max-new-tokens", str(NEW), "--page-size", str(PAGE), "--eos-id", "none",
                 "--chunk-size", "8"]) == 0
    out = capsys.readouterr()
    ids = [int(t) for t in out.out.strip().split(",")]
    assert ids[:len(prompt)] == prompt
    _assert_greedy(m, prompt, ids[len(prompt):], _hf_greedy(m, prompt))
    assert "loaded DeepseekV32ForCausalLM (deepseek_v32" in out.err


# -------------------------------------------------- what a compiled decode step gathers


def _tiny_config(**kw) -> v32.DeepseekV32Config:
    """In-process config whose pools differ in width (latent 40, rope 8, indexer 24)."""
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                num_heads=4, kv_lora_rank=40, q_lora_rank=16, qk_rope_head_dim=8,
                qk_nope_head_dim=8, v_head_dim=8, first_k_dense_replace=2, index_n_heads=4,
                index_head_dim=24, index_topk=8)
    return v32.DeepseekV32Config(**{**base, **kw})


def _gathered_rows(hlo: str, width: int) -> int:
    """Rows of `width` elements that the gathers of a compiled program produce (a gather of
    whole pages `[.., n, page_size * width]` counts page_size rows per page)."""
    rows = 0
    for shape in re.findall(r"= [a-z0-9]+\[([0-9,]+)\]\{[0-9,]*\} gather\(", hlo):
        dims = [int(x) for x in shape.split(",")]
        if dims[-1] % width == 0 and dims[-1] // width in (1, PAGE):
            rows += int(np.prod(dims[:-1])) * (dims[-1] // width)
    return rows


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_reads_only_the_selected_tokens(rng, dtype):
    """The compiled decode step (one layer group, scanned) gathers index_topk = 8 latent
    rows per sequence per layer, at most topk + one page; with index_topk at the cache's
    capacity (dense MLA, the same tokens) it gathers every token of the context."""
    lengths = np.array([100, 70], np.int32)
    batch = len(lengths)

    def step_hlo(config):
        params = v32.init_params(config, jax.random.key(0))
        spec = v32.cache_spec(config, page_size=PAGE, num_pages=40, max_seqs=batch,
                              max_pages_per_seq=16, dtype=dtype)
        cache, _ = kc.reserve(kc.init_cache(spec), jnp.asarray(lengths))
        tokens = jnp.asarray(rng.integers(0, 64, (batch, 1)), jnp.int32)
        positions = jnp.asarray(lengths[:, None] - 1)
        step = jax.jit(functools.partial(v32.forward, config=config, impl="xla",
                                         q_lengths=jnp.ones(batch, jnp.int32)))
        return step.lower(params, tokens=tokens, positions=positions,
                          cache=cache).compile().as_text()

    sparse = _gathered_rows(step_hlo(_tiny_config()), 40) / batch
    dense = _gathered_rows(step_hlo(_tiny_config(index_topk=16 * PAGE)), 40) / batch
    assert 8 <= sparse <= 8 + PAGE, sparse
    assert dense >= lengths.max(), dense  # the whole context (rounded to the loop's block)


# --------------------------------------------------------- indexer keys in the paged cache


def _spec(quant=None, **kw):
    return CacheSpec(attention=MLASpec(q_heads=2, kv_lora_rank=16, qk_rope_head_dim=4,
                                       qk_nope_head_dim=4, v_head_dim=4),
                     num_layers=2, page_size=4, num_pages=16, max_seqs=3, max_pages_per_seq=6,
                     indexer=IndexerCacheSpec(head_dim=8), quant=quant, **kw)


@jax.jit
def _write_layers(cache, c_kv, k_rope, keys, counts):
    """kc.write of each layer's rows (one program instead of one per eager operation)."""
    for layer in range(2):
        cache = kc.write(cache, layer, c_kv[layer], k_rope[layer], q_lengths=counts,
                         index_keys=keys[layer])
    return cache


def _fill(cache, rng, counts):
    """Reserves `counts` tokens per slot and writes random latents and indexer keys in both
    layers; returns (cache, {layer: keys [max_seqs, n, 8]})."""
    counts = _put(counts)
    cache, status = kc.reserve(cache, counts)
    status.raise_if_error()
    n = int(np.max(counts))
    c_kv, k_rope, keys = (rng.standard_normal((2, 3, n, w)).astype(np.float32)
                          for w in (16, 4, 8))
    cache = _write_layers(cache, c_kv, k_rope, keys, counts)
    return cache, dict(enumerate(keys))


def _index_rows(cache, layer, slot, n):
    """The indexer keys of a slot's first n tokens, read through its block table."""
    ps = cache.spec.page_size
    bt = np.asarray(cache.block_tables)[slot]
    pool = np.asarray(cache.pages.index_k)[layer, 0]
    return np.stack([pool[bt[j // ps], j % ps] for j in range(n)])


def test_indexer_keys_ride_the_latent_pages(rng):
    """Written keys sit at the latent's page and offset; a fork shares the pages; a write
    into the shared last page copies it (the copy holds the keys too); truncation and
    free return the pages (scrub zeroes their keys); compaction moves keys with tokens."""
    cache, keys = _fill(kc.init_cache(_spec()), rng, [10, 0, 0])
    for layer in range(2):
        np.testing.assert_array_equal(_index_rows(cache, layer, 0, 10), keys[layer][0, :10])
    cache, status = kc.fork(cache, jnp.array([0]), jnp.array([1]))
    status.raise_if_error()
    bt = np.asarray(cache.block_tables)
    np.testing.assert_array_equal(bt[1, :3], bt[0, :3])
    cache, new = _fill(cache, rng, [0, 1, 0])  # slot 1's 11th token: its 3rd page is shared
    bt = np.asarray(cache.block_tables)
    assert bt[1, 2] != bt[0, 2] and bt[1, 1] == bt[0, 1]
    for layer in range(2):
        np.testing.assert_array_equal(_index_rows(cache, layer, 1, 11),
                                      np.concatenate([keys[layer][0, :10],
                                                      new[layer][1, :1]]))
        np.testing.assert_array_equal(_index_rows(cache, layer, 0, 10), keys[layer][0, :10])
    kc.check_invariants(cache)

    # Compaction (StreamingLLM's eviction on full-precision pages) moves every pool.
    keep = np.tile(np.arange(8), (2, 3, 1, 1)).astype(np.int32)
    keep[:, 0, 0, 2:8] = [4, 5, 6, 7, 8, 9]  # slot 0 keeps tokens 0, 1, 4 .. 9
    cache, _, status = jax.jit(compact)(cache, _put(keep), _put([8, 11, 0]))
    assert bool(status.ok)
    for layer in range(2):
        np.testing.assert_array_equal(_index_rows(cache, layer, 0, 8),
                                      keys[layer][0, [0, 1, 4, 5, 6, 7, 8, 9]])
        np.testing.assert_array_equal(_index_rows(cache, layer, 1, 10), keys[layer][0, :10])

    cache, status = kc.truncate(cache, jnp.array([4, 11, 0], jnp.int32))
    status.raise_if_error()
    gone = set(np.asarray(bt[0, 1:2]).tolist()) - set(np.asarray(cache.block_tables)[1, :3])
    cache = kc.free(cache, jnp.array([True, False, False]), scrub=True)
    pool = np.asarray(cache.pages.index_k)
    for page in gone:
        assert not pool[:, :, page].any()
    kc.check_invariants(cache)


def test_kivi_flushes_indexer_keys_with_the_latent(rng):
    """KIVI latents: indexer keys of quantized tokens land in the index_k pages (full
    precision, exact), the tail's in ring c; a fork copies the ring; eviction of a
    quantized page rotates ring c with the others."""
    from kvjax.cache import quantized

    cache = kc.init_cache(_spec(QuantSpec(bits=4, group_size=8, residual=4)))
    cache, keys = _fill(cache, rng, [14, 0, 0])  # Q = 8 quantized, 6 in the tail
    assert int(cache.quant_lengths[0]) == 8 and cache.tail.c.dtype == jnp.float32
    ring = quantized.tail_capacity(cache.spec)
    for layer in range(2):
        np.testing.assert_array_equal(_index_rows(cache, layer, 0, 8), keys[layer][0, :8])
        tail = np.asarray(cache.tail.c)[layer, 0, 0, np.arange(8, 14) % ring]
        np.testing.assert_array_equal(tail, keys[layer][0, 8:14])
    cache, status = kc.fork(cache, jnp.array([0]), jnp.array([2]))
    status.raise_if_error()
    np.testing.assert_array_equal(np.asarray(cache.tail.c)[:, :, 2],
                                  np.asarray(cache.tail.c)[:, :, 0])
    drop = np.zeros((3, 6), bool)
    drop[0, 0] = True  # evict slot 0's first quantized page: positions shift by 4
    cache, _, status = jax.jit(quantized.drop_pages)(cache, _put(drop, bool))
    assert bool(status.ok) and int(cache.lengths[0]) == 10
    for layer in range(2):
        np.testing.assert_array_equal(_index_rows(cache, layer, 0, 4), keys[layer][0, 4:8])
        tail = np.asarray(cache.tail.c)[layer, 0, 0, np.arange(4, 10) % ring]
        np.testing.assert_array_equal(tail, keys[layer][0, 8:14])
    kc.check_invariants(cache)


def test_sharding_lays_the_indexer_pool_out_like_the_latent_pool():
    plan = kvs.ShardingPlan(mesh=kvs.make_mesh((8,), ("context",)), strategies=("context",))
    spec = _spec(QuantSpec(bits=4, group_size=8, residual=4)).replace(num_pages=32)
    cache = kvs.init_sharded_cache(spec, plan)
    assert cache.pages.index_k.sharding.is_equivalent_to(cache.pages.k_rope.sharding, 5)
    assert len(cache.pages.index_k.sharding.device_set) == 8
    assert cache.tail.c.sharding.is_equivalent_to(cache.tail.a.sharding, 5)


def test_policies_and_host_tier_on_an_indexer_cache():
    """Attention-scoring and page-selecting policies refuse by name; StreamingLLM is
    defined; the host tier refuses; the forward refuses a cache without indexer keys."""
    cache = kc.init_cache(_spec())
    for policy in (H2O(budget=8), SnapKV(budget=8, window=2, kernel=3),
                   PyramidKV(budget=8, window=2, kernel=3, beta=2.0), Quest(top_k=2)):
        with pytest.raises(UndefinedCombination, match=type(policy).__name__ + " on DeepSeek "
                           "Sparse Attention"):
            policy.init_state(cache)
    StreamingLLM(n_sink=4, window=8).init_state(cache)
    with pytest.raises(ValueError, match="lightning-indexer keys"):
        host.attach(cache, 4)
    config = _tiny_config()
    params = v32.init_params(config, jax.random.key(0))
    plain = kc.init_cache(_spec().replace(attention=config.attention, indexer=None))
    with pytest.raises(ValueError, match="the cache's indexer is None"):
        v32.forward(params, config, jnp.zeros((3, 1), jnp.int32), jnp.zeros((3, 1), jnp.int32),
                    plain, q_lengths=jnp.ones(3, jnp.int32))
    with pytest.raises(ValueError, match="index_keys"):
        kc.write(cache, 0, jnp.ones((3, 1, 16)), jnp.ones((3, 1, 4)),
                 q_lengths=jnp.zeros(3, jnp.int32))


# ------------------------------------------------------------------------ config errors


def test_config_from_hf_and_errors():
    base = dict(architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32",
                vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                num_attention_heads=2, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4,
                qk_nope_head_dim=4, v_head_dim=4, n_routed_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=8, n_group=2, topk_group=1, index_n_heads=2,
                index_head_dim=8, index_topk=16, mlp_layer_types=["dense", "sparse"],
                rope_interleave=False)
    c = v32.DeepseekV32Config.from_hf(base)
    assert (c.num_dense_layers, c.num_moe_layers, c.index_topk) == (1, 1, 16)
    assert c.rope.interleaved and c.scoring_func == "sigmoid"
    assert c.indexer_cache == IndexerCacheSpec(head_dim=8, dtype="float32")
    assert v32.DeepseekV32Config.from_hf({**base, "dtype": "bfloat16"}).indexer_cache.dtype == (
        jnp.bfloat16)
    for change, words in (
            (dict(mlp_layer_types=["sparse", "dense"]), "'dense' ones first"),
            (dict(layer_types=["indexed_attention", "full_attention"]), "indexed_attention"),
            (dict(q_lora_rank=None), "q_lora_rank"),
            (dict(index_head_dim=2), "index_head_dim=2 must be >= qk_rope_head_dim"),
            (dict(index_topk=0), "index_topk must be a positive int"),
            (dict(model_type="deepseek_v3"), "is not DeepSeek-V3.2")):
        with pytest.raises(ValueError, match=words):
            v32.DeepseekV32Config.from_hf({**base, **change})
    with pytest.raises(ValueError, match="router is DeepSeek-V3's"):
        _tiny_config(first_k_dense_replace=0, n_routed_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=8, scoring_func="softmax", topk_method="greedy")
    assert models.family_for_architecture("DeepseekV32ForCausalLM").name == "deepseek_v32"


# ------------------------------------------------- entries, page kinds, plans, policies


def test_sample_n_and_beam_search(root, rng):
    m, model, params, _ = _case("v32_moe", root)
    prompt = _prompts(rng, (13,))[0]
    greedy = _hf_greedy(m, prompt, new=12)
    res = gen.sample_n(model, params, [prompt], n=3, key=jax.random.key(1), max_new_tokens=12,
                       cache=CC, chunk_size=16)
    _assert_greedy(m, prompt, res.tokens[0].tolist(), greedy)
    assert res.tokens.tolist() == [res.tokens[0].tolist()] * 3  # greedy from forked slots

    beams = gen.beam_search(model, params, prompt, beam_width=3, max_new_tokens=12, cache=CC,
                            chunk_size=16)
    with torch.no_grad():
        ref = m.generate(torch.tensor([prompt]), num_beams=3, do_sample=False, max_new_tokens=12,
                         eos_token_id=None, pad_token_id=0, length_penalty=1.0,
                         early_stopping=False)[0, len(prompt):].tolist()
    assert beams.best == ref
    logp = torch.log_softmax(torch.tensor(_hf_logits(m, prompt + ref)), -1).numpy()
    want = sum(logp[len(prompt) - 1 + i, t] for i, t in enumerate(ref))
    np.testing.assert_allclose(beams.scores[0], want, rtol=0, atol=1e-3)


def _stepwise_greedy(model, params, prompts, config, new):
    """Greedy tokens by the public operations one step at a time (prefill in chunks of 16,
    then one token per forward): the reference the jitted loop must equal. Returns the
    tokens and each step's logits."""
    cache = config.build(model, num_seqs=len(prompts), max_tokens=max(map(len, prompts)) + new)
    seq_ids = np.arange(len(prompts), dtype=np.int32)
    cache, logits = _prefill(params, model.config, cache, prompts, seq_ids, chunk=16)
    steps = [np.stack([x[-1] for x in logits])]
    ones = _put(np.ones(len(prompts)))
    for t in range(new - 1):
        tok = steps[-1].argmax(-1).astype(np.int32)[:, None]
        cache, status = kc.reserve(cache, ones)
        status.raise_if_error()
        pos = np.array([[len(p) + t] for p in prompts], np.int32)
        out, cache = _forward(params, model.config, _put(tok), _put(pos), cache,
                              q_lengths=ones, seq_ids=_put(seq_ids))
        steps.append(np.asarray(out)[:, 0])
    steps = np.stack(steps, axis=1)  # [batch, new, vocab]
    return steps.argmax(-1), steps


@pytest.mark.parametrize("kind", ["bf16", "kivi4"])
def test_low_precision_caches(kind, root, rng):
    """bf16 latent pages and KIVI int4 latents (the indexer keys stay float32, the model's
    dtype): generate's greedy tokens equal a step-by-step run of the public operations on
    the same cache kind; against transformers' float32 model, teacher-forced on those
    tokens, the median log-prob error is within the cache's rounding (a lossy latent can
    flip the indexer's choice at a near tie in a later layer: single tokens move further)."""
    m, model, params, _ = _case("v32_moe", root)
    config = {"bf16": gen.CacheConfig(dtype="bfloat16", page_size=PAGE),
              "kivi4": gen.CacheConfig(quant=QuantSpec(bits=4, group_size=8, residual=8),
                                       page_size=PAGE)}[kind]
    prompts = _prompts(rng)
    new = 12
    res = gen.generate(model, params, prompts, key=jax.random.key(0), max_new_tokens=new,
                       cache=config, chunk_size=16, free_finished=False)
    pages = res.cache.pages
    assert pages.index_k.dtype == jnp.float32
    if kind == "kivi4":
        assert type(pages).__name__ == "QuantizedLatentPages" and res.cache.spec.quant.bits == 4
        assert int(res.cache.quant_lengths.max()) > 0
    else:
        assert pages.c_kv.dtype == jnp.bfloat16
    ref, ref_logits = _stepwise_greedy(model, params, prompts, config, new)
    for i in range(len(prompts)):
        ours = res.tokens[i].tolist()
        if ours != ref[i].tolist():  # only at a near tie of the reference's own logits
            j = next(j for j, (a, b) in enumerate(zip(ours, ref[i], strict=True)) if a != b)
            top2 = np.sort(ref_logits[i, j])[-2:]
            assert top2[1] - top2[0] < 1e-4, (kind, i, j, ours, ref[i].tolist())
    scored = gen.score(model, params, prompts, [r.tolist() for r in res.tokens], cache=config,
                       chunk_size=16)
    err = []
    for i, p in enumerate(prompts):
        toks = res.tokens[i].tolist()
        logp = torch.log_softmax(torch.tensor(_hf_logits(m, p + toks)), -1).numpy()
        err.append(np.abs(np.asarray(scored.logprobs[i, :new])
                          - logp[len(p) - 1 + np.arange(new), toks]))
    # Measured medians over fresh seeds: bf16 ~1e-3, int4 ~0.03-0.07.
    assert np.median(err) < {"bf16": 0.01, "kivi4": 0.15}[kind], np.median(err)


@pytest.mark.parametrize("cache,strategies", [("float32", ("sequences", "heads")),
                                              ("int4", ("context",))])
def test_sharded_decode_equals_one_device(cache, strategies, root, rng):
    """On 8 devices (sequences x heads; context), the indexer scores each device's pages
    and attention gathers each device's selected rows: the greedy tokens equal one
    device's (float32: lossless; KIVI int4: the same codes on every layout)."""
    _, model, params, _ = _case("v32_moe", root)
    # The one-device runs compile nothing new: float32 is shaped like GEN, int4 like
    # test_low_precision_caches' KIVI generate (6 pages of 8 per row, 12 tokens).
    prompts = _prompts(rng, (24, 19) if cache == "float32" else (27, 19))
    quant = QuantSpec(bits=4, group_size=8, residual=8) if cache == "int4" else None
    new = NEW if cache == "float32" else 12
    mesh = (kvs.make_mesh((2, 4), ("data", "model")) if "heads" in strategies
            else kvs.make_mesh((8,), ("context",)))
    want = None
    for plan in (None, kvs.ShardingPlan(mesh=mesh, strategies=strategies)):
        res = gen.generate(model, params, prompts, key=jax.random.key(0), max_new_tokens=new,
                           cache=gen.CacheConfig(page_size=PAGE, quant=quant, plan=plan),
                           chunk_size=16, free_finished=False)
        if want is None:
            want = res.tokens.tolist()
        assert res.tokens.tolist() == want, plan


def test_streaming_llm_composes(root, rng):
    """StreamingLLM (positional eviction) on DSA: each row keeps sink + window tokens, and
    the kept prompt tokens' layer-0 latents and indexer keys (which depend on the token and
    its position only) equal those of the same prompt cached without eviction: the keys
    moved with their tokens."""
    _, model, params, _ = _case("v32_moe", root)
    prompts = _prompts(rng, (24, 22))
    n_sink, window, new = 4, 36, NEW
    run = functools.partial(gen.generate, model, params, prompts, key=jax.random.key(0), **GEN)
    evicted, full = run(policy=StreamingLLM(n_sink=n_sink, window=window)).cache, run().cache
    assert np.asarray(evicted.lengths)[:2].tolist() == [n_sink + window] * 2

    def rows(cache, pool, slot, positions):
        bt = np.asarray(cache.block_tables)[slot]
        x = np.asarray(getattr(cache.pages, pool))[0, 0]
        return x[bt[positions // PAGE], positions % PAGE]

    for slot, p in enumerate(prompts):
        total = len(p) + new - 1  # the last token generated is not fed back
        kept = np.concatenate([np.arange(n_sink), np.arange(total - window, total)])
        prompt_kept = np.nonzero(kept < len(p))[0]  # cache positions of kept prompt tokens
        for pool in ("c_kv", "index_k"):
            np.testing.assert_allclose(rows(evicted, pool, slot, prompt_kept),
                                       rows(full, pool, slot, kept[prompt_kept]),
                                       rtol=1e-6, atol=1e-6, err_msg=pool)
