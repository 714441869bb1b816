"""``oasis serve``: an OpenAI-compatible HTTP server over one :class:`~oasiskv.LLMEngine`.

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (JSON, or server-sent
events with ``"stream": true``), ``GET /v1/models``, ``GET /health`` (the engine's snapshot,
including whether every KV block is back in its pool) and ``GET /metrics`` (Prometheus text).

The request path: the handler reads the body (at most ``max_body_bytes``), validates it
(:mod:`~oasiskv.serve.protocol`), renders the chat template, tokenizes, checks the prompt and
``max_tokens`` against the context, and submits the request to the engine thread
(:class:`~oasiskv.serve.engine_loop.EngineLoop`). Every refusal is an OpenAI error body
``{"error": {"message", "type", "param", "code"}}`` with a 4xx status; nothing a client sends
produces a traceback or stops the server. A client that disconnects aborts its request, whose
blocks return to the pools.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..errors import ConfigError, ContextLengthError, OasisError, OutOfBlocksError
from ..llm_engine import LLMEngine, SamplingParams, prompt_token_ids
from . import protocol as P
from .cli import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_QUEUE
from .engine_loop import EngineLoop, EngineStopped, Overloaded, RequestHandle
from .text import StopChecker, TextAssembler

log = logging.getLogger("oasiskv.serve")


@dataclass
class ServeConfig:
    """What the server needs beyond the engine.

    Attributes:
        model_name: the id clients pass as ``model`` (and ``/v1/models`` lists).
        api_key: when set, every endpoint but ``/health`` needs ``Authorization: Bearer KEY``.
        max_queue: requests that may wait beyond the ``max_num_seqs`` running ones; past that,
            429 with ``Retry-After``.
        max_body_bytes: the largest request body accepted (413 past it).
    """

    model_name: str
    api_key: str | None = None
    max_queue: int = DEFAULT_MAX_QUEUE
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES


class ApiError(Exception):
    """A refusal with an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        body = P.error_body(self.message, self.type, self.param, self.code)
        return JSONResponse(body, status_code=self.status, headers=self.headers)


