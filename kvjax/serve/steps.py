"""The serving engine's device programs: the jitted step and the bookkeeping it needs.

Every function here is pure over the engine's `DecodeState` (or its cache) and donates
it; the engine's host side (`kvjax.serve.engine`, `scheduler`, `prefixes`, `slots`)
decides what to run and calls these by module attribute, so a profiler can wrap them.

  * `step`: `prefill_lanes` (one prefill chunk per lane; rows whose prompt ends take
    their first token, `admit`), then `decode_rows` (up to `steps` decode steps of
    `kvjax.generate.decode_step` in a `lax.while_loop`), two programs: one per lane
    shape and one per row bucket; their `logprobs=True` variants also record each
    token's log-probability and the `TOP_LOGPROBS` most likely tokens (compiled apart,
    run only while a request asks for them);
  * `live_buckets`, `live_bucket`: the row counts `step` decodes (only the live rows);
  * `share`: a slot takes a prefix of another slot's pages (a prefix-cache hit);
  * `free`, `release`: free slots (cached prefixes) or decoding rows;
  * `take_row`, `put_row`: a decoding row's state, saved to the host and restored (a
    request swapped out to the host tier and back).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int, UInt32

from kvjax import cache as kv_cache
from kvjax.cache import host, window
from kvjax.cache.policies.base import CachePolicy
from kvjax.generate.loop import (
    DecodeState,
    StepLogprobs,
    decode_step,
    first_error,
    is_eos,
    ok_status,
    prefill,
    prefill_packed,
    step_logprobs,
)
from kvjax.generate.sampling import RowSampling, SamplingConfig, sample_rows
from kvjax.models.base import Model, Packing

__all__ = ["GREEDY", "TOP_LOGPROBS", "Lanes", "RowState", "admit", "first_error", "free", "is_eos",
           "decode_rows", "live_bucket", "live_buckets", "ok_status", "packed_shapes",
           "prefill_lanes", "put_row", "release", "seed_key", "share", "step", "take_row"]

GREEDY = SamplingConfig()
# Most likely tokens the logprobs variant of `step` records per token (vLLM's bound on a
# request's top logprobs; OpenAI's is 5 for completions and 20 for chat).
TOP_LOGPROBS = 20


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Lanes:
    """One prefill chunk per lane (a bucket of lanes up to `prefill_rows`; length 0: idle).
    With `packing`, the lanes' tokens lie end to end in one row (tokens [1, tokens]) and
    the model's matmuls run on that row (`kvjax.generate.loop.prefill_packed`)."""

    tokens: Int[Array, "lanes chunk"]
    lengths: Int[Array, " lanes"]
    slots: Int[Array, " lanes"]
    start: Int[Array, " lanes"]  # position of the chunk's first token
    last: Bool[Array, " lanes"]  # the prompt's last chunk: sample its first token
    key_data: UInt32[Array, "lanes key_words"]  # each request's PRNG key, as its words
    count: Int[Array, " lanes"]  # tokens the request produced before (preemption)
    max_new: Int[Array, " lanes"]
    sampling: RowSampling
    packing: Packing | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowState:
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
def take_row(state: DecodeState, slot: Int[Array, ""]) -> RowState:
    rs = state.row_sampling
    return RowState(last=state.last[slot], position=state.position[slot],
                num_generated=state.num_generated[slot], max_new=state.max_new[slot],
                done=state.done[slot], key_data=jax.random.key_data(state.keys[slot]),
                sampling=RowSampling(temperature=rs.temperature[slot], top_k=rs.top_k[slot],
                                     top_p=rs.top_p[slot]))


@functools.partial(jax.jit, donate_argnames="state")
def put_row(state: DecodeState, slot: Int[Array, ""], row: RowState) -> DecodeState:
    """Row `slot` takes a state `take_row` saved (the inverse of `take_row`)."""
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


