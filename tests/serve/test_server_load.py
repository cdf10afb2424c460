"""A bounded load test of the OpenAI-compatible server on loopback: 24 requests from 8
client threads at once (greedy and seeded sampled completions, streamed or not, some
sharing a prompt prefix; streams that hang up after their first chunk; malformed bodies),
then the server's health, the engine's invariants (every page free or held, none lost)
and each completion against the same request served alone.
"""

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import transformers
import uvicorn

from kvjax import generate as gen
from kvjax import models
from kvjax.serve import Engine
from kvjax.serve.server import create_app
from tests.serve import tiny_chat

NAME = "tiny-chat"
MAX_SEQ_LEN = 64
ENGINE = dict(max_seqs=4, max_seq_len=MAX_SEQ_LEN, chunk_size=16, eos_ids=(tiny_chat.EOS,))
CACHE = gen.CacheConfig(dtype="float32", page_size=8)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(app, base url) of a server on a free loopback port, in a thread."""
    d = tmp_path_factory.mktemp(NAME)
    tiny_chat.save(d)
    model, params = models.load(str(d))
    app = create_app(Engine(model, params, cache=CACHE, **ENGINE),
                     transformers.AutoTokenizer.from_pretrained(d), model_name=NAME)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    yield app, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    server.should_exit = True
    thread.join(30)


def _jobs(rng) -> list[tuple[str, dict | bytes]]:
    """24 requests as (kind, body), shuffled: 'greedy' and 'sampled' completions (half
    streamed), 'hangup' streams, 'malformed' bodies."""
    word = lambda n: rng.integers(len(tiny_chat.SPECIAL), tiny_chat.VOCAB_SIZE, n).tolist()  # noqa: E731
    system = word(16)  # two whole pages shared by half the prompts
    jobs = []
    for i in range(16):
        prompt = (system if i % 2 else []) + word(int(rng.integers(2, 20)))
        body = {"model": NAME, "prompt": prompt, "max_tokens": int(rng.integers(3, 13)),
                "temperature": 0, "stream": bool(i % 4 < 2)}
        if i >= 12:
            body |= {"temperature": 1.0, "top_k": 20, "seed": int(rng.integers(2**31))}
        jobs.append(("greedy" if i < 12 else "sampled", body))
    for _ in range(4):
        jobs.append(("hangup", {"model": NAME, "prompt": word(6), "max_tokens": 48,
                                "temperature": 0, "stream": True}))
    jobs += [("malformed", b'{"model": "tiny-chat", "prompt": [5, 6'),
             ("malformed", json.dumps({"model": NAME, "prompt": "w01", "max_tokens": "x"})),
             ("malformed", json.dumps({"model": NAME, "prompt": "w01", "cache_salt": 5})),
             ("malformed", json.dumps({"model": NAME, "prompt": word(MAX_SEQ_LEN)}))]
    return [jobs[i] for i in rng.permutation(len(jobs))]


def _send(url: str, kind: str, body) -> str | int:
    """The completion's text; a hang-up's or malformed body's HTTP status."""
    with httpx.Client(base_url=url, timeout=120) as c:
        if kind == "malformed":
            return c.post("/v1/completions", content=body,
                          headers={"Content-Type": "application/json"}).status_code
        if not body["stream"]:
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            text = []
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                if kind == "hangup":  # leaves with the first chunk: the connection closes
                    return r.status_code
                text.append(json.loads(line[6:])["choices"][0]["text"])
            return "".join(text)


def _idle(app) -> None:
    """Waits until no request is unfinished: the worker thread then waits for commands."""
    worker, deadline = app.state.worker, time.monotonic() + 120
    while worker.unfinished or worker.engine.has_unfinished():
        assert time.monotonic() < deadline, "requests still unfinished after 120 s"
        time.sleep(0.02)


def test_concurrent_load_leaves_the_engine_whole(served, rng, monkeypatch):
    """The requests run batched (several rows decode in one step); afterwards the server
    is healthy, the engine's invariants hold and no page is lost, each hang-up cancelled
    its request, and every completion is the one its request gets alone."""
    app, url = served
    engine = app.state.worker.engine
    real_step, rows, ends = engine.step, [], []

    def step():
        rows.append(engine.num_running)
        outs = real_step()
        ends.extend(o.finish_reason for o in outs if o.finished)
        return outs
    monkeypatch.setattr(engine, "step", step)
    jobs = _jobs(rng)
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda job: _send(url, *job), jobs))
    _idle(app)
    assert max(rows) >= 2, rows  # batched: several rows decoding in one step
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    engine.check()  # every page free, held by a request or by a cached prefix
    for (kind, _), got in zip(jobs, results, strict=True):
        if kind in ("malformed", "hangup"):
            assert got == (400 if kind == "malformed" else 200), (kind, got)
    # The engine ended the requests of hang-ups that had not finished as cancelled.
    assert 1 <= ends.count("cancelled") <= 4 and len(ends) == 20, ends
    # Each completion against the same request alone (its own salt: no prefix shared).
    for i, ((kind, body), got) in enumerate(zip(jobs, results, strict=True)):
        if kind in ("greedy", "sampled"):
            alone = _send(url, kind, body | {"stream": False, "cache_salt": f"alone-{i}"})
            assert got == alone, (kind, body)
    _idle(app)
    engine.check()
    engine.reset_prefix_cache()
    free = np.asarray(engine.state.cache.table.num_free)
    assert int(free.min()) == engine.spec.num_pages, "pages lost"
