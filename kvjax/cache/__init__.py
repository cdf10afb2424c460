"""The paged KV cache pytree, its page allocator, and operations on both."""

from kvjax.cache import quant, quantized
from kvjax.cache.page_table import (
    AllocStatus,
    CacheFullError,
    PageTable,
    check_invariants,
)
from kvjax.cache.paged import (
    KVPages,
    LatentPages,
    LayerView,
    PagedKVCache,
    Slots,
    fork,
    free,
    init_cache,
    layer_view,
    reserve,
    token_slots,
    write_layer,
    write_layer_jit,
)
from kvjax.cache.quantized import (
    QuantizedKVCache,
    QuantizedKVPages,
    QuantizedLatentPages,
    init_quantized_cache,
)

__all__ = [
    "AllocStatus",
    "CacheFullError",
    "KVPages",
    "LatentPages",
    "LayerView",
    "PageTable",
    "PagedKVCache",
    "Slots",
    "check_invariants",
    "fork",
    "free",
    "init_cache",
    "layer_view",
    "reserve",
    "token_slots",
    "write_layer",
    "write_layer_jit",
    "quant",
    "quantized",
    "QuantizedKVCache",
    "QuantizedKVPages",
    "QuantizedLatentPages",
    "init_quantized_cache",
]
