"""Peer check: kvjax's TPU paged kernel vs jax's own `pallas.ops.tpu.paged_attention`.

Both run in the TPU interpreter on the same bf16 inputs and layout
([kv_heads, pages, page_size, head_dim] pools, [batch, pages_per_sequence]
page indices). jax's kernel applies no 1/sqrt(head_dim) scale, so its query
is scaled first (in float32, then rounded to bf16 for both kernels); it reads
whole compute blocks of page indices, so every table entry is a valid page
here. It returns no log-sum-exp: outputs are compared at bf16 tolerance.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as jax_paged
from kernel_cases import gqa_case, interpreted

from kernels_pallas.paged_attention import tpu
from kernels_pallas.paged_attention.block_sizes import BlockSizes


@pytest.mark.parametrize("q_heads,kv_heads,page_size", [(8, 2, 16), (4, 4, 8)])
def test_tpu_kernel_agrees_with_jax_paged_attention(rng, q_heads, kv_heads, page_size):
    head_dim, max_pages, pages_per_block = 128, 4, 2
    lengths = [1, page_size + 1, max_pages * page_size, 2 * page_size - 1]
    q, k, v, lengths, tables = gqa_case(
        rng, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, page_size=page_size,
        max_pages=max_pages, dtype=jnp.bfloat16, lengths=lengths,
    )
    # Edited on the host (no eager program per op); numpy's bfloat16 rounds to nearest
    # even as XLA's convert does.
    num_pages = k.shape[1]
    tables = np.asarray(tables)
    tables = jax.device_put(np.where((tables >= 0) & (tables < num_pages), tables, 0))
    scale = head_dim ** -0.5
    q = jax.device_put((np.asarray(q, np.float32) * np.float32(scale)).astype(jnp.bfloat16))

    ours, _ = interpreted(
        tpu.paged_decode_attention, q, k, v, lengths, tables, scale=1.0,
        block_sizes=BlockSizes(block_tokens=pages_per_block * page_size),
        interpret=tpu.interpret_params(),
    )
    # jax's kernel mixes float32 and bf16 operands internally.
    with pltpu.force_tpu_interpret_mode(tpu.interpret_params()), \
            jax.numpy_dtype_promotion("standard"):
        theirs = jax_paged(q, k, v, lengths, tables, pages_per_compute_block=pages_per_block)
    assert theirs.shape == ours.shape and theirs.dtype == ours.dtype
    np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(theirs, np.float32),
                               rtol=2e-2, atol=2e-2)
