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

from serve.app import MAX_HEADER_BYTES
from serve.connections import LINGER_S
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
    """Whether the server closed ``sock`` (end of stream or reset, past any answer it sent first);
    False while it stays open."""
    sock.settimeout(0)
    try:
        while sock.recv(65536):
            pass
        return True
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


def test_requests_on_new_connections_past_the_limit_get_an_answer_each(server):
    """Connections opened together past --max-connections, each then sending a whole request: every
    one is answered, 200 or 503, none reset. A connection that has sent nothing yet is not an idle
    keep-alive one to close for room: closing it, its request still unread, reset it."""
    crowd = [connect(server) for _ in range(MAX_CONNECTIONS + 8)]
    try:
        for sock in crowd:
            # long enough that none is answered (and idle, to be closed for room) before all have sent
            sock.sendall(LONG_POST)
        statuses = []
        for sock in crowd:
            sock.settimeout(30)
            try:
                statuses.append(sock.recv(12)[9:12].decode() or "closed")  # "HTTP/1.1 200"
            except ConnectionResetError:
                statuses.append("reset")
        assert set(statuses) <= {"200", "503"}, statuses
        assert "503" in statuses  # past the limit
    finally:
        for sock in crowd:
            sock.close()


# -- Every byte ordering: a request that arrives behind another, or split anywhere ------------------

TARGET_S = 1.0
"""How long past its read timeout a stalled connection may stay open (issue #20's target)."""
GET_HEALTH = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
WHOLE_POST = HEADERS + b"\r\n" + BODY
LONG_BODY = json.dumps({"prompt": "Hello there", "max_new_tokens": 64, "ignore_eos": True}).encode()
LONG_POST = (
    b"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(LONG_BODY), LONG_BODY)
)
STALLED_POST = (  # headers of a 100-byte body that never comes
    b"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b"Content-Length: 100\r\n\r\n"
)
STREAM_BODY = json.dumps({"prompt": "Hello there", "max_new_tokens": 60, "stream": True}).encode()
STREAMING_POST = (
    b"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(STREAM_BODY), STREAM_BODY)
)


