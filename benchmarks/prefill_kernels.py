"""Times chunked prefill and mixed prefill + decode steps through kvjax's attention ops.

Rows (each checked against the jnp reference in the same run):

  prefill  `--batch` prompts of `--prompt` tokens attended in `--chunk`-token chunks, as
           the model's chunked prefill and the serving engine feed them: chunk k's queries
           against the k + 1 chunks already in the pages (bf16 pages: the
           `paged_prefill_attention` op; `--bits` KIVI pages: `quantized_prefill_attention`
           over quantized pages plus a full-precision tail). The time is the sum of the
           chunks' median times.
  mla      the prefill row for DeepSeek-style absorbed MLA (`mla_prefill_attention`: all
           `--mla-heads` query heads over one latent head, key [c_KV, k_rope] of
           `--d-c` + `--d-rope`, value c_KV) over bf16 latent pages.
  mixed    one step of `--batch` prefill chunks (at the middle of their prompts) and
           `--decode-rows` decode rows (at the full prompt length) in one ragged call,
           against the same work run as a prefill call plus a decode call.

Implementations: "pallas" (the kernels: on TPU the ragged kernel, on a Hopper GPU the
Mosaic GPU kernel where one is built, interpreted on CPU), "xla" (kvjax's XLA path) and,
where torch has CUDA, "torch": `scaled_dot_product_attention` with `is_causal` over the
whole prompts on contiguous K/V (the same causal FLOPs as the chunks together, no paging).
TFLOP/s count 2 x (d_k + d_v) multiply-adds per visible (query, key) pair and head, against
a bf16 matmul measured in the same run on accelerators.

  python benchmarks/prefill_kernels.py --plan        # sizes and FLOPs, no device
  python benchmarks/prefill_kernels.py               # on a GPU/TPU: 8 x 4K in 512-token chunks
  python benchmarks/prefill_kernels.py --quick       # CPU-sized: the kernels interpreted
"""

import argparse
import dataclasses
import datetime
import functools
import json
import pathlib
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks import gpu_peers  # noqa: E402
from benchmarks.pallas_kernels import paged_inputs, quant_inputs, time_fn  # noqa: E402
from kvjax import attention  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
TOL = {"float32": 1e-4, "bfloat16": 3e-2}
DEFAULTS = dict(batch=8, prompt=4096, chunk=512, decode_rows=56, q_heads=32, kv_heads=8,
                head_dim=128, page_size=16, mla_heads=128, d_c=512, d_rope=64)
QUICK = dict(batch=2, prompt=128, chunk=32, decode_rows=6, q_heads=4, kv_heads=2,
             head_dim=64, page_size=8, mla_heads=4, d_c=64, d_rope=64)


