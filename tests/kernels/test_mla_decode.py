"""Absorbed-MLA decode kernels vs the absorbed reference and vs naive decompressed MLA.

The naive check builds per-head keys [c_KV W_UK, k_rope] and values c_KV W_UV
from random up-projections, runs ordinary multi-head attention in float64 on
the gathered tokens, and compares with the kernel's latent output mapped
through W_UV — the absorption identity the kernels rely on.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_cases import assert_close, interpreted, mla_case, native_flavours, ref_mla

from kernels_pallas.mla_decode import gpu, tpu
from kernels_pallas.paged_attention.block_sizes import BlockSizes
from kernels_pallas.paged_attention.tpu import interpret_params

MAX_PAGES = 3


def run_mla(kernel, *args, block_pages=None, num_splits=None, **kwargs):
    page_size = args[2].shape[1]
    bs = None
    if block_pages is not None or num_splits is not None:
        bs = BlockSizes(block_tokens=(block_pages or 1) * page_size, num_splits=num_splits)
    if kernel == "gpu_native":
        return gpu.mla_decode_attention(*args, block_sizes=bs, **kwargs)
    if kernel == "tpu_native":
        return tpu.mla_decode_attention(*args, block_sizes=bs, **kwargs)
    # Interpreted flavours run as one jitted program (see interpreted()).
    fn = gpu.mla_decode_attention if kernel == "gpu" else tpu.mla_decode_attention
    interpret = interpret_params() if kernel == "tpu_interpreter" else True
    return interpreted(fn, *args, block_sizes=bs, interpret=interpret, **kwargs)


# (kernel, q_heads, d_c, d_rope, page_size, dtype, block_pages, num_splits): page sizes
# 8, 16, 32 and 64 on each kernel family; the TPU interpreter on small shapes.
CI_CASES = [
    ("tpu", 4, 128, 64, 8, jnp.float32, 2, None),
    ("tpu", 16, 256, 64, 64, jnp.float32, None, None),
    ("tpu", 8, 128, 64, 32, jnp.bfloat16, 2, None),
    ("tpu_interpreter", 4, 128, 64, 16, jnp.float32, 2, None),
    ("tpu_interpreter", 8, 128, 64, 64, jnp.bfloat16, None, None),
    ("gpu", 4, 128, 64, 16, jnp.float32, 2, 2),
    ("gpu", 16, 256, 32, 64, jnp.float32, None, None),
    ("gpu", 8, 128, 64, 8, jnp.bfloat16, 2, None),
    ("gpu", 4, 128, 64, 32, jnp.float32, 1, 3),
    # 32 heads in blocks of 16: two programs per sequence and split, each re-reading pages.
    ("gpu", 32, 128, 64, 16, jnp.float32, 2, None),
]


def _check(rng, kernel, q_heads, d_c, d_rope, page_size, dtype, block_pages, num_splits):
    args = mla_case(rng, q_heads=q_heads, d_c=d_c, d_rope=d_rope, page_size=page_size,
                    max_pages=MAX_PAGES, dtype=dtype)
    scale = float(rng.uniform(0.05, 0.2))
    got = run_mla(kernel, *args, scale=scale, block_pages=block_pages, num_splits=num_splits)
    assert_close(got, ref_mla(*args, scale=scale), dtype)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kernel,q_heads,d_c,d_rope,page_size,dtype,block_pages,num_splits", CI_CASES
)
def test_mla_kernel_matches_absorbed_reference(rng, kernel, q_heads, d_c, d_rope, page_size,
                                               dtype, block_pages, num_splits):
    _check(rng, kernel, q_heads, d_c, d_rope, page_size, dtype, block_pages, num_splits)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kernel,page_size,dtype",
    list(itertools.product(["tpu", "gpu", "tpu_interpreter"], [8, 16, 32, 64],
                           [jnp.float32, jnp.bfloat16])),
)
def test_mla_kernel_sweep(rng, kernel, page_size, dtype):
    _check(rng, kernel, 8, 128, 64, page_size, dtype, 2, None)


def naive_mla(q_nope, q_rope, c_kv, k_rope, lengths, w_uk, w_uv, scale):
    """Decompressed MLA decode in float64 on dense tokens.

    q_nope [b, h, dn], q_rope [b, h, dr], c_kv [b, s, dc], k_rope [b, s, dr],
    w_uk [h, dc, dn], w_uv [h, dc, dv]. Returns (out [b, h, dv], lse [b, h]).
    """
    k_nope = np.einsum("bsc,hcn->bhsn", c_kv, w_uk)
    v = np.einsum("bsc,hcv->bhsv", c_kv, w_uv)
    logits = (np.einsum("bhn,bhsn->bhs", q_nope, k_nope)
              + np.einsum("bhr,bsr->bhs", q_rope, k_rope)) * scale
    mask = np.arange(c_kv.shape[1])[None, None, :] < lengths[:, None, None]
    logits = np.where(mask, logits, -np.inf)
    m = logits.max(-1, keepdims=True)
    p = np.exp(logits - m)
    lse = (m + np.log(p.sum(-1, keepdims=True)))[..., 0]
    out = np.einsum("bhs,bhsv->bhv", p / p.sum(-1, keepdims=True), v)
    return out, lse


@pytest.mark.parametrize("kernel", ["tpu", "gpu", "tpu_interpreter", *native_flavours()])
def test_mla_kernel_matches_naive_decompressed_attention(rng, kernel):
    q_heads, d_c, d_rope, d_nope, d_v, page_size = 4, 128, 64, 32, 48, 16
    args = mla_case(rng, q_heads=q_heads, d_c=d_c, d_rope=d_rope, page_size=page_size,
                    max_pages=MAX_PAGES, dtype=jnp.float32)
    _, q_rope, latent_pages, rope_pages, lengths, tables = args
    w_uk = rng.standard_normal((q_heads, d_c, d_nope)) / np.sqrt(d_c)
    w_uv = rng.standard_normal((q_heads, d_c, d_v)) / np.sqrt(d_c)
    q_nope = rng.standard_normal((len(lengths), q_heads, d_nope))
    scale = (d_nope + d_rope) ** -0.5

    # Absorb W_UK into the query; the kernel attends over the latent.
    q_latent = jax.device_put(np.einsum("bhn,hcn->bhc", q_nope, w_uk).astype(np.float32))
    out_latent, lse = run_mla(kernel, q_latent, q_rope, latent_pages, rope_pages, lengths,
                              tables, scale=scale, block_pages=2)
    out = np.einsum("bhc,hcv->bhv", np.asarray(out_latent, np.float64), w_uv)

    # Dense tokens of every sequence, gathered on the host from the used table entries.
    lengths_np, tables_np = np.asarray(lengths), np.asarray(tables)
    latent_np, rope_np = np.asarray(latent_pages), np.asarray(rope_pages)
    max_tokens = tables_np.shape[1] * page_size
    c_dense = np.zeros((len(lengths_np), max_tokens, d_c))
    r_dense = np.zeros((len(lengths_np), max_tokens, d_rope))
    for b, n in enumerate(lengths_np):
        for t in range(n):
            page = tables_np[b, t // page_size]
            c_dense[b, t] = latent_np[page, t % page_size]
            r_dense[b, t] = rope_np[page, t % page_size]
    want_out, want_lse = naive_mla(q_nope, np.asarray(q_rope, np.float64), c_dense, r_dense,
                                   lengths_np, w_uk, w_uv, scale)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("module", [tpu, gpu], ids=["tpu", "gpu"])
def test_mla_bad_shapes_raise(rng, module):
    args = mla_case(rng, q_heads=4, d_c=128, d_rope=64, page_size=8, max_pages=2,
                    dtype=jnp.float32, lengths=[3, 9])
    ql, qr, lp, rp, lengths, tables = args
    # Narrowed on the host: no eager program per slice.
    ql96, lp96, rp32 = (jax.device_put(np.asarray(x)[..., :n])
                        for x, n in ((ql, 96), (lp, 96), (rp, 32)))
    with pytest.raises(ValueError, match=r"d_c = 96 is not supported"):
        module.mla_decode_attention(ql96, qr, lp96, rp, lengths, tables,
                                    scale=0.1, interpret=True)
    with pytest.raises(ValueError, match=r"wider than the declared max_pages=1"):
        module.mla_decode_attention(*args, scale=0.1, max_pages=1, interpret=True)
    with pytest.raises(ValueError, match=r"page_size 8 does not divide block_tokens 20"):
        module.mla_decode_attention(*args, scale=0.1, block_sizes=BlockSizes(block_tokens=20),
                                    interpret=True)
    with pytest.raises(ValueError, match=r"must equal the query widths"):
        module.mla_decode_attention(ql, qr, lp, rp32, lengths, tables, scale=0.1,
                                    interpret=True)
