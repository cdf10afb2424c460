"""The `Model` bundle that `kvjax.generate` drives, and the registry of model families.

A family is a module (or package) in `kvjax/models/` exposing: a frozen
`XxxConfig` with `from_hf(dict)` and an `attention` property (the cache geometry,
an `AttentionSpec` or `MLASpec`), `init_params(config, key)`,
`params_from_hf(config, get_tensor)`, `cache_spec(config, *, page_size, num_pages,
max_seqs, max_pages_per_seq, dtype)` and

    forward(params, config, tokens, positions, cache, *, q_lengths, seq_ids=None,
            impl="auto", select=None, observe=False, logits_at=None)

The forward contract: the caller has reserved the new tokens in the cache; each
layer writes its new keys with `kvjax.cache.write` and attends with
`kvjax.cache.attend` — the only cache operations a model calls, so a family knows
no page kind, policy or backend. `select(cache, layer, q)` (optional) returns the
`Selection` a layer's decode attention reads (a cache policy's page selection, `q`
the layer's queries, MLA: the absorbed `[q_latent, q_rope]`), and `observe=True`
also returns those queries of every layer, stacked, for the policy's hooks.
`logits_at` (int32[batch, k], token indices into each row's q_len) asks for logits at
those tokens only, [batch, k, vocab]: the final norm and the LM head run on k rows
instead of q_len (`gather_positions`; a prefill chunk needs one row per sequence, and
the LM head of a 32K vocabulary costs as much as several layers).

A family whose layers are per token but for `write` and `attend` (no recurrence across
tokens) may also take `packing` (a `Packing`): several sequences' new tokens end to end in
one row, tokens and positions [1, tokens], `q_lengths` and `seq_ids` per sequence. Its
matmuls then run on the real tokens only; `write` and `attend` see the sequences as rows
(`Packing.lanes`, and back with `Packing.packed`). `Model.packs` says whether it does.

The registry maps HuggingFace `architectures` names to those modules; modules
are imported lazily, on first use.
"""

import dataclasses
import importlib
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from kvjax.models.layers import embed_rows
from kvjax.specs import CacheSpec

__all__ = ["Model", "Packing", "Family", "register_family", "get_family", "family_for_architecture",
           "supported_architectures", "check_logits_at", "check_packing", "gather_positions"]


def check_logits_at(logits_at, tokens_shape: tuple[int, ...]) -> None:
    """Checks a forward's `logits_at` against its tokens' [batch, q_len] shape.

    Raises:
      TypeError: not an integer array. ValueError: not [batch, k] with k >= 1, or (when
        concrete) an index outside [0, q_len).
    """
    if logits_at is None:
        return
    batch, q_len = tokens_shape
    if not jnp.issubdtype(jnp.result_type(logits_at), jnp.integer):
        raise TypeError(f"forward: logits_at must be integer, got {jnp.result_type(logits_at)}.")
    shape = jnp.shape(logits_at)
    if len(shape) != 2 or shape[0] != batch or shape[1] < 1:
        raise ValueError(f"forward: logits_at must be [batch={batch}, k >= 1] token indices, "
                         f"got shape {shape}.")
    if not isinstance(logits_at, jax.core.Tracer):
        idx = np.asarray(logits_at)
        if idx.min() < 0 or idx.max() >= q_len:
            raise ValueError(f"forward: logits_at holds indices in [{idx.min()}, {idx.max()}]; "
                             f"they must lie in [0, q_len={q_len}).")


def check_packing(packing: "Packing", tokens_shape: tuple[int, ...], q_lengths, seq_ids,
                  observe: bool) -> None:
    """Checks a forward's `packing` against its tokens' shape and per-sequence rows.

    Raises:
      ValueError: tokens not one row, a packing of another token count, `q_lengths` not
        one per sequence, no `seq_ids`, or `observe` (a policy's hooks take rows).
    """
    n, _ = packing.gather.shape
    if tokens_shape[0] != 1 or packing.scatter.shape != (tokens_shape[1],):
        raise ValueError(f"forward: packed tokens must be one row [1, {packing.scatter.shape[0]}]"
                         f" (the packing's tokens), got {tokens_shape}.")
    if jnp.shape(q_lengths) != (n,) or seq_ids is None or jnp.shape(seq_ids) != (n,):
        raise ValueError(f"forward: with packing, q_lengths and seq_ids are one per sequence "
                         f"[{n}], got {jnp.shape(q_lengths)} and "
                         f"{None if seq_ids is None else jnp.shape(seq_ids)}.")
    if observe:
        raise ValueError("forward: observe (a cache policy's hooks) takes one sequence per "
                         "row, not packing.")


