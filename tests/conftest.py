"""Test setup: 8 simulated CPU devices, strict dtype promotion, full-precision f32 matmuls."""

import os

# Must happen before any JAX backend starts.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests compile hundreds of small programs and run each a few times: skipping
# LLVM's backend optimisations cuts their CPU time by about a quarter. HLO
# passes (fusion, layout, the HLO the tests inspect) are unaffected.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    ).strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_default_matmul_precision", "highest")

import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def rng(request):
    """A fresh NumPy generator per test, from a random seed.

    The seed is printed on failure (pytest shows captured stdout), so a failing
    draw can be replayed with KVJAX_TEST_SEED.
    """
    seed = int(os.environ.get("KVJAX_TEST_SEED", np.random.SeedSequence().entropy % 2**32))
    print(f"test seed: KVJAX_TEST_SEED={seed}")
    return np.random.default_rng(seed)
