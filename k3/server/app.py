"""The ASGI application of `k3 serve` (Starlette) and the uvicorn server around it.

Endpoints: POST /v1/chat/completions, POST /v1/completions (both streaming over SSE or
not), GET /v1/models[/{model}], GET /health, GET /metrics (Prometheus text). Every
error is an OpenAI error object {"error": {"message", "type", "param", "code"}}. With an
API key every request needs ``Authorization: Bearer KEY`` (401 otherwise).

A client that goes away - while its request waits for a slot, while its prompt is read,
or mid-stream - is noticed at once (the connection's http.disconnect) and its slot is
freed before the next step. Ctrl-C (or SIGTERM) drains: the listening socket closes, new
requests on open connections get 503, the requests in flight finish; a second Ctrl-C
stops at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import signal
import threading
from typing import Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from . import protocol
from .metrics import Metrics
from .protocol import ApiError, ChatAnswer, CompletionAnswer, GenRequest, ModelContext
from .scheduler import Job, Scheduler

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


class ClientGone(Exception):
    pass


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or 413 past ``limit`` bytes (a declared length over it is refused
    unread when it is far over, so that a huge upload is not received at all)."""
    cl = request.headers.get("content-length")
    too_big = ApiError(413, f"The request body is larger than this server accepts ({limit} bytes, "
                            "--max-body-bytes).", code="request_too_large")
    if cl is not None:
        try:
            n = int(cl)
        except ValueError:
            raise protocol.bad("Content-Length is not a number.") from None
        if n > limit:
            if n <= 16 * limit:  # read it away so the client sees the answer, not a reset
                async for _ in request.stream():
                    pass
            raise too_big
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


async def _watch_disconnect(receive) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


