"""How many sequences fit in a fixed KV memory budget: contiguous bf16, paged bf16, paged int4/int2.

Run, not computed: for each layout the benchmark allocates a real kvjax cache
whose pools fit the budget, then admits sequences of a realistic length
spread one after the other (reserve + write of every layer, in fixed-size
chunks) until the allocator raises `CacheFullError`. It prints a table and
writes JSON to benchmarks/results/.

Layouts (same model geometry, bf16 everywhere but in the codes):
  contiguous bf16  every sequence reserves --max-len tokens up front (a paged
                   cache whose single page per sequence is --max-len tokens long);
  paged bf16       --page-size token pages allocated on demand;
  paged int4/int2  kvjax quantized pages (KIVI: keys per channel, values per
                   token, groups of --group, float16 scale and zero) plus a bf16
                   ring of --residual + --page-size tokens per sequence slot.

Each run is checked against `kvjax.memory.capacity`'s prediction for the same
budget and order, and the allocator invariants are checked after the fill.

    PYTHONPATH=. python benchmarks/capacity.py --quick
    PYTHONPATH=. python benchmarks/capacity.py --budget-mib 256 --layers 4 --kv-heads 8
"""

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import kvjax as kvx
from kvjax.cache import check_invariants, paged
from kvjax.cache import quantized as qz
from kvjax.memory import capacity as cap
from kvjax.memory import kv_format
from kvjax.specs import QuantSpec

RESULTS = Path(__file__).resolve().parent / "results"


@dataclasses.dataclass
class Layout:
    name: str
    bits: int | None  # None: bf16
    residual: int = 0
    contiguous: bool = False


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true",
                   help="small budget and model (seconds on a CPU); overrides the sizes below")
    p.add_argument("--budget-mib", type=float, default=64.0,
                   help="KV pool budget in MiB per layout (default 64)")
    p.add_argument("--num-seqs", type=int, default=512,
                   help="sequences in the length spread offered to each cache (default 512)")
    p.add_argument("--max-len", type=int, default=8192,
                   help="longest sequence, and what a contiguous slot reserves; a power of two "
                   "(default 8192)")
    p.add_argument("--page-size", type=int, default=32, help="tokens per page (default 32)")
    p.add_argument("--group", type=int, default=32,
                   help="quantization group size G; divides --page-size (default 32)")
    p.add_argument("--residual", type=int, default=128,
                   help="full-precision tail R for the extra 'paged int2 +tail' row; a multiple "
                   "of --page-size (default 128; the headline int4/int2 rows use R = 0)")
    p.add_argument("--layers", type=int, default=2, help="model layers (default 2)")
    p.add_argument("--kv-heads", type=int, default=2, help="KV heads (default 2)")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension (default 64)")
    p.add_argument("--chunk", type=int, default=512,
                   help="tokens written per reserve+write step (default 512)")
    p.add_argument("--seed", type=int, default=0, help="seed of the length spread (default 0)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON output (default benchmarks/results/capacity[-quick].json)")
    args = p.parse_args(argv)
    if args.quick:
        args.budget_mib, args.num_seqs, args.layers, args.kv_heads = 16.0, 256, 2, 1
        args.head_dim, args.max_len, args.chunk = 64, 8192, 2048
    if args.max_len & (args.max_len - 1) or args.page_size & (args.page_size - 1):
        p.error(f"--max-len {args.max_len} and --page-size {args.page_size} must be powers of 2")
    if args.page_size % args.group or args.residual % args.page_size:
        p.error("--group must divide --page-size, and --residual be a multiple of it")
    return args


def geometry(args):
    return kvx.AttentionSpec(q_heads=args.kv_heads, kv_heads=args.kv_heads,
                             head_dim=args.head_dim)


def fmt_of(layout: Layout, args):
    if layout.bits is None:
        return kv_format("bf16")
    return kv_format(f"int{layout.bits}", group_size=args.group, residual=layout.residual)


