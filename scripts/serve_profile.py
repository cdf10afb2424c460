"""Where `python -m kvjax serve`'s time goes on the vLLM peer's burst trace, in process.

Builds the engine exactly as the server does for `benchmarks/serving.py --peer-vllm`
(the random 56M Llama, `--max-seqs 32 --max-seq-len 2048`, chunks of 64, pages of 16,
prefix caching, no EOS) and replays the burst (32 requests at once sharing a 512-token
prefix plus 32-256 own tokens, 16-256 new), or with --rate the Poisson trace, without HTTP:

  1. plain: tokens/s and time to first token of the engine alone (the server's HTTP,
     detokenization and event loop are what the peer run adds to this);
  2. timed: every step program blocked until ready and timed (`engine_breakdown`): the
     seconds in step programs with a prefill chunk and without, in bookkeeping programs,
     in host Python; the least-squares cost of a prefill lane and of a decode step;
     decode steps and tokens delivered per call;
  3. with `--ops`: the same replay under `jax.profiler.trace`, XLA:CPU's per-thunk
     events summed by HLO op and mapped to the jax operation and source line that
     made them (from the compiled module's metadata), largest first.

    python scripts/serve_profile.py                    # float32
    python scripts/serve_profile.py --dtype bfloat16 --ops
"""