async def _next_event(job: Job, watcher: asyncio.Task) -> dict:
    get = asyncio.ensure_future(job.events.get())
    done, _ = await asyncio.wait({get, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if get in done:
        return get.result()
    get.cancel()
    raise ClientGone


def _event_error(ev: dict) -> ApiError:
    status = int(ev.get("status", 500))
    return ApiError(status, ev.get("message", "error"), type="server_error" if status >= 500 else "invalid_request_error",
                    code=ev.get("code"))


class Server:
    """The application: routes over one Scheduler and one ModelContext."""

    def __init__(self, sched: Scheduler, ctx: ModelContext, metrics: Metrics, *, api_key: str | None = None,
                 max_body: int = 1 << 20, log: Callable[[str], None] | None = None):
        self.sched, self.ctx, self.metrics = sched, ctx, metrics
        self.api_key = api_key.encode() if api_key else None
        self.max_body = int(max_body)
        self.log = log or (lambda m: None)
        routes = [
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
        ]
        self.app = Starlette(routes=routes, exception_handlers={HTTPException: self._http_error,
                                                                Exception: self._internal_error})

    # ------------------------------------------------------------ ASGI front: auth + request counts
    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [0]

        async def counting_send(msg):
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            await send(msg)

        try:
            if self.api_key is not None and not self._authorized(scope):
                e = ApiError(401, "Incorrect or missing API key: send it as 'Authorization: Bearer KEY'.",
                             code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await error_response(e)(scope, receive, counting_send)
            else:
                await self.app(scope, receive, counting_send)
        finally:
            path = scope.get("path", "")
            ep = path if path in ENDPOINTS else "/v1/models" if path.startswith("/v1/models/") else "other"
            self.metrics.request(ep, status[0] or 499)  # 499: the client went away before an answer

    def _authorized(self, scope) -> bool:
        for k, v in scope.get("headers", []):
            if k == b"authorization":
                scheme, _, key = v.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(), self.api_key)
        return False

    async def _http_error(self, request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        msg = {404: f"No such endpoint: {request.method} {request.url.path}.",
               405: f"{request.method} is not allowed on {request.url.path}."}.get(exc.status_code, str(exc.detail))
        return JSONResponse(protocol.error_body(msg, "invalid_request_error", None, code), status_code=exc.status_code)

    async def _internal_error(self, request, exc: Exception):
        self.log(f"k3 serve: internal error on {request.url.path}: {type(exc).__name__}: {exc}")
        return JSONResponse(protocol.error_body(f"Internal error ({type(exc).__name__}); this is a bug in k3.",
                                                "server_error", None, "internal_error"), status_code=500)

    # ------------------------------------------------------------ small endpoints
    def _model_card(self) -> dict:
        return {"id": self.ctx.name, "object": "model", "created": int(self.metrics.started), "owned_by": "k3",
                "max_context": self.ctx.max_context}

    async def models(self, request):
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request):
        name = request.path_params["model"]
        if name != self.ctx.name:
            return error_response(ApiError(404, f"The model '{name}' does not exist.", param="model",
                                           code="model_not_found"))
        return JSONResponse(self._model_card())

    async def health(self, request):
        s = self.sched
        ok = not s.draining and s.error is None
        body = {"status": "ok" if ok else "draining" if s.error is None else "failed",
                "model": self.ctx.name, "active": s.active, "queued": s.queued,
                "max_batch": self.metrics.gauges["max_batch"], "max_queue": s.max_queue}
        eng = s.engine
        if eng is not None:  # what a pass costs: the plan's price for its batch, and what the passes so far taught
            body["read_per_token"] = {"planned": eng.plan.read_per_token, "priced_for_batch": eng.plan.sequences,
                                      "pass_cost": eng.pass_cost.as_dict() if eng.pass_cost is not None else None}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def prometheus(self, request):
        return PlainTextResponse(self.metrics.render(self.ctx.name), media_type="text/plain; version=0.0.4")

    # ------------------------------------------------------------ generation
    async def chat(self, request):
        return await self._generate(request, protocol.parse_chat)

    async def completions(self, request):
        return await self._generate(request, protocol.parse_completion)

    async def _generate(self, request: Request, parse) -> Response:
        try:
            body = protocol.parse_json_body(await read_body(request, self.max_body))
            g = parse(body, self.ctx)
            job = Job(g, asyncio.get_running_loop(), asyncio.Queue())
            self.sched.submit(job)
        except ApiError as e:
            return error_response(e)
        watcher = asyncio.ensure_future(_watch_disconnect(request.receive))
        handed = False
        try:
            first = await _next_event(job, watcher)  # admitted (or refused) before any byte is sent
            if first["type"] == "error":
                return error_response(_event_error(first))
            job.cached = first.get("cached", 0)
            if g.stream:
                handed = True  # the stream owns the watcher and the job from here
                return _SSE(self, job, watcher)
            return await self._collect(job, watcher)
        except ClientGone:
            return Response(status_code=499)
        finally:
            if not handed:
                watcher.cancel()
                self.sched.cancel(job)  # a no-op once the job ended

    def _answer(self, g: GenRequest):
        if g.kind == "chat":
            return ChatAnswer(g.fmt, self.ctx.tokenizer, g.stops, thinking=g.thinking)
        return CompletionAnswer(self.ctx.tokenizer, g.stop_ids, g.stops)

    async def _collect(self, job: Job, watcher) -> Response:
        g = job.req
        ans = self._answer(g)
        tokens: list[int] = []
        finish = None
        while finish is None and not ans.stopped:
            ev = await _next_event(job, watcher)
            if ev["type"] == "error":
                return error_response(_event_error(ev))
            if ev["type"] == "tokens":
                for t in ev["tokens"]:
                    tokens.append(t)
                    ans.feed(t)
                    if ans.stopped:
                        break
                if ans.stopped:
                    self.sched.cancel(job)  # a stop string: free the slot now
            elif ev["type"] == "end":
                finish = ev["finish"]
        ans.finish()
        use = protocol.usage(len(g.prompt), len(tokens), job.cached)
        if g.kind == "chat":
            fr = protocol.finish_reason(finish, ans.stopped, bool(ans.tool_calls))
            choice = {"index": 0, "message": ans.message(), "logprobs": None, "finish_reason": fr}
            obj = "chat.completion"
            rid = protocol.new_id("chatcmpl")
        else:
            choice = {"index": 0, "text": ans.text, "logprobs": None,
                      "finish_reason": protocol.finish_reason(finish, ans.stopped)}
            obj = "text_completion"
            rid = protocol.new_id("cmpl")
        out = {"id": rid, "object": obj, "created": protocol.now(), "model": self.ctx.name,
               "system_fingerprint": protocol.SYSTEM_FINGERPRINT, "choices": [choice], "usage": use}
        if g.return_token_ids:
            choice["token_ids"] = tokens
            out["prompt_token_ids"] = g.prompt
        return JSONResponse(out)


class _SSE:
    """A streamed answer (text/event-stream, `data: {chunk}` lines, `data: [DONE]`)."""

    def __init__(self, server: Server, job: Job, watcher):
        self.server, self.job, self.watcher = server, job, watcher

    async def __call__(self, scope, receive, send):
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                    (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})
            async for data in self._frames():
                await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except (ClientGone, OSError):
            pass
        finally:
            self.watcher.cancel()
            self.server.sched.cancel(self.job)  # no-op once it ended

    async def _frames(self):
        srv, job = self.server, self.job
        g = job.req
        chat = g.kind == "chat"
        rid, created, model = protocol.new_id("chatcmpl" if chat else "cmpl"), protocol.now(), srv.ctx.name
        ans = srv._answer(g)

        def frame(obj) -> bytes:
            return b"data: " + json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n\n"

        def chunk(delta: dict | None = None, text: str | None = None, finish=None, token_ids=None) -> bytes:
            c = {"index": 0, "logprobs": None, "finish_reason": finish}
            if chat:
                c["delta"] = delta or {}
            else:
                c["text"] = text or ""
            if token_ids is not None:
                c["token_ids"] = token_ids
            obj = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                   "model": model, "system_fingerprint": protocol.SYSTEM_FINGERPRINT, "choices": [c]}
            if g.include_usage:
                obj["usage"] = None
            return frame(obj)

        def merged(deltas: list[dict]) -> dict:
            out: dict = {}
            for d in deltas:
                for k, v in d.items():
                    out[k] = out.get(k, "") + v
            return out

        if chat:
            yield chunk({"role": "assistant", "content": ""})
        n = 0
        finish = None
        while finish is None and not ans.stopped:
            ev = await _next_event(job, self.watcher)
            if ev["type"] == "error":
                yield frame(_event_error(ev).body())
                return
            if ev["type"] == "end":
                finish = ev["finish"]
                continue
            if ev["type"] != "tokens":
                continue
            used, pieces = [], []
            for t in ev["tokens"]:
                used.append(t)
                pieces.append(ans.feed(t))
                if ans.stopped:
                    break
            n += len(used)
            if ans.stopped:
                srv.sched.cancel(job)
            ids = used if g.return_token_ids else None
            if chat:
                d = merged([x for p in pieces for x in p])
                if d or ids is not None:
                    yield chunk(d, token_ids=ids)
            else:
                s = "".join(pieces)
                if s or ids is not None:
                    yield chunk(text=s, token_ids=ids)
        tail = ans.finish()
        if chat:
            d = merged(tail)
            if d:
                yield chunk(d)
            calls = ans.tool_calls
            if calls:
                yield chunk({"tool_calls": [dict(c, index=i) for i, c in enumerate(calls)]})
            yield chunk({}, finish=protocol.finish_reason(finish, ans.stopped, bool(calls)))
        else:
            if tail:
                yield chunk(text=tail)
            yield chunk(text="", finish=protocol.finish_reason(finish, ans.stopped))
        if g.include_usage:
            yield frame({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                         "created": created, "model": model, "system_fingerprint": protocol.SYSTEM_FINGERPRINT,
                         "choices": [], "usage": protocol.usage(len(g.prompt), n, job.cached)})
        yield b"data: [DONE]\n\n"


