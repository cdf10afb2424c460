"""The serving engine with a host tier (`Engine(host_pages=..., host_rows=...)`): preempted
requests are swapped to pinned host memory and back instead of recomputed, evicted prefixes
park there and are hit from there, and every request's tokens are those of the engine
without the tier (on KIVI pages, whose recompute after a preemption may differ, those of
`kvjax.generate` alone), with every program compiled by `warmup`;
a tier too small falls back to recompute, and random arrival / cancel sequences keep every
invariant of both tiers."""

import dataclasses

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import kvjax.generate as gen
from kvjax.cache import host
from kvjax.serve import Engine, PrefixCache, page_hashes
from kvjax.serve import engine as engine_mod
from kvjax.specs import QuantSpec
from tests.serve.engine_helpers import (
    _EVENTS,
    CHUNK,
    PAGE,
    _alone,
    _drive,
    _random_events,
)

ROWS, MAX_LEN, POOL = 3, 96, 14  # 3 requests of ~80 tokens need ~30 pages: a pool of 14 swaps


def _two_tenants(rng, vocab, n):
    """n prompts alternating between two random system prompts (two chunks each), with
    unique suffixes; long outputs, so the rows outgrow the pool."""
    systems = [rng.integers(3, vocab, 2 * CHUNK).tolist() for _ in range(2)]
    prompts = [systems[i % 2] + rng.integers(3, vocab, int(k)).tolist()
               for i, k in enumerate(rng.integers(3, 24, n))]
    return prompts, [int(k) for k in rng.integers(24, 40, n)]


def _engine(model, params, cfg, **kw):
    # One holder slot: registering one tenant's prompt evicts the other's to the host.
    return Engine(model, params, max_seqs=ROWS, max_seq_len=MAX_LEN, chunk_size=CHUNK,
                  cache=cfg, prefix_slots=1, prefill_rows=2, **kw)


CONFIGS = {
    "bfloat16": gen.CacheConfig(dtype="bfloat16", page_size=PAGE),
    # Prefix hits on KIVI need chunk >= residual + page size (see kvjax.serve.engine).
    "kivi4": gen.CacheConfig(dtype="float32", page_size=PAGE,
                             quant=QuantSpec(bits=4, group_size=PAGE, residual=PAGE)),
}


