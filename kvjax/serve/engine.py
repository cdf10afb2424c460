"""Continuous batching with chunked prefill and prefix caching, on kvjax's decode step.

    engine = Engine(model, params, max_seqs=8, max_seq_len=2048,
                    cache=CacheConfig(dtype="bfloat16", quant=QuantSpec(bits=4)))
    rid = engine.add_request(prompt_ids, max_tokens=64)
    while engine.has_unfinished():
        for out in engine.step():          # RequestOutput: new tokens, finished, reason
            ...

Requests arrive at any time. The engine keeps one cache of `max_seqs` decoding rows
(plus spare slots that hold cached prefixes) and one `DecodeState` over the rows;
each `step()` is one jitted program that

  * prefills one chunk (`chunk_size` tokens) of up to `prefill_rows` waiting prompts
    through `kvjax.generate.prefill`, and for each prompt whose last chunk this was
    samples its first token and makes its row a decoding row, then
  * runs `kvjax.generate.decode_step` on every decoding row (the same step function
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
with `fold_in(key, s)`): chunks start at the same positions, and a prefix hit covers
whole chunks only. On a KIVI cache a hit also covers only pages that the request would
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
"""

import collections
import dataclasses
import functools
import itertools
import warnings
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int, UInt32

from kvjax import cache as kv_cache
from kvjax.cache import host, window
from kvjax.cache.page_table import PageTable
from kvjax.cache.policies.base import CachePolicy
from kvjax.generate import loop, setup
from kvjax.generate.loop import DecodeState, decode_params, decode_step, prefill
from kvjax.generate.sampling import RowSampling, SamplingConfig, sample_rows
from kvjax.models.base import Model
from kvjax.serve.prefix import PrefixCache, page_hashes

__all__ = ["Engine", "RequestOutput"]

GREEDY = SamplingConfig()


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """What one `Engine.step` produced for one request.

    Attributes:
      request_id: the request.
      token_ids: tokens produced in this step (up to `max_decode_steps` + 1; a stop
        or EOS token is included).
      finished: the request is done; this is its last output.
      finish_reason: "stop" (an EOS or stop id), "length" (`max_tokens`), "cancelled", or
        None while it runs.
      prompt_tokens: tokens of its prompt.
      cached_tokens: prompt tokens served from the prefix cache (0 without a hit).
    """

    request_id: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int


@dataclasses.dataclass(eq=False)
class _Request:
    id: str
    prompt: np.ndarray
    max_tokens: int
    sampling: SamplingConfig
    stop_ids: frozenset[int]
    key_data: np.ndarray  # uint32 words of its PRNG key
    salt: str | None
    output: list[int] = dataclasses.field(default_factory=list)
    slot: int | None = None
    fed: np.ndarray | None = None  # what the slot must hold: prompt (+ output if preempted)
    done_tokens: int = 0  # tokens of `fed` in the cache
    cached_tokens: int = 0
    decoding: bool = False
    looked_up: bool = False  # prefix hits attached (or none to look for)
    # While it waits for an earlier prompt to prefill pages it shares: that request, and
    # the pages of its own prompt it will then find cached.
    leader: "_Request | None" = None
    target: int = 0
    hashes: list[bytes] | None = None  # the hash chain of `fed`'s full pages
    admitted: int = 0  # admission counter (preemption picks the latest)
    cancelled: bool = False
    # While swapped out to the host tier: its parked row, the tokens and device-table
    # tokens (KIVI: quantized) it held, and its decoding row's state (None: prefilling).
    parked: int | None = None
    parked_tokens: int = 0
    parked_table: int = 0
    parked_ring_base: np.ndarray | None = None  # per window group: its rings' first page
    row_state: "_Row | None" = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Lanes:
    """One prefill chunk per lane (a bucket of lanes up to `prefill_rows`; length 0: idle)."""

    tokens: Int[Array, "lanes chunk"]
    lengths: Int[Array, " lanes"]
    slots: Int[Array, " lanes"]
    start: Int[Array, " lanes"]  # position of the chunk's first token
    last: Bool[Array, " lanes"]  # the prompt's last chunk: sample its first token
    key_data: UInt32[Array, "lanes key_words"]  # each request's PRNG key, as its words
    count: Int[Array, " lanes"]  # tokens the request produced before (preemption)
    max_new: Int[Array, " lanes"]
    sampling: RowSampling


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Row:
    """One decoding row's state, kept on the host while its sequence is swapped out (the
    cache holds the rest: its tokens, and on KIVI its tail)."""

    last: Int[Array, ""]
    position: Int[Array, ""]
    num_generated: Int[Array, ""]
    max_new: Int[Array, ""]
    done: Bool[Array, ""]
    key_data: UInt32[Array, " key_words"]
    sampling: RowSampling  # one row's settings (scalars)


@jax.jit
def _take_row(state: DecodeState, slot: Int[Array, ""]) -> _Row:
    rs = state.row_sampling
    return _Row(last=state.last[slot], position=state.position[slot],
                num_generated=state.num_generated[slot], max_new=state.max_new[slot],
                done=state.done[slot], key_data=jax.random.key_data(state.keys[slot]),
                sampling=RowSampling(temperature=rs.temperature[slot], top_k=rs.top_k[slot],
                                     top_p=rs.top_p[slot]))


@functools.partial(jax.jit, donate_argnames="state")
def _put_row(state: DecodeState, slot: Int[Array, ""], row: _Row) -> DecodeState:
    """Row `slot` takes a state `_take_row` saved (the inverse of `_take_row`)."""
    rs, r = state.row_sampling, row.sampling
    key = jax.random.wrap_key_data(row.key_data, impl=jax.random.key_impl(state.keys))
    return dataclasses.replace(
        state, last=state.last.at[slot].set(row.last),
        position=state.position.at[slot].set(row.position),
        num_generated=state.num_generated.at[slot].set(row.num_generated),
        max_new=state.max_new.at[slot].set(row.max_new), done=state.done.at[slot].set(row.done),
        keys=state.keys.at[slot].set(key),
        row_sampling=RowSampling(temperature=rs.temperature.at[slot].set(r.temperature),
                                 top_k=rs.top_k.at[slot].set(r.top_k),
                                 top_p=rs.top_p.at[slot].set(r.top_p)))


