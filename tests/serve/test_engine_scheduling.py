"""The serving engine's scheduling: stop ids, EOS and cancels, salts, policies and sharding
plans, warm-up, bad requests, the prefix cache's bookkeeping, and random arrivals and
cancels around a preemption that must keep every invariant, lose no request and give each
request generate's tokens."""

import functools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst

import kvjax.generate as gen
from kvjax.cache.policies import StreamingLLM
from kvjax.serve import Engine, PrefixCache, page_hashes
from kvjax.serve.scheduler import _lane_shape
from kvjax.specs import QuantSpec
from tests.serve.engine_helpers import (
    _EVENTS,
    CHUNK,
    PAGE,
    _alone,
    _drive,
    _four_prompts_equal_generate,
    _Replay,
    _workload,
)
from tests.sharding.helpers import make_plan


def _small_engine(model, params):
    """14 pages, 3 rows of up to 56 tokens (7 pages): three long requests at once need 21,
    so cached prefixes are evicted and a row is preempted. Several tests use this one
    configuration (their programs compile once)."""
    return Engine(model, params, max_seqs=3, max_seq_len=56, chunk_size=CHUNK, prefill_rows=2,
                  cache=gen.CacheConfig(page_size=PAGE, num_pages=14), prefix_slots=3)


def test_stop_ids_eos_and_cancel(tiny, rng):
    """Five requests on two rows: a ends at its stop id and e at the engine's EOS, each with
    generate's tokens up to it (and e's row is freed in the step that produced it); b and
    c take their rows, d waits; b (running) and d (waiting) are cancelled, b with a prefix
    of generate's tokens, d with none; c runs to its length. The EOS is a token of
    generate's run on e alone (so e draws it) that a, b and c do not draw."""
    model, params = tiny
    prompts, _ = _workload(rng, model.vocab_size, 4, system=CHUNK)  # + 40 tokens: <= 96
    cfg = gen.CacheConfig(page_size=PAGE)
    ref_a = _alone(model, params, prompts[0], 12, cfg)
    stop = ref_a[4]
    want_a = ref_a[: ref_a.index(stop) + 1]
    ref_b, ref_c = (_alone(model, params, p, 40, cfg) for p in prompts[1:3])
    taken = set(want_a) | set(ref_b) | set(ref_c)
    # e's prompt: the first of fresh random ones on which generate draws, after its first
    # token and before its 11th, a token the others never draw (the tiny model repeats
    # tokens for long runs: a few tries at most).
    for _ in range(20):
        ref_e = _alone(model, params, prompts[3], 12, cfg)
        k = next((i for i in range(1, 11) if ref_e[i] not in taken | set(ref_e[:i])), None)
        if k is not None:
            break
        prompts[3] = rng.integers(3, model.vocab_size, int(rng.integers(3, 30))).tolist()
    assert k is not None, "no EOS id found for e"
    eos = ref_e[k]
    # Calls of at most 8 decode steps, and e ends at most 10 steps after its first token:
    # b, admitted once a ends, has at most 1 + 2 * 8 of its 40 tokens by then, so it is
    # running when it is cancelled. One prefill lane: the step (its EOS is this test's
    # alone) compiles for no lane and one lane only.
    engine = Engine(model, params, max_seqs=2, max_seq_len=96, chunk_size=CHUNK, cache=cfg,
                    eos_ids=[eos], max_decode_steps=8, prefill_rows=1)
    a = engine.add_request(prompts[0], max_tokens=12, stop_ids=[stop])
    e = engine.add_request(prompts[3], max_tokens=12)
    b, c, d = (engine.add_request(p, max_tokens=40) for p in prompts[1:3] + [prompts[0]])
    outs, reasons = {}, {}
    req_e = engine.scheduler.requests[e]  # its row, once admitted: req_e.slot

    def step():
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.token_ids)
            if o.finished:
                reasons[o.request_id] = o.finish_reason
                if o.request_id == e:  # its pages went back in the step that ended it
                    assert int(engine.state.cache.lengths[req_e.slot]) == 0
        engine.check()

    while e not in reasons or not outs.get(b):
        step()
    assert b not in reasons and d not in outs and engine.num_waiting >= 1  # d waits
    engine.cancel(b)
    engine.cancel(d)
    while engine.has_unfinished():
        step()
    assert (outs[a], reasons[a]) == (want_a, "stop")
    assert (outs[e], reasons[e]) == (ref_e[: k + 1], "stop") and k + 1 < 12
    assert reasons[b] == reasons[d] == "cancelled" and outs.get(d, []) == []
    assert 0 < len(outs[b]) < 40 and outs[b] == ref_b[: len(outs[b])]
    assert (outs[c], reasons[c]) == (ref_c, "length")
    # Every page is back (cached prefixes aside).
    used = set(np.nonzero(np.asarray(engine.state.cache.lengths))[0].tolist())
    assert used <= set(engine.prefix.holders)


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


