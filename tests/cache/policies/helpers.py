"""Helpers of the policy tests: caches of random tokens built with the public cache operations,
what a cache holds read back on the host, and one decode step driven through those operations.

Every page kind: full-precision K/V, MLA latents, KIVI pages (read back dequantized).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as kvc
from kvjax.cache import QuantLayer
from kvjax.cache import quantized as qz
from kvjax.cache.paged import _pools
from kvjax.cache.policies import NoPolicy
from kvjax.cache.quant import dequantize
from kvjax.models.base import get_family
from kvjax.models.llama import LlamaConfig
from kvjax.rope import RopeConfig
from kvjax.specs import AttentionSpec, CacheSpec, QuantSpec

__all__ = ["SPEC", "KIVI", "random_filled_cache", "dense_kv", "decode_step", "held_pages",
           "tiny_llama", "tiny_params", "write", "select", "attend"]

# The specs most tests share (so that their compiled programs are shared too): GQA 4:2,
# 2 layers, pages of 4 tokens, 2 slots of up to 36 tokens; and the same with KIVI 4-bit pages
# and a full-precision tail of the last 4 .. 7 tokens.
SPEC = CacheSpec(attention=AttentionSpec(q_heads=4, kv_heads=2, head_dim=8), num_layers=2,
                 page_size=4, num_pages=24, max_seqs=2, max_pages_per_seq=9)
KIVI = SPEC.replace(quant=QuantSpec(bits=4, group_size=4, residual=4))


@functools.partial(jax.jit, donate_argnames="cache")
def _write_all(cache, a, b, q_lengths):
    """Writes the tokens the last `reserve` added, every layer: a, b [layers, seqs, T, h, w]."""
    for layer in range(cache.spec.num_layers):
        cache = kvc.write(cache, layer, a[layer], b[layer], q_lengths=q_lengths)
    return cache


# The public operations the tests call one at a time, each as one jitted program (run
# eagerly, each call compiled every primitive it ran at the shapes it met).
@functools.partial(jax.jit, static_argnames="layer", donate_argnames="cache")
def write(cache, layer, a, b, q_lengths):
    """`kvjax.cache.write` of one layer's tokens."""
    return kvc.write(cache, layer, a, b, q_lengths=q_lengths)


@functools.partial(jax.jit, static_argnames=("policy", "layer"))
def select(policy, cache, state, layer, q):
    """`policy.before_attention` at a static layer."""
    return policy.before_attention(cache, state, layer, q)


@functools.partial(jax.jit, static_argnames="layer")
def attend(cache, layer, q, q_lengths, selection=None):
    """`kvjax.cache.attend` of q [seqs, q_len, q_heads, d] at a static layer (out, lse)."""
    return kvc.attend(cache, layer, q, q_lengths=q_lengths, selection=selection)


def _reserve_and_write(cache, num_new, a, b):
    cache, status = kvc.reserve(cache, jnp.asarray(num_new, jnp.int32))
    status.raise_if_error()
    return _write_all(cache, jnp.asarray(a), jnp.asarray(b), jnp.asarray(num_new, jnp.int32))


def random_filled_cache(
    spec: CacheSpec, lengths, rng: np.random.Generator, *, k=None, v=None
) -> tuple[kvc.PagedKVCache, np.ndarray, np.ndarray]:
    """A cache whose slot s holds `lengths[s]` tokens of random K/V (any page kind).

    Pages are handed out in a scrambled order (slot 0 takes pages, the others take theirs,
    slot 0 frees its pages and takes them back), so no test relies on a sequence owning
    consecutive pages. Built with `kvjax.cache.reserve / write / free` only.

    Args:
      spec: the cache's spec.
      lengths: tokens of each slot (fewer than max_seqs entries: the rest stay empty).
      rng: the draw.
      k, v: the tokens to write instead of a random draw, laid out as returned.

    Returns:
      (cache, k, v): float32 `[layers, max_seqs, heads, max_tokens, width]`, token j of
      slot s at `[:, s, :, j]` (MLA: c_KV and k_rope, one head). On a KIVI cache these are
      the tokens written, not the dequantized ones (see `dense_kv`).
    """
    n, t = spec.max_seqs, spec.max_tokens_per_seq
    lengths = np.asarray(list(lengths) + [0] * (n - len(lengths)), np.int32)
    heads = spec.attention.cache_heads
    wa, wb = spec.attention.cache_widths
    if k is None:
        k = rng.standard_normal((spec.num_layers, n, heads, t, wa)).astype(np.float32)
    if v is None:
        v = rng.standard_normal((spec.num_layers, n, heads, t, wb)).astype(np.float32)
    k, v = np.asarray(k, np.float32), np.asarray(v, np.float32)
    a, b = k.transpose(0, 1, 3, 2, 4), v.transpose(0, 1, 3, 2, 4)  # [layers, seqs, T, h, w]
    first = np.arange(n) == 0
    cache = kvc.init_cache(spec)
    extra = 0 if spec.quant is None else spec.quant.residual
    grab = np.where(first, min(2 * spec.page_size + extra, t), 0)
    cache, status = kvc.reserve(cache, jnp.asarray(grab, jnp.int32))
    status.raise_if_error()
    cache = _reserve_and_write(cache, np.where(first, 0, lengths), a, b)
    cache = kvc.free(cache, jnp.asarray(first))
    cache = _reserve_and_write(cache, np.where(first, lengths, 0), a, b)
    kvc.check_invariants(cache)
    return cache, k, v


