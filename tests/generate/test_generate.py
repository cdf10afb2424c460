"""The decode loop, sampling, streaming, parallel sampling and beam search on a tiny model.

One tiny random HF Llama (GQA 8:2) serves every test; shapes are shared where
possible so that programs compile once.
"""

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax.cache as kv_cache
import kvjax.generate as gen
import kvjax.models as models
from kvjax.generate import sampling as sampling_mod
from tests.models import hf_tiny

torch = hf_tiny.torch

PAGE = 8
CC = gen.CacheConfig(page_size=PAGE)
LENS = (5, 13, 21)
SAMPLED = gen.SamplingConfig(temperature=0.8, top_k=40, top_p=0.9)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    m = hf_tiny.build("llama_gqa")
    d = tmp_path_factory.mktemp("llama_gqa")
    m.save_pretrained(d)
    model, params = models.load(str(d))
    return m, model, params


def _prompts(rng, vocab, lens=LENS):
    return [rng.integers(3, vocab, n).tolist() for n in lens]


def _single_cache(model, max_tokens=64):
    return kv_cache.init_cache(
        gen.CacheConfig(page_size=PAGE).spec(model, num_seqs=1, max_tokens=max_tokens))


# ---------------------------------------------------------------------------- sampling


@functools.partial(jax.jit, static_argnums=1)
def _filtered(logits, cfg):
    return sampling_mod._filter(logits, cfg)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _draws(logits, key, n, cfg):
    """`n` samples of each row, each row with its own key (one program per config)."""
    keys = jax.random.split(key, n * logits.shape[0]).reshape(n, logits.shape[0])
    return jax.vmap(lambda k: gen.sample(logits, k, cfg))(keys)


def test_sampling_filters_match_numpy(rng):
    logits = rng.normal(size=(3, 40)).astype(np.float32) * 2
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    for cfg in (gen.SamplingConfig(temperature=1.0, top_k=5),
                gen.SamplingConfig(temperature=1.0, top_p=0.6),
                gen.SamplingConfig(temperature=1.0, top_k=8, top_p=0.7)):
        keep = np.ones_like(logits, bool)
        if cfg.top_k:
            keep &= logits >= np.sort(logits, 1)[:, -cfg.top_k][:, None]
        if cfg.top_p:
            p = np.where(keep, probs, 0)
            p /= p.sum(1, keepdims=True)
            order = np.argsort(-p, 1)
            before = np.cumsum(np.take_along_axis(p, order, 1), 1) - np.take_along_axis(p, order, 1)
            kp = np.zeros_like(keep)
            np.put_along_axis(kp, order, before < cfg.top_p, 1)
            keep &= kp
        got = np.isfinite(np.asarray(_filtered(logits, cfg)))
        np.testing.assert_array_equal(got, keep)

        # Empirical frequencies over many keys follow the renormalised kept probabilities.
        n = 4000
        draws = np.asarray(_draws(logits, jax.random.key(int(rng.integers(1 << 30))), n, cfg))
        for b in range(3):
            want = np.where(keep[b], probs[b], 0)
            want /= want.sum()
            freq = np.bincount(draws[:, b], minlength=40) / n
            assert set(np.nonzero(freq)[0]) <= set(np.nonzero(keep[b])[0])
            np.testing.assert_allclose(freq, want, atol=0.035)  # ~4.5 sigma at n=4000
    greedy = np.asarray(gen.sample(jnp.asarray(logits), None, gen.GREEDY))
    np.testing.assert_array_equal(greedy, logits.argmax(1))
    with pytest.raises(ValueError, match="top_p"):
        gen.SamplingConfig(temperature=1.0, top_p=1.5)


# ---------------------------------------------------------------------------- the loop


def test_rows_are_independent(tiny, rng):
    """A batch of different-length prompts, sampled with per-row keys: each row equals
    that prompt generated alone with its key."""
    _, model, params = tiny
    prompts = _prompts(rng, model.vocab_size)
    keys = gen.as_keys(jax.random.key(int(rng.integers(1 << 30))), 3)
    max_new = [24, 11, 24]
    res = gen.generate(model, params, prompts, key=keys, max_new_tokens=max_new,
                       sampling=SAMPLED, cache=CC, chunk_size=PAGE)
    np.testing.assert_array_equal(res.num_generated, max_new)
    alone = gen.generate(model, params, [prompts[2]], key=keys[2:3], max_new_tokens=24,
                         sampling=SAMPLED, cache=_single_cache(model), chunk_size=PAGE)
    assert alone.sequences()[0] == res.sequences()[2]



