"""The checks to run on a lent accelerator, in one command within a time budget.

Each part runs in its own process with its own time limit; its output goes to
OUT/<part>.log, and OUT/device_check.json plus a table on stdout say how each ended (exit
status, seconds, pytest's summary line or the script's last lines). A part that would not
finish within what is left of `--budget` is skipped and listed. The exit status is 1 when
a part failed or timed out.

Parts, in order:

  gqa      benchmarks/pallas_kernels.py --targets --ops gqa: paged GQA decode at the target
           sizes, the Mosaic GPU and Triton kernels beside jax's op, torch's SDPA and the
           XLA path, against the nominal bandwidth and a read ceiling measured in the run
  mla      the same for absorbed-MLA decode (128 heads), with TFLOP/s against a bf16 matmul
  kivi     benchmarks/pallas_kernels.py --kivi-targets: the KIVI decode kernels (GQA int8 /
           int4 / int2, MLA int4 at 16 and 128 heads) against the bf16 kernels on the same
           8 x 32K tokens, each step's ratio against its bound
  prefill  benchmarks/prefill_kernels.py: 8 x 4K-token prompts in 512-token chunks into bf16
           and int4 pages, and a mixed step (8 chunks + 56 decode rows), kernels against the
           XLA path and torch's causal SDPA, TFLOP/s against a bf16 matmul
  long     benchmarks/long_context.py: a 4M-token context of Llama-3-8B shapes in KIVI int2
           pages on one H200 (bf16 pages refused, memory against the calculator, decode
           steps against their bound)
  kernels  the compiled Pallas kernels against their references (tests/kernels -k native)
  host     the host-memory tier (tests/cache/test_host_tier.py, --slow)
  engine   the serving engine and the models' greedy tokens through the Pallas kernels
           (tests/serve/test_engine.py, tests/attention/test_pallas_models.py, --slow)
  sweep    benchmarks/block_sweep.py over the MLA kernels' head blocks and block sizes
  offload  benchmarks/offload.py --gpu (the host tier's decode step against its bound)

  JAX_PLATFORMS=cuda python scripts/device_check.py --out /tmp/device
  python scripts/device_check.py --parts kernels,host --budget 240 --out /tmp/device
  python scripts/device_check.py --plan     # the parts, their limits and the sizes; no GPU
"""

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYTEST = [sys.executable, "-m", "pytest", "-o", "addopts=", "-p", "no:cacheprovider", "-q",
          "-rs", "--tb=short"]
# (name, command, seconds it may take)
PARTS = {
    "gqa": ([sys.executable, "benchmarks/pallas_kernels.py", "--targets", "--ops", "gqa",
             "--out", "{out}/gqa_decode.json"], 150),
    "mla": ([sys.executable, "benchmarks/pallas_kernels.py", "--targets", "--ops", "mla",
             "--out", "{out}/mla_decode.json"], 120),
    "kivi": ([sys.executable, "benchmarks/pallas_kernels.py", "--kivi-targets", "--out",
              "{out}/kivi_decode.json"], 150),
    "prefill": ([sys.executable, "benchmarks/prefill_kernels.py", "--out",
                 "{out}/prefill.json"], 150),
    "ttft": ([sys.executable, "benchmarks/serving.py", "--compare-xla", "--repeats", "2", "--out",
              "{out}/serving.json"], 240),
    "long": ([sys.executable, "benchmarks/long_context.py", "--json", "{out}/long_context.json"],
             300),
    "kernels": (PYTEST + ["--slow", "tests/kernels", "-k", "native"], 150),
    "host": (PYTEST + ["--slow", "tests/cache/test_host_tier.py"], 120),
    "engine": (PYTEST + ["--slow", "tests/serve/test_engine.py",
                         "tests/attention/test_pallas_models.py"], 240),
    "sweep": ([sys.executable, "benchmarks/block_sweep.py", "--ops", "mla", "qmla", "--bits",
               "4", "--block-heads", "16", "32", "64", "128", "--warps", "4", "8", "--block-tokens",
               "32", "64", "--time-limit", "100", "--json", "{out}/sweep.json"], 130),
    "offload": ([sys.executable, "benchmarks/offload.py", "--gpu", "--time-limit", "200",
                 "--json", "{out}/offload.json"], 250),
}
SUMMARY = re.compile(r"\d+ (passed|failed|skipped|error)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"comma-separated parts among {','.join(PARTS)} (default: all)")
    p.add_argument("--budget", type=float, default=540.0,
                   help="seconds for all parts together (default 540)")
    p.add_argument("--plan", action="store_true",
                   help="print each part's command and time limit, and the benchmark parts' "
                        "sizes and bytes, then exit (runs anywhere, no GPU)")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path(os.environ.get("OUT", ".")),
                   help="folder for the logs and device_check.json (default $OUT or .)")
    args = p.parse_args(argv)
    args.parts = [x for x in args.parts.split(",") if x]
    unknown = [x for x in args.parts if x not in PARTS]
    if unknown or not args.parts:
        p.error(f"--parts: unknown {unknown or 'empty list'}; choose among {', '.join(PARTS)}")
    if args.budget <= 0:
        p.error(f"--budget must be positive, got {args.budget}")
    return args


