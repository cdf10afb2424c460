"""Small-M matmul on CPU: kvjax's kernel (kvjax/backends/cpu/matmul.cc) against `x @ w`.

For the weight shapes of the end-to-end decode model (hidden 512, intermediate 1408,
vocab 32000) and a few row counts, times one `y = x @ w` with XLA's dot and with the
kernel of each build (`--marches`, default the native build and the AVX2 build
`-march=haswell`), the calls interleaved round-robin so that all see the same machine
load (warm-up, block_until_ready; medians and the interquartile spread), checks each
kernel's result against XLA's in the same run, and reports the weight-read rate (weight
bytes / time) next to the streaming read bandwidth measured in the run. For each build
it prints what "auto" picks (`kvjax.backends.cpu.choose("matmul", rows=M)`) and whether
that is the faster of the two.

    python benchmarks/matmul.py --quick          # seconds: M 1 and 8, f32 and bf16
    python benchmarks/matmul.py                  # M 1, 8, 16, 32, 64
    python benchmarks/matmul.py --sweep          # kernel tuning grid on the LM head shape
    python benchmarks/matmul.py --decode         # one decode step of the e2e model, A/B
    python benchmarks/matmul.py --decode --models tiny,small,medium,e2e --marches native

`--decode` times one decode step (reserve + forward, cache donated) of the
decode_e2e.py model, or of the smaller Llamas of `--models` (random weights, batches 1 and
8, 1K tokens in the cache) compiled
with each build's kernel and with XLA's dot (the matmul option is read at trace time;
the XLA program gets per-layer weights, as the decode loop gives it), calling them in
turn so that all see the same machine load, checks that their logits agree, and says
whether "auto" picks the faster for that many rows: the matmul's choice where it
matters, in the step (weights read once per step between the others).
"""

import argparse
import dataclasses
import itertools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import result_path  # noqa: E402
from kvjax.backends import cpu  # noqa: E402
from kvjax.backends.cpu import matmul as cpu_matmul  # noqa: E402
from kvjax.backends.cpu.build import available, unavailable_reason  # noqa: E402

# (K, N): the LM head, q/k/v fused width and single projections, gate+up, down.
SHAPES = ((512, 32000), (512, 1536), (512, 512), (512, 2816), (1408, 512))


def machine():
    """The CPU model and flags (the figures depend on both)."""
    import platform

    info = dict(machine=platform.machine(), cpu=platform.processor(), flags="")
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
            elif line.startswith(("flags", "Features")) and not info["flags"]:
                info["flags"] = line.split(":", 1)[1].strip()
    except OSError:
        pass
    info["cpus"] = os.cpu_count()
    return info


def read_bandwidth(nbytes=256 << 20, repeats=5):
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(jnp.sum)
    f(x).block_until_ready()
    return nbytes / median_time(f, repeats, x) / 1e9


def median_time(fn, repeats, *args):
    fn(*args).block_until_ready()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args).block_until_ready()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def interleaved(fns, args, repeats):
    """Seconds per call of each function, called round-robin (after one warm-up call each)."""
    for fn in fns.values():
        jax.block_until_ready(fn(*args))
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - t0)
    return times


def stats(ts):
    """(median, interquartile spread as a fraction of the median)."""
    q1, med, q3 = np.percentile(ts, [25, 50, 75])
    return float(med), float((q3 - q1) / med)


# Llama sizes for --decode: the e2e model, smaller ones whose weights a CPU's cache can
# hold from step to step, and "tiny", the shipped GQA demo model's config.
MODELS = {
    "e2e": dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_layers=8,
                q_heads=8, kv_heads=8, head_dim=64),
    "medium": dict(vocab_size=8192, hidden_size=384, intermediate_size=1024, num_layers=6,
                   q_heads=6, kv_heads=6, head_dim=64),
    "small": dict(vocab_size=4096, hidden_size=256, intermediate_size=704, num_layers=4,
                  q_heads=4, kv_heads=4, head_dim=64),
    "tiny": None,
}


