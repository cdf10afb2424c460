"""Fixtures shared by the kernel tests.

The `slow` sweeps here run as a daily covering sample by default and in full
with `--slow` (see tests/conftest.py).
"""

import pytest


@pytest.fixture
def pretend_tpu_v5e(monkeypatch):
    """Makes Mosaic lowering on a CPU-only machine target a one-core TPU v5e.

    Mosaic asks the default device for its TPU generation through private hooks
    (`jax._src.pallas.mosaic.tpu_info`); a jax without them skips the test.
    """
    try:
        from jax._src.pallas.mosaic import tpu_info
    except ImportError as e:
        pytest.skip(f"this jax has no Mosaic tpu_info module to patch ({e})")
    if not hasattr(tpu_info, "get_device_kind") or not hasattr(tpu_info,
                                                               "get_num_device_cores"):
        pytest.skip("this jax has no tpu_info device hooks to patch")
    monkeypatch.setattr(tpu_info, "get_device_kind", lambda: "TPU v5 lite")
    monkeypatch.setattr(tpu_info, "get_num_device_cores", lambda: 1)
