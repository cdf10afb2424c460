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
# # Beyond the KV cache: linear-attention state and learned sparse attention
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/kvjax/kvjax/blob/main/notebooks/06_beyond_kv.ipynb)
#
# Two model designs attack the KV cache inside the architecture itself:
#
# * **Hybrid linear attention** (Qwen3-Next): three of every four layers are Gated
#   DeltaNet layers, whose per-sequence state has a fixed size; only the remaining
#   full-attention layers keep a KV cache that grows with the context.
# * **Learned sparse attention** (DeepSeek-V3.2's DSA): a small "lightning indexer"
#   scores every cached token, and each query attends only to its top-k tokens of the
#   MLA latent cache.
#
# This notebook prices both against a dense cache, draws what DSA selects, and decodes a
# tiny random model of each family on kvjax's paged cache.

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

from kvjax import memory
from kvjax.generate import CacheConfig, generate
from kvjax.memory import linear_state
from kvjax.models import deepseek_v32 as v32
from kvjax.models import get_family, layers
from kvjax.models import qwen3_next as q3n
from kvjax.models.deepseek import mla
from kvjax.models.deepseek_v32.indexer import indexer_inputs
from kvjax.models.qwen3_next import delta_rule
from kvjax.rope import RopeConfig

FIGURES = os.environ.get("KVJAX_FIGURES", "figures")
os.makedirs(FIGURES, exist_ok=True)
print("backend:", jax.default_backend(), "devices:", jax.device_count())

# %% [markdown]
# ## 1. State vs KV bytes as the context grows
#
# Qwen3-Next-80B-A3B has 48 layers: 12 full-attention layers (GQA, 2 KV heads of 256) and
# 36 Gated DeltaNet layers. Each linear layer keeps, per sequence, a convolution state
# and a delta-rule state (one key-by-value matrix per value head) whose size does not
# depend on the context. The dense twin is the same model with all 48 layers full
# attention (`kvjax.memory`, bf16 KV, the state in transformers' dtypes).

# %%
preset = memory.get_preset("qwen3-next-80b-a3b")
contexts = np.array([1024, 4096, 16384, 65536, 262144])
rows = [linear_state.hybrid_cache_bytes(preset, int(c)) for c in contexts]
state = np.array([float(r.state_bytes) for r in rows])
kv = np.array([float(r.kv_bytes) for r in rows])
dense = np.array([float(r.dense_kv_bytes) for r in rows])
print(f"{'context':>8} {'state MiB':>10} {'hybrid KV MiB':>14} {'dense KV MiB':>13} "
      f"{'hybrid/dense':>13}")
for c, s, k, d in zip(contexts, state, kv, dense, strict=True):
    print(f"{c:8d} {s / 2**20:10.1f} {k / 2**20:14.1f} {d / 2**20:13.1f} {(s + k) / d:13.3f}")
print(f"KV equals the state at {float(rows[0].breakeven_tokens):.0f} tokens")

fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(contexts, (state + kv) / 2**30, marker="o", label="Qwen3-Next: state + KV (12 layers)")
ax.plot(contexts, state / 2**30, ls="--", label="its linear-attention state (36 layers)")
ax.plot(contexts, dense / 2**30, marker="s", label="dense twin: KV of 48 layers")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("context length (tokens)")
ax.set_ylabel("cache per sequence, GiB")
ax.set_title("Qwen3-Next-80B-A3B: fixed state vs growing KV")
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(f"{FIGURES}/06_state_vs_kv.png", dpi=80)

# %% [markdown]
# ## 2. The gated delta rule: the chunked form equals the recurrent form
#
# Decode runs the recurrent form, one token at a time:
# `S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - k_t^T exp(g_t) S_{t-1})^T`, `o_t = S_t^T q_t`.
# Prefill runs the chunked (parallel) form, which solves each chunk's recurrence with a
# triangular solve. On random inputs both give the same outputs and the same final state.

