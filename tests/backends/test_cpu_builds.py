"""The AVX2 build (-march=haswell) beside the native one: the same results.

Users' CPUs differ (AVX2-only machines run other code paths than an AVX-512 one: no
VNNI integer paths, 8-wide vectors, F16C converts). On an x86 machine with AVX-512 the
kernels are also built for Haswell and checked against the references here, so both
paths are tested wherever the suite runs; on an AVX2-only machine the native build is
the AVX2 build (a second one would compile the same code paths again: ~2.5 CPU-minutes).
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.paged_attention import reference as paged_ref
from kvjax.backends import cpu
from kvjax.backends.cpu import matmul as cpu_matmul


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((ln for ln in text.splitlines() if ln.startswith("flags")), "").split())


MARCHES = ["native"] + (["haswell"] if {"avx2", "fma", "f16c", "avx512f"} <= _cpu_flags()
                        else [])


@pytest.fixture(params=MARCHES)
def march(request, cpu_options):
    cpu_options(march=request.param)
    if not cpu.available():
        pytest.skip(f"-march={request.param} build unavailable: {cpu.unavailable_reason()}")
    lib = cpu.library()
    if request.param == "haswell":
        assert lib.isa_class == "avx2" and "avx512f" not in lib.isa
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


@pytest.mark.parametrize("w_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 8, 13, 32])
def test_matmul(rng, march, w_dtype, rows):
    """Every register-block height of both builds (rows 1-8 one block, 13 and 32 several),
    columns with a scalar tail; against float64 (float32 sums of K products)."""
    k, n = 200, 1000 + 13
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((k, n)), w_dtype)
    got = np.asarray(jax.jit(cpu_matmul.matmul)(x, w), np.float64)
    xf, wf = np.asarray(x, np.float64), np.asarray(w.astype(jnp.float32), np.float64)
    tol = 1e-5 * (np.abs(xf) @ np.abs(wf))
    assert np.all(np.abs(got - xf @ wf) <= tol)


def test_choices_follow_the_build(march):
    """The AVX2 build's choices are its own: MLA over float32 pages, measured slower than
    XLA there, is not picked; paged and KIVI decode are."""
    lib = cpu.library()
    assert cpu.choose("paged_decode").use_kernel
    if lib.isa_class == "avx2":
        assert cpu.choose("quantized_decode").use_kernel
        assert not cpu.choose("mla_decode", dtype=jnp.float32).use_kernel
        assert cpu.choose("mla_decode", dtype=jnp.bfloat16).use_kernel
    elif lib.isa_class == "avx512":
        assert cpu.choose("quantized_decode").use_kernel
        assert cpu.choose("mla_decode", dtype=jnp.float32).use_kernel
