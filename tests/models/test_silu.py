"""`layers.silu`: x * sigmoid(x) rounded once to a 16-bit activation dtype, as PyTorch
computes it for transformers' `act_fn(gate_proj(x)) * up_proj(x)` (float32 inside, one
rounding), not after each of the five operations of `jax.nn.silu` in bfloat16."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kvjax.models import layers


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_silu_is_rounded_once_from_the_exact_value(dtype, rng):
    np_dtype = np.dtype(getattr(ml_dtypes, dtype) if dtype == "bfloat16" else dtype)
    # Gates over the range where the exp and the divide matter, both signs.
    g = jnp.asarray((rng.standard_normal((64, 1408)) * 4).astype(np.float32), dtype)
    got = np.asarray(jax.jit(layers.silu)(g))
    assert got.dtype == np_dtype
    x = np.asarray(g).astype(np.float64)
    exact = x / (1.0 + np.exp(-x))
    # Correctly rounded but for float32's own error inside (a value within 1e-6 of a
    # rounding midpoint may go either way).
    # (The wider of the two gaps beside it: at a power of two they differ.)
    gaps = [np.abs(np.nextafter(got, np.array(s, got.dtype)).astype(np.float64) - got)
            for s in (np.inf, -np.inf)]
    half_ulp = np.maximum(*gaps) / 2
    err = np.abs(got.astype(np.float64) - exact)
    bad = err > half_ulp + 1e-6 * np.abs(exact)
    assert not bad.any(), (
        f"{int(bad.sum())} of {bad.size} not rounded once, e.g. silu({x[bad][0]!r}) = "
        f"{got[bad][0]!r}, exactly {exact[bad][0]!r}")


def test_silu_float32_is_jax_nn_silu(rng):
    x = jnp.asarray(rng.standard_normal((8, 100)).astype(np.float32) * 4)
    np.testing.assert_array_equal(np.asarray(layers.silu(x)), np.asarray(jax.nn.silu(x)))
