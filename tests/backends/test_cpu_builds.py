"""Other builds beside the native one: the AVX2 build and the portable one, same results.

Users' CPUs differ (AVX2-only machines run other code paths than an AVX-512 one: no
VNNI integer paths, 8-wide vectors, F16C converts). On an x86 machine with AVX-512 the
kernels are also built for Haswell and checked against the references here, so both
paths are tested wherever the suite runs; on an AVX2-only machine the native build is
the AVX2 build (a second one would compile the same code paths again: ~2.5 CPU-minutes).

On x86 the kernels are also built for generic x86-64 (`-march=x86-64`: no AVX, FMA or
F16C macro, so every x86 intrinsic branch is off): the portable branches, the code an
aarch64 build compiles (test_cpu_cross_compile.py checks that it does), run and are
compared with the references here. Differences from aarch64 left untested: the half type
(`_Float16` here, `__fp16` there; both IEEE binary16), prefetch instructions, 128-bit SSE2
instead of NEON registers, no FMA contraction (aarch64 fuses multiply-adds), and the
optimizer: that build is compiled at -O0 (~18 CPU-seconds; -O1 took 33, -O3 ~100), and the
Haswell one at -O1 (30 CPU-seconds; -O3 55): they test what the source computes on those
paths, not what -O3 makes of it.
"""

import dataclasses
import functools
import os
import platform
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_cpu_kernels import _vector_case
from test_xla_quantized import D as qz_D
from test_xla_quantized import _close as q_close
from test_xla_quantized import random_cache

from kernels_pallas.mla_decode import reference as mla_ref
from kernels_pallas.paged_attention import reference as paged_ref
from kernels_pallas.quantized_attention import reference as qref
from kvjax import attention
from kvjax.backends import cpu
from kvjax.backends.cpu import build
from kvjax.backends.cpu import matmul as cpu_matmul
from kvjax.cache import quantized as qz


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((ln for ln in text.splitlines() if ln.startswith("flags")), "").split())


PORTABLE = "x86-64"
MARCHES = (["native"]
           + (["haswell"] if {"avx2", "fma", "f16c", "avx512f"} <= _cpu_flags() else [])
           + ([PORTABLE] if platform.machine().lower() in ("x86_64", "amd64") else []))
# An extra build's tests are one heavy unit (see conftest.py): they run on the same day, which
# compiles that build once.
_MARCH_PARAMS = [pytest.param(m, marks=pytest.mark.heavy(unit=f"-march={m} build"), id=m)
                 if m != "native" else m for m in MARCHES]


# The extra builds' optimization levels (see above; the native build stays at -O3).
_EXTRA_OPT = {"haswell": "-O1", PORTABLE: "-O0"}


@pytest.fixture(scope="module")
def extra_builds(tmp_path_factory):
    """A library cache holding the extra builds, compiled on first use at `_EXTRA_OPT`'s
    level and put where the loader looks for the `-march=...` build of these options."""
    cache_dir = str(tmp_path_factory.mktemp("kvjax-extra-builds"))
    built = set()

    def get(march):
        opts = dataclasses.replace(cpu.get_options(), march=march, cache_dir=cache_dir)
        if march not in built:
            if build._resolve(opts.compiler) is None:
                pytest.skip(f"no C++ compiler {opts.compiler!r}")
            path = build.library_path(opts)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
                lib = build.compile_sources(opts.compiler, march, Path(tmp),
                                            opt=_EXTRA_OPT[march])
                os.replace(lib, path)
            built.add(march)
        return cache_dir

    return get


@pytest.fixture(params=_MARCH_PARAMS)
def march(request, cpu_options):
    if request.param in _EXTRA_OPT:
        cpu_options(march=request.param,
                    cache_dir=request.getfixturevalue("extra_builds")(request.param))
        assert cpu.available(), cpu.unavailable_reason()
    else:
        cpu_options(march=request.param)
        if not cpu.available():
            pytest.skip(f"-march={request.param} build unavailable: {cpu.unavailable_reason()}")
    lib = cpu.library()
    if request.param == "haswell":
        assert lib.isa_class == "avx2" and "avx512f" not in lib.isa
    if request.param == PORTABLE:
        assert lib.isa_class == "portable" and not lib.isa
    return request.param


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim,page_size",
                         [(32, 8, 128, 16), (8, 1, 64, 7), (6, 2, 40, 16)])
