"""benchmarks/serving.py: the work ceiling its --breakdown reports (the fewest decode steps
first-come first-served rows need, and the fitted costs of a lane and a step), and the
pieces of its --peer-vllm run that need no vLLM: argument checks, the streaming client
against a fake server, the latency statistics, the traces and the checkpoint."""

import http.server
import json
import sys
import threading
import time

import benchmark_cli
import jax
import numpy as np
import pytest


@pytest.fixture
def script(monkeypatch):
    return benchmark_cli.load(monkeypatch, "serving")


def _stepwise(max_new, rows):
    """Reference: step the rows one decode step at a time; a free row takes the next
    request (its first token comes from prefill, so it needs n - 1 steps)."""
    waiting = [max(n - 1, 0) for n in max_new]
    left = [0] * rows
    steps = 0
    while True:
        for r in range(rows):
            while left[r] == 0 and waiting:
                left[r] = waiting.pop(0)
        if not any(left):
            return steps
        left = [max(x - 1, 0) for x in left]
        steps += 1


def test_fcfs_steps_equal_a_step_by_step_schedule(script):
    rng = np.random.default_rng()
    for _ in range(20):
        rows = int(rng.integers(1, 9))
        max_new = rng.integers(1, 60, int(rng.integers(1, 40))).tolist()
        assert script.fcfs_decode_steps(max_new, rows) == _stepwise(max_new, rows)
    # One row runs everything back to back; enough rows run only the longest.
    assert script.fcfs_decode_steps([5, 7, 2], 1) == 4 + 6 + 1
    assert script.fcfs_decode_steps([5, 7, 2], 3) == 6


def test_call_costs_recover_the_lane_and_step_cost(script):
    rng = np.random.default_rng()
    lane, step = rng.uniform(3e-3, 9e-3), rng.uniform(0.5e-3, 1.5e-3)
    calls = [(int(k), int(s), k * lane + s * step + rng.normal(0, 1e-5))
             for k, s in zip(rng.integers(0, 5, 200), rng.integers(1, 64, 200), strict=True)]
    got_lane, got_step = script.call_costs(calls)
    np.testing.assert_allclose([got_lane, got_step], [lane, step], rtol=0.02)


# --peer-vllm: argument handling, the streaming client, the statistics, the checkpoint.


def test_peer_vllm_refuses_a_python_without_vllm(script, capsys, monkeypatch, tmp_path):
    def ran(args):
        raise AssertionError("the peer run started despite a bad --peer-vllm")

    monkeypatch.setattr(script, "peer_main", ran)
    # This test's Python has no vllm (vLLM's CPU build lives in its own environment).
    benchmark_cli.assert_refuses(script.main, capsys, ["--peer-vllm", sys.executable],
                                 sys.executable, "no vllm package")
    missing = str(tmp_path / "no-python")
    benchmark_cli.assert_refuses(script.main, capsys, ["--peer-vllm", missing], missing,
                                 "no such executable")
    benchmark_cli.assert_refuses(script.main, capsys, ["--peer-vllm", "x", "--quick"],
                                 "--quick")
    benchmark_cli.assert_refuses(script.main, capsys,
                                 ["--peer-vllm", "x", "--peer-rates", "1,-2"], "-2")
    benchmark_cli.assert_help_lists(script.main, capsys, ["--peer-vllm", "--peer-rates",
                                                          "--peer-dtype", "--peer-timeout"])


def test_text_ids_reads_any_spacing_of_the_vocabulary_words(script):
    rng = np.random.default_rng()
    ids = rng.integers(0, 32000, 50).tolist()
    seps = rng.choice(["", " ", "  ", "\n"], len(ids))
    text = "".join(s + script.vocab_word(i) for s, i in zip(seps, ids, strict=True))
    assert script.text_ids(text) == ids
    assert script.text_ids("") == []
    for bad in ("w0001", "w00012x3456", "x00012"):
        with pytest.raises(ValueError, match="streamed text"):
            script.text_ids(bad)


