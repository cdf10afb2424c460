"""`generate` with a sharded attention impl and a cache that is not laid out for its plan.

`ShardedAttention(plan)` with the default, unsharded cache used to
decode wrong tokens (Llama and DeepSeek, under the "sequences" and "context"
strategies). Now an empty cache is rebuilt laid out for the plan (a config without a
plan is built for the impl's plan) and the greedy tokens equal the unsharded run's; a
cache that holds sequences is refused (tests/reliability/test_request_errors.py).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax.cache as kc
from kvjax import generate as kvg
from kvjax import sharding as kvs
from kvjax.cache import sharded_table
from tests.reliability import tiny
from tests.sharding.helpers import make_plan, plan_id

PLANS = [
    ((8,), ("data",), ("sequences",)),
    ((8,), ("context",), ("context",)),
    ((2, 4), ("data", "context"), ("sequences", "context")),
]
LENGTHS = (5, 11, 3, 8)
KW = dict(key=jax.random.key(0), max_new_tokens=5, chunk_size=8)


def _spec(model):
    return model.make_cache_spec(page_size=4, num_pages=64, max_seqs=8, max_pages_per_seq=8,
                                 dtype="float32")


@functools.cache
def _prompts(kind, lengths=LENGTHS):
    return tiny.prompts(np.random.default_rng(sum(map(ord, kind))), lengths)


@functools.cache
def _unsharded(kind, lengths=LENGTHS):
    model, params = tiny.model_and_params(kind)
    return kvg.generate(model, params, _prompts(kind, lengths),
                        cache=kc.init_cache(_spec(model)), **KW).tokens


def _assert_laid_out(cache, plan):
    want = kvs.cache_shardings(plan, cache.spec)
    for pool, sh in zip(jax.tree.leaves(cache.pages), jax.tree.leaves(want.pages), strict=True):
        assert pool.sharding.is_equivalent_to(sh, pool.ndim), (pool.sharding, sh)
    assert type(cache.table) is type(want.table)
    if isinstance(cache.table, sharded_table.ShardedPageTable):
        sharded_table.check_invariants(cache.table)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gqa", "mla"])
@pytest.mark.parametrize("plan_args", PLANS, ids=plan_id)
def test_fresh_unsharded_cache_decodes_as_unsharded(kind, plan_args):
    model, params = tiny.model_and_params(kind)
    plan = make_plan(*plan_args)
    fresh = kc.init_cache(_spec(model))
    res = kvg.generate(model, params, _prompts(kind), cache=fresh,
                       impl=kvs.ShardedAttention(plan), **KW)
    np.testing.assert_array_equal(res.tokens, _unsharded(kind))
    _assert_laid_out(res.cache, plan)
    # The caller's empty cache was replaced, not donated: it is still there.
    assert int(jnp.sum(fresh.lengths)) == 0


def test_config_without_plan_builds_for_the_impls_plan():
    """cache=None (a CacheConfig without a plan), three rows on two data shards and four
    context shards: the cache is built for the impl's plan (slots rounded to the data
    shards, pages to every context shard's share), not refused or run out of pages."""
    model, params = tiny.model_and_params("gqa")
    plan = make_plan(*PLANS[-1])
    lengths = (6, 2, 9)
    want = _unsharded("gqa", lengths)
    res = kvg.generate(model, params, _prompts("gqa", lengths), cache=None,
                       impl=kvs.ShardedAttention(plan), **KW)
    np.testing.assert_array_equal(res.tokens, want)
    _assert_laid_out(res.cache, plan)
    assert res.cache.spec.max_seqs == 4 and res.cache.spec.num_pages % 8 == 0
