"""DeepSeek-V2 / V2-Lite / V3: multi-head latent attention (MLA) and DeepSeekMoE on the paged cache.

Per token and layer the cache holds only the normalised latent c_KV
(`kv_lora_rank` wide, after `kv_a_layernorm`) and the shared rotary key
(`qk_rope_head_dim` wide, already rotated) — `LatentPages`. Attention never
decompresses the cache: W_UK (the key half of `kv_b_proj`) is absorbed into the
query, so every head scores the latent tokens directly,

    q_latent[h] = q_nope[h] @ W_UK[h]            # [kv_lora_rank]
    logit[h, s] = (q_latent[h] . c_kv[s] + q_rope[h] . k_rope[s]) * scale

and W_UV (the value half) is applied to the attention output in latent space.
Decode (`q_len == 1`) calls `kvjax.attention.mla_decode_attention`, prefill
`mla_prefill_attention`; both are MQA over one latent head.

Semantics follow transformers 5.24's `deepseek_v2` / `deepseek_v3` models:

* RoPE: DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ... (V2 always;
  V3 when `rope_interleave`, else the rotate-half layout). The rotated pairs are
  stored interleaved; transformers' V3 stores them de-interleaved, a fixed
  permutation applied to queries and keys alike, so scores are identical.
* YaRN (`kvjax.models.yarn`): cos/sin carry `attention_factor`, and the softmax
  scale is qk_head_dim**-0.5 * mscale(factor, mscale_all_dim)**2.
* `q_a_layernorm` and `kv_a_layernorm` use eps 1e-6 (transformers does not pass
  `rms_norm_eps` to them); the block norms use `rms_norm_eps`.
* Layers `< first_k_dense_replace` have a dense SwiGLU MLP, later ones MoE:
  routed experts plus `n_shared_experts` shared experts (one SwiGLU of width
  `moe_intermediate_size * n_shared_experts`). The router runs in float32.
  V2: softmax scores, `greedy` or `group_limited_greedy` (group score = max).
  V3: sigmoid scores, `noaux_tc` (choice score = score + e_score_correction_bias,
  group score = sum of the group's top two, weights from the unbiased scores).
  Weights are divided by their sum when `norm_topk_prob`, then multiplied by
  `routed_scaling_factor`. (transformers' V2 ignores `norm_topk_prob`; DeepSeek's
  own V2 code honours it; every published V2 config has it False.)

MoE dispatch (`DeepseekConfig.moe_impl`):

* "dense": every expert on every token, combined by the (mostly zero) gate
  weights — E / top_k times the useful FLOPs; weights are read once.
* "gather": each (token, choice) gathers its expert's three matrices and does a
  matrix-vector product — reads only the chosen experts, but materialises
  tokens * top_k * 3 * hidden * moe_intermediate weights; right for decode.
* "ragged": sort (token, choice) pairs by expert and run `lax.ragged_dot`
  (a grouped GEMM on TPU/GPU; on CPU XLA lowers it to a masked product over all
  experts, no cheaper than "dense").
* "auto": "gather" when 2 * tokens * top_k <= number of experts (small-batch
  decode), else "ragged" on TPU/GPU and "dense" on CPU.

Loading (`params_from_hf`) reads per-expert or fused expert tensors, and
dequantizes DeepSeek-V3's block-FP8 weights (`weight` + `weight_scale_inv`) to
the params dtype; multi-token-prediction layers past `num_hidden_layers` are
not read.

Parameters are a nested dict pytree. Layers are split in two stacked groups —
`dense_layers` (the first `first_k_dense_replace`) and `moe_layers` — each run
with `lax.scan`, so compile time does not grow with depth.

RMSNorm and SwiGLU come from `kvjax.models.layers`; DeepSeek's rotary layouts
and YaRN live here and in `kvjax.models.yarn`.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from kvjax import attention as kattn
from kvjax import cache as kcache
from kvjax.cache import PagedKVCache
from kvjax.models import layers
from kvjax.models import yarn as kyarn
from kvjax.specs import CacheSpec, MLASpec, canonical_dtype

__all__ = [
    "DeepseekConfig",
    "init_params",
    "params_from_hf",
    "cache_spec",
    "forward",
    "forward_dense",
    "mla_attention_naive",
    "ARCHITECTURES",
]

Params = dict[str, Any]

ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
_SCORING = ("softmax", "sigmoid")
_TOPK_METHODS = {"softmax": ("greedy", "group_limited_greedy"), "sigmoid": ("noaux_tc",)}
_MOE_IMPLS = ("auto", "dense", "gather", "ragged")
_PARAM_DTYPES = ("float32", "bfloat16", "float16")
# transformers builds q_a_layernorm / kv_a_layernorm without passing rms_norm_eps.
_LATENT_NORM_EPS = 1e-6


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
      rope_interleaved: DeepSeek's interleaved-pair rotary layout (V2; V3's
        `rope_interleave`), else rotate-half.
      yarn: YaRN scaling, or None for plain RoPE.
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
    rope_theta: float = 10000.0
    rope_interleaved: bool = True
    yarn: kyarn.YarnScaling | None = None
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
        for name in ("rms_norm_eps", "rope_theta"):
            if not getattr(self, name) > 0:
                raise ValueError(f"DeepseekConfig.{name} must be positive, got "
                                 f"{getattr(self, name)}.")
        if self.yarn is not None and not isinstance(self.yarn, kyarn.YarnScaling):
            raise ValueError(f"DeepseekConfig.yarn must be a YarnScaling or None, got "
                             f"{type(self.yarn).__name__}.")
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
        return self.qk_head_dim ** -0.5 * kyarn.softmax_scale_multiplier(self.yarn)

    @property
    def attention(self) -> MLASpec:
        return MLASpec(
            q_heads=self.num_heads, kv_lora_rank=self.kv_lora_rank,
            qk_rope_head_dim=self.qk_rope_head_dim, qk_nope_head_dim=self.qk_nope_head_dim,
            v_head_dim=self.v_head_dim, q_lora_rank=self.q_lora_rank,
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
        arch = (c.get("architectures") or [None])[0]
        model_type = c.get("model_type")
        if model_type is None and arch is not None:
            model_type = {"DeepseekV2ForCausalLM": "deepseek_v2",
                          "DeepseekV3ForCausalLM": "deepseek_v3"}.get(arch)
        if model_type not in ("deepseek_v2", "deepseek_v3"):
            raise ValueError(
                f"DeepseekConfig.from_hf: model_type {model_type!r} (architectures {arch!r})"
                f" is not a DeepSeek-V2/V3 model; supported architectures: {ARCHITECTURES}."
            )
        v3 = model_type == "deepseek_v3"
        for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False),
                          ("moe_layer_freq", 1)):
            if key in c and c[key] not in (want, None):
                raise ValueError(f"DeepseekConfig.from_hf: {key}={c[key]!r} is not supported "
                                 f"(only {want!r}).")
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
                             f"supported for deepseek_v3 (only 'noaux_tc').")
        theta, yarn = _rope_from_hf(c)
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
            rope_theta=theta, yarn=yarn,
            rope_interleaved=bool(c.get("rope_interleave", True)) if v3 else True,
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
        fields.update(overrides)
        return cls(**fields)


def _rope_from_hf(c: dict) -> tuple[float, kyarn.YarnScaling | None]:
    rp = c.get("rope_parameters") or {}
    if not rp:
        rp = dict(c.get("rope_scaling") or {})
        rp.setdefault("rope_theta", c.get("rope_theta", 10000.0))
    theta = float(rp.get("rope_theta") or c.get("rope_theta") or 10000.0)
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        raise ValueError(f"DeepseekConfig.from_hf: rope type {rope_type!r} is not supported "
                         f"(supported: 'default', 'yarn').")
    orig = rp.get("original_max_position_embeddings") or c.get("max_position_embeddings")
    factor = rp.get("factor")
    if factor is None:
        factor = c["max_position_embeddings"] / orig
    return theta, kyarn.YarnScaling(
        factor=float(factor), original_max_position_embeddings=int(orig),
        beta_fast=float(rp.get("beta_fast") or 32), beta_slow=float(rp.get("beta_slow") or 1),
        mscale=float(rp.get("mscale") or 0), mscale_all_dim=float(rp.get("mscale_all_dim") or 0),
        attention_factor=rp.get("attention_factor"), truncate=bool(rp.get("truncate", True)),
    )


# ---------------------------------------------------------------------------------------------
# Parameters


def _param_shapes(config: DeepseekConfig) -> Params:
    """The params pytree as nested dicts of (shape, dtype) — one source of truth for init/load."""
    c = config
    h, nh, dc, dr = c.hidden_size, c.num_heads, c.kv_lora_rank, c.qk_rope_head_dim
    dt, f32 = c.dtype, np.dtype("float32")

    def attn(n):
        a = {
            "input_norm": ((n, h), dt), "post_norm": ((n, h), dt),
            "kv_a_proj": ((n, h, dc + dr), dt), "kv_a_norm": ((n, dc), dt),
            "w_uk": ((n, nh, c.qk_nope_head_dim, dc), dt), "w_uv": ((n, nh, dc, c.v_head_dim), dt),
            "o_proj": ((n, nh * c.v_head_dim, h), dt),
        }
        if c.q_lora_rank is None:
            a["q_proj"] = ((n, h, nh * c.qk_head_dim), dt)
        else:
            a["q_a_proj"] = ((n, h, c.q_lora_rank), dt)
            a["q_a_norm"] = ((n, c.q_lora_rank), dt)
            a["q_b_proj"] = ((n, c.q_lora_rank, nh * c.qk_head_dim), dt)
        return a

    def swiglu(lead, inner):
        return {"gate": ((*lead, h, inner), dt), "up": ((*lead, h, inner), dt),
                "down": ((*lead, inner, h), dt)}

    shapes: Params = {"embed": ((c.vocab_size, h), dt), "final_norm": ((h,), dt)}
    if not c.tie_word_embeddings:
        shapes["lm_head"] = ((h, c.vocab_size), dt)
    if c.num_dense_layers:
        n = c.num_dense_layers
        shapes["dense_layers"] = {**attn(n), "mlp": swiglu((n,), c.intermediate_size)}
    if c.num_moe_layers:
        n, e, im = c.num_moe_layers, c.n_routed_experts, c.moe_intermediate_size
        moe = {"router": ((n, e, h), f32), "experts": swiglu((n, e), im)}
        if c.topk_method == "noaux_tc":
            moe["bias"] = ((n, e), f32)
        if c.n_shared_experts:
            moe["shared"] = swiglu((n,), im * c.n_shared_experts)
        shapes["moe_layers"] = {**attn(n), "moe": moe}
    return shapes


def _is_leaf(x) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], tuple)


def init_params(config: DeepseekConfig, key: jax.Array, *, std: float = 0.02) -> Params:
    """Random parameters: normal(0, std) matrices, norm weights 1, zero router bias.

    The draws come from a host NumPy generator seeded by `key`: deterministic per
    key, and far cheaper than compiling threefry for every tensor shape.
    """
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    rng = np.random.default_rng(np.asarray(key, np.uint32).ravel())
    shapes = _param_shapes(config)
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=_is_leaf)
    out = []
    for path, (shape, dtype) in flat:
        name = jax.tree_util.keystr(path)
        if "norm" in name:
            x = np.ones(shape, np.float32)
        elif "bias" in name:
            x = np.zeros(shape, np.float32)
        else:
            x = (std * rng.standard_normal(shape)).astype(np.float32)
        out.append(jnp.asarray(x).astype(dtype))
    return jax.tree.unflatten(treedef, out)


def params_from_hf(
    config: DeepseekConfig, get_tensor: Callable[[str], np.ndarray]
) -> Params:
    """Maps HuggingFace DeepSeek-V2/V3 tensors to kvjax params, one tensor at a time.

    Each stacked parameter is allocated once on the host and filled layer by
    layer, so no second full copy of the model exists at any time. Experts are
    read from either the per-expert names `save_pretrained` and the published
    checkpoints use (`mlp.experts.{e}.gate_proj.weight`, ...) or transformers 5's
    fused in-memory names (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`).

    Args:
      config: the architecture.
      get_tensor: returns the tensor stored under an HF name as a NumPy array
        (any float dtype); raises KeyError if absent.

    Returns:
      The params pytree (jax arrays in `config.dtype`; router weights float32).

    Raises:
      KeyError: naming a tensor the checkpoint lacks.
      ValueError: naming a tensor whose shape does not match the config.
    """
    shapes = _param_shapes(config)
    buffers = jax.tree.map(lambda s: np.empty(s[0], s[1]), shapes, is_leaf=_is_leaf)

    def fetch(name: str, shape: tuple[int, ...]) -> np.ndarray:
        try:
            t = get_tensor(name)
        except KeyError as e:
            raise KeyError(f"params_from_hf: checkpoint has no tensor {name!r}.") from e
        t = np.asarray(t)
        if t.shape != shape:
            raise ValueError(f"params_from_hf: tensor {name!r} has shape {t.shape}, expected "
                             f"{shape} for this config.")
        if t.dtype.name.startswith("float8"):
            t = _dequantize_fp8(name, t, get_tensor, config.fp8_block_size)
        return t

    c = config
    h, nh = c.hidden_size, c.num_heads
    dn, dv, dc = c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank

    def linear(name, out_dim, in_dim):  # HF Linear weight [out, in] -> ours [in, out]
        return fetch(name + ".weight", (out_dim, in_dim)).T

    def load_swiglu(buf, i, prefix, inner):
        buf["gate"][i] = linear(prefix + "gate_proj", inner, h)
        buf["up"][i] = linear(prefix + "up_proj", inner, h)
        buf["down"][i] = linear(prefix + "down_proj", h, inner)

    buffers["embed"][...] = fetch("model.embed_tokens.weight", (c.vocab_size, h))
    buffers["final_norm"][...] = fetch("model.norm.weight", (h,))
    if not c.tie_word_embeddings:
        buffers["lm_head"][...] = linear("lm_head", c.vocab_size, h)

    for layer in range(c.num_layers):
        moe = layer >= c.num_dense_layers
        buf = buffers["moe_layers" if moe else "dense_layers"]
        i = layer - c.num_dense_layers if moe else layer
        p = f"model.layers.{layer}."
        a = p + "self_attn."
        buf["input_norm"][i] = fetch(p + "input_layernorm.weight", (h,))
        buf["post_norm"][i] = fetch(p + "post_attention_layernorm.weight", (h,))
        if c.q_lora_rank is None:
            buf["q_proj"][i] = linear(a + "q_proj", nh * c.qk_head_dim, h)
        else:
            buf["q_a_proj"][i] = linear(a + "q_a_proj", c.q_lora_rank, h)
            buf["q_a_norm"][i] = fetch(a + "q_a_layernorm.weight", (c.q_lora_rank,))
            buf["q_b_proj"][i] = linear(a + "q_b_proj", nh * c.qk_head_dim, c.q_lora_rank)
        buf["kv_a_proj"][i] = linear(a + "kv_a_proj_with_mqa", dc + c.qk_rope_head_dim, h)
        buf["kv_a_norm"][i] = fetch(a + "kv_a_layernorm.weight", (dc,))
        kv_b = fetch(a + "kv_b_proj.weight", (nh * (dn + dv), dc)).reshape(nh, dn + dv, dc)
        buf["w_uk"][i] = kv_b[:, :dn]
        buf["w_uv"][i] = kv_b[:, dn:].transpose(0, 2, 1)
        del kv_b
        buf["o_proj"][i] = linear(a + "o_proj", h, nh * dv)
        if not moe:
            load_swiglu(buf["mlp"], i, p + "mlp.", c.intermediate_size)
            continue
        m, mb = p + "mlp.", buf["moe"]
        e, im = c.n_routed_experts, c.moe_intermediate_size
        mb["router"][i] = fetch(m + "gate.weight", (e, h))
        if "bias" in mb:
            mb["bias"][i] = fetch(m + "gate.e_score_correction_bias", (e,))
        ex = mb["experts"]
        try:
            gate_up = get_tensor(m + "experts.gate_up_proj")
        except KeyError:
            gate_up = None
        if gate_up is not None:  # transformers 5 fused layout
            gate_up = np.asarray(gate_up)
            if gate_up.shape != (e, 2 * im, h):
                raise ValueError(f"params_from_hf: tensor {m + 'experts.gate_up_proj'!r} has "
                                 f"shape {gate_up.shape}, expected {(e, 2 * im, h)}.")
            ex["gate"][i] = gate_up[:, :im].transpose(0, 2, 1)
            ex["up"][i] = gate_up[:, im:].transpose(0, 2, 1)
            del gate_up
            ex["down"][i] = fetch(m + "experts.down_proj", (e, h, im)).transpose(0, 2, 1)
        else:
            for j in range(e):
                q = f"{m}experts.{j}."
                ex["gate"][i, j] = linear(q + "gate_proj", im, h)
                ex["up"][i, j] = linear(q + "up_proj", im, h)
                ex["down"][i, j] = linear(q + "down_proj", h, im)
        if "shared" in mb:
            load_swiglu(mb["shared"], i, m + "shared_experts.", im * c.n_shared_experts)

    # One stacked tensor at a time moves to the device; its host buffer is then dropped.
    leaves, treedef = jax.tree.flatten(buffers)
    out = []
    for j in range(len(leaves)):
        out.append(jnp.asarray(leaves[j]))
        leaves[j] = None
    return jax.tree.unflatten(treedef, out)


def _dequantize_fp8(name: str, w: np.ndarray, get_tensor, block: tuple[int, int]) -> np.ndarray:
    """float32 weights from a block-quantized FP8 checkpoint tensor (DeepSeek-V3's format).

    Each `block[0] x block[1]` tile of the [out, in] weight has one float32 factor in
    `<name>_scale_inv` (despite its name, a multiplier: w = fp8 * scale_inv).
    """
    scale_name = name + "_scale_inv"
    try:
        scale = np.asarray(get_tensor(scale_name), np.float32)
    except KeyError as e:
        raise KeyError(f"params_from_hf: {name!r} is {w.dtype.name} but the checkpoint has no "
                       f"{scale_name!r} to dequantize it.") from e
    if w.ndim != 2:
        raise ValueError(f"params_from_hf: FP8 tensor {name!r} must be 2-D, got {w.shape}.")
    bo, bi = block
    want = (-(-w.shape[0] // bo), -(-w.shape[1] // bi))
    if scale.shape != want:
        raise ValueError(
            f"params_from_hf: {scale_name!r} has shape {scale.shape}; a {w.shape} weight in "
            f"{block} blocks needs {want}."
        )
    full = np.repeat(np.repeat(scale, bo, axis=0), bi, axis=1)[: w.shape[0], : w.shape[1]]
    return w.astype(np.float32) * full


def cache_spec(
    config: DeepseekConfig, *, page_size: int, num_pages: int, max_seqs: int,
    max_pages_per_seq: int, dtype: object = "float32",
) -> CacheSpec:
    """The latent-cache `CacheSpec` for this model (`LatentPages`: c_KV and k_rope per token)."""
    return CacheSpec(
        attention=config.attention, num_layers=config.num_layers, page_size=page_size,
        num_pages=num_pages, max_seqs=max_seqs, max_pages_per_seq=max_pages_per_seq,
        dtype=canonical_dtype(dtype),
    )


# ---------------------------------------------------------------------------------------------
# Layers


def _mm(x, w):
    return layers.linear(x, w, None)


def _swiglu(x, p):
    return layers.swiglu(x, p["gate"], p["up"], p["down"])


def _rope_tables(config: DeepseekConfig, positions: Int[Array, "batch q_len"]):
    """cos, sin float32[batch, q_len, rope/2] including YaRN's attention_factor."""
    inv_freq = jnp.asarray(kyarn.rope_inv_freq(config.qk_rope_head_dim, config.rope_theta,
                                               config.yarn))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    af = jnp.float32(kyarn.attention_factor(config.yarn))
    return jnp.cos(angles) * af, jnp.sin(angles) * af


def _apply_rope(x: Float[Array, "batch q_len heads rope"], cos, sin, interleaved: bool):
    """Rotates x by per-position angles; cos/sin [batch, q_len, rope/2] broadcast over heads."""
    xf = x.astype(jnp.float32)
    cos, sin = cos[:, :, None], sin[:, :, None]
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        out = out.reshape(xf.shape)
    else:
        half = xf.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
        out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def _mla_inputs(p, config: DeepseekConfig, x, cos, sin):
    """Query parts and the new latents of one layer.

    Returns q_nope [B,T,H,dn], q_rope [B,T,H,dr] (rotated), c_kv [B,T,dc]
    (normalised), k_rope [B,T,dr] (rotated).
    """
    c = config
    b, t, _ = x.shape
    if c.q_lora_rank is None:
        q = _mm(x, p["q_proj"])
    else:
        q_a = layers.rms_norm(_mm(x, p["q_a_proj"]), p["q_a_norm"], _LATENT_NORM_EPS)
        q = _mm(q_a, p["q_b_proj"])
    q = q.reshape(b, t, c.num_heads, c.qk_head_dim)
    q_nope, q_rope = q[..., :c.qk_nope_head_dim], q[..., c.qk_nope_head_dim:]
    kv = _mm(x, p["kv_a_proj"])
    c_kv = layers.rms_norm(kv[..., :c.kv_lora_rank], p["kv_a_norm"], _LATENT_NORM_EPS)
    k_rope = kv[..., c.kv_lora_rank:]
    q_rope = _apply_rope(q_rope, cos, sin, c.rope_interleaved)
    k_rope = _apply_rope(k_rope[:, :, None], cos, sin, c.rope_interleaved)[:, :, 0]
    return q_nope, q_rope, c_kv, k_rope


def _absorb_query(p, q_nope):
    """q_latent[h] = q_nope[h] @ W_UK[h]: [B,T,H,dn] -> [B,T,H,dc]."""
    return jnp.einsum("bthn,hnc->bthc", q_nope, p["w_uk"])


def _output(p, config: DeepseekConfig, out_latent):
    """W_UV per head on the latent attention output, then o_proj: [B,T,H,dc] -> [B,T,hidden]."""
    b, t = out_latent.shape[:2]
    v = jnp.einsum("bthc,hcv->bthv", out_latent, p["w_uv"])
    return _mm(v.reshape(b, t, config.num_heads * config.v_head_dim), p["o_proj"])


def _attention(p, config: DeepseekConfig, x, cos, sin, cache: PagedKVCache, layer, ctx, impl):
    """One MLA layer: write the new latents, attend in absorbed form. Returns (out, cache)."""
    slots, lengths, block_tables, q_lengths = ctx
    q_nope, q_rope, c_kv, k_rope = _mla_inputs(p, config, x, cos, sin)
    dt = cache.spec.dtype
    cache = kcache.write_layer(cache, layer, slots, c_kv.astype(dt), k_rope.astype(dt))
    # The whole latent pools plus layer=: the XLA path reads this layer's pages in its
    # gathers instead of XLA copying the layer's pool out of the scan's carry.
    pools = (cache.pages.c_kv, cache.pages.k_rope)
    q_latent = _absorb_query(p, q_nope)
    scale = config.softmax_scale
    if x.shape[1] == 1:
        out, _ = kattn.mla_decode_attention(
            q_latent[:, 0], q_rope[:, 0], *pools, lengths, block_tables,
            scale=scale, impl=impl, layer=layer,
        )
        out = out[:, None]
    else:
        out, _ = kattn.mla_prefill_attention(
            q_latent, q_rope, *pools, lengths, block_tables, q_lengths,
            scale=scale, impl=impl, layer=layer,
        )
    return _output(p, config, out.astype(x.dtype)), cache


def mla_attention_naive(
    p: Params, config: DeepseekConfig, c_kv: Float[Array, "batch seq d_c"],
    k_rope: Float[Array, "batch seq d_rope"], q_nope: Float[Array, "batch q_len q_heads d_nope"],
    q_rope: Float[Array, "batch q_len q_heads d_rope"], q_pos: Int[Array, "batch q_len"],
    lengths: Int[Array, " batch"],
) -> Float[Array, "batch q_len hidden"]:
    """MLA the textbook way, for tests: decompress K and V per head from dense latents, attend.

    Args:
      p: one layer's attention params (unstacked).
      c_kv, k_rope: dense per-sequence latents (position s at index s).
      q_nope, q_rope: queries (q_rope already rotated); query t of row b sits at q_pos[b, t]
        and sees positions <= q_pos and < lengths[b].
    Returns:
      attention output after o_proj, [batch, q_len, hidden], float32.
    """
    c = config
    f32 = jnp.float32
    kv_b_k = p["w_uk"].astype(f32)  # [H, dn, dc]
    k_nope = jnp.einsum("bsc,hnc->bshn", c_kv.astype(f32), kv_b_k)
    v = jnp.einsum("bsc,hcv->bshv", c_kv.astype(f32), p["w_uv"].astype(f32))
    logits = (jnp.einsum("bthn,bshn->bhts", q_nope.astype(f32), k_nope)
              + jnp.einsum("bthr,bsr->bhts", q_rope.astype(f32), k_rope.astype(f32)))
    logits = logits * f32(c.softmax_scale)
    s = jnp.arange(c_kv.shape[1])
    visible = (s[None, None, :] <= q_pos[:, :, None]) & (s[None, None, :] < lengths[:, None, None])
    logits = jnp.where(visible[:, None], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bhts,bshv->bthv", probs, v)
    b, t = out.shape[:2]
    return _mm(out.reshape(b, t, -1), p["o_proj"].astype(f32))


# ---------------------------------------------------------------------------------------------
# Mixture of experts


def _route(config: DeepseekConfig, logits: Float[Array, "tokens experts"], bias):
    """Top-k experts and their combine weights, float32 [tokens, k] and int32 [tokens, k]."""
    c = config
    n, e = logits.shape
    k = c.num_experts_per_tok
    if c.scoring_func == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
        choice = scores
        if c.topk_method == "group_limited_greedy":
            group_scores = scores.reshape(n, c.n_group, e // c.n_group).max(axis=-1)
            choice = jnp.where(_group_mask(group_scores, c), scores, 0.0)
        weights, idx = jax.lax.top_k(choice, k)
    else:  # sigmoid + noaux_tc
        scores = jax.nn.sigmoid(logits)
        choice = scores + bias
        top2 = jax.lax.top_k(choice.reshape(n, c.n_group, e // c.n_group), 2)[0]
        choice = jnp.where(_group_mask(top2.sum(-1), c), choice, -jnp.inf)
        idx = jax.lax.top_k(choice, k)[1]
        weights = jnp.take_along_axis(scores, idx, axis=-1)
    if c.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + jnp.float32(1e-20))
    return weights * jnp.float32(c.routed_scaling_factor), idx.astype(jnp.int32)


def _group_mask(group_scores, c: DeepseekConfig):
    """bool[tokens, experts]: experts whose group is among the topk_group best groups."""
    n = group_scores.shape[0]
    top = jax.lax.top_k(group_scores, c.topk_group)[1]
    gmask = jnp.zeros((n, c.n_group), bool).at[jnp.arange(n)[:, None], top].set(True)
    return jnp.repeat(gmask, c.n_routed_experts // c.n_group, axis=1)


def _moe_impl(config: DeepseekConfig, num_tokens: int) -> str:
    if config.moe_impl != "auto":
        return config.moe_impl
    # "gather" reads (and copies) one expert per (token, choice); "dense" reads every expert
    # once. Gathering pays off while it touches at most half of the experts.
    if 2 * num_tokens * config.num_experts_per_tok <= config.n_routed_experts:
        return "gather"
    return "dense" if jax.default_backend() == "cpu" else "ragged"


def _experts(config: DeepseekConfig, ex, x, weights, idx):
    """Routed-expert output for tokens x [N, hidden] with top-k (weights, idx)."""
    n, h = x.shape
    k, e = config.num_experts_per_tok, config.n_routed_experts
    impl = _moe_impl(config, n)
    if impl == "dense":
        dense_w = jnp.zeros((n, e), jnp.float32).at[jnp.arange(n)[:, None], idx].add(weights)
        g = jnp.einsum("nh,ehi->nei", x, ex["gate"])
        u = jnp.einsum("nh,ehi->nei", x, ex["up"])
        y = jnp.einsum("nei,eih->neh", jax.nn.silu(g) * u, ex["down"])
        return jnp.einsum("neh,ne->nh", y.astype(jnp.float32), dense_w).astype(x.dtype)
    if impl == "gather":
        flat = idx.reshape(-1)  # [N*k]
        xs = jnp.repeat(x, k, axis=0)
        g = jnp.einsum("mh,mhi->mi", xs, ex["gate"][flat])
        u = jnp.einsum("mh,mhi->mi", xs, ex["up"][flat])
        y = jnp.einsum("mi,mih->mh", jax.nn.silu(g) * u, ex["down"][flat])
        y = y.astype(jnp.float32).reshape(n, k, h) * weights[..., None]
        return y.sum(1).astype(x.dtype)
    # ragged: sort (token, choice) pairs by expert; one grouped GEMM per projection.
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // k
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    xs = x[token]
    g = jax.lax.ragged_dot(xs, ex["gate"], sizes)
    u = jax.lax.ragged_dot(xs, ex["up"], sizes)
    y = jax.lax.ragged_dot(jax.nn.silu(g) * u, ex["down"], sizes)
    y = y.astype(jnp.float32) * weights.reshape(-1)[order][:, None]
    return jnp.zeros((n, h), jnp.float32).at[token].add(y).astype(x.dtype)


def _moe(p, config: DeepseekConfig, x: Float[Array, "batch q_len hidden"]):
    b, t, h = x.shape
    xf = x.reshape(b * t, h)
    logits = _mm(xf.astype(jnp.float32), p["router"].T)
    weights, idx = _route(config, logits, p.get("bias"))
    out = _experts(config, p["experts"], xf, weights, idx)
    if "shared" in p:
        out = out + _swiglu(xf, p["shared"])
    return out.reshape(b, t, h)


# ---------------------------------------------------------------------------------------------
# Forward


def _check_forward_args(config, tokens, positions, cache, q_lengths, seq_ids):
    if tokens.ndim != 2 or positions.shape != tokens.shape:
        raise ValueError(f"forward: tokens and positions must both be [batch, q_len]; got "
                         f"{tokens.shape} and {positions.shape}.")
    for name, x in (("tokens", tokens), ("positions", positions), ("q_lengths", q_lengths)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"forward: {name} must be integer, got {x.dtype}.")
    if q_lengths.shape != (tokens.shape[0],):
        raise ValueError(f"forward: q_lengths must be [batch={tokens.shape[0]}], got "
                         f"{q_lengths.shape}.")
    spec = cache.spec
    if spec.attention != config.attention or spec.num_layers != config.num_layers:
        raise ValueError(
            f"forward: the cache was built for {spec.attention} x {spec.num_layers} layers, but "
            f"the model needs {config.attention} x {config.num_layers} layers; build it with "
            f"deepseek.cache_spec(config, ...)."
        )
    if seq_ids is None and tokens.shape[0] != spec.max_seqs:
        raise ValueError(f"forward: without seq_ids the batch must cover all max_seqs="
                         f"{spec.max_seqs} slots, got batch {tokens.shape[0]}.")
    if seq_ids is not None and seq_ids.shape != (tokens.shape[0],):
        raise ValueError(f"forward: seq_ids must be [batch={tokens.shape[0]}], got "
                         f"{seq_ids.shape}.")


def forward(
    params: Params,
    config: DeepseekConfig,
    tokens: Int[Array, "batch q_len"],
    positions: Int[Array, "batch q_len"],
    cache: PagedKVCache,
    *,
    q_lengths: Int[Array, " batch"],
    seq_ids: Int[Array, " batch"] | None = None,
    impl: str = "auto",
) -> tuple[Float[Array, "batch q_len vocab"], PagedKVCache]:
    """Runs the model on new tokens, writing their latents into the cache.

    The caller has already called `kvjax.cache.reserve` for these tokens: token
    t of row b goes to cache position `lengths[seq_b] - q_lengths[b] + t`.
    Pure; jit it with `config` static and the cache donated.

    Args:
      params: from `init_params` / `params_from_hf`.
      config: the architecture (static).
      tokens: int32[batch, q_len]; positions t >= q_lengths[b] are padding.
      positions: int32[batch, q_len] RoPE positions.
      cache: a latent cache from `cache_spec(config, ...)` (donate it under jit).
      q_lengths: int32[batch] real tokens per row.
      seq_ids: int32[batch] cache slots of the rows (None: all slots in order).
      impl: attention implementation, one of `kvjax.attention.IMPLS`.

    Returns:
      (float32 logits [batch, q_len, vocab], updated cache).
    """
    _check_forward_args(config, tokens, positions, cache, q_lengths, seq_ids)
    b, t = tokens.shape
    q_lengths = q_lengths.astype(jnp.int32)
    lengths = cache.lengths if seq_ids is None else cache.lengths[seq_ids]
    block_tables = cache.block_tables if seq_ids is None else cache.block_tables[seq_ids]
    steps = jnp.arange(t, dtype=jnp.int32)[None, :]
    valid = steps < q_lengths[:, None]
    cache_pos = lengths[:, None] - q_lengths[:, None] + steps
    slots = kcache.token_slots(cache, cache_pos, valid, seq_ids)
    ctx = (slots, lengths, block_tables, q_lengths)
    cos, sin = _rope_tables(config, positions)

    x = params["embed"][tokens]
    eps = config.rms_norm_eps

    def block(mlp_fn, offset):
        def body(carry, xs):
            x, cache = carry
            p, i = xs
            attn, cache = _attention(p, config, layers.rms_norm(x, p["input_norm"], eps), cos, sin,
                                     cache, offset + i, ctx, impl)
            x = x + attn
            x = x + mlp_fn(p, layers.rms_norm(x, p["post_norm"], eps))
            return (x, cache), None
        return body

    if config.num_dense_layers:
        n = config.num_dense_layers
        body = block(lambda p, h: _swiglu(h, p["mlp"]), 0)
        (x, cache), _ = jax.lax.scan(body, (x, cache),
                                     (params["dense_layers"], jnp.arange(n, dtype=jnp.int32)))
    if config.num_moe_layers:
        n = config.num_moe_layers
        body = block(lambda p, h: _moe(p["moe"], config, h), config.num_dense_layers)
        (x, cache), _ = jax.lax.scan(body, (x, cache),
                                     (params["moe_layers"], jnp.arange(n, dtype=jnp.int32)))

    x = layers.rms_norm(x, params["final_norm"], eps)
    head = params["embed"].T if config.tie_word_embeddings else params["lm_head"]
    logits = _mm(x, head).astype(jnp.float32)
    return logits, cache


def forward_dense(
    params: Params,
    config: DeepseekConfig,
    tokens: Int[Array, "batch seq"],
) -> Float[Array, "batch seq vocab"]:
    """Cache-free causal forward over whole sequences (training and reference scoring).

    The same params as `forward` (token t at position t); attention decompresses
    K and V from the latents per head (`mla_attention_naive`), the cheaper form
    when every token is a query.

    Args:
      params: from `init_params` / `params_from_hf`.
      config: the architecture (static).
      tokens: int32[batch, seq].

    Returns:
      float32 logits [batch, seq, vocab].
    """
    if tokens.ndim != 2:
        raise ValueError(f"forward_dense: tokens must be [batch, seq], got {tokens.shape}.")
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    lengths = jnp.full((b,), t, jnp.int32)
    cos, sin = _rope_tables(config, positions)
    eps = config.rms_norm_eps
    x = params["embed"][tokens]

    def block(mlp_fn):
        def body(x, p):
            h = layers.rms_norm(x, p["input_norm"], eps)
            q_nope, q_rope, c_kv, k_rope = _mla_inputs(p, config, h, cos, sin)
            attn = mla_attention_naive(p, config, c_kv, k_rope, q_nope, q_rope, positions,
                                       lengths)
            x = x + attn.astype(x.dtype)
            return x + mlp_fn(p, layers.rms_norm(x, p["post_norm"], eps)), None
        return body

    if config.num_dense_layers:
        x, _ = jax.lax.scan(block(lambda p, h: _swiglu(h, p["mlp"])), x, params["dense_layers"])
    if config.num_moe_layers:
        x, _ = jax.lax.scan(block(lambda p, h: _moe(p["moe"], config, h)), x,
                            params["moe_layers"])
    x = layers.rms_norm(x, params["final_norm"], eps)
    head = params["embed"].T if config.tie_word_embeddings else params["lm_head"]
    return _mm(x, head).astype(jnp.float32)
