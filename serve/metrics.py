"""The server's Prometheus metrics, at ``GET /metrics`` (prometheus_client, in the API process).

Where a metric means what one of vLLM's means, it has vLLM's name, label ``model_name`` and
histogram buckets (vllm/v1/metrics/loggers.py), so a dashboard or an alert written for vLLM reads
it unchanged; blocklab's own are ``blocklab:``. Everything is observed on the HTTP side from the
events the workers send (a request's ``done`` event carries its timings and, beside the response,
the gaps between its tokens, ``serve.engine.TOKEN_GAPS``), so nothing is shared with the worker processes.

vLLM's names (one request = one prompt: a completions request of n prompts counts n):

- ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds`` (every gap between two
  tokens of a request), ``vllm:request_time_per_output_token_seconds`` (a request's mean gap),
  ``vllm:e2e_request_latency_seconds``, ``vllm:request_queue_time_seconds``,
  ``vllm:request_prefill_time_seconds``: histograms of the requests that finished (200), measured
  by the worker from the moment the request was admitted;
- ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``; ``vllm:request_prompt_tokens``,
  ``vllm:request_generation_tokens`` (histograms); ``vllm:request_success_total{finished_reason}``
  (``length``, ``stop``, ``scored``);
- ``vllm:num_requests_running`` (taken by a worker), ``vllm:num_requests_waiting`` (admitted, not
  taken yet), read when scraped;
- ``vllm:spec_decode_num_drafts_total``, ``..._num_draft_tokens_total``,
  ``..._num_accepted_tokens_total``: self-speculation's rounds, drafted and accepted tokens, here
  also by ``kind``.

blocklab's own, by block-set ``kind`` (``kind_of``: ``all``, ``skip``, ``exit``, ``adaptive``,
``skip+exit``, ...):

- ``blocklab:blocks_per_token`` and ``blocklab:exit_depth`` (histograms, one observation per new
  token: how many blocks it ran, and the depth it was read out at);
- ``blocklab:requests_finished_total{kind, outcome}``: every admitted request once it ends
  (``serve.http_front.OUTCOMES``);
- ``blocklab:requests_shed_total{status, reason}``: refused before running (413 ``payload``, 429
  ``in_flight``, 503 ``loading`` or ``connections``);
- ``blocklab:prefills_copied_total``, ``blocklab:prompt_tokens_copied_total`` and the gauge
  ``blocklab:prompt_cache_bytes``: the workers' prompt caches (``serve.prompt_cache``), read when
  scraped;
- ``blocklab:http_request_duration_seconds{route, method, status}``: every HTTP request, by the
  route's path template (``other`` for paths no route has), from its start to its last byte
  (observed by ``serve.http_front.HttpMetricsMiddleware``);
  ``status`` 499 when the client was gone before the answer (one whose request never arrived whole
  and was closed by ``--read-timeout``, say).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.responses import Response

from lab.blocks import BlockSet
from serve.schema import MAX_NEW_TOKENS, MAX_PROMPT_IDS, Job, new_token_count

# vLLM's buckets, so its dashboards' quantiles read the same
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                         10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
DEPTH_BUCKETS = (*range(1, 25), 28, 32, 36, 40, 48)
"""Whole blocks: every depth of GPT-2 small and medium, then the larger ones' steps."""
CLIENT_GONE = 499
"""The status counted for a request whose client left (or was closed) before its answer (nginx's)."""
HTTP_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
)
KIND_KEYS = ("skip", "overwrite", "exit", "adaptive", "speculate")
"""The block-set keys that name a kind (``min``, ``check`` and ``k`` only tune one)."""


