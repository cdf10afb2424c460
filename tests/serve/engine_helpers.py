"""Shared pieces of the serving-engine tests: the tiny model, workloads, the reference run
(`kvjax.generate` on one request alone) and a driver that adds requests as it steps."""

import collections
import os

import jax
import numpy as np
from hypothesis import strategies as hst

import kvjax.generate as gen

PAGE = 8
CHUNK = 16


def _workload(rng, vocab, n, system=48, suffix=(3, 17), new=(2, 14)):
    """n prompts: a shared system prompt (a whole number of chunks) + unique suffixes of up
    to one chunk, so that with the default 48 tokens every prompt pads to one width (64)
    and `_alone` compiles one program for them all."""
    sys_prompt = rng.integers(3, vocab, system).tolist()
    prompts = [sys_prompt + rng.integers(3, vocab, int(k)).tolist()
               for k in rng.integers(*suffix, n)]
    return prompts, [int(k) for k in rng.integers(*new, n)]


REF_NEW, REF_TOKENS = 48, 256


def drawn_seed() -> int:
    """A seed drawn as the `rng` fixture (tests/conftest.py) draws its own, for a module
    fixture, which cannot take that function-scoped one: KVJAX_TEST_SEED when set, else
    fresh; printed, so a failing draw replays with KVJAX_TEST_SEED."""
    seed = int(os.environ.get("KVJAX_TEST_SEED", np.random.SeedSequence().entropy % 2**32))
    print(f"test seed: KVJAX_TEST_SEED={seed}")
    return seed


def _alone(model, params, prompt, max_new, cache, *, key=None, sampling=gen.GREEDY, policy=None):
    """`generate` on one request alone: its first `max_new` tokens. Every call decodes
    REF_NEW tokens on a cache of one fixed size (the first tokens do not depend on how many
    follow), so the references compile once per prompt width, not per request."""
    assert max_new <= REF_NEW and len(prompt) + REF_NEW <= REF_TOKENS
    key = jax.random.key(0)[None] if key is None else key
    r = gen.generate(model, params, [prompt], key=key, max_new_tokens=REF_NEW,
                     cache=cache.build(model, num_seqs=1, max_tokens=REF_TOKENS),
                     chunk_size=CHUNK, sampling=sampling, policy=policy)
    return r.sequences()[0][:max_new]


def _drive(engine, prompts, max_new, *, arrive_every=2, first=1, check_every=1, **kw):
    """Adds the `first` requests at once, then one every `arrive_every` steps (rows join
    mid-decode); runs to the end, checking the invariants; returns each request's tokens
    and its finish reason."""
    ids, out, reasons = [], {}, {}
    pending = list(zip(prompts, max_new, strict=True))
    step = 0
    while pending or engine.has_unfinished():
        for _ in range(first if step == 0 else 1):
            if pending and step % arrive_every == 0:
                p, m = pending.pop(0)
                ids.append(engine.add_request(p, max_tokens=m, **kw))
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
            if o.finished:
                assert o.request_id not in reasons, "a request finished twice"
                reasons[o.request_id] = o.finish_reason
        if step % check_every == 0:
            engine.check()
        step += 1
        assert step < 2000, "the engine does not finish"
    engine.check()
    return [out.get(i, []) for i in ids], [reasons[i] for i in ids]



_EVENTS = hst.lists(
    hst.tuples(hst.sampled_from(["add", "add", "add", "step", "step", "cancel"]),
               hst.integers(0, 10**6)),
    min_size=4, max_size=30)


class _Replay:
    """Adds, steps and cancels on an engine, keeping what each request produced: every
    step is followed by `check()`, every request must finish exactly once, and `stats()`
    is what the engine counted since the replay began (an engine may be shared)."""

    def __init__(self, engine):
        self.engine = engine
        self.requests: dict[str, tuple[list[int], int]] = {}  # id -> (prompt, max_tokens)
        self.out: dict[str, list[int]] = {}
        self.reasons: dict[str, str] = {}
        self.cancelled: set[str] = set()
        self._before = collections.Counter(engine.stats)

    def add(self, prompt, max_tokens: int) -> str:
        rid = self.engine.add_request(prompt, max_tokens=max_tokens)
        self.requests[rid] = (list(prompt), max_tokens)
        return rid

    def cancel(self, rid: str) -> None:
        self.engine.cancel(rid)
        self.cancelled.add(rid)

    def step(self) -> None:
        for o in self.engine.step():
            self.out.setdefault(o.request_id, []).extend(o.token_ids)
            if o.finished:
                assert o.request_id not in self.reasons, "a request finished twice"
                self.reasons[o.request_id] = o.finish_reason
        self.engine.check()

    def stats(self) -> collections.Counter:
        return collections.Counter(self.engine.stats) - self._before

    def step_until(self, reached, what: str, limit: int = 100) -> None:
        """Steps until `reached()`; fails (naming `what`) if `limit` steps do not get there."""
        for _ in range(limit):
            if reached():
                return
            self.step()
        raise AssertionError(f"{limit} steps did not reach {what}: {dict(self.stats())}")

    def events(self, events, max_seq_len: int) -> None:
        """Replays hypothesis `_EVENTS`: adds of random prompts (half of them behind a
        two-page system prompt, so prefixes hit), steps and cancels of any request added
        so far; then runs the engine dry. No request is lost."""
        vocab = self.engine.vocab_size
        system = [5, 9, 17, 33, 65, 7, 11, 13, 21, 3, 4, 6, 8, 10, 12, 14]  # two pages
        for kind, x in events:
            r = np.random.default_rng(x)
            if kind == "add":
                n = int(r.integers(1, 24))
                prompt = (system if x % 2 else []) + r.integers(3, vocab, n).tolist()
                self.add(prompt, int(r.integers(1, max_seq_len - 40)))
            elif kind == "cancel" and self.requests:
                ids = list(self.requests)
                self.cancel(ids[x % len(ids)])
            else:
                self.step()
        while self.engine.has_unfinished():
            self.step()
        assert set(self.reasons) == set(self.requests), "a request was lost"
        assert self.engine.num_running == 0 and self.engine.num_waiting == 0

    def check_tokens(self, reference) -> None:
        """Every request's tokens against `reference(prompt, n)` (greedy tokens of the
        request alone): all n of them when it ran to its length, a prefix of them when it
        was cancelled first."""
        for rid, (prompt, n) in self.requests.items():
            got, reason = self.out.get(rid, []), self.reasons[rid]
            want = reference(prompt, n)
            if reason == "cancelled":
                assert rid in self.cancelled and got == want[: len(got)], (rid, got, want)
            else:
                assert (reason, got) == ("length", want), (rid, reason, got, want)


def _four_prompts_equal_generate(engine, rng, cfg, chunk) -> list[int]:
    """Drives 4 prompts of a chunk and up to half another, all at once, through `engine`;
    each must get generate's tokens with chunk `chunk`. Returns the prompts' lengths."""
    model, params = engine.model, engine.params
    lengths = [int(n) for n in rng.integers(chunk + 1, chunk * 3 // 2 + 1, 4)]
    prompts = [rng.integers(3, model.vocab_size, n).tolist() for n in lengths]
    new = [int(k) for k in rng.integers(2, 10, 4)]
    tokens, _ = _drive(engine, prompts, new, first=4)
    for p, m, got in zip(prompts, new, tokens, strict=True):
        alone = gen.generate(model, params, [p], key=jax.random.key(0)[None],
                             max_new_tokens=10, chunk_size=chunk,
                             cache=cfg.build(model, num_seqs=1, max_tokens=128))
        assert got == alone.sequences()[0][:m]
    return lengths
