"""``GET /metrics``: behind the API key unless ``--metrics-public``, and its counts equal what was sent.

The load test sends 200 requests over every route (``tests.soak``'s mix, plus refusals: bodies that
get 422, an unknown model's 404, more clients than ``--max-in-flight`` so some get 429), counts the
answers per route and status as the clients saw them, and checks the server's histograms and
counters against those counts: per route and status, requests finished, tokens, shed.
"""

import asyncio
import time
from collections import Counter

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from lab.blocks import BlockSet
from serve import app
from serve.client import closed_loop
from serve.metrics import exit_depths, kind_of, one_two_five
from serve.process import ServerProcess
from tests.soak import make_plan, send
from tests.tiny import TinyModel

MAX_IN_FLIGHT = 4
REQUESTS = 200


def samples(text: str) -> Counter:
    """Every sample of a scrape, by (name, sorted labels), the model name left out."""
    found = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            found[sample.name, labels] += sample.value
    return found


def delta(before: Counter, after: Counter, name: str, **labels) -> float:
    """The change of ``name`` summed over the samples whose labels include ``labels``."""
    wanted = {(k, str(v)) for k, v in labels.items()}
    return sum(after[key] - before.get(key, 0.0) for key in after if key[0] == name and wanted <= set(key[1]))


def test_metrics_need_the_key_unless_public():
    for public, without_key in ((False, 401), (True, 200)):
        flags = ["--api-key", "k", *(["--metrics-public"] if public else [])]
        client = TestClient(app.build(app.options(flags), TinyModel()).app)  # nothing started
        assert client.get("/metrics").status_code == without_key
        scraped = client.get("/metrics", headers={"X-API-Key": "k"})
        assert scraped.status_code == 200
        assert scraped.headers["content-type"].startswith("text/plain")
        names = {family.name for family in text_string_to_metric_families(scraped.text)}
        assert {"vllm:time_to_first_token_seconds", "vllm:num_requests_running"} <= names
        assert {"blocklab:exit_depth", "blocklab:http_request_duration_seconds"} <= names


def test_block_set_kinds_and_exit_depths():
    assert kind_of(BlockSet()) == "all"
    assert kind_of(BlockSet.parse("skip=1;exit=3", 4)) == "skip+exit"
    assert kind_of(BlockSet.parse("keep=0,2;overwrite=2", 4)) == "skip+overwrite"
    assert kind_of(BlockSet.parse("adaptive=0.9;min=2;check=cosine", 4)) == "adaptive"
    assert kind_of(BlockSet.parse("speculate=2;k=3", 4)) == "speculate"
    # adaptive over blocks 0, 2, 3 (1 skipped): 1 block ran -> depth 1, 2 -> depth 3, 3 -> depth 4
    assert exit_depths(BlockSet.parse("skip=1;adaptive=0.9", 4), 4, [1, 2, 3]) == [1, 3, 4]
    assert exit_depths(BlockSet.parse("exit=2", 4), 4, [2, 2]) == [2, 2]
    assert one_two_five(100) == [1, 2, 5, 10, 20, 50, 100]


