"""Pallas kernels over KIVI-quantized pages equal the XLA/reference quantized path.

Inputs are fresh random packed codes (every byte value, so every code of every
bit field), float16 scales and zeros of realistic size (a group's range over
2^bits - 1 steps), random full-precision tails, block tables that are a
random permutation of a larger pool with garbage (negative, past-the-pool)
entries past each row's quantized length, and rows at the edges: nothing
quantized (and an empty sequence), one page, a partly quantized page, a full
table; q_len 1 (decode) and 3 (chunked prefill with padding rows).

Tolerance (float32 rounding): both sides dequantize with the same float32
`code * scale + zero` and attend in float32; the kernels sum the logits slice
by slice (one bit field at a time) and the softmax block by block (online
rescaling), the reference in one pass. With O(1) values and at most a few
hundred terms per sum, reordering moves results by a few float32 ulps
(2^-24 relative each), far below rtol = atol = 1e-5; an error in the layout,
a group broadcast, a mask or a page index moves them by O(0.1-1). bfloat16
queries and tails compare at bfloat16's output rounding (2e-2) since both
sides round the same float32 result, which may straddle a bf16 ulp. The GPU kernel with
bfloat16 queries rounds the dequantized keys to bfloat16 for its dots: its lse may move by
as much as that rounding moves the logits, computed exactly from the case's keys
(`bf16_key_rounding_bound`), on top of the float32 tolerance.

CI runs a subset in which every bits value, GQA ratio (1, 4, MQA), q_len and
kernel flavour (TPU kernel in Pallas' interpreter and in the TPU interpreter,
GPU kernel in interpret mode) appears for GQA and for MLA; KVJAX_SLOW=1 adds
the full kernel x bits x ratio x q_len sweep (about 5 minutes on a loaded
2-core CPU).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from kernels_pallas.paged_attention.tpu import interpret_params
from kernels_pallas.quantized_attention import gpu as qgpu
from kernels_pallas.quantized_attention import reference as qref
from kernels_pallas.quantized_attention import tpu as qtpu
from tests.kernels.kernel_cases import interpreted, make_tables, native_flavours, triton_export

PS, G, MAX_PAGES, RING = 16, 16, 4, 32
RATIOS = {"mha": (4, 4), "gqa4": (8, 2), "mqa": (4, 1)}
TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}
LSE_TOL = dict(rtol=1e-5, atol=1e-5)

ref_gqa = jax.jit(qref.quantized_attention,
                  static_argnames=("k_bits", "v_bits", "scale", "soft_cap", "sliding_window"))
ref_mla = jax.jit(qref.quantized_mla_attention, static_argnames=("bits", "scale"))


def _quant_pool(rng, lead, width, bits, grouping):
    """Random packed codes [*lead, PS, width*bits/8] and f16 scale/zero of the layout."""
    codes = rng.integers(0, 256, (*lead, PS, width * bits // 8)).astype(np.uint8)
    shape = (*lead, PS // G, width) if grouping == "tokens" else (*lead, PS, width // G)
    # A group spanning [zero, zero + range] in 2^bits - 1 steps, range ~ U(0.5, 3).
    scale = rng.uniform(0.5, 3.0, shape) / (2 ** bits - 1)
    zero = rng.uniform(-1.5, 0.0, shape)
    return jax.device_put((codes, scale.astype(np.float16), zero.astype(np.float16)))


def _rows(rng, batch, q_len):
    """Quantized lengths, lengths, q_pos, block tables and pool size of `batch` edge rows."""
    quant = np.array([0, 0, PS, PS + 5, 2 * PS, MAX_PAGES * PS][:batch])
    tail = rng.integers(0, RING + 1, batch)
    tail[0] = 0  # an empty sequence: every query row is padding (out 0, lse -inf)
    tail[1:] = np.maximum(tail[1:], q_len)
    lengths = quant + tail
    q_lengths = np.minimum(rng.integers(1, q_len + 1, batch), lengths)
    t = np.arange(q_len)[None]
    q_pos = np.where(t < q_lengths[:, None], lengths[:, None] - q_lengths[:, None] + t, -1)
    tables, pool = make_tables(rng, quant, PS, MAX_PAGES)
    return (*jax.device_put((quant.astype(np.int32), lengths.astype(np.int32),
                             q_pos.astype(np.int32))), tables, pool)


def gqa_case(rng, *, bits, q_heads, kv_heads, head_dim=64, q_len=1, batch=6,
             dtype=jnp.float32):
    """Positional args of `quantized_attention` (reference signature) with fresh data."""
    quant, lengths, q_pos, tables, pool = _rows(rng, batch, q_len)
    k = _quant_pool(rng, (kv_heads, pool), head_dim, bits, "tokens")
    v = _quant_pool(rng, (kv_heads, pool), head_dim, bits, "channels")

    def draw(*shape):
        return jax.device_put(rng.standard_normal(shape).astype(np.float32).astype(dtype))

    q = draw(batch, q_len, q_heads, head_dim)
    tail_k, tail_v = draw(kv_heads, batch, RING, head_dim), draw(kv_heads, batch, RING, head_dim)
    return (q, *k, *v, tail_k, tail_v, quant, lengths, tables, q_pos)


def mla_case(rng, *, bits, q_heads=4, d_c=64, d_rope=64, q_len=1, batch=6, dtype=jnp.float32):
    """Positional args of `quantized_mla_attention` with fresh data."""
    quant, lengths, q_pos, tables, pool = _rows(rng, batch, q_len)
    codes, scale, zero = _quant_pool(rng, (pool,), d_c, bits, "channels")

    def draw(*shape):
        return jax.device_put(rng.standard_normal(shape).astype(np.float32).astype(dtype))

    return (draw(batch, q_len, q_heads, d_c), draw(batch, q_len, q_heads, d_rope),
            codes, scale, zero, draw(pool, PS, d_rope), draw(batch, RING, d_c),
            draw(batch, RING, d_rope), quant, lengths, tables, q_pos)


def _kernel(kind, mla):
    """(module function, interpret) of a kernel flavour."""
    mod, interpret = {"tpu": (qtpu, True), "tpu_interpreter": (qtpu, interpret_params()),
                      "gpu": (qgpu, True), "tpu_native": (qtpu, False),
                      "gpu_native": (qgpu, False)}[kind]
    fn = mod.quantized_mla_attention if mla else mod.quantized_attention
    # One jitted program (see interpreted()): the wrapper's folding and tail merge compile
    # with the kernel instead of op by op.
    return functools.partial(interpreted, fn, interpret=interpret)


_dequantize = jax.jit(qref.gather_dequantize, static_argnames=("bits", "grouping"))


def bf16_key_rounding_bound(q, keys, quant_lengths, q_pos, scale, window=None):
    """How far the GPU kernel's lse may move from the reference's with 16-bit queries.

    With bf16 queries the GPU kernel rounds each dequantized quantized-page key to bf16
    for its tensor-core dot and accumulates in float32; everything else (queries, bf16
    tails and rope pages, the product of bf16 operands) is exact in float32. A code times
    its float16 scale is exact in float32 (at most 8 + 11 significant bits), so
    `code * scale + zero` rounds once, with or without a fused multiply-add, and the keys
    the kernel rounds are bit for bit the reference's float32 keys `k`. Each logit of a
    quantized-page key therefore moves by exactly `scale * q . (bf16(k) - k)` (before
    float32 summation order), and a log-sum-exp moves by at most the largest move of its
    logits (it is 1-Lipschitz in the max norm, as are the soft cap, `tanh`, and the
    merge with the tail's lse). With at most 2^-8 relative per rounded key element this
    is at most `scale * max_j sum_i |q_i| |k_ji| * 2^-8`, but the exact moves are several
    times smaller, so a wrong logit scale of 1% still shows.

    Args:
      q: the queries, [batch, q_len, q_heads, d] (bf16).
      keys: the reference's float32 keys of the quantized pages, [batch, kv_heads,
        max_tokens, d] (`gather_dequantize`), for the query part `q` multiplies.
      quant_lengths, q_pos: int32 [batch], [batch, q_len].
      scale: the softmax scale; window: the sliding window, if any.

    Returns:
      float64 [batch, q_len, q_heads]: the largest |logit move| over the keys each query
      sees in the quantized pages (0 where it sees none).
    """
    q = np.asarray(q, np.float64)
    k = np.asarray(keys, np.float32)
    delta = k.astype(jnp.bfloat16).astype(np.float64) - k.astype(np.float64)
    b, t, hq, d = q.shape
    kvh = k.shape[1]
    moves = np.einsum("btkgd,bksd->btkgs", q.reshape(b, t, kvh, hq // kvh, d), delta)
    moves = np.abs(scale * moves).reshape(b, t, hq, -1)
    pos, qp = np.arange(k.shape[2]), np.asarray(q_pos)[:, :, None]
    seen = (pos < np.asarray(quant_lengths)[:, None, None]) & (pos <= qp) & (qp >= 0)
    if window is not None:
        seen &= qp - pos < window
    return np.where(seen[:, :, None, :], moves, 0.0).max(-1)


def _lse_bound(kind, dtype, args, mla, bits, scale, window=None):
    """The lse's allowed distance from the reference beyond float32 rounding: the GPU
    kernel's rounding of keys to bf16 with bf16 queries (`bf16_key_rounding_bound`);
    0 for every other case (both sides attend in float32)."""
    if not (kind.startswith("gpu") and dtype == jnp.bfloat16):
        return 0.0
    if mla:  # keys [c_KV, k_rope]: only the latent is dequantized; rope pages stay bf16
        q, (codes, cs, cz), quant, tables, q_pos = args[0], args[2:5], args[8], args[10], args[11]
        codes, cs, cz = codes[None], cs[None], cz[None]
        grouping = "channels"
    else:
        q, (codes, cs, cz), quant, tables, q_pos = args[0], args[1:4], args[9], args[11], args[12]
        grouping = "tokens"
    keys = _dequantize(codes, cs, cz, tables, quant, bits=bits, grouping=grouping)
    return bf16_key_rounding_bound(q, keys, quant, q_pos, scale, window)


def _check(got, want, dtype, lse_bound=0.0):
    (out, lse), (ref_out, ref_lse) = got, want
    assert out.dtype == ref_out.dtype and out.shape == ref_out.shape
    assert lse.dtype == jnp.float32 and lse.shape == ref_lse.shape
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32),
                               **TOL[dtype])
    lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    seen = np.isfinite(ref_lse)
    err = np.abs(lse[seen] - ref_lse[seen])
    allowed = (np.broadcast_to(lse_bound, lse.shape)[seen] + LSE_TOL["atol"]
               + LSE_TOL["rtol"] * np.abs(ref_lse[seen]))
    assert np.all(err <= allowed), (
        f"lse off the reference by up to {err.max():.3g} (allowed here "
        f"{allowed[np.argmax(err - allowed)]:.3g}: float32 rounding plus, for the GPU kernel "
        f"with bf16 queries, its bf16 rounding of the keys)")
    # The empty sequence is padding; every other row saw keys.
    assert np.all(np.isneginf(np.asarray(lse)[0])) and np.all(np.asarray(out)[0] == 0)
    assert np.all(np.isfinite(np.asarray(ref_lse)[1:, 0]))


def run_gqa(rng, kind, bits, ratio, q_len=1, dtype=jnp.float32, soft_cap=None, window=None):
    q_heads, kv_heads = RATIOS[ratio]
    args = gqa_case(rng, bits=bits, q_heads=q_heads, kv_heads=kv_heads, q_len=q_len,
                    dtype=dtype)
    opts = dict(k_bits=bits, v_bits=bits, scale=0.125, soft_cap=soft_cap, sliding_window=window)
    _check(_kernel(kind, False)(*args, **opts), ref_gqa(*args, **opts), dtype,
           _lse_bound(kind, dtype, args, False, bits, 0.125, window))


def run_mla(rng, kind, bits, q_len=1, dtype=jnp.float32):
    args = mla_case(rng, bits=bits, q_len=q_len, dtype=dtype)
    _check(_kernel(kind, True)(*args, bits=bits, scale=0.09),
           ref_mla(*args, bits=bits, scale=0.09), dtype,
           _lse_bound(kind, dtype, args, True, bits, 0.09))


# CI: every bits value, GQA ratio and q_len appears for GQA and for MLA, and every kernel
# flavour runs GQA and MLA; the sweeps below cover the full product.
# One case also runs bfloat16 inputs, a soft cap, a sliding window and TPU row blocks.
CI_GQA = [("tpu", 2, "mha", 1, False), ("tpu", 8, "mqa", 3, True), ("gpu", 4, "gqa4", 1, False),
          ("tpu_interpreter", 4, "gqa4", 1, False)]
CI_MLA = [("tpu", 4, 1, False), ("gpu", 2, 3, True), ("tpu_interpreter", 8, 1, False)]
BF16_CAP_WINDOW = dict(dtype=jnp.bfloat16, soft_cap=3.0, window=21)
KINDS = ("tpu", "tpu_interpreter", "gpu")


@pytest.mark.parametrize("kind,bits,ratio,q_len,variant", CI_GQA)
def test_gqa_kernel_equals_reference(rng, monkeypatch, kind, bits, ratio, q_len, variant):
    if variant:
        # Also split the rows over the TPU kernel's row-block grid axis (as long prefill
        # chunks are): 3 * 4 = 12 rows in blocks of 8, 4 padding rows in the last.
        monkeypatch.setattr(qtpu, "MAX_BLOCK_ROWS", 8)
        qtpu._pages_tpu.clear_cache()  # retrace with the patched block size
    run_gqa(rng, kind, bits, ratio, q_len, **(BF16_CAP_WINDOW if variant else {}))
    if variant:
        qtpu._pages_tpu.clear_cache()


@pytest.mark.parametrize("kind,bits,q_len,bf16", CI_MLA)
def test_mla_kernel_equals_reference(rng, kind, bits, q_len, bf16):
    run_mla(rng, kind, bits, q_len, dtype=jnp.bfloat16 if bf16 else jnp.float32)


@pytest.mark.parametrize("kind", native_flavours())
def test_native_kernels_equal_reference(rng, kind):
    # Compiled on an accelerator (skipped on CPU): every bits value, ratio and q_len of
    # GQA, MLA at each bits, and the bf16 / soft-cap / window variant.
    for bits, ratio, q_len in [(2, "mha", 1), (4, "gqa4", 3), (8, "mqa", 1)]:
        run_gqa(rng, kind, bits, ratio, q_len)
    run_gqa(rng, kind, 4, "gqa4", 3, **BF16_CAP_WINDOW)
    for bits, q_len in [(2, 3), (4, 1), (8, 3)]:
        run_mla(rng, kind, bits, q_len)
    run_mla(rng, kind, 4, 1, dtype=jnp.bfloat16)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_variants_sweep(rng, kind):
    run_gqa(rng, kind, 2, "gqa4", q_len=3, **BF16_CAP_WINDOW)
    run_mla(rng, kind, 4, q_len=3, dtype=jnp.bfloat16)


@pytest.mark.slow
@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("ratio", list(RATIOS))
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("kind", KINDS)
def test_gqa_sweep(rng, kind, bits, ratio, q_len):
    run_gqa(rng, kind, bits, ratio, q_len)


@pytest.mark.slow
@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("kind", KINDS)
def test_mla_sweep(rng, kind, bits, q_len):
    run_mla(rng, kind, bits, q_len)


@pytest.mark.slow
def test_pages_part_alone_equals_reference(rng):
    # The pages-only entry points (what the drop-ins wrap) against the reference's.
    args = gqa_case(rng, bits=2, q_heads=8, kv_heads=2, q_len=3)
    pages_args = args[:7] + (args[9], args[11], args[12])
    opts = dict(k_bits=2, v_bits=2, scale=0.125)
    want = interpreted(qref.quantized_pages_attention, *pages_args, **opts)
    for got in (interpreted(qtpu.quantized_pages_attention, *pages_args, **opts, interpret=True),
                interpreted(qgpu.quantized_pages_attention, *pages_args, **opts, interpret=True)):
        np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-5, atol=1e-5)


def test_bad_inputs_raise_before_tracing(rng):
    args = gqa_case(rng, bits=4, q_heads=4, kv_heads=2, batch=2)
    q, kc, ks, kz, vc, vs, vz, _, _, ql, ln, bt, qp = args
    pages = (kc, ks, kz, vc, vs, vz, ql, bt, qp)
    opts = dict(k_bits=4, v_bits=4, scale=0.1, interpret=True)

    def cut(x, index, dtype=None):  # edited on the host: no eager program per edit
        return jax.device_put(np.asarray(x, dtype)[index])

    q32, q3 = cut(q, np.s_[..., :32]), cut(q, np.s_[:, :, :3])
    ks32, kz32 = cut(ks, np.s_[..., :32]), cut(kz, np.s_[..., :32])
    for mod in (qtpu, qgpu):
        f = mod.quantized_pages_attention
        with pytest.raises(ValueError, match="q head_dim 32"):
            f(q32, *pages, **opts)
        with pytest.raises(ValueError, match="per-channel key groups"):  # 128 channels at 2 bits
            f(q, *pages, **{**opts, "k_bits": 2})
        with pytest.raises(ValueError, match="bits must be one of"):
            f(q, *pages, **{**opts, "k_bits": 3})
        with pytest.raises(ValueError, match="not a multiple of kv_heads"):
            f(q3, *pages, **opts)
        with pytest.raises(TypeError, match="uint8"):
            f(q, cut(kc, ..., np.int32), *pages[1:], **opts)
        with pytest.raises(ValueError, match="per-channel key groups"):
            f(q, kc, ks32, kz32, *pages[3:], **opts)
        with pytest.raises(ValueError, match="q_pos"):
            f(q, *pages[:-1], cut(qp, np.s_[:, :0]), **opts)
        with pytest.raises(ValueError, match="max_pages"):
            f(q, *pages, **opts, max_pages=MAX_PAGES - 1)
    # Widths the hardware kernels do not tile.
    small = gqa_case(rng, bits=2, q_heads=4, kv_heads=2, head_dim=32, batch=2)
    sp = small[1:7] + (small[9], small[11], small[12])
    with pytest.raises(ValueError, match="not supported by the TPU kernel"):
        qtpu.quantized_pages_attention(small[0], *sp, k_bits=2, v_bits=2, scale=0.1)
    with pytest.raises(ValueError, match="8-channel slices"):
        qgpu.quantized_pages_attention(small[0], *sp, k_bits=2, v_bits=2, scale=0.1)
    # The public op: impl="pallas" cannot run compiled on CPU. Traced (eval_shape) rather
    # than run: its eager setup would compile a program per op; a missing check would let
    # the trace finish without the error.
    from kvjax import attention
    from kvjax.cache.quantized import QuantizedLayerView, QuantLayer

    view = QuantizedLayerView(k=QuantLayer(kc, ks, kz, 4, "tokens"),
                              v=QuantLayer(vc, vs, vz, 4, "channels"), tail_k=args[7],
                              tail_v=args[8], block_tables=bt, quant_lengths=ql, lengths=ln)
    if jax.default_backend() == "cpu":
        with pytest.raises(ValueError, match="interpret=False needs a TPU or GPU"):
            jax.eval_shape(lambda q, view: attention.quantized_decode_attention(
                q, view, impl="pallas", interpret=False), cut(q, np.s_[:, 0]), view)
    m = mla_case(rng, bits=4, batch=2)
    with pytest.raises(ValueError, match="query widths"):
        qtpu.quantized_mla_pages_attention(m[0], cut(m[1], np.s_[..., :32]), *m[2:6], m[8],
                                           m[10], m[11], bits=4, scale=0.1)
    with pytest.raises(ValueError, match="scale must be positive"):
        qgpu.quantized_mla_pages_attention(*m[:6], m[8], m[10], m[11], bits=4, scale=0.0)


# --- lowering for real hardware, checked from CPU (see test_kernel_lowering.py) ---

S = jax.ShapeDtypeStruct


def _export_args(mla, bits):
    """Production-like shapes: Llama-3-8B-like GQA (32/8 heads, D 128) and DeepSeek-V3 MLA."""
    b, pages, mp, ps, g = 4, 64, 8, 16, 32
    tail = (S((b,), jnp.int32), S((b, mp), jnp.int32), S((b, 1), jnp.int32))
    if mla:
        dc, dr, h = 512, 64, 128
        return (S((b, 1, h, dc), jnp.bfloat16), S((b, 1, h, dr), jnp.bfloat16),
                S((pages, ps, dc * bits // 8), jnp.uint8), S((pages, ps, dc // g), jnp.float16),
                S((pages, ps, dc // g), jnp.float16), S((pages, ps, dr), jnp.bfloat16), *tail)
    d = 128
    k = (S((8, pages, ps, d * bits // 8), jnp.uint8), S((8, pages, ps // 16, d), jnp.float16),
         S((8, pages, ps // 16, d), jnp.float16))
    v = (S((8, pages, ps, d * bits // 8), jnp.uint8), S((8, pages, ps, d // g), jnp.float16),
         S((8, pages, ps, d // g), jnp.float16))
    return (S((b, 1, 32, d), jnp.bfloat16), *k, *v, *tail)


def _fn(mod, mla, bits):
    if mla:
        return functools.partial(mod.quantized_mla_pages_attention, bits=bits, scale=0.1)
    return functools.partial(mod.quantized_pages_attention, k_bits=bits, v_bits=bits, scale=0.1)


LOWER_CASES = [(False, 2), (True, 4)] + [
    pytest.param(mla, bits, marks=pytest.mark.slow)
    for mla, bits in [(False, 4), (False, 8), (True, 2), (True, 8)]]


@pytest.mark.parametrize("mla,bits", LOWER_CASES)
def test_tpu_kernels_lower_to_mosaic(pretend_tpu_v5e, mla, bits):
    module = export.export(jax.jit(_fn(qtpu, mla, bits)), platforms=["tpu"])(
        *_export_args(mla, bits)).mlir_module()
    assert module.count("tpu_custom_call") == 1


@pytest.mark.parametrize("mla,bits", LOWER_CASES)
def test_gpu_kernels_lower_to_triton(pretend_h100, mla, bits):
    module, target = triton_export(_fn(qgpu, mla, bits), *_export_args(mla, bits))
    assert module.count(target) == 1


# --- end to end: a quantized tiny model decodes the same tokens with impl="pallas" ---

def _tiny(family):
    from kvjax.models.deepseek import DeepseekConfig
    from kvjax.models.layers import RopeConfig
    from kvjax.models.llama import LlamaConfig

    # Widths the TPU kernel tiles (multiples of 64); one layer keeps compilation short.
    if family == "llama":
        return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=1,
                           q_heads=4, kv_heads=2, head_dim=64, rope=RopeConfig(theta=1e4, dim=64),
                           tie_word_embeddings=True)
    return DeepseekConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=1,
                          num_heads=2, kv_lora_rank=64, qk_rope_head_dim=64, qk_nope_head_dim=16,
                          v_head_dim=16, tie_word_embeddings=True)


@pytest.mark.parametrize("family", ["llama", pytest.param("mla", marks=pytest.mark.slow)])
def test_tiny_model_decodes_same_tokens_with_pallas(rng, family):
    from kvjax import generate as gen
    from kvjax.models.deepseek.params import init_from_shapes
    from kvjax.models.tiny import init_tiny, tiny_model
    from kvjax.specs import QuantSpec

    config = _tiny(family)
    model = tiny_model(config)
    # Random params drawn on the host, as DeepSeek's init does (Llama's draws on the device:
    # a compiled program for nothing the test checks).
    key = jax.random.key(int(rng.integers(1 << 30)))
    params = init_tiny(config, key) if family == "mla" else init_from_shapes(
        jax.eval_shape(lambda k: init_tiny(config, k), key), key)
    prompts = rng.integers(0, 256, (2, 40)).astype(np.int32)
    cc = gen.CacheConfig(dtype="float32", page_size=PS,
                         quant=QuantSpec(bits=4, group_size=16, residual=16))

    def generate(impl):
        # The prompt goes in one token per step (prefill="step"), so that prefill and decode
        # share one compilation (q_len > 1 is covered by the kernel tests above). With R = 16
        # the 33rd token moves page 0 into the quantized pool and the 48th page 1. The loop
        # records the log-probability of each token it feeds or picks: the teacher-forced
        # prompt tokens after the first, then the greedy ones (what `score` would return for
        # that continuation, from the same run).
        res = gen.generate(model, params, prompts.tolist(), key=jax.random.key(0),
                           max_new_tokens=9, cache=cc, prefill="step", impl=impl)
        return res.tokens, np.asarray(res.state.logprobs)

    ref_tokens, ref_logprobs = generate("reference")
    got_tokens, got_logprobs = generate("pallas")
    assert ref_logprobs.shape == (2, 39 + 9) and (ref_logprobs < 0).all()
    np.testing.assert_array_equal(got_tokens, ref_tokens)
    np.testing.assert_allclose(got_logprobs, ref_logprobs, rtol=1e-4, atol=1e-4)
