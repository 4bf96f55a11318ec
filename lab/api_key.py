"""The API-key rule of blocklab's HTTP servers (``blocklab serve``, ``blocklab explore``).

A server binds loopback unless told otherwise; given a key (``--api-key``, or ``LIT_SERVER_API_KEY``,
LitServe's variable), every request but those to its public paths must carry it, as ``X-API-Key: KEY``
or ``Authorization: Bearer KEY`` (what the OpenAI clients send); a server reachable from elsewhere
without a key says so when it starts. Here, in ``lab``, so that a server that is not LitServe's can
follow it without importing LitServe.
"""

from __future__ import annotations

import ipaddress
import logging
import secrets
from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

ENV_VAR = "LIT_SERVER_API_KEY"
MISSING = "missing or wrong API key (X-API-Key or Authorization: Bearer)"


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name
        return host == "localhost"


def warn_if_open(host: str, api_key: str | None, logger: logging.Logger) -> None:
    if not is_loopback(host) and not api_key:
        logger.warning("binding %s without --api-key: anyone who can reach it can use it", host)


def _detail(path: str, status: int, message: str) -> Response:
    return JSONResponse({"detail": message}, status_code=status)


class ApiKeyMiddleware:
    """Refuses (401) every request without the key, except to the paths ``public`` accepts.

    A middleware rather than a per-route dependency: it denies by default, so a route added later
    cannot slip past, and it runs before the body is read or validated. ``refusal(path, status,
    message)`` shapes the 401 (default FastAPI's ``{"detail": message}``).
    """

    def __init__(
        self,
        app: ASGIApp,
        api_key: str,
        public: Callable[[str], bool],
        refusal: Callable[[str, int, str], Response] = _detail,
    ):
        self.app, self.public, self.refusal = app, public, refusal
        self.api_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        open_to_all = scope["type"] == "lifespan" or self.public(scope["path"])
        if open_to_all or self._has_key(Headers(scope=scope)):
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
        else:
            await self.refusal(scope["path"], 401, MISSING)(scope, receive, send)

    def _has_key(self, headers: Headers) -> bool:
        given = headers.get("x-api-key")
        if given is None:
            scheme, _, credentials = headers.get("authorization", "").partition(" ")
            given = credentials if scheme.lower() == "bearer" else None
        return given is not None and secrets.compare_digest(given.encode(), self.api_key)
