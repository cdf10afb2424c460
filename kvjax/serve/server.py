"""An OpenAI-compatible HTTP server over the continuous-batching `Engine`.

    app = create_app(engine, tokenizer, model_name="tiny-llama", api_key=key,
                     request_timeout=600, max_waiting=64)
    DrainingServer(uvicorn.Config(app, host="127.0.0.1", port=8000)).run()

Endpoints:
  * `GET /health`: `{"status": "ok"}` (503 once the engine has failed);
  * `GET /v1/models`: the one served model, in OpenAI's list format;
  * `POST /v1/completions`: a prompt given as text or token ids;
  * `POST /v1/chat/completions`: messages rendered by the tokenizer's chat template;
  * `POST /tokenize`, `POST /detokenize`: the tokenizer, in vLLM's request and response
    shapes (`{"prompt"}` or `{"messages"}` -> `{"count", "max_model_len", "tokens"}`;
    `{"tokens"}` -> `{"prompt"}`);
  * `GET /metrics`: Prometheus text format (`kvjax.serve.metrics`).

Both generation endpoints take `max_tokens`, `temperature`, `top_p`, `top_k` (an
extension), `seed`, `stop`, `stream` (server-sent events in OpenAI's chunk
format, ending with `data: [DONE]`; `stream_options.include_usage` adds a final
usage chunk), `cache_salt` (vLLM's extension: a non-empty string; requests
share cached prefix pages only with requests of the same salt, so tenants with
different salts never hit each other's prompts), `n` (1 to 8 choices: n engine
requests added together, the later ones sharing the first one's prompt pages through
the prefix cache; choice i samples with seed + i * `_CHOICE_SEED_STRIDE`) and
log-probabilities (completions: `logprobs` 0 to 20; chat: `logprobs: true` and
`top_logprobs` 0 to 20): each token's log-softmax of the model's raw logits (before
temperature, top-k and top-p) and the most likely tokens', in OpenAI's shapes, each
streamed chunk with its own tokens'. Responses carry `usage` (the prompt once, every
choice's completion tokens; `prompt_tokens_details.cached_tokens` from the prefix
cache) and `finish_reason` ("stop" or "length"). Bad requests get
a 4xx answer in OpenAI's error shape, `{"error": {"message", "type", "param",
"code"}}`; fields this server does not implement (`best_of` > 1, `echo`, `suffix`,
penalties, `logit_bias`, tools, `response_format`) are refused rather than silently
ignored.

Limits, checked in this order before a handler runs (`_Gate`, a plain ASGI middleware):
a server that is draining answers 503 (`/health` and `/metrics` stay open); with an API
key, a request without `Authorization: Bearer KEY` gets a 401 (`/health` and `/metrics`
stay open); a body longer than `max_request_bytes` gets a 413 -- from its Content-Length
header before any byte is read, or as soon as a chunked body passes the limit, never
buffering more than the limit; a body not received within `request_timeout` gets a 408.
Then, before tokenizing, a text prompt longer than `max_prompt_chars` characters is
refused (400, `context_length_exceeded`) without being tokenized. Tokenization, the chat
template and detokenization run in a thread pool, never on the event loop, so a large
prompt does not hold other requests. A request still unfinished `request_timeout`
seconds after it arrived is cancelled and answered 408 (a stream ends with an error
event). With `max_waiting`, a request that would make more than `max_seqs + max_waiting`
requests unfinished at once is refused with a 429 (a request with `n` choices counts
as n).

Draining (`DrainingServer`, what `python -m kvjax serve` runs): SIGTERM or SIGINT stops
admitting (new connections are refused, requests on open connections get a 503, `/health`
says "draining" with a 503), lets every request in flight finish, then stops the engine
and exits; a second signal, or uvicorn's `timeout_graceful_shutdown` (`--drain-timeout`),
cuts the drain short.

Threading: the engine is not thread-safe, so one thread (`EngineWorker`) owns it.
Request handlers, on the event loop, hand `add_request` / `cancel` commands to that
thread through a thread-safe queue; the thread runs `engine.step()` while any
request is unfinished and passes each request's outputs back to its handler's
`asyncio.Queue` with `loop.call_soon_threadsafe`. A client that disconnects
cancels its request. A step that raises is survived: the engine's state (its donated
cache) is not trusted after it, so the thread rebuilds the engine from its params and
options (`Engine.rebuilt`) and re-queues every unfinished request, recomputed from its
prompt and the tokens its client already has; clients see no error and the same
tokens, and `kvjax_engine_restarts_total` counts the rebuilds. If the rebuild fails,
or steps keep failing (`EngineWorker.max_restarts` within `restart_window`), every
waiting request fails with a 500, the server is marked unhealthy and the thread ends.

Stop strings: a stop string that encodes to exactly one token also becomes a stop
id of the request (the engine ends it at that token); every stop string is also
matched on the decoded text, host-side, so a stop string spanning several tokens,
or inside a longer token, ends the completion too. The stopping token or string is
not part of the returned text, and neither is an EOS token.
"""

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import hmac
import json
import logging
import queue
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing, asynccontextmanager
from typing import Any

import fastapi
import jax
import numpy as np
import pydantic
import uvicorn
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvjax.serve.metrics import ServerMetrics

__all__ = ["create_app", "DrainingServer", "EngineWorker", "EngineError", "QueueFullError"]

_log = logging.getLogger("kvjax.serve")

# Completions without max_tokens get OpenAI's default; chat completions get the room left.
_DEFAULT_COMPLETION_TOKENS = 16
# Text prompts longer than max_seq_len * this many characters are refused untokenized: no
# tokenizer this server meets averages more characters per token over a whole prompt
# (English text averages about 4), so such a prompt cannot fit.
_CHARS_PER_TOKEN_BOUND = 32
# Paths served without an API key and while draining: probes and scrapes.
_OPEN_PATHS = ("/health", "/metrics")


class EngineError(RuntimeError):
    """The engine failed (or stopped) while a request was waiting on it: a 500."""


class QueueFullError(RuntimeError):
    """As many requests as the worker's capacity are unfinished: a 429."""


class _RequestTimeout(Exception):
    """A request outlived the server's request timeout: a 408."""