def admit(state: DecodeState, lanes: Lanes, last_logits, ok,
          eos_ids) -> tuple[DecodeState, Bool[Array, ""]]:
    """Rows whose prompt just ended take their first token and start decoding; also
    returns whether one of them finished with it (EOS, or a request of one token). When
    the state carries `step_logprobs`, the admitted rows' entries become their first
    tokens' (the other rows' are left as they were)."""
    rows = state.seq_ids.shape[0]
    admit = lanes.last & (lanes.lengths > 0) & ok
    lane_keys = jax.random.wrap_key_data(lanes.key_data, impl=jax.random.key_impl(state.keys))
    keys = jax.vmap(jax.random.fold_in)(lane_keys, lanes.count)
    tok = sample_rows(last_logits, keys, lanes.sampling)
    num = lanes.count + 1
    finished = admit & (is_eos(tok, eos_ids) | (num >= lanes.max_new))
    tgt = jnp.where(admit, lanes.slots, rows)  # out of range: dropped

    def put(x, v):
        return x.at[tgt].set(v, mode="drop")

    rs, ls = state.row_sampling, lanes.sampling
    taken = state.step_logprobs
    if taken is not None:
        lane_lp = step_logprobs(last_logits, tok, taken.top.shape[1])
        taken = jax.tree.map(put, taken, lane_lp)
    state = dataclasses.replace(
        state, last=put(state.last, tok),
        position=put(state.position, lanes.start + lanes.lengths),
        num_generated=put(state.num_generated, num), max_new=put(state.max_new, lanes.max_new),
        done=put(state.done, finished), keys=put(state.keys, lane_keys),
        row_sampling=RowSampling(temperature=put(rs.temperature, ls.temperature),
                                 top_k=put(rs.top_k, ls.top_k), top_p=put(rs.top_p, ls.top_p)),
        step_logprobs=taken)
    return state, jnp.any(finished)


_FIELDS = ("last", "num_generated", "done")


def _entry(s: DecodeState, logprobs: bool) -> tuple:
    """What the host reads of each row after a prefill or decode step: (last, count, done),
    and with `logprobs` each row's `StepLogprobs` (chosen, top_ids, top)."""
    out = tuple(getattr(s, f) for f in _FIELDS)
    if logprobs:
        lp = s.step_logprobs
        out += (lp.chosen, lp.top_ids, lp.top)
    return out


def _with_logprobs(model: Model, state: DecodeState) -> DecodeState:
    rows, k = state.seq_ids.shape[0], min(TOP_LOGPROBS, model.vocab_size)
    return dataclasses.replace(state, step_logprobs=StepLogprobs(
        chosen=jnp.zeros((rows,), jnp.float32), top_ids=jnp.zeros((rows, k), jnp.int32),
        top=jnp.zeros((rows, k), jnp.float32)))


@functools.partial(jax.jit, static_argnames=("model", "eos_ids", "impl", "policy", "logprobs"),
                   donate_argnames="state")
def prefill_lanes(model: Model, params, state: DecodeState, lanes: Lanes,
                  until_finish: Bool[Array, ""], *, eos_ids: tuple[int, ...], impl,
                  policy: CachePolicy | None, logprobs: bool = False):
    """One prefill chunk per lane; rows whose prompt ends take their first token (`admit`).

    Returns:
      (state, head, stop): head holds `step`'s record entry after the lanes, [1, rows];
      stop: `until_finish` and a row finished with its first token (its row is free).
    """
    if logprobs:
        state = _with_logprobs(model, state)
    if lanes.packing is not None:
        cache, last_logits, status = prefill_packed(
            model, params, state.cache, lanes.tokens, lanes.packing, lanes.lengths,
            lanes.slots, lanes.start, impl=impl)
        pstate = state.policy_state
    else:
        cache, last_logits, status, _, pstate = prefill(
            model, params, state.cache, lanes.tokens, lanes.lengths, lanes.slots,
            chunk_size=lanes.tokens.shape[1], impl=impl, policy=policy,
            policy_state=state.policy_state, start_positions=lanes.start)
    state = dataclasses.replace(state, cache=cache, policy_state=pstate,
                                status=first_error(state.status, status))
    state, finished = admit(state, lanes, last_logits, status.code == 0, eos_ids)
    head = tuple(x[None] for x in _entry(state, logprobs))
    return dataclasses.replace(state, step_logprobs=None), head, until_finish & finished


@functools.partial(jax.jit, static_argnames=("model", "eos_ids", "impl", "policy", "decode",
                                             "logprobs", "live"),
                   donate_argnames="state")
