"""Sharded attention equals single-device attention, for every strategy and its combinations.

The reference runs on one device from host copies of the same pools; the
sharded ops run jitted on the sharded pools of `kvjax.sharding.init_sharded_cache`.
"""

import functools

import jax
import numpy as np
import pytest

from kvjax import attention as kva
from kvjax import sharding as kvs
from kvjax.specs import AttentionSpec, MLASpec
from tests.sharding.helpers import (
    PLANS,
    filled_cache,
    gqa_spec,
    make_plan,
    mla_spec,
    plan_id,
    sharded_view,
    view,
)

# f32 everywhere; the merge reorders sums of exp-weighted outputs: ~1e-6 relative.
TOL = dict(rtol=2e-5, atol=2e-5)
# Lengths: empty, shorter than one page (only context shard 0 has pages), exactly a page,
# around page boundaries, and long enough to wrap round-robin over 8 context shards.
LENGTHS = np.array([0, 3, 4, 5, 13, 33, 63, 64], np.int32)
Q_LEN = 5


def _close(got, want):
    out_g, lse_g = map(np.asarray, got)
    out_w, lse_w = map(np.asarray, want)
    np.testing.assert_array_equal(np.isneginf(lse_g), np.isneginf(lse_w))
    fin = np.isfinite(lse_w)
    np.testing.assert_allclose(lse_g[fin], lse_w[fin], **TOL)
    np.testing.assert_allclose(out_g, out_w, **TOL)


@functools.partial(jax.jit, static_argnames=("impl", "kw"))
def _gqa_both(q, qp, k, v, lengths, tables, q_lengths, impl, kw=()):
    kw = dict(kw)
    return (kva.paged_decode_attention(q, k, v, lengths, tables, impl=impl, **kw),
            kva.paged_prefill_attention(qp, k, v, lengths, tables, q_lengths, impl=impl, **kw))


@functools.partial(jax.jit, static_argnames=("impl", "scale"))
def _mla_both(ql, qr, qlp, qrp, c, r, lengths, tables, q_lengths, impl, scale):
    return (kva.mla_decode_attention(ql, qr, c, r, lengths, tables, scale=scale, impl=impl),
            kva.mla_prefill_attention(qlp, qrp, c, r, lengths, tables, q_lengths, scale=scale,
                                      impl=impl))


@functools.partial(jax.jit, static_argnames=("impl", "window", "cap"))
def _decode(q, k, v, lengths, tables, impl, window=None, cap=None):
    return kva.paged_decode_attention(q, k, v, lengths, tables, sliding_window=window,
                                      soft_cap=cap, impl=impl)


def _normal(rng, shape):
    """Float32 N(0, 1) drawn on the host (jnp.asarray would compile a program per shape)."""
    return jax.device_put(rng.standard_normal(shape).astype(np.float32))


def _q_lengths(rng, lengths, batch):
    return jax.device_put(np.minimum(rng.integers(0, Q_LEN + 1, batch), lengths).astype(np.int32))


@pytest.mark.parametrize("plan_args", PLANS, ids=plan_id)
def test_gqa_decode_and_prefill_match_one_device(plan_args, rng):
    plan = make_plan(*plan_args)
    spec = gqa_spec()
    lengths = rng.permutation(LENGTHS)
    cache = filled_cache(spec, plan, lengths, rng)
    b = spec.max_seqs
    q = _normal(rng, (b, 16, 16))
    qp = _normal(rng, (b, Q_LEN, 16, 16))
    q_lengths = _q_lengths(rng, lengths, b)
    kw = (("soft_cap", 30.0),)
    v = view(cache)
    want = _gqa_both(q, qp, v.k, v.v, v.lengths, v.block_tables, q_lengths, "reference", kw)
    s = sharded_view(cache)
    got = _gqa_both(q, qp, s.k, s.v, s.lengths, s.block_tables, q_lengths,
                    kvs.ShardedAttention(plan), kw)
    _close(got[0], want[0])
    _close(got[1], want[1])


@pytest.mark.parametrize("plan_args", [p for p in PLANS if p[2] != ("heads",)], ids=plan_id)
def test_mla_decode_and_prefill_match_one_device(plan_args, rng):
    # MLA has one latent head: it shards by pages (sequences, context); heads only splits q.
    plan = make_plan(*plan_args)
    spec = mla_spec()
    lengths = rng.permutation(LENGTHS)
    cache = filled_cache(spec, plan, lengths, rng)
    b = spec.max_seqs
    ql = _normal(rng, (b, 8, 32))
    qr = _normal(rng, (b, 8, 8))
    qlp = _normal(rng, (b, Q_LEN, 8, 32))
    qrp = _normal(rng, (b, Q_LEN, 8, 8))
    q_lengths = _q_lengths(rng, lengths, b)
    scale = 24 ** -0.5
    v = view(cache)
    want = _mla_both(ql, qr, qlp, qrp, v.k, v.v, v.lengths, v.block_tables, q_lengths,
                     "reference", scale)
    s = sharded_view(cache)
    got = _mla_both(ql, qr, qlp, qrp, s.k, s.v, s.lengths, s.block_tables, q_lengths,
                    kvs.ShardedAttention(plan), scale)
    _close(got[0], want[0])
    _close(got[1], want[1])


