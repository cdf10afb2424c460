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

Two presets are read from transformers' own config classes, whose defaults are
those models' configs (transformers 5.x: `Qwen3NextConfig()`,
`DeepseekV32Config()`); `tests/memory/test_memory_hybrid_dsa.py` compares them
field by field when transformers is installed:

* `qwen3-next-80b-a3b`, a hybrid: of `num_hidden_layers` = 48 layers, layer i
  is full attention when (i + 1) % `full_attention_interval` (4) == 0 (the
  config's `layer_types`), so 12 gated GQA attention layers with a paged KV
  cache (`num_attention_heads` 16, `num_key_value_heads` 2, `head_dim` 256,
  which the config sets explicitly: hidden_size is 2048) and 36 Gated DeltaNet
  layers with a fixed state (`linear_num_key_heads` 16,
  `linear_num_value_heads` 32, `linear_key_head_dim` 128,
  `linear_value_head_dim` 128, `linear_conv_kernel_dim` 4); see
  `linear_state`.
* `deepseek-v3.2`: DeepSeek-V3's MLA geometry (the config's values equal
  `deepseek-v3`'s) plus DSA's lightning indexer (`index_n_heads` 64,
  `index_head_dim` 128, `index_topk` 2048) in every layer (`layer_types` are
  all "indexed_attention"); see `indexer`.

Their parameter counts are the exact totals of the transformers model built
from those configs (the multi-token-prediction layers, which transformers does
not build, are left out, as for `deepseek-v3`). `active_params` counts what a
decode step reads in full: every weight except the routed experts and the input
embedding table (one row is read), plus `num_experts_per_tok` routed experts
per MoE layer. The model cards quote 80B / 3B and 671B / 37B.

The Gemma presets mix sliding-window (local) and global layers: layer i is global
when (i + 1) % `global_attention_interval` == 0 (transformers' `layer_types` for
configs without one: Gemma 2 alternates, interval 2; Gemma 3 has five local layers to
one global, `sliding_window_pattern` 6), the others attend to the last
`sliding_window` tokens (4096 for Gemma 2; 512 for Gemma 3 1B, 1024 for 4B, 12B, 27B).
Shapes come from each repository's `config.json` (Gemma 3 4B, 12B and 27B:
its `text_config`), with `head_dim` set explicitly (256; 128 for the two 27B models).
Their parameter counts are the exact totals of the text model the config implies
(tied embeddings, q/k/v/o, the gated MLP, four RMSNorms per layer, Gemma 3's per-head
q/k norms and the final norm), which equal the model cards' 2.61B, 9.24B, 27.2B and
1B; Gemma 3 4B, 12B and 27B checkpoints also hold a SigLIP vision encoder and projector
(about 0.4B; the cards quote 4.3B, 12.2B and 27.4B in all), which kvjax does not load.

