"""Serving: the continuous-batching engine against static batches of `kvjax.generate`.

A trace of N requests arriving as a Poisson process: each prompt is a shared 512-token
system prompt plus a unique suffix of 32-256 tokens (log-uniform by default: short user
turns are the common case; `--suffix-dist uniform` for a flat draw), each asks for
16-256 new tokens (uniform), greedy, no EOS (every request produces exactly its
tokens, so both runs do the same useful work). The trace is replayed in real time
twice on the shipped GQA demo model:

  engine  `kvjax.serve.Engine` with `--rows` decoding rows, chunked prefill and prefix
          caching: requests join as they arrive, leave as they finish;
  static  `kvjax.generate` on consecutive batches of `--rows` requests in arrival
          order: a batch starts when its last request has arrived and the previous
          batch is done, and returns when its longest request is.

Reported per run: throughput (generated tokens / seconds from the first arrival to
the last token), time to first token and inter-token latency (median and p90; the
engine delivers up to `decode_steps` tokens at a time, and a token's latency is the
gap since the previous delivery divided by the tokens delivered; the static run's
tokens arrive when `generate` returns, so its first-token time is the batch's end and
it has no inter-token gaps), and for the engine the prefix hit rate
(prompt pages served from the cache / full prompt pages) and the prefill tokens
saved. Both runs' tokens are compared request by request (they must be identical),
and compilation is excluded: the engine compiles every program first (`Engine.warmup`,
after a short warm-up trace unless --quick), and the static
run on a first untimed pass over the same batches (each batch's shapes compile once).

    python benchmarks/serving.py                # 64 requests
    python benchmarks/serving.py --quick        # seconds: 8 requests, short prompts
"""

import argparse
import datetime
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

import kvjax.generate as gen  # noqa: E402
from kvjax.models.tiny import load_tiny  # noqa: E402
from kvjax.serve import Engine  # noqa: E402


def machine() -> dict:
    from benchmarks.kv_bits import machine as kv_machine

    return kv_machine()


def make_trace(rng, n, *, system, suffix, new, rate, vocab, dist):
    """Arrival times (s), prompts and max_tokens of n requests."""
    sys_prompt = rng.integers(0, vocab, system).tolist()
    lo, hi = suffix
    if dist == "uniform":
        lens = rng.integers(lo, hi + 1, n)
    else:
        lens = np.exp(rng.uniform(np.log(lo), np.log(hi + 1), n)).astype(int)
    prompts = [sys_prompt + rng.integers(0, vocab, int(k)).tolist() for k in lens]
    max_new = [int(k) for k in rng.integers(new[0], new[1] + 1, n)]
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n)) if rate > 0 else np.zeros(n)
    arrivals -= arrivals[0]
    return arrivals.tolist(), prompts, max_new


def run_engine(engine, arrivals, prompts, max_new):
    """Replays the trace in real time; returns tokens and per-token times per request."""
    n = len(prompts)
    times = [[] for _ in range(n)]
    tokens = [[] for _ in range(n)]
    index = {}
    nxt = 0
    t0 = time.perf_counter()
    while nxt < n or engine.has_unfinished():
        now = time.perf_counter() - t0
        while nxt < n and arrivals[nxt] <= now:
            index[engine.add_request(prompts[nxt], max_tokens=max_new[nxt])] = nxt
            nxt += 1
        if not engine.has_unfinished():
            time.sleep(max(arrivals[nxt] - now, 0))
            continue
        outs = engine.step()
        t = time.perf_counter() - t0
        for o in outs:
            i = index[o.request_id]
            k = len(o.token_ids)
            if not k:
                continue
            # Tokens delivered together share the gap since the previous delivery: one
            # token's latency is that gap / k (the first token's is its arrival time).
            prev = times[i][-1] if times[i] else None
            tokens[i].extend(o.token_ids)
            if prev is None:
                times[i].extend([t] + [t] * (k - 1))
            else:
                times[i].extend(prev + (t - prev) * np.arange(1, k + 1) / k)
    return tokens, times


