"""Gemma 2 and Gemma 3 (text) on the paged cache: local sliding-window and global layers.

Gemma 2 alternates local (window 4096) and global layers and soft-caps attention and
output logits; Gemma 3 has five local layers (window 512 or 1024) to one global, per-head
q/k RMSNorm, and a RoPE per layer type (base 10k local, 1M global, linearly scaled on the
larger models). Both use (1 + w) RMSNorms before and after attention and MLP, embeddings
scaled by sqrt(hidden_size), a tanh-GELU gated MLP and tied embeddings. Each layer
attends with its own window, so a cache whose local layers keep only their window's
pages serves it unchanged. Loads `Gemma2ForCausalLM`, `Gemma3ForCausalLM` and the text
model of `Gemma3ForConditionalGeneration`; semantics follow transformers 5.25.

The modules:

* `config`: `GemmaConfig` and its reading from `config.json`.
* `params`: the typed params, their shapes and HF names, random init.
* `checkpoint`: `params_from_hf`, HF tensors to params.
* `model`: `cache_spec` and `forward` on the paged cache.
"""

from kvjax.models.gemma.checkpoint import params_from_hf
from kvjax.models.gemma.config import ARCHITECTURES, GLOBAL, LOCAL, GemmaConfig
from kvjax.models.gemma.model import cache_spec, forward
from kvjax.models.gemma.params import (
    GemmaLayerParams,
    GemmaParams,
    init_params,
    param_shapes,
    unstack_layers,
)

# The family registry (`kvjax.models.base`) reads the config class from here.
CONFIG = GemmaConfig

__all__ = [
    "GemmaConfig",
    "GemmaParams",
    "GemmaLayerParams",
    "init_params",
    "param_shapes",
    "params_from_hf",
    "cache_spec",
    "forward",
    "unstack_layers",
    "ARCHITECTURES",
    "LOCAL",
    "GLOBAL",
    "CONFIG",
]
