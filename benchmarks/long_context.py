"""A 4M-token context on one GPU: Llama-3-8B shapes, batch 1, KIVI int2 pages.

One run, on the machine it runs on:

1. the calculator's figure (`kvjax.memory`): the model's bf16 weights plus the int2 KV of
   `--context` tokens (group 32, a 128-token full-precision residual), and the same
   context in bf16 pages;
2. the bf16 configuration, built through `kvjax.generate.CacheConfig`: refused before
   anything is allocated, the bytes named (`init_cache` checks the device's free memory);
3. the int2 cache built and filled without a prefill: random keys and values written
   through the cache's own `reserve` / `write` (which quantize as they go), chunk by
   chunk; the device memory in use then, against the calculator's weights + KV;
4. timed decode steps through `kvjax.generate.stream` (the engine's jitted step: weights,
   attention over every cached token, greedy sampling), each step's median against

       (weight bytes + KV bytes) / read ceiling

   with the read ceiling measured in the same process (`benchmarks/gpu_peers.py`);
5. a check that fails the run: one layer's attention of the last token through the
   impl the model ran ("auto") against the XLA path over the same pages.

  python benchmarks/long_context.py --plan      # the sizes and bytes; allocates nothing
  python benchmarks/long_context.py             # an H200 (about 111 GiB of its 139)
  python benchmarks/long_context.py --quick     # toy sizes: runs anywhere
"""

import argparse
import dataclasses
import datetime
import json
import math
import os
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

GiB = 1 << 30
MODELS = {
    "llama3_8b": dict(preset="llama-3-8b", vocab_size=128256, hidden_size=4096,
                      intermediate_size=14336, num_layers=32, q_heads=32, kv_heads=8,
                      head_dim=128, theta=500000.0),
    "tiny": dict(preset=None, vocab_size=512, hidden_size=256, intermediate_size=512,
                 num_layers=2, q_heads=4, kv_heads=2, head_dim=64, theta=10000.0),
}


@dataclasses.dataclass(frozen=True)
class Run:
    model: str
    context: int
    bits: int
    group: int
    residual: int
    page_size: int
    new_tokens: int
    fill_chunk: int
    within: float


def parse(argv=None) -> tuple[argparse.Namespace, Run]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--plan", action="store_true", help="print the sizes and exit")
    p.add_argument("--quick", action="store_true",
                   help="a 2-layer toy model and 8192 tokens (the same steps, any machine)")
    p.add_argument("--context", type=int, default=None,
                   help="tokens of context (default 4194304; --quick 8192)")
    p.add_argument("--bits", type=int, choices=[2, 4, 8], default=2, help="KIVI code width")
    p.add_argument("--new-tokens", type=int, default=6, help="decode steps to time (>= 2)")
    p.add_argument("--fill-chunk", type=int, default=8192, help="tokens written per fill call")
    p.add_argument("--within", type=float, default=1.3,
                   help="the step must be within this factor of its bound (default 1.3)")
    p.add_argument("--device-gib", type=float, default=139.0,
                   help="--plan only: the device memory to plan against (default 139 GiB, an "
                        "H200's)")
    p.add_argument("--json", type=pathlib.Path, default=None,
                   help="result path (default benchmarks/results/long-context-<time>.json)")
    a = p.parse_args(argv)
    if a.new_tokens < 2:
        p.error(f"--new-tokens must be >= 2 (the first step is not timed), got {a.new_tokens}")
    context = a.context or (8192 if a.quick else 4 * 1024 * 1024)
    run = Run(model="tiny" if a.quick else "llama3_8b", context=context, bits=a.bits,
              group=32, residual=128, page_size=128, new_tokens=a.new_tokens,
              fill_chunk=min(a.fill_chunk, context), within=a.within)
    if run.context % run.fill_chunk or run.fill_chunk % run.page_size:
        p.error(f"--context ({run.context}) must be a multiple of --fill-chunk "
                f"({run.fill_chunk}), and that of the page size ({run.page_size})")
    return a, run


