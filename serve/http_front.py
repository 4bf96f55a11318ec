"""The HTTP front end: the app, its routes, admission, errors and streaming, over a worker pool.

``register`` puts ``POST /predict``, ``GET /health``, ``/info``, ``/stats``, ``/metrics`` and ``/`` on
the app (``serve.app.build_app`` makes it once the pool exists; the OpenAI-compatible routes are
``serve.openai_compat``'s). Every model route goes through ``Front.admit``, which covers what a bare
server leaves open:

- a request is checked against the served model and resolved once, here (``serve.schema.resolve``:
  422 naming the field); the pool gets the resolved ``Job``;
- at most ``max_in_flight`` requests are admitted (the pool's slots); the next gets 429 with
  ``Retry-After``;
- the pool's channel ends a request that no worker took within the queue timeout (504), whose worker
  died (503), or whose step never returns (504, past ``--request-timeout``);
- an error reaches the client with its status before a stream starts, and as an explicit error
  event after;
- a client that goes away cancels its job: a non-streaming one is noticed as its disconnect arrives,
  a streaming one when its stream is cut.

``ApiKeyMiddleware`` refuses every request without the key before routing, except to the public
paths; ``BodyLimitMiddleware`` answers 413 past ``--max-payload-bytes`` (from the Content-Length
alone when there is one); ``Overloaded`` is the 503 past ``--max-connections``. Every refusal
that sheds load (413, 429, 503) says so in the API's error shape, with ``Retry-After`` where coming
back later helps, and is counted (``serve.metrics``); ``HttpMetricsMiddleware``, outermost, times
every answer by route and status. This module knows the workers only through
``serve.pool.WorkerPool``.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lab import api_key as key_rule
from serve.engine import TOKEN_GAPS
from serve.metrics import CLIENT_GONE, Metrics
from serve.pool import Channel, PoolFull, WorkerPool
from serve.schema import ModelLimits, PredictRequest, PredictResponse, RequestError, error_event, resolve

OUTCOMES = ("done", "failed", "rejected", "timed_out", "worker_died", "cancelled")
"""How an admitted request ends: done (200), failed (500), rejected by the worker (4xx), timed_out
(504: not taken within the queue timeout, or past the request timeout), worker_died (503), cancelled
(the client left first)."""
OUTCOME_OF_STATUS = {503: "worker_died", 504: "timed_out", CLIENT_GONE: "cancelled"}
PUBLIC_PATHS = frozenset({"/health", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
"""What answers without the API key: load balancers' health checks, and the schema (no secrets).
``/metrics`` joins them with ``blocklab serve --metrics-public``."""
METRICS_PATH = "/metrics"
RETRY_AFTER_S = 1
"""What a shed request is told to wait before it comes back (``Retry-After``)."""
ERROR_RESPONSES = {
    400: {"description": "The body does not parse (not UTF-8, JSON too deep); under /v1/, any invalid body"},
    401: {"description": "Missing or wrong API key"},
    413: {"description": "Body over --max-payload-bytes"},
    422: {"description": "Invalid request, naming the field"},
    429: {"description": "--max-in-flight requests in flight; retry after Retry-After seconds"},
    500: {"description": "The request's processing raised; the message says what"},
    503: {"description": "The model is loading, or the worker running the request died"},
    504: {"description": "Queue timeout, or --request-timeout reached"},
}
"""What the model routes answer besides 200, for the OpenAPI schema."""


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "bytes"})


def openai_param(loc: list) -> str | None:
    """A validation error's place as OpenAI names a field (``messages[0].content``), without the
    members of a union pydantic tried (``stop.str``, ``stop.list[str].0``: ``stop``); None for the
    body itself."""
    param = ""
    for part in loc[1:]:  # after "body"
        if isinstance(part, int):
            param += f"[{part}]"
        elif part in _TYPE_NAMES or not part.isidentifier():  # "list[str]", "function-after[...]"
            break
        else:
            param += f".{part}" if param else part
    return param or None


def openai_status(status: int) -> int:
    """``status`` as the OpenAI routes answer it: an invalid request is 400 (OpenAI's and vLLM's, the
    ``openai`` client's ``BadRequestError``), not FastAPI's 422."""
    return 400 if status == 422 else status


def error_response(path: str, status: int, detail, headers: dict[str, str] | None = None) -> JSONResponse:
    """FastAPI's ``{"detail": ...}``, or under ``/v1/`` OpenAI's ``{"error": {"message": ...}}``, the
    shape its clients read the message from, with ``param`` naming the field at fault, and its status
    as those routes answer it (``openai_status``)."""
    if not (path.startswith("/v1/") or path == "/v1"):
        return JSONResponse({"detail": detail}, status_code=status, headers=headers)
    param = None
    if not isinstance(detail, str):  # a validation error list: the first error's field is OpenAI's param
        # (JSON that does not parse is the body's: its place is a character offset, no field)
        fields = [
            None if error.get("type") == "json_invalid" else openai_param(error["loc"]) for error in detail
        ]
        param = fields[0] if fields else None
        messages = dict.fromkeys(  # a union's members each failed: one message per field and reason
            f"{field or 'body'}: {error['msg'].removeprefix('Value error, ')}"
            for field, error in zip(fields, detail, strict=True)
        )
        detail = "; ".join(messages)
    status = openai_status(status)
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": detail, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


class ApiKeyMiddleware(key_rule.ApiKeyMiddleware):
    """``lab.api_key``'s rule (401 before routing, deny by default) with ``PUBLIC_PATHS`` (and
    ``also_public``) open and the 401 in the shape of the route (OpenAI's under ``/v1/``)."""

    def __init__(self, app: ASGIApp, api_key: str, also_public: frozenset[str] = frozenset()):
        public = PUBLIC_PATHS | also_public
        super().__init__(app, api_key, public=public.__contains__, refusal=error_response)


def _content_length(scope: Scope) -> int | None:
    """The request's Content-Length as a number (None: absent; httptools has refused a malformed one)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value)
    return None


class BodyLimitMiddleware:
    """413 for a body over ``max_bytes``: at once from its Content-Length, before a byte of it is
    read (the connection is then closed: the rest is not read either), or, chunked without one, once
    the bytes counted as they arrive pass it, so a large body is never held whole."""

    def __init__(self, app: ASGIApp, max_bytes: int, metrics: Metrics):
        self.app = app
        self.max_bytes = max_bytes
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        if length is not None and length > self.max_bytes:
            self.metrics.refused(413, "payload")
            message = f"Payload too large: {length} bytes, the most this server takes is {self.max_bytes}"
            response = error_response(scope["path"], 413, message, {"Connection": "close"})
            await response(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:  # FastAPI passes an HTTPException raised here through
                self.metrics.refused(413, "payload")
                raise HTTPException(413, "Payload too large")
            return message

        await self.app(scope, counted, send)


class Overloaded:
    """The ASGI app that answers a request past ``--max-connections`` (``serve.connections``): 503 in
    the API's error shape with ``Retry-After``, and the connection closed."""

    def __init__(self, max_connections: int, metrics: Metrics):
        self.max_connections = max_connections
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.metrics.refused(503, "connections")
        message = f"more than {self.max_connections} connections open, the most this server takes: retry"
        headers = {"Retry-After": str(RETRY_AFTER_S), "Connection": "close"}
        await error_response(scope["path"], 503, message, headers)(scope, receive, send)


class HttpMetricsMiddleware:
    """Times every HTTP request by its route's path template, method and status.

    ``routes``: the app's routes (matched here, before any other middleware, so a request refused
    by the API key is counted under its route too). Outermost, so every answer is seen.
    """

    def __init__(self, app: ASGIApp, metrics: Metrics, routes: list):
        self.app, self.metrics, self.routes = app, metrics, routes

    def route_of(self, scope: Scope) -> str:
        """The path template of the route ``scope`` is for (another method's too: its 405), else other.
        A request that reached the router has it already (Starlette's ``scope["route"]``, chosen by
        the same rule); one refused before routing is matched here."""
        if "route" in scope:
            return scope["route"].path
        partial = "other"
        for route in self.routes:
            match, _ = route.matches(scope)
            if match is Match.FULL:
                return route.path
            if match is Match.PARTIAL and partial == "other":
                partial = route.path
        return partial

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), 500  # an app that raises before answering: uvicorn's 500
        answered = False

        async def received() -> Message:
            nonlocal status
            message = await receive()
            if message["type"] == "http.disconnect" and not answered:  # what the app answers, nobody reads
                status = CLIENT_GONE
            return message

        async def seen(message: Message) -> None:
            nonlocal status, answered
            if message["type"] == "http.response.start" and status != CLIENT_GONE:
                status, answered = message["status"], True
            await send(message)

        try:
            await self.app(scope, received, seen)
        finally:
            elapsed = time.perf_counter() - start
            self.metrics.http.labels(self.route_of(scope), scope["method"], str(status)).observe(elapsed)


