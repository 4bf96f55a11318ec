"""Connections that never finish their request are closed: uvicorn's h11 protocol with a read deadline.

uvicorn (0.54, h11) closes a connection idle *after* a response (``timeout_keep_alive``) but puts no
limit on the time a request takes to arrive: a socket that opens and sends nothing, headers sent a
byte a second (slowloris), a body sent a byte a second, or a body shorter than its Content-Length
each hold a connection, and under ``limit_concurrency`` a slot, for as long as the client likes.
``ReadDeadlineH11Protocol`` adds what nginx's ``client_header_timeout`` and ``client_body_timeout``
give:

- a new connection that sends nothing is closed after the keep-alive timeout, as one idle after a
  response is;
- from a request's first byte, the request line, headers and whole body must arrive within
  ``read_timeout`` seconds, or the connection is closed (a route waiting for the body sees the
  client disconnect). A deadline on the whole request rather than on the gap between reads, so a
  byte now and then cannot keep it open.

This is the one place that relies on uvicorn's protocol internals (``H11Protocol``, its ``conn``,
``timeout_keep_alive_task``); an upgrade that changes them touches this file only.
"""

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("blocklab.serve")

RECEIVING = (h11.IDLE, h11.SEND_BODY)
"""The client's h11 states in which its request is still (or not yet) arriving."""


class ReadDeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, plus a deadline on each request's arrival (see the module docstring).

    uvicorn builds one per connection as ``http(config=, server_state=, app_state=)``; pass
    ``functools.partial(ReadDeadlineH11Protocol, read_timeout=S)`` as ``uvicorn.Config(http=...)``.
    """

    def __init__(self, *args, read_timeout: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.read_timeout = read_timeout
        self.read_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        # uvicorn arms its keep-alive timer only after a response; a fresh connection idles the same way.
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )

    def data_received(self, data: bytes) -> None:
        if self.read_deadline is None and self.conn.their_state is h11.IDLE:  # a request begins
            self.read_deadline = self.loop.call_later(self.read_timeout, self._read_timed_out)
        super().data_received(data)
        if self.conn.their_state not in RECEIVING:  # all of it arrived (or the connection failed)
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _disarm(self) -> None:
        if self.read_deadline is not None:
            self.read_deadline.cancel()
            self.read_deadline = None

    def _read_timed_out(self) -> None:
        self.read_deadline = None
        if self.conn.their_state in RECEIVING and not self.transport.is_closing():
            logger.debug("closing %s: its request did not arrive within %g s", self.client, self.read_timeout)
            self.transport.close()