class _FakeServer(http.server.BaseHTTPRequestHandler):
    """Streams `plan` (lists of token ids, one per event) as OpenAI completion chunks in
    HTTP/1.1 chunked encoding, as uvicorn does; records each request body."""

    protocol_version = "HTTP/1.1"
    plan: list = []
    bodies: list = []
    finish = True
    cached = 0  # the usage chunk's cached prompt tokens (with stream_options.include_usage)

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        events = [{"choices": [{"text": "".join(" " + f"w{i:05d}" for i in ids)}]}
                  for ids in self.plan]
        events.append({"choices": [{"text": "", "finish_reason": "length"}]})
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]),
                                                    "prompt_tokens_details": {
                                                        "cached_tokens": self.cached}}})
        for e in events:
            self._chunk(f"data: {json.dumps(e)}\n\n".encode())
            self.wfile.flush()
        if self.finish:
            self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")

    def _chunk(self, data: bytes):
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

    def log_message(self, *args):
        pass


def test_stream_completion_reads_every_chunk_of_a_server(script):
    rng = np.random.default_rng()
    plan = [rng.integers(0, 32000, int(k)).tolist() for k in rng.integers(1, 6, 7)]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeServer)
    threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
    try:
        port = server.server_address[1]
        _FakeServer.plan, _FakeServer.bodies = plan, []
        prompt = rng.integers(0, 32000, 9).tolist()
        got = script.stream_completion(port, prompt, 23)
        assert got["ids"] == [t for ids in plan for t in ids]
        assert [k for _, k in got["chunks"]] == [len(ids) for ids in plan]
        times = [got["sent"]] + [t for t, _ in got["chunks"]]
        assert times == sorted(times)
        body = _FakeServer.bodies[0]
        assert (body["prompt"], body["max_tokens"], body["temperature"], body["stream"],
                body["model"]) == (prompt, 23, 0, True, script.PEER_NAME)
        assert "stream_options" not in body and got["cached_tokens"] is None
        # With usage: the final chunk (no choices) gives the prompt tokens found cached.
        _FakeServer.cached = int(rng.integers(1, 9))
        with_usage = script.stream_completion(port, prompt, 23, usage=True)
        assert _FakeServer.bodies[-1]["stream_options"] == {"include_usage": True}
        assert with_usage["ids"] == got["ids"]
        assert with_usage["cached_tokens"] == _FakeServer.cached
        _FakeServer.finish = False  # a stream cut short is an error, not a short answer
        with pytest.raises(RuntimeError, match=r"without \[DONE\]"):
            script.stream_completion(port, prompt, 23)
    finally:
        _FakeServer.finish = True
        server.shutdown()
        server.server_close()


def test_http_latency_by_hand(script):
    # Request a: sent at 0, 1 token at 1.0, 3 at 1.6, 1 at 1.7; request b: sent at 0.5,
    # 2 tokens at 2.0, 2 at 2.4.
    t0 = 0.0
    done = [dict(sent=0.0, ids=[1] * 5, chunks=[(1.0, 1), (1.6, 3), (1.7, 1)]),
            dict(sent=0.5, ids=[2] * 4, chunks=[(2.0, 2), (2.4, 2)])]
    got = script.http_latency(done, t0)
    assert got["tokens"] == 9
    np.testing.assert_allclose(got["tokens_per_s"], 9 / 2.4)
    np.testing.assert_allclose(got["ttft_s"], np.percentile([1.0, 1.5], [50, 90, 99]))
    itl = [0.2, 0.2, 0.2, 0.1, 0.2, 0.2]  # 0.6 s over 3 tokens, 0.1 over 1, 0.4 over 2
    np.testing.assert_allclose(got["itl_ms"], 1e3 * np.percentile(itl, [50, 90, 99]))
    np.testing.assert_allclose(got["chunk_gap_ms"],
                               1e3 * np.percentile([0.6, 0.1, 0.4], [50, 90, 99]))
    np.testing.assert_allclose(got["tokens_per_chunk"], (3 + 1 + 2) / 3)


def test_lognormal_trace_keeps_its_bounds_and_rate(script):
    rng = np.random.default_rng()
    arrivals, prompts, new = script.lognormal_trace(
        rng, 4000, rate=3.0, prompt=(200, 0.8, 16, 900), new=(50, 0.8, 8, 120), vocab=97)
    lens = np.array([len(p) for p in prompts])
    assert lens.min() >= 16 and lens.max() <= 900 and min(new) >= 8 and max(new) <= 120
    assert all(0 <= t < 97 for p in prompts[:50] for t in p)
    np.testing.assert_allclose(np.median(lens), 200, rtol=0.1)
    np.testing.assert_allclose(np.median(new), 50, rtol=0.1)
    gaps = np.diff(arrivals)
    assert arrivals[0] == 0 and gaps.min() >= 0
    np.testing.assert_allclose(gaps.mean(), 1 / 3.0, rtol=0.1)


