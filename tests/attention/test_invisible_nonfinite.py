"""NaN and inf a sequence cannot see never reach its output, on every implementation.

A pool is shared: it holds other requests' pages, free pages, the unused rows
of each sequence's last page, and block-table entries past a length hold
anything. None of that is visible to a sequence, so NaN/inf written there
must leave its output bit-identical. Each test runs one implementation on
clean random pools, then twice more with NaN, +inf and -inf written into every
element not visible to (a) any row of the batch and (b) one chosen row — pages
of no sequence (page 0 among them), pages of the other sequences, rows past a
length, rows before a sliding window, the scales and zeros of such pages (and
fresh codes in them), the tail ring's unused slots, and with `layer=` the
other layers of the pools — and compares the outputs of the rows concerned
with the clean run's, bit for bit. Every implementation's clean run is also
checked against the reference, so a call that read the wrong data fails too.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.mla_decode import gpu as mla_gpu
from kernels_pallas.mla_decode import tpu as mla_tpu
from kernels_pallas.paged_attention import gpu as paged_gpu
from kernels_pallas.paged_attention import tpu as paged_tpu
from kernels_pallas.paged_attention.block_sizes import BlockSizes
from kernels_pallas.paged_attention.tpu import interpret_params
from kernels_pallas.quantized_attention import gpu as qgpu
from kernels_pallas.quantized_attention import reference as qref
from kernels_pallas.quantized_attention import tpu as qtpu
from kvjax import attention
from kvjax.attention import xla
from kvjax.attention import xla_quantized as xq
from kvjax.backends import cpu as cpu_backend

needs_cpu_kernel = pytest.mark.cpu_kernels

PS, MAX_PAGES = 8, 5  # full-precision pools
QPS, G, RING, QMAX_PAGES = 16, 8, 32, 4  # quantized pools
# f32: reorderings of float32 sums; bf16 outputs are bf16 (a couple of ulps).
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


# ---------------------------------------------------------------- layouts and poison


@functools.cache
def _jit(fn, **static):
    """`fn` with its static keyword arguments bound, jitted once per binding."""
    return jax.jit(functools.partial(fn, **static))


def _tpu(impl, fn, *args, **kw):
    """A TPU kernel in interpret mode: plain ("tpu") or the TPU interpreter, as one jitted
    program (called eagerly, the wrapper's reshapes and tail merge compile a program per
    op). The interpreter's callbacks run JAX ops while its kernel runs: ops dispatched
    after the kernel (the comparisons) could queue ahead of them and wait on the kernel
    for ever, so its result is ready before anything else is dispatched."""
    interpret = interpret_params() if impl == "tpu_interpreter" else True
    return jax.block_until_ready(_jit(fn, interpret=interpret, **kw)(*args))


def _dev(x, dtype=None):
    """A device array of host `x` (cast to `dtype` on the host): no conversion program."""
    x = np.asarray(x)
    return jax.device_put(x if dtype is None else x.astype(dtype))


def _tables(rng, lengths, page_size, max_pages):
    """Block tables over a pool whose page 0 no sequence owns, garbage past each length.

    The garbage mixes ids of live pages (other sequences'), page 0, negative and
    past-the-pool ids. Returns (tables int32[batch, max_pages] as numpy, num_pages).
    """
    used = -(-np.asarray(lengths) // page_size)
    num_pages = int(used.sum()) + 3
    perm = 1 + rng.permutation(num_pages - 1)
    shape = (len(lengths), max_pages)
    tables = np.where(rng.random(shape) < 0.5, rng.integers(0, num_pages, shape),
                      rng.choice([-7, num_pages, 10**6], shape))
    start = 0
    for b, n in enumerate(used):
        tables[b, :n] = perm[start:start + n]
        start += n
    return tables.astype(np.int32), num_pages


def _q_positions(lengths, q_lengths, q_len):
    t = np.arange(q_len)[None, :]
    return np.where(t < q_lengths[:, None], lengths[:, None] - q_lengths[:, None] + t, -1)


def _seen(q_pos, limit, num_keys, window):
    """bool [batch, num_keys]: key positions below `limit` that some query of the row sees."""
    k = np.arange(num_keys)[None, None, :]
    qp = np.asarray(q_pos)[:, :, None]
    vis = (qp >= 0) & (k <= qp) & (k < np.asarray(limit)[:, None, None])
    if window is not None:
        vis &= qp - k < window
    return vis.any(axis=1)


def _page_rows(tables, seen, rows, page_size, num_pages):
    """bool [num_pages, page_size]: the page rows holding a key seen by one of `rows`."""
    keep = np.zeros((num_pages, page_size), bool)
    for b in rows:
        k = np.nonzero(seen[b])[0]
        keep[tables[b, k // page_size], k % page_size] = True
    return keep


def _poison_host(rng, x, keep):
    """x (as a host array) with every element outside `keep` (broadcast to x's shape) NaN,
    +inf or -inf."""
    x = np.asarray(x)
    bad = rng.choice(np.array([np.nan, np.inf, -np.inf], np.float32), x.shape)
    y = np.where(np.broadcast_to(keep, x.shape), x.astype(np.float32), bad)
    return y.astype(x.dtype)


def _scramble_host(rng, codes, keep):
    """uint8 codes (as a host array) with every byte outside `keep` redrawn."""
    fresh = rng.integers(0, 256, codes.shape)
    return np.where(np.broadcast_to(keep, codes.shape), np.asarray(codes), fresh).astype(
        np.uint8)


def _poison(rng, x, keep):
    return _dev(_poison_host(rng, x, keep))


def _scramble(rng, codes, keep):
    return _dev(_scramble_host(rng, codes, keep))


def _victims(rng, batch, seen):
    """(all rows, one random row that sees some key) — the two poisonings' row sets."""
    live = np.nonzero(seen.any(axis=1))[0]
    return list(range(batch)), [int(rng.choice(live))]


def _junk(rng, x):
    """A host array like x of NaN/inf (floats) or random codes (uint8)."""
    if x.dtype == jnp.uint8:
        return _scramble_host(rng, x, np.zeros(x.shape, bool))
    return _poison_host(rng, x, np.zeros(x.shape, bool))


def _stack_layer(rng, pool, index=()):
    """[2, *pool.shape][index]: the real pool at layer 1, junk at layer 0 (stacked on the
    host)."""
    return _dev(np.stack([_junk(rng, pool), np.asarray(pool)])[index])


def _check_rows(clean, poisoned, rows, ref, tol):
    """The rows' outputs and lse are bit-identical to the clean run; clean matches ref."""
    def f32(x):
        return np.asarray(x).astype(np.float32)

    for got, want, r in zip(poisoned, clean, ref, strict=True):
        got, want = f32(got), f32(want)
        np.testing.assert_array_equal(got[rows], want[rows])
        np.testing.assert_allclose(want, f32(r), rtol=tol, atol=tol)
    out, lse = clean
    assert np.all(np.isfinite(f32(out)))
    assert not np.any(np.isnan(np.asarray(lse)))


def _edge_lengths(rng, page_size, max_pages):
    """0, 1, around a page boundary, a full table and a random length."""
    lengths = [0, 1, page_size - 1, page_size + 1, max_pages * page_size,
               int(rng.integers(2, max_pages * page_size))]
    return np.asarray(lengths, np.int32)


# ---------------------------------------------------------------- full-precision GQA


def _gqa_decode(impl, rng, q, k, v, lengths, tables, window, soft_cap):
    kw = dict(sliding_window=window, soft_cap=soft_cap)
    lengths, tables = _dev(lengths), _dev(tables)
    if impl in ("reference", "xla", "cpu"):
        return _jit(attention.paged_decode_attention, impl=impl, **kw)(q, k, v, lengths, tables)
    if impl == "xla_layer":
        return _jit(xla.paged_decode_attention, layer=1, block_tokens=2 * PS, **kw)(
            q, _stack_layer(rng, k), _stack_layer(rng, v), lengths, tables)
    if impl == "cpu_layer":
        return _jit(cpu_backend.paged_decode_attention, layer=1, **kw)(
            q, _stack_layer(rng, k), _stack_layer(rng, v), lengths, tables)
    if impl == "gpu":
        return _jit(paged_gpu.paged_decode_attention,
                    block_sizes=BlockSizes(block_tokens=16, num_splits=2), interpret=True, **kw)(
            q, k, v, lengths, tables)
    return _tpu(impl, paged_tpu.paged_decode_attention, q, k, v, lengths, tables,
                block_sizes=BlockSizes(block_tokens=2 * PS), **kw)


GQA_DECODE_IMPLS = [
    "reference", "xla", "xla_layer",
    pytest.param("cpu", marks=needs_cpu_kernel), pytest.param("cpu_layer", marks=needs_cpu_kernel),
    "tpu", "tpu_interpreter", "gpu",
]


@pytest.mark.slow
@pytest.mark.parametrize("impl", GQA_DECODE_IMPLS)
@pytest.mark.parametrize("dtype,window,soft_cap", [
    (jnp.float32, None, None), (jnp.bfloat16, 11, 4.0)])
def test_gqa_decode(rng, impl, dtype, window, soft_cap):
    kv_heads, q_heads, head_dim = 2, 4, 64
    lengths = _edge_lengths(rng, PS, MAX_PAGES)
    tables, num_pages = _tables(rng, lengths, PS, MAX_PAGES)

    def draw(*shape):
        return _dev(rng.standard_normal(shape).astype(np.float32), dtype)

    q = draw(len(lengths), q_heads, head_dim)
    k, v = (draw(kv_heads, num_pages, PS, head_dim) for _ in range(2))
    seen = _seen(_q_positions(lengths, np.minimum(lengths, 1), 1), lengths,
                 PS * MAX_PAGES, window)
    run = functools.partial(_gqa_decode, impl, rng, q, lengths=lengths, tables=tables,
                            window=window, soft_cap=soft_cap)
    clean = run(k=k, v=v)
    ref = _gqa_decode("reference", rng, q, k, v, lengths, tables, window, soft_cap)
    for rows in _victims(rng, len(lengths), seen):
        keep = _page_rows(tables, seen, rows, PS, num_pages)[None, :, :, None]
        poisoned = run(k=_poison(rng, k, keep), v=_poison(rng, v, keep))
        _check_rows(clean, poisoned, rows, ref, TOL[dtype])


@pytest.mark.slow
@pytest.mark.parametrize("impl", [
    "reference", "xla", "xla_layer", pytest.param("cpu", marks=needs_cpu_kernel),
    pytest.param("cpu_layer", marks=needs_cpu_kernel)])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (6, 3.0)])