async def load(url: str) -> tuple[Counter, list]:
    """``REQUESTS`` requests from 6 clients: the plan's shots, every tenth a 422, every tenth a 404."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        plan = make_plan((await http.get("/info")).json(), max_new_tokens=4)
        seen, outcomes = Counter(), []

        async def job(number: int) -> None:
            if number % 10 == 8:
                response = await http.post("/predict", json={"prompt": "", "max_new_tokens": 1})
                seen["/predict", "POST", response.status_code] += 1
            elif number % 10 == 9:
                response = await http.get("/v1/models/nope")
                seen["/v1/models/{model}", "GET", response.status_code] += 1
            else:
                outcome = await send(http, plan.shot(number), frozenset({200, 429}))
                assert outcome.problem is None, outcome.problem
                seen[outcome.shot.path, "POST", outcome.status] += 1
                outcomes.append(outcome)

        await closed_loop(job, 6, count=REQUESTS)
    return seen, outcomes


def settle(server: ServerProcess, check, timeout_s: float = 5.0) -> None:
    """``check(scrape)`` until it holds (a stream's last observations follow its last byte)."""
    deadline = time.monotonic() + timeout_s
    while True:
        scraped = samples(httpx.get(server.url + "/metrics", timeout=10).text)
        try:
            check(scraped)
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@pytest.mark.slow
def test_the_counts_under_load_equal_the_requests_sent():
    args = ["--threads", "1", "--max-in-flight", str(MAX_IN_FLIGHT)]
    with ServerProcess(args, model_factory=TinyModel()) as server:
        before = samples(httpx.get(server.url + "/metrics", timeout=10).text)
        seen, outcomes = asyncio.run(load(server.url))
        done = [outcome for outcome in outcomes if outcome.status == 200]
        assert sum(seen.values()) == REQUESTS
        assert {status for *_, status in seen} >= {200, 404, 422}

        def check(after: Counter) -> None:
            http = "blocklab:http_request_duration_seconds_count"
            for (route, method, status), count in seen.items():
                assert delta(before, after, http, route=route, method=method, status=status) == count, (
                    route, method, status,
                )  # fmt: skip
            model_routes = ("/predict", "/v1/completions", "/v1/chat/completions")
            sent = sum(count for (route, _, _), count in seen.items() if route in model_routes)
            assert sum(delta(before, after, http, route=route) for route in model_routes) == sent
            assert delta(before, after, "vllm:e2e_request_latency_seconds_count") == len(done)
            assert delta(before, after, "vllm:request_success_total") == len(done)
            assert delta(before, after, "blocklab:requests_finished_total", outcome="done") == len(done)
            assert delta(before, after, "blocklab:requests_finished_total") == len(done)
            generating = [outcome for outcome in done if outcome.new_tokens]
            assert delta(before, after, "vllm:time_to_first_token_seconds_count") == len(generating)
            tokens = sum(outcome.new_tokens for outcome in done)
            assert delta(before, after, "vllm:generation_tokens_total") == tokens
            assert delta(before, after, "blocklab:blocks_per_token_count") == tokens
            assert delta(before, after, "blocklab:exit_depth_count") == tokens
            gaps = sum(max(0, outcome.new_tokens - 1) for outcome in generating)
            assert delta(before, after, "vllm:inter_token_latency_seconds_count") == gaps
            refused = sum(count for (_, _, status), count in seen.items() if status == 429)
            assert delta(before, after, "blocklab:requests_shed_total", status=429) == refused
            assert after["vllm:num_requests_running", ()] == 0 and after["vllm:num_requests_waiting", ()] == 0

        settle(server, check)


def test_the_prompt_caches_counts_are_scraped_as_the_workers_count_them():
    """A prompt sent again after its request ended is copied from the worker's prompt cache: the
    scrape counts it as /stats does, and the bytes the cache holds."""
    with ServerProcess(["--threads", "1"], model_factory=TinyModel()) as server:
        body = {"prompt": "The quick brown fox jumps over the lazy dog", "max_new_tokens": 2}
        before = samples(httpx.get(server.url + "/metrics", timeout=10).text)
        for _ in range(2):
            assert httpx.post(server.url + "/predict", json=body, timeout=30).status_code == 200
        after = samples(httpx.get(server.url + "/metrics", timeout=10).text)
        stats = httpx.get(server.url + "/stats", timeout=10).json()
    assert delta(before, after, "blocklab:prefills_copied_total") == 1 == stats["prefills_copied"]
    copied = delta(before, after, "blocklab:prompt_tokens_copied_total")
    assert copied == stats["prompt_tokens_copied"] > 0
    assert after["blocklab:prompt_cache_bytes", ()] == stats["prompt_cache_bytes"] > 0
