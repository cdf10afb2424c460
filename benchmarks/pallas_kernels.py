"""Times the Pallas decode kernels against the XLA path on the current backend.

For every size in batch x context x GQA ratio (plus MLA over batch x context)
this script builds a random paged cache (randomly permuted block tables,
every sequence at the full context), times each implementation (warm-up, then
the median of --repeats runs, each ending in `block_until_ready`), checks each
result against the jnp reference in the same run, and reports the achieved
bandwidth of the KV read (bytes the op must read / median time) and its
fraction of a measured device copy bandwidth (read + write bytes of a large
array copy / time).

On TPU and GPU the kernels run natively ("native"). On CPU only Pallas'
interpret mode exists: the TPU kernel is then timed interpreted ("interpret"
in the table): a correctness run, not a kernel speed. The XLA path is marked
"xla" everywhere. The quantized ops ("qgqa", "qmla": KIVI `--bits` pages, the public
`kvjax.attention.quantized_*decode_attention` with impl "xla" and "pallas") count the
packed codes, scales and zeros as the bytes read.

  python benchmarks/pallas_kernels.py --quick      # < 3 min on a GPU; a minute or two on CPU
  python benchmarks/pallas_kernels.py --help

Results go to benchmarks/results/kernels-<backend>-<UTC time>.json.
"""

import argparse
import dataclasses
import datetime
import functools
import json
import pathlib
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from kernels_pallas.mla_decode import gpu as mla_gpu  # noqa: E402
from kernels_pallas.mla_decode import reference as mla_ref  # noqa: E402
from kernels_pallas.mla_decode import tpu as mla_tpu  # noqa: E402
from kernels_pallas.paged_attention import gpu as paged_gpu  # noqa: E402
from kernels_pallas.paged_attention import reference as paged_ref  # noqa: E402
from kernels_pallas.paged_attention import tpu as paged_tpu  # noqa: E402
from kernels_pallas.quantized_attention.layout import codes_per_byte  # noqa: E402
from kvjax import attention  # noqa: E402
from kvjax.attention.pages import QuantizedLayerView, QuantLayer  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"

# (batch, context, gqa ratios) per preset and backend kind.
PRESETS = {
    ("quick", "accel"): dict(batch=[1, 8], context=[1024, 8192], gqa=[1, 4, 8]),
    ("full", "accel"): dict(batch=[1, 8, 32], context=[1024, 4096, 16384, 32768],
                            gqa=[1, 4, 8]),
    ("quick", "cpu"): dict(batch=[1, 4], context=[256, 1024], gqa=[1, 4]),
    ("full", "cpu"): dict(batch=[1, 4, 8], context=[512, 2048, 4096], gqa=[1, 4, 8]),
}
TOL = {"float32": 1e-4, "bfloat16": 3e-2}


@dataclasses.dataclass
class Row:
    op: str
    impl: str
    mode: str
    batch: int
    context: int
    q_heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    dtype: str
    kv_bytes: int
    median_ms: float
    gbps: float
    frac_copy: float
    max_abs_err: float
    ok: bool


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--quick", action="store_true",
                   help="small preset (under 3 minutes on a GPU); default is the full sweep")
    p.add_argument("--batch", type=int, nargs="+", help="batch sizes (overrides the preset)")
    p.add_argument("--context", type=int, nargs="+",
                   help="tokens per sequence (overrides the preset)")
    p.add_argument("--gqa", type=int, nargs="+",
                   help="query heads per KV head (overrides the preset); 1 = MHA")
    p.add_argument("--q-heads", type=int, default=None,
                   help="query heads (default 32 on accelerators, 8 on CPU)")
    p.add_argument("--head-dim", type=int, default=128, help="head width of K and V")
    p.add_argument("--page-size", type=int, default=16, help="tokens per page")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="cache and query dtype; auto = bfloat16 on accelerators, float32 on CPU "
                        "(bf16 arithmetic is slow on CPUs)")
    p.add_argument("--ops", nargs="+", choices=["gqa", "mla", "qgqa", "qmla"],
                   default=["gqa", "mla", "qgqa", "qmla"],
                   help="which ops to time: paged GQA decode, absorbed MLA decode, and the "
                        "same over KIVI-quantized pages (qgqa, qmla)")
    p.add_argument("--bits", type=int, choices=[2, 4, 8], default=4,
                   help="code width of the quantized ops")
    p.add_argument("--group", type=int, default=16,
                   help="KIVI group size G of the quantized ops (divides the page size)")
    p.add_argument("--mla-heads", type=int, default=16, help="MLA query heads")
    p.add_argument("--mla-dims", type=int, nargs=2, default=[512, 64], metavar=("D_C", "D_ROPE"),
                   help="MLA latent width d_c and rotary width d_rope")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed runs per implementation (median reported); default 20, 3 on CPU")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs after compilation")
    p.add_argument("--max-gib", type=float, default=8.0,
                   help="skip sizes whose KV cache exceeds this many GiB")
    p.add_argument("--copy-mib", type=int, default=None,
                   help="array size of the copy-bandwidth probe (default 1024 on accelerators, "
                        "256 on CPU)")
    p.add_argument("--no-kernel", action="store_true",
                   help="time only the XLA path (e.g. a quick CPU baseline)")
    p.add_argument("--out", type=pathlib.Path, default=None,
                   help="JSON path (default benchmarks/results/kernels-<backend>-<time>.json)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    return p.parse_args(argv)


def time_fn(fn, args, warmup, repeats):
    """Median wall time in ms of fn(*args) after compilation and warm-up; returns (ms, out)."""
    out = jax.block_until_ready(fn(*args))
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), out


