"""Bytes of kvjax's concrete cache layouts, and how many tokens or sequences fit in a budget.

`accounting` counts the information content of a token; this module counts
what kvjax actually allocates, so its numbers match `benchmarks/capacity.py`:

* contiguous: every sequence reserves `max_len` tokens up front;
* paged: a sequence of L tokens holds ceil(L / page_size) pages;
* paged and quantized (`KVFormat` with a `group_size`, the layout of
  `kvjax.cache.quantized`): the first Q = page_size * floor(max(L - R, 0) /
  page_size) tokens sit in quantized pages; every sequence slot also owns a
  full-precision ring of R + page_size tokens (R = `fmt.residual`) that holds
  the rest. A quantized page stores b-bit codes for each element plus one
  scale and one zero (`scale_bits` each) per group of G elements: keys per
  channel over G tokens, values (and MLA's latent c_KV) per token over G
  channels. MLA's rotary key stays at the tail's precision (bf16) in every page.

Pure Python: no JAX import. Byte counts are exact `Fraction`s (whole numbers
for every real layout, since codes pack into whole bytes per page).
"""

import math
from collections.abc import Sequence
from fractions import Fraction

from kvjax.memory.accounting import KVFormat, as_kv_format

__all__ = [
    "TAIL_BITS",
    "is_quantized",
    "page_bytes",
    "tail_bytes",
    "pages_held",
    "sequence_bytes",
    "paged_cache_bytes",
    "contiguous_cache_bytes",
    "tokens_in_budget",
    "sequences_in_budget",
    "length_spread",
]

TAIL_BITS = 16
"""Width of the full-precision tail and of MLA's k_rope in a quantized cache (bf16)."""


def is_quantized(fmt: KVFormat | str) -> bool:
    """True for formats laid out as kvjax quantized pages: those with a `group_size`."""
    return as_kv_format(fmt).group_size is not None


def _geometry(spec) -> tuple[int, int, int, bool]:
    try:
        heads, (wa, wb) = int(spec.cache_heads), spec.cache_widths
    except AttributeError as e:
        raise TypeError(
            f"Expected an AttentionSpec or MLASpec, got {type(spec).__name__}."
        ) from e
    return heads, int(wa), int(wb), getattr(spec, "kind", None) == "MLA"


def _check(name: str, value: object, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}.")


def page_bytes(spec, num_layers: int, page_size: int, fmt: KVFormat | str = "bf16") -> Fraction:
    """Bytes one page id costs across all layers (K and V, or c_KV and k_rope).

    Args:
      spec: `AttentionSpec` or `MLASpec`.
      num_layers: layers sharing the page table.
      page_size: tokens per page.
      fmt: element format; with a `group_size` the quantized layout described above.
    """
    fmt = as_kv_format(fmt)
    _check("num_layers", num_layers)
    _check("page_size", page_size)
    heads, wa, wb, mla = _geometry(spec)
    if not is_quantized(fmt):
        return Fraction(num_layers * heads * page_size * (wa + wb) * fmt.bits, 8)
    quantized = [wa] if mla else [wa, wb]
    full = [wb] if mla else []
    bits = sum(page_size * w * (fmt.bits + Fraction(2 * fmt.scale_bits, fmt.group_size))
               for w in quantized)
    bits += sum(page_size * w * TAIL_BITS for w in full)
    return num_layers * heads * bits / 8


def tail_bytes(spec, num_layers: int, page_size: int, fmt: KVFormat | str = "bf16") -> Fraction:
    """Bytes of one slot's full-precision ring (R + page_size tokens); 0 if not quantized."""
    fmt = as_kv_format(fmt)
    if not is_quantized(fmt):
        return Fraction(0)
    heads, wa, wb, _ = _geometry(spec)
    return Fraction(num_layers * heads * (fmt.residual + page_size) * (wa + wb) * TAIL_BITS, 8)