For MLA models `kv_heads` and `head_dim` describe the multi-head attention the
latent cache replaces: `kv_heads` is the config's `num_key_value_heads`
(= `num_attention_heads`) and `head_dim` is the paper's per-head d_h
(`qk_nope_head_dim` = `v_head_dim` = 128), not `hidden_size / heads`. The cache
itself is described by the MLA fields and `attention` returns an `MLASpec`.
"""

import dataclasses
import types
from collections.abc import Mapping

from kvjax.memory.indexer import IndexerSpec
from kvjax.memory.linear_state import GatedDeltaNetSpec

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
      active_params: parameters a decode step reads in full (MoE models), or None.
      full_attention_interval: hybrid models: every this-many-th layer (layers
        i with (i + 1) % interval == 0) is full attention with a KV cache; the
        others are linear attention. None: every layer is full attention.
      linear_attention: hybrid models: the linear-attention layers' state
        geometry; given together with `full_attention_interval`.
      indexer: DSA models: the lightning indexer, present in every layer.
      sliding_window: sliding-window models: the local layers' window (a query sees the
        last `sliding_window` tokens); given together with `global_attention_interval`.
      global_attention_interval: sliding-window models: layers i with (i + 1) % interval
        == 0 are global (full attention), the others local.
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
    active_params: int | None = None
    full_attention_interval: int | None = None
    linear_attention: GatedDeltaNetSpec | None = None
    indexer: IndexerSpec | None = None
    sliding_window: int | None = None
    global_attention_interval: int | None = None

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
        if (self.full_attention_interval is None) != (self.linear_attention is None):
            raise ValueError(
                f"ModelPreset {self.name!r}: a hybrid preset needs both full_attention_interval "
                f"and linear_attention; got {self.full_attention_interval!r} and "
                f"{self.linear_attention!r}."
            )
        interval = self.full_attention_interval
        if interval is not None and not (
            isinstance(interval, int) and 2 <= interval <= self.num_layers
        ):
            raise ValueError(
                f"ModelPreset {self.name!r}: full_attention_interval must be an int in "
                f"[2, num_layers={self.num_layers}], got {interval!r}."
            )

        if (self.sliding_window is None) != (self.global_attention_interval is None):
            raise ValueError(
                f"ModelPreset {self.name!r}: a sliding-window preset needs both sliding_window "
                f"and global_attention_interval; got {self.sliding_window!r} and "
                f"{self.global_attention_interval!r}.")
        if self.sliding_window is not None:
            g = self.global_attention_interval
            if not (isinstance(self.sliding_window, int) and self.sliding_window >= 1
                    and isinstance(g, int) and 1 <= g <= self.num_layers):
                raise ValueError(
                    f"ModelPreset {self.name!r}: sliding_window must be an int >= 1 and "
                    f"global_attention_interval an int in [1, num_layers={self.num_layers}]; "
                    f"got {self.sliding_window!r} and {g!r}.")
            if given or interval is not None:
                raise ValueError(f"ModelPreset {self.name!r}: sliding-window presets are "
                                 f"GQA/MQA/MHA models without linear-attention layers.")

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def is_hybrid(self) -> bool:
        """True if some layers are linear attention with a fixed state instead of a KV cache."""
        return self.linear_attention is not None

    @property
    def layer_types(self) -> tuple[str, ...]:
        """'full_attention', 'linear_attention' or 'sliding_attention' per layer, as
        transformers' `layer_types`."""
        n, g = self.full_attention_interval, self.global_attention_interval
        return tuple(
            "linear_attention" if n is not None and (i + 1) % n
            else "sliding_attention" if g is not None and (i + 1) % g
            else "full_attention"
            for i in range(self.num_layers)
        )

    @property
    def kv_layers(self) -> int:
        """Layers with a KV cache: all but a hybrid's linear-attention layers."""
        return self.num_layers - self.layer_types.count("linear_attention")

    @property
    def local_layers(self) -> int:
        """Sliding-window layers (0 for models without them)."""
        return self.layer_types.count("sliding_attention")

    @property
    def linear_layers(self) -> int:
        """Layers with a fixed linear-attention state instead of a KV cache."""
        return self.num_layers - self.kv_layers

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
    def label(self) -> str:
        """`kind`, plus '+GDN' for a Gated DeltaNet hybrid, '+DSA' for an indexer and '+SWA'
        for sliding-window local layers."""
        return (self.kind + ("+GDN" if self.is_hybrid else "")
                + ("+DSA" if self.indexer is not None else "")
                + ("+SWA" if self.sliding_window is not None else ""))

    @property
    def kind(self) -> str:
        """'MHA', 'GQA', 'MQA' or 'MLA': the attention of the layers with a KV cache."""
        if self.is_mla:
            return "MLA"
        if self.kv_heads == self.q_heads:
            return "MHA"
        return "MQA" if self.kv_heads == 1 else "GQA"


def _hf(repo: str, extra: str = "") -> str:
    text = f"config.json of huggingface.co/{repo}"
    return f"{text}; {extra}" if extra else text


_DENSE_PARAMS = "params: exact count implied by the config (= model card / safetensors size)"


def _transformers(config: str, repo: str, fields: str) -> str:
    return (f"transformers 5.x {config}() defaults (its docstring checkpoint: "
            f"huggingface.co/{repo}): {fields}")


