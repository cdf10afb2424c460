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
# # kvjax quickstart: what the KV cache costs, and a paged cache you can watch
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/kvjax/kvjax/blob/main/notebooks/01_quickstart.ipynb)
#
# When a transformer decodes, the KV cache grows by
# `2 × layers × kv_heads × head_dim × bytes` per token. This notebook puts numbers on
# that formula for real models, then builds a paged cache and watches its page table
# as sequences grow, fork and finish, and decodes with a tiny model on it.

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
from kvjax import memory

FIGURES = os.environ.get("KVJAX_FIGURES", "figures")
os.makedirs(FIGURES, exist_ok=True)
BACKEND = jax.default_backend()
print("backend:", BACKEND, "devices:", jax.device_count())

# %% [markdown]
# ## 1. The memory formula on real model presets
#
# Bytes per token for Llama-2-70B's shape (80 layers, 64 query heads, head_dim 128) as
# MHA, its real GQA-8, MQA, an MLA-style latent cache, and low-bit formats; and
# DeepSeek-V2's real MLA cache.

# %%
llama = memory.get_preset("llama-2-70b")
ds = memory.get_preset("deepseek-v2")
heads, hd = llama.q_heads, llama.head_dim
variants = {
    "MHA bf16": (kvx.AttentionSpec(q_heads=heads, kv_heads=heads, head_dim=hd), "bf16"),
    "GQA-8 bf16": (llama.attention, "bf16"),
    "MQA bf16": (kvx.AttentionSpec(q_heads=heads, kv_heads=1, head_dim=hd), "bf16"),
    "MLA bf16": (kvx.MLASpec(q_heads=heads, kv_lora_rank=4 * hd, qk_rope_head_dim=hd // 2,
                             qk_nope_head_dim=hd, v_head_dim=hd), "bf16"),
    "GQA-8 int4 (G=32)": (llama.attention, memory.kv_format("int4", group_size=32)),
    "GQA-8 int2 (G=32)": (llama.attention, memory.kv_format("int2", group_size=32)),
}
per_token = {name: float(memory.bytes_per_token(spec, llama.num_layers, fmt))
             for name, (spec, fmt) in variants.items()}
per_token["DeepSeek-V2 MLA bf16"] = float(memory.bytes_per_token(ds.attention, ds.num_layers,
                                                                  "bf16"))
for name, b in per_token.items():
    print(f"{name:24s} {b / 1024:9.1f} KiB/token   {b * 8192 * 8 / 1e9:8.2f} GB at 8 x 8K")

fig, ax = plt.subplots(figsize=(8, 3.5))
ax.barh(list(per_token), [b / 1024 for b in per_token.values()])
ax.set_xscale("log")
ax.set_xlabel("KV cache per token, KiB (log scale)")
ax.set_title("Llama-2-70B shape: head sharing, latents and low bits")
fig.tight_layout()
fig.savefig(f"{FIGURES}/01_kv_bytes_per_token.png", dpi=80)

# %% [markdown]
# ## 2. A paged cache
#
# The cache is one typed pytree: page pools for every layer and a page table (block
# tables, lengths, reference counts, free stack). Sizes follow the backend: tiny on CPU.

# %%
small = BACKEND == "cpu"
spec = kvx.CacheSpec(
    attention=kvx.AttentionSpec(q_heads=8, kv_heads=2, head_dim=64 if small else 128),
    num_layers=2 if small else 8, page_size=16, num_pages=64 if small else 4096,
    max_seqs=4, max_pages_per_seq=16 if small else 256,
)
cache = kvx.init_cache(spec)
print(jax.tree.map(lambda x: (x.shape, str(x.dtype)), cache))

# %% [markdown]
# ## 3. Watching the allocator
#
# Sequences grow by `reserve` (pages on demand), share pages by `fork` (parallel
# sampling, beam search), copy a shared page only when writing into it, and give pages
# back with `free`.

# %%
def show(cache, title):
    t = cache.table
    print(f"-- {title}: lengths {np.asarray(t.lengths).tolist()}, free pages {int(t.num_free)}")
    n = np.asarray(t.pages_used())
    for s in range(t.max_seqs):
        print(f"   seq {s}: pages {np.asarray(t.block_tables[s, :n[s]]).tolist()}")


