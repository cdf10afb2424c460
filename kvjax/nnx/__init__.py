"""Flax NNX on kvjax's cache: a cache holder module, an attention entry, and a driver.

    cache = kvnnx.PagedCache()                      # one nnx.Cache: the whole kvjax cache
    kvnnx.adapt(model, cache)                       # nnx.MultiHeadAttention -> paged, in place
    model_, params = kvnnx.as_model(model, vocab_size=V)
    result = kvjax.generate.generate(model_, params, prompts, key=..., max_new_tokens=32,
                                     cache=CacheConfig(quant=QuantSpec(bits=4)))

Pieces:
  * `PagedCache`: an NNX module whose one `nnx.Cache` variable holds kvjax's cache pytree
    (any page kind, sharding plan, host tier), shared by every layer; `reserve`, `fork`
    and `free` update it in place. During a forward it also carries the step's positions,
    rows and attention settings (`PagedCache.step`), which the layers read.
  * `attention(cache, layer, q, k, v, ...)`: what an NNX layer calls in place of its
    dense cache update and attention: writes the layer's new K/V, then attends its
    queries over the pages (scale, soft cap, window; a policy's page selection).
  * `PagedAttention`: an NNX attention module (projections, optional RoPE) for new models.
  * `adapt(model, cache)`: replaces every `nnx.MultiHeadAttention` of an existing model,
    in place, by `PagedMultiHeadAttention`, which reuses its projection modules (weights);
    `adapt(model, target=..., build=...)` does it for a model's own attention class
    (`kvjax.nnx.tunix` holds the builds for tunix's published models).
  * `PagedLayer`: the base of every paged attention module (its cache, layer, geometry).
  * `as_model(module)`: the module as a `kvjax.models.Model` plus its params (the
    `nnx.State` from `nnx.split`), so `kvjax.generate` (prefill, the jitted decode loop
    with the cache donated, sampling, `sample_n`, `beam_search`, policies, sharding
    plans) and `kvjax.serve.Engine` drive it — the one engine, not a second loop.
    `generate(module, ...)` is `as_model` plus `kvjax.generate.generate`, with the
    holder's own cache used and updated when it holds one.

A layer's per-layer index is the `layer` it was given (adapt numbers the attention
modules in graph order). Layers must run as a Python loop (not `nnx.scan`), since
the cache is written per layer index.
"""

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

try:
    from flax import nnx
except ImportError as err:  # the optional extra
    raise ImportError("kvjax.nnx needs Flax NNX: pip install 'kvjax[flax]' (flax>=0.12.8)."
                      ) from err
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kvjax import cache as kv_cache
from kvjax.cache.page_table import AllocStatus
from kvjax.generate import loop
from kvjax.generate.setup import CacheConfig
from kvjax.models.base import Model, check_logits_at, gather_positions
from kvjax.rope import RopeConfig, apply_rope, rope_cos_sin
from kvjax.specs import AttentionSpec, CacheSpec

__all__ = ["PagedCache", "PagedLayer", "PagedAttention", "PagedMultiHeadAttention", "NNXConfig",
           "attention", "adapt", "as_model", "generate"]


@dataclasses.dataclass(frozen=True)
class _Step:
    """One forward's rows and settings (trace-time only)."""

    positions: Int[Array, "batch q_len"]
    q_lengths: Int[Array, " batch"]
    seq_ids: Int[Array, " batch"] | None
    impl: Any
    select: Callable | None
    queries: dict | None  # layer -> queries, when a policy observes them


class _StepBox:
    """A mutable slot for the current `_Step`: a static attribute of `PagedCache`, so
    setting it never changes the module's graph (hashed by identity)."""

    def __init__(self):
        self.step: _Step | None = None


