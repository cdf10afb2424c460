"""The Mosaic GPU KIVI MLA decode kernel, checked on a CPU-only machine.

Correctness runs in Mosaic GPU's interpreter (simulated shared memory, TMA,
barriers, wgmma, three warpgroups) with its race detector on, against the jnp
reference, one call per bit width on tiny shapes (d_c 128, d_rope 32, 4 heads
padded to one 64-head block): three rows with quantized lengths of every class
(mid-page, several pages ending mid-page so a split's pipeline reuses a stage,
none), tails of every length class (empty, a full ring, mid-ring), pages drawn
from a permuted pool with garbage table entries past each row, NaN scales and
zeros on the pages no row owns and on the rows past each quantized length.
Page sizes 16 (a step of four pieces, the scales copied row by row), 64 and
128 (a page of two steps); one case splits every row (`num_sms`).

The kernel's pages part runs in a program of its own and the tail merge in
another: jitted together, XLA:CPU runs the tail's attention beside the
interpreted kernel on its two-thread pool, which starves the interpreter's
warpgroup threads (the kernel hangs on a 2-core machine).

Tolerance: the queries, the dequantized latent and the probabilities are
rounded to bfloat16 for the tensor cores (2^-9 relative each), the output is
bfloat16; logits of O(1-5): lse atol 1e-2, out rtol = atol = 3e-2 (seen: lse
2e-3, out 5e-3). A wrong field, scale, zero, mask or page moves them by
O(0.1-1).

Lowering for an H100 from CPU runs the whole Mosaic GPU lowering at DeepSeek-V3's
shape (d_c 512, d_rope 64; 16 and 128 heads) for each bit width.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import _mosaic_gpu as mgpu
from kernels_pallas.quantized_attention import mosaic_gpu_mla as km
from kernels_pallas.quantized_attention import reference as qref

S = jax.ShapeDtypeStruct
D_C, D_ROPE, HEADS, RING = 128, 32, 4, 16
# bits -> (page_size, group, num_sms): splits = num_sms // 3 rows, at most one per step.
CASES = {8: (128, 64, 3), 4: (16, 32, 3), 2: (64, 32, 9)}


@functools.partial(jax.jit, static_argnames=("bits", "scale", "num_sms"))
def _pages(*args, bits, scale, num_sms):
    return km.quantized_mla_pages_attention(
        *args, bits=bits, scale=scale, num_sms=num_sms,
        interpret=mgpu.interpret_params(detect_races=True))


@functools.partial(jax.jit, static_argnames=("scale",))
def _merge(out_q, lse_q, ql, qr, tc, tr, quant, lengths, q_pos, *, scale):
    return qref.mla_merge_with_tail(out_q, lse_q, ql, qr, tc, tr, quant, lengths, q_pos,
                                    scale=scale)


@functools.partial(jax.jit, static_argnames=("bits", "scale"))
def _ref(ql, qr, *args, bits, scale):
    f32 = jnp.float32
    return qref.quantized_mla_attention(ql.astype(f32), qr.astype(f32), *args, bits=bits,
                                        scale=scale)


def _inputs(bits):
    page_size, group, _ = CASES[bits]
    rng = np.random.default_rng(100 + bits)
    quant = np.array([page_size + 5 if page_size < 64 else 37, 150, 0], np.int32)
    lengths = (quant + np.array([0, RING, RING // 2])).astype(np.int32)
    max_pages = -(-150 // page_size) + 1
    used = -(-quant // page_size)
    num_pages = int(used.sum()) + 2
    perm = rng.permutation(num_pages)
    tables = rng.choice([-3, num_pages, 10**6], size=(3, max_pages)).astype(np.int32)
    start = 0
    for b, n in enumerate(used):
        tables[b, :n] = perm[start:start + n]
        start += n
    codes = rng.integers(0, 256, (num_pages, page_size, D_C * bits // 8)).astype(np.uint8)
    shape = (num_pages, page_size, D_C // group)
    scale = rng.uniform(0.5, 3.0, shape) / (2 ** bits - 1)
    zero = rng.uniform(-1.5, 0.0, shape)
    scale[perm[start:]] = zero[perm[start:]] = np.nan  # pages no row owns
    for b, n in enumerate(used):  # rows past each quantized length
        if n:
            last = tables[b, n - 1]
            scale[last, quant[b] - (n - 1) * page_size:] = np.nan
            zero[last, quant[b] - (n - 1) * page_size:] = np.nan

    def draw(*shape):
        return rng.standard_normal(shape).astype(jnp.bfloat16)

    q_pos = (lengths - 1)[:, None].astype(np.int32)
    return jax.device_put((draw(3, 1, HEADS, D_C), draw(3, 1, HEADS, D_ROPE), codes,
                           scale.astype(np.float16), zero.astype(np.float16),
                           draw(num_pages, page_size, D_ROPE), draw(3, RING, D_C),
                           draw(3, RING, D_ROPE), quant, lengths, tables, q_pos))


@pytest.mark.parametrize("bits", sorted(CASES))
def test_interpreted_matches_reference(bits):
    ql, qr, codes, cs, cz, rope, tc, tr, quant, lengths, tables, q_pos = _inputs(bits)
    scale = (D_C + D_ROPE) ** -0.5
    mgpu.reset_interpreter()
    out_q, lse_q = jax.block_until_ready(_pages(
        ql, qr, codes, cs, cz, rope, quant, tables, q_pos, bits=bits, scale=scale,
        num_sms=CASES[bits][2]))
    assert not mgpu.interpreter_races_found()
    out, lse = _merge(out_q, lse_q, ql, qr, tc, tr, quant, lengths, q_pos, scale=scale)
    ref_out, ref_lse = _ref(ql, qr, codes, cs, cz, rope, tc, tr, quant, lengths, tables,
                            q_pos, bits=bits, scale=scale)
    assert out.dtype == jnp.bfloat16 and out.shape == ref_out.shape
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=0, atol=1e-2)
    np.testing.assert_allclose(np.asarray(out).astype(np.float32), np.asarray(ref_out),
                               rtol=3e-2, atol=3e-2)


def _pools(bits, *, q_heads=16, d_c=512, d_rope=64, page_size=64, group=32, q_len=1,
           batch=4, pages=256, max_pages=64, dtype=jnp.bfloat16):
    return (S((batch, q_len, q_heads, d_c), dtype), S((batch, q_len, q_heads, d_rope), dtype),
            S((pages, page_size, d_c * bits // 8), jnp.uint8),
            S((pages, page_size, d_c // group), jnp.float16),
            S((pages, page_size, d_c // group), jnp.float16),
            S((pages, page_size, d_rope), dtype),
            S((batch,), jnp.int32), S((batch, max_pages), jnp.int32),
            S((batch, q_len), jnp.int32))


@pytest.mark.parametrize("bits,q_heads", [(8, 16), (4, 128), (2, 16)])
def test_lowers_for_h100(bits, q_heads):
    args = _pools(bits, q_heads=q_heads)
    assert km.unsupported_reason(*args[:6], bits=bits) is None
    lowered = mgpu.lower_for_cuda(
        functools.partial(km.quantized_mla_pages_attention, bits=bits, scale=0.1), *args)
    assert lowered.as_text().count("custom_call @mosaic_gpu") == 1


def test_unsupported_reason():
    def why(bits, **kw):
        return km.unsupported_reason(*_pools(bits, **kw)[:6], bits=bits)

    assert "q_len" in why(4, q_len=2)
    assert "group size" in why(4, group=16)
    assert "page sizes" in why(4, page_size=24)
    assert "rope pages" in why(4, dtype=jnp.float32)
    with pytest.raises(ValueError, match="q_len"):
        km.quantized_mla_pages_attention(*_pools(4, q_len=2), bits=4, scale=0.1)


class _Hopper:
    device_kind, compute_capability, core_count = "NVIDIA H100 80GB HBM3", "9.0", 114


def test_kivi_mla_decode_on_hopper_runs_this_kernel_and_prefill_rows_triton(monkeypatch):
    """impl="pallas" on a Hopper hands KIVI MLA decode rows to this kernel with the device's
    SM count (Triton's block sizes dropped); chunked-prefill rows, which it refuses, and
    non-Hopper GPUs go to the Triton kernel."""
    from kernels_pallas.quantized_attention import gpu as quant_gpu
    from kvjax.attention import pallas_impls

    calls = []
    monkeypatch.setattr(pallas_impls, "platform", lambda: "gpu")
    monkeypatch.setattr(pallas_impls, "gpu_device", _Hopper)
    monkeypatch.setattr(km, "quantized_mla_attention",
                        lambda *a, **kw: calls.append(("mosaic", kw)) or "mosaic")
    monkeypatch.setattr(quant_gpu, "quantized_mla_attention",
                        lambda *a, **kw: calls.append(("triton", kw)) or "triton")
    args = _inputs(4)
    kw = dict(bits=4, scale=0.1, block_sizes=None, max_pages=None)
    assert pallas_impls.quantized_mla_attention(*args, interpret=True, **kw) == "mosaic"
    assert calls[-1][1]["num_sms"] == 114 and "block_sizes" not in calls[-1][1]
    rows = (jnp.repeat(args[0], 2, axis=1), jnp.repeat(args[1], 2, axis=1), *args[2:])
    assert pallas_impls.quantized_mla_attention(*rows, interpret=True, **kw) == "triton"
    kernel, why = pallas_impls.gpu_kernel("quantized_mla_attention", *rows[:6], bits=4)
    assert kernel == "triton" and "q_len" in why
    monkeypatch.setattr(_Hopper, "compute_capability", "8.0")
    assert pallas_impls.quantized_mla_attention(*args, interpret=True, **kw) == "triton"
