"""How much memory a contiguous cache wastes compared with a paged one.

A contiguous cache must reserve the maximum length for every sequence up
front, because it cannot grow a sequence's slab in place; a paged cache
(PagedAttention, arXiv 2309.06180) allocates fixed-size pages on demand, so
only the last, partly filled page of each sequence is waste. This module
counts both for a list of sequence lengths.
"""

import dataclasses
from collections.abc import Sequence
from fractions import Fraction

__all__ = ["PagingWaste", "paging_waste"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PagingWaste:
    """Bytes reserved by a contiguous and a paged cache, and bytes actually used.

    All three byte counts are exact `Fraction`s (whole numbers unless the bytes
    per token are fractional); the ratios are `float`s.

    Args:
      contiguous_bytes: every sequence reserves `max_len` tokens.
      paged_bytes: every sequence holds `ceil(length / page_size)` pages.
      used_bytes: the tokens actually present.
      num_seqs: sequences simulated.
      max_len: tokens each sequence reserves in the contiguous cache.
      page_size: tokens per page in the paged cache.
    """

    contiguous_bytes: Fraction
    paged_bytes: Fraction
    used_bytes: Fraction
    num_seqs: int
    max_len: int
    page_size: int

    @property
    def contiguous_waste(self) -> float:
        """Share of the contiguous reservation holding no token."""
        return _waste(self.used_bytes, self.contiguous_bytes)

    @property
    def paged_waste(self) -> float:
        """Share of the paged reservation holding no token."""
        return _waste(self.used_bytes, self.paged_bytes)

    @property
    def paged_over_contiguous(self) -> float:
        """Paged reservation as a share of the contiguous one (lower is better)."""
        if self.contiguous_bytes == 0:
            return 0.0
        return float(self.paged_bytes / self.contiguous_bytes)


def _waste(used: Fraction, reserved: Fraction) -> float:
    # Nothing reserved means nothing wasted, rather than 0/0.
    return 0.0 if reserved == 0 else float(1 - used / reserved)


def paging_waste(
    lengths: Sequence[int],
    *,
    page_size: int = 16,
    max_len: int | None = None,
    bytes_per_token: int | Fraction = 1,
) -> PagingWaste:
    """Simulates the reservations of a contiguous and a paged cache.

    Args:
      lengths: tokens in each sequence, each >= 0.
      page_size: tokens per page of the paged cache (vLLM's default is 16).
      max_len: tokens each sequence reserves in the contiguous cache; defaults
        to `max(lengths)`, the least a contiguous cache could reserve knowing
        every length in advance. Must be at least `max(lengths)`.
      bytes_per_token: multiplies every count; leave at 1 to count tokens, or
        pass e.g. `accounting.bytes_per_token(spec, layers, fmt)`.

    Returns:
      A `PagingWaste`.

    Raises:
      ValueError: for an empty or negative length, a non-positive page size, or
        a `max_len` shorter than the longest sequence.
    """
    lengths = list(lengths)
    if not lengths:
        raise ValueError("paging_waste: lengths must not be empty.")
    for n in lengths:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"paging_waste: lengths must be ints >= 0, got {n!r}.")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
        raise ValueError(f"paging_waste: page_size must be a positive int, got {page_size!r}.")
    longest = max(lengths)
    if max_len is None:
        max_len = longest
    elif isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < longest:
        raise ValueError(
            f"paging_waste: max_len must be an int >= the longest sequence ({longest}), "
            f"got {max_len!r}."
        )
    if Fraction(bytes_per_token) < 0:
        raise ValueError(f"paging_waste: bytes_per_token must be >= 0, got {bytes_per_token!r}.")

    bpt = Fraction(bytes_per_token)
    paged_tokens = sum(-(-n // page_size) * page_size for n in lengths)
    return PagingWaste(
        contiguous_bytes=len(lengths) * max_len * bpt,
        paged_bytes=paged_tokens * bpt,
        used_bytes=sum(lengths) * bpt,
        num_seqs=len(lengths),
        max_len=max_len,
        page_size=page_size,
    )
