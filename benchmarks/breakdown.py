"""Where the time of the CPU decode step and of the prefill goes, op by op, per build.

For the model of benchmarks/decode_e2e.py (a 58.5M Llama, float32) on the CPU backend:

* `--decode`: one decode step (reserve + forward, batch B, `--context` tokens in the
  cache, the cache donated) as "auto" compiles it, and its parts at the step's shapes:
  each projection shape's matmul with the C++ kernel and with XLA's dot at M = B rows
  (times the count per step), the attention of one layer with the kernel and with the
  XLA path (times the layers), and the rest (the step minus the parts "auto" picks: the
  norms, RoPE, cache writes, sampling, dispatch).
* `--prefill`: the prompts (B x `--prompt-len` tokens, then one greedy token) through
  `kvjax.generate` and through transformers' `generate`, and kvjax's parts: each
  projection's matmul at M = B x chunk rows with XLA's dot, the C++ kernel's many-row
  path and torch's `F.linear` at M = B x prompt rows; one layer's attention over every
  chunk with the C++ kernel and with the XLA path, and torch's `scaled_dot_product_attention`
  (causal) over the whole prompt; and the rest.

Every comparison is interleaved call by call (the machine's load drifts), reported as the
median and the minimum of `--repeats` calls, with the load average beside it; each
kernel's result is checked against XLA's in the same run. `--march` picks the kernels'
build (default native; haswell: the AVX2 code on an AVX-512 machine). `--quick` takes
decode_e2e.py's --quick model (2 layers, hidden 128) instead: a check that every part runs
and agrees, at CI sizes.

    python benchmarks/breakdown.py --decode --batches 1,8 --march haswell
    python benchmarks/breakdown.py --prefill --march haswell
"""

import argparse
import json
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import result_path  # noqa: E402
from benchmarks.decode_e2e import FULL, QUICK, build_hf, machine  # noqa: E402
from kvjax.attention import xla as xla_attention  # noqa: E402
from kvjax.backends import cpu  # noqa: E402
from kvjax.backends.cpu import matmul as cpu_matmul  # noqa: E402
from kvjax.cache import init_cache, reserve  # noqa: E402
from kvjax.models import llama  # noqa: E402
from kvjax.models.layers import RopeConfig  # noqa: E402

PAGE = 16


def _config(c):
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    return llama.LlamaConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"], num_layers=c["num_hidden_layers"],
        q_heads=c["num_attention_heads"], kv_heads=c["num_key_value_heads"], head_dim=head_dim,
        rope=RopeConfig(theta=1e4, dim=head_dim))


def _projections(config):
    """(name, K, N, matmuls per forward) of the model's projections."""
    h, i = config.hidden_size, config.intermediate_size
    q, kv = config.q_heads * config.head_dim, config.kv_heads * config.head_dim
    L = config.num_layers
    return [("q / o", h, q, 2 * L), ("k / v", h, kv, 2 * L), ("gate / up", h, i, 2 * L),
            ("down", i, h, L), ("lm_head", h, config.vocab_size, 1)]


def interleaved(calls, repeats):
    """{name: (median s, min s)} of calls made round-robin after one warm-up each; calls
    maps a name to a zero-argument function returning what to block on."""
    for fn in calls.values():
        jax.block_until_ready(fn())
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - t0)
    return {name: (float(np.median(t)), float(np.min(t))) for name, t in times.items()}


def _fmt(t):
    return f"{t[0] * 1e3:8.3f} ({t[1] * 1e3:.3f})"


def _check(name, got, want, tol=1e-4):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    err = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
    if err > tol:
        raise AssertionError(f"{name}: the kernel differs from XLA by {err:.2e} (max relative)")