def test_peer_checkpoint_loads_in_kvjax_and_its_tokenizer_matches_text_ids(
        script, monkeypatch, tmp_path):
    transformers = pytest.importorskip("transformers")
    import kvjax.models as models

    small = dict(script.PEER_MODEL, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=300)
    monkeypatch.setattr(script, "PEER_MODEL", small)
    count = script.save_peer_checkpoint(str(tmp_path), seed=int(np.random.SeedSequence(
        ).entropy % 2**31))
    model, params = models.load(str(tmp_path))
    c = model.config
    assert (c.num_layers, c.hidden_size, c.q_heads, c.kv_heads, c.head_dim, model.vocab_size) \
        == (2, 32, 4, 2, 8, 300)
    assert count == sum(x.size for x in jax.tree.leaves(params))
    # What AutoTokenizer builds from this directory (TokenizersBackend is that class in
    # transformers 5), without the torch import AutoTokenizer costs.
    with open(tmp_path / "tokenizer_config.json") as fh:
        assert getattr(transformers, json.load(fh)["tokenizer_class"]) is \
            transformers.PreTrainedTokenizerFast
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    ids = np.random.default_rng().integers(0, 300, 40).tolist()
    assert script.text_ids(tok.decode(ids)) == ids
    assert tok.encode(" ".join(script.vocab_word(i) for i in ids)) == ids
    assert tok.eos_token_id is None and tok.bos_token_id is None  # nothing ends a request


# --kivi: argument handling, the budget arithmetic, reading the servers' /metrics.


def test_kivi_flags_are_listed_and_checked(script, capsys, monkeypatch):
    def ran(args):
        raise AssertionError("the --kivi run started despite bad arguments")

    monkeypatch.setattr(script, "kivi_main", ran)
    for bad in ("0", "-1", "x", "inf"):
        benchmark_cli.assert_refuses(script.main, capsys, ["--kivi", bad], repr(bad),
                                     "positive number of GiB")
    benchmark_cli.assert_refuses(script.main, capsys, ["--kivi", "--peer-vllm", "x"],
                                 "--kivi", "--peer-vllm")
    benchmark_cli.assert_refuses(script.main, capsys, ["--kivi", "0.5", "--repeats", "0"],
                                 "--repeats 0")
    benchmark_cli.assert_refuses(script.main, capsys, ["--kivi-checks", "2"],
                                 "--kivi-checks", "go with --kivi")
    benchmark_cli.assert_help_lists(script.main, capsys, ["--kivi", "--kivi-max-seqs",
                                                          "--kivi-checks"])
    # Given: that budget; bare: None, the automatic one.
    got = []
    monkeypatch.setattr(script, "kivi_main", lambda args: got.append(args.kivi) or 0)
    assert script.main(["--kivi", "0.25"]) == 0 and script.main(["--kivi", "--quick"]) == 0
    assert got == [0.25, None]


def test_kivi_pools_fill_the_budget_by_the_caches_own_bytes(script):
    """The pages each server's budget holds, against the bytes kvjax.cache allocates for a
    cache of that many pages (and one more) built for the same slots and tails."""
    import kvjax.generate as gen
    from kvjax.cache.ops import cache_device_bytes
    from kvjax.specs import QuantSpec

    rng = np.random.default_rng()
    model = script.kivi_model(script.KIVI_QUICK_MODEL)
    group, residual = script.kivi_flag_defaults()
    page, max_seqs, max_len = 32, int(rng.integers(2, 6)), 416

    def device_bytes(bits, pages, chunk):
        quant = None if bits is None else QuantSpec(bits=bits, group_size=group,
                                                    residual=residual)
        cfg = gen.CacheConfig(dtype="bfloat16", quant=quant, page_size=page, num_pages=pages)
        return cache_device_bytes(cfg.spec(model, num_seqs=3 * max_seqs, max_tokens=max_len,
                                           chunk=chunk))

    tails = script.kivi_pool(model, 4, 0, page_size=page, max_seqs=max_seqs,
                             max_seq_len=max_len)["fixed_bytes"]
    budget = int(tails + rng.integers(40, 400) * 5000)
    pools = {bits: script.kivi_pool(model, bits, budget, page_size=page, max_seqs=max_seqs,
                                    max_seq_len=max_len) for bits in (None, 4)}
    for bits, pool in pools.items():
        n = pool["pages"]
        assert n > 0 and pool["slots"] == 3 * max_seqs
        assert device_bytes(bits, n, pool["chunk"]) <= budget < device_bytes(
            bits, n + 1, pool["chunk"]), (bits, pool)
        assert device_bytes(bits, n, pool["chunk"]) == pool["fixed_bytes"] + n * pool[
            "page_bytes"]
    bf16, int4 = pools[None], pools[4]
    # KIVI chunks reach quantized pages (prefix hits), and an int4 page (4-bit codes, a
    # 16-bit scale and zero per 32) costs under a third of a bf16 page.
    assert int4["chunk"] >= residual + page and bf16["chunk"] == 64
    assert 3 * int4["page_bytes"] < bf16["page_bytes"]