def test_prompts_sharing_a_prefix_wait_for_the_first_to_prefill_it(tiny, rng):
    """Requests that arrive together with the same system prompt: the first prefills it,
    the others wait for its pages instead of computing them too (every one hits), and
    each gets generate's tokens. On the small engine (its programs are compiled once for
    the file): 3 rows, so the fourth request takes the first free row; prompts of 35 to 48
    tokens and up to 8 new ones fit its rows of 56, and three rows (4 shared pages + 3
    of their own each) its pool of 14: nothing is preempted (each prompt is computed
    once)."""
    model, params = tiny
    system = 2 * CHUNK  # two chunks
    prompts, max_new = _workload(rng, model.vocab_size, 4, system=system, new=(2, 9))
    cfg = gen.CacheConfig(page_size=PAGE)
    engine = _small_engine(model, params)
    ids = [engine.add_request(p, max_tokens=m) for p, m in zip(prompts, max_new, strict=True)]
    out = engine.run()
    engine.check()
    assert engine.stats["hit_pages"] == 3 * system // PAGE, engine.stats
    assert engine.stats["prefill_tokens"] == sum(map(len, prompts)) - 3 * system
    for i, p, m in zip(ids, prompts, max_new, strict=True):
        assert out[i] == _alone(model, params, p, m, cfg)


def test_salt_separates_tenants(tiny, rng):
    """Two prompts with a common 32-token prefix (4 pages): under another salt the second
    finds none of the first's pages (it computes its whole prompt), under the same salt it
    shares all 4 (and computes only the rest); the tokens are generate's either way. On
    the small engine's pool (14 pages) both cached prompts (at most 5 pages each) and a
    running request (at most 6) fit: nothing is evicted."""
    model, params = tiny
    prompts, _ = _workload(rng, model.vocab_size, 2, system=2 * CHUNK, suffix=(1, 9))
    cfg = gen.CacheConfig(page_size=PAGE)
    engine = _small_engine(model, params)
    want = _alone(model, params, prompts[1], 4, cfg)
    engine.add_request(prompts[0], max_tokens=4, salt="a")
    engine.run()
    for salt, hit in [("b", 0), ("a", 2 * CHUNK)]:
        before = engine.stats.copy()
        rid = engine.add_request(prompts[1], max_tokens=4, salt=salt)
        assert engine.run()[rid] == want, salt
        assert engine.stats["hit_pages"] - before["hit_pages"] == hit // PAGE, salt
        computed = engine.stats["prefill_tokens"] - before["prefill_tokens"]
        assert computed == len(prompts[1]) - hit, salt
    assert engine.stats["evictions"] == 0
    engine.check()


def test_policy_and_sharding_plan_run_through_the_engine(tiny, rng, monkeypatch):
    """With 16 rows, so that the decode steps run on buckets of the live rows (see
    test_engine_live_rows.py): a policy reads and writes its state by the rows' slots, a
    plan shards the rows and the pools, and a bucket's gathered rows keep both."""
    from kvjax.serve import steps

    model, params = tiny
    buckets, step = [], steps.step
    monkeypatch.setattr(steps, "step", lambda *a, live=None, **kw: (
        buckets.append(live), step(*a, live=live, **kw))[1])
    # Prompts of 35 to 48 tokens (past the policy's window; one reference program, the
    # other tests').
    prompts, max_new = _workload(rng, model.vocab_size, 2, system=32)
    policy = StreamingLLM(n_sink=4, window=24)
    cfg = gen.CacheConfig(page_size=PAGE)
    engine = Engine(model, params, max_seqs=16, max_seq_len=96, chunk_size=CHUNK, cache=cfg,
                    policy=policy, prefill_rows=1)
    got, _ = _drive(engine, prompts, max_new)
    for p, m, g in zip(prompts, max_new, got, strict=True):
        assert g == _alone(model, params, p, m, cfg, policy=policy)
    plan = make_plan((2, 2), ("data", "model"), ("sequences", "heads"))
    sharded = gen.CacheConfig(page_size=PAGE, plan=plan)
    engine = Engine(model, params, max_seqs=16, max_seq_len=96, chunk_size=CHUNK,
                    cache=sharded, prefill_rows=1)
    assert engine.prefix is None  # a slot's pages come from its own shard
    got, _ = _drive(engine, prompts, max_new)
    for p, m, g in zip(prompts, max_new, got, strict=True):
        assert g == _alone(model, params, p, m, cfg)
    # Buckets below the 16 rows ran (the bucket of 4 only where the two requests overlap).
    assert 1 in buckets and set(buckets) <= {1, 4}, buckets