class PagedCache(nnx.Module):
    """kvjax's paged cache as one NNX variable, shared by every attention layer of a model.

    Attributes:
      kv: `nnx.Cache` holding a `kvjax.cache.PagedKVCache` (any page kind, laid out for a
        sharding plan or with a host tier), or None before one is set.
    """

    def __init__(self, cache: kv_cache.PagedKVCache | None = None):
        if cache is not None and not isinstance(cache, kv_cache.PagedKVCache):
            raise TypeError(f"PagedCache takes a kvjax PagedKVCache or None, got "
                            f"{type(cache).__name__}.")
        self.kv = nnx.Cache(cache)
        self._box = _StepBox()

    @classmethod
    def from_spec(cls, spec: CacheSpec) -> "PagedCache":
        """A holder with an empty cache built from `spec` (`kvjax.cache.init_cache`)."""
        return cls(kv_cache.init_cache(spec))

    @property
    def cache(self) -> kv_cache.PagedKVCache:
        value = self.kv.get_value()
        if value is None:
            raise ValueError("PagedCache holds no cache yet: build it with PagedCache."
                             "from_spec(spec) or call holder.set_cache(kvjax.cache.init_cache("
                             "spec)).")
        return value

    def set_cache(self, value: kv_cache.PagedKVCache | None) -> None:
        """Replaces the held cache (None: hold none)."""
        if value is not None and not isinstance(value, kv_cache.PagedKVCache):
            raise TypeError(f"PagedCache.cache must be a kvjax PagedKVCache or None, got "
                            f"{type(value).__name__}.")
        self.kv.set_value(value)

    def reserve(self, num_new: Int[Array, " max_seqs"]) -> AllocStatus:
        """`kvjax.cache.reserve` on the held cache (donated; the holder gets the new one)."""
        cache, status = kv_cache.reserve(self.cache, num_new)
        self.set_cache(cache)
        return status

    def fork(self, src: Int[Array, " n"], dst: Int[Array, " n"]) -> AllocStatus:
        """`kvjax.cache.fork`: each `dst[i]` shares every page of `src[i]` (no copy)."""
        cache, status = kv_cache.fork(self.cache, src, dst)
        self.set_cache(cache)
        return status

    def free(self, seqs, scrub: bool = False) -> None:
        """`kvjax.cache.free`: the flagged sequences' pages go back to the pool."""
        self.set_cache(kv_cache.free(self.cache, seqs, scrub))

    @contextlib.contextmanager
    def step(self, *, positions: Int[Array, "batch q_len"], q_lengths: Int[Array, " batch"],
             seq_ids: Int[Array, " batch"] | None = None, impl="auto",
             select: Callable | None = None, observe: bool = False) -> Iterator[_Step]:
        """The rows of one forward, for the layers' `attention` calls inside the block.

        The caller has reserved the new tokens (`reserve`); see `kvjax.cache.write` for
        `q_lengths` and `seq_ids`. `positions` are the tokens' positions (for RoPE).
        `select(cache, layer, q)` is a policy's page selection (decode); `observe` keeps
        every layer's queries in the yielded step's `queries` (layer -> array).
        """
        if self._box.step is not None:
            raise RuntimeError("PagedCache.step: a step is already open on this cache.")
        positions = jnp.asarray(positions, jnp.int32)
        if positions.ndim != 2:
            raise ValueError(f"PagedCache.step: positions must be [batch, q_len], got "
                             f"{positions.shape}.")
        self._box.step = _Step(positions=positions, q_lengths=jnp.asarray(q_lengths, jnp.int32),
                               seq_ids=seq_ids, impl=impl, select=select,
                               queries={} if observe else None)
        try:
            yield self._box.step
        finally:
            self._box.step = None

    @property
    def current(self) -> _Step:
        """The open step; RuntimeError outside `step` (or a kvjax driver)."""
        if self._box.step is None:
            raise RuntimeError("kvjax.nnx attention ran outside a step: call the model through "
                               "kvjax.nnx.as_model / generate, or inside `with cache.step("
                               "positions=..., q_lengths=...)` after `cache.reserve(...)`.")
        return self._box.step

    @property
    def positions(self) -> Int[Array, "batch q_len"]:
        """The open step's token positions (for a layer's rotary embedding)."""
        return self.current.positions


