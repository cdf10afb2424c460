"""Replays the named semantic mutations of kvjax and requires each to be caught.

Each mutation (tests/mutations.py: eviction a no-op, a swap-in that copies nothing,
sampling that ignores the temperature, ...) is applied in a fresh pytest run of the
tests that claim to cover it (KVJAX_MUTATION=<name>; --slow, so every listed test runs
whatever the sweep sample; -x, so the run stops at the first failure). A mutation is
caught when a test fails; an error before any test (a mutation that breaks collection)
or a pass is not. The table on stdout says, per mutation, whether it was caught, the
first failing test (or the run's summary line) and its seconds; the exit status is 1
when one was not caught.

    python scripts/mutation_check.py --all          # every mutation (run before a release)
    python scripts/mutation_check.py                # this week's turn: CI's share of a day
    python scripts/mutation_check.py eviction_noop swap_in_copies_nothing
    python scripts/mutation_check.py --list

Without names or --all, the day's share runs: the mutations in a fixed order, ceil(n / 7)
a day in turn by the day of the year (UTC), so every mutation runs within any 7 days.
`--baseline` first runs the same tests unmutated and requires them to pass (a mutation
"caught" by tests that fail anyway proves nothing).
"""

import argparse
import datetime
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import mutations  # noqa: E402

PYTEST = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--slow",
          "--tb=line", "-x", "-o", "addopts=-p no:benchmark"]


def todays_share(names: list[str], day: int) -> list[str]:
    """ceil(n / 7) of the names, consecutive in turn, so any 7 days run all of them."""
    k = math.ceil(len(names) / 7)
    return [names[(day * k + j) % len(names)] for j in range(min(k, len(names)))]


def _summary(out: str) -> str:
    lines = [ln for ln in out.strip().splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
    return lines[-1].strip("= ") if lines else (out.strip().splitlines() or ["(no output)"])[-1]


def run(name: str | None, tests: tuple[str, ...], timeout: float) -> dict:
    env = dict(os.environ)
    env.pop("KVJAX_MUTATION", None)
    if name:
        env["KVJAX_MUTATION"] = name
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([*PYTEST, *tests], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=timeout)
        code, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        code, out = None, f"timed out after {timeout:.0f} s\n{e.stdout or ''}"
    first = re.search(r"^FAILED (\S+)", out, re.M)
    failed = code in (1, 2) and first is not None  # 2: -x under xdist stops as "interrupted"
    summary = f"failed: {first.group(1)}" if failed else _summary(out)
    return dict(exit=code, summary=summary, seconds=round(time.perf_counter() - t0, 1),
                failed=failed, passed=code == 0, tail=out[-3000:])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("names", nargs="*", help="mutations to run (default: the day's share)")
    parser.add_argument("--all", action="store_true", help="run every mutation")
    parser.add_argument("--list", action="store_true",
                        help="list the mutations, what each breaks and its tests, and exit")
    parser.add_argument("--baseline", action="store_true",
                        help="first run each mutation's tests unmutated; they must pass")
    parser.add_argument("--timeout", type=float, default=600,
                        help="seconds one pytest run may take (default 600)")
    parser.add_argument("--json", type=pathlib.Path, help="also write the results here")
    args = parser.parse_args(argv)
    names = list(mutations.MUTATIONS)
    if args.list:
        for m in mutations.MUTATIONS.values():
            print(f"{m.name}: {m.what}\n    tests: {' '.join(m.tests)}")
        return 0
    unknown = [n for n in args.names if n not in mutations.MUTATIONS]
    if unknown:
        parser.error(f"unknown mutation(s) {unknown}; --list shows them")
    if args.all:
        chosen = names
    elif args.names:
        chosen = args.names
    else:
        day = datetime.datetime.now(datetime.UTC).timetuple().tm_yday
        chosen = todays_share(names, day)
        print(f"the day's share ({len(chosen)} of {len(names)}, day {day} of the year): "
              f"{' '.join(chosen)}")
    results, ok = {}, True
    for name in chosen:
        m = mutations.MUTATIONS[name]
        row = {}
        if args.baseline:
            row["baseline"] = base = run(None, m.tests, args.timeout)
            if not base["passed"]:
                ok = False
                print(f"{name}: its tests fail without the mutation: {base['summary']}\n"
                      f"{base['tail']}", file=sys.stderr)
        row["mutant"] = res = run(name, m.tests, args.timeout)
        row["caught"] = res["failed"]
        ok &= res["failed"]
        if not res["failed"]:
            print(f"{name}: NOT caught ({res['summary']})\n{res['tail']}", file=sys.stderr)
        results[name] = row
        print(f"{name:28s} {'caught' if res['failed'] else 'NOT CAUGHT':10s} "
              f"{res['seconds']:6.1f} s  {res['summary']}", flush=True)
    print(f"\n{sum(r['caught'] for r in results.values())} of {len(results)} caught")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