class _APIError(Exception):
    """A request the server refuses, answered in OpenAI's error shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status, message, param, code, type)


def _error_response(status: int, message: str, *, type: str = "invalid_request_error",
                    param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {
        "message": message, "type": type, "param": param, "code": code}})


# ----------------------------------------------------------------------------- engine thread


@dataclasses.dataclass
class _Sink:
    """Where one request's outputs go: a queue on the event loop of its handler."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    added: asyncio.Future  # resolves to the request id, or to add_request's exception

    def _call(self, fn, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    def resolve(self, value) -> None:
        def set_result(fut=self.added):
            if not fut.done():
                fut.set_result(value)
        self._call(set_result)

    def reject(self, exc: BaseException) -> None:
        def set_exception(fut=self.added):
            if not fut.done():
                fut.set_exception(exc)
        self._call(set_exception)

    def put(self, item) -> None:
        self._call(self.queue.put_nowait, item)


_STOP = object()


class EngineWorker:
    """Owns an engine in one background thread; event-loop code talks to it by commands.

    A step that raises does not fail the requests: the worker logs it, replaces the engine
    by `Engine.rebuilt` (a fresh engine from the same params and options, every unfinished
    request queued again and recomputed from its prompt and the tokens its client already
    has) and goes on; each client keeps its stream and gets the tokens an unfailed run
    would have given. Only when the rebuild fails, or more than `max_restarts` steps fail
    within `restart_window` seconds, does the worker give up: every waiting request fails
    (a 500) and the server stays unhealthy.

    Args:
      engine: a `kvjax.serve.Engine`. After `start()`, only the worker's thread touches it
        (and the engines that replace it).
      max_restarts: rebuilds allowed within `restart_window` seconds (>= 0).
      restart_window: seconds over which failed steps count against `max_restarts`.
    """

    def __init__(self, engine, *, max_restarts: int = 3, restart_window: float = 60.0):
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or (
                max_restarts < 0):
            raise ValueError(f"max_restarts must be an int >= 0, got {max_restarts!r}.")
        if not restart_window > 0:
            raise ValueError(f"restart_window must be a positive number of seconds, got "
                             f"{restart_window!r}.")
        self.engine = engine
        self.max_restarts = max_restarts
        self.restart_window = float(restart_window)
        self._failures: collections.deque[float] = collections.deque()  # monotonic times
        self._restarts = 0
        # Tokens handed to each unfinished request's sink (what its client has).
        self._delivered: dict[str, int] = {}
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # Touched by the worker's thread only: commands taken off the queue but not yet
        # handled, and the sinks of unfinished requests.
        self._pending: collections.deque = collections.deque()
        self._sinks: dict[str, _Sink] = {}
        self._lock = threading.Lock()  # orders submissions against failure and shutdown
        self._error: str | None = None
        self._thread: threading.Thread | None = None
        self._unfinished = 0  # submitted and not finished, refused or failed; under _lock
        self._num_pages = int(engine.spec.num_pages)
        self._load = (0, 0, 0, self._num_pages)
        self._stats: dict[str, int] = {}

    @property
    def unfinished(self) -> int:
        """Requests submitted that have not finished (or been refused, or failed) yet."""
        return self._unfinished

    def load(self) -> tuple[int, int, int, int]:
        """`(running, waiting, pages_in_use, pages_total)` as the engine's thread last saw
        them (after its last step)."""
        return self._load

    def stats(self) -> dict[str, int]:
        """The engine's counters (`Engine.stats`, carried over rebuilds) after its thread's
        last step, and `restarts`: engines rebuilt after a failed step."""
        return self._stats

    def _done(self, n: int = 1) -> None:
        with self._lock:
            self._unfinished = max(0, self._unfinished - n)

    def _observe(self) -> None:
        engine = self.engine
        free = int(np.min(jax.device_get(engine.state.cache.table.num_free)))
        self._load = (engine.num_running, engine.num_waiting, self._num_pages - free,
                      self._num_pages)
        self._stats = dict(engine.stats) | {"restarts": self._restarts}

    @property
    def error(self) -> str | None:
        """Why the worker stopped serving (an engine exception or shutdown), or None."""
        return self._error

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("EngineWorker.start() was already called.")
        self._thread = threading.Thread(target=self._run, name="kvjax-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Fails the waiting requests with "shutting down" and ends the thread."""
        if self._thread is None:
            return
        self._commands.put(_STOP)
        self._thread.join(timeout)

    async def submit(self, prompt_ids: list[int], *, request_id: str,
                     capacity: int | None = None, **kwargs) -> asyncio.Queue:
        """Adds a request; returns the queue its `RequestOutput`s arrive on.

        The queue receives `RequestOutput`s up to a finished one, or an `EngineError`.

        Args:
          prompt_ids: the prompt's token ids.
          request_id: a unique id.
          capacity: refuse the request if this many are unfinished already (None: no
            bound).
          **kwargs: `Engine.add_request`'s other arguments.

        Raises:
          ValueError / TypeError: the engine refused the request (`add_request`'s message).
          QueueFullError: `capacity` requests are unfinished.
          EngineError: the engine has failed or the server is shutting down.
        """
        return (await self.submit_group(prompt_ids, [(request_id, kwargs)],
                                        capacity=capacity))[0]

    async def submit_group(self, prompt_ids: list[int],
                           requests: Sequence[tuple[str, dict[str, Any]]], *,
                           capacity: int | None = None) -> list[asyncio.Queue]:
        """Adds requests on one prompt (a request's `n` choices), all or none, in order and
        in one engine step's admission, so the later ones can share the first one's prompt
        pages; returns their queues (as `submit`'s).

        Args:
          prompt_ids: the prompt's token ids.
          requests: (unique id, `Engine.add_request`'s other arguments) per request.
          capacity: refuse them all if fewer than `len(requests)` more may be unfinished.

        Raises:
          as `submit`; when the engine refuses one, none is added.
        """
        loop = asyncio.get_running_loop()
        group = [(rid, kwargs, _Sink(loop=loop, queue=asyncio.Queue(),
                                     added=loop.create_future()))
                 for rid, kwargs in requests]
        with self._lock:
            if self._error is not None:
                raise EngineError(self._error)
            if self._thread is None:
                raise EngineError("the engine worker is not running (EngineWorker.start()).")
            if capacity is not None and self._unfinished + len(group) > capacity:
                raise QueueFullError(
                    f"{self._unfinished} requests are running or waiting and this one adds "
                    f"{len(group)}; this server queues at most {capacity}. Retry later.")
            self._unfinished += len(group)
            self._commands.put(("add", prompt_ids, group))
        got = await asyncio.gather(*(sink.added for _, _, sink in group), return_exceptions=True)
        for g in got:
            if isinstance(g, BaseException):
                raise g
        return [sink.queue for _, _, sink in group]

    def cancel(self, request_id: str) -> None:
        """Cancels a request at the engine's next step (no-op once it has finished)."""
        self._commands.put(("cancel", request_id))

    def _run(self) -> None:
        try:
            while True:
                engine = self.engine
                # Block for work when idle; otherwise take what arrived and step.
                if not (engine.has_unfinished() or self._sinks):
                    self._pending.append(self._commands.get())
                while True:
                    try:
                        self._pending.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
                while self._pending:
                    command = self._pending.popleft()
                    if command is _STOP:
                        self._fail("the server is shutting down")
                        return
                    self._handle(command)
                if engine.has_unfinished():
                    try:
                        outs = engine.step()
                    except Exception as e:
                        if self._recover(e):
                            continue
                        raise  # the step's failure goes to every waiting client
                    for out in outs:
                        sink = self._sinks.get(out.request_id)
                        if sink is None:
                            continue
                        sink.put(out)
                        self._delivered[out.request_id] = (
                            self._delivered.get(out.request_id, 0) + len(out.token_ids))
                        if out.finished:
                            del self._sinks[out.request_id]
                            self._delivered.pop(out.request_id, None)
                            self._done()
                elif self._sinks:  # the engine has nothing left for them: never wait forever
                    for rid in list(self._sinks):
                        self._sinks.pop(rid).put(EngineError(
                            f"the engine dropped request {rid} without finishing it"))
                        self._delivered.pop(rid, None)
                        self._done()
                self._observe()
        except BaseException as e:  # every failure must reach the waiting clients
            _log.exception("the engine failed; failing every waiting request")
            self._fail(f"the engine failed: {type(e).__name__}: {e}")

    def _recover(self, error: Exception) -> bool:
        """Replaces the engine after its step raised `error`: a rebuilt engine takes every
        unfinished request, each cut to the tokens its client has. False (the worker then
        fails every request) when the failures within `restart_window` exceed
        `max_restarts`, or when the rebuild fails."""
        now = time.monotonic()
        while self._failures and now - self._failures[0] > self.restart_window:
            self._failures.popleft()
        self._failures.append(now)
        if len(self._failures) > self.max_restarts:
            _log.error("engine step failed %d times in %.0f s; giving up",
                       len(self._failures), self.restart_window)
            return False
        _log.error("engine step failed; rebuilding the engine and re-queuing %d requests",
                   len(self._sinks), exc_info=error)
        try:
            self.engine = self.engine.rebuilt(delivered=dict(self._delivered))
        except Exception:
            _log.exception("rebuilding the engine failed; giving up")
            return False
        self._restarts += 1
        self._observe()
        return True

    def _handle(self, command) -> None:
        if command[0] == "add":
            _, prompt_ids, group = command
            added = []
            for rid, kwargs, _ in group:
                try:
                    self.engine.add_request(prompt_ids, request_id=rid, **kwargs)
                except Exception as e:
                    if isinstance(e, ValueError | TypeError):  # a bad request
                        error = e
                    else:  # one request's 500; the engine goes on
                        _log.exception("add_request failed")
                        error = EngineError(f"the engine could not add the request: "
                                            f"{type(e).__name__}: {e}")
                    for other in added:  # all or none: the ones added end unheard
                        self.engine.cancel(other)
                    self._done(len(group))
                    for _, _, sink in group:
                        sink.reject(error)
                    return
                added.append(rid)
            for rid, _, sink in group:
                self._sinks[rid] = sink
                sink.resolve(rid)
        elif command[0] == "cancel":
            if command[1] in self._sinks:
                self.engine.cancel(command[1])

    def _fail(self, message: str) -> None:
        with self._lock:
            self._error = message
            self._unfinished = 0
        error = EngineError(message)
        for sink in self._sinks.values():
            sink.put(error)
        self._sinks.clear()
        self._delivered.clear()
        while True:  # commands taken but not handled, and those that arrived since
            try:
                self._pending.append(self._commands.get_nowait())
            except queue.Empty:
                break
        for command in self._pending:
            if command is not _STOP and command[0] == "add":
                for _, _, sink in command[2]:
                    sink.reject(error)
        self._pending.clear()


# ----------------------------------------------------------------------------- the gate


def _error_body(message: str, type: str, code: str | None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type, "param": None,
                                 "code": code}}).encode()


