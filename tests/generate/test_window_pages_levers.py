"""Window-only pages (`CacheConfig(window_pages=True)`) with the other levers.

The tiny model of test_window_pages (a windowed layer seeing 6 tokens, then a global
layer; 4-token pages, 8-token prefill chunks, rings of 4 pages) runs prompts of 21 and
9 tokens plus 20 new ones, so the rings wrap several times.

KIVI pages: the global layer keeps KIVI int4 pages and tail, the windowed layer
full-precision rings; no other cache holds that mix, so each half is compared on a
model whose other half adds nothing to the residual stream (its attention output
projection is zero, making the contents of its cache irrelevant): with the windowed
layer muted the tokens and teacher-forced log-probabilities equal a KIVI int4 cache
without window pages bit for bit (the global layer's quantized path), with the global
layer muted they equal full-precision window pages (the rings beside KIVI pages).
Log-probabilities are teacher-forced (`kvjax.generate.score`, generate's decode step)
over random continuations.
"""

import dataclasses

import jax
import numpy as np
import pytest

import kvjax as kvx
import kvjax.generate as gen
from kvjax.cache import host, window
from kvjax.models import base, llama
from kvjax.models.deepseek.params import init_from_shapes
from kvjax.models.layers import RopeConfig

WINDOW, PAGE, CHUNK, NEW = 6, 4, 8, 20
RING = -(-(WINDOW + CHUNK - 2) // PAGE) + 1
KIVI = kvx.QuantSpec(bits=4, group_size=4, residual=4)


@pytest.fixture(scope="module")
def model_params():
    cfg = llama.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                            q_heads=4, kv_heads=2, head_dim=8,
                            rope=RopeConfig(theta=10000.0, dim=8),
                            sliding_windows=(WINDOW, None))
    key = jax.random.key(7)
    # Weights of std 0.3 (not init_params' 0.02) give peaked logits and varied tokens.
    params = init_from_shapes(jax.eval_shape(lambda k: llama.init_params(cfg, k), key), key,
                              std=0.3)
    return base.get_family("llama").model(cfg), params


@pytest.fixture(scope="module")
def prompts():
    """Prompts of 21 and 9 tokens and continuations of NEW tokens to teacher-force."""
    rng = np.random.default_rng(3)
    return ([rng.integers(0, 64, 21).tolist(), rng.integers(0, 64, 9).tolist()],
            rng.integers(0, 64, (2, NEW)).tolist())


def mute(params, layer):
    """The params with `layer`'s attention output projection zero (same shapes: the
    compiled programs are shared)."""
    wo = np.asarray(params.layers.wo).copy()
    wo[layer] = 0
    return dataclasses.replace(params, layers=dataclasses.replace(
        params.layers, wo=jax.device_put(wo)))


def score(model, params, prompts, cache, **kw):
    """Teacher-forced log-probabilities through generate's decode step (the same step a
    greedy or sampled run takes), with the final cache."""
    return gen.score(model, params, *prompts, chunk_size=CHUNK, cache=cache,
                     free_finished=False, **kw)


def test_kivi_global_layers_beside_full_precision_rings(model_params, prompts):
    model, params = model_params
    kivi_win = gen.CacheConfig(page_size=PAGE, quant=KIVI, window_pages=True)
    for muted, ref_cfg in ((0, gen.CacheConfig(page_size=PAGE, quant=KIVI)),
                           (1, gen.CacheConfig(page_size=PAGE, window_pages=True))):
        p = mute(params, muted)
        ref = score(model, p, prompts, ref_cfg)
        got = score(model, p, prompts, kivi_win)
        np.testing.assert_array_equal(got.logprobs, ref.logprobs, err_msg=f"muted {muted}")
        assert np.isfinite(got.logprobs).all() and np.ptp(got.logprobs) > 1.0
    cache = got.cache
    kvx.cache.check_invariants(cache)
    # The global layer alone in the KIVI pools and tail; the windowed one in its rings.
    assert cache.tail.a.shape[0] == 1 and cache.pages.k[0].codes.shape[0] == 1
    assert cache.pages.k[0].bits == 4
    assert cache.groups[0].pages.k.shape[:3] == (1, 2, 2 * RING)
    assert cache.groups[0].pages.k.dtype == np.float32
    assert window.pages_in_use(cache) == (2 * RING,)
    assert int(cache.quant_lengths.min()) > 0  # quantized pages were written


def test_host_tier_moves_global_pages_and_rings_stay_on_device(model_params, prompts):
    # Each row's leading pages of the global layer move to the host between a first request
    # and its continuation (more prompt, then decode); the windowed layer's rings stay on
    # the device. Tokens equal the same requests on the same tier with no page moved (every
    # page on the device: the same compiled programs). Both requests are 8-token prompts
    # (one chunk) plus NEW tokens: one prefill and one decode program serve all four runs.
    model, params = model_params
    first, more = [c[:8] for c in prompts[1]], [c[8:16] for c in prompts[1]]
    tokens = {}
    for moved in (False, True):
        cache = host.attach(gen.CacheConfig(page_size=PAGE, window_pages=True).build(
            model, num_seqs=2, max_tokens=64, chunk=CHUNK), 16, stream_pages=4)
        cache = gen.generate(model, params, first, key=jax.random.key(0), max_new_tokens=NEW,
                             chunk_size=CHUNK, cache=cache, seq_ids=[0, 1],
                             free_finished=False).cache
        if moved:
            rings = np.asarray(cache.groups[0].table.block_tables).copy()
            for s, n in ((0, 4), (1, 2)):
                assert host._movable(cache, s) > n
                cache, status = host.move(cache, s, n)
                status.raise_if_error()
            assert np.asarray(host.host_pages(cache)).tolist() == [4, 2]
            np.testing.assert_array_equal(cache.groups[0].table.block_tables, rings)
            host.check(cache)
        out = gen.generate(model, params, more, key=jax.random.key(1), max_new_tokens=NEW,
                           chunk_size=CHUNK, cache=cache, seq_ids=[0, 1], free_finished=False)
        tokens[moved] = out.tokens
        host.check(out.cache)  # both tiers' tables and how they meet
        window.check_invariants(out.cache)
        assert np.asarray(host.host_pages(out.cache)).tolist() == ([4, 2] if moved else [0, 0])
    np.testing.assert_array_equal(tokens[True], tokens[False])
    assert len(set(tokens[True][0].tolist())) > 5
    assert window.pages_in_use(out.cache) == (2 * RING,)