def copy_bandwidth(mib: int, repeats: int) -> float:
    """GB/s of read + write of an on-device array copy (the ceiling a decode step reads at).

    The input is donated and the output fed back in, so every timed run copies
    between the same two buffers instead of first-touching fresh memory.
    """
    n = mib * 2**20 // 4
    x = jnp.arange(n, dtype=jnp.float32)
    # Multiplying by a traced scalar keeps XLA from eliding or folding the copy.
    fn = jax.jit(lambda a, s: a * s, donate_argnums=0)
    one = jnp.float32(1.0)
    for _ in range(3):
        x = jax.block_until_ready(fn(x, one))
    times = []
    for _ in range(max(repeats, 5)):
        t0 = time.perf_counter()
        x = jax.block_until_ready(fn(x, one))
        times.append(time.perf_counter() - t0)
    return 2 * n * 4 / statistics.median(times) / 1e9


def paged_inputs(rng, batch, context, kv_heads, q_heads, widths, page_size, dtype):
    """Random q parts, pools and a randomly permuted block table with every row full."""
    pages_per_seq = -(-context // page_size)
    num_pages = batch * pages_per_seq
    tables = rng.permutation(num_pages).reshape(batch, pages_per_seq).astype(np.int32)
    lengths = np.full((batch,), context, np.int32)
    key = jax.random.key(int(rng.integers(2**31)))
    ks = jax.random.split(key, 2 * len(widths))
    qs = [jax.random.normal(ks[i], (batch, q_heads, w), jnp.float32).astype(dtype)
          for i, w in enumerate(widths)]
    pools = [jax.random.normal(ks[len(widths) + i], (kv_heads, num_pages, page_size, w),
                               jnp.float32).astype(dtype) for i, w in enumerate(widths)]
    return qs, pools, jnp.asarray(lengths), jnp.asarray(tables)


def quant_inputs(rng, batch, context, kv_heads, q_heads, widths, page_size, dtype, bits, group,
                 mla):
    """Random queries and a `QuantizedLayerView`: every row's whole pages quantized (random
    codes, float16 scales/zeros), the rest of its context in a one-page full-precision tail.

    Returns (query parts, view, bytes the op must read).
    """
    pages_per_seq = -(-context // page_size)
    num_pages = batch * pages_per_seq
    tables = rng.permutation(num_pages).reshape(batch, pages_per_seq).astype(np.int32)
    quant = context // page_size * page_size
    k = codes_per_byte(bits)

    def pool(width, grouping):
        heads = 1 if mla else kv_heads
        codes = rng.integers(0, 256, (heads, num_pages, page_size, width // k), dtype=np.uint8)
        shape = ((heads, num_pages, page_size // group, width) if grouping == "tokens"
                 else (heads, num_pages, page_size, width // group))
        scale = jnp.asarray(rng.uniform(0.5, 3.0, shape) / (2**bits - 1), jnp.float16)
        zero = jnp.asarray(rng.uniform(-1.5, 0.0, shape), jnp.float16)
        # Per quantized token: the packed codes plus a float16 scale and zero per G
        # elements (per channel over G tokens, or per token over G channels alike).
        nbytes = heads * batch * quant * (width // k + 4 * width // group)
        return QuantLayer(jnp.asarray(codes), scale, zero, bits, grouping), nbytes

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)

    heads = 1 if mla else kv_heads
    if mla:
        kq, kb = pool(widths[0], "channels")
        v = normal(1, num_pages, page_size, widths[1])
        vb = batch * quant * widths[1] * dtype.itemsize
    else:
        kq, kb = pool(widths[0], "tokens")
        v, vb = pool(widths[1], "channels")
    tail = [normal(heads, batch, page_size, w) for w in widths]
    view = QuantizedLayerView(
        k=kq, v=v, tail_k=tail[0], tail_v=tail[1], block_tables=jnp.asarray(tables),
        quant_lengths=jnp.full((batch,), quant, jnp.int32),
        lengths=jnp.full((batch,), context, jnp.int32))
    qs = [normal(batch, q_heads, w) for w in widths[:1 if not mla else 2]]
    tail_bytes = heads * batch * (context - quant) * sum(widths) * dtype.itemsize
    return qs, view, kb + vb + tail_bytes


def kernel_fns(backend):
    """(mode, gqa kernel, mla kernel) for the backend; CPU interprets the TPU kernel."""
    if backend == "gpu":
        return "native", paged_gpu.paged_decode_attention, mla_gpu.mla_decode_attention
    if backend == "tpu":
        return "native", paged_tpu.paged_decode_attention, mla_tpu.mla_decode_attention
    return ("interpret", functools.partial(paged_tpu.paged_decode_attention, interpret=True),
            functools.partial(mla_tpu.mla_decode_attention, interpret=True))


def main(argv=None):
    args = parse_args(argv)
    backend = jax.default_backend()
    kind = "cpu" if backend == "cpu" else "accel"
    preset = dict(PRESETS[("quick" if args.quick else "full", kind)])
    for name in ("batch", "context", "gqa"):
        if getattr(args, name):
            preset[name] = getattr(args, name)
    dtype_name = args.dtype if args.dtype != "auto" else (
        "float32" if backend == "cpu" else "bfloat16")
    dtype = jnp.dtype(dtype_name)
    q_heads = args.q_heads or (8 if backend == "cpu" else 32)
    repeats = args.repeats or (3 if backend == "cpu" else 20)
    copy_mib = args.copy_mib or (256 if backend == "cpu" else 1024)
    rng = np.random.default_rng(args.seed)
    mode, gqa_kernel, mla_kernel = kernel_fns(backend)

    print(f"backend={backend} device={jax.devices()[0].device_kind} dtype={dtype_name} "
          f"kernel mode={mode}")
    copy_gbps = copy_bandwidth(copy_mib, repeats)
    print(f"measured copy bandwidth (read+write of {copy_mib} MiB): {copy_gbps:.1f} GB/s")

    jobs = []
    if "gqa" in args.ops:
        for b in preset["batch"]:
            for c in preset["context"]:
                for g in preset["gqa"]:
                    if q_heads % g:
                        continue
                    jobs.append(("gqa", b, c, g))
    for op in ("mla", "qmla"):
        if op in args.ops:
            jobs += [(op, b, c, args.mla_heads) for b in preset["batch"]
                     for c in preset["context"]]
    if "qgqa" in args.ops:
        jobs += [("qgqa", b, c, g) for b in preset["batch"] for c in preset["context"]
                 for g in preset["gqa"] if q_heads % g == 0]

    rows, skipped = [], []
    for op, b, c, g in tqdm(jobs, desc="sizes", file=sys.stderr):
        if op in ("gqa", "qgqa"):
            kv_heads, widths, heads = q_heads // g, (args.head_dim, args.head_dim), q_heads
        else:
            kv_heads, widths, heads = 1, tuple(args.mla_dims), g
        ctx_padded = -(-c // args.page_size) * args.page_size
        pool_bytes = b * kv_heads * ctx_padded * sum(widths) * dtype.itemsize
        if pool_bytes > args.max_gib * 2**30:
            skipped.append(dict(op=op, batch=b, context=c, gqa=g, gib=pool_bytes / 2**30))
            continue
        if op in ("qgqa", "qmla"):
            qs, view, kv_bytes = quant_inputs(rng, b, c, kv_heads, heads, widths, args.page_size,
                                              dtype, args.bits, args.group, op == "qmla")
            if op == "qgqa":
                inputs, fn, opts = (qs[0], view), attention.quantized_decode_attention, {}
            else:
                inputs, fn = (qs[0], qs[1], view), attention.quantized_mla_decode_attention
                opts = dict(scale=1.0 / np.sqrt(192.0))
            ref = jax.jit(functools.partial(fn, impl="reference", **opts))
            impls = {impl: jax.jit(functools.partial(fn, impl=impl, **opts))
                     for impl in (("xla",) if args.no_kernel else ("xla", "pallas"))}
        else:
            qs, pools, lengths, tables = paged_inputs(rng, b, c, kv_heads, heads, widths,
                                                      args.page_size, dtype)
            kv_bytes = b * kv_heads * c * sum(widths) * dtype.itemsize
        if op == "gqa":
            inputs = (qs[0], pools[0], pools[1], lengths, tables)
            ref = jax.jit(paged_ref.paged_decode_attention)
            impls = {"xla": jax.jit(functools.partial(attention.paged_decode_attention,
                                                      impl="xla"))}
            if not args.no_kernel:
                impls["pallas"] = jax.jit(gqa_kernel)
        elif op == "mla":
            scale = 1.0 / np.sqrt(192.0)  # DeepSeek-V2: qk_nope 128 + qk_rope 64
            inputs = (qs[0], qs[1], pools[0][0], pools[1][0], lengths, tables)
            ref = jax.jit(functools.partial(mla_ref.mla_decode_attention, scale=scale))
            impls = {"xla": jax.jit(functools.partial(attention.mla_decode_attention,
                                                      scale=scale, impl="xla"))}
            if not args.no_kernel:
                impls["pallas"] = jax.jit(functools.partial(mla_kernel, scale=scale))
        want_out, want_lse = jax.block_until_ready(ref(*inputs))
        for impl, fn in impls.items():
            ms, (out, lse) = time_fn(fn, inputs, args.warmup, repeats)
            err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - want_out.astype(jnp.float32))))
            lse_err = float(jnp.max(jnp.abs(lse - want_lse)))
            gbps = kv_bytes / (ms * 1e-3) / 1e9
            rows.append(Row(
                op=op, impl=impl, mode="xla" if impl == "xla" else mode, batch=b, context=c,
                q_heads=heads, kv_heads=kv_heads, head_dim=widths[0],
                page_size=args.page_size, dtype=dtype_name, kv_bytes=kv_bytes,
                median_ms=ms, gbps=gbps, frac_copy=gbps / copy_gbps,
                max_abs_err=max(err, lse_err), ok=max(err, lse_err) <= TOL[dtype_name],
            ))

    header = (f"{'op':4} {'impl':6} {'mode':9} {'B':>3} {'ctx':>6} {'Hq/Hkv':>7} "
              f"{'KV MiB':>8} {'ms':>9} {'GB/s':>8} {'%copy':>6} {'maxerr':>8} ok")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r.op:4} {r.impl:6} {r.mode:9} {r.batch:>3} {r.context:>6} "
              f"{f'{r.q_heads}/{r.kv_heads}':>7} {r.kv_bytes / 2**20:>8.1f} {r.median_ms:>9.3f} "
              f"{r.gbps:>8.2f} {100 * r.frac_copy:>6.1f} {r.max_abs_err:>8.1e} "
              f"{'yes' if r.ok else 'NO'}")
    for s in skipped:
        print(f"skipped {s} (over --max-gib {args.max_gib})")

    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or RESULTS / f"kernels-{backend}-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(
        backend=backend, device_kind=jax.devices()[0].device_kind, jax=jax.__version__,
        python=platform.python_version(), kernel_mode=mode, dtype=dtype_name,
        copy_gbps=copy_gbps, copy_mib=copy_mib, repeats=repeats, warmup=args.warmup,
        quick=args.quick, rows=[dataclasses.asdict(r) for r in rows], skipped=skipped,
    ), indent=1))
    print(f"wrote {out}")
    bad = [r for r in rows if not r.ok]
    if bad:
        print(f"{len(bad)} result(s) disagree with the reference", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
