"""Markdown tables of a `python -m benchmarks` run, for the README's Performance section.

    python -m benchmarks.report benchmarks/results/full > /tmp/tables.md
"""

import argparse
import json
import sys
from pathlib import Path


def _ms(st, key="wall"):
    return (f"{st[f'{key}_median_s'] * 1e3:.2f} ({st[f'{key}_min_s'] * 1e3:.2f}–"
            f"{st[f'{key}_max_s'] * 1e3:.2f})")


def _table(hdr, rows):
    out = ["| " + " | ".join(hdr) + " |", "|" + "|".join("---" for _ in hdr) + "|"]
    out += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return "\n".join(out)


def roofline(d):
    bw = d["bandwidth"]
    base = {(r["batch"], r["context"]): r["wall_median_s"] for r in d["rows"]
            if r["format"] == "bf16"}
    rows = []
    for r in d["rows"]:
        b = base.get((r["batch"], r["context"]))
        rows.append([r["format"], r["batch"], r["context"], f"{r['bytes'] / 2**20:.1f}", _ms(r),
                     f"{r['GBps']:.2f}", f"{100 * r['fraction_of_copy']:.0f}%",
                     f"{100 * r['fraction_of_read']:.0f}%",
                     f"{r['wall_median_s'] / b:.2f}" if b else "–"])
    head = (f"Copy bandwidth {bw['copy_GBps']:.1f} GB/s (read + write of "
            f"{bw['bytes'] >> 20} MiB; best {bw['copy_GBps_best']:.1f}), streaming read "
            f"{bw['read_GBps']:.1f} GB/s (best {bw['read_GBps_best']:.1f}). "
            f"{d['rows'][0]['q_heads']} query heads, {d['rows'][0]['kv_heads']} KV heads, "
            f"head_dim {d['rows'][0]['head_dim']}, page {d['rows'][0]['page_size']}; quantized: "
            f"group {d['group']}, bf16 tail {d['residual']} tokens; {d['repeats']} repeats.\n\n")
    return head + _table(["cache", "batch", "context", "MiB read", "ms median (min–max)",
                          "GB/s", "% copy", "% read", "time / bf16"], rows)


def paging(d):
    rows = []
    for r in d["results"]:
        im = r["impls"]
        rows.append([r["case"]["name"], r["dtype"], _ms(im["xla"]),
                     _ms(im["contiguous"]) if "contiguous" in im else "–",
                     _ms(im["contiguous_blocked"]) if "contiguous_blocked" in im else "–",
                     f"{im['xla']['GBps']:.2f}",
                     *(f"{r['ratios'][k]:.2f}" if k in r["ratios"] else "–"
                       for k in ("xla/contiguous", "xla/contiguous_blocked",
                                 "xla/contiguous_cpu"))])
    return _table(["case", "dtype", "paged (XLA path) ms", "contiguous einsum ms",
                   "contiguous blocked ms", "paged GB/s", "paged / contiguous",
                   "paged / contiguous blocked", "paged / contiguous (CPU time)"], rows)


def pool(d):
    rows = []
    for dt, fs in d["pool_capacity"].items():
        b = next(iter(fs.values()))
        for f, st in fs.items():
            rows.append([dt, f, _ms(st), f"{st['wall_median_s'] / b['wall_median_s']:.2f}",
                         f"{st['cpu_median_s'] / b['cpu_median_s']:.2f}"])
    return _table(["dtype", "pool / live pages", "step ms median (min–max)", "wall vs 1x",
                   "CPU time vs 1x"], rows)


def e2e(d):
    rows = []
    for r in d["results"]:
        for name, e in r["engines"].items():
            if "error" in e:
                rows.append([r["family"], f"{r['params'] / 1e6:.1f}M", r["dtype"], name,
                             "not run: " + e["error"][:120].replace("|", "/"), "", "", "", "", ""])
                continue
            tps = e["decode_tokens_per_s"]
            step = (f"{e['step_median_s'] * 1e3:.1f} ({e['step_min_s'] * 1e3:.1f}–"
                    f"{e['step_max_s'] * 1e3:.1f})")
            same = e.get("same_tokens_as_kvjax")
            sp = e.get("kvjax_speedup_decode")
            if tps is None or (sp is not None and sp <= 0):  # a negative t(N) - t(1): noise
                sp = None
                step = f"– (noise; {step})"
            rows.append([r["family"], f"{r['params'] / 1e6:.1f}M", r["dtype"], name,
                         "–" if tps is None else f"{tps:.1f}", step,
                         f"{e['call_tokens_per_s']:.1f}",
                         f"{e['peak_rss_delta_bytes'] / 2**20:.1f}",
                         "" if same is None else f"{100 * same:.0f}%",
                         ("– / " if sp is None else f"{sp:.2f}× / ")
                         + f"{e['kvjax_speedup_call']:.2f}×" if "kvjax_speedup_call" in e else ""])
    r0 = d["results"][0]
    head = (f"Batch {r0['batch']}, prompt {r0['prompt_len']} tokens, {r0['new_tokens']} new "
            f"tokens per row, greedy; torch {d['torch']}, transformers {d['transformers']}, "
            f"jax {d['jax']}. Peak RSS+ = {d['memory_measure']}.\n\n")
    return head + _table(["model", "params", "dtype", "engine", "decode tok/s",
                          "step ms median (min–max)", "whole-call tok/s", "peak RSS+ MiB",
                          "same tokens as kvjax", "kvjax speedup (decode / call)"], rows)


def capacity(d):
    rows = [[r["layout"], r["sequences"], r["predicted_sequences"], f"{r['tokens']:,}",
             f"{r['tokens_vs_paged_bf16']:.2f}", f"{r['sequences_vs_contiguous']:.2f}",
             r["stop"]] for r in d["layouts"]]
    out = _table(["layout", "sequences", "predicted", "tokens", "tokens vs paged bf16",
                  "sequences vs contiguous", "stopped by"], rows)
    if d.get("eviction"):
        ev = [[k, v["prefill_peak_pages"], v["after_prefill_pages"],
               v["peak_pages_after_step"], v["final_pages"]] for k, v in d["eviction"].items()]
        out += "\n\nPeak KV pages per eviction policy (tiny Llama, 2 sequences):\n\n" + _table(
            ["policy", "prefill peak", "after prefill", "decode peak", "final"], ev)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path, help="a `python -m benchmarks --out` folder")
    a = p.parse_args(argv)
    s = json.loads((a.folder / "summary.json").read_text())
    m = s["machine"]
    flags = f" ({', '.join(m['cpu_flags'])})" if m.get("cpu_flags") else ""
    print(f"Machine: {m['cpu']}{flags}, {m['cores']} cores, backend {m['backend']}; "
          f"jax {m['jax']}; "
          f"started {s['started']}; load average {m['load_average_start'][0]:.1f} at start, "
          f"{s['load_average_end'][0]:.1f} at end.\n")
    for name, fn in dict(roofline=roofline, paging=paging, pool=pool, e2e=e2e,
                         capacity=capacity).items():
        sec = s["sections"].get(name)
        if not sec:
            continue
        print(f"### {name} ({sec['status']}, {sec['wall_s']:.0f} s wall, {sec['cpu_s']:.0f} s "
              "CPU)\n")
        if sec["status"] == "ok":
            print(fn(json.loads((a.folder / f"{name}.json").read_text())))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
