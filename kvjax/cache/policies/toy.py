"""A tiny random attention stack that drives cache policies through the real paged cache.

Not a language model: random weights, RMS norms without gains, no MLP. It
exists so that the policies can be tested and benchmarked end to end (prefill,
decode steps, eviction, page selection, the allocator) before and apart from
`kvjax.models`. Each layer: x += W_o attn(RoPE(W_q n(x)), RoPE(W_k n(x)), W_v n(x)).
The step functions call the policy hooks exactly as `kvjax.cache.policies.base`
describes, with no per-policy branches.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from kvjax.attention import paged_prefill_attention
from kvjax.cache import paged
from kvjax.cache.page_table import AllocStatus
from kvjax.cache.paged import PagedKVCache
from kvjax.cache.policies.base import CachePolicy, selected_decode_attention
from kvjax.cache.policies.rope import apply_rope, rope_inv_freq
from kvjax.specs import CacheSpec

__all__ = ["ToyParams", "init_toy", "toy_prefill", "toy_decode_step", "toy_generate"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ToyParams:
    embed: Float[Array, "vocab d_model"]
    wq: Float[Array, "layers d_model qd"]
    wk: Float[Array, "layers d_model kvd"]
    wv: Float[Array, "layers d_model kvd"]
    wo: Float[Array, "layers qd d_model"]
    unembed: Float[Array, "d_model vocab"]


def init_toy(spec: CacheSpec, *, vocab: int = 64, d_model: int = 32, seed: int = 0) -> ToyParams:
    """Random float32 weights for `spec`'s geometry (MHA/GQA/MQA caches only)."""
    a = spec.attention
    if spec.is_mla:
        raise ValueError("init_toy: the toy stack has no MLA variant; use an AttentionSpec.")
    r = np.random.default_rng(seed)
    n = spec.num_layers

    def w(*shape):
        return jnp.asarray(r.standard_normal(shape) / np.sqrt(shape[-2]), jnp.float32)

    return ToyParams(
        embed=jnp.asarray(r.standard_normal((vocab, d_model)), jnp.float32),
        wq=w(n, d_model, a.q_heads * a.head_dim),
        wk=w(n, d_model, a.kv_heads * a.head_dim),
        wv=w(n, d_model, a.kv_heads * a.head_dim),
        wo=w(n, a.q_heads * a.head_dim, d_model),
        unembed=w(d_model, vocab),
    )


