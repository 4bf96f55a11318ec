"""The HTTP side of a request: the API key, admission, submission to LitServe's queue, its events.

``ApiKeyMiddleware`` refuses every request without the key before routing, except to the public
paths. Every model route (``/predict`` and the OpenAI-compatible ones) goes through
``Gateway.admit`` and a ``Submission``, which cover what LitServe 0.2.19 leaves open (measured, see
the serving docs):

- requests are checked against the served model before they are queued (422 naming the field);
- at most ``max_in_flight`` requests are admitted; the next gets 429 with ``Retry-After``;
- a request not taken by a worker within ``queue_timeout`` gets 504 (even if the worker that
  dequeued it died without a word), and a request whose worker died gets 503;
- a request still running at its deadline (``request_timeout``) is ended by its worker with 504 at
  the next step; should that step never return, the gateway answers 504 itself soon after;
- an error reaches the client with its status before a stream starts, and as an explicit error
  event after (LitServe would answer 200 and cut the stream);
- a client that goes away cancels its job: the worker stops generating for it.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator

from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp

from lab import api_key as key_rule
from serve.api import BlockLabAPI
from serve.engine import error_event
from serve.litserve_seam import WORKER_DIED, ResponseBufferItem, event_from_worker
from serve.schema import Admission, PredictRequest, RequestError, resolve

POLL_S = 0.5
"""The longest a waiting request sleeps without looking around: whether its client is still there
(a non-streaming one's disconnect is only noticed by asking), whether its worker is still alive, and
at its queue: LitServe's worker monitor fails a dead worker's requests from its own thread, whose
``event.set()`` does not wake the event loop."""
CLIENT_GONE = 499
"""The status (nginx's convention) of a request whose client disconnected; nobody reads it."""
TIMEOUT_GRACE_S = 2.0
"""How long past a request's deadline the gateway waits for the worker's own 504 (sent at its next
step) before answering 504 itself: only a step that never returns takes that long."""
OUTCOMES = ("done", "failed", "rejected", "timed_out", "worker_died", "cancelled")
"""How an admitted request ends: done (200), failed (500), rejected by the worker (4xx), timed_out
(504: not taken within the queue timeout, or past the request timeout), worker_died (503), cancelled
(the client left first)."""
OUTCOME_OF_STATUS = {503: "worker_died", 504: "timed_out", 499: "cancelled"}
PUBLIC_PATHS = frozenset({"/health", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
"""What answers without the API key: load balancers' health checks, and the schema (no secrets)."""


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


async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    """FastAPI's 422 without echoing the input back: a NaN or a lone surrogate there made FastAPI's own
    handler fail with 500, and a large bad body should not come back whole."""
    detail = [{"type": e["type"], "loc": list(e["loc"]), "msg": e["msg"]} for e in error.errors()]
    return error_response(request.url.path, 422, detail)


async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    return error_response(request.url.path, error.status_code, error.detail, error.headers)


class Gateway:
    """Admits requests for the one LitAPI and hands out their ``Submission``s."""

    def __init__(
        self,
        server,
        api: BlockLabAPI,
        *,
        max_in_flight: int,
        queue_timeout: float,
        request_timeout: float = math.inf,
        retry_after_s: int = 1,
    ):
        self.server = server
        self.api = api
        self.max_in_flight = max_in_flight
        self.queue_timeout = queue_timeout
        self.request_timeout = request_timeout
        self.retry_after_s = retry_after_s
        # least recently freed first, so a cancelled job's slot is reused as late as possible
        self.free_slots = deque(range(max_in_flight))
        self.admitted = 0
        """Requests admitted so far; the count is each one's ticket."""
        self.ended = dict.fromkeys(OUTCOMES, 0)
        """How admitted requests ended, each in exactly one of ``OUTCOMES``: with the ones in flight
        they add up to ``admitted``."""

    def admit(self, request: PredictRequest) -> Submission:
        """Check, admit and queue ``request``; HTTPException 422, 429 or 503 when it cannot be."""
        limits = self.api.shared.limits()
        if limits is None:
            raise HTTPException(503, "the model is still loading", headers=self._retry_after())
        try:
            resolve(request, limits)
        except RequestError as error:
            raise HTTPException(422, error.detail()) from None
        if not self.free_slots:
            raise HTTPException(
                429,
                f"{self.max_in_flight} requests in flight, the most this server takes",
                self._retry_after(),
            )
        slot = self.free_slots.popleft()
        now = time.monotonic()
        self.admitted += 1
        deadline = now + self.request_timeout
        request.admit(Admission(ticket=self.admitted, slot=slot, submitted_at=now, deadline=deadline))
        uid = str(uuid.uuid4())
        item = self.server.enqueue(self.api, uid, request, now)
        return Submission(self, uid, item, request.admission)

    def stats(self) -> dict:
        """Requests in flight and admitted so far, and the workers' counters (``engine.COUNTERS``)."""
        return {
            "in_flight": self.max_in_flight - len(self.free_slots),
            "max_in_flight": self.max_in_flight,
            "admitted": self.admitted,
            "ended": dict(self.ended),
            **self.api.shared.totals(),
        }

    def _retry_after(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}

    def error_response(self, event: dict, path: str) -> JSONResponse:
        """An error event as the client's response; shedding (429, 503, 504) says when to come back."""
        headers = self._retry_after() if event["status"] in (429, 503, 504) else None
        return error_response(path, event["status"], event["message"], headers)


class Submission:
    """One admitted request: its events as they come, and its slot until ``close``."""

    def __init__(self, gateway: Gateway, uid: str, item: ResponseBufferItem, admission: Admission):
        self.gateway = gateway
        self.uid = uid
        self.item = item
        self.admission = admission
        self.finished = False
        self.outcome = "cancelled"  # until a last event says otherwise: the client left, or shutdown
        self.closed = False
        self.worker = None
        """The process running this request, once it has taken it."""

    async def next_event(self, client: Request | None = None) -> dict:
        """The next event; a ``done`` or ``error`` event is the last. With ``client``, a client that
        disconnects while this waits ends it with a 499 error event (``close`` then cancels the job)."""
        while True:
            while self.item.response_queue:
                event = event_from_worker(*self.item.response_queue.popleft())
                if event is not None:
                    self.finished = event["event"] in ("done", "error")  # the worker is done with it
                    return self._seen(event)
            if self.worker is not None and not self.worker.is_alive():
                # LitServe's monitor fails a dead worker's requests, but skips one whose event is set
                # at that moment (it takes it for answered): this catches those.
                return self._seen(error_event(503, WORKER_DIED))
            if self.worker is None and self.item.worker_id is not None:
                self.worker = self.gateway.server.worker_process(self.item.worker_id)
            self.item.event.clear()
            # Past a limit the request is not finished: the caller's close() cancels it.
            now, gateway = time.monotonic(), self.gateway
            queued = self.item.worker_id is None
            queue_limit = self.admission.submitted_at + gateway.queue_timeout if queued else math.inf
            hard_limit = self.admission.deadline + TIMEOUT_GRACE_S
            if now > queue_limit:
                return self._seen(error_event(
                    504, f"queue timeout: no worker took the request within {gateway.queue_timeout:g} s"
                ))  # fmt: skip
            if now > hard_limit:
                return self._seen(error_event(
                    504,
                    f"request timeout: no answer within {gateway.request_timeout:g} s (the server's "
                    f"--request-timeout) and {TIMEOUT_GRACE_S:g} s of grace: its worker is stuck in a step",
                ))  # fmt: skip
            limit = min(queue_limit, hard_limit, now + POLL_S) - now + 0.01
            try:
                await asyncio.wait_for(self.item.event.wait(), limit)
            except asyncio.TimeoutError:
                if client is not None and await client.is_disconnected():
                    return self._seen(error_event(CLIENT_GONE, "client disconnected"))

    def _seen(self, event: dict) -> dict:
        """Note a last event's outcome (``OUTCOMES``) as it passes; returns it."""
        if event["event"] == "done":
            self.outcome = "done"
        elif event["event"] == "error":
            status = event["status"]
            self.outcome = OUTCOME_OF_STATUS.get(status, "rejected" if status < 500 else "failed")
        return event

    async def final_event(self, client: Request | None = None) -> dict:
        """Wait through any token events for the ``done`` or ``error`` event."""
        event = await self.next_event(client)
        while event["event"] not in ("done", "error"):
            event = await self.next_event(client)
        return event

    def close(self) -> None:
        """Free the slot; a job not finished yet is cancelled (its worker stops it at the next step)."""
        if self.closed:
            return
        self.closed = True
        self.gateway.ended[self.outcome] += 1
        self.gateway.server.forget(self.uid)
        if not self.finished:
            self.gateway.api.shared.cancelled[self.admission.slot] = self.admission.ticket
        self.gateway.free_slots.append(self.admission.slot)


async def predict(gateway: Gateway, request: PredictRequest, client: Request) -> Response:
    """``POST /predict``: the summary as JSON, or NDJSON events ending with it when ``stream``."""
    submission = gateway.admit(request)
    try:
        first = await (submission.next_event(client) if request.stream else submission.final_event(client))
    except BaseException:  # cancelled by the server's shutdown, say: the job must not run on
        submission.close()
        raise
    if first["event"] == "error" or not request.stream:
        submission.close()
        if first["event"] == "error":
            return gateway.error_response(first, client.url.path)
        return JSONResponse(first["response"])
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
