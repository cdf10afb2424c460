"""Bytes of a KV cache split between accelerator memory and a host-memory tier.

The oldest pages of each sequence live in host RAM and are streamed back to
the device for attention; the newest stay on the device. For a sequence of
L tokens (`context`), page size P and host fraction F (0 <= F < 1):

    host pages   H = min(floor(F * L / P), M)
    host tokens  = P * H
    movable pages M = floor(max(L - R, 0) / P)

R is the format's KIVI residual (`KVFormat.residual`, 0 for float formats).
M is the number of quantized pages in kvjax's quantized layout
(`kvjax.cache.quantized`: the first P * floor(max(L - R, 0) / P) tokens are
quantized pages, the rest sit in each slot's bf16 ring of R + P tokens).
Only those pages can move: the ring is rewritten every step. Without a
residual M = floor(L / P), the whole pages of the sequence, so the cap never
binds (F < 1).

Bytes follow `accounting`: a host token costs `bytes_per_token` (quantized,
scale and zero included) and device bytes are `bytes_per_sequence(L)` minus the
host bytes, so device + host is the "KV per sequence" the `memory` CLI prints
above its host-tier block.

Every decode step reads every host-resident token of every layer once, for
the whole batch, so the host->device traffic of one step is the batch's host
bytes.

Pure Python: no JAX import. Byte counts are exact `Fraction`s.
"""

import dataclasses
import math
from fractions import Fraction

from kvjax.memory import accounting as acc

__all__ = ["HostTier", "host_tier_bytes"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostTier:
    """Where one batch's KV bytes live with a host tier; see the module docstring.

    Args:
      context: tokens per sequence (L).
      batch: sequences.
      page_size: tokens per page (P).
      host_fraction: F, as an exact `Fraction`.
      movable_pages: pages per sequence allowed on the host (M).
      host_pages: pages per sequence on the host (H).
      host_tokens: tokens per sequence on the host, P * H.
      host_bytes: bytes per sequence on the host, all layers.
      device_bytes: bytes per sequence on the device, all layers.
    """

    context: int
    batch: int
    page_size: int
    host_fraction: Fraction
    movable_pages: int
    host_pages: int
    host_tokens: int
    host_bytes: Fraction
    device_bytes: Fraction

    @property
    def device_tokens(self) -> int:
        """Tokens per sequence left on the device."""
        return self.context - self.host_tokens

    @property
    def capped(self) -> bool:
        """True if the KIVI ring, not F, limits the host pages."""
        return self.movable_pages < math.floor(self.host_fraction * self.context / self.page_size)

    @property
    def batch_host_bytes(self) -> Fraction:
        """Host bytes of the whole batch."""
        return self.batch * self.host_bytes

    @property
    def batch_device_bytes(self) -> Fraction:
        """Device bytes of the whole batch."""
        return self.batch * self.device_bytes

    @property
    def transfer_bytes_per_step(self) -> Fraction:
        """Host->device bytes of one decode step: every host token of every layer, once."""
        return self.batch_host_bytes

    def step_seconds(self, *, host_gbps: float, hbm_gbps: float) -> tuple[float, float]:
        """Seconds one decode step spends reading the KV cache, per tier.

        A lower bound on reading the KV cache only (no weights, no compute).
        The sequential bound is the sum of the two; if the transfer overlaps the
        device reads perfectly, the larger of the two.

        Args:
          host_gbps: host->device bandwidth in GB/s (10^9 bytes per second).
          hbm_gbps: device memory bandwidth in GB/s.

        Returns:
          (host bytes / host bandwidth, device bytes / HBM bandwidth) for the batch.
        """
        for name, value in (("host_gbps", host_gbps), ("hbm_gbps", hbm_gbps)):
            if isinstance(value, bool) or not isinstance(value, int | float | Fraction) or not (
                0 < value < math.inf
            ):
                raise ValueError(f"{name} must be a positive finite number, got {value!r}.")
        return (
            float(self.batch_host_bytes / Fraction(host_gbps)) / acc.GB,
            float(self.batch_device_bytes / Fraction(hbm_gbps)) / acc.GB,
        )


def _as_fraction(x: object) -> Fraction:
    """Exact value of `x`; a float is read as the decimal it prints as (0.3 -> 3/10)."""
    if isinstance(x, bool):
        raise TypeError
    if isinstance(x, float):
        return Fraction(repr(x))
    return Fraction(x)


def host_tier_bytes(
    spec: acc.CacheGeometry,
    num_layers: int,
    context: int,
    *,
    host_fraction: float | Fraction,
    page_size: int = 16,
    batch: int = 1,
    fmt: acc.KVFormat | str = "bf16",
) -> HostTier:
    """Splits a batch's KV bytes between the device and a host-memory tier.

    Args:
      spec: an `AttentionSpec` or `MLASpec` (anything with `cache_heads` and
        `cache_widths`).
      num_layers: layers, each with its own cache.
      context: tokens per sequence, >= 1.
      host_fraction: F in [0, 1), the oldest share of each sequence to hold on
        the host; a float is read as the decimal it prints as, so 0.3 is 3/10.
      page_size: tokens per page; only whole pages move.
      batch: sequences, >= 1.
      fmt: element format; its `residual` keeps a bf16 ring on the device.

    Returns:
      A `HostTier`.

    Raises:
      ValueError: for F outside [0, 1) or a non-positive context, page size,
        batch or layer count.
    """
    acc._check_int("context", context, minimum=1)
    acc._check_int("page_size", page_size, minimum=1)
    acc._check_int("batch", batch, minimum=1)
    fmt = acc.as_kv_format(fmt)
    try:
        f = _as_fraction(host_fraction)
    except (TypeError, ValueError, OverflowError):
        f = None
    if f is None or not 0 <= f < 1:
        raise ValueError(
            f"host_fraction must be a number in [0, 1) (0: no host tier), got {host_fraction!r}."
        )
    movable = max(context - fmt.residual, 0) // page_size
    host_pages = min(math.floor(f * context / page_size), movable)
    host_tokens = page_size * host_pages
    host = host_tokens * acc.bytes_per_token(spec, num_layers, fmt)
    total = acc.bytes_per_sequence(spec, num_layers, context, fmt)
    return HostTier(
        context=context,
        batch=batch,
        page_size=page_size,
        host_fraction=f,
        movable_pages=movable,
        host_pages=host_pages,
        host_tokens=host_tokens,
        host_bytes=host,
        device_bytes=total - host,
    )
