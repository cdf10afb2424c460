"""Decode attention over a paged bf16 / int4 / int2 cache against the machine's copy bandwidth.

For each batch x context size this builds one layer of a paged cache with
random contents and times one decode-attention call (`impl="auto"`: the XLA
path on CPU, the Pallas kernel on accelerators for bf16):

* bf16: `kvjax.attention.paged_decode_attention` over bf16 K/V pages;
* int4 / int2: `kvjax.attention.quantized_decode_attention` over a KIVI cache
  (`kvjax.cache.quantized`: packed codes, float16 scales and zeros per group,
  a bf16 tail of the most recent tokens).

The bytes counted are what the op must read once: the live tokens' K and V
(quantized: the packed codes, scales and zeros of every used page plus the
live tail tokens). Achieved GB/s = bytes / median wall time, reported with its
fraction of the measured copy bandwidth (read + write of a large array copy,
`benchmarks.attention.measure_bandwidth`) and of the streaming read bandwidth.

Every size is verified in the same run: bf16 against the gather reference,
quantized against dense NumPy float32 attention over the K/V
the cache dequantizes to (`kvjax.cache.quantized.dequantized_sequence`), for
two rows. Writes JSON to benchmarks/results/.

    PYTHONPATH=. python benchmarks/roofline.py --quick
    PYTHONPATH=. python benchmarks/roofline.py --max-gib 2
"""

import argparse
import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kvjax as kvx  # noqa: E402
from benchmarks import result_path  # noqa: E402
from benchmarks.attention import _time, measure_bandwidth  # noqa: E402
from kernels_pallas.paged_attention import reference as paged_ref  # noqa: E402
from kvjax import attention  # noqa: E402
from kvjax.cache import quantized as qz  # noqa: E402
from kvjax.specs import QuantSpec  # noqa: E402

BF16 = jnp.bfloat16
F32 = jnp.float32

# (batch, context); heads and widths from GEOMETRY.
FULL_SIZES = [(1, 4096), (8, 4096), (8, 16384), (16, 16384)]
QUICK_SIZES = [(2, 512)]
GEOMETRY = dict(full=dict(q_heads=32, kv_heads=8, head_dim=128),
                quick=dict(q_heads=8, kv_heads=2, head_dim=64))
FORMATS = ("bf16", "int4", "int2")
TOL = 3e-2  # bf16 queries and outputs: ~2^-7 relative rounding, with headroom


def kv_bytes_bf16(batch, context, kv_heads, head_dim):
    """Bytes of the live K and V of a bf16 cache: 2 x tokens x heads x head_dim x 2."""
    return 2 * batch * context * kv_heads * head_dim * 2


def bf16_case(rng, key, batch, context, geo, page_size):
    """Random bf16 pools with permuted block tables; returns (args, reference fn, bytes)."""
    kv_heads, d = geo["kv_heads"], geo["head_dim"]
    pages_per_seq = context // page_size
    num_pages = batch * pages_per_seq
    k1, k2, k3 = jax.random.split(key, 3)
    q = jax.random.normal(k1, (batch, geo["q_heads"], d), F32).astype(BF16)
    kp = jax.random.normal(k2, (kv_heads, num_pages, page_size, d), F32).astype(BF16)
    vp = jax.random.normal(k3, (kv_heads, num_pages, page_size, d), F32).astype(BF16)
    tables = jnp.asarray(rng.permutation(num_pages).reshape(batch, pages_per_seq), jnp.int32)
    lengths = jnp.full((batch,), context, jnp.int32)
    return (q, kp, vp, lengths, tables), kv_bytes_bf16(batch, context, kv_heads, d)


