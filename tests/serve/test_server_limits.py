"""The server's limits and operations endpoints on the tiny chat checkpoint: the request
size limit (413), the untokenized length bound, tokenization off the event loop, the
request timeout (408), the API key (401), /tokenize and /detokenize, the waiting bound
(429), /metrics and the drain on SIGTERM.

One app with every limit set serves the module, under `DrainingServer` (the drain test
comes last: it ends the server). Its engine has test_server.py's shape, and before the
server starts one request runs through it directly, so the single-prompt programs the
tests use are compiled before any request timeout runs.
"""

import asyncio
import json
import select
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jax
import numpy as np
import openai
import pytest
import transformers
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from kvjax import generate as gen
from kvjax import models
from kvjax.serve import Engine
from kvjax.serve.metrics import ENGINE_COUNTERS
from kvjax.serve.server import DrainingServer, create_app
from tests.serve import tiny_chat

NAME = "tiny-chat"
KEY = "sk-kvjax-test"
MAX_SEQ_LEN = 64
LIMIT = 256 * 1024  # max_request_bytes
# request_timeout, seconds: every request of the module's server has it, so it must hold
# a small request on a loaded 2-core machine; two tests wait it out once each.
TIMEOUT = 3.0
MAX_WAITING = 1
ENGINE = dict(max_seqs=4, max_seq_len=MAX_SEQ_LEN, chunk_size=16, eos_ids=(tiny_chat.EOS,))
CACHE = gen.CacheConfig(dtype="float32", page_size=8)
SLOW_WORD = "w87"  # a prompt holding it blocks in the tokenizer until released


class _WatchedTokenizer:
    """The checkpoint's tokenizer, recording the length of every text it is given, and
    blocking on a text that holds SLOW_WORD while `hold` is set (until `release`)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.seen: list[int] = []
        self.hold = threading.Event()
        self.blocked = threading.Event()
        self.release = threading.Event()

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def _watch(self, text):
        self.seen.append(len(text) if isinstance(text, str) else sum(
            len(m.get("content") or "") for m in text))
        if self.hold.is_set() and SLOW_WORD in str(text):
            self.blocked.set()
            self.release.wait(10)

    def encode(self, text, **kwargs):
        self._watch(text)
        return self._tokenizer.encode(text, **kwargs)

    def apply_chat_template(self, messages, **kwargs):
        self._watch(messages)
        return self._tokenizer.apply_chat_template(messages, **kwargs)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp(NAME)
    tiny_chat.save(d)
    model, params = models.load(str(d))
    tokenizer = _WatchedTokenizer(transformers.AutoTokenizer.from_pretrained(d))
    engine = Engine(model, params, cache=CACHE, **ENGINE)
    # Compiles the programs one request at a time runs (a prefill lane, decode calls).
    engine.add_request([tiny_chat.BOS, *range(10, 19)], max_tokens=24)
    engine.run()
    app = create_app(engine, tokenizer, model_name=NAME, api_key=KEY,
                     max_request_bytes=LIMIT, request_timeout=TIMEOUT, max_waiting=MAX_WAITING)
    server = DrainingServer(uvicorn.Config(app, host="127.0.0.1", port=0,
                                           log_config=None, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield dict(engine=engine, app=app, server=server, thread=thread, port=port,
               url=f"http://127.0.0.1:{port}", tokenizer=tokenizer)
    server.should_exit = True
    thread.join(30)


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served["url"] + "/v1", api_key=KEY, max_retries=0,
                         timeout=30)


AUTH = {"Authorization": f"Bearer {KEY}"}


def _metrics(url) -> dict[tuple[str, tuple], float]:
    """/metrics parsed by prometheus_client's own parser: {(sample, labels): value}."""
    r = httpx.get(url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(r.text) for s in f.samples}


