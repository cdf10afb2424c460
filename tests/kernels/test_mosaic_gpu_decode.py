"""The Mosaic GPU paged decode kernel, checked on a CPU-only machine.

Correctness runs in Mosaic GPU's interpreter (simulated shared memory, TMA,
barriers and wgmma) with its race detector on, against the jnp reference, on
tiny shapes: the interpreter is slow. Lowering for an H100 from CPU runs the
whole Mosaic GPU lowering (layouts, wgmma shapes, shared-memory transforms) at
production shapes. `choose_splits` is a pure function, checked by its
properties.
"""

import functools
import itertools
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import _mosaic_gpu as mgpu
from kernels_pallas.paged_attention import mosaic_gpu as mk
from kernels_pallas.paged_attention.block_sizes import GPU_HEAD_DIMS
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
    # Float32 pages at width 256 (hi + mid + lo bfloat16 parts of Q, K, P and V), float32
    # accuracy over a 3-token sequence (where hi + lo parts alone erred by 1.3e-5): a
    # step's K and V do not fit shared memory whole, so each comes in 64-column
    # parts through rings of 2 slots (the rings wrap within a step; Q K^T sums the parts,
    # P V fills the output's column parts); pages of 4 rows (a loop of 16 TMA copies per
    # part, repacked through registers into 8-row tiles); the window skips the first step.
    "f32_pages_width256_page4_window_softcap": dict(
        shape=dict(q_heads=2, kv_heads=1, head_dim=256, page_size=4, max_pages=40,
                   lengths=[3, 150], q_dtype=jnp.float32, page_dtype=jnp.float32),
        static=dict(sliding_window=80, soft_cap=4.0, num_sms=1),
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
    elif "sliding_window" in case["static"]:  # the window skips a step; rings wrap
        window, longest = case["static"]["sliding_window"], max(shape["lengths"])
        assert longest - window >= cfg.block_tokens
        steps = -(-longest // cfg.block_tokens) - (longest - window) // cfg.block_tokens
        assert steps * shape["head_dim"] // cfg.k_cols > cfg.num_stages

    mgpu.reset_interpreter()
    out, lse = jax.block_until_ready(_interpreted(q, k, v, lengths, tables, **case["static"]))
    assert not mgpu.interpreter_races_found()
    ref_static = {name: value for name, value in case["static"].items() if name != "num_sms"}
    ref_out, ref_lse = ref_decode(q, k, v, lengths, tables, **ref_static)
    if page_dtype == jnp.float32:
        # hi + mid + lo parts of Q, K, P and V (the 6 part products above 2^-24): the
        # float32 kernels' tolerance (kernel_cases.TOL).
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
    assert (cfg.k_cols, cfg.v_cols) == (128, 128)  # whole rows where 2+ stages fit
    # Pages of one row over 128K tokens: the staged block table stays within 16 KiB (the
    # shared memory beside the 200 KiB budget) by taking more splits.
    cfg = mk.kernel_config(1, 8, 131072, 1, 128, 128, 2, 132)
    assert cfg.table_window * 4 <= 16 * 1024
    assert cfg.num_splits * cfg.pages_per_split >= 131072 and cfg.pages_per_split % 64 == 0


def test_kernel_config_fits_shared_memory():
    # Every geometry the kernel takes fits the shared-memory budget, counted here from the
    # config: stage slots of K and V column parts in the pages' dtype, the query (16-bit
    # parts, or float32 over float32 pages plus its 3 bfloat16 parts of one column part)
    # and, for repacked pages, the 16-bit operand buffers (V's shared with K's when equally
    # wide).
    for itemsize, q_parts, width, page_size in itertools.product(
        (2, 4), (1, 2), GPU_HEAD_DIMS, (1, 4, 16, 128)
    ):
        if itemsize == 4 and q_parts == 1:  # float32 pages keep a float32 query
            continue
        cfg = mk.kernel_config(2, 8, 64, page_size, width, width, itemsize, 132,
                               q_parts=q_parts)
        assert width % cfg.k_cols == 0 and cfg.v_block % cfg.v_cols == 0
        assert cfg.num_stages >= 1 and cfg.k_cols >= min(width, 32)
        assert cfg.parts == (3 if itemsize == 4 else 1)
        kc, vc = cfg.k_cols, cfg.v_cols
        used = cfg.num_stages * 64 * (kc + vc) * itemsize
        if itemsize == 4:
            used += 64 * width * 4 + 3 * 64 * kc * 2
        else:
            used += q_parts * 64 * width * 2
        if page_size < 8 or itemsize == 4:
            used += cfg.parts * 64 * (kc + (vc if vc != kc else 0)) * 2
        assert used <= 200 * 1024, (itemsize, q_parts, width, page_size, cfg)
    f32_512 = mk.kernel_config(2, 8, 64, 16, 512, 512, 4, 132)
    assert (f32_512.k_cols, f32_512.v_block, f32_512.num_stages) == (32, 256, 3)


def test_unsupported_reason(monkeypatch):
    q, pages = S((2, 32, 128), jnp.bfloat16), S((8, 64, 16, 128), jnp.bfloat16)
    assert mk.unsupported_reason(q, pages, pages) is None
    # Every page dtype, query dtype, width and page size the Triton kernel takes (gpu.py:
    # GPU_HEAD_DIMS, power-of-two pages) runs here; on jax 0.10 only its TMA lowering
    # limit (copies of whole 128 bytes) sends the narrowest tiny-page copies to Triton.
    for page_dtype, q_dtype, width, page_size in itertools.product(
        (jnp.bfloat16, jnp.float32), (jnp.bfloat16, jnp.float32), GPU_HEAD_DIMS,
        (1, 2, 4, 8, 16, 32, 64, 128, 256),
    ):
        p = S((8, 64, page_size, width), page_dtype)
        reason = mk.unsupported_reason(S((2, 32, width), q_dtype), p, p)
        copy = width * jnp.dtype(page_dtype).itemsize * page_size
        if mgpu.JAX_VERSION >= (0, 11) or copy >= 128:
            assert reason is None, (page_dtype, q_dtype, width, page_size, reason)
        else:
            assert "jax 0.10 lowering limit" in reason, reason
    # A geometry beyond shared memory (here a budget cut to 64 KiB) goes to Triton, saying so.
    monkeypatch.setattr(mk, "_SMEM_BUDGET", 64 * 1024)
    f32_512 = S((8, 64, 16, 512), jnp.float32)
    assert "shared memory" in mk.unsupported_reason(S((2, 32, 512), jnp.float32), f32_512,
                                                    f32_512)
    monkeypatch.undo()
    odd = S((8, 64, 12, 128), jnp.bfloat16)
    assert "page sizes" in mk.unsupported_reason(q, odd, odd)
    narrow = S((8, 64, 16, 8), jnp.bfloat16)
    assert "head_dim" in mk.unsupported_reason(S((2, 32, 8), jnp.bfloat16), narrow, narrow)
    lengths, tables = S((2,), jnp.int32), S((2, 8), jnp.int32)
    with pytest.raises(ValueError, match="page sizes"):
        jax.eval_shape(mk.paged_decode_attention, q, odd, odd, lengths, tables)


@pytest.mark.parametrize("page_size,head_dim,dtype,q_dtype", [
    (16, 128, jnp.bfloat16, jnp.bfloat16), (64, 64, jnp.bfloat16, jnp.bfloat16),
    (16, 256, jnp.bfloat16, jnp.bfloat16),
    (16, 128, jnp.float32, jnp.float32),  # float32 pages: 3 parts, 64-column parts
    # Pages of one row: a loop of 64 copies a part, K and V in 64-column parts (one
    # register pass each; whole 256-column rows did not lower in minutes on jax 0.11.2).
    (1, 256, jnp.bfloat16, jnp.bfloat16),
    (16, 512, jnp.bfloat16, jnp.bfloat16),  # two value-column blocks
    # Width 512 with float32 queries over pages of 4 rows: K and V in 64-column parts.
    (4, 512, jnp.bfloat16, jnp.float32),
    # Float32 pages at width 512: 32-column parts, two value-column blocks, pages of 2.
    (2, 512, jnp.float32, jnp.float32),
])
def test_lowers_for_h100(page_size, head_dim, dtype, q_dtype):
    pages = S((8, 256, page_size, head_dim), dtype)
    lowered = mgpu.lower_for_cuda(
        mk.paged_decode_attention, S((4, 32, head_dim), q_dtype), pages, pages,
        S((4,), jnp.int32), S((4, 64), jnp.int32), sliding_window=1000, soft_cap=30.0,
    )
    assert lowered.as_text().count("custom_call @mosaic_gpu") == 1