def run_static(model, params, arrivals, prompts, max_new, rows, cache):
    """Consecutive batches of `rows` requests through `kvjax.generate`."""
    n = len(prompts)
    tokens, times = [None] * n, [None] * n
    t0 = time.perf_counter()
    for b in range(0, n, rows):
        idx = list(range(b, min(b + rows, n)))
        wait = arrivals[idx[-1]] - (time.perf_counter() - t0)
        if wait > 0:
            time.sleep(wait)
        res = gen.generate(model, params, [prompts[i] for i in idx], key=jax.random.key(0),
                           max_new_tokens=[max_new[i] for i in idx], cache=cache,
                           chunk_size=CHUNK)
        cache = res.cache  # the batch's rows are freed as they finish; the cache is reused
        t = time.perf_counter() - t0
        for j, i in enumerate(idx):
            tokens[i] = res.tokens[j, : res.num_generated[j]].tolist()
            times[i] = [t] * len(tokens[i])
    return tokens, times


def latency(arrivals, times, *, streamed: bool) -> dict:
    ttft = np.array([ts[0] - a for a, ts in zip(arrivals, times, strict=True)])
    gaps = np.concatenate([np.diff(ts) for ts in times]) if streamed else np.zeros(0)
    end = max(ts[-1] for ts in times)

    def q(x, p):
        return float(np.percentile(x, p)) if x.size else None

    return dict(ttft_median_s=q(ttft, 50), ttft_p90_s=q(ttft, 90),
                itl_median_ms=None if not gaps.size else 1e3 * q(gaps, 50),
                itl_p90_ms=None if not gaps.size else 1e3 * q(gaps, 90), makespan_s=end)


