"""The correctness soak: clients that each send a mix of requests until a deadline, and a check of
every answer.

    report = run_load("http://127.0.0.1:8000", clients=6, duration_s=3.0)
    report.problems, report.unanswered, report.latency_ms["all"]["p99"]

The mix covers every model route: ``/predict`` generating (whole and streamed, some also scoring),
``/predict`` scoring only, ``/v1/completions`` and ``/v1/chat/completions`` (whole and streamed),
under the block sets of ``traffic.default_block_sets``, greedy and sampled. Every request carries a
seed unique in the run, and ``/predict`` requests an ``id`` too; both come back in the answer. Every
answer is checked: its status is one of ``accept``, it echoes its own id, seed and block set, it holds
at most ``max_new_tokens`` tokens, a stream ends with its summary (or an explicit error event, never a
silent cut), and a refusal says why (429 with ``Retry-After``). Greedy answers to the same prompt
under the same block set must be the same text whatever batch they ran in. The clients are
``serve.client.closed_loop``'s, and ``/predict`` streams are read by ``serve.client.StreamReader``.
Used by ``tests/test_serve_load.py``, ``tests/test_serve_faults.py``, ``tests/test_serve_fuzz.py`` and
``scripts/load_test.py``.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import numpy as np

from lab.blocks import BlockSet
from lab.measure import latency_ms
from serve.client import BadStream, StreamError, StreamReader, closed_loop
from serve.schema import ended_at_eos, new_token_count
from serve.traffic import default_block_sets, fit_prompt, read_prompts

KINDS = (
    "predict",
    "predict-stream",
    "predict-score",
    "completions",
    "completions-stream",
    "chat",
    "chat-stream",
)
"""The requests of the mix; request n is of kind ``KINDS[n % len(KINDS)]``."""


@dataclass(frozen=True)
class Shot:
    """One planned request."""

    number: int
    kind: str
    path: str
    body: dict
    request_id: str
    seed: int
    block_set: str
    """As the server reports it (``str(BlockSet)``)."""
    max_new_tokens: int
    greedy_key: tuple | None
    """(route family, prompt, block set) for greedy requests: their answers must agree."""

    @property
    def stream(self) -> bool:
        return self.kind.endswith("-stream")


@dataclass
class Outcome:
    """What came back for one shot."""

    shot: Shot
    started_at: float
    """``time.monotonic()`` when it was sent."""
    latency_s: float
    status: int | None
    """None: no HTTP answer within the client's timeout (transport error or timeout)."""
    problem: str | None = None
    """What was wrong with the answer, if anything."""
    echoed_id: str | None = None
    text: str | None = None
    new_tokens: int = 0


@dataclass
class Plan:
    """How requests are drawn: prompts, block sets, sizes."""

    prompts: list[str]
    block_sets: list[str]
    depth: int
    max_new_tokens: int = 8
    seed: int = 0

    def shot(self, number: int) -> Shot:
        draw = random.Random(self.seed * 1_000_003 + number)
        kind = KINDS[number % len(KINDS)]
        prompt_index = draw.randrange(len(self.prompts))
        prompt = self.prompts[prompt_index]
        spec = draw.choice(self.block_sets)
        greedy = draw.random() < 0.5
        request_seed = self.seed * 1_000_000_000 + number
        request_id = f"load-{self.seed}-{number}"
        sampling = {"temperature": 0.0} if greedy else {"temperature": 0.8, "top_k": 40}
        max_new = 0 if kind == "predict-score" else self.max_new_tokens
        stream = kind.endswith("-stream")
        if kind.startswith("predict"):
            path, family = "/predict", "completion"
            body = {
                "id": request_id,
                "prompt": prompt,
                "max_new_tokens": max_new,
                "seed": request_seed,
                "blocks": spec,
                "stream": stream,
                "score": kind == "predict-score" or number % 3 == 0,
                **sampling,
            }
        else:
            path = "/v1/completions" if kind.startswith("completions") else "/v1/chat/completions"
            family = "completion" if kind.startswith("completions") else "chat"
            body = {
                "model": "load",
                "max_tokens": max_new,
                "seed": request_seed,
                "blocks": spec,
                "stream": stream,
                **sampling,
            }
            if family == "chat":
                body["messages"] = [{"role": "user", "content": prompt}]
            else:
                body["prompt"] = prompt
        return Shot(
            number=number,
            kind=kind,
            path=path,
            body=body,
            request_id=request_id,
            seed=request_seed,
            block_set=str(BlockSet.parse(spec, self.depth)),
            max_new_tokens=max_new,
            greedy_key=(family, prompt_index, spec, max_new) if greedy else None,
        )


