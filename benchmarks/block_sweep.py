"""Sweeps the block sizes of the Pallas GPU decode kernels and times each against the bound.

For each op (paged GQA decode over bf16 pages, absorbed MLA decode, and both over KIVI
pages: "gqa", "mla", "qgqa", "qmla") at one batch x context, this script runs the GPU
kernel under every `BlockSizes` of the grid (block_tokens x num_warps x num_stages x
num_splits x block_heads), checks each result against the jnp reference in the same run,
and reports the median time, the KV bytes read per second, and that rate as a fraction of
the device's streaming-read bandwidth (a large bf16 reduction, measured in the same run).
The default block sizes are marked, and the best setting per op is printed with its
speed-up over the default. A setting the device cannot run (e.g. more shared memory than
the GPU has) is listed as such; a result that disagrees with the reference fails the run.

Shapes: GQA heads are 128 wide, MLA's latent 512 wide plus a 64-wide rotary part; KIVI
pages quantize in groups of 16, and the sequences fill their pages (random block tables).
On CPU the kernels run in Pallas' interpret mode on `--quick`'s tiny shapes: a check of
every setting's result, not a speed.

  JAX_PLATFORMS=cuda python benchmarks/block_sweep.py --context 32768 --json sweep.json
  python benchmarks/block_sweep.py --quick          # CPU: interpret mode, seconds
"""

import argparse
import dataclasses
import functools
import itertools
import json
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.pallas_kernels import paged_inputs, quant_inputs, time_fn  # noqa: E402
from kernels_pallas.mla_decode import gpu as mla_gpu  # noqa: E402
from kernels_pallas.mla_decode import reference as mla_ref  # noqa: E402
from kernels_pallas.paged_attention import gpu as paged_gpu  # noqa: E402
from kernels_pallas.paged_attention import reference as paged_ref  # noqa: E402
from kernels_pallas.paged_attention.block_sizes import BlockSizes, default_block_sizes  # noqa: E402
from kernels_pallas.quantized_attention import gpu as quant_gpu  # noqa: E402
from kernels_pallas.quantized_attention import reference as quant_ref  # noqa: E402

OPS = ("gqa", "mla", "qgqa", "qmla")
MLA_SCALE = 1.0 / np.sqrt(192.0)  # DeepSeek: qk_nope 128 + qk_rope 64
# bf16 inputs; the quantized kernels round dequantized keys to bf16 for their dot.
TOL = dict(out=3e-2, lse=1e-2)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--quick", action="store_true",
                   help="tiny shapes and a small grid (on CPU: interpret mode, a check only)")
    p.add_argument("--ops", nargs="+", choices=OPS, default=["gqa", "qgqa"],
                   help="ops to sweep (default gqa qgqa)")
    p.add_argument("--batch", type=int, default=8, help="sequences (default 8)")
    p.add_argument("--context", type=int, default=32768, help="tokens per sequence (default 32768)")
    p.add_argument("--q-heads", type=int, default=32, help="GQA query heads (default 32)")
    p.add_argument("--kv-heads", type=int, default=8, help="GQA KV heads (default 8)")
    p.add_argument("--mla-heads", type=int, default=128, help="MLA query heads (default 128)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per page (default 16)")
    p.add_argument("--bits", type=int, nargs="+", choices=[2, 4, 8], default=[4],
                   help="code widths of the quantized ops (default 4)")
    p.add_argument("--block-tokens", type=int, nargs="+", default=[64, 128, 256],
                   help="tokens per inner step (default 64 128 256)")
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8],
                   help="Triton num_warps (default 4 8)")
    p.add_argument("--stages", type=int, nargs="+", default=[2, 3],
                   help="Triton num_stages (default 2 3)")
    p.add_argument("--splits", type=int, nargs="+", default=[0],
                   help="split-K counts; 0 = the kernel's own choice (default 0)")
    p.add_argument("--block-heads", type=int, nargs="+", default=[16],
                   help="query heads per program (powers of two >= 16; default 16): wider "
                        "groups (MLA) are split over programs that each read every page")
    p.add_argument("--repeats", type=int, default=10, help="timed runs per setting (median)")
    p.add_argument("--time-limit", type=float, default=300.0,
                   help="seconds; settings not started by then are skipped and listed")
    p.add_argument("--json", type=pathlib.Path, default=None, help="write the results here")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.context, args.q_heads, args.kv_heads = 2, 256, 8, 2
        args.mla_heads, args.block_tokens, args.warps, args.stages = 16, [32, 64], [4], [2]
        args.repeats = 1
    if any(h < 16 or h & (h - 1) for h in args.block_heads):
        p.error(f"--block-heads {args.block_heads}: each must be a power of two >= 16")
    if args.context % args.page_size:
        p.error(f"--context ({args.context}) must be a multiple of --page-size "
                f"({args.page_size})")
    if args.q_heads % args.kv_heads:
        p.error(f"--q-heads ({args.q_heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    if any(b < 16 or b % args.page_size or (b // args.page_size) & (b // args.page_size - 1)
           for b in args.block_tokens):
        p.error(f"--block-tokens {args.block_tokens}: each must be >= 16 and a power-of-two "
                f"number of {args.page_size}-token pages")
    return args


