# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.7
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # A Flax NNX model on kvjax's paged cache
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/kvjax/kvjax/blob/main/notebooks/07_flax_nnx.ipynb)
#
# Take a decoder written with Flax's own NNX modules, decode it with Flax's dense cache,
# then swap its `nnx.MultiHeadAttention` layers for kvjax's paged attention in place
# (`kvjax.nnx.adapt`, the weights are shared) and decode again: the same tokens, on a cache
# that holds only the pages the sequences fill, and with KIVI int4 pages a quarter of
# that. More in [docs/flax.md](../docs/flax.md).

# %%
# On Colab, install kvjax with Flax from the repository; elsewhere it is already installed.
import importlib.util
import subprocess
import sys

if importlib.util.find_spec("kvjax") is None or importlib.util.find_spec("flax") is None:
    subprocess.check_call(
        [sys.executable, "-m", "pip", "install", "-q",
         "kvjax[flax] @ git+https://github.com/kvjax/kvjax"]
    )

# %%
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kvjax.generate
import kvjax.nnx as kvnnx
from kvjax import QuantSpec
from kvjax.generate import CacheConfig

VOCAB, DIM, LAYERS, MAX_LEN = 64, 64, 2, 256


class Block(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.LayerNorm(DIM, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=8, num_kv_heads=2, in_features=DIM,
                                           decode=False, rngs=rngs)
        self.mlp = nnx.Linear(DIM, DIM, rngs=rngs)

    def __call__(self, x, decode):
        x = x + self.attn(self.norm(x), decode=decode)
        return x + self.mlp(jax.nn.gelu(x))


class LM(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.pos = nnx.Embed(MAX_LEN, DIM, rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])
        self.head = nnx.Linear(DIM, VOCAB, rngs=rngs)

    def __call__(self, tokens, positions, decode=False):
        x = self.embed(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x, decode)
        return self.head(x)


model = LM(nnx.Rngs(0))
prompts = np.random.default_rng(0).integers(0, VOCAB, (2, 24))  # two 24-token prompts
NEW = 16

# %% [markdown]
# ## Flax's dense cache
#
# `init_cache` gives every layer a `[batch, max_len, kv_heads, head_dim]` K and V buffer,
# sized for the longest sequence up front. Decoding feeds one token per call.

# %%
for block in model.blocks:
    block.attn.init_cache((2, MAX_LEN, DIM))
dense_bytes = sum(x.nbytes for block in model.blocks
                  for x in (block.attn.cached_key[...], block.attn.cached_value[...]))


@nnx.jit
def dense_step(model, token, position):
    return model(token, jnp.full(token.shape, position), decode=True)[:, -1]


last = None
flax_tokens = []
for t in range(prompts.shape[1] + NEW - 1):
    token = prompts[:, t:t + 1] if t < prompts.shape[1] else last[:, None]
    last = jnp.argmax(dense_step(model, jnp.asarray(token), t), -1)
    if t >= prompts.shape[1] - 1:
        flax_tokens.append(np.asarray(last))
flax_tokens = np.stack(flax_tokens, 1)
for block in model.blocks:  # drop Flax's cache: kvjax's replaces it
    block.attn.cached_key = block.attn.cached_value = block.attn.cache_index = None
print(f"Flax dense cache: {dense_bytes / 1024:.0f} KiB for {LAYERS} layers")

# %% [markdown]
# ## The same model on kvjax's pages
#
# `adapt` swaps the attention in place; `kvjax.nnx.generate` runs kvjax's decode loop
# (chunked prefill, then a jitted loop) on a paged cache. The pages in use are what the
# two sequences fill, rounded up to a page; KIVI int4 pages store 4-bit codes plus
# per-group scales and a float32 tail of recent tokens.

# %%
kvnnx.adapt(model)


def held_bytes(cache):
    """Bytes of the pages the sequences hold (and, for KIVI, of their tails)."""
    pool = sum(x.nbytes for x in jax.tree.leaves(cache.pages))
    used = cache.spec.num_pages - int(cache.table.num_free)
    tail = sum(x.nbytes for x in jax.tree.leaves(cache.tail))  # KIVI: the float32 tails
    return pool * used // cache.spec.num_pages + tail


results = {}
for name, quant in (("float32", None), ("KIVI int4", QuantSpec(bits=4, group_size=8,
                                                                 residual=16))):
    results[name] = kvnnx.generate(model, prompts.tolist(), vocab_size=VOCAB,
                                   key=jax.random.key(0), max_new_tokens=NEW,
                                   cache=CacheConfig(page_size=16, quant=quant),
                                   free_finished=False)
    print(f"kvjax {name}: {held_bytes(results[name].cache) / 1024:.1f} KiB in use; "
          f"tokens equal Flax's: {(results[name].tokens == flax_tokens).all()}")

# %% [markdown]
# ## A published model: tunix's Gemma 3
#
# [tunix](https://github.com/google/tunix) publishes NNX LLMs with dense caches of their
# own. `kvjax.nnx.tunix.adapt_gemma3` swaps the attention layers of its Gemma 3 (five
# sliding-window layers to one global) for paged ones that keep its weights. A toy
# config, random weights; tunix's own decoding on its dense cache first. On Colab the
# next cell installs `google-tunix`; where tunix is not installed this section says so
# and is skipped.

# %%
if "google.colab" in sys.modules and importlib.util.find_spec("tunix") is None:
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "google-tunix"])
try:
    from tunix.models.gemma3 import model as gemma3
