"""Faults a real server must survive: overload, a stuck queue, a client gone, a request that runs too
long, a dead worker under load, SIGTERM under load."""

import json
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from lab import tokens
from lab.config import GPTConfig
from lab.model import GPT
from lab.weights import save_model
from serve.process import ServerProcess, descendants
from tests.soak import run_load
from tests.tiny import TinyModel, is_alive

pytestmark = pytest.mark.slow

SLOW_WORD = " sleepy"  # one token; a pass over it sleeps (TinyModel.slow_token)
PROMPT = "The quick brown fox jumps over the lazy dog because"


def slow_server(slow_s: float, *args: str, step_s: float = 0.0) -> ServerProcess:
    model = TinyModel(slow_token=tokens.encode(SLOW_WORD)[0], slow_s=slow_s, step_s=step_s)
    return ServerProcess(["--threads", "1", *args], model_factory=model)


@pytest.fixture(scope="module")
def small_server():
    """At most 4 requests in flight, 1 s of queueing; 20 ms a step, 2 s for a prompt with SLOW_WORD.
    One row at a time, so that requests queue behind a running one."""
    args = ("--max-in-flight", "4", "--queue-timeout", "1", "--max-batch-size", "1")
    with slow_server(2.0, *args, step_s=0.02) as server:
        yield server


def post(url: str, body: dict, timeout: float = 30.0) -> httpx.Response:
    return httpx.post(url + "/predict", json=body, timeout=timeout)


def slow_body(**extra) -> dict:
    return {"prompt": "The" + SLOW_WORD + " cat", "max_new_tokens": 1, **extra}


def stats(server: ServerProcess) -> dict:
    return httpx.get(server.url + "/stats", timeout=10).json()


def counter_change(server: ServerProcess, name: str, before: dict, timeout_s: float = 10.0) -> dict:
    """``/stats`` once counter ``name`` has moved past ``before``'s value."""
    deadline = time.monotonic() + timeout_s
    while (now := stats(server))[name] == before[name]:
        assert time.monotonic() < deadline, f"{name} did not change: {now}"
        time.sleep(0.05)
    return now


def test_overload_gets_429_then_504_and_the_server_recovers(small_server):
    server = small_server
    with ThreadPoolExecutor(8) as pool:
        held = pool.submit(post, server.url, slow_body())
        time.sleep(0.3)  # the worker is now busy for 2 s
        queued = [pool.submit(post, server.url, {"prompt": PROMPT, "max_new_tokens": 2}) for _ in range(3)]
        time.sleep(0.2)
        refused = post(server.url, {"prompt": PROMPT})
        assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
        started = time.monotonic()
        statuses = [future.result().status_code for future in queued]
        assert statuses == [504, 504, 504]  # waited past the 1 s queue timeout, none hung
        assert time.monotonic() - started < 1.5
        assert "queue timeout" in queued[0].result().json()["detail"]
        assert queued[0].result().headers["Retry-After"] == "1"  # shedding says when to come back
        assert held.result().status_code == 200
        assert post(server.url, {"prompt": PROMPT, "max_new_tokens": 2}).status_code == 200
    counts = stats(server)
    assert counts["ended"]["timed_out"] >= 3
    assert sum(counts["ended"].values()) + counts["in_flight"] == counts["admitted"]


def test_a_client_that_disconnects_stops_its_generation(small_server):
    """Shown by the server's own counters: the job is cancelled and no token is made for it after."""
    body = {"prompt": PROMPT, "max_new_tokens": 100, "stream": True}  # 100 steps of 20 ms
    before = stats(small_server)
    with httpx.stream("POST", small_server.url + "/predict", json=body, timeout=30) as response:
        lines = response.iter_lines()
        assert json.loads(next(lines))["event"] == "token"
    # closed after one token
    cancelled = counter_change(small_server, "requests_cancelled", before)
    time.sleep(0.3)  # 15 steps' worth: a generation still running would show here
    later = stats(small_server)
    assert later["tokens_generated"] == cancelled["tokens_generated"]
    assert 1 <= cancelled["tokens_generated"] - before["tokens_generated"] < 100
    assert later["requests_done"] == before["requests_done"] and later["in_flight"] == 0
    after = post(small_server.url, {"prompt": PROMPT, "max_new_tokens": 1})
    assert after.status_code == 200, after.text


