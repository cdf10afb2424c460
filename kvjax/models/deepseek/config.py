"""`DeepseekConfig`: a DeepSeek-V2 / V2-Lite / V3 architecture, and its reading from `config.json`.

The fields mirror transformers 5.24's `DeepseekV2Config` / `DeepseekV3Config`
(see the package docstring for the semantics each one selects).
"""

import dataclasses

import numpy as np

from kvjax.rope import RopeConfig, softmax_scale_multiplier
from kvjax.specs import MLASpec, canonical_dtype

__all__ = ["DeepseekConfig", "ARCHITECTURES", "hf_fields"]

ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
_SCORING = ("softmax", "sigmoid")
_TOPK_METHODS = {"softmax": ("greedy", "group_limited_greedy"), "sigmoid": ("noaux_tc",)}
_MOE_IMPLS = ("auto", "dense", "gather", "ragged")
_PARAM_DTYPES = ("float32", "bfloat16", "float16")
# config.json fields without a default.
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
             "v_head_dim")


def _pos_int(name: str, v: object, *, zero_ok: bool = False) -> None:
    lo = 0 if zero_ok else 1
    if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < lo:
        kind = "a non-negative" if zero_ok else "a positive"
        raise ValueError(f"DeepseekConfig.{name} must be {kind} int, got {v!r}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeepseekConfig:
    """A DeepSeek-V2/V3 architecture (hashable; a valid static argument to `jax.jit`).

    Attention fields mirror the HF config (`num_heads` = num_attention_heads).
    MoE fields are ignored when `n_routed_experts == 0` or every layer is dense.

    Attributes:
      rope: the rotary embedding of the `qk_rope_head_dim` channels (`kvjax.rope`):
        its base, scaling (YaRN for the published checkpoints) and pair layout,
        interleaved for V2 and V3's `rope_interleave`, else rotate-half. Default:
        plain RoPE, theta 10000, interleaved.
      scoring_func: "softmax" (V2) or "sigmoid" (V3).
      topk_method: "greedy" / "group_limited_greedy" (softmax) or "noaux_tc" (sigmoid).
      moe_impl: expert dispatch, one of "auto", "dense", "gather", "ragged" (module docstring).
      fp8_block_size: tile of one scale in block-quantized FP8 checkpoints (DeepSeek-V3's
        `quantization_config.weight_block_size`); weights are dequantized on load.
      dtype: parameter and compute dtype (router weights stay float32).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rms_norm_eps: float = 1e-6
    rope: RopeConfig | None = None
    first_k_dense_replace: int = 0
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    n_shared_experts: int = 0
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = False
    tie_word_embeddings: bool = False
    moe_impl: str = "auto"
    fp8_block_size: tuple[int, int] = (128, 128)
    dtype: np.dtype = dataclasses.field(default=np.dtype("float32"))

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            _pos_int(name, getattr(self, name))
        if self.q_lora_rank is not None:
            _pos_int("q_lora_rank", self.q_lora_rank)
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"DeepseekConfig.qk_rope_head_dim must be even, got {self.qk_rope_head_dim}."
            )
        if not self.rms_norm_eps > 0:
            raise ValueError(f"DeepseekConfig.rms_norm_eps must be positive, got "
                             f"{self.rms_norm_eps}.")
        if self.rope is None:
            object.__setattr__(self, "rope", RopeConfig(theta=10000.0, dim=self.qk_rope_head_dim,
                                                        interleaved=True))
        if not isinstance(self.rope, RopeConfig):
            raise ValueError(f"DeepseekConfig.rope must be a kvjax.rope.RopeConfig or None, got "
                             f"{type(self.rope).__name__}.")
        if self.rope.dim != self.qk_rope_head_dim:
            raise ValueError(f"DeepseekConfig: rope.dim={self.rope.dim} must equal "
                             f"qk_rope_head_dim={self.qk_rope_head_dim}.")
        _pos_int("first_k_dense_replace", self.first_k_dense_replace, zero_ok=True)
        _pos_int("n_routed_experts", self.n_routed_experts, zero_ok=True)
        if self.num_moe_layers:
            for name in ("num_experts_per_tok", "moe_intermediate_size", "n_group", "topk_group"):
                _pos_int(name, getattr(self, name))
            _pos_int("n_shared_experts", self.n_shared_experts, zero_ok=True)
            e, k = self.n_routed_experts, self.num_experts_per_tok
            if k > e:
                raise ValueError(f"DeepseekConfig: num_experts_per_tok={k} exceeds "
                                 f"n_routed_experts={e}.")
            if self.scoring_func not in _SCORING:
                raise ValueError(f"DeepseekConfig.scoring_func must be one of {_SCORING}, got "
                                 f"{self.scoring_func!r}.")
            allowed = _TOPK_METHODS[self.scoring_func]
            if self.topk_method not in allowed:
                raise ValueError(
                    f"DeepseekConfig.topk_method={self.topk_method!r} is not supported with "
                    f"scoring_func={self.scoring_func!r}; allowed: {allowed}."
                )
            if self.topk_method != "greedy":
                if e % self.n_group:
                    raise ValueError(f"DeepseekConfig: n_group={self.n_group} must divide "
                                     f"n_routed_experts={e}.")
                if self.topk_group > self.n_group:
                    raise ValueError(f"DeepseekConfig: topk_group={self.topk_group} exceeds "
                                     f"n_group={self.n_group}.")
                if self.topk_group * (e // self.n_group) < k:
                    raise ValueError(
                        f"DeepseekConfig: topk_group={self.topk_group} groups of "
                        f"{e // self.n_group} experts cannot supply num_experts_per_tok={k}."
                    )
                if self.topk_method == "noaux_tc" and e // self.n_group < 2:
                    raise ValueError("DeepseekConfig: noaux_tc scores a group by its top two "
                                     "experts, so each group needs at least 2 experts.")
        fb = self.fp8_block_size
        if (not isinstance(fb, tuple) or len(fb) != 2
                or not all(isinstance(b, int) and b > 0 for b in fb)):
            raise ValueError(f"DeepseekConfig.fp8_block_size must be two positive ints, got "
                             f"{fb!r}.")
        if self.moe_impl not in _MOE_IMPLS:
            raise ValueError(f"DeepseekConfig.moe_impl must be one of {_MOE_IMPLS}, got "
                             f"{self.moe_impl!r}.")
        dtype = canonical_dtype(self.dtype)
        if dtype.name not in _PARAM_DTYPES:
            raise ValueError(f"DeepseekConfig.dtype must be one of {_PARAM_DTYPES}, got "
                             f"{dtype.name}.")
        object.__setattr__(self, "dtype", dtype)

    @property
    def num_dense_layers(self) -> int:
        """Layers with a dense MLP (the first ones)."""
        if self.n_routed_experts == 0:
            return self.num_layers
        return min(self.first_k_dense_replace, self.num_layers)

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim**-0.5 times DeepSeek's YaRN mscale**2."""
        return self.qk_head_dim ** -0.5 * softmax_scale_multiplier(self.rope)

    @property
    def attention(self) -> MLASpec:
        return MLASpec(
            q_heads=self.num_heads, kv_lora_rank=self.kv_lora_rank,
            qk_rope_head_dim=self.qk_rope_head_dim, qk_nope_head_dim=self.qk_nope_head_dim,
            v_head_dim=self.v_head_dim, q_lora_rank=self.q_lora_rank,
            scale=None if self.rope.rope_type != "yarn" else self.softmax_scale,
        )

    @classmethod
    def from_hf(cls, hf_config: dict, **overrides) -> "DeepseekConfig":
        """Builds a config from a DeepSeek `config.json` (transformers 5 or the original format).

        Reads `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling`
        (original checkpoints). The params dtype defaults to the checkpoint's
        `dtype` / `torch_dtype` (else float32). `overrides` replace fields (e.g.
        dtype, moe_impl).
        Raises ValueError naming any setting this implementation does not support.
        """
        c = dict(hf_config)
        archs = c.get("architectures") or [None]
        if not isinstance(archs, list):
            raise ValueError(f"DeepseekConfig.from_hf: 'architectures' must be a list like "
                             f"[\"DeepseekV2ForCausalLM\"], got {archs!r}.")
        arch = archs[0]
        indexer = sorted(k for k in c if k.startswith("index_"))
        if arch == "DeepseekV32ForCausalLM" or c.get("model_type") == "deepseek_v32" or indexer:
            # Read as V3, a V3.2 model would attend densely and ignore its trained indexer.
            raise ValueError(
                f"DeepseekConfig.from_hf: a DeepSeek-V3.2 config (architectures {arch!r}, "
                f"indexer fields {indexer}); load it with the deepseek_v32 family "
                f"(kvjax.models.deepseek_v32.DeepseekV32Config), which reads the indexer.")
        model_type = c.get("model_type")
        if model_type is None and arch is not None:
            model_type = {"DeepseekV2ForCausalLM": "deepseek_v2",
                          "DeepseekV3ForCausalLM": "deepseek_v3"}.get(arch)
        if model_type not in ("deepseek_v2", "deepseek_v3"):
            raise ValueError(
                f"DeepseekConfig.from_hf: model_type {model_type!r} (architectures {arch!r})"
                f" is not a DeepSeek-V2/V3 model; supported architectures: {ARCHITECTURES}."
            )
        fields = hf_fields(c, model_type, v3=model_type == "deepseek_v3")
        fields.update(overrides)
        return cls(**fields)


def hf_fields(c: dict, model_type: str, *, v3: bool) -> dict:
    """`DeepseekConfig`'s fields from a DeepSeek `config.json` (parsed) of `model_type`;
    `v3`: DeepSeek-V3's routing (sigmoid, noaux_tc) and rope layout (`rope_interleave`).

    Raises ValueError naming any setting this implementation does not support.
    """
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False),
                      ("moe_layer_freq", 1)):
        if key in c and c[key] not in (want, None):
            raise ValueError(f"DeepseekConfig.from_hf: {key}={c[key]!r} is not supported "
                             f"(only {want!r}).")
    missing = [k for k in _REQUIRED if c.get(k) is None]
    if missing:
        raise ValueError(f"DeepseekConfig.from_hf: config.json lacks {missing}; a "
                         f"{model_type} config needs every one of {list(_REQUIRED)}.")
    # num_key_value_heads is meaningless for MLA (kv_b_proj expands every head from the
    # latent), so it is not read.
    heads = c["num_attention_heads"]
    scoring = "sigmoid" if v3 else "softmax"
    if c.get("scoring_func") not in (None, scoring):
        raise ValueError(f"DeepseekConfig.from_hf: scoring_func={c['scoring_func']!r} is not "
                         f"what {model_type} uses ({scoring!r}).")
    topk_method = "noaux_tc" if v3 else (c.get("topk_method") or "greedy")
    if v3 and c.get("topk_method") not in (None, "noaux_tc"):
        raise ValueError(f"DeepseekConfig.from_hf: topk_method={c['topk_method']!r} is not "
                         f"supported for {model_type} (only 'noaux_tc').")
    rope = RopeConfig.from_hf(c, c["qk_rope_head_dim"],
                              interleaved=bool(c.get("rope_interleave", True)) if v3 else True)
    fp8_block = (128, 128)
    quant = c.get("quantization_config")
    if quant:
        if quant.get("quant_method") != "fp8":
            raise ValueError(
                f"DeepseekConfig.from_hf: quantization_config quant_method="
                f"{quant.get('quant_method')!r} is not supported (only block 'fp8', which "
                f"is dequantized on load)."
            )
        fp8_block = tuple(int(b) for b in quant.get("weight_block_size") or (128, 128))
    n_experts = c.get("n_routed_experts") or 0
    first_dense = c.get("first_k_dense_replace")
    fields = dict(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"], num_layers=c["num_hidden_layers"],
        num_heads=heads, kv_lora_rank=c["kv_lora_rank"], q_lora_rank=c.get("q_lora_rank"),
        qk_rope_head_dim=c["qk_rope_head_dim"], qk_nope_head_dim=c["qk_nope_head_dim"],
        v_head_dim=c["v_head_dim"], rms_norm_eps=float(c.get("rms_norm_eps") or 1e-6),
        rope=rope,
        first_k_dense_replace=(3 if v3 else 0) if first_dense is None else first_dense,
        n_routed_experts=n_experts,
        num_experts_per_tok=c.get("num_experts_per_tok") or 0,
        moe_intermediate_size=c.get("moe_intermediate_size") or 0,
        n_shared_experts=c.get("n_shared_experts") or 0,
        scoring_func=scoring, topk_method=topk_method,
        n_group=c.get("n_group") or 1, topk_group=c.get("topk_group") or 1,
        routed_scaling_factor=float(c.get("routed_scaling_factor") or 1.0),
        norm_topk_prob=bool(c.get("norm_topk_prob", v3)),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        dtype=c.get("dtype") or c.get("torch_dtype") or "float32",
        fp8_block_size=fp8_block,
    )
    return fields