def read_bandwidth(mib: int = 1024, repeats: int = 10) -> float:
    """GB/s of a bf16 reduction over a large array: the rate a decode kernel can read at."""
    x = jax.random.normal(jax.random.key(1), (mib * 2**20 // 2,), jnp.bfloat16)
    fn = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    jax.block_until_ready(fn(x))
    times = []
    for _ in range(max(repeats, 5)):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x))
        times.append(time.perf_counter() - t0)
    return x.size * 2 / statistics.median(times) / 1e9


def build(op, bits, args, rng, interpret):
    """(kernel taking block_sizes=, reference, inputs, KV bytes read, max pages) of one op."""
    b, ctx, ps = args.batch, args.context, args.page_size
    bf16 = jnp.dtype(jnp.bfloat16)
    if op == "gqa":
        qs, pools, lengths, tables = paged_inputs(rng, b, ctx, args.kv_heads, args.q_heads,
                                                  (128, 128), ps, bf16)
        fn = functools.partial(paged_gpu.paged_decode_attention, interpret=interpret)
        return (fn, paged_ref.paged_decode_attention, (qs[0], *pools, lengths, tables),
                b * args.kv_heads * ctx * 256 * 2, tables.shape[1])
    if op == "mla":
        qs, pools, lengths, tables = paged_inputs(rng, b, ctx, 1, args.mla_heads, (512, 64),
                                                  ps, bf16)
        fn = functools.partial(mla_gpu.mla_decode_attention, scale=MLA_SCALE,
                               interpret=interpret)
        ref = functools.partial(mla_ref.mla_decode_attention, scale=MLA_SCALE)
        return (fn, ref, (qs[0], qs[1], pools[0][0], pools[1][0], lengths, tables),
                b * ctx * 576 * 2, tables.shape[1])
    mla = op == "qmla"
    kv_heads, heads, widths = ((1, args.mla_heads, (512, 64)) if mla
                               else (args.kv_heads, args.q_heads, (128, 128)))
    qs, view, nbytes = quant_inputs(rng, b, ctx, kv_heads, heads, widths, ps, bf16, bits,
                                    16, mla)
    q_pos = jnp.full((b, 1), ctx - 1, jnp.int32)
    rows = (view.quant_lengths, view.block_tables, q_pos)
    if mla:
        k = view.k
        inputs = (qs[0][:, None], qs[1][:, None], k.codes[0], k.scale[0], k.zero[0], view.v[0],
                  *rows)
        opts = dict(bits=bits, scale=MLA_SCALE)
        fn, ref = quant_gpu.quantized_mla_pages_attention, quant_ref.quantized_mla_pages_attention
    else:
        k, v = view.k, view.v
        inputs = (qs[0][:, None], k.codes, k.scale, k.zero, v.codes, v.scale, v.zero, *rows)
        opts = dict(k_bits=bits, v_bits=bits, scale=float(128 ** -0.5))
        fn, ref = quant_gpu.quantized_pages_attention, quant_ref.quantized_pages_attention
    # The tail is attended outside the kernel: count the quantized pages' bytes only.
    tail = kv_heads * b * (ctx - int(view.quant_lengths[0])) * sum(widths) * 2
    return (functools.partial(fn, interpret=interpret, **opts), functools.partial(ref, **opts),
            inputs, nbytes - tail, view.block_tables.shape[1])


@dataclasses.dataclass
class Row:
    op: str
    bits: int | None
    block_tokens: int
    num_warps: int
    num_stages: int
    num_splits: int | None
    block_heads: int
    default: bool
    median_ms: float
    gbps: float
    frac_read: float
    max_err: float
    ok: bool


