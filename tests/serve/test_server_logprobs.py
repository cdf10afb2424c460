"""`logprobs` and `top_logprobs` of the OpenAI-compatible server, on the tiny random Llama
with a word-level tokenizer (`tiny_chat`), served in-process through `TestClient`.

Every log-probability is checked against a float64 NumPy log-softmax of the logits of the
HuggingFace model the checkpoint was saved from (PyTorch, float64), on the prompt and the
tokens the server produced: the engine computes them in float32, so they agree to 1e-5.
One engine serves the module (its step and its logprobs variant compile once).
"""

import json

import numpy as np
import pytest
import torch
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
# float32 logits of magnitude ~5 against a float64 reference: a few ulps of 8.
ATOL = 1e-5
PROMPT = "w05 w09 w17 w33 w61"
MESSAGES = [{"role": "user", "content": "w12 w40 w07"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("logprobs")
    tiny_chat.save(d)
    return d


@pytest.fixture(scope="module")
def served(checkpoint):
    """(TestClient, tokenizer) over one engine."""
    model, params = models.load(str(checkpoint))
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    app = create_app(Engine(model, params, cache=CACHE, **ENGINE), tokenizer, model_name=NAME)
    with TestClient(app) as client:
        yield client, tokenizer


@pytest.fixture(scope="module")
def reference(checkpoint):
    """ids -> float64 log-softmax [len(ids), vocab] of the HF model's logits."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).double().eval()

    def run(ids):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0].numpy().astype(np.float64)
        m = logits.max(-1, keepdims=True)
        return logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
    return run


def _post(client, path, body) -> dict:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(client, path, body) -> list[dict]:
    r = client.post(path, json=body | {"stream": True})
    assert r.status_code == 200, r.text
    events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def _check_logprobs(ref_lp, n_prompt, ids, chosen, tops, *, greedy):
    """chosen: each token's logprob; tops: each token's [(id, logprob)], as returned."""
    rows = ref_lp[n_prompt - 1: n_prompt - 1 + len(ids)]
    assert len(ids) > 0 and len(chosen) == len(ids) == len(tops)
    np.testing.assert_allclose(chosen, rows[np.arange(len(ids)), ids], rtol=0, atol=ATOL)
    for row, tok, top in zip(rows, ids, tops, strict=True):
        if not top:
            continue
        top_ids, top_lp = zip(*top, strict=True)
        assert list(top_lp) == sorted(top_lp, reverse=True)
        # The true top-k: the reference's k largest values, and each id's own value.
        np.testing.assert_allclose(top_lp, np.sort(row)[::-1][:len(top)], rtol=0, atol=ATOL)
        np.testing.assert_allclose(top_lp, row[list(top_ids)], rtol=0, atol=ATOL)
        if greedy:
            assert top_ids[0] == tok


def _completion_top(logprobs: dict, k: int) -> list[list[tuple[int, float]]]:
    """Each token's top k of a completion's `top_logprobs` maps (which add the chosen
    token after them when it is not among them)."""
    out = []
    for token, d in zip(logprobs["tokens"], logprobs["top_logprobs"], strict=True):
        items = list(d.items())
        assert len(items) == k or (len(items) == k + 1 and items[-1][0] == token)
        out.append([(tiny_chat.WORDS.index(t), v) for t, v in items[:k]])
    return out


def test_completion_logprobs_equal_the_models(served, reference):
    client, tokenizer = served
    body = dict(model=NAME, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=5)
    full = _post(client, "/v1/completions", body)["choices"][0]
    lp = full["logprobs"]
    ids = [tiny_chat.WORDS.index(t) for t in lp["tokens"]]
    assert tiny_chat.words(ids) == full["text"]
    prompt = tokenizer.encode(PROMPT)
    _check_logprobs(reference(prompt + ids), len(prompt), ids, lp["token_logprobs"],
                    _completion_top(lp, 5), greedy=True)
    assert lp["text_offset"] == [len(tokenizer.decode(ids[:i])) for i in range(len(ids))]
    # Streamed: each chunk carries its tokens' logprobs; together they are the same.
    chunks = _stream(client, "/v1/completions", body)
    merged = {key: [] for key in lp}
    for c in chunks:
        for key in lp:
            merged[key] += (c["choices"][0]["logprobs"] or {}).get(key, [])
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["text"]
    assert merged == lp


def test_logprobs_are_the_raw_models_under_sampling(served, reference):
    """A sampled completion's logprobs are the model's (before temperature and top-p);
    logprobs=0 gives the chosen token alone."""
    client, tokenizer = served
    body = dict(model=NAME, prompt=PROMPT, max_tokens=8, temperature=0.5, top_p=0.9,
                seed=7, logprobs=0)
    lp = _post(client, "/v1/completions", body)["choices"][0]["logprobs"]
    ids = [tiny_chat.WORDS.index(t) for t in lp["tokens"]]
    assert all(d == {t: v} for t, v, d in zip(lp["tokens"], lp["token_logprobs"],
                                               lp["top_logprobs"], strict=True))
    prompt = tokenizer.encode(PROMPT)
    _check_logprobs(reference(prompt + ids), len(prompt), ids, lp["token_logprobs"],
                    [[]] * len(ids), greedy=False)


def test_chat_logprobs_equal_the_models(served, reference):
    client, tokenizer = served
    body = dict(model=NAME, messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True,
                top_logprobs=3)
    choice = _post(client, "/v1/chat/completions", body)["choices"][0]
    content = choice["logprobs"]["content"]
    for item in [*content, *(t for e in content for t in e["top_logprobs"])]:
        assert item["bytes"] == list(item["token"].encode())
    ids = [tiny_chat.WORDS.index(e["token"]) for e in content]
    assert tiny_chat.words(ids) == choice["message"]["content"]
    prompt = tokenizer.encode(tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    tops = [[(tiny_chat.WORDS.index(t["token"]), t["logprob"]) for t in e["top_logprobs"]]
            for e in content]
    assert all(len(t) == 3 for t in tops)
    _check_logprobs(reference(prompt + ids), len(prompt), ids, [e["logprob"] for e in content],
                    tops, greedy=True)
    streamed = [e for c in _stream(client, "/v1/chat/completions", body)
                for e in ((c["choices"][0]["logprobs"] or {}).get("content") or [])]
    assert streamed == content


@pytest.mark.parametrize("path, fields, param", [
    ("/v1/completions", dict(logprobs=21), "logprobs"),
    ("/v1/completions", dict(logprobs=-1), "logprobs"),
    ("/v1/chat/completions", dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("/v1/chat/completions", dict(top_logprobs=2), "top_logprobs"),
], ids=["completion-above-20", "completion-negative", "chat-above-20", "chat-without-logprobs"])
def test_bad_logprobs_are_400(served, path, fields, param):
    client, _ = served
    prompt = dict(prompt=PROMPT) if "chat" not in path else dict(messages=MESSAGES)
    r = client.post(path, json=dict(model=NAME, max_tokens=2, **prompt, **fields))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and str(fields[param]) in error["message"]
    if fields[param] == 21:
        assert "20" in error["message"]
