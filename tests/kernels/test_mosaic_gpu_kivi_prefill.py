"""The Mosaic GPU KIVI prefill kernel (ragged rows over quantized pages), on a CPU-only machine.

Correctness runs in Mosaic GPU's interpreter (simulated shared memory, TMA,
barriers and wgmma) with its race detector on, against the jnp reference
(`quantized_attention`: pages plus the full-precision tail), one program per
case on tiny shapes: GQA 4 (16 query positions per 64-row item), four rows
of a mixed step: one with no new query, a decode row, a 20-query chunk whose
first 8 queries lie inside the quantized pages (causal against them, across
a page boundary, the chunk split over two items) and a row with nothing
quantized yet. Two CTAs, so each walks several items and the ring wraps
across them. Pages come from a permuted pool with garbage table entries past
each row; scales and zeros of pages no row owns, and of the unwritten tokens
past each row's quantized length, are NaN. Cases: int4 with 16-token pages
and key groups (16-token sub-blocks); int2 at head_dim 64 (16-byte code rows)
with a sliding window, a soft cap, a padding query and two swapped queries
inside the chunk.

Tolerance (as the decode kernel's test): the kernel rounds q times each key
scale and the scaled probabilities to bfloat16 for the tensor cores
(2^-9 relative each) and returns bfloat16; the reference attends in float32
from the same bfloat16 inputs. Logits of O(1-5) over 64-128 channels move by
a few 1e-3, hence lse atol 1e-2 and out rtol = atol = 3e-2. A wrong field,
scale, mask, position or page moves them by O(0.1-1).

Lowering for an H100 from CPU runs the whole Mosaic GPU lowering at a
production shape (32/8 heads x 128, int4, pages of 32, 128-query rows) and
for int2 16-byte code rows.
Routing: on a Hopper, "pallas"/"auto" hand KIVI rows of several queries to
this kernel, decode rows to the decode kernel, and `python -m kvjax info`
lists it.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import _mosaic_gpu as mgpu
from kernels_pallas.quantized_attention import mosaic_gpu_prefill as qp
from kernels_pallas.quantized_attention import reference as qref

S = jax.ShapeDtypeStruct
# bits -> (head_dim, page_size, key group, value group): int4 with 16-token pages and key
# groups (16-token sub-blocks), int2 with 16-byte code rows (untiled shared memory).
SHAPES = {4: (64, 16, 16, 32), 2: (64, 64, 64, 32)}
KV_HEADS, Q_HEADS, MAX_PAGES, RING = 1, 4, 8, 32
CASES = {"int4": dict(bits=4), "int2_window_softcap": dict(bits=2, sliding_window=20,
                                                             soft_cap=3.0)}


@functools.partial(jax.jit, static_argnames=("k_bits", "v_bits", "scale", "soft_cap",
                                             "sliding_window"))
def _ref(q, *args, **static):
    """The reference on the same inputs, attending in float32 (the cast inside its program)."""
    return qref.quantized_attention(q.astype(jnp.float32), *args, **static)


@functools.partial(jax.jit, static_argnames=("bits", "scale", "soft_cap", "sliding_window"))
def _interpreted(*args, bits, scale, soft_cap, sliding_window):
    # One program per case for the kernel and its tail merge.
    return qp.quantized_attention(*args, k_bits=bits, v_bits=bits, scale=scale,
                                  soft_cap=soft_cap, sliding_window=sliding_window, num_sms=2,
                                  interpret=mgpu.interpret_params(detect_races=True))


def _inputs(bits):
    head_dim, page_size, group, v_group = SHAPES[bits]
    rng = np.random.default_rng(100 + bits)
    # (quantized tokens, tail tokens, new queries) per row; the tail holds the newest.
    rows = [(37, 10, 0), (64, 5, 1), (3 * 32 + 5, 12, 20), (0, 4, 3)]
    quant = np.array([r[0] for r in rows], np.int32)
    lengths = np.array([r[0] + r[1] for r in rows], np.int32)
    n_new = np.array([r[2] for r in rows])
    q_len = int(n_new.max())
    t = np.arange(q_len)[None, :]
    q_pos = np.where(t < n_new[:, None], lengths[:, None] - n_new[:, None] + t, -1)
    if bits == 2:  # a padding slot and two swapped queries: masks by each query's position
        q_pos[2, 3] = -1
        q_pos[2, [5, 6]] = q_pos[2, [6, 5]]
    used = -(-quant // page_size)
    num_pages = int(used.sum()) + 2
    perm = rng.permutation(num_pages)
    tables = rng.choice([-3, num_pages, 10**6], size=(len(rows), MAX_PAGES)).astype(np.int32)
    start = 0
    for b, n in enumerate(used):
        tables[b, :n] = perm[start:start + n]
        start += n
    dead = perm[start:]  # pages no row owns

    def pool(grouping):
        codes = rng.integers(0, 256, (KV_HEADS, num_pages, page_size, head_dim * bits // 8))
        shape = ((KV_HEADS, num_pages, page_size // group, head_dim) if grouping == "tokens"
                 else (KV_HEADS, num_pages, page_size, head_dim // v_group))
        scale = rng.uniform(0.5, 3.0, shape) / (2 ** bits - 1)
        zero = rng.uniform(-1.5, 0.0, shape)
        scale[:, dead] = np.nan
        zero[:, dead] = np.nan
        for b, q in enumerate(quant):  # unwritten tokens past each row's quantized part
            if q % page_size:
                last = tables[b, q // page_size]
                cut = -(-(q % page_size) // group) if grouping == "tokens" else q % page_size
                scale[:, last, cut:] = np.nan
                zero[:, last, cut:] = np.nan
        return codes.astype(np.uint8), scale.astype(np.float16), zero.astype(np.float16)

    def draw(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    q = draw(len(rows), q_len, Q_HEADS, head_dim).astype(jnp.bfloat16)
    tk = draw(KV_HEADS, len(rows), RING, head_dim).astype(jnp.bfloat16)
    tv = draw(KV_HEADS, len(rows), RING, head_dim).astype(jnp.bfloat16)
    return jax.device_put((q, *pool("tokens"), *pool("channels"), tk, tv, quant, lengths,
                           tables, q_pos.astype(np.int32)))


@pytest.mark.parametrize("case", sorted(CASES))
def test_interpreted_matches_reference(case):
    static = dict(soft_cap=None, sliding_window=None) | CASES[case]
    bits = static.pop("bits")
    args = _inputs(bits)
    scale = SHAPES[bits][0] ** -0.5
    mgpu.reset_interpreter()
    out, lse = jax.block_until_ready(_interpreted(*args, bits=bits, scale=scale, **static))
    assert not mgpu.interpreter_races_found()
    ref_out, ref_lse = _ref(*args, k_bits=bits, v_bits=bits, scale=scale, **static)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=0, atol=1e-2)
    np.testing.assert_allclose(np.asarray(out).astype(np.float32), np.asarray(ref_out),
                               rtol=3e-2, atol=3e-2)


def _pools(bits=4, page_size=32, *, batch=8, q_len=128, kv_heads=8, q_heads=32, head_dim=128,
           pages=4096, max_pages=512, group=32, v_group=32):
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


@pytest.mark.parametrize("bits,page_size,head_dim,group",
                         [(4, 32, 128, 32), (2, 64, 64, 64), (4, 16, 64, 16)])
def test_lowers_for_h100(bits, page_size, head_dim, group):
    """The production shape; int2 at head_dim 64 (16-byte code rows in untiled shared
    memory); 16-token key groups (P V's K of 16 needs the value tile's 32-byte swizzle, which
    only the lowering checks) at head_dim 64, the cheapest to lower (3 s on jax 0.11.2,
    5 s at 128)."""
    assert qp.unsupported_reason(*_pools(bits, page_size, head_dim=head_dim, group=group)[:7],
                                 k_bits=bits, v_bits=bits) is None
    lowered = mgpu.lower_for_cuda(
        functools.partial(qp.quantized_pages_attention, k_bits=bits, v_bits=bits, scale=0.1,
                          sliding_window=1024),
        *_pools(bits, page_size, head_dim=head_dim, group=group))
    assert "kvjax_kivi_prefill" in lowered.as_text()


class _Gpu:
    """A stand-in for a GPU device: the attributes the kernel choice reads."""

    def __init__(self, device_kind, compute_capability, core_count=132):
        self.device_kind = device_kind
        self.compute_capability = compute_capability
        self.core_count = core_count


def test_auto_on_hopper_runs_kivi_prefill_rows_here(monkeypatch):
    """On a Hopper, "auto" resolves KIVI attention to "pallas", whose rows of several queries
    run this kernel with the device's SM count (decode rows: the decode kernel), and `python
    -m kvjax info` lists it; on an A100 "auto" stays on the XLA path and "pallas" runs Triton;
    shapes this kernel refuses go to Triton with its reason."""
    from jax.experimental.pallas import triton as pl_triton

    from kernels_pallas.quantized_attention import gpu as quant_gpu
    from kernels_pallas.quantized_attention import mosaic_gpu as qdecode
    from kvjax import info
    from kvjax.attention import pallas_impls, registry

    monkeypatch.setattr(pallas_impls, "platform", lambda: "gpu")
    # Triton's lowering knows this "GPU" (from jax 0.11 it raises where none is attached).
    monkeypatch.setattr(pl_triton, "get_gpu_info", lambda: object(), raising=False)
    calls = []
    for name, module in (("prefill", qp), ("decode", qdecode), ("triton", quant_gpu)):
        monkeypatch.setattr(module, "quantized_attention",
                            lambda *a, name=name, **kw: calls.append((name, kw)) or name)
    args = _inputs(4)
    kw = dict(k_bits=4, v_bits=4, scale=0.1, block_sizes=None, max_pages=None)
    decode_rows = (args[0][:, :1], *args[1:-1], args[-1][:, :1])

    monkeypatch.setattr(pallas_impls, "gpu_device", lambda: _Gpu("NVIDIA H100", "9.0", 114))
    assert registry.auto_impl("quantized_attention") == "pallas"
    run = registry.resolve("quantized_attention", "auto")[0]
    assert run(*args, interpret=True, **kw) == "prefill"
    assert calls[-1][1]["num_sms"] == 114 and "block_sizes" not in calls[-1][1]
    assert run(*decode_rows, interpret=True, **kw) == "decode"
    listed = info._gpu_ops()["quantized_prefill_attention"]
    assert listed["kernel"] == "mosaic" and "Hopper" in listed["reason"]
    many_heads = (S((2, 8, 8 * 128, 128), jnp.bfloat16), *_pools()[1:7])
    kernel, why = pallas_impls.gpu_kernel("quantized_prefill_attention", *many_heads, k_bits=4,
                                          v_bits=4)
    assert kernel == "triton" and "at most 64 query heads" in why

    monkeypatch.setattr(pallas_impls, "gpu_device", lambda: _Gpu("NVIDIA A100", "8.0"))
    assert registry.auto_impl("quantized_attention") == "xla"
    assert pallas_impls.quantized_attention(*args, interpret=True, **kw) == "triton"
    assert info._gpu_ops()["quantized_prefill_attention"]["kernel"] == "triton"
