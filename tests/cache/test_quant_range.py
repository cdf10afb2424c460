"""The quantizer at the ends of its range: large finite values, NaN and inf.

Finite inputs never give NaN or inf, whatever their magnitude: groups inside
+-representable_range(scale_dtype) keep the s/2 bound with the stored scale,
elements beyond it saturate to their group's grid and are flagged. A NaN or
inf makes its own group (and nothing else) NaN and is flagged; for a concrete
input, `check_quantizable` raises a ValueError naming the element.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache import quant

BITS = [2, 4, 8]
GROUPINGS = ["tokens", "channels"]
G = 8
SHAPE = (2, 32, 16)  # [heads, rows (tokens), width]


@functools.cache
def _jitted(bits, grouping, scale_dtype):
    """quantize, its dequantization and the group flags, traced (no host check)."""

    def run(x):
        codes, scale, zero = quant.quantize(x, bits=bits, group_size=G, grouping=grouping,
                                            scale_dtype=scale_dtype)
        x_hat = quant.dequantize(quant.pack_codes(codes, bits), scale, zero, bits=bits,
                                 grouping=grouping)
        bad = quant.unrepresentable_groups(x, group_size=G, grouping=grouping,
                                           scale_dtype=scale_dtype)
        return codes, scale, zero, x_hat, bad

    return jax.jit(run)


def _expand(a, grouping):
    return np.repeat(a, G, axis=-2 if grouping == "tokens" else -1)


def _group_of(idx, grouping):
    """Index of the scale entry covering element idx = (head, row, col)."""
    h, r, c = idx
    return (h, r // G, c) if grouping == "tokens" else (h, r, c // G)


def _within_half_step(x, x_hat, scale, grouping, mask):
    """|x_hat - x| <= s/2 plus float32 rounding, in float64 (no overflow near 2^127)."""
    s = _expand(np.asarray(scale, np.float64), grouping)
    x, x_hat = np.asarray(x, np.float64), np.asarray(x_hat, np.float64)
    slack = 4 * np.finfo(np.float32).eps * (np.abs(x) + s * 256)
    ok = np.abs(x_hat - x) <= s / 2 + slack
    assert np.all(ok[mask]), np.argwhere(~ok & mask)[:5]


@pytest.mark.slow
@pytest.mark.parametrize("scale_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("grouping", GROUPINGS)
@pytest.mark.parametrize("bits", BITS)
def test_large_finite_values_never_give_nan(rng, bits, grouping, scale_dtype):
    lim = quant.representable_range(scale_dtype)
    x = rng.standard_normal(SHAPE).astype(np.float32)
    # Groups that reach both ends of the representable range (the widest span the
    # scale must hold), one past each end, and huge values: 1e30, +-7e4, +-f32 max.
    big = np.array([lim, -lim, 7e4, -7e4, 1e30, -1e30, 3.4e38, -3.4e38,
                    lim * rng.uniform(0.5, 1.0), -lim * rng.uniform(0.5, 1.0)], np.float32)
    flat = x.reshape(-1)
    pos = rng.choice(flat.size, size=40, replace=False)
    flat[pos[:len(big)]] = big
    flat[pos[len(big):]] = rng.choice(big, size=40 - len(big))
    x = flat.reshape(SHAPE)
    codes, scale, zero, x_hat, bad = (np.asarray(a, np.float32)
                                      for a in _jitted(bits, grouping, scale_dtype)(x))
    assert np.isfinite(scale).all() and np.isfinite(zero).all() and np.isfinite(x_hat).all()
    assert codes.min() >= 0 and codes.max() <= 2**bits - 1
    beyond = np.abs(x) > lim
    assert beyond.any()
    # Exactly the groups holding an element beyond the range are flagged.
    group_beyond = np.zeros_like(bad, bool)
    for idx in np.argwhere(beyond):
        group_beyond[_group_of(tuple(idx), grouping)] = True
    np.testing.assert_array_equal(bad.astype(bool), group_beyond)
    # Every element of an unflagged group is within half a step; in a flagged group every
    # element inside the range still is, and those beyond it sit at the grid's end.
    _within_half_step(x, x_hat, scale, grouping, ~beyond)
    z, s = _expand(zero, grouping), _expand(scale, grouping)
    top = z + s * (2**bits - 1)
    np.testing.assert_allclose(x_hat[beyond & (x > 0)], top[beyond & (x > 0)], rtol=1e-6)
    np.testing.assert_array_equal(x_hat[beyond & (x < 0)], z[beyond & (x < 0)])


@pytest.mark.parametrize("scale_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("bits", BITS)
def test_full_range_group_keeps_the_bound(rng, bits, scale_dtype):
    """A group spanning exactly [-lim, lim] (the widest the scale dtype holds): finite
    scale, both ends reconstructed within s/2 — at int8, float16 used to overflow here."""
    lim = quant.representable_range(scale_dtype)
    x = rng.uniform(-lim, lim, SHAPE).astype(np.float32)
    x[:, 0::G, :] = -lim
    x[:, 1::G, :] = lim
    codes, scale, zero, x_hat, bad = (np.asarray(a, np.float32)
                                      for a in _jitted(bits, "tokens", scale_dtype)(x))
    assert not bad.any() and np.isfinite(x_hat).all()
    _within_half_step(x, x_hat, scale, "tokens", np.ones(SHAPE, bool))


@pytest.mark.parametrize("scale_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("grouping", GROUPINGS)
@pytest.mark.parametrize("bad_value", [np.nan, np.inf, -np.inf])
def test_non_finite_input_stays_in_its_group(rng, grouping, scale_dtype, bad_value):
    bits = int(rng.choice(BITS))
    x = (rng.standard_normal(SHAPE) * 3.0).astype(np.float32)
    idx = tuple(int(rng.integers(0, n)) for n in SHAPE)
    x[idx] = bad_value
    codes, scale, zero, x_hat, bad = (np.asarray(a, np.float32)
                                      for a in _jitted(bits, grouping, scale_dtype)(x))
    group = _group_of(idx, grouping)
    want = np.zeros(scale.shape, bool)
    want[group] = True
    np.testing.assert_array_equal(bad.astype(bool), want)
    np.testing.assert_array_equal(np.isnan(scale), want)
    np.testing.assert_array_equal(np.isnan(zero), want)
    nan_elems = _expand(want, grouping)
    # The group dequantizes to NaN, every other element is finite and within s/2.
    assert np.isnan(x_hat[nan_elems]).all()
    assert np.isfinite(x_hat[~nan_elems]).all()
    _within_half_step(x, x_hat, scale, grouping, ~nan_elems)
    if grouping == "channels":  # values: confined to the token's own G channels
        h, r, c = idx
        assert nan_elems.sum() == G and nan_elems[h, r].sum() == G


@pytest.mark.parametrize("scale_dtype,value,match", [
    ("float16", 7e4, r"x\[.*\] = 70000 lies outside \+-65504.*float16"),
    ("float16", -1e30, r"= -1e\+30 lies outside \+-65504.*bfloat16"),
    ("bfloat16", 3e38, r"= 3e\+38 lies outside \+-8.50706e\+37, the range that bfloat16"),
    ("float16", np.nan, r"= nan is not finite; its group \('tokens' grouping: one channel "
                        r"over 8 tokens\) would dequantize to NaN"),
    ("bfloat16", -np.inf, r"= -inf is not finite"),
])
def test_check_quantizable_names_the_element(rng, scale_dtype, value, match):
    x = rng.standard_normal(SHAPE).astype(np.float32)
    idx = tuple(int(rng.integers(0, n)) for n in SHAPE)
    x[idx] = value
    kw = dict(group_size=G, grouping="tokens", scale_dtype=scale_dtype)
    with pytest.raises(ValueError, match=match) as err:
        quant.check_quantizable(jnp.asarray(x), **kw)
    assert f"x{list(idx)}" in str(err.value)
    # quantize itself does not raise: eager and traced results are the same.
    eager = quant.quantize(jnp.asarray(x), bits=4, **kw)
    for a, b in zip(eager, _jitted(4, "tokens", scale_dtype)(x)[:3], strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    x[idx] = 1.0
    quant.check_quantizable(jnp.asarray(x), **kw)
    with pytest.raises(TypeError, match="needs a concrete array"):
        jax.jit(lambda x: quant.check_quantizable(x, **kw))(x)


def test_representable_range():
    assert quant.representable_range("float16") == 65504.0
    assert quant.representable_range(jnp.bfloat16) == 2.0**126


@pytest.mark.parametrize("scale_dtype", [jnp.float16, jnp.bfloat16])
def test_scale_rounding_steps_equal_nextafter_on_every_finite_value(scale_dtype):
    """The scales' and zeros' directed rounding steps by integer arithmetic on the bits;
    on every finite value of the 16-bit dtype (all 65536 patterns) they equal jnp.nextafter
    towards +inf and -inf (signed zeros stepping to a subnormal of the step's sign)."""
    y = jax.lax.bitcast_convert_type(jnp.arange(1 << 16, dtype=jnp.uint16), scale_dtype)
    finite = np.isfinite(np.asarray(y, np.float32))
    for up, target in ((True, jnp.inf), (False, -jnp.inf)):
        want = np.asarray(jnp.nextafter(y, jnp.asarray(target, scale_dtype)), np.float32)
        got = np.asarray(quant._next16(y, up=up), np.float32)
        np.testing.assert_array_equal(got[finite], want[finite])


@pytest.mark.parametrize("scale_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_scale_is_the_least_16bit_value_whose_levels_cover_the_group(rng, bits, scale_dtype):
    """Groups spanning [0, hi]: the scale is the least positive 16-bit s with
    s * levels >= hi (every finite pattern, in float64), eagerly and jitted alike. Half
    the spans are levels times a 16-bit value, whose quotient is exactly a scale: the
    case where a quotient one float32 ulp high took the next scale up."""
    levels = (1 << bits) - 1
    dt = jnp.dtype(scale_dtype)
    rows, width = 4 * G, 16
    exact = np.asarray(jnp.asarray(rng.uniform(0.01, 4, (rows // G, width)), dt), np.float64)
    hi = np.where(rng.random(exact.shape) < 0.5, exact * levels,
                  rng.uniform(0.01, 4 * levels, exact.shape)).astype(np.float32)
    x = rng.uniform(0, 1, (rows, width)).astype(np.float32) * np.repeat(hi, G, axis=0)
    x[::G] = 0.0
    x[1::G] = hi
    top = 0x7C00 if dt == jnp.float16 else 0x7F80  # +inf's pattern
    values = np.asarray(jax.lax.bitcast_convert_type(jnp.arange(top, dtype=jnp.uint16), dt),
                        np.float64)  # increasing
    want = values[np.searchsorted(values * levels, hi.astype(np.float64), side="left")]
    kw = dict(bits=bits, group_size=G, grouping="tokens", scale_dtype=dt)
    eager = quant.quantize(jnp.asarray(x), **kw)[1]
    jitted = jax.jit(lambda v: quant.quantize(v, **kw)[1])(x)
    np.testing.assert_array_equal(np.asarray(eager, np.float64), want)
    np.testing.assert_array_equal(np.asarray(jitted, np.float64), want)