def test_a_non_streaming_client_that_gives_up_stops_its_generation(small_server):
    before = stats(small_server)
    with pytest.raises(httpx.ReadTimeout):
        post(small_server.url, {"prompt": PROMPT, "max_new_tokens": 100}, timeout=0.5)
    cancelled = counter_change(small_server, "requests_cancelled", before)
    time.sleep(0.3)
    assert stats(small_server)["tokens_generated"] == cancelled["tokens_generated"]
    assert cancelled["tokens_generated"] - before["tokens_generated"] < 100


def test_a_killed_worker_fails_its_requests_fast_and_is_replaced():
    """SIGKILL to the worker under load: what it held gets 503 within seconds, what waited runs on
    the replacement, nothing hangs, and load after the replacement gets only 200s."""
    # --batch-timeout: the idle worker waits a second for company, so both slow requests are in its
    # engine when their 3 s prefill starts; the load, sent after, queues behind that pass and runs on
    # the replacement
    with slow_server(3.0, "--batch-timeout", "1.0") as server, ThreadPoolExecutor(4) as pool:
        info = httpx.get(server.url + "/info").json()
        assert info["model"]["depth"] == 4
        in_flight = pool.submit(post, server.url, slow_body())
        streamed = pool.submit(post, server.url, slow_body(stream=True, blocks="skip=1"))
        time.sleep(1.5)
        stop = threading.Event()
        load = pool.submit(
            run_load, server.url, clients=3, duration_s=120, accept=frozenset({200, 503}), stop=stop
        )
        time.sleep(0.3)
        (worker,) = server.workers()
        killed_at = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        response = in_flight.result()
        assert response.status_code == 503 and "died" in response.json()["detail"]
        assert streamed.result().status_code == 503  # before its first token: a status, not a cut stream
        assert time.monotonic() - killed_at < 5
        deadline = time.monotonic() + 60
        while httpx.get(server.url + "/health").status_code != 200:  # the new worker loads the model
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.2)
        healthy_at = time.monotonic()
        # A request of ours after the replacement: 200, and once it is answered the load's clients,
        # which send back to back, have started requests after healthy_at too (however slow the CPU).
        assert post(server.url, {"prompt": PROMPT, "max_new_tokens": 2}).status_code == 200
        time.sleep(1.0)
        stop.set()
        report = load.result()
    print(f"\nworker killed under load: {report.requests} requests, statuses {report.statuses}")
    assert report.unanswered == 0 and report.problems == [], report.problems[:3]  # 200 or 503, no hang
    for outcome in report.outcomes:
        if outcome.status == 503:  # it was in the dead worker's hands: told within seconds
            assert outcome.started_at + outcome.latency_s - killed_at < 5
        if outcome.started_at > healthy_at:
            assert outcome.status == 200
    assert any(outcome.started_at > healthy_at for outcome in report.outcomes)


def test_with_two_workers_a_killed_ones_untaken_orders_run_on_the_other():
    """Each worker holds a 2 s request and has one order queued behind it (each job goes to the
    least loaded worker); SIGKILL to one: its running job gets 503, its queued order runs on the
    other worker, and once the replacement is up every request is answered."""
    args = ("--workers", "2", "--max-batch-size", "1")
    with slow_server(2.0, *args) as server, ThreadPoolExecutor(8) as pool:
        held = [pool.submit(post, server.url, slow_body()) for _ in range(2)]
        time.sleep(0.5)  # each worker has taken one
        queued = [pool.submit(post, server.url, {"prompt": PROMPT, "max_new_tokens": 2}) for _ in range(2)]
        time.sleep(0.3)
        os.kill(server.workers()[0], signal.SIGKILL)
        assert sorted(future.result().status_code for future in held) == [200, 503]
        assert [future.result().status_code for future in queued] == [200, 200]
        deadline = time.monotonic() + 60
        while httpx.get(server.url + "/health").status_code != 200:  # the replacement loads the model
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.2)
        after = [pool.submit(post, server.url, {"prompt": PROMPT, "max_new_tokens": 2}) for _ in range(6)]
        assert [future.result().status_code for future in after] == [200] * 6
        counts = stats(server)
        assert counts["ended"]["worker_died"] == 1 and counts["ended"]["done"] == 9


def test_an_error_mid_stream_ends_with_an_error_event():
    """The worker dies after the first token: the stream ends with an error event, not a silent cut."""
    with ServerProcess(["--threads", "1"], model_factory=TinyModel(step_s=0.1)) as server:
        body = {"prompt": PROMPT, "max_new_tokens": 40, "stream": True}
        (worker,) = server.workers()
        events = []
        with httpx.stream("POST", server.url + "/predict", json=body, timeout=30) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                events.append(json.loads(line))
                if len(events) == 1:
                    os.kill(worker, signal.SIGKILL)
        assert events[0]["event"] == "token"
        assert events[-1]["event"] == "error" and events[-1]["status"] == 503
        assert len(events) < 40