class BadAnswer(Exception):
    """The answer broke the protocol or did not match its request."""


class SseError(Exception):
    """An OpenAI stream that ended with an error chunk: an answer, with the chunk's code."""

    def __init__(self, status: int, message: str):
        super().__init__(f"error chunk {status}: {message}")
        self.status = status


def _check_echo(shot: Shot, seed: int, block_set: str, new_tokens: int, limit: str) -> None:
    """What every answer echoes against its shot: the seed, the block set, at most the tokens asked."""
    if seed != shot.seed:
        raise BadAnswer(f"seed {seed} came back for {shot.seed}")
    if block_set != shot.block_set:
        raise BadAnswer(f"block set {block_set!r} ran for {shot.block_set!r}")
    if new_tokens > shot.max_new_tokens:
        raise BadAnswer(f"{new_tokens} tokens for {limit} {shot.max_new_tokens}")


def _check_summary(shot: Shot, response: dict) -> tuple[str, int]:
    """``/predict``'s summary against its shot; (text, new tokens)."""
    if response["id"] != shot.request_id:
        raise BadAnswer(f"id {response['id']!r} came back for {shot.request_id!r}")
    _check_echo(shot, response["seed"], response["block_set"], len(response["tokens"]), "max_new_tokens")
    if shot.body["score"] and not np.isfinite(response["score"]["mean_loss"]):
        raise BadAnswer(f"loss {response['score']['mean_loss']}")
    return response["text"], new_token_count(response)


def _check_blocklab(shot: Shot, answer: dict) -> None:
    """The ``blocklab`` object of an OpenAI-route answer against its shot."""
    blocklab = answer["blocklab"]
    new_tokens = len(blocklab["blocks_per_token"])
    _check_echo(shot, blocklab["seed"], blocklab["block_set"], new_tokens, "max_tokens")


async def _read_ndjson(shot: Shot, lines) -> tuple[str, int, str]:
    """A ``/predict`` stream: tokens in order, then the summary. (text, new tokens, echoed id)."""
    reader = StreamReader()
    async for line in lines:
        reader.feed(line)
    response = reader.result()
    text, new_tokens = _check_summary(shot, response.model_dump())
    pieces = "".join(token.text for token in reader.tokens)
    if len(response.tokens) != len(reader.tokens) or not text.startswith(pieces):
        raise BadAnswer(f"{len(reader.tokens)} token events but {len(response.tokens)} tokens in the summary")
    return text, new_tokens, response.id


async def _read_sse(shot: Shot, lines) -> tuple[str, int, str]:
    """An OpenAI stream: chunks, the last with ``blocklab``, then ``[DONE]``. (text, tokens, seed)."""
    text, last = "", None
    async for line in lines:
        if not line:
            continue
        if not line.startswith("data: "):
            raise BadAnswer(f"not an SSE data line: {line[:80]!r}")
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            if last is None or "blocklab" not in last:
                raise BadAnswer("[DONE] without a final chunk")
            _check_blocklab(shot, last)
            eos = ended_at_eos(last["choices"][0])  # end-of-text that ended it had no chunk, but counts
            return text, len(last["blocklab"]["blocks_per_token"]) + eos, str(last["blocklab"]["seed"])
        chunk = json.loads(data)
        if "error" in chunk:
            raise SseError(chunk["error"]["code"], chunk["error"]["message"])
        choice = chunk["choices"][0]
        text += choice["text"] if "text" in choice else choice["delta"]["content"]
        last = chunk
    raise BadAnswer("the stream ended without [DONE]")


def _read_refusal(response: httpx.Response) -> None:
    """A non-200 answer must say why; a 429 also when to come back."""
    body = response.json()
    message = body["error"]["message"] if "error" in body else body["detail"]
    if not message:
        raise BadAnswer(f"{response.status_code} without a message")
    if response.status_code == 429 and "retry-after" not in response.headers:
        raise BadAnswer("429 without Retry-After")