def test_gqa_prefill(rng, impl, window, soft_cap):
    kv_heads, q_heads, head_dim, q_len = 2, 4, 32, 5
    lengths = _edge_lengths(rng, PS, MAX_PAGES)
    # An idle row (0 queries) beside a long one, chunks of 1 and of q_len.
    q_lengths = np.minimum(np.asarray([0, 1, 3, q_len, 0, 4]), lengths).astype(np.int32)
    tables, num_pages = _tables(rng, lengths, PS, MAX_PAGES)
    q = _dev(rng.standard_normal((len(lengths), q_len, q_heads, head_dim)), np.float32)
    k, v = (_dev(rng.standard_normal((kv_heads, num_pages, PS, head_dim)), np.float32)
            for _ in range(2))
    seen = _seen(_q_positions(lengths, q_lengths, q_len), lengths, PS * MAX_PAGES, window)
    kw = dict(sliding_window=window, soft_cap=soft_cap)
    args = (_dev(lengths), _dev(tables), _dev(q_lengths))

    def run(impl, k, v):
        if impl == "xla_layer":
            return _jit(xla.paged_prefill_attention, layer=1, block_tokens=2 * PS, **kw)(
                q, _stack_layer(rng, k), _stack_layer(rng, v), *args)
        if impl == "cpu_layer":
            return _jit(cpu_backend.paged_prefill_attention, layer=1, **kw)(
                q, _stack_layer(rng, k), _stack_layer(rng, v), *args)
        return _jit(attention.paged_prefill_attention, impl=impl, **kw)(q, k, v, *args)

    clean, ref = run(impl, k, v), run("reference", k, v)
    for rows in _victims(rng, len(lengths), seen):
        keep = _page_rows(tables, seen, rows, PS, num_pages)[None, :, :, None]
        _check_rows(clean, run(impl, _poison(rng, k, keep), _poison(rng, v, keep)), rows, ref,
                    TOL[jnp.float32])