async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    """FastAPI's 422 without echoing the input back: a NaN or a lone surrogate there made FastAPI's own
    handler fail with 500, and a large bad body should not come back whole."""
    detail = [{"type": e["type"], "loc": list(e["loc"]), "msg": e["msg"]} for e in error.errors()]
    return error_response(request.url.path, 422, detail)


async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    return error_response(request.url.path, error.status_code, error.detail, error.headers)


async def _disconnected(client: Request) -> None:
    """Returns once the client has gone. Its body is read already, so the next ASGI message is the
    disconnect: this waits for it instead of asking again and again."""
    while (await client.receive())["type"] != "http.disconnect":
        pass


class Submission:
    """One admitted request: its events as they come, and its place in the pool until ``close``."""

    def __init__(self, front: Front, channel: Channel):
        self.front = front
        self.channel = channel
        self.outcome = "cancelled"  # until a last event says otherwise: the client left, or shutdown
        self.last: dict | None = None  # the done or error event, once it has come
        self.token_gaps: list[float] = []
        self._gone: asyncio.Future | None = None  # the disconnect watch, while a client is awaited

    async def next_event(self, client: Request | None = None) -> dict:
        """The next event; a ``done`` or ``error`` event is the last. With ``client``, a client that
        disconnects while this waits ends it with a 499 error event (``close`` then cancels the job)."""
        if client is not None and self._gone is None:
            self._gone = asyncio.ensure_future(_disconnected(client))
            self._gone.add_done_callback(self._client_left)
        return self._seen(await self.channel.next_event())

    def _client_left(self, watch: asyncio.Future) -> None:
        if not watch.cancelled():  # not ended by ``stop_watching``
            self.channel.interrupt(error_event(CLIENT_GONE, "client disconnected"))

    async def final_event(self, client: Request | None = None) -> dict:
        """Wait through any token events for the ``done`` or ``error`` event."""
        event = await self.next_event(client)
        while event["event"] not in ("done", "error"):
            event = await self.next_event(client)
        return event

    def stop_watching(self) -> None:
        """No more disconnect watch (a stream hands its client to the streaming response)."""
        if self._gone is not None:
            self._gone.cancel()
            self._gone = None

    def _seen(self, event: dict) -> dict:
        """Note a last event's outcome (``OUTCOMES``) as it passes (nothing is left to wait for, so
        the disconnect watch ends); returns it."""
        if event["event"] == "done":
            self.outcome = "done"
            self.token_gaps = event.pop(TOKEN_GAPS, [])  # for the metrics only: no client sees it
        elif event["event"] == "error":
            status = event["status"]
            self.outcome = OUTCOME_OF_STATUS.get(status, "rejected" if status < 500 else "failed")
        if event["event"] in ("done", "error"):
            self.last = event
            self.stop_watching()
        return event

    def close(self) -> None:
        """Free the slot; a job not finished yet is cancelled (its worker stops it at the next step)."""
        if self.channel.closed:
            return
        self.stop_watching()
        self.channel.close()
        self.front.ended[self.outcome] += 1
        limits = self.front.pool.limits()  # published once, kept while a worker is replaced
        n_layer = 0 if limits is None else limits.n_layer
        # Observed once the response now being answered is written (this runs in the event loop, which
        # turns to its next callback only then), not before it: the histograms are the slowest part
        # of a request's bookkeeping. Any later request, /metrics included, sees them.
        asyncio.get_running_loop().call_soon(
            self.front.metrics.ended, self.channel.job, self.outcome, self.last, self.token_gaps, n_layer
        )


