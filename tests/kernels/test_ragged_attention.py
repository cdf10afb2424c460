"""Ragged paged attention (TPU kernel) vs the jnp prefill references.

One batch per case mixes every kind of row the engine sends: a row with no new
query, decode rows (one query, at a page's first and at position 0), a chunk
that is the whole prompt, chunks that start mid-page and cross a page
boundary, and a row that fills its table; pages are drawn from a random
permutation of the pool, table entries past a row's length hold garbage ids
(negative and past the pool), and the pool's spare pages and the unused slots
of each row's last page hold NaN, which must not reach any output.

The kernel runs in the TPU interpreter (`pltpu.InterpretParams`:
uninitialised VMEM is NaN, out-of-bounds reads raise, DMAs and semaphores are
simulated) on two simulated cores with race detection, and lowers to Mosaic
for TPU v5e, v6e and v7 from CPU. KIVI int4 pages, which the cache serves
through the quantized op's TPU kernel, are checked here on prefill rows too.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.experimental.pallas import tpu as pltpu
from kernel_cases import TOL, interpreted, make_tables

from kernels_pallas.mla_decode import reference as mla_ref
from kernels_pallas.paged_attention import reference as paged_ref
from kernels_pallas.quantized_attention import reference as quant_ref
from kernels_pallas.quantized_attention import tpu as quant_tpu
from kernels_pallas.ragged_attention import tpu
from kernels_pallas.ragged_attention.block_sizes import RaggedBlockSizes

PAGE, MAX_PAGES, Q_LEN = 8, 4, 6
# (length, new queries) per row: none; decode at position 0; the whole prompt as one
# chunk; a full table whose chunk starts mid-page; a chunk from position 14 across the
# page boundary at 16; decode at a page's first position.
ROWS = [(13, 0), (1, 1), (6, 6), (32, 3), (20, 6), (9, 1)]

_ref_gqa = jax.jit(paged_ref.paged_prefill_attention,
                   static_argnames=("scale", "soft_cap", "sliding_window"))
_ref_mla = jax.jit(mla_ref.mla_prefill_attention, static_argnames=("scale",))
_ref_quant = jax.jit(quant_ref.quantized_attention,
                     static_argnames=("k_bits", "v_bits", "scale", "soft_cap", "sliding_window"))


def _rows(rng, widths, heads_pool, dtype):
    """Queries [batch, Q_LEN, heads, w] per width in `widths[0]`, pools [heads_pool, pages,
    PAGE, w] per width in `widths[1]` (NaN in every slot no row may read), lengths, tables
    and q_lengths."""
    lengths = np.array([n for n, _ in ROWS])
    q_lengths = np.array([q for _, q in ROWS])
    tables, num_pages = make_tables(rng, lengths, PAGE, MAX_PAGES)
    host_tables = np.asarray(tables)
    dead = np.ones((num_pages, PAGE), bool)  # pool slots that hold no row's token
    for b, n in enumerate(lengths):
        for t in range(n):
            dead[host_tables[b, t // PAGE], t % PAGE] = False
    qs = [rng.standard_normal((len(ROWS), Q_LEN, heads, w)) for heads, w in widths[0]]
    pools = []
    for w in widths[1]:
        pool = rng.standard_normal((heads_pool, num_pages, PAGE, w))
        pool[:, dead] = np.nan
        pools.append(pool)

    def dev(x):  # drawn and edited on the host: no program per shape
        return jax.device_put(np.asarray(x, np.float32).astype(dtype))

    ints = [jax.device_put(x.astype(np.int32)) for x in (lengths, q_lengths)]
    return [dev(q) for q in qs], [dev(p) for p in pools], ints[0], tables, ints[1]


def _races_found() -> bool:
    """Whether the last TPU-interpreted kernel with race detection saw a race (jax >= 0.12
    raises at the race instead). The detector's state lives in a private jax module."""
    try:
        from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    except ImportError as e:  # pragma: no cover - a jax that moved it
        pytest.fail(f"the TPU interpreter's race detector moved in jax {jax.__version__}: {e}")
    return bool(ipc.races is not None and ipc.races.races_found)


