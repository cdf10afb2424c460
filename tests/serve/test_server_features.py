"""`python -m kvjax serve` features: `cache_salt`, serving on a device mesh (`--mesh`), and
low-bit pages sized from a memory budget (`--kv-bits`, `--kv-memory`, the KIVI chunk
default).

Every server here is built by the CLI in-process (`main([...])` with the uvicorn server
not started) on a tiny random Llama whose head_dim of 32 takes KIVI groups of 32, and
served through `TestClient`. One int4 server serves the salt and the prefix-hit tests.
"""

import contextlib
import io
import json
import logging
import math
import re

import pytest
from fastapi.testclient import TestClient

from kvjax.__main__ import main
from kvjax.memory import capacity
from kvjax.memory.accounting import KVFormat
from kvjax.serve import server as kvserver
from kvjax.specs import AttentionSpec
from tests.models import hf_tiny
from tests.serve import tiny_chat

PAGE, RESIDUAL, GROUP = 32, 96, 32
MAX_SEQ_LEN = 384
BUDGET_GIB = 0.01
ATTENTION = AttentionSpec(q_heads=8, kv_heads=2, head_dim=32)
NEW = 10
# KIVI int4 pages of PAGE tokens in groups of GROUP, a RESIDUAL-token bf16 tail, and no
# --chunk-size: the CLI picks RESIDUAL + PAGE = 128 (its plain 64 would leave no prefix hit).
COMMON = ["--served-model-name", "wide", "--page-size", str(PAGE), "--kv-dtype", "bfloat16",
          "--max-seqs", "2", "--max-seq-len", str(MAX_SEQ_LEN), "--no-warmup"]
KIVI = ["--kv-bits", "4", "--kv-group-size", str(GROUP), "--kv-residual", str(RESIDUAL),
        *COMMON]


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """(checkpoint dir, the transformers model): 8 query heads of 32 on 2 KV heads."""
    config = hf_tiny.T.LlamaConfig(**hf_tiny._COMMON, num_attention_heads=8,
                                   num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                                   bos_token_id=tiny_chat.BOS, eos_token_id=tiny_chat.EOS,
                                   pad_token_id=0)
    hf_tiny.torch.manual_seed(0)
    m = hf_tiny.T.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    m = m.float().eval()
    d = tmp_path_factory.mktemp("wide")
    m.save_pretrained(d)
    tiny_chat.tokenizer().save_pretrained(d)
    return d, m


def _cli_app(args: list[str]):
    """`python -m kvjax serve ARGS` up to the point it would listen: (app, its stderr)."""
    served, err = {}, io.StringIO()

    def run(self, sockets=None):
        served["app"], self.started = self.config.app, True
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stderr(err):
        mp.setattr(kvserver.DrainingServer, "run", run)
        status = main(["serve", *args])
    assert status == 0, err.getvalue()
    return served["app"], err.getvalue()


def _budget(err: str) -> dict[str, int]:
    """The numbers of the start-up line that says what --kv-memory admits."""
    m = re.search(r"KV memory \S+ GiB: (\d+) pages of (\d+) tokens \((\d+) tokens\) x (\d+) "
                  r"bytes \((\d+) of them K/V\) \+ (\d+) bytes for (\d+) slots' rows = (\d+) "
                  r"bytes.*room for (\d+) sequences", err)
    assert m, err
    keys = ("pages", "page_size", "tokens", "page_bytes", "kv_page_bytes", "fixed", "slots",
            "total", "sequences")
    return dict(zip(keys, map(int, m.groups()), strict=True))


@pytest.fixture(scope="module")
def int4(wide):
    """The int4 server's client, with its start-up output."""
    app, err = _cli_app(["--model", str(wide[0]), *KIVI, "--kv-memory", str(BUDGET_GIB)])
    with TestClient(app) as c:
        yield c, err