class Front:
    """Admits requests to the pool and counts how they end."""

    def __init__(
        self,
        pool: WorkerPool,
        *,
        request_timeout: float = math.inf,
        default_blocks: str | None = None,
        max_prompts: int = 16,
        metrics: Metrics | None = None,
        retry_after_s: int = RETRY_AFTER_S,
        model_name: str = "MODEL",
    ):
        self.pool = pool
        self.request_timeout = request_timeout
        self.default_blocks = default_blocks
        self.max_prompts = max_prompts
        """The most prompts (slots) one request may take (``--max-prompts-per-request``)."""
        self.metrics = metrics or Metrics()
        self.metrics.watch(lambda: pool.stats())
        self.model_name = model_name  # as --model named it: errors say what to run for it
        self.retry_after_s = retry_after_s
        self.admitted = 0
        """Requests admitted so far."""
        self.ended = dict.fromkeys(OUTCOMES, 0)
        """How admitted requests ended, each in exactly one of ``OUTCOMES``: with the ones in flight
        they add up to ``admitted``."""

    def limits(self) -> ModelLimits | None:
        limits = self.pool.limits()
        if limits is None:
            return None
        return replace(limits, default_blocks=self.default_blocks, model_name=self.model_name)

    def admit(self, request: PredictRequest, needs: frozenset[str] = frozenset()) -> Submission:
        """Check, resolve and submit ``request``; HTTPException 422, 429 or 503 when it cannot be.
        ``needs``: ``serve.schema.resolve``'s."""
        return self.admit_all([request], needs)[0]

    def admit_all(
        self, requests: list[PredictRequest], needs: frozenset[str] = frozenset()
    ) -> list[Submission]:
        """``admit`` for the requests of one body (an OpenAI body's choices), all or none: every one is
        checked, and the pool's room for all of them, before any is submitted (a body refused is not
        a body cancelled: no worker sees its jobs)."""
        limits = self.limits()
        if limits is None:
            self.metrics.refused(503, "loading")
            raise HTTPException(503, "the model is still loading", headers=self._retry_after())
        jobs = []
        for request in requests:
            try:
                jobs.append(resolve(request, limits, timeout=self.request_timeout, needs=needs))
            except RequestError as error:
                raise HTTPException(422, error.detail()) from None
        channels = []
        try:
            room = self.pool.room()
            if room < len(jobs):
                raise PoolFull(
                    f"--max-in-flight: {room} slots free, {len(jobs)} needed; retry after Retry-After"
                )
            for job in jobs:
                channels.append(self.pool.submit(job))
        except BaseException as error:  # none of the body runs (none was submitted, unless room lied)
            for channel in channels:
                channel.close()
            if not isinstance(error, PoolFull):
                raise
            self.metrics.refused(429, "in_flight")
            raise HTTPException(429, str(error), self._retry_after()) from None
        self.admitted += len(channels)
        return [Submission(self, channel) for channel in channels]

    def stats(self) -> dict:
        """Requests in flight and admitted so far, how they ended, and the workers' counters."""
        return {"admitted": self.admitted, "ended": dict(self.ended), **self.pool.stats()}

    def _retry_after(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}

    def error_response(self, event: dict, path: str) -> JSONResponse:
        """An error event as the client's response; shedding (429, 503, 504) says when to come back."""
        headers = self._retry_after() if event["status"] in (429, 503, 504) else None
        return error_response(path, event["status"], event["message"], headers)