history = []
cache, status = kvx.cache.reserve(cache, jnp.array([40, 7, 0, 0], jnp.int32))
status.raise_if_error()
show(cache, "two prompts of 40 and 7 tokens")
history.append(int(cache.table.num_free))

cache, status = kvx.cache.fork(cache, jnp.array([0, 0]), jnp.array([2, 3]))
status.raise_if_error()
show(cache, "sequence 0 forked into slots 2 and 3 (no page copied)")
print("refcounts of seq 0's pages:",
      np.asarray(cache.table.refcounts)[np.asarray(cache.block_tables[0, :3])].tolist())
history.append(int(cache.table.num_free))

cache, status = kvx.cache.reserve(cache, jnp.array([1, 1, 1, 1], jnp.int32))
status.raise_if_error()
show(cache, "every sequence appends a token: the shared partial page is copied")
history.append(int(cache.table.num_free))

cache = kvx.cache.free(cache, jnp.array([True, False, True, False]), scrub=True)
show(cache, "sequences 0 and 2 finished")
history.append(int(cache.table.num_free))
kvx.cache.check_invariants(cache.table)

# %%
fig, ax = plt.subplots(figsize=(6, 2.5))
ax.plot(["grow", "fork", "append", "free"], history, marker="o")
ax.set_ylabel("free pages")
fig.tight_layout()
fig.savefig(f"{FIGURES}/01_free_pages.png", dpi=80)

# %% [markdown]
# ## 4. Decoding with a tiny model
#
# A tiny Llama-style model with random weights (`kvjax.models`), two prompts of different
# lengths, greedy decoding with `kvjax.generate`: chunked prefill, then a jitted decode
# loop that reserves a page whenever a sequence crosses a page boundary. `cache=` takes a
# `CacheConfig` (dtype, page size, pool size, optional KIVI quantization or sharding plan)
# from which `generate` builds a cache sized for the request, or a `PagedKVCache` you
# built yourself. `impl="auto"` runs the Pallas kernels on TPU/GPU and the XLA path on CPU.

# %%
from kvjax.generate import CacheConfig, generate  # noqa: E402
from kvjax.models import get_family  # noqa: E402
from kvjax.models.layers import RopeConfig  # noqa: E402
from kvjax.models.llama import LlamaConfig  # noqa: E402

head_dim = 64 if small else 128
config = LlamaConfig(vocab_size=128, hidden_size=128 if small else 1024,
                     intermediate_size=256 if small else 2048, num_layers=2 if small else 4,
                     q_heads=4 if small else 8, kv_heads=2, head_dim=head_dim,
                     rope=RopeConfig(theta=1e4, dim=head_dim))
family = get_family("llama")
model = family.model(config)
params = family.init_params(config, jax.random.key(0))
prompts = [[1, 5, 9, 2, 7], [1, 42, 17, 3, 3, 8, 11, 64, 90, 5, 31, 2, 6]]
new_tokens = 16 if small else 128
result = generate(model, params, prompts, key=jax.random.key(0), max_new_tokens=new_tokens,
                  cache=CacheConfig(page_size=8), impl="auto", free_finished=False)
for prompt, seq in zip(prompts, result.sequences(), strict=True):
    print(prompt, "->", seq)
show(result.cache, f"after prefill + {new_tokens} decode steps (page_size 8)")
decoded_lengths = np.asarray(result.cache.lengths)

# %%
# The demonstrated result: forks shared pages, and only the partial page was copied.
assert history[1] == history[0], "fork must not allocate"
# Three sequences hold the partly filled page and all append: two copy it, the last keeps it.
assert history[0] - history[2] == 2, history
# The tiny model decoded every token, and the cache holds prompt + generated tokens per row
# (the last sampled token is not written to the cache yet).
assert (result.num_generated == new_tokens).all(), result.num_generated
assert decoded_lengths[:2].tolist() == [len(p) + new_tokens - 1 for p in prompts], decoded_lengths
