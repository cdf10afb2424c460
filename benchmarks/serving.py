"""Serving: the continuous-batching engine against static batches of `kvjax.generate`.

A trace of N requests arriving as a Poisson process: each prompt is a shared 512-token
system prompt plus a unique suffix of 32-256 tokens (log-uniform by default: short user
turns are the common case; `--suffix-dist uniform` for a flat draw), each asks for
16-256 new tokens (uniform), greedy, no EOS (every request produces exactly its
tokens, so both runs do the same useful work). The trace is replayed in real time on
the shipped GQA demo model:

  engine  `kvjax.serve.Engine` with `--rows` decoding rows, chunked prefill and prefix
          caching: requests join as they arrive, leave as they finish;
  static  `kvjax.generate` on consecutive batches of `--rows` requests in arrival
          order: a batch starts when its last request has arrived and the previous
          batch is done, and returns when its longest request is.

The two replays alternate `--repeats` times (engine, static, engine, static, ...), so
that both see the same load on a shared machine; the figures are medians over the
repeats, and the ratio is that of the median throughputs (each pair's own ratio is
listed too, with the load average when the pair started).

Reported per run: throughput (generated tokens / seconds from the first arrival to
the last token), time to first token and inter-token latency (median and p90; the
engine delivers several tokens at a time, and a token's latency is the gap since the
previous delivery divided by the tokens delivered; the static run's tokens arrive when
`generate` returns, so its first-token time is the batch's end and it has no
inter-token gaps), and for the engine the prefix hit rate (prompt pages served from
the cache / full prompt pages) and the prefill tokens saved. The work each run does is
counted: decode steps (and row-steps of the static batches, finished rows included),
prefill tokens computed (chunks are computed whole, padding included), engine calls;
and the time is split: engine calls that prefill a chunk vs decode-only calls vs
waiting for arrivals; with `--breakdown`, each static batch's prefill is timed too
(`generate` with one new token). Every repeat's tokens are compared request by
request (they must be identical), and compilation is excluded: the engine compiles
every program first (`Engine.warmup`, after a short warm-up trace unless --quick),
and the static run on a first untimed pass over the same batches.

    python benchmarks/serving.py                # 64 requests, 3 interleaved repeats
    python benchmarks/serving.py --rate 0       # all requests at once
    python benchmarks/serving.py --quick        # seconds: 8 requests, short prompts
    python benchmarks/serving.py --compare-xla  # GPU/TPU: TTFT with the kernels vs XLA
"""

import argparse
import datetime
import heapq
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

import kvjax.generate as gen  # noqa: E402
from benchmarks import result_path  # noqa: E402
from kvjax.attention import registry  # noqa: E402
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
    """Replays the trace in real time; returns tokens and per-token times per request, and
    where the time went (seconds in calls that prefilled a chunk, in decode-only calls,
    and waiting for arrivals with nothing to do)."""
    n = len(prompts)
    times = [[] for _ in range(n)]
    tokens = [[] for _ in range(n)]
    split = dict(prefill_calls_s=0.0, decode_calls_s=0.0, idle_s=0.0)
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
            split["idle_s"] += time.perf_counter() - t0 - now
            continue
        chunks = engine.stats["prefill_chunks"]
        outs = engine.step()
        t = time.perf_counter() - t0
        kind = "prefill_calls_s" if engine.stats["prefill_chunks"] > chunks else "decode_calls_s"
        split[kind] += t - now
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
    return tokens, times, split


def run_static(model, params, arrivals, prompts, max_new, rows, cache):
    """Consecutive batches of `rows` requests through `kvjax.generate`; also returns each
    batch's seconds."""
    n = len(prompts)
    tokens, times, batches = [None] * n, [None] * n, []
    t0 = time.perf_counter()
    for b in range(0, n, rows):
        idx = list(range(b, min(b + rows, n)))
        wait = arrivals[idx[-1]] - (time.perf_counter() - t0)
        if wait > 0:
            time.sleep(wait)
        start = time.perf_counter()
        res = gen.generate(model, params, [prompts[i] for i in idx], key=jax.random.key(0),
                           max_new_tokens=[max_new[i] for i in idx], cache=cache,
                           chunk_size=CHUNK)
        cache = res.cache  # the batch's rows are freed as they finish; the cache is reused
        t = time.perf_counter() - t0
        batches.append(time.perf_counter() - start)
        for j, i in enumerate(idx):
            tokens[i] = res.tokens[j, : res.num_generated[j]].tolist()
            times[i] = [t] * len(tokens[i])
    return tokens, times, batches


