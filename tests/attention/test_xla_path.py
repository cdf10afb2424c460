"""The XLA path of paged attention against the gather reference.

Tolerances: float32 inputs agree with the float32 reference to 1e-5 (both compute
in f32; only the summation order differs); bf16 inputs give bf16 outputs, so they
agree to a couple of bf16 ulps (2e-2 relative), while their float32 lse agrees to
1e-5 (same bf16 values, f32 arithmetic).

Compiling is most of these tests' time on CPU: each test runs the XLA path and its
reference in one jitted program (`_run`; the reference eagerly would compile each of its
ops for each new shape), and inputs are made on the host and sent with `jax.device_put`
(`jnp.asarray` of a NumPy array compiles a `stage` program per shape).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hlo_written import materialised, written

from kernels_pallas.mla_decode import reference as mla_ref
from kernels_pallas.paged_attention import reference as paged_ref
from kvjax.attention import (
    mla_decode_attention,
    mla_prefill_attention,
    paged_decode_attention,
    paged_prefill_attention,
    registry,
    xla,
)
from kvjax.backends.cpu import options as cpu_options

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def _call(fn, **kw):
    """A hashable `(fn, kw)` for `_run`."""
    return fn, tuple(kw.items())


@functools.partial(jax.jit, static_argnames="calls")
def _run(*args, calls):
    """`fn(*args, **kw)` for each `_call(fn, **kw)` of `calls`, in one program."""
    return tuple(fn(*args, **dict(kw)) for fn, kw in calls)


def _host(rng, shape, dtype):
    """Fresh normal values as a device array of `dtype`, cast on the host (no program)."""
    return jax.device_put(rng.standard_normal(shape).astype(dtype))


def _lengths_for(page_size, max_pages, batch, rng):
    """A mixed batch: 0, 1, ps-1, ps, ps+1, max, then random lengths."""
    max_tokens = page_size * max_pages
    edge = [0, 1, page_size - 1, page_size, page_size + 1, max_tokens]
    edge = [x for x in edge if 0 <= x <= max_tokens]
    extra = rng.integers(0, max_tokens + 1, size=max(0, batch - len(edge))).tolist()
    return np.asarray((edge + extra)[:batch], np.int32)


def _tables(lengths, page_size, max_pages, num_pages, rng):
    """Randomly permuted page assignments; entries a sequence does not use hold garbage."""
    batch = len(lengths)
    tables = rng.permutation(num_pages)[: batch * max_pages].reshape(batch, max_pages)
    used = np.arange(max_pages)[None, :] * page_size < lengths[:, None]
    garbage = rng.integers(-(10**6), 10**6, size=tables.shape)
    return np.where(used, tables, garbage).astype(np.int32)


def _case(rng, *, batch, q_heads, kv_heads, head_dim, page_size, max_pages, dtype, q_len=None,
          lengths=None):
    num_pages = batch * max_pages + 3
    if lengths is None:
        lengths = _lengths_for(page_size, max_pages, batch, rng)
    tables = _tables(lengths, page_size, max_pages, num_pages, rng)
    q_shape = (batch, q_heads, head_dim) if q_len is None else (batch, q_len, q_heads, head_dim)
    q = _host(rng, q_shape, dtype)
    k = _host(rng, (kv_heads, num_pages, page_size, head_dim), dtype)
    v = _host(rng, (kv_heads, num_pages, page_size, head_dim), dtype)
    return q, k, v, jax.device_put(lengths), jax.device_put(tables)


def _close(got, want, dtype):
    (o, lse), (o_ref, lse_ref) = got, want
    assert o.dtype == o_ref.dtype and o.shape == o_ref.shape
    tol = TOL[dtype]
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_ref, np.float32),
                               rtol=tol, atol=tol)
    # lse is float32 in both and -inf exactly where a row sees nothing.
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_ref), rtol=1e-5, atol=1e-5)


# GQA ratio 1 (MHA), 2, 4, 8 and MQA, each page size and dtype at least once (the full
# product adds compile time, not coverage: the ratio only changes the folded row count). A
# `slow` sweep: the default run takes a sample holding every value of each argument.
@pytest.mark.slow
@pytest.mark.parametrize("q_heads,kv_heads,page_size,dtype", [
    (4, 4, 8, jnp.float32),
    (4, 2, 16, jnp.float32),
    (8, 2, 32, jnp.float32),
    (16, 2, 8, jnp.float32),
    (8, 1, 16, jnp.float32),
    (4, 4, 32, jnp.bfloat16),
    (8, 2, 8, jnp.bfloat16),
    (16, 2, 16, jnp.bfloat16),
    (8, 1, 32, jnp.bfloat16),
])
def test_decode_matches_reference(rng, q_heads, kv_heads, page_size, dtype):
    case = _case(rng, batch=7, q_heads=q_heads, kv_heads=kv_heads, head_dim=32,
                 page_size=page_size, max_pages=5, dtype=dtype)
    got, want = _run(*case, calls=(_call(paged_decode_attention, impl="xla"),
                                   _call(paged_decode_attention, impl="reference")))
    _close(got, want, dtype)


@pytest.mark.parametrize("block_tokens", [1, 24, 1000])
def test_decode_block_sizes(rng, block_tokens):
    # Blocks smaller than a page, not dividing the table, and larger than the table.
    case = _case(rng, batch=6, q_heads=8, kv_heads=2, head_dim=16, page_size=8, max_pages=7,
                 dtype=jnp.float32)
    got = xla.paged_decode_attention(*case, block_tokens=block_tokens)
    want, = _run(*case, calls=(_call(paged_ref.paged_decode_attention),))  # one program for all
    _close(got, want, jnp.float32)


@pytest.mark.parametrize("soft_cap,sliding_window", [(2.0, None), (None, 1), (None, 13),
                                                     (3.0, 5)])
def test_decode_soft_cap_and_window(rng, soft_cap, sliding_window):
    case = _case(rng, batch=6, q_heads=8, kv_heads=2, head_dim=16, page_size=8, max_pages=6,
                 dtype=jnp.float32)
    kw = dict(soft_cap=soft_cap, sliding_window=sliding_window)
    got, want = _run(*case, calls=(_call(xla.paged_decode_attention, block_tokens=8, **kw),
                                   _call(paged_ref.paged_decode_attention, **kw)))
    _close(got, want, jnp.float32)


def test_decode_all_rows_empty(rng):
    case = _case(rng, batch=3, q_heads=4, kv_heads=2, head_dim=16, page_size=8, max_pages=3,
                 dtype=jnp.float32, lengths=np.zeros(3, np.int32))
    (out, lse), = _run(*case, calls=(_call(paged_decode_attention, impl="xla"),))
    np.testing.assert_array_equal(np.asarray(out), 0.0)
    assert np.all(np.isneginf(np.asarray(lse)))


def test_unused_pages_are_never_read(rng):
    # Every page no sequence uses is NaN: reading one (even with zero weight) would leak NaN.
    q, k, v, lengths, tables = _case(rng, batch=5, q_heads=8, kv_heads=2, head_dim=16,
                                     page_size=8, max_pages=6, dtype=jnp.float32)
    lengths_np, tables_np = np.asarray(lengths), np.asarray(tables)
    used = np.arange(6)[None, :] * 8 < lengths_np[:, None]
    live = set(tables_np[used].tolist()) | {0}  # dead entries read page 0 (masked), as the ref
    dead = np.array([p not in live for p in range(k.shape[1])])
    k = jax.device_put(np.where(dead[None, :, None, None], np.nan, np.asarray(k)))
    v = jax.device_put(np.where(dead[None, :, None, None], np.nan, np.asarray(v)))
    (out, lse), want = _run(q, k, v, lengths, tables, calls=(
        _call(xla.paged_decode_attention, block_tokens=16),
        _call(paged_ref.paged_decode_attention)))
    assert np.all(np.isfinite(np.asarray(out)))
    _close((out, lse), want, jnp.float32)


@pytest.mark.parametrize("dtype,sliding_window,soft_cap", [
    (jnp.float32, None, None), (jnp.bfloat16, None, None), (jnp.float32, 4, 2.5)])
def test_prefill_matches_reference(rng, dtype, sliding_window, soft_cap):
    q, k, v, lengths, tables = _case(rng, batch=6, q_heads=8, kv_heads=2, head_dim=16,
                                     page_size=8, max_pages=5, dtype=dtype, q_len=6)
    # Chunks of 0 (idle row), 1, the whole row, and random sizes, never past the row's length.
    q_lengths = np.minimum(np.asarray([0, 1, 6, 3, 5, 2]), np.asarray(lengths)).astype(np.int32)
    kw = dict(sliding_window=sliding_window, soft_cap=soft_cap)
    args = (q, k, v, lengths, tables, jax.device_put(q_lengths))
    got, want = _run(*args, calls=(_call(paged_prefill_attention, impl="xla", **kw),
                                   _call(paged_prefill_attention, impl="reference", **kw)))
    _close(got, want, dtype)


def _mla_case(rng, dtype, q_len=None, batch=6, heads=4, d_c=32, d_rope=8, page_size=8,
              max_pages=5):
    num_pages = batch * max_pages + 2
    lengths = _lengths_for(page_size, max_pages, batch, rng)
    tables = _tables(lengths, page_size, max_pages, num_pages, rng)
    lead = (batch, heads) if q_len is None else (batch, q_len, heads)
    ql = _host(rng, (*lead, d_c), dtype)
    qr = _host(rng, (*lead, d_rope), dtype)
    lat = _host(rng, (num_pages, page_size, d_c), dtype)
    rope = _host(rng, (num_pages, page_size, d_rope), dtype)
    return ql, qr, lat, rope, jax.device_put(lengths), jax.device_put(tables)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_mla_decode_matches_reference(rng, dtype):
    case = _mla_case(rng, dtype)
    got, want, got_small_blocks, want_ref = _run(*case, calls=(
        _call(mla_decode_attention, scale=0.15, impl="xla"),
        _call(mla_decode_attention, scale=0.15, impl="reference"),
        _call(xla.mla_decode_attention, scale=0.15, block_tokens=8),
        _call(mla_ref.mla_decode_attention, scale=0.15)))
    _close(got, want, dtype)
    _close(got_small_blocks, want_ref, dtype)


def test_mla_prefill_matches_reference(rng):
    ql, qr, lat, rope, lengths, tables = _mla_case(rng, jnp.float32, q_len=4)
    q_lengths = jax.device_put(np.minimum([0, 1, 4, 2, 3, 4], np.asarray(lengths)).astype(np.int32))
    args = (ql, qr, lat, rope, lengths, tables, q_lengths)
    got, want = _run(*args, calls=(_call(mla_prefill_attention, scale=0.2, impl="xla"),
                                   _call(mla_prefill_attention, scale=0.2, impl="reference")))
    _close(got, want, jnp.float32)


def test_auto_is_xla_on_cpu(monkeypatch):
    assert jax.default_backend() == "cpu"
    # Without the C++ CPU kernels, which "auto" prefers where an op has one
    # (tests/attention/test_cpu_kernel.py).
    with cpu_options.override(kernels=False):
        for op in ("paged_decode_attention", "paged_prefill_attention",
                   "mla_decode_attention", "mla_prefill_attention"):
            assert registry.auto_impl(op) == "xla"
            assert registry.resolve(op, "auto")[0] is getattr(xla, op)
            assert registry.resolve(op, "reference")[0] is not getattr(xla, op)




def _no_gather_case(dtype):
    batch, kv_heads, head_dim, page_size, max_pages = 4, 2, 32, 8, 32
    rng = np.random.default_rng(0)
    args = _case(rng, batch=batch, q_heads=8, kv_heads=kv_heads, head_dim=head_dim,
                 page_size=page_size, max_pages=max_pages, dtype=dtype,
                 lengths=np.full(batch, page_size * max_pages, np.int32))
    gathered = batch * kv_heads * max_pages * page_size * head_dim
    return args, gathered, page_size


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_no_gathered_copy_of_the_sequence(dtype):
    args, gathered, page_size = _no_gather_case(dtype)
    pool = int(np.prod(args[1].shape))
    assert pool > gathered
    # The check can fail: the reference materialises exactly that gathered copy.
    assert max(n for *_, n in materialised(paged_ref.paged_decode_attention, *args)) >= gathered
    written = materialised(
        lambda *a: xla.paged_decode_attention(*a, block_tokens=2 * page_size), *args)
    # Neither a gathered copy of the sequences nor a converted copy of the pool (XLA:CPU
    # hoists a bf16 pool's f32 conversion out of the loop unless prevented).
    assert max(n for *_, n in written) <= gathered // 8, written


def _scan_layers(attend, q, pools, num_layers):
    """Runs `attend(x, pools, layer)` for each layer in a jitted scan (a traced layer)."""

    def run(q, pools):
        def body(x, layer):
            return attend(x, pools, layer).astype(x.dtype), None

        return jax.lax.scan(body, q, jnp.arange(num_layers))[0]

    return jax.jit(run)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_layer_of_whole_pools(rng, dtype):
    """layer=... on a cache's whole pools: equals the reference on that layer's slice,
    and a scan over layers never copies a layer's pool (nor converts the pools)."""
    layers = 3
    q, k, v, lengths, tables = _case(rng, batch=4, q_heads=8, kv_heads=2, head_dim=16,
                                     page_size=8, max_pages=6, dtype=dtype)
    k_all = _host(rng, (layers, *k.shape), dtype)
    v_all = _host(rng, (layers, *v.shape), dtype)
    calls = tuple(_call(paged_decode_attention, impl=impl, layer=layer)
                  for layer in range(layers) for impl in ("xla", "reference"))
    each = _run(q, k_all, v_all, lengths, tables, calls=calls)
    for layer in range(layers):
        got, want = each[2 * layer:2 * layer + 2]
        _close(got, want, dtype)

    def attend(impl):
        return lambda x, pools, layer: paged_decode_attention(
            x, *pools, lengths, tables, impl=impl, layer=layer)[0]

    run_xla = _scan_layers(attend("xla"), q, (k_all, v_all), layers)
    run_ref = _scan_layers(attend("reference"), q, (k_all, v_all), layers)
    # `materialised` of the XLA scan, compiled once: the same executable then runs.
    xla_scan = jax.jit(lambda q, k, v: run_xla(q, (k, v))).lower(q, k_all, v_all).compile()
    tol = TOL[dtype]
    np.testing.assert_allclose(np.asarray(xla_scan(q, k_all, v_all), np.float32),
                               np.asarray(run_ref(q, (k_all, v_all)), np.float32),
                               rtol=tol, atol=tol)
    layer_pool = int(np.prod(k.shape))
    stored = written(xla_scan.as_text())
    assert max(n for *_, n in stored) < layer_pool, stored