def build_spec(layout: Layout, args, budget: int, lengths) -> kvx.CacheSpec:
    att = geometry(args)
    fmt = fmt_of(layout, args)
    if layout.contiguous:
        slab = cap.page_bytes(att, args.layers, args.max_len, fmt)
        n = int(budget // slab)
        return kvx.CacheSpec(attention=att, num_layers=args.layers, page_size=args.max_len,
                             num_pages=max(n, 1), max_seqs=max(n, 1), max_pages_per_seq=1,
                             dtype="bfloat16")
    max_pages = args.max_len // args.page_size
    page = cap.page_bytes(att, args.layers, args.page_size, fmt)
    if layout.bits is None:
        return kvx.CacheSpec(attention=att, num_layers=args.layers, page_size=args.page_size,
                             num_pages=int(budget // page), max_seqs=len(lengths),
                             max_pages_per_seq=max_pages, dtype="bfloat16")
    # Each slot owns a ring, so slots are sized to what the budget can hold:
    # the model's prediction plus one, so that pages, not slots, run out first.
    predicted, _ = cap.sequences_in_budget(att, args.layers, budget, lengths,
                                           page_size=args.page_size, fmt=fmt)
    slots = min(predicted + 1, len(lengths))
    ring = cap.tail_bytes(att, args.layers, args.page_size, fmt)
    return kvx.CacheSpec(
        attention=att, num_layers=args.layers, page_size=args.page_size,
        num_pages=int((budget - slots * ring) // page), max_seqs=slots,
        max_pages_per_seq=max_pages, dtype="bfloat16",
        quant=QuantSpec(bits=layout.bits, group_size=args.group, residual=layout.residual),
    )


def _nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


@jax.jit
def _write_paged(cache, seq, start, n, a, b):
    chunk = a.shape[1]
    pos = start + jnp.arange(chunk)[None, :]
    slots = paged.token_slots(cache, pos, jnp.arange(chunk)[None, :] < n, seq[None])
    for layer in range(cache.spec.num_layers):
        cache = paged.write_layer(cache, layer, slots, a, b)
    return cache


@jax.jit
def _write_quant(cache, seq, a, b):
    for layer in range(cache.spec.num_layers):
        cache = qz.write_layer(cache, layer, a, b, seq[None])
    return cache


def fill(layout: Layout, spec: kvx.CacheSpec, lengths, args, rng):
    """Admits sequences in order until the allocator reports a full cache. Returns a dict."""
    quant = spec.quant is not None
    cache = kvx.cache.init_cache(spec)
    pools = _nbytes(cache.pages) + (_nbytes((cache.tail.a, cache.tail.b)) if quant else 0)
    h, d = args.kv_heads, args.head_dim
    a = jnp.asarray(rng.standard_normal((1, args.chunk, h, d)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((1, args.chunk, h, d)), jnp.bfloat16)
    reserve = kvx.cache.reserve
    admitted, tokens, stop = 0, 0, "all sequences fit"
    t0 = time.perf_counter()
    bar = tqdm(total=len(lengths), desc=layout.name, leave=False, file=sys.stderr)
    for seq, length in enumerate(lengths):
        if seq >= spec.max_seqs:
            stop = f"out of sequence slots ({spec.max_seqs})"
            break
        done, full = 0, False
        while done < length:
            n = min(args.chunk, length - done)
            num_new = np.zeros(spec.max_seqs, np.int32)
            num_new[seq] = n
            cache, status = reserve(cache, jnp.asarray(num_new))
            try:
                status.raise_if_error()
            except kvx.CacheFullError as e:
                stop, full = f"CacheFullError ({e.pages_needed} pages needed, " \
                             f"{e.pages_free} free)", True
                break
            sid = jnp.int32(seq)
            if quant:
                cache = _write_quant(cache, sid, a, b)
            else:
                cache = _write_paged(cache, sid, jnp.int32(done), jnp.int32(n), a, b)
            done += n
        if full:
            break
        admitted += 1
        tokens += length
        bar.update()
    bar.close()
    jax.block_until_ready(cache)
    elapsed = time.perf_counter() - t0
    table = cache.table
    check_invariants(table)
    held = np.asarray(cache.lengths)[:admitted]
    assert (held == np.asarray(lengths[:admitted])).all(), "lengths disagree with what was written"
    return dict(layout=layout.name, sequences=admitted, tokens=tokens, stop=stop,
                pool_bytes=pools, table_bytes=_nbytes(table), num_pages=spec.num_pages,
                max_seqs=spec.max_seqs, page_size=spec.page_size, fill_seconds=elapsed)


def main(argv=None):
    args = parse_args(argv)
    lengths = cap.length_spread(args.num_seqs, args.max_len, seed=args.seed)
    budget = int(args.budget_mib * 2**20)
    layouts = [
        Layout("contiguous bf16", None, contiguous=True),
        Layout("paged bf16", None),
        Layout("paged int4", 4),
        Layout("paged int2", 2),
        Layout(f"paged int2 +tail R={args.residual}", 2, residual=args.residual),
    ]
    rng = np.random.default_rng(args.seed)
    att = geometry(args)
    rows = []
    for layout in tqdm(layouts, desc="layouts", file=sys.stderr):
        spec = build_spec(layout, args, budget, lengths)
        row = fill(layout, spec, lengths, args, rng)
        fmt = fmt_of(layout, args)
        pred, _ = cap.sequences_in_budget(
            att, args.layers, budget, lengths, fmt=fmt,
            page_size=None if layout.contiguous else args.page_size,
            max_len=args.max_len if layout.contiguous else None)
        row["predicted_sequences"] = pred
        rows.append(row)
    base = {r["layout"]: r for r in rows}
    paged_bf16 = base["paged bf16"]
    for r in rows:
        r["tokens_vs_paged_bf16"] = r["tokens"] / max(paged_bf16["tokens"], 1)
        r["sequences_vs_contiguous"] = r["sequences"] / max(base["contiguous bf16"]["sequences"],
                                                           1)

    print(f"\nKV budget {args.budget_mib:g} MiB per layout; model {args.layers} layers x "
          f"{args.kv_heads} KV heads x head_dim {args.head_dim}; {len(lengths)} sequences, "
          f"lengths {min(lengths)}..{max(lengths)} (median {int(np.median(lengths))}, "
          f"log-normal), max_len {args.max_len}; page {args.page_size}, G {args.group}.")
    hdr = ["layout", "seqs", "predicted", "tokens", "x tokens paged bf16", "x seqs contiguous",
           "pool MiB", "stopped by"]
    table = [[r["layout"], r["sequences"], r["predicted_sequences"], f"{r['tokens']:,}",
              f"{r['tokens_vs_paged_bf16']:.2f}", f"{r['sequences_vs_contiguous']:.2f}",
              f"{r['pool_bytes'] / 2**20:.2f}", r["stop"]] for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(hdr, *table, strict=True)]
    for line in [hdr, ["-" * w for w in widths], *table]:
        print("  ".join(str(x).ljust(w) for x, w in zip(line, widths, strict=True)))
    mismatched = [r["layout"] for r in rows if r["sequences"] != r["predicted_sequences"]]
    if mismatched:
        print(f"WARNING: run and accounting disagree for {mismatched}")

    out = args.out or RESULTS / f"capacity{'-quick' if args.quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(
        args={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        budget_bytes=budget, lengths=lengths, rows=rows,
        machine=dict(platform=platform.platform(), jax=jax.__version__,
                     backend=jax.default_backend()),
    ), indent=1))
    print(f"wrote {out}")
    return rows


if __name__ == "__main__":
    main()
    sys.exit(0)
