"""DeepSeek-V2 / V2-Lite / V3: multi-head latent attention (MLA) and DeepSeekMoE on the paged cache.

Per token and layer the cache holds only the normalised latent c_KV
(`kv_lora_rank` wide, after `kv_a_layernorm`) and the shared rotary key
(`qk_rope_head_dim` wide, already rotated): `LatentPages`. Attention never
decompresses the cache: W_UK is absorbed into the query and W_UV applied to the
output in latent space; decode and prefill are MQA over one latent head.

Semantics follow transformers 5.24's `deepseek_v2` / `deepseek_v3` models. The
modules:

* `config`: `DeepseekConfig` and its reading from `config.json`.
* `params`: the typed params (`DeepseekParams`, `DeepseekLayerParams`,
  `MoEParams`, `SwiGLUParams`), their shapes and random init.
* `checkpoint`: `params_from_hf`, HF tensor names to params (fused or
  per-expert tensors, block-FP8 dequantization).
* `mla`: the latent attention's projections, RoPE, absorption and the naive
  decompressing reference; `q_a_layernorm` and `kv_a_layernorm` use eps 1e-6
  (transformers does not pass `rms_norm_eps` to them).
* `moe`: routing and expert dispatch.
* `model`: `cache_spec`, `forward` on the paged cache, `forward_dense`.
"""

from kvjax.models.deepseek.checkpoint import params_from_hf
from kvjax.models.deepseek.config import ARCHITECTURES, DeepseekConfig
from kvjax.models.deepseek.mla import mla_attention_naive
from kvjax.models.deepseek.model import cache_spec, forward, forward_dense
from kvjax.models.deepseek.params import (
    DeepseekLayerParams,
    DeepseekParams,
    MoEParams,
    SwiGLUParams,
    init_params,
)

# The family registry (`kvjax.models.base`) reads the config class from here.
CONFIG = DeepseekConfig

__all__ = [
    "DeepseekConfig",
    "DeepseekParams",
    "DeepseekLayerParams",
    "MoEParams",
    "SwiGLUParams",
    "init_params",
    "params_from_hf",
    "cache_spec",
    "forward",
    "forward_dense",
    "mla_attention_naive",
    "ARCHITECTURES",
    "CONFIG",
]