def dense_kv(cache: kvc.PagedKVCache) -> tuple[np.ndarray, np.ndarray]:
    """What each sequence holds, gathered in position order (host side, NumPy).

    Returns:
      float32 (a, b) `[layers, max_seqs, heads, max_tokens, width]` (zeros past each
      length): K and V, or MLA's c_KV and k_rope; a KIVI cache's quantized pages
      dequantized, its tail as stored.
    """
    spec = cache.spec
    heads = spec.attention.cache_heads
    widths = spec.attention.cache_widths
    lengths = np.asarray(cache.lengths)
    out = [np.zeros((spec.num_layers, spec.max_seqs, heads, spec.max_tokens_per_seq, w),
                    np.float32) for w in widths]
    if cache.is_quantized:
        ql = np.asarray(cache.quant_lengths)
        ring = qz.tail_capacity(spec)
        pools = _dequantized_pools(cache)
        tails = (np.asarray(cache.tail.a, np.float32), np.asarray(cache.tail.b, np.float32))
        bt = np.asarray(cache.block_tables)
        ps = spec.page_size
        for o, pool, tail in zip(out, pools, tails, strict=True):
            for s in range(spec.max_seqs):
                j = np.arange(ql[s])
                o[:, s, :, :ql[s]] = pool[:, :, bt[s, j // ps], j % ps]
                j = np.arange(ql[s], lengths[s])
                o[:, s, :, ql[s]:lengths[s]] = tail[:, :, s, j % ring]
        return out[0], out[1]
    bt = np.asarray(cache.block_tables)
    ps = spec.page_size
    for o, pool in zip(out, (np.asarray(p, np.float32) for p in _pools(cache.pages)),
                       strict=True):
        for s in range(spec.max_seqs):
            j = np.arange(lengths[s])
            o[:, s, :, :lengths[s]] = pool[:, :, bt[s, j // ps], j % ps]
    return out[0], out[1]


@jax.jit
def _dequantized_jit(cache):
    out = []
    for layer in range(cache.spec.num_layers):
        view = qz.layer_view(cache, layer)
        out.append(tuple(
            dequantize(p.codes, p.scale, p.zero, bits=p.bits, grouping=p.grouping)
            if isinstance(p, QuantLayer) else p.astype(jnp.float32) for p in (view.k, view.v)))
    return tuple(jnp.stack(x) for x in zip(*out, strict=True))


def _dequantized_pools(cache) -> tuple[np.ndarray, np.ndarray]:
    """Every layer's pools of a KIVI cache dequantized: float32 [layers, heads, pages, ps, w]."""
    return tuple(np.asarray(x) for x in _dequantized_jit(cache))


def held_pages(cache: kvc.PagedKVCache) -> int:
    """Pages the block tables hold (no sharing): full-precision pages cover every token, a
    KIVI cache's pages its quantized tokens only."""
    n = np.asarray(cache.table.lengths)
    return int((-(-n // cache.spec.page_size)).sum())


@functools.partial(jax.jit, static_argnames="policy", donate_argnames="cache")
def decode_step(cache, state, a, b, q, *, policy=None):
    """One decode step of every slot through the public operations, as a model runs them.

    Reserve one token per slot holding a sequence; per layer: write its K/V, take the
    policy's selection, attend over the cache; then the policy's `after_step`.

    Args:
      cache: the cache (donated); state: the policy's state.
      a, b: [layers, max_seqs, 1, heads, width], the step's K/V.
      q: [layers, max_seqs, q_heads, head_dim], the step's queries.
      policy: the cache policy (static; None: `NoPolicy`).

    Returns:
      (cache, state, out [layers, max_seqs, q_heads, head_dim], reserve status, policy status).
    """
    policy = NoPolicy() if policy is None else policy
    active = cache.lengths > 0
    cache, status = kvc.reserve(cache, active.astype(jnp.int32))
    ones = active.astype(jnp.int32)
    outs = []
    for layer in range(cache.spec.num_layers):
        cache = kvc.write(cache, layer, a[layer], b[layer], q_lengths=ones)
        sel = policy.before_attention(cache, state, layer, q[layer])
        out, _ = kvc.attend(cache, layer, q[layer][:, None], q_lengths=ones, selection=sel)
        outs.append(out[:, 0])
    cache, state, p_status = policy.after_step(cache, state, q, active)
    return cache, state, jnp.stack(outs), status, p_status


@functools.cache
def tiny_llama():
    """A tiny random Llama for the decode loop (2 layers, GQA 4:2, head_dim 16, vocab 64)."""
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                         q_heads=4, kv_heads=2, head_dim=16, rope=RopeConfig(theta=1e4, dim=16))
    return get_family("llama").model(config)


def tiny_params(rng: np.random.Generator):
    """Fresh random params of `tiny_llama()`, weights scaled up so that greedy choices are
    rarely near ties."""
    return _scaled_params(jax.random.key(int(rng.integers(1 << 30))))


@jax.jit
def _scaled_params(key):
    # One program: drawn eagerly, every tensor shape and the scaling compiled on its own.
    params = get_family("llama").init_params(tiny_llama().config, key)
    return jax.tree.map(
        lambda x: x * 3 if x.ndim >= 2 and jnp.issubdtype(x.dtype, jnp.floating) else x, params)