def _complete(c, prompt, *, salt=None, chat=False, max_tokens=4) -> dict:
    body = {"model": "wide", "max_tokens": max_tokens, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    if chat:
        r = c.post("/v1/chat/completions", json=body | {"messages": prompt})
    else:
        r = c.post("/v1/completions", json=body | {"prompt": prompt})
    assert r.status_code == 200, r.text
    return r.json()


def _cached(r: dict) -> int:
    return r["usage"]["prompt_tokens_details"]["cached_tokens"]


def _words(rng, n: int) -> list[int]:
    return rng.integers(len(tiny_chat.WORDS) - 89, len(tiny_chat.WORDS), n).tolist()


def test_int4_budget_holds_3x_the_tokens_of_bf16(wide, int4):
    """At one --kv-memory budget: the int4 pool holds >= 3x the tokens of the bf16 pool; a
    page costs what kvjax.memory's layout formula says (codes, scales and zero points);
    each cache fits the budget and leaves less than a page of it unused."""
    _, bf16_err = _cli_app(["--model", str(wide[0]), *COMMON, "--kv-memory", str(BUDGET_GIB)])
    q, f = _budget(int4[1]), _budget(bf16_err)
    assert q["tokens"] >= 3 * f["tokens"], (q, f)
    budget = int(BUDGET_GIB * 2**30)
    for b, fmt in ((q, KVFormat(bits=4, group_size=GROUP, scale_bits=16)), (f, "bf16")):
        assert b["tokens"] == b["pages"] * PAGE and b["page_size"] == PAGE
        assert b["kv_page_bytes"] == capacity.page_bytes(ATTENTION, 2, PAGE, fmt), (b, fmt)
        assert b["total"] == b["fixed"] + b["pages"] * b["page_bytes"] <= budget
        assert budget - b["total"] < b["page_bytes"]
        assert b["sequences"] == b["pages"] // math.ceil(
            (MAX_SEQ_LEN - (RESIDUAL if b is q else 0)) / PAGE)
    # The int4 rows' tails: 2 rows + 4 prefix holders of RESIDUAL + PAGE bf16 tokens.
    assert q["slots"] == 6 and q["fixed"] >= 6 * (RESIDUAL + PAGE) * 2 * 2 * 2 * 32 * 2
    assert "prefill chunks of 128 tokens" in int4[1]


def test_serve_in_process_leaves_the_callers_log_handlers_open(wide, capsys):
    """Building the server leaves every log handler of the process open (uvicorn's own
    logging setup is a dictConfig, which closes them all: absl's handler closes its stream
    with it), and uvicorn's log lines go to the stderr of the moment they are written."""
    class Recording(logging.Handler):
        def __init__(self):
            super().__init__()
            self.closed = False

        def emit(self, record):
            pass

        def close(self):
            self.closed = True
            super().close()

    callers = Recording()
    logger = logging.getLogger("a caller of kvjax serve")
    logger.addHandler(callers)
    try:
        _cli_app(["--model", str(wide[0]), *COMMON])
        assert not callers.closed
    finally:
        logger.removeHandler(callers)
    capsys.readouterr()
    logging.getLogger("uvicorn.error").warning("a line of uvicorn's")
    assert "a line of uvicorn's" in capsys.readouterr().err


