"""The Llama family on a paged cache: Llama 2/3/3.1, Mistral, Qwen2, Qwen3 (MHA, GQA, MQA).

The variants differ only in switches of `LlamaConfig`: q/k/v (and o) biases
(Qwen2), per-head q/k RMSNorm (Qwen3), a sliding attention window (Mistral,
Qwen2/3 "sliding_attention" layers), RoPE scaling (Llama-3.1) and tied
embeddings. Params are a frozen dataclass pytree whose per-layer tensors are
stacked along a leading `layers` axis, so the layers run as one `lax.scan`
(one compiled layer body) when every layer has the same attention window.
`unstack_layers` gives the same weights as one array per layer (a tuple), which
`forward` runs as an unrolled loop: on CPU the decode loop uses it for big
models, since XLA:CPU copies a scan's slice of the stacked weights every step.

`forward` follows the model contract (`kvjax.models.base`): the caller has
already reserved the new tokens in the cache; each layer writes its K/V with
`kvjax.cache.write` and attends with `kvjax.cache.attend` — the only two cache
operations a model calls, whatever the page kind, policy or backend.
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from kvjax import cache as kv_cache
from kvjax.models.base import Packing, check_logits_at, check_packing, gather_positions
from kvjax.models.layers import (
    RopeConfig,
    apply_rope,
    embed_rows,
    layer_params,
    linear,
    rms_norm,
    rope_cos_sin,
    swiglu,
)
from kvjax.specs import AttentionSpec, CacheSpec, canonical_dtype

__all__ = [
    "LlamaConfig",
    "LlamaParams",
    "LlamaLayerParams",
    "init_params",
    "params_from_hf",
    "cache_spec",
    "forward",
    "forward_dense",
    "unstack_layers",
    "ARCHITECTURES",
]

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                 "Qwen3ForCausalLM")
_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_PARAM_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Geometry and switches of a Llama-family model (hashable: a static jit argument).

    Attributes:
      vocab_size, hidden_size, intermediate_size, num_layers: the usual sizes.
      q_heads, kv_heads, head_dim: attention geometry (head_dim may differ from
        hidden_size // q_heads, as in Qwen3).
      rope: rotary settings, including Llama-3.1 scaling.
      rms_norm_eps: epsilon of every RMSNorm.
      qkv_bias: q/k/v projections have a bias (Qwen2; Llama `attention_bias`).
      o_bias: the output projection has a bias (Llama `attention_bias`).
      mlp_bias: the MLP projections have biases (Llama `mlp_bias`).
      qk_norm: per-head RMSNorm of q and k before RoPE (Qwen3).
      sliding_windows: per layer, the attention window (a query at p sees keys
        k with p - k < window) or None for full attention; None = all full.
      tie_word_embeddings: the LM head is the embedding matrix.
      dtype: params and activations dtype ("float32", "bfloat16", "float16").
      architecture: the HF architecture name this config came from.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    rope: RopeConfig
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_windows: tuple[int | None, ...] | None = None
    tie_word_embeddings: bool = False
    dtype: str = "float32"
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "q_heads",
                     "kv_heads", "head_dim"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {v!r}.")
        AttentionSpec(q_heads=self.q_heads, kv_heads=self.kv_heads, head_dim=self.head_dim)
        if not isinstance(self.rope, RopeConfig):
            raise ValueError(f"LlamaConfig.rope must be a RopeConfig, got {self.rope!r}.")
        if self.rope.dim != self.head_dim:
            raise ValueError(
                f"LlamaConfig: rope.dim={self.rope.dim} must equal head_dim={self.head_dim}."
            )
        if self.sliding_windows is not None:
            windows = tuple(self.sliding_windows)
            if len(windows) != self.num_layers or any(
                w is not None and (not isinstance(w, int) or w < 1) for w in windows
            ):
                raise ValueError(
                    f"LlamaConfig.sliding_windows must hold num_layers={self.num_layers} "
                    f"entries, each an int >= 1 or None; got {self.sliding_windows!r}."
                )
            object.__setattr__(self, "sliding_windows", windows)
        dtype = canonical_dtype(self.dtype).name
        if dtype not in _PARAM_DTYPES:
            raise ValueError(f"LlamaConfig.dtype must be one of {_PARAM_DTYPES}, got {dtype}.")
        object.__setattr__(self, "dtype", dtype)

    @property
    def attention(self) -> AttentionSpec:
        return AttentionSpec(q_heads=self.q_heads, kv_heads=self.kv_heads,
                             head_dim=self.head_dim)

    def window(self, layer: int) -> int | None:
        return None if self.sliding_windows is None else self.sliding_windows[layer]

    @classmethod
    def from_hf(cls, hf_config: dict, dtype: str | None = None) -> "LlamaConfig":
        """Builds the config from a HF `config.json` dict (llama, mistral, qwen2, qwen3).

        Args:
          hf_config: the parsed config.json.
          dtype: params dtype; default the checkpoint's `dtype`/`torch_dtype`, else float32.

        Raises:
          ValueError: naming an unsupported model_type, activation or rope setting.
        """
        model_type = hf_config.get("model_type", "llama")
        if model_type not in _MODEL_TYPES:
            raise ValueError(
                f"LlamaConfig.from_hf: model_type {model_type!r} is not a Llama-family type; "
                f"supported: {_MODEL_TYPES}."
            )
        act = hf_config.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"LlamaConfig.from_hf: hidden_act {act!r} is not supported (silu).")
        hidden = int(hf_config["hidden_size"])
        q_heads = int(hf_config["num_attention_heads"])
        kv_heads = int(hf_config.get("num_key_value_heads") or q_heads)
        head_dim = int(hf_config.get("head_dim") or hidden // q_heads)
        num_layers = int(hf_config["num_hidden_layers"])
        attention_bias = bool(hf_config.get("attention_bias", False))
        windows = None
        window = hf_config.get("sliding_window")
        if model_type == "mistral" and window is not None:
            windows = (int(window),) * num_layers
        elif model_type in ("qwen2", "qwen3"):
            window = window if hf_config.get("use_sliding_window", False) else None
            layer_types = hf_config.get("layer_types") or [
                "sliding_attention" if window is not None
                and i >= hf_config.get("max_window_layers", 28) else "full_attention"
                for i in range(num_layers)
            ]
            if window is not None and "sliding_attention" in layer_types:
                windows = tuple(int(window) if t == "sliding_attention" else None
                                for t in layer_types)
        if dtype is None:
            dtype = hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32"
        archs = hf_config.get("architectures") or ["LlamaForCausalLM"]
        return cls(
            vocab_size=int(hf_config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf_config["intermediate_size"]),
            num_layers=num_layers,
            q_heads=q_heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            rope=RopeConfig.from_hf(hf_config, head_dim),
            rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=False if model_type == "qwen2" else attention_bias,
            mlp_bias=bool(hf_config.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_windows=windows,
            tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
            dtype=dtype,
            architecture=archs[0],
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LlamaLayerParams:
    """Every layer's weights, stacked on a leading `layers` axis; projections are [in, out].

    Optional tensors (biases, q/k norms) are None when the config turns them off.
    """

    attn_norm: Float[Array, "layers hidden"]
    wq: Float[Array, "layers hidden q_width"]
    wk: Float[Array, "layers hidden kv_width"]
    wv: Float[Array, "layers hidden kv_width"]
    wo: Float[Array, "layers q_width hidden"]
    mlp_norm: Float[Array, "layers hidden"]
    w_gate: Float[Array, "layers hidden inter"]
    w_up: Float[Array, "layers hidden inter"]
    w_down: Float[Array, "layers inter hidden"]
    bq: Float[Array, "layers q_width"] | None = None
    bk: Float[Array, "layers kv_width"] | None = None
    bv: Float[Array, "layers kv_width"] | None = None
    bo: Float[Array, "layers hidden"] | None = None
    q_norm: Float[Array, "layers head_dim"] | None = None
    k_norm: Float[Array, "layers head_dim"] | None = None
    b_gate: Float[Array, "layers inter"] | None = None
    b_up: Float[Array, "layers inter"] | None = None
    b_down: Float[Array, "layers hidden"] | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LlamaParams:
    """Embedding, stacked layers, final norm and LM head ([hidden, vocab]; None when tied).

    `layers` may also be a tuple of per-layer params without the leading axis
    (`unstack_layers`).
    """

    embed: Float[Array, "vocab hidden"]
    layers: LlamaLayerParams | tuple[LlamaLayerParams, ...]
    final_norm: Float[Array, " hidden"]
    lm_head: Float[Array, "hidden vocab"] | None = None


def unstack_layers(params: LlamaParams) -> LlamaParams:
    """The same weights with `layers` as a tuple of per-layer `LlamaLayerParams`.

    `forward` runs such params as an unrolled loop over the layers. On CPU this is
    the faster form for decoding: XLA:CPU copies each step's slice of stacked
    weights out of the stack inside a `lax.scan` (a read and a write of every layer
    weight per token), while separate arrays are read in place. The result holds a
    copy of the layer weights (stacked params that stay referenced double their
    memory); params already unstacked are returned as they are.
    """
    if isinstance(params.layers, tuple):
        return params
    num_layers = jax.tree.leaves(params.layers)[0].shape[0]
    layers = tuple(jax.tree.map(lambda p, i=i: p[i], params.layers) for i in range(num_layers))
    return dataclasses.replace(params, layers=layers)


def _param_shapes(config: LlamaConfig) -> dict:
    """name -> (shape, HF name pattern, transpose) for every tensor the config uses."""
    c = config
    L, h, qw, kw = c.num_layers, c.hidden_size, c.q_heads * c.head_dim, c.kv_heads * c.head_dim
    i = c.intermediate_size
    p = "model.layers.{}."
    layer = {
        "attn_norm": ((L, h), p + "input_layernorm.weight", False),
        "wq": ((L, h, qw), p + "self_attn.q_proj.weight", True),
        "wk": ((L, h, kw), p + "self_attn.k_proj.weight", True),
        "wv": ((L, h, kw), p + "self_attn.v_proj.weight", True),
        "wo": ((L, qw, h), p + "self_attn.o_proj.weight", True),
        "mlp_norm": ((L, h), p + "post_attention_layernorm.weight", False),
        "w_gate": ((L, h, i), p + "mlp.gate_proj.weight", True),
        "w_up": ((L, h, i), p + "mlp.up_proj.weight", True),
        "w_down": ((L, i, h), p + "mlp.down_proj.weight", True),
    }
    if c.qkv_bias:
        layer["bq"] = ((L, qw), p + "self_attn.q_proj.bias", False)
        layer["bk"] = ((L, kw), p + "self_attn.k_proj.bias", False)
        layer["bv"] = ((L, kw), p + "self_attn.v_proj.bias", False)
    if c.o_bias:
        layer["bo"] = ((L, h), p + "self_attn.o_proj.bias", False)
    if c.qk_norm:
        layer["q_norm"] = ((L, c.head_dim), p + "self_attn.q_norm.weight", False)
        layer["k_norm"] = ((L, c.head_dim), p + "self_attn.k_norm.weight", False)
    if c.mlp_bias:
        layer["b_gate"] = ((L, i), p + "mlp.gate_proj.bias", False)
        layer["b_up"] = ((L, i), p + "mlp.up_proj.bias", False)
        layer["b_down"] = ((L, h), p + "mlp.down_proj.bias", False)
    top = {
        "embed": ((c.vocab_size, h), "model.embed_tokens.weight", False),
        "final_norm": ((h,), "model.norm.weight", False),
    }
    if not c.tie_word_embeddings:
        top["lm_head"] = ((h, c.vocab_size), "lm_head.weight", True)
    return {"layers": layer, **top}


def init_params(config: LlamaConfig, key: jax.Array) -> LlamaParams:
    """Random params (normal(0, 0.02) weights, norms near 1, small biases) for tests."""
    shapes = _param_shapes(config)
    dtype = jnp.dtype(config.dtype)
    names = [("layers", n) for n in shapes["layers"]] + [(n, None) for n in shapes
                                                         if n != "layers"]
    keys = jax.random.split(key, len(names))

    def draw(k, name, shape):
        if "norm" in name:
            return (1.0 + 0.1 * jax.random.normal(k, shape, jnp.float32)).astype(dtype)
        return (0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dtype)

    layer, top = {}, {}
    for k, (group, name) in zip(keys, names, strict=True):
        if group == "layers":
            layer[name] = draw(k, name, shapes["layers"][name][0])
        else:
            top[group] = draw(k, group, shapes[group][0])
    return LlamaParams(layers=LlamaLayerParams(**layer), **top)


def params_from_hf(config: LlamaConfig, get_tensor: Callable[[str], np.ndarray]) -> LlamaParams:
    """Maps HF tensors to `LlamaParams`, one tensor at a time.

    Each stacked parameter is assembled in one host buffer, layer by layer,
    moved to the device, and the buffer dropped before the next one: peak host
    memory is one stacked parameter, and the device never holds two copies.

    Args:
      config: the model config.
      get_tensor: returns the HF tensor with the given name as a NumPy array
        (any float dtype); raises KeyError naming a missing tensor.

    Raises:
      KeyError: naming a missing tensor. ValueError: naming a tensor of the wrong shape.
    """
    shapes = _param_shapes(config)
    dtype = jnp.dtype(config.dtype)

    def fetch(name, shape, transpose):
        x = np.asarray(get_tensor(name))
        x = x.T if transpose else x
        if x.shape != shape:
            raise ValueError(
                f"tensor {name!r} has shape {x.shape}{' after transposing' if transpose else ''}"
                f", expected {shape} for this config."
            )
        return x

    layer = {}
    for pname, (shape, pattern, transpose) in shapes["layers"].items():
        buf = np.empty(shape, dtype)
        for i in range(config.num_layers):
            buf[i] = fetch(pattern.format(i), shape[1:], transpose)
        layer[pname] = jax.device_put(buf)  # no conversion program per shape
        del buf
    top = {}
    for pname, entry in shapes.items():
        if pname != "layers":
            shape, hf_name, transpose = entry
            top[pname] = jax.device_put(fetch(hf_name, shape, transpose).astype(dtype))
    return LlamaParams(layers=LlamaLayerParams(**layer), **top)


def cache_spec(config: LlamaConfig, *, page_size: int, num_pages: int, max_seqs: int,
               max_pages_per_seq: int, dtype="float32") -> CacheSpec:
    """The `CacheSpec` of a paged K/V cache for this model."""
    return CacheSpec(attention=config.attention, num_layers=config.num_layers,
                     page_size=page_size, num_pages=num_pages, max_seqs=max_seqs,
                     max_pages_per_seq=max_pages_per_seq, dtype=dtype)


def _layer(config, lp: LlamaLayerParams, layer, x, cos, sin, cache, seq_ids, q_lengths, window,
           impl, select=None, packing=None):
    """One decoder layer: attention over the paged cache, then the MLP. Returns (x, cache, q).
    With `packing`, x holds sequences end to end in one row; the cache sees them as rows."""
    c = config
    batch, q_len, _ = x.shape
    h = rms_norm(x, lp.attn_norm, c.rms_norm_eps)
    q = linear(h, lp.wq, lp.bq).reshape(batch, q_len, c.q_heads, c.head_dim)
    k = linear(h, lp.wk, lp.bk).reshape(batch, q_len, c.kv_heads, c.head_dim)
    v = linear(h, lp.wv, lp.bv).reshape(batch, q_len, c.kv_heads, c.head_dim)
    if c.qk_norm:
        q = rms_norm(q, lp.q_norm, c.rms_norm_eps)
        k = rms_norm(k, lp.k_norm, c.rms_norm_eps)
    q = apply_rope(q, cos, sin)
    k = apply_rope(k, cos, sin)
    rows = dict(q_lengths=q_lengths, seq_ids=seq_ids)
    if packing is not None:
        q, k, v = packing.lanes(q), packing.lanes(k), packing.lanes(v)
    cache = kv_cache.write(cache, layer, k, v, **rows)
    # A policy's page selection (Quest, PyramidKV's layer budgets) applies to decode.
    selection = select(cache, layer, q[:, 0]) if select is not None and q_len == 1 else None
    out, _ = kv_cache.attend(cache, layer, q, selection=selection, scale=c.head_dim ** -0.5,
                             sliding_window=window, impl=impl, **rows)
    if packing is not None:
        out = packing.packed(out.astype(x.dtype))  # rounded first: rows copied at 16 bits
    x = x + linear(out.astype(x.dtype).reshape(batch, q_len, -1), lp.wo, lp.bo)
    h = rms_norm(x, lp.mlp_norm, c.rms_norm_eps)
    x = x + swiglu(h, lp.w_gate, lp.w_up, lp.w_down, lp.b_gate, lp.b_up, lp.b_down)
    return x, cache, q


def _lm_head(params: LlamaParams, x: Float[Array, "batch seq hidden"], dtype
             ) -> Float[Array, "batch seq vocab"]:
    """Logits rounded to `dtype`, as float32: x @ lm_head through `linear` (the CPU
    small-M kernel in decode, which rounds in place: no bf16 array widened again).

    Tied embeddings contract with the [vocab, hidden] table as stored: routing `embed.T`
    through the kernel would make XLA copy the transposed table every call.
    """
    if params.lm_head is None:
        return jnp.einsum("bth,vh->btv", x, params.embed.astype(dtype)).astype(jnp.float32)
    return linear(x.astype(dtype), params.lm_head, None, widen=True)


def forward(
    params: LlamaParams,
    config: LlamaConfig,
    tokens: Int[Array, "batch q_len"],
    positions: Int[Array, "batch q_len"],
    cache: kv_cache.PagedKVCache,
    *,
    q_lengths: Int[Array, " batch"],
    seq_ids: Int[Array, " batch"] | None = None,
    impl="auto",
    select: Callable | None = None,
    observe: bool = False,
    logits_at: Int[Array, "batch k"] | None = None,
    packing: Packing | None = None,
):
    """Runs the model on new tokens whose cache slots are already reserved.

    Args:
      params: the model params.
      config: the model config (static under jit).
      tokens: int32[batch, q_len]; entries t >= q_lengths[b] are padding.
      positions: int32[batch, q_len] RoPE positions of the tokens.
      cache: a cache of any page kind built for this model's attention geometry;
        `cache.lengths[seq]` already counts the new tokens, and token t of row b goes to
        position `lengths[seq_b] - q_lengths[b] + t`. Pure function: jit it with the
        cache donated to update the pools in place.
      q_lengths: int32[batch], real tokens per row.
      seq_ids: int32[batch] cache slots of the rows; None = every slot in order.
      impl: attention implementation (`kvjax.attention.IMPLS` or a `ShardedAttention`).
      select: optional `select(cache, layer, q [batch, q_heads, head_dim]) -> Selection |
        None`, the pages each layer's decode attention reads (a cache policy's
        `before_attention`, wrapped by the decode loop).
      observe: also return the post-RoPE queries of every layer (for cache policies).
      logits_at: int32[batch, k], token indices (in [0, q_len)) of each row at which to
        compute logits; None: every token. The final norm and the LM head then run on k
        rows per sequence instead of q_len (a prefill chunk needs only its last prompt
        token's). Out-of-range indices give NaN logits (`kvjax.models.base.gather_positions`).

    Returns:
      (float32 logits [batch, q_len, vocab] (or [batch, k, vocab] with `logits_at`), the
      cache with the new K/V written), plus, with `observe`, the queries of every layer
      [layers, batch, q_len, q_heads, head_dim].

    With `packing` (`kvjax.models.base.Packing`), tokens and positions are one row [1,
    tokens] holding several sequences end to end, and `q_lengths` and `seq_ids` (required)
    are per sequence; `logits_at` indexes the row (`[1, k]`). Not with `observe`.
    """
    c = config
    if tokens.ndim != 2 or positions.shape != tokens.shape:
        raise ValueError(
            f"forward: tokens and positions must both be [batch, q_len]; got {tokens.shape} "
            f"and {positions.shape}."
        )
    if cache.spec.attention != c.attention or cache.spec.num_layers != c.num_layers:
        raise ValueError(
            f"forward: the cache was built for {cache.spec.attention} x {cache.spec.num_layers} "
            f"layers, the model needs {c.attention} x {c.num_layers} layers."
        )
    check_logits_at(logits_at, tokens.shape)
    dtype = jnp.dtype(c.dtype)
    q_lengths = jnp.asarray(q_lengths, jnp.int32)
    if packing is not None:
        check_packing(packing, tokens.shape, q_lengths, seq_ids, observe)
    cos, sin = rope_cos_sin(positions, c.rope, dtype)
    x = embed_rows(params.embed, tokens).astype(dtype)
    args = dict(cos=cos, sin=sin, seq_ids=seq_ids, q_lengths=q_lengths, impl=impl, select=select,
                packing=packing)

    windows = c.sliding_windows or (None,) * c.num_layers
    if isinstance(params.layers, tuple):
        # Per-layer weights (`unstack_layers`): an unrolled loop, no slicing.
        queries = []
        for layer, lp in enumerate(params.layers):
            x, cache, q = _layer(c, lp, layer, x, cache=cache, window=windows[layer], **args)
            queries.append(q)
        queries = jnp.stack(queries) if observe else None
    elif len(set(windows)) == 1:
        # One compiled layer body for all layers.
        def body(carry, layer):
            x, cache = carry
            # Matrices stay in the stack (LayerSlice): the CPU matmul kernel reads them
            # in place; a scan over the stacked params would copy each layer's slice.
            lp = layer_params(params.layers, layer)
            x, cache, q = _layer(c, lp, layer, x, cache=cache, window=windows[0], **args)
            return (x, cache), (q if observe else None)

        (x, cache), queries = jax.lax.scan(
            body, (x, cache), jnp.arange(c.num_layers, dtype=jnp.int32))
    else:
        queries = []
        for layer in range(c.num_layers):
            lp = layer_params(params.layers, layer)
            x, cache, q = _layer(c, lp, layer, x, cache=cache, window=windows[layer], **args)
            queries.append(q)
        queries = jnp.stack(queries) if observe else None
    if logits_at is not None:
        x = gather_positions(x, logits_at)
    x = rms_norm(x, params.final_norm, c.rms_norm_eps)
    logits = _lm_head(params, x, dtype)
    if observe:
        return logits, cache, queries
    return logits, cache


def forward_dense(
    params: LlamaParams,
    config: LlamaConfig,
    tokens: Int[Array, "batch seq"],
) -> Float[Array, "batch seq vocab"]:
    """Cache-free causal forward over whole sequences (training and reference scoring).

    The same params and numerics as `forward` (token t sits at position t), with
    dense causal attention instead of the paged cache: for training, where no
    cache is wanted.

    Args:
      params: the model params.
      config: the model config (static under jit).
      tokens: int32[batch, seq].

    Returns:
      float32 logits [batch, seq, vocab].
    """
    c = config
    if tokens.ndim != 2:
        raise ValueError(f"forward_dense: tokens must be [batch, seq], got {tokens.shape}.")
    batch, seq = tokens.shape
    dtype = jnp.dtype(c.dtype)
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    cos, sin = rope_cos_sin(positions, c.rope, dtype)
    x = embed_rows(params.embed, tokens).astype(dtype)
    group = c.q_heads // c.kv_heads
    distance = jnp.arange(seq)[:, None] - jnp.arange(seq)[None, :]  # query - key

    def layer_fn(x, lp, window):
        h = rms_norm(x, lp.attn_norm, c.rms_norm_eps)
        q = linear(h, lp.wq, lp.bq).reshape(batch, seq, c.q_heads, c.head_dim)
        k = linear(h, lp.wk, lp.bk).reshape(batch, seq, c.kv_heads, c.head_dim)
        v = linear(h, lp.wv, lp.bv).reshape(batch, seq, c.kv_heads, c.head_dim)
        if c.qk_norm:
            q = rms_norm(q, lp.q_norm, c.rms_norm_eps)
            k = rms_norm(k, lp.k_norm, c.rms_norm_eps)
        q = apply_rope(q, cos, sin).reshape(batch, seq, c.kv_heads, group, c.head_dim)
        k = apply_rope(k, cos, sin)
        logits = jnp.einsum("btkgd,bskd->bkgts", q.astype(jnp.float32), k.astype(jnp.float32))
        logits = logits * jnp.float32(c.head_dim ** -0.5)
        visible = distance >= 0
        if window is not None:
            visible = visible & (distance < window)
        logits = jnp.where(visible, logits, -jnp.inf)
        probs = jax.nn.softmax(logits, axis=-1)
        out = jnp.einsum("bkgts,bskd->btkgd", probs, v.astype(jnp.float32))
        x = x + linear(out.astype(x.dtype).reshape(batch, seq, -1), lp.wo, lp.bo)
        h = rms_norm(x, lp.mlp_norm, c.rms_norm_eps)
        return x + swiglu(h, lp.w_gate, lp.w_up, lp.w_down, lp.b_gate, lp.b_up, lp.b_down)

    windows = c.sliding_windows or (None,) * c.num_layers
    if isinstance(params.layers, tuple):
        for layer, lp in enumerate(params.layers):
            x = layer_fn(x, lp, windows[layer])
    elif len(set(windows)) == 1:
        x, _ = jax.lax.scan(lambda x, lp: (layer_fn(x, lp, windows[0]), None), x, params.layers)
    else:
        for layer in range(c.num_layers):
            lp = jax.tree.map(lambda p, i=layer: p[i], params.layers)
            x = layer_fn(x, lp, windows[layer])
    x = rms_norm(x, params.final_norm, c.rms_norm_eps)
    return _lm_head(params, x, dtype)
