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
# # Writing your own cache policy
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/kvjax/kvjax/blob/main/notebooks/05_custom_policy.ipynb)
#
# A cache policy in kvjax is a frozen dataclass with a few hooks that a decode loop calls
# (`kvjax.cache.policies.CachePolicy`: `init_state`, `rope_positions`, `after_prefill`,
# `before_attention`, `after_step`; every hook defaults to "do nothing"). An eviction policy
# only has to say *which slots to keep*; `kvjax.cache.policies.compact` moves them to the
# front of each sequence and gives whole pages back to the pool.
#
# Here we write **KeyNorm**: keep the recent window plus the older tokens whose keys have
# the *smallest* L2 norm (Devoto et al., 2024, observe that low-norm keys tend to receive
# high attention). It needs no attention scores and no state.

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
from kvjax.cache import policies
from kvjax.cache.policies.base import active_rows, ok_status
from kvjax.cache.policies.compaction import only_rows
from kvjax.cache.policies.toy import dense_kv, init_toy, toy_generate

FIGURES = os.environ.get("KVJAX_FIGURES", "figures")
os.makedirs(FIGURES, exist_ok=True)
BACKEND = jax.default_backend()
SMALL = BACKEND == "cpu"  # tiny sizes on CPU, larger on TPU/GPU
print("backend:", BACKEND, "devices:", jax.device_count())

# %% [markdown]
# ## 1. The policy (under 40 lines)

# %%
import dataclasses  # noqa: E402


@dataclasses.dataclass(frozen=True, kw_only=True)
class KeyNorm(policies.CachePolicy):
    """Keep `recent` newest tokens plus the older ones with the smallest key norm."""

    budget: int = 64
    recent: int = 8

    def __post_init__(self):
        if not 0 <= self.recent <= self.budget:
            raise ValueError(f"KeyNorm: need 0 <= recent <= budget, got {self.recent}, "
                             f"{self.budget}.")

    def _evict(self, cache, rows):
        spec = cache.spec
        if self.budget >= spec.max_tokens_per_seq:  # nothing can ever exceed the budget
            return cache, ok_status(cache)
        norms = jnp.linalg.norm(cache.pages.k.astype(jnp.float32), axis=-1)  # [L, H, P, ps]
        per_slot = norms[:, :, jnp.maximum(cache.block_tables, 0)]  # [L, H, S, M, ps]
        layers, heads, seqs = per_slot.shape[:3]
        per_slot = per_slot.reshape(layers, heads, seqs, -1).transpose(0, 2, 1, 3)
        keep, lengths = policies.keep_heavy_and_recent(-per_slot, cache.lengths, self.budget,
                                                        self.recent, seq_axis=1)
        keep, lengths = only_rows(keep, lengths, cache.lengths, rows)  # leave idle slots alone
        cache, _, status = policies.compact(cache, keep, lengths)
        return cache, status

    def after_prefill(self, cache, state, queries, q_lengths):
        return self.after_step(cache, state, queries[:, :, 0], q_lengths > 0)

    def after_step(self, cache, state, queries, active=None):
        cache, status = self._evict(cache, active_rows(cache, active))
        return cache, state, status


# %% [markdown]
# `keep_heavy_and_recent` ranks the older slots by score (here: minus the key norm; slots
# past a sequence's length are never picked) and appends the recent window; `only_rows`
# restricts the eviction to the slots that are decoding (`active`); `compact` does the
# moving and the freeing, and reports `OUT_OF_PAGES` in a status instead of raising
# inside jit.
#
# ## 2. Check it on a cache we control
#
# One sequence of `T` random keys; each value's first channel holds its token position so
# we can read back which tokens survived, and compare with NumPy.

