"""kvjax benchmarks: one command for every section, tables on stdout, one JSON + one PNG on disk.

    python -m benchmarks --quick            # CI-sized: correctness of every section, ~2 min CPU
    python -m benchmarks                    # the full run: results, README and docs tables
    python -m benchmarks --only roofline,e2e --out /tmp/bench

Sections (each warms up, blocks until results are ready, reports medians and
min-max over repeats, checks its results against a reference in the same run,
and fails only on wrong results, never on speed):

  roofline  copy/read bandwidth and decode attention over paged bf16 / int4 / int2
            caches: GB/s of cache bytes read and fraction of copy bandwidth
            (benchmarks/roofline.py)
  paging    paged vs contiguous decode attention on the same K/V, as ratios
            (benchmarks/attention.py)
  pool      decode step time with the same live tokens in pools 1x / 4x / 16x
            larger (benchmarks/attention.py)
  decode    greedy decode of a 58M Llama, batch 1 and 8 x 1K-token prompts, against
            the weight + KV read roofline and transformers, end to end with the
            prompts too (benchmarks/decode_e2e.py); on an AVX-512 CPU once more with the
            kernels' AVX2 build (-march=haswell)
  e2e       greedy decode vs HuggingFace transformers, Llama and DeepSeek (MLA),
            float32 and bfloat16: tokens/s, peak memory, same tokens
            (benchmarks/e2e_hf.py)
  kvbits    decode tokens/s through `kvjax.generate` on bf16, KIVI int4 and int2 caches,
            batch 8 x 4K context, 8 KV heads x 128, ratios to bf16 in one run
            (benchmarks/kv_bits.py)
  offload   decode with 0% / 50% / 90% of every row's context in host memory (the
            host tier, kvjax.cache.host), bf16 and KIVI int4 caches: step time against
            host bytes / host->device bandwidth + device bytes / read bandwidth, all
            measured in the run; greedy tokens equal to the all-device run's
            (benchmarks/offload.py)
  dsa       DeepSeek Sparse Attention: one DeepSeek-V3.2 layer's decode step, sparse MLA
            (indexer + top-k + the selected latent rows) vs dense MLA at a 32K context:
            bytes read counted from the compiled programs = kvjax.memory's hand figures,
            step times; selection and output checked in float64 (benchmarks/dsa.py)
  serving   a Poisson trace of requests sharing a 512-token system prompt through the
            continuous-batching engine (prefix caching) and through static batches of
            `kvjax.generate`: throughput, time to first token, prefix hit rate
            (benchmarks/serving.py)
  capacity  sequences that fit in a fixed KV budget (contiguous / paged bf16 /
            int4 / int2, benchmarks/capacity.py) and, in the full run, peak pages
            per eviction policy (benchmarks/eviction.py)
  kernels   the Pallas decode kernels against the XLA path (benchmarks/pallas_kernels.py);
            run by default on GPU/TPU only (on CPU the kernels only interpret)

Sections run in this process, one after the other, so that they share the
machine's state. The run writes <out>/run.json (the machine, and per section its
status, wall and CPU seconds, printed table and data) and <out>/plots.png (one
panel per section). The default <out> is benchmarks/results/<machine kind>/ (e.g.
cpu-intel-2core, gpu-nvidia-h200): the latest run per machine kind is what the
repository keeps. A full run into that folder also rewrites the generated tables of
README.md and docs/performance.md (`--no-docs` leaves them); `--only S --merge` reruns
sections S into it, keeping the other sections' data, and rewrites them too (the
README's summary only when it already summarises that folder). The exit
status is 0 only if every section ran and verified its results.
"""

import argparse
import atexit
import contextlib
import datetime
import io
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # `python benchmarks/__main__.py` as well as `python -m benchmarks`
    sys.path.insert(0, str(ROOT))

