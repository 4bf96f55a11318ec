"""serve.connections in one process, on a transport that records what is written: where the reads
fall is chosen here (a socket decides that itself in tests/test_serve_hostile.py), so the header
bound's counting is checked at each boundary, and a response's writes are counted."""

import asyncio
import functools
import re
import socket

import pytest
import uvicorn
from uvicorn.server import ServerState

from serve.connections import DeadlineProtocol, unread

BOUND = 1024
"""The request line and headers' bound these connections get."""


class RecordingTransport(asyncio.Transport):
    """What a protocol writes, one entry per ``write``; closed when the protocol closes it."""

    def __init__(self):
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False
        self.reading = True

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 5000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def write(self, data) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        pass

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    @property
    def sent(self) -> bytes:
        return b"".join(self.writes)


async def answer(scope, receive, send) -> None:
    """An app answering every request 200 with its path, after reading its body."""
    while (await receive()).get("more_body"):
        pass
    body = scope["path"].encode()
    headers = [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def connection() -> tuple[DeadlineProtocol, RecordingTransport]:
    config = uvicorn.Config(answer, log_level="warning")
    config.load()
    make = functools.partial(DeadlineProtocol, read_timeout=5.0, max_header_bytes=BOUND)
    protocol = make(config=config, server_state=ServerState(), app_state={})
    transport = RecordingTransport()
    protocol.connection_made(transport)
    return protocol, transport


def get(path: str, size: int | None = None) -> bytes:
    """A GET of ``path`` whose request line and headers take ``size`` bytes (padded)."""
    head = b"GET %s HTTP/1.1\r\nHost: a\r\n" % path.encode()
    if size is None:
        return head + b"\r\n"
    padding = size - len(head) - len(b"X-Padding: \r\n\r\n")
    return head + b"X-Padding: " + b"a" * padding + b"\r\n\r\n"


async def settle() -> None:
    for _ in range(20):  # the requests' tasks run and answer (nothing here waits on a timer)
        await asyncio.sleep(0)


def statuses(sent: bytes) -> list[int]:
    """The status of each response in ``sent`` (the bodies here are paths: no status line in them)."""
    return [int(status) for status in re.findall(rb"HTTP/1\.1 (\d{3}) ", sent)]


def test_a_response_leaves_in_one_write():
    async def scenario() -> None:
        protocol, transport = connection()
        protocol.data_received(get("/one"))
        await settle()
        assert len(transport.writes) == 1  # status line, headers and body together
        assert transport.sent.startswith(b"HTTP/1.1 200") and transport.sent.endswith(b"/one")
        protocol.data_received(get("/two"))
        await settle()
        assert len(transport.writes) == 2 and transport.writes[1].endswith(b"/two")

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "reads",
    [
        lambda under: [under],  # at once
        lambda under: [under[:10], under[10:500], under[500:]],  # split, each read the request's own
        lambda under: [get("/first") + under[:600], under[600:]],  # behind another request's end
    ],
    ids=["at-once", "split", "behind-another"],
)
def test_headers_of_the_bound_are_served_wherever_the_reads_fall(reads):
    async def scenario() -> None:
        protocol, transport = connection()
        under = get("/under", BOUND)
        assert len(under) == BOUND
        for data in reads(under):
            protocol.data_received(data)
            await settle()
        assert statuses(transport.sent)[-1] == 200 and transport.sent.endswith(b"/under")
        assert not transport.closed

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "reads",
    [
        lambda over: [over],  # whole in one read: counted as parsed
        lambda over: [get("/first") + over],  # whole, behind another request's end
        lambda over: [over[:-2]],  # not whole: counted from the read
        lambda over: [over[:300], over[300:-2]],  # not whole, in two reads
    ],  # not whole, behind another request's end: the last test
    ids=["whole", "whole-behind-another", "unfinished", "unfinished-split"],
)
def test_headers_past_the_bound_get_400_wherever_the_reads_fall(reads):
    async def scenario() -> None:
        protocol, transport = connection()
        over = get("/over", BOUND + 3)  # unfinished (less its last two bytes), still past the bound
        for data in reads(over):
            protocol.data_received(data)
            await settle()
        assert b"/over" not in transport.sent  # never answered as a request
        assert statuses(transport.sent)[-1] == 400
        assert str(BOUND).encode() in transport.sent
        assert protocol.lingering  # reads and drops the rest, then closes

    asyncio.run(scenario())


def test_a_read_behind_another_requests_end_is_counted_from_the_next_read_on():
    """The read in which the request began behind another's end is left out of the count (where in
    it the request began is not known), the reads after it are counted whole: refused once those
    alone pass the bound, never before."""

    async def scenario() -> None:
        protocol, transport = connection()
        protocol.data_received(get("/first") + b"GET /slow HTTP/1.1\r\nX-Padding: " + b"a" * (BOUND - 100))
        await settle()
        protocol.data_received(b"a" * BOUND)  # the bound, not past it, since the first read
        await settle()
        assert statuses(transport.sent) == [200]
        protocol.data_received(b"a")
        await settle()
        assert statuses(transport.sent) == [200, 400]

    asyncio.run(scenario())


def test_unread_bytes_on_a_connection_are_seen_before_the_loop_reads_them():
    """``unread``, which keeps a kept-alive connection whose next request has come from being closed
    for room (closing over unread bytes resets it): False on a quiet socket, True once the peer has
    sent what the protocol has not read (reading paused), False again once the protocol has read it."""

    async def run() -> list[bool]:
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair()
        transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, ours)
        transport.pause_reading()
        seen = [unread(transport)]
        theirs.sendall(b"GET /health HTTP/1.1\r\n\r\n")
        await asyncio.sleep(0.05)
        seen.append(unread(transport))
        transport.resume_reading()
        await asyncio.sleep(0.05)  # the protocol reads it
        seen.append(unread(transport))
        transport.close()
        theirs.close()
        return seen

    assert asyncio.run(run()) == [False, True, False]
