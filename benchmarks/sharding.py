"""Per-device KV-cache bytes and decode-step time for 1, 2, 4, 8 devices per sharding strategy.

For each strategy ("heads" over a `model` axis, "sequences" over `data`,
"context" over `context`) and device count, the script builds a paged GQA
cache with `kvjax.sharding.init_sharded_cache`, fills every sequence to the
context length, and times a jitted decode step (write one token per sequence
into every layer, then `ShardedAttention` over every layer): warm-up, then the
median of --repeats runs, each ending in `block_until_ready`. Each step's
output is checked against the single-device XLA path in the same run.

Per-device bytes are read from the pools' `addressable_shards` (the largest
shard any device holds), not computed from the plan.

On CPU the devices are simulated (`--xla_force_host_platform_device_count`
style, via `jax_num_cpu_devices`): they share the same cores and memory, so the
table shows memory scaling and the overhead of the collectives and of
`shard_map`, NOT speed-up. The script prints which. On TPU/GPU it uses the real
devices (as many as exist, up to 8).

  python benchmarks/sharding.py --quick     # about a minute on a 2-core CPU
  python benchmarks/sharding.py --help

Results go to benchmarks/results/sharding-<backend>-<UTC time>.json.
"""

import argparse
import datetime
import functools
import json
import os
import pathlib
import platform
import statistics
import sys
import time

if "JAX_PLATFORMS" not in os.environ and "--cpu" in sys.argv:
    os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

# Only the CPU client reads this: without an accelerator, 8 simulated devices.
jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from kvjax import attention as kva  # noqa: E402
from kvjax import sharding as kvs  # noqa: E402
from kvjax.cache import layer_view, reserve  # noqa: E402
from kvjax.cache.paged import token_slots, write_layer  # noqa: E402
from kvjax.specs import AttentionSpec, CacheSpec  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
AXIS = {"heads": "model", "sequences": "data", "context": "context"}
PRESETS = {
    "quick": dict(layers=2, q_heads=16, kv_heads=8, head_dim=64, batch=8, context=512,
                  page_size=16),
    "full": dict(layers=4, q_heads=32, kv_heads=8, head_dim=128, batch=8, context=4096,
                 page_size=16),
}


