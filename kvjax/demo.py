"""`python -m kvjax demo`: the shipped tiny models complete Python code through compressed caches.

For the embedded GQA (Llama-style) and MLA (DeepSeek-style) byte-level models
it completes one Python prompt greedily with a bf16 cache, KIVI int4 and int2
caches, and on the GQA model an eviction policy too (StreamingLLM; policies act on
MLA latent caches as well, the demo keeps its table short), and prints each completion, the
KV bytes the sequence holds, decode tokens/s and agreement with the bf16 output.

Each configuration runs through `kvjax.generate.generate`. The prompt is fed
through the decode step one byte at a time (`prefill="step"`: one decode loop per
cache, and compilation is most of the run on a small CPU); `--chunked-prefill`
prefills it in one chunk instead.
"""

import argparse
import time

__all__ = ["add_parser", "run", "DEFAULT_PROMPT"]

DEFAULT_PROMPT = '''def count_lines(path):
    """Return the number of lines in a file."""
    with open(path) as f:
        return sum(1 for _ in f)


def read_text(path):
    """Return the contents of a file."""
    with open(path'''


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "demo", help="complete Python code with the shipped tiny models on compressed caches",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-new-tokens", type=int, default=48,
                   help="bytes to generate per configuration (default 48)")
    p.add_argument("--prompt", default=None,
                   help="prompt text (default: a Python snippet ending mid-function)")
    p.add_argument("--models", default="gqa,mla",
                   help="comma-separated tiny models to run: gqa, mla (default both)")
    p.add_argument("--residual", type=int, default=128,
                   help="KIVI full-precision recent tokens R, a multiple of 32 (default 128)")
    p.add_argument("--budget", type=float, default=0.5,
                   help="StreamingLLM budget as a fraction of prompt + output (default 0.5)")
    p.add_argument("--chunked-prefill", action="store_true",
                   help="prefill the prompt in one chunk (compiles a second program per "
                        "cache) instead of feeding it through the decode step")
    p.set_defaults(func=run)


def _configs(model_name: str, context: int, args):
    from kvjax.cache.policies import StreamingLLM
    from kvjax.eval import EvalConfig as CacheConfig

    out = [CacheConfig(name="bf16"),
           CacheConfig(name="KIVI int4", bits=4, residual=args.residual),
           CacheConfig(name="KIVI int2", bits=2, residual=args.residual)]
    if model_name == "gqa":
        budget = max(8, int(args.budget * context))
        out.append(CacheConfig(name=f"StreamingLLM {budget} tok",
                               policy=StreamingLLM(n_sink=4, window=budget - 4)))
    return out


def _show(text: bytes) -> str:
    s = text.decode("utf-8", errors="replace")
    return s.replace("\n", "\u23ce").replace("\t", "\\t")


def _run_config(model, params, cc, tokens, n: int, chunked: bool):
    """Greedy completion of `tokens` through one cache configuration.

    Returns (output bytes, cached tokens at the end, decode tokens/s).
    """
    import jax
    import numpy as np

    from kvjax import generate

    kw = dict(key=jax.random.key(0), cache=cc.cache_config(), policy=cc.policy,
              free_finished=False, prefill="chunked" if chunked else "step")
    generate.generate(model, params, [tokens], max_new_tokens=n, **kw)  # compile
    t0 = time.perf_counter()
    res = generate.generate(model, params, [tokens], max_new_tokens=n, **kw)
    rate = (len(tokens) - 1 + n if not chunked else n) / (time.perf_counter() - t0)
    return res.tokens[0, : int(res.num_generated[0])], int(np.asarray(res.cache.lengths)[0]), rate


def run(args) -> int:
    import os
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from kvjax.eval import kv_bytes_per_token
    from kvjax.models import tiny

    if args.max_new_tokens < 1:
        raise SystemExit(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}.")
    if args.residual < 0 or args.residual % 32:
        raise SystemExit(f"--residual must be a non-negative multiple of 32, got "
                         f"{args.residual}.")
    if not 0 < args.budget <= 1:
        raise SystemExit(f"--budget must be in (0, 1], got {args.budget}.")
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    for n in names:
        if n not in ("gqa", "mla"):
            raise SystemExit(f"--models: unknown model {n!r}; choose from gqa, mla.")
    prompt = (args.prompt if args.prompt is not None else DEFAULT_PROMPT).encode()
    if not prompt:
        raise SystemExit("--prompt must not be empty.")
    tokens = np.frombuffer(prompt, np.uint8).astype(np.int32).tolist()
    n = args.max_new_tokens
    context = len(tokens) + n
    print(f"prompt ({len(tokens)} bytes):\n{prompt.decode()}\n")
    t_all = time.time()
    runs = []  # (model name, model, params, cache config)
    for name in names:
        model, params = tiny.load_tiny(name)
        runs += [(name, model, params, cc) for cc in _configs(name, context, args)]
    # Compilation is most of the demo's time on a small machine; XLA compiles release the
    # GIL, so the configurations run on a thread per core (tracing stays serial).
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        results = list(pool.map(
            lambda r: _run_config(r[1], r[2], r[3], tokens, n, args.chunked_prefill), runs))
    print(f"ran {len(runs)} cache configurations in {time.time() - t_all:.1f}s"
          + ("" if args.chunked_prefill else " (prompt fed through the decode step)") + "\n")
    for name in names:
        mine = [(r, res) for r, res in zip(runs, results, strict=True) if r[0] == name]
        label = {"gqa": "GQA (Llama-style, 4 q / 2 kv heads)",
                 "mla": "MLA (DeepSeek-style latent cache)"}[name]
        print(f"== {label}: {tiny.param_count(mine[0][0][2]):,} params")
        print(f"{'cache':<22}{'KV bytes':>10}{'B/token':>9}{'tok/s':>8}{'agree':>7}  completion")
        base = None
        for (_, model, _, cc), (out, cached, rate) in mine:
            kept = cached + 1  # the last token is not fed back
            per_tok = kv_bytes_per_token(model, cc, context, kept_tokens=kept)["held"]
            total = per_tok * context
            if base is None:
                base = out
            agree = np.mean(np.asarray(out) == np.asarray(base))
            print(f"{cc.name:<22}{total:>10,.0f}{per_tok:>9.1f}{rate:>8.1f}{agree:>7.0%}  "
                  f"{_show(bytes(out.astype(np.uint8).tolist()))}")
        print()
    print(f"done in {time.time() - t_all:.1f}s (including compilation)")
    return 0
