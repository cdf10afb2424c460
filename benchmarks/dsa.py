"""DeepSeek Sparse Attention: the bytes one decode step reads and its time, sparse vs dense MLA.

One layer of DeepSeek-V3.2 (the `deepseek-v3.2` preset of `kvjax.memory`: 128 query
heads, latent 512 + rotary key 64, a lightning indexer of 64 heads x 128 with
index_topk 2048) decodes one token per sequence over a bf16 paged cache holding
`--context` tokens per sequence (default 32K):

  dense  `kvjax.attention.mla_decode_attention`: absorbed MLA over every cached latent
         (timed with the XLA path and with what impl="auto" picks on this machine);
  DSA    `indexer_scores` over every cached indexer key (bf16, 128 wide), `select_topk`,
         then `mla_sparse_attention` over the selected latent rows: what
         `kvjax.cache.indexer_topk` and `kvjax.cache.attend` run inside the model.

Bytes read are counted from the compiled programs: every gather's elements, times the
trip count XLA knows for the loop it sits in (the count-only programs are compiled with
the lengths as constants), in the pools' dtype (XLA:CPU gathers bf16 through a float32
view, which is not a read of the cache), per pool (latent, rotary key, indexer keys;
block-table reads are left out). They must equal `kvjax.memory.indexer`'s hand figures
for one layer. Step times: medians over repeats after a warm-up, every call blocked on.
On a CPU both steps are bound by arithmetic rather than bytes (128 query heads share
each latent row, about 280 kFLOP per attended token), so the GB/s column is bytes over
step time, not a bandwidth reached.

The run checks itself: each query's selection is the top-k of the indexer scores
recomputed in float64 NumPy from the same bf16 keys (a swap allowed only at a near tie),
and the sparse output equals a float64 softmax attention restricted to exactly the
selected tokens.

    python benchmarks/dsa.py                 # batch 1 x 32K tokens
    python benchmarks/dsa.py --quick         # batch 1 x 4K tokens, 3 repeats
"""

import argparse
import datetime
import json
import os
import re
import sys
import time
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvjax.attention import (  # noqa: E402
    indexer_scores,
    mla_decode_attention,
    mla_sparse_attention,
    registry,
    select_topk,
)
from kvjax.memory.indexer import dsa_cache_bytes  # noqa: E402
from kvjax.memory.presets import get_preset  # noqa: E402

PRESET = "deepseek-v3.2"


def machine():
    import platform

    model = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return dict(cpu=model, cpus=os.cpu_count(), backend=jax.default_backend(),
                device=jax.devices()[0].device_kind, jax=jax.__version__)


def geometry():
    """One layer's shapes from the preset."""
    p = get_preset(PRESET)
    a, ix = p.attention, p.indexer
    return dict(q_heads=a.q_heads, d_c=a.kv_lora_rank, d_rope=a.qk_rope_head_dim,
                index_heads=ix.n_heads, index_dim=ix.head_dim, topk=ix.topk,
                scale=float(a.qk_head_dim ** -0.5), layers=p.num_layers)


# ----------------------------------------------------------------------- counted bytes


_COMP = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_GATHER = re.compile(r"= ([a-z0-9]+)\[([0-9,]*)\]\S* gather\(")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)")
_WHILE = re.compile(r" while\(.*body=%?([\w.\-]+)")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def gathered_elements(hlo: str) -> dict[int, int]:
    """Elements every gather of a compiled module produces, by last dimension, each
    multiplied by the known trip counts of the loops around it.

    Raises:
      ValueError: a loop whose trip count XLA does not know holds a gather.
    """
    comps: dict[str, list[str]] = {}
    entry, name = None, None
    for line in hlo.splitlines():
        m = _COMP.match(line)
        if m and not line.startswith(" "):
            name = m.group(1)
            comps[name] = []
            if line.startswith("ENTRY"):
                entry = name
        elif name is not None:
            comps[name].append(line)

    def count(comp: str, seen=()) -> dict[int, int]:
        out: dict[int, int] = {}
        for line in comps.get(comp, []):
            g = _GATHER.search(line)
            if g:
                dims = [int(x) for x in g.group(2).split(",") if x]
                out[dims[-1]] = out.get(dims[-1], 0) + int(np.prod(dims))
            w = _WHILE.search(line)
            mult = None
            if w:
                t = _TRIPS.search(line)
                mult = int(t.group(1)) if t else None
            for callee in _CALLS.findall(line):
                if callee in seen or callee not in comps:
                    continue
                sub = count(callee, (*seen, comp))
                if not sub:
                    continue
                k = 1
                if w and callee == w.group(1):
                    if mult is None:
                        raise ValueError(f"a loop ({callee}) with an unknown trip count gathers")
                    k = mult
                for d, n in sub.items():
                    out[d] = out.get(d, 0) + k * n
        return out

    return count(entry)