def decode_rows(model: Model, dparams, state: DecodeState, steps: Int[Array, ""],
                until_finish: Bool[Array, ""], stop: Bool[Array, ""], *,
                eos_ids: tuple[int, ...], impl, policy: CachePolicy | None, decode: int,
                logprobs: bool = False, live: int | None = None):
    """Up to `steps` (<= `decode`, static) decode steps over the rows, in a
    `lax.while_loop` that stops once every row is done, and, when `until_finish`, as soon
    as a row has finished (a waiting request can take its row at once); none when `stop`.
    With `live` (static, fewer than the rows), the steps run on `live` rows only: the rows
    not done, which the caller guarantees are at most `live` (a step's matmuls and
    attention then cost what its live rows need, not what every row does).

    Returns:
      (state, record, ran): record holds `step`'s entries after each decode step,
      [decode, rows]; only the first `ran` are filled.
    """
    rows = state.seq_ids.shape[0]
    if logprobs:
        state = _with_logprobs(model, state)
    record = tuple(jnp.zeros((decode, *x.shape), x.dtype) for x in _entry(state, logprobs))
    full, sel = state, None
    if live is not None and live < rows:
        # Not-done rows first (a stable sort), padded with done rows: distinct rows.
        sel = jnp.argsort(state.done, stable=True)[:live]
        state = _take_rows(state, sel)
        record = tuple(r[:, :live] for r in record)

    def more(c):
        i, s, stop, _ = c
        return (i < steps) & ~stop & jnp.any(~s.done)  # no step once every row is done

    def one(c):
        i, prev, _, rec = c
        s = decode_step(model, dparams, prev, sampling=GREEDY, eos_ids=eos_ids,
                        free_finished=False, impl=impl, policy=policy)
        finished = jnp.any(s.done & ~prev.done)
        rec = tuple(r.at[i].set(x) for r, x in zip(rec, _entry(s, logprobs), strict=True))
        return i + 1, s, until_finish & finished, rec

    ran, state, _, record = jax.lax.while_loop(more, one, (jnp.int32(0), state, stop, record))
    if sel is not None:
        # Rows that did not run keep their entries (done rows: nothing to deliver).
        base = _entry(full, logprobs)
        record = tuple(jnp.broadcast_to(b[None], (decode, *b.shape)).at[:, sel].set(r)
                       for b, r in zip(base, record, strict=True))
        state = _put_rows(full, state, sel)
    # The state leaves as it came (one pytree structure for every program).
    return dataclasses.replace(state, step_logprobs=None), record, ran


def step(model: Model, params, dparams, state: DecodeState, lanes: Lanes | None,
         steps: Int[Array, ""], until_finish: Bool[Array, ""], *,
         eos_ids: tuple[int, ...], impl, policy: CachePolicy | None, decode: int,
         logprobs: bool = False, live: int | None = None):
    """The engine's call: `prefill_lanes` (when there are lanes), then `decode_rows` (when
    `steps` > 0), two programs dispatched back to back: one per lane shape and one per
    `live` bucket, not one per pair of them.

    Returns:
      (state, head, record, ran): head is `prefill_lanes`' entry ([1, rows]; None without
      lanes), record `decode_rows`' (None when no decode step was asked for; `ran` is then
      0). An entry is (last, count, done) [rows], and with `logprobs` (static) each row's
      `StepLogprobs` (chosen [rows], top_ids and top [rows, min(TOP_LOGPROBS, vocab)]: the
      raw logits' log-softmax, before temperature and top-p).
    """
    head, stop = None, np.bool_(False)
    if lanes is not None:
        state, head, stop = prefill_lanes(model, params, state, lanes, until_finish,
                                          eos_ids=eos_ids, impl=impl, policy=policy,
                                          logprobs=logprobs)
    if not decode or not int(steps):
        return state, head, None, np.int32(0)
    state, record, ran = decode_rows(model, dparams, state, steps, until_finish, stop,
                                     eos_ids=eos_ids, impl=impl, policy=policy,
                                     decode=decode, logprobs=logprobs, live=live)
    return state, head, record, ran


