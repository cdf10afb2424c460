"""Bad requests to the decode drivers fail before any work and keep the caller's cache.

Token ids outside the vocabulary and float ids, repeated slots, a cache lost on error,
chunk_size 0, max_new_tokens of the wrong length, a policy given as a string: every bad
request below goes to `generate`, `stream`, `score`, `sample_n` or `beam_search` with a
cache that holds another sequence; each
must raise a ValueError / TypeError naming what was wrong, and afterwards the cache
must still exist, hold exactly what it held, and decode that sequence further exactly
as an untouched copy does. Running out of pages is the one error raised after the
cache was donated: `CacheFullError` carries the final cache, with the other sequence
intact.
"""

import re

import jax
import numpy as np
import pytest

import kvjax.cache as kc
from kvjax import generate as kvg
from kvjax import sharding as kvs
from kvjax.cache.policies import H2O
from tests.reliability import tiny
from tests.sharding.helpers import make_plan

PAGE = 4
KW = dict(key=jax.random.key(0), max_new_tokens=3, chunk_size=8)


def _spec(model, num_pages=32):
    return model.make_cache_spec(page_size=PAGE, num_pages=num_pages, max_seqs=4,
                                 max_pages_per_seq=6, dtype="float32")


@pytest.fixture(scope="module")
def held():
    """A cache whose slot 0 holds a prompt and 3 generated tokens (the rest empty)."""
    model, params = tiny.model_and_params("gqa")
    rng = np.random.default_rng(11)
    res = kvg.generate(model, params, tiny.prompts(rng, [7]), cache=kc.init_cache(_spec(model)),
                       free_finished=False, **KW)
    return model, params, tiny.snapshot(res.cache), res.cache, int(res.tokens[0, -1])


def _continue(model, params, cache, last):
    """Slot 0's next tokens (its last generated token fed as a one-token prompt)."""
    res = kvg.generate(model, params, [[last]], cache=cache, seq_ids=[0], free_finished=False,
                       **KW)
    return res.tokens