def pages_held(length: int, page_size: int, fmt: KVFormat | str = "bf16") -> int:
    """Pages a sequence of `length` tokens holds: ceil(L / ps), or its quantized pages."""
    fmt = as_kv_format(fmt)
    _check("length", length, 0)
    if not is_quantized(fmt):
        return -(-length // page_size)
    return max(length - fmt.residual, 0) // page_size


def sequence_bytes(spec, num_layers: int, length: int, *, page_size: int,
                   fmt: KVFormat | str = "bf16") -> Fraction:
    """Bytes one sequence of `length` tokens costs: its pages plus its slot's ring."""
    return (pages_held(length, page_size, fmt) * page_bytes(spec, num_layers, page_size, fmt)
            + tail_bytes(spec, num_layers, page_size, fmt))


def paged_cache_bytes(spec, num_layers: int, *, page_size: int, num_pages: int, max_seqs: int,
                      fmt: KVFormat | str = "bf16") -> Fraction:
    """Bytes of a paged cache's pools: `num_pages` pages plus `max_seqs` rings."""
    _check("num_pages", num_pages)
    _check("max_seqs", max_seqs)
    return (num_pages * page_bytes(spec, num_layers, page_size, fmt)
            + max_seqs * tail_bytes(spec, num_layers, page_size, fmt))


def contiguous_cache_bytes(spec, num_layers: int, *, max_len: int, max_seqs: int,
                           fmt: KVFormat | str = "bf16") -> Fraction:
    """Bytes of a contiguous cache: every one of `max_seqs` slots reserves `max_len` tokens."""
    _check("max_len", max_len)
    return max_seqs * page_bytes(spec, num_layers, max_len, as_kv_format(fmt))


def tokens_in_budget(spec, num_layers: int, budget: int | Fraction, *, seq_len: int,
                     page_size: int, fmt: KVFormat | str = "bf16") -> int:
    """Tokens that fit in `budget` bytes as whole sequences of `seq_len` tokens (paged layout)."""
    _check("seq_len", seq_len)
    per_seq = sequence_bytes(spec, num_layers, seq_len, page_size=page_size, fmt=fmt)
    return math.floor(Fraction(budget) / per_seq) * seq_len


def sequences_in_budget(spec, num_layers: int, budget: int | Fraction, lengths: Sequence[int],
                        *, page_size: int | None, fmt: KVFormat | str = "bf16",
                        max_len: int | None = None) -> tuple[int, int]:
    """How many of `lengths`, taken in order, fit in `budget` bytes.

    Args:
      page_size: tokens per page, or None for a contiguous cache reserving
        `max_len` (default: the longest length) per sequence.

    Returns:
      (sequences, tokens) admitted before the first that does not fit.
    """
    budget = Fraction(budget)
    used, n, tokens = Fraction(0), 0, 0
    if page_size is None:
        max_len = max(lengths) if max_len is None else max_len
        cost = [contiguous_cache_bytes(spec, num_layers, max_len=max_len, max_seqs=1, fmt=fmt)
                ] * len(lengths)
    else:
        cost = [sequence_bytes(spec, num_layers, n_tok, page_size=page_size, fmt=fmt)
                for n_tok in lengths]
    for c, n_tok in zip(cost, lengths, strict=True):
        if used + c > budget:
            break
        used += c
        n += 1
        tokens += n_tok
    return n, tokens


def length_spread(num_seqs: int, max_len: int, *, seed: int = 0, min_len: int = 16) -> list[int]:
    """A realistic, reproducible spread of sequence lengths for capacity comparisons.

    Lengths are log-normal with median `max_len / 6` and shape 0.8 (a long
    right tail, as prompt + generation lengths of chat traffic have), clipped
    to [min_len, max_len] and rounded to ints.
    """
    import random

    _check("num_seqs", num_seqs)
    _check("max_len", max_len)
    r = random.Random(seed)
    mu = math.log(max_len / 6)
    return [min(max_len, max(min_len, round(r.lognormvariate(mu, 0.8))))
            for _ in range(num_seqs)]
