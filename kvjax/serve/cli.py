"""`python -m kvjax serve`: an OpenAI-compatible HTTP server for a HuggingFace model directory.

Examples:
  python -m kvjax serve --model ./TinyLlama-1.1B-Chat
  python -m kvjax serve --model ./llama --port 8080 --max-seqs 16 --kv-bits 4 --kv-residual 64
  python -m kvjax serve --model ./llama --kv-bits 4 --page-size 32 --kv-memory 20
  python -m kvjax serve --model ./llama --mesh data=2,model=4
  python -m kvjax serve --model ./llama --num-pages 2048 --host-pages 16384 --host-rows 32
  python -m kvjax serve --model ./llama --api-key "$KEY" --max-waiting 64 --request-timeout 600
  curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
      -d '{"model": "TinyLlama-1.1B-Chat", "prompt": "Paged caches are", "max_tokens": 32}'

Any OpenAI client works against http://HOST:PORT/v1 (the API key is checked only with
--api-key):
  openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")

SIGTERM (or Ctrl-C) drains: no new requests, the ones in flight finish, then it exits.
"""

import argparse
import dataclasses
import importlib.util
import logging
import os
import sys

from kvjax.generate.cli import (
    add_kivi_flags,
    add_mesh_flags,
    parse_dtype,
    positive_int,
    sharding_plan,
)

__all__ = ["add_parser", "run"]

