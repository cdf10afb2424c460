# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Compressing the KV cache: fewer bits, fewer tokens, fewer pages read
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/kvjax/kvjax/blob/main/notebooks/02_compression.ipynb)
#
# Three levers side by side:
#
# 1. **Quantization** (KIVI): store keys and values in 2/4/8 bits with a scale and zero per
#    group. Keys have outlier *channels*, so the grouping matters.
# 2. **Eviction** (StreamingLLM, H2O, SnapKV): keep a budget of tokens per sequence; which
#    ones, drawn over the attention matrix.
# 3. **Selection** (Quest): keep every token but read only the pages whose upper bound on
#    `q · k` is highest.
#
# Sections 1–3 open each lever up on data we control; section 4 pulls all of them on a
# trained model through `kvjax.generate`'s one decode loop, where a KIVI cache is just
# `cache=CacheConfig(quant=QuantSpec(...))` and a policy is `policy=...`. Section 5 adds
# a lever of sliding-window models (Gemma 2 / 3, Mistral): window-only pages.

# %%
# On Colab, install kvjax from the repository; elsewhere it is already installed.
import importlib.util
import subprocess
import sys

if importlib.util.find_spec("kvjax") is None:
    subprocess.check_call(
        [sys.executable, "-m", "pip", "install", "-q", "git+https://github.com/kvjax/kvjax"]
    )

# %%
import os

import jax
import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

import kvjax as kvx
from kvjax.cache import policies, quant

FIGURES = os.environ.get("KVJAX_FIGURES", "figures")
os.makedirs(FIGURES, exist_ok=True)
BACKEND = jax.default_backend()
SMALL = BACKEND == "cpu"  # tiny sizes on CPU, larger on TPU/GPU
print("backend:", BACKEND, "devices:", jax.device_count())
rng = np.random.default_rng(0)

# %% [markdown]
# ## 1. Quantization error by bits and grouping
#
# Keys of real models have a few channels with much larger magnitude than the rest. We
# build such keys (4 of 64 channels scaled by 10) and quantize them with
# `kvjax.cache.quant` two ways, in groups of 32:
#
# * `grouping="tokens"`: one scale per channel for every 32 tokens (**per-channel**, KIVI's
#   choice for keys): an outlier channel gets its own range;
# * `grouping="channels"`: one scale per token for every 32 channels (**per-token**, KIVI's
#   choice for values): an outlier inflates the step of the whole group.

# %%
tokens, width, group = (256, 64, 32) if SMALL else (4096, 128, 32)
keys = rng.standard_normal((tokens, width)).astype(np.float32)
outliers = rng.choice(width, size=4, replace=False)
keys[:, outliers] *= 10.0
keys = jnp.asarray(keys)


def rel_error(x, bits, grouping):
    packed, scale, zero = quant.quantize_packed(x, bits=bits, group_size=group,
                                                grouping=grouping)
    x_hat = quant.dequantize(packed, scale, zero, bits=bits, grouping=grouping)
    return float(jnp.linalg.norm(x_hat - x) / jnp.linalg.norm(x))


errors = {g: [rel_error(keys, b, g) for b in quant.BITS] for g in ("tokens", "channels")}
labels = {"tokens": "per-channel (grouping='tokens')",
          "channels": "per-token (grouping='channels')"}
for g, e in errors.items():
    print(f"{labels[g]:34s}", "  ".join(f"{b}-bit {x:.4f}" for b, x in zip(quant.BITS, e,
                                                                          strict=True)))

fig, ax = plt.subplots(figsize=(6, 3.5))
xs = np.arange(len(quant.BITS))
for i, (g, e) in enumerate(errors.items()):
    ax.bar(xs + 0.4 * i - 0.2, e, width=0.4, label=labels[g])
ax.set_xticks(xs, [f"{b} bits" for b in quant.BITS])
ax.set_yscale("log")
ax.set_ylabel("relative error ||K̂ - K|| / ||K||")
ax.set_title("Keys with outlier channels: group along tokens")
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(f"{FIGURES}/02_quant_error.png", dpi=80)