def test_paged_decode(rng, march, dtype, q_heads, kv_heads, head_dim, page_size):
    batch, max_pages = 3, 6
    num_pages = batch * max_pages + 2
    tables = rng.permutation(num_pages)[: batch * max_pages].reshape(batch, max_pages)
    lengths = np.array([1, max_pages * page_size, 2 * page_size + 5])

    def draw(*shape):
        return jnp.asarray(rng.standard_normal(shape), dtype)

    args = (draw(batch, q_heads, head_dim), draw(kv_heads, num_pages, page_size, head_dim),
            draw(kv_heads, num_pages, page_size, head_dim), jnp.asarray(lengths, jnp.int32),
            jnp.asarray(tables, jnp.int32))
    got = jax.jit(cpu.paged_decode_attention)(*args)
    want = jax.jit(paged_ref.paged_decode_attention)(*args)
    tol = 2e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32),
                               rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_paged_prefill(rng, march, dtype):
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
    tol = 2e-5 if dtype == jnp.float32 else 1e-2
    for kw in ({}, dict(sliding_window=30)):
        got = cpu.paged_prefill_attention(*args, item_rows=24, **kw)
        want = jax.jit(functools.partial(paged_ref.paged_prefill_attention, **kw))(*args)
        np.testing.assert_allclose(np.asarray(got[0], np.float32),
                                   np.asarray(want[0], np.float32), rtol=tol, atol=tol)
        np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=2e-5,
                                   atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("w_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 8, 13, 32, 100])
def test_matmul(rng, march, w_dtype, rows):
    """Every register-block height of both builds (rows 1-8 one block, 13 and 32 several;
    100 rows the packed many-row path, row panels with a remainder), columns with a scalar
    tail; against float64 (float32 sums of K products)."""
    k, n = 200, 1000 + 13
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((k, n)), w_dtype)
    got = np.asarray(jax.jit(cpu_matmul.matmul)(x, w), np.float64)
    xf, wf = np.asarray(x, np.float64), np.asarray(w.astype(jnp.float32), np.float64)
    tol = 1e-5 * (np.abs(xf) @ np.abs(wf))
    assert np.all(np.abs(got - xf @ wf) <= tol)


def test_choices_follow_the_build(march):
    """The AVX-512 and AVX2 builds take every attention kernel (measured faster than the
    XLA path on both, float32 and bf16 pages). The portable build was never measured:
    "auto" keeps the XLA path, except the 16-bit in-place writes."""
    lib = cpu.library()
    ops = ("paged_decode", "paged_prefill", "quantized_decode", "mla_decode")
    if lib.isa_class in ("avx2", "avx512"):
        for op in ops:
            for dtype in (jnp.float32, jnp.bfloat16):
                assert cpu.choose(op, dtype=dtype).use_kernel, (op, dtype)
    else:
        for op in (*ops, "matmul"):
            assert not cpu.choose(op, dtype=jnp.bfloat16).use_kernel, op
        assert cpu.choose("write_rows", dtype=jnp.bfloat16).use_kernel


@pytest.mark.slow
@pytest.mark.parametrize("bits,head_dim,group,scale_dtype,q_heads", [
    (2, 64, 16, jnp.float16, 16), (4, 128, 32, jnp.bfloat16, 8), (8, 64, 16, jnp.float32, 2)])
def test_quantized_decode_vectorised(rng, march, bits, head_dim, group, scale_dtype, q_heads):
    """KIVI pages whose packed fields hold whole vectors (the vectorised dequantizer and
    the codes read in place), f16/bf16/f32 scales and tails, query rows in blocks of 8 and
    1: equal to the reference."""
    args, kw = _vector_case(rng, bits, head_dim, group, scale_dtype, q_heads)
    want = jax.jit(functools.partial(qref.quantized_attention, **kw))(*args)
    q_close(cpu.quantized_attention(*args, **kw), want, 2e-5)


def test_quantized_decode_scalar_rows(rng, march):
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
def test_mla_decode(rng, march, dtype):
    batch, heads, dc, dr, ps, max_pages, num_pages = 4, 8, 64, 16, 16, 4, 14
    lengths = jnp.asarray([0, 1, max_pages * ps, 23], jnp.int32)
    tables = jnp.asarray(rng.integers(0, num_pages, (batch, max_pages)), jnp.int32)

    def draw(*shape):
        return jnp.asarray(rng.standard_normal(shape), dtype)

    args = (draw(batch, heads, dc), draw(batch, heads, dr), draw(num_pages, ps, dc),
            draw(num_pages, ps, dr), lengths, tables)
    want = jax.jit(functools.partial(mla_ref.mla_decode_attention, scale=0.1))(*args)
    got = cpu.mla_decode_attention(*args, scale=0.1)
    tol = 2e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32),
                               rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_write_rows_and_copy_pages(rng, march, dtype):
    """The in-place 16-bit writes equal XLA's scatters (indices out of range dropped)."""
    pool = jnp.asarray(rng.standard_normal((2, 2, 6, 4, 16)), dtype)
    i1, i2 = jnp.asarray([0, 5, 6, 2], jnp.int32), jnp.asarray([3, 4, 1, 0], jnp.int32)
    x = jnp.asarray(rng.standard_normal((4, 2, 16)), dtype)
    want = pool.at[1, :, i1, i2, :].set(x, mode="drop")
    got = jax.jit(cpu.write_rows)(pool, 1, i1, i2, x)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    src, dst = jnp.asarray([0, 1, 2], jnp.int32), jnp.asarray([3, 6, 5], jnp.int32)
    want = pool.at[:, :, dst].set(pool[:, :, src], mode="drop")
    got = jax.jit(cpu.copy_pages)(pool, src, dst)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
