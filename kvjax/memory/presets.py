"""Attention geometry and size of real models, for memory accounting.

Where the numbers come from:

* Shapes (`num_hidden_layers`, `hidden_size`, `num_attention_heads`,
  `num_key_value_heads`, `vocab_size` and, for MLA, `kv_lora_rank`,
  `q_lora_rank`, `qk_rope_head_dim`, `qk_nope_head_dim`, `v_head_dim`) are
  copied from `config.json` of the HuggingFace repository named in each
  preset's `source`. `head_dim` is `hidden_size // num_attention_heads` for the
  dense models (none of their configs overrides it).
* Parameter counts of the dense models are the exact totals their config
  implies (embeddings, untied LM head, attention with any biases, SwiGLU MLP,
  RMSNorm weights), which equal the sizes the HF model cards and safetensors
  indexes report (6.74B, 13.0B, 69.0B, 8.03B, 70.6B, 406B, 7.24B, 7.62B,
  72.7B, 67.4B). The MoE DeepSeek models use the totals published in their
  papers and model cards (236B, 15.7B, 671B): every expert must be resident,
  so the total, not the activated count, is what occupies memory.

For MLA models `kv_heads` and `head_dim` describe the multi-head attention the
latent cache replaces: `kv_heads` is the config's `num_key_value_heads`
(= `num_attention_heads`) and `head_dim` is the paper's per-head d_h
(`qk_nope_head_dim` = `v_head_dim` = 128), not `hidden_size / heads`. The cache
itself is described by the MLA fields and `attention` returns an `MLASpec`.
"""

import dataclasses
import types
from collections.abc import Mapping

__all__ = ["PRESETS", "ModelPreset", "get_preset", "preset_names"]

_MLA_FIELDS = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelPreset:
    """One model's cache-relevant shape and its parameter count.

    Args:
      name: lowercase key in `PRESETS`.
      num_layers: transformer layers, each with its own KV cache.
      hidden_size: model width.
      q_heads: query heads per layer.
      kv_heads: KV heads per layer (for MLA, those of the equivalent MHA).
      head_dim: width of one head (for MLA, the paper's d_h).
      num_params: total parameters.
      vocab: vocabulary size.
      source: where the numbers come from.
      kv_lora_rank: MLA latent width d_c; None for MHA/GQA/MQA models.
      q_lora_rank: MLA query latent width; None if the query is not compressed.
      qk_rope_head_dim: MLA decoupled rotary key width d_h^R.
      qk_nope_head_dim: MLA per-head non-rotary query/key width.
      v_head_dim: MLA per-head value width.
    """

    name: str
    num_layers: int
    hidden_size: int
    q_heads: int
    kv_heads: int
    head_dim: int
    num_params: int
    vocab: int
    source: str
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    qk_nope_head_dim: int | None = None
    v_head_dim: int | None = None

    def __post_init__(self):
        given = [f for f in _MLA_FIELDS if getattr(self, f) is not None]
        if given and len(given) != len(_MLA_FIELDS):
            missing = [f for f in _MLA_FIELDS if getattr(self, f) is None]
            raise ValueError(
                f"ModelPreset {self.name!r}: MLA presets need all of {_MLA_FIELDS}; "
                f"missing {missing}."
            )
        if self.q_lora_rank is not None and not given:
            raise ValueError(f"ModelPreset {self.name!r}: q_lora_rank is only for MLA presets.")

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def attention(self):
        """The cached geometry: an `AttentionSpec`, or an `MLASpec` for MLA models.

        `kvjax.specs` imports JAX, so it is imported here rather than at module
        level, keeping `import kvjax.memory` fast.
        """
        from kvjax.specs import AttentionSpec, MLASpec

        if self.is_mla:
            return MLASpec(
                q_heads=self.q_heads,
                kv_lora_rank=self.kv_lora_rank,
                qk_rope_head_dim=self.qk_rope_head_dim,
                qk_nope_head_dim=self.qk_nope_head_dim,
                v_head_dim=self.v_head_dim,
                q_lora_rank=self.q_lora_rank,
            )
        return AttentionSpec(q_heads=self.q_heads, kv_heads=self.kv_heads, head_dim=self.head_dim)

    @property
    def kind(self) -> str:
        """'MHA', 'GQA', 'MQA' or 'MLA'."""
        if self.is_mla:
            return "MLA"
        if self.kv_heads == self.q_heads:
            return "MHA"
        return "MQA" if self.kv_heads == 1 else "GQA"


def _hf(repo: str, extra: str = "") -> str:
    text = f"config.json of huggingface.co/{repo}"
    return f"{text}; {extra}" if extra else text


_DENSE_PARAMS = "params: exact count implied by the config (= model card / safetensors size)"

