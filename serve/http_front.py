"""The HTTP front end: the app, its routes, admission, errors and streaming, over a worker pool.

``register`` puts ``POST /predict``, ``GET /health``, ``/info``, ``/stats`` and ``/`` on the app
(``serve.app.build_app`` makes it once the pool exists; the OpenAI-compatible routes are
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
paths; ``BodyLimitMiddleware`` answers 413 past ``--max-payload-bytes``. This module knows the
workers only through ``serve.pool.WorkerPool``.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lab import api_key as key_rule
from serve.pool import Channel, PoolFull, WorkerPool
from serve.schema import ModelLimits, PredictRequest, PredictResponse, RequestError, error_event, resolve

CLIENT_GONE = 499
"""The status (nginx's convention) of a request whose client disconnected; nobody reads it."""
OUTCOMES = ("done", "failed", "rejected", "timed_out", "worker_died", "cancelled")
"""How an admitted request ends: done (200), failed (500), rejected by the worker (4xx), timed_out
(504: not taken within the queue timeout, or past the request timeout), worker_died (503), cancelled
(the client left first)."""
OUTCOME_OF_STATUS = {503: "worker_died", 504: "timed_out", CLIENT_GONE: "cancelled"}
PUBLIC_PATHS = frozenset({"/health", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
"""What answers without the API key: load balancers' health checks, and the schema (no secrets)."""
ERROR_RESPONSES = {
    400: {"description": "The body is not parseable (not UTF-8, or JSON nested too deep)"},
    401: {"description": "Missing or wrong API key"},
    413: {"description": "Body over --max-payload-bytes"},
    422: {"description": "Invalid request, naming the field"},
    429: {"description": "--max-in-flight requests in flight; retry after Retry-After seconds"},
    500: {"description": "The request's processing raised; the message says what"},
    503: {"description": "The model is loading, or the worker running the request died"},
    504: {"description": "Queue timeout, or --request-timeout reached"},
}
"""What the model routes answer besides 200, for the OpenAPI schema."""


def error_response(path: str, status: int, detail, headers: dict[str, str] | None = None) -> JSONResponse:
    """FastAPI's ``{"detail": ...}``, or under ``/v1/`` OpenAI's ``{"error": {"message": ...}}``, the
    shape its clients read the message from, with ``param`` naming the field at fault."""
    if not path.startswith("/v1/"):
        return JSONResponse({"detail": detail}, status_code=status, headers=headers)
    param = None
    if not isinstance(detail, str):  # a validation error list: the first error's field is OpenAI's param
        fields = [".".join(map(str, error["loc"][1:])) or None for error in detail]
        param = fields[0] if fields else None
        detail = "; ".join(
            f"{field or 'body'}: {error['msg'].removeprefix('Value error, ')}"
            for field, error in zip(fields, detail, strict=True)
        )
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": detail, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


class ApiKeyMiddleware(key_rule.ApiKeyMiddleware):
    """``lab.api_key``'s rule (401 before routing, deny by default) with ``PUBLIC_PATHS`` open and the
    401 in the shape of the route (OpenAI's under ``/v1/``)."""

    def __init__(self, app: ASGIApp, api_key: str):
        super().__init__(app, api_key, public=PUBLIC_PATHS.__contains__, refusal=error_response)


class BodyLimitMiddleware:
    """413 once a request's body passes ``max_bytes``, with a Content-Length or chunked without one:
    counted as it arrives, so a large body is never held whole."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:  # FastAPI passes an HTTPException raised here through
                raise HTTPException(413, "Payload too large")
            return message

        await self.app(scope, counted, send)


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
        self._gone: asyncio.Future | None = None  # the disconnect watch, while a client is awaited

    async def next_event(self, client: Request | None = None) -> dict:
        """The next event; a ``done`` or ``error`` event is the last. With ``client``, a client that
        disconnects while this waits ends it with a 499 error event (``close`` then cancels the job)."""
        if client is None:
            return self._seen(await self.channel.next_event())
        if self._gone is None:
            self._gone = asyncio.ensure_future(_disconnected(client))
        waiting = asyncio.ensure_future(self.channel.next_event())
        await asyncio.wait({waiting, self._gone}, return_when=asyncio.FIRST_COMPLETED)
        if waiting.done():
            return self._seen(waiting.result())
        waiting.cancel()
        return self._seen(error_event(CLIENT_GONE, "client disconnected"))

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
        elif event["event"] == "error":
            status = event["status"]
            self.outcome = OUTCOME_OF_STATUS.get(status, "rejected" if status < 500 else "failed")
        if event["event"] in ("done", "error"):
            self.stop_watching()
        return event

    def close(self) -> None:
        """Free the slot; a job not finished yet is cancelled (its worker stops it at the next step)."""
        if self.channel.closed:
            return
        self.stop_watching()
        self.channel.close()
        self.front.ended[self.outcome] += 1


class Front:
    """Admits requests to the pool and counts how they end."""

    def __init__(
        self,
        pool: WorkerPool,
        *,
        request_timeout: float = math.inf,
        default_blocks: str | None = None,
        retry_after_s: int = 1,
        model_name: str = "MODEL",
    ):
        self.pool = pool
        self.request_timeout = request_timeout
        self.default_blocks = default_blocks
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

    def admit(self, request: PredictRequest) -> Submission:
        """Check, resolve and submit ``request``; HTTPException 422, 429 or 503 when it cannot be."""
        limits = self.limits()
        if limits is None:
            raise HTTPException(503, "the model is still loading", headers=self._retry_after())
        try:
            job = resolve(request, limits, timeout=self.request_timeout)
        except RequestError as error:
            raise HTTPException(422, error.detail()) from None
        try:
            channel = self.pool.submit(job)
        except PoolFull as error:
            raise HTTPException(429, str(error), self._retry_after()) from None
        self.admitted += 1
        return Submission(self, channel)

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
    """``POST /predict``, ``GET /health``, ``/info``, ``/stats`` and ``/`` on ``app``. ``metadata`` and
    ``server_info``: what ``/info`` reports besides the served model's shape and the pool's devices."""
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

    for path, endpoint, summary in [
        ("/health", health, "Whether every worker is ready"),
        ("/info", info, "The model and the server's settings"),
        ("/stats", stats, "Counters and memory"),
        ("/", index, "What this is"),
    ]:
        app.add_api_route(path, endpoint, methods=["GET"], summary=summary)
