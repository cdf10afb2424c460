"""Byte accounting for KV caches, real-model presets, a paging-waste simulator, a host tier.

Beyond K/V: the fixed-size state of hybrid models' linear-attention layers
(`linear_state`), the DSA lightning indexer's key cache (`indexer`), and sliding-window
models' local layers with window-only pages (`window`).

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
from kvjax.memory.indexer import DSACacheBytes, IndexerSpec, dsa_cache_bytes
from kvjax.memory.linear_state import (
    GatedDeltaNetSpec,
    HybridCacheBytes,
    hybrid_cache_bytes,
    linear_state_bytes,
)
from kvjax.memory.paging import PagingWaste, paging_waste
from kvjax.memory.presets import PRESETS, ModelPreset, get_preset, preset_names
from kvjax.memory.window import WindowCacheBytes, window_cache_bytes

__all__ = [
    "DSACacheBytes",
    "DTYPE_BITS",
    "GB",
    "GatedDeltaNetSpec",
    "GiB",
    "HostTier",
    "HybridCacheBytes",
    "IndexerSpec",
    "KVFormat",
    "ModelPreset",
    "PRESETS",
    "PagingWaste",
    "WindowCacheBytes",
    "as_kv_format",
    "bytes_per_batch",
    "bytes_per_sequence",
    "bytes_per_token",
    "bytes_per_token_per_layer",
    "dsa_cache_bytes",
    "dtype_bits",
    "elements_per_token_per_layer",
    "format_bytes",
    "get_preset",
    "host_tier_bytes",
    "hybrid_cache_bytes",
    "kv_format",
    "linear_state_bytes",
    "paging_waste",
    "preset_names",
    "reduction",
    "weight_bytes",
    "window_cache_bytes",
]
