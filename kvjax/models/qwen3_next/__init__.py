"""Qwen3-Next: a hybrid of Gated DeltaNet (linear attention) and gated full attention, with a
sparse MoE, on the paged cache.

`layer_types` mixes "linear_attention" layers (Gated DeltaNet: a depthwise causal
convolution over q, k, v, then the gated delta rule; a fixed-size state per sequence)
and "full_attention" layers (GQA whose `q_proj` also gives a sigmoid output gate,
per-head (1 + w) RMSNorm of q and k, partial rotary). Only the full layers hold pages;
each linear layer keeps its convolution inputs and delta-rule state in the same cache
pytree (`kvjax.cache.read_state` / `write_state`), so `fork`, `free`, parallel sampling
and beam search work unchanged. MLPs are the sparse MoE block (softmax top-k experts plus
a sigmoid-gated shared expert) or a dense SwiGLU, per `mlp_only_layers` /
`decoder_sparse_step`. Every RMSNorm but the gated one scales by (1 + weight).

Semantics follow transformers 5.24's `qwen3_next`. The modules:

* `config`: `Qwen3NextConfig` and its reading from `config.json`.
* `params`: the typed params, their shapes and random init.
* `checkpoint`: `params_from_hf`, HF tensor names to params.
* `delta_rule`: the causal convolution and the gated delta rule (recurrent and chunked).
* `model`: `cache_spec` and `forward` on the paged cache.
"""

from kvjax.models.qwen3_next.checkpoint import params_from_hf
from kvjax.models.qwen3_next.config import ARCHITECTURES, Qwen3NextConfig
from kvjax.models.qwen3_next.model import cache_spec, forward
from kvjax.models.qwen3_next.params import (
    AttentionParams,
    DeltaNetParams,
    MoEParams,
    Qwen3NextParams,
    init_params,
)

# The family registry (`kvjax.models.base`) reads the config class from here.
CONFIG = Qwen3NextConfig

__all__ = [
    "Qwen3NextConfig",
    "Qwen3NextParams",
    "DeltaNetParams",
    "AttentionParams",
    "MoEParams",
    "init_params",
    "params_from_hf",
    "cache_spec",
    "forward",
    "ARCHITECTURES",
    "CONFIG",
]
