"""Decoding only the live rows: an engine of 16 rows runs each call's decode steps on the
smallest bucket of rows (1, 4 or all 16) that holds the rows decoding in it, and every
request still gets the tokens of `kvjax.generate` on it alone, greedy and sampled."""

import jax
import pytest

import kvjax.generate as gen
from kvjax.serve import Engine, steps
from tests.serve.engine_helpers import CHUNK, PAGE, _alone, _drive, _workload

ROWS = 16


_STEP = steps.step


def step_compiled() -> int:
    return steps.prefill_lanes._cache_size() + steps.decode_rows._cache_size()


@pytest.fixture
def buckets_used(monkeypatch):
    """The `live` bucket of every step the engine runs."""
    used = []
    step = _STEP

    def spy(*args, live=None, **kw):
        used.append(live)
        return step(*args, live=live, **kw)

    monkeypatch.setattr(steps, "step", spy)
    return used


def test_buckets_follow_the_live_rows():
    assert steps.live_buckets(ROWS) == [1, 4, None]
    assert steps.live_buckets(32) == [1, 4, 16, None]
    assert [steps.live_bucket(ROWS, n) for n in (0, 1, 2, 4, 5, 16)] == [1, 1, 4, 4, None, None]
    assert steps.live_buckets(8) == [None]  # one program: every row


def test_live_row_buckets_equal_generate_alone_and_warmup_compiles_them(tiny, rng,
                                                                          buckets_used):
    model, params = tiny
    # 8 requests, 5 at once and then one every 2 steps, of 24-39 new tokens: the first five
    # prefill (one lane a call) before the first of them is done, so calls decode 1 to 8
    # rows: each bucket runs, and rows finish and rejoin in every order.
    prompts, max_new = _workload(rng, model.vocab_size, 8, new=(24, 40))
    cfg = gen.CacheConfig(page_size=PAGE)
    engine = Engine(model, params, max_seqs=ROWS, max_seq_len=112, chunk_size=CHUNK,
                    cache=cfg, prefill_rows=1)
    engine.warmup()
    compiled = step_compiled()
    got, reasons = _drive(engine, prompts, max_new, first=5)
    assert set(buckets_used) == {1, 4, None}, buckets_used
    assert step_compiled() == compiled  # warmup compiled every bucket the trace ran
    assert reasons == ["length"] * len(prompts)
    for p, m, g in zip(prompts, max_new, got, strict=True):
        assert g == _alone(model, params, p, m, cfg)


def test_sampled_rows_in_a_bucket_equal_generate_with_the_same_key(tiny, rng, buckets_used):
    """A bucket's rows are gathered in another order than the engine's: each row must keep
    its own key and settings."""
    model, params = tiny
    prompts, max_new = _workload(rng, model.vocab_size, 3, new=(8, 14))
    configs = [gen.SamplingConfig(temperature=0.9, top_k=20, top_p=0.9),
               gen.SamplingConfig(temperature=1.3), gen.SamplingConfig(temperature=0.7)]
    seeds = [int(s) for s in rng.integers(0, 2**31, len(prompts))]
    cfg = gen.CacheConfig(page_size=PAGE)
    engine = Engine(model, params, max_seqs=ROWS, max_seq_len=112, chunk_size=CHUNK,
                    cache=cfg, prefill_rows=2)
    ids = [engine.add_request(p, max_tokens=m, sampling=c, seed=s)
           for p, m, c, s in zip(prompts, max_new, configs, seeds, strict=True)]
    out = engine.run()
    assert set(buckets_used) == {1, 4}, buckets_used
    for i, p, m, c, s in zip(ids, prompts, max_new, configs, seeds, strict=True):
        key = jax.random.key(s)[None]
        assert out[i] == _alone(model, params, p, m, cfg, key=key, sampling=c)
