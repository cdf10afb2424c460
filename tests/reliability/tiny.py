"""Tiny random Llama (GQA) and DeepSeek (MLA) models for the reliability tests, built once."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import quantized as qz
from kvjax.models import deepseek as ds
from kvjax.models import llama
from kvjax.models.base import get_family
from kvjax.models.layers import RopeConfig

VOCAB = 96


@functools.cache
def model_and_params(kind: str):
    """(model, params) of a tiny random "gqa" (Llama, 8 query / 4 KV heads) or "mla"
    (DeepSeek) model; weights scaled up so greedy decoding has no near-ties."""
    if kind == "gqa":
        config = llama.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2, q_heads=8,
            kv_heads=4, head_dim=8, rope=RopeConfig(theta=10000.0, dim=8))
        family = get_family("llama")
    else:
        config = ds.DeepseekConfig(
            vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_layers=2, num_heads=8,
            kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8)
        family = get_family("deepseek")
    model = family.model(config)
    params = family.init_params(config, jax.random.key(7))
    params = jax.tree.map(
        lambda x: x * 3 if x.ndim >= 2 and jnp.issubdtype(x.dtype, jnp.floating) else x, params)
    return model, params


def prompts(rng: np.random.Generator, lengths) -> list[list[int]]:
    return [rng.integers(0, VOCAB, n).tolist() for n in lengths]


def snapshot(tree):
    """Host copies of every array leaf (raises if one was donated and deleted)."""
    return jax.tree.map(lambda x: np.array(x, copy=True), tree)


def assert_same(tree, snap):
    """`tree` still holds exactly the arrays of `snap` (and none was deleted)."""
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), y), tree, snap)


def restore(like, snap):
    """A fresh device copy of `snap` with the static structure of `like`."""
    return jax.tree.unflatten(jax.tree.structure(like),
                              [jax.device_put(x) for x in jax.tree.leaves(snap)])


def device(x, dtype):
    """A host array on the device as `dtype` (`jnp.asarray` would compile a program per
    shape and dtype to stage it)."""
    return jax.device_put(np.asarray(x).astype(jnp.dtype(dtype)))


def jit_kivi_writes(monkeypatch):
    """Routes `kvjax.cache.quantized.write_layer` calls with a concrete layer through one
    jitted program per layer and shapes: run eagerly, its page flush (a `lax.cond`)
    compiles anew on every call. The checks of `kvjax.cache.write` run before it as they
    did, and write_layer's own argument checks run while it traces, raising the same
    errors; only its check that a write covers every reserved token needs a concrete
    cache (tests/cache/test_quant_cache.py has it)."""
    original = qz.write_layer
    jitted = jax.jit(original, static_argnames="layer")

    def write_layer(cache, layer, a, b, seq_ids=None, index_keys=None):
        if isinstance(layer, int | np.integer) and not isinstance(layer, bool):
            return jitted(cache, int(layer), a, b, seq_ids, index_keys=index_keys)
        return original(cache, layer, a, b, seq_ids, index_keys=index_keys)

    monkeypatch.setattr(qz, "write_layer", write_layer)
