"""The Mosaic GPU absorbed-MLA decode kernel, checked on a CPU-only machine.

Correctness runs in Mosaic GPU's interpreter (simulated shared memory, TMA
copies, barriers and wgmma) with its race detector on, against the jnp
reference, on small shapes (the interpreter is slow; jax 0.10's compiles every
CTA's program anew, so the cases keep few CTAs). Every cached row no query may
see (the rest of each last page, pages of no sequence) holds NaN in the
kernel's pools and fresh random values in the reference's, and block-table
entries past each length are garbage. Lowering for an H100 from CPU runs the
whole Mosaic GPU lowering (layouts, wgmma shapes, shared-memory budget) at
DeepSeek-V3's shape.
"""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_cases import ref_mla

from kernels_pallas import _mosaic_gpu as mgpu
from kernels_pallas.mla_decode import mosaic_gpu as mk

S = jax.ShapeDtypeStruct


def _case(rng, *, q_heads, d_c, d_rope, page_size, max_pages, lengths, dtype):
    """(kernel inputs with NaN in every invisible cached row, reference inputs without)."""
    lengths = np.asarray(lengths, np.int32)
    used = -(-lengths // page_size)
    num_pages = int(used.sum()) + 2
    perm = rng.permutation(num_pages)
    tables = rng.choice([-5, num_pages, 10**6], size=(len(lengths), max_pages)).astype(np.int32)
    start = 0
    for b, n in enumerate(used):
        tables[b, :n] = perm[start:start + n]
        start += n

    def draw(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    latent, rope = draw(num_pages, page_size, d_c), draw(num_pages, page_size, d_rope)
    seen = np.zeros((num_pages, page_size), bool)
    for b, n in enumerate(lengths):
        for t in range(n):
            seen[tables[b, t // page_size], t % page_size] = True
    poisoned_latent, poisoned_rope = latent.copy(), rope.copy()
    poisoned_latent[~seen] = np.nan
    poisoned_rope[~seen] = np.inf
    q_latent, q_rope = draw(len(lengths), q_heads, d_c), draw(len(lengths), q_heads, d_rope)

    def put(*xs):
        return tuple(jax.device_put(x.astype(dtype)) for x in xs)

    index = (jax.device_put(lengths), jax.device_put(tables))
    return (put(q_latent, q_rope, poisoned_latent, poisoned_rope) + index,
            put(q_latent, q_rope, latent, rope) + index)


# num_sms is set low to force split counts on tiny batches (choose_num_splits fills
# num_sms CTAs). Lengths: shorter than a page and mid-page, one whole page, 0 (an idle
# batch row), and rows whose splits hold 3 steps (the pipeline reuses a buffer), 2 and
# none (an empty split).
CASES = {
    # 4 heads padded to one 64-head block; page 16: four TMA pieces a step; 2 splits.
    "bf16_h4_page16_splits2": dict(
        shape=dict(q_heads=4, d_c=128, d_rope=64, page_size=16, max_pages=20,
                   lengths=[13, 300], dtype=jnp.bfloat16),
        num_sms=4, splits=2),
    # One TP-8 shard of DeepSeek-V3 (16 heads); page 64 is one TMA piece a step.
    "f16_h16_page64": dict(
        shape=dict(q_heads=16, d_c=256, d_rope=32, page_size=64, max_pages=3,
                   lengths=[64, 0], dtype=jnp.float16),
        num_sms=2, splits=1),
    # 128 heads: two head blocks reading the same pages; page 128 holds two steps.
    "bf16_h128_page128": dict(
        shape=dict(q_heads=128, d_c=64, d_rope=32, page_size=128, max_pages=2,
                   lengths=[150], dtype=jnp.bfloat16),
        num_sms=2, splits=1),
}


@functools.partial(jax.jit, static_argnames=("scale", "num_sms"))
def _interpreted(*args, scale, num_sms):
    return mk.mla_decode_attention(*args, scale=scale, num_sms=num_sms,
                                   interpret=mgpu.interpret_params(detect_races=True))


# The interpreter's Q K^T multiplies the poisoned rows too (their logits are masked after).
@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")
@pytest.mark.parametrize("name", sorted(CASES))
def test_interpreted_matches_reference(name):
    case = CASES[name]
    shape = case["shape"]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    args, clean = _case(rng, **shape)
    scale = float(rng.uniform(0.05, 0.2))
    max_blocks = -(-shape["max_pages"] * shape["page_size"] // mk.BLOCK_TOKENS)
    heads_blocks = -(-shape["q_heads"] // mk.BLOCK_HEADS)
    assert mk.choose_num_splits(len(shape["lengths"]), heads_blocks, max_blocks,
                                case["num_sms"]) == case["splits"]

    mgpu.reset_interpreter()
    out, lse = jax.block_until_ready(_interpreted(*args, scale=scale, num_sms=case["num_sms"]))
    assert not mgpu.interpreter_races_found()
    ref_out, ref_lse = ref_mla(*clean, scale=scale)
    assert out.dtype == shape["dtype"] and out.shape == ref_out.shape
    assert lse.dtype == jnp.float32 and lse.shape == ref_lse.shape
    # P is rounded to 16 bits before P V (2^-8 relative for bf16) and the output is 16-bit;
    # the logits are float32 sums of exact products of 16-bit values.
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32),
                               rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-4, atol=1e-4)


def _shapes(q_heads, d_c=512, d_rope=64, page_size=64, dtype=jnp.bfloat16, batch=4,
            max_pages=64):
    pages = batch * max_pages
    return (S((batch, q_heads, d_c), dtype), S((batch, q_heads, d_rope), dtype),
            S((pages, page_size, d_c), dtype), S((pages, page_size, d_rope), dtype),
            S((batch,), jnp.int32), S((batch, max_pages), jnp.int32))


# DeepSeek-V3 (128 heads, 512 + 64: the shared-memory budget's largest fit), one TP-8
# shard of it (16 heads) and a tiny model's 4 heads on 16-token pages.
@pytest.mark.parametrize("q_heads,page_size", [(128, 64), (16, 64), (4, 16)])
def test_lowers_for_h100(q_heads, page_size):
    args = _shapes(q_heads, page_size=page_size)
    assert mk.unsupported_reason(*args[:4]) is None
    lowered = mgpu.lower_for_cuda(mk.mla_decode_attention, *args, scale=0.1)
    assert lowered.as_text().count("custom_call @mosaic_gpu") == 1


def test_unsupported_reason():
    assert mk.unsupported_reason(*_shapes(128)[:4]) is None
    reasons = {
        "float32": _shapes(16, dtype=jnp.float32),
        "d_rope": _shapes(16, d_rope=16),
        "page_size": _shapes(16, page_size=24),
        "shared memory": _shapes(16, d_rope=256),
        "3-D": (S((4, 16), jnp.bfloat16),) + _shapes(16)[1:],
    }
    for word, args in reasons.items():
        reason = mk.unsupported_reason(*args[:4])
        assert reason is not None and word in reason, (word, reason)
    # The public op refuses with the same sentence before tracing anything.
    with pytest.raises(ValueError, match="float32"):
        jax.eval_shape(functools.partial(mk.mla_decode_attention, scale=0.1),
                       *_shapes(16, dtype=jnp.float32))
    with pytest.raises(ValueError, match="num_sms"):
        jax.eval_shape(functools.partial(mk.mla_decode_attention, scale=0.1, num_sms=0),
                       *_shapes(16))


def test_choose_num_splits_fills_one_wave():
    # The targets' shapes on 132 SMs at 128 heads (two head blocks): 8 x 32K splits each
    # sequence 8 ways (128 CTAs), 64 x 8K needs none, 1 x 1K takes one split per step.
    assert mk.choose_num_splits(8, 2, 32768 // 64, 132) == 8
    assert mk.choose_num_splits(64, 2, 8192 // 64, 132) == 1
    assert mk.choose_num_splits(1, 2, 1024 // 64, 132) == 16
    for batch in (1, 3, 8, 40, 66, 67, 200):
        for blocks in (1, 5, 512):
            splits = mk.choose_num_splits(batch, 2, blocks, 132)
            assert 1 <= splits <= blocks
            ctas = batch * 2 * splits
            assert splits == 1 or ctas <= 132  # never a second, partial wave
            # No more splits would fit in the wave, unless every step has its own.
            assert splits == blocks or batch * 2 * (splits + 1) > 132
