"""Paged decode attention on CPU against the memory-bandwidth ceiling.

Measures, in one process so that the ratios share the machine's state:

1. streaming read bandwidth (a jitted sum over a large array) and copy bandwidth
   (an in-place scale of a large donated array, counting read + write);
2. paged decode attention for the gather reference, the XLA path
   (`kvjax/attention/xla.py`), the C++ CPU kernel (`kvjax/backends/cpu/`, row "cpu",
   when it is available; it runs on the caller and XLA's intra-op threads, so its
   CPU time is up to the number of cores times its wall time) and contiguous
   `[batch, kv_heads, seq, head_dim]` attention on the same K/V (plain
   einsum-softmax-einsum, and the XLA path's blocked loop reading contiguous slices
   instead of pages), for GQA/MQA in
   float32 and bf16 and for MLA in absorbed form. Bandwidth counts the bytes the
   op must read once: the live keys and values (MLA: latent and rope once);
3. a pool-capacity check: the same live tokens in pools 1x, 4x and 16x larger
   (the XLA path's step time must not grow);
4. quantized pages (`kvjax/attention/xla_quantized.py`, KIVI int8/int4/int2 codes
   with float16 scales and zeros, a bf16 tail of R tokens) against paged bf16 and
   float32 pages on the same geometry, all through the XLA path: ms per decode
   step and the ratio to bf16 (int4/int2 should not be slower per token than
   bf16); rows "cpu_*" do the same with the C++ CPU kernels (ratios to "cpu_bfloat16";
   the bf16 and intN kernels are timed in turn, one call of each per round, so that
   their ratios see the same memory speed, which on a shared VM drifts by minutes).
   Bytes counted: codes + scales + zeros of the used pages + the tail.

Every result is verified against the reference in the same run. Times are
medians (with min-max) over repeats of wall-clock and of process CPU time: on a
shared machine the CPU time is the steadier figure (XLA:CPU runs these ops on
one thread). Writes JSON to benchmarks/results/.

    python benchmarks/attention.py --quick      # small sizes, a few seconds of work
    python benchmarks/attention.py              # B=8, 8 KV heads, 4K tokens
    python benchmarks/attention.py --cpu-choice # each CPU op: XLA vs each kernel build

`--cpu-choice` times, for every CPU op with a C++ kernel (paged decode and chunked
prefill f32 / bf16, KIVI int4 decode, MLA decode, bf16 row writes and page copies, the
matmul at the e2e decode model's shapes: decode rows on weights as cold as in a decode
step, and a prefill chunk's rows), the XLA path and the kernel of each build
(`--marches`, default the native build and the AVX2 build `-march=haswell`), all
interleaved in one run, checks each result against the XLA path's, and prints for each
build what "auto" picks (`kvjax.backends.cpu.choose`) next to the faster of the two.
"""

import argparse
import itertools
import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import result_path  # noqa: E402
from kernels_pallas.mla_decode import reference as mla_ref  # noqa: E402
from kernels_pallas.paged_attention import reference as paged_ref  # noqa: E402
from kernels_pallas.quantized_attention import reference as quant_ref  # noqa: E402
from kvjax.attention import xla, xla_quantized  # noqa: E402
from kvjax.backends import cpu as cpu_kernels  # noqa: E402
from kvjax.backends.cpu import matmul as cpu_matmul  # noqa: E402

F32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST


def _time(fn, args, repeats):
    """Median/min/max wall and CPU seconds of `fn(*args)` after one warm-up call."""
    stats, outs = _time_interleaved({0: (fn, args)}, repeats)
    return stats[0], outs[0]


def _time_interleaved(calls, repeats):
    """`_time` for each of {name: (fn, args)}, called in turn, one call of each per round
    (with several: their ratios see the same machine, whose memory speed drifts by
    minutes; rows say `interleaved`)."""
    outs = {name: jax.block_until_ready(fn(*a)) for name, (fn, a) in calls.items()}
    walls = {name: [] for name in calls}
    cpus = {name: [] for name in calls}
    for _ in range(repeats):
        for name, (fn, a) in calls.items():
            c0, t0 = time.process_time(), time.perf_counter()
            jax.block_until_ready(fn(*a))
            walls[name].append(time.perf_counter() - t0)
            cpus[name].append(time.process_time() - c0)
    stats = {name: dict(
        wall_median_s=float(np.median(walls[name])), wall_min_s=float(min(walls[name])),
        wall_max_s=float(max(walls[name])), cpu_median_s=float(np.median(cpus[name])),
        cpu_min_s=float(min(cpus[name])), cpu_max_s=float(max(cpus[name])), repeats=repeats,
        **({"interleaved": True} if len(calls) > 1 else {})) for name in calls}
    return stats, outs


