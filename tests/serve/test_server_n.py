"""`n` choices per request on the OpenAI-compatible server: the prompt's pages are
prefilled once and shared by the n sequences, each choice samples with its own seed,
and the choices' tokens are those of n requests served one by one. On the tiny random
Llama with a word-level tokenizer (`tiny_chat`), in-process through `TestClient`; one
engine (same configuration as `test_server_logprobs`, so its step compiles once).
"""

import collections
import json
import time

import pytest
import transformers
from fastapi.testclient import TestClient

from kvjax import generate as gen
from kvjax import models
from kvjax.serve import Engine
from kvjax.serve.server import create_app
from tests.serve import tiny_chat

NAME = "tiny-chat"
ENGINE = dict(max_seqs=4, max_seq_len=64, chunk_size=16, prefill_rows=1, eos_ids=(tiny_chat.EOS,))
CACHE = gen.CacheConfig(dtype="float32", page_size=8)
MAX_WAITING = 2  # the server takes max_seqs + 2 = 6 unfinished requests
MESSAGES = [{"role": "user", "content": "w12 w40 w07"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(TestClient, the app's worker)."""
    d = tmp_path_factory.mktemp("n")
    tiny_chat.save(d)
    model, params = models.load(str(d))
    tokenizer = transformers.AutoTokenizer.from_pretrained(d)
    app = create_app(Engine(model, params, cache=CACHE, **ENGINE), tokenizer, model_name=NAME,
                     max_waiting=MAX_WAITING)
    with TestClient(app) as client:
        yield client, app.state.worker


def _post(client, path, body) -> dict:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _idle(worker) -> None:
    """Waits until the engine's thread has nothing left (it then only waits for work)."""
    deadline = time.monotonic() + 30
    while worker.unfinished or worker.load()[:2] != (0, 0):
        assert time.monotonic() < deadline, worker.load()
        time.sleep(0.01)


def test_greedy_choices_equal_the_single_choice(served):
    client, _ = served
    body = dict(model=NAME, prompt="w05 w09 w17 w33", max_tokens=6, temperature=0)
    one = _post(client, "/v1/completions", body)
    three = _post(client, "/v1/completions", body | {"n": 3})
    assert [c["index"] for c in three["choices"]] == [0, 1, 2]
    assert [c["text"] for c in three["choices"]] == [one["choices"][0]["text"]] * 3
    u1, u3 = one["usage"], three["usage"]
    assert u3["prompt_tokens"] == u1["prompt_tokens"]  # the prompt counts once
    assert u3["completion_tokens"] == 3 * u1["completion_tokens"]
    assert u3["total_tokens"] == u3["prompt_tokens"] + u3["completion_tokens"]


def test_the_prompt_is_prefilled_once_and_its_pages_shared(served):
    """n=4 on a 29-token prompt: the first choice prefills it; the other three wait for its
    pages and share its whole chunks (16 tokens: hits cover whole chunks of a prompt's
    pages short of its last token), prefilling only the 13 after them. No page is lost."""
    client, worker = served
    ids = [tiny_chat.BOS] + [10 + (7 * i) % 80 for i in range(28)]  # a prompt only used here
    _idle(worker)
    before = collections.Counter(worker.stats())
    out = _post(client, "/v1/completions", dict(model=NAME, prompt=ids, max_tokens=5,
                                                temperature=0.8, seed=3, n=4))
    _idle(worker)
    after = collections.Counter(worker.stats())
    shared = 16
    assert after["prefill_tokens"] - before["prefill_tokens"] == len(ids) + 3 * (
        len(ids) - shared)
    assert after["hit_pages"] - before["hit_pages"] == 3 * shared // CACHE.page_size
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == shared
    worker.engine.check()  # every page is free or held by a cached prefix


def test_sampled_choices_differ_and_are_reproducible(served):
    client, _ = served
    body = dict(model=NAME, prompt="w05 w09 w17 w33", max_tokens=8, temperature=1.0, seed=11,
                n=4)
    texts = [c["text"] for c in _post(client, "/v1/completions", body)["choices"]]
    assert len(set(texts)) == 4, texts
    assert [c["text"] for c in _post(client, "/v1/completions", body)["choices"]] == texts
    # Choice 0 is what the same request with n=1 gives.
    assert _post(client, "/v1/completions", body | {"n": 1})["choices"][0]["text"] == texts[0]


def test_streamed_chat_carries_every_choice(served):
    client, _ = served
    body = dict(model=NAME, messages=MESSAGES, max_tokens=6, temperature=0.9, seed=5, n=2)
    full = _post(client, "/v1/chat/completions", body)
    r = client.post("/v1/chat/completions",
                    json=body | {"stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200, r.text
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text, finish = {0: "", 1: ""}, {}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        text[choice["index"]] += choice["delta"].get("content", "")
        if choice["finish_reason"] is not None:
            finish[choice["index"]] = choice["finish_reason"]
    assert text == {c["index"]: c["message"]["content"] for c in full["choices"]}
    assert finish == {c["index"]: c["finish_reason"] for c in full["choices"]}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"]


@pytest.mark.parametrize("n, status", [(9, 400), (0, 400), (7, 429)])
def test_bad_or_too_many_choices_are_refused(served, n, status):
    """n outside [1, 8] is a 400 naming it; n counts as n requests against the server's
    queue (max_seqs + max_waiting = 6 here): n=7 is a 429."""
    client, _ = served
    r = client.post("/v1/completions", json=dict(model=NAME, prompt="w05", max_tokens=2, n=n))
    assert r.status_code == status, r.text
    error = r.json()["error"]
    if status == 400:
        assert error["param"] == "n" and str(n) in error["message"] and "8" in error["message"]
    else:
        assert error["code"] == "queue_full"