def attention(
    cache: PagedCache,
    layer: int,
    q: Float[Array, "batch q_len q_heads head_dim"],
    k: Float[Array, "batch q_len kv_heads head_dim"],
    v: Float[Array, "batch q_len kv_heads head_dim"],
    *,
    scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
) -> Float[Array, "batch q_len q_heads head_dim"]:
    """Writes one layer's new K/V into the held cache, then attends its queries (causal).

    Call it inside `cache.step(...)` (the kvjax drivers open it), in place of a dense
    cache update plus attention: q and k already rotated (RoPE, if the model uses it).

    Args:
      cache: the holder (its cache is replaced by the written one).
      layer: this layer's index in the cache (0 <= layer < num_layers).
      q, k, v: the new tokens' queries, keys and values.
      scale: logit scale (default 1/sqrt(head_dim)); soft_cap, sliding_window: as in
        `kvjax.cache.attend`.

    Returns:
      [batch, q_len, q_heads, head_dim] in q's dtype; rows past `q_lengths` are padding.
    """
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise TypeError(f"kvjax.nnx.attention: layer must be an int, got {layer!r}.")
    st = cache.current
    rows = dict(q_lengths=st.q_lengths, seq_ids=st.seq_ids)
    kv = kv_cache.write(cache.cache, layer, k, v, **rows)
    selection = None
    if st.select is not None and q.shape[1] == 1:
        selection = st.select(kv, layer, q[:, 0])
    out, _ = kv_cache.attend(kv, layer, q, selection=selection, scale=scale, soft_cap=soft_cap,
                             sliding_window=sliding_window, impl=st.impl, **rows)
    cache.set_cache(kv)
    if st.queries is not None:
        st.queries[layer] = q
    return out.astype(q.dtype)


class PagedLayer(nnx.Module):
    """Base of the attention modules that run on a `PagedCache` (what `as_model` counts).

    A subclass sets `cache` (the shared holder), `layer` (its index in the cache) and
    `num_heads`, `num_kv_heads`, `head_dim` (its geometry), and calls `attention` in its
    forward. `PagedAttention`, `PagedMultiHeadAttention` and the adapters of published
    models (`kvjax.nnx.tunix`) are such modules; so can a user's own adapter be.
    """

    cache: "PagedCache"
    layer: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def spec(self) -> AttentionSpec:
        """The layer's cache geometry."""
        return AttentionSpec(q_heads=self.num_heads, kv_heads=self.num_kv_heads,
                             head_dim=self.head_dim)


class PagedAttention(PagedLayer):
    """Self-attention over kvjax's cache for new NNX models (GQA, optional RoPE).

    Args:
      cache: the model's `PagedCache` (shared by all layers).
      layer: this layer's index in the cache.
      in_features: model width; num_heads, num_kv_heads, head_dim: attention geometry.
      rope: rotary settings (`kvjax.rope.RopeConfig`) or None (no rotation).
      use_bias: biases on the projections.
      soft_cap, sliding_window: as in `attention`.
      rngs: for the projections' initialisation.
    """

    def __init__(self, cache: PagedCache, layer: int, *, in_features: int, num_heads: int,
                 num_kv_heads: int, head_dim: int, rope: RopeConfig | None = None,
                 use_bias: bool = False, soft_cap: float | None = None,
                 sliding_window: int | None = None, rngs: nnx.Rngs):
        if num_heads % num_kv_heads:
            raise ValueError(f"PagedAttention: num_heads ({num_heads}) must be a multiple of "
                             f"num_kv_heads ({num_kv_heads}).")
        self.cache = cache
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rope = rope
        self.soft_cap, self.sliding_window = soft_cap, sliding_window
        lin = dict(use_bias=use_bias, rngs=rngs)
        self.q_proj = nnx.Linear(in_features, num_heads * head_dim, **lin)
        self.k_proj = nnx.Linear(in_features, num_kv_heads * head_dim, **lin)
        self.v_proj = nnx.Linear(in_features, num_kv_heads * head_dim, **lin)
        self.o_proj = nnx.Linear(num_heads * head_dim, in_features, **lin)

    def __call__(self, x: Float[Array, "batch q_len hidden"]) -> Float[Array, "batch q_len hidden"]:
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.rope is not None:
            cos, sin = rope_cos_sin(self.cache.positions, self.rope, q.dtype)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attention(self.cache, self.layer, q, k, v, soft_cap=self.soft_cap,
                        sliding_window=self.sliding_window)
        return self.o_proj(out.reshape(b, t, -1))


