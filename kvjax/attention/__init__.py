"""Attention over a paged cache: decode, chunked prefill, MLA, and the LSE merge."""

from kvjax.attention.ops import (
    IMPLS,
    merge_attention_states,
    mla_decode_attention,
    mla_prefill_attention,
    paged_decode_attention,
    paged_prefill_attention,
)

__all__ = [
    "IMPLS",
    "merge_attention_states",
    "mla_decode_attention",
    "mla_prefill_attention",
    "paged_decode_attention",
    "paged_prefill_attention",
]