def engine_breakdown(engine, trace) -> dict:
    """One more replay with the engine's programs timed one by one (each blocked until
    ready, which costs a little overlap): seconds in its step programs (with and without a
    prefill chunk), in its bookkeeping programs (prefix forks, frees) with their syncs, and
    in host Python (scheduling, token delivery, dispatch)."""
    from kvjax.serve import steps

    names = ("step", "share", "release", "free")
    saved = {k: getattr(steps, k) for k in names}
    spent = {k: 0.0 for k in names}
    calls = []  # (lanes, decode steps run, seconds) per step program; read after the replay

    def timed(name):
        def run(*args, **kw):
            t = time.perf_counter()
            out = jax.block_until_ready(saved[name](*args, **kw))
            dt = time.perf_counter() - t
            spent[name] += dt
            if name == "step":
                calls.append((args[4], out[2], dt))
            return out
        return run

    for k in names:
        setattr(steps, k, timed(k))
    try:
        t0 = time.perf_counter()
        _, _, split = run_engine(engine, *trace)
        wall = time.perf_counter() - t0
    finally:
        for k, f in saved.items():
            setattr(steps, k, f)
    calls = [(0 if lanes is None else int(np.sum(np.asarray(lanes.lengths) > 0)), int(ran), dt)
             for lanes, ran, dt in calls]
    device = sum(spent.values())
    lane_s, step_s = call_costs(calls)
    return dict(wall_s=wall, idle_s=split["idle_s"], lane_s=lane_s, step_s=step_s,
                prefill_programs_s=sum(dt for lanes, _, dt in calls if lanes),
                decode_programs_s=sum(dt for lanes, _, dt in calls if not lanes),
                bookkeeping_s=device - spent["step"], host_s=wall - split["idle_s"] - device,
                calls=len(calls), prefill_calls=sum(1 for lanes, _, _ in calls if lanes),
                decode_steps=sum(k for _, k, _ in calls),
                prefill_chunks=sum(lanes for lanes, _, _ in calls))


def static_prefill_s(model, params, prompts, rows, cache) -> float:
    """Seconds the static batches spend in prefill: each batch through `generate` with one
    new token (prefill and that token's sampling), after an untimed pass that compiles."""
    total = 0.0
    for timed in (False, True):
        for b in range(0, len(prompts), rows):
            batch = prompts[b: b + rows]
            start = time.perf_counter()
            res = gen.generate(model, params, batch, key=jax.random.key(0), max_new_tokens=1,
                               cache=cache, chunk_size=CHUNK)
            jax.block_until_ready(res.tokens)
            cache = res.cache
            if timed:
                total += time.perf_counter() - start
    return total


