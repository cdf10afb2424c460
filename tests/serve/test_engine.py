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


@pytest.mark.heavy
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_equals_generate_alone_with_hits_and_preemption(tiny, rng, dtype):
    model, params = tiny
    prompts, max_new = _workload(rng, model.vocab_size, 8, system=32, suffix=(3, 24),
                                 new=(16, 40))
    cfg = gen.CacheConfig(dtype=dtype, page_size=PAGE)
    # 3 rows, a pool of 14 pages (3 requests of up to 96 tokens would need 3 x 12): cached
    # prefixes are evicted and requests preempted.
    engine = Engine(model, params, max_seqs=3, max_seq_len=96, chunk_size=CHUNK,
                    cache=gen.CacheConfig(dtype=dtype, page_size=PAGE, num_pages=14))
    got, reasons = _drive(engine, prompts, max_new)
    assert engine.stats["hit_pages"] > 0, engine.stats
    assert engine.stats["preemptions"] > 0, engine.stats
    assert reasons == ["length"] * len(prompts)
    for p, m, g in zip(prompts, max_new, got, strict=True):
        assert g == _alone(model, params, p, m, cfg)


@pytest.mark.heavy
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


@pytest.mark.heavy
@pytest.mark.parametrize("bits", [4])
def test_kivi_prefix_hits_equal_the_engine_without_them(tiny, rng, bits):
    model, params = tiny
    # Hits need chunk >= residual + page size (see kvjax.serve.engine).
    cfg = gen.CacheConfig(dtype="float32", page_size=PAGE,
                          quant=QuantSpec(bits=bits, group_size=PAGE, residual=PAGE))
    prompts, max_new = _workload(rng, model.vocab_size, 4, system=64, suffix=(3, 40))
    runs = []
    for prefix in (True, False):
        engine = Engine(model, params, max_seqs=3, max_seq_len=128, chunk_size=CHUNK, cache=cfg,
                        prefix_caching=prefix, prefill_rows=1)
        runs.append(_drive(engine, prompts, max_new)[0])
        assert (engine.stats["hit_pages"] > 0) == prefix, engine.stats
    assert runs[0] == runs[1]
    assert runs[1][0] == _alone(model, params, prompts[0], max_new[0], cfg)


@pytest.mark.heavy
def test_sampled_rows_equal_generate_with_the_same_key(tiny, rng):
    model, params = tiny
    prompts, max_new = _workload(rng, model.vocab_size, 4, new=(8, 16))
    configs = [gen.SamplingConfig(temperature=0.9, top_k=20, top_p=0.9),
               gen.SamplingConfig(temperature=1.3), gen.GREEDY,
               gen.SamplingConfig(temperature=0.7, top_p=0.8)]
    seeds = [int(s) for s in rng.integers(0, 2**31, len(prompts))]
    engine = Engine(model, params, max_seqs=2, max_seq_len=96, chunk_size=CHUNK,
                    cache=gen.CacheConfig(page_size=PAGE))
    ids = [engine.add_request(p, max_tokens=m, sampling=c, seed=s)
           for p, m, c, s in zip(prompts, max_new, configs, seeds, strict=True)]
    out = engine.run()
    for i, p, m, c, s in zip(ids, prompts, max_new, configs, seeds, strict=True):
        ref = _alone(model, params, p, m, gen.CacheConfig(page_size=PAGE),
                     key=jax.random.key(s)[None], sampling=c)
        assert out[i] == ref