def _check(got, want, dtype):
    (out, lse), (ref_out, ref_lse) = got, want
    assert out.dtype == ref_out.dtype and out.shape == ref_out.shape
    assert lse.dtype == jnp.float32 and lse.shape == ref_lse.shape
    out, lse = np.asarray(out, np.float32), np.asarray(lse)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, np.asarray(ref_out, np.float32), **TOL[dtype]["out"])
    np.testing.assert_allclose(lse, np.asarray(ref_lse), **TOL[dtype]["lse"])
    # Rows with no new query and the padding past each row's chunk: 0 and -inf.
    pad = np.arange(Q_LEN)[None, :] >= np.array([q for _, q in ROWS])[:, None]
    assert (out[pad] == 0).all() and (lse[pad] == -np.inf).all()


# (name, (q_heads, kv_heads), dtype, soft_cap, sliding_window, (block_q, block_pages)), in
# the TPU interpreter: GQA ratios 1 and 4; the default block sizes (block_q the whole chunk, four
# pages per step) and block_q 3 with two pages per step (several query blocks per chunk,
# decode rows a partial block). Pallas' plain interpret mode (what "pallas" runs on CPU)
# is exercised through kvjax.attention in tests/attention/test_pallas_dispatch.py.
GQA_CASES = [
    ("mha_f32_window", (2, 2), jnp.float32, None, 5, (3, 2)),
    ("gqa4_bf16_softcap_window", (8, 2), jnp.bfloat16, 2.0, 9, None),
]


def _tpu_interpreter():
    """The TPU interpreter on two simulated cores (the grid axis is "parallel") with race
    detection, NaN in uninitialised VMEM and out-of-bounds reads raising."""
    return pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2,
                                 uninitialized_memory="nan", out_of_bounds_reads="raise")


@pytest.mark.parametrize("case", GQA_CASES, ids=[c[0] for c in GQA_CASES])
def test_gqa_matches_reference(rng, case):
    _, (q_heads, kv_heads), dtype, soft_cap, window, blocks = case
    (q,), (k, v), lengths, tables, q_lengths = _rows(
        rng, ([(q_heads, 64)], [64, 64]), kv_heads, dtype)
    bs = None if blocks is None else RaggedBlockSizes(block_q=blocks[0],
                                                       block_tokens=blocks[1] * PAGE)
    got = interpreted(tpu.paged_prefill_attention, q, k, v, lengths, tables, q_lengths,
                      soft_cap=soft_cap, sliding_window=window, block_sizes=bs,
                      interpret=_tpu_interpreter())
    assert not _races_found()
    want = _ref_gqa(q, k, v, lengths, tables, q_lengths, soft_cap=soft_cap,
                    sliding_window=window)
    _check(got, want, dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16])
def test_mla_matches_reference(rng, dtype):
    heads, d_c, d_rope = 4, 128, 64
    (q_lat, q_rope), (latent, rope), lengths, tables, q_lengths = _rows(
        rng, ([(heads, d_c), (heads, d_rope)], [d_c, d_rope]), 1, dtype)
    latent, rope = (jax.device_put(np.asarray(x)[0]) for x in (latent, rope))  # no program
    got = interpreted(tpu.mla_prefill_attention, q_lat, q_rope, latent, rope, lengths, tables,
                      q_lengths, scale=0.1, interpret=_tpu_interpreter(),
                      block_sizes=RaggedBlockSizes(block_q=3, block_tokens=2 * PAGE))
    assert not _races_found()
    want = _ref_mla(q_lat, q_rope, latent, rope, lengths, tables, q_lengths, scale=0.1)
    _check(got, want, dtype)


def test_int4_pages_prefill_rows_match_reference(rng):
    """KIVI int4 pages (with their full-precision tail) serve ragged prefill rows through the
    quantized op's TPU kernel: rows of 0 (an empty sequence), 1 and up to 3 new queries,
    quantized lengths ending mid-page, bf16 queries with soft cap and window, in the TPU
    interpreter with race detection."""
    from test_quantized_kernels import gqa_case

    args = gqa_case(rng, bits=4, q_heads=8, kv_heads=2, q_len=3, batch=4, dtype=jnp.bfloat16)
    # New queries per row (row 0 is the empty sequence), at the end of each sequence.
    lengths, q_lengths, t = np.asarray(args[10]), np.array([0, 1, 3, 2]), np.arange(3)
    q_pos = np.where(t < q_lengths[:, None], lengths[:, None] - q_lengths[:, None] + t, -1)
    args = (*args[:-1], jax.device_put(q_pos.astype(np.int32)))
    opts = dict(k_bits=4, v_bits=4, scale=0.125, soft_cap=3.0, sliding_window=21)
    got = interpreted(quant_tpu.quantized_attention, *args, interpret=_tpu_interpreter(),
                      **opts)
    assert not _races_found()
    (out, lse), (ref_out, ref_lse) = got, _ref_quant(*args, **opts)
    assert out.dtype == jnp.bfloat16 and np.isfinite(np.asarray(out, np.float32)).all()
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32),
                               **TOL[jnp.bfloat16]["out"])
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), **TOL[jnp.bfloat16]["lse"])


