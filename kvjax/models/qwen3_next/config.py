"""`Qwen3NextConfig`: a Qwen3-Next architecture, and its reading from `config.json`.

The fields mirror transformers 5.24's `Qwen3NextConfig`. One naming difference matters
to the rest of kvjax: `num_layers` is the number of *full-attention* layers — the
layers that hold pages, what `CacheSpec.num_layers` counts and what `kvjax.generate`
checks a cache against — while `num_hidden_layers` counts every decoder layer.
"""

import dataclasses

import numpy as np

from kvjax.rope import RopeConfig
from kvjax.specs import AttentionSpec, RecurrentSpec, canonical_dtype

__all__ = ["Qwen3NextConfig", "ARCHITECTURES", "LINEAR", "FULL"]

ARCHITECTURES = ("Qwen3NextForCausalLM",)
LINEAR, FULL = "linear_attention", "full_attention"
_MOE_IMPLS = ("auto", "dense", "gather", "ragged")
_PARAM_DTYPES = ("float32", "bfloat16", "float16")
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def _pos_int(name: str, v: object, *, zero_ok: bool = False) -> None:
    lo = 0 if zero_ok else 1
    if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < lo:
        kind = "a non-negative" if zero_ok else "a positive"
        raise ValueError(f"Qwen3NextConfig.{name} must be {kind} int, got {v!r}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen3NextConfig:
    """A Qwen3-Next hybrid architecture (hashable; a valid static argument to `jax.jit`).

    Attributes:
      vocab_size, hidden_size: the usual sizes.
      num_hidden_layers: decoder layers of both kinds.
      layer_types: per layer, "linear_attention" (Gated DeltaNet) or "full_attention".
      q_heads, kv_heads, head_dim: the full-attention layers' geometry (GQA).
      rope: their rotary embedding; `rope.dim` is the rotated width
        (`head_dim * partial_rotary_factor`), the other channels pass through.
      attention_bias: q/k/v/o projections have biases.
      linear_key_heads, linear_value_heads: Gated DeltaNet key (and query) heads and
        value heads; each key head serves `linear_value_heads // linear_key_heads`
        consecutive value heads.
      linear_key_head_dim, linear_value_head_dim: their widths.
      linear_conv_kernel: width of the depthwise causal convolution over q, k and v.
      intermediate_size: width of the dense SwiGLU MLP.
      num_experts, num_experts_per_tok, moe_intermediate_size: the routed experts
        (softmax router, top-k); `num_experts == 0` makes every MLP dense.
      shared_expert_intermediate_size: the shared expert's width (sigmoid-gated).
      norm_topk_prob: divide the top-k router probabilities by their sum.
      decoder_sparse_step, mlp_only_layers: layer i has the MoE block when
        `num_experts > 0`, `(i + 1) % decoder_sparse_step == 0` and i is not in
        `mlp_only_layers`; a dense MLP otherwise.
      rms_norm_eps: epsilon of every RMSNorm (the (1 + weight) ones and the gated one).
      tie_word_embeddings: the LM head is the embedding matrix.
      moe_impl: expert dispatch ("auto", "dense", "gather", "ragged"; see
        `kvjax.models.deepseek.moe`, whose dispatch this family shares).
      dtype: parameter and activation dtype; the delta rule and the recurrent state
        always run in float32, as transformers runs them.
      architecture: the HF architecture name.
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    q_heads: int
    kv_heads: int
    head_dim: int
    rope: RopeConfig
    attention_bias: bool = False
    linear_key_heads: int
    linear_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel: int = 4
    intermediate_size: int
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    moe_impl: str = "auto"
    dtype: str = "float32"
    architecture: str = "Qwen3NextForCausalLM"

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "q_heads", "kv_heads",
                     "head_dim", "linear_key_heads", "linear_value_heads",
                     "linear_key_head_dim", "linear_value_head_dim", "intermediate_size",
                     "decoder_sparse_step"):
            _pos_int(name, getattr(self, name))
        _pos_int("linear_conv_kernel", self.linear_conv_kernel)
        if self.linear_conv_kernel < 2:
            raise ValueError(f"Qwen3NextConfig.linear_conv_kernel must be >= 2 (the cache "
                             f"keeps kernel - 1 inputs), got {self.linear_conv_kernel}.")
        AttentionSpec(q_heads=self.q_heads, kv_heads=self.kv_heads, head_dim=self.head_dim)
        types = tuple(self.layer_types)
        if len(types) != self.num_hidden_layers or any(t not in (LINEAR, FULL) for t in types):
            raise ValueError(
                f"Qwen3NextConfig.layer_types must hold num_hidden_layers="
                f"{self.num_hidden_layers} entries, each {LINEAR!r} or {FULL!r}; got {types!r}.")
        if FULL not in types:
            raise ValueError("Qwen3NextConfig.layer_types needs at least one 'full_attention' "
                             "layer: the paged cache is built for those layers.")
        object.__setattr__(self, "layer_types", types)
        if self.linear_value_heads % self.linear_key_heads:
            raise ValueError(
                f"Qwen3NextConfig: linear_key_heads={self.linear_key_heads} must divide "
                f"linear_value_heads={self.linear_value_heads}.")
        if not isinstance(self.rope, RopeConfig) or self.rope.interleaved:
            raise ValueError(f"Qwen3NextConfig.rope must be a rotate-half kvjax.rope.RopeConfig, "
                             f"got {self.rope!r}.")
        if self.rope.dim > self.head_dim:
            raise ValueError(f"Qwen3NextConfig: the rotary width {self.rope.dim} exceeds "
                             f"head_dim={self.head_dim}.")
        _pos_int("num_experts", self.num_experts, zero_ok=True)
        only = tuple(int(i) for i in self.mlp_only_layers)
        object.__setattr__(self, "mlp_only_layers", only)
        if self.num_moe_layers:
            for name in ("num_experts_per_tok", "moe_intermediate_size"):
                _pos_int(name, getattr(self, name))
            _pos_int("shared_expert_intermediate_size", self.shared_expert_intermediate_size,
                     zero_ok=True)
            if self.num_experts_per_tok > self.num_experts:
                raise ValueError(f"Qwen3NextConfig: num_experts_per_tok="
                                 f"{self.num_experts_per_tok} exceeds num_experts="
                                 f"{self.num_experts}.")
        if self.moe_impl not in _MOE_IMPLS:
            raise ValueError(f"Qwen3NextConfig.moe_impl must be one of {_MOE_IMPLS}, got "
                             f"{self.moe_impl!r}.")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"Qwen3NextConfig.rms_norm_eps must be positive, got "
                             f"{self.rms_norm_eps}.")
        dtype = canonical_dtype(self.dtype).name
        if dtype not in _PARAM_DTYPES:
            raise ValueError(f"Qwen3NextConfig.dtype must be one of {_PARAM_DTYPES}, got "
                             f"{dtype}.")
        object.__setattr__(self, "dtype", dtype)

    # -- layer bookkeeping

    def is_moe(self, layer: int) -> bool:
        """Whether decoder layer `layer` has the sparse MoE block (else a dense MLP)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def num_layers(self) -> int:
        """Full-attention layers: those that hold pages (`CacheSpec.num_layers`)."""
        return self.layer_types.count(FULL)

    @property
    def num_linear_layers(self) -> int:
        """Gated DeltaNet layers: those that keep a recurrent state per slot."""
        return self.layer_types.count(LINEAR)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe(i) for i in range(self.num_hidden_layers))

    @property
    def num_dense_layers(self) -> int:
        return self.num_hidden_layers - self.num_moe_layers

    @property
    def linear_key_width(self) -> int:
        return self.linear_key_heads * self.linear_key_head_dim

    @property
    def linear_value_width(self) -> int:
        return self.linear_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal convolution: q, k (key width each) and v."""
        return 2 * self.linear_key_width + self.linear_value_width

    @property
    def attention(self) -> AttentionSpec:
        return AttentionSpec(q_heads=self.q_heads, kv_heads=self.kv_heads,
                             head_dim=self.head_dim)

    @property
    def recurrent(self) -> RecurrentSpec | None:
        """The per-slot state of the linear layers (float32), or None without any."""
        if not self.num_linear_layers:
            return None
        return RecurrentSpec(num_layers=self.num_linear_layers, conv_dim=self.conv_dim,
                             conv_width=self.linear_conv_kernel - 1,
                             heads=self.linear_value_heads, key_dim=self.linear_key_head_dim,
                             value_dim=self.linear_value_head_dim)

    @classmethod
    def from_hf(cls, hf_config: dict, **overrides) -> "Qwen3NextConfig":
        """Builds a config from a Qwen3-Next `config.json` (transformers 5 format).

        `layer_types` defaults, as in transformers, to a full-attention layer every
        `full_attention_interval` (4) layers; `partial_rotary_factor` (default 0.25) sets
        the rotated width. The params dtype defaults to the checkpoint's. `overrides`
        replace fields (dtype, moe_impl).

        Raises:
          ValueError: naming any setting this implementation does not support.
        """
        c = dict(hf_config)
        model_type = c.get("model_type", "qwen3_next")
        if model_type != "qwen3_next":
            raise ValueError(f"Qwen3NextConfig.from_hf: model_type {model_type!r} is not "
                             f"'qwen3_next'.")
        missing = [k for k in _REQUIRED if c.get(k) is None]
        if missing:
            raise ValueError(f"Qwen3NextConfig.from_hf: config.json lacks {missing}.")
        act = c.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"Qwen3NextConfig.from_hf: hidden_act {act!r} is not supported "
                             f"(silu).")
        n = int(c["num_hidden_layers"])
        types = c.get("layer_types")
        if types is None:
            every = int(c.get("full_attention_interval", 4))
            types = [LINEAR if (i + 1) % every else FULL for i in range(n)]
        heads = int(c["num_attention_heads"])
        head_dim = int(c.get("head_dim") or c["hidden_size"] // heads)
        rope_params = dict(c.get("rope_parameters") or {})
        partial = rope_params.pop("partial_rotary_factor",
                                  c.get("partial_rotary_factor", 0.25))
        rot = int(head_dim * float(partial))
        if rot < 2 or rot % 2:
            raise ValueError(f"Qwen3NextConfig.from_hf: partial_rotary_factor={partial} with "
                             f"head_dim={head_dim} gives a rotary width of {rot}; it must be "
                             f"even and positive.")
        rope_src = {k: v for k, v in c.items() if k not in ("rope_parameters",
                                                            "partial_rotary_factor")}
        rope_src["rope_parameters"] = rope_params
        rope = RopeConfig.from_hf(rope_src, rot)
        fields = dict(
            vocab_size=int(c["vocab_size"]), hidden_size=int(c["hidden_size"]),
            num_hidden_layers=n, layer_types=tuple(types), q_heads=heads,
            kv_heads=int(c.get("num_key_value_heads") or heads), head_dim=head_dim, rope=rope,
            attention_bias=bool(c.get("attention_bias", False)),
            linear_key_heads=int(c.get("linear_num_key_heads", 16)),
            linear_value_heads=int(c.get("linear_num_value_heads", 32)),
            linear_key_head_dim=int(c.get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(c.get("linear_value_head_dim", 128)),
            linear_conv_kernel=int(c.get("linear_conv_kernel_dim", 4)),
            intermediate_size=int(c.get("intermediate_size", 5632)),
            num_experts=int(c.get("num_experts") or 0),
            num_experts_per_tok=int(c.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(c.get("moe_intermediate_size") or 0),
            shared_expert_intermediate_size=int(c.get("shared_expert_intermediate_size") or 0),
            norm_topk_prob=bool(c.get("norm_topk_prob", True)),
            decoder_sparse_step=int(c.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(c.get("mlp_only_layers") or ()),
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            dtype=c.get("dtype") or c.get("torch_dtype") or "float32",
            architecture=(c.get("architectures") or ["Qwen3NextForCausalLM"])[0],
        )
        fields.update(overrides)
        return cls(**fields)