def test_kivi_trace_arithmetic_and_automatic_budget_by_hand(script):
    # Prefix 64 = 2 chunks of 32 = 4 pages of 16; requests of 80 and 114 tokens at their end.
    prompts, new = [[0] * 74, [0] * 94], [6, 20]
    bf16 = script.kivi_trace_pages(prompts, new, prefix=64, page_size=16, chunk=32,
                                   residual=0)
    assert bf16 == dict(shared=4, own_mean=2.5, own_max=4)  # 5 and 8 pages held
    # KIVI: (80 - 32) // 16 = 3 and (114 - 32) // 16 = 5 pages; the tails hold the rest.
    kivi = script.kivi_trace_pages(prompts, new, prefix=64, page_size=16, chunk=32,
                                   residual=32)
    assert kivi == dict(shared=4, own_mean=0.5, own_max=1)
    assert script.kivi_sequences(dict(pages=14), bf16, 8, 8) == 4.0  # (14 - 4) / 2.5
    assert script.kivi_sequences(dict(pages=14), bf16, 3, 8) == 3  # at most the requests
    pages = {"bf16": bf16, "int4": kivi}
    # bf16: 100 + 1000 x (4 + ceil(4 x 2.5)) = 14100; int4: 100 + 300 x max(4 + 1, 6) = 1900.
    pools = {"bf16": dict(fixed_bytes=100, page_bytes=1000, min_pages=5, slots=3),
             "int4": dict(fixed_bytes=100, page_bytes=300, min_pages=6, slots=3)}
    assert script.KIVI_BF16_SEQS == 4
    budget, why = script.kivi_auto_budget(pools, pages)
    assert budget == 14100 and "raised" not in why
    pools["int4"]["fixed_bytes"] = 50_000  # its tails alone exceed bf16's budget
    budget, why = script.kivi_auto_budget(pools, pages)
    assert budget == 51_800 and "raised" in why and "int4" in why


def test_kivi_hits_and_agreement_by_hand(script):
    done = [dict(cached_tokens=0), dict(cached_tokens=600), dict(cached_tokens=250)]
    # Up to the 512-token prefix in whole pages of 32: 0 + 16 + 7; two requests could hit.
    assert script.kivi_prefix_hits(done, prefix=512, page_size=32) == (23, 32)
    got = script.kivi_agreement([[1, 2, 3], [4, 5], [6]], [[1, 2, 3], [4, 9], [7]])
    assert got == dict(identical=1, requests=3, tokens_before_first_difference=4 / 6)
    # Streams decoding over [1, 3], [2, 4], [2.5, 2.6] and [5, 5]: three at once at 2.5.
    spans = [(1.0, 3.0), (2.0, 4.0), (2.5, 2.6), (5.0, 5.0)]
    done = [dict(chunks=[(a, 1)] + ([(b, 2)] if b > a else [])) for a, b in spans]
    assert script.stream_concurrency(done) == 3
    assert script.stream_concurrency(done[2:]) == 1


