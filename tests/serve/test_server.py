"""`python -m kvjax serve`: the OpenAI-compatible server on a tiny random Llama with a
word-level tokenizer, driven by the official `openai` client (and raw httpx for what
the client cannot send). One engine configuration serves every in-process test, so
its step compiles once.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import jax
import openai
import pytest
import transformers
import uvicorn
from fastapi.testclient import TestClient
from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
from tokenizers import models as tk_models

from kvjax import generate as gen
from kvjax import models
from kvjax.__main__ import main
from kvjax.serve import Engine
from kvjax.serve.server import _TextStream, create_app
from tests.serve import tiny_chat

REPO = Path(__file__).resolve().parents[2]
NAME = "tiny-chat"
MAX_SEQ_LEN = 64
NEW = 12  # max_tokens of the greedy comparisons (one compiled reference loop)
ENGINE = dict(max_seqs=4, max_seq_len=MAX_SEQ_LEN, chunk_size=16, eos_ids=(tiny_chat.EOS,))
CACHE = gen.CacheConfig(dtype="float32", page_size=8)
PROMPTS = ["w05 w09 w17 w33", "w10 w11 w12", "user : w40 w41 w42 w43 w44", "w70"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp(NAME)
    tiny_chat.save(d)
    return d


@pytest.fixture(scope="module")
def loaded(checkpoint):
    model, params = models.load(str(checkpoint))
    return model, params, transformers.AutoTokenizer.from_pretrained(checkpoint)


def _serve(app):
    """Runs `app` under uvicorn on a free port in a thread: (server, thread, base url)."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, thread, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def served(loaded):
    model, params, tokenizer = loaded
    engine = Engine(model, params, cache=CACHE, **ENGINE)
    app = create_app(engine, tokenizer, model_name=NAME)
    server, thread, url = _serve(app)
    yield engine, url
    server.should_exit = True
    thread.join(30)


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def _ref_cache(model):
    """The references' cache: one sequence of up to MAX_SEQ_LEN tokens, whatever the prompt
    (a cache sized to each prompt would compile the decode loop once per size)."""
    return CACHE.build(model, num_seqs=1, max_tokens=MAX_SEQ_LEN)


@pytest.fixture(scope="module")
def reference(loaded):
    """Greedy tokens of `kvjax.generate` on one prompt alone (memoized), on a cache of one
    size for every prompt (`_ref_cache`): one compiled decode loop."""
    model, params, _ = loaded
    memo = {}

    def run(ids):
        key = tuple(ids)
        if key not in memo:
            res = gen.generate(model, params, [list(ids)], key=jax.random.key(0),
                               max_new_tokens=NEW, eos_ids=ENGINE["eos_ids"],
                               cache=_ref_cache(model), chunk_size=ENGINE["chunk_size"])
            memo[key] = res.sequences()[0]
        return memo[key]
    return run


def _expected(ref: list[int]) -> tuple[str, str]:
    """The text and finish reason the server should return for reference tokens."""
    if ref and ref[-1] == tiny_chat.EOS:
        return tiny_chat.words(ref[:-1]), "stop"
    return tiny_chat.words(ref), "length"


def _chat_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def test_health_and_models(served, client):
    r = httpx.get(served[1] + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert [m.id for m in client.models.list()] == [NAME]


@pytest.mark.parametrize("as_ids", [False, True], ids=["text", "token-ids"])
def test_completion_matches_generate(client, loaded, reference, as_ids):
    tokenizer = loaded[2]
    ids = tokenizer.encode(PROMPTS[0])
    assert ids[0] == tiny_chat.BOS  # a text prompt gets the tokenizer's BOS
    r = client.completions.create(model=NAME, prompt=ids if as_ids else PROMPTS[0],
                                  max_tokens=NEW, temperature=0)
    ref = reference(ids)
    text, finish = _expected(ref)
    assert r.choices[0].text == text
    assert r.choices[0].finish_reason == finish
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(ref))
    assert r.usage.total_tokens == len(ids) + len(ref)