@dataclasses.dataclass
class Row:
    case: str
    impl: str
    pages: str
    batch: int
    tokens: int
    ms: float
    tflops: float
    frac_matmul: float | None
    max_abs_err: float
    ok: bool


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--quick", action="store_true",
                   help="CPU-sized shapes (2 prompts of 128 tokens in 32-token chunks, 4/2 "
                        "heads x 64); the defaults are 8 x 4096 in 512-token chunks, 32/8 x 128")
    for name, default in DEFAULTS.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                       help=f"(default {default}; --quick {QUICK[name]})")
    p.add_argument("--bits", type=int, choices=[2, 4, 8], default=4,
                   help="code width of the KIVI rows (default 4)")
    p.add_argument("--group", type=int, default=None,
                   help="KIVI group size (default: the page size)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="auto = bfloat16 on accelerators, float32 on CPU")
    p.add_argument("--cases", nargs="+", choices=["prefill", "kivi", "mla", "mixed"],
                   default=["prefill", "kivi", "mla", "mixed"], help="which rows to run")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed runs per call (default 10; 2 on CPU)")
    p.add_argument("--plan", action="store_true", help="print the sizes and FLOPs and exit")
    p.add_argument("--out", type=pathlib.Path, default=None,
                   help="JSON path (default benchmarks/results/prefill-<backend>-<time>.json)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    args = p.parse_args(argv)
    base = QUICK if args.quick else DEFAULTS
    for name, default in base.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.prompt % args.chunk or args.chunk % args.page_size:
        p.error(f"--prompt ({args.prompt}) must be a multiple of --chunk ({args.chunk}) and "
                f"--chunk of --page-size ({args.page_size})")
    if args.q_heads % args.kv_heads:
        p.error(f"--q-heads ({args.q_heads}) must be a multiple of --kv-heads "
                f"({args.kv_heads})")
    args.group = args.group or args.page_size
    return args


def causal_flops(args, starts, counts, mla=False) -> int:
    """FLOPs of rows whose `counts[i]` queries start at position `starts[i]` (each query
    sees every key up to itself); MLA's absorbed form: d_c + d_rope for the logits, d_c for
    P V, every query head."""
    pairs = sum(c * s + c * (c + 1) // 2 for s, c in zip(starts, counts, strict=True))
    if mla:
        return 2 * pairs * args.mla_heads * (2 * args.d_c + args.d_rope)
    return 2 * pairs * args.q_heads * 2 * args.head_dim


def plan(args) -> list[tuple[str, int, int]]:
    """(case, batch, FLOPs) of each row."""
    chunks = args.prompt // args.chunk
    prefill, mla = (sum(causal_flops(args, [k * args.chunk] * args.batch,
                                     [args.chunk] * args.batch, mla=m) for k in range(chunks))
                    for m in (False, True))
    mid = args.prompt // 2
    mixed = (causal_flops(args, [mid] * args.batch, [args.chunk] * args.batch)
             + causal_flops(args, [args.prompt - 1] * args.decode_rows, [1] * args.decode_rows))
    rows = []
    for case in args.cases:
        if case in ("prefill", "kivi"):
            rows.append((case, args.batch, prefill))
        elif case == "mla":
            rows.append((case, args.batch, mla))
        else:
            rows.append((case, args.batch + args.decode_rows, mixed))
    return rows


def main(argv=None):
    args = parse_args(argv)
    if args.plan:
        print(f"{'case':8} {'rows':>5} {'GFLOP':>10}  shape")
        for case, rows, flops in plan(args):
            heads = (f"{args.mla_heads} heads over a {args.d_c} + {args.d_rope} latent"
                     if case == "mla" else
                     f"{args.q_heads}/{args.kv_heads} heads x {args.head_dim}")
            print(f"{case:8} {rows:>5} {flops / 1e9:>10.2f}  {args.prompt} tokens in "
                  f"{args.chunk}-token chunks, {heads}, page {args.page_size}")
        return 0
    backend = jax.default_backend()
    accel = backend != "cpu"
    dtype_name = args.dtype if args.dtype != "auto" else ("bfloat16" if accel else "float32")
    dtype = jnp.dtype(dtype_name)
    repeats = args.repeats or (10 if accel else 2)
    rng = np.random.default_rng(args.seed)
    matmul = gpu_peers.matmul_tflops() if accel else None
    device_kind = jax.devices()[0].device_kind
    print(f"backend={backend} device={device_kind} dtype={dtype_name}"
          + (f" bf16 matmul {matmul:.0f} TFLOP/s" if matmul else ""))

    def timed(fn, inputs):
        if accel:
            return gpu_peers.pipelined_ms(fn, inputs, calls=repeats)
        return time_fn(fn, inputs, 1, repeats)

    def err_of(got, want):
        return float(np.max(np.abs(np.asarray(got.astype(jnp.float32))
                                   - np.asarray(want.astype(jnp.float32)))))

    total = args.prompt + args.chunk  # room for the mixed case's rows
    widths = (args.head_dim, args.head_dim)
    scale = args.head_dim ** -0.5
    rows = []

    def add(case, impl, pages, batch, ms, flops, err):
        tflops = flops / (ms * 1e-3) / 1e12
        rows.append(Row(case, impl, pages, batch, args.prompt, ms, tflops,
                        tflops / matmul if matmul else None, err, err <= TOL[dtype_name]))

    flops = dict((c, f) for c, _, f in plan(args))
    chunks = args.prompt // args.chunk
    if "prefill" in args.cases:
        qs, pools, _, tables = paged_inputs(rng, args.batch, total, args.kv_heads,
                                            args.q_heads, widths, args.page_size, dtype)
        k_pages, v_pages = pools
        q = jax.random.normal(jax.random.key(args.seed), (args.batch, args.chunk, args.q_heads,
                                                          args.head_dim)).astype(dtype)
        q_len = jnp.full((args.batch,), args.chunk, jnp.int32)
        fns = {impl: jax.jit(functools.partial(attention.paged_prefill_attention, scale=scale,
                                               impl=impl)) for impl in ("reference", "xla",
                                                                        "pallas")}
        times = {"xla": 0.0, "pallas": 0.0}
        errs = {"xla": 0.0, "pallas": 0.0}
        for k in range(chunks):
            lengths = jnp.full((args.batch,), (k + 1) * args.chunk, jnp.int32)
            inputs = (q, k_pages, v_pages, lengths, tables, q_len)
            want = fns["reference"](*inputs)[0]
            for impl in times:
                ms, (out, _) = timed(fns[impl], inputs)
                times[impl] += ms
                errs[impl] = max(errs[impl], err_of(out, want))
        for impl in times:
            add("prefill", impl, dtype_name, args.batch, times[impl], flops["prefill"],
                errs[impl])
        torch_row(args, k_pages, v_pages, tables, scale, dtype, flops["prefill"], add)
    if "kivi" in args.cases:
        times = {"xla": 0.0, "pallas": 0.0}
        errs = {"xla": 0.0, "pallas": 0.0}
        fns = {impl: jax.jit(functools.partial(attention.quantized_prefill_attention,
                                               impl=impl)) for impl in ("reference", "xla",
                                                                        "pallas")}
        for k in range(chunks):
            _, view, _ = quant_inputs(rng, args.batch, (k + 1) * args.chunk, args.kv_heads,
                                      args.q_heads, widths, args.page_size, dtype, args.bits,
                                      args.group, False)
            q = jnp.asarray(rng.standard_normal((args.batch, args.chunk, args.q_heads,
                                                 args.head_dim)), dtype)
            inputs = (q, view, jnp.full((args.batch,), args.chunk, jnp.int32))
            want = fns["reference"](*inputs)[0]
            for impl in times:
                ms, (out, _) = timed(fns[impl], inputs)
                times[impl] += ms
                errs[impl] = max(errs[impl], err_of(out, want))
        for impl in times:
            add("kivi", impl, f"int{args.bits}", args.batch, times[impl], flops["kivi"],
                errs[impl])
    if "mla" in args.cases:
        _, pools, _, tables = paged_inputs(rng, args.batch, total, 1, 1,
                                           (args.d_c, args.d_rope), args.page_size, dtype)
        latent, rope = (p[0] for p in pools)
        ql, qr = (jnp.asarray(rng.standard_normal((args.batch, args.chunk, args.mla_heads, w)),
                              dtype) for w in (args.d_c, args.d_rope))
        q_len = jnp.full((args.batch,), args.chunk, jnp.int32)
        mla_scale = (args.d_c // 4 + args.d_rope) ** -0.5  # DeepSeek's (nope + rope)^-1/2
        fns = {impl: jax.jit(functools.partial(attention.mla_prefill_attention,
                                               scale=mla_scale, impl=impl))
               for impl in ("reference", "xla", "pallas")}
        times = {"xla": 0.0, "pallas": 0.0}
        errs = {"xla": 0.0, "pallas": 0.0}
        for k in range(chunks):
            lengths = jnp.full((args.batch,), (k + 1) * args.chunk, jnp.int32)
            inputs = (ql, qr, latent, rope, lengths, tables, q_len)
            want = fns["reference"](*inputs)[0]
            for impl in times:
                ms, (out, _) = timed(fns[impl], inputs)
                times[impl] += ms
                errs[impl] = max(errs[impl], err_of(out, want))
        for impl in times:
            add("mla", impl, dtype_name, args.batch, times[impl], flops["mla"], errs[impl])
    if "mixed" in args.cases:
        rows_total = args.batch + args.decode_rows
        qs, pools, _, tables = paged_inputs(rng, rows_total, total, args.kv_heads,
                                            args.q_heads, widths, args.page_size, dtype)
        k_pages, v_pages = pools
        mid = args.prompt // 2
        lengths = np.r_[np.full(args.batch, mid + args.chunk),
                        np.full(args.decode_rows, args.prompt)].astype(np.int32)
        q_lens = np.r_[np.full(args.batch, args.chunk), np.ones(args.decode_rows)].astype(
            np.int32)
        q = jnp.asarray(rng.standard_normal((rows_total, args.chunk, args.q_heads,
                                             args.head_dim)), dtype)
        inputs = (q, k_pages, v_pages, jnp.asarray(lengths), tables, jnp.asarray(q_lens))
        want = np.asarray(attention.paged_prefill_attention(
            *inputs, scale=scale, impl="reference")[0].astype(jnp.float32))
        b = args.batch
        for impl in ("xla", "pallas"):
            mixed = jax.jit(functools.partial(attention.paged_prefill_attention, scale=scale,
                                              impl=impl))
            ms, (out, _) = timed(mixed, inputs)
            add("mixed", impl, dtype_name, rows_total, ms, flops["mixed"],
                err_of(out, jnp.asarray(want)))

            def separate(q, k, v, ln, bt, ql, mixed=mixed, impl=impl):
                pre = mixed(q[:b], k, v, ln[:b], bt[:b], ql[:b])[0]
                dec = attention.paged_decode_attention(q[b:, 0], k, v, ln[b:], bt[b:],
                                                       scale=scale, impl=impl)[0]
                return pre, dec

            ms, (pre, dec) = timed(jax.jit(separate), inputs)
            err = max(err_of(pre, jnp.asarray(want[:b])),
                      err_of(dec, jnp.asarray(want[b:, 0])))
            add("separate", impl, dtype_name, rows_total, ms, flops["mixed"], err)

    print(f"{'case':8} {'impl':7} {'pages':8} {'rows':>4} {'ms':>10} {'TFLOP/s':>8} "
          f"{'%matmul':>7} {'maxerr':>8} ok")
    for r in rows:
        frac = f"{100 * r.frac_matmul:7.1f}" if r.frac_matmul is not None else "      -"
        print(f"{r.case:8} {r.impl:7} {r.pages:8} {r.batch:>4} {r.ms:>10.3f} {r.tflops:>8.3f} "
              f"{frac} {r.max_abs_err:>8.1e} {'yes' if r.ok else 'NO'}")
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or RESULTS / f"prefill-{backend}-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(
        backend=backend, device_kind=device_kind, jax=jax.__version__,
        python=platform.python_version(), dtype=dtype_name, matmul_tflops=matmul,
        args={k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()},
        date=stamp, rows=[dataclasses.asdict(r) for r in rows]), indent=1))
    print(f"wrote {out}")
    bad = [r for r in rows if not r.ok]
    if bad:
        print(f"{len(bad)} result(s) disagree with the reference", file=sys.stderr)
        return 1
    return 0


def torch_row(args, k_pages, v_pages, tables, scale, dtype, flops, add):
    """torch's causal SDPA over the whole prompts on contiguous K/V (where torch has CUDA),
    checked against the XLA path's output of the last chunk's queries."""
    torch = gpu_peers.torch_cuda()
    if torch is None:
        return
    pages = args.prompt // args.page_size
    gather = jax.jit(lambda p: jnp.swapaxes(p[:, tables[:, :pages]], 0, 1).reshape(
        args.batch, args.kv_heads, args.prompt, args.head_dim))
    k = torch.from_dlpack(jax.block_until_ready(gather(k_pages)))
    v = torch.from_dlpack(jax.block_until_ready(gather(v_pages)))
    q = torch.randn(args.batch, args.q_heads, args.prompt, args.head_dim, device="cuda",
                    dtype=k.dtype)

    def fn(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=args.q_heads != args.kv_heads)

    ms, _ = gpu_peers.torch_ms(fn, (q, k, v), calls=5)
    # Its check: the last query row against kvjax's decode reference on the same pages.
    last = jnp.asarray(q[:, :, -1].float().cpu().numpy(), dtype)
    want = attention.paged_decode_attention(
        last, k_pages, v_pages, jnp.full((args.batch,), args.prompt, jnp.int32), tables,
        scale=scale, impl="reference")[0]
    got = fn(q, k, v)[:, :, -1].float().cpu().numpy()
    add("prefill", "torch", str(dtype), args.batch, ms, flops,
        float(np.max(np.abs(got - np.asarray(want.astype(jnp.float32))))))


if __name__ == "__main__":
    sys.exit(main())
