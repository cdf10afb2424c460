"""Decode speed of low-bit KV caches through `kvjax.generate`, against the bf16 cache.

A Llama-shaped model (8 KV heads x 128, random weights) decodes a batch of 8 rows
at a 4K-token context on a bf16 cache and on KIVI int4 and int2 caches (bf16
tails). Each cache is prefilled through `generate` twice, the first call compiling (the
prefill time reported is the second, with its ratio to bf16's); each timed call is then
`generate` continuing those sequences for N new tokens or for 1, and a decode step
is (t(N) - t(1)) / (N - 1), medians over repeats, the caches timed in turn within
each repeat (a shared VM's speed drifts by the minute). Reported per cache: tokens/s,
the ratio to bf16 in the same run, the bytes a step reads (weights + every row's
live pages, scales and tails), and the roofline step at the streaming read bandwidth
measured between repeats. The attention implementation is whatever `impl="auto"`
picks for each page kind on this machine (printed), i.e. the engine's own choice.

The run checks itself: the int4/int2 caches must hold the context as quantized pages
(not in their full-precision tails), every row must decode its N tokens, and the
first token each cache decodes after the prompt is compared with bf16's.

    python benchmarks/kv_bits.py            # batch 8, 4K context, 4 layers
    python benchmarks/kv_bits.py --quick    # seconds: small model, 256-token context
"""

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kvjax.generate as gen  # noqa: E402
from benchmarks import result_path  # noqa: E402
from kvjax.attention import registry  # noqa: E402
from kvjax.backends import cpu  # noqa: E402
from kvjax.models.base import get_family  # noqa: E402
from kvjax.models.llama import LlamaConfig  # noqa: E402
from kvjax.rope import RopeConfig  # noqa: E402
from kvjax.specs import QuantSpec  # noqa: E402

CACHES = {"bf16": None, "int4": 4, "int2": 2}
# Which attention op each cache kind's decode runs, for the printout of "auto"'s choice.
OPS = {"bf16": "paged_decode_attention", "int4": "quantized_attention",
       "int2": "quantized_attention"}


def machine():
    """The CPU model and its SIMD flags (the figures depend on both)."""
    import platform

    model, flags = platform.processor() or platform.machine(), []
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith(("flags", "Features")) and not flags:
                flags = line.split(":", 1)[1].split()
    except OSError:
        pass
    simd = [f for f in flags if f.startswith(("avx", "fma", "f16c", "amx", "asimd", "sve"))]
    return dict(cpu=model, cpus=os.cpu_count(), simd_flags=simd)