class _BodyTooLarge(Exception):
    pass


class _Gate:
    """ASGI middleware: draining, the API key, the body's size and arrival time, before
    the app (FastAPI) parses anything.

    A body that passes is read whole (at most `max_bytes`) and replayed to the app; later
    `receive` calls (disconnect detection) go to the client as before. Each request's
    arrival time and deadline go into its ASGI scope (`kvjax.arrival`, `kvjax.deadline`).
    """

    def __init__(self, app, *, api_key: str | None, max_bytes: int,
                 timeout: float | None, metrics: ServerMetrics, draining):
        self.app = app
        self.api_key = None if api_key is None else api_key.encode()
        self.max_bytes = max_bytes
        self.timeout = timeout
        self.metrics = metrics
        self.draining = draining  # () -> bool

    async def _refuse(self, send, status: int, message: str, *, type: str, code: str,
                      headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
        self.metrics.rejected.labels(status=str(status)).inc()
        body = _error_body(message, type, code)
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            *headers]})
        await send({"type": "http.response.body", "body": body})

    async def _read(self, receive) -> bytes | None:
        """The whole body, or None if the client left; `_BodyTooLarge` past the limit."""
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            if len(body) + len(chunk) > self.max_bytes:
                raise _BodyTooLarge
            body += chunk
            if not message.get("more_body", False):
                return bytes(body)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        arrival = time.monotonic()
        scope["kvjax.arrival"] = arrival
        scope["kvjax.deadline"] = None if self.timeout is None else arrival + self.timeout
        path = scope.get("path", "")
        if path not in _OPEN_PATHS:
            if self.draining():
                return await self._refuse(
                    send, 503, "The server is shutting down and takes no new requests.",
                    type="server_error", code="draining", headers=[(b"connection", b"close")])
            if self.api_key is not None and not self._authorized(scope):
                return await self._refuse(
                    send, 401, "Incorrect or missing API key: send the header "
                    "'Authorization: Bearer <key>' with the server's --api-key.",
                    type="invalid_request_error", code="invalid_api_key",
                    headers=[(b"www-authenticate", b"Bearer")])
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        too_large = (f"The request body is larger than this server's limit of "
                     f"{self.max_bytes} bytes (--max-request-bytes).")
        length = dict(scope.get("headers", ())).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(send, 413, too_large + f" It declared {int(length)}.",
                                      type="invalid_request_error", code="request_too_large",
                                      headers=[(b"connection", b"close")])
        try:
            body = await asyncio.wait_for(self._read(receive), self.timeout)
        except _BodyTooLarge:
            # Closing the connection stops the rest of the body; nothing more is read.
            return await self._refuse(send, 413, too_large, type="invalid_request_error",
                                      code="request_too_large",
                                      headers=[(b"connection", b"close")])
        except TimeoutError:
            return await self._refuse(
                send, 408, f"The request body did not arrive within the server's "
                f"{self.timeout:g} s request timeout (--request-timeout).",
                type="invalid_request_error", code="request_timeout",
                headers=[(b"connection", b"close")])
        if body is None:  # the client left
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()
        await self.app(scope, replay, send)

    def _authorized(self, scope) -> bool:
        value = dict(scope.get("headers", ())).get(b"authorization", b"")
        scheme, _, key = value.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(), self.api_key)


