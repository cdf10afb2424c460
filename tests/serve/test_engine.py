"""The serving engine's tokens: every request's equal `kvjax.generate` run on it alone,
on a tiny random HF Llama (GQA 8:2) with fresh random prompts that share a "system
prompt", so prefix hits happen; with preemption, without prefix caching, on KIVI pages,
and sampled."""

import jax
import pytest

import kvjax.generate as gen
from kvjax.serve import Engine
from kvjax.specs import QuantSpec
from tests.serve.engine_helpers import CHUNK, PAGE, _alone, _drive, _workload


def _pooled(model, params, dtype="float32"):
    """3 rows of up to 96 tokens on a pool of 14 pages (3 such requests would need 3 x 12):
    cached prefixes are evicted and requests preempted. The tests below share it, so its
    programs compile once per dtype."""
    return Engine(model, params, max_seqs=3, max_seq_len=96, chunk_size=CHUNK, prefill_rows=2,
                  cache=gen.CacheConfig(dtype=dtype, page_size=PAGE, num_pages=14))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_equals_generate_alone_with_hits_and_preemption(tiny, rng, dtype):
    model, params = tiny
    # Prompts of 35 to 48 tokens (one reference program) and 28 to 48 more. The first three
    # start together and share only their 4 system-prompt pages: each holds 60 tokens or
    # more (8 pages) before the first ends, 4 + 3 x 4 = 16 pages of 14, so one is preempted.
    prompts, max_new = _workload(rng, model.vocab_size, 8, system=32, suffix=(3, 17),
                                 new=(28, 49))
    cfg = gen.CacheConfig(dtype=dtype, page_size=PAGE)
    engine = _pooled(model, params, dtype)
    got, reasons = _drive(engine, prompts, max_new, first=3)
    assert engine.stats["hit_pages"] > 0, engine.stats
    assert engine.stats["preemptions"] > 0, engine.stats
    assert reasons == ["length"] * len(prompts)
    for p, m, g in zip(prompts, max_new, got, strict=True):
        assert g == _alone(model, params, p, m, cfg)


def test_engine_without_prefix_caching_equals_generate(tiny, rng):
    model, params = tiny
    prompts, max_new = _workload(rng, model.vocab_size, 5)
    cfg = gen.CacheConfig(page_size=PAGE)
    engine = Engine(model, params, max_seqs=4, max_seq_len=96, chunk_size=CHUNK, cache=cfg,
                    prefix_caching=False, prefill_rows=2)
    got, _ = _drive(engine, prompts, max_new, arrive_every=1)
    assert engine.stats["hit_pages"] == 0 and engine.stats["preemptions"] == 0
    for p, m, g in zip(prompts, max_new, got, strict=True):
        assert g == _alone(model, params, p, m, cfg)


@pytest.mark.parametrize("bits", [4])
def test_kivi_prefix_hits_equal_generate_alone(tiny, rng, bits):
    """On KIVI pages a hit covers only pages the request would have quantized itself (see
    kvjax.serve.engine), so the requests that hit get the tokens of generate on each alone."""
    model, params = tiny
    # Hits need chunk >= residual + page size (see kvjax.serve.engine).
    cfg = gen.CacheConfig(dtype="float32", page_size=PAGE,
                          quant=QuantSpec(bits=bits, group_size=PAGE, residual=PAGE))
    prompts, max_new = _workload(rng, model.vocab_size, 4, system=64, suffix=(3, 16))
    engine = Engine(model, params, max_seqs=3, max_seq_len=128, chunk_size=CHUNK, cache=cfg,
                    prefill_rows=1)
    got, _ = _drive(engine, prompts, max_new)
    assert engine.stats["hit_pages"] > 0, engine.stats
    assert got == [_alone(model, params, p, m, cfg) for p, m in zip(prompts, max_new,
                                                                   strict=True)]


def test_sampled_rows_equal_generate_with_the_same_key(tiny, rng):
    model, params = tiny
    prompts, max_new = _workload(rng, model.vocab_size, 4, new=(8, 16))
    configs = [gen.SamplingConfig(temperature=0.9, top_k=20, top_p=0.9),
               gen.SamplingConfig(temperature=1.3), gen.GREEDY,
               gen.SamplingConfig(temperature=0.7, top_p=0.8)]
    seeds = [int(s) for s in rng.integers(0, 2**31, len(prompts))]
    engine = _pooled(model, params)  # 4 requests of up to 79 tokens: a preemption may come
    ids = [engine.add_request(p, max_tokens=m, sampling=c, seed=s)
           for p, m, c, s in zip(prompts, max_new, configs, seeds, strict=True)]
    out = engine.run()
    for i, p, m, c, s in zip(ids, prompts, max_new, configs, seeds, strict=True):
        ref = _alone(model, params, p, m, gen.CacheConfig(page_size=PAGE),
                     key=jax.random.key(s)[None], sampling=c)
        assert out[i] == ref
