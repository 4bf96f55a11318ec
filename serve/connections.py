"""Every connection has a deadline: uvicorn's httptools protocol with a read deadline, a bound on the
request line and headers, the connection limit and a drain that does not wait on clients.

uvicorn (0.54) closes a connection idle *after* a response (``timeout_keep_alive``) but puts no
limit on the time a request takes to arrive: a socket that opens and sends nothing, headers sent a
byte a second (slowloris), a body sent a byte a second, or a body shorter than its Content-Length
each hold a connection, and under ``limit_concurrency`` a slot, for as long as the client likes.
Nor is the keep-alive timer armed for a request that arrived *behind* another one (pipelined in the
same send, or sent while the first was being answered): uvicorn starts such a request only when the
first response ends, and then waits for its body for ever. ``DeadlineProtocol`` decides its timers
from the connection's state, never from which bytes came last, so the order the bytes arrive in
does not matter:

- **arriving** (a request has begun and is not whole: bytes of its request line or headers have
  come, or its body is incomplete; or bytes that begin no request, the blank lines HTTP tolerates
  between requests): the request must be whole within ``read_timeout`` seconds of the moment it
  began to arrive, or the connection is closed (a route waiting for the body sees the client
  disconnect). A deadline on the whole request, as nginx's ``client_header_timeout``, so a byte now
  and then cannot keep it open. A request behind a response begins to arrive when the server turns
  to it: its clock does not run while the server answers the one before;
- **idle** (nothing has come since the last request, none is being answered): closed after the
  keep-alive timeout, new connections included (uvicorn arms that timer only after a response);
- **serving** (the request is whole, the response not): no timer; the server's own limits apply
  (``--request-timeout``).

The state is re-read after every read and after every response. On shutdown, connections whose
request is still arriving are closed at once: only whole requests are drained.

httptools (uvicorn's default parser) takes a request line and headers of any size; here they may
take ``max_header_bytes``, as nginx's ``large_client_header_buffers``. httptools does not say where
in what it is fed a request begins or ends, so they are counted twice: while they arrive, by the
reads they fill (a read in which another request ends first is left out, so the count never passes
the true size, and no request is held more than a read past the bound), and once whole, from the
request line and headers as parsed. Past the bound, or on a request httptools cannot parse, the
answer is 400 (what uvicorn's h11 parser answers past its 32 kB), then a lingering close, as nginx's
``lingering_close``: the server stops writing and reads and discards what the client is still
sending for up to ``LINGER_S``. Closing at once, with the client's unread bytes in the kernel's
buffer, sends a reset that can destroy the 400 before the client reads it. httptools parses
pipelined requests as they come, so a request that fails behind one still being answered is
answered in turn, once those before it are.

A response leaves in one write where uvicorn makes two: it writes the status line and headers,
then the body, each at once, so a client that reads the headers first is woken a second time for
the body (on a busy machine, a scheduler's turn each). ``HeldWrites`` holds what a request's cycle
writes until its response is complete, the connection closes, or the event loop's turn ends (a
stream's chunks leave as they are made).

Past ``max_connections`` open connections (uvicorn's ``limit_concurrency``, done here so the answer
can be the API's own), an idle keep-alive connection (one that has answered a request and waits for
the next; not a new one yet to send its first) is closed to make room, as nginx reuses them; with
none idle, the request is answered by ``overloaded`` (an ASGI app: the API's 503 with
Retry-After) and its connection closed.

This is the one place that relies on uvicorn's protocol internals (``HttpToolsProtocol``, its
``parser``, ``cycle``, ``url``, ``headers``, ``server_state``, ``connections``, ``tasks``, ``app``,
``timeout_keep_alive_task``, the parser callbacks, ``_start_asgi_task``,
``on_response_complete``, ``send_400_response``, ``shutdown``, and ``RequestResponseCycle``'s
``transport`` (only ``write``, ``close`` and ``is_closing`` called on it), ``response_complete``,
``more_body`` and ``keep_alive``); an upgrade that changes them touches this file only.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Literal

from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle

logger = logging.getLogger("blocklab.serve")

Phase = Literal["idle", "arriving", "serving"]

LINGER_S = 2.0
"""How long a connection answered 400 keeps reading (and discarding) before it closes."""
REQUEST_LINE_FRAME = len(b"  HTTP/1.1\r\n\r\n")
"""What a request line and the blank line after the headers add to the method and target."""


class HeldWrites:
    """A connection's transport as its requests' cycles see it: what they write waits for
    ``release``, which the protocol calls once a response is complete, and the event loop at the end
    of the turn in which the writing began (module docstring)."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self.transport = transport
        self.loop = loop
        self.held: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self.held:
            self.loop.call_soon(self.release)
        self.held.append(data)

    def release(self) -> None:
        if self.held and not self.transport.is_closing():
            self.transport.write(b"".join(self.held))
        self.held.clear()

    def close(self) -> None:
        self.release()
        self.transport.close()

    def is_closing(self) -> bool:
        return self.transport.is_closing()


class HeadersTooLarge(Exception):
    """Raised in httptools' callback to stop the parser: the request's headers are past the bound."""


