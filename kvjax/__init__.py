"""kvjax: make LLM decoding fit in memory.

    import kvjax as kvx

    spec = kvx.CacheSpec(attention=kvx.AttentionSpec(q_heads=32, kv_heads=8, head_dim=128),
                         num_layers=32, page_size=16, num_pages=4096, max_seqs=64,
                         max_pages_per_seq=256, dtype="bfloat16")
    cache = kvx.init_cache(spec)

Submodules and names load on first use, so `python -m kvjax memory` and
`import kvjax.memory` do not pay for importing JAX.
"""

import importlib

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "AttentionSpec": "kvjax.specs",
    "MLASpec": "kvjax.specs",
    "CacheSpec": "kvjax.specs",
    "QuantSpec": "kvjax.specs",
    "RecurrentSpec": "kvjax.specs",
    "PagedKVCache": "kvjax.cache",
    "CacheFullError": "kvjax.cache",
    "init_cache": "kvjax.cache",
    "merge_attention_states": "kvjax.attention",
}
_SUBMODULES = ("attention", "cache", "generate", "memory", "models", "sharding", "specs")

__all__ = sorted([*_EXPORTS, *_SUBMODULES])


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"kvjax.{name}")
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kvjax' has no attribute {name!r}")


def __dir__():
    return __all__
