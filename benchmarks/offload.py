"""Decode with part of every sequence's KV cache in host memory, against a bandwidth bound.

The host tier (`kvjax.cache.host`) keeps the leading pages of a sequence in
`pinned_host` memory; each decode step gathers them there, copies them to the device
and merges their attention with the device pages' by log-sum-exp. One run of this
script measures, on the machine it runs on:

1. bandwidth: `jax.device_put` of a `--probe-mib` float32 array from device memory
   to `pinned_host` and back, the streaming read of device memory (a jitted sum over
   the same array), and the tier's own page copies (`host.move` of every slot's pages
   to the host and back, timed in every trial); warmed up, blocked until ready,
   medians;
2. the decode step of a Llama-shaped model with random float32 weights: the engine's
   whole step (`kvjax.generate.stream`: weights, attention over the cache, greedy
   sampling; one jitted step per token), timed rather than attention alone because
   the step is what a user waits for; its weight bytes are counted in the bound. The
   cache holds `--context` tokens per row; 0%, 50% and 90% of each row's
   context is moved to the host after filling (`host.move` on every slot), on a
   bf16 cache and a KIVI int4 cache. Reported per row: the median step and the bound

       host KV bytes / host->device bandwidth + (weights + device KV bytes) / read bandwidth

   (every byte a step must move, once, the copy not overlapped with the device
   reads; host->device is the faster of the two measured host->device copies), and
   the ratio step / bound;
3. a check that fails the run: the greedy tokens at every host share equal those
   at 0%, for the same cache format, or differ only at a near tie: a random model's
   next-token distribution is nearly flat, and on CPU the KIVI kernel's integer
   arithmetic (device pages) and the host part's float32 dequantization round
   differently, so a tie within ~1e-5 nats can flip. Differing tokens are therefore
   teacher-forced through both shares (`kvjax.generate.score`) and pass only if every
   log-probability agrees within TIE_NATS (1e-3) and the flipped pair was that close
   under the reference. The bf16 host bytes are also checked against
   `kvjax.memory.host_tier_bytes`.

Each trial builds a fresh cache, writes the same random K/V into it through the
cache's own `reserve` / `write` (no prompt processing: the context is random keys
and values, the same in every trial), attaches a host tier sized for the share
(`stream_pages` = the pages moved, since decode attention copies that many pages of
every row in each layer), moves the pages, decodes `--new-tokens` greedy tokens from
the same first token, and moves the pages back. Round 0 is a warm-up (it compiles;
its tokens are checked, its times dropped); then the caches and shares are timed in
turn within each of `--repeats` rounds (a shared machine's speed drifts by the minute).

    python benchmarks/offload.py              # CPU: 34M Llama, batch 4 x 4K, bf16 + int4
    python benchmarks/offload.py --quick      # seconds: tiny model, batch 2 x 512
    python benchmarks/offload.py --gpu        # H200: Llama-3-8B shape, 2x a 16 GiB KV budget
    python benchmarks/offload.py --gpu --quick   # the GPU preset at toy sizes (runs on CPU)
    python benchmarks/offload.py --gpu --plan    # sizes and bytes only; allocates nothing

`--gpu`: 32 layers, 8 KV heads x 128, 32 query heads, hidden 4096, MLP 14336, vocab
128256 (Llama-3-8B's shapes; random float32 weights and float32 matmuls at "highest"
precision, so that the two attention paths' rounding is unlikely to flip a near-tied
greedy token), a bf16 cache holding twice `--device-budget-gib` (default 16 GiB) of
context over batch 8, so that at 50% each tier holds the budget. The device pool is
sized for the whole context (the 0% reference needs it); the host pool for the 90%
share is 0.9 x 2 x the budget of pinned RAM (28.8 GiB at 16 GiB: the machine has
128 GiB of RAM, less than its 139 GiB of HBM, and `host.attach` stages the host pool's
zeros on the device).
It reports each share's step against the bound and whether it is within `--within`
(1.3x), and stops timing new rounds past `--time-limit` seconds.
"""

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time
import traceback
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kvjax.generate as gen  # noqa: E402
from benchmarks import result_path  # noqa: E402
from benchmarks.kv_bits import machine as cpu_machine  # noqa: E402
from kvjax import cache as kvc  # noqa: E402
from kvjax.cache import host  # noqa: E402
from kvjax.cache import quantized as qz  # noqa: E402
from kvjax.memory import accounting, host_tier_bytes  # noqa: E402
from kvjax.models.base import get_family  # noqa: E402
from kvjax.models.llama import LlamaConfig  # noqa: E402
from kvjax.rope import RopeConfig  # noqa: E402
from kvjax.specs import AttentionSpec, QuantSpec  # noqa: E402

GiB = 1 << 30