except ImportError as err:
    gemma3 = None
    print(f"tunix is not available ({err}); skipping its section")

# %%
if gemma3 is not None:
    from kvjax.nnx import tunix as kvtunix

    config = gemma3.ModelConfig(num_layers=6, num_embed=VOCAB, embed_dim=DIM,
                                hidden_dim=2 * DIM, num_heads=4, head_dim=16, num_kv_heads=2,
                                sliding_window_size=16, global_base_frequency=1_000_000,
                                param_dtype=jnp.float32)
    gemma = gemma3.Gemma3(config, rngs=nnx.Rngs(1))
    # tunix initialises norms and MLPs to zero and embeddings at 0.01: draw them afresh.
    params = nnx.state(gemma, nnx.Param)
    draw = np.random.default_rng(1)
    nnx.update(gemma, jax.tree.map(
        lambda x: jnp.asarray(draw.normal(0, 1 if x.shape == (VOCAB, DIM) else 0.2, x.shape),
                              jnp.float32), params))

    # tunix's dense cache: every layer holds MAX_LEN positions up front.
    shape = (2, MAX_LEN, config.num_kv_heads, config.head_dim)
    tunix_cache = {f"layer_{i}": dict(k=jnp.zeros(shape), v=jnp.zeros(shape),
                                      end_index=jnp.zeros(2, jnp.int32))
                   for i in range(config.num_layers)}
    tunix_bytes = sum(x.nbytes for layer in tunix_cache.values()
                      for x in (layer["k"], layer["v"]))

    @nnx.jit
    def tunix_step(gemma, token, position, cache):
        mask = jnp.broadcast_to(jnp.arange(MAX_LEN) <= position, (2, 1, MAX_LEN))
        logits, cache = gemma(token, jnp.full(token.shape, position), cache, mask)
        return jnp.argmax(logits[:, -1], -1), cache

    tunix_tokens = []
    for t in range(prompts.shape[1] + NEW - 1):
        token = prompts[:, t:t + 1] if t < prompts.shape[1] else last[:, None]
        last, tunix_cache = tunix_step(gemma, jnp.asarray(token), t, tunix_cache)
        if t >= prompts.shape[1] - 1:
            tunix_tokens.append(np.asarray(last))
    tunix_tokens = np.stack(tunix_tokens, 1)

    kvtunix.adapt_gemma3(gemma)  # in place: the weights are shared
    gemma_model, gemma_params = kvtunix.as_model(gemma)
    gemma_result = kvjax.generate.generate(gemma_model, gemma_params, prompts.tolist(),
                                           key=jax.random.key(0), max_new_tokens=NEW,
                                           cache=CacheConfig(page_size=16),
                                           free_finished=False)
    print(f"tunix dense cache: {tunix_bytes / 1024:.0f} KiB for {config.num_layers} layers; "
          f"kvjax: {held_bytes(gemma_result.cache) / 1024:.1f} KiB in use")
    print("all tokens equal tunix's:", (gemma_result.tokens == tunix_tokens).all())
    assert (gemma_result.tokens == tunix_tokens).all()
    assert held_bytes(gemma_result.cache) < tunix_bytes / 4  # 40 of 256 positions

# %%
paged = held_bytes(results["float32"].cache)
assert (results["float32"].tokens == flax_tokens).all()
assert paged < dense_bytes / 4  # 40 of 256 positions, rounded up to pages
assert held_bytes(results["KIVI int4"].cache) < paged
