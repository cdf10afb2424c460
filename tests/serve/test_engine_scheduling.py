"""The serving engine's scheduling: stops, cancels, salts, policies and sharding plans,
warm-up, bad requests, the prefix cache's bookkeeping, and random arrival / cancel
sequences that must keep every invariant and lose no request."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import kvjax.generate as gen
from kvjax.cache.policies import StreamingLLM
from kvjax.serve import Engine, PrefixCache, page_hashes
from tests.serve.engine_helpers import (
    _EVENTS,
    CHUNK,
    PAGE,
    _alone,
    _drive,
    _random_events,
    _workload,
)
from tests.sharding.helpers import make_plan


@pytest.mark.heavy
def test_stop_ids_cancel_and_eos(tiny, rng):
    model, params = tiny
    prompts, _ = _workload(rng, model.vocab_size, 3)
    cfg = gen.CacheConfig(page_size=PAGE)
    ref = _alone(model, params, prompts[0], 12, cfg)
    stop = ref[4]
    # An EOS id none of the three requests produces (on generate alone): a ends by its stop
    # id, b and c only by the cancel, whatever tokens this seed's model draws.
    seen = set(ref[: ref.index(stop) + 1])
    for prompt in prompts[1:]:
        seen |= set(_alone(model, params, prompt, 40, cfg))
    eos = next(t for t in range(3, model.vocab_size) if t not in seen)
    # At most 8 tokens per call: b is still running when it is cancelled after 6 steps.
    engine = Engine(model, params, max_seqs=2, max_seq_len=128, chunk_size=CHUNK, cache=cfg,
                    eos_ids=[eos], max_decode_steps=8)
    a = engine.add_request(prompts[0], max_tokens=12, stop_ids=[stop])
    b = engine.add_request(prompts[1], max_tokens=40)
    c = engine.add_request(prompts[2], max_tokens=40)  # waits: two rows
    outs = {}
    reasons = {}
    for _ in range(6):
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.token_ids)
            reasons[o.request_id] = o.finish_reason
    engine.cancel(b)
    engine.cancel(c)
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.token_ids)
            reasons[o.request_id] = o.finish_reason
    engine.check()
    assert outs[a] == ref[: ref.index(stop) + 1] and reasons[a] == "stop"
    assert reasons[b] == reasons[c] == "cancelled"
    assert len(outs.get(b, [])) < 40
    # Every page is back (cached prefixes aside).
    used = set(np.nonzero(np.asarray(engine.state.cache.lengths))[0].tolist())
    assert used <= set(engine.prefix.holders)


@pytest.mark.heavy
def test_a_waiting_request_takes_a_row_the_step_it_frees(tiny, rng):
    """Two rows busy, a third request waiting: the call ends at the decode step where the
    first row finishes (here by EOS, which only the device sees), not `decode_steps` later,
    and the waiting request starts in the next call; every request gets generate's tokens."""
    model, params = tiny
    prompts, _ = _workload(rng, model.vocab_size, 3, system=0, suffix=(3, CHUNK))
    cfg = gen.CacheConfig(page_size=PAGE)
    max_new = [12, 20, 6]
    refs = [_alone(model, params, p, m, cfg) for p, m in zip(prompts, max_new, strict=True)]
    eos = refs[0][2]
    want = [r[: r.index(eos) + 1] if eos in r else r for r in refs]
    first = min(len(want[0]), len(want[1])) - 1  # decode steps until a row is free
    assert len(want[0]) < max_new[0] and first < 8  # a row ends by EOS, mid-call
    engine = Engine(model, params, max_seqs=2, max_seq_len=64, chunk_size=CHUNK, cache=cfg,
                    decode_steps=8, eos_ids=[eos], prefill_rows=2)
    ids = [engine.add_request(p, max_tokens=m) for p, m in zip(prompts, max_new, strict=True)]
    out, before, started = {}, 0, None
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == ids[2] and started is None:
                started = before  # decode steps run before the call that admitted it
            out.setdefault(o.request_id, []).extend(o.token_ids)
        before = engine.stats["steps"]
    assert started == first, (started, first)
    assert [out[i] for i in ids] == want


