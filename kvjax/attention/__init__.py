"""Attention over paged pages: decode, chunked prefill, MLA, KIVI, selections, the LSE merge,
and DeepSeek Sparse Attention's indexer and token-sparse MLA (`sparse.py`).

The ops take pages (arrays, `QuantizedLayerView`s) and block tables, never cache
objects: `kvjax.cache` sits above this layer and builds their inputs. One registry
(`registry.py`) maps every op and `impl` to the function that runs it.
"""

from kvjax.attention.ops import (
    IMPLS,
    merge_attention_states,
    mla_decode_attention,
    mla_prefill_attention,
    paged_decode_attention,
    paged_prefill_attention,
)
from kvjax.attention.pages import QuantizedLayerView, QuantLayer, Selection, TokenSelection
from kvjax.attention.quantized import (
    quantized_decode_attention,
    quantized_mla_decode_attention,
    quantized_mla_prefill_attention,
    quantized_prefill_attention,
)
from kvjax.attention.selected import (
    mla_selected_decode_attention,
    quantized_mla_selected_decode_attention,
    quantized_selected_decode_attention,
    selected_decode_attention,
)
from kvjax.attention.sparse import (
    indexer_scores,
    mla_sparse_attention,
    quantized_mla_sparse_attention,
    select_topk,
    tail_indexer_scores,
)

__all__ = [
    "IMPLS",
    "QuantLayer",
    "QuantizedLayerView",
    "Selection",
    "TokenSelection",
    "indexer_scores",
    "mla_sparse_attention",
    "quantized_mla_sparse_attention",
    "select_topk",
    "tail_indexer_scores",
    "merge_attention_states",
    "mla_decode_attention",
    "mla_prefill_attention",
    "mla_selected_decode_attention",
    "paged_decode_attention",
    "paged_prefill_attention",
    "quantized_decode_attention",
    "quantized_mla_decode_attention",
    "quantized_mla_prefill_attention",
    "quantized_mla_selected_decode_attention",
    "quantized_prefill_attention",
    "quantized_selected_decode_attention",
    "selected_decode_attention",
]
