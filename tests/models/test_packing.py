"""Packed prefill (`kvjax.generate.prefill_packed`, `kvjax.models.base.Packing`): several
sequences' next tokens end to end in one row give each sequence's logits and cache as
prefilling it alone in its own row (Llama, stacked and per-layer weights; Gemma, with its
local layers on full pages and on window-only rings; a call's lanes cut anywhere in a
prompt), and the errors at the boundary: a family that does not pack (DeepSeek MLA here),
a packing of the wrong size, lengths that do not fit."""

import jax
import numpy as np
import pytest

import kvjax.generate as gen
from kvjax.generate.loop import prefill, prefill_packed
from kvjax.models import gemma, get_family, tiny
from kvjax.models.base import Packing
from kvjax.rope import RopeConfig

PAGE = 8
GEMMA_WINDOW = 12  # the local layers' window: shorter than most prompts here


def _model(name):
    if name == "gemma":
        # Gemma 3's layout (local, local, global; QK-norm; two RoPEs) with Gemma 2's soft
        # caps: every part of the layer that sees the packed row or its lanes.
        config = gemma.GemmaConfig(
            vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=3, q_heads=4,
            kv_heads=2, head_dim=16, layer_types=(gemma.LOCAL, gemma.LOCAL, gemma.GLOBAL),
            sliding_window=GEMMA_WINDOW, rope_local=RopeConfig(theta=10000.0, dim=16),
            rope_global=RopeConfig(theta=1e6, dim=16), query_pre_attn_scalar=24.0,
            attn_softcap=20.0, final_softcap=30.0, qk_norm=True)
        fam = get_family("gemma")
        return fam.model(config), fam.init_params(config, jax.random.key(1), std=0.2)
    config = tiny.tiny_config(name)
    return tiny.tiny_model(config), tiny.init_tiny(config, jax.random.key(1))


@pytest.mark.parametrize("name,unstack,rings", [("gqa", False, False), ("gqa", True, False),
                                                ("gemma", False, False), ("gemma", True, True)])