_DEEPSEEK_V3 = ModelPreset(
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
)

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
    _DEEPSEEK_V3,
    # DeepseekV32Config's MLA fields equal DeepSeek-V3's, so the preset extends it.
    dataclasses.replace(
        _DEEPSEEK_V3,
        name="deepseek-v3.2",
        num_params=671_877_929_216, active_params=37_477_128_448,
        indexer=IndexerSpec(n_heads=64, head_dim=128, topk=2048),
        source=_transformers(
            "DeepseekV32Config", "deepseek-ai/DeepSeek-V3.2-Exp",
            "num_hidden_layers 61 (layer_types: all indexed_attention), num_attention_heads 128, "
            "kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128, "
            "q_lora_rank 1536 (= deepseek-v3); index_n_heads 64, index_head_dim 128, "
            "index_topk 2048; params: exact count of DeepseekV32ForCausalLM (no MTP); active: "
            "non-expert weights less the embedding table + num_experts_per_tok 8 of "
            "n_routed_experts 256 in each of 58 MoE layers",
        ),
    ),
    ModelPreset(
        name="qwen3-next-80b-a3b",
        num_layers=48, hidden_size=2048, q_heads=16, kv_heads=2, head_dim=256,
        num_params=79_674_391_296, active_params=3_563_764_480, vocab=151_936,
        full_attention_interval=4,
        linear_attention=GatedDeltaNetSpec(
            num_key_heads=16, num_value_heads=32, key_head_dim=128, value_head_dim=128,
            conv_kernel=4,
        ),
        source=_transformers(
            "Qwen3NextConfig", "Qwen/Qwen3-Next-80B-A3B-Instruct",
            "num_hidden_layers 48, full_attention_interval 4 (layer_types: every 4th layer "
            "full_attention), num_attention_heads 16, num_key_value_heads 2, head_dim 256, "
            "linear_num_key_heads 16, linear_num_value_heads 32, linear_key_head_dim 128, "
            "linear_value_head_dim 128, linear_conv_kernel_dim 4, vocab_size 151936; params: "
            "exact count of Qwen3NextForCausalLM (no MTP); active: non-expert weights less the "
            "embedding table + num_experts_per_tok 10 of num_experts 512 in each of 48 MoE "
            "layers",
        ),
    ),
)


def _gemma(name: str, repo: str, *, layers: int, hidden: int, inter: int, heads: int,
           kv_heads: int, head_dim: int, vocab: int, window: int, interval: int,
           params: int, note: str) -> ModelPreset:
    return ModelPreset(
        name=name, num_layers=layers, hidden_size=hidden, q_heads=heads, kv_heads=kv_heads,
        head_dim=head_dim, num_params=params, vocab=vocab, sliding_window=window,
        global_attention_interval=interval,
        source=_hf(repo, f"num_hidden_layers {layers}, hidden_size {hidden}, intermediate_size "
                         f"{inter}, num_attention_heads {heads}, num_key_value_heads "
                         f"{kv_heads}, head_dim {head_dim}, sliding_window {window}, layer i "
                         f"global when (i + 1) % {interval} == 0; params: {note}"))


_GEMMA_TEXT = "exact count of the text model the config implies (= model card)"
_GEMMA3_MM = ("exact count of the text model the config's text_config implies; the "
              "checkpoint's SigLIP vision encoder is not counted")
_GEMMA_PRESETS = (
    _gemma("gemma-2-2b", "google/gemma-2-2b", layers=26, hidden=2304, inter=9216, heads=8,
           kv_heads=4, head_dim=256, vocab=256_000, window=4096, interval=2,
           params=2_614_341_888, note=_GEMMA_TEXT),
    _gemma("gemma-2-9b", "google/gemma-2-9b", layers=42, hidden=3584, inter=14336, heads=16,
           kv_heads=8, head_dim=256, vocab=256_000, window=4096, interval=2,
           params=9_241_705_984, note=_GEMMA_TEXT),
    _gemma("gemma-2-27b", "google/gemma-2-27b", layers=46, hidden=4608, inter=36864, heads=32,
           kv_heads=16, head_dim=128, vocab=256_000, window=4096, interval=2,
           params=27_227_128_320, note=_GEMMA_TEXT),
    _gemma("gemma-3-1b", "google/gemma-3-1b-pt", layers=26, hidden=1152, inter=6912, heads=4,
           kv_heads=1, head_dim=256, vocab=262_144, window=512, interval=6,
           params=999_885_952, note=_GEMMA_TEXT),
    _gemma("gemma-3-4b", "google/gemma-3-4b-pt", layers=34, hidden=2560, inter=10240, heads=8,
           kv_heads=4, head_dim=256, vocab=262_208, window=1024, interval=6,
           params=3_880_263_168, note=_GEMMA3_MM),
    _gemma("gemma-3-12b", "google/gemma-3-12b-pt", layers=48, hidden=3840, inter=15360,
           heads=16, kv_heads=8, head_dim=256, vocab=262_208, window=1024, interval=6,
           params=11_766_034_176, note=_GEMMA3_MM),
    _gemma("gemma-3-27b", "google/gemma-3-27b-pt", layers=62, hidden=5376, inter=21504,
           heads=32, kv_heads=16, head_dim=128, vocab=262_208, window=1024, interval=6,
           params=27_009_346_304, note=_GEMMA3_MM),
)

PRESETS: Mapping[str, ModelPreset] = types.MappingProxyType(
    {p.name: p for p in (*_PRESET_LIST, *_GEMMA_PRESETS)})
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
