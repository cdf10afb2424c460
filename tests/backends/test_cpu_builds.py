"""The CPU kernels' claims on every build class: native, x86-64-v4, x86-64-v3, portable.

Users' CPUs differ, and `-march=native` compiles different code on each (AVX-512 with and
without FP16 or VNNI, AVX2-only: 8-wide vectors, F16C converts, no integer dot products;
and the optimizer's choices, which follow the tuning). Each test here takes the
`cpu_build` fixture (tests/cpu_builds.py), so the same tolerances and the same
bit-identities are checked on each build this host can run; a build it cannot run is
skipped with the flags it lacks.

The portable build (`-march=x86-64`: no AVX, FMA or F16C macro, every x86 intrinsic branch
off) runs the branches an aarch64 build compiles (test_cpu_cross_compile.py checks that it
does). Differences from aarch64 left untested: the half type (`_Float16` here, `__fp16`
there; both IEEE binary16), prefetch instructions, 128-bit SSE2 instead of NEON registers,
no FMA contraction (aarch64 fuses multiply-adds), and the optimizer (that build is -O0).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_cpu_kernels import _shared_prefix_case
from test_xla_quantized import D as qz_D
from test_xla_quantized import _close as q_close
from test_xla_quantized import random_cache

from kernels_pallas.mla_decode import reference as mla_ref
from kernels_pallas.paged_attention import reference as paged_ref
from kvjax import attention
from kvjax.backends import cpu
from kvjax.backends.cpu import matmul as cpu_matmul
from kvjax.cache import quantized as qz

# The kernels compute in float32, as the references do; only the summation order differs:
# float32 outputs agree to F32_TOL. A bf16 output is that float32 result rounded to bf16,
# so the two may round to neighbouring bf16 values: at most one bf16 ulp apart, 2^-7 of
# the value at most, on top of the float32 difference.
F32_TOL, BF16_ULP = 2e-5, 2.0**-7


def _close_out(got, want, dtype):
    """Outputs of one dtype within the float32 bound (plus one bf16 ulp for bf16)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    rtol = F32_TOL if dtype == jnp.float32 else F32_TOL + BF16_ULP
    np.testing.assert_allclose(got, want, rtol=rtol, atol=F32_TOL)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim,page_size",
                         [(32, 8, 128, 16), (8, 1, 64, 7), (6, 2, 40, 16)])
def test_paged_decode(rng, cpu_build, dtype, q_heads, kv_heads, head_dim, page_size):
    batch, max_pages = 3, 6
    num_pages = batch * max_pages + 2
    tables = rng.permutation(num_pages)[: batch * max_pages].reshape(batch, max_pages)
    lengths = np.array([1, max_pages * page_size, 2 * page_size + 5])

    def draw(*shape):
        return jnp.asarray(rng.standard_normal(shape), dtype)

    args = (draw(batch, q_heads, head_dim), draw(kv_heads, num_pages, page_size, head_dim),
            draw(kv_heads, num_pages, page_size, head_dim), jnp.asarray(lengths, jnp.int32),
            jnp.asarray(tables, jnp.int32))
    got = cpu.paged_decode_attention(*args)
    want = jax.jit(paged_ref.paged_decode_attention)(*args)
    _close_out(got[0], want[0], dtype)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=F32_TOL,
                               atol=F32_TOL)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim,page_size",
                         [(4, 2, 32, 16), (8, 1, 128, 8)], ids=["gqa2-d32", "mqa8-d128-ps8"])
