"""`DeepseekV32Config`: DeepSeek-V3's architecture plus the lightning indexer (DSA).

The fields mirror transformers 5.24's `DeepseekV32Config`: every `DeepseekConfig`
field (MLA, MoE with V3's sigmoid `noaux_tc` routing) and the indexer's
`index_n_heads`, `index_head_dim` and `index_topk`.
"""

import dataclasses

import numpy as np

from kvjax.models.deepseek.config import DeepseekConfig, hf_fields
from kvjax.specs import CacheSpec, IndexerCacheSpec, canonical_dtype

__all__ = ["DeepseekV32Config", "ARCHITECTURES"]

ARCHITECTURES = ("DeepseekV32ForCausalLM",)
_CACHE_DTYPES = ("float32", "bfloat16", "float16")


def _pos_int(name: str, v: object) -> None:
    if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1:
        raise ValueError(f"DeepseekV32Config.{name} must be a positive int, got {v!r}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeepseekV32Config(DeepseekConfig):
    """A DeepSeek-V3.2 architecture (hashable; a valid static argument to `jax.jit`).

    DeepSeek-V3's MLA and MoE (`DeepseekConfig`, whose fields it has; the router is
    V3's: sigmoid scores, `noaux_tc`) with a lightning indexer in every layer.

    Attributes:
      index_n_heads: indexer query heads; they score against one shared key per token.
      index_head_dim: width of the indexer queries and keys (the first
        `qk_rope_head_dim` channels carry a rotate-half rotary embedding).
      index_topk: tokens each query attends to (`min(index_topk, tokens it sees)`).
      index_cache_dtype: dtype of the cached indexer keys; None (default) keeps them in
        the params dtype, as transformers does, whatever the latent pages' dtype or
        quantization (the token choice then sees the keys the model computed).
    """

    q_lora_rank: int | None = 1536
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 2048
    index_cache_dtype: np.dtype | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.q_lora_rank is None:
            raise ValueError("DeepseekV32Config.q_lora_rank must be set: the indexer's queries "
                             "come from the low-rank query (q_a_proj), which DeepSeek-V3.2 "
                             "always has.")
        for name in ("index_n_heads", "index_head_dim", "index_topk"):
            _pos_int(name, getattr(self, name))
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError(f"DeepseekV32Config: index_head_dim={self.index_head_dim} must be "
                             f">= qk_rope_head_dim={self.qk_rope_head_dim} (the indexer rotates "
                             f"its first qk_rope_head_dim channels).")
        if self.num_moe_layers and (self.scoring_func, self.topk_method) != ("sigmoid",
                                                                             "noaux_tc"):
            raise ValueError(f"DeepseekV32Config: the router is DeepSeek-V3's (scoring_func="
                             f"'sigmoid', topk_method='noaux_tc'), got {self.scoring_func!r}, "
                             f"{self.topk_method!r}.")
        if self.index_cache_dtype is not None:
            dtype = canonical_dtype(self.index_cache_dtype)
            if dtype.name not in _CACHE_DTYPES:
                raise ValueError(f"DeepseekV32Config.index_cache_dtype must be None or one of "
                                 f"{_CACHE_DTYPES}, got {dtype.name}.")
            object.__setattr__(self, "index_cache_dtype", dtype)

    @property
    def index_scale(self) -> float:
        """The indexer's score scale, index_head_dim ** -0.5."""
        return self.index_head_dim ** -0.5

    @property
    def indexer_cache(self) -> IndexerCacheSpec:
        """The geometry and dtype of the cached indexer keys."""
        dtype = self.dtype if self.index_cache_dtype is None else self.index_cache_dtype
        return IndexerCacheSpec(head_dim=self.index_head_dim, dtype=dtype)

    def check_cache(self, spec: CacheSpec) -> None:
        """ValueError unless `spec` holds this model's indexer keys."""
        if spec.indexer != self.indexer_cache:
            raise ValueError(f"the cache's indexer is {spec.indexer}; the model needs "
                             f"{self.indexer_cache} (build the cache with "
                             f"deepseek_v32.cache_spec(config, ...)).")

    @classmethod
    def from_hf(cls, hf_config: dict, **overrides) -> "DeepseekV32Config":
        """Builds a config from a DeepSeek-V3.2 `config.json` (transformers 5 format).

        `mlp_layer_types` must be some "dense" layers followed by "sparse" ones (their
        count gives `first_k_dense_replace`), `layer_types` all "indexed_attention".
        The params dtype defaults to the checkpoint's. `overrides` replace fields.
        Raises ValueError naming any setting this implementation does not support.
        """
        c = dict(hf_config)
        archs = c.get("architectures") or [None]
        if not isinstance(archs, list):
            raise ValueError(f"DeepseekV32Config.from_hf: 'architectures' must be a list like "
                             f"[\"DeepseekV32ForCausalLM\"], got {archs!r}.")
        model_type = c.get("model_type")
        if model_type is None and archs[0] in ARCHITECTURES:
            model_type = "deepseek_v32"
        if model_type != "deepseek_v32":
            raise ValueError(f"DeepseekV32Config.from_hf: model_type {model_type!r} "
                             f"(architectures {archs[0]!r}) is not DeepSeek-V3.2; supported "
                             f"architectures: {ARCHITECTURES}.")
        n = c.get("num_hidden_layers")
        kinds = c.get("layer_types")
        if kinds is not None and set(kinds) - {"indexed_attention"}:
            raise ValueError(f"DeepseekV32Config.from_hf: layer_types {kinds} are not all "
                             f"'indexed_attention' (every DeepSeek-V3.2 layer is indexed).")
        mlp = c.get("mlp_layer_types")
        if mlp is not None:
            dense = next((i for i, t in enumerate(mlp) if t != "dense"), len(mlp))
            if len(mlp) != n or any(t != "sparse" for t in mlp[dense:]):
                raise ValueError(f"DeepseekV32Config.from_hf: mlp_layer_types {mlp} must be "
                                 f"{n} entries, 'dense' ones first, then 'sparse' ones.")
            c["first_k_dense_replace"] = dense
            if dense < len(mlp) and not c.get("n_routed_experts"):
                raise ValueError("DeepseekV32Config.from_hf: 'sparse' MLP layers need "
                                 "n_routed_experts > 0.")
        # transformers' V3.2 attention always rotates interleaved pairs.
        c.pop("rope_interleave", None)
        fields = hf_fields(c, model_type, v3=True)
        missing = [k for k in ("q_lora_rank", "index_n_heads", "index_head_dim", "index_topk")
                   if c.get(k) is None]
        if missing:
            raise ValueError(f"DeepseekV32Config.from_hf: config.json lacks {missing}.")
        fields.update(index_n_heads=c["index_n_heads"], index_head_dim=c["index_head_dim"],
                      index_topk=c["index_topk"])
        fields.update(overrides)
        return cls(**fields)