def pool_bytes(elements: dict[int, int], widths: dict[str, int], page_size: int,
               itemsize: int) -> dict[str, int]:
    """Bytes read from each pool: gathers of `width` (rows) or `page_size * width` (pages)."""
    out = {name: 0 for name in widths}
    for last, n in elements.items():
        for name, w in widths.items():
            if last in (w, page_size * w):
                out[name] += n * itemsize
    return out


# ----------------------------------------------------------------------------- the run


def build(rng, g, batch, context, page_size):
    """Pools with every row's pages under permuted ids, tables, lengths and queries."""
    pages = batch * context // page_size
    ids = rng.permutation(pages).astype(np.int32).reshape(batch, -1)
    bf = jnp.bfloat16

    def pool(width):
        return jnp.asarray(rng.standard_normal((pages, page_size, width)), jnp.float32).astype(bf)

    return dict(
        latent=pool(g["d_c"]), rope=pool(g["d_rope"]), index=pool(g["index_dim"]),
        tables=jnp.asarray(ids), lengths=jnp.full((batch,), context, jnp.int32),
        q_latent=jnp.asarray(rng.standard_normal((batch, g["q_heads"], g["d_c"])) * 0.05,
                             jnp.float32),
        q_rope=jnp.asarray(rng.standard_normal((batch, g["q_heads"], g["d_rope"])) * 0.05,
                           jnp.float32),
        q_index=jnp.asarray(rng.standard_normal((batch, 1, g["index_heads"], g["index_dim"])),
                            jnp.float32),
        weights=jnp.asarray(rng.standard_normal((batch, 1, g["index_heads"])) * 0.125,
                            jnp.float32))


def programs(g, *, impl_dense="xla"):
    """The jitted steps: (dense, indexer, sparse, dsa), lengths passed as arguments."""
    k, iscale, scale = g["topk"], g["index_dim"] ** -0.5, g["scale"]

    def dense(d, lengths):
        return mla_decode_attention(d["q_latent"], d["q_rope"], d["latent"], d["rope"], lengths,
                                    d["tables"], scale=scale, impl=impl_dense)

    def indexer(d, lengths):
        s = indexer_scores(d["q_index"], d["weights"], d["index"], d["tables"], lengths,
                           (lengths - 1)[:, None], scale=iscale, impl="xla")
        return select_topk(s, k)

    def sparse(d, sel):
        return mla_sparse_attention(d["q_latent"][:, None], d["q_rope"][:, None], d["latent"],
                                    d["rope"], d["tables"], sel, scale=scale, impl="xla")

    def dsa(d, lengths):
        return sparse(d, indexer(d, lengths))

    return dict(dense=dense, indexer=indexer, sparse=sparse, dsa=dsa)


def counted(g, d, page_size):
    """Bytes each program reads per pool, from its compiled HLO (lengths constant)."""
    progs = programs(g)
    lengths = np.asarray(d["lengths"])
    widths = dict(latent=g["d_c"], rope=g["d_rope"], index=g["index_dim"])
    sel = progs["indexer"](d, d["lengths"])
    out = {}
    for name, fn, arg in (("dense", progs["dense"], None), ("dsa", progs["dsa"], None),
                          ("indexer", progs["indexer"], None), ("sparse", progs["sparse"], sel)):
        if arg is None:
            f = jax.jit(lambda d, fn=fn: fn(d, jnp.asarray(lengths)))
            hlo = f.lower(d).compile().as_text()
        else:
            hlo = jax.jit(fn).lower(d, arg).compile().as_text()
        out[name] = pool_bytes(gathered_elements(hlo), widths, page_size, 2)
    return out