def one_two_five(top: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``top`` (vLLM's ``build_1_2_5_buckets``)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > top:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


def kind_of(block_set: BlockSet) -> str:
    """The block set's kind, a label of bounded cardinality: its kind keys joined by '+', or 'all'."""
    return "+".join(name for name in block_set.given() if name in KIND_KEYS) or "all"


def exit_depths(block_set: BlockSet, n_layer: int, blocks_per_token: list[int]) -> list[int]:
    """The depth (last block run + 1) each token was read out at, from how many of the set's blocks it ran."""
    blocks = block_set.blocks_to_run(n_layer)
    return [blocks[count - 1] + 1 if count else 0 for count in blocks_per_token]


class Metrics:
    """The server's metrics in a registry of their own (one per app); see the module docstring."""

    def __init__(self, model_name: str = ""):
        self.model_name = model_name
        self.registry = registry = CollectorRegistry()
        model = ["model_name"]

        def histogram(name: str, doc: str, buckets, labels=model) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=registry)

        def counter(name: str, doc: str, labels=model) -> Counter:
            return Counter(name, doc, labels, registry=registry)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Time between two tokens.", TOKEN_LATENCY_BUCKETS
        )
        self.tpot = histogram(
            "vllm:request_time_per_output_token_seconds", "A request's mean time per output token after "
            "the first.", TOKEN_LATENCY_BUCKETS,
        )  # fmt: skip
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Admitted to done.", REQUEST_LATENCY_BUCKETS)
        self.queue = histogram(
            "vllm:request_queue_time_seconds", "Admitted to running.", REQUEST_LATENCY_BUCKETS
        )
        self.prefill = histogram(
            "vllm:request_prefill_time_seconds", "Prefill passes.", REQUEST_LATENCY_BUCKETS
        )
        self.prompt_sizes = histogram(
            "vllm:request_prompt_tokens", "Prompt tokens.", one_two_five(MAX_PROMPT_IDS)
        )
        self.generation_sizes = histogram(
            "vllm:request_generation_tokens", "New tokens.", one_two_five(MAX_NEW_TOKENS)
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("vllm:generation_tokens", "New tokens of finished requests.")
        self.success = counter("vllm:request_success", "Finished requests.", [*model, "finished_reason"])
        kind = [*model, "kind"]
        self.drafts = counter("vllm:spec_decode_num_drafts", "Speculation rounds.", kind)
        self.drafted = counter("vllm:spec_decode_num_draft_tokens", "Tokens drafted.", kind)
        self.accepted = counter("vllm:spec_decode_num_accepted_tokens", "Drafted tokens accepted.", kind)
        self.blocks_per_token = histogram(
            "blocklab:blocks_per_token", "Blocks each new token ran.", DEPTH_BUCKETS, ["kind"]
        )
        self.exit_depth = histogram(
            "blocklab:exit_depth", "The depth each new token was read out at.", DEPTH_BUCKETS, ["kind"]
        )
        self.finished = counter("blocklab:requests_finished", "Admitted requests, by how they ended.",
                                ["kind", "outcome"])  # fmt: skip
        self.shed = counter(
            "blocklab:requests_shed", "Requests refused before running.", ["status", "reason"]
        )
        self.http = histogram(
            "blocklab:http_request_duration_seconds", "HTTP requests, first byte to last.", HTTP_BUCKETS,
            ["route", "method", "status"],
        )  # fmt: skip
        self.running = Gauge("vllm:num_requests_running", "Requests a worker runs.", model, registry=registry)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests admitted, not taken yet.", model,
                             registry=registry)  # fmt: skip

    def watch(self, counts: Callable[[], dict]) -> None:
        """Read ``running`` and ``waiting`` from ``counts()`` (the pool's stats) at each scrape, and
        the workers' prompt-cache counters (``_PromptCacheCounts``)."""
        self.running.labels(self.model_name).set_function(lambda: counts()["running"])
        self.waiting.labels(self.model_name).set_function(lambda: counts()["waiting"])
        self.registry.register(_PromptCacheCounts(counts, self.model_name))

    def ended(self, job: Job, outcome: str, last: dict | None, token_gaps: list[float], n_layer: int) -> None:
        """An admitted request of a model of ``n_layer`` blocks ended (``outcome``); ``last``: its done
        or error event (None: it ended without one, cancelled), ``token_gaps``: seconds between its
        tokens."""
        kind = kind_of(job.block_set)
        self.finished.labels(kind, outcome).inc()
        if last is not None and last["event"] == "done":
            self._done(job, kind, last["response"], token_gaps, n_layer)

    def _done(self, job: Job, kind: str, response: dict, token_gaps: list[float], n_layer: int) -> None:
        model = self.model_name
        timings, made = response["timings"], new_token_count(response)
        self.success.labels(model, response["finish_reason"]).inc()
        self.e2e.labels(model).observe(timings["total_ms"] / 1000)
        self.queue.labels(model).observe(timings["queue_ms"] / 1000)
        self.prefill.labels(model).observe(timings["prefill_ms"] / 1000)
        if timings["first_token_ms"] is not None:
            self.ttft.labels(model).observe(timings["first_token_ms"] / 1000)
        if timings["per_token_ms"] is not None:
            self.tpot.labels(model).observe(timings["per_token_ms"] / 1000)
        itl = self.itl.labels(model)
        for gap in token_gaps:
            itl.observe(gap)
        self.prompt_tokens.labels(model).inc(response["prompt_tokens"])
        self.generation_tokens.labels(model).inc(made)
        self.prompt_sizes.labels(model).observe(response["prompt_tokens"])
        self.generation_sizes.labels(model).observe(made)
        if made:  # a score-only request's blocks per token are per scored position, not per new token
            per_token = response["blocks_per_token"]
            blocks, depth = self.blocks_per_token.labels(kind), self.exit_depth.labels(kind)
            for count, deep in zip(per_token, exit_depths(job.block_set, n_layer, per_token), strict=True):
                blocks.observe(count)
                depth.observe(deep)
        speculation = response.get("speculation")
        if speculation is not None:
            self.drafts.labels(model, kind).inc(speculation["rounds"])
            self.drafted.labels(model, kind).inc(speculation["drafted"])
            self.accepted.labels(model, kind).inc(speculation["accepted"])

    def refused(self, status: int, reason: str) -> None:
        self.shed.labels(str(status), reason).inc()

    def exposition(self) -> Response:
        """The registry in Prometheus' text format (what ``GET /metrics`` answers)."""
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