# ---------------------------------------------------------------- full-precision MLA


def _mla_decode(impl, rng, ql, qr, lat, rope, lengths, tables, scale):
    lengths, tables = _dev(lengths), _dev(tables)
    if impl in ("reference", "xla", "cpu"):
        return _jit(attention.mla_decode_attention, scale=scale, impl=impl)(
            ql, qr, lat, rope, lengths, tables)
    if impl in ("xla_layer", "cpu_layer"):
        lat2, rope2 = (_stack_layer(rng, np.asarray(x)[None]) for x in (lat, rope))
        if impl == "xla_layer":
            fn = _jit(xla.mla_decode_attention, scale=scale, layer=1, block_tokens=2 * PS)
        else:
            fn = _jit(cpu_backend.mla_decode_attention, scale=scale, layer=1)
        return fn(ql, qr, lat2, rope2, lengths, tables)
    if impl == "gpu":
        return _jit(mla_gpu.mla_decode_attention, scale=scale, interpret=True,
                    block_sizes=BlockSizes(block_tokens=16, num_splits=2))(
            ql, qr, lat, rope, lengths, tables)
    return _tpu(impl, mla_tpu.mla_decode_attention, ql, qr, lat, rope, lengths, tables,
                scale=scale, block_sizes=BlockSizes(block_tokens=2 * PS))


