"""`python -m kvjax eval`: what each KV-cache lever costs in quality and saves in bytes.

On the shipped tiny byte-level models (`kvjax/assets`), for each cache
configuration — bf16, int8, KIVI int4 / int2 (G=32, R=128), StreamingLLM,
H2O, SnapKV and Quest at budgets that are fractions of the perplexity context (prompt +
scored bytes; the same token budgets serve every retrieval length), and the
combinations KIVI-4 + Quest and KIVI-2 + H2O (the policies acting on the packed KIVI
pages) at the same budgets — it measures

* perplexity on held-out standard-library code, token by token while decoding:
  the prompt is prefilled, then the true continuation is fed one byte per
  decode step and scored (cache error only shows after the prefill, so a
  prefill-only pass would hide it);
* retrieval accuracy: two `key_xxxx = "ddddd"` lines (`--retrieval-pairs`; 1 is a
  passkey) buried in code, one asked for at the end in the model's trained
  style (`retrieval_query` in its JSON record: `assert key_xxxx == "` or the line's
  own prefix `key_xxxx = "`), greedy exact match of the 5 digits, at several context
  lengths;
* KV bytes per context token held in the cache, and read per decode step.

Prints a table, writes `eval.json` and `eval.png` (quality vs. bytes per token)
to `--out`.

Every configuration runs through `kvjax.generate`'s one decode loop: perplexity by
`kvjax.generate.score` (teacher forcing through the decode step), retrieval by
`kvjax.generate.generate` (greedy).

The combinations act on the packed KIVI pages (page size 32 = G). Their
full-precision tail counts against the budget b (H2O holds quantized pages
kept x 32 + tail <= b tokens; Quest reads top_k quantized pages + the tail), so
R = 128 would not fit: they use R = 32 * floor(max(b/2 - 31, 0) / 32) (about half
the budget for the recent tokens, as H2O splits it) and Quest top_k =
max(1, (b - R - 16) // 32) pages (the tail averages R + 16 tokens). H2O needs
b >= R + 31 (the largest tail); a smaller budget is reported as not run.
"""

import argparse
import dataclasses
import json
import os
import platform
import time
from typing import Any

