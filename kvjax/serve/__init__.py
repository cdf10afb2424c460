"""Serving: continuous batching with chunked prefill and prefix caching on kvjax's decode
step (`Engine`), and the OpenAI-compatible server (`python -m kvjax serve`).

Names load on first use, so the `serve` command's parser imports without JAX.
"""

import importlib

_EXPORTS = {
    "Engine": "kvjax.serve.engine",
    "RequestOutput": "kvjax.serve.engine",
    "PrefixCache": "kvjax.serve.prefix",
    "page_hashes": "kvjax.serve.prefix",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kvjax.serve' has no attribute {name!r}")