def model_config(model, dtype):
    """The LlamaConfig of a `MODELS` size in this dtype."""
    from kvjax.models import llama
    from kvjax.models.layers import RopeConfig
    from kvjax.models.tiny import tiny_config

    shape = MODELS[model]
    if shape is None:
        return dataclasses.replace(tiny_config("gqa"), dtype=dtype)
    return llama.LlamaConfig(**shape, rope=RopeConfig(theta=1e4, dim=shape["head_dim"]),
                             dtype=dtype)


def decode_ab(dtype, repeats, marches, batches=(1, 8), context=1024, verbose=True,
              model="e2e"):
    """One decode step of a Llama of `MODELS` with the kernel and with XLA's dot, per build
    and batch: median step times, interleaved, and whether "auto" picks the faster.

    The XLA-dot program runs per-layer weights (as the decode loop gives it where the
    kernel does not run: `kvjax.generate.decode_params`, XLA:CPU would copy each layer's
    slice of stacked weights every step), the kernel program the stacked weights it reads
    in place."""
    from kvjax.cache import init_cache, reserve
    from kvjax.models import llama

    config = model_config(model, dtype)
    vocab = config.vocab_size
    stacked = llama.init_params(config, jax.random.key(0))
    unstacked = llama.unstack_layers(stacked)
    model_bytes = sum(x.nbytes for x in jax.tree.leaves(stacked))
    rows = []
    for batch in batches:
        steps = 2 * (repeats + 1) * len(marches)
        pages = -(-(context + steps) // 16)
        spec = llama.cache_spec(config, page_size=16, num_pages=batch * pages, max_seqs=batch,
                                max_pages_per_seq=pages, dtype=dtype)
        cache, _ = reserve(init_cache(spec), jnp.full((batch,), context, jnp.int32))
        tokens = jnp.asarray(np.random.default_rng(0).integers(3, vocab, (batch, 1)), jnp.int32)

        def step(params, cache, tokens, batch=batch):
            positions = cache.table.lengths[:, None]
            cache, _ = reserve(cache, jnp.ones((batch,), jnp.int32))
            return llama.forward(params, config, tokens, positions, cache,
                                 q_lengths=jnp.ones((batch,), jnp.int32))

        fns = {}
        for march in marches:
            with cpu.override(march=march, matmul="on"):
                fns[march] = (jax.jit(step, donate_argnums=1).lower(
                    stacked, cache, tokens).compile(), stacked,
                    dataclasses.replace(cpu.get_options(), matmul="auto"))
        with cpu.override(matmul="off"):
            fns["xla"] = (jax.jit(step, donate_argnums=1).lower(
                unstacked, cache, tokens).compile(), unstacked, None)
        # Same state, every program: the logits must agree (float32 sums in another order;
        # bf16 activations round after each projection in both, at different points).
        got = {name: np.asarray(fn(p, jax.tree.map(jnp.copy, cache), tokens)[0], np.float32)
               for name, (fn, p, _) in fns.items()}
        tol = 1e-3 if dtype == "float32" else 5e-2
        scale = np.abs(got["xla"]).max()
        for name in marches:
            err = float(np.abs(got[name] - got["xla"]).max() / scale)
            if err > tol:
                raise AssertionError(f"{name} kernel and XLA decode logits differ: max rel err "
                                     f"{err:.2e}")
        times = {name: [] for name in fns}
        names = list(fns)
        for i in range(steps):
            name = names[i % len(names)]
            fn, p, _ = fns[name]
            t0 = time.perf_counter()
            out, cache = fn(p, cache, tokens)
            out.block_until_ready()
            if i >= len(names):  # the first call of each is a warm-up
                times[name].append(time.perf_counter() - t0)
        t_xla = float(np.median(times["xla"]))
        line = (f"decode step, {model} model ({model_bytes / 2**20:.1f} MiB), batch {batch}, "
                f"context {context}, {dtype}: xla {t_xla * 1e3:.2f} ms")
        row = dict(model=model, model_bytes=model_bytes, dtype=dtype, batch=batch,
                   context=context, xla_step_s=times["xla"], load_average=os.getloadavg())
        for march in marches:
            t = float(np.median(times[march]))
            pick = cpu.choose("matmul", rows=batch, devices=1, options=fns[march][2]).use_kernel
            ok = pick == (t < t_xla)
            row[march] = dict(step_s=times[march], speedup=t_xla / t,
                              auto="kernel" if pick else "xla", auto_is_fastest=ok)
            line += (f" | {march} kernel {t * 1e3:.2f} ms ({t_xla / t:.2f}x), auto "
                     f"{'kernel' if pick else 'xla'}{'' if ok else ' (SLOWER)'}")
        if verbose:
            print(line + f"; load average {os.getloadavg()[0]:.1f}")
        rows.append(row)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="M in 1, 8 and fewer repeats (seconds)")
    parser.add_argument("--rows", default=None,
                        help="comma-separated row counts M (default 1,8,16,32,64; quick 1,8)")
    parser.add_argument("--dtypes", default="float32,bfloat16",
                        help="comma-separated weight dtypes (x is float32)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed calls per measurement (default 30, quick 10)")
    parser.add_argument("--sweep", action="store_true",
                        help="time kernel settings (tile_vectors, ahead, block, panel) on [8,512]x"
                             "[512,32000] instead of the shape table")
    parser.add_argument("--decode", action="store_true",
                        help="A/B one decode step of the e2e model instead of the shape table")
    parser.add_argument("--decode-dtype", default="float32", choices=("float32", "bfloat16"),
                        help="--decode: params, activations and cache dtype")
    parser.add_argument("--batches", default="1,8", help="--decode: comma-separated batches")
    parser.add_argument("--models", default="e2e",
                        help=f"--decode: comma-separated Llama sizes of {', '.join(MODELS)} "
                             f"(default e2e)")
    parser.add_argument("--sweep-tiles", default="2,3",
                        help="--sweep: comma-separated tile_vectors (float32 only; bf16 uses 2)")
    parser.add_argument("--sweep-ahead", default="16,32,48",
                        help="--sweep: comma-separated prefetch distances in rows")
    parser.add_argument("--sweep-blocks", default="256,512,1024",
                        help="--sweep: comma-separated column-block widths")
    parser.add_argument("--sweep-panels", default="8,16,32",
                        help="--sweep: comma-separated panel heights in rows (0: all K)")
    parser.add_argument("--marches", default="native,haswell",
                        help="comma-separated -march builds whose kernels are timed (default "
                             "native,haswell: this CPU's and the AVX2 code)")
    parser.add_argument("--out", default=None,
                        help="JSON path (default benchmarks/results/matmul-<time>.json)")
    args = parser.parse_args(argv)
    if not available():
        sys.exit(f"kvjax CPU kernels unavailable: {unavailable_reason()}")
    rows = [int(r) for r in (args.rows or ("1,8" if args.quick else "1,8,16,32,64")).split(",")]
    repeats = args.repeats or (10 if args.quick else 30)
    dtypes = [jnp.dtype(d) for d in args.dtypes.split(",")]
    bw = read_bandwidth()
    mach = machine()
    simd = [f for f in mach["flags"].split() if f.startswith(("avx", "fma", "f16c", "amx"))]
    print(f"{mach['cpu']} ({mach['cpus']} cpus; {' '.join(simd)}); streaming read {bw:.1f} GB/s;"
          f" load average {os.getloadavg()[0]:.1f}")
    rng = np.random.default_rng(0)
    results = []

    if args.decode:
        unknown = set(args.models.split(",")) - set(MODELS)
        if unknown:
            parser.error(f"--models: unknown {sorted(unknown)}; the sizes are {list(MODELS)}")
        results = [row for name in args.models.split(",")
                   for row in decode_ab(args.decode_dtype, repeats, args.marches.split(","),
                                        [int(b) for b in args.batches.split(",")],
                                        model=name)]
    elif args.sweep:
        def ints(text):
            return [int(v) for v in text.split(",")]

        grid = list(itertools.product(dtypes, ints(args.sweep_tiles), ints(args.sweep_ahead),
                                      ints(args.sweep_blocks), ints(args.sweep_panels)))
        xs = jnp.asarray(rng.standard_normal((8, 512)), jnp.float32)
        ws = {d: jnp.asarray(rng.standard_normal((512, 32000)), d) for d in dtypes}
        for dt, tv, ahead, block, panel in grid:
            if dt == jnp.bfloat16 and tv != ints(args.sweep_tiles)[0]:
                continue  # bf16 tiles are always 32 columns: one pass over the rest
            f = jax.jit(lambda x, w, tv=tv, a=ahead, b=block, p=panel: cpu_matmul.matmul(
                x, w, tile_vectors=tv, ahead=a, block=b, panel=p))
            t = median_time(f, repeats, xs, ws[dt])
            gbps = ws[dt].nbytes / t / 1e9
            results.append(dict(dtype=dt.name, tile_vectors=tv, ahead=ahead, block=block,
                                panel=panel, kernel_s=t, kernel_GBps=gbps))
            print(f"{dt.name:9s} tile_vectors {tv} ahead {ahead:3d} block {block:4d} "
                  f"panel {panel:3d}: {t * 1e3:7.3f} ms {gbps:5.1f} GB/s")
    else:
        marches = args.marches.split(",")
        kernels = {}
        for march in marches:
            with cpu.override(march=march):
                if not available():
                    print(f"-march={march}: {unavailable_reason()}")
                    continue
                lib = cpu.library()
                print(f"-march={march}: {lib.isa_class} ({' '.join(sorted(lib.isa))})")
                kernels[march] = (jax.jit(lambda x, w: cpu_matmul.matmul(x, w)),
                                  cpu.get_options())
        print(f"{'dtype':9s} {'M':>3s} {'K':>5s} {'N':>6s} | {'x@w ms':>8s} {'GB/s':>5s} | "
              + " | ".join(f"{m + ' ms':>12s} {'GB/s':>5s} {'vs x@w':>6s} auto" for m in kernels))
        xla = jax.jit(lambda x, w: x @ w.astype(x.dtype))
        for dt, (k, n), m in itertools.product(dtypes, SHAPES, rows):
            x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
            w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dt)
            fns = {"xla": xla, **{march: f for march, (f, _) in kernels.items()}}
            times = interleaved(fns, (x, w), repeats)
            want = np.asarray(xla(x, w))
            row = dict(dtype=dt.name, M=m, K=k, N=n, weight_bytes=w.nbytes)
            t_xla, spread = stats(times["xla"])
            row["xla"] = dict(median_s=t_xla, iqr_fraction=spread, GBps=w.nbytes / t_xla / 1e9)
            line = (f"{dt.name:9s} {m:3d} {k:5d} {n:6d} | {t_xla * 1e3:8.3f} "
                    f"{w.nbytes / t_xla / 1e9:5.1f} |")
            for march, (f, opts) in kernels.items():
                got = np.asarray(f(x, w))
                err = float(np.abs(got - want).max() / np.abs(want).max())
                if err > 1e-4:
                    raise AssertionError(f"{march} kernel disagrees with x @ w: {err:.2e}")
                t, spread = stats(times[march])
                pick = cpu.choose("matmul", rows=m, devices=1, options=opts).use_kernel
                fastest = t < t_xla
                row[march] = dict(median_s=t, iqr_fraction=spread, GBps=w.nbytes / t / 1e9,
                                  speedup=t_xla / t, max_rel_err=err,
                                  auto="kernel" if pick else "xla",
                                  auto_is_fastest=pick == fastest)
                line += (f" {t * 1e3:12.3f} {w.nbytes / t / 1e9:5.1f} {t_xla / t:5.2f}x "
                         f"{'kernel' if pick else 'xla'}{'' if pick == fastest else ' (SLOWER)'}"
                         f" |")
            results.append(row)
            print(line)

    out = result_path(f"matmul-{'sweep-' if args.sweep else ''}{'quick-' if args.quick else ''}",
                      args.out)
    with open(out, "w") as f:
        json.dump(dict(machine=machine(), read_GBps=bw, load_average=os.getloadavg(),
                       repeats=repeats, results=results), f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