def _bad_requests(model, params, other_spec):
    """(name, call, error type, message pattern) for one cache argument `c`."""
    g = kvg.generate
    v = tiny.VOCAB
    plan = make_plan((2, 4), ("data", "context"), ("sequences", "context"))
    return [
        # 2: token ids outside [0, vocab) or not integers.
        ("id=vocab", lambda c: g(model, params, [[1, v]], cache=c, seq_ids=[1], **KW),
         ValueError, rf"token 1 is {v}, outside the vocabulary \[0, {v}\)"),
        ("id=100000", lambda c: g(model, params, [[100000]], cache=c, seq_ids=[1], **KW),
         ValueError, "outside the vocabulary"),
        ("id=-1", lambda c: g(model, params, [[3, -1]], cache=c, seq_ids=[1], **KW),
         ValueError, "token 1 is -1"),
        ("id=-vocab", lambda c: g(model, params, [[-v]], cache=c, seq_ids=[1], **KW),
         ValueError, "outside the vocabulary"),
        ("id=2.7", lambda c: g(model, params, [[2.7, 3]], cache=c, seq_ids=[1], **KW),
         ValueError, "non-integer token ids"),
        ("id=[] row", lambda c: g(model, params, [[1], []], cache=c, seq_ids=[1, 2], **KW),
         ValueError, "prompt 1 must be a non-empty"),
        ("score cont id", lambda c: kvg.score(model, params, [[1, 2]], [[5, v]], cache=c,
                                              seq_ids=[1]),
         ValueError, "outside the vocabulary"),
        ("stream id", lambda c: next(kvg.stream(model, params, [[v + 5]], cache=c,
                                                seq_ids=[1], **KW)),
         ValueError, "outside the vocabulary"),
        ("sample_n id", lambda c: kvg.sample_n(model, params, [[-3]], n=2, cache=c, **KW),
         ValueError, "outside the vocabulary"),
        ("beam id", lambda c: kvg.beam_search(model, params, [1, v], beam_width=2,
                                              max_new_tokens=3, cache=c),
         ValueError, "outside the vocabulary"),
        ("eos=2.7", lambda c: g(model, params, [[1]], cache=c, seq_ids=[1],
                                eos_ids=[2.7], **KW),
         ValueError, r"eos_ids must be token ids .* got \[2.7\]"),
        ("eos=vocab", lambda c: g(model, params, [[1]], cache=c, seq_ids=[1],
                                  eos_ids=[1, v], **KW),
         ValueError, rf"eos_ids holds {v}, outside the vocabulary"),
        ("sample_n eos", lambda c: kvg.sample_n(model, params, [[1]], n=2, cache=c,
                                                eos_ids=[-1], **KW),
         ValueError, "eos_ids holds -1"),
        # Sampling settings and keys are checked before the cache is donated, too.
        ("sampling str", lambda c: g(model, params, [[1]], cache=c, seq_ids=[1],
                                     **{**KW, "sampling": "greedy"}),
         TypeError, "sampling must be a kvjax.generate.SamplingConfig .* got 'greedy'"),
        ("stream sampling", lambda c: next(kvg.stream(model, params, [[1]], cache=c,
                                                      seq_ids=[1], sampling=0.8, **KW)),
         TypeError, "sampling must be a kvjax.generate.SamplingConfig"),
        ("sample_n sampling", lambda c: kvg.sample_n(model, params, [[1]], n=2, cache=c,
                                                     sampling="top_p", **KW),
         TypeError, "sampling must be a kvjax.generate.SamplingConfig"),
        ("key None", lambda c: g(model, params, [[1]], cache=c, seq_ids=[1],
                                 **{**KW, "key": None}),
         ValueError, "key must be a PRNG key, e.g. jax.random.key"),
        ("key int", lambda c: g(model, params, [[1]], cache=c, seq_ids=[1],
                                **{**KW, "key": 7}),
         ValueError, r"key must be a PRNG key .* got int32\[\]"),
        ("keys per row", lambda c: g(model, params, [[1], [2]], cache=c, seq_ids=[1, 2],
                                     **{**KW, "key": jax.random.split(jax.random.key(1), 3)}),
         ValueError, r"keys must be one key or one per row \(2,\)"),
        ("score empty cont", lambda c: kvg.score(model, params, [[1, 2]], [[]], cache=c,
                                                 seq_ids=[1]),
         ValueError, "continuation 0 must be a non-empty"),
        # 3: two rows on one slot; 10/11: slots outside the cache.
        ("dup slots", lambda c: g(model, params, [[1], [2]], cache=c, seq_ids=[2, 2], **KW),
         ValueError, r"seq_ids must be distinct .* got \[2, 2\]"),
        ("dup with held", lambda c: g(model, params, [[1], [2]], cache=c, seq_ids=[0, 0],
                                      **KW),
         ValueError, "must be distinct"),
        ("slot=max_seqs", lambda c: g(model, params, [[1]], cache=c, seq_ids=[4], **KW),
         ValueError, r"seq_ids entry 4 is outside the cache's slots \[0, 4\)"),
        ("slot=-1", lambda c: g(model, params, [[1]], cache=c, seq_ids=[-1], **KW),
         ValueError, "seq_ids entry -1 is outside"),
        ("slot float", lambda c: g(model, params, [[1]], cache=c, seq_ids=[1.0], **KW),
         ValueError, "seq_ids must be 1 ints"),
        ("slots count", lambda c: g(model, params, [[1]], cache=c, seq_ids=[1, 2], **KW),
         ValueError, "seq_ids must be 1 ints"),
        # 11: a sequence longer than the cache holds (a fresh slot, and the held one).
        ("too long", lambda c: g(model, params, [[1] * 20], cache=c, seq_ids=[1],
                                 **{**KW, "max_new_tokens": 5}),
         ValueError, r"would hold 25 tokens .* at most max_pages_per_seq \* page_size = 24"),
        ("held too long", lambda c: g(model, params, [[1] * 12], cache=c, seq_ids=[0],
                                      **{**KW, "max_new_tokens": 5}),
         ValueError, r"\(9 cached \+ 12 prompt \+ 5 new\)"),
        # 14: chunk sizes, per-row limits, policies.
        ("chunk=0", lambda c: g(model, params, [[1]], cache=c, seq_ids=[1],
                                **{**KW, "chunk_size": 0}),
         ValueError, "chunk_size must be a positive int, got 0"),
        ("chunk=-8", lambda c: g(model, params, [[1]], cache=c, seq_ids=[1],
                                 **{**KW, "chunk_size": -8}),
         ValueError, "chunk_size must be a positive int"),
        ("chunk=2.5", lambda c: g(model, params, [[1]], cache=c, seq_ids=[1],
                                  **{**KW, "chunk_size": 2.5}),
         ValueError, "chunk_size must be a positive int"),
        ("max_new rows", lambda c: g(model, params, [[1], [2]], cache=c, seq_ids=[1, 2],
                                     **{**KW, "max_new_tokens": [3, 4, 5]}),
         ValueError, r"max_new_tokens must be an int or 2 ints \(one per prompt\)"),
        ("max_new 0", lambda c: g(model, params, [[1], [2]], cache=c, seq_ids=[1, 2],
                                  **{**KW, "max_new_tokens": [3, 0]}),
         ValueError, r"max_new_tokens must be >= 1 per row, got \[3, 0\]"),
        ("max_new float", lambda c: g(model, params, [[1]], cache=c, seq_ids=[1],
                                      **{**KW, "max_new_tokens": 2.5}),
         ValueError, "max_new_tokens must be an int"),
        # Past int32 (the cast used to wrap 2**32 + 3 to 3 and decode 3 tokens).
        ("max_new 2**32+3", lambda c: g(model, params, [[1]], cache=c, seq_ids=[1],
                                        **{**KW, "max_new_tokens": 2**32 + 3}),
         ValueError, r"max_new_tokens must fit in int32 .* got \[4294967299\]"),
        ("max_new 2**31", lambda c: g(model, params, [[1], [2]], cache=c, seq_ids=[1, 2],
                                      **{**KW, "max_new_tokens": [2, 2**31]}),
         ValueError, r"must fit in int32 \(at most 2147483647\), got \[2, 2147483648\]"),
        ("policy str", lambda c: g(model, params, [[1]], cache=c, seq_ids=[1], policy="h2o",
                                   **KW),
         TypeError, "policy must be a kvjax.cache.policies.CachePolicy .* got 'h2o'"),
        ("policy class", lambda c: g(model, params, [[1]], cache=c, seq_ids=[1], policy=H2O,
                                     **KW),
         TypeError, "policy must be a kvjax.cache.policies.CachePolicy"),
        ("prefill mode", lambda c: g(model, params, [[1]], cache=c, seq_ids=[1],
                                     prefill="fast", **KW),
         ValueError, "prefill must be 'chunked' or 'step'"),
        ("sample_n n=0", lambda c: kvg.sample_n(model, params, [[1]], n=0, cache=c, **KW),
         ValueError, "n must be a positive int"),
        ("sample_n busy", lambda c: kvg.sample_n(model, params, [[1]], n=2, cache=c, **KW),
         ValueError, r"sample_n needs 2 empty slots"),
        ("beam width", lambda c: kvg.beam_search(model, params, [1], beam_width=0,
                                                 max_new_tokens=3, cache=c),
         ValueError, "beam_width must be a positive int"),
        ("beam busy", lambda c: kvg.beam_search(model, params, [1], beam_width=2,
                                                max_new_tokens=3, cache=c),
         ValueError, r"beam_search needs 4 empty slots"),
        # A cache built for another model, and a sharded impl on a cache holding sequences
        # that is not laid out for its plan (it cannot be rebuilt without losing them).
        ("other model", lambda c: g(model, params, [[1]], cache=kc.init_cache(other_spec),
                                    **KW),
         ValueError, "the cache was built for"),
        ("sharded impl", lambda c: g(model, params, [[1]], cache=c, seq_ids=[1],
                                     impl=kvs.ShardedAttention(plan), **KW),
         ValueError, "not laid out for its plan .* it holds sequences"),
        ("impl name", lambda c: g(model, params, [[1]], cache=c, seq_ids=[1], impl="fast",
                                  **KW),
         ValueError, "impl must be one of"),
    ]