_PRESET_LIST = (
    ModelPreset(
        name="llama-2-7b",
        num_layers=32, hidden_size=4096, q_heads=32, kv_heads=32, head_dim=128,
        num_params=6_738_415_616, vocab=32_000,
        source=_hf("meta-llama/Llama-2-7b-hf", _DENSE_PARAMS + "; Llama 2, arXiv 2307.09288"),
    ),
    ModelPreset(
        name="llama-2-13b",
        num_layers=40, hidden_size=5120, q_heads=40, kv_heads=40, head_dim=128,
        num_params=13_015_864_320, vocab=32_000,
        source=_hf("meta-llama/Llama-2-13b-hf", _DENSE_PARAMS + "; Llama 2, arXiv 2307.09288"),
    ),
    ModelPreset(
        name="llama-2-70b",
        num_layers=80, hidden_size=8192, q_heads=64, kv_heads=8, head_dim=128,
        num_params=68_976_648_192, vocab=32_000,
        source=_hf("meta-llama/Llama-2-70b-hf", _DENSE_PARAMS + "; Llama 2, arXiv 2307.09288"),
    ),
    ModelPreset(
        name="llama-3-8b",
        num_layers=32, hidden_size=4096, q_heads=32, kv_heads=8, head_dim=128,
        num_params=8_030_261_248, vocab=128_256,
        source=_hf("meta-llama/Meta-Llama-3-8B", _DENSE_PARAMS),
    ),
    ModelPreset(
        name="llama-3-70b",
        num_layers=80, hidden_size=8192, q_heads=64, kv_heads=8, head_dim=128,
        num_params=70_553_706_496, vocab=128_256,
        source=_hf("meta-llama/Meta-Llama-3-70B", _DENSE_PARAMS),
    ),
    ModelPreset(
        name="llama-3.1-405b",
        num_layers=126, hidden_size=16384, q_heads=128, kv_heads=8, head_dim=128,
        num_params=405_853_388_800, vocab=128_256,
        source=_hf("meta-llama/Llama-3.1-405B", _DENSE_PARAMS + "; Llama 3, arXiv 2407.21783"),
    ),
    ModelPreset(
        name="mistral-7b",
        num_layers=32, hidden_size=4096, q_heads=32, kv_heads=8, head_dim=128,
        num_params=7_241_732_096, vocab=32_000,
        source=_hf("mistralai/Mistral-7B-v0.1", _DENSE_PARAMS + "; Mistral 7B, arXiv 2310.06825"),
    ),
    ModelPreset(
        name="qwen2.5-7b",
        num_layers=28, hidden_size=3584, q_heads=28, kv_heads=4, head_dim=128,
        num_params=7_615_616_512, vocab=152_064,
        source=_hf("Qwen/Qwen2.5-7B", _DENSE_PARAMS + " (QKV biases included)"),
    ),
    ModelPreset(
        name="qwen2.5-72b",
        num_layers=80, hidden_size=8192, q_heads=64, kv_heads=8, head_dim=128,
        num_params=72_706_203_648, vocab=152_064,
        source=_hf("Qwen/Qwen2.5-72B", _DENSE_PARAMS + " (QKV biases included)"),
    ),
    ModelPreset(
        name="deepseek-67b",
        num_layers=95, hidden_size=8192, q_heads=64, kv_heads=8, head_dim=128,
        num_params=67_425_001_472, vocab=102_400,
        source=_hf(
            "deepseek-ai/deepseek-llm-67b-base", _DENSE_PARAMS + "; DeepSeek LLM, arXiv 2401.02954"
        ),
    ),
    ModelPreset(
        name="deepseek-v2",
        num_layers=60, hidden_size=5120, q_heads=128, kv_heads=128, head_dim=128,
        num_params=236_000_000_000, vocab=102_400,
        kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128,
        source=_hf(
            "deepseek-ai/DeepSeek-V2",
            "params: 236B total (21B activated) from the model card and DeepSeek-V2, "
            "arXiv 2405.04434",
        ),
    ),
    ModelPreset(
        name="deepseek-v2-lite",
        num_layers=27, hidden_size=2048, q_heads=16, kv_heads=16, head_dim=128,
        num_params=15_700_000_000, vocab=102_400,
        kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128,
        source=_hf(
            "deepseek-ai/DeepSeek-V2-Lite",
            "params: 15.7B total (2.4B activated) from DeepSeek-V2, arXiv 2405.04434, "
            "Appendix B",
        ),
    ),
    ModelPreset(
        name="deepseek-v3",
        num_layers=61, hidden_size=7168, q_heads=128, kv_heads=128, head_dim=128,
        num_params=671_000_000_000, vocab=129_280,
        kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128,
        source=_hf(
            "deepseek-ai/DeepSeek-V3",
            "params: 671B total (37B activated; the 685B on the hub adds the 14B MTP "
            "module) from DeepSeek-V3, arXiv 2412.19437",
        ),
    ),
)

PRESETS: Mapping[str, ModelPreset] = types.MappingProxyType({p.name: p for p in _PRESET_LIST})
"""Presets keyed by lowercase name, in the order above."""


def preset_names() -> tuple[str, ...]:
    """Names of all presets, in a stable order."""
    return tuple(PRESETS)


def get_preset(name: str) -> ModelPreset:
    """Returns the preset called `name` (case-insensitive).

    Raises:
      ValueError: for an unknown name; the message lists the known ones.
    """
    preset = PRESETS.get(str(name).strip().lower())
    if preset is None:
        raise ValueError(f"Unknown model {name!r}; known models: {', '.join(PRESETS)}.")
    return preset