# ====================================================================== the HTTP server
def make_server(app, sock, *, verbose: bool, on_signal: Callable[[int, bool], None]):
    """A uvicorn server on the already-bound ``sock`` that calls ``on_signal(sig,
    first)`` on Ctrl-C / SIGTERM: the first drains (uvicorn stops accepting and waits
    for the connections in flight), a second Ctrl-C stops at once."""
    import uvicorn

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # like uvicorn's, without re-raising the signal afterwards: a drained stop is a clean exit
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            prev = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, h in prev.items():
                    signal.signal(s, h)

        def handle_exit(self, sig, frame):
            first = not self.should_exit
            super().handle_exit(sig, frame)
            on_signal(sig, first)

    config = uvicorn.Config(app, log_level="info" if verbose else "warning", access_log=verbose, lifespan="off",
                            timeout_graceful_shutdown=None, server_header=False)
    server = _Server(config)
    return server, (lambda: server.run(sockets=[sock]))


def bind(host: str, port: int):
    """A listening TCP socket on host:port (port 0: any free port)."""
    import socket

    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    last = None
    for family, kind, proto, _, addr in infos:
        s = socket.socket(family, kind, proto)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind(addr)
            s.listen(2048)
            s.set_inheritable(True)
            return s
        except OSError as e:
            s.close()
            last = e
    raise last if last is not None else OSError(f"cannot resolve {host}")


def is_loopback(host: str) -> bool:
    import ipaddress
    import socket

    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback
                   for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM))
    except (OSError, ValueError):
        return False