def stream_events(url: str, body: dict, timeout: float) -> list[dict]:
    with httpx.stream("POST", url + "/predict", json={**body, "stream": True}, timeout=timeout) as response:
        return [json.loads(line) for line in response.iter_lines() if line]


@pytest.fixture(scope="module")
def deadline_server():
    """--request-timeout 1.5 s; every pass 50 ms (100 tokens would take 5 s), a pass over SLOW_WORD 8 s."""
    with slow_server(8.0, "--request-timeout", "1.5", step_s=0.05) as server:
        yield server


def test_a_generation_past_the_request_timeout_ends_with_504(deadline_server):
    server = deadline_server
    before = stats(server)
    response = post(server.url, {"prompt": PROMPT, "max_new_tokens": 100})
    assert response.status_code == 504, response.text
    assert "request timeout" in response.json()["detail"] and "--request-timeout" in response.json()["detail"]
    events = stream_events(server.url, {"prompt": PROMPT, "max_new_tokens": 100}, timeout=30)
    assert events[0]["event"] == "token" and len(events) < 100
    assert events[-1]["event"] == "error" and events[-1]["status"] == 504
    after = stats(server)
    assert after["requests_timed_out"] - before["requests_timed_out"] == 2 and after["in_flight"] == 0
    assert post(server.url, {"prompt": PROMPT, "max_new_tokens": 2}).status_code == 200  # the worker is free
    body = {"prompt": PROMPT, "max_tokens": 100, "stream": True, "ignore_eos": True}
    reply = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    chunks = [json.loads(line[6:]) for line in reply.text.split("\n\n") if line.startswith("data: {")]
    error = chunks[-1]["error"]  # OpenAI's error shape, mid-stream
    assert chunks[0]["choices"] and error | {"message": ""} == {
        "message": "", "type": "server_error", "param": None, "code": 504
    }  # fmt: skip


def test_a_step_that_never_returns_gets_504_from_the_http_side(deadline_server):
    """The worker checks the deadline between steps; a step stuck for 8 s is the HTTP side's to end."""
    started = time.monotonic()
    response = post(deadline_server.url, slow_body())
    assert response.status_code == 504 and "stuck" in response.json()["detail"], response.text
    assert time.monotonic() - started < 8  # answered while the step was still sleeping


def test_sigterm_drains_requests_in_flight_and_leaves_no_process(tmp_path):
    """Through the real CLI and --model DIR: requests running at SIGTERM finish, then all exits."""
    torch.manual_seed(0)
    config = GPTConfig(n_layer=2, n_head=2, n_embd=128, vocab_size=50257, block_size=1024)
    save_model(GPT(config), tmp_path / "model")
    # the drain outlasts 900 tokens on a slow host too: the test is of draining, not of the host's speed
    args = ["--model", str(tmp_path / "model"), "--threads", "1", "--drain-timeout", "120"]
    with ServerProcess(args) as server:
        processes = descendants(server.pid) | {server.pid}
        assert len(processes) >= 3  # the server, LitServe's manager, a worker (and the resource tracker)
        with ThreadPoolExecutor(4) as pool:
            body = {"prompt": PROMPT, "max_new_tokens": 900}
            running = [pool.submit(post, server.url, body, 120.0) for _ in range(3)]
            streaming = pool.submit(stream_events, server.url, body, 120.0)
            time.sleep(1.0)
            assert not any(future.done() for future in [*running, streaming]), "finished before SIGTERM"
            assert server.stop(timeout=120) == 0
            outs = [future.result() for future in running]
            events = streaming.result()
    assert [out.status_code for out in outs] == [200, 200, 200]
    assert all(len(out.json()["tokens"]) == 900 for out in outs)
    assert events[-1]["event"] == "done" and len(events[-1]["response"]["tokens"]) == 900
    time.sleep(0.5)
    assert [pid for pid in processes if is_alive(pid)] == []
    with socket.socket() as sock:  # the port is free again (for a server, which sets SO_REUSEADDR)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", server.port))
        sock.listen()


def test_sigint_stops_an_idle_server_and_leaves_no_process():
    with ServerProcess(["--threads", "1"], model_factory=TinyModel()) as server:
        processes = descendants(server.pid) | {server.pid}
        server.process.send_signal(signal.SIGINT)
        assert server.process.wait(timeout=60) == 0
    time.sleep(0.5)
    assert [pid for pid in processes if is_alive(pid)] == []