def _admit(state: DecodeState, lanes: _Lanes, last_logits, ok,
           eos_ids) -> tuple[DecodeState, Bool[Array, ""]]:
    """Rows whose prompt just ended take their first token and start decoding; also
    returns whether one of them finished with it (EOS, or a request of one token)."""
    rows = state.seq_ids.shape[0]
    admit = lanes.last & (lanes.lengths > 0) & ok
    lane_keys = jax.random.wrap_key_data(lanes.key_data, impl=jax.random.key_impl(state.keys))
    keys = jax.vmap(jax.random.fold_in)(lane_keys, lanes.count)
    tok = sample_rows(last_logits, keys, lanes.sampling)
    num = lanes.count + 1
    finished = admit & (loop._is_eos(tok, eos_ids) | (num >= lanes.max_new))
    tgt = jnp.where(admit, lanes.slots, rows)  # out of range: dropped

    def put(x, v):
        return x.at[tgt].set(v, mode="drop")

    rs, ls = state.row_sampling, lanes.sampling
    state = dataclasses.replace(
        state, last=put(state.last, tok),
        position=put(state.position, lanes.start + lanes.lengths),
        num_generated=put(state.num_generated, num), max_new=put(state.max_new, lanes.max_new),
        done=put(state.done, finished), keys=put(state.keys, lane_keys),
        row_sampling=RowSampling(temperature=put(rs.temperature, ls.temperature),
                                 top_k=put(rs.top_k, ls.top_k), top_p=put(rs.top_p, ls.top_p)))
    return state, jnp.any(finished)


@functools.partial(jax.jit, static_argnames=("model", "eos_ids", "impl", "policy", "decode"),
                   donate_argnames="state")
def _step(model: Model, params, dparams, state: DecodeState, lanes: _Lanes | None,
          steps: Int[Array, ""], until_finish: Bool[Array, ""], *,
          eos_ids: tuple[int, ...], impl, policy: CachePolicy | None, decode: int):
    """The engine's step: one prefill chunk per lane (rows whose prompt ends take their
    first token), then up to `steps` (<= `decode`, static) decode steps over the rows, in
    a `lax.while_loop` that stops once every row is done, and, when `until_finish`, as soon
    as a row has finished (a waiting request can take its row at once).

    Returns:
      (state, record, ran): record holds (last, count, done) [rows] after the lanes (when
      there are lanes) and after each decode step, [lanes? + decode, rows]; only the
      first `ran` decode steps' entries are filled.
    """
    rows = state.seq_ids.shape[0]
    head = None
    if lanes is not None:
        cache, last_logits, status, _, pstate = prefill(
            model, params, state.cache, lanes.tokens, lanes.lengths, lanes.slots,
            chunk_size=lanes.tokens.shape[1], impl=impl, policy=policy,
            policy_state=state.policy_state, start_positions=lanes.start)
        state = dataclasses.replace(state, cache=cache, policy_state=pstate,
                                    status=loop._first_error(state.status, status))
        state, finished = _admit(state, lanes, last_logits, status.code == 0, eos_ids)
        head = (state.last[None], state.num_generated[None], state.done[None])
        stop = until_finish & finished  # that row is free already
    else:
        stop = jnp.bool_(False)
    ran = jnp.int32(0)
    record = (jnp.zeros((decode, rows), jnp.int32), jnp.zeros((decode, rows), jnp.int32),
              jnp.zeros((decode, rows), bool))
    if decode:
        def more(c):
            i, s, stop, _ = c
            return (i < steps) & ~stop & jnp.any(~s.done)  # no step once every row is done

        def one(c):
            i, prev, _, rec = c
            s = decode_step(model, dparams, prev, sampling=GREEDY, eos_ids=eos_ids,
                            free_finished=False, impl=impl, policy=policy)
            finished = jnp.any(s.done & ~prev.done)
            rec = tuple(r.at[i].set(x) for r, x in zip(rec, (s.last, s.num_generated, s.done),
                                                       strict=True))
            return i + 1, s, until_finish & finished, rec

        ran, state, _, record = jax.lax.while_loop(more, one, (ran, state, stop, record))
    if head is not None:
        record = tuple(jnp.concatenate([h, r]) for h, r in zip(head, record, strict=True))
    return state, record, ran


@functools.partial(jax.jit, donate_argnames="cache")
def _share(cache, src: Int[Array, ""], dst: Int[Array, ""], length: Int[Array, ""]):
    """Slot `dst` (empty) takes the first `length` tokens of slot `src` — whole pages (or
    quantized pages), shared: a fork truncated to them. The engine checks the slots and
    the length before; the status is returned for the record."""
    kind = kv_cache.ops._kind(cache)
    cache, st = kind.fork(cache, src[None], dst[None])
    cache = window.fork(cache, src[None], dst[None])  # no-ops without window groups
    cache = host.after_fork(cache, src[None], dst[None], st)  # or a host tier
    new_lengths = cache.lengths.at[dst].set(length)
    cache, st2 = kind.truncate(cache, new_lengths)
    # The engine shares only lengths whose windows the rings still hold (Engine._ring_holds).
    cache = window.truncate(cache, cache.lengths)
    cache = host.after_truncate(cache, new_lengths, st2)
    return cache, loop._first_error(st, st2)


@functools.partial(jax.jit, donate_argnames="cache")
def _free(cache, slots: Bool[Array, " slots"]):
    """Frees the flagged slots (cached prefixes the engine lets go)."""
    return kv_cache.free(cache, slots)


@functools.partial(jax.jit, donate_argnames="state")
def _release(state: DecodeState, rows: Bool[Array, " rows"]) -> DecodeState:
    """Frees the flagged rows' slots and marks them done."""
    cache = loop._free_rows(state.cache, state.seq_ids, rows)
    return dataclasses.replace(state, cache=cache, done=state.done | rows)


def _key(seed: int) -> jax.Array:
    """`jax.random.key(seed)` for 32-bit seeds (what `generate` takes); wider seeds fold their
    high word in, so they do not collide with their low 32 bits."""
    low, high = seed & 0xFFFFFFFF, seed >> 32
    key = jax.random.key(low)
    return key if high == 0 else jax.random.fold_in(key, high)


