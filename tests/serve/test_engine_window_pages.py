"""The serving engine on window-only pages (`CacheConfig(window_pages=True)`).

A tiny Llama-family model whose first layer sees a 6-token window (the second is global),
on 4-token pages and 8-token chunks (rings of 4 pages). Five requests of 24 to 36 prompt
tokens and 20 new ones (more than 3 windows) that share a 16-token system prompt arrive
three at once and then one by one; then, on an emptied prefix cache, the 36-token prompt
alone and two that share its first 4 and all 9 of its pages. Every request's greedy tokens
equal `kvjax.generate`'s on the full-context cache; the engine's invariant check (rings
included) passes after every step, and once the cached prefixes are let go every page of
both pools is free again. A hit reuses a holder's
pages only where its ring still holds the window before the hit: the prompt sharing all
9 pages hits 8 (whole chunks), the one sharing the first 4 does not hit them (the 36-token
prompt's ring starts at page 6 by then; without window pages it would).
"""

import jax
import numpy as np
import pytest

import kvjax.generate as gen
from kvjax.cache import window
from kvjax.serve import Engine
from tests.generate.test_window_pages import tiny
from tests.serve.engine_helpers import _drive, _four_prompts_equal_generate

WINDOW, PAGE, CHUNK, NEW = 6, 4, 8, 20


@pytest.fixture(scope="module")
def model_params():
    return tiny((WINDOW, None))


def _alone(engine, prompt):
    """Serves one request to its end: (tokens, cached prompt tokens)."""
    rid = engine.add_request(prompt, max_tokens=NEW)
    toks, cached = [], None
    while engine.has_unfinished():
        for o in engine.step():
            assert o.request_id == rid
            toks += o.token_ids
            cached = o.cached_tokens
        engine.check()
    return toks, cached


@pytest.mark.parametrize("lanes", [2, 4])
def test_engine_window_pages_equal_generate_and_hits_stop_at_the_rings(model_params, rng,
                                                                        lanes):
    """Tokens equal generate's and prefix hits stop where the rings end, prefilling up to
    `lanes` prompts a call (4: packed rows of 32 tokens, each prompt's lane at most one
    chunk, as much as a ring takes in a call)."""
    model, params = model_params
    system = rng.integers(0, 64, 16).tolist()
    a = system + rng.integers(0, 64, 20).tolist()
    prompts = [a] + [system + rng.integers(0, 64, int(n)).tolist() for n in (8, 13, 11)]
    prompts.append(a[:24] + rng.integers(0, 64, 8).tolist())
    later = [a[:16] + rng.integers(0, 64, 12).tolist(), a + rng.integers(0, 64, 8).tolist()]
    ref = gen.generate(model, params, prompts + [a] + later, key=jax.random.key(0),
                       max_new_tokens=NEW, chunk_size=CHUNK, cache=gen.CacheConfig(page_size=PAGE))
    want = [t[:NEW] for t in ref.sequences()]
    engine = Engine(model, params, max_seqs=max(3, lanes), max_seq_len=64, chunk_size=CHUNK,
                    prefill_rows=lanes, cache=gen.CacheConfig(page_size=PAGE, window_pages=True))
    assert [g.layers for g in engine.spec.window_groups] == [(0,)]
    assert engine.packed and max(s[1] for s in engine.scheduler.lane_shapes) == CHUNK
    assert max(s[2] for s in engine.scheduler.lane_shapes) == lanes * CHUNK
    assert window.ring_size(engine.spec, 0) == 4
    got, reasons = _drive(engine, prompts, [NEW] * len(prompts), first=3, arrive_every=3)
    assert reasons == ["length"] * len(prompts)
    assert engine.stats["hit_pages"] > 0, engine.stats
    engine.reset_prefix_cache()
    engine.check()
    runs = [_alone(engine, p) for p in [a] + later]
    assert got + [t for t, _ in runs] == want
    # Without window pages the second would hit 16 tokens (the main pool holds them).
    assert [c for _, c in runs] == [0, 0, 32]
    held = window.pages_in_use(engine.state.cache)[0]
    assert 0 < held <= len(engine.prefix.holders) * 4
    engine.reset_prefix_cache()
    engine.check()
    cache = engine.state.cache
    assert window.pages_in_use(cache) == (0,)  # no page lost
    assert int(cache.table.num_free) == cache.table.num_pages

