"""Exact byte accounting for KV caches.

What one cached token costs, per layer and for a whole model, for any attention
geometry and any element width, including sub-byte codes with per-group
quantization metadata.

Elements cached per token and layer:

* MHA / GQA / MQA (`AttentionSpec`): K and V, each `kv_heads x head_dim`, so
  `2 * kv_heads * head_dim`.
* MLA (`MLASpec`): one latent "head", the compressed `c_KV` (`kv_lora_rank`)
  plus the shared rotary key (`qk_rope_head_dim`), so
  `kv_lora_rank + qk_rope_head_dim` (DeepSeek-V2, arXiv 2405.04434, Table 1).

Both come out of the specs' own `cache_heads * sum(cache_widths)`, so this
module reads any spec that describes its cache that way and never imports
`kvjax.specs` (which pulls in JAX): `import kvjax.memory` stays fast.

Return types: element counts are `int`; bits and bytes are exact
`fractions.Fraction` (a 2-bit code is a quarter of a byte, and a 16-bit scale
shared by 32 elements is half a bit per element, so integers cannot hold them).
A `Fraction` compares equal to the `int` of the same value and prints as one
when it is whole. Ratios meant for display are `float`. Byte counts are the
information content before any padding a concrete layout adds when it packs
codes into a container word.
"""

import dataclasses
import types
from collections.abc import Mapping
from fractions import Fraction
from typing import Protocol

__all__ = [
    "DTYPE_BITS",
    "GB",
    "GiB",
    "KVFormat",
    "as_kv_format",
    "bytes_per_batch",
    "bytes_per_sequence",
    "bytes_per_token",
    "bytes_per_token_per_layer",
    "dtype_bits",
    "elements_per_token_per_layer",
    "format_bytes",
    "kv_format",
    "reduction",
    "weight_bytes",
]

GB = 10**9  # decimal gigabyte, as disk and accelerator vendors quote memory
GiB = 2**30  # binary gibibyte, as `nvidia-smi` and most allocators report it

DTYPE_BITS: Mapping[str, int] = types.MappingProxyType(
    {
        "fp32": 32,
        "bf16": 16,
        "fp16": 16,
        "fp8": 8,
        "int8": 8,
        "int4": 4,
        "int2": 2,
    }
)
"""Element width in bits for each dtype name the accounting understands."""

