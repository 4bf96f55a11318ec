"""The server under load, for a few seconds: concurrent clients on every route, then more clients than
it admits. One tiny-model server for the module; ``tests.soak`` checks every answer.

The longer run is ``scripts/load_test.py``. Nothing here is timed: a request without an answer within
the client's timeout counts as lost, and that is the hang detector.
"""

import threading
import time

import httpx
import pytest

from serve.process import ServerProcess
from tests.soak import KINDS, run_load
from tests.tiny import TinyModel

MAX_IN_FLIGHT = 8
REFUSALS = frozenset({200, 429, 503, 504})


@pytest.fixture(scope="module")
def server():
    args = ["--threads", "1", "--max-in-flight", str(MAX_IN_FLIGHT), "--max-batch-size", "8"]
    with ServerProcess(args, model_factory=TinyModel()) as running:
        yield running


def stats(server) -> dict:
    return httpx.get(server.url + "/stats", timeout=10).json()


def settled(server, timeout_s: float = 10.0) -> dict:
    """``/stats`` once no request is in flight (a stream's slot is freed just after its last line)."""
    deadline = time.monotonic() + timeout_s
    while (now := stats(server))["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.05)
    return now


def test_concurrent_clients_on_every_route_get_every_answer_right(server, record_property):
    run_load(server.url, clients=2, duration_s=1.0)  # warm-up: the first passes allocate
    before = settled(server)
    report = run_load(server.url, clients=6, duration_s=3.0)
    after = settled(server)
    summary = report.as_dict()
    record_property("load", summary)
    print(
        f"\nload: {report.requests} requests, {report.clients} clients, {report.wall_s:.1f} s; "
        f"p50 {report.latency_ms['all']['p50']} ms, p99 {report.latency_ms['all']['p99']} ms; "
        f"statuses {report.statuses}; RSS {summary['rss_before_bytes'] / 2**20:.0f} -> "
        f"{summary['rss_after_bytes'] / 2**20:.0f} MiB"
    )
    assert report.problems == [] and report.inconsistent == []
    assert report.unanswered == 0 and report.duplicated == 0
    assert report.statuses == {"200": report.requests}
    assert all(report.latency_ms[kind]["n"] > 0 for kind in KINDS), report.latency_ms
    # The server's own count agrees: every request admitted finished, none failed or was dropped,
    # and it generated exactly the tokens the clients received.
    assert after["in_flight"] == 0
    delta = {name: after[name] - before[name] for name in ("admitted", "requests_done", "tokens_generated")}
    assert delta == {
        "admitted": report.requests,
        "requests_done": report.requests,
        "tokens_generated": sum(outcome.new_tokens for outcome in report.outcomes),
    }
    assert after["requests_failed"] == after["requests_cancelled"] == after["requests_timed_out"] == 0
    # A leak detector, not a measurement: a few seconds of a tiny model must not grow by hundreds of MiB.
    assert summary["rss_growth_bytes"] < 256 * 2**20


def test_more_clients_than_admitted_all_end_and_the_server_recovers(server):
    peak = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak.append(stats(server)["in_flight"])
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        report = run_load(
            server.url,
            clients=3 * MAX_IN_FLIGHT,
            duration_s=2.0,
            accept=REFUSALS,
            client_timeout_s=20.0,
            refusal_pause_s=0.05,
        )
    finally:
        done.set()
        watcher.join()
    assert report.unanswered == 0, report.problems[:3]  # every request ended, none hung
    assert report.problems == [] and report.inconsistent == []  # refusals say why, 429 with Retry-After
    assert set(report.statuses) <= {str(status) for status in REFUSALS}
    assert report.statuses.get("429", 0) > 0 and report.statuses.get("200", 0) > 0, report.statuses
    assert max(peak) <= MAX_IN_FLIGHT
    after = settled(server)
    assert after["in_flight"] == 0  # no slot leaked
    assert sum(after["ended"].values()) == after["admitted"]  # every admitted request ended once
    assert httpx.get(server.url + "/health").status_code == 200
    after = run_load(server.url, clients=2, duration_s=1.0)
    assert after.requests > 0 and after.statuses == {"200": after.requests} and after.problems == []