# %%
rng = np.random.default_rng(0)
b, t, heads, dk, dv = 2, 37, 4, 16, 16
q = rng.standard_normal((b, t, heads, dk)).astype(np.float32)
k = rng.standard_normal((b, t, heads, dk)).astype(np.float32)
q /= np.linalg.norm(q, axis=-1, keepdims=True) * np.sqrt(dk)
k /= np.linalg.norm(k, axis=-1, keepdims=True)
v = rng.standard_normal((b, t, heads, dv)).astype(np.float32)
g = -rng.uniform(0.01, 0.5, (b, t, heads)).astype(np.float32)
beta = rng.uniform(0.1, 0.9, (b, t, heads)).astype(np.float32)
s0 = rng.standard_normal((b, heads, dk, dv)).astype(np.float32)

s, outs = jnp.asarray(s0), []
for i in range(t):
    o, s = delta_rule.gated_delta_step(q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i], s)
    outs.append(o)
o_rec, s_rec = jnp.stack(outs, axis=1), s
o_chk, s_chk = delta_rule.gated_delta_chunked(q, k, v, g, beta, jnp.asarray(s0), chunk=16)
state_err = float(jnp.max(jnp.abs(s_chk - s_rec)))
out_err = float(jnp.max(jnp.abs(o_chk - o_rec)))
print(f"max |state chunked - recurrent| = {state_err:.1e}, outputs {out_err:.1e}")

# %% [markdown]
# ## 3. Decoding a tiny Qwen3-Next
#
# Two Gated DeltaNet layers and one gated full-attention layer, random weights. Only the
# full-attention layer holds pages; the linear layers' state sits in the same cache
# pytree, one slot per sequence. Prefilling in chunks of 16 or one token at a time gives
# the same greedy tokens.

# %%
q3 = q3n.Qwen3NextConfig(
    vocab_size=96, hidden_size=64, num_hidden_layers=3, intermediate_size=128,
    layer_types=("linear_attention", "linear_attention", "full_attention"),
    q_heads=4, kv_heads=2, head_dim=16, rope=RopeConfig(theta=10000.0, dim=8),
    linear_key_heads=2, linear_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
)
fam = get_family("qwen3_next")
q3_model = fam.model(q3)
q3_params = fam.init_params(q3, jax.random.key(1))
prompts = [rng.integers(0, 96, n).tolist() for n in (29, 11)]
chunked = generate(q3_model, q3_params, prompts, key=jax.random.key(0), max_new_tokens=12,
                   cache=CacheConfig(page_size=8), chunk_size=16, free_finished=False)
one_by_one = generate(q3_model, q3_params, prompts, key=jax.random.key(0), max_new_tokens=12,
                      cache=CacheConfig(page_size=8), chunk_size=1)
for prompt, seq in zip(prompts, chunked.sequences(), strict=True):
    print(len(prompt), "prompt tokens ->", seq)
cache = chunked.cache
print("KV pages (full-attention layers only):", jax.tree.map(lambda x: x.shape, cache.pages))
print("recurrent state (per slot):", jax.tree.map(lambda x: x.shape, cache.recurrent))

# %% [markdown]
# ## 4. DSA: the lightning indexer picks the tokens each query attends to
#
# A tiny random DeepSeek-V3.2 layer. For every query t the indexer scores each visible
# token s, `I[t, s] = sum_h w[t, h] relu(q_I[t, h] . k_I[s] / sqrt(d_I))`, and attention
# reads only the `index_topk` best. We compute the layer's scores and its dense
# attention (one head, absorbed MLA) on a 48-token prompt, and draw the selected tokens
# over the attention matrix.

# %%
v3 = v32.DeepseekV32Config(
    vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
    q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32, n_shared_experts=1, index_n_heads=4, index_head_dim=16,
    index_topk=12,
)
v3_fam = get_family("deepseek_v32")
v3_model = v3_fam.model(v3)
v3_params = v3_fam.init_params(v3, jax.random.key(2))
T = 48
prompt = rng.integers(3, 96, T).tolist()
layer0 = jax.tree.map(lambda a: a[0], v3_params.dense_layers)
pos = jnp.arange(T)[None]
x = layers.rms_norm(v3_params.embed[jnp.asarray(prompt)][None], layer0.input_norm,
                    v3.rms_norm_eps)
