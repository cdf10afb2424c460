"""The serving engine with a host tier (`Engine(host_pages=..., host_rows=...)`): preempted
requests are swapped to pinned host memory and back instead of recomputed, evicted prefixes
park there and are hit from there, and every request's tokens are those of
`kvjax.generate` on it alone, with every program compiled by `warmup`; a tier too small
falls back to recompute, and random arrivals, cancels and swaps keep every invariant of
both tiers and the tokens."""

import dataclasses

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst

import kvjax.generate as gen
from kvjax.cache import host
from kvjax.serve import Engine, PrefixCache, page_hashes, steps
from kvjax.specs import QuantSpec
from tests.serve.engine_helpers import (
    _EVENTS,
    CHUNK,
    PAGE,
    _alone,
    _drive,
    _Replay,
)

ROWS, MAX_LEN, POOL = 3, 96, 14  # 3 requests of ~80 tokens need ~30 pages: a pool of 14 swaps


def _two_tenants(rng, vocab, n):
    """n prompts alternating between two random system prompts (two chunks each), with
    unique suffixes; long outputs, so the rows outgrow the pool."""
    systems = [rng.integers(3, vocab, 2 * CHUNK).tolist() for _ in range(2)]
    prompts = [systems[i % 2] + rng.integers(3, vocab, int(k)).tolist()
               for i, k in enumerate(rng.integers(3, 17, n))]  # 35 to 48: one width
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
    # Room for every request at once (and more rows than requests): no recompute at all.
    per_seq = -(-MAX_LEN // PAGE) + 1
    engine = _engine(model, params, pool, host_pages=n * per_seq, host_rows=n + 2)
    engine.warmup()
    programs = (steps.prefill_lanes, steps.decode_rows, steps.release, steps.share,
                steps.take_row, steps.put_row, host._swap_out, host._swap_in, host._drop_parked)
    compiled = [f._cache_size() for f in programs]
    got, reasons = _drive(engine, prompts, max_new)
    assert [f._cache_size() for f in programs] == compiled  # warmup compiled every one
    s = engine.stats
    assert s["swaps"] > 0 and s["swap_ins"] == s["swaps"], s
    assert s["preemptions"] == 0, s
    assert s["prefix_parks"] > 0 and s["host_prefix_hits"] > 0, s
    assert reasons == ["length"] * n
    # Generate on each request alone, not the engine without the tier: that one preempts,
    # and a KIVI request recomputed after a preemption may differ (docs/serving.md).
    assert got == [_alone(model, params, p, m, cfg) for p, m in zip(prompts, max_new,
                                                                   strict=True)]
    tier = engine.state.cache.host
    pools = [tier.pages] + ([tier.tail_a, tier.tail_b] if cfg.quant is not None else [])
    kinds = {leaf.sharding.memory_kind for leaf in jax.tree.leaves(pools)}
    assert kinds == {host.HOST_MEMORY}, kinds


def _host_engine(model, params, **kw):
    """Like test_engine_scheduling's small engine (14 pages, rows of up to 56 tokens) with a
    host tier of 4 pages and 2 rows: a request of up to 32 tokens swaps, a longer one (or
    one that finds the tier taken by another) is recomputed, and parked prefixes are
    dropped for room. The tests below share its programs (a fresh engine each)."""
    return Engine(model, params, max_seqs=3, max_seq_len=56, chunk_size=CHUNK, prefill_rows=2,
                  cache=gen.CacheConfig(page_size=PAGE, num_pages=14), prefix_slots=3,
                  host_pages=4, host_rows=2, **kw)


def test_a_host_tier_too_small_falls_back_to_recompute(tiny, rng):
    """Two requests of 8 + 48 tokens start (two calls: 18 tokens each); then a third of
    48 + 8 joins and prefills while the first two decode, a step in each of its calls
    (`prefill_run=0`; 7 of the pool's 14 pages for it).
    Once they need a fourth page each, the pool cannot hold all three: the latest admitted,
    the third, holding 49 tokens or more, is preempted; the tier of 4 pages (32 tokens)
    cannot take it, so it is recomputed. Every request gets generate's tokens. (Lanes
    unpacked: the calls counted here are those of two one-chunk lanes.)"""
    model, params = tiny
    cfg = gen.CacheConfig(page_size=PAGE)
    engine = _host_engine(model, params, prefill_run=0, packed_prefill=False)
    replay = _Replay(engine)
    first = [replay.add(rng.integers(3, model.vocab_size, PAGE).tolist(), 48)
             for _ in range(2)]
    replay.step()  # the prefills and one decode step: each first token streams at once
    replay.step()  # then 8 steps
    assert all(len(replay.out[i]) == 10 for i in first), replay.out
    replay.add(rng.integers(3, model.vocab_size, 48).tolist(), 8)
    while engine.has_unfinished():
        replay.step()
    s = replay.stats()
    assert s["swaps"] == 0 and s["preemptions"] > 0, s
    replay.check_tokens(lambda p, n: _alone(model, params, p, n, cfg))


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
    return _host_engine(*tiny)


@settings(max_examples=8, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(events=_EVENTS, seed=hst.integers(0, 2**32 - 1))
def test_random_arrivals_cancels_and_swaps_with_a_host_tier_keep_invariants_and_tokens(
        tiny, host_engine, events, seed):
    """Each example opens with two requests of 48 tokens (8 + 40: 6 pages each); once they
    hold 25 tokens a third like them joins. The three cannot finish together in 14 pages:
    the cached prompts move to the host first (parked), then the third, the latest
    admitted, holding at most 32 tokens (4 pages, the tier's size), is swapped out and
    comes back when a row ends. Then random adds, steps and cancels run while they do.
    Every invariant of both tiers holds after every step, no request is lost, and each
    request's tokens are generate's on it alone (a prefix of them when cancelled)."""
    model, params = tiny
    replay = _Replay(host_engine)
    r = np.random.default_rng(seed)
    first = [replay.add(r.integers(3, model.vocab_size, PAGE).tolist(), 40) for _ in range(2)]
    replay.step_until(lambda: all(len(replay.out.get(i, [])) >= 16 for i in first),
                      "16 tokens of the first two requests")
    replay.add(r.integers(3, model.vocab_size, PAGE).tolist(), 40)
    replay.step_until(lambda: replay.stats()["swap_ins"] > 0, "a swap-in")
    s = replay.stats()
    assert s["prefix_parks"] > 0 and s["swaps"] > 0, s
    replay.events(events, max_seq_len=56)
    cfg = gen.CacheConfig(page_size=PAGE)
    replay.check_tokens(lambda p, n: _alone(model, params, p, n, cfg))