# DecodeState's per-row fields: all but those every row shares (the cache and the policy
# state, which the rows' slots index; the status and the step counter).
_SHARED_FIELDS = ("cache", "status", "step", "policy_state")
_ROW_FIELDS = tuple(f.name for f in dataclasses.fields(DecodeState)
                    if f.name not in _SHARED_FIELDS)


def _take_rows(state: DecodeState, sel: Int[Array, " live"]) -> DecodeState:
    """The state of rows `sel` only (the cache and the rest shared)."""
    return dataclasses.replace(state, **{
        f: jax.tree.map(lambda x: x[sel], getattr(state, f)) for f in _ROW_FIELDS})


def _put_rows(state: DecodeState, sub: DecodeState, sel: Int[Array, " live"]) -> DecodeState:
    """`state` with rows `sel` taken from `sub` (from `_take_rows`) and the rest of `sub`."""
    rows = {f: jax.tree.map(lambda x, y: x.at[sel].set(y), getattr(state, f), getattr(sub, f))
            for f in _ROW_FIELDS}
    return dataclasses.replace(sub, **rows)


@functools.partial(jax.jit, donate_argnames="cache")
def share(cache, src: Int[Array, ""], dst: Int[Array, ""], length: Int[Array, ""]):
    """Slot `dst` (empty) takes the first `length` tokens of slot `src` — whole pages (or
    quantized pages), shared: a fork truncated to them. The engine checks the slots and
    the length before; the status is returned for the record."""
    kind = kv_cache.page_kind(cache)
    cache, st = kind.fork(cache, src[None], dst[None])
    cache = window.fork(cache, src[None], dst[None])  # no-ops without window groups
    cache = host.after_fork(cache, src[None], dst[None], st)  # or a host tier
    new_lengths = cache.lengths.at[dst].set(length)
    cache, st2 = kind.truncate(cache, new_lengths)
    # The engine shares only lengths whose windows the rings still hold (`CacheSlots.ring_holds`).
    cache = window.truncate(cache, cache.lengths)
    cache = host.after_truncate(cache, new_lengths, st2)
    return cache, first_error(st, st2)


@functools.partial(jax.jit, donate_argnames="cache")
def free(cache, slots: Bool[Array, " slots"]):
    """Frees the flagged slots (cached prefixes the engine lets go)."""
    return kv_cache.free(cache, slots)


@functools.partial(jax.jit, donate_argnames="state")
def release(state: DecodeState, rows: Bool[Array, " rows"]) -> DecodeState:
    """Frees the flagged rows' slots and marks them done."""
    mask = jnp.zeros((state.cache.spec.max_seqs,), bool).at[state.seq_ids].set(rows)
    cache = jax.lax.cond(jnp.any(rows), lambda c: kv_cache.free(c, mask), lambda c: c,
                         state.cache)
    return dataclasses.replace(state, cache=cache, done=state.done | rows)


