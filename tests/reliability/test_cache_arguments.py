"""The generic cache operations refuse arguments no call can accept and never touch another
sequence's pages.

A layer index past the cache's layers, a negative count in a quantized `reserve`
under jit, a position no page was reserved for, slots outside
the table: a scatter index of -1 would wrap to the pool's last page), the KIVI write of
values quantization cannot represent, and integers that do not fit int32 (converting
would wrap them). Each case: a clear ValueError / TypeError and the cache unchanged, or
(under jit, where values are not known) a status or a write that changes nothing.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax.cache as kc
from kvjax.cache import page_table as pt
from kvjax.cache import paged
from kvjax.cache import quantized as qz
from kvjax.specs import AttentionSpec, CacheSpec, MLASpec, QuantSpec
from tests.reliability import tiny

MAX_SEQS, PS, Q_LEN = 4, 4, 6
KIVI = QuantSpec(bits=4, group_size=4, residual=4)


def _spec(kind, dtype="float32"):
    att = (MLASpec(q_heads=4, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8,
                   v_head_dim=8) if kind.startswith("mla")
           else AttentionSpec(q_heads=4, kv_heads=2, head_dim=8))
    return CacheSpec(attention=att, num_layers=2, page_size=PS, num_pages=16,
                     max_seqs=MAX_SEQS, max_pages_per_seq=6, dtype=dtype,
                     quant=KIVI if kind.endswith("kivi") else None)


KINDS = ["gqa", "mla", "gqa_kivi", "mla_kivi"]


def _kv(spec, rng, batch, q_len=Q_LEN, scale=1.0):
    heads = spec.attention.cache_heads
    wa, wb = spec.attention.cache_widths
    a = scale * rng.standard_normal((batch, q_len, heads, wa))
    b = scale * rng.standard_normal((batch, q_len, heads, wb))
    return tiny.device(a, spec.dtype), tiny.device(b, spec.dtype)


def _query(spec, rng, batch, q_len=1):
    if spec.is_mla:
        return (tiny.device(rng.standard_normal((batch, q_len, 4, 16)), jnp.float32),
                tiny.device(rng.standard_normal((batch, q_len, 4, 4)), jnp.float32))
    return tiny.device(rng.standard_normal((batch, q_len, 4, 8)), jnp.float32)


@pytest.fixture(autouse=True)
def _kivi_writes_compiled_once(monkeypatch):
    tiny.jit_kivi_writes(monkeypatch)


@functools.cache
def _jit_write(layer):
    """`write` under jit with the slots and lengths traced (their values unknown)."""
    def write(cache, a, b, q_lengths, seq_ids):
        return kc.write(cache, layer, a, b, q_lengths=q_lengths, seq_ids=seq_ids)

    return jax.jit(write, donate_argnames="cache")


def _filled(kind, rng, dtype="float32", counts=(5, 3, 0, 6)):
    """A cache whose slots hold `counts` tokens (written in both layers), slot 3 forked
    from slot 0 when it is empty."""
    spec = _spec(kind, dtype)
    cache, status = kc.reserve(kc.init_cache(spec), jnp.asarray(counts, jnp.int32))
    status.raise_if_error()
    a, b = _kv(spec, rng, MAX_SEQS)
    for layer in range(spec.num_layers):
        cache = kc.write(cache, layer, a, b, q_lengths=jnp.asarray(counts, jnp.int32))
    kc.check_invariants(cache)
    return cache


def _raises(err, pattern, fn, cache):
    snap = tiny.snapshot(cache)
    with pytest.raises(err, match=pattern):
        fn()
    tiny.assert_same(cache, snap)


# ------------------------------------------------------------------- 4: layer indices


@pytest.mark.parametrize("kind", KINDS)
def test_layer_past_the_cache_is_an_error(rng, kind):
    cache = _filled(kind, rng)
    spec = cache.spec
    cache, status = kc.reserve(cache, jnp.asarray([1, 1, 0, 1], jnp.int32))
    status.raise_if_error()
    a, b = _kv(spec, rng, MAX_SEQS, q_len=1)
    ones = jnp.asarray([1, 1, 0, 1], jnp.int32)
    scale = None if not spec.is_mla else 0.25
    for layer in (2, 5, -1, np.int32(5), jnp.int32(2)):
        msg = rf"layer {int(layer)} is outside the cache's 2 layers \(allowed: 0 .. 1\)"
        _raises(ValueError, msg, lambda layer=layer: kc.write(cache, layer, a, b,
                                                              q_lengths=ones), cache)
        _raises(ValueError, msg, lambda layer=layer: kc.layer_view(cache, layer), cache)
        _raises(ValueError, msg, lambda layer=layer: kc.attend(
            cache, layer, _query(spec, rng, MAX_SEQS), q_lengths=ones, scale=scale), cache)
        _raises(ValueError, msg, lambda layer=layer: kc.attend(
            cache, layer, _query(spec, rng, 2, q_len=3), q_lengths=jnp.asarray([3, 1]),
            seq_ids=jnp.asarray([0, 1]), scale=scale), cache)
    _raises(TypeError, "layer must be an int", lambda: kc.layer_view(cache, 1.0), cache)
    # The valid layers still work on the same cache.
    cache = kc.write(cache, 1, a, b, q_lengths=ones)
    kc.check_invariants(cache)


# ------------------------------------------------- 9: counts in a quantized reserve


@pytest.mark.parametrize("kind", ["gqa_kivi", "mla_kivi"])
def test_quantized_reserve_negative_count(rng, kind):
    cache = _filled(kind, rng)
    counts = np.asarray([2, -4, 0, 1], np.int32)
    _raises(ValueError, r"num_new must be >= 0 .* slot 1 asks for -4",
            lambda: kc.reserve(cache, jnp.asarray(counts)), cache)
    _raises(ValueError, r"num_new\[1\] = -4 is negative",
            lambda: qz.reserve(cache, jnp.asarray(counts)), cache)
    # A failed reserve changes nothing but the pending counts, which it clears (so that
    # the step's write that follows writes nothing).
    snap = tiny.snapshot(cache)
    failed = dataclasses.replace(snap, tail=dataclasses.replace(
        snap.tail, pending=np.zeros_like(snap.tail.pending)))
    # Traced: a status, and the lengths and quantized counts stay.
    for bad, code in ((counts, pt.BAD_COUNT),
                      (np.asarray([0, 0, 2**31 - 3, 0], np.int32), pt.TOO_LONG),
                      (np.asarray([0, 25, 0, 0], np.int32), pt.TOO_LONG)):
        new, status = jax.jit(qz.reserve)(cache, jnp.asarray(bad))
        assert int(status.code) == code, (bad, int(status.code))
        with pytest.raises((ValueError, kc.CacheFullError)):
            status.raise_if_error()
        tiny.assert_same(new, failed)
        kc.check_invariants(new)
    # The public reserve under a caller's jit: the same status, the cache donated back.
    new, status = jax.jit(kc.reserve)(tiny.restore(cache, snap), jnp.asarray(counts))
    assert int(status.code) == pt.BAD_COUNT
    tiny.assert_same(new, failed)


@pytest.mark.parametrize("kind", KINDS)
def test_counts_and_slots_past_int32_or_not_integers(rng, kind):
    cache = _filled(kind, rng)
    huge = np.asarray([0, 2**32 + 3, 0, 0], np.int64)  # would wrap to 3
    _raises(ValueError, "num_new holds 4294967299, outside int32",
            lambda: kc.reserve(cache, huge), cache)
    _raises(TypeError, "num_new must be integer, got float32",
            lambda: kc.reserve(cache, jnp.full(MAX_SEQS, 2.0)), cache)
    _raises(ValueError, r"num_new must have shape \(max_seqs,\) = \(4,\), got \(2,\)",
            lambda: kc.reserve(cache, jnp.asarray([1, 1], jnp.int32)), cache)
    _raises(ValueError, "dst holds -4294967294, outside int32",
            lambda: kc.fork(cache, np.asarray([1]), np.asarray([-2**32 + 2])), cache)
    _raises(TypeError, "src must be integer slot ids, got dtype float32",
            lambda: kc.fork(cache, jnp.asarray([0.7]), jnp.asarray([2])), cache)
    _raises(ValueError, r"src \(2,\) and dst \(1,\) must have one length",
            lambda: kc.fork(cache, jnp.asarray([0, 1]), jnp.asarray([2])), cache)
    _raises(TypeError, "seqs must be bool",
            lambda: kc.free(cache, jnp.asarray([0, 1, 0, 0], jnp.int32)), cache)


# ------------------------------------- 10: unreserved positions, slots outside the table


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_unreserved_position_is_dropped_not_wrapped(rng, dtype):
    """A position past a sequence's reserved pages has block-table entry -1: the write
    is dropped (it used to wrap to the pool's last page, another sequence's on float32)."""
    spec = _spec("gqa", dtype).replace(num_pages=5)
    cache = kc.init_cache(spec)
    counts = jnp.asarray([4, 4, 8, 4], jnp.int32)  # every page of the pool in use
    cache, status = kc.reserve(cache, counts)
    status.raise_if_error()
    a, b = _kv(spec, rng, MAX_SEQS, q_len=8)
    cache = kc.write(cache, 0, a, b, q_lengths=counts)
    snap = tiny.snapshot(cache)
    # A one-page slot that does not own the pool's last page: its positions 4 .. 11 have
    # no page (entry -1); wrapped, they would land in the last page.
    bt = np.asarray(cache.block_tables)
    s = next(s for s in (0, 1, 3) if bt[s, 0] != spec.num_pages - 1)
    assert bt[s, 1] == -1 and (bt == spec.num_pages - 1).any()
    positions = jnp.asarray(np.arange(4, 12)[None].repeat(MAX_SEQS, 0), jnp.int32)
    valid = jnp.zeros((MAX_SEQS, 8), bool).at[s].set(True)
    slots = paged.token_slots(cache, positions, valid)
    assert np.all(np.asarray(slots.page)[s] == spec.num_pages)  # the dropped sink
    x, y = _kv(spec, rng, MAX_SEQS, q_len=8, scale=100.0)
    new = jax.jit(paged.write_layer, static_argnames="layer")(cache, 0, slots, x, y)
    tiny.assert_same(new, snap)
    # Slots outside the table likewise: token_slots drops them.
    slots = paged.token_slots(cache, positions[:2], jnp.ones((2, 8), bool),
                              jnp.asarray([MAX_SEQS, -1], jnp.int32))
    assert np.all(np.asarray(slots.page) == spec.num_pages)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_write_to_slots_outside_the_table(rng, kind, dtype):
    """Concrete slots outside [0, max_seqs) or repeated are a ValueError; traced (inside a
    model's jit) their rows write nothing, and no other slot changes (a negative slot used
    to wrap to the last slots' tails and pages on a KIVI cache)."""
    cache = _filled(kind, rng, dtype)
    counts = jnp.asarray([0, 2, 0, 3], jnp.int32)  # every slot's new tokens: 1 and 3
    cache, status = kc.reserve(cache, counts)
    status.raise_if_error()
    snap = tiny.snapshot(cache)
    x, y = _kv(cache.spec, rng, 2)
    q = jnp.asarray([3, 3], jnp.int32)
    for ids in ([MAX_SEQS, 3], [-1, 1], [-MAX_SEQS, 3]):
        seq_ids = jnp.asarray(ids, jnp.int32)
        bad = ids[0]
        _raises(ValueError, rf"write: seq_ids\[0\] = {bad} is outside the cache's slots "
                            rf"\[0, {MAX_SEQS}\)",
                lambda seq_ids=seq_ids: kc.write(cache, 0, x, y, q_lengths=q, seq_ids=seq_ids),
                cache)
        _raises(ValueError, rf"attend: seq_ids\[0\] = {bad} is outside",
                lambda seq_ids=seq_ids: kc.attend(
                    cache, 0, _query(cache.spec, rng, 2, q_len=3), q_lengths=q,
                    seq_ids=seq_ids, scale=0.25), cache)
        # Traced: row 0 writes nothing; row 1 writes its own slot only.
        new = _jit_write(0)(tiny.restore(cache, snap), x, y, q_lengths=q, seq_ids=seq_ids)
        kc.check_invariants(new)
        alone = _jit_write(0)(tiny.restore(cache, snap), x[1:], y[1:], q_lengths=q[1:],
                              seq_ids=seq_ids[1:])
        jax.tree.map(lambda u, v: np.testing.assert_array_equal(np.asarray(u), np.asarray(v)),
                     new, alone)
    _raises(ValueError, r"seq_ids must be distinct .* got \[3, 3\]",
            lambda: kc.write(cache, 0, x, y, q_lengths=q, seq_ids=jnp.asarray([3, 3])), cache)
    _raises(ValueError, r"q_lengths\[1\] = 7 is outside \[0, q_len=6\]",
            lambda: kc.write(cache, 0, x, y, q_lengths=jnp.asarray([3, 7]),
                             seq_ids=jnp.asarray([1, 3])), cache)
    _raises(TypeError, "q_lengths must be integer",
            lambda: kc.write(cache, 0, x, y, q_lengths=jnp.asarray([3.0, 3.0]),
                             seq_ids=jnp.asarray([1, 3])), cache)


# --------------------------------------------------- KIVI: values it cannot represent


@pytest.mark.parametrize("kind", ["gqa_kivi", "mla_kivi"])
def test_kivi_write_of_unrepresentable_values(rng, kind):
    """Concrete: a ValueError naming the element, consistent with `check_quantizable`
    (non-finite, or beyond float16 scales' range); nothing written. Traced: the write
    goes through, and the value spoils at most its own slot (keys: one channel of its
    quantization group; the other slots dequantize exactly as before)."""
    cache = _filled(kind, rng)
    before = [qz.dequantized_sequence(cache, 0, s) for s in range(3)]
    cache, status = kc.reserve(cache, jnp.asarray([0, 2, 0, 3], jnp.int32))
    status.raise_if_error()
    snap = tiny.snapshot(cache)
    seq_ids, q = jnp.asarray([1, 3], jnp.int32), jnp.asarray([2, 3], jnp.int32)
    for value in (np.nan, np.inf, -np.inf, 1e30):
        cache = tiny.restore(cache, snap)
        x, y = _kv(cache.spec, rng, 2)
        x = x.at[1, 2, 0, 3].set(value)  # slot 3, its third new token: a real one
        what = "not finite" if not np.isfinite(value) else "lies outside \\+-65504"
        with pytest.raises(ValueError, match=rf"write: a\[1, 2, 0, 3\] \(row 1, slot 3, "
                                             rf"token 2\) = .* {what}"):
            kc.write(cache, 0, x, y, q_lengths=q, seq_ids=seq_ids)
        tiny.assert_same(cache, snap)
        # Padding (token 2 of row 0: slot 1 received 2 tokens) is never quantized: no error.
        pad = _kv(cache.spec, rng, 2)[0].at[0, 2, 0, 3].set(value)
        kc.write(tiny.restore(cache, snap), 0, pad, y, q_lengths=q, seq_ids=seq_ids)
        new = _jit_write(0)(cache, x, y, q_lengths=q, seq_ids=seq_ids)
        kc.check_invariants(new)
        for s in range(3):  # slots 0-2 keep their tokens (slot 1 gains finite ones)
            got = qz.dequantized_sequence(new, 0, s)
            n = before[s][0].shape[0]
            for g, w in zip(got, before[s], strict=True):
                np.testing.assert_array_equal(g[:n], w)
                assert np.isfinite(g).all()
