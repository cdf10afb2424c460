"""Attention over a paged cache: decode, chunked prefill, MLA, and the LSE merge."""

from kvjax.attention.ops import (
    IMPLS,
    merge_attention_states,
    mla_decode_attention,
    mla_prefill_attention,
    paged_decode_attention,
    paged_prefill_attention,
)
from kvjax.attention.quantized import (
    quantized_decode_attention,
    quantized_mla_decode_attention,
    quantized_mla_prefill_attention,
    quantized_prefill_attention,
)

__all__ = [
    "IMPLS",
    "merge_attention_states",
    "mla_decode_attention",
    "mla_prefill_attention",
    "paged_decode_attention",
    "paged_prefill_attention",
    "quantized_decode_attention",
    "quantized_mla_decode_attention",
    "quantized_mla_prefill_attention",
    "quantized_prefill_attention",
]