def llama_config(run: Run, dtype: str = "bfloat16"):
    from kvjax.models.llama import LlamaConfig
    from kvjax.rope import RopeConfig

    g = {k: v for k, v in MODELS[run.model].items() if k != "preset"}
    theta = g.pop("theta")
    return LlamaConfig(**g, rope=RopeConfig(theta=theta, dim=g["head_dim"]), dtype=dtype)


def cache_configs(run: Run):
    """{name: CacheConfig} of the KIVI cache run and the bf16 one that must be refused."""
    from kvjax import generate as gen
    from kvjax.specs import QuantSpec

    quant = QuantSpec(bits=run.bits, group_size=run.group, residual=run.residual)
    return {f"int{run.bits}": gen.CacheConfig(dtype="bfloat16", quant=quant,
                                              page_size=run.page_size),
            "bf16": gen.CacheConfig(dtype="bfloat16", page_size=run.page_size)}


def room(run: Run) -> int:
    return run.context + run.new_tokens + run.page_size


def plan(run: Run) -> dict:
    """The calculator's bytes and the caches' own (from shapes alone)."""
    import jax

    from kvjax import memory
    from kvjax.cache import ops
    from kvjax.models.base import get_family

    config = llama_config(run)
    fam = get_family("llama")
    model = fam.model(config)
    params = jax.eval_shape(lambda: fam.init_params(config, jax.random.key(0)))
    weights = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params))
    out = dict(model=run.model, weight_bytes=weights, caches={})
    fmts = {f"int{run.bits}": memory.kv_format(bits=run.bits, group_size=run.group,
                                               residual=run.residual), "bf16": "bf16"}
    attn = model.make_cache_spec(page_size=run.page_size, num_pages=1, max_seqs=1,
                                 max_pages_per_seq=1).attention
    for name, cc in cache_configs(run).items():
        spec = cc.spec(model, num_seqs=1, max_tokens=room(run))
        out["caches"][name] = dict(
            calculator_kv_bytes=float(memory.bytes_per_sequence(attn, config.num_layers,
                                                                run.context, fmts[name])),
            device_bytes=ops.cache_device_bytes(spec), num_pages=spec.num_pages)
    return out


def size(nbytes: float) -> str:
    """Bytes in GiB, or MiB below one GiB."""
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB else f"{nbytes / 2**20:.2f} MiB"


def describe(run: Run, pl: dict, device_gib: float) -> str:
    lines = [f"model {run.model} ({size(pl['weight_bytes'])} of bf16 weights), batch 1, "
             f"{run.context} tokens, pages of {run.page_size}"]
    for name, c in pl["caches"].items():
        total = pl["weight_bytes"] + c["device_bytes"]
        fits = "fits" if total <= device_gib * GiB else "does not fit"
        lines.append(f"  {name:5} pages: calculator KV {size(c['calculator_kv_bytes']):>11}, "
                     f"cache allocates {size(c['device_bytes']):>11}; with the weights "
                     f"{size(total):>11}: {fits} in {device_gib:g} GiB")
    return "\n".join(lines)


