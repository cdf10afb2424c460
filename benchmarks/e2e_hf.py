"""End-to-end greedy decode against HuggingFace transformers: Llama and DeepSeek (MLA).

For each model family and dtype the same random weights (built in transformers,
saved with `save_pretrained`, loaded into kvjax with `kvjax.models.load`) generate
the same number of greedy tokens for the same batch of prompts with:

* `hf_dynamic`: transformers `generate` with its default dynamic cache;
* `hf_static_compiled` (full run only; for the first model and dtype unless
  --static-compiled-all): `generate(cache_implementation="static")` with the
  forward wrapped in `torch.compile`; if compiling fails the error is recorded
  instead of a time;
* `kvjax`: `kvjax.generate.generate` (paged cache, `impl="auto"`).

Reported per engine: decode tokens/s (batch x (N - 1) / (t(N new tokens) -
t(1 new token)), so prompt processing is excluded; medians and min-max over
repeats), end-to-end tokens/s of the whole call, and peak memory: the largest
increase of the process's resident set size (sampled every 2 ms from
/proc/self/statm by a thread) over its value just before the call — what the
generate call allocates on top of the loaded weights, by either engine. Ratios
kvjax/HF come from the same run. Tokens: in float32 kvjax and `hf_dynamic` must
produce the same greedy tokens (checked, the run fails otherwise; the compiled
engine's agreement is reported); in bf16 rounding differs between the two
libraries, so the agreement rate is reported.

    PYTHONPATH=. python benchmarks/e2e_hf.py --quick
    PYTHONPATH=. python benchmarks/e2e_hf.py --families llama,deepseek --dtypes float32,bfloat16
"""

import argparse
import json
import os
import sys
import tempfile
import threading
import time

import jax
import numpy as np
import torch
import transformers as T
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import result_path  # noqa: E402
from benchmarks.decode_e2e import hf_generate, kvjax_generate  # noqa: E402
from kvjax.models.loading import load  # noqa: E402

_PAGE = os.sysconf("SC_PAGE_SIZE")

# Model configs. DeepSeek: MLA attention with dense MLPs in every layer (the
# configuration the decode loop's token-for-token test covers).
CONFIGS = {
    ("llama", "full"): dict(vocab_size=32000, hidden_size=512, intermediate_size=1408,
                            num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8),
    ("llama", "quick"): dict(vocab_size=512, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    ("deepseek", "full"): dict(vocab_size=32000, hidden_size=512, intermediate_size=1408,
                               num_hidden_layers=8, num_attention_heads=8,
                               num_key_value_heads=8, kv_lora_rank=128, qk_rope_head_dim=32,
                               qk_nope_head_dim=64, v_head_dim=64, q_lora_rank=None,
                               first_k_dense_replace=8, n_routed_experts=4,
                               num_experts_per_tok=2, moe_intermediate_size=256),
    ("deepseek", "quick"): dict(vocab_size=512, hidden_size=64, intermediate_size=128,
                                num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=16,
                                qk_nope_head_dim=16, v_head_dim=16, q_lora_rank=None,
                                first_k_dense_replace=2, n_routed_experts=4,
                                num_experts_per_tok=2, moe_intermediate_size=32),
}


def build_hf(family, cfg, seed=0):
    """A random float32 transformers model of `family` ("llama" or "deepseek"), eval mode."""
    common = dict(max_position_embeddings=4096, pad_token_id=0, tie_word_embeddings=False,
                  initializer_range=0.05)
    torch.manual_seed(seed)
    if family == "llama":
        # No EOS: HF's min_new_tokens would mask its logit and kvjax's greedy would not.
        config = T.LlamaConfig(**cfg, **common, bos_token_id=None, eos_token_id=None)
        model = T.LlamaForCausalLM(config)
    elif family == "deepseek":
        config = T.DeepseekV2Config(**cfg, **common, bos_token_id=None, eos_token_id=None)
        model = T.DeepseekV2ForCausalLM(config)
    else:
        raise ValueError(f"family must be 'llama' or 'deepseek', got {family!r}")
    return model.float().eval()


def _rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def peak_rss_delta(fn):
    """(fn(), largest RSS increase in bytes during the call), RSS sampled every 2 ms."""
    base = _rss()
    peak = [base]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.002)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        out = fn()
    finally:
        done.set()
        t.join()
    peak[0] = max(peak[0], _rss())
    return out, peak[0] - base