def hand(g, batch, context):
    """`kvjax.memory.indexer`'s figures for one layer (bf16 latent and indexer keys)."""
    b = dsa_cache_bytes(get_preset(PRESET), context, batch=batch, fmt="bf16",
                        indexer_dtype="bf16")
    layers = Fraction(g["layers"])
    per = dict(dense=b.batch_dense_read_bytes / layers, dsa=b.batch_dsa_read_bytes / layers,
               indexer=b.batch_indexer_bytes / layers)
    per["sparse"] = per["dsa"] - per["indexer"]
    return {k: int(v) for k, v in per.items()}


def timed(fn, args, repeats):
    """(median, min, max) seconds of `fn(*args)`, after one warm-up call."""
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)), float(min(ts)), float(max(ts))


def check(g, d, sel, out):
    """Selection = float64 top-k (swaps only at near ties); output = float64 attention
    over exactly the selected tokens. Returns the worst errors; raises on a failure."""
    bf = lambda x: np.asarray(x.astype(jnp.float32), np.float64)  # noqa: E731
    tables = np.asarray(d["tables"])
    ps = d["latent"].shape[1]
    pos_all = np.arange(int(d["lengths"][0]))
    worst_gap, worst_err = 0.0, 0.0
    for b in range(tables.shape[0]):
        rows = tables[b][pos_all // ps] * ps + pos_all % ps
        keys = bf(d["index"]).reshape(-1, g["index_dim"])[rows]
        q = np.asarray(d["q_index"], np.float64)[b, 0]
        s = np.maximum(q @ keys.T * g["index_dim"] ** -0.5, 0.0)  # [heads, tokens]
        scores = np.asarray(d["weights"], np.float64)[b, 0] @ s
        chosen = np.asarray(sel.positions)[b, 0]
        kth = np.sort(scores)[::-1][g["topk"] - 1]
        missed = set(np.argsort(-scores)[:g["topk"]].tolist()) ^ set(chosen.tolist())
        gap = max((abs(scores[i] - kth) for i in missed), default=0.0)
        if gap > 1e-4 * max(1.0, abs(kth)):
            raise AssertionError(f"row {b}: the selection is not the top-{g['topk']} of the "
                                 f"indexer scores (a token {gap:.3g} from the k-th score)")
        worst_gap = max(worst_gap, gap)
        r = tables[b][chosen // ps] * ps + chosen % ps
        c = bf(d["latent"]).reshape(-1, g["d_c"])[r]
        kr = bf(d["rope"]).reshape(-1, g["d_rope"])[r]
        logits = (np.asarray(d["q_latent"], np.float64)[b] @ c.T
                  + np.asarray(d["q_rope"], np.float64)[b] @ kr.T) * g["scale"]
        p = np.exp(logits - logits.max(-1, keepdims=True))
        want = (p / p.sum(-1, keepdims=True)) @ c
        err = float(np.abs(np.asarray(out[0])[b, 0] - want).max())
        if err > 1e-4:
            raise AssertionError(f"row {b}: sparse MLA differs from attention over the "
                                 f"selected tokens by {err:.3g}")
        worst_err = max(worst_err, err)
    return dict(selection_max_near_tie_gap=worst_gap, sparse_output_max_abs_err=worst_err)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--context", type=int, default=32768,
                        help="tokens per sequence (a multiple of 512; default 32768)")
    parser.add_argument("--batch", type=int, default=1, help="sequences (default 1)")
    parser.add_argument("--page-size", type=int, default=64, help="tokens per page (default 64)")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per program")
    parser.add_argument("--quick", action="store_true",
                        help="CI size: 4096-token context, 3 repeats")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random pools")
    parser.add_argument("--out", default=None, help="JSON file to write (default: none)")
    a = parser.parse_args(argv)
    if a.quick:
        a.context, a.repeats = 4096, 3
    g = geometry()
    if a.context % 512 or a.context <= g["topk"]:
        parser.error(f"--context must be a multiple of 512 above index_topk={g['topk']}, got "
                     f"{a.context}")
    if a.batch < 1 or a.page_size < 1 or a.page_size & (a.page_size - 1) or 512 % a.page_size:
        parser.error("--batch must be >= 1 and --page-size a power of two dividing 512")

    rng = np.random.default_rng(a.seed)
    d = build(rng, g, a.batch, a.context, a.page_size)
    count = counted(g, d, a.page_size)
    want = hand(g, a.batch, a.context)
    for name in ("dense", "dsa", "indexer", "sparse"):
        got = sum(count[name].values())
        if got != want[name]:
            raise AssertionError(f"{name}: the compiled program reads {got} bytes of the pools "
                                 f"({count[name]}), kvjax.memory.indexer says {want[name]}")

    auto = registry.auto_impl("mla_decode_attention", jnp.bfloat16)
    progs = programs(g)
    jitted = {k: jax.jit(v) for k, v in progs.items()}
    dense_auto = jax.jit(programs(g, impl_dense="auto")["dense"])
    sel = jitted["indexer"](d, d["lengths"])
    out = jitted["dsa"](d, d["lengths"])
    verified = check(g, d, sel, out)

    rows = []
    for name, fn, arg, label in (
            ("dense", jitted["dense"], d["lengths"], "dense MLA (xla)"),
            ("dense_auto", dense_auto, d["lengths"], f"dense MLA (auto: {auto})"),
            ("dsa", jitted["dsa"], d["lengths"], "DSA: indexer + top-k + sparse MLA"),
            ("indexer", jitted["indexer"], d["lengths"], "  indexer scores + top-k"),
            ("sparse", jitted["sparse"], sel, "  sparse MLA over the selection")):
        med, lo, hi = timed(fn, (d, arg), a.repeats)
        key = "dense" if name == "dense_auto" else name
        rows.append(dict(program=name, label=label, bytes_counted=sum(count[key].values()),
                         bytes_by_pool=count[key], bytes_hand=want[key], step_median_s=med,
                         step_min_s=lo, step_max_s=hi,
                         GBps=sum(count[key].values()) / med / 1e9))
    by = {r["program"]: r for r in rows}
    ratios = dict(bytes_dsa_over_dense=want["dsa"] / want["dense"],
                  time_dsa_over_dense_xla=by["dsa"]["step_median_s"] / by["dense"]["step_median_s"],
                  time_dsa_over_dense_auto=(by["dsa"]["step_median_s"]
                                            / by["dense_auto"]["step_median_s"]))

    print(f"DSA decode step: one {PRESET} layer ({g['q_heads']} heads, latent {g['d_c']} + "
          f"{g['d_rope']}, indexer {g['index_heads']} x {g['index_dim']}, top-{g['topk']}), "
          f"batch {a.batch} x {a.context} tokens, bf16 pages of {a.page_size}; "
          f"{machine()['cpu']}, {os.cpu_count()} cores")
    hdr = ["program", "MB read (counted = hand)", "step ms (min-max)", "GB/s"]
    lines = [[r["label"], f"{r['bytes_counted'] / 1e6:.2f}",
              f"{r['step_median_s'] * 1e3:.2f} ({r['step_min_s'] * 1e3:.2f}-"
              f"{r['step_max_s'] * 1e3:.2f})", f"{r['GBps']:.2f}"] for r in rows]
    widths = [max(len(str(x[i])) for x in [hdr, *lines]) for i in range(len(hdr))]
    for line in [hdr, *lines]:
        print("  ".join(str(x).ljust(w) for x, w in zip(line, widths, strict=True)))
    print(f"bytes DSA / dense: {ratios['bytes_dsa_over_dense']:.3f}; step DSA / dense: "
          f"{ratios['time_dsa_over_dense_xla']:.2f} (xla), {ratios['time_dsa_over_dense_auto']:.2f}"
          f" (auto); verified: selection = float64 top-k, sparse output within "
          f"{verified['sparse_output_max_abs_err']:.1e} of attention over the selection")
    result = dict(benchmark="dsa", machine=machine(), preset=PRESET, geometry=g,
                  batch=a.batch, context=a.context, page_size=a.page_size, repeats=a.repeats,
                  rows=rows, ratios=ratios, verified=verified, ok=True,
                  date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {a.out}")
    return result


if __name__ == "__main__":
    main()
