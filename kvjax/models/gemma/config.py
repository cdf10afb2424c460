"""`GemmaConfig`: the geometry and switches of a Gemma 2 / Gemma 3 text model, read from
a HuggingFace `config.json`.

What the two generations share and where they differ (transformers 5.25's `gemma2`,
`gemma3_text` and `gemma3`, the reference):

* both: local ("sliding_attention") and global ("full_attention") layers per
  `layer_types`, one `sliding_window` for every local layer; GQA; query scale
  `query_pre_attn_scalar ** -0.5`; (1 + w) RMSNorm before and after attention and
  MLP; embeddings times sqrt(hidden_size); tanh-GELU gated MLP; tied embeddings.
* Gemma 2: layers alternate local/global (1:1) when `layer_types` is absent; one RoPE
  for all layers; attention logits soft-capped (`attn_logit_softcapping`, 50 in the
  released models) and final logits too (`final_logit_softcapping`, 30).
* Gemma 3: five local layers to one global (`sliding_window_pattern` 6) when
  `layer_types` is absent; per-head q/k RMSNorm; RoPE per layer type
  (`rope_parameters` keyed by layer type: base 10k on local layers, 1M, with linear
  scaling on the larger models, on global ones). transformers' Gemma 3 attention never
  applies `attn_logit_softcapping`, and `Gemma3ForConditionalGeneration` (whose text
  config sits under `text_config`) never applies `final_logit_softcapping`: neither
  does this config.
"""

import dataclasses

from kvjax.rope import RopeConfig
from kvjax.specs import AttentionSpec, canonical_dtype