# ----------------------------------------------------------------------------- requests


class _Body(pydantic.BaseModel):
    """Fields shared by both generation endpoints (OpenAI's names and defaults)."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's field: requests share cached prefix pages only with the same salt.
    cache_salt: str | None = None


class CompletionRequest(_Body):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None


class ChatMessage(pydantic.BaseModel):
    # Other fields (name, tool_call_id, ...) pass through to the chat template.
    model_config = pydantic.ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Body):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None


# field -> values that mean "not used"; anything else is refused with a 400.
_UNSUPPORTED = {
    "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
    "presence_penalty": (None, 0.0), "frequency_penalty": (None, 0.0), "logit_bias": (None, {}),
    "tools": (None, []), "response_format": (None, {"type": "text"}),
}
# Most choices per request (`n`) and most top logprobs per token (vLLM's bound; the
# engine records `kvjax.serve.steps.TOP_LOGPROBS`).
_MAX_N = 8
_MAX_TOP_LOGPROBS = 20
# Choice i > 0 of a request samples with seed + i * this (mod 2**64): distinct per choice,
# and choice 0 is what the same request with n=1 gives.
_CHOICE_SEED_STRIDE = 0x9E3779B97F4A7C15


def _check_top(value, param: str) -> int:
    if isinstance(value, bool) or not 0 <= value <= _MAX_TOP_LOGPROBS:
        raise _APIError(400, f"{param} must be an integer in [0, {_MAX_TOP_LOGPROBS}], got "
                        f"{value!r}.", param=param)
    return value


def _completion_logprobs(body: "CompletionRequest") -> int | None:
    """The top logprobs a completion asks for per token (`logprobs`), None if none."""
    return None if body.logprobs is None else _check_top(body.logprobs, "logprobs")


def _chat_logprobs(body: "ChatCompletionRequest") -> int | None:
    """The top logprobs a chat completion asks for per token (`top_logprobs`, with
    `logprobs: true`), None if none."""
    if body.top_logprobs is not None and not body.logprobs:
        raise _APIError(400, f"top_logprobs={body.top_logprobs} needs logprobs=true.",
                        param="top_logprobs")
    if not body.logprobs:
        return None
    return 0 if body.top_logprobs is None else _check_top(body.top_logprobs, "top_logprobs")


@dataclasses.dataclass(frozen=True)
class _Plan:
    """A validated request, ready for the engine."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: Any  # kvjax.generate.SamplingConfig
    stop_ids: tuple[int, ...]
    stops: tuple[str, ...]
    seed: int
    stream: bool
    include_usage: bool
    salt: str | None = None  # the prefix cache's salt (cache_salt)
    logprobs: int | None = None  # top logprobs per token (None: no logprobs)
    n: int = 1  # choices
    arrival: float = 0.0  # time.monotonic() when the request arrived
    deadline: float | None = None  # time.monotonic() by which it must end (None: never)


@dataclasses.dataclass(frozen=True)
class _TokenLogprob:
    """One token's logprobs as the endpoints show them: its text, log-probability, offset
    in the choice's text, and the top (text, log-probability) pairs, most likely first."""

    text: str
    logprob: float
    offset: int
    top: list[tuple[str, float]]


class _TextStream:
    """A request's new token ids -> the text to send: incremental detokenization plus
    host-side stop strings.

    Decodes a small window (the tokens since the last complete piece of text) rather than
    the whole completion each step; holds back text that may end in an incomplete UTF-8
    character (U+FFFD) and, while stop strings are set, the last `len(longest stop) - 1`
    characters, which could be the start of one.
    """

    def __init__(self, tokenizer, stops: Sequence[str]):
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = self._read = 0  # window start; end of the ids already decoded
        self._text = ""
        self._sent = 0
        self._stops = tuple(stops)
        self._hold = max(map(len, self._stops), default=1) - 1
        self.stopped = False  # a stop string was found

    @property
    def decoded_chars(self) -> int:
        """Characters of text decoded so far (sent or held back)."""
        return len(self._text)

    def _decode(self, ids) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def feed(self, ids: Sequence[int], *, final: bool) -> str:
        """Takes new token ids; returns the new text that is safe to send."""
        self._ids.extend(ids)
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self._text += after[len(before):]
            self._prefix, self._read = self._read, len(self._ids)
        end = len(self._text) if final else max(self._sent, len(self._text) - self._hold)
        if self._stops:
            start = max(0, self._sent - self._hold)
            hits = [i for s in self._stops if (i := self._text.find(s, start)) >= 0]
            if hits:
                self.stopped = True
                end = max(self._sent, min(hits))
        delta, self._sent = self._text[self._sent:end], end
        return delta


# ----------------------------------------------------------------------------- the app


