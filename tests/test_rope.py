"""kvjax.rope: frequencies against transformers, both pair layouts against a complex-number
reference, exact re-rotation, and the errors of `RopeConfig.from_hf`."""

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import rope as kr

transformers = pytest.importorskip("transformers")


def _hf_init(rope_parameters: dict, dim: int, max_pos: int = 256):
    """transformers' (inv_freq, attention_factor) for a Llama config with this rope setting."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = transformers.LlamaConfig(hidden_size=dim * 2, num_attention_heads=2, head_dim=dim,
                                   max_position_embeddings=max_pos,
                                   rope_parameters=dict(rope_parameters))
    rope_type = rope_parameters["rope_type"]
    init = (LlamaRotaryEmbedding.compute_default_rope_parameters if rope_type == "default"
            else ROPE_INIT_FUNCTIONS[rope_type])
    inv, factor = init(cfg)
    return inv.numpy(), factor


def _settings(rng):
    """A fresh random setting of every rope type."""
    theta = float(rng.choice([1e4, 5e5, 1e6]))
    factor = float(rng.choice([2.0, 4.0, 8.0]))
    orig = int(rng.choice([16, 32, 64]))
    return {
        "default": dict(rope_type="default", rope_theta=theta),
        "linear": dict(rope_type="linear", rope_theta=theta, factor=factor),
        "llama3": dict(rope_type="llama3", rope_theta=theta, factor=factor, low_freq_factor=1.0,
                       high_freq_factor=4.0, original_max_position_embeddings=orig),
        "yarn": dict(rope_type="yarn", rope_theta=theta, factor=factor,
                     original_max_position_embeddings=orig),
        "yarn_mscale": dict(rope_type="yarn", rope_theta=theta, factor=factor,
                            original_max_position_embeddings=orig, mscale=0.707,
                            mscale_all_dim=1.0, beta_fast=24, beta_slow=2),
    }


@pytest.mark.parametrize("kind", ["default", "linear", "llama3", "yarn", "yarn_mscale"])
def test_frequencies_and_attention_factor_match_transformers(kind, rng):
    dim = int(rng.choice([16, 32, 64]))
    params = _settings(rng)[kind]
    want_inv, want_factor = _hf_init(params, dim)
    rope = kr.RopeConfig.from_hf({"rope_parameters": params, "max_position_embeddings": 256},
                                 dim)
    assert rope.rope_type == params["rope_type"]
    np.testing.assert_allclose(kr.rope_inv_freq(rope), want_inv, rtol=1e-6)
    assert kr.attention_factor(rope) == pytest.approx(want_factor, rel=1e-12)
    if kind != "default":  # the scaling really changes something
        plain = kr.rope_inv_freq(kr.RopeConfig(theta=rope.theta, dim=dim))
        assert np.abs(kr.rope_inv_freq(rope) / plain - 1).max() > 0.1


def _reference(x, pos, inv_freq, interleaved, turns=None):
    """NumPy float64: each pair as a complex number times e^(i * pos * inv_freq).

    With `turns` (float32 inv_freq / 2 pi, what exact angles reduce), the angle is
    2 pi * frac(pos * turns) in float64.
    """
    half = len(inv_freq)
    x = x.astype(np.float64)
    if interleaved:
        z = x[..., 0:2 * half:2] + 1j * x[..., 1:2 * half:2]
    else:
        z = x[..., :half] + 1j * x[..., half:2 * half]
    p = pos[..., None].astype(np.float64)
    if turns is None:
        angle = p * inv_freq.astype(np.float64)
    else:
        angle = 2 * np.pi * np.mod(p * turns.astype(np.float64), 1.0)
    z = z * np.exp(1j * angle)
    out = x.copy()
    if interleaved:
        out[..., 0:2 * half:2], out[..., 1:2 * half:2] = z.real, z.imag
    else:
        out[..., :half], out[..., half:2 * half] = z.real, z.imag
    return out


@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_rope_rotates_pairs_of_either_layout(interleaved, rng):
    batch, q_len, heads, dim = 2, 5, 3, 16
    rope = kr.RopeConfig(theta=1e4, dim=dim, interleaved=interleaved)
    x = rng.standard_normal((batch, q_len, heads, dim)).astype(np.float32)
    pos = rng.integers(0, 300, (batch, q_len)).astype(np.int32)
    cos, sin = kr.rope_cos_sin(jnp.asarray(pos), rope)
    got = np.asarray(kr.apply_rope(jnp.asarray(x), cos, sin, interleaved=interleaved))
    want = _reference(x, np.broadcast_to(pos[..., None], x.shape[:-1]), kr.rope_inv_freq(rope),
                      interleaved)
    # float32 angles up to 300 rad round by ~2e-5: the bound for every output.
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    # The other layout is a different rotation.
    other = np.asarray(kr.apply_rope(jnp.asarray(x), cos, sin, interleaved=not interleaved))
    assert np.abs(other - want).max() > 0.1


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotate_exact_angles_and_partial_rotation(interleaved, rng):
    """`rotate` (the policies' form) reduces its angles exactly even at large positions
    (a plain float32 product would be off by up to 0.06 rad at 1e6), leaves the
    channels past the rotary width untouched, and re-rotation composes."""
    head_dim, rot = 24, 16
    inv_freq = kr.rope_inv_freq(kr.RopeConfig(theta=1e4, dim=rot))
    x = rng.standard_normal((3, 7, head_dim)).astype(np.float32)
    pos = rng.integers(100_000, 1_000_000, (3, 7)).astype(np.int32)
    got = np.asarray(kr.rotate(jnp.asarray(x), jnp.asarray(pos), jnp.asarray(inv_freq),
                               interleaved=interleaved))
    # The turns per position as rotate computes them (XLA divides by a reciprocal multiply).
    turns = np.asarray(jnp.asarray(inv_freq) / jnp.float32(2 * np.pi))
    want = _reference(x, pos, inv_freq, interleaved, turns=turns)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    np.testing.assert_array_equal(got[..., rot:], x[..., rot:])
    delta = rng.integers(-50_000, 50_000, pos.shape).astype(np.int32)
    moved = kr.rerotate(jnp.asarray(got), jnp.asarray(delta), jnp.asarray(inv_freq),
                        interleaved=interleaved)
    direct = kr.rotate(jnp.asarray(x), jnp.asarray(pos + delta), jnp.asarray(inv_freq),
                       interleaved=interleaved)
    np.testing.assert_allclose(np.asarray(moved), np.asarray(direct), rtol=0, atol=1e-5)


def test_from_hf_errors_name_the_field():
    with pytest.raises(ValueError, match=r"'linear' needs 'factor'"):
        kr.RopeConfig.from_hf({"rope_scaling": {"type": "linear"}}, 16)
    with pytest.raises(ValueError, match=r"'llama3' needs 'low_freq_factor'"):
        kr.RopeConfig.from_hf({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, 16)
    with pytest.raises(ValueError, match=r"rope 'factor' must be a number, got '8'"):
        kr.RopeConfig.from_hf({"rope_scaling": {"rope_type": "linear", "factor": "8"}}, 16)
    with pytest.raises(ValueError, match=r"rope_scaling must be an object"):
        kr.RopeConfig.from_hf({"rope_scaling": "yarn"}, 16)
    with pytest.raises(ValueError, match=r"rope type 'dynamic' is not supported"):
        kr.RopeConfig.from_hf({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, 16)
    with pytest.raises(ValueError, match=r"'yarn' needs 'original_max_position_embeddings'"):
        kr.RopeConfig.from_hf({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, 16)
    # YaRN without a factor: transformers' ratio of the extended to the original context.
    r = kr.RopeConfig.from_hf({"max_position_embeddings": 4096, "rope_parameters": {
        "rope_type": "yarn", "original_max_position_embeddings": 1024}}, 16)
    assert r.factor == 4.0
    with pytest.raises(ValueError, match="dim must be a positive even int"):
        kr.RopeConfig(theta=1e4, dim=15)
