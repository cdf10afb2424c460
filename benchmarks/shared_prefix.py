"""Decode attention on CPU over sequences that share a prefix's pages.

B sequences of a P-token common prefix (a system prompt, served from the prefix cache)
plus S tokens of their own, one decode query each, through the C++ paged decode kernel
in three layouts, interleaved in one run:

  private    each sequence holds its own copy of the prefix (no prefix caching): the
             kernel reads B x (P + S) tokens;
  shared     the sequences' block tables begin with the same pages, read once per
             sequence (`CpuOptions.share=0`);
  runs       the same tables, the shared pages read once per KV head for all of the
             sequences together (`share`, the default; `kvjax.backends.cpu.shared_runs`).

Reported: the median (min-max) wall time of a call, each layout's ratio to `private`
and `shared`, and the bandwidth of the bytes each layout must read (private: every
sequence's keys and values; shared and runs: the prefix once and each sequence's own
tokens) against a streaming read of the same machine. The three outputs must be the
same bits (the copies hold the same values, and a run computes each row as alone) and
match the gather reference.

    python benchmarks/shared_prefix.py             # B=8, 8 KV heads x 4 rows, d=128, P=2048, S=256
    python benchmarks/shared_prefix.py --quick     # small, seconds
"""

import argparse
import datetime
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks import result_path  # noqa: E402
from benchmarks.attention import _time_interleaved, measure_bandwidth  # noqa: E402
from benchmarks.kv_bits import machine  # noqa: E402
from kernels_pallas.paged_attention import reference as paged_ref  # noqa: E402
from kvjax.backends import cpu  # noqa: E402