def test_bad_requests_raise_and_keep_the_cache(held):
    model, params, snap, cache, last = held
    mla_model, _ = tiny.model_and_params("mla")
    for name, call, err, pattern in _bad_requests(model, params, _spec(mla_model)):
        try:
            call(cache)
        except err as e:
            assert re.search(pattern, str(e)), (name, str(e))
        else:
            raise AssertionError(f"{name}: no {err.__name__}")
        tiny.assert_same(cache, snap)  # still there (not donated), unchanged
    kc.check_invariants(cache)
    # Still usable: slot 0 continues exactly as on an untouched copy.
    want = _continue(model, params, tiny.restore(cache, snap), last)
    np.testing.assert_array_equal(_continue(model, params, cache, last), want)


def test_cache_full_error_carries_the_other_sequences(rng):
    """Out of pages while decoding slot 1: the error holds the final cache, and slot 0
    (untouched by the request) is there, unchanged, and decodes on as before."""
    model, params = tiny.model_and_params("gqa")
    spec = _spec(model, num_pages=5)
    first = kvg.generate(model, params, tiny.prompts(rng, [6]), cache=kc.init_cache(spec),
                         free_finished=False, **KW)  # slot 0: 8 tokens, 2 pages
    snap = tiny.snapshot(first.cache)
    last = int(first.tokens[0, -1])
    with pytest.raises(kc.CacheFullError, match="needs") as err:
        kvg.generate(model, params, tiny.prompts(rng, [5]), cache=first.cache, seq_ids=[1],
                     **{**KW, "max_new_tokens": 10})  # slot 1 needs 4 of 3 free pages
    after = err.value.cache
    kc.check_invariants(after)
    n = int(snap.table.lengths[0])
    assert int(after.lengths[0]) == n == 8
    pages = np.asarray(snap.table.block_tables)[0, : -(-n // PAGE)]
    np.testing.assert_array_equal(np.asarray(after.block_tables)[0, : pages.size], pages)
    for got, want in zip((after.pages.k, after.pages.v), (snap.pages.k, snap.pages.v),
                         strict=True):
        np.testing.assert_array_equal(np.asarray(got)[:, :, pages], want[:, :, pages])
    # Slot 1 was freed on the way out or holds what it got; free it and decode slot 0 on.
    after = kc.free(after, np.arange(spec.max_seqs) == 1)
    want = _continue(model, params, tiny.restore(first.cache, snap), last)
    np.testing.assert_array_equal(_continue(model, params, after, last), want)
