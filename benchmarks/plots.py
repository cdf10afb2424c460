"""PNG plots of the benchmark sections' JSON (matplotlib, no display needed)."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _bars(ax, groups, series, values, errs=None):
    """Grouped bars: values[s][i] for series s over group index i; errs[s][i] = (min, max)."""
    n = max(len(series), 1)
    width = 0.8 / n
    for k, s in enumerate(series):
        xs = [i + (k - (n - 1) / 2) * width for i in range(len(groups))]
        ys = [values[s].get(i) or 0.0 for i in range(len(groups))]
        yerr = None
        if errs is not None:
            lo = [max(y - errs[s].get(i, (y, y))[0], 0) for i, y in enumerate(ys)]
            hi = [max(errs[s].get(i, (y, y))[1] - y, 0) for i, y in enumerate(ys)]
            yerr = [lo, hi]
        ax.bar(xs, ys, width, label=s, yerr=yerr, capsize=2)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=20, ha="right", fontsize=8)
    ax.legend(fontsize=8)


def roofline(d, ax):
    rows = d["rows"]
    keys = sorted({(r["batch"], r["context"]) for r in rows})
    groups = [f"B={b} ctx={c}" for b, c in keys]
    fmts = list(dict.fromkeys(r["format"] for r in rows))
    vals = {f: {} for f in fmts}
    errs = {f: {} for f in fmts}
    for r in rows:
        i = keys.index((r["batch"], r["context"]))
        vals[r["format"]][i] = r["GBps"]
        errs[r["format"]][i] = (r["bytes"] / r["wall_max_s"] / 1e9,
                                r["bytes"] / r["wall_min_s"] / 1e9)
    _bars(ax, groups, fmts, vals, errs)
    bw = d["bandwidth"]
    ax.axhline(bw["copy_GBps"], color="k", ls="--", lw=1, label="copy")
    ax.axhline(bw["read_GBps"], color="gray", ls=":", lw=1, label="stream read")
    ax.set_ylim(top=max(ax.get_ylim()[1], 1.1 * bw["copy_GBps"], 1.1 * bw["read_GBps"]))
    ax.set_ylabel("GB/s of cache bytes read (median, min-max)")
    ax.set_title("decode attention vs measured bandwidth")
    ax.legend(fontsize=8)


def paging(d, ax):
    labels, vals = [], {"xla/contiguous": {}, "xla/contiguous_blocked": {}, "cpu/contiguous": {}}
    for r in d["results"]:
        if not r["ratios"]:
            continue
        labels.append(f"{r['case']['name']} {r['dtype']}")
        for k in vals:
            if k in r["ratios"]:
                vals[k][len(labels) - 1] = r["ratios"][k]
    _bars(ax, labels, list(vals), vals)
    ax.axhline(1.0, color="k", lw=1)
    ax.axhline(1.2, color="r", ls="--", lw=1, label="1.2")
    ax.set_ylabel("paged / contiguous step time (wall median)")
    ax.set_title("paging overhead")


def pool(d, ax):
    for dt, rows in d["pool_capacity"].items():
        base = next(iter(rows.values()))["wall_median_s"]
        xs = [int(k[1:]) for k in rows]
        ax.plot(xs, [v["wall_median_s"] / base for v in rows.values()], "o-", label=f"{dt} wall")
        base = next(iter(rows.values()))["cpu_median_s"]
        ax.plot(xs, [v["cpu_median_s"] / base for v in rows.values()], "s--", label=f"{dt} cpu")
    ax.set_xscale("log", base=2)
    ax.axhline(1.1, color="r", ls="--", lw=1)
    ax.set_xlabel("pool size / live pages")
    ax.set_ylabel("step time relative to 1x")
    ax.set_title("pool-capacity independence")
    ax.legend(fontsize=8)


def e2e(d, ax):
    labels = [f"{r['family']} {r['dtype']}" for r in d["results"]]
    engines = list(dict.fromkeys(e for r in d["results"] for e in r["engines"]))
    vals = {e: {} for e in engines}
    for i, r in enumerate(d["results"]):
        for e, st in r["engines"].items():
            if "error" not in st:
                vals[e][i] = st["call_tokens_per_s"]
    _bars(ax, labels, engines, vals)
    ax.set_yscale("log")
    ax.set_ylabel("tokens/s (whole generate call, median)")
    ax.set_title("greedy decode: kvjax vs transformers")


def capacity(d, ax):
    rows = d["layouts"]
    ax.bar(range(len(rows)), [r["sequences"] for r in rows])
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r["layout"] for r in rows], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("sequences admitted in the budget")
    ax.set_title("KV capacity per layout")


def kernels(d, ax):
    rows = d["rows"]
    labels = list(dict.fromkeys(f"{r['op']} B{r['batch']} c{r['context']} "
                                f"{r['q_heads']}/{r['kv_heads']}" for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    vals = {i: {} for i in impls}
    for r in rows:
        vals[r["impl"]][labels.index(f"{r['op']} B{r['batch']} c{r['context']} "
                                     f"{r['q_heads']}/{r['kv_heads']}")] = r["gbps"]
    _bars(ax, labels, impls, vals)
    ax.axhline(d["copy_gbps"], color="k", ls="--", lw=1, label="copy")
    ax.set_ylabel("GB/s of KV read (median)")
    ax.set_title(f"kernels on {d['device_kind']}")


def decode(d, ax):
    several = len(d.get("builds", ())) > 1
    labels = [f"batch {r['batch']}" + (f"\n-march={r['build_march']}" if several else "")
              for r in d["results"]]
    vals = {"kvjax": {i: r["kvjax_tokens_per_s"] for i, r in enumerate(d["results"])},
            "transformers": {i: r["hf_tokens_per_s"] for i, r in enumerate(d["results"])
                             if r.get("hf_tokens_per_s")}}
    _bars(ax, labels, list(vals), vals)
    for i, r in enumerate(d["results"]):
        ax.annotate(f"{100 * r['roofline_fraction']:.0f}% of roofline", (i, 0), fontsize=8,
                    xytext=(0, 4), textcoords="offset points", ha="center")
    ax.set_ylabel("decode tokens/s (median)")
    ax.set_title("greedy decode, 58M Llama, 1K-token prompts")


PLOTTERS = dict(roofline=roofline, paging=paging, pool=pool, decode=decode, e2e=e2e,
                capacity=capacity, kernels=kernels)


def plot(name: str, data: dict, path: Path) -> Path:
    """Draws section `name`'s data to `path` (PNG) and returns the path."""
    fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
    PLOTTERS[name](data, ax)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_run(run: dict, path: Path) -> Path:
    """One PNG of a `python -m benchmarks` run: a panel per verified section, machine on top."""
    from benchmarks.report import caption

    done = [(n, s["data"]) for n, s in run["sections"].items()
            if s["status"] == "ok" and n in PLOTTERS]
    cols = 2
    rows = max(1, -(-len(done) // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(8 * cols, 4.5 * rows), layout="constrained",
                             squeeze=False)
    for ax, (name, data) in zip(axes.flat, done, strict=False):
        PLOTTERS[name](data, ax)
    for ax in list(axes.flat)[len(done):]:
        ax.axis("off")
    fig.suptitle(caption(run), fontsize=9)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