def gather_positions(x: Float[Array, "batch q_len hidden"], idx: Int[Array, "batch k"]
                     ) -> Float[Array, "batch k hidden"]:
    """`x[b, idx[b, j]]`: the hidden states of the tokens a forward's `logits_at` names.

    Traced indices outside [0, q_len) give NaN rows (no silent clamping; concrete ones
    are rejected by `check_logits_at`).
    """
    idx = jnp.asarray(idx, jnp.int32)
    inside = (idx >= 0) & (idx < x.shape[1])  # take_along_axis would wrap negative indices
    rows = jnp.take_along_axis(x, jnp.where(inside, idx, 0)[:, :, None], axis=1)
    return jnp.where(inside[:, :, None], rows, jnp.nan)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Packing:
    """Sequences packed end to end in one row of a forward: sequence i's tokens are the
    row's `offsets[i]`, ... (`lengths[i]` of them, as `q_lengths`), and `write` and
    `attend` see them as rows of up to `width` tokens.

    Attributes:
      gather: int32[sequences, width]: the packed index of each row position (positions
        past a sequence's length repeat a valid index; they are padding there).
      scatter: int32[tokens]: for each packed token, its flat row index
        (sequence * width + t); tokens past the sequences' end take any valid one.
    """

    gather: Int[Array, "sequences width"]
    scatter: Int[Array, " tokens"]

    @staticmethod
    def of(lengths, tokens: int, width: int) -> "Packing":
        """The packing of sequences of `lengths` (NumPy, each <= `width`, summing to at
        most `tokens`) end to end from index 0; built on the host.

        Raises:
          ValueError: a length outside [0, width], or more than `tokens` in all.
        """
        lengths = np.asarray(lengths, np.int64)
        if lengths.ndim != 1 or (lengths < 0).any() or (lengths > width).any():
            raise ValueError(f"Packing.of: lengths must be a vector in [0, width={width}], "
                             f"got {lengths.tolist()}.")
        if lengths.sum() > tokens:
            raise ValueError(f"Packing.of: {int(lengths.sum())} tokens do not fit a row of "
                             f"{tokens}.")
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        t = np.arange(width)
        gather = np.minimum(offsets[:, None] + np.minimum(t, np.maximum(lengths - 1, 0)[:, None]),
                            tokens - 1)
        scatter = np.zeros(tokens, np.int64)
        for i, (o, n) in enumerate(zip(offsets, lengths, strict=True)):
            scatter[o:o + n] = i * width + t[:n]
        return Packing(gather=gather.astype(np.int32), scatter=scatter.astype(np.int32))

    def lanes(self, x: Float[Array, "1 tokens ..."]) -> Float[Array, "sequences width ..."]:
        """A packed row's per-token values as one row per sequence."""
        n, w = self.gather.shape
        return _take_rows(x[0], self.gather.reshape(-1)).reshape(n, w, *x.shape[2:])

    def packed(self, y: Float[Array, "sequences width ..."]) -> Float[Array, "1 tokens ..."]:
        """Rows per sequence back into the packed row."""
        n, w = self.gather.shape
        return _take_rows(y.reshape(n * w, *y.shape[2:]), self.scatter)[None]


def _take_rows(x: Float[Array, "rows ..."], idx: Int[Array, " n"]) -> Float[Array, "n ..."]:
    """`x[idx]` as `layers.embed_rows` takes rows: 16-bit rows copied on one CPU device
    (XLA:CPU gathers them in float32, converting before and after)."""
    return embed_rows(x.reshape(x.shape[0], -1), idx).reshape(idx.shape[0], *x.shape[1:])


@dataclasses.dataclass(frozen=True, kw_only=True)
class Family:
    """One model family: its config class and its functions (all from one module)."""

    name: str
    config_cls: type
    init_params: Callable
    params_from_hf: Callable
    forward: Callable
    cache_spec: Callable
    unstack_layers: Callable | None = None

    def model(self, config) -> "Model":
        if not isinstance(config, self.config_cls):
            raise TypeError(
                f"family {self.name!r} takes a {self.config_cls.__name__}, got "
                f"{type(config).__name__}."
            )
        return Model(family=self.name, config=config, forward=self.forward,
                     cache_spec=self.cache_spec, unstack_layers=self.unstack_layers)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Model:
    """A model family bound to one config: hashable, so it can be a static jit argument.

    Attributes:
      family: the family name ("llama", "deepseek", ...).
      config: the family's frozen config.
      forward: the family's `forward` (see the module docstring) -> (logits, cache), or
        (logits, cache, queries) with `observe=True`; logits at every token, or at the
        tokens `logits_at` names.
      cache_spec: the family's `cache_spec(config, *, page_size, num_pages, max_seqs,
        max_pages_per_seq, dtype) -> CacheSpec`.
      unstack_layers: the family's `unstack_layers(params) -> params` (per-layer
        weight arrays instead of stacked ones, which its `forward` also runs), or
        None if it has none.
    """

    family: str
    config: Any
    forward: Callable
    cache_spec: Callable
    unstack_layers: Callable | None = None

    def apply(self, params, tokens, positions, cache, *, q_lengths, seq_ids=None,
              impl="auto", select=None, observe: bool = False, logits_at=None,
              packing: Packing | None = None):
        """`forward` with this model's config bound (see the module docstring)."""
        # A family registered before `logits_at` existed is still called without it.
        extra = {} if logits_at is None else dict(logits_at=logits_at)
        if packing is not None:
            if not self.packs:
                raise ValueError(f"Model.apply: the {self.family!r} family's forward takes no "
                                 f"packing (its layers are not per token); give one sequence "
                                 f"per row.")
            extra["packing"] = packing
        return self.forward(params, self.config, tokens, positions, cache, q_lengths=q_lengths,
                            seq_ids=seq_ids, impl=impl, select=select, observe=observe,
                            **extra)

    def make_cache_spec(self, *, page_size: int, num_pages: int, max_seqs: int,
                        max_pages_per_seq: int, dtype="float32") -> CacheSpec:
        """`cache_spec` with this model's config bound."""
        return self.cache_spec(self.config, page_size=page_size, num_pages=num_pages,
                               max_seqs=max_seqs, max_pages_per_seq=max_pages_per_seq,
                               dtype=dtype)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def packs(self) -> bool:
        """Whether the family's forward takes `packing` (sequences end to end in a row)."""
        return "packing" in inspect.signature(self.forward).parameters