@pytest.mark.rotate(1)
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_swaps_and_host_prefix_hits_keep_the_tokens(tiny, rng, kind):
    model, params = tiny
    cfg = CONFIGS[kind]
    n = 6
    prompts, max_new = _two_tenants(rng, model.vocab_size, n)
    pool = dataclasses.replace(cfg, num_pages=POOL)
    if cfg.quant is None:  # the reference: the engine without the tier, which preempts
        without = _engine(model, params, pool)
        want, _ = _drive(without, prompts, max_new)
        assert without.stats["preemptions"] > 0, without.stats
    # Room for every request at once (and more rows than requests): no recompute at all.
    per_seq = -(-MAX_LEN // PAGE) + 1
    engine = _engine(model, params, pool, host_pages=n * per_seq, host_rows=n + 2)
    engine.warmup()
    programs = (engine_mod._step, engine_mod._release, engine_mod._share, engine_mod._take_row,
                engine_mod._put_row, host._swap_out, host._swap_in, host._drop_parked)
    compiled = [f._cache_size() for f in programs]
    got, reasons = _drive(engine, prompts, max_new)
    assert [f._cache_size() for f in programs] == compiled  # warmup compiled every one
    s = engine.stats
    assert s["swaps"] > 0 and s["swap_ins"] == s["swaps"], s
    assert s["preemptions"] == 0, s
    assert s["prefix_parks"] > 0 and s["host_prefix_hits"] > 0, s
    assert reasons == ["length"] * n
    if cfg.quant is None:
        assert got == want
    else:  # a KIVI request recomputed after a preemption may differ (docs/serving.md): the
        # engine without the tier is no reference there, generate on each request alone is
        assert got == [_alone(model, params, p, m, cfg) for p, m in zip(prompts, max_new,
                                                                       strict=True)]
    assert [len(g) for g in got] == max_new
    tier = engine.state.cache.host
    pools = [tier.pages] + ([tier.tail_a, tier.tail_b] if cfg.quant is not None else [])
    kinds = {leaf.sharding.memory_kind for leaf in jax.tree.leaves(pools)}
    assert kinds == {host.HOST_MEMORY}, kinds
    if cfg.quant is None:  # the reference itself against generate alone, on one request
        assert got[0] == _alone(model, params, prompts[0], max_new[0], cfg)


@pytest.mark.heavy
def test_a_host_tier_too_small_falls_back_to_recompute(tiny, rng):
    model, params = tiny
    cfg = CONFIGS["bfloat16"]
    prompts, max_new = _two_tenants(rng, model.vocab_size, 4)
    # One host page: no sequence of more than 8 tokens fits, every prompt has 35 or more.
    engine = _engine(model, params, dataclasses.replace(cfg, num_pages=POOL),
                     host_pages=1, host_rows=1)
    got, reasons = _drive(engine, prompts, max_new)
    assert engine.stats["swaps"] == 0 and engine.stats["preemptions"] > 0, engine.stats
    assert reasons == ["length"] * len(prompts)
    assert got[0] == _alone(model, params, prompts[0], max_new[0], cfg)
    assert [len(g) for g in got] == max_new


def test_prefix_cache_parks_unparks_and_drops(rng):
    ps = 4
    pc = PrefixCache(ps, [10, 11])
    a, b = rng.integers(3, 1000, 20).astype(np.int32), rng.integers(3, 1000, 12).astype(np.int32)
    ha, hb = page_hashes(a, ps), page_hashes(b, ps)
    pc.add(10, ha[:4], a)
    pc.add(11, hb, b)
    pc.park(10, 3)
    pc.check()
    assert pc.free_slot() == 10 and list(pc.parked) == [3]
    assert pc.match(ha, a) == 4 and pc.match(ha, a, parked=False) == 0
    assert pc.holder_of(ha, 4) is None and pc.parked_of(ha, 2) == 3
    with pytest.raises(ValueError, match="already holds"):
        pc.park(11, 3)
    pc.park(11, 0)
    assert list(pc.parked) == [0, 3]  # least recently used first: row 3 was just looked up
    pc.unpark(3, 11)
    pc.check()
    assert pc.holder_of(ha, 4) == 11 and pc.match(ha, a, parked=False) == 4
    pc.drop_parked(0)
    pc.check()
    assert pc.match(hb, b) == 0 and not pc.parked and pc.free_slot() == 10


def test_bad_host_tier_arguments(tiny):
    model, params = tiny
    cfg = gen.CacheConfig(page_size=PAGE)
    for kw, match in [(dict(host_pages=-1), "host_pages"), (dict(host_pages=True), "host_pages"),
                      (dict(host_pages=8, host_rows=0), "host_rows"),
                      (dict(host_rows=2), "needs a host tier")]:
        with pytest.raises(ValueError, match=match):
            Engine(model, params, max_seqs=2, max_seq_len=32, chunk_size=CHUNK, cache=cfg, **kw)


# ---------------------------------------------------------------------------- invariants


@pytest.fixture(scope="module")
def host_engine(tiny):
    model, params = tiny
    # Like test_engine_scheduling's small_engine (14 pages, requests of up to 56 tokens:
    # prefix evictions and preemption are common) with a host tier of 4 pages and 2 rows:
    # a request of up to 32 tokens swaps, a longer one (or one that finds the tier taken by
    # another) is recomputed, and parked prefixes are dropped all the time.
    return Engine(model, params, max_seqs=3, max_seq_len=56, chunk_size=CHUNK, prefill_rows=2,
                  cache=gen.CacheConfig(page_size=PAGE, num_pages=14), prefix_slots=3,
                  host_pages=4, host_rows=2)


@pytest.mark.heavy
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(events=_EVENTS)
def test_random_arrivals_and_cancels_with_a_host_tier_keep_the_invariants(host_engine, events):
    _random_events(host_engine, events)

