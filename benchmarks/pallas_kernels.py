"""Times the Pallas decode kernels against the XLA path and the peers on the current backend.

For every size in batch x context x GQA ratio (plus MLA over batch x context)
this script builds a random paged cache (randomly permuted block tables,
every sequence at the full context), times each implementation (warm-up, then
the median of --repeats runs; on accelerators each run is a burst of back-to-back
calls ending in one `block_until_ready`, so microsecond kernels are not timed by the
launch latency), checks each result against the jnp reference in the same run, and
reports the bytes the op must move (K/V or latents at the true lengths, Q and O; codes,
scales, zeros and tails for quantized pages) over the median time of the whole call
(the split merge included), against the card's nominal bandwidth and against a read
ceiling measured in the same process (`benchmarks/gpu_peers.py`: torch's reduction over
a cold 4 GiB buffer where torch has CUDA, and a device copy; the faster of the two).
MLA rows also give TFLOP/s against a bf16 matmul measured in the same run: at 128 heads
MLA decode is compute-bound on Hopper.

Implementations: "xla" (kvjax's XLA path) everywhere; on GPU "mosaic" (the Mosaic GPU
kernels, on Hopper), "triton" (the Triton kernels), "jax-op" (jax's own paged attention
op for GPU, where the installed jax ships it) and "torch" (torch's
scaled_dot_product_attention on contiguous K/V of the same bytes, where torch has CUDA);
on TPU "native"; on CPU only Pallas' interpret mode exists: the TPU kernel is then timed
interpreted ("interpret"): a correctness run, not a kernel speed. The quantized ops
("qgqa", "qmla": KIVI `--bits` pages, the public
`kvjax.attention.quantized_*decode_attention` with impl "xla" and "pallas") count the
packed codes, scales and zeros as the bytes read.

  python benchmarks/pallas_kernels.py --quick      # < 3 min on a GPU; a minute or two on CPU
  python benchmarks/pallas_kernels.py --targets --plan   # the target sizes and bytes, no GPU
  python benchmarks/pallas_kernels.py --targets --ops gqa   # on a GPU: the GQA target rows
  python benchmarks/pallas_kernels.py --kivi-targets        # on a GPU: KIVI against bf16
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

from benchmarks import gpu_peers  # noqa: E402
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
# The decode sizes a GPU kernel is held to (--targets): (op, batch, context, query heads,
# KV heads, widths, page size), bf16. GQA: 32 query / 8 KV heads x 128; MLA: DeepSeek-V3's
# 128 heads over a 512 + 64 latent in 64-token pages.
TARGETS = (
    ("gqa", 8, 32768, 32, 8, (128, 128), 16),
    ("gqa", 64, 8192, 32, 8, (128, 128), 16),
    ("gqa", 1, 131072, 32, 8, (128, 128), 16),
    ("mla", 8, 32768, 128, 1, (512, 64), 64),
    ("mla", 64, 8192, 128, 1, (512, 64), 64),
    ("mla", 1, 1024, 128, 1, (512, 64), 64),
)
# The KIVI rows a GPU is held to (--kivi-targets): the bf16 kernels and KIVI pages (group 32,
# float16 scales and zeros) on the same tokens, 64-token pages: GQA 32/8 heads x 128 at
# 8 x 32K in int8 / int4 / int2; MLA (512 + 64 latent) at 16 query heads (one
# tensor-parallel-8 shard of DeepSeek-V3's 128: memory-bound) and at 128 (compute-bound).
# (op, batch, context, query heads, KV heads, widths, page size, bits, group)
KIVI_TARGETS = (
    ("gqa", 8, 32768, 32, 8, (128, 128), 64, None, None),
    ("qgqa", 8, 32768, 32, 8, (128, 128), 64, 8, 32),
    ("qgqa", 8, 32768, 32, 8, (128, 128), 64, 4, 32),
    ("qgqa", 8, 32768, 32, 8, (128, 128), 64, 2, 32),
    ("mla", 8, 32768, 16, 1, (512, 64), 64, None, None),
    ("qmla", 8, 32768, 16, 1, (512, 64), 64, 4, 32),
    ("mla", 8, 32768, 128, 1, (512, 64), 64, None, None),
    ("qmla", 8, 32768, 128, 1, (512, 64), 64, 4, 32),
)
# What a KIVI kernel's step may take at most, as a fraction of the bf16 kernel's on the same
# tokens: (op, bits, query heads or None for any) -> bound; None: reported, no bound.
KIVI_BOUNDS = {("qgqa", 8, None): 0.60, ("qgqa", 4, None): 0.40, ("qgqa", 2, None): 0.28,
               ("qmla", 4, 16): 0.50, ("qmla", 4, 128): None}


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
    bytes_moved: int
    median_ms: float
    gbps: float
    frac_copy: float
    frac_nominal: float | None
    frac_ceiling: float | None
    tflops: float
    frac_matmul: float | None
    max_abs_err: float
    ok: bool
    bits: int | None = None  # KIVI code width of the quantized ops' rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--quick", action="store_true",
                   help="small preset (under 3 minutes on a GPU); default is the full sweep")
    p.add_argument("--targets", action="store_true",
                   help="the decode sizes the GPU kernels are held to (bf16; GQA 32/8 heads x "
                        "128 at 8 x 32K, 64 x 8K, 1 x 128K; MLA 128 heads x (512 + 64) at "
                        "8 x 32K, 64 x 8K, 1 x 1K) instead of the preset; --ops still selects")
    p.add_argument("--kivi-targets", action="store_true",
                   help="the KIVI rows a GPU is held to: bf16 kernels and int8/int4/int2 "
                        "pages (group 32) on the same tokens, GQA 32/8 heads x 128 and MLA at "
                        "16 and 128 heads, 8 x 32K, 64-token pages; kernels only (no XLA "
                        "path), with each KIVI step's ratio to the bf16 kernel's against its "
                        "bound (--batch / --context shrink it, e.g. to try it on CPU)")
    p.add_argument("--plan", action="store_true",
                   help="print the sizes, bytes and FLOPs of the rows and exit (no timing; "
                        "runs anywhere)")
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
    """{impl: (mode, gqa kernel, mla kernel)} for the backend's Pallas kernels; CPU interprets
    the TPU kernel. On GPU: the Mosaic GPU kernels on a Hopper (where they import) and the
    Triton kernels."""
    if backend == "gpu":
        fns = {}
        from kvjax.attention import pallas_impls

        if pallas_impls.gpu_kernel("paged_decode_attention")[0] == "mosaic":
            from kernels_pallas.mla_decode import mosaic_gpu as mla_mosaic
            from kernels_pallas.paged_attention import mosaic_gpu as paged_mosaic

            sms = pallas_impls._num_sms(pallas_impls.gpu_device())
            fns["mosaic"] = ("native",
                             functools.partial(paged_mosaic.paged_decode_attention, num_sms=sms),
                             functools.partial(mla_mosaic.mla_decode_attention, num_sms=sms))
        fns["triton"] = ("native", paged_gpu.paged_decode_attention, mla_gpu.mla_decode_attention)
        return fns
    if backend == "tpu":
        return {"pallas": ("native", paged_tpu.paged_decode_attention,
                           mla_tpu.mla_decode_attention)}
    return {"pallas": ("interpret",
                       functools.partial(paged_tpu.paged_decode_attention, interpret=True),
                       functools.partial(mla_tpu.mla_decode_attention, interpret=True))}


@dataclasses.dataclass(frozen=True)
class Job:
    """One row's size: op, batch, context, query / KV heads, widths (K, V or latent, rope),
    page size."""

    op: str
    batch: int
    context: int
    q_heads: int
    kv_heads: int
    widths: tuple[int, int]
    page_size: int
    bits: int | None = None  # the quantized ops' code width and group (None: --bits, --group)
    group: int | None = None

    def kv_bytes(self, itemsize: int) -> int:
        """K/V (or latent + rope) bytes at the true lengths."""
        return self.batch * self.kv_heads * self.context * sum(self.widths) * itemsize

    def qo_bytes(self, itemsize: int) -> int:
        """Query parts read, output written (plus the float32 log-sum-exp)."""
        q = self.batch * self.q_heads * (sum(self.widths) if self.op in ("mla", "qmla")
                                         else self.widths[0])
        o = self.batch * self.q_heads * (self.widths[0] if self.op in ("mla", "qmla")
                                         else self.widths[1])
        return (q + o) * itemsize + self.batch * self.q_heads * 4

    def flops(self) -> int:
        """2 x (scores + weighted sum) multiply-adds over the visible tokens."""
        k_width = sum(self.widths) if self.op in ("mla", "qmla") else self.widths[0]
        v_width = self.widths[0] if self.op in ("mla", "qmla") else self.widths[1]
        return 2 * self.batch * self.q_heads * self.context * (k_width + v_width)


def make_jobs(args, preset, q_heads):
    """The rows to run: the --targets sizes or the preset's product."""
    if args.kivi_targets:  # --batch / --context (their first values) shrink it
        jobs = [Job(*t) for t in KIVI_TARGETS if t[0] in args.ops]
        return [dataclasses.replace(j, batch=(args.batch or [j.batch])[0],
                                    context=(args.context or [j.context])[0]) for j in jobs]
    if args.targets:
        return [Job(*t) for t in TARGETS if t[0] in args.ops]
    jobs = []
    gqa_widths = (args.head_dim, args.head_dim)
    for op in ("gqa", "qgqa"):
        if op in args.ops:
            jobs += [Job(op, b, c, q_heads, q_heads // g, gqa_widths, args.page_size)
                     for b in preset["batch"] for c in preset["context"] for g in preset["gqa"]
                     if q_heads % g == 0]
    for op in ("mla", "qmla"):
        if op in args.ops:
            jobs += [Job(op, b, c, args.mla_heads, 1, tuple(args.mla_dims), args.page_size)
                     for b in preset["batch"] for c in preset["context"]]
    return jobs


def print_plan(jobs, dtype):
    """The rows' sizes, bytes and FLOPs (what --plan prints)."""
    print(f"{'op':4} {'B':>3} {'ctx':>7} {'Hq/Hkv':>7} {'widths':>9} {'page':>4} "
          f"{'KV MiB':>9} {'Q+O MiB':>8} {'GFLOP':>8} {'FLOP/B':>7}")
    for j in jobs:
        kv = (quant_bytes(j) if j.op in ("qgqa", "qmla") and j.bits
              else j.kv_bytes(dtype.itemsize))
        qo = j.qo_bytes(dtype.itemsize)
        kind = f" int{j.bits} g{j.group}" if j.bits else ""
        print(f"{j.op:4} {j.batch:>3} {j.context:>7} {f'{j.q_heads}/{j.kv_heads}':>7} "
              f"{'+'.join(map(str, j.widths)):>9} {j.page_size:>4} {kv / 2**20:>9.1f} "
              f"{qo / 2**20:>8.2f} {j.flops() / 1e9:>8.1f} {j.flops() / (kv + qo):>7.1f}{kind}")


def quant_bytes(job: Job) -> int:
    """What a KIVI row reads of its cache at `job.context` tokens in whole pages (no tail):
    the packed codes plus a float16 scale and zero per `job.group` elements, of K and V
    (GQA) or of the latent with its bf16 rope part (MLA)."""
    k = codes_per_byte(job.bits)
    tokens = job.batch * job.context // job.page_size * job.page_size
    codes = lambda w: w // k + 4 * w // job.group  # noqa: E731
    if job.op == "qmla":
        return tokens * (codes(job.widths[0]) + 2 * job.widths[1])
    return job.kv_heads * tokens * (codes(job.widths[0]) + codes(job.widths[1]))


def kivi_verdicts(rows: list[Row]) -> list[dict]:
    """Each KIVI kernel row's median step over the bf16 kernel's at the same op, size and
    heads ("mosaic" where it ran, else the fastest kernel), against KIVI_BOUNDS; and
    whether int2 beat int4. A row whose result disagreed with the reference fails."""
    def kernel(r):
        return r.impl not in ("xla", "jax-op", "torch")

    base = {}
    for r in rows:
        if r.op in ("gqa", "mla") and kernel(r):
            key = (r.op, r.batch, r.context, r.q_heads)
            best = base.get(key)
            if best is None or (r.impl == "mosaic") > (best.impl == "mosaic") or (
                    (r.impl == "mosaic") == (best.impl == "mosaic")
                    and r.median_ms < best.median_ms):
                base[key] = r
    out, by_bits = [], {}
    for r in rows:
        if r.op not in ("qgqa", "qmla") or not kernel(r):
            continue
        b = base.get((r.op[1:], r.batch, r.context, r.q_heads))
        if b is None:
            continue
        bound = KIVI_BOUNDS.get((r.op, r.bits, None), KIVI_BOUNDS.get((r.op, r.bits, r.q_heads)))
        ratio = r.median_ms / b.median_ms
        name = f"{r.op} int{r.bits} {r.q_heads} heads vs {b.op} {b.impl}"
        out.append(dict(row=name, ms=r.median_ms, bf16_ms=b.median_ms, ratio=ratio,
                        bound=bound, met=(bound is None or ratio <= bound) and r.ok and b.ok))
        if r.op == "qgqa":
            by_bits[r.bits] = r
    if 2 in by_bits and 4 in by_bits:
        a, b = by_bits[2], by_bits[4]
        out.append(dict(row="qgqa int2 faster than int4", ms=a.median_ms, bf16_ms=b.median_ms,
                        ratio=a.median_ms / b.median_ms, bound=1.0,
                        met=a.median_ms < b.median_ms and a.ok and b.ok))
    return out


def peer_fns(backend, job, inputs, scale):
    """{impl: fn(*inputs) -> out} of the peers that take `job` on this backend (GPU: jax's
    own paged attention op for GQA), and torch's SDPA as (fn, args) or None."""
    if backend != "gpu" or job.op != "gqa":
        return {}, None
    peers = {}
    jax_op = gpu_peers.jax_paged_attention()
    if jax_op is not None:
        peers["jax-op"] = jax.jit(functools.partial(jax_op, scale=scale))
    q, k_pages, v_pages, _, tables = inputs
    return peers, gpu_peers.torch_sdpa(q, k_pages, v_pages, tables, scale=scale)


def main(argv=None):
    args = parse_args(argv)
    backend = jax.default_backend()
    kind = "cpu" if backend == "cpu" else "accel"
    preset = dict(PRESETS[("quick" if args.quick else "full", kind)])
    for name in ("batch", "context", "gqa"):
        if getattr(args, name):
            preset[name] = getattr(args, name)
    dtype_name = args.dtype if args.dtype != "auto" else (
        "float32" if backend == "cpu" and not (args.targets or args.kivi_targets)
        else "bfloat16")
    dtype = jnp.dtype(dtype_name)
    q_heads = args.q_heads or (8 if backend == "cpu" else 32)
    repeats = args.repeats or (3 if backend == "cpu" else 20)
    copy_mib = args.copy_mib or (256 if backend == "cpu" else 1024)
    jobs = make_jobs(args, preset, q_heads)
    if args.plan:
        print_plan(jobs, dtype)
        return 0
    rng = np.random.default_rng(args.seed)
    kernels = {} if args.no_kernel else kernel_fns(backend)
    device_kind = jax.devices()[0].device_kind

    print(f"backend={backend} device={device_kind} dtype={dtype_name} "
          f"kernels={', '.join(f'{k} ({v[0]})' for k, v in kernels.items()) or 'none'}")
    copy_gbps = copy_bandwidth(copy_mib, repeats)
    print(f"measured copy bandwidth (read+write of {copy_mib} MiB): {copy_gbps:.1f} GB/s")
    nominal = gpu_peers.nominal_gbps(device_kind) if backend == "gpu" else None
    ceiling = matmul = None
    if kind == "accel":
        ceiling = gpu_peers.read_ceiling(copy_mib=copy_mib)
        matmul = gpu_peers.matmul_tflops()
        print(f"read ceiling {ceiling['gbps']:.0f} GB/s ({ceiling['probe']}); nominal "
              f"{nominal or float('nan'):.0f} GB/s; bf16 matmul {matmul:.0f} TFLOP/s")

    def timed(fn, inputs):
        if kind == "accel":
            return gpu_peers.pipelined_ms(fn, inputs, calls=repeats)
        return time_fn(fn, inputs, args.warmup, repeats)

    rows, skipped = [], []
    for job in tqdm(jobs, desc="sizes", file=sys.stderr):
        op, b, c, heads, kv_heads, widths = (job.op, job.batch, job.context, job.q_heads,
                                            job.kv_heads, job.widths)
        ctx_padded = -(-c // job.page_size) * job.page_size
        pool_bytes = b * kv_heads * ctx_padded * sum(widths) * dtype.itemsize
        if pool_bytes > args.max_gib * 2**30:
            skipped.append(dict(op=op, batch=b, context=c, heads=heads,
                                gib=pool_bytes / 2**30))
            continue
        kv_bytes = job.kv_bytes(dtype.itemsize)
        peers, torch_peer = {}, None
        if op in ("qgqa", "qmla"):
            qs, view, kv_bytes = quant_inputs(rng, b, c, kv_heads, heads, widths, job.page_size,
                                              dtype, job.bits or args.bits,
                                              job.group or args.group, op == "qmla")
            if op == "qgqa":
                inputs, fn, opts = (qs[0], view), attention.quantized_decode_attention, {}
            else:
                inputs, fn = (qs[0], qs[1], view), attention.quantized_mla_decode_attention
                opts = dict(scale=1.0 / np.sqrt(192.0))
            ref = jax.jit(functools.partial(fn, impl="reference", **opts))
            names = (("xla",) if args.no_kernel else ("pallas",) if args.kivi_targets
                     else ("xla", "pallas"))
            impls = {impl: jax.jit(functools.partial(fn, impl=impl, **opts)) for impl in names}
        else:
            qs, pools, lengths, tables = paged_inputs(rng, b, c, kv_heads, heads, widths,
                                                      job.page_size, dtype)
        if op == "gqa":
            scale = 1.0 / np.sqrt(widths[0])
            inputs = (qs[0], pools[0], pools[1], lengths, tables)
            ref = jax.jit(paged_ref.paged_decode_attention)
            impls = {} if args.kivi_targets and kernels else {
                "xla": jax.jit(functools.partial(attention.paged_decode_attention, impl="xla"))}
            impls.update({name: jax.jit(k[1]) for name, k in kernels.items()})
            if not args.kivi_targets:
                peers, torch_peer = peer_fns(backend, job, inputs, scale)
        elif op == "mla":
            scale = 1.0 / np.sqrt(192.0)  # DeepSeek-V2/V3: qk_nope 128 + qk_rope 64
            inputs = (qs[0], qs[1], pools[0][0], pools[1][0], lengths, tables)
            ref = jax.jit(functools.partial(mla_ref.mla_decode_attention, scale=scale))
            impls = {} if args.kivi_targets and kernels else {
                "xla": jax.jit(functools.partial(attention.mla_decode_attention, scale=scale,
                                                 impl="xla"))}
            impls.update({name: jax.jit(functools.partial(k[2], scale=scale))
                          for name, k in kernels.items()})
        want_out, want_lse = jax.block_until_ready(ref(*inputs))
        want_np = np.asarray(want_out.astype(jnp.float32))
        moved = kv_bytes + job.qo_bytes(dtype.itemsize)

        def add(impl, mode, ms, err, job=job, kv_bytes=kv_bytes, moved=moved):
            gbps = moved / (ms * 1e-3) / 1e9
            tflops = job.flops() / (ms * 1e-3) / 1e12
            rows.append(Row(
                op=job.op, impl=impl, mode=mode, batch=job.batch, context=job.context,
                q_heads=job.q_heads, kv_heads=job.kv_heads, head_dim=job.widths[0],
                page_size=job.page_size, dtype=dtype_name, kv_bytes=kv_bytes,
                bytes_moved=moved, median_ms=ms, gbps=gbps, frac_copy=gbps / copy_gbps,
                frac_nominal=gbps / nominal if nominal else None,
                frac_ceiling=gbps / ceiling["gbps"] if ceiling else None, tflops=tflops,
                frac_matmul=tflops / matmul if matmul else None, max_abs_err=err,
                ok=err <= TOL[dtype_name], bits=(job.bits or args.bits) if job.op in (
                    "qgqa", "qmla") else None))

        for impl, fn in impls.items():
            ms, (out, lse) = timed(fn, inputs)
            err = float(np.max(np.abs(np.asarray(out.astype(jnp.float32)) - want_np)))
            lse_err = float(jnp.max(jnp.abs(lse - want_lse)))
            mode = "xla" if impl == "xla" else (kernels[impl][0] if impl in kernels else
                                                "native" if kind == "accel" else "interpret")
            add(impl, mode, ms, max(err, lse_err))
        for impl, fn in peers.items():  # output only: the peers return no log-sum-exp
            ms, out = timed(fn, inputs)
            add(impl, "peer", ms,
                float(np.max(np.abs(np.asarray(out.astype(jnp.float32)) - want_np))))
        if torch_peer is not None:
            ms, out = gpu_peers.torch_ms(*torch_peer, calls=repeats)
            add("torch", "peer", ms, float(np.max(np.abs(out - want_np))))

    header = (f"{'op':4} {'impl':7} {'mode':9} {'B':>3} {'ctx':>6} {'Hq/Hkv':>7} "
              f"{'MiB':>8} {'ms':>9} {'GB/s':>8} {'%nom':>5} {'%ceil':>5} {'%copy':>6} "
              f"{'TFLOP/s':>7} {'maxerr':>8} ok")
    print(header)
    print("-" * len(header))

    def pct(x):
        return f"{100 * x:5.1f}" if x is not None else "    -"

    for r in rows:
        print(f"{r.op:4} {r.impl:7} {r.mode:9} {r.batch:>3} {r.context:>6} "
              f"{f'{r.q_heads}/{r.kv_heads}':>7} {r.bytes_moved / 2**20:>8.1f} "
              f"{r.median_ms:>9.4f} {r.gbps:>8.1f} {pct(r.frac_nominal)} "
              f"{pct(r.frac_ceiling)} {100 * r.frac_copy:>6.1f} {r.tflops:>7.1f} "
              f"{r.max_abs_err:>8.1e} {'yes' if r.ok else 'NO'}")
    for s in skipped:
        print(f"skipped {s} (over --max-gib {args.max_gib})")
    verdicts = kivi_verdicts(rows) if args.kivi_targets else []
    for v in verdicts:
        verdict = ("reported, no bound" if v["bound"] is None else
                   f"bound {v['bound']:.2f}: {'met' if v['met'] else 'NOT met'}")
        print(f"{v['row']:40} {v['ms']:9.4f} / {v['bf16_ms']:9.4f} ms = {v['ratio']:5.2f}x "
              f"({verdict})")

    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or RESULTS / f"kernels-{backend}-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(
        backend=backend, device_kind=device_kind, jax=jax.__version__,
        python=platform.python_version(), kernels={k: v[0] for k, v in kernels.items()},
        dtype=dtype_name, copy_gbps=copy_gbps, copy_mib=copy_mib, nominal_gbps=nominal,
        read_ceiling=ceiling, matmul_tflops=matmul, repeats=repeats, warmup=args.warmup,
        quick=args.quick, targets=args.targets, kivi_targets=args.kivi_targets, date=stamp,
        kivi_verdicts=verdicts,
        rows=[dataclasses.asdict(r) for r in rows], skipped=skipped,
    ), indent=1))
    print(f"wrote {out}")
    bad = [r for r in rows if not r.ok]
    if bad:
        print(f"{len(bad)} result(s) disagree with the reference", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
