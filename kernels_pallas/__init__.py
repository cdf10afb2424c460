"""Pallas kernels for paged attention, one folder per op, importable without kvjax.

Each op folder holds `reference.py` (plain jnp, the oracle and the XLA path)
beside its TPU and GPU kernels.
"""