def test_context_merge_with_devices_holding_no_pages(rng):
    # A 2-page sequence and a 1-token one on 8 context devices: 6 devices hold nothing of
    # them and must contribute lse -inf without disturbing the merge.
    plan = make_plan((8,), ("context",), ("context",))
    spec = gqa_spec(max_seqs=2)
    cache = filled_cache(spec, plan, np.array([6, 1], np.int32), rng)
    v = view(cache)
    held = v.block_tables[0, :2] // (spec.num_pages // 8)
    assert sorted(held.tolist()) == [0, 1]
    q = _normal(rng, (2, 16, 16))
    want = _decode(q, v.k, v.v, v.lengths, v.block_tables, "reference")
    s = sharded_view(cache)
    _close(_decode(q, s.k, s.v, s.lengths, s.block_tables, kvs.ShardedAttention(plan)), want)


def test_kv_heads_fallback_replicates_and_matches(rng):
    # kv_heads=2 on model=8: KV heads replicated over model, query heads still split.
    plan = make_plan((8,), ("model",), ("heads",))
    spec = gqa_spec(attention=AttentionSpec(q_heads=16, kv_heads=2, head_dim=16))
    assert kvs.pool_spec(plan, spec)[1] is None
    cache = filled_cache(spec, plan, rng.permutation(LENGTHS), rng)
    q = _normal(rng, (spec.max_seqs, 16, 16))
    v = view(cache)
    want = _decode(q, v.k, v.v, v.lengths, v.block_tables, "reference")
    s = sharded_view(cache)
    _close(_decode(q, s.k, s.v, s.lengths, s.block_tables, kvs.ShardedAttention(plan)), want)


def test_sequences_sliding_window_matches_and_context_rejects_it(rng):
    plan = make_plan((2, 4), ("data", "model"), ("sequences", "heads"))
    spec = gqa_spec()
    cache = filled_cache(spec, plan, rng.permutation(LENGTHS), rng)
    q = _normal(rng, (spec.max_seqs, 16, 16))
    v = view(cache)
    want = _decode(q, v.k, v.v, v.lengths, v.block_tables, "reference", 5)
    s = sharded_view(cache)
    _close(_decode(q, s.k, s.v, s.lengths, s.block_tables, kvs.ShardedAttention(plan), 5), want)
    ctx = make_plan((8,), ("context",), ("context",))
    with pytest.raises(NotImplementedError, match="sliding_window"):
        kvs.sharded_paged_decode_attention(ctx, q, s.k, s.v, s.lengths, s.block_tables,
                                           sliding_window=4)


def test_pallas_kernels_run_inside_shard_map(rng):
    # impl="pallas" on CPU: the TPU kernels in plain interpret mode, on each device's shard
    # (the TPU interpreter hangs inside shard_map; plain interpret=True does not). The TPU
    # kernels take head_dim / d_c >= 64.
    plan = make_plan((2, 2, 2), ("data", "model", "context"), ("sequences", "heads", "context"))
    impl = kvs.ShardedAttention(plan, "pallas")
    lengths = rng.permutation(LENGTHS)
    spec = gqa_spec(attention=AttentionSpec(q_heads=16, kv_heads=8, head_dim=64))
    cache = filled_cache(spec, plan, lengths, rng)
    q = _normal(rng, (spec.max_seqs, 16, 64))
    v, s = view(cache), sharded_view(cache)
    _close(_decode(q, s.k, s.v, s.lengths, s.block_tables, impl),
           _decode(q, v.k, v.v, v.lengths, v.block_tables, "reference"))

    spec = mla_spec(attention=MLASpec(q_heads=8, kv_lora_rank=64, qk_rope_head_dim=64,
                                      qk_nope_head_dim=16, v_head_dim=16))
    cache = filled_cache(spec, plan, lengths, rng)
    ql = _normal(rng, (spec.max_seqs, 8, 64))
    qr = _normal(rng, (spec.max_seqs, 8, 64))
    v, s = view(cache), sharded_view(cache)
    mla = jax.jit(lambda *a, impl: kva.mla_decode_attention(*a, scale=0.1, impl=impl),
                  static_argnames="impl")
    _close(mla(ql, qr, s.k, s.v, s.lengths, s.block_tables, impl=impl),
           mla(ql, qr, v.k, v.v, v.lengths, v.block_tables, impl="reference"))


def test_eager_calls_compile_once_per_op_and_options(rng):
    """Called outside jit, a sharded op reuses its compiled shard_map: a second call with
    new queries does not retrace, and other options (a soft cap) get their own program
    and their own results."""
    from kvjax.sharding import attention as sharded

    plan = make_plan((2, 4), ("data", "model"), ("sequences", "heads"))
    spec = gqa_spec()
    cache = filled_cache(spec, plan, rng.permutation(LENGTHS), rng)
    v, s = view(cache), sharded_view(cache)
    impl = kvs.ShardedAttention(plan)

    def draw():
        return jax.device_put(rng.standard_normal((spec.max_seqs, 16, 16)).astype(np.float32))

    def entries():
        return {k: fn for k, fn in sharded._JITTED.items() if k[0] == impl}

    before = set(entries())
    for cap in (None, None, 20.0, None, 20.0):
        q = draw()
        got = kva.paged_decode_attention(q, s.k, s.v, s.lengths, s.block_tables,
                                         soft_cap=cap, impl=impl)
        # The reference as one program (the sharded op is the one called eagerly here).
        want = _decode(q, v.k, v.v, v.lengths, v.block_tables, "reference", cap=cap)
        _close(got, want)
    new = {k: fn for k, fn in entries().items() if k not in before}
    assert len(new) == 2  # one program per soft cap
    assert all(fn._cache_size() == 1 for fn in new.values())  # traced once each