def _spec(p, strategy, n):
    pages_per_seq = p["context"] // p["page_size"] + 1
    # Rounded up to a multiple of 8 so that every device count splits the pool evenly.
    num_pages = -(-p["batch"] * pages_per_seq // 8) * 8
    return CacheSpec(attention=AttentionSpec(q_heads=p["q_heads"], kv_heads=p["kv_heads"],
                                             head_dim=p["head_dim"]),
                     num_layers=p["layers"], page_size=p["page_size"], num_pages=num_pages,
                     max_seqs=p["batch"], max_pages_per_seq=pages_per_seq, dtype="float32")


def _step(cache, q, k, v, *, impl):
    pos = (cache.lengths - 1)[:, None]
    slots = token_slots(cache, pos, pos >= 0)
    outs = []
    for layer in range(cache.spec.num_layers):
        cache = write_layer(cache, layer, slots, k, v)
        view = layer_view(cache, layer)
        out, _ = kva.paged_decode_attention(q, view.k, view.v, view.lengths, view.block_tables,
                                            impl=impl)
        outs.append(out)
    return cache, jnp.stack(outs)


@functools.partial(jax.jit, static_argnames="spec")
def _fill_values(key, spec):
    a, b = spec.pool_shapes
    k1, k2 = jax.random.split(key)
    return (jax.random.normal(k1, a, spec.dtype), jax.random.normal(k2, b, spec.dtype))


def run_one(p, strategy, n, repeats, rng):
    plan = kvs.ShardingPlan(mesh=kvs.make_mesh((n,), (AXIS[strategy],)),
                            strategies=(strategy,))
    spec = _spec(p, strategy, n)
    cache = kvs.init_sharded_cache(spec, plan)
    cache, status = reserve(cache, jnp.full((spec.max_seqs,), p["context"], jnp.int32))
    status.raise_if_error()
    # Random pool contents (every page, so every read is of real data), laid out as planned.
    shardings = kvs.cache_shardings(plan, spec)
    ka, kb = _fill_values(jax.random.key(int(rng.integers(2**31))), spec)
    pages = type(cache.pages)(jax.device_put(ka, shardings.pages.k),
                              jax.device_put(kb, shardings.pages.v))
    cache = type(cache)(pages=pages, table=cache.table, spec=spec)
    b, hq, hk, d = spec.max_seqs, p["q_heads"], p["kv_heads"], p["head_dim"]
    q = jnp.asarray(rng.standard_normal((b, hq, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, 1, hk, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, 1, hk, d)), jnp.float32)
    per_device = max(
        sum(s.data.nbytes for pool in jax.tree.leaves(cache.pages)
            for s in pool.addressable_shards if s.device == dev)
        for dev in plan.mesh.devices.flat
    )
    # Reference on one device from host copies, before the sharded step donates the cache.
    host = jax.tree.map(np.asarray, cache)
    _, want = jax.jit(functools.partial(_step, impl="xla"))(host, q, k, v)
    step = jax.jit(functools.partial(_step, impl=kvs.ShardedAttention(plan)),
                   donate_argnums=0)
    cache, out = step(cache, q, k, v)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-4, atol=1e-4)
    times = []
    for _ in range(repeats):
        # The step writes at position length - 1 (already reserved): the table does not
        # change, so every timed step does the same work.
        t0 = time.perf_counter()
        cache, out = step(cache, q, k, v)
        out.block_until_ready()
        times.append(time.perf_counter() - t0)
    return dict(strategy=strategy, devices=n, per_device_cache_bytes=int(per_device),
                total_cache_bytes=int(sum(x.nbytes for x in jax.tree.leaves(host.pages))),
                step_ms=statistics.median(times) * 1e3, checked=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="small sizes (2 layers, 8 sequences of 512 tokens); the default is "
                         "the full preset (4 layers, 8 x 4096 tokens, head_dim 128)")
    ap.add_argument("--cpu", action="store_true",
                    help="force the CPU backend with 8 simulated devices")
    ap.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8],
                    help="device counts to run (each must divide the KV heads for 'heads')")
    ap.add_argument("--strategies", nargs="+", default=list(AXIS), choices=list(AXIS),
                    help="strategies to run")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per point (median)")
    ap.add_argument("--seed", type=int, default=0, help="random seed for the cache contents")
    ap.add_argument("--out", type=pathlib.Path, default=None,
                    help="JSON output path (default benchmarks/results/sharding-...json)")
    args = ap.parse_args(argv)
    p = PRESETS["quick" if args.quick else "full"]
    backend = jax.default_backend()
    simulated = backend == "cpu"
    available = len(jax.devices())
    counts = [n for n in args.devices if n <= available]
    rng = np.random.default_rng(args.seed)
    note = ("CPU with simulated devices: they share the host's cores and memory, so this shows "
            "per-device memory scaling and sharding overheads, NOT speed-up."
            if simulated else f"{available} real {backend} devices.")
    print(note)
    rows = []
    points = [(s, n) for s in args.strategies for n in counts]
    for strategy, n in tqdm(points, desc="sharding benchmark"):
        rows.append(run_one(p, strategy, n, args.repeats, rng))
    print(f"\n{'strategy':<10} {'devices':>7} {'cache MiB/device':>17} {'of total':>9} "
          f"{'step ms':>9}")
    for r in rows:
        frac = r["per_device_cache_bytes"] / r["total_cache_bytes"]
        print(f"{r['strategy']:<10} {r['devices']:>7} "
              f"{r['per_device_cache_bytes'] / 2**20:>17.2f} {frac:>9.3f} {r['step_ms']:>9.2f}")
    print(note)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or RESULTS / f"sharding-{backend}-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(preset="quick" if args.quick else "full", params=p,
                                   backend=backend, simulated_devices=simulated, note=note,
                                   host=platform.node(), jax=jax.__version__, rows=rows),
                              indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