def lane_shapes(prefill_rows: int, chunk: int, *, most: int = 0, wide: bool = True,
                least: int = 32, longest: int | None = None) -> list[tuple[int, int]]:
    """The (lanes, width) shapes an engine compiles its prefill for. Lane counts: powers of
    two up to `prefill_rows` (and it): idle lanes still cost their compute, so a call runs
    the smallest that fits `most` tokens (default `prefill_rows` chunks). Widths: one
    chunk, and when `wide` (float pages only) for each lane count the widest that fits
    `most` (whole chunks, or below a chunk a power of two of at least `least` tokens),
    plus single lanes of 2, 4, ... chunks, none wider than `longest` (a prompt's longest):
    many prompts then share a call in narrow lanes, each prompt's last lane wastes little,
    and one long prompt prefills in a few wide calls. On float pages a lane of 32 tokens
    or more gave bit-for-bit the logits of its chunks one by one (attention reads every
    key from the pages; checked on CPU, XLA path and kernels, float32 and bf16, widths 32
    to 512 against 64; 16-token lanes differed in the last bits, hence `least`; a
    backend whose matmuls block by row count may differ too); not so on KIVI pages,
    window-only rings or under a cache policy, whose quantization, rings and prompt
    scoring follow the chunks (not `wide` there)."""
    counts = [1]
    while counts[-1] * 2 < prefill_rows:
        counts.append(counts[-1] * 2)
    counts = sorted(set(counts + [prefill_rows]))
    most = most or prefill_rows * chunk
    shapes = {(p, chunk) for p in counts if p * chunk <= max(most, chunk)}
    for p in counts if wide else []:
        fit = min(most // p, longest or most)
        w = fit // chunk * chunk if fit >= chunk else 1 << (fit.bit_length() - 1)
        if w >= least:
            shapes.add((p, w))
    w = 2 * chunk
    while wide and w <= min(most, longest or most):
        shapes.add((1, w))
        w *= 2
    return sorted(shapes)


def packed_shapes(prefill_rows: int, tokens: int, chunk: int, *, least: int = 32,
                  widest: int | None = None) -> list[tuple[int, int, int]]:
    """The (lanes, width, tokens) shapes an engine whose model packs (`Model.packs`)
    compiles its prefill for: rows of `tokens` (down to a multiple of `least`, or else to
    one `chunk`), of one `chunk` (for a call that must allocate little), and of the powers
    of two from 2 * `least` and their 1.5x multiples from 4 * `least` up to `tokens` (the
    row a call takes shrinks with the decoding rows' share of the budget), each from one
    prompt (`width` the whole row) and from as many as fit (`prefill_rows` at most, one
    per `least` tokens at most), of up to `width` tokens each: twice the row over the
    lanes, down to a multiple of `least` (the cache's writes and attention see the lanes
    padded to `width`: a copy of the row's queries, keys and values at most twice its
    size; idle lanes cost little there, but 16 lanes of 68 tokens took 1.6x the time of
    16 of 64 in float32 on a 2-core Zen 4 for the same 544-token row). No
    lane is padded in the matmuls, which are most of a call's work. A call's lanes may end
    anywhere in a prompt. `widest` caps the lanes' width (window-only rings take one
    chunk's new tokens per call: `widest` = `chunk` there); rows are then multiples of the
    smaller of `least` and `widest`, and a row takes as many lanes as it needs."""
    counts = [1]
    while counts[-1] * 2 < prefill_rows:
        counts.append(counts[-1] * 2)
    counts = sorted(set(counts + [prefill_rows]))
    unit = least if widest is None else min(least, widest)  # rows are multiples of it
    top = tokens // unit * unit or min(chunk, tokens)
    rows = {top, min(chunk, top)} | {
        r for k in range(top.bit_length())
        for r in (1 << k, 3 << k) if 2 * unit <= r <= top and (r == 1 << k or r >= 4 * unit)}
    widest = widest or top
    shapes = {(p, min(row if p <= 2 else max(2 * row // p // least * least, least), widest), row)
              for row in rows
              for p in {1, max(q for q in counts if q == 1 or q * unit <= row)}}
    return sorted(s for s in shapes if s[0] * s[1] >= s[2])  # lanes that can fill the row


def live_buckets(rows: int) -> list[int | None]:
    """The decoding-row counts (`step`'s `live`) an engine of `rows` rows compiles its step
    for: every row (None) and, from 16 rows up, the powers of four below them. A call
    decodes only the smallest bucket that holds its live rows: a decode step of the
    56M-parameter peer model (benchmarks/serving.py) at 600 tokens of context takes 8, 10,
    19 and 42 ms at 1, 4, 16 and 32 rows (float32, 2-core Zen 4). Below 16 rows the saving
    is small beside a program to compile per bucket."""
    if rows < 16:
        return [None]
    out = [1]
    while out[-1] * 4 < rows:
        out.append(out[-1] * 4)
    return out + [None]


def live_bucket(rows: int, live: int) -> int | None:
    """The bucket of `live_buckets(rows)` a call with `live` decoding rows runs."""
    return next(b for b in live_buckets(rows) if b is None or b >= live)


def seed_key(seed: int) -> jax.Array:
    """`jax.random.key(seed)` for 32-bit seeds (what `generate` takes); wider seeds fold their
    high word in, so they do not collide with their low 32 bits."""
    low, high = seed & 0xFFFFFFFF, seed >> 32
    key = jax.random.key(low)
    return key if high == 0 else jax.random.fold_in(key, high)
