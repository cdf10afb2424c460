"""Continuous batching with chunked prefill and prefix caching, on kvjax's decode step.

    engine = Engine(model, params, max_seqs=8, max_seq_len=2048,
                    cache=CacheConfig(dtype="bfloat16", quant=QuantSpec(bits=4)))
    rid = engine.add_request(prompt_ids, max_tokens=64)
    while engine.has_unfinished():
        for out in engine.step():          # RequestOutput: new tokens, finished, reason
            ...

Requests arrive at any time. The engine keeps one cache of `max_seqs` decoding rows
(plus spare slots that hold cached prefixes) and one `DecodeState` over the rows;
each `step()` runs two jitted programs back to back:

  * one prefills a chunk of up to `prefill_rows` waiting prompts through
    `kvjax.generate.prefill`, one per lane, in the lane shape that prefills the most
    tokens per cost within the token budget (on float pages: many prompts in narrow
    lanes, fewer in wider lanes of several chunks; `steps.lane_shapes`), and for each
    prompt whose last chunk this was samples its first token and makes its row a
    decoding row;
  * the other runs `kvjax.generate.decode_step` on every decoding row (the same step function
    `generate` loops over: every page kind, policy and sharding plan) in a
    `lax.while_loop`: one step while a prompt still waits for a chunk (it starts
    sooner); while every row is busy, until the first row finishes (the host knows
    when a row reaches `max_tokens`, the device stops at an EOS), so that a waiting
    request takes the row in the next call and no row idles for it (`max_decode_steps`
    at most); else `decode_steps`.

Decode tokens and prefill chunks share a per-step token budget. Scheduling is
host-side NumPy: the engine reads back a few small arrays per step (each row's new
tokens, counts, lengths, free pages), finishes requests (EOS, `max_tokens`, a stop
id, a cancel), frees their pages and admits waiting ones.

Prompts that arrive together with a common prefix are prefilled once: a prompt that
shares more whole chunks with an earlier prompt still being prefilled than the cache
holds waits (takes no lane) until that prompt's pages cover them, and then hits them.

Before each step the engine makes sure the pool can supply every page the step may
allocate: first by evicting cached prefixes (least recently used), then by
preempting the most recently admitted request (its pages are freed; it waits again
with its prompt and the tokens it produced so far, recomputed when it is readmitted,
so nothing is lost). A step therefore never runs out of pages.

With a host tier (`host_pages`, `host_rows`; `kvjax.cache.host`), preemption swaps
instead: the request's sequence moves to a parked row of a host-memory page pool
(`swap_out`) and its decoding row's state to the host, and both come back
(`swap_in`, into any free row) when the pool has room, so it continues where it
stopped without recomputing anything. Evicted prefix holders move to parked rows
too, and a later hit brings them back before sharing them. When the host tier is
full, parked prefixes are dropped least recently used first; a swapped request is
never dropped, and a request the tier cannot take is preempted by recompute. With
window-only pages a parked sequence takes its windowed layers' rings along (and a
swapped request keeps the first logical page its rings hold), so it comes back as it
left.

Tokens of a request equal those of `kvjax.generate` run on that request alone with
the same `chunk_size` (greedy, or sampled with the same key: row i's step s samples
with `fold_in(key, s)`): chunks start at the same positions (a wide lane of several
chunks gives their logits, `steps.lane_shapes`), and a prefix hit covers whole chunks
only. On a KIVI cache a hit also covers only pages that the request would
have quantized itself by the end of its first chunk after the hit, so quantization
happens at the same tokens with and without the hit (with a residual R, hits need
`chunk_size >= R + page_size`).

With window-only pages (`CacheConfig(window_pages=True)`, `kvjax.cache.window`) the
cache is built for the engine's chunks (each window group's ring holds
`ring_pages(window, chunk_size, page_size)` pages per slot) and every slot, rows and
prefix holders alike, has its ring in each group's pool, so the windowed layers never
run out of pages and allocate nothing once a ring is full; the page check above covers
the main pool (the global layers). A hit of j pages reuses the main pool's pages
[0, j) and, in each group, the ring pages of [first_g, j), first_g = page of position
j * page_size - window_g + 1: all the keys the request's queries at j * page_size and
later read in that group. A holder's rings hold the last pages of the sequence it was
registered from only, so j is the longest whole-chunk match for which some holder's
rings still reach back to first_g in every group; the tokens from j * page_size on are
recomputed through every layer (a windowed layer's keys there need every earlier
layer's output there). Hits are therefore exact, and shorter than without window
pages when a prompt ran past the shared prefix by more than about one chunk before
its pages were registered. A call in which a prompt ends runs no more decode steps
than keep that prompt's window in its rings, so its pages can still be registered.

The engine in parts (each its own module): `steps` holds the jitted programs (the step,
prefix sharing, frees, a row's save and restore); `slots.CacheSlots` holds the device
state and the host's mirror of its lengths and free pages and runs those programs;
`prefixes.PrefixPages` finds and attaches prefix hits and keeps, evicts and parks cached
prefixes (over the index `prefix.PrefixCache`); `scheduler.Scheduler` admits, plans each
step, preempts and swaps, and delivers tokens. `Engine` ties them together and is the
public face. `Engine.rebuilt()` makes a fresh engine from the same params and options
with every unfinished request queued again, recomputed from its prompt and the tokens
it produced (what a server does after a failed step: `kvjax.serve.server`).
"""