def read_responses(sock: socket.socket, count: int, timeout_s: float = 10.0) -> list[int]:
    """The statuses of the next ``count`` responses on ``sock``, each read to the end of its
    Content-Length (one reader for all: pipelined answers come back to back)."""
    sock.settimeout(timeout_s)
    reader = sock.makefile("rb")
    statuses = []
    for _ in range(count):
        statuses.append(int(reader.readline().split()[1]))
        length = 0
        while (line := reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        reader.read(length)
    return statuses


class Closing:
    """Watches ``sock`` from ``started`` on, in a thread, for the server to close it: ``after()`` is
    the seconds that took, asserted at most the read timeout + ``TARGET_S``."""

    def __init__(self, sock: socket.socket, started: float, read_timeout: float = READ_TIMEOUT):
        self.sock, self.started, self.limit = sock, started, read_timeout + TARGET_S
        self.closed_at: float | None = None
        self.thread = threading.Thread(target=self._watch)
        self.thread.start()

    def _watch(self) -> None:
        while time.monotonic() - self.started < self.limit:
            if is_closed(self.sock):
                self.closed_at = time.monotonic()
                return
            time.sleep(0.02)

    def after(self) -> float:
        self.thread.join()
        assert self.closed_at is not None, f"still open {self.limit:g} s after its request began to arrive"
        return self.closed_at - self.started


@pytest.mark.parametrize(
    ("sends", "answered"),
    [
        ([GET_HEALTH + STALLED_POST], 1),  # issue #20's lockout reproducer, on one connection
        ([GET_HEALTH + STALLED_POST[:40]], 1),  # headers cut in the middle
        ([GET_HEALTH + b"POS"], 1),  # the request line cut
        ([GET_HEALTH + GET_HEALTH + STALLED_POST], 2),  # behind two
        ([WHOLE_POST + HEADERS + b"\r\n" + BODY[:10]], 1),  # a body short of its length, behind a POST
        ([STREAMING_POST, STALLED_POST], 1),  # sent while a stream is being answered
        ([STREAMING_POST, STALLED_POST[:30]], 1),  # a part of them, while it is answered
    ],
    ids=[
        "reproducer",
        "cut-headers",
        "cut-request-line",
        "behind-two",
        "short-body",
        "behind-a-stream",
        "cut-behind-a-stream",
    ],  # fmt: skip
)
def test_a_request_behind_another_has_a_read_deadline(server, sends, answered):
    """The request that stalls began to arrive once the server turned to it (the answer before it is
    complete): from then, closed within the read timeout + 1 s; a normal client is served meanwhile."""
    sock = connect(server)
    try:
        sock.sendall(sends[0])
        if len(sends) > 1:  # the first answer has started: the rest arrives while it is written
            assert sock.recv(12).startswith(b"HTTP/1.1 200")
            sock.sendall(sends[1])
            reader = sock.makefile("rb")
            while reader.readline() not in (b"0\r\n", b""):  # to the stream's last chunk
                pass
            reader.readline()
            statuses = [200]
        else:
            statuses = read_responses(sock, answered)
        closing = Closing(sock, time.monotonic())
        latencies = normal_requests_while(lambda: closing.thread.is_alive(), server)
        closed_after = closing.after()
    finally:
        sock.close()
    assert statuses == [200] * answered
    assert closed_after >= READ_TIMEOUT - 0.2, f"closed after {closed_after:.2f} s, before its deadline"
    assert max(latencies) < 1.0, f"the normal client waited {max(latencies):.2f} s"


def test_a_request_split_anywhere_is_timed_from_its_first_byte(server):
    """Headers in three parts, then no body: the deadline runs from the first part, not the last."""
    sock = connect(server)
    try:
        sock.sendall(STALLED_POST[:10])
        closing = Closing(sock, time.monotonic())
        for part in (STALLED_POST[10:50], STALLED_POST[50:]):
            time.sleep(0.4)
            sock.sendall(part)
        closed_after = closing.after()
    finally:
        sock.close()
    assert closed_after >= READ_TIMEOUT - 0.1


# -- The lockout: stalled requests behind others, more of them than the server takes connections ----

LOCKOUT_ARGS = ["--max-connections", "16", "--read-timeout", "2", "--keep-alive-timeout", "1"]
LOCKOUT_READ_TIMEOUT = 2.0


def answer_of(client: httpx.Client) -> tuple[float, httpx.Response]:
    start = time.monotonic()
    response = client.post("/predict", content=BODY, headers={"Content-Type": "application/json"})
    return time.monotonic() - start, response


def test_stalled_connections_past_the_limit_do_not_lock_new_requests_out():
    """Issue #20's reproducer on 20 connections against --max-connections 16: every new request is
    answered at once (200, or the API's 503 with Retry-After while the limit is reached), the stalled
    connections are closed within the read timeout + 1 s, and then new requests are served."""
    with ServerProcess(LOCKOUT_ARGS, model_factory=TinyModel()) as server:
        attackers = [connect(server) for _ in range(20)]
        started = time.monotonic()
        for sock in attackers:
            sock.sendall(GET_HEALTH + STALLED_POST)
        answers = []
        with httpx.Client(base_url=server.url, timeout=10) as client:
            while time.monotonic() - started < LOCKOUT_READ_TIMEOUT + TARGET_S:
                answers.append((time.monotonic() - started, *answer_of(client)))
                time.sleep(0.05)
            open_after = [sock for sock in attackers if not is_closed(sock)]
            for sock in attackers:
                sock.close()
            waited, last = answer_of(client)
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert not open_after, f"{len(open_after)} of 20 stalled connections open after the read timeout + 1 s"
    assert last.status_code == 200 and waited < 1.0
    for at, waited, response in answers:
        assert waited < 1.0, f"a new request {at:.1f} s into the attack waited {waited:.2f} s"
        assert response.status_code in (200, 503), response.text
        if response.status_code == 503:  # shed with instructions, in the API's error shape
            assert response.headers["retry-after"] == "1"
            assert "connections" in response.json()["detail"]
    assert answers[-1][2].status_code == 200, "still refused once the stalled connections were closed"
    assert 'blocklab:requests_shed_total{reason="connections",status="503"}' in metrics


def test_shutdown_drains_whole_requests_and_does_not_wait_on_stalled_ones():
    """SIGTERM with one request in flight and stalled connections of every kind (no request, cut
    headers, a body that never comes, behind a response): the request in flight gets its whole
    answer and the server exits once it has, long before the read timeout or the drain timeout."""
    slow = TinyModel(step_s=0.05)  # 30 tokens: about 1.5 s
    args = ["--read-timeout", "60", "--keep-alive-timeout", "60", "--drain-timeout", "60"]
    server = ServerProcess(args, model_factory=slow).start()
    try:
        stalled = [connect(server) for _ in range(4)]
        stalled[1].sendall(STALLED_POST[:30])
        stalled[2].sendall(STALLED_POST)
        stalled[3].sendall(GET_HEALTH + STALLED_POST)
        body = {"prompt": "Hello there", "max_new_tokens": 30, "ignore_eos": True}
        result = {}
        in_flight = threading.Thread(
            target=lambda: result.update(response=httpx.post(server.url + "/predict", json=body, timeout=30))
        )
        in_flight.start()
        time.sleep(0.5)  # admitted and running
        start = time.monotonic()
        returncode = server.stop(timeout=20)
        stopped_after = time.monotonic() - start
        in_flight.join()
    finally:
        server.stop()
        server.log_path.unlink()
    assert returncode == 0
    assert result["response"].status_code == 200 and len(result["response"].json()["tokens"]) == 30
    assert stopped_after < 15, f"shutdown took {stopped_after:.1f} s: it waited on a stalled connection"


# -- The request line and headers: bounded (httptools, the parser, has no bound of its own) ---------


def get_health_with_headers(size: int) -> bytes:
    """A GET /health whose request line and headers take ``size`` bytes."""
    head = GET_HEALTH[: -len(b"\r\n")]
    padding = b"X-Padding: \r\n"
    return head + padding[:-2] + b"a" * (size - len(head) - len(padding) - 2) + b"\r\n\r\n"


def test_headers_just_under_the_bound_are_served_alone_and_pipelined(server):
    """A request's line and headers of the bound less a byte pass, also behind another request in
    the same send, where the reads the server counts hold the end of the one before."""
    under = get_health_with_headers(MAX_HEADER_BYTES - 1)
    assert len(under) == MAX_HEADER_BYTES - 1
    sock = connect(server)
    try:
        sock.sendall(under)
        assert read_responses(sock, 1) == [200]
        sock.sendall(under + under + under)
        assert read_responses(sock, 3) == [200, 200, 200]
    finally:
        sock.close()


@pytest.mark.parametrize("pipelined", [False, True], ids=["alone", "behind-a-request"])
def test_headers_past_the_bound_sent_at_once_get_400_and_a_lingering_close(server, pipelined):
    """Whole headers a byte past the bound, in one send (so parsed whole, counted as parsed): 400,
    after the answer to the request before it, and the connection closed; new requests are served."""
    over = get_health_with_headers(MAX_HEADER_BYTES + 1)
    sock = connect(server)
    try:
        sock.sendall(GET_HEALTH + over if pipelined else over)
        statuses = read_responses(sock, 2 if pipelined else 1)
        closed = closed_within(sock, LINGER_S + SLACK)
    finally:
        sock.close()
    assert statuses == [200, 400] if pipelined else [400]
    assert closed is not None
    assert normal_requests_while(lambda: False, server)


def test_headers_that_never_end_are_refused_once_past_the_bound_not_at_the_read_timeout(server):
    """Headers sent a kilobyte at a time past the bound, never finished: 400 as the bound is passed
    (counted from the reads as they come), not a close at the read timeout (which answers nothing)."""
    sock = connect(server)
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nX-Padding: ")
        for _ in range(3 * MAX_HEADER_BYTES // 1024):  # what follows the 400 is read and dropped
            sock.sendall(b"a" * 1024)
            time.sleep(0.001)
        sock.settimeout(READ_TIMEOUT)
        answer = sock.recv(65536)
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 400"), answer[:100]
    assert str(MAX_HEADER_BYTES).encode() in answer


def test_garbage_behind_a_stream_is_answered_400_once_the_stream_is_whole(server):
    """A request that cannot be parsed, sent while a stream is answered: the stream ends whole, then
    the 400, then the connection closes."""
    sock = connect(server)
    try:
        sock.sendall(STREAMING_POST)
        assert sock.recv(12).startswith(b"HTTP/1.1 200")
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        reader = sock.makefile("rb")
        lines = []
        while (line := reader.readline()) not in (b"0\r\n", b""):  # to the stream's last chunk
            lines.append(line)
        reader.readline()
        after = reader.read()  # to the end: the 400 and the close
    finally:
        sock.close()
    events = [json.loads(line) for line in lines if line.startswith(b"{")]
    assert events[-1]["event"] == "done"
    assert after.startswith(b"HTTP/1.1 400"), after[:100]


def test_blank_lines_do_not_hold_a_connection_open(server):
    """Blank lines (which begin no request) sent more often than the keep-alive timeout: closed
    within the read timeout of the first, as any request that does not arrive."""
    sock = connect(server)
    stop = threading.Event()
    sender = threading.Thread(target=trickle, args=(sock, b"\r\n" * 100, stop, KEEP_ALIVE / 4))
    try:
        sender.start()
        closing = Closing(sock, time.monotonic() + KEEP_ALIVE / 4)
        closed_after = closing.after()
    finally:
        stop.set()
        sender.join()
        sock.close()
    assert closed_after >= READ_TIMEOUT - 0.2