def test_packed_calls_equal_each_prompt_alone(rng, name, unstack, rings):
    model, params = _model(name)
    if unstack:
        params = model.unstack_layers(params)
    assert model.packs
    lens = [int(n) for n in rng.integers(3, 70, 4)]
    prompts = [rng.integers(0, model.vocab_size, n).astype(np.int32) for n in lens]
    # Window-only rings are built for the most tokens one call adds to a sequence (a lane
    # here takes at most 32).
    cfg = gen.CacheConfig(page_size=PAGE, window_pages=rings)
    build = dict(num_seqs=4, max_tokens=128, chunk=32)
    # Reference: every prompt whole in its own row (on full pages: the rings hold one
    # lane's chunk, not a whole prompt).
    ref_cache = gen.CacheConfig(page_size=PAGE, window_pages=False).build(model, **build)
    width = -(-max(lens) // 32) * 32
    rows = np.zeros((4, width), np.int32)
    for i, p in enumerate(prompts):
        rows[i, :len(p)] = p
    ref_cache, ref, *_ = prefill(model, params, ref_cache, rows, np.array(lens, np.int32),
                                 np.arange(4, dtype=np.int32), chunk_size=width)
    # Packed: calls of a 64-token row, up to 32 tokens a prompt, cut wherever the row ends.
    cache = cfg.build(model, **build)
    assert bool(cache.spec.window_groups) == rings
    done, got = [0] * 4, np.zeros(np.shape(ref), np.float32)
    while done != lens:
        take, left = [], 64
        for n, d in zip(lens, done, strict=True):
            take.append(min(32, n - d, left))
            left -= take[-1]
        row = np.zeros((1, 64), np.int32)
        row[0, :sum(take)] = np.concatenate(
            [p[d:d + k] for p, d, k in zip(prompts, done, take, strict=True)])
        cache, last, status = prefill_packed(
            model, params, cache, row, Packing.of(take, 64, 32), np.array(take, np.int32),
            np.arange(4, dtype=np.int32), np.array(done, np.int32))
        assert bool(status.ok)
        for i, k in enumerate(take):
            if k and done[i] + k == lens[i]:
                got[i] = np.asarray(last[i])
        done = [d + k for d, k in zip(done, take, strict=True)]
    np.testing.assert_allclose(got, np.asarray(ref), rtol=0, atol=1e-5)
    assert np.asarray(cache.lengths)[:4].tolist() == lens
    # The cache holds the same keys: one more token decodes alike from both.
    nxt = rng.integers(0, model.vocab_size, (4, 1)).astype(np.int32)
    outs = []
    for c in (ref_cache, cache):
        c, logits, *_ = prefill(model, params, c, nxt, np.ones(4, np.int32),
                                np.arange(4, dtype=np.int32), chunk_size=1)
        outs.append(np.asarray(logits))
    np.testing.assert_allclose(outs[1], outs[0], rtol=0, atol=1e-5)


def test_packing_errors(rng):
    with pytest.raises(ValueError, match="do not fit a row of 8"):
        Packing.of([5, 4], 8, 8)
    with pytest.raises(ValueError, match=r"in \[0, width=4\]"):
        Packing.of([5], 8, 4)
    packing = Packing.of([3, 2], 8, 4)
    assert packing.gather.tolist() == [[0, 1, 2, 2], [3, 4, 4, 4]]
    assert packing.scatter.tolist()[:5] == [0, 1, 2, 4, 5]
    x = rng.standard_normal((1, 8, 3)).astype(np.float32)
    np.testing.assert_array_equal(packing.packed(packing.lanes(x))[0, :5], x[0, :5])

    model, params = _model("gqa")
    cache = gen.CacheConfig(page_size=PAGE).build(model, num_seqs=2, max_tokens=16)
    tokens = np.zeros((1, 6), np.int32)  # a row of 6 tokens, a packing of 8
    with pytest.raises(ValueError, match=r"one row \[1, 8\]"):
        model.apply(params, tokens, tokens, cache, q_lengths=np.array([3, 2], np.int32),
                    seq_ids=np.arange(2, dtype=np.int32), packing=packing)
    mla, mla_params = _model("mla")
    assert not mla.packs
    with pytest.raises(ValueError, match="takes no packing"):
        mla.apply(mla_params, np.zeros((1, 8), np.int32), np.zeros((1, 8), np.int32), None,
                  q_lengths=np.array([3, 2], np.int32), packing=packing)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_lanes_and_packed_copy_rows(rng, dtype, monkeypatch):
    """`Packing.lanes` / `packed` equal NumPy's indexing; on one CPU device 16-bit rows are
    copied by the take_rows custom call, no XLA gather (which runs them in float32). One
    device: the tests see 8, over which the custom call would not partition."""
    import jax.numpy as jnp

    from kvjax.backends import cpu

    monkeypatch.setattr(jax, "device_count", lambda backend=None: 1)
    packing = Packing.of([5, 1, 7], 16, 8)
    x = jnp.asarray(rng.standard_normal((1, 16, 3, 4)), dtype)
    lanes = jax.jit(packing.lanes)
    got = lanes(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(x)[0][packing.gather])
    y = jnp.asarray(rng.standard_normal((3, 8, 3, 4)), dtype)
    packed = jax.jit(packing.packed)
    np.testing.assert_array_equal(np.asarray(packed(y))[0],
                                  np.asarray(y).reshape(24, 3, 4)[packing.scatter])
    if dtype == "bfloat16" and jax.default_backend() == "cpu":
        assert cpu.choose("take_rows", dtype=dtype).use_kernel
        for f, a in ((lanes, x), (packed, y)):
            hlo = f.lower(a).compile().as_text()
            assert 'custom_call_target="kvjax_take_rows' in hlo and " gather(" not in hlo, hlo