# HF `architectures` entry -> (family name, module path). Modules load on first use.
_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "kvjax.models.llama"),
    "MistralForCausalLM": ("llama", "kvjax.models.llama"),
    "Qwen2ForCausalLM": ("llama", "kvjax.models.llama"),
    "Qwen3ForCausalLM": ("llama", "kvjax.models.llama"),
    "DeepseekV2ForCausalLM": ("deepseek", "kvjax.models.deepseek"),
    "DeepseekV3ForCausalLM": ("deepseek", "kvjax.models.deepseek"),
    "DeepseekV32ForCausalLM": ("deepseek_v32", "kvjax.models.deepseek_v32"),
    "Qwen3NextForCausalLM": ("qwen3_next", "kvjax.models.qwen3_next"),
    "Gemma2ForCausalLM": ("gemma", "kvjax.models.gemma"),
    "Gemma3ForCausalLM": ("gemma", "kvjax.models.gemma"),
    "Gemma3ForConditionalGeneration": ("gemma", "kvjax.models.gemma"),
}
_FAMILIES: dict[str, Family] = {}


def register_family(name: str, module: str, architectures: tuple[str, ...] = ()) -> None:
    """Registers a family module under `name` and the HF architecture names it serves."""
    for arch in architectures:
        _ARCHITECTURES[arch] = (name, module)
    _FAMILIES.pop(name, None)
    if not architectures:
        _ARCHITECTURES[f"<{name}>"] = (name, module)


def _module_family(name: str, module_path: str) -> Family:
    """The family a module provides; its config class is `module.CONFIG` if set, else the one
    `*Config` class defined there with `from_hf` and an `attention` property."""
    try:
        module = importlib.import_module(module_path)
    except ModuleNotFoundError as e:
        raise ValueError(
            f"model family {name!r} lives in {module_path}, which is not available here ({e})."
        ) from e
    config_cls = getattr(module, "CONFIG", None)
    if config_cls is None:
        configs = [
            obj for key, obj in vars(module).items()
            if key.endswith("Config") and isinstance(obj, type) and hasattr(obj, "from_hf")
            and hasattr(obj, "attention") and obj.__module__ == module.__name__
        ]
        if len(configs) != 1:
            raise ValueError(
                f"family module {module_path} must define exactly one *Config class with "
                f"from_hf and attention (or name it in CONFIG); found "
                f"{[c.__name__ for c in configs]}."
            )
        config_cls = configs[0]
    return Family(name=name, config_cls=config_cls, init_params=module.init_params,
                  params_from_hf=module.params_from_hf, forward=module.forward,
                  cache_spec=module.cache_spec,
                  unstack_layers=getattr(module, "unstack_layers", None))


def get_family(name: str) -> Family:
    """The registered family called `name` ("llama", "deepseek", "deepseek_v32",
    "qwen3_next", "gemma")."""
    if name not in _FAMILIES:
        paths = {fam: mod for fam, mod in _ARCHITECTURES.values()}
        if name not in paths:
            raise ValueError(f"Unknown model family {name!r}; known: {sorted(paths)}.")
        _FAMILIES[name] = _module_family(name, paths[name])
    return _FAMILIES[name]


def supported_architectures() -> tuple[str, ...]:
    return tuple(sorted(a for a in _ARCHITECTURES if not a.startswith("<")))


def family_for_architecture(architecture: str) -> Family:
    """The family serving a HF `architectures` entry; ValueError naming it if unsupported."""
    if architecture not in _ARCHITECTURES or architecture.startswith("<"):
        raise ValueError(
            f"Unsupported architecture {architecture!r}; supported architectures: "
            f"{', '.join(supported_architectures())}."
        )
    return get_family(_ARCHITECTURES[architecture][0])