# %% [markdown]
# ## 2. Eviction: which tokens each policy keeps
#
# One sequence of `T` tokens in a paged cache, one KV head. A handful of "heavy hitter"
# tokens have keys aligned with a direction every query shares, so they draw attention from
# every later query (like the punctuation and BOS tokens of real models). Each value's
# first channel stores its token position, so after a policy compacts the cache we can read
# which positions survived.

# %%
T, D, budget = (64, 16, 24) if SMALL else (256, 64, 64)
page_size = 8
u = rng.standard_normal(D).astype(np.float32)
u /= np.linalg.norm(u)
heavy = np.sort(rng.choice(np.arange(8, T - budget), size=5, replace=False))
k = rng.standard_normal((T, D)).astype(np.float32)
k[heavy] += 4.0 * u * np.sqrt(D)
q = rng.standard_normal((T, D)).astype(np.float32) + u
v = rng.standard_normal((T, D)).astype(np.float32)
v[:, 0] = np.arange(T)

logits = q @ k.T / np.sqrt(D)
logits[np.triu_indices(T, 1)] = -np.inf
attn = np.exp(logits - logits.max(-1, keepdims=True))
attn /= attn.sum(-1, keepdims=True)

spec = kvx.CacheSpec(attention=kvx.AttentionSpec(q_heads=1, kv_heads=1, head_dim=D),
                     num_layers=1, page_size=page_size, num_pages=2 * T // page_size,
                     max_seqs=1, max_pages_per_seq=T // page_size)


def prefilled_cache():
    cache = kvx.init_cache(spec)
    cache, status = kvx.cache.reserve(cache, jnp.array([T], jnp.int32))
    status.raise_if_error()
    # K/V are [batch, q_len, kv_heads, head_dim]; the T tokens fill the slots just reserved.
    return kvx.cache.write(cache, 0, jnp.asarray(k)[None, :, None],
                           jnp.asarray(v)[None, :, None], q_lengths=jnp.array([T]))


def cached_values(cache, seq=0, layer=0, head=0):
    """The values sequence `seq` holds, in cache order, read through its block table."""
    view = kvx.cache.layer_view(cache, layer)
    n = int(cache.lengths[seq])
    pages = np.asarray(cache.block_tables[seq, : -(-n // page_size)])
    return np.asarray(view.v)[head, pages].reshape(-1, view.v.shape[-1])[:n]


queries = jnp.asarray(q)[None, None, :, None]  # [layers, batch, q_len, q_heads, head_dim]
evictors = {
    "StreamingLLM": policies.StreamingLLM(n_sink=4, window=budget - 4),
    "H2O": policies.H2O(budget=budget),
    "SnapKV": policies.SnapKV(budget=budget, window=8, kernel=3),
}
kept = {}
for name, policy in evictors.items():
    cache = prefilled_cache()
    state = policy.init_state(cache)
    cache, state, status = jax.jit(policy.after_prefill)(cache, state, queries,
                                                           jnp.array([T], jnp.int32))
    status.raise_if_error()
    kvx.cache.check_invariants(cache.table)
    n = int(cache.lengths[0])
    kept[name] = np.sort(cached_values(cache)[:, 0].round().astype(int))
    mass = attn[-1, kept[name]].sum()
    print(f"{name:12s} keeps {n} tokens, {int(cache.num_free_pages)} free pages; "
          f"heavy hitters kept {np.isin(heavy, kept[name]).sum()}/{len(heavy)}; "
          f"last query's attention mass kept {mass:.2f}")

fig, axes = plt.subplots(1, len(kept), figsize=(4 * len(kept), 3.6), sharey=True)
for ax, (name, pos) in zip(axes, kept.items(), strict=True):
    mask = np.zeros(T, bool)
    mask[pos] = True
    log_attn = np.where(np.tri(T, dtype=bool), np.log10(attn + 1e-6), np.nan)  # causal part
    ax.imshow(log_attn, cmap="Greys", vmin=-4, vmax=0, aspect="auto")
    shown = np.where(mask[None, :], log_attn, np.nan)
    ax.imshow(shown, cmap="viridis", vmin=-4, vmax=0, aspect="auto")
    ax.set_title(f"{name}: {len(pos)} of {T} kept")
    ax.set_xlabel("key position (coloured: kept)")
axes[0].set_ylabel("query position")
fig.tight_layout()
fig.savefig(f"{FIGURES}/02_eviction_heatmap.png", dpi=80)

# %% [markdown]
# ## 3. Quest: page upper bounds vs the true page maxima
#
# Quest keeps per-page elementwise key minima and maxima; for a query `q` the bound
# `Σ_i max(q_i·max_i, q_i·min_i)` is at least `q · k` for every key of the page. The decode
# step reads only the `top_k` pages with the highest bounds (plus the current page).

# %%
quest = policies.Quest(top_k=4, dense_layers=0)
cache = prefilled_cache()
state = quest.init_state(cache)
cache, state, status = quest.after_prefill(cache, state, queries, jnp.array([T], jnp.int32))
q_now = jnp.asarray(q[-1:])[:, None]  # the last query, [batch=1, q_heads=1, head_dim]
n_pages = T // page_size
table = cache.block_tables[0, :n_pages]
bounds = policies.quest_page_bounds(q_now, state.kmin[0][:, table][None],
                                    state.kmax[0][:, table][None])
bounds = np.asarray(bounds)[0, 0]
true_max = (k @ q[-1]).reshape(n_pages, page_size).max(axis=1)
selection = quest.before_attention(cache, state, 0, q_now)
chosen_ids = np.asarray(selection.block_tables)[0, 0]
chosen = np.isin(np.asarray(table), chosen_ids[chosen_ids >= 0])
print("page  bound  true max  read")
for i in range(n_pages):
    print(f"{i:4d} {bounds[i]:6.2f} {true_max[i]:8.2f}  {'yes' if chosen[i] else ''}")

fig, ax = plt.subplots(figsize=(4.5, 4))
ax.scatter(true_max[~chosen], bounds[~chosen], label="skipped")
ax.scatter(true_max[chosen], bounds[chosen], label=f"read (top_k={quest.top_k})")
lim = [min(true_max.min(), bounds.min()), max(true_max.max(), bounds.max())]
ax.plot(lim, lim, "k--", lw=1, label="bound = true max")
ax.set_xlabel("true max_k q·k on the page")
ax.set_ylabel("Quest bound")
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(f"{FIGURES}/02_quest_bounds.png", dpi=80)

# %% [markdown]
# ## 4. All three levers on a trained model, through the one decode loop
#
# `kvjax.models.tiny.load_tiny("gqa")` is a byte-level Llama-style model shipped with kvjax
# (4 layers, 4 query / 2 KV heads of 32 channels), trained on the Python standard library.
# We take crops of standard-library files it never saw (`kvjax.data`'s held-out split) and
# score their last bytes with `kvjax.generate.score`: the prompt is prefilled, then the true
# continuation is fed one byte per decode step, through the same step function `generate`
# runs. So quantization error and eviction act on the cache exactly as they would while
# generating, and the negative log-likelihood (NLL) per byte says what they cost.
#
# Every configuration is a `CacheConfig` (bf16 pages, or KIVI pages with `quant=QuantSpec`)
# and an optional `policy=`; `generate`, `stream`, `sample_n` and `beam_search` take the
# same two arguments. The model was trained on 256-byte windows, so the context stays
# within 256 bytes; the KIVI caches keep `residual=32` recent tokens in bf16 (the paper uses
# 128 at longer contexts), and the policies keep (or read) 96 tokens, about 3/8 of it.

# %%
from concurrent.futures import ThreadPoolExecutor  # noqa: E402

from kvjax import data, memory  # noqa: E402
from kvjax.generate import CacheConfig, score  # noqa: E402
from kvjax.memory import capacity  # noqa: E402
from kvjax.models.tiny import load_tiny  # noqa: E402

model, lm_params = load_tiny("gqa")
corpus = data.load_corpus("heldout", max_bytes=200_000)
batch, prompt_len, cont_len, ps = 4, 192, 64, 32
crops = np.stack([data.code_crop(rng, corpus, prompt_len + cont_len) for _ in range(batch)])
lm_prompts = crops[:, :prompt_len].astype(int).tolist()
lm_conts = crops[:, prompt_len:].astype(int).tolist()
context = prompt_len + cont_len - 1  # tokens cached after the last scored byte
lm_budget = 3 * ps

bf16 = CacheConfig(dtype="bfloat16", page_size=ps)


def kivi(bits):
    return CacheConfig(dtype="bfloat16", page_size=ps,
                       quant=kvx.QuantSpec(bits=bits, group_size=32, residual=32))


configs = {  # name -> (cache, policy, memory format of the pages)
    "bf16": (bf16, None, memory.kv_format("bf16")),
    "KIVI int4": (kivi(4), None, memory.kv_format("int4", group_size=32, residual=32)),
    "KIVI int2": (kivi(2), None, memory.kv_format("int2", group_size=32, residual=32)),
    "StreamingLLM": (bf16, policies.StreamingLLM(n_sink=4, window=lm_budget - 4), None),
    "H2O": (bf16, policies.H2O(budget=lm_budget), None),
    "Quest": (bf16, policies.Quest(top_k=lm_budget // ps, dense_layers=0), None),
}


def bytes_held(cache):
    """KV bytes each sequence holds, read off the cache's arrays: its pages, plus its
    slot's full-precision ring on a KIVI cache."""
    per_page = sum(x.nbytes for x in jax.tree.leaves(cache.pages)) / cache.spec.num_pages
    ring = 0 if cache.tail is None else (cache.tail.a.nbytes + cache.tail.b.nbytes) / \
        cache.spec.max_seqs
    return np.asarray(cache.table.pages_used())[:batch] * per_page + ring


def run(name):
    cache_config, policy, _ = configs[name]
    res = score(model, lm_params, lm_prompts, lm_conts, cache=cache_config, policy=policy,
                free_finished=False)  # keep the final cache to measure it
    return dict(nll=res.nll(), logprobs=res.logprobs, held=bytes_held(res.cache),
                tokens=np.asarray(res.cache.lengths)[:batch])


# Each configuration compiles its own loop, which is most of the time here on a CPU; XLA
# compiles release the GIL, so one thread per core runs them side by side.
with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
    runs = dict(zip(configs, pool.map(run, configs), strict=True))
ref = runs["bf16"]
print(f"{context} tokens per sequence; policy budget {lm_budget} tokens\n")
print(f"{'cache':14s} {'NLL/byte':>8s} {'Δ NLL':>7s} {'mean |Δ log p|':>14s} "
      f"{'tokens held':>11s} {'KiB held':>8s}")
for name, r in runs.items():
    r["dnll"] = r["nll"] - ref["nll"]
    r["dev"] = float(np.abs(r["logprobs"] - ref["logprobs"]).mean())
    print(f"{name:14s} {r['nll']:8.4f} {r['dnll']:+7.4f} {r['dev']:14.4f} "
          f"{int(r['tokens'].max()):11d} {r['held'].mean() / 1024:8.1f}")

# %% [markdown]
# Quest holds every token: what it saves is reads. Each step, each KV head reads its
# `top_k` pages with the highest bounds, the same quarter of the context the evicting
# policies keep.

# %%
reads = {name: r["held"].mean() for name, r in runs.items()}
reads["Quest"] = configs["Quest"][1].top_k * ps / context * runs["Quest"]["held"].mean()
fig, ax = plt.subplots(figsize=(6, 3.5))
for name, r in runs.items():
    ax.scatter(reads[name] / 1024, r["dnll"], s=40)
    ax.annotate(name, (reads[name] / 1024, r["dnll"]), fontsize=8,
                xytext=(4, 4), textcoords="offset points")
ax.axhline(0, color="k", lw=0.5)
ax.set_xlabel("KV KiB a decode step reads per sequence")
ax.set_ylabel("Δ NLL per byte vs bf16 (nats)")
ax.set_title(f"Tiny GQA model, {context}-byte context")
fig.tight_layout()
fig.savefig(f"{FIGURES}/02_levers_on_a_model.png", dpi=80)

# %% [markdown]
# ## 5. Window-only pages: a sliding-window model decoding past its window
#
# Gemma 3's local layers (five of every six) attend only to the last `sliding_window`
# tokens, so a page that has left their window is never read again. With
# `CacheConfig(window_pages=True)` those layers keep a ring of
# `kvjax.specs.ring_pages(window, chunk, page_size)` pages per sequence, reused as the
# sequence grows, while the global layers keep every page. A tiny random Gemma 3 (two
# local layers with a 16-token window and one global layer, to keep compiling short;
# `kvjax.models.gemma`'s own `init_params`, nothing to download) decodes two sequences of
# 48 + 80 = 128 tokens, eight windows, both ways.

# %%
from kvjax.cache import window  # noqa: E402
from kvjax.generate import generate  # noqa: E402
from kvjax.models import gemma, get_family  # noqa: E402
from kvjax.rope import RopeConfig  # noqa: E402
from kvjax.specs import ring_pages  # noqa: E402

g_config = gemma.GemmaConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=3, q_heads=2,
    kv_heads=1, head_dim=16, layer_types=(gemma.LOCAL, gemma.LOCAL, gemma.GLOBAL),
    sliding_window=16, rope_local=RopeConfig(theta=10_000.0, dim=16),
    rope_global=RopeConfig(theta=1_000_000.0, dim=16, rope_type="linear", factor=8.0),
    query_pre_attn_scalar=16, qk_norm=True)
g_family = get_family("gemma")
g_model, g_params = g_family.model(g_config), g_family.init_params(g_config, jax.random.key(0))
g_prompts = rng.integers(0, g_config.vocab_size, (2, 48)).tolist()
g_page, g_chunk = 8, 16  # tokens per page; prefill chunk (the ring's chunk)


def kv_pools(cache):
    """Per page pool (the main pools, then each window group): (layers in it, pages in use,
    KV bytes of those pages across its layers, read off the pool's shape)."""
    pools = [(cache.pages, cache.spec.num_pages - int(cache.num_free_pages))]
    pools += list(zip((g.pages for g in cache.groups), window.pages_in_use(cache), strict=True))
    return [(pages.k.shape[0], used, used * (pages.k.nbytes + pages.v.nbytes) // pages.k.shape[2])
            for pages, used in pools]


def decode(window_pages):
    res = generate(g_model, g_params, g_prompts, key=jax.random.key(0), max_new_tokens=80,
                   chunk_size=g_chunk, free_finished=False,  # keep the final cache
                   cache=CacheConfig(page_size=g_page, window_pages=window_pages))
    return dict(tokens=np.asarray(res.tokens), pools=kv_pools(res.cache))


with ThreadPoolExecutor(max_workers=2) as pool:  # the two compile side by side
    g_runs = dict(zip(("every page", "window-only"), pool.map(decode, (False, True)),
                      strict=True))
for name, r in g_runs.items():
    r["bytes"] = sum(b for _, _, b in r["pools"])
    print(f"{name:11s} " + ";  ".join(f"{n} layer(s): {used} pages, {b / 1024:.0f} KiB"
                                      for n, used, b in r["pools"])
          + f";  total {r['bytes'] / 1024:.0f} KiB")
same = (g_runs["every page"]["tokens"] == g_runs["window-only"]["tokens"]).all()
print(f"ring of {ring_pages(16, g_chunk, g_page)} pages per local layer and sequence; "
      f"generated tokens identical: {same}")

# %% [markdown]
# The same accounting for the real model, with its 52 local and 10 global layers:
# `python -m kvjax memory --model gemma-3-27b --context 131072 --compare` prints it, and
# `kvjax.memory.window_cache_bytes` returns it.

# %%
g27 = memory.window_cache_bytes(memory.get_preset("gemma-3-27b"), 131_072)
print(f"gemma-3-27b, one 131,072-token sequence, bf16: {float(g27.full_bytes) / 2**30:.2f} GiB "
      f"with every page, {float(g27.window_bytes) / 2**30:.2f} GiB with window-only pages "
      f"({g27.local_layers} local layers x {g27.window_pages} pages instead of "
      f"{g27.context_pages}); {float(g27.full_bytes / g27.window_bytes):.2f}x smaller")

# %%
# The demonstrated results.
# Per-channel grouping beats per-token grouping on keys with outlier channels, at every width.
assert all(a < b for a, b in zip(errors["tokens"], errors["channels"], strict=True)), errors
# StreamingLLM keeps the sinks and the recent window; H2O finds the heavy hitters.
np.testing.assert_array_equal(kept["StreamingLLM"],
                              np.r_[0:4, T - (budget - 4):T])
assert np.isin(heavy, kept["H2O"]).all(), (heavy, kept["H2O"])
# Quest's bound is an upper bound of every page's true maximum, and the page holding the
# single best key is among those read.
assert (bounds >= true_max - 1e-4 * np.abs(true_max).max()).all()
assert chosen[np.argmax(true_max)]
# On the trained model: the bytes measured on the cache arrays are the accounting's
# (`kvjax.memory`), and KIVI int4 holds under half of bf16's, int2 less still.
for name in ("bf16", "KIVI int4", "KIVI int2"):
    want = float(capacity.sequence_bytes(model.config.attention, model.config.num_layers,
                                         context, page_size=ps, fmt=configs[name][2]))
    np.testing.assert_array_equal(runs[name]["held"], want, err_msg=name)
assert runs["KIVI int2"]["held"].max() < runs["KIVI int4"]["held"].max() < ref["held"].max() / 2
# int4 is close to lossless, int2 strays further from the bf16 scores.
assert abs(runs["KIVI int4"]["dnll"]) < 0.01, runs["KIVI int4"]["dnll"]
assert runs["KIVI int4"]["dev"] < runs["KIVI int2"]["dev"], (runs["KIVI int4"]["dev"],
                                                             runs["KIVI int2"]["dev"])
# Eviction holds exactly the budget (Quest everything); at 3/8 of the context every lever
# costs under 0.05 nats per byte (a policy that dropped or misread the wrong tokens would
# not: reading only the newest page costs Quest about 0.26).
for name in ("StreamingLLM", "H2O"):
    assert (runs[name]["tokens"] == lm_budget).all(), (name, runs[name]["tokens"])
assert (runs["Quest"]["tokens"] == context).all(), runs["Quest"]["tokens"]
for name, r in runs.items():
    assert r["dnll"] < 0.05, (name, r["dnll"])
# Window-only pages change no token, and the local layers hold one ring per sequence (the
# global layer its 16 pages either way): 1 x 32 + 2 x 10 page-layers instead of 3 x 32.
np.testing.assert_array_equal(g_runs["window-only"]["tokens"], g_runs["every page"]["tokens"])
seq_pages = -(-(48 + 80 - 1) // g_page)  # the last generated token is not fed
ring = ring_pages(16, g_chunk, g_page)
assert [p[:2] for p in g_runs["every page"]["pools"]] == [(3, 2 * seq_pages)]
assert [p[:2] for p in g_runs["window-only"]["pools"]] == [(1, 2 * seq_pages), (2, 2 * ring)]
assert g_runs["window-only"]["bytes"] * 96 == g_runs["every page"]["bytes"] * 52
# gemma-3-27b at 128K: 62 GiB with every page, about 10.5 GiB with window-only pages.
assert g27.full_bytes == 62 * 2**30 and 5.8 < g27.full_bytes / g27.window_bytes < 6.0