def main(argv=None) -> int:
    args = parse_args(argv)
    backend = jax.default_backend()
    interpret = backend != "gpu"
    rng = np.random.default_rng(args.seed)
    # Interpret mode's times are meaningless: its probe only needs to run (--quick: 4 MiB).
    read_gbps = read_bandwidth(1024 if not interpret else 4 if args.quick else 64)
    device = jax.devices()[0].device_kind
    mode = ", interpret mode: results checked, times meaningless" if interpret else ""
    print(f"{device} ({backend}{mode}); jax {jax.__version__}; streaming read "
          f"{read_gbps:.0f} GB/s; batch {args.batch} x {args.context} tokens, page "
          f"{args.page_size}", flush=True)
    t_start = time.perf_counter()
    rows, skipped, failed = [], [], []
    grid = list(itertools.product(args.block_tokens, args.warps, args.stages, args.splits,
                                  args.block_heads))
    jobs = [(op, bits) for op in args.ops for bits in (args.bits if op[0] == "q" else [None])]
    for op, bits in jobs:
        fn, ref, inputs, kv_bytes, max_pages = build(op, bits, args, rng, interpret)
        want_out, want_lse = (np.asarray(x, np.float32) for x in jax.jit(ref)(*inputs))
        default = default_block_sizes("gpu", args.page_size, max_pages)
        settings = [default] + [
            BlockSizes(block_tokens=bt, num_warps=w, num_stages=st, num_splits=sp or None,
                       block_heads=bh)
            for bt, w, st, sp, bh in grid]
        for i, bs in enumerate(dict.fromkeys(settings)):  # the default first, once
            if time.perf_counter() - t_start > args.time_limit:
                skipped.append(dict(op=op, bits=bits, **dataclasses.asdict(bs)))
                continue
            try:
                ms, (out, lse) = time_fn(jax.jit(functools.partial(fn, block_sizes=bs)), inputs,
                                         1, args.repeats)
            except jax.errors.JaxRuntimeError as e:  # e.g. more shared memory than the GPU has
                failed.append(dict(op=op, bits=bits, **dataclasses.asdict(bs),
                                   error=str(e).splitlines()[0][:200]))
                print(f"  {op}{bits or ''} {bs}: did not run: {failed[-1]['error']}", flush=True)
                continue
            err_out = float(np.max(np.abs(np.asarray(out, np.float32) - want_out)))
            err_lse = float(np.max(np.abs(np.asarray(lse) - want_lse)))
            gbps = kv_bytes / (ms * 1e-3) / 1e9
            rows.append(Row(op=op, bits=bits, block_tokens=bs.block_tokens,
                            num_warps=bs.num_warps, num_stages=bs.num_stages,
                            num_splits=bs.num_splits, block_heads=bs.block_heads,
                            default=i == 0, median_ms=ms, gbps=gbps,
                            frac_read=gbps / read_gbps, max_err=max(err_out, err_lse),
                            ok=err_out <= TOL["out"] and err_lse <= TOL["lse"]))
            r = rows[-1]
            print(f"  {op}{bits or ''} bt{r.block_tokens} w{r.num_warps} s{r.num_stages} "
                  f"h{r.block_heads} splits {r.num_splits or 'auto'}: {ms:.3f} ms, "
                  f"{gbps:.0f} GB/s "
                  f"({100 * r.frac_read:.0f}% of read){'' if r.ok else ' WRONG'}", flush=True)

    print("\n| op | block_tokens | warps | stages | heads | splits | ms | GB/s | % of read "
          "| max err | ok |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.op}{r.bits or ''}{' (default)' if r.default else ''} | {r.block_tokens} | "
              f"{r.num_warps} | {r.num_stages} | {r.block_heads} | {r.num_splits or 'auto'} | "
              f"{r.median_ms:.3f} | "
              f"{r.gbps:.0f} | {100 * r.frac_read:.0f}% | {r.max_err:.1e} | "
              f"{'yes' if r.ok else 'NO'} |")
    for op, bits in jobs:
        mine = [r for r in rows if r.op == op and r.bits == bits and r.ok]
        base = next((r for r in mine if r.default), None)
        if mine and base:
            best = min(mine, key=lambda r: r.median_ms)
            print(f"best {op}{bits or ''}: bt{best.block_tokens} w{best.num_warps} "
                  f"s{best.num_stages} h{best.block_heads} splits "
                  f"{best.num_splits or 'auto'}, {best.median_ms:.3f} ms "
                  f"= {base.median_ms / best.median_ms:.2f}x the default's speed")
    for f in failed:
        print(f"did not run: {f}")
    if skipped:
        print(f"{len(skipped)} settings skipped at the --time-limit of {args.time_limit:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dict(
            device=device, backend=backend, jax=jax.__version__, interpret=interpret,
            read_gbps=read_gbps, batch=args.batch, context=args.context,
            page_size=args.page_size, rows=[dataclasses.asdict(r) for r in rows],
            failed=failed, skipped=skipped), indent=1))
        print(f"wrote {args.json}")
    bad = [r for r in rows if not r.ok]
    if bad:
        print(f"{len(bad)} setting(s) disagree with the reference", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
