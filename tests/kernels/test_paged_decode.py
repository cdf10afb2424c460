"""Paged GQA/MQA/MHA decode kernels vs the jnp reference.

Every kernel runs on CPU: the GPU (Triton) kernel in Pallas' plain interpret
mode; the TPU kernel in plain interpret mode and in the TPU interpreter
(`pltpu.InterpretParams`: uninitialised VMEM is NaN, out-of-bounds reads raise,
DMAs and semaphores are simulated), which proves the kernel never reads a
page it did not copy and never indexes past a buffer.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from kernel_cases import (
    assert_close,
    gqa_case,
    gqa_ratios,
    interpreted,
    native_flavours,
    ref_decode,
)

from kernels_pallas.paged_attention import gpu, tpu
from kernels_pallas.paged_attention.block_sizes import BlockSizes

MAX_PAGES = 5


def run_kernel(kernel, *args, block_pages=None, num_splits=None, **kwargs):
    """Calls one kernel flavour; `block_pages` pages per inner step (None: defaults)."""
    page_size = args[1].shape[2]
    bs = None
    if block_pages is not None or num_splits is not None:
        bs = BlockSizes(block_tokens=(block_pages or 1) * page_size, num_splits=num_splits)
    if kernel == "gpu_native":
        return gpu.paged_decode_attention(*args, block_sizes=bs, **kwargs)
    if kernel == "tpu_native":
        return tpu.paged_decode_attention(*args, block_sizes=bs, **kwargs)
    # Interpreted flavours run as one jitted program (see interpreted()): the wrapper's
    # folding and split merge compile with the kernel instead of op by op.
    fn = gpu.paged_decode_attention if kernel == "gpu" else tpu.paged_decode_attention
    interpret = tpu.interpret_params() if kernel == "tpu_interpreter" else True
    return interpreted(fn, *args, block_sizes=bs, interpret=interpret, **kwargs)


# (ratio, head_dim, page_size, dtype, block_pages, num_splits): every ratio, head_dim,
# page size and dtype appears; blocks of 2 and 4 pages make several double-buffered steps
# per sequence; None keeps the defaults (one block for this short table on TPU).
CI_CASES = [
    ("mha", 64, 8, jnp.float32, 2, None),
    ("gqa2", 128, 16, jnp.float32, None, None),
    ("gqa4", 64, 32, jnp.float32, 2, 2),
    ("gqa8", 128, 8, jnp.float32, 4, None),
    ("mqa", 64, 16, jnp.bfloat16, 2, 3),
    ("gqa2", 128, 32, jnp.bfloat16, None, None),
]
# The TPU interpreter is slow (milliseconds per grid step and DMA): a small product.
INTERPRETER_CASES = [
    ("gqa2", 64, 8, jnp.float32, 2, None),
    ("mqa", 128, 16, jnp.bfloat16, 2, None),
    ("gqa8", 64, 32, jnp.float32, None, None),
]


def _check(rng, kernel, ratio, head_dim, page_size, dtype, block_pages, num_splits):
    q_heads, kv_heads = gqa_ratios()[ratio]
    args = gqa_case(rng, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                    page_size=page_size, max_pages=MAX_PAGES, dtype=dtype)
    got = run_kernel(kernel, *args, block_pages=block_pages, num_splits=num_splits)
    assert_close(got, ref_decode(*args), dtype)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["tpu", "gpu", *native_flavours()])
@pytest.mark.parametrize("ratio,head_dim,page_size,dtype,block_pages,num_splits", CI_CASES)
def test_kernel_matches_reference(rng, kernel, ratio, head_dim, page_size, dtype, block_pages,
                                  num_splits):
    _check(rng, kernel, ratio, head_dim, page_size, dtype, block_pages, num_splits)


@pytest.mark.parametrize("ratio,head_dim,page_size,dtype,block_pages,num_splits",
                         INTERPRETER_CASES)
def test_tpu_kernel_in_tpu_interpreter(rng, ratio, head_dim, page_size, dtype, block_pages,
                                       num_splits):
    _check(rng, "tpu_interpreter", ratio, head_dim, page_size, dtype, block_pages, num_splits)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["tpu", "gpu", "tpu_interpreter"])
@pytest.mark.parametrize(
    "ratio,head_dim,page_size,dtype",
    list(itertools.product(["mha", "gqa2", "gqa4", "gqa8", "mqa"], [64, 128], [8, 16, 32],
                           [jnp.float32, jnp.bfloat16])),
)
def test_kernel_sweep(rng, kernel, ratio, head_dim, page_size, dtype):
    _check(rng, kernel, ratio, head_dim, page_size, dtype, 2, None)


@pytest.mark.parametrize("kernel", ["tpu", "gpu", "tpu_interpreter", *native_flavours()])
def test_sliding_window_soft_cap_and_scale(rng, kernel):
    args = gqa_case(rng, q_heads=4, kv_heads=2, head_dim=64, page_size=8, max_pages=6,
                    dtype=jnp.float32, lengths=[1, 20, 48, 33, 7])
    opts = dict(scale=0.3, soft_cap=2.5, sliding_window=13)
    got = run_kernel(kernel, *args, block_pages=2, num_splits=2, **opts)
    assert_close(got, ref_decode(*args, **opts), jnp.float32)


@pytest.mark.parametrize("kernel", ["tpu", "gpu", "tpu_interpreter", *native_flavours()])
def test_empty_sequences_give_zero_and_neg_inf(rng, kernel):
    args = gqa_case(rng, q_heads=4, kv_heads=2, head_dim=64, page_size=8, max_pages=3,
                    dtype=jnp.float32, lengths=[0, 9, 0])
    out, lse = run_kernel(kernel, *args, block_pages=2)
    assert_close((out, lse), ref_decode(*args), jnp.float32)
    assert np.all(np.asarray(out)[[0, 2]] == 0.0)
    assert np.all(np.isneginf(np.asarray(lse)[[0, 2]]))


@pytest.mark.parametrize("kernel", ["tpu", "gpu", *native_flavours()])
def test_float32_queries_over_bf16_pages(rng, kernel):
    # A float32 model over a bf16 cache (the models upcast q): the kernels mix the two
    # under strict dtype promotion (the tests' setting) as on the device.
    q, k, v, lengths, tables = gqa_case(rng, q_heads=8, kv_heads=2, head_dim=64, page_size=8,
                                        max_pages=4, dtype=jnp.bfloat16)
    q = jax.device_put((np.asarray(q, np.float32) + rng.standard_normal(q.shape) * 1e-2)
                       .astype(np.float32))  # on the host: no eager program per op
    out, lse = run_kernel(kernel, q, k, v, lengths, tables, block_pages=2)
    assert out.dtype == jnp.float32
    assert_close((out, lse), ref_decode(q, k, v, lengths, tables), jnp.bfloat16)


def _small(rng, head_dim=64, page_size=8, max_pages=3):
    return gqa_case(rng, q_heads=4, kv_heads=2, head_dim=head_dim, page_size=page_size,
                    max_pages=max_pages, dtype=jnp.float32, lengths=[3, 9])


@pytest.fixture
def no_kernel_tracing(monkeypatch):
    """Fails the test if a kernel is traced: shape errors must come first."""
    def boom(*args, **kwargs):
        raise AssertionError("pallas_call reached before the shape check")
    monkeypatch.setattr(pl, "pallas_call", boom)


@pytest.mark.parametrize("module", [tpu, gpu], ids=["tpu", "gpu"])
@pytest.mark.parametrize("head_dim", [96, 48])
def test_unsupported_head_dim_raises(rng, no_kernel_tracing, module, head_dim):
    with pytest.raises(ValueError, match=rf"head_dim = {head_dim} is not supported"):
        module.paged_decode_attention(*_small(rng, head_dim=head_dim), interpret=True)


@pytest.mark.parametrize("module", [tpu, gpu], ids=["tpu", "gpu"])
def test_table_wider_than_declared_max_raises(rng, no_kernel_tracing, module):
    with pytest.raises(ValueError, match=r"3 columns, wider than the declared max_pages=2"):
        module.paged_decode_attention(*_small(rng), max_pages=2, interpret=True)


@pytest.mark.parametrize("module", [tpu, gpu], ids=["tpu", "gpu"])
def test_page_size_not_dividing_block_raises(rng, no_kernel_tracing, module):
    with pytest.raises(ValueError, match=r"page_size 8 does not divide block_tokens 12"):
        module.paged_decode_attention(*_small(rng), block_sizes=BlockSizes(block_tokens=12),
                                      interpret=True)


def test_gpu_block_must_be_power_of_two_pages(rng, no_kernel_tracing):
    with pytest.raises(ValueError, match=r"24 / 8 = 3"):
        gpu.paged_decode_attention(*_small(rng), block_sizes=BlockSizes(block_tokens=24),
                                   interpret=True)


def test_gpu_page_size_must_be_power_of_two(rng, no_kernel_tracing):
    with pytest.raises(ValueError, match=r"power-of-two page_size, got 12"):
        gpu.paged_decode_attention(*_small(rng, page_size=12), interpret=True)


def test_tpu_table_larger_than_smem_raises(rng, no_kernel_tracing):
    q, k, v, lengths, _ = _small(rng)
    # Built on the host: no eager program per op.
    q, lengths, tables = jax.device_put((np.tile(np.asarray(q), (64, 1, 1))[:128],
                                         np.ones((128,), np.int32),
                                         np.zeros((128, 1024), np.int32)))
    with pytest.raises(ValueError, match=r"keeps the table in SMEM"):
        tpu.paged_decode_attention(q, k, v, lengths, tables, interpret=True)


@pytest.mark.parametrize(
    "kwargs,match",
    [(dict(block_tokens=0), "block_tokens"), (dict(block_tokens=8, num_splits=0), "num_splits"),
     (dict(block_tokens=8, num_warps=3), "num_warps"),
     (dict(block_tokens=8, num_stages=0), "num_stages"),
     (dict(block_tokens=8, block_heads=8), "block_heads"),
     (dict(block_tokens=8, block_heads=24), "block_heads")],
)
def test_block_sizes_validate_themselves(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BlockSizes(**kwargs)


def test_gpu_block_below_dot_minimum_raises(rng, no_kernel_tracing):
    with pytest.raises(ValueError, match=r"at least 16"):
        gpu.paged_decode_attention(*_small(rng), block_sizes=BlockSizes(block_tokens=8),
                                   interpret=True)


@pytest.mark.parametrize(
    "backend,page_size,max_pages,rows,want",
    [("tpu", 16, 100, 1, 512), ("tpu", 16, 3, 1, 48), ("tpu", 1024, 4, 1, 1024),
     ("tpu", 16, 100, 128, 256), ("tpu", 64, 100, 1024, 64),
     ("gpu", 16, 100, 1, 64), ("gpu", 8, 1, 1, 16), ("gpu", 16, 3, 1, 64),
     ("gpu", 128, 2, 1, 128)],
)
def test_default_block_sizes_fit_the_table(backend, page_size, max_pages, rows, want):
    from kernels_pallas.paged_attention.block_sizes import default_block_sizes

    bs = default_block_sizes(backend, page_size, max_pages, rows)
    assert bs.block_tokens == want and bs.block_tokens % page_size == 0


def test_gpu_group_wider_than_block_heads(rng):
    """A group of 32 query heads runs as two 16-head programs per KV head and split."""
    args = gqa_case(rng, q_heads=64, kv_heads=2, head_dim=64, page_size=16, max_pages=3,
                    dtype=jnp.float32)
    got = run_kernel("gpu", *args, block_pages=1, num_splits=2)
    assert_close(got, ref_decode(*args), jnp.float32)