def test_each_token_streams_in_a_chunk_of_its_own(int4, rng):
    """By default every engine call decodes one step and every token is its own streamed
    chunk (the prompt's last call gives two tokens at once: each still its own chunk)."""
    c, _ = int4
    engine = c.app.state.worker.engine
    assert (engine.decode_steps, engine.max_decode_steps) == (1, 1)
    body = {"model": "wide", "prompt": _words(rng, 40), "max_tokens": NEW, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with c.stream("POST", "/v1/completions", json=body) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    texts = [e["choices"][0]["text"] for e in events if e["choices"]]
    done = _complete(c, body["prompt"], max_tokens=NEW)
    assert "".join(texts) == done["choices"][0]["text"]
    shown = done["usage"]["completion_tokens"] - (done["choices"][0]["finish_reason"] == "stop")
    assert len([t for t in texts if t]) == shown > 1


def test_kivi_pages_default_to_the_group_size(wide):
    """`--kv-bits` without `--page-size` takes pages of the KIVI group (32), not the
    plain default of 16, which the group would not divide."""
    _, err = _cli_app(["--model", str(wide[0]), "--served-model-name", "wide", "--kv-bits", "4",
                       "--max-seqs", "2", "--max-seq-len", str(MAX_SEQ_LEN), "--no-warmup"])
    assert re.search(r"pages of 32 tokens", err), err


def test_kivi_prefix_hits_with_the_default_chunk(int4, rng):
    """Two prompts sharing 260 tokens (8 whole pages): the second finds >= 80% of those
    pages' tokens cached, with no --chunk-size given (the KIVI default), and its text is
    that of the same prompt under another salt (computed without any hit)."""
    c, _ = int4
    shared = _words(rng, 260)
    a, b = shared + _words(rng, 100), shared + _words(rng, 101)
    assert _cached(_complete(c, a)) == 0
    hit = _complete(c, b, max_tokens=NEW)
    whole = 260 // PAGE * PAGE
    assert _cached(hit) >= 0.8 * whole, hit["usage"]
    alone = _complete(c, b, salt="alone", max_tokens=NEW)
    assert _cached(alone) == 0
    assert hit["choices"][0]["text"] == alone["choices"][0]["text"]


def test_cache_salt_separates_tenants(int4, rng):
    """The same prompt from tenant a, then b, then a again: b finds nothing of a's (0
    cached tokens), a finds its own prompt; chat completions too. A salt that is not a
    non-empty string is refused with a 400 in OpenAI's error shape."""
    c, _ = int4
    prompt = _words(rng, 300)
    assert _cached(_complete(c, prompt, salt="tenant-a")) == 0
    assert _cached(_complete(c, prompt, salt="tenant-b")) == 0
    assert _cached(_complete(c, prompt)) == 0  # no salt is a tenant of its own
    assert _cached(_complete(c, prompt, salt="tenant-a")) > 0
    messages = [{"role": "user", "content": tiny_chat.words(_words(rng, 300))}]
    assert _cached(_complete(c, messages, salt="x", chat=True)) == 0
    assert _cached(_complete(c, messages, salt="y", chat=True)) == 0
    assert _cached(_complete(c, messages, salt="x", chat=True)) > 0
    for salt in (5, "", ["a"], {"a": 1}):
        for path, body in (("/v1/completions", {"prompt": "w01 w02"}),
                           ("/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "w01"}]})):
            r = c.post(path, json={"model": "wide", "max_tokens": 2, "cache_salt": salt, **body})
            assert r.status_code == 400, (salt, r.text)
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["param"] == "cache_salt" and "cache_salt" in error["message"]


def test_cli_sizes_the_pool_for_data_shards_and_the_host_tier(wide, capsys):
    """Under `--mesh data=2,model=4` (the engine built by the CLI is captured, not run) the
    pool holds every row's longest request in its own data shard: 3 rows -> 4 slots, 2 per
    shard, of 64 / 16 = 4 pages each; the host tier's flags reach the engine and its line.
    (Serving on a mesh is `test_server.py`'s CLI test, on 8 devices.)"""
    import kvjax.serve

    built = {}

    def capture(model, params, **kwargs):
        built.update(kwargs)
        raise ValueError("captured")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kvjax.serve, "Engine", capture, raising=False)
        assert main(["serve", "--model", str(wide[0]), "--mesh", "data=2,model=4",
                     "--max-seqs", "3", "--max-seq-len", "64", "--page-size", "16"]) == 2
    assert "error: captured" in capsys.readouterr().err
    plan = built["cache"].plan
    assert dict(plan.mesh.shape) == {"data": 2, "model": 4}
    assert plan.strategies == ("sequences", "heads") and built["cache"].num_pages == 2 * 2 * 4
    _, err = _cli_app(["--model", str(wide[0]), "--host-pages", "32", "--max-seqs", "2",
                       "--max-seq-len", "64", "--page-size", "16", "--no-warmup"])
    assert "host tier of 32 pages, 4 rows" in err


@pytest.mark.parametrize("args, message", [
    (["--mesh", "data=2,fsdp=4"], "argument --mesh: expected AXIS=SIZE pairs"),
    (["--mesh", "model=0"], "argument --mesh: expected AXIS=SIZE pairs"),
    (["--mesh", "data=2,data=2"], "argument --mesh: expected AXIS=SIZE pairs"),
    (["--mesh", "data=4,model=4"], "error: --mesh data=4,model=4 needs 16 devices, but JAX "
                                   "sees 8"),
    (["--mesh", "data=2", "--host-pages", "8"], "error: --host-pages does not combine with "
                                                "--mesh"),
    (["--kv-memory", "1", "--num-pages", "8"], "error: give --num-pages or --kv-memory"),
    (["--kv-memory", "0"], "argument --kv-memory: expected a positive number"),
], ids=["unknown-axis", "zero-size", "repeated-axis", "too-many-devices", "host-tier",
        "pages-and-budget", "zero-budget"])
def test_bad_mesh_and_budget_flags_are_refused(wide, capsys, args, message):
    try:
        status = main(["serve", "--model", str(wide[0]), *args])
    except SystemExit as e:  # argparse's refusal of a flag's value
        status = e.code
    assert status == 2
    err = capsys.readouterr().err
    assert message in err, err
    if "AXIS=SIZE" in message:  # names what was given and what is expected
        assert repr(args[1]) in err and "data, model, context" in err


def test_budget_too_small_is_refused(wide, capsys):
    assert main(["serve", "--model", str(wide[0]), *KIVI, "--kv-memory", "0.0001"]) == 2
    err = capsys.readouterr().err
    assert "error: --kv-memory 0.0001 GiB does not cover the cache's fixed" in err, err
