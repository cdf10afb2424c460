"""Golden tests of the quantizer and the packed bit layout."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache import quant

BITS = [2, 4, 8]
GROUPINGS = ["tokens", "channels"]


def _random_blocks(rng, shape):
    # Per-column offsets and scales, so groups differ in range and centre.
    x = rng.standard_normal(shape) * rng.uniform(0.1, 5.0, shape[-1]) + rng.normal(0, 3, shape[-1])
    return x.astype(np.float32)


def _expand(s, grouping, g):
    return np.repeat(s, g, axis=-2 if grouping == "tokens" else -1)


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "grouping", "scale_dtype"))
def _round_trip(x, *, bits, group_size, grouping, scale_dtype=jnp.float16):
    """quantize, then pack_codes and dequantize of its codes, as one program per case (run
    op by op they compiled some 70 small programs per case)."""
    codes, scale, zero = quant.quantize(x, bits=bits, group_size=group_size, grouping=grouping,
                                        scale_dtype=scale_dtype)
    x_hat = quant.dequantize(quant.pack_codes(codes, bits), scale, zero, bits=bits,
                             grouping=grouping)
    return codes, scale, zero, x_hat


@pytest.mark.slow
@pytest.mark.parametrize("scale_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("grouping", GROUPINGS)
@pytest.mark.parametrize("bits", BITS)
def test_codes_in_range_and_error_within_half_step(rng, bits, grouping, scale_dtype):
    g = 8
    x = _random_blocks(rng, (3, 2, 32, 16))
    codes, scale, zero, got = _round_trip(jax.device_put(x), bits=bits, group_size=g,
                                          grouping=grouping, scale_dtype=scale_dtype)
    assert codes.dtype == jnp.uint8 and scale.dtype == jnp.dtype(scale_dtype)
    want = (3, 2, 4, 16) if grouping == "tokens" else (3, 2, 32, 2)
    assert scale.shape == want and zero.shape == want
    codes = np.asarray(codes)
    assert codes.min() >= 0 and codes.max() <= 2**bits - 1
    # Both ends of the range are used: the grid is tight, not merely valid.
    assert codes.max() == 2**bits - 1 and codes.min() == 0
    s = _expand(np.asarray(scale, np.float32), grouping, g)
    z = _expand(np.asarray(zero, np.float32), grouping, g)
    x_hat = codes.astype(np.float32) * s + z
    # Half a step with the stored scale, plus float32 rounding of the arithmetic.
    slack = 4 * np.finfo(np.float32).eps * (np.abs(x) + s * 2**bits)
    assert np.all(np.abs(x_hat - x) <= s / 2 + slack)
    # The library's dequantize agrees with the formula after packing.
    np.testing.assert_allclose(np.asarray(got), x_hat, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bits", BITS)
def test_pack_unpack_bit_exact(rng, bits):
    codes = rng.integers(0, 2**bits, (5, 3, 64), dtype=np.uint8)
    packed = quant.pack_codes(jnp.asarray(codes), bits)
    assert packed.dtype == jnp.uint8 and packed.shape == (5, 3, 64 * bits // 8)
    np.testing.assert_array_equal(np.asarray(quant.unpack_codes(packed, bits)), codes)


def test_bit_layout_hand_example():
    # 2-bit codes c0..c7 = 1, 2, 3, 0, 2, 1, 0, 3 (planar order, see layout.py):
    # byte 0 = c0 | c2<<2 | c4<<4 | c6<<6 = 1 | 3<<2 | 2<<4 | 0<<6 = 0b00_10_11_01 = 45
    # byte 1 = c1 | c3<<2 | c5<<4 | c7<<6 = 2 | 0<<2 | 1<<4 | 3<<6 = 0b11_01_00_10 = 210
    codes = jnp.array([1, 2, 3, 0, 2, 1, 0, 3], jnp.uint8)
    np.testing.assert_array_equal(np.asarray(quant.pack_codes(codes, 2)), [45, 210])
    # 4-bit codes 0x1..0x4: byte 0 = c0 | c2<<4 = 0x31, byte 1 = c1 | c3<<4 = 0x42.
    codes4 = jnp.array([1, 2, 3, 4], jnp.uint8)
    np.testing.assert_array_equal(np.asarray(quant.pack_codes(codes4, 4)), [0x31, 0x42])
    # 8-bit codes are stored as they are.
    np.testing.assert_array_equal(np.asarray(quant.pack_codes(codes, 8)), np.asarray(codes))


@pytest.mark.parametrize("grouping", GROUPINGS)
@pytest.mark.parametrize("bits", BITS)
def test_constant_groups_exact_no_nan(rng, bits, grouping):
    g = 4
    # bfloat16 values (exactly representable in float16) in every group, some
    # groups constant, including a constant group of zeros.
    x = rng.standard_normal((8, 8)).astype(jnp.bfloat16).astype(np.float32)
    if grouping == "tokens":
        x[0:4, 1] = x[0, 1]
        x[4:8, 2] = 0.0
        x[0:4, 3] = -7.25
    else:
        x[1, 0:4] = x[1, 0]
        x[2, 4:8] = 0.0
        x[3, 0:4] = 1234.0
    _, scale, _, got = _round_trip(jax.device_put(x), bits=bits, group_size=g, grouping=grouping)
    got = np.asarray(got)
    assert np.isfinite(got).all() and np.isfinite(np.asarray(scale, np.float32)).all()
    if grouping == "tokens":
        sel = [(slice(0, 4), 1), (slice(4, 8), 2), (slice(0, 4), 3)]
    else:
        sel = [(1, slice(0, 4)), (2, slice(4, 8)), (3, slice(0, 4))]
    for s in sel:
        np.testing.assert_array_equal(got[s], x[s])


def test_bad_arguments():
    x = jnp.ones((8, 8), jnp.float32)
    with pytest.raises(ValueError, match="bits must be one of"):
        quant.quantize(x, bits=3, group_size=4, grouping="tokens")
    with pytest.raises(ValueError, match="must divide"):
        quant.quantize(x, bits=4, group_size=3, grouping="channels")
    with pytest.raises(ValueError, match="grouping"):
        quant.quantize(x, bits=4, group_size=4, grouping="heads")
    with pytest.raises(ValueError, match="multiple of 4"):
        quant.pack_codes(jnp.ones((6,), jnp.uint8), 2)
