"""DeepSeek-V3.2: DeepSeek-V3's MLA and MoE with DeepSeek Sparse Attention (DSA).

Every layer adds a lightning indexer to MLA: small query heads score every cached
token against one cached indexer key per token, and attention reads only each
query's `index_topk` best tokens (DeepSeek-V3.2-Exp). The cache holds the indexer
keys beside the latent pages (`CacheSpec.indexer`: a third pool with the same page
ids), so paging, forks, copy-on-write, KIVI latents and sharding plans carry them.

Semantics follow transformers 5.24's `deepseek_v32`. The modules:

* `config`: `DeepseekV32Config` (a `DeepseekConfig` plus the indexer's fields) and its
  reading from `config.json`.
* `params`: `DeepseekV32LayerParams` (DeepSeek's layer params plus `IndexerParams`),
  random init, `params_from_hf`.
* `indexer`: the indexer's projections.
* `model`: `cache_spec` and `forward` (DeepSeek's decoder, sparse attention).
"""

from kvjax.models.deepseek_v32.config import ARCHITECTURES, DeepseekV32Config
from kvjax.models.deepseek_v32.model import cache_spec, forward
from kvjax.models.deepseek_v32.params import (
    DeepseekV32LayerParams,
    IndexerParams,
    init_params,
    param_shapes,
    params_from_hf,
)

# The family registry (`kvjax.models.base`) reads the config class from here.
CONFIG = DeepseekV32Config

__all__ = [
    "DeepseekV32Config",
    "DeepseekV32LayerParams",
    "IndexerParams",
    "init_params",
    "param_shapes",
    "params_from_hf",
    "cache_spec",
    "forward",
    "ARCHITECTURES",
    "CONFIG",
]