def outcome(log: str) -> str:
    """pytest's summary line, or the last non-empty line of a script's output."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if SUMMARY.search(ln) and " in " in ln:
            return ln.strip("= ")
    return lines[-1][:160] if lines else "(no output)"


def plan(args, env) -> int:
    """What a run would do: each part's command and limit, and the benchmarks' sizes."""
    total = 0
    for name in args.parts:
        cmd, limit = PARTS[name]
        total += limit
        fits = ("runs" if total <= args.budget else
                "runs if the parts before it leave it the time (else skipped)")
        print(f"{name}: up to {limit} s, {fits}: "
              f"{' '.join(c.format(out=args.out) for c in cmd[1:])}")
        script = next((c for c in cmd if c.startswith("benchmarks/")), None)
        if script and "--plan" in (ROOT / script).read_text():  # the scripts that plan
            subprocess.run([c for c in cmd if c not in ("--out", "--json") and "{out}" not in c]
                           + ["--plan"], cwd=ROOT, env=env, check=True)
    print(f"total {total} s of limits against a --budget of {args.budget:.0f} s")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    if args.plan:
        return plan(args, env)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    results = []
    for name in args.parts:
        cmd, limit = PARTS[name]
        left = args.budget - (time.perf_counter() - start)
        if left < limit:
            results.append(dict(part=name, status="skipped", seconds=0.0,
                                outcome=f"needs {limit} s, {left:.0f} s left"))
            print(f"{name}: skipped ({results[-1]['outcome']})", flush=True)
            continue
        cmd = [c.format(out=args.out) for c in cmd]
        print(f"{name}: {' '.join(cmd[1:])} (up to {limit} s)", flush=True)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=limit)
            log, status = proc.stdout + proc.stderr, "ok" if proc.returncode == 0 else (
                f"failed (exit {proc.returncode})")
        except subprocess.TimeoutExpired as e:
            log = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(
                errors="replace")
            status = "timed out"
        (args.out / f"{name}.log").write_text(log)
        results.append(dict(part=name, status=status, seconds=time.perf_counter() - t0,
                            outcome=outcome(log)))
        print(f"{name}: {status} in {results[-1]['seconds']:.0f} s: {results[-1]['outcome']}",
              flush=True)

    print("\n| part | status | seconds | outcome |\n|---|---|---|---|")
    for r in results:
        print(f"| {r['part']} | {r['status']} | {r['seconds']:.0f} | {r['outcome']} |")
    (args.out / "device_check.json").write_text(json.dumps(dict(results=results), indent=1))
    return 0 if all(r["status"] in ("ok", "skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
