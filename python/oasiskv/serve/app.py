"""``oasis serve``: an OpenAI-compatible HTTP server over one :class:`~oasiskv.LLMEngine`.

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (JSON, or server-sent
events with ``"stream": true``), ``GET /v1/models`` and ``GET /v1/models/{id}``, ``GET /health``
(the engine's snapshot, including whether every KV block is back in its pool) and ``GET /metrics``
(Prometheus text). The OpenAI surface, field by field, is in docs/SERVE.md.

The request path: the handler reads the body (at most ``max_body_bytes``), validates it
(:mod:`~oasiskv.serve.protocol`), renders the chat template, tokenizes, checks the prompt and
``max_tokens`` against the context, and submits the request to the engine thread
(:class:`~oasiskv.serve.engine_loop.EngineLoop`). Every refusal is an OpenAI error body
``{"error": {"message", "type", "param", "code"}}`` with a 4xx status; nothing a client sends
produces a traceback or stops the server. A client that disconnects aborts its request, whose
blocks return to the pools. A request for ``n`` choices is ``n`` engine requests (ids
``<id>-<i>``), streamed interleaved, each chunk naming its choice's ``index``.
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
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..errors import ConfigError, ContextLengthError, InvalidTextError, OasisError, OutOfBlocksError
from ..llm_engine import LLMEngine, SamplingParams, prompt_token_ids
from ..models.tokenizer import check_text
from . import protocol as P
from .config import ServeConfig
from .engine_loop import EngineLoop, EngineStopped, Overloaded, RequestHandle
from .text import StopChecker, TextAssembler, TokenPieces, token_text

log = logging.getLogger("oasiskv.serve")


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
        # A lone surrogate (echoed from the request) has no UTF-8 form: escape it, or the body
        # could not be written and the client would get a 500 and a closed connection.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        if param is not None:
            param = param.encode("utf-8", "backslashreplace").decode("utf-8")
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


@dataclass(eq=False)
class _Choice:
    """One choice of a request (``n`` of them): its engine request and the text made so far."""

    index: int
    rid: str
    handle: RequestHandle
    asm: TextAssembler
    echo: str = ""  # the prompt, with ``echo``
    n_out: int = 0  # tokens generated
    finish: str | None = None  # set once the choice is over (the engine's reason, or "stop")
    error: str | None = None
    done: bool = False  # the engine reported the request finished (nothing to abort)
    logprobs: list[P.TokenLogprob] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # each entry's text_offset (completions)
    text_pos: int = 0  # where the next token's text starts

    def __post_init__(self) -> None:
        self.text_pos = len(self.echo)


class _Server:
    """The state the handlers share (the engine thread, the model's numbers, the config) and the
    steps of a request: parsing and validating it, submitting its choices, and answering."""

    def __init__(self, llm_engine: LLMEngine, config: ServeConfig) -> None:
        self.config = config
        self.engine_loop = EngineLoop(llm_engine, max_queue=config.max_queue, model_name=config.model_name)
        self.metrics = self.engine_loop.metrics
        self.tok = llm_engine.tokenizer
        mcfg = llm_engine.model.config
        self.ctx = int(mcfg.max_position_embeddings)
        self.vocab = int(mcfg.vocab_size)
        self.created = int(time.time())
        self.pieces = TokenPieces(self.tok)

    # ------------------------------------------------------------------ request parsing
    async def read_json(self, request: Request) -> dict:
        limit = self.config.max_body_bytes
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

    def validate(self, cls, obj: dict):
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
        if req.model not in self.config.model_names:
            raise self.not_served(req.model)
        return req

    def not_served(self, model: str) -> ApiError:
        served = ", ".join(repr(m) for m in self.config.model_names)
        return ApiError(
            404,
            f"model {model!r} is not served here; this server serves {served}",
            param="model",
            code="model_not_found",
        )

    def check(self, text: str, param: str) -> None:
        """400 for text with no UTF-8 form (a lone surrogate), naming the field."""
        try:
            check_text(text, param)
        except InvalidTextError as e:
            raise ApiError(400, str(e), param=param.split("[")[0], code="invalid_text") from None

    async def encode(self, prompt, param: str) -> list[int]:
        # Off the event loop: a prompt near --max-body-bytes takes a while to tokenize.
        try:
            return await asyncio.to_thread(prompt_token_ids, prompt, self.tok, self.vocab, param)
        except InvalidTextError as e:
            raise ApiError(400, f"{param}: {e}", param=param, code="invalid_text") from None
        except ConfigError as e:
            raise ApiError(400, str(e), param=param, code="invalid_prompt") from None

    def sampling(self, req, n_prompt: int, param: str) -> list[SamplingParams]:
        """One SamplingParams per choice (choice i of a seeded request: seed + i)."""
        ctx, engine_loop = self.ctx, self.engine_loop
        max_tokens = req.max_new_tokens()
        budget = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
        if n_prompt > ctx:
            raise ApiError(
                400,
                f"the prompt has {n_prompt} tokens; the model's context is {ctx} tokens",
                param=param,
                code="context_length_exceeded",
            )
        left = ctx - n_prompt + 1  # the most that fits (the last token is never fed)
        if max_tokens is None:
            max_tokens = min(self.config.max_tokens_default, left)
        elif max_tokens > left:
            raise ApiError(
                400,
                f"{budget}={max_tokens} with a prompt of {n_prompt} tokens passes the model's "
                f"context of {ctx} tokens; lower {budget} to at most {left}",
                param=budget,
                code="context_length_exceeded",
            )
        if req.num_choices > engine_loop.capacity:
            raise ApiError(
                400,
                f"n={req.num_choices} passes what this server holds at once ({engine_loop.capacity} "
                "requests: --max-num-seqs + --max-queue); lower n",
                param="n",
                code="invalid_value",
            )
        out = []
        for i in range(req.num_choices):
            try:
                out.append(
                    SamplingParams(
                        max_tokens=max_tokens,
                        temperature=1.0 if req.temperature is None else req.temperature,
                        top_p=1.0 if req.top_p is None else req.top_p,
                        seed=None if req.seed is None else (req.seed + i) % 2**63,
                        ignore_eos=req.ignore_eos,
                        logprobs=req.num_logprobs(),
                    )
                )
            except ConfigError as e:
                raise ApiError(400, str(e), code="invalid_value") from None
        return out

    async def submit(self, rid: str, ids: list[int], params: SamplingParams, stops, arrival, param):
        try:
            return await self.engine_loop.submit(
                rid, ids, params, StopChecker(self.tok, stops) if stops else None, arrival
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

    async def submit_choices(self, rid, ids, params: list[SamplingParams], stops, arrival, param, echo: str):
        """Submit one engine request per choice; if one is refused, abort those already queued."""
        choices: list[_Choice] = []
        try:
            for i, p in enumerate(params):
                crid = rid if len(params) == 1 else f"{rid}-{i}"
                handle = await self.submit(crid, ids, p, stops, arrival, param)
                choices.append(_Choice(i, crid, handle, TextAssembler(self.tok, stops), echo))
        except BaseException:
            for c in choices:
                self.engine_loop.abort(c.rid)
            raise
        return choices

    # ------------------------------------------------------------------ generation
    async def watch_disconnect(self, request: Request, choices: list[_Choice]) -> None:
        # The body is read, so the next ASGI message is http.disconnect: sent when the client
        # goes away (or the response completes; an abort of a finished request is ignored).
        # Blocking on it costs nothing per request, unlike polling is_disconnected().
        while (await request.receive())["type"] != "http.disconnect":
            pass
        for c in choices:
            self.engine_loop.abort(c.rid)

    @staticmethod
    async def events(choices: list[_Choice]):
        """``(choice, RequestOutput)`` as the engine reports them, the choices interleaved,
        until every choice's request has finished."""
        if len(choices) == 1:
            (c,) = choices
            while True:
                out = await c.handle.queue.get()
                yield c, out
                if out.finished:
                    return
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(c: _Choice) -> None:
            while True:
                out = await c.handle.queue.get()
                merged.put_nowait((c, out))
                if out.finished:
                    return

        tasks = [asyncio.create_task(pump(c)) for c in choices]
        try:
            left = len(choices)
            while left:
                c, out = await merged.get()
                left -= out.finished
                yield c, out
        finally:
            for t in tasks:
                t.cancel()

    def take(self, c: _Choice, out, n_lp: int | None) -> list[P.TokenLogprob]:
        """Fold one output into its choice; the new tokens' logprob entries (``n_lp``: the
        alternatives asked for, None: no logprobs)."""
        pieces = self.pieces
        c.asm.push(out.new_token_ids)
        c.n_out += len(out.new_token_ids)
        new = []
        if n_lp is not None:
            for t, alts in zip(out.new_token_ids, out.new_logprobs or (), strict=False):
                text, raw = pieces(t)
                # The dict lists the most likely tokens first, then the generated one if apart.
                top = [(*pieces(a), v) for a, v in list(alts.items())[:n_lp]]
                new.append(P.TokenLogprob(text, raw, alts[t], top))
                c.offsets.append(c.text_pos)
                c.text_pos += 0 if pieces.is_special(t) else len(text)
            c.logprobs.extend(new)
        if c.asm.stopped and not out.finished:
            c.finish = "stop"  # the text holds a stop string the engine missed
            self.engine_loop.abort(c.rid)
        elif out.finished:
            c.finish, c.error, c.done = out.finish_reason, out.error, True
            c.asm.finish()
        return new

    @staticmethod
    def failure(choices: list[_Choice]) -> ApiError | None:
        for c in choices:
            if c.finish == "error":
                return ApiError(
                    500, c.error or "the request failed", type_="server_error", code="engine_error"
                )
        for c in choices:
            if c.finish == "abort":
                return ApiError(503, "the request was aborted", type_="server_error", code="aborted")
        return None

    async def run(self, request: Request, req, rid: str, choices: list[_Choice], n_prompt: int, chat: bool):
        # The watcher starts here, not inside the stream: if the response never starts (the
        # client left already), nothing would run the stream's cleanup.
        watcher = asyncio.create_task(self.watch_disconnect(request, choices))
        if req.stream:
            return StreamingResponse(
                self.stream(req, rid, choices, n_prompt, chat, watcher),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            async with aclosing(self.events(choices)) as evs:
                async for c, out in evs:
                    if c.finish is None:
                        self.take(c, out, req.num_logprobs())
                    if all(x.finish is not None for x in choices):
                        break
        finally:  # also when the handler is cancelled (shutdown)
            watcher.cancel()
            for c in choices:
                if not c.done:
                    self.engine_loop.abort(c.rid)
        err = self.failure(choices)
        if err is not None:
            raise err
        want_lp = req.num_logprobs() is not None
        body = []
        for c in choices:
            text = c.echo + c.asm.text
            if chat:
                lp = P.chat_logprobs(c.logprobs) if want_lp else None
                body.append(P.chat_choice(c.index, text, c.finish, lp))
            else:
                lp = P.completion_logprobs(c.logprobs, c.offsets) if want_lp else None
                body.append(P.completion_choice(c.index, text, c.finish, lp))
        build = P.chat_response if chat else P.completion_response
        return JSONResponse(build(rid, req.model, body, n_prompt, sum(c.n_out for c in choices)))

    async def stream(self, req, rid, choices: list[_Choice], n_prompt, chat, watcher: asyncio.Task):
        """The SSE body. # Cancel safety: cancelled or closed early, it aborts the requests."""
        model, t0 = req.model, int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        with_usage = req.include_usage
        want_lp = req.num_logprobs() is not None

        def chunk(c: _Choice, text: str, finish: str | None, lp: list[P.TokenLogprob], first=False) -> str:
            if chat:
                delta = {"role": "assistant", "content": text} if first else {"content": text}
                logprobs = P.chat_logprobs(lp) if want_lp and not first else None
                choice = P.chat_delta(c.index, delta if text or first else {}, finish, logprobs)
            else:
                logprobs = None
                if want_lp and not first:
                    logprobs = P.completion_logprobs(lp, c.offsets[len(c.offsets) - len(lp) :])
                choice = P.completion_choice(c.index, text, finish, logprobs)
            return _sse(P.chunk(rid, obj, model, t0, [choice], with_usage))

        try:
            for c in choices:
                if chat:
                    yield chunk(c, "", None, [], first=True)
                elif c.echo:
                    yield chunk(c, c.echo, None, [], first=True)
            async with aclosing(self.events(choices)) as evs:
                async for c, out in evs:
                    if c.finish is not None:
                        continue  # stopped by a stop string; its abort's report
                    lp = self.take(c, out, req.num_logprobs())
                    if c.finish is None:
                        piece = c.asm.delta()
                        if piece or lp:
                            yield chunk(c, piece, None, lp)
                        continue
                    if c.finish in ("error", "abort"):
                        err = self.failure([c])
                        yield _sse(P.error_body(err.message, "server_error", None, f"engine_{c.finish}"))
                        return
                    yield chunk(c, c.asm.delta(final=True), c.finish, lp)
                    if all(x.finish is not None for x in choices):
                        break
            if with_usage:
                yield _sse(P.usage_chunk(rid, obj, model, t0, n_prompt, sum(c.n_out for c in choices)))
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            for c in choices:
                if not c.done:
                    self.engine_loop.abort(c.rid)

    def card(self, name: str) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "oasiskv",
            "max_model_len": self.ctx,
        }


# ---------------------------------------------------------------------- routes, by family
def _add_error_handlers(app: FastAPI, srv: _Server) -> None:
    """Every refusal as an OpenAI error body (and the bad-request and overload counters)."""
    metrics = srv.metrics

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


def _add_completion_routes(app: FastAPI, srv: _Server) -> None:
    """``POST /v1/completions``."""

    @app.post("/v1/completions")
    async def completions(request: Request):
        arrival = time.monotonic()
        req = srv.validate(P.CompletionRequest, await srv.read_json(request))
        prompt = req.prompt_input()
        if isinstance(prompt, str):
            srv.check(prompt, "prompt")
        ids = await srv.encode(prompt, "prompt")
        params = srv.sampling(req, len(ids), "prompt")
        echo = ""
        if req.echo:
            echo = prompt if isinstance(prompt, str) else token_text(srv.tok, ids)
        rid = f"cmpl-{uuid.uuid4().hex}"
        choices = await srv.submit_choices(rid, ids, params, req.stop_strings(), arrival, "prompt", echo)
        return await srv.run(request, req, rid, choices, len(ids), chat=False)


def _add_chat_routes(app: FastAPI, srv: _Server) -> None:
    """``POST /v1/chat/completions``."""

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        arrival = time.monotonic()
        req = srv.validate(P.ChatCompletionRequest, await srv.read_json(request))
        tok = srv.tok
        if tok is None:
            raise ApiError(400, "this model has no tokenizer, so no chat template; use /v1/completions")
        for i, m in enumerate(req.messages):
            srv.check(m.text(), f"messages[{i}].content")
        try:
            text = await asyncio.to_thread(tok.apply_chat_template, req.template_messages())
        except ConfigError as e:
            raise ApiError(400, str(e), param="messages", code="invalid_messages") from None
        ids = await srv.encode(text, "messages")
        params = srv.sampling(req, len(ids), "messages")
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        choices = await srv.submit_choices(rid, ids, params, req.stop_strings(), arrival, "messages", "")
        return await srv.run(request, req, rid, choices, len(ids), chat=True)


def _add_info_routes(app: FastAPI, srv: _Server) -> None:
    """``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health`` and ``GET /metrics``."""
    config, engine_loop, metrics = srv.config, srv.engine_loop, srv.metrics

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [srv.card(m) for m in config.model_names]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id not in config.model_names:
            raise srv.not_served(model_id)
        return srv.card(model_id)

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


def build_app(llm_engine: LLMEngine, config: ServeConfig) -> FastAPI:
    """The FastAPI app serving ``llm_engine``. Its lifespan starts the engine thread and stops
    it (aborting whatever runs) at shutdown; from then on only that thread touches the engine."""
    srv = _Server(llm_engine, config)
    engine_loop = srv.engine_loop

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
    app.add_middleware(_BearerAuth, api_key=config.api_key, on_reject=srv.metrics.reject)
    _add_error_handlers(app, srv)
    _add_completion_routes(app, srv)
    _add_chat_routes(app, srv)
    _add_info_routes(app, srv)
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
