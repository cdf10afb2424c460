"""Model families on the paged cache, HuggingFace checkpoint loading, and the `Model` bundle.

    model, params = kvjax.models.load("path/to/hf-model")
    spec = model.make_cache_spec(page_size=16, num_pages=256, max_seqs=4, max_pages_per_seq=64)
"""

from kvjax.models.base import (
    Family,
    Model,
    family_for_architecture,
    get_family,
    register_family,
    supported_architectures,
)
from kvjax.models.convert import convert_mha_to_gqa
from kvjax.models.loading import (
    CheckpointReader,
    load,
    read_hf_config,
    restore_params,
    save_params,
)

__all__ = [
    "CheckpointReader",
    "convert_mha_to_gqa",
    "Family",
    "Model",
    "family_for_architecture",
    "get_family",
    "load",
    "read_hf_config",
    "register_family",
    "restore_params",
    "save_params",
    "supported_architectures",
]