__all__ = ["GemmaConfig", "ARCHITECTURES", "LOCAL", "GLOBAL"]

ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
LOCAL, GLOBAL = "sliding_attention", "full_attention"
_MODEL_TYPES = {"gemma2": 2, "gemma3_text": 3, "gemma3": 3}
_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")
_PARAM_DTYPES = ("float32", "bfloat16", "float16")


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _cap(v) -> bool:
    return v is None or (isinstance(v, int | float) and not isinstance(v, bool) and v > 0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmaConfig:
    """A Gemma 2 or Gemma 3 text model (hashable: a static jit argument).

    Attributes:
      vocab_size, hidden_size, intermediate_size, num_layers: the usual sizes.
      q_heads, kv_heads, head_dim: attention geometry, the same in every layer.
      layer_types: per layer, "sliding_attention" (local: a query at p sees keys k with
        p - k < sliding_window) or "full_attention" (global).
      sliding_window: the local layers' window, in tokens.
      rope_local, rope_global: the rotary settings of local and global layers (Gemma 2:
        the same one).
      query_pre_attn_scalar: queries are scaled by its inverse square root (head_dim in
        most models; 168 for Gemma 3 27B, 144 for Gemma 2 27B).
      attn_softcap: attention logits become `cap * tanh(logits / cap)` (Gemma 2); None: off.
      final_softcap: the same on the output logits (Gemma 2); None: off.
      qk_norm: per-head (1 + w) RMSNorm of q and k before RoPE (Gemma 3).
      rms_norm_eps: epsilon of every RMSNorm.
      hidden_activation: the MLP's gate activation, "gelu_pytorch_tanh" (every released
        model) or "gelu" (exact).
      tie_word_embeddings: the LM head is the embedding matrix.
      dtype: params and activations dtype ("float32", "bfloat16", "float16").
      architecture: the HF architecture name this config came from.
      window_pages: the local layers keep only the pages their window reaches (window
        groups, `kvjax.cache.window`) wherever a `kvjax.generate.CacheConfig` leaves
        `window_pages` unset: generate, the serving engine and the CLI. On by default.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    sliding_window: int
    rope_local: RopeConfig
    rope_global: RopeConfig
    query_pre_attn_scalar: float
    attn_softcap: float | None = None
    final_softcap: float | None = None
    qk_norm: bool = False
    rms_norm_eps: float = 1e-6
    hidden_activation: str = "gelu_pytorch_tanh"
    tie_word_embeddings: bool = True
    dtype: str = "float32"
    architecture: str = "Gemma3ForCausalLM"
    window_pages: bool = True

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "q_heads",
                     "kv_heads", "head_dim", "sliding_window"):
            v = getattr(self, name)
            if not _positive_int(v):
                raise ValueError(f"GemmaConfig.{name} must be a positive int, got {v!r}.")
        AttentionSpec(q_heads=self.q_heads, kv_heads=self.kv_heads, head_dim=self.head_dim)
        types = tuple(self.layer_types)
        if len(types) != self.num_layers or any(t not in (LOCAL, GLOBAL) for t in types):
            raise ValueError(
                f"GemmaConfig.layer_types must hold num_layers={self.num_layers} entries, each "
                f"{LOCAL!r} or {GLOBAL!r}; got {self.layer_types!r}.")
        object.__setattr__(self, "layer_types", types)
        for name in ("rope_local", "rope_global"):
            rope = getattr(self, name)
            if not isinstance(rope, RopeConfig) or rope.dim != self.head_dim:
                raise ValueError(f"GemmaConfig.{name} must be a RopeConfig with dim = head_dim "
                                 f"= {self.head_dim}, got {rope!r}.")
        q = self.query_pre_attn_scalar
        if isinstance(q, bool) or not isinstance(q, int | float) or not q > 0:
            raise ValueError(f"GemmaConfig.query_pre_attn_scalar must be a positive number, "
                             f"got {q!r}.")
        for name in ("attn_softcap", "final_softcap"):
            if not _cap(getattr(self, name)):
                raise ValueError(f"GemmaConfig.{name} must be a positive number or None, got "
                                 f"{getattr(self, name)!r}.")
        if self.hidden_activation not in _ACTIVATIONS:
            raise ValueError(f"GemmaConfig.hidden_activation must be one of {_ACTIVATIONS}, "
                             f"got {self.hidden_activation!r}.")
        dtype = canonical_dtype(self.dtype).name
        if dtype not in _PARAM_DTYPES:
            raise ValueError(f"GemmaConfig.dtype must be one of {_PARAM_DTYPES}, got {dtype}.")
        object.__setattr__(self, "dtype", dtype)

    @property
    def attention(self) -> AttentionSpec:
        return AttentionSpec(q_heads=self.q_heads, kv_heads=self.kv_heads,
                             head_dim=self.head_dim)

    @property
    def scale(self) -> float:
        """The queries' softmax scale, `query_pre_attn_scalar ** -0.5`."""
        return float(self.query_pre_attn_scalar) ** -0.5

    @property
    def sliding_windows(self) -> tuple[int | None, ...]:
        """Per layer, the attention window (local layers) or None (global layers)."""
        return tuple(self.sliding_window if t == LOCAL else None for t in self.layer_types)

    def window(self, layer: int) -> int | None:
        return self.sliding_windows[layer]

    def rope(self, layer: int) -> RopeConfig:
        """The rotary settings of `layer` (its type's)."""
        return self.rope_local if self.layer_types[layer] == LOCAL else self.rope_global

    @classmethod
    def from_hf(cls, hf_config: dict, dtype: str | None = None) -> "GemmaConfig":
        """Builds the config from a HF `config.json` dict (gemma2, gemma3_text, or gemma3,
        whose text part is `text_config`).

        Reads the transformers 5 fields (`layer_types`, `rope_parameters`, per layer type
        for Gemma 3) and, when absent, the older ones the released checkpoints carry
        (`sliding_window_pattern`; Gemma 3's `rope_theta` for global layers,
        `rope_local_base_freq` for local ones and `rope_scaling` for global ones).

        Args:
          hf_config: the parsed config.json.
          dtype: params dtype; default the checkpoint's `dtype`/`torch_dtype`, else float32.

        Raises:
          ValueError: naming an unsupported model_type, activation, layer type, bias or
            bidirectional attention, or a malformed rope setting.
          KeyError: a required size field is missing.
        """
        model_type = hf_config.get("model_type")
        if model_type not in _MODEL_TYPES:
            raise ValueError(f"GemmaConfig.from_hf: model_type {model_type!r} is not a Gemma 2 "
                             f"or Gemma 3 type; supported: {tuple(_MODEL_TYPES)}.")
        generation = _MODEL_TYPES[model_type]
        archs = hf_config.get("architectures") or [
            "Gemma2ForCausalLM" if generation == 2 else "Gemma3ForCausalLM"]
        if dtype is None:
            dtype = hf_config.get("dtype") or hf_config.get("torch_dtype")
        text = hf_config
        if model_type == "gemma3":
            text = hf_config.get("text_config")
            if not isinstance(text, dict):
                raise ValueError(f"GemmaConfig.from_hf: a gemma3 (multimodal) config keeps its "
                                 f"language model under 'text_config', got {text!r}.")
            if dtype is None:
                dtype = text.get("dtype") or text.get("torch_dtype")
        act = text.get("hidden_activation") or text.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in _ACTIVATIONS:
            raise ValueError(f"GemmaConfig.from_hf: hidden_activation {act!r} is not supported; "
                             f"supported: {_ACTIVATIONS}.")
        if text.get("attention_bias"):
            raise ValueError("GemmaConfig.from_hf: attention_bias=True is not supported (no "
                             "released Gemma model has attention biases).")
        if text.get("use_bidirectional_attention"):
            raise ValueError("GemmaConfig.from_hf: use_bidirectional_attention=True (an "
                             "encoder, not a causal LM) is not supported.")
        hidden = int(text["hidden_size"])
        q_heads = int(text["num_attention_heads"])
        head_dim = int(text.get("head_dim") or hidden // q_heads)
        num_layers = int(text["num_hidden_layers"])
        types = text.get("layer_types")
        if types is None:
            pattern = int(text.get("sliding_window_pattern")
                          or text.get("_sliding_window_pattern") or (2 if generation == 2 else 6))
            types = [LOCAL if (i + 1) % pattern else GLOBAL for i in range(num_layers)]
        if generation == 2:
            rope_local = rope_global = RopeConfig.from_hf(text, head_dim)
        else:
            rope_local, rope_global = _gemma3_ropes(text, head_dim)
        return cls(
            vocab_size=int(text["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(text["intermediate_size"]),
            num_layers=num_layers,
            q_heads=q_heads,
            kv_heads=int(text.get("num_key_value_heads") or q_heads),
            head_dim=head_dim,
            layer_types=tuple(types),
            sliding_window=int(text.get("sliding_window") or 4096),
            rope_local=rope_local,
            rope_global=rope_global,
            query_pre_attn_scalar=float(text.get("query_pre_attn_scalar") or 256),
            attn_softcap=text.get("attn_logit_softcapping") if generation == 2 else None,
            final_softcap=(None if model_type == "gemma3"
                           else text.get("final_logit_softcapping")),
            qk_norm=generation == 3,
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            hidden_activation=act,
            tie_word_embeddings=bool(hf_config.get("tie_word_embeddings",
                                                   text.get("tie_word_embeddings", True))),
            dtype=dtype or "float32",
            architecture=archs[0],
        )


def _gemma3_ropes(text: dict, head_dim: int) -> tuple[RopeConfig, RopeConfig]:
    """(local, global) rotary settings of a Gemma 3 text config, either format."""
    params = text.get("rope_parameters")
    if isinstance(params, dict) and (LOCAL in params or GLOBAL in params):
        nested = dict(params)
    else:
        # Released checkpoints: `rope_theta` (global), `rope_local_base_freq` (local) and
        # `rope_scaling` (global only), as transformers' Gemma3TextConfig maps them.
        scaling = text.get("rope_scaling") or (params if isinstance(params, dict) else {})
        if not isinstance(scaling, dict):
            raise ValueError(f"config.json: rope_scaling must be an object, got {scaling!r}.")
        nested = {GLOBAL: {"rope_type": "default", **scaling}, LOCAL: {"rope_type": "default"}}
        nested[GLOBAL].setdefault("rope_theta", text.get("rope_theta") or 1_000_000.0)
        nested[LOCAL]["rope_theta"] = text.get("rope_local_base_freq") or 10_000.0
    for kind, theta in ((GLOBAL, 1_000_000.0), (LOCAL, 10_000.0)):  # transformers' defaults
        entry = nested.get(kind) or {}
        if not isinstance(entry, dict):
            raise ValueError(f"config.json: rope_parameters[{kind!r}] must be an object, got "
                             f"{entry!r}.")
        nested[kind] = {"rope_type": "default", "rope_theta": theta, **entry}
    cfg = {**text, "rope_parameters": nested}
    return (RopeConfig.from_hf(cfg, head_dim, layer_type=LOCAL),
            RopeConfig.from_hf(cfg, head_dim, layer_type=GLOBAL))
