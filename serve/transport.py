"""Messages between the HTTP side and one worker process: two OS pipes, one each way.

    link = Link()                        # on the HTTP side, before the worker starts
    worker_ends = link.worker_ends       # travels to the worker process (pickled with its arguments)
    link.spawned()                       # once it has started
    await link.connect(on_message, on_end)   # in the event loop: messages in, orders out
    link.send(order)

    worker_ends.get() / get_nowait() / put(message)   # in the worker: its inbox and outbox

Why pipes, and why these rules (docs/serving.md measures the hops):

- **One writer, one reader per pipe, so no lock.** A ``multiprocessing.Queue`` shared by several
  workers serialises their writes with a lock that a worker killed mid-``put`` leaves held; here a
  killed worker leaves at most a torn message, then the end of its pipe.
- **The HTTP side never blocks on a pipe.** It reads and writes through asyncio's pipe transports in
  its event loop: an order that does not fit waits in the transport's buffer, so a stalled worker
  cannot hold the event loop, and no thread hands messages over.
- **A worker's death is the end of its pipe**, which arrives after everything it wrote (``on_end``;
  a torn last message is dropped). This needs the HTTP side to hold no copy of the worker's ends:
  ``spawned`` closes them.
- The worker blocks on its own ends: while it waits for an order it has nothing else to do.

Each message is a 4-byte big-endian length, then its pickle.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import pickle
import queue
import struct
from collections.abc import Callable
from multiprocessing.connection import Connection

HEADER = struct.Struct("!I")


def frame(message) -> bytes:
    payload = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(payload)) + payload


def _read_exactly(fd: int, size: int) -> bytes:
    """``size`` bytes from ``fd``, blocking; EOFError at the end of the pipe."""
    data = bytearray()
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return bytes(data)


class WorkerEnds:
    """The worker's ends of its two pipes, as ``serve.worker.Worker.serve`` uses an inbox and an
    outbox: ``get``/``get_nowait`` an order (None once the HTTP side has closed its end), ``put`` a
    message. The ``Connection`` objects only carry the descriptors to the spawned process."""

    def __init__(self, orders: Connection, events: Connection):
        self.orders = orders
        self.events = events

    def get(self):
        try:
            (size,) = HEADER.unpack(_read_exactly(self.orders.fileno(), HEADER.size))
            return pickle.loads(_read_exactly(self.orders.fileno(), size))
        except EOFError:
            return None

    def get_nowait(self):
        """An order already (partly) in the pipe, else ``queue.Empty``; the rest of a partial one is
        on its way (the HTTP side writes as the pipe drains)."""
        if not self.orders.poll():
            raise queue.Empty
        return self.get()

    def put(self, message) -> None:
        data = memoryview(frame(message))
        while data:
            data = data[os.write(self.events.fileno(), data) :]

    def close(self) -> None:
        self.orders.close()
        self.events.close()


class _Messages(asyncio.Protocol):
    """The HTTP side's reader of a worker's messages: whole frames to ``on_message``, then ``on_end``."""

    def __init__(self, on_message: Callable[[tuple], None], on_end: Callable[[], None]):
        self.on_message = on_message
        self.on_end = on_end
        self.buffer = bytearray()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while len(self.buffer) >= HEADER.size:
            (size,) = HEADER.unpack_from(self.buffer)
            end = HEADER.size + size
            if len(self.buffer) < end:
                return
            message = pickle.loads(self.buffer[HEADER.size : end])
            del self.buffer[:end]
            self.on_message(message)

    def connection_lost(self, exc: Exception | None) -> None:
        self.on_end()


class Link:
    """The HTTP side of one worker process: its orders out, its messages in (module docstring)."""

    def __init__(self):
        context = mp.get_context("spawn")
        orders_in, orders_out = context.Pipe(duplex=False)
        events_in, events_out = context.Pipe(duplex=False)
        self.worker_ends = WorkerEnds(orders_in, events_out)
        self._orders, self._events = orders_out, events_in
        self._writer: asyncio.WriteTransport | None = None
        self._reader: asyncio.ReadTransport | None = None

    def spawned(self) -> None:
        """The worker holds its ends now: close this process's copies (else the worker's death would
        never show as the end of its pipe)."""
        self.worker_ends.close()

    async def connect(self, on_message: Callable[[tuple], None], on_end: Callable[[], None]) -> None:
        """Deliver the worker's messages to ``on_message`` in this event loop, then ``on_end`` once
        the worker is gone; ``send`` works from now on."""
        loop = asyncio.get_running_loop()
        self._reader, _ = await loop.connect_read_pipe(lambda: _Messages(on_message, on_end), self._events)
        self._writer, _ = await loop.connect_write_pipe(asyncio.Protocol, self._orders)

    def send(self, order) -> None:
        """Queue ``order`` for the worker; never blocks (what the pipe cannot take yet is buffered)."""
        self._writer.write(frame(order))

    def close(self) -> None:
        """Close this side's ends (the worker, if alive, reads the end of its orders)."""
        for transport in (self._writer, self._reader):
            if transport is not None:
                transport.close()
        if self._writer is None:  # never connected: the pipes are this side's to close
            self._orders.close()
            self._events.close()