def decode_times(run, new_tokens, repeats):
    """Times of run(1) and run(N) after a warm-up of each; returns stats and run(N)'s tokens."""
    run(1)
    _, warm_mem = peak_rss_delta(lambda: run(new_tokens))  # warm-up; its peak includes compiling
    t1, tn, mems = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run(1)
        t1.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        out, m = peak_rss_delta(lambda: run(new_tokens))
        tn.append(time.perf_counter() - t0)
        mems.append(m)
    mem = float(np.median(mems))  # steady state (the warm-up's peak also holds compiling)
    steps = [(b - a) / (new_tokens - 1) for a, b in zip(sorted(t1), sorted(tn), strict=True)]
    return dict(step_median_s=(float(np.median(tn)) - float(np.median(t1))) / (new_tokens - 1),
                step_min_s=min(steps), step_max_s=max(steps),
                call_median_s=float(np.median(tn)), call_min_s=min(tn), call_max_s=max(tn),
                peak_rss_delta_bytes=int(mem), warmup_peak_rss_delta_bytes=int(warm_mem),
                repeats=repeats), out


def hf_static_compiled(model):
    """A generate function using the static cache and a torch.compile'd forward."""
    compiled = torch.compile(model.forward, mode="default", dynamic=False)
    orig = model.forward

    def gen(prompts, n):
        ids = torch.tensor(np.asarray(prompts), dtype=torch.long)
        model.forward = compiled
        try:
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                     min_new_tokens=n, do_sample=False, pad_token_id=0,
                                     cache_implementation="static")
        finally:
            model.forward = orig
        return out[:, ids.shape[1]:].numpy()

    return gen


def run_case(family, dtype, size, batch, prompt_len, new_tokens, repeats, engines, tmp,
             static_all=True, first=None):
    cfg = CONFIGS[(family, size)]
    hf = build_hf(family, cfg)
    path = os.path.join(tmp, family)
    if not os.path.exists(path):
        hf.save_pretrained(path)
    if dtype == "bfloat16":
        hf = hf.to(torch.bfloat16)
    model, params = load(path, dtype=dtype)
    n_params = sum(p.numel() for p in hf.parameters())
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, cfg["vocab_size"], size=(batch, prompt_len))
    res = dict(family=family, dtype=dtype, params=n_params, config=cfg, batch=batch,
               prompt_len=prompt_len, new_tokens=new_tokens, engines={})
    toks = {}
    runners = dict(
        kvjax=lambda n: kvjax_generate(model, params, prompts, n, dtype, "auto"),
        hf_dynamic=lambda n: hf_generate(hf, prompts, n),
    )
    if "hf_static_compiled" in engines and (static_all or (family, dtype) == first):
        g = hf_static_compiled(hf)
        runners["hf_static_compiled"] = lambda n: g(prompts, n)
    for name in engines:
        if name not in runners:
            res["engines"][name] = dict(error="skipped (torch.compile only for the first case; "
                                              "--static-compiled-all)")
            continue
        try:
            stats, out = decode_times(runners[name], new_tokens, repeats)
        except Exception as e:  # noqa: BLE001 - torch.compile failures are reported, not fatal
            if name == "kvjax" or name == "hf_dynamic":
                raise
            res["engines"][name] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
            continue
        # Tiny models on a loaded machine: t(N) - t(1) can drown in noise (even go negative).
        ok = stats["step_median_s"] > 0
        stats["decode_tokens_per_s"] = batch / stats["step_median_s"] if ok else None
        stats["call_tokens_per_s"] = batch * new_tokens / stats["call_median_s"]
        res["engines"][name] = stats
        toks[name] = np.asarray(out)
    for name in toks:
        if name == "kvjax":
            continue
        agree = float(np.mean(toks[name] == toks["kvjax"]))
        res["engines"][name]["same_tokens_as_kvjax"] = agree
        kv_step = res["engines"]["kvjax"]["step_median_s"]
        res["engines"][name]["kvjax_speedup_decode"] = (
            res["engines"][name]["step_median_s"] / kv_step if kv_step > 0 else None)
        res["engines"][name]["kvjax_speedup_call"] = (
            res["engines"][name]["call_median_s"] / res["engines"]["kvjax"]["call_median_s"])
        res["engines"][name]["kvjax_memory_ratio"] = (
            res["engines"]["kvjax"]["peak_rss_delta_bytes"]
            / max(res["engines"][name]["peak_rss_delta_bytes"], 1))
        # transformers' own eager path is the oracle; torch.compile may reorder float
        # arithmetic, so its agreement is reported, not asserted.
        if dtype == "float32" and name == "hf_dynamic" and agree < 1.0:
            raise AssertionError(
                f"{family} float32: kvjax and {name} greedy tokens differ ({agree:.3f} agree)")
    return res


