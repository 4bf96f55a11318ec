"""The one client of ``/predict``: a typed reader of its streams, what one request saw, and the load
generator that ``blocklab traffic``, the benchmarks and the tests drive the server with.

    async with httpx.AsyncClient(base_url=url) as http:
        reply = await send(http, {"prompt": "def main(", "max_new_tokens": 8, "stream": True})
        reply.ttft_s, reply.tpot_s, reply.response.text          # a serve.schema.PredictResponse
        replies = await closed_loop(lambda n: send(http, bodies[n]), clients=4, count=len(bodies))
        replies = await open_loop(lambda n: send(http, bodies[n]), arrival_gaps(32, 4.0, 1.0, seed=0))

A stream is NDJSON, one ``serve.schema`` event per line: a ``TokenEvent`` per new token, numbered from
0, then one ``DoneEvent`` with the whole response, or an ``ErrorEvent`` when the request failed after
the stream began. ``StreamReader`` parses each line into its event model and checks that order; a line
that is no event, a token out of turn, anything after the summary or a stream without one raises
``BadStream``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Annotated, TypeVar

import httpx
import numpy as np
from pydantic import Field, TypeAdapter, ValidationError

from serve.schema import DoneEvent, ErrorEvent, PredictResponse, TokenEvent

T = TypeVar("T")
Event = Annotated[TokenEvent | DoneEvent | ErrorEvent, Field(discriminator="event")]
_EVENT = TypeAdapter(Event)


class BadStream(ValueError):
    """A ``/predict`` stream that breaks the protocol."""


class StreamError(Exception):
    """A stream that ended with an ``ErrorEvent``: an answer, with the event's status."""

    def __init__(self, event: ErrorEvent):
        super().__init__(f"{event.status}: {event.message}")
        self.status = event.status


def parse_event(line: str | bytes) -> TokenEvent | DoneEvent | ErrorEvent:
    """One line of a stream as its event model; BadStream if it is none."""
    try:
        return _EVENT.validate_json(line, strict=True)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(map(str, first["loc"])) or "line"
        raise BadStream(f"not a stream event ({where}: {first['msg']}): {str(line)[:120]!r}") from None


class StreamReader:
    """Fed the lines of one stream in order: the token events so far, then the response."""

    def __init__(self) -> None:
        self.tokens: list[TokenEvent] = []
        self.response: PredictResponse | None = None

    def feed(self, line: str) -> TokenEvent | None:
        """The token event of ``line`` (None for a blank line or the summary); StreamError for an
        error event, BadStream for a line out of protocol."""
        if not line.strip():
            return None
        event = parse_event(line)
        if self.response is not None:
            raise BadStream(f"a {event.event} event after the summary")
        if isinstance(event, ErrorEvent):
            raise StreamError(event)
        if isinstance(event, DoneEvent):
            self.response = event.response
            return None
        if event.index != len(self.tokens):
            raise BadStream(f"token event {event.index} after {len(self.tokens)} tokens")
        self.tokens.append(event)
        return event

    def result(self) -> PredictResponse:
        """The summary, once the stream has ended; BadStream if it never came."""
        if self.response is None:
            raise BadStream(f"the stream ended after {len(self.tokens)} tokens without a summary")
        return self.response


# ---------------------------------------------------------------------------------------------------
# One request


@dataclass
class Reply:
    """One ``/predict`` request as the client saw it."""

    body: dict
    """The request sent."""
    latency_s: float
    """From sending to the end of the answer."""
    status: int | None = None
    """The HTTP status, or an error event's; None without an answer (transport error, timeout)."""
    response: PredictResponse | None = None
    error: str | None = None
    """What went wrong, if anything: the server's refusal, an error event, no answer, a broken stream."""
    token_s: list[float] = field(default_factory=list)
    """Seconds from sending to each token event (empty unless streamed)."""

    @property
    def ok(self) -> bool:
        return self.error is None and self.response is not None

    @property
    def ttft_s(self) -> float | None:
        return self.token_s[0] if self.token_s else None

    @property
    def tpot_s(self) -> float | None:
        """Mean gap between tokens after the first."""
        gaps = len(self.token_s) - 1
        return (self.token_s[-1] - self.token_s[0]) / gaps if gaps > 0 else None

    @property
    def itl_s(self) -> list[float]:
        return [later - earlier for earlier, later in zip(self.token_s, self.token_s[1:], strict=False)]


async def send(http: httpx.AsyncClient, body: dict, path: str = "/predict") -> Reply:
    """POST ``body`` and read the answer, streamed if ``body["stream"]``; what went wrong is in the
    reply, never raised."""
    start = time.perf_counter()
    reply = Reply(body=body, latency_s=0.0)
    try:
        async with http.stream("POST", path, json=body) as answer:
            reply.status = answer.status_code
            if answer.status_code != 200:
                text = (await answer.aread()).decode(errors="replace")
                reply.error = f"{answer.status_code}: {text[:300]}"
            elif body.get("stream"):
                reader = StreamReader()
                async for line in answer.aiter_lines():
                    if reader.feed(line) is not None:
                        reply.token_s.append(time.perf_counter() - start)
                reply.response = reader.result()
            else:
                reply.response = PredictResponse.model_validate_json(await answer.aread(), strict=True)
    except StreamError as error:
        reply.status, reply.error = error.status, str(error)
    except (BadStream, ValidationError) as error:
        reply.error = f"{type(error).__name__}: {error}"
    except httpx.HTTPError as error:
        reply.status, reply.error = None, f"{type(error).__name__}: {error}"
    reply.latency_s = time.perf_counter() - start
    return reply


# ---------------------------------------------------------------------------------------------------
# Load


async def closed_loop(
    job: Callable[[int], Awaitable[T]],
    clients: int,
    *,
    count: int | None = None,
    stop: Callable[[], bool] = lambda: False,
) -> list[T]:
    """``clients`` clients, each running its next job when its last one ends: jobs 0, 1, 2, ... (each
    number once) until ``count`` jobs have started or ``stop()`` says so. The results in the order
    the jobs ended."""
    results: list[T] = []
    started = 0

    async def client() -> None:
        nonlocal started
        while (count is None or started < count) and not stop():
            number, started = started, started + 1
            results.append(await job(number))

    await asyncio.gather(*(client() for _ in range(clients)))
    return results


async def open_loop(
    job: Callable[[int], Awaitable[T]], gaps: list[float], *, stop: Callable[[], bool] = lambda: False
) -> list[T]:
    """Job n starts ``sum(gaps[:n+1])`` seconds in, whatever the ones before are doing (arrivals, as
    serving benchmarks send them), until the gaps or ``stop()`` end it; the results in the order the
    jobs ended."""
    results: list[T] = []

    async def run(number: int) -> None:
        results.append(await job(number))

    arrival, tasks = time.perf_counter(), []
    for number, gap in enumerate(gaps):
        arrival += gap
        await asyncio.sleep(max(0.0, arrival - time.perf_counter()))
        if stop():
            break
        tasks.append(asyncio.create_task(run(number)))
    await asyncio.gather(*tasks)
    return results


def arrival_gaps(count: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds between ``count`` arrivals at ``rate`` per second: gamma-distributed with shape
    ``burstiness`` (1: Poisson arrivals, exponential gaps), as vLLM's ``bench serve`` draws them."""
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=count).tolist()
