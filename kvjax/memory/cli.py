"""`python -m kvjax memory`: how much memory a model's KV cache needs.

Examples:
  python -m kvjax memory --list
  python -m kvjax memory --model llama-2-70b --context 8192 --batch 8 --kv-dtype bf16
  python -m kvjax memory --model llama-3-8b --compare --group-size 32
  python -m kvjax memory --model mistral-7b --lengths 100,2000,4096 --context 8192
  python -m kvjax memory --model llama-3-8b --kv-dtype int2 --group 32 --residual 128 \
      --budget 16 --length-spread 64 --context 8192
  python -m kvjax memory --model llama-3-8b --context 131072 --batch 2 --host-fraction 0.9 \
      --host-bandwidth 55 --hbm-bandwidth 4800
  python -m kvjax memory --model qwen3-next-80b-a3b --context 262144 --compare
  python -m kvjax memory --model deepseek-v3.2 --context 131072 --batch 4
  python -m kvjax memory --model gemma-3-27b --context 131072 --compare
"""

import argparse
import functools
import math
from collections.abc import Sequence
from fractions import Fraction

from kvjax.memory import accounting as acc
from kvjax.memory import indexer as dsa
from kvjax.memory import linear_state as gdn
from kvjax.memory import window as swa
from kvjax.memory.host_tier import HostTier, host_tier_bytes
from kvjax.memory.paging import paging_waste
from kvjax.memory.presets import PRESETS, ModelPreset, get_preset

__all__ = ["add_parser", "run"]

_DEFAULT_CONTEXT = 4096
_COMPARE_DTYPES = ("bf16", "int8", "int4", "int2")
# The --budget, --lengths and --host-fraction blocks price KV pages only.
_KV_ONLY = "; not for {}, whose state or indexer keys it would leave out".format(
    " or ".join(p.name for p in PRESETS.values() if p.is_hybrid or p.indexer is not None))
_UNITS_LINE = (
    "units: decimal kB/MB/GB/TB = 10^3/10^6/10^9/10^12 bytes; "
    "binary KiB/MiB/GiB/TiB = 2^10/2^20/2^30/2^40 bytes"
)


# -- argument types: each raises ArgumentTypeError, which argparse turns into
# -- "argument --flag: <message>" and exit status 2.