# NumPy / JAX spellings, so a `CacheSpec.dtype.name` can be passed straight in.
_ALIASES = types.MappingProxyType(
    {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float8": "fp8"}
)

# Tokens in the full-precision residual tail are stored at this width.
_RESIDUAL_BITS = DTYPE_BITS["bf16"]


class CacheGeometry(Protocol):
    """What the accounting needs from a spec; `AttentionSpec` and `MLASpec` have it."""

    @property
    def cache_heads(self) -> int: ...

    @property
    def cache_widths(self) -> tuple[int, int]: ...


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {kind}, got {value!r}.")


def dtype_bits(name: str) -> int:
    """Returns the element width in bits of a dtype name.

    Args:
      name: one of `DTYPE_BITS` ('fp32', 'bf16', 'fp16', 'fp8', 'int8', 'int4',
        'int2'), case-insensitive, or a NumPy spelling ('float32', 'bfloat16',
        'float16').

    Returns:
      The width in bits, an `int`.

    Raises:
      ValueError: for an unknown name; the message lists the known ones.
    """
    key = str(name).lower()
    key = _ALIASES.get(key, key)
    if key not in DTYPE_BITS:
        raise ValueError(
            f"Unknown KV dtype {name!r}; known dtypes: {', '.join(DTYPE_BITS)}. "
            f"For another width pass bits=N explicitly."
        )
    return DTYPE_BITS[key]


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVFormat:
    """How each cached element is stored.

    Args:
      bits: width of one stored code (or float), any positive int: 2, 4, 6, 8,
        16, 32 are the usual ones.
      group_size: if set, every `group_size` elements share one scale and one
        zero point of `scale_bits` each (asymmetric quantization), which costs
        `2 * scale_bits / group_size` extra bits per element. KIVI
        (arXiv 2402.02750) groups keys per channel along `group_size` tokens and
        values per token along `group_size` channels; either way one group
        holds `group_size` elements, so the overhead per element is the same.
      scale_bits: width of each scale and each zero point (16 for bf16/fp16).
      residual: tokens of each sequence kept in full precision (bf16) instead of
        `bits`: the KIVI tail of recent tokens. 0 means no tail. Only the
        per-sequence and per-batch totals see it; per-token figures describe a
        token that has been quantized.
      name: label for display only; two formats with the same numbers are equal
        whatever their names.
    """

    bits: int
    group_size: int | None = None
    scale_bits: int = 16
    residual: int = 0
    name: str | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        _check_int("KVFormat.bits", self.bits, minimum=1)
        if self.group_size is not None:
            _check_int("KVFormat.group_size", self.group_size, minimum=1)
        _check_int("KVFormat.scale_bits", self.scale_bits, minimum=1)
        _check_int("KVFormat.residual", self.residual, minimum=0)

    @property
    def overhead_bits_per_element(self) -> Fraction:
        """Scale and zero bits amortised over one group, per element."""
        if self.group_size is None:
            return Fraction(0)
        return Fraction(2 * self.scale_bits, self.group_size)

    @property
    def bits_per_element(self) -> Fraction:
        """Average stored bits per quantized element, metadata included."""
        return self.bits + self.overhead_bits_per_element

    def describe(self) -> str:
        """A short label, e.g. 'int2 (2 bits + 16-bit scale/zero per 32 = 3 bits/element)'."""
        label = self.name or f"{self.bits}-bit"
        if self.group_size is None:
            text = f"{label} ({self.bits} bits/element"
        else:
            text = (
                f"{label} ({self.bits} bits + {self.scale_bits}-bit scale/zero per "
                f"{self.group_size} = {_fmt_fraction(self.bits_per_element)} bits/element"
            )
        if self.residual:
            text += f", last {self.residual} tokens bf16"
        return text + ")"


def kv_format(
    dtype: str = "bf16",
    *,
    bits: int | None = None,
    group_size: int | None = None,
    scale_bits: int = 16,
    residual: int = 0,
) -> KVFormat:
    """Builds a `KVFormat` from a dtype name, optionally overriding its width.

    Args:
      dtype: a name from `DTYPE_BITS`; used as the label and, unless `bits` is
        given, for the width.
      bits: explicit width, e.g. 6 for DeepSeek-V2's ~6-bit deployed KV cache.
      group_size: elements sharing one scale and zero; None for no metadata.
      scale_bits: width of each scale and each zero point.
      residual: full-precision tail length in tokens.

    Returns:
      The `KVFormat`.

    Raises:
      ValueError: for an unknown dtype name or a non-positive width.
    """
    if bits is None:
        bits = dtype_bits(dtype)
        name = str(dtype).lower()
        name = _ALIASES.get(name, name)
    else:
        name = f"{bits}-bit"
    return KVFormat(
        bits=bits, group_size=group_size, scale_bits=scale_bits, residual=residual, name=name
    )


def as_kv_format(fmt: "KVFormat | str") -> KVFormat:
    """Returns `fmt` if it is a `KVFormat`, else `kv_format(fmt)` for a dtype name."""
    if isinstance(fmt, KVFormat):
        return fmt
    if isinstance(fmt, str):
        return kv_format(fmt)
    raise TypeError(f"Expected a KVFormat or a dtype name, got {type(fmt).__name__}: {fmt!r}.")


def elements_per_token_per_layer(spec: CacheGeometry) -> int:
    """Cached elements per token in one layer.

    Args:
      spec: an `AttentionSpec` (gives `2 * kv_heads * head_dim`) or an `MLASpec`
        (gives `kv_lora_rank + qk_rope_head_dim`).

    Returns:
      An `int`.
    """
    try:
        heads, widths = spec.cache_heads, spec.cache_widths
    except AttributeError as e:
        raise TypeError(
            f"Expected an AttentionSpec or MLASpec (anything with cache_heads and "
            f"cache_widths), got {type(spec).__name__}."
        ) from e
    return int(heads) * sum(int(w) for w in widths)


def bytes_per_token_per_layer(spec: CacheGeometry, fmt: KVFormat | str = "bf16") -> Fraction:
    """Bytes one quantized token occupies in one layer, as an exact `Fraction`."""
    return elements_per_token_per_layer(spec) * as_kv_format(fmt).bits_per_element / 8


def bytes_per_token(
    spec: CacheGeometry, num_layers: int, fmt: KVFormat | str = "bf16"
) -> Fraction:
    """Bytes one quantized token occupies across `num_layers` layers, as a `Fraction`."""
    _check_int("num_layers", num_layers, minimum=1)
    return num_layers * bytes_per_token_per_layer(spec, fmt)


def _split_tokens(fmt: KVFormat, tokens: int) -> tuple[int, int]:
    """Splits a sequence into (quantized, full-precision tail) token counts.

    The tail is the most recent `min(residual, tokens)` tokens. This is the one
    place that decides how the tail is counted, so a finer model (KIVI flushes
    the tail a group at a time, so it holds between R and R + G - 1 tokens)
    changes only this function.
    """
    tail = min(fmt.residual, tokens)
    return tokens - tail, tail


def bytes_per_sequence(
    spec: CacheGeometry, num_layers: int, tokens: int, fmt: KVFormat | str = "bf16"
) -> Fraction:
    """Bytes of one sequence of `tokens` tokens, as an exact `Fraction`.

    Tokens in the format's residual tail are counted at bf16 with no metadata.
    """
    fmt = as_kv_format(fmt)
    _check_int("tokens", tokens, minimum=0)
    quantized, tail = _split_tokens(fmt, tokens)
    full = dataclasses.replace(fmt, bits=_RESIDUAL_BITS, group_size=None, residual=0)
    return quantized * bytes_per_token(spec, num_layers, fmt) + tail * bytes_per_token(
        spec, num_layers, full
    )


def bytes_per_batch(
    spec: CacheGeometry,
    num_layers: int,
    tokens: int,
    batch: int,
    fmt: KVFormat | str = "bf16",
) -> Fraction:
    """Bytes of `batch` sequences of `tokens` tokens each, as an exact `Fraction`."""
    _check_int("batch", batch, minimum=1)
    return batch * bytes_per_sequence(spec, num_layers, tokens, fmt)


def weight_bytes(num_params: int, fmt: KVFormat | str = "bf16") -> Fraction:
    """Bytes of `num_params` weights stored in `fmt`, as an exact `Fraction`."""
    _check_int("num_params", num_params, minimum=1)
    return num_params * as_kv_format(fmt).bits_per_element / 8


_DECIMAL = ((10**12, "TB"), (10**9, "GB"), (10**6, "MB"), (10**3, "kB"), (1, "B"))
_BINARY = ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"), (1, "B"))


def format_bytes(num_bytes: float | Fraction, *, binary: bool = False) -> str:
    """Formats a byte count with the largest unit that keeps it >= 1.

    Args:
      num_bytes: the count.
      binary: powers of 1024 (KiB, MiB, GiB, TiB) if True, else powers of 1000
        (kB, MB, GB, TB).

    Returns:
      A string such as '21.47 GB' or '20.00 GiB'.
    """
    value = float(num_bytes)
    for scale, unit in _BINARY if binary else _DECIMAL:
        if abs(value) >= scale or scale == 1:
            if scale == 1:
                return f"{_fmt_fraction(Fraction(num_bytes))} B"
            return f"{value / scale:.2f} {unit}"
    raise AssertionError("unreachable")


def _fmt_fraction(x: Fraction) -> str:
    """'3' for whole values, '2.5' for others: readable, no '5/2'."""
    x = Fraction(x)
    if x.denominator == 1:
        return str(x.numerator)
    return f"{float(x):.4g}"


def reduction(new: float | Fraction, baseline: float | Fraction) -> float:
    """Fraction saved going from `baseline` to `new`: `1 - new / baseline`."""
    if baseline == 0:
        raise ValueError("reduction: baseline must be non-zero.")
    return 1.0 - float(Fraction(new) / Fraction(baseline))