def _flipped_first(x, axis):
    """Layers [flip(x, axis), x] (on the host): the pools of 2 layers, x the second."""
    x = np.asarray(x)
    return jax.device_put(np.stack([np.flip(x, axis), x]))


def test_prefill_and_mla_layer_of_whole_pools(rng):
    layer = 1  # of 2 layers
    q, k, v, lengths, tables = _case(rng, batch=4, q_heads=4, kv_heads=2, head_dim=16,
                                     page_size=8, max_pages=4, dtype=jnp.float32, q_len=3)
    q_lengths = jax.device_put(np.minimum([3, 1, 2, 3], np.asarray(lengths)).astype(np.int32))

    k_all = _flipped_first(k, 1)
    v_all = _flipped_first(v, 1)

    @jax.jit
    def gqa(q, k, v, k_all, v_all, lengths, tables, q_lengths, layer):
        return (paged_prefill_attention(q, k_all, v_all, lengths, tables, q_lengths,
                                        impl="xla", layer=layer),
                paged_ref.paged_prefill_attention(q, k, v, lengths, tables, q_lengths))

    got, want = gqa(q, k, v, k_all, v_all, lengths, tables, q_lengths, jnp.int32(layer))
    _close(got, want, jnp.float32)

    ql, qr, lat, rope, lengths, tables = _mla_case(rng, jnp.float32)
    lat_all = _flipped_first(lat, 0)[:, None]  # [layers, 1, pages, ps, d_c]
    rope_all = _flipped_first(rope, 0)[:, None]

    @jax.jit
    def mla(ql, qr, lat, rope, lat_all, rope_all, lengths, tables):
        return (mla_decode_attention(ql, qr, lat_all, rope_all, lengths, tables, scale=0.2,
                                     impl="xla", layer=layer),
                mla_ref.mla_decode_attention(ql, qr, lat, rope, lengths, tables, scale=0.2))

    got, want = mla(ql, qr, lat, rope, lat_all, rope_all, lengths, tables)
    _close(got, want, jnp.float32)
    with pytest.raises(ValueError, match="whole pools"):
        mla_decode_attention(ql, qr, lat, rope, lengths, tables, scale=0.2, layer=0)
