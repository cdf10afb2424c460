"""Tiny Llama-family and DeepSeek (MLA) models generate the same greedy tokens with the
Pallas kernels (impl="pallas": interpreted on CPU, compiled on a GPU or TPU) as with the
XLA path.

Random weights, a few decode steps, prompts of different lengths so that rows
cross page boundaries at different steps. Widths are ones the kernels support
(head_dim 64; MLA latent 128 + rope 64). Prefill runs the ragged kernel except on a
GPU, which has no prefill kernel yet and runs the XLA path.
"""

import jax
import numpy as np
import pytest

from kernels_pallas.mla_decode import gpu as mla_gpu
from kernels_pallas.mla_decode import tpu as mla_tpu
from kernels_pallas.paged_attention import gpu as paged_gpu
from kernels_pallas.paged_attention import tpu as paged_tpu
from kernels_pallas.ragged_attention import tpu as ragged_tpu
from kvjax.generate.loop import CacheConfig, generate
from kvjax.models import get_family
from kvjax.models.deepseek import DeepseekConfig
from kvjax.models.layers import RopeConfig
from kvjax.models.llama import LlamaConfig

PROMPTS = [[3, 17, 5], [9, 1, 30, 12, 7, 7, 2, 40, 11, 4]]
INTERPRET = jax.default_backend() == "cpu"  # what impl="pallas" passes to the kernels
ON_GPU = jax.default_backend() == "gpu"


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts traces of the kernels impl="pallas" runs on this backend.

    The Triton kernels on a GPU, the TPU kernels elsewhere (interpreted on CPU), the
    ragged prefill kernels except on a GPU.
    """
    calls = []
    on_gpu = jax.default_backend() == "gpu"
    kernels = [(paged_gpu if on_gpu else paged_tpu, "paged_decode_attention"),
               (mla_gpu if on_gpu else mla_tpu, "mla_decode_attention")]
    if not on_gpu:
        kernels += [(ragged_tpu, "paged_prefill_attention"), (ragged_tpu, "mla_prefill_attention")]
    for module, name in kernels:
        real = getattr(module, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append((_name, kwargs.get("interpret")))
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    return calls


def _both(model, params, **kwargs):
    out = {}
    for impl in ("xla", "pallas"):
        res = generate(model, params, PROMPTS, key=jax.random.key(0), max_new_tokens=6,
                       cache=CacheConfig(page_size=8), impl=impl, **kwargs)
        out[impl] = (np.asarray(res.tokens), np.asarray(res.num_generated))
    return out


def test_llama_greedy_tokens_match_xla(kernel_calls):
    config = LlamaConfig(vocab_size=48, hidden_size=128, intermediate_size=192, num_layers=2,
                         q_heads=4, kv_heads=2, head_dim=64, rope=RopeConfig(theta=1e4, dim=64))
    family = get_family("llama")
    # One program for the init (eagerly, each tensor shape compiles its own random draw).
    params = jax.jit(family.init_params, static_argnums=0)(config, jax.random.key(1))
    out = _both(family.model(config), params)
    assert ("paged_decode_attention", INTERPRET) in kernel_calls
    assert ON_GPU or ("paged_prefill_attention", INTERPRET) in kernel_calls
    np.testing.assert_array_equal(out["pallas"][1], out["xla"][1])
    np.testing.assert_array_equal(out["pallas"][0], out["xla"][0])
    assert out["xla"][1].min() == 6


def test_deepseek_mla_greedy_tokens_match_xla(kernel_calls):
    config = DeepseekConfig(vocab_size=48, hidden_size=128, intermediate_size=192,
                            num_layers=2, num_heads=4, kv_lora_rank=128, qk_rope_head_dim=64,
                            qk_nope_head_dim=32, v_head_dim=32, first_k_dense_replace=2)
    family = get_family("deepseek")
    params = family.init_params(config, jax.random.key(2))
    out = _both(family.model(config), params)
    assert ("mla_decode_attention", INTERPRET) in kernel_calls
    assert ON_GPU or ("mla_prefill_attention", INTERPRET) in kernel_calls
    np.testing.assert_array_equal(out["pallas"][1], out["xla"][1])
    np.testing.assert_array_equal(out["pallas"][0], out["xla"][0])
    assert out["xla"][1].min() == 6