def test_shared_pages_give_the_same_bits(rng, cpu_build, cpu_options, dtype, q_heads,
                                         kv_heads, head_dim, page_size):
    """Sequences that begin on the same pages, read together there (runs: their query rows
    in one block of up to 8 x 2 rows, against blocks of 2 or 8 rows alone), give the same
    bits as each read alone, on this build."""
    args = _shared_prefix_case(rng, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                               page_size=page_size, dtype=dtype)
    run_of, _ = cpu.shared_runs(np.asarray(args[3]), np.asarray(args[4]), page_size=page_size,
                                group=q_heads // kv_heads, kv_heads=kv_heads, share=16)
    assert np.sum(run_of >= 0) >= 4, run_of  # runs formed, or this checks nothing
    outs = []
    for share in (0, 16):
        cpu_options(share=share)
        outs.append(cpu.paged_decode_attention(*args))
    want = jax.jit(paged_ref.paged_decode_attention)(*args)
    _close_out(outs[0][0], want[0], dtype)
    for a, b in zip(outs[0], outs[1], strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_paged_prefill(rng, cpu_build, dtype):
    """The prefill kernel's register blocks and softmax on this build: GQA 2, a head dim
    that is not a multiple of the vector width, chunks crossing key blocks and pages, a
    window on one call."""
    batch, q_heads, kv_heads, head_dim, ps, max_pages, q_len = 2, 4, 2, 40, 16, 8, 70
    num_pages = batch * max_pages
    tables = rng.permutation(num_pages).reshape(batch, max_pages)
    lengths = jnp.asarray([100, 70], jnp.int32)
    q_lengths = jnp.asarray([70, 61], jnp.int32)

    def draw(*shape):
        return jnp.asarray(rng.standard_normal(shape), dtype)

    args = (draw(batch, q_len, q_heads, head_dim), draw(kv_heads, num_pages, ps, head_dim),
            draw(kv_heads, num_pages, ps, head_dim), lengths, jnp.asarray(tables, jnp.int32),
            q_lengths)
    for kw in ({}, dict(sliding_window=30)):
        got = cpu.paged_prefill_attention(*args, item_rows=24, **kw)
        want = jax.jit(functools.partial(paged_ref.paged_prefill_attention, **kw))(*args)
        _close_out(got[0], want[0], dtype)
        np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=F32_TOL,
                                   atol=F32_TOL)


@pytest.mark.slow
@pytest.mark.parametrize("x_dtype,w_dtype", [(jnp.float32, jnp.float32),
                                             (jnp.float32, jnp.bfloat16),
                                             (jnp.bfloat16, jnp.bfloat16)])
@pytest.mark.parametrize("rows", [1, 5, 8, 13, 32, 100])
def test_matmul(rng, cpu_build, x_dtype, w_dtype, rows):
    """Every register-block height of both builds (rows 1-8 one block, 13 and 32 several;
    100 rows the packed many-row path, row panels with a remainder), columns with a scalar
    tail, an odd K (a last weight row without a partner in the bf16 pair tiles); against
    float64 (float32 sums of K products; a bf16 result adds half a bf16 ulp)."""
    k, n = 201, 1000 + 13
    x = jnp.asarray(rng.standard_normal((rows, k)), x_dtype)
    w = jnp.asarray(rng.standard_normal((k, n)), w_dtype)
    got = cpu_matmul.matmul(x, w)
    assert got.dtype == x.dtype
    got = np.asarray(got.astype(jnp.float32), np.float64)
    xf = np.asarray(x.astype(jnp.float32), np.float64)
    wf = np.asarray(w.astype(jnp.float32), np.float64)
    want = xf @ wf
    tol = 1e-5 * (np.abs(xf) @ np.abs(wf)) + (2.0**-8 * np.abs(want) if x_dtype == jnp.bfloat16
                                              else 0.0)
    assert np.all(np.abs(got - want) <= tol)


def test_choices_follow_the_build(cpu_build):
    """The AVX-512 and AVX2 builds take every attention kernel (measured faster than the
    XLA path on both, float32 and bf16 pages). The portable build was never measured:
    "auto" keeps the XLA path, except the 16-bit in-place writes."""
    lib = cpu.library()
    # The kernels of this build are what runs: a fresh trace names its library's target
    # (a jitted function traced under another build would keep that build's).
    q, pages = jnp.ones((1, 2, 32), jnp.float32), jnp.ones((1, 2, 16, 32), jnp.float32)
    text = jax.jit(lambda *a: cpu.paged_decode_attention(*a)).lower(
        q, pages, pages, jnp.ones((1,), jnp.int32), jnp.zeros((1, 2), jnp.int32)).as_text()
    assert lib.target("paged_decode") in text
    ops = ("paged_decode", "paged_prefill", "quantized_decode", "mla_decode")
    if lib.isa_class in ("avx2", "avx512"):
        for op in ops:
            for dtype in (jnp.float32, jnp.bfloat16):
                assert cpu.choose(op, dtype=dtype).use_kernel, (op, dtype)
    else:
        for op in (*ops, "matmul"):
            assert not cpu.choose(op, dtype=jnp.bfloat16).use_kernel, op
        assert cpu.choose("write_rows", dtype=jnp.bfloat16).use_kernel


def test_quantized_decode_scalar_rows(rng, cpu_build):
    """KIVI int4 with head dim 32 / group 8 (the scalar dequantizer), lengths at the page
    and tail edges, one layer and whole pools: equal to the reference."""
    cache = random_cache(rng, bits=4, q_heads=8, kv_heads=2)
    q = jnp.asarray(rng.standard_normal((cache.spec.max_seqs, 8, qz_D)), jnp.float32)

    def run(view, impl):
        return jax.jit(lambda q, v: attention.quantized_decode_attention(q, v, impl=impl))(
            q, view)

    want = run(qz.layer_view(cache, 0), "reference")
    q_close(run(qz.layer_view(cache, 0), "cpu"), want, 2e-5)
    q_close(run(qz.layer_view(cache, 0, whole_pools=True), "cpu"), want, 2e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_mla_decode(rng, cpu_build, dtype):
    batch, heads, dc, dr, ps, max_pages, num_pages = 4, 8, 64, 16, 16, 4, 14
    lengths = jnp.asarray([0, 1, max_pages * ps, 23], jnp.int32)
    tables = jnp.asarray(rng.integers(0, num_pages, (batch, max_pages)), jnp.int32)

    def draw(*shape):
        return jnp.asarray(rng.standard_normal(shape), dtype)

    args = (draw(batch, heads, dc), draw(batch, heads, dr), draw(num_pages, ps, dc),
            draw(num_pages, ps, dr), lengths, tables)
    want = jax.jit(functools.partial(mla_ref.mla_decode_attention, scale=0.1))(*args)
    got = cpu.mla_decode_attention(*args, scale=0.1)
    _close_out(got[0], want[0], dtype)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=F32_TOL,
                               atol=F32_TOL)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_write_rows_and_copy_pages(rng, cpu_build, dtype):
    """The in-place 16-bit writes equal XLA's scatters (indices out of range dropped)."""
    pool = jnp.asarray(rng.standard_normal((2, 2, 6, 4, 16)), dtype)
    i1, i2 = jnp.asarray([0, 5, 6, 2], jnp.int32), jnp.asarray([3, 4, 1, 0], jnp.int32)
    x = jnp.asarray(rng.standard_normal((4, 2, 16)), dtype)
    want = pool.at[1, :, i1, i2, :].set(x, mode="drop")
    got = cpu.write_rows(pool, 1, i1, i2, x)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    src, dst = jnp.asarray([0, 1, 2], jnp.int32), jnp.asarray([3, 6, 5], jnp.int32)
    want = pool.at[:, :, dst].set(pool[:, :, src], mode="drop")
    got = cpu.copy_pages(pool, src, dst)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
