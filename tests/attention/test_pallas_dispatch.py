"""`kvjax.attention` dispatch to the Pallas kernels, and a decode loop through them.

The kernels themselves are tested in tests/kernels; here: "auto" picks the
kernel on TPU/GPU and the XLA path on CPU, "pallas" runs the backend's kernel
(interpreted on CPU), and a multi-layer attention stack decoded greedily with
impl="pallas", interpret=True emits the same tokens as with impl="xla".
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.mla_decode import reference as mla_ref
from kernels_pallas.paged_attention import gpu as paged_gpu
from kernels_pallas.paged_attention import reference as paged_ref
from kvjax import cache as kvc
from kvjax.attention import ops, pallas_impls
from kvjax.attention import paged_decode_attention as decode_op
from kvjax.specs import AttentionSpec, CacheSpec


def _gqa_inputs(rng, batch=3, q_heads=4, kv_heads=2, head_dim=64, page_size=8, max_pages=3):
    num_pages = batch * max_pages + 2
    tables = rng.permutation(num_pages)[: batch * max_pages].reshape(batch, max_pages)
    lengths = rng.integers(1, max_pages * page_size + 1, size=batch)

    def draw(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    return (draw(batch, q_heads, head_dim), draw(kv_heads, num_pages, page_size, head_dim),
            draw(kv_heads, num_pages, page_size, head_dim), jnp.asarray(lengths, jnp.int32),
            jnp.asarray(tables, jnp.int32))


@pytest.mark.parametrize("platform,want", [("cpu", "xla"), ("tpu", "pallas"), ("gpu", "pallas")])
def test_auto_picks_kernel_on_accelerators_and_xla_on_cpu(monkeypatch, platform, want):
    monkeypatch.setattr(pallas_impls, "platform", lambda: platform)
    assert ops._auto_impl("paged_decode_attention") == want
    assert ops._auto_impl("mla_decode_attention") == want
    # No prefill kernel yet: prefill stays on the XLA path everywhere.
    assert ops._auto_impl("paged_prefill_attention") == "xla"


def test_pallas_on_cpu_interprets_by_default(rng):
    args = _gqa_inputs(rng)
    got = decode_op(*args, impl="pallas")
    want = paged_ref.paged_decode_attention(*args)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


def test_pallas_on_cpu_without_interpret_raises(rng):
    with pytest.raises(ValueError, match="needs a TPU or GPU backend"):
        decode_op(*_gqa_inputs(rng), impl="pallas", interpret=False)


def test_pallas_on_gpu_platform_runs_the_gpu_kernel(rng, monkeypatch):
    calls = []
    real = paged_gpu.paged_decode_attention

    def spy(*args, **kwargs):
        calls.append(kwargs["interpret"])
        return real(*args, **kwargs)

    monkeypatch.setattr(pallas_impls, "platform", lambda: "gpu")
    monkeypatch.setattr(paged_gpu, "paged_decode_attention", spy)
    args = _gqa_inputs(rng)
    out, lse = decode_op(*args, impl="pallas", interpret=True)
    assert calls == [True]
    want_out, want_lse = paged_ref.paged_decode_attention(*args)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-5, atol=1e-5)


def test_mla_and_prefill_through_pallas(rng):
    batch, heads, d_c, d_rope, page_size, max_pages = 2, 4, 128, 64, 8, 2
    num_pages = batch * max_pages
    tables = jnp.asarray(rng.permutation(num_pages).reshape(batch, max_pages), jnp.int32)
    lengths = jnp.asarray([5, 16], jnp.int32)

    def draw(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    mla_args = (draw(batch, heads, d_c), draw(batch, heads, d_rope),
                draw(num_pages, page_size, d_c), draw(num_pages, page_size, d_rope),
                lengths, tables)
    got = ops.mla_decode_attention(*mla_args, scale=0.1, impl="pallas")
    want = mla_ref.mla_decode_attention(*mla_args, scale=0.1)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)

    q = draw(batch, 3, 4, 64)
    k, v = draw(2, num_pages, page_size, 64), draw(2, num_pages, page_size, 64)
    q_lengths = jnp.asarray([2, 3], jnp.int32)
    got = ops.paged_prefill_attention(q, k, v, lengths, tables, q_lengths, impl="pallas")
    want = ops.paged_prefill_attention(q, k, v, lengths, tables, q_lengths, impl="xla")
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


# --- a tiny multi-layer attention stack decoded greedily ------------------------------------

VOCAB, D_MODEL, LAYERS = 48, 64, 3
ATTN = AttentionSpec(q_heads=4, kv_heads=2, head_dim=64)


def _params(rng):
    def w(*shape):
        return jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[-2]), jnp.float32)

    layers = [
        dict(wq=w(D_MODEL, ATTN.q_heads * ATTN.head_dim),
             wk=w(D_MODEL, ATTN.kv_heads * ATTN.head_dim),
             wv=w(D_MODEL, ATTN.kv_heads * ATTN.head_dim),
             wo=w(ATTN.q_heads * ATTN.head_dim, D_MODEL),
             w1=w(D_MODEL, 2 * D_MODEL), w2=w(2 * D_MODEL, D_MODEL))
        for _ in range(LAYERS)
    ]
    embed = jnp.asarray(rng.standard_normal((VOCAB, D_MODEL)), jnp.float32)
    return dict(embed=embed, layers=layers, unembed=w(D_MODEL, VOCAB))


def _norm(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


@functools.partial(jax.jit, static_argnames=("impl", "interpret"), donate_argnames="cache")
def _decode_step(params, cache, tokens, active, *, impl, interpret):
    """One token per active sequence through every layer; returns (cache, logits [B, V])."""
    batch = tokens.shape[0]
    slots = kvc.token_slots(cache, (cache.lengths - 1)[:, None], active[:, None])
    x = params["embed"][tokens]
    for i, p in enumerate(params["layers"]):
        h = _norm(x)
        q = (h @ p["wq"]).reshape(batch, ATTN.q_heads, ATTN.head_dim)
        k = (h @ p["wk"]).reshape(batch, 1, ATTN.kv_heads, ATTN.head_dim)
        v = (h @ p["wv"]).reshape(batch, 1, ATTN.kv_heads, ATTN.head_dim)
        cache = kvc.write_layer(cache, i, slots, k, v)
        view = kvc.layer_view(cache, i)
        out, _ = decode_op(q, view.k, view.v, view.lengths, view.block_tables, impl=impl,
                           interpret=interpret)
        x = x + out.reshape(batch, -1) @ p["wo"]
        x = x + jax.nn.gelu(_norm(x) @ p["w1"]) @ p["w2"]
    return cache, _norm(x) @ params["unembed"]


def _greedy(params, prompts, steps, impl, interpret):
    spec = CacheSpec(attention=ATTN, num_layers=LAYERS, page_size=8, num_pages=16,
                     max_seqs=len(prompts), max_pages_per_seq=4)
    cache = kvc.init_cache(spec)
    longest = max(len(p) for p in prompts)
    emitted = [[] for _ in prompts]
    all_logits = []
    for t in range(longest + steps):
        # Prompts are right-aligned so the sequences reach different lengths.
        active = np.array([t >= longest - len(p) for p in prompts])
        tokens = []
        for s, p in enumerate(prompts):
            j = t - (longest - len(p))
            tokens.append(p[j] if 0 <= j < len(p) else (emitted[s][-1] if emitted[s] else 0))
        cache, status = kvc.reserve(cache, jnp.asarray(active, jnp.int32))
        status.raise_if_error()
        cache, logits = _decode_step(params, cache, jnp.asarray(tokens, jnp.int32),
                                     jnp.asarray(active), impl=impl, interpret=interpret)
        if t >= longest - 1:
            all_logits.append(np.asarray(logits))
            for s, tok in enumerate(np.argmax(np.asarray(logits), axis=-1)):
                emitted[s].append(int(tok))
    return emitted, np.stack(all_logits)


def test_stack_decodes_same_greedy_tokens_with_pallas_as_with_xla(rng):
    params = _params(rng)
    prompts = [list(rng.integers(0, VOCAB, size=3)), list(rng.integers(0, VOCAB, size=9))]
    tokens_xla, logits_xla = _greedy(params, prompts, steps=8, impl="xla", interpret=None)
    tokens_pallas, logits_pallas = _greedy(params, prompts, steps=8, impl="pallas",
                                           interpret=True)
    assert tokens_pallas == tokens_xla
    np.testing.assert_allclose(logits_pallas, logits_xla, rtol=1e-4, atol=1e-4)