# %%
T, budget, recent = (48, 16, 4) if SMALL else (512, 128, 16)
spec = kvx.CacheSpec(attention=kvx.AttentionSpec(q_heads=4, kv_heads=2, head_dim=16),
                     num_layers=2, page_size=4, num_pages=2 * T // 4 + 8, max_seqs=2,
                     max_pages_per_seq=T // 4 + 2)
rng = np.random.default_rng(0)
k = rng.standard_normal((spec.num_layers, T, 2, 16)).astype(np.float32)
k *= rng.uniform(0.2, 2.0, size=(spec.num_layers, T, 2, 1)).astype(np.float32)
v = np.zeros_like(k)
v[..., 0] = np.arange(T)[None, :, None]

cache = kvx.init_cache(spec)
cache, status = kvx.cache.reserve(cache, jnp.array([T, 0], jnp.int32))
status.raise_if_error()
slots = kvx.cache.token_slots(cache, jnp.arange(T)[None], jnp.ones((1, T), bool),
                              seq_ids=jnp.array([0]))
for layer in range(spec.num_layers):
    cache = kvx.cache.write_layer(cache, layer, slots, jnp.asarray(k[layer])[None],
                                  jnp.asarray(v[layer])[None])
free_before = int(cache.num_free_pages)

policy = KeyNorm(budget=budget, recent=recent)
state = policy.init_state(cache)
dummy_q = jnp.zeros((spec.num_layers, spec.max_seqs, 1, 4, 16), jnp.float32)  # unused
cache, state, status = jax.jit(policy.after_prefill)(cache, state, dummy_q,
                                                     jnp.array([T, 0], jnp.int32))
status.raise_if_error()
kvx.cache.check_invariants(cache.table)
kept = dense_kv(cache)[1][:, 0, :, :budget, 0].round().astype(int)  # [layers, heads, budget]

norms = np.linalg.norm(k, axis=-1)  # [layers, T, heads]
expected = np.empty_like(kept)
for layer in range(spec.num_layers):
    for h in range(2):
        older = np.argsort(norms[layer, : T - recent, h], kind="stable")[: budget - recent]
        expected[layer, h] = np.r_[np.sort(older), T - recent:T]
print("layer 0, head 0 keeps", kept[0, 0].tolist())
print(f"pages: {free_before} free before, {int(cache.num_free_pages)} after")

fig, ax = plt.subplots(figsize=(7, 2.8))
ax.bar(np.arange(T), norms[0, :, 0], color="lightgrey", label="evicted")
ax.bar(kept[0, 0], norms[0, kept[0, 0], 0], color="tab:blue", label="kept")
ax.set_xlabel("token position")
ax.set_ylabel("key norm (layer 0, head 0)")
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(f"{FIGURES}/05_keynorm_kept.png", dpi=80)

# %% [markdown]
# ## 3. Run it in a decode loop
#
# `kvjax.cache.policies.toy` is a tiny random attention stack that calls the hooks exactly
# as `kvjax.generate` does, one Python step at a time, so we can record the tokens each
# sequence holds after every step, with `KeyNorm` and with `NoPolicy`.

# %%
params = init_toy(spec, seed=1)
prompts = rng.integers(0, 64, (2, T // 2))
steps = T // 2 - 4


def held(policy):
    trace = []
    toy_generate(params, kvx.init_cache(spec), policy, prompts, steps,
                 on_step=lambda i, c, s: trace.append(int(c.lengths.max())))
    return trace


trace = {"NoPolicy": held(policies.NoPolicy()), "KeyNorm": held(policy)}
fig, ax = plt.subplots(figsize=(5, 3))
for name, t in trace.items():
    ax.plot(t, label=name)
ax.axhline(budget, color="k", ls=":", lw=1, label="budget")
ax.set_xlabel("decode step")
ax.set_ylabel("tokens held per sequence")
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(f"{FIGURES}/05_keynorm_decode.png", dpi=80)

# %% [markdown]
# ## 4. The same policy in `kvjax.generate` with a model
#
# `generate(..., policy=KeyNorm(...))` runs it inside the compiled decode loop of a tiny
# Llama-style model (random weights): every sequence ends at the budget, whatever its
# prompt length.

# %%
from kvjax.generate import generate  # noqa: E402
from kvjax.models import get_family  # noqa: E402
from kvjax.models.layers import RopeConfig  # noqa: E402
from kvjax.models.llama import LlamaConfig  # noqa: E402

head_dim = 64 if SMALL else 128
config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_layers=2,
                     q_heads=4, kv_heads=2, head_dim=head_dim,
                     rope=RopeConfig(theta=1e4, dim=head_dim))
family = get_family("llama")
model = family.model(config)
lm_params = family.init_params(config, jax.random.key(0))
lm_prompts = [rng.integers(1, 128, size=n).tolist() for n in (T // 2, T // 4)]
out = generate(model, lm_params, lm_prompts, key=jax.random.key(0), max_new_tokens=T // 2,
               page_size=8, free_finished=False, policy=policy)
lm_lengths = np.asarray(out.cache.lengths)[: len(lm_prompts)]
print("generated", out.num_generated.tolist(), "tokens; cache holds", lm_lengths.tolist(),
      f"tokens per sequence (budget {budget})")

# %%
# The demonstrated results: KeyNorm keeps exactly the NumPy-predicted tokens, frees pages,
# and holds every sequence at its budget during decoding while NoPolicy keeps growing, in the
# toy loop and in kvjax.generate.
np.testing.assert_array_equal(kept, expected)
assert int(cache.num_free_pages) > free_before
assert max(trace["KeyNorm"]) == budget and trace["NoPolicy"][-1] == T // 2 + steps
assert (out.num_generated == T // 2).all() and (lm_lengths == budget).all(), lm_lengths
