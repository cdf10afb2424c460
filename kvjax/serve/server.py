"""An OpenAI-compatible HTTP server over the continuous-batching `Engine`.

    app = create_app(engine, tokenizer, model_name="tiny-llama")
    uvicorn.run(app, host="127.0.0.1", port=8000)

Endpoints:
  * `GET /health`: `{"status": "ok"}` (503 once the engine has failed);
  * `GET /v1/models`: the one served model, in OpenAI's list format;
  * `POST /v1/completions`: a prompt given as text or token ids;
  * `POST /v1/chat/completions`: messages rendered by the tokenizer's chat template.

Both generation endpoints take `max_tokens`, `temperature`, `top_p`, `top_k` (an
extension), `seed`, `stop` and `stream` (server-sent events in OpenAI's chunk
format, ending with `data: [DONE]`; `stream_options.include_usage` adds a final
usage chunk). Responses carry `usage` (with `prompt_tokens_details.cached_tokens`
from the prefix cache) and `finish_reason` ("stop" or "length"). Bad requests get
a 4xx answer in OpenAI's error shape, `{"error": {"message", "type", "param",
"code"}}`; fields this server does not implement (`n` > 1, `logprobs`, `echo`,
penalties, tools, ...) are refused rather than silently ignored.

Threading: the engine is not thread-safe, so one thread (`EngineWorker`) owns it.
Request handlers, on the event loop, hand `add_request` / `cancel` commands to that
thread through a thread-safe queue; the thread runs `engine.step()` while any
request is unfinished and passes each request's outputs back to its handler's
`asyncio.Queue` with `loop.call_soon_threadsafe`. A client that disconnects
cancels its request. An exception inside the engine fails every waiting request
with a 500, marks the server unhealthy and ends the thread: the engine's state
(its donated cache) is not trusted after a failed step.

Stop strings: a stop string that encodes to exactly one token also becomes a stop
id of the request (the engine ends it at that token); every stop string is also
matched on the decoded text, host-side, so a stop string spanning several tokens,
or inside a longer token, ends the completion too. The stopping token or string is
not part of the returned text, and neither is an EOS token.
"""

import asyncio
import collections
import dataclasses
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
import pydantic
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

__all__ = ["create_app", "EngineWorker", "EngineError"]

_log = logging.getLogger("kvjax.serve")

# Completions without max_tokens get OpenAI's default; chat completions get the room left.
_DEFAULT_COMPLETION_TOKENS = 16


