"""MHA -> GQA conversion by mean-pooling K/V heads (kvjax.models.convert_mha_to_gqa)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.models import convert_mha_to_gqa
from kvjax.models.layers import RopeConfig
from kvjax.models.llama import LlamaConfig, forward_dense, init_params

MHA = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, q_heads=4,
                  kv_heads=4, head_dim=8, rope=RopeConfig(theta=1e4, dim=8), qkv_bias=True)


def _params(rng):
    return init_params(MHA, jax.random.key(int(rng.integers(1 << 30))))


def test_groups_equal_heads_is_the_identity(rng):
    params = _params(rng)
    out, config = convert_mha_to_gqa(params, MHA, 4)
    assert config == MHA
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_pooled_heads_are_group_means(rng):
    params = _params(rng)
    out, config = convert_mha_to_gqa(params, MHA, 2)
    assert config.kv_heads == 2 and out.layers.wk.shape == (2, 32, 16)
    wk = np.asarray(params.layers.wk).reshape(2, 32, 4, 8)
    np.testing.assert_allclose(np.asarray(out.layers.wk).reshape(2, 32, 2, 8),
                               (wk[:, :, 0::2] + wk[:, :, 1::2]) / 2, rtol=1e-6, atol=1e-7)
    bv = np.asarray(params.layers.bv).reshape(2, 4, 8)
    np.testing.assert_allclose(np.asarray(out.layers.bv).reshape(2, 2, 8),
                               bv.reshape(2, 2, 2, 8).mean(2), rtol=1e-6, atol=1e-7)


def test_conversion_is_exact_when_grouped_heads_already_agree(rng):
    """If each group's K/V heads are equal, the GQA model computes the MHA model's logits."""
    params = _params(rng)
    lp = params.layers

    def dup(w):  # copy head 2g into head 2g+1
        x = np.array(w).reshape(*w.shape[:-1], 2, 2, 8)
        x[..., 1, :] = x[..., 0, :]
        return jnp.asarray(x.reshape(w.shape))

    params = dataclasses.replace(params, layers=dataclasses.replace(
        lp, wk=dup(lp.wk), wv=dup(lp.wv), bk=dup(lp.bk), bv=dup(lp.bv)))
    gqa, config = convert_mha_to_gqa(params, MHA, 2)
    tokens = jnp.asarray(rng.integers(0, 64, (2, 12)), jnp.int32)
    np.testing.assert_allclose(np.asarray(forward_dense(gqa, config, tokens)),
                               np.asarray(forward_dense(params, MHA, tokens)),
                               rtol=1e-5, atol=1e-5)


def test_rejects_a_non_divisor(rng):
    with pytest.raises(ValueError, match="divisor"):
        convert_mha_to_gqa(_params(rng), MHA, 3)