def _small(client, prompt="w01 w02"):
    return client.completions.create(model=NAME, prompt=prompt, max_tokens=3, temperature=0)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _upload(port: int, head: bytes, chunks, *, limit_s: float = 20) -> tuple[int, dict, int]:
    """Sends `head` then the byte strings of `chunks` on one socket, reading whenever the
    server answers and stopping to send once it has; returns (status, error, bytes sent)."""
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(head)
    s.setblocking(False)
    chunks, pending, sent, got = iter(chunks), b"", 0, b""
    deadline = time.monotonic() + limit_s
    try:
        while time.monotonic() < deadline:
            sending = chunks is not None or pending
            readable, writable, _ = select.select([s], [s] if sending else [], [], 0.05)
            if readable:
                try:
                    data = s.recv(1 << 16)
                except ConnectionResetError:
                    data = b""
                got += data
                head_, sep, body = got.partition(b"\r\n\r\n")
                if sep:
                    length = next(int(line.split(b":")[1]) for line in head_.split(b"\r\n")
                                  if line.lower().startswith(b"content-length:"))
                    if len(body) >= length:
                        return int(head_.split()[1]), json.loads(body)["error"], sent
                if not data:
                    break
                continue
            if writable:
                if not pending:
                    pending = next(chunks, None)
                    if pending is None:
                        chunks, pending = None, b""
                        continue
                try:
                    n = s.send(pending)
                except (BrokenPipeError, ConnectionResetError):
                    chunks, pending = None, b""
                    continue
                pending, sent = pending[n:], sent + n
    finally:
        s.close()
    raise AssertionError(f"no complete answer after {sent} bytes: {got[:200]!r}")


def test_a_100_mb_body_is_refused_at_once(served, client):
    """A 100 MB completion body, declared (Content-Length) and chunked: both get a 413 in
    OpenAI's shape within a second, the chunked one after at most a few times the limit
    read, and the server's memory grows by far less than the body."""
    port, size = served["port"], 100 * 2**20
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\n")
    start = b'{"model": "tiny-chat", "max_tokens": 2, "prompt": "'
    t0 = time.monotonic()
    status, error, sent = _upload(port, (head + f"Content-Length: {size}\r\n\r\n").encode(),
                                  [start])
    assert (status, error["code"]) == (413, "request_too_large"), error
    assert str(LIMIT) in error["message"] and time.monotonic() - t0 < 1.0

    piece = b"w01 " * (1 << 14)  # 64 KiB, sent again and again: 100 MB in all
    chunk = b"%x\r\n%s\r\n" % (len(piece), piece)
    n = size // len(piece)
    peak, before, stop = [0], _rss(), threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.002)
    sampler = threading.Thread(target=sample)
    sampler.start()
    t0 = time.monotonic()
    try:
        status, error, sent = _upload(
            port, (head + "Transfer-Encoding: chunked\r\n\r\n").encode(),
            [b"%x\r\n%s\r\n" % (len(start), start), *[chunk] * n, b"0\r\n\r\n"])
        elapsed = time.monotonic() - t0
    finally:
        stop.set()
        sampler.join()
    assert (status, error["code"], error["type"]) == (413, "request_too_large",
                                                     "invalid_request_error"), error
    assert elapsed < 1.0, elapsed
    assert sent < size // 10, sent  # the client stopped sending well before 100 MB
    assert peak[0] - before < 200 * 2**20, (peak[0] - before) / 2**20
    assert _small(client).choices[0].finish_reason in ("length", "stop")