def _has_recurrent_state(model: Model) -> bool:
    """Whether the model's cache keeps a recurrent state per slot (hybrid models)."""
    spec = model.make_cache_spec(page_size=16, num_pages=1, max_seqs=1, max_pages_per_seq=1)
    return spec.recurrent is not None


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
      prefill_rows: prompts prefilled per step at most (one chunk each; a step runs as
        many lanes as prompts wait, rounded up to a power of two).
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

    Attributes:
      stats: counters (`collections.Counter`): steps (decode steps), calls (programs run),
        prefill_tokens, prefill_chunks (lanes run, each `chunk_size` wide), decode_tokens,
        hit_pages, evictions (prefix holders leaving the device),
        preemptions (requests whose computed tokens were dropped, to be recomputed),
        requeues (requests sent back before they held anything); with a host tier also
        swaps and swap_ins (requests), prefix_parks (holders moved to the host),
        host_prefix_hits (hits served by bringing a parked prefix back) and
        host_prefix_drops (parked prefixes forgotten for room).
    """

    def __init__(self, model: Model, params, *, max_seqs: int = 8, max_seq_len: int = 2048,
                 cache: setup.CacheConfig | None = None, chunk_size: int = 64,
                 prefill_rows: int = 4, token_budget: int | None = None,
                 prefix_caching: bool = True, prefix_slots: int | None = None,
                 eos_ids: Sequence[int] = (), impl="auto", policy: CachePolicy | None = None,
                 decode_steps: int = 8, max_decode_steps: int | None = None,
                 host_pages: int = 0, host_rows: int | None = None):
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
        for name, v, lo in (("host_pages", host_pages, 0), ("host_rows", host_rows, 1)):
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
        slots = max_seqs + n_holders + blank
        per_seq = -(-max_seq_len // ps) + (1 if cfg.quant is not None else 0)
        if cfg.num_pages is None:
            cfg = dataclasses.replace(cfg, num_pages=max_seqs * per_seq)
        elif cfg.num_pages < per_seq:
            raise ValueError(f"Engine: the pool ({cfg.num_pages} pages) cannot hold one request "
                             f"of max_seq_len={max_seq_len} tokens ({per_seq} pages of {ps}); "
                             f"give more pages or a shorter max_seq_len.")
        kv, impl, plan = setup.prepare_cache(model, cfg, impl, num_seqs=slots,
                                             max_tokens=max_seq_len, chunk=chunk_size)
        self.host_rows = 0
        if host_pages:
            self.host_rows = int(2 * max_seqs if host_rows is None else host_rows)
            kv = host.attach(kv, int(host_pages), parked=self.host_rows)
        self.spec = kv.spec
        # Window groups (window-only pages): each group's window and ring, and per slot the
        # first logical page its rings hold beyond what its length implies (a prefix hit
        # starts a ring part-filled: see _ring_lo).
        gs = self.spec.window_groups
        self._windows = np.array([g.window for g in gs], np.int64)
        self._rings = np.array([g.ring_pages(ps) for g in gs], np.int64)
        self._ring_base = np.zeros((self.spec.max_seqs, len(gs)), np.int64)
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
        self._blank = max_seqs + n_holders if blank else None
        pstate = None if policy is None else policy.init_state(kv)
        self.state = DecodeState(
            cache=kv, seq_ids=jnp.arange(max_seqs, dtype=jnp.int32),
            last=jnp.zeros((max_seqs,), jnp.int32), position=jnp.zeros((max_seqs,), jnp.int32),
            tokens=jnp.full((max_seqs, 1), -1, jnp.int32),
            num_generated=jnp.zeros((max_seqs,), jnp.int32),
            max_new=jnp.ones((max_seqs,), jnp.int32), done=jnp.ones((max_seqs,), bool),
            keys=jax.random.split(jax.random.key(0), max_seqs), status=loop._ok_status(kv),
            step=jnp.int32(0), policy_state=pstate,
            row_sampling=jax.tree.map(jnp.asarray, RowSampling.of([GREEDY] * max_seqs)))
        self._key_words = jax.random.key_data(self.state.keys).shape[-1]
        if self.host_rows:
            # The host pools are committed to their device (placed with a memory kind) and
            # jit keys its programs on placement: commit the rest of the state there too, or
            # a step on the fresh state would compile apart from the same step later on.
            place = jax.tree.leaves(kv.host.pages)[0].sharding.with_memory_kind("device")
            self.state = jax.tree.map(
                lambda x: x if x.committed else jax.device_put(x, place), self.state)
        self._waiting: collections.deque[_Request] = collections.deque()
        self._running: dict[int, _Request] = {}  # slot -> request
        self._requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._admissions = itertools.count(1)
        self._pending_out: list[RequestOutput] = []
        self._swapped: dict[int, _Request] = {}  # parked row -> request swapped out there
        self.stats = collections.Counter()
        self._sync()

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt_ids: Sequence[int], *, max_tokens: int,
                    sampling: SamplingConfig = GREEDY, stop_ids: Sequence[int] = (),
                    seed: int = 0, salt: str | None = None,
                    request_id: str | None = None) -> str:
        """Queues a request; returns its id. Nothing runs until `step`.

        Args:
          prompt_ids: token ids, at least one, each in [0, vocab).
          max_tokens: tokens to produce at most (>= 1).
          sampling: how to pick tokens (greedy by default).
          stop_ids: tokens that end this request (kept in its output), besides EOS.
          seed: its PRNG seed: token s is drawn with fold_in(key(seed), s).
          salt: requests share cached prefix pages only with the same salt.
          request_id: a unique id (default: a counter).

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
        rid = str(next(self._ids)) if request_id is None else str(request_id)
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is in use.")
        req = _Request(id=rid, prompt=prompt, max_tokens=int(max_tokens), sampling=sampling,
                       stop_ids=frozenset(stops),
                       key_data=np.asarray(jax.random.key_data(_key(int(seed)))), salt=salt,
                       fed=prompt)
        self._requests[rid] = req
        self._waiting.append(req)
        return rid

    def cancel(self, request_id: str) -> None:
        """Ends a request at the next step (finish reason "cancelled"); unknown ids are
        ignored (it may have finished)."""
        req = self._requests.get(str(request_id))
        if req is not None:
            req.cancelled = True

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    # ------------------------------------------------------------------ device mirrors

    def _sync(self) -> None:
        c = self.state.cache
        self._mirror(jax.device_get((c.lengths, c.table.lengths, c.table.num_free,
                                     self._host_free_array())))

    def _host_free_array(self):
        c = self.state.cache
        return None if c.host is None else c.host.table.num_free

    def _mirror(self, got) -> None:
        lengths, quant, free, host_free = got
        self._lengths = np.array(lengths)
        self._quant = np.array(quant)
        self._free_pages = int(np.min(free))  # a sharded pool: the emptiest shard
        self._host_free = 0 if host_free is None else int(host_free)

    def _set_cache(self, cache) -> None:
        self.state = dataclasses.replace(self.state, cache=cache)

    def _free_slots(self, slots: Sequence[int]) -> None:
        mask = np.zeros((self.spec.max_seqs,), bool)
        mask[list(slots)] = True
        self._set_cache(_free(self.state.cache, mask))

    def _pages_for(self, slot: int, n: int) -> int:
        """Pages slot's sequence allocates to take n more tokens."""
        return self._growth(int(self._lengths[slot]), int(self._quant[slot]), n)

    def _growth(self, L: int, q: int, n: int) -> int:
        """Pages a sequence of L tokens (q of them in its page table) allocates to take n
        more tokens."""
        ps = self.spec.page_size
        if self.spec.quant is None:
            return -(-(L + n) // ps) - (-(-L // ps))
        new_q = max(kv_cache.quantized.quantized_tokens(self.spec, L + n), q)
        return (new_q - q) // ps

    # ------------------------------------------------------------------ prefix cache

    def _share(self, src: int, dst: int, length: int) -> None:
        """Slot dst (empty) shares the first `length` tokens (whole pages) of slot src."""
        if self._lengths[dst] or length > self._lengths[src] or length % self.spec.page_size:
            raise AssertionError(f"cannot share {length} tokens of slot {src} (holding "
                                 f"{self._lengths[src]}) with slot {dst} (holding "
                                 f"{self._lengths[dst]})")
        cache, _ = _share(self.state.cache, np.int32(src), np.int32(dst), np.int32(length))
        self._set_cache(cache)
        # Mirrors the device: no page changes hands but those shared (free count unchanged).
        self._lengths[dst] = self._quant[dst] = length

    def _usable_hit(self, req: _Request, n: int) -> int:
        """The pages of an n-page match a request may take (whole chunks, see module doc)."""
        ps, per_chunk = self.spec.page_size, self.chunk // self.spec.page_size
        total = len(req.fed)
        j = min(n, (total - 1) // ps)
        j -= j % per_chunk
        if self.spec.quant is not None:
            qt = kv_cache.quantized.quantized_tokens
            while j > 0 and j * ps > qt(self.spec, min(j * ps + self.chunk, total)):
                j -= per_chunk
        return max(j, 0)

    def _hashes(self, req: _Request) -> list[bytes]:
        if req.hashes is None:
            req.hashes = page_hashes(req.fed, self.spec.page_size, req.salt)
        return req.hashes

    def _ring_lo(self, slot: int) -> np.ndarray:
        """Per window group, the first logical page slot's ring holds: the last R pages of
        its length, or fewer after a prefix hit (its ring then starts at the holder's)."""
        held = -(-int(self._lengths[slot]) // self.spec.page_size)
        return np.maximum(self._ring_base[slot], held - self._rings)

    def _ring_holds(self, lo, j: int) -> bool:
        """Whether rings holding pages from `lo` (per group) on hold every page that the
        windows of queries at position j * page_size and later reach back to."""
        ps = self.spec.page_size
        first = np.maximum(j * ps - self._windows + 1, 0) // ps
        return bool(np.all(first >= np.asarray(lo, np.int64)))

    def _find_hit(self, req: _Request, *, parked: bool = True,
                  touch: bool = True) -> tuple[int, int | None, int | None]:
        """The longest usable hit for `req`: (pages j, holder slot, or None and the parked
        row holding them); (0, None, None) when none. Without window groups j is the
        whole-chunk match (`_usable_hit`); with them, the longest such j whose holder's
        rings reach back far enough (`_ring_holds`)."""
        hashes = self._hashes(req)
        j = self._usable_hit(req, self.prefix.match(hashes, req.fed, parked=parked))
        usable = None
        while j > 0:
            if self._windows.size:
                usable = lambda lo, j=j: self._ring_holds(lo, j)  # noqa: E731
            slot = self.prefix.holder_of(hashes, j, usable=usable, touch=touch)
            if slot is not None:
                return j, slot, None
            row = self.prefix.parked_of(hashes, j, usable=usable, touch=touch) if (
                parked) else None
            if row is not None:
                return j, None, row
            j -= self.chunk // self.spec.page_size
        return 0, None, None

    def _attach_prefix(self, req: _Request) -> None:
        j, holder, row = self._find_hit(req)
        if j == 0:
            return
        if holder is None:  # only a parked row holds them: bring it back first
            holder = self._unpark_prefix(row)
            if holder is not None:
                self.stats["host_prefix_hits"] += 1
            else:  # no room for it on the device: the longest hit held there
                j, holder, _ = self._find_hit(req, parked=False)
                if j == 0:
                    return
        self._share(holder, req.slot, j * self.spec.page_size)
        if self._windows.size:
            self._ring_base[req.slot] = self.prefix.ring_lo(holder)
        req.done_tokens = j * self.spec.page_size
        if not req.output:  # a readmitted request's own pages do not count as hits
            req.cached_tokens = req.done_tokens
        self.stats["hit_pages"] += j

    def _register_prefix(self, req: _Request) -> None:
        """Keeps the full pages of the request's prompt prefilled so far (quantized pages on
        KIVI) for later ones."""
        ps = self.spec.page_size
        # Only the prompt's pages (quantized ones on KIVI, which the decode steps after the
        # prompt's last chunk may have carried past it).
        held = req.done_tokens if self.spec.quant is None else int(self._quant[req.slot])
        n = min(held, len(req.fed)) // ps
        hashes = self._hashes(req)[:n]
        if n == 0 or self._lengths[req.slot] < n * ps or self.prefix.new_pages(hashes) == 0:
            return  # nothing new, or the request already finished and freed its pages
        lo = self._ring_lo(req.slot)
        if self._windows.size and not self._ring_holds(lo, n):
            return  # the rings no longer hold the window before page n: no hit could use it
        holder = self.prefix.free_slot()
        if holder is None:
            self._evict_holder()
            holder = self.prefix.free_slot()
        self._share(req.slot, holder, n * ps)
        self._ring_base[holder] = lo
        self.prefix.add(holder, hashes, req.fed, req.salt, ring_lo=lo.tolist())

    def _evict_holder(self, protect: int | None = None) -> bool:
        """Evicts the least recently used cached prefix from the device: to a parked row
        when the host tier has room for it (dropping older parked prefixes, never the row
        `protect`), else forgotten. False when no holder is left."""
        slot = self.prefix.lru_slot() if self.prefix is not None else None
        if slot is None:
            return False
        self.stats["evictions"] += 1
        if self.host_rows:
            pages = len(self.prefix.holders[slot]) // self.spec.page_size
            row = self._host_room(pages, protect=protect)
            if row is not None and self._swap_out(slot, row):
                self.prefix.park(slot, row)
                self.stats["prefix_parks"] += 1
                return True
        self.prefix.remove(slot)
        self._free_slots([slot])
        self._sync()
        return True

    def _unpark_prefix(self, row: int) -> int | None:
        """Brings the prefix parked in `row` back into a free holder slot, evicting other
        holders if need be; returns the slot, or None when the pool has no room for it."""
        pages = len(self.prefix.parked[row]) // self.spec.page_size
        if self.prefix.free_slot() is None:
            self._evict_holder(protect=row)
        while self._free_pages < pages and self._evict_holder(protect=row):
            pass
        slot = self.prefix.free_slot()
        if slot is None or self._free_pages < pages or not self._swap_in(row, slot):
            return None
        self.prefix.unpark(row, slot)
        self._ring_base[slot] = self.prefix.ring_lo(slot)
        return slot

    # ------------------------------------------------------------------ host tier

    def _swap_out(self, slot: int, row: int) -> bool:
        """Slot's sequence to parked row `row` (the slot is empty after); False (nothing
        changed) when the host pool is short."""
        cache, st = host.swap_out(self.state.cache, slot, row)
        self._set_cache(cache)
        self._sync()
        return int(st.code) == 0

    def _swap_in(self, row: int, slot: int) -> bool:
        """Parked row `row` into the empty slot; False (nothing changed) when the pool is
        short."""
        cache, st = host.swap_in(self.state.cache, row, slot)
        self._set_cache(cache)
        self._sync()
        return int(st.code) == 0

    def _drop_row(self, row: int) -> None:
        self._set_cache(host.drop_parked(self.state.cache, row))

    def _host_room(self, pages: int, protect: int | None = None) -> int | None:
        """A free parked row with `pages` free host pages, made by dropping parked
        prefixes (least recently used first, never the row `protect`) if it takes that;
        None, with nothing dropped, when dropping them all would not do. Swapped requests
        are never dropped."""
        ps = self.spec.page_size
        parked = self.prefix.parked if self.prefix is not None else {}
        used = set(self._swapped) | set(parked)
        free_rows = [r for r in range(self.host_rows) if r not in used]
        free, drop = self._host_free, []
        for r, toks in parked.items():  # least recently used first
            if (free_rows or drop) and free >= pages:
                break
            if r != protect:
                drop.append(r)
                free += len(toks) // ps
        if not ((free_rows or drop) and free >= pages):
            return None
        for r in drop:
            self._drop_row(r)
            self.prefix.drop_parked(r)
            self.stats["host_prefix_drops"] += 1
        if drop:
            self._sync()
        return free_rows[0] if free_rows else drop[0]

    def _swap_request(self, req: _Request) -> bool:
        """Preempts a running request by swapping its sequence (and decoding row) to the
        host tier; False (nothing changed) when the tier cannot take it."""
        slot = req.slot
        L, q = int(self._lengths[slot]), int(self._quant[slot])
        row = self._host_room(-(-q // self.spec.page_size))
        if row is None:
            return False
        saved = jax.device_get(_take_row(self.state, jnp.int32(slot))) if (
            req.decoding) else None
        if not self._swap_out(slot, row):
            return False
        rows = np.zeros((self.rows,), bool)
        rows[slot] = True
        self.state = _release(self.state, rows)  # the row stops (slot empty)
        del self._running[slot]
        req.parked, req.parked_tokens, req.parked_table, req.row_state = row, L, q, saved
        req.parked_ring_base = self._ring_base[slot].copy()
        req.slot = None
        self._swapped[row] = req
        self._waiting.appendleft(req)
        self.stats["swaps"] += 1
        return True

    def _resume(self, req: _Request, slot: int) -> bool:
        """Swaps a swapped-out request back into row `slot` when the pool can take it and
        the pages it will allocate next (any time while nothing else runs); it continues
        where it stopped. False (nothing changed) otherwise."""
        ps = self.spec.page_size
        need = -(-req.parked_table // ps)
        if self._running:
            ahead = self.decode_steps if req.decoding else min(
                self.chunk, len(req.fed) - req.done_tokens)
            need += self._growth(req.parked_tokens, req.parked_table, ahead)
        while self._free_pages < need and self._evict_holder():
            pass
        if self._free_pages < need or not self._swap_in(req.parked, slot):
            return False
        del self._swapped[req.parked]
        self._waiting.popleft()
        req.parked, req.slot = None, slot
        self._ring_base[slot] = req.parked_ring_base  # the rings came back as they left
        req.admitted = next(self._admissions)
        self._running[slot] = req
        if req.row_state is not None:
            self.state = _put_row(self.state, jnp.int32(slot), req.row_state)
            req.row_state = None
        self.stats["swap_ins"] += 1
        return True

    def _unswap(self, req: _Request) -> None:
        """Forgets a swapped-out request's parked row; it will be recomputed."""
        self._drop_row(req.parked)
        del self._swapped[req.parked]
        self._sync()
        req.parked, req.row_state = None, None
        self._to_recompute(req)
        self.stats["preemptions"] += 1

    # ------------------------------------------------------------------ scheduling

    def _admit_waiting(self) -> None:
        free_rows = [s for s in range(self.rows) if s not in self._running]
        while self._waiting and free_rows:
            req = self._waiting[0]
            if req.parked is not None:
                if self._resume(req, free_rows[0]):
                    free_rows.pop(0)
                    continue
                if self._running:
                    break
                # Nothing runs and the pool still cannot take it back (the pool holds a
                # request of max_seq_len, so this is a safety net): recompute it instead.
                self._unswap(req)
            # Admit when the pool can take the prompt but for the pages a prefix hit will
            # share (their holder is marked used, so eviction takes others first); a hit
            # on a parked prefix needs the pages that bring it back.
            need = -(-len(req.fed) // self.spec.page_size)
            if self.prefix is not None:
                hit, holder, row = self._find_hit(req)
                if hit:
                    if holder is not None:
                        need -= hit
                    else:
                        need += len(self.prefix.parked[row]) // self.spec.page_size - hit
            while self._free_pages < need and self._evict_holder():
                pass
            if self._free_pages < need and self._running:
                break
            self._waiting.popleft()
            req.slot = free_rows.pop(0)
            req.admitted = next(self._admissions)
            req.done_tokens, req.decoding = 0, False
            self._ring_base[req.slot] = 0
            self._running[req.slot] = req
            req.looked_up = self.prefix is None
            if self._blank is not None:
                self._reset_policy_row(req.slot)

    def _reset_policy_row(self, slot: int) -> None:
        p = self.policy.fork_state(self.state.policy_state, jnp.int32([self._blank]),
                                   jnp.int32([slot]))
        self.state = dataclasses.replace(self.state, policy_state=p)

    def _look_up_prefixes(self) -> None:
        """Prefix hits for the prompts about to take a prefill lane. Looked up this late,
        not at admission, so that a prompt queued behind one with the same prefix finds
        the pages that one registered. A prompt that shares more whole chunks with an
        earlier prompt still being prefilled than the cache holds waits for them (takes
        no lane) instead of computing them again: that prompt registers its pages as soon
        as they cover what a waiting prompt needs (`_register_for_followers`)."""
        prefilling = sorted((r for r in self._running.values() if not r.decoding),
                            key=lambda r: r.admitted)
        lanes = 0
        for req in prefilling:
            if lanes == self.prefill_rows:
                break
            if not req.looked_up:
                req.leader, req.target = self._leader_for(req, prefilling)
                if req.leader is not None:
                    continue
                req.looked_up = True
                self._attach_prefix(req)
            lanes += 1

    def _leader_for(self, req: _Request, prefilling) -> tuple["_Request | None", int]:
        """An earlier prompt being prefilled that will register more of `req`'s pages than
        the cache holds now (whole chunks `req` may use), and how many; else (None, 0)."""
        hashes = self._hashes(req)
        have = self._find_hit(req, touch=False)[0]
        for lead in prefilling:
            if lead.admitted >= req.admitted or not lead.looked_up:
                continue
            theirs = self._hashes(lead)
            common = 0
            while (common < min(len(hashes), len(theirs))
                   and hashes[common] == theirs[common]):
                common += 1
            want = self._usable_hit(req, common)
            if want > have:
                return lead, want
        return None, 0

    def _register_for_followers(self, req: _Request) -> None:
        """Registers the pages `req` has prefilled so far when they cover what a prompt
        waiting for it needs (its prompt's end registers them in any case)."""
        ps = self.spec.page_size
        done = (req.done_tokens if self.spec.quant is None
                else int(self._quant[req.slot])) // ps
        if any(r.leader is req and r.target <= done for r in self._running.values()):
            self._register_prefix(req)

    def _plan(self) -> tuple[list[int], list[tuple[_Request, int]]]:
        """This step's decoding rows and prefill lanes (request, tokens) within the budget."""
        decode = [s for s, r in self._running.items() if r.decoding]
        room = self.token_budget - len(decode)
        lanes = []
        for req in sorted((r for r in self._running.values() if not r.decoding),
                          key=lambda r: r.admitted):
            if not req.looked_up:  # waits for an earlier prompt's pages, or for a lane
                continue
            if len(lanes) == self.prefill_rows or (room < self.chunk and (lanes or decode)):
                break
            n = min(self.chunk, len(req.fed) - req.done_tokens)
            lanes.append((req, n))
            room -= self.chunk
        return decode, lanes

    def _decode_steps(self, decode, lanes) -> tuple[int, bool]:
        """Decode steps this call runs at most, and whether it ends as soon as a row
        finishes (its request is then done and a waiting one can take the row):

          * none without a decoding row;
          * one while a prompt still waits for a chunk or a lane (it starts sooner);
          * while every row is busy (or a request waits for pages), until the first row
            finishes, at most `max_decode_steps`: by length the host knows when, so no step
            runs past it; by EOS the device stops there;
          * else `decode_steps` (a request that arrives meanwhile waits at most this long).
        """
        ending = [r for r, n in lanes if r.done_tokens + n == len(r.fed)]
        if not decode and not ending:
            return 0, False
        in_lanes = {r.slot for r, _ in lanes}
        if len(ending) < len(lanes) or any(
                not r.decoding and s not in in_lanes for s, r in self._running.items()):
            return 1, False
        if not self._waiting and len(self._running) < self.rows:
            return self.decode_steps, False
        left = [self._running[s].max_tokens - len(self._running[s].output) for s in decode]
        left += [r.max_tokens - len(r.output) - 1 for r in ending]  # after the first token
        return max(1, min(self.max_decode_steps, *left)), True

    def _call_plan(self, decode, lanes) -> tuple[int, bool]:
        """`_decode_steps`, with fewer steps when the free pages cannot cover them all (the
        page check then evicts or preempts only if one step does not fit)."""
        k, until_finish = self._decode_steps(decode, lanes)
        k = min(k, self._ring_steps(lanes))
        while k > 1 and self._pages_needed(decode, lanes, k) > self._free_pages:
            k //= 2
        return k, until_finish

    def _ring_steps(self, lanes) -> int:
        """Decode steps a call may run after a prompt that ends in it while its rings still
        serve a later hit on its pages, which ends at its last whole chunk c: a window
        group's ring must still hold the page of position c - window + 1, which k more
        tokens push out once ceil((len + k) / page_size) - R passes it (unbounded without
        window groups or prefix caching). At least 1: R * page_size >= window + chunk_size
        + page_size - 2 (`kvjax.specs.ring_pages`)."""
        k = self.max_decode_steps
        if self.prefix is None or not self._windows.size:
            return k
        ps = self.spec.page_size
        for r, n in lanes:
            total = len(r.fed)
            if r.done_tokens + n != total or total < self.chunk:
                continue
            first = np.maximum((total // self.chunk) * self.chunk - self._windows + 1, 0) // ps
            if np.any(first < self._ring_base[r.slot]):
                continue  # a hit's ring that cannot register this prompt anyway
            k = min(k, int(np.min((first + self._rings) * ps)) - total)
        return max(k, 1)

    def _pages_needed(self, decode, lanes, k: int) -> int:
        """Pages the call allocates at most: k decode steps of each decoding row, and each
        lane's chunk (with k steps after it when the prompt ends there)."""
        return (sum(self._pages_for(s, k) for s in decode)
                + sum(self._pages_for(r.slot, n + (k if r.done_tokens + n == len(r.fed) else 0))
                      for r, n in lanes))

    def _preempt(self) -> None:
        """Preempts the most recently admitted request; it waits again, first in line. With
        a host tier that has room, its sequence is swapped out; else its pages are freed
        and it is recomputed when readmitted."""
        req = max(self._running.values(), key=lambda r: r.admitted)
        held = bool(self._lengths[req.slot])
        if self.host_rows and held and self._swap_request(req):
            return
        del self._running[req.slot]
        rows = np.zeros((self.rows,), bool)
        rows[req.slot] = True
        self.state = _release(self.state, rows)
        req.slot = None
        self._to_recompute(req)
        # A request admitted this step may hold nothing yet: it loses no work.
        self.stats["preemptions" if held else "requeues"] += 1
        self._waiting.appendleft(req)
        self._sync()

    def _to_recompute(self, req: _Request) -> None:
        """A request without pages will be recomputed: its prompt and the tokens it
        produced so far."""
        req.fed = np.concatenate([req.prompt, np.asarray(req.output, np.int32)])
        req.hashes = None
        req.decoding, req.done_tokens = False, 0

    def _lane_buckets(self) -> list[int]:
        """Lane counts a step is compiled for: powers of two up to `prefill_rows` (and it):
        idle lanes still cost their compute, so a step runs the smallest that fits."""
        out = [1]
        while out[-1] * 2 < self.prefill_rows:
            out.append(out[-1] * 2)
        return sorted(set(out + [self.prefill_rows]))

    def _lanes(self, lanes, width: int | None = None) -> _Lanes:
        P = width or next(b for b in self._lane_buckets() if b >= len(lanes))
        C = self.chunk
        tokens = np.zeros((P, C), np.int32)
        lengths = np.zeros((P,), np.int32)
        used = {r.slot for r, _ in lanes}
        idle = [s for s in range(self.rows) if s not in used]
        slots = np.array([r.slot for r, _ in lanes] + idle[: P - len(lanes)], np.int32)
        start = np.zeros((P,), np.int32)
        last = np.zeros((P,), bool)
        count = np.zeros((P,), np.int32)
        max_new = np.ones((P,), np.int32)
        key_data = np.zeros((P, self._key_words), np.uint32)
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
        # NumPy leaves: the jitted step moves them in its own dispatch (about 40 us for the
        # lot on a 2-core EPYC, where a jax.device_put of the tree took 0.5 ms).
        return _Lanes(tokens=tokens, lengths=lengths, slots=slots, start=start, last=last,
                      key_data=key_data, count=count, max_new=max_new,
                      sampling=RowSampling.of(configs))

    def _finish(self, req: _Request, reason: str, tokens: Sequence[int] = ()) -> None:
        self._requests.pop(req.id, None)
        self._pending_out.append(RequestOutput(
            request_id=req.id, token_ids=list(tokens), finished=True, finish_reason=reason,
            prompt_tokens=len(req.prompt), cached_tokens=req.cached_tokens))

    def step(self) -> list[RequestOutput]:
        """Runs one engine step; returns what each request produced (see `RequestOutput`)."""
        self._pending_out = []
        for r in [r for r in self._waiting if r.cancelled]:
            self._waiting.remove(r)
            if r.parked is not None:
                self._drop_row(r.parked)
                del self._swapped[r.parked]
                r.parked = None
                self._sync()
            self._finish(r, "cancelled")
        # Cancelled rows first: their pages serve this step.
        gone = [r for r in self._running.values() if r.cancelled]
        if gone:
            rows = np.zeros((self.rows,), bool)
            for r in gone:
                rows[r.slot] = True
                del self._running[r.slot]
                self._finish(r, "cancelled")
            self.state = _release(self.state, rows)
            self._sync()
        self._admit_waiting()
        self._look_up_prefixes()
        decode, lanes = self._plan()
        steps, until_finish = self._call_plan(decode, lanes)
        while self._pages_needed(decode, lanes, steps) > self._free_pages:
            if not self._evict_holder():
                if len(self._running) <= 1:
                    raise RuntimeError(
                        f"the pool ({self.spec.num_pages} pages) cannot hold the next step of "
                        f"the only running request; give the Engine more pages.")
                self._preempt()
            decode, lanes = self._plan()
            steps, until_finish = self._call_plan(decode, lanes)
        if not decode and not lanes:
            return self._pending_out
        self.state, record, ran = _step(
            self.model, self.params, self.dparams, self.state,
            self._lanes(lanes) if lanes else None, np.int32(steps), np.bool_(until_finish),
            eos_ids=self.eos_ids, impl=self.impl, policy=self.policy,
            decode=self.max_decode_steps)
        st, c = self.state, self.state.cache
        record, ran, code, *mirrored = jax.device_get(
            (record, ran, st.status.code, c.lengths, c.table.lengths, c.table.num_free,
             self._host_free_array()))
        self._mirror(mirrored)
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
        for r, n in lanes:
            r.done_tokens += n
            if r.done_tokens == len(r.fed):
                r.decoding = True
                if self.prefix is not None:
                    self._register_prefix(r)
            elif self.prefix is not None:
                self._register_for_followers(r)
        self._deliver(record, (1 if lanes else 0) + int(ran))
        return self._pending_out

    def _deliver(self, record, entries: int) -> None:
        """Hands each decoding row's new tokens to its request, finishes the requests that
        ended and frees their rows. `record`: (last, count, done) [steps, rows] after each
        step of the call (the lanes' first tokens included), of which `entries` ran."""
        last, num, done = (x[:entries] for x in record)
        release = np.zeros((self.rows,), bool)
        for slot, r in list(self._running.items()):
            if not r.decoding:
                continue
            # A row produced a token at the steps where its count grew (a row that was
            # admitted in this call starts from its request's count: the lanes' entry).
            col = num[:, slot]
            at = np.flatnonzero(np.diff(col, prepend=len(r.output)) > 0)
            toks = last[at, slot]
            reason = None
            stops = np.isin(toks, [*r.stop_ids, *self.eos_ids]) if toks.size else toks
            if stops.any():
                toks = toks[: int(np.argmax(stops)) + 1]  # the row may have run on past a
                reason = "stop"                           # host-side stop id
            elif toks.size and done[at[-1], slot]:
                reason = "length"
            toks = toks.tolist()
            # Finished rows keep their pages until now (their prompt pages were registered
            # above, even when the request ended in the call that prefilled it).
            release[slot] = reason is not None
            r.output.extend(toks)
            self.stats["decode_tokens"] += len(toks)
            if reason is not None:
                del self._running[slot]
                self._finish(r, reason, toks)
            elif toks:
                self._pending_out.append(RequestOutput(
                    request_id=r.id, token_ids=toks, finished=False, finish_reason=None,
                    prompt_tokens=len(r.prompt), cached_tokens=r.cached_tokens))
        if release.any():
            self.state = _release(self.state, release)
            self._sync()

    def warmup(self) -> None:
        """Compiles every program a step may run (the step without prefill lanes and with
        each lane count; the bookkeeping of frees, forks and truncations; with a host tier,
        its swaps of every copy width and the decoding rows' save and restore), by running
        each on no-op arguments, so that no request waits for a compile. Only on an idle
        engine (every run leaves the state as it was)."""
        if self._running or self._waiting:
            raise RuntimeError("Engine.warmup: only on an idle engine (no request queued or "
                               "running).")
        # One program per lane width (and one without lanes): the decode steps a call
        # runs are an argument. Idle lanes and rows that are all done change nothing.
        for lanes in [None] + [self._lanes([], w) for w in self._lane_buckets()]:
            self.state, record, _ = _step(
                self.model, self.params, self.dparams, self.state, lanes, np.int32(1),
                np.bool_(False), eos_ids=self.eos_ids, impl=self.impl, policy=self.policy,
                decode=self.max_decode_steps)
        jax.block_until_ready(record)
        self.state = _release(self.state, np.zeros((self.rows,), bool))
        n = self.spec.max_seqs
        cache = _free(self.state.cache, np.zeros((n,), bool))
        empty = np.nonzero(np.asarray(jax.device_get(cache.lengths)) == 0)[0]
        if self.prefix is not None and empty.size >= 2:  # empty into empty: no change
            cache, _ = _share(cache, np.int32(empty[0]), np.int32(empty[1]), np.int32(0))
        self._set_cache(cache)
        if self.host_rows:
            self._warm_host(int(empty[0]))
        self._sync()

    def _warm_host(self, slot: int) -> None:
        """Runs the host tier's programs on the empty `slot` and a free parked row: a swap
        of nothing changes nothing, whatever width its program copies."""
        used = set(self._swapped) | set(self.prefix.parked if self.prefix is not None else ())
        free = [r for r in range(self.host_rows) if r not in used]
        if free:
            s, r = jnp.int32(slot), jnp.int32(free[0])
            mp = self.spec.max_pages_per_seq
            cache = self.state.cache
            for k in sorted({host._bucket(n, mp) for n in range(mp + 1)}):
                cache, _ = host._swap_out(cache, s, r, k=k)
                cache, _ = host._swap_in(cache, r, s, k=k)
            self._set_cache(host.drop_parked(cache, free[0]))
        saved = jax.device_get(_take_row(self.state, jnp.int32(0)))  # as a swap keeps it
        self.state = _put_row(self.state, jnp.int32(0), saved)

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix (holders on the device and, with a host tier,
        parked rows), returning the pages only they held to their pools."""
        if self.prefix is None:
            return
        for row in list(self.prefix.parked):
            self._drop_row(row)
            self.prefix.drop_parked(row)
        holders = list(self.prefix.holders)
        for s in holders:
            self.prefix.remove(s)
        if holders:
            self._free_slots(holders)
        self._sync()

    def run(self) -> dict[str, list[int]]:
        """Steps until every request is done; returns each request's tokens."""
        out: dict[str, list[int]] = collections.defaultdict(list)
        while self.has_unfinished():
            for o in self.step():
                out[o.request_id].extend(o.token_ids)
        return dict(out)

    def check(self) -> None:
        """AssertionError unless the cache's invariants hold, every page is free or held by
        a request or a cached prefix, and the prefix cache agrees with its holders; with a
        host tier, also the tier's invariants (`kvjax.cache.host.check`) and that every
        parked row belongs to exactly one swapped request or one parked prefix."""
        cache = self.state.cache
        kv_cache.check_invariants(cache)
        if self.host_rows:
            self._check_host()
        lengths = np.asarray(cache.lengths)
        users = set(self._running)
        holders = set(self.prefix.holders) if self.prefix is not None else set()
        for s in range(self.spec.max_seqs):
            if lengths[s] and s not in users and s not in holders:
                raise AssertionError(f"slot {s} holds {lengths[s]} tokens but no request or "
                                     f"cached prefix owns it")
        if self._windows.size:
            self._check_rings(cache, lengths)
        if self.prefix is not None:
            self.prefix.check()
            if isinstance(cache.table, PageTable):
                ps = self.spec.page_size
                for s, toks in self.prefix.holders.items():
                    if lengths[s] != len(toks) or len(toks) % ps:
                        raise AssertionError(f"holder {s} holds {lengths[s]} tokens, its "
                                             f"entries {len(toks)}")

    def _check_rings(self, cache, lengths) -> None:
        """Every slot's rings hold the pages the engine counts on: per group, logical pages
        [`_ring_lo`, its last page) (what its windows read and a hit may share), and each
        holder's recorded `ring_lo` is the slot's."""
        ps = self.spec.page_size
        for g, grp in enumerate(cache.groups):
            bt = np.asarray(grp.table.block_tables)
            for s in np.flatnonzero(lengths):
                lo, end = int(self._ring_lo(s)[g]), -(-int(lengths[s]) // ps)
                miss = [p for p in range(lo, end) if bt[s, p % self._rings[g]] < 0]
                if miss:
                    raise AssertionError(f"slot {s} ({lengths[s]} tokens) misses pages {miss} "
                                         f"of window group {g} (its ring {bt[s].tolist()})")
        if self.prefix is not None:
            for s in self.prefix.holders:
                if self.prefix.ring_lo(s) != tuple(self._ring_base[s].tolist()):
                    raise AssertionError(f"holder {s}'s rings start at "
                                         f"{self._ring_base[s].tolist()}, its entry says "
                                         f"{list(self.prefix.ring_lo(s))}")

    def _check_host(self) -> None:
        cache = self.state.cache
        host.check(cache)
        tokens = np.asarray(host.parked_lengths(cache))
        owners: dict[int, list[str]] = collections.defaultdict(list)
        want: dict[int, int] = {}
        waiting = {id(r) for r in self._waiting}
        for row, req in self._swapped.items():
            owners[row].append(f"request {req.id!r}")
            want[row] = req.parked_tokens
            if req.parked != row or req.slot is not None or id(req) not in waiting:
                raise AssertionError(f"request {req.id!r} swapped out to row {row} is not "
                                     f"waiting there (row {req.parked}, slot {req.slot})")
        for row, toks in (self.prefix.parked if self.prefix is not None else {}).items():
            owners[row].append("a cached prefix")
            want[row] = len(toks)
        for r in range(self.host_rows):
            held = owners.get(r, [])
            if bool(tokens[r]) != bool(held) or len(held) > 1:
                raise AssertionError(f"parked row {r} holds {tokens[r]} tokens and belongs to "
                                     f"{held or 'nobody'}")
            if held and tokens[r] != want[r]:
                raise AssertionError(f"parked row {r} holds {tokens[r]} tokens, its owner "
                                     f"({held[0]}) {want[r]}")
        lost = [r.id for r in self._waiting if r.parked is not None
                and self._swapped.get(r.parked) is not r]
        if lost:
            raise AssertionError(f"requests {lost} wait on parked rows not recorded as theirs")

    def __repr__(self) -> str:
        return (f"Engine(rows={self.rows}, chunk={self.chunk}, pages={self.spec.num_pages}, "
                f"running={self.num_running}, waiting={self.num_waiting})")

