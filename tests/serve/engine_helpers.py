"""Shared pieces of the serving-engine tests: the tiny model, workloads, the reference run
(`kvjax.generate` on one request alone) and a driver that adds requests as it steps."""

import jax
import numpy as np
from hypothesis import strategies as hst

import kvjax.generate as gen

PAGE = 8
CHUNK = 16


def _workload(rng, vocab, n, system=48, suffix=(3, 30), new=(2, 14)):
    """n prompts: a shared system prompt (a whole number of chunks) + unique suffixes."""
    sys_prompt = rng.integers(3, vocab, system).tolist()
    prompts = [sys_prompt + rng.integers(3, vocab, int(k)).tolist()
               for k in rng.integers(*suffix, n)]
    return prompts, [int(k) for k in rng.integers(*new, n)]


REF_NEW, REF_TOKENS = 48, 256


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


def _drive(engine, prompts, max_new, *, arrive_every=2, check_every=1, **kw):
    """Adds a request every `arrive_every` steps (rows join mid-decode); runs to the end,
    checking the invariants; returns each request's tokens and its finish reason."""
    ids, out, reasons = [], {}, {}
    pending = list(zip(prompts, max_new, strict=True))
    step = 0
    while pending or engine.has_unfinished():
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


def _random_events(engine, events, max_seq_len=56):
    """Replays hypothesis `_EVENTS` (adds of random prompts, half of them behind a two-page
    system prompt; steps; cancels) on an idle engine, then runs it dry: `check()` after
    every step, every request finishes exactly once, none is lost."""
    vocab = engine.vocab_size
    system = [5, 9, 17, 33, 65, 7, 11, 13, 21, 3, 4, 6, 8, 10, 12, 14]  # two pages
    added, finished = [], set()

    def step():
        for o in engine.step():
            if o.finished:
                assert o.request_id not in finished, "a request finished twice"
                finished.add(o.request_id)
        engine.check()

    for kind, x in events:
        r = np.random.default_rng(x)
        if kind == "add":
            n = int(r.integers(1, 24))
            prompt = (system if x % 2 else []) + r.integers(3, vocab, n).tolist()
            added.append(engine.add_request(
                prompt, max_tokens=int(r.integers(1, max_seq_len - 40))))
        elif kind == "cancel" and added:
            engine.cancel(added[x % len(added)])
        else:
            step()
    while engine.has_unfinished():
        step()
    assert finished == set(added), "a request was lost"
    assert engine.num_running == 0 and engine.num_waiting == 0
