"""The Mosaic GPU ragged paged attention kernel, checked on a CPU-only machine.

Correctness runs in Mosaic GPU's interpreter (simulated shared memory, TMA
copies, barriers and wgmma) with its race detector on, against the jnp
prefill reference, on tiny mixed batches: a row with no new query, decode
rows (at position 0 and at a page's first position), a whole prompt as one
chunk, chunks starting mid-page and crossing pages and steps, and a row
filling its table. Pages are a random permutation of the pool, table entries
past each row's pages hold garbage ids, and every pool slot no row may read
holds NaN. One or two CTAs (`num_sms`; jax 0.10's interpreter builds each
CTA's program anew), so each walks several work items and the K/V ring wraps
across items. Lowering for an H100 from CPU runs the whole
Mosaic GPU lowering at production shapes.
"""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_cases import make_tables

from kernels_pallas import _mosaic_gpu as mgpu
from kernels_pallas.mla_decode import reference as mla_ref
from kernels_pallas.paged_attention import reference as paged_ref
from kernels_pallas.ragged_attention import mla_mosaic_gpu as mm
from kernels_pallas.ragged_attention import mosaic_gpu as mk

S = jax.ShapeDtypeStruct

_ref = jax.jit(paged_ref.paged_prefill_attention,
               static_argnames=("scale", "soft_cap", "sliding_window"))


