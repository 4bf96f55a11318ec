"""Every connection has a deadline: uvicorn's h11 protocol with a read deadline, the connection limit
and a drain that does not wait on clients.

uvicorn (0.54, h11) closes a connection idle *after* a response (``timeout_keep_alive``) but puts no
limit on the time a request takes to arrive: a socket that opens and sends nothing, headers sent a
byte a second (slowloris), a body sent a byte a second, or a body shorter than its Content-Length
each hold a connection, and under ``limit_concurrency`` a slot, for as long as the client likes.
Nor is the keep-alive timer armed for a request that arrived *behind* another one (pipelined in the
same send, or sent while the first was being answered): uvicorn parses such a request only when the
first response ends, from bytes it had buffered, and then waits for its body for ever.
``DeadlineH11Protocol`` decides its timers from the connection's state, never from which bytes came
last, so the order the bytes arrive in does not matter:

- **arriving** (a request has begun and is not whole: bytes of its request line or headers are
  buffered, or its body is incomplete): the request must be whole within ``read_timeout`` seconds
  of the moment it began to arrive, or the connection is closed (a route waiting for the body sees
  the client disconnect). A deadline on the whole request, as nginx's ``client_header_timeout``, so
  a byte now and then cannot keep it open. A request buffered behind a response begins to arrive
  when the server turns to it: its clock does not run while the server answers the one before;
- **idle** (nothing buffered, no request): closed after the keep-alive timeout, new connections
  included (uvicorn arms that timer only after a response);
- **serving** (the request is whole, the response not): no timer; the server's own limits apply
  (``--request-timeout``).

The state is re-read after every read and after every response. On shutdown, connections whose
request is still arriving are closed at once: only whole requests are drained.

A request h11 cannot parse (headers past its 32 kB limit, say) gets uvicorn's 400, then a lingering
close, as nginx's ``lingering_close``: the server stops writing and reads and discards what the client
is still sending for up to ``LINGER_S``. Closing at once, with the client's unread bytes in the
kernel's buffer, sends a reset that can destroy the 400 before the client reads it.

Past ``max_connections`` open connections (uvicorn's ``limit_concurrency``, done here so the answer
can be the API's own), an idle keep-alive connection is closed to make room, as nginx reuses them;
with none idle, the request is answered by ``overloaded`` (an ASGI app: the API's 503 with
Retry-After) and its connection closed.

This is the one place that relies on uvicorn's protocol internals (``H11Protocol``, its ``conn``,
``connections``, ``tasks``, ``app``, ``timeout_keep_alive_task``, ``on_response_complete``,
``send_400_response``, ``shutdown``); an upgrade that changes them touches this file only.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Literal

import h11
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("blocklab.serve")

Phase = Literal["idle", "arriving", "serving"]

LINGER_S = 2.0
"""How long a connection answered 400 keeps reading (and discarding) before it closes."""


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline in every state (see the module docstring).

    uvicorn builds one per connection as ``http(config=, server_state=, app_state=)``; pass
    ``functools.partial(DeadlineH11Protocol, read_timeout=S, max_connections=N, overloaded=APP)`` as
    ``uvicorn.Config(http=...)``, without ``limit_concurrency``.
    """

    def __init__(
        self,
        *args,
        read_timeout: float,
        max_connections: int | None = None,
        overloaded: ASGIApp | None = None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self.read_timeout = read_timeout
        self.max_connections = max_connections
        self.overloaded = overloaded
        self.read_deadline: asyncio.TimerHandle | None = None
        self.lingering = False
        """Answered 400: what still arrives is read and dropped until the client closes or LINGER_S."""
        self.inner_app = self.app
        if max_connections is not None:
            self.app = self._admit  # every request of this connection goes through the limit

    # -- the timers, from the connection's state ---------------------------------------------------

    def phase(self) -> Phase:
        """Whether the connection waits for nothing (idle), for the client (arriving), or on the server."""
        theirs, ours = self.conn.their_state, self.conn.our_state
        if theirs is h11.SEND_BODY:
            return "arriving"
        if theirs is h11.IDLE and ours is h11.IDLE:
            return "arriving" if self.conn.trailing_data[0] else "idle"
        return "serving"

    def _rearm(self) -> None:
        """The timers the connection's state calls for (the module docstring's table)."""
        if self.transport is None or self.transport.is_closing():
            self._disarm()
            return
        phase = self.phase()
        if phase == "arriving":
            self._unset_keepalive_if_required()
            if self.read_deadline is None:  # from the moment it began to arrive, not from the last byte
                self.read_deadline = self.loop.call_later(self.read_timeout, self._read_timed_out)
            return
        self._disarm()
        if phase == "idle" and self.timeout_keep_alive_task is None:
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )

    def _disarm(self) -> None:
        if self.read_deadline is not None:
            self.read_deadline.cancel()
            self.read_deadline = None

    def _read_timed_out(self) -> None:
        self.read_deadline = None
        if self.phase() == "arriving" and not self.transport.is_closing():
            logger.debug("closing %s: its request did not arrive within %g s", self.client, self.read_timeout)
            self.transport.close()

    # -- uvicorn's calls ---------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._rearm()

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            return
        super().data_received(data)
        self._rearm()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's 400 for a request h11 cannot parse, then a lingering close (the module docstring)
        where uvicorn closes at once."""
        headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"connection", b"close")]
        for event in (
            h11.Response(status_code=400, headers=headers),
            h11.Data(data=msg.encode()),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event))
        self._linger()

    def _linger(self) -> None:
        self._disarm()
        self.lingering = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # parses what was buffered behind the response, if anything
        self._rearm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        """The server drains: a request still arriving is not one to wait for."""
        if self.lingering or self.phase() == "arriving":
            self._disarm()
            self.transport.close()
        else:
            super().shutdown()

    # -- the connection limit ----------------------------------------------------------------------

    async def _admit(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The request runs, or gets ``overloaded``'s answer once more than ``max_connections``
        connections are open (this one included) or as many requests run besides this one."""
        if scope["type"] != "http" or not self._crowded():
            await self.inner_app(scope, receive, send)
            return
        logger.warning("%d connections open, the most this server takes: 503", len(self.connections))
        await self.overloaded(scope, receive, send)

    def _crowded(self) -> bool:
        if len(self.tasks) > self.max_connections:  # the running requests, this one included
            return True
        if len(self.connections) <= self.max_connections:
            return False
        open_ = [other for other in self.connections if not other.transport.is_closing()]
        return len(open_) > self.max_connections and not self._close_an_idle_connection()

    def _close_an_idle_connection(self) -> bool:
        """Close one idle keep-alive connection to make room for this request; False if none is idle."""
        for other in self.connections:
            idle = isinstance(other, DeadlineH11Protocol) and other.phase() == "idle"
            if other is not self and idle and not other.transport.is_closing():
                other.timeout_keep_alive_handler()
                return True
        return False
