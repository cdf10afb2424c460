"""The compiled decode loop of `generate` on a KIVI int2 cache never dequantizes a
layer's pool, nor a sequence's keys: attention (and H2O's scoring) read blocks of
pages. Checked on the optimised HLO of the whole loop (every layer, the cache write,
the policy), as `generate` compiles it."""

import jax
import numpy as np
import pytest

from kvjax import generate as gen
from kvjax.attention import registry
from kvjax.cache.policies import H2O
from kvjax.generate import loop, sampling
from kvjax.models import llama
from kvjax.models.base import get_family
from kvjax.rope import RopeConfig
from kvjax.specs import QuantSpec
from tests.attention.hlo_written import written

PAGE, RESIDUAL = 8, 8
# A sequence spans 4096 tokens: 4x the XLA path's blocks of 512 tokens of every row.
SEQ_PAGES = 512
BATCH = 2
KV_HEADS, HEAD_DIM = 2, 32
FLOATS = {"f32", "f16", "bf16", "f64"}


def _model(rng):
    config = llama.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64,
                               num_layers=2, q_heads=4, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                               rope=RopeConfig(theta=10000.0, dim=HEAD_DIM))
    params = jax.jit(llama.init_params, static_argnums=0)(  # one program, not one per shape
        config, jax.random.key(int(rng.integers(1 << 30))))
    return get_family("llama").model(config), params


def _decode_state(rng, model, params, policy, impl):
    """The shapes of a state ready to decode, from `generate`'s own request checks and
    prefill (traced, not run: lowering the loop needs only the state's shapes)."""
    prompts = [rng.integers(0, 64, int(n)).tolist() for n in rng.integers(20, 40, BATCH)]
    # A pool 4x the live sequences' pages: a layer's pool outweighs one sequence.
    config = gen.CacheConfig(dtype="float32", page_size=PAGE,
                             num_pages=4 * BATCH * SEQ_PAGES,
                             quant=QuantSpec(bits=2, group_size=PAGE, residual=RESIDUAL))
    req = loop._request(model, params, prompts, max_new_tokens=SEQ_PAGES * PAGE - 64,
                        cache=config, seq_ids=None, chunk_size=32, impl=impl, policy=policy)
    keys = sampling.as_keys(jax.random.key(0), BATCH)
    state = jax.eval_shape(lambda: loop._start(model, req, keys=keys, sampling=loop.GREEDY,
                                               eos_ids=(), free_finished=True, policy=policy,
                                               check=False))
    return state, req


def _largest_float(model, params, state, policy, impl):
    """The largest float array the compiled loop writes (the state donated, as in
    `generate`)."""
    lowered = loop.decode_loop.lower(model, loop.decode_params(model, params, BATCH), state,
                                     sampling=loop.GREEDY, impl=impl, policy=policy)
    return max((n, op) for op, dtype, n in written(lowered.compile().as_text())
               if dtype in FLOATS)


@pytest.mark.rotate(1)  # without and with a policy in turn (8-23 s each)
@pytest.mark.parametrize("policy", [None, H2O(budget=1024)], ids=["no_policy", "h2o"])
def test_decode_loop_holds_no_dequantized_pool_or_sequence(rng, policy):
    model, params = _model(rng)
    spec = gen.CacheConfig(page_size=PAGE).spec(model, num_seqs=BATCH,
                                                max_tokens=SEQ_PAGES * PAGE)
    layer_pool = 4 * BATCH * SEQ_PAGES * PAGE * KV_HEADS * HEAD_DIM
    sequence_keys = spec.max_pages_per_seq * PAGE * KV_HEADS * HEAD_DIM
    assert sequence_keys < layer_pool
    if policy is None:  # the check can fail: the reference dequantizes whole sequences
        state, req = _decode_state(rng, model, params, policy, "reference")
        n, op = _largest_float(model, params, state, policy, req.impl)
        assert n >= sequence_keys, (n, op)
    # What "auto" runs here (the C++ kernel or the XLA path), and the XLA path.
    assert "quantized_attention" in registry.CPU_KERNEL_OPS
    impls = {"xla", registry.auto_impl("quantized_attention", np.float32)}
    for impl in sorted(impls):
        state, req = _decode_state(rng, model, params, policy, impl)
        n, op = _largest_float(model, params, state, policy, req.impl)
        assert n < sequence_keys, (impl, n, op, sequence_keys)