def test_warmup_compiles_every_program_a_trace_runs(tiny, rng):
    from kvjax.serve import steps

    model, params = tiny
    engine = Engine(model, params, max_seqs=2, max_seq_len=64, chunk_size=CHUNK,
                    cache=gen.CacheConfig(page_size=PAGE, num_pages=12), decode_steps=4,
                    prefix_slots=1, prefill_rows=1)
    engine.warmup()
    programs = (steps.prefill_lanes, steps.decode_rows, steps.release, steps.share)
    compiled = [f._cache_size() for f in programs]
    # Prompts of 35 to 48 tokens: the references' programs are the other tests'. The last
    # under another system prompt, whose pages the one prefix slot takes by evicting the
    # first's (five prompts alone evicted nothing on about 1% of draws).
    prompts, max_new = _workload(rng, model.vocab_size, 5, system=32, new=(2, 12))
    other, other_new = _workload(rng, model.vocab_size, 1, system=32, new=(2, 12))
    prompts, max_new = prompts + other, max_new + other_new
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
    engine = _small_engine(model, params)  # rows of up to 56 tokens
    for kwargs, match in [
        (dict(prompt_ids=[], max_tokens=4), "non-empty"),
        (dict(prompt_ids=[1, model.vocab_size], max_tokens=4), "outside the vocabulary"),
        (dict(prompt_ids=[1, 2], max_tokens=0), "max_tokens"),
        (dict(prompt_ids=[1] * 54, max_tokens=3), "max_seq_len"),
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
    return _small_engine(*tiny)


@settings(max_examples=8, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(events=_EVENTS, seed=hst.integers(0, 2**32 - 1))
def test_random_arrivals_cancels_and_preemptions_keep_invariants_and_tokens(
        tiny, small_engine, events, seed):
    """Each example opens with three requests of 56 tokens at once, which the pool cannot
    hold: it steps until one is preempted (to be recomputed), then replays random adds,
    steps and cancels while they run. Every invariant holds after every step, no request
    is lost, and each request's tokens are generate's on it alone (a prefix of them when
    cancelled)."""
    model, params = tiny
    replay = _Replay(small_engine)
    r = np.random.default_rng(seed)
    for _ in range(3):
        replay.add(r.integers(3, model.vocab_size, 16).tolist(), 40)
    replay.step_until(lambda: replay.stats()["preemptions"] > 0, "a preemption")
    replay.events(events, max_seq_len=56)
    assert replay.stats()["evictions"] > 0, replay.stats()  # prefix holders left first
    cfg = gen.CacheConfig(page_size=PAGE)
    replay.check_tokens(lambda p, n: _alone(model, params, p, n, cfg))


def test_rebuilt_engine_continues_every_request(tiny, rng):
    """An engine rebuilt part way (`Engine.rebuilt`, what the server does after a failed
    step) finishes every request with the tokens of an uninterrupted run: running and
    waiting ones, one of them cut back by `delivered` to fewer tokens than it had produced
    (they come again, once). Sampled requests: a recomputed token's logits may differ from
    the decode step's in the last bits, which can flip a greedy near-tie of this random
    model (one seed in four here), not a draw (test_server_recovery runs greedy ones on
    fixed prompts)."""
    model, params = tiny
    prompts, _ = _workload(rng, model.vocab_size, 4, system=CHUNK)
    kinds = [dict(sampling=gen.SamplingConfig(temperature=t, top_p=p), seed=s)
             for t, p, s in ((1.0, 1.0, 11), (0.7, 0.9, 2**40 + 3), (1.3, 1.0, 5),
                             (0.9, 0.95, 0))]

    def add(engine):
        return [engine.add_request(p, max_tokens=14, **kw)
                for p, kw in zip(prompts, kinds, strict=True)]

    engine = _small_engine(model, params)
    ids = add(engine)
    want = engine.run()
    engine = _small_engine(model, params)
    assert add(engine) == ids
    got = {i: [] for i in ids}

    def part_way():  # a request waits, and two have tokens, one of them two or more
        n = sorted(len(t) for t in got.values())
        return engine.num_waiting and engine.num_running and n[-2] >= 1 and n[-1] >= 2

    while engine.has_unfinished() and not part_way():
        for o in engine.step():
            got[o.request_id].extend(o.token_ids)
    assert part_way(), (engine.stats, got)
    cut = max(ids, key=lambda i: len(got[i]))
    got[cut] = got[cut][:1]
    new = engine.rebuilt(delivered={i: len(t) for i, t in got.items()})
    assert engine.state is None and new.has_unfinished()
    assert new.add_request(prompts[0], max_tokens=2) not in ids  # ids go on counting
    while new.has_unfinished():
        for o in new.step():
            got.setdefault(o.request_id, []).extend(o.token_ids)
        new.check()
    for i in ids:
        assert got[i] == want[i], i


def test_a_first_token_streams_without_waiting_for_decode_steps(tiny, rng):
    """A lone request on an engine with free rows (which otherwise runs `decode_steps`
    steps per call): the call that prefills its last chunk runs one decode step, so its
    first token is returned after one step, not after 8; the rest come 8 per call, and
    the tokens are generate's."""
    model, params = tiny
    prompts, _ = _workload(rng, model.vocab_size, 1, system=0, suffix=(CHUNK + 3, 2 * CHUNK))
    cfg = gen.CacheConfig(page_size=PAGE)
    want = _alone(model, params, prompts[0], 20, cfg)
    engine = Engine(model, params, max_seqs=2, max_seq_len=64, chunk_size=CHUNK, cache=cfg,
                    decode_steps=8)
    engine.add_request(prompts[0], max_tokens=20)
    chunks, steps = [], []
    while engine.has_unfinished():
        for o in engine.step():
            if o.token_ids:
                chunks.append(list(o.token_ids))
                steps.append(engine.stats["steps"])
    assert sum(chunks, []) == want
    assert len(chunks[0]) == 2 and steps[0] == 1, (chunks, steps)  # first token + one step
    assert max(len(c) for c in chunks[1:]) == 8


def test_fewer_prompts_take_wider_lanes(tiny, rng):
    """With fewer prompts than `prefill_rows` the lanes are wider (whole chunks, within
    prefill_rows chunks in all): one prompt alone prefills 4 chunks a call, two prompts 2
    each, and each gets generate's tokens (chunk by chunk). The shape a step takes
    prefills the most tokens among those near the best tokens per cost, the cheapest of
    those. KIVI pages keep one chunk per lane. (Lanes unpacked: as for a model whose
    forward does not pack.)"""
    model, params = tiny
    cfg = gen.CacheConfig(page_size=PAGE)
    engine = Engine(model, params, max_seqs=4, max_seq_len=160, chunk_size=CHUNK,
                    prefill_rows=4, cache=cfg, packed_prefill=False)
    C = CHUNK
    assert engine.scheduler.lane_shapes == [(1, C), (1, 2 * C), (1, 4 * C), (2, C),
                                            (2, 2 * C), (4, C)]
    pick = functools.partial(_lane_shape, engine.scheduler.lane_shapes, chunk=C)
    assert pick([C - 3], room=8 * C) == (1, C)  # a wider lane would prefill no more
    assert pick([3 * C + 1], room=8 * C) == (1, 4 * C)
    assert pick([3 * C + 1], room=3 * C) == (1, 2 * C)  # the budget left after decode rows
    assert pick([3 * C + 1], room=8 * C, narrow=True) == (1, C)
    assert pick([2 * C, 2 * C], room=8 * C) == (2, 2 * C)
    assert pick([5 * C, 5 * C, 1], room=8 * C) == (1, 4 * C)  # as much, fewer lanes
    # (4, C) prefills more than (2, C), within 10% of its tokens per cost.
    assert pick([C, C, 3, 1], room=8 * C) == (4, C)
    assert pick([C, C, 1, 1], room=8 * C) == (2, C)
    assert pick([C, 2], room=C - 1) is None

    # a alone: 4 chunks, then its rest; b and c together: 2 chunks each, then their rests.
    lengths = [int(rng.integers(4 * C + 1, 5 * C)), *rng.integers(2 * C + 1, 3 * C, 2)]
    prompts = [rng.integers(3, model.vocab_size, int(n)).tolist() for n in lengths]
    new = [int(k) for k in rng.integers(4, 12, 3)]
    for batch, lanes in [([0], 2), ([1, 2], 4)]:
        before = engine.stats["prefill_chunks"], engine.stats["prefill_tokens"]
        tokens, _ = _drive(engine, [prompts[i] for i in batch], [new[i] for i in batch],
                           first=len(batch))
        assert engine.stats["prefill_chunks"] - before[0] == lanes, batch
        assert engine.stats["prefill_tokens"] - before[1] == sum(lengths[i] for i in batch)
        for i, got in zip(batch, tokens, strict=True):
            assert got == _alone(model, params, prompts[i], new[i], cfg), i

    kivi = Engine(model, params, max_seqs=4, max_seq_len=160, chunk_size=CHUNK, prefill_rows=4,
                  cache=gen.CacheConfig(page_size=PAGE, quant=QuantSpec(
                      bits=4, group_size=PAGE, residual=PAGE)))
    assert kivi.scheduler.lane_shapes == [(1, C), (2, C), (4, C)]


def test_many_prompts_share_a_call_in_narrow_lanes(tiny, rng, monkeypatch):
    """With more prompts than a call's tokens hold in whole chunks (a token budget below
    `prefill_rows` chunks), lanes narrower than a chunk take a prompt each: 4 prompts of a
    chunk and up to half another prefill in 2 one-chunk lanes, then 4 half-chunk lanes
    (the first two prompts' rests and the next two's first halves), padding less than
    one-chunk lanes would; each gets generate's tokens with the engine's chunk_size.
    (Lanes unpacked.)"""
    from kvjax.serve import steps

    model, params = tiny
    cfg, chunk = gen.CacheConfig(page_size=PAGE), 64
    engine = Engine(model, params, max_seqs=4, max_seq_len=128, chunk_size=chunk, cache=cfg,
                    prefill_rows=4, token_budget=4 + 2 * chunk, packed_prefill=False)
    assert engine.scheduler.lane_shapes == [(1, chunk), (1, 2 * chunk), (2, chunk),
                                            (4, chunk // 2)]
    shapes, step = [], steps.step

    def spy(model, params, dparams, state, lanes, *args, **kwargs):
        if lanes is not None:
            shapes.append(lanes.tokens.shape)
        return step(model, params, dparams, state, lanes, *args, **kwargs)

    monkeypatch.setattr(steps, "step", spy)
    lengths = _four_prompts_equal_generate(engine, rng, cfg, chunk)
    assert shapes[:2] == [(2, chunk), (4, chunk // 2)], shapes
    assert engine.stats["prefill_tokens"] == sum(lengths)
    assert sum(p * w for p, w in shapes) < 8 * chunk, shapes  # one-chunk lanes: 8 chunks


def test_packed_prefill_fills_each_row_end_to_end(tiny, rng, monkeypatch):
    """A model whose forward packs (Llama) prefills prompts end to end in one row: every
    call but the last computes only real tokens (its lanes end anywhere in a prompt), in
    fewer row tokens than one-chunk lanes would, and each request gets generate's tokens
    with the engine's chunk_size. KIVI pages, a family that does not pack (Qwen3-Next's
    recurrence) or `packed_prefill=False` keep unpacked lanes."""
    from kvjax.serve import steps

    model, params = tiny
    assert model.packs
    cfg, chunk = gen.CacheConfig(page_size=PAGE), 64
    engine = Engine(model, params, max_seqs=4, max_seq_len=128, chunk_size=chunk, cache=cfg,
                    prefill_rows=4, token_budget=4 + 2 * chunk)
    assert engine.packed
    assert engine.scheduler.lane_shapes == [(1, chunk, chunk), (1, 2 * chunk, 2 * chunk),
                                            (2, chunk, chunk), (4, chunk, 2 * chunk)]
    for p, w, row in steps.packed_shapes(16, 544, 64):  # the server's: lanes of 32k tokens
        assert w % 32 == 0 and p * w >= row and (p <= 2) == (w == row), (p, w, row)
    calls, step = [], steps.step

    def spy(model, params, dparams, state, lanes, *args, **kwargs):
        if lanes is not None:
            assert lanes.packing is not None and lanes.tokens.shape[0] == 1
            lens, last = np.asarray(lanes.lengths), np.asarray(lanes.last)
            calls.append((lanes.tokens.shape[1], int(lens.sum()), lanes.packing.gather.shape[1],
                          [(int(n), bool(e)) for n, e in zip(lens, last, strict=True) if n]))
        return step(model, params, dparams, state, lanes, *args, **kwargs)

    monkeypatch.setattr(steps, "step", spy)
    lengths = _four_prompts_equal_generate(engine, rng, cfg, chunk)
    assert sum(c[1] for c in calls) == sum(lengths) == engine.stats["prefill_tokens"]
    # Every call but the last fills its row, unless each of its lanes is full (its width)
    # or ends its prompt: a prompt's rest wider than the lanes waits for the next call.
    assert all(row == real or all(n == width or end for n, end in used)
               for row, real, width, used in calls[:-1]), calls
    assert sum(c[0] for c in calls) < 8 * chunk, calls  # one-chunk lanes: 8 chunks

    kivi = gen.CacheConfig(page_size=PAGE, quant=QuantSpec(bits=4, group_size=PAGE,
                                                           residual=PAGE))
    assert not Engine(model, params, max_seqs=2, max_seq_len=64, cache=kivi).packed
    with pytest.raises(ValueError, match="packed_prefill needs"):
        Engine(model, params, max_seqs=2, max_seq_len=64, cache=kivi, packed_prefill=True)


def test_a_wide_lane_narrows_before_anything_is_evicted_or_preempted(tiny, rng):
    """When the free pages cannot take a wide lane, the step's lanes are one chunk wide
    before cached prefixes are evicted or requests preempted (here the only one); so is a
    packed row."""
    model, params = tiny
    for packed, wide, narrow in [(False, (1, 4 * CHUNK), (1, CHUNK)),
                                 (True, (1, 4 * CHUNK, 4 * CHUNK), (1, CHUNK, CHUNK))]:
        engine = Engine(model, params, max_seqs=4, max_seq_len=160, chunk_size=CHUNK,
                        prefill_rows=4, cache=gen.CacheConfig(page_size=PAGE),
                        packed_prefill=packed)
        engine.add_request(rng.integers(3, model.vocab_size, 3 * CHUNK + 5).tolist(),
                           max_tokens=4)
        sched = engine.scheduler
        sched.admit_waiting()
        sched.look_up_prefixes()
        _, lanes, shape, _, _ = sched.plan()
        assert shape == wide and lanes[0][1] == 3 * CHUNK + 5
        engine.slots.free_pages = CHUNK // PAGE  # one chunk's pages
        _, lanes, shape, _, _ = sched.plan()
        assert shape == narrow and lanes[0][1] == CHUNK
        assert engine.stats["preemptions"] == engine.stats["requeues"] == 0


@pytest.mark.parametrize("run", [0, 2])
def test_prefill_run_holds_decode_steps_while_a_prompt_waits(tiny, rng, run):
    """While a 5-chunk prompt prefills beside a decoding row, calls run no decode step for
    up to `prefill_run` calls in a row, then one; the call with its last chunk decodes
    once. Both requests get generate's tokens."""
    model, params = tiny
    cfg = gen.CacheConfig(page_size=PAGE)
    engine = Engine(model, params, max_seqs=2, max_seq_len=160, chunk_size=CHUNK,
                    prefill_rows=1, cache=cfg, decode_steps=1, prefill_run=run)
    a, b = (rng.integers(3, model.vocab_size, n).tolist() for n in (CHUNK - 3, 5 * CHUNK - 2))
    ra = engine.add_request(a, max_tokens=20)
    out = {ra: [o.token_ids for o in engine.step()][0]}  # a's lane and first token
    rb = engine.add_request(b, max_tokens=6)
    per_call = []
    for _ in range(5):  # b's five chunks
        got = {o.request_id: o.token_ids for o in engine.step()}
        per_call.append(len(got.get(ra, [])))
        for rid, toks in got.items():
            out.setdefault(rid, []).extend(toks)
    assert per_call == ([1] * 5 if run == 0 else [0, 0, 1, 0, 1]), per_call
    assert len(out[rb]) == 2  # its last chunk's call: the first token and one decode step
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.token_ids)
    assert out[ra] == _alone(model, params, a, 20, cfg)
    assert out[rb] == _alone(model, params, b, 6, cfg)