@pytest.mark.heavy
def test_prompts_sharing_a_prefix_wait_for_the_first_to_prefill_it(tiny, rng):
    """Requests that arrive together with the same system prompt: the first prefills it,
    the others wait for its pages instead of computing them too (every one hits), and
    each gets generate's tokens."""
    model, params = tiny
    system = 3 * CHUNK  # three chunks
    prompts, max_new = _workload(rng, model.vocab_size, 4, system=system)
    cfg = gen.CacheConfig(page_size=PAGE)
    engine = Engine(model, params, max_seqs=4, max_seq_len=96, chunk_size=CHUNK, cache=cfg,
                    prefill_rows=4)
    ids = [engine.add_request(p, max_tokens=m) for p, m in zip(prompts, max_new, strict=True)]
    out = engine.run()
    engine.check()
    assert engine.stats["hit_pages"] == 3 * system // PAGE, engine.stats
    assert engine.stats["prefill_tokens"] == sum(map(len, prompts)) - 3 * system
    for i, p, m in zip(ids, prompts, max_new, strict=True):
        assert out[i] == _alone(model, params, p, m, cfg)


@pytest.mark.heavy
def test_salt_separates_tenants(tiny, rng):
    model, params = tiny
    prompts, max_new = _workload(rng, model.vocab_size, 2)
    prompts[1] = prompts[0][:48] + prompts[1][48:]
    engine = Engine(model, params, max_seqs=2, max_seq_len=96, chunk_size=CHUNK,
                    cache=gen.CacheConfig(page_size=PAGE))
    engine.add_request(prompts[0], max_tokens=2, salt="a")
    engine.run()
    engine.add_request(prompts[1], max_tokens=2, salt="b")
    engine.run()
    assert engine.stats["hit_pages"] == 0
    engine.add_request(prompts[1], max_tokens=2, salt="a")
    engine.run()
    assert engine.stats["hit_pages"] == 48 // PAGE


@pytest.mark.heavy
def test_policy_and_sharding_plan_run_through_the_engine(tiny, rng):
    model, params = tiny
    prompts, max_new = _workload(rng, model.vocab_size, 2)
    policy = StreamingLLM(n_sink=4, window=24)
    cfg = gen.CacheConfig(page_size=PAGE)
    engine = Engine(model, params, max_seqs=2, max_seq_len=96, chunk_size=CHUNK, cache=cfg,
                    policy=policy, prefill_rows=1)
    got, _ = _drive(engine, prompts, max_new)
    for p, m, g in zip(prompts, max_new, got, strict=True):
        assert g == _alone(model, params, p, m, cfg, policy=policy)
    plan = make_plan((2, 2), ("data", "model"), ("sequences", "heads"))
    sharded = gen.CacheConfig(page_size=PAGE, plan=plan)
    engine = Engine(model, params, max_seqs=2, max_seq_len=96, chunk_size=CHUNK, cache=sharded,
                    prefill_rows=1)
    assert engine.prefix is None  # a slot's pages come from its own shard
    got, _ = _drive(engine, prompts, max_new)
    for p, m, g in zip(prompts, max_new, got, strict=True):
        assert g == _alone(model, params, p, m, cfg)