def test_chat_completion_matches_generate(client, loaded, reference):
    messages = [{"role": "user", "content": "w40 w41 w42"}]
    ids = _chat_ids(loaded[2], messages)
    # The template writes BOS itself: exactly one.
    assert ids[:3] == [tiny_chat.BOS, tiny_chat.WORDS.index("user"), tiny_chat.WORDS.index(":")]
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=NEW,
                                       temperature=0)
    text, finish = _expected(reference(ids))
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text
    assert r.choices[0].finish_reason == finish
    assert r.usage.prompt_tokens == len(ids)


def test_streaming_equals_non_streaming(client):
    args = dict(model=NAME, prompt=PROMPTS[1], max_tokens=NEW, temperature=0)
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert sum(bool(c.choices and c.choices[0].text) for c in chunks) > 1  # really streamed
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == (
        whole.usage.completion_tokens)

    messages = [{"role": "system", "content": "w01"}, {"role": "user", "content": "w02 w03"}]
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=NEW,
                                          temperature=0)
    chunks = list(client.chat.completions.create(model=NAME, messages=messages,
                                                 max_tokens=NEW, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == (
        chat.choices[0].message.content)
    assert chunks[-1].choices[0].finish_reason == chat.choices[0].finish_reason


def test_sampled_completions_equal_generate_with_their_seed(client, loaded, rng):
    """temperature > 0 with top_p and top_k, and a seed: the server's tokens are generate's
    sampled with key(seed) on the prompt alone (the engine draws a row's token s with
    fold_in(key(seed), s), as generate does), for a seed whose draw differs from the greedy
    tokens (a server that ignored the sampling settings would return those). The same
    request twice gives the same text, streamed or not."""
    model, params, tokenizer = loaded
    ids = tokenizer.encode(PROMPTS[2])
    sampling = gen.SamplingConfig(temperature=1.5, top_p=0.9, top_k=20)

    def run(seed, config):
        res = gen.generate(model, params, [ids], key=jax.random.key(seed)[None],
                           max_new_tokens=NEW, sampling=config, eos_ids=ENGINE["eos_ids"],
                           cache=_ref_cache(model), chunk_size=ENGINE["chunk_size"])
        return res.sequences()[0]
    greedy = run(0, gen.GREEDY)
    # At this temperature the tiny model's draws nearly always leave the greedy tokens;
    # a few seeds make it certain.
    for seed in rng.integers(0, 2**31, 8).tolist():
        want = run(seed, sampling)
        if want != greedy:
            break
    assert want != greedy, "eight seeds drew the greedy tokens"
    args = dict(model=NAME, prompt=PROMPTS[2], max_tokens=NEW, temperature=1.5, top_p=0.9,
                extra_body={"top_k": 20}, seed=seed)
    text, finish = _expected(want)
    for _ in range(2):
        r = client.completions.create(**args)
        assert (r.choices[0].text, r.choices[0].finish_reason) == (text, finish)
    chunks = list(client.completions.create(**args, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == text


def test_stop_strings(client, loaded, reference):
    ids = loaded[2].encode(PROMPTS[0])
    ref = [t for t in reference(ids) if t != tiny_chat.EOS]
    words = tiny_chat.words(ref).split(" ")
    full = " ".join(words)
    # One token: the engine stops at it (a stop id); the text ends before it.
    k = next(i for i in range(1, len(words)) if words[i] not in words[:i])
    r = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=NEW,
                                  temperature=0, stop=[words[k]])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (" ".join(words[:k]), "stop")
    assert r.usage.completion_tokens == k + 1  # the stop token was generated
    # Two tokens: matched on the text, host-side, streamed or not.
    j = next(i for i in range(1, len(words) - 1) if words[i] != words[i + 1])
    stop = f"{words[j]} {words[j + 1]}"
    want = full[: full.index(stop)]
    r = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=NEW,
                                  temperature=0, stop=stop)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
    chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=NEW,
                                            temperature=0, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def _byte_level_tokenizer():
    tok = Tokenizer(tk_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        ["Paged caches are fast.", "Les caches paginés sont rapides — très!",
         "猫が座った。🐈‍⬛ sat on the mat"],
        trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>",
                                                clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("stop", [None, "座った", "s r"])
def test_incremental_text_is_the_whole_decode(stop):
    """Token by token, with characters split over several byte-level tokens: the pieces
    never hold a broken character, and they add up to the decoded text (up to a stop)."""
    tokenizer = _byte_level_tokenizer()
    text = "Un chat 🐈‍⬛ est très rapide — 猫が座った。 caches rapides"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    stream = _TextStream(tokenizer, [stop] if stop else [])
    pieces = []
    for i, t in enumerate(ids):
        pieces.append(stream.feed([t], final=i == len(ids) - 1))
        if stream.stopped:
            break
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) == (text[: text.index(stop)] if stop else text)
    assert stream.stopped == bool(stop)
    assert len(pieces) < len(ids) if stop else sum(map(bool, pieces)) > len(ids) // 2


def _error(e: openai.APIStatusError) -> dict:
    body = e.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize("kwargs, status, param", [
    (dict(model="gpt-17"), 404, "model"),
    (dict(max_tokens=-1), 400, "max_tokens"),
    (dict(max_tokens=0), 400, "max_tokens"),
    (dict(temperature=-0.5), 400, "temperature"),
    (dict(top_p=0.0), 400, "top_p"),
    (dict(top_p=1.5), 400, "top_p"),
    (dict(prompt=""), 400, "prompt"),
    (dict(prompt=[]), 400, "prompt"),
    (dict(prompt=list(range(5, 5 + MAX_SEQ_LEN))), 400, "prompt"),
    (dict(prompt=[5] * 60, max_tokens=10), 400, "max_tokens"),
    (dict(prompt=[5, tiny_chat.VOCAB_SIZE]), 400, None),
    (dict(n=9), 400, "n"),
    (dict(stop=[""]), 400, "stop"),
], ids=["unknown-model", "max-tokens-negative", "max-tokens-zero", "temperature", "top-p-0",
        "top-p-above-1", "empty-text", "empty-ids", "prompt-too-long", "prompt-plus-max-tokens",
        "id-outside-vocab", "n", "empty-stop"])
def test_bad_completion_requests_are_4xx(client, kwargs, status, param):
    args = dict(model=NAME, prompt="w01 w02", max_tokens=4, temperature=0) | kwargs
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(**args)
    assert e.value.status_code == status
    error = _error(e.value)
    if param is not None:
        assert error["param"] == param, error
    if "model" in kwargs:
        assert "gpt-17" in error["message"] and NAME in error["message"]
    if param == "prompt" and "prompt" in kwargs and kwargs["prompt"]:
        assert error["code"] == "context_length_exceeded" and str(MAX_SEQ_LEN) in (
            error["message"])
    # The server keeps serving.
    assert client.completions.create(model=NAME, prompt="w01", max_tokens=2,
                                     temperature=0).usage.completion_tokens >= 1


def test_bad_chat_requests_are_4xx(client):
    for kwargs, param in [(dict(messages=[]), "messages"),
                          (dict(max_completion_tokens=MAX_SEQ_LEN), "max_completion_tokens"),
                          (dict(max_tokens=0), "max_tokens"),
                          (dict(model="gpt-17"), "model")]:
        args = dict(model=NAME, messages=[{"role": "user", "content": "w01"}]) | kwargs
        with pytest.raises(openai.APIStatusError) as e:
            client.chat.completions.create(**args)
        assert 400 <= e.value.status_code < 500 and _error(e.value)["param"] == param, kwargs


@pytest.mark.parametrize("body, param", [
    (b'{"model": "tiny-chat", "prompt": ', None),
    (b'[1, 2]', None),
    (json.dumps({"model": NAME, "prompt": "w01", "max_tokens": "many"}).encode(), "max_tokens"),
    (json.dumps({"model": NAME}).encode(), "prompt"),
    (json.dumps({"model": NAME, "prompt": {"text": "w01"}}).encode(), "prompt"),
], ids=["truncated-json", "not-an-object", "wrong-type", "missing-prompt", "prompt-object"])
def test_malformed_bodies_are_400(served, body, param):
    url = served[1]
    r = httpx.post(url + "/v1/completions", content=body,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param and param in error["message"]
    elif body.startswith(b"{"):
        assert "JSON" in error["message"]
    r = httpx.get(url + "/v1/no-such-route")
    assert r.status_code == 404 and r.json()["error"]["message"]
    assert httpx.get(url + "/health").json() == {"status": "ok"}


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_client_disconnect_cancels_the_request(served, monkeypatch, stream):
    engine, url = served
    finished = []
    real_step = engine.step

    def step():  # slowed down, so that 40 tokens (in calls of up to 8) outlast the client
        time.sleep(0.2)
        outs = real_step()
        finished.extend((o.finish_reason, o.token_ids) for o in outs if o.finished)
        return outs
    monkeypatch.setattr(engine, "step", step)
    body = {"model": NAME, "prompt": PROMPTS[3], "max_tokens": 40, "temperature": 0,
            "stream": stream}
    if stream:  # hang up after the first chunk
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            next(line for line in r.iter_lines() if line.startswith("data: "))
    else:  # give up waiting for the whole completion
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.5))
    deadline = time.monotonic() + 60
    while not finished:
        assert time.monotonic() < deadline, "the engine never finished the abandoned request"
        time.sleep(0.05)
    assert finished == [("cancelled", [])]


def test_prefix_cache_hits_are_reported(client):
    # 40 tokens: the second request finds the first 2 chunks (32 tokens) cached.
    prompt = [tiny_chat.WORDS.index(f"w{i:02d}") for i in range(40, 80)]
    a, b = (client.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0)
            for _ in range(2))
    assert a.usage.prompt_tokens_details.cached_tokens == 0
    assert b.usage.prompt_tokens_details.cached_tokens == 32
    assert a.choices[0].text == b.choices[0].text


