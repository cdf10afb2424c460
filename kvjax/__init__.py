"""kvjax: make LLM decoding fit in memory.

    import kvjax as kvx

    spec = kvx.CacheSpec(attention=kvx.AttentionSpec(q_heads=32, kv_heads=8, head_dim=128),
                         num_layers=32, page_size=16, num_pages=4096, max_seqs=64,
                         max_pages_per_seq=256, dtype="bfloat16")
    cache = kvx.init_cache(spec)
"""

from kvjax import attention, cache, memory
from kvjax.attention import merge_attention_states
from kvjax.cache import CacheFullError, PagedKVCache, init_cache
from kvjax.specs import AttentionSpec, CacheSpec, MLASpec

__version__ = "0.1.0"

__all__ = [
    "AttentionSpec",
    "CacheFullError",
    "CacheSpec",
    "MLASpec",
    "PagedKVCache",
    "attention",
    "cache",
    "init_cache",
    "memory",
    "merge_attention_states",
]