class _PromptCacheCounts:
    """The workers' prompt-cache counters (``serve.engine.COUNTERS``), read from the pool's stats at
    each scrape: ``blocklab:prefills_copied_total`` (whole prompts),
    ``blocklab:prompt_tokens_copied_total`` (their positions, and those of runs of whole chunks) and
    the gauge ``blocklab:prompt_cache_bytes`` (what the caches hold now; ``serve.prompt_cache``);
    ``blocklab:prefills_in_lane_total``, the prompts prefilled on the prefill lane (``--prefill-lane``)."""

    FAMILIES = (
        (CounterMetricFamily, "blocklab:prefills_copied", "Prompts whose whole prefill was copied.",
         "prefills_copied"),
        (CounterMetricFamily, "blocklab:prompt_tokens_copied", "Prompt positions copied, not computed.",
         "prompt_tokens_copied"),
        (GaugeMetricFamily, "blocklab:prompt_cache_bytes", "Bytes the prompt caches hold.",
         "prompt_cache_bytes"),
        (CounterMetricFamily, "blocklab:prefills_in_lane", "Prompts prefilled beside the decode steps.",
         "prefills_in_lane"),
    )  # fmt: skip

    def __init__(self, counts: Callable[[], dict], model_name: str):
        self.counts = counts
        self.model_name = model_name

    def collect(self):
        counts = self.counts()
        for family_type, name, doc, key in self.FAMILIES:
            family = family_type(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], counts.get(key, 0))
            yield family