def test_kivi_reads_the_servers_metrics_registry(script):
    """`parse_metrics` on what kvjax.serve.metrics renders, and `MetricsPoller` against a
    server whose load changes at each scrape: peak and mean of what the polls saw."""
    from kvjax.serve.metrics import ENGINE_COUNTERS, ServerMetrics

    rng = np.random.default_rng()
    loads = [tuple(int(x) for x in rng.integers(0, 1000, 4)) for _ in range(6)]
    stats = {name: int(rng.integers(1, 10**6)) for name in ENGINE_COUNTERS}
    scrapes = [0]
    metrics = ServerMetrics(lambda: loads[min(scrapes[0], len(loads) - 1)], lambda: stats)
    done = int(rng.integers(1, 50))
    metrics.requests.labels(finish_reason="length").inc(done)
    got = script.parse_metrics(metrics.render().decode())
    assert got['kvjax_requests_total{finish_reason="length"}'] == done
    assert [got[k] for k in ("kvjax_requests_running", "kvjax_requests_waiting",
                             "kvjax_kv_pages_in_use", "kvjax_kv_pages_total")] == list(loads[0])
    assert all(got[f"kvjax_engine_{k}_total"] == v for k, v in stats.items())

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            body = metrics.render()
            scrapes[0] += 1
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
    try:
        with script.MetricsPoller(server.server_address[1], interval=0.001) as poller:
            while len(poller.polls) < len(loads) + 2:
                time.sleep(0.005)
    finally:
        server.shutdown()
        server.server_close()
    seen = np.array([loads[min(i, len(loads) - 1)] for i in range(len(poller.polls))])
    assert poller.summary() == dict(
        peak_running=seen[:, 0].max(), mean_running=seen[:, 0].mean(),
        peak_waiting=seen[:, 1].max(), peak_pages_in_use=seen[:, 2].max(),
        polls=len(seen))


def test_peer_runs_join_the_readme_table_newest_per_machine_and_dtype(tmp_path):
    """`benchmarks/report.py`'s vLLM rows: the newest `--peer-vllm` JSON per machine folder
    and dtype (an older one and a JSON of another benchmark ignored), with both servers'
    burst tokens/s and ratio, TTFT p90s, each Poisson rate's, the burst's identical tokens,
    the machine's AVX-512 flags, date and commit; the README summary carries them."""
    from benchmarks import report

    rng = np.random.default_rng()

    def peer(date, dtype, commit):
        def server():
            return dict(tokens_per_s=float(rng.uniform(100, 900)),
                        ttft_s=sorted(rng.uniform(0.05, 2.0, 3).tolist()))
        return dict(benchmark="serving-peer-vllm", dtype=dtype, date=date, kvjax_commit=commit,
                    requests=32, versions=dict(vllm="0.32.0"),
                    machine=dict(cpu="Some CPU", cpus=2, simd_flags=["avx2", "avx512f"]),
                    medians={t: dict(kvjax=server(), vllm=server())
                             for t in ("single", "burst", "poisson 2/s")},
                    tokens={"burst": [dict(identical=int(rng.integers(0, 33)), requests=32)]})

    folder = tmp_path / "benchmarks" / "results" / "cpu-some"
    folder.mkdir(parents=True)
    old, new = peer("2026-01-01T00:00:00", "float32", "aaa"), peer("2026-02-01T00:00:00",
                                                                    "float32", "bbb")
    (folder / "serving-vllm-old.json").write_text(json.dumps(old))
    (folder / "serving-vllm.json").write_text(json.dumps(new))
    (folder / "serving-vllm-other.json").write_text(json.dumps(dict(benchmark="other")))
    rows = report.peer_rows(tmp_path)
    assert len(rows) == 1
    measure, fig = rows[0]
    assert "Some CPU (avx512f; no avx512fp16), 2 cores" in measure
    m = new["medians"]
    k, v = m["burst"]["kvjax"], m["burst"]["vllm"]
    assert (f"float32: burst {k['tokens_per_s']:.0f} / {v['tokens_per_s']:.0f} tokens/s "
            f"({k['tokens_per_s'] / v['tokens_per_s']:.2f}x), TTFT p90 "
            f"{k['ttft_s'][1]:.2f} / {v['ttft_s'][1]:.2f} s") in fig
    k, v = m["poisson 2/s"]["kvjax"], m["poisson 2/s"]["vllm"]
    assert (f"poisson 2/s {k['tokens_per_s']:.0f} / {v['tokens_per_s']:.0f} tokens/s, TTFT "
            f"p90 {k['ttft_s'][1]:.2f} / {v['ttft_s'][1]:.2f} s") in fig
    assert f"identical {new['tokens']['burst'][0]['identical']}/32" in fig
    assert "2026-02-01, commit bbb" in fig and "aaa" not in fig
    run = json.loads((report.ROOT / "benchmarks/results/cpu-intel-2core/run.json").read_text())
    assert fig in report.summary(run, "x", tmp_path)