@pytest.mark.heavy
def test_warmup_compiles_every_program_a_trace_runs(tiny, rng):
    from kvjax.serve import engine as engine_mod

    model, params = tiny
    engine = Engine(model, params, max_seqs=2, max_seq_len=64, chunk_size=CHUNK,
                    cache=gen.CacheConfig(page_size=PAGE, num_pages=12), decode_steps=4,
                    prefix_slots=1, prefill_rows=1)
    engine.warmup()
    programs = (engine_mod._step, engine_mod._release, engine_mod._share)
    compiled = [f._cache_size() for f in programs]
    prompts, max_new = _workload(rng, model.vocab_size, 5, system=32, suffix=(3, 20),
                                 new=(2, 12))
    got, _ = _drive(engine, prompts, max_new)  # hits, evictions, host stops, bursts
    assert engine.stats["hit_pages"] > 0 and engine.stats["evictions"] > 0, engine.stats
    assert [f._cache_size() for f in programs] == compiled
    for p, m, g in zip(prompts, max_new, got, strict=True):
        assert g == _alone(model, params, p, m, gen.CacheConfig(page_size=PAGE))
    engine.add_request(prompts[0], max_tokens=2)
    with pytest.raises(RuntimeError, match="idle engine"):
        engine.warmup()


def test_bad_requests_raise_before_anything_runs(tiny):
    model, params = tiny
    engine = Engine(model, params, max_seqs=2, max_seq_len=32, chunk_size=CHUNK,
                    cache=gen.CacheConfig(page_size=PAGE))
    for kwargs, match in [
        (dict(prompt_ids=[], max_tokens=4), "non-empty"),
        (dict(prompt_ids=[1, model.vocab_size], max_tokens=4), "outside the vocabulary"),
        (dict(prompt_ids=[1, 2], max_tokens=0), "max_tokens"),
        (dict(prompt_ids=[1] * 30, max_tokens=4), "max_seq_len"),
        (dict(prompt_ids=[1, 2], max_tokens=4, stop_ids=[-1]), "outside the vocabulary"),
    ]:
        with pytest.raises(ValueError, match=match):
            engine.add_request(**kwargs)
    engine.add_request([1, 2], max_tokens=2, request_id="x")
    with pytest.raises(ValueError, match="in use"):
        engine.add_request([1, 2], max_tokens=2, request_id="x")
    with pytest.raises(ValueError, match="max_decode_steps"):
        Engine(model, params, decode_steps=8, max_decode_steps=4,
               cache=gen.CacheConfig(page_size=PAGE))
    with pytest.raises(ValueError, match="multiple of the page size"):
        Engine(model, params, chunk_size=12, cache=gen.CacheConfig(page_size=PAGE))
    with pytest.raises(ValueError, match="cannot hold one request"):
        Engine(model, params, max_seq_len=64, cache=gen.CacheConfig(page_size=PAGE, num_pages=4))


def test_prefix_cache_bookkeeping():
    ps = 4
    pc = PrefixCache(ps, [10, 11])
    toks = np.arange(20, dtype=np.int32)
    h = page_hashes(toks, ps)
    assert len(h) == 5 and page_hashes(toks, ps, "s") != h
    assert pc.match(h, toks) == 0
    pc.add(10, h[:3], toks)
    assert pc.match(h, toks) == 3 and pc.holder_of(h, 2) == 10
    other = toks.copy()
    other[9] += 1  # page 2 differs: its hash and every later one
    assert pc.match(page_hashes(other, ps), other) == 2
    pc.add(11, h, toks)
    assert pc.new_pages(h) == 0 and pc.lru_slot() == 10
    pc.remove(10)
    pc.check()
    assert pc.match(h, toks) == 5 and pc.free_slot() == 10


# ---------------------------------------------------------------------------- invariants

@pytest.fixture(scope="module")
def small_engine(tiny):
    model, params = tiny
    # 14 pages: requests of up to 56 tokens, so cached prefixes and preemption are common.
    return Engine(model, params, max_seqs=3, max_seq_len=56, chunk_size=CHUNK, prefill_rows=2,
                  cache=gen.CacheConfig(page_size=PAGE, num_pages=14), prefix_slots=3)


@pytest.mark.heavy
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(events=_EVENTS)
def test_random_arrivals_cancels_and_finishes_keep_the_invariants(small_engine, events):
    _random_events(small_engine, events)