def decode(batch, context, repeats, rng, hf_config=FULL):
    config = _config(hf_config)
    params = llama.init_params(config, jax.random.key(0))
    steps = repeats + 4
    pages = -(-(context + steps) // PAGE)
    spec = llama.cache_spec(config, page_size=PAGE, num_pages=batch * pages, max_seqs=batch,
                            max_pages_per_seq=pages)
    cache, _ = reserve(init_cache(spec), jnp.full((batch,), context, jnp.int32))
    tokens = jnp.asarray(rng.integers(3, config.vocab_size, (batch, 1)), jnp.int32)

    def step(params, cache, tokens):
        positions = cache.table.lengths[:, None]
        cache, _ = reserve(cache, jnp.ones((batch,), jnp.int32))
        return llama.forward(params, config, tokens, positions, cache,
                             q_lengths=jnp.ones((batch,), jnp.int32))

    compiled = jax.jit(step, donate_argnums=1).lower(params, cache, tokens).compile()
    state = {"cache": cache}

    def run_step():
        out, state["cache"] = compiled(params, state["cache"], tokens)
        return out

    t_step = interleaved({"step": run_step}, repeats)["step"]
    rows, parts = [], 0.0
    kernel = jax.jit(cpu_matmul.matmul)
    dot = jax.jit(lambda x, w: x @ w)
    for name, k, n, count in _projections(config):
        x = jnp.asarray(rng.standard_normal((batch, k)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.float32)
        _check(name, kernel(x, w), dot(x, w))
        t = interleaved({"kernel": lambda x=x, w=w: kernel(x, w),
                         "xla": lambda x=x, w=w: dot(x, w)}, 3 * repeats)
        auto = "kernel" if cpu.choose("matmul", rows=batch, devices=1).use_kernel else "xla"
        parts += count * t[auto][0]
        rows.append(dict(part=f"matmul {name} [{batch},{k}]x[{k},{n}]", count=count,
                         kernel=t["kernel"], xla=t["xla"], auto=auto))
    q = jnp.asarray(rng.standard_normal((batch, config.q_heads, config.head_dim)), jnp.float32)
    cache = state["cache"]
    args = (q, cache.pages.k, cache.pages.v, cache.table.lengths, cache.table.block_tables)
    layer = min(3, config.num_layers - 1)
    att_kernel = jax.jit(lambda *a: cpu.paged_decode_attention(*a, layer=layer)[0])
    att_xla = jax.jit(lambda *a: xla_attention.paged_decode_attention(*a, layer=layer)[0])
    _check("attention", att_kernel(*args), att_xla(*args))
    t = interleaved({"kernel": lambda: att_kernel(*args), "xla": lambda: att_xla(*args)},
                    3 * repeats)
    auto = "kernel" if cpu.choose("paged_decode", dtype=jnp.float32).use_kernel else "xla"
    parts += config.num_layers * t[auto][0]
    rows.append(dict(part=f"attention, one layer, {batch} x {context} tokens",
                     count=config.num_layers, kernel=t["kernel"], xla=t["xla"], auto=auto))
    return dict(batch=batch, context=context, step=t_step, rest=t_step[0] - parts, rows=rows)


def prefill(batch, prompt_len, chunk, repeats, rng, skip_hf, hf_config=FULL):
    import torch

    from kvjax import generate as gen
    from kvjax.generate.setup import CacheConfig
    from kvjax.models.loading import load

    torch.set_num_threads(os.cpu_count())
    config = _config(hf_config)
    hf = build_hf(hf_config)
    with tempfile.TemporaryDirectory(prefix="kvjax-breakdown-") as tmp:  # the checkpoint, read once
        hf.save_pretrained(tmp)
        model, params = load(tmp, dtype="float32")
    prompts = rng.integers(3, config.vocab_size, size=(batch, prompt_len))

    def kvjax_prefill():
        res = gen.generate(model, params, [list(p) for p in prompts], key=jax.random.key(0),
                           max_new_tokens=1, cache=CacheConfig(dtype="float32"),
                           chunk_size=chunk)
        return jnp.asarray(res.tokens)

    def hf_prefill():
        ids = torch.tensor(prompts, dtype=torch.long)
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1,
                              min_new_tokens=1, do_sample=False, pad_token_id=0)
        return jnp.asarray(out[:, -1:].numpy())

    calls = {"kvjax": kvjax_prefill} if skip_hf else {"kvjax": kvjax_prefill, "hf": hf_prefill}
    whole = interleaved(calls, repeats)
    chunks = prompt_len // chunk
    rows, parts = [], 0.0
    dot = jax.jit(lambda x, w: x @ w)
    kernel = jax.jit(cpu_matmul.matmul)
    for name, k, n, count in _projections(config):
        if name == "lm_head":  # one row per sequence: a decode-sized matmul
            continue
        x = jnp.asarray(rng.standard_normal((batch * chunk, k)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.float32)
        _check(name, kernel(x, w), dot(x, w))
        xt = torch.from_numpy(np.asarray(rng.standard_normal((batch * prompt_len, k)),
                                         np.float32))
        wt = torch.from_numpy(np.asarray(w).T.copy())

        def torch_linear(xt=xt, wt=wt):
            torch.nn.functional.linear(xt, wt)
            return jnp.zeros(())

        fns = {"xla": lambda x=x, w=w: dot(x, w), "kernel": lambda x=x, w=w: kernel(x, w),
               "torch": torch_linear}
        t = interleaved(fns, repeats)
        auto = ("kernel" if cpu.choose("matmul", rows=batch * chunk, devices=1).use_kernel
                else "xla")
        parts += count * chunks * t[auto][0]
        rows.append(dict(part=f"matmul {name} [{batch}x{chunk},{k}]x[{k},{n}] (torch: "
                              f"{batch}x{prompt_len} rows, once)", count=count * chunks,
                         torch_count=count, xla=t["xla"], kernel=t["kernel"], torch=t["torch"],
                         auto=auto))
    pages = batch * (prompt_len // PAGE)
    shape = (config.kv_heads, pages, PAGE, config.head_dim)
    k_pages = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    v_pages = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    tables = jnp.asarray(rng.permutation(pages).reshape(batch, -1), jnp.int32)
    att_kernel = jax.jit(lambda *a: cpu.paged_prefill_attention(*a)[0])
    att_xla = jax.jit(lambda *a: xla_attention.paged_prefill_attention(*a)[0])
    t_kernel = t_xla = 0.0
    q_lengths = jnp.full((batch,), chunk, jnp.int32)
    for c in range(chunks):
        q = jnp.asarray(rng.standard_normal((batch, chunk, config.q_heads, config.head_dim)),
                        jnp.float32)
        args = (q, k_pages, v_pages, jnp.full((batch,), (c + 1) * chunk, jnp.int32), tables,
                q_lengths)
        _check("prefill attention", att_kernel(*args), att_xla(*args))
        t = interleaved({"kernel": lambda a=args: att_kernel(*a),
                         "xla": lambda a=args: att_xla(*a)}, repeats)
        t_kernel, t_xla = t_kernel + t["kernel"][0], t_xla + t["xla"][0]
    qt, kt, vt = (torch.randn(batch, config.q_heads, prompt_len, config.head_dim)
                  for _ in range(3))

    def torch_attention():
        torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        return jnp.zeros(())

    t = interleaved({"torch": torch_attention}, repeats)
    auto = "kernel" if cpu.choose("paged_prefill", dtype=jnp.float32).use_kernel else "xla"
    parts += config.num_layers * (t_kernel if auto == "kernel" else t_xla)
    rows.append(dict(part=f"attention, one layer, {chunks} chunks of {batch} x {chunk} "
                          f"(torch: causal over {prompt_len})", count=config.num_layers,
                     torch_count=config.num_layers, kernel=(t_kernel, t_kernel),
                     xla=(t_xla, t_xla), torch=t["torch"], auto=auto))
    return dict(batch=batch, prompt_len=prompt_len, chunk=chunk, whole=whole,
                rest=whole["kvjax"][0] - parts, rows=rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decode", action="store_true", help="break down a decode step")
    parser.add_argument("--prefill", action="store_true", help="break down the prefill")
    parser.add_argument("--quick", action="store_true",
                        help="decode_e2e.py's --quick model (2 layers, hidden 128) instead of "
                             "the 58.5M one: CI sizes")
    parser.add_argument("--batches", default="1,8", help="--decode: comma-separated batches")
    parser.add_argument("--context", type=int, default=1024, help="--decode: cached tokens")
    parser.add_argument("--batch", type=int, default=8, help="--prefill: prompts")
    parser.add_argument("--prompt-len", type=int, default=1024, help="--prefill: tokens each")
    parser.add_argument("--chunk", type=int, default=256,
                        help="--prefill: kvjax's chunk size (generate's chunk_size)")
    parser.add_argument("--skip-hf", action="store_true", help="--prefill: kvjax only")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per figure")
    parser.add_argument("--march", default=None,
                        help="-march of the kernels' build (default: the options in force)")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/)")
    args = parser.parse_args(argv)
    if not (args.decode or args.prefill):
        parser.error("give --decode and/or --prefill")
    if args.march:
        cpu.set_options(march=args.march)
    lib = cpu.library()
    if lib is None:
        sys.exit(f"kvjax CPU kernels unavailable: {cpu.unavailable_reason()}")
    mach = machine()
    print(f"{mach['cpu']}, {mach['cpus']} cpus ({' '.join(mach['simd_flags'])}); kernels "
          f"-march={lib.march} ({lib.isa_class}); load average {os.getloadavg()[0]:.1f}; "
          "ms: median (min)")
    rng = np.random.default_rng(0)
    hf_config = QUICK if args.quick else FULL
    out = dict(machine=mach, march=lib.march, isa_class=lib.isa_class, decode=[], prefill=None)
    if args.decode:
        for b in [int(x) for x in args.batches.split(",")]:
            r = decode(b, args.context, args.repeats, rng, hf_config)
            r["load_average"] = os.getloadavg()
            out["decode"].append(r)
            print(f"\ndecode step, batch {b}, context {args.context}: {_fmt(r['step'])} ms; "
                  f"rest (step - the parts auto picks) {r['rest'] * 1e3:.2f} ms; load "
                  f"{r['load_average'][0]:.1f}")
            print(f"{'part':46s} {'x':>3s} {'kernel ms':>20s} {'xla ms':>20s} {'auto':>6s} "
                  f"{'auto x count ms':>15s}")
            for row in r["rows"]:
                chosen = row[row["auto"]][0] * row["count"]
                print(f"{row['part']:46s} {row['count']:3d} {_fmt(row['kernel']):>20s} "
                      f"{_fmt(row['xla']):>20s} {row['auto']:>6s} {chosen * 1e3:15.2f}")
    if args.prefill:
        r = prefill(args.batch, args.prompt_len, args.chunk, args.repeats, rng, args.skip_hf,
                    hf_config)
        r["load_average"] = os.getloadavg()
        out["prefill"] = r
        w = r["whole"]
        print(f"\nprefill {args.batch} x {args.prompt_len} tokens + 1 token: kvjax (chunks of "
              f"{args.chunk}) {w['kvjax'][0]:.2f} s (min {w['kvjax'][1]:.2f})"
              + ("" if "hf" not in w else f", transformers {w['hf'][0]:.2f} s (min "
                 f"{w['hf'][1]:.2f}): {w['hf'][0] / w['kvjax'][0]:.2f}x")
              + f"; kvjax rest (whole - the parts auto picks) {r['rest']:.2f} s; load "
              f"{r['load_average'][0]:.1f}")
        print(f"{'part':66s} {'x':>3s} {'xla ms':>18s} {'kernel ms':>18s} {'auto':>6s} "
              f"{'kvjax s':>7s} {'torch ms':>18s} {'torch s':>7s}")
        for row in r["rows"]:
            kv = row[row["auto"]][0] * row["count"]
            th = row["torch"][0] * row["torch_count"]
            print(f"{row['part']:66s} {row['count']:3d} {_fmt(row['xla']):>18s} "
                  f"{_fmt(row['kernel']):>18s} {row['auto']:>6s} {kv:7.2f} "
                  f"{_fmt(row['torch']):>18s} {th:7.2f}")
    path = result_path(f"breakdown-{lib.isa_class}-", args.out)
    with open(path, "w") as f:
        json.dump(out, f, indent=1, default=float)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