cos, sin = mla.rope_tables(v3, pos)
q_resid = mla.q_lora(layer0, x)
q_i, k_i, w_i = indexer_inputs(layer0.indexer, v3, x, q_resid, cos, sin)
causal = np.tril(np.ones((T, T), bool))
scores = jnp.einsum("bthd,bsd->bths", q_i, k_i) * v3.index_head_dim ** -0.5
index = np.asarray(jnp.einsum("bths,bth->bts", jax.nn.relu(scores), w_i))[0]
index = np.where(causal, index, -np.inf)
k_sel = v3.index_topk
selected = np.zeros((T, T), bool)
for t in range(T):
    selected[t, np.argsort(-index[t], kind="stable")[: min(k_sel, t + 1)]] = True

q_nope, q_rope, c_kv, k_rope = mla.mla_inputs(layer0, v3, x, cos, sin, q_resid)
q_lat = jnp.einsum("bthn,hnc->bthc", q_nope, layer0.w_uk)
logits = (jnp.einsum("bthc,bsc->bhts", q_lat, c_kv)
          + jnp.einsum("bthr,bsr->bhts", q_rope, k_rope)) * v3.softmax_scale
probs = np.asarray(jax.nn.softmax(jnp.where(causal, logits, -jnp.inf), axis=-1))[0, 0]
kept = (probs * selected).sum(-1)  # the dense attention mass DSA's selection keeps
print(f"each query attends to min(t + 1, {k_sel}) of its t + 1 tokens; dense attention mass "
      f"on the selected tokens: median {np.median(kept[k_sel:]):.2f} (queries past {k_sel})")

fig, ax = plt.subplots(figsize=(5, 4.5))
ax.imshow(np.where(causal, probs, np.nan), cmap="viridis")
ys, xs = np.nonzero(selected)
ax.scatter(xs, ys, s=6, c="red", marker="s", label=f"indexer top-{k_sel}")
ax.set_xlabel("key position s")
ax.set_ylabel("query position t")
ax.set_title("layer 0, head 0: dense attention and DSA's selection")
ax.legend(loc="upper right", fontsize=8)
fig.tight_layout()
fig.savefig(f"{FIGURES}/06_dsa_selection.png", dpi=80)

# %% [markdown]
# Decoding the whole model: each decode step scores every cached token with the indexer
# and gathers only the selected latent rows (`kvjax.attention.sparse`); one-token-at-a-time
# prefill gives the same tokens. At DeepSeek-V3.2's real shape (61 layers, index_topk
# 2048), what one decode step reads at 32K context (`kvjax.memory`):

# %%
v3_result = generate(v3_model, v3_params, prompts, key=jax.random.key(0), max_new_tokens=12,
                     cache=CacheConfig(page_size=8))
for prompt_, seq in zip(prompts, v3_result.sequences(), strict=True):
    print(len(prompt_), "prompt tokens ->", seq)
v3_ref = generate(v3_model, v3_params, prompts, key=jax.random.key(0), max_new_tokens=12,
                  cache=CacheConfig(page_size=8), chunk_size=1)
reads = memory.indexer.dsa_cache_bytes(memory.get_preset("deepseek-v3.2"), 32768)
print(f"dense MLA reads {float(reads.dense_read_bytes) / 2**20:.0f} MiB per step; DSA reads "
      f"{float(reads.dsa_read_bytes) / 2**20:.0f} MiB (indexer keys of every token + "
      f"{reads.selected} latent rows), {float(reads.dsa_read_bytes / reads.dense_read_bytes):.2f}x")

# %%
# The demonstrated results: the linear layers' state is fixed while KV grows, so the
# hybrid's cache falls towards a quarter of the dense twin's; the chunked and recurrent
# delta rules agree; chunked and one-token prefill decode the same tokens on both
# families; every DSA query attends to at most index_topk tokens.
assert np.all(state == state[0]) and np.all(np.diff(kv) > 0)
assert abs((state[-1] + kv[-1]) / dense[-1] - preset.kv_layers / preset.num_layers) < 0.01
assert state_err < 1e-5 and out_err < 1e-5, (state_err, out_err)
np.testing.assert_array_equal(chunked.tokens, one_by_one.tokens)
assert (selected.sum(-1) == np.minimum(np.arange(T) + 1, k_sel)).all()
assert not (selected & ~causal).any()
np.testing.assert_array_equal(v3_result.tokens, v3_ref.tokens)
assert reads.dsa_read_bytes < reads.dense_read_bytes / 2
