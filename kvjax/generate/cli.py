"""`python -m kvjax generate`: generate text from a HuggingFace model directory.

Examples:
  python -m kvjax generate --model ./TinyLlama --prompt "Paged caches are" --max-new-tokens 64
  python -m kvjax generate --model ./qwen3-tiny --prompt-ids 1,15,27 --temperature 0.8 --top-p 0.9
  python -m kvjax generate --model ./llama --prompt "Once" --n 4 --temperature 1.0
  python -m kvjax generate --model ./llama --prompt "Once" --num-beams 4
"""

import argparse
import os
import sys
import time
from collections.abc import Sequence

# The flag parsers and groups the serve command shares.
__all__ = ["add_parser", "run", "positive_int", "parse_dtype", "add_kivi_flags", "add_mesh_flags",
           "sharding_plan"]

_KV_DTYPES = ("float32", "bfloat16", "float16")
_ALIASES = {"f32": "float32", "fp32": "float32", "bf16": "bfloat16", "f16": "float16",
            "fp16": "float16"}


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return value


def _top_p(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must lie in (0, 1], got {text!r}")
    return value


def _ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        ids = []
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated non-negative token ids like 1,2,3, got {text!r}")
    return ids


def parse_dtype(text: str) -> str:
    name = _ALIASES.get(text.lower(), text.lower())
    if name not in _KV_DTYPES:
        raise argparse.ArgumentTypeError(
            f"unknown dtype {text!r}; allowed: {', '.join(_KV_DTYPES)} (or bf16, f16, f32)")
    return name


def _eos(text: str) -> list[int] | None:
    if text.lower() == "none":
        return []
    return _ids(text)


def add_kivi_flags(p: argparse.ArgumentParser) -> None:
    """--kv-bits, --kv-group-size and --kv-residual: a KIVI-quantized cache (also `serve`'s)."""
    p.add_argument("--kv-bits", type=int, choices=(2, 4, 8), default=None, metavar="BITS",
                   help="KIVI-quantize the KV cache to 2, 4 or 8 bits (default: full precision)")
    p.add_argument("--kv-group-size", type=positive_int, default=32, metavar="G",
                   help="KIVI group size G (default 32; must divide --page-size)")
    p.add_argument("--kv-residual", type=int, default=128, metavar="R",
                   help="KIVI full-precision recent tokens R, a multiple of --page-size "
                   "(default 128)")


# The cache strategy each mesh axis carries under --mesh (kvjax.sharding.ShardingPlan).
_AXIS_STRATEGY = {"data": "sequences", "model": "heads", "context": "context"}


def _mesh(text: str) -> tuple[tuple[str, int], ...]:
    """`--mesh data=2,model=4` -> (("data", 2), ("model", 4))."""
    expected = (f"expected AXIS=SIZE pairs joined by commas, each AXIS one of "
                f"{', '.join(_AXIS_STRATEGY)} at most once and each SIZE a positive integer "
                f"(e.g. data=2,model=4), got {text!r}")
    axes = []
    for part in text.replace(" ", "").split(","):
        name, eq, size = part.partition("=")
        if not eq or name not in _AXIS_STRATEGY or not size.isdigit() or int(size) < 1 or (
                name in dict(axes)):
            raise argparse.ArgumentTypeError(expected)
        axes.append((name, int(size)))
    return tuple(axes)


def add_mesh_flags(p: argparse.ArgumentParser) -> None:
    """--mesh: lay the cache and the params out on a device mesh (also `serve`'s)."""
    p.add_argument("--mesh", type=_mesh, default=None, metavar="AXIS=N[,AXIS=N...]",
                   help="run on a mesh of N1 x N2 ... devices (kvjax.sharding.make_mesh) with "
                   "these axes, each sharding the KV cache by its strategy: data=N spreads "
                   "the sequences and their pages over N devices ('sequences'), model=N "
                   "splits the attention heads, MLP and vocabulary (tensor parallel; KV heads "
                   "are replicated where N does not divide them, 'heads'), context=N spreads "
                   "each sequence's pages round-robin ('context'). The product must not "
                   "exceed the devices JAX sees (on a CPU host, "
                   "XLA_FLAGS=--xla_force_host_platform_device_count=8 gives 8). Default: "
                   "one device")


def sharding_plan(mesh: Sequence[tuple[str, int]] | None):
    """The `kvjax.sharding.ShardingPlan` of a parsed `--mesh` (None: no plan).

    Raises:
      ValueError: the mesh needs more devices than JAX sees; the message names the flag's
        value, the devices it needs and those available.
    """
    if mesh is None:
        return None
    import math

    import jax

    from kvjax import sharding as kvs

    names, sizes = [n for n, _ in mesh], [s for _, s in mesh]
    text = ",".join(f"{n}={s}" for n, s in mesh)
    have = jax.device_count()
    if math.prod(sizes) > have:
        raise ValueError(f"--mesh {text} needs {math.prod(sizes)} devices, but JAX sees {have} "
                         f"({jax.devices()[0].platform}); give a mesh of at most {have} "
                         f"devices (on a CPU host, XLA_FLAGS="
                         f"--xla_force_host_platform_device_count=N simulates N)")
    return kvs.ShardingPlan(mesh=kvs.make_mesh(sizes, names),
                            strategies=tuple(_AXIS_STRATEGY[n] for n in names))


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Registers the `generate` subcommand on `subparsers` and returns its parser."""
    p = subparsers.add_parser(
        "generate",
        help="generate tokens from a HuggingFace model directory on the paged cache",
        description=(
            "Loads a HuggingFace model directory (config.json + safetensors), prefills the "
            "prompts in chunks on a paged KV cache and decodes with kvjax's jitted loop. "
            "Prints the text (or token ids without a tokenizer.json), tokens per second and "
            "the KV cache bytes used."
        ),
        epilog=__doc__.split("\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, metavar="DIR",
                   help="HuggingFace model directory (config.json, *.safetensors, optionally "
                   "tokenizer.json)")
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="prompt text, encoded with DIR/tokenizer.json; repeat for a batch")
    p.add_argument("--prompt-ids", action="append", type=_ids, default=[], metavar="IDS",
                   help="prompt as comma-separated token ids (no tokenizer needed); repeat for "
                   "a batch")
    p.add_argument("--max-new-tokens", type=positive_int, default=64, metavar="N",
                   help="tokens to generate per sequence (default 64)")
    p.add_argument("--temperature", type=_non_negative_float, default=0.0, metavar="T",
                   help="sampling temperature; 0 means greedy (default 0)")
    p.add_argument("--top-p", type=_top_p, default=None, metavar="P",
                   help="nucleus sampling: keep the most likely tokens up to probability P")
    p.add_argument("--top-k", type=positive_int, default=None, metavar="K",
                   help="keep only the K most likely tokens when sampling")
    p.add_argument("--n", type=positive_int, default=1, metavar="N",
                   help="samples per prompt; the prompt's pages are shared by all N (default 1)")
    p.add_argument("--num-beams", type=positive_int, default=None, metavar="W",
                   help="beam search with W beams instead of sampling (one prompt)")
    p.add_argument("--seed", type=int, default=0, help="PRNG seed for sampling (default 0)")
    p.add_argument("--eos-id", type=_eos, default=None, metavar="IDS",
                   help="token ids that end a sequence (default: config.json's eos_token_id; "
                   "'none' to disable)")
    p.add_argument("--kv-dtype", type=parse_dtype, default=None, metavar="DTYPE",
                   help=f"KV cache dtype, one of {', '.join(_KV_DTYPES)} (default: the params "
                   "dtype)")
    add_kivi_flags(p)
    p.add_argument("--dtype", type=parse_dtype, default=None, metavar="DTYPE",
                   help="params and activations dtype (default: the checkpoint's)")
    p.add_argument("--page-size", type=positive_int, default=16, metavar="TOKENS",
                   help="tokens per cache page, a power of two (default 16)")
    p.add_argument("--num-pages", type=positive_int, default=None, metavar="PAGES",
                   help="pages in the pool (default: enough for every sequence's full length)")
    p.add_argument("--chunk-size", type=positive_int, default=256, metavar="TOKENS",
                   help="prefill chunk length (default 256)")
    p.add_argument("--impl", choices=("auto", "reference", "xla", "pallas"), default="auto",
                   help="attention implementation (default auto)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (shown for single-sample runs of 64+ tokens)")
    p.set_defaults(func=run)
    return p


def _load_tokenizer(path: str):
    file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(file):
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    return Tokenizer.from_file(file)


def _format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


def run(args: argparse.Namespace) -> int:
    """Runs `generate` for parsed `args`; returns the exit status.

    Errors the user can act on (bad arguments, an unreadable checkpoint, a pool too
    small) print one `error:` line and return non-zero, without a traceback.
    """
    from kvjax.cache import CacheFullError

    try:
        return _run(args)
    except CacheFullError as e:
        print(f"error: {e} Here: pass a larger --num-pages (now {args.num_pages}), or leave it "
              f"unset for enough pages for every sequence's full length.", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    if args.page_size & (args.page_size - 1):
        print(f"error: --page-size must be a power of two, got {args.page_size}",
              file=sys.stderr)
        return 2
    tokenizer = _load_tokenizer(args.model)
    if args.prompt and tokenizer is None:
        print(f"error: --prompt needs {args.model}/tokenizer.json and the 'tokenizers' package; "
              "give token ids with --prompt-ids instead", file=sys.stderr)
        return 2
    prompts = [tokenizer.encode(t).ids for t in args.prompt] + list(args.prompt_ids)
    if not prompts or any(len(p) == 0 for p in prompts):
        print("error: give at least one non-empty --prompt or --prompt-ids", file=sys.stderr)
        return 2
    if args.num_beams and (len(prompts) != 1 or args.n != 1):
        print("error: --num-beams takes exactly one prompt and --n 1", file=sys.stderr)
        return 2

    import jax
    import numpy as np
    from tqdm import tqdm

    from kvjax import generate as gen
    from kvjax import models
    from kvjax.specs import QuantSpec

    t0 = time.perf_counter()
    try:
        model, params = models.load(args.model, dtype=args.dtype)
    except (ValueError, KeyError, OSError) as e:  # config, weights, files: each names its file
        print(f"error: {e.args[0] if isinstance(e, KeyError) else e}", file=sys.stderr)
        return 2
    vocab = model.vocab_size
    bad = [t for p in prompts for t in p if t >= vocab]
    if bad:
        print(f"error: token id {bad[0]} is outside the vocabulary of {vocab}", file=sys.stderr)
        return 2
    hf = models.read_hf_config(args.model)
    eos = args.eos_id
    if eos is None:
        eos = hf.get("eos_token_id")
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    kv_dtype = args.kv_dtype or model.config.dtype
    sampling = gen.SamplingConfig(temperature=args.temperature, top_k=args.top_k,
                                  top_p=args.top_p)
    key = jax.random.key(args.seed)
    try:
        quant = None if args.kv_bits is None else QuantSpec(
            bits=args.kv_bits, group_size=args.kv_group_size, residual=args.kv_residual)
        config = gen.CacheConfig(dtype=kv_dtype, quant=quant, page_size=args.page_size,
                                 num_pages=args.num_pages)
        config.spec(model, num_seqs=1, max_tokens=1)  # geometry checks, before any work
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    common = dict(cache=config, chunk_size=args.chunk_size, impl=args.impl)
    print(f"loaded {hf['architectures'][0]} ({model.family}, {model.config.attention}) "
          f"in {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    t0 = time.perf_counter()
    first, decoded_before = None, 0
    if args.num_beams:
        res = gen.beam_search(model, params, prompts[0], beam_width=args.num_beams,
                              max_new_tokens=args.max_new_tokens, keep_cache=True, **common)
        outputs, cache = [res.best], res.cache
        peak_pages = cache.spec.num_pages - int(cache.num_free_pages)
    elif args.n > 1:
        res = gen.sample_n(model, params, prompts, n=args.n, key=key,
                           max_new_tokens=args.max_new_tokens, sampling=sampling, eos_ids=eos,
                           free_finished=False, **common)
        outputs, cache = res.sequences(), res.cache
        peak_pages = cache.spec.num_pages - int(cache.num_free_pages)
    else:
        outputs = [[] for _ in prompts]
        show = not args.no_progress and args.max_new_tokens >= 64
        # Pages are kept until the end, so the final count is the peak.
        with tqdm(total=args.max_new_tokens, disable=not show, unit="tok",
                  file=sys.stderr) as bar:
            for i, event in enumerate(gen.stream(
                    model, params, prompts, key=key, max_new_tokens=args.max_new_tokens,
                    sampling=sampling, eos_ids=eos, free_finished=False, **common)):
                for b in np.nonzero(event.emitted)[0]:
                    outputs[b].append(int(event.tokens[b]))
                if i == 1:  # the decode step is compiled by now
                    first, decoded_before = time.perf_counter(), sum(map(len, outputs))
                bar.update(1)
        cache = event.state.cache
        peak_pages = cache.spec.num_pages - int(cache.num_free_pages)
    elapsed = time.perf_counter() - t0

    for i, out in enumerate(outputs):
        src = prompts[0] if args.num_beams else prompts[i // args.n]
        head = f"[{i}] " if len(outputs) > 1 else ""
        if tokenizer is not None:
            print(head + tokenizer.decode(src + out, skip_special_tokens=False))
        else:
            print(head + ",".join(str(t) for t in src + out))

    spec = cache.spec
    page_bytes = sum(x.nbytes for x in jax.tree.leaves(cache.pages)) // spec.num_pages
    total = sum(len(o) for o in outputs)
    print(f"generated {total} tokens in {elapsed:.2f} s ({total / elapsed:.1f} tokens/s "
          "including prefill and compilation)", file=sys.stderr)
    if first is not None and total > decoded_before:
        dt, n = time.perf_counter() - first, total - decoded_before
        print(f"decode: {n} tokens in {dt:.2f} s ({n / dt:.1f} tokens/s, steady state after "
              "compilation)", file=sys.stderr)
    print(f"KV cache: {peak_pages} of {spec.num_pages} pages used at peak x "
          f"{_format_bytes(page_bytes)} per page = {_format_bytes(peak_pages * page_bytes)} "
          f"({peak_pages * page_bytes} bytes; pool {_format_bytes(spec.num_pages * page_bytes)}, "
          f"{spec.dtype.name}"
          + ("" if spec.quant is None else f", KIVI int{spec.quant.bits} + "
             f"{spec.quant.residual}-token tail") + ")", file=sys.stderr)
    return 0
