"""tunix's published Gemma 3 (Flax NNX, `tunix.models.gemma3.model`): a tiny random one
and its own greedy decoding on its own dense cache.

tunix is installed without its requirements (`pip install --no-deps google-tunix==0.1.7
einops`): its top-level package imports its trainers (datasets, grain, numba,
tensorflow-datasets; their pins would also replace this environment's transformers),
while the model modules need only flax, jax, jaxtyping and einops. `load_gemma3` imports
the model module without running that top-level `__init__` when it cannot run.
"""

import importlib
import importlib.machinery
import importlib.util
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

# Six layers: Gemma 3's pattern of five local (sliding-window) layers and one global;
# the global layer's RoPE has Gemma 3's larger base and linear factor 8.
CONFIG = dict(num_layers=6, num_embed=67, embed_dim=32, hidden_dim=64, num_heads=4,
              head_dim=16, num_kv_heads=2, sliding_window_size=8,
              local_base_frequency=10_000, global_base_frequency=1_000_000,
              global_scale_factor=8.0)


def load_gemma3():
    """`tunix.models.gemma3.model`, or None when google-tunix is not installed."""
    try:
        return importlib.import_module("tunix.models.gemma3.model")
    except ImportError:
        pass  # not installed, or its trainers' requirements are missing
    for name in [m for m in sys.modules if m == "tunix" or m.startswith("tunix.")]:
        del sys.modules[name]
    spec = importlib.util.find_spec("tunix")
    if spec is None:
        return None
    # The package without its top-level __init__ (the model modules need none of it).
    stub = importlib.machinery.ModuleSpec("tunix", None, is_package=True)
    stub.submodule_search_locations = [os.path.dirname(spec.origin)]
    sys.modules["tunix"] = importlib.util.module_from_spec(stub)
    return importlib.import_module("tunix.models.gemma3.model")


def tiny_gemma3(gemma3, seed: int):
    """A random float32 tunix Gemma3 of `CONFIG`: every parameter drawn afresh (tunix
    initialises its norms and MLP to zeros and its embeddings at std 0.01)."""
    config = gemma3.ModelConfig(**CONFIG, param_dtype=jnp.float32)
    model = nnx.eval_shape(lambda: gemma3.Gemma3(config, rngs=nnx.Rngs(0)))
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree.flatten_with_path(state)[0]]
    rng = np.random.default_rng(seed)
    new = []
    for path, leaf in zip(paths, leaves, strict=True):
        # Embeddings at unit scale so the tied output layer's logits are well apart;
        # weights at about 1/sqrt(fan-in); norm scales (used as 1 + scale) near 0.
        std = 1.0 if "input_embedding" in path else 0.1 if "scale" in path else 0.2
        new.append(jax.device_put(rng.normal(0.0, std, leaf.shape).astype(np.float32)))
    nnx.update(model, jax.tree.unflatten(treedef, new))
    return model


def dense_decode(model, prompts, max_new: int):
    """tunix's own greedy decoding of ragged prompts on its dense cache, one token per call.

    All rows advance in lockstep (tunix's cache keeps one `end_index`): at step t every
    row feeds its prompt token t at position t, or, past its prompt, its last greedy
    token; the mask lets it see cache slots 0..t. One jitted `lax.scan` over the steps.

    Returns (tokens int32[batch, max_new], logits float32[batch, steps, vocab]: row b's
    logits after feeding its token t).
    """
    lengths = np.array([len(p) for p in prompts], np.int32)
    steps = int(lengths.max()) + max_new - 1
    padded = np.zeros((len(prompts), steps + 1), np.int32)
    for b, p in enumerate(prompts):
        padded[b, : len(p)] = p
    graphdef, state = nnx.split(model)
    with jax.numpy_dtype_promotion("standard"):  # tunix's code relies on it
        logits = np.asarray(_scan(graphdef, state, jax.device_put(padded),
                                  jax.device_put(lengths)))
    tokens = np.stack([logits[b, lengths[b] - 1: lengths[b] - 1 + max_new].argmax(-1)
                       for b in range(len(prompts))]).astype(np.int32)
    return tokens, logits


@jax.jit
def _scan(graphdef, state, padded, lengths):
    batch, size = padded.shape
    cfg = CONFIG
    shape = (batch, size, cfg["num_kv_heads"], cfg["head_dim"])
    cache = {f"layer_{i}": dict(k=jnp.zeros(shape, jnp.float32), v=jnp.zeros(shape, jnp.float32),
                                end_index=jnp.zeros((batch,), jnp.int32))
             for i in range(cfg["num_layers"])}

    def body(carry, t):
        cache, last = carry
        tok = jnp.where(t < lengths, padded[:, t], last)[:, None]
        mask = jnp.broadcast_to(jnp.arange(size) <= t, (batch, 1, size))
        m = nnx.merge(graphdef, state)
        logits, cache = m(tok, jnp.full(tok.shape, t, jnp.int32), cache, mask)
        row = logits[:, 0]
        return (cache, jnp.argmax(row, -1).astype(jnp.int32)), row

    _, rows = jax.lax.scan(body, (cache, jnp.zeros((batch,), jnp.int32)),
                           jnp.arange(size - 1, dtype=jnp.int32))
    return rows.transpose(1, 0, 2)