def test_long_text_is_refused_before_tokenizing(served, client):
    """A prompt (or chat) over max_seq_len * 32 characters is a 400 without the tokenizer
    or chat template ever seeing it."""
    tokenizer, limit = served["tokenizer"], MAX_SEQ_LEN * 32
    long = ("w03 " * (limit // 4 + 1))[: limit + 1]
    tokenizer.seen.clear()
    for call in (lambda: client.completions.create(model=NAME, prompt=long, max_tokens=2),
                 lambda: client.chat.completions.create(
                     model=NAME, max_tokens=2, messages=[{"role": "user", "content": long}])):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        error = e.value.response.json()["error"]
        assert error["code"] == "context_length_exceeded" and str(limit) in error["message"]
    assert limit + 1 not in tokenizer.seen, "the over-long text was tokenized"
    # At the bound itself the text is tokenized (and then refused for its token count).
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=NAME, prompt=long[:limit], max_tokens=2)
    assert limit in tokenizer.seen


def test_tokenizing_does_not_hold_other_requests(served, client):
    """A request whose tokenization blocks (until released, at most 10 s) does not stop a
    small request from completing meanwhile: tokenization runs off the event loop."""
    tokenizer = served["tokenizer"]
    tokenizer.hold.set()
    tokenizer.release.clear()
    tokenizer.blocked.clear()
    try:
        with ThreadPoolExecutor(1) as pool:
            slow = pool.submit(_small, client, f"w01 {SLOW_WORD}")
            assert tokenizer.blocked.wait(10)
            r = _small(client)
            assert r.choices[0].finish_reason in ("length", "stop")
            assert not tokenizer.release.is_set() and not slow.done()
            tokenizer.release.set()
            assert slow.result().usage.prompt_tokens == 3
    finally:
        tokenizer.hold.clear()
        tokenizer.release.set()


def test_a_slow_sender_times_out_while_others_are_served(served, client):
    """A client that sends half a body and stalls gets a 408 after the request timeout;
    a small request sent meanwhile completes."""
    body = json.dumps({"model": NAME, "prompt": "w01", "max_tokens": 2}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    t0 = time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        stalled = pool.submit(_upload, served["port"], head, [body[:10]])
        r = _small(client)
        assert r.choices[0].finish_reason in ("length", "stop")
        assert not stalled.done()
        status, error, _ = stalled.result()
    assert (status, error["code"]) == (408, "request_timeout"), error
    assert time.monotonic() - t0 >= TIMEOUT


def test_api_key(served):
    url, body = served["url"], {"model": NAME, "prompt": "w01", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for method, path, kw in (("POST", "/v1/completions", {"json": body}),
                                 ("GET", "/v1/models", {}),
                                 ("POST", "/tokenize", {"json": {"prompt": "w01"}})):
            r = httpx.request(method, url + path, headers=headers, **kw)
            assert r.status_code == 401, (headers, path)
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["code"] == "invalid_api_key" and "Bearer" in error["message"]
    wrong = openai.OpenAI(base_url=url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    assert httpx.get(url + "/metrics").status_code == 200
    assert httpx.get(url + "/v1/models", headers=AUTH).status_code == 200


def test_tokenize_and_detokenize(served, client):
    """vLLM's shapes; tokens equal the tokenizer's own, and a chat's equal what a chat
    completion feeds the engine (its usage.prompt_tokens)."""
    url, hf = served["url"], served["tokenizer"]._tokenizer
    text = "w05 w09 user : w17"
    r = httpx.post(url + "/tokenize", headers=AUTH,
                   json={"model": NAME, "prompt": text, "return_token_strs": True}).json()
    ids = hf.encode(text)
    assert r == {"count": len(ids), "max_model_len": MAX_SEQ_LEN, "tokens": ids,
                 "token_strs": hf.convert_ids_to_tokens(ids)}
    r = httpx.post(url + "/tokenize", headers=AUTH,
                   json={"prompt": text, "add_special_tokens": False}).json()
    assert r["tokens"] == hf.encode(text, add_special_tokens=False) == ids[1:]
    messages = [{"role": "system", "content": "w01"}, {"role": "user", "content": "w02 w03"}]
    r = httpx.post(url + "/tokenize", headers=AUTH, json={"messages": messages}).json()
    want = hf.encode(hf.apply_chat_template(messages, add_generation_prompt=True,
                                            tokenize=False), add_special_tokens=False)
    assert r["tokens"] == want and r["count"] == len(want)
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=1)
    assert chat.usage.prompt_tokens == r["count"]
    r = httpx.post(url + "/detokenize", headers=AUTH, json={"model": NAME, "tokens": ids})
    assert r.json() == {"prompt": hf.decode(ids)} and r.json()["prompt"].endswith(text)
    for path, body, status, param in (
            ("/detokenize", {"tokens": [5, tiny_chat.VOCAB_SIZE]}, 400, "tokens"),
            ("/tokenize", {"prompt": "w01", "messages": messages}, 400, "prompt"),
            ("/tokenize", {}, 400, "prompt"),
            ("/tokenize", {"model": "gpt-17", "prompt": "w01"}, 404, "model")):
        r = httpx.post(url + path, headers=AUTH, json=body)
        assert (r.status_code, r.json()["error"]["param"]) == (status, param), body


def test_waiting_bound_and_timeouts(served, client, monkeypatch):
    """With the engine held, max_seqs + max_waiting requests are accepted and the next is
    refused with a 429; /metrics shows the held requests waiting; each held request ends
    with a 408 at the request timeout (streamed: an error event) and is cancelled."""
    engine, app, url = served["engine"], served["app"], served["url"]
    real_step, held, after = engine.step, threading.Event(), [0]
    held.set()

    def step():
        if held.is_set():
            time.sleep(0.005)
            return []
        if after[0] < 2:  # two passes over the worker's commands: the cancels are in
            after[0] += 1
            return []
        return real_step()
    monkeypatch.setattr(engine, "step", step)
    capacity = ENGINE["max_seqs"] + MAX_WAITING
    before = _metrics(url)
    body = {"model": NAME, "prompt": "w01 w02", "max_tokens": 2}

    def held_request(i):
        if i == 0:  # one streamed
            with httpx.stream("POST", url + "/v1/completions", headers=AUTH,
                              json=body | {"stream": True}, timeout=30) as r:
                return r.status_code, [json.loads(line[6:]) for line in r.iter_lines()
                                       if line.startswith("data: {")]
        r = httpx.post(url + "/v1/completions", headers=AUTH, json=body, timeout=30)
        return r.status_code, r.json()
    with ThreadPoolExecutor(capacity) as pool:
        futures = [pool.submit(held_request, i) for i in range(capacity)]
        deadline = time.monotonic() + 10
        while app.state.worker.unfinished < capacity:
            assert time.monotonic() < deadline, app.state.worker.unfinished
            time.sleep(0.005)
        with pytest.raises(openai.RateLimitError) as e:
            _small(client)
        error = e.value.response.json()["error"]
        assert error["code"] == "queue_full" and str(capacity) in error["message"]
        m = _metrics(url)
        assert m[("kvjax_requests_waiting", ())] == capacity
        assert m[("kvjax_requests_running", ())] == 0
        results = [f.result() for f in futures]
    status, events = results[0]
    assert status == 200 and events[-1]["error"]["code"] == "request_timeout"
    for status, r in results[1:]:
        assert (status, r["error"]["code"]) == (408, "request_timeout")
    held.clear()
    deadline = time.monotonic() + 10
    while app.state.worker.unfinished:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    m = _metrics(url)
    key = ("kvjax_requests_total", (("finish_reason", "timeout"),))
    assert m[key] - before.get(key, 0) == capacity
    key = ("kvjax_rejected_requests_total", (("status", "429"),))
    assert m[key] - before.get(key, 0) == 1


def test_metrics_count_requests_tokens_and_pages(served, client):
    """Counters move by what the responses report; the TTFT histogram gains one sample per
    request and the inter-token one a sample per later token; pages in use equal the
    engine's pool less its free pages, and the engine counters its stats (read
    directly)."""
    url, engine = served["url"], served["engine"]
    before = _metrics(url)
    # 12 tokens: more than one engine call (8 decode steps a call) delivers them.
    rs = [client.completions.create(model=NAME, prompt=p, max_tokens=12, temperature=0)
          for p in ("w11 w12 w13", "w21 w22 w23 w24 w25 w26 w27 w28 w29 w30")]
    after = _metrics(url)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)
    finishes = [r.choices[0].finish_reason for r in rs]
    for reason in ("length", "stop"):
        assert delta("kvjax_requests_total", finish_reason=reason) == finishes.count(reason)
    assert delta("kvjax_prompt_tokens_total") == sum(r.usage.prompt_tokens for r in rs)
    assert delta("kvjax_generation_tokens_total") == sum(r.usage.completion_tokens for r in rs)
    assert delta("kvjax_time_to_first_token_seconds_count") == 2
    assert delta("kvjax_inter_token_latency_seconds_count") == sum(
        r.usage.completion_tokens - 1 for r in rs)
    assert delta("kvjax_request_duration_seconds_count") == 2
    assert after[("kvjax_time_to_first_token_seconds_bucket", (("le", "+Inf"),))] >= 2
    free = int(np.min(jax.device_get(engine.state.cache.table.num_free)))  # worker idle
    assert after[("kvjax_kv_pages_total", ())] == engine.spec.num_pages
    assert after[("kvjax_kv_pages_in_use", ())] == engine.spec.num_pages - free
    assert after[("kvjax_kv_pages_in_use", ())] > 0  # the prompts' pages stay cached
    for name in ENGINE_COUNTERS:
        assert after[(f"kvjax_engine_{name}_total", ())] == engine.stats[name], name
    assert delta("kvjax_engine_calls_total") >= 2


def test_sigterm_drains_in_flight_requests(served, monkeypatch):
    """The first SIGTERM: a stream in flight runs to its end ([DONE], every token) while
    uvicorn shuts down; meanwhile /health says "draining" and a new request gets a 503;
    then the server exits and stops the engine. Ends the module's server: it runs last."""
    engine, server, url = served["engine"], served["server"], served["url"]
    real_step, app, calls, in_shutdown, during = engine.step, served["app"], [], [], []

    async def ask_app():  # what a request on a connection still open gets while draining
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvjax") as c:
            return (await c.get("/health"),
                    await c.post("/v1/completions", headers=AUTH, json=body))

    def step():
        # The first call gives the stream its first token; the next waits for the signal
        # and for uvicorn to close its listening socket, then 0.15 s more (past uvicorn's
        # 0.1 s pause before it waits for, or without a drain drops, the connections in
        # flight): the stream's other tokens come while the server is shutting down.
        if calls and not in_shutdown:
            deadline = time.monotonic() + 5
            while (not app.state.draining() or server.servers[0].is_serving()) and (
                    time.monotonic() < deadline):
                time.sleep(0.005)
            in_shutdown.append(not server.servers[0].is_serving())
            during.append(asyncio.run(ask_app()))
            time.sleep(0.15)
        calls.append(1)
        return real_step()
    monkeypatch.setattr(engine, "step", step)
    body = {"model": NAME, "prompt": "w01 w02", "max_tokens": 20, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/completions", headers=AUTH, json=body) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        server.handle_exit(signal.SIGTERM, None)
        assert served["app"].state.draining()
        rest = list(lines)
    events = [json.loads(line[6:]) for line in [first, *rest] if line.startswith("data: {")]
    assert [line for line in rest if line][-1] == "data: [DONE]"
    assert in_shutdown == [True]
    assert "usage" in events[-1], events[-1]
    finish = events[-2]["choices"][0]["finish_reason"]
    tokens = events[-1]["usage"]["completion_tokens"]
    assert (finish, tokens) == ("length", 20) or (finish == "stop" and tokens < 20)
    served["thread"].join(30)
    assert not served["thread"].is_alive()
    assert served["app"].state.worker.error == "the server is shutting down"
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/health", timeout=5)
    health, r = during[0]  # asked while the stream was still running
    assert (health.status_code, health.json()) == (503, {"status": "draining"})
    assert (r.status_code, r.json()["error"]["code"]) == (503, "draining")
