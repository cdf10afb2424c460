"""The C++ CPU decode kernels (impl="cpu") against the gather references."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hlo_written import materialised
from test_xla_quantized import D as qz_D
from test_xla_quantized import _close as q_close
from test_xla_quantized import random_cache

import kvjax as kvx
from kernels_pallas.mla_decode import reference as mla_ref
from kernels_pallas.paged_attention import reference as paged_ref
from kernels_pallas.quantized_attention import reference as qref
from kvjax import attention
from kvjax.attention import paged_decode_attention
from kvjax.backends import cpu as cpu_kernels
from kvjax.backends.cpu import build, policy
from kvjax.cache import quantized as qz

needs_kernel = pytest.mark.cpu_kernels

# The kernel computes in float32 like the reference; only the summation order differs.
# bf16 outputs are compared after both round to bf16 (one bf16 ulp is 2^-8 relative).
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 1e-2}

# Jitted: run op by op, the reference's dispatch dominates these tests' time.
reference = jax.jit(paged_ref.paged_decode_attention,
                    static_argnames=("scale", "soft_cap", "sliding_window"))
# One program per case shape, shared by every build and test that draws that case.
quantized_reference = jax.jit(qref.quantized_attention,
                              static_argnames=("k_bits", "v_bits", "scale", "soft_cap",
                                               "sliding_window"))


def _put(x, dtype):
    """`x` converted on the host and committed: eager jnp.asarray compiles a program per
    shape and dtype."""
    return jax.device_put(np.asarray(x, dtype))


def _case(rng, *, batch, q_heads, kv_heads, head_dim, page_size, max_pages, dtype,
          shared=False, lengths=None):
    num_pages = batch * max_pages + 3
    if shared:  # pages drawn with replacement: sequences share (and repeat) pages
        tables = rng.integers(0, num_pages, (batch, max_pages))
    else:
        tables = rng.permutation(num_pages)[: batch * max_pages].reshape(batch, max_pages)
    if lengths is None:
        lengths = rng.integers(1, max_pages * page_size + 1, batch)

    def draw(*shape):
        return _put(rng.standard_normal(shape), dtype)

    return (draw(batch, q_heads, head_dim), draw(kv_heads, num_pages, page_size, head_dim),
            draw(kv_heads, num_pages, page_size, head_dim),
            _put(lengths, np.int32), _put(tables, np.int32))


def _close(got, want, dtype):
    (out, lse), (out_r, lse_r) = got, want
    assert out.dtype == out_r.dtype and lse.dtype == jnp.float32
    tol = TOL[dtype]
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(out_r, np.float32),
                               rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_r), rtol=2e-5, atol=2e-5)


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "q_heads,kv_heads,head_dim,page_size",
    [(4, 4, 64, 16), (16, 4, 128, 16), (8, 1, 40, 5), (6, 2, 128, 7), (12, 1, 64, 32)],
    ids=["mha-d64", "gqa4-d128", "mqa-d40-ps5", "gqa3-ps7", "mqa12-d64"],
)
def test_matches_reference(rng, dtype, q_heads, kv_heads, head_dim, page_size):
    """GQA ratios 1, 4, 3 and MQA (12 query rows: bf16 takes them 8 and 4 at a time); the
    unrolled head dims and a generic one; pages holding whole 16-token chunks and pages that
    do not. Lengths: 1, a full last page,
    a partial one, 0, random."""
    max_pages = 5
    full = max_pages * page_size
    lengths = np.concatenate([[1, full, 2 * page_size + 3, 0],
                              rng.integers(1, full + 1, 3)])
    for shared in (False, True):
        args = _case(rng, batch=len(lengths), q_heads=q_heads, kv_heads=kv_heads,
                     head_dim=head_dim, page_size=page_size, max_pages=max_pages, dtype=dtype,
                     shared=shared, lengths=lengths)
        got = paged_decode_attention(*args, impl="cpu")
        _close(got, reference(*args), dtype)
        out, lse = np.asarray(got[0], np.float32), np.asarray(got[1])
        assert np.all(out[3] == 0.0) and np.all(np.isneginf(lse[3]))


@needs_kernel
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_soft_cap_sliding_window_scale(rng, dtype):
    args = _case(rng, batch=5, q_heads=8, kv_heads=2, head_dim=128, page_size=16, max_pages=4,
                 dtype=dtype, shared=True, lengths=[1, 64, 37, 17, 50])
    for kw in (dict(soft_cap=3.0), dict(sliding_window=1), dict(sliding_window=21),
               dict(sliding_window=21, soft_cap=5.0, scale=0.3)):
        got = paged_decode_attention(*args, impl="cpu", **kw)
        _close(got, reference(*args, **kw), dtype)


def _shared_prefix_case(rng, *, q_heads, kv_heads, head_dim, page_size, dtype):
    """Eight sequences over one pool: 0-5 begin with the same `prefix` pages (1 and 3 with
    only its first half, then their own), 2 ends exactly where the prefix does, 6 has
    pages of its own, 7 is empty."""
    prefix, own, batch = 8, 3, 8
    max_pages = prefix + own
    perm = iter(rng.permutation(batch * max_pages + 3))  # _case's pool
    common = [next(perm) for _ in range(prefix)]
    tables, lengths = [], []
    for b in range(batch):
        lead = {0: prefix, 2: prefix, 4: prefix, 5: prefix, 1: prefix // 2, 3: prefix // 2}
        n = lead.get(b, 0)
        tables.append(common[:n] + [next(perm) for _ in range(max_pages - n)])
        lengths.append(int(rng.integers(n * page_size + 1, max_pages * page_size + 1)))
    lengths[2], lengths[7] = prefix * page_size, 0
    args = _case(rng, batch=batch, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                 page_size=page_size, max_pages=max_pages, dtype=dtype, lengths=lengths)
    return (*args[:4], _put(tables, np.int32))


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim,page_size",
                         [(4, 2, 32, 16), (8, 1, 128, 32), (8, 2, 64, 8)],
                         ids=["gqa2-d32", "mqa8-d128-ps32", "gqa4-d64-ps8"])
def test_shared_pages_read_once_give_the_same_bits(rng, cpu_options, dtype, q_heads, kv_heads,
                                                   head_dim, page_size):
    """Sequences that begin on the same pages are read together there (runs), with the
    same bits as one by one, and each shared position is walked once per run (the
    kernel's count of the positions its work items read); pages of 8 tokens put two
    pages in a 16-token chunk."""
    args = _shared_prefix_case(rng, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                               page_size=page_size, dtype=dtype)
    lengths, tables = np.asarray(args[3]), np.asarray(args[4])
    group = q_heads // kv_heads
    run_of, tokens = cpu_kernels.shared_runs(lengths, tables, page_size=page_size,
                                             group=group, kv_heads=kv_heads, share=16)
    assert run_of[0] >= 0 and run_of[6] == run_of[7] == -1
    for r in set(run_of[run_of >= 0].tolist()):
        members = np.flatnonzero(run_of == r)
        n = tokens[members[0]]
        assert len(members) >= 2 and np.all(tokens[members] == n) and n >= 16 and n % 16 == 0
        assert np.all(lengths[members] >= n)  # every member sees all of the run's positions
        pages = -(-n // page_size)
        assert np.all(tables[members, :pages] == tables[members[0], :pages])
    # Runs are halved (each keeps two sequences or more) while workers would idle.
    split, _ = cpu_kernels.shared_runs(lengths, tables, page_size=page_size, group=group,
                                       kv_heads=kv_heads, share=16, workers=8)
    assert np.all((split >= 0) == (run_of >= 0))
    assert len(set(split[split >= 0].tolist())) > len(set(run_of[run_of >= 0].tolist()))
    assert all(np.sum(split == r) >= 2 for r in set(split[split >= 0].tolist()))

    # One worker: the kernel forms the runs shared_runs(workers=1) reports (no halving).
    cpu_options(threads=1)
    outs, walked = [], []
    for share in (0, 16):
        cpu_options(share=share)
        cpu_kernels.decode_positions_walked()  # resets the count
        outs.append(jax.block_until_ready(paged_decode_attention(*args, impl="cpu")))
        walked.append(cpu_kernels.decode_positions_walked())
    _close(outs[0], reference(*args), dtype)
    for a, b in zip(outs[0], outs[1], strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    # The pages are read once per run: each sequence walks its visible positions alone
    # (share 0); with runs, a run's shared positions are walked once for all its members.
    visible = np.minimum(lengths, tables.shape[1] * page_size)
    runs = {r: tokens[run_of == r][0] for r in set(run_of[run_of >= 0].tolist())}
    assert walked[0] == kv_heads * visible.sum()
    assert walked[1] == kv_heads * (sum(runs.values()) + (visible - tokens).sum())
    assert walked[1] < walked[0]


@needs_kernel
def test_shared_runs_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"lengths \[batch\] and block_tables"):
        cpu_kernels.shared_runs(np.ones(3), np.zeros((2, 4)), page_size=16)


prefill_reference = jax.jit(paged_ref.paged_prefill_attention,
                            static_argnames=("scale", "soft_cap", "sliding_window"))


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim,page_size,item_rows", [
    (4, 4, 64, 16, 192), (8, 2, 40, 7, 9), (6, 1, 128, 16, 5)],
    ids=["mha-d64", "gqa4-d40-ps7", "mqa6-d128-small-items"])
def test_prefill_matches_reference(rng, dtype, q_heads, kv_heads, head_dim, page_size,
                                   item_rows):
    """Chunks continuing a sequence (and one starting it), an idle row, a row of one query,
    key blocks crossing pages and the causal diagonal; work items of a few rows (query
    blocks cut inside a GQA group's positions) and of the whole chunk."""
    q_len, max_pages = 70, 12
    lengths = np.array([70, 150, 3, 0, max_pages * page_size])
    q_lengths = np.array([70, 70, 1, 0, 45])
    _, k, v, lengths, tables = _case(rng, batch=5, q_heads=q_heads, kv_heads=kv_heads,
                                     head_dim=head_dim, page_size=page_size,
                                     max_pages=max_pages, dtype=dtype, lengths=lengths)
    q = _put(rng.standard_normal((5, q_len, q_heads, head_dim)), dtype)
    args = (q, k, v, lengths, tables, _put(q_lengths, np.int32))
    got = jax.jit(functools.partial(cpu_kernels.paged_prefill_attention,
                                    item_rows=item_rows))(*args)
    _close(got, prefill_reference(*args), dtype if dtype != jnp.float16 else jnp.bfloat16)
    out, lse = np.asarray(got[0], np.float32), np.asarray(got[1])
    assert np.all(out[3] == 0.0) and np.all(np.isneginf(lse[3]))
    assert np.all(np.isneginf(lse[2, 1:])) and np.all(np.isneginf(lse[4, 45:]))


@needs_kernel
def test_prefill_window_soft_cap_and_layer(rng):
    """Sliding windows shorter than a key block and than the chunk, a soft cap, a scale,
    and a layer of whole pools read in place: equal to the reference."""
    layers = 3
    _, k, v, lengths, tables = _case(rng, batch=3, q_heads=8, kv_heads=2, head_dim=64,
                                     page_size=16, max_pages=10, dtype=jnp.float32,
                                     lengths=[160, 97, 40])
    q = _put(rng.standard_normal((3, 40, 8, 64)), np.float32)
    q_lengths = _put([40, 33, 40], np.int32)
    k_all, v_all = (rng.standard_normal((layers, *x.shape)).astype(np.float32) for x in (k, v))
    k_all[1], v_all[1] = k, v
    k_all, v_all = jax.device_put((k_all, v_all))
    for kw in (dict(sliding_window=5), dict(sliding_window=70, soft_cap=4.0, scale=0.2)):
        want = prefill_reference(q, k, v, lengths, tables, q_lengths, **kw)
        _close(attention.paged_prefill_attention(q, k, v, lengths, tables, q_lengths,
                                                 impl="cpu", **kw), want, jnp.float32)
        _close(attention.paged_prefill_attention(q, k_all, v_all, lengths, tables, q_lengths,
                                                 impl="cpu", layer=1, **kw), want, jnp.float32)


@needs_kernel
@pytest.mark.parametrize("head_dim", [64, 33])
def test_prefill_bf16_pages_by_query_dtype(rng, head_dim):
    """bfloat16 pages: bfloat16 queries (on an AVX512_BF16 build their logits run on
    vdpbf16ps, the scale applied to the logits) with a window, a soft cap and a scale, and
    float32 queries, which stay float32 (equal to the reference at float32's tolerance);
    an odd head_dim takes the float32 path."""
    _, k, v, lengths, tables = _case(rng, batch=3, q_heads=8, kv_heads=2, head_dim=head_dim,
                                     page_size=16, max_pages=10, dtype=jnp.bfloat16,
                                     lengths=[160, 97, 40])
    q32 = rng.standard_normal((3, 40, 8, head_dim)).astype(np.float32)
    q_lengths = _put([40, 33, 40], np.int32)
    for q, tol in ((_put(q32, jnp.bfloat16), jnp.bfloat16), (_put(q32, np.float32), jnp.float32)):
        for kw in (dict(), dict(sliding_window=5),
                   dict(sliding_window=70, soft_cap=4.0, scale=0.2)):
            want = prefill_reference(q, k, v, lengths, tables, q_lengths, **kw)
            _close(attention.paged_prefill_attention(q, k, v, lengths, tables, q_lengths,
                                                     impl="cpu", **kw), want, tol)


@needs_kernel
def test_jit_and_layers_scan_read_pools_in_place(rng):
    """Under jit, whole pools + a traced layer inside a scan over layers (how the models
    call it): equal to the reference per layer, and the program copies no layer pool."""
    layers, dtype = 3, jnp.bfloat16
    q, k, v, lengths, tables = _case(rng, batch=4, q_heads=8, kv_heads=2, head_dim=64,
                                     page_size=16, max_pages=4, dtype=dtype)
    k_host, v_host = (np.asarray(rng.standard_normal((layers, *x.shape)), dtype) for x in (k, v))
    k_all, v_all = jax.device_put((k_host, v_host))

    def run(impl):
        def step(x, layer):
            out, _ = paged_decode_attention(x, k_all, v_all, lengths, tables, impl=impl,
                                            layer=layer)
            return x, out
        return jax.jit(lambda x: jax.lax.scan(step, x, jnp.arange(layers))[1])

    got = np.asarray(run("cpu")(q), np.float32)
    for layer in range(layers):
        want = reference(q, *jax.device_put((k_host[layer], v_host[layer])), lengths, tables)
        np.testing.assert_allclose(got[layer],
                                   np.asarray(want[0], np.float32), rtol=1e-2, atol=1e-2)

    def scan_kv(q, k_all, v_all):
        def step(x, layer):
            return x, paged_decode_attention(x, k_all, v_all, lengths, tables, impl="cpu",
                                             layer=layer)[0]
        return jax.lax.scan(step, q, jnp.arange(layers))[1]

    written = materialised(scan_kv, q, k_all, v_all)
    assert max(n for *_, n in written) < int(np.prod(k.shape)), written


@needs_kernel
def test_vmap_runs_per_element(rng):
    """vmap is not needed by kvjax; it works by running the kernel per mapped element."""
    args = _case(rng, batch=2, q_heads=4, kv_heads=2, head_dim=64, page_size=16, max_pages=2,
                 dtype=jnp.float32)
    q = np.asarray(args[0])
    qs = np.stack([q, -q])
    got = jax.vmap(lambda q: cpu_kernels.paged_decode_attention(q, *args[1:]))(
        jax.device_put(qs))
    got = jax.device_get(got)
    for i in range(2):
        _close((got[0][i], got[1][i]), reference(jax.device_put(qs[i]), *args[1:]),
               jnp.float32)


@needs_kernel
def test_choose_decides_each_op():
    """`choose` (what "auto" asks): the kernel for the decode ops on a build where it was
    measured faster, the XLA path for ops without a kernel, for float32 pools (XLA writes
    those in place), for a matmul of more rows than the kernel serves or over several
    devices; the options switch each decision."""
    lib = cpu_kernels.library()
    for op in ("paged_decode", "paged_prefill", "quantized_decode", "mla_decode",
               "paged_decode_attention", "paged_prefill_attention", "quantized_attention",
               "mla_decode_attention"):
        want = lib.isa_class in policy._MEASURED[policy.ALIASES.get(op, op)]
        for dtype in (jnp.float32, jnp.bfloat16):
            choice = cpu_kernels.choose(op, dtype=dtype)
            assert choice.use_kernel == want and lib.isa_class in choice.reason, choice
    for op in ("mla_prefill_attention", "quantized_mla_attention"):
        assert not cpu_kernels.choose(op).use_kernel
    with pytest.raises(ValueError, match="unknown op"):
        cpu_kernels.choose("no_such_op")
    assert cpu_kernels.choose("write_rows", dtype=jnp.bfloat16).use_kernel
    assert cpu_kernels.choose("copy_pages", dtype=jnp.float16).use_kernel
    # Any dtype on one device; 16-bit pools on any number.
    assert cpu_kernels.choose("copy_pages", dtype=jnp.float32, devices=1).use_kernel
    assert not cpu_kernels.choose("copy_pages", dtype=jnp.float32, devices=8).use_kernel
    assert cpu_kernels.choose("copy_pages", dtype=jnp.bfloat16, devices=8).use_kernel
    assert not cpu_kernels.choose("write_rows", dtype=jnp.float32).use_kernel
    # Greedy's argmax: on one device (no partitioning rule), on every build.
    assert cpu_kernels.choose("argmax_rows", devices=1).use_kernel
    assert not cpu_kernels.choose("argmax_rows", devices=8).use_kernel
    limit = policy.MATMUL_MAX_ROWS.get(lib.isa_class, 0)
    assert cpu_kernels.choose("matmul", rows=1, devices=1).use_kernel == (limit > 0)
    assert not cpu_kernels.choose("matmul", rows=limit + 1, devices=1).use_kernel
    # bfloat16 x and w take the kernel at any row count where the build has vdpbf16ps.
    dp = "avx512bf16" in lib.isa
    for rows in (limit + 1, 4096):
        assert cpu_kernels.choose("matmul", rows=rows, devices=1,
                                  dtype=jnp.bfloat16).use_kernel == (dp and limit > 0)
        assert not cpu_kernels.choose("matmul", rows=rows, devices=1,
                                      dtype=jnp.float32).use_kernel
    assert not cpu_kernels.choose("matmul", rows=1, devices=2).use_kernel
    with cpu_kernels.override(matmul="on"):
        assert cpu_kernels.choose("matmul", rows=1, devices=2).use_kernel
    with cpu_kernels.override(matmul="off"):
        assert not cpu_kernels.choose("matmul", rows=1, devices=1).use_kernel
    with cpu_kernels.override(kernels=False):
        for op in policy.OPS:
            choice = cpu_kernels.choose(op, rows=1, devices=1, dtype=jnp.bfloat16)
            assert not choice.use_kernel and "kernels off" in choice.reason


def test_kernels_off_is_the_xla_path(rng, cpu_options):
    """With the kernels off, "auto" decode attention is the XLA path: no custom call in
    the program, and the reference's result."""
    cpu_options(kernels=False)
    args = _case(rng, batch=2, q_heads=2, kv_heads=1, head_dim=16, page_size=4, max_pages=2,
                 dtype=jnp.float32)
    fn = jax.jit(paged_decode_attention)
    assert "kvjax_" not in fn.lower(*args).as_text()
    _close(fn(*args), reference(*args), jnp.float32)
    with pytest.raises(RuntimeError, match="unavailable"):
        cpu_kernels.paged_decode_attention(*args)


def _qdecode(view, q, impl, **kw):
    return jax.jit(lambda q, v: attention.quantized_decode_attention(q, v, impl=impl, **kw))(
        q, view)


def test_unavailable_reasons(tmp_path):
    """Disabled or unbuildable kernels report why instead of raising at import."""
    lib, reason = build._load.__wrapped__(False, "g++", "native", None)
    assert lib is None and "kernels=False" in reason
    with pytest.warns(RuntimeWarning, match="no C.. compiler"):
        lib, reason = build._load.__wrapped__(True, "no-such-compiler-kvjax", "native",
                                              str(tmp_path))
    assert lib is None and "no C++ compiler" in reason
    assert not list(tmp_path.iterdir())


def test_failed_build_warns_once_with_the_compiler_message_and_auto_falls_back(tmp_path):
    """A compiler that fails: one warning carrying its message (not an exception), the
    reason kept for `kvjax info`, and every op's choice is the XLA path."""
    fake = tmp_path / "fake-cxx"
    fake.write_text("#!/bin/sh\necho 'fake-cxx: error: kvjax-test-message' >&2\nexit 1\n")
    fake.chmod(0o755)
    opts = cpu_kernels.CpuOptions(compiler=str(fake), cache_dir=str(tmp_path / "cache"),
                                  march="x86-64-v2")
    with pytest.warns(RuntimeWarning, match="kvjax-test-message") as record:
        assert not cpu_kernels.available(opts)
        assert not cpu_kernels.available(opts)  # cached: no second build, no second warning
    assert len(record) == 1
    assert "kvjax-test-message" in cpu_kernels.unavailable_reason(opts)
    for op in policy.OPS:
        choice = cpu_kernels.choose(op, dtype=jnp.bfloat16, options=opts)
        assert not choice.use_kernel and "unavailable" in choice.reason


# ----------------------------------------------------------------------------- quantized pages


@needs_kernel
@pytest.mark.parametrize("bits,q_heads,kv_heads", [(2, 8, 2), (4, 8, 1), (8, 4, 4)])
def test_quantized_decode_matches_reference(rng, bits, q_heads, kv_heads):
    """KIVI int2/int4/int8 pages with f16 scales, GQA 4 / MQA / MHA, lengths at the page
    and tail edges (random_cache), whole pools and one layer: equal to the reference."""
    cache = random_cache(rng, bits=bits, q_heads=q_heads, kv_heads=kv_heads)
    q = _put(rng.standard_normal((cache.spec.max_seqs, q_heads, qz_D)), np.float32)
    want = _qdecode(qz.layer_view(cache, 0), q, "reference")
    q_close(_qdecode(qz.layer_view(cache, 0), q, "cpu"), want, 2e-5)
    q_close(_qdecode(qz.layer_view(cache, 0, whole_pools=True), q, "cpu"), want, 2e-5)


@needs_kernel
def test_quantized_bf16_soft_cap_window_mixed_layers(rng):
    """bf16 cache and queries; soft cap and sliding window; layers of different bit widths
    read from their whole pools."""
    cache = random_cache(rng, bits=(8, 2), layers=2, dtype="bfloat16")  # 9 slots: some with
    q = _put(rng.standard_normal((9, 8, qz_D)), jnp.bfloat16)  # quantized pages
    for layer, kw in ((0, dict(soft_cap=2.0)), (1, dict(sliding_window=21))):
        want = _qdecode(qz.layer_view(cache, layer), q, "reference", **kw)
        got = _qdecode(qz.layer_view(cache, layer, whole_pools=True), q, "cpu", **kw)
        q_close(got, want, 2e-2)


@needs_kernel
def test_quantized_traced_layer_in_a_scan(rng):
    layers = 3
    cache = random_cache(rng, bits=4, layers=layers)  # 9 slots, some with quantized pages
    q = _put(rng.standard_normal((9, 8, qz_D)), np.float32)

    def run(impl, whole):
        def body(c, layer):
            view = qz.layer_view(cache, layer, whole_pools=whole)
            return c, attention.quantized_decode_attention(q, view, impl=impl)
        return jax.jit(lambda: jax.lax.scan(body, 0, jnp.arange(layers))[1])()

    q_close(run("cpu", True), run("reference", False), 2e-5)


def _qprefill(view, q, q_lengths, impl, **kw):
    fn = jax.jit(lambda q, v, n: attention.quantized_prefill_attention(q, v, n, impl=impl, **kw))
    return fn(q, view, q_lengths), fn.lower(q, view, q_lengths).as_text()


@needs_kernel
@pytest.mark.parametrize("bits,q_heads,kv_heads,dtype,kw", [
    (4, 8, 2, "float32", {}),
    ((8, 2), 4, 4, "bfloat16", dict(soft_cap=3.0, sliding_window=19)),
])
def test_quantized_prefill_matches_reference(rng, bits, q_heads, kv_heads, dtype, kw):
    """Chunked prefill over KIVI pages and their tail ring by the kernel: rows of 0 to 60
    new tokens (several work items per row, queries on both sides of the quantized/tail
    boundary), lengths at the page and tail edges, pages no query may read filled with NaN;
    every layer read from the whole pools. Equal to the reference (dequantize, then attend)."""
    layers = 2 if isinstance(bits, tuple) else 1
    cache = random_cache(rng, bits=bits, q_heads=q_heads, kv_heads=kv_heads, layers=layers,
                         dtype=dtype, nan_unused=True)
    lengths = np.asarray(cache.lengths)
    q_len = 60
    q_lengths = np.minimum(lengths, rng.integers(0, q_len + 1, lengths.shape)).astype(np.int32)
    q_lengths[-1] = min(lengths[-1], q_len)  # one row whose chunk is all real queries
    q = _put(rng.standard_normal((len(lengths), q_len, q_heads, qz_D)), jnp.dtype(dtype))
    n = jax.device_put(q_lengths)
    for layer in range(layers):
        want, _ = _qprefill(qz.layer_view(cache, layer), q, n, "reference", **kw)
        got, hlo = _qprefill(qz.layer_view(cache, layer, whole_pools=True), q, n, "cpu", **kw)
        assert "kvjax_quantized_prefill" in hlo  # the kernel, not the XLA path
        q_close(got, want, 2e-5 if dtype == "float32" else 2e-2)


def _vector_case(rng, bits, head_dim, group, scale_dtype, q_heads):
    """Pools of random codes, f16/bf16/f32 scales and zeros, a tail ring, random tables with
    shared pages and lengths 1 .. max (some in the tail only, some ending inside a chunk)."""
    kv_heads, ps, max_pages, ring = 2, 32, 4, 48
    batch, num_pages = 5, 12
    span = 1.0 / ((1 << bits) - 1)

    def codes():
        return _put(rng.integers(0, 256, (kv_heads, num_pages, ps, head_dim * bits // 8)),
                    np.uint8)

    def scale_zero(shape):
        return (_put(rng.uniform(0.5 * span, 2 * span, shape), scale_dtype),
                _put(rng.uniform(-2.0, 0.0, shape), scale_dtype))

    pools = (codes(), *scale_zero((kv_heads, num_pages, ps // group, head_dim)), codes(),
             *scale_zero((kv_heads, num_pages, ps, head_dim // group)))
    lengths = np.asarray([1, 20, 70, max_pages * ps, 100], np.int32)
    quant_lengths = ps * np.maximum(lengths - 16, 0) // ps
    tables = _put(rng.integers(0, num_pages, (batch, max_pages)), np.int32)
    # The tail ring in the scales' dtype: f16, bf16 and f32 rows widened by the kernel.
    tail_k, tail_v = (_put(rng.standard_normal((kv_heads, batch, ring, head_dim))
                           .astype(np.float32), scale_dtype) for _ in range(2))
    q = _put(rng.standard_normal((batch, 1, q_heads, head_dim)), np.float32)
    quant_lengths, lengths, q_pos = jax.device_put(
        tuple(x.astype(np.int32) for x in (quant_lengths, lengths, (lengths - 1)[:, None])))
    args = (q, *pools, tail_k, tail_v, quant_lengths, lengths, tables, q_pos)
    return args, dict(k_bits=bits, v_bits=bits, scale=head_dim**-0.5)


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize("bits,head_dim,group,scale_dtype,q_heads", [
    (2, 64, 16, jnp.float16, 16), (4, 128, 32, jnp.bfloat16, 8), (8, 64, 16, jnp.float32, 2),
    (4, 64, 32, jnp.float16, 8), (2, 128, 16, jnp.bfloat16, 4), (4, 32, 32, jnp.float32, 4),
    (8, 96, 32, jnp.float16, 2)])
def test_quantized_vectorised_rows(rng, cpu_build, cpu_options, bits, head_dim, group, scale_dtype,
                                   q_heads):
    """Widths whose packed fields hold whole 16-channel vectors take the vectorised
    dequantizer (random_cache's head_dim 32 / group 8 take the scalar one) and, for whole
    chunks, the codes read in place by the register-blocked core (query rows in blocks of
    8, 4 and 1: GQA 8, 4, 1; 1, 2, 4 and 8 value groups per row through the vector
    weights, 3 through the scalar ones); f16, bf16 and f32 scales. With float32 logits and
    values (int_logits and int_values off) the kernel is float32-exact:
    equal to the reference to 2e-6."""
    args, kw = _vector_case(rng, bits, head_dim, group, scale_dtype, q_heads)
    want = quantized_reference(*args, **kw)
    q_close(cpu_kernels.quantized_attention(*args, **kw), want, 2e-5)
    cpu_options(int_logits=False, int_values=False)
    got = cpu_kernels.quantized_attention(*args, **kw)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-6, atol=2e-6)


@needs_kernel
@pytest.mark.parametrize("bits,head_dim,group,scale_dtype,q_heads", [
    (4, 128, 32, jnp.float16, 4), (2, 128, 16, jnp.bfloat16, 8), (8, 64, 16, jnp.float32, 2)])
def test_quantized_int_logits_within_their_bound(rng, cpu_build, cpu_options, bits, head_dim, group,
                                                 scale_dtype, q_heads):
    """The integer logits (AVX512-VNNI; the float32 path elsewhere, which meets the bound
    too): each folded query row q s rounded to int16 with its largest entry m at 32767
    moves a logit by at most eps = m / 65534 * D * (2^bits - 1), so lse by at most eps and
    an output by at most (e^(2 eps) - 1) * the values' range; here m is bounded by the
    largest |q| * scale * key scale of the case (values in float32 here)."""
    cpu_options(int_values=False)
    args, kw = _vector_case(rng, bits, head_dim, group, scale_dtype, q_heads)
    q, _, k_scale, _, _, v_scale, v_zero, _, tail_v = args[:9]
    want = quantized_reference(*args, **kw)
    got = cpu_kernels.quantized_attention(*args, **kw)
    f32 = functools.partial(np.asarray, dtype=np.float32)
    m = np.abs(f32(q)).max() * kw["scale"] * f32(k_scale).max()
    eps = m / 65534 * head_dim * ((1 << bits) - 1)
    v_max = max(((1 << bits) - 1) * f32(v_scale).max() + np.abs(f32(v_zero)).max(),
                np.abs(f32(tail_v)).max())
    live = np.isfinite(f32(want[1]))
    out_err = np.abs(f32(got[0]) - f32(want[0])).max()
    lse_err = np.abs(f32(got[1])[live] - f32(want[1])[live]).max()
    assert lse_err <= eps + 1e-5, (lse_err, eps)
    assert out_err <= np.expm1(2 * eps) * 2 * v_max + 1e-5, (out_err, eps, v_max)


@needs_kernel
@pytest.mark.parametrize("bits,head_dim,group,scale_dtype,q_heads", [
    (4, 128, 32, jnp.float16, 4), (2, 128, 16, jnp.bfloat16, 8), (8, 64, 16, jnp.float32, 2),
    (4, 32, 32, jnp.bfloat16, 16), (2, 64, 32, jnp.float16, 2)])
def test_quantized_int_values_within_their_bound(rng, cpu_build, cpu_options, bits, head_dim, group,
                                                 scale_dtype, q_heads):
    """The integer values (AVX512-VNNI and VBMI; the float32 path elsewhere, which meets
    the bound too): a chunk's weights p s, rounded to int16 per query row and value group
    with the largest at 32767, move by at most (max_j p_j) s_max / 65534 each, so a chunk's
    sum by 16 (2^bits - 1) times that; the chunks' max_j p_j add up to at most the softmax
    sum, so an output moves by at most 16 (2^bits - 1) s_max / 65534 (s_max: the case's
    largest value scale). The logits are float32 here, so lse is float32-exact. 1, 2, 4 and
    8 value groups per row; query rows in blocks of 8, 4 and 1 (GQA 8, 4, 2, 1)."""
    cpu_options(int_logits=False)
    args, kw = _vector_case(rng, bits, head_dim, group, scale_dtype, q_heads)
    v_scale = args[5]
    want = quantized_reference(*args, **kw)
    got = cpu_kernels.quantized_attention(*args, **kw)
    f32 = functools.partial(np.asarray, dtype=np.float32)
    eps = 16 * ((1 << bits) - 1) * f32(v_scale).max() / 65534
    live = np.isfinite(f32(want[1]))
    out_err = np.abs(f32(got[0]) - f32(want[0])).max()
    lse_err = np.abs(f32(got[1])[live] - f32(want[1])[live]).max()
    assert lse_err <= 2e-6, lse_err
    assert out_err <= eps + 2e-6, (out_err, eps)


# ----------------------------------------------------------------------------- MLA


@needs_kernel
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_mla_decode_matches_reference(rng, dtype):
    """Absorbed MLA (latent 64 + rope 16, 8 heads): random shared pages, lengths 0, 1, a
    full table and partial pages; one layer and whole pools with a traced layer."""
    batch, heads, dc, dr, ps, max_pages, layers = 5, 8, 64, 16, 16, 4, 2
    num_pages = 14
    lengths = _put([0, 1, max_pages * ps, 17, 40], np.int32)
    tables = _put(rng.integers(0, num_pages, (batch, max_pages)), np.int32)

    def draw(*shape):
        return np.asarray(rng.standard_normal(shape), dtype)

    ql, qr = jax.device_put((draw(batch, heads, dc), draw(batch, heads, dr)))
    lat_host, rope_host = draw(layers, 1, num_pages, ps, dc), draw(layers, 1, num_pages, ps, dr)
    lat, rope = jax.device_put((lat_host, rope_host))
    ref = jax.jit(functools.partial(mla_ref.mla_decode_attention, scale=0.1))
    # One program for both layers: the layer is traced.
    whole = jax.jit(lambda i: attention.mla_decode_attention(
        ql, qr, lat, rope, lengths, tables, scale=0.1, impl="cpu", layer=i))
    for layer in range(layers):
        lat_l, rope_l = jax.device_put((lat_host[layer, 0], rope_host[layer, 0]))
        want = ref(ql, qr, lat_l, rope_l, lengths, tables)
        got = attention.mla_decode_attention(ql, qr, lat_l, rope_l, lengths, tables,
                                             scale=0.1, impl="cpu")
        _close(got, want, dtype)
        _close(whole(layer), want, dtype)


@needs_kernel
def test_quantized_mixed_scale_dtypes_run_the_xla_path(rng):
    """Key scales in float16, value scales in float32: the kernel takes one scale dtype,
    so "cpu" runs the XLA path (no widened copy of the pools) and still equals the
    reference."""
    import dataclasses

    cache = random_cache(rng, bits=4, q_heads=8, kv_heads=2)
    view = qz.layer_view(cache, 0)
    view = dataclasses.replace(view, v=dataclasses.replace(
        view.v, scale=_put(view.v.scale, np.float32), zero=_put(view.v.zero, np.float32)))
    assert view.k.scale.dtype != view.v.scale.dtype
    q = _put(rng.standard_normal((cache.spec.max_seqs, 8, qz_D)), np.float32)
    q_close(_qdecode(view, q, "cpu"), _qdecode(view, q, "reference"), 2e-5)
    lowered = jax.jit(lambda q, v: attention.quantized_decode_attention(q, v, impl="cpu"))
    assert "kvjax_quantized_decode" not in lowered.lower(q, view).as_text()
    # ... while one scale dtype does call the kernel (the check above can fail).
    same = qz.layer_view(cache, 0)
    assert "kvjax_quantized_decode" in lowered.lower(q, same).as_text()


@needs_kernel
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_write_rows_matches_scatter(rng, dtype):
    """The in-place row write equals `.at[layer, :, i1, i2, :].set(x, mode="drop")`: rows
    with an out-of-range index (the cache's sink) or an out-of-range layer are dropped.
    `read_rows` reads the same rows as [rows, heads, width], zeros out of range."""
    pool = _put(rng.standard_normal((3, 2, 6, 4, 16)), dtype)
    n = 9
    i1 = rng.integers(0, 7, n)  # 6 = out of range
    i2 = rng.integers(0, 5, n)  # 4 = out of range
    i1[0], i2[1] = 6, 4
    x = _put(rng.standard_normal((n, 2, 16)), dtype)
    i1, i2 = _put(i1, np.int32), _put(i2, np.int32)
    # One program each for both layers (the layer is traced in both).
    scatter = jax.jit(lambda pool, layer, i1, i2, x: pool.at[layer, :, i1, i2, :].set(
        x, mode="drop"))
    write = jax.jit(cpu_kernels.write_rows)
    read = jax.jit(cpu_kernels.read_rows)
    host, r1, r2 = np.asarray(pool, np.float32), np.asarray(i1), np.asarray(i2)
    for layer in (1, 3):
        rows = np.zeros((n, 2, 16), np.float32)
        inside = (r1 < 6) & (r2 < 4) & (layer < 3)
        if layer < 3:
            rows[inside] = np.moveaxis(host[layer][:, r1[inside], r2[inside]], 0, 1)
        np.testing.assert_array_equal(np.asarray(read(pool, layer, i1, i2), np.float32), rows)
        want = scatter(pool, layer, i1, i2, x)
        got = write(pool, layer, i1, i2, x)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@needs_kernel
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.uint8])
def test_copy_pages_matches_scatter(rng, dtype, monkeypatch):
    """In-place page copies equal `.at[:, :, dst].set(pool[:, :, src], mode="drop")` for
    fresh destinations; pairs with the sink index (out of range) are skipped. Every dtype:
    `reserve` copies float32 pools and KIVI code pools with it too (a float32 cache's
    reserve has the custom call, not XLA's gather of a page per slot)."""
    pool = _put(rng.standard_normal((2, 3, 8, 4, 16)), dtype)
    perm = rng.permutation(8)
    src, dst = perm[:3].copy(), perm[3:6].copy()
    dst[1] = 8  # the sink: nothing copied for this pair
    src, dst = _put(src, np.int32), _put(dst, np.int32)
    want = jax.jit(lambda pool, src, dst: pool.at[:, :, dst].set(pool[:, :, src], mode="drop"))(
        pool, src, dst)
    got = jax.jit(cpu_kernels.copy_pages)(pool, src, dst)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    if dtype == jnp.float32:  # on one device (the tests see 8)
        monkeypatch.setattr(jax, "device_count", lambda backend=None: 1)
        spec = kvx.CacheSpec(attention=kvx.AttentionSpec(q_heads=2, kv_heads=2, head_dim=16),
                             num_layers=2, page_size=4, num_pages=16, max_seqs=3,
                             max_pages_per_seq=4, dtype="float32")
        cache = jax.eval_shape(lambda: kvx.cache.init_cache(spec))
        text = jax.jit(kvx.cache.reserve, donate_argnums=0).lower(
            cache, jax.ShapeDtypeStruct((3,), jnp.int32)).compile().as_text()
        assert "kvjax_copy_pages" in text
        assert not re.search(r"= f32\[[0-9,]*\]\{[0-9,]*\} gather\(", text)
