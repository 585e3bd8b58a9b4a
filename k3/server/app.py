"""The ASGI application of `k3 serve` (Starlette) and the uvicorn server around it.

Endpoints: POST /v1/chat/completions, POST /v1/completions (both streaming over SSE or
not), POST /v1/messages and /v1/messages/count_tokens (Anthropic's API, k3.server.anthropic),
GET /v1/models[/{model}], GET /health, GET /metrics (Prometheus text). Every error is an
OpenAI error object {"error": {"message", "type", "param", "code"}} (Anthropic's shape on
/v1/messages). With an API key every request but GET /health needs ``Authorization:
Bearer KEY`` or ``x-api-key: KEY`` (401 otherwise).

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

from .. import interrupt
from . import anthropic as anthropic_api
from . import protocol
from .metrics import Metrics
from .protocol import ApiError, ChatAnswer, CompletionAnswer, GenRequest, ModelContext
from .scheduler import Job, Scheduler

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens", "/v1/models",
             "/health", "/metrics")


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
            Route("/v1/messages", self.messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
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
            scope["k3.authorized"] = self.api_key is None or self._authorized(scope)
            # /health stays open, so a load balancer's probe needs no key (without it the
            # answer says only whether the server is up and how many requests it holds)
            if not scope["k3.authorized"] and not (scope.get("path") == "/health"
                                                    and scope.get("method") in ("GET", "HEAD")):
                e = ApiError(401, "Incorrect or missing API key: send it as 'Authorization: Bearer KEY' (or "
                                  "'x-api-key: KEY').", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                resp = _anthropic_error(e) if scope.get("path", "").startswith("/v1/messages") else error_response(e)
                await resp(scope, receive, counting_send)
            else:
                await self.app(scope, receive, counting_send)
        finally:
            path = scope.get("path", "")
            ep = path if path in ENDPOINTS else "/v1/models" if path.startswith("/v1/models/") else "other"
            self.metrics.request(ep, status[0] or 499)  # 499: the client went away before an answer

    def _authorized(self, scope) -> bool:
        """The key as OpenAI's clients send it (Authorization: Bearer) or Anthropic's (x-api-key)."""
        for k, v in scope.get("headers", []):
            if k == b"authorization":
                scheme, _, key = v.partition(b" ")
                if scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(), self.api_key):
                    return True
            elif k == b"x-api-key" and hmac.compare_digest(v.strip(), self.api_key):
                return True
        return False

    async def _http_error(self, request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        msg = {404: f"No such endpoint: {request.method} {request.url.path}.",
               405: f"{request.method} is not allowed on {request.url.path}."}.get(exc.status_code, str(exc.detail))
        return self._error(request, ApiError(exc.status_code, msg, code=code))

    async def _internal_error(self, request, exc: Exception):
        self.log(f"k3 serve: internal error on {request.url.path}: {type(exc).__name__}: {exc}")
        return self._error(request, ApiError(500, f"Internal error ({type(exc).__name__}); this is a bug in k3.",
                                             type="server_error", code="internal_error"))

    @staticmethod
    def _error(request, e: ApiError) -> JSONResponse:
        """In Anthropic's shape on its API's paths, else OpenAI's."""
        return _anthropic_error(e) if request.url.path.startswith("/v1/messages") else error_response(e)

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
        # what a pass costs (the plan's price for its batch, what the passes so far taught): only with the key
        if eng is not None and request.scope.get("k3.authorized", True):
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

    async def messages(self, request):
        def parse(body, ctx):
            return protocol.parse_chat(anthropic_api.to_chat_body(body), ctx)
        return await self._generate(request, parse, anthropic=True)

    async def count_tokens(self, request):
        try:
            body = protocol.parse_json_body(await read_body(request, self.max_body))
            chat = anthropic_api.to_chat_body(body, count_only=True)
            protocol.check_model(chat, self.ctx)
            prompt = protocol.render_chat(chat, self.ctx)[0]
        except ApiError as e:
            return _anthropic_error(e)
        return JSONResponse({"input_tokens": len(prompt)})

    async def _generate(self, request: Request, parse, anthropic: bool = False) -> Response:
        err = _anthropic_error if anthropic else error_response
        try:
            body = protocol.parse_json_body(await read_body(request, self.max_body))
            g = parse(body, self.ctx)
            job = Job(g, asyncio.get_running_loop(), asyncio.Queue())
            self.sched.submit(job)
        except ApiError as e:
            return err(e)
        watcher = asyncio.ensure_future(_watch_disconnect(request.receive))
        handed = False
        try:
            first = await _next_event(job, watcher)  # admitted (or refused) before any byte is sent
            if first["type"] == "error":
                return err(_event_error(first))
            job.cached = first.get("cached", 0)
            if g.stream:
                handed = True  # the stream owns the watcher and the job from here
                return (_MessagesSSE if anthropic else _SSE)(self, job, watcher)
            if anthropic:
                got = await self._run(job, watcher)
                if isinstance(got, ApiError):
                    return err(got)
                ans, tokens, _, finish = got
                return JSONResponse(anthropic_api.message(self.ctx.name, ans, finish, len(g.prompt), len(tokens),
                                                          job.cached))
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

    def _logprobs(self, g: GenRequest, tokens: list[int], lps: list, offset: int = 0) -> dict | None:
        """The logprobs object of ``tokens`` (OpenAI's chat or legacy completions form;
        ``offset``: where their text starts in the answer, for text_offset)."""
        if g.logprobs is None:
            return None
        tok = self.ctx.tokenizer

        def text(t: int) -> tuple[str, list[int]]:
            b = tok.token_bytes(t) if tok is not None else str(t).encode()
            return b.decode("utf-8", errors="replace"), list(b)
        if g.kind == "chat":
            content = []
            for t, (lp, alts) in zip(tokens, lps):
                s, b = text(t)
                content.append({"token": s, "logprob": lp, "bytes": b,
                                "top_logprobs": [dict(zip(("token", "bytes"), text(a)), logprob=v) for a, v in alts]})
            return {"content": content, "refusal": None}
        strs = [text(t)[0] for t in tokens]
        offsets, off = [], offset
        for s in strs:
            offsets.append(off)
            off += len(s)
        return {"tokens": strs, "token_logprobs": [lp for lp, _ in lps],
                "top_logprobs": [{text(a)[0]: v for a, v in alts} for _, alts in lps] if g.logprobs else None,
                "text_offset": offsets}

    async def _run(self, job: Job, watcher):
        """The whole answer: (the Answer, its tokens, their logprobs, the engine's finish),
        or the ApiError that ended it."""
        g = job.req
        ans = self._answer(g)
        tokens: list[int] = []
        lps: list = []
        finish = None
        while finish is None and not ans.stopped:
            ev = await _next_event(job, watcher)
            if ev["type"] == "error":
                return _event_error(ev)
            if ev["type"] == "tokens":
                for j, t in enumerate(ev["tokens"]):
                    tokens.append(t)
                    if "logprobs" in ev:
                        lps.append(ev["logprobs"][j])
                    ans.feed(t)
                    if ans.stopped:
                        break
                if ans.stopped:
                    self.sched.cancel(job)  # a stop string: free the slot now
            elif ev["type"] == "end":
                finish = ev["finish"]
        ans.finish()
        return ans, tokens, lps, finish

    async def _collect(self, job: Job, watcher) -> Response:
        g = job.req
        got = await self._run(job, watcher)
        if isinstance(got, ApiError):
            return error_response(got)
        ans, tokens, lps, finish = got
        use = protocol.usage(len(g.prompt), len(tokens), job.cached)
        if g.kind == "chat":
            fr = protocol.finish_reason(finish, ans.stopped, bool(ans.tool_calls))
            choice = {"index": 0, "message": ans.message(), "logprobs": self._logprobs(g, tokens, lps),
                      "finish_reason": fr}
            obj = "chat.completion"
            rid = protocol.new_id("chatcmpl")
        else:
            choice = {"index": 0, "text": ans.text, "logprobs": self._logprobs(g, tokens, lps),
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

    async def _fed(self, ans):
        """The job's tokens fed to ``ans`` until the engine ends the job (``self.finish``
        then holds its finish) or a stop string: yields (the tokens fed, the pieces ``ans``
        gave for them, their event) per tokens event, or (the ApiError, None, None) for an
        error event, the last thing it yields."""
        self.finish = None
        while self.finish is None and not ans.stopped:
            ev = await _next_event(self.job, self.watcher)
            if ev["type"] == "error":
                yield _event_error(ev), None, None
                return
            if ev["type"] == "end":
                self.finish = ev["finish"]
                continue
            if ev["type"] != "tokens":
                continue
            used, pieces = [], []
            for t in ev["tokens"]:
                used.append(t)
                pieces.append(ans.feed(t))
                if ans.stopped:
                    break
            if ans.stopped:
                self.server.sched.cancel(self.job)
            yield used, pieces, ev

    async def _frames(self):
        srv, job = self.server, self.job
        g = job.req
        chat = g.kind == "chat"
        rid, created, model = protocol.new_id("chatcmpl" if chat else "cmpl"), protocol.now(), srv.ctx.name
        ans = srv._answer(g)

        def frame(obj) -> bytes:
            return b"data: " + json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n\n"

        def chunk(delta: dict | None = None, text: str | None = None, finish=None, token_ids=None,
                  logprobs=None) -> bytes:
            c = {"index": 0, "logprobs": logprobs, "finish_reason": finish}
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
        n = text_off = 0
        async for used, pieces, ev in self._fed(ans):
            if isinstance(used, ApiError):
                yield frame(used.body())
                return
            n += len(used)
            ids = used if g.return_token_ids else None
            lp = srv._logprobs(g, used, ev.get("logprobs", [])[:len(used)], text_off)   # each token's with it
            if lp is not None and not chat:
                text_off += sum(len(t) for t in lp["tokens"])
            if chat:
                d = merged([x for p in pieces for x in p])
                if d or ids is not None or lp is not None:
                    yield chunk(d, token_ids=ids, logprobs=lp)
            else:
                s = "".join(pieces)
                if s or ids is not None or lp is not None:
                    yield chunk(text=s, token_ids=ids, logprobs=lp)
        finish = self.finish
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


class _MessagesSSE(_SSE):
    """A streamed Messages answer: Anthropic's events (message_start, content_block_start
    / _delta / _stop per block, message_delta with the stop reason and usage,
    message_stop), an error as an ``error`` event."""

    async def _frames(self):
        srv, job = self.server, self.job
        g = job.req
        ans = srv._answer(g)
        es = anthropic_api.EventStream(srv.ctx.name, len(g.prompt), job.cached)
        for e, d in es.start():
            yield anthropic_api.frame(e, d)
        n = 0
        async for used, pieces, _ in self._fed(ans):
            if isinstance(used, ApiError):
                yield anthropic_api.frame("error", anthropic_api.api_error(used)[0])
                return
            n += len(used)
            for e, d in es.deltas([x for p in pieces for x in p]):
                yield anthropic_api.frame(e, d)
        for e, d in es.deltas(ans.finish()) + es.end(ans, self.finish, n):
            yield anthropic_api.frame(e, d)


def _anthropic_error(e: ApiError) -> JSONResponse:
    body, status = anthropic_api.api_error(e)
    return JSONResponse(body, status_code=status, headers=e.headers)


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
                # a signal recorded since the listening line was printed (k3.interrupt):
                # the first signal of a drained stop
                if interrupt.pending() is not None:
                    self.handle_exit(interrupt.pending(), None)
                    interrupt.clear(sigterm=True)
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


