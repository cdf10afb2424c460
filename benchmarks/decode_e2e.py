"""End-to-end greedy decode: kvjax against HuggingFace transformers on the same random Llama.

Builds a Llama-shaped model with random weights in transformers (about 57M
parameters by default), saves it with `save_pretrained`, loads the same weights
into kvjax, and for each batch size runs greedy generation in both:

* tokens/s of the decode phase, measured as (time for N new tokens - time for 1
  new token) / (N - 1) steps, so prompt processing is excluded on both sides;
* the weight + KV-read roofline of a decode step: every step must read all
  weights (the embedding table once per step is not needed, only its rows; the
  LM head is) and every row's live K/V once, at the streaming read bandwidth
  measured in the same run, between the timed repeats of that decode (the first
  probe's figure is reported too). The probe reads memory; where the weights fit in
  the CPU's last-level cache (recorded as `llc_bytes`), a step can beat that roofline;
* end to end, prefill included: the time for the prompts and N new tokens, and its
  ratio to transformers' (`e2e_speedup`);
* whether both produce the same tokens (greedy, float32: they should, except
  where two logits tie within rounding).

kvjax and transformers are timed in turn within each repeat (the machine's load drifts
by the minute on a shared VM). `--march haswell` runs kvjax's CPU kernels built for
AVX2 (measures the AVX2 code on an AVX-512 machine); the CPU model and flags are printed
and written with the results.

    python benchmarks/decode_e2e.py --quick       # tiny model, seconds
    python benchmarks/decode_e2e.py               # batch 1 and batch 8 x 1K prompts
    python benchmarks/decode_e2e.py --march haswell
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers as T

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kvjax.generate as gen  # noqa: E402
from benchmarks import result_path  # noqa: E402
from kvjax.backends import cpu  # noqa: E402
from kvjax.generate.setup import CacheConfig  # noqa: E402
from kvjax.models.loading import load  # noqa: E402

FULL = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
            num_attention_heads=8, num_key_value_heads=8)
QUICK = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)


def read_probe(nbytes=512 << 20):
    """A function returning the streaming read bandwidth in GB/s (a jitted sum over a
    `nbytes` array, median of three calls), warmed up."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(jnp.sum)
    f(x).block_until_ready()

    def probe(repeats=3):
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            f(x).block_until_ready()
            ts.append(time.perf_counter() - t0)
        return nbytes / float(np.median(ts)) / 1e9
    return probe


def build_hf(cfg, seed=0):
    config = T.LlamaConfig(**cfg, max_position_embeddings=4096, bos_token_id=1,
                           eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = T.LlamaForCausalLM(config).float().eval()
    return model


def hf_generate(model, prompts, new_tokens):
    ids = torch.tensor(np.asarray(prompts), dtype=torch.long)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:].numpy()


def kvjax_generate(model, params, prompts, new_tokens, cache_dtype, impl):
    res = gen.generate(model, params, [list(p) for p in prompts], key=jax.random.key(0),
                       max_new_tokens=new_tokens, cache=CacheConfig(dtype=cache_dtype),
                       impl=impl)
    return np.asarray(res.tokens)[:, :new_tokens]


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
    return dict(cpu=model, cpus=os.cpu_count(), simd_flags=simd, llc_bytes=last_level_cache())