async def _answer(shot: Shot, response: httpx.Response, outcome: Outcome) -> None:
    """Read and check the answer of a 200."""
    if shot.stream:
        reader = _read_ndjson if shot.path == "/predict" else _read_sse
        outcome.text, outcome.new_tokens, outcome.echoed_id = await reader(shot, response.aiter_lines())
        return
    answer = json.loads(await response.aread())
    if shot.path == "/predict":
        outcome.text, outcome.new_tokens = _check_summary(shot, answer)
        outcome.echoed_id = answer["id"]
    else:
        _check_blocklab(shot, answer)
        choice = answer["choices"][0]
        outcome.text = choice["text"] if "text" in choice else choice["message"]["content"]
        outcome.new_tokens = answer["usage"]["completion_tokens"]
        outcome.echoed_id = str(answer["blocklab"]["seed"])


async def send(http: httpx.AsyncClient, shot: Shot, accept: frozenset[int]) -> Outcome:
    """Send one shot and check its answer."""
    started = time.monotonic()
    outcome = Outcome(shot=shot, started_at=started, latency_s=0.0, status=None)
    try:
        async with http.stream("POST", shot.path, json=shot.body) as response:
            outcome.status = response.status_code
            if response.status_code != 200:
                await response.aread()
                _read_refusal(response)
            else:
                await _answer(shot, response, outcome)
            if outcome.status not in accept:
                outcome.problem = f"status {outcome.status}: {response.text[:200]}"
    except (StreamError, SseError) as error:
        outcome.status = error.status
        if error.status not in accept:
            outcome.problem = str(error)
    except httpx.HTTPError as error:
        outcome.status = None
        outcome.problem = f"no answer: {type(error).__name__}: {error}"
    except (BadAnswer, BadStream, json.JSONDecodeError, KeyError, TypeError, IndexError, ValueError) as error:
        outcome.problem = f"{type(error).__name__}: {error}"
    outcome.latency_s = time.monotonic() - started
    return outcome


def _percentiles_ms(latencies: list[float]) -> dict[str, float | int | None]:
    stats = latency_ms(latencies)
    return {"n": stats["n"], **{name: stats[name] for name in ("p50", "p90", "p99", "max")}}


@dataclass
class LoadReport:
    """A load run, summarised; ``outcomes`` holds every request."""

    clients: int
    wall_s: float
    requests: int
    statuses: dict[str, int]
    """Answers by HTTP status; ``none`` for requests that got no answer."""
    unanswered: int
    """Requests without an HTTP answer within the client's timeout: lost."""
    duplicated: int
    """Echoed ids (``id`` or seed) that came back more than once."""
    problems: list[str]
    """Every answer that failed its check (status not accepted, wrong echo, cut stream, ...)."""
    inconsistent: list[str]
    """Greedy requests whose answers differed between runs of the same prompt and block set."""
    latency_ms: dict[str, dict]
    """Of the 200 answers: ``all``, and per kind."""
    requests_per_s: float
    tokens_per_s: float
    server_before: dict | None = None
    """``GET /stats`` before the load (None if the server has no such route)."""
    server_after: dict | None = None
    outcomes: list[Outcome] = field(default_factory=list, repr=False)

    @property
    def errors(self) -> int:
        return len(self.problems) + len(self.inconsistent) + self.duplicated

    def rss_bytes(self, stats: dict | None) -> int | None:
        """Resident memory of the server and its workers together, from one ``/stats``."""
        if stats is None:
            return None
        rss = stats["rss_bytes"]
        values = [rss["server"], *rss["workers"]]
        return None if None in values else sum(values)

    def as_dict(self) -> dict:
        """Everything but the outcomes, for JSON."""
        before, after = self.rss_bytes(self.server_before), self.rss_bytes(self.server_after)
        counters = None
        if self.server_before is not None and self.server_after is not None:
            counters = {
                name: self.server_after[name] - self.server_before[name]
                for name, value in self.server_after.items()
                if isinstance(value, int) and name not in ("in_flight", "max_in_flight")
            }
        return {
            "clients": self.clients,
            "wall_s": round(self.wall_s, 2),
            "requests": self.requests,
            "statuses": self.statuses,
            "unanswered": self.unanswered,
            "duplicated": self.duplicated,
            "problems": len(self.problems),
            "first_problems": self.problems[:5],
            "inconsistent": len(self.inconsistent),
            "latency_ms": self.latency_ms,
            "requests_per_s": self.requests_per_s,
            "tokens_per_s": self.tokens_per_s,
            "rss_before_bytes": before,
            "rss_after_bytes": after,
            "rss_growth_bytes": None if before is None or after is None else after - before,
            "in_flight_after": None if self.server_after is None else self.server_after["in_flight"],
            "server_counters": counters,
        }