def _case(rng, *, rows, q_len, q_heads, kv_heads, head_dim, page_size, max_pages):
    """bf16 inputs; NaN in every pool slot no row's token occupies."""
    lengths = np.array([n for n, _ in rows])
    q_lengths = np.array([t for _, t in rows])
    tables, num_pages = make_tables(rng, lengths, page_size, max_pages)
    host_tables = np.asarray(tables)
    dead = np.ones((num_pages, page_size), bool)
    for b, n in enumerate(lengths):
        for t in range(n):
            dead[host_tables[b, t // page_size], t % page_size] = False

    def draw(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    k, v = (draw(kv_heads, num_pages, page_size, head_dim) for _ in range(2))
    k[:, dead] = np.nan
    v[:, dead] = np.nan
    q = draw(len(rows), q_len, q_heads, head_dim)

    def dev(x):
        return jax.device_put(x.astype(jnp.bfloat16))

    ints = [jax.device_put(x.astype(np.int32)) for x in (lengths, q_lengths)]
    return dev(q), dev(k), dev(v), ints[0], tables, ints[1]


# (length, new queries) per row. 64-token steps (config) keep the interpreter's work small.
CASES = {
    # Group 4: 16 positions per warpgroup, 32 per item. A row with none; decode at 0; a
    # whole 40-token prompt (two items, the second one partial); a chunk from 113 across
    # page 112 | 128 and step 128; decode at a page's first position; a full table.
    "gqa4_page16_softcap": dict(
        shape=dict(rows=[(13, 0), (1, 1), (40, 40), (150, 37), (17, 1), (192, 5)],
                   q_len=40, q_heads=4, kv_heads=1, head_dim=64, page_size=16,
                   max_pages=12),
        static=dict(soft_cap=3.0, num_sms=2)),
    # Group 1 (MHA, two KV heads): 64 positions per warpgroup, so the 70-token chunk fills
    # both warpgroups; a 20-token window cuts into every long row (leading masked steps,
    # a row's first step showing it nothing).
    "mha_page8_window": dict(
        shape=dict(rows=[(70, 70), (3, 0), (130, 66), (9, 1)],
                   q_len=70, q_heads=2, kv_heads=2, head_dim=64, page_size=8,
                   max_pages=17),
        static=dict(sliding_window=20, num_sms=1)),
}
_CONFIG = mk.GpuRaggedConfig(block_tokens=64, num_stages=2)


@functools.partial(jax.jit, static_argnames=("soft_cap", "sliding_window", "num_sms"))
def _interpreted(*args, soft_cap=None, sliding_window=None, num_sms):
    return mk.paged_prefill_attention(
        *args, soft_cap=soft_cap, sliding_window=sliding_window, num_sms=num_sms, config=_CONFIG,
        interpret=mgpu.interpret_params(detect_races=True))


# The interpreter's Q K^T multiplies the NaN rows too (their logits are selected away).
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("name", sorted(CASES))
def test_interpreted_matches_reference(name):
    case = CASES[name]
    args = _case(np.random.default_rng(zlib.crc32(name.encode())), **case["shape"])
    mgpu.reset_interpreter()
    out, lse = jax.block_until_ready(_interpreted(*args, **case["static"]))
    assert not mgpu.interpreter_races_found()
    ref_static = {k: v for k, v in case["static"].items() if k != "num_sms"}
    ref_out, ref_lse = _ref(*args, **ref_static)
    assert out.dtype == jnp.bfloat16 and out.shape == ref_out.shape
    assert lse.dtype == jnp.float32 and lse.shape == ref_lse.shape
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all()
    # P is rounded to bf16 before P V (2^-8 relative) and the output is bf16; the logits
    # are float32 sums of exact products of bf16 values.
    np.testing.assert_allclose(out, np.asarray(ref_out, np.float32), rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-4, atol=1e-4)
    pad = np.arange(out.shape[1])[None, :] >= np.asarray(args[5])[:, None]
    assert (out[pad] == 0).all() and (np.asarray(lse)[pad] == -np.inf).all()


def test_unsupported_reason_and_bad_inputs():
    q, pages = S((2, 64, 32, 128), jnp.bfloat16), S((8, 64, 16, 128), jnp.bfloat16)
    assert mk.unsupported_reason(q, pages, pages) is None
    f32 = S((8, 64, 16, 128), jnp.float32)
    assert "bfloat16" in mk.unsupported_reason(S((2, 64, 32, 128), jnp.float32), f32, f32)
    assert "bfloat16" in mk.unsupported_reason(S((2, 64, 32, 128), jnp.float32), pages, pages)
    odd = S((8, 64, 24, 128), jnp.bfloat16)
    assert "page sizes" in mk.unsupported_reason(q, odd, odd)
    narrow_q, narrow = S((2, 64, 32, 32), jnp.bfloat16), S((8, 64, 16, 32), jnp.bfloat16)
    assert "head_dim" in mk.unsupported_reason(narrow_q, narrow, narrow)
    one_kv = S((1, 64, 16, 128), jnp.bfloat16)
    assert "at most 64" in mk.unsupported_reason(S((2, 64, 128, 128), jnp.bfloat16), one_kv,
                                                 one_kv)
    ints, table = S((2,), jnp.int32), S((2, 8), jnp.int32)
    with pytest.raises(ValueError, match="page sizes"):
        mk.paged_prefill_attention(q, odd, odd, ints, table, ints)
    with pytest.raises(ValueError, match="q_lengths"):
        mk.paged_prefill_attention(q, pages, pages, ints, table, S((3,), jnp.int32))
    with pytest.raises(ValueError, match="num_sms"):
        mk.paged_prefill_attention(q, pages, pages, ints, table, ints, num_sms=0)
    with pytest.raises(ValueError, match="multiple of 64"):
        mk.GpuRaggedConfig(block_tokens=96, num_stages=2)
    # Head dim 128: 128-token steps in two stages fit the shared memory; 256: 64-token steps.
    assert mk.default_config(128, 128) == mk.GpuRaggedConfig(block_tokens=128, num_stages=2)
    assert mk.default_config(256, 256).block_tokens == 64


# Llama-3-8B's heads (32 / 8 x 128) at 512-query chunks with window and soft cap, pages of
# 16 (eight TMA copies a step); head_dim 256 (Gemma) at 64-token steps, pages of 64 (one
# copy a step).
@pytest.mark.parametrize("page_size,head_dim", [(16, 128), (64, 256)])
def test_lowers_for_h100(page_size, head_dim):
    batch, max_pages = 4, 8192 // page_size
    pages = S((8, batch * max_pages, page_size, head_dim), jnp.bfloat16)
    lowered = mgpu.lower_for_cuda(
        mk.paged_prefill_attention, S((batch, 512, 32, head_dim), jnp.bfloat16), pages, pages,
        S((batch,), jnp.int32), S((batch, max_pages), jnp.int32), S((batch,), jnp.int32),
        sliding_window=4096, soft_cap=50.0)
    assert lowered.as_text().count("custom_call @mosaic_gpu") == 1


# MLA. 4 heads, so 16 positions per 64-row item: a row with none; decode at 0; a 21-query
# chunk from position 59 (two items, the second partial) across page 48 | 64 and step
# 64 | 128; decode at a page's first position. 96 heads: two 64-head blocks per position
# (the second half padding), a 2-query chunk at 7 and a row with none. d_c 64 and d_rope
# 32, the kernel's narrowest widths, keep the interpreter's work small; one CTA walks
# every item.
MLA_CASES = {
    "heads4": dict(rows=[(13, 0), (1, 1), (80, 21), (17, 1)], q_len=21, q_heads=4,
                   max_pages=6),
    "heads96": dict(rows=[(9, 2), (3, 0)], q_len=2, q_heads=96, max_pages=2),
}


def _mla_case(rng, *, rows, q_len, q_heads, d_c, d_rope, page_size, max_pages):
    """bf16 inputs; NaN in the latent and inf in the rope of every slot no row occupies."""
    lengths = np.array([n for n, _ in rows])
    tables, num_pages = make_tables(rng, lengths, page_size, max_pages)
    host_tables = np.asarray(tables)
    dead = np.ones((num_pages, page_size), bool)
    for b, n in enumerate(lengths):
        for t in range(n):
            dead[host_tables[b, t // page_size], t % page_size] = False

    def draw(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    latent, rope = draw(num_pages, page_size, d_c), draw(num_pages, page_size, d_rope)
    latent[dead], rope[dead] = np.nan, np.inf
    xs = (draw(len(rows), q_len, q_heads, d_c), draw(len(rows), q_len, q_heads, d_rope),
          latent, rope)
    ints = [jax.device_put(np.array(x, np.int32)) for x in (lengths, [t for _, t in rows])]
    return (*(jax.device_put(x.astype(jnp.bfloat16)) for x in xs), ints[0], tables, ints[1])


# The interpreter's Q K^T multiplies the NaN rows too (their logits are selected away).
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("name", sorted(MLA_CASES))
def test_mla_interpreted_matches_reference(name):
    args = _mla_case(np.random.default_rng(zlib.crc32(name.encode())), d_c=64, d_rope=32,
                     page_size=16, **MLA_CASES[name])
    mgpu.reset_interpreter()
    run = jax.jit(functools.partial(mm.mla_prefill_attention, scale=0.2, num_sms=1,
                                    interpret=mgpu.interpret_params(detect_races=True)))
    out, lse = jax.block_until_ready(run(*args))
    assert not mgpu.interpreter_races_found()
    ref_out, ref_lse = jax.jit(mla_ref.mla_prefill_attention, static_argnames="scale")(
        *args, scale=0.2)
    assert out.dtype == jnp.bfloat16 and out.shape == ref_out.shape
    assert lse.dtype == jnp.float32 and lse.shape == ref_lse.shape
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all()
    # As for GQA: P rounded to bf16 before P V, a bf16 output, float32 logits.
    np.testing.assert_allclose(out, np.asarray(ref_out, np.float32), rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-4, atol=1e-4)
    pad = np.arange(out.shape[1])[None, :] >= np.asarray(args[6])[:, None]
    assert (out[pad] == 0).all() and (np.asarray(lse)[pad] == -np.inf).all()


def test_mla_unsupported_reason_and_bad_inputs():
    def mla(heads=16, d_c=512, d_rope=64, page=64, dtype=jnp.bfloat16):
        return (S((2, 8, heads, d_c), dtype), S((2, 8, heads, d_rope), dtype),
                S((32, page, d_c), dtype), S((32, page, d_rope), dtype))

    assert mm.unsupported_reason(*mla()) is None
    assert "bfloat16" in mm.unsupported_reason(*mla(dtype=jnp.float32))
    assert "d_c" in mm.unsupported_reason(*mla(d_c=96))
    assert "page_size" in mm.unsupported_reason(*mla(page=24))
    ints, table = S((2,), jnp.int32), S((2, 8), jnp.int32)
    with pytest.raises(ValueError, match="page_size"):
        mm.mla_prefill_attention(*mla(page=24), ints, table, ints, scale=0.1)
    with pytest.raises(ValueError, match="q_lengths"):
        mm.mla_prefill_attention(*mla(), ints, table, S((3,), jnp.int32), scale=0.1)
    with pytest.raises(ValueError, match="matching widths"):
        mm.mla_prefill_attention(*mla()[:2], *mla(d_rope=32)[2:], ints, table, ints, scale=0.1)
    with pytest.raises(ValueError, match="scale"):
        mm.mla_prefill_attention(*mla(), ints, table, ints, scale=0.0)


def test_mla_lowers_for_h100():
    """DeepSeek-V3's widths at 512-query chunks: 128 heads (two 64-head blocks per
    position), pages of 64."""
    heads, page_size = 128, 64
    batch, max_pages = 4, 8192 // page_size
    lowered = mgpu.lower_for_cuda(
        functools.partial(mm.mla_prefill_attention, scale=0.1),
        S((batch, 512, heads, 512), jnp.bfloat16), S((batch, 512, heads, 64), jnp.bfloat16),
        S((batch * max_pages, page_size, 512), jnp.bfloat16),
        S((batch * max_pages, page_size, 64), jnp.bfloat16),
        S((batch,), jnp.int32), S((batch, max_pages), jnp.int32), S((batch,), jnp.int32))
    assert lowered.as_text().count("custom_call @mosaic_gpu") == 1