import collections
import dataclasses
import itertools
import warnings
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as kv_cache
from kvjax.cache import host
from kvjax.cache.policies.base import CachePolicy
from kvjax.generate import setup
from kvjax.generate.loop import DecodeState, decode_params
from kvjax.generate.sampling import RowSampling, SamplingConfig
from kvjax.models.base import Model, Packing
from kvjax.serve import steps
from kvjax.serve.prefix import PrefixCache
from kvjax.serve.prefixes import PrefixPages
from kvjax.serve.scheduler import Request, RequestOutput, Scheduler, TokenLogprobs
from kvjax.serve.slots import CacheSlots

__all__ = ["Engine", "RequestOutput", "TokenLogprobs"]

GREEDY = steps.GREEDY


def _has_recurrent_state(model: Model) -> bool:
    """Whether the model's cache keeps a recurrent state per slot (hybrid models)."""
    spec = model.make_cache_spec(page_size=16, num_pages=1, max_seqs=1, max_pages_per_seq=1)
    return spec.recurrent is not None


def _settle(model: Model, cache, *, max_seqs, max_seq_len, chunk_size, prefill_rows,
            decode_steps, max_decode_steps, prefix_caching, policy, host_pages, host_rows,
            prefill_run=0, **unchecked) -> tuple[setup.CacheConfig, CachePolicy | None, bool]:
    """Checks `Engine`'s arguments; returns the cache config, the policy and whether prefix
    caching is on, as the engine will run them (see `Engine` for what combines). The
    `unchecked` ones are checked where they are used."""
    cfg = cache if cache is not None else setup.CacheConfig()
    if not isinstance(cfg, setup.CacheConfig):
        raise TypeError(f"cache must be a kvjax.generate.CacheConfig, got "
                        f"{type(cfg).__name__}.")
    for name, v in (("max_seqs", max_seqs), ("max_seq_len", max_seq_len),
                    ("chunk_size", chunk_size), ("prefill_rows", prefill_rows),
                    ("decode_steps", decode_steps),
                    ("max_decode_steps", 1 if max_decode_steps is None else max_decode_steps)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"Engine: {name} must be a positive int, got {v!r}.")
    if max_decode_steps is not None and max_decode_steps < decode_steps:
        raise ValueError(f"Engine: max_decode_steps ({max_decode_steps}) must be at least "
                         f"decode_steps ({decode_steps}).")
    ps = cfg.page_size
    if chunk_size % ps:
        raise ValueError(f"Engine: chunk_size ({chunk_size}) must be a multiple of the page "
                         f"size ({ps}), so prefix hits end on chunk boundaries.")
    setup.check_policy(policy)
    for name, v, lo in (("host_pages", host_pages, 0), ("host_rows", host_rows, 1),
                        ("prefill_run", prefill_run, 0)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | np.integer)
                              or v < lo):
            raise ValueError(f"Engine: {name} must be an int >= {lo}, got {v!r}.")
    if host_rows is not None and not host_pages:
        raise ValueError("Engine: host_rows needs a host tier; give host_pages too.")
    if host_pages and policy is not None:
        raise ValueError("Engine: a host tier does not combine with a cache policy (the "
                         "policy's per-slot state is not swapped); drop host_pages or the "
                         "policy.")
    if host_pages and cfg.plan is not None:
        raise ValueError("Engine: a host tier does not combine with a sharding plan; drop "
                         "host_pages or the plan.")
    if (policy is not None and cfg.window_pages is None
            and cfg.windows_for(model) is not None):
        # A policy compacts one length per sequence over every layer and selects pages
        # by position: not defined on window groups' rings.
        setup.log_fallback(
            f"Engine: {type(policy).__name__} runs on full pages: the model's "
            f"window-only pages do not combine with a cache policy. Pass "
            f"CacheConfig(window_pages=False) to choose this explicitly.")
        cfg = dataclasses.replace(cfg, window_pages=False)
    if policy is not None and cfg.windows_for(model) is not None:
        raise ValueError(f"Engine: {type(policy).__name__} selects or scores pages by "
                         f"position; a cache with window-only pages (CacheConfig."
                         f"window_pages) keeps only its windowed layers' last pages. Serve "
                         f"without the policy or with window_pages=False.")
    policy = setup.check_policy_model(policy, model)
    if policy is not None and prefix_caching:
        prefix_caching = False  # eviction rewrites pages a prefix would share
    if _has_recurrent_state(model):
        # A hit would need the linear layers' state at the prefix's end, which the cache
        # does not keep (only the state at each sequence's current end).
        prefix_caching = False
        if host_pages:
            raise ValueError("Engine: a host tier does not take a hybrid model's cache "
                             "(its recurrent state is not swapped); drop host_pages.")
    sharded = cfg.plan is not None and (cfg.plan.data_shards > 1
                                        or cfg.plan.context_shards > 1)
    if sharded:
        prefix_caching = False  # a slot's pages come from its own shard
    return cfg, policy, prefix_caching