def test_engine_failure_that_persists_is_a_500_not_a_hang(loaded, monkeypatch):
    # Steps fail on every engine the worker rebuilds: after EngineWorker's 3 rebuilds it
    # gives up (tests/serve/test_server_recovery.py has the failure it survives).
    model, params, tokenizer = loaded
    engine = Engine(model, params, cache=CACHE, **ENGINE)
    real_step, steps = Engine.step, []

    def step(self):  # two good steps (a prefill and a decode), then failures
        steps.append(1)
        if len(steps) > 2:
            raise RuntimeError("injected failure")
        return real_step(self)
    monkeypatch.setattr(Engine, "step", step)
    body = {"model": NAME, "prompt": "w01 w02", "max_tokens": 20, "temperature": 0}
    with TestClient(create_app(engine, tokenizer, model_name=NAME)) as c:
        with c.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
            assert r.status_code == 200
            lines = list(r.iter_lines())
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert [line for line in lines if line][-1] == "data: [DONE]"
        assert events[0]["choices"][0]["text"]  # a token arrived before the failure
        assert "injected failure" in events[-1]["error"]["message"]
        assert events[-1]["error"]["type"] == "server_error"
        assert len(steps) == 2 + 4  # the failure, then one on each of 3 rebuilt engines
        r = c.post("/v1/completions", json=body)  # the engine is gone: an immediate 500
        assert r.status_code == 500 and "injected failure" in r.json()["error"]["message"]
        r = c.get("/health")
        assert r.status_code == 503 and "injected failure" in r.json()["message"]
        assert "kvjax_engine_restarts_total 3.0" in c.get("/metrics").text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_serves_health_and_models_on_8_devices(checkpoint, loaded, reference):
    """The README's `python -m kvjax serve --model HF_DIR`, on the tiny checkpoint, in a
    process that sees 8 CPU devices and serves on all of them (`--mesh model=8`: heads,
    MLP and vocabulary split over them, the 2 KV heads replicated): a greedy completion has
    generate's tokens on one device; SIGINT ends it with status 0."""
    port = _free_port()
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvjax", "serve", "--model", str(checkpoint), "--port",
         str(port), "--max-seqs", "2", "--max-seq-len", str(MAX_SEQ_LEN), "--page-size", "8",
         "--chunk-size", "16", "--log-level", "warning", "--no-warmup", "--mesh", "model=8",
         "--api-key", "sk-cli", "--max-request-bytes", "4096", "--request-timeout", "30",
         "--max-waiting", "2", "--drain-timeout", "20"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO), XLA_FLAGS=" ".join(
            [*flags, "--xla_force_host_platform_device_count=8"])))
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                r = httpx.get(url + "/health", timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the server did not come up in 120 s"
                time.sleep(0.2)
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        assert httpx.get(url + "/v1/models").status_code == 401  # --api-key
        auth = {"Authorization": "Bearer sk-cli"}
        models_ = httpx.get(url + "/v1/models", headers=auth).json()
        assert [m["id"] for m in models_["data"]] == [checkpoint.name]
        r = httpx.post(url + "/v1/completions", headers=auth, content=b" " * 5000)
        assert r.status_code == 413 and "4096" in r.json()["error"]["message"]
        r = httpx.post(url + "/v1/completions", headers=auth, timeout=120, json={
            "model": checkpoint.name, "prompt": PROMPTS[0], "max_tokens": NEW, "temperature": 0})
        assert r.status_code == 200, r.text
        text, finish = _expected(reference(loaded[2].encode(PROMPTS[0])))
        assert (r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]) == (
            text, finish)
        assert "kvjax_kv_pages_total" in httpx.get(url + "/metrics").text
        proc.send_signal(signal.SIGINT)  # uvicorn shuts down gracefully
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert f"serving it as {checkpoint.name!r}" in err
        assert "on a mesh of 8 cpu devices (model=8; strategies heads)" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_help_lists_every_flag():
    r = subprocess.run([sys.executable, "-m", "kvjax", "serve", "--help"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for flag in ("--model", "--host", "--port", "--served-model-name", "--max-seqs",
                 "--max-seq-len", "--num-pages", "--page-size", "--chunk-size", "--kv-dtype",
                 "--kv-bits", "--kv-group-size", "--kv-residual", "--no-prefix-caching",
                 "--dtype", "--log-level", "--no-warmup", "--host-pages", "--host-rows",
                 "--api-key", "--max-request-bytes", "--request-timeout", "--max-waiting",
                 "--drain-timeout", "--mesh", "--kv-memory", "--window-pages", "--decode-steps",
                 "--prefill-lanes", "--prefill-tokens", "--prefill-run"):
        assert flag in r.stdout, flag
    # The KIVI chunk default, and what --mesh takes.
    assert "with --kv-bits at least --kv-residual + --page-size" in " ".join(r.stdout.split())
    assert "AXIS=N[,AXIS=N...]" in r.stdout and "data=N" in r.stdout


@pytest.mark.parametrize("args, message", [
    (["--page-size", "12"], "--page-size must be a power of two"),
    (["--page-size", "8", "--chunk-size", "20"], "--chunk-size (20) must be a multiple"),
    (["--port", "70000"], "--port must lie in"),
    (["--host-rows", "4"], "--host-rows needs --host-pages"),
])
def test_cli_flag_errors(checkpoint, capsys, args, message):
    assert main(["serve", "--model", str(checkpoint), *args]) == 2
    assert f"error: {message}" in capsys.readouterr().err


@pytest.mark.parametrize("tokens, budget, widest", [(32, 35, 32), (8, 19, 16)])
def test_cli_prefill_flags_reach_the_engine(checkpoint, monkeypatch, tokens, budget, widest):
    """--prefill-lanes, --prefill-tokens and --prefill-run set the engine's lanes, its
    token budget (the rows' decode tokens plus the prompt tokens, at least one chunk of
    16: fewer would keep every prompt from a lane while a row decodes) and its prefill
    run."""
    from kvjax.serve import server

    built = {}
    create_app = server.create_app

    def capture(engine, *args, **kwargs):
        built["engine"] = engine
        return create_app(engine, *args, **kwargs)

    def run(self):  # no socket: the test only reads the engine the CLI built
        self.started = True

    monkeypatch.setattr(server, "create_app", capture)
    monkeypatch.setattr(server.DrainingServer, "run", run)
    assert main(["serve", "--model", str(checkpoint), "--no-warmup", "--max-seqs", "3",
                 "--max-seq-len", str(MAX_SEQ_LEN), "--page-size", "8", "--chunk-size", "16",
                 "--prefill-lanes", "2", "--prefill-tokens", str(tokens),
                 "--prefill-run", "0"]) == 0
    engine = built["engine"]
    assert (engine.prefill_rows, engine.token_budget, engine.scheduler.prefill_run) == (
        2, budget, 0)
    assert max(s[2] if len(s) == 3 else s[0] * s[1] for s in engine.scheduler.lane_shapes) == (
        widest)


def test_cli_missing_model_dir(tmp_path, capsys):
    assert main(["serve", "--model", str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err