def _norm(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def _qkv(params, layer, x, positions, spec):
    a = spec.attention
    h = _norm(x)
    lead = x.shape[:-1]
    q = (h @ params.wq[layer]).reshape(*lead, a.q_heads, a.head_dim)
    k = (h @ params.wk[layer]).reshape(*lead, a.kv_heads, a.head_dim)
    v = (h @ params.wv[layer]).reshape(*lead, a.kv_heads, a.head_dim)
    inv_freq = rope_inv_freq(a.head_dim)
    q = apply_rope(q, positions[..., None], inv_freq)
    k = apply_rope(k, positions[..., None], inv_freq)
    return q, k.astype(spec.dtype), v.astype(spec.dtype)


@functools.partial(jax.jit, static_argnames="policy", donate_argnames="cache")
def toy_prefill(
    params: ToyParams,
    cache: PagedKVCache,
    state,
    policy: CachePolicy,
    tokens: Int[Array, "max_seqs q_len"],
    q_lengths: Int[Array, " max_seqs"],
) -> tuple[Float[Array, "max_seqs vocab"], PagedKVCache, object, AllocStatus, AllocStatus]:
    """Caches a prompt chunk for every slot; returns the logits of each row's last real token.

    Args:
      params: toy weights.
      cache: the cache (donated).
      state: the policy state.
      policy: the cache policy (static).
      tokens: int32[max_seqs, q_len], row s continues slot s; padding past q_lengths.
      q_lengths: int32[max_seqs], real tokens per row (0 leaves a slot alone).

    Returns:
      (logits, cache, state, reserve_status, policy_status).
    """
    spec = cache.spec
    q_len = tokens.shape[1]
    t = jnp.arange(q_len, dtype=jnp.int32)[None, :]
    valid = t < q_lengths[:, None]
    text_pos = cache.lengths[:, None] + t
    rope_pos = policy.rope_positions(cache, state, text_pos)
    cache, r_status = paged.reserve(cache, q_lengths.astype(jnp.int32))
    slots = paged.token_slots(cache, text_pos, valid)
    x = params.embed[tokens]
    queries = []
    for layer in range(spec.num_layers):
        q, k, v = _qkv(params, layer, x, rope_pos, spec)
        cache = paged.write_layer(cache, layer, slots, k, v)
        view = paged.layer_view(cache, layer)
        out, _ = paged_prefill_attention(q, view.k, view.v, view.lengths, view.block_tables,
                                         q_lengths.astype(jnp.int32))
        x = x + out.reshape(*x.shape[:-1], -1) @ params.wo[layer]
        queries.append(q)
    cache, state, p_status = policy.after_prefill(cache, state, jnp.stack(queries), q_lengths)
    last = jnp.take_along_axis(x, jnp.maximum(q_lengths - 1, 0)[:, None, None], axis=1)[:, 0]
    return _norm(last) @ params.unembed, cache, state, r_status, p_status


@functools.partial(jax.jit, static_argnames="policy", donate_argnames="cache")
def toy_decode_step(
    params: ToyParams,
    cache: PagedKVCache,
    state,
    policy: CachePolicy,
    tokens: Int[Array, " max_seqs"],
    text_pos: Int[Array, " max_seqs"],
    active: Int[Array, " max_seqs"],
) -> tuple[Float[Array, "max_seqs vocab"], PagedKVCache, object, AllocStatus, AllocStatus]:
    """One decode step for every active slot.

    Args:
      tokens: int32[max_seqs], the token each slot consumes.
      text_pos: int32[max_seqs], its position in the text (cache lengths shrink
        under eviction, so the loop tracks text positions itself).
      active: int32[max_seqs], 1 for slots that decode, 0 for idle ones.

    Returns:
      (logits [max_seqs, vocab], cache, state, reserve_status, policy_status).
    """
    spec = cache.spec
    rope_pos = policy.rope_positions(cache, state, text_pos[:, None])[:, 0]
    cache_pos = cache.lengths
    cache, r_status = paged.reserve(cache, active.astype(jnp.int32))
    slots = paged.token_slots(cache, cache_pos[:, None], active[:, None] > 0)
    x = params.embed[tokens]
    queries = []
    for layer in range(spec.num_layers):
        q, k, v = _qkv(params, layer, x, rope_pos, spec)
        cache = paged.write_layer(cache, layer, slots, k[:, None], v[:, None])
        view = paged.layer_view(cache, layer)
        sel = policy.before_attention(cache, state, layer, q)
        out, _ = selected_decode_attention(q, view.k, view.v, sel)
        x = x + out.reshape(x.shape[0], -1) @ params.wo[layer]
        queries.append(q)
    cache, state, p_status = policy.after_step(cache, state, jnp.stack(queries), active > 0)
    return _norm(x) @ params.unembed, cache, state, r_status, p_status


def toy_generate(
    params: ToyParams,
    cache: PagedKVCache,
    policy: CachePolicy,
    prompts: np.ndarray,
    steps: int,
    *,
    on_step=None,
) -> tuple[np.ndarray, np.ndarray, PagedKVCache]:
    """Greedy decoding of equal-length prompts in slots 0..len(prompts)-1 (host loop).

    Args:
      prompts: int[batch, prompt_len], batch <= max_seqs.
      steps: tokens to generate.
      on_step: optional callback `f(step, cache, state)` after prefill (step 0)
        and after every decode step.

    Returns:
      (tokens int[batch, steps], logits float32[batch, steps, vocab], cache).
    """
    spec = cache.spec
    batch, plen = prompts.shape
    rows = np.zeros((spec.max_seqs, plen), np.int32)
    rows[:batch] = prompts
    q_lengths = np.zeros(spec.max_seqs, np.int32)
    q_lengths[:batch] = plen
    state = policy.init_state(cache)
    logits, cache, state, rs, ps = toy_prefill(params, cache, state, policy, jnp.asarray(rows),
                                               jnp.asarray(q_lengths))
    rs.raise_if_error()
    ps.raise_if_error()
    if on_step is not None:
        on_step(0, cache, state)
    active = jnp.asarray(q_lengths > 0, jnp.int32)
    out_tokens, out_logits = [], []
    for i in range(steps):
        nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        out_tokens.append(np.asarray(nxt[:batch]))
        out_logits.append(np.asarray(logits[:batch]))
        text_pos = jnp.full((spec.max_seqs,), plen + i, jnp.int32)
        logits, cache, state, rs, ps = toy_decode_step(params, cache, state, policy, nxt,
                                                       text_pos, active)
        rs.raise_if_error()
        ps.raise_if_error()
        if on_step is not None:
            on_step(i + 1, cache, state)
    return np.stack(out_tokens, 1), np.stack(out_logits, 1), cache


def random_filled_cache(
    spec: CacheSpec, lengths, rng: np.random.Generator
) -> tuple[PagedKVCache, np.ndarray, np.ndarray]:
    """A cache whose slots hold `lengths[s]` tokens of random K/V, plus the dense copies.

    Page assignment is scrambled (a few pages are reserved and freed first) so
    tests do not rely on sequences owning consecutive pages.

    Returns:
      (cache, k, v): k, v float32[layers, max_seqs, heads, max_tokens, width],
      token j of sequence s at [:, s, :, j].
    """
    cache = paged.init_cache(spec)
    lengths = np.asarray(lengths, np.int32)
    scramble = np.zeros(spec.max_seqs, np.int32)
    scramble[0] = min(spec.page_size * 2, spec.max_tokens_per_seq)
    cache, s = paged.reserve(cache, jnp.asarray(scramble))
    s.raise_if_error()
    cache, s = paged.reserve(cache, jnp.asarray(np.where(np.arange(spec.max_seqs) == 0, 0,
                                                         lengths)))
    s.raise_if_error()
    cache = paged.free(cache, jnp.asarray(np.arange(spec.max_seqs) == 0))
    cache, s = paged.reserve(cache, jnp.asarray(np.where(np.arange(spec.max_seqs) == 0,
                                                         lengths, 0)))
    s.raise_if_error()
    (la, ha, pa, psz, wa), (_, _, _, _, wb) = spec.pool_shapes
    t = spec.max_tokens_per_seq
    k = rng.standard_normal((la, spec.max_seqs, ha, t, wa)).astype(np.float32)
    v = rng.standard_normal((la, spec.max_seqs, ha, t, wb)).astype(np.float32)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (spec.max_seqs, t))
    slots = paged.token_slots(cache, pos, pos < jnp.asarray(lengths)[:, None])
    for layer in range(la):
        cache = paged.write_layer(
            cache, layer, slots,
            jnp.asarray(k[layer].transpose(0, 2, 1, 3), spec.dtype),
            jnp.asarray(v[layer].transpose(0, 2, 1, 3), spec.dtype),
        )
    return cache, k, v


def dense_kv(cache: PagedKVCache) -> tuple[np.ndarray, np.ndarray]:
    """Each sequence's cached K/V gathered densely: float32[layers, max_seqs, heads, tokens, w]."""
    bt = np.asarray(cache.block_tables)
    lengths = np.asarray(cache.lengths)
    ps = cache.spec.page_size
    out = []
    for pool in (np.asarray(p, np.float32) for p in paged._pools(cache.pages)):
        la, h, _, _, w = pool.shape
        d = np.zeros((la, bt.shape[0], h, cache.spec.max_tokens_per_seq, w), np.float32)
        for s in range(bt.shape[0]):
            for j in range(int(lengths[s])):
                d[:, s, :, j] = pool[:, :, bt[s, j // ps], j % ps]
        out.append(d)
    return out[0], out[1]