class _Server:
    def __init__(self, worker: EngineWorker, tokenizer, model_name: str, *,
                 max_prompt_chars: int, capacity: int | None, metrics: ServerMetrics):
        self.worker = worker
        self.engine = worker.engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.created = int(time.time())
        self.max_prompt_chars = max_prompt_chars
        self.capacity = capacity
        self.metrics = metrics
        # Tokenizing and detokenizing happen here, off the event loop.
        self.pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=4, thread_name_prefix="kvjax-tokenizer")
        self._token_texts: dict[int, str] = {}

    async def off_loop(self, fn, *args, **kwargs):
        """`fn(*args, **kwargs)` in the tokenizer pool; its exceptions propagate."""
        return await asyncio.get_running_loop().run_in_executor(
            self.pool, functools.partial(fn, *args, **kwargs))

    async def prepare(self, request: fastapi.Request, fn) -> "_Plan":
        """Runs `fn() -> _Plan` (tokenization, validation) off the event loop and stamps the
        plan with the request's arrival and deadline."""
        plan = await self.off_loop(fn)
        return dataclasses.replace(plan, arrival=request.scope.get("kvjax.arrival", 0.0),
                                   deadline=request.scope.get("kvjax.deadline"))

    def check_chars(self, n: int, param: str) -> None:
        """Refuses text that cannot fit in `max_seq_len` tokens before tokenizing it."""
        if n > self.max_prompt_chars:
            raise _APIError(400, f"The {param} has {n} characters; this server holds at most "
                            f"{self.engine.max_seq_len} tokens per sequence and refuses text "
                            f"longer than {self.max_prompt_chars} characters untokenized. "
                            f"Shorten it.", param=param, code="context_length_exceeded")

    # -- validation

    def check_model(self, body: _Body) -> None:
        if body.model != self.model_name:
            raise _APIError(404, f"The model {body.model!r} does not exist; this server serves "
                            f"{self.model_name!r}.", param="model", code="model_not_found")

    def plan(self, body: _Body, prompt_ids: list[int], *, max_tokens: int | None,
             max_tokens_param: str, default_max_tokens: int | None,
             prompt_param: str, logprobs: int | None = None) -> _Plan:
        from kvjax.generate import SamplingConfig

        for name, unused in _UNSUPPORTED.items():
            value = getattr(body, name, None)
            if value not in unused:
                raise _APIError(400, f"{name}={value!r} is not supported by this server.",
                                param=name, code="unsupported_parameter")
        n = 1 if body.n is None else body.n
        if not 1 <= n <= _MAX_N:
            raise _APIError(400, f"n must be an integer in [1, {_MAX_N}], got {n}.", param="n")
        if not prompt_ids:
            raise _APIError(400, f"The {prompt_param} is empty; give at least one token.",
                            param=prompt_param)
        limit, length = self.engine.max_seq_len, len(prompt_ids)
        if max_tokens is not None and max_tokens < 1:
            raise _APIError(400, f"{max_tokens_param} must be at least 1, got {max_tokens}.",
                            param=max_tokens_param)
        if length >= limit:
            raise _APIError(400, f"This server holds at most {limit} tokens per sequence "
                            f"(prompt + completion); the {prompt_param} alone has {length} tokens. "
                            f"Shorten it.", param=prompt_param, code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = limit - length if default_max_tokens is None else min(
                default_max_tokens, limit - length)
        elif length + max_tokens > limit:
            raise _APIError(400, f"This server holds at most {limit} tokens per sequence, but "
                            f"this request asks for {length + max_tokens} ({length} in the "
                            f"{prompt_param} + {max_tokens} to generate). Shorten the "
                            f"{prompt_param} or lower {max_tokens_param}.",
                            param=max_tokens_param, code="context_length_exceeded")
        temperature = 1.0 if body.temperature is None else body.temperature
        if not temperature >= 0:
            raise _APIError(400, f"temperature must be >= 0, got {temperature}.",
                            param="temperature")
        if body.top_p is not None and not 0 < body.top_p <= 1:
            raise _APIError(400, f"top_p must lie in (0, 1], got {body.top_p}.", param="top_p")
        if body.top_k is not None and body.top_k < 1:
            raise _APIError(400, f"top_k must be at least 1 (or absent), got {body.top_k}.",
                            param="top_k")
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or ())
        if any(not s for s in stops):
            raise _APIError(400, "stop strings must not be empty.", param="stop")
        stop_ids = set()
        for s in stops:
            ids = self.tokenizer.encode(s, add_special_tokens=False)
            if len(ids) == 1:
                stop_ids.add(ids[0])
        options = body.stream_options or {}
        if options and not body.stream:
            raise _APIError(400, "stream_options needs stream=true.", param="stream_options")
        if set(options) - {"include_usage"}:
            raise _APIError(400, f"stream_options supports only include_usage, got "
                            f"{sorted(options)}.", param="stream_options")
        if body.seed is not None and not 0 <= body.seed < 2**64:
            raise _APIError(400, f"seed must be an integer in [0, 2**64), got {body.seed}.",
                            param="seed")
        seed = secrets.randbits(31) if body.seed is None else body.seed
        if body.cache_salt is not None and not body.cache_salt:
            raise _APIError(400, "cache_salt must be a non-empty string (or absent).",
                            param="cache_salt")
        return _Plan(prompt_ids=prompt_ids, max_tokens=max_tokens,
                     sampling=SamplingConfig(temperature=temperature, top_k=body.top_k,
                                             top_p=body.top_p),
                     stop_ids=tuple(sorted(stop_ids)), stops=tuple(stops), seed=seed,
                     stream=bool(body.stream),
                     include_usage=bool(options.get("include_usage", False)),
                     salt=body.cache_salt, logprobs=logprobs, n=n)

    def completion_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise _APIError(400, f"A list of {len(prompt)} prompts is not supported; send "
                                "one request per prompt.", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            self.check_chars(len(prompt), "prompt")
            return self.tokenizer.encode(prompt, add_special_tokens=True) if prompt else []
        return list(prompt)

    def chat_prompt(self, messages: list[ChatMessage], *,
                    add_generation_prompt: bool = True) -> list[int]:
        if not messages:
            raise _APIError(400, "messages is empty; give at least one message.",
                            param="messages")
        rendered = []
        for m in messages:
            d = m.model_dump(exclude_none=True)
            if isinstance(m.content, list):
                kinds = {part.get("type") for part in m.content}
                if kinds - {"text"}:
                    raise _APIError(400, f"Only text content parts are supported, got "
                                    f"{sorted(map(str, kinds - {'text'}))}.", param="messages")
                d["content"] = "".join(str(part.get("text", "")) for part in m.content)
            rendered.append(d)
        self.check_chars(sum(len(d.get("content") or "") for d in rendered), "messages")
        try:
            text = self.tokenizer.apply_chat_template(
                rendered, add_generation_prompt=add_generation_prompt, tokenize=False)
        except Exception as e:  # no template, or the template refused the chat
            raise _APIError(400, f"The chat template could not render these messages: {e}",
                            param="messages") from e
        # The template writes the special tokens (BOS) itself.
        return self.tokenizer.encode(text, add_special_tokens=False)

    # -- generation

    async def submit(self, plan: _Plan) -> tuple[list[str], list[asyncio.Queue]]:
        """Hands the plan's `n` requests (one per choice) to the engine together; returns
        their ids and output queues."""
        rids = [uuid.uuid4().hex for _ in range(plan.n)]
        group = [(rid, dict(max_tokens=plan.max_tokens, sampling=plan.sampling,
                            stop_ids=plan.stop_ids,
                            seed=(plan.seed + i * _CHOICE_SEED_STRIDE) % 2**64,
                            salt=plan.salt, logprobs=plan.logprobs))
                 for i, rid in enumerate(rids)]
        try:
            queues = await asyncio.wait_for(self.worker.submit_group(
                plan.prompt_ids, group, capacity=self.capacity), _remaining(plan))
        except (ValueError, TypeError) as e:
            raise _APIError(400, str(e)) from e
        except QueueFullError as e:
            self.metrics.rejected.labels(status="429").inc()
            raise _APIError(429, str(e), type="rate_limit_error", code="queue_full") from e
        except TimeoutError as e:
            for rid in rids:
                self.worker.cancel(rid)
            self.metrics.requests.labels(finish_reason="timeout").inc()
            raise _APIError(408, _timeout_message(plan), code="request_timeout") from e
        except asyncio.CancelledError:  # the handler is gone before the request started
            for rid in rids:
                self.worker.cancel(rid)
            raise
        self.metrics.prompt_tokens.inc(len(plan.prompt_ids))
        return rids, queues

    def token_text(self, token_id: int) -> str:
        """A token's text as logprobs show it (its decode alone; memoized)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def _feed(self, text: "_TextStream", ids: list[int], logprobs, *, final: bool,
              top: int | None) -> tuple[str, list[_TokenLogprob] | None]:
        """New text for `ids`; with logprobs, also each token's entry (fed one at a time,
        so each token's offset in the text is known)."""
        if top is None:
            return text.feed(ids, final=final), None
        if not ids:
            return text.feed([], final=final), []
        pieces, entries = [], []
        for j, (t, lp) in enumerate(zip(ids, logprobs, strict=True)):
            offset = text.decoded_chars
            pieces.append(text.feed([t], final=final and j == len(ids) - 1))
            entries.append(_TokenLogprob(
                text=self.token_text(t), logprob=lp.logprob, offset=offset,
                top=[(self.token_text(i), v) for i, v in zip(
                    lp.top_ids[:top], lp.top_logprobs[:top], strict=True)]))
        return "".join(pieces), entries

    def _feed_each(self, text: "_TextStream", ids: list[int], logprobs, *, final: bool,
                   top: int | None) -> list[tuple[str, list[_TokenLogprob] | None]]:
        """`_feed` one token at a time: each token's new text (and entry), so that every
        token streams in a chunk of its own; stops after a stop string."""
        if len(ids) <= 1:
            return [self._feed(text, ids, logprobs, final=final, top=top)]
        parts = []
        for j, t in enumerate(ids):
            parts.append(self._feed(text, [t], None if logprobs is None else logprobs[j:j + 1],
                                    final=final and j == len(ids) - 1, top=top))
            if text.stopped:
                break
        return parts

    async def generate(self, rid: str, q: asyncio.Queue, plan: _Plan,
                       request: fastapi.Request | None = None) -> AsyncIterator[dict]:
        """Yields `{"text", "finish_reason", "usage", "logprobs"}` pieces until the request
        ends, one per token (`logprobs`: the token's `_TokenLogprob`, or None when the plan
        asks for none; the stop or EOS token has none, as it has no text).

        Cancels the engine request if the consumer stops early (client gone, stop string),
        or, when `request` is given, if the client disconnects.
        """
        text = _TextStream(self.tokenizer, plan.stops)
        completion_tokens, cached, engine_done = 0, 0, False
        last = plan.arrival  # when the request's last tokens arrived
        outcome = "cancelled"  # unless it ends otherwise
        try:
            while True:
                try:
                    out = await asyncio.wait_for(q.get(), _remaining(plan))
                except TimeoutError:
                    outcome = "timeout"
                    raise _RequestTimeout(_timeout_message(plan)) from None
                if isinstance(out, Exception):
                    outcome = "error"
                    raise out
                engine_done = out.finished
                ids = list(out.token_ids)
                lps = out.logprobs
                now = time.monotonic()
                if ids and not completion_tokens:
                    self.metrics.ttft.observe(now - plan.arrival)
                    gaps = len(ids) - 1  # the first token's wait is the TTFT
                    last = now
                else:
                    gaps = len(ids)
                for _ in range(gaps):
                    self.metrics.itl.observe((now - last) / len(ids))
                if ids:
                    last = now
                completion_tokens += len(ids)
                self.metrics.generation_tokens.inc(len(ids))
                if out.finished:
                    self.metrics.cached_tokens.inc(out.cached_tokens)
                cached = max(cached, out.cached_tokens)
                finish = out.finish_reason if out.finished else None
                if finish == "stop" and ids:  # the stop / EOS token is not part of the text
                    ids = ids[:-1]
                    lps = None if lps is None else lps[:-1]
                parts = await self.off_loop(self._feed_each, text, ids, lps,
                                            final=out.finished, top=plan.logprobs)
                if text.stopped:
                    finish = "stop"
                done = finish is not None
                usage = None
                if done:
                    outcome = finish
                    self.metrics.duration.observe(time.monotonic() - plan.arrival)
                    usage = {"prompt_tokens": out.prompt_tokens,
                             "completion_tokens": completion_tokens,
                             "total_tokens": out.prompt_tokens + completion_tokens,
                             "prompt_tokens_details": {"cached_tokens": cached}}
                for j, (delta, entries) in enumerate(parts):
                    end = j == len(parts) - 1
                    yield {"text": delta, "finish_reason": finish if end else None,
                           "usage": usage if end else None, "logprobs": entries}
                if done:
                    return
                if request is not None and await request.is_disconnected():
                    return
        finally:
            if not engine_done:
                self.worker.cancel(rid)
            self.metrics.requests.labels(finish_reason=outcome).inc()

    async def _collect_one(self, rid, q, plan, request) -> tuple[str, str, dict, list | None]:
        pieces, finish, usage = [], None, None
        entries = None if plan.logprobs is None else []
        async with aclosing(self.generate(rid, q, plan, request)) as stream:
            async for piece in stream:
                pieces.append(piece["text"])
                finish, usage = piece["finish_reason"], piece["usage"]
                if entries is not None:
                    entries.extend(piece["logprobs"])
        return "".join(pieces), finish, usage, entries

    async def collect(self, rids, queues, plan, request) -> tuple[list[tuple], dict]:
        """Every choice's (text, finish reason, logprob entries or None) and the usage of
        them all (the prompt counted once)."""
        tasks = [asyncio.ensure_future(self._collect_one(rid, q, plan, request))
                 for rid, q in zip(rids, queues, strict=True)]
        try:
            results = await asyncio.gather(*tasks)
        except EngineError as e:
            raise _APIError(500, str(e), type="server_error", code="engine_error") from e
        except _RequestTimeout as e:
            raise _APIError(408, str(e), code="request_timeout") from e
        finally:
            for t in tasks:
                t.cancel()
        choices = [(text, finish, entries) for text, finish, _, entries in results]
        return choices, _total_usage([usage for _, _, usage, _ in results])

    async def sse(self, rids, queues, plan, chunk, final_usage_chunk) -> AsyncIterator[str]:
        """Server-sent events: `chunk(index, piece)` per piece of each choice (as they
        come), a usage chunk if asked once every choice has ended, [DONE]."""
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(index, rid, q):
            try:
                async with aclosing(self.generate(rid, q, plan)) as stream:
                    async for piece in stream:
                        merged.put_nowait((index, piece))
            except (EngineError, _RequestTimeout) as e:
                merged.put_nowait((index, e))
            finally:
                merged.put_nowait((index, None))

        tasks = [asyncio.ensure_future(pump(i, rid, q))
                 for i, (rid, q) in enumerate(zip(rids, queues, strict=True))]
        usages = [None] * len(tasks)
        try:
            ended = 0
            while ended < len(tasks):
                index, item = await merged.get()
                if item is None:
                    ended += 1
                    continue
                if isinstance(item, Exception):
                    if isinstance(item, EngineError):
                        error = {"message": str(item), "type": "server_error", "param": None,
                                 "code": "engine_error"}
                    else:
                        error = {"message": str(item), "type": "invalid_request_error",
                                 "param": None, "code": "request_timeout"}
                    yield f"data: {json.dumps({'error': error})}\n\n"
                    break
                for c in chunk(index, item):
                    yield f"data: {json.dumps(c)}\n\n"
                if item["usage"] is not None:
                    usages[index] = item["usage"]
            else:
                if plan.include_usage:
                    yield f"data: {json.dumps(final_usage_chunk(_total_usage(usages)))}\n\n"
        finally:
            for t in tasks:
                t.cancel()
        yield "data: [DONE]\n\n"


def _total_usage(usages: Sequence[dict]) -> dict:
    """The usage of a request's choices: the prompt once, every choice's completion."""
    prompt = usages[0]["prompt_tokens"]
    completion = sum(u["completion_tokens"] for u in usages)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": max(
                u["prompt_tokens_details"]["cached_tokens"] for u in usages)}}