def _int_at_least(minimum: int, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum:
        want = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    return _int_at_least(1, text)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def _host_fraction(text: str) -> Fraction:
    # Read as an exact decimal, so that e.g. 0.3 of 160 tokens is 48 tokens, not 47.99...
    try:
        value = Fraction(text.strip())
    except (ValueError, ZeroDivisionError):
        value = None
    if value is None or not 0 <= value < 1:
        raise argparse.ArgumentTypeError(
            f"must be a number in [0, 1) (the share of each sequence held in host memory; "
            f"0 = no host tier), got {text!r}"
        )
    return value


def _model(text: str) -> ModelPreset:
    try:
        return get_preset(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _dtype(text: str, hint: str = "") -> str:
    try:
        acc.dtype_bits(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"unknown dtype {text!r}; allowed: {', '.join(acc.DTYPE_BITS)}{hint}"
        ) from None
    return acc.kv_format(text).name


def _kv_dtype(text: str) -> str:
    return _dtype(text, " (or give any width with --kv-bits N)")


def _lengths(text: str) -> list[int]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {text!r}")
    out = []
    for p in parts:
        try:
            out.append(_int_at_least(0, p))
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(
                f"each length must be an integer >= 0, got {p!r} in {text!r}"
            ) from None
    return out


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Registers the `memory` subcommand on `subparsers` and returns its parser."""
    p = subparsers.add_parser(
        "memory",
        help="KV cache and weight memory of a model preset",
        description=(
            "Prints the KV cache bytes per token, per sequence and per batch of a real model, "
            "its weight bytes and the KV/weights ratio; optionally compares MHA/GQA/MQA/MLA "
            "caches across dtypes, simulates paging waste and splits the cache between the device "
            "and a host-memory tier. "
            "For a hybrid model (qwen3-next-80b-a3b) it also prints the fixed linear-attention "
            "state beside the KV of the full-attention layers; for a DeepSeek Sparse Attention "
            "model (deepseek-v3.2) the lightning indexer's key cache beside the MLA latent cache "
            "and the bytes one decode step reads with DSA against dense MLA. "
            "For a sliding-window model (gemma-2-*, gemma-3-*) --compare also prints the local "
            "layers' KV with every page kept against window-only pages. "
            "Decimal units (GB = 10^9 bytes) and binary units (GiB = 2^30 bytes) are both shown."
        ),
        epilog=__doc__.split("\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model", type=_model, metavar="NAME",
        help=f"model preset, case-insensitive; one of: {', '.join(PRESETS)}",
    )
    p.add_argument(
        "--list", action="store_true",
        help="list the model presets (kind, layers, heads, params, KV bytes per token and any "
        "fixed state or indexer cache) and exit",
    )
    p.add_argument(
        "--context", type=_positive_int, default=None, metavar="TOKENS",
        help=f"tokens per sequence (default {_DEFAULT_CONTEXT}); with --lengths, the length a "
        "contiguous cache reserves per sequence (default: the longest length)",
    )
    p.add_argument(
        "--batch", type=_positive_int, default=1, metavar="N",
        help="sequences decoded together (default 1)",
    )
    p.add_argument(
        "--kv-dtype", type=_kv_dtype, default="bf16", metavar="DTYPE",
        help=f"KV cache element type, one of: {', '.join(acc.DTYPE_BITS)} (default bf16)",
    )
    p.add_argument(
        "--kv-bits", type=_positive_int, default=None, metavar="BITS",
        help="KV element width in bits, overriding --kv-dtype (e.g. 6 for DeepSeek-V2's "
        "~6-bit deployed cache)",
    )
    p.add_argument(
        "--group-size", "--group", type=_positive_int, default=None, metavar="G",
        help="elements sharing one scale and one zero point (KIVI: G tokens per key channel, "
        "G channels per value token); adds 2*scale_bits/G bits per element to integer "
        "KV dtypes (default: no scale/zero overhead)",
    )
    p.add_argument(
        "--residual", type=lambda t: _int_at_least(0, t), default=0, metavar="R",
        help="KIVI full-precision tail: the most recent R tokens of each sequence stay bf16 "
        "(integer KV dtypes only; a multiple of --page-size for --budget and --host-fraction; "
        "default 0)",
    )
    p.add_argument(
        "--budget", type=_positive_float, default=None, metavar="GIB",
        help="KV memory budget in GiB: print how many tokens (whole sequences of --context "
        "tokens) and how many sequences of --lengths/--length-spread fit with contiguous "
        "bf16, paged bf16 and paged int8/int4/int2 caches in kvjax's layout (quantized "
        "pages with scale/zero per group of --group elements, default min(32, --page-size), "
        "plus a bf16 ring "
        "of --residual + --page-size tokens per sequence)" + _KV_ONLY,
    )
    p.add_argument(
        "--scale-bits", type=_positive_int, default=16, metavar="BITS",
        help="bits of each scale and each zero point when --group-size is set (default 16)",
    )
    p.add_argument(
        "--weight-dtype", type=_dtype, default="bf16", metavar="DTYPE",
        help=f"weight element type, one of: {', '.join(acc.DTYPE_BITS)} (default bf16)",
    )
    p.add_argument(
        "--compare", action="store_true",
        help="compare bytes per token of MHA (kv_heads = q_heads), the model's own cache, MQA "
        f"and an MLA variant (d_c = 4*head_dim, d_rope = head_dim/2) across "
        f"{', '.join(_COMPARE_DTYPES)}; for a hybrid model instead compare its state + KV per "
        "sequence and per batch with a dense GQA model of the same width (every layer full "
        "attention with the same KV heads, head_dim and KV dtype); for a sliding-window "
        "model also the KV of its local layers with every page kept against window-only "
        "pages (a ring of ceil((window + chunk - 2) / page_size) + 1 pages per local layer "
        "and sequence, kvjax.generate.CacheConfig(window_pages=True)), in --page-size pages",
    )
    p.add_argument(
        "--chunk", type=_positive_int, default=256, metavar="TOKENS",
        help="sliding-window models with --compare: the prefill chunk, the most tokens one "
        "step adds to a sequence, which the window-only ring must also hold (default 256, "
        "kvjax.generate's chunk_size)",
    )
    p.add_argument(
        "--state-dtype", type=_dtype, default=None, metavar="DTYPE",
        help="hybrid models only: dtype of the Gated DeltaNet recurrent state (default "
        f"{gdn.RECURRENT_STATE_DTYPE}, as transformers keeps it)",
    )
    p.add_argument(
        "--conv-dtype", type=_dtype, default=None, metavar="DTYPE",
        help="hybrid models only: dtype of the Gated DeltaNet conv state (default "
        f"{gdn.CONV_STATE_DTYPE}, the activations' dtype in transformers)",
    )
    p.add_argument(
        "--indexer-dtype", type=_dtype, default=None, metavar="DTYPE",
        help="DSA models only: dtype of the lightning indexer's cached keys (default "
        f"{dsa.INDEXER_DTYPE}, as transformers caches them; DeepSeek's kernels use fp8 plus a "
        "float32 scale per block, not counted here)",
    )
    spread = p.add_mutually_exclusive_group()
    spread.add_argument(
        "--lengths", type=_lengths, default=None, metavar="L1,L2,...",
        help="comma-separated sequence lengths: print the memory a contiguous cache reserves "
        "against a paged one and against what the tokens use" + _KV_ONLY,
    )
    spread.add_argument(
        "--length-spread", type=_positive_int, default=None, metavar="N",
        help="like --lengths with N sequences whose lengths are spread evenly up to --context: "
        "round(context * i / N) for i = 1..N",
    )
    p.add_argument(
        "--page-size", type=_positive_int, default=16, metavar="TOKENS",
        help="tokens per page for the paging comparison, --budget and the host tier "
        "(default 16, as in vLLM)",
    )
    p.add_argument(
        "--host-fraction", type=_host_fraction, default=Fraction(0), metavar="F",
        help="host-memory tier: the oldest share F (0 <= F < 1) of each sequence's --context "
        "lives in host RAM in whole pages of --page-size tokens, streamed to the device for "
        "attention: page_size * min(floor(F * context / page_size), "
        "floor(max(context - R, 0) / page_size)) tokens per sequence, where R is --residual "
        "(a KIVI cache keeps its bf16 ring of R + page_size recent tokens on the device; only "
        "its quantized pages move). Prints device and host bytes per sequence and per "
        "--batch, and the host->device bytes of one decode step, which reads every host "
        "token of every layer once (default 0: no host tier; not with --lengths, "
        "--length-spread or --budget" + _KV_ONLY + ")",
    )
    p.add_argument(
        "--host-bandwidth", type=_positive_float, default=None, metavar="GBPS",
        help="host->device bandwidth in GB/s (10^9 bytes/s), with --hbm-bandwidth and "
        "--host-fraction > 0: print a lower bound on the decode step time spent reading the "
        "KV cache only (no weights, no compute): host bytes / host bandwidth + device bytes "
        "/ HBM bandwidth for the batch, and the larger of the two if the transfer overlaps "
        "the device reads",
    )
    p.add_argument(
        "--hbm-bandwidth", type=_positive_float, default=None, metavar="GBPS",
        help="device memory (HBM) bandwidth in GB/s, with --host-bandwidth (see there)",
    )
    p.set_defaults(func=functools.partial(run, parser=p))
    return p


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Runs `memory` with parsed `args`; reports bad combinations through `parser.error`."""
    if args.list:
        print(_list_presets())
        return 0
    if args.model is None:
        parser.error(
            f"the --model argument is required (unless --list); known models: "
            f"{', '.join(PRESETS)}"
        )
    preset: ModelPreset = args.model
    kv = _kv_format(args, args.kv_dtype, args.kv_bits)
    context = args.context or _DEFAULT_CONTEXT

    lengths = args.lengths
    if args.length_spread is not None:
        n = args.length_spread
        lengths = [max(1, round(context * i / n)) for i in range(1, n + 1)]
    if lengths is not None and args.context is not None and max(lengths) > args.context:
        parser.error(
            f"argument --lengths: the longest length {max(lengths)} exceeds --context "
            f"{args.context}; raise --context or drop it to reserve the longest length"
        )

    if args.budget is not None and args.group_size and args.page_size % args.group_size:
        parser.error(
            f"argument --group: {args.group_size} must divide --page-size {args.page_size} for "
            f"--budget (keys are grouped along the tokens of a page); raise --page-size"
        )
    if args.budget is not None and args.residual % args.page_size:
        parser.error(
            f"argument --residual: {args.residual} must be a multiple of --page-size "
            f"{args.page_size} for --budget (the tail is flushed a page at a time)"
        )

    _check_host_tier(args, parser)
    _check_state_flags(args, parser, preset)

    blocks = [_summary(preset, kv, context, args.batch, args.weight_dtype)]
    if preset.is_hybrid:
        hybrid = gdn.hybrid_cache_bytes(
            preset, context, batch=args.batch, fmt=kv,
            conv_dtype=args.conv_dtype or gdn.CONV_STATE_DTYPE,
            state_dtype=args.state_dtype or gdn.RECURRENT_STATE_DTYPE,
        )
        blocks.append(_hybrid(preset, kv, hybrid, args))
    if preset.indexer is not None:
        indexed = dsa.dsa_cache_bytes(preset, context, batch=args.batch, fmt=kv,
                                      indexer_dtype=args.indexer_dtype or dsa.INDEXER_DTYPE)
        blocks.append(_dsa(preset, kv, indexed, args.indexer_dtype or dsa.INDEXER_DTYPE))
    if args.host_fraction > 0:
        tier = host_tier_bytes(preset.attention, preset.num_layers, context,
                               host_fraction=args.host_fraction, page_size=args.page_size,
                               batch=args.batch, fmt=kv)
        blocks.append(_host_tier(preset, kv, tier, args.host_bandwidth, args.hbm_bandwidth))
    if args.compare:
        if preset.sliding_window is not None:
            blocks.append(_window_compare(preset, kv, context, args))
        blocks.append(_hybrid_compare(preset, kv, hybrid) if preset.is_hybrid
                      else _compare(preset, args, context))
    if lengths is not None:
        blocks.append(_paging(preset, kv, lengths, args.context, args.page_size))
    if args.budget is not None:
        blocks.append(_capacity(preset, args, context, lengths))
    print("\n\n".join(blocks))
    return 0


def _check_host_tier(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Rejects host-tier flags that the block would silently ignore or misreport."""
    bandwidths = [f for f, v in (("--host-bandwidth", args.host_bandwidth),
                                 ("--hbm-bandwidth", args.hbm_bandwidth)) if v is not None]
    if args.host_fraction == 0:
        if bandwidths:
            parser.error(
                f"argument {bandwidths[0]}: needs --host-fraction F with 0 < F < 1 (the step "
                f"time bound is printed with the host tier); add --host-fraction"
            )
        return
    given = f"{float(args.host_fraction):g}"
    if len(bandwidths) == 1:
        other = "--hbm-bandwidth" if bandwidths[0] == "--host-bandwidth" else "--host-bandwidth"
        parser.error(
            f"argument {bandwidths[0]}: the step time bound adds both terms; give {other} too"
        )
    why = {
        "--lengths": "the host tier covers --batch sequences of --context tokens, not these",
        "--length-spread": "the host tier covers --batch sequences of --context tokens, not "
        "these",
        "--budget": "the capacity table counts device memory only and ignores the host tier",
    }
    for flag, value in (("--lengths", args.lengths), ("--length-spread", args.length_spread),
                        ("--budget", args.budget)):
        if value is not None:
            parser.error(
                f"argument --host-fraction: {given} is not allowed with {flag} ({why[flag]}); "
                f"run them separately"
            )
    kv_residual = _kv_format(args, args.kv_dtype, args.kv_bits).residual
    if kv_residual % args.page_size:
        parser.error(
            f"argument --residual: {kv_residual} must be a multiple of --page-size "
            f"{args.page_size} with --host-fraction {given} (the bf16 ring is flushed a page "
            f"at a time)"
        )


def _check_state_flags(
    args: argparse.Namespace, parser: argparse.ArgumentParser, preset: ModelPreset
) -> None:
    """Rejects state/indexer flags a preset has no use for, and blocks that would miss them."""
    for flag, value, needs, what in (
        ("--state-dtype", args.state_dtype, preset.is_hybrid, "linear-attention state"),
        ("--conv-dtype", args.conv_dtype, preset.is_hybrid, "linear-attention state"),
        ("--indexer-dtype", args.indexer_dtype, preset.indexer is not None,
         "DSA lightning indexer"),
    ):
        if value is not None and not needs:
            parser.error(f"argument {flag}: {preset.name} has no {what}; drop {flag}")
    if not (preset.is_hybrid or preset.indexer is not None):
        return
    extra = ("the linear-attention state" if preset.is_hybrid
             else "the lightning indexer's key cache")
    for flag, given in (("--budget", args.budget is not None),
                        ("--lengths", args.lengths is not None),
                        ("--length-spread", args.length_spread is not None),
                        ("--host-fraction", args.host_fraction > 0)):
        if given:
            parser.error(
                f"argument {flag}: not available for {preset.name} yet: that block counts KV "
                f"pages only and would leave out {extra}; run without {flag}"
            )


def _kv_format(args: argparse.Namespace, dtype: str, bits: int | None = None) -> acc.KVFormat:
    """The KV format of `dtype` (or of `bits`), with scale/zero overhead where it applies."""
    # Scales and zero points belong to integer codes; float formats carry their own exponent.
    quantized = bits is not None or dtype.startswith("int")
    group = args.group_size if quantized else None
    residual = args.residual if quantized else 0
    return acc.kv_format(dtype, bits=bits, group_size=group, scale_bits=args.scale_bits,
                         residual=residual)


def _capacity(
    preset: ModelPreset, args: argparse.Namespace, context: int, lengths: list[int] | None
) -> str:
    from kvjax.memory import capacity as cap

    spec, layers, ps = preset.attention, preset.num_layers, args.page_size
    budget = Fraction(args.budget) * acc.GiB
    group = args.group_size or min(32, ps)
    layouts = [("paged bf16", acc.kv_format("bf16"))]
    for dtype in ("int8", "int4", "int2"):
        layouts.append((f"paged {dtype}", acc.kv_format(
            dtype, group_size=group, scale_bits=args.scale_bits, residual=args.residual)))
    base = cap.tokens_in_budget(spec, layers, budget, seq_len=context, page_size=ps,
                                fmt=layouts[0][1])
    headers = ["cache", "bytes/page", "ring bytes/seq", f"tokens ({context:,}-token seqs)",
               "x paged bf16"]
    rows = []
    if lengths is not None:
        headers.append(f"seqs of the {len(lengths)} lengths")
        n, _ = cap.sequences_in_budget(spec, layers, budget, lengths, page_size=None,
                                       max_len=args.context or max(lengths))
        contiguous_tokens = math.floor(budget / cap.contiguous_cache_bytes(
            spec, layers, max_len=context, max_seqs=1)) * context
        rows.append(["contiguous bf16", "", "", f"{contiguous_tokens:,}",
                     f"{contiguous_tokens / base:.2f}" if base else "-", f"{n:,}"])
    for label, fmt in layouts:
        tokens = cap.tokens_in_budget(spec, layers, budget, seq_len=context, page_size=ps,
                                      fmt=fmt)
        row = [label, _n(cap.page_bytes(spec, layers, ps, fmt)),
               _n(cap.tail_bytes(spec, layers, ps, fmt)), f"{tokens:,}",
               f"{tokens / base:.2f}" if base else "-"]
        if lengths is not None:
            n, _ = cap.sequences_in_budget(spec, layers, budget, lengths, page_size=ps, fmt=fmt)
            row.append(f"{n:,}")
        rows.append(row)
    head = [
        f"Capacity of a {args.budget:g} GiB KV budget for {preset.name} "
        f"({ps}-token pages; integer rows: {args.scale_bits}-bit scale and zero per {group} "
        f"elements, bf16 ring of residual {args.residual} + {ps} tokens per sequence"
        + (", k_rope kept bf16" if preset.is_mla else "") + ").",
        "Tokens count whole sequences of --context tokens; sequences are admitted in the "
        "order given until the next one does not fit; contiguous slots reserve "
        f"{args.context or (max(lengths) if lengths else context):,} tokens each.",
        "",
    ]
    return "\n".join([*head, _table(headers, rows)])


# -- formatting


def _n(x: int | Fraction) -> str:
    """Exact count with thousands separators; two decimals only when fractional."""
    x = Fraction(x)
    if x.denominator == 1:
        return f"{x.numerator:,}"
    return f"{float(x):,.2f}"


def _params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 10**9 else f"{n / 1e6:.1f}M"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> str:
    """Plain-text table; the first `left` columns are left-aligned, the rest right-aligned."""
    widths = [max(len(str(r[i])) for r in (headers, *rows)) for i in range(len(headers))]

    def line(cells):
        return "  ".join(
            str(c).ljust(w) if i < left else str(c).rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def _geometry(preset: ModelPreset) -> str:
    if preset.is_mla:
        return (
            f"{preset.kv_lora_rank} (c_KV) + {preset.qk_rope_head_dim} (k_rope) = "
            f"{preset.kv_lora_rank + preset.qk_rope_head_dim:,} elements per token per layer"
        )
    return (
        f"2 x {preset.kv_heads} KV heads x {preset.head_dim} = "
        f"{2 * preset.kv_heads * preset.head_dim:,} elements per token per layer"
    )


def _describe(preset: ModelPreset) -> str:
    params = _params(preset.num_params) + " params"
    if preset.active_params is not None:
        params += f" ({_params(preset.active_params)} active)"
    if preset.is_hybrid:
        g = preset.linear_attention
        return (
            f"{preset.name}: hybrid {preset.label}, {preset.num_layers} layers: "
            f"{preset.kv_layers} full attention (every {preset.full_attention_interval}th; "
            f"{preset.q_heads} query heads, {preset.kv_heads} KV heads, head_dim "
            f"{preset.head_dim}) and {preset.linear_layers} Gated DeltaNet ({g.num_key_heads} "
            f"key heads, {g.num_value_heads} value heads, head dims {g.key_head_dim}/"
            f"{g.value_head_dim}, conv kernel {g.conv_kernel}), {params}"
        )
    if preset.sliding_window is not None:
        return (
            f"{preset.name}: {preset.label}, {preset.num_layers} layers: "
            f"{preset.local_layers} local (sliding window {preset.sliding_window:,}) and "
            f"{preset.kv_layers - preset.local_layers} global (layer i when (i + 1) % "
            f"{preset.global_attention_interval} == 0); {preset.q_heads} query heads, "
            f"{preset.kv_heads} KV heads, head_dim {preset.head_dim}, {params}"
        )
    if preset.is_mla:
        heads = (
            f"{preset.q_heads} query heads, MLA latent d_c {preset.kv_lora_rank}, "
            f"d_rope {preset.qk_rope_head_dim}"
        )
    else:
        heads = (
            f"{preset.q_heads} query heads, {preset.kv_heads} KV heads, "
            f"head_dim {preset.head_dim}"
        )
    if preset.indexer is not None:
        ix = preset.indexer
        heads += (f", DSA lightning indexer ({ix.n_heads} heads, head_dim {ix.head_dim}, "
                  f"top-{ix.topk})")
    return f"{preset.name}: {preset.label}, {preset.num_layers} layers, {heads}, {params}"


def _bytes_row(label: str, n: int | Fraction) -> list[str]:
    return [label, _n(n), acc.format_bytes(n), acc.format_bytes(n, binary=True)]


def _summary(
    preset: ModelPreset, kv: acc.KVFormat, context: int, batch: int, weight_dtype: str
) -> str:
    spec = preset.attention
    layers = preset.kv_layers
    per_layer = acc.bytes_per_token_per_layer(spec, kv)
    per_token = acc.bytes_per_token(spec, layers, kv)
    per_seq = acc.bytes_per_sequence(spec, layers, context, kv)
    per_batch = acc.bytes_per_batch(spec, layers, context, batch, kv)
    weights = acc.weight_bytes(preset.num_params, weight_dtype)
    which = f"{layers} layers" if layers == preset.num_layers else (
        f"{layers} full-attention layers of {preset.num_layers}")
    rows = [
        _bytes_row("KV per token per layer", per_layer),
        _bytes_row(f"KV per token ({which})", per_token),
        _bytes_row(f"KV per sequence ({context:,} tokens)", per_seq),
        _bytes_row(f"KV per batch ({batch} x {context:,} tokens)", per_batch),
        _bytes_row(f"model weights ({weight_dtype}, {preset.num_params:,} params)", weights),
        ["KV per batch / model weights", f"{float(per_batch / weights):.3f}", "", ""],
    ]
    head = [
        _describe(preset),
        f"source: {preset.source}",
        f"KV cache: {kv.describe()}; {_geometry(preset)}",
        _UNITS_LINE,
        "",
    ]
    return "\n".join([*head, _table(["quantity", "bytes", "decimal", "binary"], rows)])


def _seconds(t: float) -> str:
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
        if t >= scale:
            return f"{t / scale:.3f} {unit}"
    return f"{t / 1e-9:.3f} ns"


def _host_tier(
    preset: ModelPreset, kv: acc.KVFormat, tier: HostTier, host_gbps: float | None,
    hbm_gbps: float | None,
) -> str:
    ps, ctx, b = tier.page_size, tier.context, tier.batch
    f = f"{float(tier.host_fraction):g}"
    head = [
        f"Host tier for {preset.name}: the oldest {f} of each {ctx:,}-token sequence in host "
        f"memory, in whole {ps}-token pages: {tier.host_pages:,} pages = "
        f"{tier.host_tokens:,} tokens per sequence; {tier.device_tokens:,} stay on the device.",
        f"Rule: host tokens = page_size * min(floor(F * context / page_size), "
        f"floor(max(context - R, 0) / page_size)), R = --residual {kv.residual}: {ps} * min("
        f"{math.floor(tier.host_fraction * ctx / ps):,}, {tier.movable_pages:,}).",
    ]
    if kv.residual:
        head.append(
            f"KIVI: the bf16 ring of residual {kv.residual} + {ps} tokens stays on the device; "
            f"only the {tier.movable_pages:,} quantized pages can move"
            + (" (this caps the host pages)." if tier.capped else ".")
        )
    head += [
        f"Each host token costs {_n(acc.bytes_per_token(preset.attention, preset.num_layers, kv))}"
        f" B: {kv.describe()}; device + host = KV per sequence above. Every decode step "
        "reads every host token of every layer once, for the whole batch.",
        "",
    ]
    def row(label: str, tokens: int, n: Fraction) -> list[str]:
        return [label, f"{tokens:,}", *_bytes_row("", n)[1:]]

    rows = [
        row("device per sequence", tier.device_tokens, tier.device_bytes),
        row("host per sequence", tier.host_tokens, tier.host_bytes),
        row(f"device per batch ({b} seqs)", b * tier.device_tokens, tier.batch_device_bytes),
        row(f"host per batch ({b} seqs)", b * tier.host_tokens, tier.batch_host_bytes),
        row("host->device per decode step", b * tier.host_tokens, tier.transfer_bytes_per_step),
    ]
    text = "\n".join([*head, _table(["tier", "tokens", "bytes", "decimal", "binary"], rows)])
    if host_gbps is None or hbm_gbps is None:
        return text
    t_host, t_hbm = tier.step_seconds(host_gbps=host_gbps, hbm_gbps=hbm_gbps)
    lines = [
        "",
        "Decode step time, lower bound on reading the KV cache only (no weights, no compute):",
        f"  host->device  {acc.format_bytes(tier.batch_host_bytes)} / {host_gbps:g} GB/s = "
        f"{_seconds(t_host)}",
        f"  device (HBM)  {acc.format_bytes(tier.batch_device_bytes)} / {hbm_gbps:g} GB/s = "
        f"{_seconds(t_hbm)}",
        f"  sum (transfer, then device reads): {_seconds(t_host + t_hbm)}",
        f"  max (transfer fully overlapped with device reads): {_seconds(max(t_host, t_hbm))}",
    ]
    return "\n".join([text, *lines])


def _percent(part: Fraction, whole: Fraction) -> str:
    return f"{100 * float(part / whole):.2f}%" if whole else "-"


def _hybrid(
    preset: ModelPreset, kv: acc.KVFormat, h: gdn.HybridCacheBytes, args: argparse.Namespace
) -> str:
    g = preset.linear_attention
    conv_dtype = args.conv_dtype or gdn.CONV_STATE_DTYPE
    state_dtype = args.state_dtype or gdn.RECURRENT_STATE_DTYPE
    conv_rows, conv_cols = g.conv_state_shape
    heads, dk, dv = g.recurrent_state_shape
    ctx, b = h.context, h.batch
    head = [
        f"Hybrid cache of {preset.name}: {h.kv_layers} full-attention layers (every "
        f"{preset.full_attention_interval}th) keep a KV cache that grows with the context; "
        f"{h.linear_layers} Gated DeltaNet layers keep a fixed state per sequence.",
        f"State per layer and sequence: conv {conv_rows:,} channels (2 x {g.num_key_heads} key "
        f"heads x {g.key_head_dim} + {g.num_value_heads} value heads x {g.value_head_dim}) x "
        f"(kernel {g.conv_kernel} - 1) = {g.conv_state_elements:,} elements in {conv_dtype}; "
        f"recurrent {heads} value heads x {dk} x {dv} = {g.recurrent_state_elements:,} "
        f"elements in {state_dtype}.",
        f"KV: {kv.describe()}.",
        "",
    ]
    rows = [
        _bytes_row("conv state per layer", h.conv_bytes_per_layer),
        _bytes_row("recurrent state per layer", h.recurrent_bytes_per_layer),
        _bytes_row(f"state per sequence ({h.linear_layers} layers, any context)", h.state_bytes),
        _bytes_row(f"KV per sequence ({h.kv_layers} layers, {ctx:,} tokens)", h.kv_bytes),
        _bytes_row("state + KV per sequence", h.total_bytes),
        _bytes_row(f"state per batch ({b} seqs)", h.batch_state_bytes),
        _bytes_row(f"KV per batch ({h.kv_layers} layers, {b} x {ctx:,} tokens)",
                   h.batch_kv_bytes),
        _bytes_row("state + KV per batch", h.batch_total_bytes),
        ["state share of state + KV", _percent(h.state_bytes, h.total_bytes), "", ""],
    ]
    tail = (f"\nThe state equals the KV of {_n(h.breakeven_tokens)} tokens "
            f"({_n(h.state_bytes)} / {_n(h.kv_bytes_per_token)} B per token); beyond that the "
            "KV dominates.")
    return "\n".join([*head, _table(["quantity", "bytes", "decimal", "binary"], rows)]) + tail


def _hybrid_compare(preset: ModelPreset, kv: acc.KVFormat, h: gdn.HybridCacheBytes) -> str:
    head = [
        f"Hybrid vs dense GQA for {preset.name}: the dense model has all {h.num_layers} layers "
        f"full attention with the same {preset.kv_heads} KV heads, head_dim {preset.head_dim} "
        f"and KV {kv.describe()}; {h.context:,} tokens per sequence, batch {h.batch}.",
        "",
    ]

    def row(label: str, n: Fraction, batch_n: Fraction) -> list[str]:
        return [label, _n(n), acc.format_bytes(n, binary=True), _n(batch_n),
                acc.format_bytes(batch_n, binary=True), _percent(n, h.dense_kv_bytes)]

    rows = [
        row(f"dense GQA: KV of {h.num_layers} layers", h.dense_kv_bytes, h.batch_dense_kv_bytes),
        row(f"hybrid: KV of {h.kv_layers} full-attention layers", h.kv_bytes, h.batch_kv_bytes),
        row(f"hybrid: state of {h.linear_layers} Gated DeltaNet layers", h.state_bytes,
            h.batch_state_bytes),
        row("hybrid: state + KV", h.total_bytes, h.batch_total_bytes),
    ]
    headers = ["cache", "per sequence", "binary", f"per batch ({h.batch})", "binary",
               "of dense"]
    saved = h.batch_dense_kv_bytes - h.batch_total_bytes
    tail = (f"\nhybrid / dense: {float(h.total_bytes / h.dense_kv_bytes):.4f} "
            f"({float(h.dense_kv_bytes / h.total_bytes):.2f}x smaller); saves {_n(saved)} B = "
            f"{acc.format_bytes(saved, binary=True)} per batch.")
    return "\n".join([*head, _table(headers, rows)]) + tail


def _window_compare(preset: ModelPreset, kv: acc.KVFormat, context: int,
                    args: argparse.Namespace) -> str:
    ps, chunk = args.page_size, args.chunk
    head = [
        f"Sliding-window cache of {preset.name}: {preset.local_layers} local layers (window "
        f"{preset.sliding_window:,}) and {preset.kv_layers - preset.local_layers} global "
        f"layers; {context:,} tokens per sequence, batch {args.batch}, {ps}-token pages.",
    ]
    if kv.name not in swa.FULL_PRECISION or kv.group_size is not None or kv.residual:
        kinds = ", ".join(swa.FULL_PRECISION)
        return "\n".join([*head, f"Window-only pages are full-precision ({kinds}) in kvjax; "
                                 f"not priced for {kv.describe()}."])
    w = swa.window_cache_bytes(preset, context, batch=args.batch, fmt=kv, page_size=ps,
                               chunk=chunk)
    head += [
        f"Full context: every layer keeps ceil({context:,} / {ps}) = {w.context_pages:,} pages "
        f"per sequence. Window-only pages: a local layer keeps at most ceil((window + chunk - "
        f"2) / page_size) + 1 = ceil(({w.window:,} + {chunk} - 2) / {ps}) + 1 = "
        f"{w.ring_pages:,} pages (--chunk {chunk}, the prefill chunk), here "
        f"{w.window_pages:,}; the global layers keep all theirs.",
        f"One page of one layer: {ps} tokens x {_n(w.page_bytes / ps)} B = {_n(w.page_bytes)} "
        f"B, {kv.describe()}.",
        "",
    ]

    def row(label: str, n: Fraction) -> list[str]:
        return [label, _n(n), acc.format_bytes(n, binary=True), _n(w.batch_bytes(n)),
                acc.format_bytes(w.batch_bytes(n), binary=True), _percent(n, w.full_bytes)]

    rows = [
        row(f"local layers ({w.local_layers}), full context", w.local_full_bytes),
        row(f"local layers ({w.local_layers}), window-only", w.local_window_bytes),
        row(f"global layers ({w.global_layers})", w.global_bytes),
        row("all layers, full context", w.full_bytes),
        row("all layers, window-only local pages", w.window_bytes),
    ]
    headers = ["KV", "per sequence", "binary", f"per batch ({w.batch})", "binary",
               "of full context"]
    tail = (f"\nwindow-only / full context: {float(w.window_bytes / w.full_bytes):.4f} "
            f"({float(w.full_bytes / w.window_bytes):.2f}x smaller)" if w.window_bytes else "")
    return "\n".join([*head, _table(headers, rows)]) + tail


def _dsa(preset: ModelPreset, kv: acc.KVFormat, d: dsa.DSACacheBytes, indexer_dtype: str) -> str:
    ix, layers, ctx, b = preset.indexer, preset.num_layers, d.context, d.batch
    head = [
        f"DeepSeek Sparse Attention cache of {preset.name}: every one of the {layers} layers "
        f"caches the MLA latent ({preset.kv_lora_rank} + {preset.qk_rope_head_dim} = "
        f"{preset.kv_lora_rank + preset.qk_rope_head_dim} elements per token, {kv.describe()}) "
        f"and the lightning indexer's key ({ix.head_dim} elements per token, shared by its "
        f"{ix.n_heads} heads, {indexer_dtype}).",
        "",
    ]
    rows = [
        _bytes_row(f"latent per token ({layers} layers)", d.latent_bytes_per_token),
        _bytes_row(f"indexer keys per token ({layers} layers)", d.indexer_bytes_per_token),
        _bytes_row(f"latent per sequence ({ctx:,} tokens)", d.latent_bytes),
        _bytes_row(f"indexer keys per sequence ({ctx:,} tokens)", d.indexer_bytes),
        _bytes_row("latent + indexer per sequence", d.total_bytes),
        _bytes_row(f"latent per batch ({b} x {ctx:,} tokens)", d.batch_latent_bytes),
        _bytes_row(f"indexer keys per batch ({b} x {ctx:,} tokens)", d.batch_indexer_bytes),
        _bytes_row("latent + indexer per batch", d.batch_total_bytes),
        ["indexer / latent", _percent(d.indexer_bytes_per_token, d.latent_bytes_per_token),
         "", ""],
    ]
    reads = [
        f"One decode step reads, in every layer: dense MLA the whole latent cache ({ctx:,} "
        f"tokens); DSA the top-{ix.topk} tokens of it ({d.selected:,} here) plus all {ctx:,} "
        "indexer keys to score them.",
        "",
    ]

    def read_row(label: str, n: Fraction, batch_n: Fraction) -> list[str]:
        return [label, _n(n), acc.format_bytes(n, binary=True), _n(batch_n),
                acc.format_bytes(batch_n, binary=True)]

    read_rows = [
        read_row("dense MLA: whole latent cache", d.dense_read_bytes, d.batch_dense_read_bytes),
        read_row(f"DSA: top-{ix.topk} latent + all indexer keys", d.dsa_read_bytes,
                 d.batch_dsa_read_bytes),
    ]
    read_headers = ["decode step reads", "per sequence", "binary", f"per batch ({b})", "binary"]
    ratio = d.dsa_read_bytes / d.dense_read_bytes if d.dense_read_bytes else None
    tail = "" if ratio is None else f"\nDSA / dense MLA reads: {float(ratio):.4f} " + (
        f"({float(1 / ratio):.2f}x fewer bytes)" if ratio < 1 else
        f"(the context is within top-{ix.topk}: DSA reads all of it plus the indexer keys)")
    return "\n".join([*head, _table(["quantity", "bytes", "decimal", "binary"], rows), "",
                      *reads, _table(read_headers, read_rows)]) + tail


def _cache_key(spec) -> tuple:
    return (spec.kind, spec.cache_heads, spec.cache_widths)


def _compare(preset: ModelPreset, args: argparse.Namespace, context: int) -> str:
    # Imported here because kvjax.specs pulls in JAX; only this view builds new specs.
    from kvjax.specs import AttentionSpec, MLASpec

    hd, qh = preset.head_dim, preset.q_heads
    d_c, d_rope = 4 * hd, hd // 2
    actual = preset.attention
    candidates = [(f"MHA ({qh} KV heads)", AttentionSpec(q_heads=qh, kv_heads=qh, head_dim=hd))]
    if actual.kind == "GQA":
        candidates.append((f"GQA-{actual.kv_heads}", actual))
    candidates.append(("MQA (1 KV head)", AttentionSpec(q_heads=qh, kv_heads=1, head_dim=hd)))
    if preset.is_mla:
        candidates.append((f"MLA (d_c {actual.kv_lora_rank}, d_rope {actual.qk_rope_head_dim})",
                           actual))
    candidates.append((f"MLA (d_c {d_c}, d_rope {d_rope})", MLASpec(
        q_heads=qh, kv_lora_rank=d_c, qk_rope_head_dim=d_rope, qk_nope_head_dim=hd,
        v_head_dim=hd,
    )))
    # Two specs that cache the same tensors cost the same whatever else differs
    # (e.g. MLA's q_lora_rank), so rows are deduplicated and matched on this key.
    variants, seen = [], set()
    for label, spec in candidates:
        key = _cache_key(spec)
        if key not in seen:
            seen.add(key)
            variants.append((label + (" (actual)" if key == _cache_key(actual) else ""), spec))

    layers = preset.num_layers
    base = acc.bytes_per_token(variants[0][1], layers, "bf16")
    rows = []
    for label, spec in variants:
        for dtype in _COMPARE_DTYPES:
            fmt = _kv_format(args, dtype)
            per_token = acc.bytes_per_token(spec, layers, fmt)
            rows.append([
                label, dtype, _n(fmt.bits_per_element),
                f"{acc.elements_per_token_per_layer(spec):,}", _n(per_token),
                acc.format_bytes(per_token, binary=True),
                acc.format_bytes(acc.bytes_per_batch(spec, layers, context, args.batch, fmt)),
                f"{100 * acc.reduction(per_token, base):.2f}%",
            ])
            label = ""
    overhead = (
        f"integer dtypes carry a {args.scale_bits}-bit scale and zero per {args.group_size} "
        "elements" if args.group_size else
        "no scale/zero overhead counted (add --group-size G to include it)"
    )
    head = [
        f"Cache variants for {preset.name} ({qh} query heads, head_dim {hd}, {layers} layers); "
        f"per token across all layers, and per batch of {args.batch} x {context:,} tokens.",
        f"Assumption: the MLA row uses d_c = 4 * head_dim = {d_c} and d_rope = head_dim / 2 = "
        f"{d_rope}, DeepSeek-V2's ratios (arXiv 2405.04434), not a trained model's values.",
        f"Reduction is against MHA bf16 ({_n(base)} B/token); {overhead}.",
        "",
    ]
    headers = ["variant", "dtype", "bits/elem", "elems/token/layer", "bytes/token",
               "binary", "per batch", "reduction"]
    return "\n".join([*head, _table(headers, rows, left=2)])


def _paging(
    preset: ModelPreset, kv: acc.KVFormat, lengths: list[int], max_len: int | None,
    page_size: int,
) -> str:
    per_token = acc.bytes_per_token(preset.attention, preset.num_layers, kv)
    tokens = paging_waste(lengths, page_size=page_size, max_len=max_len)
    waste = paging_waste(lengths, page_size=page_size, max_len=max_len, bytes_per_token=per_token)
    shown = ", ".join(f"{n:,}" for n in lengths[:8]) + (", ..." if len(lengths) > 8 else "")
    rows = [
        ["contiguous (max_len per sequence)", _n(tokens.contiguous_bytes),
         *_bytes_row("", waste.contiguous_bytes)[1:], f"{100 * waste.contiguous_waste:.2f}%"],
        [f"paged ({page_size}-token pages)", _n(tokens.paged_bytes),
         *_bytes_row("", waste.paged_bytes)[1:], f"{100 * waste.paged_waste:.2f}%"],
        ["used by tokens", _n(tokens.used_bytes), *_bytes_row("", waste.used_bytes)[1:], ""],
    ]
    head = [
        f"Paging waste for {preset.name}: {waste.num_seqs} sequences of lengths {shown}; "
        f"a contiguous cache reserves {waste.max_len:,} tokens each; "
        f"KV {kv.describe()} = {_n(per_token)} B/token.",
        "",
    ]
    tail = f"\npaged / contiguous reservation: {waste.paged_over_contiguous:.3f}"
    headers = ["cache", "tokens", "bytes", "decimal", "binary", "waste"]
    return "\n".join([*head, _table(headers, rows)]) + tail


def _list_presets() -> str:
    rows = []
    for p in PRESETS.values():
        per_token = acc.bytes_per_token(p.attention, p.kv_layers, "bf16")
        heads = f"MLA d_c {p.kv_lora_rank}+{p.qk_rope_head_dim}" if p.is_mla else str(p.kv_heads)
        layers = str(p.num_layers) if p.kv_layers == p.num_layers else (
            f"{p.num_layers} ({p.kv_layers} KV)")
        other = ""
        if p.is_hybrid:
            state = gdn.linear_state_bytes(p.linear_attention, p.linear_layers)
            other = (f"{p.linear_layers}-layer state {acc.format_bytes(state, binary=True)}/seq "
                     f"({gdn.CONV_STATE_DTYPE} conv, {gdn.RECURRENT_STATE_DTYPE} recurrent)")
        if p.indexer is not None:
            keys = dsa.indexer_bytes_per_token(p.indexer, p.num_layers)
            other = f"indexer keys {_n(keys)} B/token ({dsa.INDEXER_DTYPE})"
        if p.sliding_window is not None:
            other = f"{p.local_layers} of {p.num_layers} layers local, window {p.sliding_window:,}"
        rows.append([
            p.name, p.label, layers, str(p.q_heads), heads, str(p.head_dim),
            _params(p.num_params), _n(per_token), acc.format_bytes(per_token, binary=True),
            other,
        ])
    headers = ["model", "kind", "layers", "q heads", "kv heads", "head_dim", "params",
               "KV B/token bf16", "binary", "besides the KV cache"]
    return _table(headers, rows, left=2)