def test_eos_and_length_stops_free_pages(tiny, rng):
    _, model, params = tiny
    prompts = _prompts(rng, model.vocab_size)
    kw = dict(key=jax.random.key(0), cache=CC, chunk_size=PAGE)
    full = gen.generate(model, params, prompts, max_new_tokens=[24, 11, 24], **kw)
    np.testing.assert_array_equal(full.num_generated, [24, 11, 24])
    # Finished rows were freed (free_finished defaults to True).
    assert int(full.cache.num_free_pages) == full.cache.spec.num_pages
    assert (np.asarray(full.cache.lengths) == 0).all()
    kv_cache.check_invariants(full.cache.table)
    eos = full.sequences()[0][5]
    res = gen.generate(model, params, prompts, max_new_tokens=[24, 11, 24], eos_ids=(eos,),
                       free_finished=False, **kw)
    for b, seq in enumerate(full.sequences()):
        stop = seq.index(eos) + 1 if eos in seq else len(seq)
        assert res.sequences()[b] == seq[:stop]
        assert (res.tokens[b, stop:] == -1).all()
    # Fed tokens are cached; the last sampled one never is.
    want_len = np.array(LENS) + res.num_generated - 1
    np.testing.assert_array_equal(np.asarray(res.cache.lengths), want_len)
    kv_cache.check_invariants(res.cache.table)
    used = res.cache.spec.num_pages - int(res.cache.num_free_pages)
    assert used == sum(-(-n // PAGE) for n in want_len)



def test_out_of_pages_is_a_status_then_an_error(tiny, rng):
    _, model, params = tiny
    prompts = _prompts(rng, model.vocab_size)
    kw = dict(key=jax.random.key(0), max_new_tokens=24, chunk_size=PAGE)
    # Prompts take 1 + 2 + 3 pages; 8 pages run out during decoding.
    small = gen.CacheConfig(page_size=PAGE, num_pages=8)
    with pytest.raises(kv_cache.CacheFullError, match="needs") as err:
        gen.generate(model, params, prompts, cache=small, **kw)
    kv_cache.check_invariants(err.value.cache)  # the final cache travels with the error
    res = gen.generate(model, params, prompts, cache=small, check=False, **kw)
    assert int(res.status.code) == 1
    full = gen.generate(model, params, prompts, cache=CC, **kw)
    for got, want in zip(res.sequences(), full.sequences(), strict=True):
        assert 0 < len(got) < len(want) and got == want[: len(got)]
    kv_cache.check_invariants(res.cache.table)


def test_decode_loop_compiles_once_and_donates(tiny, rng):
    """64 steps in the while_loop and 64 streamed steps trace the model once each, the
    donated cache is reused (no "donated buffers were not usable" warning), and streaming
    yields the loop's tokens."""
    _, model, params = tiny
    traces = []

    def counting_forward(*args, **kw):
        traces.append(args[3].shape)  # tokens shape at trace time
        return model.forward(*args, **kw)

    counted = dataclasses.replace(model, forward=counting_forward)
    kw = dict(max_new_tokens=64, sampling=SAMPLED, cache=CC, chunk_size=PAGE)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*[Dd]onated buffers.*")
        prompts = _prompts(rng, model.vocab_size)
        a = gen.generate(counted, params, prompts, key=jax.random.key(1), **kw)
        assert (a.num_generated == 64).all()
        assert [t for t in traces if t[1] == 1] == [(3, 1)]  # one decode trace: the loop body
        n = len(traces)
        b = gen.generate(counted, params, _prompts(rng, model.vocab_size), key=jax.random.key(2),
                         **kw)
        assert (b.num_generated == 64).all()
        assert len(traces) == n  # a second batch of the same shape: no retrace

        # The streaming generator runs the same step function, one jitted call per token.
        steps, streamed = 0, [[] for _ in prompts]
        for event in gen.stream(counted, params, prompts, key=jax.random.key(1), **kw):
            steps += 1
            for r in np.nonzero(event.emitted)[0]:
                streamed[r].append(int(event.tokens[r]))
    assert steps == 64
    assert len(traces) == n + 1  # the jitted step, traced once for 63 calls
    assert streamed == a.sequences()
    assert int(event.state.cache.num_free_pages) == event.state.cache.spec.num_pages


# ---------------------------------------------------------------------------- sharing pages


def test_parallel_sampling_shares_prompt_pages(tiny, rng):
    _, model, params = tiny
    prompt = _prompts(rng, model.vocab_size, lens=(21,))[0]  # pages: full, full, 5/8 used
    n, new = 4, 24  # 24: the single-prompt runs reuse the programs of the test above
    key = jax.random.key(int(rng.integers(1 << 30)))

    # Right after the fork: the prompt's 3 pages are held once, referenced 4 times.
    tokens, lengths, chunk = gen.pad_prompts([prompt], PAGE)
    spec = gen.CacheConfig(page_size=PAGE).spec(model, num_seqs=n, max_tokens=21 + new)
    cache, _, st, _, _ = gen.prefill(model, params, kv_cache.init_cache(spec),
                                     jnp.asarray(tokens), jnp.asarray(lengths),
                                     jnp.zeros((1,), jnp.int32), chunk_size=chunk)
    cache, st = gen.fork_samples(cache, [0], n)
    st.raise_if_error()
    prompt_pages = np.asarray(cache.block_tables)[0, :3]
    np.testing.assert_array_equal(np.asarray(cache.table.refcounts)[prompt_pages], [n] * 3)
    assert spec.num_pages - int(cache.num_free_pages) == 3
    np.testing.assert_array_equal(np.asarray(cache.block_tables)[:, :3], [prompt_pages] * n)

    res = gen.sample_n(model, params, [prompt], n=n, key=key, max_new_tokens=new,
                       sampling=SAMPLED, cache=CC, chunk_size=PAGE, free_finished=False)
    c = res.cache
    kv_cache.check_invariants(c.table)
    bt = np.asarray(c.block_tables)
    # The two full prompt pages stay shared by all samples; the partial one was
    # copied on write by 3 of them; each row holds 6 pages of 44 tokens.
    np.testing.assert_array_equal(bt[:, :2], [bt[0, :2]] * n)
    np.testing.assert_array_equal(np.asarray(c.table.refcounts)[bt[0, :2]], [n, n])
    assert len(set(bt[:, 2].tolist())) == n
    assert spec.num_pages - int(c.num_free_pages) == 2 + n * 4
    seqs = res.sequences()
    assert len({tuple(s) for s in seqs}) > 1  # samples differ

    keys = gen.sample_keys(key, 1, n)
    for j in range(n):
        alone = gen.generate(model, params, [prompt], key=keys[j][None], max_new_tokens=new,
                             sampling=SAMPLED, cache=_single_cache(model),
                             chunk_size=PAGE)
        assert alone.sequences()[0] == seqs[j]


def test_beam_search_matches_transformers(tiny, rng):
    m, model, params = tiny
    prompt = _prompts(rng, model.vocab_size, lens=(13,))[0]
    new = 12
    res = gen.beam_search(model, params, prompt, beam_width=4, max_new_tokens=new, cache=CC,
                          chunk_size=PAGE)
    with torch.no_grad():
        ref = m.generate(torch.tensor([prompt]), num_beams=4, do_sample=False,
                         max_new_tokens=new, eos_token_id=None, pad_token_id=0,
                         length_penalty=1.0, early_stopping=False)[0, len(prompt):].tolist()
    assert res.best == ref
    assert (np.diff(res.scores) <= 0).all()
    # The best beam's score is its summed log-probability under the model.
    with torch.no_grad():
        logp = torch.log_softmax(m(torch.tensor([prompt + ref])).logits[0], -1).numpy()
    want = sum(logp[len(prompt) - 1 + i, t] for i, t in enumerate(ref))
    np.testing.assert_allclose(res.scores[0], want, rtol=0, atol=1e-3)
    kv_cache.check_invariants(res.cache.table)
    assert int(res.cache.num_free_pages) == res.cache.spec.num_pages


def test_drives_the_mla_family(tmp_path, rng):
    """The same loop decodes a DeepSeek-V2 (MLA latent cache) checkpoint, token for token."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.DeepseekV2Config(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=16, q_lora_rank=None, first_k_dense_replace=2,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        initializer_range=0.2, eos_token_id=None, bos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    m = transformers.DeepseekV2ForCausalLM(cfg).eval()
    m.save_pretrained(tmp_path)
    model, params = models.load(str(tmp_path))
    assert model.family == "deepseek"
    prompts = _prompts(rng, 96, lens=(6, 19))
    res = gen.generate(model, params, prompts, key=jax.random.key(0), max_new_tokens=12,
                       chunk_size=PAGE)
    for p, ours in zip(prompts, res.sequences(), strict=True):
        with torch.no_grad():
            ref = m.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert ours == ref