class PagedMultiHeadAttention(PagedLayer):
    """An `nnx.MultiHeadAttention` running on kvjax's cache, with the same weights.

    Built by `adapt`: it keeps the original's `query`, `key`, `value`, `out` (and
    `query_ln` / `key_ln`) modules, so the weights are shared, not copied. Called as the
    original is (self-attention); `mask`, `decode` and `is_causal` are accepted and
    ignored: the cache supplies causality and the decoding state.

    Args:
      mha: the module to adapt (self-attention, no dropout at inference).
      cache: the model's `PagedCache`; layer: its index in the cache.
      qk_transform: optional `(q, k, positions) -> (q, k)` applied after the projections
        (a model's rotary embedding that the original applied in its `attention_fn`).
    """

    def __init__(self, mha: nnx.MultiHeadAttention, cache: PagedCache, layer: int, *,
                 qk_transform: Callable | None = None):
        if not isinstance(mha, nnx.MultiHeadAttention):
            raise TypeError(f"PagedMultiHeadAttention adapts an nnx.MultiHeadAttention, got "
                            f"{type(mha).__name__}.")
        if mha.in_kv_features != mha.in_features:
            raise ValueError("PagedMultiHeadAttention: cross-attention (in_kv_features != "
                             "in_features) has no decoding cache to page.")
        self.cache = cache
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = (mha.num_heads, mha.num_kv_heads,
                                                            mha.head_dim)
        self.query, self.key, self.value, self.out = mha.query, mha.key, mha.value, mha.out
        self.normalize_qk = mha.normalize_qk
        self.query_ln, self.key_ln = mha.query_ln, mha.key_ln
        self.dropout_rate = mha.dropout_rate
        self.qk_transform = qk_transform

    def __call__(self, inputs_q: Float[Array, "batch q_len features"], inputs_k=None,
                 inputs_v=None, *, mask=None, deterministic: bool | None = None, rngs=None,
                 sow_weights: bool = False, decode: bool | None = None, is_causal=False,
                 **kwargs) -> Float[Array, "batch q_len features"]:
        del mask, decode, is_causal, rngs
        for x, name in ((inputs_k, "inputs_k"), (inputs_v, "inputs_v")):
            if x is not None and x is not inputs_q:
                raise ValueError(f"PagedMultiHeadAttention: self-attention only ({name} must "
                                 f"be None or inputs_q).")
        if self.dropout_rate > 0 and deterministic is False:
            raise ValueError("PagedMultiHeadAttention runs inference only: dropout "
                             "(deterministic=False) is not applied on the paged cache.")
        if sow_weights:
            raise ValueError("PagedMultiHeadAttention: sow_weights is not available; paged "
                             "attention never materialises the weights.")
        query = self.query(inputs_q)
        key = self.key(inputs_q)
        value = self.value(inputs_q)
        if self.normalize_qk:
            query, key = self.query_ln(query), self.key_ln(key)
        if self.qk_transform is not None:
            query, key = self.qk_transform(query, key, self.cache.positions)
        out = attention(self.cache, self.layer, query, key, value)
        return self.out(out)


def _paged_layers(module: nnx.Module) -> list:
    return [node for _, node in nnx.iter_graph(module) if isinstance(node, PagedLayer)]


def _holder(module: nnx.Module) -> PagedCache:
    found = [node for _, node in nnx.iter_graph(module) if isinstance(node, PagedCache)]
    if len(found) != 1:
        raise ValueError(f"kvjax.nnx: the model must hold exactly one PagedCache (shared by "
                         f"its attention layers), found {len(found)}; use kvjax.nnx.adapt(model"
                         f") or build its layers with kvjax.nnx.PagedAttention.")
    return found[0]


