"""KV bytes of sliding-window models: full-context local layers against window-only pages.

Models such as Gemma 2 and Gemma 3 mix local layers, whose queries see only the last
`window` tokens, with global layers that see the whole context. A plain paged cache
keeps every token in every layer; kvjax's window-only pages
(`kvjax.generate.CacheConfig(window_pages=True)`, `kvjax.cache.window`) let each local
layer keep a ring of `kvjax.specs.ring_pages(window, chunk, page_size)` =
ceil((window + chunk - 2) / page_size) + 1 pages per sequence: the pages its window can
reach while one reserve adds up to `chunk` tokens (the prefill chunk). The global layers
keep all their pages either way.

Both layouts are counted in whole pages: a sequence of `context` tokens holds
ceil(context / page_size) pages per layer, a local layer with window-only pages
min(that, ring) pages. Full-precision pages only: kvjax builds window-only pages for
float32 / bfloat16 / float16 caches.
"""

import dataclasses
import math
from fractions import Fraction

from kvjax.memory import accounting as acc

__all__ = ["WindowCacheBytes", "window_cache_bytes", "ring_pages", "FULL_PRECISION"]

FULL_PRECISION = ("bf16", "fp16", "fp32")  # the page dtypes window-only pages take


def ring_pages(window: int, chunk: int, page_size: int) -> int:
    """Pages one sequence of a window-only local layer holds: `kvjax.specs.ring_pages`.

    (Imported from `kvjax.specs` when called, so that importing `kvjax.memory` does not
    import JAX: one formula, the cache's.)
    """
    from kvjax.specs import ring_pages as cache_ring_pages

    for name, v in (("window", window), ("chunk", chunk), ("page_size", page_size)):
        acc._check_int(name, v, minimum=1)
    return cache_ring_pages(window, chunk, page_size)


@dataclasses.dataclass(frozen=True, kw_only=True)
class WindowCacheBytes:
    """KV bytes of a sliding-window preset at one context, both layouts.

    Per-sequence fields; the `batch_*` properties multiply by `batch`.

    Args:
      context: tokens per sequence.
      batch: sequences.
      page_size: tokens per page.
      chunk: the most tokens one reserve adds (the prefill chunk).
      window: the local layers' window.
      local_layers, global_layers: layers of each kind.
      context_pages: pages per layer of a full-context sequence, ceil(context / page_size).
      ring_pages: pages per local layer with window-only pages (`ring_pages`).
      page_bytes: bytes of one page of one layer (K and V).
    """

    context: int
    batch: int
    page_size: int
    chunk: int
    window: int
    local_layers: int
    global_layers: int
    context_pages: int
    ring_pages: int
    page_bytes: Fraction

    @property
    def window_pages(self) -> int:
        """Pages a local layer holds per sequence with window-only pages."""
        return min(self.context_pages, self.ring_pages)

    @property
    def local_full_bytes(self) -> Fraction:
        """The local layers' KV, every page kept."""
        return self.local_layers * self.context_pages * self.page_bytes

    @property
    def local_window_bytes(self) -> Fraction:
        """The local layers' KV with window-only pages."""
        return self.local_layers * self.window_pages * self.page_bytes

    @property
    def global_bytes(self) -> Fraction:
        """The global layers' KV (all pages in both layouts)."""
        return self.global_layers * self.context_pages * self.page_bytes

    @property
    def full_bytes(self) -> Fraction:
        return self.global_bytes + self.local_full_bytes

    @property
    def window_bytes(self) -> Fraction:
        return self.global_bytes + self.local_window_bytes

    def batch_bytes(self, per_sequence: Fraction) -> Fraction:
        return self.batch * per_sequence


def window_cache_bytes(
    preset,
    context: int,
    *,
    batch: int = 1,
    fmt: acc.KVFormat | str = "bf16",
    page_size: int = 16,
    chunk: int = 256,
) -> WindowCacheBytes:
    """Full-context and window-only KV bytes of a sliding-window preset.

    Args:
      preset: a `ModelPreset` with `sliding_window` set.
      context: tokens per sequence.
      batch: sequences.
      fmt: a full-precision KV format (bf16, fp16, fp32 or a float width).
      page_size: tokens per page.
      chunk: the prefill chunk (the most tokens one reserve adds to a sequence).

    Raises:
      ValueError: a preset without local layers, a quantized format, or bad counts.
    """
    if getattr(preset, "sliding_window", None) is None:
        raise ValueError(f"window_cache_bytes: {getattr(preset, 'name', preset)!r} has no "
                         f"sliding-window layers.")
    fmt = acc.as_kv_format(fmt)
    if fmt.name not in FULL_PRECISION or fmt.group_size is not None or fmt.residual:
        raise ValueError(f"window_cache_bytes: kvjax builds window-only pages for "
                         f"full-precision caches ({', '.join(FULL_PRECISION)}); got "
                         f"{fmt.describe()}.")
    acc._check_int("context", context, minimum=0)
    acc._check_int("batch", batch, minimum=1)
    return WindowCacheBytes(
        context=context, batch=batch, page_size=page_size, chunk=chunk,
        window=preset.sliding_window, local_layers=preset.local_layers,
        global_layers=preset.kv_layers - preset.local_layers,
        context_pages=math.ceil(context / page_size),
        ring_pages=ring_pages(preset.sliding_window, chunk, page_size),
        page_bytes=page_size * acc.bytes_per_token_per_layer(preset.attention, fmt))