def static_work(prompts, max_new, rows) -> dict:
    """What the static batches compute: decode steps (each batch runs until its longest
    request is done), row-steps (finished rows included) and prefill tokens (each
    batch's prompts padded to whole chunks of its longest)."""
    steps = row_steps = prefill = 0
    for b in range(0, len(prompts), rows):
        longest = max(max_new[b: b + rows])
        width = -(-max(len(p) for p in prompts[b: b + rows]) // CHUNK) * CHUNK
        steps += longest
        row_steps += longest * len(prompts[b: b + rows])
        prefill += width * len(prompts[b: b + rows])
    return dict(decode_steps=steps, row_steps=row_steps, prefill_tokens=prefill)


def fcfs_decode_steps(max_new, rows: int) -> int:
    """Decode steps that first-come first-served rows need for these requests when every
    request waits from the start and prefill takes no step: each holds the row that frees
    first for its tokens after the first (which its prefill samples)."""
    free = [0] * rows
    for n in max_new:
        heapq.heappush(free, heapq.heappop(free) + max(n - 1, 0))
    return max(free)


def call_costs(calls) -> tuple[float, float]:
    """Seconds per prefill lane and per decode step of the engine's step programs: the
    least-squares fit of each program's time to its (lanes, decode steps)."""
    a = np.array([(lanes, steps) for lanes, steps, _ in calls], float)
    t = np.array([dt for _, _, dt in calls], float)
    (lane, step), *_ = np.linalg.lstsq(a, t, rcond=None)
    return float(lane), float(step)


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
    parser.add_argument("--quick", action="store_true", help="8 short requests, one repeat")
    parser.add_argument("--requests", type=int, default=None, help="trace length (default 64)")
    parser.add_argument("--rows", type=int, default=8,
                        help="rows decoding together, and the static batch size (default 8)")
    parser.add_argument("--rate", type=float, default=None,
                        help="mean arrivals per second (default 64: more than either run "
                             "serves on a 2-core CPU, so throughput is the machine's, not the "
                             "trace's; 0: all at once)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="engine / static replays, alternating (default 3; --quick 1)")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time the static batches' prefill (generate with one new "
                             "token per batch, after a pass that compiles those shapes)")
    parser.add_argument("--suffix-dist", choices=("loguniform", "uniform"), default="loguniform",
                        help="how unique suffix lengths are drawn (default loguniform)")
    parser.add_argument("--prefill-rows", type=int, default=None,
                        help="prompts the engine prefills per step (default 4; --quick 1)")
    parser.add_argument("--kv-dtype", default="float32", help="cache dtype (default float32)")
    parser.add_argument("--compare-xla", action="store_true",
                        help="also replay the engine with impl='xla' in each repeat (on a GPU or "
                             "TPU: time to first token with the attention kernels against the "
                             "XLA path, same trace, same process)")
    parser.add_argument("--seed", type=int, default=None, help="trace seed (default random)")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/)")
    args = parser.parse_args(argv)
    n = args.requests or (8 if args.quick else 64)
    repeats = args.repeats or (1 if args.quick else 3)
    if n < 2 or args.rows < 1 or repeats < 1:
        parser.error(f"--requests must be >= 2, --rows and --repeats >= 1, got {n}, "
                     f"{args.rows}, {repeats}")
    rate = 64.0 if args.rate is None else args.rate
    if rate < 0:
        parser.error(f"--rate must be >= 0, got {rate}")
    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**31)
    system, suffix, new = (128, (8, 64), (4, 32)) if args.quick else (512, (32, 256), (16, 256))
    max_len = system + suffix[1] + new[1]
    prefill_rows = args.prefill_rows or (1 if args.quick else 4)  # quick: fewer compiles

    mach = machine()
    print(f"{mach['cpu']}, {mach['cpus']} cpus, load average {os.getloadavg()[0]:.1f}; seed "
          f"{seed}; {n} requests at {rate}/s; system prompt {system}, suffixes "
          f"{suffix[0]}-{suffix[1]} ({args.suffix_dist}), new tokens {new[0]}-{new[1]}; "
          f"{repeats} repeats")
    model, params = load_tiny("gqa")
    cfg = gen.CacheConfig(dtype=args.kv_dtype, page_size=16)
    rng = np.random.default_rng(seed)
    trace = make_trace(rng, n, system=system, suffix=suffix, new=new, rate=rate,
                       vocab=model.vocab_size, dist=args.suffix_dist)
    arrivals, prompts, max_new = trace
    warm = make_trace(np.random.default_rng(seed + 1), min(n, 2 * args.rows), system=system,
                      suffix=suffix, new=(2, 4), rate=0, vocab=model.vocab_size,
                      dist=args.suffix_dist)

    def new_engine(impl="auto"):
        return Engine(model, params, max_seqs=args.rows, max_seq_len=max_len, chunk_size=CHUNK,
                      cache=cfg, prefill_rows=prefill_rows, impl=impl)

    if not args.quick:  # first calls (allocations, caches) outside the timing
        run_engine(new_engine(), *warm)
    # Each batch's shapes (prompt width, token buffer) compile once: a first pass over the
    # trace, untimed and without waiting for arrivals, compiles them all.
    run_static(model, params, [0.0] * n, prompts, max_new, args.rows,
               cfg.build(model, num_seqs=args.rows, max_tokens=max_len))

    produced = sum(max_new)
    pairs, same_all, engine = [], True, None
    for r in range(repeats):
        load = os.getloadavg()[0]
        engine = new_engine()  # an empty prefix cache: the trace's first request misses
        engine.warmup()  # compiles every program the engine may run
        e_tokens, e_times, e_split = run_engine(engine, *trace)
        engine.check()
        s_tokens, s_times, s_batches = run_static(
            model, params, *trace, args.rows, cfg.build(model, num_seqs=args.rows,
                                                         max_tokens=max_len))
        same = sum(a == b for a, b in zip(e_tokens, s_tokens, strict=True))
        same_all &= same == n and all(len(t) == m for t, m in zip(e_tokens, max_new,
                                                                   strict=True))
        e = dict(tokens_per_s=0.0, **latency(arrivals, e_times, streamed=True), **e_split,
                 stats=dict(engine.stats))
        s = dict(tokens_per_s=0.0, **latency(arrivals, s_times, streamed=False),
                 batch_s=s_batches)
        for x in (e, s):
            x["tokens_per_s"] = produced / x["makespan_s"]
        pairs.append(dict(load_average=load, engine=e, static=s, identical=same,
                          speedup=e["tokens_per_s"] / s["tokens_per_s"]))
        if args.compare_xla:  # the same replay, every attention op on the XLA path
            x_engine = new_engine("xla")
            x_engine.warmup()
            x_tokens, x_times, x_split = run_engine(x_engine, *trace)
            x_engine.check()
            x = dict(**latency(arrivals, x_times, streamed=True), **x_split)
            x["tokens_per_s"] = produced / x["makespan_s"]
            pairs[-1]["engine_xla"] = x
            # Kernels and XLA sum in other orders: greedy tokens may part at near-ties.
            pairs[-1]["identical_xla"] = sum(a == b for a, b in zip(e_tokens, x_tokens,
                                                                    strict=True))
        print(f"repeat {r + 1}/{repeats} (load {load:.1f}): engine {e['tokens_per_s']:.0f} "
              f"tokens/s, static {s['tokens_per_s']:.0f}, ratio {pairs[-1]['speedup']:.2f}; "
              f"tokens identical {same}/{n}", flush=True)

    def median(side, key):
        vals = [p[side][key] for p in pairs]
        return None if any(v is None for v in vals) else float(np.median(vals))

    keys = ("tokens_per_s", "ttft_median_s", "ttft_p90_s", "itl_median_ms", "itl_p90_ms",
            "makespan_s")
    sides = ("engine", "static") + (("engine_xla",) if args.compare_xla else ())
    rows = {side: {k: median(side, k) for k in keys} for side in sides}
    speedup = rows["engine"]["tokens_per_s"] / rows["static"]["tokens_per_s"]
    stats = engine.stats  # the last repeat's (the schedule depends on timing a little)
    ps = cfg.page_size
    prompt_pages = sum(len(p) // ps for p in prompts)
    hit = stats["hit_pages"]
    work = dict(
        engine=dict(decode_steps=stats["steps"], calls=stats["calls"],
                    prefill_chunks=stats["prefill_chunks"],
                    prefill_tokens=stats["prefill_chunks"] * CHUNK,
                    prompt_tokens_prefilled=stats["prefill_tokens"],
                    **{k: median("engine", k) for k in ("prefill_calls_s", "decode_calls_s",
                                                        "idle_s")}),
        static=dict(static_work(prompts, max_new, args.rows),
                    batches_s=float(np.median([sum(p["static"]["batch_s"]) for p in pairs]))),
        generated_tokens=produced)
    if args.breakdown:
        work["static"]["prefill_s"] = static_prefill_s(
            model, params, prompts, args.rows,
            cfg.build(model, num_seqs=args.rows, max_tokens=max_len))
        work["static"]["decode_s"] = work["static"]["batches_s"] - work["static"]["prefill_s"]
        engine = new_engine()
        engine.warmup()
        b = work["engine_breakdown"] = engine_breakdown(engine, trace)
        # The ratio were the engine's host Python hidden (its share of the engine's busy
        # time in the timed replay: less sensitive to the load than that replay's seconds).
        work["host_share"] = b["host_s"] / (b["wall_s"] - b["idle_s"])
        work["ratio_without_host"] = speedup / (1 - work["host_share"])
        # The work's own ceiling: the engine's lanes and the fewest decode steps rows can
        # take at the fitted costs, no host time, no wait, against the static batches.
        work["fcfs_decode_steps"] = fcfs_decode_steps(max_new, args.rows)
        work["ratio_ceiling"] = work["static"]["batches_s"] / (
            b["lane_s"] * b["prefill_chunks"] + b["step_s"] * work["fcfs_decode_steps"])

    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    print(f"\nmedians of {repeats} interleaved repeats:\n")
    print("| run | tokens/s | TTFT median / p90 (s) | ITL median / p90 (ms) | makespan (s) |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['tokens_per_s']:.0f} | {f(r['ttft_median_s'], '.2f')} / "
              f"{f(r['ttft_p90_s'], '.2f')} | {f(r['itl_median_ms'], '.1f')} / "
              f"{f(r['itl_p90_ms'], '.1f')} | {r['makespan_s']:.2f} |")
    ratios = [p["speedup"] for p in pairs]
    same = min(p["identical"] for p in pairs)
    print(f"\nengine / static throughput: {speedup:.2f}x (pairs {min(ratios):.2f}-"
          f"{max(ratios):.2f}); prefix hits: {hit} of {prompt_pages} prompt pages "
          f"({hit / prompt_pages:.0%}), {hit * ps} prefill tokens saved; "
          f"{stats['preemptions']} preemptions, {stats['evictions']} evictions; tokens "
          f"identical: {same}/{n} in every repeat")
    if args.compare_xla:
        ex = rows["engine_xla"]
        print(f"time to first token p50 / p90: engine {rows['engine']['ttft_median_s']:.3f} / "
              f"{rows['engine']['ttft_p90_s']:.3f} s (impl auto: "
              f"{registry.auto_impl('paged_prefill_attention')} prefill) against "
              f"{ex['ttft_median_s']:.3f} / {ex['ttft_p90_s']:.3f} s on the XLA path "
              f"({ex['ttft_p90_s'] / rows['engine']['ttft_p90_s']:.2f}x at p90); tokens "
              f"identical to the XLA path's: {min(p['identical_xla'] for p in pairs)}/{n}")
    we, ws = work["engine"], work["static"]
    print(f"work: engine {we['decode_steps']} decode steps in {we['calls']} calls, "
          f"{we['prefill_chunks']} prefill chunks ({we['prefill_tokens']} tokens); static "
          f"{ws['decode_steps']} decode steps ({ws['row_steps']} row-steps for {produced} "
          f"tokens), {ws['prefill_tokens']} prefill tokens")
    print(f"time: engine {we['prefill_calls_s']:.2f} s in calls with a prefill chunk, "
          f"{we['decode_calls_s']:.2f} s in decode-only calls, {we['idle_s']:.2f} s waiting "
          f"for arrivals; static {ws['batches_s']:.2f} s in batches"
          + (f" ({ws['prefill_s']:.2f} s prefill, {ws['decode_s']:.2f} s decode)"
             if args.breakdown else ""))
    if args.breakdown:
        b = work["engine_breakdown"]
        print(f"engine, programs timed one by one: {b['wall_s']:.2f} s = "
              f"{b['prefill_programs_s']:.2f} s in {b['prefill_calls']} step programs with "
              f"prefill chunks ({b['prefill_chunks']} chunks) + {b['decode_programs_s']:.2f} s "
              f"in {b['calls'] - b['prefill_calls']} decode-only ones ({b['decode_steps']} decode "
              f"steps in all) + {b['bookkeeping_s']:.2f} s bookkeeping programs and syncs + "
              f"{b['host_s']:.2f} s "
              f"host Python + {b['idle_s']:.2f} s waiting for arrivals; without its host share "
              f"({work['host_share']:.0%}) the engine would run {work['ratio_without_host']:.2f}x "
              f"static")
        print(f"work ceiling: a prefill lane costs {1e3 * b['lane_s']:.1f} ms and a decode "
              f"step {1e3 * b['step_s']:.2f} ms (fitted to the {b['calls']} step programs); "
              f"{b['prefill_chunks']} lanes and the {work['fcfs_decode_steps']} decode steps "
              f"that first-come first-served rows need at least, with no host time, would run "
              f"{work['ratio_ceiling']:.2f}x static")
    result = dict(
        benchmark="serving", machine=mach, seed=seed, requests=n, rate=rate, rows=args.rows,
        chunk=CHUNK, system=system, suffix=list(suffix), suffix_dist=args.suffix_dist,
        new_tokens=list(new), kv_dtype=args.kv_dtype, generated_tokens=produced,
        repeats=repeats, runs=rows, speedup=speedup, speedups=ratios,
        load_averages=[p["load_average"] for p in pairs], pairs=pairs, work=work,
        hit_pages=hit, prompt_pages=prompt_pages, hit_rate=hit / prompt_pages,
        prefill_tokens_saved=hit * ps, engine_stats=dict(stats), identical=same, ok=same_all,
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
    out = result_path(f"serving-{'quick-' if args.quick else ''}", args.out)
    with open(out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"wrote {out}")
    if not same_all:
        print(f"FAILED: requests' tokens differ between the engine and generate "
              f"({same}/{n} identical in the worst repeat)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
