"""`kvjax.generate` with window-only pages (`CacheConfig(window_pages=True)`).

A tiny Llama-family model whose windowed layers see 6 tokens, on 4-token pages and
8-token prefill chunks (rings of 4 pages), runs prompts of 21 and 9 tokens plus 20 new
ones (41 > 3 x 6): greedy, beam and sampled-fork tokens and teacher-forced
log-probabilities must equal the full-context cache's, in float32 and bfloat16, with
windowed and global layers mixed (the unrolled layer loop) and all layers windowed (the
scan over layers, Mistral's layout).
"""

import dataclasses

import jax
import numpy as np
import pytest

import kvjax as kvx
import kvjax.generate as gen
from kvjax.cache import window
from kvjax.models import base, llama
from kvjax.models.deepseek.params import init_from_shapes
from kvjax.models.layers import RopeConfig
from kvjax.sharding import ShardingPlan, init_sharded_cache, make_mesh

WINDOW, PAGE, CHUNK, NEW = 6, 4, 8, 20
RING = -(-(WINDOW + CHUNK - 2) // PAGE) + 1


def tiny(windows, dtype="float32"):
    cfg = llama.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                            num_layers=len(windows), q_heads=4, kv_heads=2, head_dim=8,
                            rope=RopeConfig(theta=10000.0, dim=8), sliding_windows=windows,
                            dtype=dtype)
    key = jax.random.key(7)
    # Weights of std 0.3 (not init_params' 0.02) give peaked logits and varied tokens.
    params = init_from_shapes(jax.eval_shape(lambda k: llama.init_params(cfg, k), key), key,
                              std=0.3)
    return base.get_family("llama").model(cfg), jax.tree.map(lambda x: x.astype(dtype), params)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    return [rng.integers(0, 64, 21).tolist(), rng.integers(0, 64, 9).tolist()]


def config(on, dtype="float32"):
    return gen.CacheConfig(page_size=PAGE, dtype=dtype, window_pages=on)


def test_greedy_equals_full_cache_and_rings_bound_pages(prompts):
    # A windowed then a global layer (the unrolled layer loop): the windowed layer's
    # output at every prompt position feeds the global layer's keys and values.
    windows = (WINDOW, None)
    model, params = tiny(windows)
    run = {on: gen.generate(model, params, prompts, key=jax.random.key(0), max_new_tokens=NEW,
                            chunk_size=CHUNK, cache=config(on), free_finished=False)
           for on in (False, True)}
    np.testing.assert_array_equal(run[True].tokens, run[False].tokens)
    assert len(set(run[True].tokens[0].tolist())) > 5  # not a degenerate repetition
    # Teacher-forced log-probabilities of those tokens (same prefill program, a forced
    # decode loop): a stale key anywhere in the windows would move them.
    conts = [t.tolist() for t in run[False].tokens]
    scores = {on: gen.score(model, params, prompts, conts, chunk_size=CHUNK, cache=config(on))
              for on in (False, True)}
    np.testing.assert_array_equal(scores[True].logprobs, scores[False].logprobs)
    cache = run[True].cache
    assert [g.layers for g in cache.spec.window_groups] == [(0,)]
    # Each row holds its ring and no more in the windowed layer, all of its pages in the
    # global one.
    assert window.pages_in_use(cache) == (2 * RING,)
    assert cache.groups[0].pages.k.shape[:3] == (1, 2, 2 * RING)
    assert cache.pages.k.shape[0] == 1
    held = -(-np.asarray(cache.lengths) // PAGE)  # the last new token is never written
    assert int(cache.table.num_pages - cache.table.num_free) == held.sum()


def test_sharded_window_pages_equal_unsharded(prompts):
    # KV heads over `model`, the two sequences over `data`: each ring's pages come from
    # its sequence's data shard, so a device's compacted view of a row keeps the row's
    # positions and the window masks as on one device.
    model, params = tiny((WINDOW, None))
    plan = ShardingPlan(mesh=make_mesh((2, 2), ("data", "model")),
                        strategies=("sequences", "heads"))
    run = {p: gen.generate(model, params, prompts, key=jax.random.key(0), max_new_tokens=NEW,
                           chunk_size=CHUNK, free_finished=False,
                           cache=gen.CacheConfig(page_size=PAGE, window_pages=True, plan=p))
           for p in (None, plan)}
    np.testing.assert_array_equal(run[plan].tokens, run[None].tokens)
    cache = run[plan].cache
    grp = cache.groups[0]
    assert grp.pages.k.sharding.spec[1:3] == ("model", "data")
    assert len(grp.pages.k.sharding.device_set) == 4
    assert grp.table.data_shards == 2
    kvx.cache.check_invariants(cache)  # every ring page on its sequence's data shard
    assert window.pages_in_use(cache) == (2 * RING,)


def test_bfloat16_beams_and_sampled_forks_equal_full_cache(prompts):
    # Every layer windowed (Mistral's layout): the scan over layers, a traced layer index,
    # and main pools with no layer.
    model, params = tiny((WINDOW, WINDOW), dtype="bfloat16")
    sampling = gen.SamplingConfig(temperature=1.0)
    out = {}
    for on in (False, True):
        cfg = config(on, "bfloat16")
        out[on] = (
            gen.beam_search(model, params, prompts[0], beam_width=3, max_new_tokens=NEW,
                            chunk_size=CHUNK, cache=cfg),
            # The beam's prompt, slots and pool (beam_search sizes its pool for 2 x 3 slots
            # of 11 pages, with room to fork): sample_n's prefill is beam_search's program.
            gen.sample_n(model, params, prompts[:1], n=6, key=jax.random.key(2),
                         max_new_tokens=NEW, chunk_size=CHUNK,
                         cache=dataclasses.replace(cfg, num_pages=11 + 6 * 12),
                         sampling=sampling).tokens)
    np.testing.assert_array_equal(out[True][0].tokens, out[False][0].tokens)
    np.testing.assert_array_equal(out[True][0].scores, out[False][0].scores)
    np.testing.assert_array_equal(out[True][1], out[False][1])
    assert len({tuple(t) for t in out[True][1].tolist()}) > 1  # the forks really diverge
    assert len({tuple(t) for t in out[True][0].tokens.tolist()}) == 3


def test_window_pages_refusals(prompts):
    model, params = tiny((None, WINDOW))
    # A cache built for 4-token reserves cannot take 8-token prefill chunks.
    cache = kvx.init_cache(config(True).spec(model, num_seqs=2, max_tokens=64, chunk=4))
    with pytest.raises(ValueError, match="chunk_size=4"):
        gen.generate(model, params, prompts, key=jax.random.key(0), max_new_tokens=2,
                     chunk_size=CHUNK, cache=cache)
    # Not yet combined: the 'context' strategy.
    ctx = ShardingPlan(mesh=make_mesh((2,), ("context",)), strategies=("context",))
    with pytest.raises(ValueError, match="'context' strategy"):
        init_sharded_cache(cache.spec, ctx)
    with pytest.raises(ValueError, match="'context' sharding strategy"):
        gen.CacheConfig(window_pages=True, plan=ctx)
