"""Hostile connections: idle sockets, slowloris headers and bodies, bodies short of their length.

One server with short timeouts (``--read-timeout``, ``--keep-alive-timeout``) and a small
``--max-connections``; each slow client runs next to a normal one, which must still be served
quickly, while the slow one is closed once its timeout passes.
"""

import http.client
import json
import socket
import threading
import time

import httpx
import pytest

from serve.process import ServerProcess
from tests.tiny import TinyModel

READ_TIMEOUT = 1.5
KEEP_ALIVE = 1.0
MAX_CONNECTIONS = 64
SLACK = 2.0
"""How long past its timeout a connection may take to be closed (a busy machine's scheduling)."""
BODY = json.dumps({"prompt": "Hello there", "max_new_tokens": 2}).encode()


@pytest.fixture(scope="module")
def server():
    args = [
        "--read-timeout", str(READ_TIMEOUT),
        "--keep-alive-timeout", str(KEEP_ALIVE),
        "--max-connections", str(MAX_CONNECTIONS),
    ]  # fmt: skip
    with ServerProcess(args, model_factory=TinyModel()) as running:
        yield running


def connect(server: ServerProcess) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def is_closed(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (end of stream or reset); False while it stays open."""
    sock.settimeout(0)
    try:
        return sock.recv(65536) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def trickle(sock: socket.socket, data: bytes, stop: threading.Event, every_s: float = 0.2) -> None:
    """Send ``data`` a byte at a time until it is sent, the server closes, or ``stop``."""
    for byte in data:
        if stop.wait(every_s):
            return
        try:
            sock.sendall(bytes([byte]))
        except OSError:
            return


def closed_within(sock: socket.socket, limit_s: float) -> float | None:
    """Seconds until the server closed ``sock``; None if it is still open after ``limit_s``."""
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        if is_closed(sock):
            return time.monotonic() - start
        time.sleep(0.05)
    return None


def normal_requests_while(condition, server: ServerProcess) -> list[float]:
    """Latencies of normal requests sent one after another while ``condition()`` holds."""
    latencies = []
    with httpx.Client(base_url=server.url, timeout=10) as client:
        while condition() or not latencies:
            start = time.monotonic()
            response = client.post("/predict", content=BODY, headers={"Content-Type": "application/json"})
            assert response.status_code == 200, response.text
            latencies.append(time.monotonic() - start)
            time.sleep(0.05)
    return latencies


HEADERS = (
    b"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n" % len(BODY)
)


@pytest.mark.parametrize(
    ("name", "sent_at_once", "trickled"),
    [
        ("headers at 5 bytes/s", b"POST /predict HTTP/1.1\r\n", HEADERS[24:] + b"\r\n" + BODY),
        ("body at 5 bytes/s", HEADERS + b"\r\n", BODY),
        ("a body short of its Content-Length", HEADERS + b"\r\n" + BODY[:10], b""),
    ],
    ids=["slow-headers", "slow-body", "short-body"],
)
def test_a_slow_client_is_closed_while_a_normal_one_is_served(server, name, sent_at_once, trickled):
    sock = connect(server)
    sock.sendall(sent_at_once)
    stop = threading.Event()
    sender = threading.Thread(target=trickle, args=(sock, trickled, stop))
    sender.start()
    start = time.monotonic()
    try:
        latencies = normal_requests_while(lambda: time.monotonic() - start < READ_TIMEOUT, server)
        waited = closed_within(sock, READ_TIMEOUT + SLACK - (time.monotonic() - start))
    finally:
        stop.set()
        sender.join()
        sock.close()
    assert waited is not None, f"{name}: still open {READ_TIMEOUT + SLACK} s after its first byte"
    closed_after = time.monotonic() - start
    assert closed_after >= READ_TIMEOUT - 0.1, f"{name}: closed after {closed_after:.2f} s, too early"
    assert max(latencies) < 1.0, f"{name}: the normal client waited {max(latencies):.2f} s"


def test_a_keep_alive_connection_serves_request_after_request_then_idles_out(server):
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    for _ in range(3):  # an honest client: whole requests, pauses shorter than the timeouts
        connection.request("POST", "/predict", BODY, {"Content-Type": "application/json"})
        response = connection.getresponse()
        response.read()
        assert response.status == 200
        time.sleep(KEEP_ALIVE / 2)
    assert closed_within(connection.sock, KEEP_ALIVE + SLACK) is not None
    connection.close()


def test_idle_sockets_past_the_connection_limit_are_refused_then_closed(server):
    idle = [connect(server) for _ in range(1500)]  # far past --max-connections
    try:
        opened = time.monotonic()
        with httpx.Client(base_url=server.url, timeout=10) as client:
            # Over --max-connections a request is answered at once (503), not left to hang.
            start = time.monotonic()
            crowded = client.post("/predict", content=BODY, headers={"Content-Type": "application/json"})
            assert crowded.status_code in (200, 503)
            assert time.monotonic() - start < 1.0
            deadline = opened + KEEP_ALIVE + SLACK + 5  # 1500 accepts and closes on a busy machine
            while time.monotonic() < deadline and not all(map(is_closed, idle)):
                time.sleep(0.1)
            still_open = sum(not is_closed(sock) for sock in idle)
            assert still_open == 0, f"{still_open} of 1500 idle sockets still open"
            served = client.post("/predict", content=BODY, headers={"Content-Type": "application/json"})
            assert served.status_code == 200, served.text
    finally:
        for sock in idle:
            sock.close()