SECTIONS = ("roofline", "paging", "pool", "decode", "e2e", "kvbits", "offload", "dsa",
            "serving", "capacity", "kernels")


def cpu_flags() -> list[str]:
    """The vector-ISA flags of /proc/cpuinfo that matter for these kernels."""
    want = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return [w for w in want if w in have]
    except OSError:
        pass
    return []


def machine_kind(backend: str, cpu: str, cores: int, device: str) -> str:
    """A short folder name for the kind of machine: `cpu-intel-2core`, `gpu-nvidia-h200`."""
    if backend == "cpu":
        vendor = next((v for v in ("intel", "amd", "arm") if v in cpu.lower()),
                      platform.machine().lower())
        return f"cpu-{vendor}-{cores}core"
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    return f"{backend}-{slug}"


def git_commit() -> str | None:
    """The commit measured, `-dirty` when the working tree differs from it (None outside git)."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("-dirty" if dirty.strip() else "")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ----------------------------------------------------------------------------- sections
# Each returns the argv of the script's main() for (quick, out json path).


def _roofline(quick, out):
    from benchmarks import roofline
    # Full: largest size 8 x 16K tokens x 8 KV heads x 128 = 512 MiB of bf16 K/V (the
    # quantized reference dequantizes the gathered pages in float32: 4x that, transiently).
    argv = ["--out", str(out)] + (["--quick"] if quick else ["--max-gib", "0.5", "--repeats", "3"])
    if roofline.main(argv):
        raise RuntimeError("roofline reported a failure")


def _attention(quick, out, *, paging):
    from benchmarks import attention
    if paging:
        argv = (["--quick", "--dtypes", "float32", "--only", "gqa_b4_s512,mla_b4_s512",
                 "--repeats", "3", "--ref-repeats", "1", "--bandwidth-mib", "32"] if quick else
                ["--only", "gqa_b8_s4k,gqa_b1_s4k,mla_b8_s4k", "--repeats", "5",
                 "--ref-repeats", "1", "--bandwidth-mib", "512"])
        argv += ["--pool-factors", ""]
    else:  # no cases (`--only -`), only the pool check
        argv = (["--quick", "--dtypes", "float32", "--repeats", "3", "--bandwidth-mib", "32"]
                if quick else ["--dtypes", "bfloat16", "--repeats", "7", "--bandwidth-mib", "256"])
        argv += ["--only", "-", "--pool-factors", "1,4,16"]
    # The quantized-pages comparison is its own run (`python benchmarks/attention.py
    # --quant only`); the roofline section covers int4/int2 pages here.
    attention.main(argv + ["--quant", "off", "--out", str(out)])


def _decode(quick, out):
    from benchmarks import decode_e2e
    # Quick: 32 new tokens over 3 repeats, so a step (a difference of two timings) stays
    # positive on a loaded CI machine.
    argv = ["--quick", "--batches", "2", "--repeats", "3", "--new-tokens", "32"] if quick else []
    # The native build, and on an AVX-512 CPU also the AVX2 code (-march=haswell: the
    # kernels users' AVX2-only CPUs run; XLA and transformers keep this CPU's own code).
    # The quick run checks the native build only (the AVX2 build takes a minute to compile).
    marches = ["native"] + (["haswell"] if not quick and "avx512f" in cpu_flags() else [])
    runs = []
    for march in marches:
        path = out.with_name(f"{out.stem}-{march}.json")
        decode_e2e.main(argv + ["--march", march, "--out", str(path)])
        runs.append(json.loads(path.read_text()))
    merged = {k: v for k, v in runs[0].items() if k != "results"}
    merged["builds"] = [{k: v for k, v in r.items() if k != "results"} for r in runs]
    merged["results"] = [dict(row, build=r["kernels_build"], build_march=r["march"])
                         for r in runs for row in r["results"]]
    out.write_text(json.dumps(merged, indent=1, default=str))


def _e2e(quick, out):
    from benchmarks import e2e_hf
    full = ["--prompt-len", "64", "--new-tokens", "16", "--repeats", "3"]
    if e2e_hf.main((["--quick"] if quick else full) + ["--out", str(out)]):
        raise RuntimeError("e2e reported a failure")


def _kvbits(quick, out):
    from benchmarks import kv_bits
    kv_bits.main((["--quick", "--batch", "2"] if quick else [])
                 + ["--out", str(out)])


def _offload(quick, out):
    from benchmarks import offload
    if offload.main((["--quick"] if quick else []) + ["--json", str(out)]):
        raise RuntimeError("offload: a trial failed, or greedy tokens with host-resident pages "
                           "differ from the all-device run's")


def _dsa(quick, out):
    from benchmarks import dsa
    dsa.main((["--quick"] if quick else []) + ["--out", str(out)])


def _serving(quick, out):
    from benchmarks import serving
    if serving.main((["--quick"] if quick else []) + ["--out", str(out)]):
        raise RuntimeError("the engine's tokens differ from kvjax.generate's")


def _capacity(quick, out):
    from benchmarks import capacity
    # Quick: explicit small sizes (capacity.py's own --quick preset admits 256 sequences).
    cap_argv = (["--budget-mib", "3", "--num-seqs", "128", "--layers", "1", "--kv-heads", "1",
                 "--head-dim", "32", "--chunk", "2048"] if quick else
                ["--budget-mib", "32", "--layers", "2", "--kv-heads", "2"])
    rows = capacity.main(cap_argv + ["--out", str(out.with_name("capacity_layouts.json"))])
    ev = None
    if not quick:  # six policies, each compiled: ~40 s of CPU even at toy sizes
        from benchmarks import eviction
        ev_json = out.with_name("capacity_eviction.json")
        ev = eviction.main(["--steps", "96", "--json", str(ev_json)])
    out.write_text(json.dumps(dict(layouts=rows, eviction=ev), indent=1, default=str))


def _kernels(quick, out):
    from benchmarks import pallas_kernels
    if pallas_kernels.main((["--quick"] if quick else []) + ["--out", str(out)]):
        raise RuntimeError("a kernel result disagreed with the reference")


RUNNERS = dict(
    roofline=_roofline,
    paging=lambda q, o: _attention(q, o, paging=True),
    pool=lambda q, o: _attention(q, o, paging=False),
    decode=_decode,
    e2e=_e2e,
    kvbits=_kvbits,
    offload=_offload,
    dsa=_dsa,
    serving=_serving,
    capacity=_capacity,
    kernels=_kernels,
)


class _Tee(io.TextIOBase):
    """Writes to the real stdout and keeps a copy (the section's printed table)."""

    def __init__(self, stream):
        self.stream, self.buf = stream, io.StringIO()

    def write(self, s):
        self.buf.write(s)
        return self.stream.write(s)

    def flush(self):
        self.stream.flush()


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0],
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="CI-sized inputs: checks every section end to end in about 2 min of CPU")
    p.add_argument("--only", default=None,
                   help=f"comma-separated sections to run, among {', '.join(SECTIONS)} "
                        "(default: all; kernels only on GPU/TPU)")
    p.add_argument("--out", type=Path, default=None,
                   help="output folder for run.json and plots.png (default "
                        "benchmarks/results/<machine kind>/, or .../quick/ with --quick)")
    p.add_argument("--no-plots", action="store_true", help="skip writing the PNG")
    p.add_argument("--no-docs", action="store_true",
                   help="do not rewrite the tables of README.md and docs/performance.md "
                        "(only a full run into the default folder rewrites them, or --merge)")
    p.add_argument("--merge", action="store_true",
                   help="with --only, into the default folder: replace those sections of its "
                        "run.json (the others stay; each merged section records when, on "
                        "which commit and under which load it ran) and rewrite the docs "
                        "(the README's summary only if it summarises this folder)")
    a = p.parse_args(argv)
    if a.merge and (not a.only or a.quick or a.out is not None):
        p.error("--merge needs --only, and neither --quick nor --out (it merges into the "
                "default folder's run.json)")

    import jax  # after argparse: --help stays instant

    backend = jax.default_backend()
    if a.only:
        sections = [s for s in a.only.split(",") if s]
        bad = [s for s in sections if s not in SECTIONS]
        if bad:
            p.error(f"--only: unknown section(s) {bad}; choose among {list(SECTIONS)}")
    else:
        sections = [s for s in SECTIONS if s != "kernels" or backend != "cpu"]
    machine = dict(cpu=cpu_model(), cpu_flags=cpu_flags(), cores=os.cpu_count(), backend=backend,
                   device=jax.devices()[0].device_kind, jax=jax.__version__,
                   python=platform.python_version(), load_average_start=os.getloadavg())
    kind = machine_kind(backend, machine["cpu"], machine["cores"], machine["device"])
    default_out = HERE / "results" / ("quick" if a.quick else kind)
    out_dir = a.out or default_out
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvjax-bench-"))  # the sections' own JSON files
    atexit.register(shutil.rmtree, work, True)  # removed however the run ends
    print(f"kvjax benchmarks ({'quick' if a.quick else 'full'}): {machine['cpu']}, "
          f"{machine['cores']} cores, backend {backend} ({machine['device']}), load average "
          f"{machine['load_average_start'][0]:.1f}; sections {', '.join(sections)}", flush=True)

    summary = dict(quick=a.quick, machine=machine, kind=kind, commit=git_commit(), sections={},
                   started=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
    for name in sections:
        print(f"\n=== {name} ===", flush=True)
        path = work / f"{name}.json"
        c0, t0 = time.process_time(), time.perf_counter()
        tee = _Tee(sys.stdout)
        status, error = "ok", None
        try:
            with contextlib.redirect_stdout(tee):
                RUNNERS[name](a.quick, path)
        except Exception as e:  # noqa: BLE001 - one failed section must not hide the others
            status, error = "failed", "".join(traceback.format_exception(e))
            print(error, file=sys.stderr)
        entry = dict(status=status, wall_s=time.perf_counter() - t0,
                     cpu_s=time.process_time() - c0, table=tee.buf.getvalue())
        if error:
            entry["error"] = error
        else:
            entry["data"] = json.loads(path.read_text())
        summary["sections"][name] = entry
        print(f"--- {name}: {status} in {entry['wall_s']:.1f} s wall, {entry['cpu_s']:.1f} s CPU",
              flush=True)

    summary["load_average_end"] = os.getloadavg()
    if a.merge and (out_dir / "run.json").exists():
        merged = json.loads((out_dir / "run.json").read_text())
        for name, entry in summary["sections"].items():
            entry["rerun"] = {k: summary[k] for k in ("started", "commit", "load_average_end")}
            entry["rerun"]["load_average_start"] = machine["load_average_start"]
            merged["sections"][name] = entry
        summary = merged
    (out_dir / "run.json").write_text(json.dumps(summary, indent=1, default=str))
    if not a.no_plots:
        try:
            from benchmarks import plots
            plots.plot_run(summary, out_dir / "plots.png")
        except Exception as e:  # noqa: BLE001 - a plot is not a result
            print(f"plots failed: {type(e).__name__}: {e}", file=sys.stderr)
    failed = [n for n, e in summary["sections"].items() if e["status"] != "ok"]
    print(f"\nwrote {out_dir}/run.json; " +
          (f"FAILED: {', '.join(failed)}" if failed else "all sections verified"))
    if not (a.quick or a.no_docs or failed or (a.only and not a.merge)) and (
            out_dir == default_out):
        from benchmarks import report
        for path in report.update_docs(out_dir, merged=a.merge):
            print(f"updated {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