def print_table(results):
    hdr = (f"{'model':9} {'dtype':8} {'engine':19} {'decode tok/s':>12} "
           f"{'step ms (min-max)':>22} {'call tok/s':>10} {'peak RSS+ MiB':>13} "
           f"{'same tok':>8} {'kvjax x':>7} {'x call':>6}")
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        for name, e in r["engines"].items():
            lead = f"{r['family']:9} {r['dtype']:8} {name:19}"
            if "error" in e:
                print(f"{lead} not run: {e['error'][:80]}")
                continue
            step = (f"{e['step_median_s'] * 1e3:7.2f} ({e['step_min_s'] * 1e3:.2f}-"
                    f"{e['step_max_s'] * 1e3:.2f})")
            same = f"{100 * e['same_tokens_as_kvjax']:.0f}%" if "same_tokens_as_kvjax" in e else ""
            sp = e.get("kvjax_speedup_decode")
            sp = "" if "kvjax_speedup_call" not in e else "n/a" if sp is None else f"{sp:.2f}"
            sc = f"{e['kvjax_speedup_call']:.2f}" if "kvjax_speedup_call" in e else ""
            tps = e["decode_tokens_per_s"]
            tps = "n/a (noise)" if tps is None else f"{tps:.1f}"
            print(f"{lead} {tps:>12} {step:>22} "
                  f"{e['call_tokens_per_s']:>10.1f} {e['peak_rss_delta_bytes'] / 2**20:>13.1f} "
                  f"{same:>8} {sp:>7} {sc:>6}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny models, short prompts")
    p.add_argument("--families", default="llama,deepseek",
                   help="comma-separated model families: llama, deepseek")
    p.add_argument("--dtypes", default=None,
                   help="comma-separated dtypes of weights and cache, in both libraries "
                        "(default float32,bfloat16; quick: float32)")
    p.add_argument("--batch", type=int, default=None, help="rows per batch (default 4, quick 2)")
    p.add_argument("--prompt-len", type=int, default=None,
                   help="prompt tokens per row (default 128, quick 8)")
    p.add_argument("--new-tokens", type=int, default=None,
                   help="greedy tokens per row (default 32, quick 6)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs (default 3, quick 1)")
    p.add_argument("--engines", default=None,
                   help="comma-separated among kvjax, hf_dynamic, hf_static_compiled "
                        "(default all; quick: no hf_static_compiled, compiling takes minutes)")
    p.add_argument("--static-compiled-all", action="store_true",
                   help="run hf_static_compiled for every model and dtype (default: only the "
                        "first, since torch.compile takes minutes on a CPU)")
    p.add_argument("--out", default=None,
                   help="JSON path (default benchmarks/results/e2e_hf-<time>.json)")
    a = p.parse_args(argv)
    size = "quick" if a.quick else "full"
    batch = a.batch or (2 if a.quick else 4)
    prompt_len = a.prompt_len or (8 if a.quick else 128)
    new_tokens = a.new_tokens or (6 if a.quick else 32)
    repeats = a.repeats or (1 if a.quick else 3)
    engines = (a.engines.split(",") if a.engines else
               ["kvjax", "hf_dynamic"] + ([] if a.quick else ["hf_static_compiled"]))
    for e in engines:
        if e not in ("kvjax", "hf_dynamic", "hf_static_compiled"):
            raise ValueError(f"--engines: unknown engine {e!r}")
    if engines[0] != "kvjax":
        engines = ["kvjax"] + [e for e in engines if e != "kvjax"]
    torch.set_num_threads(os.cpu_count())
    results = []
    with tempfile.TemporaryDirectory(prefix="kvjax-e2e-hf-") as tmp:
        dtypes = (a.dtypes or ("float32" if a.quick else "float32,bfloat16")).split(",")
        jobs = [(f, d) for f in a.families.split(",") for d in dtypes]
        for family, dtype in tqdm(jobs, desc="e2e vs HF", file=sys.stderr):
            results.append(run_case(family, dtype, size, batch, prompt_len, new_tokens, repeats,
                                    engines, tmp, a.static_compiled_all, jobs[0]))
    print(f"batch {batch}, prompt {prompt_len}, {new_tokens} new tokens; torch "
          f"{torch.__version__} ({torch.get_num_threads()} threads), transformers "
          f"{T.__version__}, jax {jax.__version__}; peak RSS+ = largest resident-set growth "
          "during a generate call")
    print_table(results)
    out = result_path("e2e_hf-", a.out)
    with open(out, "w") as f:
        json.dump(dict(results=results, torch=torch.__version__, transformers=T.__version__,
                       jax=jax.__version__, quick=a.quick, load_average=os.getloadavg(),
                       memory_measure="largest RSS increase over the pre-call RSS during one "
                                      "generate call (median over the timed repeats; the "
                                      "warm-up call's, which includes compiling, separately)"),
                  f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
