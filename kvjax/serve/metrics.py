"""The server's Prometheus metrics (`GET /metrics`, text exposition format).

Each app owns its own `prometheus_client.CollectorRegistry`, so several apps in one
process (tests, a router in front of several engines) never share counters.

Counters: `kvjax_requests_total{finish_reason}` (requests that ended: "stop",
"length", "cancelled", "error", "timeout"), `kvjax_rejected_requests_total{status}`
(refused before the engine saw them: 401, 408, 413, 429, 503),
`kvjax_prompt_tokens_total`, `kvjax_generation_tokens_total`,
`kvjax_prefix_cache_hit_tokens_total`. Gauges (read off the engine thread's last
snapshot when scraped): `kvjax_requests_running`, `kvjax_requests_waiting`,
`kvjax_kv_pages_in_use`, `kvjax_kv_pages_total`. The engine's own counters
(`Engine.stats`, as its thread last saw them): `kvjax_engine_{name}_total` for each name
of `ENGINE_COUNTERS` (calls, decode steps, prefill tokens, prefix-hit pages, evictions,
preemptions, swaps, ...), and `kvjax_engine_restarts_total`: engines the server's worker
rebuilt after a failed step (`EngineWorker`). Histograms:
`kvjax_time_to_first_token_seconds` (arrival of the request to its first token),
`kvjax_inter_token_latency_seconds` (between a request's tokens: a group of k tokens
that arrives together counts k gaps of 1/k of the wait since the previous group; the
first group k - 1 gaps of 0, its wait being the TTFT) and
`kvjax_request_duration_seconds` (arrival to the last token).
"""

import prometheus_client
from prometheus_client.core import CounterMetricFamily

__all__ = ["ServerMetrics", "ENGINE_COUNTERS"]

# Engine.stats name -> help text.
ENGINE_COUNTERS = {
    "calls": "Step programs the engine ran.",
    "steps": "Decode steps the engine ran.",
    "prefill_tokens": "Prompt tokens prefilled (prefix hits excluded).",
    "prefill_chunks": "Prefill lanes run.",
    "hit_pages": "Prompt pages served from the prefix cache.",
    "evictions": "Cached prefixes evicted from the device pool.",
    "preemptions": "Requests preempted for recompute.",
    "swaps": "Requests swapped out to the host tier.",
    "swap_ins": "Requests swapped back in from the host tier.",
    "restarts": "Engines rebuilt after a failed step (its requests re-queued by recompute).",
}

# From a few milliseconds (a prefix hit on a short prompt) to minutes (a long queue).
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    120.0, float("inf"))
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                  float("inf"))


class _EngineCounters:
    """A collector reporting the engine's counters from its thread's last snapshot."""

    def __init__(self, stats):
        self._stats = stats

    def collect(self):
        stats = self._stats()
        for name, doc in ENGINE_COUNTERS.items():
            yield CounterMetricFamily(f"kvjax_engine_{name}", doc,
                                      value=float(stats.get(name, 0)))


class ServerMetrics:
    """The metrics of one app.

    Args:
      load: a callable returning `(running, waiting, pages_in_use, pages_total)`: the
        engine's load as last seen by its thread; called at each scrape.
      stats: a callable returning a mapping of the engine's counters (`Engine.stats`) as
        last seen by its thread; called at each scrape.
    """

    def __init__(self, load, stats):
        self.registry = prometheus_client.CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = prometheus_client.Counter(
            "kvjax_requests", "Requests that ended, by finish reason.", ["finish_reason"],
            registry=r)
        self.rejected = prometheus_client.Counter(
            "kvjax_rejected_requests", "Requests refused before reaching the engine, by HTTP "
            "status.", ["status"], registry=r)
        self.prompt_tokens = prometheus_client.Counter(
            "kvjax_prompt_tokens", "Prompt tokens of requests the engine took.", registry=r)
        self.generation_tokens = prometheus_client.Counter(
            "kvjax_generation_tokens", "Tokens generated.", registry=r)
        self.cached_tokens = prometheus_client.Counter(
            "kvjax_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.",
            registry=r)
        self.ttft = prometheus_client.Histogram(
            "kvjax_time_to_first_token_seconds", "From a request's arrival to its first "
            "generated token.", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = prometheus_client.Histogram(
            "kvjax_inter_token_latency_seconds", "Between one request's tokens.",
            buckets=_TOKEN_BUCKETS, registry=r)
        self.duration = prometheus_client.Histogram(
            "kvjax_request_duration_seconds", "From a request's arrival to its last token.",
            buckets=_LATENCY_BUCKETS, registry=r)
        for i, (name, doc) in enumerate((
                ("kvjax_requests_running", "Requests holding a decoding row."),
                ("kvjax_requests_waiting", "Requests queued for a row (or preempted)."),
                ("kvjax_kv_pages_in_use", "KV pool pages referenced by sequences or cached "
                 "prefixes."),
                ("kvjax_kv_pages_total", "Pages in the KV pool."))):
            prometheus_client.Gauge(name, doc, registry=r).set_function(
                lambda i=i: float(load()[i]))

        r.register(_EngineCounters(stats))

    def render(self) -> bytes:
        """The registry in Prometheus' text format."""
        return prometheus_client.generate_latest(self.registry)

    content_type = prometheus_client.CONTENT_TYPE_LATEST
