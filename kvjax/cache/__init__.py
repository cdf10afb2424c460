"""The paged KV cache pytree (every page kind), its page allocator, and operations on both.

One `PagedKVCache` type holds full-precision K/V, MLA latents, or KIVI-quantized
pages with their full-precision tail (`state.py`); `init_cache(spec)` builds the kind
the spec asks for, and the generic operations (`ops.py`) serve every kind. The kinds'
implementations live in `paged.py` (full precision) and `quantized.py` (KIVI);
`page_kind(cache)` is the one of the two serving a cache, for code that composes a kind's
own fork and truncate (the serving engine's prefix sharing, `kvjax.serve.steps.share`).
"""

from kvjax.attention.pages import QuantizedLayerView, QuantLayer, Selection
from kvjax.cache import paged, quant, quantized
from kvjax.cache.ops import (
    _kind as page_kind,
)
from kvjax.cache.ops import (
    attend,
    attention_probs,
    check_invariants,
    fork,
    free,
    indexer_topk,
    init_cache,
    layer_view,
    reserve,
    truncate,
    write,
)
from kvjax.cache.page_table import AllocStatus, CacheFullError, PageTable
from kvjax.cache.recurrent import read_state, write_state
from kvjax.cache.state import (
    KIVITail,
    KVPages,
    LatentPages,
    LayerView,
    PagedKVCache,
    QuantizedKVPages,
    QuantizedLatentPages,
    QuantPool,
    RecurrentState,
    Slots,
)

__all__ = [
    "AllocStatus",
    "CacheFullError",
    "KIVITail",
    "KVPages",
    "LatentPages",
    "LayerView",
    "PageTable",
    "PagedKVCache",
    "RecurrentState",
    "QuantLayer",
    "QuantPool",
    "QuantizedKVPages",
    "QuantizedLatentPages",
    "QuantizedLayerView",
    "Selection",
    "Slots",
    "attend",
    "attention_probs",
    "check_invariants",
    "fork",
    "free",
    "indexer_topk",
    "init_cache",
    "layer_view",
    "page_kind",
    "paged",
    "quant",
    "quantized",
    "read_state",
    "reserve",
    "truncate",
    "write",
    "write_state",
]
