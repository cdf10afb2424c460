"""The kernels lower for real TPUs and GPUs, checked on a CPU-only machine.

`jax.export` for platform "tpu" runs Pallas' Mosaic lowering and for "cuda"
its Triton lowering, both in Python: unsupported primitives, non-power-of-two
Triton blocks, bad block specs or scratch shapes fail here. What is left for
hardware is the backend compilers' own passes (Mosaic layout, ptxas).

Lowering asks the device for its kind; on CPU the fixtures name one (a one-core
"TPU v5 lite", an "NVIDIA H100") through jax's abstract-device hook. Triton custom
calls carry no export-compatibility guarantee, so that safety check is disabled:
nothing is serialised for later use.
"""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax import export

from kernels_pallas.mla_decode import gpu as mla_gpu
from kernels_pallas.mla_decode import tpu as mla_tpu
from kernels_pallas.paged_attention import gpu, tpu
from tests.kernels.kernel_cases import triton_export

S = jax.ShapeDtypeStruct
BATCH, PAGES, MAX_PAGES = 4, 64, 8


def _gqa_args(dtype, page_size, q_heads=32, kv_heads=8, head_dim=128):
    return (S((BATCH, q_heads, head_dim), dtype),
            S((kv_heads, PAGES, page_size, head_dim), dtype),
            S((kv_heads, PAGES, page_size, head_dim), dtype),
            S((BATCH,), jnp.int32), S((BATCH, MAX_PAGES), jnp.int32))


def _mla_args(dtype, page_size, q_heads=128, d_c=512, d_rope=64):  # DeepSeek-V3 widths
    return (S((BATCH, q_heads, d_c), dtype), S((BATCH, q_heads, d_rope), dtype),
            S((PAGES, page_size, d_c), dtype), S((PAGES, page_size, d_rope), dtype),
            S((BATCH,), jnp.int32), S((BATCH, MAX_PAGES), jnp.int32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("op", ["gqa", "mla"])
def test_tpu_kernels_lower_to_mosaic(pretend_tpu_v5e, op, dtype):
    if op == "gqa":
        fn, args = tpu.paged_decode_attention, _gqa_args(dtype, 16)
    else:
        fn, args = functools.partial(mla_tpu.mla_decode_attention, scale=0.1), _mla_args(dtype, 16)
    module = export.export(jax.jit(fn), platforms=["tpu"])(*args).mlir_module()
    assert module.count("tpu_custom_call") == 1


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("op", ["gqa", "mla"])
def test_gpu_kernels_lower_to_triton(pretend_h100, op, dtype):
    if op == "gqa":
        fn, args = gpu.paged_decode_attention, _gqa_args(dtype, 16)
    else:
        fn, args = functools.partial(mla_gpu.mla_decode_attention, scale=0.1), _mla_args(dtype, 16)
    module, target = triton_export(fn, *args)
    assert module.count(target) == 1
