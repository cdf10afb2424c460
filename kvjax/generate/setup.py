"""Host-side preparation of a generation: the cache (given or built), checked inputs.

Everything here runs before any jitted call that donates the cache, so a bad request
raises a clear error and leaves the caller's cache as it was:

  * `CacheConfig` describes a cache to build (dtype, optional KIVI `QuantSpec`, page
    size, pool size, optional sharding plan); `prepare_cache` builds it for a request,
    or checks a cache the caller passed (its geometry against the model, a sharded
    attention impl against its layout);
  * `check_prompts`, `check_slots`, `check_room` validate token ids, slots and lengths.
"""

import dataclasses
import logging
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as kv_cache
from kvjax.cache.policies.base import CachePolicy
from kvjax.sharding import (
    ShardedAttention,
    ShardingPlan,
    cache_shardings,
    init_sharded_cache,
    shard_params,
)
from kvjax.specs import CacheSpec, QuantSpec, canonical_dtype, window_groups

__all__ = ["CacheConfig", "prepare_cache", "check_prompts", "check_slots", "check_room",
           "check_policy", "check_policy_model", "log_fallback", "shard_for_plan"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """A cache for `kvjax.generate` to build, sized for each request.

    Attributes:
      dtype: element type of full-precision pages (and of a KIVI cache's tail).
      quant: KIVI quantization (`kvjax.QuantSpec`), or None for full precision.
      page_size: tokens per page (a KIVI group size must divide it).
      num_pages: pages in the pool; None gives every row room for its whole length.
      plan: a `kvjax.sharding.ShardingPlan` to lay the cache (and the params) out on a
        device mesh; attention then runs as `ShardedAttention(plan, impl)`.
      window_pages: the model's sliding-window layers keep only the pages their window
        (plus one prefill chunk) reaches, in window groups of their own
        (`kvjax.specs.window_groups` over `model.config.sliding_windows`; see
        `kvjax.cache.window`). None (the default) follows the model config's
        `window_pages` attribute (off where it has none, as for the Llama family).
        With `quant`, the global layers keep KIVI pages and the windowed layers
        full-precision rings.
    """

    dtype: str = "float32"
    quant: QuantSpec | None = None
    page_size: int = 16
    num_pages: int | None = None
    plan: ShardingPlan | None = None
    window_pages: bool | None = None

    def __post_init__(self):
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype).name)
        if self.quant is not None and not isinstance(self.quant, QuantSpec):
            raise TypeError(f"CacheConfig.quant must be a QuantSpec or None, got "
                            f"{type(self.quant).__name__}.")
        if self.plan is not None and not isinstance(self.plan, ShardingPlan):
            raise TypeError(f"CacheConfig.plan must be a ShardingPlan or None, got "
                            f"{type(self.plan).__name__}.")
        for name in ("page_size", "num_pages"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"CacheConfig.{name} must be a positive int, got {v!r}.")
        if self.window_pages is not None and not isinstance(self.window_pages, bool):
            raise TypeError(f"CacheConfig.window_pages must be a bool or None, got "
                            f"{self.window_pages!r}.")
        if self.window_pages and self.plan is not None and self.plan.context_shards > 1:
            raise ValueError("CacheConfig.window_pages does not combine with the 'context' "
                             "sharding strategy (a window read by position is not a prefix "
                             "of a device's pages); use 'heads' and/or 'sequences'.")

    def windows_for(self, model) -> tuple[int | None, ...] | None:
        """The per-layer windows whose layers keep window-only pages (None: none do)."""
        windows = getattr(model.config, "sliding_windows", None)
        use = self.window_pages
        if use is None:
            # The model's default, where this cache can take window groups: not with the
            # 'context' strategy (that stays full-context).
            use = bool(getattr(model.config, "window_pages", False)) and (
                self.plan is None or self.plan.context_shards == 1)
        if not use or windows is None or all(w is None for w in windows):
            return None
        return tuple(windows)

    def spec(self, model, *, num_seqs: int, max_tokens: int, chunk: int = 1) -> CacheSpec:
        """The `CacheSpec` of a cache with `num_seqs` slots of up to `max_tokens` tokens.

        `chunk`: the most tokens one reserve adds to a sequence (the prefill chunk), the
        ring size of window-only pages (`window_pages`).
        """
        ps = self.page_size
        max_pages = math.ceil(max_tokens / ps)
        if self.quant is not None:  # the tail holds residual + page_size tokens beside
            max_pages += 1
        shards = 1 if self.plan is None else self.plan.page_shards
        seq_shards = 1 if self.plan is None else self.plan.data_shards
        ctx = 1 if self.plan is None else self.plan.context_shards
        num_seqs = -(-num_seqs // seq_shards) * seq_shards
        # Page j of a sequence lives on context shard j % ctx: every shard needs room for
        # ceil(max_pages / ctx) pages of each of its sequences.
        pages = self.num_pages or num_seqs * -(-max_pages // ctx) * ctx
        pages = -(-pages // shards) * shards
        spec = model.make_cache_spec(page_size=ps, num_pages=pages, max_seqs=num_seqs,
                                     max_pages_per_seq=max_pages, dtype=self.dtype)
        windows = self.windows_for(model)
        if windows is not None:
            spec = spec.replace(window_groups=window_groups(windows, chunk=chunk))
        return spec if self.quant is None else spec.replace(quant=self.quant)

    def build(self, model, *, num_seqs: int, max_tokens: int, chunk: int = 1
              ) -> kv_cache.PagedKVCache:
        """An empty cache for a request (laid out for `plan` when one is set)."""
        spec = self.spec(model, num_seqs=num_seqs, max_tokens=max_tokens, chunk=chunk)
        if self.plan is not None:
            return init_sharded_cache(spec, self.plan)
        return kv_cache.init_cache(spec)


def _sharded_layout_ok(cache: kv_cache.PagedKVCache, plan: ShardingPlan) -> bool:
    """Whether the cache's pools and table are laid out as `plan` lays them out."""
    want = cache_shardings(plan, cache.spec)
    ok = type(want.table) is type(cache.table)
    for arr, sh in zip(jax.tree.leaves(cache.pages), jax.tree.leaves(want.pages), strict=True):
        ok &= getattr(arr, "sharding", None) is not None and arr.sharding.is_equivalent_to(
            sh, arr.ndim)
    return bool(ok)


def prepare_cache(model, cache, impl, *, num_seqs: int, max_tokens: int, chunk: int = 1):
    """The cache a request runs on and the attention impl to run it with.

    Args:
      model: the model (its cache geometry must match a given cache's).
      cache: a `PagedKVCache` (any page kind; used as is), a `CacheConfig`, or None
        (a float32 cache). With a `ShardedAttention` impl, a config without a plan builds
        the cache for the impl's plan, and an empty cache not laid out for it is rebuilt
        laid out (same spec).
      impl: the attention implementation asked for.
      num_seqs, max_tokens: the slots and the longest sequence a built cache must hold.
      chunk: the most tokens one reserve adds to a sequence (window-only pages' rings).

    Returns:
      (cache, impl, plan): impl is `ShardedAttention(plan, impl)` when the config has a
      plan; plan is the sharding plan in force (or None).

    Raises:
      ValueError: a given cache built for another attention geometry, or a sharded
        attention impl with a cache not laid out for its plan that holds sequences (an
        empty one is rebuilt laid out).
    """
    if cache is None:
        cache = CacheConfig()
    plan = None
    if isinstance(cache, CacheConfig):
        if cache.plan is None and isinstance(impl, ShardedAttention):
            # Build the cache laid out for the impl's plan (pages rounded to its shards).
            cache = dataclasses.replace(cache, plan=impl.plan)
        plan = cache.plan
        if plan is not None:
            if isinstance(impl, ShardedAttention):
                if impl.plan != plan:
                    raise ValueError("generate: impl is a ShardedAttention for another plan "
                                     "than the CacheConfig's; give one plan.")
            else:
                impl = ShardedAttention(plan, impl)
        if (plan is not None and plan.context_shards > 1
                and cache.windows_for(model) is not None):
            raise ValueError("window-only pages (CacheConfig.window_pages, the model "
                             "config's default) do not combine with the 'context' sharding "
                             "strategy; pass CacheConfig(window_pages=False) or use 'heads' "
                             "and/or 'sequences'.")
        if (plan is not None and plan.context_shards > 1 and cache.window_pages is None
                and getattr(model.config, "window_pages", False)
                and dataclasses.replace(cache, plan=None).windows_for(model) is not None):
            log_fallback("the 'context' sharding strategy keeps full pages: window-only "
                         "pages (the model's default) do not split over context shards. "
                         "Pass CacheConfig(window_pages=False) to choose this explicitly.")
        cache = cache.build(model, num_seqs=num_seqs, max_tokens=max_tokens, chunk=chunk)
    elif not isinstance(cache, kv_cache.PagedKVCache):
        raise TypeError(f"cache must be a kvjax PagedKVCache, a CacheConfig or None, got "
                        f"{type(cache).__name__}.")
    spec = cache.spec
    if spec.attention != model.config.attention or spec.num_layers != model.config.num_layers:
        raise ValueError(f"the cache was built for {spec.attention} x {spec.num_layers} layers; "
                         f"the model needs {model.config.attention} x "
                         f"{model.config.num_layers} layers (build it with "
                         f"model.make_cache_spec or pass a CacheConfig).")
    if isinstance(impl, ShardedAttention):
        plan = impl.plan
        if not _sharded_layout_ok(cache, plan):
            if np.any(np.asarray(cache.lengths) > 0):
                raise ValueError(
                    "impl is a ShardedAttention but the cache is not laid out for its plan "
                    "(build it with kvjax.sharding.init_sharded_cache(spec, plan), or pass "
                    "cache=CacheConfig(plan=plan)); it holds sequences, so it cannot be "
                    "rebuilt here.")
            cache = init_sharded_cache(spec, plan)
    return cache, impl, plan


def shard_for_plan(model, params, plan: ShardingPlan | None):
    """Params laid out for `plan` (tensor parallel over `model`), or as they are."""
    if plan is None:
        return params
    return shard_params(params, plan, kv_heads=getattr(model.config.attention, "kv_heads",
                                                       None))


def check_prompts(prompts, vocab_size: int, what: str = "prompt") -> list[np.ndarray]:
    """Prompts as int32 arrays; ValueError for an empty prompt, a non-integer or an id
    outside [0, vocab_size)."""
    if isinstance(prompts, np.ndarray | jax.Array) and np.ndim(prompts) == 1:
        raise ValueError(f"{what}s must be a list of token-id lists (one per row), got a 1-D "
                         f"array; wrap it: [{what}].")
    if not isinstance(prompts, Sequence | np.ndarray | jax.Array) or len(prompts) == 0:
        raise ValueError(f"{what}s must hold at least one {what} (a list of token-id lists).")
    out = []
    for i, p in enumerate(prompts):
        a = np.asarray(p)
        if a.ndim != 1 or a.size == 0:
            raise ValueError(f"{what} {i} must be a non-empty 1-D list of token ids, got shape "
                             f"{a.shape}.")
        if a.dtype.kind not in "iu":
            raise ValueError(f"{what} {i} holds non-integer token ids ({a.dtype}, e.g. "
                             f"{a.ravel()[0]!r}); token ids are ints in [0, {vocab_size}).")
        bad = (a < 0) | (a >= vocab_size)
        if bad.any():
            j = int(np.nonzero(bad)[0][0])
            raise ValueError(f"{what} {i} token {j} is {int(a[j])}, outside the vocabulary "
                             f"[0, {vocab_size}).")
        out.append(a.astype(np.int32))
    return out


def check_eos(eos_ids, vocab_size: int) -> tuple[int, ...]:
    """EOS ids as a tuple of ints in [0, vocab_size); ValueError otherwise."""
    if isinstance(eos_ids, int | np.integer):
        eos_ids = [eos_ids]
    a = np.asarray(list(eos_ids))
    if a.size and (a.ndim != 1 or a.dtype.kind not in "iu"):
        raise ValueError(f"eos_ids must be token ids (ints in [0, {vocab_size})), got "
                         f"{list(eos_ids)!r}.")
    bad = a[(a < 0) | (a >= vocab_size)] if a.size else a
    if bad.size:
        raise ValueError(f"eos_ids holds {int(bad[0])}, outside the vocabulary [0, {vocab_size}).")
    return tuple(int(e) for e in a)


def check_sampling(sampling) -> None:
    """TypeError unless `sampling` is a `SamplingConfig`."""
    from kvjax.generate.sampling import SamplingConfig

    if not isinstance(sampling, SamplingConfig):
        raise TypeError(f"sampling must be a kvjax.generate.SamplingConfig (e.g. "
                        f"SamplingConfig(temperature=0.8); the default is greedy), got "
                        f"{sampling!r}.")


def check_slots(seq_ids, batch: int, spec: CacheSpec) -> np.ndarray:
    """Slots of the rows: distinct ints in [0, max_seqs); default 0 .. batch - 1."""
    if seq_ids is None:
        if batch > spec.max_seqs:
            raise ValueError(f"{batch} prompts but the cache has only {spec.max_seqs} sequence "
                             f"slots (max_seqs).")
        return np.arange(batch, dtype=np.int32)
    s = np.asarray(seq_ids)
    if s.shape != (batch,) or s.dtype.kind not in "iu":
        raise ValueError(f"seq_ids must be {batch} ints (one slot per prompt), got {s!r}.")
    if ((s < 0) | (s >= spec.max_seqs)).any():
        bad = int(s[(s < 0) | (s >= spec.max_seqs)][0])
        raise ValueError(f"seq_ids entry {bad} is outside the cache's slots [0, "
                         f"{spec.max_seqs}).")
    if len(set(s.tolist())) != batch:
        raise ValueError(f"seq_ids must be distinct (two rows would write one slot), got "
                         f"{s.tolist()}.")
    return s.astype(np.int32)


def check_room(cache, seq_ids: np.ndarray, lengths: np.ndarray, max_new: np.ndarray) -> None:
    """ValueError if a row's sequence would outgrow `max_pages_per_seq * page_size`."""
    spec = cache.spec
    held = np.asarray(cache.lengths)[seq_ids]
    total = held + lengths + max_new
    over = total > spec.max_tokens_per_seq
    if over.any():
        r = int(np.nonzero(over)[0][0])
        raise ValueError(
            f"row {r} (slot {int(seq_ids[r])}) would hold {int(total[r])} tokens ({int(held[r])}"
            f" cached + {int(lengths[r])} prompt + {int(max_new[r])} new) but a sequence holds "
            f"at most max_pages_per_seq * page_size = {spec.max_tokens_per_seq}; use a larger "
            f"cache or fewer new tokens.")


def check_policy(policy) -> None:
    if policy is not None and not isinstance(policy, CachePolicy):
        raise TypeError(f"policy must be a kvjax.cache.policies.CachePolicy (e.g. H2O(budget="
                        f"256)) or None, got {policy!r}.")


def check_policy_model(policy, model):
    """`policy` bound to the model's attention (`kvjax.cache.policies.base.bind_model`): the
    policies that score or select tokens by attention follow its sliding windows, soft cap
    and query scale (global layers scored with the model's logits; windowed layers keep or
    read their window). Returns the bound policy (None for None)."""
    from kvjax.cache.policies.base import bind_model

    return bind_model(policy, model)


_log = logging.getLogger("kvjax.generate")


def log_fallback(reason: str) -> None:
    """Logs (warning level, logger "kvjax.generate") why a cache left the model's default
    layout, e.g. full pages instead of window-only pages."""
    _log.warning(reason)


def max_new_vector(max_new_tokens, batch: int) -> np.ndarray:
    """Per-row token limits: one int for all rows, or one per row (each >= 1)."""
    m = np.asarray(max_new_tokens)
    if m.dtype.kind not in "iu" or m.ndim > 1 or (m.ndim == 1 and m.shape != (batch,)):
        raise ValueError(f"max_new_tokens must be an int or {batch} ints (one per prompt), "
                         f"got {max_new_tokens!r}.")
    # Checked before the cast to int32, which would wrap 2**32 + 3 to 3.
    m = np.broadcast_to(m, (batch,))
    if (m < 1).any():
        raise ValueError(f"max_new_tokens must be >= 1 per row, got {m.tolist()}.")
    if (m > np.iinfo(np.int32).max).any():
        raise ValueError(f"max_new_tokens must fit in int32 (at most {np.iinfo(np.int32).max})"
                         f", got {m.tolist()}.")
    return m.astype(np.int32)


def check_chunk(chunk_size) -> int:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int | np.integer) or (
            chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}.")
    return int(chunk_size)


def as_slot_array(seq_ids: np.ndarray):
    return jnp.asarray(seq_ids, jnp.int32)