class _BearerAuth:
    """Pure ASGI middleware: with an API key, every path but ``/health`` needs the bearer token
    (compared in constant time); 401 with an OpenAI error body otherwise."""

    def __init__(self, app, api_key: str | None, on_reject) -> None:
        self.app = app
        self.key = None if api_key is None else api_key.encode()
        self.on_reject = on_reject

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or self.key is None or scope["path"] == "/health":
            await self.app(scope, receive, send)
            return
        got = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = got.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            await self.app(scope, receive, send)
            return
        self.on_reject("unauthorized")
        err = ApiError(
            401,
            "missing or wrong API key; send 'Authorization: Bearer KEY'",
            param=None,
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
        await err.response()(scope, receive, send)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


def _error_for(e: OasisError, param: str | None) -> ApiError:
    """The 400 for an error the engine raised while refusing a request."""
    msg = " ".join(str(e).split())
    if isinstance(e, ContextLengthError):
        return ApiError(400, msg, param=param, code="context_length_exceeded")
    if isinstance(e, OutOfBlocksError):
        return ApiError(400, msg, param="max_tokens", code="kv_budget_exceeded")
    if isinstance(e, ConfigError):
        return ApiError(400, msg, param=param, code="invalid_value")
    return ApiError(400, msg, param=param, code=type(e).__name__)


def build_app(llm_engine: LLMEngine, config: ServeConfig) -> FastAPI:
    """The FastAPI app serving ``llm_engine``. Its lifespan starts the engine thread and stops
    it (aborting whatever runs) at shutdown; from then on only that thread touches the engine."""
    engine_loop = EngineLoop(llm_engine, max_queue=config.max_queue, model_name=config.model_name)
    metrics = engine_loop.metrics
    tok = llm_engine.tokenizer
    mcfg = llm_engine.model.config
    ctx = int(mcfg.max_position_embeddings)
    vocab = int(mcfg.vocab_size)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine_loop.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine_loop.stop)

    # No /docs or /openapi.json: the handlers parse their bodies themselves (to answer every
    # mistake with an OpenAI error), so the generated schema would say nothing useful.
    app = FastAPI(
        title="OasisKV", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.engine_loop = engine_loop
    app.state.config = config
    app.add_middleware(_BearerAuth, api_key=config.api_key, on_reject=metrics.reject)

    # ------------------------------------------------------------------ errors
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        if e.status < 500:
            metrics.reject("overload" if e.status == 429 else "bad_request")
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return ApiError(e.status_code, str(e.detail), code=code, headers=e.headers).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        errs = e.errors()
        msg = str(errs[0].get("msg", "invalid request")) if errs else "invalid request"
        return ApiError(400, msg).response()

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):
        log.exception("unhandled error serving %s", request.url.path)
        return ApiError(500, "internal server error", type_="server_error").response()

    # ------------------------------------------------------------------ request parsing
    async def read_json(request: Request) -> dict:
        limit = config.max_body_bytes
        too_big = ApiError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            raise too_big if declared.isdigit() else ApiError(400, "bad Content-Length header")
        chunks, total = [], 0
        try:
            async for chunk in request.stream():
                total += len(chunk)
                if total > limit:
                    raise too_big
                chunks.append(chunk)
        except ClientDisconnect:
            raise ApiError(400, "the client disconnected while sending the body") from None
        try:
            obj = json.loads(b"".join(chunks))
        except (ValueError, RecursionError) as e:
            raise ApiError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(obj, dict):
            raise ApiError(400, "the body must be a JSON object", code="invalid_json")
        return obj

    def validate(cls, obj: dict):
        try:
            req = cls.model_validate(obj)
        except ValidationError as e:
            err = e.errors(include_url=False, include_input=False)[0]
            loc = ".".join(str(x) for x in err["loc"])
            raise ApiError(400, f"{loc}: {err['msg']}", param=loc or None, code=err["type"]) from None
        try:
            req.check_supported()
        except P.UnsupportedParameter as e:
            raise ApiError(400, str(e), param=e.param, code="unsupported_parameter") from None
        if req.model != config.model_name:
            raise ApiError(
                404,
                f"model {req.model!r} is not served here; this server serves {config.model_name!r}",
                param="model",
                code="model_not_found",
            )
        return req

    async def encode(prompt, param: str) -> list[int]:
        # Off the event loop: a prompt near --max-body-bytes takes a while to tokenize.
        try:
            return await asyncio.to_thread(prompt_token_ids, prompt, tok, vocab, param)
        except ConfigError as e:
            raise ApiError(400, str(e), param=param, code="invalid_prompt") from None

    def sampling(req, n_prompt: int, max_tokens: int | None, param: str) -> SamplingParams:
        if n_prompt > ctx:
            raise ApiError(
                400,
                f"the prompt has {n_prompt} tokens; the model's context is {ctx} tokens",
                param=param,
                code="context_length_exceeded",
            )
        if max_tokens is None:
            max_tokens = ctx - n_prompt + 1  # the most that fits (the last token is never fed)
        elif n_prompt + max_tokens - 1 > ctx:
            raise ApiError(
                400,
                f"max_tokens={max_tokens} with a prompt of {n_prompt} tokens passes the model's "
                f"context of {ctx} tokens; lower max_tokens to at most {ctx - n_prompt + 1}",
                param="max_tokens",
                code="context_length_exceeded",
            )
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                seed=req.seed,
                ignore_eos=req.ignore_eos,
            )
        except ConfigError as e:
            raise ApiError(400, str(e), code="invalid_value") from None

    async def submit(rid: str, ids: list[int], params: SamplingParams, stops, arrival, param):
        try:
            return await engine_loop.submit(
                rid, ids, params, StopChecker(tok, stops) if stops else None, arrival
            )
        except Overloaded as e:
            raise ApiError(
                429,
                str(e),
                type_="rate_limit_exceeded",
                code="server_busy",
                headers={"Retry-After": str(e.retry_after_s)},
            ) from None
        except EngineStopped as e:
            raise ApiError(503, str(e), type_="server_error", code="engine_stopped") from None
        except OasisError as e:
            raise _error_for(e, param) from None

    # ------------------------------------------------------------------ generation
    async def watch_disconnect(request: Request, rid: str) -> None:
        # The body is read, so the next ASGI message is http.disconnect: sent when the client
        # goes away (or the response completes; an abort of a finished request is ignored).
        # Blocking on it costs nothing per request, unlike polling is_disconnected().
        while (await request.receive())["type"] != "http.disconnect":
            pass
        engine_loop.abort(rid)

    async def run(request: Request, req, rid: str, handle: RequestHandle, n_prompt: int, chat: bool):
        stops = req.stop_strings()
        # The watcher starts here, not inside the stream: if the response never starts (the
        # client left already), nothing would run the stream's cleanup.
        watcher = asyncio.create_task(watch_disconnect(request, rid))
        if req.stream:
            return StreamingResponse(
                stream(req, rid, handle, n_prompt, chat, stops, watcher),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        asm = TextAssembler(tok, stops)
        done = False
        try:
            while True:
                out = await handle.queue.get()
                asm.push(out.new_token_ids)
                n_out = len(out.token_ids)
                if asm.stopped and not out.finished:
                    finish = "stop"  # the text holds a stop string the engine missed
                    break
                if out.finished:
                    finish = out.finish_reason
                    done = True
                    asm.finish()
                    break
        finally:  # also when the handler is cancelled (shutdown)
            watcher.cancel()
            if not done:
                engine_loop.abort(rid)
        if finish == "error":
            raise ApiError(500, out.error or "the request failed", type_="server_error", code="engine_error")
        if finish == "abort":
            raise ApiError(503, "the request was aborted", type_="server_error", code="aborted")
        build = P.chat_response if chat else P.completion_response
        return JSONResponse(build(rid, config.model_name, asm.text, finish, n_prompt, n_out))

    async def stream(req, rid, handle: RequestHandle, n_prompt, chat, stops, watcher: asyncio.Task):
        """The SSE body. # Cancel safety: cancelled or closed early, it aborts the request."""
        model, t0 = config.model_name, int(time.time())
        asm = TextAssembler(tok, stops)
        done = False

        def chunk(text: str, finish: str | None, first: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": text} if first else {"content": text}
                return _sse(P.chat_chunk(rid, model, t0, delta if text or first else {}, finish))
            return _sse(P.completion_chunk(rid, model, t0, text, finish))

        try:
            if chat:
                yield chunk("", None, first=True)
            n_out = 0
            while True:
                out = await handle.queue.get()
                asm.push(out.new_token_ids)
                n_out = len(out.token_ids)
                if asm.stopped and not out.finished:
                    finish = "stop"  # aborted below
                    break
                if out.finished:
                    finish = out.finish_reason
                    done = True
                    asm.finish()
                    break
                piece = asm.delta()
                if piece:
                    yield chunk(piece, None)
            if finish in ("error", "abort"):
                msg = (out.error or "the request failed") if finish == "error" else "the request was aborted"
                yield _sse(P.error_body(msg, "server_error", None, f"engine_{finish}"))
                return
            yield chunk(asm.delta(final=True), finish)
            if req.stream_options is not None and req.stream_options.include_usage:
                obj = "chat.completion.chunk" if chat else "text_completion"
                yield _sse(P.usage_chunk(rid, obj, model, t0, n_prompt, n_out))
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            if not done:
                engine_loop.abort(rid)

    # ------------------------------------------------------------------ routes
    @app.post("/v1/completions")
    async def completions(request: Request):
        arrival = time.monotonic()
        req = validate(P.CompletionRequest, await read_json(request))
        ids = await encode(req.prompt_input(), "prompt")
        params = sampling(req, len(ids), req.max_tokens, "prompt")
        rid = f"cmpl-{uuid.uuid4().hex}"
        handle = await submit(rid, ids, params, req.stop_strings(), arrival, "prompt")
        return await run(request, req, rid, handle, len(ids), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        arrival = time.monotonic()
        req = validate(P.ChatCompletionRequest, await read_json(request))
        if tok is None:
            raise ApiError(400, "this model has no tokenizer, so no chat template; use /v1/completions")
        try:
            text = await asyncio.to_thread(tok.apply_chat_template, req.template_messages())
        except ConfigError as e:
            raise ApiError(400, str(e), param="messages", code="invalid_messages") from None
        ids = await encode(text, "messages")
        params = sampling(req, len(ids), req.max_new_tokens(), "messages")
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        handle = await submit(rid, ids, params, req.stop_strings(), arrival, "messages")
        return await run(request, req, rid, handle, len(ids), chat=True)

    @app.get("/v1/models")
    async def models():
        card = {
            "id": config.model_name,
            "object": "model",
            "created": created,
            "owned_by": "oasiskv",
            "max_model_len": ctx,
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        alive = engine_loop.alive
        body = {"status": "ok" if alive else "engine_stopped", **engine_loop.snapshot.as_dict()}
        body["inflight"] = engine_loop.inflight
        body["capacity"] = engine_loop.capacity
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def prometheus(request: Request):
        # Behind the API key like every route but /health (_BearerAuth).
        body, content_type = metrics.render(request.headers.get("accept"))
        return Response(body, headers={"Content-Type": content_type})

    return app


# ---------------------------------------------------------------------- running it
class ServerThread:
    """uvicorn serving ``app`` in a background thread, on a socket bound here (``port=0``: a free
    port, read back from :attr:`port`). For tests and notebooks::

        with ServerThread(build_app(eng, ServeConfig("smollm2"))) as srv:
            print(srv.url)
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
        import uvicorn

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        cfg = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=2, lifespan="on")
        self.server = uvicorn.Server(cfg)
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, name="oasis-http", daemon=True
        )

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 60.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
