"""A layer index past the cache's layers: an error when concrete, never another layer's data.

`tests/reliability/test_cache_arguments.py` covers the generic `write` / `attend` /
`layer_view` with concrete layers. Here: the kinds' own `write_layer` and `layer_view`
(`kvjax.cache.paged`, `kvjax.cache.quantized`, exported by `kvjax.cache`) refuse such a
layer and change nothing; and under jit, where the index is traced and cannot raise, a
layer outside [0, num_layers) writes nothing and reads NaN — indexing alone would clamp
it to the last (or first) layer and return that layer's attention as if it were valid.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax.cache as kc
from kvjax.cache import paged
from kvjax.cache import quantized as qz
from kvjax.specs import AttentionSpec, CacheSpec, MLASpec, QuantSpec
from tests.reliability import tiny

MAX_SEQS, PS, LAYERS = 3, 4, 2
KINDS = ["gqa", "mla", "gqa_kivi", "mla_kivi"]
KIVI = QuantSpec(bits=4, group_size=4, residual=4)
MLA_SCALE = 0.25


def _spec(kind):
    att = (MLASpec(q_heads=4, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8,
                   v_head_dim=8) if kind.startswith("mla")
           else AttentionSpec(q_heads=4, kv_heads=2, head_dim=8))
    return CacheSpec(attention=att, num_layers=LAYERS, page_size=PS, num_pages=16,
                     max_seqs=MAX_SEQS, max_pages_per_seq=5, dtype="float32",
                     quant=KIVI if kind.endswith("kivi") else None)


def _kv(spec, rng, q_len):
    heads = spec.attention.cache_heads
    wa, wb = spec.attention.cache_widths
    return tuple(tiny.device(rng.standard_normal((MAX_SEQS, q_len, heads, w)), jnp.float32)
                 for w in (wa, wb))


def _query(spec, rng):
    if spec.is_mla:
        return (tiny.device(rng.standard_normal((MAX_SEQS, 1, 4, 16)), jnp.float32),
                tiny.device(rng.standard_normal((MAX_SEQS, 1, 4, 4)), jnp.float32))
    return tiny.device(rng.standard_normal((MAX_SEQS, 1, 4, 8)), jnp.float32)


@pytest.fixture(autouse=True)
def _kivi_writes_compiled_once(monkeypatch):
    tiny.jit_kivi_writes(monkeypatch)


def _filled(kind, rng):
    """Every slot holds random tokens in both layers (different per layer; KIVI slots long
    enough to have quantized pages), then one more reserved token per slot."""
    spec = _spec(kind)
    counts = jnp.asarray(rng.integers(9, 15, MAX_SEQS), jnp.int32)
    cache, status = kc.reserve(kc.init_cache(spec), counts)
    status.raise_if_error()
    for layer in range(LAYERS):
        a, b = _kv(spec, rng, 14)
        cache = kc.write(cache, layer, a, b, q_lengths=counts)
    cache, status = kc.reserve(cache, jnp.ones(MAX_SEQS, jnp.int32))
    status.raise_if_error()
    kc.check_invariants(cache)
    return cache


@functools.cache
def _jitted(kind):
    """attend, attention_probs, layer_view and write with the layer traced."""
    mla_kw = dict(scale=MLA_SCALE) if kind.startswith("mla") else {}
    ones = jnp.ones(MAX_SEQS, jnp.int32)

    def attend(cache, layer, q):
        return kc.attend(cache, layer, q, q_lengths=ones, **mla_kw)

    def probs(cache, layer, q):
        q = jnp.concatenate(q, axis=-1) if isinstance(q, tuple) else q
        return kc.attention_probs(cache, layer, q, ones, scale=MLA_SCALE)

    def write(cache, layer, a, b):
        return kc.write(cache, layer, a, b, q_lengths=ones)

    return tuple(jax.jit(f) for f in (attend, probs, kc.layer_view, write))


@pytest.mark.parametrize("kind", KINDS)
def test_kinds_own_write_and_view_refuse_the_layer(rng, kind):
    cache = _filled(kind, rng)
    snap = tiny.snapshot(cache)
    a, b = _kv(cache.spec, rng, 1)
    ones = jnp.ones(MAX_SEQS, jnp.int32)
    if cache.tail is None:
        pos = (cache.lengths - 1)[:, None]
        slots = paged.token_slots(cache, pos, jnp.ones((MAX_SEQS, 1), bool))
        write = functools.partial(paged.write_layer, cache, slots=slots, a=a, b=b)
        views = [functools.partial(paged.layer_view, cache)]
    else:
        write = functools.partial(qz.write_layer, cache, a=a, b=b)
        views = [functools.partial(qz.layer_view, cache, whole_pools=w) for w in (False, True)]
    for layer in (LAYERS, 5, -1, np.int64(7), jnp.int32(LAYERS)):
        msg = rf"layer {int(layer)} is outside the cache's {LAYERS} layers \(allowed: 0 .. 1\)"
        with pytest.raises(ValueError, match=msg):
            write(layer=layer)
        for view in views:
            with pytest.raises(ValueError, match=msg):
                view(layer)
        tiny.assert_same(cache, snap)
    # The same cache still takes the last reserved token in every layer.
    for layer in range(LAYERS):
        cache = kc.write(cache, layer, a, b, q_lengths=ones)
    kc.check_invariants(cache)


@pytest.mark.parametrize("kind", KINDS)
def test_traced_layer_past_the_cache_reads_nan_and_writes_nothing(rng, kind):
    cache = _filled(kind, rng)
    spec = cache.spec
    attend, probs, view, write = _jitted(kind)
    q = _query(spec, rng)
    a, b = _kv(spec, rng, 1)
    # Traced valid layers: the eager results (and the two layers differ).
    eager = [kc.attend(cache, layer, q, q_lengths=jnp.ones(MAX_SEQS, jnp.int32),
                       **(dict(scale=MLA_SCALE) if spec.is_mla else {}))
             for layer in range(LAYERS)]
    for layer in range(LAYERS):
        out, lse = attend(cache, jnp.int32(layer), q)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(eager[layer][0]))
        np.testing.assert_array_equal(np.asarray(lse), np.asarray(eager[layer][1]))
        assert np.isfinite(np.asarray(out)).all()
    assert not np.array_equal(np.asarray(eager[0][0]), np.asarray(eager[1][0]))
    snap = tiny.snapshot(cache)
    for layer in (LAYERS, 5, -1, -LAYERS - 1):
        bad = jnp.int32(layer)
        out, lse = attend(cache, bad, q)
        assert np.isnan(np.asarray(out)).all() and np.isnan(np.asarray(lse)).all(), layer
        assert np.isnan(np.asarray(probs(cache, bad, q))).all(), layer
        floats = [x for x in jax.tree.leaves(view(cache, bad))
                  if jnp.issubdtype(x.dtype, jnp.floating)]
        assert floats and all(np.isnan(np.asarray(x)).all() for x in floats), layer
        # A write to it lands nowhere: no layer of any slot changes.
        new = write(tiny.restore(cache, snap), bad, a, b)
        tiny.assert_same(new, snap)
    # Still usable: every layer takes the reserved token and attends finitely.
    for layer in range(LAYERS):
        cache = kc.write(cache, layer, a, b, q_lengths=jnp.ones(MAX_SEQS, jnp.int32))
        assert np.isfinite(np.asarray(attend(cache, jnp.int32(layer), q)[0])).all()
    kc.check_invariants(cache)