import argparse
import collections
import glob
import json
import os
import re
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _ops_table(trace_dir: str, dump_dir: str, top: int) -> tuple[list[dict], float]:
    """Seconds and calls of XLA:CPU's thunks in the profile, summed per jax operation (the
    `op_name` the optimized module's metadata gives the thunk's HLO instruction; thunks are
    named per module, so each event's module id picks the module's dump), largest first."""
    from jax._src.lib import _profile_data

    meta = {}  # (module id, instruction) -> op_name
    pat = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?op_name=\"([^\"]*)\"")
    for path in glob.glob(os.path.join(dump_dir, "module_*after_optimizations.txt")):
        module = int(os.path.basename(path).split(".")[0].split("_")[1])
        for line in open(path):
            m = pat.match(line)
            if m:
                meta[module, m.group(1)] = m.group(2)
    spent = collections.defaultdict(float)
    count = collections.Counter()
    for pb in glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True):
        for plane in _profile_data.ProfileData.from_file(pb).planes:
            for line in plane.lines:
                for e in line.events:
                    stats = dict(e.stats)
                    if "hlo_op" not in stats:
                        continue
                    op = meta.get((stats.get("program_id"), stats["hlo_op"]),
                                  f"{stats.get('hlo_module')}/{stats['hlo_op']}")
                    # The jit nesting names the phase: prefill, the decode loop, bookkeeping.
                    op = re.sub(r"jit\(main\)/|closed_call/|body/|cond/|branch_\d+_fun/", "", op)
                    spent[op] += e.duration_ns / 1e9
                    count[op] += 1
    rows = [dict(op=op, seconds=s, calls=count[op])
            for op, s in sorted(spent.items(), key=lambda kv: -kv[1])]
    return rows[:top], sum(spent.values())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--decode-steps", type=int, default=1,
                        help="Engine decode_steps (default 1, as `kvjax serve`'s --decode-steps): "
                             "decode steps per call while a row is free, the tokens per streamed "
                             "chunk")
    parser.add_argument("--max-decode-steps", type=int, default=None,
                        help="Engine max_decode_steps (default --decode-steps, as the server "
                             "sets it)")
    parser.add_argument("--prefill-rows", type=int, default=16,
                        help="Engine prefill_rows (default the server's --prefill-lanes, 16)")
    parser.add_argument("--prefill-tokens", type=int, default=1024,
                        help="prompt tokens per call: Engine token_budget is the rows plus "
                        "these (default the server's --prefill-tokens, 1024)")
    parser.add_argument("--chunk", type=int, default=64, help="prefill chunk (default 64)")
    parser.add_argument("--rate", type=float, default=None,
                        help="replay the peer run's Poisson trace at this many requests per "
                             "second (log-normal prompts and outputs) instead of the burst")
    parser.add_argument("--no-timed", action="store_true", help="skip the timed replay")
    parser.add_argument("--ops", action="store_true",
                        help="also profile one replay op by op (XLA:CPU thunk events)")
    parser.add_argument("--top", type=int, default=25, help="ops listed (default 25)")
    parser.add_argument("--out", default=None, help="JSON path (default: none)")
    args = parser.parse_args(argv)

    work = tempfile.mkdtemp(prefix="kvjax-serve-profile-")
    dump = os.path.join(work, "hlo")
    if args.ops:  # before jax starts: the optimized modules name every thunk's op
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}"
                                   " --xla_dump_hlo_as_text").strip()
    import jax

    import kvjax.models as models
    from benchmarks import serving
    from kvjax.generate import CacheConfig
    from kvjax.serve import Engine

    try:
        ckpt = os.path.join(work, "llama-56m")
        serving.save_peer_checkpoint(ckpt, args.seed)
        model, params = models.load(ckpt, dtype=args.dtype)
        engine_args = dict(max_seqs=serving.PEER_MAX_SEQS, max_seq_len=serving.PEER_MAX_LEN,
                           cache=CacheConfig(dtype=args.dtype, page_size=16),
                           chunk_size=args.chunk, prefix_caching=True, eos_ids=[],
                           token_budget=serving.PEER_MAX_SEQS + args.prefill_tokens)
        if args.max_decode_steps is None:
            args.max_decode_steps = args.decode_steps
        for k in ("decode_steps", "max_decode_steps", "prefill_rows"):
            if getattr(args, k) is not None:
                engine_args[k] = getattr(args, k)

        def fresh():
            e = Engine(model, params, **engine_args)
            e.warmup()
            return e

        class TraceArgs:
            requests, suffix_dist = args.requests, "loguniform"
            peer_rates = [] if args.rate is None else [args.rate]

        def trace_for(seed):
            traces = serving.peer_traces(seed, TraceArgs)
            return traces["burst" if args.rate is None else f"poisson {args.rate:g}/s"]

        t = time.perf_counter()
        engine = fresh()
        print(f"{args.dtype}: engine built and compiled in {time.perf_counter() - t:.1f} s; "
              f"load average {os.getloadavg()[0]:.1f}", flush=True)
        serving.run_engine(engine, *trace_for(args.seed + 100))  # first calls, untimed
        result = dict(dtype=args.dtype, machine=serving.machine(), jax=jax.__version__,
                      engine={k: v for k, v in engine_args.items() if k != "cache"})

        engine = fresh()
        trace = trace_for(args.seed)
        t0 = time.perf_counter()
        tokens, times, split = serving.run_engine(engine, *trace)
        wall = time.perf_counter() - t0
        lat = serving.latency(trace[0], times, streamed=True)
        produced = sum(len(x) for x in tokens)
        plain = dict(wall_s=wall, tokens=produced, tokens_per_s=produced / lat["makespan_s"],
                     **lat, **split, stats=dict(engine.stats))
        result["plain"] = plain
        st = engine.stats
        print(f"plain replay: {produced} tokens in {lat['makespan_s']:.2f} s = "
              f"{plain['tokens_per_s']:.0f} tokens/s; TTFT p50 {lat['ttft_median_s']:.2f} s, "
              f"p90 {lat['ttft_p90_s']:.2f} s; {st['calls']} calls, {st['steps']} decode "
              f"steps, {st['prefill_chunks']} prefill chunks; {split['prefill_calls_s']:.2f} s "
              f"in calls with a chunk, {split['decode_calls_s']:.2f} s in decode-only calls",
              flush=True)

        if not args.no_timed:
            engine = fresh()
            b = serving.engine_breakdown(engine, trace)
            result["timed"] = b
            busy = b["wall_s"] - b["idle_s"]
            print(f"timed replay: {b['wall_s']:.2f} s = {b['prefill_programs_s']:.2f} s in "
                  f"{b['prefill_calls']} step programs with a chunk ({b['prefill_chunks']} "
                  f"lanes) + {b['decode_programs_s']:.2f} s in "
                  f"{b['calls'] - b['prefill_calls']} decode-only ones + "
                  f"{b['bookkeeping_s']:.2f} s bookkeeping programs + {b['host_s']:.2f} s "
                  f"host Python ({b['host_s'] / busy:.0%}); fitted: a prefill lane "
                  f"{1e3 * b['lane_s']:.1f} ms, a decode step {1e3 * b['step_s']:.1f} ms "
                  f"({b['decode_steps']} decode steps)", flush=True)

        if args.ops:
            engine = fresh()
            tdir = os.path.join(work, "trace")
            t0 = time.perf_counter()
            with jax.profiler.trace(tdir):
                serving.run_engine(engine, *trace)
            result["ops_wall_s"] = wall = time.perf_counter() - t0
            rows, total = _ops_table(tdir, dump, args.top)
            result["ops_total_s"] = total
            result["ops"] = rows
            print(f"\nXLA:CPU thunks: {total:.2f} s in a {wall:.2f} s replay; per jax op, the "
                  f"{len(rows)} largest:")
            for r in rows:
                print(f"{r['seconds']:7.2f} s {r['calls']:6d}x  {r['op']}")
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(result, fh, indent=1, default=str)
            print(f"wrote {args.out}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