# Model geometries (random weights); nothing is built until a run asks for one.
MODELS = dict(
    tiny=dict(vocab_size=512, hidden_size=256, intermediate_size=256, num_layers=2,
              q_heads=4, kv_heads=2, head_dim=64, theta=10000.0),
    cpu=dict(vocab_size=2048, hidden_size=1024, intermediate_size=1024, num_layers=4,
             q_heads=8, kv_heads=8, head_dim=128, theta=500000.0),
    llama3_8b=dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                   num_layers=32, q_heads=32, kv_heads=8, head_dim=128, theta=500000.0),
)

# context=None: derived from the device budget (twice the budget over the batch).
PRESETS = dict(
    cpu=dict(model="cpu", caches="bf16,int4", batch=4, context=4096, budget_gib=None,
             new_tokens=8, repeats=3, probe_mib=512, time_limit=None),
    quick=dict(model="tiny", caches="bf16,int4", batch=2, context=512, budget_gib=None,
               new_tokens=4, repeats=1, probe_mib=64, time_limit=None),
    gpu=dict(model="llama3_8b", caches="bf16", batch=8, context=None, budget_gib=16.0,
             new_tokens=5, repeats=2, probe_mib=4096, time_limit=400.0),
    gpu_quick=dict(model="tiny", caches="bf16", batch=2, context=None, budget_gib=1 / 1024,
                   new_tokens=4, repeats=1, probe_mib=64, time_limit=400.0),
)

CACHES = {"bf16": None, "int4": 4}
# Differing greedy tokens pass only as a near tie: teacher-forced log-probabilities within
# this many nats. The KIVI CPU kernel's integer logits and values (kvjax's documented
# ~1e-5 relative error) against the host part's float32 dequantization moved them by
# ~5e-5 on the default run; a dropped or misplaced page moves them by far more.
TIE_NATS = 1e-3
TABLE_TOKENS = 1021  # rows of the random K/V table the fill reads from (prime: no aliasing)


# ----------------------------------------------------------------------------- setup


@dataclasses.dataclass(frozen=True, kw_only=True)
class Run:
    """The resolved sizes of one run (plain numbers; nothing allocated)."""

    preset: str
    model: str
    caches: tuple[str, ...]
    fractions: tuple[Fraction, ...]
    batch: int
    context: int
    budget_bytes: int | None
    page_size: int
    new_tokens: int
    repeats: int
    probe_mib: int
    time_limit: float | None
    within: float
    seed: int


def llama(name: str) -> LlamaConfig:
    g = dict(MODELS[name])
    theta = g.pop("theta")
    return LlamaConfig(**g, rope=RopeConfig(theta=theta, dim=g["head_dim"]), dtype="float32")


def attention_spec(config: LlamaConfig) -> AttentionSpec:
    return AttentionSpec(q_heads=config.q_heads, kv_heads=config.kv_heads,
                         head_dim=config.head_dim)


def cache_config(name: str, page_size: int) -> gen.CacheConfig:
    bits = CACHES[name]
    quant = None if bits is None else QuantSpec(bits=bits, group_size=32, residual=page_size)
    return gen.CacheConfig(dtype="bfloat16", quant=quant, page_size=page_size)


def host_pages_for(run: Run, name: str, fraction: Fraction, spec) -> int:
    """Pages per row the share puts on the host: floor(F L / P), capped at the movable
    pages (every page but the last; KIVI: the quantized pages)."""
    ps = run.page_size
    if CACHES[name] is None:
        movable = -(-run.context // ps) - 1
    else:
        movable = qz.quantized_tokens(spec, run.context) // ps
    return min(math.floor(fraction * run.context / ps), movable)


def nbytes(tree) -> int:
    return int(sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(tree)))


def plan(run: Run) -> dict:
    """Bytes of every pool and tier, from shapes alone (`jax.eval_shape`: no allocation)."""
    config = llama(run.model)
    fam = get_family("llama")
    params = jax.eval_shape(lambda: fam.init_params(config, jax.random.key(0)))
    weights = nbytes(params) - config.vocab_size * config.hidden_size * 4  # embedding: rows
    model = fam.model(config)
    out = dict(model=run.model, params=sum(math.prod(x.shape) for x in jax.tree.leaves(params)),
               weight_bytes_read=weights, caches={})
    for name in run.caches:
        cc = cache_config(name, run.page_size)
        cache = jax.eval_shape(lambda cc=cc: cc.build(model, num_seqs=run.batch,
                                                      max_tokens=room(run)))
        spec = cache.spec
        page = nbytes(cache.pages) / spec.num_pages
        shares = {}
        for f in run.fractions:
            n = host_pages_for(run, name, f, spec)
            shares[str(f)] = dict(host_pages_per_row=n, host_pool_bytes=int(page * n * run.batch))
        out["caches"][name] = dict(device_pool_bytes=nbytes(cache.pages), page_bytes=page,
                                   num_pages=spec.num_pages, shares=shares)
    return out


def room(run: Run) -> int:
    """Tokens a row needs: the context, the decoded tokens, a page of slack."""
    return run.context + run.new_tokens + run.page_size


