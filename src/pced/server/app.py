"""The FastAPI app: OpenAI-compatible chat completions, the ``pced ask --json`` contract over
HTTP, health, models, and the page at ``/``.

Every refusal is a 4xx with ``{"error": {"message", "type", "param", "code"}}``; unexpected
failures are a 500 with the same shape and no traceback (that goes to the server log). A server
that cannot answer (it drains, or its engine died) says so with a 503 of that shape, and /health
answers 503 ``not ready`` naming the cause.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..decoding.loop import TimeLimitError
from ..errors import EngineDeadError, UserError
from ..options import AskOptions
from .responses import (SSE_DONE, chat_completion, clean, error_body, final_chunk, first_chunk, new_id,
                        pced_contract, sse, token_chunk)
from .schemas import AnswerRequest, ChatRequest, Limits, RequestError, answer_job, chat_job, form_defaults
from .worker import Finished, Run, Started, Worker, engine_dead, is_client_error, is_data_error, next_event

STATIC = Path(__file__).parent / "static"
KEEPALIVE_S = 1.0  # a queued stream gets a comment this often until its generation starts
log = logging.getLogger("pced.server")


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def error_response(status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                   param: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, code, param), status_code=status, headers=headers)


def as_request_error(exc: BaseException) -> RequestError:
    """The error body of a failed generation, by the error's kind (never by ValueError: a bug in a
    library is not the client's fault)."""
    if isinstance(exc, RequestError):
        return exc
    if is_client_error(exc):
        return RequestError(str(exc), None, getattr(exc, "code", None) or "invalid_value")
    if isinstance(exc, EngineDeadError):
        return engine_dead(str(exc))
    if isinstance(exc, TimeLimitError):
        return RequestError(f"{exc}; ask for fewer tokens or documents", None, exc.code, status=504, type_="server_error")
    if is_data_error(exc):
        return RequestError(str(exc), None, exc.code, status=500, type_="server_error")
    return RequestError("internal error while generating (details are in the server log)", None, "internal_error",
                        status=500, type_="server_error")


def open_with_key(path: str) -> bool:
    """The page and its static files stay open with --api-key: they are the same files for every
    server (no model, document or queue in them), and the page must load to let its user type the key.
    ``/defaults`` is the form those files start from: pced's defaults and the request limits, nothing
    about the model, the documents or the queue."""
    return path in ("/", "/defaults") or path.startswith("/static/")


