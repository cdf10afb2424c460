"""The Mosaic GPU paged decode kernel, checked on a CPU-only machine.

Correctness runs in Mosaic GPU's interpreter (simulated shared memory, TMA,
barriers and wgmma) with its race detector on, against the jnp reference, on
tiny shapes: the interpreter is slow. Lowering for an H100 from CPU runs the
whole Mosaic GPU lowering (layouts, wgmma shapes, shared-memory transforms) at
production shapes. `choose_splits` is a pure function, checked by its
properties.
"""

import functools
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import _mosaic_gpu as mgpu
from kernels_pallas.paged_attention import mosaic_gpu as mk
from tests.kernels.kernel_cases import assert_close, ref_decode

S = jax.ShapeDtypeStruct


def _case(rng, *, q_heads, kv_heads, head_dim, page_size, max_pages, lengths, q_dtype,
          page_dtype=jnp.bfloat16):
    """Random inputs with permuted pages, two sequences sharing their first page (a forked
    prefix), garbage table entries past each length and NaN in every cached row no query
    may see (the rest of each last page, the dead pages)."""
    lengths = np.asarray(lengths, np.int32)
    used = -(-lengths // page_size)
    num_pages = int(used.sum()) + 2
    perm = rng.permutation(num_pages)
    tables = rng.choice([-3, num_pages, 10**6], size=(len(lengths), max_pages)).astype(np.int32)
    start = 0
    for b, n in enumerate(used):
        tables[b, :n] = perm[start:start + n]
        start += n
    tables[1, 0] = tables[0, 0]  # shared prefix page (lengths[0] ends inside it)

    def draw(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    k = draw(kv_heads, num_pages, page_size, head_dim)
    v = draw(kv_heads, num_pages, page_size, head_dim)
    seen = np.zeros((num_pages, page_size), bool)
    for b, n in enumerate(lengths):
        for t in range(n):
            seen[tables[b, t // page_size], t % page_size] = True
    k[:, ~seen] = np.nan
    v[:, ~seen] = np.nan
    q = draw(len(lengths), q_heads, head_dim)
    put = jax.device_put
    return (put(q.astype(q_dtype)), put(k.astype(page_dtype)), put(v.astype(page_dtype)),
            put(lengths), put(tables))


# lengths: shorter than a page, ending mid-page, the shared-prefix page's owner and a
# sequence filling the table; in the first case the first two leave the second split empty.
CASES = {
    # Float32 queries over bf16 pages (hi + lo query parts).
    "f32q_group4_page16": dict(
        shape=dict(q_heads=4, kv_heads=1, head_dim=64, page_size=16, max_pages=8,
                   lengths=[11, 37, 128], q_dtype=jnp.float32),
        static=dict(),
    ),
    # Float32 pages (hi + lo bfloat16 parts of Q, K, P and V) in pages of 4 rows (several
    # TMA copies a step, repacked through registers into 8-row tiles), float32 accuracy.
    # One split of 6 steps over 4 stages: the pipeline reuses its ring of buffers.
    "f32_pages_page4_window_softcap": dict(
        shape=dict(q_heads=2, kv_heads=1, head_dim=32, page_size=4, max_pages=96,
                   lengths=[5, 61, 380], q_dtype=jnp.float32, page_dtype=jnp.float32),
        static=dict(sliding_window=300, soft_cap=4.0, num_sms=1),
    ),
    # Width 512 in bf16: two programs per KV head, each accumulating 256 value columns.
    "bf16_width512": dict(
        shape=dict(q_heads=2, kv_heads=1, head_dim=512, page_size=8, max_pages=8,
                   lengths=[3, 37, 64], q_dtype=jnp.bfloat16),
        static=dict(num_sms=1),
    ),
}


@functools.partial(jax.jit, static_argnames=("soft_cap", "sliding_window", "num_sms"))
def _interpreted(q, k, v, lengths, tables, soft_cap=None, sliding_window=None, num_sms=132):
    return mk.paged_decode_attention(
        q, k, v, lengths, tables, soft_cap=soft_cap, sliding_window=sliding_window,
        num_sms=num_sms, interpret=mgpu.interpret_params(detect_races=True),
    )


@pytest.mark.parametrize("name", sorted(CASES))
def test_interpreted_matches_reference(name):
    case = CASES[name]
    shape = case["shape"]
    q, k, v, lengths, tables = _case(np.random.default_rng(zlib.crc32(name.encode())), **shape)
    page_dtype = jnp.dtype(shape.get("page_dtype", jnp.bfloat16))
    cfg = mk.kernel_config(len(shape["lengths"]), shape["kv_heads"], shape["max_pages"],
                           shape["page_size"], shape["head_dim"], shape["head_dim"],
                           page_dtype.itemsize, case["static"].get("num_sms", 132))
    span = cfg.pages_per_split * shape["page_size"]
    if cfg.num_splits > 1:
        assert min(shape["lengths"]) <= span  # an empty split runs
    elif "sliding_window" in case["static"]:  # visible steps outnumber the stages
        window = case["static"]["sliding_window"]
        assert -(-max(shape["lengths"]) // cfg.block_tokens) - (
            (max(shape["lengths"]) - window) // cfg.block_tokens) > cfg.num_stages

    mgpu.reset_interpreter()
    out, lse = jax.block_until_ready(_interpreted(q, k, v, lengths, tables, **case["static"]))
    assert not mgpu.interpreter_races_found()
    ref_static = {name: value for name, value in case["static"].items() if name != "num_sms"}
    ref_out, ref_lse = ref_decode(q, k, v, lengths, tables, **ref_static)
    if page_dtype == jnp.float32:
        # hi + lo parts of Q, K, P and V (all products but lo x lo): the float32 kernels'
        # tolerance (kernel_cases.TOL).
        assert_close((out, lse), (ref_out, ref_lse), jnp.float32)
        return
    assert out.dtype == q.dtype and lse.dtype == jnp.float32
    # bf16 P before P V (2^-8 relative) and, for bf16 queries, a bf16 output; the logits
    # are exact products of bf16 values (float32 queries: hi + lo parts, ~2^-16).
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32),
                               rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-4, atol=1e-4)


def _efficiency(programs, splits, slots):
    waves = programs * splits / slots
    return waves / math.ceil(waves)


@pytest.mark.parametrize("num_sms", [8, 132])
def test_choose_splits_properties(num_sms):
    for programs in (1, 3, 8, 20, 64, 105, 106, 512):
        for num_steps in (1, 2, 7, 64, 2048):
            s = mk.choose_splits(programs, num_steps, num_sms)
            assert 1 <= s <= min(num_steps, 128)
            if programs >= 0.8 * num_sms:
                assert s == 1
                continue
            # Split counts that change the steps per split (more splits that leave it
            # unchanged only add empty programs).
            eligible = [t for t in range(1, min(128, num_steps, num_sms) + 1)
                        if t == 1 or -(-num_steps // t) != -(-num_steps // (t - 1))]
            best = max(_efficiency(programs, t, num_sms) for t in eligible)
            assert s in eligible and _efficiency(programs, s, num_sms) >= 0.85 * best
            assert all(_efficiency(programs, t, num_sms) < 0.85 * best  # the fewest
                       for t in eligible if t < s)
            if num_steps >= num_sms:  # a long sequence fills the GPU in whole waves
                assert _efficiency(programs, s, num_sms) >= 0.85
    with pytest.raises(ValueError, match="num_sms"):
        mk.choose_splits(8, 10, 0)


def test_kernel_config_fills_the_gpu():
    # One 128K-token sequence over 8 KV heads (page 16) spreads over >= 85% of 132 SMs;
    # 64 x 8K needs no split; every split's pages are whole steps and the table is covered.
    cfg = mk.kernel_config(1, 8, 8192, 16, 128, 128, 2, 132)
    assert 8 * cfg.num_splits >= 0.85 * 132 and 8 * cfg.num_splits <= 2 * 132
    assert cfg.num_splits * cfg.pages_per_split >= 8192
    assert (cfg.pages_per_split * 16) % cfg.block_tokens == 0
    assert cfg.num_stages == 4
    assert mk.kernel_config(64, 8, 512, 16, 128, 128, 2, 132).num_splits == 1
    assert mk.kernel_config(1, 8, 64, 16, 256, 256, 2, 132).num_stages >= 2


def test_unsupported_reason():
    q, pages = S((2, 32, 128), jnp.bfloat16), S((8, 64, 16, 128), jnp.bfloat16)
    assert mk.unsupported_reason(q, pages, pages) is None
    assert mk.unsupported_reason(S((2, 32, 128), jnp.float32), pages, pages) is None
    # Every dtype, width and page size the Triton kernel takes, within shared memory.
    f32_q = S((2, 32, 128), jnp.float32)
    for page_size in (1, 2, 4, 8, 128):
        for dtype in (jnp.bfloat16, jnp.float32):
            p = S((8, 64, page_size, 128), dtype)
            assert mk.unsupported_reason(f32_q, p, p) is None, (page_size, dtype)
    wide_q, wide = S((2, 32, 512), jnp.bfloat16), S((8, 64, 16, 512), jnp.bfloat16)
    assert mk.unsupported_reason(wide_q, wide, wide) is None
    # What does not fit 200 KiB of shared memory goes to Triton, saying so.
    f32_256 = S((8, 64, 16, 256), jnp.float32)
    assert "shared memory" in mk.unsupported_reason(S((2, 32, 256), jnp.float32), f32_256,
                                                    f32_256)
    assert "shared memory" in mk.unsupported_reason(S((2, 32, 512), jnp.float32), wide, wide)
    odd = S((8, 64, 12, 128), jnp.bfloat16)
    assert "page sizes" in mk.unsupported_reason(q, odd, odd)
    narrow = S((8, 64, 16, 8), jnp.bfloat16)
    assert "head_dim" in mk.unsupported_reason(S((2, 32, 8), jnp.bfloat16), narrow, narrow)
    lengths, tables = S((2,), jnp.int32), S((2, 8), jnp.int32)
    with pytest.raises(ValueError, match="page sizes"):
        jax.eval_shape(mk.paged_decode_attention, q, odd, odd, lengths, tables)


@pytest.mark.parametrize("page_size,head_dim,dtype", [
    (16, 128, jnp.bfloat16), (64, 64, jnp.bfloat16), (16, 256, jnp.bfloat16),
    (16, 128, jnp.float32),  # float32 pages and queries: hi + lo parts
    (4, 64, jnp.bfloat16),  # pages below one 8-row tile
    (16, 512, jnp.bfloat16),  # two value-column blocks
])
def test_lowers_for_h100(page_size, head_dim, dtype):
    pages = S((8, 256, page_size, head_dim), dtype)
    lowered = mgpu.lower_for_cuda(
        mk.paged_decode_attention, S((4, 32, head_dim), dtype), pages, pages,
        S((4,), jnp.int32), S((4, 64), jnp.int32), sliding_window=1000, soft_cap=30.0,
    )
    assert lowered.as_text().count("custom_call @mosaic_gpu") == 1
