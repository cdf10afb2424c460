"""Per-slot recurrent state of a hybrid model's linear-attention layers.

A hybrid model (Qwen3-Next: three Gated DeltaNet layers for every full-attention
layer) caches pages only for its full-attention layers; each linear layer keeps a
fixed-size state per sequence slot instead: the last inputs of its causal convolution
and the delta-rule matrix. The state is a field of the same cache pytree
(`PagedKVCache.recurrent`), so one cache, one allocator and one decode loop serve the
whole model: `fork` copies a slot's state (it is small), `free` clears it, and the
model reads and writes it per layer with `read_state` / `write_state`.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kvjax.cache.state import PagedKVCache, RecurrentState
from kvjax.specs import CacheSpec

__all__ = ["init_state", "fork_rows", "free_rows", "read_state", "write_state"]


def init_state(spec: CacheSpec) -> RecurrentState | None:
    """Zeroed state for every slot, or None when the spec has no recurrent layers."""
    r = spec.recurrent
    if r is None:
        return None
    return RecurrentState(
        conv=jnp.zeros((r.num_layers, spec.max_seqs, r.conv_dim, r.conv_width), r.dtype),
        ssm=jnp.zeros((r.num_layers, spec.max_seqs, r.heads, r.key_dim, r.value_dim), r.dtype))


def fork_rows(cache: PagedKVCache, src: Int[Array, " n"], dst: Int[Array, " n"],
              ok: Bool[Array, ""]) -> PagedKVCache:
    """Each dst slot receives a copy of its src slot's state (when the fork succeeded)."""
    state = cache.recurrent
    if state is None:
        return cache
    n = cache.spec.max_seqs
    tgt = jnp.where(ok, jnp.atleast_1d(dst), n)
    src = jnp.clip(jnp.atleast_1d(src), 0, n - 1)
    state = jax.tree.map(lambda x: x.at[:, tgt].set(x[:, src], mode="drop"), state)
    return dataclasses.replace(cache, recurrent=state)


def free_rows(cache: PagedKVCache, seqs: Bool[Array, " max_seqs"]) -> PagedKVCache:
    """Freed slots' state returns to zero (a new sequence starts from nothing)."""
    state = cache.recurrent
    if state is None:
        return cache

    def clear(x):
        flags = seqs.reshape((1, -1) + (1,) * (x.ndim - 2))
        return jnp.where(flags, jnp.zeros((), x.dtype), x)

    return dataclasses.replace(cache, recurrent=jax.tree.map(clear, state))


def _check(cache: PagedKVCache, layer) -> RecurrentState:
    if not isinstance(cache, PagedKVCache) or cache.recurrent is None:
        raise ValueError("the cache holds no recurrent state: build it from a spec with "
                         "recurrent=RecurrentSpec(...) (a hybrid model's make_cache_spec).")
    n = cache.spec.recurrent.num_layers
    if not isinstance(layer, jax.core.Tracer) and not 0 <= int(layer) < n:
        raise ValueError(f"linear layer {int(layer)} is outside the cache's {n} recurrent "
                         f"layers (0 .. {n - 1}).")
    return cache.recurrent


def read_state(
    cache: PagedKVCache, layer: int | Int[Array, ""], seq_ids: Int[Array, " batch"] | None = None
) -> tuple[Float[Array, "batch conv_dim width"], Float[Array, "batch heads key_dim value_dim"]]:
    """Linear layer `layer`'s state of the rows' slots: (conv inputs, delta-rule state)."""
    state = _check(cache, layer)
    conv, ssm = state.conv[layer], state.ssm[layer]
    if seq_ids is not None:
        conv, ssm = conv[seq_ids], ssm[seq_ids]
    return conv, ssm


def write_state(
    cache: PagedKVCache,
    layer: int | Int[Array, ""],
    conv: Float[Array, "batch conv_dim width"],
    ssm: Float[Array, "batch heads key_dim value_dim"],
    *,
    seq_ids: Int[Array, " batch"] | None = None,
    rows: Bool[Array, " batch"] | None = None,
) -> PagedKVCache:
    """Stores linear layer `layer`'s new state for the rows' slots.

    Args:
      cache: the cache (pure function; jit it with the cache donated).
      layer: the linear layer (may be traced).
      conv, ssm: the new states, one row per batch row; cast to the state's dtype.
      seq_ids: the rows' distinct slots (default every slot in order).
      rows: which rows to store (default all): a row with no real token this step
        keeps its slot's state.
    """
    state = _check(cache, layer)
    batch = conv.shape[0]
    ids = jnp.arange(batch) if seq_ids is None else jnp.asarray(seq_ids, jnp.int32)
    if rows is not None:
        ids = jnp.where(rows, ids, cache.spec.max_seqs)
    new = RecurrentState(
        conv=state.conv.at[layer, ids].set(conv.astype(state.conv.dtype), mode="drop"),
        ssm=state.ssm.at[layer, ids].set(ssm.astype(state.ssm.dtype), mode="drop"))
    return dataclasses.replace(cache, recurrent=new)