class EngineError(RuntimeError):
    """The engine failed (or stopped) while a request was waiting on it: a 500."""


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

    Args:
      engine: a `kvjax.serve.Engine`. After `start()`, only the worker's thread touches it.
    """

    def __init__(self, engine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # Touched by the worker's thread only: commands taken off the queue but not yet
        # handled, and the sinks of unfinished requests.
        self._pending: collections.deque = collections.deque()
        self._sinks: dict[str, _Sink] = {}
        self._lock = threading.Lock()  # orders submissions against failure and shutdown
        self._error: str | None = None
        self._thread: threading.Thread | None = None

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
                     **kwargs) -> asyncio.Queue:
        """Adds a request; returns the queue its `RequestOutput`s arrive on.

        The queue receives `RequestOutput`s up to a finished one, or an `EngineError`.

        Raises:
          ValueError / TypeError: the engine refused the request (`add_request`'s message).
          EngineError: the engine has failed or the server is shutting down.
        """
        loop = asyncio.get_running_loop()
        sink = _Sink(loop=loop, queue=asyncio.Queue(), added=loop.create_future())
        with self._lock:
            if self._error is not None:
                raise EngineError(self._error)
            if self._thread is None:
                raise EngineError("the engine worker is not running (EngineWorker.start()).")
            self._commands.put(("add", request_id, prompt_ids, kwargs, sink))
        await sink.added
        return sink.queue

    def cancel(self, request_id: str) -> None:
        """Cancels a request at the engine's next step (no-op once it has finished)."""
        self._commands.put(("cancel", request_id))

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
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
                    for out in engine.step():
                        sink = self._sinks.get(out.request_id)
                        if sink is None:
                            continue
                        sink.put(out)
                        if out.finished:
                            del self._sinks[out.request_id]
                elif self._sinks:  # the engine has nothing left for them: never wait forever
                    for rid in list(self._sinks):
                        self._sinks.pop(rid).put(EngineError(
                            f"the engine dropped request {rid} without finishing it"))
        except BaseException as e:  # every failure must reach the waiting clients
            _log.exception("the engine failed; failing every waiting request")
            self._fail(f"the engine failed: {type(e).__name__}: {e}")

    def _handle(self, command) -> None:
        if command[0] == "add":
            _, rid, prompt_ids, kwargs, sink = command
            try:
                self.engine.add_request(prompt_ids, request_id=rid, **kwargs)
            except (ValueError, TypeError) as e:  # a bad request: the engine is untouched
                sink.reject(e)
                return
            except Exception as e:  # one request's 500; the engine goes on
                _log.exception("add_request failed")
                sink.reject(EngineError(f"the engine could not add the request: "
                                        f"{type(e).__name__}: {e}"))
                return
            self._sinks[rid] = sink
            sink.resolve(rid)
        elif command[0] == "cancel":
            if command[1] in self._sinks:
                self.engine.cancel(command[1])

    def _fail(self, message: str) -> None:
        with self._lock:
            self._error = message
        error = EngineError(message)
        for sink in self._sinks.values():
            sink.put(error)
        self._sinks.clear()
        while True:  # commands taken but not handled, and those that arrived since
            try:
                self._pending.append(self._commands.get_nowait())
            except queue.Empty:
                break
        for command in self._pending:
            if command is not _STOP and command[0] == "add":
                command[4].reject(error)
        self._pending.clear()


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
    "n": (None, 1), "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
    "logprobs": (None, False), "top_logprobs": (None, 0), "presence_penalty": (None, 0.0),
    "frequency_penalty": (None, 0.0), "logit_bias": (None, {}), "tools": (None, []),
    "response_format": (None, {"type": "text"}),
}


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
    def __init__(self, worker: EngineWorker, tokenizer, model_name: str):
        self.worker = worker
        self.engine = worker.engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.created = int(time.time())

    # -- validation

    def check_model(self, body: _Body) -> None:
        if body.model != self.model_name:
            raise _APIError(404, f"The model {body.model!r} does not exist; this server serves "
                            f"{self.model_name!r}.", param="model", code="model_not_found")

    def plan(self, body: _Body, prompt_ids: list[int], *, max_tokens: int | None,
             max_tokens_param: str, default_max_tokens: int | None,
             prompt_param: str) -> _Plan:
        from kvjax.generate import SamplingConfig

        for name, unused in _UNSUPPORTED.items():
            value = getattr(body, name, None)
            if value not in unused:
                raise _APIError(400, f"{name}={value!r} is not supported by this server.",
                                param=name, code="unsupported_parameter")
        if not prompt_ids:
            raise _APIError(400, f"The {prompt_param} is empty; give at least one token.",
                            param=prompt_param)
        limit, n = self.engine.max_seq_len, len(prompt_ids)
        if max_tokens is not None and max_tokens < 1:
            raise _APIError(400, f"{max_tokens_param} must be at least 1, got {max_tokens}.",
                            param=max_tokens_param)
        if n >= limit:
            raise _APIError(400, f"This server holds at most {limit} tokens per sequence "
                            f"(prompt + completion); the {prompt_param} alone has {n} tokens. "
                            f"Shorten it.", param=prompt_param, code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = limit - n if default_max_tokens is None else min(
                default_max_tokens, limit - n)
        elif n + max_tokens > limit:
            raise _APIError(400, f"This server holds at most {limit} tokens per sequence, but "
                            f"this request asks for {n + max_tokens} ({n} in the "
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
        return _Plan(prompt_ids=prompt_ids, max_tokens=max_tokens,
                     sampling=SamplingConfig(temperature=temperature, top_k=body.top_k,
                                             top_p=body.top_p),
                     stop_ids=tuple(sorted(stop_ids)), stops=tuple(stops), seed=seed,
                     stream=bool(body.stream),
                     include_usage=bool(options.get("include_usage", False)))

    def completion_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise _APIError(400, f"A list of {len(prompt)} prompts is not supported; send "
                                "one request per prompt.", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True) if prompt else []
        return list(prompt)

    def chat_prompt(self, messages: list[ChatMessage]) -> list[int]:
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
        try:
            text = self.tokenizer.apply_chat_template(rendered, add_generation_prompt=True,
                                                      tokenize=False)
        except Exception as e:  # no template, or the template refused the chat
            raise _APIError(400, f"The chat template could not render these messages: {e}",
                            param="messages") from e
        # The template writes the special tokens (BOS) itself.
        return self.tokenizer.encode(text, add_special_tokens=False)

    # -- generation

    async def submit(self, plan: _Plan) -> tuple[str, asyncio.Queue]:
        rid = uuid.uuid4().hex
        try:
            q = await self.worker.submit(
                plan.prompt_ids, request_id=rid, max_tokens=plan.max_tokens,
                sampling=plan.sampling, stop_ids=plan.stop_ids, seed=plan.seed)
        except (ValueError, TypeError) as e:
            raise _APIError(400, str(e)) from e
        except asyncio.CancelledError:  # the handler is gone before the request started
            self.worker.cancel(rid)
            raise
        return rid, q

    async def generate(self, rid: str, q: asyncio.Queue, plan: _Plan,
                       request: fastapi.Request | None = None) -> AsyncIterator[dict]:
        """Yields `{"text", "finish_reason", "usage"}` pieces until the request ends.

        Cancels the engine request if the consumer stops early (client gone, stop string),
        or, when `request` is given, if the client disconnects.
        """
        text = _TextStream(self.tokenizer, plan.stops)
        completion_tokens, cached, engine_done = 0, 0, False
        try:
            while True:
                out = await q.get()
                if isinstance(out, Exception):
                    raise out
                engine_done = out.finished
                ids = list(out.token_ids)
                completion_tokens += len(ids)
                cached = max(cached, out.cached_tokens)
                finish = out.finish_reason if out.finished else None
                if finish == "stop" and ids:  # the stop / EOS token is not part of the text
                    ids = ids[:-1]
                delta = text.feed(ids, final=out.finished)
                if text.stopped:
                    finish = "stop"
                done = finish is not None
                usage = None
                if done:
                    usage = {"prompt_tokens": out.prompt_tokens,
                             "completion_tokens": completion_tokens,
                             "total_tokens": out.prompt_tokens + completion_tokens,
                             "prompt_tokens_details": {"cached_tokens": cached}}
                yield {"text": delta, "finish_reason": finish, "usage": usage}
                if done:
                    return
                if request is not None and await request.is_disconnected():
                    return
        finally:
            if not engine_done:
                self.worker.cancel(rid)

    async def collect(self, rid, q, plan, request) -> tuple[str, str, dict]:
        pieces, finish, usage = [], None, None
        try:
            async with aclosing(self.generate(rid, q, plan, request)) as stream:
                async for piece in stream:
                    pieces.append(piece["text"])
                    finish, usage = piece["finish_reason"], piece["usage"]
        except EngineError as e:
            raise _APIError(500, str(e), type="server_error", code="engine_error") from e
        return "".join(pieces), finish, usage

    async def sse(self, rid, q, plan, chunk, final_usage_chunk) -> AsyncIterator[str]:
        """Server-sent events: `chunk(piece)` per piece, a usage chunk if asked, [DONE]."""
        try:
            async with aclosing(self.generate(rid, q, plan)) as stream:
                async for piece in stream:
                    for c in chunk(piece):
                        yield f"data: {json.dumps(c)}\n\n"
                    if piece["usage"] is not None and plan.include_usage:
                        yield f"data: {json.dumps(final_usage_chunk(piece['usage']))}\n\n"
        except EngineError as e:
            error = {"message": str(e), "type": "server_error", "param": None,
                     "code": "engine_error"}
            yield f"data: {json.dumps({'error': error})}\n\n"
        yield "data: [DONE]\n\n"


def _streaming(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def create_app(engine, tokenizer, *, model_name: str) -> fastapi.FastAPI:
    """The FastAPI app serving `engine` under `model_name`.

    Args:
      engine: a `kvjax.serve.Engine`; the app's worker thread owns it from startup (the
        ASGI lifespan) to shutdown; do not call it from elsewhere meanwhile.
      tokenizer: a `transformers` tokenizer (`AutoTokenizer.from_pretrained(DIR)`) for
        text prompts, completions and the chat template.
      model_name: the id clients pass as `model` (and `/v1/models` lists).

    Returns:
      The app; its `EngineWorker` is `app.state.worker`.
    """
    worker = EngineWorker(engine)
    server = _Server(worker, tokenizer, model_name)

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(worker.stop)

    app = fastapi.FastAPI(title="kvjax", lifespan=lifespan)
    app.state.worker = worker

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
        return {"status": "ok"}

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
        plan = server.plan(body, server.completion_prompt(body.prompt),
                           max_tokens=body.max_tokens, max_tokens_param="max_tokens",
                           default_max_tokens=_DEFAULT_COMPLETION_TOKENS, prompt_param="prompt")
        rid, q = await start(plan)
        oid, created = f"cmpl-{rid}", int(time.time())
        if plan.stream:
            def chunk(piece):
                if not piece["text"] and piece["finish_reason"] is None:
                    return []
                return [{"id": oid, "object": "text_completion", "created": created,
                         "model": model_name, "choices": [{
                             "index": 0, "text": piece["text"], "logprobs": None,
                             "finish_reason": piece["finish_reason"]}]}]
            return _streaming(server.sse(rid, q, plan, chunk,
                                         usage_chunk("text_completion", oid, created)))
        text, finish, usage = await server.collect(rid, q, plan, request)
        return {"id": oid, "object": "text_completion", "created": created,
                "model": model_name, "choices": [{"index": 0, "text": text, "logprobs": None,
                                                  "finish_reason": finish}],
                "usage": usage}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: fastapi.Request):
        server.check_model(body)
        param = "max_tokens" if body.max_tokens is not None else "max_completion_tokens"
        plan = server.plan(body, server.chat_prompt(body.messages),
                           max_tokens=getattr(body, param), max_tokens_param=param,
                           default_max_tokens=None, prompt_param="messages")
        rid, q = await start(plan)
        oid, created = f"chatcmpl-{rid}", int(time.time())
        if plan.stream:
            first = [True]

            def chunk(piece):
                chunks = []
                head = {"id": oid, "object": "chat.completion.chunk", "created": created,
                        "model": model_name}
                if first[0]:
                    first[0] = False
                    chunks.append({**head, "choices": [{
                        "index": 0, "delta": {"role": "assistant", "content": ""},
                        "logprobs": None, "finish_reason": None}]})
                if piece["text"]:
                    chunks.append({**head, "choices": [{
                        "index": 0, "delta": {"content": piece["text"]}, "logprobs": None,
                        "finish_reason": None}]})
                if piece["finish_reason"] is not None:
                    chunks.append({**head, "choices": [{
                        "index": 0, "delta": {}, "logprobs": None,
                        "finish_reason": piece["finish_reason"]}]})
                return chunks
            return _streaming(server.sse(rid, q, plan, chunk,
                                         usage_chunk("chat.completion.chunk", oid, created)))
        text, finish, usage = await server.collect(rid, q, plan, request)
        return {"id": oid, "object": "chat.completion", "created": created,
                "model": model_name, "choices": [{
                    "index": 0, "message": {"role": "assistant", "content": text},
                    "logprobs": None, "finish_reason": finish}],
                "usage": usage}

    return app