def adapt(model: nnx.Module, cache: PagedCache | None = None, *,
          qk_transform: Callable | None = None, target: type | tuple[type, ...] | None = None,
          build: Callable[[Any, PagedCache, int], PagedLayer] | None = None) -> PagedCache:
    """Replaces every attention module of `model` by a paged one, in place.

    By default every `nnx.MultiHeadAttention` becomes a `PagedMultiHeadAttention`. For a
    model with attention modules of its own, give their class as `target` and `build`,
    which makes the paged module from the original (reusing its weights: see
    `kvjax.nnx.tunix` for published models). The attention modules get layer indices
    0, 1, ... in graph order (`nnx.iter_graph`: attribute and list order).

    Args:
      model: the NNX model to adapt.
      cache: the holder to attach (default: a new, empty `PagedCache`).
      qk_transform: see `PagedMultiHeadAttention` (the default `build` only).
      target: the class (or classes) of the attention modules to replace (default
        `nnx.MultiHeadAttention`).
      build: `(original, cache, layer) -> PagedLayer` (required with `target`).

    Returns:
      The holder the adapted layers share.

    Raises:
      ValueError: no attention module of `target` in the model, `target` without
        `build` (or `qk_transform` with it), or a module whose parent is not a module or
        a list (it cannot be replaced there).
      TypeError: `build` returned something that is not a `PagedLayer`.
    """
    if target is None:
        if build is not None:
            raise ValueError("kvjax.nnx.adapt: build needs the target class it replaces.")
        target = nnx.MultiHeadAttention

        def build(mha, holder, layer):
            return PagedMultiHeadAttention(mha, holder, layer, qk_transform=qk_transform)
    elif build is None:
        raise ValueError(f"kvjax.nnx.adapt: target={target!r} needs build(original, cache, "
                         f"layer) -> PagedLayer.")
    elif qk_transform is not None:
        raise ValueError("kvjax.nnx.adapt: qk_transform applies to the default build only; "
                         "apply it in your build.")
    cache = PagedCache() if cache is None else cache
    found = [(path, node) for path, node in nnx.iter_graph(model) if isinstance(node, target)]
    if not found:
        names = (" or ".join(t.__name__ for t in target) if isinstance(target, tuple)
                 else target.__name__)
        raise ValueError(f"kvjax.nnx.adapt: no {names} found in {type(model).__name__}.")
    for layer, (path, original) in enumerate(found):
        parent = model
        for key in path[:-1]:
            parent = parent[key] if isinstance(key, int) else getattr(parent, key)
        new = build(original, cache, layer)
        if not isinstance(new, PagedLayer):
            raise TypeError(f"kvjax.nnx.adapt: build must return a kvjax.nnx.PagedLayer, got "
                            f"{type(new).__name__} for the module at {path}.")
        last = path[-1]
        if isinstance(last, int):
            parent[last] = new
        elif isinstance(parent, nnx.Module):
            setattr(parent, last, new)
        else:
            raise ValueError(f"kvjax.nnx.adapt: cannot replace the attention at {path} (its "
                             f"parent is a {type(parent).__name__}).")
    return cache


def _default_call(module, tokens, positions):
    return module(tokens, positions)


@dataclasses.dataclass(frozen=True, kw_only=True)
class NNXConfig:
    """An NNX model's graph and cache geometry (hashable: a static jit argument).

    Attributes:
      graphdef: the module's `nnx.GraphDef` (its state is the params).
      vocab_size, num_layers: sizes the engine needs.
      attention: the cache geometry shared by every layer.
      call: `(module, tokens [batch, q_len], positions [batch, q_len]) -> logits
        [batch, q_len, vocab]`, how the model is called (default `module(tokens,
        positions)`).

    The hash is computed once. A graph whose static attributes are unhashable (a model
    config that is a plain dataclass, as tunix's are) is hashed by its repr; equality
    still compares the graphs themselves.
    """

    graphdef: Any
    vocab_size: int
    num_layers: int
    attention: AttentionSpec
    call: Callable = _default_call
    _hash: int = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        rest = (self.vocab_size, self.num_layers, self.attention, self.call)
        try:
            key = hash((self.graphdef, *rest))
        except TypeError:
            key = hash((repr(self.graphdef), *rest))
        object.__setattr__(self, "_hash", key)

    def __hash__(self) -> int:
        return self._hash


def _cache_spec(config: NNXConfig, *, page_size: int, num_pages: int, max_seqs: int,
                max_pages_per_seq: int, dtype="float32") -> CacheSpec:
    return CacheSpec(attention=config.attention, num_layers=config.num_layers,
                     page_size=page_size, num_pages=num_pages, max_seqs=max_seqs,
                     max_pages_per_seq=max_pages_per_seq, dtype=dtype)


