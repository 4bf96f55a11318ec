"""serve.client: the stream reader takes serve.schema's events in order and refuses anything else; a
request's reply says what went wrong instead of raising; the closed and open loops send every job once."""

import asyncio
import json

import httpx
import pytest

from serve.client import BadStream, StreamError, StreamReader, closed_loop, open_loop, parse_event, send
from serve.schema import DoneEvent, TokenEvent
from tests.tiny import predict_response


def token(index: int, text: str = "a") -> str:
    return TokenEvent(index=index, token=index, text=text, blocks=3).model_dump_json()


def done(tokens: int = 2) -> str:
    return DoneEvent(response=predict_response(tokens)).model_dump_json()


def test_events_parse_into_the_schemas_models():
    assert parse_event(token(0)).index == 0
    assert parse_event(done()).response.mean_blocks_per_token == 3.0
    error = parse_event('{"event": "error", "status": 503, "message": "worker died"}')
    assert error.status == 503 and error.message == "worker died"
    for line, what in [
        ("not json", "line"),
        ('{"event": "tokens", "index": 0}', "line: Input tag 'tokens'"),
        ('{"event": "token", "index": "0", "token": 1, "text": "a", "blocks": 3}', "token.index"),
        ('{"event": "token", "index": 0, "token": 1, "text": "a", "blocks": 3, "extra": 1}', "token.extra"),
        ('{"event": "done", "response": {"text": "a"}}', "done.response"),
    ]:
        with pytest.raises(BadStream, match=f"not a stream event \\({what}"):
            parse_event(line)


def test_the_reader_checks_the_order_of_a_stream():
    reader = StreamReader()
    assert [reader.feed(line) for line in (token(0), "", token(1))][1] is None
    assert reader.feed(done()) is None and reader.result().tokens == [0, 1] and len(reader.tokens) == 2
    with pytest.raises(BadStream, match="a token event after the summary"):
        reader.feed(token(2))
    with pytest.raises(BadStream, match="token event 1 after 0 tokens"):
        StreamReader().feed(token(1))
    cut = StreamReader()
    cut.feed(token(0))
    with pytest.raises(BadStream, match="ended after 1 tokens without a summary"):
        cut.result()
    with pytest.raises(StreamError, match="503: worker died") as error:
        StreamReader().feed('{"event": "error", "status": 503, "message": "worker died"}')
    assert error.value.status == 503


def _server(request: httpx.Request) -> httpx.Response:
    """/predict by the prompt: 'ok' streams, 'whole' answers at once, 'refuse' 429, 'cut' breaks off,
    'fail' ends with an error event, 'garbage' answers what is no response."""
    prompt = json.loads(request.content)["prompt"]
    lines = {
        "ok": [token(0), token(1), done()],
        "cut": [token(0)],
        "fail": [token(0), '{"event": "error", "status": 500, "message": "boom"}'],
    }
    if prompt == "refuse":
        return httpx.Response(429, json={"detail": "busy"})
    if prompt == "whole":
        return httpx.Response(200, content=predict_response(3).model_dump_json())
    if prompt == "garbage":
        return httpx.Response(200, json={"text": "a"})
    return httpx.Response(200, content="".join(line + "\n" for line in lines[prompt]))


def _send_all(prompts: list[str]) -> list:
    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(_server), base_url="http://test") as http:
            return [await send(http, {"prompt": p, "stream": p not in ("whole", "garbage")}) for p in prompts]

    return asyncio.run(run())


def test_a_reply_says_what_came_back_and_what_went_wrong():
    ok, whole, refused, cut, failed, garbage = _send_all(["ok", "whole", "refuse", "cut", "fail", "garbage"])
    assert ok.ok and ok.status == 200 and len(ok.token_s) == 2 and ok.response.score.mean_loss == 2.5
    assert 0 <= ok.ttft_s <= ok.token_s[1] <= ok.latency_s and ok.tpot_s == pytest.approx(ok.itl_s[0])
    assert whole.ok and whole.token_s == [] and whole.ttft_s is None and len(whole.response.tokens) == 3
    assert not refused.ok and refused.status == 429 and refused.error.startswith("429: ")
    assert not cut.ok and "without a summary" in cut.error
    assert not failed.ok and failed.status == 500 and failed.error == "500: boom"
    assert not garbage.ok and garbage.error.startswith("ValidationError")


def test_closed_loop_runs_each_job_once_with_at_most_its_clients_at_a_time():
    running, most, seen = 0, 0, []

    async def job(number: int) -> int:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(0.001)
        running -= 1
        seen.append(number)
        return number * 10

    results = asyncio.run(closed_loop(job, clients=3, count=10))
    assert sorted(results) == [n * 10 for n in range(10)] and sorted(seen) == list(range(10)) and most == 3
    stopped = asyncio.run(closed_loop(job, clients=2, stop=lambda: len(seen) >= 14))
    assert 4 <= len(stopped) <= 5  # stop() is asked before each job: the two clients' last ones finish


def test_open_loop_starts_every_job_on_its_arrival():
    async def job(number: int) -> int:
        return number

    assert sorted(asyncio.run(open_loop(job, [0.0, 0.001, 0.001]))) == [0, 1, 2]
    assert asyncio.run(open_loop(job, [0.0] * 5, stop=lambda: True)) == []
