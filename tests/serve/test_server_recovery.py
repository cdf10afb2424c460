"""The server survives a failed engine step: the worker rebuilds the engine and re-queues
every request by recompute, and the clients' streams go on with the same tokens.

Tiny random Llama with the word-level tokenizer (`tiny_chat`), one engine configuration
for both tests so the step programs compile once.
"""

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import transformers
import uvicorn

from kvjax import generate as gen
from kvjax import models
from kvjax.serve import Engine
from kvjax.serve.server import create_app
from tests.serve import tiny_chat

NAME = "tiny-chat"
# Tokens stream in groups of up to three (max_decode_steps=2), so a failure can come while
# every request is part way; one prefill lane: two step programs to compile, not four.
ENGINE = dict(max_seqs=4, max_seq_len=48, chunk_size=16, eos_ids=(tiny_chat.EOS,),
              decode_steps=2, max_decode_steps=2, prefill_rows=1)
CACHE = gen.CacheConfig(dtype="float32", page_size=8)
# Greedy and seeded sampling, prompts of one and two chunks; each runs to max_tokens.
REQUESTS = [
    dict(prompt="w05 w09 w17 w33", temperature=0),
    dict(prompt="w30 w31 w32 w33 w34 w35 w36 w37 w38 w39 w50 w51 w52 w53 w54 w55 w56 w57",
         temperature=0),
    dict(prompt="user : w40 w41 w42 w43 w44", temperature=1.0, seed=7),
    dict(prompt="w60 w61 w62 w63 w64 w65 w66 w67 w68 w69 w71 w72 w73 w74 w75 w76 w77",
         temperature=0.8, top_p=0.9, seed=123456),
]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    d = tmp_path_factory.mktemp(NAME)
    tiny_chat.save(d)
    model, params = models.load(str(d))
    return model, params, transformers.AutoTokenizer.from_pretrained(d)


class _Served:
    """`app` under uvicorn on a free port in a thread, for concurrent streaming clients."""

    def __init__(self, app):
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0,
                                                    log_config=None, log_level="critical"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "no uvicorn"
            time.sleep(0.01)
        return f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def _stream(url: str, request: dict) -> tuple[list[str], str | None, list[dict]]:
    """Streams one completion: (text pieces, finish reason, error events)."""
    body = {"model": NAME, "max_tokens": MAX_TOKENS, "stream": True} | request
    pieces, reason, errors = [], None, []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                errors.append(event)
                continue
            choice = event["choices"][0]
            pieces.append(choice["text"])
            reason = choice["finish_reason"] or reason
    return pieces, reason, errors


def _all(url: str) -> list[tuple[list[str], str | None, list[dict]]]:
    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        return list(pool.map(lambda req: _stream(url, req), REQUESTS))


def _restarts(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("kvjax_engine_restarts_total "):
            return float(line.split()[1])
    raise AssertionError("/metrics has no kvjax_engine_restarts_total")


def _fail_once_mid_stream(monkeypatch, failed: list) -> None:
    """Engine.step waits (runs nothing) until every request of `REQUESTS` has arrived,
    then raises once, at the first step in which each has streamed a token already (so
    each must continue from its tokens); `failed` records their token counts then."""
    real, arrived = Engine.step, []

    def step(self):
        reqs = self.scheduler.requests.values()
        if not arrived:
            if len(reqs) < len(REQUESTS):
                time.sleep(0.005)
                return []
            arrived.append(True)
        if not failed and all(r.output for r in reqs):
            failed.append([len(r.output) for r in reqs])
            raise RuntimeError("injected failure")
        return real(self)

    monkeypatch.setattr(Engine, "step", step)


def test_a_failed_step_rebuilds_the_engine_and_streams_go_on(loaded, monkeypatch):
    """Four concurrent streams (greedy and seeded sampling); one engine step fails while
    each has streamed some tokens. Every client gets the tokens of an unfailed run (same
    server, same requests), no error and no duplicate; /health is ok after; /metrics
    counts one restart."""
    model, params, tokenizer = loaded
    engine = Engine(model, params, cache=CACHE, **ENGINE)
    with _Served(create_app(engine, tokenizer, model_name=NAME)) as url:
        want = _all(url)  # unfailed
        assert all(not errors and reason == "length" for _, reason, errors in want), want
        assert _restarts(url) == 0
        failed = []
        _fail_once_mid_stream(monkeypatch, failed)
        got = _all(url)
        assert failed, "the injected failure never fired"
        assert len(failed[0]) == len(REQUESTS) and max(failed[0]) < MAX_TOKENS, failed
        for (want_pieces, want_reason, _), (pieces, reason, errors) in zip(want, got,
                                                                           strict=True):
            assert not errors, errors
            assert "".join(pieces) == "".join(want_pieces)
            assert reason == want_reason
        r = httpx.get(url + "/health")
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        assert _restarts(url) == 1


def test_a_failed_rebuild_fails_the_requests_and_the_health(loaded, monkeypatch):
    """When the rebuild itself raises, the worker gives up: the stream ends with an error
    event, a new request gets a 500 and /health a 503, both naming the step's failure."""
    model, params, tokenizer = loaded
    engine = Engine(model, params, cache=CACHE, **ENGINE)
    failed = []
    _fail_once_mid_stream(monkeypatch, failed)

    def rebuilt(self, delivered=None):
        raise RuntimeError("no device")

    monkeypatch.setattr(Engine, "rebuilt", rebuilt)
    with _Served(create_app(engine, tokenizer, model_name=NAME)) as url:
        got = _all(url)
        assert failed
        for _, _, errors in got:
            assert len(errors) == 1 and "injected failure" in errors[0]["error"]["message"]
        body = {"model": NAME, "prompt": "w01", "max_tokens": 2}
        r = httpx.post(url + "/v1/completions", json=body)
        assert r.status_code == 500 and "injected failure" in r.json()["error"]["message"]
        r = httpx.get(url + "/health")
        assert r.status_code == 503 and "injected failure" in r.json()["message"]
        assert _restarts(url) == 0
