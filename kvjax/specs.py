"""Static descriptions of attention geometry and of a paged cache.

Every spec is a frozen, keyword-only, hashable dataclass that validates itself,
so it can be passed as a static argument to `jax.jit` and stored as a static
field of the cache pytree. Bad values raise `ValueError` naming what was given
and what is allowed.
"""

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

__all__ = ["AttentionSpec", "MLASpec", "CacheSpec", "QuantSpec", "RecurrentSpec",
           "IndexerCacheSpec", "WindowGroupSpec", "window_groups", "canonical_dtype"]

_CACHE_DTYPES = ("float32", "bfloat16", "float16")
_QUANT_BITS = (2, 4, 8)
_SCALE_DTYPES = ("float16", "bfloat16")


def _positive_int(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value <= 0:
        raise ValueError(f"{owner}.{name} must be a positive int, got {value!r}.")


def canonical_dtype(dtype: object) -> np.dtype:
    """Returns `dtype` as a NumPy dtype, raising `ValueError` for unknown names."""
    try:
        return jnp.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"Unknown dtype {dtype!r}.") from e


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionSpec:
    """Multi-head, grouped-query or multi-query attention geometry.

    MHA has `kv_heads == q_heads`, MQA has `kv_heads == 1`, GQA anything that
    divides `q_heads` in between. Each KV head serves a group of
    `q_heads // kv_heads` consecutive query heads.
    """

    q_heads: int
    kv_heads: int
    head_dim: int

    def __post_init__(self):
        for name in ("q_heads", "kv_heads", "head_dim"):
            _positive_int("AttentionSpec", name, getattr(self, name))
        if self.q_heads % self.kv_heads:
            raise ValueError(
                f"AttentionSpec: kv_heads={self.kv_heads} must divide q_heads={self.q_heads}; "
                f"allowed kv_heads values are the divisors of {self.q_heads}: "
                f"{[d for d in range(1, self.q_heads + 1) if self.q_heads % d == 0]}."
            )

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.q_heads // self.kv_heads

    @property
    def kind(self) -> str:
        """'MHA', 'MQA' or 'GQA'."""
        if self.kv_heads == self.q_heads:
            return "MHA"
        if self.kv_heads == 1:
            return "MQA"
        return "GQA"

    @property
    def cache_heads(self) -> int:
        """Heads stored per token in the cache."""
        return self.kv_heads

    @property
    def softmax_scale(self) -> float:
        """The attention logit scale, 1/sqrt(head_dim)."""
        return self.head_dim ** -0.5

    @property
    def cache_widths(self) -> tuple[int, int]:
        """Per-head widths of the two cached tensors, K and V."""
        return (self.head_dim, self.head_dim)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLASpec:
    """Multi-head latent attention geometry (DeepSeek-V2, arXiv 2405.04434).

    The cache holds one latent "head" per token: the normalised `c_KV`
    (`kv_lora_rank` wide) and the shared rotary key (`qk_rope_head_dim` wide).
    `q_lora_rank=None` means the query uses a plain projection (V2-Lite).
    `scale` is the attention logit scale when it is not 1/sqrt(qk_nope + qk_rope)
    (YaRN's mscale multiplies it).
    """

    q_heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    scale: float | None = None

    def __post_init__(self):
        for name in ("q_heads", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                     "v_head_dim"):
            _positive_int("MLASpec", name, getattr(self, name))
        if self.q_lora_rank is not None:
            _positive_int("MLASpec", "q_lora_rank", self.q_lora_rank)
        if self.scale is not None and not (isinstance(self.scale, float | int) and self.scale > 0):
            raise ValueError(f"MLASpec.scale must be a positive float or None, got "
                             f"{self.scale!r}.")
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"MLASpec.qk_rope_head_dim must be even (rotary pairs), got "
                f"{self.qk_rope_head_dim}."
            )

    kind = "MLA"

    @property
    def qk_head_dim(self) -> int:
        """Width of one query/key head before absorption: nope + rope."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_heads(self) -> int:
        return 1

    @property
    def softmax_scale(self) -> float:
        """The attention logit scale (absorbed form: q_latent . c_KV + q_rope . k_rope)."""
        return self.qk_head_dim ** -0.5 if self.scale is None else float(self.scale)

    @property
    def cache_widths(self) -> tuple[int, int]:
        """Widths of the two cached tensors, c_KV and k_rope."""
        return (self.kv_lora_rank, self.qk_rope_head_dim)


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantSpec:
    """KIVI-style low-bit quantization of a paged cache (arXiv 2402.02750).

    Keys are quantized per channel in groups of `group_size` consecutive
    tokens, values per token in groups of `group_size` consecutive channels
    (MLA: the latent c_KV per token in channel groups; k_rope stays in the
    cache dtype). Each group stores a scale and a zero point. The most recent
    tokens stay in full precision (the cache dtype) in a per-sequence tail:
    a sequence of L tokens keeps its first
    `page_size * floor(max(L - residual, 0) / page_size)` tokens quantized, so
    the tail holds between `residual` and `residual + page_size - 1` tokens
    (all of them while L < residual).

    Args:
      bits: code width, 2, 4 or 8; an int for every layer or a tuple with one
        entry per layer (e.g. the first layers at 8 bits).
      group_size: G, elements per scale/zero group. Must divide the page size
        (keys group along tokens inside a page) and the quantized widths.
      residual: R, tokens kept in full precision; a multiple of the page size (0 allowed).
      scale_dtype: storage of scales and zero points, "float16" (default) or
        "bfloat16". float16 is the default because its 11-bit significand puts
        the zero point within 2^-11 of the group minimum (bfloat16: 2^-8, which
        at 8 bits can exceed half a quantization step when a group's range is
        small next to its magnitude); its range (|x| <= 65504) is ample for
        keys and values. Use bfloat16 for activations beyond that range.
    """

    bits: int | tuple[int, ...] = 4
    group_size: int = 32
    residual: int = 0
    scale_dtype: np.dtype = dataclasses.field(default=np.dtype("float16"))

    def __post_init__(self):
        bits = self.bits
        if isinstance(bits, list | tuple):
            bits = tuple(bits)
            if not bits:
                raise ValueError("QuantSpec.bits must not be an empty tuple.")
        for b in bits if isinstance(bits, tuple) else (bits,):
            if isinstance(b, bool) or b not in _QUANT_BITS:
                raise ValueError(f"QuantSpec.bits entries must be one of {_QUANT_BITS}, got {b!r}.")
        object.__setattr__(self, "bits", bits)
        _positive_int("QuantSpec", "group_size", self.group_size)
        if isinstance(self.residual, bool) or not isinstance(self.residual, int) or (
                self.residual < 0):
            raise ValueError(f"QuantSpec.residual must be an int >= 0, got {self.residual!r}.")
        dtype = canonical_dtype(self.scale_dtype)
        if dtype.name not in _SCALE_DTYPES:
            raise ValueError(
                f"QuantSpec.scale_dtype must be one of {_SCALE_DTYPES}, got {dtype.name}."
            )
        object.__setattr__(self, "scale_dtype", dtype)

    def layer_bits(self, num_layers: int) -> tuple[int, ...]:
        """Bits of every layer."""
        if isinstance(self.bits, tuple):
            return self.bits
        return (self.bits,) * num_layers

    def validate_for(self, spec: "CacheSpec") -> None:
        """Raises `ValueError` if this quantization does not fit `spec`'s geometry."""
        ps, g = spec.page_size, self.group_size
        if isinstance(self.bits, tuple) and len(self.bits) != spec.num_layers:
            raise ValueError(
                f"QuantSpec.bits has {len(self.bits)} entries but the cache has "
                f"{spec.num_layers} layers; give one per layer or a single int."
            )
        if self.residual % ps:
            raise ValueError(
                f"QuantSpec.residual={self.residual} must be a multiple of page_size={ps}."
            )
        # Widths quantized per token in channel groups: values, or MLA's latent.
        widths = (spec.attention.cache_widths[0] if spec.is_mla
                  else spec.attention.head_dim,)
        if not spec.is_mla and ps % g:
            raise ValueError(
                f"QuantSpec.group_size={g} must divide page_size={ps}: keys are grouped along "
                f"tokens inside a page. Use a page size that is a multiple of {g}."
            )
        for w in widths:
            if w % g:
                raise ValueError(
                    f"QuantSpec.group_size={g} must divide the quantized width {w} "
                    f"(values are grouped along channels)."
                )
            for b in set(self.layer_bits(spec.num_layers)):
                if w % (8 // b):
                    raise ValueError(
                        f"Quantized width {w} must be a multiple of {8 // b} to pack "
                        f"{b}-bit codes into bytes."
                    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecurrentSpec:
    """Fixed-size per-sequence state of a hybrid model's linear-attention layers.

    Gated DeltaNet layers (Qwen3-Next) keep, per sequence slot, the last
    `conv_width` inputs of their causal convolution and a delta-rule state of
    `heads x key_dim x value_dim`; neither grows with the context.

    Args:
      num_layers: linear-attention layers.
      conv_dim: channels of the causal convolution.
      conv_width: inputs it keeps (kernel size - 1).
      heads, key_dim, value_dim: the delta-rule state's shape per slot.
      dtype: element type of both states (float32 by default, as transformers keeps them).
    """

    num_layers: int
    conv_dim: int
    conv_width: int
    heads: int
    key_dim: int
    value_dim: int
    dtype: np.dtype = dataclasses.field(default=np.dtype("float32"))

    def __post_init__(self):
        for name in ("num_layers", "conv_dim", "conv_width", "heads", "key_dim", "value_dim"):
            _positive_int("RecurrentSpec", name, getattr(self, name))
        dtype = canonical_dtype(self.dtype)
        if dtype.name not in _CACHE_DTYPES:
            raise ValueError(f"RecurrentSpec.dtype must be one of {_CACHE_DTYPES}, got "
                             f"{dtype.name}.")
        object.__setattr__(self, "dtype", dtype)

    def bytes_per_seq(self) -> int:
        """Bytes of one slot's state, over every linear layer."""
        per_layer = (self.conv_dim * self.conv_width
                     + self.heads * self.key_dim * self.value_dim)
        return self.num_layers * per_layer * self.dtype.itemsize


@dataclasses.dataclass(frozen=True, kw_only=True)
class IndexerCacheSpec:
    """The key cache of DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2).

    Beside MLA's latent, every layer caches one indexer key per token (shared by all
    indexer heads), `head_dim` wide. The keys live in a pool of their own beside the
    latent pool, with the same page ids: one block table and one allocator serve both.
    They are never quantized (a KIVI cache quantizes the latent only), so the token
    selection sees the keys the model computed.

    Args:
      head_dim: width of one indexer key (`index_head_dim`).
      dtype: element type of the keys, float32, bfloat16 or float16 (the model's
        dtype, as transformers caches them; it does not follow the latent pages').
    """

    head_dim: int
    dtype: np.dtype = dataclasses.field(default=np.dtype("float32"))

    def __post_init__(self):
        _positive_int("IndexerCacheSpec", "head_dim", self.head_dim)
        dtype = canonical_dtype(self.dtype)
        if dtype.name not in _CACHE_DTYPES:
            raise ValueError(f"IndexerCacheSpec.dtype must be one of {_CACHE_DTYPES}, got "
                             f"{dtype.name}.")
        object.__setattr__(self, "dtype", dtype)

    def bytes_per_token(self, num_layers: int) -> int:
        """Bytes of one token's indexer keys over `num_layers` layers."""
        return num_layers * self.head_dim * self.dtype.itemsize


def ring_pages(window: int, chunk: int, page_size: int) -> int:
    """Pages a sequence of a windowed layer group holds: `ceil((window + chunk - 2) /
    page_size) + 1`.

    A reserve adds at most `chunk` tokens to a sequence, taking it from L to L + n tokens
    (n <= chunk), and the ring then holds logical pages [P - R, P), P = ceil((L + n) /
    page_size). The step's first query (position L) reads keys from L - window + 1, so
    (P - R) * page_size <= L - window + 1 must hold for the worst alignment
    (P * page_size = L + n + page_size - 1): R * page_size >= window + chunk + page_size - 2.
    The page a write overwrites in place is then one no query of the step reads.
    """
    return -(-(window + chunk - 2) // page_size) + 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class WindowGroupSpec:
    """Layers of one sliding window that keep only the pages their window reaches.

    Each sequence of the group holds a ring of `ring_pages(window, chunk, page_size)`
    pages in the group's own pool (`num_pages` pages for all sequences): logical page p
    lives in ring slot p mod R, so once the ring is full the page that leaves the window is
    overwritten in place by the page that enters it and the group allocates nothing more
    for that sequence (`kvjax.cache.window`).

    Args:
      layers: the model's layer indices in the group (distinct, increasing).
      window: the attention window of those layers (a query at p sees keys k with
        p - k < window).
      chunk: the most tokens one `reserve` adds to a sequence (the prefill chunk; 1 for
        decode only). A larger reserve is refused (status TOO_MANY_NEW).
      num_pages: pages in the group's pool; None (the default) gives every slot its ring.
    """

    layers: tuple[int, ...]
    window: int
    chunk: int
    num_pages: int | None = None

    def __post_init__(self):
        layers = tuple(self.layers) if isinstance(self.layers, list | tuple) else None
        if not layers or any(isinstance(i, bool) or not isinstance(i, int | np.integer)
                             or i < 0 for i in layers) or list(layers) != sorted(set(layers)):
            raise ValueError(f"WindowGroupSpec.layers must be distinct, increasing layer "
                             f"indices >= 0, got {self.layers!r}.")
        object.__setattr__(self, "layers", tuple(int(i) for i in layers))
        _positive_int("WindowGroupSpec", "window", self.window)
        _positive_int("WindowGroupSpec", "chunk", self.chunk)
        if self.num_pages is not None:
            _positive_int("WindowGroupSpec", "num_pages", self.num_pages)

    def ring_pages(self, page_size: int) -> int:
        """Ring slots per sequence (see the module function `ring_pages`)."""
        return ring_pages(self.window, self.chunk, page_size)


def window_groups(windows, *, chunk: int, num_pages: int | None = None
                  ) -> tuple[WindowGroupSpec, ...]:
    """Window groups for a model's per-layer windows: one group per distinct window.

    Args:
      windows: per layer, the attention window or None (a global layer), as a model config
        lists them (`LlamaConfig.sliding_windows`); None or all-None gives no group.
      chunk: the most tokens one reserve adds to a sequence (the prefill chunk).
      num_pages: each group's pool size; None: every slot its ring.

    Returns:
      The groups, ordered by their first layer, for `CacheSpec(window_groups=...)`.
    """
    if windows is None:
        return ()
    by_window: dict[int, list[int]] = {}
    for i, w in enumerate(windows):
        if w is not None:
            by_window.setdefault(int(w), []).append(i)
    groups = [WindowGroupSpec(layers=tuple(ls), window=w, chunk=chunk, num_pages=num_pages)
              for w, ls in by_window.items()]
    return tuple(sorted(groups, key=lambda g: g.layers[0]))


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheSpec:
    """Shape and layout of a paged KV cache.

    Args:
      attention: the geometry of what is cached per token and layer.
      num_layers: transformer layers sharing the page table.
      page_size: tokens per page, a power of two.
      num_pages: pages in the pool (per layer; every layer uses the same page ids).
      max_seqs: rows of the block table (concurrent sequences).
      max_pages_per_seq: columns of the block table; a sequence holds at most
        `max_pages_per_seq * page_size` tokens.
      dtype: element type of the pages: float32, bfloat16 or float16.
      quant: if set, the cache stores low-bit codes (see `QuantSpec`); `dtype`
        is then the type of the full-precision tail and of MLA's k_rope.
      recurrent: a hybrid model's per-slot linear-attention state (`RecurrentSpec`);
        `num_layers` then counts the full-attention layers, which hold pages.
      indexer: an MLA cache's lightning-indexer keys (`IndexerCacheSpec`, DeepSeek-V3.2):
        a third pool beside the latent pools, sharing their pages.
      window_groups: layers that keep only their sliding window's pages
        (`WindowGroupSpec`, `window_groups`), each group in pools and a page table of its
        own; the main pools (`pool_shapes`, `num_pages`) then hold the other layers only
        (`global_layers`). MHA/GQA/MQA caches only. With `quant`, the main pools hold the
        global layers' KIVI pages and tail, and the groups' layers stay full precision in
        their rings (their entries of a per-layer `QuantSpec.bits` are unused).
    """

    attention: AttentionSpec | MLASpec
    num_layers: int
    page_size: int
    num_pages: int
    max_seqs: int
    max_pages_per_seq: int
    dtype: np.dtype = dataclasses.field(default=np.dtype("float32"))
    quant: QuantSpec | None = None
    recurrent: RecurrentSpec | None = None
    indexer: IndexerCacheSpec | None = None
    window_groups: tuple[WindowGroupSpec, ...] = ()

    def __post_init__(self):
        if self.indexer is not None:
            if not isinstance(self.indexer, IndexerCacheSpec):
                raise ValueError(f"CacheSpec.indexer must be an IndexerCacheSpec or None, got "
                                 f"{type(self.indexer).__name__}.")
            if not isinstance(self.attention, MLASpec):
                raise ValueError("CacheSpec.indexer: indexer keys sit beside an MLA latent "
                                 "cache; this cache's attention is "
                                 f"{type(self.attention).__name__}, not MLASpec.")
        if self.recurrent is not None and not isinstance(self.recurrent, RecurrentSpec):
            raise ValueError(f"CacheSpec.recurrent must be a RecurrentSpec or None, got "
                             f"{type(self.recurrent).__name__}.")
        if not isinstance(self.attention, AttentionSpec | MLASpec):
            raise ValueError(
                f"CacheSpec.attention must be an AttentionSpec or MLASpec, got "
                f"{type(self.attention).__name__}."
            )
        for name in ("num_layers", "page_size", "num_pages", "max_seqs", "max_pages_per_seq"):
            _positive_int("CacheSpec", name, getattr(self, name))
        if self.page_size & (self.page_size - 1):
            lo = 1 << (self.page_size.bit_length() - 1)
            raise ValueError(
                f"CacheSpec.page_size must be a power of two, got {self.page_size}; "
                f"nearest allowed values are {lo} and {2 * lo}."
            )
        dtype = canonical_dtype(self.dtype)
        if dtype.name not in _CACHE_DTYPES:
            raise ValueError(f"CacheSpec.dtype must be one of {_CACHE_DTYPES}, got {dtype.name}.")
        object.__setattr__(self, "dtype", dtype)
        if self.num_pages >= 2**31 or self.max_seqs * self.max_pages_per_seq >= 2**31:
            raise ValueError("CacheSpec: page ids and table sizes must fit in int32.")
        if self.quant is not None:
            if not isinstance(self.quant, QuantSpec):
                raise ValueError(
                    f"CacheSpec.quant must be a QuantSpec or None, got {type(self.quant).__name__}."
                )
            self.quant.validate_for(self)
        self._check_window_groups()

    def _check_window_groups(self) -> None:
        groups = self.window_groups
        if not isinstance(groups, tuple | list) or not all(
                isinstance(g, WindowGroupSpec) for g in groups):
            raise ValueError(f"CacheSpec.window_groups must be a tuple of WindowGroupSpec, got "
                             f"{groups!r}.")
        groups = tuple(groups)
        object.__setattr__(self, "window_groups", groups)
        if not groups:
            return
        if self.is_mla or self.recurrent is not None:
            raise ValueError("CacheSpec.window_groups apply to MHA/GQA/MQA caches (no MLA or "
                             "recurrent state).")
        seen: set[int] = set()
        for g in groups:
            if g.layers[-1] >= self.num_layers:
                raise ValueError(f"CacheSpec.window_groups: layer {g.layers[-1]} is outside "
                                 f"the cache's {self.num_layers} layers.")
            if seen & set(g.layers):
                raise ValueError(f"CacheSpec.window_groups: layer {min(seen & set(g.layers))} "
                                 f"is in two groups.")
            seen |= set(g.layers)

    @property
    def global_layers(self) -> tuple[int, ...]:
        """The layers held in the main pools: those in no window group."""
        local = {i for g in self.window_groups for i in g.layers}
        return tuple(i for i in range(self.num_layers) if i not in local)

    def layer_home(self, layer: int) -> tuple[int | None, int]:
        """(group index or None for the main pools, the layer's index in those pools)."""
        for gi, g in enumerate(self.window_groups):
            if layer in g.layers:
                return gi, g.layers.index(layer)
        return None, self.global_layers.index(layer)

    def group_num_pages(self, g: int) -> int:
        """Pages in window group g's pool (its `num_pages`, or every slot its ring)."""
        group = self.window_groups[g]
        if group.num_pages is not None:
            return group.num_pages
        return self.max_seqs * group.ring_pages(self.page_size)

    def group_pool_shape(self, g: int) -> tuple[int, ...]:
        """Shape of window group g's K (and V) pool `[layers_g, heads, pages, page_size,
        head_dim]`."""
        group = self.window_groups[g]
        return (len(group.layers), self.attention.cache_heads, self.group_num_pages(g),
                self.page_size, self.attention.cache_widths[0])

    @property
    def max_tokens_per_seq(self) -> int:
        return self.max_pages_per_seq * self.page_size

    @property
    def is_mla(self) -> bool:
        return isinstance(self.attention, MLASpec)

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens."""
        return math.ceil(num_tokens / self.page_size)

    @property
    def pool_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of the two page pools: `[layers, heads, pages, page_size, width]`."""
        w0, w1 = self.attention.cache_widths
        h = self.attention.cache_heads
        base = (len(self.global_layers), h, self.num_pages, self.page_size)
        return (*base, w0), (*base, w1)

    @property
    def index_pool_shape(self) -> tuple[int, ...] | None:
        """Shape of the indexer key pool `[layers, 1, pages, page_size, index_head_dim]`
        (None without an indexer)."""
        if self.indexer is None:
            return None
        return (self.num_layers, 1, self.num_pages, self.page_size, self.indexer.head_dim)

    def replace(self, **changes) -> "CacheSpec":
        return dataclasses.replace(self, **changes)