CHUNK = 128


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--quick", action="store_true", help="8 short requests")
    parser.add_argument("--requests", type=int, default=None, help="trace length (default 64)")
    parser.add_argument("--rows", type=int, default=8,
                        help="rows decoding together, and the static batch size (default 8)")
    parser.add_argument("--rate", type=float, default=None,
                        help="mean arrivals per second (default 64: more than either run "
                             "serves on a 2-core CPU, so throughput is the machine's, not the "
                             "trace's; 0: all at once)")
    parser.add_argument("--suffix-dist", choices=("loguniform", "uniform"), default="loguniform",
                        help="how unique suffix lengths are drawn (default loguniform)")
    parser.add_argument("--prefill-rows", type=int, default=None,
                        help="prompts the engine prefills per step (default 4; --quick 1)")
    parser.add_argument("--kv-dtype", default="float32", help="cache dtype (default float32)")
    parser.add_argument("--seed", type=int, default=None, help="trace seed (default random)")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/)")
    args = parser.parse_args(argv)
    n = args.requests or (8 if args.quick else 64)
    if n < 2 or args.rows < 1:
        parser.error(f"--requests must be >= 2 and --rows >= 1, got {n}, {args.rows}")
    rate = 64.0 if args.rate is None else args.rate
    if rate < 0:
        parser.error(f"--rate must be >= 0, got {rate}")
    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**31)
    system, suffix, new = (128, (8, 64), (4, 32)) if args.quick else (512, (32, 256), (16, 256))
    max_len = system + suffix[1] + new[1]
    prefill_rows = args.prefill_rows or (1 if args.quick else 4)  # quick: fewer compiles

    mach = machine()
    print(f"{mach['cpu']}, {mach['cpus']} cpus; seed {seed}; {n} requests at {rate}/s; "
          f"system prompt {system}, suffixes {suffix[0]}-{suffix[1]} ({args.suffix_dist}), "
          f"new tokens {new[0]}-{new[1]}")
    model, params = load_tiny("gqa")
    cfg = gen.CacheConfig(dtype=args.kv_dtype, page_size=16)
    rng = np.random.default_rng(seed)
    trace = make_trace(rng, n, system=system, suffix=suffix, new=new, rate=rate,
                       vocab=model.vocab_size, dist=args.suffix_dist)
    warm = make_trace(np.random.default_rng(seed + 1), min(n, 2 * args.rows), system=system,
                      suffix=suffix, new=(2, 4), rate=0, vocab=model.vocab_size,
                      dist=args.suffix_dist)

    def new_engine():
        return Engine(model, params, max_seqs=args.rows, max_seq_len=max_len, chunk_size=CHUNK,
                      cache=cfg, prefill_rows=prefill_rows)

    if not args.quick:  # first calls (allocations, caches) outside the timing
        run_engine(new_engine(), *warm)
    engine = new_engine()  # an empty prefix cache: the trace's first request misses
    engine.warmup()  # compiles every program the engine may run
    t0 = time.perf_counter()
    e_tokens, e_times = run_engine(engine, *trace)
    e_wall = time.perf_counter() - t0
    engine.check()

    static_cache = cfg.build(model, num_seqs=args.rows, max_tokens=max_len)
    # Each batch's shapes (prompt width, token buffer) compile once: a first pass over the
    # trace, untimed and without waiting for arrivals, compiles them all.
    run_static(model, params, [0.0] * n, *trace[1:], args.rows, static_cache)
    static_cache = cfg.build(model, num_seqs=args.rows, max_tokens=max_len)
    s_tokens, s_times = run_static(model, params, *trace, args.rows, static_cache)

    arrivals, prompts, max_new = trace
    same = sum(a == b for a, b in zip(e_tokens, s_tokens, strict=True))
    produced = sum(max_new)
    ok = same == n and all(len(t) == m for t, m in zip(e_tokens, max_new, strict=True))
    ps = cfg.page_size
    prompt_pages = sum(len(p) // ps for p in prompts)
    hit = engine.stats["hit_pages"]
    e_lat = latency(arrivals, e_times, streamed=True)
    s_lat = latency(arrivals, s_times, streamed=False)
    rows = {
        "engine": dict(tokens_per_s=produced / e_lat["makespan_s"], **e_lat),
        "static": dict(tokens_per_s=produced / s_lat["makespan_s"], **s_lat),
    }
    speedup = rows["engine"]["tokens_per_s"] / rows["static"]["tokens_per_s"]

    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    print("\n| run | tokens/s | TTFT median / p90 (s) | ITL median / p90 (ms) | makespan (s) |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['tokens_per_s']:.0f} | {f(r['ttft_median_s'], '.2f')} / "
              f"{f(r['ttft_p90_s'], '.2f')} | {f(r['itl_median_ms'], '.1f')} / "
              f"{f(r['itl_p90_ms'], '.1f')} | {r['makespan_s']:.1f} |")
    print(f"\nengine / static throughput: {speedup:.2f}x; prefix hits: {hit} of {prompt_pages} "
          f"prompt pages ({hit / prompt_pages:.0%}), {hit * ps} prefill tokens saved; "
          f"{engine.stats['steps']} steps, {engine.stats['preemptions']} preemptions, "
          f"{engine.stats['evictions']} evictions; tokens identical: {same}/{n}")
    result = dict(
        benchmark="serving", machine=mach, seed=seed, requests=n, rate=rate, rows=args.rows,
        chunk=CHUNK, system=system, suffix=list(suffix), suffix_dist=args.suffix_dist,
        new_tokens=list(new), kv_dtype=args.kv_dtype, generated_tokens=produced,
        runs=rows, speedup=speedup, hit_pages=hit, prompt_pages=prompt_pages,
        hit_rate=hit / prompt_pages, prefill_tokens_saved=hit * ps,
        engine_stats=dict(engine.stats), engine_wall_s=e_wall, identical=same, ok=ok,
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
    out = args.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results",
        f"serving-{'quick-' if args.quick else ''}"
        f"{datetime.datetime.now(datetime.UTC).strftime('%Y%m%dT%H%M%SZ')}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"wrote {out}")
    if not ok:
        print(f"FAILED: {n - same} requests' tokens differ between the engine and generate")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