def _forward(params, config: NNXConfig, tokens, positions, cache, *, q_lengths, seq_ids=None,
             impl="auto", select=None, observe=False, logits_at=None):
    """The model contract of `kvjax.models.base` over `nnx.merge(graphdef, params)`."""
    check_logits_at(logits_at, tokens.shape)
    # Fresh variables at this trace level (the params' were made where they entered a jit;
    # NNX refuses to mutate a variable from a deeper trace, such as a scan's body).
    module = nnx.merge(config.graphdef, jax.tree.map(lambda x: x, params))
    holder = _holder(module)
    holder.set_cache(cache)
    with holder.step(positions=positions, q_lengths=q_lengths, seq_ids=seq_ids, impl=impl,
                     select=select, observe=observe) as st:
        logits = config.call(module, tokens, positions)
    cache = holder.cache
    if logits_at is not None:
        logits = gather_positions(logits, logits_at)
    logits = logits.astype(jnp.float32)
    if observe:
        missing = sorted(set(range(config.num_layers)) - set(st.queries))
        if missing:
            raise ValueError(f"kvjax.nnx: layers {missing} did not attend in this forward.")
        return logits, cache, jnp.stack([st.queries[i] for i in range(config.num_layers)])
    return logits, cache


def as_model(module: nnx.Module, *, vocab_size: int, call: Callable | None = None
             ) -> tuple[Model, nnx.State]:
    """The module as a `kvjax.models.Model` and its params, for `kvjax.generate` / serve.

    Args:
      module: an NNX model holding one `PagedCache` and paged attention layers
        (`adapt` or `PagedAttention`) numbered 0 .. num_layers - 1, one geometry.
      vocab_size: the model's vocabulary (logits' last axis).
      call: see `NNXConfig.call`.

    Returns:
      (model, params): params is the module's `nnx.State` (its cache variable empty:
      the engine passes the cache separately and donates it).

    Raises:
      ValueError: no paged layers, layer indices not 0 .. n-1, or layers of different
        geometries.
    """
    holder = _holder(module)
    layers = _paged_layers(module)
    if not layers:
        raise ValueError("kvjax.nnx.as_model: the model has no paged attention layers (adapt "
                         "it with kvjax.nnx.adapt or use kvjax.nnx.PagedAttention).")
    idx = sorted(layer.layer for layer in layers)
    if idx != list(range(len(layers))):
        raise ValueError(f"kvjax.nnx.as_model: layer indices must be 0 .. {len(layers) - 1}, "
                         f"got {idx}.")
    specs = {layer.spec for layer in layers}
    if len(specs) != 1:
        raise ValueError(f"kvjax.nnx.as_model: every layer must share one cache geometry, got "
                         f"{sorted(map(str, specs))}.")
    held = holder.kv.get_value()
    holder.kv.set_value(None)  # the params carry no cache: the engine passes its own
    try:
        graphdef, params = nnx.split(module)
    finally:
        holder.kv.set_value(held)
    config = NNXConfig(graphdef=graphdef, vocab_size=int(vocab_size), num_layers=len(layers),
                       attention=specs.pop(), call=call or _default_call)
    return Model(family="nnx", config=config, forward=_forward, cache_spec=_cache_spec), params


def generate(module: nnx.Module, prompts: Sequence[Sequence[int]], *, vocab_size: int, key,
             max_new_tokens, cache: kv_cache.PagedKVCache | CacheConfig | None = None,
             call: Callable | None = None, **kwargs) -> loop.GenerateResult:
    """`kvjax.generate.generate` on an NNX model (`as_model`); other arguments as there.

    With `cache=None` the holder's own cache is used when it holds one (donated; the
    holder then holds the final cache), else a float32 cache sized for the request.
    """
    holder = _holder(module)
    own = cache is None and holder.kv.get_value() is not None
    if own:
        cache = holder.cache
    model, params = as_model(module, vocab_size=vocab_size, call=call)
    result = loop.generate(model, params, prompts, key=key, max_new_tokens=max_new_tokens,
                           cache=cache, **kwargs)
    if own:
        holder.set_cache(result.cache)
    return result