# ----------------------------------------------------------------------------- bandwidth


def _median_time(f, x, repeats: int) -> float:
    jax.block_until_ready(f(x))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def bandwidth_probe(mib: int, repeats: int = 5):
    """A function measuring (device->host, host->device, device read) in GB/s.

    device->host / host->device: `jax.device_put` of a `mib` MiB float32 array between
    the device's `device` and `pinned_host` memories (a jitted copy in the runtime);
    read: a jitted `jnp.sum` over the same array in device memory. Medians of `repeats`
    calls after a warm-up.
    """
    dev = jax.devices()[0]
    to_host = jax.sharding.SingleDeviceSharding(dev, memory_kind=host.HOST_MEMORY)
    to_dev = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    x = jnp.ones((mib << 20) // 4, jnp.float32)
    xh = jax.device_put(x, to_host)
    total = jax.jit(jnp.sum)
    n = x.nbytes

    def probe() -> dict:
        return dict(
            put_d2h_GBps=n / _median_time(lambda a: jax.device_put(a, to_host), x, repeats) / 1e9,
            put_h2d_GBps=n / _median_time(lambda a: jax.device_put(a, to_dev), xh, repeats) / 1e9,
            read_GBps=n / _median_time(total, x, repeats) / 1e9)
    return probe


# ----------------------------------------------------------------------------- the cache


def kv_table(config: LlamaConfig, seed: int) -> jax.Array:
    """float32[2, TABLE_TOKENS, kv_heads, head_dim]: the random keys and values the fill
    writes (a table read at shifted offsets: no random draws per token)."""
    return jax.random.normal(jax.random.key(seed), (2, TABLE_TOKENS, config.kv_heads,
                                                    config.head_dim), jnp.float32)


@functools.partial(jax.jit, static_argnames="chunk", donate_argnames="cache")
def _fill_chunk(cache, table, start, count, *, chunk: int):
    spec = cache.spec
    rows = spec.max_seqs
    cache, status = kvc.reserve(cache, jnp.full((rows,), count, jnp.int32))
    pos = start + jnp.arange(chunk)
    q_lengths = jnp.full((rows,), count, jnp.int32)

    def layer(i, c):  # row b, layer i, position p reads table row (p + 97 b + 389 i) mod T
        idx = (pos[None, :] + 97 * jnp.arange(rows)[:, None] + 389 * i) % table.shape[1]
        return kvc.write(c, i, table[0][idx], table[1][idx], q_lengths=q_lengths)

    return jax.lax.fori_loop(0, spec.num_layers, layer, cache), status


def fill(cache, table, context: int, chunk: int = 2048):
    """`context` tokens of the table's keys and values in every slot, through the cache's
    own `reserve` and `write` (a KIVI cache quantizes its full pages as it goes)."""
    chunk = min(chunk, context)
    for start in range(0, context, chunk):
        cache, status = _fill_chunk(cache, table, jnp.int32(start),
                                    jnp.int32(min(chunk, context - start)), chunk=chunk)
        status.raise_if_error()
    return cache


def live_bytes(cache, rows: int) -> tuple[int, int]:
    """(device KV bytes, host KV bytes) a decode step reads for rows 0..rows-1: the rows'
    device pages (KIVI: quantized pages and every row's ring) and their host pages."""
    spec, ps = cache.spec, cache.spec.page_size
    h = np.asarray(host.host_pages(cache))[:rows]
    page = nbytes(cache.pages) / spec.num_pages
    if cache.tail is None:
        dev = float(((-(-np.asarray(cache.lengths)[:rows] // ps)) - h).sum() * page)
    else:
        dev = float(((np.asarray(cache.quant_lengths)[:rows] // ps) - h).sum() * page)
        dev += nbytes((cache.tail.a, cache.tail.b)) * rows / spec.max_seqs
    hbytes = 0.0
    if cache.host is not None:
        hbytes = float(h.sum() * nbytes(cache.host.pages) / cache.host.num_pages)
    return int(round(dev)), int(round(hbytes))


def move_all(cache, rows: int, n: int):
    """Every row's first n pages on the host (host.move slot by slot); blocks."""
    statuses = []
    for s in range(rows):
        cache, st = host.move(cache, s, n)
        statuses.append(st)
    jax.block_until_ready(cache)
    for st in statuses:
        st.raise_if_error()
    return cache


def prepare(run: Run, model, table, name: str, n: int):
    """A fresh cache holding the filled context, n pages of every row on the host
    (n = 0: no host tier); returns (cache, seconds the move to the host took)."""
    b = run.batch
    cache = cache_config(name, run.page_size).build(model, num_seqs=b, max_tokens=room(run))
    cache = fill(cache, table, run.context)
    if not n:
        return cache, None
    cache = host.attach(cache, b * n, stream_pages=n)
    jax.block_until_ready(cache)
    t0 = time.perf_counter()
    cache = move_all(cache, b, n)
    seconds = time.perf_counter() - t0
    host.check(cache)
    got = np.asarray(host.host_pages(cache))[:b]
    if not (got == n).all():
        raise AssertionError(f"host.move left {got.tolist()} host pages per row, not {n}")
    return cache, seconds


def trial(run: Run, model, params, table, name: str, n: int, first, new_tokens: int) -> dict:
    """One fresh cache: fill, move n pages per row out, decode, move them back."""
    b = run.batch
    cache, move_out = prepare(run, model, table, name, n)
    out = dict(move_out_s=move_out, move_in_s=None)
    out["device_kv_bytes"], out["host_kv_bytes"] = live_bytes(cache, b)
    out["moved_bytes"] = out["host_kv_bytes"]
    times, tokens = [], []
    t0 = time.perf_counter()
    for ev in gen.stream(model, params, first, key=jax.random.key(0),
                         max_new_tokens=new_tokens, cache=cache, free_finished=False):
        jax.block_until_ready(ev.state.cache)
        t1 = time.perf_counter()
        times.append(t1 - t0)
        tokens.append(ev.tokens)
        t0 = t1
        cache = ev.state.cache
    del ev
    if n:
        t0 = time.perf_counter()
        cache = move_all(cache, b, 0)
        out["move_in_s"] = time.perf_counter() - t0
        host.check(cache)
    del cache
    # times[0]: the first token's step (its prompt token written, as a 1-token prefill).
    out.update(step_s=times[1:], tokens=np.stack(tokens, axis=1))
    return out


def near_tie(run: Run, model, params, table, first, name: str, refs: tuple[int, np.ndarray],
             n: int, toks: np.ndarray) -> dict:
    """Whether greedy tokens that differ from the reference's flipped at a near tie.

    Teacher-forced log-probabilities (`kvjax.generate.score`, the same step function):
    the reference tokens under the reference share and under this one, and, at each
    differing row's first differing step s, the margin by which the reference share
    preferred its token r over this share's token a (lp(r) - lp(a) >= 0). A tie is
    when both the margin and every per-step difference stay within TIE_NATS.
    """
    n_ref, ref = refs
    rows = np.nonzero((toks != ref).any(axis=1))[0]
    steps = {int(b): int(np.argmax(toks[b] != ref[b])) for b in rows}
    alt = [ref[b, : steps[b]].tolist() + [int(toks[b, steps[b]])] if b in steps
           else ref[b, :1].tolist() for b in range(run.batch)]

    def score(pages, continuations):
        cache, _ = prepare(run, model, table, name, pages)
        return gen.score(model, params, first, continuations, cache=cache,
                         free_finished=False).logprobs

    lp_ref, lp_here = score(n_ref, ref.tolist()), score(n, ref.tolist())
    lp_alt = score(n_ref, alt)
    margins = {b: float(lp_ref[b, s] - lp_alt[b, s]) for b, s in steps.items()}
    drift = float(np.max(np.abs(lp_ref - lp_here)))
    return dict(rows=[int(b) for b in rows], first_steps=steps, margins_nats=margins,
                max_logprob_diff_nats=drift,
                tie=bool(drift <= TIE_NATS and max(margins.values()) <= TIE_NATS))


def tokens_verdict(t: dict) -> str:
    if t["tokens_same_as_reference"] == 1.0:
        return "same"
    return "near tie" if t["near_tie"]["tie"] else "DIFFER"


def check_trial(run: Run, config: LlamaConfig, t: dict, ref_tokens: dict, diagnose) -> list[str]:
    """The trial's greedy tokens against its cache format's first trial (the reference;
    differing tokens go to `diagnose`, which says whether they flipped at a near tie),
    and a bf16 tier's bytes against `kvjax.memory.host_tier_bytes`; returns failures."""
    failures = []
    where = f"round {t['round']} {t['cache']} {float(t['fraction']):.0%}"
    toks = t.pop("tokens")
    n_ref, ref = ref_tokens.setdefault(t["cache"], (t["host_pages"], toks))
    same = float(np.mean(toks == ref))
    t.update(tokens=toks.tolist(), tokens_same_as_reference=same)
    if same != 1.0:
        t["near_tie"] = d = diagnose(t["cache"], (n_ref, ref), t["host_pages"], toks)
        print(f"{where}: greedy tokens differ in rows {d['rows']} from steps "
              f"{list(d['first_steps'].values())}; reference margins "
              f"{[f'{m:.2g}' for m in d['margins_nats'].values()]} nats, teacher-forced "
              f"log-probabilities within {d['max_logprob_diff_nats']:.2g} nats: "
              f"{'a near tie' if d['tie'] else 'NOT a near tie'} (limit {TIE_NATS:g})",
              flush=True)
        if not d["tie"]:
            failures.append(f"{where}: greedy tokens differ from the reference's "
                            f"({100 * same:.0f}% same), not at a near tie")
    if t["cache"] == "bf16":
        acct = host_tier_bytes(attention_spec(config), config.num_layers, run.context,
                               host_fraction=t["fraction"], page_size=run.page_size,
                               batch=run.batch)
        t["accounted_host_bytes"] = int(acct.batch_host_bytes)
        if (acct.host_pages, acct.batch_host_bytes) != (t["host_pages"], t["host_kv_bytes"]):
            failures.append(f"{where}: the tier holds {t['host_pages']} pages per row, "
                            f"{t['host_kv_bytes']} bytes; host_tier_bytes says "
                            f"{acct.host_pages} pages, {acct.batch_host_bytes} bytes")
    return failures


# ----------------------------------------------------------------------------- report


def _stat(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return dict(median=float(np.median(xs)), min=float(np.min(xs)), max=float(np.max(xs)),
                n=len(xs))


def summarize(run: Run, weight_bytes: int, probes: list[dict], trials: list[dict]) -> dict:
    """Medians per (cache, share), the bound and its ratio; bandwidths over the run."""
    bw = {k: float(np.median([p[k] for p in probes])) for k in probes[0]}
    moved = [t for t in trials if t["round"] > 0 and t["host_pages"] > 0 and "error" not in t]
    tier_out = _stat([t["moved_bytes"] / t["move_out_s"] / 1e9 for t in moved])
    tier_in = _stat([t["moved_bytes"] / t["move_in_s"] / 1e9 for t in moved])
    h2d_src = "device_put"
    h2d = bw["put_h2d_GBps"]
    if tier_in and tier_in["median"] > h2d:
        h2d, h2d_src = tier_in["median"], "host.move"
    rows = []
    for name in run.caches:
        ref = None
        for f in run.fractions:
            ts = [t for t in trials if t["cache"] == name and t["fraction"] == f]
            if not ts:
                continue
            ok_ts = [t for t in ts if "error" not in t]
            timed = [t for t in ok_ts if t["round"] > 0]
            row = dict(cache=name, host_fraction=float(f), host_pages_per_row=ts[0]["host_pages"],
                       trials=len(ts), errors=[t["error"] for t in ts if "error" in t],
                       tokens_same=all(t.get("tokens_same_as_reference") == 1.0 for t in ok_ts),
                       near_ties=sum(bool(t.get("near_tie", {}).get("tie")) for t in ok_ts))
            if not timed:
                rows.append(row)
                continue
            t0 = timed[0]
            steps = [s for t in timed for s in t["step_s"]]
            step = float(np.median(steps))
            dev = weight_bytes + t0["device_kv_bytes"]
            b_host = t0["host_kv_bytes"] / (h2d * 1e9)
            b_dev = dev / (bw["read_GBps"] * 1e9)
            bound = b_host + b_dev
            row.update(
                host_tokens_per_row=ts[0]["host_pages"] * run.page_size,
                host_share=ts[0]["host_pages"] * run.page_size / run.context,
                host_kv_bytes=t0["host_kv_bytes"], device_kv_bytes=t0["device_kv_bytes"],
                weight_bytes=weight_bytes, step_median_s=step, step_min_s=float(np.min(steps)),
                step_max_s=float(np.max(steps)), steps_timed=len(steps),
                bound_s=bound, bound_host_s=b_host, bound_device_s=b_dev,
                step_over_bound=step / bound, within=bool(step / bound <= run.within),
                move_out_GBps=_stat([t["moved_bytes"] / t["move_out_s"] / 1e9 for t in timed
                                     if t["move_out_s"]]),
                move_in_GBps=_stat([t["moved_bytes"] / t["move_in_s"] / 1e9 for t in timed
                                    if t["move_in_s"]]))
            if f == 0:
                ref = step
            row["step_vs_0"] = None if ref is None else step / ref
            rows.append(row)
    return dict(bandwidth=dict(bw, tier_move_out_GBps=tier_out, tier_move_in_GBps=tier_in,
                               h2d_for_bound_GBps=h2d, h2d_for_bound_from=h2d_src),
                rows=rows)


def print_table(run: Run, summary: dict) -> None:
    bw = summary["bandwidth"]

    def g(s):
        return "–" if not s else f"{s['median']:.1f}"

    print(f"\nbandwidth (GB/s, medians): device_put device->pinned_host "
          f"{bw['put_d2h_GBps']:.1f}, pinned_host->device {bw['put_h2d_GBps']:.1f}; "
          f"host.move out {g(bw['tier_move_out_GBps'])}, back {g(bw['tier_move_in_GBps'])}; "
          f"streaming read {bw['read_GBps']:.1f}. Bound uses host->device "
          f"{bw['h2d_for_bound_GBps']:.1f} ({bw['h2d_for_bound_from']}) and the read.")
    hdr = ["cache", "host", "host MB", "device MB (KV+w)", "step ms (min-max)", "bound ms",
           "step/bound", f"<= {run.within}x", "vs 0%", "tokens"]
    lines = []
    for r in summary["rows"]:
        if "step_median_s" not in r:
            lines.append([r["cache"], f"{100 * r['host_fraction']:.0f}%",
                          "failed: " + r["errors"][0].strip().splitlines()[-1][:80]
                          if r["errors"] else "not timed (--time-limit)"]
                         + [""] * (len(hdr) - 3))
            continue
        lines.append([
            r["cache"], f"{100 * r['host_share']:.0f}%", f"{r['host_kv_bytes'] / 1e6:.1f}",
            f"{(r['device_kv_bytes'] + r['weight_bytes']) / 1e6:.1f}",
            f"{r['step_median_s'] * 1e3:.2f} ({r['step_min_s'] * 1e3:.2f}-"
            f"{r['step_max_s'] * 1e3:.2f})",
            f"{r['bound_s'] * 1e3:.2f} = {r['bound_host_s'] * 1e3:.2f} + "
            f"{r['bound_device_s'] * 1e3:.2f}",
            f"{r['step_over_bound']:.2f}", "yes" if r["within"] else "no",
            "–" if r["step_vs_0"] is None else f"{r['step_vs_0']:.2f}x",
            "same" if r["tokens_same"] else "near tie" if r["near_ties"] == r["trials"]
            else "DIFFER"])
    widths = [max(len(str(x)) for x in col) for col in zip(hdr, *lines, strict=True)]
    for line in [hdr, *lines]:
        print("  ".join(str(x).ljust(w) for x, w in zip(line, widths, strict=True)))


# ----------------------------------------------------------------------------- main


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--quick", action="store_true",
                   help="toy sizes (a tiny model, batch 2, 512 tokens; with --gpu the GPU "
                        "preset's logic at a 1 MiB budget): seconds on a CPU")
    p.add_argument("--gpu", action="store_true",
                   help="the H200 preset: Llama-3-8B shapes, bf16 cache, context = 2 x "
                        "--device-budget-gib over the batch, --time-limit 400")
    p.add_argument("--plan", action="store_true",
                   help="print the resolved sizes and the bytes of every pool and share, then "
                        "exit without allocating anything")
    p.add_argument("--caches", default=None,
                   help="comma-separated cache formats among bf16,int4 (default: bf16,int4; "
                        "--gpu: bf16)")
    p.add_argument("--fractions", default="0,0.5,0.9",
                   help="shares of each row's context moved to the host, in [0, 1): floor(F "
                        "context / page) pages per row (default 0,0.5,0.9); the first share's "
                        "greedy tokens are the reference the others must equal")
    p.add_argument("--batch", type=int, default=None, help="rows decoded together (default 4; "
                                                           "--quick 2; --gpu 8)")
    p.add_argument("--context", type=int, default=None,
                   help="tokens per row before decoding (default 4096; --quick 512; --gpu: "
                        "from --device-budget-gib)")
    p.add_argument("--device-budget-gib", type=float, default=None,
                   help="device KV budget: the context becomes twice this many bytes of bf16 "
                        "KV over the batch (default with --gpu 16; ignored with --context)")
    p.add_argument("--page-size", type=int, default=32, help="tokens per page (default 32)")
    p.add_argument("--new-tokens", type=int, default=None,
                   help="greedy tokens per trial; its first is the prompt token's step, the "
                        "rest are timed decode steps (default 8; --quick 4; --gpu 5)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed rounds after the warm-up round (default 3; --quick 1; --gpu 2)")
    p.add_argument("--probe-mib", type=int, default=None,
                   help="MiB of the bandwidth probes' array (default 512; --quick 64; --gpu "
                        "4096)")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds after which no further timed trial starts (the warm-up "
                        "round always runs; default none; --gpu 400)")
    p.add_argument("--within", type=float, default=1.3,
                   help="the step / bound ratio reported as within (default 1.3)")
    p.add_argument("--seed", type=int, default=None, help="weights, K/V and first tokens seed")
    p.add_argument("--json", default=None,
                   help="output path (default benchmarks/results/offload-[gpu-][quick-]<UTC "
                        "time>.json); rewritten after every round")
    a = p.parse_args(argv)
    preset = ("gpu_" if a.gpu else "") + ("quick" if a.quick else "")
    preset = {"": "cpu", "gpu_": "gpu"}.get(preset, preset)
    d = PRESETS[preset]
    try:
        fractions = tuple(Fraction(x.strip()) for x in a.fractions.split(",") if x.strip())
    except ValueError:
        p.error(f"--fractions: numbers in [0, 1) expected, got {a.fractions!r}")
    if not fractions or any(not 0 <= f < 1 for f in fractions):
        p.error(f"--fractions: numbers in [0, 1) expected, got {a.fractions!r}")

    def pick(flag, key):  # the flag when given (0 included), else the preset's value
        v = getattr(a, flag)
        return d[key] if v is None else v

    caches = tuple(c.strip() for c in pick("caches", "caches").split(",") if c.strip())
    if not caches or any(c not in CACHES for c in caches):
        p.error(f"--caches: choose among {list(CACHES)}, got {a.caches!r}")
    batch, new_tokens = pick("batch", "batch"), pick("new_tokens", "new_tokens")
    repeats, probe_mib = pick("repeats", "repeats"), pick("probe_mib", "probe_mib")
    budget = pick("device_budget_gib", "budget_gib")
    for name, v, lo in (("batch", batch, 1), ("page-size", a.page_size, 1),
                        ("new-tokens", new_tokens, 4), ("repeats", repeats, 1),
                        ("probe-mib", probe_mib, 1)):
        if v < lo:
            p.error(f"--{name} must be >= {lo}, got {v}")
    if a.page_size & (a.page_size - 1) or ("int4" in caches and a.page_size < 32):
        p.error(f"--page-size must be a power of two (>= 32, the KIVI group, with int4), got "
                f"{a.page_size}")
    context, budget_bytes = pick("context", "context"), None
    if a.context is None and budget is not None:
        if budget <= 0:
            p.error(f"--device-budget-gib must be > 0, got {budget}")
        budget_bytes = int(budget * GiB)
        config = llama(d["model"])
        per_token = accounting.bytes_per_token(attention_spec(config), config.num_layers, "bf16")
        context = int(2 * budget_bytes // (per_token * batch)) // a.page_size * a.page_size
    if context is None or context < 2 * a.page_size:
        p.error(f"the context must hold at least two pages ({2 * a.page_size} tokens), got "
                f"{context}")
    seed = a.seed if a.seed is not None else int(np.random.SeedSequence().entropy % 2**31)
    run = Run(preset=preset, model=d["model"], caches=caches, fractions=fractions, batch=batch,
              context=context, budget_bytes=budget_bytes, page_size=a.page_size,
              new_tokens=new_tokens, repeats=repeats, probe_mib=probe_mib,
              time_limit=pick("time_limit", "time_limit"),
              within=a.within, seed=seed)
    return a, run


def describe(run: Run, pl: dict) -> str:
    m = MODELS[run.model]
    out = [f"preset {run.preset}: Llama-shaped {pl['params'] / 1e6:.1f}M params (random, "
           f"float32; {m['num_layers']} layers, {m['q_heads']}/{m['kv_heads']} heads x "
           f"{m['head_dim']}), weights read per step {pl['weight_bytes_read'] / 1e6:.1f} MB; "
           f"batch {run.batch} x {run.context} tokens, page {run.page_size}"
           + (f"; device KV budget {run.budget_bytes / GiB:g} GiB (context = 2x the budget)"
              if run.budget_bytes else "")]
    for name, c in pl["caches"].items():
        shares = ", ".join(f"{100 * float(Fraction(f)):.0f}%: {s['host_pages_per_row']} "
                           f"pages/row, host pool {s['host_pool_bytes'] / GiB:.3g} GiB"
                           for f, s in c["shares"].items())
        out.append(f"  {name}: device pool {c['device_pool_bytes'] / GiB:.3g} GiB "
                   f"({c['num_pages']} pages of {c['page_bytes'] / 1e3:.1f} kB); {shares}")
    return "\n".join(out)


def main(argv=None):
    a, run = parse(argv)
    if a.gpu:  # before the backend starts: the preset's peak is ~95 GiB of the 139 GiB
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
    if run.fractions[0] != 0:
        print("note: the first share is not 0: tokens are compared with the first share's")
    pl = plan(run)
    mach = cpu_machine()
    dev = jax.devices()[0]
    mach.update(backend=jax.default_backend(), device=dev.device_kind, jax=jax.__version__,
                memories=[m.kind for m in dev.addressable_memories()])
    try:
        with open("/proc/meminfo") as f:
            mach["host_ram_bytes"] = int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    where = (f"{mach['cpu']}, {mach['cpus']} cpus ({' '.join(mach['simd_flags'])})"
             if mach["backend"] == "cpu" else f"{mach['device']} ({mach['backend']}), host "
             f"{mach['cpu']}, {mach['cpus']} cpus")
    print(f"{where}; jax {jax.__version__}; load average {os.getloadavg()[0]:.2f}; "
          f"seed {run.seed}")
    print(describe(run, pl), flush=True)
    if a.plan:
        return 0
    if host.HOST_MEMORY not in mach["memories"]:
        raise SystemExit(f"this device has no {host.HOST_MEMORY} memory: {mach['memories']}")

    out = result_path(f"offload-{'gpu-' if run.preset.startswith('gpu') else ''}"
                      f"{'quick-' if 'quick' in run.preset else ''}", a.json)

    # float32 matmuls in full precision: on a GPU the default (TF32-like) rounding differs
    # between the device and host attention paths enough to flip near-tied greedy tokens.
    jax.config.update("jax_default_matmul_precision", "highest")
    started = time.perf_counter()
    config = llama(run.model)
    fam = get_family("llama")
    model = fam.model(config)
    params = fam.init_params(config, jax.random.key(run.seed))
    table = kv_table(config, run.seed + 1)
    rng = np.random.default_rng(run.seed)
    first = rng.integers(0, config.vocab_size, (run.batch, 1)).tolist()
    probe = bandwidth_probe(run.probe_mib)
    probes = [probe()]
    print(f"probe: {', '.join(f'{k} {v:.1f}' for k, v in probes[0].items())}", flush=True)

    trials, ref_tokens, failures, ties = [], {}, [], {}

    def diagnose(name, refs, n, toks):  # the same tokens again: the same verdict
        key = (name, n, toks.tobytes())
        if key not in ties:
            ties[key] = near_tie(run, model, params, table, first, name, refs, n, toks)
        return ties[key]
    state = dict(rounds_timed=0, stopped_early=None)

    def save(final: bool):
        summary = summarize(run, pl["weight_bytes_read"], probes, trials)
        result = dict(
            benchmark="offload", machine=mach, load_average_start=load0,
            load_average_end=os.getloadavg(), finished=final, ok=final and not failures,
            failures=failures, run={k: (list(map(str, v)) if k == "fractions" else v)
                                    for k, v in dataclasses.asdict(run).items()},
            plan=pl, probe=dict(array_mib=run.probe_mib, how="jax.device_put between device "
                                "and pinned_host memory; read: jitted jnp.sum, float32"),
            probes=probes, rounds_timed=state["rounds_timed"],
            stopped_early=state["stopped_early"], **summary,
            trials=trials,
            wall_s=time.perf_counter() - started)
        with open(out, "w") as f:
            json.dump(result, f, indent=1, default=str)
        return summary, result

    load0 = os.getloadavg()
    save(final=False)
    last_round = 0.0
    for rnd in range(run.repeats + 1):
        elapsed = time.perf_counter() - started
        if rnd > 1 and run.time_limit is not None and elapsed + last_round > run.time_limit:
            state["stopped_early"] = (f"--time-limit {run.time_limit:g} s: {rnd - 1} of "
                                      f"{run.repeats} timed rounds run")
            print(state["stopped_early"], flush=True)
            break
        r0 = time.perf_counter()
        for name, f in [(name, f) for name in run.caches for f in run.fractions]:
            if rnd > 0 and run.time_limit is not None and (
                    time.perf_counter() - started > run.time_limit):
                state["stopped_early"] = (f"--time-limit {run.time_limit:g} s: round {rnd} "
                                          f"stopped before {name} at {float(f):.0%}")
                print(state["stopped_early"], flush=True)
                break
            spec = cache_config(name, run.page_size).spec(model, num_seqs=run.batch,
                                                          max_tokens=room(run))
            n = host_pages_for(run, name, f, spec)
            t = dict(round=rnd, cache=name, fraction=f, host_pages=n)
            c0 = time.perf_counter()
            try:
                t.update(trial(run, model, params, table, name, n, first, run.new_tokens))
            except Exception as e:  # noqa: BLE001 - recorded, reported, fails the run
                t["error"] = "".join(traceback.format_exception(e))
                failures.append(f"round {rnd} {name} {float(f):.0%}: {type(e).__name__}: {e}")
                print(t["error"], file=sys.stderr, flush=True)
            trials.append(t)
            if "error" not in t:
                failures += check_trial(run, config, t, ref_tokens, diagnose)
                print(f"round {rnd}{' (warm-up)' if rnd == 0 else ''} {name:4s} host "
                      f"{float(f):4.0%} ({n} pages/row): {time.perf_counter() - c0:6.1f} s; "
                      f"step {1e3 * float(np.median(t['step_s'])):.2f} ms; moves out / back "
                      f"{t['move_out_s'] or 0:.3f} / {t['move_in_s'] or 0:.3f} s; tokens "
                      f"{tokens_verdict(t)}",
                      flush=True)
            save(final=False)
        probes.append(probe())
        if rnd > 0:
            state["rounds_timed"] = rnd
        last_round = time.perf_counter() - r0
        if state["stopped_early"]:
            break

    summary, result = save(final=True)
    print_table(run, summary)
    for r in summary["rows"]:
        if r.get("host_fraction") == 0.5 and "step_over_bound" in r and run.budget_bytes:
            print(f"\n{r['cache']} at 2x the {run.budget_bytes / GiB:g} GiB device budget (half "
                  f"on the host): step {r['step_median_s'] * 1e3:.2f} ms, bound "
                  f"{r['bound_s'] * 1e3:.2f} ms, {r['step_over_bound']:.2f}x: "
                  f"{'within' if r['within'] else 'NOT within'} {run.within}x")
    print(f"wrote {out}")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