def read_probe(nbytes=512 << 20):
    """Streaming read bandwidth in GB/s: a jitted sum over `nbytes`, median of 3."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(jnp.sum)
    f(x).block_until_ready()

    def probe():
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            f(x).block_until_ready()
            ts.append(time.perf_counter() - t0)
        return nbytes / float(np.median(ts)) / 1e9
    return probe


def build_model(quick: bool, seed: int):
    if quick:
        config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=256,
                             num_layers=2, q_heads=4, kv_heads=2, head_dim=64,
                             rope=RopeConfig(theta=10000.0, dim=64))
    else:
        config = LlamaConfig(vocab_size=2048, hidden_size=1024, intermediate_size=1024,
                             num_layers=4, q_heads=8, kv_heads=8, head_dim=128,
                             rope=RopeConfig(theta=500000.0, dim=128))
    family = get_family("llama")
    params = family.init_params(config, jax.random.key(seed))
    return family.model(config), params, config


def cache_config(bits, page_size: int) -> gen.CacheConfig:
    quant = None if bits is None else QuantSpec(bits=bits, group_size=32, residual=page_size)
    return gen.CacheConfig(dtype="bfloat16", quant=quant, page_size=page_size)


def live_bytes(cache, seq_ids) -> int:
    """Bytes of the rows' pages (codes, scales, zero-points) and of their tails."""
    ps, rows = cache.spec.page_size, np.asarray(seq_ids)
    if cache.tail is None:
        pages = (-(-np.asarray(cache.lengths)[rows] // ps)).sum()
    else:  # quantized pages; the rest is in the tail
        pages = (np.asarray(cache.quant_lengths)[rows] // ps).sum()
    pool = sum(x.nbytes for x in jax.tree.leaves(cache.pages))
    total = int(pool * pages / cache.spec.num_pages)
    if cache.tail is not None:
        tail = cache.tail.a.nbytes + cache.tail.b.nbytes
        total += int(tail * len(seq_ids) / cache.spec.max_seqs)
    return total


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--quick", action="store_true", help="small model, short context")
    parser.add_argument("--batch", type=int, default=8, help="rows decoded together")
    parser.add_argument("--context", type=int, default=None,
                        help="prompt tokens per row (default 4096; --quick 256)")
    parser.add_argument("--new-tokens", type=int, default=None,
                        help="tokens per timed call (default 32, also with --quick)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds")
    parser.add_argument("--seed", type=int, default=None, help="weights and prompts seed")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/)")
    args = parser.parse_args(argv)
    for name in ("batch", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    context = args.context or (256 if args.quick else 4096)
    new = args.new_tokens or 32
    if new < 2 or context < 1:
        parser.error(f"--new-tokens must be >= 2 and --context >= 1, got {new}, {context}")
    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**31)

    mach = machine()
    lib = cpu.library()
    build = f"-march={lib.march} ({lib.isa_class})" if lib else "none (XLA path only)"
    print(f"{mach['cpu']}, {mach['cpus']} cpus ({' '.join(mach['simd_flags'])}); "
          f"kvjax CPU kernels: {build}; seed {seed}")
    model, params, config = build_model(args.quick, seed)
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    weight_bytes -= config.vocab_size * config.hidden_size * 4  # the embedding is indexed
    page_size = 32
    batch, seq_ids = args.batch, list(range(args.batch))
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, config.vocab_size, (batch, context)).tolist()
    room = context + (2 * args.repeats + 4) * (new + 1) + 2 * page_size

    caches, first, impls, prefill_s = {}, {}, {}, {}
    for name, bits in CACHES.items():
        cc = cache_config(bits, page_size)
        impls[name] = registry.auto_impl(OPS[name], jnp.bfloat16)
        def prefill(cc=cc):
            res = gen.generate(model, params, prompts, key=jax.random.key(0), max_new_tokens=1,
                               cache=cc.build(model, num_seqs=batch, max_tokens=room),
                               free_finished=False)
            return jax.block_until_ready(res)

        t0 = time.perf_counter()
        prefill()  # compiles the prefill for this cache (and runs it once)
        compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        res = prefill()
        first[name] = res.tokens[:, 0]
        caches[name] = res.cache
        if bits is not None:  # the context is in quantized pages, not the tail
            q = np.asarray(res.cache.quant_lengths)[seq_ids]
            assert (q >= context - res.cache.spec.quant.residual - page_size).all(), q
        prefill_s[name] = time.perf_counter() - t0
        ratio = prefill_s[name] / prefill_s["bf16"]
        print(f"prefill {name}: {prefill_s[name]:.1f} s, {ratio:.2f}x bf16"
              f" (after a first call of {compile_s:.1f} s that compiled it; auto attention: "
              f"{impls[name]})")
    last = {name: first[name][:, None].tolist() for name in CACHES}

    def run(name, n):
        res = gen.generate(model, params, last[name], key=jax.random.key(1), max_new_tokens=n,
                           cache=caches[name], seq_ids=seq_ids, free_finished=False)
        assert (res.num_generated == n).all(), res.num_generated
        caches[name] = res.cache
        last[name] = res.tokens[:, n - 1:n].tolist()
        return res

    for name in CACHES:  # warm-up: compiles both call shapes
        run(name, 1)
        run(name, new)
    probe = read_probe()
    t1 = {name: [] for name in CACHES}
    tn = {name: [] for name in CACHES}
    bws = []
    for _ in range(args.repeats):
        bws.append(probe())
        for name in CACHES:
            t0 = time.perf_counter()
            jax.block_until_ready(run(name, 1).cache)
            t1[name].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            jax.block_until_ready(run(name, new).cache)
            tn[name].append(time.perf_counter() - t0)
    bw = float(np.median(bws))

    rows = []
    base = None
    for name in CACHES:
        step = (float(np.median(tn[name])) - float(np.median(t1[name]))) / (new - 1)
        kv = live_bytes(caches[name], seq_ids)
        roof = (weight_bytes + kv) / (bw * 1e9)
        same = float(np.mean(first[name] == first["bf16"]))
        row = dict(cache=name, impl=impls[name], kv_bytes_read=kv, weight_bytes=weight_bytes,
                   roofline_step_s=roof, first_token_same_as_bf16=same,
                   context_end=int(np.asarray(caches[name].lengths)[0]),
                   prefill_s=prefill_s[name], prefill_vs_bf16=prefill_s[name] / prefill_s["bf16"])
        rows.append(row)
        head = (f"{name:5s} reads {kv / 1e6:7.1f} MB KV + {weight_bytes / 1e6:.1f} MB weights  "
                f"first token as bf16: {100 * same:.0f}%  ")
        if step <= 0:  # the N - 1 steps took less than the timing noise of a call
            row.update(step_s=None, tokens_per_s=None, vs_bf16=None, roofline_fraction=None)
            print(head + "step time unresolved: t(N) <= t(1) (timing noise larger than "
                  f"{new - 1} steps; use a quiet machine or more --new-tokens)")
            continue
        tok_s = batch / step
        if name == "bf16":
            base = tok_s
        row.update(step_s=step, tokens_per_s=tok_s,
                   vs_bf16=None if base is None else tok_s / base,
                   roofline_fraction=roof / step)
        ratio = "  n/a" if base is None else f"{tok_s / base:5.2f}"
        print(head + f"{tok_s:8.1f} tok/s  {ratio}x bf16  step {step * 1e3:6.1f} ms  "
              f"{100 * roof / step:3.0f}% of roofline at {bw:.1f} GB/s")

    out = result_path(f"kv_bits-{'quick-' if args.quick else ''}", args.out)
    with open(out, "w") as f:
        json.dump(dict(machine=mach, kernels_build=build, batch=batch, context=context,
                       new_tokens=new, repeats=args.repeats, seed=seed, read_GBps=bw,
                       load_average=os.getloadavg(), results=rows), f, indent=1)
    print(f"wrote {out}")
    return rows


if __name__ == "__main__":
    main()