def test_cli_serves_a_sliding_window_model_on_window_pages(tmp_path, monkeypatch, capsys, rng):
    """`python -m kvjax serve --window-pages` on a Qwen2 checkpoint whose second layer has a
    6-token window: one greedy completion of 30 prompt + 20 new tokens (more than 3 windows)
    equals transformers'."""
    from fastapi.testclient import TestClient

    from kvjax.__main__ import main
    from tests.models import hf_tiny
    from tests.serve import tiny_chat

    m = hf_tiny.build("qwen2_swa")
    m.save_pretrained(tmp_path)
    tiny_chat.tokenizer().save_pretrained(tmp_path)
    from kvjax.serve import server as kvserver

    served = {}

    def run(self, sockets=None):  # the CLI's server, not started: the app is served below
        served["app"], self.started = self.config.app, True

    monkeypatch.setattr(kvserver.DrainingServer, "run", run)
    assert main(["serve", "--model", str(tmp_path), "--window-pages", "--no-warmup",
                 "--max-seqs", "2", "--max-seq-len", "64", "--page-size", str(PAGE),
                 "--chunk-size", str(CHUNK), "--dtype", "float32"]) == 0
    assert "layers (1,) keep 6-token windows in rings of 4 pages" in capsys.readouterr().err
    prompt = rng.integers(len(tiny_chat.SPECIAL), tiny_chat.VOCAB_SIZE, 30).tolist()
    with TestClient(served["app"]) as c:
        r = c.post("/v1/completions", json={"model": tmp_path.name, "prompt": prompt,
                                            "max_tokens": NEW, "temperature": 0})
    assert r.status_code == 200, r.text
    ref = hf_tiny.hf_greedy(m, prompt, NEW)
    stop = tiny_chat.EOS in ref
    ref = ref[: ref.index(tiny_chat.EOS)] if stop else ref  # the server ends at EOS
    choice = r.json()["choices"][0]
    # This save of the tokenizer decodes without spaces; the words are prefix-free.
    assert (choice["text"].replace(" ", ""), choice["finish_reason"]) == (
        tiny_chat.words(ref).replace(" ", ""), "stop" if stop else "length")


def test_gemma_packs_its_prompts_on_window_rings(rng, monkeypatch):
    """Gemma (local layers on window-only rings, its default) prefills packed rows: each
    call's prompts end to end in one row, no prompt's lane wider than a chunk (what a ring
    takes in one call), and every request gets generate's tokens with the same chunk."""
    from kvjax.serve import steps
    from tests.models.test_packing import _model

    model, params = _model("gemma")
    chunk = 16
    engine = Engine(model, params, max_seqs=4, max_seq_len=128, chunk_size=chunk,
                    cache=gen.CacheConfig(page_size=PAGE), prefill_rows=4,
                    token_budget=4 + 4 * chunk)
    assert engine.packed and len(engine.spec.window_groups) == 1
    calls, step = [], steps.step

    def spy(model, params, dparams, state, lanes, *args, **kwargs):
        if lanes is not None:
            assert lanes.packing is not None and lanes.tokens.shape[0] == 1
            calls.append((lanes.tokens.shape[1], np.asarray(lanes.lengths).tolist()))
        return step(model, params, dparams, state, lanes, *args, **kwargs)

    monkeypatch.setattr(steps, "step", spy)
    lengths = _four_prompts_equal_generate(
        engine, rng, gen.CacheConfig(page_size=PAGE, window_pages=False), chunk)
    assert sum(sum(n) for _, n in calls) == sum(lengths)
    assert max(max(n) for _, n in calls) == chunk and calls[0][0] == 4 * chunk, calls