async def predict(front: Front, request: PredictRequest, client: Request) -> Response:
    """``POST /predict``: the summary as JSON, or NDJSON events ending with it when ``stream``."""
    submission = front.admit(request)
    try:
        first = await (submission.next_event(client) if request.stream else submission.final_event(client))
    except BaseException:  # cancelled by the server's shutdown, say: the job must not run on
        submission.close()
        raise
    if first["event"] == "error" or not request.stream:
        submission.close()
        if first["event"] == "error":
            return front.error_response(first, client.url.path)
        return JSONResponse(first["response"])
    submission.stop_watching()
    return StreamingResponse(_ndjson(first, submission), media_type="application/x-ndjson")


async def _ndjson(first: dict, submission: Submission) -> AsyncIterator[str]:
    try:
        event = first
        while True:
            yield json.dumps(event) + "\n"
            if event["event"] in ("done", "error"):
                return
            event = await submission.next_event()
    finally:
        submission.close()


def _rss_bytes(pid: int) -> int | None:
    """Resident memory of a process (Linux /proc); None where it cannot be read."""
    try:
        resident_pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def register(app: FastAPI, front: Front, *, model_name: str, metadata: dict, server_info: dict) -> None:
    """``POST /predict``, ``GET /health``, ``/info``, ``/stats``, ``/metrics`` and ``/`` on ``app``.
    ``metadata`` and ``server_info``: what ``/info`` reports besides the served model's shape and the
    pool's devices."""
    pool = front.pool

    async def route(request: PredictRequest, client: Request) -> Response:
        return await predict(front, request, client)

    app.add_api_route(
        "/predict",
        route,
        methods=["POST"],
        response_model=None,
        responses={
            200: {"model": PredictResponse, "description": "The summary (NDJSON events if stream)"},
            **ERROR_RESPONSES,
        },
        summary="Generate and/or score under a block set",
    )

    async def health() -> Response:
        """200 once every worker has loaded the model; 503 before, and while one is replaced."""
        ready = pool.ready()
        return PlainTextResponse("ok" if ready else "not ready", status_code=200 if ready else 503)

    async def info() -> dict:
        """The served model and how it is served."""
        model = {**metadata, **(pool.model_info() if pool.limits() is not None else {})}
        return {"model": model, "server": {**pool.describe(), **server_info}}

    async def stats() -> dict:
        """Requests in flight and admitted, the workers' counters, and resident memory in bytes."""
        workers = [_rss_bytes(pid) for pid in pool.worker_pids()]
        return {**front.stats(), "rss_bytes": {"server": _rss_bytes(os.getpid()), "workers": workers}}

    async def index() -> Response:
        return PlainTextResponse(f"blocklab serving {model_name}: see /docs")

    async def metrics() -> Response:
        """Prometheus' text format (``serve.metrics``)."""
        return front.metrics.exposition()

    for path, endpoint, summary in [
        ("/health", health, "Whether every worker is ready"),
        ("/info", info, "The model and the server's settings"),
        ("/stats", stats, "Counters and memory"),
        (METRICS_PATH, metrics, "Prometheus metrics"),
        ("/", index, "What this is"),
    ]:
        app.add_api_route(path, endpoint, methods=["GET"], summary=summary)
    # load balancers' probes may ask with HEAD (HAProxy's default check): the same status, no body
    app.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)