def _initial_state(kv, max_seqs: int, policy_state) -> DecodeState:
    """Every row idle (done) on an empty cache (and the policy's initial state); with a host
    tier, every leaf committed to the device the host pools are committed to."""
    state = DecodeState(
        cache=kv, seq_ids=jnp.arange(max_seqs, dtype=jnp.int32),
        last=jnp.zeros((max_seqs,), jnp.int32), position=jnp.zeros((max_seqs,), jnp.int32),
        tokens=jnp.full((max_seqs, 1), -1, jnp.int32),
        num_generated=jnp.zeros((max_seqs,), jnp.int32),
        max_new=jnp.ones((max_seqs,), jnp.int32), done=jnp.ones((max_seqs,), bool),
        keys=jax.random.split(jax.random.key(0), max_seqs), status=steps.ok_status(kv),
        step=jnp.int32(0), policy_state=policy_state,
        row_sampling=jax.tree.map(jnp.asarray, RowSampling.of([GREEDY] * max_seqs)))
    if kv.host is not None:
        # The host pools are committed to their device (placed with a memory kind) and jit
        # keys its programs on placement: commit the rest of the state there too, or a step
        # on the fresh state would compile apart from the same step later on.
        place = jax.tree.leaves(kv.host.pages)[0].sharding.with_memory_kind("device")
        state = jax.tree.map(lambda x: x if x.committed else jax.device_put(x, place), state)
    return state


def _packed(model: Model, packed_prefill: bool | None, floats: bool) -> bool:
    """Whether the engine packs its prefill lanes (`Engine`'s `packed_prefill`)."""
    can = model.packs and floats
    if packed_prefill and not can:
        raise ValueError(
            f"Engine: packed_prefill needs a model whose forward packs (the {model.family!r} "
            f"family's " + ("does" if model.packs else "does not") + ") on float pages without "
            "a cache policy.")
    return can if packed_prefill is None else bool(packed_prefill)


def _lane_arrays(lanes: list[tuple[Request, int]], shape: tuple[int, ...], rows: int,
                 key_words: int) -> steps.Lanes:
    """A step's prefill lanes as arrays, padded with idle lanes (of distinct idle rows) to
    `shape`: (lanes, width), or (lanes, width, tokens) with the lanes packed end to end in
    one row of that many tokens."""
    P, C = shape[:2]
    tokens = np.zeros((P, C), np.int32)
    lengths = np.zeros((P,), np.int32)
    used = {r.slot for r, _ in lanes}
    idle = [s for s in range(rows) if s not in used]
    slots = np.array([r.slot for r, _ in lanes] + idle[: P - len(lanes)], np.int32)
    start = np.zeros((P,), np.int32)
    last = np.zeros((P,), bool)
    count = np.zeros((P,), np.int32)
    max_new = np.ones((P,), np.int32)
    key_data = np.zeros((P, key_words), np.uint32)
    configs = [GREEDY] * P
    for i, (r, n) in enumerate(lanes):
        tokens[i, :n] = r.fed[r.done_tokens: r.done_tokens + n]
        lengths[i] = n
        start[i] = r.done_tokens
        last[i] = r.done_tokens + n == len(r.fed)
        count[i] = len(r.output)
        max_new[i] = r.max_tokens
        key_data[i] = r.key_data
        configs[i] = r.sampling
    packing = None
    if len(shape) == 3:
        packing = Packing.of(lengths, shape[2], C)
        row = np.zeros((1, shape[2]), np.int32)
        row[0, :lengths.sum()] = np.concatenate([tokens[i, :n] for i, n in enumerate(lengths)])
        tokens = row
    # NumPy leaves: the jitted step moves them in its own dispatch (about 40 us for the
    # lot on a 2-core EPYC, where a jax.device_put of the tree took 0.5 ms).
    return steps.Lanes(tokens=tokens, lengths=lengths, slots=slots, start=start, last=last,
                       key_data=key_data, count=count, max_new=max_new,
                       sampling=RowSampling.of(configs), packing=packing)