_DEFAULT_MAX_SEQ_LEN = 2048
_DEFAULT_CHUNK = 64
_DEFAULT_PAGE = 16
_GIB = 2**30


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Registers the `serve` subcommand on `subparsers` and returns its parser."""
    p = subparsers.add_parser(
        "serve",
        help="serve a HuggingFace model directory over an OpenAI-compatible HTTP API",
        description=(
            "Loads a HuggingFace model directory (config.json, safetensors and a tokenizer) "
            "and serves it with continuous batching, chunked prefill and prefix caching on "
            "a paged KV cache: GET /health, GET /v1/models, POST /v1/completions and "
            "POST /v1/chat/completions (streaming as server-sent events), POST /tokenize, "
            "POST /detokenize and GET /metrics (Prometheus). Needs "
            "`pip install 'kvjax[serve]'`."
        ),
        epilog=__doc__.split("\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, metavar="DIR",
                   help="HuggingFace model directory (config.json, *.safetensors and a "
                   "tokenizer: tokenizer.json / tokenizer_config.json, with a chat_template "
                   "for /v1/chat/completions)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; 0.0.0.0 for every "
                   "interface)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model id clients send as 'model' and /v1/models lists "
                   "(default: the basename of DIR)")
    p.add_argument("--max-seqs", type=positive_int, default=8, metavar="N",
                   help="requests decoding at once; more wait in a queue (default 8)")
    p.add_argument("--max-seq-len", type=positive_int, default=None, metavar="TOKENS",
                   help="longest request, prompt + max_tokens (default: the smaller of "
                   f"{_DEFAULT_MAX_SEQ_LEN} and config.json's max_position_embeddings)")
    p.add_argument("--num-pages", type=positive_int, default=None, metavar="PAGES",
                   help="pages in the KV pool (default: room for --max-seqs requests of "
                   "--max-seq-len tokens, or what --kv-memory holds); spare pages hold "
                   "cached prefixes")
    p.add_argument("--kv-memory", type=_positive_float, default=None, metavar="GIB",
                   help="size the KV pool from a memory budget instead of --num-pages: the "
                   "whole cache (every device's share together under --mesh) takes at most "
                   "GIB GiB, i.e. (GIB - the rows' fixed bytes) / bytes per page pages, "
                   "where a page's bytes are those of its page kind (with --kv-bits: codes, "
                   "scales and zero points) and each row's fixed bytes its page-table row "
                   "and, with --kv-bits, its full-precision tail of --kv-residual + "
                   "--page-size tokens. Low-bit pages thus hold several times the tokens "
                   "of full-precision ones in one budget. The pages and the sequences of "
                   "--max-seq-len tokens they admit are printed at start")
    p.add_argument("--page-size", type=positive_int, default=None, metavar="TOKENS",
                   help="tokens per cache page, a power of two (default 16; with --kv-bits "
                   "at least --kv-group-size, which must divide it)")
    p.add_argument("--chunk-size", type=positive_int, default=None, metavar="TOKENS",
                   help="prefill chunk length, a multiple of --page-size; a prefix-cache hit "
                   "covers whole chunks, and with --kv-bits hits need --chunk-size >= "
                   "--kv-residual + --page-size (default: 64, or --page-size if larger; with "
                   "--kv-bits at least --kv-residual + --page-size, so that prefix hits "
                   "work on KIVI pages)")
    p.add_argument("--kv-dtype", type=parse_dtype, default=None, metavar="DTYPE",
                   help="KV cache dtype: float32, bfloat16 or float16 (default: the params "
                   "dtype)")
    p.add_argument("--decode-steps", type=positive_int, default=1, metavar="N",
                   help="decode steps per engine call, and so tokens per streamed chunk at "
                   "most (default 1: each token streams as it is decoded; more spread each "
                   "call's fixed cost over several tokens, which stream together)")
    p.add_argument("--prefill-lanes", type=positive_int, default=16, metavar="N",
                   help="prompts prefilled per engine call at most, one per lane (default 16)")
    p.add_argument("--prefill-tokens", type=positive_int, default=1024, metavar="TOKENS",
                   help="prompt tokens per engine call at most, and at least one chunk "
                   "(default 1024): each call takes the lane shape that prefills the most "
                   "tokens per cost within them, several prompts in narrow lanes or one in "
                   "a wide lane (on float pages; one chunk per lane on KIVI pages and "
                   "window-only rings)")
    p.add_argument("--prefill-run", type=_non_negative_int, default=8, metavar="N",
                   help="engine calls with prefill lanes in a row that run no decode step "
                   "while prompts wait (default 8; 0: the decoding rows step in every "
                   "call: a lower inter-token p99, later first tokens)")
    add_kivi_flags(p)
    add_mesh_flags(p)
    p.add_argument("--window-pages", action=argparse.BooleanOptionalAction, default=None,
                   help="sliding-window layers keep only the pages their window plus one "
                   "chunk reaches (a ring per sequence, kvjax.cache.window) instead of the "
                   "whole sequence's; prefix hits then reach as far as those rings still "
                   "hold. Default: on where the model's config says so (window_pages), "
                   "else off; --no-window-pages turns it off")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="do not keep prompts' pages for later requests that share a prefix")
    p.add_argument("--host-pages", type=positive_int, default=None, metavar="PAGES",
                   help="add a host-memory tier of PAGES pages (pinned host RAM, the KV "
                   "pool's page kind and size): a request preempted for lack of pages is "
                   "swapped there and back instead of recomputed, and evicted cached prefixes "
                   "park there until a later hit brings them back (default: no host tier)")
    p.add_argument("--host-rows", type=positive_int, default=None, metavar="N",
                   help="with --host-pages: sequences the host tier holds at once, swapped "
                   "requests and parked prefixes together (default 2 x --max-seqs); when it "
                   "is full, parked prefixes are dropped first and a request that does not "
                   "fit is recomputed")
    p.add_argument("--no-warmup", action="store_true",
                   help="start serving before the engine's programs are compiled (the first "
                   "requests then wait for the compiles)")
    p.add_argument("--dtype", type=parse_dtype, default=None, metavar="DTYPE",
                   help="params and activations dtype (default: the checkpoint's)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every path but /health and "
                   "/metrics (401 otherwise); default: no key. KVJAX_API_KEY in the "
                   "environment sets it too, out of the process list")
    p.add_argument("--max-request-bytes", type=positive_int, default=8 * 2**20,
                   metavar="BYTES",
                   help="largest request body; a larger one gets a 413 before it is read "
                   "whole or parsed (default 8388608, 8 MiB). Text prompts longer than "
                   "32 characters per token of --max-seq-len are refused untokenized")
    p.add_argument("--request-timeout", type=_positive_float, default=None,
                   metavar="SECONDS",
                   help="a request unfinished this long after it arrived (body upload "
                   "included) is cancelled and answered 408 (default: no limit)")
    p.add_argument("--max-waiting", type=_non_negative_int, default=None, metavar="N",
                   help="requests that may wait for a row beyond the --max-seqs running; "
                   "more get a 429 (default: no bound)")
    p.add_argument("--drain-timeout", type=_positive_float, default=None, metavar="SECONDS",
                   help="on SIGTERM/SIGINT, wait at most this long for requests in flight "
                   "before exiting (default: until they finish; a second signal exits at "
                   "once)")
    p.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level (default info: one line per request)")
    p.set_defaults(func=run)
    return p


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _eos_ids(path: str, hf: dict, tokenizer) -> list[int]:
    """EOS ids from config.json, generation_config.json (chat models' end-of-turn) and the
    tokenizer."""
    import json

    ids = []
    sources = [hf.get("eos_token_id")]
    gen = os.path.join(path, "generation_config.json")
    if os.path.exists(gen):
        try:
            with open(gen) as f:
                sources.append(json.load(f).get("eos_token_id"))
        except (OSError, ValueError, AttributeError):
            pass
    sources.append(tokenizer.eos_token_id)
    for s in sources:
        for t in [s] if isinstance(s, int) else (s or []):
            if isinstance(t, int) and t not in ids:
                ids.append(t)
    return ids


def _default_chunk_size(page_size: int, kv_bits: int | None, kv_residual: int) -> int:
    """`--chunk-size` when none is given: 64 (or one page if larger); with KIVI pages at
    least `kv_residual + page_size`, the least chunk under which prefix hits reach quantized
    pages (`kvjax.serve.engine`); a multiple of `page_size` either way."""
    chunk = max(_DEFAULT_CHUNK, page_size)
    if kv_bits is not None:
        chunk = max(chunk, kv_residual + page_size)
    return -(-chunk // page_size) * page_size


@dataclasses.dataclass(frozen=True)
class _PoolBudget:
    """How a `--kv-memory` budget becomes a page count (bytes from the cache's array shapes).

    Attributes:
      pages: pages in the pool: `(budget - fixed_bytes) // page_bytes`, rounded down to a
        multiple of the plan's page shards.
      page_bytes: bytes one more page costs: its pools (codes, scales and zero points on
        KIVI pages) and its page-table entries.
      pool_page_bytes: the pools' share of `page_bytes` (K/V or latent pages only).
      fixed_bytes: bytes that do not grow with the pages: every slot's page-table row and,
        on KIVI pages, its full-precision tail (and window rings, recurrent state).
      total_bytes: bytes of the cache with `pages` pages (at most the budget).
    """

    pages: int
    page_bytes: int
    pool_page_bytes: int
    fixed_bytes: int
    total_bytes: int


def _pool_for_budget(spec, budget: int, shards: int = 1) -> _PoolBudget:
    """The pool a cache like `spec` (any `num_pages`) gets from `budget` bytes.

    Args:
      spec: the engine's `CacheSpec` (its slots, page kind, tail and groups); its
        `num_pages` is ignored.
      budget: bytes the whole cache may take.
      shards: the page count is rounded down to a multiple of this (a plan's page shards).

    Raises:
      ValueError: the budget does not cover the fixed bytes and one page per shard.
    """
    import jax

    from kvjax import cache as kv_cache

    def sizes(n):
        shapes = jax.eval_shape(lambda: kv_cache.init_cache(spec.replace(num_pages=n)))
        def nbytes(tree):
            return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
        return nbytes(shapes), nbytes(shapes.pages)

    (one, one_pool), (two, two_pool) = sizes(shards), sizes(2 * shards)
    page, pool_page = (two - one) // shards, (two_pool - one_pool) // shards
    fixed = one - shards * page
    pages = max(budget - fixed, 0) // page // shards * shards
    if pages < shards:
        raise ValueError(f"--kv-memory {budget / _GIB:.4g} GiB does not cover the cache's fixed "
                         f"{fixed} bytes (page-table rows, full-precision tails) and "
                         f"{shards} page(s) of {page} bytes; give more memory, fewer "
                         f"--max-seqs or a shorter --kv-residual")
    return _PoolBudget(pages=int(pages), page_bytes=int(page), pool_page_bytes=int(pool_page),
                      fixed_bytes=int(fixed), total_bytes=int(fixed + pages * page))


def _caches_prefixes(spec, plan) -> bool:
    """Whether `Engine` keeps prefixes on a cache like `spec` under `plan` (asked to): not on
    a hybrid model's cache, nor on a sequence- or context-sharded table."""
    sharded = plan is not None and (plan.data_shards > 1 or plan.context_shards > 1)
    return spec.recurrent is None and not sharded


def run(args: argparse.Namespace) -> int:
    """Runs `serve` for parsed `args` until interrupted; returns the exit status.

    Errors the user can act on (bad arguments, a missing package, an unreadable
    checkpoint or tokenizer, a mesh larger than the devices) print one `error:` line and
    return non-zero.
    """
    if args.page_size is None:
        args.page_size = _DEFAULT_PAGE if args.kv_bits is None else max(
            _DEFAULT_PAGE, args.kv_group_size)
    if args.page_size & (args.page_size - 1):
        print(f"error: --page-size must be a power of two, got {args.page_size}",
              file=sys.stderr)
        return 2
    chunk_size = args.chunk_size
    if chunk_size is None:
        chunk_size = _default_chunk_size(args.page_size, args.kv_bits, args.kv_residual)
    if chunk_size % args.page_size:
        print(f"error: --chunk-size ({chunk_size}) must be a multiple of --page-size "
              f"({args.page_size})", file=sys.stderr)
        return 2
    if args.host_rows is not None and args.host_pages is None:
        print("error: --host-rows needs --host-pages", file=sys.stderr)
        return 2
    if args.kv_memory is not None and args.num_pages is not None:
        print("error: give --num-pages or --kv-memory, not both", file=sys.stderr)
        return 2
    if args.mesh is not None and args.host_pages is not None:
        print("error: --host-pages does not combine with --mesh (the host tier swaps one "
              "device's pages)", file=sys.stderr)
        return 2
    if not 0 <= args.port < 65536:
        print(f"error: --port must lie in [0, 65535], got {args.port}", file=sys.stderr)
        return 2
    missing = [m for m in ("fastapi", "uvicorn", "transformers")
               if importlib.util.find_spec(m) is None]
    if missing:
        print(f"error: the server needs {', '.join(missing)}: pip install 'kvjax[serve]'",
              file=sys.stderr)
        return 2
    if not os.path.isdir(args.model):
        print(f"error: --model {args.model} is not a directory", file=sys.stderr)
        return 2
    try:
        plan = sharding_plan(args.mesh)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    import time

    import transformers
    import uvicorn

    from kvjax import models
    from kvjax.generate import CacheConfig
    from kvjax.serve import Engine
    from kvjax.serve.server import DrainingServer, create_app
    from kvjax.specs import QuantSpec

    t0 = time.perf_counter()
    try:
        hf = models.read_hf_config(args.model)
        model, params = models.load(args.model, dtype=args.dtype)
    except (ValueError, KeyError, OSError) as e:  # config, weights, files: each names its file
        print(f"error: {e.args[0] if isinstance(e, KeyError) else e}", file=sys.stderr)
        return 2
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    except Exception as e:  # transformers raises many kinds; the message names the file
        print(f"error: cannot load a tokenizer from {args.model}: {type(e).__name__}: {e}",
              file=sys.stderr)
        return 2
    max_seq_len = args.max_seq_len
    if max_seq_len is None:
        max_seq_len = min(_DEFAULT_MAX_SEQ_LEN,
                          hf.get("max_position_embeddings") or _DEFAULT_MAX_SEQ_LEN)
    budget = None
    try:
        quant = None if args.kv_bits is None else QuantSpec(
            bits=args.kv_bits, group_size=args.kv_group_size, residual=args.kv_residual)
        cache = CacheConfig(dtype=args.kv_dtype or model.config.dtype, quant=quant,
                            page_size=args.page_size, num_pages=args.num_pages,
                            window_pages=args.window_pages, plan=plan)
        if args.kv_memory is not None:
            spec = cache.spec(model, num_seqs=1, max_tokens=max_seq_len, chunk=chunk_size)
            # The engine's slots: its rows, and 2 x max_seqs prefix holders if it caches.
            holders = not args.no_prefix_caching and _caches_prefixes(spec, plan)
            slots = args.max_seqs * (3 if holders else 1)
            spec = cache.spec(model, num_seqs=slots, max_tokens=max_seq_len, chunk=chunk_size)
            budget = _pool_for_budget(spec, int(args.kv_memory * _GIB),
                                     1 if plan is None else plan.page_shards)
            cache = dataclasses.replace(cache, num_pages=budget.pages)
        elif args.num_pages is None and plan is not None:
            # Room for every row's longest request in its own data shard (the rows are
            # rounded up to the shards, and a row's pages come from its shard).
            spec = cache.spec(model, num_seqs=args.max_seqs, max_tokens=max_seq_len,
                              chunk=chunk_size)
            cache = dataclasses.replace(cache, num_pages=spec.num_pages)
        engine = Engine(model, params, max_seqs=args.max_seqs, max_seq_len=max_seq_len,
                        cache=cache, chunk_size=chunk_size,
                        decode_steps=args.decode_steps, max_decode_steps=args.decode_steps,
                        prefill_rows=args.prefill_lanes, prefill_run=args.prefill_run,
                        # At least a chunk: a budget below one lane would hold every
                        # prompt back while any row decodes.
                        token_budget=args.max_seqs + max(args.prefill_tokens, chunk_size),
                        prefix_caching=not args.no_prefix_caching,
                        host_pages=args.host_pages or 0, host_rows=args.host_rows,
                        eos_ids=[t for t in _eos_ids(args.model, hf, tokenizer)
                                 if t < model.vocab_size])
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    if not args.no_warmup:
        t1 = time.perf_counter()
        print("compiling the engine's programs ...", file=sys.stderr, flush=True)
        engine.warmup()
        print(f"compiled in {time.perf_counter() - t1:.1f} s", file=sys.stderr)
    spec = engine.spec
    print(f"loaded {hf['architectures'][0]} ({model.family}, {model.config.attention}) in "
          f"{time.perf_counter() - t0:.1f} s; serving it as {name!r} at "
          f"http://{args.host}:{args.port}/v1 ({args.max_seqs} sequences of up to "
          f"{max_seq_len} tokens, {spec.num_pages} pages of {spec.page_size} tokens, "
          f"{spec.dtype.name}" + ("" if args.kv_bits is None else f", KIVI int{args.kv_bits}")
          + f", prefill chunks of {chunk_size} tokens"
          + "".join(f"; layers {g.layers} keep {g.window}-token windows in rings of "
                    f"{g.ring_pages(spec.page_size)} pages" for g in spec.window_groups)
          + ("" if args.host_pages is None else
             f"; host tier of {args.host_pages} pages, {engine.host_rows} rows")
          + ("" if plan is None else
             f"; on a mesh of {_devices(engine)} {_platform()} devices ("
             + ", ".join(f"{n}={s}" for n, s in args.mesh) + "; strategies "
             + ", ".join(plan.strategies) + ")")
          + ("" if args.no_prefix_caching or _caches_prefixes(spec, plan) else
             "; prefix caching off: a sequence- or context-sharded table, or a hybrid "
             "model") + ")",
          file=sys.stderr)
    if budget is not None:
        from kvjax.cache.ops import cache_device_bytes

        # What the engine's cache takes (the estimate assumed its slots).
        budget = dataclasses.replace(budget, total_bytes=cache_device_bytes(spec))
        print(_budget_line(args, budget, spec, max_seq_len), file=sys.stderr)
    api_key = args.api_key if args.api_key is not None else (
        os.environ.get("KVJAX_API_KEY") or None)
    app = create_app(engine, tokenizer, model_name=name, api_key=api_key,
                     max_request_bytes=args.max_request_bytes,
                     request_timeout=args.request_timeout, max_waiting=args.max_waiting)
    _uvicorn_logging()
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port,
                                           log_config=None, log_level=args.log_level,
                                           timeout_graceful_shutdown=args.drain_timeout))
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it drained on
        pass
    except SystemExit as e:  # uvicorn exits when it cannot bind the port (it logged why)
        return e.code if isinstance(e.code, int) else 1
    if not server.started:  # as uvicorn.run: a startup that failed is exit status 3
        return 3
    return 0


class _CurrentStream(logging.StreamHandler):
    """A handler writing to whatever `sys.<name>` is when it emits (not the stream of the
    moment it was made, which a caller may close or replace)."""

    def __init__(self, name: str):
        self._stream_name = name
        super().__init__()

    @property
    def stream(self):
        return getattr(sys, self._stream_name)

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns one: ignored
        pass


def _uvicorn_logging() -> None:
    """uvicorn's default log lines (server messages on stderr, the access log on stdout),
    set up without `logging.config.dictConfig`, which is how uvicorn applies its default:
    that call closes every log handler of the process first, which breaks the logging of a
    program that runs `serve` in-process (absl's handler closes its stream with it). Loggers
    that already have handlers (the caller's configuration) are left as they are."""
    from uvicorn.logging import AccessFormatter, DefaultFormatter

    for name, stream, formatter in (
            ("uvicorn", "stderr", DefaultFormatter("%(levelprefix)s %(message)s")),
            ("uvicorn.access", "stdout", AccessFormatter(
                '%(levelprefix)s %(client_addr)s - "%(request_line)s" %(status_code)s'))):
        logger = logging.getLogger(name)
        if not logger.handlers:
            handler = _CurrentStream(stream)
            handler.setFormatter(formatter)
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
            logger.propagate = False


def _platform() -> str:
    import jax

    return jax.devices()[0].platform


def _devices(engine) -> int:
    """Devices the engine's params live on."""
    import jax

    return len({d for x in jax.tree.leaves(engine.params) for d in x.devices()})


def _budget_line(args, budget: _PoolBudget, spec, max_seq_len: int) -> str:
    """The start-up line that says what the --kv-memory budget admits."""
    ps = spec.page_size
    if spec.quant is None:
        per_seq = -(-max_seq_len // ps)
        kind = f"{spec.dtype.name} pages"
    else:  # a sequence's last --kv-residual tokens or more stay in its row's tail
        per_seq = max(max_seq_len - spec.quant.residual, 0) // ps
        kind = (f"KIVI int{args.kv_bits} pages (codes, scales and zero points; "
                f"{spec.quant.residual} + {ps}-token {spec.dtype.name} tails per row)")
    seqs = budget.pages // per_seq if per_seq else "any number of"
    return (f"KV memory {args.kv_memory:g} GiB: {budget.pages} pages of {ps} tokens "
            f"({budget.pages * ps} tokens) x {budget.page_bytes} bytes "
            f"({budget.pool_page_bytes} of them K/V) + {budget.fixed_bytes} bytes for "
            f"{spec.max_seqs} slots' rows = {budget.total_bytes} bytes of {kind}; room for "
            f"{seqs} sequences of {max_seq_len} tokens ({per_seq} pages each), "
            f"{args.max_seqs} decoding at once (--max-seqs)")