def main(argv=None) -> int:
    a, run = parse(argv)
    if not a.plan and not a.quick:
        # Before the backend starts: the run needs ~111 GiB of an H200's 139.
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    from benchmarks import gpu_peers

    torch_read = None if a.plan else gpu_peers.torch_read_gbps(4.0, 10)  # before jax's pool
    import jax
    import jax.numpy as jnp
    import numpy as np
    from tqdm import tqdm

    from benchmarks.offload import _fill_chunk as fill_chunk
    from benchmarks.offload import kv_table, live_bytes
    from kvjax import attention
    from kvjax import generate as gen
    from kvjax.cache import ops
    from kvjax.models.base import get_family

    pl = plan(run)
    print(describe(run, pl, a.device_gib), flush=True)
    if a.plan:
        return 0
    dev = jax.devices()[0]
    result = dict(benchmark="long_context", run=dataclasses.asdict(run), plan=pl,
                  device=dev.device_kind, backend=jax.default_backend(), jax=jax.__version__,
                  date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
    config = llama_config(run)
    fam = get_family("llama")
    model = fam.model(config)
    configs = cache_configs(run)
    name = f"int{run.bits}"

    # 2. bf16 pages: refused before allocating where the device reports its memory.
    try:
        configs["bf16"].build(model, num_seqs=1, max_tokens=room(run))
        result["bf16_refused"] = None
        print("bf16 pages: built (this device has room for them, or does not report its "
              "memory)")
    except ValueError as e:
        result["bf16_refused"] = str(e)
        print(f"bf16 pages: refused: {e}")

    # 3. The KIVI cache, filled without a prefill.
    copy = gpu_peers.copy_gbps(1024 if run.model != "tiny" else 64)
    ceiling = max(copy, torch_read or 0.0)
    params = fam.init_params(config, jax.random.key(0))
    cache = configs[name].build(model, num_seqs=1, max_tokens=room(run))
    table = kv_table(config, 1)
    t0 = time.perf_counter()
    steps = run.context // run.fill_chunk
    for i in tqdm(range(steps), desc="fill", file=sys.stderr):
        cache, status = fill_chunk(cache, table, jnp.int32(i * run.fill_chunk),
                                   jnp.int32(run.fill_chunk), chunk=run.fill_chunk)
        status.raise_if_error()
    jax.block_until_ready(cache)
    result["fill_s"] = time.perf_counter() - t0
    stats = dev.memory_stats() or {}
    predicted = pl["weight_bytes"] + pl["caches"][name]["calculator_kv_bytes"]
    result["memory"] = dict(in_use=stats.get("bytes_in_use"), predicted=predicted)
    if stats.get("bytes_in_use"):
        ratio = stats["bytes_in_use"] / predicted
        result["memory"]["ratio"] = ratio
        print(f"device memory in use {stats['bytes_in_use'] / GiB:.2f} GiB against the "
              f"calculator's {predicted / GiB:.2f} GiB (x{ratio:.3f})")

    # 4. Timed decode steps.
    kv_bytes = live_bytes(cache, 1)[0]
    bound = (pl["weight_bytes"] + kv_bytes) / (ceiling * 1e9)
    first = [[int(np.random.default_rng(0).integers(0, config.vocab_size))]]
    times = []
    t0 = time.perf_counter()
    for ev in gen.stream(model, params, first, key=jax.random.key(0),
                         max_new_tokens=run.new_tokens, cache=cache, free_finished=False):
        jax.block_until_ready(ev.state.cache)
        t1 = time.perf_counter()
        times.append(t1 - t0)
        t0 = t1
        cache = ev.state.cache
    step = statistics.median(times[1:])
    result.update(kv_bytes_read=kv_bytes, read_ceiling_gbps=ceiling, torch_read_gbps=torch_read,
                  copy_gbps=copy, step_s=times[1:], median_step_s=step, bound_s=bound,
                  ratio=step / bound)
    print(f"decode step {step * 1e3:.2f} ms; bound (weights {size(pl['weight_bytes'])} + KV "
          f"{size(kv_bytes)} at {ceiling:.0f} GB/s) {bound * 1e3:.2f} ms: x{step / bound:.2f} "
          f"(required <= {run.within}{'; not enforced at --quick sizes' if a.quick else ''})")

    # 5. One layer's attention through "auto" against the XLA path on the same pages.
    view = ops.layer_view(cache, 0)
    q = jax.random.normal(jax.random.key(3), (1, config.q_heads, config.head_dim),
                          jnp.float32).astype(jnp.bfloat16)
    got = attention.quantized_decode_attention(q, view, impl="auto")[0]
    want = attention.quantized_decode_attention(q, view, impl="xla")[0]
    err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
    result["check_max_abs_err"] = err
    ok = err <= 3e-2 and (a.quick or step / bound <= run.within)
    result["ok"] = ok
    out = a.json or (pathlib.Path(__file__).resolve().parent / "results"
                     / f"long-context-{result['date'].replace(':', '')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"check: auto vs xla attention max error {err:.1e}; wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