def _completion_logprobs_json(entries: list[_TokenLogprob], top: int) -> dict:
    """OpenAI's completion `logprobs`: tokens, their logprobs, the top `top` per token (a
    text -> logprob map, with the chosen token's entry added when it is not among
    them) and each token's offset in the text."""
    tops = []
    for e in entries:
        d = {}
        for text, lp in e.top[:top]:
            d.setdefault(text, lp)
        d.setdefault(e.text, e.logprob)
        tops.append(d)
    return {"tokens": [e.text for e in entries],
            "token_logprobs": [e.logprob for e in entries], "top_logprobs": tops,
            "text_offset": [e.offset for e in entries]}


def _chat_logprobs_json(entries: list[_TokenLogprob]) -> dict:
    """OpenAI's chat `logprobs`: per token its text, logprob, UTF-8 bytes and top list."""
    def item(text, lp):
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
    return {"content": [item(e.text, e.logprob) | {
        "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]}


def _remaining(plan: _Plan) -> float | None:
    """Seconds left before the plan's deadline (None: no deadline; never negative)."""
    return None if plan.deadline is None else max(0.0, plan.deadline - time.monotonic())


def _timeout_message(plan: _Plan) -> str:
    return (f"The request did not finish within the server's request timeout "
            f"({plan.deadline - plan.arrival:g} s, --request-timeout); it was cancelled.")


def _streaming(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


class TokenizeRequest(pydantic.BaseModel):
    """vLLM's `/tokenize` body: a `prompt` (completion) or `messages` (chat), not both."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for a chat
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(pydantic.BaseModel):
    model: str | None = None
    tokens: list[int]


def create_app(engine, tokenizer, *, model_name: str, api_key: str | None = None,
               max_request_bytes: int = 8 * 2**20, request_timeout: float | None = None,
               max_waiting: int | None = None,
               max_prompt_chars: int | None = None) -> fastapi.FastAPI:
    """The FastAPI app serving `engine` under `model_name`.

    Args:
      engine: a `kvjax.serve.Engine`; the app's worker thread owns it from startup (the
        ASGI lifespan) to shutdown; do not call it from elsewhere meanwhile.
      tokenizer: a `transformers` tokenizer (`AutoTokenizer.from_pretrained(DIR)`) for
        text prompts, completions and the chat template.
      model_name: the id clients pass as `model` (and `/v1/models` lists).
      api_key: if given, every path but `/health` and `/metrics` needs
        `Authorization: Bearer <api_key>` (401 otherwise).
      max_request_bytes: longest request body, in bytes (413 beyond it, before parsing).
      request_timeout: seconds from a request's arrival to its end, body upload and
        generation included (408 beyond it; the engine request is cancelled). None: no
        limit.
      max_waiting: requests that may wait beyond the engine's `max_seqs` running ones; a
        request beyond that is refused with a 429. None: no bound.
      max_prompt_chars: longest text prompt (a chat: the messages' text together) taken
        for tokenization, in characters (default `engine.max_seq_len * 32`); longer ones
        are refused untokenized (400, `context_length_exceeded`).

    Returns:
      The app; its `EngineWorker` is `app.state.worker`, its `ServerMetrics`
      `app.state.metrics`; `app.state.drain()` starts refusing new requests (503) and
      `app.state.draining` says whether it has.
    """
    for name, value, lo in (("max_request_bytes", max_request_bytes, 1),
                            ("max_waiting", max_waiting, 0),
                            ("max_prompt_chars", max_prompt_chars, 1)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < lo):
            raise ValueError(f"create_app: {name} must be an int >= {lo}, got {value!r}.")
    if request_timeout is not None and not (
            isinstance(request_timeout, int | float) and request_timeout > 0):
        raise ValueError(f"create_app: request_timeout must be a positive number of seconds "
                         f"(or None), got {request_timeout!r}.")
    if api_key is not None and not (isinstance(api_key, str) and api_key.strip()):
        raise ValueError(f"create_app: api_key must be a non-empty string (or None), got "
                         f"{api_key!r}.")
    worker = EngineWorker(engine)
    metrics = ServerMetrics(worker.load, worker.stats)
    server = _Server(worker, tokenizer, model_name,
                     max_prompt_chars=(engine.max_seq_len * _CHARS_PER_TOKEN_BOUND
                                       if max_prompt_chars is None else max_prompt_chars),
                     capacity=None if max_waiting is None else engine.rows + max_waiting,
                     metrics=metrics)
    draining = threading.Event()

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(worker.stop)
            server.pool.shutdown(wait=False, cancel_futures=True)

    app = fastapi.FastAPI(title="kvjax", lifespan=lifespan)
    app.state.worker = worker
    app.state.metrics = metrics
    app.state.drain = draining.set
    app.state.draining = draining.is_set
    app.add_middleware(_Gate, api_key=api_key, max_bytes=max_request_bytes,
                       timeout=request_timeout, metrics=metrics, draining=draining.is_set)

    @app.exception_handler(_APIError)
    async def _api_error(request, e: _APIError):
        return _error_response(e.status, e.message, type=e.type, param=e.param, code=e.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            message = (f"The request body is not valid JSON: "
                       f"{first.get('ctx', {}).get('error', first.get('msg'))}.")
            param = None
        elif not loc:  # the body as a whole: not an object, or not sent as JSON
            message = (f"The request body must be a JSON object sent with Content-Type: "
                       f"application/json ({first.get('msg')}).")
            param = None
        else:
            message = "; ".join(
                f"{'.'.join(str(x) for x in err.get('loc', ()) if x != 'body') or 'body'}: "
                f"{err.get('msg')}" for err in errors[:5])
            param = loc[0] if loc else None
        return _error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        return _error_response(e.status_code, str(e.detail),
                               code="not_found" if e.status_code == 404 else None)

    @app.get("/health")
    async def health():
        if worker.error is not None:
            return JSONResponse(status_code=503,
                                content={"status": "error", "message": worker.error})
        if draining.is_set():
            return JSONResponse(status_code=503, content={"status": "draining"})
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_():
        return Response(metrics.render(), media_type=metrics.content_type)

    def check_model_name(name: str | None) -> None:
        if name is not None and name != model_name:
            raise _APIError(404, f"The model {name!r} does not exist; this server serves "
                            f"{model_name!r}.", param="model", code="model_not_found")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model_name(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise _APIError(400, "Give either 'prompt' (a string) or 'messages' (a chat), "
                            "not both or neither.", param="prompt")

        def run():
            if body.prompt is not None:
                server.check_chars(len(body.prompt), "prompt")
                special = True if body.add_special_tokens is None else body.add_special_tokens
                ids = tokenizer.encode(body.prompt, add_special_tokens=special)
            else:
                ids = server.chat_prompt(body.messages,
                                         add_generation_prompt=body.add_generation_prompt)
                if body.add_special_tokens:  # the template writes them; vLLM adds them again
                    ids = tokenizer.build_inputs_with_special_tokens(ids)
            strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
            return ids, strs
        ids, strs = await server.off_loop(run)
        out = {"count": len(ids), "max_model_len": engine.max_seq_len, "tokens": ids}
        if strs is not None:
            out["token_strs"] = strs
        return out

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model_name(body.model)
        bad = [t for t in body.tokens if not 0 <= t < engine.vocab_size]
        if bad:
            raise _APIError(400, f"Token ids must lie in [0, {engine.vocab_size}), got "
                            f"{bad[:5]}.", param="tokens")
        text = await server.off_loop(tokenizer.decode, body.tokens)
        return {"prompt": text}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": server.created, "owned_by": "kvjax"}]}

    def usage_chunk(kind: str, rid: str, created: int):
        def chunk(usage):
            return {"id": rid, "object": kind, "created": created, "model": model_name,
                    "choices": [], "usage": usage}
        return chunk

    async def start(plan: _Plan):
        try:
            return await server.submit(plan)
        except EngineError as e:
            raise _APIError(500, str(e), type="server_error", code="engine_error") from e

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: fastapi.Request):
        server.check_model(body)
        plan = await server.prepare(request, lambda: server.plan(
            body, server.completion_prompt(body.prompt), max_tokens=body.max_tokens,
            max_tokens_param="max_tokens", default_max_tokens=_DEFAULT_COMPLETION_TOKENS,
            prompt_param="prompt", logprobs=_completion_logprobs(body)))
        rids, queues = await start(plan)
        oid, created = f"cmpl-{rids[0]}", int(time.time())

        def logprobs_json(entries):
            return None if entries is None else _completion_logprobs_json(entries, plan.logprobs)
        if plan.stream:
            def chunk(index, piece):
                if not (piece["text"] or piece["logprobs"]) and piece["finish_reason"] is None:
                    return []
                return [{"id": oid, "object": "text_completion", "created": created,
                         "model": model_name, "choices": [{
                             "index": index, "text": piece["text"],
                             "logprobs": logprobs_json(piece["logprobs"]),
                             "finish_reason": piece["finish_reason"]}]}]
            return _streaming(server.sse(rids, queues, plan, chunk,
                                         usage_chunk("text_completion", oid, created)))
        choices, usage = await server.collect(rids, queues, plan, request)
        return {"id": oid, "object": "text_completion", "created": created,
                "model": model_name, "choices": [
                    {"index": i, "text": text, "logprobs": logprobs_json(entries),
                     "finish_reason": finish}
                    for i, (text, finish, entries) in enumerate(choices)],
                "usage": usage}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: fastapi.Request):
        server.check_model(body)
        param = "max_tokens" if body.max_tokens is not None else "max_completion_tokens"
        plan = await server.prepare(request, lambda: server.plan(
            body, server.chat_prompt(body.messages), max_tokens=getattr(body, param),
            max_tokens_param=param, default_max_tokens=None, prompt_param="messages",
            logprobs=_chat_logprobs(body)))
        rids, queues = await start(plan)
        oid, created = f"chatcmpl-{rids[0]}", int(time.time())

        def logprobs_json(entries):
            return None if entries is None else _chat_logprobs_json(entries)
        if plan.stream:
            started = set()

            def chunk(index, piece):
                chunks = []
                head = {"id": oid, "object": "chat.completion.chunk", "created": created,
                        "model": model_name}
                if index not in started:
                    started.add(index)
                    chunks.append({**head, "choices": [{
                        "index": index, "delta": {"role": "assistant", "content": ""},
                        "logprobs": None, "finish_reason": None}]})
                if piece["text"] or piece["logprobs"]:
                    chunks.append({**head, "choices": [{
                        "index": index, "delta": {"content": piece["text"]},
                        "logprobs": logprobs_json(piece["logprobs"]), "finish_reason": None}]})
                if piece["finish_reason"] is not None:
                    chunks.append({**head, "choices": [{
                        "index": index, "delta": {}, "logprobs": None,
                        "finish_reason": piece["finish_reason"]}]})
                return chunks
            return _streaming(server.sse(rids, queues, plan, chunk,
                                         usage_chunk("chat.completion.chunk", oid, created)))
        choices, usage = await server.collect(rids, queues, plan, request)
        return {"id": oid, "object": "chat.completion", "created": created,
                "model": model_name, "choices": [{
                    "index": i, "message": {"role": "assistant", "content": text},
                    "logprobs": logprobs_json(entries), "finish_reason": finish}
                    for i, (text, finish, entries) in enumerate(choices)],
                "usage": usage}

    return app


class DrainingServer(uvicorn.Server):
    """A `uvicorn.Server` whose first SIGTERM / SIGINT drains a `create_app` app.

    The app stops admitting requests (`app.state.drain()`: 503 for new ones, `/health`
    "draining") while uvicorn closes its listening sockets and waits for the requests in
    flight to finish (at most `config.timeout_graceful_shutdown` seconds, if set); then
    the app's shutdown stops the engine. A second signal exits at once, as in uvicorn.
    """

    def handle_exit(self, sig, frame) -> None:
        drain = getattr(getattr(self.config.app, "state", None), "drain", None)
        if drain is not None:
            drain()
        super().handle_exit(sig, frame)