def test_bad_inputs_raise_before_tracing(rng):
    S = jax.ShapeDtypeStruct
    q = S((2, 4, 4, 64), jnp.float32)
    pages = S((2, 10, PAGE, 64), jnp.float32)
    ints, table = S((2,), jnp.int32), S((2, MAX_PAGES), jnp.int32)
    with pytest.raises(ValueError, match="does not divide block_tokens"):
        tpu.paged_prefill_attention(q, pages, pages, ints, table, ints,
                                    block_sizes=RaggedBlockSizes(block_q=2, block_tokens=12))
    with pytest.raises(ValueError, match="q_heads 4 is not a multiple of kv_heads 3"):
        bad = S((3, 10, PAGE, 64), jnp.float32)
        tpu.paged_prefill_attention(q, bad, bad, ints, table, ints)
    with pytest.raises(ValueError, match="head_dim = 32 is not supported"):
        narrow = S((2, 10, PAGE, 32), jnp.float32)
        tpu.paged_prefill_attention(S((2, 4, 4, 32), jnp.float32), narrow, narrow, ints, table,
                                    ints)
    with pytest.raises(ValueError, match=r"q_lengths \(3,\)"):
        tpu.paged_prefill_attention(q, pages, pages, ints, table, S((3,), jnp.int32))
    with pytest.raises(ValueError, match="wider than the declared max_pages"):
        tpu.paged_prefill_attention(q, pages, pages, ints, table, ints, max_pages=2)
    with pytest.raises(ValueError, match="block_q must be an int >= 1"):
        RaggedBlockSizes(block_q=0, block_tokens=8)


_CHIPS = {"v5e": "TPU v5 lite", "v6e": "TPU v6 lite", "v7": "TPU7x"}


@pytest.mark.parametrize("chip", sorted(_CHIPS))
def test_lowers_for_tpu(chip):
    """Mosaic lowering from CPU for each TPU generation (an abstract device of that kind):
    GQA over bf16 pages with window and soft cap, MLA over f32 pages at DeepSeek-V3's
    widths, and 64-query prefill chunks over KIVI int4 pages (keys in groups of 16 tokens,
    values in groups of 32 channels)."""
    from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

    S = jax.ShapeDtypeStruct
    batch, q_len, pages, max_pages = 4, 64, 64, 8
    i32 = (S((batch,), jnp.int32), S((batch, max_pages), jnp.int32), S((batch,), jnp.int32))
    gqa = functools.partial(tpu.paged_prefill_attention, soft_cap=30.0, sliding_window=100)
    gqa_args = (S((batch, q_len, 32, 128), jnp.bfloat16),
                *(S((8, pages, 16, 128), jnp.bfloat16),) * 2, *i32)
    mla = functools.partial(tpu.mla_prefill_attention, scale=0.1)
    mla_args = (S((batch, q_len, 16, 512), jnp.float32), S((batch, q_len, 16, 64), jnp.float32),
                S((pages, 16, 512), jnp.float32), S((pages, 16, 64), jnp.float32), *i32)
    int4 = functools.partial(quant_tpu.quantized_pages_attention, k_bits=4, v_bits=4,
                             scale=0.1, soft_cap=30.0, sliding_window=100)
    u8, f16 = jnp.uint8, jnp.float16
    int4_args = (S((batch, q_len, 32, 128), jnp.bfloat16),
                 S((8, pages, 16, 64), u8), *(S((8, pages, 1, 128), f16),) * 2,
                 S((8, pages, 16, 64), u8), *(S((8, pages, 16, 4), f16),) * 2,
                 S((batch,), jnp.int32), S((batch, max_pages), jnp.int32),
                 S((batch, q_len), jnp.int32))
    mesh = AbstractMesh((), (), abstract_device=AbstractDevice(_CHIPS[chip], 1, "tpu"))
    with use_abstract_mesh(mesh):
        for fn, args in ((gqa, gqa_args), (mla, mla_args), (int4, int4_args)):
            module = export.export(jax.jit(fn), platforms=["tpu"])(*args).mlir_module()
            assert module.count("tpu_custom_call") == 1