def quant_cache(rng, batch, context, geo, bits, page_size, group, residual):
    """A one-layer KIVI cache holding `context` tokens per row, with random codes and scales.

    The allocator runs for real (`reserve`), so block tables, quantized lengths
    and the tail split are the cache's own; only the stored values are random
    (writing gigabytes through the quantizer would dominate the benchmark).
    """
    spec = kvx.CacheSpec(
        attention=kvx.AttentionSpec(q_heads=geo["q_heads"], kv_heads=geo["kv_heads"],
                                    head_dim=geo["head_dim"]),
        num_layers=1, page_size=page_size, num_pages=batch * (context // page_size),
        max_seqs=batch, max_pages_per_seq=context // page_size, dtype=BF16,
        quant=QuantSpec(bits=bits, group_size=group, residual=residual))
    cache = qz.init_cache(spec)
    cache, status = kvx.cache.reserve(cache, jnp.full((batch,), context, jnp.int32))
    status.raise_if_error()

    def fill(x):
        if x.dtype == jnp.uint8:
            return jnp.asarray(rng.integers(0, 256, x.shape, dtype=np.uint8))
        if x.dtype == jnp.int32:
            return x
        # Positive scales and zeros of a plausible size; tail values ~N(0, 1).
        return jnp.asarray(rng.uniform(0.02, 0.2, x.shape).astype(np.float32)).astype(x.dtype)

    pages = jax.tree.map(fill, cache.pages)
    a, b = (jnp.asarray(rng.standard_normal(x.shape, np.float32)).astype(x.dtype)
            for x in (cache.tail.a, cache.tail.b))
    cache = dataclasses.replace(cache, pages=pages,
                                tail=dataclasses.replace(cache.tail, a=a, b=b))
    return jax.block_until_ready(cache)


def quant_bytes(cache):
    """Bytes a decode step must read: used pages' codes + scales + zeros, and live tail tokens."""
    view = qz.layer_view(cache, 0)
    num_pages = cache.spec.num_pages
    per_page = sum((p.codes.nbytes + p.scale.nbytes + p.zero.nbytes) / num_pages
                   for p in (view.k, view.v))
    used_pages = int(np.sum(np.asarray(cache.quant_lengths))) // cache.spec.page_size
    tail_tokens = int(np.sum(np.asarray(cache.lengths - cache.quant_lengths)))
    heads = view.tail_k.shape[0]
    tail = tail_tokens * heads * (view.tail_k.shape[-1] + view.tail_v.shape[-1]) * \
        view.tail_k.dtype.itemsize
    return int(used_pages * per_page + tail), dict(
        pages=used_pages, bytes_per_page=per_page, tail_tokens=tail_tokens, tail_bytes=tail)


def dense_rows(q, cache, rows, scale):
    """float32 NumPy attention of `rows` over the K/V the cache dequantizes to."""
    out = []
    q = np.asarray(q.astype(F32))
    for s in rows:
        k, v = qz.dequantized_sequence(cache, 0, s)  # [tokens, heads, width] float32
        hq, hkv = q.shape[1], k.shape[1]
        o = np.zeros((hq, v.shape[-1]), np.float32)
        for h in range(hq):
            logits = k[:, h // (hq // hkv)] @ q[s, h] * scale
            p = np.exp(logits - logits.max())
            o[h] = p @ v[:, h // (hq // hkv)] / p.sum()
        out.append(o)
    return np.stack(out)


def check(name, got, want):
    err = float(np.max(np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32))))
    ref = float(np.max(np.abs(np.asarray(want, np.float32)))) + 1e-6
    if not err <= TOL * max(1.0, ref):
        raise AssertionError(f"{name}: max |error| {err:.3g} vs reference exceeds {TOL}")
    return err


def run(sizes, geo, formats, repeats, page_size, group, residual, max_bytes, bw, seed=0):
    rng = np.random.default_rng(seed)
    key = jax.random.key(seed)
    rows, skipped = [], []
    jobs = [(b, c, f) for b, c in sizes for f in formats]
    for batch, context, fmt in tqdm(jobs, desc="roofline", file=sys.stderr):
        name = f"{fmt} B={batch} ctx={context}"
        full = kv_bytes_bf16(batch, context, geo["kv_heads"], geo["head_dim"])
        if full > max_bytes:
            skipped.append(dict(format=fmt, batch=batch, context=context, bf16_bytes=full))
            continue
        if fmt == "bf16":
            args, nbytes = bf16_case(rng, key, batch, context, geo, page_size)
            fn = jax.jit(attention.paged_decode_attention)
            stats, (out, _) = _time(fn, args, repeats)
            want, _ = jax.jit(paged_ref.paged_decode_attention)(*args)
            err = check(name, out, want)
            detail = {}
            del args
        else:
            cache = quant_cache(rng, batch, context, geo, int(fmt[3:]), page_size, group,
                                residual)
            nbytes, detail = quant_bytes(cache)
            q = jax.random.normal(key, (batch, geo["q_heads"], geo["head_dim"]), F32).astype(BF16)
            fn = jax.jit(lambda q, view: attention.quantized_decode_attention(q, view))
            stats, (out, _) = _time(fn, (q, qz.layer_view(cache, 0)), repeats)
            rows_checked = sorted({0, batch - 1})
            want = dense_rows(q, cache, rows_checked, geo["head_dim"] ** -0.5)
            err = check(name, np.asarray(out.astype(F32))[rows_checked], want)
            del cache
        gbps = nbytes / stats["wall_median_s"] / 1e9
        rows.append(dict(
            format=fmt, batch=batch, context=context, **geo, page_size=page_size,
            bytes=nbytes, bf16_equivalent_bytes=full, **stats, max_err=err,
            GBps=gbps, GBps_best=nbytes / stats["wall_min_s"] / 1e9,
            fraction_of_copy=gbps / bw["copy_GBps"], fraction_of_read=gbps / bw["read_GBps"],
            tokens_per_s_equiv=batch / stats["wall_median_s"], **detail))
    return rows, skipped


def print_table(rows, bw):
    print(f"copy bandwidth {bw['copy_GBps']:.1f} GB/s (read+write), streaming read "
          f"{bw['read_GBps']:.1f} GB/s")
    hdr = (f"{'fmt':5} {'B':>3} {'ctx':>6} {'MiB read':>9} {'ms median (min-max)':>24} "
           f"{'GB/s':>6} {'%copy':>6} {'%read':>6} {'vs bf16 time':>12}")
    print(hdr)
    print("-" * len(hdr))
    base = {(r["batch"], r["context"]): r["wall_median_s"] for r in rows if r["format"] == "bf16"}
    for r in rows:
        ms = (f"{r['wall_median_s'] * 1e3:8.2f} ({r['wall_min_s'] * 1e3:.2f}-"
              f"{r['wall_max_s'] * 1e3:.2f})")
        b = base.get((r["batch"], r["context"]))
        rel = f"{r['wall_median_s'] / b:.2f}" if b else "-"
        print(f"{r['format']:5} {r['batch']:>3} {r['context']:>6} {r['bytes'] / 2**20:>9.1f} "
              f"{ms:>24} {r['GBps']:>6.2f} {100 * r['fraction_of_copy']:>5.1f}% "
              f"{100 * r['fraction_of_read']:>5.1f}% {rel:>12}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes (seconds of work)")
    p.add_argument("--formats", default=",".join(FORMATS),
                   help="comma-separated cache formats among bf16, int4, int2")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed calls per size after a warm-up (default 5, quick 3)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per page")
    p.add_argument("--group", type=int, default=16,
                   help="KIVI group size (elements per scale/zero); must divide the page size")
    p.add_argument("--residual", type=int, default=64,
                   help="tokens per sequence kept in the bf16 tail of quantized caches")
    p.add_argument("--max-gib", type=float, default=2.0,
                   help="skip sizes whose bf16 K/V would exceed this many GiB")
    p.add_argument("--bandwidth-mib", type=int, default=None,
                   help="array size of the bandwidth probe (default 512, quick 64)")
    p.add_argument("--out", default=None,
                   help="JSON path (default benchmarks/results/roofline-<time>.json)")
    a = p.parse_args(argv)
    quick = a.quick
    repeats = a.repeats or (3 if quick else 5)
    geo = GEOMETRY["quick" if quick else "full"]
    sizes = QUICK_SIZES if quick else FULL_SIZES
    formats = [f for f in a.formats.split(",") if f]
    for f in formats:
        if f not in FORMATS:
            raise ValueError(f"--formats: {f!r} is not one of {FORMATS}")
    bw = measure_bandwidth((a.bandwidth_mib or (64 if quick else 512)) << 20, repeats)
    rows, skipped = run(sizes, geo, formats, repeats, a.page_size, a.group, a.residual,
                        a.max_gib * 2**30, bw)
    print_table(rows, bw)
    for s in skipped:
        print(f"skipped {s} (over --max-gib {a.max_gib})")
    out = result_path("roofline-", a.out)
    with open(out, "w") as f:
        json.dump(dict(backend=jax.default_backend(), device=jax.devices()[0].device_kind,
                       jax=jax.__version__, bandwidth=bw, rows=rows, skipped=skipped,
                       repeats=repeats, quick=quick, group=a.group, residual=a.residual,
                       load_average=os.getloadavg()), f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
