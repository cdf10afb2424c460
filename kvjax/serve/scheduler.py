"""The engine's scheduler: which requests hold rows, which prefill, how far a step decodes.

`Scheduler` keeps the requests (waiting, running, swapped out) and, before each step,
admits waiting requests to free rows, looks up their prefix hits, plans the step's
prefill lanes and decode rows within the token budget, and makes the pool able to
supply every page the step may allocate (evicting cached prefixes, then preempting
the most recently admitted request: swapped to the host tier when it has room, else
recomputed later from its prompt and the tokens it produced). After the step it hands
each request its new tokens and finishes those that ended. It runs no device program
itself but through `CacheSlots` and `PrefixPages`.
"""

import collections
import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np

from kvjax.generate.sampling import SamplingConfig
from kvjax.serve import steps
from kvjax.serve.prefixes import PrefixPages
from kvjax.serve.slots import CacheSlots

__all__ = ["Request", "RequestOutput", "Scheduler", "TokenLogprobs"]


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """One produced token's log-probabilities under the model: the log-softmax of the raw
    logits it was chosen from (before temperature, top-k and top-p).

    Attributes:
      logprob: log p(the token).
      top_ids: the request's `logprobs` most likely tokens, most likely first.
      top_logprobs: their log-probabilities (descending).
    """

    logprob: float
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


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
      logprobs: one `TokenLogprobs` per token of `token_ids` when the request asked for
        them (`Engine.add_request(logprobs=k)`), else None.
    """

    request_id: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    logprobs: list[TokenLogprobs] | None = None


@dataclasses.dataclass(eq=False)
class Request:
    """One request and where it stands (the scheduler's record of it)."""

    id: str
    prompt: np.ndarray
    max_tokens: int
    sampling: SamplingConfig
    stop_ids: frozenset[int]
    key_data: np.ndarray  # uint32 words of its PRNG key
    salt: str | None
    logprobs: int | None = None  # top tokens to report with each token's log-prob (None: none)
    output: list[int] = dataclasses.field(default_factory=list)
    slot: int | None = None
    fed: np.ndarray | None = None  # what the slot must hold: prompt (+ output if preempted)
    done_tokens: int = 0  # tokens of `fed` in the cache
    cached_tokens: int = 0
    decoding: bool = False
    looked_up: bool = False  # prefix hits attached (or none to look for)
    # While it waits for an earlier prompt to prefill pages it shares: that request, and
    # the pages of its own prompt it will then find cached.
    leader: "Request | None" = None
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
    row_state: steps.RowState | None = None

    def to_recompute(self) -> None:
        """Without pages, the request will be recomputed: its prompt and the tokens it
        produced so far."""
        self.fed = np.concatenate([self.prompt, np.asarray(self.output, np.int32)])
        self.hashes = None
        self.decoding, self.done_tokens = False, 0


def _token_logprobs(record, entries, row: int, k: int) -> list[TokenLogprobs]:
    """Row `row`'s tokens' log-probabilities at the record's `entries`, each with its top
    k; `record`: a step's (chosen, top ids, top logprobs) entries."""
    chosen, ids, top = record
    return [TokenLogprobs(logprob=float(chosen[i, row]), top_ids=tuple(ids[i, row, :k].tolist()),
                          top_logprobs=tuple(top[i, row, :k].tolist())) for i in entries]


# A prefill call's fixed cost in prompt tokens: on the 56M-parameter peer model of
# benchmarks/serving.py a call of 64, 256 and 512 tokens took ~40, ~85 and ~145 ms (float32,
# 2-core Zen 4, lanes of any shape), about (100 + tokens) * 0.24 ms.
LANE_COST = 100


def _row_tokens(shape) -> int:
    """The tokens a prefill call of `shape` computes: lanes x width, or a packed row's."""
    return shape[2] if len(shape) == 3 else shape[0] * shape[1]


def fill_lanes(shape, rest: list[int]) -> list[int]:
    """The tokens each of the prompts with `rest` tokens left (first in line first, one per
    lane) prefills in a call of `shape`: up to its width, within a packed row's tokens."""
    left, out = _row_tokens(shape), []
    for n in rest[:shape[0]]:
        k = min(shape[1], n, left)
        if k <= 0:
            break
        out.append(k)
        left -= k
    return out


def _lane_shape(shapes, rest: list[int], chunk: int, room: int, *,
                narrow: bool = False) -> tuple[int, ...] | None:
    """Of the compiled `shapes` ((lanes, width), or (lanes, width, tokens) packed) within
    `room` tokens (`narrow`: lanes at most one chunk wide), for the prompts that have
    `rest` tokens left, first in line first (one per lane): the one that prefills the most
    of them among those within 10% of the most tokens per cost (`LANE_COST` + the tokens
    it computes), the cheapest of those; None when no shape fits."""
    def useful(s):
        return sum(fill_lanes(s, rest))
    fits = [s for s in shapes if _row_tokens(s) <= room and (not narrow or s[1] <= chunk)]
    if not fits:
        return None
    best = max(useful(s) / (LANE_COST + _row_tokens(s)) for s in fits)
    good = [s for s in fits if useful(s) / (LANE_COST + _row_tokens(s)) >= 0.9 * best]
    return max(good, key=lambda s: (useful(s), -_row_tokens(s), -s[0]))


class Scheduler:
    """Admission, planning, preemption and delivery over the engine's rows.

    Args:
      slots: the engine's `CacheSlots`.
      prefixes: the engine's `PrefixPages`.
      chunk, prefill_rows, token_budget, decode_steps, max_decode_steps: as `Engine`.
      lane_shapes: the (lanes, width) shapes of a step's prefill (`steps.lane_shapes`), or
        its (lanes, width, tokens) packed ones (`steps.packed_shapes`).
      prefill_run: calls with lanes in a row without a decode step while prompts wait.
      stats: the engine's counters (preemptions, requeues, swaps, swap_ins,
        decode_tokens).

    Attributes:
      waiting: requests without a row, first in line first (swapped out ones included).
      running: row -> the request holding it.
      swapped: parked row -> the request swapped out there.
      requests: id -> every unfinished request.
      outputs: the `RequestOutput`s of the current step so far.
    """

    def __init__(self, slots: CacheSlots, prefixes: PrefixPages, *, chunk: int,
                 prefill_rows: int, token_budget: int, decode_steps: int,
                 max_decode_steps: int, stats: collections.Counter,
                 lane_shapes: Sequence[tuple[int, ...]] | None = None, prefill_run: int = 0):
        self.slots = slots
        self.prefixes = prefixes
        self.rows = slots.rows
        self.chunk = chunk
        self.prefill_rows = prefill_rows
        self.lane_shapes = lane_shapes or steps.lane_shapes(prefill_rows, chunk)
        self.token_budget = token_budget
        self.decode_steps = decode_steps
        self.max_decode_steps = max_decode_steps
        self.stats = stats
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: dict[int, Request] = {}
        self.swapped: dict[int, Request] = {}
        self.requests: dict[str, Request] = {}
        self.outputs: list[RequestOutput] = []
        self._admissions = itertools.count(1)
        self.prefill_run, self._run = prefill_run, 0  # calls with lanes and no decode step

    def add(self, req: Request) -> None:
        self.requests[req.id] = req
        self.waiting.append(req)

    def finish(self, req: Request, reason: str, tokens: Sequence[int] = (),
               logprobs: list[TokenLogprobs] | None = None) -> None:
        self.requests.pop(req.id, None)
        if logprobs is None and req.logprobs is not None:
            logprobs = []
        self.outputs.append(RequestOutput(
            request_id=req.id, token_ids=list(tokens), finished=True, finish_reason=reason,
            prompt_tokens=len(req.prompt), cached_tokens=req.cached_tokens, logprobs=logprobs))

    def drop_cancelled(self) -> None:
        """Finishes the cancelled requests, freeing what they hold (their pages serve the
        coming step)."""
        for r in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(r)
            if r.parked is not None:
                self.slots.drop_row(r.parked)
                del self.swapped[r.parked]
                r.parked = None
                self.slots.sync()
            self.finish(r, "cancelled")
        gone = [r for r in self.running.values() if r.cancelled]
        if gone:
            for r in gone:
                del self.running[r.slot]
                self.finish(r, "cancelled")
            self.slots.release([r.slot for r in gone])
            self.slots.sync()

    # ------------------------------------------------------------------ admission

    def admit_waiting(self) -> None:
        """Gives free rows to waiting requests, first in line first, while the pool can
        take their prompts (swapped out ones come back whole)."""
        slots, prefixes = self.slots, self.prefixes
        free_rows = [s for s in range(self.rows) if s not in self.running]
        while self.waiting and free_rows:
            req = self.waiting[0]
            if req.parked is not None:
                if self._resume(req, free_rows[0]):
                    free_rows.pop(0)
                    continue
                if self.running:
                    break
                # Nothing runs and the pool still cannot take it back (the pool holds a
                # request of max_seq_len, so this is a safety net): recompute it instead.
                self._unswap(req)
            # Admit when the pool can take the prompt but for the pages a prefix hit will
            # share (their holder is marked used, so eviction takes others first); a hit
            # on a parked prefix needs the pages that bring it back.
            need = -(-len(req.fed) // slots.spec.page_size)
            if prefixes.enabled:
                hit, holder, row = prefixes.find_hit(req)
                if hit:
                    if holder is not None:
                        need -= hit
                    else:
                        need += len(prefixes.parked[row]) // slots.spec.page_size - hit
            while slots.free_pages < need and prefixes.evict():
                pass
            if slots.free_pages < need and self.running:
                break
            self.waiting.popleft()
            req.slot = free_rows.pop(0)
            req.admitted = next(self._admissions)
            req.done_tokens, req.decoding = 0, False
            slots.ring_base[req.slot] = 0
            self.running[req.slot] = req
            req.looked_up = not prefixes.enabled
            if slots.blank is not None:
                slots.reset_policy_row(req.slot)

    def look_up_prefixes(self) -> None:
        """Prefix hits for the prompts about to take a prefill lane. Looked up this late,
        not at admission, so that a prompt queued behind one with the same prefix finds
        the pages that one registered. A prompt that shares more whole chunks with an
        earlier prompt still being prefilled than the cache holds waits for them (takes
        no lane) instead of computing them again: that prompt registers its pages as soon
        as they cover what a waiting prompt needs (`register_for_followers`)."""
        prefilling = sorted((r for r in self.running.values() if not r.decoding),
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
                self.prefixes.attach(req)
            lanes += 1

    def _leader_for(self, req: Request, prefilling) -> tuple["Request | None", int]:
        """An earlier prompt being prefilled that will register more of `req`'s pages than
        the cache holds now (whole chunks `req` may use), and how many; else (None, 0)."""
        hashes = self.prefixes.hashes(req)
        have = self.prefixes.find_hit(req, touch=False)[0]
        for lead in prefilling:
            if lead.admitted >= req.admitted or not lead.looked_up:
                continue
            theirs = self.prefixes.hashes(lead)
            common = 0
            while (common < min(len(hashes), len(theirs))
                   and hashes[common] == theirs[common]):
                common += 1
            want = self.prefixes.usable_hit(req, common)
            if want > have:
                return lead, want
        return None, 0

    def after_prefill(self, lanes: list[tuple[Request, int]]) -> None:
        """Records the chunks a step prefilled; a prompt that ended starts decoding, and
        its pages are kept for later prompts (with prefix caching), as are the pages a
        prompt waiting for it needs."""
        ps = self.slots.spec.page_size
        for r, n in lanes:
            r.done_tokens += n
            if r.done_tokens == len(r.fed):
                r.decoding = True
                if self.prefixes.enabled:
                    self.prefixes.register(r)
            elif self.prefixes.enabled:
                done = (r.done_tokens if self.slots.spec.quant is None
                        else int(self.slots.quant[r.slot])) // ps
                if any(f.leader is r and f.target <= done for f in self.running.values()):
                    self.prefixes.register(r)

    # ------------------------------------------------------------------ the step's plan

    def plan(self) -> tuple[list[int], list[tuple[Request, int]], tuple[int, ...] | None,
                            int, bool]:
        """The step: its decoding rows, prefill lanes (request, tokens) and their shape
        (lanes, width[, tokens]; None without lanes), the decode steps it runs at most and whether
        it ends as soon as a row finishes. Then the pool can supply every page such a
        step allocates: lanes narrowed to a chunk, prefixes evicted, requests preempted."""
        decode, lanes, shape = self._rows_and_lanes()
        k, until_finish, narrow = *self._call_plan(decode, lanes), False
        while self._pages_needed(decode, lanes, k) > self.slots.free_pages:
            if not narrow and shape is not None and shape[1] > self.chunk:
                narrow = True
            elif not self.prefixes.evict():
                if len(self.running) <= 1:
                    raise RuntimeError(
                        f"the pool ({self.slots.spec.num_pages} pages) cannot hold the next "
                        f"step of the only running request; give the Engine more pages.")
                self._preempt()
            decode, lanes, shape = self._rows_and_lanes(narrow)
            k, until_finish = self._call_plan(decode, lanes)
        self._run = self._run + 1 if lanes and decode and not k else 0
        return decode, lanes, shape, k, until_finish

    def _rows_and_lanes(self, narrow: bool = False) -> tuple[
            list[int], list[tuple[Request, int]], tuple[int, ...] | None]:
        """This step's decoding rows, prefill lanes (request, tokens: the first in line
        that have a lane, up to `prefill_rows`, within the budget the decoding rows leave)
        and their shape (`_lane_shape`; `narrow`: at most one chunk wide)."""
        decode = [s for s, r in self.running.items() if r.decoding]
        # Those not looked up wait for an earlier prompt's pages, or for a lane.
        chosen = sorted((r for r in self.running.values() if not r.decoding and r.looked_up),
                        key=lambda r: r.admitted)[:self.prefill_rows]
        if not chosen:
            return decode, [], None
        rest = [len(r.fed) - r.done_tokens for r in chosen]
        shape = _lane_shape(self.lane_shapes, rest, self.chunk,
                            self.token_budget - len(decode), narrow=narrow)
        if shape is None:
            if decode:
                return decode, [], None
            shape = min(self.lane_shapes)  # a budget below one lane: one lane still runs
        return decode, list(zip(chosen, fill_lanes(shape, rest), strict=False)), shape

    def _decode_steps(self, decode, lanes) -> tuple[int, bool]:
        """Decode steps this call runs at most, and whether it ends as soon as a row
        finishes (its request is then done and a waiting one can take the row):

          * none without a decoding row;
          * while a prompt still waits for a chunk or a lane, none for up to `prefill_run`
            calls in a row, then one (the prompts start sooner);
          * one when a prompt takes its last chunk in this call: its first token is
            streamed at the end of the call, so more steps would delay it (time to first
            token);
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
                not r.decoding and s not in in_lanes for s, r in self.running.items()):
            return int(self._run >= self.prefill_run), False
        if not self.waiting and len(self.running) < self.rows:
            return (1 if ending else self.decode_steps), False
        if ending:  # a first token to stream; the call still ends where a row finishes
            return 1, True
        left = [self.running[s].max_tokens - len(self.running[s].output) for s in decode]
        return max(1, min(self.max_decode_steps, *left)), True

    def _call_plan(self, decode, lanes) -> tuple[int, bool]:
        """`_decode_steps`, with fewer steps when the free pages cannot cover them all (the
        page check then evicts or preempts only if one step does not fit)."""
        k, until_finish = self._decode_steps(decode, lanes)
        k = min(k, _ring_steps(self, lanes))
        while k > 1 and self._pages_needed(decode, lanes, k) > self.slots.free_pages:
            k //= 2
        return k, until_finish

    def _pages_needed(self, decode, lanes, k: int) -> int:
        """Pages the call allocates at most: k decode steps of each decoding row, and each
        lane's chunk (with k steps after it when the prompt ends there)."""
        pages_for = self.slots.pages_for
        return (sum(pages_for(s, k) for s in decode)
                + sum(pages_for(r.slot, n + (k if r.done_tokens + n == len(r.fed) else 0))
                      for r, n in lanes))

    # ------------------------------------------------------------------ preemption

    def _preempt(self) -> None:
        """Preempts the most recently admitted request; it waits again, first in line. With
        a host tier that has room, its sequence is swapped out; else its pages are freed
        and it is recomputed when readmitted."""
        req = max(self.running.values(), key=lambda r: r.admitted)
        held = bool(self.slots.lengths[req.slot])
        if self.slots.host_rows and held and self._swap_out(req):
            return
        del self.running[req.slot]
        self.slots.release([req.slot])
        req.slot = None
        req.to_recompute()
        # A request admitted this step may hold nothing yet: it loses no work.
        self.stats["preemptions" if held else "requeues"] += 1
        self.waiting.appendleft(req)
        self.slots.sync()

    def _swap_out(self, req: Request) -> bool:
        """Preempts a running request by swapping its sequence (and decoding row) to the
        host tier; False (nothing changed) when the tier cannot take it."""
        slots, slot = self.slots, req.slot
        L, q = int(slots.lengths[slot]), int(slots.quant[slot])
        row = self.prefixes.host_room(-(-q // slots.spec.page_size))
        if row is None:
            return False
        saved = slots.take_row(slot) if req.decoding else None
        if not slots.swap_out(slot, row):
            return False
        slots.release([slot])  # the row stops (slot empty)
        del self.running[slot]
        req.parked, req.parked_tokens, req.parked_table, req.row_state = row, L, q, saved
        req.parked_ring_base = slots.ring_base[slot].copy()
        req.slot = None
        self.swapped[row] = req
        self.waiting.appendleft(req)
        self.stats["swaps"] += 1
        return True

    def _resume(self, req: Request, slot: int) -> bool:
        """Swaps a swapped-out request back into row `slot` when the pool can take it and
        the pages it will allocate next (any time while nothing else runs); it continues
        where it stopped. False (nothing changed) otherwise."""
        slots = self.slots
        need = -(-req.parked_table // slots.spec.page_size)
        if self.running:
            ahead = self.decode_steps if req.decoding else min(
                self.chunk, len(req.fed) - req.done_tokens)
            need += slots.growth(req.parked_tokens, req.parked_table, ahead)
        while slots.free_pages < need and self.prefixes.evict():
            pass
        if slots.free_pages < need or not slots.swap_in(req.parked, slot):
            return False
        del self.swapped[req.parked]
        self.waiting.popleft()
        req.parked, req.slot = None, slot
        slots.ring_base[slot] = req.parked_ring_base  # the rings came back as they left
        req.admitted = next(self._admissions)
        self.running[slot] = req
        if req.row_state is not None:
            slots.put_row(slot, req.row_state)
            req.row_state = None
        self.stats["swap_ins"] += 1
        return True

    def _unswap(self, req: Request) -> None:
        """Forgets a swapped-out request's parked row; it will be recomputed."""
        self.slots.drop_row(req.parked)
        del self.swapped[req.parked]
        self.slots.sync()
        req.parked, req.row_state = None, None
        req.to_recompute()
        self.stats["preemptions"] += 1

    # ------------------------------------------------------------------ delivery

    def deliver(self, record, entries: int, eos_ids: tuple[int, ...]) -> None:
        """Hands each decoding row's new tokens to its request, finishes the requests that
        ended and frees their rows. `record`: (last, count, done) [steps, rows] after each
        step of the call (the lanes' first tokens included), of which `entries` ran, and
        when the step recorded them, each token's (logprob, top ids, top logprobs)."""
        last, num, done, *lp = (x[:entries] for x in record)
        release = []
        for slot, r in list(self.running.items()):
            if not r.decoding:
                continue
            # A row produced a token at the steps where its count grew (a row that was
            # admitted in this call starts from its request's count: the lanes' entry).
            col = num[:, slot]
            at = np.flatnonzero(np.diff(col, prepend=len(r.output)) > 0)
            toks = last[at, slot]
            reason = None
            stops = np.isin(toks, [*r.stop_ids, *eos_ids]) if toks.size else toks
            if stops.any():
                toks = toks[: int(np.argmax(stops)) + 1]  # the row may have run on past a
                reason = "stop"                           # host-side stop id
            elif toks.size and done[at[-1], slot]:
                reason = "length"
            logprobs = None if r.logprobs is None else _token_logprobs(
                lp, at[:len(toks)], slot, r.logprobs)
            toks = toks.tolist()
            # Finished rows keep their pages until now (their prompt pages were registered
            # above, even when the request ended in the call that prefilled it).
            if reason is not None:
                release.append(slot)
            r.output.extend(toks)
            self.stats["decode_tokens"] += len(toks)
            if reason is not None:
                del self.running[slot]
                self.finish(r, reason, toks, logprobs)
            elif toks:
                self.outputs.append(RequestOutput(
                    request_id=r.id, token_ids=toks, finished=False, finish_reason=None,
                    prompt_tokens=len(r.prompt), cached_tokens=r.cached_tokens,
                    logprobs=logprobs))
        if release:
            self.slots.release(release)
            self.slots.sync()


def _ring_steps(sched: "Scheduler", lanes) -> int:
    """Decode steps a call may run after a prompt that ends in it while its rings still
    serve a later hit on its pages, which ends at its last whole chunk c: a window
    group's ring must still hold the page of position c - window + 1, which k more
    tokens push out once ceil((len + k) / page_size) - R passes it (unbounded without
    window groups or prefix caching). At least 1: R * page_size >= window + chunk_size
    + page_size - 2 (`kvjax.specs.ring_pages`)."""
    k, slots = sched.max_decode_steps, sched.slots
    if not sched.prefixes.enabled or not slots.windows.size:
        return k
    ps = slots.spec.page_size
    for r, n in lanes:
        total = len(r.fed)
        if r.done_tokens + n != total or total < sched.chunk:
            continue
        first = np.maximum((total // sched.chunk) * sched.chunk - slots.windows + 1, 0) // ps
        if np.any(first < slots.ring_base[r.slot]):
            continue  # a hit's ring that cannot register this prompt anyway
        k = min(k, int(np.min((first + slots.rings) * ps)) - total)
    return max(k, 1)