def measure_bandwidth(nbytes, repeats):
    """Streaming read (sum) and copy (in-place scale, read + write) bandwidth in GB/s."""
    x = jnp.ones((nbytes // 4,), F32)
    read, _ = _time(jax.jit(jnp.sum), (x,), repeats)
    scale = jax.jit(lambda y: y * F32(1.0000001), donate_argnums=0)
    walls = []
    x = scale(x)
    for _ in range(repeats):
        t0 = time.perf_counter()
        x = jax.block_until_ready(scale(x))
        walls.append(time.perf_counter() - t0)
    del x
    return dict(
        bytes=nbytes,
        read_GBps=nbytes / read["wall_median_s"] / 1e9,
        read_GBps_best=nbytes / read["wall_min_s"] / 1e9,
        copy_GBps=2 * nbytes / float(np.median(walls)) / 1e9,
        copy_GBps_best=2 * nbytes / float(min(walls)) / 1e9,
    )


# ----------------------------------------------------------------------------- contiguous


def contiguous_einsum(q, k, v, scale):
    """Plain attention on contiguous q [B,Hq,D], k/v [B,Hkv,S,D] (all positions live)."""
    batch, q_heads, d = q.shape
    kv_heads = k.shape[1]
    qg = q.reshape(batch, kv_heads, q_heads // kv_heads, d).astype(F32) * F32(scale)
    s = jnp.einsum("bhgd,bhsd->bhgs", qg, k.astype(F32), precision=HIGHEST)
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("bhgs,bhsd->bhgd", p, v.astype(F32), precision=HIGHEST)
    return out.reshape(batch, q_heads, -1).astype(q.dtype)


def contiguous_reader(x):
    """A BlockReader function over contiguous [heads, batch, seq, width]: slices, no gather."""

    def read(x, idx, page_size):
        start = idx[0, 0] * page_size  # blocks are whole, in order: see contiguous_blocked
        return jax.lax.dynamic_slice_in_dim(x, start, idx.shape[1] * page_size, axis=2).astype(F32)

    return read


def contiguous_blocked(q, kh, vh, scale, page_size, block_tokens):
    """The XLA path's online-softmax loop over contiguous K/V (slices instead of gathers).

    kh, vh: [Hkv, B, S, D], each (head, sequence) contiguous. The block table is
    the identity, so each block is one contiguous slice; this isolates what
    paging itself costs the XLA path.
    """
    batch, q_heads, d = q.shape
    kv_heads, seq = kh.shape[0], kh.shape[2]
    if seq % block_tokens or block_tokens % page_size:
        raise ValueError(f"contiguous_blocked needs whole blocks: seq {seq}, block_tokens "
                         f"{block_tokens}, page_size {page_size}")
    pages = seq // page_size
    tables = jnp.broadcast_to(jnp.arange(pages, dtype=jnp.int32), (batch, pages))
    lengths = jnp.full((batch,), seq, jnp.int32)
    read = contiguous_reader(kh)
    kr = xla.BlockReader(arrays=kh, read=lambda x, i: read(x, i, page_size))
    vr = xla.BlockReader(arrays=vh, read=lambda x, i: read(x, i, page_size))
    q_pos = jnp.tile(lengths[:, None] - 1, (1, q_heads // kv_heads))
    qf = q.reshape(batch, kv_heads, q_heads // kv_heads, d).transpose(1, 0, 2, 3)
    out, _ = xla.paged_attention_core(
        (qf,), (kr,), vr, q_pos, lengths,
        tables, page_size=page_size, scale=scale, block_tokens=block_tokens,
    )
    return out.transpose(1, 0, 2, 3).reshape(batch, q_heads, -1).astype(q.dtype)


def contiguous_mla(q_latent, q_rope, c_kv, k_rope, scale):
    """Absorbed MLA on contiguous latent [B,S,dc] and rope [B,S,dr]."""
    s = (jnp.einsum("bhc,bsc->bhs", q_latent.astype(F32), c_kv.astype(F32), precision=HIGHEST)
         + jnp.einsum("bhr,bsr->bhs", q_rope.astype(F32), k_rope.astype(F32), precision=HIGHEST))
    p = jax.nn.softmax(s * F32(scale), axis=-1)
    out = jnp.einsum("bhs,bsc->bhc", p, c_kv.astype(F32), precision=HIGHEST)
    return out.astype(q_latent.dtype)


# ----------------------------------------------------------------------------- cases


def _tables(rng, batch, max_pages, num_pages):
    """Each sequence's pages at random places in the pool."""
    return jnp.asarray(rng.permutation(num_pages)[: batch * max_pages].reshape(batch, max_pages),
                       jnp.int32)


def _check(name, got, want, dtype):
    tol = 1e-4 if dtype == F32 else 3e-2
    err = float(jnp.max(jnp.abs(got.astype(F32) - want.astype(F32))))
    scale = float(jnp.max(jnp.abs(want.astype(F32)))) + 1e-6
    if not err <= tol * max(1.0, scale):
        raise AssertionError(f"{name}: max |error| {err:.3g} vs reference exceeds {tol}")
    return err


def run_gqa(cfg, dtype, repeats, ref_repeats, block_tokens, key):
    batch, q_heads, kv_heads, d, seq, ps = (cfg[k] for k in ("batch", "q_heads", "kv_heads",
                                                             "head_dim", "seq", "page_size"))
    rng = np.random.default_rng(0)
    max_pages = seq // ps
    num_pages = batch * max_pages
    k1, k2, k3 = jax.random.split(key, 3)
    q = jax.random.normal(k1, (batch, q_heads, d), F32).astype(dtype)
    k_pages = jax.random.normal(k2, (kv_heads, num_pages, ps, d), F32).astype(dtype)
    v_pages = jax.random.normal(k3, (kv_heads, num_pages, ps, d), F32).astype(dtype)
    tables = _tables(rng, batch, max_pages, num_pages)
    if cfg.get("mixed"):
        lengths = jnp.asarray(rng.integers(1, seq + 1, size=batch), jnp.int32)
    else:
        lengths = jnp.full((batch,), seq, jnp.int32)
    live = int(jnp.sum(lengths))
    nbytes = 2 * kv_heads * live * d * jnp.dtype(dtype).itemsize
    scale = d**-0.5

    ref_fn = jax.jit(paged_ref.paged_decode_attention)
    xla_fn = jax.jit(lambda *a: xla.paged_decode_attention(*a, block_tokens=block_tokens))
    args = (q, k_pages, v_pages, lengths, tables)
    rows = {}
    rows["reference"], want = _time(ref_fn, args, ref_repeats)
    want = want[0]
    rows["xla"], got = _time(xla_fn, args, repeats)
    rows["xla"]["max_err"] = _check("xla", got[0], want, dtype)
    if cpu_kernels.available():
        cpu_fn = jax.jit(cpu_kernels.paged_decode_attention)
        rows["cpu"], got = _time(cpu_fn, args, repeats)
        rows["cpu"]["max_err"] = _check("cpu", got[0], want, dtype)
    if not cfg.get("mixed"):
        # The same K/V laid out contiguously, [B, Hkv, S, D] (built once, untimed).
        kc = jax.block_until_ready(paged_ref.gather_pages(k_pages, tables, lengths))
        vc = jax.block_until_ready(paged_ref.gather_pages(v_pages, tables, lengths))
        c_fn = jax.jit(lambda q, k, v: contiguous_einsum(q, k, v, scale))
        rows["contiguous"], got = _time(c_fn, (q, kc, vc), repeats)
        rows["contiguous"]["max_err"] = _check("contiguous", got, want, dtype)
        bt = block_tokens or xla.default_block_tokens(kv_heads, batch, 2 * d)
        bt = max(ps, bt // ps * ps)
        kh = jax.block_until_ready(jnp.swapaxes(kc, 0, 1))  # [Hkv, B, S, D], untimed
        vh = jax.block_until_ready(jnp.swapaxes(vc, 0, 1))
        cb_fn = jax.jit(lambda q, k, v: contiguous_blocked(q, k, v, scale, ps, bt))
        rows["contiguous_blocked"], got = _time(cb_fn, (q, kh, vh), repeats)
        rows["contiguous_blocked"]["max_err"] = _check("contiguous_blocked", got, want, dtype)
        del kc, vc, kh, vh
    return nbytes, rows


def run_mla(cfg, dtype, repeats, ref_repeats, block_tokens, key):
    batch, heads, dc, dr, seq, ps = (cfg[k] for k in ("batch", "q_heads", "d_c", "d_rope",
                                                      "seq", "page_size"))
    rng = np.random.default_rng(0)
    max_pages = seq // ps
    num_pages = batch * max_pages
    ks = jax.random.split(key, 4)
    ql = jax.random.normal(ks[0], (batch, heads, dc), F32).astype(dtype)
    qr = jax.random.normal(ks[1], (batch, heads, dr), F32).astype(dtype)
    lat = jax.random.normal(ks[2], (num_pages, ps, dc), F32).astype(dtype)
    rope = jax.random.normal(ks[3], (num_pages, ps, dr), F32).astype(dtype)
    tables = _tables(rng, batch, max_pages, num_pages)
    lengths = jnp.full((batch,), seq, jnp.int32)
    nbytes = batch * seq * (dc + dr) * jnp.dtype(dtype).itemsize
    scale = (dc // 4 + dr) ** -0.5
    args = (ql, qr, lat, rope, lengths, tables)
    rows = {}
    ref_fn = jax.jit(lambda *a: mla_ref.mla_decode_attention(*a, scale=scale))
    rows["reference"], want = _time(ref_fn, args, ref_repeats)
    want = want[0]
    xla_fn = jax.jit(lambda *a: xla.mla_decode_attention(*a, scale=scale,
                                                         block_tokens=block_tokens))
    rows["xla"], got = _time(xla_fn, args, repeats)
    rows["xla"]["max_err"] = _check("xla", got[0], want, dtype)
    if cpu_kernels.available():
        cpu_fn = jax.jit(lambda *a: cpu_kernels.mla_decode_attention(*a, scale=scale))
        rows["cpu"], got = _time(cpu_fn, args, repeats)
        rows["cpu"]["max_err"] = _check("cpu", got[0], want, dtype)
    cl = jax.block_until_ready(paged_ref.gather_pages(lat[None], tables, lengths)[:, 0])
    cr = jax.block_until_ready(paged_ref.gather_pages(rope[None], tables, lengths)[:, 0])
    c_fn = jax.jit(lambda a, b, c, d: contiguous_mla(a, b, c, d, scale))
    rows["contiguous"], got = _time(c_fn, (ql, qr, cl, cr), repeats)
    rows["contiguous"]["max_err"] = _check("contiguous", got, want, dtype)
    return nbytes, rows


def run_pool_check(cfg, dtype, repeats, block_tokens, factors, key):
    """XLA path step time with the same live pages placed in pools `factor`x larger."""
    batch, q_heads, kv_heads, d, seq, ps = (cfg[k] for k in ("batch", "q_heads", "kv_heads",
                                                             "head_dim", "seq", "page_size"))
    rng = np.random.default_rng(1)
    max_pages = seq // ps
    live_pages = batch * max_pages
    k1, k2, k3 = jax.random.split(key, 3)
    q = jax.random.normal(k1, (batch, q_heads, d), F32).astype(dtype)
    k_live = jax.random.normal(k2, (kv_heads, live_pages, ps, d), F32).astype(dtype)
    v_live = jax.random.normal(k3, (kv_heads, live_pages, ps, d), F32).astype(dtype)
    lengths = jnp.full((batch,), seq, jnp.int32)
    xla_fn = jax.jit(lambda *a: xla.paged_decode_attention(*a, block_tokens=block_tokens))
    out = {}
    base = None
    for f in factors:
        num_pages = live_pages * f
        ids = jnp.asarray(rng.permutation(num_pages)[:live_pages], jnp.int32)
        kp = jnp.zeros((kv_heads, num_pages, ps, d), dtype).at[:, ids].set(k_live)
        vp = jnp.zeros((kv_heads, num_pages, ps, d), dtype).at[:, ids].set(v_live)
        tables = ids.reshape(batch, max_pages)
        stats, got = _time(xla_fn, (q, kp, vp, lengths, tables), repeats)
        if base is None:
            base = got[0]
        else:  # same live K/V, so the same result
            _check(f"pool x{f}", got[0], base, dtype)
        out[f"x{f}"] = stats
        del kp, vp
    return out


def _quant_pools(rng, kv_heads, num_pages, ps, d, bits, group):
    """Random KIVI pools of one layer: packed codes, float16 scales and zeros (keys per
    channel over `group` tokens, values per token over `group` channels)."""
    span = 1.0 / ((1 << bits) - 1)

    def codes():
        return jnp.asarray(
            rng.integers(0, 256, (kv_heads, num_pages, ps, d * bits // 8), dtype=np.uint8))

    def scale_zero(shape):
        return (jnp.asarray(rng.uniform(0.5 * span, 2 * span, shape), jnp.float16),
                jnp.asarray(rng.uniform(-2.0, 0.0, shape), jnp.float16))

    ks, vs = (kv_heads, num_pages, ps // group, d), (kv_heads, num_pages, ps, d // group)
    return (codes(), *scale_zero(ks), codes(), *scale_zero(vs))


def run_quant(cfg, repeats, ref_repeats, block_tokens, key):
    """Paged f32, bf16 and int8/int4/int2 pages on one geometry, all through the XLA path;
    every result checked against its gather reference."""
    batch, q_heads, kv_heads, d, seq, ps = (cfg[k] for k in ("batch", "q_heads", "kv_heads",
                                                             "head_dim", "seq", "page_size"))
    group, residual = cfg["group"], cfg["residual"]
    rng = np.random.default_rng(0)
    max_pages = seq // ps
    num_pages = batch * max_pages
    k1, k2, k3 = jax.random.split(key, 3)
    q32 = jax.random.normal(k1, (batch, q_heads, d), F32)
    tables = _tables(rng, batch, max_pages, num_pages)
    lengths = jnp.full((batch,), seq, jnp.int32)
    scale = d**-0.5
    rows, nbytes, tokens = {}, {}, batch * seq
    cpu_calls = {}  # name: (fn, args, reference output, dtype)
    # Full-precision pages through the XLA path.
    for dt in (F32, jnp.bfloat16):
        name = f"paged_{jnp.dtype(dt).name}"
        kp = jax.random.normal(k2, (kv_heads, num_pages, ps, d), F32).astype(dt)
        vp = jax.random.normal(k3, (kv_heads, num_pages, ps, d), F32).astype(dt)
        args = (q32.astype(dt), kp, vp, lengths, tables)
        xla_fn = jax.jit(lambda *a: xla.paged_decode_attention(*a, block_tokens=block_tokens))
        rows[name], got = _time(xla_fn, args, repeats)
        want = jax.jit(paged_ref.paged_decode_attention)(*args)[0]
        rows[name]["max_err"] = _check(name, got[0], want, dt)
        nbytes[name] = 2 * kv_heads * tokens * d * jnp.dtype(dt).itemsize
        if cpu_kernels.available():
            cname = f"cpu_{jnp.dtype(dt).name}"
            nbytes[cname] = nbytes[name]
            if dt == F32:
                rows[cname], got = _time(jax.jit(cpu_kernels.paged_decode_attention), args,
                                         repeats)
                rows[cname]["max_err"] = _check(cname, got[0], want, dt)
            else:  # timed below, interleaved with the intN kernels it is compared to
                rows[cname] = None
                cpu_calls[cname] = (jax.jit(cpu_kernels.paged_decode_attention), args,
                                    want, dt)
        del kp, vp, args
    # Quantized pages + bf16 tail: Q = ps * floor((seq - R) / ps) tokens in pages.
    q_tokens = ps * (max(seq - residual, 0) // ps)
    quant_lengths = jnp.full((batch,), q_tokens, jnp.int32)
    ring = residual + ps
    tail_k = jax.random.normal(k2, (kv_heads, batch, ring, d), F32).astype(jnp.bfloat16)
    tail_v = jax.random.normal(k3, (kv_heads, batch, ring, d), F32).astype(jnp.bfloat16)
    q = q32.astype(jnp.bfloat16)[:, None]
    q_pos = (lengths - 1)[:, None]
    for bits in cfg["bits"]:
        name = f"paged_int{bits}"
        pools = _quant_pools(rng, kv_heads, num_pages, ps, d, bits, group)
        args = (q, *pools, tail_k, tail_v, quant_lengths, lengths, tables, q_pos)
        kw = dict(k_bits=bits, v_bits=bits, scale=scale)
        xla_fn = jax.jit(lambda *a, kw=kw: xla_quantized.quantized_attention(
            *a, **kw, block_tokens=block_tokens))
        rows[name], got = _time(xla_fn, args, repeats)
        ref_fn = jax.jit(lambda *a, kw=kw: quant_ref.quantized_attention(*a, **kw))
        rows[f"reference_int{bits}"], want = _time(ref_fn, args, ref_repeats)
        rows[name]["max_err"] = _check(name, got[0], want[0], jnp.bfloat16)
        used = batch * (q_tokens // ps)
        nbytes[name] = sum(x.nbytes for x in pools) * used // num_pages + (
            2 * kv_heads * batch * (seq - q_tokens) * d * 2)
        nbytes[f"reference_int{bits}"] = nbytes[name]
        if cpu_kernels.available():
            cname = f"cpu_int{bits}"
            cpu_fn = jax.jit(lambda *a, kw=kw: cpu_kernels.quantized_attention(*a, **kw))
            rows[cname] = None
            cpu_calls[cname] = (cpu_fn, args, want[0], jnp.bfloat16)
            nbytes[cname] = nbytes[name]
        del pools, args
    # The CPU kernels on bf16 and intN pages, called in turn (ratios in one machine state).
    stats, outs = _time_interleaved({k: c[:2] for k, c in cpu_calls.items()}, repeats)
    for cname, (_, _, want, dt) in cpu_calls.items():
        rows[cname] = stats[cname]
        rows[cname]["max_err"] = _check(cname, outs[cname][0], want, dt)
    return nbytes, rows


def _cpu_model():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _cpu_simd_flags():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith(("flags", "Features")):
                return [f for f in line.split(":", 1)[1].split()
                        if f.startswith(("avx", "fma", "f16c", "amx", "asimd", "sve"))]
    except OSError:
        pass
    return []


def _choice_cases(quick):
    """(op, name, make) for the --cpu-choice table: make() -> (kernel fn, xla fn, args,
    dtype, choose kwargs); the kernel fn is traced under each build's options. `args` is a
    tuple, or a list of tuples that successive calls rotate through (weights as cold as
    in a decode step, where each is read once per step between the others)."""
    b, h, kvh, d, seq, ps = (4, 8, 4, 64, 256, 16) if quick else (8, 8, 8, 64, 1024, 16)
    rng = np.random.default_rng(0)
    max_pages = seq // ps
    num_pages = b * max_pages
    tables = _tables(rng, b, max_pages, num_pages)
    lengths = jnp.asarray(rng.integers(seq // 2, seq + 1, size=b), jnp.int32)
    cases = []
    for dt in (F32, jnp.bfloat16):
        def paged(dt=dt):
            q = jnp.asarray(rng.standard_normal((b, h, d)), dt)
            k = jnp.asarray(rng.standard_normal((kvh, num_pages, ps, d)), dt)
            v = jnp.asarray(rng.standard_normal((kvh, num_pages, ps, d)), dt)
            return ((lambda *a: cpu_kernels.paged_decode_attention(*a)[0]),
                    (lambda *a: xla.paged_decode_attention(*a)[0]),
                    (q, k, v, lengths, tables), dt, {})
        cases.append(("paged_decode", f"gqa {jnp.dtype(dt).name} b{b} h{h}/{kvh} d{d} "
                                      f"s{seq}", paged))
    chunk = seq // 4
    for dt in (F32, jnp.bfloat16):
        def prefill(dt=dt):
            # The last chunk of a prompt of `seq` tokens: `chunk` queries per row over all.
            q = jnp.asarray(rng.standard_normal((b, chunk, h, d)), dt)
            k = jnp.asarray(rng.standard_normal((kvh, num_pages, ps, d)), dt)
            v = jnp.asarray(rng.standard_normal((kvh, num_pages, ps, d)), dt)
            full = jnp.full((b,), seq, jnp.int32)
            return ((lambda *a: cpu_kernels.paged_prefill_attention(*a)[0]),
                    (lambda *a: xla.paged_prefill_attention(*a)[0]),
                    (q, k, v, full, tables, jnp.full((b,), chunk, jnp.int32)), dt, {})
        cases.append(("paged_prefill", f"gqa {jnp.dtype(dt).name} b{b} x {chunk} q, s{seq}",
                      prefill))

    def quant():
        group, residual, bits = 32, 64, 4
        qps = 32
        qmax = seq // qps
        qnum = b * qmax
        qtables = _tables(rng, b, qmax, qnum)
        pools = _quant_pools(rng, kvh, qnum, qps, d, bits, group)
        q_tokens = qps * (max(seq - residual, 0) // qps)
        ring = residual + qps
        tail = [jnp.asarray(rng.standard_normal((kvh, b, ring, d)), jnp.bfloat16)
                for _ in range(2)]
        full = jnp.full((b,), seq, jnp.int32)
        args = (jnp.asarray(rng.standard_normal((b, 1, h, d)), jnp.bfloat16), *pools, *tail,
                jnp.full((b,), q_tokens, jnp.int32), full, qtables, (full - 1)[:, None])
        kw = dict(k_bits=bits, v_bits=bits, scale=d**-0.5)
        return ((lambda *a: cpu_kernels.quantized_attention(*a, **kw)[0]),
                (lambda *a: xla_quantized.quantized_attention(*a, **kw)[0]), args, jnp.bfloat16,
                {})
    cases.append(("quantized_decode", f"kivi int4 b{b} h{h}/{kvh} d{d} s{seq}", quant))
    dc, dr, mh = (128, 32, 8) if quick else (512, 64, 16)
    for dt in (F32, jnp.bfloat16):
        def mla(dt=dt):
            args = (jnp.asarray(rng.standard_normal((b, mh, dc)), dt),
                    jnp.asarray(rng.standard_normal((b, mh, dr)), dt),
                    jnp.asarray(rng.standard_normal((num_pages, ps, dc)), dt),
                    jnp.asarray(rng.standard_normal((num_pages, ps, dr)), dt), lengths, tables)
            sc = (dc // 4 + dr) ** -0.5
            return ((lambda *a: cpu_kernels.mla_decode_attention(*a, scale=sc)[0]),
                    (lambda *a: xla.mla_decode_attention(*a, scale=sc)[0]), args, dt, {})
        cases.append(("mla_decode", f"mla {jnp.dtype(dt).name} b{b} d_c {dc} s{seq}", mla))

    def rows():
        layers, heads, pages, width = 8, kvh, num_pages, d
        pool = jnp.asarray(rng.standard_normal((layers, heads, pages, ps, width)),
                           jnp.bfloat16)
        i1 = jnp.asarray(rng.integers(0, pages, b), jnp.int32)
        i2 = jnp.asarray(rng.integers(0, ps, b), jnp.int32)
        x = jnp.asarray(rng.standard_normal((b, heads, width)), jnp.bfloat16)
        layer = jnp.int32(3)
        # Not donated (the timing loop reuses the pool): both paths copy it once per call
        # on top of the write; the kernel's own in-place advantage shows under donation.
        return ((lambda p, lyr, a, c, v: cpu_kernels.write_rows(p, lyr, a, c, v)),
                (lambda p, lyr, a, c, v: p.at[lyr, :, a, c, :].set(v, mode="drop")),
                (pool, layer, i1, i2, x), jnp.bfloat16, {})
    cases.append(("write_rows", f"bf16 rows into [8, {kvh}, {num_pages}, {ps}, {d}]", rows))

    def pages():
        pool = jnp.asarray(rng.standard_normal((8, kvh, num_pages, ps, d)), jnp.bfloat16)
        src = jnp.asarray(rng.integers(0, num_pages, b), jnp.int32)
        dst = jnp.asarray(rng.integers(0, num_pages, b), jnp.int32)
        # Not donated either (reserve's copy-on-write of shared last pages, b of them).
        return ((lambda p, s_, d_: cpu_kernels.copy_pages(p, s_, d_)),
                (lambda p, s_, d_: p.at[:, :, d_].set(p[:, :, s_], mode="drop")),
                (pool, src, dst), jnp.bfloat16, {})
    cases.append(("copy_pages", f"bf16 {b} pages of [8, {kvh}, {num_pages}, {ps}, {d}]",
                  pages))

    # The matmul for a prefill chunk's rows (the kernel's packed path; XLA's dot under
    # "auto"). Its decode rows are judged in the decode step itself (run_cpu_choice: the
    # rows of benchmarks/matmul.py's decode_ab), where each weight is read once per step.
    for k_, n_ in ((512, 1408), (1408, 512)):
        def matmul(k_=k_, n_=n_, m=b * chunk):
            x = jnp.asarray(rng.standard_normal((m, k_)), F32)
            w = jnp.asarray(rng.standard_normal((k_, n_)) / np.sqrt(k_), F32)
            return (cpu_matmul.matmul, (lambda x, w: x @ w), (x, w), F32,
                    dict(rows=m, devices=1))
        cases.append(("matmul", f"float32 [{b * chunk},{k_}]x[{k_},{n_}] (prefill)", matmul))
    return cases


def run_cpu_choice(marches, repeats, quick):
    """The --cpu-choice table: for each op, XLA and each build's kernel, interleaved."""
    builds = {}
    for march in marches:
        with cpu_kernels.override(march=march):
            if not cpu_kernels.available():
                print(f"-march={march}: unavailable: {cpu_kernels.unavailable_reason()}")
                continue
            lib = cpu_kernels.library()
            builds[march] = (cpu_kernels.get_options(), lib.isa_class)
            print(f"-march={march}: {lib.isa_class} ({' '.join(sorted(lib.isa))})")
    print(f"{'op':17s} {'case':40s} {'xla ms':>8s} | " + " | ".join(
        f"{m + ' ms':>11s} {'vs xla':>6s} {'auto':>6s} {'ok':>4s}" for m in builds))
    rows, all_ok = [], True
    for op, name, make in _choice_cases(quick):
        ker, xla_fn, args, dt, choose_kw = make()
        rotation = args if isinstance(args, list) else [args]
        args = rotation[0]
        fns = {"xla": jax.jit(xla_fn)}
        for march in builds:
            with cpu_kernels.override(march=march):
                fns[march] = jax.jit(lambda *a, f=ker: f(*a))
                jax.block_until_ready(fns[march](*args))  # traced under this build
        # A rotation runs as bursts of back-to-back calls, one burst per implementation per
        # round (a decode step calls its matmuls back to back: between two calls of one
        # implementation there is no other's, whose threads would park the helpers).
        burst = min(len(rotation), 64)
        calls = {}
        for cname, fn in fns.items():
            turn = itertools.cycle(rotation)

            def run_burst(*_, fn=fn, turn=turn, burst=burst):
                out = None
                for _ in range(burst):
                    out = fn(*next(turn))
                return out
            calls[cname] = (run_burst, ())
        stats, _ = _time_interleaved(calls, repeats)
        for st in stats.values():
            for key in ("wall_median_s", "wall_min_s", "wall_max_s", "cpu_median_s",
                        "cpu_min_s", "cpu_max_s"):
                st[key] /= burst
            st["burst"] = burst
        outs = {cname: fn(*args) for cname, fn in fns.items()}
        want = np.asarray(outs["xla"], np.float32)
        row = dict(op=op, case=name, xla=stats["xla"])
        line = f"{op:17s} {name:40s} {stats['xla']['wall_median_s'] * 1e3:8.3f} |"
        for march, (opts, isa) in builds.items():
            got = np.asarray(outs[march], np.float32)
            tol = 2e-2 if dt == jnp.bfloat16 else 2e-4
            err = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
            if err > tol:
                raise AssertionError(f"{op} {name} -march={march}: kernel differs from XLA "
                                     f"by {err:.2e}")
            t, tx = stats[march]["wall_median_s"], stats["xla"]["wall_median_s"]
            pick = cpu_kernels.choose(op, dtype=dt, options=opts, **choose_kw).use_kernel
            ok, mark = _auto_ok(pick, t, tx)
            all_ok &= ok
            row[march] = dict(**stats[march], isa_class=isa, speedup=tx / t, max_rel_err=err,
                              auto="kernel" if pick else "xla", auto_is_fastest=ok)
            line += (f" {t * 1e3:11.3f} {tx / t:5.2f}x {'kernel' if pick else 'xla':>6s} "
                     f"{mark:>4s} |")
        rows.append(row)
        print(line)
    from benchmarks import matmul as matmul_bench

    # The matmul's decode rows: one decode step of the e2e model with each build's kernel
    # and with XLA's dot (per-layer weights), in turn; "auto" decides by the step's rows.
    steps = matmul_bench.decode_ab("float32", repeats, list(builds), (1,) if quick else (1, 8),
                                   context=256 if quick else 1024, verbose=False)
    for st in steps:
        tx = float(np.median(st["xla_step_s"]))
        name = f"decode step b{st['batch']} s{st['context']} (every projection)"
        row = dict(op="matmul", case=name, xla=dict(wall_median_s=tx))
        line = f"{'matmul':17s} {name:40s} {tx * 1e3:8.3f} |"
        for march, (_, isa) in builds.items():
            t = float(np.median(st[march]["step_s"]))
            pick = st[march]["auto"] == "kernel"
            ok, mark = _auto_ok(pick, t, tx)
            all_ok &= ok
            row[march] = dict(wall_median_s=t, isa_class=isa, speedup=tx / t,
                              auto=st[march]["auto"], auto_is_fastest=ok)
            line += (f" {t * 1e3:11.3f} {tx / t:5.2f}x {st[march]['auto']:>6s} {mark:>4s} |")
        rows.append(row)
        print(line)
    print(f"auto picks the faster implementation in every row (tie: within "
          f"{100 * TIE:.0f}%)" if all_ok else
          "auto does NOT pick the faster implementation in some rows (NO)")
    return rows


# Two implementations within this fraction of each other are a tie on this shared
# machine (repeated runs of the same pair moved by that much): either pick is right.
TIE = 0.05


def _auto_ok(pick, t_kernel, t_xla):
    """(ok, mark): whether "auto"'s pick is the faster of the two, or a tie."""
    if abs(t_kernel - t_xla) <= TIE * min(t_kernel, t_xla):
        return True, "tie"
    ok = pick == (t_kernel < t_xla)
    return ok, "yes" if ok else "NO"


# ----------------------------------------------------------------------------- main

FULL = [
    dict(name="gqa_b8_s4k", kind="gqa", batch=8, q_heads=32, kv_heads=8, head_dim=128,
         seq=4096, page_size=16),
    dict(name="gqa_b1_s4k", kind="gqa", batch=1, q_heads=32, kv_heads=8, head_dim=128,
         seq=4096, page_size=16),
    dict(name="gqa_b8_s1k", kind="gqa", batch=8, q_heads=32, kv_heads=8, head_dim=128,
         seq=1024, page_size=16),
    dict(name="mqa_b8_s4k", kind="gqa", batch=8, q_heads=32, kv_heads=1, head_dim=128,
         seq=4096, page_size=16),
    dict(name="gqa_b8_mixed4k", kind="gqa", batch=8, q_heads=32, kv_heads=8, head_dim=128,
         seq=4096, page_size=16, mixed=True),
    dict(name="mla_b8_s4k", kind="mla", batch=8, q_heads=16, d_c=512, d_rope=64, seq=4096,
         page_size=16),
]
QUICK = [
    dict(name="gqa_b4_s512", kind="gqa", batch=4, q_heads=16, kv_heads=4, head_dim=64,
         seq=512, page_size=16),
    dict(name="mla_b4_s512", kind="mla", batch=4, q_heads=8, d_c=128, d_rope=32, seq=512,
         page_size=16),
]
# Quantized pages vs bf16/f32 pages (the main 4K geometry; page size 32 so that KIVI's
# group of 32 tokens fits a page, the same page size for every row).
QUANT_FULL = dict(name="quant_b8_s4k", batch=8, q_heads=32, kv_heads=8, head_dim=128, seq=4096,
                  page_size=32, group=32, residual=128, bits=(8, 4, 2))
QUANT_QUICK = dict(name="quant_b4_s512", batch=4, q_heads=16, kv_heads=4, head_dim=64, seq=512,
                   page_size=32, group=32, residual=64, bits=(8, 4, 2))
POOL_FULL = dict(batch=8, q_heads=32, kv_heads=8, head_dim=128, seq=1024, page_size=16)
POOL_QUICK = dict(batch=4, q_heads=16, kv_heads=4, head_dim=64, seq=256, page_size=16)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="small sizes (seconds of work), for checking the script itself")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed calls per implementation after a warm-up (default 7, quick 5)")
    parser.add_argument("--ref-repeats", type=int, default=None,
                        help="timed calls of the slow gather reference (default 3, quick 3)")
    parser.add_argument("--dtypes", default="float32,bfloat16",
                        help="comma-separated page/query dtypes (float32, bfloat16)")
    parser.add_argument("--only", default=None,
                        help="comma-separated case names to run (see FULL/QUICK in the source)")
    parser.add_argument("--block-tokens", type=int, default=None,
                        help="tokens per sequence per loop step of the XLA path "
                             "(default: kvjax.attention.xla.default_block_tokens)")
    parser.add_argument("--bandwidth-mib", type=int, default=None,
                        help="array size for the bandwidth measurements (default 1024, quick 128)")
    parser.add_argument("--pool-factors", default="1,4,16",
                        help="pool sizes, as multiples of the live pages, for the capacity check "
                             "(empty to skip)")
    parser.add_argument("--quant", default="on", choices=("on", "off", "only"),
                        help="the quantized-pages comparison (int8/int4/int2 vs bf16/f32 "
                             "pages): run it, skip it, or run only it")
    parser.add_argument("--cpu-choice", action="store_true",
                        help="only the table of each CPU op: XLA path vs each kernel build, "
                             "and whether 'auto' picks the faster")
    parser.add_argument("--marches", default="native,haswell",
                        help="--cpu-choice: comma-separated -march builds (default "
                             "native,haswell)")
    parser.add_argument("--out", default=None,
                        help="JSON output path (default benchmarks/results/attention-<time>.json)")
    args = parser.parse_args(argv)
    if args.cpu_choice:
        print(f"{_cpu_model()} ({os.cpu_count()} cpus; {' '.join(_cpu_simd_flags())}); "
              f"load average {os.getloadavg()[0]:.1f}")
        rows = run_cpu_choice(args.marches.split(","), args.repeats or 15, args.quick)
        out = result_path(f"attention-cpu-choice-{'quick-' if args.quick else ''}", args.out)
        with open(out, "w") as f:
            json.dump(dict(cpu=_cpu_model(), simd_flags=_cpu_simd_flags(),
                           cpus=os.cpu_count(), jax=jax.__version__, rows=rows), f, indent=1)
        print(f"wrote {out}")
        return

    repeats = args.repeats or (5 if args.quick else 7)
    ref_repeats = args.ref_repeats or 3
    cases = QUICK if args.quick else FULL
    if args.only:
        names = set(args.only.split(","))
        cases = [c for c in cases if c["name"] in names]
    dtypes = [jnp.dtype(d) for d in args.dtypes.split(",")]
    bw_bytes = (args.bandwidth_mib or (128 if args.quick else 1024)) << 20
    key = jax.random.key(0)

    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}")
    bw = measure_bandwidth(bw_bytes, repeats)
    if not cpu_kernels.available():
        print(f"no 'cpu' rows: {cpu_kernels.unavailable_reason()}")
    print(f"streaming read {bw['read_GBps']:.1f} GB/s (best {bw['read_GBps_best']:.1f}), "
          f"copy {bw['copy_GBps']:.1f} GB/s (best {bw['copy_GBps_best']:.1f})")

    results = []
    if args.quant == "only":
        cases = []
    work = [(c, d) for c in cases for d in dtypes]
    for cfg, dtype in tqdm(work, desc="attention", file=sys.stderr):
        runner = run_mla if cfg["kind"] == "mla" else run_gqa
        nbytes, rows = runner(cfg, dtype, repeats, ref_repeats, args.block_tokens, key)
        for st in rows.values():
            st["GBps"] = nbytes / st["wall_median_s"] / 1e9
            st["GBps_cpu"] = nbytes / st["cpu_median_s"] / 1e9
            st["fraction_of_read_bw"] = st["GBps"] / bw["read_GBps"]
        ratios = {}
        if "contiguous" in rows:
            for impl in ("xla", "cpu"):
                for base in ("contiguous", "contiguous_blocked"):
                    if base in rows and impl in rows:
                        ratios[f"{impl}/{base}"] = rows[impl]["wall_median_s"] / rows[base][
                            "wall_median_s"]
                        ratios[f"{impl}/{base}_cpu"] = rows[impl]["cpu_median_s"] / rows[base][
                            "cpu_median_s"]
        results.append(dict(case=cfg, dtype=dtype.name, bytes=nbytes, impls=rows,
                            ratios=ratios))

    quant = None
    if args.quant != "off":
        qcfg = QUANT_QUICK if args.quick else QUANT_FULL
        nbytes, rows = run_quant(qcfg, repeats, ref_repeats, args.block_tokens, key)
        for name, st in rows.items():
            # Each implementation against its own bf16 pages ("cpu_*" rows: the CPU kernel).
            base = rows["cpu_bfloat16" if name.startswith("cpu_") else "paged_bfloat16"]
            st["bytes"] = nbytes[name]
            st["GBps"] = nbytes[name] / st["wall_median_s"] / 1e9
            st["GBps_cpu"] = nbytes[name] / st["cpu_median_s"] / 1e9
            st["fraction_of_read_bw"] = st["GBps"] / bw["read_GBps"]
            st["ratio_to_bf16"] = st["wall_median_s"] / base["wall_median_s"]
            st["ratio_to_bf16_cpu"] = st["cpu_median_s"] / base["cpu_median_s"]
        quant = dict(case=qcfg, impls=rows)

    pool = {}
    factors = [int(f) for f in args.pool_factors.split(",") if f]
    if args.quant == "only":
        factors = []
    if factors:
        pcfg = POOL_QUICK if args.quick else POOL_FULL
        for dtype in tqdm(dtypes, desc="pool capacity", file=sys.stderr):
            pool[dtype.name] = run_pool_check(pcfg, dtype, repeats, args.block_tokens, factors,
                                              key)

    # ---- table
    hdr = (f"{'case':16s} {'dtype':8s} {'impl':19s} {'wall ms (min-max)':>24s} {'cpu ms':>8s} "
           f"{'GB/s':>6s} {'%read':>6s} {'GB/s cpu':>8s}")
    if results:
        print(hdr)
        print("-" * len(hdr))
    for r in results:
        for impl, st in r["impls"].items():
            wall = (f"{st['wall_median_s'] * 1e3:7.2f} ({st['wall_min_s'] * 1e3:.1f}-"
                    f"{st['wall_max_s'] * 1e3:.1f})")
            print(f"{r['case']['name']:16s} {r['dtype']:8s} {impl:19s} {wall:>24s} "
                  f"{st['cpu_median_s'] * 1e3:8.2f} {st['GBps']:6.1f} "
                  f"{100 * st['fraction_of_read_bw']:5.0f}% {st['GBps_cpu']:8.1f}")
        if r["ratios"]:
            print(" " * 26 + "  ".join(f"{k} {v:.2f}" for k, v in r["ratios"].items()))
    if quant is not None:
        c = quant["case"]
        print(f"\n{c['name']}: B={c['batch']} Hq={c['q_heads']} Hkv={c['kv_heads']} "
              f"D={c['head_dim']} S={c['seq']} ps={c['page_size']} G={c['group']} "
              f"R={c['residual']} (XLA path; bf16 queries and tail for intN)")
        qh = (f"{'impl':19s} {'wall ms (min-max)':>24s} {'cpu ms':>8s} {'MB read':>8s} "
              f"{'GB/s':>6s} {'/bf16 wall':>10s} {'/bf16 cpu':>9s}")
        print(qh)
        print("-" * len(qh))
        for impl, st in quant["impls"].items():
            wall = (f"{st['wall_median_s'] * 1e3:7.2f} ({st['wall_min_s'] * 1e3:.1f}-"
                    f"{st['wall_max_s'] * 1e3:.1f})")
            print(f"{impl:19s} {wall:>24s} {st['cpu_median_s'] * 1e3:8.2f} "
                  f"{st['bytes'] / 1e6:8.1f} {st['GBps']:6.1f} {st['ratio_to_bf16']:10.2f} "
                  f"{st['ratio_to_bf16_cpu']:9.2f}")
    for dt, rows in pool.items():
        base = rows[next(iter(rows))]["wall_median_s"]
        base_cpu = rows[next(iter(rows))]["cpu_median_s"]
        print(f"pool capacity {dt}: " + "  ".join(
            f"{f}: {st['wall_median_s'] * 1e3:.2f} ms ({st['wall_median_s'] / base:.2f}x wall, "
            f"{st['cpu_median_s'] / base_cpu:.2f}x cpu)" for f, st in rows.items()))

    out = result_path(f"attention-{'quick-' if args.quick else ''}", args.out)
    with open(out, "w") as f:
        json.dump(dict(jax=jax.__version__, machine=platform.machine(), cpus=os.cpu_count(),
                       load_average=os.getloadavg(), bandwidth=bw, results=results,
                       pool_capacity=pool, quantized=quant, repeats=repeats,
                       block_tokens=args.block_tokens), f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