@pytest.mark.parametrize("impl", GQA_DECODE_IMPLS)
def test_mla_decode(rng, impl):
    heads, d_c, d_rope, scale = 4, 64, 64, 0.1
    lengths = _edge_lengths(rng, PS, MAX_PAGES)
    tables, num_pages = _tables(rng, lengths, PS, MAX_PAGES)

    def draw(*shape):
        return _dev(rng.standard_normal(shape), np.float32)

    ql, qr = draw(len(lengths), heads, d_c), draw(len(lengths), heads, d_rope)
    lat, rope = draw(num_pages, PS, d_c), draw(num_pages, PS, d_rope)
    seen = _seen(_q_positions(lengths, np.minimum(lengths, 1), 1), lengths, PS * MAX_PAGES,
                 None)
    clean = _mla_decode(impl, rng, ql, qr, lat, rope, lengths, tables, scale)
    ref = _mla_decode("reference", rng, ql, qr, lat, rope, lengths, tables, scale)
    for rows in _victims(rng, len(lengths), seen):
        keep = _page_rows(tables, seen, rows, PS, num_pages)[:, :, None]
        poisoned = _mla_decode(impl, rng, ql, qr, _poison(rng, lat, keep),
                               _poison(rng, rope, keep), lengths, tables, scale)
        _check_rows(clean, poisoned, rows, ref, TOL[jnp.float32])


@pytest.mark.parametrize("impl", ["reference", "xla", "xla_layer"])
def test_mla_prefill(rng, impl):
    heads, d_c, d_rope, q_len, scale = 4, 32, 8, 4, 0.15
    lengths = _edge_lengths(rng, PS, MAX_PAGES)
    q_lengths = np.minimum(np.asarray([0, 1, 2, q_len, 3, 0]), lengths).astype(np.int32)
    tables, num_pages = _tables(rng, lengths, PS, MAX_PAGES)

    def draw(*shape):
        return _dev(rng.standard_normal(shape), np.float32)

    ql, qr = draw(len(lengths), q_len, heads, d_c), draw(len(lengths), q_len, heads, d_rope)
    lat, rope = draw(num_pages, PS, d_c), draw(num_pages, PS, d_rope)
    seen = _seen(_q_positions(lengths, q_lengths, q_len), lengths, PS * MAX_PAGES, None)
    args = (_dev(lengths), _dev(tables), _dev(q_lengths))

    def run(impl, lat, rope):
        if impl == "xla_layer":
            return _jit(xla.mla_prefill_attention, scale=scale, layer=1, block_tokens=2 * PS)(
                ql, qr, _stack_layer(rng, np.asarray(lat)[None]),
                _stack_layer(rng, np.asarray(rope)[None]), *args)
        return _jit(attention.mla_prefill_attention, scale=scale, impl=impl)(
            ql, qr, lat, rope, *args)

    clean, ref = run(impl, lat, rope), run("reference", lat, rope)
    for rows in _victims(rng, len(lengths), seen):
        keep = _page_rows(tables, seen, rows, PS, num_pages)[:, :, None]
        _check_rows(clean, run(impl, _poison(rng, lat, keep), _poison(rng, rope, keep)), rows,
                    ref, TOL[jnp.float32])