def unread(transport: asyncio.Transport) -> bool:
    """Whether bytes have come on ``transport``'s socket that the event loop has not read yet."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    try:
        # through a duplicate of the descriptor: asyncio's own socket object refuses recv
        with socket.fromfd(sock.fileno(), sock.family, sock.type) as peek:
            return bool(peek.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except OSError:  # nothing there (BlockingIOError), or the socket is gone
        return False


class DeadlineProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline in every state and a bound on the headers (see
    the module docstring).

    uvicorn builds one per connection as ``http(config=, server_state=, app_state=)``; pass
    ``functools.partial(DeadlineProtocol, read_timeout=S, max_header_bytes=B, max_connections=N,
    overloaded=APP)`` as ``uvicorn.Config(http=...)``, without ``limit_concurrency``.
    """

    def __init__(
        self,
        *args,
        read_timeout: float,
        max_header_bytes: int,
        max_connections: int | None = None,
        overloaded: ASGIApp | None = None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self.read_timeout = read_timeout
        self.max_header_bytes = max_header_bytes
        self.max_connections = max_connections
        self.overloaded = overloaded
        self.read_deadline: asyncio.TimerHandle | None = None
        self.in_message = False
        """The parser is inside a request: it has begun, and is not whole."""
        self.headers_done = False
        """... and its request line and headers are whole."""
        self.began = 0
        """Requests begun on this connection."""
        self.header_bytes = 0
        """The request line and headers of the request arriving, as counted from the reads."""
        self.stray = False
        """Bytes came that begin no request (blank lines), after the last request ended."""
        self.running: RequestResponseCycle | None = None
        """The request whose ASGI task was started last: the one being answered, or answered last."""
        self.lingering = False
        """Answered 400 (or about to be): what still arrives is read and dropped."""
        self.refusal: str | None = None
        """The 400's message while it waits for the answers before it to be complete."""
        self.writes: HeldWrites | None = None  # the cycles' transport, once connected
        self.inner_app = self.app
        if max_connections is not None:
            self.app = self._admit  # every request of this connection goes through the limit

    # -- the timers, from the connection's state ---------------------------------------------------

    def phase(self) -> Phase:
        """Whether the connection waits for nothing (idle), for the client (arriving), or on the server."""
        answering = self._answering()
        if self.in_message:
            its_body = self.headers_done and self.cycle is self.running  # the request answered is not whole
            return "arriving" if its_body or not answering else "serving"
        if answering:
            return "serving"
        return "arriving" if self.stray else "idle"

    def _answering(self) -> bool:
        return self.running is not None and not self.running.response_complete

    def _rearm(self) -> None:
        """The timers the connection's state calls for (the module docstring's table)."""
        if self.transport is None or self.transport.is_closing() or self.lingering:
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
        self.writes = HeldWrites(transport, self.loop)
        self._rearm()

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            return
        began, was_between = self.began, not self.in_message
        super().data_received(data)  # the parser's callbacks below run in here
        if self.lingering or self.transport.is_closing():
            return
        if self.in_message and not self.headers_done:
            if self.began == began:  # the whole read is the request line and headers arriving
                self.header_bytes += len(data)
            elif self.began == began + 1 and was_between:  # the request began with this read
                self.header_bytes = len(data)
            if self.header_bytes > self.max_header_bytes:
                self.send_400_response(self._too_large())
                return
        elif was_between and self.began == began and not self.in_message:
            self.stray = True
        self._rearm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.in_message, self.headers_done, self.stray = True, False, False
        self.began += 1
        self.header_bytes = 0

    def on_headers_complete(self) -> None:
        self.headers_done = True
        method = self.parser.get_method()
        size = len(method) + len(self.url) + REQUEST_LINE_FRAME
        size += sum(len(name) + len(value) + 4 for name, value in self.headers)  # "name: value\r\n"
        if size > self.max_header_bytes:
            self.refusal = self._too_large()
            raise HeadersTooLarge  # httptools stops; uvicorn answers with send_400_response
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self.in_message = False

    def _too_large(self) -> str:
        return f"Request line and headers over {self.max_header_bytes} bytes"

    def _start_asgi_task(self, cycle: RequestResponseCycle, app) -> None:
        self.running = cycle
        cycle.transport = self.writes
        super()._start_asgi_task(cycle, app)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's 400 for a request it cannot parse, then a lingering close (the module docstring)
        where uvicorn closes at once; behind a whole request still being answered, once that one is."""
        self.lingering = True
        self._disarm()
        self.refusal = self.refusal or msg
        if not (self._answering() and not self.running.more_body):
            self._refuse()

    def _refuse(self) -> None:
        self.writes.release()  # what a cycle wrote goes first
        message, self.refusal = self.refusal.encode("ascii"), None
        content = [STATUS_LINE[400]]
        for name, value in self.server_state.default_headers:
            content += [name, b": ", value, b"\r\n"]
        content += [
            b"content-type: text/plain; charset=utf-8\r\n",
            b"content-length: %d\r\nconnection: close\r\n\r\n" % len(message),
            message,
        ]
        self.transport.write(b"".join(content))
        self._unset_keepalive_if_required()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)

    def on_response_complete(self) -> None:
        self.writes.release()  # the response, whole, in one write
        super().on_response_complete()  # starts the request parsed behind the response, if any
        if self.refusal is not None and not self._answering() and not self.transport.is_closing():
            self._refuse()
        self._rearm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        """The server drains: a whole request being answered closes its connection once it is; any
        other connection closes now (a request still arriving is not one to wait for)."""
        if self.phase() == "serving":
            self.running.keep_alive = False
        else:
            self._disarm()
            self.transport.close()

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
        """Close one idle keep-alive connection to make room for this request; False if none is idle.
        Closing over bytes not yet read resets a connection instead of answering its request: so a
        connection that has not begun a request is not one (its first may be in the socket unread),
        nor one whose next request has come but not been read yet."""
        for other in self.connections:
            kept_alive = isinstance(other, DeadlineProtocol) and other.began > 0 and other.phase() == "idle"
            closable = kept_alive and other is not self and not other.transport.is_closing()
            if closable and not unread(other.transport):
                other.timeout_keep_alive_handler()
                return True
        return False