def last_level_cache() -> int | None:
    """Bytes of the CPU's largest data cache (Linux sysfs), or None: weights that fit in it
    are read faster than the streaming read of memory the roofline assumes."""
    sizes = []
    for d in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            if (d / "type").read_text().strip() == "Instruction":
                continue
            text = (d / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(sizes, default=None)


def decode_rates(runs, new_tokens, repeats, probe=None):
    """Per run (name -> fn(n) returning tokens): seconds per decode step, (t(N) - t(1)) /
    (N - 1) from medians over repeats, and the median t(N) (prefill included); the runs
    are timed in turn within each repeat. With a `probe`, also the median read bandwidth
    it measures before each repeat (the roofline then sees the memory speed of the
    decode it is compared to: on a shared VM it drifts by minutes)."""
    for run in runs.values():
        run(1)
        run(new_tokens)  # warm-up: compiles / allocates
    t1 = {name: [] for name in runs}
    tn = {name: [] for name in runs}
    out, bws = {}, []
    for _ in range(repeats):
        if probe is not None:
            bws.append(probe())
        for name, run in runs.items():
            t0 = time.perf_counter()
            run(1)
            t1[name].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            out[name] = run(new_tokens)
            tn[name].append(time.perf_counter() - t0)
    res = {}
    for name in runs:
        step = (float(np.median(tn[name])) - float(np.median(t1[name]))) / (new_tokens - 1)
        res[name] = dict(step=step, total=float(np.median(tn[name])), tokens=out[name],
                         total_spread=(float(np.min(tn[name])), float(np.max(tn[name]))))
    return res, (float(np.median(bws)) if bws else None)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model and short prompts")
    parser.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    parser.add_argument("--prompt-len", type=int, default=None,
                        help="prompt tokens per row (default 1024, quick 32)")
    parser.add_argument("--new-tokens", type=int, default=None,
                        help="greedy tokens generated per row (default 64, quick 8)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="kvjax params and cache dtype (HF always runs float32)")
    parser.add_argument("--impl", default="auto", help="kvjax attention implementation")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement")
    parser.add_argument("--skip-hf", action="store_true", help="time kvjax only")
    parser.add_argument("--march", default=None,
                        help="-march of kvjax's CPU kernel build (default: the options in "
                             "force, normally native; e.g. haswell for the AVX2 code)")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/)")
    args = parser.parse_args(argv)

    if args.march:
        cpu.set_options(march=args.march)
    lib = cpu.library()
    build = (f"-march={lib.march} ({lib.isa_class}: {' '.join(sorted(lib.isa))})" if lib
             else f"none ({cpu.unavailable_reason().splitlines()[0]})")
    mach = machine()
    print(f"{mach['cpu']}, {mach['cpus']} cpus ({' '.join(mach['simd_flags'])}); "
          f"kvjax CPU kernels: {build}")
    cfg = QUICK if args.quick else FULL
    prompt_len = args.prompt_len or (32 if args.quick else 1024)
    new_tokens = args.new_tokens or (8 if args.quick else 64)
    torch.set_num_threads(os.cpu_count())

    hf = build_hf(cfg)
    n_params = sum(p.numel() for p in hf.parameters())
    with tempfile.TemporaryDirectory(prefix="kvjax-e2e-") as tmp:  # the checkpoint, read once
        hf.save_pretrained(tmp)
        model, params = load(tmp, dtype=args.dtype)
    itemsize = jnp.dtype(args.dtype).itemsize
    embed = cfg["vocab_size"] * cfg["hidden_size"]
    weight_bytes = (n_params - embed) * itemsize  # the input embedding is only indexed
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * itemsize
    probe = read_probe()
    bw = probe(5)
    print(f"model {n_params / 1e6:.1f}M params, kvjax {args.dtype}; streaming read {bw:.1f} GB/s;"
          f" load average {os.getloadavg()[0]:.1f}")

    rng = np.random.default_rng(0)
    results = []
    for batch in [int(b) for b in args.batches.split(",")]:
        prompts = rng.integers(3, cfg["vocab_size"], size=(batch, prompt_len))
        runs = {"kvjax": lambda n, p=prompts: kvjax_generate(model, params, p, n, args.dtype,
                                                              args.impl)}
        if not args.skip_hf:
            runs["hf"] = lambda n, p=prompts: hf_generate(hf, p, n)
        rates, step_bw = decode_rates(runs, new_tokens, args.repeats, probe)
        step, toks = rates["kvjax"]["step"], rates["kvjax"]["tokens"]
        ctx = prompt_len + new_tokens / 2
        read_bytes = weight_bytes + batch * ctx * kv_per_token
        roof_step = read_bytes / (step_bw * 1e9)
        row = dict(batch=batch, prompt_len=prompt_len, new_tokens=new_tokens,
                   kvjax_step_s=step, kvjax_tokens_per_s=batch / step, read_GBps=step_bw,
                   roofline_step_s=roof_step, roofline_fraction=roof_step / step,
                   # against the one probe at the start
                   roofline_fraction_first_probe=read_bytes / (bw * 1e9) / step,
                   kvjax_e2e_s=rates["kvjax"]["total"],
                   kvjax_e2e_min_max_s=rates["kvjax"]["total_spread"])
        if not args.skip_hf:
            hf_step, hf_toks = rates["hf"]["step"], rates["hf"]["tokens"]
            row.update(hf_step_s=hf_step, hf_tokens_per_s=batch / hf_step,
                       speedup=hf_step / step,
                       same_tokens_fraction=float(np.mean(hf_toks == toks)),
                       hf_e2e_s=rates["hf"]["total"],
                       hf_e2e_min_max_s=rates["hf"]["total_spread"],
                       e2e_speedup=rates["hf"]["total"] / rates["kvjax"]["total"])
        results.append(row)
        msg = (f"batch {batch}: kvjax {batch / step:8.1f} tok/s ({step * 1e3:.1f} ms/step, "
               f"{100 * roof_step / step:.0f}% of roofline {roof_step * 1e3:.1f} ms at "
               f"{step_bw:.1f} GB/s read alongside; "
               f"{100 * row['roofline_fraction_first_probe']:.0f}% at the first probe's {bw:.1f})")
        if not args.skip_hf:
            msg += (f"; HF {row['hf_tokens_per_s']:8.1f} tok/s; speedup {row['speedup']:.2f}x; "
                    f"same tokens {100 * row['same_tokens_fraction']:.0f}%; end to end "
                    f"(prefill + {new_tokens} tokens) kvjax {row['kvjax_e2e_s']:.2f} s, HF "
                    f"{row['hf_e2e_s']:.2f} s: {row['e2e_speedup']:.2f}x")
        print(msg)

    out = result_path(f"decode_e2e-{'quick-' if args.quick else ''}"
                      f"{lib.isa_class + '-' if lib else ''}", args.out)
    with open(out, "w") as f:
        json.dump(dict(machine=mach, kernels_build=build, march=lib.march if lib else None,
                       isa_class=lib.isa_class if lib else None,
                       isa=sorted(lib.isa) if lib else [], config=cfg, params=n_params,
                       dtype=args.dtype, impl=args.impl, read_GBps=bw,
                       load_average=os.getloadavg(), results=results), f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