def summarize(outcomes: list[Outcome], clients: int, wall_s: float) -> LoadReport:
    statuses = Counter("none" if o.status is None else str(o.status) for o in outcomes)
    echoed = Counter(o.echoed_id for o in outcomes if o.echoed_id is not None)
    answers: dict[tuple, set[str]] = {}
    for outcome in outcomes:
        key = outcome.shot.greedy_key
        if key is not None and outcome.status == 200 and outcome.problem is None:
            answers.setdefault(key, set()).add(outcome.text)
    ok = [o for o in outcomes if o.status == 200 and o.problem is None]
    latency = {"all": _percentiles_ms([o.latency_s for o in ok])}
    for kind in KINDS:
        latency[kind] = _percentiles_ms([o.latency_s for o in ok if o.shot.kind == kind])
    return LoadReport(
        clients=clients,
        wall_s=wall_s,
        requests=len(outcomes),
        statuses=dict(sorted(statuses.items())),
        unanswered=statuses.get("none", 0),
        duplicated=sum(count - 1 for count in echoed.values() if count > 1),
        problems=[f"{o.shot.kind} #{o.shot.number}: {o.problem}" for o in outcomes if o.problem],
        inconsistent=[f"{key}: {len(texts)} texts" for key, texts in answers.items() if len(texts) > 1],
        latency_ms=latency,
        requests_per_s=round(len(ok) / wall_s, 2) if wall_s > 0 else 0.0,
        tokens_per_s=round(sum(o.new_tokens for o in ok) / wall_s, 1) if wall_s > 0 else 0.0,
        outcomes=outcomes,
    )


def make_plan(
    info: dict, *, max_new_tokens: int = 8, prompt_tokens: int = 24, prompts: int = 6, seed: int = 0
) -> Plan:
    """A plan for the model ``GET /info`` describes: paragraphs of the Python docs cut to
    ``prompt_tokens`` (few lengths, so generations batch), its default block sets."""
    model = info["model"]
    room = min(prompt_tokens, model["context_length"] - max_new_tokens)
    texts = [fit_prompt(text, room) for text in read_prompts(None, prompts, seed)]
    return Plan(texts, default_block_sets(model["depth"]), model["depth"], max_new_tokens, seed)


def run_load(
    url: str,
    *,
    clients: int,
    duration_s: float,
    plan: Plan | None = None,
    headers: dict[str, str] | None = None,
    accept: frozenset[int] = frozenset({200}),
    client_timeout_s: float = 30.0,
    refusal_pause_s: float = 0.0,
    stop: threading.Event | None = None,
) -> LoadReport:
    """``clients`` clients, each sending one request after another until ``duration_s`` is up (or
    ``stop`` is set); every answer checked (see the module docstring). Each request gets at most
    ``client_timeout_s``; one without an answer by then counts as unanswered. After an answer other
    than 200 a client pauses ``refusal_pause_s`` (0: it hammers)."""
    return asyncio.run(
        _run_load(url, clients, duration_s, plan, headers, accept, client_timeout_s, refusal_pause_s, stop)
    )


async def _run_load(url, clients, duration_s, plan, headers, accept, client_timeout_s, refusal_pause_s, stop):
    timeout = httpx.Timeout(client_timeout_s, connect=min(client_timeout_s, 10.0))
    limits = httpx.Limits(max_connections=clients + 1, max_keepalive_connections=clients + 1)
    stop = stop or threading.Event()
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout, limits=limits) as http:
        plan = plan or make_plan((await http.get("/info")).raise_for_status().json())
        stats = await http.get("/stats")
        before = stats.json() if stats.status_code == 200 else None

        async def job(number: int) -> Outcome:
            outcome = await send(http, plan.shot(number), accept)
            if outcome.status != 200:
                await asyncio.sleep(refusal_pause_s)
            return outcome

        started = time.monotonic()
        deadline = started + duration_s
        outcomes = await closed_loop(job, clients, stop=lambda: time.monotonic() >= deadline or stop.is_set())
        report = summarize(outcomes, clients, time.monotonic() - started)
        report.server_before = before
        if before is not None:
            report.server_after = (await http.get("/stats")).json()
    return report
