"""Byte accounting for KV caches, real-model presets, a paging-waste simulator, a host tier.

Pure Python: importing this package does not import JAX.
"""

from kvjax.memory.accounting import (
    DTYPE_BITS,
    GB,
    GiB,
    KVFormat,
    as_kv_format,
    bytes_per_batch,
    bytes_per_sequence,
    bytes_per_token,
    bytes_per_token_per_layer,
    dtype_bits,
    elements_per_token_per_layer,
    format_bytes,
    kv_format,
    reduction,
    weight_bytes,
)
from kvjax.memory.host_tier import HostTier, host_tier_bytes
from kvjax.memory.paging import PagingWaste, paging_waste
from kvjax.memory.presets import PRESETS, ModelPreset, get_preset, preset_names

__all__ = [
    "DTYPE_BITS",
    "GB",
    "GiB",
    "HostTier",
    "KVFormat",
    "ModelPreset",
    "PRESETS",
    "PagingWaste",
    "as_kv_format",
    "bytes_per_batch",
    "bytes_per_sequence",
    "bytes_per_token",
    "bytes_per_token_per_layer",
    "dtype_bits",
    "elements_per_token_per_layer",
    "format_bytes",
    "get_preset",
    "host_tier_bytes",
    "kv_format",
    "paging_waste",
    "preset_names",
    "reduction",
    "weight_bytes",
]