def _split_host(value: str) -> tuple[str, int | None]:
    """``Host`` header -> (name, port); port None when absent or not a number."""
    value = value.strip().lower()
    if value.startswith("["):  # [::1]:8000
        name, _, rest = value[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    else:
        name, _, port = value.rpartition(":") if value.count(":") == 1 else (value, "", "")
    return name, int(port) if port.isdigit() else None


def host_allowed(header: str, server: tuple | None, names: tuple[str, ...] = ()) -> bool:
    """Whether a ``Host`` header names this server: a loopback name, the address the connection
    arrived on, or a name it was bound as, with the port it listens on (DNS-rebinding protection)."""
    name, port = _split_host(header)
    local_host, local_port = (server[0], server[1]) if server else (None, None)
    if local_port is not None and (port if port is not None else 80) != local_port:
        return False
    allowed = {"localhost", "127.0.0.1", "::1", *(n.lower().strip("[]") for n in names)}
    if local_host:
        allowed.add(str(local_host).lower())
    return bool(name) and name in allowed


class Guard:
    """ASGI middleware: the API key on every route but the page's static files, or without a key
    the Host check; then the request-body size limit (413)."""

    def __init__(self, app, max_body_bytes: int, api_key: str | None, hosts: tuple[str, ...] = ()):
        self.app, self.max_body_bytes, self.api_key, self.hosts = app, max_body_bytes, api_key, hosts

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        path = scope["path"]
        if self.api_key and not open_with_key(path):
            given = headers.get("authorization", "")
            token = given[7:].strip() if given[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(token.encode(), self.api_key.encode()):
                message = "missing or invalid API key: send 'Authorization: Bearer KEY'"
                response = error_response(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        if not self.api_key and not host_allowed(headers.get("host", ""), scope.get("server"), self.hosts):
            message = ("this server answers requests for its own address only (Host "
                       f"{headers.get('host', '')!r}); use 127.0.0.1 or localhost, or start it with --api-key")
            return await error_response(400, message, code="invalid_host")(scope, receive, send)
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return await error_response(400, "invalid Content-Length", code="invalid_request")(scope, receive, send)
            if int(length) > self.max_body_bytes:
                return await self._too_large(scope, receive, send)
            return await self.app(scope, receive, send)
        if headers.get("transfer-encoding", "").lower() != "chunked":
            return await self.app(scope, receive, send)
        body, more = b"", True  # a chunked body: read it here, up to the limit, then replay it
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                return await self._too_large(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send):
        message = f"request body larger than {self.max_body_bytes} bytes"
        return await error_response(413, message, code="request_too_large")(scope, receive, send)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None, str]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None, "invalid_request"
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return f"malformed JSON body{': ' + str(detail) if detail else ''}", None, "invalid_json"
    if first.get("type") == "missing" and not loc:
        return "the request needs a JSON object body", None, "missing_body"
    param = ".".join(loc) or None
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{param or 'body'}: {first.get('msg', 'invalid value')}{more}", param, "invalid_value"


def create_app(store, limits: Limits = Limits(), api_key: str | None = None, model_id: str | None = None,
               backend: str = AskOptions.backend, settings=None, hosts: tuple[str, ...] = (),
               request_cache_dir: str | None = None) -> FastAPI:
    """An app over an opened DocumentStore, answering with ``backend`` (and its ``settings``) what it
    runs and with the default backend the rest, each in its worker lane (``server.worker``). Without
    ``api_key`` it answers only Host headers that name it (loopback names, the address a request
    arrived on, and ``hosts``: the names it was bound as). ``request_cache_dir``: where request
    documents' caches go (None: the user cache, per model)."""
    worker = Worker(store, limits, backend, settings, request_cache_dir)
    model_name = model_id or worker.llm.name

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.watch_store(limits.store_poll_s)
        yield
        worker.close()

    app = FastAPI(title="pced", description="Parallel Context-of-Experts Decoding", lifespan=lifespan,
                  docs_url=None, redoc_url=None)
    app.state.worker = worker
    app.add_middleware(Guard, max_body_bytes=limits.max_body_bytes, api_key=api_key, hosts=tuple(hosts))

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError):
        return error_response(exc.status, exc.message, exc.type, exc.code, exc.param)

    @app.exception_handler(UserError)
    async def _user_error(request: Request, exc: UserError):  # a setting a dataclass refused on the way in
        return error_response(400, str(exc), code=exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        message, param, code = _validation_message(exc)
        return error_response(400, message, code=code, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(exc.status_code, str(exc.detail), type_, code=f"http_{exc.status_code}",
                              headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.error("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(500, "internal server error (details are in the server log)", "server_error", "internal_error")

    async def start(job, request: Request) -> tuple[Run, Started]:
        return await started_run(worker.submit(job), request)

    async def started_run(run: Run, request: Request) -> tuple[Run, Started]:
        try:
            kind, payload = await next_event(run, request.is_disconnected)
        except BaseException:
            run.cancel()
            raise
        if kind == "error":
            raise as_request_error(payload)
        if kind == "cancelled":
            raise ClientGone()
        return run, payload

    async def finish(run: Run, request: Request) -> Finished:
        try:
            while True:
                kind, payload = await next_event(run, request.is_disconnected)
                if kind == "done":
                    return payload
                if kind == "error":
                    raise as_request_error(payload)
                if kind == "cancelled":
                    raise ClientGone()
        finally:
            run.cancel()  # a no-op once done; stops the worker if this request was abandoned

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone):
        return Response(status_code=499)

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(STATIC / "index.html", media_type="text/html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/health")
    async def health():
        refusal = worker.refusal()
        body = {"status": "ok", "model": model_name, "documents": len(worker.store.documents), "pending": worker.pending,
                "last_tokens": worker.last_tokens, **worker.counts, "backend": worker.backend_health(),
                "kv_pool": worker.pool_health(), "store": worker.store_health(),
                "request_cache": worker.request_cache_health()}
        if refusal is None:
            return body
        return JSONResponse(clean({**body, "status": "not ready", "reason": refusal.code, "message": refusal.message}),
                            status_code=503)

    @app.get("/metrics", include_in_schema=False)
    async def metrics():
        from .metrics import CONTENT_TYPE

        return Response(worker.metrics.exposition(), media_type=CONTENT_TYPE)

    @app.get("/defaults")
    async def defaults():
        """The page asks what the CLI asks: its form reads these instead of numbers of its own."""
        return form_defaults(limits)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "pced"}]}

    @app.post("/v1/pced/answer")
    async def pced_answer(body: AnswerRequest, request: Request):
        """The ``pced ask --json`` contract: {answer, method, experts, trace, beta, timings, ...}."""
        run, started = await start(answer_job(body, limits), request)
        finished = await finish(run, request)
        return JSONResponse(clean(pced_contract(started, finished)))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        job = chat_job(body, limits)
        completion_id = new_id()
        if not body.stream:
            run, started = await start(job, request)
            finished = await finish(run, request)
            return JSONResponse(clean(chat_completion(completion_id, model_name, started, finished)))
        run = worker.submit(job)
        if worker.ahead_of(run) == 0:  # it starts now: its errors can still be a status code
            run, started = await started_run(run, request)
            return stream(run, started, completion_id, body.pced.method)
        return stream(run, None, completion_id, body.pced.method)  # queued: headers and a comment at once

    def stream(run: Run, started: Started | None, completion_id: str, method: str) -> StreamingResponse:
        def closing(kind: str, payload) -> list[str]:
            if kind != "error":  # cancelled: the client is gone, nobody reads
                return []
            exc = as_request_error(payload)
            return [sse(error_body(exc.message, exc.type, exc.code, exc.param)), SSE_DONE]

        async def events():
            nonlocal started
            try:
                while started is None:  # queued behind others: say so at once, then keep the connection alive
                    yield f": queued, {worker.ahead_of(run)} request(s) ahead\n\n"
                    try:
                        kind, payload = await asyncio.wait_for(run.events.get(), KEEPALIVE_S)
                    except asyncio.TimeoutError:
                        continue
                    if kind != "start":
                        for chunk in closing(kind, payload):
                            yield chunk
                        return
                    started = payload
                yield sse(first_chunk(completion_id, model_name, method, started))
                while True:
                    kind, payload = await run.events.get()
                    if kind == "token":
                        if payload.text:
                            yield sse(token_chunk(completion_id, model_name, payload))
                        continue
                    if kind == "done":
                        yield sse(final_chunk(completion_id, model_name, started, payload))
                        yield SSE_DONE
                    else:
                        for chunk in closing(kind, payload):
                            yield chunk
                    return
            finally:
                run.cancel()  # the client went away (the stream task was cancelled) or we are done

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return app
