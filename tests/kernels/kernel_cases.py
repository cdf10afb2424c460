"""Random paged-attention inputs shared by the kernel tests.

Each case is a batch whose rows have the lengths that break paged kernels:
1, page_size - 1, page_size, page_size + 1 and a full table, with page ids
drawn from a random permutation of a pool larger than needed, and garbage in
every table entry past a row's length (negative and past-the-pool ids), which
a kernel must never use as an address.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.mla_decode import reference as mla_ref
from kernels_pallas.paged_attention import reference as paged_ref

# Output and lse tolerances by dtype: f32 kernels reorder sums only; bf16 kernels
# round the probabilities to bf16 before P @ V (about 2^-8 relative) and the
# output itself is bf16.
TOL = {
    jnp.float32: dict(out=dict(rtol=1e-5, atol=1e-5), lse=dict(rtol=1e-5, atol=1e-5)),
    jnp.bfloat16: dict(out=dict(rtol=2e-2, atol=2e-2), lse=dict(rtol=1e-4, atol=1e-4)),
}

ref_decode = jax.jit(
    paged_ref.paged_decode_attention, static_argnames=("scale", "soft_cap", "sliding_window")
)
ref_mla = jax.jit(mla_ref.mla_decode_attention, static_argnames=("scale",))


def interpreted(fn, *args, **static):
    """`fn(*args, **static)` as one jitted program, blocked until ready: the way to run a
    kernel under the TPU interpreter. The interpreter's callbacks run JAX ops while its
    kernel runs; called eagerly, ops dispatched after the kernel (a tail merge, the
    comparisons) can queue ahead of them and wait on the kernel for ever."""
    return jax.block_until_ready(jax.jit(functools.partial(fn, **static))(*args))


def edge_lengths(page_size: int, max_pages: int) -> list[int]:
    """The lengths at and around page boundaries, plus a full table."""
    return [1, page_size - 1, page_size, page_size + 1, max_pages * page_size]


def make_tables(rng, lengths, page_size, max_pages, spare_pages=3):
    """A block table of randomly permuted pool pages, garbage past each length.

    Returns (block_tables int32[batch, max_pages], num_pages).
    """
    lengths = np.asarray(lengths)
    used = -(-lengths // page_size)
    num_pages = int(used.sum()) + spare_pages
    perm = rng.permutation(num_pages)
    tables = rng.choice([-7, num_pages, 10**6], size=(len(lengths), max_pages))
    start = 0
    for b, n in enumerate(used):
        tables[b, :n] = perm[start:start + n]
        start += n
    return jax.device_put(tables.astype(np.int32)), num_pages


def gqa_case(rng, *, q_heads, kv_heads, head_dim, page_size, max_pages, dtype, lengths=None):
    """(q, k_pages, v_pages, lengths, block_tables) with fresh N(0, 1) values."""
    if lengths is None:
        lengths = edge_lengths(page_size, max_pages)
    tables, num_pages = make_tables(rng, lengths, page_size, max_pages)

    def draw(*shape):  # drawn on the host: no program per shape
        return jax.device_put(rng.standard_normal(shape).astype(np.float32).astype(dtype))

    q = draw(len(lengths), q_heads, head_dim)
    k = draw(kv_heads, num_pages, page_size, head_dim)
    v = draw(kv_heads, num_pages, page_size, head_dim)
    return q, k, v, jax.device_put(np.asarray(lengths, np.int32)), tables


def mla_case(rng, *, q_heads, d_c, d_rope, page_size, max_pages, dtype, lengths=None):
    """(q_latent, q_rope, latent_pages, rope_pages, lengths, block_tables)."""
    if lengths is None:
        lengths = edge_lengths(page_size, max_pages)
    tables, num_pages = make_tables(rng, lengths, page_size, max_pages)

    def draw(*shape):  # drawn on the host: no program per shape
        return jax.device_put(rng.standard_normal(shape).astype(np.float32).astype(dtype))

    batch = len(lengths)
    return (draw(batch, q_heads, d_c), draw(batch, q_heads, d_rope),
            draw(num_pages, page_size, d_c), draw(num_pages, page_size, d_rope),
            jax.device_put(np.asarray(lengths, np.int32)), tables)


def assert_close(got, want, dtype):
    """Compares (out, lse) pairs at the dtype's tolerance; -inf lse must match exactly."""
    (out, lse), (ref_out, ref_lse) = got, want
    assert out.dtype == ref_out.dtype and out.shape == ref_out.shape
    assert lse.dtype == jnp.float32 and lse.shape == ref_lse.shape
    tol = TOL[dtype]
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32),
                               **tol["out"])
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), **tol["lse"])


@functools.cache
def gqa_ratios():
    """(q_heads, kv_heads) for GQA ratios 1, 2, 4, 8 and MQA."""
    return {"mha": (4, 4), "gqa2": (4, 2), "gqa4": (8, 2), "gqa8": (16, 2), "mqa": (4, 1)}


def native_flavours():
    """Kernel flavours that run compiled on this backend (none on CPU), as pytest params.

    Run the suite with JAX_PLATFORMS=cuda (or tpu) on an accelerator to include them.
    """
    backend = jax.default_backend()
    return [
        pytest.param(f"{kind}_native", marks=pytest.mark.skipif(
            backend != kind, reason=f"needs a {kind.upper()} backend"))
        for kind in ("tpu", "gpu")
    ]


def triton_export(fn, *args) -> tuple[str, str]:
    """`fn(*args)` exported for CUDA: (its MLIR module text, the custom-call target Pallas'
    Triton kernels lower to). The target is jax's own name where jax names it (jax says it
    may change)."""
    from jax import export
    from jax.experimental.pallas import triton as plgpu

    target = getattr(plgpu, "CUSTOM_CALL_TARGET_NAME", "__gpu$xla.gpu.triton")
    exp = export.export(jax.jit(fn), platforms=["cuda"],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call(target)])(*args)
    return exp.mlir_module(), target
