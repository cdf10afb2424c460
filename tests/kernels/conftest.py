"""Fixtures shared by the kernel tests.

The `slow` sweeps here run as a covering sample by default and in full
with `--slow` (see tests/conftest.py).
"""

import pytest


def _pretend(device_kind: str, platform: str):
    """Lowering for a device this machine lacks, through jax's public abstract-device hook
    (an abstract mesh of no axes whose device is `device_kind`)."""
    from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

    return use_abstract_mesh(AbstractMesh((), (), abstract_device=AbstractDevice(
        device_kind, 1, platform)))


@pytest.fixture
def pretend_tpu_v5e():
    """Makes Mosaic lowering on a CPU-only machine target a one-core TPU v5e."""
    with _pretend("TPU v5 lite", "tpu"):
        yield


@pytest.fixture
def pretend_h100():
    """Makes Triton lowering on a machine without a GPU target an H100 (jax 0.11 no longer
    falls back to one by itself: it raises "No supported GPU devices found")."""
    with _pretend("NVIDIA H100", "gpu"):
        yield
