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
# # Writing your own cache policy
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/kvjax/kvjax/blob/main/notebooks/05_custom_policy.ipynb)
#
# A cache policy in kvjax is a frozen dataclass with a few hooks that kvjax's decode loop
# calls (`kvjax.cache.policies.CachePolicy`: `init_state`, `rope_positions`,
# `after_prefill`, `before_attention`, `after_step`, `fork_state`; every hook defaults to
# "do nothing"). `kvjax.generate.generate(..., policy=...)` (and `stream`, `score`,
# `sample_n`, `beam_search`) runs them inside the compiled loop. An eviction policy only has
# to say *which slots to keep*; `kvjax.cache.policies.compact` moves them to the front of
# each sequence and gives whole pages back to the pool.
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

FIGURES = os.environ.get("KVJAX_FIGURES", "figures")
os.makedirs(FIGURES, exist_ok=True)
BACKEND = jax.default_backend()
SMALL = BACKEND == "cpu"  # tiny sizes on CPU, larger on TPU/GPU
print("backend:", BACKEND, "devices:", jax.device_count())

# %% [markdown]
# ## 1. The policy (about 40 lines)

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

    def init_state(self, cache):
        # Say which page kinds the policy is defined on, before any work is done.
        if cache.is_quantized or cache.spec.is_mla:
            raise policies.UndefinedCombination(
                "KeyNorm reads full-precision per-head keys: use a K/V cache without "
                "quantization (not KIVI pages, not MLA latents).")
        return None  # stateless

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
# inside jit. Keys are cached after RoPE, so a key moved to another slot needs no change
# (the default `rope_positions` keeps the tokens' positions in the text).
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
for layer in range(spec.num_layers):  # K/V [batch, q_len, kv_heads, head_dim] into slot 0
    cache = kvx.cache.write(cache, layer, k[layer][None], v[layer][None],
                            q_lengths=jnp.array([T]), seq_ids=jnp.array([0]))
free_before = int(cache.num_free_pages)

policy = KeyNorm(budget=budget, recent=recent)
state = policy.init_state(cache)
dummy_q = jnp.zeros((spec.num_layers, spec.max_seqs, 1, 4, 16), jnp.float32)  # unused
cache, state, status = jax.jit(policy.after_prefill)(cache, state, dummy_q,
                                                     jnp.array([T, 0], jnp.int32))
status.raise_if_error()
kvx.cache.check_invariants(cache.table)


def cached_positions(cache, layer, head, seq=0):
    """The first value channel (the token position) of every token `seq` holds."""
    view = kvx.cache.layer_view(cache, layer)
    n = int(cache.lengths[seq])
    pages = np.asarray(cache.block_tables[seq, : -(-n // spec.page_size)])
    return np.asarray(view.v)[head, pages, :, 0].reshape(-1)[:n].round().astype(int)


kept = np.array([[cached_positions(cache, layer, h) for h in range(2)]
                 for layer in range(spec.num_layers)])  # [layers, heads, budget]

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
# ## 3. Run it in `kvjax.generate`
#
# The policy goes to the decode loop as it is: `policy=KeyNorm(...)`. The model is the
# byte-level tiny GQA model shipped with kvjax (`kvjax.models.tiny`, trained on Python code);
# the prompt is a few lines of code. `kvjax.generate.stream` runs the loop one jitted step at
# a time, so we can watch the tokens each sequence holds after every step; `generate` runs
# the same step function as one compiled `lax.while_loop` and must produce the same bytes.
# Without a policy the cache keeps growing.

# %%
from kvjax.generate import CacheConfig, generate, stream  # noqa: E402
from kvjax.models.tiny import load_tiny  # noqa: E402

model, lm_params = load_tiny("gqa")
code = [b'def read_lines(path):\n    """Return the lines of a file."""\n    with open(path) as f:\n'
        b'        return f.read().splitlines()\n\n\ndef count_words(text):\n    """Return',
        b'class Stack:\n    def __init__(self):\n        self.items = []\n\n'
        b'    def push(self, item):\n        self.items.append(item)\n\n    def pop(self):\n']
lm_prompts = [list(c) for c in code]
new_tokens = 48
lm_policy = KeyNorm(budget=64, recent=16)
kw = dict(key=jax.random.key(0), max_new_tokens=new_tokens, cache=CacheConfig(page_size=16),
          free_finished=False)

trace = {"held": [], "free pages": []}
for event in stream(model, lm_params, lm_prompts, policy=lm_policy, **kw):
    c = event.state.cache
    trace["held"].append(np.asarray(c.lengths)[: len(code)])
    trace["free pages"].append(int(c.num_free_pages))
streamed = np.asarray(event.state.tokens)
held = np.array(trace["held"])  # [steps, rows]

with_policy = generate(model, lm_params, lm_prompts, policy=lm_policy, **kw)
full = generate(model, lm_params, lm_prompts, **kw)
for name, res in (("KeyNorm", with_policy), ("full cache", full)):
    print(f"-- {name}: cache holds {np.asarray(res.cache.lengths)[: len(code)].tolist()} tokens")
    for row in res.sequences():
        print("   ", repr(bytes(row).decode("utf-8", errors="replace")))
agree = float((with_policy.tokens == full.tokens).mean())
print(f"KeyNorm's greedy bytes equal the full cache's on {agree:.0%} of positions")

# Without a policy the longest row holds its prompt plus one token per step (the final
# lengths of `full` are checked below).
full_held = max(len(p) for p in lm_prompts) + np.arange(held.shape[0])
fig, ax = plt.subplots(figsize=(5, 3))
ax.plot(full_held, label="no policy")
ax.plot(held.max(axis=1), label="KeyNorm")
ax.axhline(lm_policy.budget, color="k", ls=":", lw=1, label="budget")
ax.set_xlabel("decode step")
ax.set_ylabel("tokens held (longest row)")
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(f"{FIGURES}/05_keynorm_decode.png", dpi=80)

# %% [markdown]
# ## 4. Where it is not defined, it says so
#
# `init_state` refuses a KIVI cache before `generate` touches anything, naming what works.

# %%
try:
    generate(model, lm_params, lm_prompts, policy=lm_policy, key=jax.random.key(0),
             max_new_tokens=4, cache=CacheConfig(page_size=32, quant=kvx.QuantSpec(bits=4)))
    refused = None
except policies.UndefinedCombination as err:
    refused = err
print("UndefinedCombination:", refused)

# %%
# The demonstrated results: KeyNorm keeps exactly the NumPy-predicted tokens and frees pages;
# inside kvjax.generate it holds every sequence at its budget while the full cache keeps
# growing, and the step-by-step stream and the compiled loop produce the same bytes.
np.testing.assert_array_equal(kept, expected)
assert int(cache.num_free_pages) > free_before
assert held.max() == lm_policy.budget, held.max()
np.testing.assert_array_equal(np.asarray(with_policy.cache.lengths)[: len(code)],
                              lm_policy.budget)
np.testing.assert_array_equal(np.asarray(full.cache.lengths)[: len(code)],
                              [len(p) + new_tokens - 1 for p in lm_prompts])
np.testing.assert_array_equal(with_policy.tokens, streamed)
assert (with_policy.num_generated == new_tokens).all(), with_policy.num_generated
assert isinstance(refused, policies.UndefinedCombination)