def _warmup_calls(shapes, buckets) -> list[tuple[tuple[int, int] | None, int | None]]:
    """(lane shape or None, live bucket) of the calls that compile every program a step
    runs: a prefill program per lane shape and a decode program per decoding-row bucket
    (the decode steps a call runs are an argument), each bucket with and without lanes
    before it."""
    return [(None, b) for b in buckets] + [
        (shapes[i % len(shapes)], buckets[i % len(buckets)])
        for i in range(max(len(shapes), len(buckets)))]


class Engine:
    """Serves requests that arrive at any time on one paged cache (see the module doc).

    Args:
      model, params: from `kvjax.models.load` (or a family's init_params).
      max_seqs: rows decoding at once.
      max_seq_len: longest request: prompt tokens + max_tokens.
      cache: a `kvjax.generate.CacheConfig` (dtype, KIVI quantization, page size, pool
        size, sharding plan); `num_pages` defaults to room for `max_seqs` sequences of
        `max_seq_len` tokens. Cached prefixes use pages nobody else needs.
      chunk_size: prefill chunk length; a multiple of the page size.
      prefill_rows: prompts prefilled per step at most, one per lane (lane counts:
        powers of two; widths: one chunk, and on float pages without a policy or
        window-only rings also narrower or wider lanes within the budget,
        `steps.lane_shapes`; a model that packs on float pages without a policy puts
        the lanes end to end in one row, `steps.packed_shapes`).
      token_budget: tokens per step, decode rows first; default max_seqs + prefill_rows *
        chunk_size (every lane may run every step).
      prefix_caching: keep prompts' full pages for later requests (not with a policy,
        whose eviction rewrites pages, nor with a sequence- or context-sharded table).
      prefix_slots: spare slots that hold cached prefixes (default 2 * max_seqs).
      eos_ids: tokens that end every request (besides each request's stop ids).
      impl: attention implementation.
      policy: a cache policy (eviction / page selection), as in `kvjax.generate`.
      decode_steps: decode steps per call while a row is free and no prompt waits for a
        prefill lane (a request that arrives meanwhile waits at most this many steps).
      max_decode_steps: decode steps per call at most while every row is busy: such a call
        ends with the step in which a row finishes, so that a waiting request takes the row
        at once (default 8 * decode_steps; tokens stream in groups of up to this many).
      host_pages: pages of a host-memory tier (`kvjax.cache.host`, pinned host memory,
        the cache's page kind and size); 0 (default): no host tier. With one, preemption
        swaps requests to the host instead of recomputing them, and evicted cached
        prefixes move to the host, from where a later hit brings them back. Not with a
        cache policy (its per-slot state is not swapped) nor a sharding plan.
      host_rows: parked rows of the host tier: swapped requests and cached prefixes it
        holds at once (default 2 * max_seqs; only with `host_pages`).
      prefill_run: calls with prefill lanes in a row with no decode step while prompts
        wait (0: one in every such call); default 8, ~2048 prompt tokens at the defaults:
        first tokens come sooner, and decoding rows wait that long (docs/serving.md).

    Attributes:
      stats: counters (`collections.Counter`): steps (decode steps), calls (programs run),
        prefill_tokens, prefill_chunks (lanes run, one or more chunks wide), decode_tokens,
        hit_pages, evictions (prefix holders leaving the device),
        preemptions (requests whose computed tokens were dropped, to be recomputed),
        requeues (requests sent back before they held anything); with a host tier also
        swaps and swap_ins (requests), prefix_parks (holders moved to the host),
        host_prefix_hits (hits served by bringing a parked prefix back) and
        host_prefix_drops (parked prefixes forgotten for room).
      slots, prefixes, scheduler: the engine's parts (`CacheSlots`, `PrefixPages`,
        `Scheduler`; see the module doc).
      prefix: the prefix-cache index (`PrefixCache`), None without prefix caching.
    """

    def __init__(self, model: Model, params, *, max_seqs: int = 8, max_seq_len: int = 2048,
                 cache: setup.CacheConfig | None = None, chunk_size: int = 64,
                 prefill_rows: int = 4, token_budget: int | None = None,
                 prefix_caching: bool = True, prefix_slots: int | None = None,
                 eos_ids: Sequence[int] = (), impl="auto", policy: CachePolicy | None = None,
                 decode_steps: int = 8, max_decode_steps: int | None = None,
                 host_pages: int = 0, host_rows: int | None = None, prefill_run: int = 8,
                 packed_prefill: bool | None = None):
        # What `rebuilt` builds a fresh engine from.
        self._options = dict(
            max_seqs=max_seqs, max_seq_len=max_seq_len, cache=cache, chunk_size=chunk_size,
            prefill_rows=prefill_rows, token_budget=token_budget, prefix_caching=prefix_caching,
            prefix_slots=prefix_slots, eos_ids=eos_ids, impl=impl, policy=policy,
            decode_steps=decode_steps, max_decode_steps=max_decode_steps,
            host_pages=host_pages, host_rows=host_rows, prefill_run=prefill_run,
            packed_prefill=packed_prefill)
        cfg, policy, prefix_caching = _settle(model, **self._options)
        ps = cfg.page_size
        self.model = model
        self.vocab_size = model.vocab_size
        self.max_seq_len = max_seq_len
        self.rows = max_seqs
        self.chunk = chunk_size
        self.decode_steps = decode_steps
        self.max_decode_steps = (8 * decode_steps if max_decode_steps is None
                                 else max_decode_steps)
        self.prefill_rows = min(prefill_rows, max_seqs)  # each lane needs its own row
        self.token_budget = token_budget or max_seqs + self.prefill_rows * chunk_size
        self.eos_ids = setup.check_eos(eos_ids, model.vocab_size)
        self.policy = policy
        n_holders = (2 * max_seqs if prefix_slots is None else prefix_slots) if (
            prefix_caching) else 0
        blank = 1 if policy is not None else 0  # a slot whose policy state stays initial
        per_seq = -(-max_seq_len // ps) + (1 if cfg.quant is not None else 0)
        if cfg.num_pages is None:
            cfg = dataclasses.replace(cfg, num_pages=max_seqs * per_seq)
        elif cfg.num_pages < per_seq:
            raise ValueError(f"Engine: the pool ({cfg.num_pages} pages) cannot hold one request "
                             f"of max_seq_len={max_seq_len} tokens ({per_seq} pages of {ps}); "
                             f"give more pages or a shorter max_seq_len.")
        kv, impl, plan = setup.prepare_cache(model, cfg, impl, num_seqs=max_seqs + n_holders
                                             + blank, max_tokens=max_seq_len, chunk=chunk_size)
        self.host_rows = 0
        if host_pages:
            self.host_rows = int(2 * max_seqs if host_rows is None else host_rows)
            kv = host.attach(kv, int(host_pages), parked=self.host_rows)
        self.spec = kv.spec
        self.impl = impl
        self.params = setup.shard_for_plan(model, params, plan)
        self.dparams = decode_params(model, self.params, max_seqs)
        self.prefix = PrefixCache(ps, range(max_seqs, max_seqs + n_holders)) if (
            prefix_caching) else None
        if self.prefix is not None and cfg.quant is not None and (
                chunk_size < cfg.quant.residual + ps):
            warnings.warn(f"Engine: with a KIVI residual of {cfg.quant.residual} tokens, prefix "
                          f"hits need chunk_size >= residual + page_size = "
                          f"{cfg.quant.residual + ps} (got {chunk_size}): none will happen.",
                          stacklevel=2)
        state = _initial_state(kv, max_seqs, None if policy is None else policy.init_state(kv))
        self._key_words = jax.random.key_data(state.keys).shape[-1]
        self.stats = collections.Counter()
        self.slots = CacheSlots(state, rows=max_seqs, host_rows=self.host_rows, policy=policy,
                                blank=max_seqs + n_holders if blank else None)
        self.prefixes = PrefixPages(self.slots, self.prefix, chunk=chunk_size, stats=self.stats,
                                    reserved_rows=lambda: set(self.scheduler.swapped))
        floats = cfg.quant is None and policy is None
        wide = floats and not kv.spec.window_groups
        most = min(self.prefill_rows * chunk_size, self.token_budget)
        self.packed = _packed(model, packed_prefill, floats)
        self.scheduler = Scheduler(
            self.slots, self.prefixes, chunk=chunk_size, prefill_rows=self.prefill_rows,
            token_budget=self.token_budget, decode_steps=decode_steps,
            max_decode_steps=self.max_decode_steps, stats=self.stats,
            lane_shapes=steps.packed_shapes(self.prefill_rows, most, chunk_size,
                                          least=max(ps, 32),
                                          widest=chunk_size if kv.spec.window_groups else None)
            if self.packed else steps.lane_shapes(
                self.prefill_rows, chunk_size, most=most, wide=wide, least=max(ps, 32),
                longest=-(-max_seq_len // chunk_size) * chunk_size),
            prefill_run=prefill_run)
        self._ids = itertools.count()

    @property
    def state(self) -> DecodeState:
        """The engine's decode state (its cache and decoding rows)."""
        return self.slots.state

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt_ids: Sequence[int], *, max_tokens: int,
                    sampling: SamplingConfig = GREEDY, stop_ids: Sequence[int] = (),
                    seed: int = 0, salt: str | None = None,
                    request_id: str | None = None, logprobs: int | None = None) -> str:
        """Queues a request; returns its id. Nothing runs until `step`.

        Args:
          prompt_ids: token ids, at least one, each in [0, vocab).
          max_tokens: tokens to produce at most (>= 1).
          sampling: how to pick tokens (greedy by default).
          stop_ids: tokens that end this request (kept in its output), besides EOS.
          seed: its PRNG seed: token s is drawn with fold_in(key(seed), s).
          salt: requests share cached prefix pages only with the same salt.
          request_id: a unique id (default: a counter).
          logprobs: if given (0 to `steps.TOP_LOGPROBS`), each output carries every
            token's log-probability and this many most likely tokens with theirs
            (`RequestOutput.logprobs`): the log-softmax of the model's raw logits, before
            temperature, top-k and top-p. Steps run while such a request is running record
            them (a second compiled step program; the others are unchanged).

        Raises:
          ValueError / TypeError: a bad prompt, max_tokens, sampling, stop id, a request
            longer than `max_seq_len`, or an id in use.
        """
        try:
            prompt = setup.check_prompts([prompt_ids], self.vocab_size)[0]
        except ValueError as e:  # one prompt here: "prompt 0" would read as an index
            raise ValueError(str(e).replace("prompt 0", "the prompt", 1)) from None
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int | np.integer) or (
                max_tokens < 1):
            raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}.")
        setup.check_sampling(sampling)
        stops = setup.check_eos(stop_ids, self.vocab_size)
        if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or not (
                0 <= seed < 2**64):
            raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}.")
        if len(prompt) + max_tokens > self.max_seq_len:
            raise ValueError(f"the prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) "
                             f"exceeds the engine's max_seq_len ({self.max_seq_len}).")
        top = min(steps.TOP_LOGPROBS, self.vocab_size)
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(
                logprobs, int | np.integer) or not 0 <= logprobs <= top):
            raise ValueError(f"logprobs must be an int in [0, {top}] (or None), got "
                             f"{logprobs!r}.")
        rid = str(next(self._ids)) if request_id is None else str(request_id)
        if rid in self.scheduler.requests:
            raise ValueError(f"request id {rid!r} is in use.")
        self.scheduler.add(Request(
            id=rid, prompt=prompt, max_tokens=int(max_tokens), sampling=sampling,
            stop_ids=frozenset(stops),
            key_data=np.asarray(jax.random.key_data(steps.seed_key(int(seed)))), salt=salt,
            logprobs=None if logprobs is None else int(logprobs), fed=prompt))
        return rid

    def cancel(self, request_id: str) -> None:
        """Ends a request at the next step (finish reason "cancelled"); unknown ids are
        ignored (it may have finished)."""
        req = self.scheduler.requests.get(str(request_id))
        if req is not None:
            req.cancelled = True

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.requests)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """Runs one engine step; returns what each request produced (see `RequestOutput`)."""
        sched, slots = self.scheduler, self.slots
        sched.outputs = []
        sched.drop_cancelled()
        sched.admit_waiting()
        sched.look_up_prefixes()
        decode, lanes, shape, k, until_finish = sched.plan()
        if not decode and not lanes:
            return sched.outputs
        # The step's logprobs variant runs only while a request asks for them.
        logprobs = any(r.logprobs is not None for r in sched.running.values())
        # Rows decoding in this call: those decoding now and those whose prompt ends in it.
        live = steps.live_bucket(self.rows, len(decode) + sum(
            r.done_tokens + n == len(r.fed) for r, n in lanes))
        slots.state, head, record, ran = steps.step(
            self.model, self.params, self.dparams, slots.state,
            self._lanes(lanes, shape) if lanes else None, np.int32(k), np.bool_(until_finish),
            eos_ids=self.eos_ids, impl=self.impl, policy=self.policy,
            decode=self.max_decode_steps, logprobs=logprobs, live=live)
        st, c = slots.state, slots.state.cache
        head, record, ran, code, *mirrored = jax.device_get(
            (head, record, ran, st.status.code, c.lengths, c.table.lengths, c.table.num_free,
             slots.host_free_array()))
        slots.mirror(mirrored)
        if head is not None:  # the lanes' entry first, then the decode steps'
            record = head if record is None else tuple(
                np.concatenate(x) for x in zip(head, record, strict=True))
        if int(code) != 0:
            # The page check above makes this unreachable; say so loudly if it is not.
            err = jax.device_get(st.status)
            raise RuntimeError(f"engine step failed with allocator status {int(err.code)} "
                               f"({int(err.pages_needed)} pages needed, {int(err.pages_free)} "
                               f"free): a scheduling bug.")
        self.stats["steps"] += int(ran)
        self.stats["calls"] += 1
        self.stats["prefill_tokens"] += sum(n for _, n in lanes)
        self.stats["prefill_chunks"] += len(lanes)
        sched.after_prefill(lanes)
        if record is not None:
            sched.deliver(record, (1 if lanes else 0) + int(ran), self.eos_ids)
        return sched.outputs

    def _lanes(self, lanes: list[tuple[Request, int]], shape: tuple[int, ...]) -> steps.Lanes:
        return _lane_arrays(lanes, shape, self.rows, self._key_words)

    def warmup(self) -> None:
        """Compiles every program a step may run (the step without prefill lanes and with
        each lane count; the bookkeeping of frees, forks and truncations; with a host tier,
        its swaps of every copy width and the decoding rows' save and restore), by running
        each on no-op arguments, so that no request waits for a compile (but for the step's
        logprobs variant, which the first request asking for log-probabilities compiles).
        Only on an idle engine (every run leaves the state as it was)."""
        if self.scheduler.running or self.scheduler.waiting:
            raise RuntimeError("Engine.warmup: only on an idle engine (no request queued or "
                               "running).")
        slots = self.slots
        # Idle lanes and rows that are all done change nothing.
        for shape, live in _warmup_calls(self.scheduler.lane_shapes,
                                         steps.live_buckets(self.rows)):
            slots.state, *out = steps.step(
                self.model, self.params, self.dparams, slots.state,
                None if shape is None else self._lanes([], shape), np.int32(1),
                np.bool_(False), eos_ids=self.eos_ids, impl=self.impl, policy=self.policy,
                decode=self.max_decode_steps, logprobs=False, live=live)
        jax.block_until_ready(out)
        slots.release([])
        slots.free_slots([])
        empty = np.nonzero(np.asarray(jax.device_get(slots.state.cache.lengths)) == 0)[0]
        if self.prefix is not None and empty.size >= 2:  # empty into empty: no change
            cache, _ = steps.share(slots.state.cache, np.int32(empty[0]), np.int32(empty[1]),
                                   np.int32(0))
            slots.set_cache(cache)
        if self.host_rows:
            used = set(self.scheduler.swapped) | set(self.prefixes.parked)
            free = [r for r in range(self.host_rows) if r not in used]
            if free:
                slots.set_cache(host.compile_swaps(slots.state.cache, int(empty[0]), free[0]))
            slots.put_row(0, slots.take_row(0))  # as a swap keeps a decoding row
        slots.sync()

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix (holders on the device and, with a host tier,
        parked rows), returning the pages only they held to their pools."""
        self.prefixes.reset()

    def run(self) -> dict[str, list[int]]:
        """Steps until every request is done; returns each request's tokens."""
        out: dict[str, list[int]] = collections.defaultdict(list)
        while self.has_unfinished():
            for o in self.step():
                out[o.request_id].extend(o.token_ids)
        return dict(out)

    # ------------------------------------------------------------------ recovery

    def rebuilt(self, delivered: Mapping[str, int] | None = None) -> "Engine":
        """A fresh engine from this one's model, params and options, with every unfinished
        request of this one queued again under its id (running ones first, in the order
        they were admitted, then the waiting ones in line). Each continues by recompute:
        its prompt and the tokens it produced are prefilled again, and it samples on with
        its own key from its own count, so its next tokens are those it would have
        produced (greedy, or sampled: token s draws with fold_in(key, s)); `max_tokens`
        still counts every token it produced. For a caller whose engine failed (an
        exception in `step`: the cache it donated is not trusted): nothing of this
        engine's device state is read, and it is released before the new cache is built.

        Args:
          delivered: request id -> tokens the caller has handed on of that request; a
            request's record is cut to them (a step that failed after recording tokens
            it never returned). Default: every token the engine recorded.

        Returns:
          The new engine; this one is left without state (do not use it again).
        """
        old = self.scheduler
        order = sorted(old.running.values(), key=lambda r: r.admitted) + list(old.waiting)
        # The failed engine's arrays may be half donated: drop them before allocating anew.
        state, self.slots.state = self.slots.state, None
        for x in jax.tree.leaves(state):
            if isinstance(x, jax.Array) and not x.is_deleted():
                x.delete()
        del state
        new = Engine(self.model, self.params, **self._options)
        new._ids = self._ids
        new.stats.update(self.stats)
        for r in order:
            output = r.output if delivered is None else r.output[: delivered.get(r.id, 0)]
            req = Request(id=r.id, prompt=r.prompt, max_tokens=r.max_tokens,
                          sampling=r.sampling, stop_ids=r.stop_ids, key_data=r.key_data,
                          salt=r.salt, logprobs=r.logprobs, output=list(output),
                          cached_tokens=r.cached_tokens,
                          cancelled=r.cancelled)
            req.to_recompute()
            new.scheduler.add(req)
        return new

    # ------------------------------------------------------------------ invariants

    def check(self) -> None:
        """AssertionError unless the cache's invariants hold, every page is free or held by
        a request or a cached prefix, and the prefix cache agrees with its holders; with a
        host tier, also the tier's invariants (`kvjax.cache.host.check`) and that every
        parked row belongs to exactly one swapped request or one parked prefix."""
        cache = self.slots.state.cache
        kv_cache.check_invariants(cache)
        if self.host_rows:
            _check_host(self)
        lengths = np.asarray(cache.lengths)
        users = set(self.scheduler.running)
        holders = set(self.prefix.holders) if self.prefix is not None else set()
        for s in range(self.spec.max_seqs):
            if lengths[s] and s not in users and s not in holders:
                raise AssertionError(f"slot {s} holds {lengths[s]} tokens but no request or "
                                     f"cached prefix owns it")
        if self.slots.windows.size:
            self.slots.check_rings({s: self.prefix.ring_lo(s) for s in holders})
        self.prefixes.check(lengths)

    def __repr__(self) -> str:
        return (f"Engine(rows={self.rows}, chunk={self.chunk}, pages={self.spec.num_pages}, "
                f"running={self.num_running}, waiting={self.num_waiting})")


