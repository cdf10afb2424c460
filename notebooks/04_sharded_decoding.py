# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Sharded decoding: spreading the KV cache over devices
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/kvjax/kvjax/blob/main/notebooks/04_sharded_decoding.ipynb)
#
# `kvjax.sharding` spreads the paged cache over a device mesh in three ways, which combine:
#
# * `"heads"`: KV heads over the `model` axis (tensor parallelism);
# * `"sequences"`: block-table rows, and the pages they own, over the `data` axis; each data
#   shard allocates from its own range of page ids;
# * `"context"`: one sequence's pages round-robin over the `context` axis; attention merges
#   the per-device partial results by log-sum-exp.
#
# We decode the same prompts with a tiny model under each strategy, look at which device
# holds which pages, and check every sharded run against one device. On a CPU runtime the
# notebook simulates 8 devices; on a TPU it uses the slice's chips.

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
# Simulate 8 devices on CPU. This must happen before JAX is imported; the flag only affects
# the CPU backend, so it is harmless on GPU/TPU runtimes.
import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

# %%
import jax  # noqa: E402
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

import kvjax as kvx  # noqa: E402
from kvjax import sharding as kvs  # noqa: E402
from kvjax.generate import generate  # noqa: E402
from kvjax.models import get_family  # noqa: E402
from kvjax.models.layers import RopeConfig  # noqa: E402
from kvjax.models.llama import LlamaConfig  # noqa: E402

FIGURES = os.environ.get("KVJAX_FIGURES", "figures")
os.makedirs(FIGURES, exist_ok=True)
BACKEND = jax.default_backend()
SMALL = BACKEND == "cpu"  # tiny sizes on CPU, larger on TPU/GPU
N = jax.device_count()
print("backend:", BACKEND, "devices:", N, jax.devices()[:4], "...")

# %% [markdown]
# ## 1. A tiny model and the single-device reference
#
# A Llama-style model with 8 KV heads (so `"heads"` divides them over up to 8 devices),
# random weights, 8 prompts of different lengths, greedy decoding.

# %%
head_dim = 32 if SMALL else 128
config = LlamaConfig(vocab_size=128, hidden_size=128 if SMALL else 1024,
                     intermediate_size=256 if SMALL else 2048, num_layers=2, q_heads=8,
                     kv_heads=8, head_dim=head_dim, rope=RopeConfig(theta=1e4, dim=head_dim))
family = get_family("llama")
model = family.model(config)
# init_params draws N(0, 0.02) weights; larger matrices make greedy tokens vary more from
# step to step, so the comparison with one device below checks more.
params = jax.tree.map(lambda w: w * 4 if w.ndim >= 2 else w,
                      family.init_params(config, jax.random.key(0)))
rng = np.random.default_rng(0)
max_prompt, new_tokens, page_size = (20, 6, 4) if SMALL else (200, 32, 16)
prompts = [rng.integers(1, config.vocab_size, size=int(n)).tolist()
           for n in rng.integers(3, max_prompt, size=8)]
max_pages = -(-(max_prompt + new_tokens) // page_size)
spec = model.make_cache_spec(page_size=page_size, num_pages=16 * 8, max_seqs=8,
                             max_pages_per_seq=max_pages)


def run(cache, impl, params=params):
    return generate(model, params, prompts, key=jax.random.key(0), max_new_tokens=new_tokens,
                    cache=cache, impl=impl, free_finished=False)


single = run(kvx.init_cache(spec), "auto")
print("single-device tokens, first rows:\n", single.tokens[:3])

# %% [markdown]
# ## 2. Each strategy on a mesh over all devices
#
# `kvs.make_mesh` names the axes, `kvs.ShardingPlan` says which strategies use them,
# `kvs.init_sharded_cache` creates the pools already sharded, `kvs.shard_params` lays the
# weights out tensor-parallel over `model`, and `kvs.ShardedAttention(plan)` is an attention
# `impl=` that runs each device's part inside `shard_map` (per device it uses `"auto"`: the
# Pallas kernels on TPU/GPU). The model code and `kvjax.generate` do not change.

# %%
plans = {
    "heads": ((N,), ("model",), ("heads",)),
    "sequences": ((N,), ("data",), ("sequences",)),
    "context": ((N,), ("context",), ("context",)),
}
if N >= 4 and N % 2 == 0:
    plans["sequences+heads"] = ((2, N // 2), ("data", "model"), ("sequences", "heads"))

results = {}
for name, (shape, axes, strategies) in plans.items():
    plan = kvs.ShardingPlan(mesh=kvs.make_mesh(shape, axes), strategies=strategies)
    res = run(kvs.init_sharded_cache(spec, plan), kvs.ShardedAttention(plan),
              params=kvs.shard_params(params, plan, kv_heads=config.kv_heads))
    results[name] = res
    print(f"{name:16s} mesh {dict(plan.mesh.shape)}  K pool sharding "
          f"{res.cache.pages.k.sharding.spec}  tokens equal one device: "
          f"{np.array_equal(res.tokens, single.tokens)}")

# %% [markdown]
# ## 3. Where the pages live
#
# Every array of the cache is a global `jax.Array`; `addressable_shards` tells which slice
# of the pool `[layers, kv_heads, pages, page_size, head_dim]` each device holds. We count
# the bytes of K and V of the pages in use (those in the block tables) on each device.

# %%
def bytes_in_use_per_device(cache):
    used = np.zeros(spec.num_pages, bool)
    bt, n = np.asarray(cache.block_tables), np.asarray(cache.table.pages_used())
    for s in range(bt.shape[0]):
        used[bt[s, : n[s]]] = True
    per_device = np.zeros(N)
    index = {d: i for i, d in enumerate(jax.devices())}
    for pool in (cache.pages.k, cache.pages.v):
        for shard in pool.addressable_shards:
            _, heads, pages = shard.index[:3]
            n_heads = len(range(*heads.indices(pool.shape[1])))
            n_used = used[pages].sum()
            per_device[index[shard.device]] += (n_used * n_heads * pool.shape[0] * pool.shape[3]
                                            * pool.shape[4] * pool.dtype.itemsize)
    return per_device


held = {name: bytes_in_use_per_device(res.cache) for name, res in results.items()}
held_single = bytes_in_use_per_device(single.cache)[0]
fig, ax = plt.subplots(figsize=(8, 3.5))
width = 0.8 / len(held)
for i, (name, b) in enumerate(held.items()):
    ax.bar(np.arange(N) + i * width, b / 1024, width=width, label=name)
ax.axhline(held_single / 1024, color="k", ls=":", lw=1, label="one device holds all")
ax.set_xticks(np.arange(N) + 0.4 - width / 2, [f"dev {d}" for d in range(N)])
ax.set_ylabel("K+V in use, KiB")
ax.set_title("Cache bytes in use on each device, by strategy")
ax.legend(fontsize=7, ncol=2)
fig.tight_layout()
fig.savefig(f"{FIGURES}/04_pages_per_device.png", dpi=80)
for name, b in held.items():
    print(f"{name:16s} per device KiB: {np.round(b / 1024, 1).tolist()}")

# %%
# The demonstrated results: every strategy decodes the same tokens as one device, and
# together the devices hold no more than one copy of the cache in use (heads, sequences and
# context split it rather than replicate it).
for name, res in results.items():
    np.testing.assert_array_equal(res.tokens, single.tokens, err_msg=name)
    assert (res.num_generated == new_tokens).all(), name
    assert abs(held[name].sum() - held_single) < 1e-6 * held_single, (name, held[name])