def layouts(rng, *, batch, prefix, own, page_size):
    """Block tables of the private and shared layouts over one pool, and the pool size."""
    pp, op = prefix // page_size, -(-own // page_size)
    pages = batch * (pp + op)
    perm = rng.permutation(pages)
    private = perm.reshape(batch, pp + op)
    # The shared layout: sequence 0's prefix pages for all, each its own tail pages.
    shared = np.concatenate([np.broadcast_to(private[0, :pp], (batch, pp)), private[:, pp:]],
                            axis=1)
    return private, shared, pages


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--quick", action="store_true", help="small shapes, few repeats")
    parser.add_argument("--batch", type=int, default=8, help="sequences (default 8)")
    parser.add_argument("--prefix", type=int, default=None,
                        help="shared tokens, a multiple of the page size (default 2048)")
    parser.add_argument("--own", type=int, default=None,
                        help="each sequence's own tokens (default 256)")
    parser.add_argument("--kv-heads", type=int, default=None, help="default 8")
    parser.add_argument("--group", type=int, default=4, help="query heads per KV head")
    parser.add_argument("--head-dim", type=int, default=None, help="default 128")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=None, help="default 40 (--quick 10)")
    parser.add_argument("--share", type=int, default=None,
                        help="the runs layout's CpuOptions.share (default: the options in "
                             "force, 512 unless KVJAX_CPU_SHARE says otherwise)")
    parser.add_argument("--bandwidth-mib", type=int, default=256,
                        help="array size of the streaming-read measurement (default 256)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/)")
    a = parser.parse_args(argv)
    prefix = a.prefix or (256 if a.quick else 2048)
    own = a.own or (64 if a.quick else 256)
    kvh = a.kv_heads or (2 if a.quick else 8)
    d = a.head_dim or (64 if a.quick else 128)
    repeats = a.repeats or (10 if a.quick else 40)
    if prefix % a.page_size or min(a.batch, prefix, own, kvh, a.group, d, repeats,
                                       a.bandwidth_mib) < 1:
        parser.error(f"--prefix must be a positive multiple of --page-size ({a.page_size}) "
                     f"and every size >= 1; got prefix {prefix}, own {own}, batch {a.batch}")
    if not cpu.available():
        print(f"the CPU kernels are unavailable: {cpu.unavailable_reason()}")
        return 1
    mach = machine()
    dtype = jnp.dtype(a.dtype)
    print(f"{mach['cpu']}, {mach['cpus']} cpus; {a.batch} sequences x ({prefix} shared + "
          f"{own} own) tokens, {kvh} KV heads x {a.group}, d={d}, {dtype.name} pages of "
          f"{a.page_size}")
    rng = np.random.default_rng(a.seed)
    private, shared, pages = layouts(rng, batch=a.batch, prefix=prefix, own=own,
                                     page_size=a.page_size)
    k = jnp.asarray(rng.standard_normal((kvh, pages, a.page_size, d)), dtype)
    v = jnp.asarray(rng.standard_normal((kvh, pages, a.page_size, d)), dtype)
    # The private layout holds copies of sequence 0's prefix pages: the same values.
    pp = prefix // a.page_size
    src = jnp.asarray(np.broadcast_to(private[0, :pp], (a.batch - 1, pp)).reshape(-1))
    dst = jnp.asarray(private[1:, :pp].reshape(-1))
    k, v = (x.at[:, dst].set(x[:, src]) for x in (k, v))
    q = jnp.asarray(rng.standard_normal((a.batch, kvh * a.group, d)), jnp.float32)
    lengths = jnp.full((a.batch,), prefix + own, jnp.int32)
    share = cpu.get_options().share if a.share is None else a.share
    if share < 1:
        parser.error(f"--share must be >= 1 (the runs layout takes runs), got {share}")
    run_of, _ = cpu.shared_runs(np.asarray(lengths), shared, page_size=a.page_size,
                                group=a.group, kv_heads=kvh, share=share)
    calls = {}
    for name, tables, s in (("private", private, share), ("shared", shared, 0),
                            ("runs", shared, share)):
        with cpu.override(share=s):
            fn = jax.jit(lambda *x: cpu.paged_decode_attention(*x))
            jax.block_until_ready(fn(q, k, v, lengths, jnp.asarray(tables, jnp.int32)))
        calls[name] = (fn, (q, k, v, lengths, jnp.asarray(tables, jnp.int32)))
    bw = measure_bandwidth(a.bandwidth_mib << 20, 10)
    stats, outs = _time_interleaved(calls, repeats)

    want = jax.jit(paged_ref.paged_decode_attention)(q, k, v, lengths,
                                                     jnp.asarray(shared, jnp.int32))
    tol = 2e-5 if dtype == jnp.float32 else 1e-2
    err = float(jnp.max(jnp.abs(outs["private"][0].astype(jnp.float32)
                                - want[0].astype(jnp.float32))))
    same = all(bool(jnp.array_equal(outs[n][i], outs["private"][i]))
               for n in ("shared", "runs") for i in (0, 1))
    ok = same and err <= tol and bool(np.all(run_of >= 0))

    row_bytes = 2 * kvh * d * dtype.itemsize  # keys and values of one token
    must_read = {"private": a.batch * (prefix + own) * row_bytes,
                 "shared": (prefix + a.batch * own) * row_bytes}
    must_read["runs"] = must_read["shared"]
    rows = {}
    print(f"\nstreaming read {bw['read_GBps']:.1f} GB/s\n")
    print("| layout | ms (min-max) | vs private | vs shared | GB/s of the bytes to read "
          "| of streaming read |")
    print("|---|---|---|---|---|---|")
    for name, st in stats.items():
        t = st["wall_median_s"]
        gbps = must_read[name] / t / 1e9
        rows[name] = dict(**st, bytes=must_read[name], GBps=gbps,
                          vs_private=stats["private"]["wall_median_s"] / t,
                          vs_shared=stats["shared"]["wall_median_s"] / t)
        print(f"| {name} | {1e3 * t:.3f} ({1e3 * st['wall_min_s']:.3f}-"
              f"{1e3 * st['wall_max_s']:.3f}) | {rows[name]['vs_private']:.2f}x | "
              f"{rows[name]['vs_shared']:.2f}x | {gbps:.1f} | {gbps / bw['read_GBps']:.0%} |")
    print(f"\noutputs identical across layouts: {same}; max |error| vs the reference "
          f"{err:.2g} (bound {tol}); every sequence in a run: {bool(np.all(run_of >= 0))}")
    result = dict(benchmark="shared_prefix", machine=mach, args=vars(a), prefix=prefix,
                  own=own, kv_heads=kvh, head_dim=d, share=share, bandwidth=bw, rows=rows,
                  identical=same, max_err=err, ok=ok,
                  date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
    out = result_path(f"shared_prefix-{'quick-' if a.quick else ''}", a.out)
    with open(out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"wrote {out}")
    if not ok:
        print("FAILED: the layouts' outputs differ, or differ from the reference, or a "
              "sequence formed no run")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