def _check_host(engine: Engine) -> None:
    """AssertionError unless the host tier's invariants hold and every parked row belongs
    to exactly one swapped request (waiting, recorded there) or one parked prefix."""
    sched = engine.scheduler
    host.check(engine.state.cache)
    tokens = np.asarray(host.parked_lengths(engine.state.cache))
    owners: dict[int, list[str]] = collections.defaultdict(list)
    want: dict[int, int] = {}
    waiting = {id(r) for r in sched.waiting}
    for row, req in sched.swapped.items():
        owners[row].append(f"request {req.id!r}")
        want[row] = req.parked_tokens
        if req.parked != row or req.slot is not None or id(req) not in waiting:
            raise AssertionError(f"request {req.id!r} swapped out to row {row} is not "
                                 f"waiting there (row {req.parked}, slot {req.slot})")
    for row, toks in engine.prefixes.parked.items():
        owners[row].append("a cached prefix")
        want[row] = len(toks)
    for r in range(engine.host_rows):
        held = owners.get(r, [])
        if bool(tokens[r]) != bool(held) or len(held) > 1:
            raise AssertionError(f"parked row {r} holds {tokens[r]} tokens and belongs to "
                                 f"{held or 'nobody'}")
        if held and tokens[r] != want[r]:
            raise AssertionError(f"parked row {r} holds {tokens[r]} tokens, its owner "
                                 f"({held[0]}) {want[r]}")
    lost = [r.id for r in sched.waiting if r.parked is not None
            and sched.swapped.get(r.parked) is not r]
    if lost:
        raise AssertionError(f"requests {lost} wait on parked rows not recorded as theirs")