# ---------------------------------------------------------------- quantized (KIVI) pages


def _quant_rows(rng, q_len):
    """Quantized lengths Q (0, a partial page, whole pages, a full table), lengths L in
    [Q, Q + RING] and the query positions of `q_len`-query chunks (one idle row)."""
    quant = np.asarray([0, 0, QPS, QPS + 5, 2 * QPS, QMAX_PAGES * QPS])
    lengths = quant + rng.integers(0, RING + 1, len(quant))
    lengths[0] = 0
    lengths[1:] = np.maximum(lengths[1:], quant[1:] + 1)
    q_lengths = np.minimum(rng.integers(1, q_len + 1, len(quant)), lengths)
    q_lengths[-2] = 0
    return quant.astype(np.int32), lengths.astype(np.int32), _q_positions(lengths, q_lengths,
                                                                          q_len)


def _quant_pool(rng, lead, width, bits, grouping, scale_dtype):
    codes = rng.integers(0, 256, (*lead, QPS, width * bits // 8)).astype(np.uint8)
    shape = (*lead, QPS // G, width) if grouping == "tokens" else (*lead, QPS, width // G)
    scale = rng.uniform(0.5, 3.0, shape) / (2**bits - 1)
    zero = rng.uniform(-1.5, 0.0, shape)
    return (_dev(codes), _dev(scale.astype(np.float32), scale_dtype),
            _dev(zero.astype(np.float32), scale_dtype))


def _tail_keep(quant, lengths, seen, rows):
    """bool [batch, RING]: ring slots holding a position in [Q, L) seen by one of `rows`."""
    slot = np.arange(RING)[None, :]
    pos = quant[:, None] + np.mod(slot - quant[:, None], RING)
    keep = np.take_along_axis(seen, np.minimum(pos, seen.shape[1] - 1), axis=1)
    keep &= pos < lengths[:, None]
    mask = np.zeros(len(quant), bool)
    mask[rows] = True
    return keep & mask[:, None]


def _poison_quant(rng, codes, scale, zero, keep_rows, grouping):
    """Poisoned (codes, scale, zero) of pools `[..., pages, QPS, ...]` given the page rows to
    keep, `keep_rows` bool [pages, QPS] (a key scale is kept if any token of its group is)."""
    lead = (None,) * (codes.ndim - 3)
    codes = _scramble(rng, codes, keep_rows[lead + (Ellipsis, None)])
    if grouping == "tokens":
        keep = keep_rows.reshape(keep_rows.shape[0], QPS // G, G).any(axis=-1)
    else:
        keep = keep_rows
    keep = keep[lead + (Ellipsis, None)]
    return codes, _poison(rng, scale, keep), _poison(rng, zero, keep)


def _gqa_quant(impl, rng, args, kw):
    q, *pools = args[:7]
    rest = args[7:]
    if impl == "reference":
        return _jit(qref.quantized_attention, **kw)(*args)
    if impl == "xla":
        return _jit(xq.quantized_attention, **kw, block_tokens=QPS)(*args)
    if impl in ("xla_layer", "cpu_layer"):
        layered = tuple(_stack_layer(rng, p) for p in pools)
        fn = xq.quantized_attention if impl == "xla_layer" else cpu_backend.quantized_attention
        return _jit(fn, layer=1, **kw)(q, *layered, *rest)
    if impl == "cpu":
        return _jit(cpu_backend.quantized_attention, **kw)(*args)
    if impl == "gpu":
        return _jit(qgpu.quantized_attention, **kw, interpret=True,
                    block_sizes=BlockSizes(block_tokens=QPS, num_splits=2))(*args)
    return _tpu(impl, qtpu.quantized_attention, *args, **kw,
                block_sizes=BlockSizes(block_tokens=QPS))


_QUANT_CASES = [  # bits, head_dim, q_len, window, soft_cap, dtype, scale_dtype
    (4, 64, 1, None, None, jnp.float32, jnp.float16),
    (2, 64, 1, 21, 3.0, jnp.bfloat16, jnp.bfloat16),
    (8, 64, 3, 9, None, jnp.float32, jnp.float16),
]


# A `slow` sweep: by default a sample holding every implementation and every value
# of each case's fields (the interpreted TPU and GPU kernels cost 1.5-7 s a case).
@pytest.mark.slow
@pytest.mark.parametrize(
    "impl,bits,head_dim,q_len,window,soft_cap,dtype,scale_dtype",
    [pytest.param(impl, *case, marks=needs_cpu_kernel if impl.startswith("cpu") else ())
     for impl in ("reference", "xla", "xla_layer", "cpu", "cpu_layer", "tpu",
                  "tpu_interpreter", "gpu")
     for case in _QUANT_CASES
     if not (impl.startswith("cpu") and case[2] > 1)])  # the CPU kernel does decode only
def test_quantized(rng, impl, bits, head_dim, q_len, window, soft_cap, dtype,
                   scale_dtype):
    kv_heads, q_heads = 2, 4
    quant, lengths, q_pos = _quant_rows(rng, q_len)
    tables, num_pages = _tables(rng, quant, QPS, QMAX_PAGES)
    k = _quant_pool(rng, (kv_heads, num_pages), head_dim, bits, "tokens", scale_dtype)
    v = _quant_pool(rng, (kv_heads, num_pages), head_dim, bits, "channels", scale_dtype)
    batch = len(quant)

    def draw(*shape):
        return _dev(rng.standard_normal(shape).astype(np.float32), dtype)

    q = draw(batch, q_len, q_heads, head_dim)
    tail_k, tail_v = (draw(kv_heads, batch, RING, head_dim) for _ in range(2))
    ints = tuple(_dev(x, np.int32) for x in (quant, lengths, tables, q_pos))
    kw = dict(k_bits=bits, v_bits=bits, scale=head_dim**-0.5, soft_cap=soft_cap,
              sliding_window=window)
    clean = _gqa_quant(impl, rng, (q, *k, *v, tail_k, tail_v, *ints), kw)
    ref = _gqa_quant("reference", rng, (q, *k, *v, tail_k, tail_v, *ints), kw)
    seen = _seen(q_pos, lengths, QMAX_PAGES * QPS + RING, window)
    for rows in _victims(rng, batch, seen):
        keep = _page_rows(tables, seen[:, :QMAX_PAGES * QPS] & (
            np.arange(QMAX_PAGES * QPS)[None] < quant[:, None]), rows, QPS, num_pages)
        tail_keep = _tail_keep(quant, lengths, seen, rows)[None, :, :, None]
        args = (q, *_poison_quant(rng, *k, keep, "tokens"),
                *_poison_quant(rng, *v, keep, "channels"),
                _poison(rng, tail_k, tail_keep), _poison(rng, tail_v, tail_keep), *ints)
        _check_rows(clean, _gqa_quant(impl, rng, args, kw), rows, ref, TOL[dtype])


def _mla_quant(impl, rng, args, kw):
    if impl == "reference":
        return _jit(qref.quantized_mla_attention, **kw)(*args)
    if impl == "xla":
        return _jit(xq.quantized_mla_attention, **kw, block_tokens=QPS)(*args)
    if impl == "xla_layer":
        ql, qr, codes, scale, zero, rope, *rest = args
        layered = tuple(_stack_layer(rng, p, np.s_[:, None]) for p in (codes, scale, zero, rope))
        return _jit(xq.quantized_mla_attention, layer=1, rope_layer=1, block_tokens=QPS, **kw)(
            ql, qr, *layered, *rest)
    if impl == "gpu":
        return _jit(qgpu.quantized_mla_attention, **kw, interpret=True,
                    block_sizes=BlockSizes(block_tokens=QPS, num_splits=2))(*args)
    return _tpu(impl, qtpu.quantized_mla_attention, *args, **kw,
                block_sizes=BlockSizes(block_tokens=QPS))


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["reference", "xla", "xla_layer", "tpu", "tpu_interpreter",
                                  "gpu"])
@pytest.mark.parametrize("bits,q_len", [(4, 1), (2, 3)])
def test_quantized_mla(rng, impl, bits, q_len):
    heads, d_c, d_rope, scale = 4, 64, 64, 0.09
    quant, lengths, q_pos = _quant_rows(rng, q_len)
    tables, num_pages = _tables(rng, quant, QPS, QMAX_PAGES)
    c = _quant_pool(rng, (num_pages,), d_c, bits, "channels", jnp.float16)
    batch = len(quant)

    def draw(*shape):
        return _dev(rng.standard_normal(shape), np.float32)

    ql, qr = draw(batch, q_len, heads, d_c), draw(batch, q_len, heads, d_rope)
    rope = draw(num_pages, QPS, d_rope)
    tail_c, tail_r = draw(batch, RING, d_c), draw(batch, RING, d_rope)
    ints = tuple(_dev(x, np.int32) for x in (quant, lengths, tables, q_pos))
    kw = dict(bits=bits, scale=scale)
    clean = _mla_quant(impl, rng, (ql, qr, *c, rope, tail_c, tail_r, *ints), kw)
    ref = _mla_quant("reference", rng, (ql, qr, *c, rope, tail_c, tail_r, *ints), kw)
    seen = _seen(q_pos, lengths, QMAX_PAGES * QPS + RING, None)
    for rows in _victims(rng, batch, seen):
        keep = _page_rows(tables, seen[:, :QMAX_PAGES * QPS] & (
            np.arange(QMAX_PAGES * QPS)[None] < quant[:, None]), rows, QPS, num_pages)
        tail_keep = _tail_keep(quant, lengths, seen, rows)[:, :, None]
        args = (ql, qr, *_poison_quant(rng, *c, keep, "channels"),
                _poison(rng, rope, keep[:, :, None]), _poison(rng, tail_c, tail_keep),
                _poison(rng, tail_r, tail_keep), *ints)
        _check_rows(clean, _mla_quant(impl, rng, args, kw), rows, ref, TOL[jnp.float32])


def test_poison_reaches_every_invisible_element(rng):
    """The helpers poison what no row sees (page 0, rows past a length, rows before a
    window, other rows' pages, unused ring slots) and nothing a row sees."""
    lengths = np.asarray([0, 3, PS + 2], np.int32)
    tables, num_pages = _tables(rng, lengths, PS, 3)
    seen = _seen(_q_positions(lengths, np.minimum(lengths, 1), 1), lengths, 3 * PS, 4)
    keep = _page_rows(tables, seen, [2], PS, num_pages)
    # Row 2 sees positions PS-2 .. PS+1: the last two rows of its first page, two of its second.
    assert keep.sum() == 4 and not keep[0].any()
    assert keep[tables[2, 0], PS - 2:].all() and keep[tables[2, 1], :2].all()
    x = _dev(rng.standard_normal((1, num_pages, PS, 4)) + 5.0, np.float32)
    y = np.asarray(_poison(rng, x, keep[None, :, :, None]))
    assert np.isfinite(y).sum() == 4 * 4 and np.all(y[np.isfinite(y)] > 0)
    quant = np.asarray([0, 16, 16])
    lens = np.asarray([5, 20, 16])
    q_pos = _q_positions(lens, np.minimum(lens, 1), 1)
    s = _seen(q_pos, lens, 64, None)
    tk = _tail_keep(quant, lens, s, [0, 1, 2])
    # Row 0: slots 0..4 hold positions 0..4; row 1: slots 16..19; row 2: no tail.
    assert tk[0].sum() == 5 and tk[0, :5].all()
    assert tk[1].sum() == 4 and tk[1, 16:20].all()
    assert not tk[2].any()
