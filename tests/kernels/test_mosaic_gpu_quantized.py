"""The Mosaic GPU KIVI decode kernel, checked on a CPU-only machine.

Correctness runs in Mosaic GPU's interpreter (simulated shared memory, TMA,
barriers and wgmma) with its race detector on, against the jnp reference, one
call per bit width on tiny shapes (the interpreter is slow): GQA 4, three rows
with ragged quantized lengths (none, mid-page, several pages ending mid-page)
and tails of every length class (empty, mid-ring, a full ring), pages drawn
from a permuted pool with garbage table entries past each row and NaN scales
on the pages no row owns. Inputs are bfloat16 queries and tails, random codes
over every byte value and float16 scales and zeros of realistic size.

Tolerance: the kernel rounds q times each key scale, the converted codes
(exact) and the scaled probabilities to bfloat16 for the tensor cores
(2^-9 relative each) and returns a bfloat16 output; the reference attends in
float32 from the same bfloat16 inputs. Logits of O(1-5) summed over 64-128
channels move by a few 1e-3 (3e-3 seen), hence lse atol 1e-2 and out
rtol = atol = 3e-2 (bf16 output rounding plus those logits). A wrong field, a
misplaced scale or zero, a mask or a page index moves them by O(0.1-1).

Lowering for an H100 from CPU runs the whole Mosaic GPU lowering at the
production shape (32/8 heads x 128, pages of 32 and 64) for each bit width,
and for 16-token key groups on 16-token pages and int2 at head_dim 64.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import _mosaic_gpu as mgpu
from kernels_pallas.quantized_attention import mosaic_gpu as qm
from kernels_pallas.quantized_attention import reference as qref

S = jax.ShapeDtypeStruct
# bits -> (head_dim, page_size, key group, value group): int4 with key groups and pages of
# 16 tokens (16-token logits and P V sub-blocks), int2 at head_dim 64 (16-byte code rows,
# copied and read untiled).
CASES = {8: (64, 32, 32, 32), 4: (64, 16, 16, 32), 2: (64, 64, 64, 32)}
KV_HEADS, Q_HEADS, MAX_PAGES = 1, 4, 4


@functools.partial(jax.jit, static_argnames=("k_bits", "v_bits", "scale"))
def _ref(q, *args, **static):
    """The reference on the same inputs, attending in float32 (the cast inside its program)."""
    return qref.quantized_attention(q.astype(jnp.float32), *args, **static)


@functools.partial(jax.jit, static_argnames=("bits", "scale"))
def _interpreted(*args, bits, scale):
    # One program per bit width for the kernel and its tail merge (eager, the merge would
    # compile a program per op).
    return qm.quantized_attention(*args, k_bits=bits, v_bits=bits, scale=scale,
                                  interpret=mgpu.interpret_params(detect_races=True))


def _inputs(bits):
    head_dim, page_size, group, v_group = CASES[bits]
    rng = np.random.default_rng(bits)
    ring = page_size
    quant = np.array([0, page_size + 5, 3 * page_size + 3], np.int32)
    tail = np.array([ring // 2, 0, ring])  # mid-ring, empty, a full ring
    lengths = (quant + tail).astype(np.int32)
    used = -(-quant // page_size)
    num_pages = int(used.sum()) + 2
    perm = rng.permutation(num_pages)
    tables = rng.choice([-3, num_pages, 10**6], size=(3, MAX_PAGES)).astype(np.int32)
    start = 0
    for b, n in enumerate(used):
        tables[b, :n] = perm[start:start + n]
        start += n
    dead = perm[start:]  # pages no row owns: NaN scales and zeros must not leak

    def pool(grouping):
        codes = rng.integers(0, 256, (KV_HEADS, num_pages, page_size, head_dim * bits // 8))
        shape = ((KV_HEADS, num_pages, page_size // group, head_dim) if grouping == "tokens"
                 else (KV_HEADS, num_pages, page_size, head_dim // v_group))
        scale = rng.uniform(0.5, 3.0, shape) / (2 ** bits - 1)
        zero = rng.uniform(-1.5, 0.0, shape)
        scale[:, dead] = np.nan
        zero[:, dead] = np.nan
        return codes.astype(np.uint8), scale.astype(np.float16), zero.astype(np.float16)

    def draw(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    q = draw(3, 1, Q_HEADS, head_dim).astype(jnp.bfloat16)
    tk = draw(KV_HEADS, 3, ring, head_dim).astype(jnp.bfloat16)
    tv = draw(KV_HEADS, 3, ring, head_dim).astype(jnp.bfloat16)
    q_pos = (lengths - 1)[:, None].astype(np.int32)
    return jax.device_put((q, *pool("tokens"), *pool("channels"), tk, tv, quant, lengths,
                           tables, q_pos))


@pytest.mark.parametrize("bits", sorted(CASES))
def test_interpreted_matches_reference(bits):
    args = _inputs(bits)
    scale = CASES[bits][0] ** -0.5
    mgpu.reset_interpreter()
    out, lse = jax.block_until_ready(_interpreted(*args, bits=bits, scale=scale))
    assert not mgpu.interpreter_races_found()
    ref_out, ref_lse = _ref(*args, k_bits=bits, v_bits=bits, scale=scale)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=0, atol=1e-2)
    np.testing.assert_allclose(np.asarray(out).astype(np.float32), np.asarray(ref_out),
                               rtol=3e-2, atol=3e-2)


def _pools(bits, page_size, *, batch=8, kv_heads=8, q_heads=32, head_dim=128, pages=4096,
           max_pages=512, group=32, v_group=32, q_len=1):
    packed = head_dim * bits // 8
    return (S((batch, q_len, q_heads, head_dim), jnp.bfloat16),
            S((kv_heads, pages, page_size, packed), jnp.uint8),
            S((kv_heads, pages, page_size // group, head_dim), jnp.float16),
            S((kv_heads, pages, page_size // group, head_dim), jnp.float16),
            S((kv_heads, pages, page_size, packed), jnp.uint8),
            S((kv_heads, pages, page_size, head_dim // v_group), jnp.float16),
            S((kv_heads, pages, page_size, head_dim // v_group), jnp.float16),
            S((batch,), jnp.int32), S((batch, max_pages), jnp.int32),
            S((batch, q_len), jnp.int32))


def test_unsupported_reason():
    def why(bits, page_size, **kw):
        return qm.unsupported_reason(*_pools(bits, page_size, **kw)[:7], k_bits=bits,
                                     v_bits=bits)

    for bits in (2, 4, 8):
        assert why(bits, 64) is None
    assert "q_len" in why(4, 64, q_len=2)
    assert why(4, 16, group=16) is None and why(2, 64, head_dim=64) is None
    assert "multiple of 16 tokens" in why(4, 16, group=8)
    assert "16 bytes" in why(2, 64, head_dim=64, v_group=8)
    with pytest.raises(ValueError, match="q_len"):
        qm.quantized_pages_attention(*_pools(4, 64, q_len=2), k_bits=4, v_bits=4, scale=0.1)


@pytest.mark.parametrize("bits,page_size,kw", [
    *((b, p, {}) for b in (8, 4, 2) for p in (32, 64)),
    (4, 16, dict(group=16)),  # 16-token key groups on 16-token pages
    (2, 64, dict(head_dim=64)),  # 16-byte code rows, untiled
])
def test_lowers_for_h100(bits, page_size, kw):
    lowered = mgpu.lower_for_cuda(
        functools.partial(qm.quantized_pages_attention, k_bits=bits, v_bits=bits, scale=0.1),
        *_pools(bits, page_size, **kw))
    assert "mosaic_gpu" in lowered.as_text()