__all__ = ["add_parser", "run", "cache_configs", "EvalConfig", "kv_bytes_per_token"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """One cache configuration of the evaluation: storage, optional KIVI bits, policy.

    Attributes:
      name: label for tables.
      dtype: full-precision storage ("bfloat16", "float32"); the quantized tail's dtype.
      bits: 8, 4 or 2 for a KIVI-quantized cache (None: full precision).
      group_size: KIVI group G.
      residual: KIVI full-precision recent tokens R (a multiple of the page size).
      policy: an eviction / selection policy (`kvjax.cache.policies`), on any cache kind
        where it is defined (KIVI pages: page-granular).
      read_budget: tokens a step reads when the policy selects pages (Quest), for accounting.
    """

    name: str
    dtype: str = "bfloat16"
    bits: int | None = None
    group_size: int = 32
    residual: int = 128
    policy: Any = None
    read_budget: int | None = None

    @property
    def page_size(self) -> int:
        return 32 if self.bits is not None else 16

    def cache_config(self):
        """The `kvjax.generate.CacheConfig` of this configuration."""
        from kvjax.generate import CacheConfig
        from kvjax.specs import QuantSpec

        quant = None if self.bits is None else QuantSpec(
            bits=self.bits, group_size=self.group_size, residual=self.residual)
        return CacheConfig(dtype=self.dtype, quant=quant, page_size=self.page_size)

    def build_cache(self, model, batch: int, max_len: int):
        """One cache for every call of this configuration (so each compiles once)."""
        return self.cache_config().build(model, num_seqs=batch, max_tokens=max_len)


def kv_bytes_per_token(model, cc: EvalConfig, context: int, *, page_size: int = 32,
                       kept_tokens: float | None = None) -> dict:
    """KV bytes per context token held (and read per decode step) for one configuration.

    Full-precision tokens cost the dtype's bytes per element; KIVI-quantized
    tokens `bits / 8` plus a float16 scale and zero per group of G elements
    (MLA: the latent is quantized, the rope key stays full precision). The
    first `page_size * floor((L - R) / page_size)` of L tokens are quantized,
    the rest is the full-precision tail. Eviction keeps `kept_tokens` of L;
    on a KIVI cache (page-granular H2O) it frees whole quantized pages and never
    the tail, so with a tail of T tokens the whole pages of `kept_tokens` - T stay
    quantized; as T cycles through [R, R + page_size - 1] while decoding, the
    held bytes are averaged over those T (steady state once over budget).
    Quest on a KIVI cache reads its `top_k` quantized pages, the whole tail and
    the key scales and zeros of every quantized page (its bounds); its
    `dense_layers` read everything.

    Returns:
      dict(held=bytes per context token stored, read=bytes per context token a step reads).
    """
    import jax.numpy as jnp

    from kvjax.cache.policies import H2O, Quest

    spec = model.make_cache_spec(page_size=page_size, num_pages=1, max_seqs=1,
                                 max_pages_per_seq=1, dtype=cc.dtype)
    layers = spec.num_layers
    fp = jnp.dtype(cc.dtype).itemsize
    a = spec.attention
    if spec.is_mla:
        q_elems, fp_elems = a.kv_lora_rank, a.qk_rope_head_dim
    else:
        q_elems, fp_elems = 2 * a.kv_heads * a.head_dim, 0
    full = layers * (q_elems + fp_elems) * fp
    kept = context if kept_tokens is None else min(kept_tokens, context)
    if cc.bits is None:
        held = kept * full
        read = held if cc.read_budget is None else min(cc.read_budget, context) * full
    else:
        n_q = page_size * (max(context - cc.residual, 0) // page_size)
        n_t = context - n_q
        per_q = layers * (q_elems * (cc.bits / 8 + 4 / cc.group_size) + fp_elems * fp)
        held = n_q * per_q + n_t * full
        if isinstance(cc.policy, H2O) and context > kept:
            tails = range(cc.residual, cc.residual + page_size)
            held = sum(min(n_q, page_size * (max(kept - t, 0) // page_size)) * per_q
                       + t * full for t in tails) / page_size
        read = held
        if isinstance(cc.policy, Quest):
            bounds = layers * (q_elems // 2) * 4 / cc.group_size  # key scale + zero, f16
            sparse = (min(cc.policy.top_k * page_size, n_q) * per_q + n_t * full
                      + n_q * bounds)
            dense = min(cc.policy.dense_layers, layers) / layers  # these layers read all
            read = dense * held + (1 - dense) * sparse
    return dict(held=held / context, read=read / context)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "eval", help="perplexity / retrieval / bytes per token of every cache configuration",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="CI sizes: few sequences, short contexts, one budget")
    p.add_argument("--models", default="gqa,mla", help="tiny models to evaluate (gqa, mla)")
    p.add_argument("--out", default="results/eval", help="directory for eval.json and eval.png")
    p.add_argument("--ppl-seqs", type=int, default=None,
                   help="held-out sequences for perplexity (default 8, quick 2)")
    p.add_argument("--prompt-len", type=int, default=None,
                   help="prefilled bytes before scoring (default 192, quick 176)")
    p.add_argument("--score-len", type=int, default=None,
                   help="bytes scored while decoding (default 64, quick 16)")
    p.add_argument("--contexts", default=None,
                   help="comma-separated retrieval context lengths (default 128,192,256; "
                        "quick 96)")
    p.add_argument("--retrieval-n", type=int, default=None,
                   help="retrieval prompts per context length (default 16, quick 2)")
    p.add_argument("--retrieval-pairs", type=int, default=2,
                   help="key/value lines buried per retrieval prompt, one of them asked for "
                        "(default 2: the asked one and a distractor; 1: a passkey)")
    p.add_argument("--budgets", default=None,
                   help="comma-separated policy budgets as fractions of the context "
                        "(default 0.1,0.2,0.5; quick 0.5)")
    p.add_argument("--configs", default=None,
                   help="comma-separated substrings: evaluate only configurations whose name "
                        "contains one (e.g. 'bf16,KIVI,H2O'; '^H2O': names starting with "
                        "'H2O'; '=KIVI-2': exactly that name); the first one run is the "
                        "baseline")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampled eval data")
    p.add_argument("--merge", default=None,
                   help="comma-separated result directories of earlier runs (e.g. split with "
                        "--models/--configs over processes): combine their eval.json into --out "
                        "instead of evaluating")
    p.set_defaults(func=run)


def cache_configs(model_name: str, context: int, budgets) -> list:
    """The configurations evaluated for one model at one context length."""
    from kvjax.cache.policies import H2O, Quest, SnapKV, StreamingLLM

    CacheConfig = EvalConfig
    out = [CacheConfig(name="bf16"),
           CacheConfig(name="int8", bits=8, residual=0),
           CacheConfig(name="KIVI-4", bits=4, residual=128),
           CacheConfig(name="KIVI-2", bits=2, residual=128)]
    if model_name != "gqa":
        return out  # the MLA model never learned retrieval (docs/models.md): nothing to evict
    for frac in budgets:
        b = max(8, int(round(frac * context)))
        pct = f"{frac:.0%}"
        out += [
            CacheConfig(name=f"StreamingLLM {pct}", policy=StreamingLLM(n_sink=4, window=b - 4)),
            CacheConfig(name=f"H2O {pct}", policy=H2O(budget=b)),
            CacheConfig(name=f"SnapKV {pct}",
                        policy=SnapKV(budget=b, window=min(8, b // 2), kernel=5)),
            CacheConfig(name=f"Quest {pct}", policy=Quest(top_k=max(1, b // 16), dense_layers=0),
                        read_budget=max(1, b // 16) * 16),
        ]
        residual, top_k, h2o_ok = combo_settings(b)
        out.append(CacheConfig(name=f"KIVI-4 + Quest {pct}", bits=4, residual=residual,
                               policy=Quest(top_k=top_k, dense_layers=0)))
        if h2o_ok:
            out.append(CacheConfig(name=f"KIVI-2 + H2O {pct}", bits=2, residual=residual,
                                   policy=H2O(budget=b)))
    return out


COMBO_PAGE = 32  # page size of the quantized caches (`_page_size`), = the KIVI group G


def combo_settings(budget: int) -> tuple[int, int, bool]:
    """(residual R, KIVIQuest top_k, whether KIVIH2O can hold `budget`) of the combinations."""
    ps = COMBO_PAGE
    residual = ps * int(max(budget / 2 - (ps - 1), 0) // ps)
    top_k = max(1, (budget - residual - ps // 2) // ps)
    return residual, top_k, budget >= residual + ps - 1


def combos_not_run(context: int, budgets) -> list[str]:
    """Notes for the combinations `cache_configs` leaves out (budget below one tail)."""
    notes = []
    for frac in budgets:
        b = max(8, int(round(frac * context)))
        residual, _, ok = combo_settings(b)
        if not ok:
            notes.append(f"KIVI-2 + H2O {frac:.0%}: not run: a budget of {b} tokens is below "
                         f"the largest full-precision tail ({residual + COMBO_PAGE - 1} tokens "
                         f"at R={residual}, page size {COMBO_PAGE})")
    return notes


def _matches(name: str, pattern: str) -> bool:
    """--configs matching: '=x' exact, '^x' prefix, otherwise substring."""
    if pattern.startswith("="):
        return name == pattern[1:]
    if pattern.startswith("^"):
        return name.startswith(pattern[1:])
    return pattern in name


def _perplexity(model, params, cc: EvalConfig, cache, seqs, prompt_len, chunk):
    """exp(mean NLL) of seqs[:, prompt_len:], each byte fed by a decode step (teacher
    forcing through `kvjax.generate.score`). Returns (ppl, the cache for the next call)."""
    import numpy as np

    from kvjax import generate

    res = generate.score(model, params, seqs[:, :prompt_len].tolist(),
                         seqs[:, prompt_len:].tolist(), cache=cache, policy=cc.policy,
                         chunk_size=chunk)
    return float(np.exp(res.nll())), res.cache


def _retrieval(model, params, cc: EvalConfig, cache, examples, batch, chunk):
    """Fraction of examples whose 5 value digits are generated exactly (greedy), and the
    cache for the next call."""
    import jax
    import numpy as np

    from kvjax import data, generate

    hits = []
    for i in range(0, len(examples), batch):
        chunk_ex = examples[i:i + batch]
        chunk_ex = chunk_ex + [chunk_ex[-1]] * (batch - len(chunk_ex))  # pad, scored once
        prompts = [e.tokens[:e.answer_start].tolist() for e in chunk_ex]
        res = generate.generate(model, params, prompts, key=jax.random.key(0),
                                max_new_tokens=data.VALUE_DIGITS, cache=cache,
                                policy=cc.policy, chunk_size=chunk)
        cache = res.cache
        want = np.stack([np.frombuffer(e.value, np.uint8) for e in chunk_ex])
        hits += list(np.all(res.tokens == want, axis=1))[:len(examples[i:i + batch])]
    return float(np.mean(hits)), cache


def _plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for model in sorted({r["model"] for r in rows}):
        rs = [r for r in rows if r["model"] == model]
        marker = "o" if model == "gqa" else "s"
        for ax, key, label in ((axes[0], "ppl", "perplexity (decode, lower is better)"),
                               (axes[1], "retrieval_mean", "retrieval accuracy")):
            ax.scatter([r["bytes_read"] for r in rs], [r[key] for r in rs], marker=marker,
                       label=model.upper())
            for r in rs:
                ax.annotate(r["config"], (r["bytes_read"], r[key]), fontsize=6,
                            xytext=(2, 2), textcoords="offset points")
            ax.set_xlabel("KV bytes per context token read per step")
            ax.set_ylabel(label)
            ax.set_xscale("log")
    axes[0].legend()
    fig.suptitle("kvjax tiny models: quality vs. KV bytes")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def run(args) -> int:
    import numpy as np
    from tqdm import tqdm

    from kvjax import data
    from kvjax.models import tiny

    if args.merge:
        return _merge(args)
    q = args.quick
    ppl_seqs = args.ppl_seqs or (2 if q else 8)
    # Quick: 192 tokens, past KIVI's R=128 tail plus a 32-token page, so that KIVI caches
    # hold quantized pages while the scored bytes are decoded.
    prompt_len = args.prompt_len or (176 if q else 192)
    score_len = args.score_len or (16 if q else 64)
    contexts = [int(x) for x in (args.contexts or ("96" if q else "128,192,256")).split(",")]
    retrieval_n = args.retrieval_n or (2 if q else 16)
    budgets = [float(x) for x in (args.budgets or ("0.5" if q else "0.1,0.2,0.5")).split(",")]
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    for n in names:
        if n not in ("gqa", "mla"):
            raise SystemExit(f"--models: unknown model {n!r}; choose from gqa, mla.")
    if min(contexts) < 64 or prompt_len < 16 or score_len < 1:
        raise SystemExit("contexts must be >= 64, --prompt-len >= 16, --score-len >= 1.")
    pairs = args.retrieval_pairs
    if not 1 <= pairs <= data.max_pairs(min(contexts)):
        raise SystemExit(f"--retrieval-pairs must be between 1 and "
                         f"{data.max_pairs(min(contexts))} (what a {min(contexts)}-byte "
                         f"context holds), got {pairs}.")
    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    heldout = data.load_corpus("heldout")
    total = prompt_len + score_len
    seqs = np.stack([data.code_crop(rng, heldout, total) for _ in range(ppl_seqs)])
    seqs = seqs.astype(np.int32)
    examples = {}  # per query style: each model is asked the way it was trained to answer
    # One cache shape for every call of a configuration, and one prefill chunk (every
    # prompt fits it), so each configuration compiles few programs.
    chunk = -(-max(prompt_len, max(contexts)) // 8) * 8
    max_len = max(max(contexts), total) + 8
    wanted = [w.strip() for w in args.configs.split(",")] if args.configs else None
    t0 = time.time()
    rows = []
    for name in names:
        model, params = tiny.load_tiny(name)
        query = tiny.tiny_info(name).get("retrieval_query", "assert")
        if query not in examples:
            # Same seed for every style: the styles' prompts bury the same pairs in the same
            # filler and differ only in the question.
            qrng = np.random.default_rng([args.seed, 1])
            examples[query] = {L: [data.retrieval_example(qrng, heldout, L, num_pairs=pairs,
                                                          query=query)
                                   for _ in range(retrieval_n)] for L in contexts}
        configs = cache_configs(name, total, budgets)
        if wanted:
            configs = [c for c in configs if any(_matches(c.name, w) for w in wanted)]
        base_ppl = None
        for cc in tqdm(configs, desc=f"eval {name}"):
            cache = cc.build_cache(model, ppl_seqs, max_len)
            ppl, cache = _perplexity(model, params, cc, cache, seqs, prompt_len, chunk)
            base_ppl = ppl if base_ppl is None else base_ppl
            acc = {}
            for L in contexts:
                acc[L], cache = _retrieval(model, params, cc, cache, examples[query][L],
                                           ppl_seqs, chunk)
            pol = cc.policy
            kept = getattr(pol, "budget", None)
            if hasattr(pol, "n_sink"):
                kept = pol.n_sink + pol.window
            if type(pol).__name__ == "SnapKV":  # compresses the prompt only; decoding appends
                kept = pol.budget + score_len
            acct = kv_bytes_per_token(model, cc, total, page_size=cc.page_size,
                                      kept_tokens=kept)
            rows.append(dict(model=name, config=cc.name, ppl=ppl,
                             ppl_change_pct=100 * (ppl / base_ppl - 1),
                             retrieval={str(k): v for k, v in acc.items()},
                             retrieval_query=query,
                             retrieval_mean=float(np.mean(list(acc.values()))),
                             bytes_held=acct["held"], bytes_read=acct["read"]))
    elapsed = time.time() - t0
    settings = dict(quick=q, ppl_seqs=ppl_seqs, prompt_len=prompt_len, score_len=score_len,
                    contexts=contexts, retrieval_n=retrieval_n, retrieval_pairs=pairs,
                    budgets=budgets, seed=args.seed)
    return _report(rows, settings, elapsed, args.out)


def _merge(args) -> int:
    rows, settings, elapsed = [], None, 0.0
    for d in args.merge.split(","):
        with open(os.path.join(d.strip(), "eval.json")) as f:
            r = json.load(f)
        if settings is not None and r["settings"] != settings:
            raise SystemExit(f"--merge: {d} was run with other settings: {r['settings']} vs "
                             f"{settings}.")
        settings = r["settings"]
        rows += r["rows"]
        elapsed += r["seconds"]
    os.makedirs(args.out, exist_ok=True)
    return _report(rows, settings, elapsed, args.out)


def _report(rows, settings, elapsed, out) -> int:
    contexts = settings["contexts"]
    total = settings["prompt_len"] + settings["score_len"]
    not_run = combos_not_run(total, settings["budgets"])
    base = {r["model"]: r["ppl"] for r in rows if r["config"] == "bf16"}
    for r in rows:  # relative to the model's bf16 cache when that was run
        if r["model"] in base:
            r["ppl_change_pct"] = 100 * (r["ppl"] / base[r["model"]] - 1)
    hdr = (f"{'model':<5} {'cache':<22} {'ppl':>7} {'Δppl':>7} "
           + "".join(f"{'ret@' + str(L):>8}" for L in contexts)
           + f" {'B/tok held':>11} {'B/tok read':>11}")
    lines = [hdr, "-" * len(hdr)]
    for r in rows:
        lines.append(f"{r['model']:<5} {r['config']:<22} {r['ppl']:>7.3f} "
                     f"{r['ppl_change_pct']:>+6.2f}% "
                     + "".join(f"{r['retrieval'][str(L)]:>8.0%}" for L in contexts)
                     + f" {r['bytes_held']:>11.1f} {r['bytes_read']:>11.1f}")
    for note in not_run:
        lines.append(f"{'*':<5} {note}")
    machine = (f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} CPUs, "
               f"{platform.system()}, Python {platform.python_version()}").strip()
    table = "\n".join(lines)
    print(table)
    print(f"\n{settings['ppl_seqs']} held-out sequences: {settings['prompt_len']} bytes "
          f"prefilled + {settings['score_len']} scored while decoding; policy budgets are "
          f"fractions of {total} tokens at every context; retrieval: "
          f"{settings['retrieval_n']} prompts per context length, "
          f"{settings.get('retrieval_pairs', 2)} key/value line(s) each; machine: {machine}; "
          f"{elapsed:.0f}s")
    result = dict(settings=settings, machine=machine, seconds=elapsed, rows=rows,
                  not_run=not_run, table=table)
    with open(os.path.join(out, "eval.json"), "w") as f:
        json.dump(result, f, indent=1)
    png = _plot(rows, os.path.join(out, "eval.png"))
    print(f"wrote {os.path.join(out, 'eval.json')}" + (f" and {png}" if png else ""))
    return 0
